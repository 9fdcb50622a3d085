"""Benchmark suites: the shapes to time, how much work each one is, and who runs it.

A suite is registered in :data:`SUITES` under the name ``flashflow bench --suite NAME`` takes.
The `decode` and `mlp` suites will register themselves here the same way `attention` does.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from flashflow.bench import providers


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool) -> float:
    """Two matmuls (q·kᵀ and p·v) of 2·sq·sk·d each per head; causal counts half the square.

    Halving is FlashAttention's convention (exact only for sq = sk, up to the diagonal), kept so
    that our TFLOP/s compare with the numbers FlashAttention and cuDNN publish.
    """
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


@dataclass(frozen=True)
class AttentionShape:
    name: str  # the model it stands for, e.g. "qwen-image-1024px", or "fa-sweep"
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen_q, self.seqlen_k,
                               self.head_dim, self.causal)

    @property
    def panel(self) -> str:
        """Plot panel this shape is drawn in: model shapes together, the sweep per (d, causal)."""
        if self.name.startswith("qwen-image"):
            return "Qwen-Image"
        return f"d={self.head_dim} {'causal' if self.causal else 'non-causal'}"

    @property
    def label(self) -> str:
        return (f"{self.name} b{self.batch} h{self.heads} s{self.seqlen_q} d{self.head_dim}"
                f"{' causal' if self.causal else ''}")

    def as_dict(self) -> dict:
        return asdict(self)


# Qwen-Image's MMDiT attends over one joint sequence with 24 heads of 128: at 1024×1024 that is
# 64×64 = 4096 image tokens + 256 text tokens; Qwen-Image-Edit adds the reference image's 4096.
QWEN_IMAGE = (("qwen-image-1024px", 4352), ("qwen-image-edit", 8448))

# FlashAttention's published sweep: 16k tokens per batch and 2048 model width at every point.
SWEEP_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
SWEEP_HEAD_DIMS = (64, 128, 256)
TOKENS_PER_BATCH = 16384
MODEL_DIM = 2048


def attention_shapes(quick: bool = False) -> list[AttentionShape]:
    shapes = [AttentionShape(name, 1, 24, s, s, 128, False) for name, s in QWEN_IMAGE]
    seqlens = (1024, 4096) if quick else SWEEP_SEQLENS
    head_dims = (128,) if quick else SWEEP_HEAD_DIMS
    for head_dim in head_dims:
        for causal in (False, True):
            for s in seqlens:
                shapes.append(AttentionShape("fa-sweep", TOKENS_PER_BATCH // s,
                                             MODEL_DIM // head_dim, s, s, head_dim, causal))
    return shapes


@dataclass(frozen=True)
class Suite:
    name: str
    shapes: Callable[[bool], list]  # quick -> shapes; a shape has flops, panel, label, as_dict()
    make_inputs: Callable           # (shape, dtype, device) -> tuple of tensors
    providers: dict                 # provider name -> (shape, *inputs) -> zero-argument callable
    ours: str                       # the provider the ratios and the ceiling percentage are for
    x_key: str                      # shape field on the plots' x axis

    @property
    def anchors(self) -> tuple[str, ...]:
        return tuple(p for p in self.providers if p != self.ours)


SUITES: dict[str, Suite] = {
    "attention": Suite(
        name="attention",
        shapes=attention_shapes,
        make_inputs=providers.attention_inputs,
        providers=providers.ATTENTION_PROVIDERS,
        ours="flashflow",
        x_key="seqlen_q",
    ),
}
