"""The NumPy oracle: vLLM's fused MoE semantics, stage by stage.

    router logits -> select_experts -> moe_align_block_size -> grouped_gemm (w13)
        -> apply_activation -> grouped_gemm (w2, * router weight) -> moe_sum

Every other backend is judged against these functions; their names and arguments follow
vLLM (`vllm.model_executor.layers.fused_moe`). docs/stages.md is the contract.

One file per stage, the same listing as every backend in cuda_kernels/:
    routing.py      select_experts, fused_topk, fused_topk_bias, grouped_topk (+ the
                    llama4 and zero-expert routers)
    align.py        moe_align_block_size, max_num_tokens_padded
    permute.py      moe_permute, moe_unpermute (the contiguous layout)
    gemm.py         grouped_gemm (and walk_expert_blocks, its block walk); grouped_mm
    activation.py   apply_activation, silu_and_mul, gelu_and_mul, gelu_tanh_and_mul,
                    swigluoai_and_mul
    combine.py      moe_sum (and slot_is_live, its rule for the slots routed nowhere)
    experts.py      fused_experts, fused_moe: the stages composed
    quant.py        the quantized GEMM and experts (fp8, int8, int4)
    expert_map.py   determine_expert_map (expert parallelism);  eplb.py: expert placement
    precision.py    compute_dtype, exact;  _checks.py: argument checks
This package imports nothing of the project: the oracle depends on nothing it judges.
"""

from .activation import (ACTIVATIONS, apply_activation, gelu_and_mul, gelu_tanh_and_mul,
                         silu_and_mul, swigluoai_and_mul)
from .align import max_num_tokens_padded, moe_align_block_size
from .combine import moe_sum
from .expert_map import PLACEMENTS, determine_expert_map
from .experts import DEFAULT_BLOCK_SIZE, fused_experts, fused_moe
from .gemm import grouped_gemm, grouped_mm
from .permute import moe_permute, moe_unpermute
from .precision import compute_dtype, exact
from .quant import (fused_experts_quant, grouped_gemm_quant, moe_kernel_quantize_input,
                    quantize_moe_layer)
from .routing import (BIAS_SCORING_FUNCS, SCORING_FUNCS, fused_topk, fused_topk_bias,
                      grouped_topk, llama4_custom_routing_function, select_experts, softmax,
                      sigmoid, topk_indices, zero_experts_compute)

__all__ = [
    "ACTIVATIONS", "BIAS_SCORING_FUNCS", "DEFAULT_BLOCK_SIZE", "PLACEMENTS", "SCORING_FUNCS",
    "apply_activation", "compute_dtype", "determine_expert_map", "exact", "fused_experts",
    "fused_experts_quant", "fused_moe", "fused_topk", "fused_topk_bias", "gelu_and_mul", "gelu_tanh_and_mul",
    "grouped_gemm", "grouped_gemm_quant", "grouped_mm", "grouped_topk", "llama4_custom_routing_function",
    "max_num_tokens_padded", "moe_align_block_size", "moe_kernel_quantize_input", "moe_permute", "moe_sum", "moe_unpermute",
    "quantize_moe_layer", "select_experts", "sigmoid", "silu_and_mul", "softmax", "swigluoai_and_mul", "topk_indices",
    "zero_experts_compute",
]
