"""`flashflow tune`: argument parsing, candidate generation and the no-GPU error, on the CPU."""
import argparse
import dataclasses

import pytest
import torch

from flashflow import cli
from flashflow.bench import spec, timing, tune
from flashflow.bench.ops import TUNABLE
from flashflow.bench.ops import attention as attention_spec
from flashflow.bench.ops import decode as decode_spec
from flashflow.bench.ops import mlp as mlp_spec


@dataclasses.dataclass(frozen=True)
class _Config:
    BLOCK_N: int
    num_stages: int
    use_tma: bool = False


def _parse(*argv):
    return cli.build_parser().parse_args(["tune", *argv])


def test_defaults_are_the_ops_axes_three_rounds_and_bench_results():
    args = _parse("decode")
    assert (args.op, args.rounds, str(args.out), args.vary, args.product) == ("decode", 3, "bench/results", None, False)
    assert tune.parse_vary(args.vary, "decode") == TUNABLE["decode"].axes


def test_help_shows_defaults_and_every_op(capsys):
    with pytest.raises(SystemExit) as e:
        _parse("--help")
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())   # argparse wraps lines at the terminal width
    assert "(default: 3)" in out and "(default: bench/results)" in out
    assert "{attention,attention-gluon,attention-bwd,attention-fp8,decode,mlp}" in out


def test_vary_values_are_typed_and_fields_checked():
    axes = tune.parse_vary(["BLOCK_N=64,128", "use_tma=true,false", "policy=seqsplit:8,splitk"], "mlp")
    assert axes == {"BLOCK_N": (64, 128), "use_tma": (True, False), "policy": ("seqsplit:8", "splitk")}
    with pytest.raises(ValueError, match="FIELD=V1,V2"):
        tune.parse_vary(["BLOCK_N"], "mlp")
    with pytest.raises(ValueError, match="decode has no field 'BLOCK_I'.*BLOCK_N"):
        tune.parse_vary(["BLOCK_I=64"], "decode")


def test_every_default_axis_is_a_field_or_a_plan_option():
    for op, s in TUNABLE.items():
        assert set(s.axes) <= set(tune.tunable(op)), op


def test_candidates_one_field_at_a_time_or_every_combination():
    axes = {"BLOCK_N": (64, 128), "num_stages": (3, 4, 5)}
    one = tune.candidates(axes)
    assert list(one) == ["shipped", "BLOCK_N=64", "BLOCK_N=128", "num_stages=3", "num_stages=4", "num_stages=5"]
    assert one["shipped"] == {} and one["num_stages=4"] == {"num_stages": 4}
    every = tune.candidates(axes, product=True)
    assert len(every) == 1 + 2 * 3
    assert every["BLOCK_N=128,num_stages=5"] == {"BLOCK_N": 128, "num_stages": 5}


def test_a_candidate_replaces_fields_of_the_shipped_config():
    base = _Config(64, 3)
    assert spec.replace_fields(base, {"num_stages": 4}) == _Config(64, 4)
    assert spec.replace_fields(base, {"BLOCK_N": 128, "num_splits": 8}, ("num_splits",)) == _Config(128, 3)
    assert base == _Config(64, 3)   # frozen: the shipped config is not touched
    with pytest.raises(spec.NotApplicable, match="BLOCK_I"):
        spec.replace_fields(base, {"BLOCK_I": 64})
    assert spec.same_as_shipped(base, {"num_stages": 3}, {})
    assert spec.same_as_shipped(base, {"num_splits": 4}, {"num_splits": 4})
    assert not spec.same_as_shipped(base, {"num_stages": 3, "num_splits": 8}, {"num_splits": 4})


@pytest.mark.parametrize("argv, message", [
    (["mlp", "--vary", "nope=1"], "mlp has no field 'nope'"),
    (["mlp", "--models", "gpt5"], "--models must be a comma list of"),
    (["decode", "--rounds", "0"], "--rounds must be >= 1"),
    (["attention", "--fp8"], "--fp8 applies to decode only"),
    (["mlp", "--paged"], "--paged applies to decode only"),
    (["attention-bwd", "--mask"], "--mask applies to attention only, not attention-bwd"),
    (["attention", "--tokens", "8"], "--tokens applies to mlp only, not attention"),
])
def test_bad_options_are_argparse_errors_naming_the_value(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "flashflow tune: error:" in err and message in err


def test_bad_token_list_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        _parse("mlp", "--tokens", "1,x")
    assert "comma list of integers" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without a GPU")
@pytest.mark.parametrize("op", sorted(TUNABLE))
def test_without_a_gpu_one_line_error_and_exit_2(capsys, tmp_path, op):
    assert cli.main(["tune", op, "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == "flashflow tune: " + tune.NO_GPU
    assert captured.out == "" and not any(tmp_path.iterdir())


def test_shape_selection_follows_the_options():
    args = argparse.Namespace(quick=True, head_dims=(128,), paged=True, models=("llama3-8b",), tokens=(8, 64),
                              mask=False)
    assert all(s.head_dim == 128 for s in attention_spec.tune_shapes(args))
    assert any(s.causal for s in attention_spec.tune_shapes(args))
    masked = attention_spec.tune_shapes(argparse.Namespace(**{**vars(args), "mask": True}))
    assert masked and not any(s.causal for s in masked)   # SDPA takes a mask or is_causal, not both
    shapes = decode_spec.tune_shapes(args)
    assert [s[-1] for s in shapes[:2]] == [False, True] and len(shapes) % 2 == 0
    assert mlp_spec.tune_shapes(args) == [("llama3-8b", "swiglu", 4096, 14336, 8), ("llama3-8b", "swiglu", 4096, 14336, 64)]


def test_a_case_checks_skips_and_times_candidates_against_the_anchor(monkeypatch):
    """tune_case with stand-in kernels and clock: a wrong output is reported and not timed, a
    candidate that does not exist is skipped, the fastest correct one is the best."""
    ref = torch.ones(8)
    speed = {"anchor": 10.0, "shipped": 8.0, "num_stages=4": 5.0}

    def timed(name, out):
        fn = lambda: out  # noqa: E731
        fn.name = name
        return fn

    def make(ov):
        if ov == {}:
            return timed("shipped", ref)
        if ov == {"num_stages": 4}:
            return timed("num_stages=4", ref * 1.001)
        if ov == {"num_stages": 5}:
            return timed("num_stages=5", ref * 2)    # wrong
        raise spec.NotApplicable("not for this shape")

    monkeypatch.setattr(timing, "graph_ms", lambda fn, steps, warmup, rep: speed[fn.name] / 1e3)
    case = spec.TuneCase("s", {}, timed("anchor", ref), make, work=1e6, steps=1, shipped={})
    cands = tune.candidates({"num_stages": (4, 5), "BLOCK_N": (64,)})
    done = []

    class Bar:
        def update(self, n=1):
            done.append(n)
    row = tune.tune_case(case, cands, rounds=3, warmup=1, rep=1, bar=Bar())
    c = row["candidates"]
    assert row["best"] == "num_stages=4" and row["anchor_us"] == 10.0
    assert c["num_stages=4"]["us"] == 5.0 and c["num_stages=4"]["vs_anchor"] == 2.0
    assert c["shipped"]["rounds_us"] == [8.0, 8.0, 8.0]
    assert "relative error" in c["num_stages=5"]["error"] and "us" not in c["num_stages=5"]
    assert row["skipped"] == {"BLOCK_N=64": "not for this shape"}
    assert sum(done) == 3 * (len(cands) + 1)
    assert "| s | 10.0 | 8.0 |" in tune.table([{**row, "label": "s"}], "TB/s", "sdpa")


def test_attention_fp8_axes_are_its_config_fields_and_the_qk_format():
    from flashflow.tuning.attention_fp8 import AttentionFp8Config

    names = tune.tunable("attention-fp8")
    assert "qk_format" in names and "pv_fp32_sum" in names and "BLOCK_N" in names
    base = AttentionFp8Config(64, 128, 4, 3)
    # a plan option leaves the config as it is; a field replaces it
    plan_options = TUNABLE["attention-fp8"].plan_options
    assert spec.replace_fields(base, {"qk_format": "fp8"}, plan_options) == base
    assert spec.replace_fields(base, {"BLOCK_N": 64}, plan_options).BLOCK_N == 64
    assert TUNABLE["attention-fp8"].tolerance > spec.TOLERANCE


def test_a_backward_case_times_eagerly_and_refuses_run_to_run_different_gradients(monkeypatch):
    """attention-bwd: steps = 0 times the call itself (autograd, no CUDA graph); with
    repeat_check a candidate whose bits change between runs is reported, not timed."""
    ref = torch.ones(8)
    calls = {"n": 0}

    def racy():
        calls["n"] += 1
        return ref + calls["n"] * 1e-6   # within tolerance, never the same bits twice

    steady = lambda: ref.clone()  # noqa: E731
    speed = {id(steady): 4.0, id(racy): 1.0}

    def eager(fn, warmup, rep):
        return speed.get(id(fn), 10.0) / 1e3

    monkeypatch.setattr(timing, "warm_ms", eager)
    monkeypatch.setattr(timing, "graph_ms", lambda *a: pytest.fail("attention-bwd is timed eagerly"))

    def make(ov):
        return {(): steady, (("BLOCK_M1", 32),): racy}[tuple(ov.items())]
    case = spec.TuneCase("s", {}, lambda: ref, make, work=1e6, steps=0, shipped={}, repeat_check=3)

    class Bar:
        def update(self, n=1):
            pass
    row = tune.tune_case(case, tune.candidates({"BLOCK_M1": (32,)}), rounds=2, warmup=1, rep=1, bar=Bar())
    assert row["candidates"]["BLOCK_M1=32"]["error"] == "run-to-run different over 3 runs"
    assert row["best"] == "shipped" and row["candidates"]["shipped"]["us"] == 4.0
    assert set(TUNABLE["attention-bwd"].axes) <= set(tune.tunable("attention-bwd"))
