"""EPLB at run time: physical experts, the logical -> physical map, replica choice, load.

    E logical experts, R redundant, P = E + R physical experts, W ranks, P_l = P / W per
    rank, X the largest replica count, T tokens on this rank, K top-k

Physical slot p lives on rank `p // P_l` at local index `p % P_l` (DeepSeek's layout); the
slot holds the weights of logical expert `phys2log[p]`. Without EPLB the map only encodes
the placement: `linear` gives rank r the logical run [r*P_l, (r+1)*P_l) (the identity),
`round_robin` gives it r, r+W, r+2W, ... (reference.determine_expert_map's sets, in the same
local order). With R redundant slots, the initial map puts logical `j % E` in the extra
slot `E + j` before placing slots as the placement says; `rebalance` replaces it with
`reference.eplb.rebalance_experts` of the recorded load.

Replica choice, deterministic: slot (t, k) of a token routed to logical expert e goes to
replica `(t + rank) % logcnt[e]` of e, i.e. `log2phy[e, that]`. Consecutive tokens of one
rank alternate between replicas, and ranks start at different replicas. The output cannot
depend on the choice: replicas hold identical weights.

Load: `record(topk_ids)` adds the per-logical-expert token counts of one forward
(`bincount`, on the device of the ids); `rebalance` sums them over ranks (all_reduce).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from reference.eplb import initial_physical_to_logical, rebalance_experts

__all__ = ["ExpertPlacement", "LoadRecorder", "rearrange_plan"]

PLACEMENTS = ("linear", "round_robin")


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """Where every physical expert lives and which logical expert it holds."""

    num_logical: int
    world_size: int
    phys2log: np.ndarray          # int32 [P]

    def __post_init__(self):
        p2l = np.ascontiguousarray(self.phys2log, dtype=np.int32)
        object.__setattr__(self, "phys2log", p2l)
        E, W, P = self.num_logical, self.world_size, p2l.size
        if P < E or P % W:
            raise ValueError(f"phys2log: expected P >= E={E} physical experts, a multiple of "
                             f"world_size={W}, got {P}")
        cnt = np.bincount(p2l, minlength=E)
        if p2l.min() < 0 or p2l.max() >= E or np.any(cnt == 0):
            raise ValueError(f"phys2log: expected every logical expert in [0, {E}) to have a "
                             f"replica, missing {np.flatnonzero(cnt == 0).tolist()}")
        X = int(cnt.max())
        log2phy = np.full((E, X), -1, dtype=np.int32)
        seen = np.zeros(E, dtype=np.int64)
        for p, e in enumerate(p2l):  # replicas of e in increasing slot order
            log2phy[e, seen[e]] = p
            seen[e] += 1
        object.__setattr__(self, "logcnt", cnt.astype(np.int32))
        object.__setattr__(self, "log2phy", log2phy)

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def initial(cls, num_logical: int, world_size: int, placement: str = "linear",
                num_redundant: int = 0) -> "ExpertPlacement":
        """The map before any load is known (module docstring)."""
        if placement not in PLACEMENTS:
            raise ValueError(f"placement: expected one of {list(PLACEMENTS)}, got {placement!r}")
        check_divisible(num_logical, world_size, num_redundant)
        virtual = initial_physical_to_logical(num_logical, num_redundant)  # [P]
        P = virtual.size
        per_rank = P // world_size
        if placement == "linear":
            phys2log = virtual
        else:  # slot r*P_l + j holds virtual expert r + j*W
            r, j = np.divmod(np.arange(P), per_rank)
            phys2log = virtual[r + j * world_size]
        return cls(num_logical, world_size, phys2log)

    @classmethod
    def rebalanced(cls, load, num_physical: int, world_size: int, num_groups: int = 1,
                   num_nodes: int = 1) -> "ExpertPlacement":
        """DeepSeek's EPLB of a global load vector [E] (reference.eplb.rebalance_experts)."""
        load = np.asarray(load, dtype=np.float64)
        phy2log, _, _ = rebalance_experts(load, num_physical, num_groups, num_nodes, world_size)
        return cls(load.size, world_size, phy2log)

    # ---- queries --------------------------------------------------------------------------
    @property
    def num_physical(self) -> int:
        return int(self.phys2log.size)

    @property
    def per_rank(self) -> int:
        return self.num_physical // self.world_size

    def local_logical(self, rank: int) -> np.ndarray:
        """The logical expert of each of rank's local slots: int32 [P_l]."""
        return self.phys2log[rank * self.per_rank:(rank + 1) * self.per_rank]

    def expert_map(self, rank: int) -> np.ndarray:
        """Physical id -> local id on `rank`, or -1 (the reference's expert_map over P)."""
        m = np.full(self.num_physical, -1, dtype=np.int32)
        m[rank * self.per_rank:(rank + 1) * self.per_rank] = np.arange(self.per_rank)
        return m

    def to_physical(self, topk_ids, rank: int, xp=np, maps=None):
        """Logical ids [T, K] -> physical ids [T, K] (int32), replica (t + rank) % logcnt[e].

        Runs in `xp` (NumPy or CuPy) on the ids' device; `maps` = (logcnt, log2phy) already
        there (else tiny copies are made)."""
        ids = topk_ids
        T = ids.shape[0]
        cnt, log2phy = maps if maps is not None else (xp.asarray(self.logcnt),
                                                      xp.asarray(self.log2phy))
        t = xp.arange(T, dtype=xp.int64)[:, None] + rank         # [T, 1]
        e = ids.astype(xp.int64)
        replica = t % cnt[e]                                      # [T, K]
        return log2phy[e, replica].astype(xp.int32)

    def to_json(self) -> dict:
        return {"num_logical": self.num_logical, "world_size": self.world_size,
                "phys2log": self.phys2log.tolist()}

    def __eq__(self, other):
        return (isinstance(other, ExpertPlacement) and other.num_logical == self.num_logical
                and other.world_size == self.world_size
                and np.array_equal(other.phys2log, self.phys2log))

    def __repr__(self):
        return (f"ExpertPlacement(E={self.num_logical}, P={self.num_physical}, "
                f"W={self.world_size}, phys2log={self.phys2log.tolist()})")


def check_divisible(num_logical: int, world_size: int, num_redundant: int = 0) -> None:
    """Refuse a world size that does not divide the physical experts (before any collective)."""
    for name, v, lo in (("num_experts", num_logical, 1), ("world_size", world_size, 1),
                        ("num_redundant_experts", num_redundant, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        if v < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {v}")
    P = num_logical + num_redundant
    if P % world_size:
        if num_redundant == 0:
            raise ValueError(
                f"world_size: {world_size} ranks do not divide the {num_logical} experts; "
                f"choose a world size that divides them, or add redundant experts (EPLB) so "
                f"that experts + redundant is a multiple of the world size")
        raise ValueError(
            f"num_redundant_experts: {num_logical} experts + {num_redundant} redundant = {P} "
            f"physical experts, not a multiple of the world size {world_size}")


def _gpu_counter():
    """cuda_kernels.cupy.ep_layout when its kernels can launch here, else None."""
    from .layout import _gpu_kernels

    return _gpu_kernels()


class LoadRecorder:
    """Per-logical-expert token counts, summed over the recorded forwards (on the ids'
    device: no host sync per forward)."""

    def __init__(self, num_logical: int, xp=np):
        self.num_logical = int(num_logical)
        self.xp = xp
        self.reset()

    def reset(self):
        self.counts = self.xp.zeros(self.num_logical, dtype=self.xp.int64)
        self.steps = 0

    def record(self, topk_ids):
        """counts[e] += #{topk_ids == e}. On a GPU one kernel of 64-bit atomics into the
        device counts (cupy.bincount would read max(ids) back to the host: a sync per
        forward); the counts are read only by global_load, when rebalancing."""
        xp = self.xp
        # the kernel's histogram lives in 48 KB of shared memory: E <= 12288
        kern = None if xp is np or self.num_logical > 12288 else _gpu_counter()
        if kern is not None:
            ids = topk_ids if topk_ids.dtype == np.int32 else topk_ids.astype(xp.int32)
            kern.ep_count_experts(xp.ascontiguousarray(ids), self.counts)
        else:
            self.counts += xp.bincount(topk_ids.reshape(-1).astype(xp.int64),
                                       minlength=self.num_logical)[:self.num_logical]
        self.steps += 1

    def global_load(self, comm):
        """The load summed over every rank: host int64 [E] (a collective)."""
        total = comm.all_reduce(self.counts)
        return np.asarray(comm.to_host(total), dtype=np.int64)


def rearrange_plan(old: ExpertPlacement, new: ExpertPlacement):
    """How to move expert weights from `old` to `new`, computed identically on every rank.

    Returns a list of (src_rank, src_local, dst_rank, dst_local): the weights in slot
    src_local of src_rank go to slot dst_local of dst_rank. A destination that already held
    the logical expert copies locally (src_rank == dst_rank); otherwise the source is the
    holder of the expert chosen round-robin over its old replicas, so that a hot expert's
    copies are spread over several senders.
    """
    if old.num_logical != new.num_logical or old.world_size != new.world_size or \
            old.num_physical != new.num_physical:
        raise ValueError(f"new: expected a placement of the same shape as old "
                         f"({old!r}), got {new!r}")
    Pl, W = old.per_rank, old.world_size
    plan = []
    for dst in range(W):
        old_local = old.local_logical(dst).tolist()
        for j, e in enumerate(new.local_logical(dst).tolist()):
            if e in old_local:
                plan.append((dst, old_local.index(e), dst, j))
                continue
            holders = old.log2phy[e, :old.logcnt[e]]
            src_p = int(holders[(dst * Pl + j) % holders.size])
            plan.append((src_p // Pl, src_p % Pl, dst, j))
    return plan
