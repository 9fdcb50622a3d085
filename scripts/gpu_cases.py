"""Shared bookkeeping of the GPU check scripts: relative error, PASS/FAIL lines, the JSON file."""
import json
import math
import sys
import time

import torch
import triton


def worst_over_graph_replays(fn, x, ref_of, replays: int = 100, new_input_every: int = 25) -> float:
    """Capture ``fn()`` in a CUDA graph (after a warm-up call on a side stream), replay it
    ``replays`` times, drawing fresh values into the static input ``x`` every
    ``new_input_every`` replays; the worst relative error of the graph's output against
    ``ref_of(x)`` (float64)."""
    from flashflow.bench.decode import capture_graph

    g, out = capture_graph(fn)
    worst = 0.0
    for i in range(replays):
        if i % new_input_every == 0:
            x.copy_(torch.randn_like(x))
            ref = ref_of(x)
        g.replay()
        torch.cuda.synchronize()
        worst = max(worst, Cases.rel(out, ref))
    del g
    return worst


class Cases:
    def __init__(self, tol: float):
        self.tol, self.results = tol, []

    @staticmethod
    def rel(out, ref) -> float:
        """‖out − ref‖ / ‖ref‖ in float64."""
        return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()

    def record(self, name, err, ok=None):
        ok = (err <= self.tol and math.isfinite(err)) if ok is None else ok
        self.results.append({"case": name, "rel_err": err, "ok": ok})
        print(f"{'PASS' if ok else 'FAIL'} {name}: {err:.2e}", flush=True)

    def finish(self, what: str, json_path=None):
        """Print the count, write the JSON (device, versions, date, cases), exit 1 on any failure."""
        n_fail = sum(not r["ok"] for r in self.results)
        print(f"\n{len(self.results) - n_fail}/{len(self.results)} {what} pass")
        if json_path:
            with open(json_path, "w") as fh:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "triton": triton.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "tolerance": self.tol, "cases": self.results}, fh, indent=1)
        sys.exit(1 if n_fail else 0)
