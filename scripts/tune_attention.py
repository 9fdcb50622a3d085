"""Sweep forward-attention configs on the GPU beside SDPA-cuDNN / SDPA-FLASH (one run).

Usage (on the device): python scripts/tune_attention.py [--quick] [--json OUT.json]
Prints, per shape, TFLOP/s of every config and of the anchors, then the best config per shape.
Also prints registers/spills/shared memory of every config it compiled.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashflow.ops.attention import attention_forward
from flashflow.kernels.attention_fwd import attention_fwd_kernel
from flashflow.tuning import AttentionConfig


def flops(b, h, sq, sk, d, causal):
    f = 4 * b * h * sq * sk * d
    return f / 2 if causal else f


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="qwen,sweep")
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--causal", default="0")
    ap.add_argument("--configs", default=None, help="semicolon list BM,BN,W,S,tma,ws[,maxnreg]")
    args = ap.parse_args()
    dtype = torch.bfloat16
    shapes = []
    for d in [int(x) for x in args.head_dims.split(",")]:
        for c in [bool(int(x)) for x in args.causal.split(",")]:
            if "qwen" in args.shapes:
                shapes += [(1, 24, 4352, d, c), (1, 24, 8448, d, c)]
            if "sweep" in args.shapes:
                for s in ([2048, 8192] if args.quick else [1024, 2048, 4096, 8192, 16384]):
                    shapes.append((16384 // s, 2048 // d, s, d, c))
    if args.configs:
        configs = []
        for item in args.configs.split(";"):
            p = [int(x) for x in item.split(",")]
            # BM,BN,warps,stages,load(0 ptr/1 device desc/2 host desc),ws,tail[,maxnreg]
            configs.append(AttentionConfig(p[0], p[1], p[2], p[3], use_tma=p[4] > 0, host_desc=p[4] == 2,
                                           warp_specialize=bool(p[5]), tail_split=bool(p[6]),
                                           maxnreg=p[7] if len(p) > 7 else None))
    else:
        configs = [AttentionConfig(bm, bn, w, s, tma, ws)
                   for bm, bn, w, s, tma, ws in [
                       (128, 128, 8, 2, True, False), (128, 128, 8, 3, True, False),
                       (128, 64, 8, 3, True, False), (128, 64, 4, 3, True, False),
                       (128, 128, 8, 2, False, False), (128, 128, 8, 2, True, True),
                       (128, 128, 8, 3, True, True), (64, 128, 4, 3, True, False)]]
    rows = []
    res_report = {}
    for (b, h, s, d, causal) in shapes:
        q = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
        k = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
        v = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
        fl = flops(b, h, s, s, d, causal)
        row = {"shape": [b, h, s, d, causal], "tflops": {}}
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        ref = None
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                def fn(be=be):
                    with sdpa_kernel(be):
                        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                ref = fn().transpose(1, 2)
                row["tflops"][name] = fl / bench(fn) * 1e-9
            except Exception as e:  # noqa: BLE001
                row["tflops"][name] = None
                print(f"{name} failed at {row['shape']}: {str(e)[:100]}", file=sys.stderr)
        for cfg in configs:
            mode = ("H" if cfg.host_desc else "D") if cfg.use_tma else "P"
            key = (f"{cfg.BLOCK_M}x{cfg.BLOCK_N}w{cfg.num_warps}s{cfg.num_stages}{mode}"
                   f"{'ws' if cfg.warp_specialize else ''}{'t' if cfg.tail_split else ''}"
                   f"{'r%d' % cfg.maxnreg if cfg.maxnreg else ''}")
            try:
                fn = lambda cfg=cfg: attention_forward(q, k, v, softmax_scale=d ** -0.5,
                                                       window_right=0 if causal else None,
                                                       return_lse=False, heavy_first=causal, config=cfg)
                out = fn()[0]
                err = None
                if ref is not None:
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                t = bench(fn)
                row["tflops"][key] = fl / t * 1e-9
                if err is not None and err > 1e-2:
                    print(f"BAD ERROR {key} {row['shape']}: {err}", file=sys.stderr)
                    row["tflops"][key] = -1
            except Exception as e:  # noqa: BLE001
                row["tflops"][key] = None
                print(f"{key} failed at {row['shape']}: {type(e).__name__} {str(e)[:200]}", file=sys.stderr)
        rows.append(row)
        print(json.dumps(row), flush=True)
    # resource report of the compiled variants
    for dev_cache in attention_fwd_kernel.device_caches.values():
        cache = dev_cache[0]
        for key, k in cache.items():
            try:
                md = k.metadata
                name = f"w{md.num_warps}s{md.num_stages}"
                consts = {kk: vv for kk, vv in (k.src.constants.items() if hasattr(k.src, 'constants') else [])}
                res_report[str(len(res_report))] = dict(regs=k.n_regs, spills=k.n_spills, shared=md.shared, cfg=name,
                                                        consts={str(a): str(b) for a, b in consts.items()})
            except Exception as e:  # noqa: BLE001
                print("report failed", e)
    for r in res_report.values():
        print("RES", r["cfg"], "regs", r["regs"], "spills", r["spills"], "smem", r["shared"],
              {k: v for k, v in r["consts"].items() if any(x in k for x in ("BLOCK", "HEAD_DIM", "USE_TMA", "WARP", "HAS_RIGHT"))})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "rows": rows, "resources": list(res_report.values())}, f, indent=1)
    keys = list(rows[0]["tflops"].keys())
    print("shape".ljust(24) + "".join(k[:14].rjust(15) for k in keys))
    for r in rows:
        print(str(r["shape"]).ljust(24) + "".join(
            (f"{r['tflops'][k]:.0f}" if r["tflops"][k] is not None else "-").rjust(15) for k in keys))


if __name__ == "__main__":
    main()
