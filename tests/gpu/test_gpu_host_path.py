"""The cached launch path on the GPU (flashflow.ops.common.Launcher; every cached launch is
checked against Triton's own specialisation while these tests run, see conftest.py): calls that
share shapes and strides but differ in an address's alignment, a plan's split count or the grad
mode give their own correct answers, first and repeated."""
import pytest
import torch

import flashflow
from flashflow.reference.attention import attention_naive
from flashflow.reference.decode import kvcache_attention_ref

pytestmark = pytest.mark.gpu


def _offset(t: torch.Tensor, elements: int) -> torch.Tensor:
    """``t``'s values in a buffer ``elements`` past a 16-byte boundary, same shape and strides."""
    buf = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)
    out = buf[elements:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_aligned_and_not(gpu, dtype):
    q, k, v = (torch.randn(2, 200, 4, 64, device="cuda", dtype=dtype) for _ in range(3))
    ref = attention_naive(q.double(), k.double(), v.double(), causal=True)
    for _ in range(3):
        for shift in (0, 8, 1):   # 1 element: 2 bytes past the boundary (no TMA, no 16-byte hint)
            qs, ks, vs = (_offset(t, shift) for t in (q, k, v))
            assert gpu.rel(flashflow.flash_attn_func(qs, ks, vs, causal=True), ref) < gpu.tol, shift


def test_attention_backward_aligned_and_not(gpu):
    q, k, v = (torch.randn(1, 130, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    attention_naive(qd, kd, vd, causal=True).backward(do.double())
    for _ in range(2):
        for shift in (0, 1):
            qs, ks, vs = (_offset(t, shift).requires_grad_() for t in (q, k, v))
            flashflow.flash_attn_func(qs, ks, vs, causal=True).backward(do)
            for got, want in ((qs.grad, qd.grad), (ks.grad, kd.grad), (vs.grad, vd.grad)):
                assert gpu.rel(got, want) < 2e-2, shift


def test_decode_plans_of_one_call_key(gpu):
    """Plans with different split counts see calls with equal keys: each launches its own kernel."""
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(2, 4096, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([4096, 1500], dtype=torch.int32, device="cuda")
    ref, *_ = kvcache_attention_ref(q.double(), kc.double(), vc.double(), cache_seqlens=lens)
    plans = [flashflow.plan_decode(2, 8, 2, 128, 4096, num_splits=n) for n in (1, 3, 8)]
    for _ in range(2):
        for plan in plans:
            for shift in (0, 1):
                out = plan.run(_offset(q, shift), kc, vc, cache_seqlens=lens)
                assert gpu.rel(out, ref) < gpu.tol, (plan.num_splits, shift)
