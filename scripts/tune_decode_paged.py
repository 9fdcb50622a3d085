"""Paged vs contiguous decode, cold caches: tile and pipeline depth (TB/s of KV read).

The same values as a contiguous cache and as 64-token pages behind a shuffled block table, timed
in one run as CUDA-graph replays; caches under three L2s are cloned and the steps cycle through
the clones (as the bench suite does). Every config is checked against the contiguous default.

Keys: ``contig``/``paged`` are what the library picks (DecodePlan's defaults); ``c:``/``p:``
keys are explicit configs ``BLOCK_N x stages``.

Usage (device): PYTHONPATH=. python scripts/tune_decode_paged.py [--json OUT] [--quick]
"""
import argparse
import json
from datetime import datetime, timezone

import torch
import triton

from flashflow.bench.decode import PAGE_SIZE, cycling, graph_time_ms, kv_bytes, paged_copy, rotation
from flashflow.ops.decode import DecodeConfig, DecodePlan

# (batch, seqlen, heads, kv_heads): the paged rows, then contiguous no-regression rows
SHAPES = [(64, 4096, 32, 8), (64, 8192, 32, 8), (64, 32768, 32, 8), (16, 4096, 32, 32), (16, 8192, 32, 32),
          (4, 8192, 32, 8), (1, 8192, 32, 8), (16, 4096, 32, 8), (64, 1024, 32, 8), (16, 512, 32, 8),
          (1, 32768, 32, 8)]
QUICK = SHAPES[:7]


def candidates():
    """Explicit configs timed beside the defaults: paged tiles of one page at 3-5 stages, and
    128-token tiles over two pages (rows gathered, the table entries through a pipeline stage)."""
    contig = {"c:64x3": DecodeConfig(64, 4, 3), "c:64x4": DecodeConfig(64, 4, 4), "c:128x3": DecodeConfig(128, 4, 3)}
    paged = {"p:64x3": DecodeConfig(64, 4, 3), "p:64x4": DecodeConfig(64, 4, 4), "p:64x5": DecodeConfig(64, 4, 5),
             "p:128x5": DecodeConfig(128, 4, 5)}
    return contig, paged


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="the paged rows only")
    ap.add_argument("--defaults-only", action="store_true", help="time the library's picks only")
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for (b, s, h, hk) in (QUICK if args.quick else SHAPES):
        d = 128
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        kp, vp, table = paged_copy(kc, vc, PAGE_SIZE, generator=g)
        nbytes = kv_bytes(b, s, hk, d)
        copies = rotation(nbytes, l2)
        kv = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(copies - 1)]
        pages = [(kp, vp)] + [(kp.clone(), vp.clone()) for _ in range(copies - 1)]

        def contiguous(plan):
            return cycling(lambda i: lambda: plan.run(q, *kv[i], cache_seqlens=lens), copies)

        def paged(plan):
            return cycling(lambda i: lambda: plan.run(q, *pages[i], cache_seqlens=lens, block_table=table), copies)

        heur = DecodePlan(b, h, hk, d, s, device="cuda")
        ref = heur.run(q, kc, vc, cache_seqlens=lens).float()
        contig_cfg, paged_cfg = ({}, {}) if args.defaults_only else candidates()
        row = {"shape": [b, s, h, hk], "copies": copies, "num_splits": heur.num_splits,
               "contig_config": heur.config.__dict__, "tbs": {}, "rel_err": {}}
        timed = [("contig", heur, contiguous), ("paged", heur, paged)]
        timed += [(k, DecodePlan(b, h, hk, d, s, device="cuda", config=c, num_splits=heur.num_splits), contiguous)
                  for k, c in contig_cfg.items()]
        timed += [(k, DecodePlan(b, h, hk, d, s, device="cuda", config=c, num_splits=heur.num_splits), paged)
                  for k, c in paged_cfg.items()]
        for key, plan, how in timed:
            fn = how(plan)
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (key, err)
            row["rel_err"][key] = err
            row["tbs"][key] = nbytes / graph_time_ms(fn) / 1e9
        t = row["tbs"]
        row["paged_over_contig"] = t["paged"] / t["contig"]
        rows.append(row)
        print(f"b{b} s{s} {h}/{hk} splits {heur.num_splits}: " + " ".join(f"{k} {v:.3f}" for k, v in t.items())
              + f" | paged/contig {row['paged_over_contig']:.3f}", flush=True)
        del q, kc, vc, kp, vp, kv, pages, ref
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "cuda": torch.version.cuda,
                       "date": datetime.now(timezone.utc).isoformat(), "page_size": PAGE_SIZE,
                       "dtype": "bfloat16", "head_dim": 128, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
