"""Who applies the router weights to the experts' output and sums the K slots (vLLM's
topk_weight_and_reduce.py): the experts say, in finalize_weight_and_reduce_impl(), and
finalize obeys.

    M rows, K top-k, H hidden

    TopKWeightAndReduceNoOP         the experts' output [M, H] is weighted and reduced already
    TopKWeightAndReduceDelegate     the experts leave it to finalize, which picks Contiguous
    TopKWeightAndReduceContiguous   out[m] = sum over the live slots k of w[m, k] * y[m, k]
    finalize_impl(impl)             the one finalize runs (Delegate -> Contiguous)
"""
from __future__ import annotations

import numpy as np

from .. import arrays
from .caller_arrays import assign, in_library_of
from .interface import TopKWeightAndReduce


class TopKWeightAndReduceDelegate(TopKWeightAndReduce):
    """The experts leave the choice to finalize (which picks Contiguous)."""

    def apply(self, output, fused_expert_output, topk_weights, topk_ids,
              apply_router_weight_on_input):
        raise RuntimeError("TopKWeightAndReduceDelegate: the prepare/finalize is expected to "
                           "choose a TopKWeightAndReduce implementation")


class TopKWeightAndReduceNoOP(TopKWeightAndReduce):
    """The experts' output is weighted and reduced already: [M, H]."""

    def apply(self, output, fused_expert_output, topk_weights, topk_ids,
              apply_router_weight_on_input):
        if output is None or output is fused_expert_output:
            return fused_expert_output
        if tuple(output.shape) != tuple(fused_expert_output.shape):
            raise ValueError(f"output: expected the experts' output shape "
                             f"{tuple(fused_expert_output.shape)}, got {tuple(output.shape)}")
        return assign(output, fused_expert_output)


class TopKWeightAndReduceContiguous(TopKWeightAndReduce):
    """The experts' output [M, K, H] (or [M*K, H]) unweighted: out[m] = sum over the live
    slots k of w[m, k] * y[m, k] (weights applied in the output's dtype, as vLLM's mul_,
    unless they went on the input; then the pad-aware moe_sum: a slot with id -1 adds
    nothing even if its row holds garbage)."""

    def apply(self, output, fused_expert_output, topk_weights, topk_ids,
              apply_router_weight_on_input):
        m, k = topk_ids.shape
        h = fused_expert_output.shape[-1]
        y = fused_expert_output.reshape(m, k, h)                            # [M, K, H]
        if not apply_router_weight_on_input:
            y = weight_rows(y, topk_weights)
        out = moe_sum(y, topk_ids)                                          # [M, H]
        if output is None:
            return out
        if tuple(output.shape) != (m, h):
            raise ValueError(f"output: expected shape {(m, h)}, got {tuple(output.shape)}")
        return assign(output, out)


def finalize_impl(impl):
    """The TopKWeightAndReduce that finalize runs: Contiguous in place of a Delegate."""
    return TopKWeightAndReduceContiguous() if isinstance(impl, TopKWeightAndReduceDelegate) \
        else impl


def weight_rows(x, weights):
    """x [M, K, H] * weights [M, K] broadcast over H, computed in fp32 (fp64 for fp64) and
    rounded to x's dtype (torch's in-place mul_ of a bf16 tensor by fp32 weights)."""
    if arrays.kind(x) == "torch":
        import torch

        w = weights if arrays.kind(weights) == "torch" else arrays.numpy_to_torch(
            np.ascontiguousarray(arrays.to_numpy(weights)), x.device)
        with torch.no_grad():
            return (x * w.to(x.device).reshape(w.shape[0], -1, 1)).to(x.dtype)
    h = arrays.to_numpy(x)
    ct = np.promote_types(h.dtype, np.float32)
    y = (h.astype(ct) * arrays.to_numpy(weights).astype(ct)[:, :, None]).astype(h.dtype)
    return y if arrays.kind(x) == "numpy" else in_library_of(y, x)


def moe_sum(x, topk_ids, expert_map=None):
    """The pad-aware moe_sum of x's own backend (torch or the reference; other libraries
    go through the host)."""
    if arrays.kind(x) == "torch":
        from cuda_kernels import torch as torch_backend

        ids = topk_ids if arrays.kind(topk_ids) == "torch" else arrays.numpy_to_torch(
            np.ascontiguousarray(arrays.to_numpy(topk_ids)), x.device)
        emap = None if expert_map is None else (
            expert_map if arrays.kind(expert_map) == "torch" else arrays.numpy_to_torch(
                np.ascontiguousarray(arrays.to_numpy(expert_map)), x.device))
        return torch_backend.moe_sum(x, ids.to(x.device), emap)
    import reference

    out = reference.moe_sum(arrays.to_numpy(x), arrays.to_numpy(topk_ids),
                            arrays.to_numpy(expert_map))
    return out if arrays.kind(x) == "numpy" else in_library_of(out, x)
