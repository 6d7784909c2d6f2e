"""The grouped GEMM (`reference/gemm.py`: grouped_gemm) against the loop over (token, slot)
pairs in float64.

    T = tokens, E = experts, K = top-k, H = hidden, I = intermediate, B = block size,
    P = T*K slots (s = t*K + k)

Relative Frobenius error keyed by the dtype the reference ran in (oracles.TOL); rows of slots
whose expert lives on another rank are zeros, or left alone (ignore_invalid_experts).
"""

from __future__ import annotations

import numpy as np
import pytest

from reference import determine_expert_map, grouped_gemm, moe_align_block_size
from tests.oracles import (
    BF16,
    assert_close,
    distinct_topk_ids,
    random_weights,
    rel_err,
    rng_for,
    uniform,
)

dtype_id = lambda d: np.dtype(d).name


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float64], ids=dtype_id)
@pytest.mark.parametrize("gemm", ["gemm1", "gemm2"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("mul_routed_weight", [False, True], ids=["nomul", "mul"])
def test_grouped_gemm_matches_loop(dtype, gemm, with_bias, mul_routed_weight):
    rng = rng_for("grouped_gemm", dtype_id(dtype), gemm, with_bias, mul_routed_weight)
    num_tokens, num_experts, topk, kdim, n_out, block_size = 11, 5, 3, 16, 12, 4
    ids = distinct_topk_ids(rng, num_tokens, num_experts, topk)
    weights = random_weights(rng, num_tokens, topk)
    rows = num_tokens if gemm == "gemm1" else num_tokens * topk
    a_topk = topk if gemm == "gemm1" else 1
    a = uniform(rng, (rows, kdim), 1.0, dtype)
    w = uniform(rng, (num_experts, n_out, kdim), 0.5, dtype)
    bias = uniform(rng, (num_experts, n_out), 0.5, dtype) if with_bias else None
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, block_size, num_experts)
    c = grouped_gemm(a, w, sorted_ids, expert_ids, num_post, a_topk, block_size,
                     topk_weights=weights, mul_routed_weight=mul_routed_weight, bias=bias)
    assert c.dtype == a.dtype and c.shape == (num_tokens * topk, n_out)
    want = np.zeros(c.shape)
    for s in range(num_tokens * topk):
        e = ids.flat[s]
        want[s] = w[e].astype(np.float64) @ a[s // a_topk].astype(np.float64)
        if with_bias:
            want[s] += bias[e].astype(np.float64)
        if mul_routed_weight:
            want[s] *= float(weights.flat[s])
    assert_close(c, want, dtype, what="grouped_gemm")


@pytest.mark.parametrize("ignore_invalid_experts", [False, True])
def test_grouped_gemm_non_local_experts(ignore_invalid_experts):
    # rank 0 of 2 (linear) holds experts 0..3 of 8: rows of other experts are zeros, or, when
    # alignment ignores them, never written (the NaN poison stays: reading them is a bug)
    rng = rng_for("gemm ep", ignore_invalid_experts)
    num_tokens, num_experts, topk, hidden, n_out, block_size = 9, 8, 2, 16, 10, 4
    ids = distinct_topk_ids(rng, num_tokens, num_experts, topk)
    _, expert_map = determine_expert_map(2, 0, num_experts)
    x = uniform(rng, (num_tokens, hidden))
    w = uniform(rng, (4, n_out, hidden), 0.5)
    aligned = moe_align_block_size(ids, block_size, num_experts, expert_map=expert_map,
                                   ignore_invalid_experts=ignore_invalid_experts)
    c = grouped_gemm(x, w, *aligned, topk, block_size)
    for s in range(num_tokens * topk):
        local = expert_map[ids.flat[s]]
        if local >= 0:
            want = w[local].astype(np.float64) @ x[s // topk].astype(np.float64)
            assert rel_err(c[s], want) <= 1e-5
        elif ignore_invalid_experts:
            assert np.isnan(c[s]).all()
        else:
            assert (c[s] == 0).all()
