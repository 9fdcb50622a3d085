"""The measured tables of the docs, rendered from the JSON under ``bench/results/``.

``flashflow bench --tables`` prints them; ``--write FILE ...`` replaces, in each file, the block
after every marker line it has: ``<!-- GENERATED -->`` (every table, docs/results.md) and
``<!-- MEMORY_TABLE -->`` (the memory table, docs/tutorial.md), each up to its closing
``<!-- /NAME -->`` (added on the first write). The prose around the blocks is kept.
"""
from __future__ import annotations

import json
from pathlib import Path

from flashflow.bench import timing

DEVICE = "nvidia-h100-80gb-hbm3"   # the device whose results the docs show
OFFLINE = "offline-sm90"           # `flashflow info --offline --family sm90`


def _load(results: Path, suite: str, device: str):
    path = Path(results) / f"{suite}-{device}.json"
    return (json.loads(path.read_text()), path.name) if path.exists() else (None, path.name)


def _header(d: dict, name: str) -> str:
    """Where a result was measured, its file, and the timing discipline that made its numbers."""
    how = timing.describe(d)
    return (f"{d.get('device')}, torch {d.get('torch')}, triton {d.get('triton')} (`bench/results/{name}`)."
            + (f" {how}" if how else ""))


def accuracy_table(rows: list[dict]) -> str:
    """Per shape and provider, the cosine and relative L1 error of its output against exact
    attention (the ``cosine`` / ``rel_l1`` keys :func:`flashflow.bench.suites.measure` adds), as
    Markdown; "" when no row has them (results written before they were measured)."""
    providers = list(dict.fromkeys(p for row in rows for p, res in row["results"].items() if "cosine" in res))
    if not providers:
        return ""
    head = ["shape", "b", "h", "sq", "sk", "d", "causal"]
    for p in providers:
        head += [f"{p} cosine", f"{p} rel L1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":--"] + ["--:"] * (len(head) - 1)) + "|"]
    for row in rows:
        s = row["shape"]
        cells = [s["name"], str(s["batch"]), str(s["heads"]), str(s["seqlen_q"]), str(s["seqlen_k"]),
                 str(s["head_dim"]), "yes" if s["causal"] else "no"]
        for p in providers:
            res = row["results"].get(p, {})
            cos, l1 = res.get("cosine"), res.get("rel_l1")
            cells += ["-" if cos is None else f"{cos:.6f}", "-" if l1 is None else f"{l1:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def attention_section(results, device=DEVICE) -> str:
    from flashflow.bench import runner

    d, name = _load(results, "attention", device)
    if d is None:
        return ""
    text = (f"### Prefill / diffusion attention forward ({d['dtype']}, `flashflow bench`)\n\n" + _header(d, name)
            + " Ratios are flashflow's TF/s over the anchor's in the "
            "same run; causal TF/s count half the FLOPs.\n\n" + runner.markdown_table(d["rows"]) + "\n")
    accuracy = accuracy_table(d["rows"])
    if accuracy:
        text += ("\nAccuracy of each provider's output against exact attention in float64 on the same inputs: "
                 "cosine similarity, and relative L1 error Σ|out − exact| / Σ|exact|.\n\n" + accuracy + "\n")
    return text


def decode_section(results, device=DEVICE) -> str:
    from flashflow.bench.decode import markdown_table

    d, name = _load(results, "decode", device)
    if d is None:
        return ""
    return (f"### Decode attention ({d['dtype']}, one query token, head_dim 128, `flashflow bench --suite decode`)"
            f"\n\n{_header(d, name)}\n\n{markdown_table(d)}\n")


def mlp_section(results, device=DEVICE) -> str:
    from flashflow.bench import mlp_suite

    d, name = _load(results, "mlp", device)
    if d is None or not d.get("rows"):
        return ""
    out = [f"### Fused FFN, every policy and baseline ({d['dtype']}, `flashflow bench --suite mlp`)", "",
           _header(d, name) + " µs are medians of CUDA-graph replays (10 calls per graph up to M = 256, 2 "
           "above); \"÷ torch\" is torch + CUDA graph's time over ours (> 1: ours faster).", "",
           mlp_suite.markdown_table(d, "us"), ""]
    checks, stress = d.get("checks", []), d.get("stress", [])
    if checks:
        out += [f"Correctness on the GPU: {sum(c['ok'] for c in checks)}/{len(checks)} checks within 1e-2 "
                f"of float64; {sum(s['ok'] for s in stress)}/{len(stress)} stress cases (100 back-to-back "
                "calls and 100 graph replays each, every output checked, workspace zero afterwards).", ""]
    if d.get("ncu"):
        # the stored predictions, where the file has them: the model takes half a minute per file
        rows = d["ncu"] if all("model_partitioned" in r for r in d["ncu"] if "read_bytes" in r
                               and r.get("provider") not in ("two-kernels", "two-streams", mlp_suite.ANCHOR)) \
            else mlp_suite.ncu_predictions(d["ncu"])
        out += ["DRAM bytes of one call (Nsight Compute, Llama-3-8B), beside the dataflow model's "
                "prediction for the kernel's own tiles and ticket order "
                "(`flashflow.bench.mlp_suite.ncu_predictions`). ncu flushes the L2 before each kernel, so "
                "the multi-kernel baselines re-read their intermediate from DRAM.", "",
                mlp_suite.ncu_table(rows), "",
                "Ranking by read bytes: " + "; ".join(mlp_suite.ncu_rank_check(rows)) + ".", ""]
    return "\n".join(out)


def fp8_linear_section(results, device=DEVICE) -> str:
    from flashflow.bench import fp8_linear_suite

    d, name = _load(results, "fp8-linear", device)
    if d is None or not d.get("rows"):
        return ""
    return (f"### FP8 linear at a Qwen-Image block's GEMM shapes ({d['dtype']}, `flashflow bench --suite fp8-linear`)"
            f"\n\n{_header(d, name)}\n\n{fp8_linear_suite.tables(d)}\n")


def memory_section(results, device=DEVICE, heading: bool = True) -> str:
    from flashflow.bench import memory

    d, name = _load(results, "memory", device)
    if d is None:
        return ""
    if not heading:   # the tutorial's table
        return memory.caption(d) + "\n\n" + memory.markdown_table(d["rows"]) + "\n"
    return ("### Peak memory, naive attention vs flashflow (`flashflow bench --suite memory`)\n\n"
            + memory.caption(d) + f" (`bench/results/{name}`)\n\n" + memory.markdown_table(d["rows"]) + "\n")


def info_section(results, device=OFFLINE) -> str:
    d, name = _load(results, "info", device)
    if d is None:
        return ""
    lines = ["### Registers, spills and shared memory of every op's shipped configs (`flashflow info --offline`)",
             "",
             f"Compiled for sm90 by ptxas (triton {d.get('triton')}; nothing run; `bench/results/{name}`). "
             "For the attention configs these are the figures the H100 itself reported "
             f"(`bench/results/info-{DEVICE}.json`, compared row by row in tests/bench/test_offline.py).", "",
             "| op | case | kernel | warps | stages | regs | spills | smem B |",
             "|:--|:--|:--|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        case = r.get("case")
        if r["op"] == "attention":
            case = (f"d ≤ {r['head_dim_max']}{' causal' if r['causal'] else ''} {r['variant']}, "
                    f"{r['BLOCK_M']}×{r['BLOCK_N']}")
        lines.append(f"| {r['op']} | {case} | {r.get('kernel')} | {r.get('num_warps')} | {r.get('num_stages')} | "
                     f"{r.get('n_regs')} | {r.get('n_spills')} | {r.get('shared')} |")
    return "\n".join(lines) + "\n"


def dataflow_section(results, device=DEVICE) -> str:
    from flashflow.bench.dataflow import markdown_table

    d, name = _load(results, "dataflow", device)
    if d is None:
        return ""
    return ("### Dataflow model vs measured DRAM bytes (Nsight Compute, `flashflow bench --suite dataflow`)\n\n"
            + _header(d, name) + "\n\n" + markdown_table(d["results"]) + "\n")


SECTIONS = (attention_section, decode_section, mlp_section, fp8_linear_section, memory_section, info_section,
            dataflow_section)


def render(results="bench/results") -> str:
    """Every table whose JSON is in ``results``, as docs/results.md shows them."""
    return "\n".join(p for p in (section(results) for section in SECTIONS) if p)


def blocks(results="bench/results") -> dict:
    """Marker name -> a callable rendering what goes after the marker."""
    return {"GENERATED": lambda: render(results),
            "MEMORY_TABLE": lambda: memory_section(results, heading=False)}


def replace_block(text: str, name: str, block: str) -> str:
    """Put ``block`` after the ``<!-- NAME -->`` line and drop what an earlier write put there
    (up to ``<!-- /NAME -->``); the markers stay, so the command can be run again."""
    marker, end_marker = f"<!-- {name} -->", f"<!-- /{name} -->"
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.strip() == marker]
    if not starts:
        raise ValueError(f"no line reading {marker} found")
    start = end = starts[0]
    for j in range(start + 1, len(lines)):
        if lines[j].strip() == marker:
            break
        if lines[j].strip() == end_marker:
            end = j
            break
    new = [marker, block.strip("\n"), "", end_marker]  # blank line: a table ends before the comment
    return "\n".join(lines[:start] + new + lines[end + 1:])


def write(path, results="bench/results") -> list[str]:
    """Replace every known block ``path`` has a marker for; returns the names replaced."""
    path = Path(path)
    text = path.read_text()
    done = []
    for name, make in blocks(results).items():
        if f"<!-- {name} -->" in {line.strip() for line in text.split("\n")}:
            block = make()
            if not block:
                raise ValueError(f"{path} has a <!-- {name} --> block but {results} has no result for it")
            text = replace_block(text, name, block)
            done.append(name)
    if not done:
        raise ValueError(f"{path} has none of the marker lines " +
                         ", ".join(f"<!-- {n} -->" for n in blocks(results)))
    path.write_text(text)
    return done
