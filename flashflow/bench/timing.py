"""How the benchmarks time a call: each discipline written once, under a name.

A number is only comparable with numbers timed the same way, so every result JSON a suite
writes says how it was made: ``"timing": {"discipline": NAME, ...its parameters}``
(:func:`record`); :func:`discipline_of` also reads results written before the field existed.

``warm``     ``triton.testing.do_bench`` median of eager calls on the same inputs: the L2 holds
             what the previous call left (attention and train suites, qwen-image, the read
             ceiling, tune's attention backward).
``graph``    CUDA-graph replays of ``steps`` back-to-back calls, the median replay ÷ ``steps``:
             no launch gaps, no Python between the calls, as in a serving loop (tune's
             attention cases, qwen-image's ``+graph`` providers).
``cold-l2``  ``graph`` over copies of the inputs that together span three L2s, the calls
             cycling through them: a step does not find the previous step's bytes in L2, as in a
             model whose other layers have flushed it (decode suite, tune decode).
``rounds``   several providers timed by one of the above in interleaved rounds, the order
             rotated every round, each provider's median round: the clock follows the GPU's
             temperature, and a fixed order would charge the heat to whoever comes last (mlp
             suite, every tune).
``host``     wall µs per call of back-to-back calls, one synchronize per round, the median
             round: at a tiny shape the GPU waits on the host (host suite).
``issue``    host time to issue one call, the GPU not waited for (qwen-image's host ms column).

The functions that time need a CUDA GPU; importing this module does not.
"""
from __future__ import annotations

import itertools
import math
import statistics
import time

DISCIPLINES = {
    "warm": "do_bench of eager calls on the same inputs (L2 warm)",
    "graph": "do_bench median of CUDA-graph replays of `steps` back-to-back calls, per call",
    "cold-l2": "graph replays over input copies spanning three L2s, the calls cycling through them",
    "rounds": "providers timed in interleaved rounds, the order rotated each round, median round",
    "host": "wall µs per call of back-to-back calls, one synchronize per round, median round",
    "issue": "host time to issue a call, the GPU not waited for",
}

# calls per CUDA graph where a suite times a serving loop's steps (decode)
GRAPH_STEPS = 16
# the input copies of a cold-L2 measurement span this many L2s
L2_SPAN = 3

# suites written before results named their discipline, and the one their code used
_UNNAMED = {"attention": "warm", "train": "warm", "qwen-image": "warm", "decode": "cold-l2",
            "mlp": "rounds", "host": "host", "dataflow": "warm"}
# ... and for ``rounds``, the discipline the rounds repeated
_UNNAMED_OF = {"mlp": "graph"}


def record(discipline: str, **params) -> dict:
    """The ``"timing"`` entry of a result: the discipline's name, then its parameters."""
    if discipline not in DISCIPLINES:
        raise ValueError(f"timing discipline must be one of {', '.join(DISCIPLINES)}, got {discipline!r}")
    if "of" in params and params["of"] not in DISCIPLINES:   # the discipline ``rounds`` repeats
        raise ValueError(f"timing of= must be one of {', '.join(DISCIPLINES)}, got {params['of']!r}")
    return {"discipline": discipline, **params}


def discipline_of(result: dict) -> str | None:
    """The discipline that timed ``result`` (a suite's JSON): as recorded, or for a result
    that predates the field the one its suite used; None for results that time nothing
    (info, memory) and for results of tools the repository no longer has."""
    timing = result.get("timing")
    if isinstance(timing, dict) and "discipline" in timing:
        return timing["discipline"]
    suite = str(result.get("suite") or "")
    if suite.startswith("tune-") and isinstance(timing, dict) and "rounds" in timing:
        return "rounds"
    return _UNNAMED.get(suite)


def describe(result: dict) -> str:
    """One sentence for a table's caption: the discipline's name and what it does."""
    name = discipline_of(result)
    if name is None:
        return ""
    timing = result.get("timing") if isinstance(result.get("timing"), dict) else {}
    inner = timing.get("of") or (_UNNAMED_OF.get(result.get("suite")) if "discipline" not in timing else None)
    mode = timing.get("return_mode")
    return (f"Timing `{name}`{f' of `{inner}`' if inner else ''}{f', {mode}' if mode else ''}: "
            f"{DISCIPLINES[name]}.")


def short_error(e: BaseException) -> str:
    """A failed call as one line of a result: the exception's type and first line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


# --------------------------------------------------------------------------------------------
# warm
# --------------------------------------------------------------------------------------------


def warm_ms(fn, warmup: int = 25, rep: int = 100, first_call: bool = True, return_mode: str = "median") -> float:
    """``warm``: do_bench of ``fn`` itself, ms. ``first_call``: one call before, which compiles
    and autotunes outside the measured time (off where the caller has made that call)."""
    import triton.testing

    if first_call:
        fn()
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode=return_mode)


def read_ceiling_tbs() -> float:
    """Best of a few large read-only reductions (bytes read / ``warm`` time), TB/s: the
    bandwidth a kernel that only reads can reach on this card."""
    import torch

    x = torch.randn(2**31 // 2, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    y = torch.randn(2**31 // 2, device="cuda", dtype=torch.bfloat16)
    best = 0.0
    for fn in (lambda: x.sum(dtype=torch.float32), lambda: y.view(-1, 8192).sum(dim=1, dtype=torch.float32)):
        t = warm_ms(fn, warmup=25, rep=200, first_call=False)
        best = max(best, x.numel() * 2 / (t * 1e-3) / 1e12)
    return best


# --------------------------------------------------------------------------------------------
# graph and cold-l2
# --------------------------------------------------------------------------------------------


def capture_graph(fn, steps: int = 1):
    """``(graph, output of the last captured call)`` of ``steps`` back-to-back calls of ``fn``,
    after one warm-up call on a side stream (compiles, and allocations stay out of the graph)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(g):
        for _ in range(steps):
            out = fn()
    return g, out


def replay_ms(graph, steps: int, warmup: int = 25, rep: int = 100, min_replays: int = 0) -> float:
    """``graph``: ms per call of a captured graph of ``steps`` calls. ``min_replays`` > 0 measures
    for at least that many replays (one replay is timed first): a graph of long calls would
    otherwise be timed a handful of times."""
    import torch
    import triton.testing

    if min_replays:
        graph.replay()
        torch.cuda.synchronize()
        t0 = triton.testing.do_bench(graph.replay, warmup=0, rep=1, return_mode="median")
        rep = max(rep, min_replays * t0)
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median") / steps


def graph_ms(fn, steps: int = GRAPH_STEPS, warmup: int = 25, rep: int = 100) -> float:
    """``graph``: median time of one call, from replays of a graph of ``steps`` back-to-back
    calls of ``fn`` (captured here, dropped after)."""
    g, _ = capture_graph(fn, steps)
    ms = replay_ms(g, steps, warmup, rep)
    del g
    return ms


def rotation(nbytes: int, l2_bytes: int, steps: int = GRAPH_STEPS) -> int:
    """``cold-l2``: how many copies of a step's inputs (``nbytes``) the timed steps cycle
    through: enough that one pass over them spans :data:`L2_SPAN` L2s, at most ``steps``."""
    return max(1, min(steps, math.ceil(L2_SPAN * l2_bytes / max(nbytes, 1))))


def l2_bytes() -> int:
    """The L2 size of the current CUDA device."""
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size


def cycling(make, copies: int):
    """``cold-l2``: a zero-argument callable that runs ``make(i)``'s callables in turn,
    i = 0..copies-1 (each ``make(i)`` a call on the i-th copy of the inputs)."""
    it = itertools.cycle([make(i) for i in range(copies)])
    return lambda: next(it)()


# --------------------------------------------------------------------------------------------
# rounds
# --------------------------------------------------------------------------------------------


def rounds(fns: dict, timer, n: int, after_each=None) -> tuple[dict, dict]:
    """``rounds``: ``timer(fn)`` of every ``fns`` entry in ``n`` interleaved rounds, the order
    rotated each round (who runs first changes). Returns ``(samples, errors)``: name -> the
    ``n`` times (None where the timer raised), name -> the last error's one line.
    ``after_each()`` runs after every measurement (a progress bar)."""
    names = list(fns)
    samples = {name: [] for name in names}
    errors = {}
    for r in range(n):
        for name in (names[r % len(names):] + names[:r % len(names)]) if names else ():
            try:
                samples[name].append(timer(fns[name]))
            except Exception as e:  # noqa: BLE001 — one provider's failure is its entry
                samples[name].append(None)
                errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
            if after_each is not None:
                after_each()
    return samples, errors


# --------------------------------------------------------------------------------------------
# host and issue
# --------------------------------------------------------------------------------------------


def host_us(fn, calls: int = 200, rounds: int = 7, warmup: int = 50) -> float:
    """``host``: median over ``rounds`` of the wall time per call of ``calls`` back-to-back
    calls, µs (after ``warmup`` calls)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per_call)


def issue_ms(fn, calls: int = 3) -> float:
    """``issue``: CPU time to issue one call (Python, validation, launches), the GPU not waited
    for, ms: a step whose issue time reaches its GPU time is launch-bound, and only a CUDA graph
    or fewer launches make it faster."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return host * 1e3
