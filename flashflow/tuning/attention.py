"""The attention forward's config: tiles, warps, stages and load path per GPU family and shape
class, and its launch rules (the tail split). The numbers are in ``attention.json`` beside this
module; :func:`attention_config` is the one lookup, and ops use what it returns as it is."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from flashflow.tuning import Config, ConfigTable

TABLE = "attention"


@dataclass(frozen=True)
class AttentionConfig(Config):
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    use_tma: bool = False          # TMA loads (Hopper+); else pointer loads
    host_desc: bool = True         # with TMA: host-built descriptors when the layout allows
    warp_specialize: bool = False
    maxnreg: Optional[int] = None
    tail_split: bool = True        # split the last partial wave's tiles along the keys


CONFIGS = ConfigTable(TABLE, AttentionConfig, keys=("head_dim", "causal", "bias"), what="attention")


def config_from_entry(entry: dict) -> AttentionConfig:
    """An :class:`AttentionConfig` from a table entry (the match keys are ignored)."""
    return CONFIGS.from_entry(entry)


def shipped_entries(family: Optional[str] = None) -> list[dict]:
    """The entries of ``attention.json`` in table order, each with its ``family``; every family's
    if ``family`` is None."""
    return CONFIGS.shipped_entries(family)


@functools.lru_cache(maxsize=None)
def attention_config(head_dim_pad: int, causal: bool, family: str, bias: bool = False) -> AttentionConfig:
    """The shipped config for a padded head_dim, causal or not (any right window bound), with or
    without an additive ``bias`` (SDPA's ``attn_mask``), on ``family`` (:func:`flashflow.device.gpu_family`):
    the first entry of ``attention.json`` that holds (:mod:`flashflow.tuning`'s match rule)."""
    return CONFIGS.config(family, head_dim=head_dim_pad, causal=causal, bias=bias)


def tail_merge_rows(block_m: int) -> int:
    """Query rows per program of the tail split's merge: up to 32 of a tile's ``block_m``, so a
    tile's merge spreads over several programs (a streaming combine of the pieces' partials)."""
    return min(block_m, 32)


def tail_splits(total_tiles: int, num_sms: int, kv_blocks: int, max_splits: int = 16) -> int:
    """How many key-range pieces to cut each tile of the last partial wave into (1 = none).

    With ``rem = total % num_sms`` tiles left for the last wave, cutting each into
    ``num_sms // rem`` pieces lets that wave finish in ~1/splits of a tile's time. Worth it only
    when the wave is at most half full and each piece keeps >= 2 key blocks.
    """
    rem = total_tiles % num_sms
    if rem == 0 or rem > num_sms // 2:
        return 1
    splits = min(num_sms // rem, kv_blocks // 2, max_splits)
    return splits if splits >= 2 else 1

