"""FP8 flash attention forward for Hopper (sm90) written in Gluon, Triton's warp-level dialect.

The same attention as :func:`flashflow.kernels.attention_fp8.attention_fp8_fwd_kernel`, on the
same buffers of the quantize pass (:func:`flashflow.kernels.quant.attention_quantize_kernel`) and
with the same arithmetic, step for step: INT8 (or e4m3 with ``QK_FP8``) ``S = Q8 · K8ᵀ`` with
one scale per query token and one per key block of ``BLOCK_N`` keys; ``P = 2^(S − m) · 448`` in
e4m3; ``acc = acc · α + P8 · V8`` with V e4m3, transposed ``(head_dim, keys)``, one scale per
channel; output ``acc · v_scale / l`` in the output's dtype (and the log-sum-exp with
``RETURN_LSE``). The hot case it is written for: no causal mask, no key-padding mask.

What Gluon adds over the portable kernel is the schedule, written out instead of left to
Triton's pipeliner:

* K and Vᵀ blocks arrive by TMA in two rings of ``NUM_STAGES`` shared buffers, each buffer with
  its own mbarrier (expect-tx bytes, a phase bit per pass over the ring); Q arrives once. A K
  buffer is refilled as soon as the Q·Kᵀ reading it has finished, a Vᵀ buffer as soon as its
  P·V has, so each load is issued a whole key block (or more) ahead of its use.
* Both products are asynchronous WGMMAs, overlapped inside one warpgroup as in FlashAttention-3:
  block j's ``S_j = Q · K_jᵀ`` is issued, then block j−1's ``acc = acc · α + P_{j−1} · V_{j−1}``,
  and the softmax of ``S_j`` runs while that P·V is still on the tensor cores (its wait comes
  after the softmax).
* P never leaves registers: the e4m3 probabilities are the register A operand of the P·V WGMMA
  (a ``DotOperandLayout`` of the accumulator's layout). P crosses the loop's back edge in fp32
  and is rounded to e4m3 right before the MMA that reads it: an e4m3 tensor carried across
  iterations is kept as single bytes and repacked, about 150 instructions a block of 64 × 128.
* ``KEYS_PERMUTED`` (Vᵀ's keys reordered within each 32 keys by :func:`permute_keys_for_pv`):
  the accumulator's registers already hold the A operand of P·V, so P's layout change costs
  nothing, and the rounding packs four values into a register with two ``cvt`` (the same
  round-to-nearest-even, saturating conversion); without it the change takes warp shuffles.
  The quantize pass could write Vᵀ in that order for free; :func:`permute_keys_for_pv` stands
  in for it.
* ``BLOCK_M = 16 · num_warps``: one warpgroup per 64 query rows (4 warps for 64 rows, 8 warps for
  128 rows: two warpgroups sharing one K/V ring).
* With ``WARP_SPECIALIZE`` one extra warp issues every TMA load (a producer partition given 24
  registers, ``gl.warp_specialize``; the MMA warps get the rest) and the consumers hand buffers
  back through "free" mbarriers; without it the consumer warps issue the loads themselves after
  a CTA barrier.
* The output is normalised in registers and stored from a layout of 16 contiguous bytes a
  thread (one exchange through shared memory that reuses the K/V ring).

The last key block, when ``seqlen_k`` is not a multiple of ``BLOCK_N``, runs after the
pipelined loop with the keys past ``seqlen_k`` masked (the portable kernel's masked loop).

Per key block and thread of a 64-row warpgroup (ptxas, sm90): about 580 instructions, of which
64 ``MUFU.EX2`` and 64 each of the score FMA, the INT8-to-float add, the row max, the row sum
and the accumulator's rescale; 232-244 registers (two CTAs of one warpgroup per SM, or one CTA
of two MMA warpgroups at 240 with the producer warp).

Cost per (batch, head): FLOPs 4·Sq·Sk·d at the 8-bit tensor-core rate; bytes (Sq + 2·Sk)·d at
one byte an element (K and V are read once per query tile, mostly from L2) plus the output.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashflow.kernels.hopper import first_turn, load_block, pass_turn, rescaled, store_rows, take_turn
from flashflow.kernels.tile_order import attention_tile

LOG2_E4M3_MAX: gl.constexpr = gl.constexpr(8.807354922057604)   # log2(448)
INT_AS_FLOAT_OFFSET: gl.constexpr = gl.constexpr(12582912.0)     # 1.5 · 2^23
_INT_AS_FLOAT_BITS: gl.constexpr = gl.constexpr(0x4B400000)


@gluon.jit
def _scores(qk, QK_FP8: gl.constexpr):
    """The Q·Kᵀ accumulator as fp32 ``x`` with ``score = x · row_scale − offset``: an INT8
    product plus ``1.5 · 2^23`` by the exponent trick (exact below 2^22), an FP8 one as is."""
    if QK_FP8:
        return qk
    else:
        return (qk + _INT_AS_FLOAT_BITS).to(gl.float32, bitcast=True)


@gluon.jit
def _row_scale(q_scale, k_scale_ptr, QK_FP8: gl.constexpr):
    """``(row_scale, offset)`` of one key block: the query rows' scales times the block's K scale,
    and the offset :func:`_scores` leaves in an INT8 score (none for FP8)."""
    row_scale = q_scale * gl.load(k_scale_ptr)
    if QK_FP8:
        offset = gl.zeros_like(row_scale)
    else:
        offset = INT_AS_FLOAT_OFFSET * row_scale
    return row_scale, offset


@gluon.jit
def _to_e4m3_x4(x):
    """fp32 → e4m3 (round to nearest even, saturating: what ``.to(float8e4nv)`` compiles to on
    sm90), four values of a thread packed into one register by two conversions."""
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
        "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [x], dtype=gl.float8e4nv, is_pure=True, pack=4)


@gluon.jit
def _softmax_step(qk, m_i, l_i, row_scale, offset, start_n, seqlen_k,
                  BLOCK_N: gl.constexpr, MASKED: gl.constexpr, s_layout: gl.constexpr):
    """One key block's online-softmax update, the portable kernel's formulas exactly. Returns
    ``(p, alpha, l, m)``: the probabilities (fp32, ×448), the factor for what was accumulated."""
    if MASKED:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = qk * gl.expand_dims(row_scale, 1) - gl.expand_dims(offset, 1)
        s = gl.where(gl.expand_dims(offs_n < seqlen_k, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_shift - LOG2_E4M3_MAX, 1))
        alpha = gl.exp2(m_i - m_shift)
    else:
        m_new = gl.maximum(m_i, gl.max(qk, 1) * row_scale - offset)
        p = gl.exp2(qk * gl.expand_dims(row_scale, 1) - gl.expand_dims(offset + m_new - LOG2_E4M3_MAX, 1))
        alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


@gluon.jit
def _p_operand(p, BLOCK_N: gl.constexpr, KEYS_PERMUTED: gl.constexpr, p_layout: gl.constexpr):
    """P (fp32, the accumulator's layout) as the e4m3 A operand of P·V. Made right before the
    MMA that reads it: an e4m3 tensor carried from one loop iteration to the next is kept as
    single bytes and repacked (several instructions a byte)."""
    if KEYS_PERMUTED:
        # the accumulator's column 32c + 16h + 8a + 2q + b to the A operand's position
        # 32c + 16h + 4q + 2a + b (Vᵀ's keys are permuted alike): each thread already holds its
        # A operand's values, so the layout conversion moves nothing, and four of them round to
        # e4m3 straight into one register
        p = p.reshape([p.shape[0], BLOCK_N // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5))
        p = gl.convert_layout(p.reshape([p.shape[0], BLOCK_N]), p_layout)
        p8 = _to_e4m3_x4(p)
    else:
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
    return p8


@gluon.jit
def _issue_pv(acc, alpha, p, vt_buf, BLOCK_N: gl.constexpr, KEYS_PERMUTED: gl.constexpr, p_layout: gl.constexpr):
    """``acc · α + P8 · V8`` as an asynchronous WGMMA (P from registers, Vᵀ's buffer read as
    the K-major B operand); the caller waits on the returned accumulator."""
    acc = rescaled(acc, alpha)
    return warpgroup_mma(_p_operand(p, BLOCK_N, KEYS_PERMUTED, p_layout), vt_buf.permute((1, 0)), acc,
                         is_async=True)


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_free, v_free, k_row0, v_row0, n_blocks,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The load warp of the warp-specialized kernel: every K and Vᵀ block into its ring, each
    buffer once the consumers have marked it free (the first pass waits on nothing)."""
    for j in range(n_blocks):
        stage = j % NUM_STAGES
        # phase of the "free" barrier: pass p over the ring waits for the consumers' arrival of
        # pass p − 1; the first pass goes straight through (parity 1 of a fresh barrier)
        free_phase = ((j // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(k_free.index(stage), free_phase)
        load_block(k_desc, k_smem, k_bar, k_row0 + j * BLOCK_N, 0, stage)
        mbarrier.wait(v_free.index(stage), free_phase)
        load_block(v_desc, v_smem, v_bar, v_row0, j * BLOCK_N, stage)


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, k_bar, v_bar, k_free, v_free, q_bar, k_desc, v_desc,
              QS, KS, q_row, m_start, k_row0, v_row0, seqlen_k,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
              QK_FP8: gl.constexpr, KEYS_PERMUTED: gl.constexpr, PRODUCER: gl.constexpr, PINGPONG: gl.constexpr,
              WG: gl.constexpr, num_warps: gl.constexpr):
    """The MMA and softmax warps: returns ``(acc, l, m)`` over every key of the tile's head.
    ``PINGPONG``: warpgroup ``WG`` of two takes its turn (``hopper.take_turn`` / ``pass_turn``) around
    each issue of its MMAs; both run the same number of turns."""
    k_width: gl.constexpr = 32 // 8
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=k_width)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    if QK_FP8:
        qk_dtype: gl.constexpr = gl.float32
    else:
        qk_dtype: gl.constexpr = gl.int32

    offs_m = m_start + gl.arange(0, BLOCK_M, layout=row_s)
    q_scale = gl.load(QS + q_row + offs_m)
    qk_zero = gl.zeros([BLOCK_M, BLOCK_N], qk_dtype, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    n_full = seqlen_k // BLOCK_N
    n_blocks = gl.cdiv(seqlen_k, BLOCK_N)
    mbarrier.wait(q_bar, 0)

    if n_full > 0:
        # block 0: its scores and softmax; its P·V waits for the next block's Q·Kᵀ
        mbarrier.wait(k_bar.index(0), 0)
        take_turn(PINGPONG, WG)
        qk = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), qk_zero, use_acc=False, is_async=True)
        pass_turn(PINGPONG, WG)
        qk = warpgroup_mma_wait(0, deps=[qk])
        if PRODUCER:
            mbarrier.arrive(k_free.index(0))
        elif NUM_STAGES < n_blocks:
            gl.thread_barrier()
            load_block(k_desc, k_smem, k_bar, k_row0 + NUM_STAGES * BLOCK_N, 0, 0)
        row_scale, offset = _row_scale(q_scale, KS, QK_FP8)
        p, alpha, l_i, m_i = _softmax_step(_scores(qk, QK_FP8), m_i, l_i, row_scale, offset, 0, seqlen_k,
                                            BLOCK_N, False, s_layout)
        for j in range(1, n_full):
            stage = j % NUM_STAGES
            phase = (j // NUM_STAGES) & 1
            prev = (j - 1) % NUM_STAGES
            prev_phase = ((j - 1) // NUM_STAGES) & 1
            # S_j = Q · K_jᵀ on the tensor cores ...
            mbarrier.wait(k_bar.index(stage), phase)
            mbarrier.wait(v_bar.index(prev), prev_phase)
            take_turn(PINGPONG, WG)
            qk = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), qk_zero, use_acc=False, is_async=True)
            # ... then block j−1's P·V into the rescaled accumulator
            acc = _issue_pv(acc, alpha, p, v_smem.index(prev), BLOCK_N, KEYS_PERMUTED, p_layout)
            pass_turn(PINGPONG, WG)
            qk = warpgroup_mma_wait(1, deps=[qk])
            if PRODUCER:
                mbarrier.arrive(k_free.index(stage))
            row_scale, offset = _row_scale(q_scale, KS + j, QK_FP8)
            # the softmax of block j under block j−1's P·V
            p, alpha, l_i, m_i = _softmax_step(_scores(qk, QK_FP8), m_i, l_i, row_scale, offset, 0, seqlen_k,
                                                BLOCK_N, False, s_layout)
            acc = warpgroup_mma_wait(0, deps=[acc])
            if PRODUCER:
                mbarrier.arrive(v_free.index(prev))
            else:
                # every warp is past its reads of both buffers: refill them
                gl.thread_barrier()
                if j + NUM_STAGES < n_blocks:
                    load_block(k_desc, k_smem, k_bar, k_row0 + (j + NUM_STAGES) * BLOCK_N, 0, stage)
                if j - 1 + NUM_STAGES < n_blocks:
                    load_block(v_desc, v_smem, v_bar, v_row0, (j - 1 + NUM_STAGES) * BLOCK_N, prev)
        # the last full block's P·V
        last = n_full - 1
        stage = last % NUM_STAGES
        mbarrier.wait(v_bar.index(stage), (last // NUM_STAGES) & 1)
        take_turn(PINGPONG, WG)
        acc = _issue_pv(acc, alpha, p, v_smem.index(stage), BLOCK_N, KEYS_PERMUTED, p_layout)
        pass_turn(PINGPONG, WG)
        acc = warpgroup_mma_wait(0, deps=[acc])
        if PRODUCER:
            mbarrier.arrive(v_free.index(stage))
        elif last + NUM_STAGES < n_blocks:
            gl.thread_barrier()
            load_block(v_desc, v_smem, v_bar, v_row0, (last + NUM_STAGES) * BLOCK_N, stage)

    if n_full < n_blocks:
        # the ragged last block: keys past seqlen_k masked
        stage = n_full % NUM_STAGES
        phase = (n_full // NUM_STAGES) & 1
        mbarrier.wait(k_bar.index(stage), phase)
        take_turn(PINGPONG, WG)
        qk = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), qk_zero, use_acc=False, is_async=True)
        pass_turn(PINGPONG, WG)
        qk = warpgroup_mma_wait(0, deps=[qk])
        row_scale, offset = _row_scale(q_scale, KS + n_full, QK_FP8)
        p, alpha, l_i, m_i = _softmax_step(_scores(qk, QK_FP8), m_i, l_i, row_scale, offset, n_full * BLOCK_N,
                                            seqlen_k, BLOCK_N, True, s_layout)
        mbarrier.wait(v_bar.index(stage), phase)
        take_turn(PINGPONG, WG)
        acc = _issue_pv(acc, alpha, p, v_smem.index(stage), BLOCK_N, KEYS_PERMUTED, p_layout)
        pass_turn(PINGPONG, WG)
        acc = warpgroup_mma_wait(0, deps=[acc])
    return acc, l_i, m_i


@gluon.jit
def _store_out(acc, l_i, m_i, O, LSE, VS, QC, batch, head, bhk, q_row, m_start, seqlen_q,
               stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
               BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, RETURN_LSE: gl.constexpr, COALESCE: gl.constexpr,
               num_warps: gl.constexpr):
    """Rows ``m_start..`` of the output, ``acc · v_scale / l`` (the portable kernel's
    ``normalize``), and with ``RETURN_LSE`` their log-sum-exp. ``COALESCE``: store from a layout
    of 16 contiguous bytes a thread and whole rows a warp (one exchange through shared memory,
    scratch the allocator may place over the dead K/V ring) instead of the MMA layout's 4-byte
    pieces."""
    o_layout: gl.constexpr = acc.type.layout
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    offs_m = m_start + gl.arange(0, BLOCK_M, layout=row_o)
    l_o = gl.convert_layout(l_i, row_o)
    l_safe = gl.where(l_o == 0.0, 1.0, l_o)
    v_scale = gl.load(VS + bhk * HEAD_DIM + offs_d)
    out = (acc / gl.expand_dims(l_safe, 1) * gl.expand_dims(v_scale, 0)).to(O.dtype.element_ty)
    o_base = O + batch.to(gl.int64) * stride_ob + head.to(gl.int64) * stride_oh
    rows = offs_m < seqlen_q
    store_rows(out, o_base, m_start, seqlen_q, stride_os, BLOCK_M, HEAD_DIM, COALESCE, num_warps)
    if RETURN_LSE:
        # l sums 448-scaled probabilities; -inf for a row with no key stays -inf
        m_o = gl.convert_layout(m_i, row_o)
        empty = l_o == 0.0
        lse = gl.where(empty, float("-inf"), (m_o - LOG2_E4M3_MAX + gl.log2(l_safe)) * 0.6931471805599453)
        lse = lse + gl.load(QC + q_row + offs_m)
        gl.store(LSE + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh + offs_m, lse, mask=rows)


@gluon.jit
def _consumer_wg(wg: gl.constexpr, q_smem, k_smem, v_smem, k_bar, v_bar, k_free, v_free, q_bar, k_desc, v_desc,
                 QS, KS, VS, QC, O, LSE, batch, head, bhk, q_row, m_start, k_row0, v_row0, seqlen_q, seqlen_k,
                 stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, QK_FP8: gl.constexpr,
                 KEYS_PERMUTED: gl.constexpr, PINGPONG: gl.constexpr, RETURN_LSE: gl.constexpr):
    """One of the two MMA warpgroups of a 128-row tile, in a partition of its own: rows
    ``64·wg..`` of the tile, its own output rows (from the MMA layout: the other warpgroup may
    still read the K/V ring)."""
    m_wg = m_start + 64 * wg
    first_turn(PINGPONG, wg)
    acc, l_i, m_i = _consumer(q_smem.slice(64 * wg, 64), k_smem, v_smem, k_bar, v_bar, k_free, v_free, q_bar,
                              k_desc, v_desc, QS, KS, q_row, m_wg, k_row0, v_row0, seqlen_k,
                              64, BLOCK_N, HEAD_DIM, NUM_STAGES, QK_FP8, KEYS_PERMUTED, True, PINGPONG, wg, 4)
    _store_out(acc, l_i, m_i, O, LSE, VS, QC, batch, head, bhk, q_row, m_wg, seqlen_q,
               stride_ob, stride_os, stride_oh, stride_lb, stride_lh, 64, HEAD_DIM, RETURN_LSE, False, 4)


@gluon.jit
def attention_fp8_fwd_gluon_kernel(
    q_desc, k_desc, v_desc, QS, KS, VS, QC, O, LSE,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, sq_pad, sk_pad, heads, kv_heads, num_m_blocks,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    RETURN_LSE: gl.constexpr, QK_FP8: gl.constexpr, KEYS_PERMUTED: gl.constexpr, WARP_SPECIALIZE: gl.constexpr,
    SPLIT_WARPGROUPS: gl.constexpr, PINGPONG: gl.constexpr, num_warps: gl.constexpr,
):
    """1-D grid over (m-block, head, batch) tiles, m-block fastest (the tiles that run together
    share K/V in L2). ``q_desc/k_desc/v_desc``: TMA descriptors over the 2-D views
    ``(b·h·sq_pad, D)``, ``(b·hk·sk_pad, D)`` and ``(b·hk·D, sk_pad)``, blocks
    ``[BLOCK_M, D]``, ``[BLOCK_N, D]``, ``[D, BLOCK_N]``. ``O``: ``(b, sq, h, D)``.

    ``SPLIT_WARPGROUPS`` (with ``WARP_SPECIALIZE``, ``BLOCK_M`` 128, ``num_warps`` 4): the two
    MMA warpgroups are two partitions (the default one and a worker given 240 registers), and
    with ``PINGPONG`` they take turns issuing their MMAs (FlashAttention-3's ping-pong: one
    warpgroup's softmax under the other's MMAs), passing the turn through two named barriers
    (:mod:`flashflow.kernels.hopper`)."""
    if SPLIT_WARPGROUPS:
        gl.static_assert(WARP_SPECIALIZE and BLOCK_M == 128 and num_warps == 4, "two 64-row partitions")
    else:
        gl.static_assert(BLOCK_M == 16 * num_warps, "one warpgroup per 64 query rows")
    tile = gl.program_id(0)
    pid_m, head, batch = attention_tile(tile, num_m_blocks, heads, False)
    kv_head = head // (heads // kv_heads)
    m_start = pid_m * BLOCK_M
    q_row = (batch * heads + head) * sq_pad
    bhk = batch * kv_heads + kv_head
    k_row0 = bhk * sk_pad
    v_row0 = bhk * HEAD_DIM
    ks = KS + bhk * (sk_pad // BLOCK_N)
    n_blocks = gl.cdiv(seqlen_k, BLOCK_N)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(k_bar.index(s), count=1)
        mbarrier.init(v_bar.index(s), count=1)
        # each consumer partition arrives once (one thread, after a barrier of its warps) when
        # it has read a buffer
        mbarrier.init(k_free.index(s), count=2 if SPLIT_WARPGROUPS else 1)
        mbarrier.init(v_free.index(s), count=2 if SPLIT_WARPGROUPS else 1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row + m_start, 0], q_bar, q_smem)
    if SPLIT_WARPGROUPS:
        gl.warp_specialize([
            (_consumer_wg, (0, q_smem, k_smem, v_smem, k_bar, v_bar, k_free, v_free, q_bar, k_desc, v_desc,
                            QS, ks, VS, QC, O, LSE, batch, head, bhk, q_row, m_start, k_row0, v_row0, seqlen_q,
                            seqlen_k, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                            BLOCK_N, HEAD_DIM, NUM_STAGES, QK_FP8, KEYS_PERMUTED, PINGPONG, RETURN_LSE)),
            (_consumer_wg, (1, q_smem, k_smem, v_smem, k_bar, v_bar, k_free, v_free, q_bar, k_desc, v_desc,
                            QS, ks, VS, QC, O, LSE, batch, head, bhk, q_row, m_start, k_row0, v_row0, seqlen_q,
                            seqlen_k, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                            BLOCK_N, HEAD_DIM, NUM_STAGES, QK_FP8, KEYS_PERMUTED, PINGPONG, RETURN_LSE)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_free, v_free, k_row0, v_row0, n_blocks,
                         BLOCK_N, NUM_STAGES)),
        ], [4, 1], [240, 24])
    else:
        if WARP_SPECIALIZE:
            acc, l_i, m_i = gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, k_bar, v_bar, k_free, v_free, q_bar, k_desc, v_desc,
                             QS, ks, q_row, m_start, k_row0, v_row0, seqlen_k,
                             BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, QK_FP8, KEYS_PERMUTED, True, False, 0,
                             num_warps)),
                (_producer, (k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_free, v_free, k_row0, v_row0, n_blocks,
                             BLOCK_N, NUM_STAGES)),
            ], [1], [24])
        else:
            for s in gl.static_range(NUM_STAGES):
                if s < n_blocks:
                    load_block(k_desc, k_smem, k_bar, k_row0 + s * BLOCK_N, 0, s)
                    load_block(v_desc, v_smem, v_bar, v_row0, s * BLOCK_N, s)
            acc, l_i, m_i = _consumer(q_smem, k_smem, v_smem, k_bar, v_bar, k_free, v_free, q_bar, k_desc,
                                      v_desc, QS, ks, q_row, m_start, k_row0, v_row0, seqlen_k,
                                      BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, QK_FP8, KEYS_PERMUTED, False, False, 0,
                                      num_warps)
        _store_out(acc, l_i, m_i, O, LSE, VS, QC, batch, head, bhk, q_row, m_start, seqlen_q,
                   stride_ob, stride_os, stride_oh, stride_lb, stride_lh, BLOCK_M, HEAD_DIM, RETURN_LSE, True,
                   num_warps)

    mbarrier.invalidate(q_bar)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(k_bar.index(s))
        mbarrier.invalidate(v_bar.index(s))
        mbarrier.invalidate(k_free.index(s))
        mbarrier.invalidate(v_free.index(s))


def _torch():
    import torch   # the launcher's only use of torch: dtypes and a view

    return torch


def _gl_dtype(dtype):
    torch = _torch()
    return {torch.int8: gl.int8, torch.float8_e4m3fn: gl.float8e4nv}[dtype]


def descriptors(bufs: dict, head_dim: int, block_m: int, block_n: int):
    """TMA descriptors (Gluon's host ``TensorDescriptor``) over the quantize pass's Q, K, Vᵀ."""
    q8 = bufs["q8"].reshape(-1, head_dim)
    k8 = bufs["k8"].reshape(-1, head_dim)
    vt8 = bufs["vt8"].reshape(-1, bufs["vt8"].shape[-1])
    out = []
    for t, block in ((q8, [block_m, head_dim]), (k8, [block_n, head_dim]), (vt8, [head_dim, block_n])):
        layout = gl.NVMMASharedLayout.get_default_for(block, _gl_dtype(t.dtype))
        out.append(TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout))
    return out


def launch_attention_fp8_gluon(bufs: dict, out, batch: int, heads: int, kv_heads: int, seqlen_q: int, seqlen_k: int,
                               sq_pad: int, sk_pad: int, head_dim: int, block_m: int = 64, block_n: int = 128,
                               num_warps: int = 4, num_stages: int = 2, warp_specialize: bool = False, lse=None,
                               descs=None, maxnreg=None, keys_permuted: bool = False, split_warpgroups: bool = False,
                               pingpong: bool = False):
    """Launch :func:`attention_fp8_fwd_gluon_kernel` on ``bufs``, the dict of
    ``flashflow.ops.attention_fp8.quantize_attention_inputs(q, k, v, scale, block_m', block_n)``
    (``block_n`` the same as here: K's scales are per ``block_n`` keys; its padding of the query
    rows must be a multiple of ``block_m``). ``out``: ``(batch, seqlen_q, heads, head_dim)``
    contiguous; ``lse`` (float32 ``(batch, heads, seqlen_q)``) is written when given (the quantize
    pass ran with ``lse_correction=True``). ``descs``: :func:`descriptors` made once, to keep
    their host time out of a timed loop. ``maxnreg``: the registers a thread starts with (the
    warp-specialized kernel's partitions then move them between themselves); by default as many
    as one CTA per SM allows. Returns the compiled kernel."""
    assert sq_pad % block_m == 0 and sk_pad % block_n == 0
    assert block_m == (32 if split_warpgroups else 16) * num_warps   # 64 rows a warpgroup
    assert bufs["k_scale"].shape[-1] == sk_pad // block_n, "K's scales are per block_n keys"
    if descs is None:
        descs = descriptors(bufs, head_dim, block_m, block_n)
    num_m_blocks = triton.cdiv(seqlen_q, block_m)
    o_strides = out.stride()
    return_lse = lse is not None
    lse_arg = lse if return_lse else bufs["q_scale"]
    grid = (num_m_blocks * heads * batch, 1, 1)
    return attention_fp8_fwd_gluon_kernel[grid](
        *descs, bufs["q_scale"], bufs["k_scale"], bufs["v_scale"], bufs["q_corr"], out, lse_arg,
        o_strides[0], o_strides[1], o_strides[2], heads * seqlen_q if return_lse else 0,
        seqlen_q if return_lse else 0, seqlen_q, seqlen_k, sq_pad, sk_pad, heads, kv_heads, num_m_blocks,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=num_stages, RETURN_LSE=return_lse,
        QK_FP8=bufs["q8"].dtype != _torch().int8, KEYS_PERMUTED=keys_permuted, WARP_SPECIALIZE=warp_specialize,
        SPLIT_WARPGROUPS=split_warpgroups, PINGPONG=pingpong, num_warps=num_warps,
        **({} if maxnreg is None else {"maxnreg": maxnreg}))


def permute_keys_for_pv(vt8):
    """Vᵀ ``(..., keys)`` with its keys reordered as ``launch_attention_fp8_gluon(...,
    keys_permuted=True)`` reads them: within each chunk of 32 keys, key ``16h + 4q + 2a + b`` of
    the result is key ``16h + 8a + 2q + b`` of ``vt8`` (the order the P·V MMA takes P's
    registers in). ``keys`` a multiple of 32 (the quantize pass pads to whole key blocks)."""
    shape = vt8.shape
    v = vt8.view(_torch().uint8).reshape(*shape[:-1], shape[-1] // 32, 2, 2, 4, 2)
    nd = v.dim()
    v = v.permute(*range(nd - 4), nd - 4, nd - 2, nd - 3, nd - 1)
    return v.reshape(shape).view(vt8.dtype)

