"""What the launchers (attention prefill, backward and decode; the FFN) share: what they derive
alike from their inputs, and :class:`Launcher`, the launch path that does Triton's per-call work
once per launch key."""
from __future__ import annotations

import threading
from typing import Optional

import torch
from triton import knobs as _knobs
from triton.runtime import driver as _driver
from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor

from flashflow.device import capturing, interpreting, next_pow2

_HOOKS = _knobs.runtime.launch_enter_hook   # Proton's launch hooks: installed, they see every launch
_Parameter = torch.nn.Parameter


def head_dim_pad(head_dim: int) -> int:
    """head_dim padded to a power of two of at least 16 (the tensor cores' smallest k)."""
    return max(16, next_pow2(head_dim))


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where its last axis is not unit-stride: the kernels index the
    last axis (head_dim, hidden) with unit stride and take every other stride as it is."""
    return t if t.stride(-1) == 1 else t.contiguous()


def key_padding_for_kernels(key_padding_mask: Optional[torch.Tensor], mask_keys: Optional[int]):
    """``(mask, mask_keys)`` as the attention kernels read a key-padding mask: one flag per key
    with unit stride, covering ``mask_keys`` keys (its width when None; 0 without a mask)."""
    if key_padding_mask is None:
        return None, 0
    key_padding_mask = unit_last_stride(key_padding_mask)
    return key_padding_mask, key_padding_mask.shape[1] if mask_keys is None else mask_keys


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for inputs of ``dtype``: IEEE products for fp32 (not TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_options(dtype: torch.dtype) -> dict:
    """The kernels' ``DOT_PRECISION`` / ``DOT_FP32`` for inputs of ``dtype``: fp32 inputs get
    IEEE products (not TF32); bf16 under Triton's interpreter is converted to fp32 before its
    dots, as the interpreter's bf16 ``tl.dot`` is wrong (a GPU never takes that branch)."""
    return {"DOT_PRECISION": dot_precision(dtype),
            "DOT_FP32": dtype == torch.bfloat16 and interpreting()}


# --------------------------------------------------------------------------------------------
# launching: Triton's per-call work done once per launch key
# --------------------------------------------------------------------------------------------

_CHECK_KEYS = False


def check_launch_keys(on: bool) -> bool:
    """Make every cached launch also run Triton's own argument binding and compare its
    specialisation with the one its key was cached with (the GPU tests turn this on: a key that
    misses an argument's specialisation raises instead of launching the wrong binary). Returns
    the previous setting."""
    global _CHECK_KEYS
    previous, _CHECK_KEYS = _CHECK_KEYS, bool(on)
    return previous


class Launcher:
    """Launches of one ``@triton.jit`` kernel by a key its launcher computes.

    ``kernel[grid](*args, **constexprs)`` binds and specialises every argument on every call
    (whether each int is 1 or a multiple of 16, each pointer's alignment, the descriptors'
    blocks), hashes the result, and calls the launch hooks: tens of µs for a kernel of fifty
    arguments. The key a launcher passes here stands for all of that — the shapes, strides,
    dtypes, flags and config its arguments and constexprs derive from, and whether every
    pointer is 16-byte aligned — so a repeated key goes straight to the compiled kernel's
    launch (:func:`check_launch_keys` verifies this while the GPU tests run). A first key takes
    Triton's path (compiling if needed) and records what it launched; ``key=None`` always does.
    Triton's interpreter and an installed launch hook (Proton) always take Triton's path.
    """

    __slots__ = ("kernel", "_entries", "_params")
    MAX_KEYS = 4096   # per kernel; beyond it new keys take Triton's path (each still correct)

    def __init__(self, kernel):
        self.kernel = kernel
        self._entries: dict = {}
        self._params = None

    def __call__(self, key, grid, args: tuple, constexprs: dict) -> None:
        entry = self._entries.get(key) if key is not None else None
        if entry is not None and not _HOOKS.calls:
            run, function, metadata, tail, spec = entry
            if _CHECK_KEYS:
                self._check(key, spec, args, constexprs)
            device = _driver.active.get_current_device()
            run(grid[0], grid[1], grid[2], _driver.active.get_current_stream(device), function, metadata,
                None, None, None, *args, *tail)
            return
        compiled = self.kernel[grid](*args, **constexprs)
        if key is None or len(self._entries) >= self.MAX_KEYS or not _on_cuda(args[0]) \
                or not hasattr(compiled, "function"):
            return   # (CPU tensors: the interpreter, or compiling offline for a GPU not here)
        compiled._init_handles()
        if self._params is None:
            self._params = [(p.name, p.default) for p in self.kernel.params]
        # the parameters after the positional ones, in the kernel's order (constexprs, defaults)
        tail = tuple(constexprs.get(name, default) for name, default in self._params[len(args):])
        self._entries[key] = (compiled.run, compiled.function, compiled.packed_metadata, tail,
                              self._specialisation(args, constexprs))

    def _specialisation(self, args, constexprs):
        device = _driver.active.get_current_device()
        binder = self.kernel.device_caches[device][-1]
        _, spec, options = binder(*args, **constexprs)
        return str(spec), str(options)

    def _check(self, key, spec, args, constexprs):
        if self._specialisation(args, constexprs) != spec:
            raise RuntimeError(f"{self.kernel.__name__}: launch key {key!r} does not determine Triton's "
                               "specialisation of its arguments (a flashflow bug: please report it)")


def _on_cuda(arg) -> bool:
    """The launch's first argument (a tensor, or a host TMA descriptor of one) lives on a CUDA GPU."""
    return getattr(getattr(arg, "base", arg), "is_cuda", False)


def launch_by_arguments(launcher: Launcher, grid, args: tuple, constexprs: dict) -> None:
    """``launcher`` with a key made of the launch's own arguments: every tensor's shape,
    strides, dtype and device, every int and float by value (what Triton specialises on is a
    function of them), and the constexprs (:func:`call_key`). For the launchers whose ints are
    few enough that keying on their values costs less than Triton's binding (a few µs against
    tens); a call with a misaligned tensor or an argument of another kind takes Triton's path."""
    key = call_key(args)
    if key is not None and key[-1]:
        key = (key, tuple(constexprs.items()))
    else:
        key = None
    launcher(key, grid, args, constexprs)


def tensor_descriptor(base: torch.Tensor, shape, strides, block_shape):
    """Triton's host ``TensorDescriptor`` of ``base`` for a launch whose key already fixed (and
    checked, on its first call) the shape, strides, block and alignment: built without
    re-validating them."""
    desc = object.__new__(_TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.padding = base, shape, strides, block_shape, "zero"
    return desc


def aligned16(*tensors) -> bool:
    """Every tensor's address is a multiple of 16 bytes (what Triton specialises pointers on;
    None stands for no tensor)."""
    for t in tensors:
        if t is not None and t.data_ptr() % 16:
            return False
    return True


def call_key(args) -> Optional[tuple]:
    """A hashable key of a call's arguments for ops that check a call once per key: a tensor
    (or an ``nn.Parameter``, not a subclass of either) stands for its shape, strides, dtype,
    device and ``requires_grad``, a scalar for its value
    and type (``True``, ``1`` and ``1.0`` differ), a tuple of two ints (a window) for itself;
    the grad mode is part of it. The last element says whether every tensor's address is a
    multiple of 16 bytes (a :class:`Launcher` key needs that). None for an argument of any
    other kind (a list, a tensor subclass): such a call is checked in full. Values inside
    tensors are never part of a key (reading them would synchronise)."""
    key, aligned = [], True
    append = key.append
    for x in args:
        if x is None:
            append(None)
            continue
        c = x.__class__
        if c is torch.Tensor or c is _Parameter:   # a module's weight: a plain tensor to a kernel
            append((x.shape, x.stride(), x.dtype, x.get_device(), x.is_meta, x.requires_grad))
            if x.data_ptr() % 16:
                aligned = False
        elif c is bool or c is str:   # equal only to themselves among the kinds a key holds
            append(x)
        elif c is int or c is float:   # 1 == 1.0 == True: the type tells them apart
            append((c, x))
        elif c is tuple and len(x) == 2 and x[0].__class__ is int and x[1].__class__ is int:
            append(x)
        else:
            return None
    append(torch.is_grad_enabled())
    append(aligned)
    return tuple(key)


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape`` (what ``torch.empty(shape)`` gets)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def tma_strides_ok(stride, element_size: int) -> bool:
    """The copy engine's rule for a descriptor's strides: every stride but the last (which is 1)
    a multiple of 16 bytes."""
    return not any((st * element_size) % 16 for st in stride[:-1])


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Tensors a host TMA descriptor can describe: 16-byte aligned bases and strides."""
    return all(t.data_ptr() % 16 == 0 and tma_strides_ok(t.stride(), t.element_size()) for t in tensors)


def stream_key(device: torch.device):
    """The current stream of ``device`` as a cache key (0 off CUDA): per-stream caches (the
    implicit workspaces and plans) keep one entry per stream, whose calls are ordered."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


_SCRATCH: dict = {}   # (owner, device, stream, dtype) -> a buffer, its counters left zeroed by its kernels
_SCRATCH_LOCK = threading.Lock()


def stream_scratch(owner: str, words: int, device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A zeroed buffer of at least ``words`` elements of ``dtype`` for ``owner``'s kernels (the
    FFN's sync words, the attention forward's tile counter and its key pieces' rows), kept per
    (owner, device, stream, dtype) and grown on demand, so a call costs no allocation and no memset.
    Every kernel that takes words (int32) as counters leaves them zeroed, and calls on one stream
    are ordered. During graph capture a fresh zeroed buffer is made: a graph must not keep a
    pointer into a buffer this cache may replace."""
    device = torch.device(device)
    if capturing(device):
        return torch.zeros(words, dtype=dtype, device=device)
    key = (owner, str(device), stream_key(device), dtype)
    with _SCRATCH_LOCK:
        buf = _SCRATCH.get(key)
        if buf is None or buf.numel() < words:
            buf = _SCRATCH[key] = torch.zeros(max(words, 2 * (0 if buf is None else buf.numel())),
                                              dtype=dtype, device=device)
    return buf


def dispatch(op, impl, *args):
    """A registered custom op's call: ``op`` while torch.compile traces (one opaque graph node),
    ``impl`` directly otherwise, as the dispatcher's Python layers cost more host time than a
    small launch takes on the GPU. CUDA-graph capture works either way."""
    if torch.compiler.is_compiling():
        return op(*args)
    return impl(*args)


def op_or_direct(op, impl):
    """``(*args) -> dispatch(op, impl, *args)`` as a function of its own."""
    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        return impl(*args)
    return call


def rows_view(shape, stride):
    """2-D (rows, cols) view of a (b, s, h, d) tensor of ``shape`` and ``stride`` for a host-built
    TMA descriptor.

    Returns (row_b, row_h, col_h, n_rows, n_cols, row_stride) such that token s of (b, h) is row
    ``b·row_b + h·row_h + s`` at column ``h·col_h``; None if the strides allow neither layout.
    Token-major ``(b, s, h, d)`` storage (FlashAttention's) and head-major ``(b, h, s, d)``
    storage (SDPA's, seen through a transpose) both qualify.
    """
    b, s, h, d = shape
    sb, ss, sh, _ = stride
    if (b == 1 or sb == s * ss) and (h == 1 or sh >= d):
        return s, 0, sh, b * s, (h - 1) * sh + d, ss
    if (h == 1 or sh == s * ss) and (b == 1 or sb == h * sh):
        return h * s, s, 0, b * h * s, d, ss
    return None
