"""Split-K FFN for decode batch sizes (M ≤ 64): both GEMMs in one launch, weights read once.

Tiling
------
Grid: one program per ``BLOCK_I`` slice of the intermediate dimension. A program

1. computes its slice of the intermediate, ``h = act(x·W_gateᵀ[slice]) ∘ (x·W_upᵀ[slice])``
   (or ``act(x·W1ᵀ[slice])``), streaming those weight rows over the hidden dimension in
   ``BLOCK_K`` steps, with fp32 accumulation; ``h`` stays in registers;
2. immediately multiplies it into the output: ``out += h·W_down[:, slice]ᵀ``, streaming that
   column slice of ``W_down`` in ``BLOCK_N`` tiles and adding the fp32 partials into a workspace
   with atomic adds (split-K over the intermediate). Triton emits them as 16-byte vector
   reductions (``atom.global.gpu.relaxed.add.v4.f32`` → SASS ``REDG.E.ADD.F32x4``);
3. a second, tiny launch (``mlp_splitk_cast_kernel``) casts the workspace to the output dtype and
   zeroes it, so the next call (or CUDA-graph replay) starts clean.

``STAGGER`` rotates each program's loops to start at tile ``pid mod tiles`` (1: the output
loop, 2: the K loop too), so the programs neither read the same x tile nor add into the same
output tile at the same moment. ``PDL`` (sm90+, with the cast launched programmatically
dependent): the main kernel lets the cast's programs become resident early; they wait in
``griddepcontrol.wait``, which returns once the main grid has completed and its writes are
visible — the same guarantee as stream order, without the launch gap.

Why a second launch for the cast: a last-arriver cast inside the main kernel (CTA barrier,
per-thread release atomics, then an acq_rel arrival counter) still read incomplete sums on the
H100 in about one run in three at M = 16; grid completion is
the ordering guarantee that cannot be got wrong, for ~1–2 µs inside a CUDA graph.

Bytes: every weight byte is read exactly once (3·hidden·inter·2 for SwiGLU in bf16: 352 MB for
Llama-3-8B), x and the workspace stay in L2. FLOPs: 2·M per weight element — negligible at
M ≤ 64: the floor is weight bytes over DRAM bandwidth.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashflow.kernels.mlp import _act
from flashflow.kernels.sync import _TICKET, _last_out_resets, _signal, _wait


@triton.jit
def _h_slice(X, W1, sl, M, hidden, inter, stride_xm, stride_w1, offs_m, m_ok,
             BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
             ACTIVATION: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGGER: tl.constexpr):
    """``h = act(x·W_gate[slice]ᵀ) ∘ (x·W_up[slice]ᵀ)`` (or ``act(x·W1[slice]ᵀ)``) for slice ``sl``
    of ``BLOCK_I`` intermediate columns, all M tokens, rounded to the weights' dtype as the
    unfused FFN rounds it. For SwiGLU the gate row i and the up row i + inter are loaded
    interleaved into one tile, so a single dot yields both, split after."""
    offs_k = tl.arange(0, BLOCK_K)
    if GATED:
        offs_r = tl.arange(0, 2 * BLOCK_I)
        rows = sl * BLOCK_I + offs_r // 2 + (offs_r % 2) * inter
        r_ok = (sl * BLOCK_I + offs_r // 2) < inter
    else:
        rows = sl * BLOCK_I + tl.arange(0, BLOCK_I)
        r_ok = rows < inter
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_I if GATED else BLOCK_I], dtype=tl.float32)
    n_k = tl.cdiv(hidden, BLOCK_K)
    k_first = sl % n_k if STAGGER >= 2 else 0
    for kt in range(0, n_k):
        kk = ((kt + k_first) % n_k) * BLOCK_K + offs_k
        k_ok = kk < hidden
        x = tl.load(X + offs_m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W1 + rows[:, None].to(tl.int64) * stride_w1 + kk[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, w.T, acc, input_precision=DOT_PRECISION)
    if GATED:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_I, 2]))
        h = _act(gate, ACTIVATION) * up
    else:
        h = _act(acc, ACTIVATION)
    return h.to(W1.dtype.element_ty)


@triton.jit
def _add_into_output(WS, W2, h, offs_i, i_ok, n_lo, n_hi, rot, M, hidden, stride_w2, offs_m, m_ok,
                     BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``ws[:, n_lo:n_hi] += h·W_down[n_lo:n_hi, offs_i]ᵀ`` in ``BLOCK_N`` steps, fp32 atomic adds
    (16-byte vector reductions on sm90), the loop started at step ``rot`` (mod steps)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    n_n = tl.cdiv(n_hi - n_lo, BLOCK_N)
    n_first = rot % n_n
    for nt in range(0, n_n):
        offs_n = n_lo + ((nt + n_first) % n_n) * BLOCK_N + offs_n0
        n_ok = offs_n < n_hi
        w2 = tl.load(W2 + offs_n[:, None].to(tl.int64) * stride_w2 + offs_i[None, :],
                     mask=n_ok[:, None] & i_ok[None, :], other=0.0)
        part = tl.dot(h, w2.T, input_precision=DOT_PRECISION)
        tl.atomic_add(WS + offs_m[:, None] * hidden + offs_n[None, :], part,
                      mask=m_ok[:, None] & n_ok[None, :], sem="relaxed")


@triton.jit
def mlp_splitk_kernel(
    X, W1, W2, WS,
    M, hidden, inter,
    stride_xm, stride_w1, stride_w2,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    GATED: tl.constexpr, ACTIVATION: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STAGGER: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    if PDL:  # let the cast launch's programs get resident now; they wait for this grid to end
        gdc_launch_dependents()
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = offs_i < inter
    # 1. this program's slice of the intermediate
    h = _h_slice(X, W1, pid, M, hidden, inter, stride_xm, stride_w1, offs_m, m_ok, BLOCK_M, BLOCK_I, BLOCK_K,
                 GATED, ACTIVATION, DOT_PRECISION, STAGGER)
    # 2. multiply the slice straight into the output (split-K over the intermediate)
    _add_into_output(WS, W2, h, offs_i, i_ok, 0, hidden, pid if STAGGER >= 1 else 0, M, hidden,
                     stride_w2, offs_m, m_ok, BLOCK_N, DOT_PRECISION)


@triton.jit
def mlp_splitk_grouped_kernel(
    X, W1, W2, WS, H, SYNC,
    M, hidden, inter, n_slices, n_groups, n_chunks, chunk_n, grp_off, spin_limit,
    stride_xm, stride_w1, stride_w2,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr, DOT_PRECISION: tl.constexpr,
    THREADS: tl.constexpr, STAGGER: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """Split-K with the partials of ``GROUP`` slices summed on chip: G× fewer fp32 atomics.

    Persistent, tickets (``SYNC[0]``) in dependency order:

    * tickets ``[0, n_slices)``: slice ``t`` of h (as ``mlp_splitk_kernel``'s step 1), stored to
      ``H`` (M × inter, the weights' dtype), then ``_signal`` on its group's counter
      ``SYNC[grp_off + t // GROUP]``;
    * then ``n_chunks`` items per group ``g``, item ``c`` adding
      ``h[:, group g]·W_down[chunk c, group g]ᵀ`` into output columns
      ``[c·chunk_n, (c+1)·chunk_n)`` (no chunk empty): ``_wait`` until the group's counter holds all its slices,
      load the ``GROUP·BLOCK_I`` columns of h, stream the W_down tile rows, atomic-add fp32.

    Every weight byte is still read once. Bytes added to the accumulator: ``n_groups · M ·
    hidden · 4`` instead of ``n_slices · M · hidden · 4``; h goes through L2 (M · inter · e
    written once, read ``n_chunks`` times).

    Memory ordering: ``flashflow.kernels.sync``'s producer/consumer protocol (per-thread release
    then CTA barrier then a release add; relaxed spin then per-thread acquire), and its
    deadlock argument: an item waits only on slices with smaller tickets, taken by running
    programs. The last program out resets the ticket, the group counters and the done counter
    (``SYNC[1]``), so the next launch or graph replay starts from zero. The accumulator is
    cast and zeroed by ``mlp_splitk_cast_kernel`` as for the plain kernel."""
    if PDL:  # let the cast launch's programs get resident now; they wait for this grid to end
        gdc_launch_dependents()
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    total = n_slices + n_groups * n_chunks
    t = tl.atomic_add(SYNC + _TICKET, 1, sem="relaxed", scope="gpu")
    while t < total:
        if t < n_slices:
            h = _h_slice(X, W1, t, M, hidden, inter, stride_xm, stride_w1, offs_m, m_ok, BLOCK_M, BLOCK_I,
                         BLOCK_K, GATED, ACTIVATION, DOT_PRECISION, STAGGER)
            offs_s = t * BLOCK_I + tl.arange(0, BLOCK_I)
            tl.store(H + offs_m[:, None] * inter + offs_s[None, :], h, mask=m_ok[:, None] & (offs_s < inter)[None, :])
            _signal(SYNC, grp_off + t // GROUP, THREADS)
        else:
            g = (t - n_slices) // n_chunks
            c = (t - n_slices) % n_chunks
            _wait(SYNC, grp_off + g, tl.minimum(GROUP, n_slices - g * GROUP), spin_limit, THREADS)
            offs_g = g * (GROUP * BLOCK_I) + tl.arange(0, GROUP * BLOCK_I)
            g_ok = offs_g < inter
            hg = tl.load(H + offs_m[:, None] * inter + offs_g[None, :], mask=m_ok[:, None] & g_ok[None, :],
                         other=0.0, cache_modifier=".cg")
            n_lo = c * chunk_n
            _add_into_output(WS, W2, hg, offs_g, g_ok, n_lo, tl.minimum(n_lo + chunk_n, hidden),
                             g if STAGGER >= 1 else 0, M, hidden, stride_w2, offs_m, m_ok, BLOCK_N, DOT_PRECISION)
        t = tl.atomic_add(SYNC + _TICKET, 1, sem="relaxed", scope="gpu")

    _last_out_resets(SYNC, grp_off, n_groups, THREADS)


@triton.jit
def mlp_splitk_cast_kernel(WS, OUT, M, hidden, stride_om, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out = ws.to(dtype); ws = 0 (ready for the next call). Stream order after the main kernel
    makes every program's atomic adds visible here: no in-kernel arrival protocol to get wrong."""
    if PDL:  # launched early (programmatic dependent launch): wait until the main grid is done
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * hidden
    total = tl.load(WS + offs, mask=mask, other=0.0)
    tl.store(OUT + (offs // hidden) * stride_om + offs % hidden, total.to(OUT.dtype.element_ty), mask=mask)
    tl.store(WS + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)
