"""`flashflow bench`: time flashflow against its anchors on the GPU and keep the numbers.

Suites: attention (default; flashflow and its FP8 attention vs SDPA cuDNN / FLASH, with each
output's accuracy against exact attention), decode, train, mlp, host, memory, dataflow, qwen-image,
fp8-linear.
Each writes <suite>-<device>.json to --out. Without a CUDA GPU the attention suite runs a
small correctness demo through Triton's interpreter instead; the other suites need the GPU.
--from-json prints a saved result's tables, --tables the tables of docs/results.md.
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

from flashflow.bench import runner
from flashflow.progress import progress as Progress
from flashflow.bench.attention_suite import DTYPES as _DTYPES
from flashflow.bench.suites import ATTENTION_OPTIONS, RUNNERS, SUITES

NO_GPU = ("No CUDA GPU found (torch.cuda.is_available() is False), so there is nothing to time. "
          "Running a small correctness demo through the Triton CPU interpreter instead.")

_ALL_SUITES = sorted(RUNNERS)
# shared options: argparse dest -> how the user spelled it
_FLAGS = {"quick": "--quick", "providers": "--providers", "dtype": "--dtype", "warmup": "--warmup",
          "rep": "--rep", "no_plot": "--no-plot", "markdown": "--markdown", "rescore": "--rescore",
          "variants": "--variants", "write": "--write", "suite": "--suite", "blocks": "--blocks"}
# every suite option: what a suite does not take is refused
_SUITE_OPTIONS = ATTENTION_OPTIONS | {"blocks"}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark flashflow against its anchors; print and render measured tables",
        description=__doc__.split("\n\n")[0] + " " + " ".join(__doc__.split("\n\n")[1].split()))
    p.add_argument("--suite", choices=_ALL_SUITES, default=None,
                   help="what to measure (default: attention): " + "; ".join(
                       f"{name}: {r.measures}" for name, r in sorted(RUNNERS.items())))
    p.add_argument("--quick", action="store_true", help="a few shapes instead of the full sweep")
    p.add_argument("--providers", default=None,
                   help="comma list (default: all of the suite's; attention: "
                        f"{','.join(SUITES['attention'].providers)}; mlp, qwen-image and fp8-linear take one too)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="input dtype (default: fp16 for memory, bf16 otherwise)")
    p.add_argument("--warmup", type=int, default=None, metavar="MS",
                   help="do_bench warm-up time per measurement, ms (default: 25; mlp: 5)")
    p.add_argument("--rep", type=int, default=None, metavar="MS",
                   help="do_bench measuring time per measurement, ms (default: 100; mlp: 20)")
    p.add_argument("--blocks", type=int, default=None, metavar="N",
                   help="qwen-image: transformer blocks to build, of the model's 60 (default: 6); "
                        "decode-layer: the layers of a step (default: 1)")
    p.add_argument("--out", type=Path, default=Path("bench/results"),
                   help="folder the results are written to, and --tables reads (default: bench/results)")
    p.add_argument("--no-plot", action="store_true", help="attention, qwen-image: skip the PNG plot")
    p.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                   help="print the tables of a saved result (any suite's) instead of measuring")
    p.add_argument("--markdown", action="store_true",
                   help="print the attention table as Markdown (the other suites' always are)")
    p.add_argument("--rescore", action="store_true",
                   help="with --from-json of a dataflow result: re-run the model on its measured points")
    p.add_argument("--variants", default=None, metavar="all|LIST",
                   help="with --from-json of a dataflow result: score these L2 model variants on its "
                        "measured points (e.g. drift/p2-home-halves; all: every variant, minutes)")
    p.add_argument("--tables", action="store_true",
                   help="print the measured tables of docs/results.md, rendered from the JSON in --out")
    p.add_argument("--write", nargs="+", type=Path, default=None, metavar="FILE",
                   help="with --tables: replace the generated blocks of these files instead of printing "
                        "(docs/results.md, docs/tutorial.md)")
    p.set_defaults(func=main)


def _error(message: str) -> int:
    print(f"flashflow bench: error: {message}", file=sys.stderr)
    return 2


def _passed(args, names) -> list[str]:
    """The options among ``names`` that the user gave (not at their default)."""
    return [_FLAGS[n] for n in names if getattr(args, n) not in (None, False)]


def _run_demo() -> int:
    """The interpreter must be chosen before Triton is imported; this process imported it."""
    from flashflow.device import interpreting

    if interpreting():
        from flashflow.bench import demo

        return demo.main()
    env = dict(os.environ, TRITON_INTERPRET="1")
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "flashflow.bench.demo"], env=env).returncode


# --------------------------------------------------------------------------------------------
# saved results
# --------------------------------------------------------------------------------------------


def print_result(result: dict, markdown: bool = False) -> None:
    """A saved result's tables, whatever suite wrote it."""
    suite = result.get("suite")
    if suite == "attention":   # the one report with a markdown form
        from flashflow.bench import attention_suite

        print(attention_suite.report(result, markdown=markdown))
    elif suite in RUNNERS:
        print(importlib.import_module(RUNNERS[suite].module).report(result))
    elif suite == "info":
        from flashflow.bench import info
        from flashflow.bench.ops import spec

        for op in dict.fromkeys(r["op"] for r in result["rows"]):
            print(f"{spec(op).info_title}:\n")
            print(info.format_table([r for r in result["rows"] if r["op"] == op], result.get("compiled", True)) + "\n")
    else:
        raise ValueError(f"not a flashflow bench result (its suite is {suite!r}, not one of "
                         f"{', '.join(_ALL_SUITES + ['info'])})")


def _from_json(args) -> int:
    import json

    extra = _passed(args, ("suite", "quick", "providers", "dtype", "warmup", "rep", "no_plot", "write",
                           "blocks"))
    if extra:
        return _error(f"{extra[0]} does not apply to --from-json (the file says what it measured)")
    try:
        result = json.loads(args.from_json.read_text())
        if result.get("suite") == "attention" or "schema_version" in result:
            result = runner.read_json(args.from_json)
    except (OSError, ValueError) as e:
        return _error(f"cannot read {args.from_json}: {e}")
    if (args.rescore or args.variants) and result.get("suite") != "dataflow":
        return _error(f"{'--rescore' if args.rescore else '--variants'} takes a dataflow result, and "
                      f"{args.from_json} is a {result.get('suite')!r} result")
    if result.get("suite") == "dataflow" and (args.rescore or args.variants):
        from flashflow.bench import dataflow

        if args.rescore:
            result = {**result, "results": dataflow.rescore(result)}
            print(f"{result.get('device')}: the model re-run on the measured points of {args.from_json}.\n")
        if args.variants:
            variants = None if args.variants == "all" else [v.strip() for v in args.variants.split(",") if v.strip()]
            try:
                for v in variants or ():
                    dataflow.variant_kwargs(v, 1)
            except ValueError as e:
                return _error(f"--variants: {e}")
            bar = []

            def progress(done, total):
                if not bar:
                    bar.append(Progress(total, "simulating the model variants"))
                bar[0].update()
            try:
                scores = dataflow.score_variants(result, variants, progress=progress)
            finally:
                if bar:
                    bar[0].close()
            print("Model / measured ratios per shape list the orders as they appear in the file.\n")
            print(dataflow.variants_table(scores) + "\n")
    try:
        print_result(result, args.markdown)
    except (KeyError, ValueError) as e:
        return _error(f"cannot read {args.from_json}: {e}")
    return 0


def _tables(args) -> int:
    from flashflow.bench import tables

    extra = _passed(args, ("suite", "quick", "providers", "dtype", "warmup", "rep", "no_plot", "markdown",
                           "rescore", "variants", "blocks"))
    if extra:
        return _error(f"{extra[0]} does not apply to --tables (it renders the results in --out)")
    if not args.out.is_dir():
        return _error(f"--out {args.out} is not a folder of results")
    if not args.write:
        print(tables.render(args.out))
        return 0
    for path in args.write:
        try:
            done = tables.write(path, args.out)
        except (OSError, ValueError) as e:
            return _error(f"--write {path}: {e}")
        print(f"{path}: replaced {', '.join(done)}")
    return 0


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    if args.from_json is not None:
        return _from_json(args)
    if args.tables:
        return _tables(args)
    for name in ("write", "rescore", "variants"):
        if getattr(args, name):
            needs = "--tables" if name == "write" else "--from-json FILE"
            return _error(f"{_FLAGS[name]} needs {needs}")

    suite_name = args.suite or "attention"
    options, defaults = RUNNERS[suite_name].options, RUNNERS[suite_name].defaults
    extra = _passed(args, sorted(_SUITE_OPTIONS - options))
    if extra:
        return _error(f"{extra[0]} does not apply to --suite {suite_name}")
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    return _run_runner(suite_name, args)


def _run_runner(name: str, args) -> int:
    import torch

    from flashflow.device import interpreting

    spec = RUNNERS[name]
    module = importlib.import_module(spec.module)
    check_args = getattr(module, "check_args", None)
    problem = check_args(args) if check_args else None
    if problem:
        return _error(problem)
    if not torch.cuda.is_available():
        if name == "attention":   # the default job: a correctness demo in the interpreter instead
            print(NO_GPU, flush=True)
            return _run_demo()
        return _error(f"--suite {name} needs a CUDA GPU (it {spec.measures}) and torch.cuda.is_available() "
                      "is False; without one, only the attention suite runs (a correctness demo in "
                      "Triton's interpreter)")
    if interpreting():
        return _error(f"--suite {name}: TRITON_INTERPRET is set, so the kernels would run in the CPU "
                      "interpreter and the timings would mean nothing. Unset it to benchmark the GPU.")
    if name == "mlp":
        try:
            args.providers = runner.parse_providers(args.providers, module.PROVIDERS, name)
        except ValueError as e:
            return _error(str(e))
    return module.run(args)
