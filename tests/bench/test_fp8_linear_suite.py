"""`flashflow bench --suite fp8-linear` without a GPU: its shapes and options, its registration,
one shape's row measured on the CPU with a fake clock, and its tables from a made-up result."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from flashflow import cli
from flashflow.bench import fp8_linear_suite as fl
from flashflow.bench import tables
from flashflow.bench.ops import spec
from flashflow.bench.suites import RUNNERS

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without a GPU")


def test_shapes_are_a_qwen_image_blocks_gemms():
    assert [s[1:] for s in fl.SHAPES] == [
        (8192, 3072, 9216), (8192, 3072, 3072), (8192, 3072, 12288), (8192, 12288, 3072),
        (256, 3072, 9216), (256, 3072, 12288), (256, 12288, 3072), (1, 3072, 18432)]
    assert len({s[0] for s in fl.SHAPES}) == len(fl.SHAPES)
    assert set(fl.QUICK_SHAPES) < set(fl.SHAPES)
    # the FP8 GEMM's operand alignment holds at every shape
    assert all(k % 16 == 0 and n % 16 == 0 for _, _, k, n in fl.SHAPES)
    assert fl.gemm_flops(2, 3, 5) == 60.0
    assert fl.quantize_bytes(2, 3) == 2 * 6 + 6 + 8


def test_providers_split_into_gemms_and_passes():
    assert fl.PROVIDERS[0] == fl.ANCHOR == "bf16"
    assert set(fl.GEMMS) | set(fl.PASSES) == set(fl.PROVIDERS) and not set(fl.GEMMS) & set(fl.PASSES)
    assert {"fp8 gemm (fast_accum)", "fp8 gemm (fp32 promote)", "fp8_linear", "torchao", "quantize_rows",
            "gelu_quantize_rows"} <= set(fl.PROVIDERS)
    assert fl.FAST_ACCUM == {"fp8 gemm (fp32 promote)": False, "fp8 gemm (fast_accum)": True}


# ---------------------------------------------------------------------------- options and registration


def test_registered_with_its_defaults_and_options():
    runner = RUNNERS["fp8-linear"]
    assert runner.module == "flashflow.bench.fp8_linear_suite"
    assert runner.defaults == {"warmup": fl.WARMUP_MS, "rep": fl.REP_MS}
    assert runner.options == {"quick", "providers", "warmup", "rep"}
    assert f"warm-up {fl.WARMUP_MS} ms, {fl.REP_MS} ms timed, {fl.ROUNDS} rounds" in runner.measures
    assert spec("fp8-linear").suite == "fp8-linear"


def test_check_args():
    args = SimpleNamespace(warmup=10, rep=50, providers=None)
    assert fl.check_args(args) is None and args.providers == list(fl.PROVIDERS)
    args = SimpleNamespace(warmup=1, rep=1, providers="bf16, fp8 gemm (fast_accum),bf16")
    assert fl.check_args(args) is None and args.providers == ["bf16", "fp8 gemm (fast_accum)"]
    problem = fl.check_args(SimpleNamespace(warmup=10, rep=50, providers="bf16,cutlass"))
    assert "--providers" in problem and "cutlass" in problem and "gelu_quantize_rows" in problem
    assert "--rep" in fl.check_args(SimpleNamespace(warmup=10, rep=0, providers=None))
    assert "got True" in fl.check_args(SimpleNamespace(warmup=True, rep=50, providers=None))


@pytest.mark.parametrize("argv, message", [
    (["--providers", "bf16,cutlass"], "--providers must be a comma list of bf16"),
    (["--dtype", "fp16"], "--dtype does not apply to --suite fp8-linear"),
    (["--blocks", "2"], "--blocks does not apply to --suite fp8-linear"),
    (["--no-plot"], "--no-plot does not apply to --suite fp8-linear"),
    (["--rep", "0"], "--rep must be a positive number of milliseconds, got 0"),
])
def test_bad_options_fail_as_argparse_does(argv, message, capsys):
    assert cli.main(["bench", "--suite", "fp8-linear", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashflow bench: error: ") and message in err and len(err.strip().splitlines()) == 1


@no_gpu
def test_without_a_gpu_says_so(capsys):
    assert cli.main(["bench", "--suite", "fp8-linear", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--suite fp8-linear needs a CUDA GPU" in err


def test_help_lists_the_suite(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    assert "fp8-linear: times the FP8 linear layer" in out


def test_spec_launches_the_few_rows_kernel_the_gemm_being_cublaslts():
    s = spec("fp8-linear")
    cases = s.info_cases(None)
    assert [c.label.split()[0] for c in cases] == ["fp8_weight_rows"]
    assert all(c.op == "fp8-linear" for c in cases) and "cuBLASLt" in s.info_title
    assert not s.tunable and s.config_classes[0].__module__ == "flashflow.tuning.fp8_linear"
    assert [c.label for c in s.info_cases("sm90")] == [c.label for c in cases]
    assert s.info_cases("sm80") == []   # no e4m3 before Hopper: nothing for ptxas to compile


# ---------------------------------------------------------------------------- one shape on the CPU


def test_a_row_on_the_cpu_with_a_fake_clock(device, monkeypatch):
    """Every provider runs on the shape's tensors; the fake clock gives each its own time."""
    ms = {name: 0.1 * (i + 1) for i, name in enumerate(fl.PROVIDERS)}
    calls = []

    def clock(fn):
        out = fn()
        calls.append(out)
        name = next(n for n, f in clock.fns.items() if f is fn)
        return ms[name]

    real = fl.make_providers

    def spy(*args, **kwargs):
        clock.fns = real(*args, **kwargs)
        return clock.fns

    monkeypatch.setattr(fl, "make_providers", spy)
    row = fl.bench_case("tiny", 5, 32, 48, timer=clock, rounds=2, device=device)
    res = row["results"]
    assert (row["M"], row["K"], row["N"]) == (5, 32, 48) and not [p for p, r in res.items() if r.get("error")]
    timed = [p for p in fl.PROVIDERS if p != fl.TORCHAO or fl.torchao_available()]
    assert list(res) == timed and len(calls) == 2 * len(timed)
    for name in timed:
        assert res[name]["us"] == pytest.approx(ms[name] * 1e3) and res[name]["rounds_us"] == [ms[name] * 1e3] * 2
    assert res["fp8_linear"]["tflops"] == pytest.approx(2 * 5 * 32 * 48 / (ms["fp8_linear"] * 1e-3) / 1e12)
    assert res["quantize_rows"]["tbs"] == pytest.approx(fl.quantize_bytes(5, 32) / (ms["quantize_rows"] * 1e-3) / 1e12)
    assert res["fp8_linear"]["vs_bf16"] == pytest.approx(ms["bf16"] / ms["fp8_linear"])
    assert "vs_bf16" not in res["bf16"] and "vs_bf16" not in res["quantize_rows"] and "tflops" not in res["quantize_rows"]
    # accuracy of every GEMM against the exact product: bf16 within its rounding, FP8 within e4m3's
    acc = row["accuracy"]
    assert set(acc) == {p for p in timed if p in fl.GEMMS}
    assert acc["bf16"]["rel_l2"] < 1e-2 and acc["bf16"]["cosine"] > 0.9999
    for p in ("fp8_linear", "fp8 gemm (fp32 promote)", "fp8 gemm (fast_accum)"):
        assert 1e-3 < acc[p]["rel_l2"] < 0.08 and acc[p]["cosine"] > 0.995 and acc[p]["rel_l1"] > 0, p


def test_the_fp8_gemm_is_the_ops_own_call(device):
    """The suite's GEMM with the shipped fast_accum is what fp8_linear runs, bit for bit."""
    from flashflow.device import gpu_family
    from flashflow.ops.fp8_linear import _gemm_impl, fp8_linear, quantize_weight
    from flashflow.ops.quant import quantize_rows
    from flashflow.tuning.fp8_linear import fp8_linear_config

    x, w, b = fl.make_inputs(33, 48, 32, device)   # more rows than rows_max: the row-scaled GEMM
    weight, rows = quantize_weight(w), quantize_rows(x)
    fast = fp8_linear_config(gpu_family(torch.device(device))).fast_accum
    got = fl.scaled_gemm(rows.data, rows.scale, weight.data, weight.scale, b, fast)
    assert torch.equal(got, _gemm_impl(rows.data, rows.scale, weight.data, weight.scale, b))
    assert torch.equal(got, fp8_linear(x, weight, b))
    provs = fl.make_providers(x, w, b, ("fp8 gemm (fast_accum)", "fp8 gemm (fp32 promote)", "fp8_linear"))
    name = "fp8 gemm (fast_accum)" if fast else "fp8 gemm (fp32 promote)"
    assert torch.equal(provs[name](), provs["fp8_linear"]())


def test_the_whole_run_writes_a_result_that_reads_back(device, monkeypatch, tmp_path, capsys):
    """run_bench at two tiny shapes with a fake clock (the environment made up: it needs CUDA),
    torchao missing: the JSON written, its timing discipline, and --from-json's tables."""
    from flashflow.bench import runner

    monkeypatch.setattr(runner, "environment", lambda started: {"device": "NVIDIA H100 80GB HBM3",
                                                                "date": started.isoformat()})
    monkeypatch.setattr(fl, "torchao_available", lambda: False)
    shapes = (("tiny a", 3, 32, 16), ("tiny b", 1, 16, 48))
    result = fl.run_bench(shapes, fl.PROVIDERS, warmup=1, rep=2, quick=True, progress=False, device=device,
                          timer=lambda fn: (fn(), 0.25)[1])
    assert result["timing"] == {"discipline": "rounds", "of": "warm", "warmup_ms": 1, "rep_ms": 2,
                                "return_mode": "median", "rounds": fl.ROUNDS}
    assert result["notes"] == [fl.NO_TORCHAO] and result["shipped_fast_accum"] is False
    assert [(r["layer"], r["M"], r["K"], r["N"]) for r in result["rows"]] == list(shapes)
    assert all(fl.TORCHAO not in r["results"] and r["results"]["fp8_linear"]["vs_bf16"] == 1.0 for r in result["rows"])
    path = runner.write_result(result, tmp_path)
    assert path.name == "fp8-linear-nvidia-h100-80gb-hbm3.json"
    assert cli.main(["bench", "--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| tiny b | 1 | 16 | 48 | 250.0 |" in out and f"note: {fl.NO_TORCHAO}" in out


def test_torchao_is_left_out_with_a_note_when_missing(monkeypatch):
    monkeypatch.setattr(fl, "torchao_available", lambda: False)
    x, w, b = fl.make_inputs(3, 16, 16, "cpu")
    assert fl.TORCHAO not in fl.make_providers(x, w, b, (fl.ANCHOR, fl.TORCHAO))
    assert "torchao is not installed" in fl.NO_TORCHAO


def test_a_provider_that_cannot_run_is_an_error_entry(device, monkeypatch):
    real = fl.make_providers

    def broken(*args, **kwargs):
        provs = real(*args, **kwargs)

        def fail():
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED\nmore")
        provs["fp8 gemm (fast_accum)"] = fail
        return provs

    monkeypatch.setattr(fl, "make_providers", broken)
    row = fl.bench_case("tiny", 3, 16, 16, providers=("bf16", "fp8 gemm (fast_accum)"),
                        timer=lambda fn: (fn(), 1.0)[1], rounds=1, device=device)
    assert row["results"]["fp8 gemm (fast_accum)"] == {"error": "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"}
    assert row["results"]["bf16"]["us"] == 1000.0 and set(row["accuracy"]) == {"bf16"}


# ---------------------------------------------------------------------------- tables


def fake_result() -> dict:
    rows = []
    for layer, m, k, n in fl.SHAPES[:2]:
        row = {"layer": layer, "M": m, "K": k, "N": n, "results": {}}
        times = {"bf16": [1.0, 1.2, 1.1], "fp8 gemm (fp32 promote)": [0.6] * 3, "fp8 gemm (fast_accum)": [0.5] * 3,
                 "fp8_linear": [0.8] * 3, "quantize_rows": [0.2] * 3, "gelu_quantize_rows": [0.25] * 3}
        fl.summarize(row, times)
        row["results"]["torchao"] = {"error": "RuntimeError: no kernel"}
        row["accuracy"] = {"bf16": {"cosine": 0.9999991, "rel_l1": 1.5e-3, "rel_l2": 1.9e-3},
                           "fp8_linear": {"cosine": 0.99912, "rel_l1": 3.1e-2, "rel_l2": 3.3e-2}}
        rows.append(row)
    return {"suite": "fp8-linear", "device": "NVIDIA H100 80GB HBM3", "torch": "2.x", "triton": "3.x",
            "dtype": "bf16", "providers": list(fl.PROVIDERS), "anchor": "bf16", "shipped_fast_accum": False,
            "timing": {"discipline": "rounds", "of": "warm", "return_mode": "median", "rounds": 3},
            "accuracy": {"against": fl.ACCURACY_AGAINST, "rows": fl.ACCURACY_ROWS, "inputs": fl.INPUTS},
            "notes": ["torchao 0.x: a note"], "rows": rows}


def _table_after(text: str, first_header_cell: str, header_has: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header_cell} ") and header_has in line)
    out = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        out.append([c.strip() for c in line.strip("|").split("|")])
    return out


def test_summarize_takes_the_median_round():
    row = fake_result()["rows"][0]
    assert row["results"]["bf16"]["us"] == pytest.approx(1100.0)
    assert row["results"]["fp8 gemm (fast_accum)"]["vs_bf16"] == pytest.approx(1.1 / 0.5)
    assert row["results"]["bf16"]["tflops"] == pytest.approx(2 * 8192 * 3072 * 9216 / 1.1e-3 / 1e12)


def test_report_tables_from_a_result():
    text = fl.report(fake_result())
    assert text.startswith("FP8 linear, bf16, NVIDIA H100 80GB HBM3. Timing `rounds` of `warm`, median")
    assert "fp8_linear ships `fp32 promote`" in text
    gemm = _table_after(text, "layer", "bf16 µs")
    head = gemm[0]
    assert head[:6] == ["layer", "M", "K", "N", "bf16 µs", "bf16 TF/s"] and "torchao ÷ bf16" in head
    assert len(gemm) == 2 + 2 and all(len(r) == len(head) for r in gemm)
    first = dict(zip(head, gemm[2]))
    assert first["layer"] == "image q/k/v (fused)" and first["bf16 µs"] == "1100.0"
    assert first["fp8 gemm (fast_accum) ÷ bf16"] == "2.20" and first["torchao µs"] == "err"
    passes = _table_after(text, "layer", "quantize_rows µs")
    cells = dict(zip(passes[0], passes[2]))
    assert cells["quantize_rows µs"] == "200.0" and cells["quantize_rows ÷ fp8_linear"] == "0.25"
    assert cells["quantize_rows TB/s"] == f"{fl.quantize_bytes(8192, 3072) / 0.2e-3 / 1e12:.2f}"
    acc = _table_after(text, "layer", "cosine")
    cells = dict(zip(acc[0], acc[2]))
    assert cells["fp8_linear cosine"] == "0.999120" and cells["fp8_linear rel L2"] == "3.30e-02"
    assert "fp8 gemm (fast_accum) cosine" not in acc[0]   # no accuracy recorded for it
    assert "note: torchao 0.x: a note" in text and "error torchao: RuntimeError: no kernel" in text


def test_from_json_prints_the_report(tmp_path, capsys):
    path = tmp_path / "fp8-linear-nvidia-h100-80gb-hbm3.json"
    path.write_text(json.dumps(fake_result()))
    assert cli.main(["bench", "--from-json", str(path)]) == 0
    assert capsys.readouterr().out == fl.report(fake_result()) + "\n"


def test_docs_section_renders_the_result_when_there_is_one(tmp_path):
    assert tables.fp8_linear_section(tmp_path) == ""
    (tmp_path / f"fp8-linear-{tables.DEVICE}.json").write_text(json.dumps(fake_result()))
    text = tables.fp8_linear_section(tmp_path)
    assert text.startswith("### FP8 linear at a Qwen-Image block's GEMM shapes (bf16, `flashflow bench --suite fp8-linear`)")
    assert f"(`bench/results/fp8-linear-{tables.DEVICE}.json`). Timing `rounds` of `warm`" in text
    assert fl.tables(fake_result()) in text and tables.render(tmp_path).count("### FP8 linear") == 1
