"""A Llama / Qwen-style decoder layer's decode step in one persistent launch (a megakernel).

One step of a layer for ``batch`` ≤ 16 sequences of one new token each::

    h   = x + o_proj(attention(rope(q), cache ⊕ rope(k), cache ⊕ v))   q, k, v = qkv_proj(rmsnorm(x))
    out = h + down(silu(gate(rmsnorm(h))) ∘ up(rmsnorm(h)))

Tasks
-----
The host builds a task table once (:class:`flashflow.ops.decode_layer.DecodeLayerPlan`): int32
rows ``(stage, a, b, c, wait_idx, wait_count, signal_idx, layer)``. Stages:

=========  =====================  ==========================================================
``NORM``   (which, row, -)        one row of ``XN = rmsnorm(x) ∘ g_attn`` (which 0) or of
                                  ``HN = rmsnorm(h) ∘ g_ffn`` (which 1, after every O column
                                  block), in x's dtype: the GEMVs' activations, normalised once
``QKV``    (head, pair block, -)  ``QKV_PAIRS`` rotary pairs (channels i and i + d/2) of one q,
                                  k or v head for every row of XN (the pair's two weight rows
                                  interleaved in one tile), RoPE at the row's position, then q
                                  to the workspace, k and v appended to the cache at
                                  ``cache_seqlens[b]``
``ATTN``   (b, kv head, split)    one key slice of flash-decoding over the cache after the
                                  append; the last split to arrive merges the partials into
                                  the attention output (x's dtype)
``OPROJ``  (column block, slice)  ``BLOCK_N`` columns of ``h = x + attn · W_oᵀ`` (fp32), over
                                  one K slice (``SPLIT_K``); the last slice merges
``GATEUP`` (column block, -, -)   ``BLOCK_I`` columns of ``silu(g) ∘ u`` from HN (gate and up
                                  rows interleaved in one tile), in x's dtype
``DOWN``   (column block, slice)  ``BLOCK_N`` columns of ``out = h + act · W_downᵀ``
=========  =====================  ==========================================================

Folded norms (``FOLDED``; :func:`flashflow.ops.decode_layer.fold_norms`): each norm weight is
folded into the weights that read its output (``W_qkv ∘ g_attn``, ``W_gate_up ∘ g_ffn``, per
input column), so a GEMV's dot can take the un-normalised rows and scale by ``1 / rms`` after
it. The norm rows of x then store only ``1 / rms(x)`` and the QKV tasks wait on them after
their K loop, not before it; there are no norm rows of h: the O column blocks store h in x's
dtype and its sums of squares per row, and each gate/up task works ``1 / rms(h)`` out of them.
Two synchronisation hops leave the step's critical path.

Every GEMV task multiplies a tile of weight rows — the left operand of the tensor-core dot,
64 or 128 rows, a warpgroup MMA on sm90 — by the activation rows (the right operand, ``BLOCK_B``
≥ 16), both straight from shared memory: its K loop holds two loads and a dot. With K slices
whose producers lie inside one slice, an O slice waits only on the attention of its KV heads
and a down slice only on its gate/up tiles (:func:`build_tasks`).

A program takes ticket after ticket; a task waits (``wait_count`` > 0) until counter
``wait_idx`` holds ``(epoch + 1) · wait_count`` and bumps counter ``signal_idx`` when done. A
GEMV tile loads its first weight chunk *before* the wait: the weights never depend on the
step, so the load overlaps the producers' tail.

Several layers
--------------
A launch may run the N layers of a step (``NUM_LAYERS``): the table is one layer's, once per
layer, each copy on counters of its own, and a later layer's rows of x wait on every column
block of the layer before's down projection. With folded norms its QKV tasks, whose dot reads
x before any norm row, wait only on the column blocks of their own K slice of x (a counter per
slice, :func:`x_slices`), so that the first slices' dots start while the layer before's last
column blocks are summed. Everything else a layer reads is ordered after those waits,
so the workspaces serve every layer. Layer 0's tensors are the arguments; the others are found
through a table of distances from them in 16-byte units, so that the compiler knows every
weight and cache pointer 16-byte aligned, as it knows an argument (a table of raw addresses
cast to pointers made the loads scalar, three times slower).

Synchronisation
---------------
:mod:`flashflow.kernels.sync`'s words and protocol, imported: the ticket at ``SYNC[0]``, the
error word at ``SYNC[2]`` (a bounded spin that ran out), and its signal and wait in their
fenced form on a GPU (``FENCED_SYNC``): to signal, every thread fences (``fence.acq_rel.gpu``),
a CTA barrier, then one scalar release add; to wait, a relaxed spin, then every thread acquires
with an ``ld.acquire.gpu`` of the counter (a warp's loads of one word are one request). Every
thread still orders its own accesses, as in the atomic form the interpreter runs (a release
atomic per thread on a scratch word, an acquire atomic per thread on the counter), but no CTA
queues 128 atomics on one L2 line: with 132 CTAs crossing each stage boundary together, those
atomics were most of the step (255 against 193.5 µs at batch 1 on an H100,
``bench/results/decode-layer-sync-study-nvidia-h100-80gb-hbm3.json``). ``SYNC`` here is int64.
Nothing is ever reset: counters only grow. Every launch takes exactly ``num_tasks +
num_programs`` tickets (each program stops on the first ticket ≥ ``num_tasks``), so a program's
first ticket ``t0`` gives the launch's ``epoch = t0 // (num_tasks + num_programs)``, read off
device memory: no argument changes between steps, and a CUDA graph of the launch replays
correctly. A counter bumped ``n`` times per launch
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
x and out. The intermediates (XN, q, the attention output, h, HN, act, split partials) are a few
hundred KB, written once and read from L2. Each GEMV tile also re-reads its activation rows
(batch × K values, L2). FLOPs ≈ 2 · batch · weight elements: memory bound at batch ≤ 16.
"""
import random
from dataclasses import dataclass

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer, smid

from flashflow.device import cdiv

from flashflow.kernels.decode import _attend, _kv_ptrs, _split_bounds
from flashflow.kernels.mlp import _act
from flashflow.kernels.sync import CNT_OFF, _TICKET, _arrive_last, _signal, _wait
from flashflow.kernels.softmax import merge_partials, normalize

# stage codes of the task table
QKV, ATTN, OPROJ, GATEUP, DOWN, NORM = 0, 1, 2, 3, 4, 5
STAGES = ("qkv", "attn", "oproj", "gateup", "down", "norm")
TASK_WORDS = 8   # int32 words per task row
TRACE_WORDS = 5  # int64 words a traced task: start, end, SM, stage, ready
_QKV = tl.constexpr(QKV)
_ATTN = tl.constexpr(ATTN)
_OPROJ = tl.constexpr(OPROJ)
_GATEUP = tl.constexpr(GATEUP)
_DOWN = tl.constexpr(DOWN)
_TASK_WORDS = tl.constexpr(TASK_WORDS)
# a multi-layer launch's table of addresses: a row a layer, these tensors' distances from layer 0's
# in this order (the kernel reads them by position, :func:`_layer_ptr`)
LAYER_PTR_KINDS = ("qkv", "o", "gate_up", "down", "attn_norm", "ffn_norm", "k_cache", "v_cache", "block_table")
LAYER_PTRS = len(LAYER_PTR_KINDS)
_LAYER_PTRS = tl.constexpr(LAYER_PTRS)
_TRACE_WORDS = tl.constexpr(TRACE_WORDS)


# ------------------------------------------------------------------------------------------
# GEMV pieces: a tile of weight rows times the activation rows (batch ≤ BLOCK_B), weights as
# the tensor-core dot's left operand (ROWS ≥ 64: a warpgroup MMA on sm90) and the activation rows
# as its right one, so that both go from shared memory to the tensor cores untouched
# ------------------------------------------------------------------------------------------


@triton.jit
def _layer_ptr(lp, i, LIKE):
    """Layer 0's pointer ``LIKE`` moved to this layer's tensor: word ``i`` of the layer's row of
    the table holds the distance from layer 0's in 16-byte units (every address is a multiple of
    16 bytes, which the plan checks), so the compiler knows the result 16-byte aligned and the
    loads through it vectorise as through a pointer argument."""
    UNIT: tl.constexpr = 128 // LIKE.dtype.element_ty.primitive_bitwidth   # elements in 16 bytes
    return LIKE + tl.load(lp + i) * UNIT


@triton.jit
def _w_rows(W, stride_w, rows, r_ok, k0, K, BLOCK_K: tl.constexpr):
    """Weight rows ``rows``, columns ``[k0, k0 + BLOCK_K)`` (zero past K or a row not ok)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(W + rows[:, None].to(tl.int64) * stride_w + offs_k[None, :],
                   mask=r_ok[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _act_rows(A, stride_a, offs_b, b_ok, k0, K, BLOCK_K: tl.constexpr):
    """Activation rows ``[k0, k0 + BLOCK_K)`` as stored (the weights' dtype). ``.cg``: other
    programs of this launch wrote the workspaces (a stale L1 line must not be read)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(A + offs_b[:, None] * stride_a + offs_k[None, :], mask=b_ok[:, None] & (offs_k < K)[None, :],
                   other=0.0, cache_modifier=".cg")


@triton.jit
def _dot_t(acc, w, a, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc (ROWS, BLOCK_B) += w · aᵀ`` (DOT_FP32: in fp32, the interpreter's bf16)."""
    if DOT_FP32:
        return tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), acc, input_precision=DOT_PRECISION)
    else:
        return tl.dot(w, tl.trans(a.to(w.dtype)), acc, input_precision=DOT_PRECISION)


@triton.jit
def _k_first(K_LO, K_HI, rot, BLOCK_K: tl.constexpr):
    """The first K chunk a GEMV task reads: chunk ``rot`` (mod its chunks) of ``[K_LO, K_HI)``, so
    that tasks running side by side read different columns of their weight rows."""
    n = tl.maximum(tl.cdiv(K_HI - K_LO, BLOCK_K), 1)
    return K_LO + (rot % n) * BLOCK_K


@triton.jit
def _wait_ready(SYNC, wait_idx, wait_target, spin_limit, THREADS: tl.constexpr, FENCED_SYNC: tl.constexpr, TR,
                TRACE: tl.constexpr):
    """A task's wait on its inputs (:func:`flashflow.kernels.sync._wait`); TRACE: then the time
    it passed (the global timer, ns) into ``TR`` (the task's trace word of when it was ready)."""
    _wait(SYNC, wait_idx, wait_target, spin_limit, THREADS, FENCED_SYNC)
    _stamp(TR, TRACE)


@triton.jit
def _stamp(TR, TRACE: tl.constexpr):
    if TRACE:
        tl.store(TR, globaltimer())


@triton.jit
def _k_slice(K, split, SLICES: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[k_lo, k_hi)`` of K slice ``split`` of ``SLICES``: whole ``BLOCK_K`` chunks each (the
    last slices may be short, or empty: ``k_hi ≤ k_lo``)."""
    k_per = tl.cdiv(tl.cdiv(K, SLICES), BLOCK_K) * BLOCK_K
    k_lo = split * k_per
    return k_lo, tl.minimum(K, k_lo + k_per)


@triton.jit
def _merge_slices(acc, part, split, offs, SLICES: tl.constexpr, SIZE: tl.constexpr, SYNC, merge_idx, epoch, spin_limit,
                  THREADS: tl.constexpr, FENCED_SYNC: tl.constexpr):
    """K slice ``split`` of a tile: store its fp32 partial ``acc`` at ``part[split]`` (``SIZE``
    values a slice, ``offs`` into it) and arrive (:func:`_arrive_last`). Returns ``(last, total)``:
    for the slice that arrives last, True and the partials added in slice order (the same bits
    whoever adds them); for the others False (and their own partial). One slice (``SLICES``
    1): True and ``acc``, with no store and no arrival, so that a task's epilogue is written once,
    under ``if last``, whatever its slices."""
    if SLICES == 1:
        last = True
        total = acc
    else:
        tl.store(part + split * SIZE + offs, acc)
        last = _arrive_last(SYNC, merge_idx, epoch, SLICES, spin_limit, THREADS, FENCED_SYNC)
        total = acc
        if last:
            total = tl.zeros_like(acc)
            for i in range(SLICES):
                total += tl.load(part + i * SIZE + offs, cache_modifier=".cg")
    return last, total


@triton.jit
def _gemv(A, stride_a, K_LO, K_HI, K_FIRST, offs_b, b_ok, W, stride_w, rows, r_ok, w0,
          ROWS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, GEMV_STAGES: tl.constexpr,
          DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """fp32 ``W[rows, K_LO:K_HI] · A[:, K_LO:K_HI]ᵀ`` as a ``(ROWS, BLOCK_B)`` tile, K chunk by K
    chunk from ``K_FIRST`` round to it (:func:`_k_first`), the first chunk of the weights given
    (``w0``: loaded before the caller's wait). The loop holds only the two loads and the dot:
    the activations come normalised and in the weights' dtype."""
    n = tl.cdiv(K_HI - K_LO, BLOCK_K)
    r0 = (K_FIRST - K_LO) // BLOCK_K
    acc = tl.zeros([ROWS, BLOCK_B], dtype=tl.float32)
    acc = _dot_t(acc, w0, _act_rows(A, stride_a, offs_b, b_ok, K_FIRST, K_HI, BLOCK_K), DOT_FP32, DOT_PRECISION)
    for i in tl.range(1, n, num_stages=GEMV_STAGES):
        k0 = K_LO + ((r0 + i) % n) * BLOCK_K
        w = _w_rows(W, stride_w, rows, r_ok, k0, K_HI, BLOCK_K)
        a = _act_rows(A, stride_a, offs_b, b_ok, k0, K_HI, BLOCK_K)
        acc = _dot_t(acc, w, a, DOT_FP32, DOT_PRECISION)
    return acc


@triton.jit
def _pairs(acc, BLOCK_B: tl.constexpr, HALF_ROWS: tl.constexpr):
    """A ``(2·HALF_ROWS, BLOCK_B)`` tile of interleaved rows (even: first of a pair, odd: second)
    as two ``(BLOCK_B, HALF_ROWS)`` tiles."""
    return tl.split(tl.reshape(tl.trans(acc), [BLOCK_B, HALF_ROWS, 2]))


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
def _norm_task(A, stride_a, G, DEST, b, hidden, eps, NORM_BLOCK: tl.constexpr):
    """Row ``b`` of ``DEST = rmsnorm(A) ∘ G`` in DEST's dtype (the GEMV tasks' activation, as an
    unfused layer rounds it): the sum of squares over the row, then the scaled row. A row of at
    most ``NORM_BLOCK`` values is read once and kept in registers; a longer one is read twice."""
    offs = tl.arange(0, NORM_BLOCK)
    row = A + b.to(tl.int64) * stride_a
    dest = DEST + b.to(tl.int64) * hidden
    if hidden <= NORM_BLOCK:
        ok = offs < hidden
        a = tl.load(row + offs, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(a * a, 0) / hidden + eps)
        tl.store(dest + offs, (a * rstd * g).to(DEST.dtype.element_ty), mask=ok)
    else:
        ss = tl.zeros([NORM_BLOCK], dtype=tl.float32)
        for k0 in range(0, hidden, NORM_BLOCK):
            a = tl.load(row + k0 + offs, mask=k0 + offs < hidden, other=0.0, cache_modifier=".cg").to(tl.float32)
            ss += a * a
        rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / hidden + eps)
        for k0 in range(0, hidden, NORM_BLOCK):
            ok = k0 + offs < hidden
            a = tl.load(row + k0 + offs, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            g = tl.load(G + k0 + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(dest + k0 + offs, (a * rstd * g).to(DEST.dtype.element_ty), mask=ok)


@triton.jit
def _rstd_task(A, stride_a, RSTD, b, hidden, eps, NORM_BLOCK: tl.constexpr):
    """``RSTD[b] = 1 / rms(A[b])`` in fp32: with the norm weights folded into the QKV weights the
    QKV tasks scale their dot by it (``NORM_BLOCK`` values a step)."""
    offs = tl.arange(0, NORM_BLOCK)
    row = A + b.to(tl.int64) * stride_a
    ss = tl.zeros([NORM_BLOCK], dtype=tl.float32)
    for k0 in range(0, hidden, NORM_BLOCK):
        a = tl.load(row + k0 + offs, mask=k0 + offs < hidden, other=0.0, cache_modifier=".cg").to(tl.float32)
        ss += a * a
    tl.store(RSTD + b, 1.0 / tl.sqrt(tl.sum(ss, 0) / hidden + eps))


@triton.jit
def _fold_out(h, HB, WS_SS, col, offs_b, offs_n, mask, N, BLOCK_B: tl.constexpr):
    """An O column block's h, for the FFN norm folded into the gate/up weights: h in HB's dtype
    (the gate/up dot's operand, as an unfused layer rounds h) and its sum of squares per row."""
    hb = h.to(HB.dtype.element_ty)
    tl.store(HB + offs_b[:, None] * N + offs_n[None, :], hb, mask=mask)
    hf = tl.where(mask, hb.to(tl.float32), 0.0)
    tl.store(WS_SS + col * BLOCK_B + offs_b, tl.sum(hf * hf, 1))


@triton.jit
def _fold_rstd(WS_SS, n_cols, offs_b, hidden, eps, COLS_PAD: tl.constexpr, BLOCK_B: tl.constexpr):
    """``1 / rms(h)`` per row from the ``n_cols`` O column blocks' sums of squares (summed in one
    fixed order: the same bits in every gate/up task)."""
    offs_c = tl.arange(0, COLS_PAD)
    ss = tl.load(WS_SS + offs_c[:, None] * BLOCK_B + offs_b[None, :], mask=(offs_c < n_cols)[:, None], other=0.0,
                 cache_modifier=".cg")
    return 1.0 / tl.sqrt(tl.sum(ss, 0) / hidden + eps)


@triton.jit
def _qkv_rows_scaled(acc, SYNC, RSTD, offs_b, b_ok, wait_idx, wait_target, spin_limit, THREADS: tl.constexpr,
                     FENCED_SYNC: tl.constexpr, FOLDED: tl.constexpr):
    """A QKV tile's dot of x as it is (FOLDED: the norm weight is in the weights) scaled by each
    row's ``1 / rms(x)``, once the norm row has stored it (a wait that passes at once by then);
    without FOLDED the dot was of the normalised rows and is returned as it is."""
    if FOLDED:
        _wait(SYNC, wait_idx, wait_target, spin_limit, THREADS, FENCED_SYNC)
        rstd = tl.load(RSTD + offs_b, mask=b_ok, other=0.0, cache_modifier=".cg")
        return acc * rstd[None, :]
    else:
        return acc


@triton.jit
def _qkv_task(SYNC, X, stride_x, XN, RSTD, W_QKV, stride_wqkv, QWS, KC, VC, BT, CACHE_SEQLENS, COS, SIN, WS_QKV,
              sk0, sk1, sk2, sv0, sv1, sv2, stride_bt, head, pblock, split, batch, hidden,
              wait_idx, wait_target, signal_idx, merge_idx, epoch, spin_limit,
              HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QKV_PAIRS: tl.constexpr,
              QKV_SPLIT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, PAGE_SIZE: tl.constexpr,
              LAYOUT: tl.constexpr, GEMV_STAGES: tl.constexpr, STAGGER: tl.constexpr, THREADS: tl.constexpr,
              DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, FENCED_SYNC: tl.constexpr,
              FOLDED: tl.constexpr, TR, TRACE: tl.constexpr, pre_idx=0, pre_epochs=0, n_cols=0,
              X_SLICES: tl.constexpr = 0, BLOCK_N: tl.constexpr = 1):
    """``QKV_PAIRS`` rotary pairs of head ``head`` from the normalised rows XN: the pair's two
    weight rows interleaved in one tile (one dot), RoPE, then q to the workspace, k and v into
    the cache; then the task signals. The first weight chunk loads before the wait on XN.
    FOLDED (the norm weight folded into the weights): the dot is of x as it is, with no wait
    before it, and the rows are scaled by ``RSTD`` (the norm row's) before RoPE.

    ``QKV_SPLIT`` > 1: this task is K slice ``split`` of the tile; it stores its fp32 partial at
    ``WS_QKV[tile·QKV_SPLIT + split]`` and arrives on counter ``merge_idx``, and the slice that
    arrives last adds the partials in slice order (the same bits whoever adds them), ropes,
    stores and signals.

    ``pre_epochs`` > 0 (FOLDED, a layer after the first of a multi-layer launch: the launch's
    epoch + 1): x is the layer before's output, and the dot waits, after the first weight
    chunk's load, until counter ``pre_idx`` has counted every one of that layer's ``n_cols``
    down column blocks; with ``X_SLICES`` (the K slices of x hold whole ``BLOCK_N`` column
    blocks), only the blocks of this slice's columns, on counter ``pre_idx + split``."""
    HALF: tl.constexpr = HEAD_DIM // 2
    ROWS: tl.constexpr = 2 * QKV_PAIRS
    offs_b = tl.arange(0, BLOCK_B)
    b_ok = offs_b < batch
    offs_r = tl.arange(0, ROWS)
    rows = head * HEAD_DIM + pblock * QKV_PAIRS + offs_r // 2 + (offs_r % 2) * HALF
    r_ok = pblock * QKV_PAIRS + offs_r // 2 < HALF
    tile = head * (HALF // QKV_PAIRS) + pblock
    k_lo, k_hi = _k_slice(hidden, split, QKV_SPLIT, BLOCK_K)
    k_first = _k_first(k_lo, k_hi, tile * STAGGER, BLOCK_K)
    w0 = _w_rows(W_QKV, stride_wqkv, rows, r_ok, k_first, k_hi, BLOCK_K)
    if FOLDED:   # ready at once when x is the call's input
        if pre_epochs > 0:
            if X_SLICES:   # the down column blocks of this slice's columns
                if k_hi > k_lo:
                    _wait(SYNC, pre_idx + split, pre_epochs * (tl.cdiv(k_hi, BLOCK_N) - k_lo // BLOCK_N),
                          spin_limit, THREADS, FENCED_SYNC)
            else:
                _wait(SYNC, pre_idx, pre_epochs * n_cols, spin_limit, THREADS, FENCED_SYNC)
        _stamp(TR, TRACE)
        acc = _gemv(X, stride_x, k_lo, k_hi, k_first, offs_b, b_ok, W_QKV, stride_wqkv, rows, r_ok, w0,
                    ROWS, BLOCK_B, BLOCK_K, GEMV_STAGES, DOT_FP32, DOT_PRECISION)
    else:
        _wait_ready(SYNC, wait_idx, wait_target, spin_limit, THREADS, FENCED_SYNC, TR, TRACE)
        acc = _gemv(XN, hidden, k_lo, k_hi, k_first, offs_b, b_ok, W_QKV, stride_wqkv, rows, r_ok, w0,
                    ROWS, BLOCK_B, BLOCK_K, GEMV_STAGES, DOT_FP32, DOT_PRECISION)
    last, total = _merge_slices(acc, WS_QKV + (tile * QKV_SPLIT).to(tl.int64) * (ROWS * BLOCK_B), split,
                                offs_r[:, None] * BLOCK_B + offs_b[None, :], QKV_SPLIT, ROWS * BLOCK_B,
                                SYNC, merge_idx, epoch, spin_limit, THREADS, FENCED_SYNC)
    if last:
        total = _qkv_rows_scaled(total, SYNC, RSTD, offs_b, b_ok, wait_idx, wait_target, spin_limit, THREADS,
                                 FENCED_SYNC, FOLDED)
        _qkv_store(total, QWS, KC, VC, BT, CACHE_SEQLENS, COS, SIN, sk0, sk1, sk2, sv0, sv1, sv2, stride_bt,
                   head, pblock, offs_b, b_ok, HEADS, KV_HEADS, HEAD_DIM, QKV_PAIRS, BLOCK_B, PAGE_SIZE, LAYOUT)
        _signal(SYNC, signal_idx, THREADS, FENCED_SYNC)


@triton.jit
def _qkv_store(acc, QWS, KC, VC, BT, CACHE_SEQLENS, COS, SIN, sk0, sk1, sk2, sv0, sv1, sv2, stride_bt,
               head, pblock, offs_b, b_ok, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
               QKV_PAIRS: tl.constexpr, BLOCK_B: tl.constexpr, PAGE_SIZE: tl.constexpr, LAYOUT: tl.constexpr):
    """A QKV tile's epilogue: the ``(2·QKV_PAIRS, BLOCK_B)`` tile of interleaved pair rows, roped
    at each row's position (q and k heads), q to the fp32 workspace, k and v appended to the
    cache at ``cache_seqlens[b]``."""
    HALF: tl.constexpr = HEAD_DIM // 2
    acc1, acc2 = _pairs(acc, BLOCK_B, QKV_PAIRS)
    offs_p = pblock * QKV_PAIRS + tl.arange(0, QKV_PAIRS)
    rows1 = head * HEAD_DIM + offs_p
    n_ok = offs_p < HALF
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
               THREADS: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, FENCED_SYNC: tl.constexpr,
               TR, TRACE: tl.constexpr):
    GROUP: tl.constexpr = HEADS // KV_HEADS
    _wait_ready(SYNC, wait_idx, wait_target, spin_limit, THREADS, FENCED_SYNC, TR, TRACE)
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
        _signal(SYNC, signal_idx, THREADS, FENCED_SYNC)
    else:
        bh = (b * KV_HEADS + kvh).to(tl.int64)
        piece = bh * NUM_SPLITS + split
        tl.store(WS_ACC + piece * (BLOCK_R * HEAD_DIM) + offs_r[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(WS_ML + piece * (2 * BLOCK_R) + offs_r, m_i, mask=row_valid)
        tl.store(WS_ML + piece * (2 * BLOCK_R) + BLOCK_R + offs_r, l_i, mask=row_valid)
        if _arrive_last(SYNC, merge_off + bh, epoch, NUM_SPLITS, spin_limit, THREADS, FENCED_SYNC):
            acc_t, l_t, m_t = merge_partials(WS_ACC, WS_ML, bh, offs_r, offs_d, row_valid, BLOCK_R, HEAD_DIM,
                                             NUM_SPLITS, True, ".cg")
            tl.store(out_ptrs, normalize(acc_t, l_t), mask=row_valid[:, None])
            _signal(SYNC, signal_idx, THREADS, FENCED_SYNC)


@triton.jit
def _columns_task(SYNC, A, stride_a, WA, stride_w, RES, stride_res, DEST, stride_dest, col, split, K, N,
                  batch, wait_idx, wait_target, signal_idx, spin_limit, WS_PART, merge_idx, epoch,
                  HB, WS_SS, n_cols, eps,
                  GATED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_B: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GEMV_STAGES: tl.constexpr, STAGGER: tl.constexpr,
                  THREADS: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  FENCED_SYNC: tl.constexpr, FOLD_OUT: tl.constexpr = False, FOLD_IN: tl.constexpr = False,
                  COLS_PAD: tl.constexpr = 1, TR=None, TRACE: tl.constexpr = False, signal2_idx=-1):
    """Columns ``[col·BLOCK_N, +BLOCK_N)`` of a GEMV stage: GATED (gate/up): ``silu(g) ∘ u`` of
    the normalised rows A against gate rows ``col`` of WA and the up rows N further, interleaved
    in one tile; otherwise ``RES + A · WAᵀ`` (the O and down projections with their residual).
    The first weight chunk loads before the wait.

    ``SPLIT_K`` > 1 (O and down only): this task is K slice ``split`` of the columns (slices of
    whole ``BLOCK_K`` chunks); it stores its fp32 partial at ``WS_PART[col·SPLIT_K + split]``,
    releases and arrives on counter ``merge_idx`` with one ``acq_rel`` atomic, and the slice
    that arrives last adds the partials in slice order (the same bits whoever adds them) to the
    residual, stores and signals: the stage counter counts column blocks, whatever SPLIT_K.

    Folded FFN norm: FOLD_OUT (O) also stores h in HB's dtype and its sums of squares per row
    in ``WS_SS[col]`` (:func:`_fold_out`); FOLD_IN (gate/up, A = HB, the norm weight in the
    weights) scales the dot by ``1 / rms(h)`` from the ``n_cols`` blocks' sums.

    ``signal2_idx`` ≥ 0 (not GATED): the stored columns are also counted there (the down
    projection's columns by the K slice of the next layer's x that holds them)."""
    offs_b = tl.arange(0, BLOCK_B)
    b_ok = offs_b < batch
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_lo, k_hi = _k_slice(K, split, SPLIT_K, BLOCK_K)
    k_first = _k_first(k_lo, k_hi, col * STAGGER, BLOCK_K)
    if GATED:   # gate row i and up row i (N rows further) as rows 2i and 2i + 1 of one tile
        offs_r = tl.arange(0, 2 * BLOCK_N)
        cols = col * BLOCK_N + offs_r // 2
        r_ok = cols < N
        rows = cols + (offs_r % 2) * N
        w0 = _w_rows(WA, stride_w, rows, r_ok, k_first, k_hi, BLOCK_K)
        _wait_ready(SYNC, wait_idx, wait_target, spin_limit, THREADS, FENCED_SYNC, TR, TRACE)
        if FOLD_IN:
            rstd = _fold_rstd(WS_SS, n_cols, offs_b, K, eps, COLS_PAD, BLOCK_B)
        acc = _gemv(A, stride_a, k_lo, k_hi, k_first, offs_b, b_ok, WA, stride_w, rows, r_ok, w0,
                    2 * BLOCK_N, BLOCK_B, BLOCK_K, GEMV_STAGES, DOT_FP32, DOT_PRECISION)
        acc_a, acc_b = _pairs(acc, BLOCK_B, BLOCK_N)
        if FOLD_IN:
            acc_a = acc_a * rstd[:, None]
            acc_b = acc_b * rstd[:, None]
    else:
        w0 = _w_rows(WA, stride_w, offs_n, n_ok, k_first, k_hi, BLOCK_K)
        _wait_ready(SYNC, wait_idx, wait_target, spin_limit, THREADS, FENCED_SYNC, TR, TRACE)
        acc_a = tl.trans(_gemv(A, stride_a, k_lo, k_hi, k_first, offs_b, b_ok, WA, stride_w, offs_n, n_ok, w0,
                               BLOCK_N, BLOCK_B, BLOCK_K, GEMV_STAGES, DOT_FP32, DOT_PRECISION))
    mask = b_ok[:, None] & n_ok[None, :]
    dest = DEST + offs_b[:, None] * stride_dest + offs_n[None, :]
    if GATED:
        out = _act(acc_a, 0) * acc_b
        tl.store(dest, out.to(DEST.dtype.element_ty), mask=mask)
        _signal(SYNC, signal_idx, THREADS, FENCED_SYNC)
    else:
        last, total = _merge_slices(acc_a, WS_PART + (col * SPLIT_K).to(tl.int64) * (BLOCK_B * BLOCK_N), split,
                                    offs_b[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], SPLIT_K,
                                    BLOCK_B * BLOCK_N, SYNC, merge_idx, epoch, spin_limit, THREADS, FENCED_SYNC)
        if last:
            res = tl.load(RES + offs_b[:, None] * stride_res + offs_n[None, :], mask=mask, other=0.0,
                          cache_modifier=".cg")
            h = res.to(tl.float32) + total
            tl.store(dest, h.to(DEST.dtype.element_ty), mask=mask)
            if FOLD_OUT:
                _fold_out(h, HB, WS_SS, col, offs_b, offs_n, mask, N, BLOCK_B)
            _signal(SYNC, signal_idx, THREADS, FENCED_SYNC, signal2_idx)


# ------------------------------------------------------------------------------------------
# the persistent kernel
# ------------------------------------------------------------------------------------------


@triton.jit
def decode_layer_kernel(
    X, OUT, TASKS, SYNC, CACHE_SEQLENS, BT, COS, SIN,
    W_QKV, W_O, W_GU, W_DOWN, G_ATTN, G_FFN,
    KC, VC, XN, QWS, ATT, H1, HN, ACT, WS_ACC, WS_ML, WS_PART, WS_QKV, RSTD, WS_SS, TRACE_BUF, LAYER_TABLE, XWS,
    batch, hidden, inter, num_tasks, num_programs, merge_off, h1_idx, h1_count, col_merge_off, qkv_merge_off,
    layer_words, done_idx, x_ready_idx, spin_limit,
    stride_x, stride_out, sk0, sk1, sk2, sv0, sv1, sv2, stride_bt,
    stride_wqkv, stride_wo, stride_wgu, stride_wd,
    eps, qk_scale_log2,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, QKV_PAIRS: tl.constexpr,
    QKV_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KV: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_K: tl.constexpr,
    PAGE_SIZE: tl.constexpr, LAYOUT: tl.constexpr, THREADS: tl.constexpr, GEMV_STAGES: tl.constexpr, STAGGER: tl.constexpr,
    NORM_BLOCK: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, TRACE: tl.constexpr = False,
    FENCED_SYNC: tl.constexpr = False, FOLDED: tl.constexpr = False, COLS_PAD: tl.constexpr = 1,
    NUM_LAYERS: tl.constexpr = 1, X_SLICES: tl.constexpr = 0,
):
    """One decode step of a decoder layer: the task table's tasks by ticket (module docstring).

    Tiling: every GEMV task multiplies a tile of weight rows (the tensor-core dot's left
    operand, ``ROWS`` ≥ 64) by the ``BLOCK_B`` ≥ 16 activation rows, K chunk by K chunk: QKV
    tasks of ``QKV_PAIRS`` rotary pairs (2·QKV_PAIRS interleaved rows), O / down tasks of
    ``BLOCK_N`` output columns, gate/up tasks of ``BLOCK_I`` columns (gate and up rows
    interleaved). Attention tasks of (sequence, KV head, split) with GQA packing (``BLOCK_R`` ≥
    16 rows of the group's query heads, ``BLOCK_KV`` keys a tile). Norm tasks write one row of
    ``XN = rmsnorm(x)`` or ``HN = rmsnorm(h)`` (``NORM_BLOCK`` values a step). Caches: LAYOUT 0
    contiguous ``(batch, capacity, kv_heads, d)``, 1 paged ``(blocks, PAGE_SIZE, kv_heads, d)``
    through BT. ``h1_idx``/``h1_count``: the O projection's counter, which the down stage also
    acquires (it reads h besides act); ``h1_count`` is also the number of O / down column
    blocks. ``SPLIT_K``: K slices per O / down column block (:func:`_columns_task`), their
    partials in ``WS_PART``, their arrivals on the counters from ``col_merge_off`` (O's column
    blocks, then down's). ``QKV_SPLIT``: K slices per QKV tile, their partials in ``WS_QKV``,
    their arrivals on the counters from ``qkv_merge_off`` (one a tile). Workspaces: XN, ATT, HN and ACT (the GEMVs' activations) in x's
    dtype, q, h and the partials in fp32; OUT in x's dtype. TRACE: each ticket's
    ``(start ns, end ns, SM, stage, ready ns)`` into ``TRACE_BUF`` (int64, ``TRACE_WORDS`` a
    task; ready: when its wait on its inputs passed, the start for a task that does not wait
    before its work; GPU only).

    ``NUM_LAYERS`` > 1: the table holds that many layers (a row's last word its layer); the
    tensor arguments are layer 0's and ``LAYER_TABLE`` holds every layer's distances from them
    (:data:`LAYER_PTR_KINDS`, :func:`_layer_ptr`); a layer's counters lie ``layer ·
    layer_words`` further; layer 0 reads X, the last layer writes OUT and the others write (and
    the next read) their row block of XWS (``batch · hidden`` values each, x's dtype); with
    FOLDED, a later layer's QKV tasks wait on the layer before's down counter (``done_idx``),
    or with ``X_SLICES`` (= QKV_SPLIT) on the counter of their K slice of x (``x_ready_idx`` +
    slice), which each down column block bumps besides ``done_idx``.
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
        ready = TRACE_BUF + t * _TRACE_WORDS + 4   # when the task's wait passed (TRACE)
        if NUM_LAYERS > 1:   # this task's layer: its weights, caches, x, out and counters
            layer = tl.load(row + 7)
            cbase = layer * layer_words
            lp = LAYER_TABLE + layer * _LAYER_PTRS
            w_qkv = _layer_ptr(lp, 0, W_QKV)
            w_o = _layer_ptr(lp, 1, W_O)
            w_gu = _layer_ptr(lp, 2, W_GU)
            w_down = _layer_ptr(lp, 3, W_DOWN)
            g_attn = _layer_ptr(lp, 4, G_ATTN)
            g_ffn = _layer_ptr(lp, 5, G_FFN)
            kc = _layer_ptr(lp, 6, KC)
            vc = _layer_ptr(lp, 7, VC)
            bt = _layer_ptr(lp, 8, BT)
            x_l = X   # layer 0 reads the call's x, the last writes its out, the others XWS
            if layer > 0:
                x_l = XWS + (layer - 1) * batch * hidden
            out_l = OUT
            if layer < NUM_LAYERS - 1:
                out_l = XWS + layer * batch * hidden
            # folded QKV of a layer after the first: its dot waits on the layer before's out
            pre_epochs = (epoch + 1) * tl.minimum(layer, 1) if FOLDED else 0
        else:
            cbase = 0
            w_qkv, w_o, w_gu, w_down, g_attn, g_ffn = W_QKV, W_O, W_GU, W_DOWN, G_ATTN, G_FFN
            kc, vc, bt, x_l, out_l = KC, VC, BT, X, OUT
            pre_epochs = 0
        if TRACE:
            t_start = globaltimer()
        if stage == _QKV:
            _qkv_task(SYNC, x_l, stride_x, XN, RSTD, w_qkv, stride_wqkv, QWS, kc, vc, bt, CACHE_SEQLENS, COS, SIN,
                      WS_QKV,
                      sk0, sk1, sk2, sv0, sv1, sv2, stride_bt, a, b, c, batch, hidden,
                      wait_idx, wait_target, signal_idx, cbase + qkv_merge_off + a * (HEAD_DIM // 2 // QKV_PAIRS) + b,
                      epoch,
                      spin_limit, HEADS, KV_HEADS, HEAD_DIM, QKV_PAIRS, QKV_SPLIT, BLOCK_B, BLOCK_K, PAGE_SIZE, LAYOUT,
                      GEMV_STAGES, STAGGER, THREADS, DOT_FP32, DOT_PRECISION, FENCED_SYNC, FOLDED, ready, TRACE,
                      cbase - layer_words + (x_ready_idx if X_SLICES else done_idx), pre_epochs, h1_count,
                      X_SLICES, BLOCK_N)
        elif stage == _ATTN:
            _attn_task(SYNC, QWS, kc, vc, bt, CACHE_SEQLENS, ATT, WS_ACC, WS_ML, a, b, c, epoch,
                       wait_idx, wait_target, signal_idx, cbase + merge_off, spin_limit,
                       sk0, sk1, sk2, sv0, sv1, sv2, stride_bt, qk_scale_log2,
                       HEADS, KV_HEADS, HEAD_DIM, BLOCK_R, BLOCK_KV, NUM_SPLITS, PAGE_SIZE, LAYOUT,
                       THREADS, DOT_FP32, DOT_PRECISION, FENCED_SYNC, ready, TRACE)
        elif stage == _OPROJ:
            _columns_task(SYNC, ATT, HEADS * HEAD_DIM, w_o, stride_wo, x_l, stride_x, H1, hidden,
                          a, b, HEADS * HEAD_DIM, hidden, batch, wait_idx, wait_target, signal_idx, spin_limit,
                          WS_PART, cbase + col_merge_off + a, epoch, HN, WS_SS, h1_count, eps,
                          False, SPLIT_K, BLOCK_B, BLOCK_N, BLOCK_K, GEMV_STAGES, STAGGER, THREADS,
                          DOT_FP32, DOT_PRECISION, FENCED_SYNC, FOLDED, False, COLS_PAD, ready, TRACE)
        elif stage == _GATEUP:
            _columns_task(SYNC, HN, hidden, w_gu, stride_wgu, H1, hidden, ACT, inter,
                          a, 0, hidden, inter, batch, wait_idx, wait_target, signal_idx, spin_limit,
                          WS_PART, 0, epoch, HN, WS_SS, h1_count, eps,
                          True, 1, BLOCK_B, BLOCK_I, BLOCK_K, GEMV_STAGES, STAGGER, THREADS,
                          DOT_FP32, DOT_PRECISION, FENCED_SYNC, False, FOLDED, COLS_PAD, ready, TRACE)
        elif stage == _DOWN:
            # h (the residual) is read besides act: acquire its counter too (already complete)
            _wait(SYNC, cbase + h1_idx, (epoch + 1) * h1_count, spin_limit, THREADS, FENCED_SYNC)
            x_part = -1   # X_SLICES: the K slice of the next layer's x these columns lie in
            if X_SLICES:
                x_part = cbase + x_ready_idx + a * BLOCK_N // _k_slice(hidden, 1, QKV_SPLIT, BLOCK_K)[0]
            _columns_task(SYNC, ACT, inter, w_down, stride_wd, H1, hidden, out_l, stride_out,
                          a, b, inter, hidden, batch, wait_idx, wait_target, signal_idx, spin_limit,
                          WS_PART, cbase + col_merge_off + h1_count + a, epoch, HN, WS_SS, h1_count, eps,
                          False, SPLIT_K, BLOCK_B, BLOCK_N, BLOCK_K, GEMV_STAGES, STAGGER, THREADS,
                          DOT_FP32, DOT_PRECISION, FENCED_SYNC, False, False, 1, ready, TRACE, x_part)
        else:   # a norm row: a = 0, x's attention norm into XN; a = 1, h's FFN norm into HN
            _wait_ready(SYNC, wait_idx, wait_target, spin_limit, THREADS, FENCED_SYNC, ready, TRACE)
            if FOLDED:   # only x's: 1 / rms per row (the QKV tasks scale by it)
                _rstd_task(x_l, stride_x, RSTD, b, hidden, eps, NORM_BLOCK)
            elif a == 0:
                _norm_task(x_l, stride_x, g_attn, XN, b, hidden, eps, NORM_BLOCK)
            else:
                _norm_task(H1, hidden, g_ffn, HN, b, hidden, eps, NORM_BLOCK)
            _signal(SYNC, signal_idx, THREADS, FENCED_SYNC)
        if TRACE:
            tl.store(TRACE_BUF + t * _TRACE_WORDS, t_start)
            tl.store(TRACE_BUF + t * _TRACE_WORDS + 1, globaltimer())
            tl.store(TRACE_BUF + t * _TRACE_WORDS + 2, smid().to(tl.int64))
            tl.store(TRACE_BUF + t * _TRACE_WORDS + 3, stage.to(tl.int64))
        t = tl.atomic_add(SYNC + _TICKET, 1, sem="relaxed", scope="gpu") - base


# --------------------------------------------------------------------------------------------
# the task table: the kernel's contract, built on the host (as tile_order.py's ticket orders
# are for the fused FFN)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counters:
    """Word offsets of the counters in the int64 SYNC buffer (after :mod:`flashflow.kernels.sync`'s
    fixed words): QKV tiles per KV head, split arrivals per (sequence, KV head), the attention
    results per O K slice (``parts`` words from ``o_ready``), O column blocks, gate/up tiles per
    down K slice (``parts`` words from ``act_ready``), down column blocks, rows of XN, rows of
    HN, then the K slices' arrivals per O column block and per down column block (``columns``
    each), then per QKV tile (``qkv_tiles``), then the down column blocks per K slice of the
    next layer's x (``x_parts``: :func:`x_slices`)."""
    attn_ready: int
    merge: int
    o_ready: int
    h1_ready: int
    act_ready: int
    done: int
    xn_ready: int
    hn_ready: int
    col_merge: int
    qkv_merge: int
    x_ready: int
    words: int


def counters(config, batch: int, columns: int = 0, parts: int = 1, qkv_tiles: int = 0,
             x_parts: int = 0) -> Counters:
    """The counters of a layer at ``batch`` rows; ``columns``: the O / down column blocks whose
    K slices arrive on counters of their own (0 without split-K); ``parts``: the K slices of
    the O and down projections (their inputs counted per slice); ``qkv_tiles``: the QKV tiles
    whose K slices arrive on counters of their own (0 without); ``x_parts``: the K slices of
    the next layer's x whose down column blocks are counted on counters of their own (0
    without, :func:`x_slices`)."""
    hk = config.kv_heads
    o = CNT_OFF + hk + batch * hk
    act = o + parts + 1
    base = act + parts
    qkv = base + 3 + 2 * columns
    return Counters(CNT_OFF, CNT_OFF + hk, o, o + parts, act, base, base + 1, base + 2, base + 3, qkv,
                    qkv + qkv_tiles, qkv + qkv_tiles + x_parts)


def qkv_tiles(config, tiles) -> int:
    """The QKV tiles of a layer: ``QKV_PAIRS`` rotary pairs of one q, k or v head each."""
    return (config.heads + 2 * config.kv_heads) * (config.head_dim // 2 // tiles.QKV_PAIRS)


def x_slices(config, tiles, folded: bool, layers: int) -> int:
    """The K slices of x on whose own down column blocks a later layer's QKV slices wait (0:
    every slice waits on the whole down projection): ``QKV_SPLIT`` in a multi-layer launch with
    folded norms (whose QKV dot reads x before any norm row) when each slice holds whole
    ``BLOCK_N`` column blocks, so that a slice's dot starts once its columns are stored."""
    qs, width = k_slices(config.hidden, tiles, qkv_split(tiles))
    return qs if folded and layers > 1 and qs > 1 and width % tiles.BLOCK_N == 0 else 0


def qkv_split(tiles) -> int:
    """K slices per QKV tile (``tiles.QKV_SPLIT``; 1 for tiles without the field)."""
    return getattr(tiles, "QKV_SPLIT", 1)


def k_slices(k: int, tiles, slices: int | None = None) -> tuple[int, int]:
    """``(slices, width)``: the K slices over a K of ``k`` (whole ``BLOCK_K`` chunks each; the
    last ones may be short or empty, as the kernel's ``_k_slice`` cuts them) and their width;
    ``slices``: an O / down column block's (``SPLIT_K``) unless given."""
    sk = split_k(tiles) if slices is None else slices
    return sk, cdiv(cdiv(k, sk), tiles.BLOCK_K) * tiles.BLOCK_K


def _parts(k: int, unit: int, tiles) -> tuple[int, int]:
    """``(slices, width)`` of the O / down K slices when each producer tile (``unit`` columns of
    the activation) lies inside one slice, so that a slice waits only on its own producers;
    ``(1, k)`` otherwise (every slice waits on every producer)."""
    sk, width = k_slices(k, tiles)
    return (sk, width) if sk > 1 and width % unit == 0 else (1, k)


def split_k(tiles) -> int:
    """K slices per O / down column block (``tiles.SPLIT_K``; 1 for tiles without the field)."""
    return getattr(tiles, "SPLIT_K", 1)


def build_tasks(config, batch: int, num_splits: int, tiles,
                shuffle=None, folded: bool = False, layers: int = 1) -> list[tuple]:
    """The task rows ``(stage, a, b, c, wait_idx, wait_count, signal_idx, 0)`` in ticket order:
    the rows of XN (``(NORM, 0, row)``), QKV tiles (``(head, pair block, K slice)``, by KV group:
    its query heads, its key head, its value head; a tile's slices side by side), attention tasks, O-projection tiles, the rows of HN (``(NORM, 1, row)``),
    gate/up and down tiles (O and down: ``(column block, K slice)``, slice by slice). With K
    slices whose producers each lie inside one slice (:func:`_parts`), an O slice waits only on
    its KV heads' attention and a down slice only on its gate/up tiles. ``folded`` (the norm
    weights folded into the QKV and gate/up weights): the norm rows of x give 1 / rms only, and
    there are no norm rows of h (a gate/up task waits on every O column block). ``shuffle`` (a
    seed): a random topological order instead, for tests (the outputs do not depend on the
    order).

    ``layers`` > 1 (a multi-layer launch): the table of one layer once per layer, in layer
    order, each copy's counters ``counters(...).words − CNT_OFF`` words after the one before and
    its layer in the row's last word; the rows of x of a layer after the first wait on every
    column block of the layer before's down projection (its out is their x)."""
    tasks = _layer_tasks(config, batch, num_splits, tiles, folded)
    if layers > 1:
        cnt = counters(config, batch, cdiv(config.hidden, tiles.BLOCK_N), split_k(tiles), qkv_tiles(config, tiles),
                       x_slices(config, tiles, folded, layers))
        words = cnt.words - CNT_OFF
        one, tasks = tasks, []
        for layer in range(layers):
            shift = layer * words
            for t in one:
                wait = (t[4] + shift, t[5])
                if t[0] == NORM and t[1] == 0 and layer > 0:
                    wait = (cnt.done + shift - words, cdiv(config.hidden, tiles.BLOCK_N))
                tasks.append((t[0], t[1], t[2], t[3], *wait, t[6] + shift, layer))
    if shuffle is not None:
        tasks = _random_topological(tasks, num_splits, random.Random(shuffle))
    return tasks


def _layer_tasks(config, batch: int, num_splits: int, tiles, folded: bool) -> list[tuple]:
    """One layer's task rows in ticket order (:func:`build_tasks`)."""
    c = config
    sk = split_k(tiles)
    group = c.heads // c.kv_heads
    d = c.head_dim
    per_head = d // 2 // tiles.QKV_PAIRS
    n_o, n_gu = cdiv(c.hidden, tiles.BLOCK_N), cdiv(c.intermediate, tiles.BLOCK_I)
    # an O slice waits on the attention of the KV heads whose query heads it reads, a down
    # slice on the gate/up tiles of its columns (when those lie inside one slice)
    o_parts, o_width = _parts(c.heads * d, group * d, tiles)
    d_parts, d_width = _parts(c.intermediate, tiles.BLOCK_I, tiles)
    cnt = counters(config, batch, n_o, sk, qkv_tiles(config, tiles))
    o_part = [kvh * group * d // o_width for kvh in range(c.kv_heads)]
    gu_part = [j * tiles.BLOCK_I // d_width for j in range(n_gu)]
    tasks = [(NORM, 0, b, 0, cnt.xn_ready, 0, cnt.xn_ready, 0) for b in range(batch)]
    for kvh in range(c.kv_heads):
        heads = [kvh * group + i for i in range(group)] + [c.heads + kvh, c.heads + c.kv_heads + kvh]
        tasks += [(QKV, h, p, s, cnt.xn_ready, batch, cnt.attn_ready + kvh, 0)
                  for h in heads for p in range(per_head) for s in range(qkv_split(tiles))]
    for kvh in range(c.kv_heads):
        tasks += [(ATTN, b, kvh, s, cnt.attn_ready + kvh, (group + 2) * per_head, cnt.o_ready + o_part[kvh], 0)
                  for b in range(batch) for s in range(num_splits)]
    # O and down tiles slice by slice: the first slices' inputs are complete first
    for s in range(sk):
        p = s if o_parts > 1 else 0
        tasks += [(OPROJ, j, s, 0, cnt.o_ready + p, batch * o_part.count(p), cnt.h1_ready, 0) for j in range(n_o)]
    if folded:
        tasks += [(GATEUP, j, 0, 0, cnt.h1_ready, n_o, cnt.act_ready + gu_part[j], 0) for j in range(n_gu)]
    else:
        tasks += [(NORM, 1, b, 0, cnt.h1_ready, n_o, cnt.hn_ready, 0) for b in range(batch)]
        tasks += [(GATEUP, j, 0, 0, cnt.hn_ready, batch, cnt.act_ready + gu_part[j], 0) for j in range(n_gu)]
    for s in range(sk):
        p = s if d_parts > 1 else 0
        tasks += [(DOWN, j, s, 0, cnt.act_ready + p, gu_part.count(p), cnt.done, 0) for j in range(n_o)]
    return tasks


def _merged(t) -> tuple | None:
    """What a task's partial merges into: an attention task's (sequence, KV head), a QKV K
    slice's tile, an O / down K slice's column block; None for a task that signals alone."""
    if t[0] in (ATTN, QKV):
        return (t[0], t[1], t[2], t[7])
    if t[0] in (OPROJ, DOWN):
        return (t[0], t[1], t[7])
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
