"""`flashflow bench --suite decode`: decode attention against a KV cache, in effective TB/s.

Effective bandwidth = bytes of the K and V cache that one decode step must read (batch ·
kv_heads · seqlen · head_dim · 2 tensors · element size: 2 bytes for bf16/fp16, 1 for an FP8
cache) over the median time. The ceiling is measured in the same run: a large read-only
reduction (``torch.sum`` over 4 GiB), the best bandwidth a kernel that only reads can reach on
this card.

Providers, timed in the same run on caches holding the same values:
  * ``flashflow`` — contiguous cache, :class:`flashflow.DecodePlan` (planned once);
  * ``flashflow-paged`` — the same cache as 64-token pages behind a shuffled block table;
  * ``flashflow-paged-ordered`` — the same pages with the table in allocation order (diagnostic);
  * ``flashflow-append`` / ``flashflow-paged-append`` / ``flashflow-ft-append`` — a serving step:
    the new token's K/V written in-kernel at ``cache_seqlens = seqlen - 1``, then attention over
    all ``seqlen`` keys, on the contiguous cache, the shuffled pages, and the FasterTransformer
    layout (K ``(b, hk, d/x, s, x)``, V ``(b, hk, s, d)``). The token is the one already at that
    slot, so every step rewrites the same values and the output stays sdpa-flash's;
  * ``flashflow-fp8-append`` / ``flashflow-fp8-paged-append`` / ``flashflow-fp8-ft-append`` — the
    same three on a ``float8_e4m3fn`` cache (:func:`flashflow.quantize_kv_cache`, per-KV-head
    scales; FT's x = 16), with their own plan (``kv_dtype=torch.float8_e4m3fn``); their TB/s count
    1 byte an element;
  * ``sdpa-cudnn`` / ``sdpa-flash`` — ``scaled_dot_product_attention`` on the (b, h, s, d) cache,
    ``enable_gqa=True`` (or K/V expanded to every query head if the backend refuses GQA:
    the row says so, and its effective TB/s still counts the unexpanded bytes).
Errors (``rel_err``): relative L2 error against sdpa-flash for the providers that only read and
for ``flashflow-append``; against ``flashflow-append``'s output for the other append providers
(for the FP8 ones: the error of the FP8 cache, also ``fp8_rel_err_vs_bf16``).
Each is timed as CUDA-graph replays of 16 back-to-back steps (what a serving loop runs) and,
beside, as plain eager launches. Caches smaller than three L2s are cloned and the steps cycle
through the clones (up to 16), so a step does not find the previous step's cache in L2: in a
model the other layers' weights have flushed it (METHOD: repeated runs over one buffer measure
the cache). Below ~9 MB of KV the clones still fit in L2; those rows stay cache-warm. FP8 caches
count their clones from their own (halved) bytes.
"""
from __future__ import annotations

import sys
from datetime import datetime, timezone

import torch

from flashflow.bench import timing
from flashflow.bench.timing import GRAPH_STEPS, cycling, rotation

PAGE_SIZE = 64


def decode_shapes(quick: bool):
    """(batch, seqlen, heads, kv_heads, head_dim): the issue's grid, capped at 8 GiB of cache, and
    the serving points (b, s) = (1, 2k), (1, 8k), (1, 32k), (8, 8k), (16, 16k) in GQA 32/8."""
    serving = [(1, 2048), (1, 8192), (1, 32768), (8, 8192), (16, 16384)]
    if quick:
        pts = [(1, 1024), (1, 8192), (1, 32768), (32, 4096), (16, 16384)]
        pts = sorted(dict.fromkeys(pts + serving))
        return [(b, s, 32, 8, 128) for b, s in pts] + [(1, 8192, 32, 32, 128), (32, 4096, 32, 32, 128)]
    shapes = []
    for heads, kv_heads in ((32, 8), (32, 32)):
        for b in (1, 4, 16, 32, 64):
            for s in (512, 1024, 4096, 8192, 16384, 32768, 131072):
                if b * kv_heads * s * 128 * 2 * 2 <= 8 * 2**30:
                    shapes.append((b, s, heads, kv_heads, 128))
    shapes = list(dict.fromkeys(shapes + [(b, s, 32, 8, 128) for b, s in serving]))
    return sorted(shapes, key=lambda x: (x[3], x[0], x[1]))


def kv_bytes(b, s, kv_heads, d, elt=2):
    return 2 * b * kv_heads * s * d * elt


def paged_copy(k_cache, v_cache, page: int, generator=None):
    """The same contiguous ``(b, s, hk, d)`` caches as pages ``(b·s/page, page, hk, d)`` in a
    shuffled order, with the int32 block table ``(b, s/page)`` that reads them back."""
    b, s, hk, d = k_cache.shape
    per_seq = s // page
    table = torch.randperm(b * per_seq, device=k_cache.device, generator=generator).reshape(b, per_seq).int()
    pages = []
    for c in (k_cache, v_cache):
        p = torch.empty(b * per_seq, page, hk, d, device=c.device, dtype=c.dtype)
        p[table.flatten().long()] = c[:, :per_seq * page].reshape(b * per_seq, page, hk, d)
        pages.append(p)
    return pages[0], pages[1], table


def make_providers(b, s, h, hk, d, dtype):
    """``(providers, notes, rel_err, meta)``: the timed callables by name, notes on how some ran,
    each output's relative L2 error (see the module's docstring) and ``meta``: ``num_splits``,
    ``splits_fp8``, ``cache_copies``, ``cache_copies_fp8`` and ``bytes``, the KV bytes one step of
    each provider reads (FP8: 1 byte an element)."""
    import flashflow
    from flashflow.reference.decode import to_ft_k, to_ft_v

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=dtype, generator=g)
    k_cache = torch.randn(b, s, hk, d, device="cuda", dtype=dtype, generator=g)
    v_cache = torch.randn(b, s, hk, d, device="cuda", dtype=dtype, generator=g)
    seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    plan = flashflow.plan_decode(b, h, hk, d, s, device="cuda")
    l2 = timing.l2_bytes()
    nbytes, nbytes8 = kv_bytes(b, s, hk, d), kv_bytes(b, s, hk, d, elt=1)
    copies, copies8 = rotation(nbytes, l2), rotation(nbytes8, l2)

    def clones(*ts, n=copies):
        """``n`` sets of the same values (copy 0 is the tensors themselves)."""
        return [ts] + [tuple(t.clone() for t in ts) for _ in range(n - 1)]

    kv = clones(k_cache, v_cache)
    provs = {"flashflow": cycling(lambda i: lambda: plan.run(q, *kv[i], cache_seqlens=seqlens), copies)}

    k_pages, v_pages, table = paged_copy(k_cache, v_cache, PAGE_SIZE, generator=g)
    per_seq = s // PAGE_SIZE
    pages = clones(k_pages, v_pages)
    provs["flashflow-paged"] = cycling(
        lambda i: lambda: plan.run(q, *pages[i], cache_seqlens=seqlens, block_table=table), copies)
    # diagnostic: the same pages in allocation order; the gap to the shuffled table is the cost
    # of scattered pages in memory (TLB, DRAM locality), not of the table lookup itself
    ordered = torch.arange(b * per_seq, device="cuda", dtype=torch.int32).reshape(b, per_seq)
    provs["flashflow-paged-ordered"] = cycling(
        lambda i: lambda: plan.run(q, *(t.view(b * per_seq, PAGE_SIZE, hk, d) for t in kv[i]),
                                   cache_seqlens=seqlens, block_table=ordered), copies)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt = q.transpose(1, 2)
    # SDPA's own (b, h, s, d) cache
    kvt = clones(k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous())

    # a serving step: the new token written in-kernel at slot s - 1, then attention over all s
    # keys. The token is the one already there, so every step rewrites the same values: the
    # append providers share the caches above and their output stays the reference's
    k_new, v_new = k_cache[:, s - 1:s].clone(), v_cache[:, s - 1:s].clone()
    before = torch.full((b,), s - 1, dtype=torch.int32, device="cuda")
    provs["flashflow-append"] = cycling(
        lambda i: lambda: plan.run(q, *kv[i], k_new, v_new, cache_seqlens=before), copies)
    provs["flashflow-paged-append"] = cycling(
        lambda i: lambda: plan.run(q, *pages[i], k_new, v_new, cache_seqlens=before, block_table=table), copies)
    # FasterTransformer: K (b, hk, d/x, s, x) of its own; V (b, hk, s, d) is SDPA's cache
    ft = [(kf, vt[1]) for (kf,), vt in zip(clones(to_ft_k(k_cache)), kvt)]
    provs["flashflow-ft-append"] = cycling(
        lambda i: lambda: plan.run(q, *ft[i], k_new, v_new, cache_seqlens=before, kv_layout="FT"), copies)
    meta = {"num_splits": plan.num_splits, "splits_fp8": None, "cache_copies": copies, "cache_copies_fp8": None,
            "bytes": {}}

    def fp8_providers():
        """The append providers on an FP8 copy of the caches, with their own plan."""
        fp8 = torch.float8_e4m3fn
        plan8 = flashflow.plan_decode(b, h, hk, d, s, device="cuda", kv_dtype=fp8)
        k8, ks = flashflow.quantize_kv_cache(k_cache)
        v8, vs = flashflow.quantize_kv_cache(v_cache)
        scales = {"k_scale": ks, "v_scale": vs}
        kv8 = clones(k8, v8, n=copies8)
        # pages and FT layout moved as bytes (index_put and permuted copies of FP8 may be missing)
        kp8, vp8, table8 = paged_copy(k8.view(torch.uint8), v8.view(torch.uint8), PAGE_SIZE, generator=g)
        pages8 = clones(kp8.view(fp8), vp8.view(fp8), n=copies8)
        ft8 = clones(to_ft_k(k8.view(torch.uint8)).view(fp8), to_ft_v(v8.view(torch.uint8)).view(fp8), n=copies8)
        return plan8.num_splits, {
            "flashflow-fp8-append": cycling(
                lambda i: lambda: plan8.run(q, *kv8[i], k_new, v_new, cache_seqlens=before, **scales), copies8),
            "flashflow-fp8-paged-append": cycling(
                lambda i: lambda: plan8.run(q, *pages8[i], k_new, v_new, cache_seqlens=before, block_table=table8,
                                            **scales), copies8),
            "flashflow-fp8-ft-append": cycling(
                lambda i: lambda: plan8.run(q, *ft8[i], k_new, v_new, cache_seqlens=before, kv_layout="FT",
                                            **scales), copies8)}

    notes = {}
    try:
        splits8, provs8 = fp8_providers()
        provs.update(provs8)
        meta.update(splits_fp8=splits8, cache_copies_fp8=copies8)
    except Exception as e:  # noqa: BLE001 — keep the 16-bit providers' row
        notes["flashflow-fp8"] = f"not run: {type(e).__name__}: {e}"[:200]
        print(f"  flashflow-fp8 providers {notes['flashflow-fp8']}", file=sys.stderr, flush=True)
    if "flashflow-fp8-append" not in provs:
        torch.cuda.empty_cache()   # what a failed fp8_providers() held

    for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        def gqa(i, backend=backend):
            def step():
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(qt, *kvt[i], enable_gqa=hk != h)
            return step
        try:
            gqa(0)()
            provs[name] = cycling(gqa, copies)
        except Exception:  # noqa: BLE001 — fall back to K/V expanded to every query head
            kve = [tuple(t.repeat_interleave(h // hk, 1) for t in pair) for pair in kvt]

            def expanded(i, backend=backend, kve=kve):
                def step():
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(qt, *kve[i])
                return step
            provs[name] = cycling(expanded, copies)
            notes[name] = "K/V expanded to all query heads (backend refused enable_gqa)"
    meta["bytes"] = {name: nbytes8 if name.startswith("flashflow-fp8") else nbytes for name in provs}

    def rel_err(o, ref):
        return ((o.float() - ref).norm() / ref.norm()).item()
    ref = provs["sdpa-flash"]().transpose(1, 2).float()
    errs = {}
    for name in ("flashflow", "flashflow-paged", "flashflow-paged-ordered", "flashflow-append"):
        errs[name] = rel_err(provs[name](), ref)
    # the other append providers against flashflow-append (FP8: the error of the FP8 cache)
    ref_append = provs["flashflow-append"]().float()
    for name in provs:
        if name.endswith("-append") and name != "flashflow-append":
            errs[name] = rel_err(provs[name](), ref_append)
    return provs, notes, errs, meta


def run(args) -> int:
    """Entry point of ``flashflow bench --suite decode`` (args: quick, dtype, warmup, rep, out)."""
    from flashflow.bench import runner

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    started = datetime.now(timezone.utc)
    env = runner.environment(started)
    print("measuring the read ceiling (a 2 GiB reduction)", file=sys.stderr, flush=True)
    ceiling = timing.read_ceiling_tbs()
    print(f"measured read ceiling: {ceiling:.2f} TB/s", flush=True)
    rows = []
    shapes = decode_shapes(args.quick)
    for i, (b, s, h, hk, d) in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] b{b} s{s} h{h}/{hk}", file=sys.stderr, flush=True)
        nbytes = kv_bytes(b, s, hk, d)
        row = {"batch": b, "seqlen": s, "heads": h, "kv_heads": hk, "head_dim": d, "kv_mbytes": nbytes / 1e6}
        try:
            provs, notes, errs, meta = make_providers(b, s, h, hk, d, dtype)
        except torch.cuda.OutOfMemoryError:
            row["error"] = "OOM"
            rows.append(row)
            torch.cuda.empty_cache()
            continue
        row.update(num_splits=meta["num_splits"], splits_fp8=meta["splits_fp8"], cache_copies=meta["cache_copies"],
                   cache_copies_fp8=meta["cache_copies_fp8"], notes=notes, rel_err=errs, graph_us={}, eager_us={},
                   tbs={})
        ms = {}
        for name, fn in provs.items():
            try:
                tg = timing.graph_ms(fn, GRAPH_STEPS, args.warmup, args.rep)
            except Exception as e:  # noqa: BLE001
                tg = None
                row["notes"][name] = f"graph capture failed: {type(e).__name__}"
            te = timing.warm_ms(fn, args.warmup, args.rep)
            row["graph_us"][name] = None if tg is None else tg * 1e3
            row["eager_us"][name] = te * 1e3
            best = ms[name] = tg if tg is not None else te
            row["tbs"][name] = meta["bytes"][name] / (best * 1e-3) / 1e12
        ff, cu = row["tbs"]["flashflow"], row["tbs"].get("sdpa-cudnn")
        row["vs_cudnn"] = ff / cu if cu else None
        row["pct_ceiling"] = 100 * ff / ceiling
        row["paged_vs_contig"] = row["tbs"]["flashflow-paged"] / ff
        row["paged_ordered_vs_contig"] = row["tbs"]["flashflow-paged-ordered"] / ff
        # time ratios: > 1 where the second named runs faster
        row["ft_vs_contig"] = ms["flashflow-append"] / ms["flashflow-ft-append"]
        fp8 = ms.get("flashflow-fp8-append")
        row["fp8_vs_cudnn"] = ms["sdpa-cudnn"] / fp8 if fp8 and "sdpa-cudnn" in ms else None
        row["fp8_rel_err_vs_bf16"] = errs.get("flashflow-fp8-append")
        row["fp8_bytes_ratio"] = kv_bytes(b, s, hk, d, elt=1) / nbytes
        rows.append(row)
        del provs
        torch.cuda.empty_cache()
    result = {"suite": "decode", **env, "dtype": args.dtype, "read_ceiling_tbs": ceiling,
              "timing": timing.record("cold-l2", warmup_ms=args.warmup, rep_ms=args.rep, return_mode="median",
                                      graph_steps=GRAPH_STEPS, l2_span=timing.L2_SPAN,
                                      eager_us="the same cycling calls launched eagerly (do_bench median)"),
              "graph_steps": GRAPH_STEPS, "page_size": PAGE_SIZE, "rows": rows}
    path = runner.write_result(result, args.out)
    print(f"results: {path}")
    print(markdown_table(result))
    return 0


def markdown_table(result) -> str:
    """The rows as markdown: the read-only providers against SDPA and, for results that have them
    (rows without these keys, e.g. OOM or older results, are skipped), a second table of the
    append providers: contiguous, paged and FasterTransformer caches, in 16 bits and in FP8."""
    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)
    lines = [f"read ceiling {result['read_ceiling_tbs']:.2f} TB/s; TB/s = KV bytes / median time "
             f"(CUDA graph of {result['graph_steps']} steps, cycling through `copies` clones of the caches)", "",
             "| batch | seqlen | heads q/kv | KV MB | splits | copies | flashflow TB/s | paged TB/s | cuDNN TB/s | FLASH TB/s "
             "| ÷ cuDNN | % ceiling | paged ÷ contig | pages in order ÷ contig | flashflow µs (graph / eager) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['seqlen']} | {r['heads']}/{r['kv_heads']} | {r['kv_mbytes']:.0f} "
                         f"| {r['error']} ||||||||||")
            continue
        t = r["tbs"]
        g, e = r["graph_us"]["flashflow"], r["eager_us"]["flashflow"]
        lines.append(
            f"| {r['batch']} | {r['seqlen']} | {r['heads']}/{r['kv_heads']} | {r['kv_mbytes']:.0f} | {r['num_splits']} "
            f"| {r.get('cache_copies', 1)} "
            f"| {f(t['flashflow'])} | {f(t['flashflow-paged'])} | {f(t.get('sdpa-cudnn'))} | {f(t.get('sdpa-flash'))} "
            f"| {f(r['vs_cudnn'])} | {r['pct_ceiling']:.0f}% | {r['paged_vs_contig']:.2f} "
            f"| {f(r.get('paged_ordered_vs_contig'))} | {f(g, '{:.1f}')} / {e:.1f} |")
    appended = [r for r in result["rows"] if "flashflow-append" in r.get("tbs", {})]
    if not appended:
        return "\n".join(lines)
    lines += ["", "Serving step: the new token's K/V appended in-kernel, then attention over the whole cache; "
              "FT = FasterTransformer layout, FP8 = `float8_e4m3fn` cache with per-KV-head scales, its TB/s "
              "counting 1 byte an element (half the 16-bit bytes). FT ÷ contig = contiguous time / FT time; "
              "FP8 ÷ cuDNN = cuDNN's time (16-bit cache) / FP8 time, a speedup; FP8 rel err = "
              "‖o_fp8 − o_16bit‖ / ‖o_16bit‖ of the two contiguous append providers.", "",
              "| batch | seqlen | heads q/kv | splits (FP8) | append TB/s | paged+append TB/s | FT+append TB/s "
              "| FT ÷ contig | FP8+append TB/s | FP8 paged+append TB/s | FP8 FT+append TB/s | FP8 ÷ cuDNN (speedup) "
              "| FP8 rel err |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in appended:
        t = r["tbs"]
        lines.append(
            f"| {r['batch']} | {r['seqlen']} | {r['heads']}/{r['kv_heads']} "
            f"| {r['num_splits']} ({f(r.get('splits_fp8'), '{}')}) "
            f"| {f(t.get('flashflow-append'))} | {f(t.get('flashflow-paged-append'))} "
            f"| {f(t.get('flashflow-ft-append'))} | {f(r.get('ft_vs_contig'))} "
            f"| {f(t.get('flashflow-fp8-append'))} | {f(t.get('flashflow-fp8-paged-append'))} "
            f"| {f(t.get('flashflow-fp8-ft-append'))} | {f(r.get('fp8_vs_cudnn'))} "
            f"| {f(r.get('fp8_rel_err_vs_bf16'), '{:.4f}')} |")
    return "\n".join(lines)


def report(result: dict) -> str:
    """What ``flashflow bench --from-json`` prints of a decode result."""
    return markdown_table(result)
