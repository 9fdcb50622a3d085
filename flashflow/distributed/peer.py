"""The Ulysses exchanges through memory every GPU of the group maps (PyTorch's symmetric memory),
instead of NCCL's all-to-all.

Each rank owns one buffer that every rank of the group can write (``rendezvous`` maps the ranks'
buffers into each other's address space over NVLink). :meth:`PeerUlysses.seq_to_heads` copies
each destination's head slice of this rank's q, k and v straight into that destination's buffer,
at this rank's slot of the sequence, then waits at a barrier of the group (a one-block kernel that
signals every peer and waits for every peer's signal): after it, the buffer holds the whole
sequence of this rank's heads, and attention reads it where it lies. :meth:`~PeerUlysses.heads_to_seq`
writes each destination's rows of the output into its buffer's head slot the same way.

Against the NCCL path (:func:`flashflow.distributed.exchange.seq_to_heads`) it saves the packing
copy before the all-to-all (the copies write the destination's layout directly) and NCCL's
kernels and their launch; the copies are element-wise kernels, so each byte crosses NVLink once.

Why one barrier per exchange is enough (no double buffering): a rank writes a peer's q/k/v slot
for call ``n + 1`` only after the barrier of call ``n``'s output exchange, which the peer reaches
after its attention of call ``n`` has read that slot; and it writes a peer's output slot for call
``n + 1`` only after the barrier of call ``n + 1``'s q/k/v exchange, which the peer reaches after
copying its output of call ``n`` out of the slot. The two methods must therefore alternate, every
rank in the same order, which :func:`flashflow.distributed.attention.context_attention` does.

The layouts are :func:`~flashflow.distributed.exchange.seq_to_heads`'s: the same views, the same
bits. Where the group is not NCCL over CUDA devices, or symmetric memory cannot be set up, callers
keep the NCCL / gloo path (:func:`peer_ulysses` returns None).
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

__all__ = ["PeerUlysses", "peer_ulysses", "EXCHANGES", "exchange_mode"]

# "auto": the peer path where it can run, else NCCL; "nccl": always NCCL's all-to-all (the
# environment variable FLASHFLOW_ULYSSES_EXCHANGE sets the default)
EXCHANGES = ("auto", "peer", "nccl")
# how long a barrier waits for a peer before it reports a hang (ms)
BARRIER_TIMEOUT_MS = 120_000
_ALIGN = 256   # bytes: each region of the buffer starts aligned
# the copies to other ranks: "engine" by the copy engines (cudaMemcpy2DAsync) on a side stream,
# beside the kernels that copy this rank's own slices; "kernel": element-wise copy kernels on the
# caller's stream, one after the other
REMOTE_COPIES = ("engine", "kernel")


def exchange_mode(mode: str | None = None) -> str:
    """The exchange a Ulysses call uses: ``mode`` if given, else ``FLASHFLOW_ULYSSES_EXCHANGE``,
    else ``"auto"``; anything else is refused with a ``ValueError``."""
    if mode is None:
        mode = os.environ.get("FLASHFLOW_ULYSSES_EXCHANGE", "auto")
        what = "FLASHFLOW_ULYSSES_EXCHANGE"
    else:
        what = "exchange"
    if not isinstance(mode, str) or mode not in EXCHANGES:
        raise ValueError(f"{what} must be one of {EXCHANGES}, got {mode!r}")
    return mode


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def push_seq_to_heads(tensors, slots, world: int, destinations=None, copy=_copy) -> None:
    """Write this rank's part of the q/k/v exchange: ``slots[g]`` is destination ``g``'s
    ``(seqlen_local, batch, width)`` slot for this rank (``width`` = the tensors' head slices side
    by side); each gets heads ``[g·h, (g+1)·h)`` of every tensor ``(batch, seqlen_local, heads_t,
    head_dim)``, or ``(batch, seqlen_local, world, h, head_dim)``: a head group's view.
    ``destinations``: which ``g`` (all by default); ``copy(dst, src)`` moves one
    ``(seqlen_local, h, head_dim)`` piece of one batch row. Pure copies: the same on any device
    (the CPU tests drive it with local slots)."""
    # a 5-D tensor is (batch, seqlen, world, heads per rank, head_dim) already: a head group's view
    tensors = [t if t.dim() == 5 else t.unflatten(2, (world, t.shape[2] // world)) for t in tensors]
    for g in range(world) if destinations is None else destinations:
        offset = 0
        for t in tensors:
            h, d = t.shape[3], t.shape[4]
            for b in range(t.shape[0]):
                copy(slots[g][:, b, offset:offset + h * d].unflatten(-1, (h, d)), t[b, :, g])
            offset += h * d


def push_heads_to_seq(x: torch.Tensor, slots, world: int, destinations=None, copy=_copy) -> None:
    """Write this rank's part of the output exchange: ``x`` ``(batch, world·seqlen_local, h,
    head_dim)``; ``slots[p]`` is destination ``p``'s ``(batch, seqlen_local, h, head_dim)`` view of
    this rank's heads in its output, which gets rows ``[p·S, (p+1)·S)`` of ``x``."""
    seqlen = x.shape[1] // world
    for p in range(world) if destinations is None else destinations:
        for b in range(x.shape[0]):
            copy(slots[p][b], x[b, p * seqlen:(p + 1) * seqlen])


class CopyEngine:
    """``cudaMemcpy2DAsync`` (through ctypes, from the CUDA runtime torch has loaded): a copy of
    rows with a pitch on each side, run by the GPU's copy engines, not its SMs, so it proceeds
    beside kernels. :meth:`copy` takes ``(rows, ...)`` views whose rows are each one contiguous run
    of bytes and falls back to ``Tensor.copy_`` (a kernel) for anything else."""

    def __init__(self):
        self.fn = None
        path = next((line.split()[-1] for line in _maps() if "libcudart.so" in line), None)
        if path is None:
            return
        import ctypes

        fn = ctypes.CDLL(path).cudaMemcpy2DAsync
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self.fn = fn

    @staticmethod
    def _rows(t: torch.Tensor):
        """(row pitch in bytes, bytes a row) of ``t`` ``(rows, ...)`` whose trailing dimensions are
        one contiguous run, else None."""
        run, expected = t.element_size(), 1
        for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
            if size != 1 and stride != expected:
                return None
            expected *= size
        return t.stride(0) * t.element_size(), expected * run

    @classmethod
    def pitches(cls, dst: torch.Tensor, src: torch.Tensor):
        """``(dst pitch, src pitch, bytes a row)`` when ``cudaMemcpy2DAsync`` can copy ``src`` into
        ``dst`` (same dtype and shape, rows of one contiguous run each, pitches at least a row:
        no stride-0 or overlapping rows), else None."""
        rows_d, rows_s = cls._rows(dst), cls._rows(src)
        if rows_d is None or rows_s is None or dst.dtype != src.dtype or dst.shape != src.shape:
            return None
        width = rows_d[1]
        if dst.shape[0] == 0 or width == 0 or rows_d[0] < width or rows_s[0] < width:
            return None
        return rows_d[0], rows_s[0], width

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        how = None if self.fn is None else self.pitches(dst, src)
        if how is None:
            dst.copy_(src)
            return
        err = self.fn(dst.data_ptr(), how[0], src.data_ptr(), how[1], how[2], dst.shape[0],
                      3, torch.cuda.current_stream(dst.device).cuda_stream)   # 3: cudaMemcpyDeviceToDevice
        if err != 0:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")


def _maps() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            return f.read().splitlines()
    except OSError:
        return []


def recv_views(recv: torch.Tensor, parts, batch: int):
    """The q/k/v views of a ``(world, seqlen_local, batch, width)`` receive buffer:
    ``(batch, world·seqlen_local, h_t, head_dim)`` each, as the NCCL path returns them."""
    world, seqlen, _, width = recv.shape
    joint = recv.view(world * seqlen, batch, width).transpose(0, 1)
    views, offset = [], 0
    for h, d in parts:
        views.append(joint[..., offset:offset + h * d].unflatten(-1, (h, d)))
        offset += h * d
    return views


class PeerUlysses:
    """One Ulysses group's exchanges through symmetric memory (see the module docstring). Made by
    :func:`peer_ulysses`, one per (group, device)."""

    def __init__(self, group, device: torch.device, strict: bool = False):
        self.group = group
        self.strict = strict     # a failed set-up raises (exchange="peer") instead of falling back
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = device
        self.nbytes = 0
        self.handle = None
        self._buffer = None
        self._recv = None   # (batch, seqlen, width, itemsize) of the last seq_to_heads, for heads_to_seq
        self.failed = False
        # how the copies to other ranks run (REMOTE_COPIES; FLASHFLOW_PEER_COPY sets the default)
        self.remote_copy = os.environ.get("FLASHFLOW_PEER_COPY", "engine")
        if self.remote_copy not in REMOTE_COPIES:
            raise ValueError(f"FLASHFLOW_PEER_COPY must be one of {REMOTE_COPIES}, got {self.remote_copy!r}")
        self._engine = self._side = None

    def ready_for(self, nbytes: int) -> bool:
        """Whether the buffer holds ``nbytes`` (growing it if need be; a growth is a collective of
        the group, so every rank asks for the same size at the same call). Under CUDA graph
        capture it cannot grow: False then, and the caller takes the NCCL path."""
        if nbytes <= self.nbytes:
            return True
        if torch.cuda.is_current_stream_capturing():
            return False
        from torch.distributed import _symmetric_memory as symm_mem
        if self.handle is not None:
            # the old buffer may still be written by a peer's queued copies: let all of them land
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)
        self.handle = self._buffer = None
        self.nbytes = 0
        size = _round_up(max(nbytes, 1 << 20), 1 << 20)
        try:
            self._buffer = symm_mem.empty(size, dtype=torch.uint8, device=self.device)
            self.handle = symm_mem.rendezvous(self._buffer, self.group)
        except Exception as err:   # noqa: BLE001 - any failure here means: use NCCL (on every rank alike)
            self.handle = self._buffer = None
            if self.strict:
                raise
            warnings.warn(f"flashflow: symmetric memory could not be set up ({err}); Ulysses exchanges go "
                          "through NCCL", stacklevel=4)
            self.failed = True
            return False
        self.nbytes = size
        return True

    def _view(self, rank: int, byte_offset: int, shape, dtype) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.handle.get_buffer(rank, tuple(shape), dtype, byte_offset // itemsize)

    @staticmethod
    def bytes_for(batch: int, seqlen: int, width: int, out_width: int, itemsize: int) -> int:
        """Bytes of the buffer for a call: the q/k/v receive region (``batch·seqlen·width``
        elements, ``width`` the whole group's: every rank's slot of the sequence) and the output
        region (``batch·seqlen·out_width``)."""
        return _round_up(batch * seqlen * width * itemsize, _ALIGN) + batch * seqlen * out_width * itemsize

    def seq_to_heads(self, tensors):
        """:func:`~flashflow.distributed.exchange.seq_to_heads` through the peers' buffers: views
        ``(batch, world·seqlen_local, heads_t/world, head_dim)`` of this rank's buffer, valid until
        the next :meth:`heads_to_seq` returns. None when the buffer cannot hold the call (then
        nothing was written and the caller exchanges through NCCL)."""
        world, rank = self.world, self.rank
        batch, seqlen = tensors[0].shape[:2]
        dtype = tensors[0].dtype
        parts = [(t.shape[2] // world, t.shape[3]) for t in tensors]
        width = sum(h * d for h, d in parts)   # per rank's head slice
        out_width = parts[0][0] * parts[0][1] * world
        itemsize = tensors[0].element_size()
        if not self.ready_for(self.bytes_for(batch, seqlen, width * world, out_width, itemsize)):
            return None
        slot_shape = (seqlen, batch, width)
        slot_bytes = seqlen * batch * width * itemsize
        slots = [self._view(g, rank * slot_bytes, slot_shape, dtype) for g in range(world)]
        self._push(lambda dest, copy: push_seq_to_heads(tensors, slots, world, dest, copy))
        self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        recv = self._view(rank, 0, (world, seqlen, batch, width), dtype)
        self._recv = (batch, seqlen, width, itemsize)
        return recv_views(recv, parts, batch)

    def _push(self, push) -> None:
        """``push(destinations, copy)`` for the other ranks and for this one: with the copy engines,
        the other ranks' copies on the side stream while this rank's run as kernels on the
        caller's stream, which then waits for the side stream."""
        others = [g for g in range(self.world) if g != self.rank]
        if self.remote_copy == "kernel":
            push(None, _copy)
            return
        if self._engine is None:
            self._engine, self._side = CopyEngine(), torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            push(others, self._engine.copy)
        push([self.rank], _copy)
        main.wait_stream(self._side)

    def attend(self, tensors, attend, groups: int = 1):
        """Ulysses attention through the peers' buffers, in ``groups`` groups of each rank's heads:
        ``attend(q, k, v)`` (views ``(batch, world·seqlen_local, h/groups, head_dim)``) -> the
        group's output ``(batch, world·seqlen_local, h/groups, head_dim)``; returns this rank's
        slice of the output, ``(batch, seqlen_local, heads, head_dim)``, or None when the buffer
        cannot hold the call (nothing was sent: the caller exchanges through NCCL).

        With the copy engines, every group's copies to the other ranks are queued on the side
        stream up front, so group ``i + 1``'s transfer runs under group ``i``'s attention, and
        group ``i``'s output goes back under group ``i + 1``'s attention: what is left exposed is
        the first group's transfer and the last group's output."""
        world, rank = self.world, self.rank
        batch, seqlen = tensors[0].shape[:2]
        dtype, itemsize = tensors[0].dtype, tensors[0].element_size()
        split = [t.unflatten(2, (world, groups, t.shape[2] // (world * groups))) for t in tensors]
        parts = [(t.shape[4], t.shape[5]) for t in split]
        width = sum(h * d for h, d in parts)   # one group of one rank's heads
        hq, d = parts[0]
        recv_bytes = _round_up(batch * seqlen * width * world * itemsize, _ALIGN)
        base = groups * recv_bytes
        if not self.ready_for(base + batch * seqlen * world * groups * hq * d * itemsize):
            return None
        slot_bytes = seqlen * batch * width * itemsize
        out_shape = (batch, seqlen, world, groups, hq, d)
        engine = self.remote_copy == "engine"
        if engine and self._engine is None:
            self._engine, self._side = CopyEngine(), torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        others = [g for g in range(world) if g != rank]
        slots = [[self._view(g, i * recv_bytes + rank * slot_bytes, (seqlen, batch, width), dtype)
                  for g in range(world)] for i in range(groups)]
        pieces = [[t[:, :, :, i] for t in split] for i in range(groups)]
        sent = []
        if engine:
            self._side.wait_stream(main)
            with torch.cuda.stream(self._side):
                for i in range(groups):
                    push_seq_to_heads(pieces[i], slots[i], world, others, self._engine.copy)
                    sent.append(torch.cuda.Event())
                    sent[-1].record(self._side)
        outs = []   # kept until the side stream is joined: its copies read them
        for i in range(groups):
            push_seq_to_heads(pieces[i], slots[i], world, [rank] if engine else None, _copy)
            if engine:
                main.wait_event(sent[i])
            self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
            recv = self._view(rank, i * recv_bytes, (world, seqlen, batch, width), dtype)
            out = attend(*recv_views(recv, parts, batch))
            outs.append(out)
            back = [self._view(p, base, out_shape, dtype)[:, :, rank, i] for p in range(world)]
            if engine:
                self._side.wait_stream(main)
                with torch.cuda.stream(self._side):
                    push_heads_to_seq(out, back, world, others, self._engine.copy)
            push_heads_to_seq(out, back, world, [rank] if engine else None, _copy)
        if engine:
            main.wait_stream(self._side)
        self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        del outs
        return self._view(rank, base, out_shape, dtype).reshape(batch, seqlen, world * groups * hq, d).clone()

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """:func:`~flashflow.distributed.exchange.heads_to_seq` through the peers' buffers, for the
        output of the attention over the views the last :meth:`seq_to_heads` returned: ``x``
        ``(batch, world·seqlen_local, h, head_dim)`` -> ``(batch, seqlen_local, world·h, head_dim)``,
        a new contiguous tensor."""
        world, rank = self.world, self.rank
        batch, total, h, d = x.shape
        seqlen = total // world
        if self._recv is None or self._recv[:2] != (batch, seqlen):
            raise RuntimeError("PeerUlysses.heads_to_seq must follow seq_to_heads of the same batch and sequence")
        _, _, width, itemsize = self._recv
        self._recv = None
        base = _round_up(batch * seqlen * width * world * itemsize, _ALIGN)
        out_shape = (batch, seqlen, world, h, d)
        slots = [self._view(p, base, out_shape, x.dtype)[:, :, rank] for p in range(world)]
        self._push(lambda dest, copy: push_heads_to_seq(x, slots, world, dest, copy))
        self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        return self._view(rank, base, out_shape, x.dtype).reshape(batch, seqlen, world * h, d).clone()


_PEERS: dict = {}


def peer_ulysses(group, device: torch.device, mode: str = "auto") -> PeerUlysses | None:
    """The :class:`PeerUlysses` of ``group`` on ``device``, or None where the NCCL path runs:
    ``mode`` ``"nccl"``, a CPU device, a group whose backend is not NCCL, or symmetric memory that
    failed to set up before (``"auto"`` warns once and falls back; ``"peer"`` raises instead)."""
    if mode == "nccl":
        return None
    backend = dist.get_backend(group)
    if device.type != "cuda" or backend != "nccl":
        if mode == "peer":
            raise ValueError(f"exchange='peer' needs CUDA tensors and an NCCL group, got {device.type} tensors "
                             f"and backend {backend!r}")
        return None
    group = group if group is not None else dist.group.WORLD
    key = (group.group_name, device.index)
    peer = _PEERS.get(key)
    if peer is None:
        peer = _PEERS[key] = PeerUlysses(group, device, strict=mode == "peer")
    peer.strict = mode == "peer"
    return None if peer.failed and not peer.strict else peer
