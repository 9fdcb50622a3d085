"""Flash attention backward: Triton kernels (FlashAttention-2's recomputation).

The forward keeps no probabilities, only each row's log-sum-exp. The backward recomputes a
``BLOCK_M × BLOCK_N`` tile of them at a time, ``P = exp(S − lse)``, in the base-2 domain of the
forward (:mod:`flashflow.kernels.softmax`), and never writes an S×S buffer:

    δ_i  = rowsum(dO_i ∘ O_i) − dlse_i                        (:func:`attention_bwd_delta_kernel`)
    dV_j = Σ_i P_ij dO_i,   dS_ij = P_ij (dO_i·V_j − δ_i)
    dK_j = scale · Σ_i dS'_ij Q_i                              (:func:`attention_bwd_dkdv_kernel`)
    dQ_i = scale · Σ_j dS'_ij K_j                              (:func:`attention_bwd_dq_kernel`)

with ``dS' = dS`` or, under a softcap ``c`` (``S = c·tanh(x·scale/c)``), ``dS' = dS·(1 − (S/c)²)``.
``dlse`` is the gradient reaching a returned log-sum-exp (0 when it is not used).

Deterministic by construction: a dK/dV program owns one block of keys of one KV head and loops
over every query head of its group (GQA/MQA: the group's sum happens in registers, in a fixed
order), a dQ program owns one block of queries; no atomics, so the gradients are identical
from run to run. Which keys a row sees is :mod:`flashflow.kernels.mask`'s rule (causal
bottom-right, window), plus an optional key-padding prefix as in the forward.

``DOT_FP32`` as in the forward (bf16 under the interpreter only).
"""
import triton
import triton.language as tl

from flashflow.kernels.mask import key_allowed, key_blocks, rows_mask
from flashflow.kernels.softmax import LOG2E_C


@triton.jit
def attention_bwd_delta_kernel(O, DO, DLSE, DELTA, seqlen_q, heads,
                               so_b, so_s, so_h, sdo_b, sdo_s, sdo_h, sdl_b, sdl_h, sdl_s,
                               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                               HAS_DLSE: tl.constexpr):
    """δ = rowsum(dO ∘ O) − dlse in fp32, ``DELTA[(b·heads + h)·seqlen_q + i]``. Grid
    ``(cdiv(seqlen_q, BLOCK_M), batch · heads)``; reads O and dO once."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = rows_mask(offs_m, seqlen_q, offs_d, HEAD_DIM)
    o = tl.load(O + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_s + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + b * sdl_b + h * sdl_h + offs_m * sdl_s, mask=offs_m < seqlen_q, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * seqlen_q + offs_m, delta, mask=offs_m < seqlen_q)


@triton.jit
def _probs(q, k_t, offs_m, offs_n, lse, qk_scale_log2, softcap, seqlen_q, seqlen_k, diag_offset,
           window_left, window_right, KPM, kpm_keys, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
           HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr):
    """``(P, tanh)``: the tile's probabilities recomputed from the row log-sum-exps (0 where a key
    is not allowed), and under a softcap the tile's ``tanh`` (for its derivative)."""
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION)
    t = s
    if HAS_SOFTCAP:
        t = s * qk_scale_log2
        e = tl.math.exp2(t * (2.0 * LOG2E_C))
        t = 1.0 - 2.0 / (e + 1.0)
        s = t * (softcap * LOG2E_C)
    else:
        s = s * qk_scale_log2
    allowed = key_allowed(offs_n[None, :] < seqlen_k, offs_n, offs_m[:, None] + diag_offset, window_left,
                          window_right, HAS_LEFT, HAS_RIGHT) & (offs_m < seqlen_q)[:, None]
    if HAS_KPM:
        keep = tl.load(KPM + offs_n, mask=offs_n < kpm_keys, other=1)
        allowed &= (keep != 0)[None, :]
    # a row with no allowed key has lse = -inf: every entry of it is masked, none is exp2(+inf)
    p = tl.where(allowed, tl.math.exp2(s - lse[:, None] * LOG2E_C), 0.0)
    return p, t


@triton.jit
def _load_tiles(A, B, base_a, base_b, stride_a, stride_b, offs_rows, n_rows, offs_d, HEAD_DIM: tl.constexpr,
                DOT_FP32: tl.constexpr):
    """Two ``(rows, head_dim)`` tiles over the same rows (K and V, or Q and dO), zero past the
    end, widened to fp32 under ``DOT_FP32``; and their mask."""
    mask = rows_mask(offs_rows, n_rows, offs_d, HEAD_DIM)
    a = tl.load(A + base_a + offs_rows[:, None] * stride_a + offs_d[None, :], mask=mask, other=0.0)
    b = tl.load(B + base_b + offs_rows[:, None] * stride_b + offs_d[None, :], mask=mask, other=0.0)
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b, mask


@triton.jit
def _row_stats(LSE, DELTA, lse_base, sl_s, delta_row, offs_m, seqlen_q):
    """The rows' log-sum-exp (from the forward) and δ."""
    row_ok = offs_m < seqlen_q
    lse = tl.load(LSE + lse_base + offs_m * sl_s, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + delta_row * seqlen_q + offs_m, mask=row_ok, other=0.0)
    return lse, delta


@triton.jit
def attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, KPM,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sdo_b, sdo_s, sdo_h, sl_b, sl_h, sl_s,
    sdk_b, sdk_s, sdk_h, sdv_b, sdv_s, sdv_h, skpm_b,
    seqlen_q, seqlen_k, heads, kv_heads, kpm_keys, softmax_scale, qk_scale_log2, softcap, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr = False,
):
    """dK and dV of one ``BLOCK_N`` block of keys of one KV head. Grid
    ``(cdiv(seqlen_k, BLOCK_N), batch · kv_heads)``; the query blocks that may see the keys are
    streamed for every query head of the group."""
    pid_n = tl.program_id(0)
    bkh = tl.program_id(1)
    b = (bkh // kv_heads).to(tl.int64)
    kvh = bkh % kv_heads
    group = heads // kv_heads
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_mb = tl.arange(0, BLOCK_M)
    k, v, kv_mask = _load_tiles(K, V, b * sk_b + kvh * sk_h, b * sv_b + kvh * sv_h, sk_s, sv_s, offs_n, seqlen_k,
                                offs_d, HEAD_DIM, DOT_FP32)
    k_t = tl.trans(k)
    v_t = tl.trans(v)
    kpm = KPM + b * skpm_b
    diag_offset = seqlen_k - seqlen_q
    # the query rows that may see a key of this block: i + diag_offset + right >= start_n (causal
    # side) and i + diag_offset - left <= the block's last key (window side)
    lo = 0
    hi = seqlen_q
    if HAS_RIGHT:
        lo = tl.maximum(start_n - diag_offset - window_right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(start_n + BLOCK_N - diag_offset + window_left, seqlen_q)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    for g in range(0, group):
        h = kvh * group + g
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_mb
            q, do, _rows = _load_tiles(Q, DO, b * sq_b + h * sq_h, b * sdo_b + h * sdo_h, sq_s, sdo_s, offs_m, seqlen_q,
                                   offs_d, HEAD_DIM, DOT_FP32)
            lse, delta = _row_stats(LSE, DELTA, b * sl_b + h * sl_h, sl_s, (bkh * group + g).to(tl.int64), offs_m,
                                    seqlen_q)
            p, t = _probs(q, k_t, offs_m, offs_n, lse, qk_scale_log2, softcap, seqlen_q, seqlen_k, diag_offset,
                          window_left, window_right, kpm, kpm_keys, DOT_PRECISION, HAS_SOFTCAP, HAS_LEFT,
                          HAS_RIGHT, HAS_KPM)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)
            dp = tl.dot(do, v_t, input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            if HAS_SOFTCAP:
                ds = ds * (1.0 - t * t)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)
    dk = dk * softmax_scale
    tl.store(DK + b * sdk_b + kvh * sdk_h + offs_n[:, None] * sdk_s + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + b * sdv_b + kvh * sdv_h + offs_n[:, None] * sdv_s + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, KPM,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sdo_b, sdo_s, sdo_h, sl_b, sl_h, sl_s,
    sdq_b, sdq_s, sdq_h, skpm_b,
    seqlen_q, seqlen_k, heads, kv_heads, kpm_keys, softmax_scale, qk_scale_log2, softcap, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_KPM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr = False,
):
    """dQ of one ``BLOCK_M`` block of queries of one head. Grid ``(cdiv(seqlen_q, BLOCK_M),
    batch · heads)``; the key blocks the rows may see are streamed (the forward's key range)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    kvh = h // (heads // kv_heads)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_nb = tl.arange(0, BLOCK_N)
    q, do, q_mask = _load_tiles(Q, DO, b * sq_b + h * sq_h, b * sdo_b + h * sdo_h, sq_s, sdo_s, offs_m, seqlen_q,
                                offs_d, HEAD_DIM, DOT_FP32)
    lse, delta = _row_stats(LSE, DELTA, b * sl_b + h * sl_h, sl_s, bh.to(tl.int64), offs_m, seqlen_q)
    diag_offset = seqlen_k - seqlen_q
    m_last = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    lo, hi, _full_lo, _full_hi = key_blocks(start_m, m_last, diag_offset, seqlen_k, window_left, window_right, 0, BLOCK_N,
                              HAS_LEFT, HAS_RIGHT, False)
    kpm = KPM + b * skpm_b
    kv_off_k = b * sk_b + kvh * sk_h
    kv_off_v = b * sv_b + kvh * sv_h
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_nb
        k, v, _keys = _load_tiles(K, V, kv_off_k, kv_off_v, sk_s, sv_s, offs_n, seqlen_k, offs_d, HEAD_DIM, DOT_FP32)
        p, t = _probs(q, tl.trans(k), offs_m, offs_n, lse, qk_scale_log2, softcap, seqlen_q, seqlen_k, diag_offset,
                      window_left, window_right, kpm, kpm_keys, DOT_PRECISION, HAS_SOFTCAP, HAS_LEFT, HAS_RIGHT,
                      HAS_KPM)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    dq = dq * softmax_scale
    tl.store(DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_s + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=q_mask)
