"""The Numba backend on a real GPU: every stage against the reference, at the CuPy tests' sizes.

    T tokens, E experts, K top-k, G expert groups, H hidden, I intermediate, B block size,
    N output width, Kd inner size, P = T*K slots

Every test is `gpu` and skips cleanly without a usable device (or under the simulator, which
tests/numba_sim covers). Outputs are poisoned (NaN / POISON_INT) before every launch via
`poisoned_outputs()`, so an element a kernel forgets fails. What "equal" means:
- routing ids: exact, except at true near-ties: expf and the warp-tree softmax sum may differ
  from NumPy by an ulp, so two experts whose reference selection values agree within 1e-6
  relative may swap (at most 1% of rows); ids distinct in every row; weights within 1e-5 on
  the rows whose ids match (routing math is fp32 for every input dtype). Both kernel flavours
  ("warp": shuffles, "block": shared memory) run.
- alignment, permute: integer outputs exact (the kernels are stable, so equal to the
  reference, which is stronger than the contract's per-block sets: checked as well).
- unpermute, activation, combine, GEMM: relative Frobenius error vs the reference on float64
  inputs, fp32 <= 1e-5, fp16 / bf16 <= 1e-2; NaN never passes.

Inputs are host NumPy arrays (host in, host out: the stage copies) unless a test is about
array kinds (numba device arrays, torch CUDA tensors, CuPy arrays).

Every kernel and dtype is covered by default, on a subset of the shape grids that fits a
GPU session's budget (each new kernel x dtype costs a JIT compile of a few seconds the first
time; the disk cache spares later runs). MOE_SANDBOX_FULL_GRID=1 runs the CuPy tests' full
grids in every dtype. MOE_SANDBOX_SANITIZE=1 adds compute-sanitizer memcheck and racecheck
over cuda_kernels/numba/_sanitize.py (minutes).
Run: python -m pytest tests/test_numba_gpu.py -q
"""
import functools
import importlib
import os

import numpy as np
import pytest
from tests.oracles import (
    BF16,
    TOL,
    assert_routing_matches,
    assert_same_blocks,
    distinct_topk_ids,
    gemm_problem,
    random_weights,
    rel_err,
    rng_for,
    rounding_comparable,
    selection_values,
    uniform,
)

import reference
from cuda_kernels import numba as nb

A = importlib.import_module("cuda_kernels.numba._arrays")
OK, WHY = nb.availability()
ON_GPU = OK and not A.is_simulator()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_GPU, reason=f"needs a CUDA GPU through numba: {WHY}")]

if ON_GPU:
    R = importlib.import_module("cuda_kernels.numba.routing")
    Al = importlib.import_module("cuda_kernels.numba.align")
    Pm = importlib.import_module("cuda_kernels.numba.permute")
    Ac = importlib.import_module("cuda_kernels.numba.activation")
    Cb = importlib.import_module("cuda_kernels.numba.combine")
    G = importlib.import_module("cuda_kernels.numba.gemm")

DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": BF16}
FLAVORS = ("keys", "warp", "block")
FULL = os.environ.get("MOE_SANDBOX_FULL_GRID") == "1"


def grid(default, full):
    """The default (session-budget) list, or the full grid with MOE_SANDBOX_FULL_GRID=1."""
    return full if FULL else default


ALL_DTYPES = tuple(DTYPES)
MAIN_DTYPE = grid(("bf16",), ALL_DTYPES)     # grids that run in every dtype only when FULL


@pytest.fixture(autouse=True)
def poison():
    with nb.poisoned_outputs():
        yield


def assert_close(got, want, dtype, what):
    got = nb.to_host(got)
    assert got.dtype == np.dtype(dtype), f"{what}: dtype {got.dtype} != {np.dtype(dtype)}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = rel_err(got, want)
    assert err <= TOL[np.dtype(dtype)], f"{what}: relative error {err:.3e}"


# ============================================================================ routing
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
@pytest.mark.parametrize("E,K", grid([(8, 2), (60, 4), (257, 9), (1024, 32)],
                                     [(8, 2), (16, 1), (60, 4), (128, 8), (256, 8), (257, 9),
                                      (512, 22), (1024, 32)]))
@pytest.mark.parametrize("T", grid([1, 1024], [1, 67, 1024]))
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_fused_topk(T, E, K, renormalize, dkey, flavor, scoring):
    x = draw_logits(T, E, DTYPES[dkey], renormalize)
    got = R.fused_topk(None, x, K, renormalize, scoring_func=scoring)
    want = reference.fused_topk(None, x, K, renormalize, scoring_func=scoring)
    assert_routing(got, want, selection_values(x, scoring), f"fused_topk {flavor}")
    np.testing.assert_array_equal(got[2], want[2])


@pytest.mark.parametrize("dkey", MAIN_DTYPE)
@pytest.mark.parametrize("scaling", [1.0, 2.5])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("E,K", grid([(16, 2), (256, 8), (512, 22)],
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
@pytest.mark.parametrize("E,K,Gr,TG", grid([(16, 2, 8, 2), (256, 8, 8, 4), (96, 6, 6, 3)],
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
    x = np.full((1, num_experts), np.nan, BF16)
    x[0, :num_finite] = np.arange(num_finite)
    x[0, num_finite] = np.inf
    x[0, num_finite + 1] = -np.inf
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


# ============================================================================ alignment
def assert_align_exact(got, want, B, P, what):
    got = tuple(nb.to_host(v) for v in got)
    for g, w, name in zip(got, want, ("sorted_token_ids", "expert_ids", "num_tokens_post_padded")):
        assert g.dtype == np.int32, f"{what}: {name} dtype {g.dtype}"
        np.testing.assert_array_equal(g, w, err_msg=f"{what}: {name}")
    assert_same_blocks(got, want, B, P)


def forced_align(ids, B, E, path, expert_map=None, ignore=False, rank="warp"):
    call = A.Call("topk_ids", ids)
    cap = Al.max_num_tokens_padded(ids.size, B, E)
    out = Al._sort_slots(call, ids, E, B, expert_map, bool(ignore and expert_map is not None),
                         cap, True, False, path=path, rank=rank)
    return tuple(call.result(v) for v in out[:3])


@pytest.fixture
def grid_everywhere(monkeypatch):
    """align.py's kernel as a grid of blocks behind its barrier even for a few slots (blocks
    of 2 warps), so that small shapes cover the grid path too."""
    Ag = importlib.import_module("cuda_kernels.numba.align_grid")
    monkeypatch.setitem(Ag.CONFIGS, "grid", dict(Ag.CONFIGS["grid"], SMALL_P=0, GRID_WARPS=2))


@pytest.mark.parametrize("B", [32, 128])
@pytest.mark.parametrize("K", [1, 2, 16, 32])
@pytest.mark.parametrize("E", [32, 160, 256, 257])
@pytest.mark.parametrize("T", [1, 3, 256, 2256, 4096])
def test_align_vllm_grid(T, E, K, B):
    ids = distinct_topk_ids(rng_for("align", T, E, K), T, E, K)
    want = reference.moe_align_block_size(ids, B, E)
    assert_align_exact(Al.moe_align_block_size(nb.to_device(ids), B, E), want, B, ids.size,
                       "default path (grid)")
    if ids.size <= 4096:   # the "warp" ranks, one block and several
        assert_align_exact(forced_align(ids, B, E, "multi"), want, B, ids.size, "warp multi")
        assert_align_exact(forced_align(ids, B, E, "single"), want, B, ids.size, "warp single")


@pytest.mark.parametrize("B", [1, 16, 128])
@pytest.mark.parametrize("T,E,K", [(1, 256, 8), (3, 32, 2), (40, 257, 8), (300, 8, 2),
                                   (2256, 160, 16)])
def test_align_grid_barrier(grid_everywhere, T, E, K, B):
    """The one-launch kernel as a grid of several blocks (its barrier, the [G, E] count table,
    every block's share of the padding), with and without an expert map."""
    ids = distinct_topk_ids(rng_for("align-grid", T, E, K), T, E, K)
    want = reference.moe_align_block_size(ids, B, E)
    assert_align_exact(Al.moe_align_block_size(nb.to_device(ids), B, E), want, B, ids.size,
                       "grid of blocks")
    _, emap = reference.determine_expert_map(4, 1, E, "round_robin")
    for ignore in (False, True):
        want = reference.moe_align_block_size(ids, B, E, emap, False, ignore)
        got = Al.moe_align_block_size(nb.to_device(ids), B, E, nb.to_device(emap), False, ignore)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(nb.to_host(g), w)
    x = uniform(rng_for("perm-grid", T), (T, 24), 1.0, np.float32)
    for g, w in zip(Pm.moe_permute(x, ids, E), reference.moe_permute(x, ids, E)):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("case", ["one_token", "all_on_one_expert", "empty_experts", "int64",
                                  "pad_sorted_ids", "block_1", "empty"])
def test_align_nasty(case):
    rng = rng_for("nasty", case)
    ids, B, E, pad = {
        "one_token": (distinct_topk_ids(rng, 1, 64, 8), 16, 64, False),
        "all_on_one_expert": (np.full((5000, 1), 7, np.int32), 64, 16, False),
        "empty_experts": (distinct_topk_ids(rng, 40, 256, 2), 32, 256, False),
        "int64": (distinct_topk_ids(rng, 700, 64, 6).astype(np.int64), 16, 64, False),
        "pad_sorted_ids": (distinct_topk_ids(rng, 333, 60, 4), 64, 60, True),
        "block_1": (distinct_topk_ids(rng, 999, 32, 4), 1, 32, False),
        "empty": (np.zeros((0, 8), np.int32), 64, 32, False),
    }[case]
    want = reference.moe_align_block_size(ids, B, E, pad_sorted_ids=pad)
    got = Al.moe_align_block_size(ids, B, E, pad_sorted_ids=pad)
    assert_align_exact(got, want, B, ids.size, case)


@pytest.mark.parametrize("ignore", [False, True])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("T", [3, 3000])
def test_align_expert_map(T, placement, ignore):
    E = 64
    _, emap = reference.determine_expert_map(4, 1, E, placement)
    ids = distinct_topk_ids(rng_for("emap", T, placement), T, E, 8)
    want = reference.moe_align_block_size(ids, 32, E, emap, False, ignore)
    got = Al.moe_align_block_size(nb.to_device(ids), 32, E, nb.to_device(emap), False, ignore)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(nb.to_host(g), w)


# ============================================================================ permute
@pytest.mark.parametrize("dkey", ALL_DTYPES)
@pytest.mark.parametrize("T,E,K,H", grid([(1, 8, 2, 64), (256, 128, 8, 2048), (0, 8, 2, 64),
                                          (67, 16, 3, 130)],   # rows not whole 16-byte chunks
                                         [(1, 8, 2, 64), (67, 16, 3, 130), (256, 128, 8, 2048),
                                          (4096, 256, 8, 128), (0, 8, 2, 64)]))
def test_permute_unpermute(T, E, K, H, dkey):
    dt = DTYPES[dkey]
    rng = rng_for("perm", T, E, K, H)
    x = uniform(rng, (T, H), 1.0, dt)
    ids = distinct_topk_ids(rng, T, E, K)
    got = Pm.moe_permute(x, ids, E)
    want = reference.moe_permute(x, ids, E)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    if T:
        y = uniform(rng, (T * K, H), 1.0, dt)
        tw = random_weights(rng, T, K)
        assert_close(Pm.moe_unpermute(y, tw, want[2]),
                     reference.moe_unpermute(y.astype(np.float64), tw.astype(np.float64),
                                             want[2]).astype(np.float64), dt, "unpermute")


# ============================================================================ activation, combine
ACT_DTYPES = grid([("silu", "bf16"), ("gelu", "bf16"), ("gelu_tanh", "bf16"),
                   ("swigluoai", "bf16"), ("silu", "fp32"), ("swigluoai", "fp16")],
                  [(a, d) for a in ("silu", "gelu", "gelu_tanh", "swigluoai") for d in DTYPES])


@pytest.mark.parametrize("M,N", grid([(1, 2), (37, 14), (130, 1536), (4096, 4096)],
                                     [(1, 2), (37, 14), (256, 256), (130, 1536), (3, 2000),
                                      (4096, 4096)]))
@pytest.mark.parametrize("act,dkey", ACT_DTYPES)
def test_activation_and_mul(act, M, N, dkey):
    dt = DTYPES[dkey]
    x = uniform(rng_for("act", act, M, N), (M, N), 6.0, dt)
    want = reference.apply_activation(x.astype(np.float64), act, True)
    assert_close(Ac.apply_activation(x, act, True), want, dt, act)
    if dkey != "fp32":   # vLLM's rounding points: the bits but for last-ulp exp / erf flips
        got = nb.to_host(Ac.apply_activation(x, act, True))
        engine = reference.apply_activation(x, act, True)
        mask = rounding_comparable(x, act, True)     # not where erf / tanh cancel
        assert (got.view(np.uint16) != engine.view(np.uint16))[mask].mean() < 0.01, act


@pytest.mark.parametrize("M,N", [(1, 1), (37, 15), (256, 768)])
@pytest.mark.parametrize("act,dkey", grid(
    [("silu", "bf16"), ("gelu", "bf16"), ("gelu_tanh", "bf16"), ("relu2", "bf16"),
     ("relu2", "fp32")],
    [(a, d) for a in ("silu", "gelu", "gelu_tanh", "relu2") for d in DTYPES]))
def test_activation_no_mul(act, M, N, dkey):
    dt = DTYPES[dkey]
    x = uniform(rng_for("nomul", act, M, N), (M, N), 4.0, dt)
    want = reference.apply_activation(x.astype(np.float64), act, False)
    assert_close(Ac.apply_activation(x, act, False), want, dt, act)


@pytest.mark.parametrize("T,K,H,dkey", grid(
    [(1, 2, 4096, "bf16"), (33, 8, 2048, "bf16"), (33, 8, 2048, "fp32"), (33, 8, 2048, "fp16"),
     (7, 40, 7, "bf16"), (4096, 8, 7168, "bf16")],
    [(T, K, H, d) for (T, K, H) in ((1, 2, 4096), (33, 8, 2048), (512, 1, 128), (7, 6, 7),
                                    (7, 40, 7), (4096, 8, 7168)) for d in DTYPES]))
def test_moe_sum(T, K, H, dkey):
    dt = DTYPES[dkey]
    x = uniform(rng_for("sum", T, K, H), (T, K, H), 1.0, dt)
    assert_close(Cb.moe_sum(x), reference.moe_sum(x.astype(np.float64)), dt, "moe_sum")
    ids = distinct_topk_ids(rng_for("sum-ids", T, K), T, 2 * K + 1, K)
    ids[:: 3, 0] = -1                              # slots routed nowhere: never read
    live = reference.combine.slot_is_live(ids)
    x_pad = np.where(live[:, :, None], x, np.nan).astype(dt)
    assert_close(Cb.moe_sum(x_pad, ids), reference.moe_sum(x.astype(np.float64), ids), dt,
                 "moe_sum pad-aware")


# ============================================================================ grouped GEMM
@functools.lru_cache(maxsize=2)
def cached_problem(*args, **kw):
    """gemm_problem, reused by the versions that run back to back on one problem."""
    return gemm_problem(*args, **kw)


def gemm_check(args, want, version):
    got = G.grouped_gemm(*args, version=version)
    err = rel_err(got, want)
    assert got.dtype == args[0].dtype
    assert err <= TOL[np.dtype(args[0].dtype)], f"{version}: relative error {err:.3e}"
    return got


VERSIONS = ("v1", "v2", "v3", None)
VLLM_TIH = ((1, 128, 128), (1, 2048, 128), (33, 2048, 128), (222, 1024, 1024))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("which", ["gemm1", "gemm2"])
@pytest.mark.parametrize("dkey", MAIN_DTYPE)
@pytest.mark.parametrize("top_k", [2, 6])
@pytest.mark.parametrize("E", [8, 64])
@pytest.mark.parametrize("T,I,H", VLLM_TIH)
def test_gemm_vllm_grid(T, I, H, E, top_k, dkey, which, version):  # noqa: E741
    dt = DTYPES[dkey]
    B = G.get_config(T, 2 * I, H, E, top_k, dt)["BLOCK_M"]
    if which == "gemm1":
        args, want = cached_problem(T, E, top_k, 2 * I, H, B, dt, seed=1)
    else:
        args, want = cached_problem(T, E, top_k, H, I, B, dt, seed=2, gemm2=True, mul=True)
    gemm_check(args, want, version)


GEMM_NASTY = {
    "one_token": (1, 8, 2, 256, 128, 16, {}),
    "T_not_multiple_of_block": (37, 8, 2, 192, 256, 64, {}),
    "experts_without_tokens": (3, 64, 2, 128, 128, 16, {}),
    "N200_K136": (19, 8, 3, 200, 136, 16, {}),
    "block_128": (300, 4, 2, 256, 512, 128, {}),
    "block_8_falls_back_to_v2": (30, 4, 2, 96, 72, 8, {}),
    "block_48": (50, 4, 2, 96, 72, 48, {}),
    "bias_fp32_and_weights": (25, 8, 2, 136, 264, 16, {"bias": np.float32, "mul": True}),
    "gemm2_weights": (41, 16, 4, 120, 96, 32, {"gemm2": True, "mul": True}),
    "Kd_70_element_loads": (21, 8, 2, 96, 70, 16, {"mul": True}),
}
# fp32 / fp16 run these by default (bf16 runs every case): each version, each tile height
OTHER_DTYPE_CASES = ("one_token", "T_not_multiple_of_block", "block_48", "gemm2_weights",
                     "Kd_70_element_loads")
NASTY_PARAMS = [(c, d) for c in GEMM_NASTY for d in DTYPES
                if FULL or d == "bf16" or c in OTHER_DTYPE_CASES]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case,dkey", NASTY_PARAMS)
def test_gemm_nasty(case, dkey, version):
    T, E, K, N, Kd, B, extra = GEMM_NASTY[case]
    gemm_check(*cached_problem(T, E, K, N, Kd, B, DTYPES[dkey], **extra), version)


@pytest.mark.parametrize("version", VERSIONS)
def test_gemm_all_tokens_on_one_expert_and_expert_map(version):
    ids = np.full((77, 1), 5, np.int32)
    gemm_check(*gemm_problem(77, 8, 1, 192, 256, 16, np.float16, ids=ids, mul=True), version)
    _, emap = reference.determine_expert_map(2, 1, 8)
    args, want = gemm_problem(29, 8, 2, 160, 128, 16, BF16, expert_map=emap, E_local=4,
                              bias=np.float32, mul=True)
    got = gemm_check(args, want, version).astype(np.float64)
    assert (got[np.all(want == 0, axis=1)] == 0).all()
    _, emap = reference.determine_expert_map(2, 0, 8)
    args, want = gemm_problem(21, 8, 2, 128, 128, 16, np.float16, expert_map=emap, E_local=4,
                              ignore=True)
    got = G.grouped_gemm(*args, version=version).astype(np.float64)
    live = np.isfinite(want).all(axis=1)
    assert (~live).any() and np.isnan(got[~live]).all()
    assert rel_err(got[live], want[live]) <= 1e-2


def test_gemm_empty_batch_and_deterministic():
    args, _ = gemm_problem(0, 8, 2, 64, 64, 16, np.float32)
    assert G.grouped_gemm(*args).shape == (0, 64)
    args, _ = gemm_problem(64, 8, 2, 256, 512, 16, BF16, mul=True)
    one, two = G.grouped_gemm(*args), G.grouped_gemm(*args)
    np.testing.assert_array_equal(one.view(np.uint16), two.view(np.uint16))


# ============================================================================ array kinds
def test_numba_device_arrays_in_numba_arrays_out():
    x = draw_logits(10, 16, np.float32)
    w, ids, _ = R.fused_topk(None, nb.to_device(x), 2, True)
    assert type(w).__module__.startswith("numba")
    np.testing.assert_array_equal(nb.to_host(ids), reference.fused_topk(None, x, 2, True)[1])


@pytest.mark.parametrize("dkey", DTYPES)
def test_torch_tensors_in_torch_tensors_out(dkey):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    dt = DTYPES[dkey]
    tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dkey]
    x = uniform(rng_for("torch", dkey), (5, 3, 40), 1.0, dt)
    t = torch.from_numpy(x.astype(np.float32)).to("cuda", tdt)
    out = Cb.moe_sum(t)
    assert isinstance(out, torch.Tensor) and out.dtype == tdt and out.is_cuda
    assert_close(nb.to_host(out), reference.moe_sum(x.astype(np.float64)), dt, "torch moe_sum")
    act = Ac.silu_and_mul(t.reshape(15, 40))
    assert isinstance(act, torch.Tensor) and act.dtype == tdt


@pytest.mark.parametrize("dkey", DTYPES)
def test_cupy_arrays_in_cupy_arrays_out(dkey):
    cupy = pytest.importorskip("cupy")
    dt = DTYPES[dkey]
    x = uniform(rng_for("cupy", dkey), (6, 2, 33), 1.0, dt)
    try:
        d = cupy.asarray(x)
    except Exception:
        pytest.skip("this CuPy has no bf16")
    out = Cb.moe_sum(d)
    assert isinstance(out, cupy.ndarray)
    assert_close(nb.to_host(out).view(dt) if out.dtype == np.uint16 else nb.to_host(out),
                 reference.moe_sum(x.astype(np.float64)), dt, "cupy moe_sum")


# ============================================================================ the layer
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_validate_layer_on_numba(dtype):
    from sandbox.layer import FusedMoE
    from sandbox.validate import validate

    layer = FusedMoE.random(num_experts=16, top_k=4, hidden_size=256, intermediate_size=192,
                            params_dtype=dtype)
    x, logits = layer.random_inputs(77, seed=3)
    report = validate(layer, x, logits, backends=["reference", "numba"])
    assert report.ok, report.table()


def test_mixed_mappings_numba_and_cupy():
    from sandbox.layer import FusedMoE
    from sandbox.registry import get_backend

    if not get_backend("cupy").ok:
        pytest.skip(f"cupy backend: {get_backend('cupy').reason}")
    layer = FusedMoE.random(num_experts=8, top_k=2, hidden_size=128, intermediate_size=256)
    x, logits = layer.random_inputs(33, seed=4)
    want = layer.forward(x, logits)
    for mapping in ({"route": "numba", "align": "numba", "gemm1": "cupy", "activation": "cupy",
                     "gemm2": "cupy", "combine": "numba"},
                    {"route": "cupy", "align": "cupy", "gemm1": "numba", "activation": "numba",
                     "gemm2": "numba", "combine": "cupy"}):
        got = layer.with_backend(mapping).forward(x, logits)
        assert rel_err(got, want) <= 1e-5, mapping


# ============================================================================ compute-sanitizer
def _sanitizer():
    import shutil

    path = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    return path if os.path.exists(path) else None


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MOE_SANDBOX_SANITIZE") != "1",
                    reason="minutes under the sanitizer: set MOE_SANDBOX_SANITIZE=1")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_clean(tool):
    """One representative launch of every kernel (cuda_kernels/numba/_sanitize.py) under
    compute-sanitizer: no invalid access (memcheck), no shared-memory race (racecheck), and
    every output still equal to the reference."""
    import subprocess
    import sys

    tool_path = _sanitizer()
    if tool_path is None:
        pytest.skip("compute-sanitizer not found")
    cmd = [tool_path, "--tool", tool, "--error-exitcode", "9",
           sys.executable, "-m", "cuda_kernels.numba._sanitize"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3000, check=False)
    out = r.stdout[-8000:] + r.stderr[-4000:]
    assert r.returncode == 0, f"{' '.join(cmd)} -> {r.returncode}\n{out}"
    assert "ERROR SUMMARY: 0 errors" in out or "RACECHECK SUMMARY: 0 hazards" in out, out
