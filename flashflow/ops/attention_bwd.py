"""Attention backward: the launcher of :mod:`flashflow.kernels.attention_bwd` and its custom op.

:func:`attention_backward` takes what the forward saved (q, k, v, the output and its
log-sum-exp, the bias or key-padding mask) and the incoming gradients, and returns ``(dq, dk, dv)``; a gradient
nobody asked for is not computed (frozen K/V, as in LoRA: no dK/dV launch). Two launches: dQ,
whose programs also compute and store δ for their rows, then dK/dV, which reads δ back; without
dQ (a frozen q) a δ launch takes its place. ``flashflow.ops.attention`` registers it as the
forward op's autograd formula.
"""
from __future__ import annotations

from typing import Optional

import torch

from flashflow.device import cdiv, gpu_family
from flashflow.kernels.attention_bwd import (attention_bwd_delta_kernel, attention_bwd_dkdv_kernel,
                                             attention_bwd_dq_kernel)
from flashflow.kernels.softmax import LOG2E
from flashflow.ops.common import (Launcher, aligned16, dot_options, head_dim_pad, key_padding_for_kernels,
                                  unit_last_stride)
from flashflow.tuning.attention_bwd import DELTA_ROWS, AttentionBwdConfig, attention_bwd_config


def attention_backward(q, k, v, out, lse, dout, dlse, softmax_scale: float, has_left: bool, window_left: int,
                       has_right: bool, window_right: int, softcap: float, bias: Optional[torch.Tensor] = None,
                       bias_keys: int = 0, key_padding_mask: Optional[torch.Tensor] = None,
                       mask_keys: Optional[int] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
                       cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                       need_dq: bool = True, need_dkv: bool = True, config: Optional[AttentionBwdConfig] = None):
    """``(dq, dk, dv)`` of attention, with the forward's arguments (:func:`flashflow.ops.attention._portable_forward`).

    Dense: q ``(b, sq, h, d)``, k/v ``(b, sk, hk, d)``, lse float32 ``(b, h, sq)``. Varlen
    (``cu_seqlens_q`` given): q ``(tq, h, d)``, k/v ``(tk, hk, d)``, lse ``(h, tq)``. ``dlse`` is
    the gradient of a returned lse (its shape) or None. ``bias``: the forward's additive float
    bias over the first ``bias_keys`` keys (a 4-D strided view); ``key_padding_mask``: its
    boolean ``(b, P)`` key-padding mask over the first ``mask_keys`` keys (``None``: its ``P``);
    no gradient flows to either. dq is None unless ``need_dq``, dk/dv None unless ``need_dkv``."""
    varlen = cu_seqlens_q is not None
    # the kernels read head_dim with unit stride: the forward took copies of strided q/k/v for
    # itself, but autograd saved the user's tensors as they were
    q, k, v, dout = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v), unit_last_stride(dout)
    key_padding_mask, mask_keys = key_padding_for_kernels(key_padding_mask, mask_keys)
    dq = torch.empty_like(q) if need_dq else None
    dk = torch.empty_like(k) if need_dkv else None
    dv = torch.empty_like(v) if need_dkv else None
    if q.numel() == 0 or k.numel() == 0 or not (need_dq or need_dkv):
        for t in (dq, dk, dv):
            if t is not None:
                t.zero_()
        return dq, dk, dv
    lse = lse if lse.is_contiguous() else lse.contiguous()
    has_dlse = dlse is not None
    if has_dlse and not dlse.is_contiguous():
        dlse = dlse.contiguous()
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), dout.stride(), out.stride(), lse.shape,
           q.dtype, dout.dtype, out.dtype, q.get_device(), has_dlse,
           None if bias is None else (bias.dtype, bias.shape, bias.stride()),
           bias_keys, None if key_padding_mask is None else (key_padding_mask.dtype, key_padding_mask.shape,
                                                             key_padding_mask.stride()), mask_keys,
           None if cu_seqlens_q is None else cu_seqlens_q.shape[0], max_seqlen_q,
           max_seqlen_k, has_left, window_left, has_right, window_right, softcap > 0, need_dq, need_dkv, config,
           None if dq is None else dq.stride(), None if dk is None else (dk.stride(), dv.stride()),
           aligned16(q, k, v, out, dout, dlse, bias, key_padding_mask, cu_seqlens_q, cu_seqlens_k, dq, dk, dv))
    plan = _BACKWARD_PLANS.get(key)
    if plan is None:
        plan = _BackwardPlan(q, k, v, out, lse, has_dlse, dout, dq, dk, dv, bias, bias_keys, key_padding_mask,
                             mask_keys, cu_seqlens_q, max_seqlen_q, max_seqlen_k, has_left, window_left, has_right,
                             window_right, softcap, config)
        if len(_BACKWARD_PLANS) < MAX_PLANS:
            _BACKWARD_PLANS[key] = plan
    launch_key = key if key[-1] else None   # else Triton specialises each call
    delta = torch.empty_like(lse)   # δ has the LSE's layout: (b, h, sq) or (h, tq)
    dlse_t = dlse if has_dlse else delta
    scales = (softmax_scale, softmax_scale / softcap if softcap > 0 else softmax_scale * LOG2E, softcap)
    bias_t = bias if bias is not None else delta
    mask_t = key_padding_mask if key_padding_mask is not None else delta
    cu_q = cu_seqlens_q if varlen else delta
    cu_k = cu_seqlens_k if varlen else delta
    # δ first: the dQ kernel's programs store it for their rows (every row of every sequence is one
    # program's), else the δ kernel does; dK/dV, later on the same stream, reads it back
    if need_dq:
        _DQ(launch_key, plan.dq_grid, (q, k, v, dout, out, lse, dlse_t, delta, dq, bias_t, mask_t, cu_q, cu_k,
                                       *plan.dq_ints, *scales, *plan.windows), plan.dq_constexprs)
    else:
        _DELTA(launch_key, plan.delta_grid, (out, dout, dlse_t, delta, *plan.delta_ints), plan.delta_constexprs)
    if need_dkv:
        _DKDV(launch_key, plan.dkdv_grid, (q, k, v, dout, lse, delta, dk, dv, bias_t, mask_t, cu_q, cu_k,
                                           *plan.dkdv_ints, *scales, *plan.windows), plan.dkdv_constexprs)
    return dq, dk, dv


_DELTA = Launcher(attention_bwd_delta_kernel)
_DKDV = Launcher(attention_bwd_dkdv_kernel)
_DQ = Launcher(attention_bwd_dq_kernel)
_BACKWARD_PLANS: dict = {}
MAX_PLANS = 4096   # distinct launch keys kept; later ones are worked out per call


class _BackwardPlan:
    """What one launch key of the backward fixes: config, grids, the kernels' integer arguments
    and constexprs (it keeps no tensor)."""

    def __init__(self, q, k, v, out, lse, has_dlse, dout, dq, dk, dv, bias, bias_keys, key_padding_mask, mask_keys,
                 cu_seqlens_q, max_seqlen_q, max_seqlen_k, has_left, window_left, has_right, window_right, softcap,
                 config):
        varlen = cu_seqlens_q is not None
        need_dq, need_dkv = dq is not None, dk is not None
        head_dim = q.shape[-1]
        if varlen:
            batch = cu_seqlens_q.shape[0] - 1
            heads, kv_heads = q.shape[1], k.shape[1]
            seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
            # (tokens, heads, d) as a batch of one: the batch stride is never used
            q_s, k_s, v_s, do_s = ((0, *t.stride()[:2]) for t in (q, k, v, dout))
            dq_s = (0, *dq.stride()[:2]) if need_dq else None
            dk_s, dv_s = ((0, *dk.stride()[:2]), (0, *dv.stride()[:2])) if need_dkv else (None, None)
            o_s = (0, *out.stride()[:2])
            rows = q.shape[0]
        else:
            batch, seqlen_q, heads, _ = q.shape
            seqlen_k, kv_heads = k.shape[1], k.shape[2]
            q_s, k_s, v_s, do_s, o_s = (t.stride()[:3] for t in (q, k, v, dout, out))
            dq_s = dq.stride()[:3] if need_dq else None
            dk_s, dv_s = (dk.stride()[:3], dv.stride()[:3]) if need_dkv else (None, None)
            rows = seqlen_q
        d_pad = head_dim_pad(head_dim)
        cfg = config or attention_bwd_config(d_pad, gpu_family(q.device))
        l_s = (0, *lse.stride()) if varlen else lse.stride()
        if not need_dq:   # δ's own launch; varlen: all tokens as one sequence (δ is per row)
            self.delta_grid = (cdiv(rows, DELTA_ROWS), (1 if varlen else batch) * heads, 1)
            self.delta_ints = (rows, heads, *o_s, *do_s, *l_s)
            self.delta_constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, BLOCK_M=DELTA_ROWS,
                                         HAS_DLSE=has_dlse, num_warps=4)
        if bias is None:
            b_s, bias_keys = (0, 0, 0, 0), 0
        else:
            b_s = bias.stride()
        # (b, P) flags: a batch stride (unit stride along the keys)
        mask_s = key_padding_mask.stride(0) if key_padding_mask is not None else 0
        strides = (*q_s, *k_s, *v_s, *do_s, *l_s)
        shape = (seqlen_q, seqlen_k, heads, kv_heads, bias_keys, mask_keys)
        self.windows = (window_left, window_right)
        meta = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, IS_VARLEN=varlen, HAS_SOFTCAP=softcap > 0,
                    HAS_LEFT=has_left, HAS_RIGHT=has_right, HAS_BIAS=bias is not None,
                    KEY_PADDING=key_padding_mask is not None, **dot_options(q.dtype))
        if need_dkv:
            self.dkdv_grid = (cdiv(seqlen_k, cfg.BLOCK_N1), batch * kv_heads, 1)
            self.dkdv_ints = (*strides, *dk_s, *dv_s, *b_s, mask_s, *shape)
            self.dkdv_constexprs = dict(BLOCK_M=cfg.BLOCK_M1, BLOCK_N=cfg.BLOCK_N1, num_warps=cfg.num_warps1,
                                        num_stages=cfg.num_stages1, **meta)
        if need_dq:
            self.dq_grid = (cdiv(seqlen_q, cfg.BLOCK_M2), batch * heads, 1)
            # q, k, v, dO strides, then O's for the rows' δ, then the LSE's
            self.dq_ints = (*q_s, *k_s, *v_s, *do_s, *o_s, *l_s, *dq_s, *b_s, mask_s, *shape)
            self.dq_constexprs = dict(BLOCK_M=cfg.BLOCK_M2, BLOCK_N=cfg.BLOCK_N2, num_warps=cfg.num_warps2,
                                      num_stages=cfg.num_stages2, HAS_DLSE=has_dlse, **meta)


def attention_bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        dout: torch.Tensor, dlse: Optional[torch.Tensor], bias: Optional[torch.Tensor], bias_keys: int,
                        key_padding_mask: Optional[torch.Tensor], mask_keys: int, cu_seqlens_q: Optional[torch.Tensor],
                        cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
                        softmax_scale: float, has_left: bool, window_left: int, has_right: bool, window_right: int,
                        softcap: float, need_dq: bool, need_dkv: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = attention_backward(q, k, v, out, lse, dout, dlse, softmax_scale, has_left, window_left, has_right,
                                    window_right, softcap, bias, bias_keys, key_padding_mask, mask_keys, cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, need_dq, need_dkv)
    # a custom op returns tensors: an empty one stands for a gradient not computed
    return (dq if dq is not None else q.new_empty(0), dk if dk is not None else k.new_empty(0),
            dv if dv is not None else v.new_empty(0))


attention_bwd_op = torch.library.custom_op("flashflow::attention_bwd", mutates_args=())(attention_bwd_impl)


@attention_bwd_op.register_fake
def _(q, k, v, out, lse, dout, dlse, bias, bias_keys, key_padding_mask, mask_keys, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, softmax_scale, has_left, window_left, has_right, window_right, softcap, need_dq,
      need_dkv):
    return (torch.empty_like(q) if need_dq else q.new_empty(0), torch.empty_like(k) if need_dkv else k.new_empty(0),
            torch.empty_like(v) if need_dkv else v.new_empty(0))
