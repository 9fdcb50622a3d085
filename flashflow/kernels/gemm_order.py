"""The dataflow model's probe: a plain GEMM whose tile order is a parameter, so that any order
:mod:`flashflow.dataflow.orders` knows can run and its DRAM traffic be measured against the
model's prediction (``flashflow bench --suite dataflow``, :mod:`flashflow.bench.dataflow`)."""
import triton
import triton.language as tl


@triton.jit
def gemm_tile_order_kernel(a_ptr, b_ptr, c_ptr, perm_ptr, M, N, K,
                           stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                           tiles_n,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C = A·B, one output tile per program. Program ``pid`` computes tile ``perm[pid]``: the
    launch issues program ids in increasing order, so ``perm`` is the tile order. Reads
    BLOCK_M×K of A and K×BLOCK_N of B per tile (DRAM or L2), writes BLOCK_M×BLOCK_N of C."""
    pid = tl.program_id(0)
    tile = tl.load(perm_ptr + pid)
    pid_m = tile // tiles_n
    pid_n = tile % tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
