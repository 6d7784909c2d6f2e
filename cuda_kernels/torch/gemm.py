"""The grouped GEMM in torch, and its twin on the contiguous layout.

    P = a.shape[0] * top_k slots, E_local = experts on this rank, N = output width,
    Kdim = reduction width, B = block size

    grouped_gemm(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                 block_size, topk_weights=None, mul_routed_weight=False, bias=None, *,
                 impl=None)                                  -> c [P, N] in a.dtype
    grouped_mm(x_grouped, w, expert_offsets, *, impl=None)  -> y [P, N] (moe_permute's layout)

The math (reference/gemm.py): c[s] = (a[s // top_k] @ w[e].T + bias[e]) * (topk_weights.flat[s]
if mul_routed_weight), fp32 (fp64 for fp64 inputs), rounded once. Two implementations, the
baselines a torch user would pick:
    impl="loop"        one fp32 matmul per expert with rows (the default: the most accurate
                       oracle)
    impl="grouped_mm"  the rows gathered in expert order and one torch._grouped_mm, where
                       torch has it (CUDA: bf16 on sm_90+); it rounds the product to the
                       input dtype before the bias and the routed weight, as a user of it
                       would; elsewhere the loop
MOE_SANDBOX_TORCH_GEMM=grouped_mm makes it the default (default_gemm_impl).
"""
from __future__ import annotations

import math
import os

from ._tensors import as_tensor, check_float, check_int, compute_dtype, positive_int

GEMM_IMPLS = ("loop", "grouped_mm")


def default_gemm_impl() -> str:
    impl = os.environ.get("MOE_SANDBOX_TORCH_GEMM", "loop")
    if impl not in GEMM_IMPLS:
        raise ValueError(f"MOE_SANDBOX_TORCH_GEMM: expected one of {GEMM_IMPLS}, got {impl!r}")
    return impl


def grouped_mm_supported(x, w) -> tuple[bool, str]:
    """Whether torch._grouped_mm takes x [M, Kdim] and w [G, N, Kdim] here (and why not)."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm"
    size = x.element_size()
    if (x.shape[1] * size) % 16 or (w.shape[1] * size) % 16:
        return False, "torch._grouped_mm needs row strides that are multiples of 16 bytes"
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16:
            return False, "torch._grouped_mm on CUDA takes bf16 only"
        if torch.cuda.get_device_capability(x.device) < (9, 0):
            return False, "torch._grouped_mm on CUDA needs compute capability 9.0+"
    return True, ""


def _grouped_rows(sorted_token_ids, expert_ids, num_tokens_post_padded, block_size, num_slots):
    """The (slot, local expert) pair of every real position below num_tokens_post_padded."""
    import torch

    ntpp = int(num_tokens_post_padded.reshape(-1)[0])
    pos = torch.arange(ntpp, device=sorted_token_ids.device)
    s = sorted_token_ids[:ntpp].long()                                   # [ntpp]
    e = expert_ids.long()[pos // block_size]                             # [ntpp]
    keep = s < num_slots
    return s[keep], e[keep]


def grouped_gemm(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                 block_size, topk_weights=None, mul_routed_weight=False, bias=None, *,
                 impl=None):
    """vLLM's fused MoE GEMM as a pure function.

    For every position p below num_tokens_post_padded with s = sorted_token_ids[p] < P
    (P = a.shape[0] * top_k) and e = expert_ids[p // B]:
        c[s] = (a[s // top_k] @ w[e].T + bias[e]) * (topk_weights.flat[s] if mul_routed_weight)
    in fp32 (fp64 for fp64 inputs), rounded once to a.dtype; c[s] = 0 where e == -1.
    a [M_a, Kdim], w [E_local, N, Kdim] -> c [M_a * top_k, N]. Rows no position names stay
    NaN (poisoned), so a broken alignment shows.

    impl: "loop" (one matmul per expert) or "grouped_mm" (rows gathered in expert order,
    one torch._grouped_mm; falls back to the loop where torch cannot run it).
    """
    import torch

    impl = impl or default_gemm_impl()
    if impl not in GEMM_IMPLS:
        raise ValueError(f"impl: expected one of {GEMM_IMPLS}, got {impl!r}")
    a, w = as_tensor(a, "a"), as_tensor(w, "w")
    sorted_token_ids = as_tensor(sorted_token_ids, "sorted_token_ids")
    expert_ids = as_tensor(expert_ids, "expert_ids")
    num_tokens_post_padded = as_tensor(num_tokens_post_padded, "num_tokens_post_padded")
    topk_weights, bias = as_tensor(topk_weights, "topk_weights"), as_tensor(bias, "bias")
    check_float("a", a, ndim=2)
    check_float("w", w, ndim=3)
    if w.shape[2] != a.shape[1]:
        raise ValueError(f"w: expected inner dimension {a.shape[1]} to match a, "
                         f"got shape {tuple(w.shape)}")
    check_int("sorted_token_ids", sorted_token_ids, ndim=1)
    check_int("expert_ids", expert_ids, ndim=1)
    top_k = positive_int("top_k", top_k)
    block_size = positive_int("block_size", block_size)
    num_slots = a.shape[0] * top_k
    n = w.shape[1]
    if mul_routed_weight:
        if topk_weights is None:
            raise ValueError("topk_weights: expected weights when mul_routed_weight=True, got None")
        if topk_weights.numel() != num_slots:
            raise ValueError(f"topk_weights: expected {num_slots} entries (a rows * top_k), "
                             f"got shape {tuple(topk_weights.shape)}")
    if bias is not None and tuple(bias.shape) != (w.shape[0], n):
        raise ValueError(f"bias: expected shape {(w.shape[0], n)}, got {tuple(bias.shape)}")

    cdt = compute_dtype(a.dtype)
    c = torch.full((num_slots, n), math.nan, dtype=cdt, device=a.device)
    s, e = _grouped_rows(sorted_token_ids, expert_ids, num_tokens_post_padded, block_size,
                         num_slots)
    off_rank = e < 0
    if bool(off_rank.any()):
        c[s[off_rank]] = 0                      # experts of other EP ranks: zeros, as vLLM
    s, e = s[~off_rank], e[~off_rank]
    if s.numel():
        ok = impl == "grouped_mm" and grouped_mm_supported(a, w)[0]
        if ok:
            y = _gemm_grouped_mm(a, w, s, e, top_k, cdt)
        else:
            y = _gemm_loop(a, w, s, e, top_k, cdt)
        if bias is not None:
            y = y + bias.to(cdt)[e]
        if mul_routed_weight:
            y = y * topk_weights.reshape(-1).to(cdt)[s][:, None]
        c[s] = y
    return c.to(a.dtype)


def _gemm_loop(a, w, s, e, top_k, cdt):
    """One matmul per expert that has rows: y[i] = a[s_i // top_k] @ w[e_i].T, fp32."""
    import torch

    y = torch.empty((s.numel(), w.shape[1]), dtype=cdt, device=a.device)
    for ex in torch.unique(e).tolist():
        rows = (e == ex).nonzero().squeeze(1)
        y[rows] = a[s[rows] // top_k].to(cdt) @ w[ex].to(cdt).T
    return y


def _gemm_grouped_mm(a, w, s, e, top_k, cdt):
    """Rows gathered in expert order, one torch._grouped_mm, scattered back. On the CPU the
    product is fp32; on CUDA it is bf16 (torch rounds there)."""
    import torch

    order = torch.sort(e, stable=True).indices
    x = a[s[order] // top_k]                                             # [n, Kdim]
    offs = torch.cumsum(torch.bincount(e, minlength=w.shape[0]), 0).int()
    if a.device.type == "cpu":
        x, wt = x.to(cdt), w.to(cdt)
    else:
        wt = w
    y_sorted = torch._grouped_mm(x, wt.transpose(1, 2), offs=offs).to(cdt)
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    return y


def grouped_mm(x_grouped, w, expert_offsets, *, impl=None):
    """y[rows of e] = x_grouped[rows of e] @ w[e].T; x [P, Kdim], w [E, N, Kdim],
    expert_offsets [E+1] -> [P, N] in x's dtype. impl "loop" or "grouped_mm"."""
    import torch

    x_grouped, w = as_tensor(x_grouped, "x_grouped"), as_tensor(w, "w")
    offs = as_tensor(expert_offsets, "expert_offsets")
    impl = impl or default_gemm_impl()
    cdt = compute_dtype(x_grouped.dtype)
    if impl == "grouped_mm" and grouped_mm_supported(x_grouped, w)[0] and x_grouped.shape[0]:
        if x_grouped.device.type == "cpu":
            y = torch._grouped_mm(x_grouped.to(cdt), w.to(cdt).transpose(1, 2),
                                  offs=offs[1:].int())
        else:
            y = torch._grouped_mm(x_grouped, w.transpose(1, 2), offs=offs[1:].int())
        return y.to(x_grouped.dtype)
    y = torch.zeros((x_grouped.shape[0], w.shape[1]), dtype=cdt, device=x_grouped.device)
    bounds = offs.tolist()
    for ex in range(w.shape[0]):
        lo, hi = bounds[ex], bounds[ex + 1]
        if hi > lo:
            y[lo:hi] = x_grouped[lo:hi].to(cdt) @ w[ex].to(cdt).T
    return y.to(x_grouped.dtype)
