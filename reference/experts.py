"""The expert computation: grouped GEMMs, activation, combine.

    T = tokens, K = top-k, P = T*K slots (s = t*K + k), H = hidden, I = intermediate,
    E_local = experts on this rank, B = block size, N = a GEMM's output width

    out[t] = sum_k  w[t, k] * W2[e] @ act(W13[e] @ x[t] + b13[e]) (+ b2[e] scaled too),  e = ids[t, k]

fused_experts runs it as vLLM's fused path does, one stage per function:

    moe_align_block_size   topk_ids -> sorted_token_ids, expert_ids, num_tokens_post_padded
    grouped_gemm (GEMM1)   x [T, H] gathered by slot  @ w13[e].T  -> cache1 [P, 2I]
    apply_activation       cache1 -> cache2 [P, I]
    grouped_gemm (GEMM2)   cache2 @ w2[e].T, * router weight      -> cache3 [P, H]
    moe_sum                cache3 [T, K, H] summed over K         -> out [T, H]

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
from .permute import moe_align_block_size
from .precision import compute_dtype, exact, to_compute
from .routing import select_experts

DEFAULT_BLOCK_SIZE = 64
PRECISIONS = ("engine", "exact")


def grouped_gemm(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_size,
                 topk_weights=None, mul_routed_weight=False, bias=None):
    """vLLM's fused MoE GEMM as a pure function.

    For each block b < num_tokens_post_padded / B and each s = sorted_token_ids[p] < P
    in it (P = a.shape[0] * top_k), with e = expert_ids[b]:
        c[s] = (a[s // top_k] @ w[e].T + bias[e]) * (topk_weights.flat[s] if mul_routed_weight)
    and c[s] = 0 when e == -1 (an expert on another rank). Rows that no block names stay
    NaN (only possible with ignore_invalid_experts): reading them is a caller's bug.

    a [M_a, Kdim], w [E_local, N, Kdim] -> c [P, N] in a.dtype.
    GEMM1: a = x [T, H], top_k = K.   GEMM2: a = cache2 [P, I], top_k = 1.
    """
    check_float("a", a, ndim=2)
    check_float("w", w, ndim=3)
    if w.dtype != a.dtype:
        raise TypeError(f"w: expected the dtype of a ({a.dtype}), got {w.dtype}")
    if w.shape[2] != a.shape[1]:
        raise ValueError(f"w: expected shape (E, N, {a.shape[1]}) to match a's columns, "
                         f"got {w.shape}")
    num_experts = w.shape[0]

    def expert_matmul(e, token_rows):
        return to_compute(a[token_rows]) @ to_compute(w[e]).T                 # [rows, N]

    c = walk_expert_blocks(expert_matmul, a.shape[0], num_experts, w.shape[1], sorted_token_ids,
                           expert_ids, num_tokens_post_padded, top_k, block_size, topk_weights,
                           mul_routed_weight, bias, to_compute(a[:0]).dtype)
    return c.astype(a.dtype, copy=False)   # a fresh array: no second copy in fp32


def walk_expert_blocks(expert_matmul, num_rows, num_experts, n_out, sorted_token_ids,
                       expert_ids, num_tokens_post_padded, top_k, block_size, topk_weights,
                       mul_routed_weight, bias, acc_dtype):
    """The block walk of a fused MoE GEMM, with the product itself passed in.

    The blocks b < num_tokens_post_padded / B of sorted_token_ids are grouped by their expert
    e = expert_ids[b], and each expert's real slots s < P (P = num_rows * top_k) go through
    one call expert_matmul(e, s // top_k) -> [len(s), N] in acc_dtype (those rows of the left
    operand times w[e].T). Then, in acc_dtype:
        c[s] = (expert_matmul(e, s // top_k) + bias[e]) * (topk_weights.flat[s] if mul_routed_weight)
    and c[s] = 0 where e == -1. bias[e] is rounded to acc_dtype before the add, as the kernels
    load it. Rows that no block names stay NaN. Returns c [P, N] in acc_dtype, unrounded: the
    caller rounds once. grouped_gemm passes a plain matmul, quant.grouped_gemm_quant a matmul
    on operands dequantized one expert at a time.
    """
    check_int("sorted_token_ids", sorted_token_ids, ndim=1)
    check_int("expert_ids", expert_ids, ndim=1)
    top_k = check_positive_int("top_k", top_k)
    block_size = check_positive_int("block_size", block_size)
    num_padded = int(np.asarray(num_tokens_post_padded).ravel()[0])
    num_blocks = num_padded // block_size
    if num_padded % block_size or num_padded > sorted_token_ids.size or num_blocks > expert_ids.size:
        raise ValueError(f"num_tokens_post_padded: expected a multiple of block_size ({block_size}) "
                         f"within sorted_token_ids ({sorted_token_ids.size}) and expert_ids "
                         f"({expert_ids.size} blocks), got {num_padded}")
    num_slots = num_rows * top_k
    if bias is not None:
        check_float("bias", bias, ndim=2, shape=(num_experts, n_out))
    if mul_routed_weight:
        if topk_weights is None:
            raise ValueError("topk_weights: expected an array when mul_routed_weight=True, got None")
        check_float("topk_weights", topk_weights)
        if topk_weights.size != num_slots:
            raise ValueError(f"topk_weights: expected {num_slots} weights (a rows * top_k), "
                             f"got shape {topk_weights.shape}")

    block_experts = expert_ids[:num_blocks]
    if block_experts.size and (block_experts.min() < -1 or block_experts.max() >= num_experts):
        raise ValueError(f"expert_ids: expected local ids in [-1, {num_experts}), got "
                         f"{int(block_experts.min())}..{int(block_experts.max())}")
    slots = sorted_token_ids[:num_padded].reshape(num_blocks, block_size)     # [blocks, B]

    c = np.full((num_slots, n_out), np.nan, dtype=acc_dtype)                  # [P, N]
    for e in np.unique(block_experts):
        rows = slots[block_experts == e].ravel()
        rows = rows[rows < num_slots].astype(np.int64)                        # drop padding
        if e < 0:
            c[rows] = 0
            continue
        if rows.size == 0:
            continue      # an expert whose blocks are all padding: no product to compute
        y = expert_matmul(int(e), rows // top_k)                              # [rows, N]
        if bias is not None:
            y += bias[e].astype(acc_dtype)
        if mul_routed_weight:
            y *= topk_weights.ravel()[rows].astype(acc_dtype)[:, None]
        c[rows] = y
    return c


def moe_sum(x, topk_ids=None, expert_map=None):
    """The combine: out[t] = sum_k x[t, k] over the K slots, fp32, rounded once.  [T, K, H] -> [T, H]

    With topk_ids [T, K] (vLLM's pad-aware moe_sum) a slot whose id is negative (-1: routed
    nowhere), or, with expert_map, whose expert is not on this rank (an id past the map or
    mapped to -1), is skipped: its row of x is never read (alignment scheduled no GEMM row
    for it, so it holds nothing meaningful). A token with every slot skipped sums to 0.
    """
    check_float("x", x, ndim=3)
    acc = to_compute(x)
    if topk_ids is None:
        return acc.sum(axis=1).astype(x.dtype, copy=False)
    check_int("topk_ids", topk_ids, ndim=2, shape=x.shape[:2])
    live = slot_is_live(topk_ids, expert_map)                                  # [T, K]
    return np.where(live[:, :, None], acc, 0).sum(axis=1).astype(x.dtype, copy=False)


def slot_is_live(topk_ids, expert_map=None):
    """[T, K] bool: the slots the combine adds, id >= 0 and (with expert_map) local."""
    ids = np.asarray(topk_ids).astype(np.int64)
    live = ids >= 0
    if expert_map is not None:
        emap = np.asarray(expert_map).astype(np.int64)
        inside = live & (ids < emap.size)
        live = inside & (emap[np.where(inside, ids, 0)] >= 0)
    return live


def _check_experts_args(hidden_states, w1, w2, topk_weights, topk_ids, is_act_and_mul,
                        activation, w1_bias, w2_bias):
    check_float("hidden_states", hidden_states, ndim=2)
    num_tokens, hidden = hidden_states.shape
    check_float("w1", w1, ndim=3)
    num_local, n1, _ = w1.shape
    check_float("w1", w1, shape=(None, None, hidden))
    check_float("w2", w2, ndim=3, shape=(num_local, hidden, None))
    inter = w2.shape[2]
    gated = is_act_and_mul and not activation.endswith("_no_mul")
    want_n1 = 2 * inter if gated else inter
    if n1 != want_n1:
        raise ValueError(f"w1: expected {want_n1} output rows ({'2 * ' if gated else ''}w2's "
                         f"intermediate size {inter}), got shape {w1.shape}")
    for name, wt in (("w1", w1), ("w2", w2)):
        if wt.dtype != hidden_states.dtype:
            raise TypeError(f"{name}: expected the dtype of hidden_states "
                            f"({hidden_states.dtype}), got {wt.dtype}")
    check_int("topk_ids", topk_ids, ndim=2)
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids: expected {num_tokens} rows to match hidden_states, "
                         f"got shape {topk_ids.shape}")
    check_float("topk_weights", topk_weights, ndim=2, shape=topk_ids.shape)
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
