"""Routing: router logits -> (topk_weights, topk_ids), vLLM's semantics in NumPy.

    T = tokens, E = experts, K = top-k, G = expert groups

    fused_topk        softmax over E (fp32), top-K, optional renormalize      (Mixtral, Qwen3-MoE)
    fused_topk_bias   experts chosen on softmax + bias, weighed unbiased      (biased softmax routers)
    grouped_topk      softmax/sigmoid, keep the best groups, top-K in them    (DeepSeek-V2/V3)
    llama4_custom_routing_function   top-1 on the logits, sigmoid weight     (Llama 4)
    select_experts    the dispatcher of vLLM's FusedMoE.select_experts

Order and ties: the K experts come in descending order of their selection score, ties to
the lowest expert id, so every backend can agree bit for bit on the ids.

NaN: for *selection* a NaN score counts as -inf (ties to the lowest id), so a token always
gets K distinct valid experts and no kernel ever indexes out of range. The *weights* follow
the ordinary formulas, so a NaN logit in a softmax row makes that whole row's weights NaN:
the corruption stays visible in that token's output and confined to it. A row whose
maximum is +inf, or whose entries are all -inf, gets NaN softmax weights the same way
(inf - inf). Under sigmoid scoring a NaN logit only poisons its own expert's score.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ._checks import check_choice, check_float, check_positive_int
from .precision import compute_dtype

SCORING_FUNCS = ("softmax", "sigmoid")


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row softmax in fp32: exp(x - max) / sum. NaN anywhere in a row -> NaN for the row."""
    x = logits.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        shifted = x - x.max(axis=-1, keepdims=True)
        e = np.exp(shifted)
        return e / e.sum(axis=-1, keepdims=True)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) in fp32."""
    x = logits.astype(np.float32)
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def topk_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """The k best columns of each row: descending, ties to the lowest index, NaN as -inf.

    A stable sort of the negated key keeps equal keys in index order, which is exactly the
    tie rule; the kernels implement the same comparison: (a > b) or (a == b and ia < ib).
    """
    key = np.where(np.isnan(scores), -np.inf, scores)
    return np.argsort(-key, axis=-1, kind="stable")[..., :k]


def _renormalize(weights: np.ndarray) -> np.ndarray:
    """Divide each row by its sum where that sum is positive (a zero or NaN sum is kept)."""
    total = weights.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, weights / np.where(total > 0, total, 1), weights)


def _check_logits(hidden_states, gating_output, topk):
    check_float("gating_output", gating_output, ndim=2)
    num_tokens, num_experts = gating_output.shape
    if hidden_states is not None:
        check_float("hidden_states", hidden_states, ndim=2)
        if hidden_states.shape[0] != num_tokens:
            raise ValueError(
                f"hidden_states: expected {num_tokens} rows to match gating_output, "
                f"got shape {hidden_states.shape}")
    topk = check_positive_int("topk", topk)
    if topk > num_experts:
        raise ValueError(f"topk: expected at most the number of experts ({num_experts}), got {topk}")
    return num_tokens, num_experts, topk


def check_router_width(name, logits, num_experts, zero_expert_num=0):
    """The router's columns against the experts: `num_experts` (+ `zero_expert_num`) when
    num_experts is known (None or -1: unknown, no check). Any array with a 2-D `.shape`
    (NumPy, torch, CuPy, numba); other shapes are left to the routing functions' checks."""
    if num_experts is None or num_experts == -1:
        return
    shape = tuple(getattr(logits, "shape", ()))
    if len(shape) != 2:
        return
    zero = int(zero_expert_num or 0)
    want = int(num_experts) + zero
    if shape[1] != want:
        why = (f"global_num_experts={num_experts} + zero_expert_num={zero}" if zero
               else f"one per expert, global_num_experts={num_experts}")
        raise ValueError(f"{name}: expected {want} columns ({why}), got shape {shape}")


def _check_bias(e_score_correction_bias, num_experts):
    return check_float("e_score_correction_bias", e_score_correction_bias, ndim=1,
                       shape=(num_experts,)).astype(np.float32)


def fused_topk(hidden_states, gating_output, topk, renormalize, indices_type=None):
    """Softmax top-k routing.

    scores = softmax(gating_output)                 # [T, E] fp32
    topk_ids = the K best experts by score          # [T, K] descending, ties to lowest id
    topk_weights = scores[topk_ids] (/ their sum)   # [T, K] fp32
    token_expert_indices[t, k] = k * T + t          # [T, K] the slot's row in a slot-major layout

    Returns (topk_weights f32, topk_ids int32 (or indices_type), token_expert_indices int32).
    """
    num_tokens, _, topk = _check_logits(hidden_states, gating_output, topk)
    scores = softmax(gating_output)                                   # [T, E]
    topk_ids = topk_indices(scores, topk)                             # [T, K]
    topk_weights = np.take_along_axis(scores, topk_ids, axis=-1)      # [T, K]
    if renormalize:
        topk_weights = _renormalize(topk_weights)
    token_expert_indices = (np.arange(topk, dtype=np.int32)[None, :] * num_tokens
                            + np.arange(num_tokens, dtype=np.int32)[:, None])
    return (topk_weights.astype(np.float32), topk_ids.astype(indices_type or np.int32),
            token_expert_indices.astype(np.int32))


def fused_topk_bias(hidden_states, gating_output, e_score_correction_bias, topk, renormalize,
                    routed_scaling_factor=1.0):
    """Softmax routing whose choice is steered by a per-expert bias.

    scores = softmax(gating_output); topk_ids = top-K of (scores + bias);
    topk_weights = scores[topk_ids], renormalized if asked, then * routed_scaling_factor.
    """
    _, num_experts, topk = _check_logits(hidden_states, gating_output, topk)
    bias = _check_bias(e_score_correction_bias, num_experts)
    scores = softmax(gating_output)                                   # [T, E]
    topk_ids = topk_indices(scores + bias[None, :], topk)             # [T, K]
    topk_weights = np.take_along_axis(scores, topk_ids, axis=-1)
    if renormalize:
        topk_weights = _renormalize(topk_weights)
    topk_weights = topk_weights * np.float32(routed_scaling_factor)
    return topk_weights.astype(np.float32), topk_ids.astype(np.int32)


def check_grouped_topk_args(num_experts, topk, scoring_func, num_expert_group, topk_group):
    """grouped_topk's own arguments against E experts and top-K: a known scoring_func, G =
    num_expert_group dividing E, topk_group <= G, and K <= topk_group * E/G (enough experts
    in the kept groups). Returns (G, topk_group, E/G). Plain integers: every backend's
    grouped_topk can call it before its launch."""
    check_choice("scoring_func", scoring_func, SCORING_FUNCS)
    num_expert_group = check_positive_int("num_expert_group", num_expert_group)
    topk_group = check_positive_int("topk_group", topk_group)
    if num_experts % num_expert_group:
        raise ValueError(f"num_expert_group: expected a divisor of the number of experts "
                         f"({num_experts}), got {num_expert_group}")
    if topk_group > num_expert_group:
        raise ValueError(f"topk_group: expected at most num_expert_group ({num_expert_group}), "
                         f"got {topk_group}")
    per_group = num_experts // num_expert_group
    if topk > topk_group * per_group:
        raise ValueError(f"topk: expected at most topk_group * experts per group "
                         f"({topk_group} * {per_group}), got {topk}")
    return num_expert_group, topk_group, per_group


def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0,
                 topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0,
                 e_score_correction_bias=None):
    """DeepSeek-V2/V3 group-limited routing.

    scores = softmax or sigmoid(gating_output)              # [T, E] fp32
    choice = scores + bias (or scores)                      # what selection sees
    group score = max of the group's scores (no bias), or the sum of its two best choice
                  scores (with a bias)                      # [T, G], groups of E/G experts
    keep the topk_group best groups; other experts -> -inf; topk_ids = top-K of choice
    topk_weights = scores[topk_ids] (unbiased), renormalized if asked, * routed_scaling_factor
    """
    _, num_experts, topk = _check_logits(hidden_states, gating_output, topk)
    num_expert_group, topk_group, per_group = check_grouped_topk_args(
        num_experts, topk, scoring_func, num_expert_group, topk_group)

    scores = softmax(gating_output) if scoring_func == "softmax" else sigmoid(gating_output)
    num_tokens = scores.shape[0]
    if e_score_correction_bias is not None:
        choice = scores + _check_bias(e_score_correction_bias, num_experts)[None, :]
        grouped = choice.reshape(num_tokens, num_expert_group, per_group)   # [T, G, E/G]
        best_two = topk_indices(grouped, min(2, per_group))
        group_scores = np.take_along_axis(grouped, best_two, axis=-1).sum(axis=-1)
    else:
        choice = scores
        # a NaN score ranks as -inf here too: it must not knock its whole group out
        finite = np.where(np.isnan(scores), -np.inf, scores)
        group_scores = finite.reshape(num_tokens, num_expert_group, per_group).max(axis=-1)

    kept_groups = topk_indices(group_scores, topk_group)                 # [T, topk_group]
    group_mask = np.zeros((num_tokens, num_expert_group), dtype=bool)
    np.put_along_axis(group_mask, kept_groups, True, axis=-1)
    expert_mask = np.repeat(group_mask, per_group, axis=-1)              # [T, E]
    masked_choice = np.where(expert_mask, choice, -np.inf)

    topk_ids = topk_indices(masked_choice, topk)                         # [T, K]
    topk_weights = np.take_along_axis(scores, topk_ids, axis=-1)
    if renormalize:
        topk_weights = _renormalize(topk_weights)
    topk_weights = topk_weights * np.float32(routed_scaling_factor)
    return topk_weights.astype(np.float32), topk_ids.astype(np.int32)


def llama4_custom_routing_function(hidden_states, gating_output, topk, renormalize):
    """Llama 4: top-K on the raw logits, weight = sigmoid(logit); `renormalize` is ignored."""
    _check_logits(hidden_states, gating_output, topk)
    logits = gating_output.astype(np.float32)
    topk_ids = topk_indices(logits, topk)
    topk_weights = sigmoid(np.take_along_axis(logits, topk_ids, axis=-1))
    return topk_weights.astype(np.float32), topk_ids.astype(np.int32)


def zero_experts_compute(topk_ids, topk_weights, num_experts, zero_expert_type, hidden_states):
    """Zero experts (LongCat-Flash): ids >= num_experts name parameter-free experts.

    "identity": zero_expert_result[t] = sum over such slots of topk_weights[t, k] * x[t].
    Those slots are then pointed at expert 0 with weight 0 (in place, as vLLM does), so the
    routed experts see only real experts. Returns zero_expert_result [T, H] in x's dtype.
    """
    check_choice("zero_expert_type", zero_expert_type, ("identity",))
    is_zero = topk_ids >= num_experts                                    # [T, K]
    acc = compute_dtype(hidden_states.dtype)
    scale = np.where(is_zero, topk_weights, 0).astype(acc).sum(axis=-1)         # [T]
    result = hidden_states.astype(acc) * scale[:, None]
    topk_ids[is_zero] = 0
    topk_weights[is_zero] = 0.0
    return result.astype(hidden_states.dtype, copy=False)


def _call_custom_routing(fn, hidden_states, router_logits, top_k, renormalize):
    """A custom routing function is called with the backend's own arrays (NumPy here)."""
    return fn(hidden_states=hidden_states, gating_output=router_logits, topk=top_k,
              renormalize=renormalize)


# What select_experts calls on its arrays. The three routing functions are the stages, and
# a backend's ops must have all three. The other four are the array handling of the
# dispatcher's tail, which a backend whose arrays are not NumPy's (torch) supplies; any it
# leaves out are taken from here.
_REFERENCE_OPS = SimpleNamespace(
    fused_topk=fused_topk, fused_topk_bias=fused_topk_bias, grouped_topk=grouped_topk,
    call_custom_routing=_call_custom_routing,
    ids_astype=lambda ids, indices_type: ids.astype(indices_type),
    copy=lambda x: np.array(x, copy=True),
    zero_experts_compute=zero_experts_compute)


def select_experts(hidden_states, router_logits, top_k, use_grouped_topk, renormalize,
                   topk_group=None, num_expert_group=None, custom_routing_function=None,
                   scoring_func="softmax", routed_scaling_factor=1.0,
                   e_score_correction_bias=None, indices_type=None, global_num_experts=None,
                   zero_expert_num=0, zero_expert_type=None, ops=None):
    """vLLM's FusedMoE.select_experts: pick the routing function, return
    (topk_weights [T, K] f32, topk_ids [T, K] int32, zero_expert_result [T, H] or None).

    Dispatch, in vLLM's order: grouped_topk if use_grouped_topk; fused_topk_bias if a
    correction bias is given; fused_topk if no custom function; else the custom function.
    A plain sigmoid router (scoring_func="sigmoid" without groups) is grouped_topk with one
    group, which is the same function. `ops` supplies fused_topk / fused_topk_bias /
    grouped_topk from another backend, and optionally the array handling of the tail
    (call_custom_routing, ids_astype, copy, zero_experts_compute; see _REFERENCE_OPS):
    the dispatch logic is shared.

    With global_num_experts given, router_logits must have global_num_experts +
    zero_expert_num columns (ValueError naming router_logits): a narrower router would
    otherwise route silently to the first experts only. Every backend's select_experts comes
    through here, so the check is the same everywhere; the routing functions themselves
    take no number of experts (vLLM's signatures) and check only a correction bias' width.
    """
    ops = ops or _REFERENCE_OPS

    def tail(name):   # the array handling: the backend's if it has one, else NumPy's
        return getattr(ops, name, getattr(_REFERENCE_OPS, name))

    check_choice("scoring_func", scoring_func, SCORING_FUNCS)
    check_router_width("router_logits", router_logits, global_num_experts, zero_expert_num)
    if use_grouped_topk or (scoring_func == "sigmoid" and custom_routing_function is None):
        if use_grouped_topk and (topk_group is None or num_expert_group is None):
            raise ValueError("use_grouped_topk: expected topk_group and num_expert_group, "
                             f"got topk_group={topk_group}, num_expert_group={num_expert_group}")
        topk_weights, topk_ids = ops.grouped_topk(
            hidden_states, router_logits, top_k, renormalize,
            num_expert_group=num_expert_group if use_grouped_topk else 1,
            topk_group=topk_group if use_grouped_topk else 1,
            scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor,
            e_score_correction_bias=e_score_correction_bias)
    elif e_score_correction_bias is not None:
        topk_weights, topk_ids = ops.fused_topk_bias(
            hidden_states, router_logits, e_score_correction_bias, top_k, renormalize,
            routed_scaling_factor=routed_scaling_factor)
    elif custom_routing_function is None:
        topk_weights, topk_ids, _ = ops.fused_topk(hidden_states, router_logits, top_k,
                                                   renormalize)
    else:
        topk_weights, topk_ids = tail("call_custom_routing")(
            custom_routing_function, hidden_states, router_logits, top_k, renormalize)
    if indices_type is not None:
        topk_ids = tail("ids_astype")(topk_ids, indices_type)

    zero_expert_result = None
    if zero_expert_num and zero_expert_type is not None:
        if global_num_experts is None:
            raise ValueError("global_num_experts: expected the number of real experts when "
                             "zero experts are on, got None")
        # zero_experts_compute rewrites ids and weights in place: on copies, not on the
        # routing functions' (or a custom function's) own arrays
        topk_ids, topk_weights = tail("copy")(topk_ids), tail("copy")(topk_weights)
        zero_expert_result = tail("zero_experts_compute")(
            topk_ids, topk_weights, global_num_experts, zero_expert_type, hidden_states)
    return topk_weights, topk_ids, zero_expert_result
