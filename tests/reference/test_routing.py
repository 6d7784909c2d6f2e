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
from tests.oracles import (
    BF16,
    assert_close,
    fused_experts_loop,
    llama4_loop,
    moe_weights,
    rng_for,
    route_loop,
    torch_route,
    zero_experts_loop,
    non_finite_group_logits,
)

from reference import (
    fused_experts,
    fused_topk,
    fused_topk_bias,
    grouped_topk,
    llama4_custom_routing_function,
    select_experts,
)
from reference.routing import sqrt_softplus

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
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
def test_fused_topk_matches_loop(dtype, num_tokens, num_experts, topk, renormalize,
                                 scoring_func):
    rng = rng_for("fused_topk", np.dtype(dtype).name, num_tokens, num_experts, topk, renormalize,
                  scoring_func)
    logits = logits_for(rng, num_tokens, num_experts, dtype)
    weights, ids, token_expert_indices = fused_topk(
        hidden_for(rng, num_tokens, dtype=dtype), logits, topk, renormalize,
        scoring_func=scoring_func)
    want_w, want_ids = route_loop(logits, topk, renormalize, scoring_func)
    check_route(weights, ids, want_w, want_ids)
    # the slot's row in a slot-major layout: k * T + t
    assert token_expert_indices.dtype == np.int32
    for t, k in itertools.product(range(num_tokens), range(topk)):
        assert token_expert_indices[t, k] == k * num_tokens + t
    if renormalize:
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)


def test_fused_topk_sigmoid_scores_each_expert_alone():
    # vLLM's fused_topk(scoring_func="sigmoid") (topk_sigmoid): an expert's weight is
    # sigmoid(its logit), whatever the rest of the row; renormalize divides by the K's sum
    logits = np.array([[2.0, -1.0, 0.5, 3.0]], np.float32)
    weights, ids, _ = fused_topk(None, logits, 2, False, scoring_func="sigmoid")
    assert ids.tolist() == [[3, 0]]
    np.testing.assert_allclose(weights[0], 1 / (1 + np.exp(-np.array([3.0, 2.0]))), rtol=1e-6)
    weights, _, _ = fused_topk(None, logits, 2, True, scoring_func="sigmoid")
    np.testing.assert_allclose(weights.sum(), 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="scoring_func"):
        fused_topk(None, logits, 2, False, scoring_func="softplus")


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
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_fused_topk_bias_matches_loop(num_tokens, num_experts, topk, renormalize,
                                      routed_scaling_factor, scoring_func):
    rng = rng_for("bias", num_tokens, num_experts, topk, renormalize, routed_scaling_factor,
                  scoring_func)
    logits = logits_for(rng, num_tokens, num_experts)
    # a bias on the scale of the scores (~1/E for softmax), so that it really changes the choice
    scale = 2.0 / num_experts if scoring_func == "softmax" else 0.2
    bias = (rng.standard_normal(num_experts) * scale).astype(np.float32)
    weights, ids = fused_topk_bias(hidden_for(rng, num_tokens), logits, scoring_func, bias, topk,
                                   renormalize, routed_scaling_factor=routed_scaling_factor)
    want_w, want_ids = route_loop(logits, topk, renormalize, scoring_func, bias=bias,
                                  routed_scaling_factor=routed_scaling_factor)
    check_route(weights, ids, want_w, want_ids)


def test_fused_topk_bias_chooses_on_bias_weighs_unbiased():
    # E=4 logits favour expert 0; a large bias on expert 3 makes it win the choice, but
    # its weight stays its unbiased softmax score.
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    bias = np.array([0.0, 0.0, 0.0, 10.0], np.float32)
    weights, ids = fused_topk_bias(None, logits, "softmax", bias, 1, False)
    assert ids.tolist() == [[3]]
    scores = np.exp(logits[0].astype(np.float64)) / np.exp(logits[0].astype(np.float64)).sum()
    np.testing.assert_allclose(weights[0, 0], scores[3], rtol=1e-6)


def test_sqrt_softplus_scores():
    # DeepSeek-V4: sqrt(log(1 + exp(x))), x itself above 20; -inf scores 0, NaN stays NaN
    x = np.array([[-np.inf, -30.0, -1.0, 0.0, 1.5, 19.0, 21.0, 80.0, np.nan]], np.float32)
    want = [0.0, np.exp(-15.0), *np.sqrt(np.log1p(np.exp([-1.0, 0.0, 1.5, 19.0]))),
            np.sqrt(21.0), np.sqrt(80.0), np.nan]
    got = sqrt_softplus(x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got[0, 2:], want[2:], rtol=2e-7)
    assert got[0, 0] == 0.0 and got[0, 1] < 1e-6 and np.isnan(got[0, -1])
    # in fused_topk_bias a non-finite score weighs 0, as in topk_softmax / topk_sigmoid
    weights, ids = fused_topk_bias(None, x, "sqrtsoftplus", None, 3, False)
    assert ids.tolist() == [[7, 6, 5]]
    np.testing.assert_allclose(weights[0], got[0, [7, 6, 5]])


@pytest.mark.parametrize("route", [
    {"use_grouped_topk": True, "topk_group": 1, "num_expert_group": 2},
    {"use_grouped_topk": False}])
def test_sqrt_softplus_goes_with_a_bias_and_no_groups(route):
    """vLLM's router factory sends sqrtsoftplus only to fused_topk_bias: its fused_topk and
    grouped_topk take softmax or sigmoid."""
    logits = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    route = dict(route)
    with pytest.raises(ValueError, match="scoring_func: (grouped_topk|fused_topk)"):
        select_experts(None, logits, 2, route.pop("use_grouped_topk"), True,
                                 scoring_func="sqrtsoftplus", **route)
    with pytest.raises(ValueError, match="scoring_func"):
        fused_topk(None, logits, 2, True, scoring_func="sqrtsoftplus")
    bias = np.zeros(8, np.float32)
    weights, ids, _ = select_experts(None, logits, 2, False, True,
                                               scoring_func="sqrtsoftplus",
                                               routed_scaling_factor=1.5,
                                               e_score_correction_bias=bias)
    want = fused_topk_bias(None, logits, "sqrtsoftplus", bias, 2, True,
                           routed_scaling_factor=1.5)
    np.testing.assert_array_equal(ids, want[1])
    np.testing.assert_array_equal(weights, want[0])


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
    "fused_topk_sigmoid": lambda g, k: fused_topk(None, g, k, False, scoring_func="sigmoid")[:2],
    "fused_topk_bias": lambda g, k: fused_topk_bias(None, g, "softmax",
                                                    np.zeros(g.shape[1], np.float32), k, False),
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


NAN_LOGITS = np.array([[np.nan, 1.0, 2.0, 0.5],        # a NaN logit
                       [np.nan, -np.inf, 1.0, 1.0],    # NaN and -inf
                       [1.0, 0.0, -1.0, 2.0]], np.float32)
# fused_topk / fused_topk_bias (vLLM's topk_softmax / topk_sigmoid): a non-finite score is 0.
#   softmax: a NaN makes the whole row NaN, so all zeros: ids 0, 1, 2, weights 0.
#   sigmoid: only the NaN expert scores 0 (sigmoid(-inf) = 0 too).
# grouped_topk (vLLM's fused grouped top-k): an expert with a non-finite scoring input is
#   invalid, ranked after every valid one (ties to the lowest id), weight 0.
#   softmax: a NaN row has no valid expert: ids 0, 1, 2, weights 0 (1/K with renormalize).
#   sigmoid: the NaN and -inf experts are invalid, the others rank as usual.
# Llama 4 ranks raw logits with NaN as -inf.
NAN_IDS = {
    "fused_topk": [[0, 1, 2], [0, 1, 2], [3, 0, 1]],
    "fused_topk_sigmoid": [[2, 1, 3], [2, 3, 0], [3, 0, 1]],
    "fused_topk_bias": [[0, 1, 2], [0, 1, 2], [3, 0, 1]],
    "grouped_softmax": [[0, 1, 2], [0, 1, 2], [3, 0, 1]],
    "grouped_sigmoid": [[2, 1, 3], [2, 3, 0], [3, 0, 1]],
    "llama4": [[2, 1, 3], [2, 3, 0], [3, 0, 1]],
}


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_non_finite_logits_give_defined_ids_and_weights(router):
    weights, ids = ROUTERS[router](NAN_LOGITS, 3)
    assert ids.tolist() == NAN_IDS[router]
    assert np.isfinite(weights).all() or router == "llama4"
    if router in ("fused_topk", "fused_topk_bias", "grouped_softmax"):
        assert (weights[:2] == 0).all()                  # the NaN softmax rows weigh nothing
    if router in ("fused_topk_sigmoid", "grouped_sigmoid"):
        picked = np.take_along_axis(NAN_LOGITS, ids.astype(np.int64), axis=1)
        assert (weights[~np.isfinite(picked)] == 0).all()
        assert (weights[np.isfinite(picked)] > 0).all()


def test_softmax_non_finite_rows_are_zero_and_confined_to_themselves():
    # vLLM's topk_softmax clamps a non-finite softmax score to 0 (the fix for duplicate ids
    # on CUDA-graph padding rows): a NaN logit, an all -inf row or a +inf logit zero the row
    rng = rng_for("nan rows")
    logits = logits_for(rng, 6, 16)
    logits[1, 5] = np.nan
    logits[3] = -np.inf                                  # all -inf: softmax 0/0
    logits[4, 2] = np.inf                                # +inf maximum: inf - inf
    for renormalize in (False, True):
        weights, ids, _ = fused_topk(None, logits, 4, renormalize)
        for t in (1, 3, 4):
            assert (weights[t] == 0).all(), f"row {t} should weigh nothing"
            assert ids[t].tolist() == [0, 1, 2, 3]
        clean = [0, 2, 5]
        w_clean, ids_clean, _ = fused_topk(None, logits[clean], 4, renormalize)
        np.testing.assert_array_equal(weights[clean], w_clean)
        np.testing.assert_array_equal(ids[clean], ids_clean)
        want_w, want_ids = route_loop(logits, 4, renormalize)
        np.testing.assert_array_equal(ids, want_ids)
        assert_close(weights, want_w, np.float32, what="topk_weights")


def test_minus_inf_experts_get_zero_weight_and_come_last():
    logits = np.array([[-np.inf, 1.0, 2.0, -np.inf]], np.float32)
    weights, ids, _ = fused_topk(None, logits, 3, False)
    assert ids.tolist() == [[2, 1, 0]]
    np.testing.assert_allclose(weights[0], [np.exp(1) / (1 + np.exp(1)), 1 / (1 + np.exp(1)), 0.0],
                               rtol=1e-6)


@pytest.mark.parametrize("num_experts", [512, 896, 1024])
@pytest.mark.parametrize("num_finite", [0, 15])
@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_topk_single_group_non_finite_scores(num_experts, num_finite, renormalize):
    """vLLM's test_grouped_topk_single_group_nonfinite_scores: NaN logits but for the first
    num_finite (0, 1, ..., num_finite - 1), then one +inf and one -inf; sigmoid, one group,
    zero bias, top-16, routed_scaling_factor 2.5. The finite experts come first (descending),
    then the lowest invalid id, at weight 0; with no finite logit at all the ids are 0..15 and
    the weights 1/16 (renormalize, unscaled) or 0."""
    logits = non_finite_group_logits(num_experts, num_finite)
    bias = np.zeros(num_experts, np.float32)
    weights, ids = grouped_topk(None, logits, 16, renormalize, 1, 1, "sigmoid", 2.5, bias)
    if num_finite == 0:
        assert ids.tolist() == [list(range(16))]
        np.testing.assert_array_equal(weights, np.full((1, 16), 1 / 16 if renormalize else 0.0,
                                                       np.float32))
    else:
        assert ids.tolist() == [list(range(num_finite - 1, -1, -1)) + [num_finite]]
        finite = 1 / (1 + np.exp(-np.arange(num_finite - 1, -1, -1, dtype=np.float64)))
        if renormalize:
            finite = finite / finite.sum()
        want = np.concatenate([finite * 2.5, [0.0]])[None]
        np.testing.assert_allclose(weights, want, atol=2e-5, rtol=0)
    want_w, want_ids = route_loop(logits, 16, renormalize, "sigmoid", bias, 1, 1, 2.5,
                                  kernel="grouped")
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, atol=2e-5, rtol=0)


@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_topk_softmax_no_valid_expert(renormalize):
    logits = np.array([[1.0, np.nan, 0.0, 2.0], [0.5, 1.5, -1.0, 0.0]], np.float32)
    weights, ids = grouped_topk(None, logits, 2, renormalize, num_expert_group=2, topk_group=1,
                                routed_scaling_factor=2.5)
    assert ids[0].tolist() == [0, 1]
    assert (weights[0] == (0.5 if renormalize else 0.0)).all()
    want_w, want_ids = route_loop(logits, 2, renormalize, "softmax", None, 2, 1, 2.5)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=1e-6)


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
# grouped_topk's precision: the softmax in the logits' dtype (vLLM's single-group tiers test)
# --------------------------------------------------------------------------------------------

def _single_group_reference(logits, bias, topk, scoring_func, renormalize, factor):
    """vLLM's _single_group_reference (tests/kernels/moe/test_grouped_topk.py), in NumPy:
    sigmoid in fp32 from the logits; softmax *in the logits' dtype* (torch.softmax on bf16
    returns bf16), upcast after; argsort of scores + bias, stable; renormalize; scale."""
    if scoring_func == "sigmoid":
        scores = 0.5 * np.tanh(0.5 * logits.astype(np.float32)) + 0.5
    else:
        x = logits.astype(np.float64)
        e = np.exp(x - x.max(-1, keepdims=True))
        scores = (e / e.sum(-1, keepdims=True)).astype(logits.dtype).astype(np.float32)
    ids = np.argsort(-(scores + bias.astype(np.float32)), axis=-1, kind="stable")[:, :topk]
    values = np.take_along_axis(scores, ids, -1).astype(np.float64)
    if renormalize:
        values /= values.sum(-1, keepdims=True) + 1e-20
    return values * factor, ids


@pytest.mark.parametrize("num_experts, topk, dtype",
                         [(512, 9, BF16), (512, 16, np.float16), (513, 9, np.float32),
                          (513, 16, BF16), (897, 16, np.float16), (1024, 16, BF16)],
                         ids=lambda v: np.dtype(v).name if not isinstance(v, int) else str(v))
@pytest.mark.parametrize("scoring_func, renormalize, factor",
                         [("sigmoid", True, 1.0), ("sigmoid", False, 2.5),
                          ("softmax", True, 2.5), ("softmax", False, 1.0)])
def test_grouped_topk_single_group_tiers_at_vllms_tolerance(num_experts, topk, dtype,
                                                            scoring_func, renormalize, factor):
    """vLLM's test_grouped_topk_single_group_tiers: ids exact, weights within atol 2e-5 of
    its reference, which computes a softmax in the logits' dtype. An fp32 softmax of bf16
    logits is ~1e-3 away from that (the bf16 rounding); the engine mode rounds as vLLM does."""
    rng = rng_for("single group tiers", num_experts, topk, np.dtype(dtype).name, scoring_func)
    logits = rng.standard_normal((17, num_experts)).astype(dtype)
    bias = rng.standard_normal(num_experts).astype(np.float32)
    want_w, want_ids = _single_group_reference(logits, bias, topk, scoring_func, renormalize,
                                               factor)
    weights, ids = grouped_topk(None, logits, topk, renormalize, 1, 1, scoring_func, factor,
                                bias)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, atol=2e-5, rtol=0)


def test_grouped_topk_softmax_is_rounded_to_the_logits_dtype():
    rng = rng_for("grouped softmax dtype")
    logits = rng.standard_normal((8, 64)).astype(BF16)
    w16, _ = grouped_topk(None, logits, 4, False, 8, 2, "softmax")
    w32, _ = grouped_topk(None, logits.astype(np.float32), 4, False, 8, 2, "softmax")
    np.testing.assert_array_equal(w16, w16.astype(BF16).astype(np.float32))  # bf16 values
    assert not np.array_equal(w16, w32)
    # fused_topk (vLLM's topk_softmax kernel) stays fp32 for bf16 logits
    f16, _, _ = fused_topk(None, logits, 4, False)
    f32, _, _ = fused_topk(None, logits.astype(np.float32), 4, False)
    np.testing.assert_array_equal(f16, f32)


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
    # sigmoid without groups: fused_topk(scoring_func="sigmoid"), as vLLM's router factory
    w, ids, _ = select_experts(x, logits, topk, False, True, scoring_func="sigmoid")
    check_route(w, ids, *route_loop(logits, topk, True, "sigmoid"))
    w, ids, _ = select_experts(x, logits, topk, False, True, scoring_func="sigmoid",
                               e_score_correction_bias=bias, routed_scaling_factor=2.5)
    check_route(w, ids, *route_loop(logits, topk, True, "sigmoid", bias,
                                    routed_scaling_factor=2.5))
    # a custom routing function comes before the bias (vLLM's router factory)
    w, ids, _ = select_experts(x, logits, 1, False, False, e_score_correction_bias=bias,
                               custom_routing_function=llama4_custom_routing_function)
    check_route(w, ids, *llama4_loop(logits, 1))
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
    select_experts(None, logits, 2, False, True, scoring_func="sigmoid", ops=ops)
    assert calls == ["fused_topk", "fused_topk_bias", "grouped_topk", "fused_topk"]


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
