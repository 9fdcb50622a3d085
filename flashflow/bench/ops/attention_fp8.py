"""FP8 attention as the benchmarks see it: the 8-bit forward and its quantize kernels at each
head_dim it takes for ``flashflow info``, and the call, quantize pass included, against SDPA
(cuDNN) in bf16 for ``flashflow tune`` (the attention suite's shapes at those head dims)."""
from __future__ import annotations

import dataclasses

from flashflow.bench.ops import attention
from flashflow.bench.ops.attention import BATCH, HEADS, SEQLEN
from flashflow.bench.spec import InfoCase, NotApplicable, OpSpec, TuneCase, replace_fields, same_as_shipped
from flashflow.tuning.attention_fp8 import AttentionFp8Config

PLAN_OPTIONS = ("qk_format",)


# ----------------------------------------------------------------------------- info


def _forward(device: str, head_dim: int, causal: bool) -> None:
    import torch

    from flashflow import flash_attn_fp8_func

    make = torch.empty if device == "cpu" else torch.randn
    q, k, v = (make(BATCH, SEQLEN, HEADS, head_dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    flash_attn_fp8_func(q, k, v, causal=causal)


def _gluon_forward(device: str) -> None:
    """The Gluon FP8 forward (Hopper; no op dispatches it) at head_dim 128 with its best measured
    config (docs/fp8.md); its quantize pass's kernels launch too."""
    import torch

    from flashflow.ops.attention_fp8 import attention_fp8_gluon_forward

    d = 128
    make = torch.empty if device == "cpu" else torch.randn
    q, k, v = (make(BATCH, SEQLEN, HEADS, d, device=device, dtype=torch.bfloat16) for _ in range(3))
    attention_fp8_gluon_forward(q, k, v, d ** -0.5)


def info_cases(family: str | None) -> list[InfoCase]:
    """FP8 attention and its quantize pass (K/V statistics, quantize, the 8-bit forward) at each
    head_dim it takes, causal and not; Hopper and newer only (other families: none). On Hopper
    also the Gluon forward (``gluon d128``), which no op dispatches."""
    from flashflow.ops.attention_fp8 import FP8_HEAD_DIMS
    from flashflow.tuning.attention_fp8 import supported_families

    if family is not None and family not in supported_families():
        return []
    cases = [InfoCase("attention-fp8", f"d{d}{' causal' if causal else ''}",
                      lambda device, d=d, causal=causal: _forward(device, d, causal))
             for d in FP8_HEAD_DIMS for causal in (False, True)]
    if family in (None, "sm90"):   # the Gluon kernel is written for Hopper only
        cases.append(InfoCase("attention-fp8", "gluon d128", _gluon_forward))
    return cases


# ----------------------------------------------------------------------------- tune


def tune_shapes(args):
    from flashflow.ops.attention_fp8 import FP8_HEAD_DIMS

    return [s for s in attention.tune_shapes(args) if s.head_dim in FP8_HEAD_DIMS]


def tune_case(s, args) -> TuneCase:
    """The FP8 forward, its quantize pass included, against SDPA (cuDNN) in bf16."""
    import torch

    from flashflow.bench.providers import sdpa_anchor
    from flashflow.device import gpu_family
    from flashflow.ops.attention_fp8 import attention_fp8_forward, flash_attn_fp8_func
    from flashflow.tuning.attention_fp8 import attention_fp8_config

    q, k, v = (torch.randn(s.batch, n, s.heads, s.head_dim, device="cuda", dtype=torch.bfloat16)
               for n in (s.seqlen_q, s.seqlen_k, s.seqlen_k))
    anchor = sdpa_anchor(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), s.causal)
    base = attention_fp8_config(s.head_dim, s.causal, gpu_family(q.device))

    def make(ov):
        if not ov:
            return lambda: flash_attn_fp8_func(q, k, v, causal=s.causal)
        plan = {key: ov[key] for key in PLAN_OPTIONS if key in ov}
        if same_as_shipped(base, ov, plan) and plan.get("qk_format", "int8") == "int8":
            raise NotApplicable("the shipped config")
        cfg = replace_fields(base, ov, PLAN_OPTIONS)
        fmt = plan.get("qk_format", "int8")
        return lambda: attention_fp8_forward(q, k, v, None, s.head_dim ** -0.5, s.causal, False, fmt, cfg)[0]
    return TuneCase(s.label, s.as_dict(), anchor, make, s.flops, 4, dataclasses.asdict(base))


SPEC = OpSpec(
    name="attention-fp8",
    info_title=f"FP8 attention through flash_attn_fp8_func, its quantize pass included (bf16 in, "
               f"batch {BATCH}, seqlen {SEQLEN}, {HEADS} heads)",
    info_cases=info_cases,
    suite="attention",
    axes={"BLOCK_M": (64, 128), "BLOCK_N": (64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4),
          "pv_fp32_sum": (False, True)},
    plan_options=PLAN_OPTIONS,
    config_classes=(AttentionFp8Config,),
    unit="TFLOP/s",
    anchor="sdpa",
    # 8-bit on purpose: ~4% relative L2 against exact attention (docs/fp8.md)
    tolerance=6e-2,
    tune_shapes=tune_shapes,
    tune_case=tune_case,
    tune_takes=("head_dims",),
)
