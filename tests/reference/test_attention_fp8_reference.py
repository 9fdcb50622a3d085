"""The SageAttention-style quantized attention reference against exact float64 attention.

Where the quantization is the identity (inputs that int8 / e4m3 hold exactly) the reference must
equal attention_naive to float64 rounding; elsewhere it must stay close to it, restore the true
LSE, mask as FlashAttention does and refuse bad arguments.
"""
import math

import pytest
import torch

from flashflow.reference import (
    QuantizedQKV,
    attention_fp8_reference,
    attention_naive,
    quantize_qkv_reference,
    stress_qkv,
)
from flashflow.reference.attention_fp8 import LOG2E, QK_FORMATS, STRESS_KINDS, e4m3
from flashflow.reference.metrics import cosine

F64 = torch.float64


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _representable(shape, fmt, g):
    """Values int8 / e4m3 hold exactly, each token's row reaching the format's maximum, so that
    per-token (or per-group) quantization maps them onto themselves."""
    if fmt == "int8":
        x = torch.randint(-127, 128, shape, generator=g).to(F64)
        top = 127.0
    else:
        x = e4m3(torch.randn(shape, generator=g, dtype=F64) * 60)
        top = 448.0
    sign = torch.where(torch.rand(shape[:-1], generator=g) < 0.5, -1.0, 1.0).to(F64)
    x[..., 0] = top * sign
    return x


def _exactly_quantizable_qkv(fmt, batch, seqlen_q, seqlen_k, heads, kv_heads, d, g):
    """q, k, v for which quantization (with smoothing) is the identity: k is ±pairs of
    representable tokens plus a common integer offset, so kmean is that offset exactly and
    k - kmean is representable again."""
    q = _representable((batch, seqlen_q, heads, d), fmt, g)
    half = _representable((batch, seqlen_k // 2, kv_heads, d), fmt, g)
    offset = torch.randint(-300, 301, (1, 1, kv_heads, d), generator=g).to(F64)
    k = torch.cat([half, -half], dim=1)[:, torch.randperm(seqlen_k, generator=g)] + offset
    v = torch.randn(batch, seqlen_k, kv_heads, d, generator=g, dtype=F64)
    return q, k, v


@pytest.mark.parametrize("fmt", QK_FORMATS)
@pytest.mark.parametrize("causal,padding", [(False, False), (True, False), (False, True)])
def test_identity_quantization_in_float64_equals_naive_attention(fmt, causal, padding):
    g = _gen(1)
    batch, seqlen_q, seqlen_k, heads, kv_heads, d = 2, 19, 26, 4, 2, 16
    q, k, v = _exactly_quantizable_qkv(fmt, batch, seqlen_q, seqlen_k, heads, kv_heads, d, g)
    # Scores of O(1) so that the softmax is not one-hot and the comparison has something to see.
    scale = 1.0 / (q.std() * (k - k.mean(dim=1, keepdim=True)).std() * math.sqrt(d)).item()
    mask = torch.rand(batch, seqlen_k, generator=g) < 0.7 if padding else None
    quant = quantize_qkv_reference(q, k, v, scale, fmt, q_block=1, k_block=5, compute_dtype=F64)
    assert torch.equal(quant.k_q, k - quant.kmean[:, None])
    assert torch.equal(quant.sk, torch.ones_like(quant.sk))
    out, lse = attention_fp8_reference(q, k, v, scale, causal=causal, key_padding_mask=mask,
                                       return_lse=True, qk_format=fmt, k_block=5, block_n=7,
                                       quantize_pv=False, compute_dtype=F64)
    ref, ref_lse = attention_naive(q, k, v, scale, causal=causal, key_padding_mask=mask,
                                   return_lse=True)
    assert out.dtype == lse.dtype == F64
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("fmt", QK_FORMATS)
def test_online_block_loop_matches_one_block(fmt):
    q, k, v = stress_qkv(2, 37, 53, 4, 2, 32, "offset", generator=_gen(2))
    kw = dict(qk_format=fmt, k_block=8, quantize_pv=False, return_lse=True, causal=True)
    one_out, one_lse = attention_fp8_reference(q, k, v, block_n=64, **kw)
    for block_n in (1, 7, 16):
        out, lse = attention_fp8_reference(q, k, v, block_n=block_n, **kw)
        torch.testing.assert_close(out, one_out, rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(lse, one_lse, rtol=2e-6, atol=2e-5)


@pytest.mark.parametrize("fmt", QK_FORMATS)
@pytest.mark.parametrize("kind", ["gaussian", "offset", "peaked"])
@pytest.mark.parametrize("d,heads,kv_heads,q_block,k_block",
                         [(32, 4, 2, 1, 1), (64, 4, 2, 16, 64), (64, 2, 2, 1, 16)])
def test_quantized_close_to_exact_attention(fmt, kind, d, heads, kv_heads, q_block, k_block):
    q, k, v = stress_qkv(2, 37, 53, heads, kv_heads, d, kind, generator=_gen(3))
    out, lse = attention_fp8_reference(q, k, v, return_lse=True, qk_format=fmt, q_block=q_block,
                                       k_block=k_block, block_n=16)
    ref, ref_lse = attention_naive(q.double(), k.double(), v.double(), return_lse=True)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert cosine(out, ref) > 0.99
    assert (out.double() - ref).abs().sum() / ref.abs().sum() < 0.1
    # The LSE of base-2 scores, in natural log, plus the q·kmean that smoothing took away.
    # fp8 rounds each element to 1/16 relative, int8 to 1/254 of the row's largest: LSE errors
    # scale with the scores, ~6x larger in the peaked kind.
    tol = (0.05 if fmt == "int8" else 0.25) * (6 if kind == "peaked" else 1)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=tol)


def test_lse_restores_the_smoothing_shift():
    q, k, v = stress_qkv(1, 37, 53, 2, 1, 64, "offset", generator=_gen(4))
    _, ref_lse = attention_naive(q.double(), k.double(), v.double(), return_lse=True)
    _, smooth_lse = attention_fp8_reference(q, k, v, return_lse=True, smooth_k=True)
    _, plain_lse = attention_fp8_reference(q, k, v, return_lse=True, smooth_k=False)
    shift = (q.double() * k.double().mean(dim=1, keepdim=True)).sum(-1).transpose(1, 2) / 8.0
    assert shift.abs().max() > 1.0  # the offset makes the restored term matter
    torch.testing.assert_close(smooth_lse.double(), ref_lse, rtol=0, atol=0.05)
    torch.testing.assert_close(plain_lse.double(), ref_lse, rtol=0, atol=0.5)


def test_smoothing_helps_keys_with_a_common_offset():
    q, k, v = stress_qkv(1, 37, 53, 2, 1, 64, "offset", generator=_gen(5))
    ref = attention_naive(q.double(), k.double(), v.double())
    kw = dict(qk_format="int8", k_block=53, quantize_pv=False)
    err_smooth = (attention_fp8_reference(q, k, v, smooth_k=True, **kw).double() - ref).abs().sum()
    err_plain = (attention_fp8_reference(q, k, v, smooth_k=False, **kw).double() - ref).abs().sum()
    assert err_smooth < 0.5 * err_plain


@pytest.mark.parametrize("fmt", QK_FORMATS)
def test_causal_padding_and_empty_rows(fmt):
    g = _gen(6)
    batch, seqlen_q, seqlen_k = 3, 29, 17  # seqlen_q > seqlen_k: the first 12 causal rows are empty
    q, k, v = stress_qkv(batch, seqlen_q, seqlen_k, 4, 1, 32, "gaussian", generator=g)
    mask = torch.rand(batch, seqlen_k, generator=g) < 0.6
    mask[1] = False            # batch 1: no key at all
    mask[2, :-1] = False       # batch 2: only the last key, which every causal row may see
    mask[2, -1] = True
    out, lse = attention_fp8_reference(q, k, v, causal=True, key_padding_mask=mask,
                                       return_lse=True, qk_format=fmt, k_block=4, block_n=8)
    ref, ref_lse = attention_naive(q.double(), k.double(), v.double(), causal=True,
                                   key_padding_mask=mask, return_lse=True)
    empty = torch.isinf(ref_lse)
    assert empty[:, :, :seqlen_q - seqlen_k].all() and empty[1].all() and not empty[2, :, -1].any()
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all()
    assert torch.equal(out.transpose(1, 2)[empty], torch.zeros_like(out.transpose(1, 2)[empty]))
    assert torch.isfinite(out).all()
    live = ~empty
    assert cosine(out.transpose(1, 2)[live], ref.transpose(1, 2)[live]) > 0.99
    torch.testing.assert_close(lse[live].double(), ref_lse[live], rtol=0,
                               atol=0.05 if fmt == "int8" else 0.25)
    # A row that sees one key returns that key's value, up to V's e4m3 rounding.
    torch.testing.assert_close(out[2, -1], v[2, -1].expand(4, -1), rtol=0.07, atol=0.02)


@pytest.mark.parametrize("fmt", QK_FORMATS)
@pytest.mark.parametrize("q_block,k_block", [(1, 1), (16, 64), (5, 7)])
def test_quantized_tensors_and_scales(fmt, q_block, k_block):
    q, k, v = stress_qkv(2, 37, 53, 4, 2, 32, "outliers+offset", generator=_gen(7))
    quant = quantize_qkv_reference(q, k, v, qk_format=fmt, q_block=q_block, k_block=k_block)
    assert isinstance(quant, QuantizedQKV)
    n_q, n_k = -(-37 // q_block), -(-53 // k_block)
    assert quant.q_q.shape == q.shape and quant.k_q.shape == k.shape and quant.v_q.shape == v.shape
    assert quant.sq.shape == (2, 4, n_q) and quant.sk.shape == (2, 2, n_k)
    assert quant.kmean.shape == quant.sv.shape == (2, 2, 32)
    top = 127.0 if fmt == "int8" else 448.0
    for x_q in (quant.q_q, quant.k_q):
        if fmt == "int8":
            assert torch.equal(x_q, x_q.round()) and x_q.abs().max() <= 127
        else:
            assert torch.equal(x_q, e4m3(x_q))
    assert torch.equal(quant.v_q, e4m3(quant.v_q))
    # Each scale group reaches the top of the format: the scale is amax / top.
    q_groups = torch.nn.functional.pad(quant.q_q.abs().transpose(1, 2), (0, 0, 0, n_q * q_block - 37))
    assert torch.equal(q_groups.reshape(2, 4, n_q, -1).amax(-1), torch.full((2, 4, n_q), top))
    assert torch.equal(quant.v_q.abs().amax(dim=1), torch.full((2, 2, 32), 448.0))
    # Dequantized values are within half a step (int8) / 1/16 relative plus the subnormal step (fp8).
    c = torch.tensor(LOG2E / math.sqrt(32), dtype=torch.float32)
    sq_rows = quant.sq.repeat_interleave(q_block, dim=2)[:, :, :37].transpose(1, 2)[..., None]
    sk_rows = quant.sk.repeat_interleave(k_block, dim=2)[:, :, :53].transpose(1, 2)[..., None]
    torch.testing.assert_close(quant.kmean, k.mean(dim=1))
    for x, x_q, s in ((q * c, quant.q_q, sq_rows), (k - quant.kmean[:, None], quant.k_q, sk_rows)):
        err = (x_q * s - x).abs()
        bound = 0.5 * s * 1.001 if fmt == "int8" else (x.abs() / 16 + 2.0 ** -10 * s) * 1.001
        assert (err <= bound).all()


def _allowed(batch, seqlen_q, seqlen_k, causal, mask):
    """(batch, seqlen_q, seqlen_k): which keys each query row attends."""
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    allowed = (j <= i + seqlen_k - seqlen_q) if causal else torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    allowed = allowed.expand(batch, seqlen_q, seqlen_k)
    return allowed & mask[:, None, :] if mask is not None else allowed


def _exact_without_hidden_keys(q, k, v, scale, allowed):
    """Float64 attention in which a key a row does not attend adds nothing (not 0·v)."""
    group = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, dim=2)) * scale
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    terms = p[..., None] * v.repeat_interleave(group, dim=2).transpose(1, 2)[:, :, None]
    return terms.masked_fill(~allowed[:, None, ..., None], 0.0).sum(dim=3).transpose(1, 2)


# (tensor, position (batch, token, head of that tensor, channel), causal, hide the key)
NON_FINITE = {
    "q": ("q", (1, 11, 2, 3), False, False),
    "q-causal": ("q", (0, 2, 3, 0), True, False),
    "k-block": ("k", (0, 21, 1, 5), False, False),
    "k-causal": ("k", (0, 21, 1, 5), True, False),
    "k-hidden": ("k", (1, 4, 0, 5), True, True),
    "v-causal-tiles": ("v", (0, 21, 1, 5), True, False),
    "v-hidden": ("v", (1, 4, 0, 15), False, True),
}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("case", list(NON_FINITE))
def test_non_finite_inputs_marked_at_the_granularity_of_the_scales(case, value):
    """A non-finite input makes non-finite every output exact attention makes non-finite, and
    exactly those its scale's granularity (and the kernel's tiles, for V) reach; the rest equal
    the outputs with the value replaced by 0, bit for bit."""
    which, pos, causal, hidden = NON_FINITE[case]
    g = _gen(11)
    b, sq, sk, h, hk, d, kb, bm = 2, 19, 26, 4, 2, 16, 8, 8
    q, k, v = stress_qkv(b, sq, sk, h, hk, d, "gaussian", generator=g, dtype=F64)
    mask = torch.rand(b, sk, generator=g) < 0.8
    mask[pos[0], pos[1]] = not hidden
    inputs = {"q": q, "k": k, "v": v}
    kw = dict(causal=causal, key_padding_mask=mask, return_lse=True, k_block=kb, block_n=kb, block_m=bm,
              compute_dtype=F64)
    inputs[which][pos] = 0.0
    zero, zero_lse = attention_fp8_reference(*inputs.values(), **kw)
    inputs[which][pos] = value
    out, lse = attention_fp8_reference(*inputs.values(), **kw)

    allowed = _allowed(b, sq, sk, causal, mask)
    b0, t, head, c = pos
    want = torch.zeros(b, sq, h, d, dtype=torch.bool)
    heads = slice(head * (h // hk), (head + 1) * (h // hk))
    if which == "q":
        want[b0, t, head] = allowed[b0, t].any()
    elif not hidden and which == "k":   # every row attending a key of its block
        want[b0, :, heads] = allowed[b0, :, t // kb * kb:(t // kb + 1) * kb].any(-1)[:, None, None]
    elif not hidden:                    # channel c of the rows of each tile that loads its block
        last = ((torch.arange(sq) // bm + 1) * bm).clamp(max=sq) - 1
        hi = (last + sk - sq + 1).clamp(max=sk) if causal else torch.full((sq,), sk)
        want[b0, :, heads, c] = (t // kb * kb < hi)[:, None]
    assert hidden or want.any()
    exact = _exact_without_hidden_keys(*inputs.values(), d ** -0.5, allowed)
    bad = ~torch.isfinite(out)
    assert bad[~torch.isfinite(exact)].all()
    assert torch.equal(bad, want), f"{bad.sum().item()} non-finite, {want.sum().item()} expected"
    rows = want.any(-1).transpose(1, 2) if which != "v" else torch.zeros(b, h, sq, dtype=torch.bool)
    assert torch.equal(~torch.isfinite(lse) & ~torch.isneginf(zero_lse), rows)
    assert torch.equal(out[~bad], zero[~bad]) and torch.equal(lse[~rows], zero_lse[~rows])
    if which == "v" and causal:   # the tiles reach rows that cannot see the key: exact keeps them finite
        assert (bad & torch.isfinite(exact)).any()


def test_quantized_non_finite_values_and_marks():
    q, k, v = stress_qkv(1, 9, 12, 2, 1, 8, "offset", generator=_gen(12), dtype=F64)
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, 7] = False
    q[0, 3, 1, 2] = math.inf
    k[0, 1, 0, 0], k[0, 7, 0, 1] = math.nan, math.nan    # key 7 is hidden
    v[0, 5, 0, 4], v[0, 7, 0, 3] = -math.inf, math.nan
    clean = [t.nan_to_num(0.0, 0.0, 0.0) for t in (q, k, v)]
    kw = dict(k_block=4, compute_dtype=F64)
    quant = quantize_qkv_reference(q, k, v, key_padding_mask=mask, **kw)
    ref = quantize_qkv_reference(*clean, key_padding_mask=mask, **kw)
    # the statistics take the finite values only (a non-finite one as 0): the mean and every
    # scale are those of the inputs with 0 in its place, but for the marks
    assert torch.equal(quant.kmean, ref.kmean) and torch.equal(quant.sv, ref.sv)
    assert torch.isnan(quant.sq).nonzero().tolist() == [[0, 1, 3]]
    assert torch.isnan(quant.sk).nonzero().tolist() == [[0, 0, 0]]       # key 1's block, not key 7's
    assert torch.isnan(quant.v_q).nonzero().tolist() == [[0, 5, 0, 4]]   # not hidden key 7
    for got, want in ((quant.q_q, ref.q_q), (quant.k_q, ref.k_q), (quant.v_q, ref.v_q)):
        assert torch.equal(got.nan_to_num(0.0), want)
    fine = ~torch.isnan(quant.sq)
    assert torch.equal(quant.sq[fine], ref.sq[fine]) and torch.equal(quant.sk[:, :, 1:], ref.sk[:, :, 1:])


@pytest.mark.parametrize("kind", STRESS_KINDS)
def test_stress_qkv_kinds(kind):
    q, k, v = stress_qkv(2, 40, 50, 4, 2, 64, kind, generator=_gen(8))
    assert q.shape == (2, 40, 4, 64) and k.shape == v.shape == (2, 50, 2, 64)
    again = stress_qkv(2, 40, 50, 4, 2, 64, kind, generator=_gen(8))
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again))
    kmean = k.mean(dim=1, keepdim=True)
    common_share = (kmean.norm(dim=-1) / (k - kmean).norm(dim=-1).mean(dim=1, keepdim=True)).min()
    assert (common_share > 2.0) == ("offset" in kind)
    channel_amax = (k - kmean).abs().amax(dim=(0, 1))  # (kv_heads, d)
    assert (channel_amax.amax(-1) > 8 * channel_amax.median(-1).values).all() == ("outliers" in kind)
    probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) / 8, -1)
    assert (probs.amax(-1).mean() > 0.5) == (kind in ("peaked", "outliers", "outliers+offset"))


def test_float64_compute_keeps_float64_and_float32_casts_to_q_dtype():
    q, k, v = stress_qkv(1, 9, 11, 2, 1, 16, "gaussian", generator=_gen(9), dtype=torch.float16)
    out32, lse32 = attention_fp8_reference(q, k, v, return_lse=True)
    out64, lse64 = attention_fp8_reference(q, k, v, return_lse=True, compute_dtype=F64)
    assert out32.dtype == torch.float16 and lse32.dtype == torch.float32
    assert out64.dtype == lse64.dtype == F64
    torch.testing.assert_close(out32.double(), out64, rtol=0, atol=2e-3)


def _qkv():
    return stress_qkv(1, 5, 6, 2, 1, 8, "gaussian", generator=_gen(10))


@pytest.mark.parametrize("change,error,words", [
    (dict(qk_format="fp16"), ValueError, "qk_format"),
    (dict(q_block=0), ValueError, "q_block"),
    (dict(k_block=2.0), TypeError, "k_block"),
    (dict(block_n=-1), ValueError, "block_n"),
    (dict(block_m=0), ValueError, "block_m"),
    (dict(p_scale=500.0), ValueError, "p_scale"),
    (dict(p_scale=0.0), ValueError, "p_scale"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale"),
    (dict(causal=1), TypeError, "causal"),
    (dict(smooth_k=None), TypeError, "smooth_k"),
    (dict(quantize_pv="yes"), TypeError, "quantize_pv"),
    (dict(compute_dtype=torch.float16), TypeError, "compute_dtype"),
    (dict(key_padding_mask=torch.ones(1, 6)), TypeError, "key_padding_mask"),
    (dict(key_padding_mask=torch.ones(1, 5, dtype=torch.bool)), ValueError, "key_padding_mask"),
])
def test_bad_arguments_raise(change, error, words):
    q, k, v = _qkv()
    with pytest.raises(error, match=words):
        attention_fp8_reference(q, k, v, **change)


@pytest.mark.parametrize("q,k,v,error,words", [
    ("q", None, None, TypeError, "q must be a torch.Tensor"),
    (torch.zeros(1, 5, 3, 8), torch.zeros(1, 6, 2, 8), torch.zeros(1, 6, 2, 8), ValueError,
     "multiple of kv_heads"),
    (None, torch.zeros(1, 6, 1, 4), torch.zeros(1, 6, 1, 4), ValueError, "head_dim"),
    (None, None, torch.zeros(1, 7, 1, 8), ValueError, "same shape"),
    (torch.zeros(1, 5, 2, 8, dtype=torch.int32), None, None, TypeError, "float"),
    (torch.zeros(5, 2, 8), None, None, ValueError, "rank 4"),
    (None, torch.zeros(1, 0, 1, 8), torch.zeros(1, 0, 1, 8), ValueError, "empty"),
])
def test_bad_tensors_raise(q, k, v, error, words):
    q0, k0, v0 = _qkv()
    q, k, v = (q0 if q is None else q), (k0 if k is None else k), (v0 if v is None else v)
    with pytest.raises(error, match=words):
        attention_fp8_reference(q, k, v)
    with pytest.raises(error, match=words):
        quantize_qkv_reference(q, k, v)


@pytest.mark.parametrize("args,error,words", [
    ((1, 4, 4, 3, 2, 8, "gaussian"), ValueError, "multiple of kv_heads"),
    ((1, 4, 4, 2, 1, 8, "spiky"), ValueError, "kind"),
    ((1, 0, 4, 2, 1, 8, "gaussian"), ValueError, "seqlen_q"),
    ((1, 4, 4.0, 2, 1, 8, "gaussian"), TypeError, "seqlen_k"),
])
def test_stress_qkv_bad_arguments(args, error, words):
    with pytest.raises(error, match=words):
        stress_qkv(*args)
