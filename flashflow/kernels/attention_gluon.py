"""Flash attention forward for Hopper (sm90) in Gluon, Triton's warp-level dialect: bf16 / fp16.

The attention of :func:`flashflow.kernels.attention_fwd.attention_fwd_kernel` (the online
softmax of :mod:`flashflow.kernels.softmax`, base-2 scores, the same normalisation and LSE),
with the Hopper schedule written out instead of left to Triton's pipeliner, as
FlashAttention-3 lays it out:

* K and V blocks arrive by TMA in two rings of ``NUM_STAGES`` shared buffers, each buffer with
  its own mbarrier (expect-tx bytes, a phase bit per pass over the ring); Q arrives once. Block
  ``j`` of a tile sits in buffer ``j % NUM_STAGES``; a K buffer is refilled as soon as the Q·Kᵀ
  reading it has finished, a V buffer as soon as its P·V has.
* Both products are asynchronous WGMMAs overlapped within a warpgroup: block j's
  ``S_j = Q · K_jᵀ`` is issued, then block j−1's ``acc = acc · α + P_{j−1} · V_{j−1}``, and the
  softmax of ``S_j`` runs while that P·V is still on the tensor cores. ``EARLY_RESCALE``: the
  ``acc · α`` is computed as soon as the P·V before is waited on, not in the next P·V's issue
  (where ptxas interleaves its ``FMUL``s with ``S_j``'s HGMMAs): :func:`_after_pv`.
* P never leaves registers: in 16 bits the accumulator's registers are already the A operand
  of the P·V WGMMA, so P's change of layout moves nothing. It is converted once the previous
  block's P·V is done and carried to the next block in 16 bits (:func:`_p_operand`).
* ``BLOCK_M = 16 · num_warps`` rows, one warpgroup per 64 (8 warps: two warpgroups sharing one
  K/V ring). ``WARP_SPECIALIZE``: one extra warp issues every TMA load (24 registers, the MMA
  warps the rest), the consumers hand buffers back through "free" mbarriers. With
  ``SPLIT_WARPGROUPS`` (4 warps a partition) the MMA warpgroups are partitions of their own:
  ``PARTITIONS = BLOCK_M / 64``, two (128 rows, 240 registers each) or three (192 rows,
  FlashAttention-3's head_dim-64 tile, 160 each and 168 for the first). Q then arrives in
  pieces of its descriptor's rows (a TMA box is a power of two: 192 rows take three boxes of
  64, one arrival each on the Q buffer's mbarrier). With ``PINGPONG`` two partitions take
  turns issuing their MMAs (one warpgroup's softmax under the other's WGMMAs), passing the turn
  through two named barriers (:mod:`flashflow.kernels.hopper`); with ``OVERLAP`` too, a tile's
  last P·V is issued without a turn and the next tile's first Q·Kᵀ with one.

Which keys a row sees is :mod:`flashflow.kernels.mask`'s rule (bottom-right causal diagonal; a
key-padding mask over the first ``mask_keys`` keys). Every key block of a tile runs in the one
pipelined loop above: a block outside the tile's unmasked range (a block holding a key of the
key-padding mask, the causal diagonal, a ragged last block) first sets the raw scores its rows
may not see to -inf, in a uniform branch the unmasked blocks skip; the softmax guards a row with
no allowed key yet per row (``online_softmax_scaled(..., MASKED=True)``). The scale must be
positive (the dispatcher leaves other scales to the portable kernel): a masked raw score then
stays -inf once scaled.

Loads come from host TMA descriptors over 2-D views of q, k, v (rows = tokens, the launcher's
``rows_view``): rows past a sequence's end may belong to the next sequence or head. Their keys
are masked in the scores and, in the block where that happens, V's rows past the end are
zeroed in shared memory before P·V (a 0 · NaN there would reach the output); query rows there
are never stored.

Persistent (with ``WARP_SPECIALIZE``, a grid of one CTA an SM): a CTA runs the tiles
tile_order.py's ``next_tile`` gives it, ``program_id, + num_programs, ...`` or, ``DYNAMIC``, the
next unclaimed tile by ticket (the causal entry: longest first, a CTA that finishes early
takes the next); the load warp claims the next tile once this one's loads are issued (a CTA
holds an unstarted tile only while its MMA partitions finish the last blocks in the ring) and
publishes each tile's number beside its Q buffer, so the MMA partitions walk the same tiles. With two Q
buffers its loads run into the next tile while the MMA partitions finish this one.
``OVERLAP`` (the persistent entries): once a tile's last P·V is done, the MMA partitions issue
the next tile's ``S_0 = Q · K_0ᵀ`` and normalise and store the tile's output under it (from a
layout of 16-byte rows, through a shared-memory exchange); the next tile's loop starts from
block 0's softmax. That WGMMA is issued whatever the next tile (its result is not read after
the last tile or for a tile with no key block): issued under a branch, or with the last P·V
still in flight, ptxas serialises every WGMMA of the kernel for want of registers (its C7512
note; ``tests/bench/test_offline.py`` checks every shipped config for it).
``SPLIT`` (the persistent entries without a causal mask, where the tiles do not fill the last
wave: ``tuning/attention_gluon.py``'s ``last_wave_pieces``): the CTAs walk work units, the
tiles of the full waves whole and each remaining tile as ``pieces`` runs over consecutive key
blocks (tile_order.py's ``split_unit``, ``piece_blocks``), claimed by ticket. A piece before its
tile's last stores its unnormalised rows (``acc``, ``m``, ``l`` in fp32) and arrives on its
partition's counter of the tile, each thread releasing its own stores; the last piece waits in
each thread until every thread of the others has arrived, folds their rows into its own
(:func:`_merge_pieces`) and stores the tile (sync.py's ``release_add`` / ``acquire_at_least``).
A piece waits only for units before it, and with ``SPLIT`` every unit is claimed by ticket, a
CTA's first too (tile_order.py's ``first_tile``), so running CTAs hold them whatever order the
hardware starts the CTAs in.
Written with the masked blocks in loops of their own before and after the pipelined loop, the
persistent form with two MMA partitions faulted on tiles with no unmasked block: ptxas (12.8)
computed a WGMMA descriptor of Q inside the pipelined loop's guard and read it after the merge
(docs/hopper.md). One loop for every block leaves no such path.

Budget per warp role (the shipped head_dim-128 tile: 128 rows, 128-key blocks, 2 stages):

* MMA partitions, 2 × 4 warps, 240 registers a thread (``warp_specialize``'s budget; the cubin
  reports the 168 a thread starts with): the accumulator (64 fp32), the scores (64 fp32), P
  (32 packed bf16 pairs), the row state;
* load warp, 1 warp, 24 registers;
* shared memory: Q 32 KB (two buffers, 64 KB, persistent), K and V rings 2 × 2 × 32 KB, the
  mbarriers and the tile numbers: 160 KB one CTA a tile (164,288 bytes with the compiler's
  scratch), 192 KB persistent, and 16 KB more for the overlapped store's exchange (213,124
  bytes), one CTA an SM.

Per 128-key block a thread of an MMA warpgroup issues 467 instructions on the loop's unmasked
path in the shipped non-causal form (ptxas, sm90; 474 with ping-pong turns): 16
``HGMMA.64x128x16``, 66 ``MUFU.EX2``, 66 ``FFMA``, 68 ``FMNMX``, 68 ``FADD``, 66 ``FMUL``, 32
``F2FP``, the per-row guard and the block's branch, and the barriers and addresses; a masked
block adds 84 (the mask's compares and 64 selects) (docs/hopper.md).

Cost per (batch, head): FLOPs ``4·Sq·Sk·d`` (about half with causal), at the 16-bit tensor-core
rate; bytes ``2·(Sq + 2·Sk)·d`` at two bytes an element (K and V read once per query tile,
mostly from L2) plus the output.
"""
import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashflow.kernels.hopper import first_turn, load_block, pass_turn, rescaled, store_rows, take_turn
from flashflow.kernels.mask import key_allowed
from flashflow.kernels.softmax import log_sum_exp, normalize, online_softmax_scaled, shift_of
from flashflow.kernels.sync import acquire_at_least, release_add
from flashflow.kernels.tile_order import attention_tile, first_tile, next_tile, piece_blocks, split_unit


# ----------------------------------------------------------------------------- scores


@gluon.jit
def _masked_scores(qk, offs_m, start_n, seqlen_k, diag_offset, kpm, mask_keys, CAUSAL: gl.constexpr,
                   KEY_PADDING: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """One key block's raw scores, -inf where row ``offs_m`` may not see the key (mask.py's
    rule: in the sequence, at or left of the bottom-right diagonal with ``CAUSAL``), or where the
    key-padding row ``kpm`` flags it False (its first ``mask_keys`` keys). Unscaled: the launcher's
    scale is positive, so a masked score stays -inf once scaled."""
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    allowed = key_allowed(gl.expand_dims(offs_n < seqlen_k, 0), gl.expand_dims(offs_n, 0),
                          gl.expand_dims(offs_m + diag_offset, 1), 0, 0, False, CAUSAL)
    if KEY_PADDING:
        keep = gl.load(kpm + offs_n, mask=offs_n < mask_keys, other=1)
        allowed = allowed & gl.expand_dims(keep != 0, 0)
    return gl.where(allowed, qk, float("-inf"))


@gluon.jit
def _issue_pv(acc, alpha, p, v_buf, EARLY_RESCALE: gl.constexpr):
    """``acc · α + P · V`` as an asynchronous WGMMA (P, 16-bit, from registers as the A operand,
    V's buffer as the B operand); the caller waits on the returned accumulator. With
    ``EARLY_RESCALE`` ``acc`` comes already rescaled (:func:`_after_pv`)."""
    if not EARLY_RESCALE:
        acc = rescaled(acc, alpha)
    return warpgroup_mma(p, v_buf, acc, is_async=True)


@gluon.jit
def _after_pv(acc, alpha, EARLY_RESCALE: gl.constexpr):
    """The accumulator once a P·V is waited on, ``alpha`` the next block's: with
    ``EARLY_RESCALE`` rescaled here, so that the next P·V's issue has nothing to compute.
    Inside the issue, ptxas interleaves the rescale's ``FMUL``s (64 a thread at head_dim 128,
    128 at 256) with the next block's Q·Kᵀ HGMMAs, which then issue late; done here they
    run before them. Which is faster depends on the tile (its config's ``early_rescale``)."""
    if EARLY_RESCALE:
        acc = rescaled(acc, alpha)
    return acc


# ----------------------------------------------------------------------------- loads


@gluon.jit
def _refill(desc, smem, bar, k_row0, k_col, j, stage, n_blocks, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Without a load warp (one tile a CTA): block ``j + NUM_STAGES``, where the tile has it, into
    buffer ``stage`` of a ring, the one block ``j`` leaves (every warp is past its reads of it)."""
    if j + NUM_STAGES < n_blocks:
        load_block(desc, smem, bar, k_row0 + (j + NUM_STAGES) * BLOCK_N, k_col, stage)


@gluon.jit
def _publish_tile(tile_ids, qi, tile):
    """The load warp writes the tile of Q buffer ``qi`` beside it, before the Q buffer's
    mbarrier arrival (a release) that the MMA partitions wait on."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tile_ids.index(qi).store(gl.full([1], tile, gl.int32, layout))


@gluon.jit
def _read_tile(tile_ids, q_bar, it, Q_BUFS: gl.constexpr, num_warps: gl.constexpr):
    """An MMA partition's ``it``-th tile: what the load warp published beside Q buffer
    ``it % Q_BUFS``, read once that buffer's mbarrier (Q's bytes, or the load warp's arrival
    alone at the end) has passed; a tile past the last ends the walk."""
    qi = it % Q_BUFS
    mbarrier.wait(q_bar.index(qi), (it // Q_BUFS) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    return gl.max(tile_ids.index(qi).load(layout), axis=0)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, q_free, k_free, v_free, tile_ids,
              tile_counter, q_row_b, q_row_h, q_col_h, k_row_b, k_row_h, k_col_h, seqlen_q, seqlen_k, heads,
              kv_group, num_m_blocks, num_tiles, full_units, pieces, masked_keys, CAUSAL: gl.constexpr,
              HEAVY_FIRST: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              Q_BUFS: gl.constexpr, DYNAMIC: gl.constexpr, SPLIT: gl.constexpr):
    """The load warp: for each tile of this CTA (tile_order.py's ``next_tile``, the next one
    claimed once this one's loads are issued), Q into one of ``Q_BUFS`` buffers once the
    consumers are done with the tile that used it last, the tile's number published beside it,
    then every K and V block into its ring, each buffer once the consumers have marked it free. Ring position
    ``g`` runs on across tiles, so the next tile's blocks load while the consumers finish this
    one. A pass over a ring waits for the consumers' arrivals of the pass before; the first
    goes straight through (parity 1 of a fresh barrier). After the last tile, a number past the
    end is published with an arrival alone. With ``SPLIT`` it walks work units (``num_tiles`` of
    them, :func:`_unit_span`) and loads each unit's key blocks only."""
    g = 0
    it = 0
    # key pieces wait for lower-numbered units: every unit by ticket, the first too
    tile = first_tile(tile_counter, num_tiles, SPLIT)
    while tile < num_tiles:
        m_start, head, batch, kv_head, kb0, n_blocks, full_lo, full_hi = _unit_span(
            tile, full_units, pieces, num_m_blocks, heads, kv_group, seqlen_q, seqlen_k, masked_keys, CAUSAL,
            HEAVY_FIRST, BLOCK_M, BLOCK_N, SPLIT)
        k_row0 = batch * k_row_b + kv_head * k_row_h + kb0 * BLOCK_N
        k_col = kv_head * k_col_h
        qi = it % Q_BUFS
        mbarrier.wait(q_free.index(qi), ((it // Q_BUFS) & 1) ^ 1)
        _publish_tile(tile_ids, qi, tile)
        # Q in pieces of the descriptor's rows (a TMA box is a power of two: 192 rows take
        # three), each piece an arrival on the buffer's mbarrier with its bytes
        q_rows: gl.constexpr = q_desc.block_type.shape[0]
        q_pieces = BLOCK_M // q_rows
        for r in range(q_pieces):
            mbarrier.expect(q_bar.index(qi), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [batch * q_row_b + head * q_row_h + m_start + r * q_rows,
                                                     head * q_col_h],
                                            q_bar.index(qi), q_smem.index(qi * q_pieces + r))
        for j in range(n_blocks):
            stage = (g + j) % NUM_STAGES
            free_phase = (((g + j) // NUM_STAGES) & 1) ^ 1
            mbarrier.wait(k_free.index(stage), free_phase)
            load_block(k_desc, k_smem, k_bar, k_row0 + j * BLOCK_N, k_col, stage)
            mbarrier.wait(v_free.index(stage), free_phase)
            load_block(v_desc, v_smem, v_bar, k_row0 + j * BLOCK_N, k_col, stage)
        # the next tile claimed once this one's loads are issued, not before them: a CTA then holds
        # an unstarted tile for the time of its last ring's blocks, not of the whole tile
        tile = next_tile(tile, tile_counter, num_tiles, DYNAMIC, SPLIT)
        g += n_blocks
        it += 1
    qi = it % Q_BUFS
    mbarrier.wait(q_free.index(qi), ((it // Q_BUFS) & 1) ^ 1)
    _publish_tile(tile_ids, qi, num_tiles)
    for r in range(BLOCK_M // q_desc.block_type.shape[0]):
        mbarrier.arrive(q_bar.index(qi))


@gluon.jit
def _zero_v_tail(v_buf, n_valid, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, num_warps: gl.constexpr):
    """Zero V's rows ``n_valid..`` of a buffer in shared memory (rows past the sequence's end
    that hold another sequence's values, or NaN)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [num_warps, 1], [1, 0])
    v = v_buf.load(layout)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    v_buf.store(gl.where(gl.expand_dims(rows < n_valid, 1), v, gl.zeros_like(v)))
    fence_async_shared()
    gl.thread_barrier()


# ----------------------------------------------------------------------------- consumer


@gluon.jit
def _block_softmax(qk, j, m_i, l_i, full_lo, full_hi, qk_scale_log2, offs_m, seqlen_k, diag_offset, kpm, mask_keys,
                   CAUSAL: gl.constexpr, KEY_PADDING: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """The online softmax of block ``j``'s raw scores, the scale folded into one FMA a score.
    Outside the tile's unmasked blocks ``[full_lo, full_hi)`` the mask (mask.py's rule and the
    key-padding row) first sets the scores a row may not see to -inf, in a uniform branch: the
    unmasked blocks run none of its instructions, only the per-row guard of a row with no key."""
    if (j < full_lo) | (j >= full_hi):
        qk = _masked_scores(qk, offs_m, j * BLOCK_N, seqlen_k, diag_offset, kpm, mask_keys, CAUSAL, KEY_PADDING,
                            BLOCK_N, s_layout)
    return online_softmax_scaled(qk, m_i, l_i, qk_scale_log2, True)


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr):
    """A block's P as the 16-bit A operand of its P·V WGMMA, in which it is carried to the next
    block: carried in fp32 it would hold 64 more registers a thread while the next block's
    scores accumulate (ptxas spills them). Converted with no WGMMA in flight: converted while
    one runs, ptxas serialises every WGMMA of the kernel (its C7513 note)."""
    return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _v_ready(v_smem, v_bar, stage, phase, j, seqlen_k, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
             num_warps: gl.constexpr):
    """Wait for block ``j``'s V buffer; in a block that runs past the sequence's end, zero V's
    rows there first (they hold the next sequence's or head's values, maybe NaN, and 0 · NaN would
    reach the output)."""
    mbarrier.wait(v_bar.index(stage), phase)
    if (j + 1) * BLOCK_N > seqlen_k:
        _zero_v_tail(v_smem.index(stage), seqlen_k - j * BLOCK_N, BLOCK_N, HEAD_DIM, num_warps)


@gluon.jit
def _middle_blocks(acc, p, alpha, l_i, m_i, qk_zero, q_smem, k_smem, v_smem, k_bar, v_bar, k_free, v_free, g, k_desc,
                   v_desc, k_row0, k_col, qk_scale_log2, offs_m, seqlen_k, diag_offset, kpm, mask_keys, n_blocks,
                   kb0, full_lo, full_hi, CAUSAL: gl.constexpr, KEY_PADDING: gl.constexpr, BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr, PRODUCER: gl.constexpr, PINGPONG: gl.constexpr, WG: gl.constexpr,
                   s_layout: gl.constexpr, p_layout: gl.constexpr, EARLY_RESCALE: gl.constexpr):
    """Blocks ``1 .. n_blocks − 1`` of a tile (key blocks ``kb0 + j``: a unit's keys start at block
    ``kb0``), block 0's softmax done (``p``, ``alpha``; with ``EARLY_RESCALE`` ``acc`` already
    rescaled by that ``alpha``): S_j's WGMMA issued before P_{j−1}·V_{j−1}'s, the softmax of S_j
    under it. Returns ``(acc, p, alpha, l, m)`` with the last block's P·V still to issue."""
    for j in range(1, n_blocks):
        stage = (g + j) % NUM_STAGES
        phase = ((g + j) // NUM_STAGES) & 1
        prev = (g + j - 1) % NUM_STAGES
        prev_phase = ((g + j - 1) // NUM_STAGES) & 1
        # S_j = Q · K_jᵀ on the tensor cores ...
        mbarrier.wait(k_bar.index(stage), phase)
        mbarrier.wait(v_bar.index(prev), prev_phase)
        take_turn(PINGPONG, WG)
        qk = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), qk_zero, use_acc=False, is_async=True)
        # ... then block j−1's P·V into the rescaled accumulator
        acc = _issue_pv(acc, alpha, p, v_smem.index(prev), EARLY_RESCALE)
        pass_turn(PINGPONG, WG)
        qk = warpgroup_mma_wait(1, deps=[qk])
        if PRODUCER:
            mbarrier.arrive(k_free.index(stage))
        # the softmax of block j under block j−1's P·V
        p, alpha, l_i, m_i = _block_softmax(qk, kb0 + j, m_i, l_i, full_lo, full_hi, qk_scale_log2, offs_m, seqlen_k,
                                            diag_offset, kpm, mask_keys, CAUSAL, KEY_PADDING, BLOCK_N, s_layout)
        acc = _after_pv(warpgroup_mma_wait(0, deps=[acc]), alpha, EARLY_RESCALE)
        p = _p_operand(p, v_smem.dtype, p_layout)
        if PRODUCER:
            mbarrier.arrive(v_free.index(prev))
        else:
            # every warp is past its reads of both buffers: refill them
            gl.thread_barrier()
            _refill(k_desc, k_smem, k_bar, k_row0, k_col, j, stage, n_blocks, BLOCK_N, NUM_STAGES)
            _refill(v_desc, v_smem, v_bar, k_row0, k_col, j - 1, prev, n_blocks, BLOCK_N, NUM_STAGES)
    return acc, p, alpha, l_i, m_i


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, k_bar, v_bar, k_free, v_free, q_ready, q_phase, g, k_desc, v_desc,
              m_start, k_row0, k_col, seqlen_q, seqlen_k, qk_scale_log2, kpm, mask_keys, n_blocks, full_lo, full_hi,
              CAUSAL: gl.constexpr, KEY_PADDING: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, PRODUCER: gl.constexpr, PINGPONG: gl.constexpr,
              WG: gl.constexpr, num_warps: gl.constexpr, EARLY_RESCALE: gl.constexpr):
    """The MMA and softmax warps of ``BLOCK_M`` query rows: ``(acc, l, m)`` over the blocks
    ``[0, n_blocks)`` of the tile's keys, ``[full_lo, full_hi)`` of them unmasked; block j sits
    in ring position ``g + j``; with ``PINGPONG`` each issue of its WGMMAs is a turn (a tile with
    blocks takes ``n_blocks + 1``). Every block, masked or not, runs in one pipelined
    loop: S_j's WGMMA is issued before P_{j−1}·V_{j−1}'s, and the softmax of S_j runs under it.
    Without ``PRODUCER`` (one tile a CTA) the warps refill the ring themselves."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    offs_m = m_start + gl.arange(0, BLOCK_M, layout=row_s)
    diag_offset = seqlen_k - seqlen_q
    qk_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    mbarrier.wait(q_ready, q_phase)

    if n_blocks > 0:
        # block 0: its scores and softmax; its P·V waits for the next block's Q·Kᵀ
        stage = g % NUM_STAGES
        mbarrier.wait(k_bar.index(stage), (g // NUM_STAGES) & 1)
        take_turn(PINGPONG, WG)
        qk = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), qk_zero, use_acc=False, is_async=True)
        pass_turn(PINGPONG, WG)
        qk = warpgroup_mma_wait(0, deps=[qk])
        if PRODUCER:
            mbarrier.arrive(k_free.index(stage))
        else:
            gl.thread_barrier()
            _refill(k_desc, k_smem, k_bar, k_row0, k_col, 0, stage, n_blocks, BLOCK_N, NUM_STAGES)
        p, alpha, l_i, m_i = _block_softmax(qk, 0, m_i, l_i, full_lo, full_hi, qk_scale_log2, offs_m, seqlen_k,
                                            diag_offset, kpm, mask_keys, CAUSAL, KEY_PADDING, BLOCK_N, s_layout)
        p = _p_operand(p, v_smem.dtype, p_layout)
        acc = _after_pv(acc, alpha, EARLY_RESCALE)
        acc, p, alpha, l_i, m_i = _middle_blocks(acc, p, alpha, l_i, m_i, qk_zero, q_smem, k_smem, v_smem, k_bar, v_bar, k_free,
                                                 v_free, g, k_desc, v_desc, k_row0, k_col, qk_scale_log2,
                                                 offs_m, seqlen_k, diag_offset, kpm, mask_keys, n_blocks, 0, full_lo,
                                                 full_hi, CAUSAL, KEY_PADDING, BLOCK_N, NUM_STAGES, PRODUCER, PINGPONG,
                                                 WG, s_layout, p_layout, EARLY_RESCALE)
        # the last block's P·V (only the last block can run past the sequence's end)
        last = n_blocks - 1
        stage = (g + last) % NUM_STAGES
        _v_ready(v_smem, v_bar, stage, ((g + last) // NUM_STAGES) & 1, last, seqlen_k, BLOCK_N, HEAD_DIM,
                 num_warps)
        take_turn(PINGPONG, WG)
        acc = _issue_pv(acc, alpha, p, v_smem.index(stage), EARLY_RESCALE)
        pass_turn(PINGPONG, WG)
        acc = warpgroup_mma_wait(0, deps=[acc])
        if PRODUCER:
            mbarrier.arrive(v_free.index(stage))
        else:
            gl.thread_barrier()
            _refill(v_desc, v_smem, v_bar, k_row0, k_col, last, stage, n_blocks, BLOCK_N, NUM_STAGES)
    return acc, l_i, m_i


@gluon.jit
def _store_out(acc, l_i, m_i, O, LSE, batch, head, m_start, seqlen_q, stride_ob, stride_os, stride_oh,
               stride_lb, stride_lh, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, RETURN_LSE: gl.constexpr,
               COALESCE: gl.constexpr, num_warps: gl.constexpr):
    """Rows ``m_start..`` of the output, ``acc / l`` (softmax.py's ``normalize``: 0 for a row with
    no key), and with ``RETURN_LSE`` their natural-log LSE (-inf for a row with no key).
    ``COALESCE``: store from a layout of 16 contiguous bytes a thread (one exchange through
    shared memory) instead of the MMA layout's 4-byte pieces."""
    o_layout: gl.constexpr = acc.type.layout
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_m = m_start + gl.arange(0, BLOCK_M, layout=row_o)
    l_o = gl.convert_layout(l_i, row_o)
    out = normalize(acc, l_o).to(O.dtype.element_ty)
    o_base = O + batch.to(gl.int64) * stride_ob + head.to(gl.int64) * stride_oh
    store_rows(out, o_base, m_start, seqlen_q, stride_os, BLOCK_M, HEAD_DIM, COALESCE, num_warps)
    if RETURN_LSE:
        lse = log_sum_exp(gl.convert_layout(m_i, row_o), l_o)
        gl.store(LSE + batch.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh + offs_m, lse,
                 mask=offs_m < seqlen_q)


@gluon.jit
def _tile_coords(tile, num_m_blocks, heads, kv_group, HEAVY_FIRST: gl.constexpr, BLOCK_M: gl.constexpr):
    """``(m_start, head, batch, kv_head)`` of a tile (tile_order.py's ``attention_tile``)."""
    pid_m, head, batch = attention_tile(tile, num_m_blocks, heads, HEAVY_FIRST)
    return pid_m * BLOCK_M, head, batch, head // kv_group


@gluon.jit
def _tile_blocks(m_start, seqlen_q, seqlen_k, masked_keys, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr):
    """A tile's key blocks (mask.py's ``key_blocks`` without a window): ``(n_blocks, full_lo,
    full_hi)``, blocks ``[0, n_blocks)`` of which ``[full_lo, full_hi)`` are unmasked for every
    row (the first ``masked_keys`` keys may be masked anywhere)."""
    hi = seqlen_k
    full_hi = seqlen_k // BLOCK_N
    if CAUSAL:
        diag_offset = seqlen_k - seqlen_q
        hi = gl.maximum(gl.minimum(m_start + BLOCK_M + diag_offset, seqlen_k), 0)
        full_hi = gl.minimum(full_hi, gl.maximum(m_start + diag_offset + 1, 0) // BLOCK_N)
    n_blocks = gl.cdiv(hi, BLOCK_N)
    full_lo = gl.minimum(gl.cdiv(masked_keys, BLOCK_N), n_blocks)
    full_hi = gl.maximum(full_hi, full_lo)
    return n_blocks, full_lo, full_hi


@gluon.jit
def _unit_span(unit, full_units, pieces, num_m_blocks, heads, kv_group, seqlen_q, seqlen_k, masked_keys,
               CAUSAL: gl.constexpr, HEAVY_FIRST: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               SPLIT: gl.constexpr):
    """A persistent CTA's work unit: ``(m_start, head, batch, kv_head, kb0, n_blocks, full_lo,
    full_hi)``, its key blocks ``kb0 .. kb0 + n_blocks − 1`` and ``[full_lo, full_hi)`` its tile's
    unmasked ones (:func:`_tile_coords`, :func:`_tile_blocks`). A unit is a tile, or with
    ``SPLIT`` a piece of one of the last tiles (tile_order.py's ``split_unit`` and
    ``piece_blocks``)."""
    if SPLIT:
        tile, piece, tile_pieces = split_unit(unit, full_units, pieces)
        m_start, head, batch, kv_head = _tile_coords(tile, num_m_blocks, heads, kv_group, HEAVY_FIRST, BLOCK_M)
        n_all, full_lo, full_hi = _tile_blocks(m_start, seqlen_q, seqlen_k, masked_keys, CAUSAL, BLOCK_M, BLOCK_N)
        kb0, kb1 = piece_blocks(piece, tile_pieces, n_all)
        return m_start, head, batch, kv_head, kb0, kb1 - kb0, full_lo, full_hi
    else:
        m_start, head, batch, kv_head = _tile_coords(unit, num_m_blocks, heads, kv_group, HEAVY_FIRST, BLOCK_M)
        n_all, full_lo, full_hi = _tile_blocks(m_start, seqlen_q, seqlen_k, masked_keys, CAUSAL, BLOCK_M, BLOCK_N)
        return m_start, head, batch, kv_head, n_all * 0, n_all, full_lo, full_hi


@gluon.jit
def _q_buffer(q_smem, it, wg: gl.constexpr, Q_BUFS: gl.constexpr, ROWS: gl.constexpr, TILE_M: gl.constexpr):
    """The Q rows of an MMA partition (``ROWS`` from ``ROWS·wg``) in the buffer of its ``it``-th tile."""
    if ROWS == TILE_M:
        return q_smem.index(it % Q_BUFS)
    elif q_smem.shape[1] == ROWS:
        # Q in pieces of a partition's rows (a buffer's pieces side by side)
        return q_smem.index((it % Q_BUFS) * (TILE_M // ROWS) + wg)
    else:
        return q_smem.index(it % Q_BUFS).slice(ROWS * wg, ROWS)


@gluon.jit
def _partition_tile(unit, wg: gl.constexpr, KEY_PADDING_MASK, stride_kpm, masked_keys, seqlen_q, seqlen_k, heads,
                    kv_group, num_m_blocks, full_units, pieces, CAUSAL: gl.constexpr, KEY_PADDING: gl.constexpr,
                    HEAVY_FIRST: gl.constexpr, TILE_M: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                    SPLIT: gl.constexpr):
    """An MMA partition's view of a work unit: ``(first row, head, batch, n_blocks, kb0, full_lo,
    full_hi, key-padding row)`` (:func:`_unit_span`: the unit's key blocks, not the partition's
    rows')."""
    m_start, head, batch, kv_head, kb0, n_blocks, full_lo, full_hi = _unit_span(
        unit, full_units, pieces, num_m_blocks, heads, kv_group, seqlen_q, seqlen_k, masked_keys, CAUSAL, HEAVY_FIRST,
        TILE_M, BLOCK_N, SPLIT)
    if KEY_PADDING:
        kpm = KEY_PADDING_MASK + batch.to(gl.int64) * stride_kpm
    else:
        kpm = KEY_PADDING_MASK
    return m_start + ROWS * wg, head, batch, n_blocks, kb0, full_lo, full_hi, kpm


@gluon.jit
def _first_scores(q_buf, k_smem, k_bar, g, qk_zero, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                  WG: gl.constexpr):
    """A tile's block 0: ``S_0 = Q · K_0ᵀ`` issued (asynchronous, in a turn with ``PINGPONG``) once
    K_0 (ring position ``g``) has landed."""
    stage = g % NUM_STAGES
    mbarrier.wait(k_bar.index(stage), (g // NUM_STAGES) & 1)
    take_turn(PINGPONG, WG)
    qk = warpgroup_mma(q_buf, k_smem.index(stage).permute((1, 0)), qk_zero, use_acc=False, is_async=True)
    pass_turn(PINGPONG, WG)
    return qk


@gluon.jit
def _merge_pieces(acc, l_i, m_i, unit, wg: gl.constexpr, full_units, pieces, WS, SPLIT_COUNTER,
                  ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, num_warps: gl.constexpr, PARTS: gl.constexpr):
    """The end of a work unit with the last tiles in key pieces: ``(acc, l, m, store)``. A whole
    tile keeps its state (``store``). A piece before its tile's last writes its unnormalised
    ``(acc, m, l)`` rows to its slot of ``WS`` (fp32, ``ROWS · (HEAD_DIM + 2)`` a slot) and
    arrives on the tile's counter of this partition, every thread on its own (sync.py's
    ``release_add``); it stores nothing. The last piece waits until every thread of the others
    has arrived (``acquire_at_least``, each thread), folds their rows into its own as the online
    softmax folds a block (``m`` the larger maximum, the rest rescaled by ``2^(m_p − m)``), puts
    the counter back to zero for the next launch and stores the tile's rows."""
    store = unit < full_units
    if unit >= full_units:
        o_layout: gl.constexpr = acc.type.layout
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        rows = gl.arange(0, ROWS, layout=row_o)
        offs = gl.expand_dims(rows * HEAD_DIM, 1) + gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout)), 0)
        tail = unit - full_units
        tile = tail // pieces
        piece = tail % pieces
        counter = SPLIT_COUNTER + PARTS * tile + wg
        slot_size: gl.constexpr = ROWS * (HEAD_DIM + 2)
        first_slot = (tile * (pieces - 1) * PARTS + wg).to(gl.int64)
        if piece < pieces - 1:
            base = WS + (first_slot + PARTS * piece) * slot_size
            gl.store(base + offs, acc)
            gl.store(base + ROWS * HEAD_DIM + rows, gl.convert_layout(m_i, row_o))
            gl.store(base + ROWS * HEAD_DIM + ROWS + rows, gl.convert_layout(l_i, row_o))
            release_add(counter)
        else:
            acquire_at_least(counter, (pieces - 1) * num_warps * 32)
            m_o = gl.convert_layout(m_i, row_o)
            l_o = gl.convert_layout(l_i, row_o)
            for p in range(pieces - 1):
                base = WS + (first_slot + PARTS * p) * slot_size
                m_p = gl.load(base + ROWS * HEAD_DIM + rows, cache_modifier=".cg")
                l_p = gl.load(base + ROWS * HEAD_DIM + ROWS + rows, cache_modifier=".cg")
                m_new = gl.maximum(m_o, m_p)
                shift = shift_of(m_new)
                a_o = gl.exp2(m_o - shift)
                a_p = gl.exp2(m_p - shift)
                acc = acc * gl.expand_dims(a_o, 1) + gl.load(base + offs, cache_modifier=".cg") * gl.expand_dims(a_p, 1)
                l_o = l_o * a_o + l_p * a_p
                m_o = m_new
            # every thread of the partition is past its wait before the counter goes back to zero
            gl.thread_barrier()
            gl.store(counter, 0)
            m_i = gl.convert_layout(m_o, m_i.type.layout)
            l_i = gl.convert_layout(l_o, l_i.type.layout)
            store = True
    return acc, l_i, m_i, store


@gluon.jit
def _consumer_tiles_overlapped(wg: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, q_free, k_free, v_free,
                               tile_ids, k_desc, v_desc, O, LSE, KEY_PADDING_MASK, WS, SPLIT_COUNTER,
                               stride_kpm, mask_keys, masked_keys, seqlen_q, seqlen_k, heads, kv_group, num_m_blocks,
                               num_tiles, full_units, pieces, qk_scale_log2, stride_ob, stride_os, stride_oh,
                               stride_lb, stride_lh, CAUSAL: gl.constexpr, KEY_PADDING: gl.constexpr,
                               HEAVY_FIRST: gl.constexpr, TILE_M: gl.constexpr, ROWS: gl.constexpr,
                               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
                               Q_BUFS: gl.constexpr, RETURN_LSE: gl.constexpr, num_warps: gl.constexpr,
                               SPLIT: gl.constexpr, PINGPONG: gl.constexpr, EARLY_RESCALE: gl.constexpr):
    """:func:`_consumer_tiles` with tiles overlapped (persistent): once a
    tile's last P·V is done, the next tile's ``S_0 = Q · K_0ᵀ`` is issued and the tile's output
    normalised and stored (in 16-byte rows, through shared memory) while that WGMMA runs; the next tile's
    loop then starts from block 0's softmax. Q's buffer goes back to the load warp as soon as
    the tile's last Q·Kᵀ is done (before the next tile's Q is waited on, which one Q buffer
    needs). ``SPLIT``: the walk is over work units (:func:`_unit_span`), a piece's rows merged
    by its tile's last piece (:func:`_merge_pieces`) before the store. ``PINGPONG``: a tile's
    first Q·Kᵀ and each Q·Kᵀ with the block before's P·V are issued in turns, the tile's last
    P·V without one (FlashAttention-3's order); after the last tile, warpgroup 1 hands its
    turn to no one."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = gl.arange(0, ROWS, layout=row_s)
    diag_offset = seqlen_k - seqlen_q
    qk_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    m_none = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_none = gl.zeros([ROWS], gl.float32, row_s)
    g = 0
    it = 0
    first_turn(PINGPONG, wg)
    tile = _read_tile(tile_ids, q_bar, 0, Q_BUFS, num_warps)
    m_rows, head, batch, n_blocks, kb0, full_lo, full_hi, kpm = _partition_tile(
        tile, wg, KEY_PADDING_MASK, stride_kpm, masked_keys, seqlen_q, seqlen_k, heads, kv_group, num_m_blocks,
        full_units, pieces, CAUSAL, KEY_PADDING, HEAVY_FIRST, TILE_M, ROWS, BLOCK_N, SPLIT)
    p = gl.zeros([ROWS, BLOCK_N], v_smem.dtype, p_layout)
    alpha = l_none
    l_i = l_none
    m_i = m_none
    if (tile < num_tiles) & (n_blocks > 0):
        qk = warpgroup_mma_wait(0, deps=[_first_scores(_q_buffer(q_smem, 0, wg, Q_BUFS, ROWS, TILE_M), k_smem, k_bar,
                                                       0, qk_zero, NUM_STAGES, PINGPONG, wg)])
        mbarrier.arrive(k_free.index(0))
        p, alpha, l_i, m_i = _block_softmax(qk, kb0, m_i, l_i, full_lo, full_hi, qk_scale_log2, m_rows + rows,
                                            seqlen_k, diag_offset, kpm, mask_keys, CAUSAL, KEY_PADDING, BLOCK_N,
                                            s_layout)
        p = _p_operand(p, v_smem.dtype, p_layout)
    while tile < num_tiles:
        acc = _after_pv(gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout), alpha, EARLY_RESCALE)
        acc, p, alpha, l_i, m_i = _middle_blocks(acc, p, alpha, l_i, m_i, qk_zero,
                                                 _q_buffer(q_smem, it, wg, Q_BUFS, ROWS, TILE_M), k_smem, v_smem,
                                                 k_bar, v_bar, k_free, v_free, g, k_desc, v_desc, 0, 0,
                                                 qk_scale_log2, m_rows + rows, seqlen_k, diag_offset, kpm, mask_keys,
                                                 n_blocks, kb0, full_lo, full_hi, CAUSAL, KEY_PADDING, BLOCK_N,
                                                 NUM_STAGES, True, PINGPONG, wg, s_layout, p_layout, EARLY_RESCALE)
        mbarrier.arrive(q_free.index(it % Q_BUFS))   # the tile's Q·Kᵀ are done
        last = (g + n_blocks - 1) % NUM_STAGES
        if n_blocks > 0:
            _v_ready(v_smem, v_bar, last, ((g + n_blocks - 1) // NUM_STAGES) & 1, kb0 + n_blocks - 1, seqlen_k,
                     BLOCK_N, HEAD_DIM, num_warps)
            acc_t = _issue_pv(acc, alpha, p, v_smem.index(last), EARLY_RESCALE)
        else:
            acc_t = warpgroup_mma_init(acc)
        acc = warpgroup_mma_wait(0, deps=[acc_t])
        if n_blocks > 0:
            mbarrier.arrive(v_free.index(last))
        # the next tile's first Q·Kᵀ, with this tile's output stored under it
        g_next = g + n_blocks
        nxt = _read_tile(tile_ids, q_bar, it + 1, Q_BUFS, num_warps)
        m_next, head_next, batch_next, n_next, kb0_next, lo_next, hi_next, kpm_next = _partition_tile(
            nxt, wg, KEY_PADDING_MASK, stride_kpm, masked_keys, seqlen_q, seqlen_k, heads, kv_group, num_m_blocks,
            full_units, pieces, CAUSAL, KEY_PADDING, HEAVY_FIRST, TILE_M, ROWS, BLOCK_N, SPLIT)
        first = (nxt < num_tiles) & (n_next > 0)
        # issued whatever the next tile (without a block 0 its result is not read): a WGMMA
        # under a branch would make ptxas serialise every WGMMA of the kernel
        stage_next = g_next % NUM_STAGES
        if first:
            mbarrier.wait(k_bar.index(stage_next), (g_next // NUM_STAGES) & 1)
        take_turn(PINGPONG, wg)
        qk_t = warpgroup_mma(_q_buffer(q_smem, it + 1, wg, Q_BUFS, ROWS, TILE_M),
                             k_smem.index(stage_next).permute((1, 0)), qk_zero, use_acc=False, is_async=True)
        if PINGPONG:
            # the last turn of warpgroup 1 is handed to no one
            if (wg == 0) | (nxt < num_tiles):
                pass_turn(PINGPONG, wg)
        # this tile's output under the next tile's first Q·Kᵀ
        if SPLIT:
            acc, l_i, m_i, store = _merge_pieces(acc, l_i, m_i, tile, wg, full_units, pieces, WS, SPLIT_COUNTER, ROWS,
                                                 HEAD_DIM, num_warps, TILE_M // ROWS)
            if store:
                _store_out(acc, l_i, m_i, O, LSE, batch, head, m_rows, seqlen_q, stride_ob, stride_os, stride_oh,
                           stride_lb, stride_lh, ROWS, HEAD_DIM, RETURN_LSE, True, num_warps)
        else:
            _store_out(acc, l_i, m_i, O, LSE, batch, head, m_rows, seqlen_q, stride_ob, stride_os, stride_oh,
                       stride_lb, stride_lh, ROWS, HEAD_DIM, RETURN_LSE, True, num_warps)
        qk = warpgroup_mma_wait(0, deps=[qk_t])
        if first:
            mbarrier.arrive(k_free.index(stage_next))
        # block 0's softmax whatever the next tile (p and the row state of a tile without a
        # block 0, or past the last, are not read; its row state is that of a row with no key)
        p, alpha, l_i, m_i = _block_softmax(qk, kb0_next, m_none, l_none, lo_next, hi_next, qk_scale_log2,
                                            m_next + rows, seqlen_k, diag_offset, kpm_next, mask_keys, CAUSAL,
                                            KEY_PADDING, BLOCK_N, s_layout)
        p = _p_operand(p, v_smem.dtype, p_layout)
        l_i = gl.where(first, l_i, l_none)
        m_i = gl.where(first, m_i, m_none)
        tile = nxt
        m_rows = m_next
        head = head_next
        batch = batch_next
        n_blocks = n_next
        kb0 = kb0_next
        full_lo = lo_next
        full_hi = hi_next
        kpm = kpm_next
        g = g_next
        it += 1


@gluon.jit
def _consumer_tiles(wg: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, q_free, k_free, v_free,
                    tile_ids, k_desc, v_desc, O, LSE, KEY_PADDING_MASK, WS, SPLIT_COUNTER, stride_kpm, mask_keys,
                    masked_keys, seqlen_q, seqlen_k, heads, kv_group, num_m_blocks, num_tiles, full_units, pieces,
                    qk_scale_log2, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                    CAUSAL: gl.constexpr, KEY_PADDING: gl.constexpr, HEAVY_FIRST: gl.constexpr,
                    TILE_M: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    NUM_STAGES: gl.constexpr, Q_BUFS: gl.constexpr, PINGPONG: gl.constexpr,
                    RETURN_LSE: gl.constexpr, num_warps: gl.constexpr, OVERLAP: gl.constexpr, SPLIT: gl.constexpr,
                    EARLY_RESCALE: gl.constexpr):
    """An MMA partition of the warp-specialized kernel: rows ``ROWS·wg ..`` (``ROWS`` of them)
    of each of this CTA's tiles (``TILE_M`` rows). It walks the tiles the load warp publishes,
    takes Q from the buffer the load warp filled, hands it back once the tile's MMAs are done
    and stores from the MMA layout (the ring may already hold the next tile's blocks).
    ``OVERLAP``: :func:`_consumer_tiles_overlapped` instead (the only form that takes ``SPLIT``)."""
    if OVERLAP:
        _consumer_tiles_overlapped(wg, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, q_free, k_free, v_free,
                                   tile_ids, k_desc, v_desc, O, LSE, KEY_PADDING_MASK, WS, SPLIT_COUNTER, stride_kpm,
                                   mask_keys, masked_keys, seqlen_q, seqlen_k, heads, kv_group, num_m_blocks,
                                   num_tiles, full_units, pieces, qk_scale_log2, stride_ob, stride_os, stride_oh,
                                   stride_lb, stride_lh, CAUSAL, KEY_PADDING, HEAVY_FIRST, TILE_M, ROWS, BLOCK_N,
                                   HEAD_DIM, NUM_STAGES, Q_BUFS, RETURN_LSE, num_warps, SPLIT, PINGPONG, EARLY_RESCALE)
    else:
        gl.static_assert(not SPLIT, "key pieces need the overlapped tiles")
        g = 0
        it = 0
        first_turn(PINGPONG, wg)
        tile = _read_tile(tile_ids, q_bar, 0, Q_BUFS, num_warps)
        while tile < num_tiles:
            m_rows, head, batch, n_blocks, kb0, full_lo, full_hi, kpm = _partition_tile(
                tile, wg, KEY_PADDING_MASK, stride_kpm, masked_keys, seqlen_q, seqlen_k, heads, kv_group,
                num_m_blocks, num_tiles, 1, CAUSAL, KEY_PADDING, HEAVY_FIRST, TILE_M, ROWS, BLOCK_N, False)
            qi = it % Q_BUFS
            # (the K/V blocks' rows and column: the load warp's, unused here)
            acc, l_i, m_i = _consumer(_q_buffer(q_smem, it, wg, Q_BUFS, ROWS, TILE_M), k_smem, v_smem, k_bar, v_bar,
                                      k_free, v_free, q_bar.index(qi), (it // Q_BUFS) & 1, g, k_desc, v_desc,
                                      m_rows, 0, 0, seqlen_q, seqlen_k, qk_scale_log2, kpm, mask_keys, n_blocks,
                                      full_lo, full_hi, CAUSAL, KEY_PADDING, ROWS, BLOCK_N, HEAD_DIM, NUM_STAGES, True,
                                      PINGPONG, wg, num_warps, EARLY_RESCALE)
            mbarrier.arrive(q_free.index(qi))
            _store_out(acc, l_i, m_i, O, LSE, batch, head, m_rows, seqlen_q, stride_ob, stride_os, stride_oh,
                       stride_lb, stride_lh, ROWS, HEAD_DIM, RETURN_LSE, False, num_warps)
            g += n_blocks
            it += 1
            tile = _read_tile(tile_ids, q_bar, it, Q_BUFS, num_warps)


@gluon.jit
def attention_fwd_gluon_kernel(
    q_desc, k_desc, v_desc, O, LSE, KEY_PADDING_MASK, TILE_COUNTER, WS, SPLIT_COUNTER,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_kpm,
    q_row_b, q_row_h, q_col_h, k_row_b, k_row_h, k_col_h,
    seqlen_q, seqlen_k, heads, kv_group, num_m_blocks, num_tiles, full_units, pieces, mask_keys, qk_scale_log2,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, KEY_PADDING: gl.constexpr, RETURN_LSE: gl.constexpr, HEAVY_FIRST: gl.constexpr,
    WARP_SPECIALIZE: gl.constexpr, SPLIT_WARPGROUPS: gl.constexpr, PINGPONG: gl.constexpr,
    DYNAMIC: gl.constexpr, Q_BUFS: gl.constexpr, num_warps: gl.constexpr, OVERLAP: gl.constexpr = False,
    SPLIT: gl.constexpr = False, PARTITIONS: gl.constexpr = 1, EARLY_RESCALE: gl.constexpr = False,
):
    """Tiles of ``BLOCK_M`` query rows of one (batch, head), ``num_tiles`` of them
    (:func:`_tile_coords`'s order). Without ``WARP_SPECIALIZE`` the grid is one CTA a tile;
    with it, a CTA runs the tiles tile_order.py's ``next_tile`` gives it from ``program_id`` on
    (persistent when the grid is smaller than ``num_tiles``; ``DYNAMIC``: claimed by ticket),
    its load warp running ahead into the next tile, ``Q_BUFS`` Q buffers (2: the next tile's Q
    loads under this one).
    ``q_desc/k_desc/v_desc``: TMA descriptors over 2-D row views, token s of (b, h) at row
    ``b·row_b + h·row_h + s``, column ``h·col_h`` (blocks ``[BLOCK_M, D]``, ``[BLOCK_N, D]``).
    ``O``: ``(b, sq, h, D)`` strided; ``LSE``: ``(b, h, sq)``. ``KEY_PADDING_MASK``:
    ``(b, ≥ mask_keys)`` bool, unit stride along the keys, ``stride_kpm`` a batch.
    ``TILE_COUNTER``: with ``DYNAMIC``, one int32 at zero (tile_order.py's ``next_tile``), left at
    zero; any pointer without.
    ``SPLIT`` (persistent, ``DYNAMIC``, ``OVERLAP``): ``num_tiles`` counts work units, the first
    ``full_units`` of them whole tiles and the rest the remaining tiles in ``pieces`` key pieces
    each (tile_order.py's ``split_unit``); ``WS``: fp32 scratch, ``(pieces − 1) · 2`` slots of
    ``64 · (D + 2)`` a split tile; ``SPLIT_COUNTER``: two int32 at zero a split tile, left at
    zero (:func:`_merge_pieces`). Without ``SPLIT``, ``full_units = num_tiles``, ``pieces = 1``
    and any pointers."""
    if SPLIT_WARPGROUPS:
        gl.static_assert(WARP_SPECIALIZE and BLOCK_M == 64 * PARTITIONS and num_warps == 4, "64-row partitions")
        gl.static_assert(PARTITIONS == 2 or not PINGPONG, "ping-pong turns between two partitions")
    else:
        gl.static_assert(BLOCK_M == 16 * num_warps, "one warpgroup per 64 query rows")
    if KEY_PADDING:
        masked_keys = gl.minimum(mask_keys, seqlen_k)
    else:
        masked_keys = 0

    # Q's buffers, each in pieces of the descriptor's rows (a TMA box is a power of two: 192 rows take three)
    q_pieces: gl.constexpr = BLOCK_M // q_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [Q_BUFS * q_pieces] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # each consumer partition arrives once when it has read a buffer
    consumers: gl.constexpr = PARTITIONS if SPLIT_WARPGROUPS else 1
    for s in gl.static_range(2):
        mbarrier.init(q_bar.index(s), count=q_pieces)
        mbarrier.init(q_free.index(s), count=consumers)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(k_bar.index(s), count=1)
        mbarrier.init(v_bar.index(s), count=1)
        mbarrier.init(k_free.index(s), count=consumers)
        mbarrier.init(v_free.index(s), count=consumers)
    fence_async_shared()

    if WARP_SPECIALIZE:
        # (cast: a constexpr passed through warp_specialize still compiles both sides of its branches)
        tile_counter = TILE_COUNTER.to(gl.pointer_type(gl.int32))
        producer_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, q_free, k_free, v_free,
                         tile_ids, tile_counter, q_row_b, q_row_h, q_col_h, k_row_b, k_row_h, k_col_h, seqlen_q,
                         seqlen_k, heads, kv_group, num_m_blocks, num_tiles, full_units, pieces, masked_keys, CAUSAL,
                         HEAVY_FIRST, BLOCK_M, BLOCK_N, NUM_STAGES, Q_BUFS, DYNAMIC, SPLIT)
        # each partition's arguments spelled out: passed in one tuple, the constexprs among them
        # (ROWS, the flags) would arrive as values
        if SPLIT_WARPGROUPS and PARTITIONS == 3:
            # 160 registers a partition (the first, the default partition, gets 168: what is left)
            gl.warp_specialize([
                (_consumer_tiles, (0, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, q_free, k_free, v_free,
                                   tile_ids, k_desc, v_desc, O, LSE, KEY_PADDING_MASK, WS, SPLIT_COUNTER, stride_kpm,
                                   mask_keys, masked_keys, seqlen_q, seqlen_k, heads, kv_group, num_m_blocks,
                                   num_tiles, full_units, pieces, qk_scale_log2, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                                   CAUSAL, KEY_PADDING, HEAVY_FIRST, BLOCK_M, 64, BLOCK_N, HEAD_DIM, NUM_STAGES,
                                   Q_BUFS, PINGPONG, RETURN_LSE, 4, OVERLAP, SPLIT, EARLY_RESCALE)),
                (_consumer_tiles, (1, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, q_free, k_free, v_free,
                                   tile_ids, k_desc, v_desc, O, LSE, KEY_PADDING_MASK, WS, SPLIT_COUNTER, stride_kpm,
                                   mask_keys, masked_keys, seqlen_q, seqlen_k, heads, kv_group, num_m_blocks,
                                   num_tiles, full_units, pieces, qk_scale_log2, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                                   CAUSAL, KEY_PADDING, HEAVY_FIRST, BLOCK_M, 64, BLOCK_N, HEAD_DIM, NUM_STAGES,
                                   Q_BUFS, PINGPONG, RETURN_LSE, 4, OVERLAP, SPLIT, EARLY_RESCALE)),
                (_consumer_tiles, (2, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, q_free, k_free, v_free,
                                   tile_ids, k_desc, v_desc, O, LSE, KEY_PADDING_MASK, WS, SPLIT_COUNTER, stride_kpm,
                                   mask_keys, masked_keys, seqlen_q, seqlen_k, heads, kv_group, num_m_blocks,
                                   num_tiles, full_units, pieces, qk_scale_log2, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                                   CAUSAL, KEY_PADDING, HEAVY_FIRST, BLOCK_M, 64, BLOCK_N, HEAD_DIM, NUM_STAGES,
                                   Q_BUFS, PINGPONG, RETURN_LSE, 4, OVERLAP, SPLIT, EARLY_RESCALE)),
                (_producer, producer_args),
            ], [4, 4, 1], [160, 160, 24])
        elif SPLIT_WARPGROUPS:
            gl.warp_specialize([
                (_consumer_tiles, (0, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, q_free, k_free, v_free,
                                   tile_ids, k_desc, v_desc, O, LSE, KEY_PADDING_MASK, WS, SPLIT_COUNTER, stride_kpm,
                                   mask_keys, masked_keys, seqlen_q, seqlen_k, heads, kv_group, num_m_blocks,
                                   num_tiles, full_units, pieces, qk_scale_log2, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                                   CAUSAL, KEY_PADDING, HEAVY_FIRST, BLOCK_M, 64, BLOCK_N, HEAD_DIM, NUM_STAGES,
                                   Q_BUFS, PINGPONG, RETURN_LSE, 4, OVERLAP, SPLIT, EARLY_RESCALE)),
                (_consumer_tiles, (1, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, q_free, k_free, v_free,
                                   tile_ids, k_desc, v_desc, O, LSE, KEY_PADDING_MASK, WS, SPLIT_COUNTER, stride_kpm,
                                   mask_keys, masked_keys, seqlen_q, seqlen_k, heads, kv_group, num_m_blocks,
                                   num_tiles, full_units, pieces, qk_scale_log2, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                                   CAUSAL, KEY_PADDING, HEAVY_FIRST, BLOCK_M, 64, BLOCK_N, HEAD_DIM, NUM_STAGES,
                                   Q_BUFS, PINGPONG, RETURN_LSE, 4, OVERLAP, SPLIT, EARLY_RESCALE)),
                (_producer, producer_args),
            ], [4, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_consumer_tiles, (0, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, q_free, k_free, v_free,
                                   tile_ids, k_desc, v_desc, O, LSE, KEY_PADDING_MASK, WS, SPLIT_COUNTER, stride_kpm,
                                   mask_keys, masked_keys, seqlen_q, seqlen_k, heads, kv_group, num_m_blocks,
                                   num_tiles, full_units, pieces, qk_scale_log2, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                                   CAUSAL, KEY_PADDING, HEAVY_FIRST, BLOCK_M, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES,
                                   Q_BUFS, False, RETURN_LSE, num_warps, False, False, EARLY_RESCALE)),
                (_producer, producer_args),
            ], [1], [24])
    else:
        m_start, head, batch, kv_head = _tile_coords(gl.program_id(0), num_m_blocks, heads, kv_group, HEAVY_FIRST,
                                                     BLOCK_M)
        n_blocks, full_lo, full_hi = _tile_blocks(m_start, seqlen_q, seqlen_k, masked_keys, CAUSAL, BLOCK_M, BLOCK_N)
        k_row0 = batch * k_row_b + kv_head * k_row_h
        k_col = kv_head * k_col_h
        if KEY_PADDING:
            kpm = KEY_PADDING_MASK + batch.to(gl.int64) * stride_kpm
        else:
            kpm = KEY_PADDING_MASK
        mbarrier.expect(q_bar.index(0), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [batch * q_row_b + head * q_row_h + m_start, head * q_col_h],
                                        q_bar.index(0), q_smem.index(0))
        for s in gl.static_range(NUM_STAGES):
            if s < n_blocks:
                load_block(k_desc, k_smem, k_bar, k_row0 + s * BLOCK_N, k_col, s)
                load_block(v_desc, v_smem, v_bar, k_row0 + s * BLOCK_N, k_col, s)
        acc, l_i, m_i = _consumer(q_smem.index(0), k_smem, v_smem, k_bar, v_bar, k_free, v_free, q_bar.index(0), 0,
                                  0, k_desc, v_desc, m_start, k_row0, k_col, seqlen_q, seqlen_k,
                                  qk_scale_log2, kpm, mask_keys, n_blocks, full_lo, full_hi, CAUSAL, KEY_PADDING,
                                  BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, False, False, 0, num_warps, EARLY_RESCALE)
        _store_out(acc, l_i, m_i, O, LSE, batch, head, m_start, seqlen_q, stride_ob, stride_os, stride_oh,
                   stride_lb, stride_lh, BLOCK_M, HEAD_DIM, RETURN_LSE, True, num_warps)

    for s in gl.static_range(2):
        mbarrier.invalidate(q_bar.index(s))
        mbarrier.invalidate(q_free.index(s))
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(k_bar.index(s))
        mbarrier.invalidate(v_bar.index(s))
        mbarrier.invalidate(k_free.index(s))
        mbarrier.invalidate(v_free.index(s))


def gl_dtype(dtype):
    import torch   # the launcher's only use of torch: dtypes

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype(dtype))


def descriptor_spec(view, block, dtype) -> tuple:
    """``(shape, strides, block, layout)`` of a host TMA descriptor over ``view = (rows, cols,
    row_stride)`` of a tensor's storage: what :func:`descriptor_of` needs beside the tensor."""
    rows, cols, row_stride = view
    return [rows, cols], [row_stride, 1], list(block), _smem_layout(tuple(block), dtype)


def descriptor(t, spec) -> TensorDescriptor:
    """The host TMA descriptor of ``spec`` (:func:`descriptor_spec`) over ``t``'s storage,
    validated (alignment, strides, block shape)."""
    return TensorDescriptor(t, *spec)


def descriptor_of(t, spec) -> TensorDescriptor:
    """:func:`descriptor` built without validating it again: for a call whose key fixes the
    shape, strides, dtype and alignment that :func:`descriptor` checked on the key's first call."""
    desc = object.__new__(TensorDescriptor)
    desc.base = t
    desc.shape, desc.strides, desc.block_shape, desc.layout = spec
    desc.padding = "zero"
    return desc
