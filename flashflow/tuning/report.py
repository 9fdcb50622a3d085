"""`flashflow info`: the shipped attention configs and what the compiler made of each.

On a CUDA GPU every config of the GPU's family is compiled and launched once on a small input;
the kernels it launched are read back from Triton's JIT cache for their registers per thread,
spills and shared memory. Without a GPU only the configs are listed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

from flashflow.tuning import AttentionConfig, config_from_entry, gpu_family, interpreting
from flashflow.tuning import table as tuning_table


# A representative launch: several query tiles per head, so the main loop is the one that runs.
_BATCH, _SEQLEN, _HEADS = 1, 1024, 4

NO_GPU = ("No CUDA GPU found: registers per thread, spills and shared memory come from compiling "
          "for a GPU, so only the shipped configs are listed (`flashflow info --offline` compiles "
          "for each family's GPU here).")


def shipped_configs(family: str | None = None) -> list[dict]:
    """Entries of attention_fwd.json in table order, each with its family; all families if None."""
    table = tuning_table("attention_fwd")
    families = [f for f in table if not f.startswith("_")] if family is None else [family]
    unknown = [f for f in families if f not in table]
    if unknown:
        raise ValueError(f"family must be one of {', '.join(f for f in table if not f.startswith('_'))}, "
                         f"got {unknown[0]!r}")
    return [{"family": f, **entry} for f in families for entry in table[f]]


_config = config_from_entry


def _config_row(entry: dict, causal, variant) -> dict:
    return {"family": entry["family"], "head_dim_max": entry["head_dim_max"], "causal": causal,
            "variant": variant, **_config(entry).as_dict()}


@contextlib.contextmanager
def _launches():
    """Collects (kernel name, CUfunction handle) of every Triton launch inside the block.

    The handle identifies the compiled kernel that really ran, whether it was compiled now or
    found in the cache, without depending on the kernel's constexpr names.
    """
    from triton import knobs

    seen: list[tuple[str, int]] = []

    def hook(metadata):
        data = metadata.get()
        seen.append((data["name"], data["function"]))

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # Triton 3.6: a chain of hooks, others may be installed
        chain.add(hook)
        try:
            yield seen
        finally:
            chain.remove(hook)
    else:  # older Triton: one hook slot
        knobs.runtime.launch_enter_hook = hook
        try:
            yield seen
        finally:
            knobs.runtime.launch_enter_hook = chain


def _jit_functions():
    """Every @triton.jit function of the loaded flashflow.kernels modules (autotuners unwrapped)."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("flashflow.kernels.") or module is None:
            continue
        for obj in vars(module).values():
            for _ in range(3):  # Autotuner -> Heuristics -> JITFunction at most
                if hasattr(obj, "device_caches") or not hasattr(obj, "fn"):
                    break
                obj = obj.fn
            if hasattr(obj, "device_caches"):
                yield obj


def _compiled_kernel(handle: int):
    for fn in _jit_functions():
        for kernel_cache, *_ in list(fn.device_caches.values()):
            for kernel in list(kernel_cache.values()):
                if getattr(kernel, "function", None) == handle:
                    return kernel
    return None


def _forward(device: str, cfg: AttentionConfig, head_dim: int, causal: bool, **launch) -> None:
    """The report's forward launch on ``device``, with the arguments flash_attn_func passes, so
    the kernel is the one the benchmark times."""
    import torch

    from flashflow.ops.attention import attention_forward

    q, k, v = (torch.randn(_BATCH, _SEQLEN, _HEADS, head_dim, device=device, dtype=torch.bfloat16)
               for _ in range(3))
    attention_forward(q, k, v, softmax_scale=head_dim ** -0.5, window_right=0 if causal else None,
                      heavy_first=causal, return_lse=False, config=cfg, **launch)


def _resources(cfg: AttentionConfig, head_dim: int, causal: bool, **launch) -> list[dict]:
    """Launch the forward once with ``cfg``; one dict per kernel the launch ran."""
    import torch

    with _launches() as seen:
        _forward("cuda", cfg, head_dim, causal, **launch)
        torch.cuda.synchronize()
    found = []
    for name, handle in dict.fromkeys(seen):
        kernel = _compiled_kernel(handle)
        if kernel is None:
            found.append({"kernel": name, "error": "launched, but not found in the JIT caches of "
                                                   "flashflow.kernels"})
        else:
            found.append({"kernel": name, "n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                          "shared": kernel.metadata.shared})
    return found


_OFFLINE_CAPABILITY = {"sm90": (9, 0), "sm80": (8, 0)}


def _resources_offline(cfg: AttentionConfig, head_dim: int, causal: bool, family: str, **launch) -> list[dict]:
    """:func:`_resources` without a GPU: the same launch on CPU tensors, compiled for the
    family's GPU by :mod:`flashflow.tuning.offline` (ptxas's figures; nothing runs)."""
    from flashflow.tuning.offline import compile_offline, pretend_cuda_capability

    capability = _OFFLINE_CAPABILITY[family]
    with pretend_cuda_capability(capability):
        found = compile_offline(lambda: _forward("cpu", cfg, head_dim, causal, **launch),
                                capability=capability[0] * 10 + capability[1])
    return [{"kernel": r.name, "n_regs": r.registers, "n_spills": r.spill_bytes // 4, "shared": r.shared}
            for r in found]


def _variants(cfg: AttentionConfig, causal: bool):
    """(name, config, extra launch arguments) of each code path a config ships.

    The tail split compiles its own variant of the forward kernel plus a merge kernel, and
    whether it runs depends on the SM count; both paths are forced here so both are reported.
    """
    if not getattr(cfg, "tail_split", False):
        yield "main", cfg, {}
        return
    yield "main", cfg.replace(tail_split=False), {}
    if not causal:  # the ops split only plain (unmasked, non-varlen) launches
        tiles = -(-_SEQLEN // cfg.BLOCK_M) * _HEADS * _BATCH
        # with twice as many SMs as tiles, the single wave is half empty: the ops split it
        yield "tail split", cfg, {"num_sms": 2 * tiles}


def kernel_resource_report(family: str | None = None, offline: bool = False) -> list[dict]:
    """One dict per (shipped config, causal, code path, launched kernel) with ``n_regs``,
    ``n_spills`` and ``shared`` (bytes of shared memory) from compiling on the current CUDA GPU,
    or with ``offline`` for each family's GPU on this machine.

    ``family`` defaults to the GPU's. ``offline``: compile on this machine, GPU or not, for
    each family's GPU (sm90: the H100; all families by default) without running anything.
    Otherwise, without a CUDA GPU (or under the interpreter) nothing is compiled: one dict per
    config (all families by default) with those three set to None. A config that fails to
    compile or launch gets its message under ``error``.
    """
    import torch

    empty = {"kernel": None, "n_regs": None, "n_spills": None, "shared": None, "error": None}
    if offline and interpreting():
        raise ValueError("--offline compiles for a GPU: unset TRITON_INTERPRET")
    if not offline and (not torch.cuda.is_available() or interpreting()):
        return [{**_config_row(e, e["causal"], None), **empty}
                for e in shipped_configs(family)]
    if offline:
        if family is not None and family not in _OFFLINE_CAPABILITY:
            raise ValueError(f"--offline compiles for {', '.join(_OFFLINE_CAPABILITY)}, not {family!r}")
        entries = [e for e in shipped_configs(family) if e["family"] in _OFFLINE_CAPABILITY]
    else:
        entries = shipped_configs(family or gpu_family(torch.device("cuda", torch.cuda.current_device())))
    rows = []
    for entry in entries:
        for causal in (False, True) if entry["causal"] is None else (entry["causal"],):
            for variant, cfg, launch in _variants(_config(entry), causal):
                base = {**_config_row(entry, causal, variant), **empty}
                try:
                    if offline:
                        kernels = _resources_offline(cfg, entry["head_dim_max"], causal, entry["family"], **launch)
                    else:
                        kernels = _resources(cfg, entry["head_dim_max"], causal, **launch)
                except Exception as e:  # noqa: BLE001 — e.g. out of shared memory: report, go on
                    rows.append({**base, "error": f"{type(e).__name__}: {str(e).strip()[:300]}"})
                    continue
                rows += [{**base, **k} for k in kernels] or [{**base, "error": "no kernel launched"}]
    return rows


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

_HEADERS = {"head_dim_max": "d<=", "BLOCK_M": "BM", "BLOCK_N": "BN", "num_warps": "warps",
            "num_stages": "stages", "use_tma": "tma", "warp_specialize": "ws",
            "n_regs": "regs", "n_spills": "spills", "shared": "smem B"}
_RESOURCES = ("variant", "kernel", "n_regs", "n_spills", "shared")


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def format_table(rows: list[dict], with_resources: bool) -> str:
    keys = [k for k in rows[0] if k != "error" and (with_resources or k not in _RESOURCES)]
    headers = [_HEADERS.get(k, k) for k in keys]
    # a causal of None is a config shared by causal and non-causal inputs
    body = [[("any" if r[k] is None and k == "causal" else _cell(r[k])) for k in keys]
            for r in rows]
    widths = [max(len(line[i]) for line in [headers] + body) for i in range(len(keys))]

    def line(cells):
        return "  ".join(c.ljust(w) if k in ("family", "variant", "kernel") else c.rjust(w)
                         for c, w, k in zip(cells, widths, keys)).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)] + [line(b) for b in body]
    out += [f"error ({r['family']} d<={r['head_dim_max']} causal={r['causal']} {r['variant']}): "
            f"{r['error']}"
            for r in rows if r.get("error")]
    return "\n".join(out)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "info", help="shipped kernel configs with their registers, spills and shared memory",
        description=__doc__.split("\n")[0])
    p.add_argument("--family", default=None,
                   help="config family to report (default: the GPU's; every family without one)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--offline", action="store_true",
                   help="compile for each family's GPU on this machine (no GPU needed; nothing runs)")
    p.set_defaults(func=main)


def _heading(on_gpu: bool, device, family, offline: bool = False) -> str:
    import torch
    import triton

    if offline:
        return (f"attention forward configs compiled on this machine for each family's GPU "
                f"(sm90: the H100; triton {triton.__version__}, ptxas; nothing run), for a bf16 "
                f"input of batch {_BATCH}, seqlen {_SEQLEN}, {_HEADS} heads, head_dim = d<=:")
    if on_gpu:
        return (f"attention forward configs for {family} on {device} (triton {triton.__version__}), "
                f"each compiled and launched on a bf16 input of batch {_BATCH}, seqlen {_SEQLEN}, "
                f"{_HEADS} heads, head_dim = d<=:")
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
        rows = kernel_resource_report(args.family, offline=offline)
    except ValueError as e:
        print(f"flashflow info: {e}", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name() if on_gpu else None
    compiled = on_gpu or offline
    if args.json:
        print(json.dumps({"device": device, "triton": triton.__version__, "torch": torch.__version__,
                          "compiled": compiled, "offline": offline, "rows": rows}, indent=1))
    else:
        print(_heading(on_gpu, device, rows[0]["family"] if rows else args.family, offline) + "\n")
        print(format_table(rows, with_resources=compiled) if rows else "(no configs)")
    # a config that did not compile or launch fails the command, for scripts that call it
    return 1 if any(r["error"] for r in rows) else 0
