"""moe_align_block_size in torch: the (token, slot) pairs grouped by expert in blocks of B.

    T = tokens, K = top-k, P = T*K slots (s = t*K + k), E = experts, B = block size

    moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                         pad_sorted_ids=False, ignore_invalid_experts=False)
        -> sorted_token_ids int32 [max_num_tokens_padded], expert_ids int32 [cdiv(that, B)],
           num_tokens_post_padded int32 [1]

ScatterMoE's four lines in torch (flatten, stable sort, bincount, cumsum), so the layout is
the reference's exactly (reference/align.py, whose max_num_tokens_padded sizes the output).
"""
from __future__ import annotations

from reference.align import max_num_tokens_padded

from ._tensors import as_tensor, cdiv, check_int, positive_int


def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                         pad_sorted_ids=False, ignore_invalid_experts=False):
    """Group the P = T*K slots by expert, each expert's run padded to a multiple of B with
    the value P; a slot whose id is outside [0, E) (or, with ignore_invalid_experts, whose
    expert is not local) is skipped. Returns (sorted_token_ids int32 [max_padded], expert_ids int32
    [cdiv(max_padded, B)] (local ids under expert_map, -1 past the end or off-rank),
    num_tokens_post_padded int32 [1]). Same layout as the reference: a stable sort, so slots
    come in increasing s within an expert."""
    import torch

    topk_ids = as_tensor(topk_ids, "topk_ids")
    check_int("topk_ids", topk_ids, ndim=2)
    b = positive_int("block_size", block_size)
    e = positive_int("num_experts", num_experts)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()                                   # [P]
    p = flat.numel()
    if expert_map is not None:
        expert_map = as_tensor(expert_map, "expert_map").to(dev)
        check_int("expert_map", expert_map, ndim=1)
        if expert_map.shape[0] != e:
            raise ValueError(f"expert_map: expected shape ({e},), got {tuple(expert_map.shape)}")
    capacity = max_num_tokens_padded(p, b, e, pad_sorted_ids)

    # the slots aligned: ids in [0, E) (vLLM's -1 and ids past E are skipped), and with
    # ignore_invalid_experts only local experts
    scheduled = (flat >= 0) & (flat < e)                                 # [P]
    if expert_map is not None and ignore_invalid_experts:
        scheduled &= expert_map.long()[torch.where(scheduled, flat, 0)] >= 0
    slots = torch.nonzero(scheduled).squeeze(1)                          # increasing s
    experts = flat[slots]
    counts = torch.bincount(experts, minlength=e)                        # [E]
    padded = (counts + b - 1) // b * b                                   # [E]
    padded_starts = torch.cumsum(padded, 0) - padded                     # exclusive scan
    slot_starts = torch.cumsum(counts, 0) - counts
    order = torch.sort(experts, stable=True).indices                     # scheduled, by expert
    expert_of = experts[order]
    rank = torch.arange(slots.numel(), device=dev) - slot_starts[expert_of]
    sorted_token_ids = torch.full((capacity,), p, dtype=torch.int32, device=dev)
    sorted_token_ids[padded_starts[expert_of] + rank] = slots[order].int()

    num_blocks = int(padded.sum()) // b
    expert_ids = torch.full((cdiv(capacity, b),), -1, dtype=torch.int32, device=dev)
    block_experts = torch.repeat_interleave(torch.arange(e, device=dev), padded // b)
    if expert_map is not None:
        block_experts = expert_map.long()[block_experts]
    expert_ids[:num_blocks] = block_experts.int()
    ntpp = torch.tensor([num_blocks * b], dtype=torch.int32, device=dev)
    return sorted_token_ids, expert_ids, ntpp
