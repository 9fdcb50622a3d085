"""NaN and inf propagation per op on the GPU (tests/nonfinite_cases.py), bf16 and fp16: a
non-finite input reaches the outputs that depend on it, and only those. FP8 attention's are in
tests/gpu/test_gpu_attention_fp8.py."""
import pytest
import torch

from nonfinite_cases import check_attention_backward, check_attention_forward, check_decode, check_ffn, check_norm

pytestmark = pytest.mark.gpu
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


@DTYPES
@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_attention_forward(which, causal, bad, dtype):
    check_attention_forward(which, bad, causal, "cuda", dtype, sizes=(2, 300, 517, 8, 2, 128))


@DTYPES
@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
def test_attention_backward(which, bad, dtype):
    check_attention_backward(which, bad, "cuda", dtype, sizes=(2, 300, 517, 8, 2, 128))


@DTYPES
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("where", ["q", "k_new", "cached_v", "past_length"])
def test_decode(where, paged, dtype):
    check_decode(where, "nan", "cuda", dtype, paged=paged)


@DTYPES
@pytest.mark.parametrize("m", [5, 300], ids=["split-k", "persistent"])
@pytest.mark.parametrize("where", ["x", "w_gate_up", "w_down"])
def test_ffn(where, m, dtype):
    check_ffn(where, "nan", "cuda", dtype, m=m)


@DTYPES
@pytest.mark.parametrize("op,where", [("gate_residual_layernorm_modulate", "y"), ("gate_residual_layernorm_modulate", "gate"),
                                      ("layernorm_modulate", "shift"), ("rmsnorm_rope", "x"), ("rmsnorm_rope", "weight")])
def test_norm(op, where, dtype):
    check_norm(op, where, "nan", "cuda", dtype)
