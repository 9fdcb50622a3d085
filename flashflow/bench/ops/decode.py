"""Decode attention as the benchmarks see it: ``flashflow info`` launches the decode suite's
batch-1 shapes, the other head sizes, a paged cache, a large batch and the split merge;
``flashflow tune`` times the decode suite's shapes (``--paged``: also on pages, ``--fp8``: on FP8
caches) against SDPA on cuDNN, cold in L2."""
from __future__ import annotations

import dataclasses

from flashflow.bench.spec import InfoCase, NotApplicable, OpSpec, TuneCase, TuneOption, replace_fields, same_as_shipped
from flashflow.tuning.decode import DecodeConfig

PLAN_OPTIONS = ("num_splits",)
# an FP8 KV cache against SDPA bf16 on the unquantized one: e4m3's three mantissa bits put
# Gaussian caches 3.6-3.9% from the bf16 result (docs/decode.md)
FP8_CACHE_TOLERANCE = 5e-2


# ----------------------------------------------------------------------------- info


def _decode(device: str, batch: int, seqlen: int, heads: int, kv_heads: int, head_dim: int,
            page: int | None = None) -> None:
    import torch

    from flashflow import flash_attn_with_kvcache

    q = torch.zeros(batch, 1, heads, head_dim, device=device, dtype=torch.bfloat16)
    if page:
        kc = torch.zeros(batch * seqlen // page, page, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
        table = torch.arange(batch * seqlen // page, device=device, dtype=torch.int32).view(batch, -1)
    else:
        kc, table = torch.zeros(batch, seqlen, kv_heads, head_dim, device=device, dtype=torch.bfloat16), None
    # causal=True: the build that bench/results/info-nvidia-h100-80gb-hbm3.json reports. With one
    # query token it changes no result, only the build: the default (causal=False) compiles the
    # right-bound mask out (117 registers against 148 at head_dim 128 on sm90)
    flash_attn_with_kvcache(q, kc, kc, cache_seqlens=seqlen, block_table=table, causal=True)


def _merge_states(device: str) -> None:
    import torch

    from flashflow import merge_attention_states

    out = torch.zeros(1, 1, 32, 128, device=device, dtype=torch.bfloat16)
    lse = torch.zeros(1, 32, 1, device=device)
    merge_attention_states(out, lse, out, lse)


def info_cases(family: str | None = None) -> list[InfoCase]:
    """The decode suite's batch-1 shapes (head_dim 128), head_dim 64 and 256, a paged cache and
    a batch large enough that the programs outnumber the SMs; the merge of split results."""
    from flashflow.bench.decode import PAGE_SIZE, decode_shapes

    shapes = [(b, s, h, hk, d, None) for b, s, h, hk, d in decode_shapes(quick=True) if b == 1]
    shapes += [(1, 8192, 32, 8, 64, None), (1, 8192, 32, 8, 256, None), (1, 8192, 32, 8, 128, PAGE_SIZE),
               (64, 4096, 32, 8, 128, None)]
    cases = []
    for b, s, h, hk, d, page in shapes:
        label = f"b{b} s{s} h{h}/{hk} d{d}" + (f" paged {page}" if page else "")
        cases.append(InfoCase("decode", label, lambda device, a=(b, s, h, hk, d, page): _decode(device, *a)))
    cases.append(InfoCase("decode", "merge_attention_states b1 h32 d128", _merge_states))
    return cases


# ----------------------------------------------------------------------------- tune


def tune_shapes(args):
    from flashflow.bench.decode import decode_shapes

    return [(*shape, paged) for shape in decode_shapes(args.quick) for paged in (False, True)[:1 + args.paged]]


def tune_case(shape, args) -> TuneCase:
    import torch

    from flashflow.bench.decode import PAGE_SIZE, kv_bytes, paged_copy
    from flashflow.bench.providers import sdpa_anchor
    from flashflow.bench.timing import cycling, l2_bytes, rotation
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
    copies = rotation(nbytes, l2_bytes())

    def clones(*ts):
        return [ts] + [tuple(t.clone() for t in ts) for _ in range(copies - 1)]

    qt = q.transpose(1, 2)
    anchors = [sdpa_anchor(qt, a, c, False, gqa=h != hk)
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
        copies = rotation(nbytes, l2_bytes())
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
            if same_as_shipped(base, ov, plan_opts):
                raise NotApplicable("the shipped config")
            cfg = replace_fields(base, ov, PLAN_OPTIONS)
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
    return TuneCase(label, info, anchor, make, nbytes, 16, {**dataclasses.asdict(base), **plan_opts})


SPEC = OpSpec(
    name="decode",
    info_title="decode attention through flash_attn_with_kvcache (bf16, one query token)",
    info_cases=info_cases,
    suite="decode",
    axes={"BLOCK_N": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4, 5),
          "num_splits": (1, 2, 4, 8, 16, 32)},
    plan_options=PLAN_OPTIONS,
    config_classes=(DecodeConfig,),
    unit="TB/s",
    anchor="sdpa",
    tune_shapes=tune_shapes,
    tune_case=tune_case,
    # a decode step reads a cache the other layers have flushed from L2
    tune_timing="cold-l2",
    tune_options=(
        TuneOption(("--paged",), dict(action="store_true", help="decode: also 64-token pages behind a shuffled table")),
        TuneOption(("--fp8",), dict(action="store_true", help="decode: FP8 (e4m3) caches with per-head scales"))),
    tune_takes=("paged", "fp8"),
    option_tolerances={"fp8": FP8_CACHE_TOLERANCE},
    result_flags=("fp8",),
)
