"""The torch fused_experts baseline (cuda_kernels/torch/experts.py) against the NumPy
reference in exact mode, and slots routed nowhere (id -1) contributing nothing.

    T = tokens, E = experts, K = top-k, H = hidden, I = intermediate
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import reference
from cuda_kernels import torch as tb
from cuda_kernels.torch import to_host as host
from tests.oracles import TOL, distinct_topk_ids, rng_for
from tests.oracles import rel_err_where_defined as rel

DTYPES = [np.float32, ml_dtypes.bfloat16]

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_experts_baseline(impl, dtype):
    rng = rng_for("fe", impl, str(dtype))
    t, e, k, h, i = 19, 6, 2, 32, 24
    x = rng.standard_normal((t, h)).astype(dtype)
    w1 = (rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)).astype(dtype)
    w2 = (rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(dtype)
    logits = rng.standard_normal((t, e)).astype(np.float32)
    tw, ids, _ = reference.fused_topk(x, logits, k, True)
    want = reference.fused_experts(x, w1, w2, tw, ids, precision="exact")
    got = host(tb.fused_experts(x, w1, w2, tw, ids, impl=impl))
    assert got.dtype == np.dtype(dtype) and rel(got, want) <= TOL[np.dtype(dtype)]


def test_fused_experts_baseline_skips_slots_routed_nowhere():
    rng = rng_for("fe-1")
    t, e, k, h, i = 11, 6, 2, 32, 24
    x = rng.standard_normal((t, h)).astype(np.float32)
    w1 = (rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)).astype(np.float32)
    w2 = (rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32)
    tw = rng.random((t, k)).astype(np.float32)
    ids = distinct_topk_ids(rng, t, e, k)
    ids[4] = -1
    ids[7, 0] = -1
    want = reference.fused_experts(x, w1, w2, tw, ids, precision="exact")
    got = host(tb.fused_experts(x, w1, w2, tw, ids, impl="loop"))
    assert (got[4] == 0).all() and rel(got, want) <= 1e-5
