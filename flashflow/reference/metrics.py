"""Error measures of an output against its reference, in float64: what the tests assert and the
bench suites report (relative L2 and L1 error, cosine similarity).

A reference of all zeros has no scale to be relative to: an output of all zeros is then exact
(error 0) and any other output infinitely wrong (error inf), never NaN, so an assertion
``error < tol`` reads the same for every reference."""
import math

import torch


def _relative(err: torch.Tensor, scale: torch.Tensor) -> float:
    err, scale = err.item(), scale.item()
    if scale == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / scale


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖₂ / ‖ref‖₂."""
    ref = ref.double()
    return _relative((out.double() - ref).norm(), ref.norm())


def rel_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Σ|out − ref| / Σ|ref|."""
    ref = ref.double()
    return _relative((out.double() - ref).abs().sum(), ref.abs().sum())


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors."""
    out, ref = out.double().flatten(), ref.double().flatten()
    return (out @ ref / (out.norm() * ref.norm())).item()
