"""The Gluon attention forward (Hopper) against float64: every shipped config and the schedules
of the study, odd lengths, GQA, causal with fewer and more queries than keys (rows with no key),
the key-padding mask, LSE against the portable kernel's, NaN-filled outputs; NaN/inf in the
neighbouring sequence's rows past a ragged end; the dispatcher's choice and its override; the
SDPA and fused-q/k/v layouts; CUDA graphs, torch.compile and the backward through it."""
import math

import pytest
import torch

import flashflow
from flashflow.device import gpu_family
from flashflow.ops import attention as attn_ops
from flashflow.ops import attention_gluon as ag
from flashflow.ops.attention import _portable_forward
from flashflow.ops.common import stream_scratch
from flashflow.tuning.attention_gluon import GluonAttentionConfig as C

pytestmark = pytest.mark.gpu

CONFIGS = {
    "shipped": None,
    "split-pp": C(128, 128, 4, 2, True, True, True),
    "split": C(128, 128, 4, 2, True, True, False),
    "split-pp-s3": C(128, 128, 4, 3, True, True, True),
    "persistent-8warps": C(128, 128, 8, 2, True, False, False, True),
    "persistent-split-pp": C(128, 128, 4, 2, True, True, True, True),
    "persistent-split": C(128, 128, 4, 2, True, True, False, True),
    "dynamic-split": C(128, 128, 4, 2, True, True, False, True, dynamic=True),
    "dynamic-split-pp": C(128, 128, 4, 2, True, True, True, True, dynamic=True),
    "dynamic-split-one-q": C(128, 128, 4, 2, True, True, False, True, dynamic=True, q_buffers=1),
    "persistent-split-overlap": C(128, 128, 4, 2, True, True, False, True, overlap_tiles=True),
    "dynamic-split-overlap": C(128, 128, 4, 2, True, True, False, True, dynamic=True, overlap_tiles=True),
    "dynamic-split-one-q-overlap": C(128, 128, 4, 2, True, True, False, True, dynamic=True, q_buffers=1,
                                     overlap_tiles=True),
    "persistent-split-overlap-pp": C(128, 128, 4, 2, True, True, True, True, overlap_tiles=True),
    "dynamic-split-overlap-pp": C(128, 128, 4, 2, True, True, True, True, dynamic=True, overlap_tiles=True),
    "m64-n64": C(64, 64, 4, 2),
    "m128-8warps": C(128, 128, 8, 2),
    # the accumulator rescaled once the previous P·V is waited on, in each form of the consumer
    "m64-n64-early": C(64, 64, 4, 2, early_rescale=True),
    "split-early": C(128, 128, 4, 2, True, True, False, early_rescale=True),
    "persistent-split-early": C(128, 128, 4, 2, True, True, False, True, early_rescale=True),
    "dynamic-split-overlap-pp-early": C(128, 128, 4, 2, True, True, True, True, dynamic=True, overlap_tiles=True,
                                        early_rescale=True),
}
# b, sq, sk, h, hk, d, causal, key padding
SHAPES = {
    "qwen-like": (1, 4352, 4352, 4, 4, 128, False, False),
    "ragged-gqa": (2, 1000, 1000, 8, 2, 128, False, False),
    "ragged-gqa-causal": (2, 1000, 1000, 8, 2, 128, True, False),
    "causal-sq<sk": (1, 300, 1000, 4, 4, 128, True, False),
    "causal-sq>sk": (1, 1000, 300, 4, 4, 128, True, False),
    "short": (1, 77, 77, 4, 4, 128, False, False),
    "d64-causal-odd": (2, 513, 700, 4, 4, 64, True, False),
    "key-padding": (2, 640, 640, 4, 4, 128, False, True),
    "key-padding-causal-gqa": (1, 640, 640, 4, 2, 128, True, True),
    "many-tiles-gqa": (4, 1000, 1000, 32, 8, 128, False, False),
    "causal-9000-gqa": (1, 9000, 9000, 4, 2, 128, True, False),   # (the causal entry past 8192 keys)
}


@pytest.fixture(autouse=True)
def hopper():
    if gpu_family(torch.device("cuda")) != "sm90":
        pytest.skip("the Gluon attention is written for Hopper (sm90)")


def _exact(q, k, v, causal, kpm=None):
    g = q.shape[2] // k.shape[2]
    kk, vv = (t.double().repeat_interleave(g, 2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * q.shape[-1] ** -0.5
    if kpm is not None:
        full = torch.ones(k.shape[0], k.shape[1], dtype=torch.bool, device=q.device)
        full[:, :kpm.shape[1]] = kpm
        s = s.masked_fill(~full[:, None, None, :], float("-inf"))
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        hidden = torch.arange(sk, device=q.device)[None, :] > torch.arange(sq, device=q.device)[:, None] + sk - sq
        s = s.masked_fill(hidden, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1).nan_to_num(0.0), vv)


def _run(q, k, v, cfg, causal, kpm=None, mask_keys=None, out=None):
    d = q.shape[-1]
    if cfg is None and d != 128:
        cfg = ag.gluon_attention_config(d, causal, "sm90", k.shape[1])
    return ag.gluon_forward(q, k, v, key_padding_mask=kpm, mask_keys=mask_keys, softmax_scale=d ** -0.5,
                            window_right=0 if causal else None, out=out, config=cfg)


def _check_against_float64_and_the_portable_lse(gpu, shape, cfg):
    b, sq, sk, h, hk, d, causal, kp = shape
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kpm = torch.rand(b, 200, device="cuda") > 0.3 if kp else None
    before = [t.clone() for t in (q, k, v)]
    out, lse = _run(q, k, v, cfg, causal, kpm, 200 if kp else None, out=gpu.nan_like(q))
    assert all(torch.equal(t, t0) for t, t0 in zip((q, k, v), before))   # the inputs as they were
    _, ref_lse = _portable_forward(q, k, v, key_padding_mask=kpm, mask_keys=200 if kp else None,
                                   softmax_scale=d ** -0.5, window_right=0 if causal else None)
    assert not out.isnan().any()
    assert gpu.rel(out, _exact(q, k, v, causal, kpm)) < gpu.tol
    assert torch.equal(lse == -math.inf, ref_lse == -math.inf)
    finite = ref_lse.isfinite()
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-3


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_against_float64_and_the_portable_lse(gpu, shape, config):
    _check_against_float64_and_the_portable_lse(gpu, SHAPES[shape], CONFIGS[config])


D256_CONFIGS = {"shipped": None, "n64-split": C(128, 64, 4, 2, True, True, False),
                "n64-dynamic-one-q": C(128, 64, 4, 2, True, True, False, True, dynamic=True, q_buffers=1),
                "n64-dynamic-one-q-overlap": C(128, 64, 4, 2, True, True, False, True, dynamic=True, q_buffers=1,
                                               overlap_tiles=True),
                "n64-dynamic-one-q-overlap-pp": C(128, 64, 4, 2, True, True, True, True, dynamic=True, q_buffers=1,
                                                  overlap_tiles=True),
                "n64-split-early": C(128, 64, 4, 2, True, True, False, early_rescale=True)}
D256_SHAPES = {
    "ragged-gqa-causal": (2, 1000, 1000, 4, 2, 256, True, False),
    "causal-sq<sk": (1, 300, 1000, 2, 2, 256, True, False),
    "causal-sq>sk": (1, 1000, 300, 2, 2, 256, True, False),
    "causal-2100-gqa": (1, 2100, 2100, 4, 2, 256, True, False),
    "short": (1, 77, 77, 2, 2, 256, False, False),
    "key-padding": (2, 640, 640, 2, 2, 256, False, True),
}


@pytest.mark.parametrize("config", list(D256_CONFIGS))
@pytest.mark.parametrize("shape", list(D256_SHAPES))
def test_head_dim_256_against_float64_and_the_portable_lse(gpu, shape, config):
    """head_dim 256: 64-key blocks, 192 KB of shared memory; one CTA a tile, persistent with
    one Q buffer, by ticket, overlapped."""
    _check_against_float64_and_the_portable_lse(gpu, D256_SHAPES[shape], D256_CONFIGS[config])


D64_CONFIGS = {"shipped": None,
               "m192-dynamic-overlap": C(192, 128, 4, 2, True, True, False, True, dynamic=True, overlap_tiles=True),
               "m192-one-q-s3": C(192, 128, 4, 3, True, True, False, True, dynamic=True, q_buffers=1,
                                  overlap_tiles=True)}
D64_SHAPES = {
    "ragged-gqa": (2, 1000, 1000, 8, 2, 64, False, False),
    "ragged-gqa-causal": (2, 1000, 1000, 8, 2, 64, True, False),
    "causal-sq<sk": (1, 300, 1000, 4, 4, 64, True, False),
    "causal-sq>sk": (1, 1000, 300, 4, 4, 64, True, False),
    "short": (1, 77, 77, 4, 4, 64, False, False),
    "key-padding": (2, 640, 640, 4, 4, 64, False, True),
    "many-tiles-gqa": (4, 1000, 1000, 32, 8, 64, False, False),
}


@pytest.mark.parametrize("config", list(D64_CONFIGS))
@pytest.mark.parametrize("shape", list(D64_SHAPES))
def test_head_dim_64_against_float64_and_the_portable_lse(gpu, shape, config):
    """head_dim 64: 192 rows as three MMA partitions (Q in three 64-row TMA boxes), a tile past
    the sequence's end included."""
    _check_against_float64_and_the_portable_lse(gpu, D64_SHAPES[shape], D64_CONFIGS[config])


@pytest.mark.parametrize("head_dim", [128, 256])
def test_repeated_calls_take_the_recorded_plan(gpu, head_dim):
    """flash_attn_func records the Gluon call's plan under its call key (with and without
    autograd) and launches it on later calls: fresh inputs of one key, each against float64,
    forward and backward; a call 16 bytes off a 128-byte boundary and one whose inputs are not
    16-byte aligned (the portable kernel's) beside them."""
    b, s, h, d = 1, 1100, 4, head_dim
    attn_ops._ENTRIES.clear()
    for step in range(3):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            assert gpu.rel(flashflow.flash_attn_func(q, k, v, causal=causal), _exact(q, k, v, causal)) < gpu.tol
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            out = flashflow.flash_attn_func(qg, kg, vg, causal=causal)
            dout = torch.randn_like(out)
            out.backward(dout)
            qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
            ref = _exact(qd, kd, vd, causal)
            ref.backward(dout.double())
            assert gpu.rel(out, ref) < gpu.tol
            for t, r in ((qg, qd), (kg, kd), (vg, vd)):
                assert gpu.rel(t.grad, r.grad) < 2e-2
        for shift in (8, 1):   # elements: 16 bytes (TMA still reads it), 2 bytes (it cannot)
            qs, ks, vs = (torch.empty(t.numel() + shift, dtype=t.dtype, device="cuda")[shift:].view(t.shape).copy_(t)
                          for t in (q, k, v))
            expect = ag.GLUON if shift == 8 else attn_ops.PORTABLE
            assert attn_ops.forward_kernel_name(qs, ks, vs, softmax_scale=d ** -0.5) == expect
            assert gpu.rel(flashflow.flash_attn_func(qs, ks, vs), _exact(q, k, v, False)) < gpu.tol
    plans = [e[0] for e in attn_ops._ENTRIES.values()]
    assert any(isinstance(p, ag.GluonPlan) for p in plans)


@pytest.mark.parametrize("config", ["shipped", "split-pp", "m64-n64"])
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_the_next_sequence_past_a_ragged_end_does_not_leak(gpu, config, bad):
    """Rows past sequence 0's last key are sequence 1's (the 2-D row view): NaN or inf there
    must not reach sequence 0's output (keys masked, V's rows zeroed before P·V)."""
    b, s, h, d = 2, 1000, 4, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    k[1], v[1] = float(bad), float(bad)
    for causal in (False, True):
        out, _ = _run(q, k, v, CONFIGS[config] if not causal else None, causal, out=gpu.nan_like(q))
        assert out[0].isfinite().all()
        assert gpu.rel(out[0:1], _exact(q[0:1], k[0:1], v[0:1], causal)) < gpu.tol


@pytest.mark.parametrize("head_dim", [64, 128, 256])   # (64 and 256: their persistent entries without a mask)
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_finite_inputs_as_the_portable_kernel(which, head_dim):
    b, s, h, d = 1, 700, 4, head_dim
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    t = dict(q=q, k=k, v=v)[which]
    t[0, 5, 1, 7] = float("nan")
    t[0, 300, 2, 0] = float("inf")
    for causal in (False, True):
        out, _ = _run(q, k, v, None, causal)
        ref, _ = _portable_forward(q, k, v, softmax_scale=d ** -0.5, window_right=0 if causal else None)
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())


def test_dispatch_and_its_override(monkeypatch):
    q, k, v = (torch.randn(1, 2048, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kw = dict(softmax_scale=128 ** -0.5)
    assert attn_ops.forward_kernel_name(q, k, v, **kw) == ag.GLUON
    assert attn_ops.forward_kernel_name(q, k, v, window_right=0, **kw) == ag.GLUON
    q64 = q[..., :64].contiguous()
    assert attn_ops.forward_kernel_name(q64, q64, q64, **kw) == ag.GLUON   # d64 from 2048 keys, no causal mask
    short64 = q64[:, :2047]
    assert attn_ops.forward_kernel_name(short64, short64, short64, **kw) == attn_ops.PORTABLE
    assert attn_ops.forward_kernel_name(q64, q64, q64, window_right=0, **kw) == ag.GLUON   # causal too
    assert attn_ops.forward_kernel_name(short64, short64, short64, window_right=0, **kw) == attn_ops.PORTABLE
    short = q[:, :300]
    assert attn_ops.forward_kernel_name(short, short, short, **kw) == ag.GLUON   # from 256 keys
    assert attn_ops.forward_kernel_name(short, short, short, window_right=0, **kw) == attn_ops.PORTABLE
    assert attn_ops.forward_kernel_name(*(q[:, :512],) * 3, window_right=0, **kw) == ag.GLUON   # causal from 512
    shorter = q[:, :200]
    assert attn_ops.forward_kernel_name(shorter, shorter, shorter, **kw) == attn_ops.PORTABLE   # min_seqlen_k
    monkeypatch.setenv(ag.KERNEL_ENV, "portable")
    assert attn_ops.forward_kernel_name(q, k, v, **kw) == attn_ops.PORTABLE
    monkeypatch.setenv(ag.KERNEL_ENV, "gluon")
    assert attn_ops.forward_kernel_name(short64, short64, short64, window_right=0, **kw) == ag.GLUON
    out = flashflow.flash_attn_func(short64, short64, short64, causal=True)
    assert out.isfinite().all()
    q96 = torch.randn(1, 256, 4, 96, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim 96"):
        flashflow.flash_attn_func(q96, q96, q96)
    monkeypatch.delenv(ag.KERNEL_ENV)
    q256 = torch.randn(1, 1024, 4, 256, device="cuda", dtype=torch.bfloat16)
    for causal in (None, 0):   # head_dim 256 from 512 keys, causal or not
        assert attn_ops.forward_kernel_name(q256, q256, q256, window_right=causal, **kw) == ag.GLUON
        assert attn_ops.forward_kernel_name(*(q256[:, :300],) * 3, window_right=causal, **kw) == attn_ops.PORTABLE


@pytest.mark.parametrize("head_dim", [64, 128, 256])   # (64: the 192-row tile from 2048 keys)
@pytest.mark.parametrize("layout", ["sdpa-transposed", "fused-qkv", "expanded-kv", "last-stride-2"])
def test_layouts(gpu, layout, head_dim):
    b, s, h, d = 2, 2049, 8, head_dim
    if layout == "sdpa-transposed":
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
        expect = ag.GLUON
    elif layout == "fused-qkv":
        qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.unbind(2)
        expect = ag.GLUON
    elif layout == "last-stride-2":   # every other element: TMA cannot read it, the portable kernel copies
        q, k, v = (torch.randn(b, s, h, 2 * d, device="cuda", dtype=torch.bfloat16)[..., ::2] for _ in range(3))
        expect = attn_ops.PORTABLE
    else:   # one KV head broadcast over all: stride 0 along heads, no row view
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, s, 1, d, device="cuda", dtype=torch.bfloat16).expand(b, s, h, d) for _ in range(2))
        expect = attn_ops.PORTABLE
    assert attn_ops.forward_kernel_name(q, k, v, softmax_scale=d ** -0.5) == expect
    for causal in (False, True):
        out = flashflow.flash_attn_func(q, k, v, causal=causal)
        assert gpu.rel(out, _exact(q, k, v, causal)) < gpu.tol


@pytest.mark.parametrize("head_dim", [64, 128])   # (64: the head_dim-128 causal tile from 2048 keys)
def test_sdpa_entry_and_backward(gpu, head_dim):
    b, s, h, d = 1, 2051, 4, head_dim
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flashflow.scaled_dot_product_attention(q, k, v, is_causal=True)
    qd, kd, vd = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref = _exact(qd, kd, vd, True).transpose(1, 2)
    assert gpu.rel(out, ref) < gpu.tol
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout.double())
    for t, r in ((q, qd), (k, kd), (v, vd)):
        assert gpu.rel(t.grad, r.grad.transpose(1, 2)) < gpu.tol


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_peaked_attention_against_float64(gpu, causal, head_dim):
    """Scores four times larger than unit-variance inputs give: a few keys carry each row, so a
    wrong key attended shows (near-uniform attention hides it)."""
    b, s, h, hk, d = 2, 2100, 8, 2, head_dim
    q = 4 * torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kpm = torch.rand(b, 256, device="cuda") > 0.3
    assert attn_ops.forward_kernel_name(q, k, v, softmax_scale=d ** -0.5) == ag.GLUON
    out = flashflow.flash_attn_func(q, k, v, causal=causal, key_padding_mask=kpm)
    assert gpu.rel(out, _exact(q, k, v, causal, kpm)) < gpu.tol


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_finite_forward_and_backward_as_the_portable_path(monkeypatch, which, bad):
    """A NaN or inf in q, k or v: the output and the three gradients (the portable backward,
    from the Gluon forward's LSE) hold non-finite values exactly where the portable forward's
    path puts them."""
    b, s, h, d = 1, 2048, 4, 128
    base = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    base["qkv".index(which)][0, 700, 1, 5] = float(bad)
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    results = {}
    for choice in ("gluon", "portable"):
        monkeypatch.setenv(ag.KERNEL_ENV, choice)
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = flashflow.flash_attn_func(q, k, v, causal=True)
        out.backward(dout)
        results[choice] = [out.detach(), q.grad, k.grad, v.grad]
    for got, ref in zip(results["gluon"], results["portable"]):
        assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.isinf(), ref.isinf())


@pytest.mark.parametrize("head_dim, s, causal", [(64, 2100, False), (64, 2100, True), (256, 1500, False)])
@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_head_dim_64_and_256_non_finite_forward_and_backward_as_the_portable_path(monkeypatch, which, bad,
                                                                                   head_dim, s, causal):
    """head_dim 64 (the 192-row tile; causal, the head_dim-128 causal tile) and 256 without a
    causal mask (the persistent entries, tiles by ticket), on transposed (SDPA-layout) inputs: a
    NaN or inf in q, k or v gives the output and the three gradients the portable path's
    non-finite pattern."""
    b, h, d = 1, 4, head_dim
    base = [torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
    base["qkv".index(which)][0, 700, 1, 5] = float(bad)
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    assert attn_ops.forward_kernel_name(*base, softmax_scale=d ** -0.5, window_right=0 if causal else None) == ag.GLUON
    results = {}
    for choice in ("gluon", "portable"):
        monkeypatch.setenv(ag.KERNEL_ENV, choice)
        q, k, v = (t.detach().clone().requires_grad_() for t in base)
        out = flashflow.flash_attn_func(q, k, v, causal=causal)
        out.backward(dout)
        results[choice] = [out.detach(), q.grad, k.grad, v.grad]
    for got, ref in zip(results["gluon"], results["portable"]):
        assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.isinf(), ref.isinf())


def test_graph_replays_and_compile(gpu):
    b, s, h, d = 1, 2048, 8, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert attn_ops.forward_kernel_name(q, k, v, softmax_scale=d ** -0.5) == ag.GLUON
    worst = gpu.worst_over_replays(lambda: flashflow.flash_attn_func(q, k, v), q,
                                   lambda x: _exact(x, k, v, False), replays=20, new_input_every=5)
    assert worst < gpu.tol
    compiled = torch.compile(lambda q, k, v: flashflow.flash_attn_func(q, k, v, causal=True), fullgraph=True)
    assert gpu.rel(compiled(q, k, v), _exact(q, k, v, True)) < gpu.tol


@pytest.mark.parametrize("overlap,turns", [(False, True), (True, False), (True, True)],
                         ids=["turns", "overlapped", "overlapped-turns"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_persistent_tiles_without_an_unmasked_block(gpu, dynamic, overlap, turns):
    """Persistent CTAs (two MMA partitions) walking more tiles than SMs, where some tiles hold only
    masked blocks (causal diagonals, a sequence shorter than a block) and some no block at all
    (rows before the first key): every tile against float64, tiles walked statically or claimed
    by ticket, with ping-pong turns, with tiles overlapped (a tile's output stored under the
    next tile's first Q·Kᵀ, issued also where the next tile has no block) or both; the tile
    counter is zero again after each launch."""
    cfg = C(128, 128, 4, 2, True, True, turns, True, dynamic=dynamic, overlap_tiles=overlap)
    for (b, sq, sk, h, causal) in ((3, 1100, 1100, 48, True), (64, 90, 90, 8, False), (2, 700, 260, 96, True),
                                   (1, 300, 300, 2, True)):   # (the last: fewer tiles than SMs)
        torch.manual_seed(b)
        q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, h, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for _ in range(2):
            out, _ = _run(q, k, v, cfg, causal, out=gpu.nan_like(q))
            assert not out.isnan().any()
            assert gpu.rel(out, _exact(q, k, v, causal)) < gpu.tol
            if dynamic:
                assert int(stream_scratch("attention-tiles", 1, q.device).count_nonzero()) == 0


def _on_two_streams_and_in_graph_replays(gpu, cfg, q, k, v, causal):
    """Launches of ``cfg`` on a side stream and the default stream at once (other queries), then
    CUDA-graph replays with new inputs: every output against float64."""
    q2 = torch.randn_like(q)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        out2, _ = _run(q2, k, v, cfg, causal)
    out, _ = _run(q, k, v, cfg, causal)
    torch.cuda.synchronize()
    assert gpu.rel(out, _exact(q, k, v, causal)) < gpu.tol
    assert gpu.rel(out2, _exact(q2, k, v, causal)) < gpu.tol
    worst = gpu.worst_over_replays(lambda: _run(q, k, v, cfg, causal)[0], q, lambda x: _exact(x, k, v, causal),
                                   replays=12, new_input_every=4)
    assert worst < gpu.tol


def test_dynamic_tiles_on_a_side_stream_and_in_graph_replays(gpu):
    """Tiles claimed by ticket: the counter is kept per stream (two streams' launches do not
    share it) and a captured launch takes its own, which each replay leaves at zero."""
    cfg = C(128, 128, 4, 2, True, True, True, True, dynamic=True)
    b, s, h, d = 2, 2100, 16, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    _on_two_streams_and_in_graph_replays(gpu, cfg, q, k, v, True)


def _pieces_config(head_dim, min_piece_blocks):
    import dataclasses

    return dataclasses.replace(ag.gluon_attention_config(head_dim, False, "sm90", 4096), split_last_wave=True,
                               min_piece_blocks=min_piece_blocks)


# b, sq, sk, h, hk, d, causal, key padding: tiles past the last full wave of 132 CTAs (H100, H200)
PIECE_SHAPES = {
    "few-tiles-ragged": (1, 1000, 1000, 2, 2, 128, False, False),      # 16 tiles of 8 blocks
    "key-padding": (2, 640, 640, 4, 4, 128, False, True),              # 40 tiles, the mask in block 1
    "qwen-like": (1, 4352, 4352, 4, 4, 128, False, False),             # 136 tiles: 4 past the wave
    "waves-gqa-ragged": (2, 1000, 1000, 70, 14, 128, False, False),    # 1120 tiles: 64 past 8 waves
    "sq<sk": (1, 300, 1000, 4, 4, 128, False, False),
    "gqa-sq<sk": (1, 890, 2600, 26, 13, 128, False, False),          # 182 tiles: 50 past the wave, 2 pieces
    "d256-ragged": (1, 1000, 1000, 2, 2, 256, False, False),
    "d64-ragged": (1, 1000, 1000, 2, 2, 64, False, False),             # 12 tiles of 192 rows: three partitions
    "d64-waves-gqa": (2, 1000, 1000, 70, 14, 64, False, False),        # 840 tiles: 48 past 6 waves
}


@pytest.mark.parametrize("min_piece_blocks", [1, 4])
@pytest.mark.parametrize("shape", list(PIECE_SHAPES))
def test_last_wave_in_key_pieces_against_float64(gpu, shape, min_piece_blocks):
    """The tiles past the last full wave run in key pieces, merged by each tile's last piece:
    against float64 and the portable kernel's LSE, the outputs NaN-filled before the call (the
    plan splits where the rule says so), and the pieces' counters zero again after the launch."""
    b, sq, sk, h, hk, d, causal, kp = PIECE_SHAPES[shape]
    cfg = _pieces_config(d, min_piece_blocks)
    q = torch.empty(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    plan, _ = ag.gluon_plan(q, k, k, None, 0, None, True, False, cfg)
    # every shape splits but the key-padding one at 4 blocks a piece (5 blocks a tile)
    assert (plan.split_tiles > 0) == (shape != "key-padding" or min_piece_blocks == 1)
    assert plan.constexprs["SPLIT"] == (plan.split_tiles > 0)
    for _ in range(2):
        _check_against_float64_and_the_portable_lse(gpu, PIECE_SHAPES[shape], cfg)
        torch.cuda.synchronize()
        assert int(stream_scratch("attention-pieces", 1, q.device).count_nonzero()) == 0
    # the merge adds no error of its own: tile by tile (128 rows of one head), the split call's
    # error against float64 is the whole-tile call's, on inputs with peaked rows (q scaled ×4)
    import dataclasses

    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16) * 4
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kpm = torch.rand(b, 200, device="cuda") > 0.3 if kp else None
    ref = _exact(q, k, v, False, kpm)
    errs = []
    for c in (cfg, dataclasses.replace(cfg, split_last_wave=False)):
        out, _ = _run(q, k, v, c, False, kpm, 200 if kp else None)
        diff = (out.double() - ref).transpose(1, 2).split(128, dim=2)
        errs.append(torch.stack([x.norm(dim=(2, 3)) for x in diff]) /
                    torch.stack([x.norm(dim=(2, 3)) for x in ref.transpose(1, 2).split(128, dim=2)]))
    assert errs[0].max().item() < 1.25 * errs[1].max().item() + 1e-4, (errs[0].max(), errs[1].max())


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_key_pieces_with_non_finite_inputs_as_the_portable_kernel(which):
    """NaN and inf in one piece's keys or values, or in a query row, reach the merged rows as
    they reach the portable kernel's."""
    b, s, h, d = 1, 700, 4, 128   # 24 tiles of 6 blocks: 5 pieces a tile
    cfg = _pieces_config(d, 1)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    t = dict(q=q, k=k, v=v)[which]
    t[0, 5, 1, 7] = float("nan")
    t[0, 300, 2, 0] = float("inf")
    t[0, 650, 3, 3] = float("-inf")
    out, lse = _run(q, k, v, cfg, False)
    assert ag.gluon_plan(q, k, v, None, 0, None, True, False, cfg)[0].split_tiles == 24
    ref, ref_lse = _portable_forward(q, k, v, softmax_scale=d ** -0.5)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    assert torch.equal(lse.isnan(), ref_lse.isnan())


def test_key_pieces_on_a_side_stream_and_in_graph_replays(gpu):
    """Key pieces: the counters are kept per stream, the scratch a call's own; two streams'
    launches at once and CUDA-graph replays with new inputs each give the right rows."""
    cfg = _pieces_config(128, 4)
    b, s, h, d = 1, 4352, 4, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert ag.gluon_plan(q, k, v, None, 0, None, True, False, cfg)[0].split_tiles == 4
    _on_two_streams_and_in_graph_replays(gpu, cfg, q, k, v, False)
