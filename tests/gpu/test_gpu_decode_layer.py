"""The decode-layer megakernel on the GPU, bf16 and fp16 against float64: a mid-sized GQA layer
over several steps with ragged, growing caches (contiguous and paged), outputs poisoned with NaN;
the same bits from fewer programs and from shuffled task orders; staggered K loops and deeper GEMV
pipelines; a CUDA graph of the step replayed with the epochs advancing on the device; the traced
timeline; the Llama-3-8B layer at batch 1 and 16 (its tiles in QKV K slices), weights as given and
with their norm weights folded; QKV K slices and folded norms at the mid-sized layer; non-contiguous
inputs and NaN / inf staying in their sequence (both kinds of weights), with the GPU's fenced
synchronisation."""
import pytest
import torch

import dataclasses

from flashflow.ops.decode_layer import (LLAMA3_8B, DecodeLayerPlan, LayerConfig, LayerWeights, fold_norms,
                                        random_layer_weights, trace_summary)
from flashflow.reference.decode_layer import decode_layer_reference

pytestmark = pytest.mark.gpu
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
MID = LayerConfig(hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816)
CAP, PAGE = 1024, 64


def _state(config, batch, dtype, lens, paged=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = random_layer_weights(config, dtype, "cuda", seed=seed + 1)
    shape = (batch, CAP, config.kv_heads, config.head_dim)
    kc = torch.randn(shape, generator=g).to(dtype=dtype, device="cuda")
    vc = torch.randn(shape, generator=g).to(dtype=dtype, device="cuda")
    table = None
    if paged:
        per = CAP // PAGE
        table = torch.randperm(batch * per, generator=g).reshape(batch, per).int().cuda()
        kp = torch.full((batch * per, PAGE, *shape[2:]), float("nan"), dtype=dtype, device="cuda")
        vp = kp.clone()
        kp[table.flatten().long()] = kc.reshape(batch * per, PAGE, *shape[2:])
        vp[table.flatten().long()] = vc.reshape(batch * per, PAGE, *shape[2:])
        kc, vc = kp, vp
    return w, kc, vc, torch.tensor(lens, dtype=torch.int32, device="cuda"), table


def _logical(cache, table):
    return cache if table is None else cache[table.long()].flatten(1, 2)


def _ref(config, x, w, kc, vc, lens, table):
    wd = {k: v.double() for k, v in w.as_dict().items()}
    out, _, _ = decode_layer_reference(x.double(), wd, _logical(kc, table).double(), _logical(vc, table).double(),
                                       lens.tolist(), heads=config.heads, kv_heads=config.kv_heads, eps=config.eps,
                                       rope_theta=config.rope_theta)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_steps_against_float64(dtype, paged):
    lens = [0, 17, 500, 1000]
    w, kc, vc, seqlens, table = _state(MID, 4, dtype, lens, paged)
    plan = DecodeLayerPlan(MID, 4, CAP, device="cuda", dtype=dtype, page_size=PAGE if paged else None)
    g = torch.Generator(device="cpu").manual_seed(5)
    for _ in range(4):
        x = torch.randn(4, MID.hidden, generator=g).to(dtype=dtype, device="cuda")
        ref = _ref(MID, x, w, kc, vc, seqlens, table)   # before the kernel appends
        out = torch.full((4, MID.hidden), float("nan"), dtype=dtype, device="cuda")
        plan.run(x, w, kc, vc, seqlens, table, out=out)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert out.isfinite().all() and rel < 2e-2, rel
        seqlens += 1


def test_program_counts_and_shuffled_orders_give_the_same_bits():
    w, kc, vc, seqlens, _ = _state(MID, 3, torch.bfloat16, [5, 300, 900])
    x = torch.randn(3, MID.hidden, device="cuda", dtype=torch.bfloat16)
    outs = []
    for kw in ({}, {"num_programs": 1}, {"num_programs": 7}, {"shuffle": 1}, {"shuffle": 2, "num_programs": 5}):
        plan = DecodeLayerPlan(MID, 3, CAP, device="cuda", dtype=torch.bfloat16, num_splits=4, **kw)
        k2, v2 = kc.clone(), vc.clone()
        outs.append((plan.run(x, w, k2, v2, seqlens), k2, v2))
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded"])
def test_cuda_graph_replays_advance_the_epochs(folded):
    w, kc, vc, seqlens, _ = _state(MID, 2, torch.bfloat16, [10, 400])
    w = fold_norms(w) if folded else w
    plan = DecodeLayerPlan(MID, 2, CAP, device="cuda", dtype=torch.bfloat16, folded_norms=folded)
    x = torch.randn(2, MID.hidden, device="cuda", dtype=torch.bfloat16)
    eager_k, eager_v, eager_lens = kc.clone(), vc.clone(), seqlens.clone()
    expected = []
    ref_plan = DecodeLayerPlan(MID, 2, CAP, device="cuda", dtype=torch.bfloat16, folded_norms=folded)
    for _ in range(3):
        expected.append(ref_plan.run(x, w, eager_k, eager_v, eager_lens).clone())
        eager_lens += 1
    plan.run(x, w, kc.clone(), vc.clone(), seqlens)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    out = torch.empty(2, MID.hidden, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.graph(graph):
        plan.run(x, w, kc, vc, seqlens, out=out)
        seqlens.add_(1)
    for step in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected[step]), step
    assert torch.equal(kc, eager_k) and torch.equal(vc, eager_v)
    per = plan.num_tasks + plan.programs
    assert int(plan.sync[0]) == 4 * per   # the warm-up launch and three replays: nothing reset


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded"])
@pytest.mark.parametrize("batch", [1, 16])
def test_llama3_8b_layer(batch, folded):
    w, kc, vc, seqlens, _ = _state(LLAMA3_8B, batch, torch.bfloat16, [CAP - 1 - b for b in range(batch)])
    x = torch.randn(batch, LLAMA3_8B.hidden, device="cuda", dtype=torch.bfloat16)
    ref = _ref(LLAMA3_8B, x, w, kc, vc, seqlens, None)
    plan = DecodeLayerPlan(LLAMA3_8B, batch, CAP, device="cuda", dtype=torch.bfloat16, folded_norms=folded)
    out = plan.run(x, fold_norms(w) if folded else w, kc, vc, seqlens)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("qkv_split", [1, 2, 3])
def test_folded_norms_and_qkv_slices_against_float64(qkv_split):
    """Folded norm weights over four steps with growing ragged caches (the rms of x changing),
    QKV tiles in K slices (3: one slice short); the same bits from other program counts and a
    shuffled order."""
    w, kc, vc, seqlens, _ = _state(MID, 4, torch.bfloat16, [0, 17, 500, 1000])
    folded = fold_norms(w)
    tiles = dataclasses.replace(DecodeLayerPlan(MID, 4, CAP, device="cuda").tiles, QKV_SPLIT=qkv_split)
    kw = dict(device="cuda", dtype=torch.bfloat16, config_tiles=tiles, folded_norms=True)
    plan = DecodeLayerPlan(MID, 4, CAP, **kw)
    g = torch.Generator(device="cpu").manual_seed(6)
    for step in range(4):
        x = (torch.randn(4, MID.hidden, generator=g) * (1 + step)).to(dtype=torch.bfloat16, device="cuda")
        ref = _ref(MID, x, w, kc, vc, seqlens, None)
        out = torch.full((4, MID.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        plan.run(x, folded, kc, vc, seqlens, out=out)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert out.isfinite().all() and rel < 2e-2, (step, rel)
        seqlens += 1
    x = torch.randn(4, MID.hidden, device="cuda", dtype=torch.bfloat16)
    outs = []
    for extra in ({}, {"num_programs": 5}, {"shuffle": 3}):
        k2, v2 = kc.clone(), vc.clone()
        outs.append((DecodeLayerPlan(MID, 4, CAP, **kw, **extra).run(x, folded, k2, v2, seqlens), k2, v2))
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))


def test_staggered_and_deeper_gemv_loops_against_float64():
    lens = [3, 250, 999]
    w, kc, vc, seqlens, _ = _state(MID, 3, torch.bfloat16, lens)
    x = torch.randn(3, MID.hidden, device="cuda", dtype=torch.bfloat16)
    ref = _ref(MID, x, w, kc, vc, seqlens, None)
    base = DecodeLayerPlan(MID, 3, CAP, device="cuda", dtype=torch.bfloat16).tiles
    for tiles in (dataclasses.replace(base, STAGGER=1), dataclasses.replace(base, GEMV_STAGES=5),
                  dataclasses.replace(base, STAGGER=1, SPLIT_K=1, BLOCK_K=64)):
        plan = DecodeLayerPlan(MID, 3, CAP, device="cuda", dtype=torch.bfloat16, config_tiles=tiles)
        out = plan.run(x, w, kc.clone(), vc.clone(), seqlens)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2, tiles


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded"])
def test_trace_records_every_task_and_changes_nothing(folded):
    """Each ticket's start, end, SM, stage and the time its wait passed (start ≤ ready ≤ end),
    the outputs the untraced plan's bits; the summary splits a task into wait and work."""
    w, kc, vc, seqlens, _ = _state(MID, 2, torch.bfloat16, [7, 600])
    w = fold_norms(w) if folded else w
    x = torch.randn(2, MID.hidden, device="cuda", dtype=torch.bfloat16)
    kw = dict(device="cuda", dtype=torch.bfloat16, folded_norms=folded)
    plain = DecodeLayerPlan(MID, 2, CAP, **kw)
    traced = DecodeLayerPlan(MID, 2, CAP, trace=True, **kw)
    a = plain.run(x, w, kc.clone(), vc.clone(), seqlens)
    b = traced.run(x, w, kc.clone(), vc.clone(), seqlens)
    assert torch.equal(a, b)
    tr = traced.trace.cpu()
    assert tr.shape == (traced.num_tasks, 5)
    assert (tr[:, 1] >= tr[:, 4]).all() and (tr[:, 4] >= tr[:, 0]).all() and (tr[:, 0] > 0).all()
    assert tr[:, 3].tolist() == [t[0] for t in traced.task_list]   # each ticket's own stage
    s = trace_summary(traced)
    assert sum(v["tasks"] for v in s["stages"].values()) == traced.num_tasks
    assert 0 < s["busy_fraction"] <= 1 and s["stages"]["down"]["last_end_us"] == s["span_us"]
    for v in s["stages"].values():
        assert v["mean_wait_us"] >= 0 and v["mean_work_us"] >= 0
        assert abs(v["mean_wait_us"] + v["mean_work_us"] - v["mean_task_us"]) < 0.02


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded"])
def test_non_contiguous_inputs_give_the_same_bits(folded):
    """x with a non-unit last stride, weights as transposed views, the norm weights a stride-0
    row, out a slice of a wider buffer, and a row broadcast to the batch (stride 0): the bits of
    the contiguous call (folded: x is the QKV dot's operand as given)."""
    w, kc, vc, seqlens, _ = _state(MID, 3, torch.bfloat16, [5, 300, 900])
    w = fold_norms(w) if folded else w
    x = torch.randn(3, MID.hidden, device="cuda", dtype=torch.bfloat16)
    plan = DecodeLayerPlan(MID, 3, CAP, device="cuda", dtype=torch.bfloat16, folded_norms=folded)
    k1, v1 = kc.clone(), vc.clone()
    base = plan.run(x, w, k1, v1, seqlens)
    wt = LayerWeights(**{k: (None if v is None else v.t().contiguous().t() if v.dim() == 2
                             else v[None].expand(2, -1)[1]) for k, v in w.as_dict().items()})
    xt = x.t().contiguous().t()
    assert xt.stride(-1) != 1 and wt.qkv.stride(-1) != 1
    wide = torch.full((3, 2 * MID.hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    k2, v2 = kc.clone(), vc.clone()
    out = plan.run(xt, wt, k2, v2, seqlens, out=wide[:, 1:MID.hidden + 1])
    assert torch.equal(out, base) and torch.equal(k2, k1) and torch.equal(v2, v1)
    assert wide[:, 0].isnan().all() and wide[:, MID.hidden + 1:].isnan().all()
    x1 = x[:1].expand(3, -1)
    got = plan.run(x1, w, kc.clone(), vc.clone(), seqlens)
    assert torch.equal(got, plan.run(x1.contiguous(), w, kc.clone(), vc.clone(), seqlens))


@pytest.mark.parametrize("folded", [False, True], ids=["norms", "folded"])
def test_nan_and_inf_stay_in_their_sequence(folded):
    """A NaN in one row of x, an inf in another and a NaN cached value of a third sequence: the
    untouched sequence's output and appended rows stay finite and equal those of a clean call."""
    w, kc, vc, seqlens, _ = _state(MID, 4, torch.bfloat16, [5, 300, 900, 40])
    w = fold_norms(w) if folded else w
    x = torch.randn(4, MID.hidden, device="cuda", dtype=torch.bfloat16)
    plan = DecodeLayerPlan(MID, 4, CAP, device="cuda", dtype=torch.bfloat16, num_splits=4, folded_norms=folded)
    k1, v1 = kc.clone(), vc.clone()
    clean = plan.run(x, w, k1, v1, seqlens)
    xb = x.clone()
    xb[0, 7] = float("nan")
    xb[1, 3] = float("inf")
    vb = vc.clone()
    vb[2, 100, 1, 5] = float("nan")
    k2 = kc.clone()
    out = plan.run(xb, w, k2, vb, seqlens)
    assert out[:3].isnan().any(dim=1).all() and out[3].isfinite().all()
    assert torch.equal(out[3], clean[3])
    assert not k2[0, 5].isfinite().all() and not k2[1, 300].isfinite().all()
    assert torch.equal(k2[2:], k1[2:]) and torch.equal(vb[3], v1[3])
