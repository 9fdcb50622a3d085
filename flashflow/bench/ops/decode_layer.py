"""The decode-layer megakernel as the benchmarks see it: ``flashflow info`` launches a
Llama-3-8B-sized layer at batch 1 and 16 on a contiguous cache, at batch 1 on 64-token pages and
at batch 1 with folded norm weights;
``flashflow bench --suite decode-layer`` times it against the same layer from separate kernels
and torch. Its config table is not tuned by ``flashflow tune`` (no axes)."""
from __future__ import annotations

from flashflow.bench.spec import InfoCase, OpSpec
from flashflow.tuning.decode_layer import DecodeLayerConfig

SEQLEN = 4096
PAGE_SIZE = 64


def _launch(device: str, batch: int, page: int | None, folded: bool = False) -> None:
    import torch

    from flashflow.ops.decode_layer import LLAMA3_8B, DecodeLayerPlan, LayerWeights

    c = LLAMA3_8B
    bf16 = dict(device=device, dtype=torch.bfloat16)
    shapes = LayerWeights(*(None,) * 6).shapes(c)
    w = LayerWeights(**{k: None if folded and k.endswith("norm") else torch.zeros(s, **bf16)
                        for k, s in shapes.items()})
    if page:
        blocks = batch * SEQLEN // page
        kc = torch.zeros(blocks, page, c.kv_heads, c.head_dim, **bf16)
        table = torch.arange(blocks, device=device, dtype=torch.int32).view(batch, -1)
    else:
        kc, table = torch.zeros(batch, SEQLEN, c.kv_heads, c.head_dim, **bf16), None
    lens = torch.full((batch,), SEQLEN - 1, dtype=torch.int32, device=device)
    plan = DecodeLayerPlan(c, batch, SEQLEN, device=device, dtype=torch.bfloat16, page_size=page,
                           folded_norms=folded)
    plan.run(torch.zeros(batch, c.hidden, **bf16), w, kc, kc.clone(), lens, table)


def info_cases(family: str | None = None) -> list[InfoCase]:
    """Llama-3-8B's layer (GQA 32/8, d 128, intermediate 14336), 4k cache: batch 1 and 16
    contiguous, batch 1 paged, batch 1 with folded norms."""
    return [InfoCase("decode-layer", f"llama3-8b b{b} s{SEQLEN}" + (f" paged {p}" if p else "")
                     + (" folded" if f else ""),
                     lambda device, b=b, p=p, f=f: _launch(device, b, p, f))
            for b, p, f in ((1, None, False), (16, None, False), (1, PAGE_SIZE, False), (1, None, True))]


SPEC = OpSpec(
    name="decode-layer",
    info_title="a decoder layer's decode step in one launch (bf16, Llama-3-8B sizes)",
    info_cases=info_cases,
    suite="decode-layer",
    config_classes=(DecodeLayerConfig,),
)
