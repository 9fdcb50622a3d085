"""Searching for the tile order that moves the fewest (or the most) bytes.

- :func:`exhaustive`: branch and bound over every order of a small grid (up to 4×4), with an
  LRU cache. Pruning, all of it exact:
  * a lower bound on what is left: every block that a remaining tile reads and the cache does
    not hold now must be fetched at least once (an upper bound for the worst order: every
    remaining block read misses);
  * a memo of (tiles done, cache state) → cheapest cost seen: the future depends only on that
    state, so a second arrival at it that is no cheaper is dropped;
  * row/column relabelling: with one SM and no edge tiles, renaming rows (or columns) leaves the
    traffic unchanged, so only orders that use rows and columns in first-appearance order
    0, 1, 2, … are explored;
  * waves (num_sms > 1) are explored as sets, since the order inside a wave carries no meaning.
- :func:`anneal`: simulated annealing over permutations (swap two tiles, reverse a segment,
  move a tile),
  seeded so runs repeat, started from the best named order. For realistic grids it can use a
  coarser K-step (``block_k``) to make each evaluation cheaper, and reports the result at the
  real K-step too.
"""
from __future__ import annotations

import itertools
import logging
import math
import random
from dataclasses import dataclass, field

from flashflow.dataflow import orders as _orders
from flashflow.dataflow.cache import LRUCache
from flashflow.dataflow.machine import schedule
from flashflow.dataflow.model import compare_orders, simulate, tile_job
from flashflow.dataflow.shape import GemmShape

log = logging.getLogger(__name__)

MAX_EXHAUSTIVE_TILES = 16
_MEMO_LIMIT = 2_000_000   # states remembered per search; past it the memo stops growing


@dataclass
class ExhaustiveResult:
    best_order: list
    best_read_bytes: int
    worst_order: list
    worst_read_bytes: int
    explored: int            # search nodes visited (both searches)
    complete: int            # full orders reached
    total_orders: int        # orders (or wave sequences) without pruning
    write_bytes: int = 0


class _WaveSearch:
    """Shared state of one branch-and-bound run (minimising when sign=+1, maximising -1)."""

    def __init__(self, shape: GemmShape, cache_bytes: int, num_sms: int, sign: int,
                 incumbent: tuple[int, list]):
        self.shape = shape
        self.capacity = cache_bytes
        self.num_sms = num_sms
        self.sign = sign
        self.tiles = _orders.row_major(shape.tiles_m, shape.tiles_n)
        self.full = (1 << len(self.tiles)) - 1
        self.best_cost, self.best_order = incumbent
        self.nodes = 0
        self.complete = 0
        self.memo: dict = {}
        self._wave_traces: dict = {}
        self.symmetric = (num_sms == 1 and shape.M % shape.block_m == 0
                          and shape.N % shape.block_n == 0)
        # blocks each tile reads, and their total size (for the bounds)
        self.tile_blocks = [[b for step in tile_job(shape, m, n).steps for b in step]
                            for m, n in self.tiles]
        self.tile_bytes = [sum(size for _, size in blocks) for blocks in self.tile_blocks]

    def wave_trace(self, wave: tuple[int, ...]) -> list:
        """Blocks the wave reads, in the order the machine issues them (one source of rules)."""
        trace = self._wave_traces.get(wave)
        if trace is None:
            jobs = [tile_job(self.shape, *self.tiles[i]) for i in wave]
            sched = schedule(jobs, self.num_sms)
            trace = [block for step in sched.steps for block in step.reads]
            self._wave_traces[wave] = trace
        return trace

    def bound(self, cache: LRUCache, done: int) -> int:
        remaining = [i for i in range(len(self.tiles)) if not done >> i & 1]
        if self.sign > 0:
            needed = {}
            for i in remaining:
                for key, size in self.tile_blocks[i]:
                    if key not in cache:
                        needed[key] = size
            return sum(needed.values())
        return sum(self.tile_bytes[i] for i in remaining)

    def candidates(self, done: int, used_rows: int, used_cols: int):
        remaining = [i for i in range(len(self.tiles)) if not done >> i & 1]
        if self.num_sms == 1:
            for i in remaining:
                m, n = self.tiles[i]
                if self.symmetric and (m > used_rows or n > used_cols):
                    continue
                yield (i,)
        else:
            yield from itertools.combinations(remaining, min(self.num_sms, len(remaining)))

    def run(self, cache: LRUCache, done: int, cost: int, prefix: list, rows: int, cols: int):
        self.nodes += 1
        if done == self.full:
            self.complete += 1
            if self.sign * cost < self.sign * self.best_cost:
                self.best_cost, self.best_order = cost, list(prefix)
            return
        if self.sign * (cost + self.bound(cache, done)) >= self.sign * self.best_cost:
            return
        key = (done, cache.state())
        seen = self.memo.get(key)
        if seen is not None and self.sign * seen <= self.sign * cost:
            return
        if seen is not None or len(self.memo) < _MEMO_LIMIT:
            self.memo[key] = cost
        children = []
        for wave in self.candidates(done, rows, cols):
            child = cache.copy()
            extra = 0
            for k, size in self.wave_trace(wave):
                if not child.access(k, size):
                    extra += size
            children.append((self.sign * extra, wave, child))
        children.sort(key=lambda c: c[0])   # most promising first: tightens the bound early
        for signed_extra, wave, child in children:
            new_done = done
            new_rows, new_cols = rows, cols
            for i in wave:
                new_done |= 1 << i
                m, n = self.tiles[i]
                new_rows = max(new_rows, m + 1)
                new_cols = max(new_cols, n + 1)
            prefix.extend(self.tiles[i] for i in wave)
            self.run(child, new_done, cost + self.sign * signed_extra, prefix, new_rows,
                     new_cols)
            del prefix[len(prefix) - len(wave):]


def _wave_sequences(tiles: int, per_wave: int) -> int:
    total, left = 1, tiles
    while left > 0:
        take = min(per_wave, left)
        total *= math.comb(left, take)
        left -= take
    return total


def exhaustive(shape: GemmShape, cache_bytes: int, num_sms: int = 1) -> ExhaustiveResult:
    """Best and worst orders of a small grid under an LRU cache, proven by branch and bound."""
    if shape.num_tiles > MAX_EXHAUSTIVE_TILES:
        raise ValueError(f"exhaustive search takes grids of at most {MAX_EXHAUSTIVE_TILES} "
                         f"tiles, got {shape.tiles_m}x{shape.tiles_n}; use anneal()")
    # incumbents from the named orders, so the bounds prune from the first node on
    named = compare_orders(shape, cache_bytes, num_sms)
    lo = min(named, key=lambda r: r.traffic.read_bytes)
    hi = max(named, key=lambda r: r.traffic.read_bytes)
    grid = (shape.tiles_m, shape.tiles_n)
    results = []
    explored = complete = 0
    for sign, start in ((1, lo), (-1, hi)):
        # start one byte past the named order so the search itself reaches a full order
        incumbent = (start.traffic.read_bytes + sign, _orders.make_order(start.spec, *grid))
        s = _WaveSearch(shape, cache_bytes, num_sms, sign, incumbent)
        s.run(LRUCache(cache_bytes), 0, 0, [], 0, 0)
        results.append((s.best_cost, s.best_order))
        explored += s.nodes
        complete += s.complete
        log.info("exhaustive %s: %d bytes after %d nodes", "min" if sign > 0 else "max",
                 s.best_cost, s.nodes)
    total = (math.factorial(shape.num_tiles) if num_sms == 1
             else _wave_sequences(shape.num_tiles, num_sms))
    write = simulate(shape, [], cache_bytes).write_bytes + sum(
        shape.c_tile_bytes(m, n) for m, n in _orders.row_major(*grid))
    return ExhaustiveResult(results[0][1], results[0][0], results[1][1], results[1][0],
                            explored, complete, total, write)


@dataclass
class AnnealResult:
    order: list
    read_bytes: int              # at the search's K-step
    start_spec: str
    start_read_bytes: int
    iterations: int
    accepted: int
    seed: int
    full_read_bytes: int | None = None   # at the shape's real K-step, when the search coarsened it
    history: list = field(default_factory=list)   # (iteration, best so far)


def anneal(shape: GemmShape, cache_bytes: int, num_sms: int = 1, policy: str = "lru",
           iterations: int = 2000, seed: int = 0, block_k: int | None = None,
           start: list | None = None, t_start: float = 0.02, t_end: float = 1e-4) -> AnnealResult:
    """Simulated annealing over complete orders. Temperatures are fractions of the starting
    cost, cooled geometrically from ``t_start`` to ``t_end``."""
    model_shape = shape.with_block_k(block_k) if block_k else shape
    rng = random.Random(seed)

    def cost(order):
        return simulate(model_shape, order, cache_bytes, num_sms, policy).read_bytes

    if start is None:
        named = compare_orders(model_shape, cache_bytes, num_sms, policy)
        best_row = min(named, key=lambda r: r.traffic.read_bytes)
        start_spec, current = best_row.spec, _orders.make_order(best_row.spec, shape.tiles_m,
                                                                shape.tiles_n)
        current_cost = best_row.traffic.read_bytes
    else:
        start_spec = "given"
        current = _orders.validate(start, shape.tiles_m, shape.tiles_n, complete=True)
        current_cost = cost(current)
    start_cost = current_cost
    best, best_cost = list(current), current_cost
    n = len(current)
    accepted = 0
    history = [(0, best_cost)]
    scale = max(start_cost, 1)
    for it in range(1, iterations + 1 if n > 1 else 1):
        temp = t_start * (t_end / t_start) ** (it / iterations)
        i, j = sorted(rng.sample(range(n), 2))
        candidate = list(current)
        move = rng.random()
        if move < 1 / 3:      # swap two tiles
            candidate[i], candidate[j] = candidate[j], candidate[i]
        elif move < 2 / 3:    # reverse a segment (2-opt: keeps its neighbours adjacent)
            candidate[i:j + 1] = reversed(candidate[i:j + 1])
        else:                 # move one tile later in the order
            candidate.insert(j, candidate.pop(i))
        c = cost(candidate)
        delta = (c - current_cost) / scale
        if delta <= 0 or rng.random() < math.exp(-delta / temp):
            current, current_cost = candidate, c
            accepted += 1
            if c < best_cost:
                best, best_cost = list(candidate), c
                history.append((it, best_cost))
    full = (simulate(shape, best, cache_bytes, num_sms, policy).read_bytes
            if block_k else None)
    log.info("anneal: %d -> %d bytes in %d iterations (seed %d)", start_cost, best_cost,
             iterations, seed)
    return AnnealResult(best, best_cost, start_spec, start_cost, iterations, accepted, seed, full,
                        history)
