"""The FP8 attention forward's config: tiles, warps, stages per GPU family. The numbers are in
``attention_fp8.json`` beside this module; :func:`attention_fp8_config` is the one lookup.

FP8 tensor cores are Hopper's (sm90) and later: there is no sm80 entry, and the op refuses
other GPUs with an error that says so. ``interpreter`` is Triton's CPU interpreter."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from flashflow.tuning import Config, ConfigTable

TABLE = "attention_fp8"


@dataclass(frozen=True)
class AttentionFp8Config(Config):
    BLOCK_M: int
    BLOCK_N: int          # also the key block of K's quantization scale
    num_warps: int
    num_stages: int
    warp_specialize: bool = False
    pv_fp32_sum: bool = True   # P·V of each key block summed in fp32 outside the MMA
    maxnreg: Optional[int] = None   # registers a thread is capped at (more CTAs an SM), None: ptxas's choice


CONFIGS = ConfigTable(TABLE, AttentionFp8Config, keys=("head_dim", "causal"), what="FP8 attention")


def supported_families() -> list[str]:
    return CONFIGS.families()


@functools.lru_cache(maxsize=None)
def attention_fp8_config(head_dim: int, causal: bool, family: str) -> AttentionFp8Config:
    """The shipped config for ``head_dim``, causal or not, on ``family``
    (:func:`flashflow.device.gpu_family`); the first matching entry of ``attention_fp8.json``."""
    return CONFIGS.config(family, head_dim=head_dim, causal=causal)
