"""Sweep the decode FFN kernel's tiles on the GPU (Llama-3-8B SwiGLU), CUDA-graph timing."""
import torch

from flashflow.bench.decode import graph_time_ms
from flashflow.ops.ffn import launch_decode
from flashflow.ops.mlp import ACC_OFF, MlpWorkspace

hidden, inter = 4096, 14336
w1 = torch.randn(2 * inter, hidden, dtype=torch.bfloat16, device="cuda") / 64
w2 = torch.randn(hidden, inter, dtype=torch.bfloat16, device="cuda") / 120
wbytes = (w1.numel() + w2.numel()) * 2
cfgs = [None, {"BLOCK_I": 128, "BLOCK_K": 64, "BLOCK_N": 64}, {"num_stages": 4, "BLOCK_K": 64, "BLOCK_N": 64},
        {"BLOCK_I": 32}, {"num_warps": 8}, {"BLOCK_K": 64, "BLOCK_N": 128, "num_stages": 4},
        {"BLOCK_I": 128, "BLOCK_K": 64, "BLOCK_N": 64, "num_warps": 8}]
for m in (1, 4, 16):
    x = torch.randn(m, hidden, dtype=torch.bfloat16, device="cuda")
    ws = MlpWorkspace(hidden, max_tokens=m, device="cuda")
    row = [f"M{m}"]
    for c in cfgs:
        try:
            t = graph_time_ms(lambda: launch_decode(x, w1, w2, "swiglu", ws.buffer[ACC_OFF:ACC_OFF + x.numel()].view(torch.float32).view(x.shape), c), steps=10)
            row.append(f"{c}: {t * 1e3:.1f}us {wbytes / t / 1e9:.2f}TB/s")
        except Exception as e:  # noqa: BLE001
            row.append(f"{c}: {type(e).__name__}")
    print(" | ".join(row), flush=True)
