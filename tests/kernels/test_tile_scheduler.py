"""The persistent attention forward's tile scheduler (kernels/tile_order.py's ``next_tile``) on
its own, through Triton's interpreter (or on the GPU): programs walking the tiles statically or
claiming them by ticket run every tile exactly once, in :func:`attention_tile`'s order where
they claim them, and a claiming launch leaves its counter at zero for the next one."""
import pytest
import torch
import triton
import triton.language as tl

from flashflow.kernels.tile_order import attention_tile, next_tile


@triton.jit
def _walk(RUNS, ORDER, CLAIMS, COUNTER, num_tiles, num_m_blocks, heads, DYNAMIC: tl.constexpr):
    """Each program walks its tiles: ``RUNS[tile]`` counts the runs of a tile, ``ORDER[tile]``
    holds its (pid_m, head, batch) from attention_tile (causal order), ``CLAIMS`` the number of
    tiles each program ran."""
    tile = tl.program_id(0)
    ran = 0
    while tile < num_tiles:
        nxt = next_tile(tile, COUNTER, num_tiles, DYNAMIC)
        tl.atomic_add(RUNS + tile, 1)
        pid_m, head, batch = attention_tile(tile, num_m_blocks, heads, True)
        tl.store(ORDER + 3 * tile, pid_m)
        tl.store(ORDER + 3 * tile + 1, head)
        tl.store(ORDER + 3 * tile + 2, batch)
        ran += 1
        tile = nxt
    tl.store(CLAIMS + tl.program_id(0), ran)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("num_m_blocks,heads,batch,programs", [(5, 3, 2, 4), (1, 1, 1, 1), (4, 2, 1, 8),
                                                                (7, 2, 3, 42), (3, 1, 1, 3)])
def test_every_tile_runs_once_and_the_counter_returns_to_zero(device, dynamic, num_m_blocks, heads, batch,
                                                              programs):
    num_tiles = num_m_blocks * heads * batch
    grid = min(programs, num_tiles)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    for _ in range(3):   # the counter a launch leaves is the next launch's start
        runs = torch.zeros(num_tiles, dtype=torch.int32, device=device)
        order = torch.full((num_tiles, 3), -1, dtype=torch.int32, device=device)
        claims = torch.zeros(grid, dtype=torch.int32, device=device)
        _walk[(grid,)](runs, order, claims, counter, num_tiles, num_m_blocks, heads, DYNAMIC=dynamic)
        assert runs.tolist() == [1] * num_tiles
        assert int(claims.sum()) == num_tiles and int(claims.min()) >= 1
        assert int(counter.item()) == 0
        if not dynamic:   # CTA p runs p, p + P, ...
            assert claims.tolist() == [len(range(p, num_tiles, grid)) for p in range(grid)]
    expect = [(num_m_blocks - 1 - t % num_m_blocks, (t // num_m_blocks) % heads, t // (num_m_blocks * heads))
              for t in range(num_tiles)]   # the longest m-block of a head first
    assert [tuple(r) for r in order.tolist()] == expect
