"""The whole layer: the stages composed as vLLM's fused_experts / fused_moe compose them.

    T = tokens, K = top-k, P = T*K slots (s = t*K + k), H = hidden, I = intermediate,
    E_local = experts on this rank, B = block size, N = a GEMM's output width

    out[t] = sum_k  w[t, k] * W2[e] @ act(W13[e] @ x[t] + b13[e]) (+ b2[e] scaled too),  e = ids[t, k]

fused_experts runs it as vLLM's fused path does, one stage per function (and file):

    moe_align_block_size   align.py       topk_ids -> sorted_token_ids, expert_ids,
                                          num_tokens_post_padded
    grouped_gemm (GEMM1)   gemm.py        x [T, H] gathered by slot @ w13[e].T -> cache1 [P, 2I]
    apply_activation       activation.py  cache1 -> cache2 [P, I]
    grouped_gemm (GEMM2)   gemm.py        cache2 @ w2[e].T, * router weight    -> cache3 [P, H]
    moe_sum                combine.py     cache3 [T, K, H] summed over K       -> out [T, H]

fused_moe routes first (routing.py's select_experts).

Every stage accumulates in fp32 (fp64 for fp64 inputs) and rounds once to the input dtype,
which are the rounding points of vLLM's kernels on bf16 (precision="engine").
precision="exact" runs the same stages on float64 copies of every input.
"""

from __future__ import annotations

import numpy as np

from ._checks import (
    check_choice,
    check_float,
    check_int,
    check_positive_int,
    check_working_set,
)
from .activation import apply_activation
from .align import moe_align_block_size
from .combine import moe_sum
from .gemm import grouped_gemm
from .precision import compute_dtype, exact
from .routing import select_experts

DEFAULT_BLOCK_SIZE = 64
PRECISIONS = ("engine", "exact")


def check_w1_rows(w1, inter, activation, is_act_and_mul):
    """w1 [E, N1, H] against w2's intermediate size: N1 = 2 I for a gated activation (the
    gate and up halves), else I (quant.py's formats check it the same way)."""
    gated = is_act_and_mul and not str(activation).endswith("_no_mul")
    want_n1 = 2 * inter if gated else inter
    if w1.shape[1] != want_n1:
        raise ValueError(f"w1: expected {want_n1} output rows ({'2 * ' if gated else ''}w2's "
                         f"intermediate size {inter}), got shape {w1.shape}")


def check_topk_arrays(topk_weights, topk_ids, num_tokens):
    """topk_ids int [T, K] and topk_weights float [T, K] for T = num_tokens rows."""
    check_int("topk_ids", topk_ids, ndim=2)
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids: expected {num_tokens} rows to match hidden_states, "
                         f"got shape {topk_ids.shape}")
    check_float("topk_weights", topk_weights, ndim=2, shape=topk_ids.shape)


def _check_experts_args(hidden_states, w1, w2, topk_weights, topk_ids, is_act_and_mul,
                        activation, w1_bias, w2_bias):
    check_float("hidden_states", hidden_states, ndim=2)
    num_tokens, hidden = hidden_states.shape
    check_float("w1", w1, ndim=3)
    num_local, n1, _ = w1.shape
    check_float("w1", w1, shape=(None, None, hidden))
    check_float("w2", w2, ndim=3, shape=(num_local, hidden, None))
    check_w1_rows(w1, w2.shape[2], activation, is_act_and_mul)
    for name, wt in (("w1", w1), ("w2", w2)):
        if wt.dtype != hidden_states.dtype:
            raise TypeError(f"{name}: expected the dtype of hidden_states "
                            f"({hidden_states.dtype}), got {wt.dtype}")
    check_topk_arrays(topk_weights, topk_ids, num_tokens)
    if w1_bias is not None:
        check_float("w1_bias", w1_bias, ndim=2, shape=(num_local, n1))
    if w2_bias is not None:
        check_float("w2_bias", w2_bias, ndim=2, shape=(num_local, hidden))


def check_expert_routing(topk_ids, num_local, global_num_experts, expert_map,
                         apply_router_weight_on_input):
    """The routing arguments of the experts (fused_experts, quant.fused_experts_quant):
    global_num_experts (-1 / None: num_local, which it must be without an expert_map),
    the router weight on the input only for top-1. An id outside [0, global_num_experts)
    (vLLM's -1) is allowed: that slot contributes nothing. Returns (top_k, num_experts)."""
    top_k = topk_ids.shape[1]
    num_experts = num_local if global_num_experts in (-1, None) else global_num_experts
    num_experts = check_positive_int("global_num_experts", num_experts)
    if expert_map is None and num_experts != num_local:
        raise ValueError(f"global_num_experts: expected {num_local} (w1's experts) without an "
                         f"expert_map, got {num_experts}")
    if apply_router_weight_on_input and top_k != 1:
        raise ValueError(f"apply_router_weight_on_input: needs top_k == 1, got top_k = {top_k}")
    return top_k, num_experts


def check_experts_working_set(num_tokens, top_k, n1, inter, hidden, dtype):
    """MemoryError naming T and the bytes when the intermediates of the experts cannot fit
    in host memory: at least cache1 [P, N1] + cache2 [P, I] + cache3 [P, H] (P = T*K) in
    the compute dtype (fp32, fp64 for fp64), which the stages allocate before they round.
    A lower bound of the peak (the GEMMs' gathered rows come on top): it refuses only what
    cannot fit, and costs nothing below _checks.CHECK_ABOVE_BYTES."""
    item = np.dtype(compute_dtype(np.dtype(dtype))).itemsize
    nbytes = num_tokens * top_k * (n1 + inter + hidden) * item
    check_working_set(num_tokens, nbytes,
                      f"intermediates ([T*K, {n1}] + [T*K, {inter}] + [T*K, {hidden}] in "
                      f"{np.dtype(compute_dtype(np.dtype(dtype)))}, K={top_k})")


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                  apply_router_weight_on_input=False, global_num_experts=-1, expert_map=None,
                  w1_bias=None, w2_bias=None, is_act_and_mul=True, block_size=None,
                  precision="engine"):
    """The routed experts of one MoE layer (vLLM's fused_experts).

    hidden_states [T, H]; w1 = w13 [E_local, 2I, H] (gate rows then up rows, interleaved for
    swigluoai); w2 [E_local, H, I]; topk_weights [T, K] f32; topk_ids [T, K] global ids, an
    id outside [0, E) (vLLM's -1: a masked or padded token) adds nothing: alignment skips
    the slot and the combine leaves it out. expert_map [E] maps global ids to local ids or
    -1: slots of experts on other ranks add nothing, so the ranks' partial outputs sum to
    the whole layer. The router weight scales
    GEMM2's output (and so the down-projection bias), or with apply_router_weight_on_input
    (top-1 only) GEMM1's. Returns [T, H] in hidden_states' dtype (float64 when exact).
    A batch whose intermediates cannot fit in host memory is refused before any of them is
    allocated (MemoryError naming T and the bytes: check_experts_working_set).
    """
    check_choice("precision", precision, PRECISIONS)
    _check_experts_args(hidden_states, w1, w2, topk_weights, topk_ids, is_act_and_mul,
                        activation, w1_bias, w2_bias)
    num_tokens, hidden = hidden_states.shape
    top_k, num_experts = check_expert_routing(topk_ids, w1.shape[0], global_num_experts,
                                              expert_map, apply_router_weight_on_input)
    block_size = check_positive_int("block_size",
                                    DEFAULT_BLOCK_SIZE if block_size is None else block_size)
    check_experts_working_set(num_tokens, top_k, w1.shape[1], w2.shape[2], hidden,
                              np.float64 if precision == "exact" else hidden_states.dtype)

    if precision == "exact":
        hidden_states, w1, w2, topk_weights, w1_bias, w2_bias = (
            exact(v) for v in (hidden_states, w1, w2, topk_weights, w1_bias, w2_bias))

    sorted_token_ids, expert_ids, num_tokens_post_padded = moe_align_block_size(
        topk_ids, block_size, num_experts, expert_map=expert_map)
    cache1 = grouped_gemm(hidden_states, w1, sorted_token_ids, expert_ids,        # [P, 2I]
                          num_tokens_post_padded, top_k, block_size, topk_weights,
                          mul_routed_weight=apply_router_weight_on_input, bias=w1_bias)
    cache2 = apply_activation(cache1, activation, is_act_and_mul)                  # [P, I]
    cache3 = grouped_gemm(cache2, w2, sorted_token_ids, expert_ids,                # [P, H]
                          num_tokens_post_padded, 1, block_size, topk_weights,
                          mul_routed_weight=not apply_router_weight_on_input, bias=w2_bias)
    live_ids = np.where((topk_ids >= 0) & (topk_ids < num_experts), topk_ids, -1)
    return moe_sum(cache3.reshape(num_tokens, top_k, hidden), live_ids,  # [T, H]
                   expert_map)


def fused_moe(hidden_states, w1, w2, gating_output, topk, renormalize, activation="silu",
              use_grouped_topk=False, num_expert_group=None, topk_group=None,
              custom_routing_function=None, scoring_func="softmax", routed_scaling_factor=1.0,
              e_score_correction_bias=None, apply_router_weight_on_input=False,
              global_num_experts=-1, expert_map=None, w1_bias=None, w2_bias=None,
              is_act_and_mul=True, block_size=None, precision="engine"):
    """Route, then run the experts: select_experts followed by fused_experts.

    gating_output [T, E]: one column per global expert, i.e. global_num_experts when given,
    else expert_map's length with an expert_map, else w1.shape[0] (ValueError naming
    gating_output otherwise: 6 columns for 8 experts must not route to experts 0..5)."""
    check_float("gating_output", gating_output, ndim=2)
    if all(isinstance(a, np.ndarray) and a.ndim == n
           for a, n in ((hidden_states, 2), (w1, 3), (w2, 3))) and \
            isinstance(topk, (int, np.integer)) and topk >= 1:
        # before the routing, whose [T, E] scores come first (bad arguments: checked later)
        check_experts_working_set(hidden_states.shape[0], topk, w1.shape[1], w2.shape[2],
                                  hidden_states.shape[1],
                                  np.float64 if precision == "exact" else hidden_states.dtype)
    if global_num_experts not in (-1, None):
        num_experts, source = global_num_experts, "global_num_experts"
    elif expert_map is not None:
        num_experts, source = len(expert_map), "expert_map's length"
    else:
        num_experts, source = w1.shape[0] if hasattr(w1, "shape") else None, "w1.shape[0]"
    if num_experts is not None and gating_output.shape[1] != num_experts:
        raise ValueError(f"gating_output: expected {num_experts} columns (one per expert, "
                         f"{source}), got shape {gating_output.shape}")
    topk_weights, topk_ids, _ = select_experts(
        hidden_states, gating_output, topk, use_grouped_topk, renormalize,
        topk_group=topk_group, num_expert_group=num_expert_group,
        custom_routing_function=custom_routing_function, scoring_func=scoring_func,
        routed_scaling_factor=routed_scaling_factor,
        e_score_correction_bias=e_score_correction_bias)
    return fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation=activation,
                         apply_router_weight_on_input=apply_router_weight_on_input,
                         global_num_experts=global_num_experts, expert_map=expert_map,
                         w1_bias=w1_bias, w2_bias=w2_bias, is_act_and_mul=is_act_and_mul,
                         block_size=block_size, precision=precision)
