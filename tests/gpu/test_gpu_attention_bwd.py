"""Attention backward on the GPU: bf16 gradients against float64 for each feature, bit-identical
gradients over runs, memory linear in seqlen, and autograd under torch.compile."""
import pytest
import torch

import flashflow
from flashflow.reference import full_key_padding_mask
from flashflow.reference.attention import attention_naive
from flashflow.reference.metrics import rel_l2

pytestmark = pytest.mark.gpu


def _inputs(b, sq, sk, h, hk, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    do = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v, do


CASES = {
    "dense": dict(),
    "causal": dict(causal=True),
    "causal-sq>sk": dict(causal=True, sq=700, sk=500),
    "window": dict(window=(128, 0)),
    "softcap": dict(softcap=30.0, causal=True),
    "gqa-8/2": dict(h=8, hk=2, causal=True),
    "mqa": dict(h=8, hk=1),
    "key-padding": dict(mask_keys=300),
    "d64": dict(d=64, causal=True),
    "d80": dict(d=80),
    "d96-odd": dict(d=96, sq=333, sk=517, causal=True),
    "d256": dict(d=256, sq=256, sk=256),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gradients_against_float64(name, dtype):
    c = dict(b=2, sq=512, sk=512, h=4, hk=4, d=128, causal=False, window=(-1, -1), softcap=0.0, mask_keys=None)
    c.update(CASES[name])
    q, k, v, do = _inputs(c["b"], c["sq"], c["sk"], c["h"], c["hk"], c["d"], dtype)
    key_padding_mask = None
    if c["mask_keys"]:
        key_padding_mask = torch.rand(c["b"], c["mask_keys"], device="cuda") > 0.3
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashflow.flash_attn_func(*ins, causal=c["causal"], window_size=c["window"], softcap=c["softcap"],
                                    key_padding_mask=key_padding_mask)
    out.backward(do)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    full = None if key_padding_mask is None else full_key_padding_mask(key_padding_mask, c["sk"])
    attention_naive(*refs, None, c["causal"], c["window"], c["softcap"], key_padding_mask=full).backward(do.double())
    for n, a, r in zip(("dq", "dk", "dv"), ins, refs):
        err = rel_l2(a.grad, r.grad)
        assert err < 2e-2, (n, err)


def test_deterministic_over_three_runs():
    q, k, v, do = _inputs(2, 2048, 2048, 16, 4, 128)
    runs = []
    for _ in range(3):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        flashflow.flash_attn_func(*ins, causal=True, deterministic=True).backward(do)
        runs.append([t.grad for t in ins])
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_backward_memory_is_linear_in_seqlen():
    """No S×S buffer: a step's extra memory at 32k tokens is about twice that at 16k."""
    peaks = []
    for s in (16384, 32768):
        q, k, v, do = _inputs(1, s, s, 8, 8, 128)
        ins = [t.requires_grad_() for t in (q, k, v)]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        flashflow.flash_attn_func(*ins, causal=True).backward(do)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del q, k, v, do, ins
        torch.cuda.empty_cache()
    assert peaks[1] < 2.2 * peaks[0], peaks
    assert peaks[1] < 8 * 32768 * 8 * 128 * 2 * 2   # a few copies of q-sized tensors, nothing S×S


def test_under_torch_compile():
    q, k, v, do = _inputs(2, 512, 512, 8, 2, 64)

    def loss(q, k, v):
        return (flashflow.flash_attn_func(q, k, v, causal=True).float() * do.float()).sum()

    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(*eager).backward()
    compiled = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.compile(loss, fullgraph=True)(*compiled).backward()
    for a, b in zip(eager, compiled):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_gradients_against_float64(causal):
    """flash_attn_varlen_func: ragged sequences (one of 1 token, one empty) packed, GQA 8/2, bf16."""
    from flashflow.reference.attention import attention_varlen_naive
    lq, lk = [300, 1, 0, 700], [450, 64, 10, 700]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for x in (lq, lk))
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(sum(lq), 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(sum(lk), 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn_like(q)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    flashflow.flash_attn_varlen_func(*ins, cu_q, cu_k, max(lq), max(lk), causal=causal).backward(do)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    attention_varlen_naive(*refs, cu_q, cu_k, causal=causal).backward(do.double())
    for n, a, r in zip(("dq", "dk", "dv"), ins, refs):
        err = rel_l2(a.grad, r.grad)
        assert torch.isfinite(a.grad).all() and err < 2e-2, (n, err)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sdpa_mask_gradients_against_float64(kind):
    """scaled_dot_product_attention with attn_mask (bf16), against torch's SDPA in float64."""
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v, do = (torch.randn(2, 8, 640, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    if kind == "bool":
        mask = torch.rand(2, 1, 640, 640, device="cuda", generator=g) > 0.2
        mask[..., 0] = True
    else:
        mask = torch.randn(1, 8, 640, 640, device="cuda", generator=g)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    flashflow.scaled_dot_product_attention(*ins, attn_mask=mask).backward(do)
    refs = [t.double().requires_grad_() for t in (q, k, v)]
    ref_mask = mask if kind == "bool" else mask.double()
    torch.nn.functional.scaled_dot_product_attention(*refs, attn_mask=ref_mask).backward(do.double())
    for n, a, r in zip(("dq", "dk", "dv"), ins, refs):
        err = rel_l2(a.grad, r.grad)
        assert err < 2e-2, (n, err)
