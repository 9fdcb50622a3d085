"""The attention backward as the benchmarks see it: its kernels (dQ with δ, dK/dV, and the δ
kernel of a backward without dQ) at each entry of its config table for ``flashflow info``, and
forward + backward against SDPA on cuDNN for ``flashflow tune`` (the train suite's shapes)."""
from __future__ import annotations

import dataclasses

from flashflow.bench.ops.attention import BATCH, HEADS, SEQLEN
from flashflow.bench.spec import InfoCase, NotApplicable, OpSpec, TuneCase, replace_fields, same_as_shipped
from flashflow.tuning.attention_bwd import AttentionBwdConfig


# ----------------------------------------------------------------------------- info


def _backward(device: str, head_dim: int, causal: bool, frozen_q: bool = False) -> None:
    import torch

    from flashflow import flash_attn_func

    make = torch.empty if device == "cpu" else torch.randn
    q, k, v = (make(BATCH, SEQLEN, HEADS, head_dim, device=device, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    if frozen_q:
        q.requires_grad_(False)
    flash_attn_func(q, k, v, causal=causal).backward(torch.ones_like(q))


def info_cases(family: str | None) -> list[InfoCase]:
    """The backward's kernels through ``flash_attn_func`` + autograd at the largest head_dim of
    each entry of its config table: dQ (with δ) and dK/dV, causal and not (the causal build masks
    its diagonal blocks), and with a frozen q the δ kernel and dK/dV."""
    from flashflow.tuning import table

    entries = table("attention_bwd").get(family, ()) if family else table("attention_bwd")["sm90"]
    cases = []
    for entry in entries:
        d = entry["head_dim_max"]
        for causal in (False, True):
            cases.append(InfoCase("attention-bwd", f"d<={d}{' causal' if causal else ''}",
                                  lambda device, d=d, causal=causal: _backward(device, d, causal)))
        cases.append(InfoCase("attention-bwd", f"d<={d} frozen q",
                              lambda device, d=d: _backward(device, d, False, frozen_q=True)))
    return cases


# ----------------------------------------------------------------------------- tune


def tune_shapes(args):
    from flashflow.bench.train import train_shapes

    return train_shapes(args.quick, args.head_dims or (128,))


def tune_case(shape, args) -> TuneCase:
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
        if same_as_shipped(base, ov, {}):
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
    return TuneCase(label, info, anchor, make, 3.5 * fwd_flops(b, h, s, d, causal), 0, dataclasses.asdict(base),
                    repeat_check=3)


SPEC = OpSpec(
    name="attention-bwd",
    info_title=f"attention backward through flash_attn_func + autograd (bf16, batch {BATCH}, seqlen {SEQLEN}, "
               f"{HEADS} heads; dQ with δ, dK/dV, and the δ kernel of a frozen q)",
    info_cases=info_cases,
    suite="train",
    axes={"BLOCK_M1": (32, 64), "BLOCK_N1": (64, 128), "num_warps1": (4, 8), "num_stages1": (2, 3, 4),
          "BLOCK_M2": (64, 128), "BLOCK_N2": (32, 64), "num_warps2": (4, 8), "num_stages2": (2, 3, 4)},
    config_classes=(AttentionBwdConfig,),
    unit="TFLOP/s",
    anchor="sdpa",
    tune_shapes=tune_shapes,
    tune_case=tune_case,
    # autograd between the kernels: timed eagerly, not in a CUDA graph
    tune_timing="warm",
    tune_takes=("head_dims",),
)
