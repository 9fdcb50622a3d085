"""`flashflow info`: the kernels every op launches with its shipped configs, and what the compiler
made of each (registers per thread, spills, shared memory).

On a CUDA GPU each case is launched once and its kernels are read back from Triton's JIT cache
(:mod:`flashflow.bench.resources`). ``--offline`` compiles the same launches on this machine for
each config family's GPU (sm90: the H100; sm80: the A100) with ptxas, GPU or not, and runs
nothing (:mod:`flashflow.bench.offline`). Without either, only the cases are listed.

Cases: each op's spec (:mod:`flashflow.bench.ops`) lists the launches that reach every kernel
it ships, at its shipped configs; the op's name is ``--op``'s.
"""
from __future__ import annotations

import argparse
import json
import sys

from flashflow.bench.ops import SPECS, spec
from flashflow.bench.ops.attention import shipped_configs
from flashflow.bench.spec import InfoCase
from flashflow.device import gpu_family, interpreting
from flashflow.progress import progress as Progress
from flashflow.tuning import families as tuning_families
from flashflow.tuning.attention import TABLE as ATTENTION_TABLE

OPS = tuple(s.name for s in SPECS)

# capability each family's configs are compiled for with --offline
OFFLINE_CAPABILITY = {"sm90": (9, 0), "sm80": (8, 0)}

NO_GPU = ("No CUDA GPU found: registers per thread, spills and shared memory come from compiling "
          "for a GPU, so only the shipped configs are listed (`flashflow info --offline` compiles "
          "for each family's GPU here).")

_FIGURES = {"kernel": None, "n_regs": None, "n_spills": None, "shared": None, "error": None}


# ----------------------------------------------------------------------------- the report


def cases(op: str, family: str | None) -> list[InfoCase]:
    """The launches of ``op`` (a name of :data:`OPS`) at ``family``'s configs."""
    return spec(op).info_cases(family)


def _offline_resources(case: InfoCase, family: str) -> list[dict]:
    from flashflow.bench.offline import compile_offline, pretend_cuda_capability

    capability = OFFLINE_CAPABILITY[family]
    with pretend_cuda_capability(capability):
        found = compile_offline(lambda: case.launch("cpu"), capability=capability[0] * 10 + capability[1])
    # n_spills counts 4-byte words, as the GPU's compiled kernels report it
    return [{"kernel": r.name, "n_regs": r.registers, "n_spills": r.spill_bytes // 4, "shared": r.shared,
             "num_warps": r.num_warps, "num_stages": r.num_stages} for r in found]


def _gpu_resources(case: InfoCase) -> list[dict]:
    from flashflow.bench.resources import launched_resources

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
        listing = spec(op).info_listing
        if not compiled and listing is not None:
            work += [(f, c) for f in families for c in listing(f)]
        elif compiled:
            # every op picks its configs from the GPU it runs on: one pass per family
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
def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def format_table(rows: list[dict], with_resources: bool) -> str:
    """The rows of one op as an aligned table, then one line per error."""
    shows_config = spec(rows[0]["op"]).info_shows_config
    keys = [k for k in dict.fromkeys(k for r in rows for k in r)
            if k not in ("op", "error") and (with_resources or k not in _RESOURCES)
            and not (k == "case" and shows_config)]   # the config names the case
    if not with_resources and not shows_config:
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
            print(f"\n{spec(op).info_title}:\n")
            print(format_table([r for r in rows if r["op"] == op], with_resources=compiled))
    # a case that did not compile or launch fails the command, for scripts that call it
    return 1 if any(r["error"] for r in rows) else 0
