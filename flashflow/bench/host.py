"""`flashflow bench --suite host`: the host time of one call, flashflow beside its anchors.

At a tiny shape the GPU work of a call (a few µs) is far below what the host spends to issue it,
so back-to-back calls run at the host's pace: ``calls`` calls are issued and the GPU
synchronised once; µs per call = the round's wall time / calls. An entry's providers take turns,
a round each, ``rounds`` times (the order rotated), and each keeps its median round: a drift of
the host's speed moves them alike, so their ratios hold. What it measures is everything between the Python call and the launch: argument checks,
config lookup, allocations, Triton's launcher, autograd's bookkeeping.

Entries (bf16, the anchors in the same run): the attention forward (``flash_attn_func`` vs SDPA
cuDNN and FLASH), forward + backward (vs the same), the FP8 attention forward (Hopper), decode
(``plan.run`` and the call without a plan, vs SDPA on the cache), the fused FFN at M = 1 (vs
torch: ``F.linear``, ``silu(gate)·up``, ``F.linear``).
"""
from __future__ import annotations

import statistics
import sys
from datetime import datetime, timezone

import torch

from flashflow.bench import timing

CALLS, ROUNDS, WARMUP = 200, 7, 50


def _sdpa(backend, q, k, v, **kw):
    from torch.nn.attention import sdpa_kernel

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    return run


def cases(dtype=torch.bfloat16):
    """(entry, {provider: fn}) at the suite's tiny shapes."""
    import flashflow
    from torch.nn.attention import SDPBackend

    cudnn, flash = SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION
    b, s, h, d = 1, 128, 8, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out = {"attention forward (1 x 128 x 8, d128)": {
        "flashflow": lambda: flashflow.flash_attn_func(q, k, v),
        "sdpa-cudnn": _sdpa(cudnn, qt, kt, vt), "sdpa-flash": _sdpa(flash, qt, kt, vt)}}

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    qtg, ktg, vtg = (t.clone().requires_grad_() for t in (qt, kt, vt))
    do, dot = torch.randn_like(q), torch.randn_like(qt)

    def step(fwd, grad):
        def run():
            fwd().backward(grad)
        return run
    out["attention forward + backward"] = {
        "flashflow": step(lambda: flashflow.flash_attn_func(qg, kg, vg), do),
        "sdpa-cudnn": step(_sdpa(cudnn, qtg, ktg, vtg), dot), "sdpa-flash": step(_sdpa(flash, qtg, ktg, vtg), dot)}

    if torch.cuda.get_device_capability()[0] >= 9:
        out["FP8 attention forward (quantize included)"] = {
            "flashflow-fp8": lambda: flashflow.flash_attn_fp8_func(q, k, v),
            "sdpa-cudnn": _sdpa(cudnn, qt, kt, vt)}

    batch, heads, kv_heads, cap = 1, 32, 8, 1024
    qd = torch.randn(batch, 1, heads, d, device="cuda", dtype=dtype)
    kc, vc = (torch.randn(batch, cap, kv_heads, d, device="cuda", dtype=dtype) for _ in range(2))
    lens = torch.full((batch,), cap, dtype=torch.int32, device="cuda")
    plan = flashflow.plan_decode(batch, heads, kv_heads, d, cap, device="cuda")
    qdt = qd.transpose(1, 2)
    kct, vct = (t.transpose(1, 2) for t in (kc, vc))
    out["decode (1 x 1k cache, 32/8 heads)"] = {
        "flashflow plan.run": lambda: plan.run(qd, kc, vc, cache_seqlens=lens),
        "flashflow (no plan)": lambda: flashflow.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens),
        "sdpa-flash": _sdpa(flash, qdt, kct, vct, enable_gqa=True)}

    hidden, inter = 1024, 2816
    x = torch.randn(1, hidden, device="cuda", dtype=dtype)
    w1 = torch.randn(2 * inter, hidden, device="cuda", dtype=dtype) * hidden ** -0.5
    w2 = torch.randn(hidden, inter, device="cuda", dtype=dtype) * inter ** -0.5
    F = torch.nn.functional

    def torch_ffn():
        gate_up = F.linear(x, w1)
        return F.linear(F.silu(gate_up[..., :inter]) * gate_up[..., inter:], w2)
    out["FFN, SwiGLU, M = 1 (1024 -> 2816)"] = {
        "flashflow": lambda: flashflow.fused_mlp(x, w1, w2), "torch (linear, silu·mul, linear)": torch_ffn}
    return out


def run(args) -> int:
    from flashflow.bench import runner

    env = runner.environment(datetime.now(timezone.utc))
    rows = []
    for entry, providers in cases().items():
        print(entry, file=sys.stderr, flush=True)
        for fn in providers.values():   # compile and warm every provider before any is timed
            try:
                for _ in range(WARMUP):
                    fn()
            except Exception:  # noqa: BLE001 — timed (and its error kept) below
                pass
        # the providers interleaved, one round of CALLS calls each per round: a drift of the
        # host's clock or load moves every provider alike, so the ratios hold
        samples, errors = timing.rounds(providers, lambda fn: timing.host_us(fn, CALLS, 1, 0), ROUNDS)
        row = {"entry": entry, "us": {}, "notes": dict(errors)}
        for name, times in samples.items():
            if name not in errors:
                row["us"][name] = statistics.median(times)
        rows.append(row)
    result = {"suite": "host", **env, "dtype": "bf16",
              "timing": timing.record("rounds", of="host", calls=CALLS, rounds=ROUNDS, warmup_calls=WARMUP,
                                      what="wall µs per call of back-to-back calls, one synchronize per round, "
                                           "the providers interleaved round by round, median round"),
              "rows": rows}
    path = runner.write_result(result, args.out)
    print(f"results: {path}")
    print(markdown_table(result))
    return 0


def markdown_table(result) -> str:
    lines = ["host time per call, µs (back-to-back calls at a tiny shape: the GPU waits on the host)", "",
             "| entry | provider | µs per call |", "|:--|:--|---:|"]
    for r in result["rows"]:
        for name, us in r["us"].items():
            lines.append(f"| {r['entry']} | {name} | {us:.1f} |")
        for name, note in r.get("notes", {}).items():
            lines.append(f"| {r['entry']} | {name} | {note} |")
    return "\n".join(lines)


def report(result: dict) -> str:
    """What ``flashflow bench --from-json`` prints of a host result."""
    return markdown_table(result)
