"""The FP8 linear layer as the benchmarks see it (:mod:`flashflow.ops.fp8_linear`).

Its GEMM on quantized rows is cuBLASLt's (``torch._scaled_mm`` with row-wise scales), no kernel of
flashflow's; the row quantization in front of it is the quant spec's. ``flashflow info``
launches the op's own kernel, the few-rows product (``fp8_weight_rows_kernel``), where a
Qwen-Image block runs it: the AdaLN modulation, one time-embedding row of 3072 into 6 · 3072.
The op's config (flashflow/tuning/fp8_linear.json) is not swept by ``flashflow tune``: the
fp8-linear suite times the GEMM with either ``fast_accum`` beside cuBLAS in bf16."""
from __future__ import annotations

from flashflow.bench.spec import InfoCase, OpSpec
from flashflow.tuning.fp8_linear import Fp8LinearConfig

WIDTH = 3072      # Qwen-Image's model width
MODULATION = 6 * WIDTH


def _launch(device: str) -> None:
    import torch

    from flashflow.ops.fp8_linear import Fp8Weight, fp8_linear

    make = torch.empty if device == "cpu" else torch.randn   # CPU tensors are never read offline
    x = make(1, WIDTH, device=device, dtype=torch.bfloat16)
    data = torch.zeros(MODULATION, WIDTH, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    scale = torch.ones(1, MODULATION, device=device)
    fp8_linear(x, Fp8Weight(data, scale, torch.bfloat16), make(MODULATION, device=device, dtype=torch.bfloat16))


def info_cases(family: str | None = None) -> list[InfoCase]:
    """The few-rows kernel at the modulation's shape, on the families with FP8 tensor cores only
    (those of fp8_linear.json: others get none, their GPUs having no e4m3 to read)."""
    from flashflow.tuning.fp8_linear import CONFIGS

    if family is not None and family not in CONFIGS.families():
        return []
    return [InfoCase("fp8-linear", f"fp8_weight_rows M=1 K={WIDTH} N={MODULATION}", _launch)]


SPEC = OpSpec(
    name="fp8-linear",
    info_title=("the FP8 linear layer's few-rows product (bf16 rows, e4m3 weight); its GEMM on quantized rows "
                "is cuBLASLt's (torch._scaled_mm), no kernel of flashflow's"),
    info_cases=info_cases,
    suite="fp8-linear",
    config_classes=(Fp8LinearConfig,),
)
