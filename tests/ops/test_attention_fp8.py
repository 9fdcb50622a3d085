"""FP8 attention (flash_attn_fp8_func, scaled_dot_product_attention_fp8) through Triton's
interpreter on the CPU, where the FP8 products are emulated in fp32 on the same e4m3 values.

* The quantize pass equals :func:`quantize_qkv_reference` exactly (values) and to one rounding
  (scales), padding included.
* The forward follows :func:`attention_fp8_reference` (the same numerics, in fp32 as the kernel
  runs them) up to fp32 rounding and the rare p it rounds across an e4m3 tie; and it stays within
  the error of 8-bit products of exact attention (float64), its LSE within the largest score
  error of its row.
* Views of another storage (non-unit head_dim stride, transposed, stride-0 expanded, packed qkv)
  give the bits of contiguous copies.
* A NaN or inf input reaches every output exact attention makes non-finite, and exactly the
  outputs the granularity docs/fp8.md states ("Non-finite inputs"), as the reference does.

Inputs are fresh random draws (the seed is in every failure message; FLASHFLOW_TEST_SEED replays
one) rounded to multiples of 2^-8, so that a sum of keys is exact in fp32 in any order: the
kernel's mean of K is then the reference's to the bit. Every buffer the op allocates starts as NaN
(8-bit buffers as -128 or all bits set), so an element left unwritten shows.
"""
import os
import secrets
from contextlib import contextmanager

import pytest
import torch

import flashflow
from flashflow.device import cdiv, gpu_family
from flashflow.ops import attention_fp8 as fp8_ops
from flashflow.ops.attention_fp8 import (
    flash_attn_fp8_func,
    quantize_attention_inputs,
    scaled_dot_product_attention_fp8,
)
from flashflow.reference import (attention_fp8_reference, attention_naive, full_key_padding_mask,
                                 quantize_qkv_reference, stress_qkv)
from flashflow.reference.attention_fp8 import LN2
from flashflow.reference.metrics import cosine, rel_l1, rel_l2
from flashflow.tuning.attention_fp8 import attention_fp8_config
from kernel_device import DEVICE
from nonfinite_cases import exact_attention_over

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.skipif(DEVICE == "cuda" and gpu_family(torch.device(DEVICE)) != "sm90",
                       reason="FP8 attention runs on Hopper (sm90) and newer"),
]
FORMATS = ["int8", "fp8"]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
P_SCALE = 448.0


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def fresh_seed() -> int:
    return int(os.environ.get("FLASHFLOW_TEST_SEED") or secrets.randbits(31))


def on_grid(t, dtype):
    """``t`` rounded to a multiple of 2^-8, then to ``dtype`` (still a multiple of 2^-8)."""
    return (t * 256).round().div(256).to(dtype=dtype, device=DEVICE)


def qkv(b, sq, sk, h, hk, d, dtype=torch.float16, kind="gaussian", seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(on_grid(t, dtype) for t in stress_qkv(b, sq, sk, h, hk, d, kind, generator=g))


@contextmanager
def poisoned():
    """While active, every tensor torch.empty makes starts as NaN; 8-bit ones as -128 (int8) or
    all bits set (uint8 byte buffers: NaN once seen as e4m3)."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t.fill_({torch.int8: -128, torch.uint8: 255}[t.dtype]) if t.dtype in (torch.int8, torch.uint8) else t

    torch.empty = poisoned_empty
    try:
        yield
    finally:
        torch.empty = empty


def config(d, causal):
    """The config the op picks here: its BLOCK_N is the reference's k_block and block_n."""
    return attention_fp8_config(d, causal, gpu_family(torch.device(DEVICE)))


def fp8_reference(q, k, v, fmt, causal=False, mask=None):
    """attention_fp8_reference in fp32 as the kernel computes (its quantization then rounds as the
    kernel's does), on fp32 copies of the inputs so that its output is not rounded to 16 bits."""
    cfg = config(q.shape[-1], causal)
    return attention_fp8_reference(q.float(), k.float(), v.float(), None, causal=causal, key_padding_mask=mask,
                                   return_lse=True, qk_format=fmt, q_block=1, k_block=cfg.BLOCK_N,
                                   block_n=cfg.BLOCK_N, block_m=cfg.BLOCK_M, p_scale=P_SCALE, smooth_k=True)


def quantize_reference(q, k, v, scale, fmt, bn, smooth_k=True):
    return quantize_qkv_reference(q.float(), k.float(), v.float(), scale, fmt, q_block=1, k_block=bn,
                                  smooth_k=smooth_k)


def allowed_keys(b, sq, sk, causal, mask):
    """(batch, 1, seqlen_q, seqlen_k): which keys each query row may attend."""
    rows = torch.arange(sq, device=DEVICE)[:, None]
    cols = torch.arange(sk, device=DEVICE)[None, :]
    allowed = (cols <= rows + sk - sq) if causal else torch.ones(sq, sk, dtype=torch.bool, device=DEVICE)
    allowed = allowed[None, None].expand(b, 1, sq, sk)
    return allowed & mask[:, None, None, :] if mask is not None else allowed


def kernel_scores(qz, q, k, scale, bn):
    """(batch, heads, seqlen_q, seqlen_k), float64, natural-log units: the scores the kernel's
    8-bit operands give, ``(q8·k8ᵀ)·q_scale·k_scale``, with the smoothing shift q·k̄·scale
    added back (k̄ the exact mean of k)."""
    sq, sk, heads, kv_heads = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    group = heads // kv_heads
    q8 = qz["q8"].double()[:, :, :sq]
    k8 = qz["k8"].double()[:, :, :sk].repeat_interleave(group, dim=1)
    k_scale = qz["k_scale"].double().repeat_interleave(group, dim=1).repeat_interleave(bn, dim=2)[:, :, :sk]
    s = torch.einsum("bhqd,bhkd->bhqk", q8, k8) * qz["q_scale"].double()[:, :, :sq, None] * k_scale[:, :, None, :]
    kmean = k.double().mean(dim=1).repeat_interleave(group, dim=1)      # (b, h, d)
    return s * LN2 + (torch.einsum("bqhd,bhd->bhq", q.double(), kmean) * scale)[..., None]


def lse_rounding(qz, q, k):
    """Per (batch, head, query): what fp32 arithmetic may move the kernel's LSE by, natural log.
    The INT8 scores are ``(qk + 1.5·2^23)·r − 1.5·2^23·r`` (r = q_scale·k_scale, the exponent
    trick of kernels/attention_fp8.py); without an FMA (the interpreter) each product rounds at
    the scale of 1.5·2^23·r, about r: 4r bounds the score error, and so the LSE's, plus fp32
    rounding of the LSE itself."""
    sq, heads, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    k_max = qz["k_scale"].amax(dim=-1).repeat_interleave(heads // kv_heads, dim=1)   # (b, h)
    r = qz["q_scale"][:, :, :sq].double() * k_max[..., None].double()
    return 4 * r * LN2 + 1e-5


# ---------------------------------------------------------------------------------------------
# the quantize pass
# ---------------------------------------------------------------------------------------------

# b, sq, sk, h, hk, d, dtype, kind, block_m, block_n
QUANT = {
    "fp16-gqa-odd": (2, 37, 53, 4, 2, 64, "fp16", "gaussian", 32, 16),
    "bf16-mqa-offset-d128": (1, 37, 53, 4, 1, 128, "bf16", "offset", 32, 16),
    # 150 keys of one kv head: more than one chunk of K/V statistics
    "fp16-outliers-stat-chunks": (1, 20, 150, 2, 1, 64, "fp16", "outliers", 32, 16),
    "bf16-peaked-gpu-tiles": (2, 37, 53, 2, 2, 64, "bf16", "peaked", 128, 64),
    # 1100 keys of one kv head: 35 chunks of 32, reduced once a head
    "bf16-offset-many-stat-chunks": (1, 5, 1100, 1, 1, 64, "bf16", "offset", 32, 16),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(QUANT))
def test_quantize_equals_reference(case, fmt):
    b, sq, sk, h, hk, d, dtype, kind, bm, bn = QUANT[case]
    seed = fresh_seed()
    q, k, v = qkv(b, sq, sk, h, hk, d, DTYPES[dtype], kind, seed)
    scale = d ** -0.5
    with poisoned():
        qz = quantize_attention_inputs(q, k, v, scale, bm, bn, fmt, lse_correction=True)
    ref = quantize_reference(q, k, v, scale, fmt, bn)
    msg = f"seed {seed}"
    sq_pad, sk_pad = cdiv(sq, max(bm, bn)) * max(bm, bn), cdiv(sk, bn) * bn
    assert (qz["sq_pad"], qz["sk_pad"]) == (sq_pad, sk_pad)
    qk_dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    assert qz["q8"].dtype == qz["k8"].dtype == qk_dtype and qz["vt8"].dtype == torch.float8_e4m3fn

    q8, k8, vt8 = (qz[name].float() for name in ("q8", "k8", "vt8"))
    assert q8.shape == (b, h, sq_pad, d) and k8.shape == (b, hk, sk_pad, d) and vt8.shape == (b, hk, d, sk_pad)
    assert torch.equal(q8[:, :, :sq], ref.q_q.transpose(1, 2)), msg
    assert torch.equal(k8[:, :, :sk], ref.k_q.transpose(1, 2)), msg
    assert torch.equal(vt8[..., :sk], ref.v_q.permute(0, 2, 3, 1)), msg   # V transposed: (b, hk, d, keys)
    assert (q8[:, :, sq:] == 0).all() and (k8[:, :, sk:] == 0).all() and (vt8[..., sk:] == 0).all(), msg

    assert qz["k_scale"].shape == ref.sk.shape and qz["v_scale"].shape == ref.sv.shape
    torch.testing.assert_close(qz["q_scale"][:, :, :sq], ref.sq, rtol=1e-6, atol=0, msg=msg)
    torch.testing.assert_close(qz["k_scale"], ref.sk, rtol=1e-6, atol=0, msg=msg)
    torch.testing.assert_close(qz["v_scale"], ref.sv, rtol=1e-6, atol=0, msg=msg)

    # the LSE correction: softmax_scale · q·k̄ per row, an fp32 sum of d products
    kmean = ref.kmean.double().repeat_interleave(h // hk, dim=1)
    want = torch.einsum("bqhd,bhd->bhq", q.double(), kmean) * scale
    bound = torch.einsum("bqhd,bhd->bhq", q.double().abs(), kmean.abs()) * scale * 2.0 ** -16 + 1e-30
    err = (qz["q_corr"][:, :, :sq].double() - want).abs()
    assert qz["q_corr"].shape == (b, h, sq_pad)
    assert (err <= bound).all(), f"{msg}: q_corr off by {(err / bound).max().item():.2f} of the bound"


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_without_smoothing_or_lse_correction(fmt):
    seed = fresh_seed()
    q, k, v = qkv(1, 21, 45, 2, 1, 64, torch.float16, "offset", seed)
    with poisoned():
        qz = quantize_attention_inputs(q, k, v, 0.1, 32, 16, fmt, lse_correction=False, smooth_k=False)
    ref = quantize_reference(q, k, v, 0.1, fmt, 16, smooth_k=False)
    assert torch.equal(qz["k8"].float()[:, :, :45], ref.k_q.transpose(1, 2)), f"seed {seed}"
    torch.testing.assert_close(qz["k_scale"], ref.sk, rtol=1e-6, atol=0)
    assert qz["q_corr"].shape == (1,)


# ---------------------------------------------------------------------------------------------
# the forward against the reference numerics and exact attention
# ---------------------------------------------------------------------------------------------

# b, sq, sk, h, hk, d, dtype, causal, fmt, kind, mask
FORWARD = {
    "fp16-d64-gqa-int8": (2, 37, 53, 4, 2, 64, "fp16", False, "int8", "gaussian", None),
    "fp16-d64-mqa-causal-fp8": (2, 37, 53, 4, 1, 64, "fp16", True, "fp8", "gaussian", None),
    "bf16-d128-gqa-causal-int8-offset": (1, 37, 53, 4, 2, 128, "bf16", True, "int8", "offset", None),
    "bf16-d64-mha-fp8-peaked": (2, 37, 53, 2, 2, 64, "bf16", False, "fp8", "peaked", None),
    "fp16-d128-mqa-int8-peaked-mask": (2, 37, 53, 4, 1, 128, "fp16", False, "int8", "peaked", "prefix"),
    "bf16-d64-gqa-causal-fp8-offset-mask": (2, 37, 53, 4, 2, 64, "bf16", True, "fp8", "offset", "prefix"),
    "fp16-d128-fp8-offset": (1, 37, 53, 2, 1, 128, "fp16", False, "fp8", "offset", None),
    "bf16-d128-int8-gaussian-strided-mask": (2, 37, 53, 2, 2, 128, "bf16", False, "int8", "gaussian", "strided"),
    # sq > sk: the first sq - sk rows see no key (0 out, -inf LSE)
    "fp16-d64-causal-sq>sk-int8": (1, 53, 37, 2, 1, 64, "fp16", True, "int8", "gaussian", None),
    "fp16-d256-int8": (1, 37, 40, 2, 1, 256, "fp16", False, "int8", "gaussian", None),
}
PREFIX = 20   # keys the mask covers, < seqlen_k: the rest are allowed


def prefix_mask(b, strided, g):
    """(b, PREFIX): row 0 random, row 1 all False (only the keys past the prefix are left)."""
    mask = torch.rand(b, PREFIX, generator=g) < 0.7
    mask[0, 0] = True
    mask[1:] = False
    if strided:   # a (PREFIX, b) tensor seen transposed: stride 1 along the batch, not the keys
        return mask.t().contiguous().to(DEVICE).t()
    return mask.to(DEVICE)


def exact_bounds(fmt, kind):
    """(cosine >, rel L1 <) against exact attention: the error of the format's numerics, which
    attention_fp8_reference shows alike. INT8 Q·K leaves the error of e4m3 P·V (~3% rel L1);
    e4m3 Q·K adds a relative step of 1/16 on every product, which peaked scores (std ~6)
    magnify (cosine ~0.9955, rel L1 ~0.075 on these sizes)."""
    if fmt == "int8":
        return 0.999, 0.06
    return (0.993, 0.10) if kind == "peaked" else (0.998, 0.06)


@pytest.mark.parametrize("case", list(FORWARD))
def test_forward_against_reference_and_exact(case):
    b, sq, sk, h, hk, d, dtype, causal, fmt, kind, mask_kind = FORWARD[case]
    seed = fresh_seed()
    scale = d ** -0.5
    cfg = config(d, causal)
    q, k, v = qkv(b, sq, sk, h, hk, d, DTYPES[dtype], kind, seed)
    key_padding_mask = (None if mask_kind is None
                        else prefix_mask(b, mask_kind == "strided", torch.Generator().manual_seed(seed)))
    with poisoned():
        out, lse = flash_attn_fp8_func(q, k, v, causal=causal, return_lse=True, key_padding_mask=key_padding_mask,
                                       qk_format=fmt)
    msg = f"seed {seed}"
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), f"{msg}: NaN/inf in out (an element left unwritten?)"

    mask = full_key_padding_mask(key_padding_mask, sk)
    ref, ref_lse = fp8_reference(q, k, v, fmt, causal, mask)
    exact, exact_lse = attention_naive(q.double(), k.double(), v.double(), scale, causal=causal,
                                       key_padding_mask=mask, return_lse=True)
    empty = torch.isneginf(exact_lse)                   # (b, h, sq): rows without an allowed key
    assert torch.equal(torch.isneginf(lse), empty), msg
    assert torch.isfinite(lse[~empty]).all(), msg
    assert (out.transpose(1, 2)[empty] == 0).all(), msg
    if causal and (mask_kind is not None or sq > sk):
        assert empty.any()   # the case does reach rows with no key

    # the reference: the same numerics on the same 8-bit values (test_quantize_equals_reference)
    qz = quantize_attention_inputs(q, k, v, scale, cfg.BLOCK_M, cfg.BLOCK_N, fmt, lse_correction=True)
    # apart from fp32 rounding: the kernel may round a p onto the other side of an e4m3 tie
    # (1/16 to 1/8 of that p), the rows it touches stand out, the rest agree to the output's
    # rounding (one ulp, eps: the interpreter truncates fp32 to bf16)
    eps = torch.finfo(q.dtype).eps
    gap = rel_l2(out, ref)
    assert gap < 5e-3 + eps / 2, f"{msg}: rel L2 to the reference {gap:.2e}"
    o, r = out.double(), ref.double()
    close = ((o - r).abs() <= eps * r.abs() + 1e-5).double().mean().item()
    assert close > 0.8, f"{msg}: only {close:.3f} of the elements within the output's rounding of the reference"
    tol = lse_rounding(qz, q, k)
    fin = ~empty
    lse_gap = (lse.double() - ref_lse.double()).abs()
    assert (lse_gap <= tol + 1e-5 * ref_lse.double().abs())[fin].all(), \
        f"{msg}: LSE up to {lse_gap[fin].max().item():.2e} from the reference's"

    # exact attention: the error of 8-bit products
    min_cos, max_l1 = exact_bounds(fmt, kind)
    assert cosine(out, exact) > min_cos, f"{msg}: cosine {cosine(out, exact):.5f}"
    assert rel_l1(out, exact) < max_l1, f"{msg}: rel L1 {rel_l1(out, exact):.3f}"
    # |LSE(S_q) − LSE(S)| <= max |S_q − S| over the row (an LSE is 1-Lipschitz in the max norm):
    # the kernel's LSE is within its own operands' largest score error of the exact one, which
    # holds only with the smoothing shift q·k̄ restored
    allowed = allowed_keys(b, sq, sk, causal, mask)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(h // hk, dim=2)) * scale
    bound = (kernel_scores(qz, q, k, scale, cfg.BLOCK_N) - s).abs().masked_fill(~allowed, 0.0).amax(dim=-1)
    gap = (lse.double() - exact_lse).abs()
    ok = gap <= bound + tol + 1e-5 * exact_lse.abs()
    assert ok[~empty].all(), f"{msg}: LSE {(gap - bound)[~empty].max().item():.2e} beyond its row's score error"
    if kind == "offset":   # keys sharing a large mean: an LSE without the shift back fails the check
        kmean = k.double().mean(dim=1).repeat_interleave(h // hk, dim=1)
        unshifted = lse.double() - torch.einsum("bqhd,bhd->bhq", q.double(), kmean) * scale
        assert not ((unshifted - exact_lse).abs() <= bound + tol)[~empty].all(), msg

    if mask_kind is not None:   # the LSE's extra work leaves the output's bits alone
        with poisoned():
            out2 = flash_attn_fp8_func(q, k, v, causal=causal, key_padding_mask=key_padding_mask, qk_format=fmt)
        assert torch.equal(out2, out), msg


# ---------------------------------------------------------------------------------------------
# SDPA layout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["causal-scale-fp8", "mask-gqa-int8", "broadcast-mask"])
def test_sdpa_equals_flash_on_transposed_views(case):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    b, h, hk, s, d = 2, 2, 1, 40, 64
    q, k, v = (t.transpose(1, 2).contiguous() for t in qkv(b, s, s, h, hk, d, torch.float16, "gaussian", seed))
    kw, flash_kw, mask = {}, {}, None
    if case == "causal-scale-fp8":
        kw = dict(is_causal=True, scale=0.1, qk_format="fp8")
        flash_kw = dict(causal=True, softmax_scale=0.1, qk_format="fp8")
    else:
        rows = 1 if case == "broadcast-mask" else b
        mask = torch.rand(rows, 1, 1, s, generator=g) < 0.6
        mask[..., 0] = True   # PyTorch's SDPA gives NaN for a row with no key; keep one
        mask = mask.to(DEVICE)
        kw = dict(attn_mask=mask)
        flash_kw = dict(key_padding_mask=mask[:, 0, 0, :].expand(b, s).contiguous())
    with poisoned():
        out = scaled_dot_product_attention_fp8(q, k, v, enable_gqa=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    # flash layout, contiguous copies: the strided reads of the SDPA views must give the same bits
    bshd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    want = flash_attn_fp8_func(*bshd, **flash_kw).transpose(1, 2)
    assert torch.equal(out, want), f"seed {seed}"
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, is_causal=kw.get("is_causal", False),
        scale=kw.get("scale"), enable_gqa=True)
    assert cosine(out, exact) > exact_bounds(kw.get("qk_format", "int8"), "gaussian")[0], f"seed {seed}"


# ---------------------------------------------------------------------------------------------
# layouts: strided, transposed, expanded and packed views
# ---------------------------------------------------------------------------------------------


def layout_views(layout, b, s, h, hk, d, seed):
    """q, k, v ``(batch, seqlen, heads, head_dim)`` as views of another storage, values on the
    2^-8 grid (so that a contiguous copy holds exactly the same values)."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return on_grid(torch.randn(*shape, generator=g), torch.float16)

    if layout == "head_dim-stride-2":      # every other element of a wider tensor
        return tuple(draw(b, s, n, 2 * d)[..., ::2] for n in (h, hk, hk))
    if layout == "sdpa-storage":           # (batch, heads, seqlen, head_dim) storage, transposed
        return tuple(draw(b, n, s, d).transpose(1, 2) for n in (h, hk, hk))
    if layout == "head_dim-major":         # (batch, heads, head_dim, seqlen) storage: head_dim strided by s
        return tuple(draw(b, n, d, s).permute(0, 3, 1, 2) for n in (h, hk, hk))
    if layout == "expanded-batch":         # stride 0 along the batch
        return tuple(draw(1, s, n, d).expand(b, s, n, d) for n in (h, hk, hk))
    if layout == "expanded-heads":         # stride 0 along the heads (one head shared)
        return tuple(draw(b, s, 1, d).expand(b, s, n, d) for n in (h, hk, hk))
    if layout == "packed-qkv":             # slices of one (batch, seqlen, heads + 2·kv_heads, head_dim)
        qkv_ = draw(b, s, h + 2 * hk, d)
        return qkv_[:, :, :h], qkv_[:, :, h:h + hk], qkv_[:, :, h + hk:]
    raise AssertionError(layout)


LAYOUTS = ["head_dim-stride-2", "sdpa-storage", "head_dim-major", "expanded-batch", "expanded-heads", "packed-qkv"]
SDPA_LAYOUTS = ("head_dim-stride-2", "expanded-heads")   # (SDPA storage: test_sdpa_equals_flash_on_transposed_views)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_equal_contiguous_inputs_and_exact(layout):
    seed = fresh_seed()
    b, s, h, hk, d = 2, 45, 4, 2, 64
    q, k, v = layout_views(layout, b, s, h, hk, d, seed)
    key_padding_mask = prefix_mask(b, False, torch.Generator().manual_seed(seed))
    msg = f"{layout}, seed {seed}"
    mask = full_key_padding_mask(key_padding_mask, s)
    with poisoned():
        out, lse = flash_attn_fp8_func(q, k, v, causal=True, return_lse=True, key_padding_mask=key_padding_mask)
    want, want_lse = flash_attn_fp8_func(*(t.contiguous() for t in (q, k, v)), causal=True, return_lse=True,
                                         key_padding_mask=key_padding_mask)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), msg
    exact = attention_naive(q.double(), k.double(), v.double(), d ** -0.5, causal=True, key_padding_mask=mask)
    live = exact.transpose(1, 2)[~torch.isneginf(want_lse)]   # rows with a key (the rest are 0 in both)
    mine = out.transpose(1, 2)[~torch.isneginf(want_lse)]
    min_cos, max_l1 = exact_bounds("int8", "gaussian")
    assert cosine(mine, live) > min_cos and rel_l1(mine, live) < max_l1, msg
    if layout in SDPA_LAYOUTS:   # the SDPA entry point on the same storage, seen in its layout
        with poisoned():
            sdpa = scaled_dot_product_attention_fp8(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                    enable_gqa=True).transpose(1, 2)
        exact = attention_naive(q.double(), k.double(), v.double(), d ** -0.5)
        assert cosine(sdpa, exact) > min_cos and rel_l1(sdpa, exact) < max_l1, msg


# ---------------------------------------------------------------------------------------------
# non-finite inputs
# ---------------------------------------------------------------------------------------------


def exact_attention(q, k, v, scale, causal, mask):
    """Float64 exact attention (out, lse) in which a key a row may not attend contributes nothing
    to it (tests/nonfinite_cases.py)."""
    b, sq, _, _ = q.shape
    return exact_attention_over(q, k, v, scale, allowed_keys(b, sq, k.shape[1], causal, mask))


def reached(which, pos, shape, causal, mask, block_m, block_n):
    """(batch, seqlen_q, heads, head_dim) bool: the outputs a non-finite ``which[pos]`` makes
    non-finite, by the rule of docs/fp8.md ("Non-finite inputs"). ``pos`` is (batch, token, head
    of that tensor, channel); ``mask`` the full (batch, seqlen_k) key-padding mask or None."""
    b, sq, sk, h, hk, d = shape
    b0, t, head, c = pos
    allowed = allowed_keys(b, sq, sk, causal, mask)[:, 0]            # (b, sq, sk)
    out = torch.zeros(b, sq, h, d, dtype=torch.bool, device=DEVICE)
    if which == "q":                                                # the row, if it has a key
        out[b0, t, head] = allowed[b0, t].any()
        return out
    if mask is not None and not mask[b0, t]:                        # a key no row sees
        return out
    heads = slice(head * (h // hk), (head + 1) * (h // hk))
    n0 = t // block_n * block_n
    if which == "k":   # K's scale of the key block: rows that attend one of its keys
        out[b0, :, heads] = allowed[b0, :, n0:n0 + block_n].any(dim=-1)[:, None, None]
    else:              # e4m3 NaN in V: channel c of the rows of every tile that loads the block
        rows = torch.arange(sq, device=DEVICE)
        last = ((rows // block_m + 1) * block_m).clamp(max=sq) - 1
        hi = (last + sk - sq + 1).clamp(max=sk) if causal else torch.full_like(rows, sk)
        out[b0, :, heads, c] = (n0 < hi)[:, None]
    return out


# where the bad values go, (batch, token, head of its tensor, channel): NaN in batch row 0, KV
# group 1, +inf in batch row 1, KV group 0 (one call: the two share no (batch, kv head) pair);
# keys: one that causal rows from 34 on attend (37 queries, 53 keys), or one the mask hides or shows
BAD_AT = {"q": ((0, 30, 3, 7), (1, 33, 0, 9)), "k": ((0, 50, 1, 7), (1, 50, 0, 9)),
          "v": ((0, 50, 1, 7), (1, 50, 0, 9))}
PREFIX_KEY = 5
NON_FINITE = [(which, causal, mask) for which in "qkv" for causal in (False, True)
              for mask in ((None, "mask") if which == "q" else (None, "hides-it", "shows-it"))
              if not (mask == "shows-it" and not causal)]   # without causal: as None


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")   # NaN through the interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("which,causal,mask_kind", NON_FINITE,
                         ids=[f"{w}-{'causal' if c else 'full'}-{m}" for w, c, m in NON_FINITE])
def test_non_finite_inputs_reach_every_output_exact_attention_does(which, causal, mask_kind):
    seed = fresh_seed()
    shape = b, sq, sk, h, hk, d = 2, 37, 53, 4, 2, 64
    fmt = "fp8" if causal else "int8"
    cfg = config(d, causal)
    q, k, v = qkv(b, sq, sk, h, hk, d, torch.float16, "gaussian", seed)
    (nan_at, inf_at), key_padding_mask = BAD_AT[which], None
    if mask_kind is not None:
        key_padding_mask = prefix_mask(b, False, torch.Generator().manual_seed(seed))
        if which != "q":
            nan_at, inf_at = (0, PREFIX_KEY, 1, 7), (1, PREFIX_KEY, 0, 9)
            key_padding_mask[:, PREFIX_KEY] = mask_kind == "shows-it"
    mask = full_key_padding_mask(key_padding_mask, sk)
    inputs = {"q": q, "k": k, "v": v}
    inputs[which] = inputs[which].clone()
    inputs[which][nan_at], inputs[which][inf_at] = float("nan"), float("inf")
    msg = f"{which}[{nan_at}] = nan, {which}[{inf_at}] = inf, seed {seed}"
    with poisoned():
        out, lse = flash_attn_fp8_func(*inputs.values(), causal=causal, return_lse=True,
                                       key_padding_mask=key_padding_mask, qk_format=fmt)
    exact, exact_lse = exact_attention(*inputs.values(), d ** -0.5, causal, mask)
    bad = ~torch.isfinite(out)
    assert bad[~torch.isfinite(exact)].all(), f"{msg}: finite where exact attention is not"
    assert (~torch.isfinite(lse))[~torch.isfinite(exact_lse)].all(), f"{msg}: finite LSE where exact is not"
    assert torch.isfinite(out[0, :, :h // hk]).all() and torch.isfinite(out[1, :, h // hk:]).all(), \
        f"{msg}: reached another (batch, KV group)"
    # the design's granularity, exactly (the reference's rule alike)
    want = (reached(which, nan_at, shape, causal, mask, cfg.BLOCK_M, cfg.BLOCK_N)
            | reached(which, inf_at, shape, causal, mask, cfg.BLOCK_M, cfg.BLOCK_N))
    assert mask_kind == "hides-it" or (want[0].any() and want[1].any())
    rows = want.any(dim=-1).transpose(1, 2) if which != "v" else torch.zeros_like(want[..., 0]).transpose(1, 2)
    empty = ~allowed_keys(b, sq, sk, causal, mask).any(dim=-1).expand(b, h, sq)    # lse -inf, finite or not
    assert torch.equal(bad, want), f"{msg}: {bad.sum().item()} non-finite outputs, {want.sum().item()} expected"
    assert torch.equal(~torch.isfinite(lse), rows | empty), msg
    ref, ref_lse = fp8_reference(*inputs.values(), fmt, causal, mask)
    assert torch.equal(~torch.isfinite(ref), want) and torch.equal(~torch.isfinite(ref_lse), rows | empty), msg
    # what they do not reach keeps the reference's numerics (test_forward_against_reference_and_exact's
    # bound; that it is what 0 in their place gives: test_quantize_non_finite_equals_reference)
    assert rel_l2(out[~bad], ref[~bad]) < 5e-3 + torch.finfo(q.dtype).eps / 2, msg


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # NaN through the interpreter
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_non_finite_equals_reference(fmt):
    """NaN/inf in q, k, v, one at a key the mask hides: the scales (NaN marks included) and the
    e4m3 V (NaN included) are the reference's, the 8-bit Q and K too but in a marked token or
    block (unspecified there: its NaN scale decides), and all of it is what the inputs with 0 in
    place of each non-finite value give, but for the marks."""
    seed = fresh_seed()
    b, sq, sk, h, hk, d, bn = 2, 21, 45, 2, 1, 64, 16
    q, k, v = (t.clone() for t in qkv(b, sq, sk, h, hk, d, torch.float16, "gaussian", seed))
    key_padding_mask = torch.ones(b, 10, dtype=torch.bool, device=DEVICE)
    key_padding_mask[0, 3] = False
    q[0, 4, 1, 5], q[1, 20, 0, 0] = float("nan"), float("-inf")
    k[0, 3, 0, 2], k[0, 30, 0, 9], k[1, 44, 0, 1] = float("nan"), float("inf"), float("nan")   # key 3 hidden
    v[0, 3, 0, 2], v[0, 17, 0, 63], v[1, 0, 0, 0] = float("inf"), float("nan"), float("-inf")
    zeros = [t.nan_to_num(0.0, 0.0, 0.0) for t in (q, k, v)]
    with poisoned():
        qz = quantize_attention_inputs(q, k, v, d ** -0.5, 32, bn, fmt, lse_correction=True,
                                       key_padding_mask=key_padding_mask)
        qz0 = quantize_attention_inputs(*zeros, d ** -0.5, 32, bn, fmt, lse_correction=True,
                                        key_padding_mask=key_padding_mask)
    ref = quantize_qkv_reference(q.float(), k.float(), v.float(), d ** -0.5, fmt, q_block=1, k_block=bn,
                                 key_padding_mask=full_key_padding_mask(key_padding_mask, sk))
    msg = f"seed {seed}"
    # the marks: Q tokens (0, 1, 4) and (1, 0, 20); K blocks of key 30 and of batch 1's key 44,
    # not of the hidden key 3; V's NaN at key 17 and batch 1's key 0, not at key 3
    assert torch.isnan(qz["q_scale"]).nonzero().tolist() == [[0, 1, 4], [1, 0, 20]], msg
    assert torch.isnan(qz["k_scale"]).nonzero().tolist() == [[0, 0, 1], [1, 0, 2]], msg
    assert torch.isnan(qz["vt8"].float()).nonzero().tolist() == [[0, 0, 63, 17], [1, 0, 0, 0]], msg
    assert torch.isfinite(qz["v_scale"]).all(), msg
    for name, want in (("q_scale", ref.sq), ("k_scale", ref.sk), ("v_scale", ref.sv)):
        got = qz[name][:, :, :sq] if name == "q_scale" else qz[name]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, equal_nan=True, msg=msg)
    q_ok = ~torch.isnan(qz["q_scale"])[..., None].expand(qz["q8"].shape)
    k_ok = ~torch.isnan(qz["k_scale"]).repeat_interleave(bn, dim=2)[..., None].expand(qz["k8"].shape)
    q8, k8, vt8 = (qz[name].float() for name in ("q8", "k8", "vt8"))
    assert torch.equal(q8[:, :, :sq][q_ok[:, :, :sq]], ref.q_q.transpose(1, 2)[q_ok[:, :, :sq]]), msg
    assert torch.equal(k8[:, :, :sk][k_ok[:, :, :sk]], ref.k_q.transpose(1, 2)[k_ok[:, :, :sk]]), msg
    torch.testing.assert_close(vt8[..., :sk], ref.v_q.permute(0, 2, 3, 1), rtol=0, atol=0, equal_nan=True, msg=msg)
    for name, ok in (("q8", q_ok), ("k8", k_ok), ("vt8", ~torch.isnan(vt8)), ("q_scale", ~torch.isnan(qz["q_scale"])),
                     ("k_scale", ~torch.isnan(qz["k_scale"])), ("v_scale", None)):
        got, want = qz[name].float(), qz0[name].float()
        assert torch.equal(got if ok is None else got[ok], want if ok is None else want[ok]), f"{msg}: {name}"
    assert torch.equal(qz["q_corr"][1, 1], qz0["q_corr"][1, 1]), msg   # the LSE shift, of a clean row


# ---------------------------------------------------------------------------------------------
# empty shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b,sq,sk", [(0, 9, 9), (2, 0, 9), (2, 9, 0)], ids=["batch0", "seqlen_q0", "seqlen_k0"])
def test_empty_shapes(b, sq, sk):
    q = torch.randn(b, sq, 4, 64, device=DEVICE).half()
    k, v = (torch.randn(b, sk, 2, 64, device=DEVICE).half() for _ in range(2))
    key_padding_mask = torch.ones(b, sk, dtype=torch.bool, device=DEVICE)
    with poisoned():
        out, lse = flash_attn_fp8_func(q, k, v, causal=True, return_lse=True, key_padding_mask=key_padding_mask)
    assert out.shape == q.shape and lse.shape == (b, 4, sq) and lse.dtype == torch.float32
    if sk == 0:   # rows without keys: zeros and -inf, written (the buffers started as NaN)
        assert out.numel() > 0 and (out == 0).all() and torch.isneginf(lse).all()
    with poisoned():
        out = scaled_dot_product_attention_fp8(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               enable_gqa=True)
    assert out.shape == q.transpose(1, 2).shape and (out == 0).all()


# ---------------------------------------------------------------------------------------------
# custom op and torch.compile
# ---------------------------------------------------------------------------------------------


def test_custom_op_opcheck():
    q, k, v = qkv(1, 33, 40, 2, 1, 64, seed=fresh_seed())
    for args in ((q, k, v, None, 0.125, True, True, "int8"),
                 (q, k, v, torch.ones(1, 20, dtype=torch.bool, device=DEVICE), 0.125, False, False, "fp8")):
        torch.library.opcheck(torch.ops.flashflow.attention_fp8_fwd.default, args,
                              test_utils=("test_schema", "test_faketensor"))


def test_custom_op_opcheck_sdpa_layout():
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv(1, 33, 40, 2, 1, 64, seed=fresh_seed()))
    torch.library.opcheck(torch.ops.flashflow.attention_fp8_fwd.default, (q, k, v, None, 0.125, False, False, "int8"),
                          test_utils=("test_faketensor",))


def test_torch_compile_fullgraph_traces_through():
    q, k, v = qkv(1, 33, 40, 2, 1, 64, seed=fresh_seed())
    key_padding_mask = torch.ones(1, 20, dtype=torch.bool, device=DEVICE)
    key_padding_mask[0, 3] = False

    def f(q, k, v):
        o, lse = flash_attn_fp8_func(q * 2.0, k, v, causal=True, return_lse=True, key_padding_mask=key_padding_mask)
        return o.float().sum(-1) + lse.transpose(1, 2)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v), f(q, k, v))


# ---------------------------------------------------------------------------------------------
# bad inputs: clear errors before any launch
# ---------------------------------------------------------------------------------------------


def _x(*shape, dtype=torch.float16, device=DEVICE, **kw):
    return torch.zeros(*shape, dtype=dtype, device=device, **kw)


Q, KV = (1, 8, 4, 64), (1, 8, 2, 64)


def _call(q=None, k=None, v=None, **kw):
    return lambda: flash_attn_fp8_func(_x(*Q) if q is None else q, _x(*KV) if k is None else k,
                                       _x(*KV) if v is None else v, **kw)


BAD = {
    "fp32": (_call(_x(*Q, dtype=torch.float32), _x(*KV, dtype=torch.float32), _x(*KV, dtype=torch.float32)),
             TypeError, r"q must be bfloat16 or float16 .*got torch.float32"),
    "dtype mix": (_call(v=_x(*KV, dtype=torch.bfloat16)), TypeError, r"q, k, v must share one dtype"),
    "head_dim 300": (_call(_x(1, 8, 4, 300), _x(1, 8, 2, 300), _x(1, 8, 2, 300)), ValueError,
                     r"head_dim must be one of \(64, 128, 256\) for FP8 attention, got 300"),
    "head_dim 96": (_call(_x(1, 8, 4, 96), _x(1, 8, 2, 96), _x(1, 8, 2, 96)), ValueError,
                    r"head_dim must be one of \(64, 128, 256\) for FP8 attention, got 96"),
    "heads": (_call(_x(1, 8, 6, 64), _x(1, 8, 4, 64), _x(1, 8, 4, 64)), ValueError,
              r"heads of q \(6\) must be a multiple of kv_heads \(4\)"),
    "k/v shapes": (_call(v=_x(1, 9, 2, 64)), ValueError, r"k and v must have one shape"),
    "k batch": (_call(k=_x(2, 8, 2, 64), v=_x(2, 8, 2, 64)), ValueError, r"k/v must be \(batch=1, seqlen_k"),
    "k head_dim": (_call(k=_x(1, 8, 2, 128), v=_x(1, 8, 2, 128)), ValueError, r"head_dim=64\), got \(1, 8, 2, 128\)"),
    "rank": (_call(_x(8, 4, 64)), ValueError, r"q must have rank 4"),
    "not a tensor": (_call(k=[[0.0]]), TypeError, r"k must be a torch.Tensor"),
    "qk_format": (_call(qk_format="e5m2"), ValueError, r"qk_format must be one of \('int8', 'fp8'\), got 'e5m2'"),
    "mask dtype": (_call(key_padding_mask=_x(1, 8)), TypeError, r"key_padding_mask must be a bool tensor .*float16"),
    "mask too long": (_call(key_padding_mask=_x(1, 9, dtype=torch.bool)), ValueError,
                      r"key_padding_mask must be .*P <= seqlen_k = 8.*got shape \(1, 9\)"),
    "mask batch": (_call(key_padding_mask=_x(2, 8, dtype=torch.bool)), ValueError, r"got shape \(2, 8\)"),
    "mask rank": (_call(key_padding_mask=_x(8, dtype=torch.bool)), ValueError, r"got shape \(8,\)"),
    "mask device": (_call(key_padding_mask=torch.ones(1, 8, dtype=torch.bool, device="meta")), ValueError,
                    r"key_padding_mask must be on"),
    "mask type": (_call(key_padding_mask=[[True] * 8]), TypeError, r"key_padding_mask must be .*got list"),
    "requires grad": (_call(_x(*Q, requires_grad=True)), ValueError, r"flash_attn_fp8_func: q requires grad"),
    "causal int": (_call(causal=1), TypeError, r"causal must be True or False, got 1"),
    "causal str": (_call(causal="yes"), TypeError, r"causal must be True or False, got 'yes'"),
    "return_lse str": (_call(return_lse="no"), TypeError, r"return_lse must be True or False, got 'no'"),
    "return_lse None": (_call(return_lse=None), TypeError, r"return_lse must be True or False, got None"),
    "meta": (_call(*(_x(*shape, device="meta") for shape in (Q, KV, KV))), ValueError,
             r"q is a meta tensor \(shape only, no data\)"),
    "meta k": (_call(k=_x(*KV, device="meta")), ValueError, r"k is a meta tensor"),
    "meta strided v": (_call(v=_x(1, 8, 2, 128, device="meta")[..., ::2]), ValueError, r"v is a meta tensor"),
    "scale zero": (_call(softmax_scale=0.0), ValueError, r"softmax_scale"),
    "scale nan": (_call(softmax_scale=float("nan")), ValueError, r"softmax_scale"),
}


def _sdpa(q=(1, 4, 8, 64), kv=(1, 2, 8, 64), **kw):
    return lambda: scaled_dot_product_attention_fp8(_x(*q), _x(*kv), _x(*kv), **kw)


BAD_SDPA = {
    "gqa without enable_gqa": (_sdpa(), ValueError, r"pass enable_gqa=True"),
    "causal sq != sk": (_sdpa((1, 4, 5, 64), enable_gqa=True, is_causal=True), ValueError,
                        r"seqlen_q == seqlen_k only"),
    "float mask": (_sdpa(enable_gqa=True, attn_mask=_x(1, 1, 1, 8)), ValueError, r"attn_mask must be None or a bool"),
    "per-query mask": (_sdpa(enable_gqa=True, attn_mask=_x(1, 1, 8, 8, dtype=torch.bool)), ValueError,
                       r"attn_mask must be None or a bool"),
    "per-head mask": (_sdpa(enable_gqa=True, attn_mask=_x(1, 4, 1, 8, dtype=torch.bool)), ValueError,
                      r"attn_mask must be None or a bool"),
    "3-D": (_sdpa((4, 8, 64), enable_gqa=True), ValueError, r"query must be a 4-D tensor"),
    "is_causal str": (_sdpa(enable_gqa=True, is_causal="yes"), TypeError, r"is_causal must be True or False, got 'yes'"),
    "enable_gqa str": (_sdpa(enable_gqa="no"), TypeError, r"enable_gqa must be True or False, got 'no'"),
    "enable_gqa int": (_sdpa(kv=(1, 4, 8, 64), enable_gqa=1), TypeError, r"enable_gqa must be True or False, got 1"),
    "meta query": (lambda: scaled_dot_product_attention_fp8(*(_x(1, 2, 8, 64, device="meta") for _ in range(3))),
                   ValueError, r"query is a meta tensor"),
    "fp32": (lambda: scaled_dot_product_attention_fp8(*(_x(1, 2, 8, 64, dtype=torch.float32) for _ in range(3))),
             TypeError, r"bfloat16 or float16"),
}


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("launched with bad inputs")

    monkeypatch.setattr(fp8_ops, "_attention_fp8", refuse)


@pytest.mark.parametrize("case", list(BAD) + list(BAD_SDPA))
def test_bad_inputs_raise_before_launch(case, no_launch):
    call, error, match = {**BAD, **BAD_SDPA}[case]
    with pytest.raises(error, match=match):
        call()


def test_valid_inputs_reach_the_launch(no_launch):
    # the refusals above are the checks', not the no-launch stub's
    with pytest.raises(AssertionError, match="launched"):
        _call(key_padding_mask=_x(1, 5, dtype=torch.bool))()
    with pytest.raises(AssertionError, match="launched"):
        _sdpa(enable_gqa=True, attn_mask=_x(1, 1, 1, 8, dtype=torch.bool))()


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only run under the interpreter")
def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch, no_launch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"runs on CUDA tensors; got q on cpu"):
        _call()()


def test_gpus_without_fp8_are_refused(monkeypatch, no_launch):
    monkeypatch.setattr(fp8_ops, "gpu_family", lambda device: "sm80")
    with pytest.raises(ValueError, match=r"FP8 tensor cores \(Hopper, sm90, or newer\).*sm80.*flash_attn_func"):
        _call()()


def test_grad_disabled_inputs_are_taken(no_launch):
    with torch.no_grad(), pytest.raises(AssertionError, match="launched"):
        _call(_x(*Q, requires_grad=True))()


def test_public_exports():
    assert flashflow.flash_attn_fp8_func is flash_attn_fp8_func
    assert flashflow.scaled_dot_product_attention_fp8 is scaled_dot_product_attention_fp8
