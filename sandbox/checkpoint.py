"""Read one MoE layer of a Hugging Face safetensors checkpoint into a layer's weights.

    load(path, layer_idx, build, **overrides) -> build(**kwargs), loaded
            (FusedMoE.from_safetensors: a layer; MoEWeights.from_safetensors: the weights alone)
    router_logits(layer, hidden_states) -> f32 [T, E]          x @ router_weight.T (+ bias)
    default_checkpoint_path() / default_trace_path(...)        the small files in data/

Shape legend: T tokens, E global experts, E_local experts on this rank, H hidden, I intermediate
(full), I_p = I / tp_size, I_s shared-expert intermediate.

Families and their on-disk names (prefix `model.layers.N.`), detected from the names and,
when present, the `config.json` beside the checkpoint:

    mixtral      block_sparse_moe.gate.weight [E, H]; block_sparse_moe.experts.e.{w1,w3,w2}.weight
                 (w1 gate [I, H], w3 up [I, H], w2 down [H, I]); softmax top-k, renormalized
    qwen3_moe    mlp.gate.weight [E, H]; mlp.experts.e.{gate_proj,up_proj,down_proj}.weight;
                 softmax top-k, renormalized when `norm_topk_prob`
    deepseek_v3  as qwen3_moe, plus mlp.gate.e_score_correction_bias [E] and
                 mlp.shared_experts.{gate_proj,up_proj,down_proj}.weight ([I_s, H], [I_s, H],
                 [H, I_s]); sigmoid grouped top-k (n_group, topk_group), routed_scaling_factor
    gpt_oss      mlp.router.{weight [E, H], bias [E]}; fused experts
                 mlp.experts.gate_up_proj [E, H, 2I] with gate/up interleaved on the last axis
                 (column 2j gate j, 2j+1 up j), gate_up_proj_bias [E, 2I],
                 down_proj [E, I, H], down_proj_bias [E, H]; activation swigluoai

Where the weights go (the parameters start NaN-filled), always through the weights' own
`weight_loader` (sandbox/weights.py; vLLM's rules: w1 = gate and w3 = up into `w13_weight`,
narrowed by `tp_rank` on their output dim, w2 = down narrowed on its input dim, experts of
other EP ranks skipped), so that their device caches stay coherent:
- per-expert families stream `(name, tensor)` pairs, one tensor at a time, through
  `load_weights` with the mapping of `MoEWeights.make_expert_params_mapping`; DeepSeek's
  shared experts and `e_score_correction_bias` go through the same stream. Experts that are
  not on this EP rank are not even read.
- gpt-oss: one expert's slice `gate_up_proj[e]` [H, 2I] is read and split into
  gate = columns 0::2 and up = columns 1::2 (transposed to [I, H]), loaded as w1 and w3;
  the layer puts them back on the even / odd rows of w13 because `swigluoai_and_mul` reads
  gate = x[:, 0::2], up = x[:, 1::2] of the GEMM1 output. The interleave survives tensor
  parallelism: rank r holds gate/up rows [r*I_p, (r+1)*I_p), i.e. rows
  [2*I_p*r, 2*I_p*(r+1)) of the interleaved w13. `down_proj[e]` [I, H] is transposed to
  [H, I] and loaded as w2; the biases follow their weights (the layer adds the down bias
  on tp_rank 0 only).
- router weight (and gpt-oss router bias) land on `router_weight [E, H]` and
  `router_bias [E] or None` of the result; its `checkpoint_info` says what was read.

Checks: every tensor's presence, shape and dtype are checked from the safetensors headers
before any data is read; a failure raises `CheckpointError` (a ValueError) naming the tensor,
what was expected and what was found. The weights are built fresh and returned only when
every local expert weight has been written (no NaN left), so a failed load leaves nothing
behind.

Precision: the layer's `params_dtype` defaults to float32 (FusedMoE's default; bf16 -> fp32 is
exact, so parity checks keep fp32 tolerances). Pass `params_dtype=ml_dtypes.bfloat16` to keep
the checkpoint's bf16.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import re
from typing import Any, Iterator

import numpy as np

from . import checkpoint_quant
from .checkpoint_error import CheckpointError

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
DEFAULT_FAMILY = "qwen3_moe"
DEFAULT_TRACE = "zipf"

# config.json `model_type` -> family (DeepSeek-V2 shares V3's layout)
_MODEL_TYPES = {"mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3",
                "deepseek_v2": "deepseek_v3", "gpt_oss": "gpt_oss"}
_TORCH_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_FLOAT_ST_DTYPES = ("BF16", "F16", "F32", "F64")
_HIDDEN_ACT = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
_GPT_OSS_LIMIT = 7.0  # the limit of reference.activation.swigluoai_and_mul


# ----------------------------------------------------------------------------- data/ paths

def data_dir() -> pathlib.Path:
    """The folder of the small generated files: `$MOE_SANDBOX_DATA`, else `<repo>/data`."""
    env = os.environ.get("MOE_SANDBOX_DATA")
    return pathlib.Path(env) if env else pathlib.Path(__file__).resolve().parents[1] / "data"


def default_checkpoint_path() -> pathlib.Path:
    """The default small layer: `data/qwen3_moe` (E=16, K=4, H=64, I=64, bf16)."""
    return data_dir() / DEFAULT_FAMILY


def default_trace_path(family: str = DEFAULT_FAMILY, distribution: str = DEFAULT_TRACE
                       ) -> pathlib.Path:
    """`data/traces/<family>_<distribution>.npz`."""
    return data_dir() / "traces" / f"{family}_{distribution}.npz"


# ----------------------------------------------------------------------------- the files

class CheckpointFiles:
    """The tensors of a checkpoint across one or several safetensors files, read lazily.

    `path`: a `.safetensors` file, a `*.safetensors.index.json`, or a directory holding either.
    Use as a context manager; `shape`/`dtype` read only headers, `read(name, index)` reads one
    tensor (or `tensor[index]`, e.g. one expert of a fused [E, ...] tensor) as a NumPy array.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        if not self.path.exists():
            raise CheckpointError(f"checkpoint: expected a .safetensors file, an index .json or "
                                  f"a directory, got {str(self.path)!r}, which does not exist")
        self.weight_map = self._weight_map()
        self.folder = self.path if self.path.is_dir() else self.path.parent
        self._stack = contextlib.ExitStack()
        self._handles: dict[pathlib.Path, Any] = {}

    def _weight_map(self) -> dict[str, pathlib.Path]:
        p = self.path
        if p.is_dir():
            indexes = sorted(p.glob("*.safetensors.index.json"))
            files = sorted(p.glob("*.safetensors"))
            if indexes:
                p = indexes[0]
            elif files:
                return self._union(files)
            else:
                raise CheckpointError(f"checkpoint: expected a .safetensors file or "
                                      f"model.safetensors.index.json in {str(p)!r}, found none")
        if p.name.endswith(".json"):
            try:
                index = json.loads(p.read_text())
                entries = index["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"checkpoint index {str(p)!r}: expected JSON with a "
                                      f"'weight_map' object, got {type(exc).__name__}: {exc}"
                                      ) from None
            out = {name: p.parent / fname for name, fname in entries.items()}
            for fname in sorted(set(out.values())):
                if not fname.exists():
                    raise CheckpointError(f"checkpoint index {str(p)!r}: expected shard file "
                                          f"{fname.name!r} beside it, found no such file")
            return out
        if p.suffix == ".safetensors":
            return self._union([p])
        raise CheckpointError(f"checkpoint: expected a .safetensors file, an index .json or a "
                              f"directory, got {str(p)!r}")

    @staticmethod
    def _union(files: list[pathlib.Path]) -> dict[str, pathlib.Path]:
        from safetensors import safe_open

        out: dict[str, pathlib.Path] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="numpy") as h:
                    names = list(h.keys())
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"checkpoint file {str(f)!r}: expected a safetensors "
                                      f"file, could not read it ({exc})") from None
            for name in names:
                if name in out:
                    raise CheckpointError(f"tensor {name!r}: expected in one file, found in "
                                          f"both {out[name].name!r} and {f.name!r}")
                out[name] = f
        return out

    def config(self) -> dict | None:
        cfg = self.folder / "config.json"
        if not cfg.exists():
            return None
        try:
            return json.loads(cfg.read_text())
        except ValueError as exc:
            raise CheckpointError(f"config {str(cfg)!r}: expected JSON, got {exc}") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()
        self._handles.clear()

    def _handle(self, name: str):
        from safetensors import safe_open

        f = self.weight_map[name]
        if f not in self._handles:
            self._handles[f] = self._stack.enter_context(safe_open(str(f), framework="numpy"))
        return self._handles[f]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype string: 'BF16', 'F16', 'F32', ..."""
        return self._handle(name).get_slice(name).get_dtype()

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor, or only `tensor[index]` (one expert of a fused tensor) when given."""
        if index is None:
            return self._handle(name).get_tensor(name)
        return self._handle(name).get_slice(name)[index]


# ----------------------------------------------------------------------------- the plan

@dataclasses.dataclass
class _Expect:
    """One tensor the layer needs: its name, shape and allowed safetensors dtypes."""

    name: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]


def _detect_family(files: CheckpointFiles, layer_idx: int, config: dict | None,
                   forced: str | None) -> str:
    p = f"model.layers.{layer_idx}."
    names = [n for n in files.names() if n.startswith(p)]
    if any(n.startswith(p + "block_sparse_moe.experts.") for n in names):
        by_names = "mixtral"
    elif p + "mlp.experts.gate_up_proj" in files:
        by_names = "gpt_oss"
    elif any(re.match(re.escape(p) + r"mlp\.experts\.\d+\.gate_proj\.(?:weight|weight_packed|qweight)$",
                      n)
             for n in names):
        deepseek = (p + "mlp.gate.e_score_correction_bias" in files
                    or any(n.startswith(p + "mlp.shared_experts.") for n in names)
                    or _MODEL_TYPES.get((config or {}).get("model_type")) == "deepseek_v3")
        by_names = "deepseek_v3" if deepseek else "qwen3_moe"
    else:
        moe_layers = sorted({int(m.group(1)) for n in files.names()
                             if (m := re.match(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)"
                                               r"\.experts\.", n))})
        if any(n.startswith("model.layers.") for n in files.names()):
            raise CheckpointError(
                f"layer_idx: expected a MoE layer of {str(files.path)!r} (one with "
                f"model.layers.N.block_sparse_moe.experts.* or model.layers.N.mlp.experts.*), "
                f"got {layer_idx}; MoE layers found: {moe_layers or 'none'}")
        raise CheckpointError(f"checkpoint {str(files.path)!r}: unknown family, expected "
                              f"Hugging Face names model.layers.N.(block_sparse_moe|mlp)."
                              f"experts.*, found e.g. {files.names()[:3]}")
    if forced is not None:
        if forced not in FAMILIES:
            raise CheckpointError(f"family: expected one of {FAMILIES}, got {forced!r}")
        if forced != by_names and {forced, by_names} != {"qwen3_moe", "deepseek_v3"}:
            raise CheckpointError(f"family: expected {by_names!r} from the tensor names, got "
                                  f"{forced!r}")
        return forced
    claimed = _MODEL_TYPES.get((config or {}).get("model_type"))
    if claimed is not None and claimed != by_names and not (
            claimed == "deepseek_v3" and by_names == "qwen3_moe"):
        raise CheckpointError(f"config.json model_type {config['model_type']!r} says family "
                              f"{claimed!r}, but the tensor names of layer {layer_idx} are "
                              f"{by_names!r}")
    return by_names


def _first_moe_layer(files: CheckpointFiles) -> int:
    layers = sorted({int(m.group(1)) for n in files.names()
                     if (m := re.match(r"model\.layers\.(\d+)\.(?:block_sparse_moe\.experts|"
                                       r"mlp\.experts)\.", n))})
    if not layers:
        raise CheckpointError(f"checkpoint {str(files.path)!r}: expected at least one MoE layer "
                              f"(model.layers.N.block_sparse_moe.experts.* or "
                              f"model.layers.N.mlp.experts.*), found none")
    return layers[0]


def _expert_indices(files: CheckpointFiles, experts_prefix: str) -> dict[int, str]:
    """{expert id: one tensor name of it} for names `<experts_prefix><e>.<...>`."""
    pat = re.compile(re.escape(experts_prefix) + r"(\d+)\.")
    out: dict[int, str] = {}
    for n in files.names():
        m = pat.match(n)
        if m:
            out.setdefault(int(m.group(1)), n)
    return out


def _cfg(config: dict, overrides: dict, key: str, *config_keys: str, default=None):
    """The override for `key`, else the first config key present, else `default`."""
    if key in overrides:
        return overrides[key]
    for k in config_keys:
        if k in config and config[k] is not None:
            return config[k]
    return default


def _plan(files: CheckpointFiles, family: str, layer_idx: int, config: dict | None,
          overrides: dict) -> tuple[dict, list[_Expect], dict]:
    """The FusedMoE kwargs, the tensors to check, and the names of the roles
    (router, bias, expert name templates) for `family`."""
    cfg = config or {}
    p = f"model.layers.{layer_idx}."
    if family == "mixtral":
        experts = p + "block_sparse_moe.experts."
        router = p + "block_sparse_moe.gate.weight"
        gate, up, down = "w1", "w3", "w2"
    elif family == "gpt_oss":
        experts = p + "mlp.experts."
        router = p + "mlp.router.weight"
        gate = up = down = None
    else:
        experts = p + "mlp.experts."
        router = p + "mlp.gate.weight"
        gate, up, down = "gate_proj", "up_proj", "down_proj"
    if router not in files:
        raise CheckpointError(f"tensor {router!r}: expected the router weight [E, H] of layer "
                              f"{layer_idx} ({family}), found no such tensor")

    # the model dtype every weight must have: config's torch_dtype, else the router's own
    want_dtype = _TORCH_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or ""))
    router_dtype = files.dtype(router)
    weight_dtypes = (want_dtype,) if want_dtype else (router_dtype,)
    for_bias = tuple(dict.fromkeys(weight_dtypes + ("F32",)))
    if weight_dtypes[0] not in _FLOAT_ST_DTYPES:
        raise CheckpointError(f"tensor {router!r}: expected a float dtype {_FLOAT_ST_DTYPES} "
                              f"(quantized checkpoints are not supported), found "
                              f"{weight_dtypes[0]}")

    router_shape = files.shape(router)
    if len(router_shape) != 2:
        raise CheckpointError(f"tensor {router!r}: expected shape [E, H], found {router_shape}")
    found_E, found_H = router_shape

    # sizes: overrides, then config.json, then the tensors themselves
    E_keys = {"mixtral": ("num_local_experts",), "qwen3_moe": ("num_experts",),
              "deepseek_v3": ("n_routed_experts",), "gpt_oss": ("num_local_experts",)}[family]
    I_keys = {"mixtral": ("intermediate_size",), "gpt_oss": ("intermediate_size",)}.get(
        family, ("moe_intermediate_size",))
    E = _cfg(cfg, overrides, "num_experts", *E_keys)
    H = _cfg(cfg, overrides, "hidden_size", "hidden_size", default=found_H)
    if E is None:  # no config: count experts on disk
        E = (files.shape(experts + "gate_up_proj")[0] if family == "gpt_oss"
             else len(_expert_indices(files, experts)))
    if family == "gpt_oss":
        I_found = files.shape(experts + "down_proj")[1] if experts + "down_proj" in files else None
    else:
        first = f"{experts}0.{gate}.weight"
        I_found = files.shape(first)[0] if first in files else None
    I = _cfg(cfg, overrides, "intermediate_size", *I_keys, default=I_found)  # noqa: E741
    if I is None:
        raise CheckpointError(f"tensor {experts}0.{gate}.weight: expected expert 0's gate "
                              f"weight [I, H], found no such tensor")
    top_k = _cfg(cfg, overrides, "top_k", "num_experts_per_tok", "experts_per_token")
    if top_k is None:
        raise CheckpointError(f"top_k: expected it in {str(files.folder / 'config.json')!r} "
                              f"(num_experts_per_tok) or as an override, found neither")
    E, H, I, top_k = int(E), int(H), int(I), int(top_k)  # noqa: E741

    expects = [_Expect(router, (E, H), (router_dtype,) if not want_dtype else weight_dtypes)]
    kwargs: dict[str, Any] = dict(num_experts=E, top_k=top_k, hidden_size=H, intermediate_size=I)
    roles: dict[str, Any] = {"router": router, "router_bias": None, "experts": experts,
                             "names": (gate, up, down), "shared": None, "score_bias": None}

    act = _HIDDEN_ACT.get(str(cfg.get("hidden_act", "silu")))
    if act is None:
        raise CheckpointError(f"config.json hidden_act: expected one of {sorted(_HIDDEN_ACT)}, "
                              f"got {cfg.get('hidden_act')!r}")
    if family == "gpt_oss":
        limit = float(cfg.get("swiglu_limit", _GPT_OSS_LIMIT))
        if limit != _GPT_OSS_LIMIT:
            raise CheckpointError(f"config.json swiglu_limit: expected {_GPT_OSS_LIMIT} (the "
                                  f"sandbox's swigluoai), got {limit}")
        bias = p + "mlp.router.bias"
        roles["router_bias"] = bias if bias in files else None
        if roles["router_bias"]:
            expects.append(_Expect(bias, (E,), for_bias))
        expects += [
            _Expect(experts + "gate_up_proj", (E, H, 2 * I), weight_dtypes),
            _Expect(experts + "gate_up_proj_bias", (E, 2 * I), for_bias),
            _Expect(experts + "down_proj", (E, I, H), weight_dtypes),
            _Expect(experts + "down_proj_bias", (E, H), for_bias),
        ]
        kwargs.update(renormalize=True, activation="swigluoai", has_bias=True)
    else:
        on_disk = _expert_indices(files, experts)
        extra = sorted(e for e in on_disk if e >= E)
        if extra:
            raise CheckpointError(f"tensor {on_disk[extra[0]]!r}: expected experts 0..{E - 1} "
                                  f"(num_experts={E}), found expert {extra[0]} "
                                  f"({len(on_disk)} experts on disk)")
        for e in range(E):
            expects += [_Expect(f"{experts}{e}.{gate}.weight", (I, H), weight_dtypes),
                        _Expect(f"{experts}{e}.{up}.weight", (I, H), weight_dtypes),
                        _Expect(f"{experts}{e}.{down}.weight", (H, I), weight_dtypes)]
        kwargs["activation"] = act
        if family == "mixtral":
            kwargs["renormalize"] = True
        elif family == "qwen3_moe":
            kwargs["renormalize"] = bool(cfg.get("norm_topk_prob", False))
        else:  # deepseek_v3
            n_group = int(_cfg(cfg, overrides, "num_expert_group", "n_group", default=1) or 1)
            kwargs.update(
                renormalize=bool(cfg.get("norm_topk_prob", True)),
                use_grouped_topk=True, num_expert_group=n_group,
                topk_group=int(_cfg(cfg, overrides, "topk_group", "topk_group",
                                    default=n_group) or n_group),
                scoring_func=str(cfg.get("scoring_func", "sigmoid")),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
            score_bias = p + "mlp.gate.e_score_correction_bias"
            if score_bias in files:
                roles["score_bias"] = score_bias
                expects.append(_Expect(score_bias, (E,), for_bias))
            shared = p + "mlp.shared_experts."
            if shared + "gate_proj.weight" in files or "n_shared_experts" in cfg:
                n_shared = int(_cfg(cfg, overrides, "n_shared_experts", "n_shared_experts",
                                    default=1) or 0)
                if n_shared:
                    found_Is = (files.shape(shared + "gate_proj.weight")[0]
                                if shared + "gate_proj.weight" in files else n_shared * I)
                    Is = int(overrides.get("shared_intermediate_size",  # noqa: E741
                                           n_shared * I if "n_shared_experts" in cfg
                                           or "n_shared_experts" in overrides else found_Is))
                    expects += [_Expect(shared + "gate_proj.weight", (Is, H), weight_dtypes),
                                _Expect(shared + "up_proj.weight", (Is, H), weight_dtypes),
                                _Expect(shared + "down_proj.weight", (H, Is), weight_dtypes)]
                    kwargs.update(n_shared_experts=n_shared, shared_intermediate_size=Is)
                    roles["shared"] = shared
    if found_E != E:
        raise CheckpointError(f"tensor {router!r}: expected shape {(E, H)} (num_experts={E}), "
                              f"found {router_shape}")
    # overrides win over everything derived above (they were already used for the sizes)
    kwargs.update({k: v for k, v in overrides.items() if k != "family"})
    return kwargs, expects, roles


def _check(files: CheckpointFiles, expects: list[_Expect]) -> None:
    for x in expects:
        if x.name not in files:
            raise CheckpointError(f"tensor {x.name!r}: expected shape {list(x.shape)} "
                                  f"{'/'.join(x.dtypes)}, found no such tensor in "
                                  f"{str(files.path)!r}")
        shape, dtype = files.shape(x.name), files.dtype(x.name)
        if shape != x.shape:
            raise CheckpointError(f"tensor {x.name!r}: expected shape {list(x.shape)}, "
                                  f"found {list(shape)}")
        if dtype not in x.dtypes:
            raise CheckpointError(f"tensor {x.name!r}: expected dtype {'/'.join(x.dtypes)}, "
                                  f"found {dtype}")


# ----------------------------------------------------------------------------- loading

def load(path: str | os.PathLike, layer_idx: int | None, build, **overrides):
    """Read MoE layer `layer_idx` (None: the first one) of the checkpoint at `path` into
    `build(**kwargs)`, one expert tensor at a time, and return what `build` made.

    `kwargs` are the layer's FusedMoE keyword arguments: from config.json and the tensor
    names, then `overrides` (they win; `family=` forces the family and is not passed on).
    `build` makes the object the tensors load into through its own weight_loader /
    load_weights: `FusedMoE.from_safetensors` passes FusedMoE, `MoEWeights.from_safetensors`
    the weights alone (sandbox/weights.py); this module imports neither.

    The result gets `router_weight [E, H]`, `router_bias [E] or None` and
    `checkpoint_info`. Raises `CheckpointError` on any mismatch, before any data is read
    for what the headers can tell, and when `build` refuses the arguments."""
    overrides = dict(overrides)
    with CheckpointFiles(path) as files:
        config = files.config()
        if layer_idx is None:
            layer_idx = _first_moe_layer(files)
        family = _detect_family(files, int(layer_idx), config, overrides.get("family"))
        quant = checkpoint_quant.quant_config_of(config)      # (format, FusedMoEQuantConfig)
        if quant is not None:
            if family == "gpt_oss":
                raise CheckpointError(f"config.json quantization_config: quantized gpt-oss "
                                      f"(mxfp4) is not supported, got {quant[0]}")
            overrides.setdefault("quant_config", quant[1])
        kwargs, expects, roles = _plan(files, family, int(layer_idx), config, overrides)
        if quant is not None:
            expects = checkpoint_quant.expects(expects, files, roles, quant[0],
                                               kwargs["num_experts"])
        _check(files, expects)
        try:
            weights = build(**kwargs)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"layer {layer_idx} of {str(path)!r} ({family}): the "
                                  f"layer arguments {_short(kwargs)} were refused: {exc}"
                                  ) from exc
        if quant is not None:
            checkpoint_quant.load_experts(weights, files, roles, quant[0], quant[1],
                                          kwargs["num_experts"],
                                          score_bias="e_score_correction_bias" not in overrides)
        elif family == "gpt_oss":
            _load_gpt_oss(weights, files, roles)
        else:
            _load_per_expert(weights, files, roles, kwargs["num_experts"],
                             score_bias="e_score_correction_bias" not in overrides)
        _check_complete(weights, path, layer_idx)
        wdtype = weights.w13_weight.dtype
        weights.router_weight = files.read(roles["router"]).astype(wdtype)      # [E, H]
        weights.router_bias = (files.read(roles["router_bias"]).astype(wdtype)  # [E]
                               if roles["router_bias"] else None)
        weights.checkpoint_info = {"path": str(path), "layer_idx": int(layer_idx),
                                   "family": family, "config": config,
                                   "kwargs": _short(kwargs)}
        return weights


def _per_expert_stream(weights, files: CheckpointFiles, roles: dict, num_experts: int,
                       score_bias: bool) -> Iterator[tuple[str, np.ndarray]]:
    """(name, tensor) for every tensor of this rank's experts (then the shared experts and
    the score correction bias), read one at a time."""
    expert_map = getattr(weights, "expert_map", None)
    for e in range(num_experts):
        if expert_map is not None and int(expert_map[e]) < 0:
            continue  # on another EP rank: do not even read it
        for part in roles["names"]:
            name = f"{roles['experts']}{e}.{part}.weight"
            yield name, files.read(name)
    if roles["shared"] is not None:
        for part in ("gate_proj", "up_proj", "down_proj"):
            name = f"{roles['shared']}{part}.weight"
            yield name, files.read(name)
    if roles["score_bias"] is not None and score_bias:
        yield roles["score_bias"], files.read(roles["score_bias"])


def _load_per_expert(weights, files: CheckpointFiles, roles: dict, num_experts: int,
                     score_bias: bool = True) -> None:
    gate, up, down = roles["names"]
    weights.expert_mapping = type(weights).make_expert_params_mapping(gate, down, up,
                                                                      num_experts)
    fed: list[str] = []

    def stream():
        for name, tensor in _per_expert_stream(weights, files, roles, num_experts, score_bias):
            fed.append(name)
            yield name, tensor
    try:
        loaded = weights.load_weights(stream())
    except (TypeError, ValueError) as exc:
        where = fed[-1] if fed else roles["experts"]
        raise CheckpointError(f"tensor {where!r}: the layer refused it: {exc}") from exc
    missed = [n for n in fed if n not in loaded]
    if missed:
        raise CheckpointError(f"tensor {missed[0]!r}: expected the layer to load it, but "
                              f"load_weights left it out ({len(missed)} tensors in all)")


def _load_gpt_oss(weights, files: CheckpointFiles, roles: dict) -> None:
    """One expert at a time: gate_up_proj[e] [H, 2I] -> w1 = [:, 0::2].T, w3 = [:, 1::2].T
    ([I, H] each); down_proj[e] [I, H] -> w2 = .T [H, I]; biases alike."""
    x = roles["experts"]
    num_experts = files.shape(x + "gate_up_proj")[0]
    expert_map = getattr(weights, "expert_map", None)
    for e in range(num_experts):
        if expert_map is not None and int(expert_map[e]) < 0:
            continue  # on another EP rank
        name = x + "gate_up_proj"
        try:
            gate_up = files.read(name, e)                                          # [H, 2I]
            weights.weight_loader(weights.w13_weight, gate_up[:, 0::2].T, name, "w1", e)
            weights.weight_loader(weights.w13_weight, gate_up[:, 1::2].T, name, "w3", e)
            name = x + "gate_up_proj_bias"
            bias = files.read(name, e)                                             # [2I]
            weights.weight_loader(weights.w13_bias, bias[0::2], name, "w1", e)
            weights.weight_loader(weights.w13_bias, bias[1::2], name, "w3", e)
            name = x + "down_proj"
            weights.weight_loader(weights.w2_weight, files.read(name, e).T, name, "w2", e)
            name = x + "down_proj_bias"
            weights.weight_loader(weights.w2_bias, files.read(name, e), name, "w2", e)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"tensor {name!r} (expert {e}): the layer refused it: "
                                  f"{exc}") from exc


def _check_complete(weights, path, layer_idx) -> None:
    """Every parameter must have been written: they start NaN-filled."""
    names = ["w13_weight", "w2_weight", "w13_bias", "w2_bias", "shared_w13", "shared_w2",
             "w13_weight_scale", "w2_weight_scale"]
    for name in names:
        arr = getattr(weights, name, None)
        if arr is None or arr.size == 0:
            continue
        if np.isnan(arr.astype(np.float32, copy=False)).any():
            local = np.flatnonzero(np.isnan(arr.reshape(arr.shape[0], -1).astype(np.float32))
                                   .any(axis=1))
            where = (f"local experts {local[:8].tolist()}" if name.startswith(("w13", "w2"))
                     else "some rows")
            raise CheckpointError(f"layer {layer_idx} of {str(path)!r}: expected every weight "
                                  f"of {name} to be loaded, found {where} still unset (NaN) "
                                  f"after loading, or NaN in the checkpoint itself")


def _short(kwargs: dict) -> dict:
    return {k: (f"array{list(v.shape)}" if isinstance(v, np.ndarray) else v)
            for k, v in kwargs.items()}


# ----------------------------------------------------------------------------- router

def router_logits(layer, hidden_states: np.ndarray) -> np.ndarray:
    """`x @ router_weight.T (+ router_bias)` in fp32: f32 [T, E] from x [T, H]."""
    if getattr(layer, "router_weight", None) is None:
        raise ValueError("layer: expected a FusedMoE (or MoEWeights) loaded from a checkpoint "
                         "(with router_weight), got one without a router weight")
    x = np.asarray(hidden_states).astype(np.float32)
    w = layer.router_weight.astype(np.float32)                                  # [E, H]
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"hidden_states: expected shape (T, {w.shape[1]}), got {x.shape}")
    logits = x @ w.T                                                           # [T, E]
    if layer.router_bias is not None:
        logits += layer.router_bias.astype(np.float32)
    return logits
