"""vLLM's modular fused-MoE kernel interface, mirrored: prepare/finalize objects, experts
objects, and the kernel that composes them, with vLLM's current names and arguments.

    T tokens here, M rows the experts see (T, or the rows a dispatch brought), K top-k,
    H hidden (vLLM's K), N = w1's rows (2I gated, I no-mul; vLLM's N), E experts (local:
    w1.shape[0]; global: global_num_experts), W ranks

vLLM splits a fused MoE into [router] -> [quantize + dispatch] -> [permute, experts,
unpermute] -> [combine] (vllm/model_executor/layers/fused_moe/modular_kernel.py):

    FusedMoEPrepareAndFinalizeModular   prepare(a1, topk_weights, topk_ids, num_experts,
                                        expert_map, apply_router_weight_on_input,
                                        quant_config, defer_input_quant)
                                          -> (a1q, a1q_scale, expert_tokens_meta,
                                              topk_ids or None, topk_weights or None)
                                        finalize(output, fused_expert_output, topk_weights,
                                                 topk_ids, apply_router_weight_on_input,
                                                 weight_and_reduce_impl)   (output in place)
    FusedMoEExpertsModular              workspace_shapes(M, N, K, topk, global_num_experts,
                                                         local_num_experts,
                                                         expert_tokens_meta, activation)
                                          -> (workspace13, workspace2, output) shapes
                                        apply(output, hidden_states, w1, w2, topk_weights,
                                              topk_ids, activation, global_num_experts,
                                              expert_map, a1q_scale, a2_scale, workspace13,
                                              workspace2, expert_tokens_meta,
                                              apply_router_weight_on_input) (output in place)
                                        supports_expert_map(),
                                        finalize_weight_and_reduce_impl()
    TopKWeightAndReduce{Delegate, NoOP, Contiguous}   who applies the router weights and
                                        sums the K slots: the experts say, finalize obeys
    FusedMoEKernel                      apply(hidden_states, w1, w2, topk_weights, topk_ids,
                                              activation, global_num_experts, expert_map,
                                              apply_router_weight_on_input) -> [T, H]

Implementations (prepare_finalize.py, experts.py):
    MoEPrepareAndFinalizeNoDPEPModular (one device), MoEPrepareAndFinalizeNaiveDPEPModular
    (vLLM's naive DP/EP over sandbox/ep), AllToAllPrepareAndFinalize (our all-to-all-v
    "token rows" exchange); ReferenceExperts, TorchExperts, NumbaExperts, CupyExperts (a
    backend's stages, reduce=True or False; EXPERTS[name])

What is not mirrored: quantization (our quant_config carries the biases only; quantized
experts live in reference/quant.py and cuda_kernels/cupy/quant_*), the batched activation
format (FusedMoEActivationFormat.BatchedExperts; no experts of ours take it), the
monolithic variants, async prepare/finalize, chunking, shared-expert overlap, LoRA, and
vLLM's FusedMoEConfig (our experts need none of it). docs/stages.md ("The modular kernel
interface") shows how one of these experts classes becomes a vLLM one.

Arrays: the kernel allocates its output and workspaces with hidden_states' library (NumPy,
torch or CuPy); an experts object moves what it is given to its backend
(Backend.take) and writes `output` in place in the caller's library, so any
prepare/finalize pairs with any experts on one machine.

The modules (this face hands their names on):
    interface.py          the abstract halves, the small types, FusedMoEKernel
    weight_and_reduce.py  TopKWeightAndReduce{Delegate, NoOP, Contiguous}
    prepare_finalize.py   the prepare/finalize objects
    experts.py            StageExperts and one experts class per backend
    caller_arrays.py      arrays in the caller's library (in_library_of, assign, ...)
"""

from .experts import (EXPERTS, CupyExperts, NumbaExperts, ReferenceExperts, StageExperts,
                      TorchExperts)
from .interface import (FUSED_MOE_UNQUANTIZED_CONFIG, ExpertTokensMetadata,
                        FusedMoEActivationFormat, FusedMoEExpertsModular, FusedMoEKernel,
                        FusedMoEPrepareAndFinalizeModular, FusedMoEQuantConfig,
                        TopKWeightAndReduce, split_activation)
from .prepare_finalize import (AllToAllPrepareAndFinalize,
                               MoEPrepareAndFinalizeNaiveDPEPModular,
                               MoEPrepareAndFinalizeNoDPEPModular)
from .weight_and_reduce import (TopKWeightAndReduceContiguous, TopKWeightAndReduceDelegate,
                                TopKWeightAndReduceNoOP)

__all__ = [
    "FusedMoEActivationFormat", "ExpertTokensMetadata", "FusedMoEQuantConfig",
    "FUSED_MOE_UNQUANTIZED_CONFIG", "TopKWeightAndReduce", "TopKWeightAndReduceDelegate",
    "TopKWeightAndReduceNoOP", "TopKWeightAndReduceContiguous",
    "FusedMoEPrepareAndFinalizeModular", "FusedMoEExpertsModular", "FusedMoEKernel",
    "MoEPrepareAndFinalizeNoDPEPModular", "MoEPrepareAndFinalizeNaiveDPEPModular",
    "AllToAllPrepareAndFinalize", "StageExperts", "ReferenceExperts", "TorchExperts",
    "NumbaExperts", "CupyExperts", "EXPERTS", "split_activation",
]
