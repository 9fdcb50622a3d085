import subprocess
import sys
import time

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


def _usage_error(capsys, argv) -> str:
    """Runs a command that must fail as argparse does: exit status 2, one error line on
    stderr (after the usage), nothing on stdout; returns that line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: flashflow dataflow ")
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in captured.err
    return errors[0]


def test_partitioned_l2_rejects_belady_and_bad_options(capsys):
    assert "lru only" in _usage_error(
        capsys, ["dataflow", "table", *SMALL, "--l2-partitions", "2", "--policy", "belady"])
    assert "drift" in _usage_error(capsys, ["dataflow", "table", *SMALL, "--drift", "2"])
    assert "tiles-per-sm" in _usage_error(
        capsys, ["dataflow", "table", *SMALL, "--l2-partitions", "2", "--tiles-per-sm", "3"])


@pytest.mark.parametrize("argv,message", [
    (["table", "--M", "-5"], "argument --M: must be positive, got -5"),
    (["table", "--N", "0"], "argument --N: must be positive, got 0"),
    (["table", "--K", "4k"], "argument --K: must be an integer, got '4k'"),
    (["table", "--block-k", "-64"], "argument --block-k: must be positive"),
    (["table", "--elem-bytes", "0"], "argument --elem-bytes: must be positive"),
    (["table", "--sms", "0"], "argument --sms: must be positive"),
    (["table", "--cache", "lots"], "argument --cache: size must look like 4096, 256K or 50MiB"),
    (["table", "--cache=-1M"], "argument --cache: size must look like"),
    (["table", "--cache", "1.5"], "argument --cache: size must be a whole number of bytes"),
    (["table", "--policy", "fifo"], "argument --policy: invalid choice: 'fifo'"),
    (["table", "--orders", "row_major,zigzag"], "--orders: order must be one of"),
    (["table", "--orders", "grouped_m:0"], "--orders: group must be positive, got 0"),
    (["table", "--orders", "hilbert:2"], "--orders: order 'hilbert' takes no parameter"),
    (["table", "--orders", "row_major,"], "--orders: empty name in 'row_major,'"),
    (["table", "--anneal", "-1"], "argument --anneal: must be >= 0, got -1"),
    (["table", "--seed", "3"], "--seed applies only with --anneal"),
    (["table", "--l2-partitions", "0"], "argument --l2-partitions: must be positive"),
    (["table", "--sharing", "some"], "argument --sharing: invalid choice"),
    (["table", "--placement", "left"], "argument --placement: invalid choice"),
    (["table", "--drift", "-0.5"], "argument --drift: must be in [0, 1]"),
    (["table", "--drift", "much"], "argument --drift: must be a number in [0, 1]"),
    (["sweep", "--min-cache", "0"], "argument --min-cache: size must be positive"),
    (["sweep", "--min-cache", "64M", "--max-cache", "1M"],
     "--min-cache (64.00 MiB) must not exceed --max-cache (1.00 MiB)"),
    (["sweep", "--policy", "both"], "argument --policy: invalid choice: 'both'"),
    (["search", "--iterations", "0", "--anneal"], "argument --iterations: must be positive"),
    (["search", "--iterations", "50"], "--iterations applies only to annealing"),
    (["search", "--search-block-k", "128"], "--search-block-k applies only to annealing"),
    (["waves", "--n-max", "64"], "--n-max (64) must be at least the N step (128"),
    (["waves", "--n-step", "0"], "argument --n-step: must be positive"),
    (["waves", "--tiles-per-sm", "-2"], "argument --tiles-per-sm: must be positive"),
    (["chain", "--policies", "sequential,zigzag"], "--policies: policy must be one of"),
    (["chain", "--policies", "multirow:0"], "got 'multirow:0'"),
    (["chain", "--block-n", "96"], "block_n (96) must be a multiple of block_k (64)"),
    (["chain", "--hidden", "-4096"], "argument --hidden: must be positive"),
])
def test_bad_values_are_usage_errors(argv, message, capsys):
    line = _usage_error(capsys, ["dataflow", *argv])
    assert line.startswith(f"flashflow dataflow {argv[0]}: error: ")
    assert message in line


def test_bad_value_from_the_shell_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "flashflow.cli", "dataflow", "search",
                           "--cache=-64K"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "flashflow dataflow search: error: argument --cache: size must look like 4096, 256K "
        "or 50MiB, got '-64K'")


@pytest.mark.parametrize("command,defaults", [
    ("table", ["(default: 4096)", "(default: 50MiB)", "(default: lru)", "(default: 132)",
               "(default: 0.0)"]),
    ("sweep", ["(default: 1MiB)", "(default: 128MiB)"]),
    ("search", ["(default: 512)", "annealing iterations (default 2000)"]),
    ("waves", ["(default: 16384)", "(default: --block-n)"]),
    ("chain", ["(default: 14336)", "(default: sequential,rowblock,halfrow,multirow:2)"]),
])
def test_help_shows_defaults(command, defaults, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["dataflow", command, "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())   # undo the help's line wrapping
    for text in defaults:
        assert text in out
    assert "(default: None)" not in out


def test_help_descriptions_are_whole_sentences(capsys):
    for argv in (["dataflow", "--help"], ["viz", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        description = out.split("\n\n")[1]
        assert description.rstrip().endswith("."), description
    with pytest.raises(SystemExit):
        main(["viz", "--help"])
    assert "(default: 8765)" in " ".join(capsys.readouterr().out.split())


def test_long_commands_show_progress(monkeypatch, capsys):
    import flashflow.progress
    monkeypatch.setattr(flashflow.progress, "DELAY", 0.0)
    monkeypatch.setitem(sys.modules, "tqdm", None)          # the plain counter
    assert main(["dataflow", "chain", "--M", "256", "--hidden", "256", "--intermediate", "512",
                 "--sms", "2", "--cache", "128K", "--policies", "sequential,halfrow"]) == 0
    captured = capsys.readouterr()
    assert "simulating policies: 4/4" in captured.err
    assert "sequential" in captured.out and "simulating" not in captured.out
    assert main(["dataflow", "sweep", *SMALL, "--orders", "row_major,snake",
                 "--min-cache", "64K", "--max-cache", "256K"]) == 0
    assert "simulating orders: 6/6" in capsys.readouterr().err


def test_search_shows_elapsed_time(monkeypatch, capsys):
    import flashflow.progress
    from flashflow.dataflow import search
    monkeypatch.setattr(flashflow.progress, "DELAY", 0.0)
    monkeypatch.setattr(flashflow.progress, "TICK", 0.01)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    real = search.exhaustive

    def slow(*args, **kwargs):
        time.sleep(0.2)   # long enough for the ticking thread to draw
        return real(*args, **kwargs)
    monkeypatch.setattr(search, "exhaustive", slow)
    assert main(["dataflow", "search", "--M", "256", "--N", "256", "--K", "128", "--sms", "1",
                 "--cache", "64K"]) == 0
    captured = capsys.readouterr()
    assert "exhaustive search of a 2x2 grid: 0 s" in captured.err
    assert "best :" in captured.out


def test_quick_commands_print_no_progress(capsys):
    assert main(["dataflow", "table", *SMALL, "--orders", "row_major"]) == 0
    assert capsys.readouterr().err == ""


def test_progress_with_tqdm(monkeypatch, capsys):
    pytest.importorskip("tqdm", reason="tqdm is not installed (the plain counter is tested above)")
    import flashflow.progress
    monkeypatch.setattr(flashflow.progress, "DELAY", 0.0)
    assert main(["dataflow", "chain", "--M", "256", "--hidden", "256", "--intermediate", "512",
                 "--sms", "2", "--cache", "128K", "--policies", "sequential,halfrow"]) == 0
    assert "simulating policies" in capsys.readouterr().err
