"""The Gluon pieces the Hopper (sm90) attention kernels share: a TMA copy into one buffer of a
ring, the ping-pong turns of two MMA warpgroups, the store of an output tile.

A ring is ``NUM_STAGES`` shared-memory buffers, each with a "ready" mbarrier the copy completes
(expect-tx bytes) and, where a load warp fills it, a "free" mbarrier its consumers arrive on;
pass ``p`` over the ring waits on phase ``p & 1``. The turns: warpgroup 0 of two issues its
MMAs first (parity 1 of a fresh barrier passes at once), then each waits for the other's pass.
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
def take_turn(turn, k, PINGPONG: gl.constexpr, WG: gl.constexpr):
    """Wait for warpgroup ``WG``'s ``k``-th turn to issue MMAs (nothing without ``PINGPONG``)."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), (k & 1) ^ (1 if WG == 0 else 0))


@gluon.jit
def pass_turn(turn, PINGPONG: gl.constexpr, WG: gl.constexpr):
    """Hand the turn to the other warpgroup (nothing without ``PINGPONG``)."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG))


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
