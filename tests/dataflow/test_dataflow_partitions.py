"""The partitioned L2 and the drifting (staggered) schedule, checked by hand on tiny cases."""
import pytest

from flashflow.dataflow import orders
from flashflow.dataflow.bounds import compulsory_read_bytes
from flashflow.dataflow.cache import PartitionedL2
from flashflow.dataflow.machine import schedule
from flashflow.dataflow.model import gemm_jobs, simulate
from flashflow.dataflow.shape import GemmShape

# 2x2 grid of 16x16 tiles, one K-step, 1-byte elements: every A or B block is 256 bytes.
TINY = GemmShape(32, 32, 16, 16, 16, 16, elem_bytes=1)
BLOCK = 256


def test_copies_partitions_never_serve_each_other():
    # 2 partitions of 1 block each
    l2 = PartitionedL2(2 * BLOCK, 2, "copies")
    assert l2.access("A", BLOCK, 0) == BLOCK      # side 0: miss, DRAM
    assert l2.access("A", BLOCK, 1) == BLOCK      # side 1 holds no copy: DRAM again
    assert l2.access("A", BLOCK, 0) == 0          # near hit
    assert l2.access("B", BLOCK, 0) == BLOCK      # evicts A from side 0
    assert l2.access("A", BLOCK, 0) == BLOCK      # side 1 still holds A, but copies don't share
    assert l2.fabric_bytes == 0


def test_far_partition_serves_a_near_miss():
    # 2 partitions of 1 block each
    l2 = PartitionedL2(2 * BLOCK, 2, "far")
    assert l2.access("A", BLOCK, 0) == BLOCK      # P0 [A]
    assert l2.access("A", BLOCK, 1) == 0          # P1 misses, P0 holds A: crossbar. P1 [A]
    assert l2.access("B", BLOCK, 1) == BLOCK      # P1 [B], P0 [A]: nobody had B
    assert l2.access("B", BLOCK, 0) == 0          # P0 [B] copied from P1
    assert l2.access("A", BLOCK, 1) == BLOCK      # both partitions now hold only B
    assert l2.fabric_bytes == 2 * BLOCK
    assert sorted(l2.contents()) == ["A", "B"]


def test_home_partition_is_the_point_of_coherence():
    # 2-byte blocks: piece (X, 0) lives at home P0, (X, 1) at P1; 2 bytes per partition.
    l2 = PartitionedL2(4, 2, "home")
    # side 0 reads A: (A,0) misses its home P0 -> DRAM; (A,1) misses near P0 (copy kept) and
    # home P1 -> DRAM, filling P1 too.      P0 [A0 A1]  P1 [A1]
    assert l2.access("A", 2, 0) == 2
    # side 1 reads A: (A,0) misses near P1, hits home P0 -> crossbar; (A,1) hits near=home P1.
    #                                       P0 [A1 A0]  P1 [A0 A1]
    assert l2.access("A", 2, 1) == 0
    assert l2.fabric_bytes == 1
    # side 1 reads B: (B,0) misses P1 (evicts A0 there) and home P0 (DRAM; evicts A1 there);
    # (B,1) misses near=home P1 (evicts A1) -> DRAM.   P0 [A0 B0]  P1 [B0 B1]
    assert l2.access("B", 2, 1) == 2
    # side 0 reads A again: (A,0) near=home hit; (A,1) misses P0 (evicts B0) and home P1
    # (DRAM, evicts B0 there).              P0 [A0 A1]  P1 [B1 A1]
    assert l2.access("A", 2, 0) == 1
    assert "A" in l2 and "B" in l2


def test_partitioned_l2_rejects_bad_arguments():
    with pytest.raises(ValueError, match="sharing"):
        PartitionedL2(1024, 2, "mirror")
    with pytest.raises(ValueError, match="partitions"):
        PartitionedL2(1024, 0)


def _misses(order, cache_blocks, **kw):
    return simulate(TINY, order, cache_blocks * BLOCK, 2, **kw).misses


def test_partitioned_gemm_by_hand():
    # 2 slots, slot i on side i (alternate), 4 blocks of L2 = 2 per side, row-major:
    #   wave 1: (0,0) on side 0 reads A0 B0; (0,1) on side 1 reads A0 B1.
    #   wave 2: (1,0) on side 0 reads A1 B0; (1,1) on side 1 reads A1 B1.
    # copies: wave 1 misses A0 B0 | A0 B1 (A0 twice: no merge across sides) = 4;
    #         wave 2: side 0 [A0 B0] misses A1, hits B0; side 1 [A0 B1] misses A1 = 2 -> 6
    # far:    wave 1: side 1's A0 is side 0's fresh copy (crossbar), which makes A0 side 0's
    #         most recent block: side 0 [B0 A0], side 1 [A0 B1] -> 3 misses;
    #         wave 2: side 0's A1 evicts B0, so B0 misses too (2); side 1 copies A1 from
    #         side 0 and hits B1 -> 5
    # unified 4-block LRU, for comparison: 3 + 1 = 4
    row = orders.row_major(2, 2)
    assert _misses(row, 4, partitions=2, sharing="copies", placement="alternate") == 6
    assert _misses(row, 4, partitions=2, sharing="far", placement="alternate") == 5
    assert _misses(row, 4) == 4
    t = simulate(TINY, row, 4 * BLOCK, 2, partitions=2, sharing="copies",
                 placement="alternate", record=True)
    assert (t.read_bytes, t.hits, t.misses) == (6 * BLOCK, 2, 6)
    assert [r.misses for r in t.steps] == [4, 2]
    # halves with 2 slots and 2 partitions is the same split as alternate
    assert _misses(row, 4, partitions=2, sharing="copies", placement="halves") == 6


def test_placement_sides():
    jobs = gemm_jobs(GemmShape(64, 64, 16, 16, 16, 16, elem_bytes=1), orders.row_major(4, 4))
    assert schedule(jobs, 4, partitions=2, placement="alternate").side_of_job == [0, 1] * 8
    assert schedule(jobs, 4, partitions=2, placement="halves").side_of_job == [0, 0, 1, 1] * 4
    a = schedule(jobs, 4, partitions=2, placement="random", seed=3).side_of_job
    assert a == schedule(jobs, 4, partitions=2, placement="random", seed=3).side_of_job
    assert set(a) == {0, 1}
    assert schedule(jobs, 4).side_of_job is None


def test_drift_staggers_the_first_starts():
    # 2 K-steps per tile, 2 slots, stagger of one tile: slot 1 starts at t=1, so the tiles
    # sharing A's row-panel read it one step apart and nothing merges. No cache:
    #   t0: (0,0)k0 A00 B00                 2
    #   t1: (0,0)k1 A01 B01  (0,1)k0 A00 B10 4
    #   t2: (1,0)k0 A10 B00  (0,1)k1 A01 B11 4
    #   t3: (1,0)k1 A11 B01  (1,1)k0 A10 B10 4
    #   t4: (1,1)k1 A11 B11                 2   -> 16 misses in 5 steps
    # In lockstep the two tiles of a wave merge their A reads: 3 per step, 12 in 4 steps.
    shape = GemmShape(32, 32, 32, 16, 16, 16, elem_bytes=1)
    row = orders.row_major(2, 2)
    t = simulate(shape, row, 0, 2, drift=True)
    assert (t.misses, t.makespan) == (16, 5)
    t = simulate(shape, row, 0, 2)
    assert (t.misses, t.makespan) == (12, 4)


@pytest.mark.parametrize("sharing", ["home", "far"])
@pytest.mark.parametrize("placement", ["random", "alternate", "halves"])
def test_big_partitioned_cache_costs_only_compulsory_traffic(sharing, placement):
    # each partition holds everything: every block comes from DRAM exactly once
    shape = GemmShape(100, 70, 90, 32, 16, 16, elem_bytes=2)
    everything = compulsory_read_bytes(shape)
    for spec in ("row_major", "hilbert"):
        order = orders.make_order(spec, shape.tiles_m, shape.tiles_n)
        for drift in (False, True):
            t = simulate(shape, order, 2 * everything, 3, partitions=2, sharing=sharing,
                         placement=placement, drift=drift)
            assert t.read_bytes == everything
            assert t.write_bytes == 100 * 70 * 2


def test_partitioned_model_is_lru_only():
    with pytest.raises(ValueError, match="lru"):
        simulate(TINY, orders.row_major(2, 2), 4 * BLOCK, 2, "belady", partitions=2)


def test_halves_split_sms_not_slots():
    # 4 slots on 2 SMs (2 tiles per SM): slot i runs on SM i mod 2, so "halves" puts SM 0's
    # two slots on side 0 and SM 1's on side 1
    jobs = gemm_jobs(GemmShape(64, 64, 16, 16, 16, 16, elem_bytes=1), orders.row_major(4, 4))
    sides = schedule(jobs, 4, partitions=2, placement="halves", tiles_per_sm=2).side_of_job
    assert sides == [0, 1] * 8
    with pytest.raises(ValueError, match="tiles_per_sm"):
        schedule(jobs, 4, partitions=2, tiles_per_sm=3)


def test_hardware_carries_the_partitioned_model():
    from dataclasses import replace

    from flashflow.dataflow.model import H100, H100_PARTITIONED, simulate_on
    shape = GemmShape(1024, 1024, 512, 128, 128, 64)
    order = orders.hilbert(8, 8)
    small = replace(H100_PARTITIONED, num_sms=8, l2_bytes=1 << 20, tiles_per_sm=2)
    assert simulate_on(shape, order, small).read_bytes == simulate(
        shape, order, 1 << 20, 16, partitions=2, sharing="home", placement="halves",
        drift=1.0, tiles_per_sm=2).read_bytes
    unified = replace(H100, num_sms=8, l2_bytes=1 << 20, tiles_per_sm=2)
    assert simulate_on(shape, order, unified).read_bytes == simulate(
        shape, order, 1 << 20, 16).read_bytes
    assert H100.l2_partitions == 1 and H100_PARTITIONED.l2_partitions == 2
    with pytest.raises(ValueError, match="drift"):
        simulate(shape, order, 1 << 20, 16, drift=1.5)


def test_spearman_and_separated_pairs():
    from flashflow.dataflow.stats import ranks, separated_pairs, spearman
    assert ranks([30, 10, 20, 10]) == [4, 1.5, 3, 1.5]
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1)
    # ties on the model side: ranks (1.5, 1.5, 3) against (1, 2, 3) -> rho = 0.866
    assert spearman([5, 5, 9], [1, 2, 3]) == pytest.approx(3 ** 0.5 / 2)
    # measured 100, 105, 200: only the pairs with 200 are > 10% apart; the model swaps the
    # close pair (not counted) and orders both far pairs right
    assert separated_pairs([2, 1, 9], [100, 105, 200]) == (2, 2)
    assert separated_pairs([2, 1, 0], [100, 105, 200]) == (0, 2)
