"""Input checks shared by every op: each raises a ``TypeError``/``ValueError`` that names the
argument, what it got and the form expected, before anything is launched."""
from __future__ import annotations

import math
import operator

import torch

from flashflow.device import interpreting, on_gpu

# the dtypes every op takes
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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


def check_flag(name: str, value) -> bool:
    """A Python bool: ``"no"``, ``1`` or ``None`` for a flag are refused rather than read by their
    truth value."""
    if isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be True or False, got {value!r}")


def check_int(name: str, value, least: int | None = None) -> int:
    """An integer (a Python int, a NumPy integer, anything with ``__index__``; not a bool and not
    a float such as 1.5 or 2.0), at least ``least`` when given."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if least is not None and value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value}")
    return value


def check_scale(name: str, value, positive: bool = True) -> float:
    """A finite float (> 0 when ``positive``)."""
    try:
        if isinstance(value, (str, bytes, bool)):   # float() would take "0.1" and True
            raise TypeError
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a float, got {value!r}") from None
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}, got {value}")
    return value


def check_eps(eps) -> float:
    """A norm's epsilon: a finite float >= 0."""
    eps = check_scale("eps", eps, positive=False)
    if eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    return eps


def check_same_device(name: str, t: torch.Tensor, x: torch.Tensor, x_name: str) -> None:
    """``t`` on ``x``'s device."""
    if t.device != x.device:
        raise ValueError(f"{name} must be on {x_name}'s device {x.device}, got {t.device}")


def check_unit_last_stride(name: str, t: torch.Tensor) -> None:
    """Unit stride along the last axis, for the ops that write into or read a caller's buffer
    in place and cannot take a copy (the diffusion norms' outputs and inputs)."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dim, got strides {t.stride()}; "
                         f"pass {name}.contiguous()")


# --------------------------------------------------------------------------------------------
# attention inputs (prefill and decode)
# --------------------------------------------------------------------------------------------

MAX_HEAD_DIM = 256


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share an address (an ``expand``-ed or overlapping view):
    a kernel's writes to it would race. Conservative: strides whose spans interleave count too."""
    span = 0   # the furthest offset the smaller strides reach
    for stride, size in sorted((t.stride(i), t.size(i)) for i in range(t.dim()) if t.size(i) > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of the storage ``t``'s elements span (empty for no elements)."""
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    return start, start + t.element_size() * (1 + sum(s * (n - 1) for s, n in zip(t.stride(), t.shape)))


def share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges ``a`` and ``b`` span intersect (conservative: interleaved views
    of one buffer count, though no element is shared)."""
    (a0, a1), (b0, b1) = byte_range(a), byte_range(b)
    return a0 < b1 and b0 < a1 and a.device == b.device


def check_tensor(name: str, t, rank: int, form: str) -> None:
    """A float16/bfloat16/float32 tensor of ``rank`` dimensions laid out as ``form``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {form}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} {form}, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def check_runs_here(name: str, t: torch.Tensor) -> None:
    """CUDA tensors, or CPU tensors under Triton's interpreter (or standing for a GPU offline);
    never meta tensors (no data for a kernel to read)."""
    if t.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (shape only, no data); flashflow's kernels need "
                         "CUDA tensors (or CPU tensors under TRITON_INTERPRET=1)")
    if not on_gpu(t.device) and not interpreting():
        raise ValueError(
            f"flashflow runs on CUDA tensors; got {name} on {t.device}. "
            "Move the tensors to the GPU (or set TRITON_INTERPRET=1 to run Triton's CPU interpreter)."
        )


def check_head_dim(d: int) -> None:
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {MAX_HEAD_DIM}, got {d}")


def check_qkv(q, k, v, head_axis: int) -> None:
    """q, k, v of one dtype and device, one head_dim, and ``heads % kv_heads == 0`` along
    ``head_axis`` (GQA/MQA)."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    check_runs_here("q", q)
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"q, k, v must share head_dim, got {d}, {k.shape[-1]}, {v.shape[-1]}")
    check_head_dim(d)
    heads, kv_heads = q.shape[head_axis], k.shape[head_axis]
    if v.shape[head_axis] != kv_heads:
        raise ValueError(f"k and v must have the same number of heads, got {kv_heads} and {v.shape[head_axis]}")
    check_heads(heads, kv_heads, "heads of k/v")


def check_heads(heads: int, kv_heads: int, what: str = "kv_heads") -> None:
    """At least one head on each side, and a whole number of query heads per KV head (GQA/MQA)."""
    if heads < 1 or kv_heads < 1:
        raise ValueError(f"q and k/v need at least one head each, got {heads} heads of q and {kv_heads} {what}")
    if heads % kv_heads:
        raise ValueError(f"heads of q ({heads}) must be a multiple of {what} ({kv_heads}) (GQA/MQA)")


def window_bounds(causal, window_size) -> tuple[int, int]:
    """``(left, right)`` key bounds around each row's diagonal from ``causal`` and a
    ``window_size`` pair; -1 = unbounded on that side, causal = right bound 0."""
    form = f"window_size must be a pair of ints (left, right), got {window_size!r}"
    try:
        left, right = window_size
        left, right = operator.index(left), operator.index(right)   # 1.5 or 2.0 is not a window
    except (TypeError, ValueError):
        raise TypeError(form) from None
    if isinstance(window_size[0], bool) or isinstance(window_size[1], bool):
        raise TypeError(form)
    if left < -1 or right < -1:
        raise ValueError(f"window_size sides must be >= 0, or -1 for unbounded, got {window_size!r}")
    causal = check_flag("causal", causal)
    return left, 0 if causal else right


def check_softcap(softcap) -> float:
    """A finite float >= 0 (0 disables the softcap)."""
    softcap = check_scale("softcap", softcap, positive=False)
    if softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    return softcap


def softmax_scale_or_default(softmax_scale, head_dim: int, name: str = "softmax_scale") -> float:
    """``1/sqrt(head_dim)`` for None, else a finite float > 0."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return check_scale(name, softmax_scale)


def check_key_padding_mask(mask, batch: int, seqlen_k: int, device) -> torch.Tensor:
    """A ``(batch, P)`` boolean key-padding mask over the first ``P <= seqlen_k`` keys (True =
    attend), on ``device``; returned with unit stride along the keys, as the kernels read it
    (one flag per key, once per key block)."""
    form = f"a bool tensor (batch, P) = ({batch}, P) with P <= seqlen_k = {seqlen_k}"
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be {form}, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be {form}, got dtype {mask.dtype}")
    if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] > seqlen_k:
        raise ValueError(f"key_padding_mask must be {form}, got shape {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"key_padding_mask must be on {device}, got {mask.device}")
    return mask if mask.shape[1] <= 1 or mask.stride(1) == 1 else mask.contiguous()
