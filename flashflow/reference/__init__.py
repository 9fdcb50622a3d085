"""Slow, obviously-correct PyTorch versions of flashflow's operations: the test oracles."""
from flashflow.reference.attention import (
    attention_mask,
    attention_naive,
    attention_tiled,
    attention_varlen_naive,
    full_key_padding_mask,
)
from flashflow.reference.attention_fp8 import (
    QuantizedQKV,
    attention_fp8_reference,
    quantize_qkv_reference,
    stress_qkv,
)

__all__ = ["attention_mask", "attention_naive", "attention_tiled", "attention_varlen_naive",
           "full_key_padding_mask", "QuantizedQKV", "attention_fp8_reference", "quantize_qkv_reference", "stress_qkv"]
