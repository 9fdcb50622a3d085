"""What the launchers (attention prefill, backward and decode; the FFN) derive alike from their inputs."""
from __future__ import annotations

import torch

from flashflow.device import interpreting, next_pow2


def head_dim_pad(head_dim: int) -> int:
    """head_dim padded to a power of two of at least 16 (the tensor cores' smallest k)."""
    return max(16, next_pow2(head_dim))


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where its last axis is not unit-stride: the kernels index the
    last axis (head_dim, hidden) with unit stride and take every other stride as it is."""
    return t if t.stride(-1) == 1 else t.contiguous()


def dot_options(dtype: torch.dtype) -> dict:
    """The kernels' ``DOT_PRECISION`` / ``DOT_FP32`` for inputs of ``dtype``: fp32 inputs get
    IEEE products (not TF32); bf16 under Triton's interpreter is converted to fp32 before its
    dots, as the interpreter's bf16 ``tl.dot`` is wrong (a GPU never takes that branch)."""
    return {"DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
            "DOT_FP32": dtype == torch.bfloat16 and interpreting()}
