"""The torch contiguous layout (cuda_kernels/torch/permute.py: moe_permute, grouped_mm,
moe_unpermute) against the NumPy reference: the permutation exactly, the products within
fp32's 1e-5.

    T = tokens, E = experts, K = top-k, H = hidden, N output width
"""

from __future__ import annotations

import numpy as np
import pytest

import reference
from cuda_kernels import torch as tb
from cuda_kernels.torch import to_host as host
from tests.oracles import distinct_topk_ids, rng_for
from tests.oracles import rel_err_where_defined as rel

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_permute_grouped_mm_unpermute(impl):
    rng = rng_for("perm", impl)
    t, e, k, h, n = 17, 5, 2, 16, 32
    x = rng.standard_normal((t, h)).astype(np.float32)
    ids = distinct_topk_ids(rng, t, e, k)
    tw = rng.random((t, k)).astype(np.float32)
    w = rng.standard_normal((e, n, h)).astype(np.float32)
    rx, roff, rinv = reference.moe_permute(x, ids, e)
    gx, goff, ginv = (host(v) for v in tb.moe_permute(x, ids, e))
    assert np.array_equal(gx, rx) and np.array_equal(goff, roff) and np.array_equal(ginv, rinv)
    ry = reference.grouped_mm(rx, w, roff)
    gy = host(tb.grouped_mm(gx, w, goff, impl=impl))
    assert rel(gy, ry) <= 1e-5
    assert rel(host(tb.moe_unpermute(gy, tw, ginv)), reference.moe_unpermute(ry, tw, rinv)) <= 1e-5
