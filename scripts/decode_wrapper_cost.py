"""Python cost per call of flash_attn_with_kvcache's wrapper (validation, plan, argument
packing) with the kernel launch stubbed out: runs on a CPU (TRITON_INTERPRET=1), no GPU.
On a GPU the wrapper's host synchronisations cost more than this; see scripts/host_overhead.py.

Usage: TRITON_INTERPRET=1 PYTHONPATH=. python scripts/decode_wrapper_cost.py
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import flashflow  # noqa: E402
import flashflow.ops.decode as od  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *a, **k: None


def per_call_us(fn, n=2000):
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main():
    od.decode_attention_kernel = _NoLaunch()
    for batch, paged in ((1, False), (64, False), (64, True)):
        q = torch.randn(batch, 1, 32, 128, dtype=torch.float16)
        if paged:
            kc = torch.randn(batch * 8, 64, 8, 128, dtype=torch.float16)
            table = torch.randperm(batch * 8, dtype=torch.int32).view(batch, 8)
        else:
            kc, table = torch.randn(batch, 512, 8, 128, dtype=torch.float16), None
        lens = torch.full((batch,), 400, dtype=torch.int32)
        us = per_call_us(lambda: flashflow.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, block_table=table))
        print(f"batch {batch:>2} {'paged' if paged else 'contiguous'}: {us:.1f} µs per call")


if __name__ == "__main__":
    main()
