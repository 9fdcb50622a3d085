"""Runs the code blocks of a Markdown page as a reader would: every block in order, in one
namespace, in a fresh interpreter with TRITON_INTERPRET=1 and no CUDA device visible. Each block
is compiled with the page as its file name and its real line numbers, so a traceback points
into the page. Used by tests/docs/test_docs_examples.py and test_tutorial.py."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^ {0,3}```\s*(.*?)\s*$")

_RUNNER = r"""
import json, sys, traceback
blocks = json.load(sys.stdin)
namespace = {"__name__": "__doc_example__"}
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


def extract_blocks(text: str, name: str = "page") -> list[tuple[str, int, str]]:
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
    assert info is None, f"unclosed ``` fence opened at {name}:{start - 1}"
    return blocks


def run_blocks(blocks: list[tuple[str, int, str]], timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs (path, first line, code) blocks in one namespace, as the module docstring says."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(blocks), text=True,
                          capture_output=True, cwd=ROOT, env=env, timeout=timeout)
