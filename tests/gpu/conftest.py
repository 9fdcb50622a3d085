"""Helpers of the GPU tests: relative error against float64, NaN-filled outputs, fresh random
inputs (seed printed, so a failure can be replayed with FLASHFLOW_TEST_SEED), CUDA graphs."""
import os
import secrets

import pytest
import torch

from flashflow.reference.metrics import rel_l2

TOL = 1e-2   # ‖out − ref‖ / ‖ref‖ of bf16/fp16 outputs against float64


class Gpu:
    tol = TOL

    rel = staticmethod(rel_l2)   # ‖out − ref‖ / ‖ref‖ in float64

    @staticmethod
    def nan_like(t, dtype=None):
        """A contiguous buffer of ``t``'s shape filled with NaN: a tile never written shows."""
        return torch.full(t.shape, float("nan"), dtype=dtype or t.dtype, device=t.device)

    @staticmethod
    def capture(fn, steps: int = 1):
        """(graph, output of its last call) of ``steps`` calls of ``fn``, warmed up first."""
        from flashflow.bench.timing import capture_graph

        return capture_graph(fn, steps)

    def worst_over_replays(self, fn, x, ref_of, replays: int = 100, new_input_every: int = 25) -> float:
        """Capture ``fn()``, replay it ``replays`` times, drawing fresh values into its static
        input ``x`` every ``new_input_every`` replays; the worst relative error of the graph's
        output against ``ref_of(x)`` (float64), each replay checked."""
        graph, out = self.capture(fn)
        worst = 0.0
        for i in range(replays):
            if i % new_input_every == 0:
                x.copy_(torch.randn_like(x))
                ref = ref_of(x)
            graph.replay()
            torch.cuda.synchronize()
            worst = max(worst, self.rel(out, ref))
        return worst


@pytest.fixture
def gpu():
    return Gpu()


@pytest.fixture(autouse=True)
def fresh_seed():
    """Fresh random inputs every run; the seed is printed with a failure's captured output."""
    seed = int(os.environ.get("FLASHFLOW_TEST_SEED") or secrets.randbits(31))
    print(f"seed {seed} (replay: FLASHFLOW_TEST_SEED={seed})")
    torch.manual_seed(seed)
    yield seed
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@pytest.fixture(autouse=True, scope="session")
def _launch_keys_checked():
    """Every cached launch (flashflow.ops.common.Launcher) is checked against Triton's own
    specialisation of its arguments while the GPU tests run."""
    from flashflow.ops.common import check_launch_keys

    previous = check_launch_keys(True)
    yield
    check_launch_keys(previous)
