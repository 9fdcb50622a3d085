"""Tests marked ``gpu`` (tests/gpu/) run the kernels on a CUDA GPU; elsewhere they are collected
and skipped, so a CPU run still imports them."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    from flashflow.device import interpreting

    if torch.cuda.is_available() and not interpreting():
        return
    reason = ("needs a CUDA GPU" if not torch.cuda.is_available()
              else "runs the kernels on the GPU: unset TRITON_INTERPRET")
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)
