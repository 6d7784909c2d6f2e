"""`FusedMoE`: one MoE layer whose six stages can each run on a different backend.

    T = tokens, E = global (real) experts, Z = zero experts, E_local = experts on this EP
    rank, K = top-k, H = hidden, I = intermediate size, I_p = I / tp_size, B = block size,
    P = T*K slots

The layer computes, for every token t (modelled on vLLM's FusedMoE, NumPy parameters):

    topk_weights, topk_ids = route(router_logits[t])                          # [T, K]
    out[t] = sum_k topk_weights[t, k] * (W2[e] @ act(W13[e] @ x[t] + b13[e]) + b2[e])
                                                                 (e = topk_ids[t, k])
             + zero_expert_result[t]              (zero experts: "identity" slots add w * x[t])
             + W2s @ act(W13s @ x[t])             (shared experts, every token)

as six stages, each through the backend the mapping assigns (`backend="torch"`, or
`{"route": "numba", "gemm1": "cupy"}`; stages left out use "reference"; the constructor's
argument, or `layer.backend = ...` at any time):

    route       select_experts          logits [T, E+Z] -> topk_weights f32, topk_ids [T, K]
    align       moe_align_block_size    topk_ids -> sorted_token_ids, expert_ids, num_post_padded
    gemm1       grouped_gemm            x [T, H] @ w13[e].T                    -> cache1 [P, 2I_p]
    activation  apply_activation        cache1                                -> cache2 [P, I_p]
    gemm2       grouped_gemm            cache2 @ w2[e].T (* router weight)     -> cache3 [P, H]
    combine     moe_sum                 cache3 [T, K, H] summed over K         -> out [T, H]
                                        (live slots only: not id -1, not off this rank)

Arrays move between backends only when the backend changes (sandbox.arrays.transfer: zero
copy between GPU libraries, through the host only when a host backend follows). The
shared experts run through the gemm1/activation/gemm2 backends as one expert that every
token visits with weight 1.

Parallelism (each rank holds a layer; the caller sums the ranks' outputs, i.e. all-reduces):
    tp_size > 1   w13 rows and w2 columns are this rank's slice of I; forward returns the
                  rank's partial sum. The down-projection bias and the zero-expert result
                  are added on tp_rank 0 only, so the sum over ranks counts them once.
    ep_size > 1   this rank holds E_local experts (expert_map: global -> local or -1);
                  forward returns the local experts' share. Zero-expert and shared-expert
                  outputs are added on ep_rank 0 only.

Block size: the alignment block B (= the GEMM's BLOCK_M) is the layer's `block_size` when
set, else the GEMM backend's `get_config(M, N, K, E, top_k, dtype)["BLOCK_M"]` when it has
one (cuda_kernels.cupy.grouped_gemm), else 64 (4 in the CUDA simulator); align and both
GEMMs get the same B.

Weights: w13 holds gate (checkpoint "w1") and up ("w3") one after the other, except for
swigluoai (gpt-oss), whose activation reads them interleaved (gate rows 0::2, up 1::2): the
weight loader puts w1 / w3 where the layer's activation reads them. Zero experts take router
columns E..E+Z-1 (router_logits is [T, E+Z]). Parameters are allocated filled with NaN: an
expert that was never loaded makes the output NaN instead of silently zero.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from . import arrays
from .registry import STAGES, get_backend, resolve_stage_mapping
from .streams import caller_stream

_FLOATS = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16),
           np.dtype(ml_dtypes.bfloat16))
_SHARDS = ("w1", "w2", "w3")

# checkpoint names of (gate, down, up) that load_weights knows without being told
KNOWN_CKPT_NAMES = (("gate_proj", "down_proj", "up_proj"),    # Qwen3-MoE, DeepSeek, Llama 4
                    ("w1", "w2", "w3"))                       # Mixtral

_ROUTED_RE = re.compile(r"(?:^|\.)experts\.(\d+)\.([A-Za-z0-9_]+)\.(weight|bias)$")
_SHARED_RE = re.compile(r"(?:^|\.)shared_experts?\.([A-Za-z0-9_]+)\.(weight|bias)$")


def _as_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str) and dtype.lower() in ("bf16", "bfloat16"):
        return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"params_dtype: expected float64, float32, float16 or bfloat16, "
                        f"got {dtype!r}") from None
    if dt not in _FLOATS:
        raise TypeError(f"params_dtype: expected float64, float32, float16 or bfloat16, got {dt}")
    return dt


def _int_arg(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


class _StageMapping(dict):
    """A layer's resolved {stage: backend}: a dict that refuses writes, so that a change
    goes through `FusedMoE.backend` (checked names, stale device copies dropped)."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("stage_backends: read-only; assign layer.backend = {stage: backend} "
                        "(or a backend name) to change the mapping")

    __setitem__ = __delitem__ = __ior__ = _refuse
    update = pop = popitem = clear = setdefault = _refuse

    def __reduce__(self):            # copy, deepcopy and pickle build it from a plain dict
        return type(self), (dict(self),)


_CHECKED_MAPPINGS: dict = {}    # stage -> backend names, checked once: {stage: Backend}
_AS_IS = object()               # a source that tells _call to pass the argument unmoved


@dataclass
class StageCall:
    """One stage as the layer ran it: what went in and what came out (for the harness)."""

    stage: str
    backend: str
    args: tuple
    kwargs: dict
    outputs: Any


@dataclass
class _Run:
    """Bookkeeping of one forward: which backend made each value, and the trace."""

    backends: dict
    trace: list | None = None
    sources: dict = field(default_factory=dict)


class FusedMoE:
    """A Mixture-of-Experts layer with vLLM's FusedMoE semantics and NumPy parameters.

    Parameters (NumPy, params_dtype, NaN until loaded):
        w13_weight  [E_local, 2*I_p, H]   gate rows then up rows (interleaved for swigluoai)
        w2_weight   [E_local, H, I_p]
        w13_bias    [E_local, 2*I_p]      (has_bias)
        w2_bias     [E_local, H]          (has_bias; added on tp_rank 0 only)
        e_score_correction_bias [E+Z] fp32 (given)
        shared_w13  [2*I_sp, H], shared_w2 [H, I_sp]   (n_shared_experts; I_s =
                    shared_intermediate_size or n_shared_experts * I, I_sp = I_s / tp_size)

    `backend`: a backend name or a {stage: backend} dict (see sandbox.registry); assigning
    `layer.backend` later takes effect at the next forward (`stage_backends` is the resolved,
    read-only mapping).
    `block_size`: the alignment block (= the GEMM's BLOCK_M); None asks the GEMM backend's
    `get_config`, else 64.
    A forward whose intermediates cannot fit where the stages keep them fails before the
    first stage (MemoryError naming T and the bytes; see _check_memory).
    """

    def __init__(self, num_experts, top_k, hidden_size, intermediate_size,
                 params_dtype=np.float32, renormalize=True, use_grouped_topk=False,
                 num_expert_group=None, topk_group=None, tp_size=1, tp_rank=0, ep_size=1,
                 ep_rank=0, custom_routing_function=None, scoring_func="softmax",
                 routed_scaling_factor=1.0, e_score_correction_bias=None,
                 apply_router_weight_on_input=False, activation="silu", is_act_and_mul=True,
                 has_bias=False, zero_expert_num=0, zero_expert_type=None,
                 n_shared_experts=None, shared_intermediate_size=None,
                 expert_placement="linear", backend="reference", block_size=None):
        from reference import ACTIVATIONS, PLACEMENTS, SCORING_FUNCS, determine_expert_map

        self._version = 0                # bumped by every load: device copies are stale
        self._device_params = {}
        self.num_experts = self.global_num_experts = _int_arg("num_experts", num_experts, 1)
        self.top_k = _int_arg("top_k", top_k, 1)
        self.hidden_size = _int_arg("hidden_size", hidden_size, 1)
        self.intermediate_size = _int_arg("intermediate_size", intermediate_size, 1)
        self.params_dtype = _as_dtype(params_dtype)
        self.renormalize = bool(renormalize)

        self.tp_size = _int_arg("tp_size", tp_size, 1)
        self.tp_rank = _int_arg("tp_rank", tp_rank, 0)
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank: expected a rank in [0, {self.tp_size}), got {tp_rank}")
        if self.intermediate_size % self.tp_size:
            raise ValueError(f"intermediate_size: expected a multiple of tp_size "
                             f"({self.tp_size}), got {intermediate_size}")
        self.intermediate_size_per_partition = self.intermediate_size // self.tp_size

        if expert_placement not in PLACEMENTS:
            raise ValueError(f"expert_placement: expected one of {list(PLACEMENTS)}, "
                             f"got {expert_placement!r}")
        self.ep_size = _int_arg("ep_size", ep_size, 1)
        self.ep_rank = _int_arg("ep_rank", ep_rank, 0)
        self.expert_placement = expert_placement
        self.local_num_experts, self.expert_map = determine_expert_map(
            self.ep_size, self.ep_rank, self.num_experts, expert_placement)
        if self.expert_map is None:
            self.local_to_global = np.arange(self.num_experts)
        else:
            self.local_to_global = np.flatnonzero(self.expert_map >= 0)[
                np.argsort(self.expert_map[self.expert_map >= 0])]

        self.zero_expert_num = _int_arg("zero_expert_num", zero_expert_num or 0, 0)
        if zero_expert_type not in (None, "identity"):
            raise ValueError(f"zero_expert_type: expected None or 'identity', "
                             f"got {zero_expert_type!r}")
        if self.zero_expert_num and zero_expert_type is None:
            raise ValueError("zero_expert_type: expected 'identity' when zero_expert_num > 0, "
                             "got None")
        self.zero_expert_type = zero_expert_type
        # the router scores real and zero experts alike
        self.num_router_experts = self.num_experts + self.zero_expert_num
        if self.top_k > self.num_router_experts:
            raise ValueError(f"top_k: expected at most the number of experts "
                             f"({self.num_router_experts}), got {top_k}")

        if scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func: expected one of {list(SCORING_FUNCS)}, "
                             f"got {scoring_func!r}")
        self.use_grouped_topk = bool(use_grouped_topk)
        if self.use_grouped_topk and (num_expert_group is None or topk_group is None):
            raise ValueError(f"use_grouped_topk: expected num_expert_group and topk_group, got "
                             f"num_expert_group={num_expert_group}, topk_group={topk_group}")
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.custom_routing_function = custom_routing_function
        self.scoring_func = scoring_func
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.e_score_correction_bias = None
        if e_score_correction_bias is not None:
            self.set_e_score_correction_bias(e_score_correction_bias)

        self.apply_router_weight_on_input = bool(apply_router_weight_on_input)
        if self.apply_router_weight_on_input and self.top_k != 1:
            raise ValueError(f"apply_router_weight_on_input: needs top_k == 1 (as vLLM), "
                             f"got top_k={top_k}")
        act = activation
        if isinstance(act, str) and act.endswith("_no_mul"):
            act, is_act_and_mul = act[: -len("_no_mul")], False
        if act not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {list(ACTIVATIONS)}, got {activation!r}")
        self.activation = act
        self.is_act_and_mul = bool(is_act_and_mul)
        if act == "swigluoai" and not self.is_act_and_mul:
            raise ValueError("activation: 'swigluoai' needs is_act_and_mul=True")
        if act == "relu2" and self.is_act_and_mul:
            raise ValueError("activation: 'relu2' has no gated form; pass is_act_and_mul=False")
        self.has_bias = bool(has_bias)

        if n_shared_experts is not None:
            n_shared_experts = _int_arg("n_shared_experts", n_shared_experts, 0) or None
        self.n_shared_experts = n_shared_experts
        self.shared_intermediate_size = None
        if n_shared_experts:
            i_s = shared_intermediate_size or n_shared_experts * self.intermediate_size
            i_s = _int_arg("shared_intermediate_size", i_s, 1)
            if i_s % self.tp_size:
                raise ValueError(f"shared_intermediate_size: expected a multiple of tp_size "
                                 f"({self.tp_size}), got {i_s}")
            self.shared_intermediate_size = i_s

        self.backend = backend           # checked and resolved by the property's setter
        self.block_size = (None if block_size is None
                           else _int_arg("block_size", block_size, 1))
        self.expert_mapping = None       # (param_name, weight_name, expert_id, shard_id) list
        self._allocate()

    # ------------------------------------------------------------------------- backends
    @property
    def backend(self):
        """The stage mapping as given: a backend name, or a {stage: backend} dict (stages
        left out run on "reference"). Assigning it takes effect at the next forward:

            layer.backend = {"route": "numba", "gemm1": "cupy"}

        The setter resolves the mapping through registry.resolve_stage_mapping (ValueError
        for an unknown stage or backend, TypeError for anything else; the layer is then left
        as it was) and drops the cached device copies of the parameters for backends no
        stage uses any more. Availability is checked on forward."""
        spec = self._backend_spec
        return dict(spec) if isinstance(spec, dict) else spec

    @backend.setter
    def backend(self, backend):
        mapping = resolve_stage_mapping(backend)          # raises before anything changes
        self._backend_spec = dict(backend) if isinstance(backend, Mapping) else backend
        self._stage_backends = _StageMapping(mapping)
        in_use = set(mapping.values())
        for key in [k for k in self._device_params if k[0] not in in_use]:
            del self._device_params[key]

    @property
    def stage_backends(self) -> dict:
        """{stage: backend name} for all six stages, resolved from `backend` (read-only;
        assigning a mapping here is the same as assigning `backend`)."""
        return self._stage_backends

    @stage_backends.setter
    def stage_backends(self, mapping):
        self.backend = mapping

    # ------------------------------------------------------------------------- parameters
    def _allocate(self):
        e, h, i_p = self.local_num_experts, self.hidden_size, self.intermediate_size_per_partition
        n13 = 2 * i_p if self.is_act_and_mul else i_p

        def nan(shape):
            return np.full(shape, np.nan, dtype=self.params_dtype)

        self.w13_weight = nan((e, n13, h))
        self.w2_weight = nan((e, h, i_p))
        self.w13_bias = nan((e, n13)) if self.has_bias else None
        self.w2_bias = nan((e, h)) if self.has_bias else None
        self.shared_w13 = self.shared_w2 = None
        if self.n_shared_experts:
            i_sp = self.shared_intermediate_size // self.tp_size
            self.shared_w13 = nan((2 * i_sp if self.is_act_and_mul else i_sp, h))
            self.shared_w2 = nan((h, i_sp))

    PARAM_NAMES = ("w13_weight", "w2_weight", "w13_bias", "w2_bias", "shared_w13", "shared_w2")

    def named_parameters(self):
        """(name, array) of every parameter this layer holds (None ones left out)."""
        out = [(n, getattr(self, n)) for n in self.PARAM_NAMES if getattr(self, n) is not None]
        if self.e_score_correction_bias is not None:
            out.append(("e_score_correction_bias", self.e_score_correction_bias))
        return out

    def set_e_score_correction_bias(self, bias):
        """Set the router's correction bias: [E + Z] floats, kept in fp32."""
        b = arrays.to_numpy(bias)
        b = np.asarray(b)
        if b.dtype not in _FLOATS:
            raise TypeError(f"e_score_correction_bias: expected a float array, got {b.dtype}")
        if b.shape != (self.num_router_experts,):
            raise ValueError(f"e_score_correction_bias: expected shape "
                             f"({self.num_router_experts},), got {b.shape}")
        self.e_score_correction_bias = b.astype(np.float32)
        self._version += 1

    def invalidate_device_cache(self):
        """Forget the device copies of the parameters. Loading through weight_loader /
        load_weights does this; call it after writing into a parameter array by hand."""
        self._version += 1
        self._device_params.clear()

    def _param_name(self, param) -> str:
        if param is None:
            raise ValueError("param: expected one of this layer's parameter arrays, got None "
                             "(a bias of a layer with has_bias=False, or no shared experts?)")
        if isinstance(param, str):
            if param not in self.PARAM_NAMES or getattr(self, param) is None:
                raise ValueError(f"param: expected one of "
                                 f"{[n for n, _ in self.named_parameters()]}, got {param!r}")
            return param
        for name in self.PARAM_NAMES:
            if getattr(self, name) is param:
                return name
        raise ValueError("param: expected one of this layer's parameter arrays "
                         f"({', '.join(n for n, _ in self.named_parameters())}), got "
                         f"{arrays.describe(param)}")

    def _local_expert(self, expert_id) -> int:
        e = _int_arg("expert_id", expert_id, 0)
        if e >= self.num_experts:
            raise ValueError(f"expert_id: expected a global expert id in [0, {self.num_experts}), "
                             f"got {expert_id}")
        return e if self.expert_map is None else int(self.expert_map[e])

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id) -> bool:
        """Copy one checkpoint tensor into its place in `param`, vLLM's rules.

        shard_id "w1" (gate) and "w3" (up) fill the two halves of w13 (for swigluoai the even
        and odd rows: its activation reads gate and up interleaved); "w2" is the down
        projection. Tensor parallelism narrows w1/w3 on their output dim (rows
        [tp_rank*I_p, (tp_rank+1)*I_p) of the full [I, H]) and w2 on its input dim (columns of
        [H, I]). Biases ("bias" in weight_name) follow their weight; the w2 bias is not
        narrowed (forward adds it on tp_rank 0 only). A 3-D tensor ([E, ...], 2-D for a
        bias) loads every expert at once, taking this rank's experts from it.

        expert_id is global: an expert on another EP rank is skipped (returns False).
        Floats are cast to params_dtype. A wrong shard_id, shape or dtype raises ValueError
        naming weight_name, the expected shape and the shape that came.
        Shared experts: pass `shared_w13` / `shared_w2` as `param` (expert_id is ignored).
        """
        if shard_id not in _SHARDS:
            raise ValueError(f"{weight_name}: shard_id must be one of {list(_SHARDS)}, "
                             f"got {shard_id!r}")
        name = self._param_name(param)
        param = getattr(self, name)
        loaded = np.asarray(arrays.to_numpy(loaded_weight))
        if loaded.dtype not in _FLOATS:
            raise ValueError(f"{weight_name}: expected a floating tensor (cast to "
                             f"{self.params_dtype}), got dtype {loaded.dtype}")
        is_bias = "bias" in weight_name
        if is_bias != name.endswith("bias"):
            raise ValueError(f"{weight_name}: a {'bias' if is_bias else 'weight'} cannot load "
                             f"into {name}")
        is_w13 = name in ("w13_weight", "w13_bias", "shared_w13")
        if is_w13 == (shard_id == "w2"):
            raise ValueError(f"{weight_name}: shard_id {shard_id!r} does not load into {name} "
                             f"(w1/w3 go to w13, w2 to w2)")
        if shard_id == "w3" and not self.is_act_and_mul:
            raise ValueError(f"{weight_name}: shard_id 'w3' (up) has no place without "
                             f"is_act_and_mul")
        shared = name.startswith("shared")
        i_full = self.shared_intermediate_size if shared else self.intermediate_size
        i_p = i_full // self.tp_size
        h = self.hidden_size

        # the shape of ONE expert's tensor in the checkpoint (before TP narrowing)
        if shard_id == "w2":
            one = (h,) if is_bias else (h, i_full)
        else:
            one = (i_full,) if is_bias else (i_full, h)
        full = (not shared) and loaded.ndim == len(one) + 1
        want = ((self.num_experts,) + one) if full else one
        if loaded.shape != want:
            what = "all experts" if full else ("shared experts" if shared
                                               else f"expert {expert_id}")
            raise ValueError(f"{weight_name}: expected shape {want} for shard {shard_id} of "
                             f"{what}, got {loaded.shape}")

        if full:
            loaded = loaded[self.local_to_global]                    # [E_local, ...]
            dest = param
        elif shared:
            dest = param
        else:
            local = self._local_expert(expert_id)
            if local < 0:
                return False                                         # lives on another rank
            dest = param[local]

        # TP narrowing: the intermediate dim is the last-but-one of w1/w3 weights and the
        # last of w1/w3 biases and w2 weights; the w2 bias has none.
        r = self.tp_rank
        if shard_id == "w2":
            src = loaded if is_bias else loaded[..., r * i_p:(r + 1) * i_p]
        elif is_bias:
            src = loaded[..., r * i_p:(r + 1) * i_p]
        else:
            src = loaded[..., r * i_p:(r + 1) * i_p, :]

        if shard_id == "w2":
            dest[...] = src.astype(self.params_dtype)
        else:
            if self.activation == "swigluoai":
                rows = slice(0, 2 * i_p, 2) if shard_id == "w1" else slice(1, 2 * i_p, 2)
            elif not self.is_act_and_mul:
                rows = slice(0, i_p)
            else:
                rows = slice(0, i_p) if shard_id == "w1" else slice(i_p, 2 * i_p)
            if is_bias:
                dest[..., rows] = src.astype(self.params_dtype)
            else:
                dest[..., rows, :] = src.astype(self.params_dtype)
        self.invalidate_device_cache()
        return True

    @classmethod
    def make_expert_params_mapping(cls, ckpt_gate_proj_name, ckpt_down_proj_name,
                                   ckpt_up_proj_name, num_experts):
        """[(param_name, weight_name, expert_id, shard_id)] as vLLM: param_name is
        "experts.w13_" (gate, up) or "experts.w2_" (down); weight_name is
        f"experts.{e}.{ckpt_name}."; shard_id "w1" gate, "w2" down, "w3" up."""
        return [
            ("experts.w13_" if ckpt in (ckpt_gate_proj_name, ckpt_up_proj_name) else "experts.w2_",
             f"experts.{e}.{ckpt}.", e, shard)
            for e in range(num_experts)
            for shard, ckpt in (("w1", ckpt_gate_proj_name), ("w2", ckpt_down_proj_name),
                                ("w3", ckpt_up_proj_name))
        ]

    def _mapping_index(self):
        mapping = self.expert_mapping
        if mapping is None:
            mapping = [m for names in KNOWN_CKPT_NAMES
                       for m in self.make_expert_params_mapping(*names, self.num_experts)]
        return {weight_name: (param_name, expert_id, shard)
                for param_name, weight_name, expert_id, shard in mapping}

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load (name, tensor) pairs from a checkpoint; returns the names loaded into this rank.

        Routed experts: names ending in "experts.<e>.<ckpt>.weight" (or ".bias"), with
        <ckpt> from `self.expert_mapping` (make_expert_params_mapping's list) or, when that
        is None, the Mixtral (w1/w2/w3) and Qwen/DeepSeek (gate_proj/down_proj/up_proj)
        names. Shared experts: "shared_experts.<ckpt>.weight". The router's correction
        bias: a name ending in "e_score_correction_bias". Names of experts on other EP ranks,
        and names it does not recognise, are left out of the returned set.
        """
        index = self._mapping_index()
        shard_of = {}                     # ckpt name -> shard, for the shared experts
        for weight_name, (_, _, shard) in index.items():
            shard_of[weight_name.split(".")[2]] = shard
        loaded = set()
        for name, tensor in weights:
            if name.endswith("e_score_correction_bias"):
                self.set_e_score_correction_bias(tensor)
                loaded.add(name)
                continue
            m = _ROUTED_RE.search(name)
            if m is not None:
                e, ckpt, kind = int(m.group(1)), m.group(2), m.group(3)
                entry = index.get(f"experts.{e}.{ckpt}.")
                if entry is None:
                    continue
                param_prefix, expert_id, shard = entry
                if kind == "bias" and not self.has_bias:
                    raise ValueError(f"{name}: a bias, but the layer has has_bias=False")
                attr = param_prefix.split("experts.")[1] + kind              # w13_weight ...
                if self.weight_loader(getattr(self, attr), tensor, name, shard, expert_id):
                    loaded.add(name)
                continue
            m = _SHARED_RE.search(name)
            if m is not None and self.n_shared_experts and m.group(2) == "weight":
                shard = shard_of.get(m.group(1))
                if shard is None:
                    continue
                param = self.shared_w2 if shard == "w2" else self.shared_w13
                if self.weight_loader(param, tensor, name, shard, None):
                    loaded.add(name)
        return loaded

    def unloaded(self) -> list[str]:
        """Parameters (per local expert) that are still entirely NaN, i.e. never loaded."""
        out = []
        for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
            p = getattr(self, name)
            if p is None:
                continue
            for local in range(p.shape[0]):
                if np.isnan(p[local].astype(np.float32)).all():
                    out.append(f"{name}[expert {int(self.local_to_global[local])}]")
        for name in ("shared_w13", "shared_w2"):
            p = getattr(self, name)
            if p is not None and np.isnan(p.astype(np.float32)).all():
                out.append(name)
        return out

    # ------------------------------------------------------------------------- construction
    @classmethod
    def from_safetensors(cls, path, layer_idx, **overrides):
        """One MoE layer of a safetensors checkpoint (see sandbox.checkpoint.load_fused_moe)."""
        from .checkpoint import load_fused_moe

        return load_fused_moe(path, layer_idx, **overrides)

    @classmethod
    def random(cls, seed=0, **kwargs):
        """A layer with random weights: normal / sqrt(fan_in), biases normal * 0.1.

        The full (unsharded) tensors are drawn from `seed` in a fixed order and then loaded
        through weight_loader, so ranks built with the same seed and different
        tp_rank / ep_rank hold the shards of one model. Defaults: E=8, K=2, H=64, I=96.
        """
        kwargs = {"num_experts": 8, "top_k": 2, "hidden_size": 64, "intermediate_size": 96,
                  **kwargs}
        layer = cls(**kwargs)
        rng = np.random.default_rng(seed)
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size

        def normal(shape, scale):
            return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))

        w1 = normal((e, i, h), 1 / math.sqrt(h))
        w3 = normal((e, i, h), 1 / math.sqrt(h)) if layer.is_act_and_mul else None
        w2 = normal((e, h, i), 1 / math.sqrt(i))
        layer.weight_loader(layer.w13_weight, w1, "experts.w1.weight", "w1", 0)
        if w3 is not None:
            layer.weight_loader(layer.w13_weight, w3, "experts.w3.weight", "w3", 0)
        layer.weight_loader(layer.w2_weight, w2, "experts.w2.weight", "w2", 0)
        if layer.has_bias:
            b1 = normal((e, i), 0.1)
            b3 = normal((e, i), 0.1) if layer.is_act_and_mul else None
            b2 = normal((e, h), 0.1)
            layer.weight_loader(layer.w13_bias, b1, "experts.w1.bias", "w1", 0)
            if b3 is not None:
                layer.weight_loader(layer.w13_bias, b3, "experts.w3.bias", "w3", 0)
            layer.weight_loader(layer.w2_bias, b2, "experts.w2.bias", "w2", 0)
        if layer.n_shared_experts:
            i_s = layer.shared_intermediate_size
            layer.weight_loader(layer.shared_w13, normal((i_s, h), 1 / math.sqrt(h)),
                                "shared_experts.gate_proj.weight", "w1", None)
            if layer.is_act_and_mul:
                layer.weight_loader(layer.shared_w13, normal((i_s, h), 1 / math.sqrt(h)),
                                    "shared_experts.up_proj.weight", "w3", None)
            layer.weight_loader(layer.shared_w2, normal((h, i_s), 1 / math.sqrt(i_s)),
                                "shared_experts.down_proj.weight", "w2", None)
        return layer

    def random_inputs(self, num_tokens, seed=0, logit_scale=1.0):
        """(hidden_states [T, H] params_dtype, router_logits [T, E+Z] fp32), standard normal."""
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((num_tokens, self.hidden_size), dtype=np.float32)
        logits = rng.standard_normal((num_tokens, self.num_router_experts), dtype=np.float32)
        return x.astype(self.params_dtype), logits * np.float32(logit_scale)

    def to_dtype(self, dtype) -> FusedMoE:
        """A copy of the layer with every parameter cast to `dtype` (the router bias stays fp32)."""
        dt = _as_dtype(dtype)
        other = copy.copy(self)
        other.params_dtype = dt
        for name in self.PARAM_NAMES:
            p = getattr(self, name)
            setattr(other, name, None if p is None else p.astype(dt))
        other._device_params = {}
        other._version = self._version + 1
        return other

    def with_backend(self, backend) -> FusedMoE:
        """A shallow copy of the layer (sharing the parameters) with another stage mapping
        (set through the `backend` property: the same checks); its device copies start
        empty."""
        other = copy.copy(self)
        other._device_params = {}
        other.backend = backend
        return other

    def __repr__(self):
        parts = [f"E={self.num_experts}", f"K={self.top_k}", f"H={self.hidden_size}",
                 f"I={self.intermediate_size}", f"dtype={self.params_dtype}",
                 f"activation={self.activation}"]
        if self.tp_size > 1:
            parts.append(f"tp={self.tp_rank}/{self.tp_size}")
        if self.ep_size > 1:
            parts.append(f"ep={self.ep_rank}/{self.ep_size} ({self.expert_placement}, "
                         f"{self.local_num_experts} local)")
        if self.zero_expert_num:
            parts.append(f"zero_experts={self.zero_expert_num}")
        if self.n_shared_experts:
            parts.append(f"shared={self.n_shared_experts}")
        if self.has_bias:
            parts.append("bias")
        parts.append(f"backend={self._backend_spec!r}")
        return "FusedMoE(" + ", ".join(parts) + ")"

    # ------------------------------------------------------------------------- forward
    def select_experts(self, hidden_states, router_logits):
        """The route stage on the layer's route backend, results as NumPy:
        (topk_weights f32 [T, K], topk_ids int32 [T, K], zero_expert_result [T, H] or None)."""
        run = self._start(self.stage_backends, trace=None)
        x, logits = self._inputs(hidden_states, router_logits, exact=False)
        with caller_stream(hidden_states, router_logits):
            out = self._route(run, x, logits, exact=False)
        b = run.backends["route"]
        return tuple(None if v is None else b.get(v) for v in out)

    def forward(self, hidden_states, router_logits, *, return_device=False):
        """The layer: [T, H] -> [T, H] (see the module docstring for the math).

        hidden_states: NumPy (cast to params_dtype) or a device array of params_dtype;
        router_logits [T, E+Z] any float dtype. Returns NumPy, or with return_device=True
        a device array without a copy to the host: of hidden_states' library when that is a
        GPU array (torch in, torch out; a zero-copy view), else the combine backend's own.
        With tp_size > 1 / ep_size > 1 this is the rank's partial output.
        """
        run = self._start(self.stage_backends, trace=None)
        with caller_stream(hidden_states, router_logits):
            out = self._forward(run, hidden_states, router_logits, exact=False)
        if return_device:
            if arrays.is_device(hidden_states) and arrays.kind(out) != arrays.kind(hidden_states):
                view = arrays.zero_copy(out, arrays.kind(hidden_states))
                return out if view is None else view
            return out
        return run.backends["combine"].get(out)

    __call__ = forward

    def run_stages(self, hidden_states, router_logits, backend=None, *, exact=False,
                   block_size=None):
        """Forward with a stage trace: (out as NumPy, [StageCall, ...] of the six stages).

        `backend` overrides the layer's mapping; `exact=True` runs the reference on float64
        copies of the inputs and parameters (every stage must then be "reference");
        `block_size` overrides the alignment block for this call.
        """
        mapping = self.stage_backends if backend is None else resolve_stage_mapping(backend)
        if exact and set(mapping.values()) != {"reference"}:
            raise ValueError(f"exact: runs on the reference only, got the mapping {mapping}")
        run = self._start(mapping, trace=[])
        with caller_stream(hidden_states, router_logits):
            out = self._forward(run, hidden_states, router_logits, exact=exact,
                                block=block_size)
        return run.backends["combine"].get(out), run.trace

    # --- internals
    def _start(self, mapping, trace):
        # the checks below depend on the mapping only: done once per mapping (a decode step
        # pays the host time of every forward)
        key = tuple(mapping[stage] for stage in STAGES)
        backends = _CHECKED_MAPPINGS.get(key)
        if backends is not None and any(get_backend(n) is not backends[s]
                                        for n, s in zip(key, STAGES)):
            backends = None                 # the registry was reset (registry.clear_cache)
        if backends is None:
            backends = {}
            for stage in STAGES:
                b = get_backend(mapping[stage])
                if not b.ok:
                    raise RuntimeError(f"backend {b.name!r} (stage {stage!r}) is not available "
                                       f"here: {b.reason}")
                b.stage_fn(stage)           # NotImplementedError now rather than mid-forward
                backends[stage] = b
            _CHECKED_MAPPINGS[key] = backends
        return _Run(dict(backends), trace)

    def _inputs(self, hidden_states, router_logits, exact):
        for name, v in (("hidden_states", hidden_states), ("router_logits", router_logits)):
            if not (hasattr(v, "shape") and hasattr(v, "dtype")):
                raise TypeError(f"{name}: expected an array, got {type(v).__name__}")
            if len(v.shape) != 2:
                raise ValueError(f"{name}: expected 2 dimensions, got shape {tuple(v.shape)}")
            if arrays.dtype_of(v) not in _FLOATS:
                raise TypeError(f"{name}: expected a float dtype, got {arrays.dtype_of(v)}")
        t, h = hidden_states.shape
        if h != self.hidden_size:
            raise ValueError(f"hidden_states: expected shape (T, {self.hidden_size}), "
                             f"got {tuple(hidden_states.shape)}")
        if tuple(router_logits.shape) != (t, self.num_router_experts):
            raise ValueError(f"router_logits: expected shape ({t}, {self.num_router_experts}) "
                             f"(T, experts{' + zero experts' if self.zero_expert_num else ''}), "
                             f"got {tuple(router_logits.shape)}")
        want = np.dtype(np.float64) if exact else self.params_dtype
        if arrays.kind(hidden_states) == "numpy":
            hidden_states = hidden_states.astype(want, copy=False)
        elif exact:
            hidden_states = arrays.to_numpy(hidden_states).astype(want)
        elif arrays.dtype_of(hidden_states) != want:
            raise TypeError(f"hidden_states: expected dtype {want} (params_dtype) for a device "
                            f"array, got {arrays.dtype_of(hidden_states)}")
        if exact and arrays.kind(router_logits) != "numpy":
            router_logits = arrays.to_numpy(router_logits)
        return hidden_states, router_logits

    def _check_memory(self, run, num_tokens, exact):
        """MemoryError naming T and the bytes, before any stage, when the intermediates
        cannot fit: gemm1's [P, N1], the activation's [P, I_p] and gemm2's [P, H] (P = T*K),
        each counted where the backend that makes it keeps its arrays: host memory for a
        host backend (at least fp32: the reference computes there before it rounds), the
        backend's free device memory for a GPU backend (params_dtype). A lower bound of the
        peak, so it refuses only what cannot fit; free below _checks.CHECK_ABOVE_BYTES."""
        from reference._checks import check_working_set

        dtype = np.dtype(np.float64) if exact else self.params_dtype
        widths = (("gemm1", self.w13_weight.shape[1]),
                  ("activation", self.intermediate_size_per_partition),
                  ("gemm2", self.hidden_size))
        pools = {}                        # where -> (backend, bytes, shapes)
        for stage, width in widths:
            b = run.backends[stage]
            host = b.is_host
            item = max(dtype.itemsize, 4) if host else dtype.itemsize
            where = "host memory" if host else f"{b.name} device memory"
            _, nbytes, shapes = pools.get(where, (b, 0, []))
            pools[where] = (b, nbytes + num_tokens * self.top_k * width * item,
                            shapes + [f"[T*K, {width}]"])
        for where, (b, nbytes, shapes) in pools.items():
            what = f"intermediates ({' + '.join(shapes)}, K={self.top_k})"
            check_working_set(num_tokens, nbytes, what, where,
                              available=None if where == "host memory" else b.free_memory)

    def _source(self, x):
        """The backend an input array belongs to."""
        k = arrays.kind(x)
        name = {"torch": "torch", "cupy": "cupy", "numba": "numba"}.get(k, "reference")
        return get_backend(name)

    def _param(self, name, backend, exact):
        """A parameter as `backend` reads it (float64 copies when exact; GPU copies cached)."""
        p = getattr(self, name)
        if p is None:
            return None
        if name.startswith("shared"):
            p = p[None]                   # one expert: [1, N, Kdim] for grouped_gemm
        if exact:
            return p.astype(np.float64)
        if backend.is_host:
            return backend.put(p)
        key = (backend.name, name)
        hit = self._device_params.get(key)
        if hit is not None and hit[0] == self._version and hit[1] is getattr(self, name):
            return hit[2]
        dev = backend.put(p)
        self._device_params[key] = (self._version, getattr(self, name), dev)
        return dev

    def _constant(self, name, value, backend):
        """A host constant of the layer (the router's correction bias, the expert map) as
        `backend` reads it, copied to a device once per load instead of at every call (a
        copy from the host inside a CUDA graph capture would fail)."""
        if value is None or backend.is_host:
            return value
        key = (backend.name, name)
        hit = self._device_params.get(key)
        if hit is not None and hit[0] == self._version and hit[1] is value:
            return hit[2]
        dev = arrays.transfer(value, get_backend("reference"), backend)
        self._device_params[key] = (self._version, value, dev)
        return dev

    def _call(self, run, stage, args, kwargs, sources, trace=True):
        """Run `stage` on its backend: move the arguments there, call, remember the outputs."""
        b = run.backends[stage]
        moved = tuple(a if src is _AS_IS else arrays.transfer(a, src, b)
                      for a, src in zip(args, sources))
        out = b.stage_fn(stage)(*moved, **kwargs)
        if trace and run.trace is not None:
            run.trace.append(StageCall(stage, b.name, moved, dict(kwargs), out))
        return out

    def _block(self, mapping, num_tokens):
        """block_size: the layer's, else the GEMM backend's config (BLOCK_M), else the
        backends' default (64; smaller in the CUDA simulator)."""
        if self.block_size is not None:
            return self.block_size
        for stage, n in (("gemm1", self.w13_weight.shape[1]), ("gemm2", self.hidden_size)):
            b = get_backend(mapping[stage])
            k = self.hidden_size if stage == "gemm1" else self.intermediate_size_per_partition
            try:
                cfg = b.gemm_config(num_tokens, n, k, self.local_num_experts, self.top_k,
                                    self.params_dtype)
            except Exception:   # a config table that cannot answer: fall back, don't fail
                cfg = None
            if cfg and cfg.get("BLOCK_M"):
                return int(cfg["BLOCK_M"])
        return min(get_backend(mapping[s]).default_block_size for s in STAGES)

    def block_size_for(self, backend, num_tokens) -> int:
        """The block_size a forward with `backend` (a name or mapping) uses for T tokens."""
        return self._block(resolve_stage_mapping(backend), num_tokens)

    def _route(self, run, x, logits, exact):
        b = run.backends["route"]
        bias = self.e_score_correction_bias
        kwargs = dict(topk_group=self.topk_group, num_expert_group=self.num_expert_group,
                      custom_routing_function=self.custom_routing_function,
                      scoring_func=self.scoring_func,
                      routed_scaling_factor=self.routed_scaling_factor,
                      e_score_correction_bias=self._constant("e_score_correction_bias",
                                                             bias, b),
                      global_num_experts=self.num_experts,
                      zero_expert_num=self.zero_expert_num,
                      zero_expert_type=self.zero_expert_type)
        # hidden_states only gives the routing its row count on a GPU backend (zero experts,
        # which read it, run on the host): it is not moved there
        src_x = _AS_IS if (not b.is_host and not self.zero_expert_num) else self._source(x)
        return self._call(run, "route",
                          (x, logits, self.top_k, self.use_grouped_topk, self.renormalize),
                          kwargs, (src_x, self._source(logits), None, None, None))

    def _forward(self, run, hidden_states, router_logits, exact, block=None):
        x, logits = self._inputs(hidden_states, router_logits, exact)
        t = x.shape[0]
        self._check_memory(run, t, exact)
        bk = run.backends
        if block is None:
            block = self._block({s: b.name for s, b in bk.items()}, t)
        src_x = self._source(x)

        topk_weights, topk_ids, zero_result = self._route(run, x, logits, exact)
        fused = None if exact or run.trace is not None else self._fused_experts(bk)
        if fused is not None:
            # the experts in one call of the backend's fused_experts: the same kernels as the
            # stages below, launched from a plan cached per shape (host time of a decode step)
            out = fused(x if arrays.is_device(x) else arrays.transfer(x, src_x, bk["gemm1"]),
                        self._param("w13_weight", bk["gemm1"], exact),
                        self._param("w2_weight", bk["gemm2"], exact),
                        topk_weights, topk_ids, self.activation,
                        self.apply_router_weight_on_input, block_size=block,
                        expert_map=self._constant("expert_map", self.expert_map, bk["align"]))
            return self._extras(run, out, x, src_x, zero_result, block, exact)
        sorted_ids, expert_ids, ntpp = self._call(
            run, "align", (topk_ids, block, self.num_experts),
            {"expert_map": self._constant("expert_map", self.expert_map, bk["align"])},
            (bk["route"], None, None))
        align_src = (bk["align"],) * 3
        cache1 = self._call(
            run, "gemm1",
            (x, self._param("w13_weight", bk["gemm1"], exact), sorted_ids, expert_ids, ntpp,
             self.top_k, block, topk_weights, self.apply_router_weight_on_input,
             self._param("w13_bias", bk["gemm1"], exact)),
            {}, (src_x, bk["gemm1"]) + align_src + (None, None, bk["route"], None, bk["gemm1"]))
        cache2 = self._call(run, "activation", (cache1, self.activation, self.is_act_and_mul),
                            {}, (bk["gemm1"], None, None))
        w2_bias = self._param("w2_bias", bk["gemm2"], exact) if self.tp_rank == 0 else None
        cache3 = self._call(
            run, "gemm2",
            (cache2, self._param("w2_weight", bk["gemm2"], exact), sorted_ids, expert_ids, ntpp,
             1, block, topk_weights, not self.apply_router_weight_on_input, w2_bias),
            {}, (bk["activation"], bk["gemm2"]) + align_src
            + (None, None, bk["route"], None, bk["gemm2"]))
        cache3 = arrays.transfer(cache3, bk["gemm2"], bk["combine"])
        cache3 = cache3.reshape(t, self.top_k, self.hidden_size)               # [T, K, H]
        out = self._call(   # a slot routed nowhere (id -1, or off this rank) adds nothing
            run, "combine", (cache3, topk_ids),
            {"expert_map": self._constant("expert_map", self.expert_map, bk["combine"])},
            (bk["combine"], bk["route"]))
        return self._extras(run, out, x, src_x, zero_result, block, exact)

    def _fused_experts(self, bk):
        """The backend's `fused_experts` when one backend runs align .. combine and has one
        for this layer (gated silu / gelu, no biases, a half dtype), else None."""
        names = {bk[s].name for s in ("align", "gemm1", "activation", "gemm2", "combine")}
        if len(names) != 1 or self.has_bias or not self.is_act_and_mul:
            return None
        b = bk["gemm1"]
        if b.is_host or self.params_dtype not in (np.dtype(np.float16), arrays.BF16):
            return None
        fn = getattr(b.module, "fused_experts", None)
        if fn is None or self.activation not in getattr(fn, "activations", ()):
            return None
        return fn

    def _extras(self, run, out, x, src_x, zero_result, block, exact):
        """The zero experts' and the shared experts' outputs added to the routed ones."""
        bk = run.backends
        extras = []
        if zero_result is not None and self.tp_rank == 0 and self.ep_rank == 0:
            extras.append((zero_result, bk["route"]))
        if self.n_shared_experts and self.ep_rank == 0:
            extras.append((self._shared(run, x, src_x, block, exact), bk["gemm2"]))
        if extras:
            out = self._accumulate(out, bk["combine"], extras)
        return out

    def _shared(self, run, x, src_x, block, exact):
        """The shared experts: one expert (w13 [1, 2I_s, H], w2 [1, H, I_s]) every token
        visits with weight 1, through the gemm1 / activation / gemm2 backends."""
        from reference import moe_align_block_size

        bk = run.backends
        t = x.shape[0]
        ref = get_backend("reference")
        align = moe_align_block_size(np.zeros((t, 1), np.int32), block, 1)   # host, trivial
        w13 = self._param("shared_w13", bk["gemm1"], exact)                  # [1, 2I_s, H]
        w2 = self._param("shared_w2", bk["gemm2"], exact)                    # [1, H, I_s]
        s1 = self._call(run, "gemm1", (x, w13) + align + (1, block, None, False, None), {},
                        (src_x, bk["gemm1"], ref, ref, ref, None, None, None, None, None),
                        trace=False)
        s2 = self._call(run, "activation", (s1, self.activation, self.is_act_and_mul), {},
                        (bk["gemm1"], None, None), trace=False)
        return self._call(run, "gemm2", (s2, w2) + align + (1, block, None, False, None), {},
                          (bk["activation"], bk["gemm2"], ref, ref, ref, None, None, None,
                           None, None), trace=False)

    def _accumulate(self, out, backend, extras):
        """out + sum(extras), summed in fp32 (fp64 for fp64) and rounded once to out's dtype."""
        kind = arrays.kind(out)
        if kind == "torch":
            import torch

            cdt = torch.float64 if out.dtype == torch.float64 else torch.float32
            acc = out.to(cdt)
            for v, src in extras:
                acc = acc + arrays.transfer(v, src, backend).to(cdt)
            return acc.to(out.dtype)
        # NumPy, or a GPU array library without a dependable bf16 arithmetic: on the host
        host = backend.get(out)
        cdt = np.float64 if host.dtype == np.float64 else np.float32
        acc = host.astype(cdt)
        for v, src in extras:
            acc = acc + src.get(v).astype(cdt)
        acc = acc.astype(host.dtype)
        return acc if kind == "numpy" else backend.put(acc)
