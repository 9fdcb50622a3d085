"""The dataflow model's probe: a bf16 GEMM whose output tiles are computed in a given order
(:mod:`flashflow.kernels.gemm_order`), so that Nsight Compute can count the DRAM bytes of each
tile order the model (:mod:`flashflow.dataflow`) predicts. Not a product op: `flashflow bench
--suite dataflow` launches it."""
from __future__ import annotations

import torch

from flashflow.kernels.gemm_order import gemm_tile_order_kernel

KERNEL_NAME = gemm_tile_order_kernel.__name__   # what the profiler is told to count


def gemm_in_tile_order(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, perm: torch.Tensor, block_m: int,
                       block_n: int, block_k: int, num_warps: int, num_stages: int):
    """``c = a @ b`` (a ``(M, K)``, b ``(K, N)``, c ``(M, N)``), program ``p`` computing the output
    tile ``perm[p]`` (row-major tile index over ``N / block_n`` tile columns)."""
    m, k = a.shape
    n = b.shape[1]
    return gemm_tile_order_kernel[(perm.numel(),)](
        a, b, c, perm, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        -(-n // block_n), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages)
