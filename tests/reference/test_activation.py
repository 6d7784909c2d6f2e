"""Activations (`reference/activation.py`) against per-slot float64 formulas.

    M = rows (slots), N = GEMM1 width (2I for the gated forms)

The inputs are scaled so that gates and ups cross swigluoai's clamp (|x| > 7) and the
tails of every function; tolerances by dtype (each output is rounded once).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from tests.oracles import BF16, activation_vec, assert_close, rng_for

from reference import (
    apply_activation,
    gelu_and_mul,
    gelu_tanh_and_mul,
    silu_and_mul,
    swigluoai_and_mul,
)

DTYPES = [np.float32, BF16, np.float16, np.float64]
GATED = ["silu", "gelu", "gelu_tanh", "swigluoai"]
NO_MUL = ["silu", "gelu", "gelu_tanh", "relu2"]


def inputs(rng, rows, cols, dtype, scale=4.0):
    return (rng.standard_normal((rows, cols)) * scale).astype(dtype)


def oracle(x, activation, is_act_and_mul=True):
    return np.stack([activation_vec(row.astype(np.float64), activation, is_act_and_mul) for row in x])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("rows, inter", [(1, 8), (13, 24), (64, 7)])
def test_gated_activation_matches_oracle(dtype, activation, rows, inter):
    rng = rng_for("gated", np.dtype(dtype).name, activation, rows, inter)
    x = inputs(rng, rows, 2 * inter, dtype)
    out = apply_activation(x, activation)
    assert out.dtype == x.dtype and out.shape == (rows, inter)
    assert_close(out, oracle(x, activation), dtype, what=activation)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("activation", NO_MUL)
def test_no_mul_activation_matches_oracle(dtype, activation):
    rng = rng_for("no mul", np.dtype(dtype).name, activation)
    x = inputs(rng, 13, 24, dtype)
    out = apply_activation(x, activation, is_act_and_mul=False)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close(out, oracle(x, activation, False), dtype, what=activation)
    # vLLM's "<name>_no_mul" spelling means the same
    np.testing.assert_array_equal(apply_activation(x, activation + "_no_mul"), out)


@pytest.mark.parametrize("fn, activation", [(silu_and_mul, "silu"), (gelu_and_mul, "gelu"),
                                            (gelu_tanh_and_mul, "gelu_tanh"),
                                            (swigluoai_and_mul, "swigluoai")])
def test_named_functions_are_apply_activation(fn, activation):
    x = inputs(rng_for("named", activation), 5, 16, np.float32)
    np.testing.assert_array_equal(fn(x), apply_activation(x, activation))


def test_spot_values():
    # silu(1) = 1/(1+e^-1); gelu(1) = Phi(1); gelu_tanh(1); relu2
    x = np.array([[1.0, 2.0]])                       # gate 1, up 2
    np.testing.assert_allclose(silu_and_mul(x), [[2 * 0.7310585786300049]], rtol=1e-15)
    np.testing.assert_allclose(gelu_and_mul(x), [[2 * 0.8413447460685429]], rtol=1e-15)
    np.testing.assert_allclose(gelu_tanh_and_mul(x), [[2 * 0.8411919906082768]], rtol=1e-12)
    np.testing.assert_array_equal(apply_activation(np.array([[-2.0, 3.0, 0.0]]), "relu2", False),
                                  [[0.0, 9.0, 0.0]])


def test_swigluoai_interleaved_and_clamped():
    alpha, limit = 1.702, 7.0
    # columns: gate0, up0, gate1, up1, gate2, up2
    x = np.array([[10.0, -10.0, 0.0, 0.5, -3.0, 9.0]])
    sig = lambda v: 1 / (1 + math.exp(-v))
    want = [(-limit + 1) * limit * sig(alpha * limit),     # gate clamped to 7, up to -7
            (0.5 + 1) * 0.0,                              # gate 0 kills the row
            (limit + 1) * -3.0 * sig(alpha * -3.0)]      # gate below -7 is not clamped: -3 stays
    np.testing.assert_allclose(swigluoai_and_mul(x), [want], rtol=1e-15)
    # the gate has no lower clamp: a very negative gate gives ~0, not a clamped value
    y = swigluoai_and_mul(np.array([[-50.0, 1.0]]))
    assert abs(y[0, 0]) < 1e-30
    # not the split (gate | up) layout of the other activations
    x = inputs(rng_for("swiglu layout"), 4, 8, np.float64)
    half = 4
    split = (np.clip(x[:, half:], -limit, limit) + 1) * np.minimum(x[:, :half], limit) \
        / (1 + np.exp(-alpha * np.minimum(x[:, :half], limit)))
    assert not np.allclose(swigluoai_and_mul(x), split)


@pytest.mark.parametrize("activation", GATED + ["relu2"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=lambda d: np.dtype(d).name)
def test_large_magnitudes_stay_finite(activation, dtype):
    # |x| up to 1e4: exp overflows in the denominators (-> 0, not NaN), x^3 stays finite
    rng = rng_for("large", activation, np.dtype(dtype).name)
    x = (np.sign(rng.standard_normal((8, 16))) * 10.0 ** rng.uniform(-3, 4, (8, 16))).astype(dtype)
    gated = activation != "relu2"
    out = apply_activation(x, activation, is_act_and_mul=gated)
    assert np.isfinite(out.astype(np.float64)).all()
    assert_close(out, oracle(x, activation, gated), dtype, what=activation)


@pytest.mark.parametrize("activation", GATED)
def test_empty_rows(activation):
    out = apply_activation(np.zeros((0, 8), np.float32), activation)
    assert out.shape == (0, 4) and out.dtype == np.float32


# --------------------------------------------------------------------------------------------
# vLLM's rounding points (its CUDA activation kernels, the GPU path of the fused MoE)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_gated_rounds_the_activation_before_the_multiply(dtype, activation):
    """vLLM's act_and_mul kernel returns (T)(ACT(gate) * (float)up) where ACT itself returns
    a T: act(gate) is rounded to the input dtype, then multiplied by up in fp32 and rounded
    again. Bit for bit against that, and different from a single rounding somewhere."""
    rng = rng_for("double rounding", np.dtype(dtype).name, activation)
    x = inputs(rng, 64, 256, dtype, scale=3.0)
    up = x[:, 128:].astype(np.float32)
    # round(act(gate)): the stage itself with up = 1 (a second rounding of it is exact)
    act_rounded = apply_activation(np.concatenate([x[:, :128], np.ones_like(x[:, 128:])], 1),
                                   activation)
    want = (act_rounded.astype(np.float32) * up).astype(dtype)
    got = apply_activation(x, activation)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    # a single rounding of act(gate) * up (fp64 oracle) differs somewhere
    act = np.stack([activation_vec(np.concatenate([g, np.ones_like(g)]), activation)
                    for g in x[:, :128].astype(np.float64)])
    once = (act * up.astype(np.float64)).astype(dtype)
    assert (got.view(np.uint16) != once.view(np.uint16)).any()


@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=lambda d: np.dtype(d).name)
def test_swigluoai_computes_in_vllms_order(dtype):
    """vLLM: (T)((u + 1) * g / (1 + expf(-g * alpha))), fp32, one rounding. The order shows
    in fp32 (the old (up + 1) * (g * sigmoid(alpha g)) differs by an ulp at many elements);
    in bf16 it rarely survives the rounding."""
    rng = rng_for("swigluoai order", np.dtype(dtype).name)
    x = inputs(rng, 64, 256, dtype, scale=4.0)
    g = np.minimum(x[:, 0::2].astype(np.float32), np.float32(7.0))
    u = np.clip(x[:, 1::2].astype(np.float32), np.float32(-7.0), np.float32(7.0))
    with np.errstate(over="ignore"):
        want = (((u + np.float32(1)) * g) / (np.float32(1) + np.exp(-g * np.float32(1.702))))
    bits = np.uint16 if np.dtype(dtype) == BF16 else np.uint32
    np.testing.assert_array_equal(swigluoai_and_mul(x).view(bits),
                                  want.astype(dtype).view(bits))
