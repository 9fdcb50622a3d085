"""`flashflow bench --suite qwen-image`: one Qwen-Image transformer step, diffusers against
:mod:`flashflow.integrations.diffusers`, eager and under ``torch.compile``.

The model is diffusers' ``QwenImageTransformer2DModel`` at full width (:data:`CONFIG`, the class's
own defaults, which are the released model's) with ``--blocks`` of its 60 double-stream blocks
(default 6), random weights in bf16, on the GPU. Steps, batch 1, 256 text tokens:

  * ``qwen-image-1024px``: one 1024×1024 image, 64×64 = 4096 image tokens;
  * ``qwen-image-edit-1024px``: the image and its reference, 2 × 4096 = 8192 image tokens;

each without a text mask and with one that marks 200 of the 256 text tokens valid (a padded
prompt; the attention then takes a mask). ``--quick``: the two shapes without the mask.

Providers, timed in one run on the same model and inputs:
  * ``diffusers`` — the model as diffusers builds it (SDPA attention);
  * ``diffusers+compile`` — ``torch.compile(model, dynamic=False)``, default mode;
  * ``flashflow`` — after ``flashflow.integrations.diffusers.enable(model)``;
  * ``flashflow+compile`` — ``enable(model)``, then ``torch.compile(model, dynamic=False)``;
  * ``diffusers+graph``, ``flashflow+graph`` — one step captured in a CUDA graph per shape, timed
    as replays (a step with a text mask cannot be captured: its error entry says so);
  * ``flashflow-fp8``, ``flashflow-fp8+graph`` — ``enable(model, attention="fp8")`` (FP8
    attention, :func:`flashflow.ops.attention_fp8.flash_attn_fp8_func`; Hopper or newer), eager
    and captured.

Per (provider, shape): median ms of one step (``triton.testing.do_bench`` under
``torch.no_grad()``, after the first call, which compiles and is reported as ``first_call_s``),
speedups over ``diffusers`` and ``diffusers+compile``, the output's relative L2 error and cosine
against the eager diffusers output (for the fp8 providers, the error FP8 attention adds), peak
memory over one step (``max_memory_allocated``), and for the eager providers the split of GPU
kernel time into GEMM / attention / other from ``torch.profiler`` (:func:`classify_kernel`).
Each compiled provider compiles once per shape (``dynamic=False``: static shapes, no
dynamic-shape recompiles), and the compiled code is dropped (``torch._dynamo.reset()``) before
the next provider.

Writes ``qwen-image-<device>.json`` and a PNG bar chart beside it (with matplotlib).
"""
from __future__ import annotations

import gc
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from flashflow.bench import timing

DEFAULT = "diffusers"
COMPILED_DEFAULT = "diffusers+compile"
PROVIDERS = (DEFAULT, COMPILED_DEFAULT, "flashflow", "flashflow+compile", "diffusers+graph", "flashflow+graph",
             "flashflow-fp8", "flashflow-fp8+graph")
# provider -> (flashflow's attention mode, None: not enabled; torch.compile'd; one step captured in
# a CUDA graph per shape)
_MODES = {DEFAULT: (None, False, False), COMPILED_DEFAULT: (None, True, False),
          "flashflow": ("exact", False, False), "flashflow+compile": ("exact", True, False),
          "diffusers+graph": (None, False, True), "flashflow+graph": ("exact", False, True),
          "flashflow-fp8": ("fp8", False, False), "flashflow-fp8+graph": ("fp8", False, True)}
# the GPU time split is read from the eager providers: compiled kernels are Inductor's fusions,
# named after aten ops, which would all land in "other"
PROFILED = (DEFAULT, "flashflow", "flashflow-fp8")
PROFILE_STEPS = 3

MODEL_BLOCKS = 60
DEFAULT_BLOCKS = 6
# QwenImageTransformer2DModel's __init__ defaults (the released Qwen-Image), spelled out so the
# JSON records what was built; tests/bench/test_qwen_image_suite.py checks them against diffusers.
CONFIG = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "attention_head_dim": 128,
          "num_attention_heads": 24, "joint_attention_dim": 3584, "axes_dims_rope": (16, 56, 56)}

IMAGE_SIDE = 1024 // 8 // 2  # pixels / VAE downsampling / patch size: 64 tokens per side
TEXT_TOKENS = 256
TEXT_VALID = 200             # of TEXT_TOKENS, in the masked shapes
TIMESTEP = 0.5               # the pipeline passes t / 1000, in [0, 1]

GIB = 2 ** 30

# kernel-name fragments, lower case; attention first: cutlass' FMHA kernels name cutlass too.
# FP8 attention's quantize pass (attention_kv_stats_kernel, attention_quantize_kernel) counts as
# attention: it is part of the op's call.
ATTENTION_KERNELS = ("flash", "fmha", "attention", "cudnn")
GEMM_KERNELS = ("gemm", "cutlass", "cublas", "xmma", "nvjet")
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
    for flag in ("warmup", "rep"):
        value = getattr(args, flag)
        if not isinstance(value, int) or value < 1:
            return f"--{flag} must be a positive number of milliseconds, got {value!r}"
    try:
        from flashflow.bench.runner import parse_providers

        args.providers = parse_providers(args.providers, PROVIDERS, "qwen-image")
    except ValueError as e:
        return str(e)
    return None


# --------------------------------------------------------------------------------------------
# model and inputs
# --------------------------------------------------------------------------------------------


def build_model(blocks: int, device, dtype, seed: int = 0, **overrides):
    """QwenImageTransformer2DModel with ``blocks`` blocks and random weights, made directly on
    ``device`` in ``dtype`` (60 blocks hold 20 B parameters: no fp32 or host copy on the way),
    in eval mode, parameters not requiring grad. ``overrides`` change :data:`CONFIG` (tests
    build a narrow model on the CPU)."""
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
    return model.eval().requires_grad_(False)


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


def measure(model, shapes, providers, inputs: dict, backend, integration=_integration,
            compile_fn=_compile, reset_compiled=_reset_compiled, bar=None) -> list[dict]:
    """One row per shape: every provider's result on ``inputs[shape.name, shape.text_valid]``.

    ``integration()`` returns ``(enable, disable)``, called as ``enable(model, attention=mode)``
    with the provider's attention mode (``"exact"`` or ``"fp8"``); ``compile_fn(model)`` the
    compiled callable.
    Providers run one after the other over all shapes, so each is set up (enabled, compiled)
    once and torn down (disabled, compiled code dropped, memory freed) before the next.
    """
    import torch

    rows = [{"shape": s.as_dict(), "label": s.label, "results": {}} for s in shapes]
    refs = {}
    with torch.no_grad():
        for s in shapes:  # the reference: eager diffusers, before anything is changed
            refs[s.name, s.text_valid] = model(**inputs[s.name, s.text_valid])[0].float()
        backend.sync()
        for provider in providers:
            attention, compiled, graphed = _MODES[provider]
            disable = None
            setup_error = None
            try:
                if attention is not None:
                    enable, undo = integration()
                    enable(model, attention=attention)
                    disable = undo
                forward = compile_fn(model) if compiled else model
            except Exception as e:  # noqa: BLE001 — recorded on every shape of this provider
                setup_error = timing.short_error(e)
            try:
                for row, s in zip(rows, shapes):
                    if bar is not None:
                        bar.describe(f"{provider} · {s.name}{' · mask' if s.text_valid else ''}"
                                     f"{' · compiling' if compiled and not setup_error else ''}")
                    if setup_error:
                        row["results"][provider] = {"error": setup_error}
                    elif graphed:
                        row["results"][provider] = _measure_graphed(
                            forward, inputs[s.name, s.text_valid], refs[s.name, s.text_valid], backend)
                    else:
                        row["results"][provider] = _measure_one(
                            forward, inputs[s.name, s.text_valid], refs[s.name, s.text_valid],
                            backend, profile=provider in PROFILED)
                    if bar is not None:
                        bar.update()
            finally:
                forward = None
                if disable is not None:
                    disable(model)
                if compiled:
                    reset_compiled()
                backend.free()
    for row in rows:
        row["speedup"] = speedups(row["results"])
    return rows


def _measure_one(forward, kwargs: dict, ref, backend, profile: bool) -> dict:
    def step():
        return forward(**kwargs)[0]

    res = {"ms": None, "host_ms": None, "first_call_s": None, "peak_bytes": None, "step_bytes": None,
           "rel_l2": None, "cosine": None, "split": None, "error": None}
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


def caption(result: dict) -> str:
    t = result["timing"]
    fp8 = any(p.startswith("flashflow-fp8") for row in result["rows"] for p in row["results"])
    return (f"Qwen-Image transformer, {result['blocks']} of {MODEL_BLOCKS} blocks at full width, "
            f"{result['dtype']}, batch 1, on {result['device']} (torch {result['torch']}, diffusers "
            f"{result.get('diffusers')}): median ms per step (do_bench, warm-up {t['warmup_ms']} ms, "
            f"{t['rep_ms']} ms timed); ÷ = the anchor's time over this one (> 1: faster); error of "
            f"the output vs eager diffusers"
            f"{' (flashflow-fp8: FP8 attention, its quantize pass counted as attention)' if fp8 else ''}; "
            f"peak = max_memory_allocated over one step; GEMM / attention / other = GPU kernel time "
            f"per step from torch.profiler (eager providers).")


def markdown_table(result: dict) -> str:
    head = ["shape", "text mask", "provider", "ms/step", "host ms", f"÷ {DEFAULT}", f"÷ {COMPILED_DEFAULT}",
            "rel L2", "cosine", "peak GiB", "GEMM ms", "attention ms", "other ms", "first call s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":--"] * 3 + ["--:"] * (len(head) - 3)) + "|"]
    for row in result["rows"]:
        s = row["shape"]
        mask = f"{s['text_valid']}/{s['text_tokens']}" if s.get("text_valid") else "none"
        shape = f"{s['name']} ({s['image_tokens']}+{s['text_tokens']})"
        for p, res in row["results"].items():
            if res.get("error"):
                lines.append(f"| {shape} | {mask} | {p} | {res['error'].replace('|', '/')} |"
                             + " |" * (len(head) - 4))
                continue
            sp = row.get("speedup", {}).get(p, {})
            split = (res.get("split") or {}).get("ms") or {}
            peak = res.get("peak_bytes")
            lines.append("| " + " | ".join([
                shape, mask, p, _f(res.get("ms"), ".2f"), _f(res.get("host_ms"), ".2f"), _f(sp.get(DEFAULT), ".2f"),
                _f(sp.get(COMPILED_DEFAULT), ".2f"), _f(res.get("rel_l2"), ".1e"),
                _f(res.get("cosine"), ".6f"), _f(None if peak is None else peak / GIB, ".2f"),
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
    fig = Figure(figsize=(13, 5.4), layout="constrained")
    left, right = fig.subplots(1, 2)
    width = 0.8 / max(len(providers), 1)
    for i, p in enumerate(providers):
        xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(rows))]
        ys = [r["results"].get(p, {}).get("ms") or 0.0 for r in rows]
        bars = left.bar(xs, ys, width, color=f"C{i}", label=p)
        for bar, y in zip(bars, ys):
            if y:
                left.annotate(f"{y:.0f}", (bar.get_x() + bar.get_width() / 2, y), ha="center",
                              va="bottom", fontsize="x-small")
    left.set_xticks(range(len(rows)), labels, rotation=15)
    left.set_ylabel("ms per step")
    left.set_title("step time (lower is better)")
    left.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2),
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
        "suite": "qwen-image", **env, "diffusers": diffusers.__version__, "dtype": "bf16",
        "model": "QwenImageTransformer2DModel", "config": {**CONFIG, "num_layers": args.blocks},
        "blocks": args.blocks, "parameters": params, "quick": args.quick,
        "providers": list(args.providers),
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
