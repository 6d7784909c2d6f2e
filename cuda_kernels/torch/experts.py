"""The whole expert computation as a torch user writes it: the baselines of the benchmarks.

    T = tokens, K = top-k, E = experts, H = hidden, I = intermediate

    fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                  is_act_and_mul=True, w1_bias=None, w2_bias=None, *, impl="loop") -> [T, H]

Not the stages one by one (the layer composes those through the registry): the per-expert
Python loop of most MoE ports (gpt-fast, Hugging Face), or the contiguous layout with
torch._grouped_mm, which is what a user would otherwise run.
"""
from __future__ import annotations

from ._tensors import as_tensor, compute_dtype
from .activation import apply_activation
from .gemm import GEMM_IMPLS, grouped_mm
from .permute import moe_permute, moe_unpermute


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                  is_act_and_mul=True, w1_bias=None, w2_bias=None, *, impl="loop"):
    """The whole expert computation the way a torch user writes it, for benchmarks.

    impl="loop": for each expert, its tokens' rows; act(x @ w1[e].T) @ w2[e].T; scatter-add
        weighted into the output (the loop of gpt-fast / Hugging Face ports).
    impl="grouped_mm": moe_permute, two torch._grouped_mm with the activation between,
        moe_unpermute (falls back to a loop per expert where _grouped_mm cannot run); it
        needs every id in [0, E), where the loop skips a -1 slot.
    hidden_states [T, H], w1 [E, 2I, H], w2 [E, H, I], topk_weights / topk_ids [T, K]
    -> [T, H] in hidden_states' dtype.
    """
    import torch

    hidden_states, w1, w2 = as_tensor(hidden_states), as_tensor(w1), as_tensor(w2)
    topk_weights, topk_ids = as_tensor(topk_weights), as_tensor(topk_ids)
    w1_bias, w2_bias = as_tensor(w1_bias), as_tensor(w2_bias)
    if impl == "grouped_mm":
        num_experts = w1.shape[0]
        x, offsets, inv = moe_permute(hidden_states, topk_ids, num_experts)
        h = grouped_mm(x, w1, offsets, impl="grouped_mm")
        if w1_bias is not None:
            h = _add_row_bias(h, w1_bias, offsets)
        h = apply_activation(h, activation, is_act_and_mul)
        y = grouped_mm(h, w2, offsets, impl="grouped_mm")
        if w2_bias is not None:
            y = _add_row_bias(y, w2_bias, offsets)
        return moe_unpermute(y, topk_weights, inv)
    if impl != "loop":
        raise ValueError(f"impl: expected one of {GEMM_IMPLS}, got {impl!r}")
    t, k = topk_ids.shape
    cdt = compute_dtype(hidden_states.dtype)
    out = torch.zeros((t, w2.shape[1]), dtype=cdt, device=hidden_states.device)
    flat = topk_ids.reshape(-1).long()
    for ex in torch.unique(flat).tolist():
        if not 0 <= ex < w1.shape[0]:
            continue                          # -1: a slot routed nowhere adds nothing
        slots = (flat == ex).nonzero().squeeze(1)                          # [n]
        tok = slots // k
        h = hidden_states[tok].to(cdt) @ w1[ex].to(cdt).T
        if w1_bias is not None:
            h = h + w1_bias[ex].to(cdt)
        h = apply_activation(h.to(hidden_states.dtype), activation, is_act_and_mul).to(cdt)
        y = h @ w2[ex].to(cdt).T
        if w2_bias is not None:
            y = y + w2_bias[ex].to(cdt)
        out.index_add_(0, tok, y * topk_weights.reshape(-1)[slots].to(cdt)[:, None])
    return out.to(hidden_states.dtype)


def _add_row_bias(y, bias, offsets):
    import torch

    counts = (offsets[1:] - offsets[:-1]).long()
    rows_expert = torch.repeat_interleave(torch.arange(bias.shape[0], device=y.device), counts)
    return (y.float() + bias.float()[rows_expert]).to(y.dtype)
