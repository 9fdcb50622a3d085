"""Compile flashflow's kernels for a GPU that is not there: registers, spills and shared memory
per config, on a machine with no GPU (CI, a laptop), from the same launchers that run them.

Triton compiles for a target named by its driver; :func:`offline_target` installs a stand-in
driver that names the target (default sm90, the H100) and makes every ``kernel[grid](...)``
launch a *warm-up*: the kernel is specialised on the real arguments (CPU tensors: only their
dtypes, shapes and alignment matter) and compiled down to a cubin by ptxas, but nothing runs.
The cubin's resource usage is read with ``cuobjdump`` (shipped with Triton).

What differs from a GPU run: the launchers see CPU tensors. :func:`pretend_cuda_capability`
makes flashflow's ops take them for a GPU of a given capability and SM count (configs, TMA,
the FFN's proxy fence and PDL); a launcher outside flashflow that reads ``tensor.is_cuda``
itself can be corrected with :func:`offline_target`'s ``overrides``.
The numbers are ptxas's: what the GPU would load, byte for byte, for that specialisation.
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

SM90_SHARED_LIMIT = 232448   # bytes of shared memory a CTA may opt into on the H100 (227 KB)


@dataclass(frozen=True)
class Resources:
    name: str
    registers: int           # per thread
    spill_bytes: int         # local memory per thread (spills and stack), from the cubin
    shared: int              # bytes, static + Triton's dynamic allocation
    num_warps: int
    num_stages: int

    def fits(self, limit: int = SM90_SHARED_LIMIT) -> bool:
        return self.shared <= limit

    def row(self) -> str:
        return (f"{self.name}: {self.registers} regs, {self.spill_bytes} B local, "
                f"{self.shared / 1024:.1f} KB shared, {self.num_warps} warps, {self.num_stages} stages"
                + ("" if self.fits() else "  ** over the 227 KB limit **"))


class _StandInDriver:
    """The part of Triton's driver interface that compiling (not launching) asks for."""

    def __init__(self, capability: int, warp_size: int = 32):
        from triton.backends.compiler import GPUTarget

        self._target = GPUTarget("cuda", capability, warp_size)

    def get_current_target(self):
        return self._target

    def get_current_device(self):
        # Triton keeps a compile cache (with its target) per device key: one key per target, so
        # a later offline_target for another capability, or a real GPU's device 0, never reuses
        # kernels compiled for this one
        return ("offline", self._target.arch)

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self):
        return True


def _tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.access(path, os.X_OK) else name


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, local bytes per thread) of a one-kernel cubin, from cuobjdump: its
    ``LOCAL`` plus its ``STACK`` (ptxas puts a kernel's spills in its stack frame, and the
    driver's local size, which a GPU run reports, counts both)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+).*?LOCAL:(\d+)", text)
    if m is None:
        raise RuntimeError(f"no resource line in cuobjdump's output:\n{text}")
    return int(m.group(1)), int(m.group(2)) + int(m.group(3))


def ptxas_notes(kernel, capability: int = 90) -> list[str]:
    """ptxas's notes on a compiled kernel's PTX (``-v``, the target Triton compiled for), which
    Triton does not keep: its performance notes among them, such as C7510-C7520, "wgmma.mma_async
    instructions are serialized" (every WGMMA of the kernel waited on as soon as issued)."""
    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        proc = subprocess.run([_tool("ptxas"), "-lineinfo", "-v", f"--gpu-name={arch}", src, "-o",
                               os.path.join(d, "k.cubin")], capture_output=True, text=True, check=True)
    return [line.strip() for line in proc.stderr.splitlines() if line.strip()]


def wgmma_serialized(kernel, capability: int = 90) -> list[str]:
    """The notes in which ptxas says it serialised a kernel's WGMMAs (empty: none)."""
    return [n for n in ptxas_notes(kernel, capability) if "wgmma" in n and "serialized" in n]


def resources_of(kernel, name: str = "") -> Resources:
    """Resources of a compiled kernel (what ``kernel[grid](...)`` returns under
    :func:`offline_target`)."""
    regs, local = cubin_resources(kernel.asm["cubin"])
    md = kernel.metadata
    return Resources(name or md.name, regs, local, md.shared, md.num_warps, md.num_stages)


@contextlib.contextmanager
def offline_target(capability: int = 90, overrides: Optional[dict] = None) -> Iterator[list]:
    """Within the block, launches compile for ``sm_{capability}`` and do not run; the compiled
    kernels are appended to the yielded list in launch order. ``overrides``: launch keywords
    to replace where a launch passes them (what a launcher derives from ``tensor.is_cuda``,
    e.g. a third-party launcher's). Not with TRITON_INTERPRET=1."""
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction, KernelInterface

    if knobs.runtime.interpret:
        raise RuntimeError("offline compilation needs TRITON_INTERPRET unset (the interpreter replaces "
                           "the kernels)")
    compiled: list = []
    stand_in = _StandInDriver(capability)
    real_getitem = KernelInterface.__getitem__

    def warmup_getitem(self, grid):
        if not isinstance(self, JITFunction):
            return real_getitem(self, grid)

        def launch(*args, **kwargs):
            kwargs.update({k: v for k, v in (overrides or {}).items() if k in kwargs})
            kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
            compiled.append(kernel)
            return kernel
        return launch

    previous = driver._active   # None on a machine with no GPU driver (reset_active would raise)
    driver.set_active(stand_in)
    KernelInterface.__getitem__ = warmup_getitem
    try:
        yield compiled
    finally:
        KernelInterface.__getitem__ = real_getitem
        driver._active = previous


@contextlib.contextmanager
def pretend_cuda_capability(capability: tuple[int, int] = (9, 0), sm_count: int = 132) -> Iterator[None]:
    """Make flashflow's ops take CPU tensors for a GPU of ``capability``: its family's configs
    (``flashflow.device.gpu_family``), TMA descriptors where it has them, and no "runs on CUDA
    tensors" refusal; ``sm_count`` (the H100's 132 by default) where a config depends on it.
    flashflow's launchers then also choose the GPU's launch options (proxy fence, PDL,
    ``maxnreg``)."""
    from flashflow import device

    if device.interpreting():
        raise RuntimeError("pretend_cuda_capability is for offline compilation: unset TRITON_INTERPRET")
    # the ops ask flashflow.device (gpu_family, capability, num_sms, on_gpu): setting the two
    # values is all it takes
    saved = device.set_offline(capability, sm_count)
    try:
        yield
    finally:
        device.set_offline(*saved)


def compile_offline(launch: Callable[[], object], capability: int = 90, name: Optional[str] = None,
                    overrides: Optional[dict] = None) -> list[Resources]:
    """Run ``launch()`` (a flashflow launcher call on CPU tensors) under :func:`offline_target`
    and return the resources of every kernel it launched."""
    with offline_target(capability, overrides) as compiled:
        launch()
    return [resources_of(k, name or "") for k in compiled if k is not None]
