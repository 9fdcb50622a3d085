"""docs/decode.md's example must keep running: its python block runs in a fresh interpreter with
TRITON_INTERPRET=1, on the CPU in fp16 (the interpreter's tl.dot is wrong on bf16) and with a
smaller cache; the block's own assert checks the merged halves against the whole."""
import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "decode.md"
SWAPS = {  # the doc's line -> the CPU run's; each must be in the doc as written
    'dev, dt = "cuda", torch.bfloat16': 'dev, dt = "cpu", torch.float16',
    "batch, heads, kv_heads, head_dim, capacity = 4, 32, 8, 128, 8192":
        "batch, heads, kv_heads, head_dim, capacity = 4, 32, 8, 128, 512",
    "[17, 1000, 4000, 8000]": "[17, 100, 300, 500]",
}


def test_decode_doc_example_runs():
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M)
    assert len(blocks) == 1, "docs/decode.md should hold one python example"
    code = blocks[0]
    for old, new in SWAPS.items():
        assert old in code, f"docs/decode.md's example no longer has {old!r}: update this test's SWAPS"
        code = code.replace(old, new)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
