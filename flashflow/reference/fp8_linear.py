"""The FP8 linear layer's numerics in float64 (fake quantization): the oracle of
:mod:`flashflow.ops.fp8_linear`.

``x`` per row and ``W`` per output channel, both by :func:`flashflow.reference.quant.quantize_rows`
(``scale = amax / 448``, values rounded to nearest even onto the e4m3 grid, saturated at ±448);
the product of the e4m3 values summed exactly (float64), times both scales, plus the bias. A row of
``x`` holding a NaN or an inf comes out NaN (its scale is NaN). The kernels compute ``v · 448 /
amax`` in float32: a value within float32 rounding of an e4m3 tie can round the other way, one
e4m3 step, which the tests allow for.
"""
from __future__ import annotations

from typing import Optional

import torch

from flashflow.reference.quant import quantize_rows


def quantize_weight_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values (N, K), scale (N, 1))`` of ``weight`` per output channel, float64."""
    return quantize_rows(weight.double())


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x · Wᵀ + bias`` with both operands fake-quantized, float64 ``(..., N)``."""
    xq, xs = quantize_rows(x.double())
    wq, ws = quantize_weight_reference(weight)
    xq = torch.where(torch.isnan(xs), 0.0, xq)   # a non-finite row: NaN through its scale alone
    out = (xq @ wq.T) * xs * ws.reshape(1, -1)
    if bias is not None:
        out = out + bias.double()
    return out
