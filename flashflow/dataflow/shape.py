"""A GEMM C[M, N] = A[M, K] · B[K, N] cut into output tiles and K-steps.

The unit of data the model moves is a *block*: the part of an A row-panel or a B column-panel
that one K-step of one tile reads (block_m × block_k of A, block_k × block_n of B). Edge tiles
and edge K-steps are smaller when a dimension is not a multiple of its block, and the model
charges their true size, so a cache that holds everything costs exactly the compulsory traffic.
"""
from __future__ import annotations

from dataclasses import dataclass

from flashflow.device import cdiv


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class GemmShape:
    """Problem size, tile sizes and element sizes of one GEMM."""

    M: int
    N: int
    K: int
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    elem_bytes: int = 2          # A and B (bf16 by default)
    out_bytes: int | None = None  # C; defaults to elem_bytes

    def __post_init__(self):
        for name in ("M", "N", "K", "block_m", "block_n", "block_k", "elem_bytes"):
            _positive_int(name, getattr(self, name))
        if self.out_bytes is not None:
            _positive_int("out_bytes", self.out_bytes)

    @property
    def c_bytes(self) -> int:
        return self.elem_bytes if self.out_bytes is None else self.out_bytes

    @property
    def tiles_m(self) -> int:
        return cdiv(self.M, self.block_m)

    @property
    def tiles_n(self) -> int:
        return cdiv(self.N, self.block_n)

    @property
    def k_steps(self) -> int:
        return cdiv(self.K, self.block_k)

    @property
    def num_tiles(self) -> int:
        return self.tiles_m * self.tiles_n

    def rows(self, m: int) -> int:
        """Rows of C (and of A) in tile row m."""
        return min(self.block_m, self.M - m * self.block_m)

    def cols(self, n: int) -> int:
        """Columns of C (and of B) in tile column n."""
        return min(self.block_n, self.N - n * self.block_n)

    def depth(self, k: int) -> int:
        """Length along K of K-step k."""
        return min(self.block_k, self.K - k * self.block_k)

    def a_block_bytes(self, m: int, k: int) -> int:
        return self.rows(m) * self.depth(k) * self.elem_bytes

    def b_block_bytes(self, k: int, n: int) -> int:
        return self.depth(k) * self.cols(n) * self.elem_bytes

    def c_tile_bytes(self, m: int, n: int) -> int:
        return self.rows(m) * self.cols(n) * self.c_bytes

    def with_block_k(self, block_k: int) -> "GemmShape":
        """Same problem with coarser (or finer) K-steps: a cheaper model for searches."""
        return GemmShape(self.M, self.N, self.K, self.block_m, self.block_n, block_k,
                         self.elem_bytes, self.out_bytes)

    def to_dict(self) -> dict:
        return {"M": self.M, "N": self.N, "K": self.K, "block_m": self.block_m,
                "block_n": self.block_n, "block_k": self.block_k,
                "elem_bytes": self.elem_bytes, "out_bytes": self.c_bytes}
