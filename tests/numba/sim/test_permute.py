"""Numba permute / unpermute (cuda_kernels/numba/permute.py) in the CUDA simulator against
reference/permute.py.

    T tokens, E experts, K top-k, P = T*K slots, H hidden

Every moe_permute output exact (a copy and integers); moe_unpermute within the dtype's
tolerance; outputs poisoned before every launch.
"""
import importlib

import numpy as np
import pytest

import reference
from tests.oracles import BF16, distinct_topk_ids, rel_err, rng_for, uniform

Pm = importlib.import_module("cuda_kernels.numba.permute")

pytestmark = [pytest.mark.simulator, pytest.mark.usefixtures("numba_poison")]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
@pytest.mark.parametrize("T,E,K,H", [(1, 4, 2, 3), (6, 5, 2, 8), (13, 4, 3, 2),
                                     (3, 4, 2, 260)])   # 260: a full 4-column step per thread
def test_permute_unpermute(T, E, K, H, dtype):
    rng = rng_for("perm", T, E, K, H)
    x = uniform(rng, (T, H), 1.0).astype(dtype)
    ids = distinct_topk_ids(rng, T, E, K)
    got = Pm.moe_permute(x, ids, E)
    want = reference.moe_permute(x, ids, E)
    for g, w, name in zip(got, want, ("x_grouped", "expert_offsets", "inv_permuted_idx")):
        assert g.dtype == w.dtype, name
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=name)
    y = uniform(rng, (T * K, H), 1.0).astype(dtype)
    w = (0.05 + rng.random((T, K))).astype(np.float32)
    u = Pm.moe_unpermute(y, w, want[2])
    assert u.dtype == np.dtype(dtype)
    tol = 1e-5 if dtype == np.float32 else 1e-2
    assert rel_err(u, reference.moe_unpermute(y, w, want[2])) <= tol


def test_permute_all_on_one_expert_and_empty():
    x = uniform(rng_for("one"), (9, 4), 1.0)
    ids = np.full((9, 1), 3, np.int32)
    got, want = Pm.moe_permute(x, ids, 5), reference.moe_permute(x, ids, 5)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    xg, off, inv = Pm.moe_permute(np.zeros((0, 4), np.float32), np.zeros((0, 2), np.int32), 3)
    assert xg.shape == (0, 4) and off.tolist() == [0, 0, 0, 0] and inv.shape == (0,)
    out = Pm.moe_unpermute(np.zeros((0, 4), np.float32), np.zeros((0, 2), np.float32),
                           np.zeros(0, np.int32))
    assert out.shape == (0, 4)


def test_permute_bad_inputs():
    x = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match="topk_ids: expected 3 rows to match hidden_states"):
        Pm.moe_permute(x, np.zeros((2, 2), np.int32), 4)
    with pytest.raises(ValueError, match=r"y_grouped: expected 6 rows \(T\*K\)"):
        Pm.moe_unpermute(np.ones((5, 4), np.float32), np.ones((3, 2), np.float32),
                         np.arange(6, dtype=np.int32))
    with pytest.raises(ValueError, match=r"inv_permuted_idx: expected shape \(6\)"):
        Pm.moe_unpermute(np.ones((6, 4), np.float32), np.ones((3, 2), np.float32),
                         np.arange(5, dtype=np.int32))
