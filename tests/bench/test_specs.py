"""The op specs (flashflow.bench.ops): one per op, each known to tune, info and the bench suites."""
import argparse
import importlib
import pkgutil
from pathlib import Path

import pytest

import flashflow.tuning
from flashflow import cli
from flashflow.bench import info, tune
from flashflow.bench.cli import _ALL_SUITES
from flashflow.bench.ops import BY_NAME, SPECS, TUNABLE, spec
from flashflow.bench.spec import InfoCase, OpSpec, TuneOption

TUNING = Path(flashflow.tuning.__file__).parent


def test_specs_are_declared_once_in_order_with_unique_names():
    names = [s.name for s in SPECS]
    assert names == ["attention", "attention-gluon", "attention-bwd", "attention-fp8", "decode", "mlp", "norm", "quant",
                     "fp8-linear", "decode-layer"]
    assert len(set(names)) == len(names) and all(isinstance(s, OpSpec) for s in SPECS)
    assert list(BY_NAME) == names
    with pytest.raises(ValueError, match="no op 'conv'.*attention"):
        spec("conv")


def test_every_spec_is_an_info_op_and_every_tunable_one_a_tune_op():
    assert info.OPS == tuple(s.name for s in SPECS)
    parser = cli.build_parser()
    for s in SPECS:
        if s.tunable:
            assert parser.parse_args(["tune", s.name]).op == s.name
            assert s.unit and s.anchor and s.tune_shapes and s.tune_case and s.config_classes
        else:
            with pytest.raises(SystemExit):
                parser.parse_args(["tune", s.name])
    assert set(TUNABLE) == {s.name for s in SPECS if s.axes}


def test_every_tuning_module_with_a_config_table_has_a_spec():
    """A config table (tuning/<op>.json) is what tune sweeps: each has the spec that tunes it."""
    tables = {p.stem for p in TUNING.glob("*.json")}
    tuned = {cls.__module__.rsplit(".", 1)[1] for s in SPECS for cls in s.config_classes}
    assert tables and tables == tuned
    modules = {m.name for m in pkgutil.iter_modules([str(TUNING)])}
    assert tables <= modules


def test_every_spec_names_a_bench_suite():
    assert all(s.suite in _ALL_SUITES for s in SPECS), [(s.name, s.suite) for s in SPECS]


def test_every_spec_lists_info_cases_of_its_own_op_without_a_gpu():
    for s in SPECS:
        cases = s.info_cases(None)
        assert cases and all(isinstance(c, InfoCase) and c.op == s.name for c in cases), s.name
        one_family = s.info_cases("sm90")
        assert len({c.label for c in one_family}) == len(one_family), s.name
        if s.info_listing is not None:
            assert all(c.launch is None and c.op == s.name for c in s.info_listing("sm90"))


def test_every_default_axis_and_option_is_the_ops_own():
    dests = [o.dest for s in SPECS for o in s.tune_options]
    assert len(dests) == len(set(dests))   # an option is declared by one op
    for s in TUNABLE.values():
        assert set(s.axes) <= set(s.fields()), s.name
        assert set(s.plan_options) <= set(s.fields()), s.name
        assert {o.dest for o in s.tune_options} <= set(s.tune_takes), s.name
        assert set(s.option_tolerances) | set(s.result_flags) <= set(s.tune_takes), s.name
    # what some op reads, some op declares
    assert {d for s in SPECS for d in s.tune_takes} == set(dests)


def test_an_option_changes_the_tolerance_and_the_result_name_where_the_spec_says():
    decode = spec("decode")
    plain, fp8 = argparse.Namespace(fp8=False, paged=True), argparse.Namespace(fp8=True, paged=True)
    assert decode.tolerance_for(plain) == decode.tolerance < decode.tolerance_for(fp8)
    assert decode.result_suite(plain) == "tune-decode" and decode.result_suite(fp8) == "tune-decode-fp8"
    assert spec("attention-fp8").result_suite(fp8) == "tune-attention-fp8"


def test_a_tune_option_takes_its_dest_from_its_flag():
    assert TuneOption(("--head-dims",), {}).dest == "head_dims"
    assert TuneOption(("--x",), {"dest": "y"}).dest == "y"


def test_spec_modules_are_the_ops_package_modules():
    import flashflow.bench.ops as ops

    modules = {m.name for m in pkgutil.iter_modules(ops.__path__)}
    assert modules == {s.name.replace("-", "_") for s in SPECS}
    for name in modules:
        assert importlib.import_module(f"flashflow.bench.ops.{name}").SPEC in SPECS


def test_tune_help_lists_every_ops_options_once(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["tune", "--help"])
    out = capsys.readouterr().out
    for option in (o for s in SPECS for o in s.tune_options):
        assert out.count(option.flags[0] + " ") + out.count(option.flags[0] + "\n") >= 1, option.flags
    assert tune.tunable("decode")[-1] == "num_splits"
