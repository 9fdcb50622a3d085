"""GPU check and bench of the fused FFN (decode regime), beside torch (cuBLAS) with a CUDA graph.

Usage (device): PYTHONPATH=. python scripts/gpu_ffn.py [--json OUT]
1. correctness: bf16/fp16, every activation, odd shapes, vs float64 (tolerance 1e-2);
2. 100 back-to-back runs and 100 CUDA-graph replays, each checked;
3. bench: Llama-3-8B / 70B SwiGLU and a 4096→14336 GELU FFN at M = 1, 4, 16, 64: µs (CUDA graph
   of 10 calls), TB/s of weights, ratio to torch + CUDA graph. Table printed last.
"""
import argparse
import json
import sys
import time

import torch
import triton

from flashflow.bench.decode import graph_time_ms
from flashflow.ops.mlp import MlpWorkspace, fused_mlp
from flashflow.reference.mlp import activation_ref, mlp_ref
from gpu_cases import Cases, worst_over_graph_replays

TOL = 1e-2


rel = Cases.rel   # ‖out − ref‖ / ‖ref‖ in float64


def weights(act, hidden, inter, dtype):
    rows = 2 * inter if act == "swiglu" else inter
    return (torch.randn(rows, hidden, dtype=dtype, device="cuda") / hidden ** 0.5,
            torch.randn(hidden, inter, dtype=dtype, device="cuda") / inter ** 0.5)


def torch_ffn(x, w1, w2, act):
    h = x @ w1.T
    if act == "swiglu":
        i = w2.shape[1]
        h = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
    elif act == "gelu":
        h = torch.nn.functional.gelu(h, approximate="tanh")
    else:
        h = activation_ref(act, h)
    return h @ w2.T


def graph_us(fn, steps=10):
    return graph_time_ms(fn, steps) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    checks, fails = [], 0
    for dtype in (torch.bfloat16, torch.float16):
        for act in ("swiglu", "gelu", "silu", "relu"):
            for m, hidden, inter in ((1, 4096, 14336), (7, 1000, 3000), (64, 512, 1536)):
                x = torch.randn(m, hidden, dtype=dtype, device="cuda")
                w1, w2 = weights(act, hidden, inter, dtype)
                out = torch.full((m, hidden), float("nan"), dtype=dtype, device="cuda")
                out.copy_(fused_mlp(x, w1, w2, act, policy="splitk"))
                err = rel(out, mlp_ref(x.double(), w1.double(), w2.double(), act))
                ok = err < TOL and torch.isfinite(out).all().item()
                fails += not ok
                checks.append({"case": f"{dtype} {act} M{m} {hidden}->{inter}", "rel_err": err, "ok": ok})
                print(f"{'PASS' if ok else 'FAIL'} {checks[-1]['case']}: {err:.2e}", flush=True)
    # stress: back-to-back runs and graph replays on one workspace
    x = torch.randn(16, 4096, dtype=torch.bfloat16, device="cuda")
    w1, w2 = weights("swiglu", 4096, 14336, torch.bfloat16)
    ref = mlp_ref(x.double(), w1.double(), w2.double())
    ws = MlpWorkspace(4096, max_tokens=16, device="cuda")
    outs = [fused_mlp(x, w1, w2, workspace=ws, policy="splitk") for _ in range(100)]
    torch.cuda.synchronize()
    worst = max(rel(o, ref) for o in outs)
    worst_g = worst_over_graph_replays(lambda: fused_mlp(x, w1, w2, workspace=ws, policy="splitk"), x,
                                       lambda x: mlp_ref(x.double(), w1.double(), w2.double()))
    for name, w in (("100 back-to-back runs", worst), ("100 CUDA-graph replays", worst_g)):
        ok = w < TOL
        fails += not ok
        checks.append({"case": name, "rel_err": w, "ok": ok})
        print(f"{'PASS' if ok else 'FAIL'} {name}: worst {w:.2e}", flush=True)

    rows = []
    for name, act, hidden, inter in (("llama3-8b", "swiglu", 4096, 14336), ("llama3-70b", "swiglu", 8192, 28672),
                                     ("gpt-4096x14336-gelu", "gelu", 4096, 14336)):
        w1, w2 = weights(act, hidden, inter, torch.bfloat16)
        wbytes = (w1.numel() + w2.numel()) * 2
        for m in (1, 4, 16, 64):
            x = torch.randn(m, hidden, dtype=torch.bfloat16, device="cuda")
            ws = MlpWorkspace(hidden, max_tokens=m, device="cuda")
            t_ff = graph_us(lambda: fused_mlp(x, w1, w2, act, workspace=ws, policy="splitk"))
            t_th = graph_us(lambda: torch_ffn(x, w1, w2, act))
            rows.append({"model": name, "M": m, "flashflow_us": t_ff, "torch_graph_us": t_th,
                         "flashflow_tbs": wbytes / t_ff / 1e6, "torch_tbs": wbytes / t_th / 1e6,
                         "speedup_vs_torch": t_th / t_ff, "weight_mbytes": wbytes / 1e6})
            print(json.dumps(rows[-1]), flush=True)
        del w1, w2
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "checks": checks, "bench": rows},
                      f, indent=1)
    print(f"\n{sum(c['ok'] for c in checks)}/{len(checks)} checks pass\n")
    print("| FFN | M | weights MB | flashflow µs | TB/s | torch+graph µs | TB/s | speedup |")
    print("|:--|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(f"| {r['model']} | {r['M']} | {r['weight_mbytes']:.0f} | {r['flashflow_us']:.1f} | {r['flashflow_tbs']:.2f} "
              f"| {r['torch_graph_us']:.1f} | {r['torch_tbs']:.2f} | {r['speedup_vs_torch']:.2f}× |")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
