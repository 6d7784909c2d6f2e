"""Numba combine (cuda_kernels/numba/combine.py: moe_sum, pad-aware too) against the reference,
on a real GPU.

    T tokens, K top-k, H hidden

`gpu` tests, outputs poisoned, host arrays in and out (tests/numba/__init__.py says how).

Relative Frobenius error vs the reference on float64 inputs, fp32 <= 1e-5, fp16 / bf16 <= 1e-2.
"""
import importlib

import numpy as np
import pytest

import reference
from tests.oracles import assert_output_close, distinct_topk_ids, rng_for, uniform
from tests.support import DTYPES, full_grid, gpu_marks, runs_kernels

pytestmark = [*gpu_marks("numba"), pytest.mark.usefixtures("numba_poison")]

if runs_kernels("numba"):   # imports numba on its CUDA target: only where it runs
    Cb = importlib.import_module("cuda_kernels.numba.combine")


@pytest.mark.parametrize("T,K,H,dkey", full_grid(
    [(1, 2, 4096, "bf16"), (33, 8, 2048, "bf16"), (33, 8, 2048, "fp32"), (33, 8, 2048, "fp16"),
     (7, 40, 7, "bf16"), (4096, 8, 7168, "bf16")],
    [(T, K, H, d) for (T, K, H) in ((1, 2, 4096), (33, 8, 2048), (512, 1, 128), (7, 6, 7),
                                    (7, 40, 7), (4096, 8, 7168)) for d in DTYPES]))
def test_moe_sum(T, K, H, dkey):
    dt = DTYPES[dkey]
    x = uniform(rng_for("sum", T, K, H), (T, K, H), 1.0, dt)
    assert_output_close(Cb.moe_sum(x), reference.moe_sum(x.astype(np.float64)), dt, "moe_sum")
    ids = distinct_topk_ids(rng_for("sum-ids", T, K), T, 2 * K + 1, K)
    ids[:: 3, 0] = -1                              # slots routed nowhere: never read
    live = reference.combine.slot_is_live(ids)
    x_pad = np.where(live[:, :, None], x, np.nan).astype(dt)
    assert_output_close(Cb.moe_sum(x_pad, ids), reference.moe_sum(x.astype(np.float64), ids),
                        dt, "moe_sum pad-aware")
