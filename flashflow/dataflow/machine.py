"""An SM array running jobs (output tiles) through a shared cache.

Rules, the one implementation every other module uses:

- Time advances in *K-steps*: one K-step of one tile reads one block of each operand and takes
  one unit of time, the same for every job. Hits and misses do not change timing (a modelling
  choice that keeps the schedule independent of the cache, so the whole trace is known before
  the cache runs and Belady's policy can look ahead).
- ``num_slots`` jobs run at once (SMs × resident tiles per SM). Free slots take the next jobs
  *in issue order*, as a hardware block scheduler or an atomic ticket counter hands them out.
  With equal-length jobs this gives waves of ``num_slots`` tiles.
- A job's K-step may wait for other jobs to be complete (a chain's GEMM1 waits on GEMM0);
  a waiting job holds its slot. A dependency issued after the waiting jobs can deadlock the
  machine, which :class:`DeadlockError` reports.
- All reads of one time step are concurrent: duplicates merge into one request (an L2 merges
  concurrent misses to a line) and they reach the cache in sorted key order, so the order of
  tiles *inside* a wave carries no meaning.
- A finished job's writes happen at the end of its last step: ``writes`` go through the cache
  (write-allocate, for data a later job reads back), ``store_bytes`` stream to DRAM unkept.
  Every written byte reaches DRAM once, so writes cost the same in every order.

Two options bring the machine closer to a real GPU (both off by default):

- ``stagger``: slot i takes its first job at time ``i * stagger // num_slots``. Real CTAs do
  not run in lockstep: tile times vary by a few percent, so after a few waves the slots' phases
  are spread over a whole tile, and a tile that shares a panel with one issued just before it
  reads each block a little later rather than at the same moment. ``stagger`` equal to one
  job's K-steps is that steady state (phases spread uniformly), with no free parameter.
- ``partitions``: an L2 cut into partitions (:class:`~flashflow.dataflow.cache.PartitionedL2`);
  every job runs on one *side* (the near partition of its SM) and reads through it. Concurrent
  reads merge within a side only. Slot i runs on SM ``i mod (num_slots / tiles_per_sm)``: the
  block scheduler deals one CTA to every SM, in SM order, before any SM gets a second.
  ``placement`` says which side an SM is on: ``"halves"`` (SM ids split into P contiguous runs,
  as when ids are numbered GPC by GPC and the first GPCs hang off one partition),
  ``"alternate"`` (SM s on side s mod P: ids interleaved over the partitions) or ``"random"``
  (a seeded coin per job, ignoring the slot: the limit where drift has scrambled which SM frees
  first). Writes go into the writer's side.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from flashflow.dataflow.cache import NEVER, PartitionedL2, make_cache

Block = tuple[Hashable, int]  # (key, size in bytes)


class DeadlockError(RuntimeError):
    """Every running job waits on a job that cannot run: the issue order is not a valid ticket
    order for this many slots."""


@dataclass(frozen=True)
class Job:
    name: Hashable
    steps: tuple[tuple[Block, ...], ...]           # blocks read at each K-step
    writes: tuple[Block, ...] = ()                 # written through the cache when done
    store_bytes: int = 0                           # written straight to DRAM when done
    waits: tuple[tuple[int, ...], ...] = ()        # per K-step: indices of jobs to finish first


@dataclass
class TimeStep:
    time: int
    reads: list[Block]
    writes: list[Block]
    finished: list[int]      # indices of jobs that finish at the end of this step
    store_bytes: int = 0
    requests: int = 0        # block reads asked for, before concurrent duplicates merge
    side_reads: list[list[Block]] | None = None    # per side, merged within it (partitions)
    side_writes: list[list[Block]] | None = None


@dataclass
class Schedule:
    steps: list[TimeStep]
    num_slots: int
    busy: int = 0            # slot-steps doing work
    stalled: int = 0         # slot-steps held by a job waiting on a dependency
    finish_time: dict[int, int] = field(default_factory=dict)
    partitions: int = 1
    side_of_job: list[int] | None = None

    @property
    def makespan(self) -> int:
        return len(self.steps)

    @property
    def utilization(self) -> float:
        total = self.makespan * self.num_slots
        return self.busy / total if total else 0.0


PLACEMENTS = ("random", "alternate", "halves")


def schedule(jobs: Sequence[Job], num_slots: int, *, stagger: int = 0, partitions: int = 1,
             placement: str = "random", seed: int = 0, tiles_per_sm: int = 1) -> Schedule:
    """Run ``jobs`` in issue order on ``num_slots`` slots; return what is accessed when.
    ``stagger``, ``partitions`` and ``placement``: see the module docstring; ``seed`` drives
    the random placement."""
    if num_slots <= 0:
        raise ValueError(f"num_slots must be positive, got {num_slots!r}")
    if isinstance(stagger, bool) or not isinstance(stagger, int) or stagger < 0:
        raise ValueError(f"stagger must be an int >= 0 (K-steps), got {stagger!r}")
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions must be a positive int, got {partitions!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if isinstance(tiles_per_sm, bool) or not isinstance(tiles_per_sm, int) or \
            tiles_per_sm < 1 or num_slots % tiles_per_sm:
        raise ValueError(f"tiles_per_sm must be a positive divisor of num_slots={num_slots}, "
                         f"got {tiles_per_sm!r}")
    num_sms = num_slots // tiles_per_sm
    sided = partitions > 1
    rng = random.Random(seed)
    side_of_job: list[int] = []
    start = [i * stagger // num_slots for i in range(num_slots)]
    slots: list[list[int] | None] = [None] * num_slots   # [job index, next K-step, side]
    finish_time: dict[int, int] = {}
    next_job = 0
    steps: list[TimeStep] = []
    busy = stalled = 0
    t = 0
    while next_job < len(jobs) or any(s is not None for s in slots):
        for i in range(num_slots):
            if slots[i] is None and next_job < len(jobs) and t >= start[i]:
                if placement == "random":
                    side = rng.randrange(partitions)
                elif placement == "alternate":
                    side = i % num_sms % partitions
                else:
                    side = i % num_sms * partitions // num_sms
                side_of_job.append(side)
                slots[i] = [next_job, 0, side]
                next_job += 1
        sizes: dict = {}
        side_sizes: list[dict] = [{} for _ in range(partitions)] if sided else []
        requests = 0
        finished: list[int] = []
        progressed = False
        for slot in slots:
            if slot is None:
                continue
            j, k, side = slot
            job = jobs[j]
            if k < len(job.waits) and any(finish_time.get(d, t) >= t for d in job.waits[k]):
                stalled += 1
                continue
            progressed = True
            busy += 1
            for key, size in job.steps[k]:
                sizes[key] = size
            if sided:
                side_sizes[side].update(job.steps[k])
            requests += len(job.steps[k])
            slot[1] = k + 1
            if slot[1] == len(job.steps):
                finished.append(j)
        if not progressed and any(t < s for s in start):
            # slots still before their staggered start: the machine idles, it is not stuck
            steps.append(TimeStep(t, [], [], [], 0, 0, [[] for _ in side_sizes] or None,
                                  [[] for _ in side_sizes] or None))
            t += 1
            continue
        if not progressed:
            waiting = [jobs[s[0]].name for s in slots if s is not None]
            raise DeadlockError(f"at time {t} every slot waits on an unfinished job "
                                f"(running: {waiting}); issue dependencies first or use "
                                f"more slots")
        writes: dict = {}
        side_writes: list[dict] = [{} for _ in range(partitions)] if sided else []
        store = 0
        for j in finished:
            finish_time[j] = t
            for key, size in jobs[j].writes:
                writes[key] = size
            if sided:
                side_writes[side_of_job[j]].update(jobs[j].writes)
            store += jobs[j].store_bytes
        for i, slot in enumerate(slots):
            if slot is not None and slot[0] in finish_time:
                slots[i] = None
        steps.append(TimeStep(t, [(k, sizes[k]) for k in sorted(sizes)],
                              [(k, writes[k]) for k in sorted(writes)], sorted(finished), store,
                              requests,
                              [sorted(d.items()) for d in side_sizes] if sided else None,
                              [sorted(d.items()) for d in side_writes] if sided else None))
        t += 1
    return Schedule(steps, num_slots, busy, stalled, finish_time, partitions,
                    side_of_job if sided else None)


@dataclass
class StepRecord:
    """State after one time step at which some job finished (a wave, for a plain GEMM)."""

    time: int
    finished: list[Hashable]     # names of the jobs that finished
    reads: int                   # block reads asked for since the previous record
    misses: int
    read_bytes: int              # DRAM bytes read since the previous record
    cum_read_bytes: int
    cum_write_bytes: int
    cache: list[Hashable]        # keys held, in the cache's own order

    @property
    def cum_dram_bytes(self) -> int:
        return self.cum_read_bytes + self.cum_write_bytes


@dataclass
class Traffic:
    """DRAM traffic of one run. ``misses`` counts blocks fetched from DRAM, ``hits`` every
    other block read a tile asked for: found in the cache, or merged with a concurrent
    request for the same block."""

    read_bytes: int
    write_bytes: int
    hits: int
    misses: int
    makespan: int
    utilization: float
    steps: list[StepRecord] | None = None

    @property
    def dram_bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def _next_uses(sched: Schedule) -> list[float]:
    """For every access of the trace, in order, the position of the next access to its key."""
    keys = [key for step in sched.steps for key, _ in (*step.reads, *step.writes)]
    nxt: list[float] = [NEVER] * len(keys)
    last: dict = {}
    for i in range(len(keys) - 1, -1, -1):
        nxt[i] = last.get(keys[i], NEVER)
        last[keys[i]] = i
    return nxt


def replay(sched: Schedule, jobs: Sequence[Job], cache_bytes: int, policy: str = "lru",
           record: bool = False, sharing: str = "home") -> Traffic:
    """Feed the schedule's accesses through a cache; count DRAM bytes. A schedule with
    partitions runs through a :class:`PartitionedL2` of ``cache_bytes`` in all, whose
    ``sharing`` rule says what a near miss costs (LRU only)."""
    if sched.partitions > 1:
        if policy != "lru":
            # Belady's look-ahead needs one future per partition, which the crossbar couples
            raise ValueError(f"a partitioned L2 is modelled with policy 'lru' only, got {policy!r}")
        l2 = PartitionedL2(cache_bytes, sched.partitions, sharing)

        # sides take turns within a step: the first side's miss is then the other sides'
        # crossbar hit, as a home partition merges concurrent requests for a line
        def sides(step, reads):
            return enumerate(step.side_reads if reads else step.side_writes)

        access = l2.access   # (key, size, side) -> bytes fetched from DRAM

        contents = l2.contents
    else:
        cache = make_cache(policy, cache_bytes)
        nxt = _next_uses(sched) if policy == "belady" else None
        pos = 0

        def sides(step, reads):
            return ((0, step.reads if reads else step.writes),)

        def access(key, size, side):
            nonlocal pos
            hit = cache.access(key, size, nxt[pos] if nxt else NEVER)
            pos += 1
            return 0 if hit else size

        contents = cache.contents
    hits = misses = 0
    read_bytes = write_bytes = 0
    records: list[StepRecord] | None = [] if record else None
    since_reads = since_misses = since_bytes = 0
    for step in sched.steps:
        step_misses = 0
        for side, reads in sides(step, True):
            for key, size in reads:
                fetched = access(key, size, side)
                if fetched:
                    step_misses += 1
                    read_bytes += fetched
                    since_bytes += fetched
        misses += step_misses
        hits += step.requests - step_misses
        since_misses += step_misses
        since_reads += step.requests
        for side, writes in sides(step, False):
            for key, size in writes:
                access(key, size, side)
                write_bytes += size
        write_bytes += step.store_bytes
        if records is not None and step.finished:
            records.append(StepRecord(step.time, [jobs[j].name for j in step.finished],
                                      since_reads, since_misses, since_bytes, read_bytes,
                                      write_bytes, contents()))
            since_reads = since_misses = since_bytes = 0
    return Traffic(read_bytes, write_bytes, hits, misses, sched.makespan, sched.utilization,
                   records)


def run(jobs: Sequence[Job], num_slots: int, cache_bytes: int, policy: str = "lru",
        record: bool = False, *, stagger: int = 0, partitions: int = 1,
        placement: str = "random", sharing: str = "home", seed: int = 0,
        tiles_per_sm: int = 1) -> Traffic:
    sched = schedule(jobs, num_slots, stagger=stagger, partitions=partitions,
                     placement=placement, seed=seed, tiles_per_sm=tiles_per_sm)
    return replay(sched, jobs, cache_bytes, policy, record, sharing)
