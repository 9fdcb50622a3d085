"""Benchmark suites: the shapes to time, how much work each one is, and who runs it.

``flashflow bench --suite NAME`` takes the names of :data:`RUNNERS`: a module per suite with
``run(args) -> int`` (and ``report(result)``, ``check_args(args)`` where it has them). The
attention suite's shapes and providers are the :class:`Suite` in :data:`SUITES` (shapes ×
providers, timed by :mod:`flashflow.bench.runner`), which its runner,
:mod:`flashflow.bench.attention_suite`, measures.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from flashflow.bench import providers, runner

log = logging.getLogger(__name__)


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
    # more of flashflow's providers (FP8 attention): ratios against the anchors like ``ours``,
    # never an anchor themselves
    variants: tuple[str, ...] = ()
    # (shape, *inputs) -> the exact output every provider's accuracy is measured against; None:
    # no accuracy columns
    reference: Optional[Callable] = None

    @property
    def anchors(self) -> tuple[str, ...]:
        return tuple(p for p in self.providers if p != self.ours and p not in self.variants)


SUITES: dict[str, Suite] = {
    "attention": Suite(
        name="attention",
        shapes=attention_shapes,
        make_inputs=providers.attention_inputs,
        providers=providers.ATTENTION_PROVIDERS,
        ours="flashflow",
        x_key="seqlen_q",
        variants=providers.ATTENTION_VARIANTS,
        reference=providers.exact_attention,
    ),
}

# what the accuracy keys of a result entry are measured against
ACCURACY_REFERENCE = "exact attention in float64 on the same inputs"
ACCURACY_KEYS = ("cosine", "rel_l1")


def measure(suite: Suite, shapes, names: list[str], dtype, warmup_ms: int = 25, rep_ms: int = 100,
            progress: bool = True) -> list[dict]:
    """:func:`flashflow.bench.runner.run_suite`, plus, per provider entry, the accuracy of its
    output against ``suite.reference`` (``cosine``, ``rel_l1``; None where the provider failed or
    the reference could not be computed), and ratios for ``suite.variants`` as for ``suite.ours``.

    Accuracy is a second pass after all the timing, on the same inputs (``make_inputs`` is
    seeded): the float64 reference is heavy work that would otherwise run right before a
    provider is timed and leave the GPU hot and clocked down for it. A variant never is the
    anchor of the row's check: the names are reordered to put the variants after the anchors.
    Adds keys only: the rows read as the runner's do.
    """
    variants = [p for p in names if p in suite.variants]
    names = [p for p in names if p not in suite.variants] + variants
    rows = runner.run_suite(suite, shapes, names, dtype, warmup_ms, rep_ms, progress=progress)
    if suite.reference is not None:
        for shape, row in zip(shapes, rows):
            _add_accuracy(suite, shape, row, dtype)
    anchors = [p for p in names if p != suite.ours and p not in suite.variants]
    for shape, row in zip(shapes, rows):
        tf = {p: row["results"].get(p, {}).get("tflops") for p in names}
        for v in variants:
            row["ratios"].pop(f"{suite.ours}/{v}", None)
            for other in anchors + ([suite.ours] if suite.ours in names else []):
                row["ratios"][f"{v}/{other}"] = tf[v] / tf[other] if tf[v] and tf[other] else None
    return rows


def _add_accuracy(suite: Suite, shape, row: dict, dtype) -> None:
    """``cosine`` / ``rel_l1`` of every provider's output at ``shape`` against the reference."""
    results = row["results"]
    for res in results.values():
        res.update(dict.fromkeys(ACCURACY_KEYS))
    try:
        inputs = suite.make_inputs(shape, dtype, "cuda")
        ref = suite.reference(shape, *inputs)
    except Exception as e:  # noqa: BLE001 — no accuracy for this shape; the timings stand
        log.warning("no reference at %s: %s: %s", shape.label, type(e).__name__, e)
        return
    for name, res in results.items():
        if res.get("error"):
            continue
        try:
            out = suite.providers[name](shape, *inputs)()
            res.update(providers.accuracy(out, ref))
        except Exception as e:  # noqa: BLE001
            log.warning("no accuracy for %s at %s: %s: %s", name, shape.label, type(e).__name__, e)
    del inputs, ref


@dataclass(frozen=True)
class Runner:
    """A suite with a runner module of its own."""
    module: str          # has run(args) -> int
    measures: str        # what it does, for --help and for the error on a machine without a GPU
    options: frozenset   # the shared `flashflow bench` options it takes (argparse dest names)
    defaults: dict       # its defaults for those options


# the shared options the attention suite takes, with its defaults
ATTENTION_OPTIONS = frozenset({"quick", "providers", "dtype", "warmup", "rep", "no_plot"})
ATTENTION_DEFAULTS = {"dtype": "bf16", "warmup": 25, "rep": 100}

RUNNERS: dict[str, Runner] = {
    "attention": Runner("flashflow.bench.attention_suite",
                        "times flashflow's attention forward and its FP8 variant against SDPA's cuDNN and FLASH "
                        "backends, with each output's accuracy against exact attention",
                        ATTENTION_OPTIONS, ATTENTION_DEFAULTS),
    "decode": Runner("flashflow.bench.decode",
                     "times decode attention against SDPA's cuDNN and FLASH backends",
                     frozenset({"quick", "dtype", "warmup", "rep"}), {"dtype": "bf16", "warmup": 25, "rep": 100}),
    "decode-layer": Runner("flashflow.bench.decode_layer_suite",
                           "times one decoder layer's decode step (Llama-3-8B sizes, batch 1 and 16, caches of "
                           "1k-32k tokens): the megakernel against the same layer from separate flashflow kernels, "
                           "torch eager, torch in a CUDA graph and torch.compile(mode='reduce-overhead'); "
                           "--blocks N: a step of N layers, the megakernel also running them in one launch",
                           frozenset({"quick", "providers", "warmup", "rep", "blocks"}),
                           {"warmup": 25, "rep": 100, "blocks": 1}),
    "train": Runner("flashflow.bench.train",
                    "times attention forward + backward against SDPA's cuDNN and FLASH backends (TFLOP/s, "
                    "peak memory, gradients against FLASH's)",
                    frozenset({"quick", "dtype", "warmup", "rep"}), {"dtype": "bf16", "warmup": 25, "rep": 100}),
    "mlp": Runner("flashflow.bench.mlp_suite",
                  "times the fused FFN's policies against cuBLAS",
                  frozenset({"quick", "providers", "dtype", "warmup", "rep"}), {"dtype": "bf16", "warmup": 5, "rep": 20}),
    "host": Runner("flashflow.bench.host",
                   "times the host's part of one call at a tiny shape (µs per call) beside SDPA and torch",
                   frozenset(), {}),
    "memory": Runner("flashflow.bench.memory",
                     "measures the peak CUDA memory of naive attention and flash_attn_func",
                     frozenset({"quick", "dtype"}), {"dtype": "fp16"}),
    "dataflow": Runner("flashflow.bench.dataflow",
                       "profiles a GEMM's DRAM bytes per tile order with Nsight Compute",
                       frozenset({"quick"}), {}),
    "fp8-linear": Runner("flashflow.bench.fp8_linear_suite",
                         "times the FP8 linear layer, its GEMM with and without fast accumulation and its "
                         "row-quantize passes against cuBLAS in bf16 and torchao's FP8 linear at a Qwen-Image "
                         "block's GEMM shapes, with its accuracy against float64; warm-up 10 ms, 50 ms timed, "
                         "3 rounds",
                         frozenset({"quick", "providers", "warmup", "rep"}), {"warmup": 10, "rep": 50}),
    "qwen-image": Runner("flashflow.bench.qwen_image",
                         "times a Qwen-Image transformer step, diffusers vs flashflow.integrations.diffusers "
                         "(exact and FP8 attention, FP8 linears) and torchao's FP8 linears, eager, compiled and "
                         "in CUDA graphs, with each output's and block's accuracy; warm-up 200 ms, 1000 ms timed",
                         frozenset({"quick", "providers", "warmup", "rep", "no_plot", "blocks"}),
                         {"warmup": 200, "rep": 1000, "blocks": 6}),
    "distributed": Runner("flashflow.bench.distributed_suite",
                          "times attention and a Qwen-Image step across 2 GPUs of one host (one process per GPU, "
                          "NCCL): flashflow's Ulysses and ring attention against one GPU, and flashflow inside "
                          "diffusers' context parallelism against diffusers' own, with each output's accuracy",
                          frozenset({"quick", "blocks"}), {"blocks": 6}),
}
