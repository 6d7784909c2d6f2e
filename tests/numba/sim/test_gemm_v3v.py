"""The Numba GEMM's v3v rung (16-byte loads, CuPy v3's layout) in the CUDA simulator.

    T tokens, E experts, K top-k, N output width, Kd inner size, B block size

v3v reads a and w in 16-byte chunks (4 fp32, 8 fp16 / bf16), so it runs when Kd is a multiple
of the chunk and one of its tile heights divides B; otherwise the call falls back to v3 (and
v2). Each case is checked against the reference fed float64 inputs (fp32 within 1e-5, fp16 /
bf16 within 1e-2), with NaN-poisoned outputs. The simulator's tiles are tiny (SIM_CONFIGS):
8 or 4 rows x 8 columns x 8 deep, 4 x 4 per thread.
"""
import importlib

import numpy as np
import pytest
from tests.oracles import BF16, gemm_problem
from tests.numba.sim.test_gemm import DTYPES, check, run

import reference
from cuda_kernels import numba as nb

G = importlib.import_module("cuda_kernels.numba.gemm")
pytestmark = pytest.mark.simulator

CASES = {
    # name: (T, E, K, N, Kd, B, extra); Kd = 8 or 16: whole chunks for every dtype
    "one_token": (1, 4, 2, 8, 8, 4, {}),
    "T_not_multiple_of_block_N_not_tile": (5, 4, 2, 12, 16, 8, {}),
    "experts_without_tokens": (2, 12, 2, 6, 8, 4, {}),
    "bias_and_weights": (3, 4, 2, 9, 16, 8, {"bias": np.float32, "mul": True}),
    "gemm2": (3, 4, 2, 6, 8, 4, {"gemm2": True, "mul": True}),
    "block_12": (4, 3, 2, 10, 8, 12, {"bias": np.float16}),
}


@pytest.mark.parametrize("dkey", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_v3v_cases(case, dkey):
    T, E, K, N, Kd, B, extra = CASES[case]
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
    from tests.oracles import rng_for, uniform

    rng = rng_for("gemm-v3v-bound", dkey)
    ids = np.array([[3, 2], [0, 1], [0, 1]], np.int32)     # slots 0, 1 last in the order
    align = reference.moe_align_block_size(ids, 8, 4)
    assert int(align[2][0]) > 2 * 8                        # rows past P * B
    a = uniform(rng, (1, 8), 1.0, DTYPES[dkey])
    w = uniform(rng, (4, 6, 8), 0.5, DTYPES[dkey])
    want = reference.grouped_gemm(a.astype(np.float64), w.astype(np.float64), *align, 2, 8)
    check((a, w) + tuple(align) + (2, 8, None, False, None), want, "v3v")
