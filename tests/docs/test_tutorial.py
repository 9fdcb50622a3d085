"""docs/tutorial.md must keep running: its ```python blocks are executed in order, in one namespace.

Blocks fenced ```python gpu need a CUDA GPU and are skipped here. The blocks run in a subprocess
(a fresh interpreter, as a reader would have) with TRITON_INTERPRET=1, so the cell that launches the
Triton kernel runs too. Each block is compiled with the tutorial as its file name and its real line
numbers, so a traceback points into docs/tutorial.md.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial.md"
SCRIPT = ROOT / "scripts" / "measure_memory.py"

FENCE = re.compile(r"^ {0,3}```\s*(.*?)\s*$")
RUN, GPU = "python", "python gpu"

_RUNNER = r"""
import json, sys, traceback
blocks = json.load(sys.stdin)
namespace = {"__name__": "__tutorial__"}
for path, first_line, source in blocks:
    code = compile("\n" * (first_line - 1) + source, path, "exec")
    try:
        exec(code, namespace)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: the python block starting at {path}:{first_line}", file=sys.stderr)
        sys.exit(1)
print(f"ran {len(blocks)} blocks")
"""


def extract_blocks(text: str) -> list[tuple[str, int, str]]:
    """(info string, first code line (1-based), code) of every fenced block, in order."""
    blocks, info, start, body = [], None, 0, []
    for number, line in enumerate(text.split("\n"), start=1):
        fence = FENCE.match(line)
        if info is None:
            if fence:
                info, start, body = fence.group(1), number + 1, []
        elif fence and fence.group(1) == "":
            blocks.append((info, start, "\n".join(body) + "\n"))
            info = None
        else:
            body.append(line)
    assert info is None, f"unclosed ``` fence opened at docs/tutorial.md:{start - 1}"
    return blocks


def tutorial_blocks():
    return extract_blocks(TUTORIAL.read_text(encoding="utf-8"))


def test_fences_are_known():
    """A typo in a fence (```pyhton, ```python-gpu) would silently drop a block from this test."""
    for info, line, _ in tutorial_blocks():
        if info.lower().startswith("py"):
            assert info in (RUN, GPU), f"docs/tutorial.md:{line - 1}: fence '```{info}' is neither " \
                                       f"'```{RUN}' (runs on CPU) nor '```{GPU}' (skipped)"
    infos = [info for info, _, _ in tutorial_blocks()]
    assert infos.count(RUN) >= 10 and infos.count(GPU) >= 1


def test_memory_table_marker():
    lines = [line.strip() for line in TUTORIAL.read_text(encoding="utf-8").split("\n")]
    assert lines.count("<!-- MEMORY_TABLE -->") == 1


def test_tutorial_python_blocks_run():
    blocks = [(str(TUTORIAL), line, code) for info, line, code in tutorial_blocks() if info == RUN]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(blocks), text=True,
                          capture_output=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    assert f"ran {len(blocks)} blocks" in proc.stdout
    assert "skipping the kernel" not in proc.stdout  # the interpreter cell really ran the kernel


def test_measure_memory_without_gpu_exits_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--replace-in", str(TUTORIAL)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "needs a CUDA GPU" in proc.stdout


def _load_script():
    spec = importlib.util.spec_from_file_location("measure_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_measure_memory_table_and_replace():
    mm = _load_script()
    rows = [
        {"seqlen": 1024, "naive_peak_bytes": 32 * 2 ** 20, "flashflow_peak_bytes": 2 * 2 ** 20,
         "score_matrix_bytes": 16 * 2 ** 20},
        {"seqlen": 65536, "naive_peak_bytes": "OOM", "flashflow_peak_bytes": 128 * 2 ** 20,
         "score_matrix_bytes": 65536 ** 2 * 16},
        {"seqlen": 512, "naive_peak_bytes": 8 * 2 ** 20, "flashflow_peak_bytes": 5 * 2 ** 20,
         "score_matrix_bytes": 4 * 2 ** 20},
    ]
    table = mm.markdown_table(rows).splitlines()
    assert table[2] == "| 1024 | 32.0 | 2.0 | 16× | 16 |"
    assert table[3] == "| 65536 | OOM | 128.0 | — | 65536 |"
    assert table[4] == "| 512 | 8.0 | 5.0 | 1.6× | 4 |"
    table = "\n".join(table)
    assert mm.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"

    doc = "# t\n\nbefore\n\n<!-- MEMORY_TABLE -->\n\nafter\n"
    once = mm.replace_marker(doc, "caption\n\n" + table)
    assert "<!-- MEMORY_TABLE -->\ncaption\n\n| seqlen" in once and once.endswith("\n\nafter\n")
    assert once.count("<!-- MEMORY_TABLE -->") == 1 and once.count("<!-- /MEMORY_TABLE -->") == 1
    # re-running replaces the previous table instead of stacking a second one
    twice = mm.replace_marker(once, "other caption\n\n" + table)
    assert twice == once.replace("caption", "other caption")
