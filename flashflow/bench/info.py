"""`flashflow info`: the kernels every op launches with its shipped configs, and what the compiler
made of each (registers per thread, spills, shared memory).

On a CUDA GPU each case is launched once and its kernels are read back from Triton's JIT cache
(:mod:`flashflow.tuning.report`). ``--offline`` compiles the same launches on this machine for
each config family's GPU (sm90: the H100; sm80: the A100) with ptxas, GPU or not, and runs
nothing (:mod:`flashflow.tuning.offline`). Without either, only the cases are listed.

Cases: attention forward, every entry of the shipped config table (both code paths of a config
with a tail split); the attention backward's kernels at each entry of its table; FP8 attention
with its quantize kernels at each head_dim it takes; decode attention, the decode suite's
batch-1 shapes plus the other head sizes, a paged cache and a large batch, through
``flash_attn_with_kvcache``; the fused FFN through ``fused_mlp`` at token counts that reach its
split-K and persistent kernels; the diffusion block's fused norms. Every kernel flashflow
ships is launched by one of them.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Callable

from flashflow.device import cdiv, gpu_family, interpreting
from flashflow.progress import progress as Progress
from flashflow.tuning import families as tuning_families
from flashflow.tuning.attention import TABLE as ATTENTION_TABLE
from flashflow.tuning.attention import AttentionConfig, config_from_entry, shipped_entries

OPS = ("attention", "attention-bwd", "attention-fp8", "decode", "mlp", "norm")

# capability each family's configs are compiled for with --offline
OFFLINE_CAPABILITY = {"sm90": (9, 0), "sm80": (8, 0)}

# attention: several query tiles per head, so the main loop is the one that runs
_BATCH, _SEQLEN, _HEADS = 1, 1024, 4

NO_GPU = ("No CUDA GPU found: registers per thread, spills and shared memory come from compiling "
          "for a GPU, so only the shipped configs are listed (`flashflow info --offline` compiles "
          "for each family's GPU here).")

_FIGURES = {"kernel": None, "n_regs": None, "n_spills": None, "shared": None, "error": None}


@dataclass(frozen=True)
class Case:
    """One launch of an op: ``launch(device)`` runs it once on tensors of ``device``."""
    op: str
    label: str
    launch: Callable[[str], None]
    columns: dict = field(default_factory=dict)   # config columns shown before the figures


# ----------------------------------------------------------------------------- attention


def shipped_configs(family: str | None = None) -> list[dict]:
    """Entries of the attention config table in table order, each with its family; all families
    if None."""
    try:
        return shipped_entries(family)
    except ValueError as e:
        raise ValueError(f"--{e}") from None


def _attention_forward(device: str, cfg: AttentionConfig, head_dim: int, causal: bool, bias: bool = False,
                       **launch) -> None:
    """The forward launch with the arguments flash_attn_func passes (with ``bias``: what
    scaled_dot_product_attention passes for a (seqlen, seqlen) attn_mask), so the kernel is the
    one the benchmark times; ``cfg`` and ``launch`` force a config and a code path."""
    import torch

    from flashflow.ops.attention import attention_forward

    q, k, v = (torch.empty(_BATCH, _SEQLEN, _HEADS, head_dim, device=device, dtype=torch.bfloat16)
               for _ in range(3))
    if bias:
        launch["bias"] = torch.zeros(_SEQLEN, _SEQLEN, device=device).expand(_BATCH, _HEADS, _SEQLEN, _SEQLEN)
    attention_forward(q, k, v, softmax_scale=head_dim ** -0.5, window_right=0 if causal else None,
                      heavy_first=causal, return_lse=False, config=cfg, **launch)


def attention_variants(cfg: AttentionConfig, causal: bool, bias: bool = False):
    """(name, config, extra launch arguments) of each code path a config ships.

    The tail split compiles its own variant of the forward kernel plus a merge kernel, and
    whether it runs depends on the SM count; both paths are forced here so both are reported.
    """
    if not getattr(cfg, "tail_split", False) or bias:   # the ops split only launches without a bias
        yield "main", cfg, {}
        return
    yield "main", cfg.replace(tail_split=False), {}
    if not causal:  # the ops split only plain (unmasked, non-varlen) launches
        tiles = cdiv(_SEQLEN, cfg.BLOCK_M) * _HEADS * _BATCH
        # with twice as many SMs as tiles, the single wave is half empty: the ops split it
        yield "tail split", cfg, {"num_sms": 2 * tiles}


def _config_columns(entry: dict, causal, variant) -> dict:
    return {"family": entry["family"], "head_dim_max": entry["head_dim_max"], "causal": causal,
            "bias": bool(entry.get("bias")), "variant": variant, **config_from_entry(entry).as_dict()}


def attention_cases(family: str) -> list[Case]:
    cases = []
    for entry in shipped_configs(family):
        for causal in (False, True) if entry["causal"] is None else (entry["causal"],):
            bias = bool(entry.get("bias"))
            for variant, cfg, extra in attention_variants(config_from_entry(entry), causal, bias):
                def launch(device, cfg=cfg, d=entry["head_dim_max"], causal=causal, bias=bias, extra=extra):
                    _attention_forward(device, cfg, d, causal, bias, **extra)
                label = f"d<={entry['head_dim_max']}{' causal' if causal else ''}{' bias' if bias else ''} {variant}"
                cases.append(Case("attention", label, launch, _config_columns(entry, causal, variant)))
    return cases


# ----------------------------------------------------------------------------- decode


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


def decode_cases() -> list[Case]:
    """The decode suite's batch-1 shapes (head_dim 128), head_dim 64 and 256, a paged cache and
    a batch large enough that the programs outnumber the SMs."""
    from flashflow.bench.decode import PAGE_SIZE, decode_shapes

    shapes = [(b, s, h, hk, d, None) for b, s, h, hk, d in decode_shapes(quick=True) if b == 1]
    shapes += [(1, 8192, 32, 8, 64, None), (1, 8192, 32, 8, 256, None), (1, 8192, 32, 8, 128, PAGE_SIZE),
               (64, 4096, 32, 8, 128, None)]
    cases = []
    for b, s, h, hk, d, page in shapes:
        label = f"b{b} s{s} h{h}/{hk} d{d}" + (f" paged {page}" if page else "")
        cases.append(Case("decode", label, lambda device, a=(b, s, h, hk, d, page): _decode(device, *a)))
    cases.append(Case("decode", "merge_attention_states b1 h32 d128", _merge_states))
    return cases


def _merge_states(device: str) -> None:
    import torch

    from flashflow import merge_attention_states

    out = torch.zeros(1, 1, 32, 128, device=device, dtype=torch.bfloat16)
    lse = torch.zeros(1, 32, 1, device=device)
    merge_attention_states(out, lse, out, lse)


# ----------------------------------------------------------------------------- fused FFN


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


def mlp_cases() -> list[Case]:
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
            cases.append(Case("mlp", f"{name} M={m} {policy}",
                              lambda device, a=(m, act, hidden, inter, policy): _mlp(device, *a)))
    # the bench's two-kernel baseline (mlp_two_kernels): the persistent kernel's tiles, unfused
    cases.append(Case("mlp", "llama3-8b M=1024 two-kernels",
                      lambda device: _mlp(device, 1024, "swiglu", 4096, 14336, "two-kernels")))
    return cases


# ----------------------------------------------------------------------------- attention backward


def _attention_bwd(device: str, head_dim: int, causal: bool) -> None:
    import torch

    from flashflow import flash_attn_func

    make = torch.empty if device == "cpu" else torch.randn
    q, k, v = (make(_BATCH, _SEQLEN, _HEADS, head_dim, device=device, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    flash_attn_func(q, k, v, causal=causal).backward(torch.ones_like(q))


def attention_bwd_cases(family: str) -> list[Case]:
    """The backward's three kernels (δ, dK/dV, dQ) through ``flash_attn_func`` + autograd at the
    largest head_dim of each entry of its config table, causal and not (the causal build masks
    its diagonal blocks)."""
    from flashflow.tuning import table

    entries = table("attention_bwd").get(family, ()) if family else table("attention_bwd")["sm90"]
    cases = []
    for entry in entries:
        d = entry["head_dim_max"]
        for causal in (False, True):
            cases.append(Case("attention-bwd", f"d<={d}{' causal' if causal else ''}",
                              lambda device, d=d, causal=causal: _attention_bwd(device, d, causal)))
    return cases


# ----------------------------------------------------------------------------- FP8 attention


def _attention_fp8(device: str, head_dim: int, causal: bool) -> None:
    import torch

    from flashflow import flash_attn_fp8_func

    make = torch.empty if device == "cpu" else torch.randn
    q, k, v = (make(_BATCH, _SEQLEN, _HEADS, head_dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    flash_attn_fp8_func(q, k, v, causal=causal)


def attention_fp8_cases(family: str) -> list[Case]:
    """FP8 attention and its quantize pass (K/V statistics, quantize, the 8-bit forward) at each
    head_dim it takes, causal and not; Hopper and newer only (other families: none)."""
    from flashflow.ops.attention_fp8 import FP8_HEAD_DIMS
    from flashflow.tuning.attention_fp8 import supported_families

    if family is not None and family not in supported_families():
        return []
    return [Case("attention-fp8", f"d{d}{' causal' if causal else ''}",
                 lambda device, d=d, causal=causal: _attention_fp8(device, d, causal))
            for d in FP8_HEAD_DIMS for causal in (False, True)]


# ----------------------------------------------------------------------------- diffusion norms


def _norm(device: str, op: str) -> None:
    import torch

    from flashflow.ops import norm

    b, l, h, d = 1, 4352, 24, 128   # Qwen-Image 1024px: 4096 image + 256 text tokens, 24 heads of 128
    make = torch.empty if device == "cpu" else torch.randn
    bf16 = dict(device=device, dtype=torch.bfloat16)
    if op in ("layernorm_modulate", "gate_residual", "gate_residual_layernorm_modulate"):
        x, y = make(b, l, h * d, **bf16), make(b, l, h * d, **bf16)
        shift, scale, gate = (make(b, h * d, **bf16) for _ in range(3))
        if op == "layernorm_modulate":
            norm.layernorm_modulate(x, shift, scale)
        elif op == "gate_residual":
            norm.gate_residual(x, y, gate)
        else:
            norm.gate_residual_layernorm_modulate(x, y, gate, shift, scale)
        return
    freqs = torch.ones(l, d // 2, dtype=torch.complex64, device=device)
    if op == "rmsnorm_rope":
        norm.rmsnorm_rope(make(b, l, h, d, **bf16), make(d, **bf16), freqs)
        return
    txt, img = 256, l - 256
    norm.joint_qkv_norm_rope(*(make(b, txt, h, d, **bf16) for _ in range(3)), *(make(b, img, h, d, **bf16) for _ in range(3)),
                             *(make(d, **bf16) for _ in range(4)), freqs[:txt], freqs[txt:])


NORM_OPS = ("layernorm_modulate", "gate_residual", "gate_residual_layernorm_modulate", "rmsnorm_rope",
            "joint_qkv_norm_rope")


def norm_cases() -> list[Case]:
    """The diffusion block's fused norms (flashflow.ops.norm) at Qwen-Image 1024px's width."""
    return [Case("norm", op, lambda device, op=op: _norm(device, op)) for op in NORM_OPS]


# ----------------------------------------------------------------------------- the report


def cases(op: str, family: str) -> list[Case]:
    if op == "attention":
        return attention_cases(family)
    if op == "attention-bwd":
        return attention_bwd_cases(family)
    if op == "attention-fp8":
        return attention_fp8_cases(family)
    if op == "norm":
        return norm_cases()
    return decode_cases() if op == "decode" else mlp_cases()


def _offline_resources(case: Case, family: str) -> list[dict]:
    from flashflow.tuning.offline import compile_offline, pretend_cuda_capability

    capability = OFFLINE_CAPABILITY[family]
    with pretend_cuda_capability(capability):
        found = compile_offline(lambda: case.launch("cpu"), capability=capability[0] * 10 + capability[1])
    # n_spills counts 4-byte words, as the GPU's compiled kernels report it
    return [{"kernel": r.name, "n_regs": r.registers, "n_spills": r.spill_bytes // 4, "shared": r.shared,
             "num_warps": r.num_warps, "num_stages": r.num_stages} for r in found]


def _gpu_resources(case: Case) -> list[dict]:
    from flashflow.tuning.report import launched_resources

    return launched_resources(lambda: case.launch("cuda"))


def _parse_ops(spec) -> list[str]:
    if spec is None:
        return list(OPS)
    names = [o.strip() for o in spec.split(",") if o.strip()] if isinstance(spec, str) else list(spec)
    unknown = [o for o in names if o not in OPS]
    if unknown or not names:
        raise ValueError(f"--op must be a comma list of {', '.join(OPS)}, got {spec!r}")
    return list(dict.fromkeys(names))


def kernel_resource_report(family: str | None = None, offline: bool = False, ops=None,
                           progress: bool = False) -> list[dict]:
    """One dict per (op, case, launched kernel) with ``n_regs``, ``n_spills`` and ``shared``
    (bytes of shared memory) from compiling on the current CUDA GPU, or with ``offline`` for
    each family's GPU on this machine; ``op``, ``family`` and ``case`` say which.

    ``family`` defaults to the GPU's (offline: every family of :data:`OFFLINE_CAPABILITY`).
    ``ops``: a subset of :data:`OPS` (a comma string or a list; all by default). Without a CUDA
    GPU (or under the interpreter) and without ``offline`` nothing is compiled: one dict per
    case with the figures None. A case that fails to compile or launch gets its message under
    ``error``.
    """
    import torch

    ops = _parse_ops(ops)
    if offline and interpreting():
        raise ValueError("--offline compiles for a GPU: unset TRITON_INTERPRET")
    compiled = offline or (torch.cuda.is_available() and not interpreting())
    if offline:
        if family is not None and family not in OFFLINE_CAPABILITY:
            raise ValueError(f"--offline compiles for {', '.join(OFFLINE_CAPABILITY)}, not {family!r}")
        families = [family] if family else list(OFFLINE_CAPABILITY)
    elif compiled:
        families = [family or gpu_family(torch.device("cuda", torch.cuda.current_device()))]
    else:
        families = [family] if family else _all_families()
    for f in families:
        shipped_configs(f)   # an unknown family is refused before anything compiles

    work = []
    for op in ops:
        if op == "attention" and not compiled:
            # nothing is launched: one row per table entry, as the table ships it
            work += [(f, Case(op, "", None, _config_columns(e, e["causal"], None)))
                     for f in families for e in shipped_configs(f)]
        elif op == "attention":
            work += [(f, c) for f in families for c in attention_cases(f)]
        elif compiled:
            # decode and the FFN pick their configs from the GPU they run on: one pass per family
            work += [(f, c) for f in families for c in cases(op, f)]
        else:
            work += [(None, c) for c in cases(op, None)]

    bar = Progress(len(work), "compiling kernels", enabled=progress and compiled)
    rows = []
    try:
        for f, case in work:
            base = {"op": case.op, "family": f, "case": case.label, **case.columns, **_FIGURES}
            bar.describe(f"{f} {case.op} {case.label}")
            if not compiled:
                rows.append(base)
                continue
            try:
                kernels = _offline_resources(case, f) if offline else _gpu_resources(case)
            except Exception as e:  # noqa: BLE001 — e.g. out of shared memory: report, go on
                rows.append({**base, "error": f"{type(e).__name__}: {str(e).strip()[:300]}"})
            else:
                # a config's own columns (its warps and stages) stay as the table ships them
                rows += ([{**base, **{k: v for k, v in kern.items() if k not in case.columns}} for kern in kernels]
                         or [{**base, "error": "no kernel launched"}])
            bar.update()
    finally:
        bar.close()
    return rows


def _all_families() -> list[str]:
    return tuning_families(ATTENTION_TABLE)


# ----------------------------------------------------------------------------- CLI

_HEADERS = {"head_dim_max": "d<=", "BLOCK_M": "BM", "BLOCK_N": "BN", "num_warps": "warps",
            "num_stages": "stages", "use_tma": "tma", "warp_specialize": "ws",
            "n_regs": "regs", "n_spills": "spills", "shared": "smem B"}
_RESOURCES = ("kernel", "n_regs", "n_spills", "shared")
_TEXT = ("family", "case", "variant", "kernel")
_TITLES = {"attention": "attention forward, one config table entry per line (bf16, batch {b}, seqlen {s}, "
                        "{h} heads, head_dim = d<=)".format(b=_BATCH, s=_SEQLEN, h=_HEADS),
           "decode": "decode attention through flash_attn_with_kvcache (bf16, one query token)",
           "mlp": "fused FFN through fused_mlp (bf16, the policy named)",
           "attention-bwd": "attention backward through flash_attn_func + autograd (bf16, batch {b}, seqlen {s}, "
                            "{h} heads; δ, dK/dV and dQ kernels)".format(b=_BATCH, s=_SEQLEN, h=_HEADS),
           "attention-fp8": "FP8 attention through flash_attn_fp8_func, its quantize pass included (bf16 in, "
                            "batch {b}, seqlen {s}, {h} heads)".format(b=_BATCH, s=_SEQLEN, h=_HEADS),
           "norm": "the diffusion block's fused norms (bf16, Qwen-Image 1024px: 4352 tokens, 24 heads x 128)"}


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def format_table(rows: list[dict], with_resources: bool) -> str:
    """The rows of one op as an aligned table, then one line per error."""
    keys = [k for k in dict.fromkeys(k for r in rows for k in r)
            if k not in ("op", "error") and (with_resources or k not in _RESOURCES)
            and not (k == "case" and rows[0]["op"] == "attention")]   # attention: the config says it
    if not with_resources and rows[0]["op"] != "attention":
        keys = [k for k in keys if k not in ("num_warps", "num_stages")]
    headers = [_HEADERS.get(k, k) for k in keys]
    # a causal of None is a config shared by causal and non-causal inputs
    body = [[("any" if r.get(k) is None and k == "causal" else _cell(r.get(k))) for k in keys]
            for r in rows]
    widths = [max(len(line[i]) for line in [headers] + body) for i in range(len(keys))]

    def line(cells):
        return "  ".join(c.ljust(w) if k in _TEXT else c.rjust(w)
                         for c, w, k in zip(cells, widths, keys)).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)] + [line(b) for b in body]
    out += [f"error ({r['family']} {r['op']} {r['case']}): {r['error']}" for r in rows if r.get("error")]
    return "\n".join(out)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "info", help="every op's kernels with their registers, spills and shared memory",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--family", default=None,
                   help="config family to report (no GPU: every family; on a GPU: the GPU's)")
    p.add_argument("--op", default=",".join(OPS), help="comma list of ops to report")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--offline", action="store_true",
                   help="compile for each family's GPU on this machine (no GPU needed; nothing runs)")
    p.set_defaults(func=main)


def _heading(on_gpu: bool, device, family, offline: bool = False) -> str:
    import torch
    import triton

    if offline:
        return (f"Compiled on this machine for each family's GPU ({', '.join(OFFLINE_CAPABILITY)}; "
                f"triton {triton.__version__}, ptxas); nothing run.")
    if on_gpu:
        return f"Compiled and launched once each on {device} ({family}, triton {triton.__version__})."
    if torch.cuda.is_available():
        return ("TRITON_INTERPRET is set, so nothing is compiled for the GPU: only the shipped "
                "configs are listed. Unset it for registers, spills and shared memory.")
    return NO_GPU


def main(args: argparse.Namespace) -> int:
    import torch
    import triton

    offline = getattr(args, "offline", False)
    on_gpu = torch.cuda.is_available() and not interpreting() and not offline
    try:
        rows = kernel_resource_report(args.family, offline=offline, ops=getattr(args, "op", None),
                                      progress=True)
    except ValueError as e:
        print(f"flashflow info: error: {e}", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name() if on_gpu else None
    compiled = on_gpu or offline
    if args.json:
        print(json.dumps({"suite": "info", "device": device, "triton": triton.__version__, "torch": torch.__version__,
                          "compiled": compiled, "offline": offline, "rows": rows}, indent=1))
    else:
        print(_heading(on_gpu, device, rows[0]["family"] if rows else args.family, offline))
        for op in dict.fromkeys(r["op"] for r in rows):
            print(f"\n{_TITLES[op]}:\n")
            print(format_table([r for r in rows if r["op"] == op], with_resources=compiled))
    # a case that did not compile or launch fails the command, for scripts that call it
    return 1 if any(r["error"] for r in rows) else 0
