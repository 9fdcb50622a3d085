"""Slow, obviously-correct PyTorch versions of flashflow's operations: the test oracles."""
from flashflow.reference.attention import (
    attention_mask,
    attention_naive,
    attention_tiled,
    attention_varlen_naive,
)

__all__ = ["attention_mask", "attention_naive", "attention_tiled", "attention_varlen_naive"]
