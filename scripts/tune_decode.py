"""Sweep decode configs (BLOCK_N, warps, stages) and split counts on the GPU; TB/s of KV read.

Usage (device): PYTHONPATH=. python scripts/tune_decode.py [--json OUT]
"""
import argparse
import json
import sys

import torch

from flashflow.bench.decode import graph_time_ms, kv_bytes
from flashflow.ops.decode import DecodeConfig, DecodePlan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shapes = [(1, 1024, 32, 8), (1, 8192, 32, 8), (1, 32768, 32, 8), (1, 8192, 32, 32), (4, 8192, 32, 8)]
    configs = [DecodeConfig(64, 4, 3), DecodeConfig(128, 4, 3), DecodeConfig(128, 4, 2), DecodeConfig(64, 4, 4),
               DecodeConfig(64, 2, 3)]
    rows = []
    for (b, s, h, hk) in shapes:
        d = 128
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        base = DecodePlan(b, h, hk, d, s, device="cuda")
        heur = base.num_splits
        cands = sorted({max(1, heur // 2), heur, heur * 2})
        res = {}
        for cfg in configs:
            for ns in cands:
                try:
                    plan = DecodePlan(b, h, hk, d, s, device="cuda", num_splits=ns, config=cfg)
                    t = graph_time_ms(lambda: plan.run(q, kc, vc, cache_seqlens=lens))
                    res[f"N{cfg.BLOCK_N}w{cfg.num_warps}s{cfg.num_stages}/{ns}"] = kv_bytes(b, s, hk, d) / (t * 1e-3) / 1e12
                except Exception as e:  # noqa: BLE001
                    print("fail", cfg, ns, type(e).__name__, str(e)[:150], file=sys.stderr)
        best = max(res, key=res.get)
        row = {"shape": [b, s, h, hk], "heuristic_splits": heur, "tbs": res, "best": best}
        rows.append(row)
        print(f"b{b} s{s} h{h}/{hk} heur={heur} best={best} {res[best]:.2f} TB/s | heur cfg0: "
              f"{res.get(f'N64w4s3/{heur}', 0):.2f} | " +
              " ".join(f"{k}:{v:.2f}" for k, v in sorted(res.items(), key=lambda kv: -kv[1])[:6]), flush=True)
        del q, kc, vc
        torch.cuda.empty_cache()
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
