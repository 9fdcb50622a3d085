"""The Gluon FP8 attention forward (Hopper) against the portable Triton kernel on the same
quantized inputs: the output and the LSE of each config (one and two warpgroups, two and three
stages, warp-specialized, the two warpgroups in partitions of their own with and without
ping-pong turns, Vᵀ's keys permuted) at the Qwen-Image shape, a ragged GQA shape,
fewer queries than keys and a tile shorter than one key block; and against float64 exact
attention (its error no worse than the portable kernel's). Every output starts as NaN, so a
row left unwritten shows."""
import pytest
import torch

from flashflow.device import gpu_family
from flashflow.ops.attention_fp8 import attention_fp8_forward, quantize_attention_inputs
from flashflow.reference import attention_naive
from flashflow.reference.metrics import rel_l2

pytestmark = pytest.mark.gpu
BLOCK_N = 128
VS_TRITON_TOL = 5e-3      # ‖gluon − triton‖ / ‖triton‖: the same arithmetic, sums in another order
EXACT_RATIO = 1.05        # gluon's error against exact attention over the portable kernel's

# b, sq, sk, h, hk, d
SHAPES = {
    "qwen-image": (1, 4352, 4352, 24, 24, 128),
    "ragged-gqa": (2, 1000, 1000, 8, 2, 128),
    "sq<sk": (1, 300, 1000, 4, 4, 128),
    "short": (1, 77, 77, 4, 4, 128),
}
CONFIGS = {
    "m64-s2": dict(block_m=64, num_warps=4, num_stages=2),
    "m64-s3": dict(block_m=64, num_warps=4, num_stages=3),
    "m128-s2": dict(block_m=128, num_warps=8, num_stages=2),
    "m128-s2-ws": dict(block_m=128, num_warps=8, num_stages=2, warp_specialize=True),
    "m64-s2-perm": dict(block_m=64, num_warps=4, num_stages=2, keys_permuted=True),
    "m128-s3-ws-perm": dict(block_m=128, num_warps=8, num_stages=3, warp_specialize=True, keys_permuted=True),
    "m128x2-s2": dict(block_m=128, num_warps=4, num_stages=2, warp_specialize=True, split_warpgroups=True),
    "m128x2-s2-pp-perm": dict(block_m=128, num_warps=4, num_stages=2, warp_specialize=True, split_warpgroups=True,
                              pingpong=True, keys_permuted=True),
}


@pytest.fixture(autouse=True)
def hopper():
    if gpu_family(torch.device("cuda")) != "sm90":
        pytest.skip("the Gluon FP8 attention is written for Hopper (sm90)")


def run_gluon(q, k, v, scale, opts, qk_format="int8"):
    from flashflow.kernels.attention_fp8_gluon import launch_attention_fp8_gluon, permute_keys_for_pv

    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    bufs = quantize_attention_inputs(q, k, v, scale, opts["block_m"], BLOCK_N, qk_format, lse_correction=True)
    if opts.get("keys_permuted"):
        bufs = dict(bufs, vt8=permute_keys_for_pv(bufs["vt8"]))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device=q.device)
    launch_attention_fp8_gluon(bufs, out, b, h, hk, sq, sk, bufs["sq_pad"], bufs["sk_pad"], d, block_n=BLOCK_N,
                               lse=lse, **opts)
    return out, lse


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gluon_matches_triton(shape, config):
    b, sq, sk, h, hk, d = SHAPES[shape]
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    scale = d ** -0.5
    out, lse = run_gluon(q, k, v, scale, CONFIGS[config])
    ref_out, ref_lse = attention_fp8_forward(q, k, v, None, scale, False, True, "int8")
    torch.cuda.synchronize()
    assert out.isfinite().all() and lse.isfinite().all()
    assert rel_l2(out, ref_out) < VS_TRITON_TOL
    assert (lse - ref_lse).abs().max().item() < 1e-3
    if b * h * sq * sk <= 2 ** 25:   # float64 scores of every head at once
        group = h // hk
        exact = attention_naive(q.double(), k.double().repeat_interleave(group, dim=2),
                                v.double().repeat_interleave(group, dim=2), scale)
        assert rel_l2(out, exact) <= EXACT_RATIO * rel_l2(ref_out, exact) + 1e-4


@pytest.mark.parametrize("shape", ["ragged-gqa", "short"])
def test_gluon_fp8_qk(shape):
    """Q·Kᵀ in e4m3 (the quantize pass's qk_format="fp8") against the portable kernel in it."""
    b, sq, sk, h, hk, d = SHAPES[shape]
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    scale = d ** -0.5
    out, lse = run_gluon(q, k, v, scale, CONFIGS["m64-s2"], "fp8")
    ref_out, ref_lse = attention_fp8_forward(q, k, v, None, scale, False, True, "fp8")
    torch.cuda.synchronize()
    assert out.isfinite().all()
    assert rel_l2(out, ref_out) < VS_TRITON_TOL
    assert (lse - ref_lse).abs().max().item() < 1e-3


@pytest.mark.parametrize("shape", ["qwen-image", "ragged-gqa", "short"])
def test_op_level_gluon_forward_matches_the_portable_op(shape):
    """``attention_fp8_gluon_forward`` (quantize, permute, launch) against the portable op's
    ``flash_attn_fp8_func`` on the same inputs: the same quantization blocks, the same sums."""
    from flashflow import flash_attn_fp8_func
    from flashflow.ops.attention_fp8 import attention_fp8_gluon_forward

    if gpu_family(torch.device("cuda")) != "sm90":
        pytest.skip("the Gluon kernel is written for Hopper (sm90)")
    b, sq, sk, h, hk, d = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    out = attention_fp8_gluon_forward(q, k, v, d ** -0.5)
    ref = flash_attn_fp8_func(q, k, v)
    assert torch.isfinite(out).all()
    assert rel_l2(out.float(), ref.float()) < VS_TRITON_TOL
