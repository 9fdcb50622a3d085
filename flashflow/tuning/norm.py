"""The diffusion block's norms (:mod:`flashflow.ops.norm`) and the FP8 row quantization
(:mod:`flashflow.ops.quant`) have no config table: each launch is one pass over rows held in
registers, and its launch parameters follow from the row's width by the rules below."""
from __future__ import annotations

from flashflow.device import cdiv, next_pow2

# The widest row a pass holds in registers: 16384 fp32 values over 8 warps is 64 a thread.
MAX_ROW_WIDTH = 16384


def row_warps(block: int) -> int:
    """Warps for a row of ``block`` lanes: 8 fp32 values a thread up to 8 warps (3072-wide
    rows, 4096 lanes: 8 warps, 16 values a thread)."""
    return max(1, min(8, block // 256))


def heads_per_program(heads: int, most: int) -> int:
    """The largest power of two ≤ ``most`` heads per program that leaves at most 1/8 of the
    tiles' lanes masked (24 heads: 8, not 32)."""
    block = max(1, min(next_pow2(heads), most))
    while block > 1 and 8 * (cdiv(heads, block) * block - heads) > cdiv(heads, block) * block:
        block //= 2
    return block


def modulation_warps(block: int) -> int:
    """Warps of the two LayerNorm + modulate passes (:func:`flashflow.kernels.norm.layernorm_modulate_kernel`,
    :func:`flashflow.kernels.norm.gate_residual_layernorm_modulate_kernel`): :func:`row_warps`
    capped at 4. At Qwen-Image's 3072-wide rows (4096 lanes) on the H100, 4 warps took 46.3 and
    68.7 µs over 8192 tokens against 51.2 and 73.9 with 8, 59.5 and 82.0 with 16
    (bench/results/tune-norm-warps-h100.json): these rows also read the shift, scale (and
    gate) rows, and more programs in flight hide those loads better than more threads a row."""
    return min(4, row_warps(block))
