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
}
