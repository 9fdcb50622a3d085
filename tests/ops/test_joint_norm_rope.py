"""joint_qkv_norm_rope (flashflow.ops.norm) through Triton's interpreter: both streams' q/k
RMSNorm + RoPE and the v concatenation in one launch, against float64 at odd sizes in
fp32/fp16/bf16, outputs poisoned with NaN, strided inputs as a Linear's output gives them, an
eps per norm, equality with the unfused rmsnorm_rope + torch.cat, the custom op under opcheck
and torch.compile, and bad inputs refused before any launch."""
import pytest
import torch

from flashflow.ops.norm import MAX_DIM, joint_qkv_norm_rope, joint_qkv_norm_rope_, rmsnorm_rope
from flashflow.reference import norm as ref
from norm_inputs import DEVICE, TOL, d64, err, freqs_of, poisoned, rand  # noqa: F401 (poisoned: a fixture)

pytestmark = pytest.mark.kernels
EPS4 = (1e-6, 1e-5, 1e-4, 1e-3)


def streams(b, s_txt, s_img, h, d, dtype=torch.float32, weighted=True, wdtype=None):
    """The op's twelve tensor arguments, as diffusers' processor has them: each stream's q, k, v
    views of one fused (B, S, 3·H·D) projection (row stride 3·H·D), the image stream's with its
    batch and sequence dims transposed in memory."""
    txt = rand(b, s_txt, 3 * h * d, dtype=dtype, seed=1, scale=2.0, offset=0.3).unflatten(-1, (3 * h, d))
    img = rand(s_img, b, 3 * h * d, dtype=dtype, seed=2, scale=2.0, offset=-0.2).transpose(0, 1)
    img = img.unflatten(-1, (3 * h, d))
    txt_q, txt_k, txt_v = txt.split(h, dim=2)
    img_q, img_k, img_v = img.split(h, dim=2)
    wdtype = wdtype or dtype
    weights = ([rand(d, dtype=wdtype, seed=3 + n).abs() + 0.5 for n in range(4)] if weighted else [None] * 4)
    return [txt_q, txt_k, txt_v, img_q, img_k, img_v, *weights, freqs_of(s_txt, d, seed=7),
            freqs_of(s_img, d, seed=8)]


def check_against_float64(args, eps, tol):
    query, key, value = joint_qkv_norm_rope(*args, eps=eps)
    want = ref.joint_qkv_norm_rope(*d64(*args[:10]), *args[10:], eps=eps)
    b, s_txt, h, d = args[0].shape
    shape = (b, s_txt + args[3].shape[1], h, d)
    for got, expected in zip((query, key, value), want):
        assert got.shape == shape and got.dtype == args[0].dtype and got.is_contiguous()
        assert err(got, expected) < tol
    assert torch.equal(value, torch.cat([args[2], args[5]], dim=1))     # v: an exact copy


# --------------------------------------------------------------------------------------------
# numerics
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 24])                # 24: half a tile of pairs masked
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
def test_matches_float64(poisoned, dtype, d, weighted):
    args = streams(2, 7, 13, 3, d, dtype, weighted)
    assert not args[0].is_contiguous() and not args[3].is_contiguous()
    check_against_float64(args, EPS4, TOL[dtype])


@pytest.mark.parametrize("h", [7, 24])                 # 7: a head block with a masked head; 24: three blocks
def test_head_blocks(poisoned, h):
    check_against_float64(streams(1, 5, 9, h, 48), 1e-6, TOL[torch.float32])


def test_fp32_weights_on_bf16_inputs(poisoned):
    # weights kept in fp32: no rounding to the weights' dtype in between
    check_against_float64(streams(2, 7, 13, 3, 32, torch.bfloat16, wdtype=torch.float32), 1e-6,
                          TOL[torch.bfloat16])


@pytest.mark.parametrize("s_txt,s_img", [(0, 13), (7, 0)])
def test_one_empty_stream(poisoned, s_txt, s_img):
    check_against_float64(streams(2, s_txt, s_img, 3, 32), 1e-6, TOL[torch.float32])


def test_each_eps_is_used():
    # rows of small magnitude, where eps matters; a different eps for each of the four norms
    args = streams(1, 5, 9, 2, 32)
    small = [t * 0.05 for t in args[:6]]
    eps = (0.0, 0.5, 0.01, 2.0)
    query, key, _ = joint_qkv_norm_rope(*small, *args[6:], eps=eps)
    want_q, want_k, _ = ref.joint_qkv_norm_rope(*d64(*(small + args[6:10])), *args[10:], eps=eps)
    assert err(query, want_q) < 1e-5 and err(key, want_k) < 1e-5
    swapped_q, _, _ = joint_qkv_norm_rope(*small, *args[6:], eps=(0.5, 0.0, 2.0, 0.01))
    assert not torch.allclose(query, swapped_q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
def test_equals_rmsnorm_rope_and_cat_bit_for_bit(dtype, weighted):
    args = streams(2, 7, 13, 3, 24, dtype, weighted)
    tq, tk, tv, iq, ik, iv, wtq, wtk, wiq, wik, ft, fi = args
    query, key, value = joint_qkv_norm_rope(*args, eps=EPS4)
    assert torch.equal(query, torch.cat([rmsnorm_rope(tq, wtq, ft, EPS4[0]), rmsnorm_rope(iq, wiq, fi, EPS4[2])], 1))
    assert torch.equal(key, torch.cat([rmsnorm_rope(tk, wtk, ft, EPS4[1]), rmsnorm_rope(ik, wik, fi, EPS4[3])], 1))
    assert torch.equal(value, torch.cat([tv, iv], 1))


def test_empty_batch_launches_nothing():
    outs = joint_qkv_norm_rope(*streams(0, 7, 13, 3, 32))
    assert [tuple(t.shape) for t in outs] == [(0, 20, 3, 32)] * 3


# --------------------------------------------------------------------------------------------
# custom op: opcheck and torch.compile
# --------------------------------------------------------------------------------------------


def test_custom_op_opcheck():
    checks = ("test_schema", "test_faketensor")
    for weighted in (True, False):
        args = [t.contiguous() if t is not None else None for t in streams(1, 3, 5, 2, 32, weighted=weighted)]
        torch.library.opcheck(torch.ops.flashflow.joint_qkv_norm_rope.default, (*args, *EPS4), test_utils=checks)


def test_torch_compile():
    args = streams(1, 3, 5, 2, 32)

    def attention_inputs(*tensors):
        query, key, value = joint_qkv_norm_rope(*tensors, *args[6:], eps=EPS4)
        return query * 2, key + 1, value

    compiled = torch.compile(attention_inputs, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(*args[:6]), attention_inputs(*args[:6])):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------
# bad inputs: clear errors before any launch
# --------------------------------------------------------------------------------------------

NAMES = ["txt_q", "txt_k", "txt_v", "img_q", "img_k", "img_v", "txt_q_weight", "txt_k_weight", "img_q_weight",
         "img_k_weight", "txt_freqs", "img_freqs"]
B, S_TXT, S_IMG, H, D = 2, 3, 5, 2, 16


def _call(**kw):
    args = dict(zip(NAMES, streams(B, S_TXT, S_IMG, H, D)))
    args.update(kw)
    return lambda: joint_qkv_norm_rope(**args)


BAD = {
    "txt_q rank": (_call(txt_q=rand(B, S_TXT, H * D)), ValueError, r"txt_q must have rank 4"),
    "txt_q dtype": (_call(txt_q=rand(B, S_TXT, H, D).double()), TypeError, r"txt_q must be float16, bfloat16"),
    "txt_q not a tensor": (_call(txt_q=[1.0]), TypeError, r"txt_q must be a torch.Tensor"),
    "txt_q last stride": (_call(txt_q=rand(B, S_TXT, D, H).transpose(2, 3)), ValueError,
                          r"txt_q must have unit stride"),
    "odd head_dim": (_call(txt_q=rand(B, S_TXT, H, 15)), ValueError, r"head_dim \(txt_q's last dim\) must be even"),
    "head_dim too wide": (_call(txt_q=rand(1, 1, 1, MAX_DIM + 2)), ValueError, r"must be even and between 2 and"),
    "txt_k shape": (_call(txt_k=rand(B, S_TXT + 1, H, D)), ValueError, r"txt_k must have txt_q's shape"),
    "txt_v dtype": (_call(txt_v=rand(B, S_TXT, H, D, dtype=torch.float16)), TypeError,
                    r"txt_v must have txt_q's dtype torch.float32"),
    "img_q heads": (_call(img_q=rand(B, S_IMG, H + 1, D)), ValueError,
                    r"img_q must have txt_q's batch, heads and head_dim"),
    "img_q batch": (_call(img_q=rand(B + 1, S_IMG, H, D)), ValueError,
                    r"img_q must have txt_q's batch, heads and head_dim"),
    "img_q dtype": (_call(**{n: rand(B, S_IMG, H, D, dtype=torch.float16) for n in NAMES[3:6]}), TypeError,
                    r"img_q must have txt_q's dtype"),
    "img_v shape": (_call(img_v=rand(B, S_IMG - 1, H, D)), ValueError, r"img_v must have img_q's shape"),
    "img_k last stride": (_call(img_k=rand(B, S_IMG, D, H).transpose(2, 3)), ValueError,
                          r"img_k must have unit stride"),
    "weight shape": (_call(img_k_weight=rand(D + 2)), ValueError,
                     r"img_k_weight must have shape \(head_dim,\) = \(16,\)"),
    "weight dtype": (_call(txt_k_weight=rand(D).double()), TypeError, r"txt_k_weight must be float16"),
    "weights mixed None": (_call(img_q_weight=None), ValueError,
                           r"all tensors or all None; got img_q_weight None"),
    "weights mixed dtypes": (_call(txt_q_weight=rand(D, dtype=torch.float16)), TypeError,
                             r"weights must share one dtype"),
    "txt_freqs real": (_call(txt_freqs=rand(S_TXT, D // 2)), TypeError, r"txt_freqs must be complex64"),
    "img_freqs type": (_call(img_freqs=None), TypeError, r"img_freqs must be a complex64 torch.Tensor"),
    "img_freqs shape": (_call(img_freqs=freqs_of(S_TXT, D)), ValueError,
                        r"img_freqs must have shape \(seqlen, head_dim // 2\) = \(5, 8\)"),
    "txt_freqs swapped": (_call(txt_freqs=freqs_of(S_IMG, D), img_freqs=freqs_of(S_TXT, D)), ValueError,
                          r"txt_freqs must have shape \(seqlen, head_dim // 2\) = \(3, 8\)"),
    "eps negative": (_call(eps=-1.0), ValueError, r"eps must be a finite number >= 0"),
    "eps tuple length": (_call(eps=(1e-6, 1e-6)), ValueError, r"eps must be a float or a 4-tuple"),
    "eps tuple nan": (_call(eps=(1e-6, float("nan"), 1e-6, 1e-6)), ValueError, r"eps must be a finite number"),
    "eps str": (_call(eps="1e-6"), TypeError, r"eps must be a float"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_inputs_raise(case, monkeypatch):
    from flashflow.ops import norm

    def no_launch(*args, **kwargs):
        raise AssertionError("launched with bad inputs")

    monkeypatch.setattr(norm, "_joint_qkv_norm_rope_impl", no_launch)
    call, error, match = BAD[case]
    with pytest.raises(error, match=match):
        call()


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors only run under the interpreter")
def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"CUDA tensors; got txt_q on cpu"):
        _call()()


@pytest.mark.parametrize("name", ["txt_v", "img_k", "img_q_weight", "txt_freqs"])
def test_requires_grad_is_refused(name):
    args = dict(zip(NAMES, streams(B, S_TXT, S_IMG, H, D)))
    leaf = args[name].detach().clone().requires_grad_()
    with pytest.raises(ValueError, match=rf"joint_qkv_norm_rope: {name} requires grad"):
        joint_qkv_norm_rope(**{**args, name: leaf})


# --------------------------------------------------------------------------------------------
# in place: joint_qkv_norm_rope_ on one (B, S_txt + S_img, 3, H, D) buffer
# --------------------------------------------------------------------------------------------


def joint_buffer(b, s_txt, s_img, h, d, dtype=torch.float32, margin=4):
    """Both streams' q/k/v projections side by side in one buffer, text rows first, as two
    Linear outputs written into it give them; rows padded by ``margin`` columns each side (the
    padding must come back untouched)."""
    full = rand(b, s_txt + s_img, 3 * h * d + 2 * margin, dtype=dtype, seed=11, scale=2.0, offset=0.1)
    return full, full[..., margin:margin + 3 * h * d].unflatten(-1, (3, h, d))


def joint_norms(d, dtype=torch.float32, weighted=True):
    return [rand(d, dtype=dtype, seed=20 + n).abs() + 0.5 for n in range(4)] if weighted else [None] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
@pytest.mark.parametrize("s_txt,s_img", [(5, 9), (0, 7), (6, 0)])
def test_in_place_equals_the_joint_pass_bit_for_bit(dtype, weighted, s_txt, s_img):
    b, h, d = 2, 3, 24
    full, qkv = joint_buffer(b, s_txt, s_img, h, d, dtype)
    before = full.clone()
    q, k, v = qkv.unbind(2)
    weights = joint_norms(d, dtype, weighted)
    freqs = (freqs_of(s_txt, d, seed=7), freqs_of(s_img, d, seed=8))
    want = joint_qkv_norm_rope(q[:, :s_txt], k[:, :s_txt], v[:, :s_txt], q[:, s_txt:], k[:, s_txt:], v[:, s_txt:],
                               *weights, *freqs, eps=EPS4)
    got = joint_qkv_norm_rope_(qkv, s_txt, *weights, *freqs, eps=EPS4)
    for g, w, view in zip(got, want, (q, k, v)):
        assert g.data_ptr() == view.data_ptr() and g.stride() == view.stride()   # views of the buffer
        assert torch.equal(g, w)
    # v and the padding columns are untouched, q and k were written
    margin = (full.shape[-1] - 3 * h * d) // 2
    assert torch.equal(full[..., :margin], before[..., :margin])
    assert torch.equal(full[..., -margin:], before[..., -margin:])
    assert torch.equal(full[..., margin + 2 * h * d:margin + 3 * h * d], before[..., margin + 2 * h * d:margin + 3 * h * d])
    if s_txt + s_img:
        assert not torch.equal(full[..., margin:margin + h * d], before[..., margin:margin + h * d])


def test_in_place_matches_float64():
    b, s_txt, s_img, h, d = 1, 4, 6, 2, 32
    _, qkv = joint_buffer(b, s_txt, s_img, h, d, torch.bfloat16)
    q, k, v = (t.clone() for t in qkv.unbind(2))
    weights = joint_norms(d, torch.bfloat16)
    freqs = (freqs_of(s_txt, d, seed=7), freqs_of(s_img, d, seed=8))
    want = ref.joint_qkv_norm_rope(*d64(q[:, :s_txt], k[:, :s_txt], v[:, :s_txt], q[:, s_txt:], k[:, s_txt:],
                                        v[:, s_txt:], *weights), *freqs, eps=EPS4)
    for got, expected in zip(joint_qkv_norm_rope_(qkv, s_txt, *weights, *freqs, eps=EPS4), want):
        assert err(got, expected) < TOL[torch.bfloat16]


def test_in_place_custom_op_opcheck_and_compile():
    b, s_txt, s_img, h, d = 1, 3, 5, 2, 32
    weights = joint_norms(d)
    freqs = (freqs_of(s_txt, d, seed=7), freqs_of(s_img, d, seed=8))
    _, qkv = joint_buffer(b, s_txt, s_img, h, d)
    torch.library.opcheck(torch.ops.flashflow.joint_qkv_norm_rope_.default,
                          (qkv.contiguous(), s_txt, *weights, *freqs, *EPS4), test_utils=("test_schema", "test_faketensor"))

    def attention_inputs(buf):
        query, key, value = joint_qkv_norm_rope_(buf, s_txt, *weights, *freqs, eps=EPS4)
        return query * 2, key + 1, value

    _, a = joint_buffer(b, s_txt, s_img, h, d)
    _, c = joint_buffer(b, s_txt, s_img, h, d)
    compiled = torch.compile(attention_inputs, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(a), attention_inputs(c)):
        assert torch.equal(got, want)
    assert torch.equal(a, c)   # the mutation reached the caller's buffer under compile too


def _call_in_place(**kw):
    _, qkv = joint_buffer(B, S_TXT, S_IMG, H, D)
    args = dict(qkv=qkv, s_txt=S_TXT, **dict(zip(NAMES[6:10], joint_norms(D))), txt_freqs=freqs_of(S_TXT, D),
                img_freqs=freqs_of(S_IMG, D))
    args.update(kw)
    return lambda: joint_qkv_norm_rope_(**args)


BAD_IN_PLACE = {
    "qkv rank": (_call_in_place(qkv=rand(B, S_TXT + S_IMG, 3 * H, D)), ValueError, r"qkv must have rank 5"),
    "qkv not 3": (_call_in_place(qkv=rand(B, S_TXT + S_IMG, 2, H, D)), ValueError, r"3 at dim 2 \(q, k, v\)"),
    "qkv dtype": (_call_in_place(qkv=rand(B, S_TXT + S_IMG, 3, H, D).double()), TypeError,
                  r"qkv must be float16, bfloat16"),
    "qkv last stride": (_call_in_place(qkv=rand(B, S_TXT + S_IMG, 3, D, H).transpose(3, 4)), ValueError,
                        r"qkv must have unit stride"),
    "qkv expanded": (_call_in_place(qkv=rand(1, S_TXT + S_IMG, 3, H, D).expand(B, -1, -1, -1, -1)), ValueError,
                     r"qkv is written in place: no two of its elements may share an address"),
    "odd head_dim": (_call_in_place(qkv=rand(B, S_TXT + S_IMG, 3, H, 15)), ValueError,
                     r"head_dim \(qkv's last dim\) must be even"),
    "s_txt too large": (_call_in_place(s_txt=S_TXT + S_IMG + 1), ValueError, r"s_txt must be an int in \[0, 8\]"),
    "s_txt bool": (_call_in_place(s_txt=True), ValueError, r"s_txt must be an int"),
    "s_txt float": (_call_in_place(s_txt=3.0), ValueError, r"s_txt must be an int"),
    "txt_freqs rows": (_call_in_place(txt_freqs=freqs_of(S_IMG, D)), ValueError,
                       r"txt_freqs must have shape \(seqlen, head_dim // 2\) = \(3, 8\) \(qkv \(text tokens\)'s"),
    "weights mixed None": (_call_in_place(img_q_weight=None), ValueError, r"all tensors or all None"),
    "eps tuple length": (_call_in_place(eps=(1e-6,)), ValueError, r"eps must be a float or a 4-tuple"),
}


@pytest.mark.parametrize("case", BAD_IN_PLACE, ids=list(BAD_IN_PLACE))
def test_in_place_bad_inputs_raise(case, monkeypatch):
    from flashflow.ops import norm

    def no_launch(*args, **kwargs):
        raise AssertionError("launched with bad inputs")

    monkeypatch.setattr(norm, "_joint_qkv_norm_rope_inplace_impl", no_launch)
    call, error, match = BAD_IN_PLACE[case]
    with pytest.raises(error, match=match):
        call()


def test_in_place_requires_grad_is_refused():
    _, qkv = joint_buffer(B, S_TXT, S_IMG, H, D)
    with pytest.raises(ValueError, match=r"joint_qkv_norm_rope_: qkv requires grad"):
        _call_in_place(qkv=qkv.detach().clone().requires_grad_())()


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_in_place_a_non_finite_value_reaches_its_head_only(bad):
    """A NaN or inf in one (token, head) of q and of k: that head of that token comes out
    non-finite where the joint pass makes it so (the same bits, NaN included), every other value
    equals the clean run's; v, with its own non-finite value, passes through untouched."""
    b, s_txt, s_img, h, d = 1, 3, 6, 2, 16
    weights = joint_norms(d)
    freqs = (freqs_of(s_txt, d, seed=7), freqs_of(s_img, d, seed=8))
    _, clean = joint_buffer(b, s_txt, s_img, h, d)
    _, dirty = joint_buffer(b, s_txt, s_img, h, d)
    value = float(bad)
    dirty[0, 1, 0, 1, 5] = value          # text token 1, q, head 1
    dirty[0, s_txt + 4, 1, 0, 0] = value  # image token 4, k, head 0
    dirty[0, s_txt + 2, 2, 1, 3] = value  # image token 2, v
    v_before = dirty[:, :, 2].clone()
    q, k, v = dirty.unbind(2)
    copy = joint_qkv_norm_rope(q[:, :s_txt], k[:, :s_txt], v[:, :s_txt], q[:, s_txt:], k[:, s_txt:], v[:, s_txt:],
                               *weights, *freqs, eps=EPS4)
    want = joint_qkv_norm_rope_(clean, s_txt, *weights, *freqs, eps=EPS4)
    got = joint_qkv_norm_rope_(dirty, s_txt, *weights, *freqs, eps=EPS4)
    hit_q = torch.zeros_like(got[0], dtype=torch.bool)
    hit_k = hit_q.clone()
    hit_q[0, 1, 1] = True
    hit_k[0, s_txt + 4, 0] = True
    for g, c, w, mask in ((got[0], copy[0], want[0], hit_q), (got[1], copy[1], want[1], hit_k)):
        torch.testing.assert_close(g, c, rtol=0, atol=0, equal_nan=True)
        assert not torch.isfinite(g[mask]).all()
        assert torch.equal(g[~mask], w[~mask])
    torch.testing.assert_close(got[2], v_before, rtol=0, atol=0, equal_nan=True)


def test_in_place_on_a_transposed_buffer():
    """A buffer whose batch and sequence dims are transposed in memory (and whose q/k/v parts
    are the middle of padded rows) gives the joint pass's bits too."""
    b, s_txt, s_img, h, d = 2, 3, 5, 2, 16
    full = rand(s_txt + s_img, b, 3 * h * d + 8, seed=12).transpose(0, 1)
    qkv = full[..., 4:4 + 3 * h * d].unflatten(-1, (3, h, d))
    assert not qkv.is_contiguous() and qkv.stride(0) < qkv.stride(1)
    weights = joint_norms(d)
    freqs = (freqs_of(s_txt, d, seed=7), freqs_of(s_img, d, seed=8))
    q, k, v = qkv.unbind(2)
    want = joint_qkv_norm_rope(q[:, :s_txt], k[:, :s_txt], v[:, :s_txt], q[:, s_txt:], k[:, s_txt:], v[:, s_txt:],
                               *weights, *freqs, eps=EPS4)
    for got, w in zip(joint_qkv_norm_rope_(qkv, s_txt, *weights, *freqs, eps=EPS4), want):
        assert torch.equal(got, w)
