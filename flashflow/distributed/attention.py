"""Sequence-parallel attention: each rank of a ``torch.distributed`` group holds a slice of the
sequence (FlashAttention's layout, ``(batch, seqlen_local, heads, head_dim)``) and gets its slice
of the output.

- :func:`ulysses_attention` — all-to-all to head slices of the whole sequence, flashflow's
  attention on them, all-to-all back (DeepSpeed-Ulysses). Needs heads and kv_heads divisible by
  the group size; moves q, k, v and the output once.
- :func:`ring_attention` — the ranks' K/V slices go round the ring while each rank attends its own
  queries to the slice it holds; the partial results merge by their log-sum-exp
  (:func:`flashflow.ops.decode.merge_attention_states`, the one merge of the library). The next
  slice's transfer runs under the current slice's attention.
- :func:`context_attention` — both at once over a diffusers ``ContextParallelConfig``'s meshes
  (Ulysses inside, ring outside), what the Qwen-Image processor calls.

Forward and backward (through autograd) for ``attention="exact"``; ``"fp8"`` is forward only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from flashflow.distributed.exchange import (HEADS_BACK, LSE_BACK, Exchange, Ring, SeqToHeads, expand_masks,
                                            gather_masks, group_size_rank, heads_to_seq, lse_heads_to_seq, seq_to_heads,
                                            wait)
from flashflow.distributed.peer import exchange_mode, peer_ulysses
from flashflow.ops.attention import flash_attn_func
from flashflow.ops.attention_bwd import attention_backward
from flashflow.ops.attention_fp8 import flash_attn_fp8_func
from flashflow.ops.decode import merge_attention_states
from flashflow.ops.validate import (check_flag, check_key_padding_mask, check_qkv, check_tensor,
                                    softmax_scale_or_default)

__all__ = ["ulysses_attention", "ring_attention", "context_attention", "shard_sequence", "gather_sequence",
           "ATTENTION_MODES", "LAYOUTS"]

ATTENTION_MODES = ("exact", "fp8")
# "contiguous": rank r holds tokens [r·S/P, (r+1)·S/P). "zigzag" (ring, causal load balance): the
# sequence cut in 2P chunks, rank r holds chunks r and 2P−1−r, so every rank has as many keys
# before its queries as every other.
LAYOUTS = ("contiguous", "zigzag")


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------


def _check_group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("flashflow.distributed needs torch.distributed initialised "
                         "(torch.distributed.init_process_group, e.g. under torchrun)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None (the default group), got "
                        f"{type(group).__name__}")
    return group


def _check_choice(name: str, value, choices):
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _check_inputs(q, k, v, key_padding_mask, attention):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 4, "(batch, seqlen_local, heads, head_dim)")
    check_qkv(q, k, v, head_axis=2)
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k, v must share (batch, seqlen_local) (each rank holds the same slice of queries and "
                         f"keys), got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    _check_choice("attention", attention, ATTENTION_MODES)
    if attention == "fp8" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("attention='fp8' has no backward: call it under torch.no_grad(), or use attention='exact'")
    if key_padding_mask is not None:
        key_padding_mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[1], q.device)
    return key_padding_mask


def _check_divides(world: int, heads: int, kv_heads: int, what: str) -> None:
    if heads % world or kv_heads % world:
        raise ValueError(f"{what} splits the heads across the group's {world} ranks: heads ({heads}) and kv_heads "
                         f"({kv_heads}) must be multiples of {world}; use ring_attention for this head count")


# --------------------------------------------------------------------------------------------
# one slice of attention
# --------------------------------------------------------------------------------------------


def _attend(q, k, v, scale: float, causal: bool, mask, attention: str):
    """``(out, lse)`` of q against one K/V slice (``mask``: that slice's key-padding mask or None)."""
    if attention == "fp8":
        return flash_attn_fp8_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True,
                                   key_padding_mask=mask)
    return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True, key_padding_mask=mask)


def _ring_part(step_source: int, rank: int, causal: bool, layout: str, seqlen: int):
    """What rank ``rank``'s queries attend of source ``step_source``'s K/V slice: ``(query rows,
    key rows, causal)`` as slices of the local sequence, or None for nothing."""
    every = slice(0, seqlen)
    if not causal:
        return every, every, False
    if step_source == rank:
        return every, every, True
    if layout == "contiguous":
        return (every, every, False) if step_source < rank else None
    half = seqlen // 2
    if step_source < rank:   # its first chunk precedes both of ours; its second follows both
        return every, slice(0, half), False
    return slice(half, seqlen), every, False   # both of its chunks precede our second one only


def _slice_mask(mask, keys: slice):
    """A key-padding mask (over the first P keys of a slice) restricted to the keys ``keys``
    (``keys.start`` is 0: the mask stays a prefix)."""
    if mask is None:
        return None
    return mask[:, :min(mask.shape[1], keys.stop)]


def _ring_forward(q, k, v, ring: Ring, scale, causal, layout, masks, attention):
    """Out (q's dtype) and LSE ``(batch, heads, seqlen_local)`` over every rank's K/V slice."""
    seqlen = q.shape[1]
    kv = torch.stack([k, v])
    spare = torch.empty_like(kv) if ring.world > 1 else None
    out = lse = None
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        works = ring.shift(kv, spare) if step < ring.world - 1 else []
        part = _ring_part(source, ring.rank, causal, layout, seqlen)
        if part is not None:
            rows, keys, part_causal = part
            o, l = _attend(q[:, rows], kv[0][:, keys], kv[1][:, keys], scale, part_causal,
                           _slice_mask(masks[source], keys), attention)
            if out is None:   # step 0 covers every row (its own slice)
                out, lse = o.float(), l
            elif rows.stop - rows.start == seqlen:
                out, lse = merge_attention_states(out, lse, o.float(), l)
            else:
                merged, merged_lse = merge_attention_states(out[:, rows], lse[:, :, rows], o.float(), l)
                out[:, rows] = merged
                lse[:, :, rows] = merged_lse
        wait(works)
        if works:
            kv, spare = spare, kv
    return out.to(q.dtype), lse


def _ring_backward(q, k, v, out, lse, dout, dlse, ring: Ring, scale, causal, layout, masks):
    """``(dq, dk, dv)`` of :func:`_ring_forward` (exact attention): each step's gradient with the
    final out and LSE; dK/dV accumulators travel the ring with their K/V slice and reach its owner
    after the last step."""
    seqlen = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    spare = torch.empty_like(kv) if ring.world > 1 else None
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    dspare = torch.empty_like(dkv)
    dworks = []
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        works = ring.shift(kv, spare) if step < ring.world - 1 else []
        part = _ring_part(source, ring.rank, causal, layout, seqlen)
        grads = None
        if part is not None:
            rows, keys, part_causal = part
            mask = _slice_mask(masks[source], keys)
            grads = attention_backward(
                q[:, rows], kv[0][:, keys], kv[1][:, keys], out[:, rows], lse[:, :, rows], dout[:, rows],
                None if dlse is None else dlse[:, :, rows], scale, False, 0, part_causal, 0, 0.0,
                key_padding_mask=mask, mask_keys=None if mask is None else mask.shape[1])
        if dworks:   # the accumulator of this step's slice, from the previous rank
            wait(dworks)
            dkv, dspare = dspare, dkv
        if grads is not None:
            dq_part, dk_part, dv_part = grads
            dq[:, rows] += dq_part
            dkv[0][:, keys] += dk_part
            dkv[1][:, keys] += dv_part
        if ring.world > 1:
            dworks = ring.shift(dkv, dspare)
        wait(works)
        if works:
            kv, spare = spare, kv
    if dworks:   # the last shift brought this rank's own accumulator home
        wait(dworks)
        dkv = dspare
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, scale, causal, layout, masks):
        ctx.set_materialize_grads(False)
        out, lse = _ring_forward(q, k, v, ring, scale, causal, layout, masks, "exact")
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, scale, causal, layout, masks)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, dlse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def _ring(q, k, v, group, scale, causal, layout, masks, attention):
    ring = Ring(group)
    if attention == "exact" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _RingAttention.apply(q, k, v, ring, scale, causal, layout, masks)
    return _ring_forward(q, k, v, ring, scale, causal, layout, masks, attention)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def ulysses_attention(q, k, v, group=None, causal=False, softmax_scale=None, *, return_lse=False,
                      key_padding_mask=None, attention="exact"):
    """Attention over a sequence split across the ranks of ``group`` (DeepSpeed-Ulysses).

    Every rank calls it with its contiguous slice of the sequence: rank ``r`` of ``P`` holds tokens
    ``[r·S/P, (r+1)·S/P)`` of q, k and v, ``(batch, seqlen_local, heads, head_dim)`` (the same
    shapes on every rank), and gets the same slice of the output. One all-to-all gives each rank
    ``heads/P`` heads of the whole sequence, flashflow's attention runs on them, one all-to-all
    brings the output back: per rank, q, k, v and the output cross the network once.

    Args:
        group: a ``torch.distributed`` process group (None: the default one). heads and kv_heads
            must be multiples of its size (GQA: each rank keeps whole groups of query heads).
        causal, softmax_scale: as :func:`flashflow.flash_attn_func` over the whole sequence.
        return_lse: also return the LSE, float32 ``(batch, heads, seqlen_local)``.
        key_padding_mask: bool ``(batch, P)``, ``P <= seqlen_local``, True = attend, over the first
            ``P`` keys of this rank's slice (the same ``P`` on every rank; every rank passes one,
            or none does).
        attention: ``"exact"`` (:func:`flashflow.flash_attn_func`; differentiable) or ``"fp8"``
            (:func:`flashflow.flash_attn_fp8_func`, forward only).
    """
    _check_group(group)
    key_padding_mask = _check_inputs(q, k, v, key_padding_mask, attention)
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    world, _ = group_size_rank(group)
    _check_divides(world, q.shape[2], k.shape[2], "ulysses_attention")
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    if world == 1:
        return _attend_whole(q, k, v, scale, causal, key_padding_mask, attention, return_lse)
    mask = expand_masks(gather_masks(key_padding_mask, group, world), q.shape[1])
    qh, kh, vh = SeqToHeads.apply(group, world, q, k, v)
    out, lse = _attend(qh, kh, vh, scale, causal, mask, attention)
    out = Exchange.apply(heads_to_seq, HEADS_BACK, group, world, out)
    if not return_lse:
        return out
    return out, Exchange.apply(lse_heads_to_seq, LSE_BACK, group, world, lse)


def _attend_whole(q, k, v, scale, causal, mask, attention, return_lse):
    out, lse = _attend(q, k, v, scale, causal, mask, attention)
    return (out, lse) if return_lse else out


def ring_attention(q, k, v, group=None, causal=False, softmax_scale=None, *, layout="contiguous",
                   return_lse=False, key_padding_mask=None, attention="exact"):
    """Attention over a sequence split across the ranks of ``group``, K/V passed round a ring.

    Arguments as :func:`ulysses_attention`; any head count (GQA included). Each rank attends its
    queries to the K/V slice it holds while the next slice is on its way from the previous rank;
    the partial results merge by their LSE (float32 accumulation). The backward sends the dK/dV
    accumulators round the ring with their slices.

    Args:
        layout: how the sequence is cut. ``"contiguous"`` (default): rank ``r`` holds tokens
            ``[r·S/P, (r+1)·S/P)``; with ``causal`` the last rank does ``P`` slices' work and the
            first one one. ``"zigzag"``: the sequence cut in ``2P`` chunks, rank ``r`` holding
            chunks ``r`` and ``2P−1−r`` (in that order; :func:`shard_sequence` cuts a tensor this
            way), so that every rank does the same work under ``causal`` (ring-flash-attention's
            layout); seqlen_local must be even.
    """
    _check_group(group)
    key_padding_mask = _check_inputs(q, k, v, key_padding_mask, attention)
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    layout = _check_choice("layout", layout, LAYOUTS)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout='zigzag' holds two equal chunks per rank: seqlen_local must be even, got {q.shape[1]}")
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    world, _ = group_size_rank(group)
    masks = gather_masks(key_padding_mask, group, world)
    out, lse = _ring(q, k, v, group, scale, causal, layout, masks, attention)
    return (out, lse) if return_lse else out


# Ulysses in context_attention: the heads of each rank cut in this many groups, the next group's
# all-to-all under the current group's attention (where the heads per rank divide; else 1). One
# group: on 2 × H200 at Qwen-Image-Edit 1024px, 6 blocks, FP8 attention, two groups gave 15.54 ms
# per step against 15.78 in CUDA graphs, but 23.47 against 19.46 eager, where the step is
# host-bound and each group adds two collectives' host time (bench/results/distributed-*.json).
HEAD_GROUPS = 1
# the peer-memory path's head groups (its copies run on the copy engines, beside the attention)
PEER_HEAD_GROUPS = 1
# FP8 attention through peer memory (one head group) with at least QUANTIZED_EXCHANGE_MIN_TOKENS
# tokens a rank: q, k, v quantized before the exchange and moved in 8 bits (PeerUlysses.attend_fp8),
# instead of moved in 16 bits and quantized after it (False: always the latter, for measurements).
# No floor: 2 × H200, a Qwen-Image step (6 blocks, CUDA graph), 8-bit against 16-bit: Edit (4224
# tokens a rank) 14.15 against 14.84 ms; 1024px (2176 a rank) 7.26 against 7.59 ms
# (bench/results/distributed-nvidia-h200-quantized-step-unshared.json)
QUANTIZED_EXCHANGE = True
QUANTIZED_EXCHANGE_MIN_TOKENS = 0


def context_attention(q, k, v, ulysses_group, ring_group, *, key_padding_mask=None, attention="exact",
                      softmax_scale=None, head_groups=None, exchange=None):
    """Non-causal attention over a sequence split across a Ulysses group (inside) and a ring group
    (outside), as diffusers' ``ContextParallelConfig(ulysses_degree, ring_degree)`` lays ranks out:
    the flattened rank ``ring_rank·U + ulysses_rank`` holds the sequence slice of that index. Either
    group may be None (degree 1). Forward only (the diffusion processor's path); the caller checks
    its inputs, beyond the one rule every path needs: q, k and v of one ``(batch, seqlen_local)``
    (a ``ValueError`` otherwise).

    ``exchange`` (default: ``FLASHFLOW_ULYSSES_EXCHANGE``, else ``"auto"``) picks how Ulysses alone
    moves q, k, v and the output: ``"peer"`` writes them straight into the other GPUs' memory
    (:mod:`flashflow.distributed.peer`, NCCL groups of CUDA tensors), ``"nccl"`` through
    ``all_to_all_single`` (gloo's on CPUs), ``"auto"`` the first where it can run.

    Ulysses alone runs in ``head_groups`` groups of heads (default :data:`PEER_HEAD_GROUPS` through
    peer memory, :data:`HEAD_GROUPS` through NCCL; a count that does not divide each rank's heads
    and KV heads runs as 1): each group's transfer of q, k, v runs under the previous group's
    attention, and its output's under the next one's."""
    mode = exchange_mode(exchange)
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k, v must share (batch, seqlen_local) (each rank holds the same slice of queries and "
                         f"keys), got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    u_world = dist.get_world_size(ulysses_group) if ulysses_group is not None else 1
    r_world = dist.get_world_size(ring_group) if ring_group is not None else 1
    if mode == "peer" and (u_world == 1 or r_world > 1):
        raise ValueError(f"exchange='peer' runs Ulysses alone; got ulysses degree {u_world}, ring degree {r_world} "
                         "(use exchange='auto' or 'nccl')")
    peer = peer_ulysses(ulysses_group, q.device, mode) if u_world > 1 and r_world == 1 else None
    if peer is not None:
        groups = _fit_groups(PEER_HEAD_GROUPS if head_groups is None else head_groups, q, k, u_world)
        mask = expand_masks(gather_masks(key_padding_mask, ulysses_group, u_world), q.shape[1])
        if attention == "fp8" and groups == 1 and QUANTIZED_EXCHANGE and q.numel() \
                and q.shape[1] >= QUANTIZED_EXCHANGE_MIN_TOKENS:
            # q, k, v cross at one byte an element, quantized on their way out (UlyssesFp8Plan)
            out = peer.attend_fp8(q, k, v, key_padding_mask, mask, scale)
            if out is not None:
                return out
        out = peer.attend([q, k, v], lambda *views: _attend(*views, scale, False, mask, attention)[0], groups)
        if out is not None:
            return out
    groups = HEAD_GROUPS if head_groups is None else head_groups
    if u_world > 1 and r_world == 1:
        return _ulysses_groups(q, k, v, ulysses_group, u_world, key_padding_mask, attention, scale, groups)
    mask = key_padding_mask
    if u_world > 1:
        (q, k, v), work = seq_to_heads([q, k, v], ulysses_group, u_world, async_op=True)
        mask = expand_masks(gather_masks(key_padding_mask, ulysses_group, u_world), q.shape[1] // u_world)
        work.wait()
    if r_world > 1:
        out, _ = _ring_forward(q, k, v, Ring(ring_group), scale, False, "contiguous",
                               gather_masks(mask, ring_group, r_world), attention)
    else:
        out, _ = _attend(q, k, v, scale, False, mask, attention)
    if u_world > 1:
        out = heads_to_seq(out, ulysses_group, u_world)
    return out


def _fit_groups(groups: int, q, k, world: int) -> int:
    """``groups`` when it divides each rank's heads and KV heads, else 1."""
    per_rank, kv_per_rank = q.shape[2] // world, k.shape[2] // world
    return 1 if groups < 1 or per_rank % groups or kv_per_rank % groups else groups


def _ulysses_groups(q, k, v, group, world, key_padding_mask, attention, scale, groups):
    """Ulysses attention over ``groups`` head groups, exchanges overlapped with attention."""
    batch, seqlen, heads, head_dim = q.shape
    per_rank = heads // world
    groups = _fit_groups(groups, q, k, world)
    qg, kg, vg = (t.unflatten(2, (world, groups, t.shape[2] // (world * groups))) for t in (q, k, v))
    # every group's exchange queued up front: NCCL runs them in order while the attention of the
    # groups before runs on the compute stream
    exchanges = [seq_to_heads([qg[:, :, :, g], kg[:, :, :, g], vg[:, :, :, g]], group, world, async_op=True)
                 for g in range(groups)]
    mask = expand_masks(gather_masks(key_padding_mask, group, world), seqlen)
    out = q.new_empty((batch, seqlen, world, groups, per_rank // groups, head_dim))
    finishes = []
    for g, (views, work) in enumerate(exchanges):
        work.wait()
        o, _ = _attend(*views, scale, False, mask, attention)
        finish, _ = heads_to_seq(o, group, world, out=out[:, :, :, g], async_op=True)
        finishes.append(finish)
    for finish in finishes:
        finish()
    return out.view(batch, seqlen, heads, head_dim)


# --------------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------------


def _layout_index(seqlen: int, world: int, rank: int, layout: str) -> list[slice]:
    if layout == "contiguous":
        n = seqlen // world
        return [slice(rank * n, (rank + 1) * n)]
    n = seqlen // (2 * world)
    return [slice(rank * n, (rank + 1) * n), slice((2 * world - 1 - rank) * n, (2 * world - rank) * n)]


def shard_sequence(x: torch.Tensor, group=None, layout="contiguous", dim: int = 1) -> torch.Tensor:
    """This rank's slice of a whole sequence ``x`` along ``dim`` (a copy), in ``layout``
    (:data:`LAYOUTS`): what :func:`ulysses_attention` / :func:`ring_attention` take. The sequence
    length must divide into ``P`` (contiguous) or ``2P`` (zigzag) equal chunks."""
    _check_group(group)
    layout = _check_choice("layout", layout, LAYOUTS)
    world, rank = group_size_rank(group)
    parts = world if layout == "contiguous" else 2 * world
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.shape[dim] % parts:
        raise ValueError(f"layout={layout!r} over {world} ranks cuts the sequence into {parts} equal chunks: "
                         f"x.shape[{dim}] = {x.shape[dim]} is not a multiple of {parts}")
    index = _layout_index(x.shape[dim], world, rank, layout)
    return torch.cat([x.narrow(dim, s.start, s.stop - s.start) for s in index], dim=dim)


def gather_sequence(x_local: torch.Tensor, group=None, layout="contiguous", dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's slice ``x_local`` (the inverse of :func:`shard_sequence`),
    on every rank."""
    _check_group(group)
    layout = _check_choice("layout", layout, LAYOUTS)
    world, _ = group_size_rank(group)
    if not isinstance(x_local, torch.Tensor):
        raise TypeError(f"x_local must be a torch.Tensor, got {type(x_local).__name__}")
    pieces = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(pieces, x_local.contiguous(), group=group)
    seqlen = x_local.shape[dim] * world
    out = x_local.new_empty(x_local.shape[:dim] + (seqlen,) + x_local.shape[dim + 1:])
    for rank, piece in enumerate(pieces):
        offset = 0
        for s in _layout_index(seqlen, world, rank, layout):
            n = s.stop - s.start
            out.narrow(dim, s.start, n).copy_(piece.narrow(dim, offset, n))
            offset += n
    return out
