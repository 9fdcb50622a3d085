import itertools
import random

import pytest

from flashflow.dataflow import orders
from flashflow.dataflow.bounds import bounds, compulsory_read_bytes, pebble_bytes
from flashflow.dataflow.cache import BeladyCache, LRUCache
from flashflow.dataflow.machine import Job, run
from flashflow.dataflow.model import panel_occupancy, simulate
from flashflow.dataflow.shape import GemmShape

# 2x2 grid of 16x16 tiles, one K-step, 1-byte elements: every A or B block is 256 bytes.
TINY = GemmShape(32, 32, 16, 16, 16, 16, elem_bytes=1)
BLOCK = 256


def misses(order, cache_blocks, sms=1, policy="lru", shape=TINY):
    return simulate(shape, order, cache_blocks * BLOCK, sms, policy).misses


def test_lru_2x2_by_hand():
    # Cache of 2 blocks, LRU, one SM; each tile reads A_m then B_n.
    # row-major (0,0) (0,1) (1,0) (1,1):
    #   (0,0): A0 miss, B0 miss              cache [A0 B0]
    #   (0,1): A0 hit, B1 miss (evicts B0)   cache [A0 B1]
    #   (1,0): A1 miss (evicts A0), B0 miss (evicts B1)   cache [A1 B0]
    #   (1,1): A1 hit, B1 miss (evicts B0)   cache [A1 B1]      -> 6 misses, 2 hits
    # snake (0,0) (0,1) (1,1) (1,0):
    #   (0,0): 2 misses; (0,1): A0 hit, B1 miss -> [A0 B1]
    #   (1,1): A1 miss (evicts A0), B1 hit -> [A1 B1]
    #   (1,0): A1 hit, B0 miss -> [A1 B0]                       -> 5 misses, 3 hits
    t = simulate(TINY, orders.row_major(2, 2), 2 * BLOCK)
    assert (t.misses, t.hits, t.read_bytes) == (6, 2, 6 * BLOCK)
    assert t.write_bytes == 32 * 32          # C, written once whatever the order
    assert t.dram_bytes == 6 * BLOCK + 32 * 32
    t = simulate(TINY, orders.snake(2, 2), 2 * BLOCK)
    assert (t.misses, t.hits) == (5, 3)
    assert t.hit_rate == pytest.approx(3 / 8)


def test_belady_2x2_by_hand():
    # Belady on row-major with 2 blocks: at (0,1) B1 evicts A0 (never used again) rather
    # than B0; at (1,0) A1 evicts B1 (needed last), so B0 hits:
    # 2 + 1 + 1 + 1 = 5 misses, one fewer than LRU.
    assert misses(orders.row_major(2, 2), 2, policy="belady") == 5
    assert misses(orders.snake(2, 2), 2, policy="belady") == 5


def test_two_k_steps_and_a_two_block_cache_miss_everything():
    # Each tile streams A_m,0 B_0,n A_m,1 B_1,n: a 2-block cache has evicted a tile's first
    # K-step by the time any other tile could reuse it.
    shape = GemmShape(32, 32, 32, 16, 16, 16, elem_bytes=1)
    assert misses(orders.snake(2, 2), 2, shape=shape) == 16


def test_concurrent_requests_merge():
    # No cache at all, 2 SMs, row-major: wave 1 = (0,0) (0,1) reads {A0, B0, B1} (the two
    # tiles' A0 requests merge into one DRAM read), wave 2 reads {A1, B0, B1}: 6 misses of
    # 8 requests.
    t = simulate(TINY, orders.row_major(2, 2), 0, num_sms=2)
    assert (t.misses, t.hits, t.makespan) == (6, 2, 2)


@pytest.mark.parametrize("sms", [1, 3, 7])
@pytest.mark.parametrize("policy", ["lru", "belady"])
def test_big_cache_costs_only_compulsory_traffic(sms, policy):
    # edge tiles in every dimension: M, N, K not multiples of the blocks
    shape = GemmShape(100, 70, 90, 32, 16, 16, elem_bytes=2)
    everything = compulsory_read_bytes(shape)
    for spec in ("row_major", "column_major", "hilbert", "grouped_m:2"):
        order = orders.make_order(spec, shape.tiles_m, shape.tiles_n)
        t = simulate(shape, order, everything, sms, policy)
        assert t.read_bytes == everything == (100 * 90 + 90 * 70) * 2
        assert t.write_bytes == 100 * 70 * 2


def test_belady_never_worse_than_lru_and_both_above_compulsory():
    rng = random.Random(1)
    shape = GemmShape(64, 64, 64, 16, 16, 16, elem_bytes=1)
    for _ in range(20):
        order = orders.row_major(4, 4)
        rng.shuffle(order)
        cache = rng.choice([0, 1, 3, 8, 20]) * BLOCK
        sms = rng.choice([1, 2, 4])
        lru = simulate(shape, order, cache, sms, "lru").read_bytes
        opt = simulate(shape, order, cache, sms, "belady").read_bytes
        assert compulsory_read_bytes(shape) <= opt <= lru


def test_order_inside_a_wave_does_not_matter():
    shape = GemmShape(64, 64, 48, 16, 16, 16, elem_bytes=1)
    order = orders.make_order("hilbert", 4, 4)
    base = simulate(shape, order, 5 * BLOCK, num_sms=4).read_bytes
    shuffled = []
    rng = random.Random(0)
    for i in range(0, 16, 4):
        wave = order[i:i + 4]
        rng.shuffle(wave)
        shuffled += wave
    assert shuffled != order
    assert simulate(shape, shuffled, 5 * BLOCK, num_sms=4).read_bytes == base


def test_step_records_add_up():
    t = simulate(TINY, orders.snake(2, 2), 2 * BLOCK, record=True)
    assert [r.finished for r in t.steps] == [[(0, 0)], [(0, 1)], [(1, 1)], [(1, 0)]]
    assert [r.misses for r in t.steps] == [2, 1, 1, 1]
    assert t.steps[-1].cum_read_bytes == t.read_bytes
    assert t.steps[-1].cum_dram_bytes == t.dram_bytes
    assert t.steps[-1].cache == [("A", 1, 0), ("B", 0, 0)]
    assert panel_occupancy(TINY, t.steps[-1].cache) == {"A": [0, 1], "B": [1, 0]}
    # a prefix of an order is a valid path too (what the page sends while clicking)
    assert simulate(TINY, [(0, 0), (0, 1)], 2 * BLOCK).misses == 3


def test_waves_make_steps():
    shape = GemmShape(64, 64, 32, 16, 16, 16, elem_bytes=1)
    t = simulate(shape, orders.row_major(4, 4), 0, num_sms=6, record=True)
    assert [len(r.finished) for r in t.steps] == [6, 6, 4]
    assert t.makespan == 3 * shape.k_steps
    assert t.utilization == pytest.approx(16 / 18)


def test_cache_classes_directly():
    lru = LRUCache(3)
    assert [lru.access(k, 1) for k in "abcab"] == [False, False, False, True, True]
    lru.access("d", 1)                       # evicts c, the least recent
    assert lru.contents() == ["a", "b", "d"]
    assert lru.access("big", 4) is False and "big" not in lru
    opt = BeladyCache(2)
    trace = "abcab"
    nxt = [3, 4, float("inf"), float("inf"), float("inf")]
    # c is needed later than a and b: Belady keeps a and b, so both hit again
    assert [opt.access(k, 1, n) for k, n in zip(trace, nxt)] == [False, False, False, True, True]


def test_jobs_with_dependencies_wait():
    read_x = ((("x", 0, 0), 1),)          # one K-step: one block of 1 byte
    a = Job("a", steps=(read_x, read_x), writes=((("h", 0, 0), 1),))
    b = Job("b", steps=(((("h", 0, 0), 1),),), waits=((0,),))
    t = run([a, b], num_slots=2, cache_bytes=10, record=True)
    # b waits two steps for a, then reads h from the cache (written through by a)
    assert t.makespan == 3
    assert t.misses == 1 and t.hits == 2
    assert t.write_bytes == 1


def test_bounds():
    shape = GemmShape(1024, 1024, 1024, 128, 128, 64, elem_bytes=2)
    b = bounds(shape, 1 << 20)
    assert b.compulsory_read_bytes == 2 * 1024 * 1024 * 2
    s = (1 << 20) / 2
    assert pebble_bytes(shape, 1 << 20) == pytest.approx(2 * 1024**3 / s**0.5 * 2)
    assert b.read_lower_bound >= b.compulsory_read_bytes
    best = min(simulate(shape, orders.make_order(o, 8, 8), 1 << 20, 1).read_bytes
               for o in ("row_major", "snake", "hilbert", "grouped_m:4"))
    assert best >= b.read_lower_bound


def test_shape_validation():
    with pytest.raises(ValueError, match="block_k"):
        GemmShape(10, 10, 10, block_k=0)
    with pytest.raises(ValueError, match="M must be"):
        GemmShape(True, 10, 10)
    with pytest.raises(ValueError, match="policy"):
        simulate(TINY, [(0, 0)], 100, policy="fifo")


def test_every_order_of_2x2_within_hand_bounds():
    # with 2 blocks of cache the best possible is 5 misses (snake), the worst 7 (diagonals)
    counts = {tuple(o): misses(list(o), 2) for o in itertools.permutations(orders.row_major(2, 2))}
    assert min(counts.values()) == 5 and max(counts.values()) == 7
    assert counts[((0, 0), (1, 1), (0, 1), (1, 0))] == 7
