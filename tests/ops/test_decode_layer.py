"""The decode-layer megakernel in Triton's interpreter, tiny Llama config: several steps with the
caches growing against the float64 reference layer (contiguous and paged caches, one and several
key splits, batch 1 and 3), fewer programs than tasks, shuffled task orders giving the same bits,
an order that is not topological reported instead of hanging, layouts, NaN, bad input."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from flashflow.ops.decode_layer import (TINY_LLAMA, DecodeLayerPlan, LayerConfig, LayerWeights, build_tasks,
                                        decode_layer, decode_layer_bytes, decode_step, dependency_violations,
                                        fold_norms, random_layer_weights, LLAMA3_8B)
from flashflow.kernels.decode_layer import _norm_task, counters
from flashflow.reference.decode_layer import decode_layer_reference

C = TINY_LLAMA
CAP = 48
PAGE = 16


def _case(batch, dtype=torch.float32, paged=False, seed=0, lens=None):
    """Weights, caches (contiguous or as shuffled pages), cache_seqlens and the block table."""
    g = torch.Generator().manual_seed(seed)
    w = random_layer_weights(C, dtype, "cpu", seed=seed + 1)
    kc = torch.randn(batch, CAP, C.kv_heads, C.head_dim, generator=g).to(dtype)
    vc = torch.randn(batch, CAP, C.kv_heads, C.head_dim, generator=g).to(dtype)
    lens = torch.tensor(lens or [5, 17, 0][:batch], dtype=torch.int32)
    table = None
    if paged:
        per = CAP // PAGE
        table = torch.randperm(batch * per, generator=g).reshape(batch, per).int()
        kp = torch.full((batch * per, PAGE, C.kv_heads, C.head_dim), float("nan")).to(dtype)
        vp = kp.clone()
        kp[table.flatten().long()] = kc.reshape(batch * per, PAGE, C.kv_heads, C.head_dim)
        vp[table.flatten().long()] = vc.reshape(batch * per, PAGE, C.kv_heads, C.head_dim)
        kc, vc = kp, vp
    return w, kc, vc, lens, table


def _logical(cache, table):
    """A (batch, capacity, kv_heads, d) view of a cache, paged or not."""
    if table is None:
        return cache
    return cache[table.long()].flatten(1, 2)


def _ref_state(w, kc, vc, table):
    wd = {k: v.double() for k, v in w.as_dict().items()}
    return wd, _logical(kc, table).double().clone(), _logical(vc, table).double().clone()


def _ref_step(x, wd, kref, vref, lens):
    out, kn, vn = decode_layer_reference(x.double(), wd, kref, vref, lens, heads=C.heads, kv_heads=C.kv_heads,
                                         eps=C.eps, rope_theta=C.rope_theta)
    for b, n in enumerate(lens.tolist()):
        kref[b, n], vref[b, n] = kn[b], vn[b]
    return out


@pytest.mark.parametrize("batch,paged,num_splits", [(1, False, 0), (3, False, 3), (3, True, 2)],
                         ids=["b1-contiguous", "b3-contiguous-3splits", "b3-paged-2splits"])
def test_steps_with_a_growing_cache_match_the_float64_reference(batch, paged, num_splits):
    w, kc, vc, lens, table = _case(batch, paged=paged)
    plan = DecodeLayerPlan(C, batch, CAP, device="cpu", dtype=torch.float32, page_size=PAGE if paged else None,
                           num_splits=num_splits)
    assert plan.num_splits == (num_splits or plan.num_splits) and plan.programs < plan.num_tasks
    wd, kref, vref = _ref_state(w, kc, vc, table)
    g = torch.Generator().manual_seed(7)
    steps = 3
    for step in range(steps):
        x = torch.randn(batch, C.hidden, generator=g)
        out = torch.full((batch, C.hidden), float("nan"))
        got = plan.run(x, w, kc, vc, lens, table, out=out)
        assert got is out
        ref = _ref_step(x, wd, kref, vref, lens)
        err = (got.double() - ref).abs().max().item()
        assert err < 2e-5 * ref.abs().max().item(), (step, err)
        # the appended rows (every cached row compared: nothing else was written)
        n = int(lens.max()) + 1
        for got_c, ref_c in ((_logical(kc, table), kref), (_logical(vc, table), vref)):
            for b in range(batch):
                m = int(lens[b]) + 1
                assert (got_c[b, :m].double() - ref_c[b, :m]).abs().max() < 1e-5, (step, b)
        assert n <= CAP
        lens += 1
    # nothing was reset between the steps: the ticket and every counter only grew
    sync, cnt = plan.sync, plan.counters
    assert int(sync[0]) == steps * (plan.num_tasks + plan.programs)
    assert int(sync[2]) == 0
    assert int(sync[cnt.o_ready]) == steps * batch * C.kv_heads
    assert int(sync[cnt.done]) == steps * (C.hidden // plan.tiles.BLOCK_N)
    if plan.num_splits > 1:
        assert sync[cnt.merge:cnt.merge + batch * C.kv_heads].tolist() == [steps * plan.num_splits] * (batch * C.kv_heads)


def test_bfloat16_inputs_match_the_reference_to_bf16_rounding():
    w, kc, vc, lens, _ = _case(3, dtype=torch.bfloat16)
    wd, kref, vref = _ref_state(w, kc, vc, None)
    x = torch.randn(3, C.hidden, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = decode_layer(x, w, kc, vc, lens, C)
    ref = _ref_step(x, wd, kref, vref, lens)
    assert out.dtype == torch.bfloat16
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel
    for b in range(3):
        assert (kc[b, int(lens[b])].double() - kref[b, int(lens[b])]).abs().max() < 0.05


def _steps(plan, w, kc, vc, lens, table, seed, steps=3, weights=None):
    """``steps`` steps of ``plan`` (on ``weights``, default ``w``) against the float64 layer of
    ``w``, the caches growing, outputs poisoned with NaN; x's rms changes from step to step.
    Checks each output and appended key and value."""
    wd, kref, vref = _ref_state(w, kc, vc, table)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(plan.batch, C.hidden, generator=g) * (1 + step)
        got = plan.run(x, weights or w, kc, vc, lens, table, out=torch.full((plan.batch, C.hidden), float("nan")))
        ref = _ref_step(x, wd, kref, vref, lens)
        err = (got.double() - ref).abs().max().item()
        assert err < 2e-5 * ref.abs().max().item(), (step, err)
        for b, n in enumerate(lens.tolist()):
            for cache, r in ((kc, kref), (vc, vref)):
                assert (_logical(cache, table)[b, n].double() - r[b, n]).abs().max() < 2e-5 * r[b, n].abs().max()
        lens += 1


def _run(plan, w, kc, vc, lens, table=None, x=None):
    kc, vc = kc.clone(), vc.clone()
    if x is None:
        x = torch.randn(plan.batch, C.hidden, generator=torch.Generator().manual_seed(11))
    out = plan.run(x, w, kc, vc, lens, table)
    return out, kc, vc


def test_fewer_programs_than_tasks_and_any_program_count_give_the_same_bits():
    w, kc, vc, lens, _ = _case(3)
    base = _run(DecodeLayerPlan(C, 3, CAP, device="cpu", dtype=torch.float32, num_splits=2), w, kc, vc, lens)
    for programs in (1, 2, 3):
        plan = DecodeLayerPlan(C, 3, CAP, device="cpu", dtype=torch.float32, num_splits=2, num_programs=programs)
        assert plan.programs == programs < plan.num_tasks
        got = _run(plan, w, kc, vc, lens)
        assert all(torch.equal(a, b) for a, b in zip(got, base)), programs


def test_shuffled_task_orders_are_topological_and_give_the_same_bits():
    w, kc, vc, lens, table = _case(3, paged=True)
    kw = dict(device="cpu", dtype=torch.float32, num_splits=3, page_size=PAGE)
    plain = DecodeLayerPlan(C, 3, CAP, **kw)
    base = _run(plain, w, kc, vc, lens, table)
    for seed in (1, 2):
        plan = DecodeLayerPlan(C, 3, CAP, shuffle=seed, num_programs=2, **kw)
        assert sorted(plan.task_list) == sorted(plain.task_list) and plan.task_list != plain.task_list
        assert dependency_violations(plan.task_list, plan.num_splits) == []
        # not the stages one after another: some attention task comes before the last QKV task
        stages = [t[0] for t in plan.task_list]
        assert stages.index(1) < len(stages) - 1 - stages[::-1].index(0)
        got = _run(plan, w, kc, vc, lens, table)
        assert all(torch.equal(a, b) for a, b in zip(got, base)), seed


def test_an_order_that_is_not_topological_raises_instead_of_hanging():
    w, kc, vc, lens, _ = _case(1)
    plan = DecodeLayerPlan(C, 1, CAP, device="cpu", dtype=torch.float32, num_programs=1, spin_limit=20)
    tasks = plan.task_list
    first_o = [t[0] for t in tasks].index(2)
    # the whole order backwards, and one O-projection task moved before the QKV tasks: each
    # stage's own wait must catch it
    for order in (tasks[::-1], [tasks[first_o]] + tasks[:first_o] + tasks[first_o + 1:]):
        assert dependency_violations(order, plan.num_splits)
        plan.tasks = torch.tensor(order, dtype=torch.int32).reshape(plan.tasks.shape)
        with pytest.raises(RuntimeError, match="ran out of spins"):
            _run(plan, w, kc, vc, lens)
        assert int(plan.sync.abs().sum()) == 0   # reset for the next call
    plan.tasks = torch.tensor(plan.task_list, dtype=torch.int32).reshape(plan.tasks.shape)
    base = _run(DecodeLayerPlan(C, 1, CAP, device="cpu", dtype=torch.float32), w, kc, vc, lens)
    assert all(torch.equal(a, b) for a, b in zip(_run(plan, w, kc, vc, lens), base))


def test_task_table_counts():
    tiles = DecodeLayerPlan(C, 2, CAP, device="cpu", dtype=torch.float32).tiles
    tasks = build_tasks(C, 2, 3, tiles)
    stages = [t[0] for t in tasks]
    per_head = C.head_dim // 2 // tiles.QKV_PAIRS
    assert stages.count(0) == (C.heads + 2 * C.kv_heads) * per_head
    assert stages.count(1) == 2 * C.kv_heads * 3
    assert stages.count(2) == stages.count(4) == C.hidden // tiles.BLOCK_N
    assert stages.count(3) == -(-C.intermediate // tiles.BLOCK_I)
    # a norm row of x per sequence first, one of h per sequence between the O and gate/up tiles
    assert stages.count(5) == 2 * 2
    norm_x, rest = stages[:2], stages[2:]
    first_gu = rest.index(3)
    assert norm_x == [5, 5] and rest[first_gu - 2:first_gu] == [5, 5]
    del rest[first_gu - 2:first_gu]
    assert rest == sorted(rest) and dependency_violations(tasks, 3) == []
    assert [t[1] for t in tasks if t[0] == 5] == [0, 0, 1, 1]


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded"])
def test_layouts_non_contiguous_inputs_are_taken(folded):
    """Folded: x is the QKV dot's operand as given (no norm row in between), strides and all."""
    w, kc, vc, lens, _ = _case(3)
    w = fold_norms(w) if folded else w
    x = torch.randn(3, C.hidden, generator=torch.Generator().manual_seed(5))
    plan = DecodeLayerPlan(C, 3, CAP, device="cpu", dtype=torch.float32, folded_norms=folded)
    base = _run(plan, w, kc, vc, lens, x=x)
    # x with a non-unit last stride, weights as transposed views, out a slice of a wider buffer
    xt = x.t().contiguous().t()
    wt = LayerWeights(**{k: (None if v is None else v.t().contiguous().t() if v.dim() == 2
                             else v[None].expand(2, -1)[1]) for k, v in w.as_dict().items()})
    assert xt.stride(-1) != 1 and wt.qkv.stride(-1) != 1
    kc2, vc2 = kc.clone(), vc.clone()
    wide = torch.full((3, 2 * C.hidden), float("nan"))
    out = plan.run(xt, wt, kc2, vc2, lens, out=wide[:, 1:C.hidden + 1])
    assert torch.equal(out, base[0]) and torch.equal(kc2, base[1]) and torch.equal(vc2, base[2])
    assert wide[:, 0].isnan().all() and wide[:, C.hidden + 1:].isnan().all()
    # one row broadcast to the batch (stride 0)
    x1 = x[:1].expand(3, -1)
    out1 = _run(plan, w, kc, vc, lens, x=x1)[0]
    ref = _run(plan, w, kc, vc, lens, x=x1.contiguous())[0]
    assert torch.equal(out1, ref)
    # written tensors that overlap themselves are refused
    with pytest.raises(ValueError, match="out is written by the kernel and must not overlap"):
        plan.run(x, w, kc.clone(), vc.clone(), lens, out=torch.empty(1, C.hidden).expand(3, -1))
    with pytest.raises(ValueError, match="k_cache is written by the kernel and must have a unit stride"):
        plan.run(x, w, kc.transpose(-1, -2).contiguous().transpose(-1, -2), vc.clone(), lens)


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded"])
def test_nan_in_one_row_stays_in_its_sequence(folded):
    w, kc, vc, lens, _ = _case(3)
    x = torch.randn(3, C.hidden, generator=torch.Generator().manual_seed(5))
    x[1, 7] = float("nan")
    plan = DecodeLayerPlan(C, 3, CAP, device="cpu", dtype=torch.float32, num_splits=2, folded_norms=folded)
    out, k2, v2 = _run(plan, fold_norms(w) if folded else w, kc, vc, lens, x=x)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()
    assert k2[1, int(lens[1])].isnan().all() and v2[1, int(lens[1])].isnan().all()
    assert k2[[0, 2]].isfinite().all() and v2[[0, 2]].isfinite().all()


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded"])
def test_inf_in_a_row_and_nan_in_a_cache_stay_in_their_sequence(folded):
    """An inf in x (its norm row turns NaN, as torch's RMSNorm does; folded: 1 / rms is 0 and
    the dot inf) and a NaN cached value of another sequence: the other sequences' outputs and
    appended rows stay finite."""
    w, kc, vc, lens, _ = _case(3)
    x = torch.randn(3, C.hidden, generator=torch.Generator().manual_seed(6))
    x[0, 3] = float("inf")
    vc = vc.clone()
    vc[2, 1, 0, 5] = float("nan")   # a cached value of sequence 2 (4 tokens cached)
    lens = torch.tensor([5, 17, 4], dtype=torch.int32)
    plan = DecodeLayerPlan(C, 3, CAP, device="cpu", dtype=torch.float32, num_splits=2, folded_norms=folded)
    out, k2, v2 = _run(plan, fold_norms(w) if folded else w, kc, vc, lens, x=x)
    assert not out[0].isfinite().any() and not out[2].isfinite().any() and out[1].isfinite().all()
    assert not k2[0, 5].isfinite().any() and k2[1, 17].isfinite().all() and k2[2, 4].isfinite().all()


def test_decode_step_runs_every_layer_and_advances_the_cache():
    layers = [random_layer_weights(C, torch.float32, "cpu", seed=s) for s in (3, 4)]
    _, kc, vc, lens, _ = _case(2)
    caches = [(kc.clone(), vc.clone()), (kc.clone() * 0.5, vc.clone() * 2)]
    refs = [_ref_state(w, k, v, None) for w, (k, v) in zip(layers, caches)]
    plan = DecodeLayerPlan(C, 2, CAP, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(9)
    for _ in range(2):
        x = torch.randn(2, C.hidden, generator=g)
        ref_lens = lens.clone()
        got = decode_step(plan, layers, caches, x, lens)
        assert torch.equal(lens, ref_lens + 1)
        h = x.double()
        for wd, kref, vref in refs:
            h = _ref_step(h, wd, kref, vref, ref_lens)
        assert (got.double() - h).abs().max() < 2e-5 * h.abs().max()


def _bad(name):
    w, kc, vc, lens, _ = _case(2)
    x = torch.randn(2, C.hidden)
    args = dict(x=x, weights=w, k_cache=kc, v_cache=vc, cache_seqlens=lens, block_table=None)
    return args


BAD = [
    ("x", torch.randn(3, C.hidden), ValueError, r"x must have shape \(2, 128\)"),
    ("x", torch.randn(2, C.hidden).half(), TypeError, "x must be torch.float32"),
    ("x", "tensor", TypeError, "x must be a torch.Tensor"),
    ("x", torch.randn(2, C.hidden, requires_grad=True), ValueError, "grad"),
    ("weights", {"qkv": 1}, TypeError, "weights must be a flashflow LayerWeights"),
    ("k_cache", torch.randn(2, CAP, C.kv_heads, C.head_dim).to(torch.float8_e4m3fn), TypeError, "FP8"),
    ("k_cache", torch.randn(2, CAP + 1, C.kv_heads, C.head_dim), ValueError, "k_cache must have shape"),
    ("cache_seqlens", torch.tensor([1, 2]), TypeError, "cache_seqlens must be an int32 tensor"),
    ("cache_seqlens", torch.tensor([1, CAP], dtype=torch.int32), ValueError, r"cache_seqlens must be in .*\[0, 47\]"),
    ("cache_seqlens", torch.tensor([-1, 0], dtype=torch.int32), ValueError, "cache_seqlens must be in"),
    ("block_table", torch.zeros(2, 3, dtype=torch.int32), ValueError, "block_table was given to a plan for a contiguous"),
]


@pytest.mark.parametrize("name,value,exc,match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_refused_before_any_launch(name, value, exc, match):
    args = _bad(name)
    args[name] = value
    plan = DecodeLayerPlan(C, 2, CAP, device="cpu", dtype=torch.float32)
    with pytest.raises(exc, match=match):
        plan.run(**args)
    assert int(plan.sync.abs().sum()) == 0   # nothing launched


def test_bad_weights_and_plans_are_refused():
    w, kc, vc, lens, _ = _case(2)
    plan = DecodeLayerPlan(C, 2, CAP, device="cpu", dtype=torch.float32)
    bad = LayerWeights(**{**w.as_dict(), "down": w.down[:, :-1]})
    with pytest.raises(ValueError, match=r"weights.down must have shape \(128, 160\)"):
        plan.run(torch.randn(2, C.hidden), bad, kc, vc, lens)
    with pytest.raises(ValueError, match="batch must be at most 16"):
        DecodeLayerPlan(C, 17, CAP, device="cpu", dtype=torch.float32)
    with pytest.raises(TypeError, match="batch must be an int"):
        DecodeLayerPlan(C, 2.0, CAP, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        LayerConfig(hidden=96, heads=4, kv_heads=2, head_dim=24, intermediate=64)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        LayerConfig(hidden=96, heads=3, kv_heads=2, head_dim=32, intermediate=64)
    with pytest.raises(ValueError, match="capacity .* multiple of page_size"):
        DecodeLayerPlan(C, 2, CAP, device="cpu", dtype=torch.float32, page_size=10)
    with pytest.raises(TypeError, match="block_table must be an int32 tensor of shape"):
        DecodeLayerPlan(C, 2, CAP, device="cpu", dtype=torch.float32, page_size=PAGE).run(
            torch.randn(2, C.hidden), w, kc.view(-1, PAGE, C.kv_heads, C.head_dim),
            vc.view(-1, PAGE, C.kv_heads, C.head_dim), lens)
    with pytest.raises(TypeError, match="dtype must be one of"):
        DecodeLayerPlan(C, 2, CAP, device="cpu", dtype=torch.int8)


def test_bytes_per_step():
    # a Llama-3-8B layer holds 218,103,808 matrix weights and two norms of 4096
    params = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 14336 * 4096
    assert params == 218_103_808
    kv = 2 * 8 * 1000 * 128
    assert decode_layer_bytes(LLAMA3_8B, 1, 1000) == 2 * (params + 2 * 4096 + kv + 2 * 8 * 128 + 2 * 4096)
    assert decode_layer_bytes(LLAMA3_8B, 16, 0, itemsize=1) == params + 2 * 4096 + 16 * 2 * 8 * 128 + 2 * 16 * 4096


def test_plans_kept_without_one_are_per_stream_and_bounded(monkeypatch):
    import importlib

    dl = importlib.import_module("flashflow.ops.decode_layer")
    monkeypatch.setattr(dl, "_PLANS", type(dl._PLANS)())
    monkeypatch.setattr(dl, "_PLANS_MAX", 1)
    w, kc, vc, lens, _ = _case(2)
    x = torch.randn(2, C.hidden)
    out = {}
    for stream in (1, 2, 2):
        monkeypatch.setattr(dl, "stream_key", lambda device, s=stream: s)
        decode_layer(x, w, kc.clone(), vc.clone(), lens, C)
        out[stream] = next(iter(dl._PLANS.values()))
        assert len(dl._PLANS) == 1       # the least recently used plan was dropped
    assert out[1] is not out[2]          # a second stream never shares the first one's counters
    assert next(iter(dl._PLANS))[-1] == 2


# --------------------------------------------------------------------------------------------
# split-K: the O and down column blocks in K slices, merged by the last slice to arrive
# --------------------------------------------------------------------------------------------


def _split_tiles(split_k):
    import dataclasses
    base = DecodeLayerPlan(C, 1, CAP, device="cpu", dtype=torch.float32).tiles
    return dataclasses.replace(base, SPLIT_K=split_k)


@pytest.mark.parametrize("split_k", [2, 3], ids=["2-slices", "3-slices-one-empty"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_split_k_steps_match_the_float64_reference(split_k, paged):
    """O (K = 128: with 3 slices of 64 the last is empty) and down (K = 160) in K slices, over
    three steps with the caches growing; every merge counter counts its slices."""
    batch = 3
    w, kc, vc, lens, table = _case(batch, paged=paged)
    plan = DecodeLayerPlan(C, batch, CAP, device="cpu", dtype=torch.float32, page_size=PAGE if paged else None,
                           num_splits=2, config_tiles=_split_tiles(split_k))
    steps = 3
    _steps(plan, w, kc, vc, lens, table, 7, steps)
    sync, cnt = plan.sync, plan.counters
    columns = C.hidden // plan.tiles.BLOCK_N
    assert sync[cnt.col_merge:cnt.col_merge + 2 * columns].tolist() == [steps * split_k] * (2 * columns)
    assert int(sync[cnt.h1_ready]) == int(sync[cnt.done]) == steps * columns   # column blocks, not slices
    assert int(sync[0]) == steps * (plan.num_tasks + plan.programs)


def test_split_k_any_program_count_and_order_give_the_same_bits():
    w, kc, vc, lens, table = _case(3, paged=True)
    kw = dict(device="cpu", dtype=torch.float32, num_splits=2, page_size=PAGE, config_tiles=_split_tiles(3))
    plain = DecodeLayerPlan(C, 3, CAP, **kw)
    base = _run(plain, w, kc, vc, lens, table)
    for programs in (1, 2, 3):
        got = _run(DecodeLayerPlan(C, 3, CAP, num_programs=programs, **kw), w, kc, vc, lens, table)
        assert all(torch.equal(a, b) for a, b in zip(got, base)), programs
    for seed in (1, 2):
        plan = DecodeLayerPlan(C, 3, CAP, shuffle=seed, num_programs=2, **kw)
        assert plan.task_list != plain.task_list and dependency_violations(plan.task_list, 2) == []
        got = _run(plan, w, kc, vc, lens, table)
        assert all(torch.equal(a, b) for a, b in zip(got, base)), seed
    # split-K sums in another order than one slice: close to it, and the caches are the same bits
    one = _run(DecodeLayerPlan(C, 3, CAP, device="cpu", dtype=torch.float32, num_splits=2, page_size=PAGE), w, kc,
               vc, lens, table)
    assert (base[0] - one[0]).abs().max() < 1e-5 * one[0].abs().max()
    assert torch.equal(base[1], one[1]) and torch.equal(base[2], one[2])


def test_split_k_task_table():
    tiles = _split_tiles(4)
    tasks = build_tasks(C, 2, 3, tiles)
    stages = [t[0] for t in tasks]
    columns = C.hidden // tiles.BLOCK_N
    assert stages.count(2) == stages.count(4) == 4 * columns
    # slice by slice: every column block's slice 0, then slice 1, ...
    o = [t for t in tasks if t[0] == 2]
    assert [(t[1], t[2]) for t in o] == [(j, s) for s in range(4) for j in range(columns)]
    assert dependency_violations(tasks, 3) == []
    # O slices of 32 columns cut a KV head's 64 (2 query heads of 32): every O task waits on
    # all the attention; down slices of 64 hold whole 32-column gate/up tiles: each waits on its own
    cnt = counters(C, 2, columns, 4)
    assert {(t[4], t[5]) for t in o} == {(cnt.o_ready, 2 * C.kv_heads)}
    down = [t for t in tasks if t[0] == 4]
    gu = [t for t in tasks if t[0] == 3]
    assert [t[6] - cnt.act_ready for t in gu] == [0, 0, 1, 1, 2]
    assert [(t[4] - cnt.act_ready, t[5]) for t in down] == [(s, n) for s, n in enumerate((2, 2, 1, 0))
                                                            for _ in range(columns)]
    # a down task of slice 0 may run as soon as the first two gate/up tiles are done, not before
    first_down, i_gu = stages.index(4), stages.index(3)
    early = tasks[:i_gu + 2] + [tasks[first_down]] + [t for t in tasks[i_gu + 2:] if t != tasks[first_down]]
    assert dependency_violations(early, 3) == []
    early = tasks[:i_gu + 1] + [tasks[first_down]] + [t for t in tasks[i_gu + 1:] if t != tasks[first_down]]
    assert dependency_violations(early, 3) == [i_gu + 1]
    # two slices of 64 columns: an O task of slice 0 waits only on KV head 0's attention
    tasks2 = build_tasks(C, 2, 3, _split_tiles(2))
    cnt2 = counters(C, 2, columns, 2)
    o2 = [t for t in tasks2 if t[0] == 2]
    assert [(t[4] - cnt2.o_ready, t[5]) for t in o2] == [(s, 2) for s in range(2) for _ in range(columns)]
    att = [t for t in tasks2 if t[0] == 1]
    assert [t[6] - cnt2.o_ready for t in att] == [t[2] for t in att]
    last_kvh0 = max(i for i, t in enumerate(tasks2) if t[0] == 1 and t[2] == 0)
    first_o = [t[0] for t in tasks2].index(2)
    early = tasks2[:last_kvh0 + 1] + [tasks2[first_o]] + [t for t in tasks2[last_kvh0 + 1:] if t != tasks2[first_o]]
    assert dependency_violations(early, 3) == []
    # a gate/up task needs every row of HN: moving one before the last norm row breaks it
    first_gu = stages.index(3)
    assert stages[first_gu - 1] == 5
    bad = tasks[:first_gu - 1] + [tasks[first_gu], tasks[first_gu - 1]] + tasks[first_gu + 1:]
    assert dependency_violations(bad, 3) == [first_gu - 1]
    # a norm row of h needs every O column block merged: moving it before the last O slice breaks it
    first_hn = first_gu - 2
    assert stages[first_hn - 1] == 2 and stages[first_hn] == 5
    bad = tasks[:first_hn - 1] + [tasks[first_hn], tasks[first_hn - 1]] + tasks[first_hn + 1:]
    assert dependency_violations(bad, 3) == [first_hn - 1]


# --------------------------------------------------------------------------------------------
# QKV tiles in K slices, merged, roped and stored by the last slice to arrive
# --------------------------------------------------------------------------------------------


def _qkv_tiles(qkv_split, split_k=1):
    import dataclasses
    return dataclasses.replace(_split_tiles(split_k), QKV_SPLIT=qkv_split)


@pytest.mark.parametrize("qkv_split", [2, 3], ids=["2-slices", "3-slices-one-empty"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_qkv_slices_steps_match_the_float64_reference(qkv_split, paged):
    """QKV tiles over K = 128 in 2 slices of 64, or 3 (the last empty), over three steps with the
    caches growing: RoPE and the append after the merge; every merge counter counts its slices,
    the attention counters count tiles."""
    batch = 3
    w, kc, vc, lens, table = _case(batch, paged=paged)
    plan = DecodeLayerPlan(C, batch, CAP, device="cpu", dtype=torch.float32, page_size=PAGE if paged else None,
                           num_splits=2, config_tiles=_qkv_tiles(qkv_split))
    steps = 3
    _steps(plan, w, kc, vc, lens, table, 8, steps)   # the appended key roped after the merge
    sync, cnt = plan.sync, plan.counters
    tiles = (C.heads + 2 * C.kv_heads) * (C.head_dim // 2 // plan.tiles.QKV_PAIRS)
    assert cnt.words - cnt.qkv_merge == tiles
    assert sync[cnt.qkv_merge:cnt.words].tolist() == [steps * qkv_split] * tiles
    per_group = (C.heads // C.kv_heads + 2) * (C.head_dim // 2 // plan.tiles.QKV_PAIRS)
    assert sync[cnt.attn_ready:cnt.attn_ready + C.kv_heads].tolist() == [steps * per_group] * C.kv_heads


def test_qkv_slices_any_program_count_and_order_give_the_same_bits():
    w, kc, vc, lens, table = _case(3, paged=True)
    kw = dict(device="cpu", dtype=torch.float32, num_splits=2, page_size=PAGE, config_tiles=_qkv_tiles(3, 2))
    plain = DecodeLayerPlan(C, 3, CAP, **kw)
    base = _run(plain, w, kc, vc, lens, table)
    for programs in (1, 2):
        got = _run(DecodeLayerPlan(C, 3, CAP, num_programs=programs, **kw), w, kc, vc, lens, table)
        assert all(torch.equal(a, b) for a, b in zip(got, base)), programs
    plan = DecodeLayerPlan(C, 3, CAP, shuffle=5, num_programs=3, **kw)
    assert plan.task_list != plain.task_list and dependency_violations(plan.task_list, 2) == []
    got = _run(plan, w, kc, vc, lens, table)
    assert all(torch.equal(a, b) for a, b in zip(got, base))


def test_qkv_slices_task_table():
    tiles = _qkv_tiles(2)
    tasks = build_tasks(C, 2, 3, tiles)
    per_head = C.head_dim // 2 // tiles.QKV_PAIRS
    qkv = [t for t in tasks if t[0] == 0]
    # by KV group (its query heads, its key head, its value head), a tile's slices side by side
    heads = [h for kvh in range(C.kv_heads) for h in [kvh * 2, kvh * 2 + 1, C.heads + kvh, C.heads + C.kv_heads + kvh]]
    assert [t[1:4] for t in qkv] == [(h, p, s) for h in heads for p in range(per_head) for s in range(2)]
    assert dependency_violations(tasks, 3) == []
    # KV head 0's attention needs both slices of each of its tiles: one moved after it breaks it
    first_att = [t[0] for t in tasks].index(1)
    last_slice = max(i for i, t in enumerate(tasks) if t[0] == 0 and t[6] == qkv[0][6])
    bad = tasks[:last_slice] + tasks[last_slice + 1:first_att + 1] + [tasks[last_slice]] + tasks[first_att + 1:]
    assert dependency_violations(bad, 3) == [first_att - 1]


# --------------------------------------------------------------------------------------------
# folded norms: the norm weights in the QKV and gate/up weights, 1 / rms applied after the dot
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qkv_split,split_k", [(1, 1), (2, 2), (3, 3)], ids=["one-slice", "2-slices", "3-slices"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_folded_norms_steps_match_the_float64_reference(qkv_split, split_k, paged):
    """A folded plan on fold_norms' weights, three steps with the caches growing, against the
    float64 layer of the unfolded weights; no norm rows of h, the gate/up tasks counted."""
    batch = 3
    w, kc, vc, lens, table = _case(batch, paged=paged)
    plan = DecodeLayerPlan(C, batch, CAP, device="cpu", dtype=torch.float32, page_size=PAGE if paged else None,
                           num_splits=2, config_tiles=_qkv_tiles(qkv_split, split_k), folded_norms=True)
    steps = 3
    _steps(plan, w, kc, vc, lens, table, 9, steps, weights=fold_norms(w))
    assert [t[1] for t in plan.task_list if t[0] == 5] == [0] * batch   # the norm rows of x only
    sync, cnt = plan.sync, plan.counters
    columns = C.hidden // plan.tiles.BLOCK_N
    assert int(sync[cnt.hn_ready]) == 0 and int(sync[cnt.xn_ready]) == steps * batch
    assert int(sync[cnt.h1_ready]) == int(sync[cnt.done]) == steps * columns
    assert int(sync[0]) == steps * (plan.num_tasks + plan.programs)


def test_folded_norms_any_program_count_and_order_give_the_same_bits():
    w, kc, vc, lens, table = _case(3, paged=True)
    folded = fold_norms(w)
    kw = dict(device="cpu", dtype=torch.float32, num_splits=2, page_size=PAGE, config_tiles=_qkv_tiles(2, 3),
              folded_norms=True)
    plain = DecodeLayerPlan(C, 3, CAP, **kw)
    base = _run(plain, folded, kc, vc, lens, table)
    for extra in ({"num_programs": 1}, {"num_programs": 2}, {"shuffle": 4, "num_programs": 3}):
        plan = DecodeLayerPlan(C, 3, CAP, **kw, **extra)
        assert dependency_violations(plan.task_list, 2) == []
        got = _run(plan, folded, kc, vc, lens, table)
        assert all(torch.equal(a, b) for a, b in zip(got, base)), extra


def test_folded_norms_task_table():
    tiles = _split_tiles(2)
    tasks = build_tasks(C, 2, 3, tiles, folded=True)
    plain = build_tasks(C, 2, 3, tiles)
    stages = [t[0] for t in tasks]
    cnt = counters(C, 2, C.hidden // tiles.BLOCK_N, 2)
    assert stages.count(5) == 2 and stages[:2] == [5, 5]   # the norm rows of x, none of h
    assert [t for t in plain if not (t[0] == 5 and t[1] == 1) and t[0] != 3] == [t for t in tasks if t[0] != 3]
    gu = [t for t in tasks if t[0] == 3]
    assert {(t[4], t[5]) for t in gu} == {(cnt.h1_ready, C.hidden // tiles.BLOCK_N)}
    assert dependency_violations(tasks, 3) == []
    # a gate/up task needs every O column block merged: moved before the last O slice, it breaks
    first_gu = stages.index(3)
    assert stages[first_gu - 1] == 2
    bad = tasks[:first_gu - 1] + [tasks[first_gu], tasks[first_gu - 1]] + tasks[first_gu + 1:]
    assert dependency_violations(bad, 3) == [first_gu - 1]


def test_fold_norms_scales_the_weight_columns_and_leaves_the_weights_given():
    w = random_layer_weights(C, torch.bfloat16, "cpu", seed=3)
    before = {k: v.clone() for k, v in w.as_dict().items()}
    f = fold_norms(w)
    assert f.folded and not w.folded and f.attn_norm is None and f.ffn_norm is None
    assert f.o is w.o and f.down is w.down
    assert torch.equal(f.qkv, (w.qkv.float() * w.attn_norm.float()).bfloat16())
    assert torch.equal(f.gate_up, (w.gate_up.float() * w.ffn_norm.float()).bfloat16())
    assert all(torch.equal(v, before[k]) for k, v in w.as_dict().items())
    with pytest.raises(ValueError, match="already folded"):
        fold_norms(f)
    with pytest.raises(TypeError, match="weights must be a flashflow LayerWeights"):
        fold_norms(w.as_dict())
    with pytest.raises(ValueError, match=r"weights.ffn_norm must have shape \(128,\) to fold into weights.gate_up"):
        fold_norms(LayerWeights(**{**w.as_dict(), "ffn_norm": w.ffn_norm[:-1]}))
    with pytest.raises(TypeError, match="weights.attn_norm must be a torch.Tensor"):
        fold_norms(LayerWeights(**{**w.as_dict(), "attn_norm": [1.0] * C.hidden}))
    # a product past fp16's range is refused, not folded into an inf weight
    h = LayerWeights(**{k: v.half() for k, v in w.as_dict().items()})
    gate_up = h.gate_up.clone()
    gate_up[0, 0] = 4.0
    big = LayerWeights(**{**h.as_dict(), "gate_up": gate_up, "ffn_norm": torch.full((C.hidden,), 3e4,
                                                                                      dtype=torch.float16)})
    with pytest.raises(ValueError, match=r"weights.gate_up · weights.ffn_norm overflows torch.float16"):
        fold_norms(big)
    assert fold_norms(h).gate_up.isfinite().all()


def test_folded_and_unfolded_weights_need_their_own_plan():
    w, kc, vc, lens, _ = _case(2)
    x = torch.randn(2, C.hidden)
    folded = DecodeLayerPlan(C, 2, CAP, device="cpu", dtype=torch.float32, folded_norms=True)
    plain = DecodeLayerPlan(C, 2, CAP, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="weights.attn_norm is given, but the plan was built with folded_norms=True"):
        folded.run(x, w, kc, vc, lens)
    with pytest.raises(ValueError, match=r"weights.attn_norm is None \(folded norm weights\), but the plan was built"):
        plain.run(x, fold_norms(w), kc, vc, lens)
    half = LayerWeights(**{**fold_norms(w).as_dict(), "ffn_norm": w.ffn_norm})
    with pytest.raises(ValueError, match="weights.ffn_norm is given"):
        folded.run(x, half, kc, vc, lens)
    with pytest.raises(TypeError, match="folded_norms must be True or False, got 1"):
        DecodeLayerPlan(C, 2, CAP, device="cpu", dtype=torch.float32, folded_norms=1)
    assert int(folded.sync.abs().sum()) == int(plain.sync.abs().sum()) == 0   # nothing launched


def test_bfloat16_folded_weights_match_the_reference_as_the_unfolded_ones_do():
    """bf16: the folded weights' one rounding against the normalised activation's; both against
    float64, through decode_layer (a folded plan picked for folded weights)."""
    w, kc, vc, lens, _ = _case(3, dtype=torch.bfloat16)
    wd, kref, vref = _ref_state(w, kc, vc, None)
    x = torch.randn(3, C.hidden, generator=torch.Generator().manual_seed(3)).bfloat16()
    k2, v2 = kc.clone(), vc.clone()
    plain = decode_layer(x, w, k2, v2, lens, C)
    out = decode_layer(x, fold_norms(w), kc, vc, lens, C)
    ref = _ref_step(x, wd, kref, vref, lens)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    rel_plain = ((plain.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2 and rel < 2 * rel_plain, (rel, rel_plain)
    for b in range(3):
        assert (kc[b, int(lens[b])].double() - kref[b, int(lens[b])]).abs().max() < 0.05


def test_split_k_must_be_a_positive_int():
    with pytest.raises(ValueError, match=r"SPLIT_K must be an int >= 1, got 0"):
        DecodeLayerPlan(C, 1, CAP, device="cpu", dtype=torch.float32, config_tiles=_split_tiles(0))


def test_staggered_k_loops_and_deeper_gemv_pipelines_match_the_float64_reference():
    """STAGGER 1: each GEMV task starts its K loop at chunk (task index mod chunks), K slices
    included; GEMV_STAGES apart from num_stages. Against float64, and the same bits whatever the
    program count and order."""
    import dataclasses
    batch = 3
    w, kc, vc, lens, table = _case(batch, paged=True)
    tiles = dataclasses.replace(_split_tiles(3), STAGGER=1, GEMV_STAGES=2)
    kw = dict(device="cpu", dtype=torch.float32, num_splits=2, page_size=PAGE, config_tiles=tiles)
    plan = DecodeLayerPlan(C, batch, CAP, **kw)
    wd, kref, vref = _ref_state(w, kc, vc, table)
    x = torch.randn(batch, C.hidden, generator=torch.Generator().manual_seed(4))
    k2, v2 = kc.clone(), vc.clone()
    got = plan.run(x, w, k2, v2, lens, table)
    ref = _ref_step(x, wd, kref, vref, lens)
    assert (got.double() - ref).abs().max().item() < 2e-5 * ref.abs().max().item()
    base = (got, k2, v2)
    for extra in ({"num_programs": 2}, {"shuffle": 3, "num_programs": 3}):
        again = _run(DecodeLayerPlan(C, batch, CAP, **kw, **extra), w, kc, vc, lens, table, x=x)
        assert all(torch.equal(a, b) for a, b in zip(again, base)), extra


def test_trace_needs_a_gpu():
    with pytest.raises(ValueError, match="trace=True reads the GPU's global timer"):
        DecodeLayerPlan(C, 1, CAP, device="cpu", dtype=torch.float32, trace=True)
    with pytest.raises(TypeError, match="trace"):
        DecodeLayerPlan(C, 1, CAP, device="cpu", dtype=torch.float32, trace=1)


@pytest.mark.parametrize("field,value,match", [("GEMV_STAGES", -1, "GEMV_STAGES must be an int >= 0"),
                                               ("STAGGER", 2, "STAGGER must be 0 or 1"),
                                               ("QKV_SPLIT", 0, "QKV_SPLIT must be an int >= 1, got 0"),
                                               ("QKV_SPLIT", True, "QKV_SPLIT must be an int >= 1, got True")])
def test_gemv_fields_are_checked(field, value, match):
    import dataclasses
    tiles = dataclasses.replace(_split_tiles(1), **{field: value})
    with pytest.raises(ValueError, match=match):
        DecodeLayerPlan(C, 1, CAP, device="cpu", dtype=torch.float32, config_tiles=tiles)


@triton.jit
def _norm_rows(A, G, D, hidden, eps, NORM_BLOCK: tl.constexpr):
    _norm_task(A, hidden + 3, G, D, tl.program_id(0), hidden, eps, NORM_BLOCK)


def test_norm_rows_read_once_or_in_steps():
    """``_norm_task``: a row of at most NORM_BLOCK values read once, a longer one in steps (the
    sum of squares, then the scaled row), both equal to RMSNorm in float64 rounded to the
    destination's dtype."""
    g = torch.Generator().manual_seed(2)
    for hidden, block in ((100, 128), (100, 32), (96, 32)):
        a = torch.randn(3, hidden + 3, generator=g) * 3
        w = 1 + 0.1 * torch.randn(hidden, generator=g)
        d = torch.full((3, hidden), float("nan"))
        _norm_rows[(3,)](a, w, d, hidden, 1e-5, NORM_BLOCK=block)
        x = a[:, :hidden].double()
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
        assert (d.double() - ref).abs().max().item() < 1e-5, (hidden, block)


_SYNC_CHILD = """
import json, torch
from flashflow.bench.offline import offline_target, pretend_cuda_capability
from flashflow.ops.decode_layer import DecodeLayerPlan, LayerConfig, random_layer_weights
c = LayerConfig(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=256)   # the sm90 tiles' smallest head
with pretend_cuda_capability():
    plan = DecodeLayerPlan(c, 2, 64, device="cpu", dtype=torch.bfloat16)
    w = random_layer_weights(c, torch.bfloat16, "cpu")
    kc = torch.zeros(2, 64, c.kv_heads, c.head_dim, dtype=torch.bfloat16)
    with offline_target() as ks:
        plan.run(torch.zeros(2, c.hidden, dtype=torch.bfloat16), w, kc, kc.clone(), torch.zeros(2, dtype=torch.int32))
ptx = ks[0].asm["ptx"]
print(json.dumps({p: ptx.count(p) for p in ("ld.acquire.gpu", "fence.acq_rel.gpu", "atom.global.gpu.acquire",
                                             "atom.global.gpu.release", "atom.global.gpu.acq_rel")}))
"""


def test_on_sm90_waits_acquire_with_loads_and_signals_fence_each_thread():
    """The GPU build's synchronisation (compiled for sm90 here, nothing run): waits acquire with
    ``ld.acquire.gpu`` loads and signals fence every thread, with one release atomic a signal (a
    scalar, issued by one thread) and the merges' acq_rel arrivals; no acquire atomic a thread,
    which on an H100 cost most of the step."""
    from offline_child import child_json   # tests/offline_child.py

    got = child_json(_SYNC_CHILD)
    assert got["ld.acquire.gpu"] > 0 and got["fence.acq_rel.gpu"] > 0, got
    assert got["atom.global.gpu.acquire"] == 0, got
    assert got["atom.global.gpu.release"] > 0 and got["atom.global.gpu.acq_rel"] > 0, got


def test_shipped_tiles_take_every_supported_head_dim():
    """Each family's entry for each head_dim the plan supports holds whole rotary pairs a head
    (head_dim 32 has 16 pairs: a 32-pair tile would be refused)."""
    from flashflow.ops.decode_layer import HEAD_DIMS
    from flashflow.tuning.decode_layer import decode_layer_config
    for family in ("sm90", "sm80", "interpreter"):
        for d in HEAD_DIMS:
            tiles = decode_layer_config(family, d)
            assert (d // 2) % tiles.QKV_PAIRS == 0, (family, d, tiles.QKV_PAIRS)


def test_fold_norms_takes_any_strides_and_keeps_nan_where_it_was():
    """Transposed weight views and stride-0 norm weights fold to the contiguous inputs' bits; a
    NaN in a weight stays in its column (refused is only a finite product past the range)."""
    w = random_layer_weights(C, torch.float32, "cpu", seed=5)
    base = fold_norms(w)
    odd = LayerWeights(**{k: v.t().contiguous().t() if v.dim() == 2 else v[None].expand(2, -1)[1]
                          for k, v in w.as_dict().items()})
    assert odd.qkv.stride(-1) != 1 and odd.gate_up.stride(-1) != 1
    got = fold_norms(odd)
    assert torch.equal(got.qkv, base.qkv) and torch.equal(got.gate_up, base.gate_up)
    stride0 = LayerWeights(**{**w.as_dict(), "attn_norm": torch.ones(1).expand(C.hidden)})
    assert stride0.attn_norm.stride(0) == 0 and torch.equal(fold_norms(stride0).qkv, w.qkv)
    nan = LayerWeights(**{**w.as_dict(), "qkv": w.qkv.clone()})
    nan.qkv[3, 7] = float("nan")
    f = fold_norms(nan)
    assert f.qkv[3, 7].isnan() and f.qkv.isnan().sum() == 1
