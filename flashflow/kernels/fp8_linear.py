"""The FP8 linear layer's own kernel: the product of a few rows with an e4m3 weight.

Most calls of :mod:`flashflow.ops.fp8_linear` run cuBLASLt's row-scaled FP8 GEMM on e4m3 rows. A
call with a few rows (the AdaLN modulation's single time-embedding row) is a weight read: the GEMM
streams ``N·K`` bytes of e4m3 for ``2·M·N·K`` FLOPs. Quantizing its rows would cost a launch and
add their error for nothing, so this kernel takes ``x`` as it is (bf16/fp16/fp32) and widens the
weight, exactly (e4m3 values are bf16 and fp16 values), before each dot.
"""
import triton
import triton.language as tl


@triton.jit
def fp8_weight_rows_kernel(
    X, W, W_SCALE, BIAS, OUT,
    M, N, K, stride_xm, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """``out[m, n] = w_scale[n] · Σ_k x[m, k] · w[n, k] + bias[n]`` for ``M ≤ BLOCK_M`` rows.

    Grid ``(cdiv(N, BLOCK_N),)``: a program owns ``BLOCK_N`` output channels and walks K in
    ``BLOCK_K`` steps, every row of x at once (fp32 accumulation on the tensor cores). ``W`` is
    ``(N, K)`` e4m3, contiguous; ``W_SCALE`` ``(N,)`` float32; x and out have unit stride along
    their last dim. Bytes: the weight once (``N·K``), x once per program (``M·K`` each, from
    L2), ``M·N`` outputs. FLOPs: ``2·M·N·K``."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    col_ok = offs_n < N
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(x.dtype)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    acc = acc * tl.load(W_SCALE + offs_n, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
