"""The code examples of the README and the usage pages must run as written.

Every ```python block of a page runs, in order and in one namespace, in a fresh interpreter with
TRITON_INTERPRET=1 and no CUDA device visible: the CPU variant each example spells out for itself
(`device = "cuda" if torch.cuda.is_available() else "cpu"`, smaller sizes there). Blocks are
compiled with the page as their file name and their real line numbers, so a traceback points
into the page. docs/tutorial.md has its own test (tests/docs/test_tutorial.py); docs/mlp.md has
tests/docs/test_mlp_doc.py.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/decode.md", "docs/dataflow.md"]
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


def python_blocks(page: str) -> list[tuple[str, int, str]]:
    path = ROOT / page
    blocks = extract_blocks(path.read_text(encoding="utf-8"), page)
    for info, line, _ in blocks:
        if info.lower().startswith("py"):
            assert info == "python", f"{page}:{line - 1}: fence '```{info}' is not '```python'"
    return [(str(path), line, code) for info, line, code in blocks if info == "python"]


def test_extract_blocks():
    text = "x\n```python\na = 1\n```\n\n```text\nnot code\n```\n```python\nb = a\n```\n"
    assert extract_blocks(text) == [("python", 3, "a = 1\n"), ("text", 7, "not code\n"),
                                    ("python", 10, "b = a\n")]
    with pytest.raises(AssertionError, match="unclosed"):
        extract_blocks("```python\na = 1\n")


def test_a_failing_block_names_its_line(tmp_path):
    proc = run_blocks([("page.md", 7, "x = 1\nraise ValueError('boom')\n")], timeout=120)
    assert proc.returncode == 1
    assert 'File "page.md", line 8' in proc.stderr and "page.md:7" in proc.stderr


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run_on_the_cpu(page):
    blocks = python_blocks(page)
    assert blocks, f"{page} has no ```python example"
    proc = run_blocks(blocks)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert f"ran {len(blocks)} blocks" in proc.stdout


def test_decode_example_checks_the_merge():
    """The decode page's example carries its own check (merged halves == the whole)."""
    (_, _, code), = python_blocks("docs/decode.md")
    assert "merge_attention_states" in code and "assert (merged.float() - whole.float())" in code
    assert 'device = "cuda" if torch.cuda.is_available() else "cpu"' in code
