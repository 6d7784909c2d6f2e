"""Torch alignment (cuda_kernels/torch/align.py) against the NumPy reference.

    T = tokens, E = experts, K = top-k, B = block size

Every output exact: both backends sort stably, so even the order of slots within an expert
agrees.
"""

from __future__ import annotations

import numpy as np
import pytest

import reference
from cuda_kernels import torch as tb
from cuda_kernels.torch import to_host as host
from tests.oracles import distinct_topk_ids, rng_for

torch = pytest.importorskip("torch")


ALIGN_CASES = [  # (T, E, K, B): one token, fewer slots than experts, one expert, uneven
    (1, 8, 2, 4), (3, 16, 2, 4), (40, 6, 2, 16), (33, 5, 3, 8), (64, 4, 1, 64), (0, 8, 2, 16),
]


@pytest.mark.parametrize("t,e,k,b", ALIGN_CASES)
@pytest.mark.parametrize("pad", [False, True])
def test_moe_align_block_size(t, e, k, b, pad):
    rng = rng_for("align", t, e, k, b, pad)
    ids = distinct_topk_ids(rng, t, e, k)
    want = reference.moe_align_block_size(ids, b, e, pad_sorted_ids=pad)
    got = [host(v) for v in tb.moe_align_block_size(ids, b, e, pad_sorted_ids=pad)]
    for g, w in zip(got, want):
        assert g.dtype == np.int32 and np.array_equal(g, w)


@pytest.mark.parametrize("ignore_invalid", [False, True])
def test_moe_align_expert_map(ignore_invalid):
    rng = rng_for("align-map", ignore_invalid)
    t, e, k, b = 25, 8, 2, 4
    ids = distinct_topk_ids(rng, t, e, k)
    _, expert_map = reference.determine_expert_map(2, 1, e, "round_robin")
    want = reference.moe_align_block_size(ids, b, e, expert_map=expert_map,
                                          ignore_invalid_experts=ignore_invalid)
    got = [host(v) for v in tb.moe_align_block_size(ids, b, e, expert_map=expert_map,
                                                    ignore_invalid_experts=ignore_invalid)]
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


@pytest.mark.parametrize("ep", [None, False, True], ids=["nomap", "map", "map-ignore"])
def test_moe_align_skips_ids_outside_the_experts(ep):
    """vLLM's -1 (and any id past E) is skipped: placed nowhere, counted nowhere."""
    rng = rng_for("align-skip", ep)
    t, e, k, b = 25, 8, 2, 4
    ids = distinct_topk_ids(rng, t, e, k)
    ids[3] = -1
    ids[7, 1] = 9
    kw = {}
    if ep is not None:
        kw = dict(expert_map=reference.determine_expert_map(2, 1, e)[1],
                  ignore_invalid_experts=ep)
    want = reference.moe_align_block_size(ids, b, e, **kw)
    got = [host(v) for v in tb.moe_align_block_size(ids, b, e, **kw)]
    for g, w in zip(got, want):
        assert np.array_equal(g, w)
