"""NaN and inf propagation per op (tests/nonfinite_cases.py) through Triton's interpreter: a
non-finite input reaches the outputs that depend on it, and only those. FP8 attention has its own
in tests/ops/test_attention_fp8.py."""
import pytest
import torch

from flashflow.device import interpreting
from nonfinite_cases import check_attention_backward, check_attention_forward, check_decode, check_ffn, check_norm

pytestmark = pytest.mark.skipif(not interpreting(), reason="the CPU run of tests/gpu/test_gpu_nonfinite.py")


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_attention_forward(which, causal, bad):
    check_attention_forward(which, bad, causal, "cpu", torch.float16)


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
def test_attention_backward(which, bad):
    check_attention_backward(which, bad, "cpu", torch.float32)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("where", ["q", "k_new", "cached_v", "past_length"])
def test_decode(where, paged):
    check_decode(where, "nan", "cpu", torch.float16, paged=paged)


@pytest.mark.parametrize("m", [5, 70], ids=["split-k", "persistent"])
@pytest.mark.parametrize("where", ["x", "w_gate_up", "w_down"])
def test_ffn(where, m):
    check_ffn(where, "nan", "cpu", torch.float32, m=m)


@pytest.mark.parametrize("where", ["y", "shift", "scale", "residual", "gate"])
def test_gate_residual_layernorm_modulate(where):
    check_norm("gate_residual_layernorm_modulate", where, "nan", "cpu", torch.float32)


@pytest.mark.parametrize("where", ["y", "shift", "scale"])
def test_layernorm_modulate(where):
    check_norm("layernorm_modulate", where, "inf", "cpu", torch.float32)


@pytest.mark.parametrize("where", ["x", "weight"])
def test_rmsnorm_rope(where):
    check_norm("rmsnorm_rope", where, "nan", "cpu", torch.float32)
