"""Numba permute / unpermute (cuda_kernels/numba/permute.py) against the reference, on a real
GPU.

    T tokens, E experts, K top-k, H hidden, P = T*K slots

`gpu` tests, outputs poisoned, host arrays in and out (tests/numba/__init__.py says how).

moe_permute: every output exact (a copy and integers); moe_unpermute: relative Frobenius error
vs the reference on float64 inputs, fp32 <= 1e-5, fp16 / bf16 <= 1e-2.
"""
import importlib

import numpy as np
import pytest

import reference
from tests.oracles import assert_output_close, distinct_topk_ids, random_weights, rng_for, uniform
from tests.support import DTYPES, full_grid, gpu_marks, runs_kernels

pytestmark = [*gpu_marks("numba"), pytest.mark.usefixtures("numba_poison")]

if runs_kernels("numba"):   # imports numba on its CUDA target: only where it runs
    Pm = importlib.import_module("cuda_kernels.numba.permute")


@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("T,E,K,H", full_grid([(1, 8, 2, 64), (256, 128, 8, 2048), (0, 8, 2, 64),
                                          (67, 16, 3, 130)],   # rows not whole 16-byte chunks
                                         [(1, 8, 2, 64), (67, 16, 3, 130), (256, 128, 8, 2048),
                                          (4096, 256, 8, 128), (0, 8, 2, 64)]))
def test_permute_unpermute(T, E, K, H, dkey):
    dt = DTYPES[dkey]
    rng = rng_for("perm", T, E, K, H)
    x = uniform(rng, (T, H), 1.0, dt)
    ids = distinct_topk_ids(rng, T, E, K)
    got = Pm.moe_permute(x, ids, E)
    want = reference.moe_permute(x, ids, E)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    if T:
        y = uniform(rng, (T * K, H), 1.0, dt)
        tw = random_weights(rng, T, K)
        assert_output_close(Pm.moe_unpermute(y, tw, want[2]),
                     reference.moe_unpermute(y.astype(np.float64), tw.astype(np.float64),
                                             want[2]).astype(np.float64), dt, "unpermute")
