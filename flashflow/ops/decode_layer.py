"""A decoder layer's decode step in one persistent launch: validation, the task table, launch.

* :class:`LayerConfig` — a Llama / Qwen-style layer's sizes (GQA, RoPE, SwiGLU, RMSNorm);
  :data:`TINY_LLAMA` (the CPU tests) and :data:`LLAMA3_8B` (the bench).
* :class:`LayerWeights` — one layer's weights in ``nn.Linear`` layout (q/k/v and gate/up
  concatenated); :func:`random_layer_weights`; :func:`fold_norms` (the RMSNorm weights folded
  into the QKV and gate/up weights, for a plan built with ``folded_norms=True``).
* :class:`DecodeLayerPlan` — built once per (config, batch, cache capacity, cache layout): the
  task table (:func:`build_tasks`), the grid, the fp32 workspaces, the synchronisation counters
  and the RoPE tables; :meth:`DecodeLayerPlan.run` every step: no host synchronisation (but the
  value checks, skipped under CUDA-graph capture), nothing reset between steps, capturable.
* :func:`decode_layer` — one step without a plan in hand; :func:`decode_step` — N layers.
* :func:`decode_layer_bytes` — the fewest DRAM bytes one step moves.

The kernel, its task graph, synchronisation and deadlock argument:
:mod:`flashflow.kernels.decode_layer`. Not supported (refused by name): FP8 caches, more than
16 sequences, more than one new token per sequence, head_dim other than 32, 64, 128 or 256.
"""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Optional

import torch

from flashflow.device import capturing, cdiv, gpu_family, interpreting, next_pow2, num_sms as device_num_sms
from flashflow.kernels.decode_layer import (LAYER_PTR_KINDS, STAGES, TASK_WORDS, TRACE_WORDS, build_tasks,
                                            counters, decode_layer_kernel, dependency_violations, qkv_tiles,
                                            x_slices)
# the bytes a step moves, with the task table in the kernel's module (flashflow.dataflow models it too)
from flashflow.kernels.decode_layer import decode_layer_bytes as decode_layer_bytes
from flashflow.kernels.sync import CNT_OFF, MAX_THREADS, SYNC_ERR
from flashflow.kernels.softmax import LOG2E
from flashflow.ops.common import Launcher, dot_precision, launch_by_arguments, stream_key, unit_last_stride
from flashflow.ops.validate import check_flag, check_int, check_no_grad, check_runs_here, overlaps_itself
from flashflow.tuning.decode import cap_splits, num_splits_heuristic
from flashflow.tuning.decode_layer import (DecodeLayerConfig, decode_layer_config, norm_block,
                                            num_programs as grid_programs)

MAX_BATCH = 16
HEAD_DIMS = (32, 64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Bounded spins (debug): FLASHFLOW_DECODE_LAYER_SPIN_LIMIT=N makes a wait give up after N polls,
# set the error word and go on; the op then raises. 0 (the GPU default) spins without bound.
_SPIN_LIMIT = int(os.environ.get("FLASHFLOW_DECODE_LAYER_SPIN_LIMIT", "0"))
_INTERPRETER_SPIN_LIMIT = 2000


@dataclass(frozen=True)
class LayerConfig:
    """A decoder layer's sizes: ``hidden``, ``heads`` query heads and ``kv_heads`` KV heads of
    ``head_dim``, the FFN's ``intermediate``, the RMSNorm's ``eps`` and RoPE's ``rope_theta``."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float = 1e-5
    rope_theta: float = 500000.0

    def __post_init__(self):
        for f in ("hidden", "heads", "kv_heads", "head_dim", "intermediate"):
            check_int(f, getattr(self, f), 1)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if self.heads // self.kv_heads > 128:
            raise ValueError(f"at most 128 query heads per KV head, got {self.heads // self.kv_heads}")
        for f in ("eps", "rope_theta"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                    or (f == "rope_theta" and v <= 0):
                raise ValueError(f"{f} must be a finite float{' > 0' if f == 'rope_theta' else ' >= 0'}, got {v!r}")

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


TINY_LLAMA = LayerConfig(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=160, rope_theta=10000.0)
LLAMA3_8B = LayerConfig(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336)


@dataclass
class LayerWeights:
    """One layer's weights, ``nn.Linear`` layout: ``qkv`` = cat(q_proj, k_proj, v_proj)
    ``(heads·d + 2·kv_heads·d, hidden)``, ``o`` ``(hidden, heads·d)``, ``gate_up`` =
    cat(gate_proj, up_proj) ``(2·intermediate, hidden)``, ``down`` ``(hidden, intermediate)``;
    ``attn_norm`` and ``ffn_norm`` ``(hidden,)``, both None in weights whose norm weights are
    folded into ``qkv`` and ``gate_up`` (:func:`fold_norms`)."""
    attn_norm: Optional[torch.Tensor]
    qkv: torch.Tensor
    o: torch.Tensor
    ffn_norm: Optional[torch.Tensor]
    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def folded(self) -> bool:
        """Whether the norm weights are folded into ``qkv`` and ``gate_up`` (both norms None)."""
        return self.attn_norm is None and self.ffn_norm is None

    def shapes(self, c: LayerConfig) -> dict:
        return {"attn_norm": (c.hidden,), "qkv": (c.qkv_rows, c.hidden), "o": (c.hidden, c.heads * c.head_dim),
                "ffn_norm": (c.hidden,), "gate_up": (2 * c.intermediate, c.hidden),
                "down": (c.hidden, c.intermediate)}

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def fold_norms(weights: LayerWeights) -> LayerWeights:
    """The same layer with each RMSNorm weight folded into the projection that reads the norm's
    output: ``qkv[:, j] · attn_norm[j]`` and ``gate_up[:, j] · ffn_norm[j]`` (in fp32, rounded
    once to the weights' dtype), the norms None. A plan built with ``folded_norms=True`` runs
    these: its GEMVs take the un-normalised rows and scale by ``1 / rms`` after the dot, which
    takes the norm rows off the step's critical path. New tensors: the weights given are left
    as they are. Rounding: one rounding of each folded weight, where the unfolded layer rounds
    the normalised activation; both against float64 in the tests."""
    if not isinstance(weights, LayerWeights):
        raise TypeError(f"weights must be a flashflow LayerWeights, got {type(weights).__name__}")
    if weights.attn_norm is None or weights.ffn_norm is None:
        raise ValueError("weights: the norm weights are already folded (attn_norm / ffn_norm is None)")
    out = {}
    for proj, norm in (("qkv", "attn_norm"), ("gate_up", "ffn_norm")):
        w, g = getattr(weights, proj), getattr(weights, norm)
        for name, t in ((proj, w), (norm, g)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"weights.{name} must be a torch.Tensor, got {type(t).__name__}")
        if g.dim() != 1 or w.dim() != 2 or w.shape[1] != g.shape[0]:
            raise ValueError(f"weights.{norm} must have shape ({w.shape[-1]},) to fold into weights.{proj} "
                             f"{tuple(w.shape)}, got {tuple(g.shape)}")
        if g.device != w.device:
            raise ValueError(f"weights.{norm} must be on {w.device} (weights.{proj}'s device), got {g.device}")
        with torch.no_grad():
            folded = (w.float() * g.float()[None, :]).to(w.dtype)
            # a product past the dtype's range would be a silent inf weight (a host read-back,
            # once per layer at load time)
            if not bool(torch.isfinite(folded).all()) and bool(torch.isfinite(w).all() & torch.isfinite(g).all()):
                raise ValueError(f"weights.{proj} · weights.{norm} overflows {w.dtype}: fold in a wider dtype, "
                                 f"or keep the norm weights apart (folded_norms=False)")
            out[proj] = folded
    return LayerWeights(None, out["qkv"], weights.o, None, out["gate_up"], weights.down)


def random_layer_weights(config: LayerConfig, dtype=torch.bfloat16, device="cuda", seed: int = 0) -> LayerWeights:
    """Random weights of ``config`` (Gaussian, 1/√fan-in, so activations stay of order one;
    norm weights around 1)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    c = config

    def lin(n, k):
        return (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype=dtype, device=device)

    def norm():
        return (1 + 0.1 * torch.randn(c.hidden, generator=g)).to(dtype=dtype, device=device)
    return LayerWeights(norm(), lin(c.qkv_rows, c.hidden), lin(c.hidden, c.heads * c.head_dim), norm(),
                        lin(2 * c.intermediate, c.hidden), lin(c.hidden, c.intermediate))


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _tensor(name, t, shape, dtype, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape}, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype} (the plan's dtype), got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    check_no_grad("decode_layer", **{name: t})
    return t


def _written(name, t) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} is written by the kernel and must have a unit stride in its last dimension, "
                         f"got strides {t.stride()}")
    if overlaps_itself(t):
        raise ValueError(f"{name} is written by the kernel and must not overlap itself (an expanded view), "
                         f"got strides {t.stride()} for shape {tuple(t.shape)}")


def _spin_limit(device: torch.device) -> int:
    return _INTERPRETER_SPIN_LIMIT if interpreting() else _SPIN_LIMIT


# --------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------

_LAUNCH = Launcher(decode_layer_kernel)


class DecodeLayerPlan:
    """Task table, grid, workspaces and counters of one decode-layer launch; :meth:`run` per step.

    Args:
        config: the layer's :class:`LayerConfig`.
        batch: sequences (1–16), one new token each.
        capacity: the most tokens a sequence's cache holds (RoPE tables and value checks).
        device, dtype: where and in what (float16, bfloat16 or float32) x, weights and caches are.
        page_size: None for a contiguous cache ``(batch, capacity, kv_heads, d)``; an int for a
            paged one ``(num_blocks, page_size, kv_heads, d)`` read through ``block_table``.
        num_splits: key-range splits per (sequence, KV head); 0 takes decode attention's
            heuristic (:func:`flashflow.tuning.decode.num_splits_heuristic`).
        num_programs: the persistent grid; None: one per SM (:func:`flashflow.tuning.decode_layer.num_programs`).
        shuffle: None, or a seed: the tasks in a random topological order (tests).
        config_tiles: a :class:`DecodeLayerConfig` instead of the shipped one.
        spin_limit: polls before a wait gives up and the call raises (None: 2000 in the
            interpreter, else ``FLASHFLOW_DECODE_LAYER_SPIN_LIMIT`` or 0, unbounded).
        trace: record every task's start and end (the GPU's global timer, ns), SM, stage and
            the time its wait on its inputs passed into ``plan.trace`` (``(tasks, 5)`` int64,
            ticket order) on each run: the step's timeline
            (:func:`flashflow.ops.decode_layer.trace_summary`). GPU only.
        folded_norms: the plan runs weights whose norm weights are folded into the QKV and
            gate/up weights (:func:`fold_norms`; ``run`` refuses the other kind): the norm rows
            leave the step's critical path.
        num_layers: layers a launch runs (1: one layer, :meth:`run`). More: that many layers of
            one config in one launch (:meth:`run_layers`, :func:`decode_step`), the task table
            repeated per layer and each layer's first tasks waiting on the layer before's out,
            so that a layer's first tasks are taken by programs the layer before has left idle.

    A plan's counters are shared by every call made with it: calls on one plan must be
    stream-ordered (one stream), as a serving loop's are. One plan of one layer serves every
    layer of a model of one config (:func:`decode_step`, a launch per layer); a plan of
    ``num_layers`` runs them in one launch.
    """

    def __init__(self, config: LayerConfig, batch: int, capacity: int, *, device="cuda", dtype=torch.bfloat16,
                 page_size: Optional[int] = None, num_splits: int = 0, num_programs: Optional[int] = None,
                 shuffle: Optional[int] = None, config_tiles: Optional[DecodeLayerConfig] = None,
                 spin_limit: Optional[int] = None, trace: bool = False, folded_norms: bool = False,
                 num_layers: int = 1):
        if not isinstance(config, LayerConfig):
            raise TypeError(f"config must be a flashflow LayerConfig, got {type(config).__name__}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:   # "cuda": the current device, as torch reads it
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type == "meta":
            raise ValueError("device must be where the kernels run (a CUDA device, or cpu under TRITON_INTERPRET=1), "
                             "got meta")
        if dtype not in DTYPES:
            raise TypeError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        batch = check_int("batch", batch, 1)
        if batch > MAX_BATCH:
            raise ValueError(f"batch must be at most {MAX_BATCH} (the GEMV tiles hold every row), got {batch}")
        capacity = check_int("capacity", capacity, 1)
        num_splits = check_int("num_splits", num_splits, 0)
        if page_size is not None:
            page_size = check_int("page_size", page_size, 1)
            if capacity % page_size:
                raise ValueError(f"capacity ({capacity}) must be a multiple of page_size ({page_size})")
        if num_programs is not None:
            num_programs = check_int("num_programs", num_programs, 1)
        if shuffle is not None:
            shuffle = check_int("shuffle", shuffle, 0)
        if config_tiles is not None and not isinstance(config_tiles, DecodeLayerConfig):
            raise TypeError(f"config_tiles must be a DecodeLayerConfig, got {type(config_tiles).__name__}")
        self.config, self.batch, self.capacity, self.device, self.dtype = config, batch, capacity, device, dtype
        self.page_size = page_size
        tiles = self.tiles = config_tiles or decode_layer_config(gpu_family(device), config.head_dim)
        if (config.head_dim // 2) % tiles.QKV_PAIRS:
            raise ValueError(f"QKV_PAIRS ({tiles.QKV_PAIRS}) must divide head_dim / 2 ({config.head_dim // 2})")
        assert tiles.num_warps * 32 <= MAX_THREADS
        sms = device_num_sms(device)
        asked = num_splits or num_splits_heuristic(batch * config.kv_heads, capacity, sms, tiles.BLOCK_KV)
        self.num_splits = cap_splits(asked, capacity, tiles.BLOCK_KV)
        for field in ("SPLIT_K", "QKV_SPLIT"):
            v = getattr(tiles, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{field} must be an int >= 1, got {v!r}")
        if not isinstance(tiles.GEMV_STAGES, int) or tiles.GEMV_STAGES < 0:
            raise ValueError(f"GEMV_STAGES must be an int >= 0 (0: num_stages), got {tiles.GEMV_STAGES!r}")
        if tiles.STAGGER not in (0, 1) or isinstance(tiles.STAGGER, bool):
            raise ValueError(f"STAGGER must be 0 or 1, got {tiles.STAGGER!r}")
        check_flag("folded_norms", folded_norms)
        self.folded_norms = folded_norms
        self.num_layers = check_int("num_layers", num_layers, 1)
        # a later layer's QKV slices wait on the down column blocks of their slice of x
        self.x_slices = x_slices(config, tiles, folded_norms, self.num_layers)
        # layer 0's counters; layer l's lie l · layer_words further
        self.counters = counters(config, batch, cdiv(config.hidden, tiles.BLOCK_N), tiles.SPLIT_K,
                                 qkv_tiles(config, tiles), self.x_slices)
        self.layer_words = self.counters.words - CNT_OFF
        self.task_list = build_tasks(config, batch, self.num_splits, tiles, shuffle, folded_norms, self.num_layers)
        bad = dependency_violations(self.task_list, self.num_splits)
        assert not bad, f"task table not topological at tickets {bad[:8]}"
        self.num_tasks = len(self.task_list)
        self.tasks = torch.tensor(self.task_list, dtype=torch.int32, device=device).reshape(-1, TASK_WORDS)
        self.programs = min(num_programs, self.num_tasks) if num_programs else grid_programs(self.num_tasks, sms)
        self.spin_limit = _spin_limit(device) if spin_limit is None else check_int("spin_limit", spin_limit, 0)
        self.sync = torch.zeros(CNT_OFF + self.num_layers * self.layer_words, dtype=torch.int64, device=device)
        check_flag("trace", trace)
        if trace and (device.type != "cuda" or interpreting()):
            raise ValueError("trace=True reads the GPU's global timer: a CUDA device, not the interpreter")
        self.trace = torch.zeros(self.num_tasks, TRACE_WORDS, dtype=torch.int64, device=device) if trace else None
        c = config
        f32 = dict(dtype=torch.float32, device=device)
        self.block_b = max(16, next_pow2(batch))
        self.block_r = max(16, next_pow2(c.heads // c.kv_heads))
        act = dict(dtype=dtype, device=device)   # the GEMVs' activations, rounded as an unfused layer rounds them
        self.xn = torch.empty(1 if folded_norms else batch * c.hidden, **act)
        self.q_ws = torch.empty(batch, c.heads * c.head_dim, **f32)
        self.attn = torch.empty(batch, c.heads * c.head_dim, **act)
        self.h1 = torch.empty(batch, c.hidden, **f32)
        self.hn = torch.empty(batch, c.hidden, **act)   # folded: h in x's dtype (the gate/up dot's operand)
        # folded: 1 / rms(x) per row, and the O column blocks' sums of squares of h per row
        n_o = cdiv(c.hidden, tiles.BLOCK_N)
        self.rstd = torch.empty(batch if folded_norms else 1, **f32)
        self.ws_ss = torch.empty(n_o * self.block_b if folded_norms else 1, **f32)
        self.act = torch.empty(batch, c.intermediate, **act)
        # a multi-layer launch: the outputs of every layer but the last (the next one's x), and
        # the pointer table of the layers' weights and caches (rebuilt when an address changes)
        self.xws = torch.empty(max(self.num_layers - 1, 1) * batch * c.hidden, **act)
        self._ptrs_key, self._ptrs = None, None
        pieces = batch * c.kv_heads * self.num_splits
        self.ws_acc = torch.empty(pieces * self.block_r * c.head_dim, **f32)
        self.ws_ml = torch.empty(pieces * 2 * self.block_r, **f32)
        # the O / down K slices' partials (one column block's slices side by side)
        self.ws_part = torch.empty(cdiv(c.hidden, tiles.BLOCK_N) * tiles.SPLIT_K * self.block_b * tiles.BLOCK_N
                                   if tiles.SPLIT_K > 1 else 1, **f32)
        # the QKV K slices' partials (one tile's slices side by side)
        self.ws_qkv = torch.empty(qkv_tiles(c, tiles) * tiles.QKV_SPLIT * self.block_b * 2 * tiles.QKV_PAIRS
                                  if tiles.QKV_SPLIT > 1 else 1, **f32)
        inv_freq = c.rope_theta ** (-torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        angles = torch.arange(capacity, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos = angles.cos().to(**f32).contiguous()
        self.sin = angles.sin().to(**f32).contiguous()

    def __repr__(self) -> str:
        layers = f"num_layers={self.num_layers}, " if self.num_layers > 1 else ""
        return (f"DecodeLayerPlan({layers}batch={self.batch}, capacity={self.capacity}, tasks={self.num_tasks}, "
                f"programs={self.programs}, num_splits={self.num_splits}, folded_norms={self.folded_norms}, "
                f"{self.tiles})")

    # ---------------------------------------------------------------------------------- checks

    def _check(self, x, weights, k_cache, v_cache, cache_seqlens, block_table, out, values=True):
        c, dev = self.config, self.device
        x = unit_last_stride(_tensor("x", x, (self.batch, c.hidden), self.dtype, dev))
        check_runs_here("x", x)
        if not isinstance(weights, LayerWeights):
            raise TypeError(f"weights must be a flashflow LayerWeights, got {type(weights).__name__}")
        norms = {"attn_norm": weights.attn_norm, "ffn_norm": weights.ffn_norm}
        for name, t in norms.items():
            if self.folded_norms and t is not None:
                raise ValueError(f"weights.{name} is given, but the plan was built with folded_norms=True: pass "
                                 f"fold_norms(weights), whose norm weights are in qkv and gate_up")
            if not self.folded_norms and t is None:
                raise ValueError(f"weights.{name} is None (folded norm weights), but the plan was built with "
                                 f"folded_norms=False: build it with folded_norms=True")
        w = {name: unit_last_stride(_tensor(f"weights.{name}", t, weights.shapes(c)[name], self.dtype, dev))
             for name, t in weights.as_dict().items() if t is not None}
        if self.folded_norms:   # not read: the kernel takes a placeholder
            w["attn_norm"] = w["ffn_norm"] = self.rstd
        else:
            w["attn_norm"], w["ffn_norm"] = w["attn_norm"].contiguous(), w["ffn_norm"].contiguous()
        tail = (c.kv_heads, c.head_dim)
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype == torch.float8_e4m3fn:
                raise TypeError(f"{name}: FP8 caches are not supported by decode_layer (use flash_attn_with_kvcache)")
            if self.page_size is None:
                _tensor(name, t, (self.batch, self.capacity, *tail), self.dtype, dev)
            else:
                if t.dim() != 4 or tuple(t.shape[1:]) != (self.page_size, *tail):
                    raise ValueError(f"{name} must be paged (num_blocks, {self.page_size}, {tail[0]}, {tail[1]}), got "
                                     f"{tuple(t.shape)}")
                _tensor(name, t, tuple(t.shape), self.dtype, dev)
            _written(name, t)
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                             f"{tuple(v_cache.shape)}")
        if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 \
                or tuple(cache_seqlens.shape) != (self.batch,):
            raise TypeError(f"cache_seqlens must be an int32 tensor of shape ({self.batch},), got "
                            f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)} "
                            f"{tuple(getattr(cache_seqlens, 'shape', ()))}")
        if cache_seqlens.device != dev:
            raise ValueError(f"cache_seqlens must be on {dev}, got {cache_seqlens.device}")
        cache_seqlens = cache_seqlens.contiguous()
        if self.page_size is None:
            if block_table is not None:
                raise ValueError("block_table was given to a plan for a contiguous cache (page_size=None)")
        else:
            per_seq = self.capacity // self.page_size
            if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 \
                    or tuple(block_table.shape) != (self.batch, per_seq):
                raise TypeError(f"block_table must be an int32 tensor of shape ({self.batch}, {per_seq}) for a paged "
                                f"plan, got {getattr(block_table, 'dtype', type(block_table).__name__)} "
                                f"{tuple(getattr(block_table, 'shape', ()))}")
            if block_table.device != dev:
                raise ValueError(f"block_table must be on {dev}, got {block_table.device}")
            block_table = unit_last_stride(block_table)
        if out is None:
            out = torch.empty(self.batch, c.hidden, dtype=self.dtype, device=dev)
        else:
            _tensor("out", out, (self.batch, c.hidden), self.dtype, dev)
            _written("out", out)
        if values and not capturing(dev):
            self._check_values(cache_seqlens, block_table, k_cache.shape[0])
        return x, w, cache_seqlens, block_table, out

    def _check_values(self, cache_seqlens, block_table, num_blocks) -> None:
        """Values inside tensors (a host synchronisation; skipped while a CUDA graph is captured)."""
        lo, hi = (int(v) for v in torch.aminmax(cache_seqlens))
        if lo < 0 or hi >= self.capacity:
            raise ValueError(f"cache_seqlens must be in [0, capacity - 1] = [0, {self.capacity - 1}] (the new token "
                             f"needs a free slot), got values in [{lo}, {hi}]")
        if block_table is not None:
            lo, hi = (int(v) for v in torch.aminmax(block_table))
            if lo < 0 or hi >= num_blocks:
                raise ValueError(f"block_table entries must be in [0, {num_blocks - 1}], got [{lo}, {hi}]")

    # ---------------------------------------------------------------------------------- run

    def run(self, x, weights: LayerWeights, k_cache, v_cache, cache_seqlens, block_table=None, out=None):
        """One step: ``out (batch, hidden)`` in x's dtype; the new token's roped key and its value
        appended to the caches at position ``cache_seqlens[b]`` (which the caller advances)."""
        if self.num_layers > 1:
            raise ValueError(f"this plan runs {self.num_layers} layers in one launch: call "
                             f"decode_step(plan, layers, caches, x, cache_seqlens) or plan.run_layers(...)")
        x, w, seqlens, table, out = self._check(x, weights, k_cache, v_cache, cache_seqlens, block_table, out)
        self._launch(x, w, k_cache, v_cache, seqlens, table, out, self.sync, x)
        return out

    def run_layers(self, x, layers, caches, cache_seqlens, block_tables=None, out=None):
        """``num_layers`` layers of one step in one launch: ``layers`` a list of :class:`LayerWeights`,
        ``caches`` a list of ``(k_cache, v_cache)`` and, for a paged plan, ``block_tables`` a list
        of tables (one per layer). Returns the last layer's ``out (batch, hidden)``; each layer's
        cache holds its new key and value at ``cache_seqlens[b]`` (which the caller advances).
        The tensors of one kind take one stride in every layer and addresses that are multiples
        of 16 bytes; the table of their addresses is rebuilt (a copy to the device) when one of
        them changes, which a CUDA-graph capture refuses: run the call once before capturing."""
        n = self.num_layers
        if not isinstance(layers, (list, tuple)) or len(layers) != n:
            raise ValueError(f"layers must be a list of {n} LayerWeights (the plan's num_layers), got "
                             f"{len(layers) if isinstance(layers, (list, tuple)) else type(layers).__name__}")
        if not isinstance(caches, (list, tuple)) or len(caches) != n:
            raise ValueError(f"caches must be a list of {n} (k_cache, v_cache) pairs (the plan's num_layers)")
        for i, pair in enumerate(caches):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"caches[{i}] must be a (k_cache, v_cache) pair")
        if block_tables is None:
            block_tables = [None] * n
        elif not isinstance(block_tables, (list, tuple)) or len(block_tables) != n:
            raise ValueError(f"block_tables must be None or a list of {n} tables (one per layer)")
        checked = []
        for i in range(n):
            kc, vc = caches[i]
            # x, out and the values (cache lengths, table entries) once; a table of its own again,
            # and layer 0's table again against a cache of fewer blocks than layer 0's
            fewer = not isinstance(kc, torch.Tensor) or kc.dim() != 4 or kc.shape[0] < caches[0][0].shape[0]
            values = i == 0 or (block_tables[i] is not None and (block_tables[i] is not block_tables[0] or fewer))
            x, w, seqlens, table, out = self._check(x, layers[i], kc, vc, cache_seqlens, block_tables[i], out,
                                                    values)
            if i == 0:
                x0, seqlens0, out0 = x, seqlens, out
            checked.append((w, kc, vc, table))
        ptrs = self._layer_pointers(checked)
        x0 = x0.contiguous()   # every layer's x and out one row stride (hidden)
        dest = out0 if out0.is_contiguous() else torch.empty_like(out0, memory_format=torch.contiguous_format)
        w, kc, vc, table = checked[0]
        self._launch(x0, w, kc, vc, seqlens0, table, dest, ptrs, self.xws)
        if dest is not out0:
            out0.copy_(dest)
        return out0

    def _layer_pointers(self, checked) -> torch.Tensor:
        """The int64 table ``(num_layers, len(LAYER_PTR_KINDS))`` of each layer's weight, norm, cache and
        block-table addresses as distances from layer 0's, in 16-byte units (the kernel's
        ``_layer_ptr``), after checking that every layer's tensors of a kind take layer 0's
        strides and 16-byte-aligned addresses. Placeholders (the norms of folded weights, the
        block table of a contiguous cache) take distance 0: they are not read."""
        layers = [tuple(None if self.folded_norms and kind.endswith("_norm")   # placeholders: not read
                        else {"k_cache": kc, "v_cache": vc, "block_table": table}.get(kind, w.get(kind))
                        for kind in LAYER_PTR_KINDS) for w, kc, vc, table in checked]
        for i, ts in enumerate(layers):
            for kind, t, t0 in zip(LAYER_PTR_KINDS, ts, layers[0]):
                if t is None:
                    continue
                if t.stride() != t0.stride():
                    raise ValueError(f"layer {i}'s {kind} has strides {t.stride()}, layer 0's {t0.stride()}: a "
                                     f"multi-layer launch takes one stride per kind")
                if t.data_ptr() % 16:
                    raise ValueError(f"layer {i}'s {kind} is not 16-byte aligned (address mod 16 = "
                                     f"{t.data_ptr() % 16}): a multi-layer launch reads it through its address")
        key = tuple(tuple(0 if t is None else (t.data_ptr() - t0.data_ptr()) // 16
                          for t, t0 in zip(ts, layers[0])) for ts in layers)
        if key != self._ptrs_key:
            if capturing(self.device):
                raise ValueError("a tensor of the layers changed address since the plan's last call: the table of "
                                 "addresses is copied to the device, which a CUDA-graph capture cannot hold; run "
                                 "the call once before capturing")
            self._ptrs = torch.tensor(key, dtype=torch.int64).to(self.device)
            self._ptrs_key = key
        return self._ptrs

    def _launch(self, x, w, k_cache, v_cache, seqlens, table, out, ptrs, xws) -> None:
        c, t = self.config, self.tiles
        paged = table is not None
        on_interp = interpreting()
        args = (x, out, self.tasks, self.sync, seqlens, table if paged else seqlens, self.cos, self.sin,
                w["qkv"], w["o"], w["gate_up"], w["down"], w["attn_norm"], w["ffn_norm"],
                k_cache, v_cache, self.xn, self.q_ws, self.attn, self.h1, self.hn, self.act, self.ws_acc, self.ws_ml,
                self.ws_part, self.ws_qkv, self.rstd, self.ws_ss, self.trace if self.trace is not None else self.sync,
                ptrs, xws,
                self.batch, c.hidden, c.intermediate, self.num_tasks, self.programs, self.counters.merge,
                self.counters.h1_ready, cdiv(c.hidden, t.BLOCK_N), self.counters.col_merge, self.counters.qkv_merge,
                self.layer_words, self.counters.done, self.counters.x_ready, self.spin_limit,
                x.stride(0), out.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
                table.stride(0) if paged else 0,
                w["qkv"].stride(0), w["o"].stride(0), w["gate_up"].stride(0), w["down"].stride(0),
                float(c.eps), LOG2E / math.sqrt(c.head_dim))
        constexprs = dict(HEADS=c.heads, KV_HEADS=c.kv_heads, HEAD_DIM=c.head_dim, QKV_PAIRS=t.QKV_PAIRS,
                          QKV_SPLIT=t.QKV_SPLIT,
                          BLOCK_N=t.BLOCK_N, BLOCK_I=t.BLOCK_I, BLOCK_K=t.BLOCK_K, BLOCK_KV=t.BLOCK_KV,
                          BLOCK_B=self.block_b, BLOCK_R=self.block_r, NUM_SPLITS=self.num_splits, SPLIT_K=t.SPLIT_K,
                          PAGE_SIZE=self.page_size or 1, LAYOUT=1 if paged else 0, THREADS=t.num_warps * 32,
                          GEMV_STAGES=t.GEMV_STAGES or t.num_stages, STAGGER=t.STAGGER, NORM_BLOCK=norm_block(c.hidden),
                          TRACE=self.trace is not None,
                          FENCED_SYNC=not on_interp, FOLDED=self.folded_norms,
                          COLS_PAD=next_pow2(cdiv(c.hidden, t.BLOCK_N)),
                          DOT_FP32=self.dtype == torch.bfloat16 and on_interp,
                          DOT_PRECISION=dot_precision(self.dtype), NUM_LAYERS=self.num_layers, X_SLICES=self.x_slices,
                          num_warps=t.num_warps, num_stages=t.num_stages)
        launch_by_arguments(_LAUNCH, (self.programs, 1, 1), args, constexprs)
        self._check_error()

    def _check_error(self) -> None:
        """With bounded spins, a wait that ran out set the error word: raise (reads it back, a
        host synchronisation; only when spin_limit > 0 and nothing is being captured)."""
        if self.spin_limit <= 0 or capturing(self.device):
            return
        if int(self.sync[SYNC_ERR]) != 0:
            self.sync.zero_()
            raise RuntimeError("decode_layer: a dependency wait ran out of spins (a task order that is not "
                               "topological, or a hang); the plan's counters were reset")


# the plans of calls made without one, per (sizes, device, stream): a plan's counters order its
# calls, so two streams must not share one; the least recently used beyond _PLANS_MAX is dropped
_PLANS: "OrderedDict[tuple, DecodeLayerPlan]" = OrderedDict()
_PLANS_MAX = 16


def decode_layer(x, weights: LayerWeights, k_cache, v_cache, cache_seqlens, config: LayerConfig, block_table=None,
                 out=None):
    """One decode step of one layer without a plan in hand: the plan for these sizes is built
    on the first call and kept (per device and stream's calls; see :class:`DecodeLayerPlan`).

    ``x (batch, hidden)``; ``k_cache``/``v_cache`` ``(batch, capacity, kv_heads, d)``, or paged
    ``(num_blocks, page_size, kv_heads, d)`` with ``block_table (batch, capacity / page_size)``;
    ``cache_seqlens`` int32 ``(batch,)``: tokens already cached, where the new token goes.
    Returns ``out (batch, hidden)``; the caches hold the new key and value after the call."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise TypeError(f"x must be a torch.Tensor (batch, hidden), got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise TypeError(f"k_cache must be a 4-d torch.Tensor, got {getattr(k_cache, 'shape', type(k_cache).__name__)}")
    page = None
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise TypeError("block_table must be an int32 tensor (batch, blocks per sequence)")
        page = k_cache.shape[1]
        capacity = block_table.shape[1] * page
    else:
        capacity = k_cache.shape[1]
    folded = isinstance(weights, LayerWeights) and weights.folded
    key = (config, x.shape[0], capacity, page, x.device, x.dtype, folded, stream_key(x.device))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = DecodeLayerPlan(config, x.shape[0], capacity, device=x.device, dtype=x.dtype,
                                             page_size=page, folded_norms=folded)
        if len(_PLANS) > _PLANS_MAX:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan.run(x, weights, k_cache, v_cache, cache_seqlens, block_table, out)


def decode_step(plan: DecodeLayerPlan, layers, caches, x, cache_seqlens, block_tables=None, advance=True):
    """N layers of one decode step on one plan: ``layers`` a list of :class:`LayerWeights`,
    ``caches`` a list of ``(k_cache, v_cache)`` (and ``block_tables`` a list of tables for a
    paged plan). A plan of one layer launches once per layer; a plan built with ``num_layers``
    = N runs the N layers in one launch (:meth:`DecodeLayerPlan.run_layers`). Returns the hidden
    states after the last layer. With ``advance`` (a bool), ``cache_seqlens`` is incremented in
    place at the end (a device op: the step stays capturable)."""
    if not isinstance(plan, DecodeLayerPlan):
        raise TypeError(f"plan must be a DecodeLayerPlan, got {type(plan).__name__}")
    check_flag("advance", advance)
    if plan.num_layers > 1:
        x = plan.run_layers(x, layers, caches, cache_seqlens, block_tables)
        if advance:
            cache_seqlens.add_(1)
        return x
    if not isinstance(layers, (list, tuple)) or not isinstance(caches, (list, tuple)) or len(layers) != len(caches):
        raise ValueError("layers and caches must be lists of one length (a LayerWeights and a (k_cache, v_cache) "
                         "pair per layer)")
    if block_tables is not None and (not isinstance(block_tables, (list, tuple)) or len(block_tables) != len(layers)):
        raise ValueError("block_tables must be None or a list with one table per layer")
    for i, pair in enumerate(caches):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"caches[{i}] must be a (k_cache, v_cache) pair")
    for i, (w, (kc, vc)) in enumerate(zip(layers, caches)):
        x = plan.run(x, w, kc, vc, cache_seqlens, None if block_tables is None else block_tables[i])
    if advance:
        cache_seqlens.add_(1)
    return x


def trace_summary(plan: DecodeLayerPlan) -> dict:
    """A traced plan's last step (``DecodeLayerPlan(..., trace=True)``), in µs from the first
    task's start: per stage its tasks, first start, last end, mean task time and its two parts,
    the mean wait on the task's inputs (start to ready) and the mean work after it (ready to
    end; a split or K slice's merge included); the step's span and the fraction of (programs ×
    span) spent inside tasks; a plan of several layers sums each stage over its layers (the
    trace's rows are the task table's, whose last word is the layer). Reads the trace back (a
    host synchronisation)."""
    if not isinstance(plan, DecodeLayerPlan) or plan.trace is None:
        raise ValueError("plan must be a DecodeLayerPlan built with trace=True")
    tr = plan.trace.cpu()
    t0 = int(tr[:, 0].min())
    start = (tr[:, 0] - t0).double() / 1e3
    end = (tr[:, 1] - t0).double() / 1e3
    ready = (tr[:, 4] - t0).double() / 1e3
    span = float(end.max())
    stages = {}
    for code, name in enumerate(STAGES):
        sel = tr[:, 3] == code
        if bool(sel.any()):
            stages[name] = {"tasks": int(sel.sum()), "first_start_us": round(float(start[sel].min()), 2),
                            "last_end_us": round(float(end[sel].max()), 2),
                            "mean_task_us": round(float((end[sel] - start[sel]).mean()), 2),
                            "mean_wait_us": round(float((ready[sel] - start[sel]).mean()), 2),
                            "mean_work_us": round(float((end[sel] - ready[sel]).mean()), 2)}
    busy = float((end - start).sum()) / (plan.programs * span) if span > 0 else 0.0
    return {"span_us": round(span, 2), "busy_fraction": round(busy, 3), "stages": stages}
