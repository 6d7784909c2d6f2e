"""Torch activations (cuda_kernels/torch/activation.py) against the NumPy reference, gated
and not; in bf16 also the reference's rounding points (vLLM's kernels).

    M rows (slots), N = GEMM1 width (2I for the gated forms)
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import reference
from cuda_kernels import torch as tb
from cuda_kernels.torch import to_host as host
from tests.oracles import TOL, rng_for, rounding_comparable
from tests.oracles import rel_err_where_defined as rel

DTYPES = [np.float32, ml_dtypes.bfloat16]

torch = pytest.importorskip("torch")


ACTS = [("silu", True), ("gelu", True), ("gelu_tanh", True), ("swigluoai", True),
        ("silu", False), ("gelu", False), ("gelu_tanh", False), ("relu2", False)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act,mul", ACTS)
def test_apply_activation(dtype, act, mul):
    rng = rng_for("act", str(dtype), act, mul)
    x = (rng.standard_normal((19, 24)) * 4).astype(dtype)     # * 4: reach swigluoai's clamp
    want = reference.apply_activation(reference.exact(x), act, mul)
    got = host(tb.apply_activation(x, act, mul))
    assert got.dtype == np.dtype(dtype) and rel(got, want) <= TOL[np.dtype(dtype)]
    if got.itemsize == 2:
        # the reference's rounding points (vLLM's kernels): the bf16 bits agree but for
        # last-ulp flips where torch's and NumPy's fp32 exp / erf differ (up to ~3% for gelu;
        # one rounding of act(gate) * up instead of two differs in ~30% of the elements)
        engine = reference.apply_activation(x, act, mul)
        mask = rounding_comparable(x, act, mul)      # not where erf / tanh cancel
        assert (got.view(np.uint16) != engine.view(np.uint16))[mask].mean() < 0.05


def test_apply_activation_errors():
    x = np.ones((2, 5), np.float32)
    with pytest.raises(ValueError, match="even"):
        tb.apply_activation(x, "silu", True)
    with pytest.raises(ValueError, match="activation"):
        tb.apply_activation(np.ones((2, 4), np.float32), "tanh", True)
