"""Fused transformer FFN (`fused_mlp`): validation, config, launch, custom-op registration.

``fused_mlp(x, w_gate_up, w_down, activation, policy)`` computes, with weights as ``nn.Linear``
stores them,

* ``"swiglu"``: ``(silu(x·gateᵀ) ∘ x·upᵀ)·w_downᵀ`` with ``w_gate_up = cat([gate, up])``,
  shape ``(2·intermediate, hidden)``;
* ``"gelu"`` (tanh approximation, as GPT-2), ``"silu"``, ``"relu"``: ``act(x·w_gate_upᵀ)·w_downᵀ``
  with ``w_gate_up`` = fc1's weight ``(intermediate, hidden)``;

``w_down`` is ``(hidden, intermediate)``. Kernels in :mod:`flashflow.kernels.ffn` (decode) and
:mod:`flashflow.kernels.mlp` (prefill):

* decode, M ≤ 64 tokens (``policy="splitk"``): each program computes a slice of the
  intermediate and multiplies it straight into fp32 output partials (split-K over the
  intermediate, atomic adds); a second, tiny launch (programmatically dependent on sm90) casts
  the sums and re-zeroes them. Weights are read once; the intermediate stays on chip.
* prefill (``"sequential[:R]" | "rowblock" | "multirow[:R]" | "halfrow" | "seqsplit[:R]"``): a
  persistent kernel whose programs take GEMM0 and GEMM1 tiles from a ticket counter in a
  dependency-respecting order; GEMM1 tiles wait on per-row-block counters that GEMM0 tiles
  release. On sm90 the tiles' operands come through host-built TMA descriptors.

``"auto"`` (:func:`resolve_policy`) picks split-K up to M = 32 (up to 64 where split-K runs in
one wave), then seqsplit:8 for at most two row-blocks (halfrow for one row-block of a
non-gated FFN), multirow:8 otherwise (H100, Llama-3-8B, × cuBLAS + CUDA graph: at M = 128
seqsplit 0.96, halfrow 0.91; at M = 256 seqsplit 1.05, multirow 0.94, halfrow 0.63; from
M = 512 on multirow is as fast or faster).

Baselines for the bench (same tile code): :func:`mlp_two_kernels` (GEMM0+act, then GEMM1) and
:func:`mlp_two_streams` (CuSync-style: producer and consumer kernels on two streams, flags).

State: a :class:`MlpWorkspace` (one zeroed int32 buffer: counters, and the split-K fp32
accumulator) that every kernel leaves zeroed again, so one workspace serves back-to-back calls
and CUDA-graph replays with no reset launch. Without one, a call takes the buffer flashflow keeps
per (device, stream) (during graph capture, a fresh zeroed one). Use one workspace per stream.
"""
from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from flashflow.kernels.mlp import (CNT_OFF, HALFROW, MAX_THREADS, MULTIROW, SEQSPLIT, SEQUENTIAL, SYNC_ERR,
                                   mlp_gemm0_kernel, mlp_gemm1_kernel, mlp_persistent_kernel)
from flashflow.ops.ffn import _capability, _on_gpu, decode_config, group_counters, launch_decode, wide_one_wave
from flashflow.reference.mlp import ACTIVATIONS
from flashflow.tuning import interpreting

DECODE_MAX_M = 64        # the split-K decode kernel takes at most this many tokens
# `auto` leaves split-K above this, unless split-K runs 128-wide slices in one wave there
# (ops.ffn.wide_one_wave: Llama-3-8B-like FFNs). Its fp32 atomics grow with M, and from M =
# 40-48 the persistent kernel (seqsplit / halfrow) beat the two-wave split-K configs (H100,
# CUDA graphs, all three suite FFNs: bench/results/tune-mlp-crossover-h100.json; at M = 32
# split-K leads for Llama-3-8B and GELU and ties for Llama-3-70B, at M = 64 it trails by
# 15-20%); the one-wave config measured 156.3 µs at M = 64 against seqsplit's 170.7.
AUTO_SPLITK_MAX_M = 32
POLICIES = ("auto", "splitk", "sequential", "rowblock", "multirow", "halfrow", "seqsplit")
GROUPED_POLICIES = ("sequential", "multirow", "seqsplit")   # take ":R" (row-blocks per group)
DEFAULT_GROUP_ROWS = 8
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ACT_CODE = {"swiglu": 0, "silu": 0, "gelu": 1, "relu": 2}
_POLICY_CODE = {"sequential": SEQUENTIAL, "rowblock": MULTIROW, "multirow": MULTIROW, "halfrow": HALFROW,
                "seqsplit": SEQSPLIT}
_SPLIT_K1 = (HALFROW, SEQSPLIT)   # policies whose GEMM1 tiles run as two K-halves
ACC_OFF = -(-CNT_OFF // 64) * 64   # split-K accumulator, 256-byte aligned, after the fixed words
GROUP_WORDS = 1024   # room after the accumulator for the grouped split-K kernel's group counters

# Bounded spins (debug): FLASHFLOW_MLP_SPIN_LIMIT=N makes a wait give up after N polls, set the
# error word, and the op raise. 0 = unbounded (production). The interpreter always bounds.
_SPIN_LIMIT = int(os.environ.get("FLASHFLOW_MLP_SPIN_LIMIT", "0"))
_INTERPRETER_SPIN_LIMIT = 5000


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitKConfig:
    BLOCK_I: int        # intermediate columns per program
    BLOCK_K: int        # GEMM0 step over hidden
    BLOCK_N: int        # GEMM1 step over hidden (output columns)
    num_warps: int = 4
    num_stages: int = 3
    stagger: int = 2         # rotate each program's loop start by its id (0 none, 1 output, 2 both)
    pdl: bool = True         # cast launch programmatically dependent on the main one (sm90+)
    group: int = 0           # 0, or 2/4/8…: that many slices' partials summed on chip before the
                             # atomic adds (ffn_decode_grouped_kernel; h goes through L2)


@dataclass(frozen=True)
class PersistentConfig:
    BLOCK_M: int
    BLOCK_N0: int       # intermediate columns per GEMM0 tile (gate and up each, when gated)
    BLOCK_N1: int       # output columns per GEMM1 tile
    BLOCK_K: int
    num_warps: int = 8
    num_stages: int = 3
    programs_per_sm: int = 1
    maxnreg: Optional[int] = None   # register cap per thread (to fit programs_per_sm > 1)
    use_tma: bool = False           # host TMA descriptors for x, W1, H, W_down (sm90+, fp16/bf16)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter runs programs one after another; a few are enough
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def splitk_config(m: int, hidden: int, inter: int, device: torch.device) -> SplitKConfig:
    """The decode kernel's tiles (:func:`flashflow.ops.ffn.decode_config`)."""
    return SplitKConfig(**decode_config(m, inter, True, device))


def persistent_config(gated: bool, device: torch.device, m: Optional[int] = None,
                      dtype: Optional[torch.dtype] = None) -> PersistentConfig:
    """Tiles of the prefill kernel for M = ``m`` tokens (None: large M).

    sm90+ (H100, 4096 → 14336, bf16, CUDA-graph replays, ``scripts/tune_mlp_prefill.py``,
    ``bench/results/tune-mlp-prefill-h100.json``): operands through host TMA descriptors,
    BLOCK_M 128, BLOCK_K 64, 8 warps, one program per SM, and

    * gated, more than 4 row-blocks: 128×128 GEMM0 tiles (two fp32 accumulators), 128×256
      GEMM1 tiles, 3 stages: 1.02–1.07× cuBLAS at M = 1024 and 4096, against 0.82× for the
      pointer-load kernel with 128×128 GEMM1 tiles;
    * gated, at most 4 row-blocks (M ≤ 512): 128×128 GEMM1 tiles (twice as many tiles to spread
      over the SMs) and 4 stages: 0.94× / 0.96× cuBLAS at M = 256 / 512, against 0.75× / 0.86×
      with 128×256 GEMM1 tiles;
    * not gated (one accumulator), more than 4 row-blocks: 128×256 tiles for both GEMMs, 3
      stages: 0.94× cuBLAS at M = 1024 and 4096, against 0.74–0.75× with 128×128 tiles;
    * not gated, at most 4 row-blocks: 128×128 tiles for both GEMMs and 4 stages, the gated
      rule's reason: at M ≤ 128 the 128×256 tiles give GPT-3's GELU FFN 56 GEMM0 and 16 GEMM1
      tiles (88 with seqsplit's K-halves) for 132 SMs, and the suite measured 141–148 µs at
      M = 1–64 against torch's 90–95 (the weights alone take 78 µs). 128×128 gives 176.
      *Not yet measured on a GPU* (no device was lent when it was made);
      ``scripts/gpu_verify.sh mlp-small`` times it against the 128×256 tiles.

    fp32 (pointer loads, no TMA, twice the bytes a stage) keeps 3 stages at M ≤ 512: with 4 the
    gated kernel needs 288 KB of shared memory (sm90 build), over the 227 KB a CTA may have.

    Older GPUs: pointer loads (cp.async), 128×128 tiles everywhere."""
    if not _on_gpu(device):
        return PersistentConfig(BLOCK_M=32, BLOCK_N0=32, BLOCK_N1=32, BLOCK_K=32, num_warps=4,
                                num_stages=1)
    return persistent_config_for(gated, _capability(device), m, dtype)


def persistent_config_for(gated: bool, capability: tuple[int, int], m: Optional[int] = None,
                          dtype: Optional[torch.dtype] = None) -> PersistentConfig:
    """:func:`persistent_config` for a CUDA GPU of compute ``capability`` (no device needed:
    the bench's traffic model asks what the H100 runs)."""
    if capability[0] < 9:
        return PersistentConfig(BLOCK_M=128, BLOCK_N0=128, BLOCK_N1=128, BLOCK_K=64, num_warps=8,
                                num_stages=3)
    few_rows = m is not None and _cdiv(m, 128) <= 4
    if not gated and not few_rows:
        return PersistentConfig(BLOCK_M=128, BLOCK_N0=256, BLOCK_N1=256, BLOCK_K=64, num_warps=8,
                                num_stages=3, use_tma=True)
    if few_rows:
        return PersistentConfig(BLOCK_M=128, BLOCK_N0=128, BLOCK_N1=128, BLOCK_K=64, num_warps=8,
                                num_stages=3 if dtype == torch.float32 else 4, use_tma=True)
    return PersistentConfig(BLOCK_M=128, BLOCK_N0=128, BLOCK_N1=256, BLOCK_K=64, num_warps=8,
                            num_stages=3, use_tma=True)


# --------------------------------------------------------------------------------------------
# tile orders (Python mirror of kernels.mlp.ticket_to_tile, for tests, docs and the bench)
# --------------------------------------------------------------------------------------------


def parse_policy(policy) -> tuple[str, int]:
    """``"multirow:4"`` -> ("multirow", 4); other names get their group size (rows sharing one
    pass over the weights). Raises ValueError naming the accepted forms."""
    forms = f"one of {POLICIES} or 'NAME:R' with NAME in {GROUPED_POLICIES}"
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a str, {forms}, got {type(policy).__name__}")
    name, sep, arg = policy.partition(":")
    if name not in POLICIES or (sep and name not in GROUPED_POLICIES):
        raise ValueError(f"policy must be {forms} (R ≥ 1 row-blocks, e.g. 'multirow:R'), got {policy!r}")
    if sep:
        try:
            rows = int(arg)
        except ValueError:
            rows = 0
        if rows < 1:
            raise ValueError(f"policy '{name}:R' needs an integer R ≥ 1 (e.g. 'multirow:R'), got {policy!r}")
        return name, rows
    return name, {"rowblock": 1, "halfrow": 1}.get(name, DEFAULT_GROUP_ROWS)


def _grouped(tiles_m: int, tiles_n: int, group_rows: int, first_row: int = 0, rows: Optional[int] = None):
    rows = tiles_m - first_row if rows is None else rows
    out = []
    for g0 in range(first_row, first_row + rows, group_rows):
        block = range(g0, min(g0 + group_rows, first_row + rows))
        out += [(r, j) for j in range(tiles_n) for r in block]
    return out


def _unsplit_if_one_tile(policy: str, n0: int) -> str:
    """One intermediate block leaves nothing to halve: halfrow runs as rowblock, seqsplit as
    sequential (the kernel and its Python mirror alike)."""
    if policy in ("halfrow", "seqsplit") and n0 < 2:
        return "rowblock" if policy == "halfrow" else "sequential"
    return policy


def issue_order(policy: str, tiles_m: int, n0: int, n1: int, group_rows: int = 1) -> list[tuple[int, int, int, int]]:
    """Tiles in ticket order as (kind, r, j, part): kind 0 = GEMM0 tile (row-block r,
    intermediate block j), kind 1 = GEMM1 tile (r, output block j); part = halfrow's half."""
    policy = _unsplit_if_one_tile(policy, n0)
    half = _cdiv(n0, 2)
    if policy == "sequential":
        return ([(0, r, j, 0) for r, j in _grouped(tiles_m, n0, group_rows)]
                + [(1, r, j, 0) for r, j in _grouped(tiles_m, n1, group_rows)])
    if policy == "seqsplit":
        return ([(0, r, j, int(j >= half)) for r, j in _grouped(tiles_m, n0, group_rows)]
                + [(1, r, j, p) for p in (0, 1) for r, j in _grouped(tiles_m, n1, group_rows)])
    if policy in ("multirow", "rowblock"):
        group_rows = 1 if policy == "rowblock" else group_rows
        out = []
        for g0 in range(0, tiles_m, group_rows):
            rows = min(group_rows, tiles_m - g0)
            out += [(0, r, j, 0) for r, j in _grouped(tiles_m, n0, rows, g0, rows)]
            out += [(1, r, j, 0) for r, j in _grouped(tiles_m, n1, rows, g0, rows)]
        return out
    if policy == "halfrow":
        out = []
        for r in range(tiles_m):
            out += [(0, r, j, 0) for j in range(half)] + [(1, r, c, 0) for c in range(n1)]
            out += [(0, r, j, 1) for j in range(half, n0)] + [(1, r, c, 1) for c in range(n1)]
        return out
    raise ValueError(f"no tile order for policy {policy!r}")


def dependency_violations(order, n0: int, split: bool) -> list[str]:
    """Every dependency of a tile must have a smaller ticket (the deadlock-freedom rule).
    ``split``: GEMM1 runs as two K-halves (halfrow, seqsplit); part p needs GEMM0 columns of
    half p, and part 1 also needs part 0 of the same tile."""
    half = _cdiv(n0, 2)
    seen, bad = set(), []
    for t, (kind, r, j, part) in enumerate(order):
        if kind == 1:
            cols = range(n0) if not split else (range(half) if part == 0 else range(half, n0))
            needs = [(0, r, jj, int(split and jj >= half)) for jj in cols]
            if split and part == 1:
                needs.append((1, r, j, 0))
            bad += [f"ticket {t} {order[t]} waits on {d}, not issued before" for d in needs if d not in seen]
        seen.add((kind, r, j, part))
    return bad


# --------------------------------------------------------------------------------------------
# workspace
# --------------------------------------------------------------------------------------------


def sync_words(m: int, hidden: int, cfg: PersistentConfig) -> int:
    """Int32 words the persistent kernel needs: fixed words, 2 counters per row-block and
    (halfrow) a flag per GEMM1 tile."""
    tiles_m = _cdiv(m, cfg.BLOCK_M)
    return CNT_OFF + 2 * tiles_m + tiles_m * _cdiv(hidden, cfg.BLOCK_N1)


class MlpWorkspace:
    """Zeroed scratch for :func:`fused_mlp`, reusable across calls and CUDA-graph replays.

    One int32 buffer: ticket/arrival counters, per-row-block counters and (for M ≤ 64) the
    fp32 split-K accumulator; every kernel leaves what it used zeroed. Calls that share a
    workspace must be ordered (one stream). If a launch is aborted, call :meth:`reset`.
    """

    def __init__(self, hidden: int, max_tokens: int = DECODE_MAX_M, device="cuda"):
        if not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"hidden must be a positive int, got {hidden!r}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        self.hidden, self.max_tokens = hidden, max_tokens
        smallest = PersistentConfig(BLOCK_M=16, BLOCK_N0=16, BLOCK_N1=16, BLOCK_K=16)
        acc_words = _cdiv(min(max_tokens, DECODE_MAX_M) * hidden, 64) * 64
        words = max(ACC_OFF + acc_words + GROUP_WORDS, sync_words(max_tokens, hidden, smallest))
        self.buffer = torch.zeros(words, dtype=torch.int32, device=device)

    def reset(self) -> None:
        self.buffer.zero_()

    def __repr__(self) -> str:
        return (f"MlpWorkspace(hidden={self.hidden}, max_tokens={self.max_tokens}, "
                f"device={self.buffer.device}, {self.buffer.numel() * 4} bytes)")


_IMPLICIT: dict = {}   # (device, stream) -> the zeroed buffer of calls that passed no workspace
_IMPLICIT_LOCK = threading.Lock()


def _implicit_buffer(words: int, device) -> torch.Tensor:
    """The workspace of a call that passed none: kept per (device, stream) and grown on demand,
    so an eager call costs no allocation and no memset. Every kernel leaves it zeroed, and
    calls on one stream are ordered. During graph capture a fresh zeroed buffer is made as
    before: a graph must not keep a pointer into a buffer this cache may replace."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(words, dtype=torch.int32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    with _IMPLICIT_LOCK:
        buf = _IMPLICIT.get(key)
        if buf is None or buf.numel() < words:
            buf = _IMPLICIT[key] = torch.zeros(max(words, 2 * (0 if buf is None else buf.numel())),
                                               dtype=torch.int32, device=device)
    return buf


def _buffer(workspace: Optional[MlpWorkspace], words: int, device) -> torch.Tensor:
    if workspace is None:
        return _implicit_buffer(words, device)
    if not isinstance(workspace, MlpWorkspace):
        raise TypeError(f"workspace must be a flashflow MlpWorkspace or None, got {type(workspace).__name__}")
    if workspace.buffer.device != device:
        raise ValueError(f"workspace is on {workspace.buffer.device}, the inputs on {device}")
    if workspace.buffer.numel() < words:
        raise ValueError(f"workspace holds {workspace.buffer.numel()} words, this call needs {words}: "
                         f"make it with MlpWorkspace(hidden, max_tokens ≥ this call's tokens)")
    return workspace.buffer


def _spin_limit(device) -> int:
    return _INTERPRETER_SPIN_LIMIT if device.type != "cuda" else _SPIN_LIMIT


def _check_error(buf: torch.Tensor, spin_limit: int) -> None:
    """With bounded spins, a wait that ran out set SYNC_ERR: raise (syncs; debug mode only)."""
    if spin_limit <= 0 or (buf.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    if int(buf[SYNC_ERR]) != 0:
        buf.zero_()
        raise RuntimeError("fused_mlp: a dependency wait ran out of spins (tile order bug or a hang); "
                           "the workspace was reset")


# --------------------------------------------------------------------------------------------
# validation (shape/dtype only: safe under torch.compile tracing)
# --------------------------------------------------------------------------------------------


def _check(x, w_gate_up, w_down, activation) -> None:
    for name, t, form in (("x", x, "(..., hidden)"), ("w_gate_up", w_gate_up, "(rows, hidden)"),
                          ("w_down", w_down, "(hidden, intermediate)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape {form}, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (x.dtype == w_gate_up.dtype == w_down.dtype):
        raise TypeError(f"x, w_gate_up, w_down must share one dtype, got {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}")
    if not (x.device == w_gate_up.device == w_down.device):
        raise ValueError(f"x, w_gate_up, w_down must be on one device, got {x.device}, {w_gate_up.device}, "
                         f"{w_down.device}")
    if not _on_gpu(x.device) and not interpreting():
        raise ValueError(f"flashflow's fused_mlp runs on CUDA tensors; got x on {x.device} "
                         "(or set TRITON_INTERPRET=1 to run Triton's CPU interpreter)")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have shape (..., hidden) with hidden ≥ 1, got {tuple(x.shape)}")
    if w_gate_up.dim() != 2:
        raise ValueError(f"w_gate_up must be 2-D (rows, hidden), got shape {tuple(w_gate_up.shape)}")
    if w_down.dim() != 2 or w_down.shape[1] < 1:
        raise ValueError(f"w_down must be 2-D (hidden, intermediate) with intermediate ≥ 1, "
                         f"got shape {tuple(w_down.shape)}")
    hidden = x.shape[-1]
    if w_down.shape[0] != hidden:
        raise ValueError(f"w_down must be (hidden, intermediate) = ({hidden}, ...) for x of shape "
                         f"{tuple(x.shape)}, got {tuple(w_down.shape)}")
    inter = w_down.shape[1]
    rows = 2 * inter if activation == "swiglu" else inter
    if tuple(w_gate_up.shape) != (rows, hidden):
        form = ("(2·intermediate, hidden) = cat([gate_proj.weight, up_proj.weight])" if activation == "swiglu"
                else "(intermediate, hidden) = fc1.weight")
        raise ValueError(f"w_gate_up must be {form} = {(rows, hidden)} for activation {activation!r}, "
                         f"hidden {hidden} and intermediate {inter} (from w_down), got {tuple(w_gate_up.shape)}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _dot_precision(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def resolve_policy(policy: str, m: int, cfg: Optional[PersistentConfig] = None,
                   gated: bool = True, inter: Optional[int] = None,
                   device: Optional[torch.device] = None) -> tuple[str, int]:
    """(policy, group_rows) that ``policy`` runs as for M = ``m`` tokens ("auto" resolved).
    ``inter`` and ``device`` let `auto` keep split-K up to 64 tokens where it runs in one wave.

    One or two row-blocks (H100, mlp suite, bench/results/mlp-nvidia-h100-80gb-hbm3.json):
    seqsplit, whose GEMM1 K-halves double GEMM1's parallelism, except for one row-block of a
    non-gated FFN, where halfrow and seqsplit tie (GPT-3 GELU M = 64: 147.7 / 148.3 µs). GELU at
    M = 256: seqsplit 158.8 µs against multirow 199.5 and halfrow 214.8."""
    name, rows = parse_policy(policy)
    if name != "auto":
        return name, rows
    if m <= AUTO_SPLITK_MAX_M:
        return "splitk", 1
    if m <= DECODE_MAX_M and inter is not None and device is not None and \
            wide_one_wave(m, inter, gated, device):
        return "splitk", 1
    tiles_m = _cdiv(m, (cfg.BLOCK_M if cfg else 128))
    if tiles_m == 1 and not gated:
        return "halfrow", 1
    if tiles_m <= 2:
        return "seqsplit", DEFAULT_GROUP_ROWS
    return "multirow", DEFAULT_GROUP_ROWS


# --------------------------------------------------------------------------------------------
# launchers (validated inputs: x2 is (M, hidden) with unit last stride)
# --------------------------------------------------------------------------------------------


def launch_splitk(x2, w1, w2, activation, workspace=None, config: Optional[SplitKConfig] = None):
    """Decode regime (M ≤ 64): :func:`flashflow.ops.ffn.launch_decode` on the workspace's fp32
    accumulator (one main launch, one tiny cast launch; the accumulator is left zeroed)."""
    m, hidden = x2.shape
    if m > DECODE_MAX_M:
        raise ValueError(f"policy 'splitk' is the decode kernel, for M ≤ {DECODE_MAX_M} tokens; got M={m}")
    cfg = None if config is None else {k: getattr(config, k) for k in SplitKConfig.__dataclass_fields__}
    group = config.group if config is not None else 0
    # the grouped kernel's group counters follow the accumulator (the fixed words lead the buffer)
    grp_off = ACC_OFF + _cdiv(m * hidden, 64) * 64
    n_groups = group_counters(w2.shape[1], config.BLOCK_I, group) if group else 0
    if n_groups > GROUP_WORDS:
        raise ValueError(f"SplitKConfig group={group} with BLOCK_I={config.BLOCK_I} makes {n_groups} groups; "
                         f"at most {GROUP_WORDS}: take a larger group or BLOCK_I")
    buf = _buffer(workspace, grp_off + n_groups if group else ACC_OFF + m * hidden, x2.device)
    acc = buf[ACC_OFF:ACC_OFF + m * hidden].view(torch.float32).view(m, hidden)
    if not group:
        return launch_decode(x2, w1, w2, activation, acc, cfg)
    spin = _spin_limit(x2.device)
    out = launch_decode(x2, w1, w2, activation, acc, cfg, sync=buf, grp_off=grp_off, spin_limit=spin)
    _check_error(buf, spin)
    return out


def _tma_capable(device: torch.device) -> bool:
    if interpreting():
        return True   # the interpreter emulates descriptors (tests of the TMA path)
    return _on_gpu(device) and _capability(device)[0] >= 9


def _tma_aligned(*tensors: torch.Tensor) -> bool:
    """Descriptors need 16-byte aligned bases and row strides (the last stride is 1)."""
    return all(t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])
               for t in tensors)


def _descriptors(x2, w1, w2, h, inter, gated, cfg):
    """Host TMA descriptors (x, gate rows, up rows, H, W_down), or None where the pointer path
    must run. The gate and up rows get a descriptor each, so a gate tile past ``inter`` is
    zero-filled instead of reading up rows."""
    if not (cfg.use_tma and x2.dtype in (torch.float16, torch.bfloat16) and _tma_capable(x2.device)):
        return None
    gate, up = (w1[:inter], w1[inter:]) if gated else (w1, w1)
    if not _tma_aligned(x2, gate, up, w2, h):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block)

    bm, bk = cfg.BLOCK_M, cfg.BLOCK_K
    return (desc(x2, [bm, bk]), desc(gate, [cfg.BLOCK_N0, bk]), desc(up, [cfg.BLOCK_N0, bk]),
            desc(h, [bm, bk]), desc(w2, [cfg.BLOCK_N1, bk]))


def launch_persistent(x2, w1, w2, activation, policy="multirow", group_rows=DEFAULT_GROUP_ROWS,
                      workspace=None, config: Optional[PersistentConfig] = None,
                      num_programs: Optional[int] = None, out: Optional[torch.Tensor] = None,
                      h: Optional[torch.Tensor] = None):
    """Prefill regime. ``out`` (M, hidden) and ``h`` (M, inter), contiguous, may be given (the
    GPU checks pass NaN-filled ones, so a tile that is never written shows)."""
    m, hidden = x2.shape
    inter = w2.shape[1]
    gated = activation == "swiglu"
    cfg = config or persistent_config(gated, x2.device, m, x2.dtype)
    if out is None:
        out = torch.empty((m, hidden), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return out
    tiles_m, n0, n1 = _cdiv(m, cfg.BLOCK_M), _cdiv(inter, cfg.BLOCK_N0), _cdiv(hidden, cfg.BLOCK_N1)
    policy = _unsplit_if_one_tile(policy, n0)
    group_rows = 1 if policy in ("rowblock", "halfrow") else max(1, group_rows)
    code = _POLICY_CODE[policy]
    split = code in _SPLIT_K1
    total = tiles_m * (n0 + (2 if split else 1) * n1)
    buf = _buffer(workspace, sync_words(m, hidden, cfg), x2.device)
    if h is None:
        h = torch.empty((m, inter), dtype=x2.dtype, device=x2.device)
    part = torch.empty((m, hidden), dtype=torch.float32, device=x2.device) if split else out
    programs = num_programs or num_sms(x2.device) * cfg.programs_per_sm
    programs = max(1, min(programs, total))
    threads = cfg.num_warps * 32
    assert threads <= MAX_THREADS and cfg.BLOCK_N0 % cfg.BLOCK_K == 0
    descs = _descriptors(x2, w1, w2, h, inter, gated, cfg)
    use_tma = descs is not None
    spin = _spin_limit(x2.device)
    mlp_persistent_kernel[(programs,)](
        x2, w1, w2, h, out, part, buf, *(descs or (None,) * 5), m, hidden, inter,
        x2.stride(0), w1.stride(0), w2.stride(0), h.stride(0), out.stride(0),
        tiles_m, n0, n1, group_rows, _cdiv(n0, 2), CNT_OFF + 2 * tiles_m, spin,
        POLICY=code, BLOCK_M=cfg.BLOCK_M, BLOCK_N0=cfg.BLOCK_N0, BLOCK_N1=cfg.BLOCK_N1,
        BLOCK_K=cfg.BLOCK_K, GATED=gated, ACTIVATION=_ACT_CODE[activation], THREADS=threads,
        DOT_PRECISION=_dot_precision(x2.dtype), USE_TMA=use_tma, PROXY_FENCE=use_tma and _on_gpu(x2.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and _on_gpu(x2.device) else {}),
    )
    _check_error(buf, spin)
    return out


def _fused_mlp_impl(x2: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str,
                    policy: str, workspace: Optional[MlpWorkspace] = None) -> torch.Tensor:
    cfg = persistent_config(activation == "swiglu", x2.device, x2.shape[0], x2.dtype)
    name, rows = resolve_policy(policy, x2.shape[0], cfg, activation == "swiglu", w2.shape[1], x2.device)
    if name == "splitk":
        return launch_splitk(x2, w1, w2, activation, workspace)
    return launch_persistent(x2, w1, w2, activation, name, rows, workspace, cfg)


def _fused_mlp_op_impl(x2: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str,
                       policy: str) -> torch.Tensor:
    return _fused_mlp_impl(x2, w1, w2, activation, policy)


_fused_mlp_op = torch.library.custom_op("flashflow::fused_mlp", mutates_args=())(_fused_mlp_op_impl)


@_fused_mlp_op.register_fake
def _(x2, w1, w2, activation, policy):
    return x2.new_empty((x2.shape[0], x2.shape[1]))


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def fused_mlp(x, w_gate_up, w_down, activation="swiglu", policy="auto", workspace=None):
    """Transformer FFN in one launch, weights in ``nn.Linear`` layout.

    Args:
        x: ``(..., hidden)``, bf16/fp16 (fp32 accepted, computed in fp32).
        w_gate_up: ``"swiglu"``: ``cat([gate_proj.weight, up_proj.weight])``,
            ``(2·intermediate, hidden)``; otherwise fc1's weight ``(intermediate, hidden)``.
        w_down: ``(hidden, intermediate)``.
        activation: ``"swiglu"``, ``"gelu"`` (tanh approximation), ``"silu"`` or ``"relu"``.
        policy: ``"auto"`` (split-K up to M = 32, or 64 where it runs in one wave, then the
            persistent kernel); ``"splitk"``
            (decode kernel, M ≤ 64); or a persistent-kernel tile
            order: ``"sequential"``, ``"rowblock"``, ``"multirow"`` / ``"multirow:R"``, ``"halfrow"``,
            ``"seqsplit"`` (``"sequential"`` and ``"seqsplit"`` also take ``:R``).
        workspace: an :class:`MlpWorkspace` (``max_tokens`` ≥ this call's tokens) to reuse
            across calls and CUDA-graph replays; None takes one kept per (device, stream) by
            flashflow (a fresh zeroed one while a CUDA graph is being captured).
    Returns:
        ``(..., hidden)`` in x's dtype. The intermediate is rounded to x's dtype, as the
        unfused FFN rounds it; accumulation is fp32.
    """
    _check(x, w_gate_up, w_down, activation)
    m = x.numel() // x.shape[-1]
    name, _ = resolve_policy(policy, m)
    if name == "splitk" and m > DECODE_MAX_M:
        raise ValueError(f"policy 'splitk' is the decode kernel, for at most {DECODE_MAX_M} tokens; "
                         f"x has {m} (use 'auto' or a persistent policy)")
    x2, w1, w2 = _rows(x), _unit_last(w_gate_up), _unit_last(w_down)
    if torch.compiler.is_compiling():
        if workspace is not None:
            raise ValueError("workspace is not supported under torch.compile; pass None")
        out = _fused_mlp_op(x2, w1, w2, activation, policy)
    else:
        out = _fused_mlp_impl(x2, w1, w2, activation, policy, workspace)
    return out.reshape(x.shape)


# --------------------------------------------------------------------------------------------
# baselines (the bench's anchors; same tiles as the persistent kernel)
# --------------------------------------------------------------------------------------------


def _gemm_dims(x2, w2, cfg):
    m, hidden = x2.shape
    inter = w2.shape[1]
    return m, hidden, inter, _cdiv(m, cfg.BLOCK_M), _cdiv(inter, cfg.BLOCK_N0), _cdiv(hidden, cfg.BLOCK_N1)


def _launch_gemm0(x2, w1, h, buf, activation, cfg, signal):
    m, hidden = x2.shape
    inter = h.shape[1]
    tiles_m, n0 = _cdiv(m, cfg.BLOCK_M), _cdiv(inter, cfg.BLOCK_N0)
    mlp_gemm0_kernel[(tiles_m * n0,)](
        x2, w1, h, buf, m, hidden, inter, x2.stride(0), w1.stride(0), h.stride(0),
        tiles_m, n0, DEFAULT_GROUP_ROWS, SIGNAL=signal,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N0=cfg.BLOCK_N0, BLOCK_K=cfg.BLOCK_K, GATED=activation == "swiglu",
        ACTIVATION=_ACT_CODE[activation], THREADS=cfg.num_warps * 32,
        DOT_PRECISION=_dot_precision(x2.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch_gemm1(h, w2, out, buf, cfg, n0, programs=None):
    m, inter = h.shape
    hidden = out.shape[1]
    tiles_m, n1 = _cdiv(m, cfg.BLOCK_M), _cdiv(hidden, cfg.BLOCK_N1)
    wait = programs is not None
    mlp_gemm1_kernel[(programs if wait else tiles_m * n1,)](
        h, w2, out, buf, m, hidden, inter, h.stride(0), w2.stride(0), out.stride(0),
        tiles_m, n0, n1, DEFAULT_GROUP_ROWS, _spin_limit(h.device), WAIT=wait,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N1=cfg.BLOCK_N1, BLOCK_K=cfg.BLOCK_K, THREADS=cfg.num_warps * 32,
        DOT_PRECISION=_dot_precision(h.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def mlp_two_kernels(x, w_gate_up, w_down, activation="swiglu", config: Optional[PersistentConfig] = None):
    """Baseline: GEMM0 + activation, then GEMM1, as two launches (H through device memory)."""
    _check(x, w_gate_up, w_down, activation)
    x2, w1, w2 = _rows(x), _unit_last(w_gate_up), _unit_last(w_down)
    cfg = config or persistent_config(activation == "swiglu", x2.device, x2.shape[0], x2.dtype)
    m, hidden, inter, _, _, _ = _gemm_dims(x2, w2, cfg)
    out = torch.empty((m, hidden), dtype=x2.dtype, device=x2.device)
    if m:
        h = torch.empty((m, inter), dtype=x2.dtype, device=x2.device)
        _launch_gemm0(x2, w1, h, x2, activation, cfg, signal=False)
        _launch_gemm1(h, w2, out, x2, cfg, 0)
    return out.reshape(x.shape)


def mlp_two_streams(x, w_gate_up, w_down, activation="swiglu", workspace=None,
                    config: Optional[PersistentConfig] = None, consumer_programs: Optional[int] = None):
    """Baseline, CuSync-style: the GEMM0 kernel (producer, one program per tile) on the current
    stream bumps per-row-block counters; the GEMM1 kernel (consumer, persistent, tickets in
    row-group order) runs concurrently on a side stream and waits on them per tile. The
    consumer gets at most SMs − 16 programs so the producer always has SMs to run on (no
    deadlock whatever the order in which the hardware starts the two kernels' programs)."""
    _check(x, w_gate_up, w_down, activation)
    x2, w1, w2 = _rows(x), _unit_last(w_gate_up), _unit_last(w_down)
    cfg = config or persistent_config(activation == "swiglu", x2.device, x2.shape[0], x2.dtype)
    m, hidden, inter, tiles_m, n0, n1 = _gemm_dims(x2, w2, cfg)
    out = torch.empty((m, hidden), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return out.reshape(x.shape)
    buf = _buffer(workspace, sync_words(m, hidden, cfg), x2.device)
    h = torch.empty((m, inter), dtype=x2.dtype, device=x2.device)
    sms = num_sms(x2.device)
    programs = max(1, min(consumer_programs or max(1, sms - 16), tiles_m * n1))
    if x2.is_cuda:
        main = torch.cuda.current_stream(x2.device)
        side = torch.cuda.Stream(x2.device)
        side.wait_stream(main)
        _launch_gemm0(x2, w1, h, buf, activation, cfg, signal=True)
        with torch.cuda.stream(side):
            _launch_gemm1(h, w2, out, buf, cfg, n0, programs)
        main.wait_stream(side)
        for t in (h, out, buf):
            t.record_stream(side)
    else:  # the interpreter has no streams: producer, then consumer
        _launch_gemm0(x2, w1, h, buf, activation, cfg, signal=True)
        _launch_gemm1(h, w2, out, buf, cfg, n0, programs)
        _check_error(buf, _spin_limit(x2.device))
    return out.reshape(x.shape)
