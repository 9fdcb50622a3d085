"""Launcher of the decode-regime FFN kernels (M ≤ 64 tokens), used by
:func:`flashflow.fused_mlp` for its ``"splitk"`` policy (see :mod:`flashflow.kernels.ffn`).

The main kernel adds fp32 partials into a zeroed workspace with atomics; a second tiny launch
casts and re-zeroes it. Reading the sums in the same launch (a last-arriver cast) returned
partial sums on the H100 at M = 16; stream order is what makes the sums complete.
"""
from __future__ import annotations

import torch

from flashflow.kernels.ffn import ffn_cast_kernel, ffn_decode_kernel
from flashflow.ops.attention import _cdiv, _next_pow2, _sm_count

_ACT_CODE = {"swiglu": 0, "silu": 0, "gelu": 1, "relu": 2}


def decode_block_i(inter: int, num_sms: int) -> int:
    """Intermediate slice per program: about two programs per SM, all resident at once."""
    return max(16, min(128, _next_pow2(_cdiv(inter, 2 * num_sms))))


def decode_config(m: int, inter: int, gated: bool, device: torch.device) -> dict:
    """Tiles for the decode kernel. Swept on the H100 (scripts/tune_ffn.py, Llama-3-8B): 64-wide
    slices, 128-wide K/N steps, 4 warps, 3 stages led at M = 1, 4, 16."""
    on_gpu = device.type == "cuda"
    block_i = decode_block_i(inter, _sm_count(device) if on_gpu else 4)
    # weight tiles per stage: (2·)BLOCK_I × BLOCK_K of W1 and BLOCK_N × BLOCK_I of W2; wide
    # slices (70B-class intermediates) take narrower K/N steps to fit three stages in smem
    rows = block_i * (2 if gated else 1)
    block_kn = (128 if rows <= 128 else 64) if on_gpu else 32
    return {"BLOCK_I": block_i, "BLOCK_K": block_kn, "BLOCK_N": block_kn, "num_warps": 4,
            "num_stages": 3 if on_gpu else 1}


def launch_decode(x2, w1, w2, activation: str, ws: torch.Tensor, config=None) -> torch.Tensor:
    """out = FFN(x2) for x2 ``(M, hidden)``, M ≤ 64; ``ws`` is a zeroed fp32 ``(M, hidden)``
    accumulator, left zeroed again. ``config`` overrides :func:`decode_config` entries."""
    m, hidden = x2.shape
    inter = w2.shape[1]
    out = torch.empty((m, hidden), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return out
    cfg = decode_config(m, inter, activation == "swiglu", x2.device)
    cfg.update(config or {})
    ffn_decode_kernel[(_cdiv(inter, cfg["BLOCK_I"]),)](
        x2, w1, w2, ws, m, hidden, inter, x2.stride(0), w1.stride(0), w2.stride(0),
        BLOCK_M=max(16, _next_pow2(m)), BLOCK_I=cfg["BLOCK_I"], BLOCK_K=cfg["BLOCK_K"], BLOCK_N=cfg["BLOCK_N"],
        GATED=activation == "swiglu", ACTIVATION=_ACT_CODE[activation],
        DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    ffn_cast_kernel[(_cdiv(m * hidden, 1024),)](ws, out, m, hidden, out.stride(0), BLOCK=1024, num_warps=4)
    return out
