"""Attention across several GPUs (or CPU processes under gloo): sequence parallelism over a
``torch.distributed`` group. :func:`ulysses_attention` (all-to-all to head slices),
:func:`ring_attention` (K/V round a ring, contiguous or zigzag layout), and the helpers that cut a
sequence into the ranks' slices and put it back together."""
from flashflow.distributed.attention import (ATTENTION_MODES, LAYOUTS, context_attention, gather_sequence,
                                             ring_attention, shard_sequence, ulysses_attention)

__all__ = ["ulysses_attention", "ring_attention", "context_attention", "shard_sequence", "gather_sequence",
           "ATTENTION_MODES", "LAYOUTS"]
