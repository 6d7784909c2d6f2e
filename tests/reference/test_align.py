"""Alignment (`reference/align.py`) against loop oracles.

    T = tokens, E = experts, K = top-k, B = block size, P = T*K slots (s = t*K + k)

Two levels of agreement for moe_align_block_size:
- the contract (what a kernel must match, `assert_same_blocks`): num_tokens_post_padded,
  expert_ids and the capacity exactly; each block's slots as a set, since vLLM leaves the
  order of slots inside an expert's run unspecified;
- the reference's own guarantee (stable in s within an expert): sorted_token_ids exactly.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from reference import determine_expert_map, max_num_tokens_padded, moe_align_block_size
from tests.oracles import (
    align_capacity,
    align_loop,
    assert_same_blocks,
    distinct_topk_ids,
    expert_map_loop,
    rng_for,
)


def check_alignment(topk_ids, block_size, num_experts, **kwargs):
    """Reference vs align_loop: the contract, then the reference's exact order."""
    got = moe_align_block_size(topk_ids, block_size, num_experts, **kwargs)
    want = align_loop(topk_ids, block_size, num_experts, **kwargs)
    for a in got:
        assert a.dtype == np.int32
    num_slots = topk_ids.size
    assert_same_blocks(got, want, block_size, num_slots)
    np.testing.assert_array_equal(got[0], want[0], err_msg="sorted_token_ids (stable order)")
    n = int(got[2][0])
    assert n % block_size == 0
    return got


# --------------------------------------------------------------------------------------------
# vLLM's grid: tokens x experts x top-k x block, both pad_sorted_ids settings.
# --------------------------------------------------------------------------------------------

ALIGN_GRID = [(m, e, k, b) for m, e, k, b in itertools.product(
    [1, 3, 256, 2256, 4096], [32, 160, 256, 257], [1, 2, 16, 32], [32, 128]) if k <= e]


@pytest.mark.parametrize("num_tokens, num_experts, topk, block_size", ALIGN_GRID)
def test_moe_align_block_size_vllm_grid(num_tokens, num_experts, topk, block_size):
    rng = rng_for("align", num_tokens, num_experts, topk, block_size)
    topk_ids = distinct_topk_ids(rng, num_tokens, num_experts, topk)     # randperm[:K] per token
    num_slots = topk_ids.size
    for pad_sorted_ids in (False, True):
        sorted_ids, expert_ids, num_post = check_alignment(
            topk_ids, block_size, num_experts, pad_sorted_ids=pad_sorted_ids)
        capacity = align_capacity(num_slots, block_size, num_experts, pad_sorted_ids)
        assert sorted_ids.shape == (capacity,)
        assert capacity == max_num_tokens_padded(num_slots, block_size, num_experts, pad_sorted_ids)
        assert expert_ids.shape == (math.ceil(capacity / block_size),)
        # vLLM's own checks
        n = int(num_post[0])
        assert n >= num_slots
        assert (sorted_ids < num_slots).sum() == num_slots
        assert ((expert_ids[: n // block_size] >= 0) & (expert_ids[: n // block_size] < num_experts)).all()
        assert (expert_ids[n // block_size:] == -1).all()


# --------------------------------------------------------------------------------------------
# expert_map, both ignore_invalid_experts settings
# --------------------------------------------------------------------------------------------

def every_other_map(num_experts):
    """vLLM's test map: the even experts are local, ids 0, 1, 2, ..."""
    expert_map = np.full(num_experts, -1, np.int32)
    expert_map[0::2] = np.arange(len(expert_map[0::2]))
    return expert_map


MAPS = {
    "every_other": every_other_map,
    "linear_r1_of_4": lambda e: determine_expert_map(4, 1, e, "linear")[1],
    "round_robin_r2_of_4": lambda e: determine_expert_map(4, 2, e, "round_robin")[1],
    "none_local": lambda e: np.full(e, -1, np.int32),
}


@pytest.mark.parametrize("num_tokens", [16, 32, 2048])
@pytest.mark.parametrize("topk", [2, 4])
@pytest.mark.parametrize("num_experts", [8, 64])
@pytest.mark.parametrize("map_name", sorted(MAPS))
@pytest.mark.parametrize("ignore_invalid_experts", [False, True])
def test_moe_align_block_size_expert_map(num_tokens, topk, num_experts, map_name,
                                         ignore_invalid_experts):
    block_size = 64
    rng = rng_for("align map", num_tokens, topk, num_experts, map_name, ignore_invalid_experts)
    topk_ids = distinct_topk_ids(rng, num_tokens, num_experts, topk)
    expert_map = MAPS[map_name](num_experts)
    sorted_ids, expert_ids, num_post = check_alignment(
        topk_ids, block_size, num_experts, expert_map=expert_map,
        ignore_invalid_experts=ignore_invalid_experts)
    n = int(num_post[0])
    placed = sorted_ids[:n][sorted_ids[:n] < topk_ids.size]
    local = expert_map[topk_ids.ravel()] >= 0
    if ignore_invalid_experts:
        # non-local experts get no blocks; their slots appear nowhere
        assert sorted(placed.tolist()) == np.flatnonzero(local).tolist()
        assert (expert_ids[: n // block_size] >= 0).all()
    else:
        # every slot is aligned; blocks of non-local experts carry -1 (GEMMs write zeros)
        assert sorted(placed.tolist()) == list(range(topk_ids.size))
        blocks = sorted_ids[:n].reshape(-1, block_size)
        for b, e in enumerate(expert_ids[: n // block_size]):
            slots = blocks[b][blocks[b] < topk_ids.size]
            owners = expert_map[topk_ids.ravel()[slots]]
            assert (owners == e).all()


# --------------------------------------------------------------------------------------------
# Slots routed nowhere: ids outside [0, E) are skipped (vLLM's -1 for masked / padded tokens)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expert_map_name", [None, "linear_r1_of_4"])
@pytest.mark.parametrize("ignore_invalid_experts", [False, True])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_moe_align_block_size_skips_ids_outside_the_experts(expert_map_name,
                                                           ignore_invalid_experts, block_size):
    """vLLM's moe_align_block_size (since its kernels take -1 in topk_ids): a slot whose id
    is negative or >= E is counted nowhere and placed nowhere; num_tokens_post_padded counts
    the scheduled slots only; with an expert_map, ignore_invalid_experts also skips the
    slots of non-local experts, else their blocks carry -1."""
    num_experts = 8
    rng = rng_for("align skip", expert_map_name, ignore_invalid_experts, block_size)
    topk_ids = distinct_topk_ids(rng, 40, num_experts, 3)
    topk_ids[3] = -1                                   # a padded token: routed nowhere
    topk_ids[5, 1] = -1                                # one masked slot
    topk_ids[7, 2] = num_experts + 3                   # past the experts
    expert_map = None if expert_map_name is None else MAPS[expert_map_name](num_experts)
    sorted_ids, expert_ids, num_post = check_alignment(
        topk_ids, block_size, num_experts, expert_map=expert_map,
        ignore_invalid_experts=ignore_invalid_experts)
    flat = topk_ids.ravel()
    n = int(num_post[0])
    placed = sorted_ids[:n][sorted_ids[:n] < flat.size]
    scheduled = (flat >= 0) & (flat < num_experts)
    if expert_map is not None and ignore_invalid_experts:
        scheduled &= expert_map[np.clip(flat, 0, num_experts - 1)] >= 0
    assert sorted(placed.tolist()) == np.flatnonzero(scheduled).tolist()
    counts = np.bincount(flat[scheduled], minlength=num_experts)
    assert n == int((-(-counts // block_size) * block_size).sum())
    assert (expert_ids[n // block_size:] == -1).all()


def test_moe_align_block_size_all_slots_routed_nowhere():
    sorted_ids, expert_ids, num_post = moe_align_block_size(np.full((5, 2), -1, np.int32), 4, 8)
    assert num_post.tolist() == [0]
    assert (sorted_ids == 10).all() and (expert_ids == -1).all()


# --------------------------------------------------------------------------------------------
# The nasty cases
# --------------------------------------------------------------------------------------------

NASTY = {
    "one_token_top1": (np.array([[3]]), 4, 8),
    "all_on_one_expert": (np.full((37, 1), 5), 16, 8),
    "all_on_one_expert_top2": (np.array([[5, 2]] * 20), 16, 8),
    "experts_without_tokens": (np.array([[0, 7], [7, 0], [0, 7]]), 4, 8),
    "fewer_slots_than_experts": (np.array([[1, 4]]), 16, 64),
    "block_of_one": (np.array([[2, 0], [1, 2], [0, 1]]), 1, 3),
    "block_bigger_than_batch": (np.array([[0, 1], [1, 2]]), 256, 3),
    "exact_multiple_of_block": (np.repeat(np.arange(4), 8).reshape(16, 2), 4, 4),
    "last_expert_only": (np.full((5, 1), 256), 32, 257),
}


@pytest.mark.parametrize("case", sorted(NASTY))
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("pad_sorted_ids", [False, True])
def test_moe_align_block_size_nasty_cases(case, id_dtype, pad_sorted_ids):
    topk_ids, block_size, num_experts = NASTY[case]
    check_alignment(topk_ids.astype(id_dtype), block_size, num_experts,
                    pad_sorted_ids=pad_sorted_ids)


def test_moe_align_block_size_hand_example():
    # T=3, K=2, E=4, B=2: slots s = t*K + k with experts [1, 3 | 1, 0 | 3, 1]
    topk_ids = np.array([[1, 3], [1, 0], [3, 1]], np.int32)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, 2, 4)
    P = 6
    # expert 0: [3] + pad; expert 1: [0, 2, 5] + pad; expert 2: none; expert 3: [1, 4]
    assert sorted_ids.tolist()[:8] == [3, P, 0, 2, 5, P, 1, 4]
    assert num_post.tolist() == [8]
    assert expert_ids.tolist()[:4] == [0, 1, 1, 3]
    # capacity = P + E*(B-1) = 10 -> 5 blocks, the last unused
    assert sorted_ids.tolist()[8:] == [P, P] and expert_ids.tolist()[4:] == [-1]


def test_expert_map_loop_agrees_with_reference_maps():
    # the oracle's maps (used in the EP tests) are those of determine_expert_map
    for num_experts, ep_size in [(8, 4), (10, 4), (64, 3), (5, 5)]:
        for placement in ("linear", "round_robin"):
            for rank in range(ep_size):
                local, emap = determine_expert_map(ep_size, rank, num_experts, placement)
                want_local, want_map = expert_map_loop(ep_size, rank, num_experts, placement)
                assert local == want_local
                np.testing.assert_array_equal(emap, want_map)
