"""What the norm op tests share (tests/ops/test_norm.py, test_joint_norm_rope.py): the device,
tolerances, seeded inputs, complex RoPE frequencies, the error measure and NaN-poisoned
allocations."""
import pytest
import torch

from kernel_device import DEVICE

TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + offset).to(DEVICE, dtype)


def freqs_of(s, d, seed=5):
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(s, d // 2, generator=g) * 6.3
    return torch.polar(torch.ones_like(angles), angles).to(DEVICE)


def err(out, want):
    """Largest error relative to the reference's largest magnitude."""
    return ((out.double() - want).abs().max() / want.abs().max()).item()


def d64(*ts):
    return [None if t is None else t.double() for t in ts]


@pytest.fixture
def poisoned(monkeypatch):
    """Every tensor the ops allocate starts as NaN: an element a kernel fails to write shows."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
