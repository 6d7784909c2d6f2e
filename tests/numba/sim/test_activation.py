"""Numba activations (cuda_kernels/numba/activation.py) in the CUDA simulator against the
reference.

    M rows, N columns (2I for the gated forms)

fp32 within 1e-5 and fp16 / bf16 within 1e-2 (relative Frobenius; the simulator computes in
NumPy fp32 like the reference, so these usually match bit for bit, and vLLM's rounding points
do exactly); NaN inputs stay NaN in the same places; outputs poisoned before every launch.
"""
import importlib

import numpy as np
import pytest

import reference
from tests.oracles import assert_close_where_defined as close
from tests.oracles import rng_for, uniform
from tests.support import DTYPES

Ac = importlib.import_module("cuda_kernels.numba.activation")

pytestmark = [pytest.mark.simulator, pytest.mark.usefixtures("numba_poison")]


@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("M,N", [(1, 2), (3, 10), (2, 16), (5, 36), (2, 528)])
# (2, 16): 8-byte words; (2, 528): a thread's 4 columns per step, and a tail
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "swigluoai"])
def test_activation_and_mul(act, M, N, dkey):
    x = uniform(rng_for("act", act, M, N), (M, N), 9.0).astype(DTYPES[dkey])
    close(Ac.apply_activation(x, act, True), reference.apply_activation(x, act, True),
          DTYPES[dkey], act)


@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu2"])
def test_activation_no_mul(act, dkey):
    for shape in ((3, 7), (2, 8)):   # single elements, then 8-byte words
        x = uniform(rng_for("nomul", act, shape), shape, 4.0).astype(DTYPES[dkey])
        close(Ac.apply_activation(x, act, False), reference.apply_activation(x, act, False),
              DTYPES[dkey], act)
    close(Ac.apply_activation(x, act + "_no_mul"), reference.apply_activation(x, act, False),
          DTYPES[dkey], act + "_no_mul")


def test_named_functions_nan_and_empty():
    x = uniform(rng_for("named"), (4, 8), 3.0)
    x[1, 2] = np.nan
    x[2, 5] = np.nan
    for name in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul", "swigluoai_and_mul"):
        close(getattr(Ac, name)(x), getattr(reference, name)(x), np.float32, name)
    close(Ac.swigluoai_and_mul(x, alpha=1.2, limit=2.0),
          reference.swigluoai_and_mul(x, alpha=1.2, limit=2.0), np.float32, "swiglu args")
    assert Ac.silu_and_mul(np.zeros((0, 6), np.float32)).shape == (0, 3)


def test_activation_bad_inputs():
    x = np.ones((2, 5), np.float32)
    with pytest.raises(ValueError, match="x: expected an even last dimension"):
        Ac.silu_and_mul(x)
    with pytest.raises(ValueError, match="activation: expected one of"):
        Ac.apply_activation(np.ones((2, 4), np.float32), "tanh")
    with pytest.raises(ValueError, match="activation: 'relu2' has no gated form"):
        Ac.apply_activation(np.ones((2, 4), np.float32), "relu2", True)
    with pytest.raises(TypeError, match="x: expected dtype in"):
        Ac.silu_and_mul(np.ones((2, 4), np.int32))


@pytest.mark.parametrize("dkey", ["fp16", "bf16"])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "swigluoai"])
@pytest.mark.parametrize("N", [10, 16, 32])   # single elements, 8-byte words, 16-byte chunks
def test_activation_rounding_points_bit_for_bit(act, dkey, N):
    """vLLM's rounding points (act(gate) rounded before the multiply; swigluoai once, in its
    order): the simulator's NumPy fp32 math equals the reference bit for bit on every path."""
    x = uniform(rng_for("act-bits", act, dkey, N), (4, N), 6.0).astype(DTYPES[dkey])
    got = Ac.apply_activation(x, act, True)
    want = reference.apply_activation(x, act, True)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
