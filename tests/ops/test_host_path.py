"""The host path's caches: a call key stands for everything the checks and the launch derive
from the arguments, and nothing a check refuses is let through by a key seen before."""
import pytest
import torch

import flashflow
from flashflow.ops.common import call_key, contiguous_strides
from flashflow.reference.attention import attention_naive
from flashflow.reference.metrics import rel_l2

DEVICE = "cpu"


def test_call_key_tells_kinds_apart():
    t = torch.zeros(2, 3)
    base = call_key((t, True, 1.0, "NHD", None, (-1, -1)))
    assert base is not None and base == call_key((torch.ones(2, 3), True, 1.0, "NHD", None, (-1, -1)))
    for other in ((t, 1, 1.0, "NHD", None, (-1, -1)),          # True and 1 hash alike
                  (t, True, 1, "NHD", None, (-1, -1)),           # 1.0 and 1 too
                  (t, True, 1.0, "NHD", None, (-1, 0)),
                  (t.t(), True, 1.0, "NHD", None, (-1, -1)),      # strides
                  (t.double(), True, 1.0, "NHD", None, (-1, -1)),
                  (t.requires_grad_(False).clone().requires_grad_(), True, 1.0, "NHD", None, (-1, -1))):
        assert call_key(other) != base
    with torch.no_grad():
        assert call_key((t, True, 1.0, "NHD", None, (-1, -1))) != base
    assert call_key(([1, 2],)) is None                       # a list: checked in full, never cached
    assert call_key(((-1.0, -1.0),)) is None                  # a window of floats
    assert call_key((torch.nn.Parameter(t),)) is None         # a tensor subclass


def test_call_key_alignment_flag():
    buf = torch.zeros(64, dtype=torch.float16)
    assert call_key((buf[:16],))[-1] is True
    assert call_key((buf[1:17],))[-1] is False                # 2 bytes past a 16-byte boundary


@pytest.mark.parametrize("shape", [(2, 3, 4), (1, 5, 1, 7), (0, 3), (4, 0, 2), ()])
def test_contiguous_strides_are_torchs(shape):
    assert contiguous_strides(shape) == torch.empty(shape).stride()


def _qkv(shape=(2, 37, 4, 16), dtype=torch.float32, gen=None):
    return [torch.randn(shape, dtype=dtype, device=DEVICE, generator=gen) for _ in range(3)]


def test_forward_plans_follow_flags_and_layouts():
    """One shape, calls that differ only in a flag, a window or the layout: each gets its own
    plan (a reused plan would compute the wrong mask or read the wrong strides)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(gen=gen)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)   # (b, h, s, d) storage, same shape
    for _ in range(2):   # the second round runs on the cached plans
        for kw in (dict(), dict(causal=True), dict(window_size=(5, 3)), dict(softcap=2.0), dict(causal=True)):
            for qq in (q, qt):
                out = flashflow.flash_attn_func(qq, k, v, **kw)
                ref = attention_naive(q.double(), k.double(), v.double(), **kw)
                assert rel_l2(out, ref) < 1e-5, kw


def test_decode_key_seen_before_still_refuses_bad_flags():
    q = torch.randn(2, 1, 4, 32, device=DEVICE)
    kc, vc = (torch.randn(2, 64, 2, 32, device=DEVICE) for _ in range(2))
    plan = flashflow.plan_decode(2, 4, 2, 32, 64, device=DEVICE)
    plan.run(q, kc, vc, cache_seqlens=30, causal=True)
    with pytest.raises(TypeError, match="causal"):
        plan.run(q, kc, vc, cache_seqlens=30, causal=1)
    with pytest.raises(ValueError, match="exceeds the cache capacity"):
        plan.run(q, kc, vc, cache_seqlens=65, causal=True)
    with pytest.raises(ValueError, match="requires grad"):
        plan.run(q.clone().requires_grad_(), kc, vc, cache_seqlens=30, causal=True)


def test_decode_cached_int_lengths_follow_the_value():
    """An int ``cache_seqlens`` is part of the call key: a cached step of 30 tokens is not
    reused for 40."""
    q = torch.randn(1, 1, 2, 32, device=DEVICE)
    kc, vc = (torch.randn(1, 64, 1, 32, device=DEVICE) for _ in range(2))
    plan = flashflow.plan_decode(1, 2, 1, 32, 64, device=DEVICE)
    from flashflow.reference.decode import kvcache_attention_ref

    for n in (30, 40, 30):
        out = plan.run(q, kc, vc, cache_seqlens=n)
        ref, *_ = kvcache_attention_ref(q.double(), kc.double(), vc.double(), cache_seqlens=n)
        assert rel_l2(out, ref) < 1e-5, n


def test_fused_mlp_key_seen_before_still_refuses():
    x = torch.randn(3, 32, device=DEVICE)
    w1 = torch.randn(2 * 48, 32, device=DEVICE) * 0.1
    w2 = torch.randn(32, 48, device=DEVICE) * 0.1
    a = flashflow.fused_mlp(x, w1, w2)
    assert torch.equal(a, flashflow.fused_mlp(x, w1, w2))   # the cached path gives the same bits
    with pytest.raises(ValueError, match="requires grad"):
        flashflow.fused_mlp(x, w1.clone().requires_grad_(), w2)
    with pytest.raises(ValueError, match="policy"):
        flashflow.fused_mlp(x, w1, w2, policy="nope")
