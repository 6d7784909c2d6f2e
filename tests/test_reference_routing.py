"""Routing (`reference/routing.py`) against the loop-per-token oracle and torch.

    T = tokens, E = experts, K = top-k, G = expert groups

Ids must match exactly; weights are fp32 routing math, compared against the fp64 oracle
at the fp32 tolerance. Logits are random normals (seeded per parameter set): distinct fp32
logits give scores far apart relative to fp32 rounding, so the fp64 oracle ranks them the
same way; exact ties are tested on purpose with exactly equal logits.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from oracles import (
    BF16,
    assert_close,
    fused_experts_loop,
    llama4_loop,
    moe_weights,
    rng_for,
    route_loop,
    torch_route,
    zero_experts_loop,
)

from reference import (
    fused_experts,
    fused_topk,
    fused_topk_bias,
    grouped_topk,
    llama4_custom_routing_function,
    select_experts,
)

DTYPES = [np.float32, BF16, np.float16, np.float64]


def logits_for(rng, num_tokens, num_experts, dtype=np.float32, scale=1.0):
    return (rng.standard_normal((num_tokens, num_experts)) * scale).astype(dtype)


def hidden_for(rng, num_tokens, hidden=16, dtype=np.float32):
    return rng.standard_normal((num_tokens, hidden)).astype(dtype)


def check_route(weights, ids, want_weights, want_ids):
    """Ids exactly, weights at the fp32 tolerance (routing is fp32 whatever the logits)."""
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(ids, want_ids, err_msg="topk_ids")
    assert_close(weights, want_weights, np.float32, what="topk_weights")


# --------------------------------------------------------------------------------------------
# fused_topk
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("num_experts", [8, 60, 128])
@pytest.mark.parametrize("topk", [1, 2, 6])
@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_topk_matches_loop(dtype, num_tokens, num_experts, topk, renormalize):
    rng = rng_for("fused_topk", np.dtype(dtype).name, num_tokens, num_experts, topk, renormalize)
    logits = logits_for(rng, num_tokens, num_experts, dtype)
    weights, ids, token_expert_indices = fused_topk(
        hidden_for(rng, num_tokens, dtype=dtype), logits, topk, renormalize)
    want_w, want_ids = route_loop(logits, topk, renormalize)
    check_route(weights, ids, want_w, want_ids)
    # the slot's row in a slot-major layout: k * T + t
    assert token_expert_indices.dtype == np.int32
    for t, k in itertools.product(range(num_tokens), range(topk)):
        assert token_expert_indices[t, k] == k * num_tokens + t
    if renormalize:
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)


def test_fused_topk_indices_type():
    rng = rng_for("indices_type")
    logits = logits_for(rng, 5, 16)
    _, ids, _ = fused_topk(None, logits, 3, False, indices_type=np.int64)
    assert ids.dtype == np.int64
    np.testing.assert_array_equal(ids, route_loop(logits, 3)[1])


@pytest.mark.parametrize("num_experts, topk", [(8, 2), (64, 6), (256, 8)])
def test_fused_topk_matches_torch(num_experts, topk):
    pytest.importorskip("torch")
    rng = rng_for("fused_topk torch", num_experts, topk)
    logits = logits_for(rng, 300, num_experts)
    weights, ids, _ = fused_topk(None, logits, topk, True)
    want_w, want_ids = torch_route(logits, topk, True)
    check_route(weights, ids, want_w, want_ids)


# --------------------------------------------------------------------------------------------
# fused_topk_bias
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("num_experts", [8, 64])
@pytest.mark.parametrize("topk", [1, 2, 6])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("routed_scaling_factor", [1.0, 2.5])
def test_fused_topk_bias_matches_loop(num_tokens, num_experts, topk, renormalize,
                                      routed_scaling_factor):
    rng = rng_for("bias", num_tokens, num_experts, topk, renormalize, routed_scaling_factor)
    logits = logits_for(rng, num_tokens, num_experts)
    # a bias on the scale of the softmax scores (~1/E), so that it really changes the choice
    bias = (rng.standard_normal(num_experts) * 2.0 / num_experts).astype(np.float32)
    weights, ids = fused_topk_bias(hidden_for(rng, num_tokens), logits, bias, topk, renormalize,
                                   routed_scaling_factor=routed_scaling_factor)
    want_w, want_ids = route_loop(logits, topk, renormalize, bias=bias,
                                  routed_scaling_factor=routed_scaling_factor)
    check_route(weights, ids, want_w, want_ids)


def test_fused_topk_bias_chooses_on_bias_weighs_unbiased():
    # E=4 logits favour expert 0; a large bias on expert 3 makes it win the choice, but
    # its weight stays its unbiased softmax score.
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    bias = np.array([0.0, 0.0, 0.0, 10.0], np.float32)
    weights, ids = fused_topk_bias(None, logits, bias, 1, False)
    assert ids.tolist() == [[3]]
    scores = np.exp(logits[0].astype(np.float64)) / np.exp(logits[0].astype(np.float64)).sum()
    np.testing.assert_allclose(weights[0, 0], scores[3], rtol=1e-6)


# --------------------------------------------------------------------------------------------
# grouped_topk: vLLM's grid
# --------------------------------------------------------------------------------------------

GROUPED_GRID = [(16, 2, 8, 2), (128, 2, 8, 2), (256, 8, 8, 4), (384, 8, 1, 1), (512, 22, 1, 1)]


@pytest.mark.parametrize("num_experts, topk, num_expert_group, topk_group", GROUPED_GRID)
@pytest.mark.parametrize("routed_scaling_factor", [1.0, 2.5])
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_topk_matches_loop(num_experts, topk, num_expert_group, topk_group,
                                   routed_scaling_factor, scoring_func, with_bias, renormalize):
    num_tokens = 33
    rng = rng_for("grouped", num_experts, topk, num_expert_group, topk_group,
                  routed_scaling_factor, scoring_func, with_bias, renormalize)
    logits = logits_for(rng, num_tokens, num_experts)
    bias = (rng.standard_normal(num_experts) * 0.1).astype(np.float32) if with_bias else None
    kwargs = {"num_expert_group": num_expert_group, "topk_group": topk_group,
                  "scoring_func": scoring_func, "routed_scaling_factor": routed_scaling_factor}
    weights, ids = grouped_topk(hidden_for(rng, num_tokens), logits, topk, renormalize,
                                e_score_correction_bias=bias, **kwargs)
    want_w, want_ids = route_loop(logits, topk, renormalize, bias=bias, **kwargs)
    check_route(weights, ids, want_w, want_ids)
    # the chosen experts all lie in topk_group groups
    per_group = num_experts // num_expert_group
    for row in ids:
        assert len(set((row // per_group).tolist())) <= topk_group
        assert len(set(row.tolist())) == topk
    if renormalize:
        np.testing.assert_allclose(weights.sum(axis=1), routed_scaling_factor, rtol=1e-5)


@pytest.mark.parametrize("num_experts, topk, num_expert_group, topk_group",
                         [(16, 2, 8, 2), (256, 8, 8, 4)])
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_grouped_topk_matches_torch(num_experts, topk, num_expert_group, topk_group,
                                    scoring_func, with_bias):
    pytest.importorskip("torch")
    rng = rng_for("grouped torch", num_experts, topk, scoring_func, with_bias)
    logits = logits_for(rng, 200, num_experts)
    bias = (rng.standard_normal(num_experts) * 0.1).astype(np.float32) if with_bias else None
    kwargs = {"num_expert_group": num_expert_group, "topk_group": topk_group,
                  "scoring_func": scoring_func, "routed_scaling_factor": 2.5, "bias": bias}
    want_w, want_ids = torch_route(logits, topk, True, **kwargs)
    kwargs["e_score_correction_bias"] = kwargs.pop("bias")
    weights, ids = grouped_topk(None, logits, topk, True, **kwargs)
    check_route(weights, ids, want_w, want_ids)


def test_grouped_topk_group_score_max_without_bias_top2_sum_with_bias():
    # sigmoid, E=8 in G=4 groups of 2, keep 1 group, top-2.
    # group 0 = [3, -3]: max 0.953, top-2 sum 1.000; group 1 = [2, 2]: max 0.881, sum 1.762.
    logits = np.array([[3.0, -3.0, 2.0, 2.0, -5.0, -5.0, -5.0, -5.0]], np.float32)
    kwargs = {"num_expert_group": 4, "topk_group": 1, "scoring_func": "sigmoid"}
    _, ids = grouped_topk(None, logits, 2, False, **kwargs)
    assert ids.tolist() == [[0, 1]]                    # the group with the best single expert
    weights, ids = grouped_topk(None, logits, 2, False,
                                e_score_correction_bias=np.zeros(8, np.float32), **kwargs)
    assert ids.tolist() == [[2, 3]]                    # the group with the best pair (tie: 2 first)
    np.testing.assert_allclose(weights[0], 1 / (1 + np.exp(-2.0)), rtol=1e-6)


def test_grouped_topk_masks_experts_outside_kept_groups():
    # softmax, E=6 in G=3 groups of 2, keep 1 group, top-2. Group 0 has the best expert
    # (5.0), so its partner (0.0) is picked over experts 2 and 3 (4.9, 4.8) of group 1.
    logits = np.array([[5.0, 0.0, 4.9, 4.8, 1.0, 1.0]], np.float32)
    _, ids = grouped_topk(None, logits, 2, False, num_expert_group=3, topk_group=1)
    assert ids.tolist() == [[0, 1]]
    _, ids = grouped_topk(None, logits, 2, False, num_expert_group=3, topk_group=2)
    assert ids.tolist() == [[0, 2]]


# --------------------------------------------------------------------------------------------
# Ties, NaN, Inf: the documented rules.
# --------------------------------------------------------------------------------------------

ROUTERS = {
    "fused_topk": lambda g, k: fused_topk(None, g, k, False)[:2],
    "fused_topk_bias": lambda g, k: fused_topk_bias(None, g, np.zeros(g.shape[1], np.float32), k, False),
    "grouped_softmax": lambda g, k: grouped_topk(None, g, k, False, num_expert_group=1, topk_group=1),
    "grouped_sigmoid": lambda g, k: grouped_topk(None, g, k, False, num_expert_group=1, topk_group=1,
                                                 scoring_func="sigmoid"),
    "llama4": lambda g, k: llama4_custom_routing_function(None, g, k, False),
}


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_ties_go_to_the_lowest_expert_id(router):
    logits = np.array([[1.0, 1.0, 1.0, 1.0, 1.0],
                       [0.0, 3.0, 3.0, 2.0, 3.0],
                       [2.0, 1.0, 2.0, 1.0, 2.0]], np.float32)
    _, ids = ROUTERS[router](logits, 3)
    assert ids.tolist() == [[0, 1, 2], [1, 2, 4], [0, 2, 4]]


NAN_LOGITS = np.array([[np.nan, 1.0, 2.0, 0.5],        # NaN expert never beats a number
                       [np.nan, -np.inf, 1.0, 1.0],    # NaN and -inf rank equal: lowest id first
                       [1.0, 0.0, -1.0, 2.0]], np.float32)
# A softmax row with a NaN is all NaN, so all its experts rank equal: ids 0, 1, 2.
# sigmoid(-inf) = 0 is a number and beats NaN; Llama 4 ranks raw logits, -inf ties NaN.
NAN_IDS = {
    "fused_topk": [[0, 1, 2], [0, 1, 2], [3, 0, 1]],
    "fused_topk_bias": [[0, 1, 2], [0, 1, 2], [3, 0, 1]],
    "grouped_softmax": [[0, 1, 2], [0, 1, 2], [3, 0, 1]],
    "grouped_sigmoid": [[2, 1, 3], [2, 3, 1], [3, 0, 1]],
    "llama4": [[2, 1, 3], [2, 3, 0], [3, 0, 1]],
}


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_nan_counts_as_minus_inf_for_selection(router):
    weights, ids = ROUTERS[router](NAN_LOGITS, 3)
    assert ids.tolist() == NAN_IDS[router]
    assert np.isfinite(weights[2]).all()               # the clean row is untouched
    if router.startswith(("fused", "grouped_softmax")):
        assert np.isnan(weights[:2]).all()
    else:                                              # NaN only where a NaN expert was picked
        picked = np.take_along_axis(NAN_LOGITS, ids.astype(np.int64), axis=1)
        np.testing.assert_array_equal(np.isnan(weights), np.isnan(picked))


def test_softmax_nan_row_has_nan_weights_confined_to_it():
    rng = rng_for("nan rows")
    logits = logits_for(rng, 6, 16)
    logits[1, 5] = np.nan
    logits[3] = -np.inf                                  # all -inf: softmax 0/0
    logits[4, 2] = np.inf                                # +inf maximum: inf - inf
    weights, ids, _ = fused_topk(None, logits, 4, True)
    for t in (1, 3, 4):
        assert np.isnan(weights[t]).all(), f"row {t} should be NaN"
    # every row still has K distinct in-range ids; the all-NaN rows rank all experts equal
    for row in ids:
        assert len(set(row.tolist())) == 4 and row.min() >= 0 and row.max() < 16
    assert ids[3].tolist() == [0, 1, 2, 3] and ids[4].tolist() == [0, 1, 2, 3]
    clean = [0, 2, 5]
    w_clean, ids_clean, _ = fused_topk(None, logits[clean], 4, True)
    np.testing.assert_array_equal(weights[clean], w_clean)
    np.testing.assert_array_equal(ids[clean], ids_clean)
    want_w, want_ids = route_loop(logits, 4, True)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(np.isnan(weights), np.isnan(want_w))


def test_minus_inf_experts_get_zero_weight_and_come_last():
    logits = np.array([[-np.inf, 1.0, 2.0, -np.inf]], np.float32)
    weights, ids, _ = fused_topk(None, logits, 3, False)
    assert ids.tolist() == [[2, 1, 0]]
    np.testing.assert_allclose(weights[0], [np.exp(1) / (1 + np.exp(1)), 1 / (1 + np.exp(1)), 0.0],
                               rtol=1e-6)


def test_sigmoid_nan_poisons_only_its_own_expert():
    logits = np.array([[np.nan, 1.0, 2.0, 0.5, -1.0, 0.0, 3.0, -2.0]], np.float32)
    weights, ids = grouped_topk(None, logits, 3, True, num_expert_group=1, topk_group=1,
                                scoring_func="sigmoid")
    assert ids.tolist() == [[6, 2, 1]]
    assert np.isfinite(weights).all()


def test_grouped_sigmoid_nan_does_not_eliminate_its_group():
    # sigmoid, groups [NaN, 3.0] and [0.0, 0.1], keep 1 group, top-1: expert 1 (0.953).
    logits = np.array([[np.nan, 3.0, 0.0, 0.1]], np.float32)
    _, ids = grouped_topk(None, logits, 1, False, num_expert_group=2, topk_group=1,
                          scoring_func="sigmoid")
    assert ids.tolist() == route_loop(logits, 1, False, "sigmoid", None, 2, 1)[1].tolist() == [[1]]


# --------------------------------------------------------------------------------------------
# Llama 4, select_experts dispatch, zero experts
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("num_experts", [16, 128])
@pytest.mark.parametrize("topk", [1, 2])
def test_llama4_routing_matches_loop(num_tokens, num_experts, topk):
    rng = rng_for("llama4", num_tokens, num_experts, topk)
    logits = logits_for(rng, num_tokens, num_experts, scale=3.0)
    for renormalize in (False, True):                   # renormalize is ignored
        weights, ids = llama4_custom_routing_function(None, logits, topk, renormalize)
        want_w, want_ids = llama4_loop(logits, topk)
        check_route(weights, ids, want_w, want_ids)


def test_select_experts_dispatch():
    rng = rng_for("dispatch")
    num_tokens, num_experts, topk = 9, 16, 4
    x = hidden_for(rng, num_tokens)
    logits = logits_for(rng, num_tokens, num_experts)
    bias = (rng.standard_normal(num_experts) * 0.05).astype(np.float32)

    # default: fused_topk (softmax), no zero-expert result
    w, ids, zero = select_experts(x, logits, topk, False, True)
    assert zero is None
    check_route(w, ids, *route_loop(logits, topk, True))
    # a correction bias: fused_topk_bias, then * routed_scaling_factor
    w, ids, _ = select_experts(x, logits, topk, False, True, e_score_correction_bias=bias,
                               routed_scaling_factor=2.5)
    check_route(w, ids, *route_loop(logits, topk, True, bias=bias, routed_scaling_factor=2.5))
    # grouped (takes precedence over the bias branch)
    w, ids, _ = select_experts(x, logits, topk, True, True, topk_group=2, num_expert_group=4,
                               scoring_func="sigmoid", e_score_correction_bias=bias,
                               routed_scaling_factor=2.5)
    check_route(w, ids, *route_loop(logits, topk, True, "sigmoid", bias, 4, 2, 2.5))
    # a custom routing function (Llama 4)
    w, ids, _ = select_experts(x, logits, 1, False, False,
                               custom_routing_function=llama4_custom_routing_function)
    check_route(w, ids, *llama4_loop(logits, 1))
    # the reference's documented extension: sigmoid without groups = grouped_topk, one group
    # (vLLM's FusedMoE constructor rejects this combination)
    w, ids, _ = select_experts(x, logits, topk, False, True, scoring_func="sigmoid")
    check_route(w, ids, *route_loop(logits, topk, True, "sigmoid"))
    # indices_type
    _, ids, _ = select_experts(x, logits, topk, False, True, indices_type=np.int64)
    assert ids.dtype == np.int64


def test_select_experts_goes_through_ops():
    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    ops = SimpleNamespace(fused_topk=spy("fused_topk", fused_topk),
                          fused_topk_bias=spy("fused_topk_bias", fused_topk_bias),
                          grouped_topk=spy("grouped_topk", grouped_topk))
    rng = rng_for("ops")
    logits = logits_for(rng, 3, 8)
    bias = np.zeros(8, np.float32)
    select_experts(None, logits, 2, False, True, ops=ops)
    select_experts(None, logits, 2, False, True, e_score_correction_bias=bias, ops=ops)
    select_experts(None, logits, 2, True, True, topk_group=1, num_expert_group=2, ops=ops)
    assert calls == ["fused_topk", "fused_topk_bias", "grouped_topk"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, BF16],
                         ids=lambda d: np.dtype(d).name)
def test_zero_experts_identity(dtype):
    rng = rng_for("zero experts", np.dtype(dtype).name)
    num_tokens, num_experts, zero_num, topk, hidden, inter = 11, 8, 2, 4, 32, 24
    x = hidden_for(rng, num_tokens, hidden, dtype)
    logits = logits_for(rng, num_tokens, num_experts + zero_num)
    logits[:, num_experts:] += 1.0                       # zero experts get picked often
    w, ids, zero_result = select_experts(x, logits, topk, False, True, zero_expert_num=zero_num,
                                         zero_expert_type="identity",
                                         global_num_experts=num_experts)
    route_w, route_ids = route_loop(logits, topk, True)
    assert (route_ids >= num_experts).any(), "the draw should route some slots to zero experts"
    want_result, want_ids, want_w = zero_experts_loop(route_ids, route_w, num_experts, x)
    np.testing.assert_array_equal(ids, want_ids)
    assert_close(w, want_w, np.float32, what="topk_weights")
    assert zero_result.dtype == np.dtype(dtype)
    # the routing weights are fp32 by contract, so even an fp64 batch is only fp32-accurate here
    tol_dtype = np.float32 if np.dtype(dtype) == np.float64 else dtype
    assert_close(zero_result, want_result, tol_dtype, what="zero_expert_result")
    assert ids.max() < num_experts

    # the whole layer: routed experts on the rewritten ids plus the identity experts
    w1, w2, _, _ = moe_weights(rng, num_experts, hidden, inter, dtype)
    out = fused_experts(x, w1, w2, w, ids).astype(np.float64) + zero_result.astype(np.float64)
    want = fused_experts_loop(x, w1, w2, want_w, want_ids) + want_result
    assert_close(out, want, tol_dtype)
