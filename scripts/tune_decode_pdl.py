"""Decode with and without programmatic dependent launch (PDL), and with the row or the wide
split merge, timed in one run.

Variants: ``off`` (what ships: stream order, row merge), ``pdl``, ``wide`` (the last arriver
merges over a (split, row, dim) tile, its loads in one round), ``wide+pdl``. Two settings, each
as CUDA-graph replays (medians; the variants interleaved over ``--rounds`` rounds so clock drift
hits all alike; caches under three L2s cycle through clones, as in the bench suite):

* ``steps``: 16 decode steps back to back (what `flashflow bench --suite decode` times): with
  PDL a step's grid is placed while the previous step merges and exits;
* ``layer``: 16 × (q/k/v projection by torch, decode, output projection by torch), batch × 4096
  hidden: the decode launch then depends on a cuBLAS kernel, and only gains where that kernel
  releases its dependents early.

Each PDL output is compared with its plain launch's, bit for bit (same kernel, same order of
operations); the wide merge's with the row merge's, to 1e-3 relative (sums in another order).
SDPA-cuDNN is timed once per shape in the same run for scale.

Usage (device): PYTHONPATH=. python scripts/tune_decode_pdl.py [--rounds 3] [--json OUT]
"""
import argparse
import json
import statistics
from datetime import datetime, timezone

import torch
import triton

from flashflow.bench.decode import PAGE_SIZE, cycling, graph_time_ms, kv_bytes, paged_copy, rotation
from flashflow.ops.decode import DecodePlan

VARIANTS = {"off": (False, "rows"), "pdl": (True, "rows"), "wide": (False, "wide"), "wide+pdl": (True, "wide")}

SHAPES = [  # batch, seqlen, heads, kv_heads, paged
    (1, 512, 32, 8, False), (1, 1024, 32, 8, False), (1, 4096, 32, 8, False), (1, 8192, 32, 8, False),
    (1, 8192, 32, 8, True), (1, 16384, 32, 8, False), (1, 32768, 32, 8, False), (4, 1024, 32, 8, False),
    (16, 512, 32, 8, False), (1, 1024, 32, 32, False), (64, 4096, 32, 8, False),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for (b, s, h, hk, paged) in SHAPES:
        d, dt = 128, torch.bfloat16
        q = torch.randn(b, 1, h, d, device="cuda", dtype=dt)
        kc = torch.randn(b, s, hk, d, device="cuda", dtype=dt)
        vc = torch.randn_like(kc)
        lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        table = None
        if paged:
            kc, vc, table = paged_copy(kc, vc, PAGE_SIZE)
        nbytes = kv_bytes(b, s, hk, d)
        copies = rotation(nbytes, l2)
        kv = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(copies - 1)]
        plans = {v: DecodePlan(b, h, hk, d, s, device="cuda", pdl=pdl, merge=merge)
                 for v, (pdl, merge) in VARIANTS.items()}
        assert plans["pdl"].pdl, "PDL needs sm90+"

        def step(plan, i):
            return plan.run(q, *kv[i], cache_seqlens=lens, block_table=table)

        outs = {v: step(p, 0).clone() for v, p in plans.items()}
        same = torch.equal(outs["off"], outs["pdl"]) and torch.equal(outs["wide"], outs["wide+pdl"])
        wide_rel = ((outs["wide"].float() - outs["off"].float()).norm() / outs["off"].float().norm()).item()

        # a decoder layer's attention part: projections by torch around the decode
        x = torch.randn(b, 4096, device="cuda", dtype=dt)
        w_qkv = torch.randn((h + 2 * hk) * d, 4096, device="cuda", dtype=dt) * 0.02
        w_o = torch.randn(4096, h * d, device="cuda", dtype=dt) * 0.02

        def layer(plan, i):
            qkv = torch.nn.functional.linear(x, w_qkv)
            qq = qkv[:, :h * d].view(b, 1, h, d)
            o = plan.run(qq, *kv[i], cache_seqlens=lens, block_table=table)
            return torch.nn.functional.linear(o.view(b, h * d), w_o)

        row = {"shape": [b, s, h, hk], "paged": paged, "kv_mbytes": nbytes / 1e6, "copies": copies,
               "num_splits": plans["off"].num_splits, "merge_chunk": plans["wide"].merge_chunk,
               "bitwise_equal": same, "wide_rel": wide_rel, "us": {}}
        times = {f"{k}/{v}": [] for k in ("steps", "layer") for v in VARIANTS}
        for _ in range(args.rounds):
            for tag, p in plans.items():
                times[f"steps/{tag}"].append(graph_time_ms(cycling(lambda i, p=p: lambda: step(p, i), copies)))
                times[f"layer/{tag}"].append(graph_time_ms(cycling(lambda i, p=p: lambda: layer(p, i), copies)))
        for k, v in times.items():
            row["us"][k] = statistics.median(v) * 1e3
        if not paged:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            qt = q.transpose(1, 2)
            kvt = [(k_.transpose(1, 2).contiguous(), v_.transpose(1, 2).contiguous()) for k_, v_ in kv]

            def cudnn(i):
                def run():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(qt, *kvt[i], enable_gqa=h != hk)
                return run
            row["us"]["cudnn"] = graph_time_ms(cycling(cudnn, copies)) * 1e3
            del kvt
        u = row["us"]
        row["tbs"] = {k: nbytes / (v * 1e-6) / 1e12 for k, v in u.items() if not k.startswith("layer")}
        print(f"b{b} s{s} {h}/{hk}{' paged' if paged else ''} splits {row['num_splits']}: steps us "
              + ", ".join(f"{v} {u['steps/' + v]:.1f}" for v in VARIANTS) + "; layer us "
              + ", ".join(f"{v} {u['layer/' + v]:.1f}" for v in VARIANTS)
              + (f"; cuDNN {u['cudnn']:.1f}" if "cudnn" in u else "")
              + ("" if same else "  PDL OUTPUTS DIFFER") + ("" if wide_rel < 1e-3 else f"  WIDE REL {wide_rel:.1e}"),
              flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": "tune-decode-pdl", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "date": datetime.now(timezone.utc).isoformat(),
                       "rounds": args.rounds, "rows": rows}, f, indent=1)
    print("\n| batch | seqlen | q/kv | paged | splits | steps µs: " + " | ".join(VARIANTS) + " | TB/s: "
          + " | ".join(VARIANTS) + " | cuDNN TB/s | layer µs: " + " | ".join(VARIANTS) + " |")
    print("|--:|--:|:--|:--|--:|" + "--:|" * (3 * len(VARIANTS) + 1))
    for r in rows:
        u, t = r["us"], r["tbs"]
        print(f"| {r['shape'][0]} | {r['shape'][1]} | {r['shape'][2]}/{r['shape'][3]} | {'yes' if r['paged'] else ''} | "
              f"{r['num_splits']} | " + " | ".join(f"{u['steps/' + v]:.1f}" for v in VARIANTS) + " | "
              + " | ".join(f"{t['steps/' + v]:.2f}" for v in VARIANTS) + f" | {t.get('cudnn', float('nan')):.2f} | "
              + " | ".join(f"{u['layer/' + v]:.1f}" for v in VARIANTS) + " |")


if __name__ == "__main__":
    main()
