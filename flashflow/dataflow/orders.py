"""Tile orders: the sequence in which a GEMM's output tiles are issued.

An order is a list of ``(m, n)`` tile coordinates; ``m`` indexes row-blocks of C (and A's
row-panels), ``n`` column-blocks (B's column-panels). A GPU launch issues program ids in
increasing order, so a kernel that maps program id ``pid`` to ``order[pid]`` runs this order
(see :func:`to_permutation`).
"""
from __future__ import annotations

from typing import Callable, Iterable

from flashflow.device import cdiv

Tile = tuple[int, int]


def row_major(tiles_m: int, tiles_n: int) -> list[Tile]:
    return [(m, n) for m in range(tiles_m) for n in range(tiles_n)]


def column_major(tiles_m: int, tiles_n: int) -> list[Tile]:
    return [(m, n) for n in range(tiles_n) for m in range(tiles_m)]


def snake(tiles_m: int, tiles_n: int) -> list[Tile]:
    """Row-major with every other row reversed: the end of one row and the start of the next
    share a B column-panel."""
    out = []
    for m in range(tiles_m):
        cols = range(tiles_n) if m % 2 == 0 else range(tiles_n - 1, -1, -1)
        out.extend((m, n) for n in cols)
    return out


def grouped_m(tiles_m: int, tiles_n: int, group: int = 8) -> list[Tile]:
    """Triton's GROUP_SIZE_M ordering (the matmul tutorial's program-id remap): strips of
    ``group`` row-blocks, walked column by column, m fastest inside a strip."""
    if group <= 0:
        raise ValueError(f"group must be positive, got {group!r}")
    out = []
    per_group = group * tiles_n
    for pid in range(tiles_m * tiles_n):
        first_m = (pid // per_group) * group
        size = min(tiles_m - first_m, group)
        local = pid % per_group
        out.append((first_m + local % size, local // size))
    return out


def cutlass_swizzle(tiles_m: int, tiles_n: int, width: int = 4) -> list[Tile]:
    """CUTLASS's identity threadblock swizzle of log-tile ``log2(width)``: the launch grid is
    (tiles_m·width, ceil(tiles_n/width)) and block (x, y) computes tile
    (x // width, y·width + x % width). Blocks dispatch x-fastest, so the order walks strips of
    ``width`` column-blocks, row-major inside a strip: Triton's grouping turned on its side."""
    if width <= 0:
        raise ValueError(f"width must be positive, got {width!r}")
    out = []
    for y in range(cdiv(tiles_n, width)):
        for x in range(tiles_m * width):
            n = y * width + x % width
            if n < tiles_n:
                out.append((x // width, n))
    return out


def _hilbert_d2xy(order: int, d: int) -> Tile:
    """Point d of the Hilbert curve filling a 2**order square (the classic rotate-and-flip
    construction)."""
    x = y = 0
    s = 1
    t = d
    while s < (1 << order):
        rx = 1 & (t // 2)
        ry = 1 & (t ^ rx)
        if ry == 0:
            if rx == 1:
                x, y = s - 1 - x, s - 1 - y
            x, y = y, x
        x += s * rx
        y += s * ry
        t //= 4
        s *= 2
    return x, y


def hilbert(tiles_m: int, tiles_n: int) -> list[Tile]:
    """Hilbert curve over the enclosing power-of-two square, cells outside the grid dropped
    (on non-square or non-power-of-two grids the curve then jumps across the gaps)."""
    order = max(tiles_m - 1, tiles_n - 1, 1).bit_length()
    out = []
    for d in range(1 << (2 * order)):
        m, n = _hilbert_d2xy(order, d)
        if m < tiles_m and n < tiles_n:
            out.append((m, n))
    return out


def _interleave_bits(m: int, n: int) -> int:
    z = 0
    for bit in range(max(m, n).bit_length()):
        z |= ((m >> bit) & 1) << (2 * bit + 1) | ((n >> bit) & 1) << (2 * bit)
    return z


def morton(tiles_m: int, tiles_n: int) -> list[Tile]:
    """Z-order (Morton): tiles sorted by the interleaved bits of (m, n)."""
    return sorted(row_major(tiles_m, tiles_n), key=lambda t: _interleave_bits(*t))


# name -> (function, name of its integer parameter or None, default value)
NAMED_ORDERS: dict[str, tuple[Callable[..., list[Tile]], str | None, int | None]] = {
    "row_major": (row_major, None, None),
    "column_major": (column_major, None, None),
    "snake": (snake, None, None),
    "grouped_m": (grouped_m, "group", 8),
    "cutlass_swizzle": (cutlass_swizzle, "width", 4),
    "hilbert": (hilbert, None, None),
    "morton": (morton, None, None),
}


def make_order(spec: str, tiles_m: int, tiles_n: int) -> list[Tile]:
    """Build a named order. ``spec`` is a name from NAMED_ORDERS, optionally with its integer
    parameter after a colon: ``"grouped_m:4"``, ``"cutlass_swizzle:2"``."""
    name, _, arg = spec.partition(":")
    if name not in NAMED_ORDERS:
        raise ValueError(f"order must be one of {sorted(NAMED_ORDERS)} (optionally NAME:INT), "
                         f"got {spec!r}")
    fn, param, default = NAMED_ORDERS[name]
    if param is None:
        if arg:
            raise ValueError(f"order {name!r} takes no parameter, got {spec!r}")
        return fn(tiles_m, tiles_n)
    try:
        value = int(arg) if arg else default
    except ValueError:
        raise ValueError(f"order parameter must be an int, got {spec!r}") from None
    return fn(tiles_m, tiles_n, value)


def default_specs(tiles_m: int, tiles_n: int) -> list[str]:
    """The named orders a comparison table shows, with group sizes that fit the grid."""
    specs = ["row_major", "column_major", "snake"]
    for g in (2, 4, 8, 16):
        if g < tiles_m:
            specs.append(f"grouped_m:{g}")
    for w in (2, 4, 8):
        if w < tiles_n:
            specs.append(f"cutlass_swizzle:{w}")
    return specs + ["hilbert", "morton"]


def validate(order: Iterable, tiles_m: int, tiles_n: int, complete: bool = False) -> list[Tile]:
    """Check that ``order`` lists distinct in-range tiles (all of them if ``complete``)."""
    out: list[Tile] = []
    seen = set()
    for item in order:
        try:
            m, n = (int(v) for v in item)
        except (TypeError, ValueError):
            raise ValueError(f"order entries must be (m, n) pairs, got {item!r}") from None
        if not (0 <= m < tiles_m and 0 <= n < tiles_n):
            raise ValueError(f"tile {(m, n)} is outside the {tiles_m}x{tiles_n} grid")
        if (m, n) in seen:
            raise ValueError(f"tile {(m, n)} appears twice in the order")
        seen.add((m, n))
        out.append((m, n))
    if complete and len(out) != tiles_m * tiles_n:
        raise ValueError(f"order has {len(out)} tiles, the grid has {tiles_m * tiles_n}")
    return out


def to_permutation(order: Iterable[Tile], tiles_n: int) -> list[int]:
    """Program id -> linear tile index ``m * tiles_n + n``: what a kernel reads to run the order."""
    return [m * tiles_n + n for m, n in order]


def from_permutation(perm: Iterable[int], tiles_m: int, tiles_n: int) -> list[Tile]:
    """Inverse of :func:`to_permutation`; checks that ``perm`` is a permutation of the grid."""
    order = []
    for t in perm:
        t = int(t)
        if not 0 <= t < tiles_m * tiles_n:
            raise ValueError(f"tile index {t} is outside a grid of {tiles_m * tiles_n} tiles")
        order.append((t // tiles_n, t % tiles_n))
    return validate(order, tiles_m, tiles_n, complete=True)
