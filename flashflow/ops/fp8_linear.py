"""FP8 linear layers: e4m3 weights scaled per output channel, e4m3 activations scaled per row
(token), products on the FP8 tensor cores with fp32 accumulation, the output in the layer's dtype.

``y = x · Wᵀ + b`` becomes ``y[m, n] = sx[m] · sw[n] · Σ_k qx[m, k] · qw[n, k] + b[n]`` with
``x ≈ sx · qx`` (:class:`flashflow.ops.quant.Fp8Rows`, one scale per row, made by the pass that
produced x: :func:`flashflow.ops.quant.quantize_rows`, ``gelu_quantize_rows``, or the norms'
``fp8=True`` outputs) and ``W ≈ sw · qw`` (:class:`Fp8Weight`, quantized once by
:func:`quantize_weight`). Both scales are ``amax / 448`` (e4m3's largest value), the values
rounded to nearest even onto the e4m3 grid: the recipe of torchao's
``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``.

The GEMM is ``torch._scaled_mm`` with row-wise scales (cuBLASLt / CUTLASS on Hopper), the bias
in its epilogue (added after it for a shape cuBLASLt refuses so: :func:`_gemm_impl`); a call of
a few rows is a weight read, which flashflow's own kernel does on the unquantized rows
(:mod:`flashflow.kernels.fp8_linear`). The settings and the measured
alternatives are in flashflow/tuning/fp8_linear.json.
A row whose scale is NaN (an input row holding a NaN or an inf) comes out NaN: FP8 does not hide
a non-finite input. :class:`Fp8Linear` is the ``nn.Module`` form that
:func:`flashflow.integrations.diffusers.enable` puts in place of a model's ``nn.Linear``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from torch import nn

from flashflow.device import cdiv, gpu_family, next_pow2
from flashflow.kernels.fp8_linear import fp8_weight_rows_kernel
from flashflow.ops.common import Launcher, dot_options, launch_by_arguments, op_or_direct, unit_last_stride
from flashflow.ops.quant import Fp8Rows, quantize_rows
from flashflow.ops.validate import FLOAT_DTYPES, check_no_grad, share_memory
from flashflow.tuning.fp8_linear import fp8_linear_config

__all__ = ["Fp8Weight", "Fp8Linear", "quantize_weight", "fp8_linear", "E4M3_MAX", "GEMM_MULTIPLE"]

E4M3_MAX = 448.0
# the FP8 GEMM's K and N: multiples of 16 bytes of e4m3 (cuBLASLt's and CUTLASS's operand alignment)
GEMM_MULTIPLE = 16
# the dtype _scaled_mm writes with row-wise scales (cuBLASLt takes no other); a layer of another
# dtype gets its output cast, and its bias added after
_GEMM_OUT = torch.bfloat16


class Fp8Weight(NamedTuple):
    """A linear layer's weight in e4m3, one scale per output channel.

    ``data``: ``(out_features, in_features)`` ``torch.float8_e4m3fn``, contiguous (``nn.Linear``'s
    layout); ``scale``: ``(1, out_features)`` float32; ``dtype``: the dtype the layer computes its
    output in (its original weight's)."""
    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def quantize_weight(weight: torch.Tensor, name: str = "weight") -> Fp8Weight:
    """``weight`` (``(out_features, in_features)``, bf16/fp16/fp32) per output channel:
    ``scale[n] = amax_n / 448`` (an all-zero row keeps a tiny finite scale), the values
    ``weight / scale`` rounded to nearest even onto the e4m3 grid. A weight holding a NaN or an
    inf is refused (``ValueError`` naming ``name``): its channel would have no finite scale."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    if type(weight) not in (torch.Tensor, nn.Parameter):
        raise TypeError(f"{name} is a {type(weight).__module__}.{type(weight).__name__} (a tensor subclass, e.g. a "
                        "weight quantized by torchao): FP8 quantization needs the layer's plain floating-point weight")
    if weight.dim() != 2:
        raise ValueError(f"{name} must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    if weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {weight.dtype}")
    out_features, in_features = weight.shape
    if in_features % GEMM_MULTIPLE or out_features % GEMM_MULTIPLE:
        raise ValueError(f"{name} is ({out_features}, {in_features}): the FP8 GEMM needs in_features and "
                         f"out_features to be multiples of {GEMM_MULTIPLE}")
    with torch.no_grad():
        w = weight.detach().float()
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"{name} holds a NaN or an inf: its output channel has no finite FP8 scale")
        amax = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-20)
        # the activations' rule (kernels/quant.py quantize): values times 448 / amax, scale amax / 448;
        # the clamp keeps a rounding of 448 + ulp from overflowing e4m3fn into NaN
        data = (w * (E4M3_MAX / amax)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        scale = (amax / E4M3_MAX).reshape(1, out_features).contiguous()
    return Fp8Weight(data.contiguous(), scale, weight.dtype)


def _check_weight(weight) -> None:
    if not isinstance(weight, Fp8Weight):
        raise TypeError(f"weight must be an Fp8Weight (flashflow.ops.fp8_linear.quantize_weight), got "
                        f"{type(weight).__name__}")


def fp8_linear(x: Union[torch.Tensor, Fp8Rows], weight: Fp8Weight,
               bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x · Wᵀ + bias`` on the FP8 tensor cores.

    Args:
        x: ``(..., in_features)``: a bf16/fp16/fp32 tensor (quantized per row here, one extra
            pass) or an :class:`~flashflow.ops.quant.Fp8Rows` from the pass that made it.
        weight: an :class:`Fp8Weight` (:func:`quantize_weight`).
        bias: ``(out_features,)`` in ``weight.dtype``, or None.
        out: None, or a contiguous ``(..., out_features)`` tensor of ``weight.dtype`` on x's
            device to write the result into (e.g. rows of a larger buffer, so that two layers'
            outputs land side by side with no copy); it must not overlap x.
    Returns:
        ``(..., out_features)`` in ``weight.dtype`` (``out`` itself when given); fp32 accumulation. A bf16 layer's bias is
        added in the GEMM's fp32 epilogue (in bf16 after the GEMM for a shape cuBLASLt has no
        such algorithm for: :func:`_gemm_impl`); a layer of another dtype gets the bf16 GEMM
        output cast to its dtype and the bias added after (one more pass). A float x of at most ``rows_max``
        rows (flashflow/tuning/fp8_linear.json; the AdaLN modulation's time-embedding row) is not
        quantized: flashflow's kernel multiplies it as it is with the widened e4m3 weight
        (:mod:`flashflow.kernels.fp8_linear`), the error then the weight's alone.
    """
    _check_weight(weight)
    out_features, in_features = weight.data.shape
    if isinstance(x, Fp8Rows):
        data, scale = x
        if not (isinstance(data, torch.Tensor) and isinstance(scale, torch.Tensor)):
            raise TypeError("x (Fp8Rows) must hold two tensors, data and scale")
        if data.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
            raise ValueError(f"x (Fp8Rows) must be float8_e4m3fn data with float32 scales, got {data.dtype} and "
                             f"{scale.dtype}")
        if data.dim() < 1 or tuple(scale.shape) != (*data.shape[:-1], 1):
            raise ValueError(f"x (Fp8Rows): scale must have shape data.shape[:-1] + (1,) = "
                             f"{(*data.shape[:-1], 1)}, got {tuple(scale.shape)}")
        lead = data.shape[:-1]
    elif isinstance(x, torch.Tensor):
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"x must be float16, bfloat16 or float32 (or an Fp8Rows), got {x.dtype}")
        if x.dim() < 1:
            raise ValueError("x must have at least one dimension (..., in_features)")
        check_no_grad("fp8_linear", x=x)
        data, scale = x, None
        lead = x.shape[:-1]
    else:
        raise TypeError(f"x must be a torch.Tensor or an Fp8Rows, got {type(x).__name__}")
    if data.shape[-1] != in_features:
        raise ValueError(f"x has {data.shape[-1]} features in its last dimension; weight takes {in_features}")
    if data.device != weight.data.device:
        raise ValueError(f"x is on {data.device}, weight on {weight.data.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (out_features,) or bias.dtype != weight.dtype or bias.device != weight.data.device:
            raise ValueError(f"bias must be ({out_features},) {weight.dtype} on {weight.data.device}, got "
                             f"{tuple(bias.shape)} {bias.dtype} on {bias.device}")
        check_no_grad("fp8_linear", bias=bias)
    if out is None:
        return _linear(data, scale, weight.data, weight.scale, bias, weight.dtype).view(*lead, out_features)
    _check_out(out, (*lead, out_features), weight.dtype, data)
    _linear_out(data, scale, weight.data, weight.scale, bias, out.view(-1, out_features))
    return out


def _check_out(out, shape: tuple, dtype: torch.dtype, x: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != x.device:
        raise ValueError(f"out must be a {shape} {dtype} tensor on {x.device} (x's rows by out_features, in the "
                         f"layer's dtype), got {tuple(out.shape)} {out.dtype} on {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous (a row range of a larger buffer is), got strides {out.stride()}")
    check_no_grad("fp8_linear", out=out)
    # (addresses are not known while torch.compile traces: checked on eager calls)
    if not torch.compiler.is_compiling() and share_memory(out, x):
        raise ValueError("out must not overlap x")


def _linear_impl(x: torch.Tensor, x_scale: Optional[torch.Tensor], w: torch.Tensor, w_scale: torch.Tensor,
                 bias: Optional[torch.Tensor], out_dtype: torch.dtype,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(rows, N)`` in ``out_dtype``: x ``(..., K)`` e4m3 rows with their ``x_scale``, or a float
    x (``x_scale`` None) that is quantized here, or for at most ``rows_max`` rows multiplied as it
    is (:func:`_few_rows`); written into ``out`` (contiguous ``(rows, N)``) when given."""
    out_features, in_features = w.shape
    rows = x.numel() // in_features
    cfg = fp8_linear_config(gpu_family(w.device))
    if rows == 0:
        return torch.empty((0, out_features), dtype=out_dtype, device=w.device) if out is None else out
    if x_scale is None:
        if rows <= cfg.rows_max:
            return _few_rows(x, w, w_scale, bias, out_dtype, cfg, out)
        x, x_scale = quantize_rows(x)
    a = x.reshape(rows, in_features)
    if not a.is_contiguous():
        a = a.contiguous()
    gemm_out = out if out_dtype == _GEMM_OUT else None
    result = _gemm_impl(a, x_scale.reshape(rows, 1), w, w_scale, bias if out_dtype == _GEMM_OUT else None, gemm_out)
    if out_dtype != _GEMM_OUT:
        if out is None:
            result = result.to(out_dtype)
        else:
            result = out.copy_(result)
        if bias is not None:
            result += bias
    return result


def _linear_new_impl(x: torch.Tensor, x_scale: Optional[torch.Tensor], w: torch.Tensor, w_scale: torch.Tensor,
                     bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    return _linear_impl(x, x_scale, w, w_scale, bias, out_dtype)


def _linear_out_impl(x: torch.Tensor, x_scale: Optional[torch.Tensor], w: torch.Tensor, w_scale: torch.Tensor,
                     bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    _linear_impl(x, x_scale, w, w_scale, bias, out.dtype, out)


_linear_op = torch.library.custom_op("flashflow::fp8_linear", mutates_args=())(_linear_new_impl)


@_linear_op.register_fake
def _(x, x_scale, w, w_scale, bias, out_dtype):
    return x.new_empty((x.numel() // w.shape[1], w.shape[0]), dtype=out_dtype)


_linear_out_op = torch.library.custom_op("flashflow::fp8_linear_out", mutates_args=("out",))(_linear_out_impl)


@_linear_out_op.register_fake
def _(x, x_scale, w, w_scale, bias, out):
    return None


# eager calls skip the custom op's dispatch; torch.compile sees one opaque op (the config lookup
# it would otherwise trace reads a JSON file)
_linear = op_or_direct(_linear_op, _linear_new_impl)
_linear_out = op_or_direct(_linear_out_op, _linear_out_impl)


_WEIGHT_ROWS = Launcher(fp8_weight_rows_kernel)   # keyed on its arguments: no per-call binding


def _few_rows(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
              out_dtype: torch.dtype, cfg, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(rows, N)``: x's few rows times the e4m3 weight, x not quantized
    (:func:`flashflow.kernels.fp8_linear.fp8_weight_rows_kernel`), into ``out`` when given."""
    out_features, in_features = w.shape
    x2 = unit_last_stride(x).reshape(-1, in_features)
    if out is None:
        out = torch.empty((x2.shape[0], out_features), dtype=out_dtype, device=x2.device)
    launch_by_arguments(_WEIGHT_ROWS, (cdiv(out_features, cfg.BLOCK_N), 1, 1), (
        x2, w, w_scale, bias if bias is not None else w_scale, out,
        x2.shape[0], out_features, in_features, x2.stride(0), out.stride(0)),
        dict(HAS_BIAS=bias is not None, BLOCK_M=next_pow2(max(cfg.rows_max, 16)), BLOCK_N=cfg.BLOCK_N,
             BLOCK_K=cfg.BLOCK_K, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **dot_options(x2.dtype)))
    return out


# torch._scaled_mm, looked up when _gemm_impl runs (a test stands a refusing cuBLASLt in its place)
_scaled_mm = torch._scaled_mm
# what cuBLASLt's error says when it has no algorithm for a GEMM
_REFUSED = "CUBLAS_STATUS_NOT_SUPPORTED"
# (M, K, N, bias given, device index) -> the variant that runs, for the shapes whose configured
# variant cuBLASLt refuses; bounded (a shape past the bound is worked out again at each call)
_VARIANTS: dict = {}
_VARIANTS_MAX = 4096


def _variants(fast_accum: bool, has_bias: bool) -> list:
    """The distinct GEMM variants, ``(fast accumulation, bias in the epilogue)``, in the order
    tried: the configured one, then the configured accumulation with the bias added after the
    GEMM, then fp32 promotion with the bias in the epilogue, then after. The configured numerics
    come first: the bias added after costs one bf16 pass over the (M, N) output, small at the few
    rows cuBLASLt refuses, while fp32 promotion changes the accumulation (and is slower at every M)."""
    out = []
    for fast, epilogue in ((fast_accum, True), (fast_accum, False), (False, True), (False, False)):
        v = (fast, epilogue and has_bias)
        if v not in out:
            out.append(v)
    return out


def _gemm_impl(a: torch.Tensor, scale_a: torch.Tensor, w: torch.Tensor, scale_w: torch.Tensor,
               bias: Optional[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(a · scale_a) · (w · scale_w)ᵀ + bias`` in bf16: a ``(M, K)`` and w ``(N, K)`` e4m3,
    scale_a ``(M, 1)``, scale_w ``(1, N)`` float32.

    cuBLASLt has no algorithm for some shapes with fast accumulation and a bias in its epilogue
    (on sm90 K = 12288, N = 3072 at each M tried up to 33: ``CUBLAS_STATUS_NOT_SUPPORTED`` from its
    heuristic query); such a shape runs the first of :func:`_variants` that cuBLASLt takes
    (:func:`_gemm_refused`), remembered per shape and device so that the refusal is met once. A shape no
    variant runs is refused (``ValueError``)."""
    fast_accum = fp8_linear_config(gpu_family(a.device)).fast_accum
    # per device: two GPUs of one host may be of different kinds, with different cuBLASLt algorithms
    key = (a.shape[0], a.shape[1], w.shape[0], bias is not None, a.get_device())
    known = _VARIANTS.get(key)
    first = known or (fast_accum, bias is not None)
    try:
        return _gemm_variant(a, scale_a, w, scale_w, bias, *first, out=out)
    except RuntimeError as e:
        if _REFUSED not in str(e):
            raise
        return _gemm_refused(a, scale_a, w, scale_w, bias, fast_accum, key, first, e, out)


def _gemm_variant(a, scale_a, w, scale_w, bias, fast: bool, epilogue: bool, out=None) -> torch.Tensor:
    out = _scaled_mm(a, w.t(), scale_a=scale_a, scale_b=scale_w, bias=bias if epilogue else None,
                     out_dtype=_GEMM_OUT, use_fast_accum=fast, out=out)
    if bias is not None and not epilogue:
        out += bias
    return out


def _gemm_refused(a, scale_a, w, scale_w, bias, fast_accum: bool, key: tuple, refused_variant: tuple,
                  refused: RuntimeError, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`_gemm_impl` after cuBLASLt refused ``refused_variant``: the other variants in
    order; the one that runs is remembered for ``key`` (forgotten if it is the configured one).
    A refused heuristic query launches nothing: trying the next variant is safe inside a CUDA
    graph's capture (and under torch.compile this runs inside the opaque flashflow::fp8_linear)."""
    variants = _variants(fast_accum, bias is not None)
    for variant in variants:
        if variant == refused_variant:
            continue
        try:
            result = _gemm_variant(a, scale_a, w, scale_w, bias, *variant, out=out)
        except RuntimeError as e:
            if _REFUSED not in str(e):
                raise
            refused = e
            continue
        if variant == variants[0]:
            _VARIANTS.pop(key, None)
        elif key in _VARIANTS or len(_VARIANTS) < _VARIANTS_MAX:
            _VARIANTS[key] = variant
        return result
    (m, k), n = a.shape, w.shape[0]
    tried = "; ".join(("fast accumulation" if fast else "fp32 promotion")
                      + ("" if bias is None else ", the bias in the epilogue" if epilogue else ", the bias after")
                      for fast, epilogue in variants)
    raise ValueError(f"fp8_linear: cuBLASLt has no FP8 row-wise algorithm for the GEMM of shape M={m}, K={k}, "
                     f"N={n} ({'with' if bias is not None else 'without'} a bias; refused: {tried})") from refused


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` whose weight is e4m3 per output channel (:func:`quantize_weight`):
    ``forward(x)`` takes a float tensor or an :class:`~flashflow.ops.quant.Fp8Rows` and returns
    :func:`fp8_linear`'s output. Inference only (no backward: an input that requires grad is
    refused). ``weight`` (e4m3) and ``weight_scale`` are buffers; ``bias`` is the original
    layer's ``Parameter`` (or None)."""

    def __init__(self, weight: Fp8Weight, bias: Optional[nn.Parameter] = None):
        super().__init__()
        _check_weight(weight)
        self.out_features, self.in_features = weight.data.shape
        self.dtype = weight.dtype
        self.register_buffer("weight", weight.data)
        self.register_buffer("weight_scale", weight.scale)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, name: str = "linear") -> "Fp8Linear":
        """The FP8 form of ``linear`` (its weight quantized; its bias the same ``Parameter``)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{name} must be an nn.Linear, got {type(linear).__name__}")
        return cls(quantize_weight(linear.weight, f"{name}.weight"), linear.bias)

    @property
    def fp8_weight(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.weight_scale, self.dtype)

    def forward(self, x: Union[torch.Tensor, Fp8Rows], out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return fp8_linear(x, Fp8Weight(self.weight, self.weight_scale, self.dtype), self.bias, out)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight=float8_e4m3fn per channel, out dtype={self.dtype}")
