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


@pytest.mark.parametrize("stagger", [1, 2])
@pytest.mark.parametrize("m,hidden,inter", [(3, 80, 160), (9, 100, 96)])
def test_staggered_loop_starts(stagger, m, hidden, inter):
    # programs start their K and output loops at tile (program id mod tiles) and wrap around:
    # several programs and several, partly masked, tiles per loop; the cast's PDL flag is a no-op
    # off sm90 (the interpreter runs the plain launch)
    x = torch.randn(m, hidden, dtype=torch.float16, device=DEVICE)
    w1, w2 = weights("swiglu", hidden, inter)
    acc = torch.zeros(m, hidden, dtype=torch.float32, device=DEVICE)
    cfg = {"BLOCK_I": 16, "BLOCK_K": 32, "BLOCK_N": 32, "num_stages": 1, "stagger": stagger, "pdl": True}
    out = launch_decode(x, w1, w2, "swiglu", acc, cfg)
    assert rel(out, mlp_ref(x.double(), w1.double(), w2.double())) < 5e-3
    assert (acc == 0).all()


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("m,hidden,inter", [(3, 80, 160), (9, 100, 112), (1, 48, 96)])
def test_grouped_partials(act, group, m, hidden, inter):
    """``group`` slices' partials summed on chip (h through memory, ticketed GEMM1 items that
    wait on their group's counter): odd groups (the last one short), chunks of the output that
    end mid-step, fewer programs than tickets; the counters and the accumulator end zeroed, so
    the second call on the same buffers is right too."""
    from flashflow.kernels.mlp import CNT_OFF
    from flashflow.ops.ffn import group_counters

    w1, w2 = weights(act, hidden, inter)
    acc = torch.zeros(m, hidden, dtype=torch.float32, device=DEVICE)
    cfg = {"BLOCK_I": 16, "BLOCK_K": 32, "BLOCK_N": 16, "num_stages": 1, "stagger": 2, "group": group}
    n_groups = group_counters(inter, 16, group)
    sync = torch.zeros(CNT_OFF + 64 + n_groups, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        x = torch.randn(m, hidden, dtype=torch.float16, device=DEVICE)
        out = launch_decode(x, w1, w2, act, acc, cfg, sync=sync, grp_off=CNT_OFF + 64)
        assert rel(out, mlp_ref(x.double(), w1.double(), w2.double(), act)) < 5e-3
        assert (acc == 0).all() and int(sync.count_nonzero()) == 0
    with pytest.raises(ValueError, match="sync must be a zeroed int32 tensor"):
        launch_decode(x, w1, w2, act, acc, cfg, sync=sync[:CNT_OFF], grp_off=CNT_OFF)
    for bad in (1, 3, -2):
        with pytest.raises(ValueError, match=r"config\['group'\] must be 0"):
            launch_decode(x, w1, w2, act, acc, dict(cfg, group=bad))


def test_decode_config_rules(monkeypatch):
    # the GPU branch of decode_config, with an H100's 132 SMs (no GPU needed to pick tiles)
    import flashflow.ops.ffn as ffn
    monkeypatch.setattr(ffn, "_sm_count", lambda device: 132)
    gpu = torch.device("cuda", 0)
    c8 = ffn.decode_config(16, 14336, True, gpu)   # Llama-3-8B: 224 programs of 64, staggered
    assert (c8["BLOCK_I"], c8["BLOCK_K"], c8["stagger"], c8["pdl"]) == (64, 128, 2, True)
    c70 = ffn.decode_config(16, 28672, True, gpu)  # Llama-3-70B: 128-wide slices, unstaggered
    assert (c70["BLOCK_I"], c70["BLOCK_K"], c70["stagger"], c70["pdl"]) == (128, 64, 0, True)
    # M > 32: 112 programs of 128 in one wave instead of 224 of 64 in two
    w = ffn.decode_config(64, 14336, True, gpu)
    assert (w["BLOCK_I"], w["BLOCK_K"], w["BLOCK_N"], w["num_warps"]) == (128, 64, 64, 8)
    assert ffn.decode_config(32, 14336, True, gpu)["BLOCK_I"] == 64
    assert ffn.decode_config(64, 28672, True, gpu)["BLOCK_I"] == 128 and ffn.decode_config(64, 28672, True, gpu)["num_warps"] == 4
    assert ffn.decode_config(64, 14336, False, gpu)["BLOCK_I"] == 64  # not gated: unmeasured, unchanged
    assert ffn.decode_config(64, 8192, True, gpu)["BLOCK_I"] == 32    # 32-wide slices: the rule is for 64
