"""Attention backward (flash_attn_func through autograd), Triton's interpreter, against autograd
through the float64 reference: dQ, dK, dV for each feature, small odd shapes."""
import pytest
import torch

import flashflow
from flashflow.reference import full_key_padding_mask
from flashflow.reference.attention import attention_naive
from flashflow.reference.metrics import rel_l2

pytestmark = pytest.mark.kernels
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}


def grads(b=2, sq=37, sk=45, h=4, hk=2, d=32, causal=False, window=(-1, -1), softcap=0.0, dtype=torch.float16,
          mask_keys=None, need=(True, True, True), with_lse=False, seed=0, *, device):
    """(flashflow's grads, float64 reference grads) of a random loss through the attention."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, d, generator=g).to(dtype).to(device)
               for s, n in ((sq, h), (sk, hk), (sk, hk)))
    do = torch.randn(b, sq, h, d, generator=g).to(dtype).to(device)
    dl = torch.randn(b, h, sq, generator=g).to(device)
    key_padding_mask = None
    if mask_keys is not None:
        key_padding_mask = torch.rand(b, mask_keys, generator=g).to(device) > 0.4
    ins = [t.clone().requires_grad_(n) for t, n in zip((q, k, v), need)]
    res = flashflow.flash_attn_func(*ins, causal=causal, window_size=window, softcap=softcap,
                                    key_padding_mask=key_padding_mask,
                                    return_lse=with_lse)
    refs = [t.detach().double().requires_grad_(n) for t, n in zip((q, k, v), need)]
    full = None if key_padding_mask is None else full_key_padding_mask(key_padding_mask, sk)
    ref = attention_naive(*refs, None, causal, window, softcap, key_padding_mask=full, return_lse=with_lse)
    if with_lse:
        out, lse = res
        ref_out, ref_lse = ref
        fin = torch.isfinite(ref_lse)
        loss = (out.float() * do.float()).sum() + (torch.where(fin, lse, 0) * dl).sum()
        ref_loss = (ref_out * do.double()).sum() + (torch.where(fin, ref_lse, 0) * dl.double()).sum()
    else:
        loss, ref_loss = (res.float() * do.float()).sum(), (ref * do.double()).sum()
    loss.backward()
    ref_loss.backward()
    return [t.grad for t in ins], [t.grad for t in refs]


def check(dtype=torch.float16, *, device, **kw):
    got, want = grads(dtype=dtype, **kw, device=device)
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        if r is None:
            assert a is None, name
            continue
        assert a is not None and a.dtype == dtype and torch.isfinite(a).all(), name
        assert rel_l2(a, r) < TOL[dtype], (name, rel_l2(a, r))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(37, 45), (45, 37), (1, 29), (50, 50)])
def test_dense_and_causal(device, causal, sq, sk):
    check(sq=sq, sk=sk, causal=causal, device=device)   # sq > sk causal: the first rows see no key


@pytest.mark.parametrize("window", [(8, 0), (5, 7), (-1, 3), (10, -1)])
def test_sliding_window(device, window):
    check(window=window, device=device)


def test_softcap(device):
    check(softcap=5.0, causal=True, device=device)
    check(softcap=2.0, device=device)


@pytest.mark.parametrize("h,hk", [(4, 4), (6, 1), (6, 2)])
def test_gqa_mqa_sum_over_the_group(device, h, hk):
    check(h=h, hk=hk, causal=True, device=device)


def test_key_padding_mask(device):
    check(mask_keys=20, device=device)
    check(mask_keys=45, causal=True, device=device)


@pytest.mark.parametrize("d", [16, 80, 96, 128])
def test_head_dims(device, d):
    check(d=d, sq=21, sk=33, b=1, h=2, hk=1, device=device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dtypes(device, dtype):
    check(dtype=dtype, causal=True, device=device)


def test_gradient_of_a_returned_lse(device):
    check(with_lse=True, causal=True, device=device)


def _spy_launches(monkeypatch):
    """The backward's launches as ``(kernel name, args)``, in order."""
    import flashflow.ops.attention_bwd as bwd

    launched = []
    for name, attr in (("attention_bwd_delta_kernel", "_DELTA"), ("attention_bwd_dkdv_kernel", "_DKDV"),
                       ("attention_bwd_dq_kernel", "_DQ")):
        launcher = getattr(bwd, attr)
        assert launcher.kernel is getattr(bwd, name)

        def spy(key, grid, args, constexprs, launcher=launcher, name=name):
            launched.append((name, args))
            return launcher(key, grid, args, constexprs)
        monkeypatch.setattr(bwd, attr, spy)
    return launched


@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("need", [(True, True, True), (True, False, False), (False, True, True), (False, False, True)])
def test_only_the_gradients_asked_for(device, need, with_lse, monkeypatch):
    """Frozen K/V (LoRA-style) cost no dK/dV launch; a frozen q no dQ launch. δ comes from the dQ
    launch, which runs first; only a backward without dQ launches the δ kernel (before dK/dV)."""
    launched = _spy_launches(monkeypatch)
    check(need=need, causal=True, with_lse=with_lse, device=device)
    names = [name for name, _ in launched]
    want = (["attention_bwd_dq_kernel"] if need[0] else ["attention_bwd_delta_kernel"]) \
        + (["attention_bwd_dkdv_kernel"] if need[1] or need[2] else [])
    assert names == want


def _delta_of(launched):
    """The δ buffer the backward's first launch filled (the dQ kernel's or the δ kernel's)."""
    name, args = launched[0]
    return args[7] if name == "attention_bwd_dq_kernel" else args[3]


@pytest.mark.parametrize("need_dq", [True, False])
def test_delta_is_every_row_and_no_other(device, need_dq, monkeypatch):
    """δ = rowsum(dO ∘ O) − dlse as the backward computes it, against float64, dense (b, h, sq)
    and varlen (h, tq) with a sequence shorter than a tile and an empty one: every row is written
    and a program's rows past its sequence write nothing (they would land on the next head's or
    sequence's rows). Non-causal, so the later programs (past the end) run after the earlier."""
    g = torch.Generator().manual_seed(5)
    b, sq, sk, h, hk, d = 2, 37, 29, 4, 2, 24
    q = torch.randn(b, sq, h, d, generator=g).half().to(device)
    k, v = (torch.randn(b, sk, hk, d, generator=g).half().to(device) for _ in range(2))
    do = torch.randn(b, sq, h, d, generator=g).half().to(device)
    dl = torch.randn(b, h, sq, generator=g).to(device)
    ins = [q.clone().requires_grad_(need_dq), k.clone().requires_grad_(), v.clone().requires_grad_()]
    out, lse = flashflow.flash_attn_func(*ins, return_lse=True)
    launched = _spy_launches(monkeypatch)
    ((out.float() * do.float()).sum() + (lse * dl).sum()).backward()
    want = (do.double() * out.detach().double()).sum(-1).transpose(1, 2) - dl.double()
    torch.testing.assert_close(_delta_of(launched).double(), want, rtol=1e-5, atol=1e-5)

    lq, lk = [17, 0, 33, 5], [23, 4, 33, 1]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for x in (lq, lk))
    q = torch.randn(sum(lq), h, d, generator=g).half().to(device)
    k, v = (torch.randn(sum(lk), hk, d, generator=g).half().to(device) for _ in range(2))
    do = torch.randn(sum(lq), h, d, generator=g).half().to(device)
    dl = torch.randn(h, sum(lq), generator=g).to(device)
    ins = [q.clone().requires_grad_(need_dq), k.clone().requires_grad_(), v.clone().requires_grad_()]
    out, lse = flashflow.flash_attn_varlen_func(*ins, cu_q, cu_k, max(lq), max(lk), return_lse=True)
    launched.clear()
    ((out.float() * do.float()).sum() + (lse * dl).sum()).backward()
    want = (do.double() * out.detach().double()).sum(-1).T - dl.double()
    torch.testing.assert_close(_delta_of(launched).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("need", [(True, False, False), (False, True, True), (True, True, True)])
def test_varlen_gradient_of_a_returned_lse(device, need):
    """flash_attn_varlen_func with return_lse (GQA, causal, a sequence shorter than a tile, an
    empty one): each gradient asked for against the float64 reference run per sequence."""
    from flashflow.reference.attention import attention_varlen_naive
    g = torch.Generator().manual_seed(6)
    lq, lk = [17, 0, 33, 5], [23, 4, 33, 1]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for x in (lq, lk))
    q = torch.randn(sum(lq), 4, 32, generator=g).half().to(device)
    k, v = (torch.randn(sum(lk), 2, 32, generator=g).half().to(device) for _ in range(2))
    do = torch.randn(sum(lq), 4, 32, generator=g).half().to(device)
    dl = torch.randn(4, sum(lq), generator=g).to(device)

    def loss(out, lse):
        fin = torch.isfinite(lse)
        return (out * do.to(out.dtype)).sum() + (torch.where(fin, lse, 0) * dl.to(lse.dtype)).sum()
    ins = [t.clone().requires_grad_(n) for t, n in zip((q, k, v), need)]
    out, lse = flashflow.flash_attn_varlen_func(*ins, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
    loss(out.float(), lse).backward()
    refs = [t.double().requires_grad_(n) for t, n in zip((q, k, v), need)]
    loss(*attention_varlen_naive(*refs, cu_q, cu_k, causal=True, return_lse=True)).backward()
    for name, a, r in zip(("dq", "dk", "dv"), ins, refs):
        if r.grad is None:
            assert a.grad is None, name
            continue
        assert torch.isfinite(a.grad).all() and rel_l2(a.grad, r.grad) < TOL[torch.float16], (name, rel_l2(a.grad, r.grad))


def test_deterministic_bits_and_its_argument(device):
    a, _ = grads(causal=True, h=6, hk=2, device=device)
    b, _ = grads(causal=True, h=6, hk=2, device=device)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    x = torch.randn(1, 8, 2, 16, device=device, dtype=torch.float16)
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        flashflow.flash_attn_func(x, x, x, deterministic="yes")
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        flashflow.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, 8, 8, deterministic=1)


def test_no_grad_calls_stay_on_the_inference_path(device):
    x = torch.randn(1, 8, 2, 16, device=device, dtype=torch.float16, requires_grad=True)
    with torch.no_grad():
        out = flashflow.flash_attn_func(x, x, x)
    assert not out.requires_grad


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(29, 29), (20, 33), (33, 20)])
def test_sdpa_entry_without_a_mask(device, is_causal, sq, sk):
    """scaled_dot_product_attention (top-left causal, (b, h, s, d), GQA) against torch's own SDPA
    in float64, through autograd."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, sq, 32, generator=g).half().to(device)
    k = torch.randn(2, 2, sk, 32, generator=g).half().to(device)
    v = torch.randn(2, 2, sk, 32, generator=g).half().to(device)
    do = torch.randn(2, 4, sq, 32, generator=g).half().to(device)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    flashflow.scaled_dot_product_attention(*ins, is_causal=is_causal, enable_gqa=True).backward(do)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*refs, is_causal=is_causal, enable_gqa=True)
    # a row torch leaves without keys is NaN there; flashflow gives 0 (its forward's rule)
    ref = torch.nan_to_num(ref)
    ref.backward(do.double())
    for a, r in zip(ins, refs):
        assert rel_l2(a.grad, torch.nan_to_num(r.grad)) < TOL[torch.float16]


def _loss_grads(fn, ins, do):
    (fn(*ins) * do).sum().backward()
    return [t.grad for t in ins]


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 2))])
def test_varlen(device, causal, window):
    """flash_attn_varlen_func: packed ragged sequences (one empty, q and k lengths apart), GQA,
    against the float64 reference run per sequence; no gradient crosses sequences."""
    from flashflow.reference.attention import attention_varlen_naive
    g = torch.Generator().manual_seed(3)
    lq, lk = [17, 0, 33, 5], [23, 4, 33, 1]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for x in (lq, lk))
    q = torch.randn(sum(lq), 4, 32, generator=g).half().to(device)
    k, v = (torch.randn(sum(lk), 2, 32, generator=g).half().to(device) for _ in range(2))
    do = torch.randn(sum(lq), 4, 32, generator=g).half().to(device)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    got = _loss_grads(lambda *a: flashflow.flash_attn_varlen_func(*a, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                                                  window_size=window), ins, do)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    want = _loss_grads(lambda *a: attention_varlen_naive(*a, cu_q, cu_k, causal=causal, window_size=window), refs,
                       do.double())
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all() and rel_l2(a, r) < TOL[torch.float16], (name, rel_l2(a, r))


@pytest.mark.parametrize("kind", ["bool", "additive", "bool_with_empty_rows"])
def test_sdpa_entry_with_a_mask(device, kind):
    """scaled_dot_product_attention with attn_mask (boolean or additive float, broadcast over
    heads): gradients of query, key, value against torch's SDPA in float64; a row whose keys
    are all masked gives 0 and zero gradients (torch: NaN)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 29, 32, generator=g).half().to(device)
    k, v = (torch.randn(2, 4, 37, 32, generator=g).half().to(device) for _ in range(2))
    do = torch.randn(2, 4, 29, 32, generator=g).half().to(device)
    if kind == "additive":
        mask = (torch.randn(2, 1, 29, 37, generator=g) * 2).to(device)
    else:
        mask = (torch.rand(2, 1, 29, 37, generator=g) > 0.3).to(device)
        if kind == "bool_with_empty_rows":
            mask[:, :, 3] = False
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    got = _loss_grads(lambda *a: flashflow.scaled_dot_product_attention(*a, attn_mask=mask), ins, do)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref_mask = mask if mask.dtype == torch.bool else mask.double()
    want = _loss_grads(lambda *a: torch.nan_to_num(torch.nn.functional.scaled_dot_product_attention(
        *a, attn_mask=ref_mask)), refs, do.double())
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        r = torch.nan_to_num(r)
        assert torch.isfinite(a).all() and rel_l2(a, r) < TOL[torch.float16], (name, rel_l2(a, r))
    if kind == "bool_with_empty_rows":
        assert (got[0][:, :, 3] == 0).all()


@pytest.mark.parametrize("tiles", [(16, 32, 4, 1, 32, 16, 4, 1), (32, 16, 4, 1, 16, 32, 4, 1)])
@pytest.mark.parametrize("case", [dict(causal=True), dict(window=(9, 3)), dict(mask_keys=20, causal=True),
                                  dict(sq=45, sk=37, causal=True, softcap=5.0)])
def test_unequal_tiles(device, tiles, case, monkeypatch):
    """Query and key tiles of different sizes: the masked / unmasked / masked split of each
    program's range (mask.query_blocks, mask.key_blocks) must tile it exactly."""
    import flashflow.ops.attention_bwd as bwd
    from flashflow.tuning.attention_bwd import AttentionBwdConfig

    cfg = AttentionBwdConfig(*tiles)
    monkeypatch.setattr(bwd, "attention_bwd_config", lambda *a: cfg)
    check(**case, device=device)


def test_double_backward_is_refused(device):
    # a gradient with no graph under create_graph=True would silently drop the second-order term
    # of a gradient penalty through the attention
    q, k, v = (torch.randn(1, 9, 2, 16, device=device).requires_grad_() for _ in range(3))
    out = flashflow.flash_attn_func(q, k, v)
    with pytest.raises(NotImplementedError, match="no double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    g, = torch.autograd.grad(flashflow.flash_attn_func(q, k, v).sum(), q)   # first order is unchanged
    assert torch.isfinite(g).all()
