"""Reference numerics of SageAttention-style low-precision attention (INT8/FP8 Q·K, FP8 P·V).

A quantized attention kernel is only as good as the numerics it implements, and those numerics
have many small choices (scale granularity, rounding, where the scales are applied, how P is
quantized inside the online softmax). This module fixes every one of them in PyTorch so that a
kernel can be tested against it element by element, and so that the choices themselves can be
measured against exact attention (:func:`flashflow.reference.attention_naive` in float64).

Layout is FlashAttention's: q ``(batch, seqlen_q, heads, head_dim)``, k/v ``(batch, seqlen_k,
kv_heads, head_dim)``; query head ``h`` reads kv head ``h // (heads // kv_heads)`` (GQA/MQA).

The numerics, in the order :func:`attention_fp8_reference` applies them (all in float32, or in
float64 with ``compute_dtype=torch.float64``):

1. **Smoothing K.** ``kmean = mean over seqlen_k of k`` per (batch, kv head, channel) and
   ``ks = k - kmean``. Subtracting one vector from every key adds ``-q·kmean`` to every score of a
   row, which softmax ignores, while it removes the common offset that would otherwise set the
   quantization step of every key (keys of real models share a large one).
2. **Quantizing Q.** The softmax scale and ``log2(e)`` are folded into q first,
   ``qs = q·float(softmax_scale·log2 e)``, so that scores come out in base 2 and the kernel runs
   ``exp2``. One scale per group of ``q_block`` consecutive tokens of one (batch, head):
   ``amax = max(|qs| over the group, 1e-20)``; INT8: ``q_q = round_half_even(qs·(127/amax))``,
   ``sq = amax/127``; FP8: ``q_q = e4m3(qs·(448/amax))``, ``sq = amax/448``.
3. **Quantizing K.** The same on ``ks``, one scale ``sk`` per block of ``k_block`` consecutive
   tokens of one (batch, kv head) (the last block may be partial).
4. **Scores.** ``S = (q_q·k_qᵀ)·(sq[row]·sk[block of column])``: the two scales are multiplied
   first; the dot of integers / e4m3 values is exact (taken in float64, rounded once).
5. **Quantizing V.** One scale per (batch, kv head, channel) over all keys:
   ``v_q = e4m3(v·(448/amax))``, ``sv = amax/448``.
6. **Online softmax** over blocks of ``block_n`` keys, in base 2, as a flash kernel runs it
   (masked scores are ``-inf``; a row that has seen no key yet shifts by 0, not by ``-inf``)::

       m_new = max(m, rowmax(S_j));  shift = m_new, or 0 where m_new = -inf
       alpha = exp2(m - shift);      p = exp2(S_j - shift)
       l     = alpha·l + rowsum(p)                       # p unquantized
       acc   = alpha·acc + e4m3(p·p_scale)·v_q           # products summed exactly, rounded once
       m     = m_new

   and ``out = acc·sv / (p_scale·l)``; a row with ``l = 0`` (no key allowed) gives 0.
   P lies in [0, 1] with its row maximum at 1, so ``p_scale = 448`` puts the largest
   probabilities at the top of the e4m3 range, where its relative step is smallest.
7. **LSE** (natural log): ``(m + log2 l)·ln 2 + (q·kmean)·softmax_scale``: the second term adds
   back the shift that smoothing removed, so the LSE is the true one; ``-inf`` for empty rows.

**Non-finite inputs** (NaN, ±inf) are carried as the kernels carry them, so that they come out
where exact attention puts them, at the granularity of the scales and of the kernel's tiles:

* a non-finite value is quantized as 0: ``kmean``, every amax and the quantized values are those
  of the inputs with 0 in its place (the kernel's 8-bit values of a marked Q token or K block
  may differ: its NaN scale makes them of no account);
* and marked: a Q group holding one (of ``q·softmax_scale·log2 e``) gets ``sq = NaN``, and a K
  block holding one at a key some row may attend gets ``sk = NaN``: the scores of those rows,
  and of every row at an allowed key of that block, are NaN;
* a non-finite V value at a key some row may attend is e4m3's NaN in ``v_q``. The kernel runs
  one program per tile of ``block_m`` query rows over the key blocks ``[0, hi)`` (``hi`` the
  tile's last row's causal bound, else ``seqlen_k``), and the product ``P·V`` of such a block
  takes 0·NaN = NaN: channel ``c`` of every row of a tile that loads the block is NaN, rows that
  do not attend the key included; the reference applies the same rule;
* a key that ``key_padding_mask`` hides from every row marks nothing (its non-finite values
  quantize as 0 in K and V): it cannot reach an output.

``e4m3(x)`` is round-to-nearest-even onto ``torch.float8_e4m3fn`` after clamping to ±448.
Quantized values are returned and used as floating-point tensors of the compute dtype that hold
exactly the integer / e4m3 values a kernel would store.

Masking follows FlashAttention: ``causal`` aligns the diagonal bottom-right (key ``j`` allowed
for query ``i`` iff ``j <= i + seqlen_k - seqlen_q``); ``key_padding_mask`` is bool
``(batch, seqlen_k)``, True for keys that may be attended.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from flashflow.reference.attention import attention_mask

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
E4M3_MAX = 448.0
INT8_MAX = 127.0
QK_FORMATS = ("int8", "fp8")
STRESS_KINDS = ("gaussian", "outliers", "offset", "outliers+offset", "peaked")

_QMAX = {"int8": INT8_MAX, "fp8": E4M3_MAX}
_AMAX_FLOOR = 1e-20  # an all-zero group gets a tiny scale instead of a division by zero
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class QuantizedQKV(NamedTuple):
    """What a quantization kernel writes, as exact values in a floating-point tensor.

    ``q_q`` (batch, seqlen_q, heads, head_dim), ``sq`` (batch, heads, ceil(seqlen_q/q_block));
    ``k_q`` (batch, seqlen_k, kv_heads, head_dim), ``sk`` (batch, kv_heads, ceil(seqlen_k/k_block));
    ``kmean`` (batch, kv_heads, head_dim), zeros without smoothing;
    ``v_q`` (batch, seqlen_k, kv_heads, head_dim), ``sv`` (batch, kv_heads, head_dim).
    ``q_q·sq`` approximates ``q·softmax_scale·log2(e)``, ``k_q·sk`` approximates ``k - kmean``
    and ``v_q·sv`` approximates ``v``.
    """

    q_q: torch.Tensor
    sq: torch.Tensor
    k_q: torch.Tensor
    sk: torch.Tensor
    kmean: torch.Tensor
    v_q: torch.Tensor
    sv: torch.Tensor


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest float8_e4m3fn value (ties to even) after clamping to ±448, returned
    in x's dtype. A float64 x is rounded to float32 first, as torch converts it; the double
    rounding this allows changes a value only when the float32 lands exactly on an e4m3 tie."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


# ----------------------------------------------------------------------------------- checks


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _check_positive(name: str, value, maximum: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and 0 < value <= maximum):
        bound = "" if maximum == math.inf else f" and <= {maximum}"
        raise ValueError(f"{name} must be a finite number > 0{bound}, got {value}")
    return value


def _check_qkv(q, k, v) -> None:
    for name, t, form in (("q", q, "(batch, seqlen_q, heads, head_dim)"),
                          ("k", k, "(batch, seqlen_k, kv_heads, head_dim)"),
                          ("v", v, "(batch, seqlen_k, kv_heads, head_dim)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape {form}, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 {form}, got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if 0 in t.shape:
            raise ValueError(f"{name} must have no empty dimension, got shape {tuple(t.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share head_dim, got {q.shape[3]} and {k.shape[3]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads of q ({q.shape[2]}) must be a multiple of kv_heads ({k.shape[2]})")


def _check_compute_dtype(compute_dtype) -> torch.dtype:
    if compute_dtype not in (torch.float32, torch.float64):
        raise TypeError(f"compute_dtype must be torch.float32 or torch.float64, got {compute_dtype!r}")
    return compute_dtype


def _check_qk_format(qk_format) -> str:
    if qk_format not in QK_FORMATS:
        raise ValueError(f"qk_format must be one of {QK_FORMATS}, got {qk_format!r}")
    return qk_format


def _softmax_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return _check_positive("softmax_scale", softmax_scale)


# ------------------------------------------------------------------------------ quantization


def _quantize_groups(x: torch.Tensor, group: int, fmt: str,
                     marks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``(batch, heads, seqlen, d)`` -> (x_q like x, scale ``(batch, heads, ceil(seqlen/group))``),
    one scale per ``group`` consecutive tokens (amax over the group's tokens × channels) of the
    finite values; a non-finite value quantizes as 0, and the scale of a group with a token
    that ``marks`` ``(batch, heads, seqlen)`` is NaN."""
    b, h, s, d = x.shape
    groups = -(-s // group)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    # Zero padding leaves every amax unchanged and lets a partial last group share the reshape.
    padded = F.pad(x.abs(), (0, 0, 0, groups * group - s))
    amax = padded.reshape(b, h, groups, group * d).amax(dim=-1).clamp_min(_AMAX_FLOOR)
    qmax = _QMAX[fmt]
    inv = (torch.full_like(amax, qmax) / amax).repeat_interleave(group, dim=2)[:, :, :s]
    y = x * inv[..., None]
    # |y| <= qmax up to one rounding of the product, so the int8 clamp never moves a value.
    x_q = torch.round(y).clamp(-INT8_MAX, INT8_MAX) if fmt == "int8" else e4m3(y)
    marked = F.pad(marks.to(x.dtype), (0, groups * group - s)).reshape(b, h, groups, group).amax(dim=-1) > 0
    return x_q, torch.where(marked, torch.full_like(amax, math.nan), amax / qmax)


def _poison(x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """V values as the kernel stores them: a non-finite value at a key some row may attend
    (``attended`` ``(batch, seqlen_k)``; x ``(batch, heads, seqlen_k, d)``) becomes NaN, one at a
    hidden key 0."""
    bad = torch.where(attended[:, None, :, None], torch.full_like(x, math.nan), torch.zeros_like(x))
    return torch.where(torch.isfinite(x), x, bad)


def _quantize_heads_first(q, k, v, scale: float, qk_format: str, q_block: int, k_block: int,
                          smooth_k: bool, cd: torch.dtype, attended: torch.Tensor):
    """The quantization of steps 1-5 with every tensor in ``(batch, heads, seqlen, d)`` layout;
    ``attended`` ``(batch, seqlen_k)``: the keys some row may attend (non-finite inputs)."""
    qf = q.to(cd).transpose(1, 2)
    kf = k.to(cd).transpose(1, 2)
    vf = v.to(cd).transpose(1, 2)
    finite_k = torch.where(torch.isfinite(kf), kf, torch.zeros_like(kf))
    kmean = finite_k.mean(dim=2) if smooth_k else torch.zeros_like(kf[:, :, 0])
    ks = finite_k - kmean[:, :, None]
    c = torch.tensor(scale * LOG2E, dtype=cd, device=q.device)  # one rounding of the folded scale
    qs = qf * c
    q_q, sq = _quantize_groups(qs, q_block, qk_format, ~torch.isfinite(qs).all(dim=-1))
    k_q, sk = _quantize_groups(ks, k_block, qk_format, ~torch.isfinite(kf).all(dim=-1) & attended[:, None])
    finite_v = torch.where(torch.isfinite(vf), vf, torch.zeros_like(vf))
    v_amax = finite_v.abs().amax(dim=2).clamp_min(_AMAX_FLOOR)  # (batch, kv_heads, d)
    v_q = e4m3(finite_v * (torch.full_like(v_amax, E4M3_MAX) / v_amax)[:, :, None])
    v_q = _poison(torch.where(torch.isfinite(vf), v_q, vf), attended)
    sv = v_amax / E4M3_MAX
    return q_q, sq, k_q, sk, kmean, v_q, sv


def _attended(key_padding_mask, batch: int, seqlen_k: int, device) -> torch.Tensor:
    """``(batch, seqlen_k)`` bool: the keys some row may attend (all but those the key-padding
    mask hides; causal hides none: the last row sees every key). Checks the mask."""
    if key_padding_mask is None:
        return torch.ones(batch, seqlen_k, dtype=torch.bool, device=device)
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (batch, seqlen_k), got "
                        f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}")
    if tuple(key_padding_mask.shape) != (batch, seqlen_k):
        raise ValueError(f"key_padding_mask must have shape (batch, seqlen_k) = "
                         f"{(batch, seqlen_k)}, got {tuple(key_padding_mask.shape)}")
    if key_padding_mask.device != device:
        raise ValueError(f"key_padding_mask must be on q's device {device}, "
                         f"got {key_padding_mask.device}")
    return key_padding_mask


def quantize_qkv_reference(q, k, v, softmax_scale=None, qk_format="int8", q_block=1, k_block=64,
                           smooth_k=True, compute_dtype=torch.float32, key_padding_mask=None) -> QuantizedQKV:
    """Steps 1-5 of the module docstring: smoothed, quantized Q/K with their scales, FP8 V with
    its per-channel scales, as :class:`QuantizedQKV` in the compute dtype. ``key_padding_mask``
    ``(batch, seqlen_k)`` matters for non-finite inputs only: a key it hides marks nothing.

    The oracle of a quantization kernel: its int8 / e4m3 outputs, converted to float, should
    equal ``q_q``, ``k_q``, ``v_q`` exactly and its scales equal ``sq``, ``sk``, ``sv`` (up to
    the order of the float32 sum behind ``kmean``).
    """
    _check_qkv(q, k, v)
    cd = _check_compute_dtype(compute_dtype)
    scale = _softmax_scale(softmax_scale, q.shape[3])
    fmt = _check_qk_format(qk_format)
    q_block = _check_int("q_block", q_block)
    k_block = _check_int("k_block", k_block)
    smooth_k = _check_bool("smooth_k", smooth_k)
    attended = _attended(key_padding_mask, q.shape[0], k.shape[1], q.device)
    q_q, sq, k_q, sk, kmean, v_q, sv = _quantize_heads_first(q, k, v, scale, fmt, q_block, k_block,
                                                             smooth_k, cd, attended)
    return QuantizedQKV(q_q.transpose(1, 2), sq, k_q.transpose(1, 2), sk, kmean,
                        v_q.transpose(1, 2), sv)


# --------------------------------------------------------------------------------- attention


def _exact_dot(a: torch.Tensor, b: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """a @ b taken in float64 and rounded once to cd: the sum of products of int8 or e4m3 values
    is exact in float64 (at most ~43 significant bits for head_dim <= 256), so the result is
    defined independently of the order in which a kernel accumulates it."""
    return (a.double() @ b.double()).to(cd)


def attention_fp8_reference(q, k, v, softmax_scale=None, causal=False, key_padding_mask=None,
                            return_lse=False, qk_format="int8", q_block=1, k_block=64,
                            block_n=64, p_scale=448.0, smooth_k=True, quantize_pv=True,
                            compute_dtype=torch.float32, block_m=64):
    """SageAttention-style quantized attention, computed as the module docstring defines it.

    ``qk_format``: ``"int8"`` or ``"fp8"`` (e4m3) for Q and K; ``q_block`` / ``k_block``: tokens
    per Q / K scale (1 = per token); ``block_n``: keys per step of the online softmax (it matters
    because P is quantized against the running row maximum); ``p_scale``: the factor P is
    multiplied by before e4m3 rounding, in (0, 448]; ``smooth_k``: subtract the mean key;
    ``quantize_pv=False`` keeps P and V unquantized (exact P·V, step 5 skipped) to separate the
    error of Q·K from that of P·V; ``block_m``: query rows per kernel tile (it matters only for
    where a non-finite V value reaches, module docstring).

    Returns ``out`` ``(batch, seqlen_q, heads, head_dim)`` and, with ``return_lse``, the natural
    log-sum-exp ``(batch, heads, seqlen_q)``. With ``compute_dtype=torch.float32`` out has q's
    dtype and lse is float32; with ``torch.float64`` both stay float64 (an oracle keeps its
    precision). A row with no allowed key gives out 0 and lse ``-inf``.
    """
    _check_qkv(q, k, v)
    cd = _check_compute_dtype(compute_dtype)
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    scale = _softmax_scale(softmax_scale, head_dim)
    causal = _check_bool("causal", causal)
    return_lse = _check_bool("return_lse", return_lse)
    fmt = _check_qk_format(qk_format)
    q_block = _check_int("q_block", q_block)
    k_block = _check_int("k_block", k_block)
    block_n = _check_int("block_n", block_n)
    block_m = _check_int("block_m", block_m)
    p_scale = _check_positive("p_scale", p_scale, maximum=E4M3_MAX)
    smooth_k = _check_bool("smooth_k", smooth_k)
    quantize_pv = _check_bool("quantize_pv", quantize_pv)
    attended = _attended(key_padding_mask, batch, seqlen_k, q.device)

    q_q, sq, k_q, sk, kmean, v_q, sv = _quantize_heads_first(q, k, v, scale, fmt, q_block,
                                                             k_block, smooth_k, cd, attended)
    group = heads // kv_heads

    def per_q_head(t):  # kv-head tensors, indexed by query head
        return t.repeat_interleave(group, dim=1)

    k_q, kmean, sv = per_q_head(k_q), per_q_head(kmean), per_q_head(sv)
    if quantize_pv:
        values = per_q_head(v_q)
    else:
        values = per_q_head(_poison(v.to(cd).transpose(1, 2), attended))
    row_scale = sq.repeat_interleave(q_block, dim=2)[:, :, :seqlen_q]                  # (b, h, sq)
    col_scale = per_q_head(sk).repeat_interleave(k_block, dim=2)[:, :, :seqlen_k]      # (b, h, sk)

    allowed = attention_mask(seqlen_q, seqlen_k, causal, device=q.device)[None, None]
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]

    # the key blocks [0, tile_hi) that each row's kernel tile (block_m rows) loads
    rows = torch.arange(seqlen_q, device=q.device)
    tile_last = ((rows // block_m + 1) * block_m).clamp(max=seqlen_q) - 1
    tile_hi = (tile_last + seqlen_k - seqlen_q + 1).clamp(max=seqlen_k) if causal else torch.full_like(rows, seqlen_k)

    neg_inf = float("-inf")
    m = torch.full((batch, heads, seqlen_q), neg_inf, dtype=cd, device=q.device)
    l = torch.zeros(batch, heads, seqlen_q, dtype=cd, device=q.device)
    acc = torch.zeros(batch, heads, seqlen_q, head_dim, dtype=cd, device=q.device)
    for n0 in range(0, seqlen_k, block_n):
        n1 = min(n0 + block_n, seqlen_k)
        s = _exact_dot(q_q, k_q[:, :, n0:n1].transpose(-1, -2), cd)
        s = s * (row_scale[..., None] * col_scale[:, :, None, n0:n1])
        s = s.masked_fill(~allowed[..., n0:n1], neg_inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        # A row that has seen no allowed key keeps m = -inf: shift by 0 so exp2 gives 0, not NaN.
        shift = torch.where(m_new == neg_inf, torch.zeros_like(m_new), m_new)
        alpha = torch.exp2(m - shift)
        p = torch.exp2(s - shift[..., None])
        l = l * alpha + p.sum(dim=-1)
        p_dot = e4m3(p * p_scale) if quantize_pv else p
        # NaN in V (a non-finite input) meets every p of the tiles that load the block, 0 included
        block_v = values[:, :, n0:n1]
        nan_v = torch.isnan(block_v)
        pv = _exact_dot(p_dot, block_v.masked_fill(nan_v, 0.0), cd)
        reached = (n0 < tile_hi)[None, None, :, None] & nan_v.any(dim=2)[:, :, None, :]
        acc = acc * alpha[..., None] + pv.masked_fill(reached, math.nan)
        m = m_new

    empty = l == 0
    safe_l = torch.where(empty, torch.ones_like(l), l)
    if quantize_pv:
        out = acc * sv[:, :, None, :] / (p_scale * safe_l)[..., None]
    else:
        out = acc / safe_l[..., None]
    out = out.transpose(1, 2)  # empty rows: every p was 0, so acc and out are 0
    out = out.to(q.dtype) if cd == torch.float32 else out
    if not return_lse:
        return out
    shift_back = torch.einsum("bqhd,bhd->bhq", q.to(cd), kmean) * torch.tensor(scale, dtype=cd)
    # as the kernel: -inf for an empty row, plus the shift (NaN there for a non-finite q)
    lse = ((m + torch.log2(safe_l)) * LN2).masked_fill(empty, neg_inf) + shift_back
    return out, lse


# --------------------------------------------------------------------------------- test inputs


def stress_qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, kind, generator=None,
               dtype=torch.float32, device="cpu"):
    """Inputs (q, k, v) shaped like real activations that are hard on quantized attention.

    v is standard normal for every kind; q and k by ``kind``:

    * ``"gaussian"``: q, k standard normal (scores ~ N(0, 1) at the default softmax scale).
    * ``"outliers"``: as gaussian, with 4 channels per kv head (shared by its query heads, so the
      outliers meet in q·k) scaled ×20 in q and k: one channel sets a token's quantization scale.
    * ``"offset"``: a per-kv-head random vector 4× a key's typical norm added to every key, and
      one 0.5× a query's norm added to every query of the head: most of each key is common.
    * ``"outliers+offset"``: both of the above.
    * ``"peaked"``: q, k scaled ×2.5 (scores ~ N(0, 39)), so each row's softmax is concentrated on
      a few keys, as in diffusion transformers' attention.

    Drawn in float32 on the CPU from ``generator`` (reproducible), then moved to ``dtype`` and
    ``device``.
    """
    for name, value in (("batch", batch), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k),
                        ("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        _check_int(name, value)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if kind not in STRESS_KINDS:
        raise ValueError(f"kind must be one of {STRESS_KINDS}, got {kind!r}")
    if dtype not in _FLOATS:
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    g = generator
    group = heads // kv_heads

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    q = randn(batch, seqlen_q, heads, head_dim)
    k = randn(batch, seqlen_k, kv_heads, head_dim)
    v = randn(batch, seqlen_k, kv_heads, head_dim)
    if "outliers" in kind:
        gain = torch.ones(kv_heads, head_dim)
        for hk in range(kv_heads):
            gain[hk, torch.randperm(head_dim, generator=g)[:min(4, head_dim)]] = 20.0
        k = k * gain
        q = q * gain.repeat_interleave(group, dim=0)
    if "offset" in kind:
        def common(t, times):  # a random direction per head, `times` the mean token norm
            direction = randn(t.shape[2], head_dim)
            direction = direction / direction.norm(dim=-1, keepdim=True)
            return t + times * t.norm(dim=-1).mean(dim=(0, 1))[:, None] * direction
        k = common(k, 4.0)
        q = common(q, 0.5)
    if kind == "peaked":
        q, k = q * 2.5, k * 2.5
    return tuple(t.to(dtype=dtype, device=device) for t in (q, k, v))
