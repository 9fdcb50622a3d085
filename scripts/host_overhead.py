"""Host-side cost per call vs GPU time, for small shapes where launch overhead can dominate.

Usage (device): PYTHONPATH=. python scripts/host_overhead.py
"""
import time

import torch
import triton

import flashflow
from flashflow.bench.decode import graph_time_ms
from flashflow.ops.attention import attention_forward


def host_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def graph_us(fn, steps=20):
    return graph_time_ms(fn, steps) * 1e3


SHAPES = [(32, 32, 512, 64, True), (32, 32, 512, 64, False), (16, 16, 1024, 128, True),
                             (8, 16, 2048, 128, True)]


def main():
  for (b, h, s, d, causal) in SHAPES:
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    api = lambda: flashflow.flash_attn_func(q, k, v, causal=causal)
    raw = lambda: attention_forward(q, k, v, softmax_scale=d ** -0.5, window_right=0 if causal else None,
                                    heavy_first=causal, return_lse=False)
    print(f"b{b} h{h} s{s} d{d} causal={causal}: do_bench api {triton.testing.do_bench(api, return_mode='median')*1e3:.0f} us, "
          f"raw {triton.testing.do_bench(raw, return_mode='median')*1e3:.0f} us, graph {graph_us(api):.0f} us, "
          f"host/call api {host_us(api):.0f} us raw {host_us(raw):.0f} us", flush=True)


if __name__ == "__main__" and "--profile" not in __import__("sys").argv:
    main()

if __name__ == "__main__":
    import cProfile
    import pstats
    import sys

    if "--profile" in sys.argv:
        q = torch.randn(32, 512, 32, 64, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        fn = lambda: flashflow.flash_attn_func(q, k, v, causal=True)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        cProfile.run("for _ in range(300): fn()", "/tmp/prof")
        pstats.Stats("/tmp/prof").sort_stats("tottime").print_stats(22)
