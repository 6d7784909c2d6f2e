"""vLLM's modular kernel interface (vllm/model_executor/layers/fused_moe/modular_kernel.py):
the two abstract halves, the small types they exchange, and the kernel that composes them.

    T tokens here, M rows the experts see (T, or the rows a dispatch brought), K top-k,
    H hidden (vLLM's K), N = w1's rows (2I gated, I no-mul; vLLM's N), E experts

    FusedMoEPrepareAndFinalizeModular   prepare (quantize + dispatch), finalize (combine)
    FusedMoEExpertsModular              workspace_shapes, apply (permute, experts, unpermute)
    TopKWeightAndReduce                 who weights and sums the K slots (weight_and_reduce.py)
    FusedMoEKernel(prepare_finalize, fused_experts).apply(...)   -> [T, H]
    FusedMoEActivationFormat, ExpertTokensMetadata, split_activation
    FusedMoEQuantConfig                 the layer's one config (sandbox/quant.py): the experts
                                        here take it unquantized, with biases
"""

from __future__ import annotations

import dataclasses
import enum
import math
from abc import ABC, abstractmethod

import numpy as np

from .. import arrays
from ..quant import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEQuantConfig
from .caller_arrays import empty_in_library_of


class FusedMoEActivationFormat(enum.Enum):
    """How prepare hands the tokens to the experts: Standard [M, H] with topk ids and
    weights [M, K], or BatchedExperts [E, max_tokens, H] (not implemented here)."""

    Standard = ("standard",)
    BatchedExperts = ("batched_experts",)


@dataclasses.dataclass
class ExpertTokensMetadata:
    """Rows each local expert receives (a dispatch that knows them says so)."""

    expert_num_tokens: object             # int32 [E_local], the experts' library
    expert_num_tokens_cpu: object = None  # int32 [E_local] NumPy, or None

    @staticmethod
    def make_from_list(expert_num_tokens_list, device=None) -> ExpertTokensMetadata:
        host = np.asarray(list(expert_num_tokens_list), dtype=np.int32)
        return ExpertTokensMetadata(host if device is None else device(host), host)


def split_activation(activation):
    """vLLM's activation name -> (our activation, is_act_and_mul): "relu2_no_mul" ->
    ("relu2", False), "silu" -> ("silu", True)."""
    name = getattr(activation, "value", activation)   # an enum of vLLM's passes its value
    if not isinstance(name, str):
        raise TypeError(f"activation: expected a name like 'silu' or 'relu2_no_mul', "
                        f"got {activation!r}")
    if name.endswith("_no_mul"):
        return name[: -len("_no_mul")], False
    return name, True


class TopKWeightAndReduce(ABC):
    """Apply the router weights to the experts' output and/or sum the K slots."""

    @abstractmethod
    def apply(self, output, fused_expert_output, topk_weights, topk_ids,
              apply_router_weight_on_input):
        """-> [M, H] (into `output` when given)."""

    def __eq__(self, other):
        return type(self) is type(other)

    def __hash__(self):
        return hash(type(self))


class FusedMoEPrepareAndFinalizeModular(ABC):
    """[Quantize + dispatch] before the experts, [combine] after them."""

    def post_init_setup(self, fused_experts):
        """Settings that depend on the experts (none here)."""

    @property
    @abstractmethod
    def activation_format(self) -> FusedMoEActivationFormat:
        ...

    @abstractmethod
    def topk_indices_dtype(self):
        """The topk_ids dtype the dispatch needs, or None."""

    @abstractmethod
    def max_num_tokens_per_rank(self):
        """The batch a batched dispatch takes, or None."""

    @abstractmethod
    def num_dispatchers(self) -> int:
        ...

    @abstractmethod
    def output_is_reduced(self) -> bool:
        """Whether finalize's output is summed over the ranks already."""

    def supports_async(self) -> bool:
        return False

    @property
    def requires_expert_map(self) -> bool:
        """Whether the experts must honour an expert map (experts of other ranks reach
        them): the dispatching ones. Not in vLLM's interface (its layer checks it)."""
        return False

    @abstractmethod
    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config=None, defer_input_quant=False):
        """-> (a1q [M, H], a1q_scale, expert_tokens_meta, topk_ids [M, K] or None,
        topk_weights [M, K] or None); None ids / weights: the caller's stand."""

    @abstractmethod
    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce_impl):
        """Write out [T, H] into `output`."""


class FusedMoEExpertsModular(ABC):
    """[Permute, experts, unpermute]: the two grouped GEMMs and the activation on the rows
    prepare handed over."""

    def __init__(self, quant_config: FusedMoEQuantConfig | None = None):
        if quant_config is not None and quant_config.is_quantized:
            raise NotImplementedError(
                f"quant_config: the modular experts here take unquantized experts (with "
                f"biases), got {quant_config.describe()} (the quantized layer: "
                f"FusedMoE(quant_config=...))")
        self.quant_config = FUSED_MOE_UNQUANTIZED_CONFIG if quant_config is None \
            else quant_config

    @staticmethod
    def is_monolithic() -> bool:
        return False

    @staticmethod
    def activation_format() -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.Standard

    @property
    def expects_unquantized_inputs(self) -> bool:
        return False

    @property
    def a2_scale(self):
        return self.quant_config.a2_scale

    @staticmethod
    def _supports_activation(activation) -> bool:
        from reference import ACTIVATIONS

        try:
            name, _ = split_activation(activation)
        except TypeError:
            return False
        return name in ACTIVATIONS

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return True

    @abstractmethod
    def supports_expert_map(self) -> bool:
        ...

    def supports_chunking(self) -> bool:
        return False

    @abstractmethod
    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce:
        ...

    def workspace_dtype(self, act_dtype):
        return act_dtype

    @staticmethod
    def adjust_N_for_activation(N: int, activation) -> int:
        """The activation's output width: N // 2 for the gated ones, N for *_no_mul."""
        return N // 2 if split_activation(activation)[1] else N

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        """-> (E local, M, N, K hidden, topk), read off the arrays."""
        if len(w1.shape) != 3 or len(w2.shape) != 3:
            raise ValueError(f"w1, w2: expected [E, N, H] and [E, H, I], got shapes "
                             f"{tuple(w1.shape)}, {tuple(w2.shape)}")
        E, N, _ = w1.shape
        if len(a1.shape) != 2 or len(topk_ids.shape) != 2 or topk_ids.shape[0] != a1.shape[0]:
            raise ValueError(f"hidden_states, topk_ids: expected [M, H] and [M, K], got "
                             f"shapes {tuple(a1.shape)}, {tuple(topk_ids.shape)}")
        return int(E), int(a1.shape[0]), int(N), int(a1.shape[1]), int(topk_ids.shape[1])

    @abstractmethod
    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        """-> (workspace13 shape, workspace2 shape, output shape)."""

    @abstractmethod
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        """Write the experts' output into `output` (workspace_shapes' output shape)."""


class FusedMoEKernel:
    """A prepare/finalize and an experts object composed into vLLM's fused-MoE call:

        a1q, _, meta, ids, w = prepare(hidden_states, topk_weights, topk_ids, E_global,
                                       expert_map, apply_router_weight_on_input)
        workspace13, workspace2, fused_out <- experts.workspace_shapes(...)  (fused_out
                                              shares workspace13's memory, as in vLLM)
        experts.apply(fused_out, a1q, w1, w2, w, ids, activation, ...)
        finalize(output, fused_out, w, ids, apply_router_weight_on_input,
                 experts.finalize_weight_and_reduce_impl())
    """

    def __init__(self, prepare_finalize, fused_experts):
        if not isinstance(prepare_finalize, FusedMoEPrepareAndFinalizeModular) or \
                not isinstance(fused_experts, FusedMoEExpertsModular):
            raise ValueError("prepare_finalize and fused_experts: expected a "
                             "FusedMoEPrepareAndFinalizeModular and a FusedMoEExpertsModular, "
                             f"got {type(prepare_finalize).__name__} and "
                             f"{type(fused_experts).__name__}")
        if prepare_finalize.activation_format != fused_experts.activation_format():
            raise ValueError(f"activation formats differ: {type(prepare_finalize).__name__} "
                             f"hands over {prepare_finalize.activation_format.name}, "
                             f"{type(fused_experts).__name__} takes "
                             f"{fused_experts.activation_format().name}")
        if prepare_finalize.requires_expert_map and not fused_experts.supports_expert_map():
            raise ValueError(f"{type(fused_experts).__name__} does not support an expert map, "
                             f"which {type(prepare_finalize).__name__} needs")
        self.prepare_finalize = prepare_finalize
        self.fused_experts = fused_experts
        prepare_finalize.post_init_setup(fused_experts)

    def output_is_reduced(self) -> bool:
        return self.prepare_finalize.output_is_reduced()

    def _allocate(self, like, M, N, K, topk, global_num_experts, local_num_experts, meta,
                  activation):
        ex = self.fused_experts
        dtype = ex.workspace_dtype(arrays.dtype_of(like))
        if arrays.kind(like) == "torch":
            dtype = arrays.torch_dtype(dtype)
        ws13, ws2, out = ex.workspace_shapes(M, N, K, topk, global_num_experts,
                                             local_num_experts, meta, activation)
        # cache1 is dead by the time the output is written: one buffer for both (vLLM's)
        common = empty_in_library_of(like, (max(math.prod(ws13), math.prod(out)),), dtype)
        workspace13 = common[:math.prod(ws13)].reshape(ws13)
        fused_out = common[:math.prod(out)].reshape(out)
        workspace2 = empty_in_library_of(like, ws2, dtype)
        return workspace13, workspace2, fused_out

    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
              global_num_experts=-1, expert_map=None, apply_router_weight_on_input=False):
        """out [T, H] of the experts for hidden_states [T, H] routed to topk_ids [T, K]
        (global ids; -1: routed nowhere) with topk_weights [T, K]. w1 [E_l, N, H] and w2
        [E_l, H, I] hold this rank's experts; expert_map [E_global] global -> local or -1."""
        pf, ex = self.prepare_finalize, self.fused_experts
        if expert_map is not None and not ex.supports_expert_map():
            raise ValueError(f"expert_map: {type(ex).__name__} does not support one")
        output = empty_in_library_of(hidden_states, tuple(hidden_states.shape))
        local_num_experts = w1.shape[0]
        if global_num_experts == -1:
            global_num_experts = local_num_experts
        a1q, a1q_scale, meta, ids, weights = pf.prepare(
            hidden_states, topk_weights, topk_ids, global_num_experts, expert_map,
            apply_router_weight_on_input, ex.quant_config,
            defer_input_quant=ex.expects_unquantized_inputs)
        ids = topk_ids if ids is None else ids
        weights = topk_weights if weights is None else weights
        _, M, N, K, topk = ex.moe_problem_size(a1q, w1, w2, ids)
        if M == 0:   # no rows reached this rank: nothing to compute, the combine still runs
            shape = ex.workspace_shapes(0, N, K, topk, global_num_experts, local_num_experts,
                                        meta, activation)[2]
            fused_out = empty_in_library_of(a1q, shape)
        else:
            workspace13, workspace2, fused_out = self._allocate(
                a1q, M, N, K, topk, global_num_experts, local_num_experts, meta, activation)
            ex.apply(fused_out, a1q, w1, w2, weights, ids, activation, global_num_experts,
                     expert_map, a1q_scale, ex.a2_scale, workspace13, workspace2, meta,
                     apply_router_weight_on_input)
        pf.finalize(output, fused_out, weights, ids, apply_router_weight_on_input,
                    ex.finalize_weight_and_reduce_impl())
        return output
