"""The fused FFN's configs: what ``fused_mlp`` runs, per GPU family, read from ``mlp.json``.

Three tables, each a list of entries per family (``"sm90"``, ``"sm80"``, ``"interpreter"``);
the first entry whose match keys all hold wins:

* ``"plan"`` — what ``policy="auto"`` runs: ``"splitk"`` (the decode kernel), a persistent-kernel
  tile order (``"seqsplit:8"``, ``"multirow:8"``, …) or ``"cublas"`` (``F.linear``, the
  activation, ``F.linear``);
* ``"splitk"`` — the decode kernel's :class:`SplitKConfig`;
* ``"persistent"`` — the prefill kernel's :class:`PersistentConfig`.

Match keys: ``gated`` (SwiGLU or not), ``slice`` (the split-K slice width, :func:`slice_width`:
how wide the intermediate is against the SM count, 64 for Llama-3-8B and 128 for Llama-3-70B
on an H100), ``m_max`` (the entry holds for M ≤ m_max tokens) and ``dtype``. A key an entry
leaves out matches anything; keys starting with ``_`` are notes (why, and the measurement
file). ``"_rejected"`` lists the options that were measured and lost, one line each.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from flashflow.device import cdiv, next_pow2

FAMILIES = ("sm90", "sm80", "interpreter")
_MATCH_KEYS = ("gated", "slice", "m_max", "dtype")


@dataclass(frozen=True)
class SplitKConfig:
    """The decode kernel (``flashflow.kernels.mlp_splitk``): one program per ``BLOCK_I`` slice
    of the intermediate."""
    BLOCK_I: int        # intermediate columns per program
    BLOCK_K: int        # GEMM0 step over hidden
    BLOCK_N: int        # GEMM1 step over hidden (output columns)
    num_warps: int = 4
    num_stages: int = 3
    stagger: int = 2    # rotate each program's loop start by its id (0 none, 1 output loop, 2 both)
    pdl: bool = True    # the cast launch programmatically dependent on the main one (sm90+)
    group: int = 0      # 0, or a power of two ≥ 2: that many slices' partials summed on chip
                        # before the atomic adds (mlp_splitk_grouped_kernel; h goes through L2)

    def __post_init__(self):
        if self.group and (self.group < 2 or self.group & (self.group - 1)):
            raise ValueError(f"SplitKConfig.group must be 0 (off) or a power of two ≥ 2 (slices per group), "
                             f"got {self.group}")


@dataclass(frozen=True)
class PersistentConfig:
    """The prefill kernel (``flashflow.kernels.mlp.mlp_persistent_kernel``), one program per SM."""
    BLOCK_M: int
    BLOCK_N0: int       # intermediate columns per GEMM0 tile (gate and up each, when gated)
    BLOCK_N1: int       # output columns per GEMM1 tile
    BLOCK_K: int
    num_warps: int = 8
    num_stages: int = 3
    use_tma: bool = False   # host TMA descriptors for x, W1, H, W_down (sm90+, fp16/bf16)


@functools.lru_cache(maxsize=None)
def table() -> dict:
    """``mlp.json``, parsed once."""
    with open(Path(__file__).with_name("mlp.json")) as f:
        return json.load(f)


def slice_width(inter: int, sms: int) -> int:
    """Intermediate columns per split-K program: about two programs per SM, all resident at
    once, a power of two in [16, 128]."""
    return max(16, min(128, next_pow2(cdiv(inter, 2 * sms))))


def _lookup(kind: str, family: str, **keys) -> dict:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    for entry in table()[kind][family]:
        if all(k not in entry or _holds(k, entry[k], keys.get(k)) for k in _MATCH_KEYS):
            return entry
    raise LookupError(f"mlp.json has no {kind!r} entry of {family} for {keys}")


def _holds(key, want, got) -> bool:
    if key == "m_max":
        return got is not None and got <= want
    return got == want


def _build(cls, entry: dict, **defaults):
    return cls(**{f.name: entry.get(f.name, defaults.get(f.name)) for f in fields(cls)
                  if f.name in entry or f.name in defaults})


def splitk_config(family: str, gated: bool, m: int, inter: int, sms: int) -> SplitKConfig:
    """The decode kernel's config for M = ``m`` tokens; ``BLOCK_I`` is :func:`slice_width`
    unless the entry names one."""
    width = slice_width(inter, sms)
    entry = _lookup("splitk", family, gated=gated, slice=width, m_max=m)
    return _build(SplitKConfig, entry, BLOCK_I=width)


def persistent_config(family: str, gated: bool, m: Optional[int] = None, dtype: Optional[str] = None
                      ) -> PersistentConfig:
    """The prefill kernel's config for M = ``m`` tokens (None: the large-M entry) and the
    inputs' dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``)."""
    entry = _lookup("persistent", family, gated=gated, m_max=m, dtype=dtype)
    return _build(PersistentConfig, entry)


def auto_plan(family: str, gated: bool, m: int, inter: int, sms: int) -> str:
    """What ``policy="auto"`` runs for M = ``m``: ``"splitk"``, ``"cublas"`` or a tile order."""
    return _lookup("plan", family, gated=gated, slice=slice_width(inter, sms), m_max=m)["plan"]
