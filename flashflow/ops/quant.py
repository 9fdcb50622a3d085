"""Activations as the A operand of an FP8 GEMM with row-wise scales: validation, launch, custom ops.

``torch._scaled_mm(a, b, scale_a, scale_b)`` with row-wise scales takes ``a`` as e4m3 values and
one float32 scale per row (token): :class:`Fp8Rows`. Each op here writes one in a single pass
over its input (kernels: :func:`flashflow.kernels.quant.quantize_rows_kernel`); the diffusion
norms write theirs from the pass that computes the row (``fp8=True`` of
:func:`flashflow.ops.norm.layernorm_modulate` and
:func:`~flashflow.ops.norm.gate_residual_layernorm_modulate`), so the activation never goes
through memory in 16 bits.

* :func:`quantize_rows` ``x`` per row;
* :func:`gelu_quantize_rows` ``GELU_tanh(h)`` per row: the MLP's middle activation, from the
  first GEMM's output (bias added), without writing the 16-bit GELU.

The numerics (:mod:`flashflow.kernels.quant`): per row, ``amax = max|v|`` of the fp32 row ``v``,
``scale = amax / 448`` (``1e-20 / 448`` for an all-zero row, whose values stay 0) and ``data =
e4m3(v · (448 / amax))``, rounded to nearest even onto the e4m3 grid and saturated at ±448:
``v ≈ scale · data`` with a relative error of at most 2^-4 per value (three mantissa bits) above
``scale · 2^-6``. A row holding a NaN or ±inf gets a NaN scale (its data is then unspecified): the
GEMM's output row is NaN, as the exact product's would be, instead of a finite number hiding it.

No op reads a device value on the host: every one is CUDA-graph safe. Under ``torch.compile``
each is one opaque ``flashflow::`` custom op returning the two tensors. Inputs that require grad
are refused.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from flashflow.device import next_pow2
from flashflow.kernels.quant import quantize_rows_kernel
from flashflow.ops.common import Launcher, dispatch as _dispatch, launch_by_arguments, unit_last_stride
from flashflow.ops.validate import FLOAT_DTYPES, check_no_grad, check_runs_here
from flashflow.tuning.norm import MAX_ROW_WIDTH, row_warps as _num_warps

__all__ = ["Fp8Rows", "quantize_rows", "gelu_quantize_rows", "FP8_DTYPE"]

FP8_DTYPE = torch.float8_e4m3fn


class Fp8Rows(NamedTuple):
    """An activation ``(..., K)`` as e4m3 values with one float32 scale per row:
    ``x[..., :] ≈ scale[..., 0] · data[..., :]`` (``data.float() * scale`` dequantizes it).

    * ``data``: ``torch.float8_e4m3fn``, shape ``(..., K)``, contiguous;
    * ``scale``: ``torch.float32``, shape ``(..., 1)`` (the same leading dims), contiguous; NaN
      for a row whose input held a NaN or ±inf (that row's ``data`` is then unspecified).

    ``data.view(-1, K)`` and ``scale.view(-1, 1)`` are the ``a`` and ``scale_a`` that
    ``torch._scaled_mm`` takes for row-wise scaling.
    """

    data: torch.Tensor
    scale: torch.Tensor


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _check_rows(name: str, x) -> None:
    """``x`` a ``(..., K)`` float16/bfloat16/float32 tensor flashflow can run on, 1 ≤ K ≤
    :data:`~flashflow.tuning.norm.MAX_ROW_WIDTH`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (..., K), got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have rank >= 1 (..., K), got a 0-d tensor")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    check_runs_here(name, x)
    k = x.shape[-1]
    if not 1 <= k <= MAX_ROW_WIDTH:
        raise ValueError(f"the last dim (K) of {name} must be between 1 and {MAX_ROW_WIDTH}, got {k}")


def empty_rows(shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of an :class:`Fp8Rows` of ``shape`` ``(..., K)``: e4m3 data and float32
    scales ``(..., 1)``, contiguous and unwritten."""
    return (torch.empty(shape, dtype=FP8_DTYPE, device=device),
            torch.empty((*shape[:-1], 1), dtype=torch.float32, device=device))


# --------------------------------------------------------------------------------------------
# launcher (validated inputs)
# --------------------------------------------------------------------------------------------


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as ``(B, L, K)`` with unit stride along K and its other strides as they are: a 4-d or
    higher x has its leading dims merged (a copy only where they do not merge)."""
    x = unit_last_stride(x)
    if x.dim() == 1:
        return x[None, None]
    if x.dim() == 2:
        return x[None]
    return x.flatten(0, -3) if x.dim() > 3 else x


_QUANTIZE_ROWS = Launcher(quantize_rows_kernel)   # keyed on its arguments: no per-call binding


def _quantize_rows_launch(x: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    data, scale = empty_rows(x.shape, x.device)
    rows = _as_rows(x)
    b, l, k = rows.shape
    if b * l == 0:
        return data, scale
    block = next_pow2(k)
    launch_by_arguments(_QUANTIZE_ROWS, (b * l, 1, 1), (rows, data, scale, l, k, rows.stride(0), rows.stride(1)),
                        dict(GELU=gelu, BLOCK_K=block, num_warps=_num_warps(block)))
    return data, scale


def _quantize_rows_impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_rows_launch(x, False)


def _gelu_quantize_rows_impl(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_rows_launch(h, True)


# --------------------------------------------------------------------------------------------
# custom ops: (data, scale), new tensors
# --------------------------------------------------------------------------------------------

_quantize_rows_op = torch.library.custom_op("flashflow::quantize_rows", mutates_args=())(_quantize_rows_impl)
_gelu_quantize_rows_op = torch.library.custom_op(
    "flashflow::gelu_quantize_rows", mutates_args=())(_gelu_quantize_rows_impl)


@_quantize_rows_op.register_fake
def _(x):
    return empty_rows(x.shape, x.device)


@_gelu_quantize_rows_op.register_fake
def _(h):
    return empty_rows(h.shape, h.device)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def quantize_rows(x) -> Fp8Rows:
    """``x`` as e4m3 values with one float32 scale per row, in one pass.

    Args:
        x: ``(..., K)``, fp16/bf16/fp32, any strides (a non-unit stride along K is read through a
            contiguous copy); 1 ≤ K ≤ 16384.
    Returns:
        :class:`Fp8Rows`: ``data (..., K)`` e4m3, ``scale (..., 1)`` float32, per row ``scale =
        max|x| / 448`` and ``data = e4m3(x · 448 / max|x|)`` (nearest even, saturated at ±448;
        module docstring); x is read in fp32, exactly. A row holding a NaN or ±inf has a NaN
        scale.
    """
    _check_rows("x", x)
    check_no_grad("quantize_rows", x=x)
    return Fp8Rows(*_dispatch(_quantize_rows_op, _quantize_rows_impl, x))


def gelu_quantize_rows(h) -> Fp8Rows:
    """``GELU(h)``, tanh approximation, as e4m3 values with one float32 scale per row, in one
    pass that reads h once: the MLP's middle activation, quantized for its second GEMM.

    Args:
        h: ``(..., K)``, fp16/bf16/fp32 (the first GEMM's output with its bias added), any
            strides as in :func:`quantize_rows`; 1 ≤ K ≤ 16384.
    Returns:
        :class:`Fp8Rows` of ``g = F.gelu(h.float(), approximate="tanh")``: the GELU is taken
        in fp32 (as ``a·sigmoid(2u)``, the same function) and quantized from fp32, never
        rounded to h's dtype; then as :func:`quantize_rows`. A row of h holding a NaN or ±inf
        has a NaN scale.
    """
    _check_rows("h", h)
    check_no_grad("gelu_quantize_rows", h=h)
    return Fp8Rows(*_dispatch(_gelu_quantize_rows_op, _gelu_quantize_rows_impl, h))
