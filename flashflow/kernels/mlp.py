"""Transformer FFN kernels: ``out = act(x·W_gateᵀ) ∘ (x·W_upᵀ) · W_downᵀ`` (SwiGLU) or
``out = act(x·W1ᵀ) · W_downᵀ`` (GELU/SiLU/ReLU), weights in ``nn.Linear`` layout.

Notation: M tokens, ``hidden`` (GEMM0's K, GEMM1's N), ``inter`` (GEMM0's N, GEMM1's K), e the
element size. Weight bytes W = (2 if gated else 1)·inter·hidden·e + hidden·inter·e (Llama-3-8B:
352 MB); FLOPs 2·M·W/e.

Two regimes (:mod:`flashflow.ops.mlp` picks): decode, M ≤ 64, lives in
:mod:`flashflow.kernels.mlp_splitk` (weights stream once, the intermediate stays on chip). This
module holds the prefill regime: ``mlp_persistent_kernel`` runs GEMM0 and GEMM1 as ticketed
tiles of one persistent launch, in an order of :mod:`flashflow.kernels.tile_order`,
synchronised by per-row-block counters, and the producer/consumer words both regimes share.
Its tiles load their operands either through host-built TMA descriptors (USE_TMA, sm90+) or
through masked pointer loads (older GPUs, fp32, unaligned strides, and the interpreter's tests).

Baselines for the bench share the tile code: ``mlp_gemm0_kernel`` / ``mlp_gemm1_kernel`` (two
kernels in sequence, or a CuSync-style producer/consumer pair on two streams with flags).

Synchronisation: :mod:`flashflow.kernels.sync` (the ``SYNC`` buffer's words, the producer /
consumer protocol and its memory-ordering argument, the last program's reset).
"""
import triton
import triton.language as tl

from flashflow.kernels.activation import gelu_tanh
from flashflow.kernels.sync import _CNT_OFF, _TICKET, _last_out_resets, _proxy_fence, _signal, _wait
from flashflow.kernels.tile_order import _HALFROW, _SEQSPLIT, grouped_tile, ticket_to_tile

# activations the kernels compute (`_act`'s codes; SwiGLU's gate is SiLU)
ACTIVATIONS = ("swiglu", "gelu", "silu", "relu")
ACTIVATION_CODE = {"swiglu": 0, "silu": 0, "gelu": 1, "relu": 2}


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


@triton.jit
def _act(a, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:  # silu (SwiGLU's gate too); inf-safe: a / (1 + e^-a)
        return a / (1.0 + tl.exp(-a))
    elif ACTIVATION == 1:  # gelu, tanh form
        return gelu_tanh(a)
    else:  # relu
        return tl.maximum(a, 0.0)


@triton.jit
def _gemm0_tile(X, W1, H, XD, WGD, WUD, r, j, M, hidden, inter, stride_xm, stride_w1, stride_hm,
                BLOCK_M: tl.constexpr, BLOCK_N0: tl.constexpr, BLOCK_K: tl.constexpr,
                GATED: tl.constexpr, ACTIVATION: tl.constexpr, DOT_PRECISION: tl.constexpr,
                USE_TMA: tl.constexpr):
    """H[r-block, j-block] = act(x·W_gateᵀ) ∘ (x·W_upᵀ) (or act(x·W1ᵀ)), rounded to H's dtype.

    Reads BLOCK_M·hidden of x and (2 if gated else 1)·BLOCK_N0·hidden of W1; writes
    BLOCK_M·BLOCK_N0 of H. Gate row i and up row i + inter are two loads and two dots. With
    USE_TMA the operands come through host-built descriptors (XD over x, WGD over the gate
    rows, WUD over the up rows): the copy engine zero-fills what lies outside each tensor, so no
    masks, and a gate tile past ``inter`` cannot read up rows. H is stored with ordinary stores
    either way: its consumers synchronise through generic-proxy atomics."""
    offs_m = r * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = j * BLOCK_N0 + tl.arange(0, BLOCK_N0)
    m_ok = offs_m < M
    n_ok = offs_n < inter
    acc_g = tl.zeros([BLOCK_M, BLOCK_N0], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N0], dtype=tl.float32)
    if USE_TMA:
        row_x = r * BLOCK_M
        row_w = j * BLOCK_N0
        for k0 in range(0, hidden, BLOCK_K):
            x = XD.load([row_x, k0])
            wg = WGD.load([row_w, k0])
            acc_g = tl.dot(x, wg.T, acc_g, input_precision=DOT_PRECISION)
            if GATED:
                wu = WUD.load([row_w, k0])
                acc_u = tl.dot(x, wu.T, acc_u, input_precision=DOT_PRECISION)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        wg_ptrs = W1 + offs_n[:, None].to(tl.int64) * stride_w1 + offs_k[None, :]
        wu_ptrs = wg_ptrs + inter.to(tl.int64) * stride_w1
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = offs_k < hidden - k0
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_g = tl.dot(x, wg.T, acc_g, input_precision=DOT_PRECISION)
            if GATED:
                wu = tl.load(wu_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                acc_u = tl.dot(x, wu.T, acc_u, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K
            wu_ptrs += BLOCK_K
    if GATED:
        h = _act(acc_g, ACTIVATION) * acc_u
    else:
        h = _act(acc_g, ACTIVATION)
    h_ptrs = H + offs_m[:, None].to(tl.int64) * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h.to(H.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemm1_tile(H, W2, HD, W2D, r, c, k_lo, k_hi, M, hidden, stride_hm, stride_w2,
                BLOCK_M: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """fp32 (BLOCK_M, BLOCK_N1) = H[r-block, k_lo:k_hi]·W_down[c-block, k_lo:k_hi]ᵀ (HD, W2D:
    descriptors over H and W_down with USE_TMA; ``k_lo`` is a multiple of BLOCK_K)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N1], dtype=tl.float32)
    if USE_TMA:
        row_h = r * BLOCK_M
        row_w = c * BLOCK_N1
        for k0 in range(k_lo, k_hi, BLOCK_K):
            hh = HD.load([row_h, k0])
            w = W2D.load([row_w, k0])
            acc = tl.dot(hh, w.T, acc, input_precision=DOT_PRECISION)
    else:
        offs_m = r * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = c * BLOCK_N1 + tl.arange(0, BLOCK_N1)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < hidden
        h_ptrs = H + offs_m[:, None].to(tl.int64) * stride_hm + (k_lo + offs_k)[None, :]
        w_ptrs = W2 + offs_n[:, None].to(tl.int64) * stride_w2 + (k_lo + offs_k)[None, :]
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = offs_k < k_hi - k0
            hh = tl.load(h_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(hh, w.T, acc, input_precision=DOT_PRECISION)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    return acc


@triton.jit
def _store_tile(OUT, acc, r, c, M, N, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = r * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = c * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(ptrs, acc.to(OUT.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


# ------------------------------------------------------------------------------------------
# prefill regime: one persistent launch, ticketed GEMM0 and GEMM1 tiles
# ------------------------------------------------------------------------------------------


@triton.jit
def mlp_persistent_kernel(
    X, W1, W2, H, OUT, PART, SYNC, XD, WGD, WUD, HD, W2D,
    M, hidden, inter,
    stride_xm, stride_w1, stride_w2, stride_hm, stride_om,
    tiles_m, n0, n1, group_rows, half, flag_off, spin_limit,
    POLICY: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N0: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, ACTIVATION: tl.constexpr, THREADS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, PROXY_FENCE: tl.constexpr,
):
    """Prefill FFN: GEMM0 and GEMM1 as tiles of one persistent launch.

    Tiling: GEMM0 tiles (BLOCK_M × BLOCK_N0 of the intermediate H, gate and up both when gated),
    GEMM1 tiles (BLOCK_M × BLOCK_N1 of the output, K = the intermediate). A program loops:
    take ticket t = atomic_add(SYNC[0], 1); stop when t ≥ total; map t to a tile with
    ``ticket_to_tile(POLICY)``; run it:

    * GEMM0 tile (r, j): H[r, j] = act(...) (H is M × inter in device memory, mostly L2 hits
      for its consumers), then ``_signal`` on the row-block counter SYNC[CNT_OFF + 2r + part].
    * GEMM1 tile (r, c[, part]): ``_wait`` until the row-block counter holds every GEMM0 tile
      of its K range (the whole row, or halfrow's / seqsplit's half), then stream H[r, K-range]
      and W_down[c, K-range]. Halfrow, seqsplit: part 0 stores fp32 partials to PART and
      signals flag (r, c); part 1 waits on that flag, adds the partials and stores OUT.

    Loads: with USE_TMA, x, the gate rows, the up rows, H and W_down come through host-built
    descriptors (XD, WGD, WUD, HD, W2D; block shapes BLOCK_M/BLOCK_N0/BLOCK_N1 × BLOCK_K): the
    copy engine zero-fills outside each tensor, so the loop carries no masks and no pointer
    tensors, and the pipeliner keeps num_stages TMA copies in flight. Otherwise masked pointer
    loads (cp.async). H (GEMM0's output) and OUT are always stored with ordinary stores.
    PROXY_FENCE (TMA on a GPU; the interpreter has no PTX) fences each GEMM1 wait.
    H100 config (sm90, Llama-3-8B): 128×128 GEMM0 tiles, two accumulators, and 128×256 GEMM1
    tiles, 3 stages, 8 warps: 255 registers, no spills, 144 KiB of shared memory.

    Deadlock freedom: tickets are taken in increasing order and every tile a ticket waits on
    has a smaller ticket, so it was taken by a program that is already running and that
    itself waits only on smaller tickets — by induction the smallest unfinished ticket always
    makes progress, whatever the number of programs or SMs, co-resident or not (the op keeps
    the grid ≤ SMs × occupancy only so that no program idles waiting for an SM). In Triton's
    interpreter, where programs run one after another, program 0 runs every tile in ticket
    order and never waits.

    Bytes: x, W_gate_up, W_down once if every GEMM's operands stayed in L2; in practice each
    row-group of GEMM0 re-streams W_gate_up and each row-group of GEMM1 re-streams W_down
    (``group_rows`` row-blocks share one pass), plus H written once and read once per GEMM1
    column-block (L2), halfrow's / seqsplit's fp32 partials (2·M·hidden·4 bytes). FLOPs 2·M·W/e.
    """
    if (POLICY == _HALFROW) or (POLICY == _SEQSPLIT):
        total = tiles_m * (n0 + 2 * n1)
    else:
        total = tiles_m * (n0 + n1)
    t = tl.atomic_add(SYNC + _TICKET, 1, sem="relaxed", scope="gpu")
    while t < total:
        kind, r, j, part = ticket_to_tile(t, tiles_m, n0, n1, group_rows, half, POLICY)
        cnt = _CNT_OFF + 2 * r + part
        if kind == 0:
            _gemm0_tile(X, W1, H, XD, WGD, WUD, r, j, M, hidden, inter, stride_xm, stride_w1, stride_hm,
                        BLOCK_M, BLOCK_N0, BLOCK_K, GATED, ACTIVATION, DOT_PRECISION, USE_TMA)
            _signal(SYNC, cnt, THREADS)
        else:
            if (POLICY == _HALFROW) or (POLICY == _SEQSPLIT):
                k_split = tl.minimum(half * BLOCK_N0, inter)
                k_lo = tl.where(part == 0, 0, k_split)
                k_hi = tl.where(part == 0, k_split, inter)
                expected = tl.where(part == 0, half, n0 - half)
            else:
                k_lo = 0
                k_hi = inter
                expected = n0
            _wait(SYNC, cnt, expected, spin_limit, THREADS)
            if PROXY_FENCE:
                _proxy_fence()
            acc = _gemm1_tile(H, W2, HD, W2D, r, j, k_lo, k_hi, M, hidden, stride_hm, stride_w2,
                              BLOCK_M, BLOCK_N1, BLOCK_K, DOT_PRECISION, USE_TMA)
            if (POLICY == _HALFROW) or (POLICY == _SEQSPLIT):
                offs_m = r * BLOCK_M + tl.arange(0, BLOCK_M)
                offs_n = j * BLOCK_N1 + tl.arange(0, BLOCK_N1)
                p_ptrs = PART + offs_m[:, None].to(tl.int64) * hidden + offs_n[None, :]
                p_mask = (offs_m < M)[:, None] & (offs_n < hidden)[None, :]
                flag = flag_off + r * n1 + j
                if part == 0:
                    tl.store(p_ptrs, acc, mask=p_mask)
                    _signal(SYNC, flag, THREADS)
                else:
                    _wait(SYNC, flag, 1, spin_limit, THREADS)
                    acc += tl.load(p_ptrs, mask=p_mask, other=0.0, cache_modifier=".cg")
                    _store_tile(OUT, acc, r, j, M, hidden, stride_om, BLOCK_M, BLOCK_N1)
            else:
                _store_tile(OUT, acc, r, j, M, hidden, stride_om, BLOCK_M, BLOCK_N1)
        t = tl.atomic_add(SYNC + _TICKET, 1, sem="relaxed", scope="gpu")

    # the last program out resets the counters for the next launch
    if (POLICY == _HALFROW) or (POLICY == _SEQSPLIT):
        _last_out_resets(SYNC, _CNT_OFF, flag_off - _CNT_OFF + tiles_m * n1, THREADS)
    else:
        _last_out_resets(SYNC, _CNT_OFF, 2 * tiles_m, THREADS)


# ------------------------------------------------------------------------------------------
# baselines: two kernels in sequence, or a producer/consumer pair on two streams
# ------------------------------------------------------------------------------------------


@triton.jit
def mlp_gemm0_kernel(
    X, W1, H, SYNC,
    M, hidden, inter, stride_xm, stride_w1, stride_hm,
    tiles_m, n0, group_rows,
    SIGNAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N0: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, ACTIVATION: tl.constexpr, THREADS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """GEMM0 + activation alone: one program per tile, grouped order (``group_rows``
    row-blocks, column-major inside). With SIGNAL, each tile also bumps its row-block's counter
    (the producer of the two-stream baseline). Bytes: as GEMM0 in the persistent kernel."""
    r, j = grouped_tile(tl.program_id(0), tiles_m, n0, group_rows)
    _gemm0_tile(X, W1, H, None, None, None, r, j, M, hidden, inter, stride_xm, stride_w1, stride_hm,
                BLOCK_M, BLOCK_N0, BLOCK_K, GATED, ACTIVATION, DOT_PRECISION, False)
    if SIGNAL:
        _signal(SYNC, _CNT_OFF + 2 * r, THREADS)


@triton.jit
def mlp_gemm1_kernel(
    H, W2, OUT, SYNC,
    M, hidden, inter, stride_hm, stride_w2, stride_om,
    tiles_m, n0, n1, group_rows, spin_limit,
    WAIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K: tl.constexpr,
    THREADS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """GEMM1 alone. Without WAIT: one program per tile, grouped order. With WAIT (the consumer
    of the two-stream baseline): persistent, tiles by ticket in grouped order, each waits for
    its row-block's n0 GEMM0 tiles; the last program resets the counters. The op launches at
    most SMs − 16 consumer programs, so the producer always has SMs to finish on (CuSync
    instead orders the two kernels' starts with a wait kernel)."""
    if WAIT:
        total = tiles_m * n1
        t = tl.atomic_add(SYNC + _TICKET, 1, sem="relaxed", scope="gpu")
        while t < total:
            r, c = grouped_tile(t, tiles_m, n1, group_rows)
            _wait(SYNC, _CNT_OFF + 2 * r, n0, spin_limit, THREADS)
            acc = _gemm1_tile(H, W2, None, None, r, c, 0, inter, M, hidden, stride_hm, stride_w2,
                              BLOCK_M, BLOCK_N1, BLOCK_K, DOT_PRECISION, False)
            _store_tile(OUT, acc, r, c, M, hidden, stride_om, BLOCK_M, BLOCK_N1)
            t = tl.atomic_add(SYNC + _TICKET, 1, sem="relaxed", scope="gpu")
        _last_out_resets(SYNC, _CNT_OFF, 2 * tiles_m, THREADS)
    else:
        r, c = grouped_tile(tl.program_id(0), tiles_m, n1, group_rows)
        acc = _gemm1_tile(H, W2, None, None, r, c, 0, inter, M, hidden, stride_hm, stride_w2,
                          BLOCK_M, BLOCK_N1, BLOCK_K, DOT_PRECISION, False)
        _store_tile(OUT, acc, r, c, M, hidden, stride_om, BLOCK_M, BLOCK_N1)
