"""The FP8 linear layer as the benchmarks see it (:mod:`flashflow.ops.fp8_linear`).

Its GEMM is cuBLASLt's (``torch._scaled_mm`` with row-wise scales), no kernel of flashflow's:
``flashflow info`` has nothing to report for it. What flashflow launches is the row quantization
in front of it (:mod:`flashflow.ops.quant`, ``quantize_rows_kernel``), which ``info`` launches
where a Qwen-Image block runs it: ``quantize_rows`` on the 3072-wide rows of the attention output
and the modulation input, ``gelu_quantize_rows`` on the MLP's 12288-wide hidden rows. The op's
config (``fast_accum``, flashflow/tuning/fp8_linear.json) is not swept by ``flashflow tune``:
the fp8-linear suite times the GEMM with either value beside cuBLAS in bf16."""
from __future__ import annotations

from flashflow.bench.spec import InfoCase, OpSpec
from flashflow.tuning.fp8_linear import Fp8LinearConfig

TOKENS = 8192     # Qwen-Image-Edit at 1024px: the image and its reference, 2 × 4096 image tokens
WIDTH, HIDDEN = 3072, 12288


def _launch(device: str, op: str, k: int) -> None:
    import torch

    from flashflow.ops import quant

    make = torch.empty if device == "cpu" else torch.randn   # CPU tensors are never read offline
    x = make(TOKENS, k, device=device, dtype=torch.bfloat16)
    getattr(quant, op)(x)


CASES = (("quantize_rows", WIDTH), ("gelu_quantize_rows", HIDDEN))


def info_cases(family: str | None = None) -> list[InfoCase]:
    """The row-quantize passes in front of the FP8 GEMMs, at a Qwen-Image block's widths; on the
    families with FP8 tensor cores only (those of fp8_linear.json: others get none, their GPUs
    having no e4m3 to write)."""
    from flashflow.tuning.fp8_linear import CONFIGS

    if family is not None and family not in CONFIGS.families():
        return []
    return [InfoCase("fp8-linear", f"{op} M={TOKENS} K={k}", lambda device, op=op, k=k: _launch(device, op, k))
            for op, k in CASES]


SPEC = OpSpec(
    name="fp8-linear",
    info_title=(f"the FP8 linear layer's row quantization (bf16 in, {TOKENS} rows); its GEMM is cuBLASLt's "
                "(torch._scaled_mm), no kernel of flashflow's"),
    info_cases=info_cases,
    suite="fp8-linear",
    config_classes=(Fp8LinearConfig,),
)
