"""FP8 attention on the GPU (Hopper and newer), bf16 and fp16 inputs: against float64 exact
attention at Qwen-Image's shape, a small odd GQA shape and causal 2k, for gaussian inputs and the
stress kinds that are hard on 8-bit products; against attention_fp8_reference (the same numerics);
the key-padding mask; the LSE; CUDA-graph capture and replay; torch.compile(fullgraph=True);
strided, transposed, expanded and packed q/k/v; NaN and inf inputs reaching exactly the outputs
docs/fp8.md ("Non-finite inputs") says, every one exact attention makes non-finite among them.

Every buffer the op allocates starts as NaN (torch.empty is wrapped during the call), so an output
element left unwritten shows as a non-finite value.
"""
from contextlib import contextmanager

import pytest
import torch

from flashflow.device import gpu_family
from flashflow.ops.attention_fp8 import (
    flash_attn_fp8_func,
    quantize_attention_inputs,
    scaled_dot_product_attention_fp8,
)
from flashflow.reference import attention_fp8_reference, attention_naive, full_key_padding_mask, stress_qkv
from flashflow.reference.attention_fp8 import LN2
from flashflow.reference.metrics import cosine, rel_l1, rel_l2
from flashflow.tuning.attention_fp8 import attention_fp8_config
from nonfinite_cases import exact_attention_over

pytestmark = pytest.mark.gpu
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
FORMATS = ["int8", "fp8"]
KINDS = ["gaussian", "offset", "peaked"]
REF_TOL = 1e-2   # ‖out − attention_fp8_reference‖ / ‖reference‖

# b, sq, sk, h, hk, d, causal
SHAPES = {
    "qwen-image": (1, 4352, 4352, 24, 24, 128, False),
    "odd-gqa-d64": (2, 333, 333, 8, 2, 64, False),
    "causal-2k": (1, 2048, 2048, 8, 2, 128, True),
    "causal-sq<sk-mqa-d64": (2, 333, 1000, 8, 1, 64, True),
}


@pytest.fixture(autouse=True)
def hopper():
    if gpu_family(torch.device("cuda")) != "sm90":
        pytest.skip("FP8 attention needs FP8 tensor cores (Hopper, sm90, or newer)")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def inputs(b, sq, sk, h, hk, d, dtype, kind="gaussian"):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))   # from the printed seed
    return stress_qkv(b, sq, sk, h, hk, d, kind, generator=g, dtype=dtype, device="cuda")


@contextmanager
def poisoned():
    """While active, every 16/32-bit float tensor torch.empty makes starts as NaN."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype in (torch.float16, torch.bfloat16, torch.float32) else t

    torch.empty = nan_empty
    try:
        yield
    finally:
        torch.empty = empty


def allowed_keys(b, sq, sk, causal, mask):
    """(batch, 1, seqlen_q, seqlen_k): which keys each query row may attend (bottom-right causal)."""
    rows = torch.arange(sq, device="cuda")[:, None]
    cols = torch.arange(sk, device="cuda")[None, :]
    allowed = (cols <= rows + sk - sq) if causal else torch.ones(sq, sk, dtype=torch.bool, device="cuda")
    allowed = allowed[None, None].expand(b, 1, sq, sk)
    return allowed & mask[:, None, None, :] if mask is not None else allowed


def exact_and_lse_bound(q, k, v, scale, causal, mask, qz, block_n):
    """Float64 exact attention (out, lse) and, per (batch, head, query), the largest error of the
    kernel's scores over the row's allowed keys: ``(q8·k8ᵀ)·q_scale·k_scale`` with the smoothing
    shift q·k̄·scale added back, against q·kᵀ·scale (natural-log units). An LSE is 1-Lipschitz in
    the max norm, so the kernel's LSE is within that of the exact one. One kv head at a time: the
    Qwen-Image shape's score matrices take 24·4352²·8 B = 3.6 GB each."""
    b, sq, heads, _ = q.shape
    sk, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    allowed = allowed_keys(b, sq, sk, causal, mask)
    outs, lses, bounds = [], [], []
    for j in range(kv_heads):
        hs = slice(j * group, (j + 1) * group)
        qh, kh, vh = q[:, :, hs].double(), k[:, :, j:j + 1].double(), v[:, :, j:j + 1].double()
        o, lse = attention_naive(qh, kh, vh, scale, causal=causal, key_padding_mask=mask, return_lse=True)
        s = torch.einsum("bqhd,bkd->bhqk", qh, kh[:, :, 0]) * scale
        k8 = qz["k8"][:, j, :sk].double()
        k_scale = qz["k_scale"][:, j].double().repeat_interleave(block_n, dim=1)[:, :sk]
        s_q = torch.einsum("bhqd,bkd->bhqk", qz["q8"][:, hs, :sq].double(), k8)
        s_q = s_q * qz["q_scale"][:, hs, :sq, None].double() * k_scale[:, None, None, :] * LN2
        s_q += (torch.einsum("bqhd,bd->bhq", qh, kh[:, :, 0].mean(dim=1)) * scale)[..., None]
        bounds.append((s_q - s).abs().masked_fill(~allowed, 0.0).amax(dim=-1))
        outs.append(o)
        lses.append(lse)
        del s, s_q
    return torch.cat(outs, dim=2), torch.cat(lses, dim=1), torch.cat(bounds, dim=1)


def lse_rounding(qz, q, k, fmt):
    """What the GPU's arithmetic may move the kernel's LSE by, per row. INT8 scores are
    ``(qk + 1.5·2^23)·r − 1.5·2^23·r`` (r = q_scale·k_scale), each product rounding at the scale
    of 1.5·2^23·r ≈ r unless fused: 4r. Hopper's FP8 MMA aligns each instruction's 32 products
    and its accumulator to the largest and keeps about 14 bits: at most 2^-13 of Σ|q8·k8| per
    instruction, head_dim/32 of them, Σ|q8·k8| bounded by |q8|·max|k8| (Cauchy-Schwarz). Plus
    the fp32 sum of up to seqlen_k probabilities and the approximate exp2/log2: 1e-4."""
    sq, heads, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    group = heads // kv_heads
    k_max = qz["k_scale"].amax(dim=-1).repeat_interleave(group, dim=1)
    r = qz["q_scale"][:, :, :sq].double() * k_max[..., None].double()
    tol = 4 * r * LN2 + 1e-4
    if fmt == "fp8":
        q_norm = qz["q8"][:, :, :sq].double().norm(dim=-1)
        k_norm = qz["k8"].double().norm(dim=-1).amax(dim=-1).repeat_interleave(group, dim=1)
        tol = tol + 2.0 ** -13 * (q.shape[-1] / 32) * q_norm * k_norm[..., None] * r * LN2
    return tol


def exact_bounds(fmt, kind):
    """(cosine ≥, rel L1 ≤) against exact attention: the error of the format's numerics, with a
    margin for the GPU's own rounding. attention_fp8_reference against float64 on these shapes
    (bf16): INT8 Q·K cosine 0.9991-0.9994, rel L1 0.035-0.040 (the error of e4m3 P·V; peaked
    scores are the low end); e4m3 Q·K adds a relative step of 1/16 on every product: cosine
    0.9983-0.9989 and rel L1 0.050-0.058, and peaked scores (std ~6) magnify it, cosine
    0.9935-0.9948 and rel L1 0.085-0.100."""
    if fmt == "int8":
        return (0.9985 if kind == "peaked" else 0.999), 0.05
    return (0.99, 0.13) if kind == "peaked" else (0.996, 0.08)


def check(q, k, v, fmt, causal, kind, key_padding_mask=None):
    b, sq, h, d = q.shape
    sk = k.shape[1]
    scale = d ** -0.5
    with poisoned():
        out, lse = flash_attn_fp8_func(q, k, v, causal=causal, return_lse=True, key_padding_mask=key_padding_mask,
                                       qk_format=fmt)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, h, sq)
    assert torch.isfinite(out).all(), "NaN/inf in out (an element left unwritten?)"

    mask = full_key_padding_mask(key_padding_mask, sk)
    cfg = attention_fp8_config(d, causal, gpu_family(q.device))
    qz = quantize_attention_inputs(q, k, v, scale, cfg.BLOCK_M, cfg.BLOCK_N, fmt, lse_correction=True)
    exact, exact_lse, bound = exact_and_lse_bound(q, k, v, scale, causal, mask, qz, cfg.BLOCK_N)
    empty = torch.isneginf(exact_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert torch.isfinite(lse[~empty]).all()
    assert (out.transpose(1, 2)[empty] == 0).all()

    min_cos, max_l1 = exact_bounds(fmt, kind)
    assert cosine(out, exact) >= min_cos, f"cosine {cosine(out, exact):.5f}"
    assert rel_l1(out, exact) <= max_l1, f"rel L1 {rel_l1(out, exact):.4f}"
    gap = (lse.double() - exact_lse).abs()
    # e4m3 Q·K on the H100: the FP8 MMA's own accumulation adds up to ~2e-4 here beyond the estimate
    slack = 1e-3 if fmt == "fp8" else 0.0
    ok = gap <= bound + lse_rounding(qz, q, k, fmt) + 1e-5 * exact_lse.abs() + slack
    assert ok[~empty].all(), f"LSE {(gap - bound)[~empty].max().item():.2e} beyond its row's score error"
    del exact, exact_lse, bound

    ref = attention_fp8_reference(q.float(), k.float(), v.float(), scale, causal=causal, key_padding_mask=mask,
                                  qk_format=fmt, q_block=1, k_block=cfg.BLOCK_N, block_n=cfg.BLOCK_N,
                                  p_scale=448.0)
    assert rel_l2(out, ref) < REF_TOL, f"rel L2 to attention_fp8_reference {rel_l2(out, ref):.2e}"
    return out, lse


# ---------------------------------------------------------------------------------------------
# accuracy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_against_float64_and_reference(gpu, dtype, shape, kind, fmt):
    b, sq, sk, h, hk, d, causal = SHAPES[shape]
    q, k, v = inputs(b, sq, sk, h, hk, d, dtype, kind)
    check(q, k, v, fmt, causal, kind)


def _text_mask(b, prefix, valid):
    """A text prefix mask ``(b, prefix)`` as Qwen-Image's joint [text, image] attention has it:
    the first ``valid[i]`` text tokens of batch row i attend, the padding after them does not."""
    return torch.arange(prefix, device="cuda")[None, :] < torch.tensor(valid, device="cuda")[:, None]


# b, sq, sk, h, hk, d, causal, prefix, valid text tokens per batch row (0: a row that keeps only
# the keys past the prefix; with causal its first queries see no key at all)
MASKED = {
    "qwen-image-text-prefix": (1, 4352, 4352, 24, 24, 128, False, 256, [77]),
    "odd-gqa-d64": (2, 333, 333, 8, 2, 64, False, 100, [37, 0]),
    "causal-mqa-empty-rows": (2, 333, 333, 8, 1, 128, True, 100, [100, 0]),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(MASKED))
@pytest.mark.parametrize("dtype", DTYPES)
def test_key_padding_mask(gpu, dtype, case, fmt):
    b, sq, sk, h, hk, d, causal, prefix, valid = MASKED[case]
    q, k, v = inputs(b, sq, sk, h, hk, d, dtype)
    key_padding_mask = _text_mask(b, prefix, valid)
    out, lse = check(q, k, v, fmt, causal, "gaussian", key_padding_mask)
    if causal and 0 in valid:   # the case does reach rows with no key: 0 out, -inf LSE
        assert torch.isneginf(lse).any()
    # the output without the LSE is the same up to the compiler's own rounding (a kernel compiled
    # without the LSE store may contract its multiplies and adds differently)
    again = flash_attn_fp8_func(q, k, v, causal=causal, key_padding_mask=key_padding_mask, qk_format=fmt)
    assert rel_l2(again, out) < 1e-3


# ---------------------------------------------------------------------------------------------
# CUDA graphs and torch.compile
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_graph_capture_and_replay(gpu, fmt):
    q, k, v = inputs(2, 333, 333, 8, 2, 128, torch.bfloat16)
    key_padding_mask = _text_mask(2, 100, [37, 100])

    def fn():
        return flash_attn_fp8_func(q, k, v, causal=True, return_lse=True, key_padding_mask=key_padding_mask,
                                   qk_format=fmt)

    want, want_lse = fn()
    graph, (out, lse) = gpu.capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    for t in (q, k, v):   # new values in the static inputs: the replay reads them
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    want2, want2_lse = fn()
    assert not torch.equal(want2, want)
    assert torch.equal(out, want2) and torch.equal(lse, want2_lse)


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_compile_fullgraph_equals_eager(gpu, fmt):
    q, k, v = inputs(2, 333, 333, 8, 2, 128, torch.bfloat16)
    key_padding_mask = _text_mask(2, 100, [37, 100])

    @torch.compile(fullgraph=True)
    def f(q, k, v, key_padding_mask):
        return flash_attn_fp8_func(q, k, v, causal=True, return_lse=True, key_padding_mask=key_padding_mask,
                                   qk_format=fmt)

    out, lse = f(q, k, v, key_padding_mask)
    want, want_lse = flash_attn_fp8_func(q, k, v, causal=True, return_lse=True, key_padding_mask=key_padding_mask,
                                         qk_format=fmt)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_torch_compile_sdpa_layout(gpu):
    # SDPA's usual storage, (batch, heads, seqlen, head_dim) contiguous
    q, k, v = (t.transpose(1, 2).contiguous() for t in inputs(2, 333, 333, 8, 2, 128, torch.bfloat16))

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        return scaled_dot_product_attention_fp8(q, k, v, enable_gqa=True) * 2

    assert torch.equal(f(q, k, v), scaled_dot_product_attention_fp8(q, k, v, enable_gqa=True) * 2)


# ---------------------------------------------------------------------------------------------
# layouts: strided, transposed, expanded and packed views
# ---------------------------------------------------------------------------------------------


def layout_views(layout, b, s, h, hk, d, dtype):
    """q, k, v ``(batch, seqlen, heads, head_dim)`` as views of another storage."""
    def draw(*shape):
        return torch.randn(*shape, device="cuda").to(dtype)

    if layout == "head_dim-stride-2":
        return tuple(draw(b, s, n, 2 * d)[..., ::2] for n in (h, hk, hk))
    if layout == "sdpa-storage":
        return tuple(draw(b, n, s, d).transpose(1, 2) for n in (h, hk, hk))
    if layout == "head_dim-major":
        return tuple(draw(b, n, d, s).permute(0, 3, 1, 2) for n in (h, hk, hk))
    if layout == "expanded-batch":
        return tuple(draw(1, s, n, d).expand(b, s, n, d) for n in (h, hk, hk))
    if layout == "expanded-heads":
        return tuple(draw(b, s, 1, d).expand(b, s, n, d) for n in (h, hk, hk))
    if layout == "packed-qkv":
        qkv = draw(b, s, h + 2 * hk, d)
        return qkv[:, :, :h], qkv[:, :, h:h + hk], qkv[:, :, h + hk:]
    raise AssertionError(layout)


@pytest.mark.parametrize("layout", ["head_dim-stride-2", "sdpa-storage", "head_dim-major", "expanded-batch",
                                    "expanded-heads", "packed-qkv"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_layouts(gpu, dtype, layout):
    b, s, h, hk, d = 2, 333, 8, 2, 128
    q, k, v = layout_views(layout, b, s, h, hk, d, dtype)
    key_padding_mask = _text_mask(b, 100, [37, 100])
    with poisoned():
        out, lse = flash_attn_fp8_func(q, k, v, causal=True, return_lse=True, key_padding_mask=key_padding_mask)
        sdpa = scaled_dot_product_attention_fp8(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                enable_gqa=True)
    torch.cuda.synchronize()
    want, want_lse = flash_attn_fp8_func(*(t.contiguous() for t in (q, k, v)), causal=True, return_lse=True,
                                         key_padding_mask=key_padding_mask)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    min_cos, max_l1 = exact_bounds("int8", "gaussian")
    exact = attention_naive(q.double(), k.double(), v.double(), d ** -0.5, causal=True,
                            key_padding_mask=full_key_padding_mask(key_padding_mask, s))
    assert cosine(out, exact) >= min_cos and rel_l1(out, exact) <= max_l1
    exact = attention_naive(q.double(), k.double(), v.double(), d ** -0.5)
    assert cosine(sdpa.transpose(1, 2), exact) >= min_cos and rel_l1(sdpa.transpose(1, 2), exact) <= max_l1


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
    non-finite, by the rule of docs/fp8.md ("Non-finite inputs")."""
    b, sq, sk, h, hk, d = shape
    b0, t, head, c = pos
    allowed = allowed_keys(b, sq, sk, causal, mask)[:, 0]
    out = torch.zeros(b, sq, h, d, dtype=torch.bool, device="cuda")
    if which == "q":
        out[b0, t, head] = allowed[b0, t].any()
        return out
    if mask is not None and not mask[b0, t]:
        return out
    heads = slice(head * (h // hk), (head + 1) * (h // hk))
    n0 = t // block_n * block_n
    if which == "k":
        out[b0, :, heads] = allowed[b0, :, n0:n0 + block_n].any(dim=-1)[:, None, None]
    else:
        rows = torch.arange(sq, device="cuda")
        last = ((rows // block_m + 1) * block_m).clamp(max=sq) - 1
        hi = (last + sk - sq + 1).clamp(max=sk) if causal else torch.full_like(rows, sk)
        out[b0, :, heads, c] = (n0 < hi)[:, None]
    return out


# (batch, token, head of its tensor, channel), in KV group 1 of 4; 333 queries, 400 keys: causal
# rows from 233 on attend key 300, rows from 189 on a key of its block of 128
BAD_AT = {"q": (0, 200, 5, 7), "k": (0, 300, 1, 7), "v": (0, 300, 1, 7)}
NON_FINITE = [(which, causal, mask) for which in "qkv" for causal in (False, True)
              for mask in ((None, "mask") if which == "q" else (None, "hides-it", "shows-it"))]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("which,causal,mask_kind", NON_FINITE,
                         ids=[f"{w}-{'causal' if c else 'full'}-{m}" for w, c, m in NON_FINITE])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_inputs(gpu, dtype, which, causal, mask_kind, fmt):
    shape = b, sq, sk, h, hk, d = 2, 333, 400, 8, 4, 128
    cfg = attention_fp8_config(d, causal, gpu_family(torch.device("cuda")))
    tensors = dict(zip("qkv", inputs(b, sq, sk, h, hk, d, dtype)))
    pos, key_padding_mask = BAD_AT[which], None
    if mask_kind is not None:
        key_padding_mask = _text_mask(b, 100, [80, 100])
        if which != "q":
            pos = (0, 50, 1, 7)
            key_padding_mask[0, 50] = mask_kind == "shows-it"
    mask = full_key_padding_mask(key_padding_mask, sk)
    want = reached(which, pos, shape, causal, mask, cfg.BLOCK_M, cfg.BLOCK_N)
    want_rows = want.any(dim=-1).transpose(1, 2) if which != "v" else torch.zeros_like(want[..., 0]).transpose(1, 2)
    empty = ~allowed_keys(b, sq, sk, causal, mask).any(dim=-1).expand(b, h, sq)
    assert mask_kind == "hides-it" or want.any()
    first = None
    for value in (float("nan"), float("inf")):
        tensors[which][pos] = value
        with poisoned():
            out, lse = flash_attn_fp8_func(*tensors.values(), causal=causal, return_lse=True,
                                           key_padding_mask=key_padding_mask, qk_format=fmt)
        torch.cuda.synchronize()
        exact, exact_lse = exact_attention(*tensors.values(), d ** -0.5, causal, mask)
        bad = ~torch.isfinite(out)
        assert bad[~torch.isfinite(exact)].all(), f"{value}: finite where exact attention is not"
        assert (~torch.isfinite(lse))[~torch.isfinite(exact_lse)].all()
        assert torch.isfinite(out[1]).all() and torch.isfinite(out[0, :, :h // hk]).all()
        assert torch.equal(bad, want), f"{value}: {bad.sum().item()} non-finite outputs, {want.sum().item()} expected"
        assert torch.equal(~torch.isfinite(lse), want_rows | empty)
        ref = attention_fp8_reference(*(t.float() for t in tensors.values()), d ** -0.5, causal=causal,
                                      key_padding_mask=mask, qk_format=fmt, q_block=1, k_block=cfg.BLOCK_N,
                                      block_n=cfg.BLOCK_N, block_m=cfg.BLOCK_M, p_scale=448.0)
        assert torch.equal(~torch.isfinite(ref), want)
        assert rel_l2(out[~bad], ref[~bad]) < REF_TOL
        if first is None:
            first = out, lse
        else:   # NaN and inf are both quantized as 0: what they do not reach has the same bits
            assert torch.equal(out[~bad], first[0][~bad]) and torch.equal(lse[~want_rows], first[1][~want_rows])
