"""The EPLB rebalancing algorithm (`reference/eplb.py`) against hand-worked examples,
brute force for tiny sizes, and the invariants every placement must keep."""
import itertools

import numpy as np
import pytest

from reference.eplb import (
    balanced_packing,
    gpu_loads,
    initial_physical_to_logical,
    rebalance_experts,
    rebalance_experts_hierarchical,
    replicate_experts,
)


def test_hand_worked_global_example():
    # E=4 loads [10, 40, 20, 30], 6 slots on 2 GPUs.
    # replicate: expert 1 (40) gets the first extra slot, then expert 3 (30 > 20 = 40/2).
    #   phy2log before packing [0, 1, 2, 3, 1, 3], loads per replica [10, 20, 20, 15, 20, 15]
    # pack (heaviest first, ties by index, lightest open GPU, ties to GPU 0):
    #   slot1 -> g0, slot2 -> g1, slot4 -> g0 (20 = 20), slot3 -> g1, slot5 -> g1 (35 < 40),
    #   slot0 -> g0 (g1 full). GPU0 = [1, 1, 0], GPU1 = [2, 3, 3], 50 tokens each.
    phy2log, log2phy, logcnt = rebalance_experts(np.array([10, 40, 20, 30]), 6, 1, 1, 2)
    assert phy2log.tolist() == [1, 1, 0, 2, 3, 3]
    assert logcnt.tolist() == [1, 2, 1, 2]
    assert log2phy.tolist() == [[2, -1], [0, 1], [3, -1], [4, 5]]
    assert gpu_loads([10, 40, 20, 30], phy2log, 2).tolist() == [50.0, 50.0]


def test_balanced_packing_hand_example():
    pack, rank = balanced_packing(np.array([5.0, 1.0, 4.0, 2.0]), 2)
    # 5 -> p0, 4 -> p1, 2 -> p1 (4 < 5), 1 -> p0
    assert pack.tolist() == [0, 0, 1, 1]
    assert rank.tolist() == [0, 1, 0, 1]


def test_balanced_packing_one_item_per_pack_keeps_items_in_place():
    pack, rank = balanced_packing(np.array([[1.0, 9.0, 3.0]]), 3)
    assert pack.tolist() == [[0, 1, 2]] and rank.tolist() == [[0, 0, 0]]


def _brute_force_min_max_per_replica(load, num_physical):
    """Smallest achievable max_e load[e] / cnt[e] over all count vectors (cnt >= 1, sum P)."""
    E = len(load)
    best = np.inf
    for extra in itertools.product(range(num_physical - E + 1), repeat=E):
        if sum(extra) != num_physical - E:
            continue
        cnt = np.array(extra) + 1
        best = min(best, float(np.max(load / cnt)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_replicate_experts_is_optimal_for_tiny_sizes(seed):
    rng = np.random.default_rng(seed)
    E = int(rng.integers(2, 5))
    P = E + int(rng.integers(0, 4))
    load = rng.integers(0, 100, size=E).astype(np.float64)
    phy2log, rank, logcnt = replicate_experts(load, P)
    assert phy2log[:E].tolist() == list(range(E))
    assert logcnt.sum() == P and np.all(logcnt >= 1)
    assert np.array_equal(np.bincount(phy2log, minlength=E), logcnt)
    for e in range(E):  # replica ranks of expert e are 0..cnt-1, each once
        assert sorted(rank[phy2log == e].tolist()) == list(range(logcnt[e]))
    got = float(np.max(load / logcnt))
    assert got == pytest.approx(_brute_force_min_max_per_replica(load, P))


def _check_placement(load, phy2log, log2phy, logcnt, P, W):
    E = load.shape[-1]
    assert phy2log.shape == (P,) and phy2log.dtype == np.int32
    assert logcnt.shape == (E,) and np.all(logcnt >= 1) and logcnt.sum() == P
    assert np.array_equal(np.bincount(phy2log, minlength=E), logcnt)
    assert log2phy.shape == (E, logcnt.max())
    for e in range(E):
        slots = log2phy[e, :logcnt[e]]
        assert np.all(slots >= 0) and np.all(phy2log[slots] == e)
        assert np.all(log2phy[e, logcnt[e]:] == -1)
    assert len(set(log2phy[log2phy >= 0].tolist())) == P  # every slot listed once


@pytest.mark.parametrize("E,P,G,N,W", [
    (8, 8, 1, 1, 2),      # no redundancy: a permutation
    (8, 12, 4, 2, 4),     # hierarchical, 2 nodes
    (16, 20, 4, 2, 4),
    (12, 16, 4, 2, 8),    # the DeepSeek README shape
    (12, 16, 3, 2, 8),    # G % N != 0 -> global policy
    (6, 8, 2, 1, 2),
])
def test_rebalance_invariants(E, P, G, N, W):
    rng = np.random.default_rng(E * 100 + P)
    load = rng.zipf(1.6, size=(3, E)).astype(np.float64).clip(max=500)
    phy2log, log2phy, logcnt = rebalance_experts(load, P, G, N, W)
    assert phy2log.shape == (3, P) and log2phy.shape[:2] == (3, E) and logcnt.shape == (3, E)
    for layer in range(3):
        _check_placement(load[layer], phy2log[layer], log2phy[layer][:, :logcnt[layer].max()],
                         logcnt[layer], P, W)
    # 1-D input gives the same answer as the first row of the 2-D one
    p1, l1, c1 = rebalance_experts(load[0], P, G, N, W)
    assert np.array_equal(p1, phy2log[0]) and np.array_equal(c1, logcnt[0])
    if G % N == 0 and N > 1:
        # hierarchical: all replicas of a group's experts sit on the group's one node
        per_node = P // N
        group_size = E // G
        for layer in range(3):
            node_of_slot = np.arange(P) // per_node
            for g in range(G):
                experts = np.arange(g * group_size, (g + 1) * group_size)
                nodes = node_of_slot[np.isin(phy2log[layer], experts)]
                assert len(set(nodes.tolist())) == 1


def test_rebalance_is_deterministic_and_balances_skewed_load():
    rng = np.random.default_rng(7)
    E, W, R = 32, 4, 8
    load = rng.zipf(1.4, size=E).astype(np.float64).clip(max=10_000)
    a = rebalance_experts(load, E + R, 1, 1, W)
    b = rebalance_experts(load.copy(), E + R, 1, 1, W)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    before = gpu_loads(load, np.arange(E), W)
    after = gpu_loads(load, a[0], W)
    assert after.sum() == pytest.approx(before.sum())
    assert after.max() <= before.max()
    # greedy packing never exceeds the average by more than the heaviest replica
    per_replica = load / a[2]
    assert after.max() <= after.mean() + per_replica.max() + 1e-9


def test_hierarchical_equals_global_with_one_node_one_group():
    rng = np.random.default_rng(3)
    load = rng.random((2, 12)) * 10
    a = rebalance_experts_hierarchical(load, 16, 1, 1, 4)
    phy2log, _, logcnt = rebalance_experts(load, 16, 1, 1, 4)
    assert np.array_equal(a[0], phy2log) and np.array_equal(a[2], logcnt)


def test_all_zero_load_still_places_every_expert():
    phy2log, log2phy, logcnt = rebalance_experts(np.zeros(8), 10, 1, 1, 2)
    _check_placement(np.zeros(8), phy2log, log2phy, logcnt, 10, 2)


def test_initial_physical_to_logical():
    assert initial_physical_to_logical(4, 3).tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert initial_physical_to_logical(4).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("kwargs,match", [
    (dict(weight=np.ones(8), num_physical=6, num_groups=1, num_nodes=1, num_gpus=2),
     "num_physical: expected at least"),
    (dict(weight=np.ones(8), num_physical=9, num_groups=1, num_nodes=1, num_gpus=2),
     "num_physical: expected a multiple of num_gpus"),
    (dict(weight=np.ones(8), num_physical=12, num_groups=3, num_nodes=1, num_gpus=2),
     "num_groups: expected a divisor"),
    (dict(weight=np.ones(8), num_physical=12, num_groups=2, num_nodes=4, num_gpus=2),
     "num_gpus: expected a multiple of num_nodes"),
    (dict(weight=-np.ones(8), num_physical=8, num_groups=1, num_nodes=1, num_gpus=2),
     "weight: expected finite non-negative"),
    (dict(weight=np.full(8, np.nan), num_physical=8, num_groups=1, num_nodes=1, num_gpus=2),
     "weight: expected finite non-negative"),
    (dict(weight=np.ones((2, 2, 2)), num_physical=8, num_groups=1, num_nodes=1, num_gpus=2),
     "weight: expected a 1-D"),
    (dict(weight=np.ones(8), num_physical=0, num_groups=1, num_nodes=1, num_gpus=2),
     "num_physical: expected a positive int"),
])
def test_bad_input_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rebalance_experts(**kwargs)


def test_bad_types_raise_typeerror():
    with pytest.raises(TypeError, match="num_gpus: expected an int"):
        rebalance_experts(np.ones(4), 4, 1, 1, 2.0)
    with pytest.raises(TypeError, match="weight: expected integer or float"):
        rebalance_experts(np.array(["a"] * 4), 4, 1, 1, 2)
