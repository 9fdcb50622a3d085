"""The timing disciplines (flashflow.bench.timing): named once, recorded in every result."""
import json
from pathlib import Path

import pytest

from flashflow.bench import timing

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_record_names_a_known_discipline_first():
    rec = timing.record("rounds", of="graph", rounds=3, warmup_ms=5)
    assert list(rec) == ["discipline", "of", "rounds", "warmup_ms"] and rec["discipline"] == "rounds"
    with pytest.raises(ValueError, match="must be one of warm"):
        timing.record("hot")
    with pytest.raises(ValueError, match="of= must be one of"):
        timing.record("rounds", of="eager")


def test_every_result_file_names_a_known_discipline_or_times_nothing():
    """What bench/results holds, old files (no "discipline" field) included: every result of a
    suite or a tune the code runs today says how it was timed."""
    from flashflow.bench.cli import _ALL_SUITES
    from flashflow.bench.ops import TUNABLE

    timed = (set(_ALL_SUITES) - {"memory"}) | {s.result_suite(_Flags(s.result_flags)) for s in TUNABLE.values()}
    timed |= {f"tune-{name}" for name in TUNABLE}
    files = sorted(RESULTS.glob("*.json"))
    assert files
    seen = set()
    for path in files:
        result = json.loads(path.read_text())
        name = timing.discipline_of(result)
        assert name is None or name in timing.DISCIPLINES, (path.name, name)
        if result.get("suite") in timed:
            assert name is not None, path.name
            seen.add(result["suite"])
    assert {"attention", "decode", "mlp", "host", "train", "qwen-image", "tune-decode-fp8"} <= seen


class _Flags:
    def __init__(self, names):
        self.__dict__.update(dict.fromkeys(names, True))


def test_a_result_says_its_discipline_or_its_suite_does():
    assert timing.discipline_of({"suite": "attention", "timing": {"warmup_ms": 25}}) == "warm"
    assert timing.discipline_of({"suite": "decode"}) == "cold-l2"
    assert timing.discipline_of({"suite": "tune-decode-fp8", "timing": {"rounds": 3}}) == "rounds"
    assert timing.discipline_of({"suite": "tune-mlp-prefill"}) is None   # a retired tool's file
    assert timing.discipline_of({"suite": "attention", "timing": {"discipline": "graph"}}) == "graph"
    assert timing.discipline_of({"suite": "memory"}) is None
    assert timing.describe({"suite": "mlp", "timing": {"discipline": "rounds", "of": "graph"}}).startswith(
        "Timing `rounds` of `graph`:")
    assert timing.describe({"suite": "info"}) == ""


def test_rounds_rotate_who_runs_first_and_keep_a_failure_as_none():
    order = []

    def timer(fn):
        return fn()

    def make(name, value):
        def fn():
            order.append(name)
            if value is None:
                raise RuntimeError("out of resource\nmore")
            return value
        return fn
    ticks = []
    samples, errors = timing.rounds({"a": make("a", 1.0), "b": make("b", 2.0), "c": make("c", None)}, timer, 3,
                                    after_each=lambda: ticks.append(1))
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert samples == {"a": [1.0] * 3, "b": [2.0] * 3, "c": [None] * 3}
    assert errors == {"c": "RuntimeError: out of resource\nmore"} and len(ticks) == 9
    assert timing.rounds({}, timer, 2) == ({}, {})


def test_cold_l2_copies_span_three_l2s_at_most_one_graphs_steps():
    assert timing.rotation(10, 10) == 3 and timing.rotation(1, 10**6) == timing.GRAPH_STEPS
    assert timing.rotation(10**9, 10) == 1


def test_short_error_is_one_line():
    assert timing.short_error(ValueError("bad\nsecond")) == "ValueError: bad"
    assert timing.short_error(RuntimeError()) == "RuntimeError: "


def test_warm_makes_the_first_call_outside_the_measurement(monkeypatch):
    import triton.testing

    calls = []
    monkeypatch.setattr(triton.testing, "do_bench",
                        lambda fn, warmup, rep, return_mode: (calls.append((warmup, rep, return_mode)), 2.5)[1])
    fn_calls = []
    assert timing.warm_ms(lambda: fn_calls.append(1), 3, 7) == 2.5 and fn_calls == [1]
    assert timing.warm_ms(lambda: fn_calls.append(1), first_call=False, return_mode="mean") == 2.5
    assert fn_calls == [1] and calls == [(3, 7, "median"), (25, 100, "mean")]
