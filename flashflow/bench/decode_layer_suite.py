"""`flashflow bench --suite decode-layer`: one decoder layer's decode step, the megakernel against
the same layer from separate kernels and torch, in µs per layer and TB/s.

TB/s = :func:`flashflow.ops.decode_layer.decode_layer_bytes` (every weight once, the cached keys
and values once, the appended row, x and out) over the time. Shapes: a Llama-3-8B-sized layer
(random bf16 weights; GQA 32/8, d 128, intermediate 14336) at batch 1 and 16, caches of 1k, 4k,
8k and 32k tokens, the new token at position ``seqlen − 1`` (every call rewrites that slot with
the same values).

Providers, on the same weights and cache values:
  * ``flashflow-megakernel`` — :class:`flashflow.DecodeLayerPlan` (one launch);
  * ``flashflow-megakernel-folded`` — the same with the norm weights folded into the QKV and
    gate/up weights (:func:`flashflow.fold_norms`, once before timing; ``folded_norms=True``);
  * ``flashflow-kernels`` — torch's RMSNorm, ``F.linear`` and RoPE around
    :func:`flashflow.flash_attn_with_kvcache` (in-kernel append, a :class:`flashflow.DecodePlan`)
    and :func:`flashflow.fused_mlp`;
  * ``torch-eager`` — the layer in torch (static cache ``(batch, kv_heads, capacity, d)``,
    ``index_copy_`` append, SDPA with a position mask), launched eagerly;
  * ``torch+graph`` — the same captured in a CUDA graph;
  * ``torch.compile`` — the same through ``torch.compile(mode="reduce-overhead")``.
The flashflow providers and ``torch+graph`` are timed as CUDA-graph replays of ``GRAPH_STEPS``
back-to-back steps; ``torch-eager`` and ``torch.compile`` as their own calls (do_bench median).
A layer's weights (436 MB for Llama-3-8B) span several L2s, so each step reads them from DRAM
as in a model whose other layers flush the L2 (``l2_copies`` in a row says how many input copies
the timing cycled through, 1 where the weights alone span three L2s). Errors: each output's
relative L2 error against :func:`flashflow.reference.decode_layer.decode_layer_reference` in
float64 on the same bf16 inputs.
"""
from __future__ import annotations

import sys
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from flashflow.bench import timing

MEGAKERNEL = "flashflow-megakernel"
FOLDED = "flashflow-megakernel-folded"
KERNELS = "flashflow-kernels"
EAGER = "torch-eager"
GRAPH = "torch+graph"
COMPILE = "torch.compile"
PROVIDERS = (MEGAKERNEL, FOLDED, KERNELS, EAGER, GRAPH, COMPILE)
NEEDS_CUDA = (GRAPH, COMPILE)   # capture and cudagraph trees: no CPU stand-in
SHAPES = tuple((b, s) for b in (1, 16) for s in (1024, 4096, 8192, 32768))
QUICK_SHAPES = ((1, 4096), (16, 4096))
WARMUP_MS, REP_MS = 25, 100


def torch_layer(x, w: dict, kc, vc, pos, cos, sin, heads: int, kv_heads: int, eps: float):
    """The layer in torch, static shapes (gpt-fast's form): ``kc``/``vc`` ``(batch, kv_heads,
    capacity, d)``, ``pos`` a one-element int64 tensor, the new token's position in every
    sequence; ``cos``/``sin`` ``(capacity, d/2)``."""
    batch, hidden = x.shape
    d = w["o"].shape[1] // heads
    qkv = F.linear(F.rms_norm(x, (hidden,), w["attn_norm"], eps), w["qkv"])
    q = qkv[:, :heads * d].view(batch, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(batch, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(batch, kv_heads, d)
    c, s = cos[pos].to(x.dtype), sin[pos].to(x.dtype)

    def rope(t):
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat([t1 * c - t2 * s, t2 * c + t1 * s], dim=-1)
    q, k = rope(q), rope(k)
    kc.index_copy_(2, pos, k[:, :, None])
    vc.index_copy_(2, pos, v[:, :, None])
    mask = (torch.arange(kc.shape[2], device=x.device) <= pos)[None, :]
    o = F.scaled_dot_product_attention(q[:, :, None], kc, vc, attn_mask=mask, enable_gqa=heads != kv_heads)
    h = x + F.linear(o.reshape(batch, heads * d), w["o"])
    gate, up = F.linear(F.rms_norm(h, (hidden,), w["ffn_norm"], eps), w["gate_up"]).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, w["down"])


def make_inputs(config, batch: int, seqlen: int, dtype=torch.bfloat16, device="cuda", seed: int = 0):
    """``(x, weights, k_cache, v_cache)``: random values, caches ``(batch, seqlen, kv_heads, d)``."""
    from flashflow.ops.decode_layer import random_layer_weights

    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (batch, seqlen, config.kv_heads, config.head_dim)
    kc = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    vc = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    x = torch.randn(batch, config.hidden, generator=g).to(dtype=dtype, device=device)
    return x, random_layer_weights(config, dtype, device, seed=seed + 1), kc, vc


def make_providers(config, x, weights, k_cache, v_cache, names=PROVIDERS) -> dict:
    """Zero-argument callables by name, each one step of the layer at position ``seqlen − 1``."""
    import flashflow
    from flashflow.reference.decode_layer import rope_tables

    c = config
    batch, seqlen = x.shape[0], k_cache.shape[1]
    device = x.device
    lens = torch.full((batch,), seqlen - 1, dtype=torch.int32, device=device)
    w = weights.as_dict()
    provs = {}
    if MEGAKERNEL in names:
        plan = flashflow.DecodeLayerPlan(c, batch, seqlen, device=device, dtype=x.dtype)
        kc, vc = k_cache.clone(), v_cache.clone()
        provs[MEGAKERNEL] = lambda: plan.run(x, weights, kc, vc, lens)
    if FOLDED in names:
        fplan = flashflow.DecodeLayerPlan(c, batch, seqlen, device=device, dtype=x.dtype, folded_norms=True)
        folded = flashflow.fold_norms(weights)
        kc3, vc3 = k_cache.clone(), v_cache.clone()
        provs[FOLDED] = lambda: fplan.run(x, folded, kc3, vc3, lens)
    if KERNELS in names:
        dplan = flashflow.plan_decode(batch, c.heads, c.kv_heads, c.head_dim, seqlen, device=device)
        kc2, vc2 = k_cache.clone(), v_cache.clone()
        cos, sin = (t.to(device) for t in rope_tables(seqlen, c.head_dim, c.rope_theta, torch.float32))
        cs, sn = cos[seqlen - 1].to(x.dtype), sin[seqlen - 1].to(x.dtype)

        def kernels():
            d, h, hk = c.head_dim, c.heads, c.kv_heads
            qkv = F.linear(F.rms_norm(x, (c.hidden,), w["attn_norm"], c.eps), w["qkv"])
            q, k, v = qkv.split([h * d, hk * d, hk * d], dim=-1)

            def rope(t, n):
                t1, t2 = t.view(batch, n, d).chunk(2, dim=-1)
                return torch.cat([t1 * cs - t2 * sn, t2 * cs + t1 * sn], dim=-1)[:, None]
            o = flashflow.flash_attn_with_kvcache(rope(q, h), kc2, vc2, rope(k, hk), v.view(batch, 1, hk, d),
                                                  cache_seqlens=lens, plan=dplan)
            hid = x + F.linear(o.reshape(batch, h * d), w["o"])
            return hid + flashflow.fused_mlp(F.rms_norm(hid, (c.hidden,), w["ffn_norm"], c.eps), w["gate_up"],
                                             w["down"])
        provs[KERNELS] = kernels
    if {EAGER, GRAPH, COMPILE} & set(names):
        cos, sin = (t.to(device) for t in rope_tables(seqlen, c.head_dim, c.rope_theta, torch.float32))
        pos = torch.tensor([seqlen - 1], device=device)
        layer = TorchLayer(c, w, k_cache, v_cache, cos, sin)
        for name in (EAGER, GRAPH):
            if name in names:
                provs[name] = lambda: layer(x, pos)
        if COMPILE in names:
            # a second copy of the cache, so that the providers do not share one; the weights,
            # caches and tables are the module's buffers: reduce-overhead's CUDA graphs treat
            # them as static (tensors passed as arguments would be copied in before every replay,
            # and the cache's in-place append would make it skip the graphs)
            clayer = TorchLayer(c, w, k_cache, v_cache, cos, sin)
            # a fresh compilation per shape, as a process serving one shape has: without the
            # reset, each shape after the first is a recompile of the same forward, which
            # dynamo's automatic dynamic shapes compile for symbolic sizes
            torch._dynamo.reset()
            compiled = torch.compile(clayer, mode="reduce-overhead", dynamic=False)
            provs[COMPILE] = lambda: compiled(x, pos).clone()
    return provs


class TorchLayer(torch.nn.Module):
    """:func:`torch_layer` as a module (gpt-fast's form): weights, the static caches ``(batch,
    kv_heads, capacity, d)`` and the RoPE tables are buffers, ``forward(x, pos)``."""

    def __init__(self, config, w: dict, k_cache, v_cache, cos, sin):
        super().__init__()
        self.config = config
        for name, t in w.items():
            self.register_buffer(name, t)
        self.register_buffer("kc", k_cache.transpose(1, 2).contiguous())
        self.register_buffer("vc", v_cache.transpose(1, 2).contiguous())
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        self.names = tuple(w)

    def forward(self, x, pos):
        c = self.config
        w = {name: getattr(self, name) for name in self.names}
        return torch_layer(x, w, self.kc, self.vc, pos, self.cos, self.sin, c.heads, c.kv_heads, c.eps)


def reference(config, x, weights, k_cache, v_cache) -> torch.Tensor:
    from flashflow.reference.decode_layer import decode_layer_reference

    seqlen = k_cache.shape[1]
    wd = {k: t.double() for k, t in weights.as_dict().items()}
    out, _, _ = decode_layer_reference(x.double(), wd, k_cache.double(), v_cache.double(),
                                       [seqlen - 1] * x.shape[0], heads=config.heads, kv_heads=config.kv_heads,
                                       eps=config.eps, rope_theta=config.rope_theta)
    return out


def default_timer(warmup: int, rep: int):
    """``(name, fn) -> ms``: CUDA-graph replays for the flashflow providers and torch+graph, the
    calls themselves for torch-eager and torch.compile."""
    def timer(name, fn):
        if name in (EAGER, COMPILE):
            return timing.warm_ms(fn, warmup, rep)
        return timing.graph_ms(fn, timing.GRAPH_STEPS, warmup, rep)
    return timer


def bench_case(config, batch: int, seqlen: int, names=PROVIDERS, timer=None, device="cuda",
               dtype=torch.bfloat16) -> dict:
    """One row: each provider's µs, TB/s and error, and the megakernel's speedups."""
    from flashflow.ops.decode_layer import decode_layer_bytes

    nbytes = decode_layer_bytes(config, batch, seqlen - 1, torch.empty((), dtype=dtype).element_size())
    row = {"batch": batch, "seqlen": seqlen, "bytes": nbytes, "us": {}, "tbs": {}, "rel_err": {}, "errors": {}}
    x, weights, kc, vc = make_inputs(config, batch, seqlen, dtype, device)
    row["l2_copies"] = timing.rotation(nbytes, timing.l2_bytes()) if torch.device(device).type == "cuda" else 1
    ref = reference(config, x, weights, kc, vc)
    provs = make_providers(config, x, weights, kc, vc, names)
    for name, fn in provs.items():
        try:
            out = fn()
            row["rel_err"][name] = ((out.double() - ref).norm() / ref.norm()).item()
            ms = timer(name, fn)
        except Exception as e:  # noqa: BLE001 — one provider's failure is its entry
            row["errors"][name] = timing.short_error(e)
            continue
        row["us"][name] = ms * 1e3
        row["tbs"][name] = nbytes / (ms * 1e-3) / 1e12
    mega = row["us"].get(MEGAKERNEL)
    row["speedup"] = {n: t / mega for n, t in row["us"].items() if mega and n != MEGAKERNEL}
    folded = row["us"].get(FOLDED)   # the same over the megakernel with its norm weights folded
    row["speedup_folded"] = {n: t / folded for n, t in row["us"].items() if folded and n not in (MEGAKERNEL, FOLDED)}
    return row


def check_args(args) -> str | None:
    """The problem with the suite's options, or None (then ``args.providers`` is a list)."""
    from flashflow.bench.runner import check_timing_and_providers

    return check_timing_and_providers(args, PROVIDERS, "decode-layer")


def run_bench(shapes=SHAPES, providers=PROVIDERS, warmup: int = WARMUP_MS, rep: int = REP_MS, quick: bool = False,
              device="cuda", timer=None, config=None) -> dict:
    """The whole suite's result (``timer``, ``device`` and ``config`` are the tests' to change)."""
    from flashflow.bench import runner
    from flashflow.ops.decode_layer import LLAMA3_8B

    config = config or LLAMA3_8B
    started = datetime.now(timezone.utc)
    result = {"suite": "decode-layer", **runner.environment(started), "dtype": "bf16", "quick": quick,
              "config": {k: getattr(config, k) for k in config.__dataclass_fields__},
              "providers": list(providers),
              "timing": timing.record("cold-l2", warmup_ms=warmup, rep_ms=rep, return_mode="median",
                                      graph_steps=timing.GRAPH_STEPS, l2_span=timing.L2_SPAN,
                                      eager="torch-eager and torch.compile: their calls, do_bench median"),
              "rows": []}
    timer = timer or default_timer(warmup, rep)
    for i, (b, s) in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] batch {b}, cache {s}", file=sys.stderr, flush=True)
        result["rows"].append(bench_case(config, b, s, providers, timer, device))
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return result


def run(args) -> int:
    """Entry point of ``flashflow bench --suite decode-layer`` (quick, providers, warmup, rep, out)."""
    from flashflow.bench import runner

    result = run_bench(QUICK_SHAPES if args.quick else SHAPES, args.providers, args.warmup, args.rep, args.quick)
    path = runner.write_result(result, args.out)
    print(f"results: {path}")
    print(markdown_table(result))
    return 0


def markdown_table(result: dict) -> str:
    names = result["providers"]
    lines = [f"{timing.describe(result)} TB/s = weights + KV read + appended row + x and out, over the time; "
             "÷ = the provider's time over the megakernel's.", "",
             "| batch | cache | MB | " + " | ".join(f"{n} µs (TB/s)" for n in names) + " | "
             + " | ".join(f"{n} ÷" for n in names if n != MEGAKERNEL) + " |",
             "|---:|---:|---:|" + "---:|" * (2 * len(names) - (MEGAKERNEL in names)) + ""]
    for r in result["rows"]:
        cells = [f"{r['us'][n]:.1f} ({r['tbs'][n]:.2f})" if n in r["us"] else "error" for n in names]
        ratios = [f"{r['speedup'][n]:.2f}" if n in r["speedup"] else "-" for n in names if n != MEGAKERNEL]
        lines.append(f"| {r['batch']} | {r['seqlen']} | {r['bytes'] / 1e6:.0f} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def report(result: dict) -> str:
    """What ``flashflow bench --from-json`` prints of a decode-layer result."""
    return markdown_table(result)
