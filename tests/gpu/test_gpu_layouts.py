"""Every entry point × the layouts users pass (tests/layout_cases.py) on the GPU, bf16 and fp16:
transposed views, a non-unit last stride, stride-0 expansions, slices of a packed qkv; forward and
backward against float64, FP8 attention bit-identical to its call on contiguous copies."""
import pytest
import torch

from layout_cases import LAYOUTS, check_attention, check_decode, check_ffn, check_fp8_attention

pytestmark = pytest.mark.gpu
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


@DTYPES
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("entry", ["func", "varlen", "sdpa"])
def test_attention_forward_backward(entry, layout, dtype):
    check_attention(entry, (layout,) * 4, dtype, "cuda", TOL[dtype], sizes=(2, 300, 517, 8, 2, 128))


@DTYPES
@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
def test_attention_one_strided_input(which, dtype):
    layouts = tuple("strided" if name == which else "contiguous" for name in ("q", "k", "v", "dout"))
    check_attention("func", layouts, dtype, "cuda", TOL[dtype], sizes=(2, 300, 517, 8, 2, 64))


@DTYPES
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_attention(layout, dtype):
    check_fp8_attention(layout, "cuda", dtype, 8e-2, sizes=(2, 333, 1100, 8, 2, 128))


@DTYPES
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous-cache", "paged-cache"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_with_append(layout, paged, dtype):
    check_decode(layout, paged, "cuda", dtype, TOL[dtype], sizes=(3, 2, 32, 8, 128, 1024))


@DTYPES
@pytest.mark.parametrize("m", [7, 300], ids=["split-k", "persistent"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ffn(layout, m, dtype):
    check_ffn(layout, "cuda", dtype, TOL[dtype], sizes=(m, 1024, 2816))
