"""Launcher of the decode-regime FFN kernels (M ≤ 64 tokens), used by
:func:`flashflow.fused_mlp` for its ``"splitk"`` policy (see :mod:`flashflow.kernels.ffn`).

The main kernel adds fp32 partials into a zeroed workspace with atomics; a second tiny launch
casts and re-zeroes it. Reading the sums in the same launch (a last-arriver cast) returned
partial sums on the H100 at M = 16; the main grid's completion is what makes the sums complete
(stream order, or under PDL the cast's ``griddepcontrol.wait``, which returns only then).
"""
from __future__ import annotations

import functools

import torch

from flashflow.kernels.ffn import ffn_cast_kernel, ffn_decode_grouped_kernel, ffn_decode_kernel
from flashflow.kernels.mlp import CNT_OFF as SYNC_CNT_OFF
from flashflow.ops.attention import _cdiv, _next_pow2, _sm_count
from flashflow.device import offline_capability
from flashflow.device import num_sms as _device_num_sms
from flashflow.tuning import on_gpu as _on_gpu

_ACT_CODE = {"swiglu": 0, "silu": 0, "gelu": 1, "relu": 2}


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability; for CPU tensors standing for a GPU
    (flashflow.tuning.offline), that GPU's."""
    if device.type != "cuda" and offline_capability() is not None:
        return tuple(offline_capability())
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device)
    return _device_num_sms(device)


def decode_block_i(inter: int, num_sms: int) -> int:
    """Intermediate slice per program: about two programs per SM, all resident at once."""
    return max(16, min(128, _next_pow2(_cdiv(inter, 2 * num_sms))))


def wide_one_wave(m: int, inter: int, gated: bool, device: torch.device) -> bool:
    """Whether :func:`decode_config` runs a gated FFN at M > 32 with 128-wide slices in one wave
    (they fill between 3/4 and all of the SMs). Only then does split-K beat the persistent
    kernel above M = 32 (Llama-3-8B, M = 64: 156.3 µs against seqsplit's 170.7)."""
    if not _on_gpu(device) or not gated or m <= 32:
        return False
    sms = _num_sms(device)
    return decode_block_i(inter, sms) == 64 and 3 * sms <= 4 * _cdiv(inter, 128) <= 4 * sms


def decode_config(m: int, inter: int, gated: bool, device: torch.device) -> dict:
    """Tiles and launch options of the decode kernel. Swept on the H100 (scripts/tune_ffn.py,
    bench/results/tune-ffn-decode-*.json), CUDA-graph replays:

    * 64-wide slices, 128-wide K/N steps, 4 warps, 3 stages (two programs per SM) at M ≤ 32;
      slices of 128 (70B-class intermediates) take 64-wide steps to fit three stages;
    * ``stagger`` 2 (each program starts its K loop and its output loop at tile
      ``program id mod tiles``, so the programs do not all read the same x tile and add into the
      same output tile at once) for W1 tiles of at most 128 rows (64-wide gated slices):
      Llama-3-8B 122.73 / 123.87 / 132.50 µs at M = 1 / 4 / 16 with the cast's PDL, against
      123.95 / 125.86 / 133.33 without either. With 128-wide gated slices (256 rows, 64-wide
      steps) it cost 2.0–3.5 µs (Llama-3-70B), so those run unstaggered;
    * ``pdl``: the cast launch is a programmatic dependent launch (sm90+): its programs are
      resident before the main grid ends and start on its completion (Llama-3-70B 494.86 /
      504.26 µs at M = 1 / 16, against 495.75 / 505.85);
    * gated, M > 32 (BLOCK_M 64), 64-wide slices: a program then needs 147 KB of shared memory,
      one per SM, and 2·SM-count programs run in two waves. Where 128-wide slices fill between
      3/4 and all of the SMs in one wave, take them, 8 warps, 64-wide steps: half the programs,
      half the fp32 partials (Llama-3-8B M = 64: 156.33 µs against 199.65)."""
    on_gpu = _on_gpu(device)
    sms = _num_sms(device)
    block_i = decode_block_i(inter, sms)
    if wide_one_wave(m, inter, gated, device):
        return {"BLOCK_I": 128, "BLOCK_K": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "stagger": 2,
                "pdl": False, "group": 0}
    # weight tiles per stage: (2·)BLOCK_I × BLOCK_K of W1 and BLOCK_N × BLOCK_I of W2; wide
    # slices (70B-class intermediates) take narrower K/N steps to fit three stages in smem
    rows = block_i * (2 if gated else 1)
    block_kn = (128 if rows <= 128 else 64) if on_gpu else 32
    return {"BLOCK_I": block_i, "BLOCK_K": block_kn, "BLOCK_N": block_kn, "num_warps": 4,
            "num_stages": 3 if on_gpu else 1, "stagger": 2 if rows <= 128 or not on_gpu else 0, "pdl": on_gpu,
            "group": 0}


def group_counters(inter: int, block_i: int, group: int) -> int:
    """Counter words the grouped kernel needs: one per group of ``group`` slices."""
    return _cdiv(_cdiv(inter, block_i), group)


def launch_decode(x2, w1, w2, activation: str, ws: torch.Tensor, config=None, sync=None, grp_off=None,
                  spin_limit=0) -> torch.Tensor:
    """out = FFN(x2) for x2 ``(M, hidden)``, M ≤ 64; ``ws`` is a zeroed fp32 ``(M, hidden)``
    accumulator, left zeroed again. ``config`` overrides :func:`decode_config` entries.

    ``config["group"]`` ≥ 2 runs ``ffn_decode_grouped_kernel``: the partials of that many slices
    summed on chip before the atomic adds. It needs zeroed int32 counters, ``sync`` (the fixed
    words of :mod:`flashflow.kernels.mlp` at its start, the group counters from ``grp_off``;
    left zeroed): by default a fresh zeroed tensor (a memset per call). ``spin_limit`` > 0 bounds
    its waits (debug; :func:`flashflow.ops.mlp.launch_splitk` passes its bound and checks the
    error word; 0 = unbounded)."""
    m, hidden = x2.shape
    inter = w2.shape[1]
    out = torch.empty((m, hidden), dtype=x2.dtype, device=x2.device)
    if m == 0:
        return out
    cfg = decode_config(m, inter, activation == "swiglu", x2.device)
    cfg.update(config or {})
    group = int(cfg.get("group", 0))
    if group and (group < 2 or group & (group - 1)):
        raise ValueError(f"config['group'] must be 0 (off) or a power of two >= 2 (slices per group), got {group}")
    # programmatic dependent launch of the cast: sm90+ only (the interpreter has no grids to chain)
    sm90 = _on_gpu(x2.device) and _capability(x2.device)[0] >= 9
    pdl = bool(cfg["pdl"]) and sm90
    common = dict(BLOCK_M=max(16, _next_pow2(m)), BLOCK_I=cfg["BLOCK_I"], BLOCK_K=cfg["BLOCK_K"],
                  BLOCK_N=cfg["BLOCK_N"], GATED=activation == "swiglu", ACTIVATION=_ACT_CODE[activation],
                  DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", STAGGER=cfg["stagger"], PDL=pdl,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    n_slices = _cdiv(inter, cfg["BLOCK_I"])
    if group:
        n_groups = group_counters(inter, cfg["BLOCK_I"], group)
        if sync is None:
            sync, grp_off = torch.zeros(SYNC_CNT_OFF + n_groups, dtype=torch.int32, device=x2.device), SYNC_CNT_OFF
        elif grp_off is None or grp_off < SYNC_CNT_OFF or sync.dtype != torch.int32 \
                or sync.numel() < grp_off + n_groups:
            raise ValueError(f"sync must be a zeroed int32 tensor of at least grp_off + {n_groups} words with "
                             f"grp_off >= {SYNC_CNT_OFF}, got {sync.numel()} words, grp_off={grp_off}")
        h = torch.empty((m, inter), dtype=w1.dtype, device=x2.device)
        # about `group` GEMM1 items per group (as many items as slices), of whole BLOCK_N steps
        chunk_n = _cdiv(_cdiv(hidden, group), cfg["BLOCK_N"]) * cfg["BLOCK_N"]
        n_chunks = _cdiv(hidden, chunk_n)
        grid = min(n_slices, 2 * _num_sms(x2.device))
        ffn_decode_grouped_kernel[(grid,)](
            x2, w1, w2, ws, h, sync, m, hidden, inter, n_slices, n_groups, n_chunks, chunk_n, grp_off, int(spin_limit),
            x2.stride(0), w1.stride(0), w2.stride(0), GROUP=group, THREADS=cfg["num_warps"] * 32, **common)
    else:
        ffn_decode_kernel[(n_slices,)](
            x2, w1, w2, ws, m, hidden, inter, x2.stride(0), w1.stride(0), w2.stride(0), **common)
    ffn_cast_kernel[(_cdiv(m * hidden, 1024),)](ws, out, m, hidden, out.stride(0), BLOCK=1024, num_warps=4,
                                                 PDL=pdl, launch_pdl=pdl)
    return out
