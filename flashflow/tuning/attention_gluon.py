"""The Gluon (Hopper) attention forward's config: tiles, warps, stages, warp roles and tile
scheduler per head_dim, causal or not, and length of the keys. The numbers are in
``attention_gluon.json`` beside this module; :func:`gluon_attention_config` is the one lookup."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from flashflow.tuning import Config, ConfigTable

TABLE = "attention_gluon"


@dataclass(frozen=True)
class GluonAttentionConfig(Config):
    BLOCK_M: int              # 64 query rows a warpgroup
    BLOCK_N: int
    num_warps: int            # the MMA warps (of each partition with split_warpgroups)
    num_stages: int           # buffers of the K ring and of the V ring
    warp_specialize: bool = False    # one load warp (24 registers) issues the TMA copies
    split_warpgroups: bool = False   # 64 rows an MMA partition of one warpgroup (BLOCK_M 128: two, 192: three)
    pingpong: bool = False           # the two partitions take turns issuing their MMAs (named barriers)
    persistent: bool = False         # one CTA an SM walking tiles (the load warp runs ahead)
    dynamic: bool = False            # persistent CTAs claim tiles by ticket (tile_order.next_tile)
    q_buffers: int = 2               # persistent: Q buffers (2: the next tile's Q loads under this one)
    overlap_tiles: bool = False      # a tile's output stored under the next tile's first Q·Kᵀ
    split_last_wave: bool = False    # no causal mask: the tiles past the last full wave in key pieces
    min_piece_blocks: int = 4        # split_last_wave: key blocks a piece at least
    max_pieces: int = 8              # split_last_wave: pieces a tile at most (the last one merges them all)
    early_rescale: bool = False      # the accumulator rescaled once the previous P·V is waited on, not in the next one's issue
    auto: bool = True                # the dispatcher takes it unasked (else only when forced)
    min_seqlen_k: int = 0            # unasked, only from this many keys (shorter: portable)

    def __post_init__(self):
        if self.split_warpgroups:
            if self.BLOCK_M not in (128, 192):
                raise ValueError(f"BLOCK_M {self.BLOCK_M} must be 128 or 192 with split_warpgroups (64 rows a partition)")
        elif self.BLOCK_M != 16 * self.num_warps:
            raise ValueError(f"BLOCK_M {self.BLOCK_M} must be 64 rows a warpgroup ({16 * self.num_warps} here)")
        if self.split_warpgroups and not (self.warp_specialize and self.num_warps == 4):
            raise ValueError("split_warpgroups needs warp_specialize and num_warps 4")
        if self.persistent and not self.warp_specialize:
            raise ValueError("persistent needs warp_specialize")
        if self.dynamic and not self.persistent:
            raise ValueError("dynamic needs persistent")
        if self.q_buffers not in (1, 2):
            raise ValueError(f"q_buffers must be 1 or 2, got {self.q_buffers}")
        if self.pingpong and self.partitions != 2:
            raise ValueError("pingpong needs split_warpgroups with two partitions (BLOCK_M 128)")
        if self.overlap_tiles and not self.split_warpgroups:
            raise ValueError("overlap_tiles needs split_warpgroups")
        if self.split_last_wave and not self.overlap_tiles:
            raise ValueError("split_last_wave needs overlap_tiles")
        if self.min_piece_blocks < 1 or self.max_pieces < 2:
            raise ValueError(f"min_piece_blocks must be at least 1 and max_pieces at least 2, got "
                             f"{self.min_piece_blocks} and {self.max_pieces}")

    @property
    def q_rows(self) -> int:
        """Rows of Q's TMA box (a power of two): the tile's, or one partition's for 192 rows."""
        return 64 if self.BLOCK_M == 192 else self.BLOCK_M

    @property
    def partitions(self) -> int:
        """MMA partitions (warpgroups of 64 rows with ``split_warpgroups``; else one)."""
        return self.BLOCK_M // 64 if self.split_warpgroups else 1


CONFIGS = ConfigTable(TABLE, GluonAttentionConfig, keys=("head_dim", "causal", "seqlen_k"), what="Gluon attention")


def supported_families() -> list[str]:
    return CONFIGS.families()


@functools.lru_cache(maxsize=4096)
def gluon_attention_config(head_dim: int, causal: bool, family: str, seqlen_k: int) -> GluonAttentionConfig:
    """The shipped config for ``head_dim``, causal or not, ``seqlen_k`` keys, on ``family``: the
    first matching entry of ``attention_gluon.json`` (an entry with ``seqlen_k_max`` holds up to
    that many keys)."""
    return CONFIGS.config(family, head_dim=head_dim, causal=causal, seqlen_k=seqlen_k)


def last_wave_pieces(cfg: GluonAttentionConfig, causal: bool, num_tiles: int, ctas: int, key_blocks: int) -> int:
    """Key pieces for each tile past the last full wave of ``ctas`` persistent CTAs (1: none).
    With ``split_last_wave`` and no causal mask (every tile ``key_blocks`` long), the ``T`` tiles
    left after the full waves (all of them with fewer tiles than CTAs) run as ``ctas // T`` pieces
    each, at least ``min_piece_blocks`` blocks a piece and at most ``max_pieces`` pieces (the last
    piece merges the others one after another), so the last wave keeps the SMs busy a fraction
    of a tile's time instead of a whole tile's on ``T`` of them."""
    if not cfg.split_last_wave or causal or num_tiles == 0:
        return 1
    tail = num_tiles % ctas   # (all of them with fewer tiles than CTAs)
    if tail == 0:
        return 1
    pieces = min(ctas // tail, key_blocks // cfg.min_piece_blocks, cfg.max_pieces)
    return pieces if pieces >= 2 else 1
