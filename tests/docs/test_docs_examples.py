"""The code examples of the README and the usage pages must run as written.

Every ```python block of a page runs, in order and in one namespace, in a fresh interpreter with
TRITON_INTERPRET=1 and no CUDA device visible: the CPU variant each example spells out for itself
(`device = "cuda" if torch.cuda.is_available() else "cpu"`, smaller sizes there). Blocks are
compiled with the page as their file name and their real line numbers, so a traceback points
into the page. docs/tutorial.md has its own test (tests/docs/test_tutorial.py); docs/mlp.md has
tests/docs/test_mlp_doc.py.
"""
from __future__ import annotations

import pytest
from doc_blocks import ROOT, extract_blocks, run_blocks   # tests/docs/doc_blocks.py

PAGES = ["README.md", "docs/decode.md", "docs/decode_layer.md", "docs/dataflow.md", "docs/diffusion.md", "docs/fp8.md", "docs/train.md"]


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
