"""Peak GPU memory of naive attention vs ``flashflow.flash_attn_func``, per sequence length.

Usage, on a CUDA GPU, from the repository root:

    python scripts/measure_memory.py                               # measure, write JSON, print table
    python scripts/measure_memory.py --replace-in docs/tutorial.md # ... and put the table in the doc

Shape: batch 1, 8 heads, head_dim 128, fp16, non-causal, FlashAttention layout (b, s, h, d), for
seqlen 1024 ... 32768 (``--seqlens`` to change).

What is measured, per provider and seqlen: ``torch.cuda.max_memory_allocated()`` over one forward
call, after ``torch.cuda.reset_peak_memory_stats()``, minus what was allocated just before the call.
That baseline is the inputs q, k, v (their footprint is measured the same way when they are created
and recorded as ``inputs_bytes``), so the number is what the call itself needs, its output included.

* naive: ``softmax((q·kᵀ)·scale)·v`` as three PyTorch ops in fp16 on (b, h, s, d) views. It
  materialises the (b, h, s, s) score matrix; while the scale and the softmax run, their input and
  output score tensors are alive together. ``torch.cuda.OutOfMemoryError`` is recorded as "OOM".
* flashflow: ``flashflow.flash_attn_func(q, k, v)``: scores exist only as tiles in registers.

Writes ``bench/results/memory-<device-slug>.json`` (device, versions, UTC date, rows) and prints a
Markdown table last. ``--replace-in FILE`` replaces the ``<!-- MEMORY_TABLE -->`` line of FILE (or
the block a previous run wrote after it, up to ``<!-- /MEMORY_TABLE -->``) with the table; the
marker stays, so the command can be re-run. Without a CUDA GPU the script says so and exits 0.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- MEMORY_TABLE -->"
END_MARKER = "<!-- /MEMORY_TABLE -->"
SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768)
BATCH, HEADS, HEAD_DIM = 1, 8, 128
MIB = 2 ** 20


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


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


def make_inputs(seqlen: int):
    """q, k, v and their footprint, measured like the calls: peak allocated while creating them."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    shape = (BATCH, seqlen, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3))
    torch.cuda.synchronize()
    return q, k, v, torch.cuda.max_memory_allocated() - before


def measure(seqlens) -> list[dict]:
    import torch

    import flashflow

    # Warm up both providers (Triton compile, cuBLAS workspace, the TMA scratch allocator) so that
    # one-time allocations land before the first measured call.
    q, k, v, _ = make_inputs(256)
    naive_attention(q, k, v)
    flashflow.flash_attn_func(q, k, v)
    del q, k, v
    gc.collect()
    torch.cuda.empty_cache()

    rows = []
    for seqlen in seqlens:
        q, k, v, inputs_bytes = make_inputs(seqlen)
        flash_peak, flash_out = peak_bytes(flashflow.flash_attn_func, q, k, v)
        naive_peak, naive_out = peak_bytes(naive_attention, q, k, v)
        diff = None
        if flash_out is not None and naive_out is not None:
            diff = (flash_out.float() - naive_out.float()).abs().max().item()
        rows.append({
            "seqlen": seqlen,
            "naive_peak_bytes": naive_peak,
            "flashflow_peak_bytes": flash_peak,
            "score_matrix_bytes": BATCH * HEADS * seqlen * seqlen * 2,
            "output_bytes": BATCH * seqlen * HEADS * HEAD_DIM * 2,
            "inputs_bytes": inputs_bytes,
            "max_abs_diff_flashflow_vs_naive": diff,
        })
        print(f"seqlen {seqlen}: peak MiB naive {_mib(naive_peak)}, flashflow {_mib(flash_peak)}",
              file=sys.stderr, flush=True)
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


def caption(meta: dict) -> str:
    return (f"Measured on {meta['device']} ({meta['date_utc'][:10]}, torch {meta['torch']}, "
            f"triton {meta['triton']}): batch {BATCH}, {HEADS} heads, head_dim {HEAD_DIM}, fp16, "
            f"non-causal; peak bytes allocated during one forward call beyond the resident inputs.")


def replace_marker(text: str, block: str) -> str:
    """Put ``block`` after the marker line; drop what an earlier run put there (up to END_MARKER)."""
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.strip() == MARKER]
    if not starts:
        raise ValueError(f"no line reading {MARKER} found")
    start = starts[0]
    end = start
    for j in range(start + 1, len(lines)):
        if lines[j].strip() == MARKER:
            break
        if lines[j].strip() == END_MARKER:
            end = j
            break
    new = [MARKER, block.strip("\n"), "", END_MARKER]  # blank line: the table ends before the comment
    return "\n".join(lines[:start] + new + lines[end + 1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=list(SEQLENS))
    ap.add_argument("--replace-in", metavar="FILE", default=None,
                    help=f"replace the {MARKER} line (or the block after it) of FILE with the table")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/memory-<device>.json)")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("measure_memory.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.")
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter would run flashflow on the CPU", file=sys.stderr)
        return 2
    if args.replace_in and MARKER not in Path(args.replace_in).read_text():
        print(f"{args.replace_in} has no {MARKER} line", file=sys.stderr)
        return 2

    sys.path.insert(0, str(ROOT))  # run from a checkout without installing
    import triton

    name = torch.cuda.get_device_name()
    rows = measure(args.seqlens)
    meta = {
        "device": name,
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "total_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float16",
                  "causal": False, "layout": "(batch, seqlen, heads, head_dim)"},
        "method": ("max_memory_allocated() over one forward call after reset_peak_memory_stats(), "
                   "minus the bytes allocated just before it (the inputs); includes the output. "
                   "naive = softmax((q @ k^T) * scale) @ v in fp16."),
    }
    out_path = Path(args.out) if args.out else ROOT / "bench" / "results" / f"memory-{device_slug(name)}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out_path}", file=sys.stderr)

    table = markdown_table(rows)
    if args.replace_in:
        path = Path(args.replace_in)
        path.write_text(replace_marker(path.read_text(), caption(meta) + "\n\n" + table))
        print(f"replaced the table in {path}", file=sys.stderr)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
