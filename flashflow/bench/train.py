"""`flashflow bench --suite train`: attention forward + backward, flashflow against SDPA's cuDNN
and FLASH backends in one run.

Each provider runs ``out = attention(q, k, v); out.backward(dout)`` on the same bf16/fp16
inputs (FlashAttention layout for flashflow, ``(b, h, s, d)`` for SDPA), timed with
``triton.testing.do_bench`` (timing ``warm``: median, gradients reset to None between calls). TFLOP/s count 3.5×
the forward's FLOPs (forward 1×, backward 2.5×: FlashAttention's convention), halved for causal.
Peak memory is ``torch.cuda.max_memory_allocated`` over one step beyond the inputs. The gradients
of every provider are compared with SDPA-FLASH's (relative L2).
"""
from __future__ import annotations

import sys
from datetime import datetime, timezone

import torch

PROVIDERS = ("flashflow", "sdpa-cudnn", "sdpa-flash")


def train_shapes(quick: bool, head_dims=(128,)):
    """(batch, heads, seqlen, head_dim, causal): 2 x 16 heads x 8k at head_dim 128 (the backward's
    target shape) and a sweep of lengths, 16k tokens a batch; other head dims on request."""
    seqs = (2048, 8192) if quick else (1024, 2048, 4096, 8192, 16384)
    return [(max(1, 16384 // s), 16, s, d, c) for d in head_dims for s in seqs for c in (False, True)]


def fwd_flops(b, h, s, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def _step(name, q, k, v, dout, causal):
    import flashflow
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "flashflow":
        def run():
            out = flashflow.flash_attn_func(q, k, v, causal=causal)
            out.backward(dout)
        return run
    backend = SDPBackend.CUDNN_ATTENTION if name == "sdpa-cudnn" else SDPBackend.FLASH_ATTENTION
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dt = dout.transpose(1, 2).contiguous()

    def run():
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        out.backward(dt)
    run.tensors = (qt, kt, vt)
    return run


def _grads(run, tensors, transpose):
    for t in tensors:
        t.grad = None
    run()
    return [t.grad.transpose(1, 2) if transpose else t.grad for t in tensors]


def run(args) -> int:
    from flashflow.bench import runner, timing

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    env = runner.environment(datetime.now(timezone.utc))
    rows = []
    shapes = train_shapes(args.quick)
    for i, (b, h, s, d, causal) in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] b{b} h{h} s{s} d{d}{' causal' if causal else ''}", file=sys.stderr, flush=True)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(3))
        dout = torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g)
        row = {"batch": b, "heads": h, "seqlen": s, "head_dim": d, "causal": causal, "ms": {}, "tflops": {},
               "peak_mib": {}, "rel_err": {}, "notes": {}}
        grads = {}
        for name in PROVIDERS:
            try:
                step = _step(name, q, k, v, dout, causal)
                tensors = getattr(step, "tensors", (q, k, v))
                grads[name] = _grads(step, tensors, name != "flashflow")
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                for t in tensors:
                    t.grad = None
                step()
                torch.cuda.synchronize()
                row["peak_mib"][name] = (torch.cuda.max_memory_allocated() - base) / 2**20

                def timed(step=step, tensors=tensors):
                    for t in tensors:
                        t.grad = None
                    step()
                ms = timing.warm_ms(timed, args.warmup, args.rep, first_call=False)
                row["ms"][name] = ms
                row["tflops"][name] = 3.5 * fwd_flops(b, h, s, d, causal) / (ms * 1e-3) / 1e12
            except Exception as e:  # noqa: BLE001 — a backend that refuses the shape
                row["notes"][name] = f"{type(e).__name__}: {str(e)[:200]}"
        ref = grads.get("sdpa-flash")
        if ref is not None:
            for name, gs in grads.items():
                row["rel_err"][name] = [((a.float() - r.float()).norm() / r.float().norm()).item()
                                        for a, r in zip(gs, ref)]
        ms = row["ms"]
        if "flashflow" in ms:
            for anchor in ("sdpa-cudnn", "sdpa-flash"):
                if anchor in ms:
                    row[f"vs_{anchor.split('-')[1]}"] = ms[anchor] / ms["flashflow"]
        rows.append(row)
        del q, k, v, dout, grads
        torch.cuda.empty_cache()
    result = {"suite": "train", **env, "dtype": args.dtype, "flops_convention": "3.5x forward, halved for causal",
              "timing": timing.record("warm", warmup_ms=args.warmup, rep_ms=args.rep, return_mode="median"),
              "rows": rows}
    path = runner.write_result(result, args.out)
    print(f"results: {path}")
    print(markdown_table(result))
    return 0


def markdown_table(result) -> str:
    lines = ["forward + backward, TFLOP/s = 3.5 × forward FLOPs / median time (halved for causal); "
             "peak = extra CUDA memory of one step", "",
             "| batch | heads | seqlen | head_dim | causal | flashflow TFLOP/s | cuDNN | FLASH | ÷ cuDNN | ÷ FLASH "
             "| flashflow ms | peak MiB (ff / cuDNN / FLASH) | grad rel err vs FLASH (dq, dk, dv) |",
             "|---:|---:|---:|---:|:--|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(x, spec=".0f"):
        return "—" if x is None else format(x, spec)
    for r in result["rows"]:
        tf, pk = r["tflops"], r["peak_mib"]
        err = r["rel_err"].get("flashflow")
        lines.append(
            f"| {r['batch']} | {r['heads']} | {r['seqlen']} | {r['head_dim']} | {'yes' if r['causal'] else 'no'} "
            f"| {f(tf.get('flashflow'))} | {f(tf.get('sdpa-cudnn'))} | {f(tf.get('sdpa-flash'))} "
            f"| {f(r.get('vs_cudnn'), '.2f')} | {f(r.get('vs_flash'), '.2f')} | {f(r['ms'].get('flashflow'), '.2f')} "
            f"| {f(pk.get('flashflow'))} / {f(pk.get('sdpa-cudnn'))} / {f(pk.get('sdpa-flash'))} "
            f"| {'—' if err is None else ', '.join(f'{e:.1e}' for e in err)} |")
    return "\n".join(lines)


def report(result: dict) -> str:
    """What ``flashflow bench --from-json`` prints of a train result."""
    return markdown_table(result)
