"""The FP8 row quantization (flashflow.ops.quant) through Triton's interpreter: quantize_rows and
gelu_quantize_rows against the float64 fake quantization (flashflow.reference.quant) at odd widths
in fp32/fp16/bf16 with outlier channels and offsets, zero rows, NaN/inf rows, every layout, the
widest row, outputs poisoned with NaN, the dequantized error bound, the custom ops under opcheck
and torch.compile, and bad inputs. Tolerances: tests/fp8_rows.py."""
import pytest
import torch
import torch.nn.functional as F

from flashflow.ops.quant import Fp8Rows, gelu_quantize_rows, quantize_rows
from flashflow.reference import quant as ref
from flashflow.reference.metrics import cosine
from flashflow.tuning.norm import MAX_ROW_WIDTH
from fp8_rows import assert_dequantized_close, assert_rows_match
from kernel_device import DEVICE
from norm_inputs import poisoned  # noqa: F401 (a fixture)

pytestmark = pytest.mark.kernels
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the kernels' scale: exact inputs, one fp32 division (tests/fp8_rows.py)
SCALE_RTOL = {"quantize": 2 ** -21, "gelu": 1e-5}


def stress(*shape, dtype=torch.float32, seed=0, offset=0.0, outliers=True):
    """Gaussian rows with an offset and, with ``outliers``, a few channels 30x larger (as LLM and
    DiT activations have): the rows' amax is set by a few values, the rest sit low on the grid."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) + offset
    if outliers:
        channels = torch.randperm(shape[-1], generator=g)[:max(1, shape[-1] // 64)]
        x[..., channels] *= 30.0
    return x.to(DEVICE, dtype)


def want(x, gelu):
    return (ref.gelu_quantize_rows if gelu else ref.quantize_rows)(x.double())


def exact(x, gelu):
    """The float64 rows the kernel quantizes: ``x``, or its GELU (tanh form)."""
    return F.gelu(x.double(), approximate="tanh") if gelu else x.double()


def run(x, gelu):
    return gelu_quantize_rows(x) if gelu else quantize_rows(x)


GELU = pytest.mark.parametrize("gelu", [False, True], ids=["plain", "gelu"])


# --------------------------------------------------------------------------------------------
# numerics against float64
# --------------------------------------------------------------------------------------------


@GELU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,offset", [((1, 1, 48), 0.0), ((2, 7, 1000), 0.5), ((3, 5, 200), -2.0),
                                          ((5, 3077), 0.0)])
def test_rows_match_float64(poisoned, gelu, dtype, shape, offset):
    x = stress(*shape, dtype=dtype, offset=offset)
    got = run(x, gelu)
    assert isinstance(got, Fp8Rows)
    assert_rows_match(got, exact(x, gelu), SCALE_RTOL["gelu" if gelu else "quantize"])


@GELU
def test_the_widest_row(gelu):
    x = stress(2, MAX_ROW_WIDTH, seed=1)
    assert_rows_match(run(x, gelu), exact(x, gelu), SCALE_RTOL["gelu" if gelu else "quantize"])


@GELU
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantized_is_within_e4m3_error(gelu, dtype):
    h = stress(2, 5, 300, dtype=dtype, seed=2, offset=0.3)
    got = run(h, gelu)
    exact = F.gelu(h.float(), approximate="tanh") if gelu else h.float()
    # from fp32 values: within the e4m3 bound of them, and far better than the fp8 format's worst case overall
    assert_dequantized_close(got, exact, 0.0)
    assert cosine((got.data.float() * got.scale).double(), exact.double()) > 0.999


def test_gelu_is_taken_in_fp32_before_quantizing():
    # bf16 h: the GELU's bf16 rounding would move values by up to 2^-9 relative; the kernel's
    # values are those of the fp32 GELU, so they match the float64 reference as closely as fp32 h's
    h = stress(2, 5, 1000, dtype=torch.bfloat16, seed=3)
    assert_rows_match(gelu_quantize_rows(h), exact(h, True), SCALE_RTOL["gelu"])


def test_saturation_and_subnormals():
    # one row spanning e4m3's range under its scale: 448 exactly, values on and between grid points,
    # values below the smallest normal (2^-6 · scale) and below half the smallest subnormal
    step = torch.tensor([448.0, 447.0, 416.0, 1.0, 1.0625, 0.96875, 2.0 ** -6, 2.0 ** -8 * 1.5, 2.0 ** -11, 0.0])
    x = torch.cat([step, -step]).view(1, -1).to(DEVICE) * 3.0
    got = quantize_rows(x)
    assert_rows_match(got, exact(x, False), SCALE_RTOL["quantize"])
    assert got.data.float().abs().max().item() == 448.0


@GELU
def test_zero_rows_get_the_floor_scale_and_zeros(gelu):
    x = stress(4, 100, seed=4)
    x[1] = 0.0
    got = run(x, gelu)
    assert_rows_match(got, exact(x, gelu), SCALE_RTOL["gelu" if gelu else "quantize"])
    assert (got.data[1].float() == 0).all() and got.scale[1].item() == pytest.approx(1e-20 / 448, rel=1e-6)


@GELU
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_non_finite_value_marks_its_row_only(poisoned, gelu, bad):
    x = stress(2, 5, 130, seed=5)
    x[0, 3, 17] = bad
    x[1, 0, 129] = bad
    got = run(x, gelu)
    assert want(x, gelu)[1].isnan().sum().item() == 2
    assert_rows_match(got, exact(x, gelu), SCALE_RTOL["gelu" if gelu else "quantize"])


def test_gelu_of_huge_values_is_finite():
    # |h| so large that h³ overflows fp32: GELU(h) is h or -0, the rows stay finite
    h = torch.tensor([[1e30, -1e30, 3e19, -3e19, 1.0, -5.0, -20.0, 0.0]], device=DEVICE)
    got = gelu_quantize_rows(h)
    assert_rows_match(got, exact(h, True), SCALE_RTOL["gelu"])


# --------------------------------------------------------------------------------------------
# layouts: any strides give the bits of the contiguous call
# --------------------------------------------------------------------------------------------


def _layouts():
    g = torch.Generator().manual_seed(6)
    base = torch.randn(6, 4, 2 * 150, generator=g).to(DEVICE)
    return {
        "1-d": base[0, 0, :150],
        "2-d row stride": base[:, 0, :150],
        "transposed": base[:, :, :150].transpose(0, 1),                      # (4, 6, 150), no dim contiguous but K
        "row step": base[::2, ::3, 10:160],
        "last stride 2": base[..., ::2],                                     # a contiguous copy
        "4-d unmergeable": base[:, :, :150].view(6, 2, 2, 150).transpose(0, 2),
        "expanded": base[0, :1, :150].expand(3, 5, 150),
    }


@GELU
@pytest.mark.parametrize("layout", list(_layouts()))
def test_layouts_change_no_bit(gelu, layout):
    x = _layouts()[layout]
    got, plain = run(x, gelu), run(x.contiguous(), gelu)
    assert got.data.shape == x.shape and got.scale.shape == (*x.shape[:-1], 1)
    assert torch.equal(got.data.view(torch.uint8), plain.data.view(torch.uint8))
    assert torch.equal(got.scale, plain.scale)
    assert_rows_match(got, exact(x, gelu), SCALE_RTOL["gelu" if gelu else "quantize"])


def test_empty_rows_launch_nothing():
    for shape in [(0, 48), (2, 0, 48), (3, 0, 2, 48)]:
        got = quantize_rows(torch.empty(shape, device=DEVICE))
        assert got.data.shape == shape and got.scale.shape == (*shape[:-1], 1)


# --------------------------------------------------------------------------------------------
# custom ops: opcheck and torch.compile
# --------------------------------------------------------------------------------------------


def test_custom_ops_opcheck():
    x = stress(2, 3, 48)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.flashflow.quantize_rows.default, (x,), test_utils=checks)
    torch.library.opcheck(torch.ops.flashflow.gelu_quantize_rows.default, (x[:, 1:],), test_utils=checks)


def test_torch_compile_traces_the_custom_ops():
    x = stress(3, 5, 48, seed=7)

    def mlp_middle(x):
        a = quantize_rows(x * 2)
        g = gelu_quantize_rows(x)
        return a.data.float() * a.scale, g.data, g.scale

    compiled = torch.compile(mlp_middle, fullgraph=True, backend="aot_eager")
    for got, expected in zip(compiled(x), mlp_middle(x)):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           expected.view(torch.uint8) if expected.dtype == torch.float8_e4m3fn else expected)


# --------------------------------------------------------------------------------------------
# bad inputs: clear errors before any launch
# --------------------------------------------------------------------------------------------

BAD = {
    "not a tensor": (lambda: quantize_rows([[1.0]]), TypeError, r"x must be a torch.Tensor of shape \(\.\.\., K\)"),
    "0-d": (lambda: quantize_rows(torch.tensor(1.0, device=DEVICE)), ValueError, r"x must have rank >= 1"),
    "float64": (lambda: quantize_rows(torch.ones(2, 8, dtype=torch.float64, device=DEVICE)), TypeError,
                r"x must be float16, bfloat16 or float32, got torch.float64"),
    "int": (lambda: gelu_quantize_rows(torch.ones(2, 8, dtype=torch.int32, device=DEVICE)), TypeError,
            r"h must be float16, bfloat16 or float32, got torch.int32"),
    "fp8 in": (lambda: quantize_rows(torch.ones(2, 8, device=DEVICE).to(torch.float8_e4m3fn)), TypeError,
               r"x must be float16, bfloat16 or float32"),
    "K 0": (lambda: quantize_rows(torch.ones(2, 0, device=DEVICE)), ValueError,
            r"the last dim \(K\) of x must be between 1 and 16384, got 0"),
    "K too wide": (lambda: gelu_quantize_rows(torch.ones(1, MAX_ROW_WIDTH + 1, device=DEVICE)), ValueError,
                   r"the last dim \(K\) of h must be between 1 and 16384, got 16385"),
    "requires grad": (lambda: quantize_rows(torch.ones(2, 8, device=DEVICE, requires_grad=True)), ValueError,
                      r"x requires grad"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_inputs_raise_before_any_launch(monkeypatch, case):
    from flashflow.ops import quant

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched")

    monkeypatch.setattr(quant, "quantize_rows_kernel", NoLaunch())
    call, error, match = BAD[case]
    with pytest.raises(error, match=match):
        call()


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only run under the interpreter")
def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"CUDA tensors; got x on cpu"):
        quantize_rows(torch.ones(2, 8))


# --------------------------------------------------------------------------------------------
# the reference itself
# --------------------------------------------------------------------------------------------


def test_reference_rounding_is_torchs_e4m3_conversion():
    # on float32 values (one rounding either way): ties, both binade edges, subnormals, saturation
    g = torch.Generator().manual_seed(8)
    x = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-14, 10, (20000,), generator=g).float())
    ties = torch.arange(-4000, 4000, dtype=torch.float64) * 2.0 ** -11
    for v in (x.double(), ties, ties * 256, torch.tensor([500.0, -1e6, 464.0, 2.0 ** -10, 2.0 ** -10 * 3])):
        v = v.double()
        assert torch.equal(ref.round_e4m3(v), v.float().clamp(-448, 448).to(torch.float8_e4m3fn).double())
