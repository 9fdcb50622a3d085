"""Reference numerics of the FP8 row quantization (the oracle of :mod:`flashflow.ops.quant` and of
the norms' ``fp8=True`` outputs): fake quantization in float64.

Per row (the last dim) of a float64 tensor ``v``:

* ``amax = max |v|``, floored at ``1e-20`` (an all-zero row keeps finite scale and zero values);
* ``scale = amax / 448``;
* ``data = round_e4m3(v · 448 / amax)``: rounded to nearest, ties to even, onto the e4m3 grid
  (``torch.float8_e4m3fn``: a step of ``2^(e − 3)`` for a value of exponent ``e`` ≥ −6, ``2^-9``
  below ``2^-6``), saturated at ±448; returned as float64 holding exactly those values;
* a row holding a NaN or ±inf: ``scale = NaN`` and ``data`` NaN (the kernels' data of such a row is
  unspecified).

Unlike :func:`flashflow.reference.attention_fp8.e4m3`, which converts through float32 as torch
does, :func:`round_e4m3` rounds a float64 once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-20


def e4m3_step(x: torch.Tensor) -> torch.Tensor:
    """The e4m3 grid's spacing at ``x`` (float64): ``2^(e − 3)`` for ``|x|`` of exponent ``e``,
    ``2^-9`` for ``|x| < 2^-6`` (the subnormals)."""
    _, exponent = torch.frexp(x.abs())              # |x| = m · 2^exponent, m in [0.5, 1)
    return torch.exp2((exponent - 1).clamp(min=-6).to(x.dtype) - 3)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float64) saturated at ±448 and rounded to nearest even onto the e4m3 grid, in
    float64. ``torch.round`` rounds halves to even: in units of the step, the grid's even
    neighbour."""
    x = x.clamp(-E4M3_MAX, E4M3_MAX)
    step = e4m3_step(x)
    return torch.round(x / step) * step


def _row_amax(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(finite, amax)`` per row of ``v``: whether the row is finite, and its amax over the
    finite values, floored."""
    finite = torch.isfinite(v).all(-1, keepdim=True)
    return finite, torch.where(finite, v, 0).abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR)


def _scaled(v: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    # multiplied first: ``v · 448`` is exact for values of up to 50 significant bits, so a
    # quotient on a midpoint between e4m3 grid values comes out exactly on it and rounds to even
    # (``v · (448 / amax)`` would break such a tie by the rounding of ``448 / amax``)
    return v * E4M3_MAX / amax


def scaled_rows(v: torch.Tensor) -> torch.Tensor:
    """``v · 448 / amax`` per row (float64), exactly the value :func:`quantize_rows` rounds."""
    return _scaled(v, _row_amax(v)[1])


def quantize_rows(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of ``v (..., K)`` (float64) per row: data ``(..., K)``, scale ``(..., 1)``
    (module docstring)."""
    finite, amax = _row_amax(v)
    data = round_e4m3(_scaled(v, amax))
    nan = torch.full_like(amax, float("nan"))
    return torch.where(finite, data, nan), torch.where(finite, amax / E4M3_MAX, nan)


def gelu_quantize_rows(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` of ``F.gelu(h, approximate="tanh")``."""
    return quantize_rows(F.gelu(h, approximate="tanh"))
