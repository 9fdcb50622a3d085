"""The online softmax shared by the attention kernels (prefill, decode, their split merges).

Scores are kept in the base-2 domain: the launcher folds ``log2(e)`` into the score scale
(``qk_scale_log2 = softmax_scale · LOG2E``) so every exponential is an ``exp2``. A row's running
state is its maximum ``m`` (base 2), its sum ``l = Σ 2^(s − m)`` and its un-normalised output
``acc = Σ 2^(s − m) · v``; the log-sum-exp goes back to natural log only at the end.

A row that has seen no allowed key keeps ``m = -inf``: every update and merge shifts such a row
by 0 instead (:func:`shift_of`), so ``exp2`` gives 0 and never ``exp2(-inf + inf) = NaN``.
"""
import triton
import triton.language as tl

# log2(e) for launchers (Python floats); kernels use the constexprs below
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)
TWO_LOG2E_C: tl.constexpr = tl.constexpr(2.0 * LOG2E)   # exact: a power-of-two multiple
LN2_C: tl.constexpr = tl.constexpr(LN2)


@triton.jit
def tanh(x):
    # through exp2 so that the interpreter and every GPU generation share one code path
    e = tl.math.exp2(x * TWO_LOG2E_C)  # exp(2x)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def softcap_scores(s, qk_scale_log2, softcap):
    """``log2(e) · softcap · tanh(s · scale / softcap)``: the launcher passes ``scale / softcap``
    as ``qk_scale_log2`` when a softcap is on."""
    return tanh(s * qk_scale_log2) * (softcap * LOG2E_C)


@triton.jit
def shift_of(m):
    """The maximum to subtract from a row's scores: 0 for a row with no allowed key yet."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def online_softmax(s, m_i, l_i):
    """Fold a tile of base-2 scores ``s`` (-inf where masked) into the row state ``(m, l)``.

    Returns ``(p, alpha, l, m)``: the tile's probabilities (relative to the new maximum), the
    factor that rescales what was accumulated before, and the new sum and maximum. The caller
    accumulates ``acc · alpha + p · v``.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_shift = shift_of(m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def online_softmax_scaled(qk, m_i, l_i, qk_scale_log2, MASKED: tl.constexpr = False):
    """:func:`online_softmax` of the raw scores ``qk · qk_scale_log2``, the scale folded into one
    FMA per score. Without ``MASKED`` nothing is masked: the maximum is finite, so no shift
    guard. With it, masked raw scores are -inf (``qk_scale_log2`` > 0 keeps them -inf) and a
    row with no allowed key yet is shifted by 0 (:func:`shift_of`), per row, not per score."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale_log2)
    if MASKED:
        m_shift = shift_of(m_new)
    else:
        m_shift = m_new
    p = tl.math.exp2(qk * qk_scale_log2 - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def normalize(acc, l_i):
    """The attention output ``acc / l`` (fp32); a row with no allowed key (l = 0) gives 0."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    return acc / l_safe[:, None]


@triton.jit
def log_sum_exp(m_i, l_i):
    """Natural-log LSE of a row state: ``(m + log2 l) · ln 2``; -inf for a row with no key."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    return tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2_C)


@triton.jit
def merge_partials(WS_ACC, WS_ML, tile, offs_r, offs_d, row_mask,
                   ROWS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS: tl.constexpr,
                   MASKED: tl.constexpr, CACHE: tl.constexpr):
    """Combine the un-normalised partial states of ``SPLITS`` key slices of one tile (the
    flash-decoding merge): ``acc = Σ 2^(m_j − m) · acc_j``, ``l = Σ 2^(m_j − m) · l_j`` with
    ``m = max_j m_j``. Returns ``(acc, l, m)`` for :func:`normalize` / :func:`log_sum_exp`.

    Workspace of partial ``j`` of ``tile`` (``piece = tile · SPLITS + j``): ``WS_ML[piece]`` holds ``ROWS`` maxima
    then ``ROWS`` sums, ``WS_ACC[piece]`` a ``ROWS × HEAD_DIM_PAD`` accumulator, rows ``offs_r``
    of it are merged. ``MASKED``: only rows ``row_mask`` were written; ``CACHE``: the loads'
    cache modifier (".cg" where another program of this launch wrote the partials).
    Unrolled: the partials' loads are independent and issue back to back.
    """
    m_tot = tl.full(offs_r.shape, float("-inf"), dtype=tl.float32)
    for j in tl.static_range(SPLITS):
        if MASKED:
            m_tot = tl.maximum(m_tot, tl.load(WS_ML + (tile * SPLITS + j) * (2 * ROWS) + offs_r, mask=row_mask,
                                              other=float("-inf"), cache_modifier=CACHE))
        else:
            m_tot = tl.maximum(m_tot, tl.load(WS_ML + (tile * SPLITS + j) * (2 * ROWS) + offs_r, cache_modifier=CACHE))
    m_shift = shift_of(m_tot)
    l_tot = tl.zeros(offs_r.shape, dtype=tl.float32)
    acc = tl.zeros([offs_r.shape[0], HEAD_DIM_PAD], dtype=tl.float32)
    for j in tl.static_range(SPLITS):
        piece = tile * SPLITS + j
        if MASKED:
            w = tl.math.exp2(tl.load(WS_ML + piece * (2 * ROWS) + offs_r, mask=row_mask,
                                     other=float("-inf"), cache_modifier=CACHE) - m_shift)
            l_tot += w * tl.load(WS_ML + piece * (2 * ROWS) + ROWS + offs_r, mask=row_mask,
                                 other=0.0, cache_modifier=CACHE)
            acc += w[:, None] * tl.load(WS_ACC + piece.to(tl.int64) * (ROWS * HEAD_DIM_PAD)
                                        + offs_r[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                                        mask=row_mask[:, None], other=0.0, cache_modifier=CACHE)
        else:
            w = tl.math.exp2(tl.load(WS_ML + piece * (2 * ROWS) + offs_r, cache_modifier=CACHE) - m_shift)
            l_tot += w * tl.load(WS_ML + piece * (2 * ROWS) + ROWS + offs_r, cache_modifier=CACHE)
            a = tl.load(WS_ACC + piece.to(tl.int64) * (ROWS * HEAD_DIM_PAD)
                        + offs_r[:, None] * HEAD_DIM_PAD + offs_d[None, :], cache_modifier=CACHE)
            acc += w[:, None] * a
    return acc, l_tot, m_tot
