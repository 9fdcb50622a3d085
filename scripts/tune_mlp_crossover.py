"""Where `auto` should leave the split-K decode kernel for the persistent one (GPU).

Usage (on the device, from the repository root):
    PYTHONPATH=. python scripts/tune_mlp_crossover.py [--out bench/results/tune-mlp-crossover-h100.json]

For the three FFNs of the mlp suite and M from 8 to 128 tokens, times (CUDA-graph replays of
10 calls, medians) the split-K kernel (`policy="splitk"`, M ≤ 64), the persistent kernel with
the order `auto` picks for one or two row-blocks (`seqsplit` gated, `halfrow` not), and torch +
CUDA graph, in 3 interleaved rounds (the H100's clocks drift with heat, so every ratio is
taken inside its round). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flashflow.bench import mlp_suite  # noqa: E402
from flashflow.bench.decode import graph_time_ms  # noqa: E402
from flashflow.ops import mlp  # noqa: E402

TOKENS = (8, 16, 24, 32, 40, 48, 64, 96, 128)
ROUNDS = 3


def providers(x, w1, w2, act):
    m, hidden = x.shape
    ws = mlp.MlpWorkspace(hidden, max_tokens=m, device=x.device)
    persistent = "seqsplit" if act == "swiglu" else "halfrow"
    out = {"torch-graph": lambda: mlp_suite.torch_ffn(x, w1, w2, act),
           persistent: lambda: mlp.fused_mlp(x, w1, w2, act, persistent, workspace=ws)}
    if m <= mlp.DECODE_MAX_M:
        out["splitk"] = lambda: mlp.fused_mlp(x, w1, w2, act, "splitk", workspace=ws)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "tune-mlp-crossover-h100.json"))
    args = ap.parse_args(argv)
    rows = []
    for model, act, hidden, inter in mlp_suite.MODELS:
        for m in TOKENS:
            x, w1, w2 = mlp_suite.make_inputs(act, hidden, inter, m, torch.bfloat16)
            provs = providers(x, w1, w2, act)
            ref = mlp_suite.torch_ffn(x.float(), w1.float(), w2.float(), act)
            errs = {}
            for name, fn in provs.items():
                out = fn().float()
                errs[name] = ((out - ref).norm() / ref.norm()).item()
            rounds = [{name: graph_time_ms(fn, 10) * 1e3 for name, fn in provs.items()} for _ in range(ROUNDS)]
            med = {name: statistics.median(r[name] for r in rounds) for name in provs}
            vs = {name: statistics.median(r["torch-graph"] / r[name] for r in rounds) for name in provs}
            row = {"model": model, "activation": act, "M": m, "us": med, "vs_torch": vs, "rel_err": errs,
                   "rounds_us": rounds}
            rows.append(row)
            print(f"{model:22} M={m:4} " + "  ".join(f"{n} {med[n]:7.1f}µs ({vs[n]:.2f}×, err {errs[n]:.1e})"
                                                     for n in provs), flush=True)
            del x, w1, w2, provs, ref
            torch.cuda.empty_cache()
    import triton

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "note": "CUDA-graph replays of 10 calls, do_bench medians; 3 interleaved rounds; vs_torch is the "
                      "median over rounds of torch-graph µs / provider µs in the same round",
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
