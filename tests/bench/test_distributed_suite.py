"""The distributed suite's CPU parts: its option check, and its report of a saved result (the
ratios read off the JSON's own numbers)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashflow.bench import distributed_suite as ds
from flashflow.bench.suites import RUNNERS

RESULTS = sorted((Path(__file__).resolve().parents[2] / "bench" / "results").glob("distributed-*.json"))


def test_registered_as_a_suite():
    assert RUNNERS["distributed"].module == "flashflow.bench.distributed_suite"


@pytest.mark.parametrize("blocks", [0, 61, 2.5, True])
def test_check_args_refuses_a_block_count(blocks):
    assert "--blocks" in ds.check_args(SimpleNamespace(blocks=blocks))


def test_check_args_takes_a_block_count():
    assert ds.check_args(SimpleNamespace(blocks=6)) is None


@pytest.mark.skipif(not RESULTS, reason="no saved distributed result")
@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_report_of_a_saved_result(path):
    result = json.loads(path.read_text())
    text = ds.report(result)
    for row in result["rows"]:
        res = row["results"]
        for provider, r in res.items():
            assert f"  {provider}: " in text
            if row["kind"] == "prefill" and "error" not in r:
                one = res["flashflow (one GPU)"]["ms"]
                assert f"{r['ms']:.2f} | {r['tflops']:.0f} | {one / r['ms']:.2f}" in text
            if row["kind"] == "cfg" and "error" not in r:
                assert f"{r['ms']:.2f} | {res['flashflow-fp8']['ms'] / r['ms']:.2f} | {res['diffusers']['ms'] / r['ms']:.2f}" in text
            if row["kind"] == "step" and "error" not in r:
                fp8 = f"{res['flashflow-fp8']['ms'] / r['ms']:.2f}" if "flashflow-fp8" in res else "-"
                lines = text.splitlines()
                start = lines.index(next(x for x in lines if x.startswith(f"step {row['shape']['name']}:")))
                line = next(x for x in lines[start:] if x.startswith(f"  {provider}: "))
                assert line.startswith(f"  {provider}: {r['ms']:.2f} | {fp8}"), line
                one = ds.one_gpu_counterpart(provider)
                if one in res:
                    assert line.endswith(f" | {res[one]['ms'] / r['ms']:.2f}"), line


def test_one_gpu_counterpart():
    assert ds.one_gpu_counterpart("flashflow-fp8+ulysses2+graph (peer 2 head groups)") == "flashflow-fp8+graph"
    assert ds.one_gpu_counterpart("flashflow-fp8-linear+ulysses2+graph (parallel first)") == \
        "flashflow-fp8-linear+graph"
    assert ds.one_gpu_counterpart("flashflow-fp8+ulysses2") == "flashflow-fp8"
    assert ds.one_gpu_counterpart("diffusers+ulysses2") == "diffusers"
    assert ds.one_gpu_counterpart("flashflow-fp8+graph") is None
    assert ds.one_gpu_counterpart("no such provider") is None


def test_provider_selection(monkeypatch):
    from flashflow.bench import distributed_suite as ds

    monkeypatch.delenv(ds.PROVIDERS_ENV, raising=False)
    assert ds._selected(ds.STEP_PROVIDERS) is ds.STEP_PROVIDERS
    assert all("," not in name for name in ds.STEP_PROVIDERS)   # the variable is a comma-separated list
    monkeypatch.setenv(ds.PROVIDERS_ENV, "flashflow-fp8+graph, diffusers")
    assert list(ds._selected(ds.STEP_PROVIDERS)) == ["diffusers", "flashflow-fp8+graph"]   # the suite's order
    monkeypatch.setenv(ds.PROVIDERS_ENV, "diffusers,flashflow-fp9")
    with pytest.raises(ValueError, match="unknown providers \\['flashflow-fp9'\\]"):
        ds._selected(ds.STEP_PROVIDERS)


def test_calls_a_round(monkeypatch):
    from flashflow.bench import distributed_suite as ds

    monkeypatch.delenv("FLASHFLOW_DISTRIBUTED_CALLS", raising=False)
    assert ds._calls() == ds.CALLS
    monkeypatch.setenv("FLASHFLOW_DISTRIBUTED_CALLS", "3")
    assert ds._calls() == 3
    for bad in ("0", "-2", "three"):
        monkeypatch.setenv("FLASHFLOW_DISTRIBUTED_CALLS", bad)
        with pytest.raises(ValueError, match="FLASHFLOW_DISTRIBUTED_CALLS must be a positive integer"):
            ds._calls()
