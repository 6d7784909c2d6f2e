"""Small reproducible MoE checkpoints and router-logit traces, from one seed.

`moe-sandbox data make [--out DIR] [--seed 0]` writes, under DIR (default
./moe-sandbox-results/data; `--out data` in the checkout regenerates the committed files),
through a temporary folder moved into place at the end (a failure leaves DIR as it was; see
make_all):

    mixtral/      config.json + model.safetensors   Mixtral naming, E=8  K=2 H=64 I=128
    qwen3_moe/    config.json + model.safetensors   Qwen3-MoE naming, E=16 K=4 H=64 I=64
    deepseek_v3/  config.json + model.safetensors   DeepSeek-V3 naming, E=16 K=4 H=96 I=64,
                                                    sigmoid grouped top-k (4 groups, keep 2),
                                                    e_score_correction_bias, 1 shared expert
    gpt_oss/      config.json + model.safetensors   gpt-oss naming, E=8 K=2 H=64 I=64, fused
                                                    experts with gate/up interleaved + biases
    deepseek_v3_fp8/   DeepSeek-V3's native fp8 (E=8 K=2 H=128 I=128): weight F8_E4M3 +
                       weight_scale_inv per 128x128 block; quantization_config fp8
    qwen3_moe_w4a16/   compressed-tensors pack-quantized int4, groups of 32 (qwen3_moe's weights)
    qwen3_moe_gptq/    GPTQ int4 (qweight, scales, qzeros, g_idx), groups of 32, symmetric
    mixtral_awq/       AWQ int4 (qweight, scales, qzeros), groups of 32, zero points
    traces/<family>_<distribution>.npz              hidden_states f32 [T, H], router_logits
                                                    f32 [T, E] for that family's MoE layer

Every checkpoint has two decoder layers; layer 1 (`MOE_LAYER`) is a MoE layer in every
family. Layer 0 is one too (other weights), except DeepSeek's, a dense MLP as
`first_k_dense_replace=1` says. Weights are bf16 (DeepSeek's `e_score_correction_bias` is fp32,
as in the real checkpoints). Weight scales keep every activation O(1): `gate/up ~ N(0, 1/H)`,
`down ~ N(0, 1/I)`.

Trace distributions (T tokens, E experts, K top-k); logits are drawn directly, so a trace
fixes the routing whatever the router weight is:

    balanced     token t prefers experts (t*K + k) mod E, k < K: every expert gets T*K/E slots
    zipf         each token draws K distinct experts from a Zipf(1.2) popularity over a random
                 expert order: a few hot experts take most slots, the tail gets a handful
    one_expert   every token picks the same K experts, E//2 first (then E//2+1, ... mod E):
                 one expert holds every token and E-K experts get none
    nan_rows     balanced, then every 8th row has one NaN logit and every 16th (from row 4)
                 is all NaN: vLLM's routing kernels give those tokens defined ids and
                 finite weights (docs/stages.md, route), no NaN reaches an output

Determinism: the same seed gives byte-identical files. Tensors come from
`numpy.random.default_rng(SeedSequence([seed, family_index, purpose]))`; safetensors writes
a sorted header; `.npz` archives are written with a fixed timestamp (numpy's own `savez`
stamps the current time into the zip).
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import shutil
import tempfile
import zipfile

import ml_dtypes
import numpy as np

MOE_LAYER = 1
NUM_LAYERS = 2
DISTRIBUTIONS = ("balanced", "zipf", "one_expert", "nan_rows")
TRACE_TOKENS = {"balanced": 128, "zipf": 256, "one_expert": 64, "nan_rows": 64}
ZIPF_EXPONENT = 1.2
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest date a zip header can hold


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """The sizes of one generated checkpoint (E experts, K top-k, H hidden, I intermediate)."""

    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    dense_intermediate_size: int = 128  # DeepSeek's dense layer 0 / Qwen3's `intermediate_size`
    n_group: int = 0
    topk_group: int = 0
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0


FAMILIES = {
    "mixtral": FamilySpec("mixtral", num_experts=8, top_k=2, hidden_size=64,
                          intermediate_size=128),
    "qwen3_moe": FamilySpec("qwen3_moe", num_experts=16, top_k=4, hidden_size=64,
                            intermediate_size=64),
    "deepseek_v3": FamilySpec("deepseek_v3", num_experts=16, top_k=4, hidden_size=96,
                              intermediate_size=64, n_group=4, topk_group=2,
                              n_shared_experts=1, routed_scaling_factor=2.5),
    "gpt_oss": FamilySpec("gpt_oss", num_experts=8, top_k=2, hidden_size=64,
                          intermediate_size=64),
}
FAMILY_ORDER = tuple(FAMILIES)  # the index of a family feeds its seed: never reorder

# quantized checkpoints in the formats people download (sandbox/checkpoint_quant.py): a
# family's float weights (its own seed stream, sizes as given) quantized and packed.
# name -> (family, format, quantization_config, size overrides)
QUANT_CHECKPOINTS = {
    # DeepSeek-V3's native fp8: 128x128 blocks need H and I multiples of 128
    "deepseek_v3_fp8": ("deepseek_v3", "fp8",
                        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128]},
                        dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=128)),
    "qwen3_moe_w4a16": ("qwen3_moe", "compressed-tensors",
                        {"quant_method": "compressed-tensors", "format": "pack-quantized",
                         "config_groups": {"group_0": {
                             "targets": ["Linear"], "input_activations": None,
                             "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                         "strategy": "group", "group_size": 32,
                                         "actorder": None}}},
                         "ignore": ["lm_head", "re:.*mlp.gate$"]}, {}),
    "qwen3_moe_gptq": ("qwen3_moe", "gptq",
                       {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                        "sym": True}, {}),
    "mixtral_awq": ("mixtral", "awq",
                    {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                     "version": "gemm"}, {}),
}


# ----------------------------------------------------------------------------- random draws

def _rng(seed: int, family: str, purpose: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, FAMILY_ORDER.index(family),
                                                         purpose]))


def _normal_bf16(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(
        ml_dtypes.bfloat16)


# ----------------------------------------------------------------------------- checkpoints

def config_for(spec: FamilySpec) -> dict:
    """The Hugging Face `config.json` of a generated checkpoint (the keys the loader reads,
    plus the identifying ones)."""
    common = {"hidden_size": spec.hidden_size, "num_hidden_layers": NUM_LAYERS,
              "torch_dtype": "bfloat16", "num_experts_per_tok": spec.top_k,
              "hidden_act": "silu", "rms_norm_eps": 1e-6}
    if spec.name == "mixtral":
        return {**common, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": spec.num_experts,
                "intermediate_size": spec.intermediate_size}
    if spec.name == "qwen3_moe":
        return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "num_experts": spec.num_experts, "moe_intermediate_size": spec.intermediate_size,
                "intermediate_size": spec.dense_intermediate_size, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": []}
    if spec.name == "deepseek_v3":
        return {**common, "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3", "n_routed_experts": spec.num_experts,
                "moe_intermediate_size": spec.intermediate_size,
                "intermediate_size": spec.dense_intermediate_size,
                "n_shared_experts": spec.n_shared_experts, "n_group": spec.n_group,
                "topk_group": spec.topk_group, "topk_method": "noaux_tc",
                "scoring_func": "sigmoid", "norm_topk_prob": True,
                "routed_scaling_factor": spec.routed_scaling_factor,
                "first_k_dense_replace": 1, "moe_layer_freq": 1}
    if spec.name == "gpt_oss":
        return {**common, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "num_local_experts": spec.num_experts,
                "intermediate_size": spec.intermediate_size, "swiglu_limit": 7.0}
    raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {spec.name!r}")


def make_tensors(spec: FamilySpec, seed: int = 0) -> dict[str, np.ndarray]:
    """All tensors of a generated checkpoint, by their on-disk Hugging Face names."""
    rng = _rng(seed, spec.name, 0)
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size  # noqa: E741
    s_in, s_down = 1.0 / np.sqrt(H), 1.0 / np.sqrt(I)
    out: dict[str, np.ndarray] = {}
    for layer in range(NUM_LAYERS):
        p = f"model.layers.{layer}"
        # norms make the file look like a real decoder layer; the loader must ignore them
        out[f"{p}.input_layernorm.weight"] = np.ones(H, ml_dtypes.bfloat16)
        out[f"{p}.post_attention_layernorm.weight"] = np.ones(H, ml_dtypes.bfloat16)
        if spec.name == "mixtral":
            out[f"{p}.block_sparse_moe.gate.weight"] = _normal_bf16(rng, (E, H), s_in)  # [E, H]
            for e in range(E):
                q = f"{p}.block_sparse_moe.experts.{e}"
                out[f"{q}.w1.weight"] = _normal_bf16(rng, (I, H), s_in)     # gate [I, H]
                out[f"{q}.w3.weight"] = _normal_bf16(rng, (I, H), s_in)     # up   [I, H]
                out[f"{q}.w2.weight"] = _normal_bf16(rng, (H, I), s_down)   # down [H, I]
        elif spec.name == "deepseek_v3" and layer == 0:
            Id = spec.dense_intermediate_size
            out[f"{p}.mlp.gate_proj.weight"] = _normal_bf16(rng, (Id, H), s_in)
            out[f"{p}.mlp.up_proj.weight"] = _normal_bf16(rng, (Id, H), s_in)
            out[f"{p}.mlp.down_proj.weight"] = _normal_bf16(rng, (H, Id), 1.0 / np.sqrt(Id))
        elif spec.name in ("qwen3_moe", "deepseek_v3"):
            out[f"{p}.mlp.gate.weight"] = _normal_bf16(rng, (E, H), s_in)  # [E, H]
            for e in range(E):
                q = f"{p}.mlp.experts.{e}"
                out[f"{q}.gate_proj.weight"] = _normal_bf16(rng, (I, H), s_in)
                out[f"{q}.up_proj.weight"] = _normal_bf16(rng, (I, H), s_in)
                out[f"{q}.down_proj.weight"] = _normal_bf16(rng, (H, I), s_down)
            if spec.name == "deepseek_v3":
                Is = spec.n_shared_experts * I  # noqa: E741
                out[f"{p}.mlp.gate.e_score_correction_bias"] = (
                    rng.standard_normal(E, dtype=np.float32) * np.float32(0.1))  # [E] fp32
                q = f"{p}.mlp.shared_experts"
                out[f"{q}.gate_proj.weight"] = _normal_bf16(rng, (Is, H), s_in)
                out[f"{q}.up_proj.weight"] = _normal_bf16(rng, (Is, H), s_in)
                out[f"{q}.down_proj.weight"] = _normal_bf16(rng, (H, Is), 1.0 / np.sqrt(Is))
        elif spec.name == "gpt_oss":
            q = f"{p}.mlp"
            out[f"{q}.router.weight"] = _normal_bf16(rng, (E, H), s_in)   # [E, H]
            out[f"{q}.router.bias"] = _normal_bf16(rng, (E,), 0.1)        # [E]
            # [E, H, 2I]: column 2j is gate j, column 2j+1 is up j (interleaved, on disk as
            # the model stores it: y = x @ gate_up_proj[e] + gate_up_proj_bias[e])
            out[f"{q}.experts.gate_up_proj"] = _normal_bf16(rng, (E, H, 2 * I), s_in)
            out[f"{q}.experts.gate_up_proj_bias"] = _normal_bf16(rng, (E, 2 * I), 0.1)
            out[f"{q}.experts.down_proj"] = _normal_bf16(rng, (E, I, H), s_down)  # [E, I, H]
            out[f"{q}.experts.down_proj_bias"] = _normal_bf16(rng, (E, H), 0.1)
        else:
            raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {spec.name!r}")
    return out


def write_checkpoint(spec: FamilySpec, out_dir: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write `out_dir/config.json` and `out_dir/model.safetensors`; returns `out_dir`."""
    from safetensors.numpy import save_file

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_text(out_dir / "config.json", json.dumps(config_for(spec), indent=2, sort_keys=True))
    save_file(make_tensors(spec, seed), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    return out_dir


def quant_tensors(name: str, seed: int = 0) -> tuple[FamilySpec, dict[str, np.ndarray]]:
    """The family spec and the tensors of quantized checkpoint `name` (QUANT_CHECKPOINTS):
    every routed and shared expert projection replaced by its format's tensors."""
    import re

    from . import checkpoint_quant as CQ

    family, fmt, qcfg, sizes = QUANT_CHECKPOINTS[name]
    spec = dataclasses.replace(FAMILIES[family], **sizes)
    cfg = CQ.quant_config_of({"quantization_config": qcfg})[1]
    out = {}
    pat = re.compile(r"model\.layers\.\d+\.(?:block_sparse_moe|mlp)\.(?:experts\.\d+|"
                     r"shared_experts)\.\w+\.weight$")
    for tname, t in make_tensors(spec, seed).items():
        if pat.match(tname):
            for role, v in CQ.to_format(fmt, cfg, t.astype(np.float32)).items():
                out[f"{tname[:-len('.weight')]}.{role}"] = v
        else:
            out[tname] = t
    return spec, out


def write_quant_checkpoint(name: str, out_dir: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Write quantized checkpoint `name`: config.json (with quantization_config) and
    model.safetensors (fp8 as F8_E4M3, packed int4 as I32)."""
    from safetensors.numpy import save_file

    spec, tensors = quant_tensors(name, seed)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {**config_for(spec), "quantization_config": QUANT_CHECKPOINTS[name][2]}
    _write_text(out_dir / "config.json", json.dumps(config, indent=2, sort_keys=True))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def shard_checkpoint(src: pathlib.Path, dst: pathlib.Path, num_shards: int = 2) -> pathlib.Path:
    """Split a one-file checkpoint into `num_shards` files plus `model.safetensors.index.json`
    (the Hugging Face sharded layout; tensors dealt out round-robin in name order so that one
    expert's gate, up and down land in different files). Returns `dst`."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    if (src / "config.json").exists():
        _write_text(dst / "config.json", (src / "config.json").read_text())
    shards: list[dict[str, np.ndarray]] = [{} for _ in range(num_shards)]
    weight_map = {}
    with safe_open(str(src / "model.safetensors"), framework="numpy") as f:
        for i, name in enumerate(sorted(f.keys())):
            fname = f"model-{i % num_shards + 1:05d}-of-{num_shards:05d}.safetensors"
            shards[i % num_shards][name] = f.get_tensor(name)
            weight_map[name] = fname
    total = 0
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_text(dst / "model.safetensors.index.json", json.dumps(index, indent=2, sort_keys=True))
    return dst


# ----------------------------------------------------------------------------- traces

def make_trace(distribution: str, num_tokens: int, hidden_size: int, num_experts: int,
               top_k: int, seed: int = 0, family: str = "mixtral") -> dict[str, np.ndarray]:
    """One router-logit trace: `hidden_states` f32 [T, H] ~ N(0, 1) and `router_logits`
    f32 [T, E] shaped so that the top-k follows `distribution` (see the module docstring).

    The chosen experts of a token get logits `4 + 1.5*(K-k)` above a N(0, 0.2^2) floor: a
    noise swap of two chosen experts would need a 5-sigma draw, so the order of the K is the
    one the distribution asks for, and no near-tie decides anything."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution: expected one of {DISTRIBUTIONS}, got {distribution!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected 1 <= top_k <= num_experts={num_experts}, "
                         f"got {top_k}")
    T, H, E, K = num_tokens, hidden_size, num_experts, top_k
    rng = _rng(seed, family, 1 + DISTRIBUTIONS.index(distribution))
    hidden_states = rng.standard_normal((T, H), dtype=np.float32)              # [T, H]
    logits = rng.normal(0.0, 0.2, (T, E)).astype(np.float32)                  # [T, E]
    boost = np.float32(4.0) + np.float32(1.5) * np.arange(K, 0, -1, dtype=np.float32)  # [K]
    if distribution in ("balanced", "nan_rows"):
        chosen = (np.arange(T)[:, None] * K + np.arange(K)[None, :]) % E       # [T, K]
    elif distribution == "zipf":
        ranks = rng.permutation(E)
        popularity = 1.0 / (ranks + 1.0) ** ZIPF_EXPONENT
        popularity /= popularity.sum()
        chosen = np.array([rng.choice(E, K, replace=False, p=popularity) for _ in range(T)],
                          dtype=np.int64).reshape(T, K)
    else:  # one_expert
        chosen = np.broadcast_to((E // 2 + np.arange(K)) % E, (T, K))
    if T:
        logits[np.arange(T)[:, None], chosen] += boost[None, :]
    if distribution == "nan_rows":
        one_nan = np.arange(0, T, 8)
        logits[one_nan, rng.integers(0, E, one_nan.size)] = np.nan
        logits[np.arange(4, T, 16)] = np.nan
    return {"hidden_states": hidden_states, "router_logits": logits,
            "family": np.array(family), "distribution": np.array(distribution),
            "top_k": np.array(K, np.int32), "seed": np.array(seed, np.int64)}


def save_npz(path: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
    """`np.savez_compressed` with a fixed timestamp, so the same arrays give the same bytes."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(arrays):
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            member = io.BytesIO()
            np.lib.format.write_array(member, np.asarray(arrays[name]), allow_pickle=False)
            zf.writestr(info, member.getvalue())
    path.write_bytes(buf.getvalue())


def load_trace(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    """`(hidden_states [T, H], router_logits [T, E])` of a trace file."""
    with np.load(path, allow_pickle=False) as z:
        missing = {"hidden_states", "router_logits"} - set(z.files)
        if missing:
            raise ValueError(f"trace {path}: expected arrays hidden_states and router_logits, "
                             f"missing {sorted(missing)}")
        return z["hidden_states"], z["router_logits"]


# ----------------------------------------------------------------------------- all of data/

SEED_LIMIT = 2 ** 63   # the traces store their seed as int64


def check_seed(seed) -> int:
    """`seed` as an int in [0, 2**63) (SeedSequence needs >= 0; the traces store int64)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed: expected an int >= 0, got {seed}")
    if seed >= SEED_LIMIT:
        raise ValueError(f"seed: expected an int < 2**63 (the traces store it as int64), "
                         f"got {seed}")
    return int(seed)


def check_out(out) -> pathlib.Path:
    """`out` as a Path to a folder, existing or not (ValueError when it is a file)."""
    out = pathlib.Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: expected a folder (existing or to create), got {str(out)!r}, "
                         f"which is a file")
    return out


def make_all(out: pathlib.Path = pathlib.Path("data"), seed: int = 0,
             progress=None) -> list[pathlib.Path]:
    """Write every family's checkpoint and every trace under `out`; returns the files written.
    `progress(message)` is called once per item when given.

    Everything is written into a temporary folder beside `out` first and moved into place
    at the end (a new `out`: one rename; an existing one: a rename per file, undone if one
    fails), so a failure anywhere leaves `out` as it was: never half-written. Files of `out`
    that make_all does not write (data/README.md) are kept."""
    seed = check_seed(seed)
    out = check_out(out)
    anchor = out.parent
    while not anchor.exists():       # the temporary folder must be on out's file system
        anchor = anchor.parent
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=anchor))
    try:
        staged = tmp / "new"
        relative = []
        for name, spec in FAMILIES.items():
            if progress:
                progress(f"checkpoint {name}")
            write_checkpoint(spec, staged / name, seed)
            relative += [pathlib.Path(name, "config.json"), pathlib.Path(name, "model.safetensors")]
            for dist in DISTRIBUTIONS:
                trace = make_trace(dist, TRACE_TOKENS[dist], spec.hidden_size,
                                   spec.num_experts, spec.top_k, seed, family=name)
                rel = pathlib.Path("traces", f"{name}_{dist}.npz")
                save_npz(staged / rel, trace)
                relative.append(rel)
        for name in QUANT_CHECKPOINTS:
            if progress:
                progress(f"checkpoint {name}")
            write_quant_checkpoint(name, staged / name, seed)
            relative += [pathlib.Path(name, "config.json"), pathlib.Path(name, "model.safetensors")]
        _install(staged, relative, out, tmp / "old")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / rel for rel in relative]


def _install(staged: pathlib.Path, relative: list, out: pathlib.Path,
             backup: pathlib.Path) -> None:
    """Move the files `relative` of `staged` into `out`: all of them or, on a failure, none
    (the files they replace wait in `backup` until every move is done)."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, out)
        return
    moved, saved, made = [], [], []
    try:
        for rel in relative:
            dst = out / rel
            if not dst.parent.exists():
                missing = [p for p in [dst.parent, *dst.parent.parents]
                           if out in p.parents and not p.exists()]
                dst.parent.mkdir(parents=True)
                made += sorted(missing, key=lambda p: len(p.parts))
            if dst.exists():
                (backup / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(dst, backup / rel)
                saved.append(rel)
            os.replace(staged / rel, dst)
            moved.append(rel)
    except BaseException:
        for rel in reversed(moved):
            os.replace(out / rel, staged / rel)
        for rel in reversed(saved):
            os.replace(backup / rel, out / rel)
        for d in reversed(made):
            d.rmdir()
        raise


def _write_text(path: pathlib.Path, text: str) -> None:
    path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
