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
LAYERS = "flashflow-megakernel-layers"
LAYERS_FOLDED = "flashflow-megakernel-layers-folded"
KERNELS = "flashflow-kernels"
EAGER = "torch-eager"
GRAPH = "torch+graph"
COMPILE = "torch.compile"
PROVIDERS = (MEGAKERNEL, FOLDED, KERNELS, EAGER, GRAPH, COMPILE)
# with --blocks N > 1: the step's N layers in one launch (a plan of num_layers=N), weights as
# given and folded; the other providers then run the N layers one after another
STEP_PROVIDERS = (LAYERS, LAYERS_FOLDED)
MAX_LAYERS = 32
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
        kc2, vc2 = k_cache.clone(), v_cache.clone()
        klayer = kernels_layer(c, batch, seqlen, lens, device, x.dtype)
        provs[KERNELS] = lambda: klayer(x, w, kc2, vc2)
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


def kernels_layer(config, batch: int, seqlen: int, lens, device, dtype):
    """``(x, w, k_cache, v_cache) -> out``: the layer from separate flashflow kernels at position
    ``seqlen − 1`` (``w`` a weights dict): torch's RMSNorm, ``F.linear`` and RoPE around
    :func:`flashflow.flash_attn_with_kvcache` (in-kernel append, one :class:`flashflow.DecodePlan`)
    and :func:`flashflow.fused_mlp`."""
    import flashflow
    from flashflow.reference.decode_layer import rope_tables

    c = config
    d, h, hk = c.head_dim, c.heads, c.kv_heads
    dplan = flashflow.plan_decode(batch, h, hk, d, seqlen, device=device)
    cos, sin = (t.to(device) for t in rope_tables(seqlen, d, c.rope_theta, torch.float32))
    cs, sn = cos[seqlen - 1].to(dtype), sin[seqlen - 1].to(dtype)

    def rope(t, heads):
        t1, t2 = t.view(batch, heads, d).chunk(2, dim=-1)
        return torch.cat([t1 * cs - t2 * sn, t2 * cs + t1 * sn], dim=-1)[:, None]

    def layer(x, w, kc, vc):
        q, k, v = F.linear(F.rms_norm(x, (c.hidden,), w["attn_norm"], c.eps), w["qkv"]).split(
            [h * d, hk * d, hk * d], dim=-1)
        o = flashflow.flash_attn_with_kvcache(rope(q, h), kc, vc, rope(k, hk), v.view(batch, 1, hk, d),
                                              cache_seqlens=lens, plan=dplan)
        hid = x + F.linear(o.reshape(batch, h * d), w["o"])
        return hid + flashflow.fused_mlp(F.rms_norm(hid, (c.hidden,), w["ffn_norm"], c.eps), w["gate_up"], w["down"])
    return layer


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
    _time_providers(row, make_providers(config, x, weights, kc, vc, names), ref, timer)
    mega = row["us"].get(MEGAKERNEL)
    row["speedup"] = {n: t / mega for n, t in row["us"].items() if mega and n != MEGAKERNEL}
    folded = row["us"].get(FOLDED)   # the same over the megakernel with its norm weights folded
    row["speedup_folded"] = {n: t / folded for n, t in row["us"].items() if folded and n not in (MEGAKERNEL, FOLDED)}
    return row


def make_step_providers(config, x, layers, caches, names) -> dict:
    """Zero-argument callables by name, each one step of the ``len(layers)`` layers at position
    ``seqlen − 1`` (``caches`` a ``(k_cache, v_cache)`` pair per layer). The flashflow providers
    share one copy of the caches: every call rewrites slot ``seqlen − 1`` of each layer before
    that layer's attention reads it, so no provider reads another's append."""
    import flashflow
    from flashflow.ops.decode_layer import decode_step
    from flashflow.reference.decode_layer import rope_tables

    c, n = config, len(layers)
    batch, seqlen = x.shape[0], caches[0][0].shape[1]
    device = x.device
    lens = torch.full((batch,), seqlen - 1, dtype=torch.int32, device=device)
    provs = {}
    shared = [(k.clone(), v.clone()) for k, v in caches] if set(names) - {EAGER, GRAPH, COMPILE} else []
    folded = [flashflow.fold_norms(w) for w in layers] if {FOLDED, LAYERS_FOLDED} & set(names) else []
    for name, weights, kw in ((MEGAKERNEL, layers, {}), (FOLDED, folded, {"folded_norms": True}),
                              (LAYERS, layers, {"num_layers": n}),
                              (LAYERS_FOLDED, folded, {"folded_norms": True, "num_layers": n})):
        if name in names:
            plan = flashflow.DecodeLayerPlan(c, batch, seqlen, device=device, dtype=x.dtype, **kw)
            provs[name] = (lambda p, w: lambda: decode_step(p, w, shared, x, lens, advance=False))(plan, weights)
    if KERNELS in names:
        klayer = kernels_layer(c, batch, seqlen, lens, device, x.dtype)
        dicts = [w.as_dict() for w in layers]

        def kernels():
            hid = x
            for w, (kc, vc) in zip(dicts, shared):
                hid = klayer(hid, w, kc, vc)
            return hid
        provs[KERNELS] = kernels
    if {EAGER, GRAPH, COMPILE} & set(names):
        cos, sin = (t.to(device) for t in rope_tables(seqlen, c.head_dim, c.rope_theta, torch.float32))
        pos = torch.tensor([seqlen - 1], device=device)

        def model():
            return TorchStep([TorchLayer(c, w.as_dict(), kc, vc, cos, sin) for w, (kc, vc) in zip(layers, caches)])
        if {EAGER, GRAPH} & set(names):
            step = model()
            for name in (EAGER, GRAPH):
                if name in names:
                    provs[name] = lambda: step(x, pos)
        if COMPILE in names:
            torch._dynamo.reset()   # a fresh compilation per shape (see make_providers)
            compiled = torch.compile(model(), mode="reduce-overhead", dynamic=False)
            provs[COMPILE] = lambda: compiled(x, pos).clone()
    return provs


class TorchStep(torch.nn.Module):
    """:class:`TorchLayer` s one after another: a step of several layers, ``forward(x, pos)``."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x, pos):
        for layer in self.layers:
            x = layer(x, pos)
        return x


def bench_step_case(config, batch: int, seqlen: int, layers: int, names=PROVIDERS + STEP_PROVIDERS, timer=None,
                    device="cuda", dtype=torch.bfloat16) -> dict:
    """One row of a step of ``layers`` layers (random weights and caches each): each provider's
    µs a layer (the step's time over ``layers``), TB/s of the step's bytes (``layers`` times a
    layer's), error against the float64 layers, and the speedups over the one-launch megakernel
    (``speedup``) and over the megakernel launched per layer (``speedup_per_layer``)."""
    from flashflow.ops.decode_layer import decode_layer_bytes

    nbytes = layers * decode_layer_bytes(config, batch, seqlen - 1, torch.empty((), dtype=dtype).element_size())
    row = {"batch": batch, "seqlen": seqlen, "layers": layers, "bytes": nbytes, "us": {}, "tbs": {}, "rel_err": {},
           "errors": {}}
    row["l2_copies"] = timing.rotation(nbytes, timing.l2_bytes()) if torch.device(device).type == "cuda" else 1
    x, ws, caches = None, [], []
    for i in range(layers):
        xi, w, kc, vc = make_inputs(config, batch, seqlen, dtype, device, seed=2 * i)
        x = xi if x is None else x
        ws.append(w)
        caches.append((kc, vc))
    ref = x.double()
    for w, (kc, vc) in zip(ws, caches):   # a layer at a time in float64 (the caches' copies are large)
        ref = reference(config, ref, w, kc, vc)
    _time_providers(row, make_step_providers(config, x, ws, caches, names), ref, timer, layers)
    for key, base in (("speedup", LAYERS), ("speedup_per_layer", MEGAKERNEL)):
        t0 = row["us"].get(base)
        row[key] = {n: t / t0 for n, t in row["us"].items() if t0 and n != base}
    return row


def _time_providers(row: dict, provs: dict, ref, timer, layers: int = 1) -> None:
    """Each provider's relative error against ``ref``, µs (over ``layers``) and TB/s of
    ``row["bytes"]`` into ``row``; a provider that fails has its error there instead."""
    for name, fn in provs.items():
        try:
            out = fn()
            row["rel_err"][name] = ((out.double() - ref).norm() / ref.norm()).item()
            ms = timer(name, fn)
        except Exception as e:  # noqa: BLE001 — one provider's failure is its entry
            row["errors"][name] = timing.short_error(e)
            continue
        row["us"][name] = ms * 1e3 / layers
        row["tbs"][name] = row["bytes"] / (ms * 1e-3) / 1e12


def check_args(args) -> str | None:
    """The problem with the suite's options, or None (then ``args.providers`` is a list)."""
    from flashflow.bench.runner import check_timing_and_providers

    layers = getattr(args, "blocks", 1)
    if layers is None:
        layers = args.blocks = 1
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= MAX_LAYERS:
        return f"--blocks (decode-layer: the layers of a step) must be a whole number from 1 to {MAX_LAYERS}, " \
               f"got {layers!r}"
    return check_timing_and_providers(args, PROVIDERS + STEP_PROVIDERS if layers > 1 else PROVIDERS,
                                      "decode-layer")


def run_bench(shapes=SHAPES, providers=PROVIDERS, warmup: int = WARMUP_MS, rep: int = REP_MS, quick: bool = False,
              device="cuda", timer=None, config=None, layers: int = 1) -> dict:
    """The whole suite's result (``timer``, ``device`` and ``config`` are the tests' to change);
    ``layers`` > 1: each provider runs a step of that many layers (:func:`bench_step_case`)."""
    from flashflow.bench import runner
    from flashflow.ops.decode_layer import LLAMA3_8B

    config = config or LLAMA3_8B
    started = datetime.now(timezone.utc)
    result = {"suite": "decode-layer", **runner.environment(started), "dtype": "bf16", "quick": quick,
              "config": {k: getattr(config, k) for k in config.__dataclass_fields__},
              "providers": list(providers), "layers": layers,
              "timing": timing.record("cold-l2", warmup_ms=warmup, rep_ms=rep, return_mode="median",
                                      graph_steps=timing.GRAPH_STEPS, l2_span=timing.L2_SPAN,
                                      eager="torch-eager and torch.compile: their calls, do_bench median"),
              "rows": []}
    timer = timer or default_timer(warmup, rep)
    for i, (b, s) in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] batch {b}, cache {s}", file=sys.stderr, flush=True)
        if layers > 1:
            result["rows"].append(bench_step_case(config, b, s, layers, providers, timer, device))
        else:
            result["rows"].append(bench_case(config, b, s, providers, timer, device))
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return result


def run(args) -> int:
    """Entry point of ``flashflow bench --suite decode-layer`` (quick, providers, warmup, rep, out)."""
    from flashflow.bench import runner

    layers = getattr(args, "blocks", 1) or 1
    result = run_bench(QUICK_SHAPES if args.quick else SHAPES, args.providers, args.warmup, args.rep, args.quick,
                       layers=layers)
    # a step of several layers: a file of its own beside the one-layer suite's
    path = runner.write_result(result, args.out, f"decode-layer-{layers}-layers" if layers > 1 else None)
    print(f"results: {path}")
    print(markdown_table(result))
    return 0


def markdown_table(result: dict) -> str:
    names = result["providers"]
    layers = result.get("layers", 1)
    base = LAYERS if layers > 1 else MEGAKERNEL
    what = (f"a step of {layers} layers, µs a layer; ÷ = the provider's time over the {layers} layers in one launch"
            if layers > 1 else "÷ = the provider's time over the megakernel's")
    lines = [f"{timing.describe(result)} TB/s = weights + KV read + appended row + x and out, over the time; "
             f"{what}.", "",
             "| batch | cache | MB | " + " | ".join(f"{n} µs (TB/s)" for n in names) + " | "
             + " | ".join(f"{n} ÷" for n in names if n != base) + " |",
             "|---:|---:|---:|" + "---:|" * (2 * len(names) - (base in names)) + ""]
    for r in result["rows"]:
        cells = [f"{r['us'][n]:.1f} ({r['tbs'][n]:.2f})" if n in r["us"] else "error" for n in names]
        ratios = [f"{r['speedup'][n]:.2f}" if n in r["speedup"] else "-" for n in names if n != base]
        lines.append(f"| {r['batch']} | {r['seqlen']} | {r['bytes'] / 1e6:.0f} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def report(result: dict) -> str:
    """What ``flashflow bench --from-json`` prints of a decode-layer result."""
    return markdown_table(result)
