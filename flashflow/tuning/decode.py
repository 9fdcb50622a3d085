"""Decode attention's config: key tile, warps and stages per GPU family and call shape. The
numbers are in ``decode.json`` beside this module; :func:`decode_config` is the one lookup, and
ops use what it returns as it is."""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Optional

from flashflow.tuning import families, table

TABLE = "decode"


@dataclass(frozen=True)
class DecodeConfig:
    BLOCK_N: int      # cached tokens per tile
    num_warps: int
    num_stages: int

    def as_dict(self) -> dict:
        return asdict(self)


def shipped_entries(family: Optional[str] = None) -> list[dict]:
    """The entries of ``decode.json`` in table order, each with its ``family``; every family's if
    ``family`` is None."""
    known = families(TABLE)
    if family is not None and family not in known:
        raise ValueError(f"family must be one of {', '.join(known)}, got {family!r}")
    return [{"family": f, **e} for f in ([family] if family else known) for e in table(TABLE)[f]]


@functools.lru_cache(maxsize=None)
def decode_config(family: str, head_dim_pad: int, *, programs: int = 1, num_sms: int = 1,
                  max_seqlen_k: int = 0, num_splits: int = 0, page_size: Optional[int] = None,
                  kv_fp8: bool = False) -> DecodeConfig:
    """The shipped tiles of a decode launch on ``family`` (:func:`flashflow.device.gpu_family`).

    ``programs``: (sequence, KV head) pairs; ``num_sms`` of the GPU; ``max_seqlen_k``: the cache
    capacity; ``num_splits``: the split count asked for (0 = the heuristic's); ``page_size``: the
    page of a paged cache (None: contiguous); ``kv_fp8``: an FP8 cache. The rules (FP8 caches,
    long streams, small pages) and their numbers are ``decode.json``'s (its ``_doc``).
    """
    if family not in families(TABLE):
        raise ValueError(f"no decode configs for GPU family {family!r}; known: {', '.join(families(TABLE))}")
    rules = table(TABLE)
    # more programs than SMs leaves the split heuristic at one split: the long-stream tiles apply
    # unless more splits were asked for
    long_stream = (num_splits in (0, 1) and programs > num_sms
                   and max_seqlen_k >= rules["long_stream"]["min_seqlen_k"])
    for entry in rules[family]:
        if head_dim_pad <= entry["head_dim_max"] and entry.get("long_stream") in (None, long_stream) \
                and entry.get("kv_fp8") in (None, kv_fp8) and programs <= entry.get("programs_max", programs):
            cfg = DecodeConfig(entry["BLOCK_N"], entry["num_warps"], entry["num_stages"])
            break
    else:
        raise ValueError(f"no decode config for head_dim {head_dim_pad} on {family}")
    small = rules["small_pages"]
    if page_size is not None and small["min_page"] <= page_size < cfg.BLOCK_N \
            and page_size & (page_size - 1) == 0:
        cfg = DecodeConfig(page_size, cfg.num_warps, cfg.num_stages + small["extra_stages"])
    return cfg
