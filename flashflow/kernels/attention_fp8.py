"""Flash attention forward over 8-bit Q, K and V (SageAttention-style numerics).

Inputs come from :func:`flashflow.kernels.quant.attention_quantize_kernel`: Q and K as INT8
(or e4m3 with ``QK_FP8``) with one scale per query token and one per key block of ``BLOCK_N``
keys (K smoothed by its mean), V as e4m3 stored transposed ``(head_dim, keys)`` with one scale
per channel, all padded with zeros to whole blocks. Q's scale carries ``softmax_scale · log2 e``.

Tiling is the bf16 kernel's (:mod:`flashflow.kernels.attention_fwd`): one program owns a
``BLOCK_M × head_dim`` query tile of one (batch, head), streams its KV head's keys in ``BLOCK_N``
blocks and keeps the online softmax in registers; masked key blocks (the causal diagonal, the
ragged end, a key-padding prefix) run a separate loop from the unmasked hot loop
(:func:`flashflow.kernels.mask.key_blocks`).

Per key block:

* ``S = (Q8 · K8ᵀ) · (q_scale · k_scale)``: an exact INT8 (or FP8) tensor-core product, one
  fp32 multiply a score; the row max is taken on the integer product (the row's scale is > 0);
* ``P = 2^(S − m) · 448`` in e4m3 (the factor 448 = e4m3's largest value puts P's range
  [0, 1] on the format's normals; folded into the exponent's shift, so it costs nothing);
* ``acc = acc · α + P8 · V8``: with ``PV_FP32_SUM`` the FP8 product goes into a fresh tile each
  block, added to the running accumulator in fp32 (Hopper's FP8 MMA keeps fewer accumulator bits
  than fp32, SageAttention2's two-level sum); without it the MMA accumulates into ``acc · α``.

The row sum ``l`` is of the fp32 probabilities. Output ``acc · v_scale / l``; the log-sum-exp
adds back the smoothing shift ``q·k̄`` that the quantize kernel stored per row.

Cost per (batch, head): FLOPs 4·Sq·Sk·d (halved causal) at the 8-bit tensor-core rate, twice the
bf16 one on Hopper; bytes (Sq + 2·Sk)·d at one byte an element plus the output.

``EMULATE_FP8`` (the launcher sets it under Triton's interpreter, whose FP8 ``tl.dot`` and fp32 →
fp8 conversion are wrong): P is rounded onto the e4m3 grid in fp32 and both FP8 products run in
fp32 on exactly the same values (e4m3's NaN included). On a GPU it is off and compiles to nothing.

Non-finite inputs need nothing here: the quantize pass carries them in what this loop already
multiplies (a NaN ``q_scale`` or ``k_scale``, e4m3 NaN in V; :mod:`flashflow.kernels.quant`), and
NaN survives every step that follows: the masked loop sets scores to -inf only where a key is not
allowed, ``p``, ``l`` and ``acc`` take NaN through the exponential, the sum and the MMA (0·NaN is
NaN), and :func:`~flashflow.kernels.softmax.normalize` divides by a NaN ``l``. The row maximum
may skip a NaN score (max ignores NaN on a GPU), which changes nothing: ``l`` is NaN already.
"""
import triton
import triton.language as tl

from flashflow.kernels.mask import key_allowed, key_blocks, split_range
from flashflow.kernels.quant import round_e4m3
from flashflow.kernels.softmax import log_sum_exp, normalize, shift_of
from flashflow.kernels.tile_order import attention_tile

LOG2_E4M3_MAX: tl.constexpr = tl.constexpr(8.807354922057604)   # log2(448)
# An int32 ``x`` with |x| < 2^22 plus the bits of 1.5 · 2^23 is the fp32 ``1.5 · 2^23 + x``
# exactly: the float of ``x`` for the price of an integer add. INT8 products over head_dim ≤ 256
# stay below 127² · 256 < 2^22.
INT_AS_FLOAT_OFFSET: tl.constexpr = tl.constexpr(12582912.0)
_INT_AS_FLOAT_BITS: tl.constexpr = tl.constexpr(0x4B400000)


@triton.jit
def int32_as_float(x):
    """``x + 1.5 · 2^23`` as fp32 (exact for |x| < 2^22): subtract :data:`INT_AS_FLOAT_OFFSET`
    (folded into a later FMA) for the float value of ``x``."""
    return (x + _INT_AS_FLOAT_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_kv_loop(acc, l_i, m_i, q, q_scale, lo, hi, KD, VD, KS, KEY_PADDING_MASK, k_row0, v_row0, offs_m,
                 seqlen_k, mask_keys, diag_offset,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, KEY_PADDING: tl.constexpr,
                 QK_FP8: tl.constexpr, EMULATE_FP8: tl.constexpr, PV_FP32_SUM: tl.constexpr,
                 WARP_SPECIALIZE: tl.constexpr):
    """Fold key blocks [lo, hi) into (acc, l, m); ``MASKED=False`` is the hot loop (no masks)."""
    offs_nb = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = KD.load([k_row0 + start_n, 0])
        vt = VD.load([v_row0, start_n])
        row_scale = q_scale * tl.load(KS + start_n // BLOCK_N)
        # raw scores ``qk`` with ``s = qk · row_scale − bias``: INT8 products come back as int32
        # and are made floats by the exponent trick (one integer add, no conversion unit),
        # the offset it leaves folded into the per-row bias.
        if QK_FP8:
            if EMULATE_FP8:
                qk = tl.dot(q.to(tl.float32), k.to(tl.float32).T, input_precision="ieee")
            else:
                qk = tl.dot(q, k.T)
            offset = tl.zeros_like(row_scale)
        else:
            qk = int32_as_float(tl.dot(q, k.T, out_dtype=tl.int32))
            offset = INT_AS_FLOAT_OFFSET * row_scale
        if MASKED:
            offs_n = start_n + offs_nb
            s = qk * row_scale[:, None] - offset[:, None]
            allowed = key_allowed(offs_n[None, :] < seqlen_k, offs_n[None, :], offs_m[:, None] + diag_offset, 0, 0,
                                  False, CAUSAL)
            if KEY_PADDING:
                keep = tl.load(KEY_PADDING_MASK + offs_n, mask=offs_n < mask_keys, other=1)
                allowed &= (keep != 0)[None, :]
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_shift = shift_of(m_new)
            p = tl.math.exp2(s - (m_shift - LOG2_E4M3_MAX)[:, None])
            alpha = tl.math.exp2(m_i - m_shift)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * row_scale - offset)
            p = tl.math.exp2(qk * row_scale[:, None] - (offset + m_new - LOG2_E4M3_MAX)[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if EMULATE_FP8:
            p8 = round_e4m3(p)
            # e4m3's NaN (a non-finite V value) as NaN: the interpreter's conversion makes it finite
            v8 = tl.where((vt.to(tl.int8, bitcast=True) & 0x7F) == 0x7F, float("nan"), vt.to(tl.float32)).T
            precision: tl.constexpr = "ieee"
        else:
            p8 = p.to(vt.dtype)
            v8 = vt.T
            precision: tl.constexpr = None
        if PV_FP32_SUM:
            acc = acc * alpha[:, None] + tl.dot(p8, v8, input_precision=precision)
        else:
            acc = tl.dot(p8, v8, acc * alpha[:, None], input_precision=precision)
    return acc, l_i, m_i


@triton.jit
def attention_fp8_fwd_kernel(
    QD, KD, VD, QS, KS, VS, QC, O, LSE, KEY_PADDING_MASK,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_key_padding_mask,
    seqlen_q, seqlen_k, sq_pad, sk_pad, heads, kv_heads, num_m_blocks, mask_keys,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, KEY_PADDING: tl.constexpr, RETURN_LSE: tl.constexpr, QK_FP8: tl.constexpr,
    EMULATE_FP8: tl.constexpr, PV_FP32_SUM: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """1-D grid over (m-block, head, batch) tiles, m-block fastest (tiles that run together
    share K/V in L2); causal tiles heaviest first. ``QD/KD/VD``: tensor descriptors over the
    2-D views ``(b·h·sq_pad, D)``, ``(b·hk·sk_pad, D)`` and ``(b·hk·D, sk_pad)``. With
    ``KEY_PADDING``, ``KEY_PADDING_MASK (b, ≥ mask_keys)`` holds a bool per key (False: hidden)
    over the first ``mask_keys`` keys, ``stride_key_padding_mask`` apart per batch."""
    tile = tl.program_id(0)
    pid_m, head, batch = attention_tile(tile, num_m_blocks, heads, CAUSAL)   # causal: heaviest first
    kv_head = head // (heads // kv_heads)
    m_start = pid_m * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)

    q_row = (batch * heads + head) * sq_pad
    q = QD.load([q_row + m_start, 0])
    q_scale = tl.load(QS + q_row + offs_m)
    bhk = batch * kv_heads + kv_head
    k_row0 = bhk * sk_pad
    v_row0 = bhk * HEAD_DIM
    ks = KS + bhk * (sk_pad // BLOCK_N)
    key_padding_mask = KEY_PADDING_MASK + batch.to(tl.int64) * stride_key_padding_mask

    diag_offset = seqlen_k - seqlen_q
    m_last = tl.minimum(m_start + BLOCK_M, seqlen_q) - 1
    lo, hi, full_lo, full_hi = key_blocks(m_start, m_last, diag_offset, seqlen_k, 0, 0, mask_keys, BLOCK_N,
                                          False, CAUSAL, KEY_PADDING)
    mid_lo, mid_hi = split_range(lo, hi, full_lo, full_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, l_i, m_i = _fp8_kv_loop(acc, l_i, m_i, q, q_scale, lo, mid_lo, KD, VD, ks, key_padding_mask, k_row0,
                                 v_row0, offs_m, seqlen_k, mask_keys, diag_offset, BLOCK_N, True, CAUSAL, KEY_PADDING,
                                 QK_FP8, EMULATE_FP8, PV_FP32_SUM, False)
    acc, l_i, m_i = _fp8_kv_loop(acc, l_i, m_i, q, q_scale, mid_lo, mid_hi, KD, VD, ks, key_padding_mask, k_row0,
                                 v_row0, offs_m, seqlen_k, mask_keys, diag_offset, BLOCK_N, False, CAUSAL, KEY_PADDING,
                                 QK_FP8, EMULATE_FP8, PV_FP32_SUM, WARP_SPECIALIZE)
    # past every key-padding block: no mask to load there
    acc, l_i, m_i = _fp8_kv_loop(acc, l_i, m_i, q, q_scale, mid_hi, hi, KD, VD, ks, key_padding_mask, k_row0,
                                 v_row0, offs_m, seqlen_k, mask_keys, diag_offset, BLOCK_N, True, CAUSAL, False,
                                 QK_FP8, EMULATE_FP8, PV_FP32_SUM, False)

    v_scale = tl.load(VS + bhk * HEAD_DIM + offs_d)
    out = normalize(acc, l_i) * v_scale[None, :]
    rows = offs_m < seqlen_q
    o_ptrs = (O + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
              + offs_m[:, None].to(tl.int64) * stride_os + offs_d[None, :])
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=rows[:, None])
    if RETURN_LSE:
        # l sums 448-scaled probabilities; -inf for a row with no key stays -inf
        lse = log_sum_exp(m_i - LOG2_E4M3_MAX, l_i) + tl.load(QC + q_row + offs_m)
        tl.store(LSE + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + offs_m, lse, mask=rows)
