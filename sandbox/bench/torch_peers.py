"""The two peers written in torch, and the check every candidate passes against the first.

    T tokens, E experts, K top-k, H hidden, I intermediate, P = T*K routed slots

    torch_per_expert_loop   the baseline a user writes: per expert, gather, two matmuls,
                            scatter-add (torch.where: no CUDA graph capture)
    torch_grouped_mm_moe    torch._grouped_mm over the slots sorted by expert (captures)
    has_grouped_mm()        whether this torch has torch._grouped_mm
"""
from __future__ import annotations


def torch_per_expert_loop(x, w13, w2, topk_weights, topk_ids, activation: str = "silu"):
    """The baseline a user writes in torch: for each expert, gather its tokens, two matmuls,
    scale by the router weight, scatter-add. x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights [T, K], topk_ids [T, K] -> [T, H] (accumulated in fp32)."""
    import torch

    T, H = x.shape
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        h = x[token] @ w13[e].T                                             # [n, 2I]
        a = _torch_act(torch, h, inter, activation)                         # [n, I]
        y = (a @ w2[e].T).float() * topk_weights[token, slot, None].float()  # [n, H]
        out.index_add_(0, token, y)
    return out.to(x.dtype)


def torch_grouped_mm_moe(x, w13, w2, topk_weights, topk_ids, activation: str = "silu"):
    """The same layer with `torch._grouped_mm`: sort the P slots by expert, one grouped GEMM
    per projection over the contiguous groups (`offs` = end offset of each expert's rows),
    then weight and scatter-add back to the tokens."""
    import torch

    T, H = x.shape
    E, K, inter = w13.shape[0], topk_ids.shape[1], w2.shape[2]
    flat = topk_ids.reshape(-1)                                             # [P]
    order = torch.argsort(flat, stable=True)                                # [P] slots by expert
    # rows per expert by a scatter-add, not bincount: bincount sizes its output from a max
    # read back to the host, which a CUDA graph capture refuses
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))    # [E]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)                       # [E]
    token = order // K                                                      # [P]
    x_grouped = x[token]                                                    # [P, H]
    h = torch._grouped_mm(x_grouped, w13.transpose(1, 2), offs=offs)        # [P, 2I]
    a = _torch_act(torch, h, inter, activation)                             # [P, I]
    y_grouped = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)         # [P, H]
    y = y_grouped.float() * topk_weights.reshape(-1)[order, None].float()
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    out.index_add_(0, token, y)
    return out.to(x.dtype)


def _torch_act(torch, h, inter, activation):
    if activation == "silu":
        return torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    if activation == "gelu":
        return torch.nn.functional.gelu(h[:, :inter]) * h[:, inter:]
    raise ValueError(f"activation: expected 'silu' or 'gelu' in the torch peers, "
                     f"got {activation!r}")


def has_grouped_mm() -> bool:
    try:
        import torch
        return hasattr(torch, "_grouped_mm")
    except ImportError:
        return False
