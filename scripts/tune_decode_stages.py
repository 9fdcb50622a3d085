"""Contiguous decode with deeper pipelines (does the paged setting help contiguous too?)."""
import torch

from flashflow.bench.decode import graph_time_ms, kv_bytes
from flashflow.ops.decode import DecodeConfig, DecodePlan

for (b, s) in [(1, 8192), (1, 32768), (16, 16384), (4, 8192)]:
    h, hk, d = 32, 8, 128
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    row = [f"b{b} s{s}"]
    for cfg in (None, DecodeConfig(64, 4, 5), DecodeConfig(128, 4, 3), DecodeConfig(64, 4, 6)):
        plan = DecodePlan(b, h, hk, d, s, device="cuda", config=cfg)
        t = graph_time_ms(lambda: plan.run(q, kc, vc, cache_seqlens=lens))
        c = plan.config
        row.append(f"[{c.BLOCK_N},{c.num_warps},{c.num_stages}]/{plan.num_splits} {kv_bytes(b, s, hk, d) / t / 1e9:.2f}")
    print(" | ".join(row), flush=True)
