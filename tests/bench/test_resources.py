"""flashflow.bench.resources: reading a launched kernel's resources back from Triton's JIT caches,
with the GPU's parts faked."""
from __future__ import annotations

import sys
import types

import torch

from flashflow.bench import resources as report


def test_launch_hook_sees_every_launch_and_is_removed_afterwards():
    from triton import knobs

    class LaunchMetadata:  # what Triton's launcher hands its hooks
        def get(self):
            return {"name": "attention_fwd_kernel", "function": 1234, "stream": 0}

    with report.launches() as seen:
        knobs.runtime.launch_enter_hook(LaunchMetadata())
    knobs.runtime.launch_enter_hook(LaunchMetadata())  # after the block: not recorded
    assert seen == [("attention_fwd_kernel", 1234)]


def test_compiled_kernel_is_found_by_its_function_handle(monkeypatch):
    compiled = types.SimpleNamespace(function=77, n_regs=168, n_spills=0)
    jit_fn = types.SimpleNamespace(device_caches={0: ({"key": compiled}, {}, None, None, None)})
    autotuned = types.SimpleNamespace(fn=types.SimpleNamespace(
        device_caches={0: ({"k": types.SimpleNamespace(function=78)}, {}, None, None, None)}))
    module = types.ModuleType("flashflow.kernels._fake")
    module.kernel, module.tuned, module.LOG2E = jit_fn, autotuned, 1.44
    monkeypatch.setitem(sys.modules, "flashflow.kernels._fake", module)

    assert report.compiled_kernel(77) is compiled
    assert report.compiled_kernel(78).function == 78
    assert report.compiled_kernel(79) is None


def test_launched_resources_reads_each_distinct_launch_once(monkeypatch):
    from triton import knobs

    class LaunchMetadata:
        def __init__(self, name, handle):
            self.data = {"name": name, "function": handle, "stream": 0}

        def get(self):
            return self.data

    metadata = types.SimpleNamespace(shared=1024, num_warps=8, num_stages=3)
    compiled = types.SimpleNamespace(function=91, n_regs=200, n_spills=2, metadata=metadata)
    module = types.ModuleType("flashflow.kernels._fake")
    module.kernel = types.SimpleNamespace(device_caches={0: ({"key": compiled}, {}, None, None, None)})
    monkeypatch.setitem(sys.modules, "flashflow.kernels._fake", module)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def launch():  # two launches of one kernel, then one of a kernel outside flashflow.kernels
        for name, handle in (("k", 91), ("k", 91), ("other", 92)):
            knobs.runtime.launch_enter_hook(LaunchMetadata(name, handle))

    found = report.launched_resources(launch)
    assert found[0] == {"kernel": "k", "n_regs": 200, "n_spills": 2, "shared": 1024, "num_warps": 8,
                        "num_stages": 3}
    assert found[1]["kernel"] == "other" and "not found" in found[1]["error"]
    assert len(found) == 2
