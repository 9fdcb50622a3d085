"""`flashflow bench --suite qwen-image` without a GPU: its options, its error on a CPU machine,
the kernel classes, and the measuring loop and tables on a narrow model with a fake clock."""
from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from flashflow import cli
from flashflow.bench import qwen_image as qi
from flashflow.bench.cli import NO_GPU

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without a GPU")

# a narrow Qwen-Image for the CPU: same structure, 2 heads of 32 (RoPE axes summing to 32)
NARROW = {"attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": 48,
          "axes_dims_rope": (8, 12, 12)}


# ---------------------------------------------------------------------------- model and shapes


def test_config_is_the_diffusers_class_defaults():
    from diffusers import QwenImageTransformer2DModel

    params = inspect.signature(QwenImageTransformer2DModel.__init__).parameters
    for key, value in qi.CONFIG.items():
        default = params[key].default
        assert (tuple(default) if isinstance(default, (list, tuple)) else default) == value, key
    assert params["num_layers"].default == qi.MODEL_BLOCKS
    assert sum(qi.CONFIG["axes_dims_rope"]) == qi.CONFIG["attention_head_dim"]


def test_shapes_are_qwen_image_and_edit_with_and_without_a_text_mask():
    shapes = qi.step_shapes()
    got = {(s.name, s.image_tokens, s.text_tokens, s.text_valid) for s in shapes}
    assert got == {("qwen-image-1024px", 4096, 256, None), ("qwen-image-1024px", 4096, 256, 200),
                   ("qwen-image-edit-1024px", 8192, 256, None), ("qwen-image-edit-1024px", 8192, 256, 200)}
    assert len(shapes) == 4
    quick = qi.step_shapes(quick=True)
    assert set(quick) < set(shapes) and {s.text_valid for s in quick} == {None} and len(quick) == 2
    edit = next(s for s in shapes if s.images == 2)
    assert edit.image_side ** 2 == 4096 and "8192 image tokens" in edit.label


def test_inputs_are_what_the_pipeline_passes_and_run_a_narrow_model():
    model = qi.build_model(1, "cpu", torch.float32, **NARROW)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert len(model.transformer_blocks) == 1
    config = {**qi.CONFIG, **NARROW}
    shape = qi.StepShape("edit", images=2, image_side=4, text_tokens=8, text_valid=5)
    kw = qi.make_inputs(shape, config, "cpu", torch.float32)
    assert kw["hidden_states"].shape == (1, 32, 64) and kw["encoder_hidden_states"].shape == (1, 8, 48)
    assert kw["encoder_hidden_states_mask"].tolist() == [[1] * 5 + [0] * 3]
    assert kw["img_shapes"] == [[(1, 4, 4), (1, 4, 4)]] and kw["return_dict"] is False
    with torch.no_grad():
        out = model(**kw)[0]
        unmasked = model(**{**kw, "encoder_hidden_states_mask": None})[0]
    assert out.shape == (1, 32, 2 * 2 * 16) and torch.isfinite(out).all() and out.std() > 0
    assert not torch.allclose(out, unmasked)  # the mask reaches the attention
    again = qi.make_inputs(shape, config, "cpu", torch.float32)
    assert torch.equal(again["hidden_states"], kw["hidden_states"])  # seeded


def test_output_error_is_relative_l2_and_cosine():
    ref = torch.tensor([3.0, 4.0])
    assert qi.output_error(ref, ref) == (0.0, pytest.approx(1.0))
    rel, cos = qi.output_error(torch.tensor([3.0, 4.5]), ref)
    assert rel == pytest.approx(0.1) and cos == pytest.approx((9 + 18) / (5 * math.hypot(3, 4.5)))
    assert qi.output_error(-ref, ref)[1] == pytest.approx(-1.0)


# ---------------------------------------------------------------------------- kernel classes


@pytest.mark.parametrize("name, cls", [
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("mlp_gemm0_kernel", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("attention_fwd_kernel", "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "other"),
    ("triton_per_fused_native_layer_norm_0", "other"),
    ("layernorm_modulate_kernel", "other"),
    ("Memcpy DtoD (Device -> Device)", "other"),
])
def test_kernels_are_classified_by_name(name, cls):
    assert qi.classify_kernel(name) == cls


def test_kernel_split_sums_per_class_and_step():
    kernels = [("nvjet_a", 3000.0), ("flash_fwd", 1000.0), ("elementwise", 500.0),
               ("nvjet_a", 3000.0), ("flash_fwd", 1000.0), ("elementwise", 500.0)]
    split = qi.kernel_split(kernels, steps=2, top=2)
    assert split["ms"] == {"gemm": 3.0, "attention": 1.0, "other": 0.5}
    assert split["total_ms"] == 4.5
    assert split["share"]["gemm"] == pytest.approx(3 / 4.5)
    assert [k["name"] for k in split["top"]] == ["nvjet_a", "flash_fwd"]
    assert split["top"][0] == {"name": "nvjet_a", "class": "gemm", "ms": 3.0}
    assert qi.kernel_split([], steps=1)["share"] == {"gemm": None, "attention": None, "other": None}


# ---------------------------------------------------------------------------- the command line


@no_gpu
def test_without_gpu_is_a_one_line_error(capfd):
    assert cli.main(["bench", "--suite", "qwen-image"]) == 2
    out, err = capfd.readouterr()
    assert out == "" and NO_GPU not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("flashflow bench: error:") and "--suite qwen-image" in line and "CUDA GPU" in line


@pytest.mark.parametrize("argv, needle", [
    (["--blocks", "0"], "--blocks must be a whole number from 1 to 60"),
    (["--blocks", "61"], "got 61"),
    (["--providers", "flashflow,sdpa"], "--providers must be a comma list of diffusers, "
                                        "diffusers+compile, flashflow, flashflow+compile"),
    (["--providers", ","], "--providers"),
    (["--warmup", "0"], "--warmup must be a positive number"),
    (["--dtype", "fp16"], "--dtype does not apply to --suite qwen-image"),
])
def test_bad_options_are_refused_before_the_gpu_is_looked_for(argv, needle, capsys):
    code = cli.main(["bench", "--suite", "qwen-image", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("flashflow bench: error:") and needle in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["--suite", "mlp", "--blocks", "6"], ["--blocks", "6"],
                                  ["--suite", "decode", "--blocks", "3"]])
def test_blocks_is_refused_by_the_other_suites(argv, capsys):
    assert cli.main(["bench", *argv]) == 2
    assert "--blocks does not apply to --suite" in capsys.readouterr().err


def test_blocks_does_not_apply_to_saved_results(tmp_path, capsys):
    assert cli.main(["bench", "--tables", "--blocks", "6"]) == 2
    assert "--blocks does not apply to --tables" in capsys.readouterr().err
    assert cli.main(["bench", "--from-json", str(tmp_path / "x.json"), "--blocks", "6"]) == 2
    assert "--blocks does not apply to --from-json" in capsys.readouterr().err


def test_check_args_fills_providers_and_defaults_come_from_the_registry():
    from flashflow.bench.suites import RUNNERS

    spec = RUNNERS["qwen-image"]
    assert spec.module == "flashflow.bench.qwen_image" and spec.defaults["blocks"] == qi.DEFAULT_BLOCKS
    args = SimpleNamespace(blocks=6, warmup=200, rep=1000, providers=None)
    assert qi.check_args(args) is None and args.providers == list(qi.PROVIDERS)
    args = SimpleNamespace(blocks=60, warmup=1, rep=1, providers="flashflow, diffusers,flashflow")
    assert qi.check_args(args) is None and args.providers == ["flashflow", "diffusers"]
    assert "got True" in qi.check_args(SimpleNamespace(blocks=True, warmup=1, rep=1, providers=None))


def test_help_names_the_suite_and_its_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    # argparse wraps the help text, and may break a line after a word's hyphen
    out = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    assert "qwen-image: times a Qwen-Image transformer step" in out
    assert "--blocks N qwen-image: transformer blocks to build, of the model's 60 (default: 6)" in out


# ---------------------------------------------------------------------------- measuring, faked GPU


class FakeBackend:
    """The CUDA backend's calls on the CPU: ``clock()`` says the step's ms, the memory is made up."""

    def __init__(self, clock):
        self.clock = clock
        self.calls = []

    def sync(self):
        pass

    def time_ms(self, fn):
        self.calls.append("time")
        return self.clock(fn)

    def host_ms(self, fn):
        self.calls.append("host")
        return 0.5

    def capture(self, fn):
        self.calls.append("capture")
        out = fn()
        return types.SimpleNamespace(replay=lambda: None), out

    def peak(self, fn):
        fn()
        return 1000, 100

    def kernels(self, fn, steps):
        self.calls.append("profile")
        return [("nvjet_x", 2000.0 * steps), ("flash_fwd", 1000.0 * steps), ("add", 250.0 * steps)]

    def free(self):
        self.calls.append("free")

    def park(self, model):
        self.calls.append("park")
        return next(model.parameters()).device

    def unpark(self, model, device):
        self.calls.append("unpark")

    def is_oom(self, e):
        return False


def _perturbed_block(block, block_index, which=1):
    """Block ``which`` of a copy made different (its image MLP's output weights), the others kept."""
    if block_index == which:
        with torch.no_grad():
            block.img_mlp.net[2].weight.mul_(4.0)
    return block


def _narrow_run(providers, integration=None, compile_fn=None, torchao_copy=None, blocks=1):
    """``measure`` on a narrow model; the fake clock says 10 ms eager, 8 compiled, 5 with flashflow
    enabled, 4 both, 3 with FP8 attention, 2 with FP8 linears too (1.6 compiled), 2.5 for the
    torchao copy, compiled. The fake torchao copy is the model deep-copied, numerics unchanged."""
    model = qi.build_model(blocks, "cpu", torch.float32, **NARROW)
    config = {**qi.CONFIG, **NARROW}
    shapes = [qi.StepShape("qwen-image-1024px", 1, 4, 8, None), qi.StepShape("qwen-image-1024px", 1, 4, 8, 5)]
    inputs = {(s.name, s.text_valid): qi.make_inputs(s, config, "cpu", torch.float32) for s in shapes}
    state = {"enabled": False, "compiled": 0, "reset": 0, "log": [], "via_compiled": False, "model": model}
    times = {(False, False): 10.0, (False, True): 8.0, ("exact", False): 5.0, ("exact", True): 4.0,
             ("fp8", False): 3.0, ("fp8+fp8", False): 2.0, ("fp8+fp8", True): 1.6, ("torchao", True): 2.5,
             ("torchao", False): 2.4}   # (a +graph provider replays what it captured, timed as uncompiled)

    def enable(m, attention, linear="exact"):
        assert m is model and not state["enabled"]
        state["enabled"] = attention if linear == "exact" else f"{attention}+{linear}"
        state["log"].append(("enable" if attention == "exact" else f"enable {attention}")
                            + ("" if linear == "exact" else f" linear {linear}"))

    def disable(m):
        assert m is model and state["enabled"]
        state["enabled"] = False
        state["log"].append("disable")

    @contextlib.contextmanager
    def fake_torchao(m, backend):
        assert m is model and not state["enabled"]
        backend.park(m)
        state["enabled"] = "torchao"
        state["log"].append("torchao copy")
        try:
            yield copy.deepcopy(m)
        finally:
            state["enabled"] = False
            state["log"].append("torchao dropped")
            backend.unpark(m, "cpu")

    def fake_compile(m):
        state["compiled"] += 1

        def compiled(**kw):
            state["via_compiled"] = True
            return m(**kw)
        return compiled

    def clock(fn):
        state["via_compiled"] = False
        fn()
        return times[state["enabled"], state["via_compiled"]]

    backend = FakeBackend(clock)
    rows = qi.measure(model, shapes, providers, inputs, backend,
                      integration=integration or (lambda: (enable, disable)),
                      compile_fn=compile_fn or fake_compile,
                      reset_compiled=lambda: state.__setitem__("reset", state["reset"] + 1),
                      torchao_copy=torchao_copy or fake_torchao)
    return rows, state, backend


def test_measure_times_every_provider_on_every_shape_and_tears_each_down():
    rows, state, backend = _narrow_run(list(qi.PROVIDERS))
    assert len(rows) == 2 and all(list(r["results"]) == list(qi.PROVIDERS) for r in rows)
    # flashflow, +compile, +graph; flashflow-fp8 and its +graph; the torchao copy; flashflow-fp8-linear
    # and its +graph, +compile and +compile+graph; torchao's +graph copy
    assert state["log"] == (["enable", "disable"] * 3 + ["enable fp8", "disable"] * 2
                            + ["torchao copy", "torchao dropped"] + ["enable fp8 linear fp8", "disable"] * 4
                            + ["torchao copy", "torchao dropped"])
    assert not state["enabled"]
    assert state["compiled"] == 6 and state["reset"] == 6   # once per compiled provider
    # freed after every provider, and after each graphed shape (its graph's memory pool)
    assert backend.calls.count("free") == 14 + 12 and backend.calls.count("profile") == 2 * len(qi.PROFILED)
    assert backend.calls.count("capture") == 12   # the six +graph providers, two shapes each
    # the original model waits on the host while each torchao copy runs, and only then
    assert backend.calls.count("park") == backend.calls.count("unpark") == 2
    for row in rows:
        res = row["results"]
        # the fake clock times a graph replay as the eager model it captured
        assert [res[p]["ms"] for p in qi.PROVIDERS] == [10.0, 8.0, 5.0, 4.0, 10.0, 5.0, 3.0, 3.0,
                                                       2.5, 2.0, 2.0, 1.6, 2.0, 2.4]
        assert all(r["error"] is None and r["peak_bytes"] == 1000 and r["step_bytes"] == 100
                   and r["first_call_s"] >= 0 for r in res.values())
        # the fake "flashflow" and torchao copy are diffusers itself: same output, to the last bit
        assert all(r["rel_l2"] == 0.0 and r["cosine"] == pytest.approx(1.0) for r in res.values())
        assert {p for p, r in res.items() if r["split"]} == set(qi.PROFILED)
        # one cosine per block, except for the +graph providers and diffusers+compile
        blocks = {p for p, r in res.items() if r["block_cosine"] is not None}
        assert blocks == {p for p in qi.PROVIDERS if not p.endswith("+graph")} - {"diffusers+compile"}
        assert all(res[p]["block_cosine"] == [pytest.approx(1.0)] for p in blocks)
        assert res["flashflow"]["split"]["ms"] == {"gemm": 2.0, "attention": 1.0, "other": 0.25}
        assert row["speedup"]["flashflow"] == {"diffusers": 2.0, "diffusers+compile": 1.6}
        assert row["speedup"]["flashflow+compile"] == {"diffusers": 2.5, "diffusers+compile": 2.0}
        assert row["speedup"]["diffusers"]["diffusers"] == 1.0
        assert row["speedup"]["flashflow-fp8"] == {"diffusers": pytest.approx(10 / 3),
                                                   "diffusers+compile": pytest.approx(8 / 3)}
        assert row["speedup"]["flashflow-fp8-linear+compile"] == {"diffusers": 6.25, "diffusers+compile": 5.0}
        assert row["speedup"]["torchao-fp8+compile"] == {"diffusers": 4.0, "diffusers+compile": 3.2}


def test_fp8_providers_enable_fp8_attention_and_are_measured_by_default():
    assert {"flashflow-fp8", "flashflow-fp8+graph"} <= set(qi.PROVIDERS)
    assert qi.MODES["flashflow-fp8"] == ("fp8", "exact", False, False)
    assert qi.MODES["flashflow-fp8+graph"] == ("fp8", "exact", False, True)
    assert all(qi.MODES[p].attention == "exact" and qi.MODES[p].linear == "exact"
               for p in ("flashflow", "flashflow+compile", "flashflow+graph"))
    assert "flashflow-fp8" in qi.PROFILED   # its GPU time split, attention's share included
    args = SimpleNamespace(blocks=6, warmup=200, rep=1000, providers="flashflow-fp8+graph,flashflow-fp8")
    assert qi.check_args(args) is None and args.providers == ["flashflow-fp8+graph", "flashflow-fp8"]
    # FP8 attention's own kernels, quantize pass included, are attention time
    for name in ("attention_fp8_fwd_kernel", "attention_quantize_kernel", "attention_kv_stats_kernel"):
        assert qi.classify_kernel(name) == "attention"


def test_fp8_linear_and_torchao_providers_are_measured_by_default():
    new = {"flashflow-fp8-linear": ("fp8", "fp8", False, False),
           "flashflow-fp8-linear+graph": ("fp8", "fp8", False, True),
           "flashflow-fp8-linear+compile": ("fp8", "fp8", True, False),
           "torchao-fp8+compile": (None, "torchao-fp8", True, False),
           "flashflow-fp8-linear+compile+graph": ("fp8", "fp8", True, True),
           "torchao-fp8+compile+graph": (None, "torchao-fp8", True, True)}
    assert {p: tuple(qi.MODES[p]) for p in new} == new and set(new) <= set(qi.PROVIDERS)
    assert "torchao-fp8" not in qi.PROVIDERS   # torchao eager is not a provider: only compiled
    assert "flashflow-fp8-linear" in qi.PROFILED
    args = SimpleNamespace(blocks=6, warmup=200, rep=1000,
                           providers="torchao-fp8+compile, flashflow-fp8-linear+graph,flashflow-fp8-linear+compile")
    assert qi.check_args(args) is None
    assert args.providers == ["torchao-fp8+compile", "flashflow-fp8-linear+graph", "flashflow-fp8-linear+compile"]
    args = SimpleNamespace(blocks=6, warmup=200, rep=1000, providers="torchao-fp8")
    assert "got 'torchao-fp8'" in qi.check_args(args)
    assert "torchao-fp8+compile, flashflow-fp8-linear" in qi.check_args(args)   # the list names them


def test_fp8_linear_providers_pass_linear_through_enable():
    rows, state, _ = _narrow_run(["flashflow-fp8-linear", "flashflow-fp8", "flashflow-fp8-linear+compile"])
    assert state["log"] == ["enable fp8 linear fp8", "disable", "enable fp8", "disable",
                            "enable fp8 linear fp8", "disable"]
    for row in rows:
        assert [row["results"][p]["ms"] for p in ("flashflow-fp8-linear", "flashflow-fp8",
                                                  "flashflow-fp8-linear+compile")] == [2.0, 3.0, 1.6]
        assert row["results"]["flashflow-fp8-linear"]["split"]["ms"]["gemm"] == 2.0


@pytest.mark.parametrize("name, cls", [
    # cuBLASLt's FP8 GEMMs, CUTLASS' (torch._scaled_mm with row-wise scales), Triton ones
    ("nvjet_qqtst_128x256_128x6_2x1_v_bz_coopB_TNN", "gemm"),
    ("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_kernel__5x_cublas", "gemm"),
    ("void cutlass::device_kernel<cutlass3x_sm90_tensorop_s64x128x32gemm_f8_f8_f32_bf16_bf16_128x128x128_1x1x1_0_"
     "tnn_align16_warpspecialized_cooperative_fp8_fastaccum_epi_tma>(T1::Params)", "gemm"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<"
     "cute::tuple<int, int, int>, cutlass::float_e4m3_t>>>", "gemm"),
    ("fp8_gemm_kernel", "gemm"),
    ("linear_fp8_matmul_kernel", "gemm"),
    ("_scaled_mm_matmul_kernel", "gemm"),
    # the activations' quantize kernels: amax, scale, cast
    ("fp8_quantize_rows_kernel", "other"),
    ("linear_act_quantize_kernel", "other"),
    ("triton_red_fused_abs_amax_clamp_div_reciprocal_0", "other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int, "
     "float, 4>>", "other"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda, c10::Float8_e4m3fn>", "other"),
])
def test_fp8_gemm_kernels_are_gemm_and_quantize_kernels_other(name, cls):
    assert qi.classify_kernel(name) == cls


# ---------------------------------------------------------------------------- accuracy: q/k norms, blocks


def test_build_model_scales_the_qk_norm_weights():
    plain = qi.build_model(2, "cpu", torch.float32, qk_norm_scale=1.0, **NARROW)
    scaled = qi.build_model(2, "cpu", torch.float32, **NARROW)
    assert qi.QK_NORM_SCALE == 3.0
    a, b = plain.state_dict(), scaled.state_dict()
    norms = {f"transformer_blocks.{i}.attn.{n}.weight" for i in range(2) for n in qi.QK_NORMS}
    assert norms <= set(a) and len(norms) == 8
    for key in a:
        if key in norms:
            assert torch.equal(a[key], torch.ones_like(a[key])) and torch.equal(b[key], 3 * a[key]), key
        else:
            assert torch.equal(a[key], b[key]), key   # same seed: every other weight the same


def test_scaled_qk_norms_make_attention_peaked():
    """What the scale is for: the joint attention's largest probability per query grows."""
    config = {**qi.CONFIG, **NARROW}
    shape = qi.StepShape("x", 1, 6, 8, None)
    peaks = []
    for scale in (1.0, 3.0):
        model = qi.build_model(1, "cpu", torch.float32, qk_norm_scale=scale, **NARROW)
        captured = {}
        attn = model.transformer_blocks[0].attn
        attn.norm_k.register_forward_hook(lambda _m, _a, out: captured.__setitem__("k", out))
        attn.norm_q.register_forward_hook(lambda _m, _a, out: captured.__setitem__("q", out))
        with torch.no_grad():
            model(**qi.make_inputs(shape, config, "cpu", torch.float32))
        q, k = captured["q"].transpose(1, 2), captured["k"].transpose(1, 2)   # image stream: (1, heads, n, d)
        p = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        peaks.append(p.amax(-1).mean().item())
    assert peaks[1] > 2 * peaks[0]


def test_block_hooks_give_every_blocks_image_stream_and_cosines_per_block():
    model = qi.build_model(3, "cpu", torch.float32, **NARROW)
    config = {**qi.CONFIG, **NARROW}
    kw = qi.make_inputs(qi.StepShape("x", 1, 4, 8, 5), config, "cpu", torch.float32)
    with torch.no_grad():
        want = model(**kw)[0]
        out, blocks = qi.reference_step(model, kw)
        assert torch.equal(out, want.float()) and out.dtype == torch.float32
        assert len(blocks) == 3 and all(b.shape == (1, 16, 64) and b.device.type == "cpu" for b in blocks)
        assert not torch.equal(blocks[0], blocks[1])
        assert all(not b._forward_hooks for b in model.transformer_blocks)   # removed after the call
        # block i's image stream is what block i + 1 takes in
        seen = []
        model.transformer_blocks[1].register_forward_pre_hook(
            lambda _m, args, kwargs: seen.append(kwargs["hidden_states"]), with_kwargs=True)
        model(**kw)
        assert torch.equal(seen[0], blocks[0])
        model.transformer_blocks[1]._forward_pre_hooks.clear()

        assert qi.block_cosines(model, kw, blocks) == [pytest.approx(1.0)] * 3
        other = copy.deepcopy(model)
        _perturbed_block(other.transformer_blocks[1], 1)
        cos = qi.block_cosines(other, kw, blocks)
        assert cos[0] == pytest.approx(1.0) and cos[1] < 0.9999 and cos[2] < 1
        with pytest.raises(ValueError, match="the model has 3 transformer blocks, the reference 2"):
            qi.block_cosines(model, kw, blocks[:2])


# ---------------------------------------------------------------------------- torchao


def _fake_torchao(monkeypatch, calls):
    """torchao.quantization as far as the suite uses it: quantize_ marks and changes the Linear
    weights of what it is given (block 1's MLP more than the rest) and sets an Inductor option,
    as torchao's config does."""
    import torch._inductor.config as inductor_config

    quantization = types.ModuleType("torchao.quantization")

    class PerRow:
        pass

    class Float8DynamicActivationFloat8WeightConfig:
        def __init__(self, granularity=None):
            self.granularity = granularity

    def quantize_(module, config):
        assert isinstance(config.granularity, PerRow)
        assert all(not p.requires_grad for p in module.parameters())
        calls.append(("quantize_", type(module).__name__, next(module.parameters()).device.type))
        inductor_config.coordinate_descent_tuning = True
        with torch.no_grad():
            for m in module.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(m.weight.to(torch.bfloat16).float())
        _perturbed_block(module, len([c for c in calls if c[0] == "quantize_"]) - 1)

    quantization.PerRow = PerRow
    quantization.Float8DynamicActivationFloat8WeightConfig = Float8DynamicActivationFloat8WeightConfig
    quantization.quantize_ = quantize_
    package = types.ModuleType("torchao")
    package.quantization = quantization
    monkeypatch.setitem(sys.modules, "torchao", package)
    monkeypatch.setitem(sys.modules, "torchao.quantization", quantization)


def test_torchao_copy_quantizes_every_block_of_a_copy_and_leaves_the_model_alone(monkeypatch):
    import torch._inductor.config as inductor_config

    calls = []
    _fake_torchao(monkeypatch, calls)
    tuning = inductor_config.coordinate_descent_tuning
    rows, state, backend = _narrow_run(["diffusers", "torchao-fp8+compile", "flashflow"],
                                       torchao_copy=qi.torchao_fp8_copy, blocks=2)
    model = state["model"]
    # one quantize_ per block, on the copy's blocks (not on the model, not on the whole copy)
    assert calls == [("quantize_", "QwenImageTransformerBlock", "cpu")] * 2
    assert inductor_config.coordinate_descent_tuning == tuning   # torchao's Inductor settings undone
    # the original waited on the host and came back; the copy was freed before it did
    i = backend.calls.index("park")
    assert backend.calls[i:].index("unpark") > backend.calls[i:].index("free")
    built = qi.build_model(2, "cpu", torch.float32, **NARROW).state_dict()
    assert all(torch.equal(t, built[k]) for k, t in model.state_dict().items())   # the model untouched
    for row in rows:
        res = row["results"]["torchao-fp8+compile"]
        assert res["error"] is None and res["ms"] == 8.0 and res["cosine"] < 0.99999
        # block 0: only the bf16 rounding of its weights; block 1: its MLP changed as well
        assert res["block_cosine"][0] > 0.9999 and res["block_cosine"][1] < res["block_cosine"][0]
        assert row["results"]["flashflow"]["block_cosine"] == [pytest.approx(1.0)] * 2
        assert row["results"]["diffusers"]["cosine"] == pytest.approx(1.0)


def test_without_torchao_its_provider_is_a_skip_entry_and_the_run_goes_on(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)   # what `import torchao` meets where it is not installed
    rows, state, backend = _narrow_run(["diffusers", "torchao-fp8+compile", "flashflow"],
                                       torchao_copy=qi.torchao_fp8_copy)
    assert "park" not in backend.calls and state["compiled"] == 0
    for row in rows:
        res = row["results"]["torchao-fp8+compile"]
        assert res["skipped"] is True and set(res) == {"error", "skipped"}
        assert res["error"].startswith("torchao is not installed (pip install torchao): ModuleNotFoundError")
        assert row["results"]["diffusers"]["ms"] == 10.0 and row["results"]["flashflow"]["ms"] == 5.0
        assert row["speedup"]["torchao-fp8+compile"] == {"diffusers": None, "diffusers+compile": None}
    text = qi.markdown_table(_fake_result(rows))
    line = next(l for l in text.splitlines() if "| torchao-fp8+compile |" in l)
    assert "| skipped: torchao is not installed (pip install torchao)" in line
    assert line.count("|") == text.splitlines()[0].count("|")


def test_torchao_version_comes_from_the_package_metadata(monkeypatch):
    from importlib import metadata

    def version(name):
        assert name == "torchao"
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", version)
    assert qi.torchao_version() is None
    monkeypatch.setattr(metadata, "version", lambda name: "0.17.0")
    assert qi.torchao_version() == "0.17.0"


def test_setup_record_names_modes_scale_block_pass_and_torchao():
    rec = qi.setup_record(["diffusers", "torchao-fp8+compile", "flashflow-fp8-linear"])
    assert rec["providers"] == ["diffusers", "torchao-fp8+compile", "flashflow-fp8-linear"]
    assert rec["modes"]["flashflow-fp8-linear"] == {"attention": "fp8", "linear": "fp8", "compiled": False,
                                                   "graphed": False}
    assert rec["modes"]["torchao-fp8+compile"]["linear"] == "torchao-fp8"
    assert rec["qk_norm_scale"] == 3.0 and "transformer_blocks[i]" in rec["block_accuracy"]["how"]
    assert rec["torchao_setup"]["config"] == "Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())"
    assert "torchao_setup" not in qi.setup_record(["diffusers"])
    json.dumps(rec)


def test_a_provider_that_cannot_be_set_up_is_an_error_entry_not_the_end():
    def broken():
        raise ModuleNotFoundError("No module named 'flashflow.integrations'\nmore")

    rows, state, _ = _narrow_run(["flashflow", "diffusers"], integration=broken)
    for row in rows:
        assert row["results"]["flashflow"] == {"error": "ModuleNotFoundError: No module named 'flashflow.integrations'"}
        assert row["results"]["diffusers"]["ms"] == 10.0
        assert row["speedup"]["flashflow"] == {"diffusers": None, "diffusers+compile": None}
    text = qi.markdown_table(_fake_result(rows))
    assert "| flashflow | ModuleNotFoundError" in text


def test_a_failing_step_is_recorded_and_the_provider_still_torn_down():
    def compile_that_breaks(m):
        def call(**kw):
            raise RuntimeError("inductor: boom")
        return call

    rows, state, _ = _narrow_run(["diffusers+compile", "flashflow+compile"], compile_fn=compile_that_breaks)
    for row in rows:
        for p in ("diffusers+compile", "flashflow+compile"):
            assert row["results"][p]["error"] == "RuntimeError: inductor: boom" and row["results"][p]["ms"] is None
    assert state["log"] == ["enable", "disable"] and state["reset"] == 2


def test_measure_with_the_real_integration_matches_diffusers_and_disables():
    """The suite's loop around flashflow.integrations.diffusers itself (the kernels in Triton's
    interpreter): the flashflow provider's output matches eager diffusers', and the model is
    given back as diffusers built it."""
    from flashflow.device import interpreting

    if not interpreting():
        pytest.skip("runs flashflow's kernels on CPU tensors: needs TRITON_INTERPRET=1")
    from flashflow.integrations.diffusers import is_enabled

    model = qi.build_model(1, "cpu", torch.float32, **NARROW)
    config = {**qi.CONFIG, **NARROW}
    shapes = [qi.StepShape("qwen-image-1024px", 1, 4, 8, None), qi.StepShape("qwen-image-edit-1024px", 2, 4, 8, 5)]
    inputs = {(s.name, s.text_valid): qi.make_inputs(s, config, "cpu", torch.float32) for s in shapes}
    backend = FakeBackend(lambda fn: (fn(), 1.0)[1])
    rows = qi.measure(model, shapes, ["diffusers", "flashflow"], inputs, backend, compile_fn=lambda m: m)
    for row in rows:
        res = row["results"]["flashflow"]
        assert res["error"] is None and res["rel_l2"] < 1e-4 and res["cosine"] > 1 - 1e-6, row["label"]
        assert res["split"]["ms"]["gemm"] > 0
        assert len(res["block_cosine"]) == 1 and res["block_cosine"][0] > 1 - 1e-6
    assert not is_enabled(model)
    processors = {type(b.attn.processor).__name__ for b in model.transformer_blocks}
    assert processors == {"QwenDoubleStreamAttnProcessor2_0"}


def test_measure_fp8_with_the_real_integration_reports_its_error_and_disables():
    """flashflow-fp8 through the real integration on a narrow fp16 model with heads of 64 (FP8
    attention's head_dims): its output against eager diffusers' is recorded (cosine, rel L2),
    and the model is given back as diffusers built it. An fp32 model cannot run it: an error
    entry on every shape, the other providers still measured."""
    from flashflow.device import interpreting

    if not interpreting():
        pytest.skip("runs flashflow's kernels on CPU tensors: needs TRITON_INTERPRET=1")
    from flashflow.integrations.diffusers import is_enabled

    narrow64 = {**NARROW, "attention_head_dim": 64, "axes_dims_rope": (16, 24, 24)}
    config = {**qi.CONFIG, **narrow64}
    shapes = [qi.StepShape("qwen-image-1024px", 1, 4, 8, None), qi.StepShape("qwen-image-edit-1024px", 2, 4, 8, 5)]
    backend = FakeBackend(lambda fn: (fn(), 1.0)[1])
    for dtype in (torch.float16, torch.float32):
        model = qi.build_model(1, "cpu", dtype, **narrow64)
        inputs = {(s.name, s.text_valid): qi.make_inputs(s, config, "cpu", dtype) for s in shapes}
        rows = qi.measure(model, shapes, ["diffusers", "flashflow-fp8", "flashflow"], inputs, backend,
                          compile_fn=lambda m: m)
        for row in rows:
            res, exact = row["results"]["flashflow-fp8"], row["results"]["flashflow"]
            assert exact["error"] is None
            if dtype == torch.float16:
                assert res["error"] is None and res["cosine"] > 0.99 and res["split"]["ms"]["attention"] > 0
                assert res["rel_l2"] > exact["rel_l2"]   # FP8 attention's error, beside exact attention's
                # the block pass sees it too, in the block's own output
                assert 0.99 < res["block_cosine"][0] < exact["block_cosine"][0]
            else:
                assert res["error"].startswith("ValueError: attention='fp8' needs a bfloat16 or float16 model")
        assert not is_enabled(model)
        processors = {type(b.attn.processor).__name__ for b in model.transformer_blocks}
        assert processors == {"QwenDoubleStreamAttnProcessor2_0"}


# ---------------------------------------------------------------------------- result, tables, plot


def _fake_result(rows):
    return {"suite": "qwen-image", "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "diffusers": "0.42.1",
            "dtype": "bf16", "blocks": 6, "date": "2026-01-01T00:00:00+00:00",
            "timing": {"warmup_ms": 200, "rep_ms": 1000, "return_mode": "median"}, "rows": rows}


def _fake_rows():
    def res(ms, rel, split=None, peak=5 * qi.GIB, blocks=None):
        return {"ms": ms, "first_call_s": 1.5, "peak_bytes": peak, "step_bytes": 10, "rel_l2": rel,
                "cosine": 1 - rel, "block_cosine": blocks, "split": split, "error": None}

    split = {"ms": {"gemm": 20.0, "attention": 5.0, "other": 10.0}, "total_ms": 35.0,
             "share": {}, "top": []}
    rows = []
    for s in qi.step_shapes():
        results = {"diffusers": res(40.0, 0.0, split), "diffusers+compile": res(32.0, 2e-3),
                   "flashflow": res(25.0, 3e-3, split),
                   "flashflow+compile": {"ms": None, "error": "RuntimeError: x|y"},
                   "flashflow-fp8": res(20.0, 4e-2, split, blocks=[0.9999, 0.9991, 0.9995]),
                   "torchao-fp8+compile": {"error": qi.TORCHAO_MISSING + ": ModuleNotFoundError: x", "skipped": True},
                   "flashflow-fp8-linear": res(16.0, 6e-2, split, blocks=[0.998, 0.997, 0.9985])}
        rows.append({"shape": s.as_dict(), "label": s.label, "results": results,
                     "speedup": qi.speedups(results)})
    return rows


def test_table_has_one_line_per_shape_and_provider():
    result = _fake_result(_fake_rows())
    text = qi.report(result)
    assert text.startswith("Qwen-Image transformer, 6 of 60 blocks at full width, bf16")
    lines = [l for l in text.splitlines() if l.startswith("| ")]
    assert len(lines) == 1 + 4 * 7
    assert "flashflow-fp8: FP8 attention" in text.split("\n\n")[0]   # the caption says what it is
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    ff = next(l for l in lines if "qwen-image-edit-1024px (8192+256) | 200/256 | flashflow |" in l)
    cells = dict(zip(head, [c.strip() for c in ff.strip("|").split("|")]))
    assert cells["ms/step"] == "25.00" and cells["÷ diffusers"] == "1.60" and cells["÷ diffusers+compile"] == "1.28"
    assert cells["rel L2"] == "3.0e-03" and cells["peak GiB"] == "5.00"
    assert (cells["GEMM ms"], cells["attention ms"], cells["other ms"]) == ("20.00", "5.00", "10.00")
    comp = next(l for l in lines if "| none | diffusers+compile |" in l)
    assert dict(zip(head, [c.strip() for c in comp.strip("|").split("|")]))["GEMM ms"] == "-"
    broken = next(l for l in lines if "flashflow+compile" in l)
    assert "RuntimeError: x/y" in broken and broken.count("|") == lines[0].count("|")
    fp8 = next(l for l in lines if "| none | flashflow-fp8 |" in l)
    cells = dict(zip(head, [c.strip() for c in fp8.strip("|").split("|")]))
    assert (cells["ms/step"], cells["÷ diffusers"], cells["rel L2"], cells["cosine"]) == \
        ("20.00", "2.00", "4.0e-02", "0.960000")
    assert cells["attention ms"] == "5.00"
    assert cells["block cos min"] == "0.999100"   # the block furthest from diffusers'
    assert dict(zip(head, [c.strip() for c in ff.strip("|").split("|")]))["block cos min"] == "-"
    linear = next(l for l in lines if "| none | flashflow-fp8-linear |" in l)
    cells = dict(zip(head, [c.strip() for c in linear.strip("|").split("|")]))
    assert (cells["ms/step"], cells["÷ diffusers"], cells["block cos min"]) == ("16.00", "2.50", "0.997000")
    skipped = next(l for l in lines if "| none | torchao-fp8+compile |" in l)
    assert "| skipped: torchao is not installed (pip install torchao): ModuleNotFoundError: x |" in skipped
    assert skipped.count("|") == lines[0].count("|")


def test_caption_names_fp8_only_where_it_ran():
    rows = _fake_rows()
    for row in rows:
        for p in ("flashflow-fp8", "flashflow-fp8-linear", "torchao-fp8+compile"):
            del row["results"][p]
    assert "fp8" not in qi.caption(_fake_result(rows)).lower()


def test_caption_says_what_the_fp8_linear_and_torchao_providers_run():
    result = {**_fake_result(_fake_rows()), "torchao": "0.17.0", "qk_norm_scale": 3.0}
    text = qi.caption(result)
    assert "diffusers 0.42.1, torchao 0.17.0)" in text and "q/k norm weights ×3" in text
    assert "flashflow-fp8-linear: FP8 attention and every block's Linear layers in FP8 e4m3" in text
    assert "torchao-fp8+compile: torchao's quantize_ with Float8DynamicActivationFloat8WeightConfig" in text
    assert "flashflow-fp8: FP8 attention, its quantize pass" in text
    rows = _fake_rows()
    for row in rows:
        del row["results"]["flashflow-fp8"]
    text = qi.caption(_fake_result(rows))   # a result without the fields: no torchao version, no scale
    assert "flashflow-fp8:" not in text and "flashflow-fp8-linear:" in text and "torchao 0" not in text
    assert "q/k norm" not in text


def test_from_json_prints_a_saved_result(tmp_path, capsys):
    from flashflow.bench import runner

    path = runner.write_result(_fake_result(_fake_rows()), tmp_path)
    assert path.name == "qwen-image-nvidia-h100-80gb-hbm3.json"
    assert json.loads(path.read_text())["suite"] == "qwen-image"
    assert cli.main(["bench", "--from-json", str(path)]) == 0
    assert capsys.readouterr().out == qi.report(_fake_result(_fake_rows())) + "\n"


def test_plot_draws_a_png_or_says_matplotlib_is_missing(tmp_path):
    result = _fake_result(_fake_rows())
    png = qi.plot(result, tmp_path / "q.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert png is None
    else:
        assert png == tmp_path / "q.png" and png.read_bytes()[:4] == b"\x89PNG"
