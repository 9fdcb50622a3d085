"""flashflow.distributed on the CPU: ulysses_attention, ring_attention and context_attention over
2 and 4 gloo processes (tests/distributed/gloo.py), kernels through Triton's interpreter.

Every rank draws the whole sequence from one seed (the same on every rank), takes its slice
(cut here, by index, not by the library's shard_sequence), runs the op on it, and gathers the
outputs and gradients back; each rank then compares the whole result with float64 attention
(flashflow.reference) on the whole sequence, under the tolerances the one-process op gets against
float64 (tests/ops/test_attention.py forward, tests/ops/test_attention_bwd.py gradients).

The cases of one world size run in one spawn of the ranks (a spawn and its imports cost seconds):
the first test of that world size runs them all, each rank recording each case's outcome, and
each case is one pytest test that reads its outcome. A case communicates first and asserts last,
so a failing assertion on one rank leaves the ranks in step for the next case.
"""
from __future__ import annotations

import contextlib
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import gloo
from flashflow import flash_attn_func
from flashflow.distributed import context_attention, gather_sequence, ring_attention, shard_sequence, ulysses_attention
from flashflow.ops.attention_fp8 import flash_attn_fp8_func
from flashflow.reference import attention_naive, full_key_padding_mask
from flashflow.reference.metrics import cosine, rel_l1, rel_l2

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed's gloo backend")

# the one-process op against float64: forward (tests/ops/test_attention.py) and gradients
# (tests/ops/test_attention_bwd.py); LSE within 1e-2 where finite, -inf exactly where float64 has it
FWD_TOL = {torch.float16: 5e-3, torch.float32: 1e-4}
BWD_TOL = {torch.float16: 2e-3, torch.float32: 1e-5}
LSE_TOL = 1e-2
# FP8 (INT8 Q·K, e4m3 P·V) against exact attention: the bounds of tests/ops/test_attention_fp8.py
FP8_EXACT_COSINE, FP8_EXACT_REL_L1 = 0.999, 0.06

CASES: dict[int, dict] = {2: {}, 4: {}}


def case(*worlds):
    """Register a case ``fn(rank, world)`` for the spawned runs of these world sizes."""
    def register(fn):
        for w in worlds:
            CASES[w][fn.__name__] = fn
        return fn
    return register


# ---------------------------------------------------------------------------------------------
# the spawned body and the pytest side
# ---------------------------------------------------------------------------------------------


def run_cases(rank, world):
    """Every case of this world size, in order; returns {case: None or the traceback}. A case that
    raises anything but an assertion may have stopped between collectives (the other ranks then
    wait in one): the cases after it are not run on this rank."""
    results, broken = {}, None
    for name, fn in CASES[world].items():
        if broken is not None:
            results[name] = f"not run: {broken} raised an error on this rank, which may have left the ranks out of step"
            continue
        start = time.perf_counter()
        try:
            fn(rank, world)
            results[name] = None
        except (AssertionError, pytest.fail.Exception):   # after the case's collectives: the next case runs
            results[name] = traceback.format_exc()
        except Exception:
            results[name] = traceback.format_exc()
            broken = name
        results[name + ":seconds"] = time.perf_counter() - start
    return results


_SPAWNED: dict = {}


def spawned(world):
    """The ranks' reports of one run of every case (once per pytest process and world size; a
    run that failed as a whole fails every case of it with its message, without running again)."""
    if world not in _SPAWNED:
        try:
            _SPAWNED[world] = gloo.run(world, run_cases)
        except gloo.RankFailed as e:
            _SPAWNED[world] = e
    if isinstance(_SPAWNED[world], Exception):
        pytest.fail(str(_SPAWNED[world]), pytrace=False)
    return _SPAWNED[world]


def check_spawned_case(world, name):
    reports = spawned(world)
    errors = [f"rank {rep['rank']}:\n{rep['result'][name]}" for rep in reports if rep["result"][name] is not None]
    if errors:
        pytest.fail(f"{name} on {world} gloo ranks failed:\n" + "\n".join(errors), pytrace=False)


# ---------------------------------------------------------------------------------------------
# helpers (run on every rank)
# ---------------------------------------------------------------------------------------------


def positions(seqlen_local, world, rank, layout="contiguous"):
    """The whole sequence's positions rank ``rank`` holds: its slice (contiguous), or chunks
    ``rank`` and ``2·world−1−rank`` of ``2·world`` (zigzag)."""
    if layout == "contiguous":
        return torch.arange(rank * seqlen_local, (rank + 1) * seqlen_local)
    n = seqlen_local // 2
    return torch.cat([torch.arange(rank * n, (rank + 1) * n),
                      torch.arange((2 * world - 1 - rank) * n, (2 * world - rank) * n)])


def local_slice(x, rank, world, layout="contiguous", dim=1):
    return x.index_select(dim, positions(x.shape[dim] // world, world, rank, layout)).contiguous()


def gather_whole(x, world, layout="contiguous", dim=1, group=None):
    """Every rank's ``x`` (its slice along ``dim``) put back at its positions of the whole sequence."""
    x = x.detach().contiguous()
    pieces = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(pieces, x, group=group)
    seqlen_local = x.shape[dim]
    shape = list(x.shape)
    shape[dim] = seqlen_local * world
    whole = x.new_empty(shape)
    for r, piece in enumerate(pieces):
        whole.index_copy_(dim, positions(seqlen_local, world, r, layout), piece)
    return whole


def draw(seed, b, s, h, hk, d, dtype, batch_alike=False):
    """The whole sequence's q, k, v, output gradient and LSE gradient (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    nb = 1 if batch_alike else b
    q, k, v, dout = (torch.randn(nb, s, n, d, generator=g).expand(b, s, n, d).to(dtype)
                     for n in (h, hk, hk, h))
    dlse = torch.randn(b, h, s, generator=g)
    return q, k, v, dout, dlse


def draw_masks(seed, world, b, p):
    """Each rank's key-padding mask (batch, P) over the first P keys of its slice, True = attend;
    every rank's has masked keys, and rank 1's masks its first key of every sequence."""
    g = torch.Generator().manual_seed(seed + 1000)
    masks = torch.rand(world, b, p, generator=g) > 0.4
    masks[:, :, -1] = False
    masks[1, :, 0] = False
    return masks


def whole_mask(masks, seqlen_local, world, layout="contiguous"):
    """The (batch, S) mask over the whole sequence the ranks' prefix masks make."""
    b = masks.shape[1]
    full = torch.ones(b, seqlen_local * world, dtype=torch.bool)
    for r in range(world):
        full[:, positions(seqlen_local, world, r, layout)] = full_key_padding_mask(masks[r], seqlen_local)
    return full


def as_layout(x, layout):
    """A view with ``x``'s values over storage laid out as the house's layout cases
    (tests/layout_cases.py): ``(storage leaf, view)``; the storage requires grad."""
    if layout == "contiguous":
        store = x.clone()
        return store.requires_grad_(), store
    if layout == "transposed":   # (b, h, s, d) storage, the (b, s, h, d) view: SDPA's layout
        store = x.transpose(1, 2).contiguous().requires_grad_()
        return store, store.transpose(1, 2)
    if layout == "strided":   # every other element of a twice-as-wide head_dim; NaN in the gaps
        store = torch.full(x.shape[:-1] + (2 * x.shape[-1],), float("nan"), dtype=x.dtype)
        store[..., ::2] = x
        store.requires_grad_()
        return store, store[..., ::2]
    if layout == "expanded":   # stride 0 along batch: x's sequences must be alike
        assert x.stride(0) == 0 or all(torch.equal(x[0], x[i]) for i in range(x.shape[0]))
        store = x[:1].clone().requires_grad_()
        return store, store.expand(x.shape)
    if layout == "packed":   # the middle third of a tensor three times as wide along heads (qkv.split)
        h = x.shape[2]
        store = torch.full(x.shape[:2] + (3 * h,) + x.shape[3:], float("nan"), dtype=x.dtype)
        store[:, :, h:2 * h] = x
        store.requires_grad_()
        return store, store[:, :, h:2 * h]
    raise ValueError(layout)


def bits(t):
    """``t``'s values as integers (NaN-proof equality)."""
    t = t.detach()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).clone()


def close_lse(lse, ref_lse, where):
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape, (where, lse.dtype, lse.shape)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), \
        f"{where}: LSE -inf at {torch.isneginf(lse).nonzero().tolist()}, float64 at " \
        f"{torch.isneginf(ref_lse).nonzero().tolist()}"
    fin = torch.isfinite(ref_lse)
    gap = (lse.double()[fin] - ref_lse[fin]).abs().max().item()
    assert gap < LSE_TOL, f"{where}: LSE off by {gap}"


def check_attention(rank, world, op, *, b, s_local, h, hk, d, dtype, causal=False, layout="contiguous",
                    softmax_scale=None, mask_p=None, return_lse=False, input_layouts=None,
                    empty_rows=False, seed=0):
    """``op`` (ulysses_attention or ring_attention) on this rank's slice, forward and gradients
    through autograd, gathered and compared with float64 autograd over the
    whole sequence; the inputs keep their values."""
    where = f"{op.__name__} world={world} b={b} s_local={s_local} h={h}/{hk} d={d} {dtype} causal={causal} " \
            f"layout={layout} mask_p={mask_p} lse={return_lse} inputs={input_layouts}"
    s = s_local * world
    layouts = input_layouts or ("contiguous",) * 3
    q, k, v, dout, dlse = draw(seed, b, s, h, hk, d, dtype, batch_alike="expanded" in layouts)
    masks = None if mask_p is None else draw_masks(seed, world, b, mask_p)
    if empty_rows:   # rank 0's first P keys all masked in sequence 0: with causal, its first P rows see no key
        masks[0, 0] = False
    kw = dict(return_lse=return_lse, key_padding_mask=None if masks is None else masks[rank])
    if op is ring_attention:
        kw["layout"] = layout
    # this rank's slice, laid out as asked
    stores, views = zip(*(as_layout(local_slice(t, rank, world, layout), lay) for t, lay in zip((q, k, v), layouts)))
    before = [bits(t) for t in stores]
    res = op(*views, None, causal, softmax_scale, **kw)
    out, lse = res if return_lse else (res, None)
    dout_l, dlse_l = local_slice(dout, rank, world, layout), local_slice(dlse, rank, world, layout, dim=2)
    loss = (out.float() * dout_l.float()).sum()
    if return_lse:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0) * dlse_l).sum()
    grads = torch.autograd.grad(loss, views)
    got_out = gather_whole(out, world, layout)
    got_lse = None if lse is None else gather_whole(lse, world, layout, dim=2)
    got_grads = [gather_whole(gr, world, layout) for gr in grads]
    # every collective is behind us: assertions from here on
    assert out.shape == (b, s_local, h, d) and out.dtype == dtype, (where, out.shape, out.dtype)
    for name, t, was in zip("qkv", stores, before):
        assert torch.equal(bits(t), was), f"{where}: the op changed its input {name}"
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    full = None if masks is None else whole_mask(masks, s_local, world, layout)
    ref, ref_lse = attention_naive(*refs, softmax_scale, causal, key_padding_mask=full, return_lse=True)
    assert not torch.isnan(got_out).any(), f"{where}: NaN in the output"
    assert rel_l2(got_out, ref) < FWD_TOL[dtype], (where, "out", rel_l2(got_out, ref))
    if empty_rows:
        assert causal and (got_out[0, :mask_p] == 0).all(), f"{where}: rows that see no key are not 0"
    if return_lse:
        close_lse(got_lse, ref_lse, where)
    ref_loss = (ref * dout.double()).sum()
    if return_lse:
        ref_loss = ref_loss + (torch.where(torch.isfinite(ref_lse), ref_lse, 0) * dlse.double()).sum()
    want = torch.autograd.grad(ref_loss, refs)
    for name, a, r in zip(("dq", "dk", "dv"), got_grads, want):
        assert a.shape == r.shape and a.dtype == dtype and torch.isfinite(a).all(), (where, name)
        assert rel_l2(a, r) < BWD_TOL[dtype], (where, name, rel_l2(a, r))


@contextlib.contextmanager
def no_communication():
    """Any torch.distributed communication inside raises (what a bad input must be refused before)."""
    names = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast",
             "barrier", "batch_isend_irecv", "isend", "irecv", "send", "recv", "reduce_scatter_tensor")
    saved = {n: getattr(dist, n) for n in names}

    def refuse(*args, **kwargs):
        raise AssertionError("communicated before refusing a bad input")

    try:
        for n in names:
            setattr(dist, n, refuse)
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


# ---------------------------------------------------------------------------------------------
# 2 ranks
# ---------------------------------------------------------------------------------------------


@case(2)
def ulysses_gqa_fp16(rank, world):
    check_attention(rank, world, ulysses_attention, b=2, s_local=19, h=4, hk=2, d=24, dtype=torch.float16)


@case(2)
def ulysses_causal_lse_fp32(rank, world):
    check_attention(rank, world, ulysses_attention, b=1, s_local=17, h=2, hk=2, d=40, dtype=torch.float32,
                    causal=True, return_lse=True, softmax_scale=0.3)


@case(2, 4)
def ulysses_key_padding_mask(rank, world):
    h = 2 * world
    check_attention(rank, world, ulysses_attention, b=2, s_local=13, h=h, hk=world, d=16, dtype=torch.float16,
                    mask_p=9, return_lse=True)


@case(2)
def ulysses_causal_mask_empty_rows(rank, world):
    check_attention(rank, world, ulysses_attention, b=2, s_local=12, h=2, hk=2, d=16, dtype=torch.float32,
                    causal=True, mask_p=5, return_lse=True, empty_rows=True)


@case(2)
def ring_mqa_fp16(rank, world):
    check_attention(rank, world, ring_attention, b=2, s_local=19, h=3, hk=1, d=24, dtype=torch.float16)


@case(2, 4)
def ring_causal_lse_fp32(rank, world):
    check_attention(rank, world, ring_attention, b=1, s_local=11, h=3, hk=3, d=33, dtype=torch.float32,
                    causal=True, return_lse=True, softmax_scale=0.3)


@case(2, 4)
def ring_zigzag_causal_gqa_fp16(rank, world):
    check_attention(rank, world, ring_attention, b=2, s_local=14, h=4, hk=2, d=32, dtype=torch.float16,
                    causal=True, layout="zigzag")


@case(2)
def ring_key_padding_mask(rank, world):
    check_attention(rank, world, ring_attention, b=2, s_local=13, h=4, hk=2, d=16, dtype=torch.float16,
                    mask_p=9, return_lse=True)


@case(2, 4)
def ring_zigzag_causal_mask_lse_fp32(rank, world):
    # P (9) reaches past the first chunk (6 keys): the mask is cut where a step attends that chunk only
    check_attention(rank, world, ring_attention, b=2, s_local=12, h=2, hk=1, d=16, dtype=torch.float32,
                    causal=True, layout="zigzag", mask_p=9, return_lse=True)


@case(2, 4)
def ring_causal_mask_empty_rows(rank, world):
    # rank 0's first rows see no key at all: out 0, LSE -inf through every merge of the ring
    check_attention(rank, world, ring_attention, b=2, s_local=12, h=2, hk=2, d=16, dtype=torch.float32,
                    causal=True, mask_p=5, return_lse=True, empty_rows=True)


@case(2)
def ulysses_input_layouts(rank, world):
    for layouts in (("transposed", "strided", "packed"), ("expanded", "expanded", "transposed")):
        check_attention(rank, world, ulysses_attention, b=2, s_local=10, h=4, hk=2, d=16, dtype=torch.float32,
                        causal=True, input_layouts=layouts)


@case(2)
def ring_input_layouts(rank, world):
    for layouts, layout in ((("transposed", "strided", "packed"), "zigzag"),
                            (("expanded", "transposed", "strided"), "contiguous")):
        check_attention(rank, world, ring_attention, b=2, s_local=10, h=4, hk=2, d=16, dtype=torch.float32,
                        causal=True, layout=layout, input_layouts=layouts)


@case(2)
def nan_in_one_ranks_k_reaches_what_one_process_gives(rank, world):
    """A NaN in rank 1's k (one key, one KV head, one channel): the NaN pattern of the whole
    output is that of one-process flash_attn_func on the whole sequence."""
    b, s_local, h, hk, d = 2, 12, 4, 2, 16
    s = s_local * world
    checks = []
    for op, causal, layout in ((ulysses_attention, False, "contiguous"), (ulysses_attention, True, "contiguous"),
                               (ring_attention, False, "contiguous"), (ring_attention, True, "contiguous"),
                               (ring_attention, True, "zigzag")):
        q, k, v, _, _ = draw(3, b, s, h, hk, d, torch.float16)
        j = positions(s_local, world, 1, layout)[s_local // 2 - 1]   # a key of rank 1's slice
        k = k.clone()
        k[1, j, 1, 5] = float("nan")
        kw = {"layout": layout} if op is ring_attention else {}
        out = op(*(local_slice(t, rank, world, layout) for t in (q, k, v)), causal=causal, **kw)
        got = gather_whole(out, world, layout)
        checks.append((op.__name__, causal, layout, got, flash_attn_func(q, k, v, causal=causal)))
    for name, causal, layout, got, want in checks:
        where = f"{name} causal={causal} layout={layout}"
        assert torch.isnan(want).any() and not torch.isnan(want).all(), where   # the case means something
        assert torch.equal(torch.isnan(got), torch.isnan(want)), \
            (where, torch.isnan(got).any(-1).nonzero().tolist(), torch.isnan(want).any(-1).nonzero().tolist())
        fin = ~torch.isnan(want)
        assert rel_l2(got[fin], want[fin]) < FWD_TOL[torch.float16], (where, rel_l2(got[fin], want[fin]))


LAYOUT_CASES = ((ulysses_attention, True, "contiguous"), (ring_attention, False, "contiguous"),
                (ring_attention, True, "zigzag"))


def _forward_backward(op, causal, layout, rank, world, q, k, v, dout):
    """The op on this rank's slices, then its gradients; the output and gradients gathered whole."""
    kw = {"layout": layout} if op is ring_attention else {}
    views = [local_slice(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
    out = op(*views, causal=causal, **kw)
    grads = torch.autograd.grad(out, views, local_slice(dout, rank, world, layout))
    return [gather_whole(t, world, layout) for t in (out, *grads)]


def _one_process(q, k, v, dout, causal):
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*whole, causal=causal)
    return [out.detach(), *torch.autograd.grad(out, whole, dout)]


@case(2)
def nan_in_k_is_never_hidden_and_never_spoils_a_finite_value(rank, world):
    """A NaN in rank 1's k (one element), then the backward. Every query row that attends that key
    gets a NaN output row and dq row, the key's dk and dv are NaN, and every finite entry of the
    output, dq, dk and dv equals one-process flash_attn_func's with that element 0. Ulysses runs
    the one-process kernels on whole sequences: its NaN pattern is theirs exactly; the ring's
    tiles differ (a masked key's 0 · NaN turns other entries of its tile NaN)."""
    b, s_local, h, hk, d = 2, 12, 4, 2, 16
    s = s_local * world
    checks = []
    for op, causal, layout in LAYOUT_CASES:
        q, k, v, dout, _ = draw(5, b, s, h, hk, d, torch.float16)
        j = int(positions(s_local, world, 1, layout)[3])
        clean = _one_process(q, k, v, dout, causal)
        k = k.clone()
        k[1, j, 1, 5] = float("nan")
        got = _forward_backward(op, causal, layout, rank, world, q, k, v, dout)
        checks.append((op, f"{op.__name__} causal={causal} layout={layout}", j, causal, got, clean,
                       _one_process(q, k, v, dout, causal)))
    for op, where, j, causal, got, clean, one in checks:
        rows = torch.arange(j, s) if causal else torch.arange(s)   # the rows that attend key j
        heads = [hh for hh in range(h) if hh * hk // h == 1]      # the query heads of KV head 1
        for name, t in (("out", got[0]), ("dq", got[1])):
            assert torch.isnan(t[1][rows][:, heads]).all(), (where, name, "a row attending the NaN key is not NaN")
        assert torch.isnan(got[2][1, j, 1]).all() and torch.isnan(got[3][1, j, 1]).all(), (where, "dk/dv of the key")
        for name, g, c, o in zip(("out", "dq", "dk", "dv"), got, clean, one):
            fin = torch.isfinite(g)
            assert fin.any(), (where, name)
            assert rel_l2(g[fin], c[fin]) < 1e-2, (where, name, rel_l2(g[fin], c[fin]))
            if op is ulysses_attention:
                assert torch.equal(torch.isnan(g), torch.isnan(o)), (where, name)


@case(2)
def inf_in_v_is_never_hidden_and_never_spoils_a_finite_value(rank, world):
    """An inf in rank 0's v (one element), then the backward. Every query row that attends that key
    gets a non-finite output in that channel (never a finite one); every finite entry of the
    output and of dq, dk, dv equals one-process flash_attn_func's with that element 0 (an entry
    the inf can reach is never finite and wrong). Which other entries turn NaN follows the
    kernels' tiles (a masked key's 0 · inf), which differ between layouts."""
    b, s_local, h, hk, d = 2, 12, 4, 2, 16
    s = s_local * world
    checks = []
    for op, causal, layout in LAYOUT_CASES:
        q, k, v, dout, _ = draw(6, b, s, h, hk, d, torch.float16)
        j = int(positions(s_local, world, 0, layout)[s_local - 2])   # a late key: causal rows before it miss it
        clean = _one_process(q, k, v, dout, causal)
        v = v.clone()
        v[0, j, 0, 2] = float("inf")
        got = _forward_backward(op, causal, layout, rank, world, q, k, v, dout)
        checks.append((f"{op.__name__} causal={causal} layout={layout}", j, causal, got, clean))
    for where, j, causal, got, clean in checks:
        rows = torch.arange(j, s) if causal else torch.arange(s)   # the rows that attend key j
        heads = [hh for hh in range(h) if hh * hk // h == 0]      # the query heads of KV head 0
        assert not torch.isfinite(got[0][0][rows][:, heads, 2]).any(), (where, "a row attending the inf is finite")
        for name, g, c in zip(("out", "dq", "dk", "dv"), got, clean):
            fin = torch.isfinite(g)
            assert fin.any(), (where, name)
            assert rel_l2(g[fin], c[fin]) < 1e-2, (where, name, rel_l2(g[fin], c[fin]))


@case(2)
def shard_and_gather_sequence(rank, world):
    """shard_sequence cuts the ranks' slices as the layouts say (checked against positions());
    gather_sequence puts them back, along any dim."""
    x = torch.randn(2, 24, 3, 5, generator=torch.Generator().manual_seed(7))
    results = []
    for layout in ("contiguous", "zigzag"):
        for dim in (1, 0 if layout == "contiguous" else 2):
            y = x if dim == 1 else x.transpose(1, dim)   # the sequence along another dim
            mine = shard_sequence(y, layout=layout, dim=dim)
            results.append((layout, dim, y, mine, gather_sequence(mine, layout=layout, dim=dim)))
    for layout, dim, y, mine, back in results:
        want = local_slice(y, rank, world, layout, dim=dim)
        assert torch.equal(mine, want), (layout, dim)
        assert torch.equal(back, y), (layout, dim)


@case(2)
def bad_inputs_are_refused_before_any_communication(rank, world):
    q = torch.randn(1, 8, 4, 16)
    kv = torch.randn(1, 8, 2, 16)
    with no_communication():
        with pytest.raises(ValueError, match=r"heads \(3\) and kv_heads \(1\) must be multiples of 2"):
            ulysses_attention(torch.randn(1, 8, 3, 16), torch.randn(1, 8, 1, 16), torch.randn(1, 8, 1, 16))
        with pytest.raises(ValueError, match=r"heads \(4\) and kv_heads \(1\) must be multiples of 2"):
            ulysses_attention(q, torch.randn(1, 8, 1, 16), torch.randn(1, 8, 1, 16))
        with pytest.raises(ValueError, match="zigzag.*seqlen_local must be even, got 7"):
            ring_attention(q[:, :7], kv[:, :7], kv[:, :7], causal=True, layout="zigzag")
        with pytest.raises(ValueError, match="layout must be one of"):
            ring_attention(q, kv, kv, layout="zig-zag")
        for op in (ulysses_attention, ring_attention):
            with pytest.raises(ValueError, match="attention must be one of"):
                op(q, kv, kv, attention="fp4")
            g = [torch.randn(1, 8, n, 64, dtype=torch.bfloat16, requires_grad=True) for n in (4, 2, 2)]
            with pytest.raises(ValueError, match="attention='fp8' has no backward"):
                op(*g, attention="fp8")
            with pytest.raises(ValueError, match="share \\(batch, seqlen_local\\)"):
                op(q, kv[:, :6], kv[:, :6])
            with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
                op(q, kv, kv, group=0)
            with pytest.raises(ValueError, match="key_padding_mask"):
                op(q, kv, kv, key_padding_mask=torch.ones(1, 9, dtype=torch.bool))   # P > seqlen_local
        with pytest.raises(ValueError, match="zigzag.*2 ranks.*4 equal chunks"):
            shard_sequence(torch.randn(1, 10, 2, 4), layout="zigzag")
        with pytest.raises(ValueError, match="layout must be one of"):
            gather_sequence(q, layout="diagonal")


@case(2)
def fp8_forward(rank, world):
    """attention='fp8' (bf16, head_dim 64) under no_grad on inputs that require grad.

    Ulysses: each rank runs one FP8 call on the whole sequence for its heads; the quantization's
    statistics are per (sequence, KV head) and per token / key block, so the result is the bits of
    one-process flash_attn_fp8_func. Ring: one FP8 call per K/V slice, each smoothing K by its own
    slice's mean and scaling by its own blocks, merged by LSE: not the same bits, but as close to
    one-process FP8 and to exact attention as FP8 is."""
    b, s_local, h, hk, d = 1, 16, 4, 2, 64
    s = s_local * world
    q, k, v, _, _ = draw(5, b, s, h, hk, d, torch.bfloat16)
    local = [local_slice(t, rank, world).requires_grad_() for t in (q, k, v)]
    with torch.no_grad():
        uly = gather_whole(ulysses_attention(*local, attention="fp8"), world)
        ring = gather_whole(ring_attention(*local, attention="fp8"), world)
        one = flash_attn_fp8_func(q, k, v)
    exact = attention_naive(q.double(), k.double(), v.double())
    assert uly.dtype == torch.bfloat16 and ring.dtype == torch.bfloat16
    assert torch.equal(uly, one), f"ulysses fp8 differs from one-process fp8 by {(uly.float() - one.float()).abs().max()}"
    assert cosine(ring, one) > FP8_EXACT_COSINE, ("ring vs one-process fp8", cosine(ring, one))
    for name, got in (("ulysses", uly), ("ring", ring)):
        assert cosine(got, exact) > FP8_EXACT_COSINE and rel_l1(got, exact) < FP8_EXACT_REL_L1, \
            (name, cosine(got, exact), rel_l1(got, exact))


@case(2, 4)
def context_attention_one_group(rank, world):
    """context_attention with one of its groups None: Ulysses alone (its head groups, each group's
    exchange under the previous group's attention: 1, 2, the default, and a count that does not
    divide the heads per rank, which falls back to 1) and the ring alone, with and without a mask.
    Every head is computed alone whatever the grouping: the same bits for every head_groups."""
    b, s_local, h, hk, d = 2, 9, 4 * world, 2 * world, 24
    s = s_local * world
    runs = []
    for dtype, mask_p in ((torch.float16, None), (torch.float32, 6)):
        q, k, v, _, _ = draw(13, b, s, h, hk, d, dtype)
        masks = None if mask_p is None else draw_masks(13, world, b, mask_p)
        local = [local_slice(t, rank, world) for t in (q, k, v)]
        kw = dict(key_padding_mask=None if masks is None else masks[rank])
        for groups in (1, 2, None, 3):   # kv heads per rank: 2, so 3 does not divide
            out = context_attention(*local, dist.group.WORLD, None, head_groups=groups, **kw)
            runs.append((f"ulysses head_groups={groups}", dtype, mask_p, q, k, v, masks, out, gather_whole(out, world)))
        out = context_attention(*local, None, dist.group.WORLD, **kw)
        runs.append(("ring", dtype, mask_p, q, k, v, masks, out, gather_whole(out, world)))
    for what, dtype, mask_p, q, k, v, masks, out, got in runs:
        where = f"context_attention {what} {dtype} mask_p={mask_p}"
        assert out.shape == (b, s_local, h, d) and out.dtype == dtype, (where, out.shape, out.dtype)
        full = None if masks is None else whole_mask(masks, s_local, world)
        ref = attention_naive(q.double(), k.double(), v.double(), key_padding_mask=full)
        assert rel_l2(got, ref) < FWD_TOL[dtype], (where, rel_l2(got, ref))
    for i in range(0, len(runs), 5):   # the Ulysses runs of one input: one answer
        for what, *_, got in runs[i + 1:i + 4]:
            assert torch.equal(got, runs[i][-1]), (what, runs[i][1], "differs from head_groups=1")


@case(2)
def context_attention_exchange_choice(rank, world):
    """``exchange``: "nccl" and "auto" run gloo's all-to-all (the peer path needs NCCL and CUDA):
    the same bits; "peer" on gloo, "peer" with a ring, and a wrong name are refused
    with a ValueError before anything is sent (the ranks stay in step: the next call runs);
    FLASHFLOW_ULYSSES_EXCHANGE is read when ``exchange`` is not given."""
    import os

    b, s_local, h, hk, d = 1, 7, 2 * world, 2 * world, 16
    q, k, v, _, _ = draw(17, b, s_local * world, h, hk, d, torch.float32)
    local = [local_slice(t, rank, world) for t in (q, k, v)]
    group = dist.group.WORLD
    outs = [context_attention(*local, group, None, exchange=mode) for mode in ("nccl", "auto", None)]
    refusals = []
    for kw, match in ((dict(exchange="peer"), "needs CUDA tensors and an NCCL group"),
                      (dict(exchange="nvlink"), "exchange must be one of"),
                      (dict(exchange="peer", head_groups=2), "needs CUDA tensors and an NCCL group")):
        try:
            context_attention(*local, group, None, **kw)
            refusals.append((kw, "not refused"))
        except ValueError as e:
            refusals.append((kw, None if match in str(e) else str(e)))
    ring_refusal = None
    try:
        context_attention(*local, None, group, exchange="peer")
    except ValueError as e:
        ring_refusal = str(e)
    os.environ["FLASHFLOW_ULYSSES_EXCHANGE"] = "bogus"
    try:
        context_attention(*local, group, None)
        env_refusal = "not refused"
    except ValueError as e:
        env_refusal = str(e)
    finally:
        del os.environ["FLASHFLOW_ULYSSES_EXCHANGE"]
    after = context_attention(*local, group, None)   # still in step after the refusals
    got = gather_whole(outs[0], world)
    assert rel_l2(got, attention_naive(q.double(), k.double(), v.double())) < FWD_TOL[torch.float32]
    assert all(torch.equal(o, outs[0]) for o in outs[1:] + [after])
    assert all(r is None for _, r in refusals), refusals
    assert ring_refusal is not None and "ring degree 2" in ring_refusal, ring_refusal
    assert "FLASHFLOW_ULYSSES_EXCHANGE must be one of" in env_refusal, env_refusal


@case(2)
def context_attention_quantized_exchange_rule(rank, world):
    """Which Ulysses calls take the 8-bit exchange (PeerUlysses.attend_fp8): FP8 attention through
    peer memory, one head group, at least QUANTIZED_EXCHANGE_MIN_TOKENS tokens a rank,
    QUANTIZED_EXCHANGE on; every other call the 16-bit one. K shorter than q is refused before
    anything is sent. The peer path is stood
    in for (it needs NCCL and CUDA): a stand-in that records the call and declines it, so gloo's
    all-to-all answers, and the answer is checked too."""
    from flashflow.distributed import attention as dist_attention

    calls = []

    class StandIn:
        def attend_fp8(self, q, k, v, *args, **kwargs):
            calls.append(("8-bit", q.shape[1], k.shape[1]))

        def attend(self, tensors, attend, groups=1):
            calls.append(("16-bit", groups))

    saved = dist_attention.peer_ulysses, dist_attention.QUANTIZED_EXCHANGE, dist_attention.QUANTIZED_EXCHANGE_MIN_TOKENS
    dist_attention.peer_ulysses = lambda group, device, mode: StandIn()
    try:
        b, s_local, h, d = 1, 6, 2 * world, 64
        q, k, v, _, _ = draw(23, b, s_local * world, h, h, d, torch.bfloat16)
        local = [local_slice(t, rank, world) for t in (q, k, v)]
        group = dist.group.WORLD
        dist_attention.QUANTIZED_EXCHANGE_MIN_TOKENS = s_local
        expect = []
        for attention, groups, min_tokens, on, want in (
                ("fp8", None, s_local, True, "8-bit"),
                ("exact", None, s_local, True, "16-bit"),
                ("fp8", 2, s_local, True, "16-bit"),
                ("fp8", None, s_local + 1, True, "16-bit"),
                ("fp8", None, s_local, False, "16-bit")):
            dist_attention.QUANTIZED_EXCHANGE_MIN_TOKENS, dist_attention.QUANTIZED_EXCHANGE = min_tokens, on
            before = len(calls)
            out = context_attention(*local, group, None, attention=attention, head_groups=groups, exchange="auto")
            kinds = [c[0] for c in calls[before:]]
            expect.append((attention, groups, min_tokens, on, kinds))
            assert kinds[0] == want and (want == "16-bit" or kinds[1:] == ["16-bit"]), expect[-1]
            assert out.shape == local[0].shape and not out.isnan().any()
        try:
            context_attention(local[0], local[1][:, 1:], local[2][:, 1:], group, None, attention="fp8")
            refusal = "not refused"
        except ValueError as e:
            refusal = str(e)
        assert "must share (batch, seqlen_local)" in refusal and len(calls) == before + 1, refusal
        got = gather_whole(context_attention(*local, group, None, attention="fp8"), world)
        assert rel_l2(got, attention_naive(q.double(), k.double(), v.double())) < 0.05
    finally:
        dist_attention.peer_ulysses, dist_attention.QUANTIZED_EXCHANGE, \
            dist_attention.QUANTIZED_EXCHANGE_MIN_TOKENS = saved


# ---------------------------------------------------------------------------------------------
# 4 ranks: the cases registered for (2, 4) above, and context_attention over a 2 × 2 mesh
# ---------------------------------------------------------------------------------------------


@case(4)
def ulysses_four_ranks_gqa_causal(rank, world):
    check_attention(rank, world, ulysses_attention, b=1, s_local=9, h=8, hk=4, d=24, dtype=torch.float16,
                    causal=True)


@case(4)
def ring_four_ranks_gqa_fp16(rank, world):
    check_attention(rank, world, ring_attention, b=2, s_local=9, h=4, hk=2, d=24, dtype=torch.float16)


@case(4)
def context_attention_ulysses_2_by_ring_2(rank, world):
    """Ulysses groups {0,1}, {2,3} inside ring groups {0,2}, {1,3}: the flattened rank
    ring_rank·2 + ulysses_rank is the global rank, which holds that slice of the sequence."""
    assert world == 4
    ulysses_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]   # every rank creates every group
    ring_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ug, rg = ulysses_groups[rank // 2], ring_groups[rank % 2]
    assert dist.get_rank(rg) * 2 + dist.get_rank(ug) == rank
    b, s_local, h, hk, d = 2, 10, 4, 2, 24
    s = s_local * world
    results = []
    for dtype, mask_p, scale in ((torch.float16, None, None), (torch.float32, 7, 0.25), (torch.float16, 10, None)):
        q, k, v, _, _ = draw(11, b, s, h, hk, d, dtype)
        masks = None if mask_p is None else draw_masks(11, world, b, mask_p)
        out = context_attention(*(local_slice(t, rank, world) for t in (q, k, v)), ug, rg,
                                key_padding_mask=None if masks is None else masks[rank], softmax_scale=scale)
        results.append((dtype, mask_p, scale, q, k, v, masks, out, gather_whole(out, world)))
    for dtype, mask_p, scale, q, k, v, masks, out, got in results:
        where = f"context_attention {dtype} mask_p={mask_p} scale={scale}"
        assert out.shape == (b, s_local, h, d) and out.dtype == dtype, (where, out.shape, out.dtype)
        full = None if masks is None else whole_mask(masks, s_local, world)
        ref = attention_naive(q.double(), k.double(), v.double(), scale, key_padding_mask=full)
        assert rel_l2(got, ref) < FWD_TOL[dtype], (where, rel_l2(got, ref))


# ---------------------------------------------------------------------------------------------
# in the pytest process
# ---------------------------------------------------------------------------------------------


def test_without_torch_distributed_initialised_every_entry_point_says_so():
    if dist.is_initialized():
        pytest.skip("this process has a default group")
    q = torch.randn(1, 4, 2, 16)
    for call in (lambda: ulysses_attention(q, q, q), lambda: ring_attention(q, q, q),
                 lambda: shard_sequence(q), lambda: gather_sequence(q)):
        with pytest.raises(ValueError, match="needs torch.distributed initialised"):
            call()


# after every case is registered: one test per case and world size
@pytest.mark.parametrize("name", list(CASES[2]))
def test_two_ranks(name):
    check_spawned_case(2, name)


@pytest.mark.parametrize("name", list(CASES[4]))
def test_four_ranks(name):
    check_spawned_case(4, name)
