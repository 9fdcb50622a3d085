"""The producer / consumer words of the persistent kernels (the fused FFN's
:mod:`flashflow.kernels.mlp` and :mod:`flashflow.kernels.mlp_splitk`, the decode megakernel
:mod:`flashflow.kernels.decode_layer`): the ``SYNC`` buffer's layout, the signal and the wait,
the last arrival of a merge, and the last program's reset.

Synchronisation words (one int32 ``SYNC`` buffer, zero before a launch and left zero after it):

=========================  ===================================================================
``SYNC[0]``                ticket counter
``SYNC[1]``                programs done
``SYNC[2]``                error flag: a bounded spin ran out (debug; never reset by kernels)
``SYNC[8 : 8+2·1024]``     fence scratch, one word per thread (every other word)
``SYNC[CNT_OFF + 2r + p]`` GEMM0 tiles finished in row-block r (part p: halfrow's two halves)
``SYNC[flag_off + r·n1 + c]``  halfrow, seqsplit: first K-half of GEMM1 tile (r, c) is in the partials
=========================  ===================================================================

Memory ordering (PTX model, ``scope="gpu"``)
--------------------------------------------
*Producer* (a GEMM0 tile, halfrow's first GEMM1 part, the two-stream producer): its threads
store the tile, then **every thread** issues one release atomic of its own on a private scratch
word (in SASS a fence that waits until that thread's stores are performed at GPU scope), then a
CTA barrier (``tl.debug_barrier``) so all of the CTA's stores precede the next step, then one
scalar ``tl.atomic_add(counter, 1, sem="release", scope="gpu")``. The barrier plus the single
release is the textbook pattern (the release is cumulative over what the barrier ordered before
it); the per-thread release costs one atomic per thread per tile and makes the argument not
depend on that cumulativity.

*Consumer*: spins on ``tl.load(counter, volatile=True)`` (relaxed, no fence per iteration; a
scalar acquire spin would cost a barrier and a shared-memory broadcast per iteration), then
**every thread** does one ``tl.atomic_add(counter, 0, sem="acquire", scope="gpu")`` and checks
the value it read, so each thread's later loads of the producer's data are ordered after the
producer's release without relying on a barrier to carry one thread's acquire to the others.
With TMA loads, each thread then issues ``fence.proxy.async.global``: the copy engine's reads
belong to the async proxy, which the generic-proxy acquire does not order by itself. Producers
store H with ordinary stores (a TMA store would complete asynchronously, after the release).

The decode-layer megakernel uses a fenced form of the same protocol on the GPU (``FENCED``
in ``_signal`` / ``_wait``: a ``fence.acq_rel.gpu`` per thread instead of its release atomic,
an ``ld.acquire.gpu`` per thread instead of its acquire atomic, int64 counters): each thread
orders its own accesses as in the atomic form, without the atomics that 132 CTAs crossing a
stage boundary together queue on one L2 line. The kernels here keep the atomic form. Its
partials merged by the last to arrive (``_arrive_last``: every thread releases, one ``acq_rel``
add on an epoch counter, the last arrival acquiring in every thread) serve the megakernel's
split-KV attention and its K slices.

The Gluon attention forward's key pieces (:mod:`flashflow.kernels.attention_gluon`) use a
per-thread form with no barrier: each thread of a piece releases its own stores with one
``red.release.gpu`` on the tile's counter (:func:`release_add`), and each thread of the merging
piece spins with ``ld.acquire.gpu`` until the counter holds every thread's arrival
(:func:`acquire_at_least`); the merging piece puts the counter back to zero after a barrier of
its own warps.

Counters are reset by the last program to finish (a scalar ``acq_rel`` add on a "done"
counter): every other program has then passed all its waits and signals, and the next launch
(or CUDA-graph replay) is stream-ordered after this one, so neither a reset kernel nor an epoch
argument is needed (an epoch passed as an argument would be frozen into a captured graph).
"""
import triton
import triton.language as tl

# SYNC layout (the launchers size and offset the buffer with these)
SYNC_TICKET, SYNC_DONE, SYNC_ERR, SYNC_FENCE = 0, 1, 2, 8
MAX_THREADS = 1024
CNT_OFF = SYNC_FENCE + 2 * MAX_THREADS

# the same numbers as compile-time constants for the @triton.jit code
_TICKET = tl.constexpr(SYNC_TICKET)
_DONE = tl.constexpr(SYNC_DONE)
_ERR = tl.constexpr(SYNC_ERR)
_FENCE = tl.constexpr(SYNC_FENCE)
_CNT_OFF = tl.constexpr(CNT_OFF)


@triton.jit
def _thread_release(SYNC, THREADS: tl.constexpr, FENCED: tl.constexpr = False):
    """Every thread's earlier stores performed at GPU scope: one release atomic per thread on a
    private word (stride 2: no vectorisation, so every thread of the CTA holds exactly one
    element and issues it); FENCED (GPU only): a ``fence.acq_rel.gpu`` per thread instead, no
    atomic and no scratch word."""
    if FENCED:
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        offs = tl.arange(0, THREADS)
        tl.atomic_add(SYNC + _FENCE + 2 * offs, 0, sem="release", scope="gpu")


@triton.jit
def _signal(SYNC, idx, THREADS: tl.constexpr, FENCED: tl.constexpr = False, idx2=-1):
    """Producer side: the CTA's stores are done; publish them through counter ``SYNC[idx]``
    (and ``SYNC[idx2]`` when ``idx2`` ≥ 0: a second consumer counting the same stores)."""
    _thread_release(SYNC, THREADS, FENCED)
    tl.debug_barrier()
    tl.atomic_add(SYNC + idx, 1, sem="release", scope="gpu")
    if idx2 >= 0:
        tl.atomic_add(SYNC + idx2, 1, sem="release", scope="gpu")


@triton.jit
def _wait(SYNC, idx, target, spin_limit, THREADS: tl.constexpr, FENCED: tl.constexpr = False):
    """Consumer side: spin (relaxed) until ``SYNC[idx] >= target``, then acquire per thread: an
    acquire atomic, or with FENCED (GPU only, int64 counters) an ``ld.acquire.gpu`` load (a
    warp's 32 loads of one word are one request, where 32 atomics queue on its L2 line).

    ``spin_limit`` > 0 bounds the spin (debug): on running out the error word is set and the
    program goes on, so a wrong order fails loudly instead of hanging."""
    v = tl.load(SYNC + idx, volatile=True)
    spins = 0
    while (v < target) & ((spin_limit == 0) | (spins < spin_limit)):
        v = tl.load(SYNC + idx, volatile=True)
        spins += 1
    ptrs = SYNC + idx + tl.zeros([THREADS], dtype=tl.int32)
    if FENCED:
        seen = tl.inline_asm_elementwise("ld.acquire.gpu.global.b64 $0, [$1];", "=l,l", [ptrs], dtype=tl.int64,
                                         is_pure=False, pack=1)
    else:
        seen = tl.atomic_add(ptrs, 0, sem="acquire", scope="gpu")
    short = tl.sum((seen < target).to(tl.int32), axis=0)
    if short > 0:
        tl.atomic_xchg(SYNC + _ERR, 1)


@triton.jit
def _arrive_last(SYNC, merge_idx, epoch, PARTS: tl.constexpr, spin_limit, THREADS: tl.constexpr,
                 FENCED: tl.constexpr = False):
    """A partial is stored: release it (every thread, as :func:`_signal` does) and arrive on
    counter ``merge_idx`` (one ``acq_rel`` atomic). Epoch counters, never reset: a counter
    bumped ``PARTS`` times a launch. True for the program that arrives last of the launch's
    ``PARTS``, which has then acquired every partial in every thread (its wait passes at once):
    it merges them."""
    _thread_release(SYNC, THREADS, FENCED)
    tl.debug_barrier()
    arrived = tl.atomic_add(SYNC + merge_idx, 1, sem="acq_rel", scope="gpu")
    last = (epoch + 1) * PARTS
    is_last = arrived == last - 1
    if is_last:
        _wait(SYNC, merge_idx, last, spin_limit, THREADS, FENCED)
    return is_last


@triton.jit
def release_add(counter):
    """This thread's earlier stores released at GPU scope and ``counter`` (int32) bumped by one,
    in one ``red.release.gpu`` a thread: every thread of a producer arrives on its own, so no
    barrier orders one thread's stores before another's release (the Gluon attention forward's
    key pieces). A counter at ``n · threads`` means ``n`` producers are done."""
    tl.inline_asm_elementwise("red.release.gpu.global.add.s32 [$1], 1;\n\tmov.u32 $0, 0;", "=r,l", [counter],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def acquire_at_least(counter, target):
    """Spin, this thread alone, until an ``ld.acquire.gpu`` of ``counter`` reads ``target`` or
    more: this thread's later loads then see every store released before the adds it counted
    (:func:`release_add`). No barrier inside, so the threads of a CTA may leave it apart."""
    seen = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [counter], dtype=tl.int32,
                                     is_pure=False, pack=1)
    while seen < target:
        seen = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [counter],
                                         dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _proxy_fence():
    """Orders this thread's earlier generic-proxy accesses (the acquire above) before its later
    async-proxy ones (TMA loads of the producers' tiles): the PTX model does not order the two
    proxies without it, and the producers stored H with ordinary stores."""
    tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _reset(SYNC, start, count, BLOCK: tl.constexpr):
    for o in range(0, count, BLOCK):
        offs = o + tl.arange(0, BLOCK)
        tl.store(SYNC + start + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=offs < count)


@triton.jit
def _last_out_resets(SYNC, start, count, THREADS: tl.constexpr):
    """End of a ticketed kernel: the last program to finish zeroes ``SYNC[start : start+count]``,
    the ticket and the done counter, for the next launch or graph replay (every other program
    has then passed all its waits and signals)."""
    _thread_release(SYNC, THREADS)
    tl.debug_barrier()
    done = tl.atomic_add(SYNC + _DONE, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        _reset(SYNC, start, count, 1024)
        tl.atomic_xchg(SYNC + _TICKET, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(SYNC + _DONE, 0, sem="relaxed", scope="gpu")
