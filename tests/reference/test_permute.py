"""The contiguous layout (`reference/permute.py`): moe_permute, grouped_mm, moe_unpermute
against loops.

    T = tokens, E = experts, K = top-k, H = hidden, P = T*K slots (s = t*K + k)

moe_permute: rows grouped by expert in increasing id, stable in s, exactly; grouped_mm and
moe_unpermute within the dtype's tolerance of float64 loops, and the three together equal
out[t] = sum_k w[t, k] * W[ids[t, k]] @ x[t].
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from reference import grouped_mm, moe_permute, moe_unpermute
from tests.oracles import BF16, assert_close, distinct_topk_ids, rng_for


PERMUTE_CASES = [(1, 4, 1), (7, 8, 2), (64, 16, 6), (33, 64, 8)]


@pytest.mark.parametrize("num_tokens, num_experts, topk", PERMUTE_CASES)
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float64], ids=lambda d: np.dtype(d).name)
def test_moe_permute_matches_loop(num_tokens, num_experts, topk, dtype):
    rng = rng_for("permute", num_tokens, num_experts, topk, np.dtype(dtype).name)
    hidden = 24
    x = rng.standard_normal((num_tokens, hidden)).astype(dtype)
    topk_ids = distinct_topk_ids(rng, num_tokens, num_experts, topk)
    x_grouped, expert_offsets, inv = moe_permute(x, topk_ids, num_experts)
    assert x_grouped.dtype == x.dtype and expert_offsets.dtype == np.int32 and inv.dtype == np.int32
    # loop: rows grouped by expert in increasing id, stable in s
    order = [s for e in range(num_experts) for s in range(topk_ids.size) if topk_ids.flat[s] == e]
    want_offsets = [0]
    for e in range(num_experts):
        want_offsets.append(want_offsets[-1] + int((topk_ids == e).sum()))
    assert expert_offsets.tolist() == want_offsets
    for row, s in enumerate(order):
        assert inv[s] == row
        np.testing.assert_array_equal(x_grouped[row], x[s // topk])


@pytest.mark.parametrize("num_tokens, num_experts, topk", PERMUTE_CASES)
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float64], ids=lambda d: np.dtype(d).name)
def test_grouped_mm_and_unpermute_match_loop(num_tokens, num_experts, topk, dtype):
    rng = rng_for("grouped_mm", num_tokens, num_experts, topk, np.dtype(dtype).name)
    hidden, n_out = 32, 20
    x = rng.standard_normal((num_tokens, hidden)).astype(dtype)
    w = (rng.standard_normal((num_experts, n_out, hidden)) / math.sqrt(hidden)).astype(dtype)
    topk_ids = distinct_topk_ids(rng, num_tokens, num_experts, topk)
    topk_weights = (0.1 + rng.random((num_tokens, topk))).astype(np.float32)
    x_grouped, expert_offsets, inv = moe_permute(x, topk_ids, num_experts)
    y_grouped = grouped_mm(x_grouped, w, expert_offsets)
    assert y_grouped.dtype == x.dtype and y_grouped.shape == (topk_ids.size, n_out)
    want_y = np.zeros(y_grouped.shape)
    for e in range(num_experts):
        for row in range(expert_offsets[e], expert_offsets[e + 1]):
            want_y[row] = w[e].astype(np.float64) @ x_grouped[row].astype(np.float64)
    assert_close(y_grouped, want_y, dtype, what="grouped_mm")

    out = moe_unpermute(y_grouped, topk_weights, inv)
    assert out.dtype == x.dtype and out.shape == (num_tokens, n_out)
    want_out = np.zeros((num_tokens, n_out))
    for t in range(num_tokens):
        for k in range(topk):
            want_out[t] += float(topk_weights[t, k]) * y_grouped[inv[t * topk + k]].astype(np.float64)
    assert_close(out, want_out, dtype, what="moe_unpermute")
    # end to end: out[t] = sum_k w[t, k] * W[ids[t, k]] @ x[t]
    direct = np.zeros((num_tokens, n_out))
    for t, k in itertools.product(range(num_tokens), range(topk)):
        direct[t] += float(topk_weights[t, k]) * (w[topk_ids[t, k]].astype(np.float64) @ x[t].astype(np.float64))
    assert_close(out, direct, dtype, what="permute -> grouped_mm -> unpermute")
