"""Fused FFN (flashflow.ops.mlp) through Triton's interpreter, against float64.

The interpreter runs programs one after another in program-id order, so these tests check the
arithmetic, the tile orders (the Triton ticket map against the Python one, and that every
dependency has a smaller ticket), the workspace protocol (counters and accumulators left zeroed,
repeated calls) and the bounded-spin failure path. Concurrency itself is checked on the GPU by
scripts/gpu_mlp.py.
"""
import pytest
import torch

from flashflow.kernels.mlp import CNT_OFF, HALFROW, MULTIROW, SEQSPLIT, SEQUENTIAL, mlp_ticket_map_kernel
from flashflow.ops import mlp
from flashflow.ops.mlp import (MlpWorkspace, PersistentConfig, SplitKConfig, dependency_violations, fused_mlp,
                               issue_order, launch_persistent, launch_splitk, mlp_two_kernels, mlp_two_streams,
                               parse_policy, resolve_policy)
from flashflow.reference.mlp import ACTIVATIONS, mlp_ref
from flashflow.tuning import interpreting

pytestmark = pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a CUDA GPU")
DEVICE = "cuda" if (torch.cuda.is_available() and not interpreting()) else "cpu"
TOL = 5e-3
PERSISTENT = ("sequential", "rowblock", "multirow", "multirow:2", "halfrow", "seqsplit", "sequential:2")


def weights(act, hidden, inter, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * inter if act == "swiglu" else inter
    w1 = (torch.randn(rows, hidden, generator=g) / hidden ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(hidden, inter, generator=g) / inter ** 0.5).to(DEVICE, dtype)
    return w1, w2


def tokens(m, hidden, dtype=torch.float16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, hidden, generator=g).to(DEVICE, dtype)


def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def ref_of(x, w1, w2, act):
    return mlp_ref(x.double(), w1.double(), w2.double(), act)


# --------------------------------------------------------------------------------------------
# numerics
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("m,hidden,inter", [(1, 48, 96), (3, 80, 160), (37, 48, 160)])
def test_decode_splitk_matches_float64(act, m, hidden, inter):
    x = tokens(m, hidden)
    w1, w2 = weights(act, hidden, inter)
    out = fused_mlp(x, w1, w2, act, "splitk")
    assert out.shape == (m, hidden) and out.dtype == x.dtype
    assert rel(out, ref_of(x, w1, w2, act)) < TOL


@pytest.mark.parametrize("policy", PERSISTENT)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_persistent_every_policy_and_activation(act, policy):
    # 70 tokens, hidden 80, intermediate 160: 3 row-blocks × 5 GEMM0 × 3 GEMM1 tiles of 32
    x = tokens(70, 80)
    w1, w2 = weights(act, 80, 160)
    out = fused_mlp(x, w1, w2, act, policy)
    assert out.shape == (70, 80)
    assert rel(out, ref_of(x, w1, w2, act)) < TOL


@pytest.mark.parametrize("policy", ["halfrow", "multirow:2", "sequential", "seqsplit:2"])
def test_persistent_odd_m_130(policy):
    x = tokens(130, 48)
    w1, w2 = weights("swiglu", 48, 96)
    assert rel(fused_mlp(x, w1, w2, "swiglu", policy), ref_of(x, w1, w2, "swiglu")) < TOL


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_baselines_two_kernels_and_two_streams(act):
    x = tokens(37, 80)
    w1, w2 = weights(act, 80, 96)
    ref = ref_of(x, w1, w2, act)
    assert rel(mlp_two_kernels(x, w1, w2, act), ref) < TOL
    assert rel(mlp_two_streams(x, w1, w2, act), ref) < TOL


def test_auto_leading_dims_vectors_fp32_and_empty():
    w1, w2 = weights("gelu", 48, 96, torch.float32)
    x = torch.randn(2, 3, 48, device=DEVICE)                 # 6 tokens: split-K
    out = fused_mlp(x, w1, w2, "gelu")
    assert out.shape == (2, 3, 48) and out.dtype == torch.float32
    assert rel(out, ref_of(x, w1, w2, "gelu")) < 1e-5
    x = torch.randn(2, 40, 48, device=DEVICE)[:, ::2]        # 40 strided tokens... still split-K
    assert rel(fused_mlp(x, w1, w2, "gelu"), ref_of(x, w1, w2, "gelu")) < 1e-5
    x = torch.randn(3, 33, 48, device=DEVICE)                # 99 tokens: persistent kernel
    assert rel(fused_mlp(x, w1, w2, "gelu"), ref_of(x, w1, w2, "gelu")) < 1e-5
    v = torch.randn(48, device=DEVICE)
    assert fused_mlp(v, w1, w2, "gelu").shape == (48,)
    assert fused_mlp(torch.empty(0, 48, device=DEVICE), w1, w2, "gelu").shape == (0, 48)


def test_custom_op_matches_direct_call():
    x = tokens(5, 48)
    w1, w2 = weights("relu", 48, 96)
    via_op = torch.ops.flashflow.fused_mlp(x, w1, w2, "relu", "auto")
    assert torch.equal(via_op, fused_mlp(x, w1, w2, "relu"))


# --------------------------------------------------------------------------------------------
# scheduling: fewer programs than tiles, repeated calls, tile orders
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy,programs", [("halfrow", 1), ("halfrow", 2), ("multirow", 2), ("sequential", 2),
                                             ("seqsplit", 1), ("seqsplit", 2)])
def test_fewer_programs_than_tiles(policy, programs):
    x = tokens(70, 48)
    w1, w2 = weights("swiglu", 48, 96)
    cfg = PersistentConfig(BLOCK_M=16, BLOCK_N0=16, BLOCK_N1=16, BLOCK_K=16, num_warps=4, num_stages=1)
    tiles = 5 * (6 + (2 if policy in ("halfrow", "seqsplit") else 1) * 3)      # 5 row-blocks, 6 + 3 tiles each
    assert tiles >= 20 * programs
    ws = MlpWorkspace(48, max_tokens=70, device=DEVICE)
    out = launch_persistent(x, w1, w2, "swiglu", policy, 2, workspace=ws, config=cfg, num_programs=programs)
    assert rel(out, ref_of(x, w1, w2, "swiglu")) < TOL
    assert int(ws.buffer.count_nonzero()) == 0


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_tma_path_every_policy(act, monkeypatch):
    """The descriptor path (sm90's default; the interpreter emulates descriptors): odd sizes, so
    the copy engine's zero fill stands in for every mask (a gate tile past ``inter`` must not
    read up rows); out and H start as NaN, so a tile never written shows."""
    made = []
    real = mlp._descriptors
    monkeypatch.setattr(mlp, "_descriptors", lambda *a: made.append(real(*a)) or made[-1])
    m, hidden, inter = 70, 80, 168
    x = tokens(m, hidden)
    w1, w2 = weights(act, hidden, inter)
    ref = ref_of(x, w1, w2, act)
    cfg = PersistentConfig(BLOCK_M=32, BLOCK_N0=32, BLOCK_N1=32, BLOCK_K=32, num_warps=4, num_stages=1, use_tma=True)
    for policy, rows in (("sequential", 2), ("multirow", 2), ("rowblock", 1), ("halfrow", 1), ("seqsplit", 2)):
        ws = MlpWorkspace(hidden, max_tokens=m, device=DEVICE)
        out = torch.full((m, hidden), float("nan"), dtype=x.dtype, device=DEVICE)
        h = torch.full((m, inter), float("nan"), dtype=x.dtype, device=DEVICE)
        launch_persistent(x, w1, w2, act, policy, rows, workspace=ws, config=cfg, out=out, h=h)
        assert made[-1] is not None, "descriptor path not taken"
        assert rel(out, ref) < TOL, policy
        assert int(ws.buffer.count_nonzero()) == 0, policy


def test_repeated_calls_share_one_workspace():
    """A counter or accumulator left dirty by one call would corrupt the next one."""
    ws = MlpWorkspace(48, max_tokens=130, device=DEVICE)
    w1, w2 = weights("swiglu", 48, 96)
    calls = [(5, "splitk"), (130, "halfrow"), (5, "splitk"), (64, "splitk"), (70, "sequential"),
             (130, "multirow:2"), (130, "rowblock"), (130, "seqsplit"), (1, "auto"), (40, "auto"), (100, "two-streams")]
    for seed, (m, policy) in enumerate(calls):
        x = tokens(m, 48, seed=seed)
        if policy == "two-streams":
            out = mlp_two_streams(x, w1, w2, "swiglu", workspace=ws)
        else:
            out = fused_mlp(x, w1, w2, "swiglu", policy, workspace=ws)
        assert rel(out, ref_of(x, w1, w2, "swiglu")) < TOL, (m, policy)
        assert int(ws.buffer.count_nonzero()) == 0, (m, policy)


def test_calls_without_a_workspace_share_the_kept_one():
    """Calls that pass no workspace take flashflow's, kept per (device, stream) and grown on
    demand: a growth, then smaller calls of every kind, each correct, the buffer left zeroed."""
    from flashflow.ops import mlp as om
    om._IMPLICIT.clear()
    w1, w2 = weights("swiglu", 48, 96)
    calls = [(3, "splitk"), (130, "multirow:2"), (7, "auto"), (64, "halfrow"), (1, "splitk"), (100, "two-streams")]
    sizes = []
    for seed, (m, policy) in enumerate(calls):
        x = tokens(m, 48, seed=seed)
        out = mlp_two_streams(x, w1, w2, "swiglu") if policy == "two-streams" else fused_mlp(x, w1, w2, "swiglu", policy)
        assert rel(out, ref_of(x, w1, w2, "swiglu")) < TOL, (m, policy)
        (buf,) = om._IMPLICIT.values()
        assert int(buf.count_nonzero()) == 0, (m, policy)
        sizes.append(buf.numel())
    assert sizes == sorted(sizes) and len(set(sizes)) >= 2     # grew once at least, never shrank


def test_splitk_several_programs_share_the_output():
    # intermediate 160 in slices of 16: ten programs add into every output element
    x = tokens(9, 48)
    w1, w2 = weights("gelu", 48, 160)
    cfg = SplitKConfig(BLOCK_I=16, BLOCK_K=16, BLOCK_N=16, num_stages=1)
    ws = MlpWorkspace(48, max_tokens=9, device=DEVICE)
    out = launch_splitk(x, w1, w2, "gelu", workspace=ws, config=cfg)
    assert rel(out, ref_of(x, w1, w2, "gelu")) < TOL
    assert int(ws.buffer.count_nonzero()) == 0


@pytest.mark.parametrize("workspace", [True, False])
def test_splitk_grouped_partials_through_the_workspace(workspace):
    """The grouped split-K (two slices' partials summed on chip) through launch_splitk: its
    group counters live in the workspace after the accumulator, and every word is zero again
    after each call (or, without one, in the implicit per-stream buffer)."""
    from flashflow.ops import mlp

    w1, w2 = weights("swiglu", 48, 160)
    cfg = SplitKConfig(BLOCK_I=16, BLOCK_K=16, BLOCK_N=16, num_stages=1, group=2)
    ws = MlpWorkspace(48, max_tokens=9, device=DEVICE) if workspace else None
    for m in (9, 2):
        x = tokens(m, 48)
        out = launch_splitk(x, w1, w2, "swiglu", workspace=ws, config=cfg)
        assert rel(out, ref_of(x, w1, w2, "swiglu")) < TOL
        buf = ws.buffer if workspace else mlp._implicit_buffer(1, x.device)
        assert int(buf.count_nonzero()) == 0


_ORDER_CASES = [("sequential", 1, 3, 2, 1), ("sequential", 5, 4, 3, 2), ("sequential", 7, 3, 5, 8),
                ("rowblock", 3, 5, 2, 1), ("multirow", 5, 4, 3, 2), ("multirow", 7, 2, 3, 3),
                ("multirow", 2, 6, 4, 8), ("halfrow", 3, 5, 2, 1), ("halfrow", 2, 2, 3, 1),
                ("halfrow", 4, 7, 1, 1), ("seqsplit", 3, 5, 2, 2), ("seqsplit", 1, 2, 3, 8),
                ("seqsplit", 5, 7, 4, 3)]


@pytest.mark.parametrize("policy,tiles_m,n0,n1,rows", _ORDER_CASES)
def test_ticket_map_matches_python_order_and_respects_dependencies(policy, tiles_m, n0, n1, rows):
    order = issue_order(policy, tiles_m, n0, n1, rows)
    split = policy in ("halfrow", "seqsplit")
    assert len(order) == len(set(order)) == tiles_m * (n0 + (2 if split else 1) * n1)
    assert dependency_violations(order, n0, split) == []
    code = {"sequential": SEQUENTIAL, "rowblock": MULTIROW, "multirow": MULTIROW, "halfrow": HALFROW,
            "seqsplit": SEQSPLIT}[policy]
    got = torch.full((len(order), 4), -1, dtype=torch.int32, device=DEVICE)
    block = 64
    mlp_ticket_map_kernel[(-(-len(order) // block),)](
        got, len(order), tiles_m, n0, n1, 1 if policy == "rowblock" else rows, -(-n0 // 2), POLICY=code, BLOCK=block)
    assert [tuple(r) for r in got.tolist()] == [tuple(t) for t in order]


def test_dependency_checker_flags_orders_that_can_deadlock():
    good = issue_order("rowblock", 2, 3, 2)
    assert dependency_violations(good, 3, False) == []
    # a GEMM1 tile moved ahead of the last GEMM0 tile of its row: with one program, it waits forever
    bad = good[:2] + [good[3]] + [good[2]] + good[4:]
    assert dependency_violations(bad, 3, False)
    # the dataflow model's "halfrow" interleaves GEMM1 tiles with the GEMM0 tiles they wait on
    interleaved = [(0, 0, 0, 0), (0, 0, 1, 0), (1, 0, 0, 0), (0, 0, 2, 0), (1, 0, 1, 0)]
    assert dependency_violations(interleaved, 3, False)
    # halfrow's second GEMM1 part needs its first part
    hr = issue_order("halfrow", 1, 4, 2)
    swapped = [t for t in hr if not (t[0] == 1 and t[3] == 0 and t[2] == 1)] + [(1, 0, 1, 0)]
    assert dependency_violations(swapped, 4, True)


def test_wait_that_cannot_be_met_fails_loudly(monkeypatch):
    """Tickets that skip every GEMM0 tile leave GEMM1 waiting: the bounded spin (always on in
    the interpreter, FLASHFLOW_MLP_SPIN_LIMIT on the GPU) must raise instead of hanging."""
    monkeypatch.setattr(mlp, "_INTERPRETER_SPIN_LIMIT", 50)
    x = tokens(3, 48)
    w1, w2 = weights("swiglu", 48, 96)
    ws = MlpWorkspace(48, max_tokens=8, device=DEVICE)
    ws.buffer[0] = 3   # 1 row-block × 3 GEMM0 tiles of 32: tickets start at the first GEMM1 tile
    with pytest.raises(RuntimeError, match="ran out of spins"):
        launch_persistent(x, w1, w2, "swiglu", "sequential", workspace=ws)
    assert int(ws.buffer.count_nonzero()) == 0   # reset, usable again
    assert rel(fused_mlp(x, w1, w2, "swiglu", "sequential", workspace=ws), ref_of(x, w1, w2, "swiglu")) < TOL


def test_policy_parsing_and_auto_choice():
    assert parse_policy("multirow:3") == ("multirow", 3)
    assert parse_policy("sequential:4") == ("sequential", 4)
    assert parse_policy("seqsplit:2") == ("seqsplit", 2)
    assert parse_policy("seqsplit") == ("seqsplit", mlp.DEFAULT_GROUP_ROWS)
    assert parse_policy("rowblock") == ("rowblock", 1)
    assert parse_policy("multirow") == ("multirow", mlp.DEFAULT_GROUP_ROWS)
    assert resolve_policy("auto", mlp.AUTO_SPLITK_MAX_M)[0] == "splitk"
    assert resolve_policy("auto", mlp.AUTO_SPLITK_MAX_M + 1)[0] == "seqsplit"
    assert resolve_policy("auto", 64, gated=False)[0] == "halfrow"
    gpu = PersistentConfig(BLOCK_M=128, BLOCK_N0=64, BLOCK_N1=128, BLOCK_K=64)
    assert resolve_policy("auto", 65, gpu) == ("seqsplit", mlp.DEFAULT_GROUP_ROWS)
    assert resolve_policy("auto", 256, gpu) == ("seqsplit", mlp.DEFAULT_GROUP_ROWS)
    assert resolve_policy("auto", 257, gpu) == ("multirow", mlp.DEFAULT_GROUP_ROWS)
    assert resolve_policy("auto", 256, gpu, gated=False) == ("seqsplit", mlp.DEFAULT_GROUP_ROWS)
    assert resolve_policy("auto", 257, gpu, gated=False) == ("multirow", mlp.DEFAULT_GROUP_ROWS)
    assert resolve_policy("auto", 100, gpu, gated=False) == ("halfrow", 1)
    assert resolve_policy("auto", 4096, gpu) == ("multirow", mlp.DEFAULT_GROUP_ROWS)
    assert resolve_policy("sequential", 1) == ("sequential", mlp.DEFAULT_GROUP_ROWS)
    assert CNT_OFF % 2 == 0 and mlp.ACC_OFF >= CNT_OFF and mlp.ACC_OFF % 64 == 0


# --------------------------------------------------------------------------------------------
# bad inputs: ValueError / TypeError naming the argument, before any launch
# --------------------------------------------------------------------------------------------


def test_bad_inputs():
    x = tokens(2, 48)
    w1, w2 = weights("swiglu", 48, 96)
    with pytest.raises(ValueError, match="activation must be one of"):
        fused_mlp(x, w1, w2, "tanh")
    with pytest.raises(ValueError, match=r"w_gate_up must be \(2·intermediate, hidden\)"):
        fused_mlp(x, w1[:96], w2, "swiglu")
    with pytest.raises(ValueError, match=r"w_gate_up must be \(intermediate, hidden\) = fc1.weight"):
        fused_mlp(x, w1, w2, "gelu")
    with pytest.raises(ValueError, match=r"w_down must be \(hidden, intermediate\)"):
        fused_mlp(x, w1, w2[:40], "swiglu")
    with pytest.raises(ValueError, match="w_down must be 2-D"):
        fused_mlp(x, w1, w2[0], "swiglu")
    with pytest.raises(ValueError, match="w_gate_up must be 2-D"):
        fused_mlp(x, w1[None], w2, "swiglu")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        fused_mlp(x.tolist(), w1, w2)
    with pytest.raises(TypeError, match="share one dtype"):
        fused_mlp(x.float(), w1, w2)
    with pytest.raises(TypeError, match="w_down must be float16, bfloat16 or float32"):
        fused_mlp(x, w1, w2.double())
    with pytest.raises(ValueError, match="policy must be one of"):
        fused_mlp(x, w1, w2, policy="rowwise")
    with pytest.raises(ValueError, match="multirow:R"):
        fused_mlp(x, w1, w2, policy="multirow:0")
    with pytest.raises(ValueError, match="policy must be one of"):
        fused_mlp(x, w1, w2, policy="halfrow:2")
    with pytest.raises(TypeError, match="policy must be a str"):
        fused_mlp(x, w1, w2, policy=2)
    with pytest.raises(ValueError, match="'splitk' is the decode kernel"):
        fused_mlp(tokens(65, 48), w1, w2, policy="splitk")
    with pytest.raises(ValueError, match="workspace holds"):
        fused_mlp(tokens(64, 48), w1, w2, policy="splitk", workspace=MlpWorkspace(48, max_tokens=4, device=DEVICE))
    with pytest.raises(TypeError, match="workspace must be a flashflow MlpWorkspace"):
        fused_mlp(x, w1, w2, workspace=torch.zeros(10000, dtype=torch.int32))
    with pytest.raises(ValueError, match="hidden must be a positive int"):
        MlpWorkspace(0)


def test_auto_keeps_splitk_to_64_tokens_only_where_it_runs_in_one_wave(monkeypatch):
    # measured on the H100: Llama-3-8B at M = 64 split-K with 112 programs of 128-wide slices
    # 156.3 us vs seqsplit 170.7; Llama-3-70B (224 programs, two waves) and GELU lose above 32
    from flashflow.ops import ffn

    monkeypatch.setattr(ffn, "_sm_count", lambda device: 132)
    gpu = torch.device("cuda")
    assert ffn.wide_one_wave(64, 14336, True, gpu)
    assert not ffn.wide_one_wave(32, 14336, True, gpu)          # M ≤ 32: the two-program config
    assert not ffn.wide_one_wave(64, 28672, True, gpu)          # 70B: 224 slices, two waves
    assert not ffn.wide_one_wave(64, 14336, False, gpu)         # GELU: not gated
    assert not ffn.wide_one_wave(64, 14336, True, torch.device("cpu"))
    assert resolve_policy("auto", 64, gated=True, inter=14336, device=gpu) == ("splitk", 1)
    assert resolve_policy("auto", 33, gated=True, inter=28672, device=gpu)[0] == "seqsplit"
    assert resolve_policy("auto", 48, gated=False, inter=14336, device=gpu)[0] == "halfrow"
    assert resolve_policy("auto", 65, gated=True, inter=14336, device=gpu)[0] == "seqsplit"
