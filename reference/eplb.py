"""Expert-parallel load balancing (EPLB): which logical expert each physical slot holds.

The semantics are DeepSeek's hierarchical EPLB (the `deepseek-ai/EPLB` policy), written
anew in NumPy with explicit loops: the sizes are tiny (hundreds of experts), the point is
to be read.

Legend: `L` MoE layers, `E` logical experts, `P` physical experts (`E` + redundant
replicas), `G` expert groups, `N` nodes, `W` GPUs (the EP world size), `X` the largest
replica count. Physical slot `p` lives on GPU `p // (P // W)`, so GPU `g` holds the
contiguous run of slots `[g * P/W, (g+1) * P/W)`; nodes hold contiguous runs of GPUs.

The three steps (hierarchical policy, used when `G % N == 0`):

1. **Groups to nodes.** Sum the load of each group of `E/G` consecutive experts and pack
   the `G` groups onto the `N` nodes, `G/N` groups per node, balancing the node loads
   (`balanced_packing`). All replicas of an expert stay on its group's node, so tokens of
   a group of experts never cross the (slow) inter-node network twice.
2. **Replicate within each node.** The node's `E/N` experts become `P/N` physical
   experts: each extra replica goes to the expert with the highest *load per replica*
   (`replicate_experts`: greedy, which minimises the largest load per replica).
3. **Replicas to GPUs within each node.** Pack the node's `P/N` physical experts, each
   carrying `load / replica_count`, onto its `W/N` GPUs, `P/W` per GPU
   (`balanced_packing` again).

When `G % N != 0` the *global* policy runs the same steps with one group and one node.

Tie-breaking (the spec leaves it open; ours is deterministic): heavier first, equal loads
in increasing index; an item goes to the lightest pack that still has room, equal loads to
the lowest pack id; a replica goes to the first expert with the highest load per replica.
With one item per pack (`n == num_packs`) `balanced_packing` keeps item `i` in pack `i`
(nothing to balance, nothing moves).

    rebalance_experts(weight, num_physical, num_groups, num_nodes, num_gpus)
        -> phy2log int32 [L, P], log2phy int32 [L, E, X] (-1 padded), logcnt int32 [L, E]
    (a 1-D `weight [E]` gives `[P]`, `[E, X]`, `[E]`)

Run as a script for a worked example: `python -m reference.eplb`.
"""
from __future__ import annotations

import numpy as np

__all__ = [
    "balanced_packing",
    "replicate_experts",
    "rebalance_experts_hierarchical",
    "rebalance_experts",
    "initial_physical_to_logical",
    "gpu_loads",
]


def _as_load_matrix(weight, name: str = "weight") -> tuple[np.ndarray, bool]:
    """float64 [L, n] from a [n] or [L, n] load array; also whether the input was 1-D."""
    arr = np.asarray(weight)
    if arr.ndim not in (1, 2):
        raise ValueError(f"{name}: expected a 1-D [E] or 2-D [L, E] array of loads, "
                         f"got shape {arr.shape}")
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"{name}: expected integer or float loads, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if arr.shape[-1] == 0:
        raise ValueError(f"{name}: expected at least one expert, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        finite = arr[np.isfinite(arr)]
        low = finite.min() if finite.size else "n/a"
        raise ValueError(f"{name}: expected finite non-negative loads, got min {low} "
                         f"and {int(np.sum(~np.isfinite(arr)))} non-finite values")
    return np.atleast_2d(arr), arr.ndim == 1


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return int(value)


# --------------------------------------------------------------------------------------
# One layer at a time: plain loops over a 1-D load vector
# --------------------------------------------------------------------------------------
def _pack_one(load: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy balanced packing of `n` items into `num_packs` packs of `n / num_packs` items."""
    n = load.shape[0]
    per_pack = n // num_packs
    if per_pack == 1:
        # one item per pack: every assignment has the same pack loads, keep items in place
        return np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
    pack_index = np.full(n, -1, dtype=np.int32)
    rank_in_pack = np.full(n, -1, dtype=np.int32)
    pack_load = np.zeros(num_packs, dtype=np.float64)
    pack_items = np.zeros(num_packs, dtype=np.int64)
    for item in np.argsort(-load, kind="stable"):  # heaviest first, ties by index
        room = pack_items < per_pack
        pack = int(np.argmin(np.where(room, pack_load, np.inf)))  # lightest open pack
        pack_index[item] = pack
        rank_in_pack[item] = pack_items[pack]
        pack_load[pack] += load[item]
        pack_items[pack] += 1
    return pack_index, rank_in_pack


def _replicate_one(load: np.ndarray, num_physical: int):
    """Greedy replication of `n` logical experts into `num_physical` slots."""
    n = load.shape[0]
    phy2log = np.empty(num_physical, dtype=np.int32)
    replica_rank = np.zeros(num_physical, dtype=np.int32)
    logcnt = np.ones(n, dtype=np.int32)
    phy2log[:n] = np.arange(n)  # every expert keeps its first replica in its own slot
    for slot in range(n, num_physical):
        hottest = int(np.argmax(load / logcnt))  # highest load per replica, first on ties
        phy2log[slot] = hottest
        replica_rank[slot] = logcnt[hottest]
        logcnt[hottest] += 1
    return phy2log, replica_rank, logcnt


def _hierarchical_one(load, num_physical, num_groups, num_nodes, num_gpus):
    """The three steps of the module docstring for one layer's load vector [E]."""
    E = load.shape[0]
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    log_per_node = E // num_nodes
    phy_per_node = num_physical // num_nodes
    gpus_per_node = num_gpus // num_nodes
    phy_per_gpu = num_physical // num_gpus

    # step 1: groups to nodes. "node-major" ids (mlog) number the experts so that node n
    # holds mlog ids [n * E/N, (n+1) * E/N), groups in their packing order, experts in order
    group_load = load.reshape(num_groups, group_size).sum(axis=1)  # [G]
    group_node, group_pos = _pack_one(group_load, num_nodes)
    log2mlog = np.empty(E, dtype=np.int64)
    for g in range(num_groups):
        first = (group_node[g] * groups_per_node + group_pos[g]) * group_size
        log2mlog[g * group_size:(g + 1) * group_size] = first + np.arange(group_size)
    mlog2log = np.empty(E, dtype=np.int64)
    mlog2log[log2mlog] = np.arange(E)

    phy2log = np.empty(num_physical, dtype=np.int32)
    phy_rank = np.empty(num_physical, dtype=np.int32)
    logcnt = np.empty(E, dtype=np.int32)
    for node in range(num_nodes):
        node_experts = mlog2log[node * log_per_node:(node + 1) * log_per_node]  # logical ids
        node_load = load[node_experts]  # [E/N]
        # step 2: replicate within the node
        local_phy2log, local_rank, local_cnt = _replicate_one(node_load, phy_per_node)
        logcnt[node_experts] = local_cnt
        # step 3: pack the node's replicas onto its GPUs, each carrying load / count
        replica_load = node_load[local_phy2log] / local_cnt[local_phy2log]  # [P/N]
        gpu, pos = _pack_one(replica_load, gpus_per_node)
        slot = node * phy_per_node + gpu * phy_per_gpu + pos  # final physical slot
        phy2log[slot] = node_experts[local_phy2log]
        phy_rank[slot] = local_rank
    return phy2log, phy_rank, logcnt


# --------------------------------------------------------------------------------------
# Public API: [L, n] in, one row per layer
# --------------------------------------------------------------------------------------
def balanced_packing(weight, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack `n` weighted items into `num_packs` packs of exactly `n / num_packs` items each.

    Greedy longest-processing-time: items in decreasing weight, each into the currently
    lightest pack that is not full. weight [L, n] or [n]; returns `pack_index` and
    `rank_in_pack` (the order in which the pack received the item), int32 of the same shape.
    """
    load, squeeze = _as_load_matrix(weight)
    num_packs = _positive_int(num_packs, "num_packs")
    n = load.shape[1]
    if n % num_packs:
        raise ValueError(f"num_packs: expected a divisor of the {n} items, got {num_packs}")
    rows = [_pack_one(row, num_packs) for row in load]
    pack_index = np.stack([r[0] for r in rows])
    rank_in_pack = np.stack([r[1] for r in rows])
    return (pack_index[0], rank_in_pack[0]) if squeeze else (pack_index, rank_in_pack)


def replicate_experts(weight, num_physical: int):
    """Replicate `E` logical experts into `num_physical` slots, minimising max load/replica.

    Slots `0..E-1` hold experts `0..E-1`; each further slot goes to
    `argmax_e weight[e] / logcnt[e]`. weight [L, E] or [E]. Returns `phy2log [.., P]`,
    `replica_rank [.., P]` (0 for an expert's first replica, 1 for its second, ...) and
    `logcnt [.., E]`, all int32.
    """
    load, squeeze = _as_load_matrix(weight)
    num_physical = _positive_int(num_physical, "num_physical")
    if num_physical < load.shape[1]:
        raise ValueError(f"num_physical: expected at least the {load.shape[1]} logical "
                         f"experts, got {num_physical}")
    rows = [_replicate_one(row, num_physical) for row in load]
    out = tuple(np.stack([r[i] for r in rows]) for i in range(3))
    return tuple(o[0] for o in out) if squeeze else out


def _check_layout(E, num_physical, num_groups, num_nodes, num_gpus):
    num_physical = _positive_int(num_physical, "num_physical")
    num_groups = _positive_int(num_groups, "num_groups")
    num_nodes = _positive_int(num_nodes, "num_nodes")
    num_gpus = _positive_int(num_gpus, "num_gpus")
    if num_physical < E:
        raise ValueError(f"num_physical: expected at least the {E} logical experts, "
                         f"got {num_physical}")
    if num_physical % num_gpus:
        raise ValueError(f"num_physical: expected a multiple of num_gpus={num_gpus} (every "
                         f"GPU holds the same number of physical experts), got {num_physical}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus: expected a multiple of num_nodes={num_nodes}, "
                         f"got {num_gpus}")
    if E % num_groups:
        raise ValueError(f"num_groups: expected a divisor of the {E} logical experts, "
                         f"got {num_groups}")
    return num_physical, num_groups, num_nodes, num_gpus


def rebalance_experts_hierarchical(weight, num_physical: int, num_groups: int,
                                   num_nodes: int, num_gpus: int):
    """The hierarchical policy (module docstring), needs `num_groups % num_nodes == 0`.

    Returns `phy2log [.., P]`, `phy_rank [.., P]` (replica rank of each slot), `logcnt [.., E]`.
    """
    load, squeeze = _as_load_matrix(weight)
    E = load.shape[1]
    num_physical, num_groups, num_nodes, num_gpus = _check_layout(
        E, num_physical, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes:
        raise ValueError(f"num_groups: expected a multiple of num_nodes={num_nodes} for the "
                         f"hierarchical policy, got {num_groups}")
    rows = [_hierarchical_one(row, num_physical, num_groups, num_nodes, num_gpus)
            for row in load]
    out = tuple(np.stack([r[i] for r in rows]) for i in range(3))
    return tuple(o[0] for o in out) if squeeze else out


def rebalance_experts(weight, num_physical: int, num_groups: int = 1, num_nodes: int = 1,
                      num_gpus: int = 1):
    """DeepSeek EPLB entry point: the hierarchical policy when `num_groups % num_nodes == 0`,
    else the global one (one group, one node).

    weight [L, E] (or [E]): the recorded load of every logical expert (tokens routed to it).
    Returns:
        phy2log [L, P] int32: the logical expert each physical slot holds;
        log2phy [L, E, X] int32: the physical slots of each logical expert, by replica rank,
            padded with -1 (X = the largest replica count);
        logcnt  [L, E] int32: replicas per logical expert (>= 1, sums to P).
    """
    load, squeeze = _as_load_matrix(weight)
    E = load.shape[1]
    num_physical, num_groups, num_nodes, num_gpus = _check_layout(
        E, num_physical, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes == 0:
        phy2log, phy_rank, logcnt = rebalance_experts_hierarchical(
            load, num_physical, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phy_rank, logcnt = rebalance_experts_hierarchical(
            load, num_physical, 1, 1, num_gpus)
    L = load.shape[0]
    X = int(logcnt.max())
    log2phy = np.full((L, E, X), -1, dtype=np.int32)
    for layer in range(L):
        for slot in range(num_physical):
            log2phy[layer, phy2log[layer, slot], phy_rank[layer, slot]] = slot
    if squeeze:
        return phy2log[0], log2phy[0], logcnt[0]
    return phy2log, log2phy, logcnt


def initial_physical_to_logical(num_logical: int, num_redundant: int = 0) -> np.ndarray:
    """The map before any load is known: slot p < E holds expert p, the redundant slots
    `E + j` hold expert `j % E` (vLLM's initial EPLB layout). int32 [E + R]."""
    num_logical = _positive_int(num_logical, "num_logical")
    if isinstance(num_redundant, bool) or not isinstance(num_redundant, (int, np.integer)):
        raise TypeError(f"num_redundant: expected an int, got {type(num_redundant).__name__}")
    if num_redundant < 0:
        raise ValueError(f"num_redundant: expected >= 0, got {num_redundant}")
    return np.concatenate([np.arange(num_logical),
                           np.arange(num_redundant) % num_logical]).astype(np.int32)


def gpu_loads(weight, phy2log, num_gpus: int) -> np.ndarray:
    """Load each GPU carries when every replica of expert e takes `weight[e] / logcnt[e]`.

    weight [E] or [L, E], phy2log [P] or [L, P] -> [W] or [L, W] float64.
    """
    load, squeeze = _as_load_matrix(weight)
    p2l = np.atleast_2d(np.asarray(phy2log))
    num_gpus = _positive_int(num_gpus, "num_gpus")
    if p2l.shape[0] != load.shape[0] or p2l.shape[1] % num_gpus:
        raise ValueError(f"phy2log: expected [L, P] with L={load.shape[0]} and P a multiple "
                         f"of num_gpus={num_gpus}, got shape {np.shape(phy2log)}")
    out = np.empty((load.shape[0], num_gpus))
    for layer in range(load.shape[0]):
        cnt = np.bincount(p2l[layer], minlength=load.shape[1])
        if np.any(cnt == 0):
            raise ValueError(f"phy2log: every logical expert needs a replica; layer {layer} "
                             f"misses experts {np.flatnonzero(cnt == 0).tolist()}")
        per_slot = load[layer, p2l[layer]] / cnt[p2l[layer]]
        out[layer] = per_slot.reshape(num_gpus, -1).sum(axis=1)
    return out[0] if squeeze else out


if __name__ == "__main__":
    # A skewed load: a few experts take most tokens. Compare the GPU loads without
    # redundancy (linear placement) and after EPLB with 4 extra replicas.
    rng = np.random.default_rng(0)
    E, W, R = 16, 4, 4
    load = np.round(1000 * rng.zipf(1.5, size=E).clip(max=50)).astype(np.int64)
    print("load per logical expert:", load.tolist())
    print("linear, no replicas   -> GPU loads", gpu_loads(load, np.arange(E), W).tolist())
    phy2log, log2phy, logcnt = rebalance_experts(load, E + R, num_groups=4, num_nodes=2,
                                                 num_gpus=W)
    print("EPLB phy2log          ->", phy2log.tolist())
    print("replicas per expert   ->", logcnt.tolist())
    print("EPLB                  -> GPU loads", gpu_loads(load, phy2log, W).tolist())
