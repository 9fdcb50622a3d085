"""Decode split counts × tiles, contiguous and paged (64-token pages, shuffled), beside
SDPA-cuDNN, all timed as CUDA-graph replays in one run (TB/s of KV read). Caches under three
L2s are cloned and the steps cycle through the clones, as in the bench suite.

Usage (device): PYTHONPATH=. python scripts/tune_decode_splits.py [--set small|large] [--merge rows|wide]
                [--json OUT]
  small: batch 1-4, where the split count matters; large: batch 16-64 with one split, where
  the pipeline depth (and so programs per SM) matters. ``--merge``: the split merge of every
  plan (a cheaper merge may move the best split count up).
"""
import argparse
import json
from datetime import datetime, timezone

import torch
import triton

from flashflow.bench.decode import PAGE_SIZE, cycling, graph_time_ms, kv_bytes, paged_copy, rotation
from flashflow.ops.decode import DecodeConfig, DecodePlan

SETS = {
    "small": dict(shapes=[(1, 4096, 32, 8), (1, 8192, 32, 8), (1, 16384, 32, 8), (1, 32768, 32, 8)],
                  splits=(8, 12, 16, 24, 32),
                  contig=[DecodeConfig(64, 4, 3), DecodeConfig(128, 4, 3), DecodeConfig(128, 4, 4)],
                  paged=[None, DecodeConfig(128, 4, 3)]),
    "large": dict(shapes=[(16, 512, 32, 8), (4, 512, 32, 32), (64, 1024, 32, 8), (16, 4096, 32, 8),
                          (64, 8192, 32, 8), (64, 32768, 32, 8), (16, 8192, 32, 32), (16, 32768, 32, 32)],
                  splits=(1, 2),
                  contig=[DecodeConfig(64, 4, 3), DecodeConfig(64, 4, 4), DecodeConfig(64, 4, 5),
                          DecodeConfig(128, 4, 3), DecodeConfig(32, 4, 6)],
                  paged=[None]),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", choices=sorted(SETS), default="small")
    ap.add_argument("--merge", choices=("rows", "wide"), default=None)
    args = ap.parse_args()
    sweep = SETS[args.set]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = []
    for (b, s, h, hk) in sweep["shapes"]:
        d = 128
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        kp, vp, table = paged_copy(kc, vc, PAGE_SIZE)
        nbytes = kv_bytes(b, s, hk, d)
        copies = rotation(nbytes, l2)
        kv = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(copies - 1)]
        pages = [(kp, vp)] + [(kp.clone(), vp.clone()) for _ in range(copies - 1)]
        row = {"shape": [b, s, h, hk], "copies": copies, "tbs": {}}
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kvt = [(kt, vt)] + [(kt.clone(), vt.clone()) for _ in range(copies - 1)]

        def cudnn(i):
            def step():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(qt, *kvt[i], enable_gqa=h != hk)
            return step
        row["tbs"]["cudnn"] = nbytes / graph_time_ms(cycling(cudnn, copies)) / 1e9
        heur = DecodePlan(b, h, hk, d, s, device="cuda", merge=args.merge)

        def contiguous(plan):
            return cycling(lambda i: lambda: plan.run(q, *kv[i], cache_seqlens=lens), copies)

        def paged(plan):
            return cycling(lambda i: lambda: plan.run(q, *pages[i], cache_seqlens=lens, block_table=table), copies)
        row["heuristic"] = [heur.num_splits, heur.config.BLOCK_N]
        row["tbs"]["heuristic"] = nbytes / graph_time_ms(contiguous(heur)) / 1e9
        row["tbs"]["heuristic-paged"] = nbytes / graph_time_ms(paged(heur)) / 1e9
        ref = heur.run(q, kc, vc, cache_seqlens=lens).float()
        for splits in sorted({*sweep["splits"], heur.num_splits}):
            for name, cfgs, is_paged in (("c", sweep["contig"], False), ("p", sweep["paged"], True)):
                for cfg in cfgs:
                    plan = DecodePlan(b, h, hk, d, s, device="cuda", config=cfg, num_splits=splits, merge=args.merge)
                    fn = paged(plan) if is_paged else contiguous(plan)
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
        del q, kc, vc, kp, vp, kt, vt, kv, pages, kvt
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "merge": heur.merge,
                       "triton": triton.__version__, "date": datetime.now(timezone.utc).isoformat(),
                       "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
