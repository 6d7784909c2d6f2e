"""`FusedMoE`: one MoE layer whose six stages can each run on a different backend.

    FusedMoE = the weights (sandbox/weights.py: parameters, weight_loader / load_weights,
               expert maps) + the router's settings + a stage mapping, run by the
               pipeline (sandbox/pipeline.py)

    T = tokens, E = global (real) experts, Z = zero experts, E_local = experts on this EP
    rank, K = top-k, H = hidden, I = intermediate size, I_p = I / tp_size, B = block size,
    P = T*K slots

The layer computes, for every token t (modelled on vLLM's FusedMoE, NumPy parameters):

    topk_weights, topk_ids = route(router_logits[t])                          # [T, K]
    out[t] = sum_k topk_weights[t, k] * (W2[e] @ act(W13[e] @ x[t] + b13[e]) + b2[e])
                                                                 (e = topk_ids[t, k])
             + zero_expert_result[t]              (zero experts: "identity" slots add w * x[t])
             + W2s @ act(W13s @ x[t])             (shared experts, every token)

as six stages, each through the backend the mapping assigns (`backend="torch"`, or
`{"route": "numba", "gemm1": "cupy"}`; stages left out use "reference"; the constructor's
argument, or `layer.backend = ...` at any time):

    route       select_experts          logits [T, E+Z] -> topk_weights f32, topk_ids [T, K]
    align       moe_align_block_size    topk_ids -> sorted_token_ids, expert_ids, num_post_padded
    gemm1       grouped_gemm            x [T, H] @ w13[e].T                    -> cache1 [P, 2I_p]
    activation  apply_activation        cache1                                -> cache2 [P, I_p]
    gemm2       grouped_gemm            cache2 @ w2[e].T (* router weight)     -> cache3 [P, H]
    combine     moe_sum                 cache3 [T, K, H] summed over K         -> out [T, H]
                                        (live slots only: not id -1, not off this rank)

Arrays move between backends only when the backend changes: each stage's backend takes
its arguments by their own kind (registry.Backend.take: zero copy between GPU libraries,
through the host only when a host backend follows). The shared experts run through the
gemm1/activation/gemm2 backends as one expert that every token visits with weight 1.

Parallelism (each rank holds a layer; the caller sums the ranks' outputs, i.e. all-reduces):
    tp_size > 1   w13 rows and w2 columns are this rank's slice of I; forward returns the
                  rank's partial sum. The down-projection bias and the zero-expert result
                  are added on tp_rank 0 only, so the sum over ranks counts them once.
    ep_size > 1   this rank holds E_local experts (expert_map: global -> local or -1);
                  forward returns the local experts' share. Zero-expert and shared-expert
                  outputs are added on ep_rank 0 only.

Block size: the alignment block B (= the GEMM's BLOCK_M) is the layer's `block_size` when
set, else the GEMM backend's `get_config(M, N, K, E, top_k, dtype)["BLOCK_M"]` when it has
one (cuda_kernels.cupy.gemm), else 64 (4 in the CUDA simulator); align and both
GEMMs get the same B.

Weights (sandbox/weights.py): w13 holds gate (checkpoint "w1") and up ("w3") one after the
other, except for swigluoai (gpt-oss), whose activation reads them interleaved (gate rows
0::2, up 1::2). Zero experts take router columns E..E+Z-1 (router_logits is [T, E+Z]).
Parameters are allocated filled with NaN: an expert that was never loaded makes the output
NaN instead of silently zero.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np

from . import arrays, checkpoint, pipeline
from .registry import resolve_stage_mapping
from .streams import caller_stream
from .weights import MoEWeights, int_arg


class _StageMapping(dict):
    """A layer's resolved {stage: backend}: a dict that refuses writes, so that a change
    goes through `FusedMoE.backend` (checked names, stale device copies dropped)."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("stage_backends: read-only; assign layer.backend = {stage: backend} "
                        "(or a backend name) to change the mapping")

    __setitem__ = __delitem__ = __ior__ = _refuse
    update = pop = popitem = clear = setdefault = _refuse

    def __reduce__(self):            # copy, deepcopy and pickle build it from a plain dict
        return type(self), (dict(self),)


class FusedMoE(MoEWeights):
    """A Mixture-of-Experts layer with vLLM's FusedMoE semantics and NumPy parameters.

    Parameters (MoEWeights, NumPy, params_dtype, NaN until loaded):
        w13_weight  [E_local, 2*I_p, H]   gate rows then up rows (interleaved for swigluoai)
        w2_weight   [E_local, H, I_p]
        w13_bias    [E_local, 2*I_p]      (has_bias)
        w2_bias     [E_local, H]          (has_bias; added on tp_rank 0 only)
        e_score_correction_bias [E+Z] fp32 (given)
        shared_w13  [2*I_sp, H], shared_w2 [H, I_sp]   (n_shared_experts; I_s =
                    shared_intermediate_size or n_shared_experts * I, I_sp = I_s / tp_size)

    `backend`: a backend name or a {stage: backend} dict (see sandbox.registry); assigning
    `layer.backend` later takes effect at the next forward (`stage_backends` is the resolved,
    read-only mapping).
    `block_size`: the alignment block (= the GEMM's BLOCK_M); None asks the GEMM backend's
    `get_config`, else 64.
    A forward whose intermediates cannot fit where the stages keep them fails before the
    first stage (MemoryError naming T and the bytes; see pipeline.check_memory).
    """

    def __init__(self, num_experts, top_k, hidden_size, intermediate_size,
                 params_dtype=np.float32, renormalize=True, use_grouped_topk=False,
                 num_expert_group=None, topk_group=None, tp_size=1, tp_rank=0, ep_size=1,
                 ep_rank=0, custom_routing_function=None, scoring_func="softmax",
                 routed_scaling_factor=1.0, e_score_correction_bias=None,
                 apply_router_weight_on_input=False, activation="silu", is_act_and_mul=True,
                 has_bias=False, zero_expert_num=0, zero_expert_type=None,
                 n_shared_experts=None, shared_intermediate_size=None,
                 expert_placement="linear", backend="reference", block_size=None,
                 quant_config=None):
        from reference.routing import check_scoring_route

        super().__init__(num_experts, hidden_size, intermediate_size, params_dtype,
                         tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size, ep_rank=ep_rank,
                         expert_placement=expert_placement, activation=activation,
                         is_act_and_mul=is_act_and_mul, has_bias=has_bias,
                         zero_expert_num=zero_expert_num, n_shared_experts=n_shared_experts,
                         shared_intermediate_size=shared_intermediate_size,
                         e_score_correction_bias=e_score_correction_bias,
                         quant_config=quant_config)
        # the router
        self.top_k = int_arg("top_k", top_k, 1)
        self.renormalize = bool(renormalize)
        if zero_expert_type not in (None, "identity"):
            raise ValueError(f"zero_expert_type: expected None or 'identity', "
                             f"got {zero_expert_type!r}")
        if self.zero_expert_num and zero_expert_type is None:
            raise ValueError("zero_expert_type: expected 'identity' when zero_expert_num > 0, "
                             "got None")
        self.zero_expert_type = zero_expert_type
        if self.top_k > self.num_router_experts:
            raise ValueError(f"top_k: expected at most the number of experts "
                             f"({self.num_router_experts}), got {top_k}")
        self.use_grouped_topk = bool(use_grouped_topk)
        # the correction bias may still come from load_weights: select_experts checks it
        check_scoring_route(scoring_func, self.use_grouped_topk,
                            custom_routing_function is not None, has_bias=True)
        if self.use_grouped_topk and (num_expert_group is None or topk_group is None):
            raise ValueError(f"use_grouped_topk: expected num_expert_group and topk_group, got "
                             f"num_expert_group={num_expert_group}, topk_group={topk_group}")
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.custom_routing_function = custom_routing_function
        self.scoring_func = scoring_func
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.apply_router_weight_on_input = bool(apply_router_weight_on_input)
        if self.apply_router_weight_on_input and self.top_k != 1:
            raise ValueError(f"apply_router_weight_on_input: needs top_k == 1 (as vLLM), "
                             f"got top_k={top_k}")
        # the pipeline
        self.backend = backend           # checked and resolved by the property's setter
        self.block_size = (None if block_size is None
                           else int_arg("block_size", block_size, 1))

    # ------------------------------------------------------------------------- backends
    @property
    def backend(self):
        """The stage mapping as given: a backend name, or a {stage: backend} dict (stages
        left out run on "reference"). Assigning it takes effect at the next forward:

            layer.backend = {"route": "numba", "gemm1": "cupy"}

        The setter resolves the mapping through registry.resolve_stage_mapping (ValueError
        for an unknown stage or backend, TypeError for anything else; the layer is then left
        as it was) and drops the cached device copies of the parameters for backends no
        stage uses any more. Availability is checked on forward."""
        spec = self._backend_spec
        return dict(spec) if isinstance(spec, dict) else spec

    @backend.setter
    def backend(self, backend):
        mapping = resolve_stage_mapping(backend)          # raises before anything changes
        self._backend_spec = dict(backend) if isinstance(backend, Mapping) else backend
        self._stage_backends = _StageMapping(mapping)
        self.keep_device_copies(set(mapping.values()))

    @property
    def stage_backends(self) -> dict:
        """{stage: backend name} for all six stages, resolved from `backend` (read-only;
        assigning a mapping here is the same as assigning `backend`)."""
        return self._stage_backends

    @stage_backends.setter
    def stage_backends(self, mapping):
        self.backend = mapping

    def block_size_for(self, backend, num_tokens) -> int:
        """The block_size a forward with `backend` (a name or mapping) uses for T tokens."""
        return pipeline.block_size_for(self, resolve_stage_mapping(backend), num_tokens)

    # ------------------------------------------------------------------------- construction
    @classmethod
    def from_safetensors(cls, path, layer_idx=None, **overrides):
        """One MoE layer of a safetensors checkpoint (sandbox.checkpoint.load; layer_idx
        None: the first MoE layer). `overrides` are FusedMoE keyword arguments (they win
        over config.json), plus `family=` to force the family. The layer carries
        `router_weight [E, H]`, `router_bias [E] or None` and `checkpoint_info`; any
        mismatch raises checkpoint.CheckpointError."""
        return checkpoint.load(path, layer_idx, cls, **overrides)

    @classmethod
    def random(cls, seed=0, **kwargs):
        """A layer with random weights (MoEWeights.load_random: normal / sqrt(fan_in),
        biases normal * 0.1, the full tensors drawn from `seed` and loaded through
        weight_loader, so ranks built with the same seed and different tp_rank / ep_rank
        hold the shards of one model). Defaults: E=8, K=2, H=64, I=96."""
        kwargs = {"num_experts": 8, "top_k": 2, "hidden_size": 64, "intermediate_size": 96,
                  **kwargs}
        return cls(**kwargs).load_random(seed)

    def random_inputs(self, num_tokens, seed=0, logit_scale=1.0):
        """(hidden_states [T, H] params_dtype, router_logits [T, E+Z] fp32), standard normal."""
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((num_tokens, self.hidden_size), dtype=np.float32)
        logits = rng.standard_normal((num_tokens, self.num_router_experts), dtype=np.float32)
        return x.astype(self.params_dtype), logits * np.float32(logit_scale)

    def with_backend(self, backend) -> FusedMoE:
        """A shallow copy of the layer (sharing the parameters) with another stage mapping
        (set through the `backend` property: the same checks); its device copies start
        empty."""
        other = copy.copy(self)
        other._device_params = {}
        other.backend = backend
        return other

    def __repr__(self):
        parts = [f"E={self.num_experts}", f"K={self.top_k}", f"H={self.hidden_size}",
                 f"I={self.intermediate_size}", f"dtype={self.params_dtype}",
                 f"activation={self.activation}"]
        if self.tp_size > 1:
            parts.append(f"tp={self.tp_rank}/{self.tp_size}")
        if self.ep_size > 1:
            parts.append(f"ep={self.ep_rank}/{self.ep_size} ({self.expert_placement}, "
                         f"{self.local_num_experts} local)")
        if self.zero_expert_num:
            parts.append(f"zero_experts={self.zero_expert_num}")
        if self.n_shared_experts:
            parts.append(f"shared={self.n_shared_experts}")
        if self.has_bias:
            parts.append("bias")
        if self.quant_config is not None:
            parts.append(f"quant={self.quant_config.describe()!r}")
        parts.append(f"backend={self._backend_spec!r}")
        return "FusedMoE(" + ", ".join(parts) + ")"

    # ------------------------------------------------------------------------- forward
    def select_experts(self, hidden_states, router_logits):
        """The route stage on the layer's route backend, results as NumPy:
        (topk_weights f32 [T, K], topk_ids int32 [T, K], zero_expert_result [T, H] or None)."""
        run = pipeline.start(self.stage_backends)
        x, logits = pipeline.check_inputs(self, hidden_states, router_logits, exact=False)
        with caller_stream(hidden_states, router_logits):
            out = pipeline.route(self, run, x, logits)
        b = run.backends["route"]
        return tuple(None if v is None else b.get(v) for v in out)

    def forward(self, hidden_states, router_logits, *, return_device=False):
        """The layer: [T, H] -> [T, H] (see the module docstring for the math).

        hidden_states: NumPy (cast to params_dtype) or a device array of params_dtype;
        router_logits [T, E+Z] any float dtype. Returns NumPy, or with return_device=True
        a device array without a copy to the host: of hidden_states' library when that is a
        GPU array (torch in, torch out; a zero-copy view), else the combine backend's own.
        With tp_size > 1 / ep_size > 1 this is the rank's partial output.
        """
        run = pipeline.start(self.stage_backends)
        with caller_stream(hidden_states, router_logits):
            out = pipeline.forward(self, run, hidden_states, router_logits, exact=False)
        if return_device:
            if arrays.is_device(hidden_states) and arrays.kind(out) != arrays.kind(hidden_states):
                view = arrays.zero_copy(out, arrays.kind(hidden_states))
                return out if view is None else view
            return out
        return run.backends["combine"].get(out)

    __call__ = forward

    def run_stages(self, hidden_states, router_logits, backend=None, *, exact=False,
                   block_size=None):
        """Forward with a stage trace: (out as NumPy, [StageCall, ...] of the six stages).

        `backend` overrides the layer's mapping; `exact=True` runs the reference on float64
        copies of the inputs and parameters (every stage must then be "reference");
        `block_size` overrides the alignment block for this call.
        """
        mapping = self.stage_backends if backend is None else resolve_stage_mapping(backend)
        if exact and set(mapping.values()) != {"reference"}:
            raise ValueError(f"exact: runs on the reference only, got the mapping {mapping}")
        run = pipeline.start(mapping, trace=[])
        with caller_stream(hidden_states, router_logits):
            out = pipeline.forward(self, run, hidden_states, router_logits, exact=exact,
                                   block=block_size)
        return run.backends["combine"].get(out), run.trace
