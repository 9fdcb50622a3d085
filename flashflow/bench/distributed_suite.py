"""``flashflow bench --suite distributed``: attention and a Qwen-Image step across the GPUs of one
host, beside one GPU and diffusers' own context parallelism, in one run.

The suite starts one process per GPU (NCCL), each building the same model with the same random
weights (the q/k norm weights ×3: peaked attention, :mod:`flashflow.bench.qwen_image`) and the
same inputs. Rows:

- ``step``: a Qwen-Image(-Edit) 1024px step. One GPU (every rank alone, rank 0's time): diffusers'
  default, flashflow exact and FP8 attention. Parallel: diffusers' ``enable_parallelism`` with
  its own processors (Ulysses), and with flashflow enabled (Ulysses, ring; exact and FP8). Each
  output against the one-GPU diffusers output (cosine, relative L2); the NCCL kernels' time per step.
- ``cfg``: a true-CFG step (``true_cfg_scale=4``, a negative prompt) of diffusers' real
  ``QwenImagePipeline`` and ``QwenImageEditPipeline`` at 1024px (prompt embeddings given, random
  VAE for the Edit reference image, ``output_type="latent"``): ms per step, the median interval
  between CUDA events recorded at the end of each step (the prompt, VAE and set-up costs fall
  outside), the slowest rank. One GPU (diffusers' default, flashflow FP8), diffusers' Ulysses-2
  and flashflow FP8 with Ulysses-2, flashflow's CFG parallel (FP8, and diffusers' own processors);
  the final latents against the one-GPU diffusers pipeline's.
- ``exchange``: the Ulysses exchanges of one Qwen-Image-Edit block (8448 tokens, 24 heads of
  128, batch 1) on their own: q, k, v there and the output back through NCCL and through peer
  memory (each copy mode), q, k, v to head slices in 16 bits and in 8 bits (what FP8 attention
  could send once its quantization ran before the exchange), the output back, and the small
  all-reduce of K's sums and V's channel maxima, and the block's whole FP8 attention through peer
  memory with q, k, v quantized on their way out and in 16 bits, beside the attention alone
  (this rank's heads over the whole sequence); each issued eagerly and captured in a CUDA graph.
- ``prefill``: causal GQA attention over a long sequence (``flash_attn_func`` on one GPU against
  :func:`flashflow.distributed.ulysses_attention` and :func:`~flashflow.distributed.ring_attention`,
  contiguous and zigzag), each rank's slice of the output against the one-GPU output.

Timing (``ranks``): every rank runs the same fixed number of calls (a collective inside a call
keeps them in step; ``do_bench`` picks its own count per process and would not), rounds of calls
between CUDA events, the median round per rank and the slowest rank's median. Each host waits for
its GPU at the end of a round, so the ranks start a round apart; the first exchange of the round
absorbs that offset (a step profile showed 180 µs at its first barrier), and :data:`CALLS` calls
back to back a round spread it as a pipeline's steps do.

Environment: ``FLASHFLOW_DISTRIBUTED_PARTS`` (comma-separated, default every part),
``FLASHFLOW_DISTRIBUTED_PROVIDERS`` (a comma-separated subset of the step providers, default all)
and ``FLASHFLOW_DISTRIBUTED_CALLS`` (calls a round, default :data:`CALLS`).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

from flashflow.bench import timing

SUITE = "distributed"
WORLD = 2
PREFILL = dict(batch=1, seqlen=65536, heads=32, kv_heads=8, head_dim=128, causal=True)
PREFILL_QUICK = dict(batch=1, seqlen=16384, heads=32, kv_heads=8, head_dim=128, causal=True)
# (name, images): text of 256 tokens, no mask
STEP_SHAPES = (("qwen-image-edit-1024px", 2), ("qwen-image-1024px", 1))
ROUNDS, CALLS, WARMUP = 7, 10, 3
# the cfg part: (name, pipeline class); steps of a timed pipeline call, timed calls
CFG_SHAPES = (("qwen-image-1024px", "QwenImagePipeline"), ("qwen-image-edit-1024px", "QwenImageEditPipeline"))
CFG_STEPS, CFG_REPEATS = 12, 3
GRAPH_CALLS = 10   # the exchange part: calls captured in one CUDA graph

# provider -> how it runs: flashflow's attention mode (None: diffusers' processors), the context-parallel degrees
# (None: one GPU), the order of enable and enable_parallelism, CUDA graph replays, Ulysses head groups
def _p(attention=None, degrees=None, order="enable-first", graph=False, head_groups=None, linear="exact",
       exchange=None, peer_groups=None, peer_copy=None, quantized=None, shared_modulations=None):
    return dict(attention=attention, degrees=degrees, order=order, graph=graph, head_groups=head_groups,
                linear=linear, exchange=exchange, peer_groups=peer_groups, peer_copy=peer_copy, quantized=quantized,
                shared_modulations=shared_modulations)


U2, R2 = dict(ulysses_degree=2), dict(ring_degree=2)
STEP_PROVIDERS = {
    "diffusers": _p(),
    "flashflow": _p("exact"),
    "flashflow-fp8": _p("fp8"),
    "diffusers+ulysses2": _p(None, U2),
    "flashflow+ulysses2": _p("exact", U2),
    "flashflow-fp8+ulysses2": _p("fp8", U2),
    "flashflow-fp8+ulysses2 (1 head group)": _p("fp8", U2, head_groups=1),
    "flashflow-fp8+ulysses2 (parallel first)": _p("fp8", U2, order="parallel-first"),
    "flashflow-fp8+ulysses2 (nccl exchange)": _p("fp8", U2, exchange="nccl"),
    "flashflow-fp8+ring2": _p("fp8", R2),
    # CUDA graphs last: a capture that fails on one rank leaves the other in a collective
    "flashflow-fp8+graph": _p("fp8", graph=True),
    "flashflow-fp8+ulysses2+graph": _p("fp8", U2, graph=True),
    "flashflow-fp8+ulysses2+graph (1 head group)": _p("fp8", U2, graph=True, head_groups=1),
    "flashflow+ulysses2+graph": _p("exact", U2, graph=True),
    "flashflow-fp8+ulysses2+graph (nccl exchange)": _p("fp8", U2, graph=True, exchange="nccl"),
    "flashflow-fp8+ulysses2+graph (parallel first)": _p("fp8", U2, order="parallel-first", graph=True),
    "flashflow-fp8+ulysses2+graph (peer 1 head group)": _p("fp8", U2, graph=True, peer_groups=1),
    "flashflow-fp8+ulysses2+graph (peer 2 head groups)": _p("fp8", U2, graph=True, peer_groups=2),
    "flashflow-fp8+ulysses2+graph (peer 3 head groups)": _p("fp8", U2, graph=True, peer_groups=3),
    "flashflow-fp8+ulysses2+graph (peer kernel copies)": _p("fp8", U2, graph=True, peer_copy="kernel"),
    # FP8 attention through peer memory moves q, k, v in 16 bits and quantizes after the exchange
    # (distributed.attention.QUANTIZED_EXCHANGE off) instead of quantizing on the way out
    "flashflow-fp8+ulysses2 (16-bit exchange)": _p("fp8", U2, quantized=False),
    "flashflow-fp8+ulysses2+graph (16-bit exchange)": _p("fp8", U2, graph=True, quantized=False),
    # every rank computes every block's AdaLN modulations (integrations.diffusers.SHARE_MODULATIONS off)
    "flashflow-fp8+ulysses2+graph (modulations on every rank)": _p("fp8", U2, graph=True, shared_modulations=False),
    # FP8 linear layers too (enable(attention="fp8", linear="fp8")): the fastest one-GPU step
    "flashflow-fp8-linear+graph": _p("fp8", graph=True, linear="fp8"),
    "flashflow-fp8-linear+ulysses2+graph": _p("fp8", U2, graph=True, linear="fp8"),
    "flashflow-fp8-linear+ulysses2+graph (nccl exchange)": _p("fp8", U2, graph=True, linear="fp8", exchange="nccl"),
    "flashflow-fp8-linear+ulysses2+graph (peer 1 head group)": _p("fp8", U2, graph=True, linear="fp8",
                                                                    peer_groups=1),
    "flashflow-fp8-linear+ulysses2+graph (peer 2 head groups)": _p("fp8", U2, graph=True, linear="fp8",
                                                                     peer_groups=2),
    "flashflow-fp8-linear+ulysses2+graph (peer 3 head groups)": _p("fp8", U2, graph=True, linear="fp8",
                                                                     peer_groups=3),
    "flashflow-fp8-linear+ulysses2+graph (parallel first)": _p("fp8", U2, order="parallel-first", graph=True,
                                                              linear="fp8"),
    "flashflow-fp8-linear+ulysses2+graph (16-bit exchange)": _p("fp8", U2, graph=True, linear="fp8",
                                                                quantized=False),
}
# cfg part: provider -> (flashflow's attention mode or None, "cfg" / context-parallel degrees / None: one GPU)
CFG_PROVIDERS = {   # the context-parallel ones last: whatever their hooks leave cannot reach the others
    "diffusers": (None, None),
    "flashflow-fp8": ("fp8", None),
    "diffusers+cfg2": (None, "cfg"),
    "flashflow-fp8+cfg2": ("fp8", "cfg"),
    "diffusers+ulysses2": (None, U2),
    "flashflow-fp8+ulysses2": ("fp8", U2),
}
# the provider whose eager step's host profile is printed (rank 0): where the host time goes
PROFILED = "flashflow-fp8+ulysses2"


def check_args(args) -> str | None:
    blocks = args.blocks
    if not isinstance(blocks, int) or isinstance(blocks, bool) or not 1 <= blocks <= 60:
        return f"--blocks must be a whole number from 1 to 60, got {blocks!r}"
    return None


EXCHANGE_ENV, PEER_COPY_ENV = "FLASHFLOW_ULYSSES_EXCHANGE", "FLASHFLOW_PEER_COPY"
# FLASHFLOW_DISTRIBUTED_PROVIDERS: a comma-separated subset of the step providers to run (all by default)
PROVIDERS_ENV = "FLASHFLOW_DISTRIBUTED_PROVIDERS"


def _selected(providers: dict) -> dict:
    """The step providers :data:`PROVIDERS_ENV` names (in their order), all when it is unset; an
    unknown name is refused with a ``ValueError``."""
    names = os.environ.get(PROVIDERS_ENV)
    if not names:
        return providers
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in providers]
    if unknown:
        raise ValueError(f"{PROVIDERS_ENV} names unknown providers {unknown}; known: {list(providers)}")
    return {n: how for n, how in providers.items() if n in wanted}


def _calls() -> int:
    calls = os.environ.get("FLASHFLOW_DISTRIBUTED_CALLS", "")
    if calls and not (calls.isdigit() and int(calls) > 0):
        raise ValueError(f"FLASHFLOW_DISTRIBUTED_CALLS must be a positive integer, got {calls!r}")
    return int(calls) if calls else CALLS


def _time_rounds(fn, sync) -> float:
    """Median ms per call over :data:`ROUNDS` rounds of :func:`_calls` calls (CUDA events)."""
    import torch

    calls = _calls()
    for _ in range(WARMUP):
        fn()
    sync()
    per_round = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        per_round.append(start.elapsed_time(end) / calls)
    per_round.sort()
    return per_round[len(per_round) // 2]


def _slowest(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _nccl_ms(fn) -> dict:
    """GPU time of one call's kernels: NCCL's and all, in ms (the profiler's kernel intervals)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    nccl = total = 0.0
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        total += us
        if "nccl" in e.name.lower():
            nccl += us
    return {"nccl_kernels_ms": nccl / 1e3, "all_kernels_ms": total / 1e3}


_MESHES: dict = {}


def _mesh(degrees):
    """One device mesh per degrees for the whole run: each new mesh is new NCCL communicators."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (degrees.get("ring_degree", 1), degrees.get("ulysses_degree", 1))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cuda", key, mesh_dim_names=("ring", "ulysses"))
    return _MESHES[key]


@contextmanager
def _parallelism(model, degrees):
    """``model.enable_parallelism(ContextParallelConfig(**degrees))`` for the block, then its hooks
    removed and the config forgotten (diffusers has no public inverse)."""
    import diffusers
    from diffusers.hooks.context_parallel import remove_context_parallel

    model.enable_parallelism(config=diffusers.ContextParallelConfig(**degrees, mesh=_mesh(degrees)))
    try:
        yield model
    finally:
        remove_context_parallel(model, model._cp_plan)
        model._parallel_config = None
        for block in model.transformer_blocks:
            processor = block.attn.processor
            if "_parallel_config" in getattr(processor, "__dict__", {}):
                del processor.__dict__["_parallel_config"]   # diffusers' processor: back to its class's None


def _host_profile(fn, rank: int) -> None:
    """Print (rank 0) where one call's host time goes (the profiler's CPU ops by self time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    torch.cuda.synchronize()
    if rank == 0:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), file=sys.stderr, flush=True)


@contextmanager
def _provider(model, attention, degrees, order, linear="exact"):
    """``model`` as the provider runs it; flashflow disabled before the parallelism is removed, so
    that no processor keeps a config whose hooks are gone."""
    from functools import partial

    from flashflow.integrations import diffusers as ff_diffusers

    disable, enable = ff_diffusers.disable, partial(ff_diffusers.enable, linear=linear)
    if degrees is None:
        if attention is not None:
            enable(model, attention=attention)
        try:
            yield model
        finally:
            disable(model)
        return
    if attention is not None and order == "enable-first":
        enable(model, attention=attention)
    try:
        with _parallelism(model, degrees):
            if attention is not None and order != "enable-first":
                enable(model, attention=attention)
            try:
                yield model
            finally:
                disable(model)
    finally:
        disable(model)


def _step_rows(rank, blocks, quick, save):
    import torch

    from flashflow.bench import qwen_image as qi
    from flashflow.distributed import attention as dist_attention
    from flashflow.reference.metrics import cosine, rel_l2

    head_groups, peer_groups = dist_attention.HEAD_GROUPS, dist_attention.PEER_HEAD_GROUPS
    from flashflow.integrations import diffusers as ff_diffusers

    quantized, shared = dist_attention.QUANTIZED_EXCHANGE, ff_diffusers.SHARE_MODULATIONS

    dtype = torch.bfloat16
    model = qi.build_model(blocks, "cuda", dtype)
    rows = []
    shapes = STEP_SHAPES[:1] if quick else STEP_SHAPES
    for name, images in shapes:
        shape = qi.StepShape(name, images, qi.IMAGE_SIDE, qi.TEXT_TOKENS, None)
        kwargs = qi.make_inputs(shape, qi.CONFIG, "cuda", dtype)

        def step():
            with torch.inference_mode():
                return model(**kwargs)[0]

        ref = step()
        results = {}
        for provider, how in _selected(STEP_PROVIDERS).items():
            degrees = how["degrees"]
            if how["head_groups"] is not None:
                dist_attention.HEAD_GROUPS = how["head_groups"]
            if how["peer_groups"] is not None:
                dist_attention.PEER_HEAD_GROUPS = how["peer_groups"]
            if how["quantized"] is not None:
                dist_attention.QUANTIZED_EXCHANGE = how["quantized"]
            if how["shared_modulations"] is not None:
                ff_diffusers.SHARE_MODULATIONS = how["shared_modulations"]
            saved_env = {name: os.environ.get(name) for name in (EXCHANGE_ENV, PEER_COPY_ENV)}
            for name, value in ((EXCHANGE_ENV, how["exchange"]), (PEER_COPY_ENV, how["peer_copy"])):
                if value is not None:
                    os.environ[name] = value
            try:
                with _provider(model, how["attention"], degrees, how["order"], how["linear"]):
                    out = step()
                    res = {"rel_l2": rel_l2(out, ref), "cosine": cosine(out, ref)}
                    if how["graph"]:
                        graph, out = timing.capture_graph(step)
                        ms = _time_rounds(graph.replay, torch.cuda.synchronize)
                        res.update(rel_l2=rel_l2(out, ref), cosine=cosine(out, ref))
                        del graph
                    else:
                        ms = _time_rounds(step, torch.cuda.synchronize)
                        res["issue_ms"] = timing.issue_ms(step)
                    res.update(ms=_slowest(ms) if degrees else ms, ms_rank=ms)
                    if degrees and not how["graph"]:
                        res.update(_nccl_ms(step))
                    if provider == PROFILED:
                        _host_profile(step, rank)   # every rank: the step's collectives need both
            except Exception as e:  # noqa: BLE001 — a refusal is a result
                res = {"error": timing.short_error(e)}
                torch.cuda.synchronize()
            finally:
                dist_attention.HEAD_GROUPS, dist_attention.PEER_HEAD_GROUPS = head_groups, peer_groups
                dist_attention.QUANTIZED_EXCHANGE, ff_diffusers.SHARE_MODULATIONS = quantized, shared
                for name, value in saved_env.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            results[provider] = res
            if rank == 0:
                print(f"  {name} {provider}: {res}", file=sys.stderr, flush=True)
            save(rows + [{"kind": "step", "shape": shape.as_dict(), "results": results}])
        rows.append({"kind": "step", "shape": shape.as_dict(), "results": results})
    return rows


def _cfg_pipeline(kind: str, model, dtype):
    """diffusers' pipeline around ``model``, no text encoder (the embeddings are given); the Edit
    pipeline with diffusers' Qwen-Image VAE (default config, random weights) for its reference image."""
    import diffusers

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    if kind == "QwenImagePipeline":
        pipe = diffusers.QwenImagePipeline(scheduler=scheduler, vae=None, text_encoder=None, tokenizer=None,
                                           transformer=model)
    else:
        vae = diffusers.AutoencoderKLQwenImage().to("cuda", dtype).eval()
        pipe = diffusers.QwenImageEditPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
                                               processor=None, transformer=model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _cfg_call(kind: str, dtype) -> dict:
    """The pipeline call's arguments: 256-token prompt and negative prompt embeddings, 1024px."""
    import numpy as np
    import torch
    from PIL import Image

    from flashflow.bench import qwen_image as qi

    g = torch.Generator(device="cuda").manual_seed(1)
    width = qi.CONFIG["joint_attention_dim"]
    ones = torch.ones(1, qi.TEXT_TOKENS, dtype=torch.long, device="cuda")
    kw = dict(prompt_embeds=torch.randn(1, qi.TEXT_TOKENS, width, device="cuda", generator=g).to(dtype),
              negative_prompt_embeds=torch.randn(1, qi.TEXT_TOKENS, width, device="cuda", generator=g).to(dtype),
              prompt_embeds_mask=ones, negative_prompt_embeds_mask=ones, true_cfg_scale=4.0,
              height=1024, width=1024, output_type="latent")
    if kind == "QwenImageEditPipeline":
        pixels = np.random.default_rng(2).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
        kw["image"] = Image.fromarray(pixels)
    return kw


def _cfg_rows(rank, blocks, quick, save):
    import gc
    import statistics

    import torch

    from flashflow.bench import qwen_image as qi
    from flashflow.integrations.cfg_parallel import disable_cfg_parallel, enable_cfg_parallel
    from flashflow.reference.metrics import cosine, rel_l2

    dtype = torch.bfloat16
    model = qi.build_model(blocks, "cuda", dtype)
    rows = []
    for name, kind in (CFG_SHAPES[:1] if quick else CFG_SHAPES):
        pipe = _cfg_pipeline(kind, model, dtype)
        kw = _cfg_call(kind, dtype)

        def call(steps, **more):
            with torch.inference_mode():
                return pipe(**kw, num_inference_steps=steps, generator=torch.Generator("cuda").manual_seed(0),
                            **more).images

        def step_intervals():
            """ms between the ends of consecutive steps (CUDA events from the step-end callback)."""
            intervals = []
            for _ in range(CFG_REPEATS):
                events = []

                def mark(_pipe, _i, _t, _kwargs):
                    events.append(torch.cuda.Event(enable_timing=True))
                    events[-1].record()
                    return {}

                gc.collect()
                call(CFG_STEPS, callback_on_step_end=mark, callback_on_step_end_tensor_inputs=[])
                torch.cuda.synchronize()
                intervals += [x.elapsed_time(y) for x, y in zip(events, events[1:])]
            return intervals

        results, ref = {}, None
        for provider, (attention, parallel) in CFG_PROVIDERS.items():
            degrees = parallel if isinstance(parallel, dict) else None
            try:
                with _provider(model, attention, degrees, "enable-first"):
                    if parallel == "cfg":
                        enable_cfg_parallel(pipe)
                    try:
                        out = call(CFG_STEPS)   # warm-up, and the output compared
                        if ref is None:
                            ref = out
                        intervals = step_intervals()
                        ms_rank = statistics.median(intervals)
                        quartiles = statistics.quantiles(intervals, n=4)
                        res = {"ms": _slowest(ms_rank), "ms_rank": ms_rank,
                               "quartiles_rank": [quartiles[0], quartiles[2]],
                               "rel_l2": rel_l2(out, ref), "cosine": cosine(out, ref)}
                    finally:
                        disable_cfg_parallel(pipe)
            except Exception as e:  # noqa: BLE001 — a refusal is a result
                res = {"error": timing.short_error(e)}
                torch.cuda.synchronize()
            results[provider] = res
            if rank == 0:
                print(f"  cfg {name} {provider}: {res}", file=sys.stderr, flush=True)
            save(rows + [{"kind": "cfg", "shape": {"name": name, "pipeline": kind, "steps": CFG_STEPS},
                          "results": results}])
        rows.append({"kind": "cfg", "shape": {"name": name, "pipeline": kind, "steps": CFG_STEPS},
                     "results": results})
    return rows


EXCHANGE = dict(batch=1, seqlen=8448, heads=24, head_dim=128)


def _exchange_rows(rank, world):
    import torch
    import torch.distributed as dist

    from flashflow.distributed import attention as dist_attention
    from flashflow.distributed import context_attention
    from flashflow.distributed.exchange import heads_to_seq, seq_to_heads
    from flashflow.distributed.peer import REMOTE_COPIES, peer_ulysses
    from flashflow.ops.attention_fp8 import flash_attn_fp8_func

    p = EXCHANGE
    local = p["seqlen"] // world
    shape = (p["batch"], local, p["heads"], p["head_dim"])
    g = torch.Generator(device="cuda").manual_seed(rank)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn).view(torch.int8) for t in (q, k, v))
    out = torch.randn((p["batch"], p["seqlen"], p["heads"] // world, p["head_dim"]), device="cuda",
                      dtype=torch.bfloat16, generator=g)
    stats = torch.randn((p["batch"], p["heads"], 2 * p["head_dim"]), device="cuda", dtype=torch.float32, generator=g)
    peer = peer_ulysses(None, q.device, "peer")

    whole_heads = [torch.randn((p["batch"], p["seqlen"], p["heads"] // world, p["head_dim"]), device="cuda",
                               dtype=torch.bfloat16, generator=g) for _ in range(3)]

    def fp8_attention(quantized):
        def call():
            saved = dist_attention.QUANTIZED_EXCHANGE, dist_attention.QUANTIZED_EXCHANGE_MIN_TOKENS
            dist_attention.QUANTIZED_EXCHANGE, dist_attention.QUANTIZED_EXCHANGE_MIN_TOKENS = quantized, 0
            try:
                return context_attention(q, k, v, dist.group.WORLD, None, attention="fp8", exchange="peer")
            finally:
                dist_attention.QUANTIZED_EXCHANGE, dist_attention.QUANTIZED_EXCHANGE_MIN_TOKENS = saved
        return call

    def nccl_pair():
        seq_to_heads([q, k, v], None, world)
        return heads_to_seq(out, None, world)

    def peer_pair(copies, groups=1):   # q, k, v there, the output back, around no attention
        def pair():
            peer.remote_copy = copies
            return peer.attend([q, k, v], lambda *views: out, groups)
        return pair

    cases = {
        "q, k, v and output in 16 bits (NCCL: seq_to_heads, heads_to_seq)": (
            nccl_pair, (3 * q.numel() + out.numel()) * 2),
        **{f"q, k, v and output in 16 bits (peer memory, {copies} copies)": (peer_pair(copies),
                                                                            (3 * q.numel() + out.numel()) * 2)
           for copies in REMOTE_COPIES if copies != "auto"},
        "q, k, v in 16 bits (seq_to_heads)": (lambda: seq_to_heads([q, k, v], None, world), 3 * q.numel() * 2),
        "q, k, v in 8 bits (seq_to_heads)": (lambda: seq_to_heads([q8, k8, v8], None, world), 3 * q.numel()),
        "output in 16 bits (heads_to_seq)": (lambda: heads_to_seq(out, None, world), out.numel() * 2),
        "K sums and V maxima (all_reduce)": (lambda: dist.all_reduce(stats), stats.numel() * 4),
        # the whole FP8 attention of the block, exchanges included, and its attention alone
        "FP8 attention, q, k, v quantized on their way out (peer memory)": (
            fp8_attention(True), 3 * q.numel() + 2 * out.numel()),
        "FP8 attention, q, k, v in 16 bits, quantized after the exchange (peer memory)": (
            fp8_attention(False), (3 * q.numel() + out.numel()) * 2),
        "FP8 attention of this rank's heads over the whole sequence, no exchange": (
            lambda: flash_attn_fp8_func(*whole_heads), 0),
    }
    results = {}
    for name, (fn, nbytes) in cases.items():
        ms_rank = _time_rounds(fn, torch.cuda.synchronize)
        ms = _slowest(ms_rank)
        # bytes this rank sends to others: (world - 1) / world of its buffer
        results[name] = {"ms": ms, "ms_rank": ms_rank, "bytes_sent": nbytes * (world - 1) / world,
                         "gb_per_s": nbytes * (world - 1) / world / ms / 1e6, **_nccl_ms(fn)}
        # the same calls captured in a CUDA graph (10 a replay): the GPU's time, without the host's
        try:
            graph, _ = timing.capture_graph(fn, GRAPH_CALLS)
            graph_ms = _slowest(_time_rounds(graph.replay, torch.cuda.synchronize)) / GRAPH_CALLS
            results[name].update(graph_ms=graph_ms, graph_gb_per_s=nbytes * (world - 1) / world / graph_ms / 1e6)
            del graph
        except Exception as e:  # noqa: BLE001 — a capture that fails is a result
            results[name]["graph_error"] = timing.short_error(e)
            torch.cuda.synchronize()
        if rank == 0:
            print(f"  exchange {name}: {results[name]}", file=sys.stderr, flush=True)
    return [{"kind": "exchange", "shape": {**p, "world": world}, "results": results}]


def _prefill_rows(rank, world, quick):
    import torch

    from flashflow.distributed import ring_attention, shard_sequence, ulysses_attention
    from flashflow.ops.attention import flash_attn_func
    from flashflow.reference.metrics import rel_l2

    p = PREFILL_QUICK if quick else PREFILL
    g = torch.Generator(device="cuda").manual_seed(0)
    shape_q = (p["batch"], p["seqlen"], p["heads"], p["head_dim"])
    shape_kv = (p["batch"], p["seqlen"], p["kv_heads"], p["head_dim"])
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=g)
    flops = 4.0 * p["batch"] * p["heads"] * p["seqlen"] ** 2 * p["head_dim"] / (2 if p["causal"] else 1)
    results = {}
    with torch.inference_mode():
        whole = flash_attn_func(q, k, v, causal=p["causal"])
        ms = _time_rounds(lambda: flash_attn_func(q, k, v, causal=p["causal"]), torch.cuda.synchronize)
        results["flashflow (one GPU)"] = {"ms": ms, "tflops": flops / ms / 1e9}
        for provider, fn, layout in (("ulysses", ulysses_attention, "contiguous"),
                                     ("ring", ring_attention, "contiguous"),
                                     ("ring zigzag", ring_attention, "zigzag")):
            ql, kl, vl = (shard_sequence(t, layout=layout) for t in (q, k, v))
            kw = {"layout": layout} if fn is ring_attention else {}
            try:
                out = fn(ql, kl, vl, causal=p["causal"], **kw)
                err = rel_l2(out, shard_sequence(whole, layout=layout))
                ms_rank = _time_rounds(lambda: fn(ql, kl, vl, causal=p["causal"], **kw), torch.cuda.synchronize)
                ms = _slowest(ms_rank)
                results[provider] = {"ms": ms, "ms_rank": ms_rank, "tflops": flops / ms / 1e9,
                                     "rel_l2": _slowest(err), **_nccl_ms(lambda: fn(ql, kl, vl, causal=p["causal"], **kw))}
            except Exception as e:  # noqa: BLE001
                results[provider] = {"error": timing.short_error(e)}
            if rank == 0:
                print(f"  prefill {provider}: {results[provider]}", file=sys.stderr, flush=True)
    return [{"kind": "prefill", "shape": {**p, "world": world}, "results": results}]


def _worker(rank, world, port, blocks, quick, parts, out_dir):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    # a collective left waiting (a rank that failed elsewhere) aborts after this, not never
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank),
                            timeout=timedelta(seconds=120))
    try:
        rows = []

        def save(more):   # after every provider: a run cut short keeps what it measured
            if rank == 0:
                Path(out_dir, "rows.json").write_text(json.dumps(rows + more))

        if "prefill" in parts:
            rows += _prefill_rows(rank, world, quick)
            save([])
        if "step" in parts:
            rows += _step_rows(rank, blocks, quick, save)
            save([])
        if "cfg" in parts:
            rows += _cfg_rows(rank, blocks, quick, save)
            save([])
        if "exchange" in parts:
            rows += _exchange_rows(rank, world)
            save([])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(args) -> int:
    import socket

    import torch

    from flashflow.bench import runner

    if torch.cuda.device_count() < WORLD:
        print(f"the distributed suite needs {WORLD} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    started = datetime.now(timezone.utc)
    wall = time.perf_counter()
    env = runner.environment(started)
    parts = os.environ.get("FLASHFLOW_DISTRIBUTED_PARTS", "prefill,step,cfg,exchange").split(",")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    failed = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            torch.multiprocessing.spawn(_worker, args=(WORLD, port, args.blocks, args.quick, parts, tmp),
                                        nprocs=WORLD)
        except Exception as e:  # noqa: BLE001 — keep the rows measured before it
            failed = timing.short_error(e)
            print(f"a rank failed: {failed}", file=sys.stderr, flush=True)
        rows_file = Path(tmp, "rows.json")
        rows = json.loads(rows_file.read_text()) if rows_file.exists() else []
    import diffusers

    result = {
        "suite": SUITE, **env, "diffusers": diffusers.__version__, "world": WORLD, "blocks": args.blocks,
        "quick": args.quick, "providers": list(_selected(STEP_PROVIDERS)), "cfg_providers": list(CFG_PROVIDERS),
        "timing": timing.record("rounds", of="warm", rounds=ROUNDS, calls=_calls(), warmup_calls=WARMUP,
                                ranks="every rank the same calls; the slowest rank's median round",
                                cfg_part=f"CUDA events recorded at the end of each step (the pipeline's step-end "
                                         f"callback), the median interval over {CFG_REPEATS} calls of {CFG_STEPS} "
                                         f"steps; the slowest rank's median"),
        "reference": "step and cfg: diffusers' default on one GPU, same weights and inputs; prefill: flash_attn_func "
                     "on one GPU",
        "rows": rows,
        "failed": failed,
        "total_s": time.perf_counter() - wall,
    }
    path = runner.write_result(result, args.out)
    print(f"results: {path}")
    print(report(result))
    return 0 if failed is None else 1


def one_gpu_counterpart(provider: str) -> str | None:
    """The one-GPU step provider that runs ``provider``'s flashflow modes (attention, linear layers,
    CUDA graph or not), or None (a one-GPU provider, or none such)."""
    how = STEP_PROVIDERS.get(provider)
    if how is None or how["degrees"] is None:
        return None
    return next((name for name, other in STEP_PROVIDERS.items() if other["degrees"] is None
                 and all(other[k] == how[k] for k in ("attention", "linear", "graph"))), None)


def report(result: dict, markdown: bool = False) -> str:
    lines = []
    for row in result["rows"]:
        res = row["results"]
        if row["kind"] in ("step", "cfg"):
            step = row["kind"] == "step"
            anchors = ["flashflow-fp8", "diffusers"] + (["diffusers+ulysses2"] if step else [])
            lines.append(f"step {row['shape']['name']}: ms | × one-GPU flashflow-fp8 | × diffusers | "
                         f"× diffusers+ulysses2 | cosine | nccl ms | × one GPU, same mode" if step else
                         f"cfg step {row['shape']['name']}: ms per step | × one-GPU flashflow-fp8 | × diffusers | "
                         f"cosine")
            for provider, r in res.items():
                if "error" in r:
                    lines.append(f"  {provider}: {r['error']}")
                    continue
                ratios = [f"{res[a]['ms'] / r['ms']:.2f}" if res.get(a, {}).get("ms") else "-" for a in anchors]
                tail = [f"{r['cosine']:.6f}"] + ([f"{r.get('nccl_kernels_ms', 0):.2f}"] if step else [])
                if step:
                    one = one_gpu_counterpart(provider)
                    tail.append(f"{res[one]['ms'] / r['ms']:.2f}" if res.get(one, {}).get("ms") else "-")
                lines.append(f"  {provider}: " + " | ".join([f"{r['ms']:.2f}", *ratios, *tail]))
        elif row["kind"] == "exchange":
            lines.append(f"exchange {row['shape']}: ms | GB/s sent per rank | NCCL kernel ms | ms in a graph")
            for provider, r in res.items():
                graph = f"{r['graph_ms']:.3f}" if "graph_ms" in r else "-"
                lines.append(f"  {provider}: {r['ms']:.3f} | {r['gb_per_s']:.0f} | {r.get('nccl_kernels_ms', 0):.3f} | "
                             f"{graph}")
        else:
            one = res.get("flashflow (one GPU)", {}).get("ms")
            lines.append(f"prefill {row['shape']}: ms | TFLOP/s | × one GPU | rel_l2")
            for provider, r in res.items():
                if "error" in r:
                    lines.append(f"  {provider}: {r['error']}")
                    continue
                lines.append(f"  {provider}: {r['ms']:.2f} | {r['tflops']:.0f} | {one / r['ms']:.2f} | "
                             f"{r.get('rel_l2', 0):.2e}")
    return "\n".join(lines)
