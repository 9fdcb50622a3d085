"""flashflow: Triton kernels for transformer inference that move as few bytes as the hardware allows."""
from flashflow.ops.attention import flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention
from flashflow.ops.attention_fp8 import flash_attn_fp8_func, scaled_dot_product_attention_fp8
from flashflow.ops.decode import (DecodePlan, flash_attn_with_kvcache, merge_attention_states, plan_decode,
                                 quantize_kv_cache)
from flashflow.ops.decode_layer import (DecodeLayerPlan, LayerConfig, LayerWeights, decode_layer, decode_step,
                                       fold_norms, random_layer_weights)
from flashflow.ops.mlp import MlpWorkspace, fused_mlp

__version__ = "0.1.0"
__all__ = [
    "flash_attn_func", "flash_attn_varlen_func", "scaled_dot_product_attention",
    "flash_attn_fp8_func", "scaled_dot_product_attention_fp8",
    "flash_attn_with_kvcache", "merge_attention_states", "plan_decode", "DecodePlan", "quantize_kv_cache", "fused_mlp", "MlpWorkspace",
    "DecodeLayerPlan", "LayerConfig", "LayerWeights", "decode_layer", "decode_step", "fold_norms",
    "random_layer_weights",
    "__version__",
]
