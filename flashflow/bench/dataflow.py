"""`flashflow bench --suite dataflow`: the dataflow model's DRAM traffic against Nsight Compute.

A Triton GEMM whose tile order is a parameter (:mod:`flashflow.kernels.gemm_order`): program id
``pid`` computes tile ``perm[pid]`` (linear index m * tiles_n + n), so any order the model knows
can run. For each shape × order:

1. the kernel runs once, is checked against torch.matmul, and timed (do_bench);
2. Nsight Compute measures its DRAM bytes: this module is started again under
   ``ncu --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum --csv``
   for one warm-up launch that compiles and one profiled launch (ncu's default cache control
   flushes L2 before the profiled launch, as the model assumes);
3. the model predicts the bytes with the GPU's parameters (SMs, L2; resident CTAs per SM from
   the compiled kernel's registers and shared memory), twice: the unified model (one LRU over
   the whole L2, lockstep waves; also under Belady) and the partitioned one
   (``model.H100_PARTITIONED``: two near partitions with home-based sharing, SM halves, slots
   drifting out of lockstep).

Both are approximations (equal tile times, in-order dispatch, no prefetch, sector or
compression effects): they rank orders and show their ratios, they do not match bytes.

Writes ``dataflow-<device>.json``; prints a Markdown table, then Spearman's rank correlation per
shape for both models and how many pairs of orders measured more than 10% apart each orders the
same way. Needs ncu on PATH (or /usr/local/cuda/bin/ncu); without it the measured columns stay
empty and the reason is printed.

On the CPU, from a result: ``flashflow bench --from-json FILE --rescore`` re-runs both models on
its measured points; ``--variants all`` scores every L2 model variant on them
(:func:`score_variants`: how H100_PARTITIONED was chosen, so its score there is in-sample).
"""
from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import triton

from flashflow.bench import timing
from flashflow.dataflow import orders as _orders
from flashflow.dataflow.bounds import compulsory_read_bytes
from flashflow.dataflow.model import H100, H100_PARTITIONED, Hardware, simulate, simulate_on
from flashflow.dataflow.shape import GemmShape
from flashflow.dataflow.stats import separated_pairs, spearman
from flashflow.ops.gemm_order import KERNEL_NAME, gemm_in_tile_order

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
# The first two shapes chose the partitioned model (in-sample); 16384x4096x4096 and
# grouped_m:4 were added after, so their rows test it out of sample. 16384x4096x4096 is the
# second shape transposed: the two models disagree on it (the unified one predicts compulsory
# traffic for row-major and grouped_m:8), and it shows whether A and B behave alike.
DEFAULT_SHAPES = ("8192x8192x8192", "4096x16384x4096", "16384x4096x4096")
DEFAULT_ORDERS = ("row_major", "column_major", "snake", "grouped_m:8", "cutlass_swizzle:8",
                  "hilbert", "grouped_m:4")
MODEL_NOTE = ("Both models are approximations (equal tile times, in-order dispatch; no "
              "prefetch, sectors or compression). Unified: one LRU over the whole L2, lockstep "
              "K-steps. Partitioned: two near partitions of half the L2 with home-based "
              "sharing, SMs split into halves, slots drifting out of lockstep. Compare ratios "
              "between orders, not exact bytes.")


# ---------------------------------------------------------------- CPU-testable helpers

def parse_shape(text: str) -> tuple[int, int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text.strip())
    if not match:
        raise ValueError(f"shape must look like 8192x8192x8192 (MxNxK), got {text!r}")
    return tuple(int(g) for g in match.groups())


def gemm_shape(mnk, block_m=128, block_n=128, block_k=64, elem_bytes=2) -> GemmShape:
    return GemmShape(*mnk, block_m, block_n, block_k, elem_bytes)


def order_permutation(spec: str, shape: GemmShape, device="cpu") -> torch.Tensor:
    """The ``perm`` tensor that makes the kernel run the named order."""
    order = _orders.make_order(spec, shape.tiles_m, shape.tiles_n)
    return torch.tensor(_orders.to_permutation(order, shape.tiles_n), dtype=torch.int32,
                        device=device)


def predict(shape: GemmShape, spec: str, hw: Hardware, policy: str = "lru") -> dict:
    """The model's bytes for this order on ``hw`` (slots = SMs × resident CTAs per SM, and
    the L2 partitions and drift ``hw`` asks for)."""
    order = _orders.make_order(spec, shape.tiles_m, shape.tiles_n)
    t = simulate_on(shape, order, hw, policy)
    return {"read_bytes": t.read_bytes, "write_bytes": t.write_bytes, "hit_rate": t.hit_rate}


def partitioned(hw: Hardware) -> Hardware:
    """The partitioned model (H100_PARTITIONED's rules) with this GPU's SMs, L2 and occupancy."""
    return dataclasses.replace(H100_PARTITIONED, num_sms=hw.num_sms, l2_bytes=hw.l2_bytes,
                               tiles_per_sm=hw.tiles_per_sm)


def rank_summary(results: list[dict]) -> list[dict]:
    """Per shape with measured bytes: Spearman's rho of each model against the measurement and
    the pairs (measured > 10% apart) it orders the same way."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in results):
        rows = [r for r in results if r["shape"] == shape and r.get("measured_read_bytes")]
        if len(rows) < 2:
            continue
        measured = [r["measured_read_bytes"] for r in rows]
        entry = {"shape": shape, "orders": len(rows)}
        for key in ("model_lru", "model_partitioned"):
            if all((r.get(key) or {}).get("read_bytes") is not None for r in rows):
                model = [r[key]["read_bytes"] for r in rows]
                right, total = separated_pairs(model, measured)
                entry[key] = {"spearman": spearman(model, measured), "pairs_right": right,
                              "pairs": total}
        out.append(entry)
    return out


def rank_lines(summary: list[dict]) -> str:
    names = {"model_lru": "unified LRU", "model_partitioned": "partitioned"}
    lines = []
    for e in summary:
        parts = [f"{names[k]} rho {e[k]['spearman']:.2f} ({e[k]['pairs_right']}/{e[k]['pairs']} "
                 f"pairs >10% apart)" for k in names if k in e]
        lines.append(f"- {e['shape']} ({e['orders']} orders): " + "; ".join(parts))
    return "\n".join(lines)


def occupancy(n_regs: int, shared_bytes: int, num_warps: int, max_shared: int,
              regs_per_sm: int = 65536, threads_per_sm: int = 2048, max_ctas: int = 32) -> int:
    """Resident CTAs per SM allowed by registers, shared memory and threads."""
    threads = num_warps * 32
    limits = [threads_per_sm // threads, max_ctas]
    if n_regs > 0:
        limits.append(regs_per_sm // (n_regs * threads))
    if shared_bytes > 0:
        limits.append(max_shared // shared_bytes)
    return max(1, min(limits))


_UNIT_SCALE = {"byte": 1, "bytes": 1, "b": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9,
               "tbyte": 1e12, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20,
               "gib": 2**30}


def _to_bytes(value: str, unit: str, metric: str) -> float:
    unit = (unit or "byte").strip().lower()
    if unit not in _UNIT_SCALE:
        raise ValueError(f"unknown unit {unit!r} for {metric}")
    return float((value or "nan").replace(",", "")) * _UNIT_SCALE[unit]


def parse_ncu_csv(text: str, kernel: str = KERNEL_NAME) -> dict[str, float]:
    """Metric name -> bytes, from ``ncu --csv`` output mixed with other lines (the program's
    own output, ==PROF== lines). Reads the default "details" page (one row per metric) and
    the wide "raw" page (one column per metric, units in the second row). If several
    launches of ``kernel`` were profiled, the last one wins."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header (a line starting with \"ID\") in the output")
    rows = list(csv.reader(io.StringIO("\n".join(
        line for line in lines[start:] if line.startswith('"')))))
    header, body = rows[0], rows[1:]
    out: dict[str, float] = {}
    if "Metric Name" in header:
        for values in body:
            row = dict(zip(header, values))
            if kernel in (row.get("Kernel Name") or "") and row.get("Metric Name") in METRICS:
                out[row["Metric Name"]] = _to_bytes(row.get("Metric Value"),
                                                    row.get("Metric Unit"), row["Metric Name"])
        return out
    columns = {m: header.index(m) for m in METRICS if m in header}
    units = body[0] if body and not body[0][0] else None   # the raw page's units row
    name_col = header.index("Kernel Name") if "Kernel Name" in header else None
    for values in body[1 if units else 0:]:
        if name_col is not None and kernel not in values[name_col]:
            continue
        for metric, col in columns.items():
            out[metric] = _to_bytes(values[col], units[col] if units else "byte", metric)
    return out


def _mib(n) -> str:
    return "" if n is None else f"{n / 2**20:.1f}"


def markdown_table(results: list[dict]) -> str:
    """One row per (shape, order). The partitioned model's two columns appear when the rows
    carry its prediction (a JSON from before it existed renders as it did)."""
    with_p = any("model_partitioned" in r for r in results)
    p_head = "| model partitioned read MiB | partitioned / measured " if with_p else ""
    lines = ["| shape (MxNxK) | order | measured read MiB | model LRU read MiB | model / measured "
             f"{p_head}| model Belady read MiB | compulsory read MiB | measured write MiB "
             "| time µs |",
             "|---|---|---:|---:|---:|" + ("---:|---:|" if with_p else "") + "---:|---:|---:|---:|"]

    def ratio(model, measured):
        return f"{model / measured:.2f}" if measured and model is not None else ""

    for r in results:
        measured = r.get("measured_read_bytes")
        model = r["model_lru"]["read_bytes"]
        time_us = f"{r['time_us']:.0f}" if r.get("time_us") else ""
        p_cells = ""
        if with_p:
            p = (r.get("model_partitioned") or {}).get("read_bytes")
            p_cells = f"| {_mib(p)} | {ratio(p, measured)} "
        lines.append(f"| {r['shape']} | {r['order']} | {_mib(measured)} | {_mib(model)} "
                     f"| {ratio(model, measured)} {p_cells}"
                     f"| {_mib(r['model_belady']['read_bytes'])} "
                     f"| {_mib(r['compulsory_read_bytes'])} "
                     f"| {_mib(r.get('measured_write_bytes'))} | {time_us} |")
    return "\n".join(lines)


def rescore(payload: dict, belady: bool = True) -> list[dict]:
    """The rows of a validation JSON with both models' predictions recomputed (CPU only), for
    the hardware and kernel the JSON records."""
    hw_info = payload["model_hardware"]
    hw = Hardware(num_sms=hw_info["num_sms"], l2_bytes=hw_info["l2_bytes"],
                  tiles_per_sm=hw_info["tiles_per_sm"])
    block = payload.get("kernel", {}).get("block") or [128, 128, 64]
    out = []
    for r in payload["results"]:
        shape = gemm_shape(parse_shape(r["shape"]), *block)
        row = dict(r)
        row["model_lru"] = predict(shape, r["order"], hw, "lru")
        row["model_partitioned"] = predict(shape, r["order"], partitioned(hw), "lru")
        row["model_belady"] = (predict(shape, r["order"], hw, "belady") if belady
                               else {"read_bytes": None})
        row["compulsory_read_bytes"] = compulsory_read_bytes(shape)
        out.append(row)
    return out


# ---------------------------------------------------------------- GPU parts

def launch(a, b, c, perm, shape: GemmShape, num_warps: int, num_stages: int):
    return gemm_in_tile_order(a, b, c, perm, shape.block_m, shape.block_n, shape.block_k, num_warps, num_stages)


def make_inputs(shape: GemmShape, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(shape.M, shape.K, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(shape.K, shape.N, device=device, dtype=torch.bfloat16, generator=g)
    c = torch.empty(shape.M, shape.N, device=device, dtype=torch.bfloat16)
    return a, b, c


def single_run(shape_text: str, spec: str, block_m: int, block_n: int, block_k: int, num_warps: int,
               num_stages: int) -> int:
    """Under ncu: one launch to compile and warm up, one to profile (--launch-skip 1)."""
    shape = gemm_shape(parse_shape(shape_text), block_m, block_n, block_k)
    a, b, c = make_inputs(shape, "cuda")
    perm = order_permutation(spec, shape, "cuda")
    for _ in range(2):
        launch(a, b, c, perm, shape, num_warps, num_stages)
    torch.cuda.synchronize()
    return 0


def measure_with_ncu(ncu: str, args: "Settings", shape_text: str, spec: str) -> tuple[dict, str | None]:
    cmd = [ncu, "--clock-control", "none", "--metrics", ",".join(METRICS), "--csv",
           "--print-units", "base", "--kernel-name", f"regex:{KERNEL_NAME}",
           "--launch-skip", "1", "--launch-count", "1",
           sys.executable, "-m", "flashflow.bench.dataflow", shape_text, spec,
           str(args.block_m), str(args.block_n), str(args.block_k), str(args.num_warps),
           str(args.num_stages)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.ncu_timeout)
    except subprocess.TimeoutExpired:
        return {}, f"ncu timed out after {args.ncu_timeout} s"
    try:
        metrics = parse_ncu_csv(proc.stdout)
    except ValueError as e:
        tail = (proc.stdout + proc.stderr)[-1500:]
        return {}, f"ncu exit {proc.returncode}: {e}; output tail:\n{tail}"
    missing = [m for m in METRICS if m not in metrics]
    if missing:
        return metrics, f"ncu reported no {missing}"
    return metrics, None


# ---------------------------------------------------------------- the suite


@dataclasses.dataclass(frozen=True)
class Settings:
    shapes: tuple = DEFAULT_SHAPES
    orders: tuple = DEFAULT_ORDERS
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    tiles_per_sm: int | None = None      # resident CTAs per SM for the model; None: from the kernel
    belady: bool = True
    ncu: str | None = None
    ncu_timeout: int = 300


def default_ncu() -> str | None:
    path = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    return path if os.path.exists(path) else None


def measure(settings: Settings, log=print) -> dict:
    """Every (shape, order) of ``settings`` on the current GPU: the result dict the suite writes."""
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    l2 = getattr(props, "L2_cache_size", 0) or H100.l2_bytes
    ncu = settings.ncu
    ncu_version = None
    if ncu is None:
        print("ncu not found on PATH nor at /usr/local/cuda/bin/ncu: the measured columns stay empty",
              file=sys.stderr)
    else:
        ncu_version = subprocess.run([ncu, "--version"], capture_output=True,
                                     text=True).stdout.strip().splitlines()[-1:]
    results, kernel_info = [], {}
    total = len(settings.shapes) * len(settings.orders)
    for mnk in (parse_shape(s) for s in settings.shapes):
        shape = gemm_shape(mnk, settings.block_m, settings.block_n, settings.block_k)
        shape_text = "x".join(map(str, mnk))
        a, b, c = make_inputs(shape, "cuda")
        ref = (a.float() @ b.float())
        for spec in settings.orders:
            perm = order_permutation(spec, shape, "cuda")
            c.fill_(float("nan"))
            compiled = launch(a, b, c, perm, shape, settings.num_warps, settings.num_stages)
            torch.cuda.synchronize()
            err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
            if not kernel_info:
                if hasattr(compiled, "_init_handles"):   # n_regs is filled in lazily
                    compiled._init_handles()
                n_regs = getattr(compiled, "n_regs", 0) or 0
                shared = getattr(getattr(compiled, "metadata", None), "shared", 0) or 0
                max_shared = getattr(props, "shared_memory_per_multiprocessor", 0) or 233472
                regs_per_sm = getattr(props, "regs_per_multiprocessor", 0) or 65536
                per_sm = settings.tiles_per_sm or occupancy(n_regs, shared, settings.num_warps,
                                                            max_shared, regs_per_sm)
                kernel_info = {"n_regs": n_regs, "n_spills": getattr(compiled, "n_spills", None),
                               "shared_bytes": shared, "num_warps": settings.num_warps,
                               "num_stages": settings.num_stages, "tiles_per_sm": per_sm,
                               "block": [settings.block_m, settings.block_n, settings.block_k]}
            hw = Hardware(num_sms=sms, l2_bytes=l2, tiles_per_sm=kernel_info["tiles_per_sm"])
            ms = timing.warm_ms(lambda: launch(a, b, c, perm, shape, settings.num_warps, settings.num_stages),
                                first_call=False, return_mode="mean")
            t0 = time.time()
            model_lru = predict(shape, spec, hw, "lru")
            model_partitioned = predict(shape, spec, partitioned(hw), "lru")
            model_belady = predict(shape, spec, hw, "belady") if settings.belady else {"read_bytes": None}
            row = {"shape": shape_text, "order": spec, "rel_err": err, "time_us": ms * 1e3,
                   "tflops": 2 * shape.M * shape.N * shape.K / (ms * 1e-3) / 1e12,
                   "model_lru": model_lru, "model_partitioned": model_partitioned,
                   "model_belady": model_belady, "model_seconds": time.time() - t0,
                   "compulsory_read_bytes": compulsory_read_bytes(shape),
                   "measured_read_bytes": None, "measured_write_bytes": None, "ncu_error": None}
            if ncu:
                metrics, problem = measure_with_ncu(ncu, settings, shape_text, spec)
                row["measured_read_bytes"] = metrics.get("dram__bytes_read.sum")
                row["measured_write_bytes"] = metrics.get("dram__bytes_write.sum")
                row["ncu_error"] = problem
                if problem:
                    print(f"{shape_text} {spec}: {problem}", file=sys.stderr)
            results.append(row)
            log(f"[{len(results)}/{total}] {shape_text} {spec:18s} err {err:.1e}  {ms * 1e3:8.1f} us  "
                f"measured read {_mib(row['measured_read_bytes']):>8} MiB  model unified "
                f"{_mib(model_lru['read_bytes'])} MiB, partitioned {_mib(model_partitioned['read_bytes'])} MiB")
            if err > 2e-2:
                print(f"WARNING: {shape_text} {spec} relative error {err:.2e}", file=sys.stderr)
        a = b = c = ref = None   # free this shape's buffers before the next one
        torch.cuda.empty_cache()
    return {
        "suite": "dataflow", "device": props.name, "sms": sms, "l2_bytes": l2,
        "model_hardware": {"num_sms": sms, "l2_bytes": l2, "tiles_per_sm": kernel_info.get("tiles_per_sm")},
        "model_partitioned": {k: getattr(H100_PARTITIONED, k) for k in
                              ("l2_partitions", "sharing", "placement", "drift")},
        "rank_agreement": rank_summary(results),
        "kernel": kernel_info, "torch": torch.__version__, "triton": triton.__version__,
        "python": sys.version.split()[0], "ncu": ncu_version,
        "ncu_command": "ncu --clock-control none --metrics " + ",".join(METRICS) +
                       " --csv --print-units base (default cache control: L2 flushed)",
        "note": MODEL_NOTE, "results": results,
        "timing": timing.record("warm", warmup_ms=25, rep_ms=100, return_mode="mean"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def report(result: dict) -> str:
    """The table and the rank agreement of a result (as measured, or rescored)."""
    hw = result.get("model_hardware", {})
    return (f"{result.get('device')}: {hw.get('num_sms')} SMs, L2 {hw.get('l2_bytes', 0) / 2**20:.0f} MiB, "
            f"model slots {hw.get('num_sms')} x {hw.get('tiles_per_sm')} CTAs/SM. {MODEL_NOTE}\n\n"
            + markdown_table(result["results"])
            + "\n\nRank agreement with the measurement:\n" + rank_lines(rank_summary(result["results"])))


def run(args) -> int:
    """Entry point of ``flashflow bench --suite dataflow`` (args: quick, out)."""
    from flashflow.bench import runner

    settings = Settings(shapes=DEFAULT_SHAPES[:1] if args.quick else DEFAULT_SHAPES, ncu=default_ncu())
    result = measure(settings, log=lambda line: print(line, file=sys.stderr, flush=True))
    path = runner.write_result(result, args.out)
    print(f"results: {path}\n\n{report(result)}")
    return 0


# ---------------------------------------------------------------- L2 model variants (CPU)

SHARINGS = ("home", "far", "copies")
PLACEMENTS = ("random", "alternate", "halves")


def all_variants() -> list[str]:
    """Timing (``lockstep`` K-steps, or ``drift``: slot phases spread over one tile) × L2
    (``unified`` LRU of the full or half size, or two partitions with a ``sharing`` rule and a
    ``placement`` of tiles on sides; flashflow/dataflow/cache.py and machine.py). The model's
    H100_PARTITIONED is ``drift/p2-home-halves``."""
    out = []
    for phases in ("lockstep", "drift"):
        out += [f"{phases}/unified", f"{phases}/unified-half"]
        out += [f"{phases}/p2-{s}-{p}" for s, p in itertools.product(SHARINGS, PLACEMENTS)]
    return out


def variant_kwargs(name: str, l2_bytes: int) -> tuple[int, dict]:
    """'drift/p2-home-random' -> (cache bytes, simulate() keyword arguments). ``driftF`` spreads
    the phases over a fraction F of a tile (a free parameter: a sensitivity check only)."""
    phases, _, l2 = name.partition("/")
    if phases == "lockstep":
        kw = {"drift": 0.0}
    elif phases == "drift":
        kw = {"drift": 1.0}
    elif phases.startswith("drift") and _is_fraction(phases[5:]):
        kw = {"drift": float(phases[5:])}
    else:
        raise ValueError(f"variant timing must be lockstep, drift or driftF (F in [0, 1]), got {name!r}")
    if l2 == "unified":
        return l2_bytes, kw
    if l2 == "unified-half":
        return l2_bytes // 2, kw
    parts = l2.split("-")
    if len(parts) != 3 or parts[0] != "p2" or parts[1] not in SHARINGS or parts[2] not in PLACEMENTS:
        raise ValueError(f"variant L2 must be unified, unified-half or p2-SHARING-PLACEMENT, got {name!r}")
    return l2_bytes, dict(kw, partitions=2, sharing=parts[1], placement=parts[2])


def _is_fraction(text: str) -> bool:
    try:
        return 0 <= float(text) <= 1
    except ValueError:
        return False


def _predict_variant(job) -> int:
    mnk, block, spec, slots, per_sm, l2_bytes, variant, seed = job
    shape = GemmShape(*mnk, *block)
    cache, kw = variant_kwargs(variant, l2_bytes)
    order = _orders.make_order(spec, shape.tiles_m, shape.tiles_n)
    return simulate(shape, order, cache, slots, seed=seed, tiles_per_sm=per_sm, **kw).read_bytes


def score_variants(payload: dict, variants=None, seeds=(0,), workers: int = 2, progress=None) -> list[dict]:
    """Per variant and measured shape of a result: Spearman's rho between predicted and measured
    read bytes, the pairs (> 10% apart) ordered right, and model/measured ratios. The random
    placement is averaged over ``seeds``. Nothing is fitted per point."""
    hw = payload["model_hardware"]
    slots = hw["num_sms"] * hw["tiles_per_sm"]
    block = tuple(payload.get("kernel", {}).get("block") or (128, 128, 64))
    points = [r for r in payload["results"] if r.get("measured_read_bytes")]
    variants = list(variants or all_variants())
    for v in variants:
        variant_kwargs(v, 1)   # a bad name is refused before the long run
    jobs = [(tuple(int(x) for x in r["shape"].split("x")), block, r["order"], slots, hw["tiles_per_sm"],
             hw["l2_bytes"], v, seed)
            for v in variants for r in points for seed in (seeds if "random" in v else seeds[:1])]
    with ProcessPoolExecutor(workers) as pool:
        reads = []
        for read in pool.map(_predict_variant, jobs, chunksize=1):
            reads.append(read)
            if progress:
                progress(len(reads), len(jobs))
    by_job: dict = {}
    for job, read in zip(jobs, reads):
        by_job.setdefault((job[6], "x".join(map(str, job[0])), job[2]), []).append(read)
    out = []
    for v in variants:
        entry = {"variant": v, "shapes": []}
        for shape in dict.fromkeys(r["shape"] for r in points):
            rows = [r for r in points if r["shape"] == shape]
            measured = [r["measured_read_bytes"] for r in rows]
            model = [sum(by_job[(v, shape, r["order"])]) / len(by_job[(v, shape, r["order"])]) for r in rows]
            right, total = separated_pairs(model, measured)
            entry["shapes"].append({"shape": shape, "orders": [r["order"] for r in rows],
                                    "spearman": spearman(model, measured), "pairs_right": right, "pairs": total,
                                    "ratios": [p / m for p, m in zip(model, measured)]})
        out.append(entry)
    return out


def variants_table(scores: list[dict]) -> str:
    shapes = [s["shape"] for s in scores[0]["shapes"]] if scores else []
    head = ["variant"] + [h for s in shapes for h in (f"rho {s}", "pairs >10%", f"ratios {s}")] + \
           ["min ratio", "max ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in scores:
        ratios = [x for s in e["shapes"] for x in s["ratios"]]
        cells = [e["variant"]]
        for s in e["shapes"]:
            cells += [f"{s['spearman']:.2f}", f"{s['pairs_right']}/{s['pairs']}",
                      " ".join(f"{x:.2f}" for x in s["ratios"])]
        cells += [f"{min(ratios):.2f}", f"{max(ratios):.2f}"] if ratios else ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":   # the child ncu profiles: MxNxK ORDER BM BN BK WARPS STAGES
    shape_text, spec, *ints = sys.argv[1:]
    sys.exit(single_run(shape_text, spec, *map(int, ints)))
