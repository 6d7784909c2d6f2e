"""Numba alignment (cuda_kernels/numba/align.py, align_grid.py) against the reference, on a
real GPU: the one-launch grid kernel (the default) and the multi-launch "warp" ranks.

    T tokens, E experts, K top-k, B block size, P = T*K slots

`gpu` tests, outputs poisoned, host arrays in and out (tests/numba/__init__.py says how).

Integer outputs exact (the kernels are stable, so equal to the reference, which is stronger
than the contract's per-block sets: checked as well).
"""
import importlib

import numpy as np
import pytest

import reference
from cuda_kernels import numba as nb
from tests.oracles import assert_same_blocks, distinct_topk_ids, rng_for, uniform
from tests.support import gpu_marks, runs_kernels

pytestmark = [*gpu_marks("numba"), pytest.mark.usefixtures("numba_poison")]

if runs_kernels("numba"):   # imports numba on its CUDA target: only where it runs
    A = importlib.import_module("cuda_kernels.numba._arrays")
    Al = importlib.import_module("cuda_kernels.numba.align")
    Pm = importlib.import_module("cuda_kernels.numba.permute")


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
