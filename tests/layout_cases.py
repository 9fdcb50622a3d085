"""The layouts users pass, and one check per entry point that a layout changes nothing: shared by
tests/ops/test_layouts.py (Triton's interpreter, fp16/fp32, tiny shapes) and
tests/gpu/test_gpu_layouts.py (bf16/fp16 on the GPU).

A layout is a view of the logical tensor over a storage of another shape:

* ``contiguous``  the plain tensor;
* ``transposed``  stored with two leading axes swapped (SDPA's (b, h, s, d) behind an FA-layout
  view, or a column-major matrix: non-unit last stride);
* ``strided``     every other element of a twice-as-wide last axis (non-unit last stride);
* ``expanded``    stride 0 along batch (rank 3: heads; rank 2: rows), as ``.expand`` makes;
* ``packed``      a slice along heads (rank 2: columns) of a tensor three times as wide, as
  ``qkv.split`` makes.

Each check compares with float64 (exact ops) and, where the op quantizes, with the same call on
contiguous copies (a layout must not change a single bit of the result).
"""
from __future__ import annotations

import torch

import flashflow
from flashflow.reference.attention import attention_naive, attention_varlen_naive
from flashflow.reference.decode import kvcache_attention_ref
from flashflow.reference.metrics import rel_l2

LAYOUTS = ("contiguous", "transposed", "strided", "expanded", "packed")
NON_UNIT_LAST = ("strided",)   # and "transposed" at rank 2


def make(shape, layout: str, dtype, device, gen: torch.Generator, scale: float = 1.0, grad: bool = False):
    """A random tensor of ``shape`` laid out as ``layout`` (a view; with ``grad`` its storage
    requires grad, so gradients reach the view through autograd)."""
    shape = list(shape)
    rank = len(shape)
    store = list(shape)
    if layout == "transposed":
        a, b = (1, 2) if rank == 4 else (0, 1)
        store[a], store[b] = store[b], store[a]
    elif layout == "strided":
        store[-1] *= 2
    elif layout == "expanded":
        store[1 if rank == 3 else 0] = 1
    elif layout == "packed":
        store[-2 if rank >= 3 else -1] *= 3
    elif layout != "contiguous":
        raise ValueError(layout)
    base = (torch.randn(store, generator=gen) * scale).to(device, dtype).requires_grad_(grad)
    if layout == "transposed":
        view = base.transpose(*((1, 2) if rank == 4 else (0, 1)))
    elif layout == "strided":
        view = base[..., ::2]
    elif layout == "expanded":
        view = base.expand(shape)
    elif layout == "packed":
        axis = -2 if rank >= 3 else -1
        view = base.narrow(axis, shape[axis], shape[axis])
    else:
        view = base.view(shape)
    assert list(view.shape) == shape
    return view


def _grads(loss, inputs):
    return torch.autograd.grad(loss, inputs)


def check_attention(entry: str, layouts, dtype, device, tol: float, sizes=None, seed: int = 0):
    """Forward and backward of ``entry`` (``func``, ``varlen`` or ``sdpa``) with q, k, v and the
    output gradient laid out as ``layouts = (q, k, v, dout)``, against float64 autograd."""
    g = torch.Generator().manual_seed(seed)
    b, sq, sk, h, hk, d = sizes or (2, 19, 23, 4, 2, 24)
    if entry == "sdpa":   # (batch, heads, seqlen, head_dim), one head count (no enable_gqa here)
        shapes = ((b, h, sq, d), (b, h, sk, d), (b, h, sk, d), (b, h, sq, d))
    elif entry == "varlen":
        shapes = ((b * sq, h, d), (b * sk, hk, d), (b * sk, hk, d), (b * sq, h, d))
    else:
        shapes = ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d))
    q, k, v, do = (make(s, lay, dtype, device, g, grad=i < 3) for i, (s, lay) in enumerate(zip(shapes, layouts)))
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if entry == "sdpa":
        out = flashflow.scaled_dot_product_attention(q, k, v)
        ref = attention_naive(*(t.transpose(1, 2) for t in refs)).transpose(1, 2)
    elif entry == "varlen":
        cu_q = torch.arange(0, b + 1, dtype=torch.int32, device=device) * sq
        cu_k = torch.arange(0, b + 1, dtype=torch.int32, device=device) * sk
        cu_q[1] -= 3   # ragged: the first sequence is shorter
        cu_k[1] -= 5
        out = flashflow.flash_attn_varlen_func(q, k, v, cu_q, cu_k, sq + 3, sk + 5, causal=True)
        ref = attention_varlen_naive(*refs, cu_q.cpu(), cu_k.cpu(), causal=True)
    else:
        out = flashflow.flash_attn_func(q, k, v, causal=True)
        ref = attention_naive(*refs, causal=True)
    assert rel_l2(out, ref) < tol, ("out", rel_l2(out, ref))
    got = _grads((out.float() * do.float()).sum(), (q, k, v))
    want = _grads((ref * do.double()).sum(), refs)
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == r.shape and torch.isfinite(a).all(), name
        assert rel_l2(a, r) < tol, (name, rel_l2(a, r))


def check_fp8_attention(layout: str, device, dtype, tol: float, sizes=None, seed: int = 0):
    """flash_attn_fp8_func with q, k, v laid out as ``layout``: the same bits as on contiguous
    copies, and within the FP8 tolerance of float64 exact attention."""
    g = torch.Generator().manual_seed(seed)
    b, sq, sk, h, hk, d = sizes or (2, 40, 72, 4, 2, 64)
    q, k, v = (make(s, layout, dtype, device, g) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    out = flashflow.flash_attn_fp8_func(q, k, v, causal=True)
    same = flashflow.flash_attn_fp8_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, same), (out.float() - same.float()).abs().max()
    ref = attention_naive(q.double(), k.double(), v.double(), causal=True)
    assert rel_l2(out, ref) < tol, rel_l2(out, ref)


def check_decode(layout: str, paged: bool, device, dtype, tol: float, sizes=None, seed: int = 0):
    """flash_attn_with_kvcache appending k/v, with q, k, v laid out as ``layout``: the output and
    the cache after the append against the float64 reference (a wrong append would spoil every
    later step, so the cache is compared too, and a second step attends what was appended)."""
    g = torch.Generator().manual_seed(seed)
    b, sq, h, hk, d, cap = sizes or (2, 2, 4, 2, 32, 48)
    k_cache = torch.randn(b, cap, hk, d, generator=g).to(device, dtype)
    v_cache = torch.randn(b, cap, hk, d, generator=g).to(device, dtype)
    lens = torch.tensor([cap // 3, cap - 2 * sq - 1][:b] + [5] * max(0, b - 2), dtype=torch.int32, device=device)
    q = make((b, sq, h, d), layout, dtype, device, g)
    k = make((b, sq, hk, d), layout, dtype, device, g)
    v = make((b, sq, hk, d), layout, dtype, device, g)
    kw = {}
    if paged:   # pages of 16 tokens, each sequence's pages in reverse order
        page = 16
        n = cap // page
        table = torch.stack([torch.arange(n) + i * n for i in range(b)]).flip(1).to(device, torch.int32)
        pages_k = torch.empty(b * n, page, hk, d, dtype=dtype, device=device)
        pages_v = torch.empty_like(pages_k)
        for i in range(b):
            for j in range(n):
                pages_k[table[i, j]] = k_cache[i, j * page:(j + 1) * page]
                pages_v[table[i, j]] = v_cache[i, j * page:(j + 1) * page]
        caches, kw = (pages_k, pages_v), dict(block_table=table)
    else:
        caches = (k_cache, v_cache)
    ref_caches = tuple(c.double() for c in caches)
    ref, _, ref_k, ref_v = kvcache_attention_ref(q.double(), *ref_caches, k.double(), v.double(), cache_seqlens=lens,
                                                 causal=True, **kw)
    out = flashflow.flash_attn_with_kvcache(q, *caches, k=k, v=v, cache_seqlens=lens, causal=True, **kw)
    assert rel_l2(out, ref) < tol, ("out", rel_l2(out, ref))
    assert rel_l2(caches[0], ref_k) < tol and rel_l2(caches[1], ref_v) < tol, "the appended k/v"
    # the next step reads the appended tokens from the cache
    q2 = make((b, 1, h, d), layout, dtype, device, g)
    ref2, *_ = kvcache_attention_ref(q2.double(), ref_k, ref_v, cache_seqlens=lens + sq, causal=True, **kw)
    out2 = flashflow.flash_attn_with_kvcache(q2, *caches, cache_seqlens=lens + sq, causal=True, **kw)
    assert rel_l2(out2, ref2) < tol, ("next step", rel_l2(out2, ref2))


def check_ffn(layout: str, device, dtype, tol: float, sizes=None, activation: str = "swiglu", seed: int = 0):
    """fused_mlp with x, w_gate_up and w_down laid out as ``layout``, against float64."""
    from flashflow.reference.mlp import mlp_ref

    g = torch.Generator().manual_seed(seed)
    m, hidden, inter = sizes or (5, 48, 40)
    rows = 2 * inter if activation == "swiglu" else inter
    x = make((m, hidden), layout, dtype, device, g)
    w1 = make((rows, hidden), layout, dtype, device, g, scale=hidden ** -0.5)
    w2 = make((hidden, inter), layout, dtype, device, g, scale=inter ** -0.5)
    out = flashflow.fused_mlp(x, w1, w2, activation=activation)
    ref = mlp_ref(x.double(), w1.double(), w2.double(), activation)
    assert rel_l2(out, ref) < tol, rel_l2(out, ref)
