"""The decode-regime FFN kernels (policy "splitk" of flashflow.fused_mlp), through the
interpreter, against float64. The op-level tests of every policy are in test_mlp.py."""
import pytest
import torch

from flashflow import MlpWorkspace, fused_mlp
from flashflow.ops.ffn import decode_block_i, launch_decode
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
    out = fused_mlp(x, w1, w2, act, policy="splitk")
    assert out.shape == (m, hidden) and out.dtype == x.dtype
    assert rel(out, mlp_ref(x.double(), w1.double(), w2.double(), act)) < 5e-3


def test_leading_dims_and_fp32():
    x = torch.randn(2, 3, 48, dtype=torch.float32, device=DEVICE)
    w1, w2 = weights("gelu", 48, 96, torch.float32)
    out = fused_mlp(x, w1, w2, "gelu", policy="splitk")
    assert out.shape == (2, 3, 48)
    assert rel(out, mlp_ref(x.double(), w1.double(), w2.double(), "gelu")) < 1e-5


def test_accumulator_left_zeroed_for_the_next_call():
    x = torch.randn(5, 64, dtype=torch.float16, device=DEVICE)
    w1, w2 = weights("swiglu", 64, 160)
    acc = torch.zeros(5, 64, dtype=torch.float32, device=DEVICE)
    ref = mlp_ref(x.double(), w1.double(), w2.double())
    for _ in range(3):  # a stale accumulator would add the previous call's result
        assert rel(launch_decode(x, w1, w2, "swiglu", acc), ref) < 5e-3
        assert (acc == 0).all()
    ws = MlpWorkspace(64, max_tokens=5, device=DEVICE)
    for _ in range(2):
        assert rel(fused_mlp(x, w1, w2, workspace=ws, policy="splitk"), ref) < 5e-3
        assert int(ws.buffer.count_nonzero()) == 0


def test_slices_per_program():
    assert decode_block_i(14336, 132) == 64 and decode_block_i(28672, 132) == 128
    assert decode_block_i(160, 4) == 32  # interpreter: 5 programs add into every output element
