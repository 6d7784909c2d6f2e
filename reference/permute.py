"""Permutation: the contiguous layout of torch._grouped_mm-style GEMMs.

    T = tokens, K = top-k, P = T*K slots (s = t*K + k), E = experts, H = hidden

moe_permute / moe_unpermute
    x_grouped         [P, H]   rows of hidden_states, grouped by expert
    expert_offsets    [E + 1]  expert e owns rows expert_offsets[e]:expert_offsets[e+1]
    inv_permuted_idx  [P]      where slot s went: x_grouped[inv_permuted_idx[s]] = x[s // K]

The grouping of align.py with B = 1 and no padding: a stable sort of the flat ids, so slots
within an expert keep increasing s. The GEMM on this layout is gemm.py's grouped_mm.
"""

from __future__ import annotations

import numpy as np

from ._checks import check_float, check_ids_in_range, check_int, check_positive_int
from .precision import to_compute


def moe_permute(hidden_states, topk_ids, num_experts):
    """Gather token rows into expert-contiguous order.

    Returns (x_grouped [P, H], expert_offsets int32 [E+1], inv_permuted_idx int32 [P]).
    """
    check_float("hidden_states", hidden_states, ndim=2)
    check_int("topk_ids", topk_ids, ndim=2)
    num_experts = check_positive_int("num_experts", num_experts)
    if topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"topk_ids: expected {hidden_states.shape[0]} rows to match "
                         f"hidden_states, got shape {topk_ids.shape}")
    check_ids_in_range("topk_ids", topk_ids, num_experts)
    top_k = topk_ids.shape[1]
    flat = topk_ids.ravel()
    order = np.argsort(flat, kind="stable")                        # [P] grouped slot -> s
    inv_permuted_idx = np.empty_like(order)
    inv_permuted_idx[order] = np.arange(flat.size)
    x_grouped = hidden_states[order // top_k]                      # [P, H]
    counts = np.bincount(flat, minlength=num_experts)
    expert_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return x_grouped, expert_offsets, inv_permuted_idx.astype(np.int32)


def moe_unpermute(y_grouped, topk_weights, inv_permuted_idx):
    """Weighted combine back into token order: out[t] = sum_k w[t, k] * y[inv[t*K + k]].

    fp32 sum in slot order, rounded once to y_grouped's dtype.
    """
    check_float("y_grouped", y_grouped, ndim=2)
    check_float("topk_weights", topk_weights, ndim=2)
    check_int("inv_permuted_idx", inv_permuted_idx, ndim=1, shape=(topk_weights.size,))
    if y_grouped.shape[0] != topk_weights.size:
        raise ValueError(f"y_grouped: expected {topk_weights.size} rows (T*K), "
                         f"got shape {y_grouped.shape}")
    num_tokens, top_k = topk_weights.shape
    y = to_compute(y_grouped)[inv_permuted_idx].reshape(num_tokens, top_k, y_grouped.shape[1])
    weights = topk_weights.astype(y.dtype)[:, :, None]
    return (y * weights).sum(axis=1).astype(y_grouped.dtype, copy=False)
