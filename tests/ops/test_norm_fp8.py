"""The diffusion norms' FP8 row outputs (``fp8=True`` of layernorm_modulate and
gate_residual_layernorm_modulate) through Triton's interpreter: against the float64 reference
quantized by flashflow.reference.quant, in fp32/fp16/bf16 at odd widths with outlier channels and
offsets, the index (zero_cond_t) rows, strided inputs, zero and non-finite rows, outputs poisoned
with NaN, the dequantized rows against the 16-bit op's output, the custom ops under opcheck and
torch.compile, and bad inputs. Tolerances: tests/fp8_rows.py."""
import pytest
import torch

from flashflow.ops.norm import gate_residual_layernorm_modulate, layernorm_modulate
from flashflow.ops.quant import Fp8Rows
from flashflow.reference import norm as ref
from flashflow.reference.quant import quantize_rows as ref_rows
from fp8_rows import assert_dequantized_close, assert_rows_match
from norm_inputs import DEVICE, TOL, d64, err, poisoned, rand  # noqa: F401 (poisoned: a fixture)

pytestmark = pytest.mark.kernels
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1, 48), (2, 7, 1000), (1, 5, 200), (2, 3, 3077)]          # (B, L, D)
# the scale is the amax of a row computed in fp32 (LayerNorm, modulation): its error, ~1e-6
SCALE_RTOL = 1e-5
ROUNDING = {torch.float32: 0.0, torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}


def outliers(x, seed=0):
    """x with a few channels 20x larger, as a DiT's activations have."""
    g = torch.Generator().manual_seed(seed)
    channels = torch.randperm(x.shape[-1], generator=g)[:max(1, x.shape[-1] // 64)]
    x = x.clone()
    x[..., channels] *= 20.0
    return x


def lnm_inputs(b, l, d, dtype=torch.float32, rows=None):
    x = outliers(rand(b, l, d, dtype=dtype, scale=3.0, offset=1.0))
    rows = rows or b
    shift, scale = rand(rows, d, dtype=dtype, seed=1), rand(rows, d, dtype=dtype, seed=2)
    return x, shift, outliers(scale, seed=3)


def grlnm_inputs(b, l, d, dtype=torch.float32, rows=None):
    res, y = outliers(rand(b, l, d, dtype=dtype, offset=0.5)), rand(b, l, d, dtype=dtype, seed=1)
    rows = rows or b
    gate, shift, scale = (rand(rows, d, dtype=dtype, seed=s) for s in (2, 3, 4))
    return res, y, gate, shift, scale


# --------------------------------------------------------------------------------------------
# numerics against float64
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,l,d", SHAPES)
def test_layernorm_modulate_fp8_matches_float64(poisoned, dtype, b, l, d):
    x, shift, scale = lnm_inputs(b, l, d, dtype)
    got = layernorm_modulate(x, shift, scale, fp8=True)
    assert isinstance(got, Fp8Rows)
    assert_rows_match(got, ref.layernorm_modulate(*d64(x, shift, scale), 1e-6), SCALE_RTOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,l,d", SHAPES)
def test_gate_residual_layernorm_modulate_fp8_matches_float64(poisoned, dtype, b, l, d):
    ins = grlnm_inputs(b, l, d, dtype)
    new_res, got = gate_residual_layernorm_modulate(*ins, fp8=True)
    want_res, _ = ref.gate_residual_layernorm_modulate(*d64(*ins), 1e-6)
    assert new_res.dtype == dtype and isinstance(got, Fp8Rows)
    assert err(new_res, want_res) < TOL[dtype]
    # the same residual, bit for bit, as the 16-bit path's
    assert torch.equal(new_res, gate_residual_layernorm_modulate(*ins)[0])
    # modulated from the residual as rounded to its dtype (as stored), in float64
    want_mod = ref.layernorm_modulate(new_res.double(), *d64(*ins[3:]), 1e-6)
    assert_rows_match(got, want_mod, SCALE_RTOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantized_matches_the_16_bit_output(dtype):
    # both round the same fp32 row: the fp8 one to e4m3 under its scale, the other to x's dtype
    x, shift, scale = lnm_inputs(2, 5, 1000, dtype)
    got, plain = layernorm_modulate(x, shift, scale, fp8=True), layernorm_modulate(x, shift, scale)
    assert_dequantized_close(got, plain, ROUNDING[dtype])
    ins = grlnm_inputs(2, 5, 1000, dtype)
    (_, got), (_, plain) = gate_residual_layernorm_modulate(*ins, fp8=True), gate_residual_layernorm_modulate(*ins)
    assert_dequantized_close(got, plain, ROUNDING[dtype])


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.bool])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_picks_the_second_half_of_the_rows(poisoned, index_dtype, dtype):
    b, l, d = 2, 9, 80
    index = torch.zeros(b, l, dtype=torch.int64)
    index[0, 4:] = 1          # diffusers' layout: the reference image's tokens after the target's
    index[1, ::3] = 1
    index = index.to(DEVICE, index_dtype)
    x, shift, scale = lnm_inputs(b, l, d, dtype, rows=2 * b)
    got = layernorm_modulate(x, shift, scale, index=index, fp8=True)
    assert_rows_match(got, ref.layernorm_modulate(*d64(x, shift, scale), 1e-6, index=index), SCALE_RTOL)
    ins = grlnm_inputs(b, l, d, dtype, rows=2 * b)
    new_res, got = gate_residual_layernorm_modulate(*ins, index=index, fp8=True)
    assert torch.equal(new_res, gate_residual_layernorm_modulate(*ins, index=index)[0])
    want_mod = ref.layernorm_modulate(new_res.double(), *d64(*ins[3:]), 1e-6, index=index)
    assert_rows_match(got, want_mod, SCALE_RTOL)


def test_strided_inputs_as_diffusers_makes_them():
    b, l, d = 2, 7, 80
    mod1, mod2 = rand(b, 6 * d, seed=1).chunk(2, dim=-1)
    shift, scale, gate = mod1.chunk(3, dim=-1)
    shift2, scale2, _ = mod2.chunk(3, dim=-1)
    x = rand(l + 3, b, d + 5)[2:2 + l, :, 1:1 + d].transpose(0, 1)        # (B, L, D), no dim contiguous but D
    y = rand(b, l, 3 * d, seed=2)[..., d:2 * d]
    got = layernorm_modulate(x, shift, scale, fp8=True)
    assert_rows_match(got, ref.layernorm_modulate(*d64(x, shift, scale), 1e-6), SCALE_RTOL)
    new_res, got = gate_residual_layernorm_modulate(x, y, gate, shift2, scale2, fp8=True)
    want_mod = ref.layernorm_modulate(new_res.double(), *d64(shift2, scale2), 1e-6)
    assert_rows_match(got, want_mod, SCALE_RTOL)
    # the bits of the call on contiguous copies
    again = layernorm_modulate(x.contiguous(), shift.contiguous(), scale.contiguous(), fp8=True)
    assert torch.equal(got.scale.isnan(), again.scale.isnan())
    assert torch.equal(layernorm_modulate(x, shift, scale, fp8=True).data.view(torch.uint8), again.data.view(torch.uint8))


def test_a_zero_row_gets_the_floor_scale():
    # a constant token normalises to 0; with shift 0 its modulated row is all zeros
    b, l, d = 2, 3, 48
    x, shift, scale = lnm_inputs(b, l, d)
    x[1, 2] = 5.0
    shift[1] = 0.0
    got = layernorm_modulate(x, shift, scale, fp8=True)
    assert_rows_match(got, ref.layernorm_modulate(*d64(x, shift, scale), 1e-6), SCALE_RTOL)
    assert (got.data[1, 2].float() == 0).all() and got.scale[1, 2].item() == pytest.approx(1e-20 / 448, rel=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_non_finite_value_marks_its_rows_only(poisoned, bad):
    b, l, d = 2, 5, 130
    x, shift, scale = lnm_inputs(b, l, d)
    x[0, 3, 17] = bad                     # one token
    got = layernorm_modulate(x, shift, scale, fp8=True)
    want = ref.layernorm_modulate(*d64(x, shift, scale), 1e-6)
    assert ref_rows(want)[1].isnan().sum().item() == 1
    assert_rows_match(got, want, SCALE_RTOL)
    res, y, gate, shift, scale = grlnm_inputs(b, l, d)
    y[1, 0, 100] = bad                    # one token of the branch
    gate[0, 5] = bad                      # a column of every token of batch entry 0
    new_res, got = gate_residual_layernorm_modulate(res, y, gate, shift, scale, fp8=True)
    want = ref.layernorm_modulate(new_res.double(), *d64(shift, scale), 1e-6)
    assert ref_rows(want)[1].isnan().sum().item() == l + 1
    assert_rows_match(got, want, SCALE_RTOL)


def test_empty_inputs_launch_nothing():
    x, shift, scale = rand(2, 0, 48), rand(2, 48), rand(2, 48)
    got = layernorm_modulate(x, shift, scale, fp8=True)
    assert got.data.shape == (2, 0, 48) and got.scale.shape == (2, 0, 1)
    new_res, got = gate_residual_layernorm_modulate(x, x, shift, shift, scale, fp8=True)
    assert new_res.shape == got.data.shape == (2, 0, 48) and got.scale.shape == (2, 0, 1)


# --------------------------------------------------------------------------------------------
# custom ops: opcheck and torch.compile
# --------------------------------------------------------------------------------------------


def test_custom_ops_opcheck():
    b, l, d = 2, 3, 48
    x, y = rand(b, l, d), rand(b, l, d, seed=1)
    gate, shift, scale = (rand(2 * b, d, seed=s) for s in (2, 3, 4))
    index = torch.tensor([[0, 1, 1], [1, 0, 0]], device=DEVICE)
    checks = ("test_schema", "test_faketensor")
    ops = torch.ops.flashflow
    torch.library.opcheck(ops.layernorm_modulate_fp8.default, (x, shift, scale, index, 1e-6), test_utils=checks)
    torch.library.opcheck(ops.gate_residual_layernorm_modulate_fp8.default, (x, y, gate[:b], shift[:b], scale[:b],
                                                                              None, 1e-6), test_utils=checks)


def test_torch_compile_traces_the_fp8_outputs():
    b, l, d = 1, 5, 48
    res, y = rand(b, l, d, seed=4), rand(b, l, d, seed=5)
    gate, shift, scale = (rand(b, d, seed=s) for s in (6, 7, 8))

    def block(res, y):
        new_res, mod = gate_residual_layernorm_modulate(res, y, gate, shift, scale, fp8=True)
        first = layernorm_modulate(new_res, shift, scale, fp8=True)
        return new_res * 2, mod.data.float() * mod.scale, first.scale

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(res, y), block(res, y)):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------
# bad inputs: clear errors before any launch
# --------------------------------------------------------------------------------------------

B, L, D = 2, 3, 48


def _lnm(**kw):
    args = dict(x=rand(B, L, D), shift=rand(B, D), scale=rand(B, D), fp8=True)
    args.update(kw)
    return lambda: layernorm_modulate(**args)


def _grlnm(**kw):
    args = dict(residual=rand(B, L, D), y=rand(B, L, D), gate=rand(B, D), shift=rand(B, D), scale=rand(B, D),
                fp8=True)
    args.update(kw)
    return lambda: gate_residual_layernorm_modulate(**args)


BAD = {
    "fp8 str": (_lnm(fp8="yes"), TypeError, r"fp8 must be True or False, got 'yes'"),
    "fp8 int": (_lnm(fp8=1), TypeError, r"fp8 must be True or False, got 1"),
    "fp8 None": (_grlnm(fp8=None), TypeError, r"fp8 must be True or False, got None"),
    "x float64": (_lnm(x=rand(B, L, D).double()), TypeError, r"x must be float16, bfloat16 or float32"),
    "residual float64": (_grlnm(residual=rand(B, L, D).double()), TypeError,
                         r"residual must be float16, bfloat16 or float32"),
    "x fp8": (_lnm(x=rand(B, L, D).to(torch.float8_e4m3fn)), TypeError, r"x must be float16, bfloat16 or float32"),
    "scale rows": (_lnm(scale=rand(B + 1, D)), ValueError, r"scale must have shape \(batch, dim\)"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_inputs_raise_before_any_launch(monkeypatch, case):
    from flashflow.ops import norm

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched")

    monkeypatch.setattr(norm, "layernorm_modulate_kernel", NoLaunch())
    monkeypatch.setattr(norm, "gate_residual_layernorm_modulate_kernel", NoLaunch())
    call, error, match = BAD[case]
    with pytest.raises(error, match=match):
        call()
