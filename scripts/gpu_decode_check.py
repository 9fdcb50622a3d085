"""GPU check of decode attention: bf16/fp16 against float64 on every feature, and CUDA graphs.

Usage (on the device): PYTHONPATH=. python scripts/gpu_decode_check.py [--json OUT]
Exits 1 if any case fails.
"""
from __future__ import annotations

import argparse

import torch

from gpu_cases import Cases

import flashflow
from flashflow.bench.decode import capture_graph
from flashflow.ops.decode import DecodeConfig, DecodePlan
from flashflow.reference.decode import kvcache_attention_ref, to_ft_k, to_ft_v

TOL = 1e-2
_cases = Cases(TOL)
rel, record, results = _cases.rel, _cases.record, _cases.results


def case(dtype, lens, heads=32, kv_heads=8, d=128, capacity=4096, seqlen_q=1, n_new=0, page=None,
         causal=True, window=(-1, -1), softcap=0.0, num_splits=0, kv_layout="NHD", config=None, poison=False,
         merge=None):
    """``poison``: cache rows past each sequence's length hold NaN (what a reused page may hold)."""
    batch = len(lens)
    if page is None:
        k_cache = torch.randn(batch, capacity, kv_heads, d, dtype=dtype, device="cuda")
        table = None
    else:
        per_seq = capacity // page
        nb = batch * per_seq + 5
        k_cache = torch.randn(nb, page, kv_heads, d, dtype=dtype, device="cuda")
        table = torch.randperm(nb, device="cuda")[:batch * per_seq].reshape(batch, per_seq).int()
    v_cache = torch.randn_like(k_cache)
    if kv_layout == "FT":
        k_cache, v_cache = to_ft_k(k_cache), to_ft_v(v_cache)
    q = torch.randn(batch, seqlen_q, heads, d, dtype=dtype, device="cuda")
    k = torch.randn(batch, n_new, kv_heads, d, dtype=dtype, device="cuda") if n_new else None
    v = torch.randn_like(k) if n_new else None
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if poison:
        for c in (k_cache, v_cache):
            for i, n in enumerate(lens):
                pos = torch.arange(n, capacity, device="cuda")
                if page is None:
                    c[i, pos] = float("nan")
                else:
                    c[table[i, pos // page].long(), pos % page] = float("nan")
    ref, ref_lse, ref_k, ref_v = kvcache_attention_ref(
        q.double(), k_cache.double(), v_cache.double(), None if k is None else k.double(),
        None if v is None else v.double(), seqlens, table, causal=causal, window_size=window,
        softcap=softcap, kv_layout=kv_layout)
    plan = None if config is None and merge is None else DecodePlan(
        batch, heads, kv_heads, d, capacity, seqlen_q=seqlen_q, num_splits=num_splits, config=config, merge=merge)
    out, lse = flashflow.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                 block_table=table, causal=causal, window_size=window,
                                                 softcap=softcap, num_splits=num_splits, return_lse=True,
                                                 kv_layout=kv_layout, plan=plan)
    fin = torch.isfinite(ref_lse)
    ok_lse = bool((lse.double()[fin] - ref_lse[fin]).abs().max() < 1e-2) if fin.any() else True
    ok_cache = all(torch.allclose(c.double(), r, rtol=0, atol=0, equal_nan=True)
                   for c, r in ((k_cache, ref_k), (v_cache, ref_v)))
    err = rel(out, ref)
    name = (f"{str(dtype)[6:]} lens={lens} h{heads}/{kv_heads} d{d} sq{seqlen_q} new{n_new} page={page} "
            f"causal={causal} win={window} softcap={softcap} splits={num_splits} {kv_layout}"
            + (f" config={config}" if config else "") + (" NaN past the end" if poison else "")
            + (f" merge={merge}" if merge else ""))
    record(name, err, err <= TOL and ok_lse and ok_cache and torch.isfinite(out).all().item())


def graph_case(dtype, merge=None):
    """Plan once, capture one step in a CUDA graph, replay with new inputs: same as eager."""
    b, h, hk, d, cap = 4, 32, 8, 128, 8192
    plan = flashflow.plan_decode(b, h, hk, d, cap, device="cuda", merge=merge)
    k_cache = torch.randn(b, cap, hk, d, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, 1, h, d, dtype=dtype, device="cuda")
    seqlens = torch.tensor([100, 2000, 5000, 8000], dtype=torch.int32, device="cuda")
    g, out = capture_graph(lambda: plan.run(q, k_cache, v_cache, cache_seqlens=seqlens))
    worst = 0.0
    for step in range(20):
        q.copy_(torch.randn_like(q))
        seqlens.copy_(torch.randint(1, cap, (b,), device="cuda", dtype=torch.int32))
        g.replay()
        ref, _, _, _ = kvcache_attention_ref(q.double(), k_cache.double(), v_cache.double(), cache_seqlens=seqlens)
        eager = plan.run(q, k_cache, v_cache, cache_seqlens=seqlens)
        worst = max(worst, rel(out, ref), (out.float() - eager.float()).abs().max().item())
    record(f"{str(dtype)[6:]} CUDA graph replay x20 (plan, {plan.num_splits} splits, merge={plan.merge})", worst,
           worst <= TOL and bool((plan.counters == 0).all()))


def pdl_case(dtype, num_splits, graph, merge=None):
    """Programmatic dependent launches, back to back with no other kernel between them: step i
    appends a token at position lens0 + i that step i + 1 attends (each step has its own lengths
    tensor, written before the loop). A step releases its dependents before its append and its
    merge, so the next step's grid is placed early; a load issued before its
    ``griddepcontrol.wait`` returned would read the key and value still to be appended. Eager,
    or captured once and replayed (caches reset before each replay)."""
    b, h, hk, d, cap, steps = 3, 32, 8, 128, 4096, 8
    plan = flashflow.plan_decode(b, h, hk, d, cap, device="cuda", num_splits=num_splits, pdl=True, merge=merge)
    k_cache = torch.randn(b, cap, hk, d, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    k0, v0 = k_cache.clone(), v_cache.clone()
    lens0 = torch.tensor([5, 1000, 3000], dtype=torch.int32, device="cuda")
    lens = [lens0 + i for i in range(steps)]
    qs = torch.randn(steps, b, 1, h, d, dtype=dtype, device="cuda")
    ks = torch.randn(steps, b, 1, hk, d, dtype=dtype, device="cuda")
    vs = torch.randn_like(ks)

    def loop():
        return [plan.run(qs[i], k_cache, v_cache, ks[i], vs[i], cache_seqlens=lens[i]) for i in range(steps)]

    refs, rk, rv = [], k0.double(), v0.double()
    for i in range(steps):
        ref, _, rk, rv = kvcache_attention_ref(qs[i].double(), rk, rv, ks[i].double(), vs[i].double(), lens[i])
        refs.append(ref)
    worst, rounds = 0.0, 10 if graph else 3
    g, outs = capture_graph(loop) if graph else (None, None)
    for _ in range(rounds):
        k_cache.copy_(k0)
        v_cache.copy_(v0)
        if graph:
            g.replay()
        else:
            outs = loop()
        torch.cuda.synchronize()
        worst = max([worst] + [rel(o, r) for o, r in zip(outs, refs)])
        if not (torch.equal(k_cache.double(), rk) and torch.equal(v_cache.double(), rv)):
            worst = float("inf")
    record(f"{str(dtype)[6:]} PDL x{steps} appending steps back to back, {num_splits} splits, "
           f"{'graph replays x' + str(rounds) if graph else 'eager x' + str(rounds)} (pdl={plan.pdl}, "
           f"merge={plan.merge})", worst,
           worst <= TOL and plan.pdl and (num_splits == 1 or bool((plan.counters == 0).all())))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    # "pdl": the cases of the options not yet timed (PDL, and the wide merge with and without it)
    ap.add_argument("--cases", choices=("all", "pdl"), default="all")
    args = ap.parse_args()
    for dtype in (torch.bfloat16, torch.float16):
        for splits in (1, 4):
            for graph in (False, True):
                pdl_case(dtype, splits, graph)
        for graph in (False, True):
            pdl_case(dtype, 16, graph, merge="wide")
        # the wide merge: one chunk (GQA 4 rows, 16 splits), chunks (16 rows; d 256), MHA, paged,
        # append, window (empty splits), FT, and graph replays
        case(dtype, [1, 17, 4000], num_splits=16, merge="wide")
        case(dtype, [1, 17, 4000], num_splits=13, merge="wide")
        case(dtype, [7, 4000], n_new=4, seqlen_q=4, num_splits=16, merge="wide")
        case(dtype, [300, 1000], d=256, heads=32, kv_heads=8, capacity=1024, num_splits=16, merge="wide")
        case(dtype, [500, 4000], softcap=30.0, heads=32, kv_heads=32, num_splits=8, merge="wide")
        case(dtype, [4000, 3, 2222], page=64, num_splits=16, merge="wide", poison=True)
        case(dtype, [0, 33, 4000], n_new=1, page=64, num_splits=16, merge="wide")
        case(dtype, [500, 4000], window=(256, 0), num_splits=16, merge="wide")
        case(dtype, [50, 3000], kv_layout="FT", n_new=2, seqlen_q=2, num_splits=7, merge="wide")
        graph_case(dtype, merge="wide")
        if args.cases == "pdl":
            continue
        case(dtype, [1, 17, 1000])
        case(dtype, [1, 17, 1000], num_splits=1)
        case(dtype, [4000, 3, 2222], page=16)
        case(dtype, [4000, 3, 2222], page=256, num_splits=5)
        case(dtype, [0, 33, 4000], n_new=1, page=64)
        case(dtype, [7, 4000], n_new=4, seqlen_q=4)
        case(dtype, [1, 17, 1000], kv_layout="FT")
        case(dtype, [50, 3000], kv_layout="FT", n_new=2, seqlen_q=2, num_splits=3)
        case(dtype, [500, 4000], window=(256, 0))
        case(dtype, [500, 4000], softcap=30.0, heads=32, kv_heads=32)
        case(dtype, [500, 4000], seqlen_q=3, causal=False, heads=16, kv_heads=2, d=64)
        case(dtype, [300, 1000], d=256, heads=8, kv_heads=8, capacity=1024)
        # more (sequence, KV head) programs than SMs, long streams: the 128-token-tile config
        case(dtype, [4096, 1, 3000, 17] * 5, capacity=4096)
        case(dtype, [4096, 1, 3000, 17] * 5, capacity=4096, page=64)
        # explicit configs, paged tiles of one page (table entry read a tile ahead) or over two
        # (rows gathered), over rows past the end that hold NaN
        for cfg in (DecodeConfig(64, 4, 3), DecodeConfig(64, 4, 5), DecodeConfig(128, 4, 3)):
            for page in (None, 64, 128, 256):
                case(dtype, [4096, 1, 3000, 17, 200], capacity=4096, page=page, config=cfg, poison=True)
                case(dtype, [0, 33, 4000], n_new=2, seqlen_q=2, page=page, num_splits=3, config=cfg)
            case(dtype, [500, 4000], window=(256, 0), page=64, num_splits=4, config=cfg, poison=True)
            case(dtype, [500, 4000], softcap=30.0, heads=32, kv_heads=32, page=128, config=cfg)
            case(dtype, [300, 1000], heads=16, kv_heads=2, d=80, capacity=1024, page=64, config=cfg)
        graph_case(dtype)
    _cases.finish("decode GPU cases", args.json)


if __name__ == "__main__":
    main()
