"""The shared kernel pieces (kernels/softmax.py, kernels/mask.py) on their own, through Triton's
interpreter, against PyTorch: the online softmax over tiles, the merge of split partials, the
key mask and the key-block ranges the prefill kernel's three loops rely on."""
import math

import pytest
import torch
import triton
import triton.language as tl

from flashflow.device import interpreting
from flashflow.kernels.mask import key_allowed, key_blocks
from flashflow.kernels.softmax import (LOG2E, log_sum_exp, merge_partials, normalize, online_softmax,
                                       online_softmax_scaled)
from flashflow.reference import attention_mask

pytestmark = pytest.mark.skipif(not interpreting(), reason="runs the jit helpers under TRITON_INTERPRET=1")


@triton.jit
def _softmax_tiles(S, V, O, LSE, WS_ACC, WS_ML, n_keys, scale, SCALED: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_N: tl.constexpr, D: tl.constexpr, TILES: tl.constexpr):
    """Rows of base-2 scores S (ROWS × TILES·BLOCK_N, -inf = masked) and values V: the online
    softmax over the tiles, normalised (O, LSE); each tile's partial state also goes to the
    workspace (one split per tile) for the merge test. SCALED 1: ``online_softmax_scaled`` of
    S (scale 1); SCALED 2: its ``MASKED`` form of the raw scores ``S / scale``."""
    r = tl.arange(0, ROWS)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    for t in tl.static_range(TILES):
        s = tl.load(S + r[:, None] * n_keys + t * BLOCK_N + n[None, :])
        v = tl.load(V + (t * BLOCK_N + n[:, None]) * D + d[None, :])
        if SCALED == 2:
            p, alpha, l_i, m_i = online_softmax_scaled(s / scale, m_i, l_i, scale, True)
        elif SCALED == 1:
            p, alpha, l_i, m_i = online_softmax_scaled(s, m_i, l_i, 1.0)
        else:
            p, alpha, l_i, m_i = online_softmax(s, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        # the tile alone, as one split's partial
        p1, a1, l1, m1 = online_softmax(s, tl.full([ROWS], float("-inf"), dtype=tl.float32),
                                        tl.zeros([ROWS], dtype=tl.float32))
        tl.store(WS_ACC + t * ROWS * D + r[:, None] * D + d[None, :], tl.dot(p1, v, input_precision="ieee"))
        tl.store(WS_ML + t * 2 * ROWS + r, m1)
        tl.store(WS_ML + t * 2 * ROWS + ROWS + r, l1)
    tl.store(O + r[:, None] * D + d[None, :], normalize(acc, l_i))
    tl.store(LSE + r, log_sum_exp(m_i, l_i))


@triton.jit
def _merge(WS_ACC, WS_ML, O, LSE, ROWS: tl.constexpr, D: tl.constexpr, TILES: tl.constexpr,
           MASKED: tl.constexpr):
    r = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    acc, l_i, m_i = merge_partials(WS_ACC, WS_ML, 0, r, d, r < ROWS, ROWS, D, TILES, MASKED, "")
    tl.store(O + r[:, None] * D + d[None, :], normalize(acc, l_i))
    tl.store(LSE + r, log_sum_exp(m_i, l_i))


def _run(scaled, masked_rows):
    rows, block_n, d, tiles = 16, 16, 16, 3
    n_keys = block_n * tiles
    s = torch.randn(rows, n_keys, dtype=torch.float32) * 3
    if masked_rows:
        s[2] = float("-inf")                      # a row with no allowed key at all
        s[5, :block_n] = float("-inf")            # a row whose first tile is masked
        s[7, block_n:] = float("-inf")            # and one masked after its first tile
    v = torch.randn(n_keys, d, dtype=torch.float32)
    o, lse = torch.empty(rows, d), torch.empty(rows)
    ws_acc, ws_ml = torch.empty(tiles, rows, d), torch.empty(tiles, 2, rows)
    _softmax_tiles[(1,)](s, v, o, lse, ws_acc, ws_ml, n_keys, 0.37, SCALED=int(scaled), ROWS=rows, BLOCK_N=block_n,
                         D=d, TILES=tiles)
    # reference: softmax of natural-log scores s·ln2 (s is base 2)
    nat = s.double() * math.log(2)
    ref_lse = torch.logsumexp(nat, dim=1)
    ref = torch.nan_to_num(torch.softmax(nat, dim=1)) @ v.double()
    return s, o, lse, ws_acc, ws_ml, ref, ref_lse


@pytest.mark.parametrize("scaled", [False, True])
def test_online_softmax_over_tiles(scaled):
    _, o, lse, _, _, ref, ref_lse = _run(scaled, masked_rows=False)
    assert torch.allclose(o.double(), ref, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)


@pytest.mark.parametrize("scaled", [0, 2])
def test_rows_with_no_key_give_zero_and_minus_inf_never_nan(scaled):
    """The guarded forms: online_softmax, and online_softmax_scaled with MASKED (raw scores,
    -inf where masked, a positive scale: the Gluon kernel's masked blocks)."""
    _, o, lse, _, _, ref, ref_lse = _run(scaled, masked_rows=True)
    assert torch.isfinite(o).all() and (o[2] == 0).all() and torch.isneginf(lse[2])
    keep = torch.isfinite(ref_lse)
    assert torch.allclose(o.double()[keep], ref[keep], atol=1e-5)
    assert torch.allclose(lse.double()[keep], ref_lse[keep], atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_merge_of_split_partials_equals_the_whole(masked):
    _, o, lse, ws_acc, ws_ml, ref, ref_lse = _run(False, masked_rows=True)
    om, lm = torch.empty_like(o), torch.empty_like(lse)
    _merge[(1,)](ws_acc, ws_ml, om, lm, ROWS=16, D=16, TILES=3, MASKED=masked)
    assert torch.allclose(om, o, atol=1e-5) and (om[2] == 0).all()
    assert torch.equal(torch.isinf(lm), torch.isinf(lse))
    fin = torch.isfinite(lse)
    assert torch.allclose(lm[fin], lse[fin], atol=1e-5)


def test_log2e_is_log2_of_e():
    assert LOG2E == pytest.approx(1 / math.log(2), rel=1e-15)


@triton.jit
def _mask_tile(ALLOWED, RANGES, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, KEYS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    pid = tl.program_id(0)
    m_start = pid * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, KEYS)
    diag_offset = seqlen_k - seqlen_q
    allowed = key_allowed(offs_n[None, :] < seqlen_k, offs_n, offs_m[:, None] + diag_offset, window_left,
                          window_right, HAS_LEFT, HAS_RIGHT)
    tl.store(ALLOWED + offs_m[:, None] * KEYS + offs_n[None, :], allowed.to(tl.int8),
             mask=offs_m[:, None] < seqlen_q)
    m_last = tl.minimum(m_start + BLOCK_M, seqlen_q) - 1
    lo, hi, full_lo, full_hi = key_blocks(m_start, m_last, diag_offset, seqlen_k, window_left, window_right,
                                          seqlen_k, BLOCK_N, HAS_LEFT, HAS_RIGHT, False)
    tl.store(RANGES + pid * 4 + tl.arange(0, 4),
             tl.where(tl.arange(0, 4) == 0, lo, tl.where(tl.arange(0, 4) == 1, hi,
                      tl.where(tl.arange(0, 4) == 2, full_lo, full_hi))))


@pytest.mark.parametrize("sq,sk", [(50, 70), (70, 50), (64, 64)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (10, 0), (5, 20), (16, -1)])
def test_key_mask_and_block_ranges(sq, sk, window):
    block_m, block_n, keys = 16, 16, 128
    left, right = window
    tiles = -(-sq // block_m)
    allowed = torch.zeros(sq, keys, dtype=torch.int8)
    ranges = torch.zeros(tiles, 4, dtype=torch.int32)
    _mask_tile[(tiles,)](allowed, ranges, sq, sk, max(left, 0), max(right, 0), BLOCK_M=block_m, BLOCK_N=block_n,
                         KEYS=keys, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0)
    ref = attention_mask(sq, sk, window_size=window)
    assert torch.equal(allowed[:, :sk].bool(), ref) and not allowed[:, sk:].any()
    for t in range(tiles):
        lo, hi, full_lo, full_hi = ranges[t].tolist()
        rows = ref[t * block_m:(t + 1) * block_m]
        seen = rows.any(0).nonzero().flatten()
        if len(seen):     # every key some row sees lies in [lo, hi)
            assert lo <= seen.min() and seen.max() < hi
        # the kernel's clamp of the unmasked loop into [lo, hi): whole blocks (or none) that
        # every row sees entirely
        mid_lo = min(max(full_lo, lo), max(hi, lo))
        mid_hi = max(min(full_hi, hi), mid_lo)
        if mid_hi > mid_lo:
            assert mid_lo % block_n == 0 and (mid_hi - mid_lo) % block_n == 0
            assert rows[:, mid_lo:mid_hi].all()
