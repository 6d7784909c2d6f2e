"""Experts implementations, one per backend of the registry: the stage functions of
docs/stages.md (align -> gemm1 -> activation -> gemm2 -> combine), or the backend's one-call
fused_experts where it has one.

    M rows, K top-k, H hidden, N = w1's rows, E experts, B block size

    StageExperts         a backend's stages, as vLLM's TritonExperts runs its kernels
    ReferenceExperts, TorchExperts, NumbaExperts, CupyExperts;  EXPERTS[name]

Each either reduces inside apply (reduce=True, the default: router weights applied in GEMM2,
the K slots summed by the pad-aware moe_sum; output [M, H]; TopKWeightAndReduceNoOP;
vLLM's TritonExperts) or leaves both to finalize (reduce=False: output [M, K, H]
unweighted, the rows of slots routed nowhere zeroed; TopKWeightAndReduceDelegate, so
finalize picks TopKWeightAndReduceContiguous). What it is given moves to its backend by
its own kind (Backend.take); `output` is written in place in the caller's library.
"""
from __future__ import annotations

import math

import numpy as np

from .. import arrays
from ..registry import get_backend
from .caller_arrays import assign
from .interface import FusedMoEExpertsModular, split_activation
from .weight_and_reduce import TopKWeightAndReduceDelegate, TopKWeightAndReduceNoOP


class StageExperts(FusedMoEExpertsModular):
    """Experts that run docs/stages.md's align -> gemm1 -> activation -> gemm2 (-> combine)
    on one backend of the registry, as vLLM's TritonExperts runs its kernels:

        sorted_token_ids, expert_ids, n = moe_align_block_size(topk_ids, B, E_global,
                                                               expert_map)
        cache1 = grouped_gemm(x, w1, ...)                                   # [M K, N]
        cache2 = apply_activation(cache1, activation)                       # [M K, N']
        cache3 = grouped_gemm(cache2, w2, ..., topk_weights, mul=reduce and not on_input)
        output = moe_sum(cache3 [M, K, H], topk_ids, expert_map)            # reduce=True
               | cache3 [M, K, H] with the rows of dead slots zeroed        # reduce=False

    The router weight never multiplies GEMM1 here (vLLM's TritonExperts: when it goes on the
    input, prepare applied it). block_size: None -> the backend's GEMM config (BLOCK_M),
    else its default (the layer's rule). The workspaces are checked for size, not used:
    the stage functions allocate their own intermediates."""

    backend_name = "reference"

    def __init__(self, quant_config=None, *, block_size=None, reduce=True):
        super().__init__(quant_config)
        self.block_size = block_size
        self.reduce = bool(reduce)

    @property
    def backend(self):
        return get_backend(self.backend_name)

    def supports_expert_map(self) -> bool:
        return True

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP() if self.reduce else TopKWeightAndReduceDelegate()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        n_act = self.adjust_N_for_activation(N, activation)
        workspace13 = (M, topk, max(n_act, K))     # cache2, and the output may alias it
        workspace2 = (M, topk, max(N, K))          # cache1, then cache3
        output = (M, K) if self.reduce else (M, topk, K)
        return workspace13, workspace2, output

    def _block(self, M, N, K, E, topk, dtype):
        if self.block_size is not None:
            return int(self.block_size)
        b = self.backend
        try:
            cfg = b.gemm_config(M, N, K, E, topk, dtype)
        except Exception:
            cfg = None
        if cfg and cfg.get("BLOCK_M"):
            return int(cfg["BLOCK_M"])
        return b.default_block_size

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        if a1q_scale is not None or a2_scale is not None:
            raise NotImplementedError("a1q_scale, a2_scale: quantized activations are not "
                                      "mirrored here")
        name, is_act_and_mul = split_activation(activation)
        E, M, N, H, topk = self.moe_problem_size(hidden_states, w1, w2, topk_ids)
        if global_num_experts is None or global_num_experts == -1:
            global_num_experts = E
        shapes = self.workspace_shapes(M, N, H, topk, global_num_experts, E,
                                       expert_tokens_meta, activation)
        if tuple(output.shape) != shapes[2]:
            raise ValueError(f"output: expected shape {shapes[2]}, got {tuple(output.shape)}")
        for ws, want, what in ((workspace13, shapes[0], "workspace13"),
                               (workspace2, shapes[1], "workspace2")):
            if ws is not None and math.prod(ws.shape) < math.prod(want):
                raise ValueError(f"{what}: expected room for {want}, got {tuple(ws.shape)}")
        if M == 0:
            return
        dtype = arrays.dtype_of(hidden_states)
        block = self._block(M, N, H, E, topk, dtype)
        result = self._compute(hidden_states, w1, w2, topk_weights, topk_ids, name,
                               is_act_and_mul, global_num_experts, expert_map,
                               apply_router_weight_on_input, block)
        assign(output, result, self.backend)

    def _compute(self, x, w1, w2, topk_weights, topk_ids, activation, is_act_and_mul,
                 global_num_experts, expert_map, on_input, block):
        b = self.backend
        qc = self.quant_config
        x, w1, w2, tw, ids, emap, b1, b2 = b.take((x, w1, w2, topk_weights, topk_ids,
                                                   expert_map, qc.w1_bias, qc.w2_bias))
        M, H = x.shape
        topk = ids.shape[1]
        sorted_ids, expert_ids, ntpp = b.stage_fn("align")(
            ids, block, global_num_experts, expert_map=emap)
        gemm = b.stage_fn("gemm1")
        cache1 = gemm(x, w1, sorted_ids, expert_ids, ntpp, topk, block, None, False, b1)
        cache2 = b.stage_fn("activation")(cache1, activation, is_act_and_mul)
        cache3 = gemm(cache2, w2, sorted_ids, expert_ids, ntpp, 1, block, tw,
                      self.reduce and not on_input, b2)                      # [M K, H]
        if self.reduce:
            return b.stage_fn("combine")(cache3.reshape(M, topk, H), ids, expert_map=emap)
        dead = ~_live_slots(topk_ids, expert_map, global_num_experts).reshape(-1)
        if dead.any():   # rows alignment skipped were never written: zero them
            cache3 = _zero_rows(cache3, dead)
        return cache3.reshape(M, topk, H)


def _live_slots(topk_ids, expert_map, num_experts):
    """bool [M, K] host: the slots an expert of this rank computes (docs/stages.md: an id
    outside [0, num_experts), or one the expert map sends to -1, is routed nowhere)."""
    ids = arrays.to_numpy(topk_ids).astype(np.int64)
    live = (ids >= 0) & (ids < num_experts)
    if expert_map is not None:
        emap = arrays.to_numpy(expert_map).astype(np.int64)
        live &= emap[np.clip(ids, 0, emap.size - 1)] >= 0
    return live


def _zero_rows(y, dead):
    """y [P, H] with the rows where `dead` (host bool [P]) is True set to 0."""
    k = arrays.kind(y)
    if k == "numpy":
        y = np.array(y, copy=True)
        y[dead] = 0
        return y
    if k == "torch":
        import torch

        y = y.clone()
        y[torch.from_numpy(dead).to(y.device)] = 0
        return y
    if k == "cupy":
        import cupy

        y = y.copy()
        y[cupy.asarray(dead)] = 0
        return y
    h = arrays.to_numpy(y).copy()
    h[dead] = 0
    return h


class ReferenceExperts(StageExperts):
    """The NumPy reference's stages (reference/): with NoDPEP prepare/finalize and
    reduce=True, bit for bit reference.fused_experts."""

    backend_name = "reference"


class TorchExperts(StageExperts):
    """cuda_kernels/torch/'s stages (CPU or CUDA)."""

    backend_name = "torch"


class NumbaExperts(StageExperts):
    """cuda_kernels.numba's stages (a GPU, or the CUDA simulator)."""

    backend_name = "numba"


class CupyExperts(StageExperts):
    """cuda_kernels.cupy: reduce=True with a gated silu / gelu / gelu_tanh, bf16 or fp16 and
    no biases runs cuda_kernels.cupy.fused_experts (align .. combine from one cached plan;
    the router weight multiplies GEMM2, or nothing when it went on the input: the weights
    passed are then ones, which GEMM1 multiplies exactly); anything else runs the stages."""

    backend_name = "cupy"

    def _compute(self, x, w1, w2, topk_weights, topk_ids, activation, is_act_and_mul,
                 global_num_experts, expert_map, on_input, block):
        b = self.backend
        fn = getattr(b.module, "fused_experts", None)
        qc = self.quant_config
        fast = (self.reduce and is_act_and_mul and qc.w1_bias is None and qc.w2_bias is None
                and fn is not None and activation in getattr(fn, "activations", ())
                and arrays.dtype_of(x) in (np.dtype(np.float16), arrays.BF16))
        if not fast:
            return super()._compute(x, w1, w2, topk_weights, topk_ids, activation,
                                    is_act_and_mul, global_num_experts, expert_map,
                                    on_input, block)
        xd, w1d, w2d, tw, ids, emap = b.take((x, w1, w2, topk_weights, topk_ids, expert_map))
        if on_input:   # GEMM1 multiplies by the weight then: by 1, exactly
            tw = b.to_device(np.ones(tuple(topk_ids.shape), np.float32))
        return fn(xd, w1d, w2d, tw, ids, activation, bool(on_input), block_size=block,
                  expert_map=emap)


EXPERTS = {"reference": ReferenceExperts, "torch": TorchExperts, "numba": NumbaExperts,
           "cupy": CupyExperts}
