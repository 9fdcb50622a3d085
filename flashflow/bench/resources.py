"""Registers per thread, spills and shared memory of the kernels a launch ran on the GPU.

:func:`launched_resources` runs a callable that launches flashflow kernels, notes every launch
through Triton's launch hook, and reads each launched kernel back from the Triton JIT caches
of :mod:`flashflow.kernels`. Without a GPU, :mod:`flashflow.bench.offline` compiles for one
instead. ``flashflow info`` (:mod:`flashflow.bench.info`) reports both for every op.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable


@contextlib.contextmanager
def launches():
    """Collects (kernel name, CUfunction handle) of every Triton launch inside the block.

    The handle identifies the compiled kernel that really ran, whether it was compiled now or
    found in the cache, without depending on the kernel's constexpr names.
    """
    from triton import knobs

    seen: list[tuple[str, int]] = []

    def hook(metadata):
        data = metadata.get()
        seen.append((data["name"], data["function"]))

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # Triton 3.6: a chain of hooks, others may be installed
        chain.add(hook)
        try:
            yield seen
        finally:
            chain.remove(hook)
    else:  # older Triton: one hook slot
        knobs.runtime.launch_enter_hook = hook
        try:
            yield seen
        finally:
            knobs.runtime.launch_enter_hook = chain


def jit_functions():
    """Every @triton.jit function of the loaded flashflow.kernels modules (autotuners unwrapped)."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("flashflow.kernels.") or module is None:
            continue
        for obj in vars(module).values():
            for _ in range(3):  # Autotuner -> Heuristics -> JITFunction at most
                if hasattr(obj, "device_caches") or not hasattr(obj, "fn"):
                    break
                obj = obj.fn
            if hasattr(obj, "device_caches"):
                yield obj


def compiled_kernel(handle: int):
    """The compiled kernel of a launch's CUfunction handle, or None."""
    for fn in jit_functions():
        for kernel_cache, *_ in list(fn.device_caches.values()):
            for kernel in list(kernel_cache.values()):
                if getattr(kernel, "function", None) == handle:
                    return kernel
    return None


def launched_resources(launch: Callable[[], object]) -> list[dict]:
    """Run ``launch()`` on the current CUDA GPU; one dict per distinct kernel it launched, in
    launch order: ``kernel``, ``n_regs``, ``n_spills``, ``shared`` (bytes), ``num_warps``,
    ``num_stages`` (or ``error`` for a kernel not found in the caches)."""
    import torch

    with launches() as seen:
        launch()
        torch.cuda.synchronize()
    found = []
    for name, handle in dict.fromkeys(seen):
        kernel = compiled_kernel(handle)
        if kernel is None:
            found.append({"kernel": name, "error": "launched, but not found in the JIT caches of "
                                                   "flashflow.kernels"})
        else:
            found.append({"kernel": name, "n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                          "shared": kernel.metadata.shared, "num_warps": kernel.metadata.num_warps,
                          "num_stages": kernel.metadata.num_stages})
    return found
