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
"""
import importlib

import numpy as np
import pytest
from tests.oracles import BF16, TOL, gemm_problem, rel_err

import reference
from cuda_kernels import numba as nb

G = importlib.import_module("cuda_kernels.numba.gemm")

pytestmark = pytest.mark.simulator
DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": BF16}
VERSIONS = ("v1", "v2", "v3")


def run(args, version):
    with nb.poisoned_outputs():
        return G.grouped_gemm(*args, version=version)


def check(args, want, version):
    got = run(args, version)
    assert got.dtype == args[0].dtype and got.shape == want.shape
    err = rel_err(got, want)
    assert err <= TOL[np.dtype(args[0].dtype)], f"{version}: relative error {err:.2e}"
    return got


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
