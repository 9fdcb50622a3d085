import pytest

from flashflow.dataflow.chain import FfnShape, chain_jobs, compare_policies, issue_order, simulate_chain

# 2 row-blocks; GEMM0 2x2 tiles, GEMM1 2x2 tiles; 2 K-steps each; every block 16x16 = 256 B.
SMALL = FfnShape(M=32, hidden=32, intermediate=32, block_m=16, block_n=16, block_k=16,
                 elem_bytes=1, gated=False)


def test_no_cache_reads_every_block_of_every_tile():
    # 4 GEMM0 tiles x 2 K-steps x (x block + W_gate_up block) + the same for GEMM1
    # (intermediate block + W_down block): 16 + 16 blocks of 256 B, nothing shared on 1 SM.
    r = simulate_chain(SMALL, "sequential", 0, num_sms=1)
    assert r.traffic.read_bytes == 32 * 256
    assert r.traffic.write_bytes == 32 * 32 + 32 * 32     # intermediate + output, once each


@pytest.mark.parametrize("policy", ["sequential", "rowblock", "multirow:2"])
def test_big_cache_reads_inputs_once_and_intermediate_from_cache(policy):
    # x, W_gate_up and W_down once; the intermediate was written through the cache
    r = simulate_chain(SMALL, policy, 1 << 20, num_sms=2)
    assert r.traffic.read_bytes == 3 * 32 * 32
    gated = FfnShape(**{**SMALL.__dict__, "gated": True})
    assert simulate_chain(gated, policy, 1 << 20, num_sms=2).traffic.read_bytes == 4 * 32 * 32


def test_issue_orders():
    # the kernel's orders, as (kind, r, j, part): kind 0 GEMM0, 1 GEMM1
    assert issue_order(SMALL, "rowblock") == [
        (0, 0, 0, 0), (0, 0, 1, 0), (1, 0, 0, 0), (1, 0, 1, 0),
        (0, 1, 0, 0), (0, 1, 1, 0), (1, 1, 0, 0), (1, 1, 1, 0)]
    seq = issue_order(SMALL, "sequential")
    # column-major inside a group of row-blocks: consecutive tiles share a weight column
    assert seq[:4] == [(0, r, j, 0) for j in range(2) for r in range(2)]
    assert issue_order(SMALL, "multirow:2") == seq
    # halfrow: half a GEMM0 row, GEMM1 over K-half 0, the other half, GEMM1 over K-half 1
    assert issue_order(SMALL, "halfrow")[:6] == [
        (0, 0, 0, 0), (1, 0, 0, 0), (1, 0, 1, 0), (0, 0, 1, 1), (1, 0, 0, 1), (1, 0, 1, 1)]
    # the model-only order: the rest of the GEMM0 row interleaved with the GEMM1 row
    assert issue_order(SMALL, "interleaved")[:4] == [(0, 0, 0, 0), (0, 0, 1, 0), (1, 0, 0, 0), (1, 0, 1, 0)]
    with pytest.raises(ValueError, match="policy"):
        issue_order(SMALL, "diagonal")


def test_dependencies():
    wide = FfnShape(M=16, hidden=64, intermediate=128, block_m=16, block_n=32, block_k=16,
                    elem_bytes=1)
    jobs = chain_jobs(wide, "interleaved", deps="tile")
    g1 = next(j for j in jobs if j.name[0] == "gemm1")
    index = {j.name: i for i, j in enumerate(jobs)}
    # GEMM1 K-step s waits on the GEMM0 n-tile that holds it (block_n / block_k = 2 steps)
    assert [w for w in g1.waits] == [(index[("gemm0", 0, s // 2)],) for s in range(8)]
    rowblock = chain_jobs(wide, "interleaved", deps="rowblock")
    g1 = next(j for j in rowblock if j.name[0] == "gemm1")
    assert len(g1.waits) == 1 and len(g1.waits[0]) == 4
    # per-tile flags let GEMM1 start on the first chunks: never slower than a row flag
    # 4 SMs: GEMM0 n-tiles 0-2 and GEMM1 tile 0 start at t=0 (4 and 8 K-steps long);
    # GEMM0 n-tiles 0-2 finish in step 3, then n-tile 3 and GEMM1 tile 1 start at t=4 and
    # n-tile 3 finishes in step 7. Per-tile flags: each GEMM1 tile runs its K-steps 0-5 on
    # chunks 0-2 at t=4-9 and its last 2 at t=10-11: 12 steps in all. Row flag: GEMM1 waits
    # for the whole row, runs t=8-15: 16 steps.
    t_tile = simulate_chain(wide, "interleaved", 1 << 20, 4, deps="tile").traffic.makespan
    t_row = simulate_chain(wide, "interleaved", 1 << 20, 4, deps="rowblock").traffic.makespan
    assert (t_tile, t_row) == (12, 16)


def test_interleaved_on_too_few_sms_deadlocks():
    # 4 GEMM0 n-tiles: interleaved issues G0 0, G0 1, G0 2, G1 0, G0 3, ... GEMM1 tile 0 holds
    # the only SM waiting for n-tile 3, which is issued after it: deadlock.
    wide = FfnShape(M=16, hidden=64, intermediate=128, block_m=16, block_n=32, block_k=16,
                    elem_bytes=1)
    r = simulate_chain(wide, "interleaved", 1 << 20, num_sms=1)
    assert r.deadlocked and "waits" in r.error
    assert not simulate_chain(wide, "interleaved", 1 << 20, num_sms=2).deadlocked
    assert not simulate_chain(wide, "rowblock", 1 << 20, num_sms=1).deadlocked
    # the kernel's halfrow splits GEMM1 in K-halves instead: a valid ticket order on one SM
    for deps in ("rowblock", "tile"):
        assert not simulate_chain(wide, "halfrow", 1 << 20, num_sms=1, deps=deps).deadlocked


def test_compare_policies_and_validation():
    results = compare_policies(SMALL, 4 * 256, 2)
    assert [r.policy for r in results] == ["sequential", "rowblock", "halfrow", "multirow:2"]
    with pytest.raises(ValueError, match="multiple of block_k"):
        FfnShape(64, 64, 64, block_n=48, block_k=32)
    with pytest.raises(ValueError, match="deps"):
        chain_jobs(SMALL, "rowblock", deps="none")
