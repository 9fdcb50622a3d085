"""Tile orders, defined once: the attention kernels' tile map (:func:`attention_tile`), the
persistent attention forward's tile scheduler (:func:`first_tile`, :func:`next_tile`: static or by tickets; its work
units when the tiles past the last full wave run in key pieces, :func:`split_unit` and
:func:`piece_blocks`) and the persistent FFN kernel's ticket order (which tile ticket ``t`` runs).

``ticket_to_tile`` is the kernel's map (``@triton.jit``, called by
:func:`flashflow.kernels.mlp.mlp_persistent_kernel` for every ticket). :func:`issue_order` runs
the *same function body* on the host: its Python code is executed with ``tl`` bound to a
few torch equivalents (``where``, ``minimum``, ``int32``), over every ticket at once. The
launcher, the dataflow model (:mod:`flashflow.dataflow.chain`) and the tests all take the
order from here, so no second spelling of it can drift from what the GPU runs.

Orders (``POLICY``; ``group_rows`` = R row-blocks per group):

* ``SEQUENTIAL`` ("sequential[:R]"): all GEMM0 tiles, then all GEMM1 tiles; each phase in
  groups of R row-blocks, column-major inside a group.
* ``MULTIROW`` ("multirow[:R]", and "rowblock" = R of 1): per group of R row-blocks, their
  GEMM0 tiles then their GEMM1 tiles, both column-major inside the group.
* ``HALFROW`` ("halfrow"): per row-block, GEMM0 columns [0, half) (part 0); GEMM1 over K-part 0
  (the intermediate those columns hold); GEMM0 columns [half, n0) (part 1); GEMM1 over K-part 1,
  which adds the part-0 partial sums. GEMM1 starts after half a row of GEMM0.
* ``SEQSPLIT`` ("seqsplit[:R]"): SEQUENTIAL's GEMM0 phase (GEMM0 tile (r, j) counts towards half
  ``j >= half`` of row-block r), then every GEMM1 tile over K-part 0, then every GEMM1 tile over
  K-part 1 (adds the part-0 partials), each pass in groups. Part 0 needs only the first GEMM0
  columns, which finish a wave or more before the GEMM0 phase ends, so no program idles at the
  phase change, and the last tiles are half as long.

With one GEMM0 column block there is nothing to halve: halfrow runs as rowblock and seqsplit as
sequential (:func:`launch_order`). In every order each tile a ticket depends on has a smaller
ticket (:func:`dependency_violations`), which is what makes the kernel deadlock-free.
"""
from __future__ import annotations

import types
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashflow.device import cdiv

SEQUENTIAL, MULTIROW, HALFROW, SEQSPLIT = 0, 1, 2, 3
_SEQUENTIAL = tl.constexpr(SEQUENTIAL)
_MULTIROW = tl.constexpr(MULTIROW)
_HALFROW = tl.constexpr(HALFROW)
_SEQSPLIT = tl.constexpr(SEQSPLIT)

ORDERS = ("sequential", "rowblock", "multirow", "halfrow", "seqsplit")
GROUPED_ORDERS = ("sequential", "multirow", "seqsplit")   # take ":R" (row-blocks per group)
DEFAULT_GROUP_ROWS = 8
ORDER_CODE = {"sequential": SEQUENTIAL, "rowblock": MULTIROW, "multirow": MULTIROW, "halfrow": HALFROW,
              "seqsplit": SEQSPLIT}
SPLIT_ORDERS = ("halfrow", "seqsplit")   # GEMM1 tiles run as two K-halves with fp32 partials


@triton.jit
def attention_tile(tile, num_m_blocks, heads, HEAVY_FIRST: tl.constexpr):
    """``(pid_m, head, batch)`` of the attention forward's tile ``tile`` (every attention
    kernel's, prefill and FP8, portable and Gluon): m-block fastest, then head, then batch, so
    the tiles that run together share K/V in L2. ``HEAVY_FIRST`` (causal): the m-blocks last to
    first, those near the end of the sequence see the most keys, so the short ones fill the
    last wave."""
    pid_m = tile % num_m_blocks
    head = (tile // num_m_blocks) % heads
    batch = tile // (num_m_blocks * heads)
    if HEAVY_FIRST:
        pid_m = num_m_blocks - 1 - pid_m
    return pid_m, head, batch


@triton.jit
def first_tile(counter, num_tiles, ALL_BY_TICKET: tl.constexpr):
    """The first tile of a persistent CTA of the attention forward: its program id, or with
    ``ALL_BY_TICKET`` a ticket from ``counter`` like every later one (:func:`next_tile`), so
    that a CTA only ever holds a tile no lower-numbered tile is still waiting to be claimed for,
    whatever order the hardware starts the CTAs in."""
    if ALL_BY_TICKET:
        tile = _ticket(counter, num_tiles + tl.num_programs(0) - 1)
    else:
        tile = tl.program_id(0)
    return tile


@triton.jit
def _ticket(counter, last):
    """A ticket from ``counter``; the CTA holding ``last``, the launch's last ticket, puts the
    counter back to zero for the next launch on the stream."""
    ticket = tl.atomic_add(counter, 1, sem="relaxed")
    if ticket == last:
        tl.atomic_xchg(counter, 0, sem="relaxed")
    return ticket


@triton.jit
def next_tile(tile, counter, num_tiles, DYNAMIC: tl.constexpr, ALL_BY_TICKET: tl.constexpr = False):
    """The tile a persistent CTA of the attention forward runs after ``tile`` (a CTA starts
    at :func:`first_tile`; a tile past ``num_tiles - 1`` ends its walk). Static: ``tile +
    num_programs``, CTA p runs p, p + P, p + 2P, .... ``DYNAMIC``: the next tile of
    :func:`attention_tile`'s order no CTA has claimed, ``P +`` a ticket taken from ``counter``
    (one int32, zero before the launch), so that a CTA that finishes early takes the next tile,
    as the hardware hands out the blocks of a grid of one CTA a tile (with ``HEAVY_FIRST``, the
    longest first). Every CTA takes one ticket a tile it runs, the last one past the end, so the
    launch takes exactly ``num_tiles`` tickets; the CTA holding ticket ``num_tiles - 1``, the
    last taken, puts the counter back to zero for the next launch on the stream.
    ``ALL_BY_TICKET`` (``DYNAMIC`` too): the first tiles were tickets as well, so the next one is
    the ticket itself, and the launch takes ``num_tiles + P`` of them."""
    if ALL_BY_TICKET:
        nxt = _ticket(counter, num_tiles + tl.num_programs(0) - 1)
    elif DYNAMIC:
        nxt = tl.num_programs(0) + _ticket(counter, num_tiles - 1)
    else:
        nxt = tile + tl.num_programs(0)
    return nxt


@triton.jit
def split_unit(unit, full_units, pieces):
    """``(tile, piece, pieces of the tile)`` of the persistent attention forward's work unit
    ``unit`` when the last wave's tiles run in key pieces: units ``[0, full_units)`` are whole
    tiles (tile = unit, piece 0 of 1); after them each remaining tile is ``pieces`` units in a
    row, its pieces in key order, the last of them the one that waits for the others and combines
    (a piece never waits for a unit after it: with every unit claimed by ticket, ``first_tile``
    and ``next_tile`` with ``ALL_BY_TICKET``, a piece waits only for units running CTAs hold,
    which keeps the launch free of deadlock)."""
    tail = tl.maximum(unit - full_units, 0)
    split = unit >= full_units
    tile = tl.where(split, full_units + tail // pieces, unit)
    piece = tl.where(split, tail % pieces, 0)
    return tile, piece, tl.where(split, pieces, 1)


@triton.jit
def piece_blocks(piece, pieces, n_blocks):
    """Key blocks ``[lo, hi)`` of piece ``piece`` of ``pieces`` over a tile's ``n_blocks``
    (sizes differing by at most one)."""
    return piece * n_blocks // pieces, (piece + 1) * n_blocks // pieces


@triton.jit
def grouped_tile(t, tiles_m, tiles_n, group_rows):
    """Tile ``t`` of a (tiles_m × tiles_n) grid walked in groups of ``group_rows`` row-blocks,
    column-major inside a group: consecutive tiles share a weight column (L2 reuse) and rows of
    one group finish together."""
    g = t // (group_rows * tiles_n)
    rows_g = tl.minimum(group_rows, tiles_m - g * group_rows)
    local = t - g * group_rows * tiles_n
    return g * group_rows + local % rows_g, local // rows_g


@triton.jit
def ticket_to_tile(t, tiles_m, n0, n1, group_rows, half, POLICY: tl.constexpr):
    """Ticket -> (kind, row-block r, column j, part); kind 0 = GEMM0 tile (r, j) of the
    intermediate, kind 1 = GEMM1 tile (r, j) of the output; part = the K-half of a split GEMM1
    tile, or the half of the row a GEMM0 tile counts towards (the module docstring has the
    orders)."""
    if POLICY == _SEQUENTIAL:
        total0 = tiles_m * n0
        is_g1 = t >= total0
        u = tl.where(is_g1, t - total0, t)
        r, j = grouped_tile(u, tiles_m, tl.where(is_g1, n1, n0), group_rows)
        kind = is_g1.to(tl.int32)
        part = t * 0
    elif POLICY == _MULTIROW:
        per_group = group_rows * (n0 + n1)
        g = t // per_group
        rows_g = tl.minimum(group_rows, tiles_m - g * group_rows)
        local = t - g * per_group
        is_g1 = local >= rows_g * n0
        u = tl.where(is_g1, local - rows_g * n0, local)
        r = g * group_rows + u % rows_g
        j = u // rows_g
        kind = is_g1.to(tl.int32)
        part = t * 0
    elif POLICY == _SEQSPLIT:
        total0 = tiles_m * n0
        is_g1 = t >= total0
        u = tl.where(is_g1, t - total0, t)
        second = is_g1 & (u >= tiles_m * n1)
        u = tl.where(second, u - tiles_m * n1, u)
        r, j = grouped_tile(u, tiles_m, tl.where(is_g1, n1, n0), group_rows)
        kind = is_g1.to(tl.int32)
        part = tl.where(is_g1, second, j >= half).to(tl.int32)
    else:
        per = n0 + 2 * n1
        r = t // per
        u = t - r * per
        in_b = (u >= half) & (u < half + n1)     # GEMM1, K-part 0
        in_c = (u >= half + n1) & (u < n0 + n1)  # GEMM0, columns [half, n0)
        in_d = u >= n0 + n1                      # GEMM1, K-part 1
        kind = (in_b | in_d).to(tl.int32)
        part = (in_c | in_d).to(tl.int32)
        j = tl.where(in_b, u - half, tl.where(in_c, u - n1, tl.where(in_d, u - n0 - n1, u)))
    return kind, r, j, part


@triton.jit
def mlp_ticket_map_kernel(OUT, total, tiles_m, n0, n1, group_rows, half, POLICY: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Writes ``ticket_to_tile`` of tickets [0, total) as rows (kind, r, j, part): the map as
    the kernel compiles it, for the tests to hold :func:`issue_order` against."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = t < total
    kind, r, j, part = ticket_to_tile(tl.minimum(t, total - 1), tiles_m, n0, n1, group_rows, half, POLICY)
    tl.store(OUT + 4 * t, kind, mask=ok)
    tl.store(OUT + 4 * t + 1, r, mask=ok)
    tl.store(OUT + 4 * t + 2, j, mask=ok)
    tl.store(OUT + 4 * t + 3, part, mask=ok)


# ------------------------------------------------------------------------------------------
# the same map on the host
# ------------------------------------------------------------------------------------------


def _host_minimum(a, b):
    return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))


# what the map's body asks of `tl`, as torch operations on int64 ticket vectors (every value is
# a non-negative integer, so floor division and remainder agree with the GPU's)
_HOST_TL = types.SimpleNamespace(where=torch.where, minimum=_host_minimum, int32=torch.int64)


def _on_host(jit_fn, **extra):
    fn = jit_fn.fn   # the Python function under @triton.jit (and under the interpreter's wrapper)
    scope = dict(fn.__globals__, tl=_HOST_TL, _SEQUENTIAL=SEQUENTIAL, _MULTIROW=MULTIROW, _HALFROW=HALFROW,
                 _SEQSPLIT=SEQSPLIT, **extra)
    return types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)


_host_grouped_tile = _on_host(grouped_tile)
_host_ticket_to_tile = _on_host(ticket_to_tile, grouped_tile=_host_grouped_tile)


def parse_order(policy: str) -> tuple[str, int]:
    """``"multirow:4"`` -> ("multirow", 4); a name without ``:R`` gets its default group size
    (1 for rowblock and halfrow, which take one row-block at a time). Raises ValueError naming
    the accepted forms."""
    forms = f"one of {ORDERS} or 'NAME:R' with NAME in {GROUPED_ORDERS}"
    if not isinstance(policy, str):
        raise TypeError(f"tile order must be a str, {forms}, got {type(policy).__name__}")
    name, sep, arg = policy.partition(":")
    if name not in ORDERS or (sep and name not in GROUPED_ORDERS):
        raise ValueError(f"tile order must be {forms} (R ≥ 1 row-blocks, e.g. 'multirow:R'), got {policy!r}")
    if not sep:
        return name, 1 if name in ("rowblock", "halfrow") else DEFAULT_GROUP_ROWS
    try:
        rows = int(arg)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"tile order '{name}:R' needs an integer R ≥ 1 (e.g. 'multirow:R'), got {policy!r}")
    return name, rows


class LaunchOrder(NamedTuple):
    """What the kernel is launched with for an order: its constexpr code, row-blocks per group,
    the GEMM0 column where the second half starts, and the number of tickets."""
    code: int
    group_rows: int
    half: int
    total: int
    split: bool


def launch_order(name: str, group_rows: int, tiles_m: int, n0: int, n1: int) -> LaunchOrder:
    if name in SPLIT_ORDERS and n0 < 2:   # one GEMM0 column block: nothing to halve
        name = "rowblock" if name == "halfrow" else "sequential"
    group_rows = 1 if name in ("rowblock", "halfrow") else max(1, int(group_rows))
    split = name in SPLIT_ORDERS
    return LaunchOrder(ORDER_CODE[name], group_rows, cdiv(n0, 2), tiles_m * (n0 + (2 if split else 1) * n1), split)


def issue_order(policy: str, tiles_m: int, n0: int, n1: int, group_rows: int | None = None
                ) -> list[tuple[int, int, int, int]]:
    """Every ticket's tile, in ticket order, as (kind, r, j, part): what the kernel runs for
    ``policy`` (``"multirow:8"``, or a name and ``group_rows``) on a grid of ``tiles_m``
    row-blocks, ``n0`` GEMM0 and ``n1`` GEMM1 column blocks."""
    name, rows = parse_order(policy)
    o = launch_order(name, rows if group_rows is None else group_rows, tiles_m, n0, n1)
    if o.total == 0:
        return []
    t = torch.arange(o.total, dtype=torch.int64)
    kind, r, j, part = _host_ticket_to_tile(t, tiles_m, n0, n1, o.group_rows, o.half, o.code)
    cols = [torch.as_tensor(v).expand(o.total).tolist() for v in (kind, r, j, part)]
    return [tuple(int(v) for v in row) for row in zip(*cols)]


def dependency_violations(order, n0: int, split: bool) -> list[str]:
    """Every dependency of a tile must have a smaller ticket (the deadlock-freedom rule).
    ``split``: GEMM1 runs as two K-halves (halfrow, seqsplit); part p needs GEMM0 columns of
    half p, and part 1 also needs part 0 of the same tile."""
    half = cdiv(n0, 2)
    seen, bad = set(), []
    for t, (kind, r, j, part) in enumerate(order):
        if kind == 1:
            cols = range(n0) if not split else (range(half) if part == 0 else range(half, n0))
            needs = [(0, r, jj, int(split and jj >= half)) for jj in cols]
            if split and part == 1:
                needs.append((1, r, j, 0))
            bad += [f"ticket {t} {order[t]} waits on {d}, not issued before" for d in needs if d not in seen]
        seen.add((kind, r, j, part))
    return bad
