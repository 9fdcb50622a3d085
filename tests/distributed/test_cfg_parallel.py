"""CFG parallel (flashflow.integrations.cfg_parallel) on diffusers' real QwenImagePipeline with a
tiny transformer (peaked attention: q/k norm weights ×3), on 2 and 4 gloo processes
(tests/distributed/gloo.py), kernels through Triton's interpreter.

Every rank runs the same pipeline call (same arguments, same generator seed) with the prompt
embeddings given (no text encoder), ``output_type="latent"``. Each rank computes the one-process
result itself first, then the CFG-parallel one, and reports numbers; the assertions run here in
the parent. The spawned body of a world size runs once (a spawn and its imports cost seconds) and
the tests of that world size read its report.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

import gloo

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")   # diffusers' pipelines need it importable (no weights are loaded)

from flashflow.integrations import cfg_parallel  # noqa: E402
from flashflow.integrations.cfg_parallel import (disable_cfg_parallel, enable_cfg_parallel,  # noqa: E402
                                                 is_cfg_parallel)

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed's gloo backend")

STEPS = 2
TOL = 1e-5   # the same ops on the same inputs in another process: float32 round-off at most


def _pipeline(heads=2):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    torch.manual_seed(0)
    model = diffusers.QwenImageTransformer2DModel(
        num_layers=1, attention_head_dim=32, num_attention_heads=heads, axes_dims_rope=(8, 12, 12),
        joint_attention_dim=48, in_channels=16, out_channels=4)
    with torch.no_grad():   # RMSNorm weights away from 1, then ×3: peaked attention
        for name, p in model.named_parameters():
            if name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
                p.uniform_(0.5, 1.5).mul_(3)
    model.eval()
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None,
                             tokenizer=None, transformer=model)


def _call_kwargs(cfg_scale=4.0):
    """A prompt of 8 tokens (the last 3 padding) and a negative prompt of 6 real tokens; 64 × 80 px:
    4 × 5 latent patches, 20 image tokens (every length splits evenly over 2 ranks)."""
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 5:] = 0
    return dict(prompt_embeds=torch.randn(1, 8, 48, generator=g), prompt_embeds_mask=mask,
                negative_prompt_embeds=torch.randn(1, 6, 48, generator=g),
                negative_prompt_embeds_mask=torch.ones(1, 6, dtype=torch.long),
                true_cfg_scale=cfg_scale, height=64, width=80, num_inference_steps=STEPS, output_type="latent")


def _run(pipe, seed=0, **overrides):
    """The pipeline's latents and how many transformer forwards ran on this rank."""
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        out = pipe(**{**_call_kwargs(), **overrides}, generator=torch.Generator().manual_seed(seed)).images
    finally:
        handle.remove()
    return out, len(calls)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def two_ranks(rank, world):
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

    from flashflow.integrations.diffusers import disable, enable
    report = {}
    pipe = _pipeline()
    diffusers_out, _ = _run(pipe)                  # diffusers' own processors, one process
    enable(pipe.transformer)
    want, report["one_process_calls"] = _run(pipe)
    no_cfg, _ = _run(pipe, true_cfg_scale=1.0)
    report["cfg_matters"] = _rel(no_cfg, want)
    x = dict(hidden_states=torch.randn(1, 20, 16), encoder_hidden_states=torch.randn(1, 8, 48),
             timestep=torch.full((1,), 0.5), img_shapes=[[(1, 4, 5)]], return_dict=False)
    with torch.no_grad():
        direct = pipe.transformer(**x)[0]

    enable_cfg_parallel(pipe)
    report["enabled"] = is_cfg_parallel(pipe)
    report["class_names"] = [type(pipe).__name__, type(pipe.transformer).__name__]
    got, report["cfg_calls"] = _run(pipe)
    report["cfg_vs_one_process"] = _rel(got, want)
    report["nan"] = bool(got.isnan().any())
    # the same embeddings laid out otherwise: a transposed view, a non-unit last stride, a
    # stride-0 mask (the same values)
    call = _call_kwargs()
    pe, ne = call["prompt_embeds"], call["negative_prompt_embeds"]
    strided, _ = _run(pipe, prompt_embeds=pe.transpose(1, 2).contiguous().transpose(1, 2),
                      negative_prompt_embeds=torch.stack([ne, ne], dim=-1)[..., 0],
                      negative_prompt_embeds_mask=torch.ones(1, 1, dtype=torch.long).expand(1, 6))
    report["layouts_vs_contiguous"] = _rel(strided, got)
    # a NaN in the negative prompt: the unconditional branch (the other rank's) carries it
    nan_ne = ne.clone()
    nan_ne[0, 2, 7] = float("nan")
    nan_got, _ = _run(pipe, negative_prompt_embeds=nan_ne)
    disable_cfg_parallel(pipe)
    nan_want, _ = _run(pipe, negative_prompt_embeds=nan_ne)
    enable_cfg_parallel(pipe)
    report["nan_somewhere"] = bool(nan_want.isnan().any())
    report["nan_pattern_equal"] = bool(torch.equal(nan_got.isnan(), nan_want.isnan()))
    fin = ~nan_want.isnan()
    report["nan_finite_part"] = _rel(nan_got[fin], nan_want[fin]) if fin.any() else 0.0
    got_no_cfg, report["no_cfg_calls"] = _run(pipe, true_cfg_scale=1.0)
    report["no_cfg_vs_one_process"] = _rel(got_no_cfg, no_cfg)
    with torch.no_grad():
        report["direct_call"] = _rel(pipe.transformer(**x)[0], direct)
    try:
        _run(pipe, seed=rank)   # each rank its own seed: different latents
        report["different_seeds"] = "ran"
    except ValueError as e:
        report["different_seeds"] = str(e)
    got_after, _ = _run(pipe)   # the pipeline is still usable after the refusal
    report["after_refusal"] = _rel(got_after, want)

    disable(pipe.transformer)   # diffusers' own processors under CFG parallel
    got_diffusers, _ = _run(pipe)
    report["diffusers_processors"] = _rel(got_diffusers, diffusers_out)

    disable_cfg_parallel(pipe)
    report["restored"] = (type(pipe) is QwenImagePipeline and type(pipe.transformer) is QwenImageTransformer2DModel
                          and not is_cfg_parallel(pipe))
    again, report["disabled_calls"] = _run(pipe)
    report["disabled_vs_diffusers"] = _rel(again, diffusers_out)

    # the transformer's own context parallelism over the same two ranks: refused, in either order
    torch.accelerator.device_count = lambda: 1   # diffusers 0.42.1 picks rank % device_count: 0 here
    cp_pipe = _pipeline()
    enable(cp_pipe.transformer)
    enable_cfg_parallel(cp_pipe)
    cp_pipe.transformer.enable_parallelism(config=diffusers.ContextParallelConfig(ulysses_degree=2))
    try:
        _run(cp_pipe)
        report["parallelism_after"] = "ran"
    except ValueError as e:
        report["parallelism_after"] = str(e)
    disable_cfg_parallel(cp_pipe)
    try:
        enable_cfg_parallel(cp_pipe)
        report["parallelism_before"] = "accepted"
    except ValueError as e:
        report["parallelism_before"] = str(e)
    report["parallelism_left_alone"] = not is_cfg_parallel(cp_pipe)

    singles = [dist.new_group([0]), dist.new_group([1])]
    try:
        enable_cfg_parallel(pipe, singles[rank])
        report["group_of_one"] = "accepted"
    except ValueError as e:
        report["group_of_one"] = str(e)
    report["left_alone"] = type(pipe) is QwenImagePipeline
    return report


def four_ranks(rank, world):
    """CFG 2 × Ulysses 2: a (cfg, ring, ulysses) mesh of shape (2, 1, 2), each branch's Ulysses over
    two ranks, flashflow's processor."""
    from torch.distributed.device_mesh import init_device_mesh

    from flashflow.integrations.diffusers import enable
    torch.accelerator.device_count = lambda: 1   # diffusers 0.42.1 picks rank % device_count: 0 here
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("cfg", "ring", "ulysses"))
    pipe = _pipeline()
    enable(pipe.transformer)
    want, _ = _run(pipe)
    pipe.transformer.enable_parallelism(config=diffusers.ContextParallelConfig(ulysses_degree=2, mesh=mesh))
    enable_cfg_parallel(pipe, mesh["cfg"])
    got, calls = _run(pipe)
    return dict(cfg_vs_one_process=_rel(got, want), calls=calls, nan=bool(got.isnan().any()))


@pytest.fixture(scope="module")
def two():
    return [r["result"] for r in gloo.run(2, two_ranks, timeout=600)]


@pytest.fixture(scope="module")
def four():
    return [r["result"] for r in gloo.run(4, four_ranks, timeout=600)]


def test_each_rank_runs_one_branch_and_gets_the_one_process_result(two):
    for r in two:
        assert r["one_process_calls"] == 2 * STEPS
        assert r["cfg_matters"] > 1e-2, r   # the negative branch moves the result 1000 × TOL: a wrong half shows
        assert r["enabled"] and r["class_names"] == ["QwenImagePipeline", "QwenImageTransformer2DModel"]
        assert r["cfg_calls"] == STEPS, r
        assert not r["nan"]
        assert r["cfg_vs_one_process"] < TOL, r


def test_non_contiguous_embeddings_give_the_contiguous_result(two):
    assert all(r["layouts_vs_contiguous"] < TOL for r in two), two


def test_a_nan_in_one_branch_reaches_what_one_process_gives(two):
    for r in two:
        assert r["nan_somewhere"] and r["nan_pattern_equal"], r
        assert r["nan_finite_part"] < TOL, r


def test_without_true_cfg_every_rank_runs_the_transformer_itself(two):
    for r in two:
        assert r["no_cfg_calls"] == STEPS
        assert r["no_cfg_vs_one_process"] < TOL, r


def test_the_transformer_called_outside_the_pipeline_is_untouched(two):
    assert all(r["direct_call"] == 0.0 for r in two)


def test_ranks_given_different_latents_are_refused(two):
    for r in two:
        assert "different transformer inputs" in r["different_seeds"], r
        assert r["after_refusal"] < TOL, r


def test_diffusers_own_processors_under_cfg_parallel(two):
    assert all(r["diffusers_processors"] < TOL for r in two), two


def test_disable_restores_the_pipeline(two):
    for r in two:
        assert r["restored"]
        assert r["disabled_calls"] == 2 * STEPS
        assert r["disabled_vs_diffusers"] < TOL


def test_a_cfg_group_sharing_ranks_with_the_transformer_parallelism_is_refused(two):
    for r in two:
        for order in ("parallelism_after", "parallelism_before"):
            assert "would then mix the two branches" in r[order], (order, r[order])
        assert r["parallelism_left_alone"]


def test_a_group_of_one_rank_is_refused(two):
    for r in two:
        assert "group: CFG parallel runs the two branches of a step on a group of 2 ranks, got 1" in r["group_of_one"]
        assert r["left_alone"]


def test_cfg_parallel_composes_with_ulysses_on_four_ranks(four):
    for r in four:
        assert r["calls"] == STEPS
        assert not r["nan"]
        assert r["cfg_vs_one_process"] < TOL, four


# ---------------------------------------------------------------------------------------------
# one process: refusals and the pairing's own checks (no collective reached)
# ---------------------------------------------------------------------------------------------


def test_refusals_before_anything_changes():
    with pytest.raises(TypeError, match="pipe: one of diffusers' Qwen-Image pipelines"):
        enable_cfg_parallel(object())
    pipe = _pipeline()
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="needs torch.distributed initialized"):
            enable_cfg_parallel(pipe)
    assert not is_cfg_parallel(pipe) and type(pipe).__mro__[1] is not cfg_parallel._CfgPipeline
    assert disable_cfg_parallel(pipe) is pipe   # a no-op on a pipeline without it


def _state():
    transformer = types.SimpleNamespace(proj_out=types.SimpleNamespace(out_features=16))
    state = cfg_parallel._CfgState(None, 0, object, object)
    state.depth, state.encodes = 1, 2   # inside a pipeline call with a negative prompt encoded
    return state, transformer


def _forward(**kw):
    raise AssertionError("no transformer pass may run in these cases")


KW = dict(hidden_states=torch.zeros(1, 20, 16), return_dict=False)


def test_a_pass_outside_the_two_cache_contexts_is_refused():
    state, transformer = _state()
    with pytest.raises(RuntimeError, match=r"cache_context\('cond'\).*under None"):
        state.call(transformer, _forward, (), KW)


def test_a_second_conditional_pass_is_refused():
    state, transformer = _state()
    state.context = "cond"
    (first,) = state.call(transformer, _forward, (), KW)
    assert first.shape == (1, 20, 16) and first.isnan().all()   # NaN until the unconditional pass fills it
    with pytest.raises(RuntimeError, match="second conditional"):
        state.call(transformer, _forward, (), KW)


def test_an_unconditional_pass_alone_is_refused():
    state, transformer = _state()
    state.context = "uncond"
    with pytest.raises(RuntimeError, match="without the conditional one"):
        state.call(transformer, _forward, (), KW)


def test_a_pipeline_call_ending_with_a_pending_conditional_pass_is_refused():
    state, transformer = _state()
    state.context = "cond"
    out = state.call(transformer, _forward, (), dict(KW, return_dict=True))
    assert out.sample.isnan().all()
    with pytest.raises(RuntimeError, match="never came"):
        state.end()
    state.end()   # nothing pending any more
