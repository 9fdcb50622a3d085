"""The FP8 attention forward's config: tiles, warps, stages per GPU family. The numbers are in
``attention_fp8.json`` beside this module; :func:`attention_fp8_config` is the one lookup.

FP8 tensor cores are Hopper's (sm90) and later: there is no sm80 entry, and the op refuses
other GPUs with an error that says so. ``interpreter`` is Triton's CPU interpreter."""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace

from flashflow.tuning import families, table

TABLE = "attention_fp8"


@dataclass(frozen=True)
class AttentionFp8Config:
    BLOCK_M: int
    BLOCK_N: int          # also the key block of K's quantization scale
    num_warps: int
    num_stages: int
    warp_specialize: bool = False
    pv_fp32_sum: bool = True   # P·V of each key block summed in fp32 outside the MMA

    def replace(self, **kw) -> "AttentionFp8Config":
        return replace(self, **kw)

    def as_dict(self) -> dict:
        return asdict(self)


def supported_families() -> list[str]:
    return families(TABLE)


@functools.lru_cache(maxsize=None)
def attention_fp8_config(head_dim: int, causal: bool, family: str) -> AttentionFp8Config:
    """The shipped config for ``head_dim``, causal or not, on ``family``
    (:func:`flashflow.device.gpu_family`); the first matching entry of ``attention_fp8.json``."""
    if family not in families(TABLE):
        raise ValueError(f"no FP8 attention configs for GPU family {family!r}; known: {', '.join(families(TABLE))}")
    for entry in table(TABLE)[family]:
        if head_dim <= entry["head_dim_max"] and entry["causal"] in (None, causal):
            return AttentionFp8Config(**{k: entry[k] for k in AttentionFp8Config.__dataclass_fields__ if k in entry})
    raise ValueError(f"no FP8 attention config for head_dim {head_dim} on {family}")
