"""Paged vs contiguous decode: sweep configs and page sizes (TB/s of KV read, CUDA graph).

Usage (device): PYTHONPATH=. python scripts/tune_decode_paged.py
"""
import torch

from flashflow.bench.decode import graph_time_ms, kv_bytes
from flashflow.ops.decode import DecodeConfig, DecodePlan

for (b, s, h, hk) in [(1, 8192, 32, 8), (1, 32768, 32, 8), (16, 16384, 32, 8)]:
    d = 128
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    nbytes = kv_bytes(b, s, hk, d)
    base = DecodePlan(b, h, hk, d, s, device="cuda")
    out = [f"b{b} s{s} splits={base.num_splits}"]
    t = graph_time_ms(lambda: base.run(q, kc, vc, cache_seqlens=lens))
    out.append(f"contig[{base.config.BLOCK_N},{base.config.num_warps},{base.config.num_stages}] {nbytes / t / 1e9:.2f}")
    for page in (64, 256):
        per = s // page
        table = torch.randperm(b * per, device="cuda").reshape(b, per).int()
        kp = torch.empty(b * per, page, hk, d, device="cuda", dtype=torch.bfloat16)
        vp = torch.empty_like(kp)
        kp[table.flatten().long()] = kc.reshape(b * per, page, hk, d)
        vp[table.flatten().long()] = vc.reshape(b * per, page, hk, d)
        for cfg in (None, DecodeConfig(64, 4, 4), DecodeConfig(64, 4, 5), DecodeConfig(32, 4, 5), DecodeConfig(64, 8, 4),
                    DecodeConfig(128, 4, 3)):
            if cfg is not None and cfg.BLOCK_N > page:
                continue
            plan = DecodePlan(b, h, hk, d, s, device="cuda", config=cfg, num_splits=base.num_splits)
            try:
                t = graph_time_ms(lambda: plan.run(q, kp, vp, cache_seqlens=lens, block_table=table))
                c = plan.config
                out.append(f"p{page}[{c.BLOCK_N},{c.num_warps},{c.num_stages}] {nbytes / t / 1e9:.2f}")
            except Exception as e:  # noqa: BLE001
                out.append(f"p{page} {cfg} failed {type(e).__name__}")
        del kp, vp
    print(" | ".join(out), flush=True)
    del q, kc, vc
    torch.cuda.empty_cache()
