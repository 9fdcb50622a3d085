"""Reference decode attention against a KV cache, and the cache layouts it reads.

Cache layouts (``kv_layout``):
  * ``"NHD"`` contiguous: k/v cache ``(batch, capacity, kv_heads, head_dim)`` (FlashAttention's).
  * ``"NHD"`` paged: k/v cache ``(num_blocks, page_size, kv_heads, head_dim)`` plus
    ``block_table (batch, max_blocks)``: token ``t`` of sequence ``b`` lives in page
    ``block_table[b, t // page_size]`` at row ``t % page_size``.
  * ``"FT"`` (FasterTransformer's masked multi-head attention): K ``(batch, kv_heads, head_dim/x,
    capacity, x)`` with ``x`` = 16 bytes of elements (8 for fp16/bf16), so that one thread's 16-byte
    load holds x consecutive channels of one token; V ``(batch, kv_heads, capacity, head_dim)``.
"""
from __future__ import annotations

import torch

from flashflow.reference.attention import attention_naive


def ft_x(dtype: torch.dtype) -> int:
    """Elements per 16 bytes: the innermost K-cache split of the FasterTransformer layout."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def to_ft_k(k: torch.Tensor, x: int | None = None) -> torch.Tensor:
    """(batch, seqlen, heads, d) -> FasterTransformer K layout (batch, heads, d/x, seqlen, x)."""
    b, s, h, d = k.shape
    x = x or ft_x(k.dtype)
    return k.reshape(b, s, h, d // x, x).permute(0, 2, 3, 1, 4).contiguous()


def from_ft_k(k_ft: torch.Tensor) -> torch.Tensor:
    b, h, dx, s, x = k_ft.shape
    return k_ft.permute(0, 3, 1, 2, 4).reshape(b, s, h, dx * x)


def to_ft_v(v: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen, heads, d) -> (batch, heads, seqlen, d)."""
    return v.transpose(1, 2).contiguous()


def from_ft_v(v_ft: torch.Tensor) -> torch.Tensor:
    return v_ft.transpose(1, 2)


def gather_cache(cache: torch.Tensor, block_table: torch.Tensor | None, b: int, length: int) -> torch.Tensor:
    """The first ``length`` tokens of sequence ``b``: ``(length, kv_heads, head_dim)``."""
    if block_table is None:
        return cache[b, :length]
    page = cache.shape[1]
    idx = torch.arange(length, device=cache.device)
    pages = block_table[b, idx // page].long()
    return cache[pages, idx % page]


E4M3_MAX = 448.0


def quantize_e4m3(x: torch.Tensor, scale) -> torch.Tensor:
    """``x / scale`` in float32 (IEEE division), saturated at ±448 and rounded to nearest even
    onto the e4m3 grid: what the decode kernel's append stores. ``scale`` broadcasts against x."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _head_scale(scale, kv_heads: int, device) -> torch.Tensor:
    """A cache scale (None, a float, or a (kv_heads,) tensor) as float32 ``(kv_heads,)``."""
    if scale is None:
        scale = 1.0
    return torch.as_tensor(scale, dtype=torch.float32, device=device).expand(kv_heads).clone()


def _append(k_cache, v_cache, k, v, lens, block_table):
    """Write the new tokens ``k``/``v`` of each sequence at its length, in place."""
    for b in range(k.shape[0]):
        pos = torch.arange(lens[b], lens[b] + k.shape[1], device=k.device)
        if block_table is None:
            k_cache[b, pos] = k[b]
            v_cache[b, pos] = v[b]
        else:
            page = k_cache.shape[1]
            pages = block_table[b, pos // page].long()
            k_cache[pages, pos % page] = k[b]
            v_cache[pages, pos % page] = v[b]


def kvcache_attention_ref(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                          softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                          kv_layout="NHD", k_scale=None, v_scale=None):
    """Decode attention by gathering each sequence's keys and calling the naive reference.

    Returns ``(out, lse, k_cache_new, v_cache_new)``: the caches after appending ``k``/``v`` at
    ``cache_seqlens`` (copies; the inputs are not modified). Causal is aligned bottom-right: the
    ``seqlen_q`` queries are the last ``seqlen_q`` positions of each sequence.

    FP8 caches (``float8_e4m3fn``) are read as ``cache · scale`` (``k_scale``/``v_scale``: None,
    a float, or a ``(kv_heads,)`` tensor); new tokens are quantized by :func:`quantize_e4m3`,
    appended, and attended as stored. The attention itself runs in q's dtype (float64 in tests).
    ``causal`` is False by default, as in :func:`flashflow.flash_attn_with_kvcache`.
    """
    ft_split = k_cache.shape[-1] if kv_layout == "FT" else None  # x of the caller's dtype
    if kv_layout == "FT":
        k_cache, v_cache = from_ft_k(k_cache), from_ft_v(v_cache)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    batch, seqlen_q = q.shape[:2]
    capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    n_new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        lens = [capacity - n_new] * batch
    elif isinstance(cache_seqlens, int):
        lens = [cache_seqlens] * batch
    else:
        lens = [int(x) for x in cache_seqlens.tolist()]
    if fp8:
        ks = _head_scale(k_scale, k_cache.shape[2], q.device)
        vs = _head_scale(v_scale, k_cache.shape[2], q.device)
        if n_new:
            _append(k_cache, v_cache, quantize_e4m3(k, ks[:, None]), quantize_e4m3(v, vs[:, None]), lens,
                    block_table)
        k_read = k_cache.to(q.dtype) * ks.to(q.dtype)[:, None]
        v_read = v_cache.to(q.dtype) * vs.to(q.dtype)[:, None]
    else:
        if n_new:
            _append(k_cache, v_cache, k, v, lens, block_table)
        k_read, v_read = k_cache, v_cache
    outs, lses = [], []
    for b in range(batch):
        total = lens[b] + n_new
        kb = gather_cache(k_read, block_table, b, total)
        vb = gather_cache(v_read, block_table, b, total)
        o, lse = attention_naive(q[b:b + 1], kb[None], vb[None], softmax_scale, causal, window_size,
                                 softcap, return_lse=True)
        outs.append(o)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    if kv_layout == "FT":
        k_cache, v_cache = to_ft_k(k_cache, ft_split), to_ft_v(v_cache)
    return out, lse, k_cache, v_cache


def merge_attention_states_ref(out_a, lse_a, out_b, lse_b):
    """Combine two attention results over disjoint key sets (FlashAttention layouts).

    out ``(batch, seqlen, heads, d)``, lse ``(batch, heads, seqlen)``; lse = -inf means "no key".
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).transpose(1, 2)[..., None]
    wb = torch.exp(lse_b - safe).transpose(1, 2)[..., None]
    return wa * out_a + wb * out_b, lse
