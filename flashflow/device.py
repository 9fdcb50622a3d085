"""What flashflow asks about the machine, defined once: the GPU family and capability, the SM
count, whether Triton's interpreter runs the kernels, whether a CUDA graph is being captured,
and the two integer helpers every launcher needs.

CPU tensors normally mean the interpreter. While :func:`flashflow.bench.offline.pretend_cuda_capability`
is active they stand for a GPU instead (kernels are compiled for it, never run): every question
below then answers for that GPU, so the ops pick the configs and launch options it would get.

This module imports nothing else of flashflow; every layer may import it.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

# (major, minor) and SM count of the GPU that CPU tensors stand for while compiling offline
_OFFLINE_CAPABILITY: Optional[tuple[int, int]] = None
_OFFLINE_SM_COUNT: Optional[int] = None

# The interpreter runs programs one after another: a few programs are enough to exercise every
# cross-program path (tickets, split merges) without making the tests slow.
INTERPRETER_SM_COUNT = 4


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ ``n`` (1 for n ≤ 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def offline_capability() -> Optional[tuple[int, int]]:
    """The capability CPU tensors stand for while compiling offline, else None."""
    return _OFFLINE_CAPABILITY


def set_offline(capability: Optional[tuple[int, int]], sm_count: Optional[int]) -> tuple:
    """Make CPU tensors stand for a GPU (None, None: stop); returns the previous setting."""
    global _OFFLINE_CAPABILITY, _OFFLINE_SM_COUNT
    previous = (_OFFLINE_CAPABILITY, _OFFLINE_SM_COUNT)
    _OFFLINE_CAPABILITY = tuple(capability) if capability is not None else None
    _OFFLINE_SM_COUNT = sm_count
    return previous


def on_gpu(device: torch.device) -> bool:
    """A CUDA device, or CPU tensors standing for one (offline compilation)."""
    return device.type == "cuda" or _OFFLINE_CAPABILITY is not None


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of ``device``'s GPU; (0, 0) for the interpreter."""
    if device.type == "cuda":
        return _cuda_capability(_index(device))
    if _OFFLINE_CAPABILITY is not None:
        return _OFFLINE_CAPABILITY
    return (0, 0)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``'s GPU (a few for the interpreter)."""
    if device.type == "cuda":
        return _cuda_sm_count(_index(device))
    return _OFFLINE_SM_COUNT or INTERPRETER_SM_COUNT


def gpu_family(device: torch.device) -> str:
    """'interpreter', 'sm90' (Hopper and newer) or 'sm80' (Ampere/Ada and anything older):
    the key of every config table in :mod:`flashflow.tuning`."""
    if device.type != "cuda" and _OFFLINE_CAPABILITY is not None and not interpreting():
        return "sm90" if _OFFLINE_CAPABILITY[0] >= 9 else "sm80"
    if interpreting() or device.type != "cuda":
        return "interpreter"
    return "sm90" if capability(device)[0] >= 9 else "sm80"


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (no host reads then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
