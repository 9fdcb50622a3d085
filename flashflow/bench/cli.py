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
import logging
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from flashflow.bench import runner, suites, timing
from flashflow.progress import progress as Progress
from flashflow.bench.suites import ATTENTION_DEFAULTS, ATTENTION_OPTIONS, RUNNERS, SUITES

NO_GPU = ("No CUDA GPU found (torch.cuda.is_available() is False), so there is nothing to time. "
          "Running a small correctness demo through the Triton CPU interpreter instead.")

_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
_ALL_SUITES = sorted(SUITES) + sorted(RUNNERS)
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
                       [f"attention: flashflow's forward and {', '.join(SUITES['attention'].variants)} vs "
                        f"{', '.join(SUITES['attention'].anchors)}, with each output's accuracy"]
                       + [f"{name}: {r.measures}" for name, r in sorted(RUNNERS.items())]))
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
                   help="qwen-image: transformer blocks to build, of the model's 60 (default: 6)")
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
    if suite == "attention":
        print(runner.markdown_table(result["rows"]) if markdown else runner.text_table(result["rows"]))
        _print_accuracy(result["rows"])
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
    options, defaults = ((ATTENTION_OPTIONS, ATTENTION_DEFAULTS) if suite_name in SUITES else
                         (RUNNERS[suite_name].options, RUNNERS[suite_name].defaults))
    extra = _passed(args, sorted(_SUITE_OPTIONS - options))
    if extra:
        return _error(f"{extra[0]} does not apply to --suite {suite_name}")
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    if suite_name in RUNNERS:
        return _run_runner(suite_name, args)

    suite = SUITES[suite_name]
    try:
        providers = runner.parse_providers(args.providers, suite.providers, suite.name)
    except ValueError as e:
        return _error(str(e))

    import torch

    from flashflow.device import interpreting

    if not torch.cuda.is_available():
        print(NO_GPU, flush=True)
        return _run_demo()
    if interpreting():
        return _error("TRITON_INTERPRET is set, so the kernels would run in the CPU interpreter and the "
                      "timings would mean nothing. Unset it to benchmark the GPU.")

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    dtype = getattr(torch, _DTYPES[args.dtype])
    shapes = suite.shapes(args.quick)
    started = datetime.now(timezone.utc)
    env = runner.environment(started)
    if "H100" not in env["device"]:
        print(f"note: the ceiling column is the H100's {runner.MATMUL_CEILING_TFLOPS:.0f} TFLOP/s; "
              f"this is a {env['device']}.", file=sys.stderr)
    rows = suites.measure(suite, shapes, providers, dtype, args.warmup, args.rep)
    result = {
        "schema_version": runner.SCHEMA_VERSION, "suite": suite.name, **env,
        "dtype": args.dtype, "quick": args.quick, "providers": providers, "ours": suite.ours,
        "ceiling_tflops": runner.MATMUL_CEILING_TFLOPS,
        "timing": timing.record("warm", warmup_ms=args.warmup, rep_ms=args.rep, return_mode="median"),
        "rows": rows,
    }
    if suite.reference is not None:
        result["accuracy"] = {"against": suites.ACCURACY_REFERENCE, "keys": list(suites.ACCURACY_KEYS)}
    stamped, stable = runner.write_json(result, args.out)
    for line in runner.failures(rows):
        print(line)
    print(f"results: {stamped}\n         {stable}")
    if not args.no_plot:
        title = f"{suite.name}, {args.dtype}, {env['device']}"
        try:
            png = runner.plot(rows, suite.x_key, title, stable.with_suffix(".png"))
        except Exception as e:  # noqa: BLE001 — the numbers are saved; still print the table
            print(f"plot failed: {type(e).__name__}: {e}")
        else:
            print(f"plot:    {png}" if png else "plot skipped: matplotlib is not installed "
                  "(pip install matplotlib, or pass --no-plot)")
    print(f"\n{suite.name}, {args.dtype}, {env['device']}: median times; causal TF/s count half "
          f"the FLOPs;\n'X ÷' = X's TF/s over the other provider's (>1: X faster); '% of' "
          f"{suite.ours}'s share of the bf16 matmul ceiling; 'rel err' of {suite.ours}'s output vs the "
          f"first anchor's\n")
    print(runner.markdown_table(rows) if args.markdown else runner.text_table(rows), flush=True)
    _print_accuracy(rows)
    return 0


def _print_accuracy(rows: list[dict]) -> None:
    from flashflow.bench import tables

    text = tables.accuracy_table(rows)
    if text:
        print(f"\naccuracy against {suites.ACCURACY_REFERENCE}: cosine, and relative L1 error "
              f"Σ|out − exact| / Σ|exact|\n\n{text}", flush=True)


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
        return _error(f"--suite {name} needs a CUDA GPU (it {spec.measures}) and torch.cuda.is_available() "
                      "is False; without one, only the attention suite runs (a correctness demo in "
                      "Triton's interpreter)")
    if interpreting():
        return _error(f"--suite {name}: TRITON_INTERPRET is set, so the kernels would run in the CPU "
                      "interpreter. Unset it to benchmark the GPU.")
    if name == "mlp":
        try:
            args.providers = runner.parse_providers(args.providers, module.PROVIDERS, name)
        except ValueError as e:
            return _error(str(e))
    return module.run(args)
