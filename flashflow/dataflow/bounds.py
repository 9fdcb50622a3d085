"""Lower bounds on a GEMM's DRAM traffic, to judge how far an order is from the best possible.

- Compulsory: every input element read once, every output written once.
- Red-blue pebble (Hong & Kung's I/O bound, sharpened by Kwasniewski et al. to
  2·M·N·K/√S + M·N): any schedule of the M·N·K multiply-adds with a fast memory of S elements
  moves at least about 2·M·N·K/√S elements. It holds for every tiling, not only the model's
  fixed tiles, so the model's best order usually sits above it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from flashflow.dataflow.shape import GemmShape


@dataclass(frozen=True)
class Bounds:
    compulsory_read_bytes: int
    compulsory_write_bytes: int
    pebble_bytes: float          # 2·M·N·K/√S elements, in bytes (reads and writes together)

    @property
    def read_lower_bound(self) -> float:
        """The larger of the two bounds on bytes read (the pebble bound less the output)."""
        return max(self.compulsory_read_bytes, self.pebble_bytes - self.compulsory_write_bytes)


def compulsory_read_bytes(shape: GemmShape) -> int:
    return (shape.M * shape.K + shape.K * shape.N) * shape.elem_bytes


def compulsory_write_bytes(shape: GemmShape) -> int:
    return shape.M * shape.N * shape.c_bytes


def pebble_bytes(shape: GemmShape, cache_bytes: int) -> float:
    """2·M·N·K/√S elements for a cache of S = cache_bytes / elem_bytes elements."""
    if cache_bytes <= 0:
        return math.inf
    s = cache_bytes / shape.elem_bytes
    return 2.0 * shape.M * shape.N * shape.K / math.sqrt(s) * shape.elem_bytes


def bounds(shape: GemmShape, cache_bytes: int) -> Bounds:
    return Bounds(compulsory_read_bytes(shape), compulsory_write_bytes(shape),
                  pebble_bytes(shape, cache_bytes))
