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
    """What the model needs of a GPU: how many tiles run at once, the L2 size and, optionally,
    how the L2 is partitioned and whether the tiles drift out of lockstep (see
    :mod:`~flashflow.dataflow.machine`)."""

    num_sms: int
    l2_bytes: int
    tiles_per_sm: int = 1    # resident CTAs per SM for the kernel's config
    l2_partitions: int = 1
    sharing: str = "home"
    placement: str = "halves"
    drift: float = 0.0

    @property
    def slots(self) -> int:
        return self.num_sms * self.tiles_per_sm

    def machine_options(self) -> dict:
        """The keyword arguments :func:`simulate` takes for this GPU (besides size and slots)."""
        if self.l2_partitions == 1:
            return {"drift": self.drift}
        return {"partitions": self.l2_partitions, "sharing": self.sharing,
                "placement": self.placement, "drift": self.drift,
                "tiles_per_sm": self.tiles_per_sm}


# An H100 SXM: 132 SMs, 50 MB of L2, modelled as one LRU over the whole L2 in lockstep waves:
# simple, and what the explorer page shows, but it ranks measured tile orders poorly.
H100 = Hardware(num_sms=132, l2_bytes=50 * 1024 * 1024)

# The same GPU with the L2 as the hardware builds it: two partitions of 25 MB joined by a
# crossbar, every line homed in one of them (the point of coherence; a near miss that its home
# holds crosses over without touching DRAM), each SM filling its near partition, so data used on
# both sides is held twice. SM ids are taken as numbered partition-major and CTAs as dealt one
# per SM in id order ("halves"); tiles drift out of lockstep, so the slots' phases are spread
# over a whole tile (drift=1). No parameter was fitted, but this variant was chosen among
# several on 12 measured points (docs/dataflow.md; `flashflow bench --from-json bench/results/dataflow-nvidia-h100-80gb-hbm3.json --variants all`).
H100_PARTITIONED = Hardware(num_sms=132, l2_bytes=50 * 1024 * 1024, l2_partitions=2,
                            sharing="home", placement="halves", drift=1.0)


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
             policy: str = "lru", record: bool = False, *, partitions: int = 1,
             sharing: str = "home", placement: str = "random", drift: float = 0.0,
             seed: int = 0, tiles_per_sm: int = 1) -> Traffic:
    """Run the tiles of ``order`` (any list of distinct tiles, a prefix of an order too) in
    waves of ``num_sms`` through a cache of ``cache_bytes``. ``record`` keeps a
    :class:`~flashflow.dataflow.machine.StepRecord` per wave.

    ``partitions`` > 1 splits the cache into that many near partitions (``sharing`` and
    ``placement`` as in :mod:`~flashflow.dataflow.machine`; ``tiles_per_sm`` slots share an
    SM and so a side); ``drift`` spreads the slots' start times over that fraction of one
    tile's K-steps (0: lockstep, 1: phases spread over a whole tile)."""
    if not 0 <= drift <= 1:
        raise ValueError(f"drift must be a fraction of a tile in [0, 1], got {drift!r}")
    return run(gemm_jobs(shape, order), num_sms, cache_bytes, policy, record,
               stagger=round(drift * shape.k_steps), partitions=partitions,
               placement=placement, sharing=sharing, seed=seed, tiles_per_sm=tiles_per_sm)


def simulate_on(shape: GemmShape, order: Iterable, hw: Hardware, policy: str = "lru",
                record: bool = False) -> Traffic:
    """:func:`simulate` with every machine parameter taken from ``hw``."""
    return simulate(shape, order, hw.l2_bytes, hw.slots, policy, record,
                    **hw.machine_options())


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
                   specs: Sequence[str] | None = None, extra: dict | None = None,
                   **machine) -> list[OrderRow]:
    """Traffic of every named order (``specs``, default :func:`orders.default_specs`) and of
    any ``extra`` {label: order}, in the order given. ``machine``: :func:`simulate`'s
    partition and drift options."""
    specs = list(specs) if specs is not None else _orders.default_specs(shape.tiles_m,
                                                                        shape.tiles_n)
    rows = []
    for spec in specs:
        order = _orders.make_order(spec, shape.tiles_m, shape.tiles_n)
        rows.append(OrderRow(spec, simulate(shape, order, cache_bytes, num_sms, policy,
                                            **machine)))
        log.debug("%s: %d bytes read", spec, rows[-1].traffic.read_bytes)
    for label, order in (extra or {}).items():
        rows.append(OrderRow(label, simulate(shape, order, cache_bytes, num_sms, policy,
                                             **machine)))
    return rows
