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
from tests.emulator import library_fixture, ptr
from tests.oracles import assert_output_close, distinct_topk_ids, random_weights, rng_for, uniform
from tests.support import DTYPES, on_gpu

pytestmark = pytest.mark.usefixtures("cupy_poison")


@on_gpu("cupy")
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


@on_gpu("cupy")
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


@on_gpu("cupy")
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


# ============================================================================ CPU: the emulator
# The kernel source on the CPU emulator of tests/emulator (g++, a std::thread per CUDA thread,
# tiny tunables), against the reference: the kernel's logic without a GPU (not the GPU's
# expf / erff ulps, timing or memory ordering: the GPU tests above stay the judge).
ENTRY = r"""
extern "C" void permute_index(const int* ids, int* off, int* inv, int P, int E, int chunk,
                              int threads, int smem) {
    launch(1, threads, smem, [&] { moe_permute_index_kernel(ids, off, inv, P, E, chunk); });
}
extern "C" void gather(const unsigned* x, const int* inv, unsigned* xg, int P, int K, int words) {
    launch((P + ROW_WARPS - 1) / ROW_WARPS, ROW_WARPS * 32, 0,
           [&] { gather_rows_kernel<unsigned int>(x, inv, xg, P, K, words); });
}
extern "C" void unpermute(const float* y, const float* w, const int* inv, float* out, int T,
                          int K, int H, int vec) {
    int chunks = (H + UNPERMUTE_THREADS * vec - 1) / (UNPERMUTE_THREADS * vec);
#define U(V) if (vec == V) launch(T * chunks, UNPERMUTE_THREADS, 0, [&] { \
    moe_unpermute_kernel<V>(y, w, inv, out, T, K, H, chunks); });
    U(1) U(4)
}"""
DEFINES = {"SCALAR_T": "float", "ROW_WARPS": 2, "UNPERMUTE_THREADS": 32, "PREFETCH": 2}


emulated = library_fixture("permute.cu", (DEFINES, ENTRY))


@pytest.mark.simulator
def test_emulated_permute(emulated):
    lib = emulated
    rng = np.random.default_rng(7)
    for T, E, K, H in ((1, 8, 2, 4), (37, 16, 3, 9), (130, 64, 4, 12)):
        x = rng.standard_normal((T, H)).astype(np.float32)
        ids = distinct_topk_ids(rng, T, E, K)
        P = T * K
        W, chunk, smem = ck_perm._group_geometry(P, E + 1)
        off, inv = np.full(E + 1, -7, np.int32), np.full(P, -7, np.int32)
        lib.permute_index(ptr(ids), ptr(off), ptr(inv), P, E, chunk, W * 32, smem)
        xg = np.full((P, H), np.nan, np.float32)
        lib.gather(ptr(x), ptr(inv), ptr(xg), P, K, H)
        want = reference.moe_permute(x, ids, E)
        for g, w in zip((xg, off, inv), want):
            np.testing.assert_array_equal(g, w)
        y = rng.standard_normal((P, H)).astype(np.float32)
        wts = rng.random((T, K)).astype(np.float32)
        for vec in (1, 4) if H % 4 == 0 else (1,):
            out = np.full((T, H), np.nan, np.float32)
            lib.unpermute(ptr(y), ptr(wts), ptr(inv), ptr(out), T, K, H, vec)
            np.testing.assert_array_equal(out, reference.moe_unpermute(y, wts, inv))
