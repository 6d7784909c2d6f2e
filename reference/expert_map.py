"""Which experts live on which rank under expert parallelism (vLLM's determine_expert_map).

    E = global experts, R = ep_size, r = ep_rank

linear       rank r holds one contiguous run of experts; the first E % R ranks hold one extra
round_robin  rank r holds experts r, r + R, r + 2R, ...

expert_map[e] is e's local id on this rank, or -1 when e lives elsewhere.
"""

from __future__ import annotations

import numpy as np

from ._checks import check_choice, check_positive_int

PLACEMENTS = ("linear", "round_robin")


def determine_expert_map(ep_size, ep_rank, global_num_experts, placement="linear"):
    """Returns (local_num_experts, expert_map int32 [E] or None when ep_size == 1)."""
    ep_size = check_positive_int("ep_size", ep_size)
    ep_rank = check_positive_int("ep_rank", ep_rank, minimum=0)
    global_num_experts = check_positive_int("global_num_experts", global_num_experts)
    check_choice("placement", placement, PLACEMENTS)
    if ep_rank >= ep_size:
        raise ValueError(f"ep_rank: expected a rank in [0, {ep_size}), got {ep_rank}")
    if ep_size == 1:
        return global_num_experts, None
    if global_num_experts < ep_size:
        raise ValueError(f"ep_size: expected at most global_num_experts ({global_num_experts}) "
                         f"ranks so that each holds an expert, got {ep_size}")

    base, remainder = divmod(global_num_experts, ep_size)
    local_num_experts = base + (1 if ep_rank < remainder else 0)
    if placement == "linear":
        start = ep_rank * base + min(ep_rank, remainder)
        local_experts = np.arange(start, start + local_num_experts)
    else:
        local_experts = np.arange(ep_rank, global_num_experts, ep_size)
    expert_map = np.full(global_num_experts, -1, dtype=np.int32)
    expert_map[local_experts] = np.arange(local_num_experts, dtype=np.int32)
    return local_num_experts, expert_map
