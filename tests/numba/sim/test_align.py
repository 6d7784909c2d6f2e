"""Numba alignment (cuda_kernels/numba/align.py) in the CUDA simulator against
reference/align.py.

    T tokens, E experts, K top-k, B block size, P = T*K slots

The kernels' ranks are stable (increasing slot inside an expert), so every integer output
must equal the reference's exactly, which is stronger than the contract's per-block sets
(checked too, with tests/oracles.py's assert_same_blocks). Both launch paths run: the single
block (P <= SINGLE_BLOCK_MAX_SLOTS) and count / scan / scatter over several blocks (the
simulator config makes the switch at 32 slots, so tiny shapes exercise it).
"""
import importlib

import numpy as np
import pytest

import reference
from cuda_kernels import numba as nb
from tests.oracles import align_loop, assert_same_blocks, distinct_topk_ids, rng_for

Al = importlib.import_module("cuda_kernels.numba.align")
A = importlib.import_module("cuda_kernels.numba._arrays")

pytestmark = [pytest.mark.simulator, pytest.mark.usefixtures("numba_poison")]


def align(ids, B, E, expert_map=None, pad=False, ignore=False, path=None):
    """moe_align_block_size through one forced launch path (None: the module's choice)."""
    if path is None:
        return Al.moe_align_block_size(ids, B, E, expert_map, pad, ignore)
    call = A.Call("topk_ids", ids)
    cap = Al.max_num_tokens_padded(ids.size, B, E, pad)
    out = Al._sort_slots(call, ids, E, B, expert_map, bool(ignore and expert_map is not None),
                         cap, True, False, path=path)
    return tuple(call.result(v) for v in out[:3])


def assert_align(ids, B, E, expert_map=None, pad=False, ignore=False, path=None):
    got = align(ids, B, E, expert_map, pad, ignore, path)
    want = reference.moe_align_block_size(ids, B, E, expert_map, pad, ignore)
    for g, w, name in zip(got, want, ("sorted_token_ids", "expert_ids", "num_tokens_post_padded")):
        assert g.dtype == np.int32, name
        np.testing.assert_array_equal(g, w, err_msg=f"{name} (path {path})")
    if expert_map is None:
        assert_same_blocks(got, align_loop(ids, B, E, pad_sorted_ids=pad), B, ids.size)


@pytest.mark.parametrize("path", ["single", "multi"])
@pytest.mark.parametrize("B", [1, 4, 5])
@pytest.mark.parametrize("T,E,K", [(1, 4, 1), (3, 9, 2), (7, 4, 3), (20, 6, 2)])
def test_align_grid(T, E, K, B, path):
    assert_align(distinct_topk_ids(rng_for("align", T, E, K), T, E, K), B, E, path=path)


@pytest.mark.parametrize("path", ["single", "multi"])
def test_align_nasty(path):
    rng = rng_for("nasty")
    assert_align(np.full((21, 1), 2, np.int32), 4, 5, path=path)            # one expert
    assert_align(distinct_topk_ids(rng, 5, 16, 2), 4, 16, path=path)       # empty experts
    assert_align(distinct_topk_ids(rng, 9, 5, 2), 3, 5, pad=True, path=path)
    assert_align(distinct_topk_ids(rng, 11, 7, 3).astype(np.int64), 2, 7, path=path)
    assert_align(np.zeros((0, 2), np.int32), 4, 3, path=path)               # T = 0


@pytest.mark.parametrize("path", ["single", "multi"])
@pytest.mark.parametrize("ignore", [False, True])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_align_expert_map(placement, ignore, path):
    E = 8
    _, emap = reference.determine_expert_map(3, 1, E, placement)
    ids = distinct_topk_ids(rng_for("emap", placement), 17, E, 2)
    assert_align(ids, 4, E, emap, ignore=ignore, path=path)


def test_align_device_ids_out_of_range_are_skipped():
    """A device array is not read back for checks: slots of ids outside [0, E) land nowhere."""
    ids = np.array([[0, 1], [5, 2]], np.int32)
    s, e, n = align(A.to_device(ids), 2, 3)   # numba array in -> numba arrays out
    s, e, n = (nb.to_host(v) for v in (s, e, n))
    assert int(n[0]) == 6 and 2 not in s[:6].tolist()
    assert sorted(s[s < 4].tolist()) == [0, 1, 3]


@pytest.mark.parametrize("path", ["single", "multi", None])
@pytest.mark.parametrize("ignore", [False, True])
def test_align_skips_ids_outside_the_experts(path, ignore):
    """vLLM's -1 (a masked or padded token) and ids past E: placed nowhere, counted nowhere,
    through both launch paths and the public function on host arrays (which used to
    raise)."""
    E = 6
    ids = distinct_topk_ids(rng_for("skip", path), 19, E, 2)
    ids[3] = -1
    ids[5, 1] = -1
    ids[8, 0] = E + 2
    assert_align(ids, 4, E, path=path)
    _, emap = reference.determine_expert_map(2, 0, E)
    assert_align(ids, 4, E, emap, ignore=ignore, path=path)


def test_align_bad_inputs():
    ids = np.zeros((3, 2), np.int32)
    with pytest.raises(ValueError, match="block_size: expected an int >= 1"):
        Al.moe_align_block_size(ids, 0, 4)
    with pytest.raises(TypeError, match="topk_ids: expected dtype in"):
        Al.moe_align_block_size(ids.astype(np.float32), 4, 4)
    with pytest.raises(ValueError, match=r"expert_map: expected shape \(4\)"):
        Al.moe_align_block_size(ids, 4, 4, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="expert_map: expected local ids >= 0 or -1"):
        Al.moe_align_block_size(ids, 4, 4, np.full(4, -2, np.int32))
