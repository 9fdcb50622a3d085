"""Prefill FFN (the persistent kernel, M ≥ 128): load path, stages, GEMM1 tile and tile order,
checked, stress-tested and timed against cuBLAS in one run on one GPU.

Usage (on the device, from the repository root):
    PYTHONPATH=. python scripts/tune_mlp_prefill.py                 # everything, ~5 min on an H100
    PYTHONPATH=. python scripts/tune_mlp_prefill.py --variants tma4:seqsplit:8,ptr3:multirow:8

A variant is [gelu/]CONFIG:POLICY[:R]; CONFIG names a PersistentConfig below (ptr = pointer
loads, tma = host TMA descriptors; the digit is num_stages; n256 = 128×256 GEMM1 tiles; b256 =
128×256 GEMM0 and GEMM1 tiles, for non-gated FFNs; k128 = BLOCK_K 128; m64 = 64-row tiles;
n64 = 64-wide GEMM1 tiles; w4 = 4 warps, two programs per SM); "gelu/" times it on a
GPT-3-style GELU FFN of the same sizes instead of SwiGLU. Phases, in one process (faulthandler
prints where it hung, past --limit seconds):

1. compile: every kernel the run needs, in parallel worker processes (Triton's disk cache);
2. check: every variant on Llama-3-8B at M = 1024 against a float32 reference (TF32 off), and on
   odd shapes (SwiGLU and GELU, bf16 and fp16, M = 130 and 300) against float64, with out and
   H filled with NaN beforehand (a tile never written shows) and spins bounded (a wrong order
   raises instead of hanging); the workspace must be zero afterwards;
3. time: CUDA-graph replays (2 calls per graph, median) of every variant and of cuBLAS in
   sequence (F.linear, activation, F.linear captured in a graph), at M = 1024 and 4096 (or
   --tokens), in --rounds rounds that each time cuBLAS first: the H100 slows as it heats
   (cuBLAS measured 541 µs, then 618 µs, a minute apart), so each ratio is taken against its
   own round's cuBLAS and the medians over rounds are reported;
4. stress: the fastest variants and the shipped default: 50 back-to-back calls and 50 graph
   replays (the input changed every 25) at M = 1024, each output bitwise equal to an eager
   call on the same input (the kernel is deterministic, so a stale tile shows as a difference).

Writes $OUT/tune-mlp-prefill.json (or --out) and prints a short table last.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HIDDEN, INTER = 4096, 14336
TOKENS = (1024, 4096)
STRESS_M = 1024
TOL = 1e-2

CONFIGS = {
    "ptr3": dict(use_tma=False, num_stages=3),
    "tma3": dict(use_tma=True, num_stages=3),
    "tma4": dict(use_tma=True, num_stages=4),
    "tma3n256": dict(use_tma=True, num_stages=3, BLOCK_N1=256),
    "tma4n256": dict(use_tma=True, num_stages=4, BLOCK_N1=256),
    "tma2k128": dict(use_tma=True, num_stages=2, BLOCK_K=128),
    "tma3b256": dict(use_tma=True, num_stages=3, BLOCK_N0=256, BLOCK_N1=256, nongated_only=True),
    "tma4b256": dict(use_tma=True, num_stages=4, BLOCK_N0=256, BLOCK_N1=256, nongated_only=True),
    # few row-blocks (M ≤ 512), where the weight stream bounds the time and SMs need tiles:
    # 64-row tiles waste no padding at M = 64 and leave shared memory for more stages
    "tma4n64": dict(use_tma=True, num_stages=4, BLOCK_N1=64),
    "tma5m64": dict(use_tma=True, num_stages=5, BLOCK_M=64),
    "tma5m64n64": dict(use_tma=True, num_stages=5, BLOCK_M=64, BLOCK_N1=64),
    # one warpgroup per 64-row tile, two programs per SM (non-gated: 96 KB of shared memory and
    # 229 registers each, compiled for sm90 on a CPU by flashflow.tuning.offline)
    "tma4m64w4": dict(use_tma=True, num_stages=4, BLOCK_M=64, num_warps=4, programs_per_sm=2,
                      nongated_only=True),
    "tma4m64n64w4": dict(use_tma=True, num_stages=4, BLOCK_M=64, BLOCK_N1=64, num_warps=4,
                         programs_per_sm=2, nongated_only=True),
}
POLICIES = ("multirow:8", "sequential:4", "seqsplit:8", "seqsplit:4")
CHECK_ONLY = ("halfrow", "rowblock", "sequential")   # checked (and stressed), not timed
ODD = (("bfloat16", "swiglu", 300, 1000, 3000), ("float16", "gelu", 130, 520, 1000))


def make_config(name):
    from flashflow.ops.mlp import PersistentConfig

    base = dict(BLOCK_M=128, BLOCK_N0=128, BLOCK_N1=128, BLOCK_K=64, num_warps=8)
    base.update({k: v for k, v in CONFIGS[name].items() if k != "nongated_only"})
    return PersistentConfig(**base)


def parse_variant(v):
    """'[gelu/]CONFIG:POLICY[:R]' -> (activation, config name, policy, rows)."""
    from flashflow.ops.mlp import parse_policy

    act, _, rest = v.rpartition("/")
    if rest == "auto":   # the public op with its own config and policy
        return act or "swiglu", None, "auto", 0
    cfg, _, policy = rest.partition(":")
    name, rows = parse_policy(policy)
    return act or "swiglu", cfg, name, rows


def kernel_part(v):
    return v.rpartition("/")[2]


# --------------------------------------------------------------------------------------------
# kernels: launch with optional NaN-filled buffers; record each compiled kernel's resources
# --------------------------------------------------------------------------------------------

KERNEL_INFO: dict = {}
KERNEL_KEY = ("use_tma", "num_stages", "BLOCK_N0", "BLOCK_N1", "BLOCK_K", "policy_code", "gated", "dtype", "hidden",
              "inter")


def _record_kernels():
    """Wrap the persistent kernel so every launch records (regs, spills, smem) of its binary."""
    from flashflow.ops import mlp

    real = mlp.mlp_persistent_kernel
    if getattr(real, "_recording", False):
        return

    class Recorder:
        _recording = True

        def __getitem__(self, grid):
            launch = real[grid]

            def run(*args, **kw):
                k = launch(*args, **kw)
                key = (kw["USE_TMA"], kw["num_stages"], kw["BLOCK_N0"], kw["BLOCK_N1"], kw["BLOCK_K"], kw["POLICY"],
                       kw["GATED"], str(args[0].dtype).replace("torch.", ""), args[0].shape[1], args[2].shape[1])
                if k is not None and key not in KERNEL_INFO:
                    KERNEL_INFO[key] = dict(n_regs=getattr(k, "n_regs", None), n_spills=getattr(k, "n_spills", None),
                                            shared=k.metadata.shared)
                return k
            return run

    mlp.mlp_persistent_kernel = Recorder()


def call(x, w1, w2, act, variant, ws, poison=False):
    import torch

    from flashflow.ops.mlp import fused_mlp, launch_persistent

    _, cfg_name, policy, rows = parse_variant(variant)
    if cfg_name is None:
        return fused_mlp(x, w1, w2, act, "auto", workspace=ws)
    m, hidden = x.shape
    inter = w2.shape[1]
    out = h = None
    if poison:
        out = torch.full((m, hidden), float("nan"), dtype=x.dtype, device=x.device)
        h = torch.full((m, inter), float("nan"), dtype=x.dtype, device=x.device)
    return launch_persistent(x, w1, w2, act, policy, rows, workspace=ws, config=make_config(cfg_name), out=out, h=h)


def inputs(act, hidden, inter, m, dtype, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = 2 * inter if act == "swiglu" else inter
    x = torch.randn(m, hidden, device="cuda", dtype=dtype, generator=g)
    w1 = torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=g) / hidden ** 0.5
    w2 = torch.randn(hidden, inter, device="cuda", dtype=dtype, generator=g) / inter ** 0.5
    return x, w1, w2


def _compile_jobs(jobs):
    """One call per (variant, shape) that the run will launch: fills Triton's disk cache."""
    import torch

    from flashflow.ops.mlp import MlpWorkspace

    failed = []
    for v, tokens in jobs:
        act = parse_variant(v)[0]
        try:   # a config that does not fit (shared memory) is reported, and the run goes on
            for m in tokens:
                x, w1, w2 = inputs(act, HIDDEN, INTER, m, torch.bfloat16)
                call(x, w1, w2, act, v, MlpWorkspace(HIDDEN, max_tokens=m, device="cuda"))
            for dt, oact, m, hd, it in odd_cases(v):
                x, w1, w2 = inputs(oact, hd, it, m, getattr(torch, dt))
                call(x, w1, w2, oact, v, MlpWorkspace(hd, max_tokens=m, device="cuda"))
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            failed.append(f"{v}: {type(e).__name__}: {e}"[:300])
    return failed


def odd_cases(v):
    """ODD cases this variant's config can run (b256 configs hold one accumulator only)."""
    cfg = parse_variant(v)[1]
    if cfg is None:
        return []
    return [c for c in ODD if not (CONFIGS[cfg].get("nongated_only") and c[1] == "swiglu")]


def phase_compile(jobs, workers):
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    chunks = [jobs[i::workers] for i in range(workers)]
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        failed = [f for part in ex.map(_compile_jobs, [c for c in chunks if c]) for f in part]
    for f in failed:
        print(f"FAIL compile {f}", flush=True)
    return time.time() - t0


# --------------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------------


def rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def phase_check(variants):
    import torch

    from flashflow.ops import mlp
    from flashflow.reference.mlp import mlp_ref

    mlp._SPIN_LIMIT = 1 << 22   # a wait that cannot be met raises (after seconds) instead of hanging
    rows = []
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False   # an fp32 reference
    x, w1, w2 = inputs("swiglu", HIDDEN, INTER, 1024, torch.bfloat16, seed=7)
    ref = mlp_ref(x.float(), w1.float(), w2.float(), "swiglu")
    cases = [("llama3-8b M=1024 (fp32 ref)", x, w1, w2, "swiglu", ref)]
    for dt, act, m, hd, it in ODD:
        xo, w1o, w2o = inputs(act, hd, it, m, getattr(torch, dt), seed=m)
        cases.append((f"{dt} {act} M={m} {hd}->{it} (fp64 ref)", xo, w1o, w2o, act,
                      mlp_ref(xo.double(), w1o.double(), w2o.double(), act)))
    for v in variants:
        for name, xc, w1c, w2c, act, refc in cases:
            if CONFIGS[parse_variant(v)[1]].get("nongated_only") and act == "swiglu":
                continue
            ws = mlp.MlpWorkspace(xc.shape[1], max_tokens=xc.shape[0], device="cuda")
            try:
                out = call(xc, w1c, w2c, act, v, ws, poison=True)
                torch.cuda.synchronize()
                err = rel(out, refc)
                finite = bool(torch.isfinite(out).all())
                clean = int(ws.buffer.count_nonzero()) == 0
                ok = finite and clean and err <= TOL
                row = dict(variant=v, case=name, rel_err=err, finite=finite, workspace_zero=clean, ok=ok)
            except Exception as e:  # noqa: BLE001 — report and go on
                row = dict(variant=v, case=name, ok=False, error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            if not row["ok"]:
                print(f"FAIL check {v} {name}: {row}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    mlp._SPIN_LIMIT = 0
    return rows


# --------------------------------------------------------------------------------------------
# time
# --------------------------------------------------------------------------------------------


def phase_time(variants, tokens, rep, rounds):
    import statistics

    import torch

    from flashflow.bench.decode import graph_time_ms
    from flashflow.bench.mlp_suite import ffn_flops, torch_ffn
    from flashflow.ops.mlp import MlpWorkspace

    out = {}
    for act in sorted({parse_variant(v)[0] for v in variants}, key=lambda a: a != "swiglu"):
        mine = [v for v in variants if parse_variant(v)[0] == act]
        anchor = "cublas-graph" if act == "swiglu" else f"{act}/cublas-graph"
        for m in tokens:
            x, w1, w2 = inputs(act, HIDDEN, INTER, m, torch.bfloat16)
            ws = MlpWorkspace(HIDDEN, max_tokens=m, device="cuda")
            flops = ffn_flops(m, act, HIDDEN, INTER)
            fns = {anchor: lambda: torch_ffn(x, w1, w2, act)}
            fns.update({v: (lambda v=v: call(x, w1, w2, act, v, ws)) for v in mine})
            samples = {k: [] for k in fns}
            for _ in range(rounds):
                for k, fn in fns.items():
                    try:
                        samples[k].append(graph_time_ms(fn, steps=2, warmup=10, rep=rep) * 1e3)
                    except Exception as e:  # noqa: BLE001
                        samples[k].append(f"{type(e).__name__}: {e}"[:200])
            res = out.setdefault(str(m), {})
            base = samples[anchor]
            for k, us in samples.items():
                if not all(isinstance(u, float) for u in us):
                    res[k] = dict(error=next(u for u in us if not isinstance(u, float)))
                    continue
                med = statistics.median(us)
                res[k] = dict(us=med, tflops=flops / (med * 1e-6) / 1e12, rounds_us=[round(u, 1) for u in us],
                              vs_cublas=statistics.median(b / u for b, u in zip(base, us)))
                print(f"M={m} {k}: {med:.1f} µs, ÷cuBLAS {res[k]['vs_cublas']:.3f} ({res[k]['rounds_us']})", flush=True)
            del x, w1, w2, fns
            torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------------------------
# stress
# --------------------------------------------------------------------------------------------


def phase_stress(cases, runs=50):
    import torch

    from flashflow.bench.decode import capture_graph
    from flashflow.ops import mlp

    rows = []
    for v, m in cases:
        t0 = time.time()
        x, w1, w2 = inputs("swiglu", HIDDEN, INTER, m, torch.bfloat16, seed=11)
        ws = mlp.MlpWorkspace(HIDDEN, max_tokens=m, device="cuda")
        expect = call(x, w1, w2, "swiglu", v, ws).clone()
        outs = [call(x, w1, w2, "swiglu", v, ws) for _ in range(runs)]
        torch.cuda.synchronize()
        b2b_bad = sum(not torch.equal(o, expect) for o in outs)
        del outs
        graph, static = capture_graph(lambda: call(x, w1, w2, "swiglu", v, ws))
        graph_bad = 0
        for i in range(runs):
            if i % 25 == 0:
                x.copy_(torch.randn_like(x))
                expect = call(x, w1, w2, "swiglu", v, ws).clone()
            graph.replay()
            torch.cuda.synchronize()
            graph_bad += not torch.equal(static, expect)
        del graph
        clean = int(ws.buffer.count_nonzero()) == 0
        ok = b2b_bad == 0 and graph_bad == 0 and clean
        rows.append(dict(variant=v, M=m, runs=runs, back_to_back_mismatches=b2b_bad,
                         graph_mismatches=graph_bad, workspace_zero=clean, ok=ok, seconds=time.time() - t0))
        print(f"{'PASS' if ok else 'FAIL'} stress {v} M={m}: b2b mismatches {b2b_bad}/{runs}, graph {graph_bad}/{runs}, "
              f"workspace zero {clean}", flush=True)
    return rows


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=None, help="comma list of CONFIG:POLICY[:R]")
    ap.add_argument("--stress", type=int, default=3, help="stress the N fastest variants (+ the default)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench measuring time per variant, ms")
    ap.add_argument("--limit", type=int, default=400, help="seconds before faulthandler dumps and exits")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma list of M to time")
    ap.add_argument("--rounds", type=int, default=1, help="timing rounds (each starts with cuBLAS)")
    ap.add_argument("--no-stress", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    faulthandler.dump_traceback_later(args.limit, exit=True)

    import torch
    import triton

    variants = (args.variants.split(",") if args.variants else
                [f"{c}:{p}" for c in CONFIGS for p in POLICIES])
    tokens = [int(t) for t in args.tokens.split(",")]
    configs = sorted({parse_variant(v)[1] for v in variants} - {None}, key=list(CONFIGS).index)
    kernels = sorted({kernel_part(v) for v in variants if parse_variant(v)[1]},
                     key=[kernel_part(v) for v in variants].index)
    check_variants = kernels + [f"{c}:{p}" for c in configs for p in CHECK_ONLY
                                if CONFIGS[c]["use_tma"] and not CONFIGS[c].get("nongated_only")]
    t_all = time.time()
    workers = max(1, min(12, (os.cpu_count() or 2) - 2))
    jobs = [(v, tokens) for v in variants] + [(v, []) for v in check_variants if v not in variants]
    secs = phase_compile(jobs, workers)
    print(f"compiled in {secs:.0f} s ({workers} workers)", flush=True)
    _record_kernels()
    checks = phase_check(check_variants)
    print(f"checks: {sum(c['ok'] for c in checks)}/{len(checks)} pass ({time.time() - t_all:.0f} s)", flush=True)
    partial = Path(args.out) / "tune-mlp-prefill.partial.json"   # kept if a later phase hangs
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text(json.dumps(dict(checks=checks, kernels=[[list(k), v] for k, v in KERNEL_INFO.items()])))
    timing = phase_time(variants, tokens, args.rep, args.rounds)
    partial.write_text(json.dumps(dict(checks=checks, timing=timing)))
    bad = {c["variant"] for c in checks if not c["ok"]}
    key_m = str(STRESS_M) if str(STRESS_M) in timing else str(tokens[0])
    ranked = sorted((v for v in variants if v not in bad and parse_variant(v)[0] == "swiglu" and parse_variant(v)[1]
                     and "us" in timing[key_m].get(v, {})), key=lambda v: timing[key_m][v]["us"])
    from flashflow.ops.mlp import persistent_config, resolve_policy

    default_cfg = persistent_config(True, torch.device("cuda"), STRESS_M)
    dpol, drows = resolve_policy("auto", STRESS_M, default_cfg)
    # the fastest variants, and every policy of the fastest config (halfrow also at 2 row-blocks)
    cases = [(v, STRESS_M) for v in ranked[:args.stress]]
    if ranked:
        best_cfg = ranked[0].partition(":")[0]
        for p in POLICIES + CHECK_ONLY + ("multirow:8",):
            if (f"{best_cfg}:{p}", STRESS_M) not in cases:
                cases.append((f"{best_cfg}:{p}", STRESS_M))
        cases.append((f"{best_cfg}:halfrow", 256))
        cases.append((ranked[0], 4096))
    stress = [] if args.no_stress else phase_stress(cases)
    # the shipped default through the public op, as a serving loop calls it
    from flashflow.ops import mlp

    x, w1, w2 = inputs("swiglu", HIDDEN, INTER, STRESS_M, torch.bfloat16, seed=3)
    ws = mlp.MlpWorkspace(HIDDEN, max_tokens=STRESS_M, device="cuda")
    first = mlp.fused_mlp(x, w1, w2, "swiglu", workspace=ws).clone()
    same = all(torch.equal(mlp.fused_mlp(x, w1, w2, "swiglu", workspace=ws), first) for _ in range(20))
    default_row = dict(config=repr(default_cfg), policy=f"{dpol}:{drows}", repeat_equal=same,
                       workspace_zero=int(ws.buffer.count_nonzero()) == 0)

    props = torch.cuda.get_device_properties(0)
    result = dict(suite="tune-mlp-prefill", device=props.name, sm_count=props.multi_processor_count,
                  torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  model="llama3-8b swiglu 4096->14336 bf16", configs=CONFIGS,
                  kernels=[dict(zip(KERNEL_KEY, k), **v) for k, v in KERNEL_INFO.items()],
                  checks=checks, timing=timing, stress=stress, default=default_row,
                  seconds=round(time.time() - t_all, 1))
    path = Path(args.out) / "tune-mlp-prefill.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    partial.unlink(missing_ok=True)

    print(f"\nresults: {path} ({time.time() - t_all:.0f} s); default {default_row}")
    print(f"checks: {sum(c['ok'] for c in checks)}/{len(checks)} pass; failing variants: {sorted(bad) or 'none'}")
    for k, v in KERNEL_INFO.items():
        if k[-2:] == (HIDDEN, INTER):
            print("kernel " + " ".join(f"{a}={b}" for a, b in zip(KERNEL_KEY, k)) + f": {v}")
    print(f"{'variant':24} {'check':>5} " + " ".join(f"{'M=' + m + ' µs':>11} {'TF/s':>5} {'÷cuBLAS':>7}" for m in timing))
    anchors = ["cublas-graph"] + sorted({f"{parse_variant(v)[0]}/cublas-graph" for v in variants} - {"swiglu/cublas-graph"})
    for v in anchors + variants:
        ok = "" if "cublas" in v else ("FAIL" if kernel_part(v) in bad else "ok")
        cells = []
        for m in timing:
            r = timing[m].get(v, {})
            cells.append(f"{r['us']:11.1f} {r['tflops']:5.0f} {r['vs_cublas']:7.3f}" if "us" in r else f"{'err':>11} {'':5} {'':7}")
        print(f"{v:24} {ok:>5} " + " ".join(cells))
    for s in stress:
        print(f"stress {s['variant']} M={s['M']}: {'ok' if s['ok'] else 'FAIL'} (b2b {s['back_to_back_mismatches']}, "
              f"graph {s['graph_mismatches']}, zero {s['workspace_zero']})")
    failed = bool(bad) or any(not s["ok"] for s in stress) or not same
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
