"""A chain of two GEMMs, the fused FFN: GEMM0 = x·W_gate_upᵀ gives the intermediate h (the
SwiGLU epilogue folds gate and up into one M×I tile), GEMM1 = h·W_downᵀ gives the output.

Cache keys: ``("X", r, k)`` x's block (row-block r, K-step k over the hidden size),
``("W0", j, k)`` W_gate_up's block for intermediate column-block j (gate and up together when
``gated``), ``("H", r, s)`` the intermediate's block (row-block r, GEMM1 K-step s), and
``("W1", c, s)`` W_down's block for output column-block c. GEMM0's tiles write their
intermediate blocks through the cache (write-allocate), so a GEMM1 tile that runs soon after
reads them from L2; the final output streams to DRAM.

Dependencies (``deps``):
- ``"rowblock"``: the kernel's: a GEMM1 tile of row-block r starts only when every GEMM0 tile it
  reads is complete (all of row-block r, or one half of it when GEMM1 runs in K-halves).
- ``"tile"``: a what-if: GEMM1's K-step s waits only on the GEMM0 tile that produced its K-chunk
  (n-tile j = s·block_k // block_n), so it starts on the first chunk and consumes the rest as
  they arrive. With M ≤ block_m there is one row-block and "rowblock" is a full barrier.

Issue orders: the persistent FFN kernel's own ticket orders (``"sequential[:R]"``,
``"rowblock"``, ``"multirow[:R]"``, ``"halfrow"``, ``"seqsplit[:R]"``), taken from
:mod:`flashflow.kernels.tile_order`, the definition the kernel compiles; and one order the
kernel does not run, ``"interleaved"``: per row-block, the first half of its GEMM0 row, then the
second half interleaved with its GEMM1 row, so GEMM1 tiles are issued while GEMM0 is still
producing. A GEMM1 tile that is issued before a GEMM0 tile it waits on holds its slot; with too
few slots this deadlocks, and the model says so (``Traffic`` is replaced by the error).
"""
from __future__ import annotations

from dataclasses import dataclass

from flashflow.dataflow.machine import DeadlockError, Job, Schedule, Traffic, replay, schedule
from flashflow.dataflow.shape import GemmShape, _positive_int
from flashflow.device import cdiv
from flashflow.kernels import tile_order

POLICIES = tile_order.ORDERS + ("interleaved",)
DEPENDENCIES = ("rowblock", "tile")


@dataclass(frozen=True)
class FfnShape:
    M: int                  # tokens
    hidden: int             # model width: GEMM0's K, GEMM1's N
    intermediate: int       # FFN width: GEMM0's N, GEMM1's K
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    elem_bytes: int = 2
    gated: bool = True      # W_gate_up holds two matrices (gate and up)
    block_n1: int = 0       # GEMM1's output tile width; 0: block_n (GEMM0's)

    def __post_init__(self):
        for name in ("M", "hidden", "intermediate", "block_m", "block_n", "block_k",
                     "elem_bytes"):
            _positive_int(name, getattr(self, name))
        if self.block_n1:
            _positive_int("block_n1", self.block_n1)
        if self.block_n % self.block_k:
            raise ValueError(f"block_n ({self.block_n}) must be a multiple of block_k "
                             f"({self.block_k}): GEMM1 reads GEMM0's tiles in K-steps")

    @property
    def gemm0(self) -> GemmShape:
        """x · W_gate_upᵀ: M × intermediate over K = hidden (W's element count per column
        doubles when ``gated``: :func:`_gemm0_job` charges that)."""
        return GemmShape(self.M, self.intermediate, self.hidden, self.block_m, self.block_n,
                         self.block_k, self.elem_bytes)

    @property
    def gemm1(self) -> GemmShape:
        """h · W_downᵀ: M × hidden over K = intermediate, in ``bn1``-wide output tiles."""
        return GemmShape(self.M, self.hidden, self.intermediate, self.block_m, self.bn1,
                         self.block_k, self.elem_bytes)

    @property
    def row_blocks(self) -> int:
        return self.gemm0.tiles_m

    @property
    def tiles_n0(self) -> int:
        return self.gemm0.tiles_n

    @property
    def bn1(self) -> int:
        return self.block_n1 or self.block_n

    @property
    def tiles_n1(self) -> int:
        return self.gemm1.tiles_n

    @property
    def k_steps0(self) -> int:
        return self.gemm0.k_steps

    @property
    def k_steps1(self) -> int:
        return self.gemm1.k_steps


def _gemm0_job(s: FfnShape, r: int, j: int) -> Job:
    e = s.elem_bytes
    gemm0, gemm1 = s.gemm0, s.gemm1
    rows = gemm0.rows(r)
    cols = gemm0.cols(j)
    weight_mult = 2 if s.gated else 1
    steps = []
    for k in range(gemm0.k_steps):
        depth = gemm0.depth(k)
        steps.append(((("X", r, k), rows * depth * e),
                      (("W0", j, k), depth * cols * weight_mult * e)))
    per_tile = s.block_n // s.block_k
    writes = []
    for sub in range(j * per_tile, min((j + 1) * per_tile, gemm1.k_steps)):
        writes.append((("H", r, sub), rows * gemm1.depth(sub) * e))
    return Job(name=("gemm0", r, j), steps=tuple(steps), writes=tuple(writes))


def issue_order(s: FfnShape, policy: str) -> list[tuple[int, int, int, int]]:
    """The chain's tiles in issue order, as (kind, r, j, part) (kind 0: GEMM0 tile (r, j);
    kind 1: GEMM1 tile (r, j); part: the K-half of a split GEMM1 tile, or the half of the row a
    GEMM0 tile counts towards): the kernel's ticket order for its policies, or the model-only
    ``"interleaved"`` order."""
    if policy == "interleaved":
        out = []
        half = cdiv(s.tiles_n0, 2)
        for r in range(s.row_blocks):
            first = [(0, r, j, 0) for j in range(half)]
            rest = [(0, r, j, 0) for j in range(half, s.tiles_n0)]
            second = [(1, r, c, 0) for c in range(s.tiles_n1)]
            out += first
            for i in range(max(len(rest), len(second))):
                out += rest[i:i + 1] + second[i:i + 1]
        return out
    try:
        return tile_order.issue_order(policy, s.row_blocks, s.tiles_n0, s.tiles_n1)
    except (TypeError, ValueError):
        name = str(policy).partition(":")[0]
        if name in tile_order.GROUPED_ORDERS:
            raise ValueError(f"{name} group must be positive (an integer R ≥ 1 row-blocks), got {policy!r}") from None
        raise ValueError(f"policy must be one of {POLICIES} (sequential, multirow and seqsplit take ':R' "
                         f"row-blocks per group), got {policy!r}") from None


def chain_jobs(s: FfnShape, policy: str, deps: str = "tile") -> list[Job]:
    if deps not in DEPENDENCIES:
        raise ValueError(f"deps must be one of {DEPENDENCIES}, got {deps!r}")
    return ticket_jobs(s, issue_order(s, policy), deps=deps)


def ticket_jobs(s: FfnShape, order, partial_bytes: int = 4, deps: str = "rowblock") -> list[Job]:
    """The persistent FFN kernel's tiles as model jobs, in the given ticket order.

    ``order``: ``(kind, r, j, part)`` per ticket, as :func:`issue_order` gives it (kind 0:
    GEMM0 tile (r, j); kind 1: GEMM1 tile (r, j); ``part``: the K-half of a split GEMM1 tile, or
    which half of the row a GEMM0 tile belongs to). With ``deps="rowblock"`` the waits are the
    kernel's: a GEMM1 tile starts when its row-block counter holds every GEMM0 tile it reads
    (all of row-block r, or one half when GEMM1 is split in K-halves); ``deps="tile"`` makes
    each K-step wait only on the GEMM0 tile that holds its chunk.
    A split tile's part 0 writes fp32 partials (``partial_bytes`` each) through the cache
    (write-allocate: part 1 reads them back); part 1 waits on part 0 after its K loop, reads
    the partials in its last step and stores the output.
    """
    if deps not in DEPENDENCIES:
        raise ValueError(f"deps must be one of {DEPENDENCIES}, got {deps!r}")
    order = [tuple(t) for t in order]
    per_tile = s.block_n // s.block_k
    split = any(kind == 1 and part == 1 for kind, _, _, part in order)
    tiles_n0 = s.tiles_n0
    half = cdiv(tiles_n0, 2)
    k_split = min(half * s.block_n, s.intermediate)
    index = {t: i for i, t in enumerate(order)}
    g0 = {(r, j): i for i, (kind, r, j, _) in enumerate(order) if kind == 0}
    missing = [t for t in order if t[0] == 1 and any((t[1], c) not in g0 for c in range(tiles_n0))]
    if missing:
        raise ValueError(f"order has GEMM1 tiles without their GEMM0 row, e.g. {missing[0]}")
    e = s.elem_bytes
    gemm1 = s.gemm1
    jobs = []
    for kind, r, j, part in order:
        if kind == 0:
            jobs.append(_gemm0_job(s, r, j))
            continue
        rows, cols = gemm1.rows(r), gemm1.cols(j)
        lo, hi = ((0, k_split) if part == 0 else (k_split, s.intermediate)) if split \
            else (0, s.intermediate)
        cols0 = range(tiles_n0) if not split else (range(half) if part == 0 else range(half, tiles_n0))
        subs = range(lo // s.block_k, cdiv(hi, s.block_k))
        steps = []
        for sub in subs:
            depth = gemm1.depth(sub)
            steps.append([(("H", r, sub), rows * depth * e), (("W1", j, sub), depth * cols * e)])
        if deps == "tile":
            waits = [(g0[(r, sub // per_tile)],) for sub in subs]
        else:
            waits = [()] * len(steps)
            waits[0] = tuple(g0[(r, c)] for c in cols0)
        partial = (("P", r, j), rows * cols * partial_bytes)
        if split and part == 1:
            steps[-1].append(partial)
            waits[-1] = waits[-1] + (index[(1, r, j, 0)],)
        while waits and not waits[-1]:   # no wait after the last one that holds any
            waits.pop()
        if split and part == 0:
            jobs.append(Job(name=("gemm1", r, j, 0), steps=tuple(map(tuple, steps)),
                            writes=(partial,), waits=tuple(waits)))
        else:
            jobs.append(Job(name=("gemm1", r, j, part), steps=tuple(map(tuple, steps)),
                            store_bytes=rows * cols * e, waits=tuple(waits)))
    return jobs


def simulate_tickets(s: FfnShape, order, hw, partial_bytes: int = 4) -> ChainResult:
    """Traffic of the kernel's ticket order on ``hw`` (a :class:`~flashflow.dataflow.model.
    Hardware`): slots = SMs × tiles per SM, its L2 (unified or partitioned) and drift, the
    stagger measured in GEMM0 K-steps (one GEMM0 tile's length)."""
    jobs = ticket_jobs(s, order, partial_bytes)
    opts = hw.machine_options()
    stagger = round(opts.pop("drift", 0.0) * s.k_steps0)
    sharing = opts.pop("sharing", "home")
    try:
        sched = schedule(jobs, hw.slots, stagger=stagger, **opts)
    except DeadlockError as e:
        return ChainResult("tickets", "kernel", None, None, str(e))
    return ChainResult("tickets", "kernel", replay(sched, jobs, hw.l2_bytes, "lru", sharing=sharing),
                       sched)


@dataclass
class ChainResult:
    policy: str
    deps: str
    traffic: Traffic | None          # None when the issue order deadlocks
    schedule: Schedule | None
    error: str | None = None

    @property
    def deadlocked(self) -> bool:
        return self.traffic is None


def simulate_chain(s: FfnShape, policy: str, cache_bytes: int, num_sms: int, deps: str = "tile",
                   cache_policy: str = "lru") -> ChainResult:
    jobs = chain_jobs(s, policy, deps)
    try:
        sched = schedule(jobs, num_sms)
    except DeadlockError as e:
        return ChainResult(policy, deps, None, None, str(e))
    return ChainResult(policy, deps, replay(sched, jobs, cache_bytes, cache_policy), sched)


def compare_policies(s: FfnShape, cache_bytes: int, num_sms: int, deps: str = "tile",
                     policies=("sequential", "rowblock", "halfrow", "multirow:2"),
                     cache_policy: str = "lru") -> list[ChainResult]:
    return [simulate_chain(s, p, cache_bytes, num_sms, deps, cache_policy) for p in policies]
