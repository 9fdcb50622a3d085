"""Comparing the model's bytes with measured ones: rank correlation and ordered pairs."""
from __future__ import annotations

from typing import Sequence


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 1, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks, so ties (the unified
    model often gives orders equal bytes) are handled exactly. nan if either side is constant."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need two sequences of equal length >= 2, got {len(x)} and {len(y)}")
    rx, ry = ranks(x), ranks(y)
    n = len(x)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx and vy else float("nan")


def separated_pairs(model: Sequence[float], measured: Sequence[float],
                    margin: float = 0.10) -> tuple[int, int]:
    """(pairs the model orders as measured, pairs) over the pairs whose measured bytes differ
    by more than ``margin``. Closer pairs are within what one profiled launch and unmodelled
    effects (DRAM pages, prefetch) can swap, so a rank correlation alone over-weights them."""
    right = total = 0
    for i in range(len(measured)):
        for j in range(i + 1, len(measured)):
            lo, hi = sorted((measured[i], measured[j]))
            if hi <= lo * (1 + margin):
                continue
            total += 1
            right += (model[i] - model[j]) * (measured[i] - measured[j]) > 0
    return right, total
