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
    assert runner.options == {"quick", "providers", "warmup", "rep", "blocks"} and runner.defaults["blocks"] == 1
    assert dl.STEP_PROVIDERS == ("flashflow-megakernel-layers", "flashflow-megakernel-layers-folded")
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
    # --blocks: the layers of a step; the one-launch providers only with more than one
    args = SimpleNamespace(warmup=25, rep=100, providers=None, blocks=8)
    assert dl.check_args(args) is None and args.providers == list(dl.PROVIDERS + dl.STEP_PROVIDERS)
    assert "--providers" in dl.check_args(SimpleNamespace(warmup=25, rep=100, providers=dl.LAYERS, blocks=1))
    for bad in (0, 33, 2.5, True):
        assert "--blocks" in dl.check_args(SimpleNamespace(warmup=25, rep=100, providers=None, blocks=bad))


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


def test_a_step_of_several_layers_on_the_cpu_with_a_fake_clock():
    """--blocks 2: every provider that needs no CUDA runs both tiny layers (the one-launch plan
    too) and agrees with the float64 layers; µs are a layer's, TB/s the step's; ratios over the
    one launch and over a launch per layer; the table says what ÷ is over."""
    if not torch.cuda.is_available():
        from flashflow.device import interpreting
        if not interpreting():
            pytest.skip("the flashflow providers run in Triton's interpreter on the CPU")
    names = [n for n in dl.PROVIDERS + dl.STEP_PROVIDERS if n not in dl.NEEDS_CUDA]
    ms = {n: 0.5 * (i + 1) for i, n in enumerate(names)}
    row = dl.bench_step_case(TINY_LLAMA, 2, 24, 2, names, timer=lambda name, fn: ms[name], device="cpu",
                             dtype=torch.float32)
    assert row["errors"] == {} and set(row["us"]) == set(names) and row["layers"] == 2
    for n in names:
        assert row["rel_err"][n] < 1e-5, (n, row["rel_err"][n])
        assert row["us"][n] == pytest.approx(ms[n] * 1e3 / 2)
        assert row["tbs"][n] == pytest.approx(row["bytes"] / (ms[n] * 1e-3) / 1e12)
    from flashflow.ops.decode_layer import decode_layer_bytes
    assert row["bytes"] == 2 * decode_layer_bytes(TINY_LLAMA, 2, 23, 4)
    assert row["speedup"] == {n: pytest.approx(ms[n] / ms[dl.LAYERS]) for n in names if n != dl.LAYERS}
    assert row["speedup_per_layer"] == {n: pytest.approx(ms[n] / ms[dl.MEGAKERNEL]) for n in names
                                        if n != dl.MEGAKERNEL}
    result = {"suite": "decode-layer", "providers": names, "layers": 2, "timing": {"discipline": "cold-l2"},
              "rows": [row]}
    table = dl.report(result)
    assert "a step of 2 layers" in table and "flashflow-megakernel ÷" in table
    assert "flashflow-megakernel-layers ÷" not in table
