"""`flashflow bench --suite decode-layer` without a GPU: its registration and options, one row
on the CPU (interpreter, tiny config) with a fake clock, every provider's output against the
float64 reference, and its table from the result."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashflow import cli
from flashflow.bench import decode_layer_suite as dl
from flashflow.bench.ops import spec
from flashflow.bench.suites import RUNNERS
from flashflow.ops.decode_layer import LLAMA3_8B, TINY_LLAMA

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without a GPU")


def test_registered_with_its_shapes_providers_and_options():
    runner = RUNNERS["decode-layer"]
    assert runner.module == "flashflow.bench.decode_layer_suite"
    assert runner.options == {"quick", "providers", "warmup", "rep"}
    assert spec("decode-layer").suite == "decode-layer"
    assert dl.PROVIDERS == ("flashflow-megakernel", "flashflow-megakernel-folded", "flashflow-kernels", "torch-eager",
                            "torch+graph", "torch.compile")
    assert {b for b, _ in dl.SHAPES} == {1, 16} and {s for _, s in dl.SHAPES} == {1024, 4096, 8192, 32768}
    assert (LLAMA3_8B.hidden, LLAMA3_8B.heads, LLAMA3_8B.kv_heads, LLAMA3_8B.head_dim,
            LLAMA3_8B.intermediate) == (4096, 32, 8, 128, 14336)


def test_check_args():
    args = SimpleNamespace(warmup=25, rep=100, providers=None)
    assert dl.check_args(args) is None and args.providers == list(dl.PROVIDERS)
    assert "--providers" in dl.check_args(SimpleNamespace(warmup=25, rep=100, providers="torch-eager,vllm"))
    assert "--rep" in dl.check_args(SimpleNamespace(warmup=25, rep=0, providers=None))


@no_gpu
def test_without_a_gpu_says_so(capsys):
    assert cli.main(["bench", "--suite", "decode-layer", "--quick"]) == 2
    assert "--suite decode-layer needs a CUDA GPU" in capsys.readouterr().err


def test_a_row_on_the_cpu_with_a_fake_clock(monkeypatch):
    """The providers that need no CUDA run on the tiny layer in fp32 and agree with the float64
    reference; the fake clock's times become µs, TB/s and speedups; the table prints them."""
    if not torch.cuda.is_available():
        from flashflow.device import interpreting
        if not interpreting():
            pytest.skip("the flashflow providers run in Triton's interpreter on the CPU")
    names = [n for n in dl.PROVIDERS if n not in dl.NEEDS_CUDA]
    ms = {n: 0.5 * (i + 1) for i, n in enumerate(names)}
    row = dl.bench_case(TINY_LLAMA, 2, 24, names, timer=lambda name, fn: ms[name], device="cpu",
                        dtype=torch.float32)
    assert row["errors"] == {} and set(row["us"]) == set(names)
    for n in names:
        assert row["rel_err"][n] < 1e-5, (n, row["rel_err"][n])
        assert row["tbs"][n] == pytest.approx(row["bytes"] / (ms[n] * 1e-3) / 1e12)
    assert row["speedup"] == {n: pytest.approx(ms[n] / ms[dl.MEGAKERNEL]) for n in names if n != dl.MEGAKERNEL}
    assert row["speedup_folded"] == {n: pytest.approx(ms[n] / ms[dl.FOLDED]) for n in names
                                     if n not in (dl.MEGAKERNEL, dl.FOLDED)}
    result = {"suite": "decode-layer", "providers": names, "timing": {"discipline": "cold-l2"}, "rows": [row]}
    table = dl.report(result)
    assert "| 2 | 24 |" in table and "flashflow-kernels ÷" in table and "0.50" not in table.split("\n")[-1][:12]
