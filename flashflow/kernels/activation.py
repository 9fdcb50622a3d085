"""Elementwise activations shared by kernel families: the FFN's (:mod:`flashflow.kernels.mlp`)
and the FP8 row quantization of the MLP's middle activation (:mod:`flashflow.kernels.quant`)."""
import triton
import triton.language as tl

# sqrt(2/pi), the tanh approximation's constant
_SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)


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
