"""Where the tests run.

Tests that launch kernels at small, odd sizes (tests/ops, most of tests/kernels) take the
``device`` fixture or carry the ``kernels`` marker: they run on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``), or on a CUDA GPU when one is present and the interpreter is
off, and are skipped elsewhere. So the split is "small shapes, anywhere the kernels run" here
against "large bf16/fp16 shapes on a GPU" in tests/gpu: tests marked ``gpu`` run there on a CUDA
GPU only; elsewhere they are collected and skipped, so a CPU run still imports them.
"""
import pytest
import torch

from flashflow.device import interpreting
from kernel_device import DEVICE


@pytest.fixture(scope="session")
def device() -> str:
    """The device of a test's tensors: "cuda" on a GPU run, "cpu" under Triton's interpreter."""
    return DEVICE


def pytest_collection_modifyitems(config, items):
    on_gpu = torch.cuda.is_available() and not interpreting()
    kernels_run = interpreting() or torch.cuda.is_available()
    gpu_skip = pytest.mark.skip(reason="needs a CUDA GPU" if not torch.cuda.is_available()
                                else "runs the kernels on the GPU: unset TRITON_INTERPRET")
    kernels_skip = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 or a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            if not on_gpu:
                item.add_marker(gpu_skip)
        elif not kernels_run and ("kernels" in item.keywords or "device" in getattr(item, "fixturenames", ())):
            item.add_marker(kernels_skip)
