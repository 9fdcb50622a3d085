"""Who runs a benchmark shape: flashflow and the anchors it is measured against.

A provider takes a shape and its input tensors and returns a zero-argument callable; the runner
times that callable. Every provider of a suite returns its output in the same layout, so the
runner can check ours against an anchor on the very inputs it timed.
"""
from __future__ import annotations

import torch


def attention_inputs(shape, dtype: torch.dtype, device, seed: int = 0):
    """q, k, v in FlashAttention layout ``(batch, seqlen, heads, head_dim)``."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(seqlen):
        return torch.randn(shape.batch, seqlen, shape.heads, shape.head_dim, generator=gen,
                           device=device, dtype=dtype)

    return rand(shape.seqlen_q), rand(shape.seqlen_k), rand(shape.seqlen_k)


def flashflow_attention(shape, q, k, v):
    import flashflow  # imported late: the kernels bind to the interpreter or the GPU at import

    return lambda: flashflow.flash_attn_func(q, k, v, causal=shape.causal)


FP8_DTYPES = (torch.bfloat16, torch.float16)


def flashflow_fp8_attention(shape, q, k, v):
    """:func:`flashflow.ops.attention_fp8.flash_attn_fp8_func`: the quantize pass and the 8-bit
    forward, both inside the timed call. Shapes it has no kernel for raise here, and the runner
    records the error as that provider's entry (as for any provider's unsupported case); a GPU
    older than Hopper gets the op's own error at the first call."""
    from flashflow.ops.attention_fp8 import FP8_HEAD_DIMS, flash_attn_fp8_func

    if q.dtype not in FP8_DTYPES:
        raise ValueError(f"flashflow-fp8 takes bf16 or fp16 inputs, got {q.dtype}")
    if shape.head_dim not in FP8_HEAD_DIMS:
        raise ValueError(f"flashflow-fp8 takes head_dim {', '.join(map(str, FP8_HEAD_DIMS))}, got {shape.head_dim}")
    return lambda: flash_attn_fp8_func(q, k, v, causal=shape.causal)


def _sdpa(backend_name: str):
    def make(shape, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        # SDPA's layout is (b, h, s, d): the transposes are views of the same memory flashflow
        # reads. Its causal mask is top-left aligned, flashflow's bottom-right; the suites only
        # time sq == sk, where the two agree.
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run():
            with sdpa_kernel(backend):
                return sdpa(qt, kt, vt, is_causal=shape.causal).transpose(1, 2)

        return run

    return make


ATTENTION_PROVIDERS = {
    "flashflow": flashflow_attention,
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    "flashflow-fp8": flashflow_fp8_attention,
}
# flashflow's other attention: timed against the anchors like "flashflow", and not one of them
ATTENTION_VARIANTS = ("flashflow-fp8",)


# --------------------------------------------------------------------------------------------
# accuracy against exact attention
# --------------------------------------------------------------------------------------------

# scores of one chunk of query rows, all heads, in float64: the reference's working memory
REFERENCE_CHUNK_BYTES = 256 * 2**20


def exact_attention(shape, q, k, v, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """softmax(q·kᵀ/√d)·v in ``dtype`` on q's device, FlashAttention layout, causal aligned
    bottom-right; query rows in chunks so the scores never take more than
    :data:`REFERENCE_CHUNK_BYTES` (a 16k-token sequence fits beside the suite's inputs)."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    scale = head_dim ** -0.5
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    per_row = heads * max(seqlen_k, 1) * torch.finfo(dtype).bits // 8
    rows = max(1, min(seqlen_q, REFERENCE_CHUNK_BYTES // per_row))
    keys = torch.arange(seqlen_k, device=q.device)
    for b in range(batch):
        kb = k[b].to(dtype).repeat_interleave(heads // kv_heads, dim=1)   # (sk, h, d)
        vb = v[b].to(dtype).repeat_interleave(heads // kv_heads, dim=1)
        for start in range(0, seqlen_q, rows):
            qb = q[b, start:start + rows].to(dtype)
            scores = torch.einsum("qhd,khd->hqk", qb, kb) * scale
            if shape.causal:
                last = torch.arange(start, start + qb.shape[0], device=q.device) + (seqlen_k - seqlen_q)
                scores.masked_fill_(keys[None, None, :] > last[None, :, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)   # a row with no key gives 0
            out[b, start:start + rows] = torch.einsum("hqk,khd->qhd", probs, vb)
            del scores, probs
    return out


def accuracy(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Cosine similarity and relative L1 error (Σ|out − ref| / Σ|ref|) of ``out`` against
    ``ref``, in float64."""
    from flashflow.reference.metrics import cosine, rel_l1

    return {"cosine": cosine(out, ref), "rel_l1": rel_l1(out, ref)}


def sdpa_anchor(qt, kt, vt, causal, gqa=False, mask=None):
    """SDPA on cuDNN (where cuDNN refuses the shape, FlashAttention's backend, or the
    memory-efficient one for a ``mask``, which FlashAttention's does not take); output in
    FlashAttention's (b, s, h, d) layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    second = SDPBackend.FLASH_ATTENTION if mask is None else SDPBackend.EFFICIENT_ATTENTION
    for backend in (SDPBackend.CUDNN_ATTENTION, second):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, attn_mask=mask, is_causal=causal, enable_gqa=gqa).transpose(1, 2)
        try:
            run()
        except RuntimeError:
            continue
        run.backend = "sdpa-" + backend.name.split("_")[0].lower()
        return run
    raise RuntimeError(f"neither cuDNN nor {second.name} SDPA runs this shape")
