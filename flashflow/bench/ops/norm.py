"""The diffusion block's fused norms as the benchmarks see them: ``flashflow info`` launches each
at Qwen-Image 1024px's width. They have no config table to tune; the qwen-image suite times
them inside the transformer step."""
from __future__ import annotations

from flashflow.bench.spec import InfoCase, OpSpec


def _launch(device: str, op: str) -> None:
    import torch

    from flashflow.ops import norm

    b, l, h, d = 1, 4352, 24, 128   # Qwen-Image 1024px: 4096 image + 256 text tokens, 24 heads of 128
    make = torch.empty if device == "cpu" else torch.randn
    bf16 = dict(device=device, dtype=torch.bfloat16)
    name, _, fp8 = op.partition(" ")
    if name in ("layernorm_modulate", "gate_residual", "gate_residual_layernorm_modulate"):
        x, y = make(b, l, h * d, **bf16), make(b, l, h * d, **bf16)
        shift, scale, gate = (make(b, h * d, **bf16) for _ in range(3))
        if name == "layernorm_modulate":
            norm.layernorm_modulate(x, shift, scale, fp8=fp8 == "fp8")
        elif name == "gate_residual":
            norm.gate_residual(x, y, gate)
        else:
            norm.gate_residual_layernorm_modulate(x, y, gate, shift, scale, fp8=fp8 == "fp8")
        return
    freqs = torch.ones(l, d // 2, dtype=torch.complex64, device=device)
    if op == "rmsnorm_rope":
        norm.rmsnorm_rope(make(b, l, h, d, **bf16), make(d, **bf16), freqs)
        return
    txt, img = 256, l - 256
    norm.joint_qkv_norm_rope(*(make(b, txt, h, d, **bf16) for _ in range(3)), *(make(b, img, h, d, **bf16) for _ in range(3)),
                             *(make(d, **bf16) for _ in range(4)), freqs[:txt], freqs[txt:])


# "<op> fp8": the op's fp8=True launch (its modulated rows as e4m3 with a scale per token)
NORM_OPS = ("layernorm_modulate", "layernorm_modulate fp8", "gate_residual", "gate_residual_layernorm_modulate",
            "gate_residual_layernorm_modulate fp8", "rmsnorm_rope", "joint_qkv_norm_rope")


def info_cases(family: str | None = None) -> list[InfoCase]:
    """The diffusion block's fused norms (flashflow.ops.norm) at Qwen-Image 1024px's width."""
    return [InfoCase("norm", op, lambda device, op=op: _launch(device, op)) for op in NORM_OPS]


SPEC = OpSpec(
    name="norm",
    info_title="the diffusion block's fused norms (bf16, Qwen-Image 1024px: 4352 tokens, 24 heads x 128)",
    info_cases=info_cases,
    suite="qwen-image",
)
