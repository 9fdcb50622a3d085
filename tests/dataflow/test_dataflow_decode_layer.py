"""The decode-layer megakernel on the dataflow machine (flashflow.dataflow.decode_layer): its jobs
follow the kernel's task table, the DRAM bytes sit at the fewest a step moves when the L2 holds
the workspaces, and each stage's span and busy SMs follow from its tasks."""
from dataclasses import replace
from types import SimpleNamespace

import pytest

from flashflow.cli import main
from flashflow.dataflow.decode_layer import layer_jobs, model_layer
from flashflow.device import cdiv
from flashflow.kernels.decode_layer import STAGES, build_tasks, decode_layer_bytes
from flashflow.tuning.decode_layer import decode_layer_config

LLAMA = SimpleNamespace(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336)
TINY = SimpleNamespace(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=192)
TILES = replace(decode_layer_config("sm90", 128), SPLIT_K=1, QKV_PAIRS=32, QKV_SPLIT=1)   # one K slice, 64-row QKV tiles unsplit: what split-K is compared with
TINY_TILES = replace(decode_layer_config("interpreter", 32), BLOCK_K=32, BLOCK_KV=16)


def test_jobs_follow_the_task_table():
    jobs = layer_jobs(TINY, 3, 40, TINY_TILES, 2)
    tasks = build_tasks(TINY, 3, 2, TINY_TILES)
    assert [j.name[0] for j in jobs] == [STAGES[t[0]] for t in tasks]
    qkv = [j for j in jobs if j.name[0] == "qkv"]
    assert all(len(j.steps) == cdiv(TINY.hidden, TINY_TILES.BLOCK_K) for j in qkv)
    down = [j for j in jobs if j.name[0] == "down"]
    assert all(len(j.steps) == cdiv(TINY.intermediate, TINY_TILES.BLOCK_K) for j in down)
    # every wait names jobs of smaller tickets (the table is topological)
    assert all(d < i for i, j in enumerate(jobs) for w in j.waits for d in w)
    # the attention tasks of a sequence and KV head read its 41 keys once over their splits
    keys = {k: n for j in jobs if j.name[0] == "attn" for step in j.steps for k, n in step if k[0] == "K"}
    assert len(keys) == 3 * 2 * cdiv(41, 16) and sum(keys.values()) == 3 * 2 * 41 * TINY.head_dim * 2


@pytest.mark.parametrize("batch,cache_len", [(1, 40), (3, 100)])
def test_dram_bytes_are_the_fewest_when_the_l2_holds_the_workspaces(batch, cache_len):
    r = model_layer(TINY, batch, cache_len, TINY_TILES, 2, num_slots=8, l2_bytes=64 * 2**20)
    fewest = decode_layer_bytes(TINY, batch, cache_len)
    # the workspaces are written back once: q, the attention partials and h in fp32; the GEMVs'
    # activations (the norm rows of x and h, the attention output, act) in the weights' dtype
    c, e = TINY, 2
    workspaces = 4 * batch * (c.heads * c.head_dim + c.kv_heads * 2 * (c.heads // c.kv_heads) * (c.head_dim + 2)
                              + c.hidden) \
        + e * batch * (2 * c.hidden + c.kv_heads * (c.heads // c.kv_heads) * c.head_dim + c.intermediate)
    assert r.compulsory_bytes == fewest
    # against the fewest: the norm weights are not modelled (2·hidden elements), the new token's
    # k and v go to DRAM and the attention reads them back (2·batch·kv_heads·d elements), and
    # every workspace block is written back once
    assert r.dram_bytes == fewest - 2 * c.hidden * e + 2 * batch * c.kv_heads * c.head_dim * e + workspaces
    # reads: the weights, x and the cache with the new token once; the workspaces are L2 hits
    weights = ((c.heads + 2 * c.kv_heads) * c.head_dim * c.hidden + c.hidden * c.heads * c.head_dim
               + 3 * c.intermediate * c.hidden) * e
    assert r.read_bytes == weights + batch * c.hidden * e + 2 * batch * c.kv_heads * (cache_len + 1) * c.head_dim * e


def test_a_small_l2_rereads_the_activations():
    big = model_layer(TINY, 3, 100, TINY_TILES, 2, num_slots=8, l2_bytes=64 * 2**20)
    small = model_layer(TINY, 3, 100, TINY_TILES, 2, num_slots=8, l2_bytes=1024)
    assert small.dram_bytes > big.dram_bytes


def test_llama_stages_at_batch_1():
    r = model_layer(LLAMA, 1, 4095, TILES, 16)
    stages = {s.name: s for s in r.stages}
    assert stages["down"].tasks == cdiv(4096, TILES.BLOCK_N)
    assert stages["down"].steps_per_task == cdiv(14336, TILES.BLOCK_K)
    # the down stage keeps its tasks' share of the 132 SMs busy over its span, no more
    assert stages["down"].busy_fraction == pytest.approx(stages["down"].tasks / 132)
    # each stage waits on the whole stage before: the spans add up to the step
    assert sum(s.span for s in r.stages) == r.makespan
    assert r.ideal_makespan == cdiv(sum(s.tasks * s.steps_per_task for s in r.stages), 132)
    assert r.makespan > r.ideal_makespan
    assert sum(s.weight_bytes for s in r.stages) == decode_layer_bytes(LLAMA, 1, 0) - 2 * (2 * 8 * 128 + 2 * 4096 + 2 * 4096)


def test_cli(capsys):
    assert main(["dataflow", "decode-layer", "--batch", "2", "--cache-len", "100", "--hidden", "256",
                 "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--intermediate", "512", "--sms", "8"]) == 0
    out = capsys.readouterr().out
    assert "down" in out and "SMs busy" in out and "K-steps" in out
    with pytest.raises(SystemExit) as e:
        main(["dataflow", "decode-layer", "--heads", "6", "--kv-heads", "4"])
    assert e.value.code == 2
    assert "--heads (6) must be a multiple of --kv-heads (4)" in capsys.readouterr().err


def test_split_k_jobs_and_bytes():
    """K slices: each O / down column block's slices read its K chunks once between them, the
    last slice waits on its siblings and reads their partials; DRAM bytes grow by the partials'
    write-back only."""
    tiles = replace(TINY_TILES, SPLIT_K=3)
    jobs = layer_jobs(TINY, 3, 40, tiles, 2)
    tasks = build_tasks(TINY, 3, 2, tiles)
    assert [j.name[0] for j in jobs] == [STAGES[t[0]] for t in tasks]
    assert all(d < i for i, j in enumerate(jobs) for w in j.waits for d in w)
    for stage, k_total in (("oproj", TINY.heads * TINY.head_dim), ("down", TINY.intermediate)):
        for col in range(cdiv(TINY.hidden, tiles.BLOCK_N)):
            idx = [i for i, j in enumerate(jobs) if j.name[:2] == (stage, col)]
            assert len(idx) == 3
            weight_chunks = [k for i in idx for step in jobs[i].steps for k, _ in step if k[0] == stage]
            assert sorted(weight_chunks) == [(stage, col, k) for k in range(cdiv(k_total, tiles.BLOCK_K))]
            merger = jobs[idx[-1]]
            assert sorted(merger.waits[-1]) == idx[:-1]
            assert {k for k, _ in merger.steps[-1]} == {(stage + "-part", col, s) for s in range(2)}
    one = model_layer(TINY, 3, 40, TINY_TILES, 2, num_slots=8, l2_bytes=64 * 2**20)
    three = model_layer(TINY, 3, 40, tiles, 2, num_slots=8, l2_bytes=64 * 2**20)
    partials = 2 * cdiv(TINY.hidden, tiles.BLOCK_N) * 3 * 3 * tiles.BLOCK_N * 4
    assert three.dram_bytes == one.dram_bytes + partials
    assert three.read_bytes == one.read_bytes


def test_split_k_fills_the_narrow_stages_at_llama_size():
    """The O and down stages, 32 column blocks for 132 SMs, in 4 K slices: 128 tasks each, a
    down slice starting once its quarter of the gate/up tiles is done, and the step's predicted
    time falls towards every SM busy (2.12x -> 1.20x of it)."""
    one = model_layer(LLAMA, 1, 4095, TILES, 16)
    four = model_layer(LLAMA, 1, 4095, replace(TILES, SPLIT_K=4), 16)
    s1, s4 = ({s.name: s for s in r.stages} for r in (one, four))
    for name in ("oproj", "down"):
        assert s4[name].tasks == 4 * s1[name].tasks
        assert s4[name].busy_fraction > 1.8 * s1[name].busy_fraction
    assert s4["oproj"].busy_fraction > 3 * s1["oproj"].busy_fraction
    # the first down slices run beside the gate/up tiles' second wave: the spans overlap
    assert sum(s.span for s in four.stages) > four.makespan
    assert one.makespan / one.ideal_makespan == pytest.approx(2.12, abs=0.01)
    assert four.makespan / four.ideal_makespan == pytest.approx(1.20, abs=0.01)
    assert s4["oproj"].span < s1["oproj"].span / 3 and s4["down"].span < s1["down"].span / 1.8
    assert four.makespan < 0.6 * one.makespan


def test_cli_split_k(capsys):
    assert main(["dataflow", "decode-layer", "--split-k", "4"]) == 0
    out = capsys.readouterr().out
    # the shipped tiles besides: QKV tiles of 64 rotary pairs in 4 K slices
    assert "SPLIT_K=4" in out and "QKV_SPLIT=4" in out and "1.18x" in out


def test_qkv_slices_jobs_and_bytes():
    """QKV tiles in K slices: a tile's slices read its weight chunks once between them, the last
    waits on its siblings and reads their partials; DRAM bytes grow by the partials' write-back."""
    tiles = replace(TINY_TILES, QKV_SPLIT=3)
    jobs = layer_jobs(TINY, 3, 40, tiles, 2)
    tasks = build_tasks(TINY, 3, 2, tiles)
    assert [j.name[0] for j in jobs] == [STAGES[t[0]] for t in tasks]
    assert all(d < i for i, j in enumerate(jobs) for w in j.waits for d in w)
    pairs = TINY.head_dim // 2 // tiles.QKV_PAIRS
    heads = TINY.heads + 2 * TINY.kv_heads
    for h in range(heads):
        for p in range(pairs):
            idx = [i for i, j in enumerate(jobs) if j.name[:3] == ("qkv", h, p)]
            assert len(idx) == 3
            chunks = [k for i in idx for step in jobs[i].steps for k, _ in step if k[0] == "Wqkv"]
            assert sorted(chunks) == [("Wqkv", h, p, k) for k in range(cdiv(TINY.hidden, tiles.BLOCK_K))]
            assert sorted(jobs[idx[-1]].waits[-1]) == idx[:-1]
    one = model_layer(TINY, 3, 40, TINY_TILES, 2, num_slots=8, l2_bytes=64 * 2**20)
    three = model_layer(TINY, 3, 40, tiles, 2, num_slots=8, l2_bytes=64 * 2**20)
    partials = heads * pairs * 3 * 3 * 2 * tiles.QKV_PAIRS * 4
    assert three.dram_bytes == one.dram_bytes + partials
    assert three.read_bytes == one.read_bytes


def test_folded_norms_jobs_and_bytes():
    """Folded norm weights: no norm rows of h, the QKV tasks read x itself and wait on the norm
    rows of x only before their last step (a non-merging slice not at all), the gate/up tasks
    read h as the O tasks wrote it in the weights' dtype; DRAM bytes: the normalised rows'
    write-back gives way to h's and 1 / rms."""
    for tiles in (TINY_TILES, replace(TINY_TILES, QKV_SPLIT=2)):
        jobs = layer_jobs(TINY, 3, 40, tiles, 2, folded=True)
        tasks = build_tasks(TINY, 3, 2, tiles, folded=True)
        assert [j.name[0] for j in jobs] == [STAGES[t[0]] for t in tasks]
        assert [j.name[1] for j in jobs if j.name[0] == "norm"] == [0, 0, 0]
        assert all(d < i for i, j in enumerate(jobs) for w in j.waits for d in w)
        norms = {i for i, j in enumerate(jobs) if j.name[0] == "norm"}
        for j in jobs:
            if j.name[0] == "qkv":
                assert not set(j.waits[0]) & norms or len(j.steps) == 1
                assert {k[0] for step in j.steps for k, _ in step} <= {"Wqkv", "x", "qkv-part"}
            if j.name[0] == "gateup":
                assert {k[0] for step in j.steps for k, _ in step} == {"gateup", "hb"}
        merging = [j for j in jobs if j.name[0] == "qkv" and j.waits and set(j.waits[-1]) & norms]
        assert len(merging) == (TINY.heads + 2 * TINY.kv_heads) * (TINY.head_dim // 2 // tiles.QKV_PAIRS)
    plain = model_layer(TINY, 3, 40, TINY_TILES, 2, num_slots=8, l2_bytes=64 * 2**20)
    folded = model_layer(TINY, 3, 40, TINY_TILES, 2, num_slots=8, l2_bytes=64 * 2**20, folded=True)
    assert folded.read_bytes == plain.read_bytes
    assert folded.dram_bytes == plain.dram_bytes - 3 * TINY.hidden * 2 + 3 * 4
    assert "norm-h" not in {s.name for s in folded.stages}


def test_cli_folded_norms(capsys):
    assert main(["dataflow", "decode-layer", "--folded-norms", "--qkv-split", "2"]) == 0
    out = capsys.readouterr().out
    assert "folded norms" in out and "QKV_SPLIT=2" in out and "norm-h" not in out
