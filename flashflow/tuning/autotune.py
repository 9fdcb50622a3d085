"""Optional autotuning of the attention forward config (``FLASHFLOW_AUTOTUNE=1``).

The shipped tables in this folder are the default. With autotuning on, the first call of each
shape class (GPU, dtype, padded head_dim, causal, seqlen bucket) times a few candidate configs
around the table's entry on the call's own inputs and keeps the fastest for the rest of the
process. The cache below is one of the few global states docs/DESIGN.md allows.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Iterable

from flashflow.tuning.attention import AttentionConfig

log = logging.getLogger(__name__)

_CACHE: dict[tuple, AttentionConfig] = {}


def enabled() -> bool:
    return os.environ.get("FLASHFLOW_AUTOTUNE", "0") not in ("", "0")


def seqlen_bucket(seqlen: int) -> int:
    """Power-of-two bucket: configs that win at 4k also win at 5k, not necessarily at 512."""
    return 1 << max(int(seqlen) - 1, 0).bit_length()


def candidates(base: AttentionConfig) -> list[AttentionConfig]:
    """The table's entry and its neighbours in the knobs that mattered in the H100 sweeps."""
    out = [base]
    for change in ({"num_stages": max(2, base.num_stages - 1)}, {"warp_specialize": not base.warp_specialize},
                   {"BLOCK_N": max(32, base.BLOCK_N // 2), "num_stages": base.num_stages + 1},
                   {"maxnreg": 240} if base.num_warps == 8 else {"num_warps": 8}):
        cand = base.replace(**change)
        if cand not in out:
            out.append(cand)
    return out


def pick(key: tuple, cands: Iterable[AttentionConfig], time_ms: Callable[[AttentionConfig], float]) -> AttentionConfig:
    """Fastest candidate for ``key`` (timed once, then cached). Failing candidates are skipped."""
    if key in _CACHE:
        return _CACHE[key]
    best, best_t = None, float("inf")
    for cfg in cands:
        try:
            t = time_ms(cfg)
        except Exception as e:  # noqa: BLE001 — e.g. out of shared memory for this shape
            log.info("autotune: %s failed: %s", cfg, e)
            continue
        log.info("autotune %s: %s %.3f ms", key, cfg, t)
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        raise RuntimeError(f"autotune: every candidate config failed for {key}")
    _CACHE[key] = best
    return best


def clear() -> None:
    _CACHE.clear()
