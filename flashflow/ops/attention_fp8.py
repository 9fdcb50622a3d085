"""FP8 attention: validation, the quantize pass, config choice, launch, custom op.

:func:`flash_attn_fp8_func` takes bf16/fp16 Q, K, V in FlashAttention layout and returns the
attention output in the same dtype, computing both products on 8-bit tensor cores
(SageAttention's recipe, :mod:`flashflow.kernels.quant`, :mod:`flashflow.kernels.attention_fp8`):

1. ``attention_kv_stats_kernel``: per (batch, kv head) and chunk of keys the sum of K and the
   largest |V| per channel, then ``attention_kv_stats_total_kernel`` reduces the chunks once a
   head (the mean of K over the keys, the largest |V|);
2. ``attention_quantize_kernel``: Q per token and K − mean(K) per key block to INT8 (or e4m3),
   V per channel to e4m3, transposed, all padded to whole blocks;
3. ``attention_fp8_fwd_kernel``: the flash forward on the 8-bit operands.

The time of a call includes all of them. :func:`scaled_dot_product_attention_fp8` is the same in
SDPA's layout. Hopper (sm90) and newer run it; under Triton's interpreter it runs with the FP8
products emulated in fp32 on the same values (so CPU tests check the GPU's numerics); other GPUs
get a ``ValueError`` (use :func:`flashflow.flash_attn_func` there).
"""
from __future__ import annotations

from typing import Optional

import torch

from flashflow.device import cdiv, gpu_family, interpreting, next_pow2, num_sms
from flashflow.kernels.attention_fp8 import attention_fp8_fwd_kernel
from flashflow.kernels.quant import (attention_k_edge_stats_kernel, attention_kv_stats_kernel,
                                     attention_kv_stats_total_kernel, attention_quantize_kernel)
from flashflow.kernels.softmax import LOG2E
from flashflow.ops.common import (Launcher, call_key, contiguous_strides, op_or_direct, tensor_descriptor,
                                  unit_last_stride)
from flashflow.ops.validate import (check_flag, check_heads, check_key_padding_mask, check_no_grad, check_runs_here,
                                    softmax_scale_or_default)
from flashflow.tuning.attention_fp8 import AttentionFp8Config, attention_fp8_config, supported_families

__all__ = ["flash_attn_fp8_func", "scaled_dot_product_attention_fp8", "quantize_attention_inputs",
           "QK_FORMATS", "FP8_HEAD_DIMS"]

# Q·Kᵀ in INT8 (the default: an exact integer product, and more accurate than e4m3 at the same
# byte count, docs/fp8.md) or in e4m3.
QK_FORMATS = ("int8", "fp8")
FP8_HEAD_DIMS = (64, 128, 256)
# The K/V statistics' grid, (key block, programs a SM, chunks a head at most, warps). One process:
# many short programs (the kernel is bound by each program's chain of loads, not by bandwidth),
# their partials reduced once a head before the quantize kernel
# (bench/results/fp8-quantize-pass-nvidia-h200.json). Sequence-parallel: about four waves of
# programs, at most 32 chunks a rank, since the quantize kernel reduces every rank's partials in
# one load (not measured with the one-process grid).
_STATS_GRID = {True: (32, 16, 128, 2), False: (64, 4, 32, 4)}
_STATS_TOTAL_CHANNELS = 32   # channels a program of the reduction (all partials in one load)


# torch.compile traces these checks: the families are read once (it cannot trace the JSON read
# behind supported_families()) and the device's family is a constant to it, not a traced query.
_FAMILIES = tuple(supported_families())


@torch.compiler.assume_constant_result
def _family(device: torch.device) -> str:
    return gpu_family(device)


def _check_inputs(q, k, v, qk_format, key_padding_mask):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (batch, seqlen, heads, head_dim), "
                            f"got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
        check_runs_here(name, t)   # a meta tensor is refused before anything reads its data
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must be bfloat16 or float16 (FP8 attention quantizes 16-bit inputs), "
                            f"got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    family = _family(q.device)
    if family not in _FAMILIES:
        raise ValueError(f"FP8 attention needs FP8 tensor cores (Hopper, sm90, or newer); {q.device} is "
                         f"{family}. Use flashflow.flash_attn_func (exact bf16/fp16 attention) there.")
    batch, seqlen_q, heads, head_dim = q.shape
    if head_dim not in FP8_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {FP8_HEAD_DIMS} for FP8 attention, got {head_dim}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape (batch, seqlen_k, kv_heads, head_dim), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k/v must be (batch={batch}, seqlen_k, kv_heads, head_dim={head_dim}), got {tuple(k.shape)}")
    check_heads(heads, k.shape[2])
    if qk_format not in QK_FORMATS:
        raise ValueError(f"qk_format must be one of {QK_FORMATS}, got {qk_format!r}")
    if key_padding_mask is not None:
        check_key_padding_mask(key_padding_mask, batch, k.shape[1], q.device)


def stats_split(seqlen_k: int, heads: int, device, one_process: bool) -> tuple[int, int, int, int]:
    """``(chunk, chunks, block, warps)`` of the quantize pass's K/V statistics over ``seqlen_k``
    keys of ``heads`` (batch · kv heads): chunks of whole ``block``-key steps, as many as
    :data:`_STATS_GRID` asks of the GPU's SMs."""
    block, per_sm, most, warps = _STATS_GRID[one_process]
    per_head = min(most, max(1, cdiv(per_sm * num_sms(device), heads)))
    chunk = cdiv(cdiv(max(seqlen_k, 1), per_head), block) * block
    return chunk, cdiv(max(seqlen_k, 1), chunk), block, warps


def _mask_stride(key_padding_mask) -> int:
    """The batch stride the kernels read a key-padding mask with: its own, or its width where it
    is copied to unit stride first (:func:`unit_last_stride`); 0 without a mask."""
    if key_padding_mask is None or not key_padding_mask.shape[1]:
        return 0
    if key_padding_mask.stride(-1) == 1:
        return key_padding_mask.stride(0)
    return key_padding_mask.shape[1]


def _config(head_dim: int, causal: bool, device) -> AttentionFp8Config:
    return attention_fp8_config(head_dim, causal, gpu_family(device))


def quantize_attention_inputs(q, k, v, softmax_scale: float, block_m: int, block_n: int, qk_format: str = "int8",
                              lse_correction: bool = False, smooth_k: bool = True, key_padding_mask=None) -> dict:
    """The quantize pass alone, on validated inputs (head_dim unit-stride): a dict of the 8-bit
    tensors and scales the kernel reads (names as in
    :func:`flashflow.kernels.quant.attention_quantize_kernel`: ``q8, q_scale, q_corr, k8, k_scale,
    vt8, v_scale``), padded to ``block_m`` / ``block_n``. ``key_padding_mask`` (the call's,
    ``(batch, P)``) keeps the non-finite values of the keys it hides from marking anything."""
    plan = _Fp8Plan(q, k, v, key_padding_mask, block_m, block_n, qk_format, lse_correction, smooth_k)
    bufs = plan.quantize(None, q, k, v, key_padding_mask, softmax_scale)
    batch, _, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    sq_pad, sk_pad = plan.sq_pad, plan.sk_pad
    shapes = dict(q8=(batch, heads, sq_pad, head_dim), k8=(batch, kv_heads, sk_pad, head_dim),
                  vt8=(batch, kv_heads, head_dim, sk_pad), q_scale=(batch, heads, sq_pad),
                  q_corr=(batch, heads, sq_pad) if lse_correction else (1,),
                  k_scale=(batch, kv_heads, sk_pad // block_n), v_scale=(batch, kv_heads, head_dim))
    return {**{name: bufs[name].view(shape) for name, shape in shapes.items()}, "sq_pad": sq_pad, "sk_pad": sk_pad}


class _Fp8Plan:
    """What one call key of the FP8 forward fixes: the padded sizes, the layout of the quantize
    pass's buffers in one allocation, the grids, the kernels' integer arguments and constexprs,
    the descriptors' shapes (it keeps no tensor)."""

    # the quantize pass's buffers: 8-bit tensors first, then the float32 scales and statistics
    # (partials, then their totals a head)
    BUFFERS = ("q8", "k8", "vt8", "q_scale", "q_corr", "k_scale", "v_scale", "ksum", "vmax", "ksum1", "vmax1")

    def __init__(self, q, k, v, key_padding_mask, block_m, block_n, qk_format, lse_correction, smooth_k=True,
                 device=None):
        batch, seqlen_q, heads, head_dim = q.shape
        seqlen_k, kv_heads = k.shape[1], k.shape[2]
        q_block = max(block_m, block_n)   # powers of two: a multiple of both
        sq_pad = self.sq_pad = cdiv(max(seqlen_q, 1), q_block) * q_block
        sk_pad = self.sk_pad = cdiv(max(seqlen_k, 1), block_n) * block_n
        qk_dtype = torch.float8_e4m3fn if qk_format == "fp8" else torch.int8
        chunk, chunks, stats_block, stats_warps = stats_split(seqlen_k, batch * kv_heads, device or q.device, True)
        n_q, n_k = batch * heads * sq_pad * head_dim, batch * kv_heads * sk_pad * head_dim
        counts = dict(q8=(n_q, qk_dtype), k8=(n_k, qk_dtype), vt8=(n_k, torch.float8_e4m3fn),
                      q_scale=(batch * heads * sq_pad, torch.float32),
                      q_corr=(batch * heads * sq_pad if lse_correction else 1, torch.float32),
                      k_scale=(batch * kv_heads * (sk_pad // block_n), torch.float32),
                      v_scale=(batch * kv_heads * head_dim, torch.float32),
                      ksum=(batch * kv_heads * chunks * head_dim, torch.float32),
                      vmax=(batch * kv_heads * chunks * head_dim, torch.float32),
                      ksum1=(batch * kv_heads * head_dim, torch.float32),
                      vmax1=(batch * kv_heads * head_dim, torch.float32))
        # one allocation carved into every buffer, each on a 16-byte boundary (host time is part
        # of a call: one allocation instead of nine)
        self.slices, at = [], 0
        for name in self.BUFFERS:
            n, dtype = counts[name]
            self.slices.append((at, at + n * dtype.itemsize, dtype))
            at = cdiv(at + n * dtype.itemsize, 16) * 16
        self.nbytes = at
        mask_keys = 0 if key_padding_mask is None else key_padding_mask.shape[1]
        self.mask_keys = mask_keys
        self.stats_grid = (batch * kv_heads, chunks, 1)
        self.stats_ints = (seqlen_k, kv_heads, chunk, chunks, 0, *k.stride()[:3], *v.stride()[:3])
        self.stats_constexprs = dict(HEAD_DIM=head_dim, BLOCK_S=stats_block, WORLD=1, num_warps=stats_warps)
        self.total_grid = (batch * kv_heads, head_dim // _STATS_TOTAL_CHANNELS, 1)
        self.total_ints = (chunks,)
        self.total_constexprs = dict(HEAD_DIM=head_dim, CHUNKS_PAD=next_pow2(chunks), BLOCK_D=_STATS_TOTAL_CHANNELS,
                                     num_warps=4)
        self.quant_grid = (max(sq_pad, sk_pad) // block_n, heads + 2 * kv_heads, batch)
        mask_stride = _mask_stride(key_padding_mask)
        self.mask_stride = mask_stride
        self.quant_ints = (seqlen_q, seqlen_k, sq_pad, sk_pad, heads, kv_heads, 1, mask_keys,   # 1: the totals
                           0, max(seqlen_q, seqlen_k), heads, kv_heads, 0,
                           *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], mask_stride)
        self.quant_constexprs = dict(
            HEAD_DIM=head_dim, BLOCK_S=block_n, QK_FP8=qk_format == "fp8", SMOOTH_K=smooth_k,
            LSE_CORRECTION=lse_correction, CHUNKS_PAD=1, KEY_PADDING=mask_keys > 0,
            EMULATE_FP8=interpreting(), WORLD=1, num_warps=4)

    def quantize(self, key, q, k, v, key_padding_mask, softmax_scale) -> dict:
        """The quantize pass: the buffers by name (flat views of one allocation)."""
        raw = q.new_empty((self.nbytes,), dtype=torch.uint8)
        bufs = {name: raw[a:b].view(dtype) for name, (a, b, dtype) in zip(self.BUFFERS, self.slices)}
        _STATS(key, self.stats_grid, (k, v, bufs["ksum"], bufs["vmax"], k, *self.stats_ints), self.stats_constexprs)
        _TOTAL(key, self.total_grid, (bufs["ksum"], bufs["vmax"], bufs["ksum1"], bufs["vmax1"], *self.total_ints),
               self.total_constexprs)
        mask = q
        if self.mask_keys:
            mask = unit_last_stride(key_padding_mask)
        _QUANTIZE(key, self.quant_grid, (
            q, k, v, bufs["q8"], bufs["q_scale"], bufs["q_corr"], bufs["k8"], bufs["k_scale"],
            bufs["vt8"].view(torch.int8), bufs["v_scale"], bufs["ksum1"], bufs["vmax1"], mask, q, q, q, *self.quant_ints,
            softmax_scale * LOG2E, softmax_scale), self.quant_constexprs)
        return bufs


class _Fp8ForwardPlan(_Fp8Plan):
    """:class:`_Fp8Plan` plus the attention kernel's launch."""

    def __init__(self, q, k, v, key_padding_mask, causal, return_lse, qk_format, cfg, device=None):
        batch, seqlen_q, heads, head_dim = q.shape
        seqlen_k, kv_heads = k.shape[1], k.shape[2]
        self.lse_shape = (batch, heads, seqlen_q) if return_lse else (1,)
        self.empty = q.numel() == 0
        self.no_keys = seqlen_k == 0
        if self.empty or self.no_keys:   # nothing is launched
            return
        super().__init__(q, k, v, key_padding_mask, cfg.BLOCK_M, cfg.BLOCK_N, qk_format, return_lse, device=device)
        sq_pad, sk_pad = self.sq_pad, self.sk_pad
        self.descs = (([batch * heads * sq_pad, head_dim], [head_dim, 1], [cfg.BLOCK_M, head_dim]),
                      ([batch * kv_heads * sk_pad, head_dim], [head_dim, 1], [cfg.BLOCK_N, head_dim]),
                      ([batch * kv_heads * head_dim, sk_pad], [sk_pad, 1], [head_dim, cfg.BLOCK_N]))
        num_m_blocks = cdiv(seqlen_q, cfg.BLOCK_M)
        out_strides = contiguous_strides(q.shape)
        self.grid = (num_m_blocks * heads * batch, 1, 1)
        self.ints = (*out_strides[:3], *((heads * seqlen_q, seqlen_q) if return_lse else (0, 0)), self.mask_stride,
                     seqlen_q, seqlen_k, sq_pad, sk_pad, heads, kv_heads, num_m_blocks, self.mask_keys)
        self.constexprs = dict(
            HEAD_DIM=head_dim, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, CAUSAL=causal, KEY_PADDING=self.mask_keys > 0,
            RETURN_LSE=return_lse, QK_FP8=qk_format == "fp8", EMULATE_FP8=interpreting(), PV_FP32_SUM=cfg.pv_fp32_sum,
            WARP_SPECIALIZE=cfg.warp_specialize, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.maxnreg and not interpreting():
            self.constexprs["maxnreg"] = cfg.maxnreg


_STATS = Launcher(attention_kv_stats_kernel)
_TOTAL = Launcher(attention_kv_stats_total_kernel)
_EDGES = Launcher(attention_k_edge_stats_kernel)
_QUANTIZE = Launcher(attention_quantize_kernel)
_FORWARD = Launcher(attention_fp8_fwd_kernel)
_PLANS: dict = {}
MAX_PLANS = 4096   # distinct call keys kept; later ones are worked out per call


def _attention_fp8_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                        softmax_scale: float, causal: bool, return_lse: bool,
                        qk_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_fp8_forward(q, k, v, key_padding_mask, softmax_scale, causal, return_lse, qk_format)


def attention_fp8_forward(q, k, v, key_padding_mask, softmax_scale: float, causal: bool, return_lse: bool,
                          qk_format: str, config: Optional[AttentionFp8Config] = None):
    """Quantize and launch on validated inputs; ``config`` overrides the shipped one (sweeps).
    What the launches derive from the inputs' kinds is worked out once per call key
    (:class:`_Fp8ForwardPlan`)."""
    key = call_key((q, k, v, key_padding_mask, causal, return_lse, qk_format)) if config is None else None
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        cfg = config or _config(q.shape[-1], causal, q.device)
        plan = _Fp8ForwardPlan(q, k, v, key_padding_mask if key_padding_mask is None or key_padding_mask.shape[1]
                               else None, causal, return_lse, qk_format, cfg)
        if key is not None and len(_PLANS) < MAX_PLANS:
            _PLANS[key] = plan
    out = q.new_empty(q.shape)
    lse = q.new_empty(plan.lse_shape, dtype=torch.float32)
    if plan.empty:
        return out, lse
    if plan.no_keys:
        out.zero_()
        if return_lse:
            lse.fill_(float("-inf"))
        return out, lse
    launch_key = key if key is not None and key[-1] else None
    bufs = plan.quantize(launch_key, q, k, v, key_padding_mask, softmax_scale)
    _attend_quantized(launch_key, plan, bufs, key_padding_mask, out, lse)
    return out, lse


def _attend_quantized(launch_key, plan: _Fp8ForwardPlan, bufs: dict, key_padding_mask, out, lse) -> None:
    """The attention kernel on the quantize pass's buffers ``bufs`` (by name)."""
    descs = tuple(tensor_descriptor(bufs[name], *spec) for name, spec in zip(("q8", "k8", "vt8"), plan.descs))
    mask = out
    if plan.mask_keys:
        mask = unit_last_stride(key_padding_mask)
    _FORWARD(launch_key, plan.grid, (*descs, bufs["q_scale"], bufs["k_scale"], bufs["v_scale"], bufs["q_corr"], out, lse,
                                     mask, *plan.ints), plan.constexprs)


_attention_fp8_op = torch.library.custom_op("flashflow::attention_fp8_fwd", mutates_args=())(_attention_fp8_impl)


@_attention_fp8_op.register_fake
def _(q, k, v, key_padding_mask, softmax_scale, causal, return_lse, qk_format):
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if return_lse else (1,)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty(lse_shape, dtype=torch.float32)


_attention_fp8 = op_or_direct(_attention_fp8_op, _attention_fp8_impl)


def flash_attn_fp8_func(q, k, v, softmax_scale=None, causal=False, return_lse=False, *, key_padding_mask=None,
                        qk_format="int8"):
    """Attention with 8-bit products, FlashAttention layout (bf16/fp16 in and out).

    Args:
        q: ``(batch, seqlen_q, heads, head_dim)``; k, v: ``(batch, seqlen_k, kv_heads, head_dim)``,
            ``heads % kv_heads == 0``; bfloat16 or float16; head_dim 64, 128 or 256. Any strides
            (views, stride-0 expanded batch or heads); a tensor whose head_dim is not unit-stride
            is copied first.
        softmax_scale: defaults to ``1/sqrt(head_dim)``.
        causal: mask aligned to the bottom-right corner (FlashAttention's rule).
        return_lse: also return the log-sum-exp, float32 ``(batch, heads, seqlen_q)`` (the
            smoothing of K is added back, so it is the LSE of the unsmoothed scores).
        key_padding_mask: bool ``(batch, P)``, ``P <= seqlen_k``, True = attend; covers keys
            ``[0, P)`` (a joint ``[text, image]`` sequence passes its text mask alone).
        qk_format: ``"int8"`` (default) or ``"fp8"``: the 8-bit format of Q·Kᵀ. P·V is e4m3.
    Returns:
        ``out`` of q's shape and dtype, or ``(out, lse)``. Rows with no allowed key give 0.

    Non-finite inputs (NaN, ±inf) never give a finite output where exact attention gives a
    non-finite one; at the granularity of K's scales and of the kernel's tiles they reach more
    (docs/fp8.md, "Non-finite inputs"; ``BLOCK_M``/``BLOCK_N``: ``tuning/attention_fp8.json``).
    What a NaN or inf makes NaN, where it is in

    * ``q[b, i, h]``: out and lse of row ``(b, i, h)`` (a row with no allowed key: out 0);
    * ``k[b, j, hk]``: out and lse of every row of the heads of kv head ``hk`` in batch ``b``
      that attends a key of ``j``'s block of ``BLOCK_N`` keys;
    * ``v[b, j, hk, c]``: channel ``c`` of out in every row of those heads whose tile of
      ``BLOCK_M`` query rows loads ``j``'s key block (every row without causal; with causal the
      rows from the first of the tile holding row ``⌊j/BLOCK_N⌋·BLOCK_N − (seqlen_k − seqlen_q)``).

    A key ``key_padding_mask`` hides marks nothing, and every output a non-finite value does not
    reach is what the call gives with 0 in its place.

    Accuracy and speed against exact attention: docs/fp8.md.
    """
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    _check_inputs(q, k, v, qk_format, key_padding_mask)
    check_no_grad("flash_attn_fp8_func", q=q, k=k, v=v)
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    out, lse = _attention_fp8(q, k, v, key_padding_mask, scale, causal, return_lse, qk_format)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention_fp8(query, key, value, attn_mask=None, is_causal=False, scale=None,
                                     enable_gqa=False, *, qk_format="int8"):
    """:func:`flash_attn_fp8_func` in SDPA's layout ``(batch, heads, seqlen, head_dim)``.

    ``attn_mask``: None or a boolean key-padding mask broadcastable as ``(batch, 1, 1,
    seqlen_k)`` (True = attend); other masks are refused (use the bf16
    :func:`flashflow.scaled_dot_product_attention`). ``is_causal`` is PyTorch's top-left
    alignment, taken for ``seqlen_q == seqlen_k`` only (where both alignments agree).
    Query heads that are a multiple of the key heads need ``enable_gqa=True``, as in PyTorch.
    """
    is_causal = check_flag("is_causal", is_causal)
    enable_gqa = check_flag("enable_gqa", enable_gqa)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, heads, seqlen, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        check_runs_here(name, t)
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True "
                         "for grouped-query attention")
    if is_causal and query.shape[2] != key.shape[2]:
        raise ValueError("is_causal with seqlen_q != seqlen_k is aligned top-left in SDPA; FP8 attention takes "
                         "causal masks where seqlen_q == seqlen_k only (flash_attn_fp8_func aligns bottom-right)")
    key_padding_mask = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool or attn_mask.dim() != 4 \
                or attn_mask.shape[1] != 1 or attn_mask.shape[2] != 1 or attn_mask.shape[3] != key.shape[2] \
                or attn_mask.shape[0] not in (1, query.shape[0]):
            raise ValueError("attn_mask must be None or a bool key-padding mask of shape (batch, 1, 1, seqlen_k) "
                             "for FP8 attention; use flashflow.scaled_dot_product_attention for other masks")
        key_padding_mask = attn_mask[:, 0, 0, :].expand(query.shape[0], key.shape[2])
    out = flash_attn_fp8_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale, is_causal,
                              key_padding_mask=key_padding_mask, qk_format=qk_format)
    return out.transpose(1, 2)


def attention_fp8_gluon_forward(q, k, v, softmax_scale: float, block_m: int = 64, block_n: int = 128,
                                num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """The Gluon FP8 forward for Hopper (:mod:`flashflow.kernels.attention_fp8_gluon`) on
    validated bf16/fp16 ``(b, s, h, d)`` q, k, v, non-causal, no key-padding mask: the quantize
    pass, Vᵀ's keys in the order the kernel reads them, the launch; returns the output. No op
    dispatches it (it measured slower than the portable kernel: docs/fp8.md); its defaults are
    its fastest measured config. ``flashflow info`` and its GPU test run it."""
    from flashflow.kernels.attention_fp8_gluon import launch_attention_fp8_gluon, permute_keys_for_pv

    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    bufs = quantize_attention_inputs(q, k, v, softmax_scale, block_m, block_n, "int8")
    bufs = dict(bufs, vt8=permute_keys_for_pv(bufs["vt8"]))
    out = torch.empty_like(q)
    launch_attention_fp8_gluon(bufs, out, batch, heads, kv_heads, seqlen_q, seqlen_k, bufs["sq_pad"], bufs["sk_pad"],
                               head_dim, block_m=block_m, block_n=block_n, num_warps=num_warps,
                               num_stages=num_stages, keys_permuted=True)
    return out


# --------------------------------------------------------------------------------------------
# sequence-parallel (Ulysses): the exchange inside the quantize pass
# --------------------------------------------------------------------------------------------


class UlyssesFp8Plan:
    """The FP8 forward of one Ulysses call that quantizes before the exchange: each rank quantizes
    its slice of the sequence, every head, into the layout the attending rank's kernel reads (the
    whole sequence's buffers, its rows of them), and only the 8-bit values and their scales cross
    between GPUs: q, k and v at one byte an element instead of two, and no copy or quantize pass
    on the receiving side.

    Every rank of the group holds one buffer of :attr:`nbytes` with the same layout, and every
    rank's kernels can write into every rank's buffer (peer memory:
    :mod:`flashflow.distributed.peer`): the attention kernel's inputs (:class:`_Fp8Plan`'s
    regions, the whole sequence, this rank's heads) and the gathered statistics. The kernels
    store into the other ranks' buffers themselves (``destination_bytes``, from
    :meth:`peer_bytes`: rank ``g``'s buffer's address minus this rank's), so no copy runs between
    the steps. The caller runs, with a barrier of the group after each of the first two steps:

    1. :meth:`statistics` — this rank's partial K sums and V maxima (every head, its keys) and the
       K extremes of the key blocks at its slice's two ends, into every rank's buffer;
    2. :meth:`quantize` — the attention kernel's 8-bit inputs and scales
       (:func:`flashflow.kernels.quant.attention_quantize_kernel`), from the whole sequence's
       statistics: the same K mean, V scales and key-block scales on every rank, those of one
       process over the whole sequence (K's mean up to the order of its sum). Rank ``g``'s heads
       land at this rank's rows of rank ``g``'s regions;
    3. :meth:`attend` — this rank's heads over the whole sequence, ``(batch, world·seqlen_local,
       heads / world, head_dim)``, and the LSE with ``return_lse``; or :meth:`attend_rows`, one
       source rank's queries at a time (its output may lie in another rank's memory).

    Shapes: q ``(batch, seqlen_local, heads, head_dim)``, k and v ``(batch, seqlen_local,
    kv_heads, head_dim)`` (one length: self-attention), head_dim unit-stride, heads and kv_heads
    multiples of the world; ``key_padding_mask`` this rank's ``(batch, P)`` over its first ``P``
    keys and ``recv_mask`` every rank's masks over the whole sequence
    (:func:`flashflow.distributed.exchange.expand_masks`), or both None. The plan keeps no tensor.
    """

    def __init__(self, q, k, v, key_padding_mask, recv_mask, world: int, rank: int, qk_format: str = "int8",
                 return_lse: bool = False, config: Optional[AttentionFp8Config] = None):
        batch, seqlen_local, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        seqlen = world * seqlen_local
        device = q.device
        cfg = config or _config(head_dim, False, device)
        self.world, self.rank, self.return_lse = world, rank, return_lse

        def whole(h):
            return torch.empty((batch, seqlen, h, head_dim), dtype=q.dtype, device="meta")

        h, hk = heads // world, kv_heads // world
        recv = self.recv = _Fp8ForwardPlan(whole(h), whole(hk), whole(hk), recv_mask, False, return_lse, qk_format,
                                           cfg, device=device)
        self.out_shape, self.dtype = (batch, seqlen, h, head_dim), q.dtype
        # this rank's partial statistics: its chunks take slots [rank·chunks, (rank+1)·chunks)
        chunk, chunks, stats_block, stats_warps = stats_split(seqlen_local, batch * kv_heads, device, False)
        slots = world * chunks
        stats = batch * kv_heads * slots * head_dim
        edges = world * 2 * batch * kv_heads * head_dim
        self.slices, at = [], cdiv(recv.nbytes, 256) * 256
        for n in (stats, stats, edges, edges):   # ksum, vmax of every rank; K block ends' max, min
            self.slices.append((at, at + 4 * n))
            at = cdiv(at + 4 * n, 256) * 256
        self.nbytes = at
        mask_keys = 0 if key_padding_mask is None else key_padding_mask.shape[1]
        mask_stride = _mask_stride(key_padding_mask)
        self.mask_keys = mask_keys
        row_lo = rank * seqlen_local
        row_hi = row_lo + seqlen_local
        block_s = cfg.BLOCK_N
        self.stats_grid = (batch * kv_heads, chunks, 1)
        self.stats_ints = (seqlen_local, kv_heads, chunk, slots, rank * chunks, *k.stride()[:3], *v.stride()[:3])
        self.stats_constexprs = dict(HEAD_DIM=head_dim, BLOCK_S=stats_block, WORLD=world, num_warps=stats_warps)
        self.edge_grid = (batch * kv_heads, 2, 1)
        self.edge_ints = (row_lo, seqlen_local, kv_heads, batch * kv_heads, rank, mask_keys, *k.stride()[:3],
                          mask_stride)
        self.edge_constexprs = dict(HEAD_DIM=head_dim, BLOCK_S=block_s, KEY_PADDING=mask_keys > 0, WORLD=world,
                                    num_warps=4)
        # the rows this rank writes: its slice, and the padding past the sequence for the last rank
        q_hi = recv.sq_pad if row_hi >= seqlen else row_hi
        k_hi = recv.sk_pad if row_hi >= seqlen else row_hi
        self.quant_blocks = cdiv(max(q_hi, k_hi), block_s) - row_lo // block_s
        self.batch, self.heads_per_rank = batch, (h, hk)
        self.quant_ints = (seqlen, seqlen, recv.sq_pad, recv.sk_pad, heads, kv_heads, slots, mask_keys,
                           row_lo, row_hi, h, hk)
        self.quant_strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], mask_stride)
        self.quant_constexprs = dict(
            HEAD_DIM=head_dim, BLOCK_S=block_s, QK_FP8=qk_format == "fp8", SMOOTH_K=True, LSE_CORRECTION=return_lse,
            CHUNKS_PAD=next_pow2(slots), KEY_PADDING=mask_keys > 0, EMULATE_FP8=interpreting(), WORLD=world,
            num_warps=4)

    def peer_bytes(self, buffers) -> list[int]:
        """The kernels' ``PEER_BYTES`` for this rank: ``buffers[g]`` (rank ``g``'s buffer as this
        process maps it, at least :attr:`nbytes` bytes each) minus this rank's, in bytes. The
        kernels keep their stores full width by taking each a multiple of 16: a ValueError where
        one is not."""
        if len(buffers) != self.world:
            raise ValueError(f"buffers must hold one buffer a rank ({self.world}), got {len(buffers)}")
        own = buffers[self.rank].data_ptr()
        delta = [b.data_ptr() - own for b in buffers]
        if any(d % 16 for d in delta) or any(b.numel() * b.element_size() < self.nbytes for b in buffers):
            raise ValueError(f"buffers must each hold {self.nbytes} bytes at addresses 16 bytes apart, got "
                             f"offsets {delta} and sizes {[b.numel() * b.element_size() for b in buffers]}")
        return delta

    def views(self, buffer: torch.Tensor) -> dict:
        """The regions of a rank's buffer (uint8, at least :attr:`nbytes`) by name: the attention
        kernel's inputs (:class:`_Fp8Plan`'s names) and the gathered statistics."""
        bufs = {name: buffer[a:b].view(dtype) for name, (a, b, dtype) in zip(self.recv.BUFFERS, self.recv.slices)}
        for name, (a, b) in zip(("ksum_all", "vmax_all", "edge_max", "edge_min"), self.slices):
            bufs[name] = buffer[a:b].view(torch.float32)
        return bufs

    @staticmethod
    def _mask(key_padding_mask, like):
        if key_padding_mask is None:
            return like
        return unit_last_stride(key_padding_mask)

    def statistics(self, key, bufs: dict, destination_bytes: torch.Tensor, k, v, key_padding_mask) -> None:
        """This rank's statistics into every rank's buffer (``destination_bytes``: :meth:`peer_bytes`
        as an int64 tensor on the device)."""
        _STATS(key, self.stats_grid, (k, v, bufs["ksum_all"], bufs["vmax_all"], destination_bytes, *self.stats_ints),
               self.stats_constexprs)
        _EDGES(key, self.edge_grid, (k, self._mask(key_padding_mask, k), bufs["edge_max"], bufs["edge_min"],
                                     destination_bytes, *self.edge_ints), self.edge_constexprs)

    def quantize(self, key, bufs: dict, destination_bytes: torch.Tensor, q, k, v, key_padding_mask,
                 softmax_scale: float, first: int = 0, count: Optional[int] = None) -> None:
        """The quantize pass for the heads of destination ranks ``first`` to ``first + count − 1``
        (all by default, in one launch), each into its rank's buffer."""
        count = self.world - first if count is None else count
        h, hk = self.heads_per_rank
        _QUANTIZE(None if key is None else key + (first, count), (self.quant_blocks, count * (h + 2 * hk), self.batch), (
            q, k, v, bufs["q8"], bufs["q_scale"], bufs["q_corr"], bufs["k8"], bufs["k_scale"],
            bufs["vt8"].view(torch.int8), bufs["v_scale"], bufs["ksum_all"], bufs["vmax_all"],
            self._mask(key_padding_mask, q), bufs["edge_max"], bufs["edge_min"], destination_bytes,
            *self.quant_ints, first, *self.quant_strides, softmax_scale * LOG2E, softmax_scale), self.quant_constexprs)

    def attend(self, key, bufs: dict, recv_mask, out=None):
        """``(out, lse)``: this rank's heads over the whole sequence from its buffer."""
        if out is None:
            out = bufs["q8"].new_empty(self.out_shape, dtype=self.dtype)
        lse = out.new_empty(self.recv.lse_shape, dtype=torch.float32)
        _attend_quantized(key, self.recv, bufs, recv_mask, out, lse)
        return out, lse

    def attend_rows(self, key, bufs: dict, recv_mask, source: int, out) -> None:
        """This rank's heads for the queries of rank ``source``'s slice alone, into ``out``
        ``(batch, seqlen_local, heads / world, head_dim)`` (any strides, head_dim unit-stride):
        the attention kernel on the rows ``[source·seqlen_local, (source+1)·seqlen_local)`` of its
        inputs (descriptors and scales from that row on). Without ``return_lse``."""
        if self.return_lse:
            raise ValueError("attend_rows runs without the LSE: make the plan with return_lse=False")
        recv, (batch, seqlen, h, d) = self.recv, self.out_shape
        rows = seqlen // self.world
        row0 = source * rows
        (qs, qstr, qblock), kd, vd = recv.descs
        descs = (tensor_descriptor(bufs["q8"][row0 * d:], [qs[0] - row0, qs[1]], qstr, qblock),
                 tensor_descriptor(bufs["k8"], *kd), tensor_descriptor(bufs["vt8"], *vd))
        block_m = recv.constexprs["BLOCK_M"]
        m_blocks = cdiv(rows, block_m)
        mask = out
        if recv.mask_keys:
            mask = unit_last_stride(recv_mask)
        ints = (*out.stride()[:3], *recv.ints[3:6], rows, *recv.ints[7:12], m_blocks, recv.ints[13])
        _FORWARD(None if key is None else key + ("rows", source), (m_blocks * h * batch, 1, 1),
                 (*descs, bufs["q_scale"][row0:], bufs["k_scale"], bufs["v_scale"], bufs["q_corr"], out, out, mask,
                  *ints), recv.constexprs)
