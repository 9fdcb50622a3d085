"""Decode at small batch after the merge change (only real query rows cross the workspace):
split counts × tiles, contiguous and paged (64-token pages, shuffled), beside SDPA-cuDNN, all
timed as CUDA-graph replays in one run. TB/s of KV read.

Usage (device): PYTHONPATH=. python scripts/tune_decode_splits.py [--json OUT]
"""
import argparse
import json
from datetime import datetime, timezone

import torch
import triton

from flashflow.bench.decode import PAGE_SIZE, graph_time_ms, kv_bytes
from flashflow.ops.decode import DecodeConfig, DecodePlan

SHAPES = [(1, 1024, 32, 8), (1, 8192, 32, 8), (1, 32768, 32, 8), (4, 8192, 32, 8), (1, 8192, 32, 32),
          (1, 131072, 32, 8)]
CONTIG = [DecodeConfig(64, 4, 3), DecodeConfig(128, 4, 3), DecodeConfig(128, 4, 4)]
PAGED = [None, DecodeConfig(64, 4, 4), DecodeConfig(128, 4, 3), DecodeConfig(128, 4, 4), DecodeConfig(128, 4, 5)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = []
    for (b, s, h, hk) in SHAPES:
        d = 128
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        per = s // PAGE_SIZE
        table = torch.randperm(b * per, device="cuda").reshape(b, per).int()
        kp = torch.empty(b * per, PAGE_SIZE, hk, d, device="cuda", dtype=torch.bfloat16)
        vp = torch.empty_like(kp)
        kp[table.flatten().long()] = kc.reshape(b * per, PAGE_SIZE, hk, d)
        vp[table.flatten().long()] = vc.reshape(b * per, PAGE_SIZE, hk, d)
        nbytes = kv_bytes(b, s, hk, d)
        row = {"shape": [b, s, h, hk], "tbs": {}}
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=h != hk)
        row["tbs"]["cudnn"] = nbytes / graph_time_ms(cudnn) / 1e9
        heur = DecodePlan(b, h, hk, d, s, device="cuda")
        row["heuristic"] = [heur.num_splits, heur.config.BLOCK_N]
        row["tbs"]["heuristic"] = nbytes / graph_time_ms(lambda: heur.run(q, kc, vc, cache_seqlens=lens)) / 1e9
        row["tbs"]["heuristic-paged"] = nbytes / graph_time_ms(
            lambda: heur.run(q, kp, vp, cache_seqlens=lens, block_table=table)) / 1e9
        ref = heur.run(q, kc, vc, cache_seqlens=lens).float()
        for splits in sorted({4, 8, 12, 16, 24, 32, heur.num_splits}):
            for name, cfgs, paged in (("c", CONTIG, False), ("p", PAGED, True)):
                for cfg in cfgs:
                    plan = DecodePlan(b, h, hk, d, s, device="cuda", config=cfg, num_splits=splits)
                    if paged:
                        fn = lambda: plan.run(q, kp, vp, cache_seqlens=lens, block_table=table)  # noqa: E731
                    else:
                        fn = lambda: plan.run(q, kc, vc, cache_seqlens=lens)  # noqa: E731
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, (name, cfg, splits, err)
                    c = cfg or DecodeConfig(0, 4, 5)
                    key = f"{name}{c.BLOCK_N}s{c.num_stages}/{splits}"
                    row["tbs"][key] = nbytes / graph_time_ms(fn) / 1e9
        for kind in ("c", "p"):
            best = max((k for k in row["tbs"] if k.startswith(kind) and "/" in k), key=row["tbs"].get)
            row[f"best_{kind}"] = [best, row["tbs"][best]]
        results.append(row)
        print(f"b{b} s{s} {h}/{hk}: cudnn {row['tbs']['cudnn']:.2f} heuristic {row['heuristic']} "
              f"{row['tbs']['heuristic']:.2f} paged {row['tbs']['heuristic-paged']:.2f} | best contig "
              f"{row['best_c'][0]} {row['best_c'][1]:.2f} | best paged {row['best_p'][0]} {row['best_p'][1]:.2f}",
              flush=True)
        del q, kc, vc, kp, vp, kt, vt
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "date": datetime.now(timezone.utc).isoformat(),
                       "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
