"""Reference versions of the diffusion block's normalisation ops (the oracles of
:mod:`flashflow.ops.norm`), written the way diffusers' Qwen-Image block computes them
(``QwenImageTransformerBlock._modulate``, ``nn.LayerNorm``, ``RMSNorm``,
``apply_rotary_emb_qwen(..., use_real=False)``). Pass float64 tensors for an oracle; the
complex frequencies are then taken in complex128.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def modulation(param: torch.Tensor, x: torch.Tensor, index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``param`` (B, D), or (2B, D) with ``index`` (B, L), broadcast to each token of x (B, L, D):
    token (b, l) takes row b where ``index[b, l] == 0``, else row B + b."""
    if index is None:
        return param.unsqueeze(1)
    batch = param.shape[0] // 2
    return torch.where(index.unsqueeze(-1) == 0, param[:batch].unsqueeze(1), param[batch:].unsqueeze(1))


def layernorm_modulate(x, shift, scale, eps=1e-6, index=None):
    """``LayerNorm(x, no affine, eps)·(1 + scale) + shift``, per token's modulation row."""
    normed = F.layer_norm(x, (x.shape[-1],), eps=eps)
    return normed * (1 + modulation(scale, x, index)) + modulation(shift, x, index)


def gate_residual(residual, y, gate, index=None):
    """``residual + gate·y``."""
    return residual + modulation(gate, residual, index) * y


def gate_residual_layernorm_modulate(residual, y, gate, shift, scale, eps=1e-6, index=None):
    """``(new_residual, layernorm_modulate(new_residual, shift, scale))`` with
    ``new_residual = residual + gate·y``."""
    new_residual = gate_residual(residual, y, gate, index)
    return new_residual, layernorm_modulate(new_residual, shift, scale, eps, index)


def rmsnorm(x, weight=None, eps=1e-6):
    """diffusers' ``RMSNorm`` over the last dim: statistics in float32 (float64 for float64
    input), the normalised values cast to a fp16/bf16 weight's dtype before the multiply, or
    back to x's dtype when there is no weight."""
    stats_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    variance = x.to(stats_dtype).pow(2).mean(-1, keepdim=True)
    normed = x * torch.rsqrt(variance + eps)
    if weight is None:
        return normed.to(x.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        normed = normed.to(weight.dtype)
    return normed * weight


def rope(x, freqs):
    """Rotary embedding of x (B, S, H, D): pairs ``(x[2i], x[2i+1])`` as complex numbers times
    ``freqs[s, i]`` (complex, (S, D/2)); in float32 (complex64), or float64 for float64 x."""
    real_dtype, complex_dtype = ((torch.float64, torch.complex128) if x.dtype == torch.float64
                                 else (torch.float32, torch.complex64))
    pairs = torch.view_as_complex(x.to(real_dtype).unflatten(-1, (-1, 2)))   # also for an empty seqlen
    rotated = pairs * freqs.to(x.device, complex_dtype).unsqueeze(1)
    return torch.view_as_real(rotated).flatten(3)


def rmsnorm_rope(x, weight, freqs, eps=1e-6):
    """``rope(rmsnorm(x, weight, eps), freqs)`` in x's dtype (the q/k path of Qwen-Image's
    attention processor, for x (B, S, H, D))."""
    return rope(rmsnorm(x, weight, eps), freqs).to(x.dtype)


def joint_qkv_norm_rope(txt_q, txt_k, txt_v, img_q, img_k, img_v, txt_q_weight, txt_k_weight, img_q_weight,
                        img_k_weight, txt_freqs, img_freqs, eps=1e-6):
    """The joint [text, image] ``(query, key, value)`` of a double-stream block: each stream's q
    and k through :func:`rmsnorm_rope` with its own weight and frequencies, v as it is, each
    concatenated along the sequence, text first. ``eps``: one float or a 4-tuple
    ``(txt_q, txt_k, img_q, img_k)``."""
    eps_tq, eps_tk, eps_iq, eps_ik = eps if isinstance(eps, (tuple, list)) else (eps,) * 4
    query = torch.cat([rmsnorm_rope(txt_q, txt_q_weight, txt_freqs, eps_tq),
                       rmsnorm_rope(img_q, img_q_weight, img_freqs, eps_iq)], dim=1)
    key = torch.cat([rmsnorm_rope(txt_k, txt_k_weight, txt_freqs, eps_tk),
                     rmsnorm_rope(img_k, img_k_weight, img_freqs, eps_ik)], dim=1)
    return query, key, torch.cat([txt_v, img_v], dim=1)
