"""The Hopper attention forward in Gluon (:mod:`flashflow.kernels.attention_gluon`): which calls
it takes, its config and its launch.

:func:`flashflow.ops.attention.attention_forward` runs the first registered forward kernel that
supports a call; this one registers ahead of the portable Triton kernel. It takes a call
(:func:`supports`) on an sm90 GPU, in bf16 or fp16, at a head_dim with a shipped config whose
``auto`` is on and whose ``min_seqlen_k`` the keys reach (``tuning/attention_gluon.json``:
head_dim 128 from 256 keys, 512 causal; head_dim 256 from 512 keys; head_dim 64 from 2048 keys,
causal or not; on shorter calls the portable kernel measured faster), dense (no varlen), with no additive bias, softcap or
window other than causal, and q/k/v describable by host TMA descriptors (16-byte aligned bases and strides, unit last
stride, a 2-D row view: :func:`flashflow.ops.common.rows_view`; k and v alike). A key-padding
mask and an LSE are taken. Everything else runs on the portable kernel.

``FLASHFLOW_ATTENTION_KERNEL`` forces the choice: ``portable`` never takes this kernel,
``gluon`` takes it wherever it can run (``auto`` off included) and raises a ``ValueError``
naming the reason where it cannot; ``auto`` (the default) is the rule above.
:func:`unsupported_reason` is the rule in words (``flashflow info`` prints the choice).

A call's launch is worked out once per call key (:class:`GluonPlan`: descriptors' views and
blocks, grid, integer arguments, constexprs) and launched through
:class:`~flashflow.ops.common.Launcher`, which skips Triton's per-call argument binding;
``flash_attn_func`` records the plan under its own call key as it does the portable kernel's.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch

from flashflow.device import cdiv, gpu_family, interpreting, num_sms, on_gpu
from flashflow.kernels.softmax import LOG2E
from flashflow.ops.common import Launcher, aligned16, contiguous_strides, rows_view, stream_scratch, tma_strides_ok
from flashflow.tuning import NoConfigError
from flashflow.tuning.attention_gluon import GluonAttentionConfig, gluon_attention_config, last_wave_pieces

GLUON = "gluon-sm90"
KERNEL_ENV = "FLASHFLOW_ATTENTION_KERNEL"
KERNEL_CHOICES = ("auto", "gluon", "portable")
DTYPES = (torch.bfloat16, torch.float16)


def kernel_choice() -> str:
    """``FLASHFLOW_ATTENTION_KERNEL``, checked: ``auto`` (unset), ``gluon`` or ``portable``."""
    choice = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV} must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    return choice


def unsupported_reason(q, k, v, *, bias=None, cu_seqlens_q=None, softcap=0.0, window_left=None, window_right=None,
                       softmax_scale=None, config=None, out=None, forced: bool = False, **_) -> Optional[str]:
    """Why the Gluon kernel does not take this call (None: it does). ``forced``: as under
    ``FLASHFLOW_ATTENTION_KERNEL=gluon`` (a config with ``auto`` off still runs)."""
    if interpreting() or not on_gpu(q.device):
        return "not on a CUDA device"
    family = gpu_family(q.device)
    if family != "sm90":
        return f"not a Hopper GPU ({family})"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (takes bf16 or fp16)"
    if cu_seqlens_q is not None:
        return "varlen (cu_seqlens)"
    if bias is not None:
        return "an additive bias"
    if softcap > 0:
        return "softcap"
    if window_left is not None or window_right not in (None, 0):
        return "a window other than causal"
    if softmax_scale is not None and not (0 < softmax_scale < math.inf):
        return f"softmax_scale {softmax_scale} (the kernel masks raw scores: it takes a positive, finite scale)"
    if config is not None:
        return "a portable config was given"
    if q.numel() == 0 or k.shape[1] == 0:
        return "an empty call"
    causal = window_right is not None
    try:
        cfg = gluon_attention_config(q.shape[-1], causal, family, k.shape[1])
    except NoConfigError:
        return f"head_dim {q.shape[-1]} (no Gluon config)"
    if not (cfg.auto or forced):
        return f"head_dim {q.shape[-1]}{' causal' if causal else ''}: the portable kernel measured faster"
    if k.shape[1] < cfg.min_seqlen_k and not forced:
        return f"fewer than {cfg.min_seqlen_k} keys: the portable kernel measured faster"
    if out is not None and out.stride(-1) != 1:
        return "out without unit last stride"
    es = q.element_size()
    if not (aligned16(q, k, v) and all(t.stride(-1) == 1 and tma_strides_ok(t.stride(), es) for t in (q, k, v))):
        return "q, k, v not describable by TMA (16-byte aligned bases and strides, unit last stride)"
    views = [rows_view(t.shape, t.stride()) for t in (q, k, v)]
    if not all(views) or views[1][:3] != views[2][:3]:
        return "q, k, v strides allow no 2-D row view (k and v alike)"
    return None


def supports(q, k, v, **kw) -> bool:
    choice = kernel_choice()
    if choice == "portable":
        return False
    reason = unsupported_reason(q, k, v, forced=choice == "gluon", **kw)
    if reason is not None and choice == "gluon":
        raise ValueError(f"{KERNEL_ENV}=gluon: the Gluon attention forward cannot take this call: {reason}")
    return reason is None


def gluon_forward(q, k, v, *, key_padding_mask=None, mask_keys=None, softmax_scale: float, window_right=None,
                  return_lse: bool = True, heavy_first: bool = False, out=None,
                  config: Optional[GluonAttentionConfig] = None, **_):
    """Launch the Gluon forward on validated tensors in FlashAttention layout (the keyword
    arguments of ``flashflow.ops.attention._portable_forward``; what :func:`supports` refuses
    never comes here). ``config`` overrides the shipped one (studies, tests). Returns
    ``(out, lse)``: lse ``(b, h, sq)`` float32, natural log, ``(0,)`` without ``return_lse``."""
    if key_padding_mask is not None and mask_keys is None:
        mask_keys = key_padding_mask.shape[1]
    plan, launch_key = gluon_plan(q, k, v, key_padding_mask, mask_keys or 0, window_right, return_lse, heavy_first,
                                  config, out)
    return plan.launch(launch_key, q, k, v, out, key_padding_mask, softmax_scale)


def gluon_plan(q, k, v, key_padding_mask, mask_keys: int, window_right, return_lse: bool, heavy_first: bool,
               config=None, out=None) -> tuple:
    """``(plan, launch_key)`` of a Gluon call (:func:`gluon_forward`'s arguments, ``mask_keys``
    set): the :class:`GluonPlan` of the call's key, worked out on its first call, and the key
    its :class:`~flashflow.ops.common.Launcher` is called with (None where an address is not
    16-byte aligned: Triton specialises that call)."""
    kpm = key_padding_mask
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.get_device(),
           None if out is None else out.stride(),
           None if kpm is None else (kpm.dtype, kpm.shape, kpm.stride()), mask_keys,
           window_right is not None, return_lse, heavy_first, config,
           None if q.is_cuda else num_sms(q.device),   # (offline: the stood-in GPU's)
           aligned16(q, k, v, out, kpm))
    plan = _PLANS.get(key)
    if plan is None:
        plan = GluonPlan(q, k, v, kpm, mask_keys, window_right is not None, return_lse, heavy_first, config, out)
        if len(_PLANS) < MAX_PLANS:
            _PLANS[key] = plan
    return plan, (key if key[-1] else None)


class GluonPlan:
    """What a Gluon launch derives from its call's key (shapes, strides, dtype, device, flags,
    config): the config, the TMA descriptors' views and blocks, the grid, the kernel's integer
    arguments and constexprs. A call then builds three descriptors and launches
    (:meth:`launch`); the plan keeps no tensor."""

    __slots__ = ("cfg", "descs", "grid", "ints", "constexprs", "lse_shape", "split_tiles", "ws_words",
                 "_descriptor_of", "_launch")
    # with tiles by ticket the launch takes the tile counter, one zeroed int32 word the kernel
    # leaves zeroed, from the stream's scratch (ops/common.py); without, any pointer stands in.
    # With the last wave's tiles in key pieces (``split_tiles`` of them) it also takes two zeroed
    # words a split tile and ``ws_words`` fp32 for the pieces' rows from the stream's scratch

    def __init__(self, q, k, v, kpm, mask_keys, causal, return_lse, heavy_first, config, out):
        from flashflow.kernels.attention_gluon import descriptor, descriptor_of, descriptor_spec

        self._descriptor_of, self._launch = descriptor_of, _launcher()   # looked up once, not per call

        batch, seqlen_q, heads, head_dim = q.shape
        seqlen_k, kv_heads = k.shape[1], k.shape[2]
        cfg = self.cfg = config or gluon_attention_config(head_dim, causal, gpu_family(q.device), seqlen_k)
        self.lse_shape = (batch, heads, seqlen_q) if return_lse else (0,)
        views = [rows_view(t.shape, t.stride()) for t in (q, k, v)]
        self.descs = tuple(descriptor_spec(vw[3:], [rows, head_dim], q.dtype)
                           for vw, rows in zip(views, (cfg.q_rows, cfg.BLOCK_N, cfg.BLOCK_N)))
        for t, spec in zip((q, k, v), self.descs):   # checked once: later calls share the key
            descriptor(t, spec)
        num_m_blocks = cdiv(seqlen_q, cfg.BLOCK_M)
        num_tiles = num_m_blocks * heads * batch
        ctas = num_sms(q.device)
        pieces = last_wave_pieces(cfg, causal, num_tiles, ctas, cdiv(seqlen_k, cfg.BLOCK_N))
        self.split_tiles = num_tiles % ctas if pieces > 1 else 0   # the tiles past the last full wave
        full_units = num_tiles - self.split_tiles
        units = full_units + self.split_tiles * pieces
        self.ws_words = self.split_tiles * (pieces - 1) * cfg.partitions * 64 * (head_dim + 2)
        self.grid = (min(units, ctas) if cfg.persistent else num_tiles, 1, 1)
        so = out.stride() if out is not None else contiguous_strides(q.shape)
        self.ints = (so[0], so[1], so[2], heads * seqlen_q if return_lse else 0, seqlen_q if return_lse else 0,
                     kpm.stride(0) if kpm is not None else 0, *views[0][:3], *views[1][:3],
                     seqlen_q, seqlen_k, heads, heads // kv_heads, num_m_blocks, units, full_units, pieces,
                     mask_keys if kpm is not None else 0)
        self.constexprs = dict(
            HEAD_DIM=head_dim, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, NUM_STAGES=cfg.num_stages, CAUSAL=causal,
            KEY_PADDING=kpm is not None, RETURN_LSE=return_lse, HEAVY_FIRST=causal and heavy_first,
            WARP_SPECIALIZE=cfg.warp_specialize, SPLIT_WARPGROUPS=cfg.split_warpgroups, PINGPONG=cfg.pingpong,
            # key pieces wait on each other: only CTAs already running take a unit (by ticket)
            DYNAMIC=cfg.dynamic or pieces > 1, SPLIT=pieces > 1,
            Q_BUFS=cfg.q_buffers if cfg.persistent else 1, OVERLAP=cfg.overlap_tiles, num_warps=cfg.num_warps,
            PARTITIONS=cfg.partitions, EARLY_RESCALE=cfg.early_rescale)

    def launch(self, launch_key, q, k, v, out, kpm, softmax_scale: float):
        """Allocate the call's outputs and launch; returns ``(out, lse)``."""
        if out is None:
            out = q.new_empty(q.shape)
        lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        make, (qs, ks, vs) = self._descriptor_of, self.descs
        counter = stream_scratch("attention-tiles", 1, q.device) if self.constexprs["DYNAMIC"] else q
        if self.split_tiles:
            ws = stream_scratch("attention-piece-rows", self.ws_words, q.device, torch.float32)
            split_counter = stream_scratch("attention-pieces", self.cfg.partitions * self.split_tiles, q.device)
        else:
            ws = split_counter = q
        self._launch(launch_key, self.grid, (make(q, qs), make(k, ks), make(v, vs), out, lse,
                                             q if kpm is None else kpm, counter, ws, split_counter, *self.ints,
                                             softmax_scale * LOG2E),
                     self.constexprs)
        return out, lse


@functools.lru_cache(maxsize=1)
def _launcher() -> Launcher:
    from flashflow.kernels.attention_gluon import attention_fwd_gluon_kernel

    return Launcher(attention_fwd_gluon_kernel)


_PLANS: dict = {}
MAX_PLANS = 4096   # distinct call keys kept; later ones are worked out per call
