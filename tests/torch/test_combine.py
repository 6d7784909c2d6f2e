"""Torch combine (cuda_kernels/torch/combine.py: moe_sum, pad-aware too) against the NumPy
reference.

    T = tokens, K = top-k, H = hidden
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import reference
from cuda_kernels import torch as tb
from cuda_kernels.torch import to_host as host
from tests.oracles import TOL, rng_for
from tests.oracles import rel_err_where_defined as rel

DTYPES = [np.float32, ml_dtypes.bfloat16]

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_sum(dtype):
    x = rng_for("sum", str(dtype)).standard_normal((13, 3, 20)).astype(dtype)
    want = reference.moe_sum(reference.exact(x))
    got = host(tb.moe_sum(x))
    assert got.dtype == np.dtype(dtype) and rel(got, want) <= TOL[np.dtype(dtype)]


@pytest.mark.parametrize("with_map", [False, True])
def test_moe_sum_pad_aware(with_map):
    """vLLM's moe_sum(input, output, topk_ids, expert_map): skipped slots are never read."""
    rng = rng_for("sum-pad", with_map)
    x = rng.standard_normal((6, 3, 20)).astype(np.float32)
    ids = np.array([[0, 1, 2], [-1, 3, 1], [-1, -1, -1], [2, -1, 0], [3, 3, 1], [1, 0, 2]],
                   np.int32)
    expert_map = np.array([0, -1, 1, 2], np.int32) if with_map else None
    live = reference.combine.slot_is_live(ids, expert_map)
    x[~live] = np.nan                                    # never written by the GEMMs
    want = reference.moe_sum(x, ids, expert_map)
    got = host(tb.moe_sum(x, ids, expert_map))
    assert np.isfinite(got).all() and rel(got, want) <= 1e-6
