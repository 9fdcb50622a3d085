"""DRAM traffic of one GEMM run in a given tile order on an SM array with an L2.

Cache keys: ``("A", m, k)`` is A's block for tile-row m at K-step k, ``("B", n, k)`` B's block
for tile-column n at K-step k. C tiles stream to DRAM without being kept (nothing reads them
back inside the GEMM). See :mod:`flashflow.dataflow.machine` for the timing rules.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Sequence

from flashflow.dataflow import orders as _orders
from flashflow.dataflow.machine import Job, Traffic, run
from flashflow.dataflow.shape import GemmShape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hardware:
    """What the model needs of a GPU: how many tiles run at once and the L2 size."""

    num_sms: int
    l2_bytes: int
    tiles_per_sm: int = 1    # resident CTAs per SM for the kernel's config

    @property
    def slots(self) -> int:
        return self.num_sms * self.tiles_per_sm


# An H100 SXM: 132 SMs, 50 MB of L2. The L2 is two partitions with a crossbar between them and
# data may be duplicated across them, so the effective size for reuse is smaller; the model
# takes the nominal size and is an approximation either way.
H100 = Hardware(num_sms=132, l2_bytes=50 * 1024 * 1024)


def _a_panel(shape: GemmShape, m: int) -> list:
    return [(("A", m, k), shape.a_block_bytes(m, k)) for k in range(shape.k_steps)]


def _b_panel(shape: GemmShape, n: int) -> list:
    return [(("B", n, k), shape.b_block_bytes(k, n)) for k in range(shape.k_steps)]


def tile_job(shape: GemmShape, m: int, n: int, a_panel=None, b_panel=None) -> Job:
    """Tile (m, n): K-step k reads A's block (m, k) and B's block (k, n)."""
    a_panel = a_panel or _a_panel(shape, m)
    b_panel = b_panel or _b_panel(shape, n)
    return Job(name=(m, n), steps=tuple(zip(a_panel, b_panel)),
               store_bytes=shape.c_tile_bytes(m, n))


def gemm_jobs(shape: GemmShape, order: Iterable) -> list[Job]:
    tiles = _orders.validate(order, shape.tiles_m, shape.tiles_n)
    a = {m: _a_panel(shape, m) for m in {m for m, _ in tiles}}   # shared by a row's tiles
    b = {n: _b_panel(shape, n) for n in {n for _, n in tiles}}
    return [tile_job(shape, m, n, a[m], b[n]) for m, n in tiles]


def simulate(shape: GemmShape, order: Iterable, cache_bytes: int, num_sms: int = 1,
             policy: str = "lru", record: bool = False) -> Traffic:
    """Run the tiles of ``order`` (any list of distinct tiles, a prefix of an order too) in
    waves of ``num_sms`` through a cache of ``cache_bytes``. ``record`` keeps a
    :class:`~flashflow.dataflow.machine.StepRecord` per wave."""
    return run(gemm_jobs(shape, order), num_sms, cache_bytes, policy, record)


def panel_occupancy(shape: GemmShape, keys: Sequence) -> dict:
    """How many K-blocks of each A row-panel and B column-panel a cache holds."""
    a = [0] * shape.tiles_m
    b = [0] * shape.tiles_n
    for kind, idx, _ in keys:
        if kind == "A":
            a[idx] += 1
        elif kind == "B":
            b[idx] += 1
    return {"A": a, "B": b}


@dataclass
class OrderRow:
    spec: str
    traffic: Traffic


def compare_orders(shape: GemmShape, cache_bytes: int, num_sms: int = 1, policy: str = "lru",
                   specs: Sequence[str] | None = None, extra: dict | None = None) -> list[OrderRow]:
    """Traffic of every named order (``specs``, default :func:`orders.default_specs`) and of
    any ``extra`` {label: order}, in the order given."""
    specs = list(specs) if specs is not None else _orders.default_specs(shape.tiles_m,
                                                                        shape.tiles_n)
    rows = []
    for spec in specs:
        order = _orders.make_order(spec, shape.tiles_m, shape.tiles_n)
        rows.append(OrderRow(spec, simulate(shape, order, cache_bytes, num_sms, policy)))
        log.debug("%s: %d bytes read", spec, rows[-1].traffic.read_bytes)
    for label, order in (extra or {}).items():
        rows.append(OrderRow(label, simulate(shape, order, cache_bytes, num_sms, policy)))
    return rows
