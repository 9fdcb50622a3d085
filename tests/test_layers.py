"""The layer rules of docs/DESIGN.md, read off the imports: data flows top to bottom, never back
up. A float64 oracle that imported the kernels it checks would agree with their bugs; a bench
that launched kernels itself would time something no user calls."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "flashflow"

# layer (first folder under flashflow/) -> packages it never imports
NEVER = {
    "kernels": ("ops", "reference", "bench", "tuning", "integrations", "dataflow", "distributed"),
    "tuning": ("ops", "reference", "bench", "integrations", "distributed"),
    "ops": ("reference", "bench", "integrations", "distributed"),
    "reference": ("kernels", "ops", "tuning", "bench", "integrations", "distributed"),
    "bench": ("kernels",),
    "distributed": ("kernels", "reference", "bench", "integrations"),
    "integrations": ("kernels", "reference", "bench"),
    "dataflow": ("ops", "reference", "bench", "integrations", "distributed"),
}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "flashflow":
                yield from (f"flashflow.{a.name}" for a in node.names)
            else:
                yield node.module


@pytest.mark.parametrize("layer", sorted(NEVER))
def test_imports_go_down_only(layer):
    broken = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for module in _imports(path):
            parts = module.split(".")
            if parts[0] == "flashflow" and len(parts) > 1 and parts[1] in NEVER[layer]:
                broken.append(f"{path.relative_to(ROOT.parent)} imports {module}")
    assert not broken, "\n".join(broken)
