"""The FP8 linear layer's GEMM config per GPU family (:mod:`flashflow.ops.fp8_linear`). The
numbers are in ``fp8_linear.json`` beside this module; :func:`fp8_linear_config` is the one lookup.

``fast_accum``: ``torch._scaled_mm``'s ``use_fast_accum``. False: the FP8 MMAs' partial sums are
promoted into an fp32 accumulator as cuBLASLt does by default (the FP8 tensor cores' own
accumulator keeps fewer bits); True: they accumulate in the MMA throughout. A shape cuBLASLt
refuses with fast accumulation and a bias keeps fast accumulation and gets its bias after the
GEMM (:func:`flashflow.ops.fp8_linear._gemm_impl`).

``rows_max`` and the tiles after it: a call of at most ``rows_max`` rows (``BLOCK_M``) runs
:func:`flashflow.kernels.fp8_linear.fp8_weight_rows_kernel` on its unquantized rows instead of
quantizing them for cuBLASLt (0: never)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from flashflow.tuning import Config, ConfigTable

TABLE = "fp8_linear"


@dataclass(frozen=True)
class Fp8LinearConfig(Config):
    fast_accum: bool = False
    rows_max: int = 16
    BLOCK_N: int = 32
    BLOCK_K: int = 256
    num_warps: int = 4
    num_stages: int = 4


CONFIGS = ConfigTable(TABLE, Fp8LinearConfig, keys=(), what="FP8 linear")


@functools.lru_cache(maxsize=None)
def fp8_linear_config(family: str) -> Fp8LinearConfig:
    """The shipped config on ``family`` (:func:`flashflow.device.gpu_family`)."""
    return CONFIGS.config(family)
