"""Attention on the GPU, bf16 and fp16 against float64: every feature, odd sizes, the SDPA
layout and masks, torch.compile(fullgraph=True), CUDA-graph capture and replay."""
import pytest
import torch

import flashflow
from flashflow.ops.attention import attention_forward
from flashflow.reference import attention_naive, attention_varlen_naive

pytestmark = pytest.mark.gpu
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]

# (b, sq, sk, h, hk, d, causal, window, softcap, strided)
DENSE = {
    "plain": (2, 1000, 1000, 8, 8, 128, False, (-1, -1), 0.0, False),
    "long": (1, 4352, 4352, 4, 4, 128, False, (-1, -1), 0.0, False),
    "causal-gqa-odd": (2, 777, 777, 6, 2, 64, True, (-1, -1), 0.0, False),
    "causal-mqa-sq<sk": (1, 300, 1200, 8, 1, 128, True, (-1, -1), 0.0, False),
    "causal-sq>sk-empty-rows-d96": (1, 1200, 300, 8, 4, 96, True, (-1, -1), 0.0, False),
    "window-d80": (2, 513, 513, 4, 4, 80, False, (100, 37), 0.0, False),
    "causal-window-left": (2, 1025, 1025, 4, 2, 128, True, (256, -1), 0.0, False),
    "softcap-d256": (1, 640, 640, 4, 4, 256, False, (-1, -1), 30.0, False),
    "causal-softcap-d32": (1, 640, 640, 4, 4, 32, True, (-1, -1), 15.0, False),
    "one-token": (1, 1, 1, 2, 2, 64, False, (-1, -1), 0.0, False),
    "strided-sdpa-layout": (3, 77, 301, 4, 4, 128, False, (-1, -1), 0.0, True),
    "strided-causal-gqa": (2, 1111, 1111, 8, 2, 128, True, (-1, -1), 0.0, True),
}


def _qkv(b, sq, sk, h, hk, d, dtype, strided):
    if strided:   # SDPA's (b, h, s, d) storage seen through a transpose
        return (torch.randn(b, h, sq, d, device="cuda", dtype=dtype).transpose(1, 2),
                torch.randn(b, hk, sk, d, device="cuda", dtype=dtype).transpose(1, 2),
                torch.randn(b, hk, sk, d, device="cuda", dtype=dtype).transpose(1, 2))
    return (torch.randn(b, sq, h, d, device="cuda", dtype=dtype),
            torch.randn(b, sk, hk, d, device="cuda", dtype=dtype),
            torch.randn(b, sk, hk, d, device="cuda", dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(DENSE))
def test_dense_against_float64(gpu, dtype, case):
    b, sq, sk, h, hk, d, causal, window, softcap, strided = DENSE[case]
    q, k, v = _qkv(b, sq, sk, h, hk, d, dtype, strided)
    left, right = window
    right = 0 if causal else right
    out = gpu.nan_like(q)   # through the launcher's out=: every element must be written
    attention_forward(q, k, v, softmax_scale=d ** -0.5, window_left=left if left >= 0 else None,
                      window_right=right if right >= 0 else None, softcap=softcap, out=out,
                      heavy_first=causal)
    o2, lse = flashflow.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                        return_lse=True)
    ro, rl = attention_naive(q.double(), k.double(), v.double(), causal=causal, window_size=window,
                             softcap=softcap, return_lse=True)
    assert not torch.isnan(out).any()
    assert gpu.rel(out, ro) <= gpu.tol
    assert gpu.rel(o2, ro) <= gpu.tol
    assert torch.equal(torch.isinf(lse), torch.isinf(rl))   # rows with no key: -inf on both sides
    fin = torch.isfinite(rl)
    if fin.any():
        assert (lse.double()[fin] - rl[fin]).abs().max().item() < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_gqa_against_float64(gpu, dtype, causal):
    lens_q, lens_k = [1, 17, 1000, 300], [1, 40, 1000, 333]
    cq = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    ck = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 8, 128, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    o, lse = flashflow.flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal,
                                              return_lse=True)
    ro, rl = attention_varlen_naive(q.double(), k.double(), v.double(), cq, ck, causal=causal, return_lse=True)
    assert gpu.rel(o, ro) <= gpu.tol
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isinf(lse), torch.isinf(rl))
    assert (lse.double()[fin] - rl[fin]).abs().max().item() < 1e-2


SDPA = ["bool-key-padding-mask", "float-mask", "causal-top-left"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SDPA)
def test_sdpa_layout_gqa_against_float64(gpu, dtype, case):
    q = torch.randn(2, 8, 333, 128, device="cuda", dtype=dtype)
    k = torch.randn(2, 2, 450, 128, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    kw, ref_kw = {}, {}
    if case == "bool-key-padding-mask":
        kw["attn_mask"] = ref_kw["attn_mask"] = torch.rand(2, 1, 1, 450, device="cuda") > 0.3
    elif case == "float-mask":
        kw["attn_mask"] = torch.randn(1, 8, 333, 450, device="cuda", dtype=dtype)
        ref_kw["attn_mask"] = kw["attn_mask"].double()
    else:
        kw["is_causal"] = ref_kw["is_causal"] = True
    o = flashflow.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    r = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True,
                                                         **ref_kw)
    assert gpu.rel(o, r) <= gpu.tol


def test_torch_compile_fullgraph(gpu):
    q = torch.randn(2, 512, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 512, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        return flashflow.flash_attn_func(q * 1.0, k, v, causal=True) + 0

    ref = attention_naive(q.double(), k.double(), v.double(), causal=True)
    assert gpu.rel(f(q, k, v), ref) <= gpu.tol


def test_cuda_graph_replay_with_new_inputs(gpu):
    q = torch.randn(2, 512, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 512, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    worst = gpu.worst_over_replays(lambda: flashflow.flash_attn_func(q, k, v, causal=True), q,
                                   lambda q: attention_naive(q.double(), k.double(), v.double(), causal=True),
                                   replays=20, new_input_every=5)
    assert worst <= gpu.tol
