"""The decode-layer megakernel's config: task tile sizes, warps and stages per GPU family, and
its launch rule (the grid, :func:`num_programs`). The numbers are in ``decode_layer.json``
beside this module; :func:`decode_layer_config` is the one lookup."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from flashflow.tuning import Config, ConfigTable

TABLE = "decode_layer"


@dataclass(frozen=True)
class DecodeLayerConfig(Config):
    QKV_PAIRS: int    # rotary pairs (channels i, i + d/2) of one q/k/v head per QKV task
    BLOCK_N: int      # output columns per O-projection and down-projection task
    BLOCK_I: int      # intermediate columns per gate/up task
    BLOCK_K: int      # K chunk of every GEMV task
    BLOCK_KV: int     # cached keys per attention tile
    num_warps: int
    num_stages: int
    SPLIT_K: int = 1  # K slices per O / down column block (their partials merged by the last slice)
    GEMV_STAGES: int = 0  # pipeline stages of the GEMV tasks' weight loops (0: num_stages)
    STAGGER: int = 0  # 1: a GEMV task starts its K loop at chunk (task index mod chunks), 0: at its first
    QKV_SPLIT: int = 1  # K slices per QKV tile (their partials merged, roped and stored by the last slice)


CONFIGS = ConfigTable(TABLE, DecodeLayerConfig, keys=("head_dim",), what="decode layer")


def shipped_entries(family=None) -> list[dict]:
    """The entries of ``decode_layer.json`` in table order, each with its ``family``."""
    return CONFIGS.shipped_entries(family)


@functools.lru_cache(maxsize=None)
def decode_layer_config(family: str, head_dim: int) -> DecodeLayerConfig:
    """The shipped tiles of a decode-layer launch on ``family`` (:func:`flashflow.device.gpu_family`)."""
    return CONFIGS.config(family, head_dim=head_dim)


def num_programs(num_tasks: int, num_sms: int) -> int:
    """The persistent grid: one program per SM (a task's tiles are sized so that one program
    streams a weight tile at a time), never more than the tasks."""
    return max(1, min(num_tasks, num_sms))


def norm_block(hidden: int) -> int:
    """Values a norm task reads per step of its row: the whole row (read once, kept in
    registers) up to 8192 values, else 8192-value steps (the row read twice)."""
    return min(8192, 1 << (hidden - 1).bit_length())
