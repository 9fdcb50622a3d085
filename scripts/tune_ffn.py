"""Sweep the decode FFN kernel's variants on the GPU, beside torch (cuBLAS) + CUDA graph.

Usage (device): PYTHONPATH=. python scripts/tune_ffn.py [--json OUT] [--rounds R] [--variants a,b]

1. PTX: which atomic instructions the main kernel's split-K adds compile to (scalar or vector),
   registers and spills of every variant;
2. correctness of every variant against float64 (Llama-3-8B at M = 1, 4, 5, 16, 64 and an odd
   shape), then 100 back-to-back calls and 100 CUDA-graph replays per variant, each checked;
3. timing: CUDA-graph replays of 10 calls (median per call), the torch anchor in the same run,
   ``--rounds`` interleaved rounds (the H100 drifts with heat; each round rotates the order).
   Llama-3-8B at M = 1, 4, 16, 32, 64 and Llama-3-70B at M = 1, 16, and a diagnostic: M = 16 with
   one x row read 16 times (M = 16's atomics, M = 1's x traffic).

Variants g2 / g4n32 / g4n64 / g8n16 run ffn_decode_grouped_kernel (the partials of 2-8 slices
summed on chip before the atomic adds); they target M = 16's extra cost over M = 1.
"""
import argparse
import json
import re
import statistics
import time
from collections import Counter

import torch
import triton

from flashflow.bench.decode import graph_time_ms
from flashflow.bench.mlp_suite import make_inputs, torch_ffn, weight_bytes
from flashflow.kernels.ffn import ffn_decode_grouped_kernel, ffn_decode_kernel
from flashflow.kernels.mlp import CNT_OFF
from flashflow.ops.ffn import decode_config, launch_decode
from flashflow.reference.mlp import mlp_ref
from gpu_cases import Cases, worst_over_graph_replays

TOL = 1e-2
# name -> decode_config overrides ("default": none). "shipped" is the config before the
# loop-start stagger, the PDL cast and the wide slices at M > 32
# (bench/results/tune-ffn-decode-atomics-h100-run*.json).
_BI128 = {"BLOCK_I": 128, "BLOCK_K": 64, "BLOCK_N": 64, "num_warps": 8}
_SHIPPED = {"stagger": 0, "pdl": False}
VARIANTS = {
    "shipped": _SHIPPED,
    "default": {},
    "sn+pdl": {"stagger": 1, "pdl": True},
    "skn+pdl": {"stagger": 2, "pdl": True},
    "st4": {"num_stages": 4},
    "bn64": {"BLOCK_N": 64},
    "bi128w8": {**_BI128, "stagger": 2},
    "bi128w8st4": {**_BI128, "stagger": 2, "num_stages": 4},
    "bi128w8st5": {**_BI128, "stagger": 2, "num_stages": 5},
    # partials of 2/4/8 slices summed on chip (ffn_decode_grouped_kernel): 2-8x fewer fp32 adds;
    # GEMM1 steps narrowed to keep two programs per SM (72-82 KB of smem, 168-192 registers)
    "g2": {"group": 2, "BLOCK_N": 64},
    "g4n32": {"group": 4, "BLOCK_N": 32},
    "g4n64": {"group": 4, "BLOCK_N": 64},
    "g8n16": {"group": 8, "BLOCK_N": 16},
}
VARIANTS_70B = ("shipped", "default", "sn+pdl", "skn+pdl", "g2", "g4n32")
# (model, hidden, inter, M, x rows aliased): the aliased case reads one x row 16 times (stride 0),
# so it has M = 16's atomics with M = 1's x traffic from L2 (a diagnostic, not a result)
CASES = ([("llama3-8b", 4096, 14336, m, False) for m in (1, 4, 16, 32, 64)] + [("llama3-8b", 4096, 14336, 16, True)]
         + [("llama3-70b", 8192, 28672, m, False) for m in (1, 16)])
DIAG_VARIANTS = ("shipped", "default", "g4n32")


def applies(name, m):
    """Grouped variants are for M ≤ 32 (at M = 64 the wide slices' groups overflow shared memory)."""
    return m <= 32 or "group" not in VARIANTS[name]


rel = Cases.rel   # ‖out − ref‖ / ‖ref‖ in float64


def resolve(overrides, inter, gated=True):
    """The shipped variant pins the earlier tiles: decode_config's at M = 1 (no M > 32 rule)."""
    if overrides is _SHIPPED:
        cfg = decode_config(1, inter, gated, torch.device("cuda"))
        cfg.update(_SHIPPED)
        return cfg
    return overrides


def decoder(act, acc, overrides):
    """launch_decode with the accumulator and, for the grouped kernel, counters kept across
    calls (both left zeroed by every call), as fused_mlp's workspace keeps them."""
    sync = torch.zeros(CNT_OFF + 4096, dtype=torch.int32, device=acc.device) if overrides.get("group") else None
    return lambda x, w1, w2: launch_decode(x, w1, w2, act, acc, overrides, sync=sync,
                                           grp_off=CNT_OFF if sync is not None else None)


def caller(x, w1, w2, act, overrides):
    m, hidden = x.shape
    acc = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
    run = decoder(act, acc, resolve(overrides, w2.shape[1], act == "swiglu"))
    return lambda: run(x, w1, w2)


def _compiled():
    return {id(k): k for fn in (ffn_decode_kernel, ffn_decode_grouped_kernel)
            for kc, *_ in fn.device_caches.values() for k in kc.values()}


def ptx_report(x, w1, w2, overrides):
    """Launch as launch_decode does, take the main kernel it compiled, read its atomics off the PTX."""
    m, hidden = x.shape
    before = _compiled()
    acc = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
    overrides = resolve(overrides, w2.shape[1])
    launch_decode(x, w1, w2, "swiglu", acc, overrides)
    new = [k for i, k in _compiled().items() if i not in before]
    if len(new) != 1:
        return {"error": f"{len(new)} new compiled kernels"}
    k = new[0]
    ptx = k.asm["ptx"]
    ops = Counter(re.search(r"\b((?:atom|red)\.global\S*|cp\.reduce\.async\.bulk\S*)", l).group(1) for l in ptx.splitlines()
                  if re.search(r"\b(?:atom|red)\.global|cp\.reduce\.async\.bulk", l))
    try:
        sass = k.asm["sass"]
    except Exception:  # noqa: BLE001 — no cuobjdump: PTX only
        sass = ""
    reds = Counter(re.search(r"\b((?:REDG|ATOMG|UBLKRED|UTMAREDG)\S*)", l).group(1) for l in sass.splitlines()
                   if re.search(r"\b(REDG|ATOMG|UBLKRED|UTMAREDG)", l))
    cfg = decode_config(m, w2.shape[1], True, x.device)
    cfg.update(overrides)
    return {"ptx_atomics": dict(ops), "sass_atomics": dict(reds), "n_regs": k.n_regs, "n_spills": k.n_spills,
            "shared": k.metadata.shared, "cfg": cfg}


def stress(name, overrides, log):
    x = torch.randn(16, 4096, dtype=torch.bfloat16, device="cuda")
    w1 = torch.randn(2 * 14336, 4096, dtype=torch.bfloat16, device="cuda") / 64
    w2 = torch.randn(4096, 14336, dtype=torch.bfloat16, device="cuda") / 120
    ref = mlp_ref(x.double(), w1.double(), w2.double())
    ws = torch.zeros(16, 4096, dtype=torch.float32, device="cuda")
    run = decoder("swiglu", ws, resolve(overrides, 14336))
    outs = [run(x, w1, w2) for _ in range(100)]
    torch.cuda.synchronize()
    worst = max(rel(o, ref) for o in outs)
    worst_g = worst_over_graph_replays(lambda: run(x, w1, w2), x,
                                       lambda x: mlp_ref(x.double(), w1.double(), w2.double()))
    zero = int(ws.count_nonzero()) == 0
    return [log({"variant": name, "case": "100 back-to-back M16", "rel_err": worst, "ok": worst < TOL and zero}),
            log({"variant": name, "case": "100 graph replays M16", "rel_err": worst_g, "ok": worst_g < TOL and zero})]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-checks", action="store_true")
    args = ap.parse_args()
    names = args.variants.split(",")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "variants": {n: VARIANTS[n] for n in names}, "ptx": {}, "checks": [], "times_us": {}, "summary": []}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    def log(row):
        print(("PASS " if row["ok"] else "FAIL ") + json.dumps(row), flush=True)
        return row

    # 1. PTX
    x = torch.randn(16, 4096, dtype=torch.bfloat16, device="cuda")
    w1, w2 = make_inputs("swiglu", 4096, 14336, 1, torch.bfloat16)[1:]
    for n in names:
        for m in [mm for mm in (1, 16, 32, 64) if applies(n, mm)]:
            result["ptx"][f"{n} M{m}"] = r = ptx_report(torch.randn(m, 4096, dtype=x.dtype, device="cuda"),
                                                        w1, w2, VARIANTS[n])
            print("PTX", n, m, json.dumps(r), flush=True)
    save()

    # 2. correctness
    if not args.no_checks:
        for n in names:
            odd = [("swiglu", 7, 1000, 3000), ("gelu", 7, 1000, 3000), ("swiglu", 3, 1001, 3003)]
            for act, m, hidden, inter in [("swiglu", mm, 4096, 14336) for mm in (1, 4, 5, 16, 64) if applies(n, mm)] + (
                    odd if "BLOCK_N" not in VARIANTS[n] or "group" in VARIANTS[n] else []):
                x_, w1_, w2_ = make_inputs(act, hidden, inter, m, torch.bfloat16, seed=m)
                ref = mlp_ref(x_.double(), w1_.double(), w2_.double(), act)
                out = torch.full((m, hidden), float("nan"), dtype=x_.dtype, device="cuda")
                acc = torch.zeros(m, hidden, dtype=torch.float32, device="cuda")
                out.copy_(decoder(act, acc, resolve(VARIANTS[n], inter, act == "swiglu"))(x_, w1_, w2_))
                err = rel(out, ref)
                result["checks"].append(log({"variant": n, "case": f"{act} M{m} {hidden}->{inter}", "rel_err": err,
                                             "ok": err < TOL and bool(torch.isfinite(out).all()) and int(acc.count_nonzero()) == 0}))
            result["checks"] += stress(n, VARIANTS[n], log)
            save()

    # 3. timing, interleaved rounds
    cases = []
    for model, hidden, inter, m, alias in CASES:
        if not cases or cases[-1]["model"] != model:
            torch.cuda.empty_cache()
            x_, w1_, w2_ = make_inputs("swiglu", hidden, inter, 64, torch.bfloat16)
        xm = x_[:1].expand(m, hidden) if alias else x_[:m].contiguous()
        vs = [n for n in names if (model == "llama3-8b" or n in VARIANTS_70B) and (not alias or n in DIAG_VARIANTS)
              and applies(n, m)]
        fns = {"torch-graph": lambda xm=xm, a=w1_, b=w2_: torch_ffn(xm, a, b, "swiglu")}
        fns.update({n: caller(xm, w1_, w2_, "swiglu", VARIANTS[n]) for n in vs})
        cases.append({"model": model + (" x-aliased" if alias else ""), "M": m, "hidden": hidden, "inter": inter, "fns": fns,
                      "wbytes": weight_bytes("swiglu", hidden, inter)})
    for r in range(args.rounds):
        for c in cases:
            key = f"{c['model']} M{c['M']}"
            order = list(c["fns"])
            order = order[r % len(order):] + order[:r % len(order)]
            for n in order:
                try:
                    us = graph_time_ms(c["fns"][n], steps=10) * 1e3
                except Exception as e:  # noqa: BLE001 — keep the other variants' numbers
                    print("ERROR", key, n, type(e).__name__, str(e)[:300], flush=True)
                    us = float("nan")
                result["times_us"].setdefault(key, {}).setdefault(n, []).append(us)
            print(f"round {r} {key}: " + " ".join(f"{n}={result['times_us'][key][n][-1]:.1f}" for n in c["fns"]),
                  flush=True)
        save()
    for c in cases:
        key = f"{c['model']} M{c['M']}"
        t = {n: statistics.median(v) for n, v in result["times_us"][key].items()}
        row = {"case": key, "median_us": t, "weight_tbs": {n: c["wbytes"] / u / 1e6 for n, u in t.items()},
               "vs_torch": {n: t["torch-graph"] / u for n, u in t.items()}}
        result["summary"].append(row)
    save()
    print("\n| case | " + " | ".join(["torch-graph"] + names) + " |")
    for row in result["summary"]:
        print(f"| {row['case']} | " + " | ".join(f"{row['median_us'][n]:.1f}" if n in row["median_us"] else "—"
                                                  for n in ["torch-graph"] + names) + " |")
    print(f"\n{sum(c['ok'] for c in result['checks'])}/{len(result['checks'])} checks pass")


if __name__ == "__main__":
    main()
