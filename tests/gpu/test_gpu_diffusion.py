"""The diffusion block's fused ops and the diffusers integration on the GPU: bf16/fp16 against
float64 at the Qwen-Image widths, CUDA-graph replay, torch.compile, and the full-width
QwenImageTransformer2DModel (6 blocks, random weights) with ``enable`` against its default."""
import pytest
import torch

from flashflow.ops.norm import (gate_residual, gate_residual_layernorm_modulate, joint_qkv_norm_rope,
                                layernorm_modulate, rmsnorm_rope)
from flashflow.reference import norm as ref

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]


def _freqs(s, d, device="cuda"):
    angles = torch.rand(s, d // 2, device=device, dtype=torch.float32) * 6.3
    return torch.polar(torch.ones_like(angles), angles)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,l,d", [(1, 4352, 3072), (2, 257, 3072), (1, 33, 200)])
def test_layernorm_modulate(gpu, dtype, b, l, d):
    x = torch.randn(b, l, d, device="cuda", dtype=dtype) * 3 + 1
    shift, scale = torch.randn(b, d, device="cuda", dtype=dtype), torch.randn(b, d, device="cuda", dtype=dtype)
    want = ref.layernorm_modulate(x.double(), shift.double(), scale.double(), 1e-6)
    assert gpu.rel(layernorm_modulate(x, shift, scale), want) < gpu.tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm_modulate_index(gpu, dtype):
    b, l, d = 2, 300, 3072
    x = torch.randn(b, l, d, device="cuda", dtype=dtype)
    shift, scale = (torch.randn(2 * b, d, device="cuda", dtype=dtype) for _ in range(2))
    index = (torch.rand(b, l, device="cuda") < 0.5).to(torch.int64)
    want = ref.layernorm_modulate(x.double(), shift.double(), scale.double(), 1e-6, index=index)
    assert gpu.rel(layernorm_modulate(x, shift, scale, index=index), want) < gpu.tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_residual_and_fused_norm(gpu, dtype):
    b, l, d = 1, 4352, 3072
    res, y = torch.randn(b, l, d, device="cuda", dtype=dtype), torch.randn(b, l, d, device="cuda", dtype=dtype)
    gate, shift, scale = (torch.randn(b, d, device="cuda", dtype=dtype) for _ in range(3))
    assert gpu.rel(gate_residual(res, y, gate), ref.gate_residual(res.double(), y.double(), gate.double())) < gpu.tol
    new_res, mod = gate_residual_layernorm_modulate(res, y, gate, shift, scale)
    want_res, want_mod = ref.gate_residual_layernorm_modulate(res.double(), y.double(), gate.double(),
                                                              shift.double(), scale.double(), 1e-6)
    assert gpu.rel(new_res, want_res) < gpu.tol and gpu.rel(mod, want_mod) < gpu.tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s,h,d", [(4096, 24, 128), (256, 24, 128), (37, 3, 64)])
def test_rmsnorm_rope_into_a_joint_buffer(gpu, dtype, s, h, d):
    b, off = 1, 19
    x = torch.randn(b, s, h * d, device="cuda", dtype=dtype).unflatten(-1, (h, d))   # a Linear's output
    w = torch.rand(d, device="cuda", dtype=dtype) + 0.5
    freqs = _freqs(s, d)
    joint = torch.full((b, s + 2 * off, h, d), float("nan"), device="cuda", dtype=dtype)
    rmsnorm_rope(x, w, freqs, out=joint[:, off:off + s])
    want = ref.rmsnorm_rope(x.double(), w.double(), freqs, 1e-6)
    assert gpu.rel(joint[:, off:off + s], want) < gpu.tol
    assert joint[:, :off].isnan().all() and joint[:, off + s:].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s_txt,s_img,h,d", [(256, 4096, 24, 128), (37, 301, 3, 64)])
def test_joint_qkv_norm_rope(gpu, monkeypatch, dtype, s_txt, s_img, h, d):
    b = 1
    # each stream's q, k, v: views of one (B, S, 3·H·D) projection, as the Linear outputs give them
    txt = torch.randn(b, s_txt, 3 * h * d, device="cuda", dtype=dtype).unflatten(-1, (3 * h, d)).split(h, dim=2)
    img = torch.randn(b, s_img, 3 * h * d, device="cuda", dtype=dtype).unflatten(-1, (3 * h, d)).split(h, dim=2)
    weights = [torch.rand(d, device="cuda", dtype=dtype) + 0.5 for _ in range(4)]
    freqs = [_freqs(s_txt, d), _freqs(s_img, d)]
    eps = (1e-6, 1e-5, 1e-6, 1e-5)
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    # the outputs are allocated inside the op: NaN-filled, so an element never written shows
    monkeypatch.setattr(torch, "empty", nan_empty)
    query, key, value = joint_qkv_norm_rope(*txt, *img, *weights, *freqs, eps=eps)
    monkeypatch.undo()
    want = ref.joint_qkv_norm_rope(*(t.double() for t in (*txt, *img, *weights)), *freqs, eps=eps)
    for got, expected in zip((query, key, value), want):
        assert got.shape == (b, s_txt + s_img, h, d) and got.dtype == dtype
        assert gpu.rel(got, expected) < gpu.tol
    # the same bits as the four rmsnorm_rope passes and the torch.cat it replaces
    assert torch.equal(query, torch.cat([rmsnorm_rope(txt[0], weights[0], freqs[0], eps[0]),
                                         rmsnorm_rope(img[0], weights[2], freqs[1], eps[2])], 1))
    assert torch.equal(key, torch.cat([rmsnorm_rope(txt[1], weights[1], freqs[0], eps[1]),
                                       rmsnorm_rope(img[1], weights[3], freqs[1], eps[3])], 1))
    assert torch.equal(value, torch.cat([txt[2], img[2]], 1))


def test_graph_replay_and_compile(gpu):
    b, l, d = 1, 1024, 3072
    x = torch.randn(b, l, d, device="cuda", dtype=torch.bfloat16)
    shift, scale = (torch.randn(b, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    worst = gpu.worst_over_replays(lambda: layernorm_modulate(x, shift, scale), x,
                                   lambda x: ref.layernorm_modulate(x.double(), shift.double(), scale.double(), 1e-6))
    assert worst < gpu.tol
    compiled = torch.compile(lambda x: layernorm_modulate(x, shift, scale) * 2, fullgraph=False)
    want = ref.layernorm_modulate(x.double(), shift.double(), scale.double(), 1e-6) * 2
    assert gpu.rel(compiled(x), want) < gpu.tol


# --------------------------------------------------------------------------- the full-width model


def _qwen_inputs(model, images, txt=256, valid=None, dtype=torch.bfloat16):
    cfg = model.config
    side = 64   # 1024 px: 64 x 64 latent patches per image
    img = torch.randn(1, images * side * side, cfg.in_channels, device="cuda", dtype=dtype)
    enc = torch.randn(1, txt, cfg.joint_attention_dim, device="cuda", dtype=dtype)
    mask = None
    if valid is not None:
        mask = torch.zeros(1, txt, dtype=torch.bool, device="cuda")
        mask[:, :valid] = True
    kwargs = dict(hidden_states=img, encoder_hidden_states=enc, encoder_hidden_states_mask=mask,
                  timestep=torch.full((1,), 0.5, device="cuda", dtype=dtype),
                  img_shapes=[[(1, side, side)] * images], return_dict=False)
    return kwargs


@pytest.mark.parametrize("images,valid", [(1, None), (2, 200)], ids=["qwen-image", "edit-padded"])
def test_full_width_model_with_enable(gpu, images, valid):
    diffusers = pytest.importorskip("diffusers")
    from flashflow.integrations.diffusers import disable, enable

    torch.manual_seed(0)
    model = diffusers.QwenImageTransformer2DModel(num_layers=6).to("cuda", torch.bfloat16).eval()
    kwargs = _qwen_inputs(model, images, valid=valid)
    with torch.inference_mode():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        want = model(**kwargs)[0].float()
        peak_default = torch.cuda.max_memory_allocated() - base
        enable(model)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        got = model(**kwargs)[0].float()
        peak_ours = torch.cuda.max_memory_allocated() - base
        disable(model)
        again = model(**kwargs)[0].float()
    assert gpu.rel(got, want) < 1e-2
    assert peak_ours <= peak_default, (peak_ours, peak_default)
    assert gpu.rel(again, want) < 1e-6   # the original processors and forwards are back
