"""Several decoder layers in one launch (``DecodeLayerPlan(..., num_layers=N)``) in Triton's
interpreter, tiny Llama config: the same bits as one launch per layer over growing caches
(contiguous and paged, folded norms, K slices), against the float64 layers, any program count and
shuffled orders, the cross-layer waits in the task table, the counters per layer, layouts, NaN,
and the inputs a multi-layer launch refuses."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flashflow.kernels.decode_layer import DOWN, NORM, QKV
from flashflow.kernels.sync import CNT_OFF
from flashflow.ops.decode_layer import (TINY_LLAMA, DecodeLayerPlan, build_tasks, decode_step,
                                        dependency_violations, fold_norms, random_layer_weights)
from flashflow.reference.decode_layer import decode_layer_reference

C = TINY_LLAMA
CAP = 48
PAGE = 16
F32 = dict(device="cpu", dtype=torch.float32)


def _tiles(qkv_split=1, split_k=1):
    base = DecodeLayerPlan(C, 1, CAP, **F32).tiles
    return dataclasses.replace(base, QKV_SPLIT=qkv_split, SPLIT_K=split_k)


def _model(n, batch, paged=False, folded=False, seed=0):
    """``n`` layers' weights, their caches (pages of one shuffled table when paged), lengths."""
    g = torch.Generator().manual_seed(seed)
    layers = [random_layer_weights(C, torch.float32, "cpu", seed=seed + 1 + i) for i in range(n)]
    if folded:
        layers = [fold_norms(w) for w in layers]
    table = None
    if paged:
        per = CAP // PAGE
        table = torch.randperm(batch * per, generator=g).reshape(batch, per).int()
        shape = (batch * per, PAGE, C.kv_heads, C.head_dim)
    else:
        shape = (batch, CAP, C.kv_heads, C.head_dim)
    caches = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(n)]
    lens = torch.tensor([5, 17, 0][:batch], dtype=torch.int32)
    return layers, caches, lens, table


def _clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def _steps(plan, layers, caches, lens, table, steps=2, seed=3):
    """``steps`` steps of decode_step from the same inputs; the outputs of each step."""
    g = torch.Generator().manual_seed(seed)
    lens = lens.clone()
    tables = None if table is None else [table] * len(layers)
    outs = []
    for _ in range(steps):
        x = torch.randn(plan.batch, C.hidden, generator=g)
        outs.append(decode_step(plan, layers, caches, x, lens, tables))
    return outs


CASES = [dict(), dict(paged=True), dict(folded=True, tiles=(2, 3)), dict(folded=True, paged=True, tiles=(3, 2)),
         dict(tiles=(2, 2))]


@pytest.mark.parametrize("case", CASES, ids=["contiguous", "paged", "folded-slices", "folded-paged-slices",
                                             "slices"])
def test_layers_in_one_launch_give_the_bits_of_a_launch_per_layer(case):
    n, batch = 3, 3
    layers, caches, lens, table = _model(n, batch, case.get("paged", False), case.get("folded", False))
    kw = dict(**F32, num_splits=2, page_size=PAGE if case.get("paged") else None,
              folded_norms=case.get("folded", False), config_tiles=_tiles(*case.get("tiles", (1, 1))))
    one = DecodeLayerPlan(C, batch, CAP, **kw)
    many = DecodeLayerPlan(C, batch, CAP, **kw, num_layers=n)
    assert many.num_tasks == n * one.num_tasks and many.programs < many.num_tasks
    c1, cn = _clone(caches), _clone(caches)
    want = _steps(one, layers, c1, lens, table)
    got = _steps(many, layers, cn, lens, table)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for p, q in zip(c1, cn) for a, b in zip(p, q))
    # every layer's counters counted every step, each in its own words; the ticket took
    # tasks + programs a launch
    steps, words = 2, many.layer_words
    cnt, columns = many.counters, C.hidden // many.tiles.BLOCK_N
    assert int(many.sync[0]) == steps * (many.num_tasks + many.programs) and int(many.sync[2]) == 0
    assert [int(many.sync[cnt.done + i * words]) for i in range(n)] == [steps * columns] * n
    assert [int(many.sync[cnt.xn_ready + i * words]) for i in range(n)] == [steps * batch] * n
    assert many.sync.numel() == CNT_OFF + n * words
    # folded: each K slice of x counts the down column blocks of its columns, the count its
    # QKV slices of the next layer wait for (a slice past the hidden size, none)
    tiles = many.tiles
    assert many.x_slices == (tiles.QKV_SPLIT if case.get("folded") else 0) and one.x_slices == 0
    if many.x_slices:
        width = -(-(-(-C.hidden // tiles.QKV_SPLIT)) // tiles.BLOCK_K) * tiles.BLOCK_K   # whole BLOCK_K chunks
        blocks = [sum(1 for j in range(columns) if j * tiles.BLOCK_N // width == p) for p in range(many.x_slices)]
        assert sum(blocks) == columns and (tiles.QKV_SPLIT < 3 or blocks[-1] == 0)
        assert [int(many.sync[cnt.x_ready + i * words + p]) for i in range(n) for p in range(many.x_slices)] == \
            [steps * b for _ in range(n) for b in blocks]


def test_layers_in_one_launch_match_the_float64_layers():
    n, batch = 2, 2
    layers, caches, lens, _ = _model(n, batch, seed=5)
    plan = DecodeLayerPlan(C, batch, CAP, **F32, num_splits=2, num_layers=n)
    refs = [({k: t.double() for k, t in w.as_dict().items()}, k.double().clone(), v.double().clone())
            for w, (k, v) in zip(layers, caches)]
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        x = torch.randn(batch, C.hidden, generator=g)
        ref_lens = lens.clone()
        got = decode_step(plan, layers, caches, x, lens)
        assert torch.equal(lens, ref_lens + 1)
        h = x.double()
        for wd, kref, vref in refs:
            h, kn, vn = decode_layer_reference(h, wd, kref, vref, ref_lens, heads=C.heads, kv_heads=C.kv_heads,
                                               eps=C.eps, rope_theta=C.rope_theta)
            for b, m in enumerate(ref_lens.tolist()):
                kref[b, m], vref[b, m] = kn[b], vn[b]
        assert (got.double() - h).abs().max() < 2e-5 * h.abs().max()
    for (k, v), (_, kref, vref) in zip(caches, refs):
        m = int(lens.max())
        assert (k[:, :m].double() - kref[:, :m]).abs().max() < 1e-5
        assert (v[:, :m].double() - vref[:, :m]).abs().max() < 1e-5


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded"])
def test_layers_in_one_launch_any_program_count_and_order_give_the_same_bits(folded):
    n, batch = 2, 3
    layers, caches, lens, table = _model(n, batch, paged=True, folded=folded, seed=7)
    kw = dict(**F32, num_splits=2, page_size=PAGE, folded_norms=folded, config_tiles=_tiles(2, 2), num_layers=n)
    base = _steps(DecodeLayerPlan(C, batch, CAP, **kw), layers, _clone(caches), lens, table, steps=1)
    for extra in ({"num_programs": 1}, {"num_programs": 2}, {"shuffle": 5, "num_programs": 3}):
        plan = DecodeLayerPlan(C, batch, CAP, **kw, **extra)
        assert dependency_violations(plan.task_list, 2) == []
        got = _steps(plan, layers, _clone(caches), lens, table, steps=1)
        assert all(torch.equal(a, b) for a, b in zip(got, base)), extra


def test_the_table_of_several_layers_waits_on_the_layer_before():
    tiles = _tiles(2, 2)
    one = build_tasks(C, 2, 2, tiles)
    many = build_tasks(C, 2, 2, tiles, layers=3)
    plan = DecodeLayerPlan(C, 2, CAP, **F32, config_tiles=tiles, num_layers=3)
    words, cnt = plan.layer_words, plan.counters
    assert len(many) == 3 * len(one) and [t[7] for t in many] == [i // len(one) for i in range(len(many))]
    assert dependency_violations(many, 2) == []
    for layer in range(3):
        rows = many[layer * len(one):(layer + 1) * len(one)]
        for t, u in zip(rows, one):
            assert t[:4] == u[:4] and t[6] == u[6] + layer * words
            if t[0] == NORM and t[1] == 0 and layer:   # x's rows: every down column block of the layer before
                assert t[4:6] == (cnt.done + (layer - 1) * words, C.hidden // tiles.BLOCK_N)
            else:
                assert t[4:6] == (u[4] + layer * words, u[5])
    # a task of layer 1 moved ahead of the layer before's last down tile is caught
    first_norm = len(one)
    last_down = max(i for i, t in enumerate(many) if t[0] == DOWN and t[7] == 0)
    bad = list(many)
    bad.insert(last_down, bad.pop(first_norm))
    assert dependency_violations(bad, 2) != []
    qkv = next(i for i, t in enumerate(many) if t[0] == QKV and t[7] == 1)
    bad = list(many)
    bad.insert(last_down, bad.pop(qkv))
    assert dependency_violations(bad, 2) != []


def test_layouts_non_contiguous_x_and_out_are_taken():
    n, batch = 2, 2
    layers, caches, lens, _ = _model(n, batch, seed=11)
    plan = DecodeLayerPlan(C, batch, CAP, **F32, num_layers=n)
    x = torch.randn(batch, C.hidden, generator=torch.Generator().manual_seed(4))
    c1, c2 = _clone(caches), _clone(caches)
    want = plan.run_layers(x, layers, c1, lens)
    xt = x.t().contiguous().t()                     # last stride 2
    out = torch.full((batch, 2 * C.hidden), float("nan"))[:, :C.hidden]   # row stride 2·hidden
    got = plan.run_layers(xt, layers, c2, lens, out=out)
    assert got is out and torch.equal(out, want)


def test_nan_in_one_row_stays_in_its_sequence_through_the_layers():
    n, batch = 2, 3
    layers, caches, lens, _ = _model(n, batch, seed=13)
    plan = DecodeLayerPlan(C, batch, CAP, **F32, num_splits=2, num_layers=n)
    x = torch.randn(batch, C.hidden)
    x[1, 7] = float("nan")
    out = plan.run_layers(x, layers, caches, lens)
    assert out[1].isnan().all() and out[0].isfinite().all() and out[2].isfinite().all()
    for k, v in caches:   # layer 0 appends sequence 1's k and v from a NaN norm; both layers' stay put
        assert not k[1, 17].isfinite().all() and k[0, 5].isfinite().all() and k[2, 0].isfinite().all()
        assert k[1, 16].isfinite().all() and v[1, 18].isfinite().all()


def test_inputs_a_multi_layer_launch_refuses():
    n, batch = 2, 2
    layers, caches, lens, _ = _model(n, batch, seed=17)
    plan = DecodeLayerPlan(C, batch, CAP, **F32, num_layers=n)
    x = torch.randn(batch, C.hidden)
    with pytest.raises(ValueError, match="runs 2 layers in one launch"):
        plan.run(x, layers[0], *caches[0], lens)
    with pytest.raises(ValueError, match="layers must be a list of 2"):
        decode_step(plan, layers[:1], caches[:1], x, lens)
    with pytest.raises(ValueError, match="caches must be a list of 2"):
        plan.run_layers(x, layers, caches[:1], lens)
    with pytest.raises(ValueError, match=r"caches\[1\] must be a \(k_cache, v_cache\) pair"):
        plan.run_layers(x, layers, [caches[0], caches[1][0]], lens)
    with pytest.raises(ValueError, match="block_tables must be None or a list of 2"):
        plan.run_layers(x, layers, caches, lens, block_tables=[None])
    with pytest.raises(ValueError, match="num_layers"):
        DecodeLayerPlan(C, batch, CAP, **F32, num_layers=0)
    # another stride in one layer
    wide = torch.zeros(C.qkv_rows, 2 * C.hidden)
    wide[:, :C.hidden] = layers[1].qkv
    odd = dataclasses.replace(layers[1], qkv=wide[:, :C.hidden])
    with pytest.raises(ValueError, match=r"layer 1's qkv has strides \(256, 1\), layer 0's \(128, 1\)"):
        plan.run_layers(x, [layers[0], odd], caches, lens)
    # an address off 16 bytes (4 bytes in): refused, not read through a misaligned pointer
    buf = torch.zeros(C.hidden * C.hidden + 1)
    o = buf[1:].view(C.hidden, C.hidden)
    o.copy_(layers[1].o)
    with pytest.raises(ValueError, match="layer 1's o is not 16-byte aligned"):
        plan.run_layers(x, [layers[0], dataclasses.replace(layers[1], o=o)], caches, lens)
    # a layer's own checks name the argument
    with pytest.raises(TypeError, match="weights must be a flashflow LayerWeights"):
        plan.run_layers(x, [layers[0], {"qkv": 1}], caches, lens)


def test_a_shared_block_table_is_checked_against_every_layers_cache():
    """Layer 0's block table passed for every layer: a later layer whose paged cache has fewer
    blocks than the table's entries name is refused before the launch, not read past its end."""
    n, batch = 2, 2
    layers, caches, lens, table = _model(n, batch, paged=True, seed=23)
    plan = DecodeLayerPlan(C, batch, CAP, **F32, page_size=PAGE, num_layers=n)
    small = tuple(t[:int(table.max())] for t in caches[1])   # the table's largest entry is past its end
    x = torch.randn(batch, C.hidden)
    with pytest.raises(ValueError, match=r"block_table entries must be in \[0, "):
        plan.run_layers(x, layers, [caches[0], small], lens, block_tables=[table, table])
    out = plan.run_layers(x, layers, _clone(caches), lens, block_tables=[table, table])   # the same table, room
    assert out.isfinite().all()


def test_stride0_x_transposed_caches_and_inf_give_the_bits_of_a_launch_per_layer():
    """x a stride-0 expansion of one row (with an inf), every layer's caches transposed views of
    (batch, kv_heads, capacity, d) buffers: one launch writes what a launch per layer writes,
    and the inf's sequence alone goes non-finite."""
    n, batch = 2, 3
    layers, caches, lens, _ = _model(n, batch, seed=19)
    views = [tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in pair) for pair in caches]
    assert views[0][0].stride() != caches[0][0].stride() and views[0][0].stride(-1) == 1
    row = torch.randn(1, C.hidden, generator=torch.Generator().manual_seed(6))
    x = row.expand(batch, C.hidden)                                   # stride (0, 1)
    one = DecodeLayerPlan(C, batch, CAP, **F32, num_splits=2)
    many = DecodeLayerPlan(C, batch, CAP, **F32, num_splits=2, num_layers=n)
    c1, cn = [tuple(t.clone().transpose(1, 2).contiguous().transpose(1, 2) for t in p) for p in views], views
    want = decode_step(one, layers, c1, x, lens.clone(), advance=False)
    got = decode_step(many, layers, cn, x, lens.clone(), advance=False)
    assert torch.equal(got, want) and got.isfinite().all()
    assert all(torch.equal(a, b) for p, q in zip(c1, cn) for a, b in zip(p, q))
    xi = x.clone()
    xi[2, 3] = float("inf")
    out = many.run_layers(xi, layers, cn, lens)
    assert not out[2].isfinite().any() and out[0].isfinite().all() and out[1].isfinite().all()
