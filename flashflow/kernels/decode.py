"""Decode attention against a KV cache (flash-decoding): Triton kernels.

Tiling
------
Grid ``(num_splits, batch · kv_heads)``. A program owns one KV head of one sequence and one slice
of its cached keys; its query rows are every query head of that KV group times every query
token (GQA packing: ``rows = group · seqlen_q``, padded to ``BLOCK_R`` ≥ 16 for the tensor cores),
so each K/V tile is read once from memory for all the heads that share it. The slice is streamed
in ``BLOCK_N`` tokens with the online softmax of the prefill kernel.

With one split the program normalises and stores. With several, each writes its un-normalised
partial (acc, m, l) in fp32 to a workspace and bumps a per-(sequence, KV head) counter; the last
program to arrive merges the partials by their log-sum-exp (flash-decoding's merge, fused: no
second launch) and resets the counter to 0, so the next launch or CUDA-graph replay starts clean.
The counter bump is an ``acq_rel`` atomic after a CTA barrier: the barrier orders every thread's
workspace stores before the releasing atomic; the acquire orders the merging program's loads
after the other programs' releases (loads use ``.cg`` so no stale L1 line is read).

New tokens (``k``/``v`` given) are attended from the inputs directly by the last split and written
into the cache by that same program: nothing in the launch reads those cache rows, so there is
no race between the append and the attention.

``KV_FP8``: the caches are ``float8_e4m3fn`` holding ``K / k_scale`` and ``V / v_scale``
(per tensor: the float arguments; ``SCALE_PER_HEAD``: one float32 per KV head at
``K_SCALE``/``V_SCALE``). The tiles widen exactly to fp16 for the tensor cores (one conversion
instruction per pair; widening to bf16 takes several, and ran 1.3-1.6x slower on the H100), q
with them after a power-of-two scale where it exceeds fp16's range; a program owns one KV head,
so ``k_scale`` joins the score scale and ``v_scale`` multiplies its accumulator once.
The append quantizes the new K/V with :func:`flashflow.kernels.quant.round_e4m3` (nearest even,
saturating at ±448) and attends them as stored. Bytes read halve.

Cache layouts (``LAYOUT``): 0 contiguous ``(b, s, hk, d)``; 1 paged ``(blocks, page, hk, d)``
through ``block_table``; 2 FasterTransformer: K ``(b, hk, d/x, s, x)``, V ``(b, hk, s, d)``. An FT K
tile is loaded as it lies (:func:`_ft_k_tile`: one row of ``BLOCK_N · x`` contiguous elements per
16-byte channel piece, regrouped on chip); loaded key by key it ran at 0.84-0.88x of contiguous.

Bytes: every program reads its K/V slice once: ``2 · batch · kv_heads · seqlen · d · 2`` bytes
in bf16, the floor of the whole op; FLOPs (4 · heads · seqlen · d per token) are negligible.

The softmax, its merge and the key mask are the prefill kernel's (:mod:`flashflow.kernels.softmax`,
:mod:`flashflow.kernels.mask`); ``DOT_FP32`` is as there (bf16 under the interpreter only).
"""
import triton
import triton.language as tl

from flashflow.kernels.mask import key_allowed, window_start
from flashflow.kernels.quant import round_e4m3
from flashflow.kernels.softmax import (log_sum_exp, merge_partials, normalize, online_softmax, shift_of,
                                       softcap_scores)


@triton.jit
def _kv_ptrs(KC, VC, BT, b, kvh, tile_start, page, offs_n, offs_d, valid_n,
             sk0, sk1, sk2, sv0, sv1, sv2, stride_bt,
             PAGE_SIZE: tl.constexpr, LAYOUT: tl.constexpr, FT_X: tl.constexpr,
             PAGE_ALIGNED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pointers to the K and V rows of cache positions ``offs_n`` (tokens) of (b, kvh); ``page``:
    the tile's table entry where the tile lies in one page (``PAGE_ALIGNED``), read by the caller."""
    if LAYOUT == 1 and PAGE_ALIGNED:
        # one table entry (a scalar), rows contiguous: the per-row part of the address is the
        # same for every tile of a page-sized tile loop (16-byte vector loads; rows written as
        # start + arange, not offs_n % PAGE_SIZE, so the compiler sees them contiguous)
        if PAGE_SIZE == BLOCK_N:
            row = tl.arange(0, BLOCK_N)   # tiles start on multiples of BLOCK_N
        else:
            row = tile_start % PAGE_SIZE + tl.arange(0, BLOCK_N)
        page = page.to(tl.int64)
        k_ptrs = (KC + (page * sk0 + kvh * sk2)) + (row[:, None] * sk1 + offs_d[None, :])
        v_ptrs = (VC + (page * sv0 + kvh * sv2)) + (row[:, None] * sv1 + offs_d[None, :])
    elif LAYOUT == 1:
        page = tl.load(BT + b * stride_bt + offs_n // PAGE_SIZE, mask=valid_n, other=0).to(tl.int64)
        row = (offs_n % PAGE_SIZE).to(tl.int64)
        k_ptrs = KC + page[:, None] * sk0 + row[:, None] * sk1 + kvh * sk2 + offs_d[None, :]
        v_ptrs = VC + page[:, None] * sv0 + row[:, None] * sv1 + kvh * sv2 + offs_d[None, :]
    elif LAYOUT == 2:
        # a key's x channels are 16 contiguous bytes, keys x elements apart (the op checks it):
        # the token stride is the constexpr FT_X, so every piece is known 16-byte aligned. The
        # attention loop reads K through _ft_k_tile; these pointers serve V and the append
        n = offs_n.to(tl.int64)
        sk2 = tl.multiple_of(sk2, FT_X)
        k_ptrs = (KC + b.to(tl.int64) * sk0 + kvh * sk1 + (offs_d // FT_X)[None, :] * sk2
                  + n[:, None] * FT_X + (offs_d % FT_X)[None, :])
        v_ptrs = VC + b.to(tl.int64) * sv0 + kvh * sv1 + n[:, None] * sv2 + offs_d[None, :]
    else:
        n = offs_n.to(tl.int64)
        k_ptrs = KC + b.to(tl.int64) * sk0 + n[:, None] * sk1 + kvh * sk2 + offs_d[None, :]
        v_ptrs = VC + b.to(tl.int64) * sv0 + n[:, None] * sv1 + kvh * sv2 + offs_d[None, :]
    return k_ptrs, v_ptrs


@triton.jit
def _split_bounds(cache_len, n_new, seqlen_q, split, window_left, HAS_LEFT: tl.constexpr, BLOCK_N: tl.constexpr,
                  NUM_SPLITS: tl.constexpr):
    """``[start, end)``: the cached keys of split ``split`` (whole tiles, from the window's start)."""
    lo = 0
    if HAS_LEFT:
        lo = window_start(cache_len + n_new - seqlen_q, window_left, BLOCK_N)
    n_blocks = tl.cdiv(tl.maximum(cache_len - lo, 0), BLOCK_N)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    start = lo + split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, cache_len)
    return start, end


@triton.jit
def _ft_k_tile(KC, b, kvh, start_n, end, sk0, sk1, sk2, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
               BLOCK_N: tl.constexpr, FT_X: tl.constexpr):
    """The K tile ``(BLOCK_N, HEAD_DIM_PAD)`` of keys ``start_n ..`` from the FT layout, loaded as
    it lies: one row of ``BLOCK_N · FT_X`` contiguous elements per 16-byte channel piece (a warp
    reads 512 contiguous bytes), then regrouped to (key, channel) on chip."""
    PIECES: tl.constexpr = HEAD_DIM_PAD // FT_X
    offs_c = tl.arange(0, PIECES)
    offs_m = tl.arange(0, BLOCK_N * FT_X)
    sk2 = tl.multiple_of(sk2, FT_X)
    base = KC + b.to(tl.int64) * sk0 + kvh * sk1 + start_n * FT_X
    ptrs = base + offs_c[:, None].to(tl.int64) * sk2 + offs_m[None, :]
    mask = (offs_c < HEAD_DIM // FT_X)[:, None] & ((start_n + offs_m // FT_X) < end)[None, :]
    pieces = tl.load(ptrs, mask=mask, other=0.0)
    return tl.reshape(tl.permute(tl.reshape(pieces, [PIECES, BLOCK_N, FT_X]), (1, 0, 2)), [BLOCK_N, HEAD_DIM_PAD])


@triton.jit
def _attend(acc, l_i, m_i, q, k, v, offs_n, valid_n, diag, qk_scale_log2, softcap, window_left,
            window_right, HAS_SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    s = tl.dot(q, k.T, input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        s = softcap_scores(s, qk_scale_log2, softcap)
    else:
        s = s * qk_scale_log2
    allowed = key_allowed(valid_n[None, :], offs_n[None, :], diag[:, None], window_left, window_right, HAS_LEFT, HAS_RIGHT)
    s = tl.where(allowed, s, float("-inf"))
    p, alpha, l_i, m_new = online_softmax(s, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _store_rows(O, LSE, acc, l_i, m_i, b, row_head, row_tok, row_valid, offs_d, soq_b, soq_s, soq_h,
                sl_b, sl_h, sl_s, HEAD_DIM: tl.constexpr, RETURN_LSE: tl.constexpr):
    out = normalize(acc, l_i)
    o_ptrs = (O + b.to(tl.int64) * soq_b + row_tok[:, None] * soq_s + row_head[:, None] * soq_h
              + offs_d[None, :])
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_valid[:, None] & (offs_d[None, :] < HEAD_DIM))
    if RETURN_LSE:
        lse = log_sum_exp(m_i, l_i)
        tl.store(LSE + b.to(tl.int64) * sl_b + row_head * sl_h + row_tok * sl_s, lse, mask=row_valid)


@triton.jit
def decode_attention_kernel(
    Q, KC, VC, KNEW, VNEW, O, LSE, CACHE_SEQLENS, BT, WS_ACC, WS_ML, COUNTERS, K_SCALE, V_SCALE,
    sq_b, sq_s, sq_h, so_b, so_s, so_h, sl_b, sl_h, sl_s,
    sk0, sk1, sk2, sv0, sv1, sv2, skn_b, skn_s, skn_h, svn_b, svn_s, svn_h, stride_bt,
    seqlen_q, n_new, kv_group, num_kv_heads,
    qk_scale_log2, softcap, window_left, window_right, k_scale, v_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_NEW: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, LAYOUT: tl.constexpr, FT_X: tl.constexpr,
    HAS_NEW: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, RETURN_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr = False, KV_FP8: tl.constexpr = False, SCALE_PER_HEAD: tl.constexpr = False,
):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_kv_heads
    kvh = bh % num_kv_heads
    bt_row = BT + b * stride_bt
    cache_len = tl.load(CACHE_SEQLENS + b)   # tokens already in the cache
    total = cache_len + n_new                # keys after the append

    # query rows: r = token · group + head-in-group
    offs_r = tl.arange(0, BLOCK_R)
    row_tok = offs_r // kv_group
    row_head = kvh * kv_group + offs_r % kv_group
    row_valid = row_tok < seqlen_q
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    q = tl.load(Q + b.to(tl.int64) * sq_b + row_tok[:, None] * sq_s + row_head[:, None] * sq_h + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    elif KV_FP8 and q.dtype == tl.bfloat16:
        # e4m3 widens to fp16 in one instruction per pair, to bf16 in several: with an FP8 cache
        # the dots run in fp16 (on the H100 1.3-1.6x faster than widening to bf16). q goes
        # to fp16 exactly where |q| < 2^14, after a power-of-two scale that brings a larger
        # tile there (folded into the score scale, so nothing overflows or rounds more)
        q_amax = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
        q_pow2 = tl.where(q_amax > 16384.0, tl.math.exp2(tl.math.ceil(tl.math.log2(q_amax / 16384.0))), 1.0)
        q = (q.to(tl.float32) / q_pow2).to(tl.float16)
        qk_scale_log2 = qk_scale_log2 * q_pow2
    if KV_FP8:
        # an e4m3 cache holds K/scale and V/scale: the tiles widen exactly to q's dtype, k's
        # scale joins the score scale and v's multiplies the output once (one pair per program:
        # a program owns one KV head)
        if SCALE_PER_HEAD:
            k_scale = tl.load(K_SCALE + kvh)
            v_scale = tl.load(V_SCALE + kvh)
        qk_scale_log2 = qk_scale_log2 * k_scale
    diag = total - seqlen_q + row_tok        # last key each row may see (causal, bottom-right)

    # this program's slice of the cached keys
    start, end = _split_bounds(cache_len, n_new, seqlen_q, split, window_left, HAS_LEFT, BLOCK_N, NUM_SPLITS)

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM_PAD], dtype=tl.float32)
    offs_nb = tl.arange(0, BLOCK_N)
    # paged, a tile per page or less: the table entry is a scalar read one tile ahead, so a
    # tile's loads wait on no lookup and the entry takes no pipeline stage or shared memory
    page_aligned: tl.constexpr = LAYOUT == 1 and PAGE_SIZE % BLOCK_N == 0
    next_page = 0
    if page_aligned:
        next_page = tl.load(bt_row + start // PAGE_SIZE, mask=start < end, other=0)
    for start_n in range(start, end, BLOCK_N):
        page = next_page
        if page_aligned:
            next_page = tl.load(bt_row + (start_n + BLOCK_N) // PAGE_SIZE, mask=start_n + BLOCK_N < end, other=0)
        offs_n = start_n + offs_nb
        valid_n = offs_n < end
        k_ptrs, v_ptrs = _kv_ptrs(KC, VC, BT, b, kvh, start_n, page, offs_n, offs_d, valid_n, sk0, sk1, sk2,
                                  sv0, sv1, sv2, stride_bt, PAGE_SIZE, LAYOUT, FT_X, page_aligned, BLOCK_N)
        kv_mask = valid_n[:, None] & d_valid[None, :]
        if LAYOUT == 2:
            k = _ft_k_tile(KC, b, kvh, start_n, end, sk0, sk1, sk2, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, FT_X)
        else:
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, k, v, offs_n, valid_n, diag, qk_scale_log2, softcap,
                                window_left, window_right, HAS_SOFTCAP, HAS_LEFT, HAS_RIGHT, DOT_PRECISION)
    if HAS_NEW:
        if split == NUM_SPLITS - 1:
            # the new tokens: attend them from the inputs, and append them to the cache
            offs_j = tl.arange(0, BLOCK_NEW)
            valid_j = offs_j < n_new
            new_mask = valid_j[:, None] & d_valid[None, :]
            kn = tl.load(KNEW + b.to(tl.int64) * skn_b + offs_j[:, None] * skn_s + kvh * skn_h + offs_d[None, :],
                         mask=new_mask, other=0.0)
            vn = tl.load(VNEW + b.to(tl.int64) * svn_b + offs_j[:, None] * svn_s + kvh * svn_h + offs_d[None, :],
                         mask=new_mask, other=0.0)
            if KV_FP8:
                # quantized as the cache will hold them (saturating at ±448), and attended so:
                # the output is the attention over the cache after the append
                kn = round_e4m3(tl.fdiv(kn.to(tl.float32), k_scale, ieee_rounding=True))
                vn = round_e4m3(tl.fdiv(vn.to(tl.float32), v_scale, ieee_rounding=True))
                if not DOT_FP32:
                    kn = kn.to(q.dtype)
                    vn = vn.to(q.dtype)
            elif DOT_FP32:
                kn = kn.to(tl.float32)
                vn = vn.to(tl.float32)
            pos = cache_len + offs_j
            acc, l_i, m_i = _attend(acc, l_i, m_i, q, kn, vn, pos, valid_j, diag, qk_scale_log2, softcap,
                                    window_left, window_right, HAS_SOFTCAP, HAS_LEFT, HAS_RIGHT,
                                    DOT_PRECISION)
            k_ptrs, v_ptrs = _kv_ptrs(KC, VC, BT, b, kvh, cache_len, 0, pos, offs_d, valid_j, sk0, sk1, sk2,
                                      sv0, sv1, sv2, stride_bt, PAGE_SIZE, LAYOUT, FT_X, False, BLOCK_NEW)
            tl.store(k_ptrs, kn.to(KC.dtype.element_ty), mask=new_mask)
            tl.store(v_ptrs, vn.to(VC.dtype.element_ty), mask=new_mask)

    if KV_FP8:
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        _store_rows(O, LSE, acc, l_i, m_i, b, row_head, row_tok, row_valid, offs_d, so_b, so_s, so_h,
                    sl_b, sl_h, sl_s, HEAD_DIM, RETURN_LSE)
    else:
        # only the real query rows go through the workspace: GQA 32/8 fills 4 of the 16 rows
        # of a tensor-core tile, so padding rows would be 4x the merge's bytes (on the H100 this
        # cut no time at 1x8k: the merge's cost is its chain of L2 round trips, not its bytes)
        piece = bh.to(tl.int64) * NUM_SPLITS + split
        tl.store(WS_ACC + piece * (BLOCK_R * HEAD_DIM_PAD) + offs_r[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(WS_ML + piece * (2 * BLOCK_R) + offs_r, m_i, mask=row_valid)
        tl.store(WS_ML + piece * (2 * BLOCK_R) + BLOCK_R + offs_r, l_i, mask=row_valid)
        tl.debug_barrier()  # every thread's partial stores before the releasing atomic
        arrived = tl.atomic_add(COUNTERS + bh, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:
            acc_tot, l_tot, m_tot = merge_partials(WS_ACC, WS_ML, bh.to(tl.int64), offs_r, offs_d, row_valid, BLOCK_R,
                                                   HEAD_DIM_PAD, NUM_SPLITS, True, ".cg")
            _store_rows(O, LSE, acc_tot, l_tot, m_tot, b, row_head, row_tok, row_valid, offs_d,
                        so_b, so_s, so_h, sl_b, sl_h, sl_s, HEAD_DIM, RETURN_LSE)
            tl.atomic_xchg(COUNTERS + bh, 0)  # ready for the next launch / graph replay


@triton.jit
def merge_states_kernel(OA, LA, OB, LB, O, L, n_rows, heads, seqlen,
                        soa_b, soa_s, soa_h, sob_b, sob_s, sob_h, so_b, so_s, so_h,
                        sla_b, sla_h, sla_s, slb_b, slb_h, slb_s, sl_b, sl_h, sl_s,
                        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """out = (e^{la−m}·oa + e^{lb−m}·ob) / (e^{la−m} + e^{lb−m}), lse = m + log(Σ), per
    (batch, seq, head) row; 2 reads and 1 write of head_dim values per row (memory bound)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)   # flattened (batch, seq, head)
    valid = offs < n_rows * heads
    r = offs // heads
    h = (offs % heads).to(tl.int64)
    bi = (r // seqlen).to(tl.int64)
    si = (r % seqlen).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    la = tl.load(LA + bi * sla_b + h * sla_h + si * sla_s, mask=valid, other=float("-inf"))
    lb = tl.load(LB + bi * slb_b + h * slb_h + si * slb_s, mask=valid, other=float("-inf"))
    m = tl.maximum(la, lb)
    m_shift = shift_of(m)
    wa = tl.exp(la - m_shift)
    wb = tl.exp(lb - m_shift)
    tot = wa + wb
    empty = tot == 0.0
    t_safe = tl.where(empty, 1.0, tot)
    oa = tl.load(OA + (bi * soa_b + si * soa_s + h * soa_h)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    ob = tl.load(OB + (bi * sob_b + si * sob_s + h * sob_h)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    out = (wa[:, None] * oa.to(tl.float32) + wb[:, None] * ob.to(tl.float32)) / t_safe[:, None]
    tl.store(O + (bi * so_b + si * so_s + h * so_h)[:, None] + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=mask)
    lse = tl.where(empty, float("-inf"), m_shift + tl.log(t_safe))
    tl.store(L + bi * sl_b + h * sl_h + si * sl_s, lse, mask=valid)
