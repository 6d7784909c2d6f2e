"""Routing in torch: softmax / sigmoid (/ sqrt-softplus) scores, optional bias and expert
groups, top-k.

    T = tokens, E = experts, K = top-k, G = expert groups (num_expert_group)

    fused_topk(hidden_states, gating_output, topk, renormalize, indices_type=None,
               scoring_func="softmax")   -> topk_weights f32 [T, K], topk_ids int32 [T, K],
                                            token_expert_indices int32 [T, K]
    fused_topk_bias(hidden_states, gating_output, scoring_func, e_score_correction_bias, topk,
                    renormalize, indices_type=None, routed_scaling_factor=1.0)
    grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0,
                 topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0,
                 e_score_correction_bias=None)
    select_experts(...)   vLLM's dispatcher: reference.routing.select_experts with ops = these
                          functions and their tensor handling (zero_experts_compute, ...)

The math is the reference's (reference/routing.py), written with torch's own operations: a
softmax spelled out (the NaN and inf rules), a stable descending sort for top-k (ties to the
lowest id, NaN as -inf). Only what is not math comes from the reference: select_experts'
dispatch and grouped_topk's argument checks.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from reference.routing import (
    BIAS_SCORING_FUNCS,
    SCORING_FUNCS,
    SOFTPLUS_THRESHOLD,
    check_grouped_topk_args,
)
from reference.routing import select_experts as _reference_select_experts

from ._tensors import (
    as_tensor,
    check_float,
    compute_dtype,
    index_dtype,
    positive_int,
    to_device,
    to_host,
)


def _softmax(logits):
    """exp(x - max) / sum in fp32, written out (not torch.softmax) so that the NaN and inf
    rules are the reference's: NaN anywhere in a row, +inf, or an all -inf row -> NaN row."""
    import torch

    x = logits.float()
    m = x.max(dim=-1, keepdim=True).values if x.shape[-1] else x
    e = torch.exp(x - m)
    return e / e.sum(dim=-1, keepdim=True)


def _sigmoid(logits):
    import torch

    return torch.sigmoid(logits.float())


def _sqrt_softplus(logits):
    """sqrt(softplus(x)) in fp32, softplus = log(1 + exp(x)), or x above 20 (reference's
    sqrt_softplus; written out, not F.softplus, whose log1p rounds differently)."""
    import torch

    x = logits.float()
    return torch.sqrt(torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log(1.0 + torch.exp(x))))


_SCORE_OF = {"softmax": _softmax, "sigmoid": _sigmoid, "sqrtsoftplus": _sqrt_softplus}


def _topk_indices(scores, k):
    """k best columns per row, descending, ties to the lowest index, NaN as -inf: a stable
    descending sort keeps equal keys in index order."""
    import torch

    key = torch.where(torch.isnan(scores), torch.full_like(scores, -math.inf), scores)
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]


def _renormalize(w):
    import torch

    total = w.sum(dim=-1, keepdim=True)
    pos = total > 0
    return torch.where(pos, w / torch.where(pos, total, torch.ones_like(total)), w)


def _check_logits(hidden_states, gating_output, topk):
    check_float("gating_output", gating_output, ndim=2)
    t, e = gating_output.shape
    if hidden_states is not None:
        check_float("hidden_states", hidden_states, ndim=2)
        if hidden_states.shape[0] != t:
            raise ValueError(f"hidden_states: expected {t} rows to match gating_output, "
                             f"got shape {tuple(hidden_states.shape)}")
    topk = positive_int("topk", topk)
    if topk > e:
        raise ValueError(f"topk: expected at most the number of experts ({e}), got {topk}")
    return t, e, topk


def _scoring_func(scoring_func, choices=SCORING_FUNCS):
    if not isinstance(scoring_func, str):
        raise TypeError(f"scoring_func: expected one of {sorted(choices)}, "
                        f"got {type(scoring_func).__name__}")
    if scoring_func not in choices:
        raise ValueError(f"scoring_func: expected one of {sorted(choices)}, "
                         f"got {scoring_func!r}")
    return scoring_func


def _topk_scores(logits, scoring_func):
    """vLLM's topk_softmax / topk_sigmoid / topk_softplus_sqrt scores: fp32, a non-finite
    score replaced by 0."""
    import torch

    scores = _SCORE_OF[scoring_func](logits)
    return torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores))


def _grouped_scores(logits, scoring_func):
    """grouped_topk's scores and valid mask: softmax computed in fp32 and rounded to the
    logits' dtype (valid where finite), sigmoid in fp32 (valid where the logit is finite);
    invalid experts score 0."""
    import torch

    if scoring_func == "softmax":
        raw = _softmax(logits)
        valid = torch.isfinite(raw)
        raw = raw.to(logits.dtype).float()
    else:
        valid = torch.isfinite(logits.float())
        raw = _sigmoid(logits)
    return torch.where(valid, raw, torch.zeros_like(raw)), valid


def fused_topk(hidden_states, gating_output, topk, renormalize, indices_type=None,
               scoring_func="softmax"):
    """vLLM's topk_softmax / topk_sigmoid: scores = softmax or sigmoid(logits) [T, E] fp32
    (non-finite -> 0); ids = K best (descending, ties to the lowest id); weights =
    scores[ids] (/ their sum if renormalize); token_expert_indices[t, k] = k*T + t.
    Returns (f32 [T, K], int32 [T, K], int32 [T, K])."""
    import torch

    _scoring_func(scoring_func)
    hidden_states, gating_output = as_tensor(hidden_states, "hidden_states"), as_tensor(gating_output,
                                                                          "gating_output")
    t, _, topk = _check_logits(hidden_states, gating_output, topk)
    scores = _topk_scores(gating_output, scoring_func)                # [T, E]
    ids = _topk_indices(scores, topk)                                 # [T, K]
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = _renormalize(weights)
    dev = gating_output.device
    tei = (torch.arange(topk, device=dev, dtype=torch.int32)[None, :] * t
           + torch.arange(t, device=dev, dtype=torch.int32)[:, None])
    return weights.float(), ids.to(index_dtype(indices_type)), tei


def fused_topk_bias(hidden_states, gating_output, scoring_func, e_score_correction_bias, topk,
                    renormalize, indices_type=None, routed_scaling_factor=1.0):
    """Experts chosen on scores + bias (scores: softmax, sigmoid or sqrt(softplus),
    non-finite -> 0), weighed by the unbiased scores, renormalized if asked, times
    routed_scaling_factor. Returns (f32 [T, K], int32 [T, K])."""
    _scoring_func(scoring_func, BIAS_SCORING_FUNCS)
    hidden_states, gating_output = as_tensor(hidden_states, "hidden_states"), as_tensor(gating_output,
                                                                          "gating_output")
    _, e, topk = _check_logits(hidden_states, gating_output, topk)
    scores = _topk_scores(gating_output, scoring_func)
    choice = scores
    if e_score_correction_bias is not None:
        bias = as_tensor(e_score_correction_bias, "e_score_correction_bias")
        check_float("e_score_correction_bias", bias, ndim=1)
        if bias.shape[0] != e:
            raise ValueError(f"e_score_correction_bias: expected shape ({e},), "
                             f"got {tuple(bias.shape)}")
        choice = scores + bias.float()[None, :]
    ids = _topk_indices(choice, topk)
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = _renormalize(weights)
    weights = weights * float(routed_scaling_factor)
    return weights.float(), ids.to(index_dtype(indices_type))


def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0,
                 topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0,
                 e_score_correction_bias=None):
    """DeepSeek group-limited routing: scores (softmax rounded to the logits' dtype, or
    sigmoid), an expert with a non-finite scoring input invalid (ranked last, weight 0);
    group score = max of the group's choices (no bias) or sum of its two best biased ones;
    keep the topk_group best groups; top-K of the (biased) masked choices; weights
    unbiased, renormalized if asked, times routed_scaling_factor; a token with no valid
    expert among its K gets 1/K (renormalize) or 0. Returns (f32 [T, K], int32 [T, K])."""
    import torch

    hidden_states, gating_output = as_tensor(hidden_states, "hidden_states"), as_tensor(gating_output,
                                                                          "gating_output")
    _, e, topk = _check_logits(hidden_states, gating_output, topk)
    g, kg, per = check_grouped_topk_args(e, topk, scoring_func, num_expert_group, topk_group)
    scores, valid = _grouped_scores(gating_output, scoring_func)
    t = scores.shape[0]
    neg_inf = torch.full_like(scores, -math.inf)
    choice = scores
    if e_score_correction_bias is not None:
        bias = as_tensor(e_score_correction_bias, "e_score_correction_bias").float()
        if bias.dim() != 1 or bias.shape[0] != e:
            raise ValueError(f"e_score_correction_bias: expected shape ({e},), "
                             f"got {tuple(bias.shape)}")
        choice = scores + bias[None, :]
    choice = torch.where(valid, choice, neg_inf)
    grouped = choice.reshape(t, g, per)                                   # [T, G, E/G]
    if e_score_correction_bias is not None:
        best = _topk_indices(grouped, min(2, per))
        group_scores = grouped.gather(-1, best).sum(-1)                   # [T, G]
    else:
        # NaN as -inf for selection: amax would propagate a NaN into the group score
        key = torch.where(torch.isnan(grouped), torch.full_like(grouped, -math.inf), grouped)
        group_scores = key.amax(-1)
    kept = _topk_indices(group_scores, kg)                                # [T, topk_group]
    group_mask = torch.zeros((t, g), dtype=torch.bool, device=scores.device)
    group_mask.scatter_(1, kept, True)
    expert_mask = group_mask.repeat_interleave(per, dim=1)                # [T, E]
    masked = torch.where(expert_mask, choice, neg_inf)
    ids = _topk_indices(masked, topk)
    chosen_valid = valid.gather(-1, ids)
    weights = torch.where(chosen_valid, scores.gather(-1, ids), torch.zeros_like(ids,
                                                                                 dtype=torch.float32))
    if renormalize:
        weights = _renormalize(weights)
    weights = weights * float(routed_scaling_factor)
    none_valid = ~chosen_valid.any(-1, keepdim=True)
    weights = torch.where(none_valid, torch.full_like(weights, 1.0 / topk if renormalize else 0.0),
                          weights)
    return weights.float(), ids.int()


def zero_experts_compute(topk_ids, topk_weights, num_experts, zero_expert_type, hidden_states):
    """Zero experts ("identity"): result[t] = sum of the weights of slots with id >= E, times
    x[t]; those slots are then pointed at expert 0 with weight 0, in place."""
    if zero_expert_type != "identity":
        raise ValueError(f"zero_expert_type: expected one of ['identity'], "
                         f"got {zero_expert_type!r}")
    import torch

    is_zero = topk_ids >= num_experts
    # where, not a product: a NaN weight of a real expert must not poison the zero result
    scale = torch.where(is_zero, topk_weights.float(), 0.0).sum(-1)       # [T]
    result = hidden_states.to(compute_dtype(hidden_states.dtype)) * scale[:, None].to(
        compute_dtype(hidden_states.dtype))
    topk_ids[is_zero] = 0
    topk_weights[is_zero] = 0.0
    return result.to(hidden_states.dtype)


def _call_custom_routing(fn, hidden_states, router_logits, top_k, renormalize):
    """A custom routing function is user code written against NumPy (the reference's
    convention): it is called with host arrays and its results come back as tensors."""
    w_np, ids_np = fn(hidden_states=to_host(hidden_states), gating_output=to_host(router_logits),
                      topk=top_k, renormalize=renormalize)
    return (to_device(np.asarray(w_np)).to(router_logits.device),
            to_device(np.asarray(ids_np)).to(router_logits.device))


# the ops of reference.routing.select_experts: the three routing functions, and the array
# handling of the dispatcher's tail done on tensors
_TAIL = ("call_custom_routing", "ids_astype", "copy", "zero_experts_compute")
_OPS = SimpleNamespace(fused_topk=fused_topk, fused_topk_bias=fused_topk_bias,
                       grouped_topk=grouped_topk, call_custom_routing=_call_custom_routing,
                       ids_astype=lambda ids, indices_type: ids.to(index_dtype(indices_type)),
                       copy=lambda t: t.clone(), zero_experts_compute=zero_experts_compute)


def _with_torch_tail(ops):
    """A caller's ops, with this module's tensor handling for whatever of the tail it lacks."""
    merged = SimpleNamespace(**{name: getattr(_OPS, name) for name in _TAIL})
    for name in ("fused_topk", "fused_topk_bias", "grouped_topk") + _TAIL:
        if hasattr(ops, name):
            setattr(merged, name, getattr(ops, name))
    return merged


def select_experts(hidden_states, router_logits, top_k, use_grouped_topk, renormalize,
                   topk_group=None, num_expert_group=None, custom_routing_function=None,
                   scoring_func="softmax", routed_scaling_factor=1.0,
                   e_score_correction_bias=None, indices_type=None, global_num_experts=None,
                   zero_expert_num=0, zero_expert_type=None, ops=None):
    """vLLM's dispatcher, in its router factory's order: grouped_topk; the custom function;
    fused_topk_bias when a correction bias is given; else fused_topk (softmax or sigmoid
    scores). The dispatch is the reference's (reference.routing.select_experts) with
    ops = this module's routing functions and tensor handling, as the CuPy and Numba
    backends do: the routing math stays this module's own. A custom routing function is
    user code written against NumPy: it is called with host NumPy arrays and its results
    come back as tensors. Returns (topk_weights f32 [T, K], topk_ids int32 [T, K],
    zero_expert_result [T, H] or None)."""
    return _reference_select_experts(
        as_tensor(hidden_states, "hidden_states"), as_tensor(router_logits, "router_logits"), top_k,
        use_grouped_topk, renormalize, topk_group=topk_group, num_expert_group=num_expert_group,
        custom_routing_function=custom_routing_function, scoring_func=scoring_func,
        routed_scaling_factor=routed_scaling_factor,
        e_score_correction_bias=e_score_correction_bias, indices_type=indices_type,
        global_num_experts=global_num_experts, zero_expert_num=zero_expert_num,
        zero_expert_type=zero_expert_type, ops=_OPS if ops is None else _with_torch_tail(ops))
