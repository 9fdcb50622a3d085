"""Kernel configs per (GPU family, shape class), read from the JSON tables in this folder."""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

_HERE = Path(__file__).parent

# transitional re-exports: callers import these from flashflow.device
from flashflow.device import gpu_family, interpreting, offline_capability, on_gpu  # noqa: E402,F401


@dataclass(frozen=True)
class AttentionConfig:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    use_tma: bool = False          # TMA loads (Hopper+); else pointer loads
    host_desc: bool = True         # with TMA: host-built descriptors when the layout allows
    warp_specialize: bool = False
    maxnreg: int | None = None
    tail_split: bool = True        # split the last partial wave's tiles along the keys

    def replace(self, **kw) -> "AttentionConfig":
        return replace(self, **kw)

    def as_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=None)
def _table(name: str) -> dict:
    with open(_HERE / f"{name}.json") as f:
        return json.load(f)


def family_entries(name: str, family: str) -> list[dict]:
    return _table(name)[family]


def table(name: str) -> dict:
    """A config table of this folder (``name``.json), parsed once."""
    return _table(name)


def config_from_entry(entry: dict) -> AttentionConfig:
    """An :class:`AttentionConfig` from a table entry (the match keys are ignored)."""
    return AttentionConfig(**{k: entry[k] for k in AttentionConfig.__dataclass_fields__ if k in entry})


def attention_fwd_config(head_dim_pad: int, causal: bool, family: str) -> AttentionConfig:
    for entry in _table("attention_fwd")[family]:
        if head_dim_pad <= entry["head_dim_max"] and entry["causal"] in (None, causal):
            return config_from_entry(entry)
    raise ValueError(f"no attention config for head_dim {head_dim_pad} on {family}")
