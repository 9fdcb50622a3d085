"""Ulysses through peer memory (flashflow.distributed.peer) on two GPUs of one host, NCCL.

The CPU tests (tests/distributed/test_peer_layout.py) check the copies' layouts with local
buffers; here the copies cross NVLink into the other rank's symmetric memory and the barrier
orders them. Each case runs on both ranks in one spawn; every rank's buffer is poisoned with NaN
(all bytes 0xFF) before each call, so a slot nobody wrote shows.

Every case runs in each copy mode (REMOTE_COPIES): the copies to the other rank by the copy
engines, by kernels, and "auto" (kernels eagerly, the copy engines in the captured graph).

- The exchanges against NCCL's all-to-all, bit for bit, over fresh inputs: separate tensors, the
  processor's fused q/k/v views, transposed, non-unit-stride and stride-0 inputs; the buffer growing for a
  longer sequence.
- context_attention with exchange="peer" against "nccl" (exact and FP8, with a key-padding mask,
  1, 2 and 4 head groups), bit for bit, and exact against float64 attention over the whole
  sequence.
- CUDA graph capture of the peer path: replays with new inputs equal the eager NCCL path.
- NaN/inf in one rank's k reach the same outputs as through NCCL.
"""
from __future__ import annotations

import os
import tempfile
import traceback

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]


def _poison(peer):
    import torch.distributed as dist

    if peer._buffer is not None:
        peer._buffer.fill_(0xFF)          # every bf16 / fp16 element NaN
    torch.cuda.synchronize()
    dist.barrier()                        # no rank writes into a buffer before its owner poisoned it


def _draw(shape, seed, layout, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, s, h, d = shape
    if layout == "fused":
        return torch.randn(b, s, 3, h, d, device="cuda", dtype=dtype, generator=g).unbind(2)
    if layout == "transposed":
        return tuple(torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2) for _ in range(3))
    if layout == "expanded":   # stride 0 along the heads: one head's values seen h times
        return tuple(torch.randn(b, s, 1, d, device="cuda", dtype=dtype, generator=g).expand(b, s, h, d)
                     for _ in range(3))
    if layout == "strided":
        return tuple(torch.randn(b, s, h, 2 * d, device="cuda", dtype=dtype, generator=g)[..., ::2] for _ in range(3))
    return tuple(torch.randn(shape, device="cuda", dtype=dtype, generator=g) for _ in range(3))


def _capture(call):
    """``(graph, out)``: ``call`` warmed up twice on a side stream, then captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def _exchanges(rank, world, report):
    """PeerUlysses.attend around an attention that records the views it gets and returns a given
    output: the views equal NCCL's seq_to_heads, the result NCCL's heads_to_seq, for 1 and 2 head
    groups (group i: heads [i·h/2, (i+1)·h/2) of each rank's slice)."""
    from flashflow.distributed.exchange import heads_to_seq, seq_to_heads
    from flashflow.distributed.peer import peer_ulysses

    peer = peer_ulysses(None, torch.device("cuda", rank), "peer")
    calls = 0
    for it, (s, layout) in enumerate([(257, "contiguous"), (257, "fused"), (300, "transposed"), (1031, "strided"),
                                      (1031, "fused"), (64, "contiguous"), (200, "expanded")]):
        q, k, v = _draw((1, s, 8, 128), 1000 * it + rank, layout)
        want = seq_to_heads([q, k, v], None, world)
        out = torch.randn(1, world * s, 4, 128, device="cuda", dtype=torch.bfloat16)
        want_back = heads_to_seq(out, None, world)
        for groups in (1, 2):
            per = 4 // groups
            seen = []

            def fake_attention(*views):
                i = len(seen)
                seen.append([t.clone() for t in views])
                return out[:, :, i * per:(i + 1) * per].contiguous()

            _poison(peer)
            back = peer.attend([q, k, v], fake_attention, groups)
            calls += 1
            assert len(seen) == groups
            for i, views in enumerate(seen):
                for j, (a, b) in enumerate(zip(views, want)):
                    b = b[:, :, i * per:(i + 1) * per]
                    assert a.shape == b.shape and torch.equal(a, b), (it, s, layout, groups, i, j)
            assert torch.equal(back, want_back), (it, s, layout, groups, "output")
    report.append(f"exchanges: {calls} calls bit-equal, buffer {peer.nbytes} bytes")


def _attention(rank, world, report):
    import torch.distributed as dist

    from flashflow.distributed import context_attention, gather_sequence
    from flashflow.distributed.peer import peer_ulysses
    from flashflow.reference import attention_naive, full_key_padding_mask
    from flashflow.reference.metrics import rel_l2

    from flashflow.distributed import attention as dist_attention

    # the 16-bit exchange here (its bits are NCCL's); the quantized one: _fp8_quantized_exchange
    dist_attention.QUANTIZED_EXCHANGE = False
    peer = peer_ulysses(None, torch.device("cuda", rank), "peer")
    group = dist.group.WORLD
    b, s, h, d = 1, 1500, 8, 128
    whole = [torch.randn(b, s * world, h, d, device="cuda", dtype=torch.bfloat16,
                         generator=torch.Generator(device="cuda").manual_seed(7 + i)) for i in range(3)]
    local = [t[:, rank * s:(rank + 1) * s] for t in whole]
    mask = torch.ones(b, 40, dtype=torch.bool, device="cuda")
    mask[:, 33:] = False   # each rank's first 40 keys: 7 of them padding
    for attention in ("exact", "fp8"):
        for m, groups in ((None, 1), (mask, 1), (None, 2), (mask, 4)):
            # the same head groups through NCCL: the same attention calls (a kernel's configuration
            # may depend on the head count, so other groupings need not give the same bits)
            want = context_attention(*local, group, None, attention=attention, key_padding_mask=m, exchange="nccl",
                                     head_groups=groups)
            _poison(peer)
            got = context_attention(*local, group, None, attention=attention, key_padding_mask=m, exchange="peer",
                                    head_groups=groups)
            assert torch.equal(got, want), (attention, m is not None, groups)
            if attention == "exact":
                full_mask = None
                if m is not None:
                    full_mask = torch.cat([full_key_padding_mask(m, s)] * world, dim=1)
                ref = attention_naive(*(t.double() for t in whole), key_padding_mask=full_mask)
                err = rel_l2(gather_sequence(got), ref)
                assert err < 1e-2, (attention, m is not None, err)
    report.append("context_attention: peer == nccl, exact and fp8, with and without a mask, 1, 2 and 4 head groups")

    # CUDA graph: captured on static inputs, replayed with new values
    static = [t.clone() for t in local]

    def call():
        return context_attention(*static, group, None, attention="fp8", exchange="peer", head_groups=2)

    graph, out = _capture(call)
    for it in range(4):
        for t in static:
            t.copy_(torch.randn_like(t))
        graph.replay()
        want = context_attention(*static, group, None, attention="fp8", exchange="nccl", head_groups=2)
        assert torch.equal(out, want), ("graph replay", it)
    report.append("graph (2 head groups): 4 replays with new inputs == eager nccl")

    # NaN and inf in rank 0's keys: the same outputs as through NCCL
    bad = [t.clone() for t in local]
    if rank == 0:
        bad[1][0, 5, 3, 7] = float("nan")
        bad[1][0, 9, 6, 0] = float("inf")
    for attention in ("exact", "fp8"):
        want = context_attention(*bad, group, None, attention=attention, exchange="nccl")
        _poison(peer)
        got = context_attention(*bad, group, None, attention=attention, exchange="peer")
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), attention
        assert got.isnan().any(), attention
    report.append("nan/inf: same pattern as nccl")
    dist_attention.QUANTIZED_EXCHANGE = True


def _fp8_quantized_exchange(rank, world, report):
    """FP8 attention whose exchange is the quantize pass (PeerUlysses.attend_fp8): each rank's
    slice of the output is one process's FP8 attention over the whole sequence (K's mean summed in
    another order: close, not the same bits), in every input layout, with a mask, with NaN/inf,
    and under CUDA graph replays; 1500 tokens a rank, so a 128-key block straddles the ranks."""
    import torch.distributed as dist

    from flashflow.distributed import attention as dist_attention
    from flashflow.distributed import context_attention
    from flashflow.distributed.exchange import expand_masks
    from flashflow.distributed.peer import peer_ulysses
    from flashflow.ops.attention_fp8 import flash_attn_fp8_func
    from flashflow.reference import attention_naive
    from flashflow.reference.metrics import rel_l2

    assert dist_attention.QUANTIZED_EXCHANGE
    min_tokens, dist_attention.QUANTIZED_EXCHANGE_MIN_TOKENS = dist_attention.QUANTIZED_EXCHANGE_MIN_TOKENS, 0
    peer = peer_ulysses(None, torch.device("cuda", rank), "peer")
    peer._fp8_plans.clear()
    group = dist.group.WORLD
    b, s, h, d = 1, 1500, 8, 128
    rows = slice(rank * s, (rank + 1) * s)
    mask = torch.ones(b, 40, dtype=torch.bool, device="cuda")
    mask[:, 33:] = False
    for layout in ("contiguous", "transposed", "fused", "expanded", "strided"):
        for m in (None, mask):
            whole = _draw((b, s * world, h, d), 11, layout)   # the same on every rank
            if layout != "expanded":
                whole[1][..., 5] += 3.0                        # an offset channel in K
            local = [t[:, rows] for t in whole]
            full = expand_masks([m] * world, s) if m is not None else None
            want = flash_attn_fp8_func(*whole, key_padding_mask=full)[:, rows]
            _poison(peer)
            got = context_attention(*local, group, None, attention="fp8", key_padding_mask=m, exchange="peer")
            ref = attention_naive(*(t.double() for t in whole), key_padding_mask=full)[:, rows]
            err, want_err = rel_l2(got, ref), rel_l2(want, ref)
            assert not got.isnan().any(), (layout, m is not None)
            assert err < 0.05 and err < 1.2 * want_err + 1e-3, (layout, m is not None, err, want_err)
            assert (got.float() - want.float()).abs().max() < 0.05, (layout, m is not None)
    assert peer._fp8_plans, "the quantized exchange did not run"
    report.append("quantized exchange == one-process fp8 over the whole sequence, 5 layouts, with and without a mask")

    # NaN / inf in rank 0's keys, one of them in the block shared with rank 1 (keys 1408-1535)
    whole = _draw((b, s * world, h, d), 12, "contiguous")
    whole[1][0, 5, 3, 7] = float("nan")
    whole[1][0, 1450, 6, 0] = float("inf")
    want = flash_attn_fp8_func(*whole)[:, rows]
    _poison(peer)
    got = context_attention(*(t[:, rows] for t in whole), group, None, attention="fp8", exchange="peer")
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    report.append("quantized exchange: nan/inf pattern == one process")

    # CUDA graph: captured on static inputs, replayed with new values == eager
    static = [t[:, rows].clone() for t in _draw((b, s * world, h, d), 13, "contiguous")]

    def call():
        return context_attention(*static, group, None, attention="fp8", exchange="peer")

    graph, out = _capture(call)
    for it in range(4):
        for t in static:
            t.copy_(torch.randn_like(t))
        graph.replay()
        want = call()
        assert torch.equal(out, want), ("graph replay", it)
    report.append("quantized exchange: 4 graph replays with new inputs == eager")
    dist_attention.QUANTIZED_EXCHANGE_MIN_TOKENS = min_tokens


CASES = (_exchanges, _attention, _fp8_quantized_exchange)


def _worker(rank, world, port, out_dir):
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank),
                            timeout=datetime.timedelta(seconds=120))
    from flashflow.distributed.peer import REMOTE_COPIES, peer_ulysses

    lines = []
    try:
        for case, copies in ((c, m) for m in REMOTE_COPIES for c in CASES):
            try:
                peer_ulysses(None, torch.device("cuda", rank), "peer").remote_copy = copies
                with torch.inference_mode(False), torch.no_grad():
                    case(rank, world, lines)
                lines.append(f"PASS {case.__name__} {copies}")
            except Exception:   # noqa: BLE001 - reported to the parent
                lines.append(f"FAIL {case.__name__} {copies}\n{traceback.format_exc()}")
                break
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(lines))
        dist.destroy_process_group()


def test_peer_ulysses_on_two_gpus():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_worker, args=(2, port, tmp), nprocs=2)
        reports = [open(os.path.join(tmp, f"rank{r}.txt")).read() for r in range(2)]
    print("\n".join(reports))
    from flashflow.distributed.peer import REMOTE_COPIES

    for r, text in enumerate(reports):
        for case in CASES:
            for copies in REMOTE_COPIES:
                assert f"PASS {case.__name__} {copies}" in text, f"rank {r}:\n{text}"
