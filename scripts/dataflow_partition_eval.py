"""Score L2 model variants against DRAM bytes measured on a GPU (CPU only).

Reads a validation JSON written by scripts/dataflow_gpu_validate.py (default: the H100 one in
bench/results/), re-runs the dataflow model for every measured (shape, order) under each
variant, and prints per variant and shape the Spearman rank correlation between predicted and
measured read bytes and the model/measured ratios. Every variant is one rule set of
:mod:`flashflow.dataflow.machine`; nothing here is fitted per point.

Variants: timing (``lockstep`` K-steps, or ``drift``: slot phases spread over one tile) ×
L2 (``unified`` LRU of the full or half size, or two partitions with a ``sharing`` rule and a
``placement`` of tiles on sides; see flashflow/dataflow/cache.py and machine.py). ``driftF``
spreads the phases over a fraction F of a tile (a free parameter: a sensitivity check only).
The model's H100_PARTITIONED is ``drift/p2-home-halves``.

Besides Spearman's rho per shape it counts the pairs of orders whose measured bytes differ by
more than 10% that the variant orders the same way ("pairs >10%").

    python scripts/dataflow_partition_eval.py                  # 22 variants, ~2 min on 2 cores
    python scripts/dataflow_partition_eval.py --variants drift/p2-home-random --seeds 0,1,2
    python scripts/dataflow_partition_eval.py --json out.json  # also write every prediction

Whatever variant scores best here was chosen on these points: a score on the data used to
choose is in-sample, not a validation.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flashflow.dataflow import orders as _orders  # noqa: E402
from flashflow.dataflow.model import simulate  # noqa: E402
from flashflow.dataflow.shape import GemmShape  # noqa: E402
from flashflow.dataflow.stats import separated_pairs, spearman  # noqa: E402

DEFAULT_JSON = REPO / "bench" / "results" / "dataflow-validation-nvidia-h100-80gb-hbm3.json"
SHARINGS = ("home", "far", "copies")
PLACEMENTS = ("random", "alternate", "halves")


def all_variants() -> list[str]:
    out = []
    for timing in ("lockstep", "drift"):
        out += [f"{timing}/unified", f"{timing}/unified-half"]
        out += [f"{timing}/p2-{s}-{p}" for s, p in itertools.product(SHARINGS, PLACEMENTS)]
    return out


def variant_kwargs(name: str, l2_bytes: int) -> tuple[int, dict]:
    """'drift/p2-home-random' -> (cache bytes, simulate() keyword arguments)."""
    timing, _, l2 = name.partition("/")
    if timing == "lockstep":
        kw = {"drift": 0.0}
    elif timing == "drift":
        kw = {"drift": 1.0}
    elif timing.startswith("drift") and _is_fraction(timing[5:]):
        kw = {"drift": float(timing[5:])}
    else:
        raise ValueError(f"variant timing must be lockstep, drift or driftF (F in [0, 1]), "
                         f"got {name!r}")
    if l2 == "unified":
        return l2_bytes, kw
    if l2 == "unified-half":
        return l2_bytes // 2, kw
    parts = l2.split("-")
    if len(parts) != 3 or parts[0] != "p2" or parts[1] not in SHARINGS or \
            parts[2] not in PLACEMENTS:
        raise ValueError(f"variant L2 must be unified, unified-half or p2-SHARING-PLACEMENT, "
                         f"got {name!r}")
    return l2_bytes, dict(kw, partitions=2, sharing=parts[1], placement=parts[2])


def _is_fraction(text: str) -> bool:
    try:
        return 0 <= float(text) <= 1
    except ValueError:
        return False


def _predict(job) -> int:
    mnk, block, spec, slots, per_sm, l2_bytes, variant, seed = job
    shape = GemmShape(*mnk, *block)
    cache, kw = variant_kwargs(variant, l2_bytes)
    order = _orders.make_order(spec, shape.tiles_m, shape.tiles_n)
    return simulate(shape, order, cache, slots, seed=seed, tiles_per_sm=per_sm,
                    **kw).read_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", default=str(DEFAULT_JSON))
    ap.add_argument("--variants", default=None, help="comma-separated; default: all")
    ap.add_argument("--seeds", default="0", help="seeds of the random placement, averaged")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", help="write every prediction here")
    args = ap.parse_args(argv)

    data = json.loads(Path(args.measured).read_text())
    hw = data["model_hardware"]
    slots = hw["num_sms"] * hw["tiles_per_sm"]
    block = tuple(data["kernel"]["block"])
    points = [r for r in data["results"] if r.get("measured_read_bytes")]
    variants = args.variants.split(",") if args.variants else all_variants()
    for v in variants:
        variant_kwargs(v, 1)   # reject a bad name before the long run
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"{len(points)} measured points from {args.measured} ({data['device']}); model: "
          f"{slots} slots, L2 {hw['l2_bytes'] / 2**20:.0f} MiB, tiles {block}")

    jobs = []
    for v in variants:
        for r in points:
            mnk = tuple(int(x) for x in r["shape"].split("x"))
            for seed in (seeds if "random" in v else seeds[:1]):
                jobs.append((mnk, block, r["order"], slots, hw["tiles_per_sm"],
                             hw["l2_bytes"], v, seed))
    t0 = time.time()
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(_predict, jobs, chunksize=1))
    by_job: dict = {}
    for job, read in zip(jobs, results):
        by_job.setdefault((job[6], "x".join(map(str, job[0])), job[2]), []).append(read)
    print(f"{len(jobs)} simulations in {time.time() - t0:.0f} s\n")

    shapes = list(dict.fromkeys(r["shape"] for r in points))
    summary = []
    for v in variants:
        line = [v]
        all_ratios = []
        for shape in shapes:
            rows = [r for r in points if r["shape"] == shape]
            measured = [r["measured_read_bytes"] for r in rows]
            model = [sum(by_job[(v, shape, r["order"])]) / len(by_job[(v, shape, r["order"])])
                     for r in rows]
            ratios = [p / m for p, m in zip(model, measured)]
            all_ratios += ratios
            line.append(spearman(model, measured))
            right, total = separated_pairs(model, measured)
            line.append(f"{right}/{total}")
            line.append(" ".join(f"{x:.2f}" for x in ratios))
        line.append(min(all_ratios))
        line.append(max(all_ratios))
        summary.append(line)

    orders_note = " / ".join(f"{s}: " + ", ".join(r["order"] for r in points
                                                  if r["shape"] == s) for s in shapes)
    print(f"ratio columns list model/measured in the order {orders_note}\n")
    head = ["variant"] + [h for s in shapes for h in (f"rho {s}", "pairs >10%",
                                                      f"ratios {s}")] + \
           ["min ratio", "max ratio"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for line in summary:
        cells = [f"{c:.2f}" if isinstance(c, float) else str(c) for c in line]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"measured": args.measured, "seeds": seeds,
             "predictions": [{"variant": v, "shape": s, "order": o, "read_bytes": reads}
                             for (v, s, o), reads in by_job.items()]}, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
