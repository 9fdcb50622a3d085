"""Attention backward: the launcher of :mod:`flashflow.kernels.attention_bwd` and its custom op.

:func:`attention_backward` takes what the forward saved (q, k, v, the output and its
log-sum-exp) and the incoming gradients, and returns ``(dq, dk, dv)``; a gradient nobody asked
for is not computed (frozen K/V, as in LoRA: no dK/dV launch). Three launches: δ, dK/dV, dQ.
``flashflow.ops.attention`` registers it as the forward op's autograd formula.
"""
from __future__ import annotations

from typing import Optional

import torch

from flashflow.device import cdiv, gpu_family
from flashflow.kernels.attention_bwd import (attention_bwd_delta_kernel, attention_bwd_dkdv_kernel,
                                             attention_bwd_dq_kernel)
from flashflow.kernels.softmax import LOG2E
from flashflow.ops.common import dot_options, head_dim_pad
from flashflow.tuning.attention_bwd import AttentionBwdConfig, attention_bwd_config


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def attention_backward(q, k, v, out, lse, dout, dlse, softmax_scale: float, has_left: bool, window_left: int,
                       has_right: bool, window_right: int, softcap: float, key_padding: Optional[torch.Tensor],
                       need_dq: bool = True, need_dkv: bool = True, config: Optional[AttentionBwdConfig] = None):
    """``(dq, dk, dv)`` of dense attention, q ``(b, sq, h, d)``, k/v ``(b, sk, hk, d)``, lse float32
    ``(b, h, sq)``; ``dlse`` the gradient of a returned lse or None; ``key_padding`` a boolean
    ``(b, P)`` prefix mask (True = attend) or None. dq is None unless ``need_dq``, dk/dv None
    unless ``need_dkv``."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    dout = _unit_last(dout)
    dq = torch.empty_like(q) if need_dq else None
    dk = torch.empty_like(k) if need_dkv else None
    dv = torch.empty_like(v) if need_dkv else None
    if q.numel() == 0 or k.numel() == 0 or not (need_dq or need_dkv):
        if need_dq:
            dq.zero_()
        if need_dkv:
            dk.zero_()
            dv.zero_()
        return dq, dk, dv
    d_pad = head_dim_pad(head_dim)
    cfg = config or attention_bwd_config(d_pad, gpu_family(q.device))
    dots = dot_options(q.dtype)
    delta = torch.empty((batch * heads, seqlen_q), dtype=torch.float32, device=q.device)
    has_dlse = dlse is not None
    dlse_s = dlse.stride() if has_dlse else (0, 0, 0)
    attention_bwd_delta_kernel[(cdiv(seqlen_q, 64), batch * heads)](
        out, dout, dlse if has_dlse else delta, delta, seqlen_q, heads,
        out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2), *dlse_s,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, BLOCK_M=64, HAS_DLSE=has_dlse, num_warps=4)
    qk_scale_log2 = softmax_scale / softcap if softcap > 0 else softmax_scale * LOG2E
    kpm = key_padding if key_padding is not None else delta
    kpm_keys = key_padding.shape[1] if key_padding is not None else 0
    common = (seqlen_q, seqlen_k, heads, kv_heads, kpm_keys, softmax_scale, qk_scale_log2, softcap,
              window_left, window_right)
    meta = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, HAS_SOFTCAP=softcap > 0, HAS_LEFT=has_left, HAS_RIGHT=has_right, HAS_KPM=key_padding is not None,
                **dots, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *lse.stride())
    kpm_stride = key_padding.stride(0) if key_padding is not None else 0
    if need_dkv:
        attention_bwd_dkdv_kernel[(cdiv(seqlen_k, cfg.BLOCK_N1), batch * kv_heads)](
            q, k, v, dout, lse, delta, dk, dv, kpm, *strides, *dk.stride()[:3], *dv.stride()[:3], kpm_stride,
            *common, BLOCK_M=cfg.BLOCK_M1, BLOCK_N=cfg.BLOCK_N1, **meta)
    if need_dq:
        attention_bwd_dq_kernel[(cdiv(seqlen_q, cfg.BLOCK_M2), batch * heads)](
            q, k, v, dout, lse, delta, dq, kpm, *strides, *dq.stride()[:3], kpm_stride, *common,
            BLOCK_M=cfg.BLOCK_M2, BLOCK_N=cfg.BLOCK_N2, **meta)
    return dq, dk, dv


def _attention_bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        dout: torch.Tensor, dlse: Optional[torch.Tensor], key_padding: Optional[torch.Tensor],
                        softmax_scale: float, has_left: bool, window_left: int, has_right: bool, window_right: int,
                        softcap: float, need_dq: bool, need_dkv: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = attention_backward(q, k, v, out, lse, dout, dlse, softmax_scale, has_left, window_left, has_right,
                                    window_right, softcap, key_padding, need_dq, need_dkv)
    # a custom op returns tensors: an empty one stands for a gradient not computed
    return (dq if dq is not None else q.new_empty(0), dk if dk is not None else k.new_empty(0),
            dv if dv is not None else v.new_empty(0))


attention_bwd_op = torch.library.custom_op("flashflow::attention_bwd", mutates_args=())(_attention_bwd_impl)


@attention_bwd_op.register_fake
def _(q, k, v, out, lse, dout, dlse, key_padding, softmax_scale, has_left, window_left, has_right, window_right,
      softcap, need_dq, need_dkv):
    return (torch.empty_like(q) if need_dq else q.new_empty(0), torch.empty_like(k) if need_dkv else k.new_empty(0),
            torch.empty_like(v) if need_dkv else v.new_empty(0))
