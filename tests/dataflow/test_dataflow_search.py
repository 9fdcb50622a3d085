import itertools

import pytest

from flashflow.dataflow import orders
from flashflow.dataflow.model import simulate
from flashflow.dataflow.search import anneal, exhaustive
from flashflow.dataflow.shape import GemmShape

BLOCK = 256   # 16x16 blocks of 1-byte elements


def shape(tm, tn, k_steps=1):
    return GemmShape(16 * tm, 16 * tn, 16 * k_steps, 16, 16, 16, elem_bytes=1)


@pytest.mark.parametrize("cache_blocks,sms", [(2, 1), (3, 1), (2, 2), (4, 3)])
def test_exhaustive_matches_brute_force_on_2x3(cache_blocks, sms):
    s = shape(2, 3)
    costs = [simulate(s, list(p), cache_blocks * BLOCK, sms).read_bytes
             for p in itertools.permutations(orders.row_major(2, 3))]   # 720 orders
    r = exhaustive(s, cache_blocks * BLOCK, sms)
    assert r.best_read_bytes == min(costs)
    assert r.worst_read_bytes == max(costs)
    # the orders it returns really cost what it says
    assert simulate(s, r.best_order, cache_blocks * BLOCK, sms).read_bytes == min(costs)
    assert simulate(s, r.worst_order, cache_blocks * BLOCK, sms).read_bytes == max(costs)


def test_3x3_tiny_cache():
    # 2 blocks of cache: the worst order misses all 18 reads; the best misses 10 (a snake:
    # 2 + 8 single misses, one new panel per tile).
    r = exhaustive(shape(3, 3), 2 * BLOCK)
    assert r.best_read_bytes == 10 * BLOCK
    assert r.worst_read_bytes == 18 * BLOCK
    assert r.total_orders == 362880
    assert r.explored < 5000


def test_4x4_best_and_worst_with_pruning():
    s = shape(4, 4)
    r = exhaustive(s, 4 * BLOCK)
    assert r.best_read_bytes == 10 * BLOCK      # compulsory is 8 blocks
    assert r.worst_read_bytes == 32 * BLOCK     # every read misses
    assert r.total_orders == 20922789888000     # 16!
    assert 0 < r.explored < 20000               # pruning does the work
    named = min(simulate(s, orders.make_order(o, 4, 4), 4 * BLOCK).read_bytes
                for o in orders.default_specs(4, 4))
    assert r.best_read_bytes <= named
    assert simulate(s, r.best_order, 4 * BLOCK).read_bytes == r.best_read_bytes
    again = exhaustive(s, 4 * BLOCK)
    assert (again.best_order, again.explored) == (r.best_order, r.explored)


def test_exhaustive_refuses_big_grids():
    with pytest.raises(ValueError, match="anneal"):
        exhaustive(shape(5, 4), BLOCK)


def test_anneal_is_reproducible_and_no_worse_than_its_start():
    s = GemmShape(96, 96, 64, 16, 16, 16, elem_bytes=1)   # 6x6 grid, 4 K-steps
    a = anneal(s, 12 * BLOCK, num_sms=2, iterations=150, seed=7)
    b = anneal(s, 12 * BLOCK, num_sms=2, iterations=150, seed=7)
    assert a.order == b.order and a.read_bytes == b.read_bytes and a.history == b.history
    assert a.read_bytes <= a.start_read_bytes
    assert sorted(a.order) == orders.row_major(6, 6)
    assert simulate(s, a.order, 12 * BLOCK, 2).read_bytes == a.read_bytes


def test_anneal_with_coarse_k_reports_the_real_cost():
    s = GemmShape(64, 64, 128, 16, 16, 16, elem_bytes=1)
    r = anneal(s, 16 * BLOCK, iterations=40, seed=1, block_k=64)
    assert r.full_read_bytes == simulate(s, r.order, 16 * BLOCK).read_bytes
