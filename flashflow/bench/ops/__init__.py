"""One module per op, each declaring its :class:`~flashflow.bench.spec.OpSpec` once: ``SPEC``.

:data:`SPECS` lists them in declaration order; ``flashflow info`` reports them in this order and
``flashflow tune`` takes the names of the tunable ones. A new op adds its module here.
"""
from __future__ import annotations

from flashflow.bench.ops import (attention, attention_bwd, attention_fp8, attention_gluon, decode, decode_layer,
                                 fp8_linear, mlp, norm, quant)
from flashflow.bench.spec import OpSpec

SPECS: tuple[OpSpec, ...] = tuple(m.SPEC for m in (attention, attention_gluon, attention_bwd, attention_fp8, decode,
                                                     mlp, norm, quant, fp8_linear, decode_layer))
BY_NAME: dict[str, OpSpec] = {s.name: s for s in SPECS}
TUNABLE: dict[str, OpSpec] = {s.name: s for s in SPECS if s.tunable}


def spec(name: str) -> OpSpec:
    """The spec named ``name``; ValueError listing the names there are."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"no op {name!r}; the ops are {', '.join(BY_NAME)}") from None
