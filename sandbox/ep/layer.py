"""`EPMoE`: the MoE layer under expert parallelism.

    T tokens on this rank, E logical experts, R redundant, P = E + R physical experts,
    W ranks, P_l = P / W experts per rank, K top-k, H hidden, I intermediate

Each rank holds the weights of its P_l physical experts only, in a `sandbox.MoEWeights`
over the P physical ids with linear placement (vLLM's layout for EPLB: physical expert p
lives on rank p // P_l; `MoEWeights.weight_loader` skips the others). Which *logical* expert
each physical slot holds is the `ExpertPlacement` (eplb_runtime.py): the linear or
round_robin placement of reference.determine_expert_map, or an EPLB map with replicas.

forward(x [T, H], router_logits [T, E]) -> out [T, H], this rank's tokens:

    topk_weights, topk_ids = select_experts(x, logits)          # logical ids, on this rank
    record the load; ids -> physical ids (replica (t + rank) % count)
    dispatch  -> the rows each rank's experts need               (dispatch.py, two schemes)
    experts   -> align, GEMM1, activation, GEMM2 on local weights (the stage backend)
    combine   -> out[t] = sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t])

out equals the single-device layer's output for these tokens (up to the dtype's rounding)
for either scheme, any placement and any replication: replicas hold identical weights.

Backends: the CPU communicator runs the NumPy reference stages; the NCCL communicator runs
`cuda_kernels.cupy` on the GPU, or the reference on the host ("reference": arrays cross to
the host around each stage) where the CuPy kernels are missing.
"""
from __future__ import annotations

import dataclasses
import json
import re

import ml_dtypes
import numpy as np

from .dispatch import (ALLTOALL_ROWS, SCHEMES, allgather_combine, allgather_dispatch,
                       alltoall_combine, alltoall_dispatch)
from .eplb_runtime import PLACEMENTS, ExpertPlacement, LoadRecorder, check_divisible, \
    rearrange_plan
from .wire import raw, to_comm, to_host, view_as

__all__ = ["EPConfig", "EPMoE"]

_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
           "bfloat16": np.dtype(ml_dtypes.bfloat16), "float64": np.dtype(np.float64)}
_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}
_PARAMS = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")
_CKPT_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",
                "w1": "w1", "w3": "w3", "w2": "w2"}
_ROUTED = re.compile(r"(?:^|\.)experts\.(\d+)\.([A-Za-z0-9_]+)\.(weight|bias)$")


def dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype.lower(), dtype.lower())
        if name in _DTYPES:
            return name
    else:
        for name, dt in _DTYPES.items():
            try:
                if np.dtype(dtype) == dt:
                    return name
            except TypeError:
                break
    raise TypeError(f"dtype: expected one of {list(_DTYPES)} (or fp32/fp16/bf16), got {dtype!r}")


@dataclasses.dataclass(frozen=True)
class EPConfig:
    """Everything every rank must agree on (compared through the store before any
    collective). Routing arguments follow FusedMoE / select_experts."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    dtype: str = "bfloat16"
    scheme: str = "alltoall"              # "allgather" | "alltoall"
    alltoall_rows: str = "token"          # alltoall: one row per (token, rank) | per "slot"
    placement: str = "linear"             # "linear" | "round_robin" (initial, under EPLB)
    num_redundant_experts: int = 0        # R: physical = logical + R
    eplb_num_groups: int = 1              # rebalance: expert groups (hierarchical EPLB)
    eplb_num_nodes: int = 1               # rebalance: nodes
    renormalize: bool = True
    use_grouped_topk: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None
    scoring_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    activation: str = "silu"
    is_act_and_mul: bool = True
    apply_router_weight_on_input: bool = False
    has_bias: bool = False
    block_size: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme: expected one of {list(SCHEMES)}, got {self.scheme!r}")
        if self.alltoall_rows not in ALLTOALL_ROWS:
            raise ValueError(f"alltoall_rows: expected one of {list(ALLTOALL_ROWS)}, "
                             f"got {self.alltoall_rows!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement: expected one of {list(PLACEMENTS)}, "
                             f"got {self.placement!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: expected at most num_experts={self.num_experts}, "
                             f"got {self.top_k}")
        if self.apply_router_weight_on_input and self.top_k != 1:
            raise ValueError(f"apply_router_weight_on_input: needs top_k == 1, "
                             f"got top_k={self.top_k}")

    @property
    def num_physical(self) -> int:
        return self.num_experts + self.num_redundant_experts

    @property
    def np_dtype(self) -> np.dtype:
        return _DTYPES[self.dtype]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class _OnHost:
    """A stage namespace for device arrays that runs the NumPy reference on the host:
    device arguments go to the host, results come back (the fallback when an NCCL run has
    no CuPy kernels)."""

    def __init__(self, ops, comm):
        self._ops, self._comm = ops, comm
        self.name = "reference (host)"

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        comm = self._comm

        def call(*args, **kwargs):
            args = [to_host(comm, a) for a in args]
            kwargs = {k: to_host(comm, v) for k, v in kwargs.items()}
            return to_comm(comm, fn(*args, **kwargs))

        return call


class EPMoE:
    """One MoE layer spread over the ranks of `comm` (see the module docstring).

    comm: a Communicator (CPU or NCCL). config: EPConfig. backend: the stage backend,
    "reference" (NumPy; host) or "cupy" (GPU, NCCL only).
    Refuses before any collective: a world size that does not divide the physical experts,
    a config that differs across ranks, a backend that cannot read the communicator's
    arrays.
    """

    def __init__(self, comm, config: EPConfig, backend: str = "reference",
                 placement: ExpertPlacement | None = None, host_weights: bool = True):
        from sandbox.weights import MoEWeights

        if not isinstance(config, EPConfig):
            raise TypeError(f"config: expected an EPConfig, got {type(config).__name__}")
        self.comm, self.config = comm, config
        W, r = comm.world_size, comm.rank
        check_divisible(config.num_experts, W, config.num_redundant_experts)
        if placement is None:
            placement = ExpertPlacement.initial(config.num_experts, W, config.placement,
                                                config.num_redundant_experts)
        if placement.num_physical != config.num_physical or placement.world_size != W or \
                placement.num_logical != config.num_experts:
            raise ValueError(f"placement: expected E={config.num_experts}, "
                             f"P={config.num_physical}, W={W}, got {placement!r}")
        # every rank must run the same layer: compare through the store, not a collective
        comm.agree("EP layer config", {**config.to_json(), "world_size": W,
                                       "backend_kind": comm.backend,
                                       "placement": placement.phys2log.tolist()})

        self._dev: dict = {}
        self._given: set = set()         # names of the arrays set_device_parameters handed over
        self.backend = backend           # checked, and the ops chosen, by the property's setter
        self.placement = placement
        self.dtype = config.np_dtype
        self.experts_per_rank = placement.per_rank
        self.experts = None if not host_weights else MoEWeights(
            num_experts=config.num_physical, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, params_dtype=self.dtype, ep_size=W,
            ep_rank=r, expert_placement="linear", activation=config.activation,
            is_act_and_mul=config.is_act_and_mul, has_bias=config.has_bias)
        self.e_score_correction_bias = None
        self.load = LoadRecorder(config.num_experts, comm.xp)
        self.record_load = config.num_redundant_experts > 0
        self.last_stats: dict = {}

    # ---- backend ----------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The stage backend's name. Assigning it runs the constructor's checks (ValueError
        or RuntimeError, the layer left as it was), picks the stage functions again and drops
        the device copies made from the host weights (arrays given to set_device_parameters
        stay)."""
        return self._backend

    @backend.setter
    def backend(self, backend):
        from sandbox.registry import get_backend

        comm = self.comm
        b = get_backend(backend)
        if not b.ok:
            raise RuntimeError(f"backend: {backend!r} is not available here: {b.reason}")
        if comm.backend == "cpu" and not b.is_host:
            raise ValueError(f"backend: the CPU communicator needs a host backend "
                             f"('reference'), got {backend!r}")
        if comm.backend == "nccl":
            if backend not in ("cupy", "reference"):
                raise ValueError(f"backend: expected 'cupy' or 'reference' with NCCL, "
                                 f"got {backend!r}")
            self.ops = b if backend == "cupy" else _OnHost(b, comm)
        else:
            self.ops = b
        self._backend = backend
        for key in [k for k in self._dev if k not in self._given]:
            del self._dev[key]

    # ---- parameters -------------------------------------------------------------------------
    def param_shapes(self) -> dict:
        """{name: shape} of this rank's parameters ([P_l, ...] each)."""
        c, Pl = self.config, self.experts_per_rank
        n13 = 2 * c.intermediate_size if c.is_act_and_mul else c.intermediate_size
        shapes = {"w13_weight": (Pl, n13, c.hidden_size),
                  "w2_weight": (Pl, c.hidden_size, c.intermediate_size)}
        if c.has_bias:
            shapes.update(w13_bias=(Pl, n13), w2_bias=(Pl, c.hidden_size))
        return shapes

    def _need_host(self, what):
        if self.experts is None:
            raise RuntimeError(f"rank {self.comm.rank}: this layer was built with "
                               f"host_weights=False; {what} needs the host weights (its "
                               f"parameters exist only as device arrays: set_device_parameters)")

    def _host(self, name):
        self._need_host(name)
        return getattr(self.experts, name)

    # the host parameters, read through _host (a layer built with host_weights=False says so)
    w13_weight = property(lambda self: self._host("w13_weight"))
    w2_weight = property(lambda self: self._host("w2_weight"))
    w13_bias = property(lambda self: self._host("w13_bias"))
    w2_bias = property(lambda self: self._host("w2_bias"))

    def local_logical_experts(self) -> np.ndarray:
        """The logical expert held by each local slot: int32 [P_l]."""
        return self.placement.local_logical(self.comm.rank)

    def _invalidate(self):
        self._dev.clear()
        self._given.clear()
        if self.experts is not None:
            self.experts.invalidate_device_cache()

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id) -> bool:
        """MoEWeights.weight_loader with a *logical* expert_id: the tensor goes into every local
        replica of that expert (none when it lives elsewhere: returns False). A full tensor
        ([E, ...]) loads every local slot at once."""
        from sandbox import arrays

        loaded = np.asarray(arrays.to_numpy(loaded_weight))
        one_ndim = 1 if "bias" in weight_name else 2
        if loaded.ndim == one_ndim + 1:
            if loaded.shape[0] != self.config.num_experts:
                raise ValueError(f"{weight_name}: expected {self.config.num_experts} experts "
                                 f"in the first dimension of a full tensor, got {loaded.shape}")
            full_physical = loaded[self.placement.phys2log]             # [P, ...]
            self._need_host("weight_loader")
            ok = self.experts.weight_loader(param, full_physical, weight_name, shard_id, 0)
            self._invalidate()
            return ok
        if isinstance(expert_id, bool) or not isinstance(expert_id, (int, np.integer)) or \
                not 0 <= expert_id < self.config.num_experts:
            raise ValueError(f"expert_id: expected a logical expert id in "
                             f"[0, {self.config.num_experts}), got {expert_id!r}")
        slots = self.placement.log2phy[expert_id, :self.placement.logcnt[expert_id]]
        self._need_host("weight_loader")
        ok = False
        for p in slots.tolist():
            ok |= bool(self.experts.weight_loader(param, loaded, weight_name, shard_id, p))
        self._invalidate()
        return ok

    def load_weights(self, weights) -> set[str]:
        """(name, tensor) pairs of a checkpoint: `...experts.<e>.<gate_proj|up_proj|down_proj
        |w1|w3|w2>.<weight|bias>`, plus `...e_score_correction_bias`. Returns the names that
        landed on this rank."""
        loaded = set()
        for name, tensor in weights:
            if name.endswith("e_score_correction_bias"):
                self.set_e_score_correction_bias(tensor)
                loaded.add(name)
                continue
            m = _ROUTED.search(name)
            if m is None or m.group(2) not in _CKPT_SHARDS:
                continue
            shard = _CKPT_SHARDS[m.group(2)]
            param = ("w2_" if shard == "w2" else "w13_") + m.group(3)
            if self.weight_loader(param, tensor, name, shard, int(m.group(1))):
                loaded.add(name)
        return loaded

    def load_from(self, layer):
        """Copy this rank's experts from a single-device `FusedMoE` (ep_size 1) holding all
        E experts: slot j gets logical expert local_logical[j]'s fused tensors."""
        if layer.num_experts != self.config.num_experts or layer.ep_size != 1:
            raise ValueError(f"layer: expected a single-device FusedMoE with "
                             f"{self.config.num_experts} experts, got {layer!r}")
        idx = self.local_logical_experts()
        for name in _PARAMS:
            src, dst = getattr(layer, name), self._host(name)
            if (src is None) != (dst is None):
                raise ValueError(f"layer: {name} is {'missing' if src is None else 'extra'} "
                                 f"(has_bias differs)")
            if src is not None:
                if src.shape[1:] != dst.shape[1:]:
                    raise ValueError(f"layer: {name} has shape {src.shape[1:]} per expert, "
                                     f"expected {dst.shape[1:]}")
                dst[...] = src[idx].astype(self.dtype)
        if layer.e_score_correction_bias is not None:
            self.set_e_score_correction_bias(layer.e_score_correction_bias)
        self._invalidate()

    def set_e_score_correction_bias(self, bias):
        from sandbox import arrays

        b = np.asarray(arrays.to_numpy(bias), dtype=np.float32)
        if b.shape != (self.config.num_experts,):
            raise ValueError(f"e_score_correction_bias: expected shape "
                             f"({self.config.num_experts},), got {b.shape}")
        self.e_score_correction_bias = b
        self._dev.pop("e_score_correction_bias", None)

    def set_device_parameters(self, **params):
        """Hand the stage backend ready arrays (e.g. random weights made on the GPU by a
        benchmark, `w13_weight=[P_l, 2I, H]`): the host copies are bypassed (and stay
        unloaded); loading weights or moving experts replaces them again."""
        shapes = self.param_shapes()
        for name, arr in params.items():
            if name not in shapes:
                raise ValueError(f"{name}: expected one of the layer's parameters "
                                 f"{sorted(shapes)}")
            if tuple(arr.shape) != shapes[name]:
                raise ValueError(f"{name}: expected shape {shapes[name]}, "
                                 f"got {tuple(arr.shape)}")
            self._dev[name] = arr
            self._given.add(name)

    def _param(self, name):
        """A parameter as the stage backend reads it (device copy cached)."""
        if name in self._dev:
            return self._dev[name]
        if name == "e_score_correction_bias":
            host = self.e_score_correction_bias
        elif name not in self.param_shapes():
            return None  # a bias the layer does not have
        else:
            host = self._host(name)
        if host is None:
            return None
        # a never-loaded expert is NaN (MoEWeights allocates so); look at one row per expert
        probe = host if host.ndim < 3 else host[:, :1]
        if name != "e_score_correction_bias" and np.isnan(probe.astype(np.float32)).any():
            raise RuntimeError(f"rank {self.comm.rank}: {name} has experts that were never "
                               f"loaded: {self.experts.unloaded()[:4]}")
        dev = host
        if self.comm.backend == "nccl" and self.backend == "cupy":
            dev = self.ops.to_device(host)
        self._dev[name] = dev
        return dev

    # ---- forward ------------------------------------------------------------------------------
    def _block(self, num_tokens):
        if self.config.block_size:
            return self.config.block_size
        try:
            cfg = self.ops.gemm_config(num_tokens, self.param_shapes()["w13_weight"][1],
                                       self.config.hidden_size, self.experts_per_rank,
                                       self.config.top_k, self.dtype)
            if cfg and cfg.get("BLOCK_M"):
                return int(cfg["BLOCK_M"])
        except Exception:
            pass
        return 64

    def _as_input(self, x, name):
        xp = self.comm.xp
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
        if len(x.shape) != 2:
            raise ValueError(f"{name}: expected 2 dimensions, got shape {tuple(x.shape)}")
        if isinstance(x, np.ndarray) and xp is not np:
            x = view_as(xp.asarray(raw(np.ascontiguousarray(x))), x.dtype)
        return x

    def route(self, x, router_logits):
        """select_experts on the stage backend: (topk_weights f32 [T, K], topk_ids int32 [T, K])."""
        c = self.config
        xp = self.comm.xp
        if x.shape[0] == 0:  # no tokens on this rank: no routing kernel on an empty grid
            return (xp.zeros((0, c.top_k), dtype=xp.float32),
                    xp.zeros((0, c.top_k), dtype=xp.int32))
        weights, ids, _ = self.ops.select_experts(
            x, router_logits, c.top_k, c.use_grouped_topk, c.renormalize,
            topk_group=c.topk_group, num_expert_group=c.num_expert_group,
            scoring_func=c.scoring_func, routed_scaling_factor=c.routed_scaling_factor,
            e_score_correction_bias=self._param("e_score_correction_bias"),
            global_num_experts=c.num_experts)
        return weights, ids.astype(self.comm.xp.int32)

    def experts_forward(self, x, topk_ids, topk_weights, num_experts, expert_map=None,
                        mul_gemm1=False, mul_gemm2=True):
        """The local experts on rows x [M, H] with ids [M, K] (local or physical + expert_map):
        align, GEMM1, activation, GEMM2, and the sum over K -> [M, H]."""
        xp = self.comm.xp
        c = self.config
        M, K = topk_ids.shape
        if M == 0:  # nothing routed here: no kernel launches on empty grids
            return view_as(xp.zeros((0, c.hidden_size), dtype=raw(x).dtype), self.dtype)
        ops = self.ops
        B = self._block(M)
        sorted_ids, expert_ids, ntpp = ops.moe_align_block_size(
            topk_ids, B, num_experts, expert_map=expert_map)
        cache1 = ops.grouped_gemm(x, self._param("w13_weight"), sorted_ids, expert_ids, ntpp,
                                  K, B, topk_weights, mul_gemm1, self._param("w13_bias"))
        cache2 = ops.apply_activation(cache1, c.activation, c.is_act_and_mul)
        cache3 = ops.grouped_gemm(cache2, self._param("w2_weight"), sorted_ids, expert_ids,
                                  ntpp, 1, B, topk_weights, mul_gemm2, self._param("w2_bias"))
        if K == 1:  # one slot per row: the sum over K is the row itself
            return cache3
        return ops.moe_sum(cache3.reshape(M, K, c.hidden_size))

    def forward(self, hidden_states, router_logits):
        """[T, H], [T, E] -> [T, H] on this rank (the comm's array module)."""
        c, comm = self.config, self.comm
        xp = comm.xp
        x = self._as_input(hidden_states, "hidden_states")
        logits = self._as_input(router_logits, "router_logits")
        if x.shape[1] != c.hidden_size:
            raise ValueError(f"hidden_states: expected shape (T, {c.hidden_size}), "
                             f"got {tuple(x.shape)}")
        if np.dtype(x.dtype) != self.dtype:
            raise TypeError(f"hidden_states: expected dtype {self.dtype}, got {x.dtype}")
        if tuple(logits.shape) != (x.shape[0], c.num_experts):
            raise ValueError(f"router_logits: expected shape ({x.shape[0]}, {c.num_experts}), "
                             f"got {tuple(logits.shape)}")
        topk_weights, topk_ids = self.route(x, logits)
        if self.record_load:
            self.load.record(topk_ids)
        phys = self.placement.to_physical(topk_ids, comm.rank, xp,                # [T, K]
                                          maps=(self._map("logcnt"), self._map("log2phy")))
        if c.scheme == "allgather":
            return self._forward_allgather(x, topk_weights, phys)
        return self._forward_alltoall(x, topk_weights, phys)

    __call__ = forward

    def _map(self, name):
        """A placement map (logcnt, log2phy) in the communicator's array module, cached."""
        key = "placement_" + name
        if key not in self._dev:
            host = getattr(self.placement, name)
            self._dev[key] = host if self.comm.xp is np else self.comm.xp.asarray(host)
        return self._dev[key]

    def _expert_map(self):
        if "expert_map" not in self._dev:
            m = self.placement.expert_map(self.comm.rank)
            self._dev["expert_map"] = m if self.comm.xp is np or self.backend != "cupy" \
                else self.comm.xp.asarray(m)
        return self._dev["expert_map"]

    def _forward_allgather(self, x, topk_weights, phys):
        c, comm = self.config, self.comm
        x_all, w_all, ids_all, st = allgather_dispatch(comm, x, topk_weights, phys)
        partial = self.experts_forward(x_all, ids_all, w_all, c.num_physical,
                                       expert_map=self._expert_map(),
                                       mul_gemm1=c.apply_router_weight_on_input,
                                       mul_gemm2=not c.apply_router_weight_on_input)
        self.last_stats = {"scheme": "allgather", "tokens_per_rank": st.counts.tolist()}
        return allgather_combine(comm, partial, st)

    def _forward_alltoall(self, x, topk_weights, phys):
        c, comm = self.config, self.comm
        xp = comm.xp
        on_input = c.apply_router_weight_on_input
        if c.alltoall_rows == "token":
            # each token once per owning rank, with its K physical ids and weights: the owner
            # runs its local slots exactly as the all-gather scheme does (expert_map drops
            # the others) and returns one weighted partial row per token
            x_recv, ids_recv, w_recv, st = alltoall_dispatch(
                comm, self.ops, x, phys, self.experts_per_rank, topk_weights=topk_weights,
                rows="token")
            y = self.experts_forward(x_recv, ids_recv, w_recv, c.num_physical,
                                     expert_map=self._expert_map(), mul_gemm1=on_input,
                                     mul_gemm2=not on_input)
            combine_w = None
        else:
            x_recv, ids_recv, w_recv, st = alltoall_dispatch(
                comm, self.ops, x, phys, self.experts_per_rank,
                topk_weights=topk_weights if on_input else None, rows="slot")
            if on_input:  # the owner scales GEMM1 (vLLM's top-1 rule); the combine adds plainly
                y = self.experts_forward(x_recv, ids_recv.reshape(-1, 1), w_recv.reshape(-1, 1),
                                         self.experts_per_rank, mul_gemm1=True, mul_gemm2=False)
                combine_w = xp.ones(topk_weights.shape, dtype=xp.float32)
            else:  # unweighted expert rows; the weighted sum happens at the source
                y = self.experts_forward(x_recv, ids_recv.reshape(-1, 1), None,
                                         self.experts_per_rank, mul_gemm1=False, mul_gemm2=False)
                combine_w = topk_weights
        self.last_stats = {"scheme": "alltoall", "rows": c.alltoall_rows,
                           "rows_sent": st.send_counts.tolist(),
                           "rows_received": st.recv_counts.tolist(),
                           "rows_computed": int(x_recv.shape[0])}
        return alltoall_combine(comm, self.ops, y, st, combine_w)

    def with_scheme(self, scheme: str) -> "EPMoE":
        """A twin of this layer that shares its weights and placement but dispatches with
        `scheme` (checked across ranks like the config)."""
        import copy

        if scheme not in SCHEMES:
            raise ValueError(f"scheme: expected one of {list(SCHEMES)}, got {scheme!r}")
        self.comm.agree("EP layer scheme", {"scheme": scheme})
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, scheme=scheme)
        return other

    # ---- EPLB ---------------------------------------------------------------------------------
    def rebalance(self, load=None) -> ExpertPlacement:
        """Recompute the placement from the load (default: the recorded load summed over
        ranks, a collective) with reference.eplb, move the weights, reset the record."""
        c = self.config
        if load is None:
            load = self.load.global_load(self.comm)
        new = ExpertPlacement.rebalanced(np.asarray(load), c.num_physical,
                                         self.comm.world_size, c.eplb_num_groups,
                                         c.eplb_num_nodes)
        self.apply_placement(new)
        self.load.reset()
        return new

    def apply_placement(self, new: ExpertPlacement):
        """Move expert weights between ranks (grouped send/recv) so that slot p holds
        new.phys2log[p]; every rank computes the same plan (eplb_runtime.rearrange_plan)."""
        comm = self.comm
        self.comm.agree("EPLB placement", new.to_json())
        plan = rearrange_plan(self.placement, new)
        r = comm.rank
        xp = comm.xp
        for name in self.param_shapes():
            host = self._host(name)
            src = raw(host) if xp is np else xp.asarray(raw(host))     # [P_l, ...] bytes
            dst = xp.empty_like(src)
            for s, sj, d, dj in plan:  # local copies first, outside the group
                if s == d == r:
                    dst[dj] = src[sj]
            with comm._op("EPLB rearrange"), comm.group():
                for s, sj, d, dj in plan:  # the same order on every rank: pairs match up
                    if s == d:
                        continue
                    if s == r:
                        comm.send(src[sj], d)
                    elif d == r:
                        comm.recv(dst[dj], s)
            comm.synchronize()
            host[...] = np.asarray(comm.to_host(dst)).view(self.dtype)
        self.placement = new
        self._invalidate()

    def __repr__(self):
        c = self.config
        return (f"EPMoE(rank {self.comm.rank}/{self.comm.world_size}, E={c.num_experts}, "
                f"P={c.num_physical}, scheme={c.scheme}, placement={c.placement}, "
                f"dtype={c.dtype}, backend={self.backend!r}, local experts "
                f"{self.local_logical_experts().tolist()})")


def config_from_json(text: str) -> EPConfig:
    return EPConfig(**json.loads(text))
