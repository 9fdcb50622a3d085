"""Decode attention's config: key tile, warps and stages per GPU family and call shape, and its
launch rule (the split count, :func:`num_splits_heuristic`). The numbers are in ``decode.json``
beside this module; :func:`decode_config` is the one lookup, and ops use what it returns as it is."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from flashflow.device import cdiv
from flashflow.tuning import Config, ConfigTable, table

TABLE = "decode"


@dataclass(frozen=True)
class DecodeConfig(Config):
    BLOCK_N: int      # cached tokens per tile
    num_warps: int
    num_stages: int


CONFIGS = ConfigTable(TABLE, DecodeConfig, keys=("head_dim", "long_stream", "kv_fp8", "programs"), what="decode")


def shipped_entries(family: Optional[str] = None) -> list[dict]:
    """The entries of ``decode.json`` in table order, each with its ``family``; every family's if
    ``family`` is None."""
    return CONFIGS.shipped_entries(family)


@functools.lru_cache(maxsize=None)
def decode_config(family: str, head_dim_pad: int, *, programs: int = 1, num_sms: int = 1,
                  max_seqlen_k: int = 0, num_splits: int = 0, page_size: Optional[int] = None,
                  kv_fp8: bool = False) -> DecodeConfig:
    """The shipped tiles of a decode launch on ``family`` (:func:`flashflow.device.gpu_family`).

    ``programs``: (sequence, KV head) pairs; ``num_sms`` of the GPU; ``max_seqlen_k``: the cache
    capacity; ``num_splits``: the split count asked for (0 = :func:`num_splits_heuristic`'s);
    ``page_size``: the page of a paged cache (None: contiguous); ``kv_fp8``: an FP8 cache. The
    rules (FP8 caches, long streams, small pages) and their numbers are ``decode.json``'s.
    """
    rules = table(TABLE)
    # more programs than SMs leaves num_splits_heuristic at one split: the long-stream tiles apply
    # unless more splits were asked for
    long_stream = (num_splits in (0, 1) and programs > num_sms
                   and max_seqlen_k >= rules["long_stream"]["min_seqlen_k"])
    cfg = CONFIGS.config(family, head_dim=head_dim_pad, long_stream=long_stream, kv_fp8=kv_fp8, programs=programs)
    small = rules["small_pages"]
    if page_size is not None and small["min_page"] <= page_size < cfg.BLOCK_N \
            and page_size & (page_size - 1) == 0:
        cfg = cfg.replace(BLOCK_N=page_size, num_stages=cfg.num_stages + small["extra_stages"])
    return cfg


MAX_SPLITS = 32   # splits per (sequence, KV head) a launch takes at most


def cap_splits(num_splits: int, max_seqlen_k: int, block_n: int) -> int:
    """An asked split count capped at the key blocks of ``max_seqlen_k`` and at ``MAX_SPLITS``: a
    split beyond the key blocks is empty and each split costs a partial to merge (1000 splits of a
    64-token cache ran 102 s in the interpreter), while the output does not depend on the count."""
    return min(num_splits, -(-max(max_seqlen_k, 1) // block_n), MAX_SPLITS)


def num_splits_heuristic(batch_kv_heads: int, max_seqlen_k: int, num_sms: int, block_n: int,
                         max_splits: int = 32, kv_fp8: bool = False) -> int:
    """About one program per SM, each with >= 2 key blocks; no split once the (sequence, KV
    head) pairs alone fill three quarters of the SMs.

    One program per (sequence, KV head) leaves most SMs idle at small batch (8 programs for one
    sequence of Llama-3-8B on 132 SMs); splitting the sequence fills them. More splits than SMs
    only add partials to merge: on the H100 1×8k ran best at 16 splits, not 32.

    An FP8 cache (``kv_fp8``) costs a program more work per byte (the tiles are widened on
    chip), so it takes about two programs per SM, at most 16 splits, down to one key block a
    split, and no split from 1.5 programs per SM on: on the H100 8 × 8k GQA ran best at 4-6
    splits (1.67x cuDNN bf16 against 1.35x at 2), 16 × 16k at 2 (1.83x against 1.29x
    unsplit), 32 × 4k unsplit, 1 × 1k and 1 × 2k at 8 and 16 (one block each: 9-20% faster
    than 4 and 8).
    """
    if batch_kv_heads == 0:
        return 1
    n_blocks = cdiv(max(max_seqlen_k, 1), block_n)
    if kv_fp8:
        if 2 * batch_kv_heads >= 3 * num_sms:
            return 1
        want = max(1, round(2 * num_sms / batch_kv_heads))
        return max(1, min(want, n_blocks, 16))
    if 4 * batch_kv_heads >= 3 * num_sms:
        return 1
    want = max(1, num_sms // batch_kv_heads)
    return max(1, min(want, n_blocks // 2, max_splits))
