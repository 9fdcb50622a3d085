"""Which keys a query row may see, shared by the attention kernels (prefill and decode).

FlashAttention's rule, aligned to the bottom-right corner of the score matrix: query row ``i``
has the *diagonal* key ``diag = i + seqlen_k − seqlen_q`` and may see key ``j`` iff

    diag − window_left <= j <= diag + window_right      (and j < seqlen_k)

where an unbounded side is left out (``HAS_LEFT`` / ``HAS_RIGHT`` false) and causal attention
is ``window_right = 0``. The launchers turn ``causal`` / ``window_size`` into these two bounds
(:func:`flashflow.ops.validate.window_bounds`).
"""
import triton
import triton.language as tl


@triton.jit
def rows_mask(offs_rows, n_rows, offs_d, HEAD_DIM: tl.constexpr):
    """``(rows, head_dim)`` tile mask: rows before ``n_rows`` (the sequence's end), real columns
    of a head_dim padded to a power of two."""
    return (offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)


@triton.jit
def key_allowed(in_seq, keys, diag, window_left, window_right,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Mask of the keys each row may see, in whichever orientation the tile is: ``keys`` holds
    the key indices and ``diag`` each row's diagonal key, broadcast against each other (``[1, keys]``
    and ``[rows, 1]`` for a score tile, ``[keys, 1]`` and ``[1, rows]`` for its transpose);
    ``in_seq`` marks the keys (and rows) that exist."""
    allowed = in_seq
    if HAS_RIGHT:
        allowed &= keys <= diag + window_right
    if HAS_LEFT:
        allowed &= keys >= diag - window_left
    return allowed


@triton.jit
def window_start(first_diag, window_left, BLOCK_N: tl.constexpr):
    """First key block any row may see, for rows whose smallest diagonal is ``first_diag``: the
    left edge of the window, rounded down to a block."""
    lo = tl.maximum(first_diag - window_left, 0)
    return (lo // BLOCK_N) * BLOCK_N


@triton.jit
def key_blocks(m_start, m_last, diag_offset, seqlen_k, window_left, window_right, masked_keys,
               BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               HAS_MASKED_KEYS: tl.constexpr):
    """Key range ``[lo, hi)`` of the query rows ``m_start..m_last`` of one tile, and the part
    ``[full_lo, full_hi)`` of it where every row may see every key of a block (the unmasked hot
    loop; it may be empty or lie outside ``[lo, hi)``: the caller clamps). ``diag_offset``:
    ``seqlen_k − seqlen_q``. With ``HAS_MASKED_KEYS``, something the caller reads per key (an
    additive bias over its ``bias_keys``, a key-padding mask over its ``mask_keys``) can mask
    anywhere in the first ``masked_keys`` keys: no block holding one of them is unmasked
    (``masked_keys = seqlen_k``: none is)."""
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = window_start(m_start + diag_offset, window_left, BLOCK_N)
        full_lo = tl.maximum(m_last + diag_offset - window_left, 0)
        full_lo = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(m_last + diag_offset + window_right + 1, seqlen_k)
        right_edge = tl.minimum(m_start + diag_offset + window_right + 1, seqlen_k)
        full_hi = (tl.maximum(right_edge, 0) // BLOCK_N) * BLOCK_N
    if HAS_MASKED_KEYS:
        full_lo = tl.maximum(full_lo, tl.cdiv(masked_keys, BLOCK_N) * BLOCK_N)
    return lo, hi, full_lo, full_hi


@triton.jit
def masked_prefix(bias_keys, mask_keys, HAS_BIAS: tl.constexpr, KEY_PADDING: tl.constexpr):
    """:func:`key_blocks`'s ``masked_keys`` for attention with an additive bias over its first
    ``bias_keys`` keys (``HAS_BIAS``) and/or a key-padding mask over its first ``mask_keys``
    (``KEY_PADDING``): the first keys either may hide anywhere."""
    if HAS_BIAS and KEY_PADDING:
        masked_keys = tl.maximum(bias_keys, mask_keys)
    elif KEY_PADDING:
        masked_keys = mask_keys
    else:
        masked_keys = bias_keys
    return masked_keys


@triton.jit
def query_blocks(n_start, n_last, diag_offset, seqlen_q, window_left, window_right, BLOCK_M: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """The transpose of :func:`key_blocks`: query range ``[lo, hi)`` whose rows may see one of the
    keys ``n_start..n_last``, and the part ``[full_lo, full_hi)`` (whole ``BLOCK_M`` blocks, none
    past ``seqlen_q``) where every row sees every one of them. Row ``i`` sees key ``j`` iff
    ``j − diag_offset − right <= i <= j − diag_offset + left``."""
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = (seqlen_q // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:
        lo = tl.maximum(n_start - diag_offset - window_right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(n_last - diag_offset - window_right, 0), BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(n_last - diag_offset + window_left + 1, seqlen_q)
        full_hi = tl.minimum(full_hi, (tl.maximum(n_start - diag_offset + window_left + 1, 0) // BLOCK_M) * BLOCK_M)
    return lo, hi, full_lo, full_hi


@triton.jit
def split_range(lo, hi, full_lo, full_hi):
    """``(mid_lo, mid_hi)``: ``[lo, hi)`` cut into three loops, masked ``[lo, mid_lo)``, unmasked
    ``[mid_lo, mid_hi)``, masked ``[mid_hi, hi)``; ``full_lo``/``full_hi`` from :func:`key_blocks`
    or :func:`query_blocks` (block multiples, possibly empty or outside ``[lo, hi)``)."""
    mid_lo = tl.minimum(tl.maximum(full_lo, lo), tl.maximum(hi, lo))
    mid_hi = tl.maximum(tl.minimum(full_hi, hi), mid_lo)
    return mid_lo, mid_hi
