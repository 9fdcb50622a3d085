"""Fused FFN (decode regime) against the float64 reference, through Triton's interpreter."""
import pytest
import torch

from flashflow.ops.ffn import decode_block_i, fused_mlp, make_workspace
from flashflow.reference.mlp import mlp_ref
from flashflow.tuning import interpreting

pytestmark = pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a CUDA GPU")
DEVICE = "cuda" if (torch.cuda.is_available() and not interpreting()) else "cpu"


def weights(act, hidden, inter, dtype=torch.float16):
    rows = 2 * inter if act == "swiglu" else inter
    w1 = torch.randn(rows, hidden, dtype=dtype, device=DEVICE) / hidden ** 0.5
    w2 = torch.randn(hidden, inter, dtype=dtype, device=DEVICE) / inter ** 0.5
    return w1, w2


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("act", ["swiglu", "gelu", "silu", "relu"])
@pytest.mark.parametrize("m,hidden,inter", [(1, 48, 96), (3, 80, 160), (37, 64, 100)])
def test_activations_odd_shapes(act, m, hidden, inter):
    x = torch.randn(m, hidden, dtype=torch.float16, device=DEVICE)
    w1, w2 = weights(act, hidden, inter)
    out = fused_mlp(x, w1, w2, act)
    assert out.shape == (m, hidden) and out.dtype == x.dtype
    assert rel(out, mlp_ref(x.double(), w1.double(), w2.double(), act)) < 5e-3


def test_leading_dims_and_fp32():
    x = torch.randn(2, 3, 48, dtype=torch.float32, device=DEVICE)
    w1, w2 = weights("gelu", 48, 96, torch.float32)
    out = fused_mlp(x, w1, w2, "gelu")
    assert out.shape == (2, 3, 48)
    assert rel(out, mlp_ref(x.double(), w1.double(), w2.double(), "gelu")) < 1e-5


def test_workspace_reused_and_left_zeroed():
    x = torch.randn(5, 64, dtype=torch.float16, device=DEVICE)
    w1, w2 = weights("swiglu", 64, 160)
    ws = make_workspace(5, 64, DEVICE)
    ref = mlp_ref(x.double(), w1.double(), w2.double())
    for _ in range(3):  # a stale workspace or counter would add the previous call's result
        assert rel(fused_mlp(x, w1, w2, workspace=ws), ref) < 5e-3
        assert (ws == 0).all()


def test_many_programs_split_the_intermediate():
    # the split-K over the intermediate must combine more than one program's partial
    assert decode_block_i(14336, 132) == 64 and decode_block_i(28672, 132) == 128
    assert decode_block_i(160, 4) == 32  # interpreter: 5 programs for intermediate 160


def test_prefill_sizes_fall_back_correctly():
    x = torch.randn(70, 32, dtype=torch.float16, device=DEVICE)
    w1, w2 = weights("relu", 32, 48)
    assert rel(fused_mlp(x, w1, w2, "relu"), mlp_ref(x.double(), w1.double(), w2.double(), "relu")) < 5e-3


def test_bad_inputs():
    x = torch.randn(2, 48, dtype=torch.float16, device=DEVICE)
    w1, w2 = weights("swiglu", 48, 96)
    with pytest.raises(ValueError, match="activation must be one of"):
        fused_mlp(x, w1, w2, "tanh")
    with pytest.raises(ValueError, match=r"w_gate_up must be \(2·intermediate, hidden\)"):
        fused_mlp(x, w1[:96], w2, "swiglu")
    with pytest.raises(TypeError, match="share a dtype"):
        fused_mlp(x.float(), w1, w2)
    with pytest.raises(ValueError, match="policy"):
        fused_mlp(x, w1, w2, policy="rowblock")
    with pytest.raises(ValueError, match="workspace must be float32"):
        fused_mlp(x, w1, w2, workspace=make_workspace(3, 48, DEVICE))
