"""`flashflow bench` on a CPU machine, and the pieces of the benchmark that need no GPU."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.testing

from flashflow import cli
from flashflow.bench import runner
from flashflow.bench.cli import NO_GPU
from flashflow.bench.suites import SUITES, AttentionShape, Suite, attention_flops, attention_shapes

ROOT = Path(__file__).resolve().parents[2]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without a GPU")


# ---------------------------------------------------------------------------- FLOPs and suite


def test_flops_count_two_matmuls_and_halve_for_causal():
    # q·kᵀ and p·v: 2·sq·sk·d multiply-adds each → 4·b·h·sq·sk·d
    assert attention_flops(2, 3, 5, 7, 11, causal=False) == 4 * 2 * 3 * 5 * 7 * 11
    assert attention_flops(2, 3, 5, 7, 11, causal=True) == 2 * 2 * 3 * 5 * 7 * 11
    shape = AttentionShape("x", 1, 24, 4352, 4352, 128, False)
    assert shape.flops == 4 * 24 * 4352**2 * 128


def test_attention_suite_holds_qwen_image_and_the_flashattention_sweep():
    shapes = attention_shapes()
    qwen = {(s.batch, s.heads, s.seqlen_q, s.seqlen_k, s.head_dim, s.causal)
            for s in shapes if s.name.startswith("qwen-image")}
    assert qwen == {(1, 24, 4352, 4352, 128, False), (1, 24, 8448, 8448, 128, False)}
    sweep = [s for s in shapes if s.name == "fa-sweep"]
    assert all(s.batch * s.seqlen_q == 16384 and s.heads * s.head_dim == 2048 for s in sweep)
    points = {(s.seqlen_q, s.head_dim, s.causal) for s in sweep}
    assert points == {(n, d, c) for n in (512, 1024, 2048, 4096, 8192, 16384)
                      for d in (64, 128, 256) for c in (False, True)}
    assert len(sweep) == len(points) and len(shapes) == len(sweep) + 2


def test_quick_suite_is_a_few_of_the_full_shapes():
    quick, full = attention_shapes(quick=True), attention_shapes()
    assert 0 < len(quick) <= 8 and set(quick) <= set(full)
    assert {s.causal for s in quick} == {False, True}


# ---------------------------------------------------------------------------- runner, faked GPU


def _fake_suite():
    def inputs(shape, dtype, device):
        return (torch.ones(4, 4),)

    def ours(shape, x):
        return lambda: x * 1.01

    def broken(shape, x):
        raise RuntimeError("No available kernel.\nsecond line")

    def anchor(shape, x):
        return lambda: x

    return Suite("attention", attention_shapes, inputs,
                 {"flashflow": ours, "sdpa-cudnn": broken, "sdpa-flash": anchor},
                 ours="flashflow", x_key="seqlen_q")


def test_run_suite_times_every_provider_and_records_failures_as_null(monkeypatch):
    times = {1.01: 1.0, 1.0: 2.0}  # ours takes 1 ms, the anchor 2 ms

    def fake_do_bench(fn, warmup, rep, return_mode):
        assert return_mode == "median"
        return times[round(fn()[0, 0].item(), 2)]

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    shape = AttentionShape("fa-sweep", 2, 4, 64, 64, 32, True)
    suite = _fake_suite()
    (row,) = runner.run_suite(suite, [shape], list(suite.providers), torch.bfloat16,
                              progress=False)

    assert row["results"]["sdpa-cudnn"] == {
        "ms": None, "tflops": None, "error": "RuntimeError: No available kernel."}
    ours, anchor = row["results"]["flashflow"], row["results"]["sdpa-flash"]
    assert ours["ms"] == 1.0 and anchor["ms"] == 2.0
    assert ours["tflops"] == pytest.approx(shape.flops / 1e-3 / 1e12)
    assert row["ratios"] == {"flashflow/sdpa-cudnn": None,
                             "flashflow/sdpa-flash": pytest.approx(2.0)}
    assert row["pct_of_ceiling"] == pytest.approx(100 * ours["tflops"] / runner.MATMUL_CEILING_TFLOPS)
    assert row["check"]["against"] == "sdpa-flash"
    assert row["check"]["rel_err"] == pytest.approx(0.01, rel=1e-3)
    assert runner.failures([row]) == ["sdpa-cudnn failed on 1 shape(s): RuntimeError: No available kernel."]


# ---------------------------------------------------------------------------- JSON and tables


def _synthetic_rows():
    rows = []
    for shape, ms in ((AttentionShape("qwen-image-1024px", 1, 24, 4352, 4352, 128, False), 2.0),
                      (AttentionShape("fa-sweep", 8, 16, 2048, 2048, 128, True), 0.5)):
        tf = shape.flops / ms * 1e-9
        rows.append({
            "shape": shape.as_dict(), "panel": shape.panel, "flops": shape.flops,
            "results": {"flashflow": {"ms": ms, "tflops": tf, "error": None},
                        "sdpa-cudnn": {"ms": ms * 1.25, "tflops": tf / 1.25, "error": None},
                        "sdpa-flash": {"ms": None, "tflops": None, "error": "RuntimeError: no"}},
            "ratios": {"flashflow/sdpa-cudnn": 1.25, "flashflow/sdpa-flash": None},
            "pct_of_ceiling": 100 * tf / runner.MATMUL_CEILING_TFLOPS,
            "check": {"against": "sdpa-cudnn", "rel_err": 3.1e-3},
        })
    return rows


def _synthetic_result(rows):
    return {"schema_version": runner.SCHEMA_VERSION, "suite": "attention", "dtype": "bf16",
            "device": "NVIDIA H100 80GB HBM3", "sm_count": 132, "capability": "9.0",
            "torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0", "cudnn": 91000,
            "python": "3.12.3", "date": "2026-11-22T16:05:09+00:00", "git_commit": "abc",
            "git_dirty": False, "providers": ["flashflow", "sdpa-cudnn", "sdpa-flash"],
            "ours": "flashflow", "ceiling_tflops": runner.MATMUL_CEILING_TFLOPS, "rows": rows}


def test_json_writer_names_files_by_suite_device_and_time_and_round_trips(tmp_path):
    rows = _synthetic_rows()
    rows[0]["check"]["rel_err"] = float("nan")  # strict JSON has no NaN: written as null
    stamped, stable = runner.write_json(_synthetic_result(rows), tmp_path / "results")

    assert stamped.name == "attention-nvidia-h100-80gb-hbm3-20261122-160509.json"
    assert stable.name == "attention-nvidia-h100-80gb-hbm3.json"
    assert stamped.read_text() == stable.read_text()
    back = runner.read_json(stable)
    assert set(runner.REQUIRED_KEYS) <= set(back)
    assert back["rows"][0]["check"]["rel_err"] is None
    rows[0]["check"]["rel_err"] = None
    assert back == json.loads(json.dumps(_synthetic_result(rows)))


def test_read_json_rejects_a_file_that_is_not_a_bench_result(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="missing schema_version"):
        runner.read_json(path)


def test_device_slug_is_safe_in_file_names():
    assert runner.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert runner.device_slug("  A/B (x) ") == "a-b-x"


def test_markdown_table_renders_one_line_per_row_with_numbers_right_aligned():
    rows = _synthetic_rows()
    lines = runner.markdown_table(rows).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]

    assert len(lines) == 2 + len(rows)
    header, align, first, second = cells
    assert all(len(c) == len(header) for c in cells)
    assert header[:7] == ["shape", "b", "h", "sq", "sk", "d", "causal"]
    assert align[0] == ":--" and set(align[1:]) == {"--:"}
    col = dict(zip(header, first))
    assert col["shape"] == "qwen-image-1024px" and col["causal"] == "no"
    assert col["flashflow ms"] == "2.000"
    assert float(col["flashflow TF/s"]) == pytest.approx(rows[0]["results"]["flashflow"]["tflops"], abs=0.5)
    assert col["flashflow ÷ sdpa-cudnn"] == "1.25"
    assert col["sdpa-flash ms"] == col["flashflow ÷ sdpa-flash"] == "-"  # a failed provider
    assert col["rel err"] == "3.1e-03"
    assert dict(zip(header, second))["causal"] == "yes"


def test_text_table_is_aligned():
    lines = runner.text_table(_synthetic_rows()).splitlines()
    assert len({len(line) for line in lines[1:]}) == 1  # the header's top line is stripped
    assert "flashflow" in lines[0] and lines[2].startswith("---")


def test_from_json_prints_the_markdown_table_of_a_saved_result(tmp_path, capsys):
    rows = _synthetic_rows()
    _, stable = runner.write_json(_synthetic_result(rows), tmp_path)
    assert cli.main(["bench", "--from-json", str(stable), "--markdown"]) == 0
    assert capsys.readouterr().out == runner.markdown_table(rows) + "\n"


def test_unknown_provider_is_refused(capsys):
    assert cli.main(["bench", "--providers", "flashflow,nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_plot_has_one_panel_per_head_dim_and_causal_plus_qwen(tmp_path):
    pytest.importorskip("matplotlib")
    shapes = attention_shapes()
    rows = [{"shape": s.as_dict(), "panel": s.panel,
             "results": {"flashflow": {"tflops": 100.0 + i}}} for i, s in enumerate(shapes)]
    assert len({r["panel"] for r in rows}) == 7
    png = runner.plot(rows, "seqlen_q", "test", tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- no GPU: the demo

_DEMO_LINE = re.compile(r"rel err (\S+)\s+\(tolerance (\S+)\)\s+(ok|FAILED)")


def _check_demo_output(out: str) -> None:
    assert NO_GPU in out
    found = _DEMO_LINE.findall(out)
    assert len(found) >= 3
    for err, tol, verdict in found:
        assert math.isfinite(float(err)) and float(err) <= float(tol) and verdict == "ok"


@no_gpu
def test_bench_without_gpu_says_so_and_runs_the_interpreter_demo(capfd):
    assert cli.main(["bench"]) == 0
    _check_demo_output(capfd.readouterr().out)


@no_gpu
def test_bench_without_gpu_starts_the_interpreter_itself():
    # A user's shell has no TRITON_INTERPRET: the demo must run in a process that sets it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "flashflow.cli", "bench"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    _check_demo_output(proc.stdout)


def test_suite_registry_names_its_providers():
    suite = SUITES["attention"]
    assert list(suite.providers) == ["flashflow", "sdpa-cudnn", "sdpa-flash", "flashflow-fp8"]
    assert suite.ours == "flashflow" and suite.anchors == ("sdpa-cudnn", "sdpa-flash")
    assert suite.variants == ("flashflow-fp8",)


def test_from_json_refuses_a_missing_file(tmp_path, capsys):
    assert cli.main(["bench", "--from-json", str(tmp_path / "none.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_cold_l2_timing_cycles_input_copies_past_l2():
    from flashflow.bench.timing import cycling, rotation

    l2 = 50 * 2**20
    assert rotation(34 * 10**6, l2) == 5          # 1×8k GQA: 5 copies ≈ 170 MB ≥ 3 L2s
    assert rotation(2 * 10**6, l2) == 16          # tiny caches: capped at the graph's 16 steps
    assert rotation(537 * 10**6, l2) == 1         # already 10× the L2: no copies
    seen = []
    step = cycling(lambda i: lambda: seen.append(i), 3)
    for _ in range(7):
        step()
    assert seen == [0, 1, 2, 0, 1, 2, 0]


def test_decode_bench_paged_copy_reads_back_the_cache():
    import torch

    from flashflow.bench.decode import paged_copy

    k, v = torch.randn(2, 64, 3, 8), torch.randn(2, 64, 3, 8)
    kp, vp, table = paged_copy(k, v, 16)
    assert table.dtype == torch.int32 and tuple(table.shape) == (2, 4)
    assert torch.equal(kp[table.long()].reshape(2, 64, 3, 8), k)
    assert torch.equal(vp[table.long()].reshape(2, 64, 3, 8), v)


def test_decode_bench_quick_shapes_hold_the_serving_points_once():
    from flashflow.bench.decode import decode_shapes

    for quick in (True, False):
        shapes = decode_shapes(quick)
        assert len(set(shapes)) == len(shapes)
        for b, s in ((1, 2048), (1, 8192), (1, 32768), (8, 8192), (16, 16384)):
            assert (b, s, 32, 8, 128) in shapes, (quick, b, s)
    assert {(1, 1024, 32, 8, 128), (32, 4096, 32, 8, 128), (1, 8192, 32, 32, 128)} <= set(decode_shapes(True))


def test_decode_bench_table_adds_the_append_and_fp8_columns_only_where_rows_have_them():
    from flashflow.bench.decode import markdown_table

    base = {"batch": 1, "seqlen": 8192, "heads": 32, "kv_heads": 8, "head_dim": 128, "kv_mbytes": 33.6,
            "num_splits": 16, "cache_copies": 5, "vs_cudnn": 1.2, "pct_ceiling": 60.0, "paged_vs_contig": 0.98,
            "paged_ordered_vs_contig": 0.99, "graph_us": {"flashflow": 20.0}, "eager_us": {"flashflow": 30.0},
            "tbs": {"flashflow": 1.7, "flashflow-paged": 1.66, "sdpa-cudnn": 1.4, "sdpa-flash": 1.1}}
    new = {**base, "splits_fp8": 8, "ft_vs_contig": 0.95, "fp8_vs_cudnn": 2.1, "fp8_rel_err_vs_bf16": 0.0213,
           "fp8_bytes_ratio": 0.5,
           "tbs": {**base["tbs"], "flashflow-append": 1.65, "flashflow-paged-append": 1.6,
                   "flashflow-ft-append": 1.57, "flashflow-fp8-append": 1.5, "flashflow-fp8-paged-append": 1.45,
                   "flashflow-fp8-ft-append": 1.4}}
    oom = {k: base[k] for k in ("batch", "seqlen", "heads", "kv_heads", "head_dim", "kv_mbytes")}
    head = {"read_ceiling_tbs": 3.0, "graph_steps": 16}
    old = markdown_table({**head, "rows": [base, {**oom, "error": "OOM"}]})
    assert "append" not in old and len(old.splitlines()) == 6    # an older result: one table, as before
    lines = markdown_table({**head, "rows": [new, {**oom, "error": "OOM"}, {**base, "batch": 4}]}).splitlines()
    assert lines[:5] == old.splitlines()[:5] and "OOM" in lines[5]   # the first table is unchanged
    header = next(i for i, line in enumerate(lines) if "FT+append TB/s" in line)
    for col in ("append TB/s", "FT ÷ contig", "FP8+append TB/s", "FP8 ÷ cuDNN (speedup)", "FP8 rel err"):
        assert col in lines[header]
    assert len(lines) == header + 3                               # only the row that has the providers
    assert lines[-1] == ("| 1 | 8192 | 32/8 | 16 (8) | 1.65 | 1.60 | 1.57 | 0.95 | 1.50 | 1.45 | 1.40 | 2.10 "
                         "| 0.0213 |")
    cells = [len(line.split("|")) for line in lines[header:]]
    assert len(set(cells)) == 1


# ---------------------------------------------------------------------------- the other suites


def test_train_suite_shapes_flops_and_table():
    from flashflow.bench import train

    shapes = train.train_shapes(quick=True)
    assert (2, 16, 8192, 128, False) in shapes and (2, 16, 8192, 128, True) in shapes   # the shape
    assert train.fwd_flops(2, 16, 8192, 128, True) * 2 == train.fwd_flops(2, 16, 8192, 128, False)
    assert {s[3] for s in train.train_shapes(quick=True, head_dims=(64, 256))} == {64, 256}
    row = {"batch": 2, "heads": 16, "seqlen": 8192, "head_dim": 128, "causal": True,
           "ms": {"flashflow": 9.69}, "tflops": {"flashflow": 199.0, "sdpa-cudnn": 492.0},
           "peak_mib": {"flashflow": 259.0}, "rel_err": {"flashflow": [1.3e-3, 1.4e-3, 3.1e-4]},
           "vs_cudnn": 0.40, "notes": {"sdpa-flash": "RuntimeError: refused"}}
    line = train.markdown_table({"rows": [row]}).splitlines()[-1]
    assert line == ("| 2 | 16 | 8192 | 128 | yes | 199 | 492 | — | 0.40 | — | 9.69 | 259 / — / — "
                    "| 1.3e-03, 1.4e-03, 3.1e-04 |")


@no_gpu
@pytest.mark.parametrize("suite", ["decode", "train", "mlp", "memory", "dataflow"])
def test_gpu_only_suite_without_gpu_is_a_one_line_error(suite, capfd):
    assert cli.main(["bench", "--suite", suite]) == 2
    out, err = capfd.readouterr()
    assert out == "" and NO_GPU not in err     # no demo of another suite
    (line,) = err.strip().splitlines()
    assert line.startswith("flashflow bench: error:") and f"--suite {suite}" in line and "CUDA GPU" in line


@pytest.mark.parametrize("argv, flag", [
    (["--suite", "decode", "--providers", "flashflow"], "--providers"),
    (["--suite", "memory", "--warmup", "3"], "--warmup"),
    (["--suite", "dataflow", "--dtype", "fp16"], "--dtype"),
    (["--suite", "mlp", "--no-plot"], "--no-plot"),
    (["--write", "docs/results.md"], "--write"),
    (["--rescore"], "--rescore"),
    (["--tables", "--quick"], "--quick"),
])
def test_an_option_a_suite_does_not_take_is_refused(argv, flag, capsys):
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashflow bench: error:") and flag in err


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: attention)", "(default: bench/results)", "(default: 25; mlp: 5)",
                    "(default: 100; mlp: 20)", "(default: fp16 for memory, bf16 otherwise)"):
        assert default in out
    for suite in ("decode", "mlp", "memory", "dataflow"):
        assert f"{suite}:" in out


def test_from_json_prints_any_suite_result(capsys):
    for name, expect in (("decode-nvidia-h100-80gb-hbm3.json", "| batch | seqlen |"),
                         ("mlp-nvidia-h100-80gb-hbm3.json", "torch-graph µs"),
                         ("memory-nvidia-h100-80gb-hbm3.json", "| seqlen | naive peak MiB |"),
                         ("dataflow-nvidia-h100-80gb-hbm3.json", "Rank agreement"),
                         ("info-nvidia-h100-80gb-hbm3.json", "attention_merge_kernel"),
                         ("host-nvidia-h200.json", "| entry | provider | µs per call |"),
                         ("train-nvidia-h100-80gb-hbm3.json", "| batch | heads | seqlen |"),
                         ("qwen-image-nvidia-h100-80gb-hbm3.json", "Qwen-Image transformer")):
        assert cli.main(["bench", "--from-json", str(ROOT / "bench/results" / name)]) == 0, name
        assert expect in capsys.readouterr().out, name


def test_every_suite_with_a_runner_module_reports_a_saved_result():
    """--from-json prints through the suite module's own report(result): no list of suites."""
    import importlib

    from flashflow.bench.suites import RUNNERS

    for name, runner_spec in RUNNERS.items():
        module = importlib.import_module(runner_spec.module)
        assert callable(getattr(module, "report", None)) and callable(module.run), name


def test_from_json_refuses_a_file_of_no_suite(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"suite": "tune-mlp-prefill", "rows": []}))
    assert cli.main(["bench", "--from-json", str(path)]) == 2
    assert "not a flashflow bench result" in capsys.readouterr().err
    assert cli.main(["bench", "--from-json", str(ROOT / "bench/results/memory-nvidia-h100-80gb-hbm3.json"),
                     "--rescore"]) == 2
    assert "dataflow result" in capsys.readouterr().err


# ---------------------------------------------------------------------------- docs tables


def test_tables_render_every_suite_in_the_results_folder(capsys):
    from flashflow.bench import tables

    text = tables.render(ROOT / "bench/results")
    for heading in ("### Prefill / diffusion attention forward", "### Decode attention",
                    "### Fused FFN, every policy", "### Peak memory", "### Registers, spills",
                    "### Dataflow model vs measured"):
        assert text.count(heading) == 1, heading
    assert cli.main(["bench", "--tables", "--out", str(ROOT / "bench/results")]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_docs_tables_are_the_rendered_ones():
    """docs/results.md and docs/tutorial.md hold what `flashflow bench --tables --write` renders
    from bench/results: a result changed without the docs fails here."""
    from flashflow.bench import tables

    for doc in ("results.md", "tutorial.md"):
        text = (ROOT / "docs" / doc).read_text()
        for name, make in tables.blocks(ROOT / "bench/results").items():
            if f"<!-- {name} -->" in text.split("\n") or f"<!-- {name} -->\n" in text:
                assert tables.replace_block(text, name, make()) == text, (doc, name)


def test_write_replaces_only_the_blocks_and_needs_a_marker(tmp_path, capsys):
    doc = tmp_path / "d.md"
    doc.write_text("# t\n\nprose\n\n<!-- MEMORY_TABLE -->\nold\n\n<!-- /MEMORY_TABLE -->\n\nmore prose\n")
    assert cli.main(["bench", "--tables", "--out", str(ROOT / "bench/results"), "--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# t\n\nprose\n\n<!-- MEMORY_TABLE -->\nMeasured on") and "old" not in text
    assert text.endswith("<!-- /MEMORY_TABLE -->\n\nmore prose\n")
    (tmp_path / "none.md").write_text("no markers\n")
    assert cli.main(["bench", "--tables", "--write", str(tmp_path / "none.md")]) == 2
    assert "none of the marker lines" in capsys.readouterr().err


def test_mlp_ncu_predictions_add_the_model_to_persistent_policies(monkeypatch):
    from flashflow.bench import mlp_suite

    calls = []

    def fake_traffic(act, hidden, inter, m, policy, hw=None):
        calls.append((policy, hw.l2_partitions if hasattr(hw, "l2_partitions") else hw))
        return {"policy": policy, "read_bytes": 100e6 if policy == "multirow" else 200e6, "write_bytes": 1e6}

    monkeypatch.setattr(mlp_suite, "model_traffic", fake_traffic)
    rows = [{"M": 1024, "provider": p, "model": "llama3-8b", "read_bytes": b, "write_bytes": 2e6, "launches": 1}
            for p, b in (("multirow", 150e6), ("sequential", 300e6), ("torch-graph", 400e6))]
    out = mlp_suite.ncu_predictions(rows)
    assert "model_partitioned" not in rows[0]                 # the input is left as it is
    assert out[0]["model_partitioned"]["read_bytes"] == 100e6 and "model_unified" in out[1]
    assert "model_partitioned" not in out[2]                   # the anchor is not our kernel
    assert len(calls) == 4
    table = mlp_suite.ncu_table(out).splitlines()
    assert table[2] == "| 1024 | multirow | 150 | 100 | 0.67 | 100 | 0.67 | 2 | 1 | 1 |"
    assert mlp_suite.ncu_rank_check(out) == ["M=1024: measured multirow < sequential; partitioned same; unified same"]
