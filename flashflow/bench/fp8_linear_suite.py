"""`flashflow bench --suite fp8-linear`: the FP8 linear layer (:mod:`flashflow.ops.fp8_linear`)
against cuBLAS in bf16 at the GEMM shapes of a Qwen-Image block, with its accuracy.

Shapes ``(M, K, N)`` (:data:`SHAPES`; width 3072, 24 heads of 128, MLP 4 × 3072): the image
stream of Qwen-Image-Edit at 1024px (the image and its reference, 8192 tokens) through the fused
q/k/v (N = 9216), the attention's output projection, the MLP's up and down projections; the
text stream's 256 tokens through q/k/v and the MLP; the AdaLN modulation (one row per image,
3072 → 6 × 3072). ``--quick``: :data:`QUICK_SHAPES`. bf16, every layer with its bias.

Providers, on the same tensors in one run:
  * ``bf16`` — the anchor: ``F.linear(x, w, b)`` (cuBLAS);
  * ``fp8 gemm (fp32 promote)``, ``fp8 gemm (fast_accum)`` — the GEMM alone on inputs quantized
    beforehand, as flashflow runs it (``torch._scaled_mm`` with row-wise scales and the bias in
    its epilogue, the arguments of ``flashflow.ops.fp8_linear``'s GEMM) with ``use_fast_accum``
    False and True: the two values of the op's config (flashflow/tuning/fp8_linear.json); the
    result says which one ships;
  * ``fp8_linear`` — :func:`flashflow.ops.fp8_linear.fp8_linear` from the bf16 x: the row
    quantization (one pass over x) and the GEMM;
  * ``torchao`` — where torchao is installed: a one-layer ``nn.Linear`` after
    ``quantize_(module, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))``, eager
    (the same recipe: per-row activation and per-channel weight scales, e4m3; torchao's own
    GEMM settings); without torchao it is left out and the result notes why;
  * ``quantize_rows``, ``gelu_quantize_rows`` — the row-quantize passes alone on x
    (:mod:`flashflow.ops.quant`): what ``fp8_linear`` adds to the GEMM, and what the GELU pass
    costs in front of the MLP's down projection.

Timing ``rounds`` of ``warm`` (:mod:`flashflow.bench.timing`): per shape, every provider's
``triton.testing.do_bench`` median in :data:`ROUNDS` interleaved rounds, the order rotated each
round, the median round kept. Metrics: µs; the GEMMs' TFLOP/s (2·M·K·N) and speed-up over bf16
(bf16's time ÷ theirs, > 1: faster); the quantize passes' TB/s (read 2·M·K, write M·K + 4·M).

Accuracy, after a shape's timing, on inputs shaped like a block's activations (Gaussian with
outlier channels ×20 and a random offset per row; weight channels of two ranges): each GEMM
provider's output against the exact ``x · Wᵀ + b`` in float64 on the same bf16 inputs, over
:data:`ACCURACY_ROWS` rows spread over M: cosine, relative L1 and L2 error
(:mod:`flashflow.reference.metrics`).

Writes ``fp8-linear-<device>.json``. Needs a GPU with FP8 tensor cores (Hopper, sm90, or newer).
"""
from __future__ import annotations

import importlib.util
import statistics
import sys
from datetime import datetime, timezone

import torch

from flashflow.bench import timing

# (layer, M, K, N)
SHAPES = (("image q/k/v (fused)", 8192, 3072, 9216), ("image out proj", 8192, 3072, 3072),
          ("image mlp up", 8192, 3072, 12288), ("image mlp down", 8192, 12288, 3072),
          ("text q/k/v (fused)", 256, 3072, 9216), ("text mlp up", 256, 3072, 12288),
          ("text mlp down", 256, 12288, 3072), ("adaLN modulation", 1, 3072, 18432))
QUICK_SHAPES = (SHAPES[0], SHAPES[3], SHAPES[6], SHAPES[7])

ANCHOR = "bf16"
GEMM_PROMOTE = "fp8 gemm (fp32 promote)"
GEMM_FAST = "fp8 gemm (fast_accum)"
LINEAR = "fp8_linear"
TORCHAO = "torchao"
QUANTIZE = "quantize_rows"
GELU_QUANTIZE = "gelu_quantize_rows"
# providers whose work is the GEMM (TFLOP/s, speed-up over bf16, accuracy) and the passes (TB/s)
GEMMS = (ANCHOR, GEMM_PROMOTE, GEMM_FAST, LINEAR, TORCHAO)
PASSES = (QUANTIZE, GELU_QUANTIZE)
PROVIDERS = GEMMS + PASSES
FAST_ACCUM = {GEMM_PROMOTE: False, GEMM_FAST: True}

ROUNDS = 3
# do_bench's warm-up and measuring time per measurement, ms: a shape's slowest GEMM takes about
# a millisecond, so 50 ms are some fifty calls, and the whole suite runs in about a minute
WARMUP_MS, REP_MS = 10, 50
ACCURACY_ROWS = 256
ACCURACY_AGAINST = "x · Wᵀ + b in float64 on the same bf16 inputs"
INPUTS = ("x: Gaussian, every 97th channel ×20, plus a Gaussian offset per row; w: Gaussian / √K, "
          "every 5th output channel ×4; b: Gaussian")
NO_TORCHAO = "torchao is not installed: no torchao provider"


def gemm_flops(m: int, k: int, n: int) -> float:
    return 2.0 * m * k * n


def quantize_bytes(m: int, k: int) -> int:
    """Bytes a row-quantize pass moves: x read in bf16, e4m3 values and a float32 scale per row
    written."""
    return 2 * m * k + m * k + 4 * m


def make_inputs(m: int, k: int, n: int, device="cuda", seed: int = 0):
    """``(x (M, K), w (N, K), b (N,))`` in bf16 (:data:`INPUTS`), drawn in float32 from a seeded
    generator on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=g)
    x[:, ::97] *= 20.0                                        # outlier channels
    x += torch.randn(m, 1, device=device, generator=g)        # an offset per row
    w = torch.randn(n, k, device=device, generator=g) * k ** -0.5
    w[::5] *= 4.0                                             # channels of two ranges
    b = torch.randn(n, device=device, generator=g)
    return x.to(torch.bfloat16), w.to(torch.bfloat16), b.to(torch.bfloat16)


def scaled_gemm(a, scale_a, w, scale_w, bias, fast_accum: bool):
    """The FP8 GEMM as :mod:`flashflow.ops.fp8_linear` calls it (same arguments), with
    ``use_fast_accum`` chosen here instead of by the op's config."""
    return torch._scaled_mm(a, w.t(), scale_a=scale_a, scale_b=scale_w, bias=bias, out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def torchao_linear(w, b):
    """A one-layer ``nn.Linear`` holding ``w`` and ``b``, quantized by torchao's per-row FP8
    recipe (dynamic e4m3 activations per row, e4m3 weights per output channel)."""
    from torch import nn
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    n, k = w.shape
    layer = nn.Linear(k, n, bias=b is not None, device=w.device, dtype=w.dtype).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(w)
        if b is not None:
            layer.bias.copy_(b)
    quantize_(layer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return layer


def make_providers(x, w, b, names=PROVIDERS) -> dict:
    """name -> zero-argument callable on these tensors (``x (M, K)``, ``w (N, K)``, ``b (N,)``,
    bf16), for the ``names`` asked for; ``torchao`` only where it is installed. The weights are
    quantized here, once, as a model's are."""
    import torch.nn.functional as F

    from flashflow.ops.fp8_linear import fp8_linear, quantize_weight
    from flashflow.ops.quant import gelu_quantize_rows, quantize_rows

    m, k = x.shape
    weight = quantize_weight(w)
    rows = quantize_rows(x)
    a, scale_a = rows.data, rows.scale.reshape(m, 1)
    table = {
        ANCHOR: lambda: F.linear(x, w, b),
        LINEAR: lambda: fp8_linear(x, weight, b),
        QUANTIZE: lambda: quantize_rows(x),
        GELU_QUANTIZE: lambda: gelu_quantize_rows(x),
    }
    for name, fast in FAST_ACCUM.items():
        table[name] = lambda fast=fast: scaled_gemm(a, scale_a, weight.data, weight.scale, b, fast)
    out = {}
    for name in names:
        if name != TORCHAO:
            out[name] = table[name]
        elif torchao_available():
            try:
                layer = torchao_linear(w, b)
            except Exception as e:  # noqa: BLE001 — a torchao that does not take this torch: its entry
                out[name] = _raises(e)
            else:
                out[name] = lambda: _inference(layer, x)
    return out


def _inference(layer, x):
    with torch.no_grad():
        return layer(x)


def _raises(error: Exception):
    def call():
        raise error
    return call


def accuracy(outputs: dict, x, w, b, count: int = ACCURACY_ROWS) -> dict:
    """Per output ``(M, N)``: cosine, rel L1 and rel L2 against the exact float64 ``x · Wᵀ + b``
    over ``count`` rows spread over M (all of a smaller M)."""
    from flashflow.reference.metrics import cosine, rel_l1, rel_l2

    m = x.shape[0]
    rows = (torch.arange(m, device=x.device) if m <= count else
            torch.linspace(0, m - 1, count, device=x.device).round().long())
    exact = x[rows].double() @ w.double().T + b.double()
    return {name: {"cosine": cosine(out[rows], exact), "rel_l1": rel_l1(out[rows], exact),
                   "rel_l2": rel_l2(out[rows], exact)} for name, out in outputs.items()}


def warm_timer(warmup: int, rep: int):
    return lambda fn: timing.warm_ms(fn, warmup, rep, first_call=False)


def summarize(row: dict, times: dict) -> None:
    """Fills ``row["results"]`` from ``times`` (provider -> ms of each round): the median round in
    µs, each round, TFLOP/s for a GEMM and TB/s for a quantize pass, the GEMMs' speed-up over
    bf16 (bf16's µs ÷ theirs)."""
    m, k, n = row["M"], row["K"], row["N"]
    for name, samples in times.items():
        ms = statistics.median(samples)
        res = row["results"].setdefault(name, {})
        res.update(us=ms * 1e3, rounds_us=[t * 1e3 for t in samples])
        if name in PASSES:
            res["tbs"] = quantize_bytes(m, k) / (ms * 1e-3) / 1e12
        else:
            res["tflops"] = gemm_flops(m, k, n) / (ms * 1e-3) / 1e12
    anchor = row["results"].get(ANCHOR, {}).get("us")
    for name, res in row["results"].items():
        if name in GEMMS and name != ANCHOR and anchor and res.get("us"):
            res["vs_bf16"] = anchor / res["us"]


def bench_case(layer: str, m: int, k: int, n: int, providers=PROVIDERS, timer=None, rounds: int = ROUNDS,
               device="cuda", after_each=None) -> dict:
    """One shape's row: every provider's times (``timer(fn)`` -> ms, default ``warm`` with the
    suite's defaults; :data:`ROUNDS` interleaved rounds), metrics and the GEMMs' accuracy."""
    timer = timer or warm_timer(WARMUP_MS, REP_MS)
    x, w, b = make_inputs(m, k, n, device)
    row = {"layer": layer, "M": m, "K": k, "N": n, "gflop": gemm_flops(m, k, n) / 1e9,
           "quantize_mbytes": quantize_bytes(m, k) / 1e6, "results": {}}
    fns = {}
    try:
        provs = make_providers(x, w, b, providers)
    except Exception as e:  # noqa: BLE001 — the weight or the input could not be quantized
        for name in providers:
            row["results"][name] = {"error": timing.short_error(e)}
        return row
    outputs = {}
    for name, fn in provs.items():
        try:
            out = fn()   # compiles and warms outside the timed calls; raises for what cannot run
            if x.is_cuda:
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 — keep the other providers' numbers
            row["results"][name] = {"error": timing.short_error(e)}
            continue
        fns[name] = fn
        row["results"][name] = {}
        if name in GEMMS:
            outputs[name] = out
    times, errors = timing.rounds(fns, timer, rounds, after_each=after_each)
    for name, error in errors.items():
        row["results"][name]["error"] = error
        del times[name]
    summarize(row, times)
    try:
        row["accuracy"] = accuracy({p: o for p, o in outputs.items() if p not in errors}, x, w, b)
    except Exception as e:  # noqa: BLE001 — the timings stand without it
        row["accuracy"], row["accuracy_error"] = {}, timing.short_error(e)
    return row


def check_args(args) -> str | None:
    """The problem with the suite's options, or None (then ``args.providers`` is a list). Runs
    before the GPU is looked for, so a typo is reported on any machine."""
    from flashflow.bench.runner import check_timing_and_providers

    return check_timing_and_providers(args, PROVIDERS, "fp8-linear")


def run_bench(shapes=SHAPES, providers=PROVIDERS, warmup: int = WARMUP_MS, rep: int = REP_MS, quick: bool = False,
              progress: bool = True, device="cuda", timer=None) -> dict:
    """The result of the whole suite: the environment, how it was timed, one row per shape
    (:func:`bench_case`). ``timer`` (default ``warm`` with ``warmup`` and ``rep``) and ``device``
    are the tests' to change."""
    from flashflow.bench import runner
    from flashflow.device import gpu_family
    from flashflow.progress import progress as Progress
    from flashflow.tuning.fp8_linear import fp8_linear_config

    started = datetime.now(timezone.utc)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torchao = TORCHAO in providers and torchao_available()
    timed = [p for p in providers if p != TORCHAO or torchao]
    result = {"suite": "fp8-linear", **runner.environment(started), "dtype": "bf16", "quick": quick,
              "providers": list(providers), "anchor": ANCHOR,
              "shipped_fast_accum": fp8_linear_config(gpu_family(device)).fast_accum,
              "timing": timing.record("rounds", of="warm", warmup_ms=warmup, rep_ms=rep, return_mode="median",
                                      rounds=ROUNDS),
              "accuracy": {"against": ACCURACY_AGAINST, "rows": ACCURACY_ROWS, "inputs": INPUTS,
                           "keys": ["cosine", "rel_l1", "rel_l2"]},
              "notes": [NO_TORCHAO] if TORCHAO in providers and not torchao else [], "rows": []}
    if torchao:
        import torchao as ao

        result["torchao"] = getattr(ao, "__version__", None)
    timer = timer or warm_timer(warmup, rep)
    bar = Progress(len(shapes) * len(timed) * ROUNDS, "bench fp8-linear", enabled=progress)
    try:
        for layer, m, k, n in shapes:
            bar.describe(f"{layer} M={m} K={k} N={n}")
            result["rows"].append(bench_case(layer, m, k, n, timed, timer, device=device, after_each=bar.update))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        bar.close()
    return result


# ---------------------------------------------------------------------------- tables


def _fmt(res, key: str, spec: str) -> str:
    if res is None:
        return ""
    if res.get("error"):
        return "err"
    v = res.get(key)
    return "" if v is None else format(v, spec)


def _shape_cells(r: dict) -> list[str]:
    return [r["layer"], str(r["M"]), str(r["K"]), str(r["N"])]


def _table(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join([":--", "--:", "--:", "--:"] + ["--:"] * (len(head) - 4)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body])


def _present(result: dict, names) -> list[str]:
    return [p for p in names if any(p in r["results"] for r in result["rows"])]


def gemm_table(result: dict) -> str:
    """One line per shape: each GEMM provider's µs and TFLOP/s, then every provider's speed-up
    over bf16."""
    provs = _present(result, GEMMS)
    head = ["layer", "M", "K", "N"] + [f"{p} {u}" for p in provs for u in ("µs", "TF/s")]
    head += [f"{p} ÷ bf16" for p in provs if p != ANCHOR]
    body = []
    for r in result["rows"]:
        res = r["results"]
        cells = _shape_cells(r)
        for p in provs:
            cells += [_fmt(res.get(p), "us", ".1f"), _fmt(res.get(p), "tflops", ".0f")]
        cells += [_fmt(res.get(p), "vs_bf16", ".2f") for p in provs if p != ANCHOR]
        body.append(cells)
    return _table(head, body)


def pass_table(result: dict) -> str:
    """One line per shape: each quantize pass's µs and TB/s, and its share of fp8_linear's time."""
    provs = _present(result, PASSES)
    head = ["layer", "M", "K", "N"] + [f"{p} {u}" for p in provs for u in ("µs", "TB/s")]
    head += ["quantize_rows ÷ fp8_linear"] if QUANTIZE in provs else []
    body = []
    for r in result["rows"]:
        res = r["results"]
        cells = _shape_cells(r)
        for p in provs:
            cells += [_fmt(res.get(p), "us", ".1f"), _fmt(res.get(p), "tbs", ".2f")]
        if QUANTIZE in provs:
            q, lin = res.get(QUANTIZE, {}).get("us"), res.get(LINEAR, {}).get("us")
            cells.append(f"{q / lin:.2f}" if q and lin else "")
        body.append(cells)
    return _table(head, body)


def accuracy_table(result: dict) -> str:
    """One line per shape: each GEMM provider's cosine and relative L1 / L2 error against the
    exact product."""
    provs = [p for p in GEMMS if any(p in r.get("accuracy", {}) for r in result["rows"])]
    head = ["layer", "M", "K", "N"] + [f"{p} {u}" for p in provs for u in ("cosine", "rel L1", "rel L2")]
    body = []
    for r in result["rows"]:
        acc = r.get("accuracy", {})
        cells = _shape_cells(r)
        for p in provs:
            a = acc.get(p)
            cells += ([f"{a['cosine']:.6f}", f"{a['rel_l1']:.2e}", f"{a['rel_l2']:.2e}"] if a
                      else ["", "", ""])
        body.append(cells)
    return _table(head, body)


def errors(result: dict) -> list[str]:
    return sorted({f"{p}: {v['error']}" for r in result["rows"] for p, v in r["results"].items() if v.get("error")})


def tables(result: dict) -> str:
    """The GEMMs, the quantize passes and the accuracy as Markdown, then notes and errors."""
    shipped = "fast_accum" if result.get("shipped_fast_accum") else "fp32 promote"
    acc = result.get("accuracy", {})
    parts = [f"fp8_linear ships `{shipped}`. '÷ bf16' is bf16's time over the provider's (> 1: faster).",
             gemm_table(result), "Row-quantize passes (bytes: read 2·M·K, write M·K + 4·M):", pass_table(result),
             f"Accuracy against {acc.get('against', ACCURACY_AGAINST)}, over {acc.get('rows', ACCURACY_ROWS)} "
             f"rows spread over M ({acc.get('inputs', INPUTS)}):", accuracy_table(result)]
    tail = [f"note: {n}" for n in result.get("notes", [])] + [f"error {e}" for e in errors(result)]
    if tail:
        parts.append("\n".join(tail))
    return "\n\n".join(parts)


def report(result: dict) -> str:
    """What ``flashflow bench --from-json`` prints of an fp8-linear result."""
    return (f"FP8 linear, {result.get('dtype', 'bf16')}, {result.get('device')}. {timing.describe(result)}\n\n"
            + tables(result))


def run(args) -> int:
    """Entry point of ``flashflow bench --suite fp8-linear`` (args: quick, warmup, rep, providers,
    out; :func:`check_args` has run and the CLI has found a GPU)."""
    from flashflow.bench import runner
    from flashflow.device import gpu_family

    device = torch.device("cuda", torch.cuda.current_device())
    if gpu_family(device) != "sm90":
        print(f"flashflow bench: error: --suite fp8-linear needs FP8 tensor cores with row-wise scaled GEMMs "
              f"(Hopper, sm90, or newer); {torch.cuda.get_device_name(device)} has none", file=sys.stderr)
        return 2
    if TORCHAO in args.providers and not torchao_available():
        print(f"note: {NO_TORCHAO}", file=sys.stderr, flush=True)
    result = run_bench(QUICK_SHAPES if args.quick else SHAPES, tuple(args.providers), args.warmup, args.rep,
                       args.quick)
    path = runner.write_result(result, args.out)
    print(f"results: {path}\n")
    print(report(result))
    return 0
