"""The grouped GEMM of the fused MoE layer, and its twin on the contiguous layout.

    T = tokens, K = top-k, P = T*K slots (s = t*K + k), E_local = experts on this rank,
    B = block size, N = a GEMM's output width, Kdim = its reduction width

grouped_gemm (vLLM's fused MoE GEMM, on moe_align_block_size's blocks):
    c[s] = (a[s // top_k] @ w[e].T + bias[e]) * (topk_weights.flat[s] if mul_routed_weight)
    GEMM1: a = x [T, H], w = w13 [E_local, 2I, H], top_k = K  -> [P, 2I]
    GEMM2: a = act [P, I], w = w2 [E_local, H, I], top_k = 1  -> [P, H]
grouped_mm (torch._grouped_mm's contiguous layout, on moe_permute's x_grouped):
    y[rows of e] = x_grouped[rows of e] @ w[e].T

Both accumulate in fp32 (fp64 for fp64 inputs) and round once to the input dtype.
walk_expert_blocks is grouped_gemm's block walk with the product passed in, which
quant.grouped_gemm_quant reuses with operands dequantized one expert at a time.
"""

from __future__ import annotations

import numpy as np

from ._checks import check_float, check_int, check_positive_int
from .precision import to_compute


def grouped_gemm(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_size,
                 topk_weights=None, mul_routed_weight=False, bias=None):
    """vLLM's fused MoE GEMM as a pure function.

    For each block b < num_tokens_post_padded / B and each s = sorted_token_ids[p] < P
    in it (P = a.shape[0] * top_k), with e = expert_ids[b]:
        c[s] = (a[s // top_k] @ w[e].T + bias[e]) * (topk_weights.flat[s] if mul_routed_weight)
    and c[s] = 0 when e == -1 (an expert on another rank). Rows that no block names stay
    NaN (only possible with ignore_invalid_experts): reading them is a caller's bug.

    a [M_a, Kdim], w [E_local, N, Kdim] -> c [P, N] in a.dtype.
    GEMM1: a = x [T, H], top_k = K.   GEMM2: a = cache2 [P, I], top_k = 1.
    """
    check_float("a", a, ndim=2)
    check_float("w", w, ndim=3)
    if w.dtype != a.dtype:
        raise TypeError(f"w: expected the dtype of a ({a.dtype}), got {w.dtype}")
    if w.shape[2] != a.shape[1]:
        raise ValueError(f"w: expected shape (E, N, {a.shape[1]}) to match a's columns, "
                         f"got {w.shape}")
    num_experts = w.shape[0]

    def expert_matmul(e, token_rows):
        return to_compute(a[token_rows]) @ to_compute(w[e]).T                 # [rows, N]

    c = walk_expert_blocks(expert_matmul, a.shape[0], num_experts, w.shape[1], sorted_token_ids,
                           expert_ids, num_tokens_post_padded, top_k, block_size, topk_weights,
                           mul_routed_weight, bias, to_compute(a[:0]).dtype)
    return c.astype(a.dtype, copy=False)   # a fresh array: no second copy in fp32


def walk_expert_blocks(expert_matmul, num_rows, num_experts, n_out, sorted_token_ids,
                       expert_ids, num_tokens_post_padded, top_k, block_size, topk_weights,
                       mul_routed_weight, bias, acc_dtype):
    """The block walk of a fused MoE GEMM, with the product itself passed in.

    The blocks b < num_tokens_post_padded / B of sorted_token_ids are grouped by their expert
    e = expert_ids[b], and each expert's real slots s < P (P = num_rows * top_k) go through
    one call expert_matmul(e, s // top_k) -> [len(s), N] in acc_dtype (those rows of the left
    operand times w[e].T). Then, in acc_dtype:
        c[s] = (expert_matmul(e, s // top_k) + bias[e]) * (topk_weights.flat[s] if mul_routed_weight)
    and c[s] = 0 where e == -1. bias[e] is rounded to acc_dtype before the add, as the kernels
    load it. Rows that no block names stay NaN. Returns c [P, N] in acc_dtype, unrounded: the
    caller rounds once. grouped_gemm passes a plain matmul, quant.grouped_gemm_quant a matmul
    on operands dequantized one expert at a time.
    """
    check_int("sorted_token_ids", sorted_token_ids, ndim=1)
    check_int("expert_ids", expert_ids, ndim=1)
    top_k = check_positive_int("top_k", top_k)
    block_size = check_positive_int("block_size", block_size)
    num_padded = int(np.asarray(num_tokens_post_padded).ravel()[0])
    num_blocks = num_padded // block_size
    if num_padded % block_size or num_padded > sorted_token_ids.size or num_blocks > expert_ids.size:
        raise ValueError(f"num_tokens_post_padded: expected a multiple of block_size ({block_size}) "
                         f"within sorted_token_ids ({sorted_token_ids.size}) and expert_ids "
                         f"({expert_ids.size} blocks), got {num_padded}")
    num_slots = num_rows * top_k
    if bias is not None:
        check_float("bias", bias, ndim=2, shape=(num_experts, n_out))
    if mul_routed_weight:
        if topk_weights is None:
            raise ValueError("topk_weights: expected an array when mul_routed_weight=True, got None")
        check_float("topk_weights", topk_weights)
        if topk_weights.size != num_slots:
            raise ValueError(f"topk_weights: expected {num_slots} weights (a rows * top_k), "
                             f"got shape {topk_weights.shape}")

    block_experts = expert_ids[:num_blocks]
    if block_experts.size and (block_experts.min() < -1 or block_experts.max() >= num_experts):
        raise ValueError(f"expert_ids: expected local ids in [-1, {num_experts}), got "
                         f"{int(block_experts.min())}..{int(block_experts.max())}")
    slots = sorted_token_ids[:num_padded].reshape(num_blocks, block_size)     # [blocks, B]

    c = np.full((num_slots, n_out), np.nan, dtype=acc_dtype)                  # [P, N]
    for e in np.unique(block_experts):
        rows = slots[block_experts == e].ravel()
        rows = rows[rows < num_slots].astype(np.int64)                        # drop padding
        if e < 0:
            c[rows] = 0
            continue
        if rows.size == 0:
            continue      # an expert whose blocks are all padding: no product to compute
        y = expert_matmul(int(e), rows // top_k)                              # [rows, N]
        if bias is not None:
            y += bias[e].astype(acc_dtype)
        if mul_routed_weight:
            y *= topk_weights.ravel()[rows].astype(acc_dtype)[:, None]
        c[rows] = y
    return c


def grouped_mm(x_grouped, w, expert_offsets):
    """The contiguous grouped GEMM: y[rows of e] = x_grouped[rows of e] @ w[e].T.

    x_grouped [P, Kdim], w [E, N, Kdim], expert_offsets [E+1] -> y_grouped [P, N].
    """
    check_float("x_grouped", x_grouped, ndim=2)
    check_float("w", w, ndim=3)
    check_int("expert_offsets", expert_offsets, ndim=1, shape=(w.shape[0] + 1,))
    if w.shape[2] != x_grouped.shape[1]:
        raise ValueError(f"w: expected inner dimension {x_grouped.shape[1]} to match "
                         f"x_grouped, got shape {w.shape}")
    y = np.empty((x_grouped.shape[0], w.shape[1]), dtype=to_compute(x_grouped[:0]).dtype)
    for e in range(w.shape[0]):
        lo, hi = int(expert_offsets[e]), int(expert_offsets[e + 1])
        if hi > lo:
            y[lo:hi] = to_compute(x_grouped[lo:hi]) @ to_compute(w[e]).T
    return y.astype(x_grouped.dtype, copy=False)
