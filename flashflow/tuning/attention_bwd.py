"""The attention backward's config: query and key tiles, warps, stages per GPU family, and its
launch rule (:data:`DELTA_ROWS`). The numbers are in ``attention_bwd.json`` beside this module;
:func:`attention_bwd_config` is the one lookup. ``interpreter`` is Triton's CPU interpreter."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from flashflow.tuning import Config, ConfigTable

TABLE = "attention_bwd"

DELTA_ROWS = 64   # rows per program of the δ kernel (a streaming row reduction; backwards without dQ)


@dataclass(frozen=True)
class AttentionBwdConfig(Config):
    BLOCK_M1: int     # dK/dV kernel: queries streamed per step
    BLOCK_N1: int     # dK/dV kernel: the program's block of keys
    num_warps1: int
    num_stages1: int
    BLOCK_M2: int     # dQ kernel: the program's block of queries
    BLOCK_N2: int     # dQ kernel: keys streamed per step
    num_warps2: int
    num_stages2: int


CONFIGS = ConfigTable(TABLE, AttentionBwdConfig, keys=("head_dim",), what="attention backward")


@functools.lru_cache(maxsize=None)
def attention_bwd_config(head_dim_pad: int, family: str) -> AttentionBwdConfig:
    """The shipped config for a padded ``head_dim`` on ``family`` (:func:`flashflow.device.gpu_family`):
    the first entry of ``attention_bwd.json`` whose ``head_dim_max`` covers it."""
    return CONFIGS.config(family, head_dim=head_dim_pad)
