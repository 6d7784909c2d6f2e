"""vLLM's modular fused-MoE kernel interface, mirrored: prepare/finalize objects, experts
objects, and the kernel that composes them, with vLLM's current names and arguments.

    T tokens here, M rows the experts see (T, or the rows a dispatch brought), K top-k,
    H hidden (vLLM's K), N = w1's rows (2I gated, I no-mul; vLLM's N), E experts (local:
    w1.shape[0]; global: global_num_experts), W ranks

vLLM splits a fused MoE into [router] -> [quantize + dispatch] -> [permute, experts,
unpermute] -> [combine] (vllm/model_executor/layers/fused_moe/modular_kernel.py):

    FusedMoEPrepareAndFinalizeModular   prepare(a1, topk_weights, topk_ids, num_experts,
                                        expert_map, apply_router_weight_on_input,
                                        quant_config, defer_input_quant)
                                          -> (a1q, a1q_scale, expert_tokens_meta,
                                              topk_ids or None, topk_weights or None)
                                        finalize(output, fused_expert_output, topk_weights,
                                                 topk_ids, apply_router_weight_on_input,
                                                 weight_and_reduce_impl)   (output in place)
    FusedMoEExpertsModular              workspace_shapes(M, N, K, topk, global_num_experts,
                                                         local_num_experts,
                                                         expert_tokens_meta, activation)
                                          -> (workspace13, workspace2, output) shapes
                                        apply(output, hidden_states, w1, w2, topk_weights,
                                              topk_ids, activation, global_num_experts,
                                              expert_map, a1q_scale, a2_scale, workspace13,
                                              workspace2, expert_tokens_meta,
                                              apply_router_weight_on_input) (output in place)
                                        supports_expert_map(),
                                        finalize_weight_and_reduce_impl()
    TopKWeightAndReduce{Delegate, NoOP, Contiguous}   who applies the router weights and
                                        sums the K slots: the experts say, finalize obeys
    FusedMoEKernel                      apply(hidden_states, w1, w2, topk_weights, topk_ids,
                                              activation, global_num_experts, expert_map,
                                              apply_router_weight_on_input) -> [T, H]

Prepare/finalize implementations here:
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

Experts implementations (one per backend; the stage functions of docs/stages.md, or the
backend's one-call fused_experts where it has one):
    ReferenceExperts, TorchExperts, NumbaExperts, CupyExperts

Each experts object either reduces inside apply (reduce=True, the default: router weights
applied in GEMM2, the K slots summed by the pad-aware moe_sum; output [M, H];
TopKWeightAndReduceNoOP; vLLM's TritonExperts) or leaves both to finalize (reduce=False:
output [M, K, H] unweighted, the rows of slots routed nowhere zeroed;
TopKWeightAndReduceDelegate, so finalize picks TopKWeightAndReduceContiguous).

What is not mirrored: quantization (our quant_config carries the biases only; quantized
experts live in reference/quant.py and cuda_kernels/cupy/quant_*), the batched activation
format (FusedMoEActivationFormat.BatchedExperts; no experts of ours take it), the
monolithic variants, async prepare/finalize, chunking, shared-expert overlap, LoRA, and
vLLM's FusedMoEConfig (our experts need none of it). docs/stages.md ("The modular kernel
interface") shows how one of these experts classes becomes a vLLM one.

Arrays: the kernel allocates its output and workspaces with hidden_states' library (NumPy,
torch or CuPy); an experts object moves what it is given to its backend
(sandbox.arrays.transfer) and writes `output` in place in the caller's library, so any
prepare/finalize pairs with any experts on one machine.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from abc import ABC, abstractmethod

import numpy as np

from . import arrays
from .registry import get_backend

__all__ = [
    "FusedMoEActivationFormat", "ExpertTokensMetadata", "FusedMoEQuantConfig",
    "FUSED_MOE_UNQUANTIZED_CONFIG", "TopKWeightAndReduce", "TopKWeightAndReduceDelegate",
    "TopKWeightAndReduceNoOP", "TopKWeightAndReduceContiguous",
    "FusedMoEPrepareAndFinalizeModular", "FusedMoEExpertsModular", "FusedMoEKernel",
    "MoEPrepareAndFinalizeNoDPEPModular", "MoEPrepareAndFinalizeNaiveDPEPModular",
    "AllToAllPrepareAndFinalize", "StageExperts", "ReferenceExperts", "TorchExperts",
    "NumbaExperts", "CupyExperts", "EXPERTS", "split_activation",
]


# ----------------------------------------------------------------------------- small types
class FusedMoEActivationFormat(enum.Enum):
    """How prepare hands the tokens to the experts: Standard [M, H] with topk ids and
    weights [M, K], or BatchedExperts [E, max_tokens, H] (not implemented here)."""

    Standard = ("standard",)
    BatchedExperts = ("batched_experts",)


@dataclasses.dataclass
class ExpertTokensMetadata:
    """Rows each local expert receives (a dispatch that knows them says so)."""

    expert_num_tokens: object             # int32 [E_local], the experts' library
    expert_num_tokens_cpu: object = None  # int32 [E_local] NumPy, or None

    @staticmethod
    def make_from_list(expert_num_tokens_list, device=None) -> ExpertTokensMetadata:
        host = np.asarray(list(expert_num_tokens_list), dtype=np.int32)
        return ExpertTokensMetadata(host if device is None else device(host), host)


@dataclasses.dataclass(frozen=True)
class FusedMoEQuantConfig:
    """vLLM's quant config, reduced to what unquantized experts read: the biases.
    quant_dtype must stay None (quantized experts are not mirrored here)."""

    quant_dtype: object = None
    w1_bias: object = None                # [E, N] or None
    w2_bias: object = None                # [E, H] or None
    a1_scale: object = None
    a2_scale: object = None

    def __post_init__(self):
        if self.quant_dtype is not None or self.a1_scale is not None \
                or self.a2_scale is not None:
            raise NotImplementedError("quant_config: only unquantized experts are mirrored "
                                      f"here, got quant_dtype={self.quant_dtype!r}")

    @staticmethod
    def make(w1_bias=None, w2_bias=None) -> FusedMoEQuantConfig:
        return FusedMoEQuantConfig(w1_bias=w1_bias, w2_bias=w2_bias)


FUSED_MOE_UNQUANTIZED_CONFIG = FusedMoEQuantConfig()


def split_activation(activation):
    """vLLM's activation name -> (our activation, is_act_and_mul): "relu2_no_mul" ->
    ("relu2", False), "silu" -> ("silu", True)."""
    name = getattr(activation, "value", activation)   # an enum of vLLM's passes its value
    if not isinstance(name, str):
        raise TypeError(f"activation: expected a name like 'silu' or 'relu2_no_mul', "
                        f"got {activation!r}")
    if name.endswith("_no_mul"):
        return name[: -len("_no_mul")], False
    return name, True


# ----------------------------------------------------------------------------- array helpers
def _host(x):
    return None if x is None else arrays.to_numpy(x)


def _like(host, ref):
    """A host NumPy array in `ref`'s library (and device)."""
    k = arrays.kind(ref)
    if k == "numpy":
        return host
    if k == "torch":
        return arrays.numpy_to_torch(np.ascontiguousarray(host), ref.device)
    return get_backend(k).to_device(np.ascontiguousarray(host))


def _assign(dst, src, backend=None):
    """dst[...] = src, in place, whatever the two libraries (`backend`: the one that made
    src, whose `get` knows its conventions; else sandbox.arrays.to_numpy)."""
    k = arrays.kind(dst)

    def host_of(v):
        h = backend.get(v) if backend is not None else arrays.to_numpy(v)
        return np.ascontiguousarray(h).reshape(tuple(dst.shape))

    if k == "torch":
        import torch

        if arrays.kind(src) != "torch":
            t = arrays.zero_copy(src, "torch") if arrays.is_device(src) else None
            src = t if t is not None else arrays.numpy_to_torch(host_of(src))
        with torch.no_grad():
            dst.copy_(src.reshape(dst.shape))
        return dst
    if k == "numpy":
        np.copyto(dst, host_of(src))
        return dst
    if k == "cupy" and arrays.is_device(src):
        y = arrays.zero_copy(src, "cupy")
        if y is not None:
            dst[...] = y.reshape(dst.shape)
            return dst
    host = host_of(src)
    if k == "cupy":
        dst[...] = get_backend("cupy").to_device(host)
    else:                                  # numba device arrays
        dst.copy_to_device(host)
    return dst


def _empty(like, shape, dtype=None):
    """An uninitialised array of `like`'s library, device and (by default) dtype."""
    k = arrays.kind(like)
    if k == "torch":
        import torch

        return torch.empty(shape, dtype=like.dtype if dtype is None else dtype,
                           device=like.device)
    if k == "cupy":
        import cupy

        return cupy.empty(shape, dtype=like.dtype if dtype is None else dtype)
    return np.empty(shape, dtype=arrays.dtype_of(like) if dtype is None else dtype)


def _live_slots(topk_ids, expert_map, num_experts):
    """bool [M, K] host: the slots an expert of this rank computes (docs/stages.md: an id
    outside [0, num_experts), or one the expert map sends to -1, is routed nowhere)."""
    ids = _host(topk_ids).astype(np.int64)
    live = (ids >= 0) & (ids < num_experts)
    if expert_map is not None:
        emap = _host(expert_map).astype(np.int64)
        live &= emap[np.clip(ids, 0, emap.size - 1)] >= 0
    return live


def _weight_rows(x, weights):
    """x [M, K, H] * weights [M, K] broadcast over H, computed in fp32 (fp64 for fp64) and
    rounded to x's dtype (torch's in-place mul_ of a bf16 tensor by fp32 weights)."""
    if arrays.kind(x) == "torch":
        import torch

        w = weights if arrays.kind(weights) == "torch" else arrays.numpy_to_torch(
            np.ascontiguousarray(_host(weights)), x.device)
        with torch.no_grad():
            return (x * w.to(x.device).reshape(w.shape[0], -1, 1)).to(x.dtype)
    h = arrays.to_numpy(x)
    ct = np.promote_types(h.dtype, np.float32)
    y = (h.astype(ct) * _host(weights).astype(ct)[:, :, None]).astype(h.dtype)
    return y if arrays.kind(x) == "numpy" else _like(y, x)


def _moe_sum(x, topk_ids, expert_map=None):
    """The pad-aware moe_sum of x's own backend (torch or the reference; other libraries
    go through the host)."""
    if arrays.kind(x) == "torch":
        from cuda_kernels import torch as torch_backend

        ids = topk_ids if arrays.kind(topk_ids) == "torch" else arrays.numpy_to_torch(
            np.ascontiguousarray(_host(topk_ids)), x.device)
        emap = None if expert_map is None else (
            expert_map if arrays.kind(expert_map) == "torch" else arrays.numpy_to_torch(
                np.ascontiguousarray(_host(expert_map)), x.device))
        return torch_backend.moe_sum(x, ids.to(x.device), emap)
    import reference

    out = reference.moe_sum(arrays.to_numpy(x), _host(topk_ids), _host(expert_map))
    return out if arrays.kind(x) == "numpy" else _like(out, x)


# ----------------------------------------------------------------------------- weight and reduce
class TopKWeightAndReduce(ABC):
    """Apply the router weights to the experts' output and/or sum the K slots."""

    @abstractmethod
    def apply(self, output, fused_expert_output, topk_weights, topk_ids,
              apply_router_weight_on_input):
        """-> [M, H] (into `output` when given)."""

    def __eq__(self, other):
        return type(self) is type(other)

    def __hash__(self):
        return hash(type(self))


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
        return _assign(output, fused_expert_output)


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
            y = _weight_rows(y, topk_weights)
        out = _moe_sum(y, topk_ids)                                         # [M, H]
        if output is None:
            return out
        if tuple(output.shape) != (m, h):
            raise ValueError(f"output: expected shape {(m, h)}, got {tuple(output.shape)}")
        return _assign(output, out)


# ----------------------------------------------------------------------------- prepare / finalize
class FusedMoEPrepareAndFinalizeModular(ABC):
    """[Quantize + dispatch] before the experts, [combine] after them."""

    def post_init_setup(self, fused_experts):
        """Settings that depend on the experts (none here)."""

    @property
    @abstractmethod
    def activation_format(self) -> FusedMoEActivationFormat:
        ...

    @abstractmethod
    def topk_indices_dtype(self):
        """The topk_ids dtype the dispatch needs, or None."""

    @abstractmethod
    def max_num_tokens_per_rank(self):
        """The batch a batched dispatch takes, or None."""

    @abstractmethod
    def num_dispatchers(self) -> int:
        ...

    @abstractmethod
    def output_is_reduced(self) -> bool:
        """Whether finalize's output is summed over the ranks already."""

    def supports_async(self) -> bool:
        return False

    @property
    def requires_expert_map(self) -> bool:
        """Whether the experts must honour an expert map (experts of other ranks reach
        them): the dispatching ones. Not in vLLM's interface (its layer checks it)."""
        return False

    @abstractmethod
    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config=None, defer_input_quant=False):
        """-> (a1q [M, H], a1q_scale, expert_tokens_meta, topk_ids [M, K] or None,
        topk_weights [M, K] or None); None ids / weights: the caller's stand."""

    @abstractmethod
    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input, weight_and_reduce_impl):
        """Write out [T, H] into `output`."""


def _weight_input(a1, topk_weights, topk_ids):
    """apply_router_weight_on_input: a1 * w, the weight rounded to a1's dtype first and
    the product rounded to it (vLLM's `a1 * topk_weights.to(a1.dtype)`); top-1 only."""
    if topk_ids.shape[1] != 1:
        raise ValueError(f"apply_router_weight_on_input: only implemented for top_k == 1, "
                         f"got top_k={topk_ids.shape[1]}")
    if arrays.kind(a1) == "torch":
        import torch

        w = topk_weights if arrays.kind(topk_weights) == "torch" else arrays.numpy_to_torch(
            np.ascontiguousarray(_host(topk_weights)), a1.device)
        with torch.no_grad():
            return a1 * w.to(device=a1.device, dtype=a1.dtype)
    h = arrays.to_numpy(a1)
    ct = np.promote_types(h.dtype, np.float32)
    w = _host(topk_weights).astype(h.dtype).astype(ct)                      # [M, 1]
    y = (h.astype(ct) * w).astype(h.dtype)
    return y if arrays.kind(a1) == "numpy" else _like(y, a1)


def _finalize_impl(impl):
    return TopKWeightAndReduceContiguous() if isinstance(impl, TopKWeightAndReduceDelegate) \
        else impl


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
        _finalize_impl(weight_and_reduce_impl).apply(
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
        partial = _finalize_impl(weight_and_reduce_impl).apply(
            None, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input)
        out = self._combine(partial)
        self._state = None
        _assign(output, out)

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
        from .ep.dispatch import allgather_dispatch

        if apply_router_weight_on_input:
            a1 = _weight_input(a1, topk_weights, topk_ids)
        x_all, w_all, ids_all, self._state = allgather_dispatch(
            self.comm, self._to_comm(a1), self._to_comm(topk_weights, np.float32),
            self._to_comm(topk_ids, np.int32))
        return x_all, None, None, ids_all, w_all

    def _combine(self, partial):
        from .ep.dispatch import allgather_combine

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
        from .ep.dispatch import alltoall_dispatch

        W = self.comm.world_size
        if num_experts % W:
            raise ValueError(f"num_experts: expected a multiple of the world size {W}, "
                             f"got {num_experts}")
        epr = num_experts // W
        if expert_map is not None:   # the exchange sends expert e to rank e // epr
            emap = _host(expert_map)
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
        ids_h = _host(ids_recv).astype(np.int64)
        local = ids_h - self.comm.rank * epr
        mine = (ids_h >= 0) & (local >= 0) & (local < epr)
        counts = np.bincount(local[mine], minlength=epr).astype(np.int32)
        meta = ExpertTokensMetadata(counts, counts.copy())
        return x_recv, None, meta, ids_recv, w_recv

    def _combine(self, partial):
        from .ep.dispatch import alltoall_combine

        return alltoall_combine(self.comm, self._ops(), self._to_comm(partial), self._state)


# ----------------------------------------------------------------------------- experts
class FusedMoEExpertsModular(ABC):
    """[Permute, experts, unpermute]: the two grouped GEMMs and the activation on the rows
    prepare handed over."""

    def __init__(self, quant_config: FusedMoEQuantConfig | None = None):
        self.quant_config = FUSED_MOE_UNQUANTIZED_CONFIG if quant_config is None \
            else quant_config

    @staticmethod
    def is_monolithic() -> bool:
        return False

    @staticmethod
    def activation_format() -> FusedMoEActivationFormat:
        return FusedMoEActivationFormat.Standard

    @property
    def expects_unquantized_inputs(self) -> bool:
        return False

    @property
    def a2_scale(self):
        return self.quant_config.a2_scale

    @staticmethod
    def _supports_activation(activation) -> bool:
        from reference import ACTIVATIONS

        try:
            name, _ = split_activation(activation)
        except TypeError:
            return False
        return name in ACTIVATIONS

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return True

    @abstractmethod
    def supports_expert_map(self) -> bool:
        ...

    def supports_chunking(self) -> bool:
        return False

    @abstractmethod
    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce:
        ...

    def workspace_dtype(self, act_dtype):
        return act_dtype

    @staticmethod
    def adjust_N_for_activation(N: int, activation) -> int:
        """The activation's output width: N // 2 for the gated ones, N for *_no_mul."""
        return N // 2 if split_activation(activation)[1] else N

    def moe_problem_size(self, a1, w1, w2, topk_ids):
        """-> (E local, M, N, K hidden, topk), read off the arrays."""
        if len(w1.shape) != 3 or len(w2.shape) != 3:
            raise ValueError(f"w1, w2: expected [E, N, H] and [E, H, I], got shapes "
                             f"{tuple(w1.shape)}, {tuple(w2.shape)}")
        E, N, _ = w1.shape
        if len(a1.shape) != 2 or len(topk_ids.shape) != 2 or topk_ids.shape[0] != a1.shape[0]:
            raise ValueError(f"hidden_states, topk_ids: expected [M, H] and [M, K], got "
                             f"shapes {tuple(a1.shape)}, {tuple(topk_ids.shape)}")
        return int(E), int(a1.shape[0]), int(N), int(a1.shape[1]), int(topk_ids.shape[1])

    @abstractmethod
    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        """-> (workspace13 shape, workspace2 shape, output shape)."""

    @abstractmethod
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        """Write the experts' output into `output` (workspace_shapes' output shape)."""


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
        _assign(output, result, self.backend)

    def _compute(self, x, w1, w2, topk_weights, topk_ids, activation, is_act_and_mul,
                 global_num_experts, expert_map, on_input, block):
        b = self.backend
        qc = self.quant_config
        x, w1, w2, tw, ids, emap, b1, b2 = (
            arrays.transfer(v, None, b) for v in (x, w1, w2, topk_weights, topk_ids,
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
    """sandbox/torch_backend.py's stages (CPU or CUDA)."""

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
        xd, w1d, w2d, tw, ids, emap = (
            arrays.transfer(v, None, b) for v in (x, w1, w2, topk_weights, topk_ids,
                                                  expert_map))
        if on_input:   # GEMM1 multiplies by the weight then: by 1, exactly
            tw = b.to_device(np.ones(tuple(topk_ids.shape), np.float32))
        return fn(xd, w1d, w2d, tw, ids, activation, bool(on_input), block_size=block,
                  expert_map=emap)


EXPERTS = {"reference": ReferenceExperts, "torch": TorchExperts, "numba": NumbaExperts,
           "cupy": CupyExperts}


# ----------------------------------------------------------------------------- the kernel
class FusedMoEKernel:
    """A prepare/finalize and an experts object composed into vLLM's fused-MoE call:

        a1q, _, meta, ids, w = prepare(hidden_states, topk_weights, topk_ids, E_global,
                                       expert_map, apply_router_weight_on_input)
        workspace13, workspace2, fused_out <- experts.workspace_shapes(...)  (fused_out
                                              shares workspace13's memory, as in vLLM)
        experts.apply(fused_out, a1q, w1, w2, w, ids, activation, ...)
        finalize(output, fused_out, w, ids, apply_router_weight_on_input,
                 experts.finalize_weight_and_reduce_impl())
    """

    def __init__(self, prepare_finalize, fused_experts):
        if not isinstance(prepare_finalize, FusedMoEPrepareAndFinalizeModular) or \
                not isinstance(fused_experts, FusedMoEExpertsModular):
            raise ValueError("prepare_finalize and fused_experts: expected a "
                             "FusedMoEPrepareAndFinalizeModular and a FusedMoEExpertsModular, "
                             f"got {type(prepare_finalize).__name__} and "
                             f"{type(fused_experts).__name__}")
        if prepare_finalize.activation_format != fused_experts.activation_format():
            raise ValueError(f"activation formats differ: {type(prepare_finalize).__name__} "
                             f"hands over {prepare_finalize.activation_format.name}, "
                             f"{type(fused_experts).__name__} takes "
                             f"{fused_experts.activation_format().name}")
        if prepare_finalize.requires_expert_map and not fused_experts.supports_expert_map():
            raise ValueError(f"{type(fused_experts).__name__} does not support an expert map, "
                             f"which {type(prepare_finalize).__name__} needs")
        self.prepare_finalize = prepare_finalize
        self.fused_experts = fused_experts
        prepare_finalize.post_init_setup(fused_experts)

    def output_is_reduced(self) -> bool:
        return self.prepare_finalize.output_is_reduced()

    def _allocate(self, like, M, N, K, topk, global_num_experts, local_num_experts, meta,
                  activation):
        ex = self.fused_experts
        dtype = ex.workspace_dtype(arrays.dtype_of(like))
        if arrays.kind(like) == "torch":
            dtype = arrays.torch_dtype(dtype)
        ws13, ws2, out = ex.workspace_shapes(M, N, K, topk, global_num_experts,
                                             local_num_experts, meta, activation)
        # cache1 is dead by the time the output is written: one buffer for both (vLLM's)
        common = _empty(like, (max(math.prod(ws13), math.prod(out)),), dtype)
        workspace13 = common[:math.prod(ws13)].reshape(ws13)
        fused_out = common[:math.prod(out)].reshape(out)
        workspace2 = _empty(like, ws2, dtype)
        return workspace13, workspace2, fused_out

    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
              global_num_experts=-1, expert_map=None, apply_router_weight_on_input=False):
        """out [T, H] of the experts for hidden_states [T, H] routed to topk_ids [T, K]
        (global ids; -1: routed nowhere) with topk_weights [T, K]. w1 [E_l, N, H] and w2
        [E_l, H, I] hold this rank's experts; expert_map [E_global] global -> local or -1."""
        pf, ex = self.prepare_finalize, self.fused_experts
        if expert_map is not None and not ex.supports_expert_map():
            raise ValueError(f"expert_map: {type(ex).__name__} does not support one")
        output = _empty(hidden_states, tuple(hidden_states.shape))
        local_num_experts = w1.shape[0]
        if global_num_experts == -1:
            global_num_experts = local_num_experts
        a1q, a1q_scale, meta, ids, weights = pf.prepare(
            hidden_states, topk_weights, topk_ids, global_num_experts, expert_map,
            apply_router_weight_on_input, ex.quant_config,
            defer_input_quant=ex.expects_unquantized_inputs)
        ids = topk_ids if ids is None else ids
        weights = topk_weights if weights is None else weights
        _, M, N, K, topk = ex.moe_problem_size(a1q, w1, w2, ids)
        if M == 0:   # no rows reached this rank: nothing to compute, the combine still runs
            fused_out = _empty(a1q, ex.workspace_shapes(0, N, K, topk, global_num_experts,
                                                        local_num_experts, meta,
                                                        activation)[2])
        else:
            workspace13, workspace2, fused_out = self._allocate(
                a1q, M, N, K, topk, global_num_experts, local_num_experts, meta, activation)
            ex.apply(fused_out, a1q, w1, w2, weights, ids, activation, global_num_experts,
                     expert_map, a1q_scale, ex.a2_scale, workspace13, workspace2, meta,
                     apply_router_weight_on_input)
        pf.finalize(output, fused_out, weights, ids, apply_router_weight_on_input,
                    ex.finalize_weight_and_reduce_impl())
        return output
