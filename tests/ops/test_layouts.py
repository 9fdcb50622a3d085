"""Every entry point × the layouts users pass (tests/layout_cases.py): contiguous, transposed
views, a non-unit last stride, stride-0 expansions and slices of a packed qkv, through Triton's
interpreter against float64; forward and backward. A layout must never change the answer."""
import pytest
import torch

from flashflow.device import interpreting
from flashflow.ops import norm
from flashflow.reference import norm as norm_ref
from flashflow.reference.metrics import rel_l2
from layout_cases import LAYOUTS, check_attention, check_decode, check_ffn, check_fp8_attention, make

pytestmark = pytest.mark.skipif(not interpreting(), reason="the CPU run of tests/gpu/test_gpu_layouts.py")
TOL = {torch.float16: 3e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("entry", ["func", "varlen", "sdpa"])
def test_attention_forward_backward(entry, layout):
    check_attention(entry, (layout,) * 4, torch.float16, "cpu", TOL[torch.float16])


@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("layout", ["strided", "transposed"])
def test_attention_one_input_laid_out(which, layout):
    # a strided v alone used to spoil dq and dk: each input on its own
    layouts = tuple(layout if name == which else "contiguous" for name in ("q", "k", "v", "dout"))
    check_attention("func", layouts, torch.float32, "cpu", TOL[torch.float32])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_attention(layout):
    check_fp8_attention(layout, "cpu", torch.float16, 6e-2, sizes=(1, 24, 40, 2, 1, 64))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous-cache", "paged-cache"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_with_append(layout, paged):
    check_decode(layout, paged, "cpu", torch.float16, TOL[torch.float16])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ffn(layout):
    check_ffn(layout, "cpu", torch.float32, 1e-5)


# the norm ops take any strides but a unit one along the last axis, which they refuse by name
NORM_TOL = 1e-5


def _norm_case(layout, op):
    g = torch.Generator().manual_seed(0)
    b, l, h, d = 2, 5, 3, 16
    if op == "layernorm_modulate":
        x = make((b, l, h * d), layout, torch.float32, "cpu", g)
        shift, scale = (torch.randn(b, h * d, generator=g) for _ in range(2))
        return (lambda: norm.layernorm_modulate(x, shift, scale),
                lambda: norm_ref.layernorm_modulate(x.double(), shift.double(), scale.double()), "x")
    if op == "gate_residual_layernorm_modulate":
        res, y = (make((b, l, h * d), layout, torch.float32, "cpu", g) for _ in range(2))
        gate, shift, scale = (torch.randn(b, h * d, generator=g) for _ in range(3))
        return (lambda: norm.gate_residual_layernorm_modulate(res, y, gate, shift, scale),
                lambda: norm_ref.gate_residual_layernorm_modulate(*(t.double() for t in (res, y, gate, shift, scale))),
                "residual")
    x = make((b, l, h, d), layout, torch.float32, "cpu", g)
    w = torch.randn(d, generator=g)
    angles = torch.rand(l, d // 2, generator=g) * 6.3
    freqs = torch.polar(torch.ones_like(angles), angles)
    return (lambda: norm.rmsnorm_rope(x, w, freqs),
            lambda: norm_ref.rmsnorm_rope(x.double(), w.double(), freqs), "x")


@pytest.mark.parametrize("op", ["layernorm_modulate", "gate_residual_layernorm_modulate", "rmsnorm_rope"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_norm_ops(layout, op):
    run, ref, name = _norm_case(layout, op)
    if layout == "strided":
        with pytest.raises(ValueError, match=name):
            run()
        return
    out, want = run(), ref()
    if isinstance(out, tuple):
        out, want = out[0], want[0]
    assert rel_l2(out, want) < NORM_TOL


def test_joint_qkv_norm_rope_layouts():
    g = torch.Generator().manual_seed(0)
    b, s_txt, s_img, h, d = 1, 3, 5, 2, 16
    for layout in ("transposed", "expanded", "packed"):
        txt = [make((b, s_txt, h, d), layout, torch.float32, "cpu", g) for _ in range(3)]
        img = [make((b, s_img, h, d), layout, torch.float32, "cpu", g) for _ in range(3)]
        ws = [torch.randn(d, generator=g) for _ in range(4)]
        fr = [torch.polar(torch.ones(s, d // 2), torch.rand(s, d // 2, generator=g) * 6.3) for s in (s_txt, s_img)]
        got = norm.joint_qkv_norm_rope(*txt, *img, *ws, *fr)
        want = norm_ref.joint_qkv_norm_rope(*(t.double() for t in txt + img), *(w.double() for w in ws), *fr)
        for a, r in zip(got, want):
            assert rel_l2(a, r) < NORM_TOL, layout
