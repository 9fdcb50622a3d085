"""The FP8 row outputs on the GPU: quantize_rows, gelu_quantize_rows and the norms' ``fp8=True``
in bf16/fp16 at Qwen-Image 1024px's widths against the float64 fake quantization (tolerances:
tests/fp8_rows.py), rows with a NaN or ±inf, and CUDA-graph replay."""
import pytest
import torch
import torch.nn.functional as F

from flashflow.ops.norm import gate_residual_layernorm_modulate, layernorm_modulate
from flashflow.ops.quant import gelu_quantize_rows, quantize_rows
from flashflow.reference import norm as ref
from fp8_rows import assert_dequantized_close, assert_rows_match

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
TOKENS, DIM, HIDDEN = 4352, 3072, 12288


def _rows(*shape, dtype):
    x = torch.randn(*shape, device="cuda") + 0.3
    x[..., torch.randperm(shape[-1], device="cuda")[:shape[-1] // 64]] *= 30.0     # outlier channels
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows(gpu, dtype):
    x = _rows(1, TOKENS, DIM, dtype=dtype)
    got = quantize_rows(x)
    assert_rows_match(got, x.double(), 2 ** -21)
    assert_dequantized_close(got, x, 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_quantize_rows(gpu, dtype):
    h = _rows(1, TOKENS, HIDDEN, dtype=dtype)
    got = gelu_quantize_rows(h)
    assert_rows_match(got, F.gelu(h.double(), approximate="tanh"), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_fp8(gpu, dtype):
    b, l, d = 1, TOKENS, DIM
    x, y = _rows(b, l, d, dtype=dtype), torch.randn(b, l, d, device="cuda", dtype=dtype)
    gate, shift, scale = (torch.randn(b, d, device="cuda", dtype=dtype) for _ in range(3))
    got = layernorm_modulate(x, shift, scale, fp8=True)
    want = ref.layernorm_modulate(x.double(), shift.double(), scale.double(), 1e-6)
    assert_rows_match(got, want, 1e-5)
    new_res, got = gate_residual_layernorm_modulate(x, y, gate, shift, scale, fp8=True)
    assert torch.equal(new_res, gate_residual_layernorm_modulate(x, y, gate, shift, scale)[0])
    want = ref.layernorm_modulate(new_res.double(), shift.double(), scale.double(), 1e-6)
    assert_rows_match(got, want, 1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_rows(gpu, bad):
    x = _rows(4, 300, dtype=torch.bfloat16)
    x[1, 7] = bad
    assert_rows_match(quantize_rows(x), x.double(), 2 ** -21)
    assert_rows_match(gelu_quantize_rows(x), F.gelu(x.double(), approximate="tanh"), 1e-5)
    shift, scale = torch.randn(2, 1, 300, device="cuda").unbind(0)
    got = layernorm_modulate(x[None], shift, scale, fp8=True)
    assert torch.equal(got.scale.isnan().flatten().cpu(), torch.tensor([False, True, False, False]))


def test_cuda_graph_replay(gpu):
    x = _rows(2, 100, 1000, dtype=torch.bfloat16)
    graph, out = gpu.capture(lambda: gelu_quantize_rows(x))
    want = gelu_quantize_rows(x)
    x.copy_(_rows(2, 100, 1000, dtype=torch.bfloat16))
    graph.replay()
    fresh = gelu_quantize_rows(x)
    assert torch.equal(out.data.view(torch.uint8), fresh.data.view(torch.uint8)) and torch.equal(out.scale, fresh.scale)
    assert not torch.equal(out.scale, want.scale)
