"""Decode attention against a KV cache: validation, split planning, launch.

* :func:`flash_attn_with_kvcache` — FlashAttention 2's signature and meaning (contiguous or paged
  cache, in-kernel append of the new K/V, ragged ``cache_seqlens``), plus the FasterTransformer
  cache layout and FP8 caches; FlashAttention's arguments flashflow does not implement (rotary,
  ``cache_batch_idx``, ``cache_leftpad``, ALiBi) are refused by name.
* :class:`DecodePlan` / :func:`plan_decode` — the serving-engine split: plan once per batch layout
  (split count, workspace, counters), then :meth:`DecodePlan.run` every step: no host
  synchronisation, a fixed workspace, CUDA-graph capturable.
* :func:`merge_attention_states` — combine two partial attention results by their LSE.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Optional

import torch

from flashflow.device import capturing, cdiv, gpu_family, next_pow2, num_sms as device_num_sms
from flashflow.kernels.decode import decode_attention_kernel, merge_states_kernel
from flashflow.kernels.softmax import LOG2E
from flashflow.ops.common import (Launcher, call_key, stream_key, contiguous_strides as _contiguous_strides, dot_options,
                                  head_dim_pad as _head_dim_pad, unit_last_stride)
from flashflow.ops.validate import (check_flag, overlaps_itself, check_head_dim, check_heads, check_int, check_no_grad, check_qkv,
                                    check_runs_here, check_scale, check_softcap, check_tensor,
                                    softmax_scale_or_default, window_bounds)
from flashflow.tuning.decode import cap_splits, DecodeConfig, decode_config, num_splits_heuristic

KV_LAYOUTS = ("NHD", "FT")
FP8_CACHE_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8_CACHE_DTYPE)
MAX_ROWS = 128  # query heads per KV head × query tokens handled by one program
# the most key-range splits a launch takes: the fused merge is unrolled over the splits, and
# the heuristic's own maximum is 32 (FlashAttention caps its num_splits at 128)


def _ft_x(dtype: torch.dtype) -> int:
    return 16 // dtype.itemsize


def check_kv_scale(name: str, scale, kv_heads: int, device) -> tuple[float, Optional[torch.Tensor]]:
    """``(per-tensor value, per-head tensor or None)`` of a cache scale: None (1.0), a Python float
    > 0, or a float32 tensor ``(kv_heads,)`` on the cache's device."""
    if scale is None:
        return 1.0, None
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32 or tuple(scale.shape) != (kv_heads,):
            raise TypeError(f"{name} must be a float or a float32 tensor of shape (kv_heads,) = ({kv_heads},), "
                            f"got a {scale.dtype} tensor of shape {tuple(scale.shape)}")
        if scale.device != torch.device(device):
            raise ValueError(f"{name} must be on {device}, got {scale.device}")
        check_no_grad("flash_attn_with_kvcache", **{name: scale})
        return 1.0, scale.contiguous()
    return check_scale(name, scale), None


def _check_scales(k_cache, k_scale, v_scale, kv_heads, device):
    """``(k_val, k_per_head, v_val, v_per_head)``: the forms of an FP8 cache's scales (their
    per-head values are read, if at all, by :func:`_check_values`)."""
    if k_cache.dtype != FP8_CACHE_DTYPE and (k_scale is not None or v_scale is not None):
        raise ValueError(f"k_scale/v_scale apply to {FP8_CACHE_DTYPE} caches only; this cache is "
                         f"{k_cache.dtype}")
    k_val, k_per_head = check_kv_scale("k_scale", k_scale, kv_heads, device)
    v_val, v_per_head = check_kv_scale("v_scale", v_scale, kv_heads, device)
    if (k_per_head is None) != (v_per_head is None):
        raise TypeError("k_scale and v_scale must both be floats (per tensor) or both (kv_heads,) tensors "
                        "(per head)")
    return k_val, k_per_head, v_val, v_per_head


def _cache_geometry(q, k_cache, v_cache, block_table, kv_layout):
    """Validate the cache tensors; return (capacity, kv_heads, page_size, layout code)."""
    batch, _, _, head_dim = q.shape
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype == FP8_CACHE_DTYPE:
            if q.dtype not in (torch.float16, torch.bfloat16):
                raise TypeError(f"an FP8 {name} needs q in float16 or bfloat16, got q {q.dtype}")
        elif t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype} or be {FP8_CACHE_DTYPE} (an FP8 cache), "
                            f"got {t.dtype}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must share a dtype, got {k_cache.dtype} and {v_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dimension, got strides {t.stride()}")
    if kv_layout == "FT":
        if block_table is not None:
            raise ValueError("block_table (paged cache) is not supported with kv_layout='FT'")
        x = _ft_x(k_cache.dtype)
        if k_cache.dim() != 5 or k_cache.shape[0] != batch or k_cache.shape[2] * k_cache.shape[4] != head_dim \
                or k_cache.shape[4] != x:
            raise ValueError(f"k_cache in the FT layout must be (batch, kv_heads, head_dim/{x}, capacity, {x}) = "
                             f"({batch}, kv_heads, {head_dim // x}, capacity, {x}) (x: 16 bytes of "
                             f"{k_cache.dtype}), got {tuple(k_cache.shape)}")
        if k_cache.stride(3) != x or k_cache.stride(2) % x:
            raise ValueError(f"k_cache in the FT layout must hold each key's {x} channels contiguous, keys {x} "
                             f"elements apart (strides (..., {x}·capacity, {x}, 1)), got strides {k_cache.stride()}")
        kv_heads, capacity = k_cache.shape[1], k_cache.shape[3]
        if tuple(v_cache.shape) != (batch, kv_heads, capacity, head_dim):
            raise ValueError(f"v_cache in the FT layout must be (batch, kv_heads, capacity, head_dim) = "
                             f"{(batch, kv_heads, capacity, head_dim)}, got {tuple(v_cache.shape)}")
        return capacity, kv_heads, 1, 2
    if k_cache.dim() != 4 or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError("k_cache and v_cache must both be (batch, capacity, kv_heads, head_dim), or "
                         f"(num_blocks, page_size, kv_heads, head_dim) with block_table; got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[-1] != head_dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[-1]} != q head_dim {head_dim}")
    kv_heads = k_cache.shape[2]
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache batch {k_cache.shape[0]} != q batch {batch}")
        return k_cache.shape[1], kv_heads, 1, 0
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise TypeError(f"block_table must be an int32 tensor (batch, max_blocks_per_seq), got "
                        f"{getattr(block_table, 'dtype', type(block_table).__name__)}")
    if block_table.shape[0] != batch or block_table.device != q.device:
        raise ValueError(f"block_table must be ({batch}, max_blocks) on {q.device}, got "
                         f"{tuple(block_table.shape)} on {block_table.device}")
    page = k_cache.shape[1]
    return block_table.shape[1] * page, kv_heads, page, 1


class DecodePlan:
    """Split count, workspace and counters for one batch layout; :meth:`run` is sync-free.

    Build it once per (batch, heads, kv_heads, head_dim, capacity, seqlen_q) and call
    :meth:`run` every decode step, also inside CUDA-graph capture: the workspace is fixed and
    the merge counters are reset by the kernel itself. ``kv_dtype``: the caches' dtype where it
    is ``torch.float8_e4m3fn`` (an FP8 cache takes more splits and its own tiles; a plan runs
    the kind of cache it was made for); None or a 16/32-bit dtype otherwise. ``num_splits``: 0
    for the heuristic's (:func:`num_splits_heuristic`), else an int >= 1 capped at the key blocks
    of ``max_seqlen_k`` (of the config's ``BLOCK_N`` tokens) and at ``MAX_SPLITS`` (32): more
    splits only add empty slices and partials to merge, and the output does not depend on the
    count; ``self.num_splits`` is the count run.
    """

    def __init__(self, batch: int, heads: int, kv_heads: int, head_dim: int, max_seqlen_k: int, *,
                 seqlen_q: int = 1, device="cuda", num_splits: int = 0, num_sms: Optional[int] = None,
                 config: Optional[DecodeConfig] = None, kv_dtype: Optional[torch.dtype] = None):
        device = torch.device(device)
        if device.type == "meta":
            raise ValueError("device must be where the kernels run (a CUDA device, or cpu under TRITON_INTERPRET=1), "
                             "got meta")
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise TypeError(f"kv_dtype must be None (q's dtype) or one of {KV_DTYPES}, got {kv_dtype!r}")
        batch, seqlen_q, max_seqlen_k = (check_int(n, x, 0) for n, x in (("batch", batch), ("seqlen_q", seqlen_q),
                                                                          ("max_seqlen_k", max_seqlen_k)))
        heads, kv_heads, head_dim = (check_int(n, x) for n, x in (("heads", heads), ("kv_heads", kv_heads),
                                                                  ("head_dim", head_dim)))
        num_splits = self.num_splits_asked = check_int("num_splits", num_splits, 0)
        check_heads(heads, kv_heads)
        check_head_dim(head_dim)
        group = heads // kv_heads
        if group * seqlen_q > MAX_ROWS:
            raise ValueError(f"kv group ({group}) × seqlen_q ({seqlen_q}) must be <= {MAX_ROWS}; use "
                             "flash_attn_func for longer query blocks")
        self.batch, self.heads, self.kv_heads, self.head_dim = batch, heads, kv_heads, head_dim
        self.seqlen_q, self.max_seqlen_k = seqlen_q, max_seqlen_k
        self.head_dim_pad = _head_dim_pad(head_dim)
        self.block_r = max(16, next_pow2(group * seqlen_q))
        self.kv_fp8 = kv_dtype == FP8_CACHE_DTYPE
        family = gpu_family(device)
        if num_sms is None:
            num_sms = device_num_sms(device)
        self.config_given = config is not None
        # the tiles for a contiguous cache; a paged one may take page-sized tiles (config_for)
        self._lookup = dict(family=family, head_dim_pad=self.head_dim_pad, programs=batch * kv_heads,
                            num_sms=num_sms, max_seqlen_k=max_seqlen_k, num_splits=num_splits)
        self.config = config or decode_config(**self._lookup, kv_fp8=self.kv_fp8)
        if num_splits:
            capped = cap_splits(num_splits, max_seqlen_k, self.config.BLOCK_N)
            if capped != num_splits:
                num_splits = self._lookup["num_splits"] = capped
                self.config = config or decode_config(**self._lookup, kv_fp8=self.kv_fp8)
        self._page_configs: dict[int, DecodeConfig] = {}
        self.num_splits = num_splits or num_splits_heuristic(batch * kv_heads, max_seqlen_k, num_sms,
                                                             self.config.BLOCK_N, kv_fp8=self.kv_fp8)
        n = batch * kv_heads
        if self.num_splits > 1:
            self.ws_acc = torch.empty((n, self.num_splits, self.block_r, self.head_dim_pad),
                                      dtype=torch.float32, device=device)
            self.ws_ml = torch.empty((n, self.num_splits, 2, self.block_r), dtype=torch.float32, device=device)
            self.counters = torch.zeros(n, dtype=torch.int32, device=device)
        else:
            self.ws_acc = self.ws_ml = self.counters = torch.empty(1, dtype=torch.float32, device=device)
        self._no_lse = torch.empty(1, dtype=torch.float32, device=device)   # never written
        self._full_lens: dict[int, torch.Tensor] = {}   # cache_seqlens=None, built outside capture
        self._launches: dict = {}   # call key -> _DecodeLaunch

    def config_for(self, page_size: Optional[int]) -> DecodeConfig:
        """The tiles of a launch on a paged cache of ``page_size`` (None: contiguous): the plan's
        ``config`` if one was given, else :func:`flashflow.tuning.decode.decode_config`'s."""
        if self.config_given or page_size is None:
            return self.config
        cfg = self._page_configs.get(page_size)
        if cfg is None:
            cfg = self._page_configs[page_size] = decode_config(**self._lookup, page_size=page_size,
                                                                 kv_fp8=self.kv_fp8)
        return cfg

    def run(self, q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, return_lse=False, *,
            kv_layout="NHD", out=None, k_scale=None, v_scale=None):
        """One decode step: :func:`flash_attn_with_kvcache`'s arguments and meaning (``causal``
        False by default, as there), its shared arguments in its order; ``return_lse`` is
        ``return_softmax_lse``; ``out``: a tensor of q's shape and dtype to write the output into
        (any strides with a unit last one, no two elements at one address), else one is allocated.

        Shapes, dtypes, devices and flags are checked; no device value is read, so this runs
        inside CUDA-graph capture. The values in tensors are then the caller's: ``cache_seqlens``
        (plus the new tokens) within the capacity, the ``block_table`` entries a sequence uses
        within ``[0, num_blocks)``, and per-head ``k_scale``/``v_scale`` finite and > 0 (only their
        shape ``(kv_heads,)`` is checked, so no scale is read out of bounds; a zero, negative,
        inf or NaN scale gives a wrong output and an append quantized with it).
        :func:`flash_attn_with_kvcache` without a plan checks them all, in one read-back.

        A q, k or v whose last axis is not unit-stride is copied first (the kernel reads
        head_dim with unit stride); every other stride (transposed, ``expand``-ed, a slice of a
        packed qkv) is read as it is.

        The checks and everything the launch derives from them run once per call key (the
        arguments' shapes, strides, dtypes, devices, flags and scalar values,
        :func:`flashflow.ops.common.call_key`); a step with a key seen before allocates its
        output and launches.
        """
        args = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
                return_lse, kv_layout, out, k_scale, v_scale)
        key = call_key(args)
        launch = self._launches.get(key) if key is not None else None
        if launch is None:
            launch = self._prepare(*args)
            # the kernel's key: the call's and what the plan adds (splits, tiles, rows per program)
            launch.launch_key = (key, tuple(launch.constexprs.items())) if key is not None and key[-1] else None
            if key is not None and len(self._launches) < MAX_LAUNCH_KEYS:
                self._launches[key] = launch
        return launch(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, k_scale, v_scale)

    def _prepare(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size,
                 softcap, return_lse, kv_layout, out, k_scale, v_scale) -> "_DecodeLaunch":
        """The checks of :meth:`run` and what its launch derives from the arguments."""
        _check_decode_inputs(q, k, v, k_cache, v_cache)
        if q.device != self._no_lse.device:
            raise ValueError(f"this plan is for {self._no_lse.device}, got q on {q.device}")
        return_lse = check_flag("return_lse", return_lse)
        capacity, kv_heads, page, layout = _cache_geometry(q, k_cache, v_cache, block_table, kv_layout)
        fp8 = k_cache.dtype == FP8_CACHE_DTYPE
        if fp8 != self.kv_fp8:
            raise ValueError(f"this plan is for {'an FP8' if self.kv_fp8 else 'a 16/32-bit'} cache (kv_dtype); got "
                             f"{k_cache.dtype} caches: plan with kv_dtype={k_cache.dtype}")
        k_val, k_per_head, v_val, v_per_head = _check_scales(k_cache, k_scale, v_scale, kv_heads, q.device)
        batch, seqlen_q, heads, head_dim = q.shape
        if (batch, heads, kv_heads, head_dim, seqlen_q) != (self.batch, self.heads, self.kv_heads,
                                                            self.head_dim, self.seqlen_q):
            raise ValueError(f"this plan is for (batch, heads, kv_heads, head_dim, seqlen_q) = "
                             f"{(self.batch, self.heads, self.kv_heads, self.head_dim, self.seqlen_q)}, got "
                             f"{(batch, heads, kv_heads, head_dim, seqlen_q)}")
        if k is not None and (k.shape[0] != batch or k.shape[2] != kv_heads or k.shape[3] != head_dim):
            raise ValueError(f"k must be (batch, seqlen_new, kv_heads, head_dim) = ({batch}, n, {kv_heads}, "
                             f"{head_dim}), got {tuple(k.shape)}")
        n_new = 0 if k is None else k.shape[1]
        if n_new and cache_seqlens is None:
            raise ValueError("cache_seqlens is required when appending k/v (where to write them)")
        if n_new:
            for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
                if overlaps_itself(t):   # several sequences' new tokens would land on one address
                    raise ValueError(f"{name} has elements sharing an address (an expand-ed or overlapping view, "
                                     f"strides {t.stride()}): the append cannot write into it; pass a cache with "
                                     "its own memory per position")
        if _is_int(cache_seqlens) and (cache_seqlens < 0 or cache_seqlens + n_new > capacity):
            raise ValueError(f"cache_seqlens = {cache_seqlens} plus {n_new} new tokens exceeds the cache capacity "
                             f"({capacity} tokens)")
        if out is not None:
            _check_out(out, q)
        if cache_seqlens is not None and not _is_int(cache_seqlens):
            _seqlens_tensor(cache_seqlens, batch, 0, q.device)   # its form
        # the kernel indexes head_dim with unit stride, every other axis by its stride
        q = unit_last_stride(q)
        if k is not None:
            k, v = unit_last_stride(k), unit_last_stride(v)
        left, right = window_bounds(causal, window_size)
        softcap = check_softcap(softcap)
        scale = softmax_scale_or_default(softmax_scale, head_dim)
        qk_scale_log2 = scale / softcap if softcap > 0 else scale * LOG2E
        lens = None
        if _is_int(cache_seqlens) and not capturing(q.device):   # built once, read by every step
            lens = _seqlens_tensor(cache_seqlens, batch, capacity - n_new, q.device)
        kn = k if k is not None else q
        vn = v if v is not None else q
        out_stride = out.stride() if out is not None else _contiguous_strides(q.shape)
        ls = (heads * seqlen_q, seqlen_q, 1) if return_lse else (0, 0, 0)
        cfg = self.config_for(page if layout == 1 else None)
        tail = (*q.stride()[:3], *out_stride[:3], *ls, *k_cache.stride()[:3], *v_cache.stride()[:3],
                *kn.stride()[:3], *vn.stride()[:3], block_table.stride(0) if block_table is not None else 0,
                seqlen_q, n_new, heads // kv_heads, kv_heads,
                qk_scale_log2, softcap, max(left, 0), max(right, 0), k_val, v_val)
        constexprs = dict(
            HEAD_DIM=head_dim, HEAD_DIM_PAD=self.head_dim_pad, BLOCK_N=cfg.BLOCK_N,
            BLOCK_R=self.block_r, BLOCK_NEW=max(16, next_pow2(n_new)),
            NUM_SPLITS=self.num_splits, PAGE_SIZE=page, LAYOUT=layout,
            FT_X=_ft_x(k_cache.dtype) if layout == 2 else 1, KV_FP8=fp8, SCALE_PER_HEAD=k_per_head is not None,
            HAS_NEW=n_new > 0, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, HAS_SOFTCAP=softcap > 0,
            RETURN_LSE=return_lse, **dot_options(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return _DecodeLaunch(
            lens=lens, lens_default=capacity - n_new, batch=batch,
            lse_shape=(batch, heads, seqlen_q) if return_lse else None,
            empty=batch == 0 or (seqlen_q == 0 and n_new == 0),   # nothing to attend, nothing to append
            grid=(self.num_splits, batch * kv_heads, 1), tail=tail, constexprs=constexprs, launch_key=None)


class _DecodeLaunch:
    """One call key of :meth:`DecodePlan.run`: checked once; what its launches share."""

    __slots__ = ("lens", "lens_default", "batch", "lse_shape", "empty", "grid", "tail", "constexprs", "launch_key")

    def __init__(self, **fields):
        for name, value in fields.items():
            setattr(self, name, value)

    def __call__(self, plan, q, k_cache, v_cache, k, v, cache_seqlens, block_table, out, k_scale, v_scale):
        # the kernel indexes head_dim with unit stride, every other axis by its stride
        q = unit_last_stride(q)
        if out is None:
            out = q.new_empty(q.shape)
        lse = q.new_empty(self.lse_shape, dtype=torch.float32) if self.lse_shape else plan._no_lse
        if self.empty:
            return (out, lse) if self.lse_shape else out
        if k is not None:
            kn, vn = unit_last_stride(k), unit_last_stride(v)
        else:
            kn = vn = q
        lens = cache_seqlens
        if lens is None:
            lens = plan._full_lens.get(self.lens_default)
            if lens is None:
                lens = _seqlens_tensor(None, self.batch, self.lens_default, q.device)
                if not capturing(q.device):
                    plan._full_lens[self.lens_default] = lens
        elif lens.__class__ is not torch.Tensor:
            lens = self.lens if self.lens is not None else _seqlens_tensor(lens, self.batch, 0, q.device)
        no = plan._no_lse
        _DECODE(self.launch_key, self.grid, (
            q, k_cache, v_cache, kn, vn, out, lse, lens, block_table if block_table is not None else lens,
            plan.ws_acc, plan.ws_ml, plan.counters,
            k_scale.contiguous() if k_scale.__class__ is torch.Tensor else no,
            v_scale.contiguous() if v_scale.__class__ is torch.Tensor else no, *self.tail), self.constexprs)
        return (out, lse) if self.lse_shape else out


_DECODE = Launcher(decode_attention_kernel)
MAX_LAUNCH_KEYS = 256   # per plan: call keys kept (layouts × flags); later ones are checked per call


_EAGER_PLANS: "OrderedDict[tuple, DecodePlan]" = OrderedDict()
_EAGER_PLANS_MAX = 16
_EAGER_PLANS_LOCK = threading.Lock()


def _eager_plan(batch, heads, kv_heads, head_dim, capacity, seqlen_q, device, num_splits, kv_dtype) -> DecodePlan:
    """The plan of a call that passed none, kept per (layout, device, stream) for the next call:
    its workspace and counters are reused instead of three allocations and the counters' memset
    per call. Reuse on one stream is ordered, and every launch leaves the counters at zero; an
    evicted plan's memory returns to the allocator on that same stream. During graph capture a
    fresh plan is built as before: a graph must not keep pointers into a workspace that this
    cache may drop."""
    if capturing(device):
        return DecodePlan(batch, heads, kv_heads, head_dim, capacity, seqlen_q=seqlen_q, device=device,
                          num_splits=num_splits, kv_dtype=kv_dtype)
    fp8 = kv_dtype == FP8_CACHE_DTYPE   # the 16/32-bit caches share one plan
    key = (batch, heads, kv_heads, head_dim, capacity, seqlen_q, num_splits, fp8, str(device), stream_key(device))
    with _EAGER_PLANS_LOCK:
        plan = _EAGER_PLANS.get(key)
        if plan is None:
            plan = DecodePlan(batch, heads, kv_heads, head_dim, capacity, seqlen_q=seqlen_q, device=device,
                              num_splits=num_splits, kv_dtype=kv_dtype)
            _EAGER_PLANS[key] = plan
            if len(_EAGER_PLANS) > _EAGER_PLANS_MAX:
                _EAGER_PLANS.popitem(last=False)
        else:
            _EAGER_PLANS.move_to_end(key)
    return plan


def plan_decode(batch, heads, kv_heads, head_dim, max_seqlen_k, *, seqlen_q=1, device="cuda", num_splits=0,
                kv_dtype=None):
    """Plan a decode step (see :class:`DecodePlan`); ``kv_dtype=torch.float8_e4m3fn`` for an FP8
    cache (its split count and tiles differ)."""
    return DecodePlan(batch, heads, kv_heads, head_dim, max_seqlen_k, seqlen_q=seqlen_q, device=device,
                      num_splits=num_splits, kv_dtype=kv_dtype)


def _check_decode_inputs(q, k, v, k_cache, v_cache):
    check_tensor("q", q, 4, "(batch, seqlen_q, heads, head_dim)")
    check_no_grad("flash_attn_with_kvcache", q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    if (k is None) != (v is None):
        raise ValueError("pass both k and v to append, or neither")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, 4, "(batch, seqlen_new, kv_heads, head_dim)")
        if k.shape != v.shape:
            raise ValueError(f"k and v must both be (batch, seqlen_new, kv_heads, head_dim), got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        check_qkv(q, k, v, head_axis=2)
    else:
        check_runs_here("q", q)
        check_head_dim(q.shape[-1])


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_out(out, q) -> None:
    """``out=``: q's shape, dtype and device; the kernel writes head_dim with unit stride and
    takes the other strides as they are; no two elements at one address (racing writes)."""
    form = f"a {q.dtype} tensor of q's shape {tuple(q.shape)} on {q.device}"
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be {form}, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {form}, got a {out.dtype} tensor of shape {tuple(out.shape)} on {out.device}")
    if (out.stride(-1) != 1 and out.shape[-1] > 1) or overlaps_itself(out):
        raise ValueError(f"out must have a unit stride in its last dimension and no two elements at one address, "
                         f"got strides {out.stride()}")
    check_no_grad("flash_attn_with_kvcache", out=out)


def _seqlens_tensor(cache_seqlens, batch, default, device):
    if cache_seqlens is None:
        return torch.full((batch,), default, dtype=torch.int32, device=device)
    if _is_int(cache_seqlens):
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 \
            or tuple(cache_seqlens.shape) != (batch,):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor of shape ({batch},), got "
                        f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)} "
                        f"{tuple(getattr(cache_seqlens, 'shape', ()))}")
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens must be on {device}, got {cache_seqlens.device}")
    return cache_seqlens


def _check_values(cache_seqlens, n_new, capacity, block_table, num_blocks, page, batch, scales=()):
    """Checks that need device values on the host: lengths within the capacity, the pages a
    sequence uses within ``[0, num_blocks)``, and ``scales`` (``(name, per-head tensor)`` pairs)
    finite and > 0. Computed on the device and read back in one transfer whatever the batch
    (none for an int or absent ``cache_seqlens`` without a block table or scale tensors): a host
    synchronisation per row would stall the launch queue ``batch`` times per call. Skipped
    during graph capture. Only a failing length or page check reads more, to name the row."""
    scales = [(name, t) for name, t in scales if t is not None]
    if not isinstance(cache_seqlens, torch.Tensor):
        # None: the whole capacity (appending then raises in DecodePlan.run: no position given)
        n = max(capacity - n_new, 0) if cache_seqlens is None else cache_seqlens
        if cache_seqlens is not None and (n < 0 or n + n_new > capacity):
            raise ValueError(f"cache_seqlens[0] = {n} plus {n_new} new tokens exceeds the cache capacity "
                             f"({capacity} tokens)")
        if block_table is None and not scales:
            return
    lens_given = isinstance(cache_seqlens, torch.Tensor)
    probe = cache_seqlens if lens_given else block_table if block_table is not None else scales[0][1]
    if capturing(probe.device):
        return
    parts = []   # (what, device vector): read back together
    if block_table is None:
        if lens_given:   # the lengths themselves, checked in a Python loop (fewest launches)
            parts.append(("lens", cache_seqlens))
    else:
        if lens_given:
            lens = cache_seqlens.to(torch.int64)
            bad_len = (lens < 0) | (lens + n_new > capacity)
            flags = [bad_len.any()]
        else:
            lens = torch.full((batch,), n, dtype=torch.int64, device=block_table.device)
            flags = []
        pages = torch.div(lens.clamp(min=0) + n_new + page - 1, page, rounding_mode="floor")
        pages = pages.clamp(max=block_table.shape[1])
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages[:, None]
        bad_page = used & ((block_table < 0) | (block_table >= num_blocks))
        flags.append(bad_page.any())
        parts.append(("flags", torch.stack(flags)))
    parts += scales
    if len(parts) == 1:   # the one transfer
        host = [parts[0][1].tolist()]
    else:   # float64 holds int32 lengths, flags and float32 scales exactly
        flat = torch.cat([t.to(torch.float64) for _, t in parts]).tolist()
        host, at = [], 0
        for _, t in parts:
            host.append(flat[at:at + t.numel()])
            at += t.numel()
    for (what, _), values in zip(parts, host):
        if what == "lens":
            for i, x in enumerate(values):
                if x < 0 or x + n_new > capacity:
                    raise ValueError(f"cache_seqlens[{i}] = {int(x)} plus {n_new} new tokens exceeds the cache "
                                     f"capacity ({capacity} tokens)")
        elif what == "flags":
            if not any(values):
                continue
            if lens_given and bool(bad_len.any()):
                i = int(bad_len.nonzero()[0, 0])
                raise ValueError(f"cache_seqlens[{i}] = {int(lens[i])} plus {n_new} new tokens exceeds the cache "
                                 f"capacity ({capacity} tokens)")
            i = int(bad_page.any(dim=1).nonzero()[0, 0])
            raise ValueError(f"block_table[{i}] holds page indices outside [0, {num_blocks}) (num_blocks of "
                             f"k_cache): {block_table[i, :int(pages[i])].tolist()}")
        else:
            for i, x in enumerate(values):
                if not (math.isfinite(x) and x > 0):
                    raise ValueError(f"{what} must hold finite numbers > 0 (one per KV head), got {what}[{i}] = {x}")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, kv_layout="NHD", plan=None, k_scale=None, v_scale=None):
    """Attention of a few query tokens against a KV cache: FlashAttention 2's
    ``flash_attn_with_kvcache``, its signature (positions, names, defaults) and meaning, plus
    keyword-only ``kv_layout``, ``plan``, ``k_scale`` and ``v_scale``.

    Args:
        q: ``(batch, seqlen_q, heads, head_dim)``, seqlen_q small (1 for decode, a few for
            speculative decoding).
        k_cache, v_cache: ``(batch, capacity, kv_heads, head_dim)``; or, with ``block_table``,
            pages ``(num_blocks, page_size, kv_heads, head_dim)`` (any page size); or with
            ``kv_layout="FT"`` the FasterTransformer layout K ``(batch, kv_heads, head_dim/x,
            capacity, x)`` (x = 16 bytes of elements), V ``(batch, kv_heads, capacity, head_dim)``.
        k, v: optional new tokens ``(batch, seqlen_new, kv_heads, head_dim)``, written into the
            cache at ``cache_seqlens`` inside the kernel and attended in the same call.
        rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, alibi_slopes: not implemented;
            anything but None is refused (apply RoPE before the call; index or page the cache).
        cache_seqlens: int or int32 ``(batch,)``: tokens already in each sequence's cache
            (default: the whole capacity).
        block_table: int32 ``(batch, max_blocks_per_seq)`` page indices of a paged cache.
        causal: bottom-right aligned: query ``i`` sees keys up to ``cache_seqlens + seqlen_new -
            seqlen_q + i``. False by default, as in FlashAttention (the same for one query token).
        rotary_interleaved: a bool; as in FlashAttention it matters only with ``rotary_cos``.
        num_splits: key-range splits per (sequence, KV head); 0 = heuristic from batch × KV heads,
            sequence length and SM count. The output does not depend on it: a larger value is
            capped at the cache's key blocks (capacity / the config's ``BLOCK_N``) and at
            ``MAX_SPLITS`` (32). With ``plan``, the plan's (0 or the same value).
        return_softmax_lse: also return the log-sum-exp.
        plan: a :class:`DecodePlan` to reuse (no allocation, no host synchronisation). Without
            one, the lengths, the pages each sequence uses and per-head scales are checked on the
            device and read back once (skipped while a CUDA graph is captured), and the plan is
            taken from a small cache per (layout, device, stream).
        k_scale, v_scale: the dequantization scales of an FP8 cache (``k_cache``/``v_cache`` in
            ``torch.float8_e4m3fn``, read as ``cache · scale``; q, k, v and the output stay
            float16/bfloat16): a Python float (per tensor) or a float32 tensor ``(kv_heads,)`` (per
            head), finite and > 0; None is 1.0. Appended ``k``/``v`` are quantized with them
            (nearest even, saturating at ±448) and attended as stored. See :func:`quantize_kv_cache`.
    Returns ``out`` ``(batch, seqlen_q, heads, head_dim)``, or ``(out, lse)`` with lse float32
    ``(batch, heads, seqlen_q)``.
    """
    for name, value, instead in (("rotary_cos", rotary_cos, "apply RoPE to q and k before the call"),
                                 ("rotary_sin", rotary_sin, "apply RoPE to q and k before the call"),
                                 ("cache_batch_idx", cache_batch_idx, "a paged cache's block_table maps each "
                                  "sequence to its pages"),
                                 ("cache_leftpad", cache_leftpad, "store each sequence's cache from position 0"),
                                 ("alibi_slopes", alibi_slopes, "ALiBi biases are not supported")):
        if value is not None:
            raise ValueError(f"flashflow does not implement {name} (got a {type(value).__name__}; pass None): "
                             f"{instead}")
    check_flag("rotary_interleaved", rotary_interleaved)
    return_softmax_lse = check_flag("return_softmax_lse", return_softmax_lse)
    num_splits = check_int("num_splits", num_splits, 0)
    _check_decode_inputs(q, k, v, k_cache, v_cache)
    capacity, kv_heads, page, _ = _cache_geometry(q, k_cache, v_cache, block_table, kv_layout)
    batch, seqlen_q, heads, head_dim = q.shape
    check_heads(heads, kv_heads, "kv_heads of the cache")
    n_new = 0 if k is None else k.shape[1]
    if plan is None:
        if cache_seqlens is not None and not _is_int(cache_seqlens):
            _seqlens_tensor(cache_seqlens, batch, 0, q.device)   # its form, before its values are read
        _, k_per_head, _, v_per_head = _check_scales(k_cache, k_scale, v_scale, kv_heads, q.device)
        _check_values(cache_seqlens, n_new, capacity, block_table, k_cache.shape[0], page, batch,
                      (("k_scale", k_per_head), ("v_scale", v_per_head)))
        plan = _eager_plan(batch, heads, kv_heads, head_dim, capacity, seqlen_q, q.device, num_splits,
                           k_cache.dtype)
    elif not isinstance(plan, DecodePlan):
        raise TypeError(f"plan must be a DecodePlan (flashflow.plan_decode), got {type(plan).__name__}")
    elif num_splits not in (0, plan.num_splits, plan.num_splits_asked):
        raise ValueError(f"num_splits is the plan's ({plan.num_splits}) when a plan is given; got {num_splits} "
                         "(pass 0, or plan with plan_decode(..., num_splits=...))")
    return plan.run(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size,
                    softcap, return_softmax_lse, kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale)


def quantize_kv_cache(cache, scale=None, kv_layout="NHD"):
    """``(fp8_cache, scale)``: a float16/bfloat16/float32 KV cache as ``torch.float8_e4m3fn`` for
    :func:`flash_attn_with_kvcache` (``k_scale``/``v_scale``), each value ``cache / scale`` rounded
    to nearest even and saturated at ±448.

    ``cache``: a K or V cache in any layout the op reads: ``(batch, capacity, kv_heads, head_dim)``
    or pages ``(num_blocks, page_size, kv_heads, head_dim)`` (``kv_layout="NHD"``), or with
    ``kv_layout="FT"`` a K cache ``(batch, kv_heads, head_dim/x, capacity, x)`` (returned with the
    FP8 layout's x = 16) or a V cache ``(batch, kv_heads, capacity, head_dim)``.
    ``scale``: None (one per KV head, the head's max |value| / 448: a float32 ``(kv_heads,)``
    tensor), a Python float > 0, or a float32 ``(kv_heads,)`` tensor of finite values > 0;
    returned as given otherwise.

    The cache must be finite: an inf or NaN (an unwritten row, say) would give a head scale of
    inf and a head of NaN, or saturate silently; it raises, naming the KV head. The values are
    read back once (this is a preparation step, not a decode step).
    """
    if not isinstance(cache, torch.Tensor) or cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"cache must be a float16, bfloat16 or float32 tensor, got "
                        f"{getattr(cache, 'dtype', type(cache).__name__)}")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    check_no_grad("quantize_kv_cache", cache=cache)
    if cache.device.type == "meta":
        raise ValueError("cache is a meta tensor (shape only, no values to quantize)")
    if cache.dim() == 5 and kv_layout == "FT":   # K (b, hk, d/x, s, x): to (b, s, hk, d) and back
        b, hk, dx, s, x = cache.shape
        heads_last = cache.permute(0, 3, 1, 2, 4).reshape(b, s, hk, dx * x)
        fp8, scale = quantize_kv_cache(heads_last, scale)
        x8 = _ft_x(FP8_CACHE_DTYPE)
        if (dx * x) % x8:
            raise ValueError(f"head_dim {dx * x} of an FT K cache must be a multiple of {x8} in FP8")
        return fp8.reshape(b, s, hk, dx * x // x8, x8).permute(0, 2, 3, 1, 4).contiguous(), scale
    if cache.dim() != 4:
        raise ValueError(f"cache must be (batch, capacity, kv_heads, head_dim), pages (num_blocks, page_size, "
                         f"kv_heads, head_dim), or with kv_layout='FT' a K cache of rank 5 or a V cache "
                         f"(batch, kv_heads, capacity, head_dim); got shape {tuple(cache.shape)}")
    head_axis = 1 if kv_layout == "FT" else 2
    kv_heads = cache.shape[head_axis]
    shape = [1] * 4
    shape[head_axis] = kv_heads
    if cache.numel():
        amax = cache.abs().amax(dim=[a for a in range(4) if a != head_axis]).float()   # NaN where a NaN is
    else:
        amax = torch.zeros(kv_heads, dtype=torch.float32, device=cache.device)
    if scale is None:
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    _, per_head = check_kv_scale("scale", scale, kv_heads, cache.device)
    flags = ~torch.isfinite(amax)
    if per_head is not None:
        flags = torch.cat([flags, ~(torch.isfinite(per_head) & (per_head > 0))])
    flags = flags.tolist()   # the one read-back
    if any(flags[:kv_heads]):
        raise ValueError(f"cache holds non-finite values (inf or NaN) in KV head {flags.index(True)}: no scale "
                         "maps them onto e4m3; zero or drop them first")
    if any(flags[kv_heads:]):
        i = flags.index(True, kv_heads) - kv_heads
        raise ValueError(f"scale must hold finite numbers > 0 (one per KV head), got scale[{i}] = {float(per_head[i])}")
    s = per_head.view(shape) if per_head is not None else torch.tensor(float(scale), dtype=torch.float32)
    fp8 = (cache.float() / s.to(cache.device)).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_CACHE_DTYPE)
    return fp8, scale


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Combine two attention results computed over disjoint key sets.

    out ``(batch, seqlen, heads, head_dim)`` (any float dtype), lse float32 ``(batch, heads,
    seqlen)``, as returned by ``flash_attn_func(..., return_lse=True)`` or
    ``flash_attn_with_kvcache(..., return_softmax_lse=True)``. Returns ``(out, lse)``
    for the union of the key sets; a row with lse -inf on both sides gives 0 and -inf.
    """
    for name, t, rank in (("out_a", out_a, 4), ("out_b", out_b, 4), ("lse_a", lse_a, 3), ("lse_b", lse_b, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            raise ValueError(f"{name} must be a rank-{rank} tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    check_no_grad("merge_attention_states", out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    for name, t in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if t.device != out_a.device:
            raise ValueError(f"{name} must be on out_a's device {out_a.device}, got {t.device}")
    check_runs_here("out_a", out_a)
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must have one shape, got {tuple(out_a.shape)} and {tuple(out_b.shape)}")
    batch, seqlen, heads, head_dim = out_a.shape
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != (batch, heads, seqlen):
            raise ValueError(f"{name} must be (batch, heads, seqlen) = {(batch, heads, seqlen)}, got {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
    if out_a.dtype != out_b.dtype:
        raise TypeError(f"out_a and out_b must share a dtype, got {out_a.dtype} and {out_b.dtype}")
    if out_a.stride(-1) != 1 or out_b.stride(-1) != 1:
        out_a, out_b = out_a.contiguous(), out_b.contiguous()
    out = torch.empty(out_a.shape, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty((batch, heads, seqlen), dtype=torch.float32, device=out_a.device)
    rows = batch * seqlen * heads
    if rows == 0:
        return out, lse
    block_rows = 16
    merge_states_kernel[(cdiv(rows, block_rows),)](
        out_a, lse_a, out_b, lse_b, out, lse, batch * seqlen, heads, seqlen,
        *out_a.stride()[:3], *out_b.stride()[:3], *out.stride()[:3],
        *lse_a.stride(), *lse_b.stride(), *lse.stride(),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=_head_dim_pad(head_dim), BLOCK_ROWS=block_rows,
        num_warps=4,
    )
    return out, lse
