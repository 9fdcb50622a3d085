"""Flash attention forward: Triton kernels.

Tiling
------
One program owns a ``BLOCK_M × head_dim`` tile of queries of one (batch, head) and streams the
keys/values of the matching KV head in ``BLOCK_N`` rows at a time, keeping the running row max
``m``, row sum ``l`` and the un-normalised output ``acc`` in registers (online softmax). Scores
live only as a ``BLOCK_M × BLOCK_N`` register tile; nothing of size S×S touches memory.

The key range of a query block is split into at most three loops so that the hot loop does no
masking at all: blocks left of the window (masked), blocks fully inside every row's allowed range
(unmasked), and the diagonal / window edge / ragged end (masked). Non-causal attention over a
multiple of ``BLOCK_N`` keys runs only the unmasked loop. An additive bias (``HAS_BIAS``,
SDPA's ``attn_mask``) covers the first ``bias_keys`` keys (all of them for a full bias), a
key-padding mask (``KEY_PADDING``) the first ``mask_keys``: their blocks join the first masked
loop, the only one that reads them, and the keys after them take the unmasked loop, so a mask
over a short prefix (the text of a joint ``[text, image]`` sequence) costs only its own blocks.
The key-padding mask has its own pointer, ``KEY_PADDING_MASK`` ``(batch, ≥ mask_keys)`` bool
with unit stride along the keys: a row of flags per key block, not a float score tile, so it
needs no shared memory and keeps the unmasked configs.

Loads (``LOAD_MODE``, a constexpr; one kernel body):
  * 0 pointers: masked ``tl.load``/``tl.store`` with arbitrary strides (Ampere/Ada, interpreter).
  * 1 device descriptors: per-program TMA descriptors over one (sequence, head) slice, so the copy
    engine zero-fills past the end of a sequence and clips stores at it (varlen, odd head_dim).
  * 2 host descriptors: TMA descriptors built once on the host over a 2-D view of the whole
    tensor (rows = tokens of all sequences); nothing is built per program. Rows past a sequence's
    end belong to the next sequence: K/V columns there are masked in the scores, Q rows there are
    never stored (partial output tiles are stored through pointers).

Tail split
----------
With a 1-D grid of ``num_full`` whole tiles followed by ``TAIL_SPLITS`` pieces of each of the last
few tiles, a launch whose tile count leaves the last wave mostly empty (e.g. 816 tiles on 132 SMs:
6.2 waves) ends after a fraction of a wave instead of a whole one. Each piece covers a slice of
the key range and writes its un-normalised partial (acc, m, l) in fp32; ``attention_merge_kernel``
combines the pieces (the flash-decoding merge).

Cost per (batch, head): FLOPs = 4·Sq·Sk·d (halved for causal), bytes ≥ 2·(2·Sq + 2·Sk)·d (bf16),
so at Sq = Sk = 4096, d = 128 the arithmetic intensity is ~1000 FLOP/B: matrix-unit bound.

Scores are kept in the base-2 domain (:mod:`flashflow.kernels.softmax`); which keys a row sees
is :mod:`flashflow.kernels.mask`'s rule.

``DOT_FP32`` (the launcher sets it only for bf16 under Triton's interpreter, whose bf16 ``tl.dot``
is wrong): the tiles are converted to fp32 after loading, so both dots run in fp32. On a GPU it
is off and compiles to nothing.
"""
import triton
import triton.language as tl

from flashflow.kernels.mask import key_allowed, key_blocks, masked_prefix, split_range, rows_mask
from flashflow.kernels.softmax import (LOG2E_C, log_sum_exp, merge_partials, normalize, online_softmax,
                                       online_softmax_scaled, softcap_scores)
from flashflow.kernels.tile_order import attention_tile


@triton.jit
def _masked_scores(q, k_t, offs_m, offs_n, bias_ptrs, KEY_PADDING_MASK, qk_scale_log2, softcap, seqlen_k, bias_end,
                   mask_keys, diag_offset, window_left, window_right, DOT_PRECISION: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LEFT: tl.constexpr,
                   HAS_RIGHT: tl.constexpr, KEY_PADDING: tl.constexpr):
    """log2(e)·(softcap(q·kᵀ·scale) + bias), -inf outside the sequence, the window and the diagonal.
    The bias covers the keys before ``bias_end``; later ones add nothing. With ``KEY_PADDING``,
    ``KEY_PADDING_MASK`` (this batch's row) hides the keys before ``mask_keys`` whose flag is
    False (one load of ``BLOCK_N`` flags, not a score tile)."""
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        s = softcap_scores(s, qk_scale_log2, softcap)
    else:
        s = s * qk_scale_log2
    if HAS_BIAS:
        b = tl.load(bias_ptrs, mask=offs_n[None, :] < bias_end, other=0.0).to(tl.float32)
        s += b * LOG2E_C
    allowed = key_allowed(offs_n[None, :] < seqlen_k, offs_n[None, :], offs_m[:, None] + diag_offset, window_left,
                          window_right, HAS_LEFT, HAS_RIGHT)
    if KEY_PADDING:
        keep = tl.load(KEY_PADDING_MASK + offs_n, mask=offs_n < mask_keys, other=1)
        allowed &= (keep != 0)[None, :]
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def _load_kv(K, V, KD, VD, k_row0, k_col0, start_n, offs_n, offs_d, stride_kn, stride_vn, seqlen_k,
             HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr,
             LOAD_MODE: tl.constexpr, DOT_FP32: tl.constexpr):
    if LOAD_MODE == 2:
        k = KD.load([k_row0 + start_n, k_col0])
        v = VD.load([k_row0 + start_n, k_col0])
    elif LOAD_MODE == 1:
        k = KD.load([start_n, 0])
        v = VD.load([start_n, 0])
    else:
        k_ptrs = K + offs_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = V + offs_n[:, None] * stride_vn + offs_d[None, :]
        if MASKED or HEAD_DIM != HEAD_DIM_PAD:
            kv_mask = rows_mask(offs_n, seqlen_k, offs_d, HEAD_DIM)
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _kv_loop(acc, l_i, m_i, q, lo, hi, K, V, KD, VD, k_row0, k_col0, stride_kn, stride_vn, offs_m,
             offs_d, bias_ptrs, stride_bias_n, KEY_PADDING_MASK, qk_scale_log2, softcap, seqlen_k, bias_end,
             mask_keys, diag_offset, window_left, window_right,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
             MASKED: tl.constexpr, LOAD_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
             HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LEFT: tl.constexpr,
             HAS_RIGHT: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, DOT_FP32: tl.constexpr,
             KEY_PADDING: tl.constexpr):
    """Fold key blocks [lo, hi) into (acc, l, m). ``MASKED=False`` is the hot loop: no masks,
    scale folded into one FMA with the max subtraction."""
    offs_nb = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_nb
        k, v = _load_kv(K, V, KD, VD, k_row0, k_col0, start_n, offs_n, offs_d, stride_kn, stride_vn,
                        seqlen_k, HEAD_DIM, HEAD_DIM_PAD, MASKED, LOAD_MODE, DOT_FP32)
        if MASKED or HAS_SOFTCAP:
            if MASKED:
                s = _masked_scores(q, k.T, offs_m, offs_n, bias_ptrs + start_n * stride_bias_n,
                                   KEY_PADDING_MASK, qk_scale_log2, softcap, seqlen_k, bias_end, mask_keys,
                                   diag_offset, window_left, window_right, DOT_PRECISION, HAS_SOFTCAP,
                                   HAS_BIAS, HAS_LEFT, HAS_RIGHT, KEY_PADDING)
            else:
                s = softcap_scores(tl.dot(q, k.T, input_precision=DOT_PRECISION), qk_scale_log2, softcap)
            p, alpha, l_i, m_i = online_softmax(s, m_i, l_i)
        else:
            qk = tl.dot(q, k.T, input_precision=DOT_PRECISION)
            p, alpha, l_i, m_i = online_softmax_scaled(qk, m_i, l_i, qk_scale_log2)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_i


@triton.jit
def attention_fwd_kernel(
    Q, K, V, O, LSE, BIAS, KEY_PADDING_MASK, CU_SEQLENS_Q, CU_SEQLENS_K, QD, KD, VD, OD, WS_ACC, WS_ML,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    stride_bb, stride_bh, stride_bm, stride_bn, stride_key_padding_mask,
    q_row_b, q_row_h, q_col_h, k_row_b, k_row_h, k_col_h, o_row_b, o_row_h, o_col_h,
    seqlen_q, seqlen_k, heads, kv_group, num_m_blocks, num_full,
    qk_scale_log2, softcap, window_left, window_right, bias_keys, mask_keys,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, RETURN_LSE: tl.constexpr,
    HEAVY_FIRST: tl.constexpr, LOAD_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, TAIL_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr = False,
    KEY_PADDING: tl.constexpr = False,
):
    """1-D grid over tiles, m-block fastest, then head, then batch (programs that run together
    share K/V in L2). Tiles ``>= num_full`` are cut into ``TAIL_SPLITS`` key-range pieces.

    Causal programs are dispatched heaviest-first (``HEAVY_FIRST``: the m-blocks near the end of
    the sequence see the most keys), so the short ones fill the last wave.

    ``HAS_BIAS``: ``BIAS`` is an additive float score bias over the first ``bias_keys`` keys
    (strides ``stride_b*``). ``KEY_PADDING``: ``KEY_PADDING_MASK (batch, ≥ mask_keys)`` holds a
    bool per key (False: hidden) over the first ``mask_keys`` keys, ``stride_key_padding_mask``
    apart per batch, unit stride along the keys.
    """
    pid = tl.program_id(0)
    tile = pid
    if TAIL_SPLITS > 1:
        is_piece = pid >= num_full
        piece = tl.maximum(pid - num_full, 0)
        tile = tl.where(is_piece, num_full + piece // TAIL_SPLITS, pid)
        split = piece % TAIL_SPLITS
    pid_m, head, batch = attention_tile(tile, num_m_blocks, heads, HEAVY_FIRST)
    kv_head = head // kv_group

    if IS_VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + batch)
        seqlen_q = tl.load(CU_SEQLENS_Q + batch + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + batch)
        seqlen_k = tl.load(CU_SEQLENS_K + batch + 1) - k_start
    else:
        q_start = 0
        k_start = 0
    m_start = pid_m * BLOCK_M
    if m_start >= seqlen_q:
        return

    # 64-bit offsets: batch·stride overflows int32 for long sequences
    q_base = Q + batch.to(tl.int64) * stride_qb + q_start.to(tl.int64) * stride_qs + head.to(tl.int64) * stride_qh
    k_base = K + batch.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_ks + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vs + kv_head.to(tl.int64) * stride_vh
    o_base = O + batch.to(tl.int64) * stride_ob + q_start.to(tl.int64) * stride_os + head.to(tl.int64) * stride_oh

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)

    k_row0 = batch * k_row_b + kv_head * k_row_h
    k_col0 = kv_head * k_col_h
    if LOAD_MODE == 2:
        kd = KD
        vd = VD
        q = QD.load([batch * q_row_b + head * q_row_h + m_start, head * q_col_h])
    elif LOAD_MODE == 1:
        q_desc = tl.make_tensor_descriptor(q_base, shape=[seqlen_q, HEAD_DIM], strides=[stride_qs, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM_PAD])
        kd = tl.make_tensor_descriptor(k_base, shape=[seqlen_k, HEAD_DIM], strides=[stride_ks, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM_PAD])
        vd = tl.make_tensor_descriptor(v_base, shape=[seqlen_k, HEAD_DIM], strides=[stride_vs, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM_PAD])
        q = q_desc.load([m_start, 0])
    else:
        kd = KD
        vd = VD
        q_mask = rows_mask(offs_m, seqlen_q, offs_d, HEAD_DIM)
        q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    bias_end = seqlen_k
    if HAS_BIAS:
        bias_end = tl.minimum(seqlen_k, bias_keys)
        bias_ptrs = (BIAS + batch.to(tl.int64) * stride_bb + head.to(tl.int64) * stride_bh
                     + tl.minimum(offs_m, seqlen_q - 1)[:, None].to(tl.int64) * stride_bm
                     + tl.arange(0, BLOCK_N)[None, :] * stride_bn)
    else:
        bias_ptrs = BIAS
    if KEY_PADDING:   # this batch's row of flags
        key_padding_mask = KEY_PADDING_MASK + batch.to(tl.int64) * stride_key_padding_mask
    else:
        key_padding_mask = KEY_PADDING_MASK

    # Key range of this query block (see the module docstring for the three loops).
    diag_offset = seqlen_k - seqlen_q
    m_last = tl.minimum(m_start + BLOCK_M, seqlen_q) - 1
    masked_keys = masked_prefix(bias_keys, mask_keys, HAS_BIAS, KEY_PADDING)
    lo, hi, full_lo, full_hi = key_blocks(m_start, m_last, diag_offset, seqlen_k, window_left, window_right,
                                          masked_keys, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_BIAS or KEY_PADDING)
    if TAIL_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(seqlen_k, BLOCK_N), TAIL_SPLITS) * BLOCK_N
        lo = tl.where(is_piece, tl.maximum(lo, split * chunk), lo)
        hi = tl.where(is_piece, tl.minimum(hi, split * chunk + chunk), hi)
    mid_lo, mid_hi = split_range(lo, hi, full_lo, full_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    acc, l_i, m_i = _kv_loop(acc, l_i, m_i, q, lo, mid_lo, k_base, v_base, kd, vd, k_row0, k_col0,
                             stride_ks, stride_vs, offs_m, offs_d, bias_ptrs, stride_bn, key_padding_mask,
                             qk_scale_log2, softcap, seqlen_k, bias_end, mask_keys, diag_offset, window_left,
                             window_right, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, LOAD_MODE, DOT_PRECISION,
                             HAS_SOFTCAP, HAS_BIAS, HAS_LEFT, HAS_RIGHT, False, DOT_FP32, KEY_PADDING)
    acc, l_i, m_i = _kv_loop(acc, l_i, m_i, q, mid_lo, mid_hi, k_base, v_base, kd, vd, k_row0, k_col0,
                             stride_ks, stride_vs, offs_m, offs_d, bias_ptrs, stride_bn, key_padding_mask,
                             qk_scale_log2, softcap, seqlen_k, bias_end, mask_keys, diag_offset, window_left,
                             window_right, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, False, LOAD_MODE, DOT_PRECISION,
                             HAS_SOFTCAP, HAS_BIAS, HAS_LEFT, HAS_RIGHT, WARP_SPECIALIZE,
                             DOT_FP32, KEY_PADDING)
    # The last loop starts at or after full_lo, past every block of the first masked_keys keys
    # (or is empty): no bias, no key-padding mask.
    acc, l_i, m_i = _kv_loop(acc, l_i, m_i, q, mid_hi, hi, k_base, v_base, kd, vd, k_row0, k_col0,
                             stride_ks, stride_vs, offs_m, offs_d, bias_ptrs, stride_bn, key_padding_mask,
                             qk_scale_log2, softcap, seqlen_k, bias_end, mask_keys, diag_offset, window_left,
                             window_right, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, LOAD_MODE, DOT_PRECISION,
                             HAS_SOFTCAP, False, HAS_LEFT, HAS_RIGHT, False, DOT_FP32, False)

    if TAIL_SPLITS > 1:
        if is_piece:
            # partial result of one key slice: un-normalised, merged by attention_merge_kernel
            offs_r = tl.arange(0, BLOCK_M)
            ws = WS_ACC + piece.to(tl.int64) * (BLOCK_M * HEAD_DIM_PAD)
            tl.store(ws + offs_r[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc)
            tl.store(WS_ML + piece.to(tl.int64) * (2 * BLOCK_M) + offs_r, m_i)
            tl.store(WS_ML + piece.to(tl.int64) * (2 * BLOCK_M) + BLOCK_M + offs_r, l_i)
            return

    out = normalize(acc, l_i).to(O.dtype.element_ty)
    if RETURN_LSE:
        lse = log_sum_exp(m_i, l_i)
        l_ptrs = (LSE + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
                  + (q_start + offs_m).to(tl.int64) * stride_ls)
        tl.store(l_ptrs, lse, mask=offs_m < seqlen_q)
    if LOAD_MODE == 1:
        o_desc = tl.make_tensor_descriptor(o_base, shape=[seqlen_q, HEAD_DIM], strides=[stride_os, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM_PAD])
        o_desc.store([m_start, 0], out)
    elif LOAD_MODE == 2 and m_start + BLOCK_M <= seqlen_q:
        OD.store([batch * o_row_b + head * o_row_h + m_start, head * o_col_h], out)
    else:
        o_mask = rows_mask(offs_m, seqlen_q, offs_d, HEAD_DIM)
        tl.store(o_base + offs_m[:, None] * stride_os + offs_d[None, :], out, mask=o_mask)


@triton.jit
def attention_merge_kernel(
    O, LSE, WS_ACC, WS_ML,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
    seqlen_q, heads, num_m_blocks, first_tile,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    MERGE_ROWS: tl.constexpr, SPLITS: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    """Merge the key-slice partials of one split tile: out = Σ 2^(m_j−m)·acc_j / Σ 2^(m_j−m)·l_j.

    Grid (split tiles, BLOCK_M / MERGE_ROWS): a program merges MERGE_ROWS rows, so its fp32
    accumulator stays small (no spills at head_dim 256). Reads SPLITS partials, writes once.
    """
    t = tl.program_id(0)
    tile = first_tile + t
    pid_m, head, batch = attention_tile(tile, num_m_blocks, heads, False)   # the split tiles are plain ones
    offs_r = tl.program_id(1) * MERGE_ROWS + tl.arange(0, MERGE_ROWS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    acc, l_tot, m_tot = merge_partials(WS_ACC, WS_ML, t, offs_r, offs_d, offs_r, BLOCK_M, HEAD_DIM_PAD,
                                       SPLITS, False, "")
    out = normalize(acc, l_tot)
    offs_m = pid_m * BLOCK_M + offs_r
    o_ptrs = (O + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
              + offs_m[:, None].to(tl.int64) * stride_os + offs_d[None, :])
    o_mask = rows_mask(offs_m, seqlen_q, offs_d, HEAD_DIM)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_mask)
    if RETURN_LSE:
        lse = log_sum_exp(m_tot, l_tot)
        tl.store(LSE + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
                 + offs_m.to(tl.int64) * stride_ls, lse, mask=offs_m < seqlen_q)
