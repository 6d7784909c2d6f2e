"""Routing: router logits -> (topk_weights, topk_ids), vLLM's semantics in NumPy.

    T = tokens, E = experts, K = top-k, G = expert groups

    fused_topk        softmax or sigmoid over E (fp32), top-K, optional renormalize (Mixtral, Qwen3-MoE)
    fused_topk_bias   experts chosen on scores + bias, weighed unbiased        (biased routers)
    grouped_topk      softmax/sigmoid, keep the best groups, top-K in them    (DeepSeek-V2/V3)
    llama4_custom_routing_function   top-1 on the logits, sigmoid weight     (Llama 4)
    select_experts    the dispatcher of vLLM's router factory

Order and ties: the K experts come in descending order of their selection score, ties to
the lowest expert id, so every backend can agree bit for bit on the ids.

Non-finite values follow vLLM's kernels, which differ by function:
* fused_topk / fused_topk_bias (vLLM's topk_softmax / topk_sigmoid kernels): a score that
  is not finite becomes 0. A softmax row with a NaN or +inf logit, or all -inf, is all
  NaN before that, so it becomes all zeros: ids 0..K-1 (ties), weights 0.
* grouped_topk (vLLM's fused grouped top-k kernel): an expert whose scoring input is not
  finite (the logit under sigmoid, the softmax score under softmax) is *invalid*: it ranks
  below every valid expert (ties to the lowest id) and weighs 0. A token none of whose K
  experts is valid gets the weights 1/K when renormalizing, else 0.
So a token always gets K distinct experts in [0, E) and finite weights.

Precision: all routing math is fp32, except that grouped_topk's softmax scores are rounded
to the logits' dtype before use (vLLM computes that softmax in the logits' dtype, bf16 for a
bf16 router, and upcasts after); fp32 and fp64 logits are unaffected.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ._checks import check_choice, check_float, check_positive_int
from .precision import compute_dtype

SCORING_FUNCS = ("softmax", "sigmoid")   # fused_topk, grouped_topk
# fused_topk_bias also takes DeepSeek-V4's sqrt(softplus) (vLLM's topk_softplus_sqrt kernel)
BIAS_SCORING_FUNCS = SCORING_FUNCS + ("sqrtsoftplus",)
SOFTPLUS_THRESHOLD = 20.0   # softplus(x) = x above it (torch's and vLLM's threshold)


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


def sqrt_softplus(logits: np.ndarray) -> np.ndarray:
    """sqrt(softplus(x)) in fp32, softplus(x) = log(1 + exp(x)), or x above 20 (DeepSeek-V4's
    router scores). NaN stays NaN; -inf gives 0, +inf gives +inf."""
    x = logits.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        softplus = np.where(x > np.float32(SOFTPLUS_THRESHOLD), x,
                            np.log(np.float32(1.0) + np.exp(x)))
        return np.sqrt(softplus.astype(np.float32))


def _check_scoring_func(scoring_func, choices=SCORING_FUNCS):
    if not isinstance(scoring_func, str):
        raise TypeError(f"scoring_func: expected one of {list(choices)}, "
                        f"got {type(scoring_func).__name__}")
    return check_choice("scoring_func", scoring_func, choices)


_SCORE_OF = {"softmax": softmax, "sigmoid": sigmoid, "sqrtsoftplus": sqrt_softplus}


def scores_of(logits: np.ndarray, scoring_func: str = "softmax") -> np.ndarray:
    """softmax, sigmoid or sqrt(softplus) of the logits, fp32 [T, E]."""
    return _SCORE_OF[scoring_func](logits)


def topk_scores(logits: np.ndarray, scoring_func: str = "softmax") -> np.ndarray:
    """The scores vLLM's topk_softmax / topk_sigmoid / topk_softplus_sqrt kernels rank: fp32,
    a non-finite score (NaN, +-inf) replaced by 0. (vLLM's sqrt-softplus kernel clears only
    NaN, so a +inf logit there weighs inf, or NaN after renormalizing; here it weighs 0, as
    in the other two.)"""
    scores = scores_of(logits, scoring_func)
    return np.where(np.isfinite(scores), scores, np.float32(0.0)).astype(np.float32)


def grouped_scores(logits: np.ndarray, scoring_func: str = "softmax"):
    """The scores grouped_topk ranks, and which experts are valid: (scores f32 [T, E],
    valid bool [T, E]). Softmax: computed in fp32, rounded to the logits' dtype (vLLM's
    torch.softmax runs in that dtype), valid where finite. Sigmoid: fp32, valid where the
    logit is finite. Invalid experts' scores are 0 here (they never weigh anything)."""
    if scoring_func == "softmax":
        raw = softmax(logits)
        valid = np.isfinite(raw)
        if np.dtype(logits.dtype) != np.float32:
            with np.errstate(over="ignore", invalid="ignore"):
                raw = raw.astype(logits.dtype).astype(np.float32)
    else:
        valid = np.isfinite(logits.astype(np.float32))
        raw = sigmoid(logits)
    return np.where(valid, raw, np.float32(0.0)).astype(np.float32), valid


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


def check_scoring_route(scoring_func, use_grouped_topk, has_custom_routing, has_bias):
    """scoring_func against the routing function select_experts will call: sqrtsoftplus only
    reaches fused_topk_bias (a correction bias, no grouping), as in vLLM's router factory,
    whose fused_topk and grouped_topk take softmax or sigmoid. (A custom routing function
    ignores scoring_func.)"""
    _check_scoring_func(scoring_func, BIAS_SCORING_FUNCS)
    if scoring_func in SCORING_FUNCS:
        return
    if use_grouped_topk:
        route = "grouped_topk"
    elif has_custom_routing or has_bias:
        return
    else:
        route = "fused_topk (no e_score_correction_bias)"
    raise ValueError(f"scoring_func: {route} expected one of {list(SCORING_FUNCS)}, got "
                     f"{scoring_func!r} (it goes with an e_score_correction_bias, no grouping)")


def _check_bias(e_score_correction_bias, num_experts):
    return check_float("e_score_correction_bias", e_score_correction_bias, ndim=1,
                       shape=(num_experts,)).astype(np.float32)


def fused_topk(hidden_states, gating_output, topk, renormalize, indices_type=None,
               scoring_func="softmax"):
    """Softmax (or sigmoid) top-k routing: vLLM's topk_softmax / topk_sigmoid kernels.

    scores = softmax or sigmoid(gating_output)      # [T, E] fp32, non-finite -> 0
    topk_ids = the K best experts by score          # [T, K] descending, ties to lowest id
    topk_weights = scores[topk_ids] (/ their sum)   # [T, K] fp32 (the sum only if > 0)
    token_expert_indices[t, k] = k * T + t          # [T, K] the slot's row in a slot-major layout

    Returns (topk_weights f32, topk_ids int32 (or indices_type), token_expert_indices int32).
    """
    _check_scoring_func(scoring_func)
    num_tokens, _, topk = _check_logits(hidden_states, gating_output, topk)
    scores = topk_scores(gating_output, scoring_func)                 # [T, E]
    topk_ids = topk_indices(scores, topk)                             # [T, K]
    topk_weights = np.take_along_axis(scores, topk_ids, axis=-1)      # [T, K]
    if renormalize:
        topk_weights = _renormalize(topk_weights)
    token_expert_indices = (np.arange(topk, dtype=np.int32)[None, :] * num_tokens
                            + np.arange(num_tokens, dtype=np.int32)[:, None])
    return (topk_weights.astype(np.float32), topk_ids.astype(indices_type or np.int32),
            token_expert_indices.astype(np.int32))


def fused_topk_bias(hidden_states, gating_output, scoring_func, e_score_correction_bias, topk,
                    renormalize, indices_type=None, routed_scaling_factor=1.0):
    """Routing whose choice is steered by a per-expert bias (vLLM's fused_topk_bias: the
    topk_softmax / topk_sigmoid / topk_softplus_sqrt kernels with a bias).

    scores = softmax, sigmoid or sqrt(softplus(gating_output)), non-finite -> 0;
    topk_ids = top-K of (scores + bias) (of scores when the bias is None);
    topk_weights = scores[topk_ids], renormalized if asked, then * routed_scaling_factor.
    """
    _check_scoring_func(scoring_func, BIAS_SCORING_FUNCS)
    _, num_experts, topk = _check_logits(hidden_states, gating_output, topk)
    scores = topk_scores(gating_output, scoring_func)                 # [T, E]
    choice = scores
    if e_score_correction_bias is not None:
        choice = scores + _check_bias(e_score_correction_bias, num_experts)[None, :]
    topk_ids = topk_indices(choice, topk)                             # [T, K]
    topk_weights = np.take_along_axis(scores, topk_ids, axis=-1)
    if renormalize:
        topk_weights = _renormalize(topk_weights)
    topk_weights = topk_weights * np.float32(routed_scaling_factor)
    return topk_weights.astype(np.float32), topk_ids.astype(indices_type or np.int32)


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
    """DeepSeek-V2/V3 group-limited routing (vLLM's grouped_topk and its fused kernel).

    scores, valid = grouped_scores(gating_output)          # [T, E] fp32 (softmax rounded to
                                                           # the logits' dtype), finite inputs
    choice = scores + bias (or scores), -inf where invalid # what selection sees
    group score = max of the group's choices (no bias), or the sum of its two best
                  (with a bias)                            # [T, G], groups of E/G experts
    keep the topk_group best groups; other experts -> -inf; topk_ids = top-K of choice
    topk_weights = scores[topk_ids] (unbiased; 0 for an invalid expert), renormalized if
                   asked, * routed_scaling_factor; a token with no valid expert among its K
                   gets 1/K each when renormalizing, else 0
    """
    _, num_experts, topk = _check_logits(hidden_states, gating_output, topk)
    num_expert_group, topk_group, per_group = check_grouped_topk_args(
        num_experts, topk, scoring_func, num_expert_group, topk_group)

    scores, valid = grouped_scores(gating_output, scoring_func)          # [T, E]
    num_tokens = scores.shape[0]
    choice = scores
    if e_score_correction_bias is not None:
        choice = scores + _check_bias(e_score_correction_bias, num_experts)[None, :]
    choice = np.where(valid, choice, -np.inf).astype(np.float32)
    grouped = choice.reshape(num_tokens, num_expert_group, per_group)    # [T, G, E/G]
    if e_score_correction_bias is not None:
        best_two = topk_indices(grouped, min(2, per_group))
        group_scores = np.take_along_axis(grouped, best_two, axis=-1).sum(axis=-1)
    else:
        # a NaN choice (a NaN bias) ranks as -inf here too: it must not knock its group out
        group_scores = np.where(np.isnan(grouped), -np.inf, grouped).max(axis=-1)

    kept_groups = topk_indices(group_scores, topk_group)                 # [T, topk_group]
    group_mask = np.zeros((num_tokens, num_expert_group), dtype=bool)
    np.put_along_axis(group_mask, kept_groups, True, axis=-1)
    expert_mask = np.repeat(group_mask, per_group, axis=-1)              # [T, E]
    masked_choice = np.where(expert_mask, choice, -np.inf)

    topk_ids = topk_indices(masked_choice, topk)                         # [T, K]
    chosen_valid = np.take_along_axis(valid, topk_ids, axis=-1)          # [T, K]
    topk_weights = np.where(chosen_valid, np.take_along_axis(scores, topk_ids, axis=-1),
                            np.float32(0.0))
    if renormalize:
        topk_weights = _renormalize(topk_weights)
    topk_weights = topk_weights * np.float32(routed_scaling_factor)
    none_valid = ~chosen_valid.any(axis=-1)                              # [T]
    if none_valid.any():
        topk_weights[none_valid] = np.float32(1.0 / topk) if renormalize else np.float32(0.0)
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
    """vLLM's FusedMoE routing: pick the routing function, return
    (topk_weights [T, K] f32, topk_ids [T, K] int32, zero_expert_result [T, H] or None).

    Dispatch, in the order of vLLM's router factory: grouped_topk if use_grouped_topk; the
    custom function if one is given; fused_topk_bias (softmax, sigmoid or sqrtsoftplus
    scores) if a correction bias is given; else fused_topk (softmax or sigmoid: sqrtsoftplus
    without a bias is a ValueError, as vLLM's fused_topk refuses it). routed_scaling_factor
    applies to grouped_topk and fused_topk_bias only (vLLM's FusedTopKRouter takes none).
    `ops` supplies fused_topk / fused_topk_bias / grouped_topk from another backend, and
    optionally the array handling of the tail (call_custom_routing, ids_astype, copy,
    zero_experts_compute; see _REFERENCE_OPS): the dispatch logic is shared.

    With global_num_experts given, router_logits must have global_num_experts +
    zero_expert_num columns (ValueError naming router_logits): a narrower router would
    otherwise route silently to the first experts only. Every backend's select_experts comes
    through here, so the check is the same everywhere; the routing functions themselves
    take no number of experts (vLLM's signatures) and check only a correction bias' width.
    """
    ops = ops or _REFERENCE_OPS

    def tail(name):   # the array handling: the backend's if it has one, else NumPy's
        return getattr(ops, name, getattr(_REFERENCE_OPS, name))

    check_scoring_route(scoring_func, use_grouped_topk, custom_routing_function is not None,
                        e_score_correction_bias is not None)
    check_router_width("router_logits", router_logits, global_num_experts, zero_expert_num)
    if use_grouped_topk:
        if topk_group is None or num_expert_group is None:
            raise ValueError("use_grouped_topk: expected topk_group and num_expert_group, "
                             f"got topk_group={topk_group}, num_expert_group={num_expert_group}")
        topk_weights, topk_ids = ops.grouped_topk(
            hidden_states, router_logits, top_k, renormalize,
            num_expert_group=num_expert_group, topk_group=topk_group,
            scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor,
            e_score_correction_bias=e_score_correction_bias)
    elif custom_routing_function is not None:
        topk_weights, topk_ids = tail("call_custom_routing")(
            custom_routing_function, hidden_states, router_logits, top_k, renormalize)
    elif e_score_correction_bias is not None:
        topk_weights, topk_ids = ops.fused_topk_bias(
            hidden_states, router_logits, scoring_func, e_score_correction_bias, top_k,
            renormalize, routed_scaling_factor=routed_scaling_factor)
    else:
        topk_weights, topk_ids, _ = ops.fused_topk(hidden_states, router_logits, top_k,
                                                   renormalize, scoring_func=scoring_func)
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
