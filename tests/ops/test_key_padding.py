"""``flash_attn_func(..., key_padding_mask=)``: a mask over the first P keys, later keys always
attended, against the float64 reference with the equivalent dense (batch, seqlen_k) mask.

The interpreter's config has BLOCK_N = 32, so 200 keys with P = 37 run the mask's blocks
[0, 64), the unmasked loop over [64, 192) and the ragged end [192, 200).
"""
import re

import pytest
import torch

import flashflow
from flashflow.ops.attention import attention_forward
from flashflow.reference import attention_naive, full_key_padding_mask
from flashflow.reference.metrics import rel_l2

pytestmark = pytest.mark.kernels
TOL = {torch.float16: 5e-3, torch.float32: 1e-4}


def rand(*shape, dtype=torch.float16, device):
    return torch.randn(*shape, dtype=dtype, device=device)


def check(b, sq, sk, h, hk, d, p, dtype=torch.float16, causal=False, window=(-1, -1), mask=None, *, device):
    q = rand(b, sq, h, d, dtype=dtype, device=device)
    k, v = rand(b, sk, hk, d, dtype=dtype, device=device), rand(b, sk, hk, d, dtype=dtype, device=device)
    if mask is None:
        mask = torch.rand(b, p, device=device) > 0.4
    out, lse = flashflow.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True,
                                         key_padding_mask=mask)
    ref, ref_lse = attention_naive(q.double(), k.double(), v.double(), None, causal, window,
                                   key_padding_mask=full_key_padding_mask(mask, sk), return_lse=True)
    assert out.shape == q.shape and lse.shape == (b, h, sq)
    assert not torch.isnan(out).any()
    assert rel_l2(out, ref) < TOL[dtype], rel_l2(out, ref)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    if fin.any():
        assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-2
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("p", [37, 64, 1, 200], ids=["P37", "P64-aligned", "P1", "P=Sk"])
def test_prefix_mask_matches_reference(device, dtype, p):
    check(2, 45, 200, 4, 4, 64, p, dtype=dtype, device=device)


def test_gqa(device):
    check(2, 33, 200, 6, 2, 64, 37, device=device)


@pytest.mark.parametrize("sq,sk,p", [(200, 200, 37), (70, 200, 37), (45, 200, 150)])
def test_causal(device, sq, sk, p):
    check(1, sq, sk, 4, 2, 32, p, causal=True, device=device)


@pytest.mark.parametrize("window", [(50, 0), (20, 30), (-1, 40)])
def test_sliding_window(device, window):
    check(1, 90, 200, 2, 2, 32, 70, window=window, device=device)


def test_odd_sizes(device):
    check(3, 17, 101, 3, 1, 80, 45, dtype=torch.float32, device=device)


def test_fully_masked_rows_give_zero_and_neg_inf_lse(device):
    b, sq, sk, h = 2, 21, 75, 2
    mask = torch.rand(b, sk, device=device) > 0.4
    mask[0] = False      # every key of batch 0 masked
    mask[1, 0] = True
    out, lse = check(b, sq, sk, h, h, 32, sk, mask=mask, device=device)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert torch.isfinite(lse[1]).all()


def test_masked_prefix_with_keys_after_it_is_not_fully_masked(device):
    # P < seqlen_k: the keys after P are attended, so no row is empty
    mask = torch.zeros(2, 37, dtype=torch.bool, device=device)
    out, lse = check(2, 40, 200, 2, 2, 32, 37, mask=mask, device=device)
    assert torch.isfinite(lse).all()


def test_empty_mask_is_no_mask(device):
    q, k, v = rand(1, 30, 2, 32, device=device), rand(1, 70, 2, 32, device=device), rand(1, 70, 2, 32, device=device)
    mask = torch.ones(1, 0, dtype=torch.bool, device=device)
    assert torch.equal(flashflow.flash_attn_func(q, k, v, key_padding_mask=mask), flashflow.flash_attn_func(q, k, v))


def test_all_true_mask_equals_no_mask(device):
    q = rand(2, 30, 2, 32, dtype=torch.float32, device=device)
    k, v = (rand(2, 200, 2, 32, dtype=torch.float32, device=device) for _ in range(2))
    mask = torch.ones(2, 37, dtype=torch.bool, device=device)
    a = flashflow.flash_attn_func(q, k, v, key_padding_mask=mask)
    assert torch.allclose(a, flashflow.flash_attn_func(q, k, v), rtol=1e-5, atol=1e-6)


def test_keys_past_bias_keys_are_never_read_from_the_bias(device):
    # a bias whose columns from P on are -inf: with bias_keys = P the kernel must not read them
    b, sq, sk, h, d, p = 2, 40, 200, 2, 32, 37
    q, k, v = rand(b, sq, h, d, device=device), rand(b, sk, h, d, device=device), rand(b, sk, h, d, device=device)
    mask = torch.rand(b, p, device=device) > 0.4
    bias = torch.full((b, 1, 1, sk), float("-inf"), device=device)
    bias[:, 0, 0, :p] = torch.zeros(b, p, device=device).masked_fill(~mask, float("-inf"))
    out, _ = attention_forward(q, k, v, bias=bias.expand(b, h, sq, sk), bias_keys=p, softmax_scale=d ** -0.5)
    ref = attention_naive(q.double(), k.double(), v.double(), key_padding_mask=full_key_padding_mask(mask, sk))
    assert rel_l2(out, ref) < TOL[torch.float16]


def test_a_bias_and_a_key_padding_mask_each_in_its_own_argument(device):
    """The launchers' float ``bias`` (over ``bias_keys``) and ``key_padding_mask`` (over
    ``mask_keys``) are separate arguments and may come together: forward and backward against
    float64 autograd with both folded into one additive mask. Neither prefix is a block multiple,
    the mask's is the longer one, and the unmasked loop runs past both."""
    from flashflow.ops.attention_bwd import attention_backward

    b, sq, sk, h, d, pb, pm = 2, 40, 200, 2, 32, 29, 45
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(b, s, h, d, generator=g).to(torch.float16).to(device) for s in (sq, sk, sk, sq))
    bias = torch.randn(b, h, sq, pb, generator=g).to(device)
    mask = torch.rand(b, pm, generator=g).to(device) > 0.4
    scale = d ** -0.5
    kw = dict(bias=bias, bias_keys=pb, key_padding_mask=mask, mask_keys=pm)
    out, lse = attention_forward(q, k, v, softmax_scale=scale, **kw)
    dq, dk, dv = attention_backward(q, k, v, out, lse, do, None, scale, False, 0, False, 0, 0.0, **kw)

    additive = torch.zeros(b, h, sq, sk, dtype=torch.float64, device=device)
    additive[..., :pb] = bias.double()
    additive.masked_fill_(~full_key_padding_mask(mask, sk)[:, None, None, :], float("-inf"))
    refs = [t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*refs, attn_mask=additive, scale=scale)
    ref.backward(do.double().transpose(1, 2))
    assert rel_l2(out, ref.transpose(1, 2)) < TOL[torch.float16]
    for name, got, r in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
        assert rel_l2(got, r.grad.transpose(1, 2)) < 2e-3, name


def test_sdpa_key_padding_mask_over_many_blocks(device):
    # SDPA's (B, 1, 1, S_k) boolean mask: the mask covers the whole key range
    b, h, sq, sk = 2, 4, 45, 200
    q, k, v = rand(b, h, sq, 64, device=device), rand(b, h, sk, 64, device=device), rand(b, h, sk, 64, device=device)
    mask = torch.rand(b, 1, 1, sk, device=device) > 0.4
    mask[..., -1] = True   # PyTorch gives NaN for a fully masked row
    out = flashflow.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert rel_l2(out, ref) < TOL[torch.float16]
    # the same mask through flash_attn_func (P = S_k) gives the same numbers
    fa = flashflow.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   key_padding_mask=mask[:, 0, 0])
    assert torch.allclose(fa.transpose(1, 2), out, rtol=1e-3, atol=1e-3)


def test_custom_op_opcheck_with_a_prefix_bias_or_mask(device):
    q, k, v = rand(1, 33, 2, 32, device=device), rand(1, 80, 1, 32, device=device), rand(1, 80, 1, 32, device=device)
    bias = torch.zeros(1, 1, 1, 20, device=device).expand(1, 2, 33, 20)
    args = (q, k, v, bias, 20, None, 0, None, None, 0, 0, 0.2, False, 0, False, 0, 0.0, True, False)
    torch.library.opcheck(torch.ops.flashflow.attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    # and with a key-padding mask over the first 20 keys, in its own argument
    mask = torch.rand(1, 20, device=device) > 0.3
    args = (q, k, v, None, 0, mask, 20, None, None, 0, 0, 0.2, False, 0, True, 0, 0.0, True, True)
    torch.library.opcheck(torch.ops.flashflow.attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph_traces_through(device):
    q, k, v = rand(1, 33, 2, 32, device=device), rand(1, 80, 1, 32, device=device), rand(1, 80, 1, 32, device=device)
    mask = torch.rand(1, 20, device=device) > 0.3

    def f(q, k, v, mask):
        return flashflow.flash_attn_func(q * 2.0, k, v, causal=True, key_padding_mask=mask)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(q, k, v, mask), f(q, k, v, mask), atol=1e-3)


def test_bad_key_padding_masks(device):
    q, k = rand(2, 8, 2, 32, device=device), rand(2, 50, 2, 32, device=device)
    with pytest.raises(TypeError, match=r"key_padding_mask must be a bool tensor \(batch, P\).*got list"):
        flashflow.flash_attn_func(q, k, k, key_padding_mask=[[True] * 5] * 2)
    with pytest.raises(TypeError, match=r"key_padding_mask must be a bool tensor.*got dtype torch.uint8"):
        flashflow.flash_attn_func(q, k, k, key_padding_mask=torch.ones(2, 5, dtype=torch.uint8, device=device))
    for shape in ((2, 1, 1, 5), (5,), (3, 5), (1, 5)):
        expected = r"key_padding_mask must be .*\(2, P\).*got shape " + re.escape(str(shape))
        with pytest.raises(ValueError, match=expected):
            flashflow.flash_attn_func(q, k, k, key_padding_mask=torch.ones(shape, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match=r"P <= seqlen_k = 50, got shape \(2, 51\)"):
        flashflow.flash_attn_func(q, k, k, key_padding_mask=torch.ones(2, 51, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="key_padding_mask must be on"):
        flashflow.flash_attn_func(q, k, k, key_padding_mask=torch.ones(2, 5, dtype=torch.bool, device="meta"))
    with pytest.raises(TypeError, match="unexpected keyword|positional"):
        flashflow.flash_attn_func(q, k, k, None, False, (-1, -1), 0.0, False, torch.ones(2, 5, dtype=torch.bool))
