"""`flashflow tune OP`: time candidate configs of one op beside its anchor, on this GPU.

A candidate is the shipped config with some fields replaced (``--vary FIELD=V1,V2``, repeated;
by default one field at a time over the op's axes below, ``--product`` for every combination).
``shipped`` is the op as it ships (its own config lookup); the anchor is SDPA on cuDNN for
attention, attention-bwd (forward + backward) and decode, torch (cuBLAS) captured in a CUDA graph
for mlp. Every candidate's output
is checked against the anchor's (relative error ≤ 1e-2, else it is reported and not timed);
every provider is timed as CUDA-graph replays after a warm-up (attention-bwd eagerly: autograd;
its candidates must also repeat their gradients bit for bit), in ``--rounds`` interleaved
rounds (clocks drift with heat: each ratio is taken inside its round, then the median).

Besides config fields, a few plan options vary like fields: ``num_splits`` (decode) and
``policy`` (mlp: which kernel and tile order). ``--mask`` times attention with an additive mask,
from the shipped bias configs; ``--paged`` decode on a paged cache, from the page-sized tiles
where those ship; ``--fp8`` decode on FP8 (e4m3) caches, from their configs (the anchor stays
SDPA bf16 on the unquantized cache, within ``FP8_CACHE_TOLERANCE``). The JSON goes to
``--out/tune-OP-<device>.json``; the table printed last lists the best candidate per shape.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
from pathlib import Path

TOLERANCE = 1e-2
# FP8 attention is 8-bit on purpose: ~4% relative L2 against exact attention (docs/fp8.md)
TOLERANCES = {"attention-fp8": 6e-2}
# an FP8 KV cache against SDPA bf16 on the unquantized one: e4m3's three mantissa bits put
# Gaussian caches 3.6-3.9% from the bf16 result (docs/decode.md)
FP8_CACHE_TOLERANCE = 5e-2

# Default axes (field -> values) per op; a value equal to the shipped one is not a candidate.
AXES = {
    "attention": {"BLOCK_M": (64, 128), "BLOCK_N": (64, 128), "num_warps": (4, 8),
                  "num_stages": (2, 3, 4), "use_tma": (False, True), "warp_specialize": (False, True)},
    "attention-fp8": {"BLOCK_M": (64, 128), "BLOCK_N": (64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4),
                      "pv_fp32_sum": (False, True)},
    "attention-bwd": {"BLOCK_M1": (32, 64), "BLOCK_N1": (64, 128), "num_warps1": (4, 8), "num_stages1": (2, 3, 4),
                      "BLOCK_M2": (64, 128), "BLOCK_N2": (32, 64), "num_warps2": (4, 8), "num_stages2": (2, 3, 4)},
    "decode": {"BLOCK_N": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4, 5),
               "num_splits": (1, 2, 4, 8, 16, 32)},
    "mlp": {"policy": ("splitk", "seqsplit:8", "multirow:8", "halfrow"),
            "BLOCK_I": (64, 128), "BLOCK_N": (64, 128), "group": (0, 2, 4),
            "BLOCK_N1": (128, 256), "num_stages": (3, 4, 5), "use_tma": (False, True)},
}
PLAN_OPTIONS = {"attention": (), "attention-bwd": (), "attention-fp8": ("qk_format",), "decode": ("num_splits",), "mlp": ("policy",)}
NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False)"


class NotApplicable(Exception):
    """A candidate that does not exist for this shape (e.g. a split-K field on a prefill shape)."""


# --------------------------------------------------------------------------------------------
# candidates
# --------------------------------------------------------------------------------------------


def _value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    try:
        return int(text)
    except ValueError:
        return text.strip()


def config_classes(op: str) -> tuple:
    """The config dataclasses whose fields a candidate of ``op`` may replace."""
    if op == "attention":
        from flashflow.tuning.attention import AttentionConfig

        return (AttentionConfig,)
    if op == "attention-bwd":
        from flashflow.tuning.attention_bwd import AttentionBwdConfig

        return (AttentionBwdConfig,)
    if op == "attention-fp8":
        from flashflow.tuning.attention_fp8 import AttentionFp8Config

        return (AttentionFp8Config,)
    if op == "decode":
        from flashflow.tuning.decode import DecodeConfig

        return (DecodeConfig,)
    from flashflow.tuning.mlp import PersistentConfig, SplitKConfig

    return (SplitKConfig, PersistentConfig)


def tunable(op: str) -> tuple[str, ...]:
    """Every name ``--vary`` takes for ``op``: its configs' fields, then its plan options."""
    names = [f.name for cls in config_classes(op) for f in dataclasses.fields(cls)] + list(PLAN_OPTIONS[op])
    return tuple(dict.fromkeys(names))


def parse_vary(specs, op: str) -> dict:
    """``["BLOCK_N=64,128", ...]`` -> ``{"BLOCK_N": (64, 128)}`` (the op's AXES when empty).
    Raises ValueError naming the spec and the form expected."""
    if not specs:
        return dict(AXES[op])
    axes = {}
    for spec in specs:
        field, sep, values = spec.partition("=")
        field = field.strip()
        if not sep or not field or not values.strip():
            raise ValueError(f"--vary must be FIELD=V1,V2,... (e.g. num_stages=3,4), got {spec!r}")
        if field not in tunable(op):
            raise ValueError(f"--vary {spec!r}: {op} has no field {field!r}; it takes {', '.join(tunable(op))}")
        axes[field] = tuple(_value(v) for v in values.split(","))
    return axes


def candidates(axes: dict, product: bool = False) -> dict:
    """name -> overrides. ``shipped`` (no override) first; then one field at a time, or with
    ``product`` every combination of the axes' values."""
    out = {"shipped": {}}
    if product:
        fields = list(axes)
        for values in itertools.product(*(axes[f] for f in fields)):
            ov = dict(zip(fields, values))
            out[",".join(f"{f}={v}" for f, v in ov.items())] = ov
    else:
        for field, values in axes.items():
            for v in values:
                out[f"{field}={v}"] = {field: v}
    return out


def replace_fields(base, overrides: dict, plan_options=()):
    """``base`` (a frozen config dataclass) with the overrides that are its fields replaced;
    NotApplicable if an override is neither its field nor a plan option, or changes nothing."""
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = [k for k in overrides if k not in fields and k not in plan_options]
    if unknown:
        raise NotApplicable(f"{', '.join(unknown)} not a field of {type(base).__name__}")
    mine = {k: v for k, v in overrides.items() if k in fields}
    return dataclasses.replace(base, **mine)


def _same_as_shipped(base, overrides: dict, plan: dict) -> bool:
    """Whether a candidate only restates what ships (timed once, as ``shipped``)."""
    for k, v in overrides.items():
        current = getattr(base, k) if hasattr(base, k) else plan.get(k)
        if current != v:
            return False
    return True


# --------------------------------------------------------------------------------------------
# per-op cases: the shapes, the anchor, and how to build a candidate
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    label: str
    shape: dict
    anchor: object     # zero-argument callable, the reference output and the time to beat
    make: object       # overrides -> zero-argument callable (NotApplicable if it does not exist)
    work: float        # FLOP or bytes: work / seconds is the metric
    steps: int         # calls per CUDA graph (0: timed eagerly, do_bench on the call itself)
    shipped: dict      # the shipped config's fields and plan options
    repeat_check: int = 0   # > 0: a candidate must give the same bits this many times over


def _sdpa_anchor(qt, kt, vt, causal, gqa=False, mask=None):
    """SDPA on cuDNN (where cuDNN refuses the shape, FlashAttention's backend, or the
    memory-efficient one for a ``mask``, which FlashAttention's does not take); output in
    FlashAttention's (b, s, h, d) layout."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    second = SDPBackend.FLASH_ATTENTION if mask is None else SDPBackend.EFFICIENT_ATTENTION
    for backend in (SDPBackend.CUDNN_ATTENTION, second):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, attn_mask=mask, is_causal=causal, enable_gqa=gqa).transpose(1, 2)
        try:
            run()
        except RuntimeError:
            continue
        run.backend = "sdpa-" + backend.name.split("_")[0].lower()
        return run
    raise RuntimeError(f"neither cuDNN nor {second.name} SDPA runs this shape")


def _attention_shapes(args):
    from flashflow.bench.suites import attention_shapes

    # a mask replaces the causal one (SDPA takes one or the other): the non-causal shapes
    return [s for s in attention_shapes(args.quick) if (not args.head_dims or s.head_dim in args.head_dims)
            and not (args.mask and s.causal)]


def _attention_case(s, args) -> Case:
    import torch

    import flashflow
    from flashflow.device import gpu_family, next_pow2
    from flashflow.ops.attention import attention_forward
    from flashflow.tuning.attention import attention_config

    q, k, v = (torch.randn(s.batch, n, s.heads, s.head_dim, device="cuda", dtype=torch.bfloat16)
               for n in (s.seqlen_q, s.seqlen_k, s.seqlen_k))
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    mask = None
    if args.mask:
        # an additive score bias shared by every batch and head, the last eighth of the keys
        # masked out as padding would be
        mask = torch.randn(s.seqlen_q, s.seqlen_k, device="cuda", dtype=torch.bfloat16)
        mask[:, s.seqlen_k - s.seqlen_k // 8:] = float("-inf")
    anchor = _sdpa_anchor(qt, kt, vt, s.causal, mask=mask)
    base = attention_config(max(16, next_pow2(s.head_dim)), s.causal, gpu_family(q.device), bias=mask is not None)

    def make(ov):
        if not ov:
            if mask is not None:
                return lambda: flashflow.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)
            return lambda: flashflow.flash_attn_func(q, k, v, causal=s.causal)
        if _same_as_shipped(base, ov, {}):
            raise NotApplicable("the shipped config")
        cfg = replace_fields(base, ov)
        bias = None if mask is None else mask.expand(s.batch, s.heads, s.seqlen_q, s.seqlen_k)
        return lambda: attention_forward(q, k, v, bias=bias, softmax_scale=s.head_dim ** -0.5,
                                         window_right=0 if s.causal else None, return_lse=False,
                                         heavy_first=s.causal, config=cfg)[0]
    info = {**s.as_dict(), "mask": mask is not None}
    return Case(s.label + (" mask" if mask is not None else ""), info, anchor, make, s.flops, 4,
                dataclasses.asdict(base))


def _attention_bwd_shapes(args):
    from flashflow.bench.train import train_shapes

    if args.mask:
        raise ValueError("--mask applies to the forward's bias configs, not to attention-bwd")
    return train_shapes(args.quick, args.head_dims or (128,))


def _attention_bwd_case(shape, args) -> Case:
    """Forward + backward (the training step's attention) against SDPA on cuDNN, each call
    returning the three gradients flattened; candidates replace the backward's config (the
    forward ships as is) and must give identical bits over three runs (deterministic)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashflow
    from flashflow.bench.train import fwd_flops
    from flashflow.device import gpu_family
    from flashflow.ops.attention import attention_forward
    from flashflow.ops.attention_bwd import attention_backward
    from flashflow.ops.common import head_dim_pad
    from flashflow.tuning.attention_bwd import attention_bwd_config

    b, h, s, d, causal = shape
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    qt, kt, vt = (t.detach().transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
    dot = do.transpose(1, 2)
    scale = d ** -0.5

    def flat(gs, transpose=False):
        return torch.cat([(g.transpose(1, 2) if transpose else g).reshape(-1) for g in gs])

    def anchor():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        return flat(torch.autograd.grad(out, (qt, kt, vt), dot), transpose=True)
    anchor.backend = "sdpa-cudnn"
    base = attention_bwd_config(head_dim_pad(d), gpu_family(q.device))

    def make(ov):
        if not ov:
            def shipped():
                out = flashflow.flash_attn_func(*leaves, causal=causal)
                return flat(torch.autograd.grad(out, leaves, do))
            return shipped
        if _same_as_shipped(base, ov, {}):
            raise NotApplicable("the shipped config")
        cfg = replace_fields(base, ov)

        def run():
            out, lse = attention_forward(q, k, v, softmax_scale=scale, window_right=0 if causal else None,
                                         return_lse=True, heavy_first=causal)
            return flat(attention_backward(q, k, v, out, lse, do, None, scale, False, 0, causal, 0, 0.0,
                                           config=cfg))
        return run
    info = {"batch": b, "heads": h, "seqlen": s, "head_dim": d, "causal": causal}
    label = f"b{b} h{h} s{s} d{d}" + (" causal" if causal else "")
    return Case(label, info, anchor, make, 3.5 * fwd_flops(b, h, s, d, causal), 0, dataclasses.asdict(base),
                repeat_check=3)


def _attention_fp8_shapes(args):
    from flashflow.ops.attention_fp8 import FP8_HEAD_DIMS

    return [s for s in _attention_shapes(args) if s.head_dim in FP8_HEAD_DIMS]


def _attention_fp8_case(s, args) -> Case:
    """The FP8 forward, its quantize pass included, against SDPA (cuDNN) in bf16."""
    import torch

    from flashflow.device import gpu_family
    from flashflow.ops.attention_fp8 import attention_fp8_forward, flash_attn_fp8_func
    from flashflow.tuning.attention_fp8 import attention_fp8_config

    if args.mask:
        raise ValueError("--mask applies to the bf16 attention's bias configs, not to attention-fp8")
    q, k, v = (torch.randn(s.batch, n, s.heads, s.head_dim, device="cuda", dtype=torch.bfloat16)
               for n in (s.seqlen_q, s.seqlen_k, s.seqlen_k))
    anchor = _sdpa_anchor(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), s.causal)
    base = attention_fp8_config(s.head_dim, s.causal, gpu_family(q.device))

    def make(ov):
        if not ov:
            return lambda: flash_attn_fp8_func(q, k, v, causal=s.causal)
        plan = {key: ov[key] for key in PLAN_OPTIONS["attention-fp8"] if key in ov}
        if _same_as_shipped(base, ov, plan) and plan.get("qk_format", "int8") == "int8":
            raise NotApplicable("the shipped config")
        cfg = replace_fields(base, ov, PLAN_OPTIONS["attention-fp8"])
        fmt = plan.get("qk_format", "int8")
        return lambda: attention_fp8_forward(q, k, v, None, s.head_dim ** -0.5, s.causal, False, fmt, cfg)[0]
    return Case(s.label, s.as_dict(), anchor, make, s.flops, 4, dataclasses.asdict(base))


def _tolerance(args) -> float:
    if args.op == "decode" and getattr(args, "fp8", False):
        return FP8_CACHE_TOLERANCE
    return TOLERANCES.get(args.op, TOLERANCE)


def _decode_shapes(args):
    from flashflow.bench.decode import decode_shapes

    return [(*shape, paged) for shape in decode_shapes(args.quick) for paged in (False, True)[:1 + args.paged]]


def _decode_case(shape, args) -> Case:
    import torch

    from flashflow.bench.decode import PAGE_SIZE, cycling, kv_bytes, paged_copy, rotation
    from flashflow.ops.decode import DecodePlan

    b, s, h, hk, d, paged = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    nbytes = kv_bytes(b, s, hk, d)
    # caches under three L2s are cloned and the steps cycle through the clones: a step must not
    # find the previous step's cache in L2 (in a model the other layers' weights flush it)
    copies = rotation(nbytes, torch.cuda.get_device_properties(0).L2_cache_size)

    def clones(*ts):
        return [ts] + [tuple(t.clone() for t in ts) for _ in range(copies - 1)]

    qt = q.transpose(1, 2)
    anchors = [_sdpa_anchor(qt, a, c, False, gqa=h != hk)
               for a, c in clones(kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous())]
    anchor = cycling(lambda i: anchors[i], copies)
    anchor.backend = anchors[0].backend
    table = None
    fp8 = getattr(args, "fp8", False)
    scales = {}
    if fp8:
        from flashflow.ops.decode import quantize_kv_cache
        kc, ks = quantize_kv_cache(kc)
        vc, vs = quantize_kv_cache(vc)
        scales = {"k_scale": ks, "v_scale": vs}
        nbytes = kv_bytes(b, s, hk, d, 1)
        copies = rotation(nbytes, torch.cuda.get_device_properties(0).L2_cache_size)
    kv_dtype = kc.dtype if fp8 else None
    if paged:
        # pages of bytes: an FP8 tensor is copied as uint8 (index_put has no FP8 kernel)
        kb, vb, table = paged_copy(kc.view(torch.uint8) if fp8 else kc, vc.view(torch.uint8) if fp8 else vc,
                                   PAGE_SIZE, generator=g)
        kc, vc = (kb.view(torch.float8_e4m3fn), vb.view(torch.float8_e4m3fn)) if fp8 else (kb, vb)
    caches = clones(kc, vc)
    shipped = DecodePlan(b, h, hk, d, s, device="cuda", kv_dtype=kv_dtype)
    # a paged cache may ship page-sized tiles: candidates start from what this launch runs
    base = shipped.config_for(PAGE_SIZE if paged else None)
    plan_opts = {"num_splits": shipped.num_splits}

    def make(ov):
        plan = shipped
        if ov:
            if _same_as_shipped(base, ov, plan_opts):
                raise NotApplicable("the shipped config")
            cfg = replace_fields(base, ov, PLAN_OPTIONS["decode"])
            opts = {**plan_opts, **{k: v for k, v in ov.items() if k in plan_opts}}
            try:
                plan = DecodePlan(b, h, hk, d, s, device="cuda", config=cfg, kv_dtype=kv_dtype, **opts)
            except ValueError as e:
                raise NotApplicable(str(e)) from e
            if plan.num_splits != opts["num_splits"]:   # capped (DecodePlan): it would run as another candidate
                raise NotApplicable(f"num_splits {opts['num_splits']} is capped at {plan.num_splits} for this cache")
        return cycling(lambda i: lambda: plan.run(q, *caches[i], cache_seqlens=lens, block_table=table, **scales),
                       copies)
    label = f"b{b} s{s} h{h}/{hk} d{d}{' paged' if paged else ''}{' fp8' if fp8 else ''}"
    info = {"batch": b, "seqlen": s, "heads": h, "kv_heads": hk, "head_dim": d, "paged": paged, "fp8": fp8,
            "copies": copies}
    return Case(label, info, anchor, make, nbytes, 16, {**dataclasses.asdict(base), **plan_opts})


def _mlp_shapes(args):
    from flashflow.bench import mlp_suite

    tokens = args.tokens or (mlp_suite.QUICK_TOKENS if args.quick else mlp_suite.TOKENS)
    return [(*mo, m) for mo in mlp_suite.MODELS if not args.models or mo[0] in args.models for m in tokens]


def _mlp_case(shape, args) -> Case:
    import torch

    from flashflow.bench import mlp_suite
    from flashflow.ops import mlp

    model, act, hidden, inter, m = shape
    x, w1, w2 = mlp_suite.make_inputs(act, hidden, inter, m, torch.bfloat16)
    ws = mlp.MlpWorkspace(hidden, max_tokens=m, device="cuda")
    shipped_policy = _mlp_shipped(None, x, w2, act)

    def make(ov):
        if not ov:
            return lambda: mlp.fused_mlp(x, w1, w2, act, workspace=ws)
        policy = ov.get("policy", shipped_policy)
        if policy == "cublas":
            raise NotApplicable("cuBLAS is the anchor")
        name, rows = mlp.parse_policy(policy)
        if name == "splitk" and m > mlp.DECODE_MAX_M:
            raise NotApplicable(f"split-K takes at most {mlp.DECODE_MAX_M} tokens")
        base = _mlp_shipped(name, x, w2, act)
        if _same_as_shipped(base, ov, {"policy": shipped_policy}):
            raise NotApplicable("the shipped config")
        cfg = replace_fields(base, ov, PLAN_OPTIONS["mlp"])
        if name == "splitk":
            return lambda: mlp.launch_splitk(x, w1, w2, act, ws, config=cfg)
        return lambda: mlp.launch_persistent(x, w1, w2, act, name, rows, ws, config=cfg)
    info = {"model": model, "activation": act, "hidden": hidden, "intermediate": inter, "M": m}
    kernel = "splitk" if shipped_policy == "splitk" else "persistent"
    return Case(f"{model} M={m}", info, lambda: mlp.launch_cublas(x, w1, w2, act), make,
                mlp_suite.weight_bytes(act, hidden, inter), mlp_suite.steps_for(m),
                {**dataclasses.asdict(_mlp_shipped(kernel, x, w2, act)), "policy": shipped_policy})


def _mlp_shipped(kernel, x, w2, act):
    """What ships for this shape: with ``kernel`` None the plan ``policy="auto"`` runs
    (``"splitk"``, ``"cublas"`` or a tile order ``NAME:R``); with ``"splitk"`` that kernel's
    config, with any other policy name the persistent kernel's."""
    from flashflow.device import gpu_family, num_sms
    from flashflow.tuning import mlp as tuning

    family, sms, gated, (m, _), inter = gpu_family(x.device), num_sms(x.device), act == "swiglu", x.shape, w2.shape[1]
    if kernel is None:
        return tuning.auto_plan(family, gated, m, inter, sms)
    if kernel == "splitk":
        return tuning.splitk_config(family, gated, m, inter, sms)
    return tuning.persistent_config(family, gated, m, str(x.dtype).replace("torch.", ""))


# op -> (its shapes from the parsed arguments, the case of one shape)
OPS = {"attention": (_attention_shapes, _attention_case), "attention-bwd": (_attention_bwd_shapes, _attention_bwd_case),
       "attention-fp8": (_attention_fp8_shapes, _attention_fp8_case), "decode": (_decode_shapes, _decode_case),
       "mlp": (_mlp_shapes, _mlp_case)}
UNITS = {"attention": "TFLOP/s", "attention-bwd": "TFLOP/s", "attention-fp8": "TFLOP/s", "decode": "TB/s", "mlp": "TB/s"}
ANCHORS = {"attention": "sdpa", "attention-bwd": "sdpa", "attention-fp8": "sdpa", "decode": "sdpa", "mlp": "torch+graph"}


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def _rel(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def tune_case(case: Case, cands: dict, rounds: int, warmup: int, rep: int, bar,
              tolerance: float = TOLERANCE) -> dict:
    """One shape: check every candidate against the anchor, then time them all, interleaved."""
    import torch

    from flashflow.bench.decode import eager_time_ms, graph_time_ms

    ref = case.anchor()
    fns = {"anchor": case.anchor}
    row = {"label": case.label, "shape": case.shape, "shipped_config": case.shipped,
           "anchor": getattr(case.anchor, "backend", None), "candidates": {}, "skipped": {}}
    for name, ov in cands.items():
        try:
            fn = case.make(ov)
            out = fn()
            err = _rel(out, ref)
            if case.repeat_check and not all(torch.equal(out, fn()) for _ in range(case.repeat_check - 1)):
                row["candidates"][name] = {"overrides": ov, "rel_err": err,
                                           "error": f"run-to-run different over {case.repeat_check} runs"}
                continue
        except NotApplicable as e:
            row["skipped"][name] = str(e)
            continue
        except Exception as e:  # noqa: BLE001 — a config that does not compile or fit is a result
            row["candidates"][name] = {"overrides": ov, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        row["candidates"][name] = {"overrides": ov, "rel_err": err}
        if err <= tolerance:
            fns[name] = fn
        else:
            row["candidates"][name]["error"] = f"relative error {err:.2e} > {tolerance}"
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    samples = {name: [] for name in fns}
    if case.steps:
        timer = lambda f: graph_time_ms(f, case.steps, warmup, rep)  # noqa: E731
    else:
        timer = lambda f: eager_time_ms(f, warmup, rep)  # noqa: E731
    for r in range(rounds):
        order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]   # rotate who runs first
        for name in order:
            try:
                samples[name].append(timer(fns[name]) * 1e3)
            except Exception as e:  # noqa: BLE001
                samples[name].append(None)
                row["candidates"].setdefault(name, {})["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            bar.update()
    bar.update(rounds * (len(cands) + 1 - len(fns)))   # skipped or refused: done too
    base = samples.pop("anchor")
    row["anchor_us"] = statistics.median(u for u in base if u is not None)
    for name, us in samples.items():
        if None in us:
            continue
        med = statistics.median(us)
        row["candidates"][name].update(us=med, rounds_us=[round(u, 2) for u in us],
                                       metric=case.work / (med * 1e-6) / 1e12,
                                       vs_anchor=statistics.median(b / u for b, u in zip(base, us)))
    timed = {n: c for n, c in row["candidates"].items() if "us" in c}
    if timed:
        row["best"] = min(timed, key=lambda n: timed[n]["us"])
    return row


def table(rows, unit: str, anchor: str) -> str:
    head = f"| shape | {anchor} µs | shipped µs | {unit} | best | µs | {unit} | best ÷ shipped |"
    lines = [head, "|:--|--:|--:|--:|:--|--:|--:|--:|"]
    for r in rows:
        c = r["candidates"]
        ship, best = c.get("shipped", {}), c.get(r.get("best"), {})

        def cell(d, key, spec):
            return format(d[key], spec) if key in d else "—"
        gain = f"{ship['us'] / best['us']:.3f}" if "us" in ship and "us" in best else "—"
        lines.append(f"| {r['label']} | {r['anchor_us']:.1f} | {cell(ship, 'us', '.1f')} | "
                     f"{cell(ship, 'metric', '.2f')} | {r.get('best', '—')} | {cell(best, 'us', '.1f')} | "
                     f"{cell(best, 'metric', '.2f')} | {gain} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown (empty ones say "none" in their help instead), the description's paragraphs kept."""

    def _get_help_string(self, action):
        if action.default in (None, (), "", False):
            return action.help
        return super()._get_help_string(action)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("tune", help="time candidate configs of an op beside its anchor (GPU)",
                              description=__doc__, formatter_class=_Formatter)
    p.add_argument("op", choices=sorted(AXES), help="which op's configs to sweep")
    p.add_argument("--vary", action="append", default=None, metavar="FIELD=V1,V2",
                   help="a field (or plan option) and its values; repeat for more. Default per op: "
                        + "; ".join(f"{op}: " + " ".join(f"{f}={','.join(map(str, v))}" for f, v in ax.items())
                                    for op, ax in AXES.items()))
    p.add_argument("--product", action="store_true",
                   help="every combination of the --vary values, not one field at a time")
    p.add_argument("--quick", action="store_true", help="the bench suite's quick shapes")
    p.add_argument("--head-dims", type=_int_list, default=(), metavar="D,D",
                   help="attention: only these head dims (none: all the suite's); attention-bwd: "
                        "these head dims (none: 128)")
    p.add_argument("--mask", action="store_true",
                   help="attention: an additive float mask (SDPA's attn_mask) on the non-causal shapes; "
                        "sweeps the bias configs")
    p.add_argument("--paged", action="store_true", help="decode: also 64-token pages behind a shuffled table")
    p.add_argument("--fp8", action="store_true", help="decode: FP8 (e4m3) caches with per-head scales")
    p.add_argument("--models", default="", help="mlp: comma list of the mlp suite's FFNs (none: all)")
    p.add_argument("--tokens", type=_int_list, default=(), metavar="M,M",
                   help="mlp: token counts (none: the mlp suite's)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (medians reported)")
    p.add_argument("--warmup", type=int, default=25, metavar="MS", help="do_bench warm-up per measurement")
    p.add_argument("--rep", type=int, default=100, metavar="MS", help="do_bench measuring time per measurement")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder of the JSON")
    p.set_defaults(func=main, parser=p)


def _validate(args):
    """Parsed options that argparse cannot check alone (ValueError with the fix)."""
    from flashflow.bench import mlp_suite

    args.models = tuple(m for m in args.models.split(",") if m)
    known = [mo[0] for mo in mlp_suite.MODELS]
    bad = [m for m in args.models if m not in known]
    if bad:
        raise ValueError(f"--models must be a comma list of {', '.join(known)}, got {', '.join(bad)}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    for flag in ("paged", "fp8"):
        if getattr(args, flag, False) and args.op != "decode":
            raise ValueError(f"--{flag} applies to decode only, not {args.op}")
    return candidates(parse_vary(args.vary, args.op), args.product)


def main(args: argparse.Namespace) -> int:
    parser = getattr(args, "parser", None)
    try:
        cands = _validate(args)
    except ValueError as e:
        if parser is None:
            raise
        parser.error(str(e))   # exits 2 with the usage line
    import torch

    from flashflow.device import interpreting

    if not torch.cuda.is_available() or interpreting():
        reason = NO_GPU if not torch.cuda.is_available() else "times the GPU: unset TRITON_INTERPRET"
        print(f"flashflow tune: {reason}", file=sys.stderr)
        return 2
    from flashflow.bench import runner
    from flashflow.progress import progress

    env = runner.environment()
    shapes_of, case_of = OPS[args.op]
    shapes = shapes_of(args)
    rows = []
    with progress(len(shapes) * args.rounds * (len(cands) + 1), f"tune {args.op}") as bar:
        for shape in shapes:
            case = case_of(shape, args)
            rows.append(tune_case(case, cands, args.rounds, args.warmup, args.rep, bar, _tolerance(args)))
            del case   # its tensors, before the next shape allocates
            torch.cuda.empty_cache()
    suite = f"tune-{args.op}" + ("-fp8" if args.op == "decode" and getattr(args, "fp8", False) else "")
    result = {"suite": suite, **env, "dtype": "bfloat16", "unit": UNITS[args.op],
              "tolerance": _tolerance(args), "candidates": cands, "rows": rows,
              "timing": {"rounds": args.rounds, "warmup_ms": args.warmup, "rep_ms": args.rep,
                         "return_mode": "median", "cuda_graph": args.op != "attention-bwd"}}
    path = runner.write_result(result, args.out)
    print(table(rows, UNITS[args.op], ANCHORS[args.op]))
    print(f"\nresults: {path}")
    return 0
