"""The Ulysses exchanges through memory every GPU of the group maps (PyTorch's symmetric memory),
instead of NCCL's all-to-all.

Each rank owns one buffer that every rank of the group can write (``rendezvous`` maps the ranks'
buffers into each other's address space over NVLink). :meth:`PeerUlysses.attend` copies each
destination's head slice of this rank's q, k and v straight into that destination's buffer, at
this rank's slot of the sequence, then waits at a barrier of the group (a one-block kernel that
signals every peer and waits for every peer's signal): after it, the buffer holds the whole
sequence of this rank's heads, and attention reads it where it lies. The attention's output goes
back the same way, into each destination's output region, and a second barrier ends the call.

Against the NCCL path (:func:`flashflow.distributed.exchange.seq_to_heads`) it saves the packing
copy before the all-to-all and NCCL's kernels; the copies to other GPUs run on the copy engines
(``REMOTE_COPIES``), beside this rank's own copies and, with several head groups, beside the
previous group's attention.

Why one barrier per exchange is enough (no double buffering): a rank writes a peer's q/k/v slot
for call ``n + 1`` only after the barrier that ends call ``n``, which the peer reaches after its
attention of call ``n`` has read that slot; and it writes a peer's output region for call
``n + 1`` only after a q/k/v barrier of call ``n + 1``, which the peer reaches after copying its
output of call ``n`` out of the region. Every rank must make the same calls in the same order,
each rank's calls on one CUDA stream, as every rank of a Ulysses group running a model does.

:meth:`PeerUlysses.attend_fp8` sends q, k and v in 8 bits: the statistics and quantize kernels,
and the attention kernel for the other ranks' queries, store into the peers' buffers themselves
(no copy runs), with a barrier after each of the three; the ordering argument above holds for
each region (statistics, inputs, output).

The views attention gets are :func:`~flashflow.distributed.exchange.seq_to_heads`'s: the same
layout, the same bits. Where the group is not NCCL over CUDA devices, or symmetric memory cannot
be set up, callers keep the NCCL / gloo path (:func:`peer_ulysses` returns None).
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from flashflow.ops.attention_fp8 import UlyssesFp8Plan
from flashflow.ops.common import aligned16, unit_last_stride

__all__ = ["PeerUlysses", "peer_ulysses", "EXCHANGES", "exchange_mode"]

# "auto": the peer path where it can run, else NCCL; "nccl": always NCCL's all-to-all (the
# environment variable FLASHFLOW_ULYSSES_EXCHANGE sets the default)
EXCHANGES = ("auto", "peer", "nccl")
# how long a barrier waits for a peer before it reports a hang (ms)
BARRIER_TIMEOUT_MS = 120_000
_ALIGN = 256   # bytes: each region of the buffer starts aligned
# the copies to other ranks: "engine" by the copy engines (cudaMemcpy2DAsync, rows of the caller's
# tensors where they lie) on a side stream, beside the kernels that copy this rank's own slices;
# "kernel": element-wise copy kernels on the caller's stream writing straight into the other GPUs'
# memory. (Packing the other ranks' slices locally first, then one copy-engine run a destination,
# measured slower than "engine": 0.235 against 0.191 ms an Edit block's exchanges, 2 × H200.)
# "auto": "engine" while a CUDA graph is being captured (the GPU's time: 0.189 against 0.217 ms an
# Edit block's exchanges), "kernel" otherwise (the host's: issued eagerly, a block's exchanges take
# 0.443 ms with kernels against 0.858 with the copy engines' calls and events; 2 × H200).
REMOTE_COPIES = ("auto", "engine", "kernel")
DEFAULT_REMOTE_COPY = "auto"


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


def _wide(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` seen as 8-byte elements (its last dimension unit-stride, every stride and its offset
    whole 8-byte steps), else None: a strided copy then moves 8 bytes a load, not 2."""
    if t.element_size() >= 8 or t.dim() == 0 or t.stride(-1) != 1:
        return None
    try:
        return t.view(torch.int64)
    except RuntimeError:
        return None


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, through 8-byte views where both sides allow it (same dtype)."""
    if dst.dtype == src.dtype and dst.shape == src.shape:
        wide_dst, wide_src = _wide(dst), _wide(src)
        if wide_dst is not None and wide_src is not None and wide_dst.shape == wide_src.shape:
            wide_dst.copy_(wide_src)
            return
    dst.copy_(src)


def push_seq_to_heads(tensors, slots, world: int, destinations=None, copy=_copy) -> None:
    """Write this rank's part of the q/k/v exchange: ``slots[g][j]`` is destination ``g``'s
    ``(batch, seqlen_local, h_j, head_dim)`` slot of tensor ``j`` for this rank, which gets heads
    ``[g·h_j, (g+1)·h_j)`` of ``tensors[j]`` ``(batch, seqlen_local, heads_j, head_dim)`` (or of its
    ``(batch, seqlen_local, world, h_j, head_dim)`` view: a head group's). ``destinations``: which
    ``g`` (all by default); ``copy(dst, src)`` moves one batch row's ``(seqlen_local, h_j,
    head_dim)`` piece. Pure copies: the same on any device (the CPU tests drive it with local
    slots)."""
    # a 5-D tensor is (batch, seqlen, world, heads per rank, head_dim) already: a head group's view
    tensors = [t if t.dim() == 5 else t.unflatten(2, (world, t.shape[2] // world)) for t in tensors]
    for g in range(world) if destinations is None else destinations:
        for j, t in enumerate(tensors):
            for b in range(t.shape[0]):
                copy(slots[g][j][b], t[b, :, g])


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
        if dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape and dst.numel():
            dst, src = dst.view(1, -1), src.view(1, -1)   # one run of bytes
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


def recv_views(regions):
    """The q/k/v attention reads from its receive regions ``(batch, world, seqlen_local, h_j,
    head_dim)`` (source rank ``p``'s slot at ``[:, p]``): ``(batch, world·seqlen_local, h_j,
    head_dim)`` each, contiguous, the sequence in rank order (the values NCCL's
    :func:`~flashflow.distributed.exchange.seq_to_heads` returns)."""
    return [r.flatten(1, 2) for r in regions]


def out_from_region(region: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's output from its output region ``(world, groups, batch, seqlen_local, h,
    head_dim)`` (source rank ``p``'s group ``i`` at ``[p, i]``): ``(batch, seqlen_local, world·groups·h,
    head_dim)``, heads in rank order then group order, a new contiguous tensor (or ``out``)."""
    world, groups, batch, seqlen, h, d = region.shape
    if out is None:
        out = torch.empty((batch, seqlen, world * groups * h, d), dtype=region.dtype, device=region.device)
    _copy(out.view(batch, seqlen, world, groups, h, d), region.permute(2, 3, 0, 1, 4, 5))
    return out


class PeerUlysses:
    """One Ulysses group's exchanges through symmetric memory (see the module docstring). Made by
    :func:`peer_ulysses`, one per (group, device). Its buffer holds, per head group, a receive
    region ``(batch, world, seqlen_local, h_j, head_dim)`` for each of q, k, v (rank ``p``'s slot
    at ``[:, p]``: attention reads each as one contiguous tensor), then one output region
    ``(world, groups, batch, seqlen_local, h, head_dim)``."""

    def __init__(self, group, device: torch.device):
        self.group = group
        self.strict = False      # a failed set-up raises (exchange="peer") instead of falling back
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = device
        self.nbytes = 0
        self.handle = None
        self._buffer = None
        self.failed = False
        # how the copies to other ranks run, one of REMOTE_COPIES; None: FLASHFLOW_PEER_COPY, else
        # DEFAULT_REMOTE_COPY (read at each call)
        self.remote_copy = None
        self._engine = self._side = None
        self._cached = {}   # layout -> views of the buffers (emptied when the buffer is replaced)
        self._fp8_plans = {}   # call key -> UlyssesFp8Plan
        self._last_layout = None

    def copy_mode(self) -> str:
        """The copies' mode for the next call (see ``remote_copy``); a wrong name is a ValueError."""
        mode, what = self.remote_copy, "remote_copy"
        if mode is None:
            mode, what = os.environ.get("FLASHFLOW_PEER_COPY", DEFAULT_REMOTE_COPY), "FLASHFLOW_PEER_COPY"
        if mode not in REMOTE_COPIES:
            raise ValueError(f"{what} must be one of {REMOTE_COPIES}, got {mode!r}")
        return mode

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
        self._cached.clear()
        self._last_layout = None
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
        return self.handle.get_buffer(rank, tuple(shape), dtype, byte_offset // dtype.itemsize)

    @staticmethod
    def layout(batch: int, seqlen: int, parts, itemsize: int, world: int, groups: int):
        """``(offsets of one group's receive regions, bytes of a group's, offset of the output
        region, bytes in all)``: ``parts`` the ``(heads, head_dim)`` of one group of one rank's
        q, k, v (the output takes q's)."""
        offsets, at = [], 0
        for h, d in parts:
            offsets.append(at)
            at += _round_up(batch * world * seqlen * h * d * itemsize, _ALIGN)
        base = groups * at
        h, d = parts[0]
        return offsets, at, base, base + world * groups * batch * seqlen * h * d * itemsize

    def _views(self, batch, seqlen, parts, dtype, groups, offsets, group_bytes, base):
        """``(recv, slots, outs)`` of a call's layout, made once per layout (the host's time):
        ``recv[i]`` the q/k/v attention reads for group ``i``; ``slots[i][g][j]`` rank ``g``'s
        slot of tensor ``j`` for this rank; ``outs[p]`` rank ``p``'s output region."""
        key = (batch, seqlen, parts, dtype, groups, self.nbytes)
        views = self._cached.get(key)
        if views is None:
            world, rank = self.world, self.rank

            def regions(g, i):   # rank g's receive regions of group i, one a tensor
                return [self._view(g, i * group_bytes + off, (batch, world, seqlen, h, d), dtype)
                        for off, (h, d) in zip(offsets, parts)]

            hq, d = parts[0]
            recv = [recv_views(regions(rank, i)) for i in range(groups)]
            slots = [[[r[:, rank] for r in regions(g, i)] for g in range(world)] for i in range(groups)]
            outs = [self._view(p, base, (world, groups, batch, seqlen, hq, d), dtype) for p in range(world)]
            if len(self._cached) >= 16:
                self._cached.pop(next(iter(self._cached)))
            views = self._cached[key] = (recv, slots, outs)
        return views

    def attend(self, tensors, attend, groups: int = 1):
        """Ulysses attention through the peers' buffers, in ``groups`` groups of each rank's heads:
        ``tensors`` q, k, v ``(batch, seqlen_local, heads_t, head_dim)``; ``attend(q, k, v)`` (views
        ``(batch, world·seqlen_local, heads_t/(world·groups), head_dim)`` of this rank's buffer)
        -> the group's output ``(batch, world·seqlen_local, heads/(world·groups), head_dim)``.
        Returns this rank's slice of the output, ``(batch, seqlen_local, heads, head_dim)``, or None
        when the buffer cannot hold the call (nothing was sent: the caller exchanges through NCCL).

        With the copy engines, every group's copies to the other ranks are queued on the side
        stream up front, so group ``i + 1``'s transfer runs under group ``i``'s attention, and
        group ``i``'s output goes back under group ``i + 1``'s attention: what is left exposed is
        the first group's transfer and the last group's output."""
        world, rank = self.world, self.rank
        batch, seqlen = tensors[0].shape[:2]
        dtype, itemsize = tensors[0].dtype, tensors[0].element_size()
        split = [t.unflatten(2, (world, groups, t.shape[2] // (world * groups))) for t in tensors]
        parts = [(t.shape[4], t.shape[5]) for t in split]
        offsets, group_bytes, base, total = self.layout(batch, seqlen, parts, itemsize, world, groups)
        if not self.ready_for(total):
            return None
        mode = self._mode()
        main = torch.cuda.current_stream(self.device)
        others = [g for g in range(world) if g != rank]
        recv_at, slots_at, outs_at = self._views(batch, seqlen, tuple(parts), dtype, groups,
                                                 offsets, group_bytes, base)
        self._begin(("bf16", batch, seqlen, tuple(parts), dtype, groups))
        keep = []   # what the side stream reads, kept alive until it is joined
        sent = []
        for i in range(groups):
            pieces = [t[:, :, :, i] for t in split]
            slots = slots_at[i]
            if mode == "kernel":
                push_seq_to_heads(pieces, slots, world)
                continue
            self._side.wait_stream(main)
            with torch.cuda.stream(self._side):   # the copy engines read the caller's tensors where they lie
                push_seq_to_heads(pieces, slots, world, others, self._engine.copy)
            push_seq_to_heads(pieces, slots, world, [rank])
            sent.append(torch.cuda.Event())
            sent[-1].record(self._side)
        for i in range(groups):
            if mode != "kernel":
                main.wait_event(sent[i])
            self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
            out = attend(*recv_at[i])
            self._send_output(out, [outs_at[p][rank, i] for p in range(world)], mode, keep)
        if mode != "kernel":
            main.wait_stream(self._side)
        self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        del keep
        return out_from_region(outs_at[rank])

    def _mode(self) -> str:
        mode = self.copy_mode()
        if mode == "auto":
            mode = "engine" if torch.cuda.is_current_stream_capturing() else "kernel"
        if mode == "engine" and self._engine is None:
            self._engine, self._side = CopyEngine(), torch.cuda.Stream(self.device)
        return mode

    def _begin(self, layout) -> None:
        """Start a call of ``layout``. A call writes into the peers' buffers before its first
        barrier; where its layout differs from the previous call's, those writes could land on the
        previous call's output region while a peer still copies it out: one barrier first."""
        if self._last_layout is not None and layout != self._last_layout:
            self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        self._last_layout = layout

    def _send_output(self, out, back, mode: str, keep: list) -> None:
        """``out`` (this rank's heads over the whole sequence) into every rank's output region
        (``back[p]``: rank ``p``'s slot for this rank): by kernels, or by the copy engines on the side
        stream beside this rank's own slot's copy (``out`` is kept alive in ``keep`` till joined)."""
        world, rank = self.world, self.rank
        if mode == "kernel":
            push_heads_to_seq(out, back, world)
            return
        main = torch.cuda.current_stream(self.device)
        keep.append(out)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            push_heads_to_seq(out, back, world, [g for g in range(world) if g != rank], self._engine.copy)
        push_heads_to_seq(out, back, world, [rank])

    def attend_fp8(self, q, k, v, key_padding_mask, recv_mask, softmax_scale: float, qk_format: str = "int8"):
        """Ulysses FP8 attention that quantizes before the exchange
        (:class:`flashflow.ops.attention_fp8.UlyssesFp8Plan`). q, k, v ``(batch, seqlen_local,
        heads, head_dim)`` (heads and kv heads multiples of the world), ``key_padding_mask`` this
        rank's ``(batch, P)`` and ``recv_mask`` the whole sequence's
        (:func:`~flashflow.distributed.exchange.expand_masks`), or both None. Returns this rank's
        slice of the output, or None when nothing was sent (the buffer cannot hold the call: the
        caller takes another path).

        The statistics and quantize kernels store into the other ranks' buffers themselves (peer
        memory, NVLink): no copy runs before attention. In order:

        1. this rank's statistics into every rank's buffer; barrier;
        2. the quantize pass, one launch: each head's 8-bit values and scales at this rank's rows
           of the buffer of the rank that attends it; barrier;
        3. attention of this rank's heads for the other ranks' queries, each result sent into that
           rank's output region, then for this rank's own queries, straight into the output;
           barrier; the other ranks' heads from this rank's output region into the output.

        How a result is sent follows the copy mode (:meth:`copy_mode`): ``"kernel"`` — the
        attention kernel stores it into the other rank's region itself; ``"engine"`` — into a
        local tensor, copied by the copy engines on the side stream under the next launch
        (2 × H200, Edit: the attention launch that stores into the other GPU took 279 µs against
        261 for the same rows stored locally).
        """
        world, rank = self.world, self.rank
        q, k, v = (unit_last_stride(t) for t in (q, k, v))   # the quantize pass reads head_dim unit-stride
        batch, seqlen, heads, head_dim = q.shape
        layout = ("fp8", q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, qk_format,
                  None if key_padding_mask is None else (key_padding_mask.shape, key_padding_mask.stride()),
                  None if recv_mask is None else (recv_mask.shape, recv_mask.stride()))
        plan = self._fp8_plans.get(layout)
        if plan is None:
            plan = UlyssesFp8Plan(q, k, v, key_padding_mask, recv_mask, world, rank, qk_format)
            if len(self._fp8_plans) >= 16:
                self._fp8_plans.pop(next(iter(self._fp8_plans)))
            self._fp8_plans[layout] = plan
        h = heads // world
        base = plan.nbytes
        if not self.ready_for(base + world * batch * seqlen * h * head_dim * q.element_size()):
            return None
        mode = self._mode()
        key = layout + (self.nbytes,)
        views = self._cached.get(key)
        if views is None:
            buffers = [self._view(g, 0, (self.nbytes,), torch.uint8) for g in range(world)]
            # rank p's output region: (world, batch, seqlen_local, h, head_dim), source rank s's at [s]
            outs = [self._view(p, base, (world, batch, seqlen, h, head_dim), q.dtype) for p in range(world)]
            dest_bytes = torch.tensor(plan.peer_bytes(buffers), dtype=torch.int64, device=self.device)
            if len(self._cached) >= 16:
                self._cached.pop(next(iter(self._cached)))
            views = self._cached[key] = (plan.views(buffers[rank]), outs, dest_bytes)
        bufs, outs_at, dest_bytes = views
        # the launches' key (ops.common.Launcher): the layout fixes every argument's kind, pointers
        # aligned or not included; an unaligned call takes Triton's own path
        launch = ("ulysses",) + key if aligned16(q, k, v, key_padding_mask, recv_mask) else None
        self._begin(layout)
        plan.statistics(launch, bufs, dest_bytes, k, v, key_padding_mask)
        self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        plan.quantize(launch, bufs, dest_bytes, q, k, v, key_padding_mask, softmax_scale)
        self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        out = q.new_empty((batch, seqlen, heads, head_dim))
        keep = []   # what the side stream reads, kept alive until it is joined
        for p in [*range(rank + 1, world), *range(rank + 1)]:   # the other ranks' queries first, this rank's last
            if p == rank:
                plan.attend_rows(launch, bufs, recv_mask, p, out[:, :, p * h:(p + 1) * h])
            elif mode == "kernel":
                plan.attend_rows(launch, bufs, recv_mask, p, outs_at[p][rank])
            else:
                keep.append(q.new_empty((batch, seqlen, h, head_dim)))
                plan.attend_rows(launch, bufs, recv_mask, p, keep[-1])
                self._side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._side):
                    self._engine.copy(outs_at[p][rank].view(batch * seqlen, -1), keep[-1].view(batch * seqlen, -1))
        if mode != "kernel":
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        del keep
        self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        for p in range(world):
            if p != rank:
                _copy(out[:, :, p * h:(p + 1) * h], outs_at[rank][p])
        return out


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
        peer = _PEERS[key] = PeerUlysses(group, device)
    peer.strict = mode == "peer"
    return None if peer.failed and not peer.strict else peer
