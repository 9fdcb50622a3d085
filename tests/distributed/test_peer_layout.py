"""The layouts of the peer-memory Ulysses exchange (flashflow.distributed.peer), in one process.

On a GPU each rank's copies write into the other ranks' buffers; here every rank's buffer is a
local tensor and the ranks' copies run one after the other, which is what the buffers hold once
the barrier has passed. What each rank then reads must be what the NCCL path's all-to-all gives
it (the contract of seq_to_heads / heads_to_seq): heads [g·h, (g+1)·h) of every rank's slice, in
rank order along the sequence; and back. Inputs come contiguous, transposed, with a non-unit last
stride, expanded with stride 0, and as views of one fused q/k/v buffer (the diffusion processor's).
Buffers start filled with NaN, so a slot a copy misses shows.
"""
from __future__ import annotations

import pytest
import torch

from flashflow.distributed import peer as peer_module
from flashflow.distributed.peer import (EXCHANGES, CopyEngine, PeerUlysses, exchange_mode, out_from_region,
                                        push_heads_to_seq, push_seq_to_heads, recv_views)


def _layouts(b, s, h, d, dtype, layout, gen):
    """(q, k, v) of shape (b, s, h, d) (k and v with h // 2 heads under "gqa") in ``layout``."""
    kv_h = h // 2 if layout == "gqa" else h
    if layout == "fused":   # views of one (b, s, 3, h, d) buffer, as the processor's joint q/k/v
        qkv = torch.randn(b, s, 3, h, d, generator=gen, dtype=torch.float64).to(dtype)
        return qkv.unbind(2)
    if layout == "transposed":
        return tuple(torch.randn(b, hh, s, d, generator=gen, dtype=torch.float64).to(dtype).transpose(1, 2)
                     for hh in (h, kv_h, kv_h))
    if layout == "strided":   # non-unit last stride
        return tuple(torch.randn(b, s, hh, 2 * d, generator=gen, dtype=torch.float64).to(dtype)[..., ::2]
                     for hh in (h, kv_h, kv_h))
    if layout == "expanded":  # stride 0 along the batch
        return tuple(torch.randn(1, s, hh, d, generator=gen, dtype=torch.float64).to(dtype).expand(b, s, hh, d)
                     for hh in (h, kv_h, kv_h))
    return tuple(torch.randn(b, s, hh, d, generator=gen, dtype=torch.float64).to(dtype) for hh in (h, kv_h, kv_h))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "fused", "transposed", "strided", "expanded", "gqa"])
def test_seq_to_heads_then_heads_to_seq_match_the_all_to_all(world, layout):
    b, s, h, d = 2, 5, 2 * world, 8
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(world * 100 + len(layout))
    ranks = [_layouts(b, s, h, d, dtype, layout, gen) for _ in range(world)]
    parts = [(t.shape[2] // world, d) for t in ranks[0]]
    # every rank's receive regions (batch, world, seqlen, h_j, d), one for each of q, k, v
    recv = [[torch.full((b, world, s, hh, dd), float("nan"), dtype=dtype) for hh, dd in parts] for _ in range(world)]
    for r, tensors in enumerate(ranks):   # rank r's copies land in every rank's slot r
        push_seq_to_heads(tensors, [[region[:, r] for region in recv[g]] for g in range(world)], world)
    for g in range(world):
        views = recv_views(recv[g])
        for i, view in enumerate(views):
            hh = parts[i][0]
            want = torch.cat([ranks[p][i][:, :, g * hh:(g + 1) * hh] for p in range(world)], dim=1)
            assert view.shape == (b, world * s, hh, d) and view.is_contiguous()
            assert torch.equal(view, want), (world, layout, g, i)

    # the output back: rank g's attention output over its heads, rows of every rank's slice
    h_local = parts[0][0]
    outs = [torch.randn(b, world * s, h_local, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(world)]
    regions = [torch.full((world, 1, b, s, h_local, d), float("nan"), dtype=dtype) for _ in range(world)]
    for g, x in enumerate(outs):   # rank g's output lands at [g, group 0] of every rank's region
        push_heads_to_seq(x, [regions[p][g, 0] for p in range(world)], world)
    for p in range(world):
        want = torch.cat([outs[g][:, p * s:(p + 1) * s] for g in range(world)], dim=2)
        got = out_from_region(regions[p])
        assert got.is_contiguous() and torch.equal(got, want), (world, layout, p)


def test_output_region_with_head_groups():
    # region [p, i]: source rank p's head group i; the output orders heads rank-major, then group
    world, groups, b, s, h, d = 3, 2, 2, 5, 2, 8
    region = torch.randn(world, groups, b, s, h, d).to(torch.bfloat16)
    got = out_from_region(region)
    want = torch.cat([region[p, i] for p in range(world) for i in range(groups)], dim=2)
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", ["heads", "transposed", "odd", "offset", "float32", "int8"])
def test_copy_goes_wide_where_it_can_and_is_exact_everywhere(case):
    base = torch.randn(4, 6, 3, 16).to(torch.bfloat16)
    dst = torch.full((4, 6, 3, 16), float("nan"), dtype=torch.bfloat16)
    src, d = base, dst
    if case == "heads":         # a head slice: 8-byte runs with a stride (wide)
        src, d = base[:, :, 1:], dst[:, :, 1:]
    elif case == "transposed":  # last stride not 1 on the source: plain copy
        src = torch.randn(4, 6, 16, 3).to(torch.bfloat16).transpose(2, 3)
    elif case == "odd":         # 3 elements a row: not whole 8-byte steps
        src, d = base[..., :3], dst[..., :3]
    elif case == "offset":      # an offset of one element: not 8-byte aligned
        src, d = base[..., 1:9], dst[..., 1:9]
    elif case == "float32":
        src, d = base.float(), dst.float()
    else:
        src, d = (base * 10).to(torch.int8), torch.zeros_like(dst, dtype=torch.int8)
    peer_module._copy(d, src)
    assert torch.equal(d.nan_to_num(7.0) if d.is_floating_point() else d,
                       src.nan_to_num(7.0) if src.is_floating_point() else src)
    if case == "heads":
        assert peer_module._wide(src) is not None and peer_module._wide(d) is not None
    if case in ("transposed", "odd", "offset"):
        assert peer_module._wide(src) is None or peer_module._wide(d) is None


def test_the_buffer_holds_every_region():
    # q, k, v of 1 × 4224 tokens × 24 heads × 128 and the output: what one Qwen-Image-Edit block
    # asks of each of 2 ranks (bf16), in 1 and 2 head groups
    b, s, heads, d, world = 1, 4224, 24, 128, 2
    for groups in (1, 2):
        h = heads // (world * groups)
        offsets, group_bytes, base, total = PeerUlysses.layout(b, s, [(h, d)] * 3, 2, world, groups)
        one = b * world * s * h * d * 2
        assert offsets == [0, one, 2 * one] and group_bytes == 3 * one   # already 256-byte multiples
        assert base == groups * group_bytes
        assert total - base == world * groups * b * s * h * d * 2
        assert total == b * s * 4 * heads * d * 2
    offsets, group_bytes, _, _ = PeerUlysses.layout(1, 3, [(1, 8), (1, 8), (1, 8)], 2, 2, 1)
    assert offsets == [0, 256, 512] and group_bytes == 768              # 96-byte regions, aligned


def test_exchange_mode(monkeypatch):
    monkeypatch.delenv("FLASHFLOW_ULYSSES_EXCHANGE", raising=False)
    assert exchange_mode() == "auto"
    for mode in EXCHANGES:
        assert exchange_mode(mode) == mode
        monkeypatch.setenv("FLASHFLOW_ULYSSES_EXCHANGE", mode)
        assert exchange_mode() == mode
    monkeypatch.setenv("FLASHFLOW_ULYSSES_EXCHANGE", "nvlink")
    with pytest.raises(ValueError, match="FLASHFLOW_ULYSSES_EXCHANGE must be one of"):
        exchange_mode()
    assert exchange_mode("nccl") == "nccl"   # an explicit argument wins over the environment
    for bad in ("NCCL", 1, ""):
        with pytest.raises(ValueError, match="exchange must be one of"):
            exchange_mode(bad)


def test_copy_engine_rows_and_fallback():
    rows = CopyEngine._rows
    t = torch.zeros(6, 4, 8, dtype=torch.bfloat16)
    assert rows(t) == (64, 64)                                  # contiguous rows
    assert rows(t[:, 1:3]) == (64, 32)                          # a head slice of each row
    assert rows(torch.zeros(6, 2, 3, 4, 8)[:, 1, :, 1:3]) is None   # two runs a row
    assert rows(t[:, :, ::2]) is None                           # non-unit last stride
    assert rows(t.transpose(1, 2)) is None
    row0 = torch.zeros(1, 8, dtype=torch.bfloat16).expand(5, 8)
    assert rows(row0) == (0, 16)                                # stride-0 rows: one source row, repeated
    pitches = CopyEngine.pitches
    assert pitches(torch.zeros(5, 8, dtype=torch.bfloat16), row0) is None   # cudaMemcpy2D refuses a pitch < a row
    assert pitches(t[:, 1:3], t[:, 2:4]) == (64, 64, 32)
    assert pitches(t[:, 1:3], t[:, 2:4].float()) is None       # dtypes differ
    assert pitches(t[:0, 1:3], t[:0, 2:4]) is None              # nothing to copy
    engine = CopyEngine()
    engine.fn = None          # no CUDA runtime: every copy is Tensor.copy_
    src = torch.randn(6, 4, 8).to(torch.bfloat16).transpose(1, 2)
    dst = torch.full((6, 8, 4), float("nan"), dtype=torch.bfloat16)
    engine.copy(dst, src)
    assert torch.equal(dst, src)


def test_copy_mode(monkeypatch):
    peer = PeerUlysses.__new__(PeerUlysses)   # no group: only the mode's lookup
    peer.remote_copy = None
    monkeypatch.delenv("FLASHFLOW_PEER_COPY", raising=False)
    assert peer.copy_mode() == peer_module.DEFAULT_REMOTE_COPY == "auto"
    monkeypatch.setenv("FLASHFLOW_PEER_COPY", "kernel")
    assert peer.copy_mode() == "kernel"
    peer.remote_copy = "engine"                # the attribute wins over the environment
    assert peer.copy_mode() == "engine"
    peer.remote_copy = "dma"
    with pytest.raises(ValueError, match="remote_copy must be one of"):
        peer.copy_mode()
    peer.remote_copy = None
    monkeypatch.setenv("FLASHFLOW_PEER_COPY", "dma")
    with pytest.raises(ValueError, match="FLASHFLOW_PEER_COPY must be one of"):
        peer.copy_mode()
