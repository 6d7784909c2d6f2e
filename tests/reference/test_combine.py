"""The combine (`reference/combine.py`: moe_sum) against loops in float64: the sum over a
token's slots, and slots routed nowhere (id -1, or an expert of another rank) never read.

    T = tokens, K = top-k, H = hidden
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from reference import moe_sum
from tests.oracles import BF16, assert_close, rng_for, uniform

DTYPES = [np.float32, BF16, np.float16, np.float64]
dtype_id = lambda d: np.dtype(d).name


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_moe_sum_matches_loop(dtype):
    rng = rng_for("moe_sum", dtype_id(dtype))
    x = uniform(rng, (7, 4, 33), 1.0, dtype)
    out = moe_sum(x)
    assert out.dtype == x.dtype and out.shape == (7, 33)
    want = np.zeros((7, 33))
    for t, k in itertools.product(range(7), range(4)):
        want[t] += x[t, k].astype(np.float64)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("with_map", [False, True], ids=["nomap", "map"])
def test_moe_sum_skips_slots_routed_nowhere(with_map):
    """vLLM's pad-aware moe_sum(input, output, topk_ids, expert_map): a slot with a negative
    id, or (with an expert_map) a non-local expert, is never read; a token with every slot
    skipped sums to 0. The skipped rows may hold anything (here NaN: never written)."""
    rng = rng_for("moe_sum pad-aware", with_map)
    x = uniform(rng, (5, 3, 17), 1.0)
    ids = np.array([[0, 1, 2], [-1, 3, 1], [-1, -1, -1], [2, -1, 0], [3, 3, 1]], np.int32)
    expert_map = np.array([0, -1, 1, 2], np.int32) if with_map else None
    live = ids >= 0
    if with_map:
        live &= expert_map[np.maximum(ids, 0)] >= 0
    x[~live] = np.nan
    out = moe_sum(x, ids, expert_map)
    want = np.where(live[:, :, None], x.astype(np.float64), 0.0).sum(axis=1)
    assert_close(out, want, np.float32)
    assert (out[2] == 0).all()
    np.testing.assert_array_equal(moe_sum(np.nan_to_num(x), None), np.nan_to_num(x).sum(1))
