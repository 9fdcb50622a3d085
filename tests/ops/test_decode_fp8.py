"""FP8 (e4m3) KV caches in decode attention, through Triton's interpreter, against float64 of the
dequantized cache; and :func:`flashflow.quantize_kv_cache`."""
import pytest
import torch

import flashflow
from flashflow.ops.decode import DecodePlan
from flashflow.reference.decode import (from_ft_k, kvcache_attention_ref, quantize_e4m3, to_ft_k, to_ft_v)
from flashflow.tuning.decode import DecodeConfig
from flashflow.reference.metrics import rel_l2

pytestmark = pytest.mark.kernels
FP8 = torch.float8_e4m3fn


def realistic(shape, dtype, gen, outlier_heads=True, *, device):
    """Gaussian values with a common offset and, per KV head (axis 2), a different magnitude
    (x0.2 .. x1), as real caches have: per-head scales then differ from a per-tensor one."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32) + 0.5
    if outlier_heads:
        mags = torch.logspace(-0.7, 0.0, shape[2])
        x = x * mags.view(1, 1, -1, 1)
    return x.to(dtype).to(device)


def fp8_case(lens, heads=8, kv_heads=2, d=64, capacity=512, seqlen_q=1, n_new=0, page=None, kv_layout="NHD",
             scale="head", num_splits=0, dtype=torch.float16, config=None, softcap=0.0,
             window=(-1, -1), big_new=False, *, device):
    """``scale``: "head" (quantize_kv_cache's per-head amax scales), "tensor" (one float), or
    "one" (no scale passed: 1.0, values already in e4m3's range)."""
    gen = torch.Generator().manual_seed(len(lens) * 1000 + capacity + n_new + (page or 0))
    batch = len(lens)
    if page is None:
        k_full = realistic((batch, capacity, kv_heads, d), dtype, gen, device=device)
        v_full = realistic((batch, capacity, kv_heads, d), dtype, gen, device=device)
        table = None
    else:
        per_seq = capacity // page
        num_blocks = batch * per_seq + 3
        k_full = realistic((num_blocks, page, kv_heads, d), dtype, gen, device=device)
        v_full = realistic((num_blocks, page, kv_heads, d), dtype, gen, device=device)
        table = torch.randperm(num_blocks, generator=gen)[:batch * per_seq].reshape(batch, per_seq).int().to(device)
    if scale == "head":
        k_cache, k_scale = flashflow.quantize_kv_cache(k_full)
        v_cache, v_scale = flashflow.quantize_kv_cache(v_full)
    elif scale == "tensor":
        k_scale = float(k_full.abs().max()) / 448
        v_scale = float(v_full.abs().max()) / 448
        k_cache, _ = flashflow.quantize_kv_cache(k_full, k_scale)
        v_cache, _ = flashflow.quantize_kv_cache(v_full, v_scale)
    else:
        k_scale = v_scale = None
        k_cache, _ = flashflow.quantize_kv_cache(k_full, 1.0)
        v_cache, _ = flashflow.quantize_kv_cache(v_full, 1.0)
    if kv_layout == "FT":
        k_cache, v_cache = to_ft_k(k_cache), to_ft_v(v_cache)
    q = realistic((batch, seqlen_q, heads, d), dtype, gen, outlier_heads=False, device=device)
    k = realistic((batch, n_new, kv_heads, d), dtype, gen, device=device) if n_new else None
    v = realistic((batch, n_new, kv_heads, d), dtype, gen, device=device) if n_new else None
    if big_new:   # beyond 448 · scale: the append saturates
        k = k * 1000
        v = v * 1000
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref, ref_lse, ref_k, ref_v = kvcache_attention_ref(
        q.double(), k_cache, v_cache, None if k is None else k.double(), None if v is None else v.double(),
        seqlens, table, causal=True, window_size=window, softcap=softcap, kv_layout=kv_layout,
        k_scale=k_scale, v_scale=v_scale)
    plan = None if config is None else DecodePlan(
        batch, heads, kv_heads, d, capacity, seqlen_q=seqlen_q, device=device, num_splits=num_splits,
        config=config, kv_dtype=torch.float8_e4m3fn)
    out = torch.full_like(q, float("nan"))
    out, lse = flashflow.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table, num_splits=num_splits,
        return_softmax_lse=True, causal=True, kv_layout=kv_layout, plan=plan, k_scale=k_scale, v_scale=v_scale,
        softcap=softcap, window_size=window)
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) < 5e-3, rel_l2(out, ref)
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max() < 1e-2
    # the append stored exactly the reference's e4m3 values (saturated, not NaN), nothing else moved
    for c, r in ((k_cache, ref_k), (v_cache, ref_v)):
        assert c.dtype == FP8
        assert torch.equal(c.float(), r.float())
    return out


@pytest.mark.parametrize("page", [None, 16, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_cache_contiguous_and_paged(device, page, num_splits):
    fp8_case([1, 100, 500], page=page, num_splits=num_splits, device=device)


@pytest.mark.parametrize("kv_layout", ["NHD", "FT"])
@pytest.mark.parametrize("page", [None, 32])
@pytest.mark.parametrize("n_new", [1, 3])
def test_fp8_cache_append(device, kv_layout, page, n_new):
    if kv_layout == "FT" and page is not None:
        pytest.skip("the FT layout is not paged")
    fp8_case([0, 40, 300], n_new=n_new, seqlen_q=n_new, page=page, num_splits=3, kv_layout=kv_layout, device=device)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_fp8_cache_fastertransformer(device, num_splits):
    fp8_case([1, 17, 500], kv_layout="FT", num_splits=num_splits, device=device)


@pytest.mark.parametrize("scale", ["tensor", "one"])
def test_fp8_per_tensor_scales(device, scale):
    fp8_case([33, 257], scale=scale, num_splits=2, n_new=1, device=device)


def test_fp8_bf16_queries_gqa_splits_softcap_window(device):
    # bf16 queries: the e4m3 tiles and q go to fp16 on a GPU (fp32 dots under the interpreter)
    fp8_case([100, 450], heads=6, kv_heads=2, d=80, dtype=torch.bfloat16, num_splits=4,
             softcap=5.0, seqlen_q=2, device=device)
    fp8_case([100, 450], heads=4, kv_heads=4, d=128, num_splits=3, window=(64, 0),
             config=DecodeConfig(32, 4, 1), device=device)


def test_fp8_append_saturates(device):
    fp8_case([10, 20], n_new=2, seqlen_q=1, num_splits=2, big_new=True, device=device)


def test_fp8_cache_output_close_to_the_bf16_cache(device):
    """What a user trades: the FP8 cache's output beside the bf16 cache's (the issue's 2e-2).
    Scores of unit spread here; the sharper the softmax, the more K's 1/16 relative steps move
    it (heads x4 larger: about 5e-2, the quantization itself, as float64 of the cache shows)."""
    gen = torch.Generator().manual_seed(3)
    k = realistic((2, 700, 2, 64), torch.bfloat16, gen, device=device)
    v = realistic((2, 700, 2, 64), torch.bfloat16, gen, device=device)
    q = realistic((2, 1, 8, 64), torch.bfloat16, gen, outlier_heads=False, device=device)
    o16 = flashflow.flash_attn_with_kvcache(q, k, v, cache_seqlens=700)
    k8, ks = flashflow.quantize_kv_cache(k)
    v8, vs = flashflow.quantize_kv_cache(v)
    o8 = flashflow.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=700, k_scale=ks, v_scale=vs)
    assert rel_l2(o8, o16.double()) < 2e-2


# ------------------------------------------------------------------------------------------
# quantize_kv_cache
# ------------------------------------------------------------------------------------------

def test_quantize_kv_cache_per_head_scales_round_trip(device):
    gen = torch.Generator().manual_seed(0)
    cache = realistic((2, 50, 3, 32), torch.bfloat16, gen, device=device)
    fp8, scale = flashflow.quantize_kv_cache(cache)
    assert fp8.dtype == FP8 and fp8.shape == cache.shape
    assert scale.dtype == torch.float32 and scale.shape == (3,)
    amax = cache.float().abs().amax(dim=(0, 1, 3))
    torch.testing.assert_close(scale, amax / 448)
    deq = fp8.float() * scale.view(1, 1, 3, 1)
    assert rel_l2(deq, cache.double()) < 0.04              # three mantissa bits
    assert (fp8.float().abs().amax(dim=(0, 1, 3)) == 448).all()   # each head's max maps onto 448
    assert torch.equal(fp8.float(), quantize_e4m3(cache, scale.view(1, 1, 3, 1)).float())


def test_quantize_kv_cache_given_scales_and_saturation(device):
    cache = torch.tensor([[[[1.0, -1000.0, 3.3, 0.0]]]], dtype=torch.float16, device=device)
    fp8, scale = flashflow.quantize_kv_cache(cache, 0.5)
    assert scale == 0.5
    assert fp8.float().flatten().tolist() == [2.0, -448.0, 6.5, 0.0]
    per_head = torch.tensor([2.0], device=device)
    fp8, scale = flashflow.quantize_kv_cache(cache, per_head)
    assert scale is per_head and fp8.float().flatten().tolist() == [0.5, -448.0, 1.625, 0.0]
    # an all-zero head gets scale 1 (not 0: no division by zero downstream)
    _, s = flashflow.quantize_kv_cache(torch.zeros(1, 4, 2, 16, device=device))
    assert s.tolist() == [1.0, 1.0]


def test_quantize_kv_cache_fastertransformer_layouts(device):
    gen = torch.Generator().manual_seed(1)
    nhd = realistic((2, 40, 3, 32), torch.float16, gen, device=device)
    ref, scale = flashflow.quantize_kv_cache(nhd)
    k_ft, k_s = flashflow.quantize_kv_cache(to_ft_k(nhd), kv_layout="FT")   # x 8 in, x 16 out
    assert k_ft.shape == (2, 3, 2, 40, 16)
    assert torch.equal(from_ft_k(k_ft).float(), ref.float()) and torch.equal(k_s, scale)
    v_ft, v_s = flashflow.quantize_kv_cache(to_ft_v(nhd), kv_layout="FT")   # (b, hk, s, d): heads on axis 1
    assert torch.equal(v_ft.transpose(1, 2).float(), ref.float()) and torch.equal(v_s, scale)


def test_quantize_kv_cache_bad_inputs():
    with pytest.raises(TypeError, match="cache must be a float16, bfloat16 or float32"):
        flashflow.quantize_kv_cache(torch.zeros(1, 2, 3, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        flashflow.quantize_kv_cache(torch.zeros(1, 2, 3, 4), kv_layout="HND")
    with pytest.raises(ValueError, match="cache must be"):
        flashflow.quantize_kv_cache(torch.zeros(2, 3, 4))
    for bad in (0.0, -1.0, float("nan"), "1"):
        with pytest.raises((TypeError, ValueError), match="scale must be"):
            flashflow.quantize_kv_cache(torch.zeros(1, 2, 3, 4), bad)
    with pytest.raises(TypeError, match=r"scale must be a float or a float32 tensor of shape \(kv_heads,\)"):
        flashflow.quantize_kv_cache(torch.zeros(1, 2, 3, 4), torch.ones(2))
    with pytest.raises(ValueError, match="requires grad"):
        flashflow.quantize_kv_cache(torch.zeros(1, 2, 3, 4, requires_grad=True))


# ------------------------------------------------------------------------------------------
# bad inputs: named before any launch
# ------------------------------------------------------------------------------------------

def _fp8_inputs(kv_heads=2, *, device):
    q = torch.randn(1, 1, 4, 32, dtype=torch.float16, device=device)
    kc = torch.randn(1, 64, kv_heads, 32, device=device).to(FP8)
    return q, kc, kc.clone()


@pytest.mark.parametrize("k_scale,v_scale,err,match", [
    (-1.0, 1.0, ValueError, "k_scale must be a finite number > 0"),
    (1.0, float("nan"), ValueError, "v_scale must be a finite number > 0"),
    (0.0, 1.0, ValueError, "k_scale must be a finite number > 0"),
    ("2", 1.0, TypeError, "k_scale must be a float"),
    (torch.ones(3), torch.ones(2), TypeError, r"k_scale must be a float or a float32 tensor of shape \(kv_heads,\) = \(2,\)"),
    (torch.ones(2, dtype=torch.float64), torch.ones(2), TypeError, "k_scale must be a float or a float32 tensor"),
    (torch.ones(2), 1.0, TypeError, "must both be floats"),
])
def test_bad_scales(device, k_scale, v_scale, err, match):
    q, kc, vc = _fp8_inputs(device=device)
    if isinstance(k_scale, torch.Tensor):
        k_scale = k_scale.to(device)
    with pytest.raises(err, match=match):
        flashflow.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=10, k_scale=k_scale, v_scale=v_scale)


def test_bad_fp8_dtypes_and_layouts(device):
    q, kc, vc = _fp8_inputs(device=device)
    with pytest.raises(TypeError, match="needs q in float16 or bfloat16"):
        flashflow.flash_attn_with_kvcache(q.float(), kc, vc, cache_seqlens=10)
    with pytest.raises(TypeError, match="must have q's dtype .* or be torch.float8_e4m3fn"):
        flashflow.flash_attn_with_kvcache(q, kc.to(torch.float8_e5m2), vc, cache_seqlens=10)
    with pytest.raises(TypeError, match="k_cache and v_cache must share a dtype"):
        flashflow.flash_attn_with_kvcache(q, kc, vc.half(), cache_seqlens=10)
    with pytest.raises(ValueError, match="apply to torch.float8_e4m3fn caches only"):
        flashflow.flash_attn_with_kvcache(q, kc.half(), vc.half(), cache_seqlens=10, k_scale=2.0)
    # an FP8 cache in the FT layout has x = 16 (16 bytes); the bf16 layout's x = 8 is refused
    k_ft8 = to_ft_k(kc.half(), 8).to(FP8)
    with pytest.raises(ValueError, match=r"head_dim/16, capacity, 16"):
        flashflow.flash_attn_with_kvcache(q, k_ft8, to_ft_v(vc), cache_seqlens=10, kv_layout="FT")
    # FT K whose key pieces are not x apart (a transposed view)
    k_ft = to_ft_k(kc)
    bad = k_ft.transpose(3, 2).contiguous().transpose(3, 2)
    with pytest.raises(ValueError, match="contiguous, keys 16"):
        flashflow.flash_attn_with_kvcache(q, bad, to_ft_v(vc), cache_seqlens=10, kv_layout="FT")
    with pytest.raises(ValueError, match="requires grad"):
        flashflow.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=10, k_scale=torch.ones(2, requires_grad=True,
                                                                                       device=device),
                                          v_scale=torch.ones(2, device=device))


# ------------------------------------------------------------------------------------------
# per-head scale values: checked where the host reads the device anyway
# ------------------------------------------------------------------------------------------

BAD_SCALES = [-1.0, 0.0, float("inf"), float("nan")]


@pytest.mark.parametrize("bad", BAD_SCALES)
@pytest.mark.parametrize("lens", ["tensor", "int", "paged"])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_bad_per_head_scale_values_are_refused(device, which, lens, bad):
    # the float path refuses these; a (kv_heads,) tensor holding one was used as given
    q, kc, vc = _fp8_inputs(kv_heads=3, device=device)
    table = None
    if lens == "paged":
        kc, vc = kc.view(4, 16, 3, 32), vc.view(4, 16, 3, 32)
        table = torch.arange(4, dtype=torch.int32, device=device).view(1, 4)
    seqlens = 10 if lens == "int" else torch.tensor([10], dtype=torch.int32, device=device)
    scales = {"k_scale": torch.ones(3, device=device), "v_scale": torch.ones(3, device=device)}
    scales[which][2] = bad
    q = torch.randn(1, 1, 6, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=rf"{which} must hold finite numbers > 0 .*{which}\[2\] = {bad}"):
        flashflow.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, **scales)


@pytest.mark.parametrize("lens", ["tensor", "int", "paged"])
def test_scale_check_is_in_the_one_read_back(device, monkeypatch, lens):
    # the scales' values ride on the transfer that reads the lengths / pages back: no second
    # host synchronisation (one for the scales alone where nothing else is read); plan.run
    # reads nothing (inside CUDA-graph capture nothing can be read: the values are the caller's)
    q, kc, vc = _fp8_inputs(kv_heads=2, device=device)
    table = None
    if lens == "paged":
        kc, vc = kc.view(4, 16, 2, 32), vc.view(4, 16, 2, 32)
        table = torch.arange(4, dtype=torch.int32, device=device).view(1, 4)
    seqlens = 10 if lens == "int" else torch.tensor([10], dtype=torch.int32, device=device)
    ks, vs = torch.full((2,), 0.5, device=device), torch.full((2,), 2.0, device=device)
    plan = DecodePlan(1, 4, 2, 32, 64, device=device, kv_dtype=FP8)
    reads = []
    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=orig, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1])
    out = flashflow.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                            k_scale=ks, v_scale=vs)
    assert reads == ["tolist"]
    reads.clear()
    vs[1] = float("nan")   # not read by plan.run: its output shows it
    bad = plan.run(q, kc, vc, cache_seqlens=seqlens, block_table=table, k_scale=ks, v_scale=vs)
    assert reads == []
    monkeypatch.undo()
    assert torch.isfinite(out).all() and torch.isnan(bad[0, 0, 2:]).all()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("scale", ["derived", "float", "tensor"])
def test_quantize_kv_cache_refuses_non_finite_caches(device, scale, bad):
    # an inf gave scale inf and an all-NaN head (or saturated silently under a given scale)
    cache = torch.randn(2, 8, 3, 16, device=device)
    cache[1, 5, 1, 7] = bad
    given = {"derived": None, "float": 0.5, "tensor": torch.ones(3, device=device)}[scale]
    with pytest.raises(ValueError, match="cache holds non-finite values .* in KV head 1"):
        flashflow.quantize_kv_cache(cache, given)
    with pytest.raises(ValueError, match="cache holds non-finite values .* in KV head 1"):
        flashflow.quantize_kv_cache(to_ft_k(cache.half()), given, kv_layout="FT")


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_quantize_kv_cache_refuses_bad_scale_tensors(device, bad):
    scale = torch.ones(3, device=device)
    scale[2] = bad
    with pytest.raises(ValueError, match=rf"scale must hold finite numbers > 0 .*scale\[2\] = {bad}"):
        flashflow.quantize_kv_cache(torch.randn(2, 8, 3, 16, device=device), scale)


@pytest.mark.parametrize("n_new", [0, 2])
def test_fp8_strided_q_k_v(device, n_new):
    # q and the appended k/v with a non-unit last stride (every other element of a wider
    # buffer): the kernel reads head_dim with unit stride, so they are copied first; the e4m3
    # values the append stores are the reference's
    gen = torch.Generator().manual_seed(7)
    lens = [5, 40]
    k8, ks = flashflow.quantize_kv_cache(realistic((2, 64, 2, 32), torch.float16, gen, device=device))
    v8, vs = flashflow.quantize_kv_cache(realistic((2, 64, 2, 32), torch.float16, gen, device=device))
    wide = lambda *shape: realistic((*shape[:-1], 2 * shape[-1]), torch.float16, gen, False,  # noqa: E731
                                    device=device)[..., ::2]
    q = wide(2, max(n_new, 1), 4, 32)
    k, v = (wide(2, n_new, 2, 32), wide(2, n_new, 2, 32)) if n_new else (None, None)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref, _, ref_k, ref_v = kvcache_attention_ref(q.double(), k8, v8, None if k is None else k.double(),
                                                 None if v is None else v.double(), seqlens, None, causal=True,
                                                 k_scale=ks, v_scale=vs)
    out = flashflow.flash_attn_with_kvcache(q, k8, v8, k, v, cache_seqlens=seqlens, causal=True, num_splits=2,
                                            k_scale=ks, v_scale=vs)
    assert rel_l2(out, ref) < 5e-3
    assert torch.equal(k8.float(), ref_k.float()) and torch.equal(v8.float(), ref_v.float())
