"""The FP8 row quantization (:mod:`flashflow.ops.quant`) as the benchmarks see it: ``flashflow
info`` launches it at Qwen-Image 1024px's activations (the norms' ``fp8=True`` outputs are the
norm spec's cases). No config table to tune; the qwen-image suite is where the block's FP8
linears run."""
from __future__ import annotations

from flashflow.bench.spec import InfoCase, OpSpec

TOKENS, DIM, MLP_HIDDEN = 4352, 3072, 12288   # Qwen-Image 1024px: 4096 image + 256 text tokens


def _launch(device: str, op: str) -> None:
    import torch

    from flashflow.ops import quant

    make = torch.empty if device == "cpu" else torch.randn
    if op == "quantize_rows":
        quant.quantize_rows(make(1, TOKENS, DIM, device=device, dtype=torch.bfloat16))
    else:
        quant.gelu_quantize_rows(make(1, TOKENS, MLP_HIDDEN, device=device, dtype=torch.bfloat16))


QUANT_OPS = ("quantize_rows", "gelu_quantize_rows")


def info_cases(family: str | None = None) -> list[InfoCase]:
    """quantize_rows at the block's width, gelu_quantize_rows at the MLP's hidden width."""
    return [InfoCase("quant", op, lambda device, op=op: _launch(device, op)) for op in QUANT_OPS]


SPEC = OpSpec(
    name="quant",
    info_title=f"FP8 rows for row-scaled GEMMs (bf16 in, Qwen-Image 1024px: {TOKENS} tokens x {DIM}, "
               f"MLP hidden {MLP_HIDDEN})",
    info_cases=info_cases,
    suite="qwen-image",
)
