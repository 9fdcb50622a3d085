"""Several decoder layers in one launch on the GPU (``DecodeLayerPlan(..., num_layers=N)``), bf16:
the bits of one launch per layer over growing ragged caches (contiguous and paged, folded norms,
the shipped tiles with their K slices), fewer programs and shuffled orders, the Llama-3-8B layers
against float64, a CUDA graph of the step replayed (and a capture refused when an address
changed), with the GPU's fenced synchronisation and pointers read from the layer table."""
import dataclasses

import pytest
import torch

from flashflow.ops.decode_layer import (LLAMA3_8B, DecodeLayerPlan, LayerConfig, decode_step, fold_norms,
                                        random_layer_weights)
from flashflow.reference.decode_layer import decode_layer_reference

pytestmark = pytest.mark.gpu
MID = LayerConfig(hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816)
CAP, PAGE = 1024, 64
BF16 = dict(device="cuda", dtype=torch.bfloat16)


def _model(config, n, batch, lens, paged=False, folded=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    layers = [random_layer_weights(config, torch.bfloat16, "cuda", seed=seed + 1 + i) for i in range(n)]
    if folded:
        layers = [fold_norms(w) for w in layers]
    table = None
    if paged:
        per = CAP // PAGE
        table = torch.randperm(batch * per, generator=g).reshape(batch, per).int().cuda()
        shape = (batch * per, PAGE, config.kv_heads, config.head_dim)
    else:
        shape = (batch, CAP, config.kv_heads, config.head_dim)
    caches = [tuple(torch.randn(shape, generator=g).to(**BF16) for _ in range(2)) for _ in range(n)]
    return layers, caches, torch.tensor(lens, dtype=torch.int32, device="cuda"), table


def _clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def _steps(plan, layers, caches, lens, table, steps=3):
    g = torch.Generator(device="cpu").manual_seed(9)
    lens = lens.clone()
    tables = None if table is None else [table] * len(layers)
    outs = []
    for _ in range(steps):
        x = torch.randn(plan.batch, plan.config.hidden, generator=g).to(**BF16)
        outs.append(decode_step(plan, layers, caches, x, lens, tables).clone())
    return outs


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_layers_in_one_launch_give_the_bits_of_a_launch_per_layer(paged, folded):
    n = 4
    layers, caches, lens, table = _model(MID, n, 4, [0, 17, 500, 1000], paged, folded)
    kw = dict(**BF16, page_size=PAGE if paged else None, folded_norms=folded)
    one, many = DecodeLayerPlan(MID, 4, CAP, **kw), DecodeLayerPlan(MID, 4, CAP, **kw, num_layers=n)
    c1, cn = _clone(caches), _clone(caches)
    want, got = _steps(one, layers, c1, lens, table), _steps(many, layers, cn, lens, table)
    assert all(o.isfinite().all() for o in got)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for p, q in zip(c1, cn) for a, b in zip(p, q))


def test_program_counts_and_shuffled_orders_give_the_same_bits():
    n = 3
    layers, caches, lens, _ = _model(MID, n, 3, [5, 300, 900], seed=3)
    outs = []
    for kw in ({}, {"num_programs": 1}, {"num_programs": 7}, {"shuffle": 1, "num_programs": 5}):
        plan = DecodeLayerPlan(MID, 3, CAP, **BF16, num_splits=4, num_layers=n, **kw)
        c = _clone(caches)
        outs.append((_steps(plan, layers, c, lens, None, steps=1)[0], c))
    for out, c in outs[1:]:
        assert torch.equal(out, outs[0][0])
        assert all(torch.equal(a, b) for p, q in zip(c, outs[0][1]) for a, b in zip(p, q))


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded"])
@pytest.mark.parametrize("batch", [1, 16])
def test_llama3_8b_layers_against_float64(batch, folded):
    n = 2
    layers, caches, lens, _ = _model(LLAMA3_8B, n, batch, [CAP - 1 - b for b in range(batch)], seed=5)
    x = torch.randn(batch, LLAMA3_8B.hidden, **BF16)
    h = x.double()
    for w, (kc, vc) in zip(layers, caches):
        wd = {k: t.double() for k, t in w.as_dict().items()}
        h, _, _ = decode_layer_reference(h, wd, kc.double(), vc.double(), lens.tolist(), heads=LLAMA3_8B.heads,
                                         kv_heads=LLAMA3_8B.kv_heads, eps=LLAMA3_8B.eps,
                                         rope_theta=LLAMA3_8B.rope_theta)
    plan = DecodeLayerPlan(LLAMA3_8B, batch, CAP, **BF16, folded_norms=folded, num_layers=n)
    out = plan.run_layers(x, [fold_norms(w) for w in layers] if folded else layers, caches, lens)
    assert ((out.double() - h).norm() / h.norm()).item() < 2e-2


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded"])
def test_cuda_graph_replays_of_the_layers(folded):
    n = 3
    layers, caches, lens, _ = _model(MID, n, 2, [10, 400], folded=folded, seed=7)
    kw = dict(**BF16, folded_norms=folded, num_layers=n)
    x = torch.randn(2, MID.hidden, **BF16)
    ref_plan, plan = DecodeLayerPlan(MID, 2, CAP, **kw), DecodeLayerPlan(MID, 2, CAP, **kw)
    orig, eager, eager_lens = _clone(caches), _clone(caches), lens.clone()
    expected = [decode_step(ref_plan, layers, eager, x, eager_lens).clone() for _ in range(3)]
    decode_step(plan, layers, caches, x, lens.clone())   # compile and the pointer table, outside a capture
    # a capture with tensors at other addresses than the call before is refused (the table is
    # copied to the device), before anything is launched
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="changed address"):
        with torch.cuda.graph(graph):
            decode_step(plan, layers, _clone(orig), x, lens)
    torch.cuda.synchronize()
    for (k, v), (k0, v0) in zip(caches, orig):   # undo the warm-up's appends
        k.copy_(k0)
        v.copy_(v0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_step(plan, layers, caches, x, lens)
    for step in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected[step]), step
    assert all(torch.equal(a, b) for p, q in zip(caches, eager) for a, b in zip(p, q))
    assert torch.equal(lens, eager_lens)


def test_non_contiguous_weights_of_one_stride_are_read_through_the_table():
    """Every layer's qkv a row-slice of one wider buffer (row stride 2·hidden, one stride for all)."""
    n = 2
    layers, caches, lens, _ = _model(MID, n, 2, [3, 700], seed=11)
    wide = [torch.zeros(MID.qkv_rows, 2 * MID.hidden, **BF16) for _ in range(n)]
    odd = []
    for w, buf in zip(layers, wide):
        buf[:, MID.hidden:] = w.qkv
        odd.append(dataclasses.replace(w, qkv=buf[:, MID.hidden:]))
    plan = DecodeLayerPlan(MID, 2, CAP, **BF16, num_layers=n)
    x = torch.randn(2, MID.hidden, **BF16)
    c1, c2 = _clone(caches), _clone(caches)
    want = plan.run_layers(x, layers, c1, lens).clone()
    assert torch.equal(plan.run_layers(x, odd, c2, lens), want)


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded"])
def test_stride0_x_transposed_caches_and_inf_give_the_bits_of_a_launch_per_layer(folded):
    """x a stride-0 expansion of one row, every layer's caches transposed views of (batch,
    kv_heads, capacity, d) buffers: one launch writes what a launch per layer writes; an inf in
    one sequence's x leaves the others finite."""
    n = 3
    layers, caches, lens, _ = _model(MID, n, 3, [4, 200, 900], folded=folded, seed=13)
    views = [tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in pair) for pair in caches]
    x = torch.randn(1, MID.hidden, **BF16).expand(3, MID.hidden)
    kw = dict(**BF16, folded_norms=folded)
    one, many = DecodeLayerPlan(MID, 3, CAP, **kw), DecodeLayerPlan(MID, 3, CAP, **kw, num_layers=n)
    c1 = [tuple(t.clone().transpose(1, 2).contiguous().transpose(1, 2) for t in p) for p in views]
    want = decode_step(one, layers, c1, x, lens.clone(), advance=False)
    got = decode_step(many, layers, views, x, lens.clone(), advance=False)
    assert torch.equal(got, want) and got.isfinite().all()
    assert all(torch.equal(a, b) for p, q in zip(c1, views) for a, b in zip(p, q))
    xi = x.clone()
    xi[1, 5] = float("inf")
    out = many.run_layers(xi, layers, views, lens)
    assert not out[1].isfinite().any() and out[0].isfinite().all() and out[2].isfinite().all()
