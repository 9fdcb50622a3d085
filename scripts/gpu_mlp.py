"""GPU check, stress test and bench of the fused FFN (flashflow.ops.mlp), one GPU.

Usage (on the device, from the repository root):
    PYTHONPATH=. python scripts/gpu_mlp.py            # check + stress + bench, ~5 min on an H100
    PYTHONPATH=. python scripts/gpu_mlp.py --quick    # fewer cases and token counts, ~2-3 min
    PYTHONPATH=. python scripts/gpu_mlp.py --ncu      # also DRAM bytes per policy (Nsight Compute)
    PYTHONPATH=. python scripts/gpu_mlp.py --phases bench   # any of check,stress,bench,ncu

Phases (each in a child process with a time limit, so a hang is reported instead of eating the
session; the child also arms faulthandler to print where it hung):
1. check — bf16 (every activation) and fp16 (SwiGLU, GELU), odd shapes and Llama-3-8B shapes,
   every policy and both Triton baselines, against float64: relative error ≤ 1e-2. Runs in
   parallel worker processes (the time is mostly Triton compiling).
2. stress — Llama-3-8B: 100 back-to-back calls and 100 CUDA-graph replays (the input changed
   every 25) of split-K (M = 16, 64), every persistent policy (M = 512) and the two-stream
   baseline, every output checked; the workspace must be all zero afterwards.
3. bench — flashflow.bench.mlp_suite: 3 FFNs × M = 1 … 4096, every policy and baseline, CUDA
   graphs (kernels compiled first in parallel workers).
4. ncu (with --ncu) — per policy (and the two-kernel and torch baselines) at M = 1024 and 4096
   on Llama-3-8B, one call under ``ncu --clock-control none --metrics
   dram__bytes_read.sum,dram__bytes_write.sum --csv`` (this script in --single-run mode,
   profiling only between cudaProfilerStart/Stop); bytes summed over the call's kernels. ncu
   flushes L2 before each profiled kernel, so multi-kernel baselines re-read their
   intermediate from DRAM. Adds ~2-4 min.

Writes bench/results/mlp-<device-slug>.json (device, versions, date, checks, stress, bench,
ncu) and prints the compact bench table last. Exit status 1 if a check, stress run or phase
failed.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TOL = 1e-2
PHASE_LIMITS_S = {"check": 170, "stress": 150, "bench": 400, "ncu": 500}
QUICK_LIMITS_S = {"check": 120, "stress": 60, "bench": 200, "ncu": 300}
NCU_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
NCU_PROVIDERS = ("sequential", "rowblock", "multirow", "halfrow", "seqsplit", "two-kernels", "torch-graph")
NCU_TOKENS = (1024, 4096)


def _workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) - 1))


# --------------------------------------------------------------------------------------------
# check phase
# --------------------------------------------------------------------------------------------


def check_cases(quick: bool) -> list[tuple]:
    """(dtype name, activation, M, hidden, inter, variant, layout)."""
    odd_small = [(1, 1000, 3000), (7, 520, 1000), (64, 512, 1536)]
    odd_large = [(130, 520, 1000), (300, 1000, 3000)]
    persistent = ["sequential", "rowblock", "multirow", "multirow:2", "halfrow", "seqsplit", "two-kernels",
                  "two-streams"]
    cases = []
    plan = [("bfloat16", a) for a in ("swiglu", "gelu", "silu", "relu")]
    plan += [("float16", a) for a in (("swiglu",) if quick else ("swiglu", "gelu"))]
    for dtype, act in plan:
        for m, h, i in odd_small:
            cases.append((dtype, act, m, h, i, "splitk", "plain"))
        for m, h, i in (odd_large[:1] if quick else odd_large):
            for v in persistent:
                cases.append((dtype, act, m, h, i, v, "plain"))
        for m in (1, 64, 130):
            cases.append((dtype, act, m, 520, 1000, "auto", "plain"))
    for m in ((1, 16) if quick else (1, 16, 64)):
        cases.append(("bfloat16", "swiglu", m, 4096, 14336, "splitk", "plain"))
    for v in (["multirow", "halfrow", "auto"] if quick else persistent + ["auto"]):
        cases.append(("bfloat16", "swiglu", 256, 4096, 14336, v, "plain"))
    cases.append(("bfloat16", "swiglu", 5, 520, 1000, "auto", "3d-strided"))
    cases.append(("bfloat16", "gelu", 200, 520, 1000, "auto", "3d-strided"))
    return cases


def _run_case(case) -> dict:
    import torch

    from flashflow.ops import mlp
    from flashflow.reference.mlp import mlp_ref

    dtype_name, act, m, hidden, inter, variant, layout = case
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    rows = 2 * inter if act == "swiglu" else inter
    w1 = torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=g) / hidden ** 0.5
    w2 = torch.randn(hidden, inter, device="cuda", dtype=dtype, generator=g) / inter ** 0.5
    if layout == "3d-strided":   # (2, m, hidden) seen through a column slice of a wider tensor
        x = torch.randn(2, m, hidden + 24, device="cuda", dtype=dtype, generator=g)[..., 8:8 + hidden]
    else:
        x = torch.randn(m, hidden, device="cuda", dtype=dtype, generator=g)
    name = f"{dtype_name} {act} M={m} {hidden}->{inter} {variant}{'' if layout == 'plain' else ' ' + layout}"
    try:
        if variant == "two-kernels":
            out = mlp.mlp_two_kernels(x, w1, w2, act)
        elif variant == "two-streams":
            out = mlp.mlp_two_streams(x, w1, w2, act)
        else:
            out = mlp.fused_mlp(x, w1, w2, act, variant)
        torch.cuda.synchronize()
        ref = mlp_ref(x.double(), w1.double(), w2.double(), act)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        ok = bool(torch.isfinite(out).all().item()) and err <= TOL and out.shape == x.shape
        res = {"case": name, "rel_err": err, "ok": ok}
    except Exception as e:  # noqa: BLE001 — report and go on
        res = {"case": name, "rel_err": None, "ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
    print(f"{'PASS' if res['ok'] else 'FAIL'} {name}: "
          f"{res['rel_err']:.2e}" if res["rel_err"] is not None else f"FAIL {name}: {res.get('error')}", flush=True)
    return res


def _run_cases(cases) -> list[dict]:
    return [_run_case(c) for c in cases]


def phase_check(args) -> dict:
    import concurrent.futures as cf
    import multiprocessing as mp

    cases = check_cases(args.quick)
    n = _workers()
    chunks = [cases[i::n] for i in range(n)]
    results = []
    with cf.ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context("spawn")) as ex:
        for part in ex.map(_run_cases, chunks):
            results += part
    return {"checks": results}


# --------------------------------------------------------------------------------------------
# stress phase
# --------------------------------------------------------------------------------------------


def phase_stress(args) -> dict:
    import torch

    from gpu_cases import worst_over_graph_replays

    from flashflow.bench.mlp_suite import make_inputs, torch_ffn
    from flashflow.ops import mlp

    runs = 100
    variants = [("splitk", 16), ("splitk", 64)] + [(p, 512) for p in ("sequential", "rowblock", "multirow", "halfrow")]
    variants += [("seqsplit", 256), ("multirow", 4096)]   # auto at M = 256 is seqsplit:8
    variants.append(("two-streams", 512))
    out_rows = []
    for policy, m in variants:
        t0 = time.time()
        x, w1, w2 = make_inputs("swiglu", 4096, 14336, m, torch.bfloat16, seed=m)
        ws = mlp.MlpWorkspace(4096, max_tokens=m, device="cuda")
        if policy == "two-streams":
            def call():
                return mlp.mlp_two_streams(x, w1, w2, "swiglu", workspace=ws)
        else:
            def call():
                return mlp.fused_mlp(x, w1, w2, "swiglu", policy, workspace=ws)

        def rel(out, ref):
            return ((out.float() - ref).norm() / ref.norm()).item()

        ref = torch_ffn(x.float(), w1.float(), w2.float(), "swiglu")
        outs = [call() for _ in range(runs)]
        torch.cuda.synchronize()
        worst_b2b = max(rel(o, ref) for o in outs)
        del outs
        # CUDA graph: capture once, replay; change the input every 25 replays
        worst_graph = worst_over_graph_replays(
            call, x, lambda xi: torch_ffn(xi.float(), w1.float(), w2.float(), "swiglu"), replays=runs)
        clean = int(ws.buffer.count_nonzero().item()) == 0
        ok = worst_b2b <= TOL and worst_graph <= TOL and clean
        row = {"case": f"{policy} M={m}", "worst_back_to_back": worst_b2b, "worst_graph": worst_graph,
               "workspace_zero_after": clean, "ok": ok, "seconds": time.time() - t0}
        print(f"{'PASS' if ok else 'FAIL'} stress {row['case']}: back-to-back {worst_b2b:.2e}, "
              f"graph {worst_graph:.2e}, workspace zero after: {clean}", flush=True)
        out_rows.append(row)
    return {"stress": out_rows}


# --------------------------------------------------------------------------------------------
# bench phase
# --------------------------------------------------------------------------------------------


def _warm(jobs) -> int:
    """Compile every kernel the bench will time (one call each); fills Triton's disk cache."""
    import torch

    from flashflow.bench import mlp_suite

    for model, act, hidden, inter, m in jobs:
        x, w1, w2 = mlp_suite.make_inputs(act, hidden, inter, m, torch.bfloat16)
        for name, fn in mlp_suite.make_providers(x, w1, w2, act).items():
            try:
                fn()
            except Exception as e:  # noqa: BLE001 — the bench reports it
                print(f"warm-up {model} M={m} {name}: {type(e).__name__}: {e}"[:300], flush=True)
        torch.cuda.synchronize()
        del x, w1, w2
        torch.cuda.empty_cache()
    return len(jobs)


def phase_bench(args) -> dict:
    import concurrent.futures as cf
    import multiprocessing as mp

    import torch

    from flashflow.bench import mlp_suite

    tokens = mlp_suite.QUICK_TOKENS if args.quick else mlp_suite.TOKENS
    models = mlp_suite.MODELS[:1] if args.quick else mlp_suite.MODELS
    jobs = [(mo, a, h, i, m) for mo, a, h, i in models for m in tokens]
    t0 = time.time()
    n = _workers()
    with cf.ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context("spawn")) as ex:
        list(ex.map(_warm, [jobs[i::n] for i in range(n)]))
    print(f"bench: kernels compiled in {time.time() - t0:.0f} s", flush=True)

    def log(row):
        print(f"{row['model']} M={row['M']}: " + ", ".join(
            f"{p} {v['us']:.1f}µs" if v.get("us") else f"{p} {v.get('error', '-')}"
            for p, v in row["results"].items()), flush=True)

    result = mlp_suite.run_bench(quick=args.quick, dtype=torch.bfloat16, warmup=args.warmup, rep=args.rep,
                                 models=models, tokens=tokens, log=log)
    return {"bench": result}


# --------------------------------------------------------------------------------------------
# ncu phase
# --------------------------------------------------------------------------------------------


def single_run(args) -> int:
    """Under ncu: compile and warm up outside the profiled range, then one call inside it."""
    import torch

    from flashflow.bench import mlp_suite

    model, act, hidden, inter = mlp_suite.MODELS[0]
    x, w1, w2 = mlp_suite.make_inputs(act, hidden, inter, args.m, torch.bfloat16)
    provs = mlp_suite.make_providers(x, w1, w2, act, (args.single_run,))
    fn = provs[args.single_run]
    if args.single_run == mlp_suite.ANCHOR:
        def fn():
            return mlp_suite.torch_ffn(x, w1, w2, act)
    fn()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


def parse_ncu(text: str) -> dict:
    """Sum each metric over the profiled kernels of ``ncu --csv --print-units base`` output."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header in the output")
    rows = list(csv.reader(io.StringIO("\n".join(line for line in lines[start:] if line.startswith('"')))))
    header, body = rows[0], rows[1:]
    sums, kernels = {m: 0.0 for m in NCU_METRICS}, set()
    for values in body:
        row = dict(zip(header, values))
        if row.get("Metric Name") in sums:
            unit = (row.get("Metric Unit") or "byte").lower()
            scale = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9}.get(unit, 1)
            sums[row["Metric Name"]] += float(row["Metric Value"].replace(",", "")) * scale
            kernels.add((row.get("ID"), row.get("Kernel Name")))
    return {"read_bytes": sums[NCU_METRICS[0]], "write_bytes": sums[NCU_METRICS[1]],
            "kernels": sorted({k for _, k in kernels})[:8], "launches": len(kernels)}


def phase_ncu(args) -> dict:
    from flashflow.bench.mlp_suite import MODELS, weight_bytes

    ncu = args.ncu_path or shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not os.path.exists(ncu):
        return {"ncu": [], "ncu_error": f"ncu not found ({ncu})"}
    _, act, hidden, inter = MODELS[0]
    rows = []
    for m in NCU_TOKENS:
        for prov in NCU_PROVIDERS:
            cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none",
                   "--metrics", ",".join(NCU_METRICS), "--csv", "--print-units", "base",
                   sys.executable, str(Path(__file__).resolve()), "--single-run", prov, "--m", str(m)]
            row = {"model": MODELS[0][0], "M": m, "provider": prov,
                   "weight_bytes": weight_bytes(act, hidden, inter)}
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                row.update(parse_ncu(proc.stdout))
            except subprocess.TimeoutExpired:
                row["error"] = "ncu timed out after 120 s"
            except ValueError as e:
                row["error"] = f"{e}; exit {proc.returncode}; tail: {(proc.stdout + proc.stderr)[-600:]}"
            rows.append(row)
            msg = (f"read {row['read_bytes'] / 1e6:.0f} MB, write {row['write_bytes'] / 1e6:.0f} MB "
                   f"({row['launches']} kernels)" if "read_bytes" in row else row.get("error"))
            print(f"ncu {prov} M={m}: {msg}", flush=True)
    return {"ncu": rows}


def ncu_table(rows) -> str:
    lines = ["| M | provider | DRAM read MB | DRAM write MB | read ÷ weight bytes | kernels |",
             "|--:|:--|--:|--:|--:|--:|"]
    for r in rows:
        if "read_bytes" not in r:
            lines.append(f"| {r['M']} | {r['provider']} | {r.get('error', '')[:60]} | | | |")
            continue
        lines.append(f"| {r['M']} | {r['provider']} | {r['read_bytes'] / 1e6:.0f} | {r['write_bytes'] / 1e6:.0f} "
                     f"| {r['read_bytes'] / r['weight_bytes']:.2f} | {r['launches']} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------

PHASES = {"check": phase_check, "stress": phase_stress, "bench": phase_bench, "ncu": phase_ncu}


def run_phase(args) -> int:
    import faulthandler

    limit = (QUICK_LIMITS_S if args.quick else PHASE_LIMITS_S)[args.phase]
    faulthandler.dump_traceback_later(limit - 5, exit=True)   # a hang prints where it was
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this script runs on a GPU machine", file=sys.stderr)
        return 2
    result = PHASES[args.phase](args)
    result["device"] = torch.cuda.get_device_name()
    Path(args.result).write_text(json.dumps(result, default=str))
    return 0


def _child(args, phase: str, path: Path) -> tuple[int | None, float]:
    limit = (QUICK_LIMITS_S if args.quick else PHASE_LIMITS_S)[phase]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--result", str(path),
           "--warmup", str(args.warmup), "--rep", str(args.rep)] + (["--quick"] if args.quick else [])
    if args.ncu_path:
        cmd += ["--ncu-path", args.ncu_path]
    t0 = time.time()
    proc = subprocess.Popen(cmd, start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # the phase and its workers
        proc.wait()
        rc = None
    return rc, time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ncu", action="store_true", help="also measure DRAM bytes per policy with ncu")
    ap.add_argument("--ncu-path", default=None)
    ap.add_argument("--phases", default=None, help="comma list of check,stress,bench,ncu")
    ap.add_argument("--warmup", type=int, default=5, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=20, help="do_bench measuring time, ms")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--single-run", help=argparse.SUPPRESS)
    ap.add_argument("--m", type=int, default=1024, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.single_run:
        return single_run(args)
    if args.phase:
        return run_phase(args)

    phases = args.phases.split(",") if args.phases else ["check", "stress", "bench"] + (["ncu"] if args.ncu else [])
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        ap.error(f"--phases must be a comma list of {','.join(PHASES)}, got {args.phases!r}")
    tmp = Path(tempfile.mkdtemp(prefix="gpu_mlp_"))
    merged, status, failed = {}, {}, False
    t_all = time.time()
    for phase in phases:
        print(f"\n== {phase} ==", flush=True)
        rc, secs = _child(args, phase, tmp / f"{phase}.json")
        status[phase] = {"exit": rc, "seconds": round(secs, 1)}
        if rc is None:
            print(f"HANG/TIMEOUT: phase {phase} passed its {secs:.0f} s limit and was killed", flush=True)
        path = tmp / f"{phase}.json"
        if path.exists():
            merged.update(json.loads(path.read_text()))
        failed |= rc != 0
    merged["phases"] = status

    checks, stress = merged.get("checks", []), merged.get("stress", [])
    failed |= any(not c["ok"] for c in checks + stress)
    bench = merged.pop("bench", None)
    device = (bench or {}).get("device") or merged.get("device") or "unknown"
    result = dict(bench or {"suite": "mlp", "device": device})
    result.update({k: v for k, v in merged.items() if k != "device"})
    result.setdefault("date", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    try:
        import torch
        import triton

        result.setdefault("torch", torch.__version__)
        result.setdefault("triton", triton.__version__)
    except ImportError:
        pass
    from flashflow.bench import mlp_suite

    path = mlp_suite.write_result(result, args.out) if device != "unknown" else None

    print("\n== summary ==")
    for phase, st in status.items():
        print(f"{phase}: exit {st['exit']} in {st['seconds']} s")
    if checks:
        print(f"checks: {sum(c['ok'] for c in checks)}/{len(checks)} pass, worst rel err "
              f"{max((c['rel_err'] or 0) for c in checks):.2e}")
        for c in checks:
            if not c["ok"]:
                print(f"  FAIL {c['case']}: {c.get('error') or c['rel_err']}")
    for s in stress:
        print(f"stress {s['case']}: {'ok' if s['ok'] else 'FAIL'} (b2b {s['worst_back_to_back']:.1e}, "
              f"graph {s['worst_graph']:.1e}, workspace zero {s['workspace_zero_after']})")
    if merged.get("ncu"):
        print("\nDRAM bytes (ncu, one call, L2 flushed before each kernel):\n" + ncu_table(merged["ncu"]))
    elif merged.get("ncu_error"):
        print(f"ncu: {merged['ncu_error']}")
    print(f"\nresults: {path}  (total {time.time() - t_all:.0f} s)")
    if bench:
        print("\n" + mlp_suite.markdown_table(bench, "us") + "\n")
        print(mlp_suite.compact_table(bench))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
