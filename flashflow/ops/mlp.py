"""Fused transformer FFN (`fused_mlp`): validation, plan and config lookup, launch, custom op.

``fused_mlp(x, w_gate_up, w_down, activation, policy)`` computes, with weights as ``nn.Linear``
stores them,

* ``"swiglu"``: ``(silu(x·gateᵀ) ∘ x·upᵀ)·w_downᵀ`` with ``w_gate_up = cat([gate, up])``,
  shape ``(2·intermediate, hidden)``;
* ``"gelu"`` (tanh approximation, as GPT-2), ``"silu"``, ``"relu"``: ``act(x·w_gate_upᵀ)·w_downᵀ``
  with ``w_gate_up`` = fc1's weight ``(intermediate, hidden)``;

``w_down`` is ``(hidden, intermediate)``. Plans (``policy``):

* ``"splitk"`` (decode, M ≤ 64 tokens; :mod:`flashflow.kernels.mlp_splitk`): each program
  computes a slice of the intermediate and multiplies it straight into fp32 output partials
  (split-K over the intermediate, atomic adds); a second, tiny launch (programmatically
  dependent on sm90) casts the sums and re-zeroes them. Weights are read once; the
  intermediate stays on chip.
* a tile order of the persistent kernel (:mod:`flashflow.kernels.mlp`; ``"sequential[:R]"``,
  ``"rowblock"``, ``"multirow[:R]"``, ``"halfrow"``, ``"seqsplit[:R]"``, defined in
  :mod:`flashflow.kernels.tile_order`): programs take GEMM0 and GEMM1 tiles from a ticket
  counter in a dependency-respecting order; GEMM1 tiles wait on per-row-block counters that
  GEMM0 tiles release. On sm90 the tiles' operands come through host-built TMA descriptors.
* ``"cublas"``: ``F.linear``, the activation, ``F.linear`` — the unfused FFN, for the shapes
  where no fused plan beats it.
* ``"auto"``: the plan ``flashflow/tuning/mlp.json`` names for the GPU family, gated or not,
  the split-K slice width and M (:func:`flashflow.tuning.mlp.auto_plan`); on an H100 that is
  split-K, the persistent kernel or cuBLAS, whichever measured fastest.

Baselines for the bench (same tile code): :func:`mlp_two_kernels` (GEMM0+act, then GEMM1) and
:func:`mlp_two_streams` (CuSync-style: producer and consumer kernels on two streams, flags).

State: a :class:`MlpWorkspace` (one zeroed int32 buffer: counters, and the split-K fp32
accumulator) that every kernel leaves zeroed again, so one workspace serves back-to-back calls
and CUDA-graph replays with no reset launch. Without one, a call takes the buffer flashflow keeps
per (device, stream) (during graph capture, a fresh zeroed one). Use one workspace per stream.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from flashflow.device import capability, capturing, cdiv, gpu_family, interpreting, num_sms, on_gpu
from flashflow.kernels.mlp import (ACTIVATION_CODE, ACTIVATIONS, mlp_gemm0_kernel, mlp_gemm1_kernel,
                                   mlp_persistent_kernel)
from flashflow.kernels.mlp_splitk import mlp_splitk_cast_kernel, mlp_splitk_grouped_kernel, mlp_splitk_kernel
from flashflow.kernels.sync import CNT_OFF, MAX_THREADS, SYNC_ERR
from flashflow.kernels.tile_order import (DEFAULT_GROUP_ROWS, GROUPED_ORDERS, ORDERS, issue_order, launch_order,
                                         parse_order)
from flashflow.ops.common import (Launcher, dot_precision, launch_by_arguments, stream_scratch,
                                  tma_compatible, unit_last_stride)
from flashflow.ops.validate import FLOAT_DTYPES, check_no_grad
from flashflow.tuning import mlp as tuning
from flashflow.tuning.mlp import PersistentConfig, SplitKConfig

__all__ = ["fused_mlp", "MlpWorkspace", "ACTIVATIONS", "POLICIES", "PersistentConfig", "SplitKConfig",
           "parse_policy", "resolve_policy", "splitk_config", "persistent_config", "launch_splitk",
           "launch_persistent", "launch_cublas", "mlp_two_kernels", "mlp_two_streams", "issue_order"]

DECODE_MAX_M = 64        # the split-K kernel takes at most this many tokens
PLANS = ("auto", "splitk", "cublas")
POLICIES = PLANS + ORDERS
ACC_OFF = cdiv(CNT_OFF, 64) * 64   # split-K accumulator, 256-byte aligned, after the fixed words
GROUP_WORDS = 1024   # room after the accumulator for the grouped split-K kernel's group counters

# Bounded spins (debug): FLASHFLOW_MLP_SPIN_LIMIT=N makes a wait give up after N polls, set the
# error word, and the op raise. 0 = unbounded (production). The interpreter always bounds.
_SPIN_LIMIT = int(os.environ.get("FLASHFLOW_MLP_SPIN_LIMIT", "0"))
_INTERPRETER_SPIN_LIMIT = 5000


# --------------------------------------------------------------------------------------------
# plans and configs (numbers: flashflow/tuning/mlp.json)
# --------------------------------------------------------------------------------------------


def parse_policy(policy) -> tuple[str, int]:
    """``"multirow:4"`` -> ("multirow", 4); a name without ``:R`` gets its group size (rows
    sharing one pass over the weights; 1 for the plans that have none). Raises ValueError
    naming the accepted forms."""
    forms = f"one of {POLICIES} or 'NAME:R' with NAME in {GROUPED_ORDERS}"
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a str, {forms}, got {type(policy).__name__}")
    if policy in PLANS:
        return policy, 1
    try:
        return parse_order(policy)
    except ValueError:
        raise ValueError(f"policy must be {forms} (R ≥ 1 row-blocks, e.g. 'multirow:R'), got {policy!r}") from None


def _dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def splitk_config(m: int, inter: int, gated: bool, device: torch.device) -> SplitKConfig:
    """The split-K kernel's config for this device's GPU family and SM count."""
    return tuning.splitk_config(gpu_family(device), gated, m, inter, num_sms(device))


def persistent_config(gated: bool, device: torch.device, m: Optional[int] = None,
                      dtype: Optional[torch.dtype] = None) -> PersistentConfig:
    """The persistent kernel's config for M = ``m`` tokens (None: large M) on this device."""
    return tuning.persistent_config(gpu_family(device), gated, m, _dtype_name(dtype))


def resolve_policy(policy: str, m: int, gated: bool, inter: int, device: torch.device) -> tuple[str, int]:
    """(plan, group_rows) that ``policy`` runs as for M = ``m`` tokens ("auto" looked up in
    flashflow/tuning/mlp.json for the device's family, ``gated``, and the split-K slice width
    of an intermediate of ``inter`` on its SMs)."""
    name, rows = parse_policy(policy)
    if name != "auto":
        return name, rows
    return parse_policy(tuning.auto_plan(gpu_family(device), gated, m, inter, num_sms(device)))


# --------------------------------------------------------------------------------------------
# workspace
# --------------------------------------------------------------------------------------------


def sync_words(m: int, hidden: int, cfg: PersistentConfig) -> int:
    """Int32 words the persistent kernel needs: fixed words, 2 counters per row-block and
    (halfrow) a flag per GEMM1 tile."""
    tiles_m = cdiv(m, cfg.BLOCK_M)
    return CNT_OFF + 2 * tiles_m + tiles_m * cdiv(hidden, cfg.BLOCK_N1)


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
        acc_words = cdiv(min(max_tokens, DECODE_MAX_M) * hidden, 64) * 64
        words = max(ACC_OFF + acc_words + GROUP_WORDS, sync_words(max_tokens, hidden, smallest))
        self.buffer = torch.zeros(words, dtype=torch.int32, device=device)

    def reset(self) -> None:
        self.buffer.zero_()

    def __repr__(self) -> str:
        return (f"MlpWorkspace(hidden={self.hidden}, max_tokens={self.max_tokens}, "
                f"device={self.buffer.device}, {self.buffer.numel() * 4} bytes)")


def _implicit_buffer(words: int, device) -> torch.Tensor:
    """The workspace of a call that passed none (:func:`~flashflow.ops.common.stream_scratch`)."""
    return stream_scratch("mlp", words, device)


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
    # offline compilation (CPU tensors standing for a GPU) must build what the GPU runs: unbounded
    return _INTERPRETER_SPIN_LIMIT if interpreting() else _SPIN_LIMIT


def _check_error(buf: torch.Tensor, spin_limit: int) -> None:
    """With bounded spins, a wait that ran out set SYNC_ERR: raise (syncs; debug mode only)."""
    if spin_limit <= 0 or capturing(buf.device):
        return
    if int(buf[SYNC_ERR]) != 0:
        buf.zero_()
        raise RuntimeError("fused_mlp: a dependency wait ran out of spins (tile order bug or a hang); "
                           "the workspace was reset")


# --------------------------------------------------------------------------------------------
# validation (shape/dtype only: safe under torch.compile tracing)
# --------------------------------------------------------------------------------------------


def _check(x, w_gate_up, w_down, activation, op: str = "fused_mlp") -> None:
    for name, t, form in (("x", x, "(..., hidden)"), ("w_gate_up", w_gate_up, "(rows, hidden)"),
                          ("w_down", w_down, "(hidden, intermediate)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape {form}, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (x.dtype == w_gate_up.dtype == w_down.dtype):
        raise TypeError(f"x, w_gate_up, w_down must share one dtype, got {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}")
    if not (x.device == w_gate_up.device == w_down.device):
        raise ValueError(f"x, w_gate_up, w_down must be on one device, got {x.device}, {w_gate_up.device}, "
                         f"{w_down.device}")
    if not on_gpu(x.device) and not interpreting():
        raise ValueError(f"flashflow's {op} runs on CUDA tensors; got x on {x.device} "
                         "(or set TRITON_INTERPRET=1 to run Triton's CPU interpreter)")
    check_no_grad(op, x=x, w_gate_up=w_gate_up, w_down=w_down)
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


def _check_interpretable(*tensors: torch.Tensor) -> None:
    """Triton's interpreter computes ``tl.dot`` on bf16 operands wrongly (garbage, not rounding
    error); the op upcasts for it (:func:`_interpreter_dtype`), a direct launcher call is refused."""
    if interpreting() and any(t.dtype == torch.bfloat16 for t in tensors):
        raise TypeError("Triton's interpreter (TRITON_INTERPRET=1) computes tl.dot on bfloat16 operands wrongly: "
                        "call fused_mlp (it computes bfloat16 inputs in float32 there) or pass float16/float32")


def _interpreter_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute ``dtype`` inputs in: bf16 runs as fp32 under the
    interpreter (see :func:`_check_interpretable`), everything else as itself."""
    return torch.float32 if interpreting() and dtype == torch.bfloat16 else dtype


# --------------------------------------------------------------------------------------------
# launchers (validated inputs: x2 is (M, hidden) with unit last stride)
# --------------------------------------------------------------------------------------------


# the kernels' launches, keyed on their own arguments (no per-call binding by Triton)
_SPLITK = Launcher(mlp_splitk_kernel)
_SPLITK_GROUPED = Launcher(mlp_splitk_grouped_kernel)
_SPLITK_CAST = Launcher(mlp_splitk_cast_kernel)
_PERSISTENT = Launcher(mlp_persistent_kernel)


def launch_splitk(x2, w1, w2, activation, workspace=None, config: Optional[SplitKConfig] = None):
    """Decode regime (M ≤ 64): the split-K kernel adds fp32 partials into the workspace's
    accumulator; a second, tiny launch casts them to ``out`` and zeroes the accumulator.
    ``config`` None: :func:`splitk_config`.

    Why a second launch for the cast: the main grid's completion is what makes the sums
    complete (stream order, or under PDL the cast's ``griddepcontrol.wait``, which returns only
    then); a last-arriver cast in the main kernel returned partial sums on the H100 at M = 16.

    ``config.group`` ≥ 2 runs the grouped kernel (that many slices' partials summed on chip
    before the atomic adds); its group counters follow the accumulator in the workspace."""
    _check_interpretable(x2)
    m, hidden = x2.shape
    inter = w2.shape[1]
    if m > DECODE_MAX_M:
        raise ValueError(f"policy 'splitk' is the decode kernel (split-K), for M ≤ {DECODE_MAX_M} tokens; got M={m}")
    gated = activation == "swiglu"
    cfg = config or splitk_config(m, inter, gated, x2.device)
    out = torch.empty((m, hidden), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return out
    n_slices = cdiv(inter, cfg.BLOCK_I)
    grp_off = ACC_OFF + cdiv(m * hidden, 64) * 64
    n_groups = cdiv(n_slices, cfg.group) if cfg.group else 0
    if n_groups > GROUP_WORDS:
        raise ValueError(f"SplitKConfig group={cfg.group} with BLOCK_I={cfg.BLOCK_I} makes {n_groups} groups; "
                         f"at most {GROUP_WORDS}: take a larger group or BLOCK_I")
    buf = _buffer(workspace, grp_off + n_groups if cfg.group else ACC_OFF + m * hidden, x2.device)
    acc = buf[ACC_OFF:ACC_OFF + m * hidden].view(torch.float32).view(m, hidden)
    # programmatic dependent launch of the cast exists from sm90 on (the interpreter has no grids to chain)
    pdl = cfg.pdl and on_gpu(x2.device) and capability(x2.device)[0] >= 9
    common = dict(BLOCK_M=tuning.splitk_rows(m), BLOCK_I=cfg.BLOCK_I, BLOCK_K=cfg.BLOCK_K, BLOCK_N=cfg.BLOCK_N,
                  GATED=gated, ACTIVATION=ACTIVATION_CODE[activation], DOT_PRECISION=dot_precision(x2.dtype),
                  STAGGER=cfg.stagger, PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    spin = 0
    if cfg.group:
        spin = _spin_limit(x2.device)
        h = torch.empty((m, inter), dtype=w1.dtype, device=x2.device)
        chunk_n = tuning.chunk_n(hidden, cfg.group, cfg.BLOCK_N)
        n_chunks = cdiv(hidden, chunk_n)
        grid = tuning.grouped_programs(n_slices, num_sms(x2.device))
        launch_by_arguments(_SPLITK_GROUPED, (grid, 1, 1), (
            x2, w1, w2, acc, h, buf, m, hidden, inter, n_slices, n_groups, n_chunks, chunk_n, grp_off, spin,
            x2.stride(0), w1.stride(0), w2.stride(0)), dict(GROUP=cfg.group, THREADS=cfg.num_warps * 32, **common))
    else:
        launch_by_arguments(_SPLITK, (n_slices, 1, 1), (
            x2, w1, w2, acc, m, hidden, inter, x2.stride(0), w1.stride(0), w2.stride(0)), common)
    launch_by_arguments(_SPLITK_CAST, (cdiv(m * hidden, 1024), 1, 1), (acc, out, m, hidden, out.stride(0)),
                        dict(BLOCK=1024, num_warps=4, PDL=pdl, launch_pdl=pdl))
    _check_error(buf, spin)
    return out


def _tma_capable(device: torch.device) -> bool:
    if interpreting():
        return True   # the interpreter emulates descriptors (tests of the TMA path)
    return on_gpu(device) and capability(device)[0] >= 9


def _descriptors(x2, w1, w2, h, inter, gated, cfg):
    """Host TMA descriptors (x, gate rows, up rows, H, W_down), or None where the pointer path
    must run. The gate and up rows get a descriptor each, so a gate tile past ``inter`` is
    zero-filled instead of reading up rows."""
    if not (cfg.use_tma and x2.dtype in (torch.float16, torch.bfloat16) and _tma_capable(x2.device)):
        return None
    gate, up = (w1[:inter], w1[inter:]) if gated else (w1, w1)
    if not tma_compatible(x2, gate, up, w2, h):
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
    """Prefill regime: tile order ``policy`` (a name of :data:`flashflow.kernels.tile_order.ORDERS`)
    in groups of ``group_rows`` row-blocks. ``config`` None: :func:`persistent_config`.
    ``out`` (M, hidden) and ``h`` (M, inter), contiguous, may be given (the GPU checks pass
    NaN-filled ones, so a tile that is never written shows)."""
    _check_interpretable(x2)
    m, hidden = x2.shape
    inter = w2.shape[1]
    gated = activation == "swiglu"
    cfg = config or persistent_config(gated, x2.device, m, x2.dtype)
    if out is None:
        out = torch.empty((m, hidden), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return out
    tiles_m, n0, n1 = cdiv(m, cfg.BLOCK_M), cdiv(inter, cfg.BLOCK_N0), cdiv(hidden, cfg.BLOCK_N1)
    order = launch_order(policy, group_rows, tiles_m, n0, n1)
    buf = _buffer(workspace, sync_words(m, hidden, cfg), x2.device)
    if h is None:
        h = torch.empty((m, inter), dtype=x2.dtype, device=x2.device)
    part = torch.empty((m, hidden), dtype=torch.float32, device=x2.device) if order.split else out
    programs = max(1, min(num_programs or num_sms(x2.device), order.total))
    threads = cfg.num_warps * 32
    assert threads <= MAX_THREADS and cfg.BLOCK_N0 % cfg.BLOCK_K == 0
    descs = _descriptors(x2, w1, w2, h, inter, gated, cfg)
    use_tma = descs is not None
    spin = _spin_limit(x2.device)
    # host descriptors make no call key: those launches take Triton's path
    launch_by_arguments(_PERSISTENT, (programs, 1, 1), (
        x2, w1, w2, h, out, part, buf, *(descs or (None,) * 5), m, hidden, inter,
        x2.stride(0), w1.stride(0), w2.stride(0), h.stride(0), out.stride(0),
        tiles_m, n0, n1, order.group_rows, order.half, CNT_OFF + 2 * tiles_m, spin), dict(
        POLICY=order.code, BLOCK_M=cfg.BLOCK_M, BLOCK_N0=cfg.BLOCK_N0, BLOCK_N1=cfg.BLOCK_N1,
        BLOCK_K=cfg.BLOCK_K, GATED=gated, ACTIVATION=ACTIVATION_CODE[activation], THREADS=threads,
        DOT_PRECISION=dot_precision(x2.dtype), USE_TMA=use_tma, PROXY_FENCE=use_tma and on_gpu(x2.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    _check_error(buf, spin)
    return out


def launch_cublas(x2, w1, w2, activation):
    """The unfused FFN: ``F.linear``, the activation, ``F.linear`` (cuBLAS on a GPU), the
    reference's math in x's dtype. No host synchronisation: CUDA-graph and torch.compile safe."""
    f = torch.nn.functional
    h = f.linear(x2, w1)
    if activation == "swiglu":   # in place in the first GEMM's output: two allocations fewer
        inter = w2.shape[1]
        h = f.silu(h.narrow(-1, 0, inter), inplace=True).mul_(h.narrow(-1, inter, inter))
    elif activation == "gelu":
        h = f.gelu(h, approximate="tanh")
    elif activation == "silu":
        h = f.silu(h)
    else:
        h = f.relu(h)
    return f.linear(h, w2)


def _fused_mlp_impl(x2: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str,
                    policy: str, workspace: Optional[MlpWorkspace] = None, plan=None) -> torch.Tensor:
    """``plan``: ``(name, rows, dtype to compute in)`` as :func:`_plan` gives it for these inputs."""
    dtype = x2.dtype
    name, rows, run_as = plan or _plan(x2, w2, activation, policy)
    if run_as != dtype:
        x2, w1, w2 = x2.to(run_as), w1.to(run_as), w2.to(run_as)
    if name == "cublas":
        out = launch_cublas(x2, w1, w2, activation)
    elif name == "splitk":
        out = launch_splitk(x2, w1, w2, activation, workspace)
    else:
        out = launch_persistent(x2, w1, w2, activation, name, rows, workspace)
    return out if out.dtype == dtype else out.to(dtype)


def _plan(x2, w2, activation, policy) -> tuple[str, int, torch.dtype]:
    """What a call runs as: the plan and group rows ``policy`` resolves to for its M, and the
    dtype the kernels compute in."""
    name, rows = resolve_policy(policy, x2.shape[0], activation == "swiglu", w2.shape[1], x2.device)
    return name, rows, _interpreter_dtype(x2.dtype)


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
    """Transformer FFN, weights in ``nn.Linear`` layout.

    Args:
        x: ``(..., hidden)``, bf16/fp16 (fp32 accepted, computed in fp32).
        w_gate_up: ``"swiglu"``: ``cat([gate_proj.weight, up_proj.weight])``,
            ``(2·intermediate, hidden)``; otherwise fc1's weight ``(intermediate, hidden)``.
        w_down: ``(hidden, intermediate)``.
        activation: ``"swiglu"``, ``"gelu"`` (tanh approximation), ``"silu"`` or ``"relu"``.
        policy: ``"auto"`` (the fastest plan measured for this GPU family, FFN and M:
            flashflow/tuning/mlp.json); ``"splitk"`` (split-K kernel, M ≤ 64); ``"cublas"``
            (``F.linear``, activation, ``F.linear``); or a persistent-kernel tile order:
            ``"sequential"``, ``"rowblock"``, ``"multirow"`` / ``"multirow:R"``, ``"halfrow"``,
            ``"seqsplit"`` (``"sequential"`` and ``"seqsplit"`` also take ``:R``).
        workspace: an :class:`MlpWorkspace` (``max_tokens`` ≥ this call's tokens) to reuse
            across calls and CUDA-graph replays; None takes one kept per (device, stream) by
            flashflow (a fresh zeroed one while a CUDA graph is being captured).
    Returns:
        ``(..., hidden)`` in x's dtype. The intermediate is rounded to x's dtype, as the
        unfused FFN rounds it; accumulation is fp32. Under Triton's interpreter bf16 inputs
        are computed in fp32 (its bf16 ``tl.dot`` is wrong).
    """
    compiling = torch.compiler.is_compiling()
    key = None
    if workspace is None and not compiling and x.__class__ is torch.Tensor and w_gate_up.__class__ is torch.Tensor \
            and w_down.__class__ is torch.Tensor and activation.__class__ is str and policy.__class__ is str:
        # what the checks and the plan read (a decode step's FFN is a few µs of GPU work: the
        # generic call_key's alignment and meta flags, which no launch here needs, are left out)
        key = (x.shape, x.stride(), x.dtype, x.device, x.requires_grad, w_gate_up.shape, w_gate_up.stride(),
               w_gate_up.dtype, w_gate_up.device, w_gate_up.requires_grad, w_down.shape, w_down.stride(),
               w_down.dtype, w_down.device, w_down.requires_grad, activation, policy, torch.is_grad_enabled())
        run = _CALLS.get(key)
        if run is not None:   # these arguments' kinds passed the checks before: only the launch is left
            return run(x, w_gate_up, w_down)
    _check(x, w_gate_up, w_down, activation)
    m = x.numel() // x.shape[-1]
    name, _ = parse_policy(policy)
    if name == "splitk" and m > DECODE_MAX_M:
        raise ValueError(f"policy 'splitk' is the decode kernel (split-K), for at most {DECODE_MAX_M} tokens; "
                         f"x has {m} (use 'auto' or a persistent policy)")
    if workspace is not None:
        _buffer(workspace, 0, x.device)   # the type and device, before anything runs
        if workspace.hidden != x.shape[-1] or m > workspace.max_tokens:
            raise ValueError(f"workspace was made for hidden={workspace.hidden}, max_tokens={workspace.max_tokens}; "
                             f"this call has hidden={x.shape[-1]} and {m} tokens: make one with "
                             f"MlpWorkspace({x.shape[-1]}, max_tokens >= {m})")
    x2, w1, w2 = _rows(x), unit_last_stride(w_gate_up), unit_last_stride(w_down)
    if compiling:
        if workspace is not None:
            raise ValueError("workspace is not supported under torch.compile; pass None")
        out = _fused_mlp_op(x2, w1, w2, activation, policy)
    else:
        plan = _plan(x2, w2, activation, policy)
        if key is not None and len(_CALLS) < MAX_CALLS:
            _CALLS[key] = _call(plan, x, w_gate_up, w_down, activation, policy)
        out = _fused_mlp_impl(x2, w1, w2, activation, policy, workspace, plan)
    return out.reshape(x.shape)


_CALLS: dict = {}   # call key (shapes, strides, dtypes, device, activation, policy) -> its launch
MAX_CALLS = 4096


def _call(plan, x, w_gate_up, w_down, activation, policy):
    """``run(x, w_gate_up, w_down)`` for later calls of the key these arguments have: checked,
    resolved, only the launch left. A 2-D x of unit-stride rows through cuBLAS as SwiGLU, the
    decode step's shape, takes the shortest path (the three ops, nothing around them)."""
    name, _, run_as = plan
    direct = x.dim() == 2 and x.stride(-1) == 1 and w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1
    if name == "cublas" and activation == "swiglu" and direct and run_as == x.dtype:
        linear, silu_ = torch.nn.functional.linear, torch._C._nn.silu_   # what F.silu(inplace=True) calls

        def swiglu(x, w1, w2):
            gate, up = linear(x, w1).chunk(2, 1)   # one call for both halves (w1 has 2·inter rows)
            return linear(silu_(gate).mul_(up), w2)
        return swiglu

    def run(x, w1, w2):
        out = _fused_mlp_impl(_rows(x), unit_last_stride(w1), unit_last_stride(w2), activation, policy, None, plan)
        return out.reshape(x.shape)
    return run


# --------------------------------------------------------------------------------------------
# baselines (the bench's anchors; same tiles as the persistent kernel)
# --------------------------------------------------------------------------------------------


def _gemm_dims(x2, w2, cfg):
    m, hidden = x2.shape
    inter = w2.shape[1]
    return m, hidden, inter, cdiv(m, cfg.BLOCK_M), cdiv(inter, cfg.BLOCK_N0), cdiv(hidden, cfg.BLOCK_N1)


def _launch_gemm0(x2, w1, h, buf, activation, cfg, signal):
    m, hidden = x2.shape
    inter = h.shape[1]
    tiles_m, n0 = cdiv(m, cfg.BLOCK_M), cdiv(inter, cfg.BLOCK_N0)
    mlp_gemm0_kernel[(tiles_m * n0,)](
        x2, w1, h, buf, m, hidden, inter, x2.stride(0), w1.stride(0), h.stride(0),
        tiles_m, n0, DEFAULT_GROUP_ROWS, SIGNAL=signal,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N0=cfg.BLOCK_N0, BLOCK_K=cfg.BLOCK_K, GATED=activation == "swiglu",
        ACTIVATION=ACTIVATION_CODE[activation], THREADS=cfg.num_warps * 32,
        DOT_PRECISION=dot_precision(x2.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch_gemm1(h, w2, out, buf, cfg, n0, programs=None):
    m, inter = h.shape
    hidden = out.shape[1]
    tiles_m, n1 = cdiv(m, cfg.BLOCK_M), cdiv(hidden, cfg.BLOCK_N1)
    wait = programs is not None
    mlp_gemm1_kernel[(programs if wait else tiles_m * n1,)](
        h, w2, out, buf, m, hidden, inter, h.stride(0), w2.stride(0), out.stride(0),
        tiles_m, n0, n1, DEFAULT_GROUP_ROWS, _spin_limit(h.device), WAIT=wait,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N1=cfg.BLOCK_N1, BLOCK_K=cfg.BLOCK_K, THREADS=cfg.num_warps * 32,
        DOT_PRECISION=dot_precision(h.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _baseline_inputs(x, w_gate_up, w_down, activation, config, op):
    """Checked (M, hidden) rows and weights in the dtype the kernels compute in, and the config."""
    _check(x, w_gate_up, w_down, activation, op)
    run_as = _interpreter_dtype(x.dtype)
    x2, w1, w2 = _rows(x).to(run_as), unit_last_stride(w_gate_up).to(run_as), unit_last_stride(w_down).to(run_as)
    return x2, w1, w2, config or persistent_config(activation == "swiglu", x2.device, x2.shape[0], x2.dtype)


def mlp_two_kernels(x, w_gate_up, w_down, activation="swiglu", config: Optional[PersistentConfig] = None):
    """Baseline: GEMM0 + activation, then GEMM1, as two launches (H through device memory)."""
    x2, w1, w2, cfg = _baseline_inputs(x, w_gate_up, w_down, activation, config, "mlp_two_kernels")
    m, hidden, inter, _, _, _ = _gemm_dims(x2, w2, cfg)
    out = torch.empty((m, hidden), dtype=x2.dtype, device=x2.device)
    if m:
        h = torch.empty((m, inter), dtype=x2.dtype, device=x2.device)
        _launch_gemm0(x2, w1, h, x2, activation, cfg, signal=False)
        _launch_gemm1(h, w2, out, x2, cfg, 0)
    return out.to(x.dtype).reshape(x.shape)


def mlp_two_streams(x, w_gate_up, w_down, activation="swiglu", workspace=None,
                    config: Optional[PersistentConfig] = None, consumer_programs: Optional[int] = None):
    """Baseline, CuSync-style: the GEMM0 kernel (producer, one program per tile) on the current
    stream bumps per-row-block counters; the GEMM1 kernel (consumer, persistent, tickets in
    row-group order) runs concurrently on a side stream and waits on them per tile. The
    consumer gets at most SMs − 16 programs so the producer always has SMs to run on (no
    deadlock whatever the order in which the hardware starts the two kernels' programs)."""
    x2, w1, w2, cfg = _baseline_inputs(x, w_gate_up, w_down, activation, config, "mlp_two_streams")
    m, hidden, inter, tiles_m, n0, n1 = _gemm_dims(x2, w2, cfg)
    out = torch.empty((m, hidden), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return out.to(x.dtype).reshape(x.shape)
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
    return out.to(x.dtype).reshape(x.shape)
