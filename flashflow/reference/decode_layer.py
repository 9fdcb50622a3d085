"""Reference decode step of a Llama / Qwen-style decoder layer (GQA, RoPE, SwiGLU, RMSNorm),
in plain PyTorch at whatever dtype it is given (float64 for the tests' oracle).

Weights in ``nn.Linear`` layout: ``qkv`` = ``cat([q_proj, k_proj, v_proj])`` ``(heads·d +
2·kv_heads·d, hidden)``, ``o`` ``(hidden, heads·d)``, ``gate_up`` = ``cat([gate_proj, up_proj])``
``(2·inter, hidden)``, ``down`` ``(hidden, inter)``; the norms' weights ``(hidden,)``. RoPE is
the rotate-half form (Llama, Qwen): channel i pairs with i + d/2.
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(length: int, head_dim: int, theta: float, dtype=torch.float64, device="cpu"):
    """``(cos, sin)``, each ``(length, head_dim / 2)``: angle ``pos · theta^(−2i/d)``."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.arange(length, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x (..., d)`` turned by ``cos``/``sin`` ``(..., d/2)`` (broadcast), rotate-half pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def decode_layer_reference(x, weights: dict, k_cache, v_cache, cache_seqlens, *, heads: int, kv_heads: int,
                           eps: float = 1e-5, rope_theta: float = 500000.0):
    """One decode step: ``(out, k_new, v_new)``.

    ``x (batch, hidden)``; ``weights``: ``attn_norm, qkv, o, ffn_norm, gate_up, down``;
    ``k_cache``/``v_cache`` ``(batch, ≥ len, kv_heads, d)`` holding ``cache_seqlens[b]`` tokens of
    sequence b (a Python list or tensor of ints). The new token sits at position
    ``cache_seqlens[b]``; ``k_new``/``v_new`` ``(batch, kv_heads, d)`` are its roped key and its
    value, which the caller appends. Computed in x's dtype.
    """
    batch, _ = x.shape
    d = weights["o"].shape[1] // heads
    group = heads // kv_heads
    lens = [int(n) for n in cache_seqlens]
    qkv = rms_norm(x, weights["attn_norm"], eps) @ weights["qkv"].T
    q = qkv[:, :heads * d].reshape(batch, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].reshape(batch, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].reshape(batch, kv_heads, d)
    cos, sin = rope_tables(max(lens) + 1, d, rope_theta, x.dtype, x.device)
    pos = torch.tensor(lens, device=x.device)
    q = apply_rope(q, cos[pos][:, None, :], sin[pos][:, None, :])
    k = apply_rope(k, cos[pos][:, None, :], sin[pos][:, None, :])
    attn = torch.empty(batch, heads, d, dtype=x.dtype, device=x.device)
    for b in range(batch):
        keys = torch.cat([k_cache[b, :lens[b]].to(x.dtype), k[b][None]])     # (len + 1, kv_heads, d)
        values = torch.cat([v_cache[b, :lens[b]].to(x.dtype), v[b][None]])
        for h in range(heads):
            kv = h // group
            scores = keys[:, kv] @ q[b, h] / d ** 0.5
            attn[b, h] = torch.softmax(scores, 0) @ values[:, kv]
    h1 = x + attn.reshape(batch, heads * d) @ weights["o"].T
    gu = rms_norm(h1, weights["ffn_norm"], eps) @ weights["gate_up"].T
    gate, up = gu.chunk(2, dim=-1)
    out = h1 + (torch.nn.functional.silu(gate) * up) @ weights["down"].T
    return out, k, v
