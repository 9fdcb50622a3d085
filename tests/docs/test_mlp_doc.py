"""docs/mlp.md's examples run as written: every ```python block in order, in one namespace, in a
fresh interpreter with TRITON_INTERPRET=1 and no CUDA device (the CPU variant the page spells
out: small shapes, float16). The blocks carry their own checks against torch's layers and the
config table."""
from __future__ import annotations

from doc_blocks import ROOT, extract_blocks, run_blocks   # tests/docs/doc_blocks.py

PAGE = ROOT / "docs" / "mlp.md"


def _blocks():
    blocks = extract_blocks(PAGE.read_text(encoding="utf-8"), "docs/mlp.md")
    for info, line, _ in blocks:
        if info.lower().startswith("py"):
            assert info == "python", f"docs/mlp.md:{line - 1}: fence '```{info}' is not '```python'"
    return [(str(PAGE), line, code) for info, line, code in blocks if info == "python"]


def test_mlp_page_examples_run_on_the_cpu():
    blocks = _blocks()
    assert len(blocks) >= 4
    proc = run_blocks(blocks)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert f"ran {len(blocks)} blocks" in proc.stdout


def test_mlp_page_examples_check_their_results():
    code = "".join(c for _, _, c in _blocks())
    assert 'device = "cuda" if torch.cuda.is_available() else "cpu"' in code
    assert "assert (out.float() - expected.float()).norm()" in code          # against nn.Linear layers
    assert "tuning.auto_plan(" in code and "issue_order(" in code


def test_mlp_page_speaks_of_the_product():
    text = PAGE.read_text(encoding="utf-8").lower()
    for phrase in ("not yet timed", "not yet measured", "session", "was lent", "no device"):
        assert phrase not in text, phrase
