"""GPU correctness check of flashflow attention: bf16/fp16 against float64, every feature.

Usage (on the device): python scripts/gpu_check.py [--json OUT]
Each case draws fresh random inputs, poisons the output buffer with NaN through the
``out=`` path, and compares ‖out − ref‖/‖ref‖ against the float64 reference. Also checks
torch.compile(fullgraph=True) and CUDA-graph capture/replay. Exits 1 if any case fails.
"""
from __future__ import annotations

import argparse
import time

import torch

from gpu_cases import Cases

import flashflow
from flashflow.bench.decode import capture_graph
from flashflow.ops.attention import attention_forward
from flashflow.reference import attention_naive, attention_varlen_naive

TOL = 1e-2
_cases = Cases(TOL)
rel, record, results = _cases.rel, _cases.record, _cases.results


def dense_case(dtype, b, sq, sk, h, hk, d, causal=False, window=(-1, -1), softcap=0.0, strided=False):
    g = torch.Generator(device="cuda").manual_seed(int(time.time_ns()) % (2**31))
    if strided:  # SDPA-style (b, h, s, d) storage seen through a transpose
        q = torch.randn(b, h, sq, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
        k = torch.randn(b, hk, sk, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
        v = torch.randn(b, hk, sk, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    else:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    left, right = window
    if causal:
        right = 0
    attention_forward(q, k, v, softmax_scale=d ** -0.5, window_left=left if left >= 0 else None,
                      window_right=right if right >= 0 else None, softcap=softcap, out=out,
                      heavy_first=causal)
    o2, lse = flashflow.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                        return_lse=True)
    ro, rl = attention_naive(q.double(), k.double(), v.double(), causal=causal, window_size=window,
                             softcap=softcap, return_lse=True)
    name = (f"{str(dtype)[6:]} b{b} sq{sq} sk{sk} h{h}/{hk} d{d} causal={causal} win={window} "
            f"softcap={softcap} strided={strided}")
    err = max(rel(out, ro), rel(o2, ro))
    fin = torch.isfinite(rl)
    lse_err = (lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    ok = err <= TOL and not torch.isnan(out).any().item() and lse_err < 1e-2 and \
        bool((torch.isinf(lse) == torch.isinf(rl)).all())
    record(name, err, ok)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype in (torch.bfloat16, torch.float16):
        dense_case(dtype, 2, 1000, 1000, 8, 8, 128)
        dense_case(dtype, 1, 4352, 4352, 4, 4, 128)
        dense_case(dtype, 2, 777, 777, 6, 2, 64, causal=True)
        dense_case(dtype, 1, 300, 1200, 8, 1, 128, causal=True)          # MQA, sq < sk
        dense_case(dtype, 1, 1200, 300, 8, 4, 96, causal=True)           # sq > sk: empty rows
        dense_case(dtype, 2, 513, 513, 4, 4, 80, window=(100, 37))
        dense_case(dtype, 2, 1025, 1025, 4, 2, 128, causal=True, window=(256, -1))
        dense_case(dtype, 1, 640, 640, 4, 4, 256, softcap=30.0)
        dense_case(dtype, 1, 640, 640, 4, 4, 32, causal=True, softcap=15.0)
        dense_case(dtype, 1, 1, 1, 2, 2, 64)
        dense_case(dtype, 3, 77, 301, 4, 4, 128, strided=True)
        dense_case(dtype, 2, 1111, 1111, 8, 2, 128, causal=True, strided=True)
        # varlen
        lens_q = [1, 17, 1000, 300]
        lens_k = [1, 40, 1000, 333]
        cq = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        ck = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        for causal in (False, True):
            q = torch.randn(sum(lens_q), 8, 128, device="cuda", dtype=dtype)
            k = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=dtype)
            v = torch.randn_like(k)
            o, l = flashflow.flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal,
                                                    return_lse=True)
            ro, rl = attention_varlen_naive(q.double(), k.double(), v.double(), cq, ck, causal=causal,
                                            return_lse=True)
            record(f"{str(dtype)[6:]} varlen causal={causal}", rel(o, ro))
        # SDPA API: key padding mask, float mask, top-left causal, GQA
        q = torch.randn(2, 8, 333, 128, device="cuda", dtype=dtype)
        k = torch.randn(2, 2, 450, 128, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        kpm = torch.rand(2, 1, 1, 450, device="cuda") > 0.3
        o = flashflow.scaled_dot_product_attention(q, k, v, attn_mask=kpm, enable_gqa=True)
        r = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=kpm,
                                                             enable_gqa=True)
        record(f"{str(dtype)[6:]} sdpa bool mask gqa", rel(o, r))
        fm = torch.randn(1, 8, 333, 450, device="cuda", dtype=dtype)
        o = flashflow.scaled_dot_product_attention(q, k, v, attn_mask=fm, enable_gqa=True)
        r = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                             attn_mask=fm.double(), enable_gqa=True)
        record(f"{str(dtype)[6:]} sdpa float mask", rel(o, r))
        o = flashflow.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        r = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                             enable_gqa=True)
        record(f"{str(dtype)[6:]} sdpa causal top-left", rel(o, r))

    # torch.compile(fullgraph=True) and CUDA graphs
    q = torch.randn(2, 512, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 512, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ref = flashflow.flash_attn_func(q, k, v, causal=True)

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        return flashflow.flash_attn_func(q * 1.0, k, v, causal=True) + 0

    try:
        record("torch.compile fullgraph", rel(f(q, k, v), ref.double()), None)
    except Exception as e:  # noqa: BLE001
        print("compile failed:", type(e).__name__, str(e)[:500])
        record("torch.compile fullgraph", float("inf"), False)
    graph, static_out = capture_graph(lambda: flashflow.flash_attn_func(q, k, v, causal=True))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    record("cuda graph replay", rel(static_out, attention_naive(q.double(), k.double(), v.double(), causal=True)))

    _cases.finish("GPU correctness cases", args.json)


if __name__ == "__main__":
    main()
