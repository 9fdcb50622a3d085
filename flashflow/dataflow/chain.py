"""A chain of two GEMMs, the fused FFN: GEMM0 = x·W_gate_upᵀ gives the intermediate h (the
SwiGLU epilogue folds gate and up into one M×I tile), GEMM1 = h·W_downᵀ gives the output.

Cache keys: ``("X", r, k)`` x's block (row-block r, K-step k over the hidden size),
``("W0", j, k)`` W_gate_up's block for intermediate column-block j (gate and up together when
``gated``), ``("H", r, s)`` the intermediate's block (row-block r, GEMM1 K-step s), and
``("W1", c, s)`` W_down's block for output column-block c. GEMM0's tiles write their
intermediate blocks through the cache (write-allocate), so a GEMM1 tile that runs soon after
reads them from L2; the final output streams to DRAM.

Dependencies:
- ``"rowblock"``: a GEMM1 tile of row-block r starts only when every GEMM0 tile of row-block r
  is complete (one flag per row-block).
- ``"tile"``: GEMM1's K-step s waits only on the GEMM0 tile that produced its K-chunk
  (n-tile j = s·block_k // block_n), so it starts on the first chunk and consumes the rest as
  they arrive. With M ≤ block_m there is one row-block and "rowblock" is a full barrier.

Issue orders (policies) — all walk GEMM0 row-major inside a row-block:
- ``"sequential"``: all of GEMM0, then all of GEMM1 (two launches, or one with a barrier).
- ``"rowblock"``: per row-block, its GEMM0 row then its GEMM1 row.
- ``"multirow:R"``: per group of R row-blocks, their GEMM0 rows then their GEMM1 rows.
- ``"halfrow"``: per row-block, the first half of its GEMM0 row, then the second half
  interleaved with its GEMM1 row, so GEMM1 tiles are issued while GEMM0 is still producing.
  A GEMM1 tile that is issued before a GEMM0 tile it waits on holds its slot; with too few
  slots this deadlocks, and the model says so (``Traffic`` is replaced by the error).
"""
from __future__ import annotations

from dataclasses import dataclass

from flashflow.dataflow.machine import DeadlockError, Job, Schedule, Traffic, replay, schedule
from flashflow.dataflow.shape import _positive_int

POLICIES = ("sequential", "rowblock", "halfrow", "multirow")
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

    def __post_init__(self):
        for name in ("M", "hidden", "intermediate", "block_m", "block_n", "block_k",
                     "elem_bytes"):
            _positive_int(name, getattr(self, name))
        if self.block_n % self.block_k:
            raise ValueError(f"block_n ({self.block_n}) must be a multiple of block_k "
                             f"({self.block_k}): GEMM1 reads GEMM0's tiles in K-steps")

    @property
    def row_blocks(self) -> int:
        return -(-self.M // self.block_m)

    @property
    def tiles_n0(self) -> int:
        return -(-self.intermediate // self.block_n)

    @property
    def tiles_n1(self) -> int:
        return -(-self.hidden // self.block_n)

    @property
    def k_steps0(self) -> int:
        return -(-self.hidden // self.block_k)

    @property
    def k_steps1(self) -> int:
        return -(-self.intermediate // self.block_k)

    def _rows(self, r):
        return min(self.block_m, self.M - r * self.block_m)

    def _span(self, total, block, i):
        return min(block, total - i * block)


def _gemm0_job(s: FfnShape, r: int, j: int) -> Job:
    e = s.elem_bytes
    rows = s._rows(r)
    cols = s._span(s.intermediate, s.block_n, j)
    weight_mult = 2 if s.gated else 1
    steps = []
    for k in range(s.k_steps0):
        depth = s._span(s.hidden, s.block_k, k)
        steps.append(((("X", r, k), rows * depth * e),
                      (("W0", j, k), depth * cols * weight_mult * e)))
    per_tile = s.block_n // s.block_k
    writes = []
    for sub in range(j * per_tile, min((j + 1) * per_tile, s.k_steps1)):
        writes.append((("H", r, sub), rows * s._span(s.intermediate, s.block_k, sub) * e))
    return Job(name=("gemm0", r, j), steps=tuple(steps), writes=tuple(writes))


def _gemm1_job(s: FfnShape, r: int, c: int, deps: str, g0_index: dict) -> Job:
    e = s.elem_bytes
    rows = s._rows(r)
    cols = s._span(s.hidden, s.block_n, c)
    per_tile = s.block_n // s.block_k
    steps, waits = [], []
    for sub in range(s.k_steps1):
        depth = s._span(s.intermediate, s.block_k, sub)
        steps.append(((("H", r, sub), rows * depth * e), (("W1", c, sub), depth * cols * e)))
        if deps == "tile":
            waits.append((g0_index[(r, sub // per_tile)],))
        elif sub == 0:
            waits.append(tuple(g0_index[(r, j)] for j in range(s.tiles_n0)))
    return Job(name=("gemm1", r, c), steps=tuple(steps), store_bytes=rows * cols * e,
               waits=tuple(waits))


def issue_order(s: FfnShape, policy: str) -> list[tuple[str, int, int]]:
    """The chain's jobs in issue order, as ("gemm0", r, j) / ("gemm1", r, c)."""
    name, _, arg = policy.partition(":")
    g0 = lambda r: [("gemm0", r, j) for j in range(s.tiles_n0)]  # noqa: E731
    g1 = lambda r: [("gemm1", r, c) for c in range(s.tiles_n1)]  # noqa: E731
    rows = range(s.row_blocks)
    if name == "sequential":
        return [t for r in rows for t in g0(r)] + [t for r in rows for t in g1(r)]
    if name == "rowblock":
        return [t for r in rows for t in (*g0(r), *g1(r))]
    if name == "multirow":
        group = int(arg) if arg else 2
        if group <= 0:
            raise ValueError(f"multirow group must be positive, got {policy!r}")
        out = []
        for first in range(0, s.row_blocks, group):
            block = range(first, min(first + group, s.row_blocks))
            out += [t for r in block for t in g0(r)] + [t for r in block for t in g1(r)]
        return out
    if name == "halfrow":
        out = []
        half = (s.tiles_n0 + 1) // 2
        for r in rows:
            first, rest, second = g0(r)[:half], g0(r)[half:], g1(r)
            out += first
            for i in range(max(len(rest), len(second))):
                out += rest[i:i + 1] + second[i:i + 1]
        return out
    raise ValueError(f"policy must be one of {POLICIES} (multirow:R for R rows), got {policy!r}")


def chain_jobs(s: FfnShape, policy: str, deps: str = "tile") -> list[Job]:
    if deps not in DEPENDENCIES:
        raise ValueError(f"deps must be one of {DEPENDENCIES}, got {deps!r}")
    names = issue_order(s, policy)
    g0_index = {(r, j): i for i, (kind, r, j) in enumerate(names) if kind == "gemm0"}
    return [_gemm0_job(s, r, j) if kind == "gemm0" else _gemm1_job(s, r, j, deps, g0_index)
            for kind, r, j in names]


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
