"""The combine in torch: the K expert outputs of each token summed into one row.

    T = tokens, K = top-k, H = hidden

    moe_sum(x [T, K, H], topk_ids=None, expert_map=None) -> [T, H]

fp32 sum over K, rounded once (reference/combine.py); with the ids a slot routed nowhere
(id < 0, or off this rank through the expert map) is never read.
"""
from __future__ import annotations

from ._tensors import as_tensor, check_float, check_int, compute_dtype


def moe_sum(x, topk_ids=None, expert_map=None):
    """[T, K, H] -> [T, H]: fp32 sum over K, rounded once to x.dtype. With topk_ids [T, K]
    (vLLM's pad-aware moe_sum) a slot with a negative id, or with expert_map a non-local
    expert, is skipped (its row is never read)."""
    import torch

    x = as_tensor(x)
    check_float("x", x, ndim=3)
    acc = x.to(compute_dtype(x.dtype))
    if topk_ids is None:
        return acc.sum(dim=1).to(x.dtype)
    ids = as_tensor(topk_ids, "topk_ids").to(x.device).long()
    check_int("topk_ids", ids, ndim=2)
    if tuple(ids.shape) != tuple(x.shape[:2]):
        raise ValueError(f"topk_ids: expected shape {tuple(x.shape[:2])}, got {tuple(ids.shape)}")
    live = ids >= 0
    if expert_map is not None:
        emap = as_tensor(expert_map, "expert_map").to(x.device).long()
        inside = live & (ids < emap.numel())
        live = inside & (emap[torch.where(inside, ids, 0)] >= 0)
    return torch.where(live[:, :, None], acc, torch.zeros((), dtype=acc.dtype,
                                                          device=acc.device)).sum(1).to(x.dtype)
