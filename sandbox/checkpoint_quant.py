"""Quantized checkpoints as people download them, read into a quantized layer (sandbox/quant.py).

    N a projection's output rows, K its input columns (gate/up: N = I, K = H; down: N = H,
    K = I), G = K / group_size

`config.json` `quantization_config` says the format (checkpoint.load calls quant_config_of):

    quant_method "fp8" (DeepSeek-V3)   <proj>.weight F8_E4M3 [N, K] and <proj>.weight_scale_inv
                                       F32 [N/bn, K/bk] (weight_block_size [bn, bk], dynamic
                                       activations: activation_scheme "dynamic")
    "compressed-tensors"               <proj>.weight_packed I32 [N, K/8] (code + 8, eight
      (pack-quantized, int4 group)     nibbles a word, k = 8j + i at bits 4i), weight_scale
                                       [N, G] (bf16/f16/f32), weight_shape I32/I64 [2] = [N, K];
                                       symmetric only
    "gptq" (bits 4)                    <proj>.qweight I32 [K/8, N] (packed along K), scales F16
                                       [G, N], qzeros I32 [G, N/8] (zero point - 1, GPTQ v1),
                                       g_idx I32 [K]: act order (desc_act) is refused by name
                                       unless g_idx is the plain k // group_size
    "awq" (bits 4, version gemm)       <proj>.qweight I32 [K, N/8] (packed along N in AWQ's
                                       order: nibble i holds column 8c + [0,2,4,6,1,3,5,7][i]),
                                       qzeros I32 [G, N/8] (same order), scales F16 [G, N]

Every format is converted to the layer's layout (int4 codes in [0, 15], two a byte along K,
low nibble first; f32 scales [N, G]; zero points uint8 [N, G]) and loaded through the layer's
weight_loader. Shared experts (DeepSeek) are dequantized into the layer's float shared
experts. A tensor that does not match its config (dtype, shape, zero points a symmetric
config forbids, act order) raises CheckpointError naming it, before the layer is returned.

`to_format` is the inverse, used by `moe-sandbox data make` (sandbox/datagen.py) to write
the small checkpoints of data/.
"""
from __future__ import annotations

import json

import numpy as np

from . import quant as Q
from .checkpoint_error import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # nibble i of an AWQ word holds column 8c + this
FORMATS = ("fp8", "compressed-tensors", "gptq", "awq")


def _err(msg):
    return CheckpointError(msg)


def quant_config_of(config: dict | None):
    """(format, FusedMoEQuantConfig) from config.json's quantization_config, or None."""
    qc = (config or {}).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    where = "config.json quantization_config"
    if method == "fp8":
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise _err(f"{where}: activation_scheme {qc.get('activation_scheme')!r} with "
                       f"block weights; expected 'dynamic' (as vLLM's Fp8 MoE)")
        bs = qc.get("weight_block_size")
        if bs is None:
            raise _err(f"{where}: quant_method fp8 without weight_block_size is not a "
                       f"DeepSeek-V3 checkpoint; expected [128, 128]")
        return "fp8", Q.fp8_w8a8_moe_quant_config(block_shape=tuple(bs))
    if method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        if qc.get("format") != "pack-quantized" or len(groups) != 1:
            raise _err(f"{where}: expected format 'pack-quantized' with one config group, got "
                       f"{qc.get('format')!r} with {len(groups)}")
        w = groups[0].get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("strategy")) != (4, "int", "group"):
            raise _err(f"{where}: expected int4 group weights, got num_bits "
                       f"{w.get('num_bits')} type {w.get('type')} strategy {w.get('strategy')}")
        if not w.get("symmetric", True):
            raise _err(f"{where}: asymmetric compressed-tensors weights (weight_zero_point) "
                       f"are not supported; expected symmetric")
        if w.get("actorder") not in (None, False):
            raise _err(f"{where}: actorder {w.get('actorder')!r} (activation order) is not "
                       f"supported; expected null")
        return "compressed-tensors", Q.int4_w4a16_moe_quant_config(int(w["group_size"]))
    if method in ("gptq", "awq"):
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise _err(f"{where}: {method} with bits {bits}; expected 4")
        gs = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if method == "awq":
            if qc.get("version", "gemm").lower() != "gemm":
                raise _err(f"{where}: AWQ version {qc.get('version')!r}; expected 'gemm'")
            return "awq", Q.int4_w4a16_moe_quant_config(gs, has_zp=bool(qc.get("zero_point",
                                                                               True)))
        return "gptq", Q.int4_w4a16_moe_quant_config(gs, has_zp=not qc.get("sym", True))
    raise _err(f"{where}: quant_method {method!r} is not supported; expected one of "
               f"{list(FORMATS)}")


def tensor_names(fmt: str, prefix: str) -> tuple[str, ...]:
    """The on-disk names of one projection `prefix` (e.g. '...experts.3.gate_proj')."""
    return {"fp8": (f"{prefix}.weight", f"{prefix}.weight_scale_inv"),
            "compressed-tensors": (f"{prefix}.weight_packed", f"{prefix}.weight_scale",
                                   f"{prefix}.weight_shape"),
            "gptq": (f"{prefix}.qweight", f"{prefix}.scales", f"{prefix}.qzeros",
                     f"{prefix}.g_idx"),
            "awq": (f"{prefix}.qweight", f"{prefix}.scales", f"{prefix}.qzeros")}[fmt]


# ----------------------------------------------------------------------------- raw reads
def read_raw(path, name: str, dtype_map=None) -> np.ndarray:
    """One tensor of a safetensors file read from its header and bytes (safetensors'
    NumPy reader has no fp8: F8_E4M3 comes back as ml_dtypes.float8_e4m3fn)."""
    dtypes = {"F8_E4M3": Q.FP8, "I32": np.dtype("<i4"), "I64": np.dtype("<i8"),
              "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "U8": np.dtype(np.uint8),
              "I8": np.dtype(np.int8)}
    import ml_dtypes
    dtypes["BF16"] = np.dtype(ml_dtypes.bfloat16)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        info = header[name]
        start, end = info["data_offsets"]
        f.seek(8 + n + start)
        raw = f.read(end - start)
    return np.frombuffer(raw, dtype=dtypes[info["dtype"]]).reshape(info["shape"]).copy()


# ----------------------------------------------------------------------------- nibbles
def _nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words -> their 8 nibbles (bits 4i first) along `axis`, which grows 8x."""
    w = words.astype(np.uint32)
    nib = np.stack([(w >> np.uint32(4 * i)) & np.uint32(0xF) for i in range(8)], axis=-1)
    nib = np.moveaxis(nib, -1, axis + 1) if axis != w.ndim - 1 else nib
    shape = list(w.shape)
    shape[axis] *= 8
    return nib.reshape(shape).astype(np.uint8)


def _words(nib: np.ndarray, axis: int) -> np.ndarray:
    """The inverse of _nibbles: 8 nibbles along `axis` (k = 8j + i at bits 4i) -> int32."""
    n = np.moveaxis(nib.astype(np.uint32), axis, -1)
    n = n.reshape(n.shape[:-1] + (n.shape[-1] // 8, 8))
    w = np.zeros(n.shape[:-1], np.uint32)
    for i in range(8):
        w |= n[..., i] << np.uint32(4 * i)
    # contiguous: safetensors writes an array's memory as it lies, not in C order
    return np.ascontiguousarray(np.moveaxis(w.view(np.int32), -1, axis))


def _awq_perm(n):
    """Column order of AWQ's words: position 8c + i holds column 8c + AWQ_ORDER[i]."""
    return (np.arange(n) // 8) * 8 + np.array(AWQ_ORDER)[np.arange(n) % 8]


# ----------------------------------------------------------------------------- read
def from_format(fmt, cfg, t: dict, name: str, n: int, k: int):
    """One projection's format tensors `t` (by role) -> (codes, scale, zero point or None) in
    the layer's layout for a logical [n, k] weight. CheckpointError naming `name`."""
    from reference.quant import pack_int4

    def want(role, shape, dtypes):
        a = t[role]
        if a.dtype not in [np.dtype(d) for d in dtypes] or a.shape != tuple(shape):
            raise _err(f"tensor {name}.{role}: expected {'/'.join(str(np.dtype(d)) for d in dtypes)}"
                       f" {list(shape)} ({fmt}, {cfg.describe()}), found {a.dtype} "
                       f"{list(a.shape)}")
        return a
    if fmt == "fp8":
        bn, bk = cfg.block_shape
        q = want("weight", (n, k), (Q.FP8,))
        s = want("weight_scale_inv", (-(-n // bn), -(-k // bk)), (np.float32,))
        return q, s, None
    gs = cfg.group_size
    g = k // gs
    floats = (np.float16, np.float32)
    if fmt == "compressed-tensors":
        import ml_dtypes
        shape = t["weight_shape"].reshape(-1).tolist()
        if shape != [n, k]:
            raise _err(f"tensor {name}.weight_shape: expected [{n}, {k}], found {shape}")
        codes = _nibbles(want("weight_packed", (n, k // 8), (np.int32,)), 1)
        s = want("weight_scale", (n, g), floats + (ml_dtypes.bfloat16,)).astype(np.float32)
        return pack_int4(codes), s, None
    if fmt == "gptq":
        codes = _nibbles(want("qweight", (k // 8, n), (np.int32,)), 0).T    # [n, k]
        s = want("scales", (g, n), floats).astype(np.float32).T
        zp = (_nibbles(want("qzeros", (g, n // 8), (np.int32,)), 1).astype(np.int32) + 1).T
        g_idx = want("g_idx", (k,), (np.int32,))
        if not np.array_equal(g_idx, np.arange(k) // gs):
            raise _err(f"tensor {name}.g_idx: act order (desc_act: a permuted g_idx) is not "
                       f"supported; expected g_idx[k] = k // {gs}")
    else:
        perm = _awq_perm(n)
        codes = np.empty((k, n), np.uint8)
        codes[:, perm] = _nibbles(want("qweight", (k, n // 8), (np.int32,)), 1)
        codes = codes.T
        s = want("scales", (g, n), floats).astype(np.float32).T
        z = np.empty((g, n), np.int32)
        z[:, perm] = _nibbles(want("qzeros", (g, n // 8), (np.int32,)), 1)
        zp = z.T
    if zp.max() > 15:
        raise _err(f"tensor {name}.qzeros: expected int4 zero points, found {int(zp.max())}")
    if not cfg.has_zp:
        if np.any(zp != 8):
            raise _err(f"tensor {name}.qzeros: a symmetric config (sym / zero_point false) "
                       f"expects every zero point 8, found {sorted(set(zp.ravel().tolist()))[:4]}")
        zp = None
    return pack_int4(np.ascontiguousarray(codes)), np.ascontiguousarray(s), \
        None if zp is None else np.ascontiguousarray(zp.astype(np.uint8))


# ----------------------------------------------------------------------------- write
def to_format(fmt, cfg, w: np.ndarray) -> dict:
    """A float [n, k] weight quantized (reference/quant.py) into `fmt`'s tensors by role."""
    return {role: np.ascontiguousarray(v) for role, v in _to_format(fmt, cfg, w).items()}


def _to_format(fmt, cfg, w):
    from reference.quant import unpack_int4

    q, s, z = Q.quantize_experts(cfg, w[None])
    q, s = q[0], s[0]
    n, k = w.shape
    if fmt == "fp8":
        return {"weight": q, "weight_scale_inv": s.astype(np.float32)}
    codes = unpack_int4(q)                                              # [n, k] in [0, 15]
    zp = np.full(s.shape, 8, np.int32) if z is None else z[0].astype(np.int32)   # [n, G]
    if fmt == "compressed-tensors":
        return {"weight_packed": _words(codes, 1), "weight_scale": s.astype(np.float16),
                "weight_shape": np.array([n, k], np.int64)}
    if fmt == "gptq":
        return {"qweight": _words(codes.T, 0), "scales": s.T.astype(np.float16),
                "qzeros": _words((zp - 1).T, 1),
                "g_idx": (np.arange(k) // cfg.group_size).astype(np.int32)}
    perm = _awq_perm(n)
    return {"qweight": _words(codes.T[:, perm], 1), "scales": s.T.astype(np.float16),
            "qzeros": _words(zp.T[:, perm], 1)}


# ----------------------------------------------------------------------------- load
def _expert_weight(name: str, roles: dict) -> bool:
    return name.startswith(roles["experts"]) or (
        roles["shared"] is not None and name.startswith(roles["shared"]))


def expects(expects_list, files, roles, fmt, num_experts):
    """The plan's expectations with the float expert weights left out (their quantized
    tensors are checked as they are read, before the layer is returned); CheckpointError
    naming the first quantized tensor missing."""
    gate, up, down = roles["names"]
    prefixes = [f"{roles['experts']}{e}.{p}" for e in range(num_experts)
                for p in (gate, up, down)]
    if roles["shared"] is not None:
        prefixes += [f"{roles['shared']}{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    for prefix in prefixes:
        for name in tensor_names(fmt, prefix):
            if name not in files:
                raise _err(f"tensor {name!r}: expected by the {fmt} quantization_config, found "
                           f"no such tensor in {str(files.path)!r}")
    return [x for x in expects_list if not _expert_weight(x.name, roles)]


def load_experts(weights, files, roles, fmt, cfg, num_experts, score_bias=True):
    """Every local expert's projections read, converted and loaded through weights'
    weight_loader; shared experts dequantized into its float shared experts."""
    gate, up, down = roles["names"]
    i, h = weights.intermediate_size, weights.hidden_size
    expert_map = getattr(weights, "expert_map", None)

    def read(prefix, n, k):
        t = {name.rsplit(".", 1)[1]: read_raw(files.weight_map[name], name)
             for name in tensor_names(fmt, prefix)}
        return from_format(fmt, cfg, t, prefix, n, k)

    for e in range(num_experts):
        if expert_map is not None and int(expert_map[e]) < 0:
            continue
        for part, shard, (n, k) in ((gate, "w1", (i, h)), (up, "w3", (i, h)),
                                    (down, "w2", (h, i))):
            prefix = f"{roles['experts']}{e}.{part}"
            q, s, z = read(prefix, n, k)
            base = "w2" if shard == "w2" else "w13"
            try:
                for what, v in (("weight", q), ("weight_scale", s), ("weight_zero_point", z)):
                    if v is not None:
                        weights.weight_loader(getattr(weights, f"{base}_{what}"), v,
                                              f"{prefix}.{what}", shard, e)
            except (TypeError, ValueError) as exc:
                raise _err(f"tensor {prefix!r}: the layer refused it: {exc}") from exc
    if roles["shared"] is not None:
        i_s = weights.shared_intermediate_size
        for part, shard, (n, k) in (("gate_proj", "w1", (i_s, h)), ("up_proj", "w3", (i_s, h)),
                                    ("down_proj", "w2", (h, i_s))):
            prefix = f"{roles['shared']}{part}"
            q, s, z = read(prefix, n, k)
            w = Q.dequantize_experts(cfg, q[None], s[None], None if z is None else z[None])[0]
            param = weights.shared_w2 if shard == "w2" else weights.shared_w13
            weights.weight_loader(param, w, prefix + ".weight", shard, None)
    if roles["score_bias"] is not None and score_bias:
        weights.set_e_score_correction_bias(files.read(roles["score_bias"]))
