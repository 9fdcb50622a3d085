"""The Gluon attention forward (Hopper) as the benchmarks see it: each entry of its config table
for ``flashflow info`` (with the registers of each warp role), and the kernel at candidate
configs against SDPA (cuDNN) for ``flashflow tune`` at the attention suite's shapes of the head
dims it has configs for. The dispatcher's choice between it and the portable kernel is
``flashflow.ops.attention_gluon``'s; the attention suite times whichever the dispatcher takes."""
from __future__ import annotations

import dataclasses

from flashflow.bench.ops import attention
from flashflow.bench.ops.attention import BATCH, HEADS, SEQLEN
from flashflow.bench.spec import InfoCase, NotApplicable, OpSpec, TuneCase, replace_fields, same_as_shipped
from flashflow.tuning.attention_gluon import CONFIGS, GluonAttentionConfig, supported_families

# ----------------------------------------------------------------------------- info


def _forward(device: str, cfg: GluonAttentionConfig, head_dim: int, causal: bool) -> None:
    """The Gluon forward at one config, launched as the dispatcher launches it."""
    import torch

    from flashflow.ops.attention_gluon import gluon_forward

    q, k, v = (torch.empty(BATCH, SEQLEN, HEADS, head_dim, device=device, dtype=torch.bfloat16)
               for _ in range(3))
    gluon_forward(q, k, v, softmax_scale=head_dim ** -0.5, window_right=0 if causal else None, heavy_first=causal,
                  return_lse=False, config=cfg)


def roles(cfg: GluonAttentionConfig) -> str:
    """Registers per warp role of a config (the kernel's ``warp_specialize`` budgets: the
    cubin's figure is what a thread starts with, before the partitions move registers)."""
    if not cfg.warp_specialize:
        return f"{cfg.num_warps} MMA warps, no load warp"
    if cfg.split_warpgroups and cfg.partitions == 3:
        return "3 MMA partitions x 4 warps at 160 registers (the first 168), 1 load warp at 24"
    if cfg.split_warpgroups:
        return "2 MMA partitions x 4 warps at 240 registers, 1 load warp at 24"
    return f"{cfg.num_warps} MMA warps, 1 load warp at 24 registers"


def info_cases(family: str | None) -> list[InfoCase]:
    """Each entry of ``attention_gluon.json``, causal and not where it holds for both (Hopper
    only; other families: none)."""
    if family is not None and family not in supported_families():
        return []
    cases = []
    for entry in CONFIGS.shipped_entries(family):
        cfg = CONFIGS.from_entry(entry)
        for causal in (False, True) if entry["causal"] is None else (entry["causal"],):
            keys = f", up to {entry['seqlen_k_max']} keys" if entry.get("seqlen_k_max") else ""
            label = f"d{entry['head_dim']}{' causal' if causal else ''}{keys}{'' if cfg.auto else ' (forced only)'}"
            cases.append(InfoCase("attention-gluon", label,
                                  lambda device, cfg=cfg, d=entry["head_dim"], causal=causal:
                                  _forward(device, cfg, d, causal),
                                  {"family": entry["family"], "head_dim": entry["head_dim"], "causal": causal,
                                   "roles": roles(cfg), **cfg.as_dict()}))
    return cases


# ----------------------------------------------------------------------------- tune


def tune_shapes(args):
    heads = {e["head_dim"] for e in CONFIGS.shipped_entries("sm90")}
    return [s for s in attention.tune_shapes(args) if s.head_dim in heads]


def tune_case(s, args) -> TuneCase:
    """The Gluon forward at the shipped config and at candidates, against SDPA (cuDNN)."""
    import torch

    from flashflow.bench.providers import sdpa_anchor
    from flashflow.device import gpu_family
    from flashflow.ops.attention_gluon import gluon_forward
    from flashflow.tuning.attention_gluon import gluon_attention_config

    q, k, v = (torch.randn(s.batch, n, s.heads, s.head_dim, device="cuda", dtype=torch.bfloat16)
               for n in (s.seqlen_q, s.seqlen_k, s.seqlen_k))
    anchor = sdpa_anchor(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), s.causal)
    base = gluon_attention_config(s.head_dim, s.causal, gpu_family(q.device), s.seqlen_k)

    def make(ov):
        if ov and same_as_shipped(base, ov, {}):
            raise NotApplicable("the shipped config")
        try:
            cfg = replace_fields(base, ov) if ov else base
        except ValueError as e:   # a combination the kernel cannot be (GluonAttentionConfig's rules)
            raise NotApplicable(str(e)) from None
        return lambda: gluon_forward(q, k, v, softmax_scale=s.head_dim ** -0.5,
                                     window_right=0 if s.causal else None, return_lse=False,
                                     heavy_first=s.causal, config=cfg)[0]
    return TuneCase(s.label, s.as_dict(), anchor, make, s.flops, 4, dataclasses.asdict(base))


SPEC = OpSpec(
    name="attention-gluon",
    info_title=f"the Gluon attention forward (Hopper), one config table entry per line (bf16, batch {BATCH}, "
               f"seqlen {SEQLEN}, {HEADS} heads)",
    info_cases=info_cases,
    info_shows_config=True,
    suite="attention",
    axes={"BLOCK_M": (128, 192), "BLOCK_N": (64, 128), "num_stages": (2, 3), "pingpong": (False, True),
          "split_warpgroups": (False, True), "persistent": (False, True), "dynamic": (False, True),
          "overlap_tiles": (False, True), "split_last_wave": (False, True), "max_pieces": (4, 8, 16)},
    config_classes=(GluonAttentionConfig,),
    unit="TFLOP/s",
    anchor="sdpa",
    tune_shapes=tune_shapes,
    tune_case=tune_case,
    tune_takes=("head_dims",),
)
