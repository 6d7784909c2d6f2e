"""The CuPy kernels of every stage but the GEMM, against the NumPy reference, on the GPU.

    T tokens, E experts, K top-k, G expert groups, H hidden, B block size, P = T*K slots

Every test here is `gpu` and skips cleanly without a usable device (availability() says
why). Outputs are poisoned before every launch (`_compile.POISON`: NaN for floats,
-123456789 for ints), so an element a kernel forgets to write fails the comparison.

What "equal" means, stage by stage:
- routing ids: exact, except at a *true near-tie*. The kernel ranks the same fp32 scores as
  the reference, but its expf and its softmax sum (a warp tree, not NumPy's pairwise order)
  can differ from NumPy's by an ulp or two, so two experts whose scores lie within that
  distance may swap. The rule: where a row's ids differ, the k-th chosen selection value
  (scores + bias, NaN as -inf, the reference's fp32 numbers) of the kernel must equal the
  reference's k-th within 1e-6 relative, at every k; at most 1% of rows may differ this
  way (random fp32 logits almost never produce one; bf16 logits never do, their distinct
  values being 2^-8 apart); ids are distinct in every row; weights are compared on the
  rows whose ids match (relative Frobenius error <= 1e-5: the math is fp32 for every input
  dtype).
- alignment: integer outputs exact, on both of its paths (one block up to SMALL_P slots, a
  cooperative grid above; the vLLM grid crosses the threshold, the nasty cases force each,
  the grid one with tiny blocks so that even small cases span many blocks). The contract only fixes the *set* of slots per block
  (assert_same_blocks); this kernel is stable (increasing s inside an expert, like the
  reference), so the order is checked exactly too, in a separate assertion.
- permute: x_grouped, expert_offsets, inv_permuted_idx exact (a copy and integers).
- unpermute, activation, combine: relative Frobenius error <= TOL[dtype] (fp32 1e-5,
  fp16/bf16 1e-2); NaN never passes.
"""
from __future__ import annotations

import numpy as np
import pytest
from tests.oracles import assert_routing_matches as routing_matches
from tests.oracles import (
    BF16,
    TOL,
    rounding_comparable,
    assert_same_blocks,
    distinct_topk_ids,
    random_weights,
    rel_err,
    rng_for,
    selection_values,
    uniform,
)

import reference
from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy import activation as ck_act
from cuda_kernels.cupy import align as ck_align
from cuda_kernels.cupy import combine as ck_combine
from cuda_kernels.cupy import permute as ck_perm
from cuda_kernels.cupy import routing as ck_route

OK, WHY = C.availability()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=f"no usable GPU: {WHY}")]

DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": BF16}


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(C, "POISON", True)


def dev(a):
    return C.to_device(a)


def host(x):
    return C.to_host(x)


def assert_close(got, want, dtype, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != reference {want.dtype}"
    err = rel_err(got, want)
    tol = TOL[np.dtype(dtype)]
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e} ({np.dtype(dtype)})"


# ============================================================================ routing
def assert_routing_matches(got, want, sel, what="routing"):
    """ids exact up to true near-ties (module docstring), weights on the matching rows."""
    routing_matches(got, want, sel, what, to_host=host)


def draw_logits(rng, T, E, dtype, scale=2.0):
    return uniform(rng, (T, E), scale, np.float32).astype(dtype)


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


@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("scaling", [1.0, 2.5])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
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


def test_routing_ties_go_to_the_lowest_id():
    T, E, K = 5, 64, 8
    logits = np.zeros((T, E), np.float32) + np.float32(0.25)  # every score equal
    logits[1, 40] = 3.0                                         # one clear winner
    logits[2, ::2] = 1.0                                        # ties among even ids
    got = ck_route.fused_topk(None, dev(logits), K, True)
    want = reference.fused_topk(None, logits, K, True)
    np.testing.assert_array_equal(host(got[1]), want[1])
    np.testing.assert_array_equal(host(got[1])[0], np.arange(K))


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


@pytest.mark.parametrize("num_experts", [512, 896, 1024])
@pytest.mark.parametrize("num_finite", [0, 15])
@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_topk_single_group_non_finite(num_experts, num_finite, renormalize):
    """vLLM's test_grouped_topk_single_group_nonfinite_scores."""
    logits = np.full((1, num_experts), np.nan, BF16)
    logits[0, :num_finite] = np.arange(num_finite)
    logits[0, num_finite] = np.inf
    logits[0, num_finite + 1] = -np.inf
    bias = np.zeros(num_experts, np.float32)
    got = ck_route.grouped_topk(None, dev(logits), 16, renormalize, 1, 1, "sigmoid", 2.5,
                                dev(bias))
    want = reference.grouped_topk(None, logits, 16, renormalize, 1, 1, "sigmoid", 2.5, bias)
    np.testing.assert_array_equal(host(got[1]), want[1])
    np.testing.assert_allclose(host(got[0]), want[0], atol=2e-5, rtol=0)


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


def test_routing_fp64_logits():
    logits = draw_logits(rng_for("fp64"), 40, 64, np.float64)
    got = ck_route.fused_topk(None, dev(logits), 6, True)
    want = reference.fused_topk(None, logits, 6, True)
    assert_routing_matches(got, want, selection_values(logits))


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


# ============================================================================ alignment
def check_align(topk_ids, B, E, expert_map=None, pad=False, ignore_invalid=False):
    got = ck_align.moe_align_block_size(dev(topk_ids), B, E,
                                       None if expert_map is None else dev(expert_map),
                                       pad, ignore_invalid)
    want = reference.moe_align_block_size(topk_ids, B, E, expert_map, pad, ignore_invalid)
    got = tuple(host(x) for x in got)
    for g, w, name in zip(got, want, ("sorted_token_ids", "expert_ids", "num_tokens_post_padded")):
        assert g.dtype == np.int32, f"{name}: dtype {g.dtype}"
        assert g.shape == w.shape, f"{name}: shape {g.shape} != reference {w.shape}"
    assert_same_blocks(got, want, B, topk_ids.size)                     # the contract
    np.testing.assert_array_equal(got[0], want[0],                      # this kernel: stable
                                  err_msg="sorted_token_ids order (the kernel is stable)")
    return got


@pytest.mark.parametrize("B", [32, 128])
@pytest.mark.parametrize("K", [1, 2, 16, 32])
@pytest.mark.parametrize("E", [32, 160, 256, 257])
@pytest.mark.parametrize("T", [1, 3, 256, 2256, 4096])
def test_align_vllm_grid(T, E, K, B):
    rng = rng_for("align", T, E, K, B)
    check_align(distinct_topk_ids(rng, T, E, K), B, E)


@pytest.fixture(params=["one_block", "grid"])
def align_path(request, monkeypatch):
    """Both alignment paths: one block (P <= SMALL_P) and the cooperative grid (forced, with
    blocks of 2 warps of 32 slots: a 1000-slot case spans 16 blocks, E1024 hits the SM cap)."""
    if request.param == "grid":
        monkeypatch.setitem(ck_align.CONFIGS["align"], "SMALL_P", 0)
        monkeypatch.setitem(ck_align.CONFIGS["align"], "WARP_SLOTS", 32)
        monkeypatch.setitem(ck_align.CONFIGS["align"], "TABLE_LOADS", 1 << 20)  # no table cap
        monkeypatch.setitem(ck_align.CONFIGS["group"], "MAX_WARPS", 2)
    return request.param


@pytest.mark.parametrize("case", ["one_token", "all_on_one_expert", "empty_experts",
                                  "one_expert_per_block", "E1024", "not_pow2", "B1", "pad"])
def test_align_nasty(case, align_path):
    rng = rng_for("align_nasty", case)
    B, pad = 16, False
    if case == "one_token":
        E, ids = 8, np.array([[5, 2]], np.int32)
    elif case == "all_on_one_expert":
        E, ids = 64, np.full((1000, 1), 37, np.int32)
    elif case == "empty_experts":  # only 3 of 257 experts used, T not a multiple of B
        E, ids = 257, rng.choice(np.array([0, 100, 256], np.int32), size=(333, 2))
    elif case == "one_expert_per_block":
        E, ids, B = 128, distinct_topk_ids(rng, 7, 128, 4), 1
    elif case == "E1024":
        E, ids, B = 1024, distinct_topk_ids(rng, 1500, 1024, 8), 64
    elif case == "not_pow2":
        E, ids, B = 100, distinct_topk_ids(rng, 777, 100, 6), 24
    elif case == "B1":
        E, ids, B = 16, distinct_topk_ids(rng, 99, 16, 3), 1
    else:
        E, ids, pad = 40, distinct_topk_ids(rng, 50, 40, 3), True
    check_align(ids, B, E, pad=pad)


def test_align_empty_batch(align_path):
    got = check_align(np.zeros((0, 4), np.int32), 16, 8)
    assert got[0].size == 0 and int(got[2][0]) == 0


@pytest.mark.parametrize("ignore_invalid", [False, True])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("ep_rank", [0, 3])
def test_align_expert_map(ep_rank, placement, ignore_invalid, align_path):
    T, E, K, B = 300, 64, 6, 16
    rng = rng_for("align_map", ep_rank, placement, ignore_invalid)
    _, emap = reference.determine_expert_map(4, ep_rank, E, placement)
    check_align(distinct_topk_ids(rng, T, E, K), B, E, emap.astype(np.int32), False,
                ignore_invalid)


@pytest.mark.parametrize("ignore_invalid", [False, True])
def test_align_skips_ids_outside_the_experts(ignore_invalid, align_path):
    """vLLM's -1 (a masked or padded token, another rank's expert) and ids past E: placed
    nowhere, counted nowhere."""
    T, E, K, B = 300, 64, 6, 16
    ids = distinct_topk_ids(rng_for("align_skip"), T, E, K)
    ids[::7] = -1
    ids[3, 2] = E + 5
    check_align(ids, B, E)
    _, emap = reference.determine_expert_map(4, 1, E)
    check_align(ids, B, E, emap.astype(np.int32), False, ignore_invalid)


def test_align_int64_ids_and_bad_inputs():
    ids = distinct_topk_ids(rng_for("i64"), 30, 16, 2)
    got = ck_align.moe_align_block_size(dev(ids.astype(np.int64)), 8, 16)
    want = reference.moe_align_block_size(ids, 8, 16)
    np.testing.assert_array_equal(host(got[0]), want[0])
    with pytest.raises(TypeError, match="topk_ids"):
        ck_align.moe_align_block_size(dev(np.ones((3, 2), np.float32)), 8, 16)
    with pytest.raises(TypeError, match="topk_ids"):
        ck_align.moe_align_block_size(ids, 8, 16)
    with pytest.raises(ValueError, match="block_size"):
        ck_align.moe_align_block_size(dev(ids), 0, 16)
    with pytest.raises(ValueError, match="expert_map"):
        ck_align.moe_align_block_size(dev(ids), 8, 16, dev(np.zeros(15, np.int32)))
    with pytest.raises(ValueError, match="topk_ids"):
        ck_align.moe_align_block_size(dev(np.ones((4, 8), np.int32))[:, ::2], 8, 16)


# ============================================================================ permute / unpermute
@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("T,E,K,H", [(1, 8, 2, 64), (67, 16, 3, 130), (256, 128, 8, 2048),
                                     (1000, 257, 6, 7), (513, 64, 1, 4096)])
def test_permute_unpermute(T, E, K, H, dkey):
    dtype = DTYPES[dkey]
    rng = rng_for("permute", T, E, K, H, dkey)
    x = uniform(rng, (T, H), 1.0, dtype)
    ids = distinct_topk_ids(rng, T, E, K)
    got = ck_perm.moe_permute(dev(x), dev(ids), E)
    want = reference.moe_permute(x, ids, E)
    for g, w, name in zip(got, want, ("x_grouped", "expert_offsets", "inv_permuted_idx")):
        g = host(g)
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=name)
    y = uniform(rng, (T * K, H), 1.0, dtype)
    w8 = random_weights(rng, T, K)
    inv = want[2]
    out = ck_perm.moe_unpermute(dev(y), dev(w8), dev(inv))
    assert_close(host(out), reference.moe_unpermute(y, w8, inv), dtype, "moe_unpermute")


def test_permute_all_on_one_expert_and_empty():
    x = uniform(rng_for("p1"), (40, 24), 1.0, np.float32)
    ids = np.full((40, 2), 5, np.int32)
    ids[:, 1] = 6
    got = ck_perm.moe_permute(dev(x), dev(ids), 10)
    want = reference.moe_permute(x, ids, 10)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(host(g), w)
    x0 = np.zeros((0, 24), np.float32)
    got = ck_perm.moe_permute(dev(x0), dev(np.zeros((0, 2), np.int32)), 10)
    assert got[0].shape == (0, 24) and got[2].shape == (0,)
    np.testing.assert_array_equal(host(got[1]), np.zeros(11, np.int32))
    out = ck_perm.moe_unpermute(dev(np.zeros((0, 24), np.float32)),
                                dev(np.zeros((0, 2), np.float32)), dev(np.zeros(0, np.int32)))
    assert out.shape == (0, 24)


def test_unpermute_misaligned_view_and_bad_inputs():
    T, K, H = 9, 2, 64
    rng = rng_for("unperm_misaligned")
    buf = uniform(rng, (T * K * H + 1,), 1.0, np.float16)
    y = buf[1:].reshape(T * K, H)  # 2 bytes off a 16-byte boundary: the scalar path
    w = random_weights(rng, T, K)
    inv = np.random.default_rng(1).permutation(T * K).astype(np.int32)
    d_buf = dev(buf)
    out = ck_perm.moe_unpermute(d_buf[1:].reshape(T * K, H), dev(w), dev(inv))
    assert_close(host(out), reference.moe_unpermute(y, w, inv), np.float16, "misaligned")
    with pytest.raises(ValueError, match="y_grouped"):
        ck_perm.moe_unpermute(dev(np.ones((5, H), np.float32)), dev(w), dev(inv))
    with pytest.raises(ValueError, match="inv_permuted_idx"):
        ck_perm.moe_unpermute(dev(np.ones((T * K, H), np.float32)), dev(w), dev(inv[:-1]))


# ============================================================================ activation
ACTS_MUL = ["silu", "gelu", "gelu_tanh", "swigluoai"]
ACTS_NO_MUL = ["silu", "gelu", "gelu_tanh", "relu2"]


@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("M,N", [(1, 2), (37, 14), (256, 256), (130, 1536), (3, 2 * 1000)])
@pytest.mark.parametrize("act", ACTS_MUL)
def test_activation_and_mul(act, M, N, dkey):
    dtype = DTYPES[dkey]
    x = uniform(rng_for("act", act, M, N, dkey), (M, N), 9.0, dtype)  # past swigluoai's limit
    got = ck_act.apply_activation(dev(x), act, True)
    assert_close(host(got), reference.apply_activation(x, act, True), dtype, act)
    if dtype.itemsize == 2:   # vLLM's rounding points: the bits but for last-ulp flips
        want = reference.apply_activation(x, act, True)
        mask = rounding_comparable(x, act, True)     # not where erf / tanh cancel
        flips = host(got).view(np.uint16) != want.view(np.uint16)
        assert flips[mask].mean() < 0.01, act


@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("M,N", [(1, 1), (37, 15), (256, 768)])
@pytest.mark.parametrize("act", ACTS_NO_MUL)
def test_activation_no_mul(act, M, N, dkey):
    dtype = DTYPES[dkey]
    x = uniform(rng_for("act_nm", act, M, N, dkey), (M, N), 4.0, dtype)
    got = ck_act.apply_activation(dev(x), act, False)
    assert_close(host(got), reference.apply_activation(x, act, False), dtype, act)
    got = ck_act.apply_activation(dev(x), act + "_no_mul")
    assert_close(host(got), reference.apply_activation(x, act, False), dtype, act + "_no_mul")


def test_activation_named_functions_nan_and_misaligned():
    rng = rng_for("act_named")
    x = uniform(rng, (20, 64), 3.0, np.float32)
    for fn in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul", "swigluoai_and_mul"):
        assert_close(host(getattr(ck_act, fn)(dev(x))), getattr(reference, fn)(x), np.float32, fn)
    xn = x.copy()
    xn[3, 0] = np.nan   # a gate (first half, and an interleaved gate)
    xn[5, 33] = np.nan  # an up of the halves layout
    for fn in ("silu_and_mul", "swigluoai_and_mul"):
        got, want = host(getattr(ck_act, fn)(dev(xn))), getattr(reference, fn)(xn)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{fn} NaN")
    buf = uniform(rng, (20 * 64 + 1,), 3.0, BF16)
    got = ck_act.silu_and_mul(dev(buf)[1:].reshape(20, 64))  # misaligned: scalar path
    assert_close(host(got), reference.silu_and_mul(buf[1:].reshape(20, 64)), BF16, "misaligned")
    empty = ck_act.silu_and_mul(dev(np.zeros((0, 8), np.float32)))
    assert empty.shape == (0, 4)


def test_activation_bad_inputs():
    with pytest.raises(ValueError, match="x"):
        ck_act.silu_and_mul(dev(np.ones((4, 7), np.float32)))
    with pytest.raises(ValueError, match="activation"):
        ck_act.apply_activation(dev(np.ones((4, 8), np.float32)), "tanh")
    with pytest.raises(ValueError, match="activation"):
        ck_act.apply_activation(dev(np.ones((4, 8), np.float32)), "relu2", True)
    with pytest.raises(TypeError, match="x"):
        ck_act.silu_and_mul(dev(np.ones((4, 8), np.float64)))
    with pytest.raises(ValueError, match="x"):
        ck_act.silu_and_mul(dev(np.ones((8, 4), np.float32)).T)


# ============================================================================ combine
@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("T,K,H", [(1, 2, 4096), (33, 8, 2048), (512, 1, 128), (7, 6, 7),
                                   (100, 22, 1000), (2, 3, 1)])
def test_moe_sum(T, K, H, dkey):
    dtype = DTYPES[dkey]
    x = uniform(rng_for("moe_sum", T, K, H, dkey), (T, K, H), 1.0, dtype)
    d = dev(x)
    got = ck_combine.moe_sum(d)
    assert_close(host(got), reference.moe_sum(x), dtype, "moe_sum")
    again = ck_combine.moe_sum(d)  # deterministic: bitwise the same twice
    np.testing.assert_array_equal(host(got).view(np.uint8), host(again).view(np.uint8))


@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("with_map", [False, True])
def test_moe_sum_pad_aware(dkey, with_map):
    """vLLM's moe_sum(input, output, topk_ids, expert_map): dead slots are never read."""
    dtype = DTYPES[dkey]
    T, K, H = 33, 4, 2048
    rng = rng_for("moe_sum_pad", dkey, with_map)
    x = uniform(rng, (T, K, H), 1.0, dtype)
    ids = distinct_topk_ids(rng, T, 16, K)
    ids[::5, 1] = -1
    ids[7] = -1
    emap = reference.determine_expert_map(2, 0, 16)[1].astype(np.int32) if with_map else None
    live = reference.combine.slot_is_live(ids, emap)
    x[~live] = np.nan                                 # rows the GEMMs never wrote
    got = ck_combine.moe_sum(dev(x), dev(ids), None if emap is None else dev(emap))
    want = reference.moe_sum(x, ids, emap)
    assert np.isfinite(host(got).astype(np.float32)).all()
    assert_close(host(got), want, dtype, "moe_sum pad-aware")


def test_moe_sum_empty_misaligned_and_bad_inputs():
    assert ck_combine.moe_sum(dev(np.zeros((0, 2, 8), np.float32))).shape == (0, 8)
    buf = uniform(rng_for("sum_mis"), (5 * 3 * 16 + 1,), 1.0, np.float16)
    got = ck_combine.moe_sum(dev(buf)[1:].reshape(5, 3, 16))
    assert_close(host(got), reference.moe_sum(buf[1:].reshape(5, 3, 16)), np.float16, "misaligned")
    with pytest.raises(ValueError, match="x"):
        ck_combine.moe_sum(dev(np.ones((4, 8), np.float32)))
    with pytest.raises(TypeError, match="x"):
        ck_combine.moe_sum(dev(np.ones((2, 2, 8), np.int32)))


# ============================================================================ devices
def test_wrong_device_is_rejected():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs to place an array on the wrong one")
    with cupy.cuda.Device(1):
        x = cupy.ones((4, 8), cupy.float32)
    with pytest.raises(ValueError, match="device"):
        ck_combine.moe_sum(x.reshape(2, 2, 8))
    with pytest.raises(ValueError, match="device"):
        ck_act.silu_and_mul(x)
