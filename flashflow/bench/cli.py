"""`flashflow bench`: time flashflow against its anchors on the GPU and keep the numbers.

Without a CUDA GPU it says so and runs a small correctness demo through Triton's interpreter.
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from flashflow.bench import runner
from flashflow.bench.suites import SUITES

NO_GPU = ("No CUDA GPU found (torch.cuda.is_available() is False), so there is nothing to time. "
          "Running a small correctness demo through the Triton CPU interpreter instead.")

_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}

# suites whose metrics differ from the attention table (TB/s, µs): their module has run(args)
OWN_RUNNER_SUITES = {"decode": "flashflow.bench.decode", "mlp": "flashflow.bench.mlp_suite"}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark flashflow against its anchors (SDPA cuDNN / FlashAttention)",
        description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES) + sorted(OWN_RUNNER_SUITES), default="attention",
                   help="which shapes and providers (default: attention)")
    p.add_argument("--quick", action="store_true", help="a few shapes instead of the full sweep")
    p.add_argument("--providers", default=None,
                   help="comma list (default: all of the suite's; attention: "
                        f"{','.join(SUITES['attention'].providers)})")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--out", type=Path, default=Path("bench/results"),
                   help="folder for the JSON and the plot (default: bench/results)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.add_argument("--warmup", type=int, default=25, metavar="MS",
                   help="do_bench warm-up time per measurement, ms (default: 25)")
    p.add_argument("--rep", type=int, default=100, metavar="MS",
                   help="do_bench measuring time per measurement, ms (default: 100)")
    p.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                   help="print the table of an earlier result instead of measuring")
    p.add_argument("--markdown", action="store_true",
                   help="print the table as Markdown (for docs)")
    p.set_defaults(func=main)


def _print_table(rows: list[dict], markdown: bool) -> None:
    print(runner.markdown_table(rows) if markdown else runner.text_table(rows), flush=True)


def _run_demo() -> int:
    """The interpreter must be chosen before Triton is imported; this process imported it."""
    from flashflow.tuning import interpreting

    if interpreting():
        from flashflow.bench import demo

        return demo.main()
    env = dict(os.environ, TRITON_INTERPRET="1")
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "flashflow.bench.demo"], env=env).returncode


def _parse_providers(spec: str | None, suite) -> list[str]:
    if spec is None:
        return list(suite.providers)
    names = [p.strip() for p in spec.split(",") if p.strip()]
    unknown = [p for p in names if p not in suite.providers]
    if unknown or not names:
        raise ValueError(f"--providers must be a comma list of {', '.join(suite.providers)} "
                         f"for suite {suite.name!r}, got {spec!r}")
    return list(dict.fromkeys(names))


def main(args: argparse.Namespace) -> int:
    if args.from_json is not None:
        try:
            rows = runner.read_json(args.from_json)["rows"]
        except (OSError, ValueError) as e:
            print(f"flashflow bench: cannot read {args.from_json}: {e}", file=sys.stderr)
            return 2
        _print_table(rows, args.markdown)
        return 0

    if args.suite in OWN_RUNNER_SUITES:
        import importlib

        import torch

        if not torch.cuda.is_available():
            print(NO_GPU, flush=True)
            return _run_demo()
        return importlib.import_module(OWN_RUNNER_SUITES[args.suite]).run(args)

    suite = SUITES[args.suite]
    try:
        providers = _parse_providers(args.providers, suite)
    except ValueError as e:
        print(f"flashflow bench: {e}", file=sys.stderr)
        return 2

    import torch

    from flashflow.tuning import interpreting

    if not torch.cuda.is_available():
        print(NO_GPU, flush=True)
        return _run_demo()
    if interpreting():
        print("flashflow bench: TRITON_INTERPRET is set, so the kernels would run in the CPU "
              "interpreter and the timings would mean nothing. Unset it to benchmark the GPU.",
              file=sys.stderr)
        return 2

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    dtype = getattr(torch, _DTYPES[args.dtype])
    shapes = suite.shapes(args.quick)
    started = datetime.now(timezone.utc)
    env = runner.environment(started)
    if "H100" not in env["device"]:
        print(f"note: the ceiling column is the H100's {runner.MATMUL_CEILING_TFLOPS:.0f} TFLOP/s; "
              f"this is a {env['device']}.", file=sys.stderr)
    rows = runner.run_suite(suite, shapes, providers, dtype, args.warmup, args.rep)
    result = {
        "schema_version": runner.SCHEMA_VERSION, "suite": suite.name, **env,
        "dtype": args.dtype, "quick": args.quick, "providers": providers, "ours": suite.ours,
        "ceiling_tflops": runner.MATMUL_CEILING_TFLOPS,
        "timing": {"warmup_ms": args.warmup, "rep_ms": args.rep, "return_mode": "median"},
        "rows": rows,
    }
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
          f"the FLOPs;\n'{suite.ours} ÷' = its TF/s over the anchor's (>1: {suite.ours} faster); "
          f"'% of' the bf16 matmul ceiling; 'rel err' of the outputs vs the first anchor\n")
    _print_table(rows, args.markdown)
    return 0
