"""flashflow inside diffusers' Qwen-Image transformer: one call, in place; the weights untouched
unless ``linear="fp8"`` asks for FP8 layers (then kept on the host and put back by ``disable``).

``enable(transformer)`` swaps, in every ``QwenImageTransformerBlock``:

- the attention processor for :class:`FlashflowQwenAttnProcessor`: diffusers' six
  projections, then one ``joint_qkv_norm_rope`` launch for q, k and v of both streams (the four q/k
  RMSNorm + RoPE passes, written straight into the joint ``[text, image]`` buffers, and the v
  concatenation: no ``torch.cat``; a pass per stream where the four norms' weights differ in
  dtype, or without RoPE), then flashflow's attention over the joint sequence, exact
  (``flash_attn_func``, ``attention="exact"``) or with 8-bit products (``flash_attn_fp8_func``,
  ``attention="fp8"``); with a text padding mask, the op's ``key_padding_mask`` over the text
  keys alone: the image keys run the kernel's unmasked loop, and no dense mask is ever built;
- the block's ``forward`` for one that does the same math with fused passes:
  ``layernorm_modulate`` (norm1 + AdaLN modulate), ``gate_residual_layernorm_modulate`` (gate ·
  attention + residual, norm2, modulate), ``gate_residual`` after the MLP, and on CUDA the MLP's
  first Linear with cuBLASLt's bias + GELU(tanh) epilogue;
- with ``linear="fp8"``, every Linear of the block for :class:`flashflow.ops.fp8_linear.Fp8Linear`
  (q/k/v of a stream as one fused GEMM), the norms writing the GEMMs' inputs as e4m3 rows.

``disable(transformer)`` puts the original processor objects, the class's ``forward`` and the
original Linear modules back, so the model computes exactly what it computed before ``enable``.

Inference only: the fused block ops have no backward, so a model in training mode is refused, and a
block or processor called with autograd recording and a parameter or input that requires grad
raises one ``ValueError`` at its entry (docs/diffusion.md).

Several GPUs: diffusers' context parallelism (``enable_parallelism`` with a
``ContextParallelConfig``: ``ulysses_degree``, ``ring_degree`` or both), in either order of
``enable`` and ``enable_parallelism``. diffusers' hooks split the text and image streams along
the sequence; the processor runs the fused norm/RoPE pass on its rank's slice, then
:func:`flashflow.distributed.context_attention` (an exchange to head slices of the whole
sequence, through the other GPUs' memory where the group is NCCL, else NCCL's or gloo's
all-to-all; a ring of K/V slices merged by their LSE; or both) with flashflow's attention, exact
or FP8 (docs/diffusion.md, docs/distributed.md). ``ulysses_anything`` / ``ring_anything`` (uneven slices) and tensor
parallelism are refused with a ``ValueError``. CFG parallel, the conditional and unconditional
passes of a pipeline step on two ranks or two groups of ranks, is a pipeline-level switch:
:func:`flashflow.integrations.cfg_parallel.enable_cfg_parallel`. Under context parallelism the
AdaLN modulations (``img_mod`` / ``txt_mod`` of every block, which depend on the timestep
embedding alone) are computed once a call and shared out while a CUDA graph is captured: each
rank of the group runs whole modules in turn and one all-gather gives every rank all of them
(:class:`_ModulationTable`), so their weights are read once over the group instead of once a
rank.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn

try:
    from diffusers.models.activations import GELU as _DiffusersGELU
    from diffusers.models.normalization import RMSNorm as _DiffusersRMSNorm
    from diffusers.models.transformers.transformer_qwenimage import (
        QwenDoubleStreamAttnProcessor2_0,
        QwenImageTransformer2DModel,
        QwenImageTransformerBlock,
    )
except ImportError as e:   # pragma: no cover - depends on the environment
    raise ImportError("flashflow.integrations.diffusers needs diffusers (pip install diffusers)") from e

from flashflow.device import interpreting
from flashflow.distributed.attention import context_attention
from flashflow.ops.attention import flash_attn_func
from flashflow.ops.attention_fp8 import FP8_HEAD_DIMS, flash_attn_fp8_func
from flashflow.ops.fp8_linear import GEMM_MULTIPLE, Fp8Linear, Fp8Weight, quantize_weight
from flashflow.ops.norm import (gate_residual, gate_residual_layernorm_modulate, joint_qkv_norm_rope,
                                joint_qkv_norm_rope_, layernorm_modulate, rmsnorm_rope)
from flashflow.ops.quant import Fp8Rows, gelu_quantize_rows

__all__ = ["enable", "disable", "is_enabled", "FlashflowQwenAttnProcessor", "SUPPORTED_MODELS",
           "ATTENTION_MODES", "LINEAR_MODES"]

SUPPORTED_MODELS = (QwenImageTransformer2DModel,)
# "exact": flash_attn_func, exact attention in the model's own dtype (bf16, fp16 or fp32 models alike);
# "fp8": flash_attn_fp8_func, Q·Kᵀ in INT8 and P·V in e4m3 (bf16 or fp16 models, Hopper or newer).
ATTENTION_MODES = ("exact", "fp8")
# "exact": the model's own nn.Linear layers, untouched; "fp8": every Linear of every block as
# flashflow.ops.fp8_linear.Fp8Linear (e4m3 weights per output channel, e4m3 activations per row).
LINEAR_MODES = ("exact", "fp8")
_FP8_DTYPES = (torch.bfloat16, torch.float16)

# With linear="fp8", the fused q/k/v projection of each stream (one GEMM over the three weights,
# which the to_q / to_k / to_v modules view) is a submodule of the attention module by these names.
_QKV, _ADD_QKV = "flashflow_to_qkv", "flashflow_add_qkv"
# The original nn.Linear modules a block's FP8 layers replaced, {path: (module on the CPU, its device)}.
_ORIGINAL_LINEARS = "_flashflow_original_linears"

# The original (processor, instance-level forward or None) of a block, kept on the block itself.
_ORIGINAL = "_flashflow_original"
# The transformer's _ModulationTable (and each block's reference to it), set by enable.
_MODULATIONS = "_flashflow_modulations"
# Under context parallelism, while a CUDA graph is captured, the blocks' AdaLN modulations are
# shared out over the group (_ModulationTable); False: every rank computes all of them, for
# measurements.
SHARE_MODULATIONS = True

# cuBLASLt's bias + GELU epilogue is the tanh approximation; CPU builds of this private op use the
# erf GELU instead, hence CUDA only.
_HAS_ADDMM_ACTIVATION = hasattr(torch, "_addmm_activation")


# --------------------------------------------------------------------------------------------
# the attention processor
# --------------------------------------------------------------------------------------------


def _context_parallel(config):
    """The ``ContextParallelConfig`` of a diffusers ``ParallelConfig`` (what ``enable_parallelism``
    hands the processors), or None: no config, or tensor parallelism only."""
    return getattr(config, "context_parallel_config", None)


def _context_parallel_refused(config, heads: int | None = None) -> ValueError | None:
    """The error for a context-parallel config flashflow's processor cannot run, else None:
    uneven slices (``ulysses_anything`` / ``ring_anything``), or a Ulysses degree that does not
    divide the heads (``heads``, when known)."""
    cp = _context_parallel(config)
    if cp is None:
        return None
    what = (f"ContextParallelConfig(ring_degree={cp.ring_degree}, ulysses_degree={cp.ulysses_degree}"
            f"{', ulysses_anything=True' if cp.ulysses_anything else ''}{', ring_anything=True' if cp.ring_anything else ''})")
    if cp.ulysses_anything or cp.ring_anything:
        return ValueError(
            f"{what} with flashflow.integrations.diffusers.enable(): flashflow's processor runs equal sequence slices "
            "only (the sequence length a multiple of the degrees); leave ulysses_anything / ring_anything off, or use "
            "diffusers' own processors (flashflow.integrations.diffusers.disable(transformer) first)")
    if heads is not None and heads % cp.ulysses_degree:
        return ValueError(
            f"{what}: Ulysses splits the attention heads across ranks, and the model's {heads} heads are not a "
            f"multiple of ulysses_degree={cp.ulysses_degree}; use a ulysses_degree that divides {heads}, or "
            "ring_degree")
    return None


def _tensor_parallel_refused(config) -> ValueError | None:
    """The error for a diffusers ``ParallelConfig`` with tensor parallelism, else None."""
    tp = getattr(config, "tensor_parallel_config", None)
    if tp is None:
        return None
    return ValueError(
        f"tensor parallelism ({type(tp).__name__}, diffusers' enable_parallelism or "
        "from_pretrained(parallel_config=...)) with flashflow.integrations.diffusers.enable(): flashflow's fused "
        "block ops read the Linear layers' weights themselves and have not been checked on sharded weights, so "
        "they are refused rather than risk a wrong result. Run the parallel model with diffusers' own processors "
        "(flashflow.integrations.diffusers.disable(transformer) first), or flashflow on one GPU")


def _trainable_parameter(module: nn.Module, skip: nn.Module | None = None) -> str | None:
    """The name of a parameter of ``module`` (outside its submodule ``skip``) that requires grad, or
    None: a plain walk of the module tree, without ``module.parameters()``'s nested generators and
    names (the name is looked up on a hit only)."""
    stack = [module]
    while stack:
        mod = stack.pop()
        if mod is None or mod is skip:
            continue
        for p in mod._parameters.values():
            if p is not None and p.requires_grad:
                return next(name for name, q in module.named_parameters() if q is p)
        stack.extend(reversed(mod._modules.values()))   # popped in the modules' order
    return None


def _refuse_autograd(module: nn.Module, where: str, skip: nn.Module | None = None, **inputs) -> None:
    """Called while autograd records (``torch.is_grad_enabled()``): one look at the block's (or the
    attention module's) parameters and inputs, so that the user reads what to do instead of the
    first fused op's ``x requires grad`` about a tensor inside it. Under ``torch.no_grad()`` /
    ``torch.inference_mode()`` (pipelines) the caller's ``is_grad_enabled()`` is the whole cost. The
    block skips its attention module, which the processor looks at."""
    param = _trainable_parameter(module, skip)
    if param is not None:
        situation = f"the transformer's parameters require grad ({where}'s {param}, among others)"
        fix = "or freeze the model with transformer.requires_grad_(False)"
    else:
        name = next((n for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if name is None:
            return
        situation = f"{where}'s input {name} requires grad"
        fix = "or pass inputs that do not require grad (.detach())"
    raise ValueError(
        f"flashflow's Qwen-Image blocks run with autograd recording, and {situation}; flashflow's diffusion ops "
        f"(the fused norms, RoPE and gates, FP8 attention) have no backward. Run the model under torch.no_grad() "
        f"or torch.inference_mode() (diffusers' pipelines do), {fix}; to train, call "
        "flashflow.integrations.diffusers.disable(transformer) first")


def _rows(x):
    """The tensor of a stream's activation: ``x`` itself, or the e4m3 data of an ``Fp8Rows``."""
    return x.data if isinstance(x, Fp8Rows) else x


def _norm_rope_into(norm: nn.Module, x: torch.Tensor, freqs, out: torch.Tensor) -> None:
    """RMSNorm (+ RoPE when ``freqs`` is given) of ``x`` (B, S, H, D), written into ``out``."""
    if freqs is None:
        # rmsnorm_rope always rotates; without RoPE (never the case inside the model's own
        # forward) the norm is diffusers' module.
        out.copy_(norm(x))
    else:
        rmsnorm_rope(x, norm.weight, freqs, eps=norm.eps, out=out)


class FlashflowQwenAttnProcessor:
    """Joint [text, image] attention of a Qwen-Image block through flashflow's kernels; a
    drop-in for diffusers' ``QwenDoubleStreamAttnProcessor2_0`` (same call, same outputs up to
    rounding with ``attention="exact"``, up to FP8 attention's error with ``"fp8"``).

    ``attention``: one of :data:`ATTENTION_MODES`; :func:`enable` sets it (and checks that the
    model can run it). ``heads``: the attention module's head count, when known (a Ulysses degree
    that does not divide it is refused when the parallel config arrives). Under diffusers' context
    parallelism (the config ``enable_parallelism`` hands it) each rank's slice of the joint
    sequence attends to the whole sequence through :func:`flashflow.distributed.context_attention`;
    a config it cannot run is refused with a ``ValueError`` (``ulysses_anything`` / ``ring_anything``,
    tensor parallelism), and so is a call while autograd records with parameters or inputs that
    require grad (no backward)."""

    def __init__(self, attention: str = "exact", heads: int | None = None):
        self.attention = _check_attention(attention)
        self.heads = heads
        self._given_parallel_config = None
        self._refusal = None

    # diffusers hands its parallel config to every processor that has this attribute
    # (ModelMixin.enable_parallelism: ``if hasattr(processor, "_parallel_config"): processor._parallel_config =
    # config``), before it installs the hooks that split the sequence across ranks. Refusing a config here stops
    # enable_parallelism there, with the model still whole; a refused config is kept, so that a model run after the
    # refusal raises too (__call__) and disable() can undo what enable_parallelism had recorded.
    @property
    def _parallel_config(self):
        return self._given_parallel_config

    @_parallel_config.setter
    def _parallel_config(self, config) -> None:
        self._given_parallel_config = config
        self._refusal = _tensor_parallel_refused(config) or _context_parallel_refused(config, self.heads)
        if self._refusal is not None:
            raise self._refusal

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,                       # image stream
        encoder_hidden_states: torch.Tensor | None = None,  # text stream
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._refusal is not None:
            raise self._refusal
        cp = _context_parallel(self._given_parallel_config)
        if cp is not None and self.heads != attn.heads:
            # a processor made without heads (or moved to another module): its config checked against
            # this module's heads once, not at every call
            refused = _context_parallel_refused(self._given_parallel_config, attn.heads)
            if refused is not None:
                raise refused
            self.heads = attn.heads
        if torch.is_grad_enabled():
            _refuse_autograd(attn, "the attention module", hidden_states=hidden_states,
                             encoder_hidden_states=encoder_hidden_states)
        if encoder_hidden_states is None:
            raise ValueError("FlashflowQwenAttnProcessor requires encoder_hidden_states (the text stream)")
        if attention_mask is not None:
            raise ValueError("FlashflowQwenAttnProcessor does not take an attention_mask; pass the text padding "
                             "mask as encoder_hidden_states_mask (batch, text_seqlen), as diffusers' processor does")
        # with linear="fp8" the block hands over its modulated streams as e4m3 rows (Fp8Rows)
        batch, seq_img = _rows(hidden_states).shape[:2]
        seq_txt = _rows(encoder_hidden_states).shape[1]
        head_dim = attn.inner_dim // attn.heads

        img_freqs, txt_freqs = image_rotary_emb if image_rotary_emb is not None else (None, None)
        norms = (attn.norm_added_q, attn.norm_added_k, attn.norm_q, attn.norm_k)
        weights = [norm.weight for norm in norms]
        # joint_qkv_norm_rope runs the four norms on one kernel path: weights all present in one
        # dtype, or all absent
        one_path = (all(w is None for w in weights)
                    or (all(w is not None for w in weights) and len({w.dtype for w in weights}) == 1))

        qkv, add_qkv = attn._modules.get(_QKV), attn._modules.get(_ADD_QKV)
        joint = None
        if qkv is not None and batch == 1 and txt_freqs is not None and one_path:
            # The two streams' fused q/k/v GEMMs write side by side into one (1, S_txt + S_img,
            # 3·inner) buffer, text rows first: the joint v is then where attention reads it (no
            # copy), and q and k are normalised and rotated in place. (With batch > 1 a stream's
            # rows are not one block of such a buffer.)
            joint = torch.empty((1, seq_txt + seq_img, qkv.out_features), dtype=qkv.dtype,
                                device=_rows(hidden_states).device)
            add_qkv(encoder_hidden_states, out=joint[:, :seq_txt])
            qkv(hidden_states, out=joint[:, seq_txt:])
            query, key, value = joint_qkv_norm_rope_(joint.unflatten(-1, (3, -1, head_dim)), seq_txt, *weights,
                                                     txt_freqs, img_freqs, eps=tuple(norm.eps for norm in norms))
        elif qkv is not None:
            # one FP8 GEMM per stream for q, k and v: views of its (B, S, 3·inner) output
            img_q, img_k, img_v = qkv(hidden_states).unflatten(-1, (3, -1, head_dim)).unbind(-3)
            txt_q, txt_k, txt_v = add_qkv(encoder_hidden_states).unflatten(-1, (3, -1, head_dim)).unbind(-3)
        else:
            img_q = attn.to_q(hidden_states).unflatten(-1, (-1, head_dim))
            img_k = attn.to_k(hidden_states).unflatten(-1, (-1, head_dim))
            img_v = attn.to_v(hidden_states).unflatten(-1, (-1, head_dim))
            txt_q = attn.add_q_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
            txt_k = attn.add_k_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
            txt_v = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))

        if joint is None and txt_freqs is not None and one_path:
            # One launch for the four norm + RoPE passes and the three [text, image]
            # concatenations: at Qwen-Image's sizes the step is close to host-bound, and each
            # launch costs host time.
            query, key, value = joint_qkv_norm_rope(txt_q, txt_k, txt_v, img_q, img_k, img_v, *weights, txt_freqs,
                                                    img_freqs, eps=tuple(norm.eps for norm in norms))
        elif joint is None:
            # The [text, image] concatenation is folded into the norm (+ RoPE) pass: each stream
            # is written at its offset of the joint buffer.
            joint_shape = (batch, seq_txt + seq_img, img_q.shape[2], head_dim)
            query = img_q.new_empty(joint_shape)
            key = img_k.new_empty(joint_shape)
            _norm_rope_into(attn.norm_added_q, txt_q, txt_freqs, query[:, :seq_txt])
            _norm_rope_into(attn.norm_q, img_q, img_freqs, query[:, seq_txt:])
            _norm_rope_into(attn.norm_added_k, txt_k, txt_freqs, key[:, :seq_txt])
            _norm_rope_into(attn.norm_k, img_k, img_freqs, key[:, seq_txt:])
            value = torch.cat([txt_v, img_v], dim=1)

        mask = None
        if encoder_hidden_states_mask is not None:
            if tuple(encoder_hidden_states_mask.shape) != (batch, seq_txt):
                raise ValueError(f"encoder_hidden_states_mask must be (batch, text_seqlen) = ({batch}, {seq_txt}), "
                                 f"got shape {tuple(encoder_hidden_states_mask.shape)}")
            # The text keys come first in the joint sequence, so the text mask (nonzero = a real
            # token, as the model's forward normalises it) is a key-padding mask over its first
            # seq_txt keys; the image keys always attend and take the unmasked loop.
            mask = encoder_hidden_states_mask.to(torch.bool)
        if cp is not None:
            # diffusers' hooks gave this rank its slice of both streams (and of the text mask):
            # the joint slice [text slice, image slice] attends to every rank's slice
            out = context_attention(
                query, key, value, cp._ulysses_mesh.get_group() if cp.ulysses_degree > 1 else None,
                cp._ring_mesh.get_group() if cp.ring_degree > 1 else None, key_padding_mask=mask,
                attention=self.attention)
        elif self.attention == "fp8":
            out = flash_attn_fp8_func(query, key, value, key_padding_mask=mask)
        else:
            out = flash_attn_func(query, key, value, key_padding_mask=mask)
        out = out.flatten(2, 3)

        if qkv is not None:
            # the FP8 layers quantize their rows from the strided views: no contiguous copies
            img_out = attn.to_out[0](out[:, seq_txt:])
            txt_out = attn.to_add_out(out[:, :seq_txt])
        else:
            img_out = attn.to_out[0](out[:, seq_txt:].contiguous())
            txt_out = attn.to_add_out(out[:, :seq_txt].contiguous())
        for module in attn.to_out[1:]:   # dropout
            img_out = module(img_out)
        return img_out, txt_out


# --------------------------------------------------------------------------------------------
# the block forward
# --------------------------------------------------------------------------------------------


def _feed_forward(ff: nn.Module, x) -> torch.Tensor:
    """diffusers' ``FeedForward`` (Linear, GELU tanh, dropout, Linear); on CUDA the first Linear
    and the GELU are one cuBLASLt GEMM with a bias + GELU(tanh) epilogue, saving a full write
    and read of the 4·dim-wide hidden activation. With FP8 layers (``x`` an ``Fp8Rows``): the
    first GEMM adds its bias in its epilogue, one pass applies the GELU and quantizes the rows
    for the second (``gelu_quantize_rows``), and the dropouts (identity in eval mode) are
    skipped."""
    act = ff.net[0]
    proj = getattr(act, "proj", None)
    if isinstance(proj, Fp8Linear):
        h = gelu_quantize_rows(proj(x))
        return next(m for m in ff.net[1:] if isinstance(m, Fp8Linear))(h)
    if (x.is_cuda and _HAS_ADDMM_ACTIVATION and type(act) is _DiffusersGELU and act.approximate == "tanh"
            and type(proj) is nn.Linear and type(proj.weight) is nn.Parameter and proj.bias is not None):
        h = torch._addmm_activation(proj.bias, x.reshape(-1, x.shape[-1]), proj.weight.t(), use_gelu=True)
        h = h.view(*x.shape[:-1], h.shape[-1])
        for module in ff.net[1:]:
            h = module(h)
        return h
    return ff(x)


_module = torch.nn.modules.module


def _plain_attention_call(attn) -> bool:
    """``attn(...)`` would run diffusers' ``Attention.forward`` and nothing else (no hook of torch or
    diffusers, no compiled call) into flashflow's processor: the block may call the processor itself."""
    return (isinstance(attn.processor, FlashflowQwenAttnProcessor) and "forward" not in attn.__dict__
            and getattr(attn, "_compiled_call_impl", None) is None
            and not (attn._forward_hooks or attn._forward_pre_hooks or attn._backward_hooks
                     or attn._backward_pre_hooks or _module._global_forward_hooks
                     or _module._global_forward_pre_hooks or _module._global_backward_hooks
                     or _module._global_backward_pre_hooks))


class _ModulationTable:
    """Every block's AdaLN modulation parameters for one call, shared out over diffusers'
    context-parallel group (a forward hook of the transformer's ``time_text_embed``, which makes
    ``temb``).

    The modulations depend on ``temb`` alone, the same on every rank of the group, and each is a
    GEMV that reads a ``6·dim × dim`` weight: run on every rank, the group reads every weight once
    a rank. Here module ``i`` of the list ``[blocks[0].img_mod, blocks[0].txt_mod,
    blocks[1].img_mod, ...]`` runs on rank ``i % world`` alone (whole modules: any kind of layer,
    FP8 ones too, the same bits as on one GPU), into slot ``i // world`` of that rank's piece, and
    one ``all_gather_into_tensor`` gives every rank all of them; each block then reads its two as
    views of the gathered buffer. The table holds them for the ``temb`` it saw (the same tensor
    object the model hands every block); a block called with any other ``temb``, outside context
    parallelism, or with fewer modules than ranks, computes its own as before. Not under autograd
    (the fused blocks refuse it).

    Only while a CUDA graph is captured (or on the CPU, where the gloo tests run it). 2 × H200,
    Edit, 6 blocks: captured, 14.00 ms a step against 14.15 with every rank computing all of them
    (``bench/results/distributed-nvidia-h200-quantized-step.json``); eagerly a two-GPU step is
    host-bound and the extra collective measured 17.19 ms against 14.26 without it
    (``...-quantized-step-anchors.json``, ``...-quantized-step.json``)."""

    def __init__(self, blocks):
        self.blocks = list(blocks)
        self.temb = None
        self.views = {}
        self.handle = None

    def __call__(self, module, args, temb) -> None:
        self.temb, self.views = None, {}
        if not isinstance(temb, torch.Tensor) or torch.is_grad_enabled() or not self.blocks or not SHARE_MODULATIONS:
            return
        if temb.is_cuda and not torch.cuda.is_current_stream_capturing():
            return
        processor = self.blocks[0].attn.processor
        if not isinstance(processor, FlashflowQwenAttnProcessor):
            return
        cp = _context_parallel(processor._given_parallel_config)
        if cp is None or processor._refusal is not None:
            return
        group = cp._flattened_mesh.get_group()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        blocks = [b for b in self.blocks if _forward_is_ours(b)]
        modules = [(b, name) for b in blocks for name in ("img_mod", "txt_mod")]
        if world < 2 or len(modules) < world:
            return
        # txt_mod takes the first half of temb under zero_cond_t, as the block forward does
        half = temb.chunk(2, dim=0)[0]
        inputs = [half if name == "txt_mod" and b.zero_cond_t else temb for b, name in modules]
        outs = [getattr(b, name)(x) for (b, name), x in zip(modules[rank::world], inputs[rank::world])]
        shapes = [(x.shape[0], getattr(b, name)[-1].out_features) for (b, name), x in zip(modules, inputs)]
        mine = outs[0].new_empty((-(-len(modules) // world), max(r * w for r, w in shapes)))
        for i, out in enumerate(outs):
            mine[i, :out.numel()].copy_(out.reshape(-1))
        every = mine.new_empty((world * mine.shape[0], mine.shape[1]))   # rank-major (gloo takes this form only)
        dist.all_gather_into_tensor(every, mine, group=group)
        every = every.view(world, *mine.shape)
        for i, ((b, name), (rows, width)) in enumerate(zip(modules, shapes)):
            self.views[(id(b), name)] = every[i % world, i // world, :rows * width].view(rows, width)
        self.temb = temb

    def modulations(self, block, temb):
        """``(img_mod(temb), txt_mod(temb))`` of ``block`` from this call's table, or None."""
        if temb is not self.temb:
            return None
        img, txt = self.views.get((id(block), "img_mod")), self.views.get((id(block), "txt_mod"))
        return None if img is None or txt is None else (img, txt)


def _block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict | None = None,
    modulate_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """QwenImageTransformerBlock.forward with flashflow's fused passes (same math, same order)."""
    if torch.is_grad_enabled():
        _refuse_autograd(self, "the block", skip=self.attn, hidden_states=hidden_states,
                         encoder_hidden_states=encoder_hidden_states, temb=temb)
    table = self.__dict__.get(_MODULATIONS)
    shared = table.modulations(self, temb) if table is not None else None
    if shared is not None:   # computed for this temb over the context-parallel group
        img_mod_params, txt_mod_params = shared
    else:
        img_mod_params = self.img_mod(temb)   # (B, 6·dim), or (2B, 6·dim) with zero_cond_t
        if self.zero_cond_t:
            temb = torch.chunk(temb, 2, dim=0)[0]
        txt_mod_params = self.txt_mod(temb)
    img_mod1, img_mod2 = img_mod_params.chunk(2, dim=-1)
    txt_mod1, txt_mod2 = txt_mod_params.chunk(2, dim=-1)
    img_shift1, img_scale1, img_gate1 = img_mod1.chunk(3, dim=-1)
    img_shift2, img_scale2, img_gate2 = img_mod2.chunk(3, dim=-1)
    txt_shift1, txt_scale1, txt_gate1 = txt_mod1.chunk(3, dim=-1)
    txt_shift2, txt_scale2, txt_gate2 = txt_mod2.chunk(3, dim=-1)

    # FP8 linear layers: the norms write their outputs as e4m3 rows and scales, the GEMMs' inputs
    fp8 = _QKV in self.attn._modules
    img_modulated = layernorm_modulate(hidden_states, img_shift1, img_scale1, eps=self.img_norm1.eps,
                                       index=modulate_index, fp8=fp8)
    txt_modulated = layernorm_modulate(encoder_hidden_states, txt_shift1, txt_scale1, eps=self.txt_norm1.eps,
                                       fp8=fp8)

    if not joint_attention_kwargs and _plain_attention_call(self.attn):
        # what diffusers' Attention.forward would do here, without its per-call inspect.signature
        # of the processor (about 60 µs of host time a block)
        img_attn_output, txt_attn_output = self.attn.processor(
            self.attn, img_modulated, encoder_hidden_states=txt_modulated,
            encoder_hidden_states_mask=encoder_hidden_states_mask, image_rotary_emb=image_rotary_emb)
    else:
        # through the Attention module: its hooks and its handling of joint_attention_kwargs
        img_attn_output, txt_attn_output = self.attn(
            hidden_states=img_modulated,
            encoder_hidden_states=txt_modulated,
            encoder_hidden_states_mask=encoder_hidden_states_mask,
            image_rotary_emb=image_rotary_emb,
            **(joint_attention_kwargs or {}),
        )

    hidden_states, img_modulated2 = gate_residual_layernorm_modulate(
        hidden_states, img_attn_output, img_gate1, img_shift2, img_scale2, eps=self.img_norm2.eps,
        index=modulate_index, fp8=fp8)
    encoder_hidden_states, txt_modulated2 = gate_residual_layernorm_modulate(
        encoder_hidden_states, txt_attn_output, txt_gate1, txt_shift2, txt_scale2, eps=self.txt_norm2.eps, fp8=fp8)

    hidden_states = gate_residual(hidden_states, _feed_forward(self.img_mlp, img_modulated2), img_gate2,
                                  index=modulate_index)
    encoder_hidden_states = gate_residual(encoder_hidden_states, _feed_forward(self.txt_mlp, txt_modulated2),
                                          txt_gate2)

    # The original block's guard against fp16 overflow (inf -> the largest finite fp16).
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


# --------------------------------------------------------------------------------------------
# enable / disable
# --------------------------------------------------------------------------------------------


def _check_attention(attention) -> str:
    if not isinstance(attention, str):
        raise TypeError(f"attention must be a str, one of {ATTENTION_MODES}, got {attention!r}")
    if attention == "bf16":
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got 'bf16': exact attention in the model's "
                         "own dtype (bf16, fp16 or fp32 alike) is attention='exact'")
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    return attention


def _check_transformer(transformer) -> list:
    if not isinstance(transformer, SUPPORTED_MODELS):
        names = ", ".join(f"diffusers.{cls.__name__}" for cls in SUPPORTED_MODELS)
        raise TypeError(f"transformer must be one of: {names} (e.g. pipe.transformer of a QwenImagePipeline or "
                        f"QwenImageEditPipeline), got {type(transformer).__module__}.{type(transformer).__name__}")
    return [block for block in transformer.transformer_blocks if isinstance(block, QwenImageTransformerBlock)]


def _check_16bit(dtype, setting: str, why: str = "") -> None:
    """``setting="fp8"`` (attention or linear) quantizes 16-bit activations: a bf16/fp16 model."""
    if dtype not in _FP8_DTYPES:
        raise ValueError(f"{setting}='fp8' needs a bfloat16 or float16 model{why}, got a {dtype} model; convert it "
                         f"(transformer.to(torch.bfloat16)) or use {setting}='exact'")


def _check_fp8(transformer, blocks) -> None:
    """What ``attention="fp8"`` needs, checked before any block changes: a bf16/fp16 model,
    head_dim 64, 128 or 256, and a device that runs FP8 attention. The device is probed with a
    call of ``flash_attn_fp8_func`` on empty tensors (the op's own checks; nothing launches);
    a model whose weights are on the CPU outside Triton's interpreter (offloaded to the GPU per
    call) is probed at its first step instead, by the op."""
    dtype, device = transformer.dtype, transformer.device
    _check_16bit(dtype, "attention", " (FP8 attention quantizes 16-bit q, k, v)")
    head_shapes = {}
    for i, block in enumerate(blocks):
        heads, head_dim = block.attn.heads, block.attn.inner_dim // block.attn.heads
        if head_dim not in FP8_HEAD_DIMS:
            raise ValueError(f"attention='fp8' needs head_dim in {FP8_HEAD_DIMS}; transformer_blocks[{i}] has "
                             f"head_dim {head_dim}; use attention='exact'")
        head_shapes[heads, head_dim] = None
    if device.type == "cuda" or interpreting():
        for heads, head_dim in head_shapes:
            probe = torch.empty(1, 0, heads, head_dim, dtype=dtype, device=device)
            try:
                flash_attn_fp8_func(probe, probe, probe)
            except (TypeError, ValueError) as e:
                raise ValueError(f"attention='fp8' cannot run on {device}: {e} (use "
                                 "attention='exact' for exact attention)") from e


def _check_linear(linear) -> str:
    if not isinstance(linear, str):
        raise TypeError(f"linear must be a str, one of {LINEAR_MODES}, got {linear!r}")
    if linear == "bf16":
        raise ValueError(f"linear must be one of {LINEAR_MODES}, got 'bf16': the model's own Linear layers, in its "
                         "own dtype (bf16, fp16 or fp32 alike), are linear='exact'")
    if linear not in LINEAR_MODES:
        raise ValueError(f"linear must be one of {LINEAR_MODES}, got {linear!r}")
    return linear


def _block_linears(block) -> list[tuple[str, nn.Module, str]]:
    """``(path, parent, name)`` of every Linear of a block that ``linear="fp8"`` replaces: the six
    q/k/v projections, the two output projections, both streams' MLP GEMMs and AdaLN modulations."""
    attn = block.attn
    out = [(f"attn.{n}", attn, n) for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj",
                                            "to_add_out")]
    out.append(("attn.to_out.0", attn.to_out, "0"))
    for mlp in ("img_mlp", "txt_mlp"):
        ff = getattr(block, mlp)
        out += [(f"{mlp}.net.0.proj", ff.net[0], "proj"), (f"{mlp}.net.2", ff.net, "2")]
    out += [(f"{mod}.1", getattr(block, mod), "1") for mod in ("img_mod", "txt_mod")]
    return out


def _check_fp8_linear(transformer, blocks) -> None:
    """What ``linear="fp8"`` needs, checked before any block changes: a bf16/fp16 model on a GPU
    with FP8 tensor cores (Hopper, sm90, or newer; or the CPU under Triton's interpreter), the
    blocks' layers as diffusers builds them, each a plain ``nn.Linear`` (not a tensor subclass:
    a model quantized by torchao is refused here) with finite weights and in/out features
    that are multiples of 16."""
    dtype, device = transformer.dtype, transformer.device
    _check_16bit(dtype, "linear")
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device)[0] < 9:
            raise ValueError(f"linear='fp8' needs FP8 tensor cores with row-wise scaled GEMMs (Hopper, sm90, or newer); "
                             f"{torch.cuda.get_device_name(device)} is sm{''.join(map(str, torch.cuda.get_device_capability(device)))}: "
                             "use linear='exact'")
    elif not interpreting():
        raise ValueError(f"linear='fp8' runs on a CUDA GPU (Hopper or newer); the model is on {device} (move it to "
                         "the GPU first, or use linear='exact')")
    for i, block in enumerate(blocks):
        for ff_name in ("img_mlp", "txt_mlp"):
            net = getattr(block, ff_name).net
            act = net[0]
            if not (type(act) is _DiffusersGELU and act.approximate == "tanh" and len(net) >= 3
                    and isinstance(net[1], nn.Dropout)
                    and all(isinstance(m, nn.Dropout) for m in net[3:])):
                raise ValueError(f"transformer_blocks[{i}].{ff_name} is not diffusers' FeedForward(activation_fn="
                                 "'gelu-approximate') (GELU tanh with its Linear, dropout, Linear): linear='fp8' "
                                 "supports the Qwen-Image blocks' MLP")
        for path, parent, name in _block_linears(block):
            module = parent._modules.get(name)
            where = f"transformer_blocks[{i}].{path}"
            if isinstance(module, Fp8Linear):
                continue
            if type(module) is not nn.Linear:
                raise ValueError(f"{where} is {type(module).__name__}, not an nn.Linear: linear='fp8' replaces "
                                 "diffusers' nn.Linear layers")
            weight = module.weight
            if type(weight) not in (nn.Parameter, torch.Tensor) or weight.dtype not in _FP8_DTYPES:
                raise ValueError(
                    f"{where}.weight is a {type(weight).__name__} of {weight.dtype} (a model quantized by torchao or "
                    "another library?): linear='fp8' quantizes the model's own bf16/fp16 weights. Enable it on the "
                    "unquantized model, or keep that library's layers with linear='exact'")
            if module.in_features % GEMM_MULTIPLE or module.out_features % GEMM_MULTIPLE:
                raise ValueError(f"{where} is Linear({module.in_features}, {module.out_features}): the FP8 GEMM needs "
                                 f"in_features and out_features that are multiples of {GEMM_MULTIPLE}")
            if not bool(torch.isfinite(weight).all()):
                raise ValueError(f"{where}.weight holds a NaN or an inf: it has no FP8 scale; use linear='exact'")


def _fp8_layer(linear: nn.Linear, path: str, weight: Fp8Weight | None = None) -> Fp8Linear:
    """The FP8 layer for ``linear`` (its weight quantized, or ``weight`` given), with its own copy of the
    bias (the original module, bias included, moves to the CPU)."""
    bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return Fp8Linear(weight if weight is not None else quantize_weight(linear.weight, path + ".weight"), bias)


def _fused_qkv(layers: list[nn.Linear], path: str) -> tuple[Fp8Linear, list[Fp8Linear]]:
    """One FP8 layer over the concatenated q, k, v weights (per-channel scales: quantizing them
    apart is quantizing them together), and the three layers as views of it."""
    parts = [quantize_weight(m.weight, f"{path}[{j}].weight") for j, m in enumerate(layers)]
    data = torch.cat([p.data for p in parts])
    scale = torch.cat([p.scale for p in parts], dim=1)
    dtype = parts[0].dtype
    if all(m.bias is None for m in layers):
        bias = None
    else:
        bias = nn.Parameter(torch.cat([m.bias.detach() if m.bias is not None else
                                       torch.zeros(m.out_features, dtype=dtype, device=data.device)
                                       for m in layers]), requires_grad=False)
    fused = Fp8Linear(Fp8Weight(data, scale, dtype), bias)
    views, start = [], 0
    for m in layers:
        n = m.out_features
        views.append(_fp8_layer(m, path, Fp8Weight(data[start:start + n], scale[:, start:start + n].contiguous(),
                                                    dtype)))
        start += n
    return fused, views


def _to_fp8_linears(block) -> None:
    """Replace the block's Linears by FP8 layers; the originals move to the CPU (a bit-exact
    copy, put back by :func:`_to_exact_linears`)."""
    if _ORIGINAL_LINEARS in block.__dict__:
        return
    attn = block.attn
    originals = {}
    with torch.no_grad():
        for fused_name, names in ((_QKV, ("to_q", "to_k", "to_v")), (_ADD_QKV, ("add_q_proj", "add_k_proj",
                                                                                 "add_v_proj"))):
            layers = [getattr(attn, n) for n in names]
            fused, views = _fused_qkv(layers, "attn." + fused_name)
            for n, layer, view in zip(names, layers, views):
                originals[f"attn.{n}"] = (layer, layer.weight.device)
                setattr(attn, n, view)
            setattr(attn, fused_name, fused)
        for path, parent, name in _block_linears(block):
            if path in originals:
                continue
            layer = parent._modules[name]
            originals[path] = (layer, layer.weight.device)
            setattr(parent, name, _fp8_layer(layer, path))
    for layer, _ in originals.values():
        layer.to("cpu")
    block.__dict__[_ORIGINAL_LINEARS] = originals


def _to_exact_linears(block) -> None:
    """Put back the Linears :func:`_to_fp8_linears` replaced, on their devices (bit-exact)."""
    originals = block.__dict__.pop(_ORIGINAL_LINEARS, None)
    if originals is None:
        return
    by_path = {path: (parent, name) for path, parent, name in _block_linears(block)}
    for path, (layer, device) in originals.items():
        parent, name = by_path[path]
        setattr(parent, name, layer.to(device))
    for fused_name in (_QKV, _ADD_QKV):
        block.attn._modules.pop(fused_name, None)


def _hook_reference(block):
    """The innermost reference of diffusers' hooks on ``block`` (``HookRegistry``: context
    parallelism's split hooks, caches, offloading), whose forward is the block's own forward under
    the hooks; None without hooks."""
    refs = getattr(block.__dict__.get("_diffusers_hook"), "_fn_refs", None)
    return refs[0] if refs else None


def _inner_forward(block):
    """The block's own forward: under diffusers' hooks the one their innermost reference calls,
    else the instance's ``forward`` attribute (None: the class's)."""
    ref = _hook_reference(block)
    if ref is None:
        return block.__dict__.get("forward")
    return ref.original_forward if ref.original_forward is not None else ref.forward


def _set_inner_forward(block, forward) -> None:
    """Make ``forward`` (None: the class's) the block's own forward, under diffusers' hooks when it
    has some: ``enable`` and ``enable_parallelism`` then work in either order, the hooks splitting
    the inputs of whichever forward runs."""
    ref = _hook_reference(block)
    if ref is None:
        if forward is None:
            block.__dict__.pop("forward", None)
        else:
            block.forward = forward
        return
    forward = forward if forward is not None else types.MethodType(type(block).forward, block)
    if ref.original_forward is not None:
        ref.original_forward = forward
    else:
        ref.forward = forward


def _forward_is_ours(block) -> bool:
    return getattr(_inner_forward(block), "__func__", None) is _block_forward


def _processor_is_ours(block) -> bool:
    return isinstance(block.attn.processor, FlashflowQwenAttnProcessor)


def is_enabled(transformer) -> bool:
    """True when every Qwen-Image block of ``transformer`` runs flashflow's forward and processor."""
    blocks = _check_transformer(transformer)
    return bool(blocks) and all(_forward_is_ours(b) and _processor_is_ours(b) for b in blocks)


def enable(transformer, attention: str = "exact", linear: str = "exact"):
    """Run ``transformer`` (diffusers' ``QwenImageTransformer2DModel``) through flashflow, in place.

    Args:
        transformer: the model, in eval mode (``pipe.transformer``), on a CUDA device (or on the
            CPU under Triton's interpreter). With ``linear="exact"`` its weights are not touched or
            copied.
        attention: ``"exact"`` (default): exact attention in the model's dtype (bf16, fp16 or
            fp32 models). ``"fp8"``: :func:`flashflow.ops.attention_fp8.flash_attn_fp8_func`,
            Q·Kᵀ in INT8 and P·V in e4m3 (about 0.999 cosine to exact attention per call,
            docs/diffusion.md); it needs a bf16 or fp16 model (a ``ValueError`` otherwise), head_dim
            64, 128 or 256 (Qwen-Image's is 128), and Hopper (sm90) or newer, or the CPU under
            Triton's interpreter. The device is checked here, with the op's own error, when the
            weights are on the GPU; weights kept on the CPU (offloading) are checked by the op at
            the first step.
        linear: ``"exact"`` (default): the model's own ``nn.Linear`` layers. ``"fp8"``: every
            Linear of every block (q/k/v of both streams, fused into one GEMM per stream; the
            output projections; both MLP GEMMs; the AdaLN modulations) as
            :class:`flashflow.ops.fp8_linear.Fp8Linear`: e4m3 weights with one scale per output
            channel, e4m3 activations with one scale per token, fp32 accumulation, the output
            in the model's dtype. The norms that produce the GEMMs' inputs write them in e4m3
            directly, and the MLP's GELU pass quantizes its output (docs/diffusion.md). Needs a
            bf16/fp16 model on Hopper (sm90) or newer (or the CPU under Triton's interpreter),
            and plain ``nn.Linear`` layers: a model already quantized by torchao is refused
            (keep torchao's layers with ``linear="exact"``). The original layers move to the
            CPU (host memory: the blocks' Linear weights, two bytes a parameter in bf16; the GPU
            then holds one byte a parameter), and ``disable`` (or ``linear="exact"``) moves them
            back: bit-exact.
    Returns:
        ``transformer`` itself. Enabling an enabled model changes nothing but its modes
        (``enable(model, attention="fp8")`` after ``enable(model)`` switches attention; the same
        for ``linear``); ``disable`` undoes it.

    Every block is checked before any is changed, so a refused model is left as it was.
    diffusers' context parallelism works in either order: ``enable`` on a model that runs it
    hands its config to flashflow's processors and puts the fused block forward under the hooks
    that split the sequence; ``enable_parallelism`` on an enabled model hands the config to them.
    A config the processor cannot run (uneven slices, a Ulysses degree that does not divide the
    heads, tensor parallelism) is refused with a ``ValueError``, in either order.
    """
    attention = _check_attention(attention)
    linear = _check_linear(linear)
    blocks = _check_transformer(transformer)
    parallel = getattr(transformer, "_parallel_config", None)
    tp_error = _tensor_parallel_refused(parallel)
    if tp_error is not None:
        raise tp_error
    for block in blocks:
        cp_error = _context_parallel_refused(parallel, block.attn.heads)
        if cp_error is not None:
            raise cp_error
    if transformer.training or any(block.training for block in blocks):
        raise ValueError("enable() takes a model in eval mode: the fused block ops are inference-only (no backward); "
                         "call transformer.eval() first")
    for i, block in enumerate(blocks):
        inner = _inner_forward(block)
        if not _forward_is_ours(block) and inner is not None and getattr(inner, "__func__", None) is not type(
                block).forward:
            raise ValueError(f"transformer_blocks[{i}].forward is already replaced on the instance (a wrapper other "
                             "than diffusers' hooks?); call enable() before installing it")
        if not _processor_is_ours(block) and type(block.attn.processor) is not QwenDoubleStreamAttnProcessor2_0:
            raise ValueError(f"transformer_blocks[{i}].attn.processor is {type(block.attn.processor).__name__}; "
                             "enable() replaces only diffusers' QwenDoubleStreamAttnProcessor2_0")
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            norm = getattr(block.attn, name, None)
            if not (isinstance(norm, _DiffusersRMSNorm) and norm.bias is None):
                raise ValueError(f"transformer_blocks[{i}].attn.{name} is {type(norm).__name__}; enable() supports "
                                 "the Qwen-Image blocks' qk_norm='rms_norm' (diffusers RMSNorm without bias)")
    if attention == "fp8":
        _check_fp8(transformer, blocks)
    if linear == "fp8":
        _check_fp8_linear(transformer, blocks)
    for block in blocks:
        if linear == "fp8":
            _to_fp8_linears(block)
        else:
            _to_exact_linears(block)
        if _processor_is_ours(block):
            block.attn.processor.attention = attention
        else:
            setattr(block, _ORIGINAL, block.attn.processor)
            processor = FlashflowQwenAttnProcessor(attention, heads=block.attn.heads)
            if _context_parallel(parallel) is not None:
                processor._parallel_config = parallel   # enable_parallelism came first (checked above)
            block.attn.set_processor(processor)
        if not _forward_is_ours(block):
            _set_inner_forward(block, types.MethodType(_block_forward, block))
    embed = getattr(transformer, "time_text_embed", None)
    if transformer.__dict__.get(_MODULATIONS) is None and isinstance(embed, nn.Module):
        table = _ModulationTable(blocks)
        table.handle = embed.register_forward_hook(table)
        for owner in (transformer, *blocks):
            owner.__dict__[_MODULATIONS] = table
    return transformer


def disable(transformer):
    """Undo :func:`enable`: every block gets back its original processor object and the class's
    ``forward``, so outputs are bit-identical to those before ``enable``. A model that was never
    enabled is returned unchanged (no-op); a processor set by the user after ``enable`` is left
    in place. After flashflow's processors refused ``enable_parallelism``, it also forgets the
    config that ``enable_parallelism`` had recorded on the model before the refusal, so that
    ``enable_parallelism`` can be called again (with diffusers' processors). Returns ``transformer``."""
    blocks = _check_transformer(transformer)
    refused = [b.attn.processor._given_parallel_config for b in blocks
               if _processor_is_ours(b) and b.attn.processor._refusal is not None]
    table = transformer.__dict__.pop(_MODULATIONS, None)
    if table is not None:
        table.handle.remove()
        for block in blocks:
            block.__dict__.pop(_MODULATIONS, None)
    for block in blocks:
        _to_exact_linears(block)
        original = block.__dict__.pop(_ORIGINAL, None)
        if original is not None and _processor_is_ours(block):
            given = block.attn.processor._given_parallel_config
            if (block.attn.processor._refusal is None and _context_parallel(given) is not None
                    and hasattr(original, "_parallel_config")):
                # enable_parallelism handed its config to flashflow's processor only: diffusers'
                # processor needs it too, or it would attend over its rank's slice alone
                original._parallel_config = given
            block.attn.set_processor(original)
        if _forward_is_ours(block):
            _set_inner_forward(block, None)
    # diffusers 0.42.1's enable_parallelism records its config on the model, hands it to the processors (where ours
    # refused it), and only then installs the hooks that split the sequence: the refusal left no hook, only the
    # record, which makes a second enable_parallelism raise "Parallelism is already applied".
    recorded = transformer.__dict__.get("_parallel_config")
    if recorded is not None and any(recorded is config for config in refused):
        del transformer._parallel_config
    return transformer
