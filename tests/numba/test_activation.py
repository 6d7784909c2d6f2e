"""Numba activations (cuda_kernels/numba/activation.py) against the reference, on a real GPU.

    M rows (slots), N = GEMM1 width (2I for the gated forms)

`gpu` tests, outputs poisoned, host arrays in and out (tests/numba/__init__.py says how).

Relative Frobenius error vs the reference on float64 inputs, fp32 <= 1e-5, fp16 / bf16 <= 1e-2
(NaN never passes); in fp16 / bf16 also vLLM's rounding points, bit for bit but for last-ulp
exp / erf flips.
"""
import importlib

import numpy as np
import pytest

import reference
from cuda_kernels import numba as nb
from tests.oracles import assert_output_close, rng_for, rounding_comparable, uniform
from tests.support import DTYPES, full_grid, gpu_marks, runs_kernels

pytestmark = [*gpu_marks("numba"), pytest.mark.usefixtures("numba_poison")]

if runs_kernels("numba"):   # imports numba on its CUDA target: only where it runs
    Ac = importlib.import_module("cuda_kernels.numba.activation")


ACT_DTYPES = full_grid([("silu", "bf16"), ("gelu", "bf16"), ("gelu_tanh", "bf16"),
                   ("swigluoai", "bf16"), ("silu", "fp32"), ("swigluoai", "fp16")],
                  [(a, d) for a in ("silu", "gelu", "gelu_tanh", "swigluoai") for d in DTYPES])


@pytest.mark.parametrize("M,N", full_grid([(1, 2), (37, 14), (130, 1536), (4096, 4096)],
                                     [(1, 2), (37, 14), (256, 256), (130, 1536), (3, 2000),
                                      (4096, 4096)]))
@pytest.mark.parametrize("act,dkey", ACT_DTYPES)
def test_activation_and_mul(act, M, N, dkey):
    dt = DTYPES[dkey]
    x = uniform(rng_for("act", act, M, N), (M, N), 6.0, dt)
    want = reference.apply_activation(x.astype(np.float64), act, True)
    assert_output_close(Ac.apply_activation(x, act, True), want, dt, act)
    if dkey != "fp32":   # vLLM's rounding points: the bits but for last-ulp exp / erf flips
        got = nb.to_host(Ac.apply_activation(x, act, True))
        engine = reference.apply_activation(x, act, True)
        mask = rounding_comparable(x, act, True)     # not where erf / tanh cancel
        assert (got.view(np.uint16) != engine.view(np.uint16))[mask].mean() < 0.01, act


@pytest.mark.parametrize("M,N", [(1, 1), (37, 15), (256, 768)])
@pytest.mark.parametrize("act,dkey", full_grid(
    [("silu", "bf16"), ("gelu", "bf16"), ("gelu_tanh", "bf16"), ("relu2", "bf16"),
     ("relu2", "fp32")],
    [(a, d) for a in ("silu", "gelu", "gelu_tanh", "relu2") for d in DTYPES]))
def test_activation_no_mul(act, M, N, dkey):
    dt = DTYPES[dkey]
    x = uniform(rng_for("nomul", act, M, N), (M, N), 4.0, dt)
    want = reference.apply_activation(x.astype(np.float64), act, False)
    assert_output_close(Ac.apply_activation(x, act, False), want, dt, act)
