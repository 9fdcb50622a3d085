"""Flash attention backward: Triton kernels (FlashAttention-2's recomputation).

The forward keeps no probabilities, only each row's log-sum-exp. The backward recomputes a tile
of them at a time, ``P = exp(S − lse)``, in the base-2 domain of the forward
(:mod:`flashflow.kernels.softmax`), and never writes an S×S buffer:

    δ_i  = rowsum(dO_i ∘ O_i) − dlse_i
    dQ_i = scale · Σ_j dS'_ij K_j                              (:func:`attention_bwd_dq_kernel`)
    dV_j = Σ_i P_ij dO_i,   dS_ij = P_ij (dO_i·V_j − δ_i)
    dK_j = scale · Σ_i dS'_ij Q_i                              (:func:`attention_bwd_dkdv_kernel`)

with ``dS' = dS`` or, under a softcap ``c`` (``S = c·tanh(x·scale/c)``), ``dS' = dS·(1 − (S/c)²)``.
``dlse`` is the gradient reaching a returned log-sum-exp (0 when it is not used).

δ is fp32, one value per query row, laid out as the LSE. The dQ kernel runs first: each program
computes δ of its own rows from the O and dO tiles it loads (dO it needs anyway), uses it for its
dS in registers and stores it; the dK/dV kernel, launched after it on the same stream, reads it
back. Without dQ (a frozen q) :func:`attention_bwd_delta_kernel` computes δ alone, before dK/dV.

Tiles
-----
A dK/dV program owns ``BLOCK_N`` keys of one KV head and works on the *transposed* score tile
``Sᵀ = K·Qᵀ`` (``BLOCK_N × BLOCK_M``): ``Pᵀ`` and ``dSᵀ`` are then already the left operands of
``dV += Pᵀ·dO`` and ``dK += dSᵀ·Q``, straight from the accumulator's registers, and no register
tile is ever transposed (only loaded ones, which costs a shared-memory descriptor). A dQ program
owns ``BLOCK_M`` queries and works on ``S = Q·Kᵀ``.

Each program's range is cut in three loops as in the forward (:func:`flashflow.kernels.mask.split_range`):
masked blocks, an unmasked hot loop where every row sees every key of the tile (no index
arithmetic at all), masked blocks. Non-causal attention over whole blocks runs only the hot loop.
Which keys a row sees is :mod:`flashflow.kernels.mask`'s rule (causal bottom-right, window), plus
a key-padding mask over a key prefix (``KEY_PADDING``: ``KEY_PADDING_MASK`` over ``mask_keys``) or
an additive score bias (``HAS_BIAS``: SDPA's ``attn_mask``, ``BIAS`` over ``bias_keys``) as in the forward.

Deterministic by construction: a dK/dV program loops over every query head of its group (GQA/MQA:
the group's sum happens in registers, in a fixed order), a dQ program owns its rows; no atomics,
so the gradients are identical from run to run.

Varlen (``IS_VARLEN``): the batch index picks a packed sequence through ``cu_seqlens``; programs
past its end do nothing. ``DOT_FP32`` as in the forward (bf16 under the interpreter only).
"""
import triton
import triton.language as tl

from flashflow.kernels.mask import key_allowed, key_blocks, masked_prefix, query_blocks, rows_mask, split_range
from flashflow.kernels.softmax import LOG2E_C


@triton.jit
def _delta(o, do, DLSE, sl_s, offs_m, seqlen_q, HAS_DLSE: tl.constexpr):
    """δ of the rows ``offs_m`` in fp32 from their ``(rows, head_dim)`` tiles of O and dO (zero
    past the end); ``DLSE`` points at the (sequence, head)'s first row, laid out as the LSE."""
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + offs_m * sl_s, mask=offs_m < seqlen_q, other=0.0)
    return delta


@triton.jit
def attention_bwd_delta_kernel(O, DO, DLSE, DELTA, seqlen_q, heads,
                               so_b, so_s, so_h, sdo_b, sdo_s, sdo_h, sl_b, sl_h, sl_s,
                               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                               HAS_DLSE: tl.constexpr):
    """δ = rowsum(dO ∘ O) − dlse in fp32, laid out as the LSE (strides ``sl_*``, shared by
    ``DLSE`` and ``DELTA``), for a backward without dQ (whose kernel computes δ itself). Grid
    ``(cdiv(seqlen_q, BLOCK_M), batch · heads)``; a varlen batch is one sequence of all its
    tokens here (δ is per row)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = rows_mask(offs_m, seqlen_q, offs_d, HEAD_DIM)
    o = tl.load(O + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_s + offs_d[None, :], mask=mask, other=0.0)
    row0 = b * sl_b + h * sl_h
    delta = _delta(o, do, DLSE + row0, sl_s, offs_m, seqlen_q, HAS_DLSE)
    tl.store(DELTA + row0 + offs_m * sl_s, delta, mask=offs_m < seqlen_q)


@triton.jit
def _seq_range(CU_Q, CU_K, b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """``(q_start, k_start, seqlen_q, seqlen_k)`` of batch entry ``b``: 0 and the dense lengths,
    or a packed sequence's offsets and lengths."""
    if IS_VARLEN:
        q_start = tl.load(CU_Q + b)
        seqlen_q = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        seqlen_k = tl.load(CU_K + b + 1) - k_start
        q_start = q_start.to(tl.int64)
        k_start = k_start.to(tl.int64)
    else:
        q_start = 0
        k_start = 0
    return q_start, k_start, seqlen_q, seqlen_k


@triton.jit
def _load_tiles(A, B, stride_a, stride_b, offs_rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, DOT_FP32: tl.constexpr):
    """Two ``(rows, head_dim)`` tiles over the same rows (K and V, or Q and dO), zero past the
    end, widened to fp32 under ``DOT_FP32``; and their mask."""
    mask = rows_mask(offs_rows, n_rows, offs_d, HEAD_DIM)
    a = tl.load(A + offs_rows[:, None] * stride_a + offs_d[None, :], mask=mask, other=0.0)
    b = tl.load(B + offs_rows[:, None] * stride_b + offs_d[None, :], mask=mask, other=0.0)
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b, mask


@triton.jit
def _lse2(LSE, sl_s, offs_m, seqlen_q):
    """The rows' log-sum-exp in base 2 (from the forward); ``LSE`` points at the (sequence,
    head)'s first row. A row that saw no key (lse = -inf) gets +inf, so every probability of it
    is 0 rather than exp2(+inf)."""
    lse = tl.load(LSE + offs_m * sl_s, mask=offs_m < seqlen_q, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)


@triton.jit
def _row_stats(LSE, DELTA, sl_s, offs_m, seqlen_q):
    """The rows' base-2 log-sum-exp (:func:`_lse2`) and δ, read back from the (sequence, head)'s
    first row of ``LSE``/``DELTA``."""
    delta = tl.load(DELTA + offs_m * sl_s, mask=offs_m < seqlen_q, other=0.0)
    return _lse2(LSE, sl_s, offs_m, seqlen_q), delta


@triton.jit
def _probs(s, q_idx, k_idx, lse2, bias_ptrs, KEY_PADDING_MASK, qk_scale_log2, softcap, seqlen_q, seqlen_k, bias_end,
           mask_keys, diag_offset, window_left, window_right, MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
           HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, KEY_PADDING: tl.constexpr):
    """``(P, tanh)`` of a tile of raw scores ``s`` in either orientation: ``q_idx``/``k_idx``/``lse2``
    are broadcast to it (``[M, 1]``/``[1, N]``/``[M, 1]`` or the transposes). ``P`` is recomputed
    from the base-2 row log-sum-exps; unmasked tiles compute no index at all, masked ones zero
    what a row may not see (``KEY_PADDING_MASK``: this batch's row of flags, read at ``k_idx``
    before ``mask_keys``) and add the bias (``bias_ptrs`` of the tile's shape). Under a softcap,
    ``tanh`` for its derivative."""
    t = s
    if HAS_SOFTCAP:
        t = s * qk_scale_log2
        e = tl.math.exp2(t * (2.0 * LOG2E_C))
        t = 1.0 - 2.0 / (e + 1.0)
        s = t * (softcap * LOG2E_C)
    else:
        s = s * qk_scale_log2
    if MASKED:
        allowed = key_allowed((k_idx < seqlen_k) & (q_idx < seqlen_q), k_idx, q_idx + diag_offset, window_left,
                              window_right, HAS_LEFT, HAS_RIGHT)
        if KEY_PADDING:
            keep = tl.load(KEY_PADDING_MASK + k_idx, mask=k_idx < mask_keys, other=1)
            allowed &= keep != 0
        if HAS_BIAS:
            bias = tl.load(bias_ptrs, mask=(k_idx < bias_end) & (q_idx < seqlen_q), other=0.0)
            s += bias.to(tl.float32) * LOG2E_C
        p = tl.where(allowed, tl.math.exp2(s - lse2), 0.0)
    else:
        p = tl.math.exp2(s - lse2)
    return p, t


@triton.jit
def _dkdv_loop(dk, dv, k, v, Q, DO, LSE, DELTA, bias_ptrs, KEY_PADDING_MASK, lo, hi, offs_n, offs_d, sq_s, sdo_s,
               sl_s, sb_m, seqlen_q, seqlen_k, bias_end, mask_keys, diag_offset, window_left, window_right,
               qk_scale_log2, softcap,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, KEY_PADDING: tl.constexpr,
               DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """dK, dV of the program's keys over the query blocks ``[lo, hi)`` of one head, on ``Sᵀ``."""
    offs_mb = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_mb
        q, do, _rows = _load_tiles(Q, DO, sq_s, sdo_s, offs_m, seqlen_q, offs_d, HEAD_DIM, DOT_FP32)
        lse2, delta = _row_stats(LSE, DELTA, sl_s, offs_m, seqlen_q)
        s = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        b_ptrs = bias_ptrs
        if HAS_BIAS:
            b_ptrs = bias_ptrs + offs_m[None, :] * sb_m
        p, t = _probs(s, offs_m[None, :], offs_n[:, None], lse2[None, :], b_ptrs, KEY_PADDING_MASK, qk_scale_log2,
                      softcap, seqlen_q, seqlen_k, bias_end, mask_keys, diag_offset, window_left, window_right, MASKED,
                      HAS_SOFTCAP, HAS_LEFT, HAS_RIGHT, HAS_BIAS, KEY_PADDING)
        dv += tl.dot(p.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[None, :])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dk += tl.dot(ds.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, BIAS, KEY_PADDING_MASK, CU_Q, CU_K,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sdo_b, sdo_s, sdo_h, sl_b, sl_h, sl_s,
    sdk_b, sdk_s, sdk_h, sdv_b, sdv_s, sdv_h, sb_b, sb_h, sb_m, sb_n, stride_key_padding_mask,
    seqlen_q, seqlen_k, heads, kv_heads, bias_keys, mask_keys, softmax_scale, qk_scale_log2, softcap, window_left,
    window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, KEY_PADDING: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr = False,
):
    """dK and dV of one ``BLOCK_N`` block of keys of one KV head. Grid
    ``(cdiv(seqlen_k, BLOCK_N), batch · kv_heads)`` (varlen: the longest sequence's keys); the
    query blocks that may see the keys are streamed for every query head of the group."""
    pid_n = tl.program_id(0)
    bkh = tl.program_id(1)
    b = (bkh // kv_heads).to(tl.int64)
    kvh = bkh % kv_heads
    group = heads // kv_heads
    q_start, k_start, seqlen_q, seqlen_k = _seq_range(CU_Q, CU_K, b, seqlen_q, seqlen_k, IS_VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n < seqlen_k:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        k, v, kv_mask = _load_tiles(K + b * sk_b + k_start * sk_s + kvh * sk_h, V + b * sv_b + k_start * sv_s + kvh * sv_h,
                                    sk_s, sv_s, offs_n, seqlen_k, offs_d, HEAD_DIM, DOT_FP32)
        diag_offset = seqlen_k - seqlen_q
        n_last = tl.minimum(start_n + BLOCK_N, seqlen_k) - 1
        lo, hi, full_lo, full_hi = query_blocks(start_n, n_last, diag_offset, seqlen_q, window_left, window_right,
                                                BLOCK_M, HAS_LEFT, HAS_RIGHT)
        bias_end = seqlen_k
        if HAS_BIAS:
            bias_end = tl.minimum(seqlen_k, bias_keys)
            if start_n < bias_end:   # a biased key block: every query block loads the bias
                full_hi = 0
        if KEY_PADDING:
            if start_n < mask_keys:   # a key block the mask covers: every query block reads its flags
                full_hi = 0
            key_padding_mask = KEY_PADDING_MASK + b * stride_key_padding_mask   # this batch's row of flags
        else:
            key_padding_mask = KEY_PADDING_MASK
        mid_lo, mid_hi = split_range(lo, hi, full_lo, full_hi)
        dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
        for g in range(0, group):
            h = (kvh * group + g).to(tl.int64)
            q_ptr = Q + b * sq_b + q_start * sq_s + h * sq_h
            do_ptr = DO + b * sdo_b + q_start * sdo_s + h * sdo_h
            lse_ptr = LSE + b * sl_b + h * sl_h + q_start * sl_s
            delta_ptr = DELTA + b * sl_b + h * sl_h + q_start * sl_s
            bias_ptrs = BIAS + b * sb_b + offs_n[:, None] * sb_n
            if HAS_BIAS:
                bias_ptrs += h * sb_h
            dk, dv = _dkdv_loop(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, bias_ptrs, key_padding_mask, lo,
                                mid_lo, offs_n, offs_d, sq_s, sdo_s, sl_s, sb_m, seqlen_q, seqlen_k, bias_end,
                                mask_keys, diag_offset, window_left, window_right, qk_scale_log2, softcap, HEAD_DIM,
                                BLOCK_M, True, HAS_SOFTCAP, HAS_LEFT, HAS_RIGHT, HAS_BIAS, KEY_PADDING,
                                DOT_PRECISION, DOT_FP32)
            dk, dv = _dkdv_loop(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, bias_ptrs, key_padding_mask, mid_lo,
                                mid_hi, offs_n, offs_d, sq_s, sdo_s, sl_s, sb_m, seqlen_q, seqlen_k, bias_end,
                                mask_keys, diag_offset, window_left, window_right, qk_scale_log2, softcap, HEAD_DIM,
                                BLOCK_M, False, HAS_SOFTCAP, HAS_LEFT, HAS_RIGHT, HAS_BIAS, KEY_PADDING,
                                DOT_PRECISION, DOT_FP32)
            dk, dv = _dkdv_loop(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, bias_ptrs, key_padding_mask, mid_hi,
                                hi, offs_n, offs_d, sq_s, sdo_s, sl_s, sb_m, seqlen_q, seqlen_k, bias_end,
                                mask_keys, diag_offset, window_left, window_right, qk_scale_log2, softcap, HEAD_DIM,
                                BLOCK_M, True, HAS_SOFTCAP, HAS_LEFT, HAS_RIGHT, HAS_BIAS, KEY_PADDING,
                                DOT_PRECISION, DOT_FP32)
        dk = dk * softmax_scale
        tl.store(DK + b * sdk_b + k_start * sdk_s + kvh * sdk_h + offs_n[:, None] * sdk_s + offs_d[None, :],
                 dk.to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + b * sdv_b + k_start * sdv_s + kvh * sdv_h + offs_n[:, None] * sdv_s + offs_d[None, :],
                 dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_loop(dq, q, do, lse2, delta, K, V, bias_ptrs, KEY_PADDING_MASK, lo, hi, offs_m, offs_d, sk_s, sv_s, sb_n,
             seqlen_q, seqlen_k, bias_end, mask_keys, diag_offset, window_left, window_right, qk_scale_log2, softcap,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, KEY_PADDING: tl.constexpr,
             DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """dQ of the program's rows over the key blocks ``[lo, hi)``, on ``S``."""
    offs_nb = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_nb
        k, v, _keys = _load_tiles(K, V, sk_s, sv_s, offs_n, seqlen_k, offs_d, HEAD_DIM, DOT_FP32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p, t = _probs(s, offs_m[:, None], offs_n[None, :], lse2[:, None], bias_ptrs + offs_n[None, :] * sb_n,
                      KEY_PADDING_MASK, qk_scale_log2, softcap, seqlen_q, seqlen_k, bias_end, mask_keys, diag_offset,
                      window_left, window_right, MASKED, HAS_SOFTCAP, HAS_LEFT, HAS_RIGHT, HAS_BIAS, KEY_PADDING)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def attention_bwd_dq_kernel(
    Q, K, V, DO, O, LSE, DLSE, DELTA, DQ, BIAS, KEY_PADDING_MASK, CU_Q, CU_K,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sdo_b, sdo_s, sdo_h, so_b, so_s, so_h, sl_b, sl_h, sl_s,
    sdq_b, sdq_s, sdq_h, sb_b, sb_h, sb_m, sb_n, stride_key_padding_mask,
    seqlen_q, seqlen_k, heads, kv_heads, bias_keys, mask_keys, softmax_scale, qk_scale_log2, softcap, window_left,
    window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, KEY_PADDING: tl.constexpr, HAS_DLSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr = False,
):
    """dQ of one ``BLOCK_M`` block of queries of one head, and their δ. Grid
    ``(cdiv(seqlen_q, BLOCK_M), batch · heads)`` (varlen: the longest sequence's queries), the
    heaviest blocks first under a causal bound. The program computes its rows' δ from their O and
    dO tiles, uses it for its own dS and stores it to ``DELTA`` for the dK/dV kernel launched
    after it; then streams the key blocks the rows may see (the forward's key range and loops,
    :func:`flashflow.kernels.mask.key_blocks`)."""
    pid_m = tl.program_id(0)
    if HAS_RIGHT:   # causal: the last query blocks see the most keys, so they start first
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    kvh = h // (heads // kv_heads)
    q_start, k_start, seqlen_q, seqlen_k = _seq_range(CU_Q, CU_K, b, seqlen_q, seqlen_k, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m < seqlen_q:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        q, do, q_mask = _load_tiles(Q + b * sq_b + q_start * sq_s + h * sq_h, DO + b * sdo_b + q_start * sdo_s + h * sdo_h,
                                    sq_s, sdo_s, offs_m, seqlen_q, offs_d, HEAD_DIM, DOT_FP32)
        o = tl.load(O + b * so_b + q_start * so_s + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], mask=q_mask,
                    other=0.0)
        row0 = b * sl_b + h * sl_h + q_start * sl_s
        delta = _delta(o, do, DLSE + row0, sl_s, offs_m, seqlen_q, HAS_DLSE)
        tl.store(DELTA + row0 + offs_m * sl_s, delta, mask=offs_m < seqlen_q)
        lse2 = _lse2(LSE + row0, sl_s, offs_m, seqlen_q)
        diag_offset = seqlen_k - seqlen_q
        m_last = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
        masked_keys = masked_prefix(bias_keys, mask_keys, HAS_BIAS, KEY_PADDING)
        lo, hi, full_lo, full_hi = key_blocks(start_m, m_last, diag_offset, seqlen_k, window_left, window_right,
                                              masked_keys, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_BIAS or KEY_PADDING)
        mid_lo, mid_hi = split_range(lo, hi, full_lo, full_hi)
        bias_end = seqlen_k
        if HAS_BIAS:
            bias_end = tl.minimum(seqlen_k, bias_keys)
        bias_ptrs = BIAS + b * sb_b
        if HAS_BIAS:
            bias_ptrs += h * sb_h + offs_m[:, None] * sb_m
        key_padding_mask = KEY_PADDING_MASK
        if KEY_PADDING:   # this batch's row of flags
            key_padding_mask += b * stride_key_padding_mask
        k_ptr = K + b * sk_b + k_start * sk_s + kvh * sk_h
        v_ptr = V + b * sv_b + k_start * sv_s + kvh * sv_h
        dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        dq = _dq_loop(dq, q, do, lse2, delta, k_ptr, v_ptr, bias_ptrs, key_padding_mask, lo, mid_lo, offs_m,
                      offs_d, sk_s, sv_s, sb_n, seqlen_q, seqlen_k, bias_end, mask_keys, diag_offset, window_left,
                      window_right, qk_scale_log2, softcap, HEAD_DIM, BLOCK_N, True, HAS_SOFTCAP, HAS_LEFT,
                      HAS_RIGHT, HAS_BIAS, KEY_PADDING, DOT_PRECISION, DOT_FP32)
        dq = _dq_loop(dq, q, do, lse2, delta, k_ptr, v_ptr, bias_ptrs, key_padding_mask, mid_lo, mid_hi, offs_m,
                      offs_d, sk_s, sv_s, sb_n, seqlen_q, seqlen_k, bias_end, mask_keys, diag_offset, window_left,
                      window_right, qk_scale_log2, softcap, HEAD_DIM, BLOCK_N, False, HAS_SOFTCAP, HAS_LEFT,
                      HAS_RIGHT, HAS_BIAS, KEY_PADDING, DOT_PRECISION, DOT_FP32)
        # past full_lo: past every block of the first masked_keys keys (key_blocks), so no bias, no mask here
        dq = _dq_loop(dq, q, do, lse2, delta, k_ptr, v_ptr, bias_ptrs, key_padding_mask, mid_hi, hi, offs_m,
                      offs_d, sk_s, sv_s, sb_n, seqlen_q, seqlen_k, bias_end, mask_keys, diag_offset, window_left,
                      window_right, qk_scale_log2, softcap, HEAD_DIM, BLOCK_N, True, HAS_SOFTCAP, HAS_LEFT,
                      HAS_RIGHT, False, False, DOT_PRECISION, DOT_FP32)
        dq = dq * softmax_scale
        tl.store(DQ + b * sdq_b + q_start * sdq_s + h * sdq_h + offs_m[:, None] * sdq_s + offs_d[None, :],
                 dq.to(DQ.dtype.element_ty), mask=q_mask)
