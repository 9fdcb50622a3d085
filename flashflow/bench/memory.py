"""`flashflow bench --suite memory`: peak GPU memory of naive attention vs ``flash_attn_func``,
per sequence length.

Shape: batch 1, 8 heads, head_dim 128, fp16 by default, non-causal, FlashAttention layout
(b, s, h, d), for seqlen 1024 ... 32768 (``--quick``: 1024 and 4096).

What is measured, per provider and seqlen: ``torch.cuda.max_memory_allocated()`` over one forward
call, after ``torch.cuda.reset_peak_memory_stats()``, minus what was allocated just before the call.
That baseline is the inputs q, k, v (their footprint is measured the same way when they are created
and recorded as ``inputs_bytes``), so the number is what the call itself needs, its output included.

* naive: ``softmax((q·kᵀ)·scale)·v`` as three PyTorch ops on (b, h, s, d) views. It materialises
  the (b, h, s, s) score matrix; while the scale and the softmax run, their input and output score
  tensors are alive together. ``torch.cuda.OutOfMemoryError`` is recorded as "OOM".
* flashflow: ``flashflow.flash_attn_func(q, k, v)``: scores exist only as tiles in registers.

Writes ``memory-<device>.json``; ``flashflow bench --tables --write docs/tutorial.md`` puts the
table into the tutorial.
"""
from __future__ import annotations

import gc
import math
import sys
from datetime import datetime, timezone

SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_SEQLENS = (1024, 4096)
BATCH, HEADS, HEAD_DIM = 1, 8, 128
MIB = 2 ** 20
DEFAULT_DTYPE = "fp16"


def naive_attention(q, k, v):
    """softmax(q·kᵀ·scale)·v in the inputs' dtype, written the way it usually is."""
    import torch

    scale = 1.0 / math.sqrt(q.shape[-1])
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, h, s, d) views
    return (torch.softmax((qt @ kt.transpose(-2, -1)) * scale, dim=-1) @ vt).transpose(1, 2)


def peak_bytes(fn, *args):
    """(peak bytes the call allocated beyond what was resident before it, output), or ("OOM", None)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.max_memory_allocated()  # == memory_allocated() right after the reset
    try:
        out = fn(*args)
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        out = None
    if out is None:
        gc.collect()
        torch.cuda.empty_cache()
        return "OOM", None
    return torch.cuda.max_memory_allocated() - resident, out


def make_inputs(seqlen: int, dtype):
    """q, k, v and their footprint, measured like the calls: peak allocated while creating them."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    shape = (BATCH, seqlen, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    torch.cuda.synchronize()
    return q, k, v, torch.cuda.max_memory_allocated() - before


def measure(seqlens, dtype) -> list[dict]:
    import torch

    import flashflow

    # both providers once first (Triton compile, cuBLAS workspace, the TMA scratch allocator), so
    # one-time allocations land before the first measured call
    q, k, v, _ = make_inputs(256, dtype)
    naive_attention(q, k, v)
    flashflow.flash_attn_func(q, k, v)
    del q, k, v
    gc.collect()
    torch.cuda.empty_cache()

    rows = []
    for i, seqlen in enumerate(seqlens):
        q, k, v, inputs_bytes = make_inputs(seqlen, dtype)
        flash_peak, flash_out = peak_bytes(flashflow.flash_attn_func, q, k, v)
        naive_peak, naive_out = peak_bytes(naive_attention, q, k, v)
        diff = None
        if flash_out is not None and naive_out is not None:
            diff = (flash_out.float() - naive_out.float()).abs().max().item()
        rows.append({
            "seqlen": seqlen,
            "naive_peak_bytes": naive_peak,
            "flashflow_peak_bytes": flash_peak,
            "score_matrix_bytes": BATCH * HEADS * seqlen * seqlen * q.element_size(),
            "output_bytes": BATCH * seqlen * HEADS * HEAD_DIM * q.element_size(),
            "inputs_bytes": inputs_bytes,
            "max_abs_diff_flashflow_vs_naive": diff,
        })
        print(f"[{i + 1}/{len(seqlens)}] seqlen {seqlen}: peak MiB naive {_mib(naive_peak)}, "
              f"flashflow {_mib(flash_peak)}", file=sys.stderr, flush=True)
        del q, k, v, flash_out, naive_out
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _mib(nbytes) -> str:
    return nbytes if isinstance(nbytes, str) else f"{nbytes / MIB:.1f}"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| seqlen | naive peak MiB | flashflow peak MiB | ratio | S² score matrix MiB |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        naive, flash = r["naive_peak_bytes"], r["flashflow_peak_bytes"]
        ratio = "—"
        if not isinstance(naive, str) and not isinstance(flash, str) and flash > 0:
            ratio = f"{naive / flash:.0f}×" if naive >= 10 * flash else f"{naive / flash:.1f}×"
        lines.append(f"| {r['seqlen']} | {_mib(naive)} | {_mib(flash)} | {ratio} | "
                     f"{r['score_matrix_bytes'] / MIB:.0f} |")
    return "\n".join(lines)


def caption(result: dict) -> str:
    shape = result["shape"]
    dtype = {"float16": "fp16", "bfloat16": "bf16"}.get(shape["dtype"], shape["dtype"])
    return (f"Measured on {result['device']} ({result['date_utc'][:10]}, torch {result['torch']}, "
            f"triton {result['triton']}): batch {shape['batch']}, {shape['heads']} heads, head_dim "
            f"{shape['head_dim']}, {dtype}, non-causal; peak bytes allocated during one forward call "
            f"beyond the resident inputs.")


def run(args) -> int:
    """Entry point of ``flashflow bench --suite memory`` (args: quick, dtype, out)."""
    import torch
    import triton

    from flashflow.bench import runner

    dtype_name = args.dtype or DEFAULT_DTYPE
    dtype = torch.float16 if dtype_name == "fp16" else torch.bfloat16
    name = torch.cuda.get_device_name()
    rows = measure(QUICK_SEQLENS if args.quick else SEQLENS, dtype)
    result = {
        "suite": "memory",
        "device": name,
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "total_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "shape": {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": str(dtype).removeprefix("torch."),
                  "causal": False, "layout": "(batch, seqlen, heads, head_dim)"},
        "method": ("max_memory_allocated() over one forward call after reset_peak_memory_stats(), "
                   "minus the bytes allocated just before it (the inputs); includes the output. "
                   f"naive = softmax((q @ k^T) * scale) @ v in {dtype_name}."),
        "rows": rows,
    }
    path = runner.write_result(result, args.out)
    print(f"results: {path}\n\n{caption(result)}\n\n{markdown_table(rows)}")
    return 0


def report(result: dict) -> str:
    """What ``flashflow bench --from-json`` prints of a memory result."""
    return caption(result) + "\n\n" + markdown_table(result["rows"])
