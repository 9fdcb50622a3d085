"""8-bit quantization numerics, shared by every kernel that stores or multiplies 8-bit values.

Two formats:

* INT8, symmetric: ``x ≈ scale · q`` with ``q = round_half_even(x / scale)`` in [-127, 127] and
  ``scale = amax / 127``. Tensor cores multiply INT8 exactly (int32 accumulation).
* FP8 e4m3 (``torch.float8_e4m3fn``): ``x ≈ scale · q`` with ``q = e4m3(x / scale)``, rounded to
  nearest even onto the e4m3 grid and saturated at ±448, ``scale = amax / 448``. Three mantissa
  bits: a relative step of 1/16 at worst, whatever the magnitude above 2^-6.

The roundings are written out in fp32 arithmetic (:func:`round_half_even`, :func:`round_e4m3`)
instead of relying on the cast alone: the result is then exactly representable, so the cast that
follows is exact on every GPU and under Triton's interpreter (whose own fp32 → fp8 conversion
does not round to nearest), and the CPU tests check the numerics the GPU runs.

Attention (:func:`attention_kv_stats_kernel`, :func:`attention_quantize_kernel`) follows
SageAttention: K is smoothed by its mean over tokens (softmax is shift-invariant per row, so the
scores lose nothing; only the log-sum-exp needs ``q·k̄`` added back), Q gets one scale per token,
K one per block of keys, V one per channel, and V is stored transposed, ``(head_dim, keys)``,
the K-major operand Hopper's FP8 MMA takes for P·V.
"""
import triton
import triton.language as tl

INT8_MAX: tl.constexpr = tl.constexpr(127.0)
E4M3_MAX: tl.constexpr = tl.constexpr(448.0)
# 1.5 · 2^23: adding and subtracting it rounds an fp32 of magnitude < 2^22 to the nearest
# integer, ties to even (the FPU's own rounding of the sum).
_RNE_MAGIC: tl.constexpr = tl.constexpr(12582912.0)
# the floor of an amax, so that an all-zero row or block gets a finite scale (its values stay 0)
AMAX_FLOOR: tl.constexpr = tl.constexpr(1e-20)


@triton.jit
def round_half_even(x):
    """``x`` (fp32, |x| < 2^22) rounded to the nearest integer, ties to even, still fp32."""
    return (x + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def round_e4m3(x):
    """``x`` (fp32) rounded to nearest even onto the e4m3 grid, saturated at ±448, as fp32.

    The grid step is ``2^(e − 3)`` for a value of exponent ``e`` (three mantissa bits), and
    ``2^-9`` for every value below the smallest normal ``2^-6`` (the subnormals)."""
    x = tl.minimum(tl.maximum(x, -E4M3_MAX), E4M3_MAX)
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    step = ((exponent + (127 - 3)) << 23).to(tl.float32, bitcast=True)
    return round_half_even(x / step) * step


@triton.jit
def quantize(x, amax, FP8: tl.constexpr):
    """``(values, scale)``: ``x`` over ``scale = amax / qmax`` rounded to the format's grid
    (integers in [-127, 127], or e4m3 values), as fp32; ``amax`` broadcasts against ``x``."""
    amax = tl.maximum(amax, AMAX_FLOOR)
    if FP8:
        return round_e4m3(x * (E4M3_MAX / amax)), amax / E4M3_MAX
    else:
        return round_half_even(x * (INT8_MAX / amax)), amax / INT8_MAX


# --------------------------------------------------------------------------------------------
# attention: statistics of K and V, then Q, K and V quantized in one launch
# --------------------------------------------------------------------------------------------


@triton.jit
def attention_kv_stats_kernel(
    K, V, KSUM, VMAX,
    seqlen_k, kv_heads, chunk,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Per (batch, kv head) and chunk of ``chunk`` keys: the fp32 sum of K over the chunk's keys
    and the max of |V|, per channel. Grid (batch · kv_heads, chunks); partial results
    ``KSUM/VMAX[(b·kv_heads + h)·chunks + c, :]``, reduced by the quantize kernel (a fixed
    order: the same inputs give the same bits).

    Bytes: K and V read once (2·Sk·Hk·D elements), 2·chunks·Hk·D floats written."""
    bh = tl.program_id(0)
    c = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    offs_d = tl.arange(0, HEAD_DIM)
    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    ksum = tl.zeros([HEAD_DIM], dtype=tl.float32)
    vmax = tl.zeros([HEAD_DIM], dtype=tl.float32)
    start = c * chunk
    end = tl.minimum(start + chunk, seqlen_k)
    for s0 in range(start, end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        rows = (offs_s < end)[:, None]
        k = tl.load(k_base + offs_s[:, None].to(tl.int64) * stride_ks + offs_d[None, :], mask=rows, other=0.0)
        v = tl.load(v_base + offs_s[:, None].to(tl.int64) * stride_vs + offs_d[None, :], mask=rows, other=0.0)
        ksum += tl.sum(k.to(tl.float32), 0)
        vmax = tl.maximum(vmax, tl.max(tl.abs(v.to(tl.float32)), 0))
    n_chunks = tl.num_programs(1)
    tl.store(KSUM + (bh * n_chunks + c) * HEAD_DIM + offs_d, ksum)
    tl.store(VMAX + (bh * n_chunks + c) * HEAD_DIM + offs_d, vmax)


@triton.jit
def _kv_head_stats(KSUM, VMAX, bh, chunks, seqlen_k, offs_d, HEAD_DIM: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """(mean of K over the keys, max |V|) per channel of one (batch, kv head), from the partials:
    all chunks in one load (a loop over them would chain their latencies in every program)."""
    offs_c = tl.arange(0, CHUNKS_PAD)
    offs = (bh * chunks + offs_c)[:, None] * HEAD_DIM + offs_d[None, :]
    valid = (offs_c < chunks)[:, None]
    ksum = tl.sum(tl.load(KSUM + offs, mask=valid, other=0.0), 0)
    vmax = tl.max(tl.load(VMAX + offs, mask=valid, other=0.0), 0)
    return ksum / seqlen_k, vmax


@triton.jit
def attention_quantize_kernel(
    Q, K, V, Q8, QS, QC, K8, KS, VT8, VS, KSUM, VMAX,
    seqlen_q, seqlen_k, sq_pad, sk_pad, heads, kv_heads, chunks,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    qk_scale_log2, softmax_scale,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, QK_FP8: tl.constexpr, SMOOTH_K: tl.constexpr,
    LSE_CORRECTION: tl.constexpr, CHUNKS_PAD: tl.constexpr,
):
    """Q, K and V of an attention call to 8 bits, padded to whole blocks, in one launch.

    Grid (blocks of ``BLOCK_S`` tokens, heads + 2·kv_heads, batch): the second axis picks a Q
    head, a K head or a V head. Outputs (``pad`` rows are written as zeros):

    * ``Q8 (b, h, sq_pad, D)``: ``q · softmax_scale · log2 e`` per token over ``QS (b, h, sq_pad)``
      (INT8, or e4m3 with ``QK_FP8``); with ``LSE_CORRECTION`` also ``QC (b, h, sq_pad)`` =
      ``softmax_scale · q·k̄``, the shift smoothing takes out of each row's scores.
    * ``K8 (b, hk, sk_pad, D)``: ``k − k̄`` per block of ``BLOCK_S`` keys over ``KS (b, hk,
      sk_pad / BLOCK_S)`` (the attention kernel's key block, so its scale is one scalar a tile).
    * ``VT8 (b, hk, D, sk_pad)``: e4m3 ``v`` per channel over ``VS (b, hk, D)``, transposed.

    Bytes: Q, K, V read once and written once at one byte an element, plus the scales.
    """
    blk = tl.program_id(0)
    which = tl.program_id(1)
    b = tl.program_id(2)
    offs_s = blk * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    if which < heads:
        h = which
        if blk * BLOCK_S >= sq_pad:
            return
        rows = (offs_s < seqlen_q)[:, None]
        q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
                    + offs_s[:, None].to(tl.int64) * stride_qs + offs_d[None, :], mask=rows, other=0.0)
        q = q.to(tl.float32)
        qs = q * qk_scale_log2
        values, scale = quantize(qs, tl.max(tl.abs(qs), 1)[:, None], QK_FP8)
        row = (b * heads + h).to(tl.int64) * sq_pad + offs_s
        tl.store(Q8 + row[:, None] * HEAD_DIM + offs_d[None, :], values.to(Q8.dtype.element_ty))
        tl.store(QS + row, tl.reshape(scale, [BLOCK_S]))
        if LSE_CORRECTION:
            kv_head = h // (heads // kv_heads)
            kmean, _ = _kv_head_stats(KSUM, VMAX, b * kv_heads + kv_head, chunks, seqlen_k, offs_d, HEAD_DIM,
                                      CHUNKS_PAD)
            tl.store(QC + row, tl.sum(q * kmean[None, :], 1) * softmax_scale)
    else:
        h = (which - heads) % kv_heads
        is_k = which < heads + kv_heads
        if blk * BLOCK_S >= sk_pad:
            return
        rows = (offs_s < seqlen_k)[:, None]
        kmean, vmax = _kv_head_stats(KSUM, VMAX, b * kv_heads + h, chunks, seqlen_k, offs_d, HEAD_DIM, CHUNKS_PAD)
        bh = (b * kv_heads + h).to(tl.int64)
        if is_k:
            k = tl.load(K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
                        + offs_s[:, None].to(tl.int64) * stride_ks + offs_d[None, :], mask=rows, other=0.0)
            k = k.to(tl.float32)
            if SMOOTH_K:
                k = tl.where(rows, k - kmean[None, :], 0.0)
            k_values, k_scale = quantize(k, tl.max(tl.max(tl.abs(k), 1), 0), QK_FP8)
            tl.store(K8 + (bh * sk_pad + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                     k_values.to(K8.dtype.element_ty))
            tl.store(KS + bh * (sk_pad // BLOCK_S) + blk, k_scale)
        else:
            v = tl.load(V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
                        + offs_s[:, None].to(tl.int64) * stride_vs + offs_d[None, :], mask=rows, other=0.0)
            v_values, v_scale = quantize(v.to(tl.float32), vmax[None, :], True)
            tl.store(VT8 + (bh * HEAD_DIM + offs_d)[None, :] * sk_pad + offs_s[:, None],
                     v_values.to(VT8.dtype.element_ty))
            if blk == 0:
                tl.store(VS + bh * HEAD_DIM + offs_d, tl.reshape(v_scale, [HEAD_DIM]))
