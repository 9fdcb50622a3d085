"""The dataflow model of the persistent FFN kernel's own ticket orders (kernels.tile_order)."""
import pytest
import torch

from flashflow.dataflow import chain
from flashflow.dataflow.chain import FfnShape, simulate_tickets, ticket_jobs
from flashflow.dataflow.model import Hardware
from flashflow.kernels import tile_order
from flashflow.device import interpreting

# 2 row-blocks of 16; GEMM0: 4 tiles of 16 intermediate columns, 2 K-steps of 16 over hidden 32;
# GEMM1: 1 tile of 32 output columns, 4 K-steps of 16 over the intermediate 64. 1-byte elements.
S = FfnShape(M=32, hidden=32, intermediate=64, block_m=16, block_n=16, block_k=16, elem_bytes=1,
             gated=False, block_n1=32)
POLICIES = ("sequential:2", "rowblock", "multirow:2", "halfrow", "seqsplit:2")
SPLIT = ("halfrow", "seqsplit")


def order(s, policy):
    return chain.issue_order(s, policy)


def kernel_order(policy, tiles_m, n0, n1):
    """The ticket map as the kernel compiles it (Triton's interpreter, or the GPU)."""
    name, rows = tile_order.parse_order(policy)
    o = tile_order.launch_order(name, rows, tiles_m, n0, n1)
    device = "cuda" if (torch.cuda.is_available() and not interpreting()) else "cpu"
    got = torch.full((o.total, 4), -1, dtype=torch.int32, device=device)
    tile_order.mlp_ticket_map_kernel[(-(-o.total // 64),)](got, o.total, tiles_m, n0, n1, o.group_rows, o.half,
                                                           POLICY=o.code, BLOCK=64)
    return [tuple(r) for r in got.tolist()]


_MODEL_SHAPES = [
    # one row-block: halfrow is 8 tickets (GEMM1 in K-halves), not the 6 of an interleaved order
    FfnShape(M=16, hidden=64, intermediate=128, block_m=16, block_n=32, block_k=16, elem_bytes=1),
    S,
    FfnShape(M=70, hidden=80, intermediate=160, block_m=16, block_n=32, block_k=16, elem_bytes=1, block_n1=16),
    FfnShape(M=32, hidden=32, intermediate=16, block_m=16, block_n=16, block_k=16, elem_bytes=1, gated=False),
]


@pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(), reason="needs TRITON_INTERPRET=1 or a GPU")
@pytest.mark.parametrize("policy", ["sequential", "sequential:2", "rowblock", "multirow", "multirow:2", "multirow:3",
                                    "halfrow", "seqsplit", "seqsplit:2"])
@pytest.mark.parametrize("shape", range(len(_MODEL_SHAPES)))
def test_model_order_is_the_kernel_order(policy, shape):
    s = _MODEL_SHAPES[shape]
    got = order(s, policy)
    assert got == kernel_order(policy, s.row_blocks, s.tiles_n0, s.tiles_n1)
    if shape == 0 and policy == "halfrow":
        assert len(got) == s.tiles_n0 + 2 * s.tiles_n1 == 8


@pytest.mark.parametrize("policy", POLICIES)
def test_without_cache_every_block_is_read_from_dram(policy):
    # GEMM0: 8 tiles x 2 K-steps x (x 16x16 + W 16x16) = 8192 B; GEMM1: 2 tiles x 4 K-steps x
    # (H 16x16 + W_down 32x16) = 6144 B; split policies read each row-block's fp32 partial
    # (16x32x4 = 2048 B) back once and write it once.
    split = policy.split(":")[0] in SPLIT
    r = simulate_tickets(S, order(S, policy), Hardware(num_sms=1, l2_bytes=0))
    assert r.traffic.read_bytes == 8192 + 6144 + (2 * 2048 if split else 0)
    # H (32x64) and out (32x32) written once each, plus the partials
    assert r.traffic.write_bytes == 2048 + 1024 + (2 * 2048 if split else 0)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("sms", [1, 2, 3])
def test_big_cache_reads_inputs_once_and_never_deadlocks(policy, sms):
    # x (32x32), fc1 (64x32) and W_down (32x64) once; H and the partials come back from L2.
    # The ticket order is valid for any number of slots: no deadlock even on one SM.
    r = simulate_tickets(S, order(S, policy), Hardware(num_sms=sms, l2_bytes=1 << 20))
    assert not r.deadlocked
    assert r.traffic.read_bytes == 1024 + 2048 + 2048


def test_split_waits_follow_the_kernel():
    jobs = ticket_jobs(S, order(S, "seqsplit:2"))
    names = [j.name for j in jobs]
    part1 = jobs[names.index(("gemm1", 0, 0, 1))]
    # part 1 covers K-steps 2-3 (GEMM0 columns [32, 64)): waits on GEMM0 tiles 2 and 3 of its
    # row-block first, on its own part 0 only in its last step, where it reads the partials
    g0 = {n[1:3]: i for i, n in enumerate(names) if n[0] == "gemm0"}
    assert part1.waits[0] == (g0[(0, 2)], g0[(0, 3)])
    assert part1.waits[-1] == (names.index(("gemm1", 0, 0, 0)),)
    assert [k for k, _ in part1.steps[0]] == [("H", 0, 2), ("W1", 0, 2)]
    assert ("P", 0, 0) in [k for k, _ in part1.steps[-1]]
    with pytest.raises(ValueError, match="without their GEMM0"):
        ticket_jobs(S, [(1, 0, 0, 0)])


def test_one_pass_over_the_weights_per_group():
    # 4 row-blocks, an L2 as large as the weights: rowblock re-streams every weight once per
    # row-block (69632 B), multirow:4 walks a weight column for all four (26112 B).
    s = FfnShape(M=64, hidden=64, intermediate=128, block_m=16, block_n=32, block_k=16,
                 elem_bytes=1, gated=False, block_n1=32)
    weights = 2 * 128 * 64
    hw = Hardware(num_sms=2, l2_bytes=16384)
    row = simulate_tickets(s, order(s, "rowblock"), hw).traffic.read_bytes
    group = simulate_tickets(s, order(s, "multirow:4"), hw).traffic.read_bytes
    assert row >= 4 * weights
    assert group < row / 2


def test_model_traffic_uses_the_shipped_tiles_and_policy():
    from flashflow.bench.mlp_suite import model_traffic, weight_bytes

    r = model_traffic("swiglu", 4096, 14336, 256, "auto")
    assert r["policy"] == "seqsplit:8"                  # auto for 2 row-blocks of a gated FFN
    assert r["read_bytes"] >= weight_bytes("swiglu", 4096, 14336)
    with pytest.raises(ValueError, match="persistent kernel"):
        model_traffic("swiglu", 4096, 14336, 16, "auto")


@pytest.mark.parametrize("split, plain", [("halfrow", "rowblock"), ("seqsplit", "sequential")])
def test_one_intermediate_tile_runs_unsplit_as_the_kernel_does(split, plain):
    # one GEMM0 column leaves no K-half to split: the kernel runs rowblock / sequential, and
    # the model must take the same order (it raised IndexError on the empty second half)
    s = FfnShape(M=32, hidden=32, intermediate=16, block_m=16, block_n=16, block_k=16, elem_bytes=1,
                 gated=False, block_n1=32)
    assert s.tiles_n0 == 1
    assert order(s, split) == order(s, plain)
    r = simulate_tickets(s, order(s, split), Hardware(num_sms=1, l2_bytes=0))
    assert r.traffic is not None and r.traffic.read_bytes > 0
