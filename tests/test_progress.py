"""flashflow.progress: the one progress line of the CLI commands (dataflow, bench, info)."""
import sys

import flashflow.progress
from flashflow.progress import progress


def test_describe_names_the_step_under_way(monkeypatch, capsys):
    monkeypatch.setattr(flashflow.progress, "DELAY", 0.0)
    monkeypatch.setitem(sys.modules, "tqdm", None)          # the plain counter
    with progress(2, "timing") as bar:
        bar.describe("shape a")
        bar.update()
        bar.describe("shape b")
        bar.update()
    err = capsys.readouterr().err
    assert "timing: 1/2" in err and "shape a" in err
    assert "timing: 2/2" in err and "shape b" in err


def test_disabled_draws_nothing(monkeypatch, capsys):
    monkeypatch.setattr(flashflow.progress, "DELAY", 0.0)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    for total in (3, None):
        with progress(total, "timing", enabled=False) as bar:
            bar.describe("shape a")
            bar.update()
    assert capsys.readouterr().err == ""
