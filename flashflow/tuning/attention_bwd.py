"""The attention backward's config: query and key tiles, warps, stages per GPU family. The
numbers are in ``attention_bwd.json`` beside this module; :func:`attention_bwd_config` is the one
lookup. ``interpreter`` is Triton's CPU interpreter."""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace

from flashflow.tuning import families, table

TABLE = "attention_bwd"


@dataclass(frozen=True)
class AttentionBwdConfig:
    BLOCK_M1: int     # dK/dV kernel: queries streamed per step
    BLOCK_N1: int     # dK/dV kernel: the program's block of keys
    num_warps1: int
    num_stages1: int
    BLOCK_M2: int     # dQ kernel: the program's block of queries
    BLOCK_N2: int     # dQ kernel: keys streamed per step
    num_warps2: int
    num_stages2: int

    def replace(self, **kw) -> "AttentionBwdConfig":
        return replace(self, **kw)

    def as_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=None)
def attention_bwd_config(head_dim_pad: int, family: str) -> AttentionBwdConfig:
    """The shipped config for a padded ``head_dim`` on ``family`` (:func:`flashflow.device.gpu_family`):
    the first entry of ``attention_bwd.json`` whose ``head_dim_max`` covers it."""
    if family not in families(TABLE):
        raise ValueError(f"no attention backward configs for GPU family {family!r}; known: "
                         f"{', '.join(families(TABLE))}")
    for entry in table(TABLE)[family]:
        if head_dim_pad <= entry["head_dim_max"]:
            return AttentionBwdConfig(**{k: entry[k] for k in AttentionBwdConfig.__dataclass_fields__})
    raise ValueError(f"no attention backward config for head_dim {head_dim_pad} on {family}")
