"""Numba routing kernels in the CUDA simulator against reference/routing.py.

    T tokens, E experts, K top-k, G expert groups

The simulator runs the "block" flavour (shared-memory reductions; it has no warp shuffles)
in NumPy fp32, the reference's own arithmetic, so ids must match exactly and weights within
fp32's 1e-5 (relative Frobenius). Outputs are poisoned (NaN / POISON_INT) before every
launch so an element the kernel forgets fails. Tiny shapes: a simulated thread costs ~0.5 ms.
"""
import importlib

import numpy as np
import pytest
from tests.oracles import BF16, non_finite_group_logits, rel_err, rng_for, uniform
from tests.support import DTYPES

import reference
from cuda_kernels import numba as nb

R = importlib.import_module("cuda_kernels.numba.routing")
A = importlib.import_module("cuda_kernels.numba._arrays")

pytestmark = [pytest.mark.simulator, pytest.mark.usefixtures("numba_poison")]


def logits_for(T, E, dtype, *params):
    return uniform(rng_for("route", T, E, str(dtype), *params), (T, E), 2.0).astype(dtype)


def assert_route(got, want, what):
    (gw, gi), (ww, wi) = got[:2], want[:2]
    assert gi.dtype == wi.dtype and gw.dtype == np.float32, what
    np.testing.assert_array_equal(gi, wi, err_msg=f"{what}: ids")
    nan_g, nan_w = np.isnan(gw), np.isnan(ww)
    np.testing.assert_array_equal(nan_g, nan_w, err_msg=f"{what}: NaN weights")
    rows = ~nan_w.any(axis=1)
    if rows.any():
        assert rel_err(gw[rows], ww[rows]) <= 1e-5, what


def test_the_simulator_is_on():
    ok, why = nb.availability()
    assert ok and "CUDA simulator" in why
    assert R.DEFAULT_FLAVOR == "block"


@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("T,E,K", [(1, 8, 2), (5, 16, 4), (3, 6, 6), (2, 40, 3)])
def test_fused_topk(T, E, K, renormalize, dkey):
    x = logits_for(T, E, DTYPES[dkey], renormalize)
    got = R.fused_topk(None, x, K, renormalize)
    want = reference.fused_topk(None, x, K, renormalize)
    assert_route(got, want, "fused_topk")
    np.testing.assert_array_equal(got[2], want[2], err_msg="token_expert_indices")


@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_topk_sigmoid(renormalize):
    """vLLM's fused_topk(scoring_func="sigmoid") (topk_sigmoid)."""
    x = logits_for(5, 16, BF16, "sigmoid")
    assert_route(R.fused_topk(None, x, 4, renormalize, scoring_func="sigmoid"),
                 reference.fused_topk(None, x, 4, renormalize, scoring_func="sigmoid"),
                 "fused_topk sigmoid")


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("scaling", [1.0, 2.5])
@pytest.mark.parametrize("T,E,K", [(3, 16, 2), (2, 12, 5)])
def test_fused_topk_bias(T, E, K, scaling, scoring):
    x = logits_for(T, E, np.float32, scaling, scoring)
    bias = uniform(rng_for("bias", E), (E,), 0.3)
    for renorm in (False, True):
        assert_route(R.fused_topk_bias(None, x, scoring, bias, K, renorm,
                                       routed_scaling_factor=scaling),
                     reference.fused_topk_bias(None, x, scoring, bias, K, renorm,
                                               routed_scaling_factor=scaling),
                     "fused_topk_bias")


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("E,K,G,TG,dkey", [(16, 2, 4, 2, "fp32"), (12, 3, 3, 2, "bf16"),
                                           (8, 2, 8, 2, "fp16"), (10, 4, 1, 1, "bf16")])
def test_grouped_topk(E, K, G, TG, dkey, scoring, with_bias):
    """bf16 / fp16 logits: the softmax scores rounded to the logits' dtype, as vLLM."""
    T = 3
    x = logits_for(T, E, DTYPES[dkey], G, scoring)
    bias = uniform(rng_for("gbias", E), (E,), 0.3) if with_bias else None
    args = (None, x, K, True, G, TG, scoring, 2.5, bias)
    assert_route(R.grouped_topk(*args), reference.grouped_topk(*args), "grouped_topk")


def test_sqrt_softplus_scores():
    """DeepSeek-V4's scores: sqrt(softplus(x)) with softplus(x) = x above 20; NaN and +-inf
    logits score 0 (fused_topk_bias' non-finite rule), no bias as with one."""
    x = (12 * logits_for(4, 16, np.float32, "softplus")).astype(np.float32)
    x[0, 3], x[1, 6], x[2, :4], x[3, 9] = np.nan, np.inf, -np.inf, 21.0
    for bias in (None, uniform(rng_for("spbias", 16), (16,), 0.3)):
        for renorm in (False, True):
            args = (None, x, "sqrtsoftplus", bias, 3, renorm, None, 1.5)
            assert_route(R.fused_topk_bias(*args), reference.fused_topk_bias(*args),
                         f"sqrtsoftplus bias={bias is not None} renorm={renorm}")


def test_sqrt_softplus_goes_with_fused_topk_bias_only():
    x = logits_for(2, 8, np.float32, "sp-only")
    with pytest.raises(ValueError, match="scoring_func"):
        R.fused_topk(None, x, 2, True, scoring_func="sqrtsoftplus")
    with pytest.raises(ValueError, match="scoring_func"):
        R.grouped_topk(None, x, 2, True, 2, 1, "sqrtsoftplus")


def test_ties_go_to_the_lowest_id():
    x = np.zeros((2, 8), np.float32)
    x[1, [2, 5, 7]] = 1.0
    assert_route(R.fused_topk(None, x, 3, False), reference.fused_topk(None, x, 3, False),
                 "ties")
    assert R.fused_topk(None, x, 3, False)[1].tolist() == [[0, 1, 2], [2, 5, 7]]


def test_nan_and_inf_rows():
    """vLLM's non-finite rules. fused_topk (topk_softmax): a non-finite score is 0, so a row
    with a NaN logit, a +inf one or only -inf routes to the K lowest ids at weight 0.
    grouped_topk: an expert with a non-finite scoring input is invalid (ranked last, weight
    0); a row with no valid expert gets 1/K (renormalize) or 0."""
    x = logits_for(5, 8, np.float32, "nan")
    x[0, 3] = np.nan
    x[1, 6] = np.inf
    x[2, :] = -np.inf
    x[3, :] = np.nan
    for renorm in (True, False):
        assert_route(R.fused_topk(None, x, 3, renorm), reference.fused_topk(None, x, 3, renorm),
                     "nan")
        assert_route(R.fused_topk(None, x, 3, renorm, scoring_func="sigmoid"),
                     reference.fused_topk(None, x, 3, renorm, scoring_func="sigmoid"),
                     "sigmoid nan")
    w, ids, _ = R.fused_topk(None, x, 3, True)
    assert (w[:4] == 0).all() and (w[4] > 0).all()
    assert (ids[:4] == np.arange(3)).all()
    for renorm in (True, False):
        for args in ((None, x, 3, renorm, 2, 1, "sigmoid", 1.0, None),
                     (None, x, 3, renorm, 4, 2, "sigmoid", 1.0, uniform(rng_for("nb"), (8,), 0.3)),
                     (None, x, 3, renorm, 1, 1, "softmax", 2.5, None)):
            got = R.grouped_topk(*args)
            assert_route(got, reference.grouped_topk(*args), f"grouped nan {args[6]}")
            assert np.isfinite(got[0]).all()


@pytest.mark.parametrize("num_finite", [0, 15])
@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_topk_single_group_non_finite(num_finite, renormalize):
    """vLLM's test_grouped_topk_single_group_nonfinite_scores (E = 64 here: the simulator)."""
    x = non_finite_group_logits(64, num_finite)
    args = (None, x, 16, renormalize, 1, 1, "sigmoid", 2.5, np.zeros(64, np.float32))
    got = R.grouped_topk(*args)
    assert_route(got, reference.grouped_topk(*args), "single group non-finite")
    if num_finite == 0:
        assert (got[0] == (1 / 16 if renormalize else 0.0)).all()


def test_empty_batch_indices_type_and_fp64():
    x = np.zeros((0, 8), np.float32)
    w, ids, tei = R.fused_topk(None, x, 2, True, indices_type=np.int64)
    assert w.shape == ids.shape == tei.shape == (0, 2) and ids.dtype == np.int64
    x = logits_for(3, 8, np.float64)
    got = R.fused_topk(None, x, 2, True, indices_type=np.int64)
    want = reference.fused_topk(None, x, 2, True, indices_type=np.int64)
    assert got[1].dtype == np.int64
    assert_route(got, want, "fp64 logits, int64 ids")


@pytest.mark.parametrize("case", ["softmax", "bias", "grouped", "sigmoid", "sigmoid_bias",
                                  "custom"])
def test_select_experts_dispatch(case):
    T, E, K = 3, 8, 2
    x = logits_for(T, E, np.float32, case)
    h = np.ones((T, 4), np.float32)
    bias = uniform(rng_for("sb"), (E,), 0.3)
    kw = dict(softmax={}, bias=dict(e_score_correction_bias=bias),
              grouped=dict(use_grouped_topk=True, topk_group=2, num_expert_group=4),
              sigmoid=dict(scoring_func="sigmoid"),
              sigmoid_bias=dict(scoring_func="sigmoid", e_score_correction_bias=bias,
                                routed_scaling_factor=2.5),
              custom=dict(custom_routing_function=reference.llama4_custom_routing_function))[case]
    use_grouped = kw.pop("use_grouped_topk", False)
    got = R.select_experts(h, x, K, use_grouped, True, indices_type=np.int64, **kw)
    want = reference.select_experts(h, x, K, use_grouped, True, indices_type=np.int64, **kw)
    assert got[2] is None and want[2] is None
    assert_route(got, want, f"select_experts {case}")


def test_select_experts_zero_experts_on_host():
    T, E, Z, K = 3, 6, 2, 3
    x = logits_for(T, E + Z, np.float32, "zero")
    h = uniform(rng_for("h"), (T, 4), 1.0)
    kw = dict(global_num_experts=E, zero_expert_num=Z, zero_expert_type="identity")
    got = R.select_experts(h, x, K, False, True, **kw)
    want = reference.select_experts(h, x, K, False, True, **kw)
    assert_route(got, want, "zero experts")
    assert rel_err(got[2], want[2]) <= 1e-5


def test_bad_inputs_name_the_argument():
    x = logits_for(2, 8, np.float32)
    with pytest.raises(ValueError, match="topk: expected at most the number of experts"):
        R.fused_topk(None, x, 9, True)
    with pytest.raises(ValueError, match="gating_output: expected 2 dimensions"):
        R.fused_topk(None, x[0], 2, True)
    with pytest.raises(TypeError, match="gating_output: expected dtype in"):
        R.fused_topk(None, x.astype(np.int32), 2, True)
    with pytest.raises(ValueError, match="hidden_states: expected 2 rows"):
        R.fused_topk(np.ones((3, 4), np.float32), x, 2, True)
    with pytest.raises(ValueError, match="num_expert_group: expected a divisor"):
        R.grouped_topk(None, x, 2, True, 3, 1)
    with pytest.raises(ValueError, match="topk_group: expected at most num_expert_group"):
        R.grouped_topk(None, x, 2, True, 2, 3)
    with pytest.raises(ValueError, match="scoring_func: expected one of"):
        R.grouped_topk(None, x, 2, True, 2, 1, "relu")
    with pytest.raises(ValueError, match="e_score_correction_bias: expected shape"):
        R.fused_topk_bias(None, x, "softmax", np.ones(7, np.float32), 2, True)
    with pytest.raises(TypeError, match="scoring_func"):
        R.fused_topk_bias(None, x, np.ones(8, np.float32), 2, True, 2.5)   # the old order
    with pytest.raises(ValueError, match="scoring_func: expected one of"):
        R.fused_topk(None, x, 2, True, scoring_func="relu")
    with pytest.raises(TypeError, match="indices_type: expected an integer dtype"):
        R.fused_topk(None, x, 2, True, indices_type=np.float32)
    with pytest.raises(TypeError, match="gating_output: expected a NumPy array or a CUDA array"):
        R.fused_topk(None, x.tolist(), 2, True)
