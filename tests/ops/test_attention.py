"""Flash attention forward against the float64 reference, through Triton's interpreter on the CPU.

Run with TRITON_INTERPRET=1 (the README's test command sets it). Inputs are fresh random draws,
outputs are poisoned with NaN before the call, sizes are odd.
"""
import pytest
import torch

import flashflow
from flashflow.ops import attention as attn_ops
from flashflow.ops.attention import attention_forward, tail_splits
from flashflow.reference import attention_naive, attention_tiled, attention_varlen_naive
from flashflow.ops import validate
from flashflow.tuning.attention import AttentionConfig
from flashflow.reference.metrics import rel_l2

pytestmark = pytest.mark.kernels
TOL = {torch.float16: 5e-3, torch.float32: 1e-4, torch.bfloat16: 2e-2}


def rand(*shape, dtype=torch.float16, device):
    return torch.randn(*shape, dtype=dtype, device=device)


def check_dense(b, sq, sk, h, hk, d, dtype=torch.float16, causal=False, window=(-1, -1), softcap=0.0,
                config=None, layout="bshd", num_sms=None, scale=None, *, device):
    if layout == "bshd":
        q = rand(b, sq, h, d, dtype=dtype, device=device)
        k, v = rand(b, sk, hk, d, dtype=dtype, device=device), rand(b, sk, hk, d, dtype=dtype, device=device)
    else:  # SDPA storage seen through a transpose: arbitrary strides, no copy
        q = rand(b, h, sq, d, dtype=dtype, device=device).transpose(1, 2)
        k = rand(b, hk, sk, d, dtype=dtype, device=device).transpose(1, 2)
        v = rand(b, hk, sk, d, dtype=dtype, device=device).transpose(1, 2)
    scale = d ** -0.5 if scale is None else scale
    out = torch.full((b, sq, h, d), float("nan"), dtype=dtype, device=device)
    left, right = window
    if causal:
        right = 0
    attention_forward(q, k, v, softmax_scale=scale, window_left=left if left >= 0 else None,
                      window_right=right if right >= 0 else None, softcap=softcap, out=out,
                      config=config, num_sms=num_sms, heavy_first=causal)
    ref, ref_lse = attention_naive(q.double(), k.double(), v.double(), scale, causal, window, softcap,
                                   return_lse=True)
    assert not torch.isnan(out).any(), "output has NaN (unwritten or invalid)"
    assert rel_l2(out, ref) < TOL[dtype], rel_l2(out, ref)
    # the public entry point, with LSE
    o2, lse = flashflow.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window,
                                        softcap=softcap, return_lse=True)
    assert rel_l2(o2, ref) < TOL[dtype]
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    if fin.any():
        assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("seqlen", [1, 77, 300])
def test_dense_noncausal(device, dtype, seqlen):
    check_dense(2, seqlen, seqlen, 3, 3, 64, dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("sq,sk", [(77, 77), (40, 300), (300, 40), (1, 77)])
def test_causal_bottom_right(device, dtype, sq, sk):
    # sq > sk leaves the first sq - sk rows with no key: they must be 0 with lse -inf
    check_dense(1, sq, sk, 2, 2, 64, dtype=dtype, causal=True, device=device)


@pytest.mark.parametrize("d", [32, 80, 96, 128, 256])
def test_head_dims(device, d):
    check_dense(1, 65, 97, 2, 1, d, device=device)


@pytest.mark.parametrize("h,hk", [(8, 2), (6, 1), (4, 4)])
def test_gqa_mqa(device, h, hk):
    check_dense(2, 50, 70, h, hk, 32, causal=True, device=device)


@pytest.mark.parametrize("window", [(16, 0), (10, 20), (0, 0), (-1, 5), (33, -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window(device, window, causal):
    check_dense(1, 150, 170, 2, 1, 32, causal=causal, window=window, device=device)


@pytest.mark.parametrize("causal", [False, True])
def test_softcap(device, causal):
    check_dense(1, 90, 90, 2, 2, 64, causal=causal, softcap=2.0, scale=0.5, device=device)


def test_softcap_fp32_window(device):
    check_dense(1, 61, 61, 2, 1, 48, dtype=torch.float32, softcap=5.0, window=(8, 8), device=device)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("load", ["pointer", "device_desc", "host_desc"])
def test_load_paths_and_strides(device, layout, load):
    cfg = AttentionConfig(32, 32, 4, 1, use_tma=load != "pointer", host_desc=load == "host_desc")
    check_dense(2, 77, 130, 4, 2, 64, config=cfg, layout=layout, device=device)
    check_dense(2, 77, 130, 4, 2, 64, config=cfg, layout=layout, causal=True, device=device)


def test_sliced_noncontiguous_inputs(device):
    base = rand(2, 90, 4, 3 * 64, device=device)
    q, k, v = base[..., :64], base[..., 64:128], base[..., 128:]  # packed qkv, seq stride 768
    ref = attention_naive(q.double(), k.double(), v.double(), causal=True)
    out = flashflow.flash_attn_func(q, k, v, causal=True)
    assert rel_l2(out, ref) < TOL[torch.float16]


@pytest.mark.parametrize("load", ["pointer", "host_desc"])
@pytest.mark.parametrize("num_sms", [10, 11, 23])
def test_tail_split_matches(device, num_sms, load):
    # 3 m-blocks x 4 heads x 2 batch = 24 tiles; these SM counts leave a short last wave,
    # so its tiles are cut into key-range pieces and merged.
    cfg = AttentionConfig(32, 32, 4, 1, use_tma=load != "pointer", host_desc=True)
    assert tail_splits(24, num_sms, 10) > 1
    check_dense(2, 77, 300, 4, 2, 64, config=cfg, num_sms=num_sms, device=device)


def test_tail_split_policy():
    assert tail_splits(816, 132, 34) == 5       # Qwen-Image 1024px: 6.2 waves -> cut the 24 tail tiles
    assert tail_splits(1584, 132, 66) == 1      # exact waves
    assert tail_splits(2048, 132, 16) == 1      # last wave more than half full
    assert tail_splits(24, 132, 1) == 1         # too few key blocks to cut


def test_fully_masked_rows_give_zero(device):
    # window (0, 0) with sq > sk: rows before the diagonal have no key at all
    q, k, v = rand(1, 40, 2, 32, device=device), rand(1, 10, 2, 32, device=device), rand(1, 10, 2, 32, device=device)
    out, lse = flashflow.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.isfinite(out).all()
    assert (out[:, :30] == 0).all()
    assert torch.isneginf(lse[:, :, :30]).all() and torch.isfinite(lse[:, :, 30:]).all()


def test_tiled_reference_equals_naive():
    q, k, v = (torch.randn(2, 70, 4, 16, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    for kw in ({}, {"causal": True}, {"window_size": (5, 3)}, {"softcap": 3.0}):
        o1, l1 = attention_naive(q, k, v, return_lse=True, **kw)
        o2, l2 = attention_tiled(q, k, v, return_lse=True, block_m=16, block_n=24, **kw)
        assert torch.allclose(o1, o2, atol=1e-12) and torch.allclose(l1, l2, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# varlen
# ---------------------------------------------------------------------------------------------


def _cu(lens, *, device):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tma", [False, True])
def test_varlen(device, causal, tma):
    lens_q, lens_k = [1, 17, 100, 0, 45], [5, 17, 130, 3, 45]
    cq, ck = _cu(lens_q, device=device), _cu(lens_k, device=device)
    q = rand(sum(lens_q), 4, 80, device=device)
    k, v = rand(sum(lens_k), 2, 80, device=device), rand(sum(lens_k), 2, 80, device=device)
    cfg = AttentionConfig(32, 32, 4, 1, use_tma=tma)
    out = torch.full_like(q, float("nan"))
    attention_forward(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=100, max_seqlen_k=130,
                      softmax_scale=80 ** -0.5, window_right=0 if causal else None, out=out, config=cfg)
    ref, ref_lse = attention_varlen_naive(q.double(), k.double(), v.double(), cq, ck, causal=causal,
                                          return_lse=True)
    assert not torch.isnan(out).any()
    assert rel_l2(out, ref) < TOL[torch.float16]
    o2, lse = flashflow.flash_attn_varlen_func(q, k, v, cq, ck, 100, 130, causal=causal, return_lse=True,
                                               window_size=(-1, -1))
    assert rel_l2(o2, ref) < TOL[torch.float16]
    assert lse.shape == (4, sum(lens_q))
    fin = torch.isfinite(ref_lse)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max() < 1e-2


# ---------------------------------------------------------------------------------------------
# SDPA-compatible entry point
# ---------------------------------------------------------------------------------------------


def sdpa_ref(q, k, v, **kw):
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)


def test_sdpa_key_padding_mask_gqa(device):
    q, k, v = rand(2, 8, 33, 64, device=device), rand(2, 2, 45, 64, device=device), rand(2, 2, 45, 64, device=device)
    mask = torch.rand(2, 1, 1, 45, device=device) > 0.3
    mask[:, :, :, 0] = True  # PyTorch gives NaN for fully masked rows; keep one key so both agree
    out = flashflow.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert out.shape == (2, 8, 33, 64)
    assert rel_l2(out, sdpa_ref(q, k, v, attn_mask=mask, enable_gqa=True)) < TOL[torch.float16]


def test_sdpa_float_mask_and_scale(device):
    q = rand(1, 4, 20, 32, dtype=torch.float32, device=device)
    k, v = (rand(1, 4, 37, 32, dtype=torch.float32, device=device) for _ in range(2))
    bias = torch.randn(4, 20, 37, device=device)
    out = flashflow.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3)
    assert rel_l2(out, sdpa_ref(q, k, v, attn_mask=bias.double(), scale=0.3)) < TOL[torch.float32]


@pytest.mark.parametrize("sq,sk", [(30, 30), (20, 50), (50, 20)])
def test_sdpa_causal_is_top_left(device, sq, sk):
    q, k, v = rand(1, 2, sq, 32, device=device), rand(1, 2, sk, 32, device=device), rand(1, 2, sk, 32, device=device)
    out = flashflow.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_l2(out, sdpa_ref(q, k, v, is_causal=True)) < TOL[torch.float16]


def test_sdpa_fully_masked_row_is_zero_not_nan(device):
    q, k, v = rand(1, 2, 5, 32, device=device), rand(1, 2, 7, 32, device=device), rand(1, 2, 7, 32, device=device)
    mask = torch.ones(1, 1, 5, 7, dtype=torch.bool, device=device)
    mask[..., 2, :] = False
    out = flashflow.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all() and (out[:, :, 2] == 0).all()
    keep = torch.tensor([0, 1, 3, 4])
    ref = sdpa_ref(q, k, v, attn_mask=mask)
    assert rel_l2(out[:, :, keep], ref[:, :, keep]) < TOL[torch.float16]


def test_sdpa_3d_inputs(device):
    q, k, v = rand(4, 19, 64, device=device), rand(4, 23, 64, device=device), rand(4, 23, 64, device=device)
    out = flashflow.scaled_dot_product_attention(q, k, v)
    assert out.shape == (4, 19, 64)
    assert rel_l2(out, sdpa_ref(q, k, v)) < TOL[torch.float16]


# ---------------------------------------------------------------------------------------------
# custom op / torch.compile
# ---------------------------------------------------------------------------------------------


def test_custom_op_opcheck(device):
    q, k, v = rand(1, 33, 2, 32, device=device), rand(1, 40, 1, 32, device=device), rand(1, 40, 1, 32, device=device)
    args = (q, k, v, None, 0, None, 0, None, None, 0, 0, 0.2, False, 0, True, 0, 0.0, True, True)
    torch.library.opcheck(torch.ops.flashflow.attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph_traces_through(device):
    q, k, v = rand(1, 33, 2, 32, device=device), rand(1, 40, 1, 32, device=device), rand(1, 40, 1, 32, device=device)

    def f(q, k, v):
        o, lse = flashflow.flash_attn_func(q * 2.0, k, v, causal=True, return_lse=True)
        return o.float().sum(-1) + lse.transpose(1, 2)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(q, k, v), f(q, k, v), atol=1e-3)


# ---------------------------------------------------------------------------------------------
# bad inputs: clear errors before any launch
# ---------------------------------------------------------------------------------------------


def test_bad_rank(device):
    with pytest.raises(ValueError, match=r"q must have rank 4"):
        flashflow.flash_attn_func(rand(2, 8, 32, device=device), rand(2, 8, 2, 32, device=device),
                                  rand(2, 8, 2, 32, device=device))


def test_dtype_mismatch(device):
    with pytest.raises(TypeError, match="share one dtype"):
        flashflow.flash_attn_func(rand(1, 8, 2, 32, device=device),
                                  rand(1, 8, 2, 32, dtype=torch.float32, device=device),
                                  rand(1, 8, 2, 32, device=device))


def test_unsupported_dtype(device):
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        x = torch.zeros(1, 8, 2, 32, dtype=torch.int32, device=device)
        flashflow.flash_attn_func(x, x, x)


def test_head_dim_too_large(device):
    with pytest.raises(ValueError, match="head_dim must be between 1 and 256, got 300"):
        flashflow.flash_attn_func(rand(1, 8, 2, 300, device=device), rand(1, 8, 2, 300, device=device),
                                  rand(1, 8, 2, 300, device=device))


def test_heads_not_divisible(device):
    with pytest.raises(ValueError, match=r"heads of q \(6\) must be a multiple of heads of k/v \(4\)"):
        flashflow.flash_attn_func(rand(1, 8, 6, 32, device=device), rand(1, 8, 4, 32, device=device),
                                  rand(1, 8, 4, 32, device=device))


def test_kv_mismatch(device):
    with pytest.raises(ValueError, match="same number of heads"):
        flashflow.flash_attn_func(rand(1, 8, 4, 32, device=device), rand(1, 8, 2, 32, device=device),
                                  rand(1, 8, 4, 32, device=device))
    with pytest.raises(ValueError, match="seqlen_k"):
        flashflow.flash_attn_func(rand(1, 8, 4, 32, device=device), rand(1, 8, 2, 32, device=device),
                                  rand(1, 9, 2, 32, device=device))


def test_cpu_tensor_on_gpu_path(monkeypatch):
    monkeypatch.setattr(validate, "interpreting", lambda: False)
    x = torch.randn(1, 8, 2, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="runs on CUDA tensors; got q on cpu"):
        flashflow.flash_attn_func(x, x, x)


def test_bad_window_and_softcap(device):
    x = rand(1, 8, 2, 32, device=device)
    with pytest.raises(ValueError, match="window_size"):
        flashflow.flash_attn_func(x, x, x, window_size=(-3, 0))
    with pytest.raises(TypeError, match="window_size"):
        flashflow.flash_attn_func(x, x, x, window_size=5)
    with pytest.raises(ValueError, match="softcap"):
        flashflow.flash_attn_func(x, x, x, softcap=-1.0)


def test_flags_and_window_must_be_what_they_say(device):
    # "no" is truthy and 1.5 truncates: read as such, both would run silently as something else
    x = rand(1, 8, 2, 32, device=device)
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        flashflow.flash_attn_func(x, x, x, window_size=(1.5, 2))
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        flashflow.flash_attn_func(x, x, x, window_size=(True, 2))
    for kw in (dict(return_lse="no"), dict(causal=1), dict(causal="yes"), dict(deterministic=None)):
        name = next(iter(kw))
        with pytest.raises(TypeError, match=f"{name} must be True or False"):
            flashflow.flash_attn_func(x, x, x, **kw)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        flashflow.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, 8, 8, return_lse="no")
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        flashflow.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, 8.5, 8)
    with pytest.raises(TypeError, match="is_causal must be True or False"):
        flashflow.scaled_dot_product_attention(x, x, x, is_causal="no")
    assert flashflow.flash_attn_func(x, x, x, window_size=(torch.tensor(3), 0)).shape == x.shape   # 0-d int tensors: ints


def test_arguments_after_qkv_are_keywords(device):
    # FlashAttention 2 takes dropout_p fourth, FlashAttention 3 softmax_scale: a positional 0.1
    # was read as a softmax scale
    x = rand(1, 8, 2, 32, device=device)
    with pytest.raises(TypeError, match="positional"):
        flashflow.flash_attn_func(x, x, x, 0.1)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="positional"):
        flashflow.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, 8, 8, 0.1)


def test_meta_tensors_are_refused_by_name():
    x = torch.empty(1, 8, 2, 32, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="q is a meta tensor"):
        flashflow.flash_attn_func(x, x, x)
    with pytest.raises(ValueError, match="query is a meta tensor|q is a meta tensor"):
        flashflow.scaled_dot_product_attention(x, x, x)


def test_varlen_bad_cu_seqlens(device):
    q, k = rand(10, 2, 32, device=device), rand(12, 2, 32, device=device)
    cq = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    ck = torch.tensor([0, 12], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="same length"):
        flashflow.flash_attn_varlen_func(q, k, k, cq, ck, 6, 12)
    ck = torch.tensor([0, 5, 11], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] must equal the packed token count 12"):
        flashflow.flash_attn_varlen_func(q, k, k, cq, ck, 6, 12)
    ck = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="max_seqlen_q=5 is smaller"):
        flashflow.flash_attn_varlen_func(q, k, k, cq, ck, 5, 12)
    with pytest.raises(TypeError, match="int32"):
        flashflow.flash_attn_varlen_func(q, k, k, cq.long(), ck, 6, 12)
    bad = torch.tensor([0, 7, 4, 10], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="non-decreasing"):
        flashflow.flash_attn_varlen_func(q, k, k, bad, torch.tensor([0, 3, 6, 12], dtype=torch.int32,
                                                                     device=device), 7, 12)


def test_sdpa_bad_inputs(device):
    q = rand(1, 4, 8, 32, device=device)
    with pytest.raises(ValueError, match="dropout_p"):
        flashflow.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="enable_gqa"):
        flashflow.scaled_dot_product_attention(q, rand(1, 2, 8, 32, device=device), rand(1, 2, 8, 32, device=device))
    with pytest.raises(ValueError, match="does not broadcast"):
        flashflow.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 8, 8, dtype=torch.bool,
                                                                               device=device))
    with pytest.raises(ValueError, match="not both"):
        flashflow.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool,
                                                                               device=device), is_causal=True)


# ---------------------------------------------------------------------------------------------
# bf16 (the interpreter's bf16 tl.dot is wrong: the kernels convert to fp32 there), grad, scale
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_against_float64(device, causal):
    check_dense(2, 77, 130, 4, 2, 64, dtype=torch.bfloat16, causal=causal, device=device)


def test_bf16_softcap_window_tail_split_varlen_sdpa(device):
    check_dense(1, 61, 97, 2, 1, 48, dtype=torch.bfloat16, softcap=5.0, window=(8, 8), device=device)
    check_dense(2, 77, 300, 4, 2, 64, dtype=torch.bfloat16, config=AttentionConfig(32, 32, 4, 1), num_sms=10,
                device=device)
    lens = [1, 17, 40]
    cu = _cu(lens, device=device)
    q, k, v = (rand(sum(lens), 2, 32, dtype=torch.bfloat16, device=device) for _ in range(3))
    out = flashflow.flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=True)
    ref = attention_varlen_naive(q.double(), k.double(), v.double(), cu, cu, causal=True)
    assert rel_l2(out, ref) < TOL[torch.bfloat16]
    qs, ks, vs = (rand(1, 2, 20, 32, dtype=torch.bfloat16, device=device) for _ in range(3))
    mask = torch.rand(20, 20, device=device) > 0.3
    mask[:, 0] = True
    out = flashflow.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
    assert rel_l2(out, sdpa_ref(qs, ks, vs, attn_mask=mask)) < TOL[torch.bfloat16]


def test_sdpa_mask_requiring_grad_is_refused(device):
    q = rand(1, 2, 8, 32, dtype=torch.float32, device=device)
    bias = torch.zeros(8, 8, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask requires grad"):
        flashflow.scaled_dot_product_attention(q, q, q, attn_mask=bias)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf"), 0.0, -0.5])
def test_bad_softmax_scale(device, scale):
    x = rand(1, 8, 2, 32, device=device)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=rf"softmax_scale must be a finite number > 0, got {scale}"):
        flashflow.flash_attn_func(x, x, x, softmax_scale=scale)
    with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
        flashflow.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, 8, 8, softmax_scale=scale)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        flashflow.scaled_dot_product_attention(x, x, x, scale=scale)
    with pytest.raises(TypeError, match="softmax_scale must be a float"):
        flashflow.flash_attn_func(x, x, x, softmax_scale="0.1")


def test_bad_softcap_and_causal_values(device):
    x = rand(1, 8, 2, 32, device=device)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softcap must be a finite number"):
            flashflow.flash_attn_func(x, x, x, softcap=bad)
    with pytest.raises(TypeError, match="causal must be True or False, got 'yes'"):
        flashflow.flash_attn_func(x, x, x, causal="yes")


def test_empty_inputs_give_empty_outputs_and_zero_kv_heads_is_named(device):
    for b, sq, sk in ((0, 8, 8), (2, 0, 8)):
        q, k = rand(b, sq, 2, 32, device=device), rand(b, sk, 2, 32, device=device)
        out, lse = flashflow.flash_attn_func(q, k, k, return_lse=True)
        assert out.shape == q.shape and lse.shape == (b, 2, sq)
    with pytest.raises(ValueError, match=r"at least one head each, got 2 heads of q and 0 heads of k/v"):
        flashflow.flash_attn_func(rand(1, 8, 2, 32, device=device), rand(1, 8, 0, 32, device=device),
                                  rand(1, 8, 0, 32, device=device))


def test_sdpa_with_a_bias_looks_up_the_bias_config(device, monkeypatch):
    # the config is the lookup's, bias included, and used as it is (no edit after the lookup)
    seen = []
    real = attn_ops.attention_config
    monkeypatch.setattr(attn_ops, "attention_config", lambda *a: seen.append(a) or real(*a))
    q = rand(1, 2, 8, 32, device=device)
    flashflow.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool, device=device))
    flashflow.scaled_dot_product_attention(q, q, q)
    assert [a[-1] for a in seen] == [True, False]
