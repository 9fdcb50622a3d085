"""`flashflow bench --suite mlp`: the fused FFN against cuBLAS, every policy in one run.

FFNs (bf16 by default): Llama-3-8B (4096 → 14336, SwiGLU), Llama-3-70B (8192 → 28672, SwiGLU)
and a GPT-3-style 4096 → 14336 GELU FFN, at M = 1, 4, 16, 64, 256, 1024, 4096 tokens.

Providers, timed in the same run on the same tensors:
  * ``torch-graph`` — the anchor: ``F.linear``, the activation, ``F.linear`` (cuBLAS;
    :func:`flashflow.ops.mlp.launch_cublas`), captured in a CUDA graph;
  * ``flashflow`` — :func:`flashflow.ops.mlp.fused_mlp` with ``policy="auto"``;
  * ``splitk`` (M ≤ 64), ``sequential``, ``rowblock``, ``multirow``, ``halfrow`` — each policy
    forced;
  * ``two-kernels`` — GEMM0+act then GEMM1, two Triton launches (same tiles);
  * ``two-streams`` — CuSync-style producer/consumer kernels on two streams with flags.
Every provider is timed as CUDA-graph replays (a graph of ``steps`` back-to-back calls; the
median per call), so launch overheads are what a serving loop pays. Metrics: µs, TB/s of
weight bytes (the decode floor), TFLOP/s, and the ratio of torch-graph's time to ours (> 1:
ours faster). The read ceiling is measured in the same run (a large bf16 sum).
"""
from __future__ import annotations

import sys
from datetime import datetime, timezone

import torch

from flashflow.bench import timing

MODELS = (("llama3-8b", "swiglu", 4096, 14336), ("llama3-70b", "swiglu", 8192, 28672),
          ("gpt3-4096x14336-gelu", "gelu", 4096, 14336))
TOKENS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
QUICK_TOKENS = (1, 16, 64, 1024)
ANCHOR = "torch-graph"
PROVIDERS = (ANCHOR, "flashflow", "splitk", "sequential", "rowblock", "multirow", "halfrow",
             "seqsplit", "cublas", "two-kernels", "two-streams")
POLICY_PROVIDERS = ("splitk", "sequential", "rowblock", "multirow", "halfrow", "seqsplit", "cublas")


def weight_bytes(activation: str, hidden: int, inter: int, elt: int = 2) -> int:
    rows = 2 * inter if activation == "swiglu" else inter
    return (rows * hidden + hidden * inter) * elt


def ffn_flops(m: int, activation: str, hidden: int, inter: int) -> float:
    return 2.0 * m * weight_bytes(activation, hidden, inter, 1)


def make_inputs(activation, hidden, inter, m, dtype, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    rows = 2 * inter if activation == "swiglu" else inter
    x = torch.randn(m, hidden, device=device, dtype=dtype, generator=g)
    w1 = torch.randn(rows, hidden, device=device, dtype=dtype, generator=g) / hidden ** 0.5
    w2 = torch.randn(hidden, inter, device=device, dtype=dtype, generator=g) / inter ** 0.5
    return x, w1, w2


def make_providers(x, w1, w2, activation, names=PROVIDERS) -> dict:
    """name -> zero-argument callable; providers that do not apply to this M are left out."""
    from flashflow.ops import mlp

    m, hidden = x.shape
    ws = mlp.MlpWorkspace(hidden, max_tokens=max(m, 1), device=x.device)
    table = {
        ANCHOR: lambda: mlp.launch_cublas(x, w1, w2, activation),
        "flashflow": lambda: mlp.fused_mlp(x, w1, w2, activation, "auto", workspace=ws),
        "two-kernels": lambda: mlp.mlp_two_kernels(x, w1, w2, activation),
        "two-streams": lambda: mlp.mlp_two_streams(x, w1, w2, activation, workspace=ws),
    }
    for p in POLICY_PROVIDERS:
        if p == "splitk" and m > mlp.DECODE_MAX_M:
            continue
        table[p] = (lambda p=p: mlp.fused_mlp(x, w1, w2, activation, p, workspace=ws))
    return {n: table[n] for n in names if n in table}


def model_traffic(activation: str, hidden: int, inter: int, m: int, policy: str,
                  family: str = "sm90", sms: int = 132, hw=None, dtype: str = "bfloat16") -> dict:
    """DRAM bytes the dataflow model predicts for one call of the persistent kernel: the tiles
    ``family`` ships for it (:func:`flashflow.tuning.mlp.persistent_config`) in its own ticket
    order (:func:`flashflow.ops.mlp.issue_order`, the kernels' own; ``"auto"`` as it resolves on ``sms`` SMs),
    replayed through ``hw``'s L2 (default: the partitioned H100 model,
    :data:`flashflow.dataflow.model.H100_PARTITIONED`)."""
    from flashflow.dataflow.chain import FfnShape, simulate_tickets
    from flashflow.dataflow.model import H100_PARTITIONED
    from flashflow.ops import mlp
    from flashflow.tuning import mlp as tuning

    gated = activation == "swiglu"
    cfg = tuning.persistent_config(family, gated, m, dtype)
    name, rows = mlp.parse_policy(policy)
    if name == "auto":
        name, rows = mlp.parse_policy(tuning.auto_plan(family, gated, m, inter, sms))
    if name in ("splitk", "cublas"):
        raise ValueError(f"the traffic model covers the persistent kernel, and {policy!r} runs {name} at M={m}")
    s = FfnShape(m, hidden, inter, cfg.BLOCK_M, cfg.BLOCK_N0, cfg.BLOCK_K, 2, gated, block_n1=cfg.BLOCK_N1)
    order = mlp.issue_order(name, s.row_blocks, s.tiles_n0, s.tiles_n1, rows)
    r = simulate_tickets(s, order, hw or H100_PARTITIONED)
    if r.deadlocked:
        return {"policy": f"{name}:{rows}", "error": r.error}
    return {"policy": f"{name}:{rows}", "read_bytes": r.traffic.read_bytes,
            "write_bytes": r.traffic.write_bytes, "makespan_ksteps": r.traffic.makespan}


def steps_for(m: int) -> int:
    return 10 if m <= 256 else 2


ROUNDS = 3
MIN_REPLAYS = 20


def bench_case(model, activation, hidden, inter, m, dtype, providers=PROVIDERS, warmup=5, rep=20,
               rounds=ROUNDS) -> dict:
    """One (FFN, M) row: every provider's µs, TB/s, TFLOP/s, ratio to the anchor, error.

    Each provider's calls are captured in one CUDA graph; the graphs are then timed in ``rounds``
    interleaved rounds (:mod:`flashflow.bench.timing`'s ``rounds`` of ``graph``), each round in a rotated order, and a provider's time is the median over
    its rounds. The H100's clock follows its temperature: one provider timed right after a hot
    one is slower, and a fixed order would charge that to whoever comes last. A measurement runs
    for at least ``rep`` ms and ``MIN_REPLAYS`` replays (a 4096-token step takes milliseconds)."""
    x, w1, w2 = make_inputs(activation, hidden, inter, m, dtype)
    provs = make_providers(x, w1, w2, activation, providers)
    wbytes = weight_bytes(activation, hidden, inter, x.element_size())
    flops = ffn_flops(m, activation, hidden, inter)
    from flashflow.ops.mlp import launch_cublas

    ref = launch_cublas(x.float(), w1.float(), w2.float(), activation)
    row = {"model": model, "activation": activation, "hidden": hidden, "intermediate": inter, "M": m,
           "weight_mbytes": wbytes / 1e6, "gflop": flops / 1e9, "results": {}}
    steps = steps_for(m)
    graphs = {}
    for name, fn in provs.items():
        res = row["results"][name] = {}
        try:
            out = fn().float()
            torch.cuda.synchronize()
            res["rel_err"] = ((out - ref).norm() / ref.norm()).item()
            graphs[name], _ = timing.capture_graph(fn, steps)
        except Exception as e:  # noqa: BLE001 — keep the other providers' numbers
            res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    times, errors = timing.rounds(
        graphs, lambda g: timing.replay_ms(g, steps, warmup, rep, min_replays=MIN_REPLAYS), rounds)
    for name, error in errors.items():
        row["results"][name]["error"] = error
        del times[name]
    for name, ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        row["results"][name].update(us=ms * 1e3, tbs=wbytes / (ms * 1e-3) / 1e12,
                                    tflops=flops / (ms * 1e-3) / 1e12, rounds_us=[t * 1e3 for t in ts])
    anchor = row["results"].get(ANCHOR, {}).get("us")
    for res in row["results"].values():
        if anchor and res.get("us"):
            res["vs_torch"] = anchor / res["us"]
    del graphs, provs, x, w1, w2, ref
    torch.cuda.empty_cache()
    return row


def run_bench(quick=False, dtype=torch.bfloat16, warmup=5, rep=20, models=MODELS, tokens=None,
              providers=PROVIDERS, log=None) -> dict:
    from flashflow.bench import runner

    tokens = tokens or (QUICK_TOKENS if quick else TOKENS)
    started = datetime.now(timezone.utc)
    result = {"suite": "mlp", **runner.environment(started), "dtype": str(dtype).replace("torch.", ""),
              "quick": quick, "providers": list(providers), "anchor": ANCHOR,
              "timing": timing.record("rounds", of="graph", warmup_ms=warmup, rep_ms=rep, return_mode="median",
                                      rounds=ROUNDS, min_replays=MIN_REPLAYS,
                                      graph_steps={str(m): steps_for(m) for m in tokens}),
              "read_ceiling_tbs": timing.read_ceiling_tbs(), "rows": []}
    for model, act, hidden, inter in models:
        for m in tokens:
            row = bench_case(model, act, hidden, inter, m, dtype, providers, warmup, rep)
            result["rows"].append(row)
            if log:
                log(row)
    return result


def _cell(res: dict, key: str, spec: str) -> str:
    if res is None:
        return ""
    if res.get("error"):
        return "err"
    v = res.get(key)
    return "" if v is None else format(v, spec)


def markdown_table(result: dict, metric: str = "us") -> str:
    """One line per (FFN, M): each provider's µs (or TB/s, TFLOP/s), then ours ÷ torch."""
    rows = result["rows"]
    provs = [p for p in result["providers"] if any(p in r["results"] for r in rows)]
    spec = {"us": ".1f", "tbs": ".2f", "tflops": ".0f"}[metric]
    unit = {"us": "µs", "tbs": "TB/s", "tflops": "TFLOP/s"}[metric]
    head = ["FFN", "M"] + [f"{p} {unit}" for p in provs] + ["best", "best ÷ torch", "flashflow ÷ torch"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":--", "--:"] + ["--:"] * (len(head) - 2)) + "|"]
    for r in rows:
        res = r["results"]
        ours = {p: v for p, v in res.items() if p != ANCHOR and v.get("us")}
        best = min(ours, key=lambda p: ours[p]["us"]) if ours else None
        cells = [r["model"], str(r["M"])] + [_cell(res.get(p), metric, spec) for p in provs]
        cells += [best or "", f"{ours[best]['vs_torch']:.2f}" if best and ours[best].get("vs_torch") else "",
                  _cell(res.get("flashflow"), "vs_torch", ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compact_table(result: dict) -> str:
    """Plain text, narrow: per (FFN, M) the anchor, auto, and the best policy/baseline."""
    lines = [f"read ceiling {result['read_ceiling_tbs']:.2f} TB/s; times are medians of CUDA-graph replays",
             f"{'FFN':22} {'M':>5} {'torch µs':>9} {'TB/s':>5} {'auto µs':>8} {'TB/s':>5} {'TF/s':>5} "
             f"{'auto÷t':>6} {'best of ours':>13} {'µs':>8} {'best÷t':>6} {'err':>7}"]
    for r in result["rows"]:
        res = r["results"]
        t, a = res.get(ANCHOR, {}), res.get("flashflow", {})
        ours = {p: v for p, v in res.items() if p != ANCHOR and v.get("us")}
        best = min(ours, key=lambda p: ours[p]["us"]) if ours else ""
        b = ours.get(best, {})

        def f(d, k, s):
            return format(d[k], s) if d.get(k) is not None else "-"
        lines.append(f"{r['model']:22} {r['M']:>5} {f(t, 'us', '9.1f')} {f(t, 'tbs', '5.2f')} "
                     f"{f(a, 'us', '8.1f')} {f(a, 'tbs', '5.2f')} {f(a, 'tflops', '5.0f')} {f(a, 'vs_torch', '6.2f')} "
                     f"{best:>13} {f(b, 'us', '8.1f')} {f(b, 'vs_torch', '6.2f')} {f(a, 'rel_err', '7.1e')}")
    errors = sorted({f"{p}: {v['error']}" for r in result["rows"] for p, v in r["results"].items() if v.get("error")})
    return "\n".join(lines + [f"error {e}" for e in errors])


def report(result: dict) -> str:
    """What ``flashflow bench --from-json`` prints of an mlp result: µs, TB/s and TFLOP/s per
    provider, then the narrow summary."""
    return "\n\n".join([markdown_table(result, metric) for metric in ("us", "tbs", "tflops")]
                       + [compact_table(result)])


def run(args) -> int:
    """Entry point of ``flashflow bench --suite mlp`` (args: dtype, quick, warmup, rep, providers, out;
    the CLI has checked them and that a GPU is there)."""
    from flashflow.bench import runner

    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    total = len(MODELS) * len(QUICK_TOKENS if args.quick else TOKENS)
    done = []

    def log(row):
        done.append(row)
        print(f"[{len(done)}/{total}] {row['model']} M={row['M']}: " + ", ".join(
            f"{p} {v['us']:.1f}µs" if v.get("us") else f"{p} {v.get('error', '-')}"
            for p, v in row["results"].items()), file=sys.stderr, flush=True)

    print("measuring the read ceiling (a 2 GiB reduction)", file=sys.stderr, flush=True)
    result = run_bench(quick=args.quick, dtype=dtype, warmup=args.warmup, rep=args.rep,
                       providers=tuple(args.providers or PROVIDERS), log=log)
    path = runner.write_result(result, args.out)
    print(f"results: {path}\n")
    for metric in ("us", "tbs", "tflops"):
        print(markdown_table(result, metric) + "\n")
    print(compact_table(result))
    return 0


# ---------------------------------------------------------------- DRAM bytes: measured and modelled


def ncu_predictions(rows: list[dict]) -> list[dict]:
    """Measured DRAM bytes of one call per (M, provider) (Nsight Compute rows: ``M``,
    ``provider``, ``model``, ``read_bytes``, ``write_bytes``, ``launches``), each row of a
    persistent-kernel policy with what :func:`model_traffic` predicts for the kernel's own tiles
    and ticket order added: ``model_partitioned`` (the partitioned-L2 H100 model, which ranked
    measured GEMM orders correctly: docs/dataflow.md) and ``model_unified`` (one LRU). New dicts;
    ``rows`` is left as it is."""
    from flashflow.dataflow.model import H100, H100_PARTITIONED

    models = {"model_partitioned": H100_PARTITIONED, "model_unified": H100}
    specs = {name: (act, hidden, inter) for name, act, hidden, inter in MODELS}
    policies = set(POLICY_PROVIDERS) - {"splitk"} | {"flashflow"}
    cache: dict = {}
    out = []
    for row in rows:
        row = {k: v for k, v in row.items() if k not in models}
        if row.get("provider") in policies and row.get("model") in specs:
            act, hidden, inter = specs[row["model"]]
            policy = "auto" if row["provider"] == "flashflow" else row["provider"]
            for key, hw in models.items():
                args = (act, hidden, inter, row["M"], policy, key)
                if args not in cache:
                    cache[args] = model_traffic(act, hidden, inter, row["M"], policy, hw=hw)
                row[key] = cache[args]
        out.append(row)
    return out


def ncu_table(rows: list[dict]) -> str:
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


def ncu_rank_check(rows: list[dict]) -> list[str]:
    """Per M: the persistent policies ordered by measured read bytes, and each model's order."""
    out = []
    for m in sorted({r["M"] for r in rows}):
        pol = [r for r in rows if r["M"] == m and "read_bytes" in r and "model_partitioned" in r]
        measured = [r["provider"] for r in sorted(pol, key=lambda r: r["read_bytes"])]
        line = f"M={m}: measured {' < '.join(measured)}"
        for key in ("model_partitioned", "model_unified"):
            ranked = [r["provider"] for r in sorted(pol, key=lambda r: r[key].get("read_bytes", float("inf")))]
            line += f"; {key.removeprefix('model_')} {'same' if ranked == measured else ' < '.join(ranked)}"
        out.append(line)
    return out
