import sys

import pytest

from flashflow.cli import build_parser, main
from flashflow.dataflow.cli import parse_size

SMALL = ["--M", "512", "--N", "512", "--K", "256", "--sms", "4", "--cache", "256K"]


def test_subcommands_are_registered():
    parser = build_parser()
    args = parser.parse_args(["dataflow", "table"])
    assert callable(args.func)
    args = parser.parse_args(["viz", "--port", "0"])
    assert callable(args.func) and args.host == "127.0.0.1"


def test_parse_size():
    assert parse_size("50M") == parse_size("50MiB") == 50 * 2**20
    assert parse_size("256kb") == 256 * 1024
    assert parse_size("4096") == 4096
    with pytest.raises(Exception, match="size"):
        parse_size("lots")


def test_table(capsys):
    assert main(["dataflow", "table", *SMALL, "--policy", "both"]) == 0
    out = capsys.readouterr().out
    for name in ("row_major", "snake", "grouped_m:2", "cutlass_swizzle:2", "hilbert", "morton",
                 "read (belady)", "compulsory reads 512.00 KiB"):
        assert name in out


def test_table_with_anneal(capsys):
    assert main(["dataflow", "table", *SMALL, "--orders", "row_major", "--anneal", "20"]) == 0
    assert "anneal(seed=0)" in capsys.readouterr().out


def test_search_sweep_waves_chain(capsys):
    assert main(["dataflow", "search", "--M", "384", "--N", "384", "--K", "128", "--sms", "1",
                 "--cache", "64K"]) == 0
    out = capsys.readouterr().out
    assert "exhaustive over a 3x3 grid" in out and "best :" in out and "worst:" in out
    assert main(["dataflow", "search", *SMALL, "--anneal", "--iterations", "10"]) == 0
    assert "anneal (seed 0, 10 iterations" in capsys.readouterr().out
    assert main(["dataflow", "sweep", *SMALL, "--orders", "row_major,snake",
                 "--min-cache", "64K", "--max-cache", "256K"]) == 0
    out = capsys.readouterr().out
    assert "lower bound" in out and "64.00 KiB" in out and "256.00 KiB" in out
    assert main(["dataflow", "waves", "--M", "1024", "--n-max", "4096"]) == 0
    assert "last wave" in capsys.readouterr().out
    assert main(["dataflow", "chain", "--M", "256", "--hidden", "256", "--intermediate", "512",
                 "--sms", "2", "--cache", "128K", "--policies", "sequential,halfrow"]) == 0
    out = capsys.readouterr().out
    assert "sequential" in out and "halfrow" in out


@pytest.mark.parametrize("cmd", [
    ["dataflow", "table", *SMALL, "--orders", "row_major,hilbert"],
    ["dataflow", "sweep", *SMALL, "--orders", "row_major", "--min-cache", "128K",
     "--max-cache", "256K"],
    ["dataflow", "waves", "--M", "512", "--n-max", "2048"],
    ["dataflow", "search", "--M", "256", "--N", "256", "--K", "128", "--sms", "1",
     "--cache", "64K"],
])
def test_png_without_matplotlib_degrades_to_a_message(cmd, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # makes `import matplotlib` fail
    png = tmp_path / "out.png"
    assert main([*cmd, "--png", str(png)]) == 0
    captured = capsys.readouterr()
    assert "needs matplotlib" in captured.err
    assert captured.out.strip()              # the text result is still printed
    assert not png.exists()


@pytest.mark.parametrize("cmd", [
    ["dataflow", "table", *SMALL, "--orders", "row_major,hilbert,grouped_m:2"],
    ["dataflow", "sweep", *SMALL, "--orders", "row_major", "--min-cache", "128K",
     "--max-cache", "256K"],
    ["dataflow", "waves", "--M", "512", "--n-max", "2048"],
    ["dataflow", "search", "--M", "256", "--N", "256", "--K", "128", "--sms", "1",
     "--cache", "64K"],
])
def test_png_plots(cmd, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    png = tmp_path / "out.png"
    assert main([*cmd, "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_partitioned_l2(capsys):
    from flashflow.dataflow import orders
    from flashflow.dataflow.cli import fmt_bytes
    from flashflow.dataflow.model import simulate
    from flashflow.dataflow.shape import GemmShape
    assert main(["dataflow", "table", *SMALL, "--orders", "row_major,hilbert",
                 "--l2-partitions", "2", "--placement", "alternate", "--drift", "1",
                 "--tiles-per-sm", "2"]) == 0
    out = capsys.readouterr().out
    assert "in 2 partitions (sharing home, placement alternate, 2 tiles/SM), drift 1" in out
    # the table shows what the model says for the same options
    t = simulate(GemmShape(512, 512, 256), orders.row_major(4, 4), 256 * 1024, 4,
                 partitions=2, sharing="home", placement="alternate", drift=1.0, tiles_per_sm=2)
    row = next(line for line in out.splitlines() if line.startswith("row_major"))
    assert fmt_bytes(t.read_bytes) in row


def test_partitioned_l2_rejects_belady_and_bad_options():
    with pytest.raises(SystemExit, match="lru only"):
        main(["dataflow", "table", *SMALL, "--l2-partitions", "2", "--policy", "belady"])
    with pytest.raises(SystemExit, match="drift"):
        main(["dataflow", "table", *SMALL, "--drift", "2"])
    with pytest.raises(SystemExit, match="tiles-per-sm"):
        main(["dataflow", "table", *SMALL, "--l2-partitions", "2", "--tiles-per-sm", "3"])
