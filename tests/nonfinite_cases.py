"""NaN and inf in, and where they must come out: one check per op, shared by
tests/ops/test_nonfinite.py (Triton's interpreter) and tests/gpu/test_gpu_nonfinite.py.

The rule is exact math's: a non-finite input reaches exactly the outputs that depend on it. An
upstream blow-up must never disappear into plausible numbers (a finite output where exact math
has none), and must not spread to outputs that do not depend on it (another sequence, another
head group, a key a row does not attend, a cache slot past the sequence's length).

One allowance, stated where it is used: a NaN/inf in ``v`` at a key that a row does not attend
but that shares a key tile with keys it does (the diagonal tile under causal) may reach that row
too, in that channel only: the tile's P·V multiplies the masked key's zero probability by the
value, and 0·NaN is NaN (FlashAttention's kernels behave the same).
"""
from __future__ import annotations

import torch

import flashflow
from flashflow.reference.attention import attention_mask, attention_naive
from flashflow.reference.decode import kvcache_attention_ref

BAD = {"nan": float("nan"), "inf": float("inf")}


def _rows_bad(t):
    """Per (…, row) whether any channel is non-finite."""
    return ~torch.isfinite(t.float()).all(dim=-1)


def check_attention_forward(which: str, bad: str, causal: bool, device, dtype, sizes=None, seed: int = 0):
    """flash_attn_func with one non-finite element in q, k or v."""
    g = torch.Generator().manual_seed(seed)
    b, sq, sk, h, hk, d = sizes or (2, 19, 23, 4, 2, 24)
    q = torch.randn(b, sq, h, d, generator=g).to(device, dtype)
    k = torch.randn(b, sk, hk, d, generator=g).to(device, dtype)
    v = torch.randn(b, sk, hk, d, generator=g).to(device, dtype)
    bi, i0, j0, h0, c0 = 1, sq // 2, sk // 2, 1, d // 3
    group = h // hk
    hk0 = h0 // group
    rows_of_group = torch.arange(h, device=device) // group == hk0
    allowed = attention_mask(sq, sk, causal, device=device)          # (sq, sk)
    want = torch.zeros(b, sq, h, dtype=torch.bool, device=device)    # rows exact math makes non-finite
    if which == "q":
        q[bi, i0, h0, c0] = BAD[bad]
        want[bi, i0, h0] = allowed[i0].any()
    elif which == "k":
        k[bi, j0, hk0, c0] = BAD[bad]
        want[bi] = allowed[:, j0, None] & rows_of_group[None, :]
    else:
        v[bi, j0, hk0, c0] = BAD[bad]
        want[bi] = allowed[:, j0, None] & rows_of_group[None, :]
    out = flashflow.flash_attn_func(q, k, v, causal=causal)
    got = _rows_bad(out)
    if which == "k" and bad == "inf":
        # q·k is +inf or -inf by the sign of q's channel: -inf is a key the row gives no weight
        want = _rows_bad(attention_naive(q.double(), k.double(), v.double(), causal=causal))
        assert want.any() and want.sum() < want[bi].numel()
    if which == "v":
        # only channel c0 may be non-finite; rows of the same tile as an attended row may be too
        others = torch.ones(d, dtype=torch.bool, device=device)
        others[c0] = False
        assert torch.isfinite(out[..., others].float()).all(), "a NaN in one channel of v spread to others"
        assert (got >= want).all(), "a non-finite v did not reach a row that attends it"
        assert not got[1 - bi].any() and not got[bi][:, ~rows_of_group].any(), "reached another sequence/group"
        if not causal:
            assert torch.equal(got, want)
    else:
        assert torch.equal(got, want), (got.nonzero().tolist(), want.nonzero().tolist())


def check_attention_backward(which: str, bad: str, device, dtype, sizes=None, seed: int = 0):
    """The gradients of flash_attn_func with one non-finite element in q, k, v or dout: every
    gradient entry exact math (float64 autograd) makes non-finite is non-finite, and the other
    sequence of the batch keeps finite gradients."""
    g = torch.Generator().manual_seed(seed)
    b, sq, sk, h, hk, d = sizes or (2, 19, 23, 4, 2, 24)
    ts = [torch.randn(b, s, n, d, generator=g).to(device, dtype) for s, n in ((sq, h), (sk, hk), (sk, hk), (sq, h))]
    idx = {"q": (1, sq // 2, 1, 3), "k": (1, sk // 2, 0, 3), "v": (1, sk // 2, 0, 3), "dout": (1, sq // 2, 1, 3)}
    ts[("q", "k", "v", "dout").index(which)][idx[which]] = BAD[bad]
    q, k, v, do = ts
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashflow.flash_attn_func(*ins)
    got = torch.autograd.grad(out, ins, do)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention_naive(*refs), refs, do.double())
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        bad_a, bad_r = ~torch.isfinite(a.float()), ~torch.isfinite(r)
        assert (bad_a >= bad_r).all(), f"{name}: a non-finite input vanished from the gradient"
        assert not bad_a[0].any(), f"{name}: reached the other sequence"


def check_decode(where: str, bad: str, device, dtype, paged: bool = False, seed: int = 0):
    """flash_attn_with_kvcache with a non-finite value in q, the new k, a cached key inside the
    sequence, or cache slots past its length (unwritten memory: must never be read)."""
    g = torch.Generator().manual_seed(seed)
    b, sq, h, hk, d, cap = 2, 1, 4, 2, 32, 64
    k_cache = torch.randn(b, cap, hk, d, generator=g).to(device, dtype)
    v_cache = torch.randn(b, cap, hk, d, generator=g).to(device, dtype)
    lens = torch.tensor([20, 37], dtype=torch.int32, device=device)
    q = torch.randn(b, sq, h, d, generator=g).to(device, dtype)
    k = torch.randn(b, 1, hk, d, generator=g).to(device, dtype)
    v = torch.randn(b, 1, hk, d, generator=g).to(device, dtype)
    clean = kvcache_attention_ref(q.double(), k_cache.double(), v_cache.double(), k.double(), v.double(),
                                  cache_seqlens=lens, causal=True)[0]
    want = torch.zeros(b, sq, h, dtype=torch.bool, device=device)
    if where == "q":
        q[1, 0, 3, 5] = BAD[bad]
        want[1, 0, 3] = True
    elif where == "k_new":
        k[1, 0, 0, 5] = BAD[bad]
        want[1, 0, :h // hk] = True
    elif where == "cached_v":
        v_cache[1, 30, 1, 5] = BAD[bad]
        want[1, 0, h // hk:] = True
    elif where == "past_length":   # what torch.empty or an earlier, longer sequence left there
        v_cache[0, 21:] = BAD[bad]
        k_cache[0, 21:] = BAD[bad]
        v_cache[1, 38:] = BAD[bad]
    else:
        raise ValueError(where)
    kw = {}
    caches = (k_cache, v_cache)
    if paged:   # pages of 16 tokens, one table row per sequence
        n = cap // 16
        table = torch.arange(b * n, device=device, dtype=torch.int32).view(b, n)
        caches = tuple(c.reshape(b * n, 16, hk, d) for c in caches)
        kw = dict(block_table=table)
    out = flashflow.flash_attn_with_kvcache(q, *caches, k=k, v=v, cache_seqlens=lens, causal=True, **kw)
    got = _rows_bad(out)
    assert torch.equal(got, want), (got.nonzero().tolist(), want.nonzero().tolist())
    if where == "past_length":
        assert ((out.double() - clean).abs().max() < 1e-2), "unused cache slots changed the answer"


def check_ffn(where: str, bad: str, device, dtype, m: int = 5, seed: int = 0):
    """fused_mlp with a non-finite value in x, w_gate_up or w_down: exactly the outputs exact
    math makes non-finite; then a clean call on the same workspace is exact again (nothing
    non-finite stays behind in the split-K accumulator)."""
    from flashflow.reference.mlp import mlp_ref

    g = torch.Generator().manual_seed(seed)
    hidden, inter = 48, 40
    x = torch.randn(m, hidden, generator=g).to(device, dtype)
    w1 = (torch.randn(2 * inter, hidden, generator=g) * hidden ** -0.5).to(device, dtype)
    w2 = (torch.randn(hidden, inter, generator=g) * inter ** -0.5).to(device, dtype)
    x_bad, w1_bad, w2_bad = x.clone(), w1.clone(), w2.clone()
    {"x": x_bad, "w_gate_up": w1_bad, "w_down": w2_bad}[where][1, 7] = BAD[bad]
    out = flashflow.fused_mlp(x_bad, w1_bad, w2_bad)
    want = ~torch.isfinite(mlp_ref(x_bad.double(), w1_bad.double(), w2_bad.double(), "swiglu"))
    assert want.any()
    assert torch.equal(~torch.isfinite(out.float()), want)
    again = flashflow.fused_mlp(x, w1, w2)
    ref = mlp_ref(x.double(), w1.double(), w2.double(), "swiglu")
    assert torch.isfinite(again.float()).all() and (again.double() - ref).abs().max() < 1e-2 * ref.abs().max()


def check_norm(op: str, where: str, bad: str, device, dtype, seed: int = 0):
    """The diffusion block's norm ops with a non-finite element in one input: exactly the
    outputs the float64 reference makes non-finite."""
    from flashflow.ops import norm
    from flashflow.reference import norm as ref

    g = torch.Generator().manual_seed(seed)
    b, l, h, d = 2, 5, 3, 16
    if op == "rmsnorm_rope":
        ins = {"x": torch.randn(b, l, h, d, generator=g), "weight": torch.randn(d, generator=g)}
        angles = torch.rand(l, d // 2, generator=g) * 6.3
        freqs = torch.polar(torch.ones_like(angles), angles).to(device)
    else:
        ins = {"residual": torch.randn(b, l, h * d, generator=g), "y": torch.randn(b, l, h * d, generator=g),
               "gate": torch.randn(b, h * d, generator=g), "shift": torch.randn(b, h * d, generator=g),
               "scale": torch.randn(b, h * d, generator=g)}
    ins = {name: t.to(device, dtype) for name, t in ins.items()}
    ins[where].view(-1)[7] = BAD[bad]
    if op == "rmsnorm_rope":
        out = norm.rmsnorm_rope(ins["x"], ins["weight"], freqs)
        want = ref.rmsnorm_rope(ins["x"].double(), ins["weight"].double(), freqs)
    elif op == "layernorm_modulate":
        out = norm.layernorm_modulate(ins["y"], ins["shift"], ins["scale"])
        want = ref.layernorm_modulate(ins["y"].double(), ins["shift"].double(), ins["scale"].double())
    else:
        out = norm.gate_residual_layernorm_modulate(*ins.values())
        want = ref.gate_residual_layernorm_modulate(*(t.double() for t in ins.values()))
    outs = out if isinstance(out, tuple) else (out,)
    wants = want if isinstance(want, tuple) else (want,)
    for o, w in zip(outs, wants):
        assert torch.equal(~torch.isfinite(o.float()), ~torch.isfinite(w)), op


def exact_attention_over(q, k, v, scale, allowed):
    """Float64 exact attention ``(out, lse)`` over the keys ``allowed`` lets each row attend
    (``(batch, 1 or heads, seqlen_q, seqlen_k)`` bool), in which a key a row does not attend
    contributes nothing to it (attention_naive multiplies it by 0, and 0·NaN is NaN); GQA by
    repeating k and v over the group."""
    h = q.shape[2]
    group = h // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(group, dim=2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    p = p.masked_fill(~allowed, 0.0)
    vv = v.double().repeat_interleave(group, dim=2).transpose(1, 2)            # (b, h, sk, d)
    out = p @ torch.where(torch.isfinite(vv), vv, torch.zeros_like(vv))
    # a non-finite v[j, c] makes channel c of every row that attends key j non-finite
    hit = (allowed.to(torch.float64) @ (~torch.isfinite(vv)).to(torch.float64)) > 0
    return out.masked_fill(hit, float("nan")).transpose(1, 2), lse
