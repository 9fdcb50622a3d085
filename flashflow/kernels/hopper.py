"""The Gluon pieces the Hopper (sm90) attention kernels share: a TMA copy into one buffer of a
ring, the ping-pong turns of two MMA warpgroups, the accumulator's rescale, the store of an
output tile.

A ring is ``NUM_STAGES`` shared-memory buffers, each with a "ready" mbarrier the copy completes
(expect-tx bytes) and, where a load warp fills it, a "free" mbarrier its consumers arrive on;
pass ``p`` over the ring waits on phase ``p & 1``. The turns (FlashAttention-3's scheduler
barrier): warpgroup ``w`` of two waits at named barrier ``10 + w`` (``bar.sync``, 256 threads:
its own 128 and the other's arrivals) before issuing its MMAs and arrives at the other's
(``bar.arrive``) once they are issued; warpgroup 1 arrives once before its first turn, so
warpgroup 0 goes first. Named barriers 0 to 1 + partitions are Triton's own (a partition's
``thread_barrier``); a waiting warp is descheduled, where an mbarrier's wait polls. The last
arrival of a walk may be left pending when the CTA exits.
Used by :mod:`flashflow.kernels.attention_gluon` and :mod:`flashflow.kernels.attention_fp8_gluon`.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


@gluon.jit
def load_block(desc, smem, bar, row, col, stage):
    """TMA copy of ``desc``'s block at ``[row, col]`` into buffer ``stage`` of the ring ``smem``,
    completing ``bar[stage]`` (its expected bytes set first)."""
    mbarrier.expect(bar.index(stage), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], bar.index(stage), smem.index(stage))


@gluon.jit
def _bar_sync(ID: gl.constexpr):
    """``bar.sync ID, 256``: wait until the 128 threads of this warpgroup and 128 arrivals of the
    other have reached named barrier ``ID``."""
    if ID == 10:
        gl.inline_asm_elementwise("bar.sync 10, 256;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
    else:
        gl.inline_asm_elementwise("bar.sync 11, 256;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def _bar_arrive(ID: gl.constexpr):
    """``bar.arrive ID, 256``: this warpgroup's 128 arrivals at named barrier ``ID``, no wait."""
    if ID == 10:
        gl.inline_asm_elementwise("bar.arrive 10, 256;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.arrive 11, 256;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def first_turn(PINGPONG: gl.constexpr, WG: gl.constexpr):
    """Before the first turn: warpgroup 1 lets warpgroup 0 take it (nothing without ``PINGPONG``)."""
    if PINGPONG:
        if WG == 1:
            _bar_arrive(10)


@gluon.jit
def take_turn(PINGPONG: gl.constexpr, WG: gl.constexpr):
    """Wait for warpgroup ``WG``'s next turn to issue MMAs (nothing without ``PINGPONG``)."""
    if PINGPONG:
        if WG == 0:
            _bar_sync(10)
        else:
            _bar_sync(11)


@gluon.jit
def pass_turn(PINGPONG: gl.constexpr, WG: gl.constexpr):
    """Hand the turn to the other warpgroup (nothing without ``PINGPONG``)."""
    if PINGPONG:
        if WG == 0:
            _bar_arrive(11)
        else:
            _bar_arrive(10)


@gluon.jit
def rescaled(acc, alpha):
    """``acc · α`` row by row (``alpha`` one value a row, in any row layout): the online
    softmax's accumulator brought to a block's new row maximum."""
    return acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)


@gluon.jit
def store_rows(out, o_base, m_start, seqlen_q, stride_os, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
               COALESCE: gl.constexpr, num_warps: gl.constexpr):
    """Rows ``m_start..`` (those before ``seqlen_q``) of an output tile ``out`` (the MMA
    accumulator's layout, already in the output's dtype) at ``o_base``, ``stride_os`` apart.
    ``COALESCE``: from a layout of 16 contiguous bytes a thread and whole rows a warp (one
    exchange through shared memory, which the allocator may place over a dead K/V ring) instead
    of the MMA layout's 4-byte pieces."""
    if COALESCE:
        st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HEAD_DIM, HEAD_DIM // 8], [num_warps, 1],
                                                   [1, 0])
        out = gl.convert_layout(out, st_layout)
        st_m = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
        st_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, st_layout))
        o_ptrs = o_base + gl.expand_dims(st_m.to(gl.int64) * stride_os, 1) + gl.expand_dims(st_d, 0)
        gl.store(o_ptrs, out, mask=gl.expand_dims(st_m < seqlen_q, 1))
    else:
        o_layout: gl.constexpr = out.type.layout
        offs_m = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = o_base + gl.expand_dims(offs_m.to(gl.int64) * stride_os, 1) + gl.expand_dims(offs_d, 0)
        gl.store(o_ptrs, out, mask=gl.expand_dims(offs_m < seqlen_q, 1))
