"""flashflow.integrations.diffusers on a tiny Qwen-Image transformer (random weights, CPU,
Triton's interpreter): enable matches the model's own forward (one and two images, with and
without text padding, zero_cond_t; exact attention and FP8 attention), disable gives back the
exact original, and the refusals (autograd, diffusers' context parallelism: in one process and
on two gloo ranks)."""
import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

diffusers = pytest.importorskip("diffusers")

import flashflow.integrations.diffusers as ffd  # noqa: E402
from flashflow.integrations.diffusers import FlashflowQwenAttnProcessor, disable, enable, is_enabled  # noqa: E402
from flashflow.reference.metrics import cosine  # noqa: E402
from flashflow.reference.metrics import rel_l2  # noqa: E402

TOL = {torch.float32: 1e-3, torch.float16: 2e-2}
TXT = 7
IMAGE = (1, 4, 6)   # (frames, height, width) in latent patches


# FP8 attention takes head_dim 64, 128 or 256: the FP8 tests build heads of 64
HEAD_DIM_64 = dict(attention_head_dim=64, axes_dims_rope=(16, 24, 24))


def tiny_model(dtype=torch.float32, zero_cond_t=False, seed=0, **config):
    torch.manual_seed(seed)
    config = {"attention_head_dim": 32, "axes_dims_rope": (8, 12, 12), "num_attention_heads": 2, **config}
    model = diffusers.QwenImageTransformer2DModel(
        num_layers=2, joint_attention_dim=48, in_channels=16, out_channels=4, zero_cond_t=zero_cond_t, **config)
    with torch.no_grad():   # the RMSNorm weights start at 1: make them count
        for name, p in model.named_parameters():
            if name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
                p.uniform_(0.5, 1.5)
    return model.to(dtype).eval()


def inputs(images, padded, dtype=torch.float32, batch=2, seed=1):
    """As the Qwen-Image (Edit) pipelines call the transformer: the latents of the generated
    image first, then those of the reference image(s); the prompt's padding mask, or None when
    every prompt token is real (the pipelines pass None then)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [IMAGE] * images
    seq_img = sum(f * h * w for f, h, w in shapes)
    mask = None
    if padded:
        mask = torch.ones(batch, TXT, dtype=torch.bool)
        mask[-1, TXT - 3:] = False   # the last prompt is 3 tokens shorter
    return dict(hidden_states=torch.randn(batch, seq_img, 16, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, TXT, 48, generator=g).to(dtype),
                encoder_hidden_states_mask=mask,
                timestep=torch.full((batch,), 0.4).to(dtype),
                img_shapes=[shapes] * batch, return_dict=False)


def run(model, kwargs):
    with torch.inference_mode():
        return model(**kwargs)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padded"])
@pytest.mark.parametrize("images", [1, 2], ids=["one-image", "two-images"])
def test_enable_matches_the_original(images, padded, dtype):
    model = tiny_model(dtype)
    kwargs = inputs(images, padded, dtype)
    want = run(model, kwargs)
    enable(model)
    got = run(model, kwargs)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    assert rel_l2(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_zero_cond_t_modulate_index(dtype):
    """Edit-2511-style models modulate the reference image's tokens with the t=0 parameters."""
    model = tiny_model(dtype, zero_cond_t=True)
    kwargs = inputs(2, True, dtype)
    want = run(model, kwargs)
    enable(model)
    assert rel_l2(run(model, kwargs), want) < TOL[dtype]


def test_the_padding_mask_is_applied():
    """The padded case above can fail: masking the last prompt's tail changes that sample only."""
    model = enable(tiny_model())
    masked, unmasked = inputs(1, True), inputs(1, False)
    a, b = run(model, masked), run(model, unmasked)
    assert torch.allclose(a[0], b[0], rtol=1e-5, atol=1e-6)
    assert rel_l2(a[1], b[1]) > 1e-3


def test_attention_gets_a_key_padding_mask_never_a_dense_one(monkeypatch):
    # the text mask alone, (batch, text_seqlen): it covers the text keys, which come first in
    # the joint sequence; the image keys are never masked and no (.., S) or S×S mask is built
    seen = []
    real_fa = ffd.flash_attn_func

    def fa(q, k, v, **kw):
        mask = kw.get("key_padding_mask")
        seen.append(("flash", tuple(q.shape), None if mask is None else (tuple(mask.shape), mask.dtype)))
        return real_fa(q, k, v, **kw)

    monkeypatch.setattr(ffd, "flash_attn_func", fa)
    model = enable(tiny_model())
    seq = TXT + 2 * IMAGE[0] * IMAGE[1] * IMAGE[2]
    run(model, inputs(2, True))
    assert seen == [("flash", (2, seq, 2, 32), ((2, TXT), torch.bool))] * 2
    seen.clear()
    run(model, inputs(2, False))
    assert seen == [("flash", (2, seq, 2, 32), None)] * 2


def test_enabled_model_under_torch_compile():
    """torch.compile traces the swapped forward and processor (flashflow's ops are custom ops);
    the eager backend keeps the interpreter run short."""
    model = tiny_model()
    kwargs = inputs(2, True)
    want = run(model, kwargs)
    compiled = torch.compile(enable(model), backend="eager", dynamic=False)
    with torch.no_grad():
        got = compiled(**kwargs)[0]
    assert rel_l2(got, want) < TOL[torch.float32]


def test_without_rotary_embedding():
    """A block called with image_rotary_emb=None: q/k get RMSNorm only, as in diffusers."""
    model = tiny_model()
    block = model.transformer_blocks[0]
    g = torch.Generator().manual_seed(3)
    args = dict(hidden_states=torch.randn(2, 24, 64, generator=g),
                encoder_hidden_states=torch.randn(2, TXT, 64, generator=g),
                encoder_hidden_states_mask=None, temb=torch.randn(2, 64, generator=g), image_rotary_emb=None)
    with torch.inference_mode():
        want = block(**args)
        enable(model)
        got = block(**args)
    for g_, w_ in zip(got, want):
        assert rel_l2(g_, w_) < 1e-3


def test_text_mask_of_the_wrong_shape_is_refused():
    attn = enable(tiny_model()).transformer_blocks[0].attn
    g = torch.Generator().manual_seed(4)
    img, txt = torch.randn(2, 24, 64, generator=g), torch.randn(2, TXT, 64, generator=g)
    for bad in (torch.ones(2, TXT + 1, dtype=torch.bool), torch.ones(1, TXT, dtype=torch.bool)):
        with pytest.raises(ValueError, match=rf"encoder_hidden_states_mask must be \(batch, text_seqlen\) = "
                                             rf"\(2, {TXT}\), got shape \({bad.shape[0]}, {bad.shape[1]}\)"):
            with torch.inference_mode():
                attn.processor(attn, img, txt, encoder_hidden_states_mask=bad)


def test_disable_restores_the_exact_original():
    model = tiny_model()
    kwargs = inputs(2, True)
    processors = [b.attn.processor for b in model.transformer_blocks]
    want = run(model, kwargs)
    enable(model)
    assert is_enabled(model)
    assert all(isinstance(b.attn.processor, FlashflowQwenAttnProcessor) for b in model.transformer_blocks)
    assert not torch.equal(run(model, kwargs), want)   # the flashflow path really ran
    assert disable(model) is model
    assert not is_enabled(model)
    assert all(b.attn.processor is p for b, p in zip(model.transformer_blocks, processors))
    assert all("forward" not in b.__dict__ for b in model.transformer_blocks)
    assert torch.equal(run(model, kwargs), want)


def test_enable_twice_and_disable_twice_are_harmless():
    model = tiny_model()
    kwargs = inputs(1, False)
    want = run(model, kwargs)
    assert enable(model) is model
    once = run(model, kwargs)
    processors = [b.attn.processor for b in model.transformer_blocks]
    enable(model)
    assert all(b.attn.processor is p for b, p in zip(model.transformer_blocks, processors))
    assert torch.equal(run(model, kwargs), once)
    disable(model)
    disable(model)
    assert torch.equal(run(model, kwargs), want)


def test_disable_on_a_model_never_enabled_is_a_no_op():
    model = tiny_model()
    kwargs = inputs(1, False)
    want = run(model, kwargs)
    processors = [b.attn.processor for b in model.transformer_blocks]
    disable(model)
    assert all(b.attn.processor is p for b, p in zip(model.transformer_blocks, processors))
    assert torch.equal(run(model, kwargs), want)


def test_refusals():
    model = tiny_model()
    with pytest.raises(TypeError, match="QwenImageTransformer2DModel"):
        enable(nn.Linear(4, 4).eval())
    with pytest.raises(TypeError, match="QwenImageTransformer2DModel"):
        disable(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"one of \('exact', 'fp8'\), got 'int8'"):
        enable(model, attention="int8")
    with pytest.raises(ValueError, match=r"one of \('exact', 'fp8'\), got 'FP8'"):
        enable(model, attention="FP8")
    for refused in (lambda: enable(model, attention="bf16"), lambda: FlashflowQwenAttnProcessor(attention="bf16")):
        with pytest.raises(ValueError, match=r"attention must be one of \('exact', 'fp8'\), got 'bf16': exact "
                                             r"attention in the model's own dtype .* is attention='exact'"):
            refused()
    with pytest.raises(TypeError, match="attention must be a str"):
        enable(model, attention=None)
    model.train()
    with pytest.raises(ValueError, match="eval"):
        enable(model)
    model.eval()
    model.transformer_blocks[1].attn.set_processor(diffusers.models.attention_processor.AttnProcessor2_0())
    with pytest.raises(ValueError, match=r"transformer_blocks\[1\].attn.processor is AttnProcessor2_0"):
        enable(model)
    # every refusal above left the model untouched
    assert not any(isinstance(b.attn.processor, FlashflowQwenAttnProcessor) for b in model.transformer_blocks)
    assert all("forward" not in b.__dict__ for b in model.transformer_blocks)


# ---------------------------------------------------------------------------- FP8 linear layers

LINEAR_PATHS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                "attn.to_add_out", "attn.to_out.0", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                "txt_mlp.net.2", "img_mod.1", "txt_mod.1")


def peaked(model):
    """q/k RMSNorm weights ×3: peaked attention, so a wrong attention input shows in the output
    (random weights otherwise make attention near uniform)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
                p.mul_(3.0)
    return model


def block_outputs(model, kwargs):
    """Each block's image-stream output, from forward hooks."""
    outs = []
    hooks = [b.register_forward_hook(lambda m, a, o: outs.append(o[1].detach().clone()))
             for b in model.transformer_blocks]
    try:
        final = run(model, kwargs)
    finally:
        for h in hooks:
            h.remove()
    return outs, final


def module_at(block, path):
    m = block
    for part in path.split("."):
        m = m._modules[part]
    return m


def test_fp8_linear_matches_the_original_per_block():
    model = peaked(tiny_model(torch.float16))
    kwargs = inputs(2, True, torch.float16)
    want_blocks, want = block_outputs(model, kwargs)
    exact_blocks, exact = block_outputs(enable(model), kwargs)
    enable(model, linear="fp8")
    got_blocks, got = block_outputs(model, kwargs)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.isfinite(got).all()
    for i, (g, w) in enumerate(zip(got_blocks, want_blocks)):
        assert cosine(g, w) > 0.995, f"block {i}: cosine {cosine(g, w)}"
    assert cosine(got, want) > 0.995
    assert rel_l2(exact, want) < rel_l2(got, want)   # the 8-bit products do change the output


def test_fp8_linear_replaces_every_linear_and_disable_restores_them_bit_exactly(monkeypatch):
    model = peaked(tiny_model(torch.float16))
    kwargs = inputs(1, True, torch.float16)
    want = run(model, kwargs)
    before = {n: (p.clone(), p.device, p.dtype) for n, p in model.named_parameters()}
    modules = {i: {path: module_at(b, path) for path in LINEAR_PATHS} for i, b in enumerate(model.transformer_blocks)}
    calls = []
    real_norm = ffd.layernorm_modulate

    def norm(*a, **kw):
        calls.append(kw.get("fp8"))
        return real_norm(*a, **kw)

    monkeypatch.setattr(ffd, "layernorm_modulate", norm)
    enable(model, linear="fp8")
    for block in model.transformer_blocks:
        for path in LINEAR_PATHS:
            layer = module_at(block, path)
            assert isinstance(layer, ffd.Fp8Linear), path
            assert layer.weight.dtype == torch.float8_e4m3fn
        for fused in (ffd._QKV, ffd._ADD_QKV):   # q, k, v: views of one fused weight
            assert isinstance(block.attn._modules[fused], ffd.Fp8Linear)
        assert block.attn.to_k.weight.data_ptr() == (block.attn._modules[ffd._QKV].weight.data_ptr()
                                                     + block.attn.to_q.weight.numel())
        assert not any(type(m) is nn.Linear for m in block.modules())
    run(model, kwargs)
    assert calls and all(c is True for c in calls)   # the norms wrote the GEMMs' inputs in e4m3
    monkeypatch.setattr(ffd, "layernorm_modulate", real_norm)
    disable(model)
    for i, block in enumerate(model.transformer_blocks):
        for path in LINEAR_PATHS:
            assert module_at(block, path) is modules[i][path]
        assert ffd._QKV not in block.attn._modules and ffd._ADD_QKV not in block.attn._modules
    after = dict(model.named_parameters())
    assert set(after) == set(before)
    for name, (value, device, dtype) in before.items():
        assert after[name].device == device and after[name].dtype == dtype and torch.equal(after[name], value), name
    assert torch.equal(run(model, kwargs), want)


def test_fp8_linear_switches_with_enable_and_combines_with_fp8_attention():
    model = peaked(tiny_model(torch.float16, **HEAD_DIM_64))
    kwargs = inputs(2, True, torch.float16)
    want = run(model, kwargs)
    exact = run(enable(model), kwargs)
    lin = run(enable(model, linear="fp8"), kwargs)
    assert torch.equal(run(enable(model, linear="exact"), kwargs), exact)   # and back, bit-exactly
    assert torch.equal(run(enable(model, linear="fp8"), kwargs), lin)
    both = run(enable(model, attention="fp8", linear="fp8"), kwargs)
    assert torch.isfinite(both).all() and cosine(both, want) > 0.99
    assert not torch.equal(both, lin)
    disable(model)
    assert torch.equal(run(model, kwargs), want)


@pytest.mark.parametrize("attention", ["exact", "fp8"])
def test_fp8_linear_one_prompt_writes_both_streams_into_one_joint_buffer(attention, monkeypatch):
    """With one prompt (batch 1) the two streams' q/k/v GEMMs write into one joint buffer and q,
    k are normalised there in place (joint_qkv_norm_rope_, no copy of v); the output equals,
    bit for bit, that sample's output in a batch of two, which takes the path with the joint
    copy (joint_qkv_norm_rope)."""
    model = enable(peaked(tiny_model(torch.float16, **HEAD_DIM_64)), attention=attention, linear="fp8")
    kwargs = inputs(2, False, torch.float16)
    calls = {"in place": 0, "copy": 0}
    in_place, copy = ffd.joint_qkv_norm_rope_, ffd.joint_qkv_norm_rope

    def count(name, fn):
        def call(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return call

    monkeypatch.setattr(ffd, "joint_qkv_norm_rope_", count("in place", in_place))
    monkeypatch.setattr(ffd, "joint_qkv_norm_rope", count("copy", copy))
    both = run(model, kwargs)
    assert calls == {"in place": 0, "copy": 2}
    one = {k: (v[:1] if isinstance(v, torch.Tensor) else v[:1] if k == "img_shapes" else v) for k, v in kwargs.items()}
    got = run(model, one)
    assert calls == {"in place": 2, "copy": 2}
    assert torch.isfinite(got).all() and torch.equal(got, both[:1])


def test_fp8_linear_under_torch_compile():
    model = peaked(tiny_model(torch.float16))
    kwargs = inputs(2, False, torch.float16)
    eager = run(enable(model, linear="fp8"), kwargs)
    compiled = torch.compile(model, backend="eager", dynamic=False)
    with torch.no_grad():
        got = compiled(**kwargs)[0]
    assert torch.equal(got, eager)


@pytest.mark.parametrize("batch", [1, 2], ids=["joint-buffer", "batch-2"])
@pytest.mark.parametrize("attention", ["exact", "fp8"])
def test_an_fp8_linear_block_traces_as_one_graph(attention, batch):
    """torch.compile sees a whole enabled block, FP8 layers included, without a graph break
    (with one prompt the q/k/v GEMMs write into the joint buffer through ``out=``)."""
    model = enable(peaked(tiny_model(torch.float16, **HEAD_DIM_64)), attention=attention, linear="fp8")
    block = model.transformer_blocks[0]
    captured = {}
    hook = block.register_forward_pre_hook(lambda m, a, kw: captured.update(args=a, kwargs=kw), with_kwargs=True)
    run(model, inputs(1, False, torch.float16, batch=batch))
    hook.remove()
    with torch.no_grad():
        explained = torch._dynamo.explain(block)(*captured["args"], **captured["kwargs"])
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


class _QuantizedWeight(torch.Tensor):
    """Stands for a weight quantized by another library (torchao's Float8Tensor is a tensor subclass)."""


def test_fp8_linear_refusals_leave_the_model_as_it_was():
    model = tiny_model(torch.float16)
    kwargs = inputs(1, False, torch.float16)
    want = run(model, kwargs)
    with pytest.raises(ValueError, match="linear must be one of .*got 'bf16'.*linear='exact'"):
        enable(model, linear="bf16")
    with pytest.raises(TypeError, match="linear must be a str"):
        enable(model, linear=None)
    with pytest.raises(ValueError, match="linear must be one of"):
        enable(model, linear="int8")
    with pytest.raises(ValueError, match=r"linear='fp8' needs a bfloat16 or float16 model, got a torch.float32"):
        enable(tiny_model(torch.float32), linear="fp8")
    block = model.transformer_blocks[1]
    original = block.img_mlp.net[2].weight
    block.img_mlp.net[2].weight = nn.Parameter(original.detach().as_subclass(_QuantizedWeight), requires_grad=False)
    with pytest.raises(ValueError, match=r"transformer_blocks\[1\].img_mlp.net.2.weight is a _QuantizedWeight.*torchao"):
        enable(model, linear="fp8")
    assert not is_enabled(model)
    assert not any(isinstance(m, ffd.Fp8Linear) for m in model.modules())
    block.img_mlp.net[2].weight = original
    assert torch.equal(run(model, kwargs), want)
    with torch.no_grad():
        block.txt_mod[1].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"transformer_blocks\[1\].txt_mod.1.weight holds a NaN"):
        enable(model, linear="fp8")
    assert not any(isinstance(m, ffd.Fp8Linear) for m in model.modules())


def test_the_model_own_linears_run_where_another_library_quantized_them():
    """linear='exact' keeps whatever the Linear layers are: a weight of a tensor subclass is not
    handed to the fused GELU epilogue (which would need the plain weight), the module runs it."""
    block = tiny_model(torch.float16).transformer_blocks[0]
    proj = block.img_mlp.net[0].proj
    proj.weight = nn.Parameter(proj.weight.detach().as_subclass(_QuantizedWeight), requires_grad=False)
    x = torch.randn(1, 3, 64, dtype=torch.float16)
    with torch.no_grad():
        assert torch.equal(ffd._feed_forward(block.img_mlp, x), block.img_mlp(x))


# ---------------------------------------------------------------------------- FP8 attention


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padded"])
def test_fp8_attention_matches_the_original(padded, monkeypatch):
    """attention="fp8" runs flash_attn_fp8_func (with the text mask as its key_padding_mask) and
    stays within FP8 attention's error of the model's own output; exact attention does better."""
    calls = []
    real_fp8 = ffd.flash_attn_fp8_func

    def fp8(q, k, v, **kw):
        mask = kw.get("key_padding_mask")
        calls.append((tuple(q.shape), q.dtype, None if mask is None else tuple(mask.shape)))
        return real_fp8(q, k, v, **kw)

    monkeypatch.setattr(ffd, "flash_attn_fp8_func", fp8)
    model = tiny_model(torch.float16, **HEAD_DIM_64)
    kwargs = inputs(2, padded, torch.float16)
    want = run(model, kwargs)
    exact = run(enable(model), kwargs)
    assert calls == []
    enable(model, attention="fp8")
    assert calls == [((1, 0, 2, 64), torch.float16, None)]   # enable's probe of the device: empty tensors
    calls.clear()
    got = run(model, kwargs)
    seq = TXT + 2 * IMAGE[0] * IMAGE[1] * IMAGE[2]
    assert calls == [((2, seq, 2, 64), torch.float16, (2, TXT) if padded else None)] * 2
    assert got.dtype == want.dtype and got.shape == want.shape and torch.isfinite(got).all()
    assert cosine(got, want) > 0.99
    assert rel_l2(exact, want) < rel_l2(got, want)   # the 8-bit products do change the output


def test_fp8_attention_applies_the_padding_mask():
    model = enable(tiny_model(torch.float16, **HEAD_DIM_64), attention="fp8")
    masked, unmasked = inputs(1, True, torch.float16), inputs(1, False, torch.float16)
    a, b = run(model, masked), run(model, unmasked)
    assert rel_l2(a[0], b[0]) < 1e-3    # the first prompt is not padded: up to rounding, the same
    assert rel_l2(a[1], b[1]) > 2e-3    # the last one is: 3 of its 7 text keys masked


def test_attention_mode_switches_and_disable_restores():
    model = tiny_model(torch.float16, **HEAD_DIM_64)
    kwargs = inputs(1, True, torch.float16)
    processors = [b.attn.processor for b in model.transformer_blocks]
    want = run(model, kwargs)
    exact = run(enable(model, attention="exact"), kwargs)
    ours = [b.attn.processor for b in model.transformer_blocks]
    fp8 = run(enable(model, attention="fp8"), kwargs)
    assert [b.attn.processor for b in model.transformer_blocks] == ours   # switched in place
    assert all(p.attention == "fp8" for p in ours) and is_enabled(model)
    assert not torch.equal(fp8, exact)
    assert torch.equal(run(enable(model), kwargs), exact)   # and back
    assert all(p.attention == "exact" for p in ours)
    enable(model, attention="fp8")
    disable(model)
    assert all(b.attn.processor is p for b, p in zip(model.transformer_blocks, processors))
    assert torch.equal(run(model, kwargs), want)


def test_fp8_attention_under_torch_compile():
    model = tiny_model(torch.float16, **HEAD_DIM_64)
    kwargs = inputs(2, True, torch.float16)
    want = run(model, kwargs)
    eager = run(enable(model, attention="fp8"), kwargs)
    compiled = torch.compile(model, backend="eager", dynamic=False)
    with torch.no_grad():
        got = compiled(**kwargs)[0]
    assert rel_l2(got, eager) < 1e-3 and cosine(got, want) > 0.99


def test_fp8_attention_refuses_a_fp32_model_before_changing_it():
    model = tiny_model(torch.float32, **HEAD_DIM_64)
    with pytest.raises(ValueError, match=r"attention='fp8' needs a bfloat16 or float16 model .*torch.float32"):
        enable(model, attention="fp8")
    assert not any(isinstance(b.attn.processor, FlashflowQwenAttnProcessor) for b in model.transformer_blocks)
    enable(model)   # an enabled fp32 model is refused too, and keeps exact attention
    with pytest.raises(ValueError, match="bfloat16 or float16 model"):
        enable(model, attention="fp8")
    assert all(b.attn.processor.attention == "exact" for b in model.transformer_blocks)


def test_fp8_attention_refuses_a_head_dim_it_has_no_kernel_for():
    model = tiny_model(torch.float16)   # heads of 32
    with pytest.raises(ValueError, match=r"head_dim in \(64, 128, 256\); transformer_blocks\[0\] has head_dim 32"):
        enable(model, attention="fp8")
    assert not is_enabled(model)


def test_fp8_attention_gives_the_ops_error_where_it_cannot_run(monkeypatch):
    """enable() probes the device with the op itself (empty tensors, nothing launched): a GPU
    without FP8 tensor cores is refused there, with the op's message."""
    seen = []

    def no_fp8(q, k, v, **kw):
        seen.append((tuple(q.shape), q.dtype, q.device.type))
        raise ValueError("FP8 attention needs FP8 tensor cores (Hopper, sm90, or newer); cuda:0 is sm80.")

    monkeypatch.setattr(ffd, "flash_attn_fp8_func", no_fp8)
    model = tiny_model(torch.bfloat16, **HEAD_DIM_64)
    with pytest.raises(ValueError, match=r"attention='fp8' cannot run on cpu: FP8 attention needs FP8 tensor "
                                         r"cores .*attention='exact'"):
        enable(model, attention="fp8")
    assert seen == [((1, 0, 2, 64), torch.bfloat16, "cpu")]
    assert not is_enabled(model)


NO_BACKWARD = (r"autograd recording, and {what}; flashflow's diffusion ops .* have no backward\. Run the model "
               r"under torch\.no_grad\(\) or torch\.inference_mode\(\) .*{fix}.*to train, call "
               r"flashflow\.integrations\.diffusers\.disable\(transformer\) first")


def test_autograd_is_refused_with_what_to_do():
    """No backward: a freshly built model (parameters that require grad) run outside no_grad raises
    one ValueError at the first block's entry that says what to do, not an op's message about a
    tensor inside the block; its result would have had a wrong gradient."""
    model = enable(tiny_model())
    kwargs = inputs(1, False)
    with pytest.raises(ValueError, match=NO_BACKWARD.format(what=r"the transformer's parameters require grad "
                                                                 r"\(the block's \S+, among others\)",
                                                            fix=r"transformer\.requires_grad_\(False\)")):
        model(**kwargs)
    attn = model.transformer_blocks[0].attn   # the processor called alone says the same
    g = torch.Generator().manual_seed(4)
    img, txt = torch.randn(2, 24, 64, generator=g), torch.randn(2, TXT, 64, generator=g)
    with pytest.raises(ValueError, match=NO_BACKWARD.format(what=r"the transformer's parameters require grad "
                                                                 r"\(the attention module's \S+, among others\)",
                                                            fix="requires_grad_")):
        attn.processor(attn, img, txt)


def test_autograd_with_a_frozen_model_runs_and_inputs_that_require_grad_are_refused(monkeypatch):
    """A frozen model runs with grad mode on (the same output as under inference_mode); an input
    that requires grad is named. The check is one look per block and per processor call, only while
    autograd records: none under no_grad / inference_mode."""
    model = enable(tiny_model()).requires_grad_(False)
    kwargs = inputs(1, True, batch=1)
    looks, refuse = [], ffd._refuse_autograd
    monkeypatch.setattr(ffd, "_refuse_autograd", lambda module, where, **kw: looks.append(where) or
                        refuse(module, where, **kw))
    with torch.no_grad():   # as the pipelines run it
        want = model(**kwargs)[0]
    assert looks == []
    assert torch.equal(model(**kwargs)[0], want)
    assert looks == ["the block", "the attention module"] * 2
    block = model.transformer_blocks[0]
    g = torch.Generator().manual_seed(3)
    args = dict(hidden_states=torch.randn(2, 24, 64, generator=g).requires_grad_(),
                encoder_hidden_states=torch.randn(2, TXT, 64, generator=g), encoder_hidden_states_mask=None,
                temb=torch.randn(2, 64, generator=g), image_rotary_emb=None)
    with pytest.raises(ValueError, match=NO_BACKWARD.format(what="the block's input hidden_states requires grad",
                                                            fix=r"\.detach\(\)")):
        block(**args)


def test_feed_forward_on_the_cpu_is_the_module_itself():
    ff = tiny_model().transformer_blocks[0].img_mlp
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        assert torch.equal(ffd._feed_forward(ff, x), ff(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_fused_gelu_epilogue_is_gelu_tanh(dtype, monkeypatch):
    """cuBLASLt's bias + GELU epilogue against Linear then F.gelu(approximate="tanh")."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    calls, fused = [], torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation", lambda *a, **kw: calls.append(kw) or fused(*a, **kw))
    ff = tiny_model().transformer_blocks[0].img_mlp.to("cuda", dtype)
    x = torch.randn(3, 77, 64, device="cuda", dtype=dtype)
    proj = ff.net[0].proj
    with torch.inference_mode():
        want = ff.net[2](torch.nn.functional.gelu(proj(x).float(), approximate="tanh").to(dtype))
        got = ffd._feed_forward(ff, x)
    assert calls == [{"use_gelu": True}]   # the epilogue path ran, not the module's
    assert rel_l2(got, want) < (1e-4 if dtype == torch.float32 else 1e-2)


# ------------------------------------------------------------------- diffusers' context parallelism


def cp_config(degrees):
    """A ParallelConfig as diffusers' enable_parallelism builds it (diffusers' own types)."""
    return diffusers.ParallelConfig(context_parallel_config=diffusers.ContextParallelConfig(**degrees))


def set_processors_config(model, config):
    """What diffusers 0.42.1's enable_parallelism does to the processors (ModelMixin.enable_parallelism):
    records the config on the model, then hands it to every attention processor that has a
    `_parallel_config` attribute. enable_parallelism itself cannot run in one process:
    ContextParallelConfig's setup refuses degrees above the world size; the gloo tests below run
    the real call."""
    model._parallel_config = config
    attention_classes = (diffusers.models.attention_processor.Attention,
                         diffusers.models.attention_processor.MochiAttention,
                         diffusers.models.attention.AttentionModuleMixin)   # enable_parallelism's own list
    for module in model.modules():
        if isinstance(module, attention_classes):
            processor = module.processor
            if processor is not None and hasattr(processor, "_parallel_config"):
                processor._parallel_config = config


@pytest.mark.parametrize("degrees, match", [
    (dict(ulysses_degree=2, ulysses_anything=True), r"ulysses_anything=True\).*equal sequence slices only"),
    (dict(ring_degree=2, ring_anything=True), r"ring_anything=True\).*equal sequence slices only"),
    (dict(ulysses_degree=4), r"the model's 2 heads are not a multiple of ulysses_degree=4"),
], ids=["ulysses-anything", "ring-anything", "heads"])
def test_a_context_parallel_config_the_processor_cannot_run_is_refused(degrees, match):
    """enable, then enable_parallelism with a config flashflow cannot run: refused where diffusers
    hands the processors its config (before its hooks split the sequence), and at a run after
    that; disable gives back a working model on which enable_parallelism can be called again. In
    the other order, enable refuses the model and leaves it untouched."""
    model = tiny_model()
    kwargs = inputs(1, False)
    want = run(model, kwargs)
    enable(model)
    config = cp_config(degrees)
    with pytest.raises(ValueError, match=match):
        set_processors_config(model, config)
    with pytest.raises(ValueError, match=match):   # and a model run after the refusal
        run(model, kwargs)
    disable(model)
    assert model._parallel_config is None   # enable_parallelism may be called again
    assert torch.equal(run(model, kwargs), want)

    other = tiny_model()
    other._parallel_config = config
    with pytest.raises(ValueError, match=match):
        enable(other)
    assert not any(isinstance(b.attn.processor, FlashflowQwenAttnProcessor) for b in other.transformer_blocks)
    assert all("forward" not in b.__dict__ for b in other.transformer_blocks)


def test_tensor_parallelism_is_refused_both_ways():
    """diffusers 0.42 shards Qwen-Image's Linears across ranks (its _tp_plan); flashflow's fused
    block ops read those weights themselves and were never checked on shards: refused when
    enable_parallelism hands the processors the config, at a call after that, and by enable on a
    model that already runs it (diffusers' own config types, as for context parallelism)."""
    config = diffusers.ParallelConfig(tensor_parallel_config=diffusers.TensorParallelConfig(tp_degree=2))
    model = enable(tiny_model())
    processor = model.transformer_blocks[0].attn.processor
    with pytest.raises(ValueError, match=r"tensor parallelism \(TensorParallelConfig.*refused"):
        processor._parallel_config = config        # what enable_parallelism does to each processor
    with pytest.raises(ValueError, match="tensor parallelism"):
        run(model, inputs(1, False, batch=1))
    other = tiny_model()
    other._parallel_config = config
    with pytest.raises(ValueError, match="tensor parallelism"):
        enable(other)
    assert not any(isinstance(b.attn.processor, FlashflowQwenAttnProcessor) for b in other.transformer_blocks)


def _peaked_model(dtype=torch.float32, **config):
    model = tiny_model(dtype, **config)
    with torch.no_grad():   # peaked attention: a wrong key set shows in the output
        for name, p in model.named_parameters():
            if name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
                p.mul_(3)
    return model


def _cp_inputs(world, padded, dtype=torch.float32):
    """Inputs whose text (8 tokens) and image (4 × 6 patches) split evenly over ``world`` ranks;
    with ``padded`` the text mask hides tokens of the last rank's text slice and of another's."""
    kwargs = inputs(1, False, dtype=dtype, batch=1)
    kwargs["encoder_hidden_states"] = torch.randn(1, 8, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    if padded:
        mask = torch.ones(1, 8, dtype=torch.bool)
        mask[0, 5:] = False
        mask[0, 1] = False
        kwargs["encoder_hidden_states_mask"] = mask
    return kwargs


def _context_parallel_worker(rank, world, init_method, cases):
    """One of ``world`` gloo ranks on the CPU: diffusers' real enable_parallelism with flashflow's
    processor, in both orders, against the one-process output of the same model."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        # diffusers 0.42.1 picks the rank's device as rank % torch.accelerator.device_count(): 0 here
        torch.accelerator.device_count = lambda: 1
        for degrees, padded, attention, order, heads, *zero_cond_t in cases:
            dtype = torch.bfloat16 if attention == "fp8" else torch.float32
            config = HEAD_DIM_64 if attention == "fp8" else {}
            model = _peaked_model(dtype, num_attention_heads=heads, zero_cond_t=bool(zero_cond_t), **config)
            kwargs = _cp_inputs(world, padded, dtype)
            want = run(model, kwargs)   # one process, diffusers' own processors
            if order == "enable-first":
                enable(model, attention=attention)
                model.enable_parallelism(config=diffusers.ContextParallelConfig(**degrees))
            else:
                model.enable_parallelism(config=diffusers.ContextParallelConfig(**degrees))
                enable(model, attention=attention)
            assert is_enabled(model)
            # every block's modulations come from the group's table (each rank ran half of them)
            table = model.__dict__["_flashflow_modulations"]
            shared, lookup = [], table.modulations
            table.modulations = lambda block, temb: shared.append(lookup(block, temb) is not None) or lookup(block, temb)
            got = run(model, kwargs)
            where = f"rank {rank}: {degrees} padded={padded} {attention} {order} zero_cond_t={bool(zero_cond_t)}"
            assert shared == [True] * len(model.transformer_blocks), (where, shared)
            assert len(table.views) == 2 * len(model.transformer_blocks), where
            if attention == "fp8":
                assert cosine(got, want) > 0.999, (where, cosine(got, want))
            else:
                assert rel_l2(got, want) < TOL[dtype], (where, rel_l2(got, want))
            disable(model)
            assert not is_enabled(model)
            if degrees.get("ring_degree", 1) == 1 and attention == "exact":
                # diffusers' own processors took the config back: their Ulysses attention, not a local one
                assert rel_l2(run(model, kwargs), want) < 1e-5, where
    finally:
        dist.destroy_process_group()
    # gloo's worker thread can release a finished collective's buffers during interpreter shutdown
    # and abort the process (tests/distributed/gloo.py): a rank that passed leaves without it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(world, tmp_path, cases):
    torch.multiprocessing.spawn(_context_parallel_worker,
                                args=(world, f"file://{tmp_path / 'rendezvous'}", cases), nprocs=world)


GLOO = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                          reason="needs torch.distributed's gloo")


@GLOO
def test_context_parallel_on_two_ranks(tmp_path):
    """Two processes: Ulysses and ring, both orders of enable and enable_parallelism, with and
    without a text mask, exact and FP8 attention, zero_cond_t: each rank's output equals the
    one-process model's (peaked attention, so a rank attending its own half would show), every
    block's AdaLN modulations taken from the group's table."""
    _spawn(2, tmp_path, [
        (dict(ulysses_degree=2), False, "exact", "enable-first", 2),
        (dict(ulysses_degree=2), True, "exact", "parallel-first", 4),   # 2 heads per rank: two head groups
        (dict(ring_degree=2), True, "exact", "enable-first", 2),
        (dict(ring_degree=2), False, "exact", "parallel-first", 2),
        (dict(ulysses_degree=2), True, "fp8", "parallel-first", 2),
        (dict(ulysses_degree=2), False, "exact", "enable-first", 2, True),   # zero_cond_t: img_mod on two temb rows
    ])


@GLOO
def test_context_parallel_on_four_ranks(tmp_path):
    """Four processes: Ulysses 2 inside a ring of 2 (diffusers' mesh: ring outside), with a text mask."""
    _spawn(4, tmp_path, [(dict(ulysses_degree=2, ring_degree=2), True, "exact", "enable-first", 2),
                         (dict(ring_degree=4), False, "exact", "parallel-first", 2)])


def test_the_block_calls_the_processor_itself_unless_the_attention_module_is_hooked(monkeypatch):
    """Without hooks on a block's Attention module the fused block calls flashflow's processor
    directly (diffusers' Attention.forward costs an inspect.signature a call); a hooked module, or
    joint_attention_kwargs, go through the module, hooks and all: same output either way."""
    model = tiny_model()
    kwargs = inputs(1, False)
    want = run(model, kwargs)
    enable(model)
    attn_class = type(model.transformer_blocks[0].attn)
    module_calls, hook_calls = [], []
    original_forward = attn_class.forward
    monkeypatch.setattr(attn_class, "forward",
                        lambda self, *a, **kw: module_calls.append(1) or original_forward(self, *a, **kw))
    direct = run(model, kwargs)
    assert module_calls == []
    assert rel_l2(direct, want) < TOL[torch.float32]
    handle = model.transformer_blocks[1].attn.register_forward_pre_hook(lambda *a: hook_calls.append(1))
    try:
        hooked = run(model, kwargs)
    finally:
        handle.remove()
    assert module_calls == [1] and hook_calls == [1]   # the hooked block only, its hook run
    assert torch.equal(hooked, direct)
    module_calls.clear()
    run(model, dict(kwargs, attention_kwargs={"unexpected": 1}))   # diffusers warns about and drops it
    assert module_calls == [1, 1]
