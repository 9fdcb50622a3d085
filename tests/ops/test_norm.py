"""The diffusion block's fused norms (flashflow.ops.norm) through Triton's interpreter: against
float64 at odd sizes in fp32/fp16/bf16, outputs poisoned with NaN, the index (zero_cond_t)
variant, strided inputs as diffusers produces them, ``out=`` into a slice of a bigger buffer,
the custom ops under opcheck and torch.compile, bad inputs, and equality with diffusers' own
Qwen-Image functions on tiny cases."""
import pytest
import torch

from flashflow.device import interpreting
from flashflow.ops import norm
from flashflow.ops.norm import (MAX_DIM, gate_residual, gate_residual_layernorm_modulate, layernorm_modulate,
                                rmsnorm_rope)
from flashflow.reference import norm as ref
from norm_inputs import DEVICE, TOL, d64, err, freqs_of, poisoned, rand  # noqa: F401 (poisoned: a fixture)

pytestmark = pytest.mark.kernels
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1, 48), (2, 7, 80), (1, 33, 200), (2, 33, 48)]          # (B, L, D)
ROPE_SHAPES = [(1, 1, 2, 48), (2, 7, 3, 80), (1, 33, 1, 200), (2, 5, 24, 48)]   # (B, S, H, D)


# --------------------------------------------------------------------------------------------
# numerics against float64
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,l,d", SHAPES)
def test_layernorm_modulate_matches_float64(poisoned, dtype, b, l, d):
    x = rand(b, l, d, dtype=dtype, scale=3.0, offset=1.0)        # an offset mean: the two-pass variance
    shift, scale = rand(b, d, dtype=dtype, seed=1), rand(b, d, dtype=dtype, seed=2)
    y = layernorm_modulate(x, shift, scale)
    assert y.shape == x.shape and y.dtype == dtype
    assert err(y, ref.layernorm_modulate(*d64(x, shift, scale), 1e-6)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,l,d", SHAPES)
def test_gate_residual_matches_float64(poisoned, dtype, b, l, d):
    res, y, gate = rand(b, l, d, dtype=dtype), rand(b, l, d, dtype=dtype, seed=1), rand(b, d, dtype=dtype, seed=2)
    out = gate_residual(res, y, gate)
    assert out.shape == res.shape and out.dtype == dtype
    assert err(out, ref.gate_residual(*d64(res, y, gate))) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,l,d", SHAPES)
def test_gate_residual_layernorm_modulate_matches_float64(poisoned, dtype, b, l, d):
    res, y = rand(b, l, d, dtype=dtype, offset=0.5), rand(b, l, d, dtype=dtype, seed=1)
    gate, shift, scale = (rand(b, d, dtype=dtype, seed=s) for s in (2, 3, 4))
    new_res, mod = gate_residual_layernorm_modulate(res, y, gate, shift, scale)
    want_res, want_mod = ref.gate_residual_layernorm_modulate(*d64(res, y, gate, shift, scale), 1e-6)
    assert new_res.dtype == mod.dtype == dtype
    assert err(new_res, want_res) < TOL[dtype] and err(mod, want_mod) < TOL[dtype]
    # the LayerNorm is of the residual as stored: the same as normalising the returned tensor
    assert torch.equal(mod, layernorm_modulate(new_res, shift, scale))


def test_gate_residual_wide_rows_split_into_column_blocks():
    # wider than one column block: two blocks per token, the second partly masked
    b, l, d = 1, 3, norm.RESIDUAL_BLOCK + 40
    res, y, gate = rand(b, l, d), rand(b, l, d, seed=1), rand(b, d, seed=2)
    assert err(gate_residual(res, y, gate), ref.gate_residual(*d64(res, y, gate))) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,h,d", ROPE_SHAPES)
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
def test_rmsnorm_rope_matches_float64(poisoned, dtype, b, s, h, d, weighted):
    x = rand(b, s, h, d, dtype=dtype, scale=2.0, offset=0.3)
    w = (rand(d, dtype=dtype, seed=3).abs() + 0.5) if weighted else None
    freqs = freqs_of(s, d)
    out = rmsnorm_rope(x, w, freqs)
    assert out.shape == x.shape and out.dtype == dtype
    assert err(out, ref.rmsnorm_rope(*d64(x, w), freqs, 1e-6)) < TOL[dtype]


def test_rmsnorm_rope_fp32_weight_on_bf16_x():
    # a weight kept in fp32: no rounding to the weight's dtype in between
    x, w, freqs = rand(2, 7, 3, 80, dtype=torch.bfloat16), rand(80, seed=3) + 2.0, freqs_of(7, 80)
    out = rmsnorm_rope(x, w, freqs)
    assert out.dtype == torch.bfloat16
    assert err(out, ref.rmsnorm_rope(*d64(x, w), freqs, 1e-6)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("eps", [0.0, 0.5])
def test_eps_is_used(eps):
    # rows of small magnitude, where eps matters
    x, shift, scale = rand(2, 7, 48, scale=0.1), rand(2, 48, seed=1), rand(2, 48, seed=2)
    assert err(layernorm_modulate(x, shift, scale, eps=eps),
               ref.layernorm_modulate(*d64(x, shift, scale), eps)) < TOL[torch.float32]
    q, w, freqs = rand(1, 7, 2, 48, scale=0.1), rand(48, seed=3), freqs_of(7, 48)
    assert err(rmsnorm_rope(q, w, freqs, eps=eps), ref.rmsnorm_rope(*d64(q, w), freqs, eps)) < TOL[torch.float32]


# --------------------------------------------------------------------------------------------
# the index (zero_cond_t) variant
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32, torch.bool])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_picks_the_second_half_of_the_rows(poisoned, index_dtype, dtype):
    b, l, d = 2, 33, 80
    x, y = rand(b, l, d, dtype=dtype), rand(b, l, d, dtype=dtype, seed=1)
    gate, shift, scale = (rand(2 * b, d, dtype=dtype, seed=s) for s in (2, 3, 4))
    index = torch.zeros(b, l, dtype=torch.int64)
    index[0, 10:] = 1       # diffusers' layout: the reference image's tokens after the target's
    index[1, ::3] = 1
    index = index.to(DEVICE, index_dtype)
    tol = TOL[dtype]
    assert err(layernorm_modulate(x, shift, scale, index=index),
               ref.layernorm_modulate(*d64(x, shift, scale), 1e-6, index=index)) < tol
    assert err(gate_residual(x, y, gate, index=index), ref.gate_residual(*d64(x, y, gate), index=index)) < tol
    new_res, mod = gate_residual_layernorm_modulate(x, y, gate, shift, scale, index=index)
    want_res, want_mod = ref.gate_residual_layernorm_modulate(*d64(x, y, gate, shift, scale), 1e-6, index=index)
    assert err(new_res, want_res) < tol and err(mod, want_mod) < tol


def test_index_all_zero_equals_no_index():
    b, l, d = 2, 7, 48
    x, shift, scale = rand(b, l, d), rand(2 * b, d, seed=1), rand(2 * b, d, seed=2)
    zero = torch.zeros(b, l, dtype=torch.int64, device=DEVICE)
    assert torch.equal(layernorm_modulate(x, shift, scale, index=zero),
                       layernorm_modulate(x, shift[:b], scale[:b]))
    one = torch.ones_like(zero)
    assert torch.equal(layernorm_modulate(x, shift, scale, index=one),
                       layernorm_modulate(x, shift[b:], scale[b:]))


# --------------------------------------------------------------------------------------------
# strided inputs, out= into a slice, empty inputs
# --------------------------------------------------------------------------------------------


def test_strided_inputs_as_diffusers_makes_them():
    b, l, d = 2, 7, 80
    # mod_params (B, 6D) chunked into norm1/norm2 and then shift/scale/gate: row stride 6D
    mod1, mod2 = rand(b, 6 * d, seed=1).chunk(2, dim=-1)
    shift, scale, gate = mod1.chunk(3, dim=-1)
    shift2, scale2, _ = mod2.chunk(3, dim=-1)
    x = rand(l + 3, b, d + 5)[2:2 + l, :, 1:1 + d].transpose(0, 1)        # (B, L, D), no dim contiguous but D
    y = rand(b, l, 3 * d, seed=2)[..., d:2 * d]
    assert not x.is_contiguous() and shift.stride(0) == 6 * d
    assert err(layernorm_modulate(x, shift, scale), ref.layernorm_modulate(*d64(x, shift, scale), 1e-6)) < 1e-5
    assert err(gate_residual(x, y, gate), ref.gate_residual(*d64(x, y, gate))) < 1e-5
    new_res, mod = gate_residual_layernorm_modulate(x, y, gate, shift2, scale2)
    want_res, want_mod = ref.gate_residual_layernorm_modulate(*d64(x, y, gate, shift2, scale2), 1e-6)
    assert err(new_res, want_res) < 1e-5 and err(mod, want_mod) < 1e-5


def test_rmsnorm_rope_strided_x_and_freqs():
    b, s, h, d = 2, 7, 3, 48
    x = rand(b, s, 3 * h * d)[..., h * d:2 * h * d].unflatten(-1, (h, d))     # the k part of a fused qkv Linear
    table = freqs_of(s + 9, 2 * d)                                            # wider and longer than needed
    freqs = table[4:4 + s, 3:3 + d // 2]
    w = rand(d, seed=3)
    assert not freqs.is_contiguous()
    assert err(rmsnorm_rope(x, w, freqs), ref.rmsnorm_rope(*d64(x, w), freqs, 1e-6)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rmsnorm_rope_into_a_slice_of_the_joint_buffer(dtype):
    b, s_txt, s_img, h, d = 2, 5, 11, 3, 80
    txt = rand(b, s_txt, h * d, dtype=dtype, seed=1).unflatten(-1, (h, d))
    img = rand(b, s_img, h * d, dtype=dtype, seed=2).unflatten(-1, (h, d))
    w_txt, w_img = rand(d, dtype=dtype, seed=3), rand(d, dtype=dtype, seed=4)
    f_txt, f_img = freqs_of(s_txt, d, seed=6), freqs_of(s_img, d, seed=7)
    sentinel = 1234.0
    joint = torch.full((b, s_txt + s_img + 2, h, d), sentinel, dtype=dtype, device=DEVICE)
    got_txt = rmsnorm_rope(txt, w_txt, f_txt, out=joint[:, 1:1 + s_txt])
    got_img = rmsnorm_rope(img, w_img, f_img, out=joint[:, 1 + s_txt:1 + s_txt + s_img])
    assert got_txt.data_ptr() == joint[:, 1:].data_ptr() and got_img.shape == img.shape
    want = torch.cat([ref.rmsnorm_rope(*d64(txt, w_txt), f_txt, 1e-6),
                      ref.rmsnorm_rope(*d64(img, w_img), f_img, 1e-6)], 1)
    assert err(joint[:, 1:-1], want) < TOL[dtype]
    assert (joint[:, 0] == sentinel).all() and (joint[:, -1] == sentinel).all()      # neighbours untouched
    # ... and equal to the new-tensor form, bit for bit
    assert torch.equal(joint[:, 1:1 + s_txt], rmsnorm_rope(txt, w_txt, f_txt))


def test_rmsnorm_rope_into_a_head_slice():
    # out strided along heads too: a (B, S, 2H, D) buffer's first H heads
    b, s, h, d = 1, 7, 3, 48
    x, w, freqs = rand(b, s, h, d), rand(d, seed=3), freqs_of(s, d)
    buf = torch.full((b, s, 2 * h, d), float("nan"), device=DEVICE)
    rmsnorm_rope(x, w, freqs, out=buf[:, :, :h])
    assert err(buf[:, :, :h], ref.rmsnorm_rope(*d64(x, w), freqs, 1e-6)) < 1e-5
    assert buf[:, :, h:].isnan().all()


def test_rmsnorm_rope_in_place():
    x, w, freqs = rand(2, 7, 3, 48), rand(48, seed=3), freqs_of(7, 48)
    want = ref.rmsnorm_rope(*d64(x, w), freqs, 1e-6)
    assert rmsnorm_rope(x, w, freqs, out=x) is x
    assert err(x, want) < 1e-5


def test_empty_inputs_launch_nothing():
    x, shift, scale = rand(2, 0, 48), rand(2, 48), rand(2, 48)
    assert layernorm_modulate(x, shift, scale).shape == (2, 0, 48)
    assert gate_residual(x, x, shift).shape == (2, 0, 48)
    assert [t.shape for t in gate_residual_layernorm_modulate(x, x, shift, shift, scale)] == [(2, 0, 48)] * 2
    assert rmsnorm_rope(rand(2, 0, 3, 48), None, freqs_of(0, 48)).shape == (2, 0, 3, 48)


# --------------------------------------------------------------------------------------------
# custom ops: opcheck and torch.compile
# --------------------------------------------------------------------------------------------


def test_custom_ops_opcheck():
    b, l, d = 2, 3, 48
    x, y = rand(b, l, d), rand(b, l, d, seed=1)
    gate, shift, scale = (rand(2 * b, d, seed=s) for s in (2, 3, 4))
    index = torch.tensor([[0, 1, 1], [1, 0, 0]], device=DEVICE)
    q, w, freqs = rand(b, l, 2, d), rand(d, seed=5), freqs_of(l, d)
    checks = ("test_schema", "test_faketensor")
    ops = torch.ops.flashflow
    torch.library.opcheck(ops.layernorm_modulate.default, (x, shift, scale, index, 1e-6), test_utils=checks)
    torch.library.opcheck(ops.gate_residual.default, (x, y, gate[:b], None), test_utils=checks)
    torch.library.opcheck(ops.gate_residual_layernorm_modulate.default, (x, y, gate, shift, scale, index, 1e-6),
                          test_utils=checks)
    torch.library.opcheck(ops.rmsnorm_rope.default, (q, w, freqs, 1e-6), test_utils=checks)
    torch.library.opcheck(ops.rmsnorm_rope_out.default, (q, None, freqs, 1e-6, torch.empty_like(q)),
                          test_utils=checks)


def test_torch_compile_writes_the_joint_buffer():
    b, s_txt, s_img, h, d = 1, 3, 5, 2, 48
    txt, img = rand(b, s_txt, h, d, seed=1), rand(b, s_img, h, d, seed=2)
    w, f_txt, f_img = rand(d, seed=3), freqs_of(s_txt, d), freqs_of(s_img, d, seed=8)
    res, y = rand(b, s_img, d, seed=4), rand(b, s_img, d, seed=5)
    gate, shift, scale = (rand(b, d, seed=s) for s in (6, 7, 8))

    def block(txt, img, res, y):
        joint = torch.empty(b, s_txt + s_img, h, d, device=DEVICE)
        rmsnorm_rope(txt, w, f_txt, out=joint[:, :s_txt])
        rmsnorm_rope(img, w, f_img, out=joint[:, s_txt:])
        new_res, mod = gate_residual_layernorm_modulate(res, y, gate, shift, scale)
        return joint * 2, gate_residual(new_res, mod, gate), layernorm_modulate(mod, shift, scale)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(txt, img, res, y), block(txt, img, res, y)):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------
# bad inputs: clear errors before any launch
# --------------------------------------------------------------------------------------------

B, L, D = 2, 3, 48


def _lnm(**kw):
    args = dict(x=rand(B, L, D), shift=rand(B, D), scale=rand(B, D))
    args.update(kw)
    return lambda: layernorm_modulate(**args)


def _gr(**kw):
    args = dict(residual=rand(B, L, D), y=rand(B, L, D), gate=rand(B, D))
    args.update(kw)
    return lambda: gate_residual(**args)


def _grlnm(**kw):
    args = dict(residual=rand(B, L, D), y=rand(B, L, D), gate=rand(B, D), shift=rand(B, D), scale=rand(B, D))
    args.update(kw)
    return lambda: gate_residual_layernorm_modulate(**args)


def _rr(**kw):
    args = dict(x=rand(B, L, 2, D), weight=rand(D), freqs=freqs_of(L, D))
    args.update(kw)
    return lambda: rmsnorm_rope(**args)


BAD = {
    "x rank": (_lnm(x=rand(B, D)), ValueError, r"x must have rank 3"),
    "x dtype": (_lnm(x=rand(B, L, D).double()), TypeError, r"x must be float16, bfloat16 or float32"),
    "x not a tensor": (_lnm(x=[[1.0]]), TypeError, r"x must be a torch.Tensor"),
    "x last stride": (_lnm(x=rand(B, D, L).transpose(1, 2)), ValueError, r"x must have unit stride"),
    "x too wide": (_lnm(x=rand(1, 1, MAX_DIM + 1), shift=rand(1, MAX_DIM + 1), scale=rand(1, MAX_DIM + 1)),
                   ValueError, r"last dim of x must be between 1 and"),
    "shift rows": (_lnm(shift=rand(B + 1, D)), ValueError, r"shift must have shape \(batch, dim\) = \(2, 48\)"),
    "scale width": (_lnm(scale=rand(B, D + 1)), ValueError, r"scale must have shape"),
    "scale last stride": (_lnm(scale=rand(D, B).T), ValueError, r"scale must have unit stride"),
    "shift dtype": (_lnm(shift=rand(B, D).double()), TypeError, r"shift must be float16"),
    "index needs 2B rows": (_lnm(index=torch.zeros(B, L, dtype=torch.long)), ValueError,
                            r"shift must have shape \(2·batch, dim\) = \(4, 48\)"),
    "index shape": (_lnm(index=torch.zeros(B, L + 1, dtype=torch.long), shift=rand(2 * B, D), scale=rand(2 * B, D)),
                    ValueError, r"index must have shape \(batch, seqlen\) = \(2, 3\)"),
    "index dtype": (_lnm(index=torch.zeros(B, L), shift=rand(2 * B, D), scale=rand(2 * B, D)),
                    TypeError, r"index must be an integer or bool tensor"),
    "index type": (_lnm(index=[0, 1]), TypeError, r"index must be None or an integer torch.Tensor"),
    "eps negative": (_lnm(eps=-1e-6), ValueError, r"eps must be a finite number >= 0"),
    "eps nan": (_lnm(eps=float("nan")), ValueError, r"eps must be a finite number"),
    "eps str": (_lnm(eps="1e-6"), TypeError, r"eps must be a float"),
    "y shape": (_gr(y=rand(B, L + 1, D)), ValueError, r"y must have residual's shape \(2, 3, 48\)"),
    "y rank": (_gr(y=rand(B, L)), ValueError, r"y must have rank 3"),
    "gate shape": (_gr(gate=rand(B, 1, D)), ValueError, r"gate must have rank 2"),
    "residual rank": (_gr(residual=rand(B, L, D, 1)), ValueError, r"residual must have rank 3"),
    "fused gate rows": (_grlnm(gate=rand(1, D)), ValueError, r"gate must have shape \(batch, dim\)"),
    "fused scale width": (_grlnm(scale=rand(B, 2 * D)), ValueError, r"scale must have shape"),
    "fused eps": (_grlnm(eps=float("inf")), ValueError, r"eps must be a finite number"),
    "rope x rank": (_rr(x=rand(B, L, D)), ValueError, r"x must have rank 4"),
    "rope odd head_dim": (_rr(x=rand(B, L, 2, 47), weight=rand(47)), ValueError, r"head_dim .* must be even"),
    "rope x last stride": (_rr(x=rand(B, L, D, 2).transpose(2, 3)), ValueError, r"x must have unit stride"),
    "rope weight shape": (_rr(weight=rand(D + 2)), ValueError, r"weight must have shape \(head_dim,\) = \(48,\)"),
    "rope weight dtype": (_rr(weight=rand(D).double()), TypeError, r"weight must be float16"),
    "rope freqs real": (_rr(freqs=rand(L, D // 2)), TypeError, r"freqs must be complex64"),
    "rope freqs complex128": (_rr(freqs=freqs_of(L, D).to(torch.complex128)), TypeError, r"freqs must be complex64"),
    "rope freqs shape": (_rr(freqs=freqs_of(L + 1, D)), ValueError,
                         r"freqs must have shape \(seqlen, head_dim // 2\) = \(3, 24\)"),
    "rope freqs type": (_rr(freqs=None), TypeError, r"freqs must be a complex64 torch.Tensor"),
    "rope out shape": (_rr(out=rand(B, L, 2, D + 2)), ValueError, r"out must have x's shape"),
    "rope out dtype": (_rr(out=rand(B, L, 2, D, dtype=torch.float16)), TypeError, r"out must have x's dtype"),
    "rope out last stride": (_rr(out=rand(B, L, D, 2).transpose(2, 3)), ValueError, r"out must have unit stride"),
    "rope eps": (_rr(eps=-1.0), ValueError, r"eps must be a finite number >= 0"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_inputs_raise(case):
    call, error, match = BAD[case]
    with pytest.raises(error, match=match):
        call()


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only run under the interpreter")
def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"CUDA tensors; got x on cpu"):
        _lnm()()


@pytest.mark.parametrize("op,name,shape", [(_lnm, "scale", (B, D)), (_gr, "y", (B, L, D)),
                                           (_grlnm, "shift", (B, D)), (_rr, "weight", (D,))])
def test_requires_grad_is_refused(op, name, shape):
    with pytest.raises(ValueError, match=rf"{name} requires grad"):
        op(**{name: rand(*shape).requires_grad_()})()


def test_requires_grad_is_accepted_under_no_grad():
    x = rand(B, L, D).requires_grad_()
    with torch.no_grad():
        assert not layernorm_modulate(x, rand(B, D), rand(B, D)).requires_grad


# --------------------------------------------------------------------------------------------
# diffusers' own Qwen-Image functions
# --------------------------------------------------------------------------------------------


def _qwen_block(dim):
    qwen = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")
    return qwen.QwenImageTransformerBlock(dim=dim, num_attention_heads=2, attention_head_dim=dim // 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_index", [False, True], ids=["plain", "index"])
def test_layernorm_modulate_equals_diffusers_block(dtype, with_index):
    b, l, d = 2, 7, 48
    block = _qwen_block(d)
    layer_norm = torch.nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
    x, attn = rand(b, l, d, dtype=dtype, scale=2.0), rand(b, l, d, dtype=dtype, seed=1)
    rows = 2 * b if with_index else b
    mod_params = rand(rows, 3 * d, dtype=dtype, seed=2)
    index = (torch.arange(l, device=DEVICE) >= 3).long().expand(b, l) if with_index else None
    with torch.no_grad():
        want, want_gate = block._modulate(layer_norm(x), mod_params, index)
        want_res = x + want_gate * attn
        want_mod, _ = block._modulate(layer_norm(want_res), mod_params, index)
    shift, scale, gate = mod_params.chunk(3, dim=-1)
    got = layernorm_modulate(x, shift, scale, index=index)
    got_res = gate_residual(x, attn, gate, index=index)
    fused_res, fused_mod = gate_residual_layernorm_modulate(x, attn, gate, shift, scale, index=index)
    # fp32: the same arithmetic; bf16: diffusers rounds after every step, flashflow once
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for out, expected in ((got, want), (got_res, want_res), (fused_res, want_res), (fused_mod, want_mod)):
        assert err(out, expected.double()) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
def test_rmsnorm_rope_equals_diffusers(dtype, weighted):
    qwen = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")
    from diffusers.models.normalization import RMSNorm

    b, s, h, d = 2, 7, 3, 48
    rms = RMSNorm(d, eps=1e-6, elementwise_affine=weighted).to(DEVICE, dtype)
    if weighted:
        with torch.no_grad():
            rms.weight.copy_(rand(d, seed=3) + 1.0)
    x = rand(b, s, h * d, dtype=dtype, scale=2.0).unflatten(-1, (h, d))
    freqs = freqs_of(s, d)
    with torch.no_grad():
        want = qwen.apply_rotary_emb_qwen(rms(x), freqs, use_real=False)
        got = rmsnorm_rope(x, rms.weight if weighted else None, freqs)   # a Parameter: under no_grad
    assert got.dtype == want.dtype == dtype
    # The same roundings in the same places: what is left is the last bits of the fp32 rotation
    # and, for bf16 under the interpreter, its casts to bf16, which truncate instead of rounding
    # to nearest (up to three conversions, each within one unit of the last place).
    last_place = {torch.float32: 2 ** -20, torch.float16: 2 ** -10,
                  torch.bfloat16: (4 if interpreting() else 1) * 2 ** -7}[dtype]
    assert err(got, want.double()) <= last_place


def test_rmsnorm_rope_out_under_torch_compile():
    """``out=`` into two slices of a joint buffer survives torch.compile (the functional op and a
    copy are traced: Inductor rejected the mutating op on a view)."""
    torch.manual_seed(0)
    s_t, s_i, h, d = 5, 9, 2, 16
    xt = torch.randn(1, s_t, h, d, device=DEVICE)
    xi = torch.randn(1, s_i, h, d, device=DEVICE)
    ft = torch.polar(torch.ones(s_t, d // 2), torch.rand(s_t, d // 2) * 6)
    fi = torch.polar(torch.ones(s_i, d // 2), torch.rand(s_i, d // 2) * 6)

    def joint(xt, xi):
        out = torch.empty(1, s_t + s_i, h, d, device=DEVICE)
        rmsnorm_rope(xt, None, ft, out=out[:, :s_t])
        rmsnorm_rope(xi, None, fi, out=out[:, s_t:])
        return out

    want = joint(xt, xi)
    got = torch.compile(joint, fullgraph=True)(xt, xi)   # Inductor
    assert torch.equal(got, want)
