"""`MoEWeights`: the parameters of one MoE layer and how a checkpoint fills them, vLLM's way.

    E = global (real) experts, Z = zero experts, E_local = experts on this EP rank,
    H = hidden, I = intermediate size, I_p = I / tp_size, I_s = shared-expert
    intermediate size, I_sp = I_s / tp_size

Parameters (NumPy, params_dtype, allocated filled with NaN: an expert that was never loaded
makes a forward NaN instead of silently zero):

    w13_weight  [E_local, 2*I_p, H]   gate rows then up rows (interleaved for swigluoai)
    w2_weight   [E_local, H, I_p]
    w13_bias    [E_local, 2*I_p]      (has_bias)
    w2_bias     [E_local, H]          (has_bias)
    shared_w13  [2*I_sp, H], shared_w2 [H, I_sp]      (n_shared_experts)
    e_score_correction_bias [E+Z] fp32                  (the router's, when given or loaded)
    router_weight [E, H], router_bias [E]               (a checkpoint's router, else None)

w13 holds gate (checkpoint "w1") and up ("w3") one after the other, except for swigluoai
(gpt-oss), whose activation reads them interleaved (gate rows 0::2, up 1::2): the layout
follows the activation, so the weights know it. Without a gate (`is_act_and_mul=False`)
w13 is the up projection alone ([E_local, I_p, H]).

Sharding:
    tp_size > 1   w13 rows and w2 columns are this rank's slice of I (rows
                  [tp_rank*I_p, (tp_rank+1)*I_p) of each checkpoint tensor's I axis)
    ep_size > 1   this rank holds E_local experts: expert_map [E] (global -> local, or -1
                  off this rank; reference.determine_expert_map with `expert_placement`)
                  and local_to_global [E_local]

Loading, with vLLM's names:
    weight_loader(param, loaded_weight, weight_name, shard_id, expert_id)   one tensor
    load_weights(((name, tensor), ...)) -> the names loaded into this rank   a stream
    make_expert_params_mapping(gate, down, up, num_experts)                 the names known
    from_safetensors(path, layer_idx)     one layer of a Hugging Face checkpoint, weights
                                          only, no pipeline (sandbox/checkpoint.py)
    load_random(seed)                     random weights, the same model on every rank

Device copies: `param_for(name, backend)` / `constant_for(name, value, backend)` hand a
parameter (or a host constant: the correction bias, the expert map) to a backend as its
stages read it, copied to a GPU once per load: every load bumps a version, so a stale copy
is never read.

`FusedMoE` (sandbox/layer.py) is a MoEWeights with a router and the stage pipeline; EPMoE
(sandbox/ep/layer.py) keeps its host weights in one.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable
from typing import Any

import ml_dtypes
import numpy as np

from . import arrays, checkpoint

FLOAT_DTYPES = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16),
                np.dtype(ml_dtypes.bfloat16))
_SHARDS = ("w1", "w2", "w3")

# the constructor's arguments: what a checkpoint's layer arguments give the weights alone
WEIGHT_ARGS = ("num_experts", "hidden_size", "intermediate_size", "params_dtype", "tp_size",
               "tp_rank", "ep_size", "ep_rank", "expert_placement", "activation",
               "is_act_and_mul", "has_bias", "zero_expert_num", "n_shared_experts",
               "shared_intermediate_size", "e_score_correction_bias", "quant_config")

# checkpoint names of (gate, down, up) that load_weights knows without being told
KNOWN_CKPT_NAMES = (("gate_proj", "down_proj", "up_proj"),    # Qwen3-MoE, DeepSeek, Llama 4
                    ("w1", "w2", "w3"))                       # Mixtral

_ROUTED_RE = re.compile(r"(?:^|\.)experts\.(\d+)\.([A-Za-z0-9_]+)\.(weight|bias)$")
_SHARED_RE = re.compile(r"(?:^|\.)shared_experts?\.([A-Za-z0-9_]+)\.(weight|bias)$")


def as_float_dtype(dtype) -> np.dtype:
    """params_dtype as a NumPy dtype: float64, float32, float16 or bfloat16 ("bf16" too)."""
    if isinstance(dtype, str) and dtype.lower() in ("bf16", "bfloat16"):
        return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"params_dtype: expected float64, float32, float16 or bfloat16, "
                        f"got {dtype!r}") from None
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"params_dtype: expected float64, float32, float16 or bfloat16, got {dt}")
    return dt


def int_arg(name, value, minimum):
    """`value` as an int >= minimum (TypeError / ValueError naming the argument)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


class MoEWeights:
    """The parameters of one MoE layer, sharded for (tp_rank, ep_rank), and their loaders
    (see the module docstring). Arguments as FusedMoE's of the same names."""

    PARAM_NAMES = ("w13_weight", "w2_weight", "w13_bias", "w2_bias", "shared_w13", "shared_w2")
    # a quantized layer's scales, zero points and static activation scales (sandbox/quant.py)
    QUANT_PARAM_NAMES = ("w13_weight_scale", "w2_weight_scale", "w13_weight_zero_point",
                         "w2_weight_zero_point", "w13_input_scale", "w2_input_scale")

    def __init__(self, num_experts, hidden_size, intermediate_size, params_dtype=np.float32,
                 tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, expert_placement="linear",
                 activation="silu", is_act_and_mul=True, has_bias=False, zero_expert_num=0,
                 n_shared_experts=None, shared_intermediate_size=None,
                 e_score_correction_bias=None, quant_config=None):
        from reference import ACTIVATIONS, PLACEMENTS, determine_expert_map

        from . import quant as Q

        self._version = 0                # bumped by every load: device copies are stale
        self._device_params = {}         # (backend, name) -> (version, host array, copy)
        self.num_experts = self.global_num_experts = int_arg("num_experts", num_experts, 1)
        self.hidden_size = int_arg("hidden_size", hidden_size, 1)
        self.intermediate_size = int_arg("intermediate_size", intermediate_size, 1)
        self.params_dtype = as_float_dtype(params_dtype)

        self.tp_size = int_arg("tp_size", tp_size, 1)
        self.tp_rank = int_arg("tp_rank", tp_rank, 0)
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank: expected a rank in [0, {self.tp_size}), got {tp_rank}")
        if self.intermediate_size % self.tp_size:
            raise ValueError(f"intermediate_size: expected a multiple of tp_size "
                             f"({self.tp_size}), got {intermediate_size}")
        self.intermediate_size_per_partition = self.intermediate_size // self.tp_size

        if expert_placement not in PLACEMENTS:
            raise ValueError(f"expert_placement: expected one of {list(PLACEMENTS)}, "
                             f"got {expert_placement!r}")
        self.ep_size = int_arg("ep_size", ep_size, 1)
        self.ep_rank = int_arg("ep_rank", ep_rank, 0)
        self.expert_placement = expert_placement
        self.local_num_experts, self.expert_map = determine_expert_map(
            self.ep_size, self.ep_rank, self.num_experts, expert_placement)
        if self.expert_map is None:
            self.local_to_global = np.arange(self.num_experts)
        else:
            self.local_to_global = np.flatnonzero(self.expert_map >= 0)[
                np.argsort(self.expert_map[self.expert_map >= 0])]

        self.zero_expert_num = int_arg("zero_expert_num", zero_expert_num or 0, 0)
        # the router scores real and zero experts alike
        self.num_router_experts = self.num_experts + self.zero_expert_num
        self.e_score_correction_bias = None
        if e_score_correction_bias is not None:
            self.set_e_score_correction_bias(e_score_correction_bias)

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
            n_shared_experts = int_arg("n_shared_experts", n_shared_experts, 0) or None
        self.n_shared_experts = n_shared_experts
        self.shared_intermediate_size = None
        if n_shared_experts:
            i_s = shared_intermediate_size or n_shared_experts * self.intermediate_size
            i_s = int_arg("shared_intermediate_size", i_s, 1)
            if i_s % self.tp_size:
                raise ValueError(f"shared_intermediate_size: expected a multiple of tp_size "
                                 f"({self.tp_size}), got {i_s}")
            self.shared_intermediate_size = i_s

        # quantized experts (sandbox/quant.py): the codes in w13/w2_weight, scales beside them
        self.quant_config = Q.as_quant_config(quant_config)
        if self.quant_config is not None:
            if self.tp_size > 1:
                raise Q.QuantConfigError(f"quant_config: tensor parallelism of quantized "
                                         f"experts is not implemented (tp_size={self.tp_size})")
            self.quant_config.check_dims(self.hidden_size, self.intermediate_size,
                                         self.is_act_and_mul, act == "swigluoai")
        self.expert_mapping = None       # (param_name, weight_name, expert_id, shard_id) list
        self.router_weight = self.router_bias = None   # a checkpoint's router, when read
        self._allocate()

    def _allocate(self):
        e, h, i_p = self.local_num_experts, self.hidden_size, self.intermediate_size_per_partition
        n13 = 2 * i_p if self.is_act_and_mul else i_p

        def nan(shape):
            return np.full(shape, np.nan, dtype=self.params_dtype)

        self.w13_weight = nan((e, n13, h))
        self.w2_weight = nan((e, h, i_p))
        for name in self.QUANT_PARAM_NAMES:
            setattr(self, name, None)
        qc = self.quant_config
        if qc is not None:
            # codes start at zero (fp8, int8 and uint8 have no NaN): the NaN-filled scales
            # make an expert never loaded NaN all the same
            for w, n, k in (("w13", n13, h), ("w2", h, i_p)):
                setattr(self, f"{w}_weight", np.zeros((e,) + qc.code_shape(n, k),
                                                      qc.code_dtype()))
                setattr(self, f"{w}_weight_scale",
                        np.full((e,) + qc.scale_shape(n, k), np.nan, np.float32))
                if qc.has_zp:
                    setattr(self, f"{w}_weight_zero_point",
                            np.zeros((e,) + qc.scale_shape(n, k), np.uint8))
                if qc.static_input_scale:
                    setattr(self, f"{w}_input_scale", np.full((e,), np.nan, np.float32))
        self.w13_bias = nan((e, n13)) if self.has_bias else None
        self.w2_bias = nan((e, h)) if self.has_bias else None
        self.shared_w13 = self.shared_w2 = None
        if self.n_shared_experts:
            i_sp = self.shared_intermediate_size // self.tp_size
            self.shared_w13 = nan((2 * i_sp if self.is_act_and_mul else i_sp, h))
            self.shared_w2 = nan((h, i_sp))

    # ------------------------------------------------------------------------- parameters
    def named_parameters(self):
        """(name, array) of every parameter this layer holds (None ones left out)."""
        out = [(n, getattr(self, n)) for n in self.PARAM_NAMES + self.QUANT_PARAM_NAMES
               if getattr(self, n, None) is not None]
        if self.e_score_correction_bias is not None:
            out.append(("e_score_correction_bias", self.e_score_correction_bias))
        return out

    def set_e_score_correction_bias(self, bias):
        """Set the router's correction bias: [E + Z] floats, kept in fp32."""
        b = arrays.to_numpy(bias)
        b = np.asarray(b)
        if b.dtype not in FLOAT_DTYPES:
            raise TypeError(f"e_score_correction_bias: expected a float array, got {b.dtype}")
        if b.shape != (self.num_router_experts,):
            raise ValueError(f"e_score_correction_bias: expected shape "
                             f"({self.num_router_experts},), got {b.shape}")
        self.e_score_correction_bias = b.astype(np.float32)
        self._version += 1

    def unloaded(self) -> list[str]:
        """Parameters (per local expert) that are still entirely NaN, i.e. never loaded."""
        out = []
        floats = ("w13_weight", "w2_weight") if self.quant_config is None else \
            ("w13_weight_scale", "w2_weight_scale", "w13_input_scale", "w2_input_scale")
        for name in floats + ("w13_bias", "w2_bias"):
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

    def to_dtype(self, dtype):
        """A copy with every parameter cast to `dtype` (the router bias stays fp32)."""
        dt = as_float_dtype(dtype)
        other = copy.copy(self)
        other.params_dtype = dt
        for name in self.PARAM_NAMES:
            p = getattr(self, name)
            if self.quant_config is not None and name in ("w13_weight", "w2_weight"):
                continue                 # codes keep their format: dtype is the activations'
            setattr(other, name, None if p is None else p.astype(dt))
        other._device_params = {}
        other._version = self._version + 1
        return other

    # ------------------------------------------------------------------------- device copies
    def invalidate_device_cache(self):
        """Forget the device copies of the parameters. Loading through weight_loader /
        load_weights does this; call it after writing into a parameter array by hand."""
        self._version += 1
        self._device_params.clear()

    def keep_device_copies(self, backends):
        """Drop the device copies of every backend not named in `backends` (the layer
        calls it when its stage mapping changes)."""
        for key in [k for k in self._device_params if k[0] not in backends]:
            del self._device_params[key]

    def param_for(self, name, backend, exact=False):
        """Parameter `name` as `backend` (a registry Backend) reads it: a float64 copy when
        exact, a device copy cached per load on a GPU backend; the shared experts' as one
        expert ([1, N, Kdim], what grouped_gemm takes). None for a parameter not held."""
        p = getattr(self, name)
        if p is None:
            return None
        if name.startswith("shared"):
            p = p[None]
        if exact:
            return p.astype(np.float64)
        if backend.is_host:
            return backend.put(p)
        key = (backend.name, name)
        hit = self._device_params.get(key)
        if hit is not None and hit[0] == self._version and hit[1] is getattr(self, name):
            return hit[2]
        # fp8 codes travel as their bytes: no GPU array library of ours has an fp8 dtype
        dev = backend.put(p.view(np.uint8) if p.dtype == ml_dtypes.float8_e4m3fn else p)
        self._device_params[key] = (self._version, getattr(self, name), dev)
        return dev

    def constant_for(self, name, value, backend):
        """A host constant of the layer (the router's correction bias, the expert map) as
        `backend` reads it, copied to a device once per load instead of at every call (a
        copy from the host inside a CUDA graph capture would fail)."""
        if value is None or backend.is_host:
            return value
        key = (backend.name, name)
        hit = self._device_params.get(key)
        if hit is not None and hit[0] == self._version and hit[1] is value:
            return hit[2]
        dev = backend.take(value)
        self._device_params[key] = (self._version, value, dev)
        return dev

    # ------------------------------------------------------------------------- loading
    def _param_name(self, param) -> str:
        if param is None:
            raise ValueError("param: expected one of this layer's parameter arrays, got None "
                             "(a bias of a layer with has_bias=False, or no shared experts?)")
        names = self.PARAM_NAMES + self.QUANT_PARAM_NAMES
        if isinstance(param, str):
            if param not in names or getattr(self, param) is None:
                raise ValueError(f"param: expected one of "
                                 f"{[n for n, _ in self.named_parameters()]}, got {param!r}")
            return param
        for name in names:
            if getattr(self, name) is param:
                return name
        raise ValueError("param: expected one of this layer's parameter arrays "
                         f"({', '.join(n for n, _ in self.named_parameters())}), got "
                         f"{arrays.describe(param)}")

    def _local_expert(self, expert_id) -> int:
        e = int_arg("expert_id", expert_id, 0)
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
        if self.quant_config is not None and (name in self.QUANT_PARAM_NAMES
                                              or name in ("w13_weight", "w2_weight")):
            return self._load_quantized(name, loaded_weight, weight_name, shard_id, expert_id)
        param = getattr(self, name)
        loaded = np.asarray(arrays.to_numpy(loaded_weight))
        if loaded.dtype not in FLOAT_DTYPES:
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

    def _load_quantized(self, name, loaded_weight, weight_name, shard_id, expert_id) -> bool:
        """weight_loader for a quantized layer's codes, scales, zero points and input scales
        (sandbox/quant.py): one shard of one expert ([N_shard, ...]) or of all experts
        ([E, N_shard, ...]), in the layer's own layout (checkpoint formats are converted
        before: sandbox/checkpoint_quant.py). Gate and up rows go where the float loader puts
        them; block scales by blocks; a per-tensor scale (or static input scale) is one per
        expert, so gate and up must agree on it."""
        from . import quant as Q

        qc = self.quant_config
        base, kind = name.split("_", 1)                       # "w13", "weight_scale"
        if (base == "w13") == (shard_id == "w2"):
            raise ValueError(f"{weight_name}: shard_id {shard_id!r} does not load into {name} "
                             f"(w1/w3 go to w13, w2 to w2)")
        if shard_id == "w3" and not self.is_act_and_mul:
            raise ValueError(f"{weight_name}: shard_id 'w3' (up) has no place without "
                             f"is_act_and_mul")
        loaded = np.asarray(arrays.to_numpy(loaded_weight))
        i, h = self.intermediate_size, self.hidden_size
        n, k = (h, i) if shard_id == "w2" else (i, h)         # this shard's logical weight
        if kind == "weight":
            one, dtype = qc.code_shape(n, k), qc.code_dtype()
            if loaded.dtype != dtype:
                codes = {Q.FP8: "fp8", np.dtype(np.int8): "int8", np.dtype(np.uint8): "int4/uint8"}
                cls = Q.QuantFormatMismatch if loaded.dtype in codes else Q.QuantShapeError
                raise cls(f"{weight_name}: expected {qc.weight_dtype} codes ({dtype}) as the "
                          f"layer's quant_config says, got dtype {loaded.dtype}"
                          + (f" ({codes[loaded.dtype]} codes)" if loaded.dtype in codes else ""))
        elif kind == "weight_zero_point":
            one, dtype = qc.scale_shape(n, k), np.dtype(np.uint8)
            if loaded.dtype != dtype:
                raise Q.QuantShapeError(f"{weight_name}: expected uint8 zero points (one code "
                                        f"a group, unpacked), got dtype {loaded.dtype}")
        else:
            one = qc.scale_shape(n, k) if kind == "weight_scale" else ()
            dtype = np.dtype(np.float32)
            if loaded.dtype not in FLOAT_DTYPES:
                raise Q.QuantShapeError(f"{weight_name}: expected float scales, got dtype "
                                        f"{loaded.dtype}")
        full = loaded.ndim == len(one) + 1
        want = ((self.num_experts,) + one) if full else one
        if loaded.shape != want:
            raise Q.QuantShapeError(f"{weight_name}: expected shape {want} for {name} (shard "
                                    f"{shard_id}, {qc.describe()}), got {loaded.shape}")
        src = loaded.astype(dtype)
        param = getattr(self, name)
        if full:
            src, dest_idx = src[self.local_to_global], slice(None)
        else:
            local = self._local_expert(expert_id)
            if local < 0:
                return False
            dest_idx = local
        if shard_id == "w2" or not one:
            if not one and shard_id == "w3":          # one value per expert: gate's must match
                have = param[dest_idx]
                if np.any(~np.isnan(have) & (have != src)):
                    raise Q.QuantConfigError(
                        f"{weight_name}: the layer holds one {kind} per expert, but gate (w1) "
                        f"and up (w3) of expert {expert_id} differ ({have} vs {src}); "
                        f"requantize them to one scale")
            param[dest_idx] = src
        else:
            rows_n = src.shape[-len(one)]             # the shard's rows (blocks for block scales)
            if self.activation == "swigluoai":
                rows = slice(0, 2 * rows_n, 2) if shard_id == "w1" else slice(1, 2 * rows_n, 2)
            elif not self.is_act_and_mul or shard_id == "w1":
                rows = slice(0, rows_n)
            else:
                rows = slice(rows_n, 2 * rows_n)
            if full:
                param[:, rows] = src
            else:
                param[dest_idx, rows] = src
        self.invalidate_device_cache()
        return True

    def quantize_from(self, weights) -> MoEWeights:
        """Fill this quantized layer from a float MoEWeights of the same shape and sharding
        (its w13 / w2 quantized per expert with reference/quant.py's quantizers; biases and
        shared experts copied; static input scales left to the caller). Returns self."""
        from . import quant as Q

        qc = self.quant_config
        if qc is None:
            raise ValueError("quantize_from: this layer has no quant_config")
        for name in ("w13_weight", "w2_weight"):
            src = getattr(weights, name)
            if weights.quant_config is not None or src.shape[:2] != getattr(self, name).shape[:2]:
                raise ValueError(f"weights: expected a float layer of this one's shape, got "
                                 f"{name} {src.shape} ({weights.quant_config})")
            q, s, z = Q.quantize_experts(qc, src)
            base = name.split("_")[0]
            getattr(self, name)[...] = q
            getattr(self, f"{base}_weight_scale")[...] = s
            if z is not None:
                getattr(self, f"{base}_weight_zero_point")[...] = z
        for name in ("w13_bias", "w2_bias", "shared_w13", "shared_w2"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(weights, name).astype(self.params_dtype))
        if weights.e_score_correction_bias is not None:
            self.set_e_score_correction_bias(weights.e_score_correction_bias)
        self.invalidate_device_cache()
        return self

    def dequantized(self, keep_fp32=False) -> MoEWeights:
        """A float copy of this layer (quant_config None): the experts dequantized to
        params_dtype (fp32 with keep_fp32, for the exact answer: dequantization is exact
        in fp32), everything else shared. What a quantized layer approximates."""
        from . import quant as Q

        qc = self.quant_config
        if qc is None:
            return self
        other = copy.copy(self)
        other.quant_config = None
        for base in ("w13", "w2"):
            w = Q.dequantize_experts(qc, getattr(self, f"{base}_weight"),
                                     getattr(self, f"{base}_weight_scale"),
                                     getattr(self, f"{base}_weight_zero_point"))
            setattr(other, f"{base}_weight", w if keep_fp32 else w.astype(self.params_dtype))
        for name in self.QUANT_PARAM_NAMES:
            setattr(other, name, None)
        other._device_params = {}
        other._version = self._version + 1
        return other

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

    @classmethod
    def from_safetensors(cls, path, layer_idx=None, **overrides):
        """The weights of one MoE layer of a safetensors checkpoint, with no pipeline to run
        them (sandbox.checkpoint.load; layer_idx None: the first MoE layer). The layer's
        routing arguments are left out; `overrides` are MoEWeights arguments, plus
        `family=` to force the family (TypeError for any other name)."""
        unknown = sorted(set(overrides) - set(WEIGHT_ARGS) - {"family"})
        if unknown:
            raise TypeError(f"overrides: expected MoEWeights arguments {list(WEIGHT_ARGS)} or "
                            f"family, got {unknown}")

        def build(**kwargs):
            return cls(**{k: v for k, v in kwargs.items() if k in WEIGHT_ARGS})

        return checkpoint.load(path, layer_idx, build, **overrides)

    def load_random(self, seed=0):
        """Random weights: normal / sqrt(fan_in), biases normal * 0.1; returns self.

        The full (unsharded) tensors are drawn from `seed` in a fixed order and then loaded
        through weight_loader, so ranks loaded with the same seed and different
        tp_rank / ep_rank hold the shards of one model."""
        if self.quant_config is not None:
            # the same float model, drawn as for a float layer, then quantized per expert;
            # static activation scales are set from a standard-normal input's range
            twin = copy.copy(self)
            twin.quant_config = None
            twin._allocate()
            twin.load_random(seed)
            self.quantize_from(twin)
            for base in ("w13", "w2"):
                if self.quant_config.static_input_scale:
                    qmax = 448.0 if self.quant_config.weight_dtype == "fp8" else 127.0
                    getattr(self, f"{base}_input_scale")[...] = np.float32(8.0 / qmax)
            return self
        rng = np.random.default_rng(seed)
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size

        def normal(shape, scale):
            return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))

        w1 = normal((e, i, h), 1 / math.sqrt(h))
        w3 = normal((e, i, h), 1 / math.sqrt(h)) if self.is_act_and_mul else None
        w2 = normal((e, h, i), 1 / math.sqrt(i))
        self.weight_loader(self.w13_weight, w1, "experts.w1.weight", "w1", 0)
        if w3 is not None:
            self.weight_loader(self.w13_weight, w3, "experts.w3.weight", "w3", 0)
        self.weight_loader(self.w2_weight, w2, "experts.w2.weight", "w2", 0)
        if self.has_bias:
            b1 = normal((e, i), 0.1)
            b3 = normal((e, i), 0.1) if self.is_act_and_mul else None
            b2 = normal((e, h), 0.1)
            self.weight_loader(self.w13_bias, b1, "experts.w1.bias", "w1", 0)
            if b3 is not None:
                self.weight_loader(self.w13_bias, b3, "experts.w3.bias", "w3", 0)
            self.weight_loader(self.w2_bias, b2, "experts.w2.bias", "w2", 0)
        if self.n_shared_experts:
            i_s = self.shared_intermediate_size
            self.weight_loader(self.shared_w13, normal((i_s, h), 1 / math.sqrt(h)),
                               "shared_experts.gate_proj.weight", "w1", None)
            if self.is_act_and_mul:
                self.weight_loader(self.shared_w13, normal((i_s, h), 1 / math.sqrt(h)),
                                   "shared_experts.up_proj.weight", "w3", None)
            self.weight_loader(self.shared_w2, normal((h, i_s), 1 / math.sqrt(i_s)),
                               "shared_experts.down_proj.weight", "w2", None)
        return self
