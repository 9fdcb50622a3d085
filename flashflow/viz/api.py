"""The explorer's JSON API as plain functions (dict in, dict out), so the rules live only in
:mod:`flashflow.dataflow` and the HTTP layer stays thin. Every error is a ValueError whose
message the page shows."""
from __future__ import annotations

from flashflow.dataflow import orders as _orders
from flashflow.dataflow import search as _search
from flashflow.dataflow.bounds import bounds
from flashflow.dataflow.model import panel_occupancy, simulate
from flashflow.dataflow.shape import GemmShape
from flashflow.device import cdiv

# The page draws every tile and re-simulates on every click: keep requests interactive.
MAX_TILES = 1024
MAX_K_STEPS = 512
MAX_ANNEAL_WORK = 3_000_000   # iterations × tiles × K-steps


def _int(req: dict, name: str, default=None) -> int:
    value = req.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def parse_shape(req: dict) -> GemmShape:
    shape_req = req.get("shape")
    if not isinstance(shape_req, dict):
        raise ValueError(f"shape must be an object with M, N, K, block_m, block_n, block_k, "
                         f"got {shape_req!r}")
    shape = GemmShape(*(_int(shape_req, k, d) for k, d in (
        ("M", None), ("N", None), ("K", None), ("block_m", 128), ("block_n", 128),
        ("block_k", 64), ("elem_bytes", 2))))
    if shape.num_tiles > MAX_TILES:
        raise ValueError(f"the page draws at most {MAX_TILES} tiles, this shape has "
                         f"{shape.tiles_m}x{shape.tiles_n}; use larger tiles or the CLI")
    if shape.k_steps > MAX_K_STEPS:
        raise ValueError(f"at most {MAX_K_STEPS} K-steps, this shape has {shape.k_steps}; "
                         f"use a larger block_k")
    return shape


def _machine(req: dict) -> tuple[int, int, str]:
    cache = _int(req, "cache_bytes")
    sms = _int(req, "num_sms", 1)
    policy = req.get("policy", "lru")
    if cache < 0 or sms <= 0:
        raise ValueError(f"need cache_bytes >= 0 and num_sms > 0, got {cache}, {sms}")
    if policy not in ("lru", "belady"):
        raise ValueError(f"policy must be 'lru' or 'belady', got {policy!r}")
    return cache, sms, policy


def list_orders() -> dict:
    return {"orders": [{"name": name, "param": param, "default": default}
                       for name, (_, param, default) in _orders.NAMED_ORDERS.items()]}


def named_order(req: dict) -> dict:
    shape = parse_shape(req)
    spec = req.get("spec")
    if not isinstance(spec, str):
        raise ValueError(f"spec must be an order name such as 'grouped_m:4', got {spec!r}")
    return {"path": [list(t) for t in _orders.make_order(spec, shape.tiles_m, shape.tiles_n)]}


def simulate_path(req: dict) -> dict:
    """Traffic of the clicked path, with the state after every wave (every tile on one SM)."""
    shape = parse_shape(req)
    cache, sms, policy = _machine(req)
    path = _orders.validate(req.get("path", []), shape.tiles_m, shape.tiles_n)
    traffic = simulate(shape, path, cache, sms, policy, record=True)
    b = bounds(shape, cache)
    steps = []
    for rec in traffic.steps:
        steps.append({
            "time": rec.time, "tiles": [list(t) for t in rec.finished],
            "requests": rec.reads, "misses": rec.misses, "read_bytes": rec.read_bytes,
            "cum_read_bytes": rec.cum_read_bytes, "cum_write_bytes": rec.cum_write_bytes,
            "cum_dram_bytes": rec.cum_dram_bytes,
            "cache": panel_occupancy(shape, rec.cache),
            "cache_blocks": len(rec.cache),
        })
    return {
        "shape": shape.to_dict(),
        "grid": {"tiles_m": shape.tiles_m, "tiles_n": shape.tiles_n, "k_steps": shape.k_steps},
        "path": [list(t) for t in path],
        "steps": steps,
        "totals": {"read_bytes": traffic.read_bytes, "write_bytes": traffic.write_bytes,
                   "dram_bytes": traffic.dram_bytes, "hits": traffic.hits,
                   "misses": traffic.misses, "hit_rate": traffic.hit_rate,
                   "makespan": traffic.makespan},
        "bounds": {"compulsory_read_bytes": b.compulsory_read_bytes,
                   "compulsory_write_bytes": b.compulsory_write_bytes,
                   "pebble_bytes": b.pebble_bytes},
        "a_block_bytes": shape.a_block_bytes(0, 0), "b_block_bytes": shape.b_block_bytes(0, 0),
        "cache_bytes": cache, "num_sms": sms, "policy": policy,
    }


def search_order(req: dict) -> dict:
    """Best order: proven by exhaustive search up to 16 tiles (LRU), annealed beyond."""
    shape = parse_shape(req)
    cache, sms, policy = _machine(req)
    method = req.get("method", "auto")
    if method == "auto":
        method = "exhaustive" if shape.num_tiles <= _search.MAX_EXHAUSTIVE_TILES else "anneal"
    if method == "exhaustive":
        r = _search.exhaustive(shape, cache, sms)
        return {"method": "exhaustive", "policy": "lru", "path": [list(t) for t in r.best_order],
                "read_bytes": r.best_read_bytes, "worst_path": [list(t) for t in r.worst_order],
                "worst_read_bytes": r.worst_read_bytes, "explored": r.explored,
                "total_orders": r.total_orders}
    if method != "anneal":
        raise ValueError(f"method must be 'auto', 'exhaustive' or 'anneal', got {method!r}")
    iterations = _int(req, "iterations", 300)
    if iterations <= 0:
        raise ValueError(f"iterations must be positive, got {iterations}")
    # Keep the request interactive: evaluate with at most 8 (coarser) K-steps and cap
    # iterations x tiles x K-steps; the CLI searches longer.
    k_eval = min(shape.k_steps, 8)
    block_k = cdiv(shape.K, k_eval) if k_eval < shape.k_steps else None
    iterations = max(1, min(iterations, MAX_ANNEAL_WORK // (shape.num_tiles * k_eval)))
    r = _search.anneal(shape, cache, sms, policy, iterations=iterations,
                       seed=_int(req, "seed", 0), block_k=block_k)
    read = r.full_read_bytes if r.full_read_bytes is not None else r.read_bytes
    start_order = _orders.make_order(r.start_spec, shape.tiles_m, shape.tiles_n)
    start = (r.start_read_bytes if block_k is None
             else simulate(shape, start_order, cache, sms, policy).read_bytes)
    order = r.order
    if read > start:   # better only at the coarse K-step: keep the named order
        order, read = start_order, start
    return {"method": "anneal", "policy": policy, "path": [list(t) for t in order],
            "read_bytes": read, "start": r.start_spec, "start_read_bytes": start,
            "iterations": r.iterations, "seed": r.seed, "search_block_k": block_k}


ROUTES = {"/api/simulate": simulate_path, "/api/order": named_order, "/api/search": search_order}
