"""The diffusion block's memory-bound elementwise work, fused: validation, launch, custom ops.

A double-stream DiT block (Qwen-Image, as diffusers implements it) spends a large share of a
step outside its GEMMs and attention, in passes that each read and write the whole activation:
LayerNorm then AdaLN modulation, the gated residual add, the q/k RMSNorm, the rotary
embedding, the concatenation of the text and image streams. Each op here is one pass over its
rows (kernels: :mod:`flashflow.kernels.norm`), computing in fp32 and returning x's dtype (or,
with ``fp8=True``, the modulated rows as e4m3 with one scale per token, the A operand of an FP8
GEMM: :class:`flashflow.ops.quant.Fp8Rows`):

* :func:`layernorm_modulate` ``LayerNorm(x)·(1 + scale) + shift``;
* :func:`gate_residual` ``residual + gate·y``;
* :func:`gate_residual_layernorm_modulate` both of those, reading residual and y once;
* :func:`rmsnorm_rope` q/k RMSNorm and RoPE, optionally written straight into a slice of the
  joint [text, image] buffer (``out=``), which folds the concatenation into the same pass;
* :func:`joint_qkv_norm_rope` the whole of it for a double-stream block in one launch: both
  streams' q and k normalised and rotated, and v copied, into the three joint [text, image]
  tensors (one launch instead of four ``rmsnorm_rope`` and a ``torch.cat``: at Qwen-Image's
  sizes the block is close to host-bound, and each launch costs host time).

shift / scale / gate are rows of the modulation (diffusers' ``mod_params.chunk(3, dim=-1)``
views are taken as they are: any row stride, unit stride along D). With ``index`` (an integer
(B, L) tensor) they have 2B rows and token (b, l) takes row b where ``index[b, l] == 0``, row
B + b elsewhere, as diffusers' ``_modulate(..., index)``; the index values are not read on the
host, so any nonzero value means the second half.

No op reads a device value on the host: every one is CUDA-graph safe. Under ``torch.compile``
each is one opaque ``flashflow::`` custom op. ``rmsnorm_rope(..., out=)`` traces as the
functional op and a copy into ``out``: Inductor could not lower the mutating op
(``flashflow::rmsnorm_rope_out``, kept for direct use) on a view of a bigger buffer. Inputs that
require grad are refused.
"""
from __future__ import annotations

from typing import Optional

import torch

from flashflow.device import cdiv, next_pow2
from flashflow.kernels.norm import (gate_residual_kernel, gate_residual_layernorm_modulate_kernel,
                                    joint_qkv_norm_rope_kernel, layernorm_modulate_kernel, rmsnorm_rope_kernel)
from flashflow.ops.common import Launcher, dispatch as _dispatch, launch_by_arguments
from flashflow.ops.quant import Fp8Rows, empty_rows
from flashflow.ops.validate import (check_eps, check_flag, check_no_grad, check_runs_here, check_same_device,
                                    check_tensor, check_unit_last_stride, overlaps_itself)
from flashflow.tuning.norm import (MAX_ROW_WIDTH, heads_per_program as _heads_per_program, modulation_warps,
                                   row_warps as _num_warps)

__all__ = ["layernorm_modulate", "gate_residual", "gate_residual_layernorm_modulate", "rmsnorm_rope",
           "joint_qkv_norm_rope", "MAX_DIM"]

# rows are held in registers in one pass
MAX_DIM = MAX_ROW_WIDTH
# gate_residual reduces nothing: rows split into column blocks of at most this width
RESIDUAL_BLOCK = 4096
# rmsnorm_rope and joint_qkv_norm_rope pack heads of one token into a tile of at most this many elements
ROPE_TILE = 4096


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _check_dim(name: str, d: int) -> None:
    if not 1 <= d <= MAX_DIM:
        raise ValueError(f"the last dim of {name} must be between 1 and {MAX_DIM}, got {d}")


def _check_rows(name: str, x: torch.Tensor) -> tuple[int, int, int]:
    """x a (batch, seqlen, dim) float tensor flashflow can run on; returns (B, L, D)."""
    check_tensor(name, x, 3, "(batch, seqlen, dim)")
    check_runs_here(name, x)
    check_unit_last_stride(name, x)
    return tuple(x.shape)


def _check_index(index, b: int, l: int, x: torch.Tensor) -> None:
    if index is None:
        return
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"index must be None or an integer torch.Tensor of shape (batch, seqlen), "
                        f"got {type(index).__name__}")
    if index.dtype.is_floating_point or index.dtype.is_complex:
        raise TypeError(f"index must be an integer or bool tensor (0: first half of the modulation rows, "
                        f"else the second), got {index.dtype}")
    if tuple(index.shape) != (b, l):
        raise ValueError(f"index must have shape (batch, seqlen) = {(b, l)}, got {tuple(index.shape)}")
    check_same_device("index", index, x, "x")


def _check_modulation(name: str, t, b: int, d: int, x: torch.Tensor, x_name: str, index) -> None:
    """One modulation row per batch entry, (B, D); (2B, D) with ``index``."""
    rows, form = (2 * b, "(2·batch, dim)") if index is not None else (b, "(batch, dim)")
    check_tensor(name, t, 2, form)
    if tuple(t.shape) != (rows, d):
        hint = " (index is given: the rows of both halves)" if index is not None else ""
        raise ValueError(f"{name} must have shape {form} = {(rows, d)}{hint}, got {tuple(t.shape)}")
    check_same_device(name, t, x, x_name)
    check_unit_last_stride(name, t)


def _check_like(name: str, t, x: torch.Tensor, x_name: str) -> None:
    """A float tensor of x's shape on x's device, unit last stride."""
    check_tensor(name, t, x.dim(), f"{tuple(x.shape)} like {x_name}")
    if t.shape != x.shape:
        raise ValueError(f"{name} must have {x_name}'s shape {tuple(x.shape)}, got {tuple(t.shape)}")
    check_same_device(name, t, x, x_name)
    check_unit_last_stride(name, t)


def _check_head_rows(name: str, x) -> tuple[int, int, int, int]:
    """x a (batch, seqlen, heads, head_dim) float tensor flashflow can run on, head_dim even;
    returns its shape."""
    check_tensor(name, x, 4, "(batch, seqlen, heads, head_dim)")
    check_runs_here(name, x)
    check_unit_last_stride(name, x)
    b, s, h, d = x.shape
    if d % 2 or not 2 <= d <= MAX_DIM:
        raise ValueError(f"head_dim ({name}'s last dim) must be even and between 2 and {MAX_DIM}, got {d}")
    return b, s, h, d


def _check_norm_weight(name: str, weight, d: int, x: torch.Tensor, x_name: str) -> None:
    """None, or an RMSNorm weight (head_dim,) on x's device."""
    if weight is None:
        return
    check_tensor(name, weight, 1, "(head_dim,)")
    if weight.shape[0] != d:
        raise ValueError(f"{name} must have shape (head_dim,) = ({d},), got {tuple(weight.shape)}")
    check_same_device(name, weight, x, x_name)
    check_unit_last_stride(name, weight)


def _check_freqs(name: str, freqs, s: int, d: int, x: torch.Tensor, x_name: str) -> None:
    """complex64 rotary frequencies (seqlen, head_dim // 2) of x's tokens, on x's device."""
    if not isinstance(freqs, torch.Tensor):
        raise TypeError(f"{name} must be a complex64 torch.Tensor of shape (seqlen, head_dim // 2), "
                        f"got {type(freqs).__name__}")
    if freqs.dtype != torch.complex64:
        raise TypeError(f"{name} must be complex64 (the rotation runs in fp32), got {freqs.dtype}")
    if tuple(freqs.shape) != (s, d // 2):
        raise ValueError(f"{name} must have shape (seqlen, head_dim // 2) = {(s, d // 2)} ({x_name}'s seqlen), "
                         f"got {tuple(freqs.shape)}")
    check_same_device(name, freqs, x, x_name)


def _index_args(index: Optional[torch.Tensor], x: torch.Tensor) -> tuple:
    """(pointer, stride_b, stride_l); x stands in for the pointer when there is no index."""
    if index is None:
        return x, 0, 0
    if index.dtype == torch.bool:
        index = index.view(torch.uint8)
    return index, index.stride(0), index.stride(1)


# --------------------------------------------------------------------------------------------
# launchers (validated inputs)
# --------------------------------------------------------------------------------------------

# each kernel's launches keyed on their arguments (ops.common.launch_by_arguments): a repeated
# call skips Triton's per-call binding, most of the host time of these memory-bound passes
_LAYERNORM_MODULATE = Launcher(layernorm_modulate_kernel)
_GATE_RESIDUAL = Launcher(gate_residual_kernel)
_GATE_RESIDUAL_LAYERNORM_MODULATE = Launcher(gate_residual_layernorm_modulate_kernel)
_RMSNORM_ROPE = Launcher(rmsnorm_rope_kernel)
_JOINT_QKV_NORM_ROPE = Launcher(joint_qkv_norm_rope_kernel)


def _layernorm_modulate_launch(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                               index: Optional[torch.Tensor], eps: float, y: torch.Tensor,
                               row_scale: Optional[torch.Tensor]) -> None:
    """Into ``y`` (B, L, D) contiguous: x's dtype, or e4m3 with ``row_scale`` (B, L, 1)."""
    b, l, d = x.shape
    if b * l == 0:
        return
    index_ptr, stride_ib, stride_il = _index_args(index, x)
    block = next_pow2(d)
    launch_by_arguments(_LAYERNORM_MODULATE, (b * l, 1, 1), (
        x, shift, scale, index_ptr, y, row_scale if row_scale is not None else y, b, l, d,
        x.stride(0), x.stride(1), shift.stride(0), scale.stride(0), stride_ib, stride_il, y.stride(0), y.stride(1),
        eps), dict(HAS_INDEX=index is not None, FP8_OUT=row_scale is not None, BLOCK_D=block,
                   num_warps=modulation_warps(block)))


def _layernorm_modulate_impl(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                             index: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _layernorm_modulate_launch(x, shift, scale, index, eps, y, None)
    return y


def _layernorm_modulate_fp8_impl(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                                 index: Optional[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    data, row_scale = empty_rows(x.shape, x.device)
    _layernorm_modulate_launch(x, shift, scale, index, eps, data, row_scale)
    return data, row_scale


def _gate_residual_impl(residual: torch.Tensor, y: torch.Tensor, gate: torch.Tensor,
                        index: Optional[torch.Tensor]) -> torch.Tensor:
    b, l, d = residual.shape
    out = torch.empty((b, l, d), dtype=residual.dtype, device=residual.device)
    if b * l == 0:
        return out
    index_ptr, stride_ib, stride_il = _index_args(index, residual)
    block = min(next_pow2(d), RESIDUAL_BLOCK)
    launch_by_arguments(_GATE_RESIDUAL, (b * l, cdiv(d, block), 1), (
        residual, y, gate, index_ptr, out, b, l, d,
        residual.stride(0), residual.stride(1), y.stride(0), y.stride(1), gate.stride(0), stride_ib, stride_il,
        out.stride(0), out.stride(1)), dict(HAS_INDEX=index is not None, BLOCK_D=block, num_warps=_num_warps(block)))
    return out


def _gate_residual_layernorm_modulate_launch(
    residual: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
    index: Optional[torch.Tensor], eps: float, new_res: torch.Tensor, mod: torch.Tensor,
    row_scale: Optional[torch.Tensor],
) -> None:
    """Into ``new_res`` and ``mod`` (B, L, D) contiguous: ``mod`` in residual's dtype, or e4m3
    with ``row_scale`` (B, L, 1)."""
    b, l, d = residual.shape
    if b * l == 0:
        return
    index_ptr, stride_ib, stride_il = _index_args(index, residual)
    block = next_pow2(d)
    launch_by_arguments(_GATE_RESIDUAL_LAYERNORM_MODULATE, (b * l, 1, 1), (
        residual, y, gate, shift, scale, index_ptr, new_res, mod, row_scale if row_scale is not None else mod,
        b, l, d,
        residual.stride(0), residual.stride(1), y.stride(0), y.stride(1), gate.stride(0), shift.stride(0),
        scale.stride(0), stride_ib, stride_il, new_res.stride(0), new_res.stride(1), mod.stride(0), mod.stride(1),
        eps), dict(HAS_INDEX=index is not None, FP8_OUT=row_scale is not None, BLOCK_D=block,
                   num_warps=modulation_warps(block)))


def _gate_residual_layernorm_modulate_impl(
    residual: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
    index: Optional[torch.Tensor], eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    new_res = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    mod = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    _gate_residual_layernorm_modulate_launch(residual, y, gate, shift, scale, index, eps, new_res, mod, None)
    return new_res, mod


def _gate_residual_layernorm_modulate_fp8_impl(
    residual: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
    index: Optional[torch.Tensor], eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    new_res = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    data, row_scale = empty_rows(residual.shape, residual.device)
    _gate_residual_layernorm_modulate_launch(residual, y, gate, shift, scale, index, eps, new_res, data, row_scale)
    return new_res, data, row_scale


def _rmsnorm_rope_launch(x: torch.Tensor, weight: Optional[torch.Tensor], freqs: torch.Tensor, eps: float,
                         out: torch.Tensor) -> None:
    b, s, h, d = x.shape
    if b * s * h == 0:
        return
    f = torch.view_as_real(freqs)     # (S, D/2, 2) float32, unit last stride
    half = next_pow2(d // 2)
    block_h = _heads_per_program(h, ROPE_TILE // (2 * half))
    launch_by_arguments(_RMSNORM_ROPE, (b * s, cdiv(h, block_h), 1), (
        x, weight if weight is not None else x, f, out, s, h, d,
        x.stride(0), x.stride(1), x.stride(2), f.stride(0), f.stride(1), out.stride(0), out.stride(1), out.stride(2),
        eps), dict(HAS_WEIGHT=weight is not None, BLOCK_H=block_h, BLOCK_HALF=half,
                   num_warps=_num_warps(block_h * 2 * half)))


def _rmsnorm_rope_impl(x: torch.Tensor, weight: Optional[torch.Tensor], freqs: torch.Tensor,
                       eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rmsnorm_rope_launch(x, weight, freqs, eps, out)
    return out


def _rmsnorm_rope_out_impl(x: torch.Tensor, weight: Optional[torch.Tensor], freqs: torch.Tensor, eps: float,
                           out: torch.Tensor) -> None:
    _rmsnorm_rope_launch(x, weight, freqs, eps, out)


def _joint_qkv_norm_rope_impl(
    txt_q: torch.Tensor, txt_k: torch.Tensor, txt_v: torch.Tensor,
    img_q: torch.Tensor, img_k: torch.Tensor, img_v: torch.Tensor,
    txt_q_weight: Optional[torch.Tensor], txt_k_weight: Optional[torch.Tensor],
    img_q_weight: Optional[torch.Tensor], img_k_weight: Optional[torch.Tensor],
    txt_freqs: torch.Tensor, img_freqs: torch.Tensor,
    eps_txt_q: float, eps_txt_k: float, eps_img_q: float, eps_img_k: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, s_txt, h, d = txt_q.shape
    s = s_txt + img_q.shape[1]
    query, key, value = (torch.empty((b, s, h, d), dtype=txt_q.dtype, device=txt_q.device) for _ in range(3))
    _joint_qkv_norm_rope_launch(txt_q, txt_k, txt_v, img_q, img_k, img_v, txt_q_weight, txt_k_weight, img_q_weight,
                                img_k_weight, txt_freqs, img_freqs, (eps_txt_q, eps_txt_k, eps_img_q, eps_img_k),
                                query, key, value)
    return query, key, value


def _joint_qkv_norm_rope_launch(txt_q, txt_k, txt_v, img_q, img_k, img_v, txt_q_weight, txt_k_weight, img_q_weight,
                                img_k_weight, txt_freqs, img_freqs, eps: tuple, query, key, value) -> None:
    """The joint pass into ``query``, ``key`` and ``value`` (one layout); ``value`` None: v is
    left where it is (the grid's tensor axis covers q and k only)."""
    b, s_txt, h, d = txt_q.shape
    s = s_txt + img_q.shape[1]
    if b * s * h == 0:
        return
    tf, imf = torch.view_as_real(txt_freqs), torch.view_as_real(img_freqs)   # (S, D/2, 2) float32
    half = next_pow2(d // 2)
    block_h = _heads_per_program(h, ROPE_TILE // (2 * half))
    has_weight = txt_q_weight is not None
    # without weights, any pointer of one type stands in for the four (never read)
    w_tq, w_tk, w_iq, w_ik = ((txt_q_weight, txt_k_weight, img_q_weight, img_k_weight) if has_weight
                              else (txt_q,) * 4)
    launch_by_arguments(_JOINT_QKV_NORM_ROPE, (b * s, 2 if value is None else 3, cdiv(h, block_h)), (
        txt_q, txt_k, txt_v, img_q, img_k, img_v, w_tq, w_tk, w_iq, w_ik, tf, imf, query, key,
        query if value is None else value, s_txt, s, h, d,
        *txt_q.stride()[:3], *txt_k.stride()[:3], *txt_v.stride()[:3],
        *img_q.stride()[:3], *img_k.stride()[:3], *img_v.stride()[:3],
        tf.stride(0), tf.stride(1), imf.stride(0), imf.stride(1), *query.stride()[:3], *eps),
        dict(HAS_WEIGHT=has_weight, BLOCK_H=block_h, BLOCK_HALF=half, num_warps=_num_warps(block_h * 2 * half)))


def _joint_qkv_norm_rope_inplace_impl(
    qkv: torch.Tensor, s_txt: int,
    txt_q_weight: Optional[torch.Tensor], txt_k_weight: Optional[torch.Tensor],
    img_q_weight: Optional[torch.Tensor], img_k_weight: Optional[torch.Tensor],
    txt_freqs: torch.Tensor, img_freqs: torch.Tensor,
    eps_txt_q: float, eps_txt_k: float, eps_img_q: float, eps_img_k: float,
) -> None:
    q, k, v = qkv.unbind(2)
    # each program reads its (token, heads) tile whole before writing it back: in place is safe
    _joint_qkv_norm_rope_launch(q[:, :s_txt], k[:, :s_txt], v[:, :s_txt], q[:, s_txt:], k[:, s_txt:], v[:, s_txt:],
                                txt_q_weight, txt_k_weight, img_q_weight, img_k_weight, txt_freqs, img_freqs,
                                (eps_txt_q, eps_txt_k, eps_img_q, eps_img_k), q, k, None)


# --------------------------------------------------------------------------------------------
# custom ops: new tensors are returned (mutates_args=()), except rmsnorm_rope_out, which writes
# into the caller's ``out`` view and is declared as mutating it
# --------------------------------------------------------------------------------------------

_layernorm_modulate_op = torch.library.custom_op(
    "flashflow::layernorm_modulate", mutates_args=())(_layernorm_modulate_impl)
_layernorm_modulate_fp8_op = torch.library.custom_op(
    "flashflow::layernorm_modulate_fp8", mutates_args=())(_layernorm_modulate_fp8_impl)
_gate_residual_op = torch.library.custom_op("flashflow::gate_residual", mutates_args=())(_gate_residual_impl)
_gate_residual_layernorm_modulate_op = torch.library.custom_op(
    "flashflow::gate_residual_layernorm_modulate", mutates_args=())(_gate_residual_layernorm_modulate_impl)
_gate_residual_layernorm_modulate_fp8_op = torch.library.custom_op(
    "flashflow::gate_residual_layernorm_modulate_fp8", mutates_args=())(_gate_residual_layernorm_modulate_fp8_impl)
_rmsnorm_rope_op = torch.library.custom_op("flashflow::rmsnorm_rope", mutates_args=())(_rmsnorm_rope_impl)
_rmsnorm_rope_out_op = torch.library.custom_op(
    "flashflow::rmsnorm_rope_out", mutates_args=("out",))(_rmsnorm_rope_out_impl)
_joint_qkv_norm_rope_op = torch.library.custom_op(
    "flashflow::joint_qkv_norm_rope", mutates_args=())(_joint_qkv_norm_rope_impl)
_joint_qkv_norm_rope_inplace_op = torch.library.custom_op(
    "flashflow::joint_qkv_norm_rope_", mutates_args=("qkv",))(_joint_qkv_norm_rope_inplace_impl)


@_layernorm_modulate_op.register_fake
def _(x, shift, scale, index, eps):
    return x.new_empty(x.shape)


@_layernorm_modulate_fp8_op.register_fake
def _(x, shift, scale, index, eps):
    return empty_rows(x.shape, x.device)


@_gate_residual_op.register_fake
def _(residual, y, gate, index):
    return residual.new_empty(residual.shape)


@_gate_residual_layernorm_modulate_op.register_fake
def _(residual, y, gate, shift, scale, index, eps):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


@_gate_residual_layernorm_modulate_fp8_op.register_fake
def _(residual, y, gate, shift, scale, index, eps):
    return (residual.new_empty(residual.shape), *empty_rows(residual.shape, residual.device))


@_rmsnorm_rope_op.register_fake
def _(x, weight, freqs, eps):
    return x.new_empty(x.shape)


@_rmsnorm_rope_out_op.register_fake
def _(x, weight, freqs, eps, out):
    return None


@_joint_qkv_norm_rope_op.register_fake
def _(txt_q, txt_k, txt_v, img_q, img_k, img_v, txt_q_weight, txt_k_weight, img_q_weight, img_k_weight,
      txt_freqs, img_freqs, eps_txt_q, eps_txt_k, eps_img_q, eps_img_k):
    b, s_txt, h, d = txt_q.shape
    shape = (b, s_txt + img_q.shape[1], h, d)
    return txt_q.new_empty(shape), txt_q.new_empty(shape), txt_q.new_empty(shape)


@_joint_qkv_norm_rope_inplace_op.register_fake
def _(qkv, s_txt, txt_q_weight, txt_k_weight, img_q_weight, img_k_weight, txt_freqs, img_freqs, eps_txt_q, eps_txt_k,
      eps_img_q, eps_img_k):
    return None


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def layernorm_modulate(x, shift, scale, eps=1e-6, index=None, fp8=False):
    """LayerNorm (no affine) and AdaLN modulation in one pass.

    Args:
        x: ``(batch, seqlen, dim)``, fp16/bf16/fp32, unit stride along dim (other strides free).
        shift, scale: ``(batch, dim)`` modulation rows (any float dtype, unit stride along dim);
            ``(2·batch, dim)`` when ``index`` is given.
        eps: the LayerNorm's epsilon (diffusers' Qwen-Image blocks: 1e-6).
        index: None, or an integer/bool ``(batch, seqlen)`` tensor: token (b, l) takes
            modulation row b where ``index[b, l] == 0``, else row batch + b.
        fp8: True or False. True returns the result as the A operand of a row-scaled FP8 GEMM
            (:class:`~flashflow.ops.quant.Fp8Rows`) instead of a tensor in x's dtype.
    Returns:
        ``LayerNorm(x)·(1 + scale) + shift``, statistics and arithmetic in fp32: a new
        contiguous tensor in x's dtype (the fp32 value rounded once to it); with ``fp8`` an
        :class:`~flashflow.ops.quant.Fp8Rows` ``(data (batch, seqlen, dim) e4m3, scale (batch,
        seqlen, 1) float32)``, each token's row quantized from the fp32 value itself (never
        rounded to x's dtype): ``scale = max|row| / 448``, ``data = e4m3(row · 448 / max|row|)``
        (nearest even, saturated at ±448), a NaN scale for a row holding a NaN or ±inf
        (:mod:`flashflow.ops.quant`).
    """
    b, l, d = _check_rows("x", x)
    _check_dim("x", d)
    _check_index(index, b, l, x)
    _check_modulation("shift", shift, b, d, x, "x", index)
    _check_modulation("scale", scale, b, d, x, "x", index)
    eps = check_eps(eps)
    fp8 = check_flag("fp8", fp8)
    check_no_grad("layernorm_modulate", x=x, shift=shift, scale=scale)
    if fp8:
        return Fp8Rows(*_dispatch(_layernorm_modulate_fp8_op, _layernorm_modulate_fp8_impl,
                                  x, shift, scale, index, eps))
    return _dispatch(_layernorm_modulate_op, _layernorm_modulate_impl, x, shift, scale, index, eps)


def gate_residual(residual, y, gate, index=None):
    """The gated residual add ``residual + gate·y``.

    Args:
        residual: ``(batch, seqlen, dim)``, fp16/bf16/fp32, unit stride along dim.
        y: the branch's output, residual's shape (any float dtype, unit stride along dim).
        gate: ``(batch, dim)`` (``(2·batch, dim)`` with ``index``), any float dtype.
        index: as in :func:`layernorm_modulate`.
    Returns:
        A new contiguous tensor in residual's dtype, computed in fp32 and rounded once.
    """
    b, l, d = _check_rows("residual", residual)
    _check_like("y", y, residual, "residual")
    _check_index(index, b, l, residual)
    _check_modulation("gate", gate, b, d, residual, "residual", index)
    check_no_grad("gate_residual", residual=residual, y=y, gate=gate)
    return _dispatch(_gate_residual_op, _gate_residual_impl, residual, y, gate, index)


def gate_residual_layernorm_modulate(residual, y, gate, shift, scale, eps=1e-6, index=None, fp8=False):
    """:func:`gate_residual` then :func:`layernorm_modulate` of its result, in one pass that
    reads residual and y once.

    Args: as :func:`gate_residual` and :func:`layernorm_modulate` (gate, shift and scale share
        ``index``; ``fp8`` concerns ``modulated`` only).
    Returns:
        ``(new_residual, modulated)``: ``new_residual = residual + gate·y``, computed in fp32
        and rounded once to residual's dtype, and ``modulated = LayerNorm(new_residual)·(1 +
        scale) + shift`` in fp32, the LayerNorm taken of new_residual as rounded (as the
        unfused block normalises the tensor it stored). Both are new contiguous tensors in
        residual's dtype; with ``fp8``, ``modulated`` is an
        :class:`~flashflow.ops.quant.Fp8Rows` quantized per token from its fp32 value, never
        rounded to residual's dtype, as in :func:`layernorm_modulate` (new_residual is still
        residual's dtype).
    """
    b, l, d = _check_rows("residual", residual)
    _check_dim("residual", d)
    _check_like("y", y, residual, "residual")
    _check_index(index, b, l, residual)
    for name, t in (("gate", gate), ("shift", shift), ("scale", scale)):
        _check_modulation(name, t, b, d, residual, "residual", index)
    eps = check_eps(eps)
    fp8 = check_flag("fp8", fp8)
    check_no_grad("gate_residual_layernorm_modulate", residual=residual, y=y, gate=gate, shift=shift, scale=scale)
    if fp8:
        new_res, data, row_scale = _dispatch(_gate_residual_layernorm_modulate_fp8_op,
                                             _gate_residual_layernorm_modulate_fp8_impl,
                                             residual, y, gate, shift, scale, index, eps)
        return new_res, Fp8Rows(data, row_scale)
    return _dispatch(_gate_residual_layernorm_modulate_op, _gate_residual_layernorm_modulate_impl,
                     residual, y, gate, shift, scale, index, eps)


def rmsnorm_rope(x, weight, freqs, eps=1e-6, out=None):
    """q/k RMSNorm followed by the rotary embedding, one pass (diffusers' ``RMSNorm`` then
    ``apply_rotary_emb_qwen(..., use_real=False)``).

    Args:
        x: ``(batch, seqlen, heads, head_dim)``, fp16/bf16/fp32, unit stride along head_dim
            (e.g. ``linear_out.unflatten(-1, (heads, head_dim))``); head_dim even.
        weight: the RMSNorm's ``(head_dim,)`` weight (any float dtype, contiguous), or None.
            As in diffusers, the normalised values are rounded to a fp16/bf16 weight's dtype
            before and after the multiply (to x's dtype when there is no weight).
        freqs: complex64 ``(seqlen, head_dim // 2)`` (any strides): pairs ``(x[2i], x[2i+1])``
            are complex numbers multiplied by ``freqs[s, i]``, in fp32.
        eps: the RMSNorm's epsilon.
        out: None (a new contiguous tensor), or a ``(batch, seqlen, heads, head_dim)`` tensor of
            x's dtype, unit stride along head_dim, to write into: e.g. ``joint[:, off:off +
            seqlen]``, a slice of the joint [text, image] buffer, which folds the
            concatenation into this pass. It may be x itself; it must not otherwise overlap x.
    Returns:
        The result in x's dtype: ``out`` when given.
    """
    b, s, h, d = _check_head_rows("x", x)
    _check_norm_weight("weight", weight, d, x, "x")
    _check_freqs("freqs", freqs, s, d, x, "x")
    if out is not None:
        _check_like("out", out, x, "x")
        if out.dtype != x.dtype:
            raise TypeError(f"out must have x's dtype {x.dtype}, got {out.dtype}")
    eps = check_eps(eps)
    check_no_grad("rmsnorm_rope", x=x, weight=weight, freqs=freqs, out=out)
    if out is None:
        return _dispatch(_rmsnorm_rope_op, _rmsnorm_rope_impl, x, weight, freqs, eps)
    if torch.compiler.is_compiling():
        # Inductor cannot lower a custom op that mutates a view of a larger buffer
        # ("auto_functionalized_v2 was not removed"): trace the functional op and a copy into
        # ``out``, which Inductor fuses with its other writes of the buffer.
        return out.copy_(_rmsnorm_rope_op(x, weight, freqs, eps))
    _rmsnorm_rope_out_impl(x, weight, freqs, eps, out)
    return out


def joint_qkv_norm_rope(txt_q, txt_k, txt_v, img_q, img_k, img_v, txt_q_weight, txt_k_weight, img_q_weight,
                        img_k_weight, txt_freqs, img_freqs, eps=1e-6):
    """The joint [text, image] query, key and value of a double-stream attention block, in one
    launch: each stream's q and k through :func:`rmsnorm_rope` with its own weight and
    frequencies, and v as it is, concatenated along the sequence (text first), as diffusers'
    Qwen-Image processor does with four ``RMSNorm`` + ``apply_rotary_emb_qwen`` and three
    ``torch.cat``.

    Args:
        txt_q, txt_k, txt_v: the text stream's ``(batch, S_txt, heads, head_dim)`` projections,
            fp16/bf16/fp32, one dtype, unit stride along head_dim (other strides free, e.g.
            ``linear_out.unflatten(-1, (heads, head_dim))``); head_dim even.
        img_q, img_k, img_v: the image stream's, ``(batch, S_img, heads, head_dim)``, same
            dtype, batch, heads and head_dim.
        txt_q_weight, txt_k_weight, img_q_weight, img_k_weight: the four RMSNorm weights
            (diffusers' ``norm_added_q``, ``norm_added_k``, ``norm_q``, ``norm_k``),
            ``(head_dim,)`` tensors of one float dtype, or all four None; rounded as in
            :func:`rmsnorm_rope`.
        txt_freqs, img_freqs: complex64 ``(S_txt, head_dim // 2)`` and ``(S_img, head_dim // 2)``
            (any strides): each stream's rotary frequencies.
        eps: the RMSNorms' epsilon, one float or a 4-tuple ``(txt_q, txt_k, img_q, img_k)``.
    Returns:
        ``(query, key, value)``, new contiguous ``(batch, S_txt + S_img, heads, head_dim)``
        tensors in the inputs' dtype: equal, bit for bit, to ``torch.cat`` of the
        :func:`rmsnorm_rope` outputs (q, k) and of txt_v and img_v.
    """
    b, s_txt, h, d = _check_head_rows("txt_q", txt_q)
    for name, t in (("txt_k", txt_k), ("txt_v", txt_v)):
        _check_like(name, t, txt_q, "txt_q")
    img_b, s_img, img_h, img_d = _check_head_rows("img_q", img_q)
    if (img_b, img_h, img_d) != (b, h, d):
        raise ValueError(f"img_q must have txt_q's batch, heads and head_dim: (batch, S_img, heads, head_dim) = "
                         f"({b}, S_img, {h}, {d}), got {tuple(img_q.shape)}")
    check_same_device("img_q", img_q, txt_q, "txt_q")
    for name, t in (("img_k", img_k), ("img_v", img_v)):
        _check_like(name, t, img_q, "img_q")
    for name, t in (("txt_k", txt_k), ("txt_v", txt_v), ("img_q", img_q), ("img_k", img_k), ("img_v", img_v)):
        if t.dtype != txt_q.dtype:
            raise TypeError(f"{name} must have txt_q's dtype {txt_q.dtype}, got {t.dtype}")
    weights = {"txt_q_weight": txt_q_weight, "txt_k_weight": txt_k_weight, "img_q_weight": img_q_weight,
               "img_k_weight": img_k_weight}
    eps = _check_joint_norms(weights, txt_freqs, img_freqs, eps, s_txt, s_img, d, txt_q, ("txt_q", "txt_q", "img_q"))
    check_no_grad("joint_qkv_norm_rope", txt_q=txt_q, txt_k=txt_k, txt_v=txt_v, img_q=img_q, img_k=img_k,
                  img_v=img_v, txt_freqs=txt_freqs, img_freqs=img_freqs, **weights)
    return _dispatch(_joint_qkv_norm_rope_op, _joint_qkv_norm_rope_impl, txt_q, txt_k, txt_v, img_q, img_k, img_v,
                     txt_q_weight, txt_k_weight, img_q_weight, img_k_weight, txt_freqs, img_freqs, *eps)


def _check_joint_norms(weights: dict, txt_freqs, img_freqs, eps, s_txt: int, s_img: int, d: int, x: torch.Tensor,
                       names: tuple[str, str, str]) -> tuple:
    """The four RMSNorm weights (all tensors of one dtype, or all None), both streams'
    frequencies and eps (one float or four), as the joint passes take them; returns the 4 eps.
    ``names``: how errors name x, the text tokens and the image tokens."""
    x_name, txt_name, img_name = names
    for name, w in weights.items():
        _check_norm_weight(name, w, d, x, x_name)
    given = [name for name, w in weights.items() if w is not None]
    # one kernel path for all four norms: the weights' presence and dtype are compile-time
    if given and len(given) != len(weights):
        missing = [name for name in weights if name not in given]
        raise ValueError(f"the four RMSNorm weights must be all tensors or all None; got {', '.join(missing)} None "
                         f"and {', '.join(given)} given (use rmsnorm_rope per tensor for mixed norms)")
    if given and len({w.dtype for w in weights.values()}) > 1:
        dtypes = ", ".join(f"{name} {w.dtype}" for name, w in weights.items())
        raise TypeError(f"the four RMSNorm weights must share one dtype, got {dtypes}")
    _check_freqs("txt_freqs", txt_freqs, s_txt, d, x, txt_name)
    _check_freqs("img_freqs", img_freqs, s_img, d, x, img_name)
    if isinstance(eps, (tuple, list)):
        if len(eps) != 4:
            raise ValueError(f"eps must be a float or a 4-tuple (txt_q, txt_k, img_q, img_k), got {len(eps)} values")
        return tuple(check_eps(e) for e in eps)
    return (check_eps(eps),) * 4


def joint_qkv_norm_rope_(qkv, s_txt, txt_q_weight, txt_k_weight, img_q_weight, img_k_weight, txt_freqs, img_freqs,
                         eps=1e-6):
    """:func:`joint_qkv_norm_rope` in place, on the joint [text, image] projections of one
    buffer: for the text tokens ``qkv[:, :s_txt]`` and the image tokens ``qkv[:, s_txt:]``, q
    (``qkv[:, :, 0]``) and k (``qkv[:, :, 1]``) are overwritten by their stream's RMSNorm and
    RoPE; v (``qkv[:, :, 2]``) is already where attention reads it and is not touched. What the
    two streams' q/k/v projections written side by side into one buffer need (the FP8 layers'
    ``out=``): no joint copy of v, no new q and k.

    Args:
        qkv: ``(batch, S_txt + S_img, 3, heads, head_dim)``, fp16/bf16/fp32, unit stride along
            head_dim (other strides free, e.g. a ``(batch, S, 3·heads·head_dim)`` projection
            output unflattened), no two elements at one address; head_dim even.
        s_txt: the number of text tokens, first along the sequence (0 ≤ s_txt ≤ S).
        txt_q_weight, txt_k_weight, img_q_weight, img_k_weight, txt_freqs, img_freqs, eps: as
            :func:`joint_qkv_norm_rope`.
    Returns:
        ``(query, key, value)``: the three ``(batch, S, heads, head_dim)`` views of ``qkv``, q and
        k equal, bit for bit, to :func:`joint_qkv_norm_rope`'s outputs for the same inputs.
    """
    check_tensor("qkv", qkv, 5, "(batch, S_txt + S_img, 3, heads, head_dim)")
    check_runs_here("qkv", qkv)
    check_unit_last_stride("qkv", qkv)
    b, s, three, h, d = qkv.shape
    if three != 3:
        raise ValueError(f"qkv must have shape (batch, S_txt + S_img, 3, heads, head_dim): 3 at dim 2 (q, k, v), got "
                         f"{tuple(qkv.shape)}")
    if d % 2 or not 2 <= d <= MAX_DIM:
        raise ValueError(f"head_dim (qkv's last dim) must be even and between 2 and {MAX_DIM}, got {d}")
    if isinstance(s_txt, bool) or not isinstance(s_txt, int) or not 0 <= s_txt <= s:
        raise ValueError(f"s_txt must be an int in [0, {s}] (qkv's sequence length), got {s_txt!r}")
    if overlaps_itself(qkv):
        raise ValueError(f"qkv is written in place: no two of its elements may share an address, got strides "
                         f"{qkv.stride()} for shape {tuple(qkv.shape)}")
    weights = {"txt_q_weight": txt_q_weight, "txt_k_weight": txt_k_weight, "img_q_weight": img_q_weight,
               "img_k_weight": img_k_weight}
    eps = _check_joint_norms(weights, txt_freqs, img_freqs, eps, s_txt, s - s_txt, d, qkv,
                             ("qkv", "qkv (text tokens)", "qkv (image tokens)"))
    check_no_grad("joint_qkv_norm_rope_", qkv=qkv, txt_freqs=txt_freqs, img_freqs=img_freqs, **weights)
    _dispatch(_joint_qkv_norm_rope_inplace_op, _joint_qkv_norm_rope_inplace_impl, qkv, s_txt, txt_q_weight,
              txt_k_weight, img_q_weight, img_k_weight, txt_freqs, img_freqs, *eps)
    return qkv.unbind(2)
