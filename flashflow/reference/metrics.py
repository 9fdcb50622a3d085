"""Error measures of an output against its reference, in float64: what the tests assert and the
bench suites report (relative L2 and L1 error, cosine similarity)."""
import torch


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖₂ / ‖ref‖₂."""
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def rel_l1(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Σ|out − ref| / Σ|ref|."""
    ref = ref.double()
    return ((out.double() - ref).abs().sum() / ref.abs().sum()).item()


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors."""
    out, ref = out.double().flatten(), ref.double().flatten()
    return (out @ ref / (out.norm() * ref.norm())).item()
