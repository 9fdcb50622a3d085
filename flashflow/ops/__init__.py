from flashflow.ops.attention import flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "scaled_dot_product_attention"]
