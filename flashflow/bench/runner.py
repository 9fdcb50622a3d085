"""Time a suite's providers on the GPU, and write the results as a table, JSON and a plot.

A result is one JSON-able dict: the environment it was measured in plus one row per shape::

    {"shape": {...}, "panel": "d=128 causal", "flops": 1.1e12,
     "results": {"flashflow": {"ms": 2.1, "tflops": 523.0, "error": null}, ...},
     "ratios": {"flashflow/sdpa-cudnn": 0.97, ...},   # TFLOP/s of ours ÷ the anchor's
     "pct_of_ceiling": 66.6,                          # ours, % of MATMUL_CEILING_TFLOPS
     "check": {"against": "sdpa-cudnn", "rel_err": 0.003}}
"""
from __future__ import annotations

import json
import logging
import math
import platform
import re
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from flashflow.bench import timing
from flashflow.progress import progress as Progress

log = logging.getLogger(__name__)

# Dense bf16 matmul rate measured on an H100 (80GB HBM3, 132 SMs). Attention's two
# matmuls cannot run faster than that, so the percentage says how much of the tensor cores'
# rate the softmax, masking and memory traffic leave us. Other GPUs need their own number.
MATMUL_CEILING_TFLOPS = 785.0

# Ours vs an anchor: relative Frobenius error of the outputs. Two correct bf16 implementations
# differ by a few 1e-3 (each rounds its output to 8 mantissa bits); a real bug gives ~1.
CHECK_TOLERANCE = 2e-2

SCHEMA_VERSION = 1


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def time_provider(make, shape, inputs, warmup_ms: int, rep_ms: int):
    """(result dict, output or None), timed ``warm``. An exception, e.g. an unsupported
    head_dim, is recorded."""
    import torch

    try:
        fn = make(shape, *inputs)
        # The explicit first call compiles, autotunes, and raises for unsupported shapes
        # before do_bench starts counting.
        out = fn()
        torch.cuda.synchronize()
        ms = timing.warm_ms(fn, warmup_ms, rep_ms, first_call=False)
    except Exception as e:  # noqa: BLE001 — any provider failure becomes a null entry
        if isinstance(e, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        return {"ms": None, "tflops": None, "error": timing.short_error(e)}, None
    return {"ms": ms, "tflops": shape.flops / ms * 1e-9, "error": None}, out


def _rel_err(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


def _summarize(row: dict, outputs: dict, ours: str, anchors: list[str]) -> None:
    """Adds ratios, the ceiling percentage and the output check to a row."""
    res = row["results"]
    ours_tf = res.get(ours, {}).get("tflops")
    row["ratios"] = {}
    for a in anchors:
        anchor_tf = res[a]["tflops"]
        row["ratios"][f"{ours}/{a}"] = ours_tf / anchor_tf if ours_tf and anchor_tf else None
    row["pct_of_ceiling"] = 100 * ours_tf / MATMUL_CEILING_TFLOPS if ours_tf else None
    row["check"] = None
    ref_name = next((a for a in anchors if a in outputs), None)
    if ours in outputs and ref_name is not None:
        err = _rel_err(outputs[ours], outputs[ref_name])
        row["check"] = {"against": ref_name, "rel_err": err}
        if not err <= CHECK_TOLERANCE:  # also catches NaN
            log.warning("%s differs from %s by %.2e (> %.0e) at %s", ours, ref_name, err,
                        CHECK_TOLERANCE, row["shape"])


def run_suite(suite, shapes, providers: list[str], dtype, warmup_ms: int = 25,
              rep_ms: int = 100, progress: bool = True) -> list[dict]:
    """Times every provider on every shape, all on the same inputs; returns the rows."""
    import torch

    anchors = [p for p in providers if p != suite.ours]
    rows = []
    bar = Progress(len(shapes) * len(providers), f"bench {suite.name}", enabled=progress)
    try:
        for shape in shapes:
            inputs = suite.make_inputs(shape, dtype, "cuda")
            row = {"shape": shape.as_dict(), "panel": shape.panel, "flops": shape.flops,
                   "results": {}}
            outputs = {}
            for name in providers:
                bar.describe(f"{shape.label} · {name}")
                row["results"][name], out = time_provider(suite.providers[name], shape, inputs,
                                                          warmup_ms, rep_ms)
                # keep ours and the first anchor that ran: all the check needs
                if out is not None and (name == suite.ours or not set(anchors) & set(outputs)):
                    outputs[name] = out
                err = row["results"][name]["error"]
                if err:
                    log.info("%s failed at %s: %s", name, shape.label, err)
                bar.update()
            _summarize(row, outputs, suite.ours, anchors)
            rows.append(row)
            del inputs, outputs
            torch.cuda.empty_cache()
    finally:
        bar.close()
    return rows


def parse_providers(spec, known, suite: str) -> list[str]:
    """``--providers``: a comma list (or a list) of names from ``known``, duplicates dropped;
    None means all of them."""
    if spec is None:
        return list(known)
    names = list(spec) if isinstance(spec, (list, tuple)) else [p.strip() for p in spec.split(",") if p.strip()]
    unknown = [p for p in names if p not in known]
    if unknown or not names:
        raise ValueError(f"--providers must be a comma list of {', '.join(known)} "
                         f"for suite {suite!r}, got {spec!r}")
    return list(dict.fromkeys(names))


def check_timing_and_providers(args, known, suite: str) -> str | None:
    """The problem with a suite's ``--warmup``, ``--rep`` (positive whole milliseconds) and
    ``--providers`` (:func:`parse_providers` of ``known``), or None, ``args.providers`` then a
    list. Suites call it before looking for a GPU, so a typo is reported on any machine."""
    for flag in ("warmup", "rep"):
        value = getattr(args, flag)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"--{flag} must be a positive number of milliseconds, got {value!r}"
    try:
        args.providers = parse_providers(args.providers, known, suite)
    except ValueError as e:
        return str(e)
    return None


# --------------------------------------------------------------------------------------------
# environment and JSON
# --------------------------------------------------------------------------------------------


def git_commit() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout flashflow is imported from, or (None, None)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None, None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=here, capture_output=True, text=True, timeout=10)
        return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None, None


def environment(now: datetime | None = None) -> dict:
    """Where and with what a result was measured (needs CUDA)."""
    import torch
    import triton

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    commit, dirty = git_commit()
    now = now or datetime.now(timezone.utc)
    return {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "date": now.isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": dirty,
    }


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (safe in file names)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def _finite(obj):
    """NaN/inf become null: strict JSON has no spelling for them (the warning log names them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_result(result: dict, out_dir, stem: str | None = None) -> Path:
    """Writes ``<suite>-<device>.json`` (``result``'s ``suite`` and ``device``; ``stem`` in the
    suite's place for a variant of it, e.g. a decode-layer step of several layers) in ``out_dir``,
    created if need be: the one current file of a (suite, device), what docs and diffs point at."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem or result['suite']}-{device_slug(result['device'])}.json"
    path.write_text(json.dumps(_finite(result), indent=1, allow_nan=False, default=str) + "\n")
    return path


def write_json(result: dict, out_dir) -> tuple[Path, Path]:
    """Writes the stable ``<suite>-<device>.json`` (:func:`write_result`) and a copy stamped
    ``<suite>-<device>-<UTC stamp>.json``, which keeps the history."""
    stable = write_result(result, out_dir)
    date = datetime.fromisoformat(result["date"])
    stamped = stable.with_name(f"{stable.stem}-{date.strftime('%Y%m%d-%H%M%S')}.json")
    shutil.copyfile(stable, stamped)
    return stamped, stable


REQUIRED_KEYS = ("schema_version", "suite", "dtype", "device", "sm_count", "torch", "triton",
                 "cuda", "python", "date", "git_commit", "providers", "ours",
                 "ceiling_tflops", "rows")


def read_json(path) -> dict:
    result = json.loads(Path(path).read_text())
    missing = [k for k in REQUIRED_KEYS if k not in result]
    if missing:
        raise ValueError(f"{path} is not a flashflow bench result: missing {', '.join(missing)}")
    return result


# --------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------

_SHAPE_HEADERS = {"name": "shape", "batch": "b", "heads": "h", "seqlen_q": "sq",
                  "seqlen_k": "sk", "head_dim": "d", "causal": "causal"}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _providers_of(rows: list[dict]) -> list[str]:
    seen = {}
    for row in rows:
        seen.update(dict.fromkeys(row["results"]))
    return list(seen)


def table_cells(rows: list[dict]) -> tuple[list[tuple[str, str]], list[list[str]], int]:
    """Headers as (group, column) pairs, cell rows, and how many leading columns are text.

    Shared by both renderers: the plain table puts the group on a line of its own above its
    columns, Markdown joins the two.
    """
    if not rows:
        return [], [], 0
    shape_keys = list(rows[0]["shape"])
    providers = _providers_of(rows)
    ratio_keys = list(dict.fromkeys(k for row in rows for k in row.get("ratios", {})))
    headers = [("", _SHAPE_HEADERS.get(k, k)) for k in shape_keys]
    for p in providers:
        headers += [(p, "ms"), (p, "TF/s")]
    for k in ratio_keys:
        ours, anchor = k.split("/", 1)
        headers.append((f"{ours} ÷", anchor))
    headers += [("% of", f"{MATMUL_CEILING_TFLOPS:.0f}"), ("rel", "err")]
    body = []
    for row in rows:
        cells = []
        for k in shape_keys:
            v = row["shape"][k]
            cells.append(("yes" if v else "no") if isinstance(v, bool) else str(v))
        for p in providers:
            res = row["results"].get(p, {})
            cells += [_fmt(res.get("ms"), ".3f"), _fmt(res.get("tflops"), ".0f")]
        cells += [_fmt(row.get("ratios", {}).get(k), ".2f") for k in ratio_keys]
        cells.append(_fmt(row.get("pct_of_ceiling"), ".0f"))
        cells.append(_fmt((row.get("check") or {}).get("rel_err"), ".1e"))
        body.append(cells)
    return headers, body, 1


def text_table(rows: list[dict]) -> str:
    """Plain aligned table: text columns left, numbers right, groups spanning their columns."""
    headers, body, n_text = table_cells(rows)
    if not headers:
        return "(no rows)"
    widths = [max(len(r[i]) for r in [[h for _, h in headers]] + body)
              for i in range(len(headers))]
    spans = []  # (group, first column, last column)
    for i, (group, _) in enumerate(headers):
        if spans and spans[-1][0] == group and group:
            spans[-1][2] = i
        else:
            spans.append([group, i, i])
    for group, first, last in spans:  # widen a span's last column until its group fits
        span_width = sum(widths[first:last + 1]) + 2 * (last - first)
        widths[last] += max(0, len(group) - span_width)

    def line(cells):
        return "  ".join(c.ljust(w) if i < n_text else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    top = "  ".join(group.center(sum(widths[first:last + 1]) + 2 * (last - first))
                    for group, first, last in spans).rstrip()
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([top, line([h for _, h in headers]), rule] + [line(r) for r in body])


def markdown_table(rows: list[dict]) -> str:
    """The rows as a GitHub Markdown table, numbers right-aligned, for pasting into docs."""
    headers, body, n_text = table_cells(rows)
    if not headers:
        return ""
    names = [f"{group} {col}".strip() for group, col in headers]
    align = [":--" if i < n_text else "--:" for i in range(len(headers))]

    def line(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(names), line(align)] + [line(r) for r in body])


def failures(rows: list[dict]) -> list[str]:
    """One line per (provider, error message) with the number of shapes it hit."""
    counts: dict[tuple[str, str], int] = {}
    for row in rows:
        for p, res in row["results"].items():
            if res.get("error"):
                counts[(p, res["error"])] = counts.get((p, res["error"]), 0) + 1
    return [f"{p} failed on {n} shape(s): {err}" for (p, err), n in counts.items()]


# --------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------


def plot(rows: list[dict], x_key: str, title: str, path) -> Path | None:
    """TFLOP/s vs ``x_key``, one line per provider, one panel per row["panel"].

    Returns the PNG's path, or None when matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    except ImportError:
        return None
    panels = list(dict.fromkeys(row["panel"] for row in rows))
    providers = _providers_of(rows)
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(4.2 * ncols, 3.4 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, panel in zip(axes, panels):
        panel_rows = sorted((r for r in rows if r["panel"] == panel),
                            key=lambda r: r["shape"][x_key])
        for i, p in enumerate(providers):
            pts = [(r["shape"][x_key], r["results"][p]["tflops"]) for r in panel_rows
                   if r["results"].get(p, {}).get("tflops") is not None]
            if pts:
                xs, ys = zip(*pts)
                # one colour per provider in every panel, also where another provider failed
                ax.plot(xs, ys, marker="o", color=f"C{i}", label=p)
        xs = [r["shape"][x_key] for r in panel_rows]
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs], rotation=45 if len(xs) > 4 else 0)
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(panel)
        ax.set_xlabel(x_key)
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    axes[0].legend(loc="lower right", fontsize="small")
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
