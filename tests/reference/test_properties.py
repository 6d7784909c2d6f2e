"""Properties of the reference that hold for every input (hypothesis).

    T = tokens, E = experts, K = top-k, G = expert groups, B = block size, P = T*K slots

Shapes and flags are drawn by hypothesis; the arrays are drawn from a NumPy generator
seeded by hypothesis (fast, and the seed is printed with a failing example). The runs are
derandomized so CI sees the same examples every time; `max_examples` keeps each property
to about a second.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from tests.oracles import (
    assert_close,
    distinct_topk_ids,
    expert_map_loop,
    local_weights,
    moe_weights,
    random_weights,
    uniform,
)

from reference import (
    determine_expert_map,
    fused_experts,
    fused_moe,
    fused_topk,
    fused_topk_bias,
    grouped_topk,
    llama4_custom_routing_function,
    moe_align_block_size,
    moe_permute,
    moe_unpermute,
    select_experts,
)

PROPERTY = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
seeds = st.integers(0, 2**32 - 1)


# --------------------------------------------------------------------------------------------
# Alignment
# --------------------------------------------------------------------------------------------

@st.composite
def alignment_cases(draw):
    num_experts = draw(st.integers(1, 24))
    num_tokens = draw(st.integers(0, 40))
    topk = draw(st.integers(1, 6))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 64]))
    # any ids, repeats allowed (stronger than vLLM's distinct ids per token); sometimes
    # skewed onto a few experts so that many experts get nothing
    hot = draw(st.integers(1, num_experts))
    ids = draw(arrays(np.int32, (num_tokens, topk), elements=st.integers(0, hot - 1)))
    return ids, block_size, num_experts, draw(st.booleans())


@PROPERTY
@given(alignment_cases())
def test_alignment_places_every_slot_once_in_ceil_blocks(case):
    topk_ids, block_size, num_experts, pad_sorted_ids = case
    num_slots = topk_ids.size
    sorted_ids, expert_ids, num_post = moe_align_block_size(
        topk_ids, block_size, num_experts, pad_sorted_ids=pad_sorted_ids)
    n = int(num_post[0])
    counts = np.bincount(topk_ids.ravel(), minlength=num_experts)
    blocks_per_expert = [math.ceil(c / block_size) for c in counts]
    assert n == sum(blocks_per_expert) * block_size
    head = sorted_ids[:n]
    # every (token, slot) pair exactly once; everything else is the padding value P
    assert sorted(head[head < num_slots].tolist()) == list(range(num_slots))
    assert (head[head >= num_slots] == num_slots).all() and (sorted_ids[n:] == num_slots).all()
    # blocks per expert = ceil(count / B), in increasing expert order, -1 after the end
    block_experts = expert_ids[: n // block_size]
    assert np.bincount(block_experts, minlength=num_experts).tolist() == blocks_per_expert
    assert (np.diff(block_experts) >= 0).all()
    assert (expert_ids[n // block_size:] == -1).all()
    # each slot sits in a block of its own expert
    for b, e in enumerate(block_experts):
        block = sorted_ids[b * block_size:(b + 1) * block_size]
        assert (topk_ids.ravel()[block[block < num_slots]] == e).all()


@PROPERTY
@given(alignment_cases(), st.integers(1, 4), st.sampled_from(["linear", "round_robin"]), seeds)
def test_alignment_under_expert_map_ignoring_invalid(case, ep_size, placement, seed):
    topk_ids, block_size, num_experts, _ = case
    ep_size = min(ep_size, num_experts)
    rank = seed % ep_size
    _, expert_map = determine_expert_map(ep_size, rank, num_experts, placement)
    if expert_map is None:
        expert_map = np.arange(num_experts, dtype=np.int32)
    sorted_ids, expert_ids, num_post = moe_align_block_size(
        topk_ids, block_size, num_experts, expert_map=expert_map, ignore_invalid_experts=True)
    n = int(num_post[0])
    local_slots = np.flatnonzero(expert_map[topk_ids.ravel()] >= 0)
    head = sorted_ids[:n]
    assert sorted(head[head < topk_ids.size].tolist()) == local_slots.tolist()
    assert (expert_ids[: n // block_size] >= 0).all()


# --------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------

@st.composite
def grouped_cases(draw):
    num_expert_group = draw(st.sampled_from([1, 2, 4]))
    per_group = draw(st.integers(1, 6))
    num_experts = num_expert_group * per_group
    topk_group = draw(st.integers(1, num_expert_group))
    topk = draw(st.integers(1, topk_group * per_group))
    return num_experts, topk, num_expert_group, topk_group


finite_logits = st.floats(-30, 30, width=32)
any_logits = st.floats(width=32, allow_nan=True, allow_infinity=True)


@PROPERTY
@given(seeds, st.integers(1, 30), grouped_cases(), st.sampled_from(["softmax", "sigmoid"]),
       st.booleans(), st.sampled_from([1.0, 2.5]))
def test_renormalized_weights_sum_to_the_scaling_factor(seed, num_tokens, grouped, scoring_func,
                                                       with_bias, routed_scaling_factor):
    num_experts, topk, num_expert_group, topk_group = grouped
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((num_tokens, num_experts)) * 5).astype(np.float32)
    bias = rng.standard_normal(num_experts).astype(np.float32) if with_bias else None
    weights, _ = grouped_topk(None, logits, topk, True, num_expert_group, topk_group,
                              scoring_func, routed_scaling_factor, bias)
    np.testing.assert_allclose(weights.sum(axis=1), routed_scaling_factor, rtol=1e-5)
    weights, _, _ = fused_topk(None, logits, topk, True, scoring_func=scoring_func)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-5)
    if with_bias:
        weights, _ = fused_topk_bias(None, logits, scoring_func, bias, topk, True,
                                     routed_scaling_factor=routed_scaling_factor)
        np.testing.assert_allclose(weights.sum(axis=1), routed_scaling_factor, rtol=1e-5)


def _check_ids(ids, num_experts, topk):
    assert ids.shape[1] == topk
    assert ((ids >= 0) & (ids < num_experts)).all(), "an id out of range"
    for row in ids:
        assert len(set(row.tolist())) == topk, f"duplicate ids {row}"


@PROPERTY
@given(st.data(), grouped_cases(), st.integers(0, 6), st.sampled_from(["softmax", "sigmoid"]),
       st.booleans())
def test_ids_distinct_and_in_range_with_nan_and_inf(data, grouped, num_tokens, scoring_func,
                                                   with_bias):
    num_experts, topk, num_expert_group, topk_group = grouped
    logits = data.draw(arrays(np.float32, (num_tokens, num_experts), elements=any_logits))
    bias = data.draw(arrays(np.float32, (num_experts,), elements=any_logits)) if with_bias else None
    weights, ids = grouped_topk(None, logits, topk, True, num_expert_group, topk_group,
                                scoring_func, 2.5, bias)
    _check_ids(ids, num_experts, topk)
    if not with_bias:   # a NaN bias is not the kernels' concern: only the logits are
        assert np.isfinite(weights).all()
    weights, ids, _ = fused_topk(None, logits, topk, True, scoring_func=scoring_func)
    _check_ids(ids, num_experts, topk)
    # vLLM's topk kernels: a non-finite score is 0. A softmax row with a NaN, a +inf
    # maximum or nothing but -inf is all zeros (ids 0..K-1); weights are always finite
    assert np.isfinite(weights).all()
    if scoring_func == "softmax":
        with np.errstate(invalid="ignore"):
            poisoned = (np.isnan(logits).any(axis=1) | (logits == np.inf).any(axis=1)
                        | (logits == -np.inf).all(axis=1))
        for t in np.nonzero(poisoned)[0]:
            assert (weights[t] == 0).all() and ids[t].tolist() == list(range(topk))
    if with_bias:
        _, ids = fused_topk_bias(None, logits, scoring_func, bias, topk, False)
        _check_ids(ids, num_experts, topk)
    _, ids = llama4_custom_routing_function(None, logits, topk, False)
    _check_ids(ids, num_experts, topk)


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------

def _group_preserving_permutation(rng, num_experts, num_expert_group):
    """pi[e]: shuffle the groups, then the experts inside each group (grouped_topk's
    selection is invariant only under renamings that keep groups whole)."""
    per_group = num_experts // num_expert_group
    group_order = rng.permutation(num_expert_group)
    pi = np.empty(num_experts, dtype=np.int64)
    for g in range(num_expert_group):
        inside = rng.permutation(per_group)
        pi[g * per_group:(g + 1) * per_group] = group_order[g] * per_group + inside
    return pi


@PROPERTY
@given(seeds, st.integers(1, 12), grouped_cases(), st.sampled_from(["softmax", "sigmoid"]),
       st.booleans(), st.booleans())
def test_renaming_experts_leaves_the_output_unchanged(seed, num_tokens, grouped, scoring_func,
                                                      with_bias, renormalize):
    num_experts, topk, num_expert_group, topk_group = grouped
    rng = np.random.default_rng(seed)
    hidden, inter = 8, 6
    x = uniform(rng, (num_tokens, hidden), 1.0, np.float64)
    w1, w2, b1, b2 = moe_weights(rng, num_experts, hidden, inter, np.float64, bias=True)
    logits = rng.standard_normal((num_tokens, num_experts)).astype(np.float32)
    bias = (rng.standard_normal(num_experts) * 0.1).astype(np.float32) if with_bias else None
    pi = _group_preserving_permutation(rng, num_experts, num_expert_group)
    inv = np.argsort(pi)                                 # renamed expert j was expert inv[j]

    route = {"use_grouped_topk": True, "num_expert_group": num_expert_group, "topk_group": topk_group,
                 "scoring_func": scoring_func}
    renamed_bias = None if bias is None else bias[inv]
    out = fused_moe(x, w1, w2, logits, topk, renormalize, e_score_correction_bias=bias,
                    w1_bias=b1, w2_bias=b2, **route)
    renamed = fused_moe(x, w1[inv], w2[inv], logits[:, inv], topk, renormalize,
                        e_score_correction_bias=renamed_bias, w1_bias=b1[inv], w2_bias=b2[inv],
                        **route)
    # the same experts are chosen, under their new names, in the same order
    _, ids, _ = select_experts(x, logits, topk, True, renormalize, e_score_correction_bias=bias,
                               topk_group=topk_group, num_expert_group=num_expert_group,
                               scoring_func=scoring_func)
    _, renamed_ids, _ = select_experts(x, logits[:, inv], topk, True, renormalize,
                                       e_score_correction_bias=renamed_bias,
                                       topk_group=topk_group, num_expert_group=num_expert_group,
                                       scoring_func=scoring_func)
    np.testing.assert_array_equal(renamed_ids, pi[ids])
    # the routing weights are fp32 math whose softmax denominator sums the experts in id
    # order, so renaming moves them by an fp32 rounding: fp32's tolerance, not fp64's
    assert_close(renamed, out, np.float32, what="output after renaming the experts")


@PROPERTY
@given(seeds, st.integers(0, 10), st.integers(1, 12), st.integers(1, 4), st.integers(1, 12),
       st.sampled_from(["linear", "round_robin"]), st.booleans())
def test_expert_parallel_partial_outputs_sum_to_the_layer(seed, num_tokens, num_experts, topk,
                                                          ep_size, placement, with_bias):
    topk = min(topk, num_experts)
    ep_size = min(ep_size, num_experts)
    rng = np.random.default_rng(seed)
    hidden, inter = 8, 6
    x = uniform(rng, (num_tokens, hidden), 1.0, np.float64)
    w1, w2, b1, b2 = moe_weights(rng, num_experts, hidden, inter, np.float64, bias=with_bias)
    weights = random_weights(rng, num_tokens, topk)
    ids = distinct_topk_ids(rng, num_tokens, num_experts, topk)
    full = fused_experts(x, w1, w2, weights, ids, w1_bias=b1, w2_bias=b2)
    total = np.zeros_like(full)
    owners = np.zeros(num_experts, dtype=int)
    for rank in range(ep_size):
        _local, expert_map = determine_expert_map(ep_size, rank, num_experts, placement)
        if expert_map is None:                           # ep_size == 1: everything is local
            expert_map = np.arange(num_experts, dtype=np.int32)
        else:
            np.testing.assert_array_equal(
                expert_map, expert_map_loop(ep_size, rank, num_experts, placement)[1])
        owners += expert_map >= 0
        lw1, lw2, lb1, lb2 = local_weights(expert_map, w1, w2, b1, b2)
        total += fused_experts(x, lw1, lw2, weights, ids, global_num_experts=num_experts,
                               expert_map=expert_map, w1_bias=lb1, w2_bias=lb2)
    assert (owners == 1).all(), "every expert lives on exactly one rank"
    assert_close(total, full, np.float64, what="sum of the ranks' partial outputs")


@PROPERTY
@given(seeds, st.integers(1, 20), st.integers(1, 10), st.integers(1, 4))   # T=0: test_errors.py
def test_permute_then_unpermute_weighs_each_token(seed, num_tokens, num_experts, topk):
    topk = min(topk, num_experts)
    rng = np.random.default_rng(seed)
    x = uniform(rng, (num_tokens, 5), 1.0, np.float64)
    ids = distinct_topk_ids(rng, num_tokens, num_experts, topk)
    weights = random_weights(rng, num_tokens, topk)
    x_grouped, offsets, inv = moe_permute(x, ids, num_experts)
    assert offsets[-1] == ids.size and (np.diff(offsets) >= 0).all()
    out = moe_unpermute(x_grouped, weights, inv)
    assert_close(out, x * weights.astype(np.float64).sum(axis=1, keepdims=True), np.float64)


@PROPERTY
@given(seeds, st.integers(1, 8), st.integers(2, 10), st.integers(1, 3))
def test_select_experts_default_is_fused_topk(seed, num_tokens, num_experts, topk):
    topk = min(topk, num_experts)
    logits = np.random.default_rng(seed).standard_normal((num_tokens, num_experts)).astype(np.float32)
    a = select_experts(None, logits, topk, False, True)
    b = fused_topk(None, logits, topk, True)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
