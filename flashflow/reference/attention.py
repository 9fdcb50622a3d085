"""Reference attention: the naive formula and the tiled online-softmax loop.

Layout is FlashAttention's: q ``(batch, seqlen_q, heads, head_dim)``, k/v ``(batch, seqlen_k,
kv_heads, head_dim)``. Both functions support every feature of :func:`flashflow.flash_attn_func`
(causal aligned bottom-right, sliding window, softcap, GQA/MQA, LSE) and are written for
clarity, not speed. Tests call them in float64.

Masking rule (FlashAttention's): query row ``i`` may attend to key ``j`` iff

    i + (seqlen_k - seqlen_q) - window_left <= j <= i + (seqlen_k - seqlen_q) + window_right

where a negative window side means "unbounded" and ``causal`` means ``window_right = 0``.
A row with no allowed key returns 0 and log-sum-exp ``-inf`` (log of an empty sum).
"""
from __future__ import annotations

import math

import torch


def _normalize_window(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    return left, right


def attention_mask(seqlen_q: int, seqlen_k: int, causal: bool = False,
                   window_size: tuple[int, int] = (-1, -1), device=None) -> torch.Tensor:
    """Boolean ``(seqlen_q, seqlen_k)`` mask, True where query i may attend key j."""
    left, right = _normalize_window(causal, window_size)
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = i + (seqlen_k - seqlen_q)
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        allowed &= j <= diag + right
    if left >= 0:
        allowed &= j >= diag - left
    return allowed


def full_key_padding_mask(key_padding_mask, seqlen_k: int):
    """A key-padding mask over a prefix of the keys, ``(batch, P)`` as flashflow's ops take it,
    as the ``(batch, seqlen_k)`` one the references take: keys from P on are attended. None
    stays None."""
    if key_padding_mask is None:
        return None
    tail = torch.ones(key_padding_mask.shape[0], seqlen_k - key_padding_mask.shape[1], dtype=torch.bool,
                      device=key_padding_mask.device)
    return torch.cat([key_padding_mask, tail], dim=1)


def _expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    kv_heads = k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"heads of q ({heads}) must be a multiple of heads of k/v ({kv_heads})")
    return k.repeat_interleave(heads // kv_heads, dim=2)


def attention_naive(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    key_padding_mask=None, return_lse=False):
    """softmax(mask(softcap(q·kᵀ·scale)))·v, materialising the full score matrix.

    ``key_padding_mask``: optional bool ``(batch, seqlen_k)``, True for keys that may be attended.
    Computes in the inputs' dtype: pass float64 tensors for an oracle.
    """
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    k = _expand_kv(k, heads)
    v = _expand_kv(v, heads)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = attention_mask(seqlen_q, seqlen_k, causal, window_size, device=q.device)
    allowed = allowed[None, None].expand(batch, heads, seqlen_q, seqlen_k)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :].to(torch.bool)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where a row has no key
    probs = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return (out, lse.float() if lse.dtype != torch.float64 else lse) if return_lse else out


def attention_tiled(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    return_lse=False, block_m=64, block_n=64):
    """The FlashAttention forward loop, written in PyTorch.

    For each block of ``block_m`` query rows we keep three running quantities over the key
    blocks seen so far: the row maximum ``m``, the row sum ``l`` of ``exp(s - m)`` and the
    un-normalised output ``acc = Σ exp(s - m)·v``. A new key block with scores ``s`` updates them:

        m_new = max(m, rowmax(s))
        alpha = exp(m - m_new)             # rescales everything accumulated so far
        p     = exp(s - m_new)
        l     = alpha·l + rowsum(p)
        acc   = alpha·acc + p·v

    and at the end ``out = acc / l``, ``lse = m + log(l)``. Only a ``block_m × block_n`` tile of
    scores exists at any time: memory is O(seqlen), not O(seqlen²).
    """
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    k = _expand_kv(k, heads)
    v = _expand_kv(v, heads)
    out = torch.empty_like(q)
    lse_all = torch.empty(batch, heads, seqlen_q, dtype=q.dtype, device=q.device)
    neg_inf = float("-inf")
    for m0 in range(0, seqlen_q, block_m):
        qb = q[:, m0:m0 + block_m].permute(0, 2, 1, 3)  # (b, h, bm, d)
        rows = qb.shape[2]
        m = torch.full((batch, heads, rows), neg_inf, dtype=q.dtype, device=q.device)
        l = torch.zeros(batch, heads, rows, dtype=q.dtype, device=q.device)
        acc = torch.zeros(batch, heads, rows, head_dim, dtype=q.dtype, device=q.device)
        for n0 in range(0, seqlen_k, block_n):
            kb = k[:, n0:n0 + block_n].permute(0, 2, 3, 1)  # (b, h, d, bn)
            vb = v[:, n0:n0 + block_n].permute(0, 2, 1, 3)  # (b, h, bn, d)
            s = (qb @ kb) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            allowed = attention_mask(seqlen_q, seqlen_k, causal, window_size, q.device)
            s = s.masked_fill(~allowed[m0:m0 + rows, n0:n0 + kb.shape[-1]], neg_inf)
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row that has seen no key yet keeps m = -inf; shift by 0 so exp gives 0, not NaN.
            shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - shift)
            p = torch.exp(s - shift[..., None])
            l = alpha * l + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ vb
            m = m_new
        safe_l = torch.where(l == 0, torch.ones_like(l), l)
        out[:, m0:m0 + rows] = (acc / safe_l[..., None]).permute(0, 2, 1, 3)
        lse_all[:, :, m0:m0 + rows] = torch.where(l == 0, torch.full_like(m, neg_inf),
                                                  m + torch.log(safe_l))
    return (out, lse_all) if return_lse else out


def attention_varlen_naive(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, return_lse=False):
    """Packed ragged batch: q ``(total_q, heads, d)``, k/v ``(total_k, kv_heads, d)``.

    Returns out ``(total_q, heads, d)`` and, with ``return_lse``, lse ``(heads, total_q)`` as
    FlashAttention's varlen API does.
    """
    outs, lses = [], []
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        o, lse = attention_naive(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], softmax_scale,
                                 causal, window_size, softcap, return_lse=True)
        outs.append(o[0])
        lses.append(lse[0])
    out = torch.cat(outs, 0)
    return (out, torch.cat(lses, dim=1)) if return_lse else out
