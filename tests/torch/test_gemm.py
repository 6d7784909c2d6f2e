"""The torch grouped GEMM (cuda_kernels/torch/gemm.py: a loop over experts, or torch's
grouped_mm) against the NumPy reference, with and without router weights, biases and an
expert map.

    T = tokens, E = experts, K = top-k, N output width, Kd inner size, B = block size
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import reference
from cuda_kernels import torch as tb
from cuda_kernels.torch import to_host as host
from tests.oracles import TOL, gemm_problem
from tests.oracles import rel_err_where_defined as rel

DTYPES = [np.float32, ml_dtypes.bfloat16]

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize("ep", [False, True])
def test_grouped_gemm(dtype, impl, ep):
    E_local, expert_map = reference.determine_expert_map(2, 0, 6) if ep else (6, None)
    for mul, bias in ((False, None), (True, dtype)):
        args, want = gemm_problem(21, 6, 2, 48, 32, 8, dtype, expert_map=expert_map,
                                  E_local=E_local, bias=bias, mul=mul, seed=impl)
        got = host(tb.grouped_gemm(*args, impl=impl))
        assert got.dtype == np.dtype(dtype)
        assert not np.isnan(got).any()
        assert rel(got, want) <= TOL[np.dtype(dtype)]


def test_grouped_gemm_t0():
    args, _ = gemm_problem(0, 6, 2, 48, 32, 8, np.float32, bias=np.float32, mul=True)
    got = host(tb.grouped_gemm(*args))
    assert got.shape == (0, 48)
