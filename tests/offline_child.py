"""Compiling for the H100 on a machine without one, from the tests: the test session runs with
TRITON_INTERPRET=1, which replaces the kernels at import time, so the compilation runs in a
child process without it (flashflow.bench.offline inside). Used by tests/bench/test_offline.py
and tests/ops/test_decode_layer.py."""
import json
import os
import subprocess
import sys

import pytest


def child_json(code: str, timeout: int = 600):
    """Run ``code`` in a child Python without TRITON_INTERPRET and return the JSON its last
    output line holds; skip where this Triton ships no cuobjdump, fail with the child's
    stderr otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode and "cuobjdump" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip("Triton's cuobjdump is not installed with this Triton")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
