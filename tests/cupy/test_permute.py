"""CuPy permute / unpermute (cuda_kernels/cupy/permute.py, permute.cu) against the NumPy
reference, on the GPU.

    T tokens, E experts, K top-k, H hidden, P = T*K slots

Every test here is `gpu` and skips cleanly without a usable device (availability() says
why). Outputs are poisoned before every launch (the `cupy_poison` fixture: NaN for floats,
-123456789 for ints), so an element a kernel forgets to write fails the comparison.

moe_permute: x_grouped, expert_offsets, inv_permuted_idx exact (a copy and integers).
moe_unpermute: relative Frobenius error <= TOL[dtype] (fp32 1e-5, fp16/bf16 1e-2).
"""
from __future__ import annotations

import numpy as np
import pytest

import reference
from cuda_kernels.cupy import permute as ck_perm
from cuda_kernels.cupy import to_device as dev
from cuda_kernels.cupy import to_host as host
from tests.oracles import assert_output_close, distinct_topk_ids, random_weights, rng_for, uniform
from tests.support import DTYPES, gpu_marks

pytestmark = [*gpu_marks("cupy"), pytest.mark.usefixtures("cupy_poison")]


@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("T,E,K,H", [(1, 8, 2, 64), (67, 16, 3, 130), (256, 128, 8, 2048),
                                     (1000, 257, 6, 7), (513, 64, 1, 4096)])
def test_permute_unpermute(T, E, K, H, dkey):
    dtype = DTYPES[dkey]
    rng = rng_for("permute", T, E, K, H, dkey)
    x = uniform(rng, (T, H), 1.0, dtype)
    ids = distinct_topk_ids(rng, T, E, K)
    got = ck_perm.moe_permute(dev(x), dev(ids), E)
    want = reference.moe_permute(x, ids, E)
    for g, w, name in zip(got, want, ("x_grouped", "expert_offsets", "inv_permuted_idx")):
        g = host(g)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=name)
    y = uniform(rng, (T * K, H), 1.0, dtype)
    w8 = random_weights(rng, T, K)
    inv = want[2]
    out = ck_perm.moe_unpermute(dev(y), dev(w8), dev(inv))
    assert_output_close(host(out), reference.moe_unpermute(y, w8, inv), dtype, "moe_unpermute")


def test_permute_all_on_one_expert_and_empty():
    x = uniform(rng_for("p1"), (40, 24), 1.0, np.float32)
    ids = np.full((40, 2), 5, np.int32)
    ids[:, 1] = 6
    got = ck_perm.moe_permute(dev(x), dev(ids), 10)
    want = reference.moe_permute(x, ids, 10)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(host(g), w)
    x0 = np.zeros((0, 24), np.float32)
    got = ck_perm.moe_permute(dev(x0), dev(np.zeros((0, 2), np.int32)), 10)
    assert got[0].shape == (0, 24) and got[2].shape == (0,)
    np.testing.assert_array_equal(host(got[1]), np.zeros(11, np.int32))
    out = ck_perm.moe_unpermute(dev(np.zeros((0, 24), np.float32)),
                                dev(np.zeros((0, 2), np.float32)), dev(np.zeros(0, np.int32)))
    assert out.shape == (0, 24)


def test_unpermute_misaligned_view_and_bad_inputs():
    T, K, H = 9, 2, 64
    rng = rng_for("unperm_misaligned")
    buf = uniform(rng, (T * K * H + 1,), 1.0, np.float16)
    y = buf[1:].reshape(T * K, H)  # 2 bytes off a 16-byte boundary: the scalar path
    w = random_weights(rng, T, K)
    inv = np.random.default_rng(1).permutation(T * K).astype(np.int32)
    d_buf = dev(buf)
    out = ck_perm.moe_unpermute(d_buf[1:].reshape(T * K, H), dev(w), dev(inv))
    assert_output_close(host(out), reference.moe_unpermute(y, w, inv), np.float16, "misaligned")
    with pytest.raises(ValueError, match="y_grouped"):
        ck_perm.moe_unpermute(dev(np.ones((5, H), np.float32)), dev(w), dev(inv))
    with pytest.raises(ValueError, match="inv_permuted_idx"):
        ck_perm.moe_unpermute(dev(np.ones((T * K, H), np.float32)), dev(w), dev(inv[:-1]))
