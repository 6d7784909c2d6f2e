"""Numba routing (cuda_kernels/numba/routing.py, routing_kernels.py) against the reference,
on a real GPU, at the CuPy tests' sizes; every kernel flavour ("keys", "warp": shuffles,
"block": shared memory).

    T tokens, E experts, K top-k, G expert groups

`gpu` tests, outputs poisoned, host arrays in and out (tests/numba/__init__.py says how).

Ids exact, except at true near-ties: expf and the warp-tree softmax sum may differ from NumPy
by an ulp, so two experts whose reference selection values agree within 1e-6 relative may
swap (at most 1% of rows); ids distinct in every row; weights within 1e-5 on the rows whose
ids match (routing math is fp32 for every input dtype).
"""
import importlib

import numpy as np
import pytest

import reference
from cuda_kernels import numba as nb
from tests.oracles import (assert_routing_matches, non_finite_group_logits, rng_for,
                           selection_values, uniform)
from tests.support import DTYPES, full_grid, gpu_marks, runs_kernels

pytestmark = [*gpu_marks("numba"), pytest.mark.usefixtures("numba_poison")]

if runs_kernels("numba"):   # imports numba on its CUDA target: only where it runs
    R = importlib.import_module("cuda_kernels.numba.routing")

FLAVORS = ("keys", "warp", "block")
ALL_DTYPES = tuple(DTYPES)
MAIN_DTYPE = full_grid(("bf16",), ALL_DTYPES)     # grids that run in every dtype only when full


def assert_routing(got, want, sel, what):
    assert_routing_matches(got, want, sel, what, to_host=nb.to_host)


def draw_logits(T, E, dtype, *params):
    return uniform(rng_for("logits", T, E, str(dtype), *params), (T, E), 2.0).astype(dtype)


@pytest.fixture(params=FLAVORS)
def flavor(request, monkeypatch):
    monkeypatch.setattr(R, "DEFAULT_FLAVOR", request.param)
    return request.param


@pytest.mark.parametrize("dkey", ALL_DTYPES)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("E,K", full_grid([(8, 2), (60, 4), (257, 9), (1024, 32)],
                                     [(8, 2), (16, 1), (60, 4), (128, 8), (256, 8), (257, 9),
                                      (512, 22), (1024, 32)]))
@pytest.mark.parametrize("T", full_grid([1, 1024], [1, 67, 1024]))
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_fused_topk(T, E, K, renormalize, dkey, flavor, scoring):
    x = draw_logits(T, E, DTYPES[dkey], renormalize)
    got = R.fused_topk(None, x, K, renormalize, scoring_func=scoring)
    want = reference.fused_topk(None, x, K, renormalize, scoring_func=scoring)
    assert_routing(got, want, selection_values(x, scoring), f"fused_topk {flavor}")
    np.testing.assert_array_equal(got[2], want[2])


@pytest.mark.parametrize("dkey", MAIN_DTYPE)
@pytest.mark.parametrize("scaling", [1.0, 2.5])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("E,K", full_grid([(16, 2), (256, 8), (512, 22)],
                                     [(16, 2), (128, 8), (256, 8), (384, 8), (512, 22)]))
def test_fused_topk_bias(E, K, scaling, scoring, dkey, flavor):
    x = draw_logits(333, E, DTYPES[dkey], scaling)
    bias = uniform(rng_for("bias", E), (E,), 0.2)
    for renorm in (False, True):
        assert_routing(R.fused_topk_bias(None, x, scoring, bias, K, renorm,
                                         routed_scaling_factor=scaling),
                       reference.fused_topk_bias(None, x, scoring, bias, K, renorm,
                                                 routed_scaling_factor=scaling),
                       selection_values(x, scoring, bias=bias), f"fused_topk_bias {flavor}")


@pytest.mark.parametrize("dkey", MAIN_DTYPE)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("E,K,Gr,TG", full_grid([(16, 2, 8, 2), (256, 8, 8, 4), (96, 6, 6, 3)],
                                           [(16, 2, 8, 2), (128, 2, 8, 2), (256, 8, 8, 4),
                                            (384, 8, 1, 1), (512, 22, 1, 1), (96, 6, 6, 3)]))
def test_grouped_topk(E, K, Gr, TG, scoring, with_bias, dkey, flavor):
    x = draw_logits(257, E, DTYPES[dkey], Gr, scoring)
    bias = uniform(rng_for("gbias", E), (E,), 0.2) if with_bias else None
    for renorm, scale in ((False, 1.0), (True, 2.5)):
        args = (None, x, K, renorm, Gr, TG, scoring, scale, bias)
        assert_routing(R.grouped_topk(*args), reference.grouped_topk(*args),
                       selection_values(x, scoring, bias, Gr, TG, kernel="grouped"),
                       f"grouped_topk {flavor}")


def test_routing_ties_nan_inf_empty_fp64(flavor):
    x = draw_logits(6, 64, np.float32, "nasty")
    x[0, 5] = np.nan
    x[1, 9] = np.inf
    x[2] = -np.inf
    x[3] = 0.0                                     # all tied: ids 0..K-1
    for scoring in ("softmax", "sigmoid"):
        want = reference.fused_topk(None, x, 4, True, scoring_func=scoring)
        got = R.fused_topk(None, x, 4, True, scoring_func=scoring)
        np.testing.assert_array_equal(nb.to_host(got[1]), want[1])
        np.testing.assert_allclose(nb.to_host(got[0]), want[0], rtol=1e-5, atol=1e-7)
        assert nb.to_host(got[1])[3].tolist() == [0, 1, 2, 3]
    assert (nb.to_host(R.fused_topk(None, x, 4, True)[0])[:3] == 0).all()   # non-finite -> 0
    for args in ((None, x, 4, True, 8, 2, "sigmoid", 1.0, uniform(rng_for("b"), (64,), 0.2)),
                 (None, x, 4, True, 1, 1, "softmax", 2.5, None),
                 (None, x, 4, False, 8, 2, "sigmoid", 2.5, None)):
        got, want = R.grouped_topk(*args), reference.grouped_topk(*args)
        np.testing.assert_array_equal(nb.to_host(got[1]), want[1])
        np.testing.assert_allclose(nb.to_host(got[0]), want[0], rtol=1e-5, atol=1e-7)
    w, ids, tei = R.fused_topk(None, np.zeros((0, 32), np.float32), 4, True, np.int64)
    assert w.shape == (0, 4) and ids.dtype == np.int64
    x64 = draw_logits(50, 40, np.float64)
    assert_routing(R.fused_topk(None, x64, 5, True), reference.fused_topk(None, x64, 5, True),
                   selection_values(x64), "fp64 logits")


@pytest.mark.parametrize("num_finite", [0, 15])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("num_experts", [512, 1024])
def test_grouped_topk_single_group_non_finite(num_finite, renormalize, num_experts, flavor):
    """vLLM's test_grouped_topk_single_group_nonfinite_scores on every flavour."""
    x = non_finite_group_logits(num_experts, num_finite)
    args = (None, x, 16, renormalize, 1, 1, "sigmoid", 2.5, np.zeros(num_experts, np.float32))
    got, want = R.grouped_topk(*args), reference.grouped_topk(*args)
    np.testing.assert_array_equal(nb.to_host(got[1]), want[1])
    np.testing.assert_allclose(nb.to_host(got[0]), want[0], atol=2e-5, rtol=0)


@pytest.mark.parametrize("case", ["softmax", "bias", "grouped", "sigmoid", "custom"])
def test_select_experts_on_device_arrays(case):
    T, E, K = 45, 64, 6
    x = draw_logits(T, E, np.float32, case)
    h = np.ones((T, 8), np.float32)
    bias = uniform(rng_for("sb"), (E,), 0.2)
    kw = dict(softmax={}, bias=dict(e_score_correction_bias=nb.to_device(bias)),
              grouped=dict(topk_group=2, num_expert_group=8),
              sigmoid=dict(scoring_func="sigmoid"),
              custom=dict(custom_routing_function=reference.llama4_custom_routing_function))[case]
    ref_kw = dict(kw, e_score_correction_bias=bias) if case == "bias" else kw
    grouped = case == "grouped"
    if case == "custom":   # the custom function is NumPy code: host arrays
        got = R.select_experts(h, x, K, grouped, True, **kw)
    else:
        got = R.select_experts(nb.to_device(h), nb.to_device(x), K, grouped, True,
                               indices_type=np.int64, **kw)
    want = reference.select_experts(h, x, K, grouped, True,
                                    indices_type=None if case == "custom" else np.int64, **ref_kw)
    sel = selection_values(x, "sigmoid" if case in ("sigmoid",) else "softmax",
                           bias if case == "bias" else None, 8 if grouped else 1, 2)
    if case == "custom":
        np.testing.assert_array_equal(got[1], want[1])
    else:
        assert_routing(got, want, sel, f"select_experts {case}")
