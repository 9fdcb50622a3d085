"""A Llama / Qwen-style decoder layer's decode step in one persistent launch (a megakernel).

One step of a layer for ``batch`` ≤ 16 sequences of one new token each::

    h   = x + o_proj(attention(rope(q), cache ⊕ rope(k), cache ⊕ v))   q, k, v = qkv_proj(rmsnorm(x))
    out = h + down(silu(gate(rmsnorm(h))) ∘ up(rmsnorm(h)))

Tasks
-----
The host builds a task table once (:class:`flashflow.ops.decode_layer.DecodeLayerPlan`): int32
rows ``(stage, a, b, c, wait_idx, wait_count, signal_idx, 0)``. Stages:

=========  =====================  ==========================================================
``QKV``    (head, pair block, -)  ``QKV_PAIRS`` rotary pairs (channels i and i + d/2) of one q,
                                  k or v head for every row: the RMSNorm is recomputed from x
                                  (its sum of squares rides in the same K loop, the scale
                                  applies after), RoPE at the row's position, then q to the
                                  workspace, k and v appended to the cache at ``cache_seqlens[b]``
``ATTN``   (b, kv head, split)    one key slice of flash-decoding over the cache after the
                                  append; the last split to arrive merges the partials
``OPROJ``  (column block, -, -)   ``BLOCK_N`` columns of ``h = x + attn · W_oᵀ`` (fp32)
``GATEUP`` (column block, -, -)   ``BLOCK_I`` columns of ``silu(g) ∘ u`` from rmsnorm(h)
``DOWN``   (column block, -, -)   ``BLOCK_N`` columns of ``out = h + act · W_downᵀ``
=========  =====================  ==========================================================

A program takes ticket after ticket; a task waits (``wait_count`` > 0) until counter
``wait_idx`` holds ``(epoch + 1) · wait_count`` and bumps counter ``signal_idx`` when done. A
GEMV tile loads its first weight chunk *before* the wait: the weights never depend on the
step, so the load overlaps the producers' tail.

Synchronisation
---------------
:mod:`flashflow.kernels.mlp`'s words and protocol, imported: the ticket at ``SYNC[0]``, the
error word at ``SYNC[2]`` (a bounded spin that ran out), the per-thread fence scratch, and
``_signal`` / ``_wait`` (per-thread release, CTA barrier, scalar release; relaxed spin, then
per-thread acquire). ``SYNC`` here is int64. Nothing is ever reset: counters only grow. Every
launch takes exactly ``num_tasks + num_programs`` tickets (each program stops on the first
ticket ≥ ``num_tasks``), so a program's first ticket ``t0`` gives the launch's ``epoch =
t0 // (num_tasks + num_programs)``, read off device memory: no argument changes between steps,
and a CUDA graph of the launch replays correctly. A counter bumped ``n`` times per launch
holds ``(epoch + 1) · n`` once the launch's producers are done.

The split-KV merge: each split stores its fp32 partial (acc, m, l), releases, and bumps the
(sequence, KV head) counter with one ``acq_rel`` atomic; the program that reads ``(epoch + 1) ·
NUM_SPLITS − 1`` arrived last, acquires per thread, merges the partials in split order (the
same bits whoever merges) and signals ``OPROJ``'s counter.

Deadlock freedom
----------------
Tickets are taken in increasing order and the table is topological: every task a ticket
waits on has a smaller ticket (the plan checks it). The smallest unfinished ticket was taken by
a running program and waits only on finished tasks, so it completes; by induction every ticket
completes, whatever the number of programs, co-resident or not. With one program, or in
Triton's interpreter (programs run one after another), program 0 runs every task in ticket
order and never waits. A table that is not topological sets the error word after
``spin_limit`` polls (``spin_limit`` > 0) instead of hanging.

Bytes
-----
Weights once: ``(hidden·(heads + 2·kv_heads)·d + heads·d·hidden + 3·inter·hidden + 2·hidden)·e``;
the cache once: ``2·batch·kv_heads·cache_len·d·e`` read and ``2·batch·kv_heads·d·e`` appended;
x and out. The fp32 intermediates (q, attention output, h, act, split partials) are a few
hundred KB, written once and read from L2. Each GEMV tile also re-reads its activation rows
(batch × K values, L2). FLOPs ≈ 2 · batch · weight elements: memory bound at batch ≤ 16.
"""
import random
from dataclasses import dataclass

import triton
import triton.language as tl

from flashflow.device import cdiv

from flashflow.kernels.decode import _attend, _kv_ptrs, _split_bounds
from flashflow.kernels.mlp import CNT_OFF, _TICKET, _act, _signal, _thread_release, _wait
from flashflow.kernels.softmax import merge_partials, normalize

# stage codes of the task table
QKV, ATTN, OPROJ, GATEUP, DOWN = 0, 1, 2, 3, 4
STAGES = ("qkv", "attn", "oproj", "gateup", "down")
TASK_WORDS = 8   # int32 words per task row
_QKV = tl.constexpr(QKV)
_ATTN = tl.constexpr(ATTN)
_OPROJ = tl.constexpr(OPROJ)
_GATEUP = tl.constexpr(GATEUP)
_TASK_WORDS = tl.constexpr(TASK_WORDS)


# ------------------------------------------------------------------------------------------
# GEMV pieces: rows of activations (batch ≤ BLOCK_B) times a tile of weight rows
# ------------------------------------------------------------------------------------------


@triton.jit
def _w_chunk(W, stride_w, offs_n, n_ok, k0, K, BLOCK_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(W + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :],
                   mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _a_chunk(A, stride_a, G, offs_b, b_ok, k0, K, ss, HAS_NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """Activation rows ``[k0, k0 + BLOCK_K)`` in fp32 (times the norm weight with HAS_NORM) and
    the running sum of squares of the raw values. ``.cg``: other programs of this launch wrote
    the workspaces (a stale L1 line must not be read)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    a = tl.load(A + offs_b[:, None] * stride_a + offs_k[None, :], mask=b_ok[:, None] & k_ok[None, :], other=0.0,
                cache_modifier=".cg").to(tl.float32)
    if HAS_NORM:
        ss += tl.sum(a * a, 1)
        g = tl.load(G + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        a = a * g[None, :]
    return a, ss


@triton.jit
def _dot(acc, a, w, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a, tl.trans(w.to(tl.float32)), acc, input_precision=DOT_PRECISION)
    else:
        return tl.dot(a.to(w.dtype), tl.trans(w), acc, input_precision=DOT_PRECISION)


@triton.jit
def _gemv(A, stride_a, G, K_LO, K_HI, offs_b, b_ok, WA, WB, stride_w, rows_a, rows_b, n_ok, wa0, wb0,
          HAS_NORM: tl.constexpr, TWO: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """fp32 ``(A∘g)[:, K_LO:K_HI] · W[rows, K_LO:K_HI]ᵀ`` for one (TWO: two) weight row sets,
    the first K chunk of the weights given (``wa0``, ``wb0``: loaded before the caller's wait);
    also the rows' sum of squares (HAS_NORM, over the whole row: K_LO = 0)."""
    acc_a = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_B], dtype=tl.float32)
    a, ss = _a_chunk(A, stride_a, G, offs_b, b_ok, K_LO, K_HI, ss, HAS_NORM, BLOCK_K)
    acc_a = _dot(acc_a, a, wa0, DOT_FP32, DOT_PRECISION)
    if TWO:
        acc_b = _dot(acc_b, a, wb0, DOT_FP32, DOT_PRECISION)
    for k0 in range(K_LO + BLOCK_K, K_HI, BLOCK_K):
        wa = _w_chunk(WA, stride_w, rows_a, n_ok, k0, K_HI, BLOCK_K)
        if TWO:
            wb = _w_chunk(WB, stride_w, rows_b, n_ok, k0, K_HI, BLOCK_K)
        a, ss = _a_chunk(A, stride_a, G, offs_b, b_ok, k0, K_HI, ss, HAS_NORM, BLOCK_K)
        acc_a = _dot(acc_a, a, wa, DOT_FP32, DOT_PRECISION)
        if TWO:
            acc_b = _dot(acc_b, a, wb, DOT_FP32, DOT_PRECISION)
    return acc_a, acc_b, ss


@triton.jit
def _cache_rows(C, BT, offs_b, pos, kvh, s0, s1, s2, stride_bt, b_ok, PAGE_SIZE: tl.constexpr,
                LAYOUT: tl.constexpr):
    """Pointers to the cache row of token ``pos[b]`` of each sequence ``offs_b`` (KV head kvh)."""
    if LAYOUT == 1:
        page = tl.load(BT + offs_b * stride_bt + pos // PAGE_SIZE, mask=b_ok, other=0).to(tl.int64)
        return C + page * s0 + (pos % PAGE_SIZE).to(tl.int64) * s1 + kvh * s2
    else:
        return C + offs_b.to(tl.int64) * s0 + pos.to(tl.int64) * s1 + kvh * s2


# ------------------------------------------------------------------------------------------
# stages
# ------------------------------------------------------------------------------------------


@triton.jit
def _qkv_task(X, stride_x, G_ATTN, W_QKV, stride_wqkv, QWS, KC, VC, BT, CACHE_SEQLENS, COS, SIN,
              sk0, sk1, sk2, sv0, sv1, sv2, stride_bt, head, pblock, batch, hidden, eps,
              HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QKV_PAIRS: tl.constexpr,
              BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, PAGE_SIZE: tl.constexpr, LAYOUT: tl.constexpr,
              DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_b = tl.arange(0, BLOCK_B)
    b_ok = offs_b < batch
    offs_p = pblock * QKV_PAIRS + tl.arange(0, QKV_PAIRS)
    rows1 = head * HEAD_DIM + offs_p
    rows2 = rows1 + HALF
    n_ok = offs_p < HALF
    w1 = _w_chunk(W_QKV, stride_wqkv, rows1, n_ok, 0, hidden, BLOCK_K)
    w2 = _w_chunk(W_QKV, stride_wqkv, rows2, n_ok, 0, hidden, BLOCK_K)
    acc1, acc2, ss = _gemv(X, stride_x, G_ATTN, 0, hidden, offs_b, b_ok, W_QKV, W_QKV, stride_wqkv, rows1, rows2,
                           n_ok, w1, w2, True, True, BLOCK_B, QKV_PAIRS, BLOCK_K, DOT_FP32, DOT_PRECISION)
    rstd = 1.0 / tl.sqrt(ss / hidden + eps)
    acc1 = acc1 * rstd[:, None]
    acc2 = acc2 * rstd[:, None]
    pos = tl.load(CACHE_SEQLENS + offs_b, mask=b_ok, other=0)
    mask = b_ok[:, None] & n_ok[None, :]
    if head < HEADS + KV_HEADS:   # q and k heads turn by their position (rotate-half pairs)
        cs_off = pos[:, None].to(tl.int64) * HALF + offs_p[None, :]
        cos = tl.load(COS + cs_off, mask=mask, other=0.0)
        sin = tl.load(SIN + cs_off, mask=mask, other=0.0)
        o1 = acc1 * cos - acc2 * sin
        o2 = acc2 * cos + acc1 * sin
    else:
        o1 = acc1
        o2 = acc2
    if head < HEADS:
        q_ptrs = QWS + offs_b[:, None] * (HEADS * HEAD_DIM) + rows1[None, :]
        tl.store(q_ptrs, o1, mask=mask)
        tl.store(q_ptrs + HALF, o2, mask=mask)
    elif head < HEADS + KV_HEADS:
        k_rows = _cache_rows(KC, BT, offs_b, pos, head - HEADS, sk0, sk1, sk2, stride_bt, b_ok, PAGE_SIZE, LAYOUT)
        k_ptrs = k_rows[:, None] + offs_p[None, :]
        tl.store(k_ptrs, o1.to(KC.dtype.element_ty), mask=mask)
        tl.store(k_ptrs + HALF, o2.to(KC.dtype.element_ty), mask=mask)
    else:
        v_rows = _cache_rows(VC, BT, offs_b, pos, head - HEADS - KV_HEADS, sv0, sv1, sv2, stride_bt, b_ok,
                             PAGE_SIZE, LAYOUT)
        v_ptrs = v_rows[:, None] + offs_p[None, :]
        tl.store(v_ptrs, o1.to(VC.dtype.element_ty), mask=mask)
        tl.store(v_ptrs + HALF, o2.to(VC.dtype.element_ty), mask=mask)


@triton.jit
def _attn_task(SYNC, QWS, KC, VC, BT, CACHE_SEQLENS, ATT, WS_ACC, WS_ML, b, kvh, split, epoch,
               wait_idx, wait_target, signal_idx, merge_off, spin_limit,
               sk0, sk1, sk2, sv0, sv1, sv2, stride_bt, qk_scale_log2,
               HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_KV: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr, LAYOUT: tl.constexpr,
               THREADS: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    GROUP: tl.constexpr = HEADS // KV_HEADS
    _wait(SYNC, wait_idx, wait_target, spin_limit, THREADS)
    total = tl.load(CACHE_SEQLENS + b) + 1   # keys after this step's append
    offs_r = tl.arange(0, BLOCK_R)
    row_valid = offs_r < GROUP
    row_head = kvh * GROUP + offs_r
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(QWS + b * (HEADS * HEAD_DIM) + row_head[:, None] * HEAD_DIM + offs_d[None, :],
                mask=row_valid[:, None], other=0.0, cache_modifier=".cg")
    if not DOT_FP32:
        q = q.to(KC.dtype.element_ty)
    diag = tl.zeros([BLOCK_R], dtype=tl.int32) + total   # unused: no causal or window bound
    start, end = _split_bounds(total, 0, 1, split, 0, False, BLOCK_KV, NUM_SPLITS)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    offs_nb = tl.arange(0, BLOCK_KV)
    for start_n in range(start, end, BLOCK_KV):
        offs_n = start_n + offs_nb
        valid_n = offs_n < end
        k_ptrs, v_ptrs = _kv_ptrs(KC, VC, BT, b, kvh, start_n, 0, offs_n, offs_d, valid_n, sk0, sk1, sk2,
                                  sv0, sv1, sv2, stride_bt, PAGE_SIZE, LAYOUT, 1, False, BLOCK_KV)
        k = tl.load(k_ptrs, mask=valid_n[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=valid_n[:, None], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, k, v, offs_n, valid_n, diag, qk_scale_log2, 0.0, 0, 0,
                                False, False, False, DOT_PRECISION)
    out_ptrs = ATT + b * (HEADS * HEAD_DIM) + row_head[:, None] * HEAD_DIM + offs_d[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptrs, normalize(acc, l_i), mask=row_valid[:, None])
        _signal(SYNC, signal_idx, THREADS)
    else:
        bh = (b * KV_HEADS + kvh).to(tl.int64)
        piece = bh * NUM_SPLITS + split
        tl.store(WS_ACC + piece * (BLOCK_R * HEAD_DIM) + offs_r[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(WS_ML + piece * (2 * BLOCK_R) + offs_r, m_i, mask=row_valid)
        tl.store(WS_ML + piece * (2 * BLOCK_R) + BLOCK_R + offs_r, l_i, mask=row_valid)
        _thread_release(SYNC, THREADS)
        tl.debug_barrier()
        merge_idx = merge_off + bh
        arrived = tl.atomic_add(SYNC + merge_idx, 1, sem="acq_rel", scope="gpu")
        last = (epoch + 1) * NUM_SPLITS
        if arrived == last - 1:
            _wait(SYNC, merge_idx, last, spin_limit, THREADS)   # passes at once: the per-thread acquire
            acc_t, l_t, m_t = merge_partials(WS_ACC, WS_ML, bh, offs_r, offs_d, row_valid, BLOCK_R, HEAD_DIM,
                                             NUM_SPLITS, True, ".cg")
            tl.store(out_ptrs, normalize(acc_t, l_t), mask=row_valid[:, None])
            _signal(SYNC, signal_idx, THREADS)


@triton.jit
def _columns_task(SYNC, A, stride_a, G, WA, WB, stride_w, RES, stride_res, DEST, stride_dest, col, split, K, N,
                  batch, eps, wait_idx, wait_target, signal_idx, spin_limit, WS_PART, merge_idx, epoch,
                  HAS_NORM: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_B: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, THREADS: tl.constexpr, DOT_FP32: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Columns ``[col·BLOCK_N, +BLOCK_N)`` of a GEMV stage: GATED (gate/up): ``silu(g) ∘ u`` of
    rmsnorm(A) against rows ``col`` of WA (gate) and WB (up); otherwise ``RES + A · WAᵀ`` (the
    O and down projections with their residual). The first weight chunk loads before the wait.

    ``SPLIT_K`` > 1 (O and down only): this task is K slice ``split`` of the columns (slices of
    whole ``BLOCK_K`` chunks); it stores its fp32 partial at ``WS_PART[col·SPLIT_K + split]``,
    releases and arrives on counter ``merge_idx`` with one ``acq_rel`` atomic, and the slice
    that arrives last adds the partials in slice order (the same bits whoever adds them) to the
    residual, stores and signals: the stage counter counts column blocks, whatever SPLIT_K."""
    offs_b = tl.arange(0, BLOCK_B)
    b_ok = offs_b < batch
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = split * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    wa0 = _w_chunk(WA, stride_w, offs_n, n_ok, k_lo, k_hi, BLOCK_K)
    wb0 = wa0
    if GATED:
        wb0 = _w_chunk(WB, stride_w, offs_n, n_ok, k_lo, k_hi, BLOCK_K)
    _wait(SYNC, wait_idx, wait_target, spin_limit, THREADS)
    acc_a, acc_b, ss = _gemv(A, stride_a, G, k_lo, k_hi, offs_b, b_ok, WA, WB, stride_w, offs_n, offs_n, n_ok, wa0,
                             wb0, HAS_NORM, GATED, BLOCK_B, BLOCK_N, BLOCK_K, DOT_FP32, DOT_PRECISION)
    mask = b_ok[:, None] & n_ok[None, :]
    dest = DEST + offs_b[:, None] * stride_dest + offs_n[None, :]
    if GATED:
        rstd = 1.0 / tl.sqrt(ss / K + eps)
        out = _act(acc_a * rstd[:, None], 0) * (acc_b * rstd[:, None])
        tl.store(dest, out.to(DEST.dtype.element_ty), mask=mask)
        _signal(SYNC, signal_idx, THREADS)
    elif SPLIT_K == 1:
        res = tl.load(RES + offs_b[:, None] * stride_res + offs_n[None, :], mask=mask, other=0.0,
                      cache_modifier=".cg")
        tl.store(dest, (res.to(tl.float32) + acc_a).to(DEST.dtype.element_ty), mask=mask)
        _signal(SYNC, signal_idx, THREADS)
    else:
        tile = offs_b[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        part = WS_PART + (col * SPLIT_K).to(tl.int64) * (BLOCK_B * BLOCK_N)
        tl.store(part + split * (BLOCK_B * BLOCK_N) + tile, acc_a)
        _thread_release(SYNC, THREADS)
        tl.debug_barrier()
        arrived = tl.atomic_add(SYNC + merge_idx, 1, sem="acq_rel", scope="gpu")
        last = (epoch + 1) * SPLIT_K
        if arrived == last - 1:
            _wait(SYNC, merge_idx, last, spin_limit, THREADS)   # passes at once: the per-thread acquire
            total = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
            for i in range(SPLIT_K):
                total += tl.load(part + i * (BLOCK_B * BLOCK_N) + tile, cache_modifier=".cg")
            res = tl.load(RES + offs_b[:, None] * stride_res + offs_n[None, :], mask=mask, other=0.0,
                          cache_modifier=".cg")
            tl.store(dest, (res.to(tl.float32) + total).to(DEST.dtype.element_ty), mask=mask)
            _signal(SYNC, signal_idx, THREADS)


# ------------------------------------------------------------------------------------------
# the persistent kernel
# ------------------------------------------------------------------------------------------


@triton.jit
def decode_layer_kernel(
    X, OUT, TASKS, SYNC, CACHE_SEQLENS, BT, COS, SIN,
    W_QKV, W_O, W_GU, W_DOWN, G_ATTN, G_FFN,
    KC, VC, QWS, ATT, H1, ACT, WS_ACC, WS_ML, WS_PART,
    batch, hidden, inter, num_tasks, num_programs, merge_off, h1_idx, h1_count, col_merge_off, spin_limit,
    stride_x, stride_out, sk0, sk1, sk2, sv0, sv1, sv2, stride_bt,
    stride_wqkv, stride_wo, stride_wgu, stride_wd,
    eps, qk_scale_log2,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QKV_PAIRS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KV: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_K: tl.constexpr,
    PAGE_SIZE: tl.constexpr, LAYOUT: tl.constexpr, THREADS: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One decode step of a decoder layer: the task table's tasks by ticket (module docstring).

    Tiling: QKV tasks of ``QKV_PAIRS`` rotary pairs × all rows (two weight tiles of
    QKV_PAIRS × BLOCK_K per K chunk, two tensor-core dots with M = BLOCK_B ≥ 16 rows); attention
    tasks of (sequence, KV head, split) with GQA packing (``BLOCK_R`` ≥ 16 rows of the group's
    query heads, ``BLOCK_KV`` keys a tile); O / down tasks of BLOCK_N output columns over the whole
    K; gate/up tasks of BLOCK_I columns, gate and up rows both. Caches: LAYOUT 0 contiguous
    ``(batch, capacity, kv_heads, d)``, 1 paged ``(blocks, PAGE_SIZE, kv_heads, d)`` through BT.
    ``h1_idx``/``h1_count``: the O projection's counter, which the down stage also acquires
    (it reads h besides act); ``h1_count`` is also the number of O / down column blocks.
    ``SPLIT_K``: K slices per O / down column block (:func:`_columns_task`), their partials in
    ``WS_PART``, their arrivals on the counters from ``col_merge_off`` (O's column blocks, then
    down's). Workspaces are fp32; OUT in x's dtype.
    """
    t0 = tl.atomic_add(SYNC + _TICKET, 1, sem="relaxed", scope="gpu")
    per_launch = num_tasks + num_programs
    epoch = t0 // per_launch
    base = epoch * per_launch
    t = t0 - base
    while t < num_tasks:
        row = TASKS + t * _TASK_WORDS
        stage = tl.load(row)
        a = tl.load(row + 1)
        b = tl.load(row + 2)
        c = tl.load(row + 3)
        wait_idx = tl.load(row + 4)
        wait_target = (epoch + 1) * tl.load(row + 5)
        signal_idx = tl.load(row + 6)
        if stage == _QKV:
            _qkv_task(X, stride_x, G_ATTN, W_QKV, stride_wqkv, QWS, KC, VC, BT, CACHE_SEQLENS, COS, SIN,
                      sk0, sk1, sk2, sv0, sv1, sv2, stride_bt, a, b, batch, hidden, eps,
                      HEADS, KV_HEADS, HEAD_DIM, QKV_PAIRS, BLOCK_B, BLOCK_K, PAGE_SIZE, LAYOUT,
                      DOT_FP32, DOT_PRECISION)
            _signal(SYNC, signal_idx, THREADS)
        elif stage == _ATTN:
            _attn_task(SYNC, QWS, KC, VC, BT, CACHE_SEQLENS, ATT, WS_ACC, WS_ML, a, b, c, epoch,
                       wait_idx, wait_target, signal_idx, merge_off, spin_limit,
                       sk0, sk1, sk2, sv0, sv1, sv2, stride_bt, qk_scale_log2,
                       HEADS, KV_HEADS, HEAD_DIM, BLOCK_R, BLOCK_KV, NUM_SPLITS, PAGE_SIZE, LAYOUT,
                       THREADS, DOT_FP32, DOT_PRECISION)
        elif stage == _OPROJ:
            _columns_task(SYNC, ATT, HEADS * HEAD_DIM, G_ATTN, W_O, W_O, stride_wo, X, stride_x, H1, hidden,
                          a, b, HEADS * HEAD_DIM, hidden, batch, eps, wait_idx, wait_target, signal_idx, spin_limit,
                          WS_PART, col_merge_off + a, epoch,
                          False, False, SPLIT_K, BLOCK_B, BLOCK_N, BLOCK_K, THREADS, DOT_FP32, DOT_PRECISION)
        elif stage == _GATEUP:
            _columns_task(SYNC, H1, hidden, G_FFN, W_GU, W_GU + inter.to(tl.int64) * stride_wgu, stride_wgu,
                          H1, hidden, ACT, inter, a, 0, hidden, inter, batch, eps, wait_idx, wait_target, signal_idx,
                          spin_limit, WS_PART, 0, epoch,
                          True, True, 1, BLOCK_B, BLOCK_I, BLOCK_K, THREADS, DOT_FP32, DOT_PRECISION)
        else:
            # h (the residual) is read besides act: acquire its counter too (already complete)
            _wait(SYNC, h1_idx, (epoch + 1) * h1_count, spin_limit, THREADS)
            _columns_task(SYNC, ACT, inter, G_FFN, W_DOWN, W_DOWN, stride_wd, H1, hidden, OUT, stride_out,
                          a, b, inter, hidden, batch, eps, wait_idx, wait_target, signal_idx, spin_limit,
                          WS_PART, col_merge_off + h1_count + a, epoch,
                          False, False, SPLIT_K, BLOCK_B, BLOCK_N, BLOCK_K, THREADS, DOT_FP32, DOT_PRECISION)
        t = tl.atomic_add(SYNC + _TICKET, 1, sem="relaxed", scope="gpu") - base


# --------------------------------------------------------------------------------------------
# the task table: the kernel's contract, built on the host (as tile_order.py's ticket orders
# are for the fused FFN)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counters:
    """Word offsets of the counters in the int64 SYNC buffer (after :mod:`flashflow.kernels.mlp`'s
    fixed words): QKV tiles per KV head, split arrivals per (sequence, KV head), one each for
    attention results, O tiles, gate/up tiles and down tiles, then the K slices' arrivals per O
    column block and per down column block (``columns`` each)."""
    attn_ready: int
    merge: int
    o_ready: int
    h1_ready: int
    act_ready: int
    done: int
    col_merge: int
    words: int


def counters(config, batch: int, columns: int = 0) -> Counters:
    """The counters of a layer at ``batch`` rows; ``columns``: the O / down column blocks whose
    K slices arrive on counters of their own (0 without split-K)."""
    hk = config.kv_heads
    base = CNT_OFF + hk + batch * hk
    return Counters(CNT_OFF, CNT_OFF + hk, base, base + 1, base + 2, base + 3, base + 4, base + 4 + 2 * columns)


def split_k(tiles) -> int:
    """K slices per O / down column block (``tiles.SPLIT_K``; 1 for tiles without the field)."""
    return getattr(tiles, "SPLIT_K", 1)


def build_tasks(config, batch: int, num_splits: int, tiles,
                shuffle=None) -> list[tuple]:
    """The task rows ``(stage, a, b, c, wait_idx, wait_count, signal_idx, 0)`` in ticket order:
    QKV tiles (by KV group: its query heads, its key head, its value head), attention tasks,
    O-projection, gate/up and down tiles (O and down: ``(column block, K slice)``, each column
    block's slices together). ``shuffle`` (a seed): a random topological order instead, for
    tests (the outputs do not depend on the order)."""
    c = config
    cnt = counters(config, batch, cdiv(c.hidden, tiles.BLOCK_N))
    sk = split_k(tiles)
    group = c.heads // c.kv_heads
    per_head = c.head_dim // 2 // tiles.QKV_PAIRS
    n_o, n_gu = cdiv(c.hidden, tiles.BLOCK_N), cdiv(c.intermediate, tiles.BLOCK_I)
    tasks = []
    for kvh in range(c.kv_heads):
        heads = [kvh * group + i for i in range(group)] + [c.heads + kvh, c.heads + c.kv_heads + kvh]
        tasks += [(QKV, h, p, 0, 0, 0, cnt.attn_ready + kvh, 0) for h in heads for p in range(per_head)]
    for kvh in range(c.kv_heads):
        tasks += [(ATTN, b, kvh, s, cnt.attn_ready + kvh, (group + 2) * per_head, cnt.o_ready, 0)
                  for b in range(batch) for s in range(num_splits)]
    tasks += [(OPROJ, j, s, 0, cnt.o_ready, batch * c.kv_heads, cnt.h1_ready, 0) for j in range(n_o) for s in range(sk)]
    tasks += [(GATEUP, j, 0, 0, cnt.h1_ready, n_o, cnt.act_ready, 0) for j in range(n_gu)]
    tasks += [(DOWN, j, s, 0, cnt.act_ready, n_gu, cnt.done, 0) for j in range(n_o) for s in range(sk)]
    if shuffle is not None:
        tasks = _random_topological(tasks, num_splits, random.Random(shuffle))
    return tasks


def _merged(t) -> tuple | None:
    """What a task's partial merges into: an attention task's (sequence, KV head), an O / down
    K slice's column block; None for a task that signals alone."""
    if t[0] == ATTN:
        return (ATTN, t[1], t[2])
    if t[0] in (OPROJ, DOWN):
        return (t[0], t[1])
    return None


def _signals(tasks: list[tuple], num_splits: int):
    """Each task's contribution to the counters: a task whose partial is merged (attention
    splits, O / down K slices) counts towards its counter only as the last of its group (the
    merge signals)."""
    left = {}
    for t in tasks:
        key = _merged(t)
        if key is not None:
            left[key] = left.get(key, 0) + 1
    return left


def _random_topological(tasks, num_splits, rng) -> list[tuple]:
    count: dict = {}
    left = _signals(tasks, num_splits)
    pending, order = list(tasks), []
    while pending:
        ready = [i for i, t in enumerate(pending) if count.get(t[4], 0) >= t[5]]
        t = pending.pop(rng.choice(ready))
        order.append(t)
        _count(t, count, left)
    return order


def _count(t, count, left) -> None:
    key = _merged(t)
    if key is not None:
        left[key] -= 1
        if left[key]:
            return
    count[t[6]] = count.get(t[6], 0) + 1


def dependency_violations(tasks: list[tuple], num_splits: int) -> list[int]:
    """Tickets whose wait is not met by the tasks of smaller tickets (empty: the order is
    topological, which is what makes the kernel deadlock-free)."""
    count: dict = {}
    left = _signals(tasks, num_splits)
    bad = []
    for i, t in enumerate(tasks):
        if count.get(t[4], 0) < t[5]:
            bad.append(i)
        _count(t, count, left)
    return bad


def decode_layer_bytes(config, batch: int, cache_len: int, itemsize: int = 2) -> int:
    """The fewest DRAM bytes one step moves: every weight once, the ``cache_len`` cached keys and
    values of every sequence read once, the new key and value written, x read and out written."""
    c = config
    weights = ((c.heads + 2 * c.kv_heads) * c.head_dim * c.hidden + c.hidden * c.heads * c.head_dim + 3 * c.intermediate * c.hidden
               + 2 * c.hidden)
    kv_read = 2 * batch * c.kv_heads * cache_len * c.head_dim
    kv_write = 2 * batch * c.kv_heads * c.head_dim
    return (weights + kv_read + kv_write + 2 * batch * c.hidden) * itemsize
