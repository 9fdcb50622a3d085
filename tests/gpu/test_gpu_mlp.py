"""The fused FFN on the GPU, bf16 and fp16 against float64: every activation, every policy and
both Triton baselines, split-K with grouped configs, odd and 3-D strided shapes; then stress:
back-to-back calls and CUDA-graph replays with each output checked and the workspace all zero
afterwards."""
import dataclasses

import pytest
import torch

from flashflow import MlpWorkspace, fused_mlp
from flashflow.device import gpu_family, num_sms
from flashflow.ops import mlp
from flashflow.reference.mlp import mlp_ref
from flashflow.tuning.mlp import splitk_config

pytestmark = pytest.mark.gpu
PERSISTENT = ("sequential", "rowblock", "multirow", "multirow:2", "halfrow", "seqsplit")
BASELINES = {"two-kernels": mlp.mlp_two_kernels, "two-streams": mlp.mlp_two_streams}
# split-K with the partials of 2-8 slices summed on chip before the atomic adds: (group, BLOCK_N)
GROUPED = {"g2n64": (2, 64), "g4n32": (4, 32), "g4n64": (4, 64), "g8n16": (8, 16)}


def _inputs(act, m, hidden, inter, dtype, strided=False):
    rows = 2 * inter if act == "swiglu" else inter
    w1 = torch.randn(rows, hidden, device="cuda", dtype=dtype) / hidden ** 0.5
    w2 = torch.randn(hidden, inter, device="cuda", dtype=dtype) / inter ** 0.5
    if strided:   # (2, m, hidden) seen through a column slice of a wider tensor
        x = torch.randn(2, m, hidden + 24, device="cuda", dtype=dtype)[..., 8:8 + hidden]
    else:
        x = torch.randn(m, hidden, device="cuda", dtype=dtype)
    return x, w1, w2


def _grouped(group, block_n):
    """split-K on the shipped tiles with ``group`` slices summed on chip and GEMM1 steps of ``block_n``."""
    def run(x, w1, w2, act, workspace):
        base = splitk_config(gpu_family(x.device), act == "swiglu", x.shape[0], w2.shape[1], num_sms(x.device))
        cfg = dataclasses.replace(base, group=group, BLOCK_N=block_n)
        return mlp.launch_splitk(x, w1, w2, act, workspace, config=cfg)
    return run


def _check_cases():
    """id -> (dtype, activation, M, hidden, inter, policy, strided). Compiling dominates the run
    time, and a kernel is compiled per (dtype, activation, policy, tiles, divisibility of the
    sizes by 16), not per shape: every feature is covered on few compilations, each over
    several shapes."""
    cases = {}

    def add(dtype, act, m, h, i, policy, strided=False):
        cases[f"{dtype}-{act}-M{m}-{h}x{i}-{policy}{'-strided' if strided else ''}"] = (
            getattr(torch, dtype), act, m, h, i, policy, strided)
    odd = ((130, 520, 1000), (300, 1000, 3000))   # 2 and 3 row-blocks, sizes not multiples of 16
    for dtype in ("bfloat16", "float16"):
        for act in ("swiglu", "gelu", "silu", "relu"):
            for m, h, i in ((1, 1000, 3000), (7, 1000, 3000), (7, 520, 1000)):
                add(dtype, act, m, h, i, "splitk")
            for m in (1, 64, 130):
                add(dtype, act, m, 520, 1000, "auto")
            # every tile order for the gated and one non-gated FFN, both dtypes; one order for
            # the other activations (they differ from gelu in the activation code only)
            policies = PERSISTENT if act in ("swiglu", "gelu") else ("multirow",)
            for m, h, i in odd:
                for policy in policies:
                    add(dtype, act, m, h, i, policy)
        for act in ("swiglu", "gelu"):
            for m, h, i in ((1, 4096, 14336), (64, 512, 1536)):
                add(dtype, act, m, h, i, "splitk")
    for act in ("swiglu", "gelu"):
        for m, h, i in odd:
            for policy in BASELINES:
                add("bfloat16", act, m, h, i, policy)
    for m in (16, 64):
        add("bfloat16", "swiglu", m, 4096, 14336, "splitk")
    for policy in PERSISTENT + tuple(BASELINES) + ("auto",):
        add("bfloat16", "swiglu", 256, 4096, 14336, policy)
    add("bfloat16", "swiglu", 5, 520, 1000, "auto", strided=True)
    add("bfloat16", "gelu", 200, 520, 1000, "auto", strided=True)
    for name in GROUPED:
        for act, m, h, i in ([("swiglu", m, 4096, 14336) for m in (1, 4, 5, 16)]
                             + [("swiglu", 7, 1000, 3000), ("gelu", 7, 1000, 3000), ("swiglu", 3, 1001, 3003)]):
            add("bfloat16", act, m, h, i, name)
    return cases


CHECKS = _check_cases()


@pytest.mark.parametrize("case", list(CHECKS))
def test_fused_mlp_against_float64(gpu, case):
    dtype, act, m, hidden, inter, policy, strided = CHECKS[case]
    x, w1, w2 = _inputs(act, m, hidden, inter, dtype, strided)
    ws = MlpWorkspace(hidden, max_tokens=x.numel() // hidden, device="cuda")
    if policy in BASELINES:
        out = BASELINES[policy](x, w1, w2, act, **({"workspace": ws} if policy == "two-streams" else {}))
    elif policy in GROUPED:
        out = _grouped(*GROUPED[policy])(x, w1, w2, act, ws)
    else:
        out = fused_mlp(x, w1, w2, act, policy, workspace=ws)
    ref = mlp_ref(x.double(), w1.double(), w2.double(), act)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    assert gpu.rel(out, ref) <= gpu.tol
    assert ws.buffer.count_nonzero().item() == 0   # counters and accumulators left zeroed
    if policy in PERSISTENT:
        # into NaN-filled out and intermediate: a tile never written shows; same bits as the op
        name, rows = mlp.parse_policy(policy)
        out2, h = gpu.nan_like(out), torch.full((m, inter), float("nan"), dtype=dtype, device="cuda")
        mlp.launch_persistent(x, w1, w2, act, name, rows, ws, out=out2, h=h)
        assert torch.equal(out2, out)
        assert not torch.isnan(h).any()


# (policy, M): split-K at 16 and 64, every persistent policy at 4 row-blocks, seqsplit where
# `auto` picks it, multirow at 32 row-blocks, the two-stream baseline, and the grouped split-K
STRESS = ([("splitk", 16), ("splitk", 64)] + [(p, 512) for p in ("sequential", "rowblock", "multirow", "halfrow")]
          + [("seqsplit", 256), ("multirow", 4096), ("two-streams", 512)] + [(g, 16) for g in GROUPED])


@pytest.mark.parametrize("policy, m", STRESS, ids=[f"{p}-M{m}" for p, m in STRESS])
def test_back_to_back_and_graph_replays_llama3_8b(gpu, policy, m):
    runs = 100
    x, w1, w2 = _inputs("swiglu", m, 4096, 14336, torch.bfloat16)
    ws = MlpWorkspace(4096, max_tokens=m, device="cuda")
    if policy == "two-streams":
        def call():
            return mlp.mlp_two_streams(x, w1, w2, "swiglu", workspace=ws)
    elif policy in GROUPED:
        def call():
            return _grouped(*GROUPED[policy])(x, w1, w2, "swiglu", ws)
    else:
        def call():
            return fused_mlp(x, w1, w2, "swiglu", policy, workspace=ws)

    def ref_of(x):
        return mlp_ref(x.double(), w1.double(), w2.double())

    ref = ref_of(x)
    outs = [call() for _ in range(runs)]
    torch.cuda.synchronize()
    assert max(gpu.rel(o, ref) for o in outs) <= gpu.tol
    if policy in PERSISTENT:   # no atomics: a stale or half-written tile shows as a difference
        assert all(torch.equal(o, outs[0]) for o in outs)
    del outs
    assert gpu.worst_over_replays(call, x, ref_of, replays=runs) <= gpu.tol
    assert ws.buffer.count_nonzero().item() == 0
