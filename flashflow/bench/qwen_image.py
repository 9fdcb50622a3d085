"""`flashflow bench --suite qwen-image`: one Qwen-Image transformer step, diffusers against
:mod:`flashflow.integrations.diffusers` and against torchao's FP8 linears, eager, under
``torch.compile`` and captured in a CUDA graph.

The model is diffusers' ``QwenImageTransformer2DModel`` at full width (:data:`CONFIG`, the class's
own defaults, which are the released model's) with ``--blocks`` of its 60 double-stream blocks
(default 6), random weights in bf16, on the GPU, with the q/k RMSNorm weights scaled ×3
(:data:`QK_NORM_SCALE`, :func:`build_model`): random weights otherwise give near-uniform
attention, whose output hardly depends on which keys it attended, and the accuracy columns would
not see an attention error. Steps, batch 1, 256 text tokens:

  * ``qwen-image-1024px``: one 1024×1024 image, 64×64 = 4096 image tokens;
  * ``qwen-image-edit-1024px``: the image and its reference, 2 × 4096 = 8192 image tokens;

each without a text mask and with one that marks 200 of the 256 text tokens valid (a padded
prompt; the attention then takes a mask). ``--quick``: the two shapes without the mask.

Providers, timed in one run on the same weights and inputs (:data:`MODES` says what each runs):
  * ``diffusers`` — the model as diffusers builds it (SDPA attention, bf16 Linear layers);
  * ``diffusers+compile`` — ``torch.compile(model, dynamic=False)``, default mode;
  * ``flashflow`` — after ``flashflow.integrations.diffusers.enable(model)``;
  * ``flashflow+compile`` — ``enable(model)``, then ``torch.compile(model, dynamic=False)``;
  * ``diffusers+graph``, ``flashflow+graph`` — one step captured in a CUDA graph per shape, timed
    as replays (a step with a text mask cannot be captured: its error entry says so);
  * ``flashflow-fp8``, ``flashflow-fp8+graph`` — ``enable(model, attention="fp8")`` (FP8
    attention, :func:`flashflow.ops.attention_fp8.flash_attn_fp8_func`; Hopper or newer), eager
    and captured;
  * ``flashflow-fp8-linear``, ``flashflow-fp8-linear+graph``, ``flashflow-fp8-linear+compile`` —
    ``enable(model, attention="fp8", linear="fp8")``: FP8 attention and every Linear of every block
    in FP8 e4m3 (per-row activation, per-channel weight scales); eager, captured, and compiled;
  * ``flashflow-fp8-linear+compile+graph``, ``torchao-fp8+compile+graph`` — compiled, then one
    step of the compiled model captured in a CUDA graph (what ``mode="reduce-overhead"`` does):
    both FP8 recipes with no host time between kernels;
  * ``torchao-fp8+compile`` — what a user of torchao does today: ``quantize_`` with
    ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` on the Linear layers of the
    transformer blocks, then ``torch.compile(model, dynamic=False)``. ``quantize_`` changes a model
    in place, so it runs on a copy (:func:`torchao_fp8_copy`: made block by block while the
    original waits on the CPU, so the GPU holds one model at a time and the peak memory is the
    quantized model's), dropped afterwards. torchao is optional (``pip install torchao``, or the
    ``bench`` extra): without it the provider's entry on every shape says so (``"skipped": true``)
    and the rest of the run goes on.

Per (provider, shape): median ms of one step (``triton.testing.do_bench`` under
``torch.no_grad()``, after the first call, which compiles and is reported as ``first_call_s``),
speedups over ``diffusers`` and ``diffusers+compile``, the output's relative L2 error and cosine
against the eager diffusers output (for the fp8 providers, the error FP8 adds), ``block_cosine``:
per transformer block, the cosine of its image-stream output against eager diffusers' (forward
hooks on ``transformer_blocks[i]``, one extra call per provider and shape; :func:`block_cosines`),
peak memory over one step (``max_memory_allocated``), and for the eager providers in
:data:`PROFILED` the split of GPU kernel time into GEMM / attention / other from
``torch.profiler`` (:func:`classify_kernel`). The block pass calls the provider's model
uncompiled: a compiled graph does not call hooks added after it was compiled, and compiling it
again with them would cost a compile per shape; so a compiled provider reports its model's blocks
as eager code computes them (its quantization or attention error, not Inductor's reordering),
``diffusers+compile`` none (its uncompiled model is the reference), and the ``+graph`` providers
none (they replay their eager provider's kernels). Each compiled provider compiles once per shape
(``dynamic=False``: static shapes, no dynamic-shape recompiles), and the compiled code is dropped
(``torch._dynamo.reset()``) before the next provider.

Writes ``qwen-image-<device>.json`` and a PNG bar chart beside it (with matplotlib).
"""
from __future__ import annotations

import copy
import gc
import sys
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

from flashflow.bench import timing

DEFAULT = "diffusers"
COMPILED_DEFAULT = "diffusers+compile"
TORCHAO = "torchao-fp8+compile"


class Mode(NamedTuple):
    """What a provider runs."""
    attention: str | None   # flashflow's attention mode ("exact", "fp8"); None: flashflow not enabled
    linear: str             # "exact": the model's own Linear layers; "fp8": flashflow's FP8 linears
                            # (enable(..., linear="fp8")); "torchao-fp8": torchao's quantize_, on a copy
    compiled: bool          # torch.compile(model, dynamic=False)
    graphed: bool           # one step captured in a CUDA graph per shape


MODES = {
    DEFAULT: Mode(None, "exact", False, False),
    COMPILED_DEFAULT: Mode(None, "exact", True, False),
    "flashflow": Mode("exact", "exact", False, False),
    "flashflow+compile": Mode("exact", "exact", True, False),
    "diffusers+graph": Mode(None, "exact", False, True),
    "flashflow+graph": Mode("exact", "exact", False, True),
    "flashflow-fp8": Mode("fp8", "exact", False, False),
    "flashflow-fp8+graph": Mode("fp8", "exact", False, True),
    TORCHAO: Mode(None, "torchao-fp8", True, False),
    "flashflow-fp8-linear": Mode("fp8", "fp8", False, False),
    "flashflow-fp8-linear+graph": Mode("fp8", "fp8", False, True),
    "flashflow-fp8-linear+compile": Mode("fp8", "fp8", True, False),
    # compiled, then one step captured: what torch.compile's mode="reduce-overhead" does
    "flashflow-fp8-linear+compile+graph": Mode("fp8", "fp8", True, True),
    TORCHAO + "+graph": Mode(None, "torchao-fp8", True, True),
}
PROVIDERS = tuple(MODES)
# the GPU time split is read from the eager providers: compiled kernels are Inductor's fusions,
# named after aten ops, which would all land in "other"
PROFILED = (DEFAULT, "flashflow", "flashflow-fp8", "flashflow-fp8-linear")
PROFILE_STEPS = 3

MODEL_BLOCKS = 60
DEFAULT_BLOCKS = 6
# QwenImageTransformer2DModel's __init__ defaults (the released Qwen-Image), spelled out so the
# JSON records what was built; tests/bench/test_qwen_image_suite.py checks them against diffusers.
CONFIG = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "attention_head_dim": 128,
          "num_attention_heads": 24, "joint_attention_dim": 3584, "axes_dims_rope": (16, 56, 56)}
# The q/k RMSNorm weights (both streams) are multiplied by this: q·k scores of random weights are
# about N(0, 1), attention over thousands of keys is then near uniform and an attention error
# hardly shows in the output; ×3 makes it peaked (docs/diffusion.md).
QK_NORM_SCALE = 3.0
QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")

TORCHAO_CONFIG = "Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())"
TORCHAO_MISSING = "torchao is not installed (pip install torchao)"

IMAGE_SIDE = 1024 // 8 // 2  # pixels / VAE downsampling / patch size: 64 tokens per side
TEXT_TOKENS = 256
TEXT_VALID = 200             # of TEXT_TOKENS, in the masked shapes
TIMESTEP = 0.5               # the pipeline passes t / 1000, in [0, 1]

GIB = 2 ** 30

# kernel-name fragments, lower case; attention first: cutlass' FMHA kernels name cutlass too.
# FP8 attention's quantize pass (attention_kv_stats_kernel, attention_quantize_kernel) counts as
# attention: it is part of the op's call. FP8 GEMMs are GEMMs: cuBLASLt's (nvjet_*, sm90_xmma_gemm_*
# e4m3), CUTLASS' (cutlass3x_sm90_*, torch._scaled_mm's row-wise f8f8bf16 kernels) and Triton ones
# named *gemm* / *matmul*; the FP8 linears' activation quantize kernels (amax, scale, cast) are
# "other", as the bf16 step's casts and norms are.
ATTENTION_KERNELS = ("flash", "fmha", "attention", "cudnn")
GEMM_KERNELS = ("gemm", "matmul", "cutlass", "cublas", "xmma", "nvjet")
CLASSES = ("gemm", "attention", "other")


@dataclass(frozen=True)
class StepShape:
    name: str
    images: int               # images in the joint sequence (Edit: the generated one + the reference)
    image_side: int           # tokens per image side
    text_tokens: int
    text_valid: int | None    # None: no text mask passed (every token valid)

    @property
    def image_tokens(self) -> int:
        return self.images * self.image_side ** 2

    @property
    def label(self) -> str:
        mask = f"text {self.text_valid}/{self.text_tokens}" if self.text_valid else f"text {self.text_tokens}"
        return f"{self.name} ({self.image_tokens} image tokens, {mask})"

    def as_dict(self) -> dict:
        return {**asdict(self), "image_tokens": self.image_tokens}


def step_shapes(quick: bool = False) -> list[StepShape]:
    shapes = []
    for name, images in (("qwen-image-1024px", 1), ("qwen-image-edit-1024px", 2)):
        for valid in ((None,) if quick else (None, TEXT_VALID)):
            shapes.append(StepShape(name, images, IMAGE_SIDE, TEXT_TOKENS, valid))
    return shapes


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------


def check_args(args) -> str | None:
    """The problem with the suite's options, or None (then ``args.providers`` is a list).
    Runs before the GPU is looked for, so a typo is reported on any machine."""
    blocks = args.blocks
    if not isinstance(blocks, int) or isinstance(blocks, bool) or not 1 <= blocks <= MODEL_BLOCKS:
        return (f"--blocks must be a whole number from 1 to {MODEL_BLOCKS} (Qwen-Image has "
                f"{MODEL_BLOCKS} transformer blocks), got {blocks!r}")
    from flashflow.bench.runner import check_timing_and_providers

    return check_timing_and_providers(args, PROVIDERS, "qwen-image")


# --------------------------------------------------------------------------------------------
# model and inputs
# --------------------------------------------------------------------------------------------


def build_model(blocks: int, device, dtype, seed: int = 0, qk_norm_scale: float = QK_NORM_SCALE, **overrides):
    """QwenImageTransformer2DModel with ``blocks`` blocks and random weights, made directly on
    ``device`` in ``dtype`` (60 blocks hold 20 B parameters: no fp32 or host copy on the way),
    in eval mode, parameters not requiring grad. The q/k RMSNorm weights of both streams
    (:data:`QK_NORMS`) are multiplied by ``qk_norm_scale`` (default :data:`QK_NORM_SCALE`, 1 keeps
    diffusers' ones) so attention is peaked and its errors show. ``overrides`` change
    :data:`CONFIG` (tests build a narrow model on the CPU)."""
    import torch
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # RoPE's tables are made in explicit fp32/complex64
    try:
        with torch.device(device):
            model = QwenImageTransformer2DModel(**{**CONFIG, **overrides, "num_layers": blocks})
    finally:
        torch.set_default_dtype(before)
    model = model.eval().requires_grad_(False)
    if qk_norm_scale != 1:
        for block in model.transformer_blocks:
            for name in QK_NORMS:
                getattr(block.attn, name).weight.mul_(qk_norm_scale)
    return model


def make_inputs(shape: StepShape, config: dict, device, dtype, seed: int = 0) -> dict:
    """The keyword arguments of one step, as the Qwen-Image (Edit) pipeline passes them."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    channels = config["in_channels"]
    hidden = torch.randn(1, shape.image_tokens, channels, generator=g)
    text = torch.randn(1, shape.text_tokens, config["joint_attention_dim"], generator=g)
    mask = None
    if shape.text_valid is not None:
        mask = torch.zeros(1, shape.text_tokens, dtype=torch.long)  # the tokenizer's attention mask
        mask[:, :shape.text_valid] = 1
        mask = mask.to(device)
    return {
        "hidden_states": hidden.to(device=device, dtype=dtype),
        "encoder_hidden_states": text.to(device=device, dtype=dtype),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.full((1,), TIMESTEP, device=device, dtype=dtype),
        "img_shapes": [[(1, shape.image_side, shape.image_side)] * shape.images],
        "return_dict": False,
    }


def output_error(out, ref) -> tuple[float, float]:
    """(relative L2 error, cosine similarity) of ``out`` against ``ref``, in float64."""
    from flashflow.reference.metrics import cosine, rel_l2

    return rel_l2(out, ref), cosine(out, ref)


@contextmanager
def block_hooks(model, on_block):
    """Forward hooks on ``model.transformer_blocks[i]`` for the ``with`` body: each block's call
    hands ``on_block(i, image_stream)`` its image-stream output (a block returns
    ``(encoder_hidden_states, hidden_states)``)."""
    handles = [block.register_forward_hook(lambda _m, _a, out, i=i: on_block(i, out[1]))
               for i, block in enumerate(model.transformer_blocks)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def reference_step(model, kwargs: dict):
    """(the step's output in float32, every block's image-stream output on the CPU in the model's
    dtype): the reference of one shape, from one call. The block outputs wait on the host, so
    they take no GPU memory while the providers are measured."""
    blocks: dict[int, object] = {}
    with block_hooks(model, lambda i, x: blocks.__setitem__(i, x.detach().to("cpu", copy=True))):
        out = model(**kwargs)[0].float()
    return out, [blocks[i] for i in range(len(blocks))]


def block_cosines(model, kwargs: dict, ref_blocks: list) -> list[float]:
    """One call of ``model`` with hooks on its blocks: per block, the cosine of its image-stream
    output against ``ref_blocks[i]`` (from :func:`reference_step`), in float64 on the output's
    device, computed as the block returns (no block output is kept)."""
    from flashflow.reference.metrics import cosine

    blocks = len(model.transformer_blocks)
    if blocks != len(ref_blocks):
        raise ValueError(f"the model has {blocks} transformer blocks, the reference {len(ref_blocks)}")
    got: dict[int, float] = {}
    with block_hooks(model, lambda i, x: got.__setitem__(i, cosine(x, ref_blocks[i].to(x.device)))):
        model(**kwargs)
    if sorted(got) != list(range(blocks)):
        raise RuntimeError(f"the hooks saw blocks {sorted(got)} of {blocks}: a block was not called as a module")
    return [got[i] for i in range(len(ref_blocks))]


# --------------------------------------------------------------------------------------------
# torchao
# --------------------------------------------------------------------------------------------


class Skipped(Exception):
    """A provider that cannot run on this machine (a missing optional package): its entry on
    every shape is ``{"error": reason, "skipped": True}`` and the run goes on."""


def torchao_version() -> str | None:
    """The installed torchao's version, or None (read from the package metadata: nothing imported)."""
    from importlib import metadata

    try:
        return metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return None


@contextmanager
def torchao_fp8_copy(model, backend):
    """A copy of ``model`` with torchao's ``quantize_(block,
    Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))`` on every transformer
    block's Linear layers, for the ``with`` body; :class:`Skipped` when torchao does not import.

    ``quantize_`` replaces weights in place, so it works on a copy. ``model`` waits on the CPU
    (``backend.park``) meanwhile: the copy is made from it block by block (one bf16 block on the
    GPU at a time, quantized before the next), so the GPU holds the quantized model alone and its
    peak memory is the copy's. Afterwards the copy is dropped and ``model`` goes back where it was.
    torchao's config adjusts Inductor's settings for the compile that follows (what a user of it
    gets); they are put back on the way out, so the providers measured later compile with the
    defaults."""
    from torch import nn

    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError as e:
        raise Skipped(f"{TORCHAO_MISSING}: {timing.short_error(e)}") from e
    import torch._inductor.config as inductor_config

    saved = inductor_config.get_config_copy()
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    device = backend.park(model)
    quantized = None
    try:
        blocks = nn.ModuleList()
        # everything but the blocks, deep-copied; the memo stands the empty list in for the blocks
        quantized = copy.deepcopy(model, {id(model.transformer_blocks): blocks}).to(device)
        for block in model.transformer_blocks:
            block = copy.deepcopy(block).to(device)
            quantize_(block, config)   # its default filter: the nn.Linear modules
            blocks.append(block)
        yield quantized
    finally:
        quantized = blocks = block = None
        backend.free()
        inductor_config.load_config(saved)
        backend.unpark(model, device)


# --------------------------------------------------------------------------------------------
# kernel classes
# --------------------------------------------------------------------------------------------


def classify_kernel(name: str) -> str:
    """"attention", "gemm" or "other", from a GPU kernel's name."""
    low = name.lower()
    if any(k in low for k in ATTENTION_KERNELS):
        return "attention"
    if any(k in low for k in GEMM_KERNELS):
        return "gemm"
    return "other"


def kernel_split(kernels, steps: int = 1, top: int = 12) -> dict:
    """``kernels``: (name, µs) pairs over ``steps`` steps. Per step: ms per class, total, the
    classes' shares of the total, and the ``top`` kernels by time."""
    per_class = dict.fromkeys(CLASSES, 0.0)
    per_name: dict[str, float] = {}
    for name, us in kernels:
        per_class[classify_kernel(name)] += us
        per_name[name] = per_name.get(name, 0.0) + us
    total = sum(per_class.values())
    ms = {c: v / steps / 1e3 for c, v in per_class.items()}
    return {
        "ms": ms,
        "total_ms": total / steps / 1e3,
        "share": {c: (per_class[c] / total if total else None) for c in CLASSES},
        "top": [{"name": n[:160], "class": classify_kernel(n), "ms": us / steps / 1e3}
                for n, us in sorted(per_name.items(), key=lambda kv: -kv[1])[:top]],
    }


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------


class CudaBackend:
    """How a step is timed (:mod:`flashflow.bench.timing`: ``warm``, a captured step as ``graph``
    replays, the host's share as ``issue``), its memory measured and its kernels listed on the
    GPU; tests pass a stand-in."""

    def __init__(self, warmup_ms: int, rep_ms: int):
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize()

    def time_ms(self, fn) -> float:
        return timing.warm_ms(fn, self.warmup_ms, self.rep_ms, first_call=False)

    def capture(self, fn):
        """(CUDA graph of one call of ``fn``, its output), after a warm-up call."""
        return timing.capture_graph(fn, 1)

    def host_ms(self, fn, calls: int = 3) -> float:
        """``issue`` time of one call: a step whose host time reaches its GPU time is
        launch-bound, and only a CUDA graph or fewer launches make it faster."""
        return timing.issue_ms(fn, calls)

    def peak(self, fn) -> tuple[int, int]:
        """(peak bytes allocated during one call, the part of it beyond what was resident before)."""
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return peak, peak - resident

    def kernels(self, fn, steps: int) -> list[tuple[str, float]]:
        """(name, µs) of every GPU kernel, memcpy and memset of ``steps`` calls."""
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
        # the GPU activity's own interval: device_time_total reads 0 for events marked async
        return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                if e.device_type == DeviceType.CUDA]

    def free(self) -> None:
        import torch

        gc.collect()
        torch.cuda.empty_cache()

    def park(self, model):
        """Move ``model`` to the host while a copy of it runs; returns the device it was on."""
        device = next(model.parameters()).device
        model.to("cpu")
        self.free()
        return device

    def unpark(self, model, device) -> None:
        model.to(device)

    def is_oom(self, e: BaseException) -> bool:
        import torch

        return isinstance(e, torch.cuda.OutOfMemoryError)


def _integration():
    from flashflow.integrations.diffusers import disable, enable

    return enable, disable


def _compile(model):
    import torch

    return torch.compile(model, dynamic=False)


def _reset_compiled() -> None:
    import torch._dynamo

    torch._dynamo.reset()


def _blocks_measured(mode: Mode) -> bool:
    """Whether a provider gets a block pass: not the ``+graph`` ones (their eager provider's
    kernels, replayed), not ``diffusers+compile`` (its uncompiled model is the reference;
    ``diffusers`` itself gets one: a second eager call against the first)."""
    return not mode.graphed and not (mode.compiled and mode.attention is None and mode.linear == "exact")


@contextmanager
def _enabled(model, mode: Mode, integration):
    """``model`` with flashflow enabled as ``mode`` says, disabled on the way out.
    ``linear="exact"`` is ``enable``'s default and is not spelled out."""
    enable, disable = integration()
    options = {} if mode.linear == "exact" else {"linear": mode.linear}
    enable(model, attention=mode.attention, **options)
    try:
        yield model
    finally:
        disable(model)


def _provider_model(model, mode: Mode, backend, integration, torchao_copy):
    """A context manager giving the uncompiled model ``mode`` runs: ``model`` itself, as diffusers
    built it or with flashflow enabled, or torchao's quantized copy."""
    if mode.linear == "torchao-fp8":
        return torchao_copy(model, backend)
    if mode.attention is None:
        return nullcontext(model)
    return _enabled(model, mode, integration)


def measure(model, shapes, providers, inputs: dict, backend, integration=_integration,
            compile_fn=_compile, reset_compiled=_reset_compiled, torchao_copy=torchao_fp8_copy,
            bar=None) -> list[dict]:
    """One row per shape: every provider's result on ``inputs[shape.name, shape.text_valid]``.

    ``integration()`` returns ``(enable, disable)``, called as ``enable(model, attention=mode)``
    with the provider's attention mode (``"exact"`` or ``"fp8"``), plus ``linear="fp8"`` for the
    FP8-linear providers (:data:`MODES`); ``compile_fn(model)`` the compiled callable;
    ``torchao_copy(model, backend)`` a context manager giving the torchao-quantized copy
    (:func:`torchao_fp8_copy`). The reference is eager diffusers on ``model`` before anything is
    changed: each shape's output and its blocks' image-stream outputs (:func:`reference_step`).
    Providers run one after the other over all shapes, so each is set up (enabled or copied,
    compiled) once and torn down (compiled code dropped, disabled or its copy freed, memory
    freed) before the next.
    """
    import torch

    rows = [{"shape": s.as_dict(), "label": s.label, "results": {}} for s in shapes]
    refs, ref_blocks = {}, {}
    with torch.no_grad():
        for s in shapes:
            key = s.name, s.text_valid
            refs[key], ref_blocks[key] = reference_step(model, inputs[key])
        backend.sync()
        for provider in providers:
            mode = MODES[provider]
            setup_error, skipped = None, False
            stack = ExitStack()
            eager = forward = None
            try:
                eager = stack.enter_context(_provider_model(model, mode, backend, integration, torchao_copy))
                forward = compile_fn(eager) if mode.compiled else eager
            except Skipped as e:
                setup_error, skipped = str(e), True
            except Exception as e:  # noqa: BLE001 — recorded on every shape of this provider
                setup_error = timing.short_error(e)
            try:
                for row, s in zip(rows, shapes):
                    key = s.name, s.text_valid
                    if bar is not None:
                        bar.describe(f"{provider} · {s.name}{' · mask' if s.text_valid else ''}"
                                     f"{' · compiling' if mode.compiled and not setup_error else ''}")
                    if setup_error:
                        row["results"][provider] = {"error": setup_error, **({"skipped": True} if skipped else {})}
                    elif mode.graphed:
                        row["results"][provider] = _measure_graphed(forward, inputs[key], refs[key], backend)
                    else:
                        res = _measure_one(forward, inputs[key], refs[key], backend,
                                           profile=provider in PROFILED)
                        if res["error"] is None and _blocks_measured(mode):
                            _measure_blocks(res, eager, inputs[key], ref_blocks[key], backend)
                        row["results"][provider] = res
                    if bar is not None:
                        bar.update()
            finally:
                eager = forward = None
                if mode.compiled:
                    reset_compiled()   # the compiled code holds the model it was compiled from
                stack.close()
                backend.free()
    for row in rows:
        row["speedup"] = speedups(row["results"])
    return rows


def _measure_one(forward, kwargs: dict, ref, backend, profile: bool) -> dict:
    def step():
        return forward(**kwargs)[0]

    res = {"ms": None, "host_ms": None, "first_call_s": None, "peak_bytes": None, "step_bytes": None,
           "rel_l2": None, "cosine": None, "block_cosine": None, "split": None, "error": None}
    try:
        t0 = time.perf_counter()
        out = step()
        backend.sync()
        res["first_call_s"] = time.perf_counter() - t0
        res["rel_l2"], res["cosine"] = output_error(out, ref)
        del out
        res["ms"] = backend.time_ms(step)
        res["host_ms"] = backend.host_ms(step)
        res["peak_bytes"], res["step_bytes"] = backend.peak(step)
        if profile:
            res["split"] = kernel_split(backend.kernels(step, PROFILE_STEPS), PROFILE_STEPS)
    except Exception as e:  # noqa: BLE001 — a provider's failure is a row entry, not the end
        res["error"] = timing.short_error(e)
        if backend.is_oom(e):
            backend.free()
    return res


def _measure_blocks(res: dict, eager, kwargs: dict, ref_blocks: list, backend) -> None:
    """``res["block_cosine"]`` from one uncompiled call with hooks, or ``res["block_error"]``."""
    try:
        res["block_cosine"] = block_cosines(eager, kwargs, ref_blocks)
    except Exception as e:  # noqa: BLE001 — the step's own figures stand
        res["block_error"] = timing.short_error(e)
        if backend.is_oom(e):
            backend.free()


def _measure_graphed(forward, kwargs: dict, ref, backend) -> dict:
    """One step captured in a CUDA graph (static inputs), then timed as graph replays: the
    step's GPU time with no host work between its kernels. A model whose forward reads a device
    value on the host cannot be captured: that is its error entry."""
    try:
        graph, out = backend.capture(lambda: forward(**kwargs)[0])
    except Exception as e:  # noqa: BLE001
        backend.free()
        return {"ms": None, "error": f"CUDA graph capture: {timing.short_error(e)}"}

    def replay(**_):
        graph.replay()
        return (out,)

    res = _measure_one(replay, kwargs, ref, backend, profile=False)
    graph = out = None   # the graph's memory goes back before free()
    backend.free()
    return res


def speedups(results: dict) -> dict:
    """provider -> {anchor: anchor's ms ÷ provider's ms} for the anchors diffusers and
    diffusers+compile (> 1: faster than the anchor)."""
    out = {}
    for p, res in results.items():
        out[p] = {}
        for anchor in (DEFAULT, COMPILED_DEFAULT):
            a, b = results.get(anchor, {}).get("ms"), res.get("ms")
            out[p][anchor] = a / b if a and b else None
    return out


# --------------------------------------------------------------------------------------------
# tables and plot
# --------------------------------------------------------------------------------------------


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _provider_notes(providers) -> list[str]:
    """What the caption says about the FP8 and torchao providers among ``providers``."""
    notes = []
    if any(p.startswith("flashflow-fp8") and not p.startswith("flashflow-fp8-linear") for p in providers):
        notes.append("flashflow-fp8: FP8 attention, its quantize pass counted as attention")
    if any(p.startswith("flashflow-fp8-linear") for p in providers):
        notes.append("flashflow-fp8-linear: FP8 attention and every block's Linear layers in FP8 e4m3 (per-row "
                     "activation and per-channel weight scales), the activations' quantize kernels counted as other")
    if TORCHAO in providers:
        notes.append(f"{TORCHAO}: torchao's quantize_ with {TORCHAO_CONFIG} on the blocks' Linear layers (a copy "
                     "of the model), then torch.compile")
    return notes


def caption(result: dict) -> str:
    t = result["timing"]
    providers = list(dict.fromkeys(p for row in result["rows"] for p in row["results"]))
    notes = "".join(f"; {n}" for n in _provider_notes(providers))
    versions = f"diffusers {result.get('diffusers')}" + (f", torchao {result['torchao']}" if result.get("torchao") else "")
    scale = result.get("qk_norm_scale")
    return (f"Qwen-Image transformer, {result['blocks']} of {MODEL_BLOCKS} blocks at full width, "
            f"{result['dtype']}, batch 1, on {result['device']} (torch {result['torch']}, {versions}): "
            f"median ms per step (do_bench, warm-up {t['warmup_ms']} ms, {t['rep_ms']} ms timed); ÷ = the "
            f"anchor's time over this one (> 1: faster); error of the output vs eager diffusers"
            f"{f' (q/k norm weights ×{scale:g}: peaked attention)' if scale else ''}; block cos min = the "
            f"lowest per-block cosine of the image stream vs eager diffusers (compiled providers: their "
            f"model uncompiled){notes}; peak = max_memory_allocated over one step; GEMM / attention / other "
            f"= GPU kernel time per step from torch.profiler (eager providers).")


def markdown_table(result: dict) -> str:
    head = ["shape", "text mask", "provider", "ms/step", "host ms", f"÷ {DEFAULT}", f"÷ {COMPILED_DEFAULT}",
            "rel L2", "cosine", "block cos min", "peak GiB", "GEMM ms", "attention ms", "other ms", "first call s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":--"] * 3 + ["--:"] * (len(head) - 3)) + "|"]
    for row in result["rows"]:
        s = row["shape"]
        mask = f"{s['text_valid']}/{s['text_tokens']}" if s.get("text_valid") else "none"
        shape = f"{s['name']} ({s['image_tokens']}+{s['text_tokens']})"
        for p, res in row["results"].items():
            if res.get("error"):
                error = ("skipped: " if res.get("skipped") else "") + res["error"].replace("|", "/")
                lines.append(f"| {shape} | {mask} | {p} | {error} |" + " |" * (len(head) - 4))
                continue
            sp = row.get("speedup", {}).get(p, {})
            split = (res.get("split") or {}).get("ms") or {}
            peak = res.get("peak_bytes")
            blocks = res.get("block_cosine")
            lines.append("| " + " | ".join([
                shape, mask, p, _f(res.get("ms"), ".2f"), _f(res.get("host_ms"), ".2f"), _f(sp.get(DEFAULT), ".2f"),
                _f(sp.get(COMPILED_DEFAULT), ".2f"), _f(res.get("rel_l2"), ".1e"),
                _f(res.get("cosine"), ".6f"), _f(min(blocks) if blocks else None, ".6f"),
                _f(None if peak is None else peak / GIB, ".2f"),
                _f(split.get("gemm"), ".2f"), _f(split.get("attention"), ".2f"),
                _f(split.get("other"), ".2f"), _f(res.get("first_call_s"), ".1f")]) + " |")
    return "\n".join(lines)


def report(result: dict) -> str:
    return caption(result) + "\n\n" + markdown_table(result)


_HATCHES = ("", "", "//", "xx")


def plot(result: dict, path) -> Path | None:
    """ms per step per provider and shape (left); the eager providers' GPU time split (right).
    Returns the PNG's path, or None when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    except ImportError:
        return None
    rows = result["rows"]
    labels = [f"{r['shape']['name'].removeprefix('qwen-image-')}"
              f"{' mask' if r['shape'].get('text_valid') else ''}" for r in rows]
    providers = list(dict.fromkeys(p for r in rows for p in r["results"]))
    fig = Figure(figsize=(15, 5.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    width = 0.8 / max(len(providers), 1)
    for i, p in enumerate(providers):
        xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(rows))]
        ys = [r["results"].get(p, {}).get("ms") or 0.0 for r in rows]
        # ten colours, then the same ten hatched
        bars = left.bar(xs, ys, width, color=f"C{i % 10}", hatch="//" if i >= 10 else "", edgecolor="white",
                        linewidth=0.3, label=p)
        for bar, y in zip(bars, ys):
            if y:
                left.annotate(f"{y:.0f}", (bar.get_x() + bar.get_width() / 2, y), ha="center",
                              va="bottom", fontsize="x-small")
    left.set_xticks(range(len(rows)), labels, rotation=15)
    left.set_ylabel("ms per step")
    left.set_title("step time (lower is better)")
    left.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.2),
                ncol=min(4, len(providers)))
    left.grid(axis="y", alpha=0.3)

    split_providers = [p for p in providers if any((r["results"][p].get("split") for r in rows
                                                    if p in r["results"]))]
    width = 0.8 / max(len(split_providers), 1)
    for i, p in enumerate(split_providers):
        xs = [j + (i - (len(split_providers) - 1) / 2) * width for j in range(len(rows))]
        bottom = [0.0] * len(rows)
        for k, cls in enumerate(CLASSES):
            ys = [((r["results"].get(p, {}).get("split") or {}).get("ms") or {}).get(cls, 0.0) for r in rows]
            # colour: the kernel class; the first provider solid, the next lighter, then hatched
            right.bar(xs, ys, width, bottom=bottom, color=f"C{k}", alpha=1.0 if i == 0 else 0.55,
                      hatch=_HATCHES[i % len(_HATCHES)], edgecolor="black", linewidth=0.4,
                      label=f"{p}: {cls}")
            bottom = [b + y for b, y in zip(bottom, ys)]
    right.set_xticks(range(len(rows)), labels, rotation=15)
    right.set_ylabel("GPU kernel ms per step")
    right.set_title("GEMM / attention / other")
    if split_providers:
        right.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.2),
                     ncol=len(split_providers))
    right.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Qwen-Image transformer step, {result['blocks']} blocks, {result['dtype']}, "
                 f"{result['device']}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


def setup_record(providers) -> dict:
    """The JSON's account of what ``providers`` ran: the providers, each one's :class:`Mode`, the
    q/k norm scale, how the per-block accuracy was taken, and (when it ran) torchao's setup."""
    record = {
        "providers": list(providers),
        "modes": {p: MODES[p]._asdict() for p in providers},
        "qk_norm_scale": QK_NORM_SCALE,
        "block_accuracy": {
            "value": "block_cosine: per transformer block, cosine of its image-stream output vs eager diffusers'",
            "how": "forward hooks on transformer_blocks[i], one extra call per provider and shape, after its timing",
            "compiled": "the provider's model uncompiled (hooks added after compiling are not called by the "
                        "compiled graph); none for diffusers+compile (its uncompiled model is the reference)",
            "graph": "none (a +graph provider replays its eager provider's kernels)",
        },
    }
    if TORCHAO in providers:
        record["torchao_setup"] = {
            "config": TORCHAO_CONFIG, "api": "torchao.quantization.quantize_",
            "scope": "every nn.Linear of transformer_blocks, on a copy of the model (the original on the CPU meanwhile)",
            "inductor": "torchao's settings (set_inductor_config=True) for its compile, the defaults restored after",
        }
    return record



def run(args) -> int:
    """Entry point of ``flashflow bench --suite qwen-image`` (args: blocks, quick, providers,
    warmup, rep, no_plot, out; the CLI has checked them with :func:`check_args` and that a GPU
    is there)."""
    import diffusers
    import torch

    from flashflow.bench import runner
    from flashflow.progress import progress as Progress

    started = datetime.now(timezone.utc)
    wall = time.perf_counter()
    env = runner.environment(started)
    dtype = torch.bfloat16
    shapes = step_shapes(args.quick)
    print(f"building QwenImageTransformer2DModel, {args.blocks} blocks at full width, bf16",
          file=sys.stderr, flush=True)
    model = build_model(args.blocks, "cuda", dtype)
    params = sum(p.numel() for p in model.parameters())
    inputs = {(s.name, s.text_valid): make_inputs(s, CONFIG, "cuda", dtype) for s in shapes}
    backend = CudaBackend(args.warmup, args.rep)
    bar = Progress(len(shapes) * len(args.providers), "bench qwen-image")
    try:
        rows = measure(model, shapes, args.providers, inputs, backend, bar=bar)
    finally:
        bar.close()
    del model, inputs
    backend.free()
    result = {
        "suite": "qwen-image", **env, "diffusers": diffusers.__version__, "torchao": torchao_version(),
        "dtype": "bf16", "model": "QwenImageTransformer2DModel", "config": {**CONFIG, "num_layers": args.blocks},
        "blocks": args.blocks, "parameters": params, "quick": args.quick,
        **setup_record(args.providers),
        "timing": timing.record("warm", warmup_ms=args.warmup, rep_ms=args.rep, return_mode="median",
                                profile_steps=PROFILE_STEPS, no_grad=True,
                                graph_providers="graph (one step per graph)", host_ms="issue"),
        "compile": {"mode": "default", "dynamic": False, "scope": "whole model, once per shape"},
        "kernel_classes": {"attention": list(ATTENTION_KERNELS), "gemm": list(GEMM_KERNELS)},
        "rows": rows,
        "total_s": time.perf_counter() - wall,
    }
    path = runner.write_result(result, args.out)
    print(f"results: {path}")
    if not args.no_plot:
        try:
            png = plot(result, path.with_suffix(".png"))
        except Exception as e:  # noqa: BLE001 — the numbers are saved; still print the table
            print(f"plot failed: {type(e).__name__}: {e}")
        else:
            print(f"plot:    {png}" if png else "plot skipped: matplotlib is not installed "
                  "(pip install matplotlib, or pass --no-plot)")
    print(f"\n{report(result)}\n\ntotal {result['total_s']:.0f} s", flush=True)
    return 0
