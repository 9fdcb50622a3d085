"""Kernel configs per (GPU family, shape class), read from the JSON tables in this folder."""
from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

_HERE = Path(__file__).parent


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


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _table(name: str) -> dict:
    with open(_HERE / f"{name}.json") as f:
        return json.load(f)


# (major, minor) and SM count while flashflow.tuning.offline.pretend_cuda_capability is active:
# CPU tensors then stand for that GPU (kernels are compiled for it, never run)
_OFFLINE_CAPABILITY = None
_OFFLINE_SM_COUNT = None


def offline_capability():
    """The capability CPU tensors stand for while compiling offline, else None."""
    return _OFFLINE_CAPABILITY


def offline_sm_count():
    """The SM count of the GPU CPU tensors stand for while compiling offline, else None."""
    return _OFFLINE_SM_COUNT


def on_gpu(device) -> bool:
    """A CUDA device, or CPU tensors standing for one (flashflow.tuning.offline)."""
    return device.type == "cuda" or _OFFLINE_CAPABILITY is not None


def gpu_family(device) -> str:
    """'interpreter', 'sm90' (Hopper and newer) or 'sm80' (Ampere/Ada and anything older)."""
    if device.type != "cuda" and _OFFLINE_CAPABILITY is not None and not interpreting():
        return "sm90" if _OFFLINE_CAPABILITY[0] >= 9 else "sm80"
    if interpreting() or device.type != "cuda":
        return "interpreter"
    import torch

    major, _ = torch.cuda.get_device_capability(device)
    return "sm90" if major >= 9 else "sm80"


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
