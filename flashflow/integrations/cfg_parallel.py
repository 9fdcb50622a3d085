"""CFG parallel for diffusers' Qwen-Image pipelines: the conditional and the unconditional
transformer passes of a true-CFG step run at the same time on two ranks (or two groups of
ranks), and one all-gather gives every rank both outputs.

    enable_cfg_parallel(pipe, group)     # group: 2 ranks (a ProcessGroup or a 1-D DeviceMesh)
    image = pipe(prompt, negative_prompt=..., true_cfg_scale=4.0, generator=same_seed_on_every_rank)
    disable_cfg_parallel(pipe)

Every rank calls the pipeline with the same arguments and the same generator seed, as under
diffusers' own ``enable_parallelism``; every rank gets the whole result. The pipelines
(``QwenImagePipeline``, ``QwenImageEditPipeline``, ``QwenImageEditPlusPipeline`` and the other
Qwen-Image pipelines of diffusers) run, per step::

    with transformer.cache_context("cond"):
        noise_pred = transformer(**cond)[0]
    if do_true_cfg:
        with transformer.cache_context("uncond"):
            neg_noise_pred = transformer(**uncond)[0]
        comb_pred = neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)

and read ``noise_pred`` only after the second call. Under CFG parallel the conditional call runs
nothing: it keeps its arguments and returns a view of a two-row output buffer (filled with NaN).
The unconditional call runs this rank's branch (position 0 of the group: the conditional inputs,
position 1: the unconditional ones) and all-gathers the two outputs into that buffer, so the
tensor the first call returned holds the conditional output by the time the pipeline reads it,
and the second call returns the other row.

Whether a step has an unconditional call is the pipeline's own decision (``true_cfg_scale > 1``
and a negative prompt): it encodes the negative prompt exactly when it runs true CFG, so the
pipeline call counts its ``encode_prompt`` calls; a call without true CFG runs the transformer on
every rank as before. Anything off the pattern (a second conditional pass before the
unconditional one, an unconditional pass alone, a pass outside the two cache contexts, a pipeline
call that ends with a conditional output never filled) raises a ``RuntimeError``; ranks given
different inputs (another seed, another prompt) raise a ``ValueError`` at the first paired step
(one host synchronisation per pipeline call): never a silently mixed step.

Composes with diffusers' context parallelism: with 4 GPUs, a ``(cfg, ring, ulysses)`` device mesh
of shape ``(2, 1, 2)``, ``ContextParallelConfig(ulysses_degree=2, mesh=mesh)`` for the transformer
(flashflow's processor or diffusers' own) and ``enable_cfg_parallel(pipe, mesh["cfg"])``: each
branch runs Ulysses over its two GPUs (docs/distributed.md).
"""
from __future__ import annotations

import contextlib
import zlib

import torch
import torch.distributed as dist

try:
    from diffusers.models.modeling_outputs import Transformer2DModelOutput
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
    from diffusers.pipelines import qwenimage as _qwenimage
except ImportError as e:   # pragma: no cover - depends on the environment
    raise ImportError("flashflow.integrations.cfg_parallel needs diffusers (pip install diffusers)") from e

__all__ = ["enable_cfg_parallel", "disable_cfg_parallel", "is_cfg_parallel", "SUPPORTED_PIPELINES"]

# Every Qwen-Image pipeline of diffusers: each encodes the negative prompt exactly when it runs true
# CFG and calls the transformer under cache_context("cond") then, with true CFG, ("uncond").
SUPPORTED_PIPELINES = tuple(getattr(_qwenimage, name) for name in (
    "QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline", "QwenImageImg2ImgPipeline",
    "QwenImageInpaintPipeline", "QwenImageEditInpaintPipeline", "QwenImageControlNetPipeline",
    "QwenImageControlNetInpaintPipeline", "QwenImageLayeredPipeline") if hasattr(_qwenimage, name))

_STATE = "_flashflow_cfg_parallel"   # the _CfgState, on the pipeline and on its transformer
_BRANCHES = ("cond", "uncond")        # the pipelines' cache_context names, in call order


class _CfgState:
    """The pairing of one pipeline's transformer calls; lives on the pipeline and the transformer."""

    def __init__(self, group, position: int, pipe_class, transformer_class):
        self.group = group
        self.position = position   # in the group; 0: the conditional branch, 1: the unconditional one
        self.classes = (pipe_class, transformer_class)
        self.depth = 0            # pipeline calls under way (a nested call is refused)
        self.encodes = 0          # encode_prompt calls in this pipeline call
        self.context = None       # the cache_context the transformer runs under
        self.pending = None       # (args, kwargs, two-row buffer) of a conditional call not yet run
        self.checked = False      # the ranks' inputs compared in this pipeline call

    def begin(self) -> None:
        self.encodes, self.pending, self.checked = 0, None, False

    def call(self, transformer, forward, args, kwargs):
        if self.encodes < 2:   # no negative prompt encoded: no true CFG in this pipeline call
            return forward(*args, **kwargs)
        if self.context not in _BRANCHES:
            raise RuntimeError(
                f"CFG parallel pairs the pipeline's transformer passes under cache_context('cond') and "
                f"cache_context('uncond'); a pass ran under {self.context!r}")
        if self.context == "cond":
            if self.pending is not None:
                raise RuntimeError("CFG parallel: a second conditional transformer pass before the "
                                   "unconditional one of the same step")
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            rows = hidden.shape[:-1] + (transformer.proj_out.out_features,)
            buffer = torch.full((2, *rows), float("nan"), dtype=hidden.dtype, device=hidden.device)
            self.pending = (args, kwargs, buffer)
            return _result(kwargs, buffer[0])
        if self.pending is None:
            raise RuntimeError("CFG parallel: an unconditional transformer pass without the conditional one "
                               "before it")
        cond_args, cond_kwargs, buffer = self.pending
        self.pending = None
        if not self.checked:
            _check_separate_groups(transformer, self.group)   # enable_parallelism may have come later
            _check_same_inputs(self.group, (cond_args, cond_kwargs, args, kwargs), buffer.device)
            self.checked = True
        mine = (cond_args, cond_kwargs) if self.position == 0 else (args, kwargs)
        out = _sample(forward(*mine[0], **mine[1]))
        if out.shape != buffer.shape[1:] or out.dtype != buffer.dtype:
            raise RuntimeError(f"CFG parallel: the transformer returned {tuple(out.shape)} {out.dtype}, not "
                               f"{tuple(buffer.shape[1:])} {buffer.dtype} (the latents' rows and dtype)")
        dist.all_gather_into_tensor(buffer.view(2 * out.shape[0], *out.shape[1:]), out.contiguous(),
                                    group=self.group)
        return _result(kwargs, buffer[1])

    def end(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            raise RuntimeError("CFG parallel: the pipeline call ended with a conditional transformer pass "
                               "whose unconditional pass never came; its output was never computed")


def _sample(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result.sample


def _result(kwargs, sample: torch.Tensor):
    """The transformer's return structure for ``sample`` (``return_dict`` as the call asked)."""
    return Transformer2DModelOutput(sample=sample) if kwargs.get("return_dict", True) else (sample,)


def _leaves(value, out: list):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _leaves(v, out)
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            out.append(zlib.crc32(repr(k).encode()))
            _leaves(value[k], out)
    else:
        out.append(zlib.crc32(repr(value).encode()))
    return out


def _model_parallel_ranks(transformer) -> set:
    """The ranks this rank runs the transformer's passes with under diffusers' ``enable_parallelism``:
    its context-parallel group (ring × Ulysses) and its tensor-parallel group; empty without."""
    config = getattr(transformer, "_parallel_config", None)
    ranks = set()
    cp = getattr(config, "context_parallel_config", None)
    if getattr(cp, "_flattened_mesh", None) is not None:
        ranks |= set(cp._flattened_mesh.mesh.flatten().tolist())
    tp = getattr(config, "tensor_parallel_config", None)
    if getattr(tp, "_mesh", None) is not None:
        ranks |= set(tp._mesh.mesh.flatten().tolist())
    return ranks


def _check_separate_groups(transformer, group) -> None:
    """The two ranks of the CFG group run different branches: neither may be in the other's
    context- or tensor-parallel group, whose collectives would pair one branch's data with the
    other's."""
    cfg_ranks = set(dist.get_process_group_ranks(group))
    shared = (_model_parallel_ranks(transformer) & cfg_ranks) - {dist.get_rank()}
    if shared:
        raise ValueError(
            f"group: CFG parallel runs a different branch on each of the ranks {sorted(cfg_ranks)}, but the "
            f"transformer's enable_parallelism group of this rank also holds rank(s) {sorted(shared)}, whose "
            "collectives would then mix the two branches; put CFG and the context/tensor parallelism on separate "
            "dimensions of one device mesh (docs/distributed.md)")


def _check_same_inputs(group, inputs, device) -> None:
    """Every rank of ``group`` was given the same inputs for both branches (one all-gather of a few
    numbers per input and one host synchronisation)."""
    stats, values = [], []   # per tensor (sum, sum of squares) on the device; the rest from the host, one copy
    for leaf in _leaves(inputs, []):
        if isinstance(leaf, torch.Tensor):
            x = leaf.detach().to(device=device, dtype=torch.float64)
            stats.append(torch.stack([x.sum(), x.square().sum()]))
            values.append(float(x.numel()))
        else:
            values.append(float(leaf))
    mine = torch.tensor(values, dtype=torch.float64).to(device)
    if stats:
        mine = torch.cat([torch.cat(stats), mine])
    every = torch.empty(2 * mine.numel(), device=device, dtype=torch.float64)
    dist.all_gather_into_tensor(every, mine, group=group)
    a, b = every.view(2, -1).cpu()
    if not bool(((a == b) | (a.isnan() & b.isnan())).all()):
        raise ValueError("CFG parallel: the two ranks of the group were given different transformer inputs; call "
                         "the pipeline with the same arguments and the same generator seed on every rank")


class _CfgPipeline:
    """Mixed into the pipeline's class by :func:`enable_cfg_parallel`."""

    def __call__(self, *args, **kwargs):
        state = self.__dict__[_STATE]
        if state.depth:
            raise RuntimeError("CFG parallel: a pipeline call inside another call of the same pipeline")
        state.depth += 1
        state.begin()
        try:
            result = super().__call__(*args, **kwargs)
            state.end()
        finally:
            state.depth -= 1
            state.pending = None
        return result

    def encode_prompt(self, *args, **kwargs):
        state = self.__dict__[_STATE]
        if state.depth:
            state.encodes += 1
        return super().encode_prompt(*args, **kwargs)


class _CfgTransformer:
    """Mixed into the transformer's class by :func:`enable_cfg_parallel`."""

    def __call__(self, *args, **kwargs):
        state = self.__dict__.get(_STATE)
        if state is None or not state.depth:   # called outside the pipeline: the transformer itself
            return super().__call__(*args, **kwargs)
        return state.call(self, super().__call__, args, kwargs)

    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs):
        state = self.__dict__.get(_STATE)
        with super().cache_context(name, **kwargs):
            outer = state.context if state is not None else None
            if state is not None:
                state.context = name
            try:
                yield
            finally:
                if state is not None:
                    state.context = outer


_MIXED: dict[tuple[type, type], type] = {}


def _mixed(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin`` in front, under the same name (diffusers records class names in configs)."""
    key = (mixin, cls)
    if key not in _MIXED:
        _MIXED[key] = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _MIXED[key]


def _group(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("enable_cfg_parallel needs torch.distributed initialized (init_process_group)")
    if group is None:
        group = dist.group.WORLD
    elif isinstance(group, dist.device_mesh.DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group: a 1-D DeviceMesh (e.g. mesh['cfg']), got one of {group.ndim} dimensions")
        group = group.get_group()
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}")
    size = dist.get_world_size(group)
    if size != 2:
        raise ValueError(f"group: CFG parallel runs the two branches of a step on a group of 2 ranks, got {size} "
                         "(with more GPUs, give the transformer a context-parallel mesh for the rest)")
    if dist.get_rank(group) < 0:
        raise ValueError("group: this rank is not a member of the group")
    return group


def is_cfg_parallel(pipe) -> bool:
    return _STATE in getattr(pipe, "__dict__", {})


def enable_cfg_parallel(pipe, group=None):
    """Run the conditional and unconditional transformer passes of each true-CFG step of ``pipe``
    on the two ranks of ``group`` (None: the whole world, which must be 2 ranks); in place, returns
    ``pipe``. Every rank calls the pipeline with the same arguments and generator seed."""
    if not isinstance(pipe, SUPPORTED_PIPELINES):
        raise TypeError(f"pipe: one of diffusers' Qwen-Image pipelines "
                        f"({', '.join(c.__name__ for c in SUPPORTED_PIPELINES)}), got {type(pipe).__name__}")
    transformer = getattr(pipe, "transformer", None)
    if not isinstance(transformer, QwenImageTransformer2DModel):
        raise TypeError(f"pipe.transformer: a QwenImageTransformer2DModel, got {type(transformer).__name__}")
    group = _group(group)
    _check_separate_groups(transformer, group)
    if is_cfg_parallel(pipe):
        if pipe.__dict__[_STATE].group is group:
            return pipe
        disable_cfg_parallel(pipe)
    state = _CfgState(group, dist.get_rank(group), type(pipe), type(transformer))
    pipe.__dict__[_STATE] = state
    transformer.__dict__[_STATE] = state
    pipe.__class__ = _mixed(_CfgPipeline, type(pipe))
    transformer.__class__ = _mixed(_CfgTransformer, type(transformer))
    return pipe


def disable_cfg_parallel(pipe):
    """Undo :func:`enable_cfg_parallel` (a no-op on a pipeline without it); returns ``pipe``."""
    state = pipe.__dict__.pop(_STATE, None) if hasattr(pipe, "__dict__") else None
    if state is None:
        return pipe
    pipe_class, transformer_class = state.classes
    pipe.__class__ = pipe_class
    transformer = pipe.transformer
    transformer.__dict__.pop(_STATE, None)
    if isinstance(transformer, _CfgTransformer):
        transformer.__class__ = transformer_class
    return pipe
