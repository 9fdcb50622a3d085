"""Measured DRAM bytes of the fused FFN's policies (ncu) beside what the dataflow model predicts.

Usage (CPU, no GPU needed: the model is Python):
    python scripts/mlp_ncu_model.py bench/results/mlp-nvidia-h100-80gb-hbm3.json
    python scripts/mlp_ncu_model.py A.json B.json C.json --out merged.json   # merge gpu_mlp runs

``scripts/gpu_mlp.py --ncu`` measures, for each policy at M = 1024 and 4096 (Llama-3-8B), one
call's ``dram__bytes_read.sum`` / ``dram__bytes_write.sum``. This script adds, for every row that
is a policy of the persistent kernel, the bytes :func:`flashflow.bench.mlp_suite.model_traffic`
predicts for the kernel's own tiles and ticket order: on the partitioned-L2 H100 model (the
one that ranked measured GEMM orders correctly, docs/dataflow.md) and on the unified LRU.

Several input files (the phases of one gpu_mlp session run as separate device calls) are merged
first: each top-level key is taken from the last file that has it (``phases`` are combined).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flashflow.bench import mlp_suite  # noqa: E402
from flashflow.dataflow.model import H100, H100_PARTITIONED  # noqa: E402

MODELS = {"model_partitioned": H100_PARTITIONED, "model_unified": H100}


def add_predictions(result: dict) -> dict:
    """Adds ``model_partitioned`` / ``model_unified`` ({policy, read_bytes, write_bytes}) to
    each ncu row of a persistent-kernel policy (in place); returns ``result``."""
    specs = {name: (act, hidden, inter) for name, act, hidden, inter in mlp_suite.MODELS}
    policies = set(mlp_suite.POLICY_PROVIDERS) - {"splitk"} | {"flashflow"}
    cache: dict = {}
    for row in result.get("ncu", []):
        if row.get("provider") not in policies or row.get("model") not in specs:
            continue
        act, hidden, inter = specs[row["model"]]
        policy = "auto" if row["provider"] == "flashflow" else row["provider"]
        for key, hw in MODELS.items():
            args = (act, hidden, inter, row["M"], policy, key)
            if args not in cache:
                cache[args] = mlp_suite.model_traffic(act, hidden, inter, row["M"], policy, hw=hw)
            row[key] = cache[args]
    return result


def table(rows) -> str:
    """Markdown: measured and predicted MB per (M, provider)."""
    head = ("| M | provider | measured read MB | model read MB (partitioned L2) | ÷ measured "
            "| model read MB (unified L2) | ÷ measured | measured write MB | model write MB | kernels |")
    lines = [head, "|--:|:--|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        if "read_bytes" not in r:
            lines.append(f"| {r['M']} | {r['provider']} | {r.get('error', '')[:60]} |  |  |  |  |  |  |  |")
            continue
        mp, mu = r.get("model_partitioned") or {}, r.get("model_unified") or {}
        read = r["read_bytes"]

        def mb(d, k):
            return f"{d[k] / 1e6:.0f}" if k in d else "—"

        def ratio(d):
            return f"{d['read_bytes'] / read:.2f}" if "read_bytes" in d else "—"
        lines.append(f"| {r['M']} | {r['provider']} | {read / 1e6:.0f} | {mb(mp, 'read_bytes')} | {ratio(mp)} "
                     f"| {mb(mu, 'read_bytes')} | {ratio(mu)} | {r['write_bytes'] / 1e6:.0f} "
                     f"| {mb(mp, 'write_bytes')} | {r['launches']} |")
    return "\n".join(lines)


def rank_check(rows) -> list[str]:
    """Per M: the measured order of the persistent policies by read bytes, and each model's."""
    out = []
    for m in sorted({r["M"] for r in rows}):
        pol = [r for r in rows if r["M"] == m and "read_bytes" in r and "model_partitioned" in r]
        measured = [r["provider"] for r in sorted(pol, key=lambda r: r["read_bytes"])]
        line = f"M={m}: measured {' < '.join(measured)}"
        for key in MODELS:
            ranked = [r["provider"] for r in sorted(pol, key=lambda r: r[key].get("read_bytes", float("inf")))]
            line += f"; {key.removeprefix('model_')} {'same' if ranked == measured else ' < '.join(ranked)}"
        out.append(line)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="gpu_mlp result JSON file(s)")
    ap.add_argument("--out", help="where to write the merged result with predictions "
                                  "(default: the single input, in place)")
    args = ap.parse_args(argv)
    if len(args.inputs) > 1 and not args.out:
        ap.error("merging several inputs needs --out")
    result: dict = {}
    for path in args.inputs:
        part = json.loads(Path(path).read_text())
        phases = {**result.get("phases", {}), **part.get("phases", {})}
        result.update(part)
        if phases:
            result["phases"] = phases
    add_predictions(result)
    out = Path(args.out or args.inputs[0])
    out.write_text(json.dumps(result, indent=1) + "\n")
    rows = result.get("ncu", [])
    print(table(rows))
    print("\n".join(rank_check(rows)))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
