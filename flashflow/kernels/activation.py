"""Elementwise activations shared by kernel families: the FFN's (:mod:`flashflow.kernels.mlp`)
and the FP8 row quantization of the MLP's middle activation (:mod:`flashflow.kernels.quant`).

GELU's tanh form comes in two codings of one function: :func:`gelu_tanh` (``tl.exp`` and the
2-ulp division, for 16-bit outputs) and :func:`gelu_tanh_fast` (one flush-to-zero ``ex2`` and an
approximate division, half the instructions, for values rounded to e4m3 next: the rounding
hides the difference, bit for bit on the rows measured)."""
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from flashflow.device import interpreting

# sqrt(2/pi), the tanh approximation's constant, and log2(e)
_S, _LOG2E = 0.7978845608028654, 1.4426950408889634
_SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(_S)


@triton.jit
def gelu_tanh(a):
    """GELU, tanh form (``F.gelu(a, approximate="tanh")``, GPT-2's), of fp32 ``a``:
    ``0.5·a·(1 + tanh(u))`` written as ``a·sigmoid(2u)``, ``u = sqrt(2/π)·(a + 0.044715·a³)``.
    The sigmoid form has no ``1 + tanh`` to cancel for negative ``a``, and is inf-safe: ``u``
    overflowing to ±inf gives ``a`` or ``-0``; ``a = -inf`` gives NaN (``-inf / inf``), as torch
    gives for it."""
    u = _SQRT_2_OVER_PI * (a + 0.044715 * a * a * a)
    # the fast division (within 2 ulp): the results feed 8-bit or 16-bit roundings
    return tl.fdiv(a, 1.0 + tl.exp(-2.0 * u), ieee_rounding=False)


# -2·sqrt(2/π)·log2(e) and that times 0.044715: GELU's tanh argument, doubled, negated and in
# base 2, as ``a·(C1 + C2·a²)``
_C1: tl.constexpr = tl.constexpr(-2.0 * _S * _LOG2E)
_C2: tl.constexpr = tl.constexpr(-2.0 * _S * _LOG2E * 0.044715)
# on a GPU, the division as the hardware's approximate reciprocal and one multiply (no range
# fix-up: a divisor past 2^126 gives 0, which is the quotient's limit here anyway)
_FAST_DIVISION: tl.constexpr = tl.constexpr(not interpreting())


@triton.jit
def gelu_tanh_fast(a):
    """:func:`gelu_tanh` for values rounded to 8 bits next (the FP8 rows of
    :mod:`flashflow.kernels.quant`), in the fewest instructions: ``a / (1 + 2^w)``,
    ``u = sqrt(2/π)·(a + 0.044715·a³)``, ``w = −2u·log2(e) = a·(C1 + C2·a²)``.
    The sigmoid form has no ``1 + tanh`` to cancel for negative ``a``, and is inf-safe: ``w``
    overflowing to ∓inf gives ``a`` or ``-0``; ``a = -inf`` gives NaN (``-inf · 0``), as torch
    gives for it.

    Cost per element on a GPU: three FMA-pipe instructions for ``w``, one ``MUFU.EX2`` (the
    flush-to-zero ``ex2.approx``: ``2^w`` below 2^-126 is 0, and ``a / 1`` is then exact), one
    add, one ``MUFU.RCP`` and a multiply (``div.approx``; within 2 ulp of the quotient): about
    half :func:`gelu_tanh`'s instructions."""
    w = a * (_C1 + _C2 * (a * a))
    d = 1.0 + tl.math.exp2(w)
    if _FAST_DIVISION:
        return libdevice.fast_dividef(a, d)
    else:
        return a / d
