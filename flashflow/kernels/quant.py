"""8-bit quantization numerics, shared by every kernel that stores or multiplies 8-bit values.

Two formats:

* INT8, symmetric: ``x ≈ scale · q`` with ``q = round_half_even(x / scale)`` in [-127, 127] and
  ``scale = amax / 127``. Tensor cores multiply INT8 exactly (int32 accumulation).
* FP8 e4m3 (``torch.float8_e4m3fn``): ``x ≈ scale · q`` with ``q = e4m3(x / scale)``, rounded to
  nearest even onto the e4m3 grid and saturated at ±448, ``scale = amax / 448``. Three mantissa
  bits: a relative step of 1/16 at worst, whatever the magnitude above 2^-6.

The roundings are defined in fp32 arithmetic (:func:`round_half_even`, :func:`round_e4m3`,
:func:`e4m3_grid`): under Triton's interpreter, whose own fp32 → fp8 conversion does not round to
nearest, the values are rounded onto the grid first and the cast that follows is exact, so the
CPU tests check the numerics the GPU runs. On a GPU an e4m3 value that is only stored is the
hardware's conversion itself (:func:`to_e4m3`: ``cvt.rn.satfinite``, nearest even and
saturating, the same values), one instruction per pair of values.

Rows (:func:`quantize_row_fp8`, :func:`quantize_rows_kernel`): the A operand of an FP8 GEMM
with row-wise scales (``torch._scaled_mm``), one e4m3 scale per row (token) of an activation,
``x ≈ scale[row] · q[row, :]``. A row holding a NaN or ±inf gets a NaN scale, so the GEMM's
output row is NaN rather than a finite number hiding it. The diffusion norms
(:mod:`flashflow.kernels.norm`) quantize their output rows with it in the pass that computes them.

Attention (:func:`attention_kv_stats_kernel`, :func:`attention_quantize_kernel`) follows
SageAttention: K is smoothed by its mean over tokens (softmax is shift-invariant per row, so the
scores lose nothing; only the log-sum-exp needs ``q·k̄`` added back), Q gets one scale per token,
K one per block of keys, V one per channel, and V is stored transposed, ``(head_dim, keys)``,
the K-major operand Hopper's FP8 MMA takes for P·V.

Non-finite inputs come out where exact attention puts them, at the granularity of the scales
and of the attention kernel's tiles (docs/fp8.md, "Non-finite inputs"); the work is all here,
none in the attention loop, and almost none per element (a program of this pass holds a
128 × head_dim fp32 tile: every value per element it keeps longer costs registers and time). The statistics (K's mean, V's channel
amax) take the finite values only, a non-finite one as 0 (Triton's max ignores NaN, an inf
would flatten the channel's scale). The non-finiteness is marked in what the attention kernel
already multiplies: a token of Q holding one gets a NaN scale (its amax, taken NaN-propagating,
is NaN or inf: every score of its row is NaN), a block of K holding one a NaN scale (the scores
of every row at an allowed key of the block are NaN), and the V value is stored as e4m3's NaN
(P·V multiplies it by every p of its key block, 0 included). A key the key-padding mask hides
from every row marks nothing: its non-finite values are taken as 0.
"""
import triton
import triton.language as tl

from flashflow.device import interpreting
from flashflow.kernels.activation import gelu_tanh_fast

INT8_MAX: tl.constexpr = tl.constexpr(127.0)
E4M3_MAX: tl.constexpr = tl.constexpr(448.0)
# 1.5 · 2^23: adding and subtracting it rounds an fp32 of magnitude < 2^22 to the nearest
# integer, ties to even (the FPU's own rounding of the sum).
_RNE_MAGIC: tl.constexpr = tl.constexpr(12582912.0)
# the floor of an amax, so that an all-zero row or block gets a finite scale (its values stay 0)
AMAX_FLOOR: tl.constexpr = tl.constexpr(1e-20)
# the GPU's own fp32 -> e4m3 conversion rounds to nearest even and saturates: round_e4m3 uses it
# wherever kernels are compiled (not under the interpreter, whose conversion truncates)
_HARDWARE_E4M3: tl.constexpr = tl.constexpr(not interpreting())
# e4m3 (float8_e4m3fn) NaN, S.1111.111: written as bits, since Triton's interpreter converts an
# fp32 NaN to a finite e4m3 value (a GPU's conversion keeps it)
E4M3_NAN_BITS: tl.constexpr = tl.constexpr(0x7F)


@triton.jit
def round_half_even(x):
    """``x`` (fp32, |x| < 2^22) rounded to the nearest integer, ties to even, still fp32."""
    return (x + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def round_e4m3(x):
    """``x`` (fp32) rounded to nearest even onto the e4m3 grid, saturated at ±448, as fp32.

    The grid step is ``2^(e − 3)`` for a value of exponent ``e`` (three mantissa bits), and
    ``2^-9`` for every value below the smallest normal ``2^-6`` (the subnormals). On a GPU this
    is the hardware's conversion (``cvt.rn.satfinite`` to e4m3 and back: one instruction per
    pair of values); under Triton's interpreter, whose conversion does not round to nearest,
    :func:`e4m3_grid` computes the same values in fp32 arithmetic."""
    x = tl.minimum(tl.maximum(x, -E4M3_MAX), E4M3_MAX)
    if _HARDWARE_E4M3:
        return x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
    else:
        return e4m3_grid(x)


@triton.jit
def to_e4m3(x):
    """``x`` (fp32) rounded to nearest even onto the e4m3 grid and saturated at ±448 (NaN stays
    NaN), for a value that is only stored into an e4m3 tensor: on a GPU the e4m3 value itself
    (``cvt.rn.satfinite``, one instruction per pair of values, no clamp: the conversion
    saturates); under the interpreter :func:`round_e4m3`'s fp32 value on the grid, which the
    store then converts exactly. Where the rounded value is computed with, use
    :func:`round_e4m3`."""
    if _HARDWARE_E4M3:
        return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        return round_e4m3(x)


@triton.jit
def e4m3_grid(x):
    """:func:`round_e4m3` without the saturation, for ``|x| <= 448`` (up to one rounding: 448
    plus a few ulp still rounds to 448); NaN stays NaN."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    step = ((exponent + (127 - 3)) << 23).to(tl.float32, bitcast=True)
    # times the step's reciprocal, a power of two too: exact, as the division was, and cheaper
    inverse = ((127 + 3 - exponent) << 23).to(tl.float32, bitcast=True)
    return round_half_even(x * inverse) * step


@triton.jit
def is_finite(x):
    """True where ``x`` is neither NaN nor ±inf: one compare (NaN fails every compare)."""
    return tl.abs(x) < float("inf")


@triton.jit
def _maximum_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def amax_keep_nan(x, axis):
    """``max |x|`` along ``axis``, NaN where ``x`` holds a NaN (``tl.max`` skips NaN): as cheap
    as ``tl.max``, one NaN-propagating max a step."""
    return tl.reduce(tl.abs(x), axis, _maximum_keep_nan)


@triton.jit
def mark_non_finite(scale, amax):
    """``scale``, or NaN where ``amax`` is not finite (``amax − amax`` is NaN for NaN and ±inf,
    +0 otherwise): the mark of a token or block holding a non-finite value."""
    return scale + (amax - amax)


@triton.jit
def quantize(x, amax, FP8: tl.constexpr):
    """``(values, scale)``: ``x`` over ``scale = amax / qmax`` rounded to the format's grid
    (integers in [-127, 127] as fp32, or e4m3 values as :func:`to_e4m3` gives them: only to be
    stored); ``amax`` broadcasts against ``x``."""
    amax = tl.maximum(amax, AMAX_FLOOR)
    if FP8:
        return to_e4m3(x * (E4M3_MAX / amax)), amax / E4M3_MAX
    else:
        return round_half_even(x * (INT8_MAX / amax)), amax / INT8_MAX


@triton.jit
def quantize_row_fp8(x):
    """``(values, scale)`` of one fp32 row ``x`` (1-D; masked lanes must hold 0) with one e4m3
    scale: ``scale = max|x| / 448`` (``AMAX_FLOOR / 448`` for an all-zero row) and ``values =
    to_e4m3(x · (448 / max|x|))``, to be stored; ``scale`` is NaN where the row holds a NaN or
    ±inf (its values are then unspecified)."""
    amax = amax_keep_nan(x, 0)
    values, scale = quantize(x, amax, True)
    return values, mark_non_finite(scale, amax)


# --------------------------------------------------------------------------------------------
# rows: the A operand of a row-scaled FP8 GEMM
# --------------------------------------------------------------------------------------------


@triton.jit
def quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr,
    L, K,
    stride_xb, stride_xl,
    GELU: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Rows of ``x`` (B·L rows of K, row (b, l) at ``b·stride_xb + l·stride_xl``, unit stride
    along K) to e4m3 with one float32 scale each (:func:`quantize_row_fp8`): ``q (B·L, K)``
    contiguous, ``s (B·L,)``. With ``GELU``, the row is first taken through GELU's tanh form in
    fp32 (:func:`flashflow.kernels.activation.gelu_tanh_fast`), never rounded to x's dtype.

    One program per row, the row held in registers (``BLOCK_K`` = next power of two of K): its
    amax is one reduction. Bytes: x read once, K bytes and one float written per row.
    FLOPs: about 4 per element (about 12 with ``GELU``).
    """
    row = tl.program_id(0).to(tl.int64)
    b = row // L
    l = row % L
    k = tl.arange(0, BLOCK_K)
    mask = k < K
    x = tl.load(x_ptr + b * stride_xb + l * stride_xl + k, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        x = gelu_tanh_fast(x)
    values, scale = quantize_row_fp8(x)
    tl.store(q_ptr + row * K + k, values.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


# --------------------------------------------------------------------------------------------
# attention: statistics of K and V (partials, then one process reduces them once), then Q, K and V
# quantized in one launch
# --------------------------------------------------------------------------------------------


@triton.jit
def in_rank(ptr, PEER_BYTES, g, WORLD: tl.constexpr):
    """``ptr`` (an address in this rank's buffers) moved to the same place in the buffers kept for
    rank ``g``: ``PEER_BYTES[g]`` is their address minus this rank's, in bytes, a multiple of 16.
    One rank (``WORLD`` 1): ``ptr`` itself, nothing read."""
    if WORLD == 1:
        return ptr
    else:
        # a multiple of 16 bytes (the caller's rule): the stores keep their full width
        delta = tl.multiple_of(tl.load(PEER_BYTES + g), 16)
        return ptr + delta // (ptr.dtype.element_ty.primitive_bitwidth // 8)


@triton.jit
def attention_kv_stats_kernel(
    K, V, KSUM, VMAX, PEER_BYTES,
    seqlen_k, kv_heads, chunk, slots, slot0,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, WORLD: tl.constexpr,
):
    """Per (batch, kv head) and chunk of ``chunk`` keys: the fp32 sum of K over the chunk's keys
    and the max of |V|, per channel, a non-finite value counted as 0 (the quantize kernel marks
    it; the finite rest keeps its mean and scale). Grid (batch · kv_heads, chunks); partial results
    ``KSUM/VMAX[(b·kv_heads + h)·slots + slot0 + c, :]``, reduced by the quantize kernel (a fixed
    order: the same inputs give the same bits). One process: ``slots`` = chunks, ``slot0`` = 0.

    Sequence-parallel (each rank holding ``seqlen_k`` keys of the sequence, ``WORLD`` > 1): rank
    ``r``'s chunks take slots ``[slot0, slot0 + chunks)`` of ``slots`` and are written into every
    rank's buffer (:func:`in_rank`, ``PEER_BYTES``); once all have landed, every rank reduces all
    of them in the same order. One process: ``PEER_BYTES`` is not read.

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
        k = k.to(tl.float32)
        v = tl.abs(v.to(tl.float32))
        ksum += tl.sum(tl.where(is_finite(k), k, 0.0), 0)
        vmax = tl.maximum(vmax, tl.max(tl.where(v < float("inf"), v, 0.0), 0))
    at = (bh.to(tl.int64) * slots + slot0 + c) * HEAD_DIM + offs_d
    for g in tl.static_range(WORLD):
        tl.store(in_rank(KSUM, PEER_BYTES, g, WORLD) + at, ksum)
        tl.store(in_rank(VMAX, PEER_BYTES, g, WORLD) + at, vmax)


@triton.jit
def attention_kv_stats_total_kernel(KSUM, VMAX, KSUM1, VMAX1, chunks, HEAD_DIM: tl.constexpr,
                                    CHUNKS_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """One process: the partials of :func:`attention_kv_stats_kernel` of one (batch, kv head)
    and ``BLOCK_D`` channels (grid ``(batch · kv_heads, HEAD_DIM / BLOCK_D)``), ``chunks`` of
    them, reduced once into ``KSUM1/VMAX1[bh, :]`` in one load and a fixed order, so that the
    quantize kernel's many K and V programs each read one row of statistics (``chunks`` = 1
    there) instead of every partial. Bytes: the partials once, 2·D floats a head written."""
    bh = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ksum, vmax = _partials_total(KSUM, VMAX, bh, chunks, offs_d, HEAD_DIM, CHUNKS_PAD)
    tl.store(KSUM1 + bh * HEAD_DIM + offs_d, ksum)
    tl.store(VMAX1 + bh * HEAD_DIM + offs_d, vmax)


@triton.jit
def attention_k_edge_stats_kernel(
    K, KEY_PADDING_MASK, EDGE_MAX, EDGE_MIN, PEER_BYTES,
    row_lo, seqlen_local, kv_heads, bh_count, rank, mask_keys,
    stride_kb, stride_ks, stride_kh, stride_key_padding_mask,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, KEY_PADDING: tl.constexpr, WORLD: tl.constexpr,
):
    """Sequence-parallel K statistics of the two key blocks at the ends of this rank's slice
    (global keys ``[row_lo, row_lo + seqlen_local)``): block ``row_lo // BLOCK_S`` (end 0) and block
    ``(row_lo + seqlen_local − 1) // BLOCK_S`` (end 1), which may hold keys of other ranks too.
    Per (batch, kv head) and end, the per-channel max and min of the rank's keys in the block (a
    key the key-padding mask hides: its non-finite values as 0; a NaN kept), written at ``[rank,
    end, b·kv_heads + h]`` of ``EDGE_MAX``/``EDGE_MIN`` ``(world, 2, batch·kv_heads, D)`` in
    every rank's buffer (``WORLD`` of them, :func:`in_rank`). The quantize kernel merges the parts of a shared block into the scale one
    process would give it: ``max|k − k̄|`` over the block is ``max(max k − k̄, k̄ − min k)`` per
    channel, exactly (fp32 subtraction is monotonic). Grid (batch · kv_heads, 2)."""
    bh = tl.program_id(0)
    end = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    blk = (row_lo + end * (seqlen_local - 1)) // BLOCK_S
    offs_s = blk * BLOCK_S + tl.arange(0, BLOCK_S) - row_lo   # the block's rows, local indices
    rows = (offs_s >= 0) & (offs_s < seqlen_local)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
                + offs_s[:, None].to(tl.int64) * stride_ks + offs_d[None, :], mask=rows[:, None], other=0.0)
    k = k.to(tl.float32)
    if KEY_PADDING:
        k = _hidden_as_zero(k, KEY_PADDING_MASK + b.to(tl.int64) * stride_key_padding_mask,
                            tl.where(rows, offs_s, mask_keys), mask_keys)
    kmax = tl.reduce(tl.where(rows[:, None], k, float("-inf")), 0, _maximum_keep_nan)
    kmin = -tl.reduce(tl.where(rows[:, None], -k, float("-inf")), 0, _maximum_keep_nan)
    at = ((rank * 2 + end) * bh_count + bh).to(tl.int64) * HEAD_DIM + offs_d
    for g in tl.static_range(WORLD):
        tl.store(in_rank(EDGE_MAX, PEER_BYTES, g, WORLD) + at, kmax)
        tl.store(in_rank(EDGE_MIN, PEER_BYTES, g, WORLD) + at, kmin)


@triton.jit
def _partials_total(KSUM, VMAX, bh, chunks, offs_d, HEAD_DIM: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """(sum of K, max |V|) over the ``chunks`` partials of one (batch, kv head) at channels
    ``offs_d``: all chunks in one load (a loop over them would chain their latencies), summed in
    a fixed order."""
    offs_c = tl.arange(0, CHUNKS_PAD)
    offs = (bh * chunks + offs_c)[:, None] * HEAD_DIM + offs_d[None, :]
    valid = (offs_c < chunks)[:, None]
    return (tl.sum(tl.load(KSUM + offs, mask=valid, other=0.0), 0),
            tl.max(tl.load(VMAX + offs, mask=valid, other=0.0), 0))


@triton.jit
def _kv_head_stats(KSUM, VMAX, bh, chunks, seqlen_k, offs_d, HEAD_DIM: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """(mean of K over the keys, max |V|) per channel of one (batch, kv head), from the partials
    (one process: ``chunks`` = 1, the totals of :func:`attention_kv_stats_total_kernel`)."""
    ksum, vmax = _partials_total(KSUM, VMAX, bh, chunks, offs_d, HEAD_DIM, CHUNKS_PAD)
    return ksum / seqlen_k, vmax


@triton.jit
def _hidden_as_zero(x, KEY_PADDING_MASK, offs_s, mask_keys):
    """``x`` ``(keys, D)`` with its non-finite values at keys the key-padding mask hides (False
    in ``KEY_PADDING_MASK[:mask_keys]``) taken as 0: such a key reaches no output, and must not
    mark one."""
    keep = tl.load(KEY_PADDING_MASK + offs_s, mask=offs_s < mask_keys, other=1) != 0
    return tl.where(keep[:, None] | is_finite(x), x, 0.0)


@triton.jit
def _minimum_keep_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _shared_block_amax(EDGE_MAX, EDGE_MIN, blk, kmean, bh, bh_count, seqlen_local, offs_d,
                       HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, WORLD: tl.constexpr):
    """``max |k − k̄|`` over key block ``blk`` from the parts every rank holding some of its keys
    wrote (:func:`attention_k_edge_stats_kernel`; rank ``r`` holds keys ``[r·seqlen_local,
    (r+1)·seqlen_local)``), merged in rank order: the same bits on every rank, NaN if a part
    holds one."""
    hi = tl.full([HEAD_DIM], float("-inf"), tl.float32)
    lo = tl.full([HEAD_DIM], float("inf"), tl.float32)
    for r in tl.static_range(WORLD):
        for end in tl.static_range(2):
            if (r * seqlen_local + end * (seqlen_local - 1)) // BLOCK_S == blk:
                at = ((r * 2 + end) * bh_count + bh).to(tl.int64) * HEAD_DIM + offs_d
                hi = _maximum_keep_nan(hi, tl.load(EDGE_MAX + at))
                lo = _minimum_keep_nan(lo, tl.load(EDGE_MIN + at))
    return tl.reduce(_maximum_keep_nan(hi - kmean, kmean - lo), 0, _maximum_keep_nan)


@triton.jit
def _store_own(ptr, values, own, whole, WORLD: tl.constexpr):
    """Store the tile's rows this rank owns (``own``, broadcasting against ``values``); a tile
    that is ``whole``ly this rank's (always, for one process) without a mask: full-width stores."""
    if WORLD == 1:
        tl.store(ptr, values)
    elif whole:
        tl.store(ptr, values)
    else:
        tl.store(ptr, values, mask=own)


@triton.jit
def attention_quantize_kernel(
    Q, K, V, Q8, QS, QC, K8, KS, VT8, VS, KSUM, VMAX, KEY_PADDING_MASK, EDGE_MAX, EDGE_MIN, PEER_BYTES,
    seqlen_q, seqlen_k, sq_pad, sk_pad, heads, kv_heads, chunks, mask_keys,
    row_lo, row_hi, heads_out, kv_heads_out, dest0,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_key_padding_mask, qk_scale_log2, softmax_scale,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, QK_FP8: tl.constexpr, SMOOTH_K: tl.constexpr,
    LSE_CORRECTION: tl.constexpr, CHUNKS_PAD: tl.constexpr, KEY_PADDING: tl.constexpr,
    EMULATE_FP8: tl.constexpr, WORLD: tl.constexpr,
):
    """Q, K and V of an attention call to 8 bits, padded to whole blocks, in one launch.

    Grid (blocks of ``BLOCK_S`` tokens, heads + 2·kv_heads, batch): the second axis picks a Q
    head, a K head or a V head (sequence-parallel: of destination ranks from ``dest0`` on, any
    number of whole ranks). Outputs (``pad`` rows are written as zeros):

    * ``Q8 (b, h, sq_pad, D)``: ``q · softmax_scale · log2 e`` per token over ``QS (b, h, sq_pad)``
      (INT8, or e4m3 with ``QK_FP8``); with ``LSE_CORRECTION`` also ``QC (b, h, sq_pad)`` =
      ``softmax_scale · q·k̄``, the shift smoothing takes out of each row's scores.
    * ``K8 (b, hk, sk_pad, D)``: ``k − k̄`` per block of ``BLOCK_S`` keys over ``KS (b, hk,
      sk_pad / BLOCK_S)`` (the attention kernel's key block, so its scale is one scalar a tile).
    * ``VT8 (b, hk, D, sk_pad)``: e4m3 ``v`` per channel over ``VS (b, hk, D)``, transposed,
      written as its bits (an int8 view of the e4m3 tensor).

    Non-finite values (module docstring): ``QS`` of a token holding one and ``KS`` of a block
    holding one are NaN (the 8-bit values of such a token or block are unspecified), ``VT8``
    holds e4m3's NaN in its place. ``KEY_PADDING_MASK (b, ≥ mask_keys)`` with ``KEY_PADDING``:
    the key-padding mask over the first ``mask_keys`` keys; a non-finite K or V value at a key it
    hides is taken as 0. ``EMULATE_FP8``: under Triton's interpreter (its fp32 → e4m3 conversion loses NaN).

    Sequence-parallel (Ulysses, ``WORLD`` > 1): this rank holds tokens ``[row_lo, row_hi)`` of
    the sequence (q and k alike, all heads) and writes them into the buffers kept for the rank
    that attends each head (head ``h`` for rank ``h // heads_out`` as its head ``h % heads_out``,
    through :func:`in_rank`), at their rows of buffers whose shapes are the attention's on the
    whole sequence (``heads_out`` / ``kv_heads_out`` heads). Program 0 of axis 0 is block
    ``row_lo // BLOCK_S``; the last rank also writes the padding. ``KSUM``/``VMAX`` hold every
    rank's partial statistics (``chunks`` slots a head), so K's mean and V's scale are the whole
    sequence's; a key block shared with another rank gets its scale from ``EDGE_MAX``/``EDGE_MIN``
    (:func:`_shared_block_amax`), the value one process would give it. One process: ``row_lo`` 0,
    ``row_hi`` ≥ both lengths, ``heads_out``/``kv_heads_out`` the heads.

    Bytes: Q, K, V read once and written once at one byte an element, plus the scales.
    """
    blk = tl.program_id(0) + row_lo // BLOCK_S
    # axis 1: the heads of destination ranks dest0, dest0 + 1, ...: each heads_out Q heads, then
    # kv_heads_out K heads, then as many V heads (one process: every head, dest0 0). Several ranks:
    # the destinations interleaved (head j of each in turn), so the programs storing into other
    # GPUs' memory run among those storing into this one's
    if WORLD == 1:
        dest = dest0
        which = tl.program_id(1)
    else:
        count = tl.num_programs(1) // (heads_out + 2 * kv_heads_out)
        dest = dest0 + tl.program_id(1) % count
        which = tl.program_id(1) // count
    b = tl.program_id(2)
    offs_s = blk * BLOCK_S + tl.arange(0, BLOCK_S)   # rows of the whole sequence
    local = offs_s - row_lo                            # rows of this rank's tensors
    offs_d = tl.arange(0, HEAD_DIM)
    if which < heads_out:
        h = dest * heads_out + which
        write_hi = tl.where(row_hi >= seqlen_q, sq_pad, row_hi)
        if blk * BLOCK_S >= write_hi:
            return
        rows = ((offs_s >= row_lo) & (offs_s < tl.minimum(row_hi, seqlen_q)))[:, None]
        own = (offs_s >= row_lo) & (offs_s < write_hi)
        whole = (blk * BLOCK_S >= row_lo) & (blk * BLOCK_S + BLOCK_S <= write_hi)
        q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
                    + local[:, None].to(tl.int64) * stride_qs + offs_d[None, :], mask=rows, other=0.0)
        q = q.to(tl.float32)
        qs = q * qk_scale_log2
        # a token holding a non-finite value: its amax is NaN or inf, its scale NaN (its 8-bit
        # values are then of no use to anyone); nothing more per element
        amax = amax_keep_nan(qs, 1)[:, None]
        values, scale = quantize(qs, amax, QK_FP8)
        scale = mark_non_finite(scale, amax)
        row = (b * heads_out + h % heads_out).to(tl.int64) * sq_pad + offs_s
        g = h // heads_out
        _store_own(in_rank(Q8, PEER_BYTES, g, WORLD) + row[:, None] * HEAD_DIM + offs_d[None, :],
                   values.to(Q8.dtype.element_ty), own[:, None], whole, WORLD)
        _store_own(in_rank(QS, PEER_BYTES, g, WORLD) + row, tl.reshape(scale, [BLOCK_S]), own, whole, WORLD)
        if LSE_CORRECTION:
            kv_head = h // (heads // kv_heads)
            kmean, _ = _kv_head_stats(KSUM, VMAX, b * kv_heads + kv_head, chunks, seqlen_k, offs_d, HEAD_DIM,
                                      CHUNKS_PAD)
            _store_own(in_rank(QC, PEER_BYTES, g, WORLD) + row, tl.sum(q * kmean[None, :], 1) * softmax_scale,
                       own, whole, WORLD)
    else:
        h = dest * kv_heads_out + (which - heads_out) % kv_heads_out
        is_k = which < heads_out + kv_heads_out
        write_hi = tl.where(row_hi >= seqlen_k, sk_pad, row_hi)
        if blk * BLOCK_S >= write_hi:
            return
        valid = (offs_s >= row_lo) & (offs_s < tl.minimum(row_hi, seqlen_k))
        rows = valid[:, None]
        # where the key-padding mask is read: the rows of this rank's tensors, none elsewhere
        mask_rows = tl.where(valid, local, mask_keys)
        kmean, vmax = _kv_head_stats(KSUM, VMAX, b * kv_heads + h, chunks, seqlen_k, offs_d, HEAD_DIM, CHUNKS_PAD)
        bh = (b * kv_heads_out + h % kv_heads_out).to(tl.int64)
        g = h // kv_heads_out
        own = (offs_s >= row_lo) & (offs_s < write_hi)
        whole = (blk * BLOCK_S >= row_lo) & (blk * BLOCK_S + BLOCK_S <= write_hi)
        key_padding_mask = KEY_PADDING_MASK + b.to(tl.int64) * stride_key_padding_mask
        # the blocks of the key-padding mask's prefix: past it, no key is hidden, no work
        hides = blk * BLOCK_S < row_lo + mask_keys
        if is_k:
            k = tl.load(K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
                        + local[:, None].to(tl.int64) * stride_ks + offs_d[None, :], mask=rows, other=0.0)
            k = k.to(tl.float32)
            if KEY_PADDING:
                if hides:
                    k = _hidden_as_zero(k, key_padding_mask, mask_rows, mask_keys)
            if SMOOTH_K:
                k = tl.where(rows, k - kmean[None, :], 0.0)
            # a block holding a non-finite value: a NaN or inf amax, a NaN scale
            k_amax = amax_keep_nan(amax_keep_nan(k, 1), 0)
            if WORLD > 1:
                if (blk * BLOCK_S < row_lo) | (tl.minimum(blk * BLOCK_S + BLOCK_S, seqlen_k) > row_hi):
                    # a block shared with another rank: the scale of all its keys
                    shift = kmean
                    if not SMOOTH_K:
                        shift = tl.zeros_like(kmean)
                    k_amax = _shared_block_amax(EDGE_MAX, EDGE_MIN, blk, shift,
                                                b * kv_heads + h, tl.num_programs(2) * kv_heads, row_hi - row_lo,
                                                offs_d, HEAD_DIM, BLOCK_S, WORLD)
            k_values, k_scale = quantize(k, k_amax, QK_FP8)
            k_scale = mark_non_finite(k_scale, k_amax)
            _store_own(in_rank(K8, PEER_BYTES, g, WORLD) + (bh * sk_pad + offs_s)[:, None] * HEAD_DIM
                       + offs_d[None, :], k_values.to(K8.dtype.element_ty), own[:, None], whole, WORLD)
            tl.store(in_rank(KS, PEER_BYTES, g, WORLD) + bh * (sk_pad // BLOCK_S) + blk, k_scale)
        else:
            v = tl.load(V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
                        + local[:, None].to(tl.int64) * stride_vs + offs_d[None, :], mask=rows, other=0.0)
            v = v.to(tl.float32)
            if KEY_PADDING:
                if hides:
                    v = _hidden_as_zero(v, key_padding_mask, mask_rows, mask_keys)
            # a non-finite value becomes NaN (inf too) and stays NaN on the grid: e4m3's NaN. Its
            # select takes the place of the saturation: |v| <= amax, the channel's finite max
            v = tl.where(is_finite(v), v, float("nan"))
            v_amax = tl.maximum(vmax, AMAX_FLOOR)[None, :]
            v_scale = v_amax / E4M3_MAX
            if EMULATE_FP8:
                # the interpreter's fp32 → e4m3 conversion neither rounds to nearest nor keeps
                # NaN: the value on the grid in fp32 first, NaN written as its bits
                v_values = e4m3_grid(v * (E4M3_MAX / v_amax))
                bits = v_values.to(tl.float8e4nv).to(tl.int8, bitcast=True)
                bits = tl.where(v_values == v_values, bits, E4M3_NAN_BITS).to(tl.int8)
            else:
                # |v| <= amax: the hardware's rounding (nearest even) never saturates here
                bits = (v * (E4M3_MAX / v_amax)).to(tl.float8e4nv, fp_downcast_rounding="rtne").to(
                    tl.int8, bitcast=True)
            _store_own(in_rank(VT8, PEER_BYTES, g, WORLD) + (bh * HEAD_DIM + offs_d)[None, :] * sk_pad
                       + offs_s[:, None], bits, own[:, None], whole, WORLD)
            if tl.program_id(0) == 0:
                tl.store(in_rank(VS, PEER_BYTES, g, WORLD) + bh * HEAD_DIM + offs_d, tl.reshape(v_scale, [HEAD_DIM]))
