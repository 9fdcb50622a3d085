"""docs/tutorial.md must keep running: its ```python blocks are executed in order, in one namespace.

Blocks fenced ```python gpu need a CUDA GPU and are skipped here. The blocks run in a subprocess
(a fresh interpreter, as a reader would have) with TRITON_INTERPRET=1, so the cell that launches the
Triton kernel runs too. Each block is compiled with the tutorial as its file name and its real line
numbers, so a traceback points into docs/tutorial.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from doc_blocks import ROOT, _RUNNER, extract_blocks   # tests/docs/doc_blocks.py

TUTORIAL = ROOT / "docs" / "tutorial.md"

RUN, GPU = "python", "python gpu"


def tutorial_blocks():
    return extract_blocks(TUTORIAL.read_text(encoding="utf-8"), "docs/tutorial.md")


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


def test_memory_suite_without_gpu_is_a_one_line_error():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "flashflow.cli", "bench", "--suite", "memory"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert "--suite memory needs a CUDA GPU" in proc.stderr


def test_memory_table_and_replace():
    from flashflow.bench import memory as mm
    from flashflow.bench import runner, tables

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
    assert runner.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"

    doc = "# t\n\nbefore\n\n<!-- MEMORY_TABLE -->\n\nafter\n"
    once = tables.replace_block(doc, "MEMORY_TABLE", "caption\n\n" + table)
    assert "<!-- MEMORY_TABLE -->\ncaption\n\n| seqlen" in once and once.endswith("\n\nafter\n")
    assert once.count("<!-- MEMORY_TABLE -->") == 1 and once.count("<!-- /MEMORY_TABLE -->") == 1
    # re-running replaces the previous table instead of stacking a second one
    twice = tables.replace_block(once, "MEMORY_TABLE", "other caption\n\n" + table)
    assert twice == once.replace("caption", "other caption")
