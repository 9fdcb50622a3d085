"""The persistent attention forward's tile scheduler (kernels/tile_order.py's ``next_tile``) on
its own, through Triton's interpreter (or on the GPU): programs walking the tiles statically or
claiming them by ticket run every tile exactly once, in :func:`attention_tile`'s order where
they claim them, and a claiming launch leaves its counter at zero for the next one."""
import pytest
import torch
import triton
import triton.language as tl

from flashflow.kernels.tile_order import attention_tile, first_tile, next_tile, piece_blocks, split_unit


@triton.jit
def _walk(RUNS, ORDER, CLAIMS, COUNTER, num_tiles, num_m_blocks, heads, DYNAMIC: tl.constexpr,
          ALL_BY_TICKET: tl.constexpr):
    """Each program walks its tiles: ``RUNS[tile]`` counts the runs of a tile, ``ORDER[tile]``
    holds its (pid_m, head, batch) from attention_tile (causal order), ``CLAIMS`` the number of
    tiles each program ran."""
    tile = first_tile(COUNTER, num_tiles, ALL_BY_TICKET)
    ran = 0
    while tile < num_tiles:
        nxt = next_tile(tile, COUNTER, num_tiles, DYNAMIC, ALL_BY_TICKET)
        tl.atomic_add(RUNS + tile, 1)
        pid_m, head, batch = attention_tile(tile, num_m_blocks, heads, True)
        tl.store(ORDER + 3 * tile, pid_m)
        tl.store(ORDER + 3 * tile + 1, head)
        tl.store(ORDER + 3 * tile + 2, batch)
        ran += 1
        tile = nxt
    tl.store(CLAIMS + tl.program_id(0), ran)


@pytest.mark.parametrize("dynamic", [False, True, "all"])
@pytest.mark.parametrize("num_m_blocks,heads,batch,programs", [(5, 3, 2, 4), (1, 1, 1, 1), (4, 2, 1, 8),
                                                                (7, 2, 3, 42), (3, 1, 1, 3)])
def test_every_tile_runs_once_and_the_counter_returns_to_zero(device, dynamic, num_m_blocks, heads, batch,
                                                              programs):
    """Static, by ticket after each CTA's program id, and every tile by ticket (``all``: a
    CTA's first too, as a launch with key pieces walks)."""
    num_tiles = num_m_blocks * heads * batch
    grid = min(programs, num_tiles)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    for _ in range(3):   # the counter a launch leaves is the next launch's start
        runs = torch.zeros(num_tiles, dtype=torch.int32, device=device)
        order = torch.full((num_tiles, 3), -1, dtype=torch.int32, device=device)
        claims = torch.zeros(grid, dtype=torch.int32, device=device)
        _walk[(grid,)](runs, order, claims, counter, num_tiles, num_m_blocks, heads, DYNAMIC=bool(dynamic),
                       ALL_BY_TICKET=dynamic == "all")
        assert runs.tolist() == [1] * num_tiles
        # (by ticket alone, a CTA may find every tile taken: the interpreter runs one at a time)
        assert int(claims.sum()) == num_tiles and int(claims.min()) >= (0 if dynamic == "all" else 1)
        assert int(counter.item()) == 0
        if not dynamic:   # CTA p runs p, p + P, ...
            assert claims.tolist() == [len(range(p, num_tiles, grid)) for p in range(grid)]
    expect = [(num_m_blocks - 1 - t % num_m_blocks, (t // num_m_blocks) % heads, t // (num_m_blocks * heads))
              for t in range(num_tiles)]   # the longest m-block of a head first
    assert [tuple(r) for r in order.tolist()] == expect


@triton.jit
def _split_walk(BLOCK_RUNS, LAST, COUNTER, num_units, full_units, pieces, n_blocks, DYNAMIC: tl.constexpr):
    """Each program walks work units as the kernel with key pieces does (``DYNAMIC``: every
    unit by ticket, ``first_tile`` and ``next_tile``); a unit adds one to ``BLOCK_RUNS[tile, j]``
    for each key block j it holds (tile_order's ``split_unit`` and ``piece_blocks``), and the
    unit that is its tile's last piece writes its unit number to ``LAST[tile]``."""
    unit = first_tile(COUNTER, num_units, DYNAMIC)
    while unit < num_units:
        nxt = next_tile(unit, COUNTER, num_units, DYNAMIC, DYNAMIC)
        tile, piece, tile_pieces = split_unit(unit, full_units, pieces)
        lo, hi = piece_blocks(piece, tile_pieces, n_blocks)
        for j in range(lo, hi):
            tl.atomic_add(BLOCK_RUNS + tile * n_blocks + j, 1)
        if piece == tile_pieces - 1:
            tl.store(LAST + tile, unit)
        unit = nxt


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("num_tiles,ctas,n_blocks,pieces", [(10, 4, 7, 2), (5, 8, 9, 8), (13, 6, 3, 3),
                                                             (4, 4, 5, 1), (182, 132, 3, 5)])
def test_split_units_cover_every_key_block_once(device, dynamic, num_tiles, ctas, n_blocks, pieces):
    """The tiles past the last full wave in key pieces (in several rounds over the CTAs where
    they outnumber them: 50 tiles in 5 pieces over 132): every key block of every tile is held by
    exactly one unit, whole tiles keep unit = tile, and a tile's merging piece (its last) is its
    highest-numbered unit, after all the pieces it waits for."""
    tail = num_tiles % ctas if pieces > 1 else 0
    full_units = num_tiles - tail
    units = full_units + tail * pieces
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    runs = torch.zeros(num_tiles, n_blocks, dtype=torch.int32, device=device)
    last = torch.full((num_tiles,), -1, dtype=torch.int32, device=device)
    _split_walk[(min(ctas, units),)](runs, last, counter, units, full_units, pieces, n_blocks, DYNAMIC=dynamic)
    assert runs.tolist() == [[1] * n_blocks] * num_tiles
    assert last.tolist() == (list(range(full_units)) +
                             [full_units + t * pieces + pieces - 1 for t in range(tail)])
    assert int(counter.item()) == 0
