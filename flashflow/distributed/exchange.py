"""The exchanges of sequence-parallel attention over a ``torch.distributed`` group: the Ulysses
all-to-all (a rank's slice of the sequence with every head <-> the whole sequence with its slice of
the heads), the ring's neighbour transfer, and the small all-gathers of key-padding masks.

Layouts are FlashAttention's ``(batch, seqlen, heads, head_dim)``. Rank ``r`` of a group of ``P``
holds the ``r``-th slice of the sequence; after :func:`seq_to_heads` it holds heads
``[r·H/P, (r+1)·H/P)`` of the sequence ``[slice 0, slice 1, …, slice P−1]``.

Everything here is plain ``torch.distributed`` (NCCL on GPUs, gloo on CPUs): the collectives are
issued on the caller's stream order (NCCL waits for the work queued before it, and ``wait()`` makes
the caller's stream wait for the transfer), so an asynchronous transfer overlaps whatever kernels
are queued between its start and its ``wait``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size_rank(group) -> tuple[int, int]:
    """``(world size, rank)`` of ``group`` (None: the default group)."""
    return dist.get_world_size(group), dist.get_rank(group)


def global_rank(group, rank: int) -> int:
    """The default-group rank of ``group``'s rank ``rank`` (what point-to-point ops address)."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


# --------------------------------------------------------------------------------------------
# Ulysses: sequence-sharded <-> head-sharded
# --------------------------------------------------------------------------------------------


def seq_to_heads(tensors, group, world: int, async_op: bool = False):
    """All-to-all of ``tensors`` (each ``(batch, seqlen_local, heads_t, head_dim)``, one dtype and
    device, ``heads_t % world == 0``) from sequence-sharded to head-sharded, in one collective.

    Returns views ``(batch, world·seqlen_local, heads_t/world, head_dim)`` of one receive buffer
    (sequence stride ``batch·W`` elements, head_dim unit-stride): no copy on the receiving side. With
    ``async_op`` it returns ``(views, work)``: the views hold their values once ``work.wait()`` has
    been called (which orders the caller's stream after the transfer)."""
    batch, seqlen = tensors[0].shape[:2]
    # a 5-D tensor is (batch, seqlen, world, heads per rank, head_dim) already: a head group's view
    tensors = [t if t.dim() == 5 else t.unflatten(2, (world, t.shape[2] // world)) for t in tensors]
    parts = [(t.shape[3], t.shape[4]) for t in tensors]
    width = sum(h * d for h, d in parts)
    # per destination: (seqlen, batch, width): the received chunks stack along the sequence
    send = torch.empty((world, seqlen, batch, width), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for t, (h, d) in zip(tensors, parts):
        send[..., offset:offset + h * d].unflatten(-1, (h, d)).copy_(t.permute(2, 1, 0, 3, 4))
        offset += h * d
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    joint = recv.view(world * seqlen, batch, width).transpose(0, 1)
    views, offset = [], 0
    for h, d in parts:
        views.append(joint[..., offset:offset + h * d].unflatten(-1, (h, d)))
        offset += h * d
    return (views, work) if async_op else views


def heads_to_seq(x: torch.Tensor, group, world: int, out: torch.Tensor | None = None, async_op: bool = False):
    """The inverse of :func:`seq_to_heads` for one tensor: ``x`` ``(batch, world·seqlen_local,
    heads_local, head_dim)`` -> ``(batch, seqlen_local, world·heads_local, head_dim)``, contiguous.
    A contiguous ``x`` of batch 1 is sent as it is (its per-rank chunks are already adjacent).

    ``out``: a ``(batch, seqlen_local, world, heads_local, head_dim)`` view to write the result
    into (a head group's slots of a larger output). With ``async_op`` it returns ``(finish, work)``:
    call ``finish()`` (after or instead of ``work.wait()``) for the result."""
    batch, total, heads, head_dim = x.shape
    seqlen = total // world
    send = x.unflatten(1, (world, seqlen)).transpose(0, 1).contiguous()   # (world, batch, seqlen, h, d)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)

    def finish():
        if work is not None:
            work.wait()
        if out is not None:
            return out.copy_(recv.permute(1, 2, 0, 3, 4))
        return recv.permute(1, 2, 0, 3, 4).reshape(batch, seqlen, world * heads, head_dim)

    return (finish, work) if async_op else finish()


def lse_heads_to_seq(lse: torch.Tensor, group, world: int) -> torch.Tensor:
    """LSE ``(batch, heads_local, world·seqlen_local)`` -> ``(batch, world·heads_local, seqlen_local)``."""
    batch, heads, total = lse.shape
    seqlen = total // world
    send = lse.unflatten(2, (world, seqlen)).permute(2, 0, 1, 3).contiguous()   # (world, batch, h, s)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(batch, world * heads, seqlen)


def lse_seq_to_heads(lse: torch.Tensor, group, world: int) -> torch.Tensor:
    """The inverse of :func:`lse_heads_to_seq` (the gradient's way back)."""
    batch, heads, seqlen = lse.shape
    lse = lse.contiguous()   # a gradient may come strided
    send = lse.unflatten(1, (world, heads // world)).transpose(0, 1).contiguous()   # (world, batch, h/w, s)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3).reshape(batch, heads // world, world * seqlen)


class SeqToHeads(torch.autograd.Function):
    """:func:`seq_to_heads` with its gradient (the inverse exchange of each output's gradient)."""

    @staticmethod
    def forward(ctx, group, world, *tensors):
        ctx.group, ctx.world = group, world
        return tuple(seq_to_heads(tensors, group, world))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *(None if g is None else heads_to_seq(g, ctx.group, ctx.world) for g in grads))


def _one_seq_to_heads(x, group, world):
    return seq_to_heads([x], group, world)[0]


class Exchange(torch.autograd.Function):
    """One exchange ``there(x, group, world)`` with its gradient: its inverse ``back`` on the
    output's gradient (``Exchange.apply(heads_to_seq, HEADS_BACK, group, world, out)``)."""

    @staticmethod
    def forward(ctx, there, back, group, world, x):
        ctx.back, ctx.group, ctx.world = back, group, world
        return there(x, group, world)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None, ctx.back(grad, ctx.group, ctx.world)


# the inverses Exchange takes for heads_to_seq and lse_heads_to_seq
HEADS_BACK, LSE_BACK = _one_seq_to_heads, lse_seq_to_heads


# --------------------------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------------------------


def gather_masks(mask: torch.Tensor | None, group, world: int) -> list:
    """Every rank's key-padding mask ``(batch, P)`` (one shape on every rank), in rank order; a list
    of None when ``mask`` is None (then every rank must pass None)."""
    if mask is None:
        return [None] * world
    if world == 1:
        return [mask]
    # gloo and NCCL both move bytes: a bool mask travels as uint8
    src = mask.to(torch.uint8).contiguous()
    out = torch.empty((world * src.shape[0],) + tuple(src.shape[1:]), dtype=torch.uint8, device=src.device)
    dist.all_gather_into_tensor(out, src, group=group)
    return list(out.to(torch.bool).unflatten(0, (world, src.shape[0])).unbind(0))


def expand_masks(masks: list, seqlen_local: int) -> torch.Tensor | None:
    """One mask over the concatenation of the ranks' key slices (each ``seqlen_local`` keys, each
    rank's mask covering its first ``P`` keys): ``(batch, world·seqlen_local)``, True where a key is
    attended; None when no rank has a mask."""
    if masks[0] is None:
        return None
    batch, covered = masks[0].shape
    full = torch.ones((batch, len(masks), seqlen_local), dtype=torch.bool, device=masks[0].device)
    full[:, :, :covered] = torch.stack(masks, dim=1)
    return full.flatten(1)


# --------------------------------------------------------------------------------------------
# ring
# --------------------------------------------------------------------------------------------


class Ring:
    """The ring of ``group``: each rank sends to the next and receives from the previous one."""

    def __init__(self, group):
        self.group = group
        self.world, self.rank = group_size_rank(group)
        self.next = global_rank(group, (self.rank + 1) % self.world)
        self.prev = global_rank(group, (self.rank - 1) % self.world)

    def shift(self, send: torch.Tensor, recv: torch.Tensor) -> list:
        """Start sending ``send`` to the next rank and receiving the previous rank's into ``recv``;
        returns the works to ``wait()`` before ``recv`` is read or ``send`` written."""
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return dist.batch_isend_irecv(ops)


def wait(works) -> None:
    for work in works:
        work.wait()
