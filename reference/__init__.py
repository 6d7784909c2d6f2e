"""The NumPy oracle: vLLM's fused MoE semantics, stage by stage.

    router logits -> select_experts -> moe_align_block_size -> grouped_gemm (w13)
        -> apply_activation -> grouped_gemm (w2, * router weight) -> moe_sum

Every other backend is judged against these functions; their names and arguments follow
vLLM (`vllm.model_executor.layers.fused_moe`). docs/stages.md is the contract.
This package imports nothing of the project: the oracle depends on nothing it judges.
"""

from .activation import (ACTIVATIONS, apply_activation, gelu_and_mul, gelu_tanh_and_mul,
                         silu_and_mul, swigluoai_and_mul)
from .expert_map import PLACEMENTS, determine_expert_map
from .experts import DEFAULT_BLOCK_SIZE, fused_experts, fused_moe, grouped_gemm, moe_sum
from .permute import (grouped_mm, max_num_tokens_padded, moe_align_block_size, moe_permute,
                      moe_unpermute)
from .precision import compute_dtype, exact
from .quant import (fused_experts_quant, grouped_gemm_quant, moe_kernel_quantize_input,
                    quantize_moe_layer)
from .routing import (SCORING_FUNCS, fused_topk, fused_topk_bias, grouped_topk,
                      llama4_custom_routing_function, select_experts, softmax, sigmoid,
                      topk_indices, zero_experts_compute)

__all__ = [
    "ACTIVATIONS", "DEFAULT_BLOCK_SIZE", "PLACEMENTS", "SCORING_FUNCS",
    "apply_activation", "compute_dtype", "determine_expert_map", "exact", "fused_experts",
    "fused_experts_quant", "fused_moe", "fused_topk", "fused_topk_bias", "gelu_and_mul", "gelu_tanh_and_mul",
    "grouped_gemm", "grouped_gemm_quant", "grouped_mm", "grouped_topk", "llama4_custom_routing_function",
    "max_num_tokens_padded", "moe_align_block_size", "moe_kernel_quantize_input", "moe_permute", "moe_sum", "moe_unpermute",
    "quantize_moe_layer", "select_experts", "sigmoid", "silu_and_mul", "softmax", "swigluoai_and_mul", "topk_indices",
    "zero_experts_compute",
]
