"""The Numba grouped GEMM ladder in the CUDA simulator against reference.grouped_gemm.

    T tokens, E experts (E_local on this rank), K top-k, N output width, Kd inner size,
    B block size, P = T*K slots (rows of c)

Every version (v1 naive, v2 shared-memory tiles, v3 register blocking; the simulator's tile
configs are small, SIM_CONFIGS) x fp32 / fp16 / bf16 against the reference fed float64
inputs: fp32 within 1e-5, fp16 / bf16 within 1e-2 (one rounding of the output). Outputs are
poisoned (NaN) before every launch: a row the kernel forgets stays NaN and fails. Nasty
cases: one token, tokens not a multiple of the block, experts with no tokens, all tokens on
one expert, Kd and N not multiples of the tiles, block sizes the v3 tile cannot divide
(fallback to v2), expert_ids == -1 blocks (zeros), rows no block names (left alone), T = 0.

The v3v rung (16-byte loads, CuPy v3's layout) reads a and w in 16-byte chunks (4 fp32, 8 fp16 /
bf16), so it runs when Kd is a multiple of the chunk and one of its tile heights divides B;
otherwise the call falls back to v3 (and v2): each case is checked the same way. The
simulator's v3v tiles are tiny (SIM_CONFIGS): 8 or 4 rows x 8 columns x 8 deep, 4 x 4 per thread.
"""
import importlib

import numpy as np
import pytest

import reference
from cuda_kernels import numba as nb
from tests.oracles import BF16, check_gemm, gemm_problem, rel_err, rng_for, uniform
from tests.support import DTYPES

G = importlib.import_module("cuda_kernels.numba.gemm")

pytestmark = [pytest.mark.simulator, pytest.mark.usefixtures("numba_poison")]
VERSIONS = ("v1", "v2", "v3")


def run(args, version):
    return G.grouped_gemm(*args, version=version)


def check(args, want, version):
    return check_gemm(G.grouped_gemm, args, want, version)


CASES = {
    # name: (T, E, K, N, Kd, B, extra)
    "one_token": (1, 4, 2, 8, 8, 4, {}),
    "T_not_multiple_of_block": (5, 4, 2, 12, 10, 8, {}),
    "experts_without_tokens": (2, 12, 2, 6, 5, 4, {}),
    "bias_and_weights": (3, 4, 2, 9, 7, 4, {"bias": np.float32, "mul": True}),
    "gemm2": (3, 4, 2, 6, 9, 4, {"gemm2": True, "mul": True}),
    "block_not_divisible_by_tile": (4, 3, 2, 6, 5, 6, {"bias": np.float16}),
    "block_1": (2, 3, 2, 5, 4, 1, {}),
    "word_loads_Kd_8": (3, 4, 2, 9, 8, 8, {"bias": np.float32, "mul": True}),
    "word_loads_Kd_16_N_not_tile": (4, 3, 2, 11, 16, 4, {}),
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_cases(case, dkey, version):
    T, E, K, N, Kd, B, extra = CASES[case]
    check(*gemm_problem(T, E, K, N, Kd, B, DTYPES[dkey], **extra), version)


@pytest.mark.parametrize("version", VERSIONS)
def test_all_tokens_on_one_expert(version):
    ids = np.full((9, 1), 2, np.int32)
    check(*gemm_problem(9, 4, 1, 6, 6, 4, np.float32, ids=ids, mul=True), version)


@pytest.mark.parametrize("version", VERSIONS)
def test_expert_map_minus_one_blocks_are_zero(version):
    E, B = 6, 4
    _, emap = reference.determine_expert_map(2, 1, E)
    args, want = gemm_problem(5, E, 2, 6, 5, B, np.float32, expert_map=emap, E_local=3,
                         bias=np.float32, mul=True)
    got = check(args, want, version)
    st, ex, nt = args[2], args[3], args[4]
    zero = [s for b, e in enumerate(ex[:int(nt[0]) // B]) if e == -1
            for s in st[b * B:(b + 1) * B] if s < 10]
    assert zero and (got[zero] == 0).all()


@pytest.mark.parametrize("version", VERSIONS)
def test_rows_named_by_no_block_are_left_alone(version):
    E = 6
    _, emap = reference.determine_expert_map(2, 0, E)
    args, want = gemm_problem(5, E, 2, 6, 5, 4, np.float32, expert_map=emap, E_local=3, ignore=True)
    got = run(args, version)
    live = np.isfinite(want).all(axis=1)
    assert (~live).any() and live.any()
    assert np.isnan(got[~live]).all()
    assert rel_err(got[live], want[live]) <= 1e-5


@pytest.mark.parametrize("dkey,Kd,word", [("fp32", 10, "f32"), ("fp32", 7, ""),
                                          ("fp16", 8, "f16"), ("fp16", 6, ""),
                                          ("bf16", 12, "bf16"), ("bf16", 10, "")])
def test_v3_word_loads_when_kd_allows(dkey, Kd, word):
    """v3 reads a and w as 8-byte words when Kd is a multiple of the word's elements (2 fp32,
    4 fp16 / bf16), else element by element; both must match the reference."""
    args, want = gemm_problem(3, 4, 2, 6, Kd, 8, DTYPES[dkey])
    ad, wd = (nb.to_device(x) for x in args[:2])
    assert G._word_kind(ad, wd, Kd) == word
    check(args, want, "v3")


def test_plan_falls_back_and_empty_batch():
    assert G.plan(None, 8)[0] == "v3" and G.plan("v3", 2)[0] == "v2" and G.plan("v1", 3)[0] == "v1"
    args, _ = gemm_problem(0, 4, 2, 6, 5, 4, np.float32)
    for version in VERSIONS:
        assert run(args, version).shape == (0, 6)


def test_bad_inputs():
    args, _ = gemm_problem(3, 4, 2, 6, 5, 4, np.float32)
    a, w, st, ex, nt = args[:5]
    with pytest.raises(TypeError, match=r"w: expected the dtype of a \(float32\), got float16"):
        G.grouped_gemm(a, w.astype(np.float16), st, ex, nt, 2, 4)
    with pytest.raises(ValueError, match="w: expected shape .* to match a's columns"):
        G.grouped_gemm(a, w[:, :, :4], st, ex, nt, 2, 4)
    with pytest.raises(ValueError, match="num_tokens_post_padded: expected a multiple of"):
        G.grouped_gemm(a, w, st, ex, nt + 1, 2, 4)
    with pytest.raises(ValueError, match="topk_weights: expected an array when mul_routed_weight"):
        G.grouped_gemm(a, w, st, ex, nt, 2, 4, None, True)
    with pytest.raises(ValueError, match=r"bias: expected shape \(4, 6\)"):
        G.grouped_gemm(a, w, st, ex, nt, 2, 4, bias=np.ones((4, 5), np.float32))
    with pytest.raises(ValueError, match="version: expected one of"):
        G.grouped_gemm(a, w, st, ex, nt, 2, 4, version="v9")
    with pytest.raises(ValueError, match="expert_ids: expected local ids in"):
        G.grouped_gemm(a, w, st, ex + 7, nt, 2, 4)


# ============================================================================ v3v

V3V_CASES = {
    # name: (T, E, K, N, Kd, B, extra); Kd = 8 or 16: whole chunks for every dtype
    "one_token": (1, 4, 2, 8, 8, 4, {}),
    "T_not_multiple_of_block_N_not_tile": (5, 4, 2, 12, 16, 8, {}),
    "experts_without_tokens": (2, 12, 2, 6, 8, 4, {}),
    "bias_and_weights": (3, 4, 2, 9, 16, 8, {"bias": np.float32, "mul": True}),
    "gemm2": (3, 4, 2, 6, 8, 4, {"gemm2": True, "mul": True}),
    "block_12": (4, 3, 2, 10, 8, 12, {"bias": np.float16}),
}


@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("case", V3V_CASES)
def test_v3v_cases(case, dkey):
    T, E, K, N, Kd, B, extra = V3V_CASES[case]
    check(*gemm_problem(T, E, K, N, Kd, B, DTYPES[dkey], **extra), "v3v")


def test_v3v_all_tokens_on_one_expert_and_expert_map():
    ids = np.full((9, 1), 2, np.int32)
    check(*gemm_problem(9, 4, 1, 6, 8, 4, np.float32, ids=ids, mul=True), "v3v")
    E, B = 6, 4
    _, emap = reference.determine_expert_map(2, 1, E)
    args, want = gemm_problem(5, E, 2, 6, 8, B, np.float32, expert_map=emap, E_local=3,
                         bias=np.float32, mul=True)
    got = check(args, want, "v3v")
    st, ex, nt = args[2], args[3], args[4]
    zero = [s for b, e in enumerate(ex[:int(nt[0]) // B]) if e == -1
            for s in st[b * B:(b + 1) * B] if s < 10]
    assert zero and (got[zero] == 0).all()


@pytest.mark.parametrize("dkey,Kd,vec", [("fp32", 8, "f32"), ("fp32", 6, ""),
                                         ("fp16", 16, "f16"), ("bf16", 12, ""),
                                         ("bf16", 8, "bf16")])
def test_v3v_runs_when_chunks_fit_else_falls_back(dkey, Kd, vec):
    args, want = gemm_problem(3, 4, 2, 6, Kd, 8, DTYPES[dkey])
    ad, wd = (nb.to_device(x) for x in args[:2])
    assert G._vec_kind(ad, wd, Kd) == vec
    assert G.plan("v3v", 8, "", vec).version == ("v3v" if vec else "v3")
    assert G.plan("v3v", 2, "", vec).version == "v2"      # no tile height divides B = 2
    check(args, want, "v3v")


def test_v3v_empty_batch():
    args, _ = gemm_problem(0, 4, 2, 6, 8, 4, np.float32)
    assert run(args, "v3v").shape == (0, 6)


def test_v3v_sparse_tile_for_few_rows_per_expert():
    """Few slots per expert (decode) take the "sparse" tile (one row per thread); full tiles
    the dense one. Both must match."""
    assert G.plan("v3v", 8, "", "f32", fill=0.5).version == "v3v"
    sparse, dense = G.plan("v3v", 8, "", "f32", fill=0.5), G.plan("v3v", 8, "", "f32", fill=8)
    assert sparse.kernel is not dense.kernel and sparse.block > dense.block
    check(*gemm_problem(1, 4, 2, 10, 8, 8, np.float32, bias=np.float32, mul=True), "v3v")   # sparse
    check(*gemm_problem(12, 2, 2, 10, 8, 8, BF16), "v3v")                                   # dense


@pytest.mark.parametrize("dkey", ["fp32", "bf16"])
def test_v3v_rows_past_the_grid_bound(dkey):
    """v3v launches cdiv(min(capacity, P * B), BM) row tiles (a valid alignment of P slots
    never pads past P * B). An alignment made for more slots than a's rows * top_k (here 3
    tokens aligned, 1 row given: P = 2) puts live rows past that bound; the blocks' loop over
    row tiles must still reach them."""
    rng = rng_for("gemm-v3v-bound", dkey)
    ids = np.array([[3, 2], [0, 1], [0, 1]], np.int32)     # slots 0, 1 last in the order
    align = reference.moe_align_block_size(ids, 8, 4)
    assert int(align[2][0]) > 2 * 8                        # rows past P * B
    a = uniform(rng, (1, 8), 1.0, DTYPES[dkey])
    w = uniform(rng, (4, 6, 8), 0.5, DTYPES[dkey])
    want = reference.grouped_gemm(a.astype(np.float64), w.astype(np.float64), *align, 2, 8)
    check((a, w) + tuple(align) + (2, 8, None, False, None), want, "v3v")
