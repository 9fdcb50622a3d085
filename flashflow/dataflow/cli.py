"""`flashflow dataflow ...`: tables and plots of the tile-order / cache-traffic model.

    flashflow dataflow table  --M 4096 --N 4096 --K 4096            # orders vs DRAM bytes
    flashflow dataflow table  --M 8192 --N 8192 --K 8192 --l2-partitions 2 --drift 1 --tiles-per-sm 2
                                                 # the partitioned H100 model (see docs)
    flashflow dataflow sweep  --M 4096 --N 4096 --K 4096 --png t.png # traffic vs cache size
    flashflow dataflow search --M 512 --N 512 --K 512 --block-m 128 --block-n 128 --cache 256KiB --sms 1
    flashflow dataflow waves  --M 4096 --n-max 16384 --png w.png    # tail / stair-step curve
    flashflow dataflow chain  --M 4096 --hidden 4096 --intermediate 14336
    flashflow dataflow decode-layer --batch 1 --cache-len 4095   # the decode megakernel's stages

Defaults are an H100 (132 SMs, 50 MiB of L2, modelled as one LRU in lockstep waves) running
bf16 with 128×128×64 tiles; ``--l2-partitions 2`` splits the L2 into near partitions
(``--sharing``, ``--placement``) and ``--drift`` spreads the slots out of lockstep. Sizes take
K, M, G suffixes in powers of 1024 (50M = 50 MiB). PNG output needs matplotlib; without it the
text output is printed and a note says why no PNG was written.
"""
from __future__ import annotations

import argparse
import re
import sys

from flashflow.dataflow import bounds as _bounds
from flashflow.dataflow import chain as _chain
from flashflow.dataflow import decode_layer as _decode_layer
from flashflow.dataflow import orders as _orders
from flashflow.dataflow import plots as _plots
from flashflow.dataflow import search as _search
from flashflow.dataflow import waves as _waves
from flashflow.dataflow.cache import PartitionedL2
from flashflow.dataflow.machine import PLACEMENTS
from flashflow.dataflow.model import H100, H100_PARTITIONED, compare_orders
from flashflow.dataflow.shape import GemmShape
from flashflow.progress import progress

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
ANNEAL_ITERATIONS = 2000


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every option's help; descriptions keep their line breaks (examples)."""

    def _get_help_string(self, action):
        # an option without a default (None) says in its own words what happens without it
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_size(text: str) -> int:
    """'50M', '50MiB', '256KB', '4096' -> bytes (suffixes are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"size must look like 4096, 256K or 50MiB, got {text!r}")
    value = float(match.group(1)) * _UNITS[match.group(2).upper()]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"size must be a whole number of bytes, got {text!r}")
    return int(value)


def _positive_size(text: str) -> int:
    value = parse_size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            word = "positive" if low == 1 else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {word}, got {value}")
        return value
    parse.__name__ = "int"   # argparse names the type in some messages
    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return value


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _shape(args) -> GemmShape:
    return GemmShape(args.M, args.N, args.K, args.block_m, args.block_n, args.block_k,
                     args.elem_bytes)


def _specs(text: str | None, shape: GemmShape) -> list[str] | None:
    """``--orders`` as a list, every name checked against the grid (None: the default set)."""
    if text is None:
        return None
    specs = [spec.strip() for spec in text.split(",")]
    for spec in specs:
        if not spec:
            raise ValueError(f"--orders: empty name in {text!r}")
        try:
            _orders.make_order(spec, shape.tiles_m, shape.tiles_n)
        except ValueError as e:
            raise ValueError(f"--orders: {e}") from None
    return specs


def _unused(args, option: str, needs: str) -> None:
    """Options that only a mode reads are refused outside it, not silently ignored."""
    if getattr(args, option.lstrip("-").replace("-", "_")) is not None:
        raise ValueError(f"{option} applies only {needs}")


def _add_shape(p, M=4096, N=4096, K=4096):
    p.add_argument("--M", type=_positive, default=M, help="rows of A and C")
    p.add_argument("--N", type=_positive, default=N, help="columns of B and C")
    p.add_argument("--K", type=_positive, default=K, help="the reduction dimension")
    _add_tiles(p)


def _add_tiles(p):
    p.add_argument("--block-m", type=_positive, default=128, help="tile rows")
    p.add_argument("--block-n", type=_positive, default=128, help="tile columns")
    p.add_argument("--block-k", type=_positive, default=64, help="K-step of a tile")
    p.add_argument("--elem-bytes", type=_positive, default=2, help="bytes per element (bf16: 2)")


def _add_machine(p, cache=True, partitions=False, both=False):
    p.add_argument("--sms", type=_positive, default=H100.num_sms,
                   help="tiles running at once (SMs x resident tiles per SM)")
    if cache:
        p.add_argument("--cache", type=parse_size, default="50MiB",
                       help="L2 size (K, M, G suffixes: powers of 1024)")
        p.add_argument("--policy", choices=("lru", "belady", "both") if both else ("lru", "belady"),
                       default="lru", help="cache replacement policy")
    if partitions:
        p.add_argument("--l2-partitions", type=_positive, default=1,
                       help="near L2 partitions, each of cache/N (H100: 2); LRU only")
        p.add_argument("--sharing", choices=PartitionedL2.SHARING,
                       default=H100_PARTITIONED.sharing,
                       help="what a near miss costs: home (a copy in the line's home "
                            "partition serves it), far (any partition serves it), copies "
                            "(DRAM always)")
        p.add_argument("--placement", choices=PLACEMENTS, default=H100_PARTITIONED.placement,
                       help="which partition's SMs run each tile")
        p.add_argument("--tiles-per-sm", type=_positive, default=1,
                       help="resident tiles per SM: --sms/this are SMs, for --placement")
        p.add_argument("--drift", type=_fraction, default=0.0,
                       help="spread of the slots' phases, as a fraction of one tile "
                            "(0: lockstep waves, 1: fully drifted)")


def _machine_options(args) -> dict:
    if args.l2_partitions == 1:
        return {"drift": args.drift}
    if args.policy != "lru":
        raise ValueError(f"a partitioned L2 (--l2-partitions {args.l2_partitions}) is modelled "
                         f"with --policy lru only, got --policy {args.policy}")
    if args.sms % args.tiles_per_sm:
        raise ValueError(f"--sms {args.sms} must be a multiple of --tiles-per-sm "
                         f"{args.tiles_per_sm}")
    return {"partitions": args.l2_partitions, "sharing": args.sharing,
            "placement": args.placement, "drift": args.drift, "tiles_per_sm": args.tiles_per_sm}


def _machine_text(args) -> str:
    if args.l2_partitions == 1:
        text = f"cache {fmt_bytes(args.cache)}"
    else:
        text = (f"cache {fmt_bytes(args.cache)} in {args.l2_partitions} partitions "
                f"(sharing {args.sharing}, placement {args.placement}, "
                f"{args.tiles_per_sm} tiles/SM)")
    return text + (f", drift {args.drift:g}" if args.drift else "")


def _png(path, draw) -> None:
    if not path:
        return
    try:
        draw(path)
        print(f"wrote {path}")
    except _plots.PlottingUnavailable as e:
        print(f"note: no PNG written to {path}: {e}", file=sys.stderr)


def _compare(shape, cache, sms, policy, specs, bar, extra=None, **machine):
    """compare_orders one order at a time, so the bar counts orders."""
    rows = []
    for spec in specs:
        rows += compare_orders(shape, cache, sms, policy, [spec], **machine)
        bar.update()
    for label, order in (extra or {}).items():
        rows += compare_orders(shape, cache, sms, policy, [], {label: order}, **machine)
        bar.update()
    return rows


def cmd_table(args) -> int:
    shape = _shape(args)
    specs = _specs(args.orders, shape) or _orders.default_specs(shape.tiles_m, shape.tiles_n)
    if not args.anneal:
        _unused(args, "--seed", "with --anneal")
        _unused(args, "--search-block-k", "with --anneal")
    policies = ("lru", "belady") if args.policy == "both" else (args.policy,)
    machine = _machine_options(args)
    b = _bounds.bounds(shape, args.cache)
    print(f"GEMM {shape.M}x{shape.N}x{shape.K}, tiles {shape.block_m}x{shape.block_n}x"
          f"{shape.block_k} ({shape.tiles_m}x{shape.tiles_n} grid, {shape.k_steps} K-steps), "
          f"{args.sms} SMs, {_machine_text(args)}")
    print(f"compulsory reads {fmt_bytes(b.compulsory_read_bytes)}, writes "
          f"{fmt_bytes(b.compulsory_write_bytes)}; red-blue pebble bound "
          f"{fmt_bytes(b.pebble_bytes)} (2MNK/sqrt(S))", flush=True)
    extra = {}
    if args.anneal:
        seed = args.seed or 0
        with progress(None, f"annealing ({args.anneal} iterations)"):
            res = _search.anneal(shape, args.cache, args.sms, policies[0], iterations=args.anneal,
                                 seed=seed, block_k=args.search_block_k)
        extra[f"anneal(seed={seed})"] = res.order
    headers = ["order"]
    for p in policies:
        headers += [f"read ({p})", "x compulsory", "hit rate"]
    with progress(len(policies) * (len(specs) + len(extra)), "simulating orders") as bar:
        results = {p: _compare(shape, args.cache, args.sms, p, specs, bar, extra, **machine)
                   for p in policies}
    rows = []
    for i, row in enumerate(results[policies[0]]):
        line = [row.spec]
        for p in policies:
            t = results[p][i].traffic
            line += [fmt_bytes(t.read_bytes), f"{t.read_bytes / b.compulsory_read_bytes:.2f}",
                     f"{t.hit_rate:.3f}"]
        rows.append(line)
    print(_table(headers, rows))

    def draw(path):
        panels = {r.spec: extra[r.spec] if r.spec in extra else
                  _orders.make_order(r.spec, shape.tiles_m, shape.tiles_n)
                  for r in results[policies[0]]}
        _plots.order_heatmap(path, shape.tiles_m, shape.tiles_n, panels)
    _png(args.png, draw)
    return 0


def cmd_sweep(args) -> int:
    shape = _shape(args)
    specs = _specs(args.orders, shape) or _orders.default_specs(shape.tiles_m, shape.tiles_n)
    if args.min_cache > args.max_cache:
        raise ValueError(f"--min-cache ({fmt_bytes(args.min_cache)}) must not exceed "
                         f"--max-cache ({fmt_bytes(args.max_cache)})")
    sizes = []
    size = args.min_cache
    while size <= args.max_cache:
        sizes.append(size)
        size *= 2
    machine = _machine_options(args)
    series = {s: [] for s in specs}
    with progress(len(sizes) * len(specs), "simulating orders") as bar:
        for c in sizes:
            for row in _compare(shape, c, args.sms, args.policy, specs, bar, **machine):
                series[row.spec].append(row.traffic.read_bytes)
    lower = [_bounds.bounds(shape, c).read_lower_bound for c in sizes]
    print(_table(["cache"] + specs + ["lower bound"],
                 [[fmt_bytes(c)] + [fmt_bytes(series[s][i]) for s in specs] +
                  [fmt_bytes(lower[i])] for i, c in enumerate(sizes)]))
    _png(args.png, lambda p: _plots.traffic_vs_cache(
        p, sizes, series, lower,
        f"{shape.M}x{shape.N}x{shape.K}, {args.sms} SMs ({args.policy})"))
    return 0


def cmd_search(args) -> int:
    shape = _shape(args)
    grid = (shape.tiles_m, shape.tiles_n)
    panels = {}
    if shape.num_tiles <= _search.MAX_EXHAUSTIVE_TILES and not args.anneal:
        for option in ("--iterations", "--seed", "--search-block-k"):
            _unused(args, option, f"to annealing (add --anneal; grids of at most "
                                  f"{_search.MAX_EXHAUSTIVE_TILES} tiles are searched "
                                  f"exhaustively)")
        if args.policy != "lru":
            print("note: exhaustive search prunes with LRU states; searching under LRU",
                  file=sys.stderr)
        with progress(None, f"exhaustive search of a {grid[0]}x{grid[1]} grid"):
            r = _search.exhaustive(shape, args.cache, args.sms)
        print(f"exhaustive over a {grid[0]}x{grid[1]} grid: {r.explored} nodes explored, "
              f"{r.complete} complete orders reached, of {r.total_orders} without pruning")
        print(f"best : {fmt_bytes(r.best_read_bytes)} read  {r.best_order}")
        print(f"worst: {fmt_bytes(r.worst_read_bytes)} read  {r.worst_order}")
        panels = {"best": r.best_order, "worst": r.worst_order}
    else:
        iterations = args.iterations or ANNEAL_ITERATIONS
        with progress(None, f"annealing ({iterations} iterations)"):
            r = _search.anneal(shape, args.cache, args.sms, args.policy, iterations=iterations,
                               seed=args.seed or 0, block_k=args.search_block_k)
        full = f" ({fmt_bytes(r.full_read_bytes)} at block_k={shape.block_k})" \
            if r.full_read_bytes is not None else ""
        print(f"anneal (seed {r.seed}, {r.iterations} iterations, {r.accepted} accepted): "
              f"{r.start_spec} {fmt_bytes(r.start_read_bytes)} -> {fmt_bytes(r.read_bytes)}"
              f"{full}")
        if shape.num_tiles <= 64:
            print(f"order: {r.order}")
        panels = {f"anneal seed {r.seed}": r.order,
                  r.start_spec: _orders.make_order(r.start_spec, *grid)}
    _png(args.png, lambda p: _plots.order_heatmap(p, grid[0], grid[1], panels))
    return 0


def cmd_waves(args) -> int:
    step = args.n_step or args.block_n
    if args.n_max < step:
        raise ValueError(f"--n-max ({args.n_max}) must be at least the N step ({step}: "
                         f"--n-step, or --block-n when no --n-step is given)")
    points = _waves.stair_steps(args.M, range(step, args.n_max + 1, step), args.block_m,
                                args.block_n, args.sms, args.tiles_per_sm)
    print(_table(["N", "tiles", "waves", "last wave", "time", "ideal"],
                 [[p.N, p.tiles, p.waves, f"{p.last_wave_utilization:.0%}", f"{p.time:.0f}",
                   f"{p.ideal_time:.2f}"] for p in points]))
    _png(args.png, lambda path: _plots.stair_steps(
        path, [p.N for p in points], [p.time for p in points], [p.ideal_time for p in points],
        f"M={args.M}, {args.block_m}x{args.block_n} tiles, "
        f"{args.sms * args.tiles_per_sm} slots"))
    return 0


def _chain_policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",")]
    probe = _chain.FfnShape(1, 64, 64, block_n=64, block_k=64)
    for p in policies:
        try:
            _chain.chain_jobs(probe, p)
        except ValueError as e:
            raise ValueError(f"--policies: {e}") from None
    return policies


def cmd_chain(args) -> int:
    s = _chain.FfnShape(args.M, args.hidden, args.intermediate, args.block_m, args.block_n,
                        args.block_k, args.elem_bytes, gated=not args.ungated)
    policies = _chain_policies(args.policies)
    print(f"FFN M={s.M} hidden={s.hidden} intermediate={s.intermediate}: GEMM0 "
          f"{s.row_blocks}x{s.tiles_n0} tiles, GEMM1 {s.row_blocks}x{s.tiles_n1}; {args.sms} SMs, "
          f"cache {fmt_bytes(args.cache)}", flush=True)
    rows = []
    with progress(2 * len(policies), "simulating policies") as bar:
        for deps in ("rowblock", "tile"):
            for policy in policies:
                r, = _chain.compare_policies(s, args.cache, args.sms, deps, [policy],
                                             args.policy)
                bar.update()
                if r.deadlocked:
                    rows.append([r.policy, deps, "deadlock", "", "", "", ""])
                    continue
                t = r.traffic
                rows.append([r.policy, deps, fmt_bytes(t.read_bytes), fmt_bytes(t.write_bytes),
                             f"{t.hit_rate:.3f}", t.makespan, f"{t.utilization:.0%}"])
    print(_table(["policy", "deps", "read", "write", "hit rate", "time (K-steps)",
                  "SM busy"], rows))
    return 0


def cmd_decode_layer(args) -> int:
    from dataclasses import replace
    from types import SimpleNamespace

    from flashflow.tuning.decode import cap_splits, num_splits_heuristic
    from flashflow.tuning.decode_layer import decode_layer_config

    if args.heads % args.kv_heads:
        raise ValueError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    layer = SimpleNamespace(hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                            head_dim=args.head_dim, intermediate=args.intermediate)
    tiles = decode_layer_config("sm90", args.head_dim)
    tiles = replace(tiles, **{k: v for k, v in (("QKV_PAIRS", args.qkv_pairs), ("BLOCK_N", args.block_n),
                                                ("BLOCK_I", args.block_i), ("BLOCK_K", args.block_k),
                                                ("SPLIT_K", args.split_k), ("QKV_SPLIT", args.qkv_split))
                              if v is not None})
    if (args.head_dim // 2) % tiles.QKV_PAIRS:
        raise ValueError(f"--qkv-pairs ({tiles.QKV_PAIRS}) must divide head_dim / 2 ({args.head_dim // 2})")
    capacity = args.cache_len + 1
    splits = args.splits or cap_splits(num_splits_heuristic(args.batch * args.kv_heads, capacity, args.sms,
                                                            tiles.BLOCK_KV), capacity, tiles.BLOCK_KV)
    r = _decode_layer.model_layer(layer, args.batch, args.cache_len, tiles, splits, args.sms, args.cache,
                                  args.elem_bytes, args.folded_norms)
    print(f"decode layer hidden={args.hidden} heads={args.heads}/{args.kv_heads} d={args.head_dim} "
          f"intermediate={args.intermediate}, batch {args.batch}, {args.cache_len} cached keys, {splits} splits; "
          f"{args.sms} programs, L2 {fmt_bytes(args.cache)}; tiles {tiles}"
          + ("; folded norms" if args.folded_norms else ""))
    rows = [[st.name, st.tasks, f"{st.steps_per_task:.0f}", st.span, f"{st.busy_fraction:.0%}",
             fmt_bytes(st.weight_bytes)] for st in r.stages]
    print(_table(["stage", "tasks", "K-steps a task", "span (K-steps)", "SMs busy", "weights"], rows))
    print(f"DRAM {fmt_bytes(r.dram_bytes)} (the fewest a step moves: {fmt_bytes(r.compulsory_bytes)}); "
          f"time {r.makespan} K-steps against {r.ideal_makespan} with every SM busy: "
          f"{r.makespan / r.ideal_makespan:.2f}x, SMs {r.utilization:.0%} busy")
    return 0


def _run(args) -> int:
    """Bad values the options' types cannot see alone (combinations, order names, shapes the
    model refuses) end as argparse errors: usage, one line, exit status 2."""
    try:
        return args.command(args)
    except ValueError as e:
        args.parser.error(str(e))


def _sub(sub, name, command, help, description):
    p = sub.add_parser(name, help=help, description=description, formatter_class=_Formatter)
    p.set_defaults(func=_run, command=command, parser=p)
    return p


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "dataflow", help="tile-order / cache-traffic model: tables, sweeps, searches, plots",
        description=__doc__, formatter_class=_Formatter)
    sub = p.add_subparsers(dest="dataflow_command", required=True, metavar="COMMAND")

    t = _sub(sub, "table", cmd_table, "named orders and their DRAM traffic",
             "DRAM traffic of named tile orders (and an annealed one) for one GEMM.")
    _add_shape(t)
    _add_machine(t, partitions=True, both=True)
    t.add_argument("--orders", help="comma-separated specs, e.g. row_major,grouped_m:8 "
                                    "(default: the named orders that fit the grid)")
    t.add_argument("--anneal", type=_non_negative, default=0, metavar="ITERS",
                   help="add an annealed order found in ITERS iterations (0: none)")
    t.add_argument("--seed", type=int, default=None, help="annealing seed (default 0)")
    t.add_argument("--search-block-k", type=_positive, default=None,
                   help="coarser K-step for the annealing's evaluations (default: --block-k)")
    t.add_argument("--png", help="write heat maps of the orders to this PNG")

    s = _sub(sub, "sweep", cmd_sweep, "traffic vs cache size",
             "DRAM traffic of tile orders as the cache doubles from --min-cache to --max-cache.")
    _add_shape(s)
    _add_machine(s, partitions=True)
    s.add_argument("--orders", help="comma-separated specs (default: the named orders that fit "
                                    "the grid)")
    s.add_argument("--min-cache", type=_positive_size, default="1MiB", help="smallest cache")
    s.add_argument("--max-cache", type=_positive_size, default="128MiB", help="largest cache")
    s.add_argument("--png", help="write traffic against cache size to this PNG")

    q = _sub(sub, "search", cmd_search, "best order: exhaustive (<= 16 tiles) or annealing",
             f"The best tile order: proven by exhaustive search on grids of at most "
             f"{_search.MAX_EXHAUSTIVE_TILES} tiles (LRU), found by simulated annealing on "
             f"larger grids or with --anneal.")
    _add_shape(q, 512, 512, 512)
    _add_machine(q)
    q.add_argument("--anneal", action="store_true", help="anneal even on a small grid")
    q.add_argument("--iterations", type=_positive, default=None,
                   help=f"annealing iterations (default {ANNEAL_ITERATIONS})")
    q.add_argument("--seed", type=int, default=None, help="annealing seed (default 0)")
    q.add_argument("--search-block-k", type=_positive, default=None,
                   help="coarser K-step for the annealing's evaluations (default: --block-k)")
    q.add_argument("--png", help="write heat maps of the orders found to this PNG")

    w = _sub(sub, "waves", cmd_waves, "waves, last-wave utilization, stair-step latency",
             "Waves, last-wave utilization and the stair-step latency of an MxN GEMM as N "
             "grows.")
    w.add_argument("--M", type=_positive, default=4096, help="rows of the output")
    w.add_argument("--n-max", type=_positive, default=16384, help="largest N")
    w.add_argument("--n-step", type=_positive, default=None,
                   help="step of N (default: --block-n)")
    w.add_argument("--block-m", type=_positive, default=128, help="tile rows")
    w.add_argument("--block-n", type=_positive, default=128, help="tile columns")
    w.add_argument("--tiles-per-sm", type=_positive, default=1, help="resident tiles per SM")
    _add_machine(w, cache=False)
    w.add_argument("--png", help="write the stair-step curve to this PNG")

    c = _sub(sub, "chain", cmd_chain, "GEMM0 -> GEMM1 (fused FFN) scheduling policies",
             "Traffic and time of the fused FFN's two GEMMs under each issue policy and "
             "dependency kind.")
    c.add_argument("--M", type=_positive, default=4096, help="tokens")
    c.add_argument("--hidden", type=_positive, default=4096, help="model width")
    c.add_argument("--intermediate", type=_positive, default=14336, help="FFN width")
    c.add_argument("--ungated", action="store_true", help="W_gate_up is one matrix, not two")
    c.add_argument("--policies", default="sequential,rowblock,halfrow,multirow:2",
                   help="comma-separated issue policies (multirow:R for R row-blocks)")
    _add_tiles(c)
    _add_machine(c)

    d = _sub(sub, "decode-layer", cmd_decode_layer, "the decode megakernel's stages: SMs busy, DRAM bytes",
             "The decode-layer megakernel's task table (flashflow.kernels.decode_layer) on the "
             "machine: each stage's tasks, the span it takes and the SMs it keeps busy, and the "
             "DRAM bytes of a step against the fewest possible. One K-step a time unit.")
    d.add_argument("--batch", type=_positive, default=1, help="sequences (1-16)")
    d.add_argument("--cache-len", type=_non_negative, default=4095, help="keys cached before this token")
    d.add_argument("--hidden", type=_positive, default=4096, help="model width (Llama-3-8B's by default)")
    d.add_argument("--heads", type=_positive, default=32, help="query heads")
    d.add_argument("--kv-heads", type=_positive, default=8, help="key/value heads")
    d.add_argument("--head-dim", type=_positive, default=128, help="head size")
    d.add_argument("--intermediate", type=_positive, default=14336, help="FFN width")
    d.add_argument("--splits", type=_non_negative, default=0, help="attention splits (0: the plan's rule)")
    d.add_argument("--qkv-pairs", type=_positive, default=None, help="rotary pairs a QKV task (default: sm90's)")
    d.add_argument("--block-n", type=_positive, default=None, help="O / down columns a task (default: sm90's)")
    d.add_argument("--block-i", type=_positive, default=None, help="gate/up columns a task (default: sm90's)")
    d.add_argument("--block-k", type=_positive, default=None, help="K chunk (default: sm90's)")
    d.add_argument("--split-k", type=_positive, default=None,
                   help="K slices an O / down column block, merged by the last (default: sm90's)")
    d.add_argument("--qkv-split", type=_positive, default=None,
                   help="K slices a QKV tile, merged by the last (default: sm90's)")
    d.add_argument("--folded-norms", action="store_true",
                   help="the norm weights folded into the QKV and gate/up weights (no norm rows of h)")
    d.add_argument("--elem-bytes", type=_positive, default=2, help="bytes an element (2: bf16)")
    _add_machine(d)
