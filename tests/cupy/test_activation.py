"""CuPy activations (cuda_kernels/cupy/activation.py, activation.cu) against the NumPy
reference, on the GPU.

    M rows (slots), N = GEMM1 width (2I for the gated forms)

Every test here is `gpu` and skips cleanly without a usable device (availability() says
why). Outputs are poisoned before every launch (the `cupy_poison` fixture: NaN for floats,
-123456789 for ints), so an element a kernel forgets to write fails the comparison.

Relative Frobenius error <= TOL[dtype] (fp32 1e-5, fp16/bf16 1e-2); in fp16 / bf16 also
vLLM's rounding points, bit for bit but for last-ulp flips; NaN stays where it was.
"""
from __future__ import annotations

import numpy as np
import pytest

import reference
from cuda_kernels.cupy import activation as ck_act
from cuda_kernels.cupy import to_device as dev
from cuda_kernels.cupy import to_host as host
from tests.emulator import library_fixture, ptr
from tests.oracles import BF16, assert_output_close, rng_for, rounding_comparable, uniform
from tests.support import DTYPES, on_gpu

pytestmark = pytest.mark.usefixtures("cupy_poison")


ACTS_MUL = ["silu", "gelu", "gelu_tanh", "swigluoai"]
ACTS_NO_MUL = ["silu", "gelu", "gelu_tanh", "relu2"]


@on_gpu("cupy")
@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("M,N", [(1, 2), (37, 14), (256, 256), (130, 1536), (3, 2 * 1000)])
@pytest.mark.parametrize("act", ACTS_MUL)
def test_activation_and_mul(act, M, N, dkey):
    dtype = DTYPES[dkey]
    x = uniform(rng_for("act", act, M, N, dkey), (M, N), 9.0, dtype)  # past swigluoai's limit
    got = ck_act.apply_activation(dev(x), act, True)
    assert_output_close(host(got), reference.apply_activation(x, act, True), dtype, act)
    if dtype.itemsize == 2:   # vLLM's rounding points: the bits but for last-ulp flips
        want = reference.apply_activation(x, act, True)
        mask = rounding_comparable(x, act, True)     # not where erf / tanh cancel
        flips = host(got).view(np.uint16) != want.view(np.uint16)
        assert flips[mask].mean() < 0.01, act


@on_gpu("cupy")
@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("M,N", [(1, 1), (37, 15), (256, 768)])
@pytest.mark.parametrize("act", ACTS_NO_MUL)
def test_activation_no_mul(act, M, N, dkey):
    dtype = DTYPES[dkey]
    x = uniform(rng_for("act_nm", act, M, N, dkey), (M, N), 4.0, dtype)
    got = ck_act.apply_activation(dev(x), act, False)
    assert_output_close(host(got), reference.apply_activation(x, act, False), dtype, act)
    got = ck_act.apply_activation(dev(x), act + "_no_mul")
    assert_output_close(host(got), reference.apply_activation(x, act, False), dtype,
                        act + "_no_mul")


@on_gpu("cupy")
def test_activation_named_functions_nan_and_misaligned():
    rng = rng_for("act_named")
    x = uniform(rng, (20, 64), 3.0, np.float32)
    for fn in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul", "swigluoai_and_mul"):
        assert_output_close(host(getattr(ck_act, fn)(dev(x))), getattr(reference, fn)(x),
                            np.float32, fn)
    xn = x.copy()
    xn[3, 0] = np.nan   # a gate (first half, and an interleaved gate)
    xn[5, 33] = np.nan  # an up of the halves layout
    for fn in ("silu_and_mul", "swigluoai_and_mul"):
        got, want = host(getattr(ck_act, fn)(dev(xn))), getattr(reference, fn)(xn)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{fn} NaN")
    buf = uniform(rng, (20 * 64 + 1,), 3.0, BF16)
    got = ck_act.silu_and_mul(dev(buf)[1:].reshape(20, 64))  # misaligned: scalar path
    assert_output_close(host(got), reference.silu_and_mul(buf[1:].reshape(20, 64)), BF16,
                        "misaligned")
    empty = ck_act.silu_and_mul(dev(np.zeros((0, 8), np.float32)))
    assert empty.shape == (0, 4)


@on_gpu("cupy")
def test_activation_bad_inputs():
    with pytest.raises(ValueError, match="x"):
        ck_act.silu_and_mul(dev(np.ones((4, 7), np.float32)))
    with pytest.raises(ValueError, match="activation"):
        ck_act.apply_activation(dev(np.ones((4, 8), np.float32)), "tanh")
    with pytest.raises(ValueError, match="activation"):
        ck_act.apply_activation(dev(np.ones((4, 8), np.float32)), "relu2", True)
    with pytest.raises(TypeError, match="x"):
        ck_act.silu_and_mul(dev(np.ones((4, 8), np.float64)))
    with pytest.raises(ValueError, match="x"):
        ck_act.silu_and_mul(dev(np.ones((8, 4), np.float32)).T)


# ============================================================================ CPU: the emulator
# The kernel source on the CPU emulator of tests/emulator (g++, a std::thread per CUDA thread,
# tiny tunables), against the reference: the kernel's logic without a GPU (not the GPU's
# expf / erff ulps, timing or memory ordering: the GPU tests above stay the judge).
ENTRY = r"""
extern "C" void act(const float* x, float* out, int M, int N, int which, int vec) {
    // which: 0 silu, 1 gelu, 2 gelu_tanh (and mul), 3 swigluoai, 10 + ACT: no-mul
    int width = which < 10 ? N / 2 : N;
    int chunks = (width + ACT_THREADS * vec - 1) / (ACT_THREADS * vec);
#define AM(A, V) if (which == A && vec == V) launch(M * chunks, ACT_THREADS, 0, [&] { \
    act_and_mul_kernel<A, V>(x, out, M, width, chunks); });
#define SW(V) if (which == 3 && vec == V) launch(M * chunks, ACT_THREADS, 0, [&] { \
    swigluoai_and_mul_kernel<V>(x, out, M, width, chunks, 1.702f, 7.0f); });
#define NM(A, V) if (which == 10 + A && vec == V) launch(M * chunks, ACT_THREADS, 0, [&] { \
    act_kernel<A, V>(x, out, M, width, chunks); });
    AM(0, 1) AM(0, 4) AM(1, 1) AM(1, 4) AM(2, 1) AM(2, 4) SW(1) SW(4)
    NM(0, 1) NM(0, 4) NM(1, 4) NM(2, 4) NM(3, 1) NM(3, 4)
}"""
ENTRY_BF16 = r"""
extern "C" void act(const __nv_bfloat16* x, __nv_bfloat16* out, int M, int N, int which, int vec) {
    int width = N / 2;
    int chunks = (width + ACT_THREADS * vec - 1) / (ACT_THREADS * vec);
#define AM(A, V) if (which == A && vec == V) launch(M * chunks, ACT_THREADS, 0, [&] { \
    act_and_mul_kernel<A, V>(x, out, M, width, chunks); });
#define SW(V) if (which == 3 && vec == V) launch(M * chunks, ACT_THREADS, 0, [&] { \
    swigluoai_and_mul_kernel<V>(x, out, M, width, chunks, 1.702f, 7.0f); });
    AM(0, 1) AM(0, 8) AM(1, 1) AM(1, 8) AM(2, 1) AM(2, 8) SW(1) SW(8)
}"""
DEFINES = {"SCALAR_T": "float", "ACT_THREADS": 32}
DEFINES_BF16 = {"SCALAR_T": "__nv_bfloat16", "ACT_THREADS": 32}


emulated = library_fixture("activation.cu", {"fp32": (DEFINES, ENTRY),
                                              "bf16": (DEFINES_BF16, ENTRY_BF16)})


@pytest.mark.simulator
def test_emulated_activation(emulated):
    act = emulated["fp32"]
    rng = np.random.default_rng(9)
    names = {0: "silu", 1: "gelu", 2: "gelu_tanh", 3: "swigluoai"}
    for M, N in ((1, 2), (5, 16), (3, 72)):
        x = (4 * rng.standard_normal((M, N))).astype(np.float32)
        x[0, 0] = 9.0  # past swigluoai's limit
        for which, name in names.items():
            for vec in (1, 4):
                if (N // 2) % vec:
                    continue
                out = np.full((M, N // 2), np.nan, np.float32)
                act.act(ptr(x), ptr(out), M, N, which, vec)
                want = reference.apply_activation(x, name, True)
                assert np.abs(out - want).max() <= 1e-6 * np.abs(want).max(), (name, M, N, vec)
        for a, name in ((0, "silu"), (1, "gelu"), (2, "gelu_tanh"), (3, "relu2")):
            vec = 4 if N % 4 == 0 else 1
            if a in (1, 2) and vec == 1:
                continue  # not instantiated in the entry point
            out = np.full((M, N), np.nan, np.float32)
            act.act(ptr(x), ptr(out), M, N, 10 + a, vec)
            want = reference.apply_activation(x, name, False)
            assert np.abs(out - want).max() <= 1e-6 * np.abs(want).max(), (name, M, N, vec)
    # bf16: vLLM's rounding points (act(gate) rounded before the multiply), bit for bit but
    # for the CPU's expf / erff ulps against NumPy's (a few % for gelu; one rounding of
    # act(gate) * up instead of two differs in ~30% of the elements)
    act16 = emulated["bf16"]
    x = (3 * rng.standard_normal((6, 256))).astype(BF16)
    for which, name in names.items():
        for vec in (1, 8):
            out = np.zeros((6, 128), BF16)
            act16.act(ptr(x), ptr(out), 6, 256, which, vec)
            want = reference.apply_activation(x, name, True)
            assert (out.view(np.uint16) != want.view(np.uint16)).mean() < 0.05, (name, vec)
