"""Check the dataflow model's DRAM traffic against Nsight Compute on a GPU.

A Triton GEMM whose tile order is a parameter: program id ``pid`` computes tile
``perm[pid]`` (linear index m * tiles_n + n), so any order the model knows can run. For each
shape × order it

1. runs the kernel once and checks it against torch.matmul, and times it (do_bench);
2. measures DRAM bytes with Nsight Compute, launching this script again under
   ``ncu --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum --csv``
   in ``--single-run`` mode (one warm-up launch that compiles, one profiled launch; ncu's
   default cache control flushes L2 before the profiled launch, as the model assumes);
3. asks the model for its prediction with the GPU's parameters (an H100: 132 SMs, 50 MiB L2;
   resident CTAs per SM from the compiled kernel's registers and shared memory), twice: the
   unified model (one LRU over the whole L2, lockstep waves; also under Belady) and the
   partitioned one (model.H100_PARTITIONED: two near partitions with home-based sharing, SM
   halves, slots drifting out of lockstep).

Both are approximations (equal tile times, in-order dispatch, no prefetch, sector or
compression effects). Expect them to rank orders and show their ratios, not to match bytes.

Writes bench/results/dataflow-validation-<device>.json and prints a Markdown table last, then
Spearman's rank correlation per shape for both models and how many pairs of orders measured
more than 10% apart each model orders the same way.

Usage (on the device, from the repository root):
    python scripts/dataflow_gpu_validate.py                 # 3 shapes x 7 orders
    python scripts/dataflow_gpu_validate.py --shapes 8192x8192x8192 --orders row_major,grouped_m:8
    python scripts/dataflow_gpu_validate.py --shapes 4096x16384x4096 --append   # add to the JSON
    python scripts/dataflow_gpu_validate.py --rescore bench/results/dataflow-validation-nvidia-h100-80gb-hbm3.json
                  # CPU only: re-run both models on a JSON's measured points, print the table
Needs Python 3.12, torch 2.11, triton 3.6 and ncu on PATH (or --ncu PATH); without ncu the
measured columns are empty and the reason is printed.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:   # run from a checkout without installing
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashflow.dataflow import orders as _orders  # noqa: E402
from flashflow.dataflow.bounds import compulsory_read_bytes  # noqa: E402
from flashflow.dataflow.model import H100, H100_PARTITIONED, Hardware, simulate_on  # noqa: E402
from flashflow.dataflow.shape import GemmShape  # noqa: E402
from flashflow.dataflow.stats import separated_pairs, spearman  # noqa: E402

KERNEL_NAME = "gemm_tile_order_kernel"
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


@triton.jit
def gemm_tile_order_kernel(a_ptr, b_ptr, c_ptr, perm_ptr, M, N, K,
                           stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                           tiles_n,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C = A·B, one output tile per program. Program ``pid`` computes tile ``perm[pid]``: the
    launch issues program ids in increasing order, so ``perm`` is the tile order. Reads
    BLOCK_M×K of A and K×BLOCK_N of B per tile (DRAM or L2), writes BLOCK_M×BLOCK_N of C."""
    pid = tl.program_id(0)
    tile = tl.load(perm_ptr + pid)
    pid_m = tile // tiles_n
    pid_n = tile % tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


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


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


# ---------------------------------------------------------------- GPU parts

def launch(a, b, c, perm, shape: GemmShape, num_warps: int, num_stages: int):
    grid = (perm.numel(),)
    return gemm_tile_order_kernel[grid](
        a, b, c, perm, shape.M, shape.N, shape.K, a.stride(0), a.stride(1), b.stride(0),
        b.stride(1), c.stride(0), c.stride(1), shape.tiles_n,
        BLOCK_M=shape.block_m, BLOCK_N=shape.block_n, BLOCK_K=shape.block_k,
        num_warps=num_warps, num_stages=num_stages)


def make_inputs(shape: GemmShape, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(shape.M, shape.K, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(shape.K, shape.N, device=device, dtype=torch.bfloat16, generator=g)
    c = torch.empty(shape.M, shape.N, device=device, dtype=torch.bfloat16)
    return a, b, c


def single_run(args) -> int:
    """Under ncu: one launch to compile and warm up, one to profile (--launch-skip 1)."""
    shape = gemm_shape(parse_shape(args.single_run), args.block_m, args.block_n, args.block_k)
    a, b, c = make_inputs(shape, "cuda")
    perm = order_permutation(args.order, shape, "cuda")
    for _ in range(2):
        launch(a, b, c, perm, shape, args.num_warps, args.num_stages)
    torch.cuda.synchronize()
    return 0


def measure_with_ncu(ncu: str, args, shape_text: str, spec: str) -> tuple[dict, str | None]:
    cmd = [ncu, "--clock-control", "none", "--metrics", ",".join(METRICS), "--csv",
           "--print-units", "base", "--kernel-name", f"regex:{KERNEL_NAME}",
           "--launch-skip", "1", "--launch-count", "1",
           sys.executable, str(Path(__file__).resolve()), "--single-run", shape_text,
           "--order", spec, "--block-m", str(args.block_m), "--block-n", str(args.block_n),
           "--block-k", str(args.block_k), "--num-warps", str(args.num_warps),
           "--num-stages", str(args.num_stages)]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="MxNxK,MxNxK,...")
    ap.add_argument("--orders", default=",".join(DEFAULT_ORDERS))
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--block-k", type=int, default=64)
    ap.add_argument("--num-warps", type=int, default=8)
    ap.add_argument("--num-stages", type=int, default=3)
    ap.add_argument("--tiles-per-sm", type=int, default=None,
                    help="resident CTAs per SM for the model (default: from the kernel)")
    ap.add_argument("--no-belady", action="store_true", help="skip the Belady prediction")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--ncu-timeout", type=int, default=300)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows of an existing JSON for other shapes/orders (to split a "
                         "run over several calls)")
    ap.add_argument("--rescore", metavar="JSON",
                    help="no GPU: re-run both models on this JSON's rows and print the table")
    ap.add_argument("--single-run", metavar="MxNxK", help=argparse.SUPPRESS)
    ap.add_argument("--order", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.single_run:
        return single_run(args)
    if args.rescore:
        payload = json.loads(Path(args.rescore).read_text())
        results = rescore(payload, belady=not args.no_belady)
        print(f"{payload.get('device')}: model re-run on {len(results)} rows of {args.rescore}. "
              f"{MODEL_NOTE}\n")
        print(markdown_table(results))
        print("\nRank agreement with the measurement:\n" + rank_lines(rank_summary(results)))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: this script runs on a GPU machine", file=sys.stderr)
        return 2

    props = torch.cuda.get_device_properties(0)
    device_name = props.name
    sms = props.multi_processor_count
    l2 = getattr(props, "L2_cache_size", 0) or H100.l2_bytes
    specs = [s for s in args.orders.split(",") if s]
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s]
    ncu = args.ncu if args.ncu and os.path.exists(args.ncu) else None
    if ncu is None:
        print(f"ncu not found ({args.ncu}): measured columns stay empty", file=sys.stderr)
    ncu_version = None
    if ncu:
        ncu_version = subprocess.run([ncu, "--version"], capture_output=True,
                                     text=True).stdout.strip().splitlines()[-1:]

    results, kernel_info = [], {}
    for mnk in shapes:
        shape = gemm_shape(mnk, args.block_m, args.block_n, args.block_k)
        shape_text = "x".join(map(str, mnk))
        a, b, c = make_inputs(shape, "cuda")
        ref = (a.float() @ b.float())
        for spec in specs:
            perm = order_permutation(spec, shape, "cuda")
            c.fill_(float("nan"))
            compiled = launch(a, b, c, perm, shape, args.num_warps, args.num_stages)
            torch.cuda.synchronize()
            err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
            if not kernel_info:
                if hasattr(compiled, "_init_handles"):   # n_regs is filled in lazily
                    compiled._init_handles()
                n_regs = getattr(compiled, "n_regs", 0) or 0
                shared = getattr(getattr(compiled, "metadata", None), "shared", 0) or 0
                max_shared = getattr(props, "shared_memory_per_multiprocessor", 0) or 233472
                regs_per_sm = getattr(props, "regs_per_multiprocessor", 0) or 65536
                per_sm = args.tiles_per_sm or occupancy(n_regs, shared, args.num_warps,
                                                        max_shared, regs_per_sm)
                kernel_info = {"n_regs": n_regs, "n_spills": getattr(compiled, "n_spills", None),
                               "shared_bytes": shared, "num_warps": args.num_warps,
                               "num_stages": args.num_stages, "tiles_per_sm": per_sm,
                               "block": [args.block_m, args.block_n, args.block_k]}
            hw = Hardware(num_sms=sms, l2_bytes=l2, tiles_per_sm=kernel_info["tiles_per_sm"])
            ms = triton.testing.do_bench(
                lambda: launch(a, b, c, perm, shape, args.num_warps, args.num_stages))
            t0 = time.time()
            model_lru = predict(shape, spec, hw, "lru")
            model_partitioned = predict(shape, spec, partitioned(hw), "lru")
            model_belady = (predict(shape, spec, hw, "belady") if not args.no_belady
                            else {"read_bytes": None})
            model_s = time.time() - t0
            row = {"shape": shape_text, "order": spec, "rel_err": err, "time_us": ms * 1e3,
                   "tflops": 2 * shape.M * shape.N * shape.K / (ms * 1e-3) / 1e12,
                   "model_lru": model_lru, "model_partitioned": model_partitioned,
                   "model_belady": model_belady,
                   "model_seconds": model_s,
                   "compulsory_read_bytes": compulsory_read_bytes(shape),
                   "measured_read_bytes": None, "measured_write_bytes": None, "ncu_error": None}
            if ncu:
                metrics, problem = measure_with_ncu(ncu, args, shape_text, spec)
                row["measured_read_bytes"] = metrics.get("dram__bytes_read.sum")
                row["measured_write_bytes"] = metrics.get("dram__bytes_write.sum")
                row["ncu_error"] = problem
                if problem:
                    print(f"{shape_text} {spec}: {problem}", file=sys.stderr)
            results.append(row)
            print(f"{shape_text} {spec:18s} err {err:.1e}  {ms * 1e3:8.1f} us  measured read "
                  f"{_mib(row['measured_read_bytes']):>8} MiB  model unified "
                  f"{_mib(model_lru['read_bytes'])} MiB, partitioned "
                  f"{_mib(model_partitioned['read_bytes'])} MiB", flush=True)
            if err > 2e-2:
                print(f"WARNING: {shape_text} {spec} relative error {err:.2e}", file=sys.stderr)
        a = b = c = ref = None   # free this shape's buffers before the next one
        torch.cuda.empty_cache()

    out = Path(args.out) if args.out else (
        REPO / "bench" / "results" / f"dataflow-validation-{device_slug(device_name)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.append and out.exists():
        done = {(r["shape"], r["order"]) for r in results}
        results = [r for r in json.loads(out.read_text()).get("results", [])
                   if (r["shape"], r["order"]) not in done] + results
    payload = {
        "device": device_name, "sms": sms, "l2_bytes": l2,
        "model_hardware": {"num_sms": sms, "l2_bytes": l2,
                           "tiles_per_sm": kernel_info.get("tiles_per_sm")},
        "model_partitioned": {k: getattr(H100_PARTITIONED, k) for k in
                              ("l2_partitions", "sharing", "placement", "drift")},
        "rank_agreement": rank_summary(results),
        "kernel": kernel_info, "torch": torch.__version__, "triton": triton.__version__,
        "python": sys.version.split()[0], "ncu": ncu_version,
        "ncu_command": "ncu --clock-control none --metrics " + ",".join(METRICS) +
                       " --csv --print-units base (default cache control: L2 flushed)",
        "note": MODEL_NOTE, "results": results,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {out}\n")
    print(f"{device_name}: {sms} SMs, L2 {l2 / 2**20:.0f} MiB, model slots {sms} x "
          f"{kernel_info.get('tiles_per_sm')} CTAs/SM. {MODEL_NOTE}\n")
    print(markdown_table(results))
    print("\nRank agreement with the measurement:\n" + rank_lines(rank_summary(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
