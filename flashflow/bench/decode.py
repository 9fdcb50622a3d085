"""`flashflow bench --suite decode`: decode attention against a KV cache, in effective TB/s.

Effective bandwidth = bytes of the K and V cache that one decode step must read (batch ·
kv_heads · seqlen · head_dim · 2 tensors · element size) over the median time. The ceiling is
measured in the same run: a large read-only reduction (``torch.sum`` over 4 GiB), the best
bandwidth a kernel that only reads can reach on this card.

Providers, timed in the same run on caches holding the same values:
  * ``flashflow`` — contiguous cache, :class:`flashflow.DecodePlan` (planned once);
  * ``flashflow-paged`` — the same cache as 64-token pages behind a shuffled block table;
  * ``flashflow-paged-ordered`` — the same pages with the table in allocation order (diagnostic);
  * ``sdpa-cudnn`` / ``sdpa-flash`` — ``scaled_dot_product_attention`` on the (b, h, s, d) cache,
    ``enable_gqa=True`` (or K/V expanded to every query head if the backend refuses GQA:
    the row says so, and its effective TB/s still counts the unexpanded bytes).
Each is timed as CUDA-graph replays of 16 back-to-back steps (what a serving loop runs) and,
beside, as plain eager launches. Caches smaller than three L2s are cloned and the steps cycle
through the clones (up to 16), so a step does not find the previous step's cache in L2: in a
model the other layers' weights have flushed it (METHOD: repeated runs over one buffer measure
the cache). Below ~9 MB of KV the clones still fit in L2; those rows stay cache-warm.
"""
from __future__ import annotations

import itertools
import math
import sys
from datetime import datetime, timezone

import torch

GRAPH_STEPS = 16
PAGE_SIZE = 64


def decode_shapes(quick: bool):
    """(batch, seqlen, heads, kv_heads, head_dim): the issue's grid, capped at 8 GiB of cache."""
    if quick:
        pts = [(1, 1024), (1, 8192), (1, 32768), (32, 4096), (16, 16384)]
        return [(b, s, 32, 8, 128) for b, s in pts] + [(1, 8192, 32, 32, 128), (32, 4096, 32, 32, 128)]
    shapes = []
    for heads, kv_heads in ((32, 8), (32, 32)):
        for b in (1, 4, 16, 32, 64):
            for s in (512, 1024, 4096, 8192, 16384, 32768, 131072):
                if b * kv_heads * s * 128 * 2 * 2 <= 8 * 2**30:
                    shapes.append((b, s, heads, kv_heads, 128))
    return shapes


def kv_bytes(b, s, kv_heads, d, elt=2):
    return 2 * b * kv_heads * s * d * elt


def read_ceiling_tbs() -> float:
    """Best of a few large read-only reductions (bytes read / time)."""
    import triton

    x = torch.randn(2**31 // 2, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    y = torch.randn(2**31 // 2, device="cuda", dtype=torch.bfloat16)
    best = 0.0
    for fn in (lambda: x.sum(dtype=torch.float32), lambda: y.view(-1, 8192).sum(dim=1, dtype=torch.float32)):
        t = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        best = max(best, x.numel() * 2 / (t * 1e-3) / 1e12)
    del x, y
    return best


def capture_graph(fn, steps: int = 1):
    """``(graph, output of the last captured call)`` of ``steps`` back-to-back calls of ``fn``,
    after one warm-up call on a side stream (compiles, and allocations stay out of the graph)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(g):
        for _ in range(steps):
            out = fn()
    return g, out


def graph_time_ms(fn, steps=GRAPH_STEPS, warmup: int = 25, rep: int = 100) -> float:
    """Median time of one call, from CUDA-graph replays of ``steps`` back-to-back calls (what a
    serving loop runs: no launch gaps, no Python in the loop)."""
    import triton

    g, _ = capture_graph(fn, steps)
    ms = triton.testing.do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median") / steps
    del g
    return ms


def _eager_time_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    import triton

    fn()
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def rotation(nbytes: int, l2_bytes: int, steps: int = GRAPH_STEPS) -> int:
    """How many copies of a step's inputs the timed steps cycle through: enough that one pass
    over them is three L2s, at most ``steps``."""
    return max(1, min(steps, math.ceil(3 * l2_bytes / max(nbytes, 1))))


def cycling(make, copies: int):
    """A zero-argument callable that runs ``make(i)``'s callables in turn, i = 0..copies-1."""
    it = itertools.cycle([make(i) for i in range(copies)])
    return lambda: next(it)()


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
    import flashflow

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=dtype, generator=g)
    k_cache = torch.randn(b, s, hk, d, device="cuda", dtype=dtype, generator=g)
    v_cache = torch.randn(b, s, hk, d, device="cuda", dtype=dtype, generator=g)
    seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    plan = flashflow.plan_decode(b, h, hk, d, s, device="cuda")
    copies = rotation(kv_bytes(b, s, hk, d), torch.cuda.get_device_properties(0).L2_cache_size)

    def clones(*ts):
        """``copies`` sets of the same values (copy 0 is the tensors themselves)."""
        return [ts] + [tuple(t.clone() for t in ts) for _ in range(copies - 1)]

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
    notes = {}
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
    ref = provs["sdpa-flash"]().transpose(1, 2).float()
    errs = {}
    for name in ("flashflow", "flashflow-paged", "flashflow-paged-ordered"):
        o = provs[name]().float()
        errs[name] = ((o - ref).norm() / ref.norm()).item()
    return provs, notes, errs, plan.num_splits, copies


def run(args) -> int:
    """Entry point of ``flashflow bench --suite decode`` (args: quick, dtype, warmup, rep, out)."""
    from flashflow.bench import runner

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    started = datetime.now(timezone.utc)
    env = runner.environment(started)
    print("measuring the read ceiling (a 2 GiB reduction)", file=sys.stderr, flush=True)
    ceiling = read_ceiling_tbs()
    print(f"measured read ceiling: {ceiling:.2f} TB/s", flush=True)
    rows = []
    shapes = decode_shapes(args.quick)
    for i, (b, s, h, hk, d) in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] b{b} s{s} h{h}/{hk}", file=sys.stderr, flush=True)
        nbytes = kv_bytes(b, s, hk, d)
        row = {"batch": b, "seqlen": s, "heads": h, "kv_heads": hk, "head_dim": d, "kv_mbytes": nbytes / 1e6}
        try:
            provs, notes, errs, splits, copies = make_providers(b, s, h, hk, d, dtype)
        except torch.cuda.OutOfMemoryError:
            row["error"] = "OOM"
            rows.append(row)
            torch.cuda.empty_cache()
            continue
        row.update(num_splits=splits, cache_copies=copies, notes=notes, rel_err=errs, graph_us={}, eager_us={}, tbs={})
        for name, fn in provs.items():
            try:
                tg = graph_time_ms(fn, warmup=args.warmup, rep=args.rep)
            except Exception as e:  # noqa: BLE001
                tg = None
                row["notes"][name] = f"graph capture failed: {type(e).__name__}"
            te = _eager_time_ms(fn, args.warmup, args.rep)
            row["graph_us"][name] = None if tg is None else tg * 1e3
            row["eager_us"][name] = te * 1e3
            best = tg if tg is not None else te
            row["tbs"][name] = nbytes / (best * 1e-3) / 1e12
        ff, cu = row["tbs"]["flashflow"], row["tbs"].get("sdpa-cudnn")
        row["vs_cudnn"] = ff / cu if cu else None
        row["pct_ceiling"] = 100 * ff / ceiling
        row["paged_vs_contig"] = row["tbs"]["flashflow-paged"] / ff
        row["paged_ordered_vs_contig"] = row["tbs"]["flashflow-paged-ordered"] / ff
        rows.append(row)
        del provs
        torch.cuda.empty_cache()
    result = {"suite": "decode", **env, "dtype": args.dtype, "read_ceiling_tbs": ceiling,
              "timing": {"warmup_ms": args.warmup, "rep_ms": args.rep, "return_mode": "median"},
              "graph_steps": GRAPH_STEPS, "page_size": PAGE_SIZE, "rows": rows}
    path = runner.write_result(result, args.out)
    print(f"results: {path}")
    print(markdown_table(result))
    return 0


def markdown_table(result) -> str:
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

        def f(x, fmt="{:.2f}"):
            return "-" if x is None else fmt.format(x)
        g, e = r["graph_us"]["flashflow"], r["eager_us"]["flashflow"]
        lines.append(
            f"| {r['batch']} | {r['seqlen']} | {r['heads']}/{r['kv_heads']} | {r['kv_mbytes']:.0f} | {r['num_splits']} "
            f"| {r.get('cache_copies', 1)} "
            f"| {f(t['flashflow'])} | {f(t['flashflow-paged'])} | {f(t.get('sdpa-cudnn'))} | {f(t.get('sdpa-flash'))} "
            f"| {f(r['vs_cudnn'])} | {r['pct_ceiling']:.0f}% | {r['paged_vs_contig']:.2f} "
            f"| {f(r.get('paged_ordered_vs_contig'))} | {f(g, '{:.1f}')} / {e:.1f} |")
    return "\n".join(lines)
