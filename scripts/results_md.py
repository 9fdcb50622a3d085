"""Render the measured tables of docs/results.md from the JSON under bench/results/.

Usage: python scripts/results_md.py [--write docs/results.md]
Everything between the ``<!-- GENERATED -->`` markers of docs/results.md is replaced; the prose
around them is kept.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))


def _load(name):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _header(d):
    return (f"Device: {d.get('device')}, torch {d.get('torch')}, triton {d.get('triton')}, "
            f"date {d.get('date')}.")


def attention_section() -> str:
    from flashflow.bench import runner

    d = _load("attention-nvidia-h100-80gb-hbm3.json")
    if d is None:
        return ""
    return ("### Prefill / diffusion attention forward (bf16, `flashflow bench`)\n\n" + _header(d) +
            " Median of `triton.testing.do_bench`; ratios are flashflow's TF/s over the anchor's in the "
            "same run; causal TF/s count half the FLOPs.\n\n" + runner.markdown_table(d["rows"]) + "\n")


def decode_section() -> str:
    from flashflow.bench.decode import markdown_table

    d = _load("decode-nvidia-h100-80gb-hbm3.json")
    if d is None:
        return ""
    return ("### Decode attention (bf16, one query token, head_dim 128, `flashflow bench --suite decode`)\n\n"
            + _header(d) + "\n\n" + markdown_table(d) + "\n")


def info_section() -> str:
    d = _load("info-h100.json")
    if d is None:
        return ""
    lines = ["### Registers, spills and shared memory of the shipped attention configs (`flashflow info`)", "",
             _header(d), "", "| d ≤ | causal | variant | BM×BN | warps | stages | kernel | regs | spills | smem B |",
             "|---:|:--|:--|:--|---:|---:|:--|---:|---:|---:|"]
    for r in d["rows"]:
        lines.append(f"| {r.get('head_dim_max')} | {'yes' if r.get('causal') else 'no'} | {r.get('variant')} | "
                     f"{r.get('BLOCK_M')}×{r.get('BLOCK_N')} | {r.get('num_warps')} | {r.get('num_stages')} | "
                     f"{r.get('kernel')} | {r.get('n_regs')} | {r.get('n_spills')} | {r.get('shared')} |")
    return "\n".join(lines) + "\n"


def validation_section() -> str:
    d = _load("dataflow-validation-nvidia-h100-80gb-hbm3.json")
    if d is None:
        return ""
    spec = importlib.util.spec_from_file_location("dv", ROOT / "scripts" / "dataflow_gpu_validate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return ("### Dataflow model vs measured DRAM bytes (Nsight Compute)\n\n" + _header(d) + "\n\n" +
            mod.markdown_table(d["results"]) + "\n")


def ffn_section() -> str:
    d = _load("ffn-nvidia-h100-80gb-hbm3.json")
    if d is None:
        return ""
    lines = ["### Fused FFN, decode regime (bf16, `scripts/gpu_ffn.py`): the kernel before its staggered "
             "loops and PDL cast (now 122.7 / 123.9 / 132.5 µs at M = 1 / 4 / 16: docs/mlp.md, "
             "`tune-ffn-decode-atomics-h100-run2.json`)", "", _header(d) +
             " Both timed as CUDA-graph replays of 10 calls in the same run; TB/s = weight bytes / time.", "",
             "| FFN | M | weights MB | flashflow µs | TB/s | torch+graph µs | TB/s | speedup |",
             "|:--|--:|--:|--:|--:|--:|--:|--:|"]
    for r in d["bench"]:
        lines.append(f"| {r['model']} | {r['M']} | {r['weight_mbytes']:.0f} | {r['flashflow_us']:.1f} | "
                     f"{r['flashflow_tbs']:.2f} | {r['torch_graph_us']:.1f} | {r['torch_tbs']:.2f} | "
                     f"{r['speedup_vs_torch']:.2f}× |")
    ok = sum(c["ok"] for c in d["checks"])
    lines += ["", f"Correctness on the GPU: {ok}/{len(d['checks'])} checks within 1e-2 of float64 "
              "(every activation, bf16/fp16, odd shapes, 100 back-to-back runs, 100 graph replays)."]
    return "\n".join(lines) + "\n"


def paged_section() -> str:
    after, before = _load("tune-decode-paged-h100.json"), _load("tune-decode-paged-h100-before.json")
    if after is None or before is None:
        return ""
    old = {tuple(r["shape"]): r for r in before["rows"]}
    lines = ["### Decode, paged vs contiguous after the scalar page lookup (`scripts/tune_decode_paged.py`)", "",
             _header(after) + " 64-token pages, shuffled block tables, cold L2, CUDA graphs; each ratio "
             "against contiguous measured in the same run (the two runs are separate).", "",
             "| batch | seqlen | heads / kv heads | contiguous TB/s (after's run) | paged before | ÷ contiguous | paged after "
             "| ÷ contiguous |", "|--:|--:|:--|--:|--:|--:|--:|--:|"]
    for r in after["rows"]:
        b, sq, h, hk = r["shape"]
        o = old.get(tuple(r["shape"]))
        ob = f"{o['tbs']['paged']:.3f} | {o['paged_over_contig']:.3f}" if o else " | "
        lines.append(f"| {b} | {sq} | {h}/{hk} | {r['tbs']['contig']:.3f} | {ob} | {r['tbs']['paged']:.3f} "
                     f"| {r['paged_over_contig']:.3f} |")
    return "\n".join(lines) + "\n"


def mlp_section() -> str:
    from flashflow.bench import mlp_suite

    d = _load("mlp-nvidia-h100-80gb-hbm3.json")
    if d is None or not d.get("rows"):
        return ""
    spec = importlib.util.spec_from_file_location("mncu", ROOT / "scripts" / "mlp_ncu_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = ["### Fused FFN, every policy and baseline (bf16, `flashflow bench --suite mlp`)", "",
           _header(d) + " µs are medians of CUDA-graph replays (10 calls per graph up to M = 256, 2 "
           "above); \"÷ torch\" is torch + CUDA graph's time over ours (> 1: ours faster).", "",
           mlp_suite.markdown_table(d, "us"), ""]
    checks, stress = d.get("checks", []), d.get("stress", [])
    if checks:
        out += [f"Correctness on the GPU in the same session: {sum(c['ok'] for c in checks)}/{len(checks)} "
                f"checks within 1e-2 of float64; {sum(s['ok'] for s in stress)}/{len(stress)} stress cases "
                "(100 back-to-back calls and 100 graph replays each, every output checked, workspace zero "
                "afterwards).", ""]
    if d.get("ncu"):
        out += ["DRAM bytes of one call (Nsight Compute, Llama-3-8B), beside the dataflow model's "
                "prediction for the kernel's own tiles and ticket order (`scripts/mlp_ncu_model.py`). "
                "ncu flushes the L2 before each kernel, so the multi-kernel baselines re-read their "
                "intermediate from DRAM.", "", mod.table(d["ncu"]), "",
                "Ranking by read bytes: " + "; ".join(mod.rank_check(d["ncu"])) + ".", ""]
    return "\n".join(out)


def render() -> str:
    parts = [attention_section(), decode_section(), paged_section(), ffn_section(), mlp_section(), info_section(),
             validation_section()]
    return "\n".join(p for p in parts if p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", default=None)
    args = ap.parse_args()
    body = render()
    if not args.write:
        print(body)
        return
    path = Path(args.write)
    text = path.read_text()
    start, end = "<!-- GENERATED -->", "<!-- /GENERATED -->"
    i, j = text.index(start) + len(start), text.index(end)
    path.write_text(text[:i] + "\n" + body + "\n" + text[j:])


if __name__ == "__main__":
    main()
