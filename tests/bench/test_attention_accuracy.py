"""The attention suite's FP8 provider and its accuracy columns, without a GPU: the exact
reference against the float64 oracle, the metrics, the provider's refusals, the measuring loop
around the runner (faked clock), and the tables, old results (no accuracy keys) included."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import triton.testing

from flashflow import cli
from flashflow.bench import providers, runner, suites, tables
from flashflow.bench.suites import SUITES, AttentionShape, Suite, attention_shapes
from flashflow.reference import attention_naive

ROOT = Path(__file__).resolve().parents[2]


def _needs_interpreter():
    from flashflow.device import interpreting

    if not interpreting():
        pytest.skip("runs flashflow's kernels on CPU tensors: needs TRITON_INTERPRET=1")


@pytest.fixture
def fake_clock(monkeypatch):
    """do_bench calls the function once and says 1 ms; no CUDA to synchronize."""
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep, return_mode: (fn(), 1.0)[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


# ---------------------------------------------------------------------------- registry and shapes


def test_fp8_is_a_flashflow_provider_not_an_anchor():
    suite = SUITES["attention"]
    assert list(suite.providers) == ["flashflow", "sdpa-cudnn", "sdpa-flash", "flashflow-fp8"]
    assert suite.variants == ("flashflow-fp8",) and suite.anchors == ("sdpa-cudnn", "sdpa-flash")
    assert suite.reference is providers.exact_attention


def test_the_fp8_shapes_are_in_the_suite():
    """Qwen-Image and Qwen-Image-Edit's joint attention (non-causal) and causal 8k."""
    full = {(s.batch, s.seqlen_q, s.heads, s.head_dim, s.causal) for s in attention_shapes()}
    assert {(1, 4352, 24, 128, False), (1, 8448, 24, 128, False)} <= full
    assert {(2, 8192, 16, 128, True), (2, 8192, 32, 64, True), (2, 8192, 8, 256, True)} <= full


# ---------------------------------------------------------------------------- reference and metrics


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
def test_exact_attention_is_the_float64_oracle_in_chunks(causal, chunk_rows, monkeypatch):
    g = torch.Generator().manual_seed(0)
    batch, sq, sk, heads, kv_heads, d = 2, 13, 29, 4, 2, 16
    q = torch.randn(batch, sq, heads, d, generator=g, dtype=torch.float64).half()
    k = torch.randn(batch, sk, kv_heads, d, generator=g, dtype=torch.float64).half()
    v = torch.randn(batch, sk, kv_heads, d, generator=g, dtype=torch.float64).half()
    # chunks of chunk_rows query rows: the causal diagonal moves with each chunk's offset
    monkeypatch.setattr(providers, "REFERENCE_CHUNK_BYTES", chunk_rows * heads * sk * 8)
    shape = AttentionShape("x", batch, heads, sq, sk, d, causal)
    got = providers.exact_attention(shape, q, k, v)
    want = attention_naive(q.double(), k.double(), v.double(), causal=causal)
    assert got.dtype == torch.float64 and got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_exact_attention_gives_zero_for_a_row_with_no_key():
    # causal, sq > sk: the first sq - sk query rows see no key (FlashAttention's bottom-right rule)
    q, k, v = torch.randn(1, 5, 1, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
    out = providers.exact_attention(AttentionShape("x", 1, 1, 5, 3, 8, True), q, k, v)
    assert torch.equal(out[:, :2], torch.zeros(1, 2, 1, 8, dtype=torch.float64)) and torch.isfinite(out).all()


def test_accuracy_is_cosine_and_relative_l1():
    ref = torch.tensor([3.0, -4.0], dtype=torch.float64)
    assert providers.accuracy(ref.half(), ref) == {"cosine": pytest.approx(1.0), "rel_l1": 0.0}
    acc = providers.accuracy(torch.tensor([3.0, -3.0]), ref)
    assert acc["rel_l1"] == pytest.approx(1 / 7)
    assert acc["cosine"] == pytest.approx((9 + 12) / (5 * 18 ** 0.5))
    assert providers.accuracy(-ref, ref)["cosine"] == pytest.approx(-1.0)


# ---------------------------------------------------------------------------- the FP8 provider


@pytest.mark.parametrize("dtype, head_dim, needle", [
    (torch.float32, 128, "flashflow-fp8 takes bf16 or fp16 inputs, got torch.float32"),
    (torch.bfloat16, 96, "flashflow-fp8 takes head_dim 64, 128, 256, got 96"),
    (torch.float16, 32, "got 32"),
])
def test_fp8_provider_refuses_what_it_has_no_kernel_for(dtype, head_dim, needle, fake_clock):
    shape = AttentionShape("fa-sweep", 1, 2, 16, 16, head_dim, False)
    q = k = v = torch.zeros(1, 16, 2, head_dim, dtype=dtype)
    with pytest.raises(ValueError, match=needle):
        providers.flashflow_fp8_attention(shape, q, k, v)
    # in the runner: an error entry, as any provider's unsupported case
    res, out = runner.time_provider(providers.flashflow_fp8_attention, shape, (q, k, v), 1, 1)
    assert out is None and res["ms"] is None and res["error"].startswith("ValueError: flashflow-fp8 takes")


# ---------------------------------------------------------------------------- measure, faked clock


def _fake_suite(reference_calls):
    """Each provider scales its input by a factor: the output says who made it."""
    def inputs(shape, dtype, device):
        return (torch.ones(4, 4),)

    def reference(shape, x):
        reference_calls.append(shape.seqlen_q)
        return x.double()

    def broken(shape, x):
        raise RuntimeError("No available kernel.")

    return Suite("attention", attention_shapes, inputs,
                 {"flashflow": lambda shape, x: (lambda: x * 1.01),
                  "sdpa-cudnn": lambda shape, x: (lambda: x),
                  "flashflow-fp8": lambda shape, x: (lambda: x * 0.9),
                  "sdpa-flash": broken},
                 ours="flashflow", x_key="seqlen_q", variants=("flashflow-fp8",), reference=reference)


def test_measure_adds_accuracy_and_the_variants_ratios(monkeypatch):
    ms = {1.01: 1.0, 1.0: 2.0, 0.9: 0.5}   # ours, the anchor, the variant
    monkeypatch.setattr(triton.testing, "do_bench",
                        lambda fn, warmup, rep, return_mode: ms[round(fn()[0, 0].item(), 2)])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    suite = _fake_suite(calls)
    shapes = [AttentionShape("fa-sweep", 1, 1, s, s, 64, False) for s in (64, 128)]
    # the user's order puts the variant first: it still is no anchor of the check
    rows = suites.measure(suite, shapes, ["flashflow-fp8", "flashflow", "sdpa-flash", "sdpa-cudnn"],
                          torch.float16, progress=False)
    assert calls == [64, 128]   # one reference per shape
    for row in rows:
        res = row["results"]
        assert list(res) == ["flashflow", "sdpa-flash", "sdpa-cudnn", "flashflow-fp8"]
        assert res["flashflow"]["cosine"] == pytest.approx(1.0) and res["flashflow"]["rel_l1"] == pytest.approx(0.01)
        assert res["flashflow-fp8"]["rel_l1"] == pytest.approx(0.1) and res["sdpa-cudnn"]["rel_l1"] == 0.0
        assert res["sdpa-flash"]["error"] == "RuntimeError: No available kernel."
        assert res["sdpa-flash"]["cosine"] is None and res["sdpa-flash"]["rel_l1"] is None
        assert row["check"]["against"] == "sdpa-cudnn"
        assert row["ratios"] == {"flashflow/sdpa-flash": None, "flashflow/sdpa-cudnn": pytest.approx(2.0),
                                 "flashflow-fp8/sdpa-flash": None, "flashflow-fp8/sdpa-cudnn": pytest.approx(4.0),
                                 "flashflow-fp8/flashflow": pytest.approx(2.0)}
    text = runner.markdown_table(rows)
    assert "flashflow-fp8 ÷ sdpa-cudnn" in text and "flashflow-fp8 ÷ flashflow" in text
    assert "flashflow ÷ flashflow-fp8" not in text


def test_measure_without_a_reference_is_the_runner(fake_clock):
    suite = _fake_suite([])
    plain = Suite(suite.name, suite.shapes, suite.make_inputs, suite.providers, suite.ours, suite.x_key)
    shape = AttentionShape("fa-sweep", 1, 1, 64, 64, 64, False)
    (row,) = suites.measure(plain, [shape], ["flashflow", "sdpa-cudnn"], torch.float16, progress=False)
    (want,) = runner.run_suite(plain, [shape], ["flashflow", "sdpa-cudnn"], torch.float16, progress=False)
    assert row == want and "cosine" not in row["results"]["flashflow"]


def test_a_failing_reference_leaves_the_timings(fake_clock, caplog):
    calls = []
    suite = _fake_suite(calls)

    def broken(shape, x):
        calls.append(shape.seqlen_q)
        raise MemoryError("too big")

    suite = Suite(suite.name, suite.shapes, suite.make_inputs, suite.providers, suite.ours, suite.x_key,
                  suite.variants, broken)
    shape = AttentionShape("fa-sweep", 1, 1, 64, 64, 64, False)
    (row,) = suites.measure(suite, [shape], ["flashflow", "sdpa-cudnn", "flashflow-fp8"], torch.float16,
                            progress=False)
    assert calls == [64]   # tried once for the shape
    assert all(r["ms"] == 1.0 and r["cosine"] is None and r["rel_l1"] is None for r in row["results"].values())
    assert "no reference at" in caplog.text and "MemoryError: too big" in caplog.text


def test_the_attention_suite_under_the_interpreter(fake_clock):
    """The real providers and reference on small shapes (the kernels in Triton's interpreter):
    exact attention (ours, and SDPA's CPU flash backend) within rounding of the float64
    reference, FP8 attention within its quantization error."""
    _needs_interpreter()
    from dataclasses import replace

    # the runner makes its inputs on "cuda": here they stay on the CPU
    suite = replace(SUITES["attention"], make_inputs=lambda shape, dtype, device:
                    providers.attention_inputs(shape, dtype, "cpu"))
    shapes = [AttentionShape("qwen-image-small", 1, 2, 80, 80, 128, False),
              AttentionShape("fa-sweep", 2, 2, 72, 72, 64, True)]
    rows = suites.measure(suite, shapes, ["flashflow", "flashflow-fp8", "sdpa-flash"], torch.float16,
                          progress=False)
    for row in rows:
        res = row["results"]
        assert res["flashflow"]["cosine"] > 0.999999 and res["flashflow"]["rel_l1"] < 1e-3, row["shape"]
        assert res["sdpa-flash"]["cosine"] > 0.999999 and res["sdpa-flash"]["rel_l1"] < 1e-3, row["shape"]
        # FP8 attention: about 0.9994 and 0.03 here; an exact result would fail too
        assert 0.998 < res["flashflow-fp8"]["cosine"] < 0.99999, row["shape"]
        assert 1e-2 < res["flashflow-fp8"]["rel_l1"] < 0.06, row["shape"]
        assert row["check"]["against"] == "sdpa-flash"
        assert set(row["ratios"]) == {"flashflow/sdpa-flash", "flashflow-fp8/sdpa-flash", "flashflow-fp8/flashflow"}


# ---------------------------------------------------------------------------- tables


def _rows_with_accuracy():
    shape = AttentionShape("qwen-image-1024px", 1, 24, 4352, 4352, 128, False)
    res = {"flashflow": {"ms": 0.4, "tflops": 580.0, "error": None, "cosine": 0.9999991, "rel_l1": 3.2e-3},
           "sdpa-cudnn": {"ms": 0.38, "tflops": 610.0, "error": None, "cosine": 0.9999993, "rel_l1": 2.9e-3},
           "flashflow-fp8": {"ms": None, "tflops": None, "error": "ValueError: no FP8", "cosine": None,
                             "rel_l1": None}}
    return [{"shape": shape.as_dict(), "panel": shape.panel, "flops": shape.flops, "results": res,
             "ratios": {"flashflow/sdpa-cudnn": 0.95, "flashflow-fp8/sdpa-cudnn": None},
             "pct_of_ceiling": 73.9, "check": {"against": "sdpa-cudnn", "rel_err": 4.5e-4}}]


def test_accuracy_table_has_two_columns_per_provider():
    lines = tables.accuracy_table(_rows_with_accuracy()).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    header, align, row = cells
    assert header[:7] == ["shape", "b", "h", "sq", "sk", "d", "causal"]
    col = dict(zip(header, row))
    assert (col["flashflow cosine"], col["flashflow rel L1"]) == ("0.999999", "3.2e-03")
    assert (col["flashflow-fp8 cosine"], col["flashflow-fp8 rel L1"]) == ("-", "-")
    assert col["sq"] == "4352" and col["causal"] == "no" and len(align) == len(header) == 7 + 2 * 3


def test_results_without_accuracy_render_as_before():
    # a result written before the accuracy columns existed: its rows lack cosine / rel_l1
    saved = json.loads((ROOT / "bench/results/attention-nvidia-h100-80gb-hbm3.json").read_text())
    for row in saved["rows"]:
        for res in row["results"].values():
            res.pop("cosine", None)
            res.pop("rel_l1", None)
    assert tables.accuracy_table(saved["rows"]) == ""
    with_accuracy = json.loads((ROOT / "bench/results/attention-nvidia-h100-80gb-hbm3.json").read_text())
    assert runner.markdown_table(saved["rows"]) == runner.markdown_table(with_accuracy["rows"])


def test_results_with_accuracy_add_the_table(tmp_path, capsys):
    rows = _rows_with_accuracy()
    result = {"schema_version": runner.SCHEMA_VERSION, "suite": "attention", "dtype": "bf16",
              "device": "NVIDIA H100 80GB HBM3", "sm_count": 132, "torch": "2.11.0", "triton": "3.6.0",
              "cuda": "13.0", "python": "3.12.3", "date": "2026-11-22T16:05:09+00:00", "git_commit": "abc",
              "providers": list(rows[0]["results"]), "ours": "flashflow",
              "ceiling_tflops": runner.MATMUL_CEILING_TFLOPS, "rows": rows,
              "accuracy": {"against": suites.ACCURACY_REFERENCE, "keys": list(suites.ACCURACY_KEYS)}}
    path = runner.write_result(result, tmp_path)
    section = tables.attention_section(tmp_path)
    assert section.endswith(tables.accuracy_table(rows) + "\n")
    assert "against exact attention in float64" in section
    assert cli.main(["bench", "--from-json", str(path), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(runner.markdown_table(rows) + "\n") and tables.accuracy_table(rows) in out
