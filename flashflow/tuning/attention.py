"""The attention forward's config: tiles, warps, stages and load path per GPU family and shape
class. The numbers are in ``attention.json`` beside this module; :func:`attention_config` is the
one lookup, and ops use what it returns as it is."""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import Optional

from flashflow.tuning import families, table

TABLE = "attention"


@dataclass(frozen=True)
class AttentionConfig:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    use_tma: bool = False          # TMA loads (Hopper+); else pointer loads
    host_desc: bool = True         # with TMA: host-built descriptors when the layout allows
    warp_specialize: bool = False
    maxnreg: Optional[int] = None
    tail_split: bool = True        # split the last partial wave's tiles along the keys

    def replace(self, **kw) -> "AttentionConfig":
        """A copy with some fields changed (autotune candidates, sweeps)."""
        return replace(self, **kw)

    def as_dict(self) -> dict:
        return asdict(self)


def config_from_entry(entry: dict) -> AttentionConfig:
    """An :class:`AttentionConfig` from a table entry (the match keys are ignored)."""
    return AttentionConfig(**{k: entry[k] for k in AttentionConfig.__dataclass_fields__ if k in entry})


def shipped_entries(family: Optional[str] = None) -> list[dict]:
    """The entries of ``attention.json`` in table order, each with its ``family``; every family's
    if ``family`` is None."""
    known = families(TABLE)
    if family is not None and family not in known:
        raise ValueError(f"family must be one of {', '.join(known)}, got {family!r}")
    return [{"family": f, **e} for f in ([family] if family else known) for e in table(TABLE)[f]]


@functools.lru_cache(maxsize=None)
def attention_config(head_dim_pad: int, causal: bool, family: str, bias: bool = False) -> AttentionConfig:
    """The shipped config for a padded head_dim, causal or not (any right window bound), with or
    without an additive ``bias`` (SDPA's ``attn_mask``), on ``family`` (:func:`flashflow.device.gpu_family`).
    The first matching entry of ``attention.json`` wins (its ``_doc`` gives the rule)."""
    if family not in families(TABLE):
        raise ValueError(f"no attention configs for GPU family {family!r}; known: {', '.join(families(TABLE))}")
    for entry in table(TABLE)[family]:
        if head_dim_pad <= entry["head_dim_max"] and entry["causal"] in (None, causal) \
                and entry.get("bias") in (None, bias):
            return config_from_entry(entry)
    raise ValueError(f"no attention config for head_dim {head_dim_pad} on {family}")
