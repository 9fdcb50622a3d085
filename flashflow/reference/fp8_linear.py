"""The FP8 linear layer's numerics in float64 (fake quantization): the oracle of
:mod:`flashflow.ops.fp8_linear`.

``x`` per row and ``W`` per output channel: ``scale = amax / 448`` (``1e-20 / 448`` for an
all-zero row), values ``e4m3(v · 448 / amax)`` (nearest even onto the e4m3 grid, clamped to
±448); the product of the e4m3 values summed exactly (float64), times both scales, plus the bias.
A row of ``x`` holding a NaN or an inf comes out NaN (its scale is NaN). The kernels compute
``v · 448 / amax`` in float32: a value that lands within float32 rounding of an e4m3 tie can round
the other way, one e4m3 step, which the tests allow for.
"""
from __future__ import annotations

from typing import Optional

import torch

from flashflow.reference.attention_fp8 import e4m3

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-20


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scale)`` of ``x`` (..., K) per row, float64: ``values`` on the e4m3 grid,
    ``scale`` (..., 1); a row holding a NaN or an inf has a NaN scale."""
    v = x.double()
    amax = v.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(v).all(dim=-1, keepdim=True)
    safe = torch.where(finite, amax, torch.ones_like(amax)).clamp_min(AMAX_FLOOR)
    values = e4m3(torch.where(torch.isfinite(v), v, torch.zeros_like(v)) * (E4M3_MAX / safe))
    scale = torch.where(finite, safe / E4M3_MAX, torch.full_like(safe, float("nan")))
    return values, scale


def quantize_weight_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values (N, K), scale (N, 1))`` of ``weight`` per output channel, float64."""
    return quantize_rows_reference(weight)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x · Wᵀ + bias`` with both operands fake-quantized, float64 ``(..., N)``."""
    xq, xs = quantize_rows_reference(x)
    wq, ws = quantize_weight_reference(weight)
    out = (xq @ wq.T) * xs * ws.reshape(1, -1)
    if bias is not None:
        out = out + bias.double()
    return out
