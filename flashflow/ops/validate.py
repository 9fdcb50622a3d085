"""Input checks shared by every op: each raises a ``TypeError``/``ValueError`` that names the
argument, what it got and the form expected, before anything is launched."""
from __future__ import annotations

import math

import torch


def check_no_grad(op: str, **tensors) -> None:
    """flashflow's ops have no backward yet: an input that requires grad would come back detached
    and its gradient silently wrong, so it is refused."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{op}: {name} requires grad, but flashflow has no backward pass for {op} yet, so its "
                f"gradient would be wrong. Call it under torch.no_grad() / torch.inference_mode(), or "
                f"pass {name}.detach()."
            )


def check_scale(name: str, value, positive: bool = True) -> float:
    """A finite float (> 0 when ``positive``)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a float, got {value!r}") from None
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}, got {value}")
    return value
