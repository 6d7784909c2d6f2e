"""The contiguous layout in torch: rows grouped by expert, and back.

    T = tokens, K = top-k, P = T*K slots, E = experts, H = hidden

    moe_permute(hidden_states, topk_ids, num_experts)
        -> x_grouped [P, H], expert_offsets int32 [E+1], inv_permuted_idx int32 [P]
    moe_unpermute(y_grouped, topk_weights, inv_permuted_idx) -> out [T, H]

A stable sort of the flat ids (reference/permute.py), so slots within an expert keep
increasing s; the unpermute sums in fp32 and rounds once.
"""
from __future__ import annotations

from ._tensors import as_tensor, check_float, check_int, compute_dtype, positive_int


def moe_permute(hidden_states, topk_ids, num_experts):
    """Rows of hidden_states grouped by expert (stable in s). Returns (x_grouped [P, H],
    expert_offsets int32 [E+1], inv_permuted_idx int32 [P])."""
    import torch

    hidden_states, topk_ids = as_tensor(hidden_states, "hidden_states"), as_tensor(topk_ids, "topk_ids")
    check_float("hidden_states", hidden_states, ndim=2)
    check_int("topk_ids", topk_ids, ndim=2)
    e = positive_int("num_experts", num_experts)
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices                         # grouped row -> s
    inv = torch.empty_like(order)
    inv[order] = torch.arange(flat.numel(), device=flat.device)
    offsets = torch.zeros(e + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(torch.bincount(flat, minlength=e), 0)
    return hidden_states[order // k], offsets, inv.int()


def moe_unpermute(y_grouped, topk_weights, inv_permuted_idx):
    """out[t] = sum_k w[t, k] * y_grouped[inv[t*K + k]] in fp32, rounded once."""
    y_grouped, topk_weights = as_tensor(y_grouped, "y_grouped"), as_tensor(topk_weights, "topk_weights")
    inv = as_tensor(inv_permuted_idx, "inv_permuted_idx")
    t, k = topk_weights.shape
    cdt = compute_dtype(y_grouped.dtype)
    y = y_grouped.to(cdt)[inv.long()].reshape(t, k, -1)
    return (y * topk_weights.to(cdt)[:, :, None]).sum(1).to(y_grouped.dtype)
