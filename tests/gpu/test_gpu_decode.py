"""Decode attention on the GPU, bf16 and fp16 against float64: contiguous, paged and FT caches,
in-kernel append, ragged lengths, window, softcap, explicit configs over rows past the end that
hold NaN, plan/run under CUDA-graph replay, and appending steps back to back."""
import pytest
import torch

import flashflow
from flashflow.ops.decode import DecodePlan
from flashflow.reference.decode import kvcache_attention_ref, to_ft_k, to_ft_v
from flashflow.tuning.decode import DecodeConfig

pytestmark = pytest.mark.gpu
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _case(lens, heads=32, kv_heads=8, d=128, capacity=4096, seqlen_q=1, n_new=0, page=None, causal=True,
          window=(-1, -1), softcap=0.0, num_splits=0, kv_layout="NHD", config=None, poison=False):
    return dict(lens=lens, heads=heads, kv_heads=kv_heads, d=d, capacity=capacity, seqlen_q=seqlen_q,
                n_new=n_new, page=page, causal=causal, window=window, softcap=softcap, num_splits=num_splits,
                kv_layout=kv_layout, config=config, poison=poison)


CASES = {
    "ragged": _case([1, 17, 1000]),
    "ragged-one-split": _case([1, 17, 1000], num_splits=1),
    "paged16": _case([4000, 3, 2222], page=16),
    "paged256-5splits": _case([4000, 3, 2222], page=256, num_splits=5),
    "paged64-append-empty-seq": _case([0, 33, 4000], n_new=1, page=64),
    "append4-sq4": _case([7, 4000], n_new=4, seqlen_q=4),
    "ft": _case([1, 17, 1000], kv_layout="FT"),
    "ft-append-3splits": _case([50, 3000], kv_layout="FT", n_new=2, seqlen_q=2, num_splits=3),
    "window": _case([500, 4000], window=(256, 0)),
    "softcap-mha": _case([500, 4000], softcap=30.0, heads=32, kv_heads=32),
    "non-causal-sq3-d64": _case([500, 4000], seqlen_q=3, causal=False, heads=16, kv_heads=2, d=64),
    "d256": _case([300, 1000], d=256, heads=8, kv_heads=8, capacity=1024),
    # more (sequence, KV head) programs than SMs, long streams: the 128-token-tile config
    "many-programs": _case([4096, 1, 3000, 17] * 5),
    "many-programs-paged": _case([4096, 1, 3000, 17] * 5, page=64),
    # split merges: 16 partials of 4 rows, 13, 16 rows (seqlen_q 4), d 256, MHA, paged, windows
    "16splits": _case([1, 17, 4000], num_splits=16),
    "13splits": _case([1, 17, 4000], num_splits=13),
    "16splits-append-sq4": _case([7, 4000], n_new=4, seqlen_q=4, num_splits=16),
    "16splits-d256": _case([300, 1000], d=256, capacity=1024, num_splits=16),
    "8splits-softcap-mha": _case([500, 4000], softcap=30.0, kv_heads=32, num_splits=8),
    "16splits-paged-nan-past-end": _case([4000, 3, 2222], page=64, num_splits=16, poison=True),
    "16splits-window": _case([500, 4000], window=(256, 0), num_splits=16),
}
# explicit configs; paged tiles of one page (table entry read a tile ahead) or over two (rows
# gathered), over rows past the end that hold NaN
for _n, _w, _s in ((64, 4, 3), (64, 4, 5), (128, 4, 3)):
    _cfg = DecodeConfig(BLOCK_N=_n, num_warps=_w, num_stages=_s)
    _tag = f"cfg{_n}x{_s}"
    for _page in (None, 64, 128, 256):
        _p = f"page{_page}" if _page else "contig"
        CASES[f"{_tag}-{_p}-nan-past-end"] = _case([4096, 1, 3000, 17, 200], page=_page, config=_cfg, poison=True)
        CASES[f"{_tag}-{_p}-append-3splits"] = _case([0, 33, 4000], n_new=2, seqlen_q=2, page=_page,
                                                     num_splits=3, config=_cfg)
    CASES[f"{_tag}-window-page64-nan-past-end"] = _case([500, 4000], window=(256, 0), page=64, num_splits=4,
                                                        config=_cfg, poison=True)
    CASES[f"{_tag}-softcap-mha-page128"] = _case([500, 4000], softcap=30.0, kv_heads=32, page=128, config=_cfg)
    CASES[f"{_tag}-d80-page64"] = _case([300, 1000], heads=16, kv_heads=2, d=80, capacity=1024, page=64,
                                        config=_cfg)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_decode_against_float64(gpu, dtype, name):
    c = CASES[name]
    lens, cap, page, kv_heads, d = c["lens"], c["capacity"], c["page"], c["kv_heads"], c["d"]
    batch = len(lens)
    if page is None:
        k_cache = torch.randn(batch, cap, kv_heads, d, dtype=dtype, device="cuda")
        table = None
    else:
        per_seq = cap // page
        blocks = batch * per_seq + 5
        k_cache = torch.randn(blocks, page, kv_heads, d, dtype=dtype, device="cuda")
        table = torch.randperm(blocks, device="cuda")[:batch * per_seq].reshape(batch, per_seq).int()
    v_cache = torch.randn_like(k_cache)
    if c["poison"]:   # what a reused page may hold past a sequence's end
        for cache in (k_cache, v_cache):
            for i, n in enumerate(lens):
                pos = torch.arange(n, cap, device="cuda")
                if page is None:
                    cache[i, pos] = float("nan")
                else:
                    cache[table[i, pos // page].long(), pos % page] = float("nan")
    if c["kv_layout"] == "FT":
        k_cache, v_cache = to_ft_k(k_cache), to_ft_v(v_cache)
    q = torch.randn(batch, c["seqlen_q"], c["heads"], d, dtype=dtype, device="cuda")
    k = torch.randn(batch, c["n_new"], kv_heads, d, dtype=dtype, device="cuda") if c["n_new"] else None
    v = torch.randn_like(k) if c["n_new"] else None
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ref, ref_lse, ref_k, ref_v = kvcache_attention_ref(
        q.double(), k_cache.double(), v_cache.double(), None if k is None else k.double(),
        None if v is None else v.double(), seqlens, table, causal=c["causal"], window_size=c["window"],
        softcap=c["softcap"], kv_layout=c["kv_layout"])
    plan = None
    if c["config"] is not None:
        plan = DecodePlan(batch, c["heads"], kv_heads, d, cap, seqlen_q=c["seqlen_q"], num_splits=c["num_splits"],
                          config=c["config"])
    out, lse = flashflow.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table, causal=c["causal"],
        window_size=c["window"], softcap=c["softcap"], num_splits=c["num_splits"], return_softmax_lse=True,
        kv_layout=c["kv_layout"], plan=plan)
    assert torch.isfinite(out).all()
    assert gpu.rel(out, ref) <= gpu.tol
    fin = torch.isfinite(ref_lse)
    if fin.any():
        assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-2
    # the appended tokens land exactly where they belong, nothing else changes
    assert torch.allclose(k_cache.double(), ref_k, rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(v_cache.double(), ref_v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_plan_graph_replays_match_eager_and_float64(gpu, dtype):
    b, h, hk, d, cap = 4, 32, 8, 128, 8192
    plan = flashflow.plan_decode(b, h, hk, d, cap, device="cuda")
    k_cache = torch.randn(b, cap, hk, d, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, 1, h, d, dtype=dtype, device="cuda")
    seqlens = torch.tensor([100, 2000, 5000, 8000], dtype=torch.int32, device="cuda")
    graph, out = gpu.capture(lambda: plan.run(q, k_cache, v_cache, cache_seqlens=seqlens))
    for step in range(20):
        q.copy_(torch.randn_like(q))
        seqlens.copy_(torch.randint(1, cap, (b,), device="cuda", dtype=torch.int32))
        graph.replay()
        ref, _, _, _ = kvcache_attention_ref(q.double(), k_cache.double(), v_cache.double(), cache_seqlens=seqlens)
        eager = plan.run(q, k_cache, v_cache, cache_seqlens=seqlens)
        assert gpu.rel(out, ref) <= gpu.tol, f"replay {step}"
        assert (out.float() - eager.float()).abs().max().item() <= gpu.tol, f"replay {step}"
    assert (plan.counters == 0).all()   # the merge counters are left reset for the next step


BACK_TO_BACK = [pytest.param(1, False, id="1split-eager"), pytest.param(1, True, id="1split-graph"),
                pytest.param(4, False, id="4splits-eager"), pytest.param(4, True, id="4splits-graph"),
                pytest.param(16, False, id="16splits-eager"), pytest.param(16, True, id="16splits-graph")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits, graph", BACK_TO_BACK)
def test_appending_steps_back_to_back(gpu, dtype, num_splits, graph):
    """Step i appends a token that step i + 1 attends, launched with nothing between them.
    Eager, or captured once and replayed (caches reset before each)."""
    b, h, hk, d, cap, steps = 3, 32, 8, 128, 4096, 8
    plan = flashflow.plan_decode(b, h, hk, d, cap, device="cuda", num_splits=num_splits)
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
    g, outs = gpu.capture(loop) if graph else (None, None)
    for r in range(10 if graph else 3):
        k_cache.copy_(k0)
        v_cache.copy_(v0)
        if graph:
            g.replay()
        else:
            outs = loop()
        torch.cuda.synchronize()
        for i, (o, ref) in enumerate(zip(outs, refs)):
            assert gpu.rel(o, ref) <= gpu.tol, f"round {r}, step {i}"
        assert torch.equal(k_cache.double(), rk) and torch.equal(v_cache.double(), rv), f"round {r}"
    if num_splits > 1:
        assert (plan.counters == 0).all()


def laid_out(how, q, k, v):
    """q, k, v with these values in another memory layout: every other element of a wider buffer
    (last stride 2), (b, h, s, d) storage seen as (b, s, h, d), one head of q / one sequence of
    k, v broadcast by ``expand`` (stride 0), or slices of one packed (b, s, h + 2·kv_heads, d)."""
    if how == "last-stride-2":
        def wide(t):
            buf = torch.randn(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
            buf[..., 1::2] = t
            return buf[..., 1::2]
        return wide(q), wide(k), wide(v)
    if how == "transposed":
        return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    if how == "expanded":
        return q[:, :, :1].expand_as(q), k[:1].expand_as(k), v[:1].expand_as(v)
    b, s, h, d = q.shape
    hk = k.shape[2]
    return torch.randn(b, s, h + 2 * hk, d, dtype=q.dtype, device=q.device).split([h, hk, hk], dim=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [None, 64])
@pytest.mark.parametrize("how", ["last-stride-2", "transposed", "expanded", "packed-qkv"])
def test_strided_q_k_v_with_append(gpu, dtype, page, how):
    """q and the appended k/v in the layouts users pass, through the op and through plan.run
    (into a NaN-filled out): the output and the cache after the append are float64's."""
    b, h, hk, d, cap, n = 3, 32, 8, 128, 4096, 2
    if page is None:
        k_cache, table = torch.randn(b, cap, hk, d, dtype=dtype, device="cuda"), None
    else:
        blocks = b * cap // page
        k_cache = torch.randn(blocks + 5, page, hk, d, dtype=dtype, device="cuda")
        table = torch.randperm(blocks + 5, device="cuda")[:blocks].reshape(b, cap // page).int()
    v_cache = torch.randn_like(k_cache)
    q, k, v = laid_out(how, torch.randn(b, n, h, d, dtype=dtype, device="cuda"),
                       torch.randn(b, n, hk, d, dtype=dtype, device="cuda"),
                       torch.randn(b, n, hk, d, dtype=dtype, device="cuda"))
    seqlens = torch.tensor([0, 1000, cap - n], dtype=torch.int32, device="cuda")
    ref, _, ref_k, ref_v = kvcache_attention_ref(q.double(), k_cache.double(), v_cache.double(), k.double(),
                                                 v.double(), seqlens, table, causal=True)
    plan = flashflow.plan_decode(b, h, hk, d, cap, seqlen_q=n, device="cuda", num_splits=4)
    for step in ("op", "plan"):
        kc, vc = k_cache.clone(), v_cache.clone()
        if step == "op":
            out = flashflow.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table,
                                                    causal=True)
        else:
            out = plan.run(q, kc, vc, k, v, seqlens, table, causal=True, out=gpu.nan_like(q))
        torch.cuda.synchronize()
        assert gpu.rel(out, ref) <= gpu.tol, step
        assert torch.equal(kc.double(), ref_k) and torch.equal(vc.double(), ref_v), step
