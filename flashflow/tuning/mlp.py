"""The fused FFN's configs: what ``fused_mlp`` runs, per GPU family, read from ``mlp.json``, and
its launch rules (:func:`slice_width`, :func:`chunk_n`).

Three tables, each a list of entries per family (``"sm90"``, ``"sm80"``, ``"interpreter"``),
matched by :mod:`flashflow.tuning`'s one rule (the first entry that holds wins):

* ``"plan"`` — what ``policy="auto"`` runs: ``"splitk"`` (the decode kernel), a persistent-kernel
  tile order (``"seqsplit:8"``, ``"multirow:8"``, …) or ``"cublas"`` (``F.linear``, the
  activation, ``F.linear``);
* ``"splitk"`` — the decode kernel's :class:`SplitKConfig`;
* ``"persistent"`` — the prefill kernel's :class:`PersistentConfig`.

Match keys: ``gated`` (SwiGLU or not), ``slice`` (the split-K slice width, :func:`slice_width`:
how wide the intermediate is against the SM count, 64 for Llama-3-8B and 128 for Llama-3-70B
on an H100), ``m_max`` (the entry holds for M ≤ m_max tokens) and ``dtype``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from flashflow.device import cdiv, next_pow2
from flashflow.tuning import Config, ConfigTable, table as _table

TABLE = "mlp"


@dataclass(frozen=True)
class SplitKConfig(Config):
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
class PersistentConfig(Config):
    """The prefill kernel (``flashflow.kernels.mlp.mlp_persistent_kernel``), one program per SM."""
    BLOCK_M: int
    BLOCK_N0: int       # intermediate columns per GEMM0 tile (gate and up each, when gated)
    BLOCK_N1: int       # output columns per GEMM1 tile
    BLOCK_K: int
    num_warps: int = 8
    num_stages: int = 3
    use_tma: bool = False   # host TMA descriptors for x, W1, H, W_down (sm90+, fp16/bf16)


@dataclass(frozen=True)
class Plan(Config):
    """What ``policy="auto"`` runs (a ``"plan"`` entry)."""
    plan: str


PLANS = ConfigTable(TABLE, Plan, keys=("gated", "slice", "m"), what="mlp plan", kind="plan")
SPLITK = ConfigTable(TABLE, SplitKConfig, keys=("gated", "slice", "m"), what="mlp splitk", kind="splitk",
                     supplied=(("BLOCK_I", 64),))
PERSISTENT = ConfigTable(TABLE, PersistentConfig, keys=("gated", "m", "dtype"), what="mlp persistent",
                         kind="persistent")
FAMILIES = tuple(PLANS.families())


def table() -> dict:
    """``mlp.json``, parsed once."""
    return _table(TABLE)


def slice_width(inter: int, sms: int) -> int:
    """Intermediate columns per split-K program: about two programs per SM, all resident at
    once, a power of two in [16, 128]."""
    return max(16, min(128, next_pow2(cdiv(inter, 2 * sms))))


def chunk_n(hidden: int, group: int, block_n: int) -> int:
    """Output columns per GEMM1 item of the grouped split-K kernel: about ``group`` items per
    group (as many items as slices), of whole ``block_n`` steps."""
    return cdiv(cdiv(hidden, group), block_n) * block_n


@functools.lru_cache(maxsize=4096)
def splitk_rows(m: int) -> int:
    """The split-K kernels' row tile for M = ``m`` tokens: all of them, padded to a power of two
    of at least 16 (the tensor cores' smallest M)."""
    return max(16, next_pow2(m))


def grouped_programs(n_slices: int, sms: int) -> int:
    """Programs of the grouped split-K kernel: one per slice, at most two per SM (it loops over
    the slices; more programs would only wait on the group counters)."""
    return min(n_slices, 2 * sms)


def splitk_config(family: str, gated: bool, m: int, inter: int, sms: int) -> SplitKConfig:
    """The decode kernel's config for M = ``m`` tokens; ``BLOCK_I`` is :func:`slice_width`
    unless the entry names one."""
    width = slice_width(inter, sms)
    return SPLITK.config(family, {"BLOCK_I": width}, gated=gated, slice=width, m=m)


@functools.lru_cache(maxsize=4096)
def persistent_config(family: str, gated: bool, m: Optional[int] = None, dtype: Optional[str] = None
                      ) -> PersistentConfig:
    """The prefill kernel's config for M = ``m`` tokens (None: the large-M entry) and the
    inputs' dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``)."""
    return PERSISTENT.config(family, gated=gated, m=m, dtype=dtype)


@functools.lru_cache(maxsize=4096)
def auto_plan(family: str, gated: bool, m: int, inter: int, sms: int) -> str:
    """What ``policy="auto"`` runs for M = ``m``: ``"splitk"``, ``"cublas"`` or a tile order."""
    return PLANS.config(family, gated=gated, slice=slice_width(inter, sms), m=m).plan
