"""Torch routing (cuda_kernels/torch/routing.py) against the NumPy reference: fused_topk,
fused_topk_bias, grouped_topk, select_experts (zero experts, custom functions, a caller's ops).

    T = tokens, E = experts, K = top-k

Ids exact (both backends rank the same fp32 scores); weights within fp32's 1e-5.
"""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import reference
from cuda_kernels import torch as tb
from cuda_kernels.torch import to_host as host
from tests.oracles import non_finite_group_logits, rng_for
from tests.oracles import rel_err_where_defined as rel

torch = pytest.importorskip("torch")


def _non_finite_rows(logits):
    logits[5, 7] = np.nan                                # a NaN logit
    logits[6] = -np.inf                                  # nothing but -inf
    logits[8, 1] = np.inf                                # a +inf logit


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("logit_dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
def test_fused_topk(renormalize, logit_dtype, scoring_func):
    rng = rng_for("topk", renormalize, str(logit_dtype), scoring_func)
    t, e, k = 37, 12, 3
    logits = rng.standard_normal((t, e)).astype(logit_dtype)
    _non_finite_rows(logits)
    x = rng.standard_normal((t, 16)).astype(np.float32)
    ew, eids, etei = reference.fused_topk(x, logits, k, renormalize, scoring_func=scoring_func)
    gw, gids, gtei = (host(v) for v in tb.fused_topk(x, logits, k, renormalize,
                                                     scoring_func=scoring_func))
    assert gids.dtype == np.int32 and np.array_equal(gids, eids)
    assert np.array_equal(gtei, etei)
    assert gw.dtype == np.float32 and rel(gw, ew) <= 1e-5
    assert np.isfinite(gw).all()                         # vLLM's kernels: non-finite -> 0
    if scoring_func == "softmax":
        assert (gw[[5, 6, 8]] == 0).all()


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_fused_topk_bias(scoring_func):
    rng = rng_for("bias", scoring_func)
    t, e, k = 29, 16, 4
    logits = rng.standard_normal((t, e)).astype(np.float32)
    _non_finite_rows(logits)
    bias = (rng.standard_normal(e) * 0.1).astype(np.float32)
    ew, eids = reference.fused_topk_bias(None, logits, scoring_func, bias, k, True,
                                         routed_scaling_factor=2.5)
    gw, gids = (host(v) for v in tb.fused_topk_bias(None, logits, scoring_func, bias, k, True,
                                                    routed_scaling_factor=2.5))
    assert np.array_equal(gids, eids) and rel(gw, ew) <= 1e-5
    with pytest.raises(TypeError, match="scoring_func"):
        tb.fused_topk_bias(None, logits, bias, k, True, 2.5)   # the old argument order


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("logit_dtype", [np.float32, ml_dtypes.bfloat16])
def test_grouped_topk(scoring_func, with_bias, logit_dtype):
    rng = rng_for("grouped", scoring_func, with_bias, str(logit_dtype))
    t, e, k = 31, 32, 4
    logits = rng.standard_normal((t, e)).astype(logit_dtype)
    _non_finite_rows(logits)
    logits[3, 9] = np.nan
    logits[9, :8] = np.nan                               # a whole group invalid
    bias = (rng.standard_normal(e) * 0.1).astype(np.float32) if with_bias else None
    kw = dict(num_expert_group=8, topk_group=3, scoring_func=scoring_func,
              routed_scaling_factor=1.5, e_score_correction_bias=bias)
    for renormalize in (True, False):
        ew, eids = reference.grouped_topk(None, logits, k, renormalize, **kw)
        gw, gids = (host(v) for v in tb.grouped_topk(None, logits, k, renormalize, **kw))
        assert np.array_equal(gids, eids)
        assert np.isfinite(gw).all() and rel(gw, ew) <= 1e-5


@pytest.mark.parametrize("num_finite", [0, 15])
@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_topk_single_group_non_finite(num_finite, renormalize):
    """vLLM's test_grouped_topk_single_group_nonfinite_scores, on the torch backend."""
    logits = non_finite_group_logits(512, num_finite)
    bias = np.zeros(512, np.float32)
    ew, eids = reference.grouped_topk(None, logits, 16, renormalize, 1, 1, "sigmoid", 2.5, bias)
    gw, gids = (host(v) for v in tb.grouped_topk(None, logits, 16, renormalize, 1, 1, "sigmoid",
                                                 2.5, bias))
    assert np.array_equal(gids, eids)
    np.testing.assert_allclose(gw, ew, atol=2e-5, rtol=0)


def test_select_experts_zero_experts():
    rng = rng_for("zero")
    t, e, z, k, h = 23, 8, 2, 3, 16
    x = rng.standard_normal((t, h)).astype(np.float32)
    logits = rng.standard_normal((t, e + z)).astype(np.float32)
    logits[:4, e:] += 3.0                                 # some tokens pick zero experts
    logits[6, 2] = np.nan
    kw = dict(global_num_experts=e, zero_expert_num=z, zero_expert_type="identity")
    ew, eids, ez = reference.select_experts(x, logits, k, False, True, **kw)
    gw, gids, gz = (host(v) for v in tb.select_experts(x, logits, k, False, True, **kw))
    assert np.array_equal(gids, eids) and gids.max() < e
    assert rel(gw, ew) <= 1e-5 and rel(gz, ez) <= 1e-5
    assert np.abs(ez[:4]).sum() > 0                       # the zero experts did contribute


def test_select_experts_custom_function():
    rng = rng_for("custom")
    logits = rng.standard_normal((11, 6)).astype(np.float32)
    fn = reference.llama4_custom_routing_function
    ew, eids, _ = reference.select_experts(None, logits, 1, False, False,
                                           custom_routing_function=fn)
    gw, gids, _ = (host(v) if v is not None else None
                   for v in tb.select_experts(None, logits, 1, False, False,
                                              custom_routing_function=fn))
    assert np.array_equal(gids, eids) and rel(gw, ew) <= 1e-6


def test_select_experts_checks_the_logits_width():
    """6 logit columns for 8 experts (or 8 for 8 + 2 zero experts) name router_logits instead
    of routing to the first columns' experts."""
    x = torch.zeros((3, 4))
    for cols, want, kw in ((6, 8, {}),
                           (8, 10, {"zero_expert_num": 2, "zero_expert_type": "identity"})):
        with pytest.raises(ValueError,
                           match=rf"^router_logits: expected {want} columns.*got shape \(3, {cols}\)"):
            tb.select_experts(x, torch.zeros((3, cols)), 2, False, True, global_num_experts=8,
                              **kw)


def test_select_experts_ops_and_indices_type():
    """The dispatch is the reference's: a caller's ops supply the routing functions, this
    backend's tensor handling fills in the rest of the tail (ids cast, copies, zero experts)."""
    rng = rng_for("ops")
    t, e, z, k = 9, 8, 2, 2
    logits = rng.standard_normal((t, e + z)).astype(np.float32)
    x = rng.standard_normal((t, 4)).astype(np.float32)
    calls = []

    def spy(name):
        def call(*args, **kwargs):
            calls.append(name)
            return getattr(tb, name)(*args, **kwargs)
        return call

    ops = SimpleNamespace(fused_topk=spy("fused_topk"), fused_topk_bias=spy("fused_topk_bias"),
                          grouped_topk=spy("grouped_topk"))
    kw = dict(global_num_experts=e, zero_expert_num=z, zero_expert_type="identity",
              indices_type=np.int64)
    gw, gids, gz = tb.select_experts(x, logits, k, False, True, ops=ops, **kw)
    assert calls == ["fused_topk"]
    assert isinstance(gids, torch.Tensor) and gids.dtype == torch.int64
    ew, eids, ez = reference.select_experts(x, logits, k, False, True, **kw)
    assert np.array_equal(host(gids), eids) and rel(host(gw), ew) <= 1e-5
    assert rel(host(gz), ez) <= 1e-5
    _, ids32, _ = tb.select_experts(x, logits, k, False, True, indices_type=torch.int32)
    assert ids32.dtype == torch.int32
