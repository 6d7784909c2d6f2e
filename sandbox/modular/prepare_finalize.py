"""Prepare/finalize implementations: what happens to the tokens before the experts and after.

    T tokens here, M rows the experts see, K top-k, H hidden, E experts, W ranks

    MoEPrepareAndFinalizeNoDPEPModular     one device (vLLM's class of that name): the input
                                           weighted when apply_router_weight_on_input, no
                                           dispatch; finalize = the weight-and-reduce
    MoEPrepareAndFinalizeNaiveDPEPModular  vLLM's naive DP/EP over our communicator
                                           (sandbox/ep): all-gather of the tokens and their
                                           routing, reduce-scatter of the partial outputs
    AllToAllPrepareAndFinalize             our all-to-all-v "token rows" exchange
                                           (sandbox/ep/dispatch.py; the shape of vLLM's
                                           DeepEP high-throughput one): each token goes once
                                           to each rank holding one of its experts
"""
from __future__ import annotations

import numpy as np

from .. import arrays
from ..registry import get_backend
from .caller_arrays import assign, in_library_of
from .interface import (ExpertTokensMetadata, FusedMoEActivationFormat,
                        FusedMoEPrepareAndFinalizeModular)
from .weight_and_reduce import finalize_impl


def _weight_input(a1, topk_weights, topk_ids):
    """apply_router_weight_on_input: a1 * w, the weight rounded to a1's dtype first and
    the product rounded to it (vLLM's `a1 * topk_weights.to(a1.dtype)`); top-1 only."""
    if topk_ids.shape[1] != 1:
        raise ValueError(f"apply_router_weight_on_input: only implemented for top_k == 1, "
                         f"got top_k={topk_ids.shape[1]}")
    if arrays.kind(a1) == "torch":
        import torch

        w = topk_weights if arrays.kind(topk_weights) == "torch" else arrays.numpy_to_torch(
            np.ascontiguousarray(arrays.to_numpy(topk_weights)), a1.device)
        with torch.no_grad():
            return a1 * w.to(device=a1.device, dtype=a1.dtype)
    h = arrays.to_numpy(a1)
    ct = np.promote_types(h.dtype, np.float32)
    w = arrays.to_numpy(topk_weights).astype(h.dtype).astype(ct)               # [M, 1]
    y = (h.astype(ct) * w).astype(h.dtype)
    return y if arrays.kind(a1) == "numpy" else in_library_of(y, a1)


class MoEPrepareAndFinalizeNoDPEPModular(FusedMoEPrepareAndFinalizeModular):
    """One device, no dispatch (vLLM's class of this name, unquantized): prepare weights the
    input when asked; finalize reduces into `output` (Delegate -> Contiguous)."""

    @property
    def activation_format(self):
        return FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self):
        return None

    def max_num_tokens_per_rank(self):
        return None

    def num_dispatchers(self):
        return 1

    def output_is_reduced(self):
        return False

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config=None, defer_input_quant=False):
        if apply_router_weight_on_input:
            a1 = _weight_input(a1, topk_weights, topk_ids)
        return a1, None, None, None, None

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce_impl):
        finalize_impl(weight_and_reduce_impl).apply(
            output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input)


class _CommPrepareAndFinalize(FusedMoEPrepareAndFinalizeModular):
    """Shared by the dispatching ones: a communicator of sandbox/ep (its arrays: comm.xp,
    NumPy for the CPU one, CuPy for NCCL) and the state one dispatch leaves for its
    combine (vLLM keeps it in the EP group or the all-to-all manager)."""

    def __init__(self, comm):
        self.comm = comm
        self._state = None

    @property
    def activation_format(self):
        return FusedMoEActivationFormat.Standard

    @property
    def requires_expert_map(self):
        return self.comm.world_size > 1

    def topk_indices_dtype(self):
        return np.int32

    def max_num_tokens_per_rank(self):
        return None

    def num_dispatchers(self):
        return self.comm.world_size

    def output_is_reduced(self):
        return False

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce_impl):
        """Weight and reduce this rank's expert outputs (unless the experts did), then the
        exchange's combine back to the tokens' ranks (`_combine`), into `output`."""
        if self._state is None:
            raise RuntimeError("finalize: expected a prepare first (no dispatch state)")
        partial = finalize_impl(weight_and_reduce_impl).apply(
            None, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input)
        out = self._combine(partial)
        self._state = None
        assign(output, out)

    def _to_comm(self, x, dtype=None):
        """x in the communicator's library (NumPy for the CPU communicator)."""
        if x is None:
            return None
        xp = self.comm.xp
        if xp is np:
            h = arrays.to_numpy(x)
        elif arrays.kind(x) == "cupy":
            h = x
        else:
            h = arrays.zero_copy(x, "cupy") if arrays.is_device(x) else None
            if h is None:
                h = get_backend("cupy").to_device(np.ascontiguousarray(arrays.to_numpy(x)))
        h = h if dtype is None else h.astype(dtype, copy=False)
        return xp.ascontiguousarray(h) if xp is not np else np.ascontiguousarray(h)

    def _ops(self):
        """The stage backend the "stages" all-to-all path permutes with."""
        return get_backend("reference" if self.comm.xp is np else "cupy")


class MoEPrepareAndFinalizeNaiveDPEPModular(_CommPrepareAndFinalize):
    """vLLM's naive DP/EP: every rank sees every token. prepare all-gathers the tokens, ids
    and weights of all ranks ([sum_p T_p, H], global ids: the experts' expert map keeps this
    rank's); finalize reduces on this rank (the experts' partial over all tokens) and
    reduce-scatters, each rank keeping its own T rows (sandbox/ep/dispatch.py, "allgather")."""

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config=None, defer_input_quant=False):
        from ..ep.dispatch import allgather_dispatch

        if apply_router_weight_on_input:
            a1 = _weight_input(a1, topk_weights, topk_ids)
        x_all, w_all, ids_all, self._state = allgather_dispatch(
            self.comm, self._to_comm(a1), self._to_comm(topk_weights, np.float32),
            self._to_comm(topk_ids, np.int32))
        return x_all, None, None, ids_all, w_all

    def _combine(self, partial):
        from ..ep.dispatch import allgather_combine

        return allgather_combine(self.comm, self._to_comm(partial), self._state)   # [T, H]


class AllToAllPrepareAndFinalize(_CommPrepareAndFinalize):
    """Our all-to-all-v with token rows (sandbox/ep/dispatch.py, scheme "alltoall", rows
    "token"): token t goes once to each rank holding one of its experts, with its K global
    ids and weights; the owner computes its local slots (the expert map skips the others)
    and sums them weighted; the combine returns each partial to the token's rank and adds
    them. Experts are placed linearly (rank r holds [r E_l, (r + 1) E_l)), as vLLM's
    default expert map. prepare says how many rows each local expert got
    (expert_tokens_meta), as vLLM's DeepEP high-throughput dispatch does.
    impl: "fused" (default) or "stages" (dispatch.py)."""

    def __init__(self, comm, impl=None):
        super().__init__(comm)
        self.impl = impl

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config=None, defer_input_quant=False):
        from ..ep.dispatch import alltoall_dispatch

        W = self.comm.world_size
        if num_experts % W:
            raise ValueError(f"num_experts: expected a multiple of the world size {W}, "
                             f"got {num_experts}")
        epr = num_experts // W
        if expert_map is not None:   # the exchange sends expert e to rank e // epr
            emap = arrays.to_numpy(expert_map)
            want = np.full(num_experts, -1, np.int64)
            r = self.comm.rank
            want[r * epr:(r + 1) * epr] = np.arange(epr)
            if emap.shape != (num_experts,) or not np.array_equal(emap, want):
                raise ValueError("expert_map: the all-to-all exchange places experts "
                                 "linearly (rank r holds experts r*E/W .. (r+1)*E/W - 1); "
                                 "got another map")
        if apply_router_weight_on_input:
            a1 = _weight_input(a1, topk_weights, topk_ids)
        x_recv, ids_recv, w_recv, self._state = alltoall_dispatch(
            self.comm, self._ops(), self._to_comm(a1), self._to_comm(topk_ids, np.int32),
            epr, self._to_comm(topk_weights, np.float32), rows="token", impl=self.impl)
        ids_h = arrays.to_numpy(ids_recv).astype(np.int64)
        local = ids_h - self.comm.rank * epr
        mine = (ids_h >= 0) & (local >= 0) & (local < epr)
        counts = np.bincount(local[mine], minlength=epr).astype(np.int32)
        meta = ExpertTokensMetadata(counts, counts.copy())
        return x_recv, None, meta, ids_recv, w_recv

    def _combine(self, partial):
        from ..ep.dispatch import alltoall_combine

        return alltoall_combine(self.comm, self._ops(), self._to_comm(partial), self._state)
