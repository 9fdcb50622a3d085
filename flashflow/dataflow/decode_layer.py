"""The decode-layer megakernel (:mod:`flashflow.kernels.decode_layer`) on the dataflow machine:
its task table, in ticket order, as the machine's jobs (:mod:`flashflow.dataflow.machine`).

Each task is a job whose K-steps read what the kernel's loop reads per iteration:

- a norm row (x's or h's): one step reading the row (x from DRAM, h's fp32 blocks from the O
  tasks) and writing the normalised row chunk by chunk;
- a QKV task (head, rotary-pair block): per ``BLOCK_K`` chunk of the hidden size, its weight
  tile (``2·QKV_PAIRS`` rows) and the chunk of XN; it writes its q rows to the fp32 workspace
  (write-allocate: the attention tasks read them back) or stores its k/v rows into the cache.
  With ``QKV_SPLIT`` > 1 it is one K slice of its tile, merged as the O and down slices are;
- an attention task (sequence, KV head, split): per ``BLOCK_KV`` keys of its slice, that block
  of K and of V; it reads its group's q rows first, and writes its fp32 partial (the merging
  split also the attention output, in the weights' dtype);
- an O, gate/up or down task: per ``BLOCK_K`` chunk, its weight tile (gate and up together)
  and the chunk of its input (the attention output, HN or the activation); it writes its
  columns (h in fp32, the activation in the weights' dtype; the down stage stores ``out``).
  With ``SPLIT_K`` > 1 an O or down task is one K slice of its columns: it writes an fp32
  partial, and the last slice (in ticket order) also reads the others' and writes the columns.

A job waits on the tasks that signal the counter its task waits on: the table's own
dependencies (with per-slice counters, an O or down slice waits only on its producers).

The activations and workspaces are ``batch`` rows: tens to hundreds of KB, held by the L2.
Weights and the cache are read once whatever the order, so the predicted DRAM bytes sit at
:func:`flashflow.kernels.decode_layer.decode_layer_bytes` plus the workspaces' write-back. What the
model shows beyond bytes is the schedule: one K-step a time unit, ``num_slots`` programs (one
an SM), the slots each stage keeps busy while it runs. A stage of fewer tasks than slots, or
whose last wave is short, leaves SMs idle, and a memory-bound step is then slower than its
bytes. The model holds no rate of bytes a second per program: the megakernel's measured
shortfall is mostly that rate (docs/decode_layer.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from flashflow.dataflow.machine import Job, replay, schedule
from flashflow.device import cdiv
from flashflow.kernels.decode_layer import (ATTN, DOWN, GATEUP, NORM, OPROJ, QKV, STAGES, build_tasks,
                                           decode_layer_bytes, k_slices, qkv_split)

F32 = 4


@dataclass(frozen=True)
class StageReport:
    """One stage of a step: its tasks, their K-steps, the time span from its first K-step to its
    last (in K-steps) and the busy slots over that span."""

    name: str
    tasks: int
    steps_per_task: float
    span: int
    busy_fraction: float
    weight_bytes: int


@dataclass(frozen=True)
class LayerReport:
    dram_bytes: int
    read_bytes: int
    write_bytes: int
    compulsory_bytes: int
    makespan: int            # K-steps
    ideal_makespan: int      # every slot busy every step: total K-steps / slots, rounded up
    utilization: float
    stages: tuple[StageReport, ...]


def layer_jobs(config, batch: int, cache_len: int, tiles, num_splits: int, itemsize: int = 2,
               folded: bool = False) -> list[Job]:
    """The plan's task table (:func:`flashflow.kernels.decode_layer.build_tasks`) as jobs, in
    ticket order. ``config``: the layer's sizes (hidden, heads, kv_heads, head_dim,
    intermediate, as :class:`flashflow.ops.decode_layer.LayerConfig`); ``cache_len`` keys in
    the cache before this step's token. A job waits on the tasks that signal the counter its
    task waits on (the table's own dependencies). A workspace block is keyed by its writer (a
    norm row's K chunks, the attention output per (sequence, KV head), h per O task, the
    activation per gate/up task); a reader's K chunk reads every writer block it overlaps.
    ``folded`` (folded norm weights): the norm rows of x read x and write only ``1 / rms``, the
    QKV tasks read x itself, the O tasks write h in the weights' dtype besides, which the gate/up
    tasks read (there are no norm rows of h)."""
    c, e, bk = config, itemsize, tiles.BLOCK_K
    d, group = c.head_dim, c.heads // c.kv_heads
    keys = cache_len + 1
    chunk = cdiv(cdiv(keys, num_splits), tiles.BLOCK_KV) * tiles.BLOCK_KV
    pairs = d // 2 // tiles.QKV_PAIRS
    tasks = build_tasks(c, batch, num_splits, tiles, folded=folded)
    signals: dict[int, list[int]] = {}
    for i, t in enumerate(tasks):
        signals.setdefault(t[6], []).append(i)

    def waits_of(t) -> tuple:
        return (tuple(signals.get(t[4], ())),) if t[5] else ((),)

    def late(waits, steps) -> tuple:
        """Folded norms: a QKV task waits on the norm rows of x after its K loop, before its
        last step (a slice that does not merge, not at all)."""
        return ((),) * (len(steps) - 1) + (waits[0],)

    def written(src, k):
        """The workspace blocks that K chunk ``k`` of source ``src`` overlaps."""
        lo, hi = k * bk, (k + 1) * bk
        if src in ("xn", "hn", "x"):   # the norm rows (or x), chunk by chunk
            return tuple(((src, b, k), (min(hi, c.hidden) - lo) * e) for b in range(batch))
        if src == "hb":   # folded: h in the weights' dtype, per O column block
            return tuple((("hb", j), batch * min(tiles.BLOCK_N, c.hidden - j * tiles.BLOCK_N) * e)
                         for j in range(lo // tiles.BLOCK_N, cdiv(min(hi, c.hidden), tiles.BLOCK_N)))
        if src == "att":
            width = group * d
            return tuple((("att", b, h), group * d * e) for b in range(batch)
                         for h in range(lo // width, cdiv(min(hi, c.heads * d), width)))
        return tuple((("act", j), batch * min(tiles.BLOCK_I, c.intermediate - j * tiles.BLOCK_I) * e)
                     for j in range(lo // tiles.BLOCK_I, cdiv(min(hi, c.intermediate), tiles.BLOCK_I)))

    def chunks(k_total, rows, key, src, k_range=None):
        lo, hi = k_range or (0, cdiv(k_total, bk))
        return tuple(((key + (k,), rows * min(bk, k_total - k * bk) * e),) + written(src, k)
                     for k in range(lo, hi))

    sk, _ = k_slices(c.hidden, tiles)
    qs = qkv_split(tiles)
    slices: dict[tuple, list[int]] = {}   # (stage, column block) or (QKV, head, pairs) -> its K slices' tickets
    for i, t in enumerate(tasks):
        if t[0] in (OPROJ, DOWN):
            slices.setdefault((t[0], t[1]), []).append(i)
        elif t[0] == QKV:
            slices.setdefault((QKV, t[1], t[2]), []).append(i)
    n_h = cdiv(c.hidden, tiles.BLOCK_N)

    def sliced(i, t, name, wkey, k_total, rows, src, n_slices, part_bytes, result, store_bytes, waits_late=False):
        """K slice ``name[-1]`` of ``n_slices`` (whole BLOCK_K chunks, as the kernel cuts them)
        of the tile whose weight chunks are keyed ``wkey``: it writes an fp32 partial; the last
        slice in ticket order, once the others are done, reads their partials (its own, just
        written, stays in L2) and writes the result."""
        s, tile = name[-1], wkey[1:]
        per, n = cdiv(cdiv(k_total, n_slices), bk), cdiv(k_total, bk)
        steps = chunks(k_total, rows, wkey, src, (min(s * per, n), min((s + 1) * per, n))) or ((),)
        part_key = (name[0] + "-part",) + tile
        siblings = slices[(t[0],) + tile]
        merging = siblings[-1] == i
        waits = ((),) if waits_late else waits_of(t)
        if merging:
            steps = steps + (tuple((part_key + (j,), part_bytes) for j in range(n_slices) if j != s),)
            last = tuple(j for j in siblings if j != i) + (waits_of(t)[0] if waits_late else ())
            waits = waits + ((),) * (len(steps) - 2) + (last,)
        return Job(name, steps, writes=((part_key + (s,), part_bytes),) + (result if merging else ()),
                   store_bytes=store_bytes if merging else 0, waits=waits)

    jobs = []
    for i, t in enumerate(tasks):
        stage, a, b, s = t[0], t[1], t[2], t[3]
        if stage == NORM:   # one row: read it (x from DRAM, h from its O blocks), write it normalised
            n = cdiv(c.hidden, bk)
            if a == 0:
                reads = tuple((("x", b, k), (min((k + 1) * bk, c.hidden) - k * bk) * e) for k in range(n))
            else:
                reads = tuple((("h", j), batch * min(tiles.BLOCK_N, c.hidden - j * tiles.BLOCK_N) * F32)
                              for j in range(n_h))
            out = ((("rstd", b), F32),) if folded else \
                tuple((("xn" if a == 0 else "hn", b, k), (min((k + 1) * bk, c.hidden) - k * bk) * e) for k in range(n))
            jobs.append(Job(("norm", a, b), (reads,), writes=out, waits=waits_of(t)))
        elif stage == QKV:
            rows = batch * 2 * tiles.QKV_PAIRS
            # q rows to the workspace, read back by the group's attention; the new token's k or
            # v rows into the cache
            result = ((("q", a, b), rows * F32),) if a < c.heads else ()
            store = 0 if a < c.heads else rows * e
            src = "x" if folded else "xn"
            if qs > 1:
                jobs.append(sliced(i, t, ("qkv", a, b, s), ("Wqkv", a, b), c.hidden, 2 * tiles.QKV_PAIRS, src, qs,
                                   rows * F32, result, store, waits_late=folded))
                continue
            steps = chunks(c.hidden, 2 * tiles.QKV_PAIRS, ("Wqkv", a, b), src)
            jobs.append(Job(("qkv", a, b), steps, writes=result, store_bytes=store,
                            waits=late(waits_of(t), steps) if folded else waits_of(t)))
        elif stage == ATTN:
            lo, hi = s * chunk, min((s + 1) * chunk, keys)
            q_blocks = tuple((("q", h, p), batch * 2 * tiles.QKV_PAIRS * F32)
                             for h in range(b * group, (b + 1) * group) for p in range(pairs))
            steps = [q_blocks] if hi <= lo else []
            for j, k0 in enumerate(range(lo, hi, tiles.BLOCK_KV)):
                n = min(tiles.BLOCK_KV, hi - k0)
                blocks = ((("K", a, b, k0), n * d * e), (("V", a, b, k0), n * d * e))
                steps.append((q_blocks + blocks) if j == 0 else blocks)
            out = ((("part", a, b, s), group * (d + 2) * F32),)
            if s == num_splits - 1:   # the merge's result, which the O tasks read
                out += ((("att", a, b), group * d * e),)
            jobs.append(Job(("attn", a, b, s), tuple(steps), writes=out, waits=waits_of(t)))
        else:
            if stage == OPROJ:
                k_total, rows, width, src = c.heads * d, tiles.BLOCK_N, tiles.BLOCK_N, "att"
            elif stage == GATEUP:
                k_total, rows, width, src = c.hidden, 2 * tiles.BLOCK_I, tiles.BLOCK_I, "hb" if folded else "hn"
            else:
                k_total, rows, width, src = c.intermediate, tiles.BLOCK_N, tiles.BLOCK_N, "act"
            total = c.intermediate if stage == GATEUP else c.hidden
            cols = batch * min(width, total - a * width)
            result = (() if stage == DOWN else
                      ((("h", a), cols * F32),) + (((("hb", a), cols * e),) if folded else ()) if stage == OPROJ
                      else ((("act", a), cols * e),))
            if stage == GATEUP or sk == 1:
                steps = chunks(k_total, rows, (STAGES[stage], a), src)
                jobs.append(Job((STAGES[stage], a), steps, writes=result,
                                store_bytes=cols * e if stage == DOWN else 0, waits=waits_of(t)))
                continue
            jobs.append(sliced(i, t, (STAGES[stage], a, b), (STAGES[stage], a), k_total, rows, src, sk, cols * F32, result,
                               cols * e if stage == DOWN else 0))
    return jobs


def model_layer(config, batch: int, cache_len: int, tiles, num_splits: int, num_slots: int = 132,
                l2_bytes: int = 50 * 2**20, itemsize: int = 2, folded: bool = False) -> LayerReport:
    """Schedule one step's jobs on ``num_slots`` programs, replay it through an LRU L2 of
    ``l2_bytes``: the DRAM bytes, the makespan against every slot busy, and each stage's
    span and busy slots."""
    jobs = layer_jobs(config, batch, cache_len, tiles, num_splits, itemsize, folded)
    sched = schedule(jobs, num_slots)
    traffic = replay(sched, jobs, l2_bytes)
    total_steps = sum(len(j.steps) for j in jobs)
    # per stage: the K-steps its jobs ran at each time
    first, last, busy = {}, {}, {}
    start = {}
    for i, job in enumerate(jobs):
        end = sched.finish_time[i]
        start[i] = end - len(job.steps) + 1   # a lower bound when the job stalled: its span is then wider
    # the norm rows of x and of h are two stages of the step (before QKV, between O and gate/up)
    stage_of = [("norm-x" if job.name[1] == 0 else "norm-h") if job.name[0] == "norm" else job.name[0]
                for job in jobs]
    for i, job in enumerate(jobs):
        name = stage_of[i]
        first[name] = min(first.get(name, start[i]), start[i])
        last[name] = max(last.get(name, sched.finish_time[i]), sched.finish_time[i])
        busy[name] = busy.get(name, 0) + len(job.steps)
    reports = []
    for name in ("norm-x", "qkv", "attn", "oproj", "norm-h", "gateup", "down"):
        idx = [i for i, s in enumerate(stage_of) if s == name]
        if not idx:   # folded norms: no norm rows of h
            continue
        span = last[name] - first[name] + 1
        weights = sum(size for i in idx for step in jobs[i].steps for key, size in step
                      if key[0] in ("Wqkv", "oproj", "gateup", "down"))
        reports.append(StageReport(name, len(idx), busy[name] / len(idx), span, busy[name] / (span * num_slots),
                                   weights))
    return LayerReport(traffic.dram_bytes, traffic.read_bytes, traffic.write_bytes, decode_layer_bytes(config, batch, cache_len, itemsize), sched.makespan,
                       cdiv(total_steps, num_slots), traffic.utilization, tuple(reports))
