"""CuPy combine (cuda_kernels/cupy/combine.py, combine.cu: moe_sum) against the NumPy
reference, on the GPU; arrays on the wrong device are refused (moe_sum, silu_and_mul).

    T tokens, K top-k, H hidden

Every test here is `gpu` and skips cleanly without a usable device (availability() says
why). Outputs are poisoned before every launch (the `cupy_poison` fixture: NaN for floats,
-123456789 for ints), so an element a kernel forgets to write fails the comparison.

Relative Frobenius error <= TOL[dtype] (fp32 1e-5, fp16/bf16 1e-2); NaN never passes.
"""
from __future__ import annotations

import numpy as np
import pytest

import reference
from cuda_kernels.cupy import activation as ck_act
from cuda_kernels.cupy import combine as ck_combine
from cuda_kernels.cupy import to_device as dev
from cuda_kernels.cupy import to_host as host
from tests.emulator import library_fixture, ptr
from tests.oracles import assert_output_close, distinct_topk_ids, rng_for, uniform
from tests.support import DTYPES, on_gpu

pytestmark = pytest.mark.usefixtures("cupy_poison")


@on_gpu("cupy")
@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("T,K,H", [(1, 2, 4096), (33, 8, 2048), (512, 1, 128), (7, 6, 7),
                                   (100, 22, 1000), (2, 3, 1)])
def test_moe_sum(T, K, H, dkey):
    dtype = DTYPES[dkey]
    x = uniform(rng_for("moe_sum", T, K, H, dkey), (T, K, H), 1.0, dtype)
    d = dev(x)
    got = ck_combine.moe_sum(d)
    assert_output_close(host(got), reference.moe_sum(x), dtype, "moe_sum")
    again = ck_combine.moe_sum(d)  # deterministic: bitwise the same twice
    np.testing.assert_array_equal(host(got).view(np.uint8), host(again).view(np.uint8))


@on_gpu("cupy")
@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("with_map", [False, True])
def test_moe_sum_pad_aware(dkey, with_map):
    """vLLM's moe_sum(input, output, topk_ids, expert_map): dead slots are never read."""
    dtype = DTYPES[dkey]
    T, K, H = 33, 4, 2048
    rng = rng_for("moe_sum_pad", dkey, with_map)
    x = uniform(rng, (T, K, H), 1.0, dtype)
    ids = distinct_topk_ids(rng, T, 16, K)
    ids[::5, 1] = -1
    ids[7] = -1
    emap = reference.determine_expert_map(2, 0, 16)[1].astype(np.int32) if with_map else None
    live = reference.combine.slot_is_live(ids, emap)
    x[~live] = np.nan                                 # rows the GEMMs never wrote
    got = ck_combine.moe_sum(dev(x), dev(ids), None if emap is None else dev(emap))
    want = reference.moe_sum(x, ids, emap)
    assert np.isfinite(host(got).astype(np.float32)).all()
    assert_output_close(host(got), want, dtype, "moe_sum pad-aware")


@on_gpu("cupy")
def test_moe_sum_empty_misaligned_and_bad_inputs():
    assert ck_combine.moe_sum(dev(np.zeros((0, 2, 8), np.float32))).shape == (0, 8)
    buf = uniform(rng_for("sum_mis"), (5 * 3 * 16 + 1,), 1.0, np.float16)
    got = ck_combine.moe_sum(dev(buf)[1:].reshape(5, 3, 16))
    assert_output_close(host(got), reference.moe_sum(buf[1:].reshape(5, 3, 16)), np.float16,
                        "misaligned")
    with pytest.raises(ValueError, match="x"):
        ck_combine.moe_sum(dev(np.ones((4, 8), np.float32)))
    with pytest.raises(TypeError, match="x"):
        ck_combine.moe_sum(dev(np.ones((2, 2, 8), np.int32)))


# ============================================================================ devices
@on_gpu("cupy")
def test_wrong_device_is_rejected():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs to place an array on the wrong one")
    with cupy.cuda.Device(1):
        x = cupy.ones((4, 8), cupy.float32)
    with pytest.raises(ValueError, match="device"):
        ck_combine.moe_sum(x.reshape(2, 2, 8))
    with pytest.raises(ValueError, match="device"):
        ck_act.silu_and_mul(x)


# ============================================================================ CPU: the emulator
# The kernel source on the CPU emulator of tests/emulator (g++, a std::thread per CUDA thread,
# tiny tunables), against the reference: the kernel's logic without a GPU (not the GPU's
# expf / erff ulps, timing or memory ordering: the GPU tests above stay the judge).
ENTRY = r"""
extern "C" void moe_sum(const float* x, float* out, int T, int K, int H, int vec) {
    int chunks = (H + SUM_THREADS * vec - 1) / (SUM_THREADS * vec);
#define S(V) if (vec == V) launch(T * chunks, SUM_THREADS, 0, [&] { \
    moe_sum_kernel<V>(x, out, T, K, H, chunks); });
    S(1) S(4)
}
extern "C" void moe_sum_live(const float* x, const int* ids, const int* emap, int map_len,
                             float* out, int T, int K, int H, int vec) {
    int chunks = (H + SUM_THREADS * vec - 1) / (SUM_THREADS * vec);
#define SL(V) if (vec == V) launch(T * chunks, SUM_THREADS, 0, [&] { \
    moe_sum_live_kernel<V>(x, ids, emap, map_len, out, T, K, H, chunks); });
    SL(1) SL(4)
}"""
DEFINES = {"SCALAR_T": "float", "SUM_THREADS": 32}


emulated = library_fixture("combine.cu", (DEFINES, ENTRY))


@pytest.mark.simulator
def test_emulated_combine(emulated):
    comb = emulated
    rng = np.random.default_rng(9)
    for T, K, H in ((1, 2, 5), (3, 8, 40), (2, 22, 36)):
        x = rng.standard_normal((T, K, H)).astype(np.float32)
        for vec in (1, 4) if H % 4 == 0 else (1,):
            out = np.full((T, H), np.nan, np.float32)
            comb.moe_sum(ptr(x), ptr(out), T, K, H, vec)
            np.testing.assert_array_equal(out, reference.moe_sum(x))  # slot order: bitwise
    # pad-aware: slots with id -1 (or a non-local expert) never read (NaN rows here)
    x = rng.standard_normal((5, 3, 40)).astype(np.float32)
    ids = np.array([[0, 1, 2], [-1, 3, 1], [-1, -1, -1], [2, -1, 0], [3, 3, 1]], np.int32)
    for emap in (None, np.array([0, -1, 1, 2], np.int32)):
        live = reference.combine.slot_is_live(ids, emap)
        xp = np.where(live[:, :, None], x, np.nan).astype(np.float32)
        for vec in (1, 4):
            out = np.full((5, 40), np.nan, np.float32)
            comb.moe_sum_live(ptr(xp), ptr(ids), ptr(emap), 0 if emap is None else 4, ptr(out),
                              5, 3, 40, vec)
            np.testing.assert_array_equal(out, reference.moe_sum(xp, ids, emap))
