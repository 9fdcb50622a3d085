"""FP8 (e4m3) KV caches on the GPU: contiguous, paged and FT layouts, the quantizing append,
per-head and per-tensor scales, splits, CUDA-graph replay; float64 of the
dequantized cache as the oracle, and the output beside the bf16 cache's."""
import pytest
import torch

import flashflow
from flashflow.ops.decode import DecodePlan
from flashflow.reference.decode import kvcache_attention_ref, to_ft_k, to_ft_v
from flashflow.reference.metrics import rel_l2

pytestmark = pytest.mark.gpu
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _paged(cache, page, table):
    b, s, hk, d = cache.shape
    out = torch.zeros(int(table.max()) + 1, page, hk, d, dtype=cache.dtype, device=cache.device)
    out[table.flatten().long()] = cache.reshape(b * (s // page), page, hk, d)
    return out


def _inputs(lens, dtype, capacity, heads=32, kv_heads=8, d=128, n_new=0, seqlen_q=1, page=None, kv_layout="NHD",
            per_head=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(lens)
    mags = torch.logspace(-0.7, 0.0, kv_heads, device="cuda").view(1, 1, -1, 1)
    k = ((torch.randn(batch, capacity, kv_heads, d, device="cuda", generator=g) + 0.3) * mags).to(dtype)
    v = ((torch.randn(batch, capacity, kv_heads, d, device="cuda", generator=g) + 0.3) * mags).to(dtype)
    if per_head:
        k8, ks = flashflow.quantize_kv_cache(k)
        v8, vs = flashflow.quantize_kv_cache(v)
    else:
        ks, vs = float(k.abs().max()) / 448, float(v.abs().max()) / 448
        k8, _ = flashflow.quantize_kv_cache(k, ks)
        v8, _ = flashflow.quantize_kv_cache(v, vs)
    table = None
    if page is not None:
        per_seq = capacity // page
        table = torch.randperm(batch * per_seq + 5, device="cuda", generator=g)[:batch * per_seq]
        table = table.reshape(batch, per_seq).int()
        k8, v8 = _paged(k8, page, table), _paged(v8, page, table)
    elif kv_layout == "FT":
        k8, v8 = to_ft_k(k8), to_ft_v(v8)
    q = torch.randn(batch, seqlen_q, heads, d, device="cuda", dtype=dtype, generator=g)
    kn = torch.randn(batch, n_new, kv_heads, d, device="cuda", dtype=dtype, generator=g) if n_new else None
    vn = torch.randn(batch, n_new, kv_heads, d, device="cuda", dtype=dtype, generator=g) if n_new else None
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return dict(q=q, k_cache=k8, v_cache=v8, k=kn, v=vn, cache_seqlens=seqlens, block_table=table,
                kv_layout=kv_layout, k_scale=ks, v_scale=vs), (k, v)


def _check(args, out, lse):
    """The float64 of a ``causal=True`` call (every call below is causal)."""
    ref, ref_lse, ref_k, ref_v = kvcache_attention_ref(
        args["q"].double(), args["k_cache"], args["v_cache"],
        None if args["k"] is None else args["k"].double(), None if args["v"] is None else args["v"].double(),
        args["cache_seqlens"], args["block_table"], causal=True, kv_layout=args["kv_layout"],
        k_scale=args["k_scale"], v_scale=args["v_scale"])
    assert torch.isfinite(out).all()
    err = rel_l2(out, ref)
    assert err < 1e-2, err
    assert (lse.double() - ref_lse).abs().max() < 1e-2
    return ref_k, ref_v


CASES = {
    "contig": dict(lens=[1, 17, 4000]),
    "contig-append-3splits": dict(lens=[0, 33, 4000], n_new=2, seqlen_q=2, num_splits=3),
    "paged64-append": dict(lens=[0, 33, 4000], n_new=1, page=64),
    "paged16": dict(lens=[4000, 3, 2222], page=16),
    "ft": dict(lens=[1, 17, 4000], kv_layout="FT"),
    "ft-append-7splits": dict(lens=[50, 3000], kv_layout="FT", n_new=2, seqlen_q=2, num_splits=7),
    "per-tensor-append": dict(lens=[7, 4000], n_new=1, per_head=False),
    "d64-mha-16splits": dict(lens=[300, 4000], heads=16, kv_heads=16, d=64, num_splits=16),
    "many-programs": dict(lens=[4096, 1, 3000, 17] * 5),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_fp8_cache_against_float64(dtype, name):
    case = dict(CASES[name])
    num_splits = case.pop("num_splits", 0)
    args, _ = _inputs(dtype=dtype, capacity=4096, **case)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    out, lse = flashflow.flash_attn_with_kvcache(**args, num_splits=num_splits, causal=True,
                                                 return_softmax_lse=True)
    # the reference appends to copies of the caches as they were before the call
    args_before = dict(args, k_cache=before[0], v_cache=before[1])
    ref_k, ref_v = _check(args_before, out, lse)
    assert torch.equal(args["k_cache"].float(), ref_k.float())
    assert torch.equal(args["v_cache"].float(), ref_v.float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_cache_close_to_bf16_cache_at_8x8k(dtype):
    args, (k, v) = _inputs([8192] * 8, dtype, 8192)
    o8 = flashflow.flash_attn_with_kvcache(args["q"], args["k_cache"], args["v_cache"], cache_seqlens=8192,
                                           k_scale=args["k_scale"], v_scale=args["v_scale"])
    o16 = flashflow.flash_attn_with_kvcache(args["q"], k, v, cache_seqlens=8192)
    assert rel_l2(o8, o16) < 2e-2


def test_fp8_plan_graph_replays_append_steps():
    """Appending steps captured in a CUDA graph: each replay quantizes the next token into the FP8
    cache at the position the device tensor says; the result is the float64 of the whole run."""
    dtype = torch.bfloat16
    args, _ = _inputs([100, 2000], dtype, 4096, n_new=1)
    plan = DecodePlan(2, 32, 8, 128, 4096, num_splits=8, kv_dtype=torch.float8_e4m3fn)
    start = (args["k_cache"].clone(), args["v_cache"].clone())
    seqlens = args["cache_seqlens"]
    steps = [(torch.randn_like(args["k"]), torch.randn_like(args["v"]), torch.randn_like(args["q"])) for _ in range(3)]
    q, kn, vn = args["q"].clone(), args["k"].clone(), args["v"].clone()
    call = lambda: plan.run(q, args["k_cache"], args["v_cache"], kn, vn, cache_seqlens=seqlens,  # noqa: E731
                            k_scale=args["k_scale"], v_scale=args["v_scale"])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()   # compile; appends at 100 / 2000 (overwritten below by replays from the start)
    torch.cuda.current_stream().wait_stream(s)
    args["k_cache"].copy_(start[0])
    args["v_cache"].copy_(start[1])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    k_ref, v_ref = start
    for i, (k1, v1, q1) in enumerate(steps):
        kn.copy_(k1)
        vn.copy_(v1)
        q.copy_(q1)
        g.replay()
        ref, _, k_ref, v_ref = kvcache_attention_ref(
            q1.double(), k_ref, v_ref, k1.double(), v1.double(), seqlens.clone(), None,
            k_scale=args["k_scale"], v_scale=args["v_scale"])
        err = rel_l2(out, ref)
        assert err < 1e-2, (i, err)
        seqlens += 1
    assert torch.equal(args["k_cache"].float(), k_ref.float())
    assert torch.equal(args["v_cache"].float(), v_ref.float())


def test_fp8_cache_bf16_queries_beyond_fp16_range():
    """With an FP8 cache the dots run in fp16: a bf16 q past fp16's range (|q| ~ 1e5) is brought
    in by a power-of-two scale folded into the score scale, not overflowed to inf."""
    args, _ = _inputs([33, 3000], torch.bfloat16, 4096, n_new=1)
    args["q"] = args["q"] * 1e5 / 64   # scores stay finite under the default softmax scale
    args["q"][0, 0, 0, 0] = 2.0e5
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    out, lse = flashflow.flash_attn_with_kvcache(**args, causal=True, return_softmax_lse=True)
    _check(dict(args, k_cache=before[0], v_cache=before[1]), out, lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [None, 64])
def test_fp8_strided_q_k_v_with_append(dtype, page):
    """q and the appended k/v with a non-unit last stride (every other element of a wider
    buffer): the e4m3 values stored and the output are float64's of the dequantized cache."""
    args, _ = _inputs([0, 1000, 4094], dtype, 4096, n_new=2, seqlen_q=2, page=page)

    def wide(t):
        buf = torch.randn(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        buf[..., ::2] = t
        return buf[..., ::2]

    args.update(q=wide(args["q"]), k=wide(args["k"]), v=wide(args["v"]))
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    out, lse = flashflow.flash_attn_with_kvcache(**args, causal=True, return_softmax_lse=True)
    ref_k, ref_v = _check(dict(args, k_cache=before[0], v_cache=before[1]), out, lse)
    assert torch.equal(args["k_cache"].float(), ref_k.float())
    assert torch.equal(args["v_cache"].float(), ref_v.float())
