"""What the FP8 row tests share (tests/ops/test_quant.py, test_norm_fp8.py and
tests/gpu/test_gpu_quant.py): the comparison of an :class:`~flashflow.ops.quant.Fp8Rows` with the
float64 fake quantization of :mod:`flashflow.reference.quant`, and the e4m3 error bound of its
dequantized values.

Tolerances, and why (``rtol``, one per kernel):

* ``scale``: relative ``rtol``. The kernel's scale is ``amax / 448`` in fp32 of an fp32
  amax: exact inputs (quantize_rows of fp32/fp16/bf16 values) leave only that division's rounding
  (1 ulp, or 2 for a GPU's approximate fp32 division: 2^-21 covers it); a row the kernel computes
  (a LayerNorm, a GELU) carries its fp32 arithmetic error into the amax, about 1e-6.
* ``data``: each value the reference's, or one e4m3 step away where the reference's exact
  quotient ``q = v · 448 / amax`` lies within ``rtol · 448`` of the midpoint between the two
  (``rtol`` of the row's amax, in ``q``'s units). The kernel rounds ``v · fp32(448 / amax)``:
  that multiplier's rounding moves ``q`` by a few fp32 ulp of ``q``, and a computed row's own
  fp32 error is a few ulp of the terms it sums, as large as the row's amax where a small value
  is a difference of large ones (a LayerNorm's ``x̂ · (1 + scale) + shift``); either decides
  the side only at or right beside a midpoint. Exact ties are not rare: 16-bit inputs hold few
  significant bits, and where the amax's significand has a factor 7 (448 = 7 · 64), many of a
  row's quotients land exactly on midpoints (about 1 in 200 values of Gaussian bf16 rows), and the
  kernel's multiplier breaks each tie one way or the other. A value off anywhere else (a wrong
  rounding mode, a truncation, a wrong scale) fails.
* rows with a NaN or ±inf: the scale is NaN there and only there; their data is unspecified.
"""
import torch

from flashflow.reference.quant import E4M3_MAX, e4m3_step, quantize_rows, scaled_rows


def assert_rows_match(got, values: torch.Tensor, rtol: float) -> None:
    """``got`` (Fp8Rows) against the float64 fake quantization of ``values`` (the float64 rows
    before quantization; module docstring)."""
    want_data, want_scale = quantize_rows(values)
    data, scale = got
    assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert data.shape == want_data.shape and scale.shape == want_scale.shape
    assert data.is_contiguous() and scale.is_contiguous()
    marked = want_scale.isnan()
    assert torch.equal(scale.isnan().cpu(), marked.cpu()), "NaN scales on exactly the non-finite rows"
    finite = ~marked.expand_as(want_data)
    d, w = data.double().cpu()[finite.cpu()], want_data.cpu()[finite.cpu()]
    s, ws = scale.double()[~marked], want_scale[~marked]
    assert (s - ws).abs().le(rtol * ws).all(), ((s - ws).abs() / ws).max().item()
    assert torch.isfinite(d).all(), "every value of a finite row is written and finite"
    assert (d - w).abs().le(e4m3_step(torch.maximum(d.abs(), w.abs()))).all(), "at most one e4m3 step"
    off = d != w
    quotient = scaled_rows(values).cpu()[finite.cpu()][off]
    midpoint = (d[off] + w[off]) / 2
    gap = (quotient - midpoint).abs() / E4M3_MAX
    assert gap.le(rtol).all(), (f"{off.sum().item()} of {d.numel()} values off; the farthest from a midpoint by "
                                f"{gap.max().item():.3g} of the row's amax, allowed {rtol:.3g}")


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
