"""`flashflow bench --suite attention` (the default suite): flashflow's attention forward and its
FP8 variant against SDPA's cuDNN and FLASH backends at the shapes of
:func:`flashflow.bench.suites.attention_shapes`, with each output's accuracy against exact
attention (:data:`flashflow.bench.suites.SUITES`). A runner like the others
(:data:`flashflow.bench.suites.RUNNERS`): ``check_args``, ``run``, ``report``.
"""
from __future__ import annotations

import logging
import sys
from datetime import datetime, timezone

from flashflow.bench import runner, suites, timing

SUITE = suites.SUITES["attention"]
PROVIDERS = SUITE.providers
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def check_args(args) -> str | None:
    """``args.providers`` as a list of the suite's providers; the problem, if any."""
    try:
        args.providers = runner.parse_providers(args.providers, SUITE.providers, SUITE.name)
    except ValueError as e:
        return str(e)
    return None


def run(args) -> int:
    import torch

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    suite, providers = SUITE, args.providers
    dtype = getattr(torch, DTYPES[args.dtype])
    shapes = suite.shapes(args.quick)
    env = runner.environment(datetime.now(timezone.utc))
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
    print(report(result, markdown=getattr(args, "markdown", False)), flush=True)
    return 0


def report(result: dict, markdown: bool = False) -> str:
    """The timing table and, where measured, the accuracy table of a saved result."""
    from flashflow.bench import tables

    rows = result["rows"]
    text = runner.markdown_table(rows) if markdown else runner.text_table(rows)
    accuracy = tables.accuracy_table(rows)
    if accuracy:
        text += (f"\n\naccuracy against {suites.ACCURACY_REFERENCE}: cosine, and relative L1 error "
                 f"Σ|out − exact| / Σ|exact|\n\n{accuracy}")
    return text
