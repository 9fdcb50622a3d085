"""Fused transformer FFN (`flashflow.fused_mlp`): validation, config, launch.

Decode regime (M ≤ 64 tokens): one Triton launch, see :mod:`flashflow.kernels.ffn`.
Prefill regime (M > 64): not fused yet — the persistent ticketed GEMM0→GEMM1 kernel of the
dataflow issue is still to be built; until then the op runs the two GEMMs through PyTorch
(cuBLAS) and says so in the log once.
"""
from __future__ import annotations

import logging

import torch

from flashflow.kernels.ffn import ffn_cast_kernel, ffn_decode_kernel
from flashflow.ops.attention import _cdiv, _next_pow2, _sm_count
from flashflow.reference.mlp import ACTIVATIONS, activation_ref
from flashflow.tuning import interpreting

log = logging.getLogger(__name__)
DECODE_MAX_M = 64
_ACT_CODE = {"swiglu": 0, "silu": 0, "gelu": 1, "relu": 2}
_warned_prefill = []


def _check(x, w_gate_up, w_down, activation):
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (x.dtype == w_gate_up.dtype == w_down.dtype):
        raise TypeError(f"x, w_gate_up, w_down must share a dtype, got {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}")
    if not (x.device == w_gate_up.device == w_down.device):
        raise ValueError(f"x, w_gate_up, w_down must be on one device, got {x.device}, {w_gate_up.device}, "
                         f"{w_down.device}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"flashflow kernels run on CUDA tensors; got x on {x.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() < 1 or w_gate_up.dim() != 2 or w_down.dim() != 2:
        raise ValueError(f"x must be (..., hidden) and the weights 2-D, got {tuple(x.shape)}, "
                         f"{tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    hidden = x.shape[-1]
    hidden_w, inter = w_down.shape
    rows = 2 * inter if activation == "swiglu" else inter
    if hidden_w != hidden or tuple(w_gate_up.shape) != (rows, hidden):
        form = "(2·intermediate, hidden) = cat([gate, up])" if activation == "swiglu" else "(intermediate, hidden)"
        raise ValueError(f"with x (..., {hidden}) and w_down (hidden, intermediate) = {tuple(w_down.shape)}, "
                         f"w_gate_up must be {form} = {(rows, hidden)}; got w_gate_up {tuple(w_gate_up.shape)}"
                         + ("" if hidden_w == hidden else f" and w_down's hidden {hidden_w} != {hidden}"))


def decode_block_i(inter: int, num_sms: int) -> int:
    """Intermediate slice per program: about two programs per SM, all resident at once."""
    return max(16, min(128, _next_pow2(_cdiv(inter, 2 * num_sms))))


def fused_mlp(x, w_gate_up, w_down, activation="swiglu", policy="auto", workspace=None, _config=None):
    """Transformer FFN ``act(x·W1ᵀ)[∘ x·W_upᵀ]·W_downᵀ`` with weights in ``nn.Linear`` layout.

    Args:
        x: ``(..., hidden)``, fp16/bf16 (fp32 accepted).
        w_gate_up: SwiGLU: ``cat([gate_proj.weight, up_proj.weight])`` ``(2·intermediate, hidden)``;
            otherwise fc1's weight ``(intermediate, hidden)``.
        w_down: ``(hidden, intermediate)``.
        activation: ``"swiglu"``, ``"gelu"`` (tanh approximation), ``"silu"`` or ``"relu"``.
        policy: ``"auto"`` (reserved for the prefill kernel's tile orders).
        workspace: optional zeroed fp32 ``(M, hidden)`` buffer reused across calls
            (``make_workspace``); every call leaves it zeroed again.
    """
    _check(x, w_gate_up, w_down, activation)
    if policy != "auto":
        raise ValueError(f"policy must be 'auto' for now (the prefill policies are not built yet), got {policy!r}")
    lead = x.shape[:-1]
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    inter = w_down.shape[1]
    if m > DECODE_MAX_M:
        if not _warned_prefill:
            log.warning("fused_mlp: M=%d > %d runs the unfused PyTorch path (prefill kernel not built yet)",
                        m, DECODE_MAX_M)
            _warned_prefill.append(True)
        h = x2 @ w_gate_up.T
        h = activation_ref("silu", h[:, :inter]) * h[:, inter:] if activation == "swiglu" else activation_ref(activation, h)
        return (h.to(x.dtype) @ w_down.T).reshape(*lead, hidden)
    w1 = w_gate_up if w_gate_up.stride(-1) == 1 else w_gate_up.contiguous()
    w2 = w_down if w_down.stride(-1) == 1 else w_down.contiguous()
    ws = workspace if workspace is not None else make_workspace(m, hidden, x.device)
    if ws.shape != (m, hidden) or ws.dtype != torch.float32:
        raise ValueError(f"workspace must be float32 ({m}, {hidden}), got {ws.dtype} {tuple(ws.shape)}")
    out = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, hidden)
    num_sms = _sm_count(x.device) if x.device.type == "cuda" else 4
    block_i = decode_block_i(inter, num_sms)
    on_gpu = x.device.type == "cuda"
    # weight tiles per pipeline stage: (2·)BLOCK_I × BLOCK_K of W1 and BLOCK_N × BLOCK_I of W2;
    # wide slices (70B-class intermediates) take narrower K/N steps to fit three stages in smem
    rows = block_i * (2 if activation == "swiglu" else 1)
    block_kn = (128 if rows <= 128 else 64) if on_gpu else 32
    cfg = {"BLOCK_I": block_i, "BLOCK_K": block_kn, "BLOCK_N": block_kn, "num_warps": 4,
           "num_stages": 3 if on_gpu else 1}
    cfg.update(_config or {})  # tuning scripts only
    ffn_decode_kernel[(_cdiv(inter, cfg["BLOCK_I"]),)](
        x2, w1, w2, ws, m, hidden, inter, x2.stride(0), w1.stride(0), w2.stride(0),
        BLOCK_M=max(16, _next_pow2(m)), BLOCK_I=cfg["BLOCK_I"], BLOCK_K=cfg["BLOCK_K"], BLOCK_N=cfg["BLOCK_N"],
        GATED=activation == "swiglu", ACTIVATION=_ACT_CODE[activation],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    ffn_cast_kernel[(_cdiv(m * hidden, 1024),)](ws, out, m, hidden, out.stride(0), BLOCK=1024, num_warps=4)
    return out.reshape(*lead, hidden)


def make_workspace(m: int, hidden: int, device) -> torch.Tensor:
    """Zeroed fp32 accumulator (M, hidden); reusable: every call leaves it zeroed again."""
    return torch.zeros((m, hidden), dtype=torch.float32, device=device)
