"""Flash attention forward: validation, config choice, launch, custom-op registration.

Public entry points (re-exported by ``flashflow``):

* :func:`flash_attn_func` — FlashAttention layout ``(batch, seqlen, heads, head_dim)``.
* :func:`flash_attn_varlen_func` — packed ragged batches ``(total_tokens, heads, head_dim)``.
* :func:`scaled_dot_product_attention` — SDPA layout ``(batch, heads, seqlen, head_dim)`` and
  semantics (top-left causal, boolean or additive ``attn_mask``, ``enable_gqa``).

All three go through one ``torch.library`` custom op, ``flashflow::attention_fwd``, so that
``torch.compile(fullgraph=True)`` traces through them and CUDA graphs capture them.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton

from flashflow.device import capturing, cdiv, gpu_family, interpreting, num_sms as device_num_sms
from flashflow.kernels.attention_fwd import attention_fwd_kernel, attention_merge_kernel
from flashflow.kernels.softmax import LOG2E
from flashflow.ops import attention_gluon
from flashflow.ops.attention_bwd import attention_bwd_impl, attention_bwd_op
from flashflow.ops.common import (Launcher, aligned16, call_key, contiguous_strides as _contiguous_strides, dot_options,
                                  head_dim_pad as _head_dim_pad, key_padding_for_kernels, op_or_direct, rows_view, tensor_descriptor,
                                  tma_strides_ok, unit_last_stride)
from flashflow.ops.validate import (check_flag, check_int, check_key_padding_mask, check_no_grad, check_qkv,
                                    check_softcap, check_tensor, softmax_scale_or_default, window_bounds)
from flashflow.tuning import autotune
from flashflow.tuning.attention import AttentionConfig, attention_config, tail_merge_rows, tail_splits

# --------------------------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------------------------

_ALLOCATOR_SET = False


def _ensure_tma_allocator() -> None:
    """Device-side tensor descriptors need a small global scratch buffer per launch."""
    global _ALLOCATOR_SET
    if not _ALLOCATOR_SET:
        def alloc(size: int, alignment: int, stream):
            return torch.empty(size, dtype=torch.int8, device="cuda")

        triton.set_allocator(alloc)
        _ALLOCATOR_SET = True


def _tma_strides_ok(q, k, v, out_stride) -> bool:
    """Host or device descriptors for q, k, v and out (the bases' alignment is in the launch key)."""
    es = q.element_size()
    return all(tma_strides_ok(st, es) for st in (q.stride(), k.stride(), v.stride(), out_stride))


def pick_config(q: torch.Tensor, causal: bool, bias: bool = False) -> AttentionConfig:
    """The shipped config for ``q``'s head_dim and GPU (:func:`flashflow.tuning.attention.attention_config`)."""
    return attention_config(_head_dim_pad(q.shape[-1]), causal, gpu_family(q.device), bias)


# --------------------------------------------------------------------------------------------
# dispatch: the first registered forward kernel whose ``supports(q, k, v, **kw)`` accepts the
# call runs it. The portable Triton kernel (pointer loads on Ampere/Ada, TMA on Hopper) accepts
# everything; a generation-specific kernel registers ahead of it with ``first=True``.
# --------------------------------------------------------------------------------------------

_FORWARD_KERNELS: list = []
# flash_attn_func's calls without a key-padding mask, by call key (which tells calls that record
# autograd apart): a key seen before skips the validation (a function of the key) and the
# dispatch, and launches its plan, under _AttentionFunction where it records autograd
_ENTRIES: dict = {}


_OVERRIDE_SEEN: list = [None]   # FLASHFLOW_ATTENTION_KERNEL's value when _ENTRIES was filled


def _follow_kernel_override() -> None:
    """Forget the recorded entries when ``FLASHFLOW_ATTENTION_KERNEL`` changed since they were
    recorded (they stand for the kernel its old value chose)."""
    value = os.environ.get(attention_gluon.KERNEL_ENV)
    if value != _OVERRIDE_SEEN[0]:
        _ENTRIES.clear()
        _OVERRIDE_SEEN[0] = value


def register_forward_kernel(name: str, supports, launch, first: bool = False) -> None:
    entry = (name, supports, launch)
    _FORWARD_KERNELS.insert(0, entry) if first else _FORWARD_KERNELS.append(entry)
    _ENTRIES.clear()   # a recorded call may belong to the new kernel


def forward_kernel_name(q, k, v, **kw) -> str:
    return next(name for name, supports, _ in _FORWARD_KERNELS if supports(q, k, v, **kw))


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw):
    """Run the forward pass on validated tensors with the first kernel that supports the call.

    See :func:`_portable_forward` for the arguments and layouts.
    """
    for _, supports, launch in _FORWARD_KERNELS:
        if supports(q, k, v, **kw):
            return launch(q, k, v, **kw)
    raise RuntimeError("no attention forward kernel accepts this call")  # portable accepts all


def _portable_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    bias: Optional[torch.Tensor] = None, bias_keys: Optional[int] = None,
    key_padding_mask: Optional[torch.Tensor] = None, mask_keys: Optional[int] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: int = 0, max_seqlen_k: int = 0,
    softmax_scale: float, window_left: Optional[int] = None, window_right: Optional[int] = None,
    softcap: float = 0.0, return_lse: bool = True, heavy_first: bool = False,
    config: Optional[AttentionConfig] = None, out: Optional[torch.Tensor] = None,
    num_sms: Optional[int] = None,
):
    """Launch the forward kernel on validated tensors in FlashAttention layout.

    Dense: q ``(b, sq, h, d)``, k/v ``(b, sk, hk, d)``; out ``(b, sq, h, d)``, lse ``(b, h, sq)``.
    Varlen (``cu_seqlens_q`` given): q ``(tq, h, d)``, k/v ``(tk, hk, d)``; lse ``(h, tq)``.
    ``window_left/right = None`` means unbounded on that side; the diagonal is bottom-right
    aligned. ``bias`` is an additive float score bias broadcastable to ``(b, h, sq, sk)`` as
    a 4-D strided view (stride 0 on broadcast axes); -inf entries mask. It covers the first
    ``bias_keys`` keys (``None``: all of them); later keys are unbiased and never read from
    ``bias``, and their blocks run unmasked. ``key_padding_mask`` is a boolean ``(b, P)``
    key-padding mask (True = attend; dense calls only) over the first ``mask_keys`` keys
    (``None``: its ``P``); later keys are always attended, never read from it, and their blocks
    run unmasked (a mask without unit stride along the keys is copied). ``num_sms`` overrides
    the SM count used for the tail split (:func:`flashflow.device.num_sms` by default).

    Everything the launch derives from the shapes, strides, flags and config (the config
    itself, the load path, the grid, the kernel's integer arguments, the compiled kernel) is
    worked out once per such key (:class:`_ForwardPlan`); a call with a key seen before only
    allocates its outputs and launches.
    """
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    if bias is None:
        bias_keys = 0
    elif bias_keys is None:
        bias_keys = k.shape[1] if cu_seqlens_q is None else max_seqlen_k
    key_padding_mask, mask_keys = key_padding_for_kernels(key_padding_mask, mask_keys)
    plan, launch_key = _forward_plan(q, k, v, bias, bias_keys, key_padding_mask, mask_keys, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
                                     return_lse, heavy_first, config, out, num_sms)
    return _launch(plan, launch_key, q, k, v, out, bias, key_padding_mask, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                   softcap)


def _forward_plan(q, k, v, bias, bias_keys, key_padding_mask, mask_keys, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, softmax_scale, window_left, window_right, softcap, return_lse, heavy_first, config, out,
                  num_sms) -> tuple:
    """``(plan, launch_key)`` of a call of :func:`_portable_forward` (its arguments normalised:
    unit last strides, ``bias_keys`` and ``mask_keys`` set): the :class:`_ForwardPlan` of its
    key, worked out on the key's first call, and the key the kernel's :class:`Launcher` is
    called with (None where Triton must specialise each call)."""
    tune = config is None and autotune.enabled()
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.get_device(),
           None if out is None else (out.stride(), out.dtype),
           None if bias is None else (bias.dtype, bias.shape, bias.stride()), bias_keys,
           None if key_padding_mask is None else (key_padding_mask.dtype, key_padding_mask.shape,
                                                  key_padding_mask.stride()), mask_keys,
           None if cu_seqlens_q is None else cu_seqlens_q.shape[0], max_seqlen_q, max_seqlen_k,
           window_left, window_right, softcap > 0, return_lse, heavy_first, config, num_sms, tune,
           aligned16(q, k, v, out), aligned16(bias, key_padding_mask, cu_seqlens_q, cu_seqlens_k))
    plan = _FORWARD_PLANS.get(key)
    if plan is None:
        tuning = None if not tune else dict(
            bias=bias, bias_keys=bias_keys, key_padding_mask=key_padding_mask, mask_keys=mask_keys,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
            window_left=window_left, window_right=window_right, softcap=softcap, return_lse=return_lse,
            heavy_first=heavy_first)
        plan = _ForwardPlan(q, k, v, bias, bias_keys, key_padding_mask, mask_keys, cu_seqlens_q, max_seqlen_q,
                            max_seqlen_k, window_left, window_right, softcap, return_lse, heavy_first, config, out,
                            num_sms, tma_aligned=key[-2], tuning=tuning)
        if not (tune and capturing(q.device)) and len(_FORWARD_PLANS) < MAX_PLANS:
            _FORWARD_PLANS[key] = plan
    return plan, (key if key[-1] and key[-2] else None)   # else Triton specialises each call


def _launch(plan, launch_key, q, k, v, out, bias, key_padding_mask, cu_seqlens_q, cu_seqlens_k, softmax_scale,
            softcap):
    """Allocate the call's outputs (and split workspaces) and launch ``plan``'s kernels (a
    :class:`~flashflow.ops.attention_gluon.GluonPlan`: the Gluon kernel's)."""
    if plan.__class__ is attention_gluon.GluonPlan:
        return plan.launch(launch_key, q, k, v, out, key_padding_mask, softmax_scale)
    if out is None:
        out = q.new_empty(q.shape)
    lse = q.new_empty(plan.lse_shape, dtype=torch.float32)
    if plan.empty:
        return out, lse
    if plan.descs is None:
        descs = _NO_DESCS
    else:
        descs = tuple(tensor_descriptor(t, *spec) for t, spec in zip((q, k, v, out), plan.descs))
    if plan.splits > 1:
        ws_acc = q.new_empty(plan.ws_acc_shape, dtype=torch.float32)
        ws_ml = q.new_empty(plan.ws_ml_shape, dtype=torch.float32)
    else:
        ws_acc = ws_ml = q
    varlen = cu_seqlens_q is not None
    dummy = cu_seqlens_q if varlen else q
    _FORWARD(launch_key, plan.grid, (
        q, k, v, out, lse, bias if bias is not None else q, key_padding_mask if key_padding_mask is not None else q,
        dummy, cu_seqlens_k if varlen else dummy, *descs, ws_acc, ws_ml, *plan.ints,
        softmax_scale / softcap if softcap > 0 else softmax_scale * LOG2E, softcap, *plan.ints_after), plan.constexprs)
    if plan.splits > 1:
        _MERGE(launch_key, plan.merge_grid, (out, lse, ws_acc, ws_ml, *plan.merge_ints), plan.merge_constexprs)
    return out, lse


_FORWARD = Launcher(attention_fwd_kernel)
_MERGE = Launcher(attention_merge_kernel)
_FORWARD_PLANS: dict = {}
_NO_DESCS = (None, None, None, None)
MAX_PLANS = 4096   # distinct launch keys kept (shapes × layouts × flags); later ones are worked out per call


def _autotuned(cfg, q, k, v, **kw) -> AttentionConfig:
    """``FLASHFLOW_AUTOTUNE=1``: the fastest of the candidates around ``cfg`` on these inputs."""
    if not q.is_cuda or capturing(q.device):
        return cfg
    varlen = kw["cu_seqlens_q"] is not None
    seqlen_q = kw["max_seqlen_q"] if varlen else q.shape[1]
    seqlen_k = kw["max_seqlen_k"] if varlen else k.shape[1]
    key = (torch.cuda.get_device_name(q.device), q.dtype, _head_dim_pad(q.shape[-1]), kw["window_left"],
           kw["window_right"], kw["bias"] is not None, kw["key_padding_mask"] is not None, varlen,
           autotune.seqlen_bucket(seqlen_q), autotune.seqlen_bucket(seqlen_k))

    def time_ms(c):
        run = lambda: _portable_forward(q, k, v, config=c, **kw)  # noqa: E731
        run()
        return triton.testing.do_bench(run, warmup=5, rep=20, return_mode="median")

    return autotune.pick(key, autotune.candidates(cfg), time_ms)


class _ForwardPlan:
    """What one launch key of the forward fixes: config, load path and descriptors' shapes, grid,
    tail split and workspaces, the kernel's integer arguments and constexprs."""

    def __init__(self, q, k, v, bias, bias_keys, key_padding_mask, mask_keys, cu_seqlens_q, max_seqlen_q,
                 max_seqlen_k, window_left, window_right, softcap, return_lse, heavy_first, config, out, num_sms,
                 tma_aligned, tuning=None):
        self.bias, self.bias_keys = bias, bias_keys
        self.key_padding_mask, self.mask_keys = key_padding_mask, mask_keys
        self.varlen = cu_seqlens_q is not None
        self.cu_batch = cu_seqlens_q.shape[0] - 1 if self.varlen else 0
        self.max_seqlen_q, self.max_seqlen_k = max_seqlen_q, max_seqlen_k
        self.window_left, self.window_right, self.softcap = window_left, window_right, softcap
        self.return_lse, self.heavy_first, self.num_sms = return_lse, heavy_first, num_sms
        cfg = config or pick_config(q, causal=window_right is not None, bias=bias is not None)
        if tuning is not None:
            cfg = _autotuned(cfg, q, k, v, **tuning)
        self.cfg = cfg
        self._derive(q, k, v, out, tma_aligned)
        self.bias = self.key_padding_mask = None   # the plan outlives the call: it keeps no tensor

    def _derive(self, q, k, v, out, tma_aligned) -> None:
        cfg, varlen = self.cfg, self.varlen
        head_dim = q.shape[-1]
        if varlen:
            heads, kv_heads = q.shape[1], k.shape[1]
            seqlen_q, seqlen_k = self.max_seqlen_q, self.max_seqlen_k
            batch = None   # from cu_seqlens: the key holds its length
            sq_b = sk_b = sv_b = 0
            sq_s, sq_h = q.stride(0), q.stride(1)
            sk_s, sk_h = k.stride(0), k.stride(1)
            sv_s, sv_h = v.stride(0), v.stride(1)
        else:
            batch, seqlen_q, heads, _ = q.shape
            seqlen_k, kv_heads = k.shape[1], k.shape[2]
            sq_b, sq_s, sq_h = q.stride()[:3]
            sk_b, sk_s, sk_h = k.stride()[:3]
            sv_b, sv_s, sv_h = v.stride()[:3]
        out_stride = out.stride() if out is not None else _contiguous_strides(q.shape)
        if varlen:
            self.lse_shape = (heads, q.shape[0]) if self.return_lse else (0,)
            l_strides = (0, q.shape[0], 1) if self.return_lse else (0, 0, 0)
            so_b, so_s, so_h = 0, out_stride[0], out_stride[1]
        else:
            self.lse_shape = (batch, heads, seqlen_q) if self.return_lse else (0,)
            l_strides = (heads * seqlen_q, seqlen_q, 1) if self.return_lse else (0, 0, 0)
            so_b, so_s, so_h = out_stride[:3]
        self.empty = q.numel() == 0 or batch == 0 or seqlen_q == 0
        if self.empty:
            return
        if varlen:
            batch = self.cu_batch
        head_dim_pad = _head_dim_pad(head_dim)
        # load path: host descriptors > device descriptors > pointers
        load_mode, self.descs, rows = 0, None, (0,) * 9
        if cfg.use_tma and tma_aligned and _tma_strides_ok(q, k, v, out_stride):
            load_mode = 1
            views = None if (varlen or head_dim != head_dim_pad or not cfg.host_desc) else \
                [rows_view(t.shape, st) for t, st in ((q, q.stride()), (k, k.stride()), (v, v.stride()),
                                                        (q, out_stride))]
            if views and all(views) and views[1][:3] == views[2][:3]:
                load_mode = 2
                blocks = (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_N, cfg.BLOCK_M)
                self.descs = tuple(([vw[3], vw[4]], [vw[5], 1], [bm, head_dim_pad]) for vw, bm in zip(views, blocks))
                rows = views[0][:3] + views[1][:3] + views[3][:3]
            if q.device.type == "cuda":
                _ensure_tma_allocator()
        num_m_blocks = cdiv(seqlen_q, cfg.BLOCK_M)
        total = num_m_blocks * heads * batch
        splits = 1
        plain = not (varlen or self.heavy_first or self.bias is not None
                     or self.window_left is not None or self.window_right is not None)
        num_sms = self.num_sms
        if cfg.tail_split and plain:
            if num_sms is None:
                num_sms = device_num_sms(q.device)
            splits = tail_splits(total, num_sms, cdiv(seqlen_k, cfg.BLOCK_N))
        self.splits = splits
        if splits > 1:
            num_full = total - total % num_sms
            n_pieces = (total - num_full) * splits
            self.ws_acc_shape = (n_pieces, cfg.BLOCK_M, head_dim_pad)
            self.ws_ml_shape = (n_pieces, 2, cfg.BLOCK_M)
            self.grid = (num_full + n_pieces, 1, 1)
        else:
            num_full = total
            self.grid = (total, 1, 1)
        bias, key_padding_mask = self.bias, self.key_padding_mask
        b_strides = bias.stride() if bias is not None else (0, 0, 0, 0)
        # (b, P) flags: a batch stride (unit stride along the keys)
        mask_stride = key_padding_mask.stride(0) if key_padding_mask is not None else 0
        self.ints = (sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_s, so_h, *l_strides,
                     *b_strides, mask_stride, *rows, seqlen_q, seqlen_k, heads, heads // kv_heads, num_m_blocks,
                     num_full)
        self.ints_after = (self.window_left or 0, self.window_right or 0, self.bias_keys, self.mask_keys)
        self.constexprs = dict(
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
            IS_VARLEN=varlen, HAS_LEFT=self.window_left is not None, HAS_RIGHT=self.window_right is not None,
            HAS_SOFTCAP=self.softcap > 0, HAS_BIAS=bias is not None, RETURN_LSE=self.return_lse,
            HEAVY_FIRST=self.heavy_first, LOAD_MODE=load_mode, **dot_options(q.dtype),
            WARP_SPECIALIZE=cfg.warp_specialize, TAIL_SPLITS=splits, KEY_PADDING=key_padding_mask is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.maxnreg:
            self.constexprs["maxnreg"] = cfg.maxnreg
        if splits > 1:
            merge_rows = tail_merge_rows(cfg.BLOCK_M)
            self.merge_grid = (total - num_full, cfg.BLOCK_M // merge_rows, 1)
            self.merge_ints = (so_b, so_s, so_h, *l_strides, seqlen_q, heads, num_m_blocks, num_full)
            self.merge_constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_M=cfg.BLOCK_M,
                                         MERGE_ROWS=merge_rows, SPLITS=splits, RETURN_LSE=self.return_lse,
                                         num_warps=4)


PORTABLE = "triton-portable"
register_forward_kernel(PORTABLE, lambda q, k, v, **kw: True, _portable_forward)
# Hopper: the Gluon kernel takes the calls it supports (flashflow.ops.attention_gluon)
register_forward_kernel(attention_gluon.GLUON, attention_gluon.supports, attention_gluon.gluon_forward, first=True)


# --------------------------------------------------------------------------------------------
# custom op: one registered op serves all three public entry points
# --------------------------------------------------------------------------------------------


def _check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k):
    """Value checks need the numbers on the host; skipped while a CUDA graph is being captured."""
    if capturing(cu_seqlens_q.device):
        return
    for name, cu, total, max_len in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
                                     ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k)):
        vals = cu.tolist()
        if vals[0] != 0:
            raise ValueError(f"{name} must start at 0, got {vals[0]}")
        if any(b < a for a, b in zip(vals, vals[1:])):
            raise ValueError(f"{name} must be non-decreasing, got {vals}")
        if vals[-1] != total:
            raise ValueError(f"{name}[-1] must equal the packed token count {total}, got {vals[-1]}")
        longest = max((b - a for a, b in zip(vals, vals[1:])), default=0)
        if longest > max_len:
            name_max = "max_seqlen_q" if name.endswith("q") else "max_seqlen_k"
            raise ValueError(f"{name_max}={max_len} is smaller than the longest sequence ({longest})")


def _attention_fwd_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor], bias_keys: int,
    key_padding_mask: Optional[torch.Tensor], mask_keys: int,
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
    has_left: bool, window_left: int, has_right: bool, window_right: int,
    softcap: float, return_lse: bool, heavy_first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op behind the three entry points: ``bias`` is an additive float score bias over the
    first ``bias_keys`` keys, ``key_padding_mask`` a boolean ``(batch, P)`` mask over the first
    ``mask_keys`` (:func:`_portable_forward`)."""
    if cu_seqlens_q is not None:
        _check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    return attention_forward(
        q, k, v, bias=bias, bias_keys=bias_keys, key_padding_mask=key_padding_mask, mask_keys=mask_keys,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
        window_left=window_left if has_left else None, window_right=window_right if has_right else None,
        softcap=softcap, return_lse=return_lse, heavy_first=heavy_first,
    )


_attention_fwd_op = torch.library.custom_op("flashflow::attention_fwd", mutates_args=())(_attention_fwd_impl)


@_attention_fwd_op.register_fake
def _(q, k, v, bias, bias_keys, key_padding_mask, mask_keys, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, has_left, window_left, has_right, window_right, softcap, return_lse, heavy_first):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not return_lse:
        lse_shape = (0,)
    elif cu_seqlens_q is not None:
        lse_shape = (q.shape[1], q.shape[0])
    else:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty(lse_shape, dtype=torch.float32)


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, bias, bias_keys, key_padding_mask, mask_keys, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
     softmax_scale, has_left, window_left, has_right, window_right, softcap, _, _) = inputs
    out, lse = output
    # the entry points that take gradients ask for the LSE, which the backward recomputes from
    ctx.supported = lse.numel() > 0 or q.numel() == 0
    ctx.save_for_backward(q, k, v, out, lse, bias, key_padding_mask, cu_seqlens_q, cu_seqlens_k)
    ctx.args = (bias_keys, mask_keys, max_seqlen_q, max_seqlen_k, softmax_scale, has_left, window_left,
                has_right, window_right, softcap)


def _fwd_backward(ctx, dout, dlse, bwd=attention_bwd_op):
    if torch.is_grad_enabled():
        # autograd enables grad mode inside a backward only for create_graph=True: the kernels'
        # gradients would come back without a graph, so a second derivative would be silently 0
        raise NotImplementedError(
            "flashflow's attention has no double backward: the gradient cannot be differentiated again "
            "(create_graph=True, e.g. a gradient penalty or a Hessian). Use torch's attention for that step "
            "(torch.nn.functional.scaled_dot_product_attention with the math backend).")
    if not ctx.supported:
        raise NotImplementedError("flashflow's attention backward needs the forward's log-sum-exp: call the op "
                                  "with return_lse=True (the public entry points do when an input requires grad)")
    q, k, v, out, lse, bias, key_padding_mask, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if dout is None:   # only the LSE was used
        dout = torch.zeros_like(out)
    bias_keys, mask_keys, max_seqlen_q, max_seqlen_k, *rest = ctx.args
    need_dq = ctx.needs_input_grad[0]
    need_dkv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    dq, dk, dv = bwd(q, k, v, out, lse, dout, dlse, bias, bias_keys, key_padding_mask, mask_keys, cu_seqlens_q,
                     cu_seqlens_k, max_seqlen_q, max_seqlen_k, *rest, need_dq, need_dkv)
    grads = [dq if need_dq else None, dk if ctx.needs_input_grad[1] else None,
             dv if ctx.needs_input_grad[2] else None]
    return (*grads, *([None] * (len(ctx.needs_input_grad) - 3)))


_attention_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


class _AttentionFunction(torch.autograd.Function):
    """The same forward and autograd formula as the registered op, for eager calls: the custom
    op's autograd layers (argument normalisation, redispatch) cost a few hundred microseconds of
    host time per training step, more than a short step's kernels take on the GPU."""

    @staticmethod
    def forward(ctx, q, k, v, bias, key_padding_mask, cu_seqlens_q, cu_seqlens_k, rest, entry=None):
        # a gradient autograd has none for stays None (an unused LSE: no zeros to allocate and
        # fill, and the δ pass skips its term)
        ctx.set_materialize_grads(False)
        args = (q, k, v, bias, rest[0], key_padding_mask, rest[1], cu_seqlens_q, cu_seqlens_k, *rest[2:])
        if entry is None:
            output = _attention_fwd_impl(*args)
        else:   # flash_attn_func's recorded plan for this call key (_grad_entry)
            plan, launch_key, scale, softcap = entry[:4]
            output = _launch(plan, launch_key, q, k, v, None, None, None, None, None, scale, softcap)
        _fwd_setup_context(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _fwd_backward(ctx, dout, dlse, attention_bwd_impl)


def _attention_fwd_grad(*args):
    """Forward that records its backward: the registered op (with its autograd formula) while
    torch.compile traces, :class:`_AttentionFunction` otherwise (the tensors as its arguments,
    the rest in one tuple: autograd inspects each argument of ``apply``)."""
    if torch.compiler.is_compiling():
        return _attention_fwd_op(*args)
    q, k, v, bias, bias_keys, key_padding_mask, mask_keys, cu_seqlens_q, cu_seqlens_k, *rest = args
    return _AttentionFunction.apply(q, k, v, bias, key_padding_mask, cu_seqlens_q, cu_seqlens_k,
                                    (bias_keys, mask_keys, *rest))


_attention_fwd = op_or_direct(_attention_fwd_op, _attention_fwd_impl)


def _window_args(causal: bool, window_size) -> tuple[bool, int, bool, int]:
    """The custom op's window arguments: (has_left, left, has_right, right)."""
    left, right = window_bounds(causal, window_size)
    return left >= 0, max(left, 0), right >= 0, max(right, 0)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    return_lse=False, key_padding_mask=None, deterministic=False):
    """Exact attention, FlashAttention layout.

    Everything after q, k, v is keyword-only: FlashAttention 2 takes ``dropout_p`` fourth and
    FlashAttention 3 ``softmax_scale``, so a positional fourth argument would mean one thing to
    code ported from one and another to code ported from the other (a dropout of 0.1 silently
    read as a softmax scale). The keywords mean what they mean there; ``return_lse`` returns
    ``(out, lse)`` (FlashAttention 2: ``return_attn_probs``, which also returns the
    probabilities; flashflow never forms them).

    Args:
        q: ``(batch, seqlen_q, heads, head_dim)``; k, v: ``(batch, seqlen_k, kv_heads, head_dim)``
            with ``heads % kv_heads == 0`` (GQA/MQA). fp16, bf16 (fp32 also accepted).
        softmax_scale: defaults to ``1/sqrt(head_dim)``.
        causal: mask aligned to the bottom-right corner of the score matrix (FlashAttention's rule,
            matters when ``seqlen_q != seqlen_k``).
        window_size: ``(left, right)`` sliding window, -1 = unbounded.
        softcap: if > 0, scores become ``softcap·tanh(scores/softcap)`` before the softmax.
        return_lse: also return the log-sum-exp, float32 ``(batch, heads, seqlen_q)``.
        key_padding_mask: bool ``(batch, P)`` with ``P <= seqlen_k``, True = attend. It covers
            keys ``[0, P)`` only: keys ``>= P`` are always attended. For a joint ``[text, image]``
            sequence pass the text mask alone (``P`` = text length): only the key blocks of the
            first ``P`` keys pay for the mask, the rest run the unmasked loop. Combines with
            ``causal`` / ``window_size``.
        deterministic: FlashAttention's flag for run-to-run identical gradients. flashflow's
            backward always is (no atomics: each gradient block has one program), so both values
            give the same bits.

    Differentiable: where q, k or v requires grad, the backward recomputes the probabilities
    from the saved log-sum-exp (memory O(seqlen)); a gradient not required is not computed
    (frozen K/V: no dK/dV launch). Also under ``torch.compile`` (custom ops with an autograd
    formula).

    Returns:
        ``out`` of q's shape and dtype, or ``(out, lse)``. Rows with no allowed key give 0
        (and lse = -inf).
    """
    key = None
    grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v))
    if key_padding_mask is None and not torch.compiler.is_compiling():
        # the key holds each tensor's requires_grad and the grad mode: a call that records
        # autograd has keys of its own, whose entries launch under _AttentionFunction
        key = call_key((q, k, v, softmax_scale, causal, window_size, softcap, return_lse, deterministic))
        _follow_kernel_override()
        entry = _ENTRIES.get(key) if key is not None else None
        if entry is not None and not autotune.enabled() and (q.is_cuda or interpreting()):
            if grad:
                out, lse = _AttentionFunction.apply(q, k, v, None, None, None, None, entry[4], entry)
            else:
                plan, launch_key, scale, softcap = entry
                out, lse = _launch(plan, launch_key, q, k, v, None, None, None, None, None, scale, softcap)
            return (out, lse) if return_lse else out
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 4, "(batch, seqlen, heads, head_dim)")
    check_qkv(q, k, v, head_axis=2)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k, v must share batch, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must share seqlen_k, got {k.shape[1]} and {v.shape[1]}")
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    mask_keys = 0
    if key_padding_mask is not None:
        key_padding_mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[1], q.device)
        mask_keys = key_padding_mask.shape[-1]
        if mask_keys == 0:   # the mask covers no key
            key_padding_mask = None
    check_flag("deterministic", deterministic)
    return_lse = check_flag("return_lse", return_lse)
    args = (q, k, v, None, 0, key_padding_mask, mask_keys, None, None, 0, 0, scale,
            *_window_args(causal, window_size), check_softcap(softcap))
    if grad:
        # through the registered op, whose autograd formula is the backward kernels; the LSE
        # is what the backward recomputes the probabilities from
        entry = _grad_entry(key, q, k, v, args, bool(causal)) if key is not None else None
        if entry is not None:
            out, lse = _AttentionFunction.apply(q, k, v, None, None, None, None, entry[4], entry)
        else:
            out, lse = _attention_fwd_grad(*args, True, bool(causal))
    elif key is not None:
        out, lse = _entry_call(key, q, k, v, args, bool(return_lse), bool(causal))
    else:
        out, lse = _attention_fwd(*args, bool(return_lse), bool(causal))
    return (out, lse) if return_lse else out


def _entry_plan(q, k, v, args, return_lse: bool, heavy_first: bool):
    """``(kw, found)`` for a validated :func:`flash_attn_func` call (its op arguments ``args``):
    ``kw`` the forward's keyword arguments, ``found`` its ``(plan, launch key)`` where the portable
    kernel (with work to do) or the Gluon kernel takes the call on unit-stride inputs, no
    autotuning is on and the entry table has room, else None."""
    scale, has_left, window_left, has_right, window_right, softcap = args[11:17]
    window_left = window_left if has_left else None
    window_right = window_right if has_right else None
    kw = dict(bias=None, bias_keys=0, key_padding_mask=None, mask_keys=0, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=0, max_seqlen_k=0, softmax_scale=scale, window_left=window_left,
              window_right=window_right, softcap=softcap, return_lse=return_lse, heavy_first=heavy_first)
    if (not (q.is_cuda or interpreting()) or autotune.enabled() or len(_ENTRIES) >= MAX_PLANS
            or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1):
        return kw, None
    kernel = forward_kernel_name(q, k, v, **kw)
    if kernel == attention_gluon.GLUON:
        return kw, attention_gluon.gluon_plan(q, k, v, None, 0, window_right, return_lse, heavy_first)
    if kernel != PORTABLE:
        return kw, None
    plan, launch_key = _forward_plan(q, k, v, None, 0, None, 0, None, None, 0, 0, scale, window_left, window_right,
                                     softcap, return_lse, heavy_first, None, None, None)
    return kw, None if plan.empty else (plan, launch_key)


def _grad_entry(key, q, k, v, args, heavy_first: bool):
    """The entry of a validated call that records autograd: ``(plan, launch key, scale, softcap,
    the op's remaining arguments as _AttentionFunction takes them)``, recorded under ``key``; None
    where no plan can stand for the call."""
    _, found = _entry_plan(q, k, v, args, True, heavy_first)
    if found is None:
        return None
    entry = (*found, args[11], args[16], (args[4], args[6], *args[9:], True, heavy_first))
    _ENTRIES[key] = entry
    return entry


def _entry_call(key, q, k, v, args, return_lse: bool, heavy_first: bool):
    """A validated call of :func:`flash_attn_func` (its op arguments ``args``) run as the op runs
    it, recording ``(plan, launch key, scale, softcap)`` under ``key`` where a plan can stand for
    it (:func:`_entry_plan`)."""
    kw, found = _entry_plan(q, k, v, args, return_lse, heavy_first)
    if found is None:
        return attention_forward(q, k, v, **kw)
    plan, launch_key = found
    _ENTRIES[key] = (plan, launch_key, args[11], args[16])
    return _launch(plan, launch_key, q, k, v, None, None, None, None, None, args[11], args[16])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           return_lse=False, deterministic=False):
    """Exact attention over a packed ragged batch (FlashAttention's varlen API).

    q ``(total_q, heads, head_dim)``, k/v ``(total_k, kv_heads, head_dim)``; sequence ``b`` is
    ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``. ``cu_seqlens_*`` are int32 ``(batch + 1,)``.
    Returns out ``(total_q, heads, head_dim)`` and, with ``return_lse``, lse ``(heads, total_q)``.
    Arguments after ``max_seqlen_k`` are keyword-only, as in :func:`flash_attn_func` (FlashAttention
    2 puts ``dropout_p`` there, FlashAttention 3 ``seqused_q``).
    Differentiable as :func:`flash_attn_func` (per-sequence gradients, no cross-sequence terms;
    ``deterministic`` as there: always holds).
    """
    check_flag("deterministic", deterministic)
    return_lse = check_flag("return_lse", return_lse)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 3, "(total_tokens, heads, head_dim)")
    check_qkv(q, k, v, head_axis=1)
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must share total_k, got {k.shape[0]} and {v.shape[0]}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
            raise TypeError(f"{name} must be a 1-D int32 tensor (batch + 1,), got "
                            f"{getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {cu.device}")
        if cu.numel() < 2:
            raise ValueError(f"{name} must hold batch + 1 >= 2 offsets, got {cu.numel()}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                         f"got {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    max_seqlen_q, max_seqlen_k = check_int("max_seqlen_q", max_seqlen_q, 0), check_int("max_seqlen_k", max_seqlen_k, 0)
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    args = (q, k, v, None, 0, None, 0, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), int(max_seqlen_q),
            int(max_seqlen_k), scale, *_window_args(causal, window_size), check_softcap(softcap))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = _attention_fwd_grad(*args, True, bool(causal))   # differentiable: keeps the LSE
    else:
        out, lse = _attention_fwd(*args, bool(return_lse), bool(causal))
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``, differentiable in query,
    key and value as :func:`flash_attn_func` (with or without ``attn_mask``; a mask that requires
    grad is refused: no gradient flows to it).

    Layout ``(batch, heads, seqlen, head_dim)`` (3-D ``(heads, seqlen, head_dim)`` also taken).
    ``is_causal`` is aligned top-left as in PyTorch. ``attn_mask`` may be boolean (True = attend)
    or additive float, broadcastable to ``(batch, heads, seqlen_q, seqlen_k)``. Unlike PyTorch,
    a fully masked row gives 0, not NaN.
    """
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0 (flashflow attention has no dropout), got {dropout_p}")
    is_causal, enable_gqa = check_flag("is_causal", is_causal), check_flag("enable_gqa", enable_gqa)
    squeeze = False
    if isinstance(query, torch.Tensor) and query.dim() == 3:
        query, key, value = query[None], key[None] if key.dim() == 3 else key, value[None] if value.dim() == 3 else value
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask[None]
        squeeze = True
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, 4, "(batch, heads, seqlen, head_dim)")
    check_no_grad("scaled_dot_product_attention", attn_mask=attn_mask)
    if not enable_gqa and key.shape[1] != query.shape[1]:
        raise ValueError(f"query has {query.shape[1]} heads but key has {key.shape[1]}; "
                         "pass enable_gqa=True for grouped-query attention")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    check_qkv(q, k, v, head_axis=2)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"query, key, value must share batch, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"key and value must share seqlen, got {k.shape[1]} and {v.shape[1]}")
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    if is_causal and attn_mask is not None:
        raise ValueError("pass either attn_mask or is_causal=True, not both (as PyTorch requires)")
    bias = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask must be on {q.device}, got {attn_mask.device}")
        target = (batch, heads, seqlen_q, seqlen_k)
        try:
            expanded = attn_mask.expand(target) if attn_mask.dim() <= 4 else None
        except RuntimeError:
            expanded = None
        if expanded is None:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                             f"(batch, heads, seqlen_q, seqlen_k) = {target}")
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=torch.float32, device=q.device)
            bias = bias.masked_fill(~attn_mask, float("-inf")).expand(target)
        elif attn_mask.is_floating_point():
            bias = expanded
        else:
            raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    softmax_scale = softmax_scale_or_default(scale, head_dim, name="scale")
    # PyTorch's causal mask keeps j <= i (top-left); the kernel's diagonal is bottom-right,
    # i.e. j <= i + (seqlen_k - seqlen_q) + right, so shift the right edge back.
    has_right = bool(is_causal)
    right = seqlen_q - seqlen_k if is_causal else 0
    bias_keys = seqlen_k if bias is not None else 0   # attn_mask may bias any key
    args = (q, k, v, bias, bias_keys, None, 0, None, None, 0, 0, softmax_scale, False, 0, has_right, right, 0.0)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, _ = _attention_fwd_grad(*args, True, bool(is_causal))   # differentiable (no grad to the mask)
    else:
        out, _ = _attention_fwd(*args, False, bool(is_causal))
    out = out.transpose(1, 2)
    return out[0] if squeeze else out
