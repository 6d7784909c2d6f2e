"""CuPy routing (cuda_kernels/cupy/routing.py, routing.cu) against the NumPy reference, on the GPU.

    T tokens, E experts, K top-k, G expert groups

Every test here is `gpu` and skips cleanly without a usable device (availability() says
why). Outputs are poisoned before every launch (the `cupy_poison` fixture: NaN for floats,
-123456789 for ints), so an element a kernel forgets to write fails the comparison.

What "equal" means: ids exact, except at a *true near-tie*. The kernel ranks the same fp32
scores as the reference, but its expf and its softmax sum (a warp tree, not NumPy's pairwise
order) can differ from NumPy's by an ulp or two, so two experts whose scores lie within that
distance may swap. The rule: where a row's ids differ, the k-th chosen selection value
(scores + bias, NaN as -inf, the reference's fp32 numbers) of the kernel must equal the
reference's k-th within 1e-6 relative, at every k; at most 1% of rows may differ this way
(random fp32 logits almost never produce one; bf16 logits never do, their distinct values
being 2^-8 apart); ids are distinct in every row; weights are compared on the rows whose ids
match (relative Frobenius error <= 1e-5: the math is fp32 for every input dtype).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

import reference
from cuda_kernels.cupy import routing as ck_route
from cuda_kernels.cupy import to_device as dev
from cuda_kernels.cupy import to_host as host
from tests.emulator import library_fixture, ptr
from tests.oracles import BF16, non_finite_group_logits, rng_for, selection_values, uniform
from tests.oracles import assert_routing_matches as routing_matches
from tests.support import DTYPES, on_gpu

pytestmark = pytest.mark.usefixtures("cupy_poison")


def assert_routing_matches(got, want, sel, what="routing"):
    """ids exact up to true near-ties (module docstring), weights on the matching rows."""
    routing_matches(got, want, sel, what, to_host=host)


def draw_logits(rng, T, E, dtype, scale=2.0):
    return uniform(rng, (T, E), scale, np.float32).astype(dtype)


@on_gpu("cupy")
@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("E,K", [(8, 2), (16, 1), (60, 4), (128, 8), (256, 8), (257, 9),
                                 (512, 22), (1000, 32), (1024, 6)])
@pytest.mark.parametrize("T", [1, 67, 1024])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_fused_topk(T, E, K, renormalize, dkey, scoring):
    rng = rng_for("fused_topk", T, E, K, renormalize, dkey, scoring)
    logits = draw_logits(rng, T, E, DTYPES[dkey])
    hidden = uniform(rng, (T, 16), 1.0, DTYPES[dkey])
    got = ck_route.fused_topk(dev(hidden), dev(logits), K, renormalize, scoring_func=scoring)
    want = reference.fused_topk(hidden, logits, K, renormalize, scoring_func=scoring)
    assert_routing_matches(got, want, selection_values(logits, scoring), "fused_topk")
    np.testing.assert_array_equal(host(got[2]), want[2], err_msg="token_expert_indices")


@on_gpu("cupy")
@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("scaling", [1.0, 2.5])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("E,K", [(16, 2), (128, 8), (256, 8), (384, 8), (512, 22)])
def test_fused_topk_bias(E, K, scaling, scoring, dkey):
    T = 133
    rng = rng_for("fused_topk_bias", E, K, scaling, dkey, scoring)
    logits = draw_logits(rng, T, E, DTYPES[dkey])
    bias = uniform(rng, (E,), 0.05, np.float32)
    got = ck_route.fused_topk_bias(None, dev(logits), scoring, dev(bias), K, True,
                                   routed_scaling_factor=scaling)
    want = reference.fused_topk_bias(None, logits, scoring, bias, K, True,
                                     routed_scaling_factor=scaling)
    assert_routing_matches(got, want, selection_values(logits, scoring, bias=bias),
                           "fused_topk_bias")


# vLLM's grouped_topk grid: (E, top-k, groups, topk_group) x routed_scaling_factor
GROUPED_GRID = [(16, 2, 8, 2), (128, 2, 8, 2), (256, 8, 8, 4), (384, 8, 1, 1), (512, 22, 1, 1)]


@on_gpu("cupy")
@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("scaling", [1.0, 2.5])
@pytest.mark.parametrize("E,K,G,TG", GROUPED_GRID)
def test_grouped_topk_vllm_grid(E, K, G, TG, scaling, renormalize, scoring, with_bias, dkey):
    T = 257  # not a multiple of the warps per block
    rng = rng_for("grouped", E, K, G, TG, scaling, renormalize, scoring, with_bias, dkey)
    logits = draw_logits(rng, T, E, DTYPES[dkey])
    bias = uniform(rng, (E,), 0.1, np.float32) if with_bias else None
    got = ck_route.grouped_topk(None, dev(logits), K, renormalize, G, TG, scoring, scaling,
                                dev(bias) if with_bias else None)
    want = reference.grouped_topk(None, logits, K, renormalize, G, TG, scoring, scaling, bias)
    assert_routing_matches(got, want,
                           selection_values(logits, scoring, bias, G, TG, kernel="grouped"),
                           "grouped_topk")


@on_gpu("cupy")
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_topk_groups_not_power_of_two(scoring, with_bias):
    T, E, K, G, TG = 50, 96, 5, 6, 3  # groups of 16, 6 groups
    rng = rng_for("grouped_np2", scoring, with_bias)
    logits = draw_logits(rng, T, E, np.float32)
    bias = uniform(rng, (E,), 0.1, np.float32) if with_bias else None
    got = ck_route.grouped_topk(None, dev(logits), K, True, G, TG, scoring, 1.0,
                                dev(bias) if with_bias else None)
    want = reference.grouped_topk(None, logits, K, True, G, TG, scoring, 1.0, bias)
    assert_routing_matches(got, want, selection_values(logits, scoring, bias, G, TG))


@on_gpu("cupy")
def test_routing_ties_go_to_the_lowest_id():
    T, E, K = 5, 64, 8
    logits = np.zeros((T, E), np.float32) + np.float32(0.25)  # every score equal
    logits[1, 40] = 3.0                                         # one clear winner
    logits[2, ::2] = 1.0                                        # ties among even ids
    got = ck_route.fused_topk(None, dev(logits), K, True)
    want = reference.fused_topk(None, logits, K, True)
    np.testing.assert_array_equal(host(got[1]), want[1])
    np.testing.assert_array_equal(host(got[1])[0], np.arange(K))


@on_gpu("cupy")
def test_routing_nan_and_inf_rows():
    """vLLM's topk kernels: a non-finite score is 0, so a row with a NaN logit, a +inf one
    or only -inf routes to ids 0..K-1 at weight 0; other rows untouched. grouped_topk: an
    expert with a non-finite scoring input is invalid (last, weight 0); a row with none
    valid gets 1/K (renormalize) or 0."""
    T, E, K = 6, 32, 4
    rng = rng_for("nan_rows")
    logits = draw_logits(rng, T, E, np.float32)
    logits[1, 7] = np.nan
    logits[2, 3] = np.inf
    logits[3, :] = -np.inf
    for scoring in ("softmax", "sigmoid"):
        got = ck_route.fused_topk(None, dev(logits), K, True, scoring_func=scoring)
        want = reference.fused_topk(None, logits, K, True, scoring_func=scoring)
        g_w, g_ids = host(got[0]), host(got[1])
        np.testing.assert_array_equal(g_ids, want[1])
        assert np.isfinite(g_w).all() and np.abs(g_w - want[0]).max() <= 1e-6
    assert (host(ck_route.fused_topk(None, dev(logits), K, True)[0])[1:4] == 0).all()
    logits = draw_logits(rng, T, 64, np.float32)
    logits[0, :8] = np.nan  # one whole group NaN
    logits[4, 9] = np.nan
    logits[5] = np.nan      # no valid expert
    for bias in (None, uniform(rng, (64,), 0.1, np.float32)):
        for scoring in ("softmax", "sigmoid"):
            for renorm in (True, False):
                got = ck_route.grouped_topk(None, dev(logits), 4, renorm, 8, 3, scoring, 1.5,
                                            None if bias is None else dev(bias))
                want = reference.grouped_topk(None, logits, 4, renorm, 8, 3, scoring, 1.5, bias)
                np.testing.assert_array_equal(host(got[1]), want[1])
                assert np.abs(host(got[0]) - want[0]).max() <= 1e-6


@on_gpu("cupy")
@pytest.mark.parametrize("num_experts", [512, 896, 1024])
@pytest.mark.parametrize("num_finite", [0, 15])
@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_topk_single_group_non_finite(num_experts, num_finite, renormalize):
    """vLLM's test_grouped_topk_single_group_nonfinite_scores."""
    logits = non_finite_group_logits(num_experts, num_finite)
    bias = np.zeros(num_experts, np.float32)
    got = ck_route.grouped_topk(None, dev(logits), 16, renormalize, 1, 1, "sigmoid", 2.5,
                                dev(bias))
    want = reference.grouped_topk(None, logits, 16, renormalize, 1, 1, "sigmoid", 2.5, bias)
    np.testing.assert_array_equal(host(got[1]), want[1])
    np.testing.assert_allclose(host(got[0]), want[0], atol=2e-5, rtol=0)


@on_gpu("cupy")
def test_routing_empty_batch_and_indices_type():
    logits = np.zeros((0, 16), np.float32)
    w, ids, tei = ck_route.fused_topk(None, dev(logits), 2, True)
    assert w.shape == (0, 2) and ids.shape == (0, 2) and tei.shape == (0, 2)
    w, ids = ck_route.grouped_topk(None, dev(logits), 2, True, 4, 2, "sigmoid", 1.0, None)
    assert w.shape == (0, 2)
    logits = draw_logits(rng_for("indices_type"), 9, 16, np.float32)
    _, ids, _ = ck_route.fused_topk(None, dev(logits), 3, False, indices_type=np.int64)
    assert ids.dtype == np.int64
    np.testing.assert_array_equal(host(ids), reference.fused_topk(None, logits, 3, False)[1])


@on_gpu("cupy")
def test_routing_fp64_logits():
    logits = draw_logits(rng_for("fp64"), 40, 64, np.float64)
    got = ck_route.fused_topk(None, dev(logits), 6, True)
    want = reference.fused_topk(None, logits, 6, True)
    assert_routing_matches(got, want, selection_values(logits))


@on_gpu("cupy")
@pytest.mark.parametrize("case", ["softmax", "bias", "grouped", "sigmoid", "sigmoid_bias",
                                  "custom"])
def test_select_experts_dispatch(case):
    T, E, K = 70, 64, 6
    rng = rng_for("select", case)
    logits = draw_logits(rng, T, E, BF16)
    bias = uniform(rng, (E,), 0.1, np.float32)
    kw = dict(top_k=K, renormalize=True, use_grouped_topk=False)
    if case == "bias":
        kw.update(e_score_correction_bias=bias, routed_scaling_factor=2.5)
    elif case == "grouped":
        kw.update(use_grouped_topk=True, topk_group=2, num_expert_group=8,
                  scoring_func="sigmoid", e_score_correction_bias=bias, routed_scaling_factor=2.5)
    elif case == "sigmoid":
        kw.update(scoring_func="sigmoid")
    elif case == "sigmoid_bias":
        kw.update(scoring_func="sigmoid", e_score_correction_bias=bias, routed_scaling_factor=2.5)
    elif case == "custom":
        kw.update(custom_routing_function=lambda **a: ck_route.fused_topk(
            a["hidden_states"], a["gating_output"], a["topk"], a["renormalize"])[:2])
    dev_kw = {k: (dev(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    got = ck_route.select_experts(None, dev(logits), **dev_kw)
    if case == "custom":
        kw["custom_routing_function"] = lambda **a: reference.fused_topk(
            a["hidden_states"], a["gating_output"], a["topk"], a["renormalize"])[:2]
    want = reference.select_experts(None, logits, **kw)
    assert got[2] is None
    scoring = kw.get("scoring_func", "softmax")
    sel = selection_values(logits, scoring, kw.get("e_score_correction_bias"),
                           kw.get("num_expert_group") or 1, kw.get("topk_group") or 1,
                           kernel="grouped" if case == "grouped" else "topk")
    assert_routing_matches(got[:2], want[:2], sel, f"select_experts[{case}]")


@on_gpu("cupy")
def test_routing_bad_inputs():
    good = dev(np.ones((4, 16), np.float32))
    with pytest.raises(TypeError, match="gating_output"):
        ck_route.fused_topk(None, np.ones((4, 16), np.float32), 2, True)  # NumPy, not CuPy
    with pytest.raises(TypeError, match="gating_output"):
        ck_route.fused_topk(None, dev(np.ones((4, 16), np.int32)), 2, True)
    with pytest.raises(ValueError, match="gating_output"):
        ck_route.fused_topk(None, dev(np.ones((16, 4), np.float32)).T, 2, True)  # strided
    with pytest.raises(ValueError, match="topk"):
        ck_route.fused_topk(None, good, 17, True)
    with pytest.raises(ValueError, match="topk"):
        ck_route.fused_topk(None, dev(np.ones((4, 64), np.float32)), 33, True)
    with pytest.raises(ValueError, match="gating_output"):
        ck_route.fused_topk(None, dev(np.ones((2, 2048), np.float32)), 2, True)
    with pytest.raises(ValueError, match="hidden_states"):
        ck_route.fused_topk(dev(np.ones((3, 8), np.float32)), good, 2, True)
    with pytest.raises(ValueError, match="num_expert_group"):
        ck_route.grouped_topk(None, good, 2, True, 3, 1)
    with pytest.raises(ValueError, match="topk_group"):
        ck_route.grouped_topk(None, good, 2, True, 4, 5)
    with pytest.raises(ValueError, match="scoring_func"):
        ck_route.grouped_topk(None, good, 2, True, 4, 2, "tanh")
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        ck_route.fused_topk_bias(None, good, "softmax", dev(np.ones(15, np.float32)), 2, True)
    with pytest.raises(TypeError, match="scoring_func"):
        ck_route.fused_topk_bias(None, good, dev(np.ones(16, np.float32)), 2, True, 2.5)
    with pytest.raises(ValueError, match="scoring_func"):
        ck_route.fused_topk(None, good, 2, True, scoring_func="tanh")


# ============================================================================ CPU: the emulator
# The kernel source on the CPU emulator of tests/emulator (g++, a std::thread per CUDA thread,
# tiny tunables), against the reference: the kernel's logic without a GPU (not the GPU's
# expf / erff ulps, timing or memory ordering: the GPU tests above stay the judge).
ENTRY = r"""
extern "C" void route(const IN_T* g, const float* bias, float* w, int* ids, int* tei, int T,
                      int E, int K, int G, int TG, int scoring, int renorm, int mode,
                      float scale, int vpt, int smem) {
    unsigned grid = (T + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK;
#define R(V) if (vpt == V) launch(grid, WARPS_PER_BLOCK * 32, smem, [&] { \
    route_topk_kernel<V>(g, bias, w, ids, tei, T, E, K, G, TG, scoring, renorm, mode, scale); });
    R(1) R(2) R(4) R(8) R(16) R(32)
}"""
DEFINES = {"IN_T": "float", "WARPS_PER_BLOCK": 4}
DEFINES_BF16 = {"IN_T": "__nv_bfloat16", "WARPS_PER_BLOCK": 4}


emulated = library_fixture("routing.cu", {"fp32": (DEFINES, ENTRY), "bf16": (DEFINES_BF16, ENTRY)})


@pytest.mark.simulator
def test_emulated_routing(emulated):
    lib, lib16 = emulated["fp32"], emulated["bf16"]
    rng = np.random.default_rng(8)
    TOPK, GROUPED = ck_route.MODE_TOPK, ck_route.MODE_GROUPED

    def route(x, K, G=1, TG=1, scoring=0, bias=None, renorm=True, scale=1.0, mode=TOPK):
        T, E = x.shape
        w, ids, tei = (np.full((T, K), np.nan, np.float32), np.full((T, K), -7, np.int32),
                       np.full((T, K), -7, np.int32))
        rowf = (E + E // 32 + 2) & ~1
        smem = 4 * (rowf + 2 * G) * 4 if G > 1 else 0
        which = lib16 if x.dtype == reference._checks.FLOAT_DTYPES[3] else lib
        which.route(ptr(x), ptr(bias), ptr(w), ptr(ids), ptr(tei), T, E, K, G, TG, scoring,
                    int(renorm), mode, ctypes.c_float(scale), ck_route._vpt(E), smem)
        return w, ids, tei

    def same(got, want, what):
        np.testing.assert_array_equal(got[1], want[1], err_msg=what)
        np.testing.assert_array_equal(np.isnan(got[0]), np.isnan(want[0]), err_msg=what)
        ok = ~np.isnan(want[0])
        assert np.abs(got[0][ok] - want[0][ok]).max(initial=0) < 1e-6, what

    for T, E, K in ((1, 8, 2), (9, 60, 4), (5, 257, 9), (3, 1000, 32), (5, 16, 1)):
        x = rng.standard_normal((T, E)).astype(np.float32)
        for renorm in (False, True):
            for scoring, name in ((0, "softmax"), (1, "sigmoid")):
                got = route(x, K, scoring=scoring, renorm=renorm)
                want = reference.fused_topk(None, x, K, renorm, scoring_func=name)
                same(got, want, f"fused_topk {name} T={T} E={E} K={K}")
                np.testing.assert_array_equal(got[2], want[2])
        b = (0.1 * rng.standard_normal(E)).astype(np.float32)
        for scoring, name in ((0, "softmax"), (1, "sigmoid"), (2, "sqrtsoftplus")):
            same(route(x, K, scoring=scoring, bias=b, scale=2.5),
                 reference.fused_topk_bias(None, x, name, b, K, True, routed_scaling_factor=2.5),
                 f"fused_topk_bias {name} E={E}")
    for E, K, G, TG in ((16, 2, 8, 2), (256, 8, 8, 4), (512, 22, 1, 1), (96, 5, 6, 3)):
        for scoring in (0, 1):
            for with_bias in (False, True):
                x = rng.standard_normal((7, E)).astype(np.float32)
                b = (0.1 * rng.standard_normal(E)).astype(np.float32) if with_bias else None
                want = reference.grouped_topk(None, x, K, True, G, TG, ("softmax", "sigmoid")[scoring],
                                              2.5, b)
                same(route(x, K, G, TG, scoring, b, True, 2.5, GROUPED), want,
                     f"grouped_topk E={E} K={K} G={G} TG={TG} scoring={scoring} bias={with_bias}")
    # non-finite logits: fused_topk zeroes non-finite scores (rows of ids 0..K-1, weight 0)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    x[1, 7], x[2, 3], x[3, :], x[4, :], x[5, ::2] = np.nan, np.inf, -np.inf, 0.5, 2.0
    for scoring, name in ((0, "softmax"), (1, "sigmoid")):
        for renorm in (False, True):
            same(route(x, 4, scoring=scoring, renorm=renorm),
                 reference.fused_topk(None, x, 4, renorm, scoring_func=name),
                 f"NaN / inf / ties {name}")
    # sqrt-softplus (DeepSeek-V4, fused_topk_bias only): wide logits cross softplus' x > 20
    # branch; NaN and +-inf score 0
    x = (12 * rng.standard_normal((6, 256))).astype(np.float32)
    x[1, 7], x[2, 3], x[3, :], x[4, 9], x[5, ::2] = np.nan, np.inf, -np.inf, 21.0, 2.0
    bias256 = (0.1 * rng.standard_normal(256)).astype(np.float32)
    for bias in (None, bias256):
        for renorm in (False, True):
            same(route(x, 6, scoring=2, bias=bias, renorm=renorm, scale=1.5),
                 reference.fused_topk_bias(None, x, "sqrtsoftplus", bias, 6, renorm,
                                           routed_scaling_factor=1.5),
                 f"sqrtsoftplus bias {bias is not None} renorm {renorm}")
    # grouped_topk: invalid experts ranked last at weight 0, rows with none valid 1/K or 0
    x = rng.standard_normal((6, 64)).astype(np.float32)
    x[0, :8], x[4, 9], x[5, 20:30], x[2] = np.nan, np.nan, np.nan, np.nan
    for b in (None, (0.1 * rng.standard_normal(64)).astype(np.float32)):
        for scoring, name in ((0, "softmax"), (1, "sigmoid")):
            for renorm in (False, True):
                same(route(x, 4, 8, 3, scoring, b, renorm, 1.5, GROUPED),
                     reference.grouped_topk(None, x, 4, renorm, 8, 3, name, 1.5, b),
                     f"{name} with NaN logits, bias {b is not None}")
    # bf16 logits: grouped_topk rounds its softmax scores to bf16 (vLLM's dtype); the
    # single-group non-finite case of vLLM's test
    BF16 = reference._checks.FLOAT_DTYPES[3]
    xb = rng.standard_normal((9, 256)).astype(BF16)
    for scoring, name in ((0, "softmax"), (1, "sigmoid")):
        same(route(xb, 8, 8, 4, scoring, None, True, 2.5, GROUPED),
             reference.grouped_topk(None, xb, 8, True, 8, 4, name, 2.5), f"bf16 grouped {name}")
        same(route(xb, 8, scoring=scoring), reference.fused_topk(None, xb, 8, True,
                                                                scoring_func=name),
             f"bf16 fused_topk {name}")
    same(route(xb, 6, scoring=2, bias=bias256),
         reference.fused_topk_bias(None, xb, "sqrtsoftplus", bias256, 6, True),
         "bf16 fused_topk_bias sqrtsoftplus")
    for num_finite in (0, 15):
        for renorm in (False, True):
            xn = np.full((1, 512), np.nan, BF16)
            xn[0, :num_finite] = np.arange(num_finite)
            xn[0, num_finite], xn[0, num_finite + 1] = np.inf, -np.inf
            z = np.zeros(512, np.float32)
            same(route(xn, 16, 1, 1, 1, z, renorm, 2.5, GROUPED),
                 reference.grouped_topk(None, xn, 16, renorm, 1, 1, "sigmoid", 2.5, z),
                 f"single group non-finite {num_finite} renorm {renorm}")
