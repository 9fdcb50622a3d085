"""Run a test body in ``world`` CPU processes over torch.distributed's gloo backend.

:func:`run` spawns one process per rank (a fresh interpreter each: ``spawn``, never ``fork``,
so no Triton or torch state is inherited), sets ``TRITON_INTERPRET=1`` there before anything
imports Triton or flashflow, joins the default group over TCP on a free local port, calls
``fn(rank, world, *args)``, then meets the other ranks at a barrier, destroys the group and exits
without the interpreter's shutdown.

Each rank reports its outcome to the parent through a file, written as soon as ``fn`` has
returned or raised, before the teardown: the parent judges a rank by that report, not by its
exit status. A rank that reported success and then died in the interpreter's shutdown still
passed its test; a rank that died before reporting (a crash in a kernel, a hang ended by the
timeout) fails the test with its exit status. When one rank fails, the others are likely
blocked in a collective waiting for it: they get a short grace period and are killed, and the
failure raised in pytest is the failing rank's traceback.

Why the child ends with ``os._exit`` once the group is destroyed: gloo's worker thread drops its
reference to a finished collective (and so to the tensors it moved) a moment after ``wait()`` has
returned. When Python has already let go of those tensors (the temporary send/receive buffers of
an exchange), that last release must take the GIL; if the main thread has reached the
interpreter's shutdown by then (on a busy machine the worker thread can lag that long), the
worker is torn down inside a ``noexcept`` frame: "terminate called without an active exception",
SIGABRT, after all the work is done. gdb shows ``ProcessGroupGloo::runLoop`` ->
``~AsyncAlltoallWork`` -> ``TensorImpl::decref_pyobject`` -> ``PyThread_exit_thread``: seen after
Ulysses' all-to-alls, in about one process exit in five on 2 CPU cores, barrier or not. Nothing is
left to do at that point, so the child skips the interpreter's shutdown.

``fn`` must be a module-level function of an importable module (a test module of this folder:
pytest put the folder on ``sys.path``, and the children inherit it).
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import sys
import tempfile
import time
import traceback
import warnings

# a rank's wait for a peer that never comes (gloo's collective timeout), and the parent's limit
# on one whole run: a deadlock fails the test instead of hanging pytest
COLLECTIVE_TIMEOUT_S = 30
RUN_TIMEOUT_S = 180
# after one rank has failed: how long the others get to report (they may be stuck waiting on it)
GRACE_S = 5.0


class RankFailed(AssertionError):
    """One or more ranks failed: their reports (tracebacks) or exit statuses."""


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick for port 0)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _report(path: str, report: dict) -> None:
    try:
        text = json.dumps(report)
    except (TypeError, ValueError):
        text = json.dumps(dict(report, ok=False, result=None,
                               error=f"the function returned what JSON cannot carry: {report['result']!r}"))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)   # atomic: the parent never reads half a report


def _child(rank: int, world: int, port: int, module: str, name: str, args: tuple, report_path: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"   # before Triton (through flashflow) is first imported here
    report = {"rank": rank, "ok": False, "error": None}
    dist = None
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)   # several ranks share a few cores
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        fn = getattr(importlib.import_module(module), name)
        start = time.perf_counter()
        result = fn(rank, world, *args)
        report.update(ok=True, result=result, seconds=time.perf_counter() - start)
    except BaseException:   # noqa: BLE001 — everything, assertion or not, goes back to the parent
        report["error"] = traceback.format_exc()
    report["time"] = time.time()   # the parent lists failures in the order they happened
    _report(report_path, report)
    if report["ok"] and dist is not None and dist.is_initialized():
        dist.barrier()                 # no rank tears the group down while a peer still talks to it
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if report["ok"] else 1)   # no interpreter shutdown: see the module's docstring


def run(world: int, fn, *args, timeout: float = RUN_TIMEOUT_S, grace: float = GRACE_S) -> list[dict]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; raises :class:`RankFailed` with every
    failing rank's traceback (or exit status) if any rank fails. Returns the ranks' reports, in
    rank order: ``rank``, ``ok``, ``result`` (what ``fn`` returned: JSON-able), ``seconds`` (fn's
    time) and ``exitcode`` (the process's; negative: killed by that signal)."""
    import torch.multiprocessing as mp

    module, name = fn.__module__, fn.__qualname__
    if "." in name or name == "<lambda>":
        raise ValueError(f"{module}.{name}: the ranks import the function by name, it must be module-level")
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="flashflow-gloo-") as tmp:
        paths = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        procs = [ctx.Process(target=_child, args=(r, world, port, module, name, args, paths[r]), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed_at = None
        killed = {}   # rank -> why the harness killed it
        reports: list[dict | None] = [None] * world

        def read_reports():
            for r in range(world):
                if reports[r] is None and os.path.exists(paths[r]):
                    with open(paths[r]) as f:
                        reports[r] = json.load(f)

        try:
            while True:
                read_reports()
                if failed_at is None and any(
                        (rep is not None and not rep["ok"]) or (rep is None and p.exitcode is not None)
                        for rep, p in zip(reports, procs)):
                    failed_at = time.monotonic()
                if all(p.exitcode is not None for p in procs):
                    break
                if all(rep is not None and rep["ok"] for rep in reports):
                    # every rank passed: the teardown (barrier, destroy) gets a short wait of its own
                    for p in procs:
                        p.join(timeout=30.0)
                    break
                now = time.monotonic()
                if now > deadline:
                    killed.update((r, f"killed after the run's {timeout:.0f} s") for r in range(world))
                    break
                if failed_at is not None and now - failed_at > grace:
                    killed.update((r, f"killed {grace:g} s after another rank failed, likely waiting for it")
                                  for r in range(world))
                    break
                time.sleep(0.05)
        finally:
            for r, p in enumerate(procs):
                if p.is_alive():
                    p.kill()
                else:
                    killed.pop(r, None)
                p.join()
        read_reports()   # a report written between the last poll and the end
    failures, silent, late = [], [], []
    for r, (rep, p) in enumerate(zip(reports, procs)):
        if rep is None:
            silent.append(f"rank {r} of {world} never reported ({killed.get(r, f'exit status {p.exitcode}')})")
            continue
        rep["exitcode"] = p.exitcode
        if not rep["ok"]:
            failures.append((rep["time"], f"rank {r} of {world} failed:\n{rep['error']}"))
        elif p.exitcode != 0:
            late.append(f"rank {r}: exit status {p.exitcode}" + (f" ({killed[r]})" if r in killed else ""))
    if failures or silent:
        # in the order they failed (a rank that failed first is the likely cause; ranks that lost a
        # peer fail after it), then the ranks that never reported
        problems = [text for _, text in sorted(failures)] + silent
        raise RankFailed(f"{module}.{name} on {world} gloo ranks:\n" + "\n".join(problems))
    if late:
        warnings.warn(f"{module}.{name}: every rank reported success, then in its teardown: {'; '.join(late)}")
    return reports
