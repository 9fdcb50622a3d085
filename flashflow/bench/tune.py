"""`flashflow tune OP`: time candidate configs of one op beside its anchor, on this GPU.

A candidate is the shipped config with some fields replaced (``--vary FIELD=V1,V2``, repeated;
by default one field at a time over the op's axes, ``--product`` for every combination).
``shipped`` is the op as it ships (its own config lookup). What an op is tuned on — its shapes,
anchor, axes, tolerance and options — is its spec's (:mod:`flashflow.bench.ops`): the anchor is
SDPA on cuDNN for attention, attention-bwd (forward + backward) and decode, torch (cuBLAS)
captured in a CUDA graph for mlp. Every candidate's output is checked against the anchor's
(relative error ≤ 1e-2, FP8 attention 6e-2, else it is reported and not timed); every provider
is timed as CUDA-graph replays after a warm-up (attention-bwd eagerly: autograd; its candidates
must also repeat their gradients bit for bit; decode cold in L2), in ``--rounds`` interleaved
rounds (:mod:`flashflow.bench.timing`'s ``rounds``: clocks drift with heat, so each ratio is
taken inside its round, then the median).

Besides config fields, a few plan options vary like fields: ``num_splits`` (decode) and
``policy`` (mlp: which kernel and tile order). ``--mask`` times attention with an additive mask,
from the shipped bias configs; ``--paged`` decode on a paged cache, from the page-sized tiles
where those ship; ``--fp8`` decode on FP8 (e4m3) caches, from their configs (the anchor stays
SDPA bf16 on the unquantized cache, within 5e-2). The JSON goes to
``--out/tune-OP-<device>.json``; the table printed last lists the best candidate per shape.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

from flashflow.bench import timing
from flashflow.bench.ops import TUNABLE
from flashflow.bench.spec import TOLERANCE, NotApplicable, TuneCase, TuneOption
from flashflow.reference.metrics import rel_l2

NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False)"


# --------------------------------------------------------------------------------------------
# candidates
# --------------------------------------------------------------------------------------------


def _value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    try:
        return int(text)
    except ValueError:
        return text.strip()


def tunable(op: str) -> tuple[str, ...]:
    """Every name ``--vary`` takes for ``op``: its configs' fields, then its plan options."""
    return TUNABLE[op].fields()


def parse_vary(specs, op: str) -> dict:
    """``["BLOCK_N=64,128", ...]`` -> ``{"BLOCK_N": (64, 128)}`` (the op's AXES when empty).
    Raises ValueError naming the spec and the form expected."""
    if not specs:
        return dict(TUNABLE[op].axes)
    axes = {}
    for spec in specs:
        field, sep, values = spec.partition("=")
        field = field.strip()
        if not sep or not field or not values.strip():
            raise ValueError(f"--vary must be FIELD=V1,V2,... (e.g. num_stages=3,4), got {spec!r}")
        if field not in tunable(op):
            raise ValueError(f"--vary {spec!r}: {op} has no field {field!r}; it takes {', '.join(tunable(op))}")
        axes[field] = tuple(_value(v) for v in values.split(","))
    return axes


def candidates(axes: dict, product: bool = False) -> dict:
    """name -> overrides. ``shipped`` (no override) first; then one field at a time, or with
    ``product`` every combination of the axes' values."""
    out = {"shipped": {}}
    if product:
        fields = list(axes)
        for values in itertools.product(*(axes[f] for f in fields)):
            ov = dict(zip(fields, values))
            out[",".join(f"{f}={v}" for f, v in ov.items())] = ov
    else:
        for field, values in axes.items():
            for v in values:
                out[f"{field}={v}"] = {field: v}
    return out


def tune_case(case: TuneCase, cands: dict, rounds: int, warmup: int, rep: int, bar,
              tolerance: float = TOLERANCE) -> dict:
    """One shape: check every candidate against the anchor, then time them all (timing
    ``rounds``: of ``graph`` replays of ``case.steps`` calls, or with ``steps`` 0 ``warm``)."""
    import torch

    ref = case.anchor()
    fns = {"anchor": case.anchor}
    row = {"label": case.label, "shape": case.shape, "shipped_config": case.shipped,
           "anchor": getattr(case.anchor, "backend", None), "candidates": {}, "skipped": {}}
    for name, ov in cands.items():
        try:
            fn = case.make(ov)
            out = fn()
            err = rel_l2(out, ref)
            if case.repeat_check and not all(torch.equal(out, fn()) for _ in range(case.repeat_check - 1)):
                row["candidates"][name] = {"overrides": ov, "rel_err": err,
                                           "error": f"run-to-run different over {case.repeat_check} runs"}
                continue
        except NotApplicable as e:
            row["skipped"][name] = str(e)
            continue
        except Exception as e:  # noqa: BLE001 — a config that does not compile or fit is a result
            row["candidates"][name] = {"overrides": ov, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        row["candidates"][name] = {"overrides": ov, "rel_err": err}
        if err <= tolerance:
            fns[name] = fn
        else:
            row["candidates"][name]["error"] = f"relative error {err:.2e} > {tolerance}"
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if case.steps:
        timer = lambda f: timing.graph_ms(f, case.steps, warmup, rep) * 1e3  # noqa: E731
    else:
        timer = lambda f: timing.warm_ms(f, warmup, rep) * 1e3  # noqa: E731
    samples, errors = timing.rounds(fns, timer, rounds, after_each=bar.update)
    for name, error in errors.items():
        row["candidates"].setdefault(name, {})["error"] = error
    bar.update(rounds * (len(cands) + 1 - len(fns)))   # skipped or refused: done too
    base = samples.pop("anchor")
    row["anchor_us"] = statistics.median(u for u in base if u is not None)
    for name, us in samples.items():
        if None in us:
            continue
        med = statistics.median(us)
        row["candidates"][name].update(us=med, rounds_us=[round(u, 2) for u in us],
                                       metric=case.work / (med * 1e-6) / 1e12,
                                       vs_anchor=statistics.median(b / u for b, u in zip(base, us)))
    timed = {n: c for n, c in row["candidates"].items() if "us" in c}
    if timed:
        row["best"] = min(timed, key=lambda n: timed[n]["us"])
    return row


def table(rows, unit: str, anchor: str) -> str:
    head = f"| shape | {anchor} µs | shipped µs | {unit} | best | µs | {unit} | best ÷ shipped |"
    lines = [head, "|:--|--:|--:|--:|:--|--:|--:|--:|"]
    for r in rows:
        c = r["candidates"]
        ship, best = c.get("shipped", {}), c.get(r.get("best"), {})

        def cell(d, key, spec):
            return format(d[key], spec) if key in d else "—"
        gain = f"{ship['us'] / best['us']:.3f}" if "us" in ship and "us" in best else "—"
        lines.append(f"| {r['label']} | {r['anchor_us']:.1f} | {cell(ship, 'us', '.1f')} | "
                     f"{cell(ship, 'metric', '.2f')} | {r.get('best', '—')} | {cell(best, 'us', '.1f')} | "
                     f"{cell(best, 'metric', '.2f')} | {gain} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown (empty ones say "none" in their help instead), the description's paragraphs kept."""

    def _get_help_string(self, action):
        if action.default in (None, (), "", False):
            return action.help
        return super()._get_help_string(action)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("tune", help="time candidate configs of an op beside its anchor (GPU)",
                              description=__doc__, formatter_class=_Formatter)
    p.add_argument("op", choices=list(TUNABLE), help="which op's configs to sweep")
    p.add_argument("--vary", action="append", default=None, metavar="FIELD=V1,V2",
                   help="a field (or plan option) and its values; repeat for more. Default per op: "
                        + "; ".join(f"{s.name}: " + " ".join(f"{f}={','.join(map(str, v))}" for f, v in s.axes.items())
                                    for s in TUNABLE.values()))
    p.add_argument("--product", action="store_true",
                   help="every combination of the --vary values, not one field at a time")
    p.add_argument("--quick", action="store_true", help="the bench suite's quick shapes")
    for option in _op_options():
        p.add_argument(*option.flags, **option.kwargs)
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (medians reported)")
    p.add_argument("--warmup", type=int, default=25, metavar="MS", help="do_bench warm-up per measurement")
    p.add_argument("--rep", type=int, default=100, metavar="MS", help="do_bench measuring time per measurement")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder of the JSON")
    p.set_defaults(func=main, parser=p)


def _op_options() -> list[TuneOption]:
    """The options the ops declare, each once, in the ops' order."""
    seen = {}
    for s in TUNABLE.values():
        for option in s.tune_options:
            seen.setdefault(option.dest, option)
    return list(seen.values())


def _validate(args):
    """Parsed options that argparse cannot check alone (ValueError with the fix)."""
    spec = TUNABLE[args.op]
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    for option in _op_options():
        if getattr(args, option.dest, None) in (None, False, "", ()) or option.dest in spec.tune_takes:
            continue
        owners = [s.name for s in TUNABLE.values() if option.dest in s.tune_takes]
        raise ValueError(f"{option.flags[0]} applies to {', '.join(owners)} only, not {args.op}")
    if spec.tune_check is not None:
        spec.tune_check(args)
    return candidates(parse_vary(args.vary, args.op), args.product)


def main(args: argparse.Namespace) -> int:
    parser = getattr(args, "parser", None)
    try:
        cands = _validate(args)
    except ValueError as e:
        if parser is None:
            raise
        parser.error(str(e))   # exits 2 with the usage line
    import torch

    from flashflow.device import interpreting

    if not torch.cuda.is_available() or interpreting():
        reason = NO_GPU if not torch.cuda.is_available() else "times the GPU: unset TRITON_INTERPRET"
        print(f"flashflow tune: {reason}", file=sys.stderr)
        return 2
    from flashflow.bench import runner
    from flashflow.progress import progress

    spec = TUNABLE[args.op]
    env = runner.environment()
    shapes = spec.tune_shapes(args)
    tolerance = spec.tolerance_for(args)
    rows = []
    with progress(len(shapes) * args.rounds * (len(cands) + 1), f"tune {args.op}") as bar:
        for shape in shapes:
            case = spec.tune_case(shape, args)
            rows.append(tune_case(case, cands, args.rounds, args.warmup, args.rep, bar, tolerance))
            del case   # its tensors, before the next shape allocates
            torch.cuda.empty_cache()
    result = {"suite": spec.result_suite(args), **env, "dtype": "bfloat16", "unit": spec.unit,
              "tolerance": tolerance, "candidates": cands, "rows": rows,
              "timing": timing.record("rounds", of=spec.tune_timing, rounds=args.rounds, warmup_ms=args.warmup,
                                      rep_ms=args.rep, return_mode="median",
                                      cuda_graph=spec.tune_timing != "warm")}
    path = runner.write_result(result, args.out)
    print(table(rows, spec.unit, spec.anchor))
    print(f"\nresults: {path}")
    return 0
