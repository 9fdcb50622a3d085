"""FP8 linear layers (flashflow.ops.fp8_linear): e4m3 weights per output channel, e4m3 activations
per row, against the float64 fake-quantized reference and against the exact float64 product.

Under Triton's interpreter the row quantization is the kernel's; ``torch._scaled_mm`` is torch's
CPU implementation (the same math on the same e4m3 values). On a GPU it is cuBLASLt's.
"""
import dataclasses
import os
import secrets

import pytest
import torch
from torch import nn

import flashflow.ops.fp8_linear as fp8_linear_module
from flashflow.ops.fp8_linear import Fp8Linear, Fp8Weight, fp8_linear, quantize_weight
from flashflow.ops.quant import Fp8Rows, quantize_rows
from flashflow.reference.fp8_linear import fp8_linear_reference, quantize_weight_reference
from flashflow.reference.metrics import cosine, rel_l2

pytestmark = pytest.mark.kernels
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# K, N: multiples of 16 (the FP8 GEMM's operands); odd M
SHAPES = [(17, 16, 32), (33, 80, 112)]   # more rows than rows_max: quantized rows, the row-scaled GEMM


def fresh_seed() -> int:
    return int(os.environ.get("FLASHFLOW_TEST_SEED") or secrets.randbits(31))


def realistic(shape, seed, device, dtype):
    """Gaussian activations with a few outlier channels and a per-row offset (what quantization
    meets after a norm), rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x[..., ::7] *= 12.0                                     # outlier channels
    x += torch.randn((*shape[:-1], 1), generator=g, dtype=torch.float64)   # offsets
    return x.to(dtype).to(device)


def weights(n, k, seed, device, dtype, bias=True):
    g = torch.Generator().manual_seed(seed + 1)
    w = (torch.randn(n, k, generator=g, dtype=torch.float64) * k ** -0.5)
    w[::5] *= 4.0                                           # channels of different ranges
    b = torch.randn(n, generator=g, dtype=torch.float64) if bias else None
    return w.to(dtype).to(device), None if b is None else b.to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("given", ["tensor", "fp8-rows"])
def test_matches_the_fake_quantized_float64_product(device, dtype, m, k, n, given):
    seed = fresh_seed()
    x = realistic((m, k), seed, device, dtype)
    w, b = weights(n, k, seed, device, dtype)
    weight = quantize_weight(w)
    out = fp8_linear(x if given == "tensor" else quantize_rows(x), weight, b)
    assert out.shape == (m, n) and out.dtype == dtype
    rows = quantize_rows(x)   # the op's own e4m3 values (the quantize pass is tested in test_quant.py)
    given = (rows.data.double() * rows.scale.double()) @ (weight.data.double() * weight.scale.double().T).T
    # the GEMM on those values: the output rounded to bf16 (2^-8) once or, for fp16 layers, twice
    assert rel_l2(out, given + b.double()) < 1e-2, f"seed {seed}"
    # the float64 reference rounds v·448/amax once, the kernels in fp32: a value at an e4m3 tie may
    # land one step apart, which at these small K moves its output row by a few percent
    assert rel_l2(out, fp8_linear_reference(x, w, b)) < 5e-2, f"seed {seed}"
    exact = x.double() @ w.double().T + b.double()
    # 8-bit products of exact math: e4m3 keeps 3 mantissa bits on each operand
    assert cosine(out, exact) > 0.995 and rel_l2(out, exact) < 0.08, f"seed {seed}"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("m", [1, 5, 16])
def test_few_rows_are_multiplied_unquantized(device, dtype, m):
    """At most rows_max rows (the modulation's time-embedding row): flashflow's kernel multiplies x
    as it is with the widened e4m3 weight; NaN and inf go where the exact product puts them."""
    seed = fresh_seed()
    x = realistic((m, 80), seed, device, dtype)
    w, b = weights(112, 80, seed, device, dtype)
    weight = quantize_weight(w)
    out = fp8_linear(x, weight, b)
    own = x.double() @ (weight.data.double() * weight.scale.double().T).T   # only the weight quantized
    assert out.shape == (m, 112) and out.dtype == dtype
    assert rel_l2(out, own + b.double()) < 1e-2, f"seed {seed}"
    assert rel_l2(fp8_linear(x, weight), own) < 1e-2, f"seed {seed}"
    values, scale = quantize_weight_reference(w)   # the weight's values: one e4m3 step off at a tie
    assert rel_l2(out, x.double() @ (values * scale).T + b.double()) < 5e-2, f"seed {seed}"
    assert fp8_linear(x[None].transpose(0, 1), weight, b).shape == (m, 1, 112)
    x[0, 3] = float("nan")
    got = fp8_linear(x, weight, b)
    assert torch.isnan(got[0]).all() and torch.equal(got[1:], out[1:])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_weight_quantization_is_per_channel_e4m3(device, dtype):
    w, _ = weights(48, 80, fresh_seed(), device, dtype)
    w[3] = 0   # an all-zero channel keeps a finite scale and zero values
    fw = quantize_weight(w)
    assert fw.data.dtype == torch.float8_e4m3fn and fw.data.shape == (48, 80) and fw.data.is_contiguous()
    assert fw.scale.dtype == torch.float32 and fw.scale.shape == (1, 48) and fw.dtype == dtype
    values, scale = quantize_weight_reference(w)
    steps = (fw.data.double() - values).abs()
    # values agree but for an fp32 / float64 tie, one e4m3 step (≤ 2^-3 of the value at most, here ≤ 32 at 448)
    assert (steps > 0).float().mean() < 0.01 and (steps <= values.abs() / 8 + 2 ** -9).all()
    torch.testing.assert_close(fw.scale.double().reshape(-1, 1), scale, rtol=1e-6, atol=0)
    assert torch.isfinite(fw.scale).all() and (fw.data[3].float() == 0).all()
    assert (fw.data.float().abs().amax(dim=1)[torch.arange(48) != 3] == 448).all()   # every channel uses the range


def test_layouts_give_the_contiguous_bits(device):
    """Transposed and expanded (stride-0) views, a non-unit row stride and 3-d inputs."""
    dtype = torch.bfloat16
    seed = fresh_seed()
    w, b = weights(32, 48, seed, device, dtype)
    weight = quantize_weight(w)
    base = realistic((48, 10), seed, device, dtype)
    cases = {
        "transposed": base.t(),                                             # (10, 48), last stride 10
        "row-stride": realistic((10, 96), seed, device, dtype)[:, ::2],    # non-unit last stride
        "sliced-rows": realistic((10, 64), seed, device, dtype)[:, 16:],   # row stride 64
        "expanded": realistic((1, 48), seed, device, dtype).expand(25, 48),  # stride-0 rows
        "3-d view": realistic((2, 9, 48), seed, device, dtype).transpose(0, 1),
    }
    for name, x in cases.items():
        got = fp8_linear(x, weight, b)
        want = fp8_linear(x.contiguous(), weight, b)
        assert got.shape == (*x.shape[:-1], 32), name
        assert torch.equal(got, want), name


def test_a_non_finite_row_is_nan_the_others_exact(device):
    dtype = torch.bfloat16
    seed = fresh_seed()
    x = realistic((20, 48), seed, device, dtype)   # more than rows_max: the quantized path
    w, b = weights(16, 48, seed, device, dtype)
    weight = quantize_weight(w)
    clean = fp8_linear(x, weight, b)
    x[1, 5] = float("nan")
    x[4, 0] = float("inf")
    got = fp8_linear(x, weight, b)
    assert torch.isnan(got[1]).all() and torch.isnan(got[4]).all()
    keep = [i for i in range(20) if i not in (1, 4)]
    assert torch.equal(got[keep], clean[keep])


def test_fp8_linear_module(device):
    dtype = torch.float16
    linear = nn.Linear(48, 32).to(dtype).to(device)
    layer = Fp8Linear.from_linear(linear, "proj")
    x = realistic((3, 5, 48), fresh_seed(), device, dtype)
    with torch.no_grad():
        got = layer(x)
        assert torch.equal(got, fp8_linear(x, layer.fp8_weight, linear.bias))
        assert cosine(got, linear(x)) > 0.995
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.bias is linear.bias
    assert "float8_e4m3fn" in repr(layer)
    no_bias = Fp8Linear.from_linear(nn.Linear(48, 32, bias=False).to(dtype).to(device))
    assert no_bias.bias is None and no_bias(x).shape == (3, 5, 32)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("m", [3, 33], ids=["few-rows", "quantized-rows"])
@pytest.mark.parametrize("given", ["tensor", "fp8-rows"])
def test_out_takes_the_result_in_its_rows_of_a_larger_buffer(device, dtype, m, given):
    """``out=``: the rows of a buffer the result lands in, bit for bit what the call returns
    without it; the buffer's other rows untouched."""
    seed = fresh_seed()
    k, n = 48, 32
    x = realistic((1, m, k), seed, device, dtype)
    w, b = weights(n, k, seed, device, dtype)
    weight = quantize_weight(w)
    arg = x if given == "tensor" else quantize_rows(x)
    want = fp8_linear(arg, weight, b)
    buf = torch.full((1, m + 7, n), float("nan"), dtype=dtype, device=device)
    got = fp8_linear(arg, weight, b, out=buf[:, 2:2 + m])
    assert got.data_ptr() == buf[:, 2:].data_ptr() and got.shape == (1, m, n)
    assert torch.equal(buf[:, 2:2 + m], want)
    assert torch.isnan(buf[:, :2]).all() and torch.isnan(buf[:, 2 + m:]).all()
    layer = Fp8Linear(weight, b)
    buf.fill_(float("nan"))
    layer(arg, out=buf[:, 2:2 + m])
    assert torch.equal(buf[:, 2:2 + m], want) and torch.isnan(buf[:, :2]).all()


def test_out_with_a_non_finite_row(device):
    """A NaN row and an inf row of x: the same rows of out are NaN, the others equal the call
    without out bit for bit."""
    dtype = torch.bfloat16
    seed = fresh_seed()
    x = realistic((1, 20, 48), seed, device, dtype)
    x[0, 3, 7] = float("nan")
    x[0, 11, 0] = float("inf")
    w, b = weights(32, 48, seed, device, dtype)
    weight = quantize_weight(w)
    want = fp8_linear(x, weight, b)
    buf = torch.zeros((1, 22, 32), dtype=dtype, device=device)
    got = fp8_linear(x, weight, b, out=buf[:, 1:21])
    assert torch.isnan(got[0, 3]).all() and torch.isnan(got[0, 11]).all()
    keep = [i for i in range(20) if i not in (3, 11)]
    assert torch.equal(got[0, keep], want[0, keep]) and torch.isfinite(got[0, keep]).all()
    assert not buf[:, 0].any() and not buf[:, 21].any()


def test_out_under_torch_compile(device):
    dtype = torch.bfloat16
    seed = fresh_seed()
    w, b = weights(32, 48, seed, device, dtype)
    weight = quantize_weight(w)
    x = realistic((1, 20, 48), seed, device, dtype)

    def f(x, buf):
        fp8_linear(quantize_rows(x), weight, b, out=buf[:, 4:])
        return buf * 2

    eager_buf = torch.zeros((1, 24, 32), dtype=dtype, device=device)
    compiled_buf = torch.zeros_like(eager_buf)
    eager = f(x, eager_buf)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(x, compiled_buf)
    assert torch.equal(compiled, eager) and torch.equal(compiled_buf, eager_buf)


def _bad_cases(device):
    dtype = torch.bfloat16
    w = torch.randn(32, 48, dtype=dtype, device=device)
    weight = quantize_weight(w)
    x = torch.randn(4, 48, dtype=dtype, device=device)
    rows = quantize_rows(x)
    flat = torch.randn(288, dtype=dtype, device=device)
    return [
        ("weight must be an Fp8Weight", TypeError, lambda: fp8_linear(x, w)),
        ("x must be a torch.Tensor or an Fp8Rows", TypeError, lambda: fp8_linear(x.tolist(), weight)),
        ("x must be float16, bfloat16 or float32", ValueError, lambda: fp8_linear(x.int(), weight)),
        ("weight takes 48", ValueError, lambda: fp8_linear(x[:, :32], weight)),
        (r"bias must be \(32,\)", ValueError, lambda: fp8_linear(x, weight, torch.zeros(16, dtype=dtype, device=device))),
        (r"bias must be \(32,\)", ValueError, lambda: fp8_linear(x, weight, torch.zeros(32, device=device))),
        ("bias must be a torch.Tensor", TypeError, lambda: fp8_linear(x, weight, 0.5)),
        ("float8_e4m3fn data with float32 scales", ValueError,
         lambda: fp8_linear(Fp8Rows(rows.data.float(), rows.scale), weight)),
        (r"scale must have shape", ValueError, lambda: fp8_linear(Fp8Rows(rows.data, rows.scale[:2]), weight)),
        ("requires grad", ValueError, lambda: fp8_linear(x.float().requires_grad_(), quantize_weight(w.float()))),
        ("multiples of 16", ValueError, lambda: quantize_weight(w[:, :40])),
        ("must be 2-D", ValueError, lambda: quantize_weight(w[0])),
        ("NaN or an inf", ValueError, lambda: quantize_weight(torch.where(w > 2, float("inf"), w))),
        ("float16, bfloat16 or float32", ValueError, lambda: quantize_weight(w.double())),
        ("tensor subclass", TypeError, lambda: quantize_weight(w.as_subclass(_Subclass))),
        ("must be an nn.Linear", TypeError, lambda: Fp8Linear.from_linear(nn.Conv1d(48, 32, 1))),
        ("must be an Fp8Weight", TypeError, lambda: Fp8Linear((w, w, dtype))),
        (r"out must be a \(4, 32\) torch.bfloat16 tensor", ValueError,
         lambda: fp8_linear(x, weight, out=torch.empty(4, 33, dtype=dtype, device=device))),
        (r"out must be a \(4, 32\) torch.bfloat16 tensor", ValueError,
         lambda: fp8_linear(x, weight, out=torch.empty(4, 32, device=device))),
        ("out must be contiguous", ValueError,
         lambda: fp8_linear(x, weight, out=torch.empty(32, 4, dtype=dtype, device=device).t())),
        ("out must be a torch.Tensor or None", TypeError, lambda: fp8_linear(x, weight, out=[0.0])),
        ("out must not overlap x", ValueError, lambda: fp8_linear(flat[:192].view(4, 48), weight,
                                                                   out=flat[160:288].view(4, 32))),
        ("out requires grad", ValueError,
         lambda: fp8_linear(x, weight, out=torch.empty(4, 32, dtype=dtype, device=device, requires_grad=True))),
    ]


class _Subclass(torch.Tensor):
    pass


def test_bad_input_is_refused_before_any_launch(device):
    for match, error, call in _bad_cases(device):
        with pytest.raises(error, match=match):
            call()


def test_under_torch_compile(device):
    dtype = torch.bfloat16
    seed = fresh_seed()
    w, b = weights(32, 48, seed, device, dtype)
    weight = quantize_weight(w)
    x = realistic((2, 7, 48), seed, device, dtype)

    def f(x):
        return fp8_linear(quantize_rows(x), weight, b) + 1

    eager = f(x)
    compiled = torch.compile(f, backend="eager", fullgraph=True)(x)
    assert torch.equal(compiled, eager)


# what torch raises when cuBLASLt has no algorithm for a GEMM
REFUSED = "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic(...)`"


@pytest.fixture
def cublaslt(monkeypatch):
    """Installs a stand-in for the op's ``_scaled_mm`` that refuses the calls ``refuse(kwargs)``
    picks and otherwise runs the real one; returns its log of (M, fast accumulation, bias given).
    Fast accumulation is configured (sm90's setting; the interpreter's config has it off), and
    the op's remembered variants are cleared before and after."""
    fp8_linear_module._VARIANTS.clear()
    config = fp8_linear_module.fp8_linear_config
    monkeypatch.setattr(fp8_linear_module, "fp8_linear_config",
                        lambda family: dataclasses.replace(config(family), fast_accum=True))
    real, calls = fp8_linear_module._scaled_mm, []

    def install(refuse):
        def scaled_mm(a, b, **kwargs):
            calls.append((a.shape[0], kwargs["use_fast_accum"], kwargs["bias"] is not None))
            error = refuse(kwargs)
            if error is not None:
                raise error
            return real(a, b, **kwargs)
        monkeypatch.setattr(fp8_linear_module, "_scaled_mm", scaled_mm)
        return calls

    yield install
    fp8_linear_module._VARIANTS.clear()


REFUSALS = {   # what cuBLASLt refuses -> the variants tried, (fast accumulation, bias in the GEMM)
    "fast accumulation with a bias": (lambda kw: kw["use_fast_accum"] and kw["bias"] is not None,
                                      [(True, True), (True, False)]),
    "fast accumulation": (lambda kw: kw["use_fast_accum"], [(True, True), (True, False), (False, True)]),
}


@pytest.mark.parametrize("refusal", REFUSALS, ids=REFUSALS.keys())
def test_a_refused_gemm_runs_the_next_variant_once_worked_out(device, cublaslt, refusal):
    """cuBLASLt without an algorithm for a shape (fast accumulation and a bias: K = 12288,
    N = 3072, few rows on sm90): the bias added after, or else fp32 promotion; the variant that
    runs is remembered for the shape, another shape worked out again."""
    refused, tried = REFUSALS[refusal]
    calls = cublaslt(lambda kw: RuntimeError(REFUSED) if refused(kw) else None)
    dtype = torch.bfloat16   # a bf16 layer's bias goes to the GEMM
    seed = fresh_seed()
    x = realistic((33, 80), seed, device, dtype)
    w, b = weights(112, 80, seed, device, dtype)
    weight = quantize_weight(w)
    out = fp8_linear(x, weight, b)
    assert [(c[1], c[2]) for c in calls] == tried and {c[0] for c in calls} == {33}
    rows = quantize_rows(x)
    given = (rows.data.double() * rows.scale.double()) @ (weight.data.double() * weight.scale.double().T).T
    assert out.shape == (33, 112) and out.dtype == dtype
    assert rel_l2(out, given + b.double()) < 1e-2, f"seed {seed}"
    del calls[:]
    assert torch.equal(fp8_linear(x, weight, b), out)
    assert calls == [(33, *tried[-1])]   # the remembered variant alone
    # remembered per device too (two GPUs of one host may differ)
    assert list(fp8_linear_module._VARIANTS) == [(33, 80, 112, True, x.get_device())]
    del calls[:]
    fp8_linear(x[:20], weight, b)   # another shape: refused once more
    assert calls == [(20, *v) for v in tried]
    del calls[:]
    fp8_linear(x, weight)   # no bias: a shape of its own
    assert [(c[1], c[2]) for c in calls] == ([(True, False)] if len(tried) == 2 else [(True, False), (False, False)])


def test_a_gemm_no_variant_runs_is_refused_naming_its_shape(device, cublaslt):
    calls = cublaslt(lambda kw: RuntimeError(REFUSED))
    dtype = torch.bfloat16
    seed = fresh_seed()
    x = realistic((33, 80), seed, device, dtype)
    w, b = weights(112, 80, seed, device, dtype)
    weight = quantize_weight(w)
    for _ in range(2):   # refused each time, nothing remembered
        del calls[:]
        with pytest.raises(ValueError, match=r"no FP8 row-wise algorithm for the GEMM of shape M=33, K=80, N=112"):
            fp8_linear(x, weight, b)
        assert [(c[1], c[2]) for c in calls] == [(True, True), (True, False), (False, True), (False, False)]
    with pytest.raises(ValueError, match=r"M=33, K=80, N=112 \(without a bias"):
        fp8_linear(x, weight)


def test_another_gemm_error_propagates_as_it_is(device, cublaslt):
    oom = RuntimeError("CUDA error: out of memory")
    calls = cublaslt(lambda kw: oom)
    dtype = torch.bfloat16
    seed = fresh_seed()
    x = realistic((33, 80), seed, device, dtype)
    w, b = weights(112, 80, seed, device, dtype)
    with pytest.raises(RuntimeError) as raised:
        fp8_linear(x, quantize_weight(w), b)
    assert raised.value is oom and len(calls) == 1


def test_fp8_weight_is_a_named_tuple():
    assert Fp8Weight._fields == ("data", "scale", "dtype")


@pytest.mark.parametrize("layout", ["transposed", "strided-rows"])
def test_a_refused_gemm_on_strided_and_non_finite_rows(device, cublaslt, layout):
    """The variant with the bias after the GEMM takes the op's other inputs as the configured one
    does: rows read through a transposed view or a row stride give the contiguous rows' bits, and
    a row holding a NaN or an inf comes out NaN with the other rows untouched."""
    cublaslt(lambda kw: RuntimeError(REFUSED) if kw["use_fast_accum"] and kw["bias"] is not None else None)
    dtype = torch.bfloat16
    seed = fresh_seed()
    x = realistic((24, 80), seed, device, dtype)
    w, b = weights(112, 80, seed, device, dtype)
    weight = quantize_weight(w)
    clean = fp8_linear(x, weight, b)
    if layout == "transposed":
        view = x.t().contiguous().t()                        # strides (1, 24)
    else:
        view = torch.cat([x, x], dim=1)[:, :80]              # row stride 160
    assert not view.is_contiguous() and torch.equal(view, x)
    assert torch.equal(fp8_linear(view, weight, b), clean)
    x[3, 7] = float("nan")
    x[9, 0] = float("-inf")
    got = fp8_linear(x, weight, b)
    assert torch.isnan(got[3]).all() and torch.isnan(got[9]).all()
    keep = [i for i in range(24) if i not in (3, 9)]
    assert torch.equal(got[keep], clean[keep])
