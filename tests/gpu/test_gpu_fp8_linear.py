"""FP8 linear layers on the GPU (cuBLASLt's row-wise scaled GEMM, flashflow's row quantization)
at Qwen-Image's widths: against the float64 fake-quantized product (the same e4m3 values) and the
exact product, bf16 and fp16 layers, the norms' and the GELU pass's FP8 rows as inputs, strided
inputs, non-finite rows, and CUDA-graph replays."""
import pytest
import torch

from flashflow.device import gpu_family
from flashflow.ops.fp8_linear import fp8_linear, quantize_weight
from flashflow.ops.quant import gelu_quantize_rows, quantize_rows
from flashflow.reference.fp8_linear import fp8_linear_reference, quantize_weight_reference
from flashflow.reference.metrics import cosine, rel_l2
from flashflow.tuning.fp8_linear import fp8_linear_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or gpu_family(torch.device("cuda")) != "sm90",
                                 reason="FP8 GEMMs with row-wise scales run on Hopper (sm90) and newer")]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (M, K, N): text rows and image rows of a Qwen-Image block, its q/k/v, MLP and output shapes; odd M
SHAPES = [(256, 3072, 9216), (4099, 3072, 12288), (1000, 12288, 3072), (1, 3072, 18432), (7, 3072, 18432)]


def _inputs(m, k, n, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.float32)
    x[:, ::97] *= 20.0                                       # outlier channels
    x += torch.randn(m, 1, device="cuda", generator=g)        # per-token offsets
    w = torch.randn(n, k, device="cuda", generator=g) * k ** -0.5
    b = torch.randn(n, device="cuda", generator=g)
    return x.to(dtype), w.to(dtype), b.to(dtype)


def _rows(m, count=64):
    """The rows checked in float64 (all of a small M)."""
    return torch.arange(m, device="cuda") if m <= count else torch.linspace(0, m - 1, count, device="cuda").long()


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_against_float64(dtype, m, k, n):
    x, w, b = _inputs(m, k, n, dtype)
    weight = quantize_weight(w)
    out = fp8_linear(x, weight, b)
    assert out.shape == (m, n) and out.dtype == dtype and torch.isfinite(out).all()
    rows = _rows(m)
    if m <= fp8_linear_config(gpu_family(x.device)).rows_max:   # few rows: x multiplied unquantized
        values, scale = quantize_weight_reference(w)
        want = x[rows].double() @ (values * scale).T + b.double()
    else:
        want = fp8_linear_reference(x[rows], w, b)
    assert rel_l2(out[rows], want) < 1e-2
    exact = x[rows].double() @ w.double().T + b.double()
    assert cosine(out[rows], exact) > 0.998 and rel_l2(out[rows], exact) < 0.06


def test_rows_from_the_gelu_pass_and_strided_inputs():
    x, w, b = _inputs(777, 3072, 12288, torch.bfloat16)
    h = fp8_linear(x, quantize_weight(w), b)
    w2 = torch.randn(3072, 12288, device="cuda", dtype=torch.bfloat16) * 12288 ** -0.5
    out = fp8_linear(gelu_quantize_rows(h), quantize_weight(w2))
    rows = _rows(777)
    gelu = torch.nn.functional.gelu(h[rows].double(), approximate="tanh")
    assert cosine(out[rows], gelu @ w2.double().T) > 0.998
    wide = torch.randn(2, 500, 3072 + 64, device="cuda", dtype=torch.bfloat16)[..., 32:32 + 3072]
    weight = quantize_weight(w)
    assert torch.equal(fp8_linear(wide, weight, b), fp8_linear(wide.contiguous(), weight, b))
    assert torch.equal(fp8_linear(wide, weight, b), fp8_linear(quantize_rows(wide), weight, b))


def test_non_finite_rows_are_nan_and_the_others_untouched():
    x, w, b = _inputs(300, 3072, 3072, torch.bfloat16)
    weight = quantize_weight(w)
    clean = fp8_linear(x, weight, b)
    x[7, 100], x[200, 3000] = float("nan"), float("-inf")
    got = fp8_linear(x, weight, b)
    assert torch.isnan(got[7]).all() and torch.isnan(got[200]).all()
    keep = torch.ones(300, dtype=torch.bool, device="cuda")
    keep[[7, 200]] = False
    assert torch.equal(got[keep], clean[keep])


def test_cuda_graph_replays():
    x, w, b = _inputs(512, 3072, 3072, torch.bfloat16)
    weight = quantize_weight(w)
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fp8_linear(static_x, weight, b)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fp8_linear(static_x, weight, b)
    for seed in range(3):
        fresh, _, _ = _inputs(512, 3072, 3072, torch.bfloat16, seed=seed + 1)
        static_x.copy_(fresh)
        static_out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(static_out, fp8_linear(fresh, weight, b))


@pytest.mark.parametrize("m", [17, 24, 32, 33, 40, 47, 48, 64])
def test_shapes_cublaslt_refuses_with_fast_accumulation_and_a_bias(m):
    """Qwen-Image's text MLP down-projection (K 12288, N 3072) at a short prompt's row counts:
    cuBLASLt has no fast-accumulation algorithm with a bias in the epilogue for some of them; the
    call still gives the fake-quantized product, eagerly and captured in a CUDA graph (where the
    refused variant is worked out before capture or, for a new shape, inside it)."""
    fresh, w, b = _inputs(m + 1, 12288, 3072, torch.bfloat16, seed=m)   # fresh: a shape first met in the capture
    x = fresh[:m]
    weight = quantize_weight(w)
    want = fp8_linear_reference(x, w, b)
    out = fp8_linear(x, weight, b)
    assert torch.isfinite(out).all() and rel_l2(out, want) < 1e-2
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_linear(x, weight, b)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = fp8_linear(x, weight, b)
        captured_fresh = fp8_linear(fresh, weight, b)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)
    assert rel_l2(captured_fresh, fp8_linear_reference(fresh, w, b)) < 1e-2
