"""Numba combine (cuda_kernels/numba/combine.py: moe_sum, pad-aware too) in the CUDA
simulator against the reference.

    T tokens, K top-k, H hidden

fp32 within 1e-5 and fp16 / bf16 within 1e-2 (relative Frobenius); NaN inputs stay NaN in the
same places; outputs poisoned before every launch.
"""
import importlib

import numpy as np
import pytest

import reference
from tests.oracles import assert_close_where_defined as close
from tests.oracles import rng_for, uniform
from tests.support import DTYPES

Cb = importlib.import_module("cuda_kernels.numba.combine")

pytestmark = [pytest.mark.simulator, pytest.mark.usefixtures("numba_poison")]


@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("T,K,H", [(1, 2, 5), (4, 3, 17), (3, 1, 4), (2, 3, 264)])
def test_moe_sum(T, K, H, dkey):
    x = uniform(rng_for("sum", T, K, H), (T, K, H), 1.0).astype(DTYPES[dkey])
    got, want = Cb.moe_sum(x), reference.moe_sum(x)
    close(got, want, DTYPES[dkey], "moe_sum")
    if dkey == "fp32":   # the same order of fp32 additions as NumPy: bit for bit
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("with_map", [False, True])
def test_moe_sum_pad_aware(dkey, with_map):
    """vLLM's moe_sum(input, output, topk_ids, expert_map): a slot with a negative id (or a
    non-local expert) is never read; a token with none left sums to 0."""
    x = uniform(rng_for("sum-pad", dkey, with_map), (5, 3, 9), 1.0).astype(DTYPES[dkey])
    ids = np.array([[0, 1, 2], [-1, 3, 1], [-1, -1, -1], [2, -1, 0], [3, 3, 1]], np.int32)
    emap = np.array([0, -1, 1, 2], np.int32) if with_map else None
    live = reference.combine.slot_is_live(ids, emap)
    x[~live] = np.nan                                     # rows the GEMMs never wrote
    got, want = Cb.moe_sum(x, ids, emap), reference.moe_sum(x, ids, emap)
    close(got, want, DTYPES[dkey], "moe_sum pad-aware")
    assert (got[2].astype(np.float32) == 0).all()


def test_moe_sum_empty_and_bad_inputs():
    assert Cb.moe_sum(np.zeros((0, 2, 4), np.float16)).shape == (0, 4)
    with pytest.raises(ValueError, match="x: expected 3 dimensions"):
        Cb.moe_sum(np.ones((2, 4), np.float32))
