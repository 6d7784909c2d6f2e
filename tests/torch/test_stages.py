"""The torch backend, stage by stage, against the NumPy reference (fp32 and bf16).

    T = tokens, E = experts, K = top-k, H = hidden, I = intermediate, B = block size

Ids and alignment must match exactly (both backends sort stably, so even the order of slots
within an expert agrees); floats within the dtype's tolerance, against the reference fed the
same inputs in float64 (exact mode). Fresh random inputs every test; NaN never passes.
"""

from __future__ import annotations

import math
import zlib
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from tests.oracles import rounding_comparable

import reference
from cuda_kernels import torch as tb
from sandbox.arrays import BF16

torch = pytest.importorskip("torch")

TOL = {np.dtype(np.float32): 1e-5, BF16: 1e-2, np.dtype(np.float64): 1e-12}
DTYPES = [np.float32, ml_dtypes.bfloat16]


def rel(got, want):
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    assert got.shape == want.shape
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaN at other places"
    ok = ~np.isnan(want)
    num, den = np.linalg.norm(got[ok] - want[ok]), np.linalg.norm(want[ok])
    return 0.0 if num == 0 else (math.inf if den == 0 else float(num / den))


def host(t):
    return tb.to_host(t)


def rng_for(*key):
    """A generator seeded by the test's own key: fresh data per check, reproducible runs."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def rand_ids(rng, t, e, k):
    """[T, K] distinct experts per token (what routing produces)."""
    ids = np.empty((t, k), np.int32)
    for r in range(t):
        ids[r] = rng.permutation(e)[:k]
    return ids


# ----------------------------------------------------------------------------- module API
def test_availability_and_roundtrip():
    ok, reason = tb.availability()
    assert ok and "torch" in reason
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16, np.int32):
        a = (rng_for("rt", str(dt)).standard_normal((3, 5)) * 10).astype(dt)
        t = tb.to_device(a)
        back = tb.to_host(t)
        assert back.dtype == np.dtype(dt) and np.array_equal(back, a)


# ----------------------------------------------------------------------------- route
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


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
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
    logits = np.full((1, 512), np.nan, BF16)
    logits[0, :num_finite] = np.arange(num_finite)
    logits[0, num_finite] = np.inf
    logits[0, num_finite + 1] = -np.inf
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


# ----------------------------------------------------------------------------- align
ALIGN_CASES = [  # (T, E, K, B): one token, fewer slots than experts, one expert, uneven
    (1, 8, 2, 4), (3, 16, 2, 4), (40, 6, 2, 16), (33, 5, 3, 8), (64, 4, 1, 64), (0, 8, 2, 16),
]


@pytest.mark.parametrize("t,e,k,b", ALIGN_CASES)
@pytest.mark.parametrize("pad", [False, True])
def test_moe_align_block_size(t, e, k, b, pad):
    rng = rng_for("align", t, e, k, b, pad)
    ids = rand_ids(rng, t, e, k)
    want = reference.moe_align_block_size(ids, b, e, pad_sorted_ids=pad)
    got = [host(v) for v in tb.moe_align_block_size(ids, b, e, pad_sorted_ids=pad)]
    for g, w in zip(got, want):
        assert g.dtype == np.int32 and np.array_equal(g, w)


@pytest.mark.parametrize("ignore_invalid", [False, True])
def test_moe_align_expert_map(ignore_invalid):
    rng = rng_for("align-map", ignore_invalid)
    t, e, k, b = 25, 8, 2, 4
    ids = rand_ids(rng, t, e, k)
    _, expert_map = reference.determine_expert_map(2, 1, e, "round_robin")
    want = reference.moe_align_block_size(ids, b, e, expert_map=expert_map,
                                          ignore_invalid_experts=ignore_invalid)
    got = [host(v) for v in tb.moe_align_block_size(ids, b, e, expert_map=expert_map,
                                                    ignore_invalid_experts=ignore_invalid)]
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


@pytest.mark.parametrize("ep", [None, False, True], ids=["nomap", "map", "map-ignore"])
def test_moe_align_skips_ids_outside_the_experts(ep):
    """vLLM's -1 (and any id past E) is skipped: placed nowhere, counted nowhere."""
    rng = rng_for("align-skip", ep)
    t, e, k, b = 25, 8, 2, 4
    ids = rand_ids(rng, t, e, k)
    ids[3] = -1
    ids[7, 1] = 9
    kw = {}
    if ep is not None:
        kw = dict(expert_map=reference.determine_expert_map(2, 1, e)[1],
                  ignore_invalid_experts=ep)
    want = reference.moe_align_block_size(ids, b, e, **kw)
    got = [host(v) for v in tb.moe_align_block_size(ids, b, e, **kw)]
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


# ----------------------------------------------------------------------------- gemm
def _gemm_inputs(rng, dtype, t=21, e=6, k=2, h=32, n=48, b=8, ep=False):
    ids = rand_ids(rng, t, e, k)
    expert_map = None
    e_local = e
    if ep:
        e_local, expert_map = reference.determine_expert_map(2, 0, e)
    a = rng.standard_normal((t, h)).astype(dtype)
    w = (rng.standard_normal((e_local, n, h)) / np.sqrt(h)).astype(dtype)
    bias = (rng.standard_normal((e_local, n)) * 0.1).astype(dtype)
    tw = rng.random((t, k)).astype(np.float32)
    align = reference.moe_align_block_size(ids, b, e, expert_map=expert_map)
    return a, w, bias, tw, align, k, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize("ep", [False, True])
def test_grouped_gemm(dtype, impl, ep):
    rng = rng_for("gemm", str(dtype), impl, ep)
    a, w, bias, tw, align, k, b = _gemm_inputs(rng, dtype, ep=ep)
    for top_k, mul, use_bias in ((k, False, False), (k, True, True)):
        args = (a, w) + align + (top_k, b, tw, mul, bias if use_bias else None)
        want = reference.grouped_gemm(*(reference.exact(v) for v in args))
        got = host(tb.grouped_gemm(*args, impl=impl))
        assert got.dtype == np.dtype(dtype)
        assert not np.isnan(got).any()
        assert rel(got, want) <= TOL[np.dtype(dtype)]


def test_grouped_gemm_t0():
    rng = rng_for("gemm0")
    a, w, bias, tw, align, k, b = _gemm_inputs(rng, np.float32, t=0)
    got = host(tb.grouped_gemm(a, w, *align, k, b, tw, True, bias))
    assert got.shape == (0, w.shape[1])


# ----------------------------------------------------------------------------- activation
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


# ----------------------------------------------------------------------------- combine
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_sum(dtype):
    x = rng_for("sum", str(dtype)).standard_normal((13, 3, 20)).astype(dtype)
    want = reference.moe_sum(reference.exact(x))
    got = host(tb.moe_sum(x))
    assert got.dtype == np.dtype(dtype) and rel(got, want) <= TOL[np.dtype(dtype)]


@pytest.mark.parametrize("with_map", [False, True])
def test_moe_sum_pad_aware(with_map):
    """vLLM's moe_sum(input, output, topk_ids, expert_map): skipped slots are never read."""
    rng = rng_for("sum-pad", with_map)
    x = rng.standard_normal((6, 3, 20)).astype(np.float32)
    ids = np.array([[0, 1, 2], [-1, 3, 1], [-1, -1, -1], [2, -1, 0], [3, 3, 1], [1, 0, 2]],
                   np.int32)
    expert_map = np.array([0, -1, 1, 2], np.int32) if with_map else None
    live = reference.combine.slot_is_live(ids, expert_map)
    x[~live] = np.nan                                    # never written by the GEMMs
    want = reference.moe_sum(x, ids, expert_map)
    got = host(tb.moe_sum(x, ids, expert_map))
    assert np.isfinite(got).all() and rel(got, want) <= 1e-6


# ----------------------------------------------------------------------------- contiguous layout
@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_permute_grouped_mm_unpermute(impl):
    rng = rng_for("perm", impl)
    t, e, k, h, n = 17, 5, 2, 16, 32
    x = rng.standard_normal((t, h)).astype(np.float32)
    ids = rand_ids(rng, t, e, k)
    tw = rng.random((t, k)).astype(np.float32)
    w = rng.standard_normal((e, n, h)).astype(np.float32)
    rx, roff, rinv = reference.moe_permute(x, ids, e)
    gx, goff, ginv = (host(v) for v in tb.moe_permute(x, ids, e))
    assert np.array_equal(gx, rx) and np.array_equal(goff, roff) and np.array_equal(ginv, rinv)
    ry = reference.grouped_mm(rx, w, roff)
    gy = host(tb.grouped_mm(gx, w, goff, impl=impl))
    assert rel(gy, ry) <= 1e-5
    assert rel(host(tb.moe_unpermute(gy, tw, ginv)), reference.moe_unpermute(ry, tw, rinv)) <= 1e-5


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_experts_baseline(impl, dtype):
    rng = rng_for("fe", impl, str(dtype))
    t, e, k, h, i = 19, 6, 2, 32, 24
    x = rng.standard_normal((t, h)).astype(dtype)
    w1 = (rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)).astype(dtype)
    w2 = (rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(dtype)
    logits = rng.standard_normal((t, e)).astype(np.float32)
    tw, ids, _ = reference.fused_topk(x, logits, k, True)
    want = reference.fused_experts(x, w1, w2, tw, ids, precision="exact")
    got = host(tb.fused_experts(x, w1, w2, tw, ids, impl=impl))
    assert got.dtype == np.dtype(dtype) and rel(got, want) <= TOL[np.dtype(dtype)]


def test_fused_experts_baseline_skips_slots_routed_nowhere():
    rng = rng_for("fe-1")
    t, e, k, h, i = 11, 6, 2, 32, 24
    x = rng.standard_normal((t, h)).astype(np.float32)
    w1 = (rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)).astype(np.float32)
    w2 = (rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32)
    tw = rng.random((t, k)).astype(np.float32)
    ids = rand_ids(rng, t, e, k)
    ids[4] = -1
    ids[7, 0] = -1
    want = reference.fused_experts(x, w1, w2, tw, ids, precision="exact")
    got = host(tb.fused_experts(x, w1, w2, tw, ids, impl="loop"))
    assert (got[4] == 0).all() and rel(got, want) <= 1e-5


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_cuda_stages(dtype):
    """On the GPU: every stage on CUDA tensors against the reference."""
    assert tb.device().type == "cuda"
    rng = rng_for("cuda", str(dtype))
    a, w, bias, tw, align, k, b = _gemm_inputs(rng, dtype, t=300, e=8, h=128, n=256, b=64)
    for impl in ("loop", "grouped_mm"):
        args = (a, w) + align + (k, b, tw, True, bias)
        want = reference.grouped_gemm(*(reference.exact(v) for v in args))
        got_t = tb.grouped_gemm(*(tb.to_device(v) if isinstance(v, np.ndarray) else v
                                  for v in args), impl=impl)
        assert got_t.is_cuda
        assert rel(host(got_t), want) <= TOL[np.dtype(dtype)]
    logits = rng.standard_normal((300, 8)).astype(np.float32)
    ew, eids, _ = reference.fused_topk(None, logits, 2, True)
    gw, gids, _ = tb.fused_topk(None, tb.to_device(logits), 2, True)
    assert np.array_equal(host(gids), eids) and rel(host(gw), ew) <= 1e-5
    got = [host(v) for v in tb.moe_align_block_size(tb.to_device(eids), 64, 8)]
    for g, wnt in zip(got, reference.moe_align_block_size(eids, 64, 8)):
        assert np.array_equal(g, wnt)


@pytest.mark.gpu
def test_torch_cuda_select_experts_tail():
    """select_experts on CUDA tensors through the shared dispatcher: a NumPy custom routing
    function's results come back on the device, zero experts are computed there."""
    assert tb.device().type == "cuda"
    rng = rng_for("cuda select")
    t, e, z, k = 37, 8, 2, 3
    x = rng.standard_normal((t, 16)).astype(np.float32)
    logits = rng.standard_normal((t, e + z)).astype(np.float32)
    logits[:4, e:] += 3.0
    kw = dict(global_num_experts=e, zero_expert_num=z, zero_expert_type="identity")
    ew, eids, ez = reference.select_experts(x, logits, k, False, True, **kw)
    gw, gids, gz = tb.select_experts(tb.to_device(x), tb.to_device(logits), k, False, True, **kw)
    assert gw.is_cuda and gids.is_cuda and gz.is_cuda
    assert np.array_equal(host(gids), eids) and rel(host(gw), ew) <= 1e-5
    assert rel(host(gz), ez) <= 1e-5
    fn = reference.llama4_custom_routing_function
    ew, eids, _ = reference.select_experts(None, logits[:, :e], 1, False, False,
                                           custom_routing_function=fn)
    gw, gids, _ = tb.select_experts(None, tb.to_device(logits[:, :e]), 1, False, False,
                                    custom_routing_function=fn)
    assert gw.is_cuda and gids.is_cuda
    assert np.array_equal(host(gids), eids) and rel(host(gw), ew) <= 1e-6
