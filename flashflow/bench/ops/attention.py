"""The attention forward as the benchmarks see it: its info launches (every entry of the shipped
config table, both code paths of a config with a tail split) and its tune cases (the attention
suite's shapes against SDPA on cuDNN; ``--mask``: an additive mask, the bias configs)."""
from __future__ import annotations

import dataclasses

from flashflow.bench.spec import (InfoCase, NotApplicable, OpSpec, TuneCase, TuneOption, int_list, replace_fields,
                                  same_as_shipped)
from flashflow.device import cdiv
from flashflow.tuning.attention import AttentionConfig, config_from_entry, shipped_entries

# info's launches: several query tiles per head, so the main loop is the one that runs
BATCH, SEQLEN, HEADS = 1, 1024, 4


# ----------------------------------------------------------------------------- info


def shipped_configs(family: str | None = None) -> list[dict]:
    """Entries of the attention config table in table order, each with its family; all families
    if None."""
    try:
        return shipped_entries(family)
    except ValueError as e:
        raise ValueError(f"--{e}") from None


def _forward(device: str, cfg: AttentionConfig, head_dim: int, causal: bool, bias: bool = False,
             **launch) -> None:
    """The forward launch with the arguments flash_attn_func passes (with ``bias``: what
    scaled_dot_product_attention passes for a (seqlen, seqlen) attn_mask), so the kernel is the
    one the benchmark times; ``cfg`` and ``launch`` force a config and a code path."""
    import torch

    from flashflow.ops.attention import attention_forward

    q, k, v = (torch.empty(BATCH, SEQLEN, HEADS, head_dim, device=device, dtype=torch.bfloat16)
               for _ in range(3))
    if bias:
        launch["bias"] = torch.zeros(SEQLEN, SEQLEN, device=device).expand(BATCH, HEADS, SEQLEN, SEQLEN)
    attention_forward(q, k, v, softmax_scale=head_dim ** -0.5, window_right=0 if causal else None,
                      heavy_first=causal, return_lse=False, config=cfg, **launch)


def variants(cfg: AttentionConfig, causal: bool, bias: bool = False):
    """(name, config, extra launch arguments) of each code path a config ships.

    The tail split compiles its own variant of the forward kernel plus a merge kernel, and
    whether it runs depends on the SM count; both paths are forced here so both are reported.
    """
    if not getattr(cfg, "tail_split", False) or bias:   # the ops split only launches without a bias
        yield "main", cfg, {}
        return
    yield "main", cfg.replace(tail_split=False), {}
    if not causal:  # the ops split only plain (unmasked, non-varlen) launches
        tiles = cdiv(SEQLEN, cfg.BLOCK_M) * HEADS * BATCH
        # with twice as many SMs as tiles, the single wave is half empty: the ops split it
        yield "tail split", cfg, {"num_sms": 2 * tiles}


def config_columns(entry: dict, causal, variant) -> dict:
    return {"family": entry["family"], "head_dim_max": entry["head_dim_max"], "causal": causal,
            "bias": bool(entry.get("bias")), "variant": variant, **config_from_entry(entry).as_dict()}


def info_cases(family: str | None) -> list[InfoCase]:
    cases = []
    for entry in shipped_configs(family):
        for causal in (False, True) if entry["causal"] is None else (entry["causal"],):
            bias = bool(entry.get("bias"))
            for variant, cfg, extra in variants(config_from_entry(entry), causal, bias):
                def launch(device, cfg=cfg, d=entry["head_dim_max"], causal=causal, bias=bias, extra=extra):
                    _forward(device, cfg, d, causal, bias, **extra)
                label = f"d<={entry['head_dim_max']}{' causal' if causal else ''}{' bias' if bias else ''} {variant}"
                cases.append(InfoCase("attention", label, launch, config_columns(entry, causal, variant)))
    return cases


def info_listing(family: str) -> list[InfoCase]:
    """Nothing launched: one row per table entry, as the table ships it."""
    return [InfoCase("attention", "", None, config_columns(e, e["causal"], None)) for e in shipped_configs(family)]


# ----------------------------------------------------------------------------- tune


def tune_shapes(args):
    from flashflow.bench.suites import attention_shapes

    # a mask replaces the causal one (SDPA takes one or the other): the non-causal shapes
    return [s for s in attention_shapes(args.quick) if (not args.head_dims or s.head_dim in args.head_dims)
            and not (args.mask and s.causal)]


def tune_case(s, args) -> TuneCase:
    import torch

    import flashflow
    from flashflow.bench.providers import sdpa_anchor
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
    anchor = sdpa_anchor(qt, kt, vt, s.causal, mask=mask)
    base = attention_config(max(16, next_pow2(s.head_dim)), s.causal, gpu_family(q.device), bias=mask is not None)

    def make(ov):
        if not ov:
            if mask is not None:
                return lambda: flashflow.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)
            return lambda: flashflow.flash_attn_func(q, k, v, causal=s.causal)
        if same_as_shipped(base, ov, {}):
            raise NotApplicable("the shipped config")
        cfg = replace_fields(base, ov)
        bias = None if mask is None else mask.expand(s.batch, s.heads, s.seqlen_q, s.seqlen_k)
        return lambda: attention_forward(q, k, v, bias=bias, softmax_scale=s.head_dim ** -0.5,
                                         window_right=0 if s.causal else None, return_lse=False,
                                         heavy_first=s.causal, config=cfg)[0]
    info = {**s.as_dict(), "mask": mask is not None}
    return TuneCase(s.label + (" mask" if mask is not None else ""), info, anchor, make, s.flops, 4,
                    dataclasses.asdict(base))


SPEC = OpSpec(
    name="attention",
    info_title=f"attention forward, one config table entry per line (bf16, batch {BATCH}, seqlen {SEQLEN}, "
               f"{HEADS} heads, head_dim = d<=)",
    info_cases=info_cases,
    info_listing=info_listing,
    info_shows_config=True,
    suite="attention",
    axes={"BLOCK_M": (64, 128), "BLOCK_N": (64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4),
          "use_tma": (False, True), "warp_specialize": (False, True)},
    config_classes=(AttentionConfig,),
    unit="TFLOP/s",
    anchor="sdpa",
    tune_shapes=tune_shapes,
    tune_case=tune_case,
    tune_options=(
        TuneOption(("--head-dims",), dict(type=int_list, default=(), metavar="D,D",
                                          help="attention: only these head dims (none: all the suite's); "
                                               "attention-bwd: these head dims (none: 128)")),
        TuneOption(("--mask",), dict(action="store_true",
                                     help="attention: an additive float mask (SDPA's attn_mask) on the "
                                          "non-causal shapes; sweeps the bias configs"))),
    tune_takes=("head_dims", "mask"),
)
