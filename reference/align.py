"""Alignment: group the (token, slot) pairs by expert in blocks of the GEMM's BLOCK_M.

    T = tokens, K = top-k, P = T*K slots (s = t*K + k), E = experts, B = block size

moe_align_block_size is the layout of vLLM's fused Triton/CUDA GEMM:
    sorted_token_ids  [max_num_tokens_padded]  slots grouped by expert, each expert's run
                                               padded to a multiple of B with the value P
    expert_ids        [cdiv(max_padded, B)]    the expert of each block, -1 past the end
    num_tokens_post_padded [1]                 sum_e ceil(count_e / B) * B

The routing preparation is the four lines of ScatterMoE: flatten, stable sort, count,
cumulative sum. A stable sort orders slots within an expert by s; kernels may order them
otherwise (atomics), which is why tests compare blocks as sets. The contiguous layout
(moe_permute, B = 1 and no padding) is permute.py's.
"""

from __future__ import annotations

import numpy as np

from ._checks import check_int, check_positive_int


def _cdiv(a, b):
    return -(-a // b)


def max_num_tokens_padded(num_slots: int, block_size: int, num_experts: int,
                          pad_sorted_ids: bool = False) -> int:
    """The length of sorted_token_ids: the worst case of padding every expert, but never
    more than one block per slot (a batch with fewer slots than experts)."""
    size = num_slots + num_experts * (block_size - 1)
    if pad_sorted_ids:
        size = _cdiv(size, block_size) * block_size
    if num_slots < num_experts:
        size = min(size, num_slots * block_size)
    return size


def _check_expert_map(expert_map, num_experts):
    if expert_map is None:
        return None
    check_int("expert_map", expert_map, ndim=1, shape=(num_experts,))
    if expert_map.size and expert_map.min() < -1:
        raise ValueError(f"expert_map: expected local ids >= 0 or -1, got {int(expert_map.min())}")
    return expert_map


def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                         pad_sorted_ids=False, ignore_invalid_experts=False):
    """Sort slots by expert and pad each expert's run to a multiple of block_size.

    A slot whose id lies outside [0, num_experts) (vLLM's -1: a masked or padded token, an
    expert of another rank) is skipped: it appears nowhere and counts in nothing.
    With expert_map (global id -> local id or -1): by default every expert is aligned and
    expert_ids holds local ids, -1 for the blocks of experts not on this rank (the GEMMs
    write zeros for their rows); with ignore_invalid_experts=True the slots of non-local
    experts are skipped too (no blocks). num_tokens_post_padded counts the scheduled slots
    only. Blocks past num_tokens_post_padded hold -1.

    Returns (sorted_token_ids int32, expert_ids int32, num_tokens_post_padded int32 [1]).
    """
    check_int("topk_ids", topk_ids, ndim=2)
    block_size = check_positive_int("block_size", block_size)
    num_experts = check_positive_int("num_experts", num_experts)
    expert_map = _check_expert_map(expert_map, num_experts)

    flat = topk_ids.ravel().astype(np.int64)                       # [P] expert of slot s
    num_slots = flat.size
    capacity = max_num_tokens_padded(num_slots, block_size, num_experts, pad_sorted_ids)

    scheduled = (flat >= 0) & (flat < num_experts)                 # [P] the slots aligned
    if expert_map is not None and ignore_invalid_experts:
        scheduled &= expert_map[np.where(scheduled, flat, 0)] >= 0
    slots = np.nonzero(scheduled)[0]                               # increasing s
    experts = flat[slots]
    counts = np.bincount(experts, minlength=num_experts)           # [E]
    padded = _cdiv(counts, block_size) * block_size                # [E]
    padded_starts = np.concatenate([[0], np.cumsum(padded)[:-1]])  # [E] where expert e begins
    slot_starts = np.concatenate([[0], np.cumsum(counts)[:-1]])    # [E] in the sorted slot list

    order = np.argsort(experts, kind="stable")                     # scheduled slots by expert
    expert_of = experts[order]
    rank_in_expert = np.arange(slots.size) - slot_starts[expert_of]
    sorted_token_ids = np.full(capacity, num_slots, dtype=np.int32)
    sorted_token_ids[padded_starts[expert_of] + rank_in_expert] = slots[order]

    num_blocks = int(padded.sum()) // block_size
    expert_ids = np.full(_cdiv(capacity, block_size), -1, dtype=np.int32)
    block_experts = np.repeat(np.arange(num_experts), padded // block_size)
    if expert_map is not None:
        block_experts = expert_map[block_experts]
    expert_ids[:num_blocks] = block_experts
    num_tokens_post_padded = np.array([num_blocks * block_size], dtype=np.int32)
    return sorted_token_ids, expert_ids, num_tokens_post_padded
