"""The fused FFN as the benchmarks see it: ``flashflow info`` launches the mlp suite's FFNs at
token counts that reach every split-K and persistent config (and the bench's two-kernel
baseline); ``flashflow tune`` times kernels, tile orders and configs against torch (cuBLAS) in a
CUDA graph."""
from __future__ import annotations

import dataclasses

from flashflow.bench.spec import (InfoCase, NotApplicable, OpSpec, TuneCase, TuneOption, int_list, replace_fields,
                                  same_as_shipped)
from flashflow.tuning.mlp import PersistentConfig, SplitKConfig

PLAN_OPTIONS = ("policy",)


# ----------------------------------------------------------------------------- info


def _mlp(device: str, m: int, activation: str, hidden: int, inter: int, policy: str) -> None:
    import torch

    from flashflow import fused_mlp

    # CPU tensors are never read offline: empty ones cost no memory
    make = torch.empty if device == "cpu" else torch.zeros
    rows = 2 * inter if activation == "swiglu" else inter
    x = make(m, hidden, device=device, dtype=torch.bfloat16)
    w1 = make(rows, hidden, device=device, dtype=torch.bfloat16)
    w2 = make(hidden, inter, device=device, dtype=torch.bfloat16)
    if policy == "two-kernels":
        from flashflow.ops.mlp import mlp_two_kernels

        mlp_two_kernels(x, w1, w2, activation)
        return
    fused_mlp(x, w1, w2, activation, policy)


def info_cases(family: str | None = None) -> list[InfoCase]:
    """The mlp suite's FFNs at token counts that reach each shipped config of the split-K kernel
    (plain and grouped slices, 64- and 128-wide, one wave) and of the persistent kernel (its
    small- and large-M tiles), each kernel named by its policy: ``auto`` hands some of these
    token counts to cuBLAS, which is no kernel of flashflow's."""
    from flashflow.bench.mlp_suite import MODELS

    picks = {"llama3-8b": ((1, "splitk"), (16, "splitk"), (64, "splitk"), (256, "seqsplit:8"), (1024, "multirow:8")),
             "llama3-70b": ((16, "splitk"),),
             "gpt3-4096x14336-gelu": ((1, "splitk"), (64, "seqsplit:8"), (1024, "multirow:8"))}
    cases = []
    for name, act, hidden, inter in MODELS:
        for m, policy in picks.get(name, ()):
            cases.append(InfoCase("mlp", f"{name} M={m} {policy}",
                                  lambda device, a=(m, act, hidden, inter, policy): _mlp(device, *a)))
    # the bench's two-kernel baseline (mlp_two_kernels): the persistent kernel's tiles, unfused
    cases.append(InfoCase("mlp", "llama3-8b M=1024 two-kernels",
                          lambda device: _mlp(device, 1024, "swiglu", 4096, 14336, "two-kernels")))
    return cases


# ----------------------------------------------------------------------------- tune


def tune_check(args) -> None:
    """``--models``: names of the mlp suite's FFNs (then a tuple)."""
    from flashflow.bench import mlp_suite

    args.models = tuple(m for m in args.models.split(",") if m) if isinstance(args.models, str) else args.models
    known = [mo[0] for mo in mlp_suite.MODELS]
    bad = [m for m in args.models if m not in known]
    if bad:
        raise ValueError(f"--models must be a comma list of {', '.join(known)}, got {', '.join(bad)}")


def tune_shapes(args):
    from flashflow.bench import mlp_suite

    tokens = args.tokens or (mlp_suite.QUICK_TOKENS if args.quick else mlp_suite.TOKENS)
    return [(*mo, m) for mo in mlp_suite.MODELS if not args.models or mo[0] in args.models for m in tokens]


def tune_case(shape, args) -> TuneCase:
    import torch

    from flashflow.bench import mlp_suite
    from flashflow.ops import mlp

    model, act, hidden, inter, m = shape
    x, w1, w2 = mlp_suite.make_inputs(act, hidden, inter, m, torch.bfloat16)
    ws = mlp.MlpWorkspace(hidden, max_tokens=m, device="cuda")
    shipped_policy = shipped(None, x, w2, act)

    def make(ov):
        if not ov:
            return lambda: mlp.fused_mlp(x, w1, w2, act, workspace=ws)
        policy = ov.get("policy", shipped_policy)
        if policy == "cublas":
            raise NotApplicable("cuBLAS is the anchor")
        name, rows = mlp.parse_policy(policy)
        if name == "splitk" and m > mlp.DECODE_MAX_M:
            raise NotApplicable(f"split-K takes at most {mlp.DECODE_MAX_M} tokens")
        base = shipped(name, x, w2, act)
        if same_as_shipped(base, ov, {"policy": shipped_policy}):
            raise NotApplicable("the shipped config")
        cfg = replace_fields(base, ov, PLAN_OPTIONS)
        if name == "splitk":
            return lambda: mlp.launch_splitk(x, w1, w2, act, ws, config=cfg)
        return lambda: mlp.launch_persistent(x, w1, w2, act, name, rows, ws, config=cfg)
    info = {"model": model, "activation": act, "hidden": hidden, "intermediate": inter, "M": m}
    kernel = "splitk" if shipped_policy == "splitk" else "persistent"
    return TuneCase(f"{model} M={m}", info, lambda: mlp.launch_cublas(x, w1, w2, act), make,
                mlp_suite.weight_bytes(act, hidden, inter), mlp_suite.steps_for(m),
                {**dataclasses.asdict(shipped(kernel, x, w2, act)), "policy": shipped_policy})


def shipped(kernel, x, w2, act):
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


SPEC = OpSpec(
    name="mlp",
    info_title="fused FFN through fused_mlp (bf16, the policy named)",
    info_cases=info_cases,
    suite="mlp",
    axes={"policy": ("splitk", "seqsplit:8", "multirow:8", "halfrow"),
          "BLOCK_I": (64, 128), "BLOCK_N": (64, 128), "group": (0, 2, 4),
          "BLOCK_N1": (128, 256), "num_stages": (3, 4, 5), "use_tma": (False, True)},
    plan_options=PLAN_OPTIONS,
    config_classes=(SplitKConfig, PersistentConfig),
    unit="TB/s",
    anchor="torch+graph",
    tune_shapes=tune_shapes,
    tune_case=tune_case,
    tune_options=(
        TuneOption(("--models",), dict(default="", help="mlp: comma list of the mlp suite's FFNs (none: all)")),
        TuneOption(("--tokens",), dict(type=int_list, default=(), metavar="M,M",
                                       help="mlp: token counts (none: the mlp suite's)"))),
    tune_takes=("models", "tokens"),
    tune_check=tune_check,
)
