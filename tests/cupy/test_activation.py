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
from tests.oracles import BF16, assert_output_close, rng_for, rounding_comparable, uniform
from tests.support import DTYPES, gpu_marks

pytestmark = [*gpu_marks("cupy"), pytest.mark.usefixtures("cupy_poison")]


ACTS_MUL = ["silu", "gelu", "gelu_tanh", "swigluoai"]
ACTS_NO_MUL = ["silu", "gelu", "gelu_tanh", "relu2"]


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
