"""What the FP8 row tests share (tests/ops/test_quant.py, test_norm_fp8.py and
tests/gpu/test_gpu_quant.py): the comparison of an :class:`~flashflow.ops.quant.Fp8Rows` with the
float64 fake quantization of :mod:`flashflow.reference.quant`, and the e4m3 error bound of its
dequantized values.

Tolerances, and why:

* ``scale``: relative ``scale_rtol``. The kernel's scale is ``amax / 448`` in fp32 of an fp32
  amax: exact inputs (quantize_rows of fp32/fp16/bf16 values) leave only that division's rounding
  (1 ulp, or 2 for a GPU's approximate fp32 division: 2^-21 covers it); a row the kernel computes
  (a LayerNorm, a GELU) carries its fp32 arithmetic error into the amax, about 1e-6.
* ``data``: each value the reference's, or one e4m3 step away. The kernel rounds
  ``v · fp32(448 / amax)``, the reference ``v · 448 / amax`` in float64; the two can fall on
  either side of a midpoint between grid values only where the exact quotient lies within a few
  fp32 ulp of one (or on it, where the fp32 product breaks the tie): rare, so at most
  ``1%`` of the values of the finite rows may differ at all (a wrong rounding mode, say
  truncation, moves about half of them).
* rows with a NaN or ±inf: the scale is NaN there and only there; their data is unspecified.
"""
import torch

from flashflow.reference.quant import e4m3_step

# the share of values allowed one e4m3 step off the reference (ties broken by fp32 rounding)
OFF_BY_ONE_STEP = 0.01


def assert_rows_match(got, want_data: torch.Tensor, want_scale: torch.Tensor, scale_rtol: float) -> None:
    """``got`` (Fp8Rows) against the reference's float64 ``(data, scale)`` (module docstring)."""
    data, scale = got
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert data.shape == want_data.shape and scale.shape == want_scale.shape
    assert data.is_contiguous() and scale.is_contiguous()
    marked = want_scale.isnan()
    assert torch.equal(scale.isnan().cpu(), marked.cpu()), "NaN scales on exactly the non-finite rows"
    finite = ~marked.expand_as(want_data)
    d, w = data.double()[finite], want_data[finite]
    s, ws = scale.double()[~marked], want_scale[~marked]
    assert (s - ws).abs().le(scale_rtol * ws).all(), ((s - ws).abs() / ws).max().item()
    assert torch.isfinite(d).all(), "every value of a finite row is written and finite"
    off = d != w
    assert (d - w).abs().le(e4m3_step(torch.maximum(d.abs(), w.abs()))).all(), "at most one e4m3 step"
    assert off.sum().item() <= OFF_BY_ONE_STEP * max(d.numel(), 1), f"{off.sum().item()} of {d.numel()} off"


def assert_dequantized_close(got, want: torch.Tensor, rounding: float) -> None:
    """``data·scale`` of the finite rows within e4m3's error of ``want`` (the same rows before
    quantization, rounded with relative error at most ``rounding``, 0 for fp32/float64): per
    value ``|deq − v| ≤ 2^-4·|v|`` (half a step of three mantissa bits) above the subnormals,
    ``≤ 2^-10·scale`` below them; plus ``want``'s own rounding on both sides."""
    data, scale = got
    finite = ~scale.isnan().expand_as(data)
    deq = (data.double() * scale.double())[finite]
    want = want.double()[finite]
    bound = (2 ** -4 + 2 * rounding) * (1 + rounding) * want.abs() + 2 ** -10 * scale.double().expand_as(data)[finite]
    assert (deq - want).abs().le(bound * (1 + 1e-6)).all(), ((deq - want).abs() - bound).max().item()
