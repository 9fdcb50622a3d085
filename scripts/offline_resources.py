"""Registers, spills and shared memory of the decode-attention and fused-FFN kernels, compiled
for the H100 (sm90) on this machine, GPU or not (flashflow.tuning.offline). Nothing runs.

Usage (TRITON_INTERPRET unset):
    PYTHONPATH=. python scripts/offline_resources.py            # a table
    PYTHONPATH=. python scripts/offline_resources.py --json F   # and the rows as JSON

Rows: the decode-attention step of the suite's small-batch shapes (through the public op, so
the shipped sm90 config and split count); the FFN decode kernel through its launcher (the
configs `ops.ffn.decode_config` gives on the H100); the prefill kernel's shipped configs and the
candidates of `scripts/gpu_verify.sh mlp-small`. A row "over" the 227 KB limit would not load.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def decode_rows():
    import torch

    from flashflow.ops.decode import DecodePlan, flash_attn_with_kvcache
    from flashflow.tuning.offline import compile_offline, pretend_cuda_capability

    rows = []
    for batch, seqlen, kv_heads, page, pdl in ((1, 8192, 8, None, None), (1, 8192, 8, None, True),
                                               (1, 32768, 8, None, None), (64, 4096, 8, None, None),
                                               (16, 4096, 8, 64, None)):
        q = torch.empty(batch, 1, 32, 128, dtype=torch.bfloat16)
        if page:
            kc = torch.empty(batch * seqlen // page, page, kv_heads, 128, dtype=torch.bfloat16)
            table = torch.arange(batch * seqlen // page, dtype=torch.int32).view(batch, -1)
        else:
            kc, table = torch.empty(batch, seqlen, kv_heads, 128, dtype=torch.bfloat16), None
        with pretend_cuda_capability():
            found = compile_offline(lambda: flash_attn_with_kvcache(q, kc, kc, cache_seqlens=seqlen,
                                                                    block_table=table, pdl=pdl))
        rows += [(f"decode b{batch} s{seqlen} hk{kv_heads}" + (f" page {page}" if page else "")
                  + (" pdl" if pdl else ""), r) for r in found]
    # the split merge: the row merge (shipped) against the wide one, batch 1 × 8k GQA, head_dim
    # 128 and 256, one query token and four (16 rows: the wide merge in chunks)
    for d, seqlen_q in ((128, 1), (128, 4), (256, 1)):
        q = torch.empty(1, seqlen_q, 32, d, dtype=torch.bfloat16)
        kc = torch.empty(1, 8192, 8, d, dtype=torch.bfloat16)
        for merge in ("rows", "wide"):
            with pretend_cuda_capability():
                plan = DecodePlan(1, 32, 8, d, 8192, seqlen_q=seqlen_q, device="cpu", merge=merge)
                found = compile_offline(lambda: plan.run(q, kc, kc, cache_seqlens=8192))
            rows += [(f"decode b1 s8192 hk8 d{d} sq{seqlen_q} {plan.num_splits} splits merge={merge}", r)
                     for r in found]
    return rows


def ffn_decode_rows():
    import torch

    from flashflow.ops.ffn import decode_config, launch_decode
    from flashflow.tuning.offline import compile_offline, pretend_cuda_capability

    rows = []
    # the shipped configs, then the grouped split-K candidates of scripts/tune_ffn.py (g2, g4n32)
    for name, hidden, inter, m, extra in (("llama3-8b", 4096, 14336, 16, None), ("llama3-8b", 4096, 14336, 64, None),
                                          ("llama3-70b", 8192, 28672, 16, None),
                                          ("llama3-8b", 4096, 14336, 16, {"group": 2, "BLOCK_N": 64}),
                                          ("llama3-8b", 4096, 14336, 16, {"group": 4, "BLOCK_N": 32}),
                                          ("llama3-70b", 8192, 28672, 16, {"group": 2, "BLOCK_N": 64})):
        x = torch.empty(m, hidden, dtype=torch.bfloat16)
        w1 = torch.empty(2 * inter, hidden, dtype=torch.bfloat16)
        w2 = torch.empty(hidden, inter, dtype=torch.bfloat16)
        acc = torch.zeros(m, hidden)
        with pretend_cuda_capability():   # decode_config as on the H100 (132 SMs)
            width = decode_config(m, inter, True, x.device)["BLOCK_I"]
            found = compile_offline(lambda: launch_decode(x, w1, w2, "swiglu", acc, extra))
        label = f"ffn decode {name} M={m} {width}-wide" + (
            f" group {extra['group']} n{extra['BLOCK_N']}" if extra else "")
        rows += [(label, r) for r in found]
    return rows


def ffn_prefill_rows():
    import torch

    from flashflow.ops import mlp
    from flashflow.tuning.offline import compile_offline, pretend_cuda_capability

    P = mlp.PersistentConfig
    cases = [
        ("shipped gated M>512", True, 1024, mlp.persistent_config_for(True, (9, 0), 1024), "multirow"),
        ("shipped gated M<=512", True, 256, mlp.persistent_config_for(True, (9, 0), 256), "seqsplit"),
        ("shipped gelu M>512", False, 1024, mlp.persistent_config_for(False, (9, 0), 1024), "multirow"),
        ("shipped gelu M<=512", False, 256, mlp.persistent_config_for(False, (9, 0), 256), "seqsplit"),
        ("candidate gelu tma5m64", False, 64, P(64, 128, 128, 64, 8, 5, use_tma=True), "seqsplit"),
        ("candidate gelu tma4m64w4 (2/SM)", False, 64, P(64, 128, 128, 64, 4, 4, programs_per_sm=2, use_tma=True),
         "seqsplit"),
        ("candidate gated tma5m64", True, 64, P(64, 128, 128, 64, 8, 5, use_tma=True), "seqsplit"),
    ]
    hidden, inter, rows = 4096, 14336, []
    for name, gated, m, cfg, policy in cases:
        x = torch.empty(m, hidden, dtype=torch.bfloat16)
        w1 = torch.empty((2 if gated else 1) * inter, hidden, dtype=torch.bfloat16)
        w2 = torch.empty(hidden, inter, dtype=torch.bfloat16)
        ws = mlp.MlpWorkspace(hidden, max_tokens=m, device="cpu")
        with pretend_cuda_capability():
            found = compile_offline(lambda: mlp.launch_persistent(x, w1, w2, "swiglu" if gated else "gelu", policy,
                                                                  8, workspace=ws, config=cfg))
        label = (f"{name}: {cfg.BLOCK_M}x{cfg.BLOCK_N0}/{cfg.BLOCK_N1} {cfg.num_warps}w {cfg.num_stages}st "
                 f"{policy} M={m}")
        rows += [(label, r) for r in found]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    rows = decode_rows() + ffn_decode_rows() + ffn_prefill_rows()
    width = max(len(label) for label, _ in rows)
    print(f"{'case':<{width}}  kernel                     regs  local B  smem KB  fits")
    for label, r in rows:
        print(f"{label:<{width}}  {r.name:<25} {r.registers:>5} {r.spill_bytes:>8} {r.shared / 1024:>8.1f}  "
              f"{'yes' if r.fits() else 'NO'}")
    if args.json:
        import time

        import torch
        import triton

        Path(args.json).write_text(json.dumps(dict(
            suite="offline-resources", target="sm90 (compiled on a machine without a GPU; nothing run)",
            triton=triton.__version__, torch=torch.__version__,
            date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            rows=[dict(case=label, kernel=r.name, registers=r.registers, local_bytes=r.spill_bytes, shared=r.shared,
                       num_warps=r.num_warps, num_stages=r.num_stages) for label, r in rows]), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
