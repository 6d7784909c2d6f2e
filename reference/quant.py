"""Quantized MoE: fp8 (per-tensor, per-token, DeepSeek-V3 block), int8 w8a8, weight-only int8/int4.

    T tokens, E experts (E_local on this rank), K top-k, P = T*K slots, H hidden, I intermediate,
    N a GEMM's output width (2I for GEMM1, H for GEMM2), Kdim its reduction width (H, then I),
    G groups along Kdim, NB = cdiv(N, bn), KB = cdiv(Kdim, bk) for block_shape = [bn, bk]

The semantics are those of vLLM's fused_experts with its argument names (use_fp8_w8a8,
use_int8_w8a8, use_int8_w8a16, use_int4_w4a16, per_act_token_quant, per_channel_quant,
block_shape, w1_scale, w2_scale, w1_zp, w2_zp, a1_scale, a2_scale). The oracle of every
quantized GEMM is "dequantize, then matmul in fp32":

    c[s] = (deq(a)[s // top_k] @ deq(w[e]).T + bias[e]) * r[s]
    (r = topk_weights.flat when mul_routed_weight, else 1)

rounded once to the activation dtype (bf16). A kernel that scales partial sums block by
block (vLLM's Triton kernel, ours) equals it up to fp32 accumulation order.

Formats (x = a real value, q = its stored code, s = its scale; all scale math in fp32):

    fp8 e4m3fn   q = e4m3(clamp(x / s, -448, 448))   (ml_dtypes.float8_e4m3fn, round to nearest
                 even; the clamp comes first because e4m3fn has no inf: a value past 448 would
                 cast to NaN)                                          x ~ float(q) * s
    int8         q = clamp(round_half_away(x / s), -128, 127)  (Triton's libdevice.round, as vLLM's
                 per_token_quant_int8)                                 x ~ q * s
    int4 (w4a16) q in [0, 15] unsigned, packed two per byte along Kdim: byte j of a row holds
                 k = 2j in its low nibble and k = 2j+1 in its high nibble ([E, N, Kdim/2] uint8)
                                                                       x ~ (q - zp) * s
    int8 (w8a16) uint8 codes in [0, 255] with a zero point (GPTQ-style), x ~ (q - zp) * s; or
                 int8 codes with no zero point (vLLM's ExpertsInt8 layout), x ~ q * s

Scales, by granularity (the shape decides, the flags must agree):

    activations   per-tensor  a_scale [1]       static when given, else dynamic over the batch
                  per-token   a_scale [M, 1]    per_act_token_quant=True
                  per-group   a_scale [M, KB]   block_shape = [bn, bk]: groups of bk columns
    w8a8 weights  per-tensor  w_scale [E]       (one per expert)
                  per-channel w_scale [E, N]    per_channel_quant=True ([E, N, 1] accepted)
                  per-block   w_scale [E, NB, KB]
    w4a16/w8a16   per-group   w_scale [E, N, G] block_shape = [0, group_size] (None: G = Kdim /
                              group_size inferred from the shape, G = 1 is per-channel);
                              w_zp [E, N, G] uint8, one unpacked code per group, or None

Dynamic activation scales (the formulas of vLLM's kernels):

    fp8 per-tensor / per-token   s = max(absmax / 448, 1 / (448 * 512))  (vLLM's per-token floor,
                                 used per-tensor too so that an all-zero batch stays finite)
    fp8 per-group (1 x bk)       s = max(absmax, 1e-10) / 448, optionally rounded up to a power
                                 of two (use_ue8m0, DeepSeek-V3 / DeepGEMM's UE8M0 scales)
    int8 per-token / per-group   s = max(absmax, 1e-10) / 127

Default zero points (no w_zp given), as vLLM's GPTQ/AWQ-style w4a16/w8a16 Triton kernel
(`fused_moe_kernel_gptq_awq`, b_zp_num): 8 for int4 codes, 128 for uint8 codes, and 0 for int8
codes. Our zero points are stored unpacked, one uint8 per (expert, row n, group); vLLM packs
int4 zero points two per byte along N.

Pipeline (fused_experts_quant): quantize x -> GEMM1 (dequantized in the main loop) -> bf16 ->
activation -> bf16 -> quantize -> GEMM2 (* router weight) -> bf16 -> moe_sum; the weight-only
formats skip both activation quantizations.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ._checks import (
    FLOAT_DTYPES,
    check_array,
    check_choice,
    check_float,
    check_positive_int,
)
from .activation import apply_activation
from .align import moe_align_block_size
from .combine import moe_sum
from .experts import DEFAULT_BLOCK_SIZE, check_expert_routing, check_topk_arrays, check_w1_rows
from .gemm import grouped_gemm, walk_expert_blocks
from .precision import compute_dtype

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0                               # largest finite e4m3fn
INT8_MAX, INT8_MIN = 127, -128
GROUP_EPS = 1e-10                             # absmax floor of the group quantizers
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)       # vLLM's floor on dynamic per-token fp8 scales
DEFAULT_BLOCK_SHAPE = (128, 128)              # DeepSeek-V3: 128x128 weight blocks, 1x128 groups
INT4_ZERO_POINT, UINT8_ZERO_POINT = 8, 128    # default zero points of the w4a16 / w8a16 codes
ACT_QUANT_DTYPES = ("fp8", "int8")

_F32 = np.float32
_ACT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def _cdiv(a, b):
    return -(-a // b)


# ----------------------------------------------------------------------------- rounding, casts
def round_half_away(x):
    """Round to the nearest integer, ties away from zero (CUDA's roundf), in float64.

    float64 keeps `x + 0.5` exact for every fp32 input, so 0.49999997 rounds to 0, not 1."""
    x = np.asarray(x, dtype=np.float64)
    return np.trunc(x + np.copysign(0.5, x))


def cast_fp8(y):
    """fp32 values -> e4m3fn codes: clamp to +-448 first (e4m3fn overflows to NaN), then
    round to nearest even. NaN stays NaN."""
    y = np.asarray(y, dtype=_F32)
    # np.clip keeps NaN (CUDA's fminf/fmaxf would drop it): a NaN input stays visible
    return np.clip(y, _F32(-FP8_MAX), _F32(FP8_MAX)).astype(FP8_DTYPE)


def cast_int8(y):
    """fp32 values -> int8 codes: round half away from zero, clamp to [-128, 127].
    NaN has no int8 code (it becomes 0); a NaN scale still makes the dequantized row NaN."""
    r = np.clip(round_half_away(y), INT8_MIN, INT8_MAX)
    return np.nan_to_num(r, nan=0.0).astype(np.int8)


def pow2_ceil(s):
    """The smallest power of two >= s for positive finite fp32 s (UE8M0 scales), bit-exact:
    a scale with a non-zero mantissa moves to the next exponent. Others pass unchanged."""
    s = np.ascontiguousarray(s, dtype=_F32)
    bits = s.view(np.uint32)
    finite_pos = np.isfinite(s) & (s > 0)
    up = ((bits & np.uint32(0x7F800000)) + np.uint32(0x00800000)).astype(np.uint32)
    out = np.where(finite_pos & ((bits & np.uint32(0x007FFFFF)) != 0), up, bits)
    return out.astype(np.uint32).view(_F32)


# ----------------------------------------------------------------------------- activations
def _check_act(name, x):
    check_array(name, x, ndim=2, dtypes=_ACT_DTYPES)
    return x.astype(_F32)


def scaled_fp8_quant(x, scale=None, use_per_token_if_dynamic=False):
    """fp8 e4m3 with one scale for the whole tensor or one per row (vLLM's scaled_fp8_quant).

    x [M, Kdim] (bf16 / fp16 / fp32). `scale` given: static per-tensor ([1] or a scalar).
    Dynamic: s = max(absmax / 448, 1/(448*512)) over the tensor, or over each row when
    use_per_token_if_dynamic. Returns q fp8 [M, Kdim], scale f32 [1] or [M, 1].
    """
    xf = _check_act("x", x)
    if scale is not None:
        s = np.asarray(scale, dtype=_F32).reshape(-1)
        if s.size != 1:
            raise ValueError(f"scale: expected one static per-tensor scale, got shape "
                             f"{np.shape(scale)}")
        return cast_fp8(xf / s[0]), s.copy()
    # np.max propagates NaN: a NaN in the batch (row) makes its scale NaN, so everything it
    # scales dequantizes to NaN rather than to finite garbage
    if use_per_token_if_dynamic:
        amax = np.abs(xf).max(axis=1, keepdims=True) if xf.shape[1] else \
            np.zeros((xf.shape[0], 1), _F32)                                     # [M, 1]
    else:
        amax = np.abs(xf).max().reshape(1, 1) if xf.size else np.zeros((1, 1), _F32)
    s = np.maximum(amax / _F32(FP8_MAX), _F32(FP8_MIN_SCALE)).astype(_F32)
    q = cast_fp8(xf / s)
    return q, (s if use_per_token_if_dynamic else s.reshape(1))


def _group_quant(x, group_size, qmax, eps, use_ue8m0):
    """absmax scales of 1 x group_size column groups: s [M, G], and x / s broadcast back."""
    xf = _check_act("x", x)
    m, k = xf.shape
    group_size = check_positive_int("group_size", group_size)
    if k % group_size:
        raise ValueError(f"group_size: expected a divisor of x's {k} columns, got {group_size}")
    g = k // group_size
    xg = xf.reshape(m, g, group_size)                                  # [M, G, gs]
    amax = np.max(np.abs(xg), axis=2) if xg.size else np.zeros((m, g), _F32)   # [M, G]
    s = (np.maximum(amax, _F32(eps)) / _F32(qmax)).astype(_F32)
    if use_ue8m0:
        s = pow2_ceil(s)
    return (xg / s[:, :, None]).reshape(m, k), s


def per_token_group_quant_fp8(x, group_size, eps=GROUP_EPS, use_ue8m0=False):
    """fp8 e4m3 per 1 x group_size groups of columns (DeepSeek-V3's activation format).

    s[m, g] = max(absmax(x[m, g*gs:(g+1)*gs]), eps) / 448 (rounded up to a power of two with
    use_ue8m0); q = e4m3(clamp(x / s, -448, 448)). x [M, Kdim] -> q fp8 [M, Kdim], s f32 [M, G].
    """
    y, s = _group_quant(x, group_size, FP8_MAX, eps, use_ue8m0)
    return cast_fp8(y), s


def per_token_group_quant_int8(x, group_size, eps=GROUP_EPS):
    """int8 per 1 x group_size groups: s = max(absmax, eps) / 127, q = round_half_away(x / s).
    x [M, Kdim] -> q int8 [M, Kdim], s f32 [M, G]."""
    y, s = _group_quant(x, group_size, INT8_MAX, eps, False)
    return cast_int8(y), s


def per_token_quant_int8(x):
    """int8 per row (vLLM's per_token_quant_int8): a group as wide as the row.
    x [M, Kdim] -> q int8 [M, Kdim], s f32 [M, 1]."""
    xf = _check_act("x", x)
    if xf.shape[1] == 0:
        return np.zeros(xf.shape, np.int8), np.full((xf.shape[0], 1), GROUP_EPS / INT8_MAX, _F32)
    return per_token_group_quant_int8(x, xf.shape[1])


def scaled_int8_quant(x, scale=None):
    """int8 with a static per-tensor scale (given) or dynamic per-row scales (vLLM's
    scaled_int8_quant, symmetric). x [M, Kdim] -> q int8, s f32 [1] or [M, 1]."""
    if scale is None:
        return per_token_quant_int8(x)
    xf = _check_act("x", x)
    s = np.asarray(scale, dtype=_F32).reshape(-1)
    if s.size != 1:
        raise ValueError(f"scale: expected one static per-tensor scale, got shape "
                         f"{np.shape(scale)}")
    return cast_int8(xf / s[0]), s.copy()


def _scaled_int8_tensor_dynamic(x):
    xf = _check_act("x", x)
    amax = np.max(np.abs(xf)) if xf.size else _F32(0)
    s = np.array([max(amax, _F32(GROUP_EPS)) / _F32(INT8_MAX)], dtype=_F32)
    return cast_int8(xf / s[0]), s


def moe_kernel_quantize_input(a, a_scale, quant_dtype, per_act_token_quant=False,
                              block_shape=None, use_ue8m0=False):
    """Quantize a GEMM's activations the way fused_experts does before each GEMM.

    quant_dtype None (bf16 or weight-only): (a, None). Otherwise "fp8" or "int8":
      block_shape [bn, bk]     per-token-group, groups of bk columns       -> a_scale [M, KB]
      per_act_token_quant      dynamic per-token                            -> a_scale [M, 1]
      else                     per-tensor, static a_scale if given, else dynamic -> [1]
    """
    if quant_dtype is None:
        return a, None
    check_choice("quant_dtype", quant_dtype, ACT_QUANT_DTYPES)
    if block_shape is not None:
        bk = block_shape_of(block_shape)[1]
        if a_scale is not None:
            raise ValueError("a_scale: block quantization computes its own per-group scales; "
                             "expected None, got an array")
        k = a.shape[1] if getattr(a, "ndim", 0) == 2 else 0
        if k % bk:
            # vLLM's group quantizer needs whole groups: pad with zeros (a zero never raises
            # a group's absmax), quantize, cut back
            pad = np.zeros((a.shape[0], _cdiv(k, bk) * bk - k), dtype=a.dtype)
            q, s = moe_kernel_quantize_input(np.concatenate([a, pad], axis=1), None, quant_dtype,
                                             False, block_shape, use_ue8m0)
            return np.ascontiguousarray(q[:, :k]), s
        if quant_dtype == "fp8":
            return per_token_group_quant_fp8(a, bk, use_ue8m0=use_ue8m0)
        return per_token_group_quant_int8(a, bk)
    if per_act_token_quant:
        if a_scale is not None:
            raise ValueError("a_scale: per_act_token_quant computes dynamic per-token scales; "
                             "expected None, got an array")
        if quant_dtype == "fp8":
            return scaled_fp8_quant(a, None, use_per_token_if_dynamic=True)
        return per_token_quant_int8(a)
    if quant_dtype == "fp8":
        return scaled_fp8_quant(a, a_scale)
    if a_scale is None:
        return _scaled_int8_tensor_dynamic(a)
    return scaled_int8_quant(a, a_scale)


def dequantize_activation(q, scale, group_size=None):
    """fp32 values of quantized activations: q [M, Kdim] (fp8 / int8) times its scale, which
    is [1] (per-tensor), [M, 1] (per-token) or [M, KB] with group_size (groups of columns)."""
    check_array("q", q, ndim=2, dtypes=(FP8_DTYPE, np.dtype(np.int8)))
    m, k = q.shape
    s = np.asarray(scale)
    if s.dtype not in FLOAT_DTYPES:
        raise TypeError(f"scale: expected a float array, got {s.dtype}")
    s = s.astype(_F32)
    qf = q.astype(_F32)
    if group_size is not None:
        group_size = check_positive_int("group_size", group_size)
        kb = _cdiv(k, group_size)
        if s.shape != (m, kb):
            raise ValueError(f"scale: expected shape ({m}, {kb}) for groups of {group_size} "
                             f"columns, got {s.shape}")
        cols = np.arange(k) // group_size
        return qf * s[:, cols]
    if s.size == 1:
        return qf * s.reshape(())
    if s.shape in ((m, 1), (m,)):
        return qf * s.reshape(m, 1)
    raise ValueError(f"scale: expected shape (1,) per-tensor or ({m}, 1) per-token "
                     f"(or pass group_size), got {s.shape}")


# ----------------------------------------------------------------------------- weights
def block_shape_of(block_shape):
    """(bn, bk) of vLLM's block_shape [bn, bk] (bn >= 0, bk >= 1), or None (the launchers of
    cuda_kernels/cupy/quant read it the same way)."""
    if block_shape is None:
        return None
    try:
        bn, bk = (int(v) for v in block_shape)
    except (TypeError, ValueError):
        raise TypeError(f"block_shape: expected two ints [bn, bk], got {block_shape!r}") from None
    if bn < 0 or bk < 1:
        raise ValueError(f"block_shape: expected [bn >= 0, bk >= 1], got {block_shape!r}")
    return bn, bk


def _check_weight_float(name, w):
    check_float(name, w, ndim=3)
    return w.astype(_F32)


def _block_absmax(wf, bn, bk):
    """absmax over [bn, bk] blocks of w [E, N, Kdim] (edge blocks partial) -> [E, NB, KB]."""
    e, n, k = wf.shape
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    padded = np.zeros((e, nb * bn, kb * bk), dtype=_F32)
    padded[:, :n, :k] = np.abs(wf)
    return padded.reshape(e, nb, bn, kb, bk).max(axis=(2, 4))


def _expand_block(s, n, k, bn, bk):
    """A per-block scale [E, NB, KB] broadcast to every element [E, N, Kdim]."""
    return s[:, np.arange(n) // bn][:, :, np.arange(k) // bk]


WEIGHT_GRANULARITIES = ("tensor", "channel", "block")


def _weight_scales(wf, granularity, block_shape, qmax, use_ue8m0):
    check_choice("granularity", granularity, WEIGHT_GRANULARITIES)
    e, n, k = wf.shape
    if granularity == "tensor":
        amax = np.abs(wf).reshape(e, -1).max(axis=1) if wf.size else np.zeros(e, _F32)
        s = (np.maximum(amax, _F32(GROUP_EPS)) / _F32(qmax)).astype(_F32)          # [E]
        full = s[:, None, None]
    elif granularity == "channel":
        amax = np.abs(wf).max(axis=2) if k else np.zeros((e, n), _F32)
        s = (np.maximum(amax, _F32(GROUP_EPS)) / _F32(qmax)).astype(_F32)          # [E, N]
        full = s[:, :, None]
    else:
        bn, bk = block_shape_of(block_shape if block_shape is not None else DEFAULT_BLOCK_SHAPE)
        if bn < 1:
            raise ValueError(f"block_shape: expected bn >= 1 for block weights, got "
                             f"{block_shape!r}")
        s = (np.maximum(_block_absmax(wf, bn, bk), _F32(GROUP_EPS)) / _F32(qmax)).astype(_F32)
        if use_ue8m0:
            s = pow2_ceil(s)
        return s, _expand_block(s, n, k, bn, bk)
    if use_ue8m0:
        s = pow2_ceil(s)
        full = s.reshape(full.shape)
    return s, full


def quantize_weight_fp8(w, granularity="block", block_shape=DEFAULT_BLOCK_SHAPE, use_ue8m0=False):
    """fp8 e4m3 weights: w [E, N, Kdim] float -> (q fp8 [E, N, Kdim], scale f32).

    granularity "tensor": s [E] = absmax(w[e]) / 448; "channel": s [E, N]; "block": s [E, NB, KB]
    over block_shape [bn, bk] blocks (edge blocks partial), optionally powers of two (use_ue8m0).
    """
    wf = _check_weight_float("w", w)
    s, full = _weight_scales(wf, granularity, block_shape, FP8_MAX, use_ue8m0)
    return cast_fp8(wf / full), s


def quantize_weight_int8(w, granularity="channel", block_shape=DEFAULT_BLOCK_SHAPE):
    """int8 weights for w8a8: w [E, N, Kdim] -> (q int8, scale f32) with s = absmax / 127 per
    expert ("tensor", [E]), per row ("channel", [E, N]) or per block ("block", [E, NB, KB])."""
    wf = _check_weight_float("w", w)
    s, full = _weight_scales(wf, granularity, block_shape, INT8_MAX, False)
    return cast_int8(wf / full), s


def pack_int4(q):
    """uint8 codes in [0, 15], [..., Kdim] with Kdim even -> bytes [..., Kdim/2]:
    byte j = q[2j] | q[2j+1] << 4 (even k in the low nibble)."""
    check_array("q", q, dtypes=(np.dtype(np.uint8),))
    if q.shape[-1] % 2:
        raise ValueError(f"q: expected an even last dimension to pack two codes per byte, "
                         f"got shape {q.shape}")
    if q.size and q.max() > 15:
        raise ValueError(f"q: expected int4 codes in [0, 15], got {int(q.max())}")
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed):
    """bytes [..., Kdim/2] -> uint8 codes [..., Kdim] (low nibble first)."""
    check_array("packed", packed, dtypes=(np.dtype(np.uint8),))
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


def quantize_weight_wna16(w, num_bits=4, group_size=128, zero_point=False):
    """Weight-only int4 / int8 codes with per-(row, group) scales (GPTQ / AWQ style).

    w [E, N, Kdim] float, group_size dividing Kdim (group_size = Kdim: per-channel).
    Symmetric (zero_point=False): zp = 8 (int4) / 128 (uint8), s = absmax / (2^(b-1) - 1),
        q = clamp(round_half_away(w / s) + zp, 0, 2^b - 1).
    Asymmetric (zero_point=True): s = (max - min) / (2^b - 1), zp = clamp(round_half_away(-min/s)),
        q = clamp(round_half_away(w / s) + zp, 0, 2^b - 1).
    Returns q uint8 ([E, N, Kdim/2] packed for int4, [E, N, Kdim] for int8), s f32 [E, N, G],
    zp uint8 [E, N, G] (zero_point) or None (the default zero point applies).
    """
    wf = _check_weight_float("w", w)
    if num_bits not in (4, 8):
        raise ValueError(f"num_bits: expected 4 or 8, got {num_bits!r}")
    e, n, k = wf.shape
    group_size = check_positive_int("group_size", group_size)
    if k % group_size:
        raise ValueError(f"group_size: expected a divisor of Kdim = {k}, got {group_size}")
    if num_bits == 4 and k % 2:
        raise ValueError(f"w: expected an even Kdim to pack int4 codes, got shape {w.shape}")
    g = k // group_size
    qmax = (1 << num_bits) - 1
    wg = wf.reshape(e, n, g, group_size)                                   # [E, N, G, gs]
    if zero_point:
        lo = np.minimum(wg.min(axis=3), 0) if wg.size else np.zeros((e, n, g), _F32)
        hi = np.maximum(wg.max(axis=3), 0) if wg.size else np.zeros((e, n, g), _F32)
        s = (np.maximum(hi - lo, _F32(GROUP_EPS)) / _F32(qmax)).astype(_F32)
        zp = np.clip(round_half_away(-lo / s), 0, qmax).astype(np.uint8)
        zpf = zp.astype(np.float64)
    else:
        amax = np.abs(wg).max(axis=3) if wg.size else np.zeros((e, n, g), _F32)
        s = (np.maximum(amax, _F32(GROUP_EPS)) / _F32(qmax // 2)).astype(_F32)
        zp = None
        zpf = float(INT4_ZERO_POINT if num_bits == 4 else UINT8_ZERO_POINT)
    codes = round_half_away(wg / s[..., None]) + (zpf[..., None] if zero_point else zpf)
    q = np.clip(codes, 0, qmax).astype(np.uint8).reshape(e, n, k)
    if num_bits == 4:
        q = pack_int4(q)
    return q, s, zp


def _wna16_layout(w, num_bits, w_scale, w_zp, block_shape):
    """Check a weight-only weight and its scales; return (Kdim, group_size, default zp)."""
    if num_bits == 4:
        check_array("w", w, ndim=3, dtypes=(np.dtype(np.uint8),))
        k = w.shape[2] * 2
        default_zp = INT4_ZERO_POINT
    else:
        check_array("w", w, ndim=3, dtypes=(np.dtype(np.uint8), np.dtype(np.int8)))
        k = w.shape[2]
        default_zp = UINT8_ZERO_POINT if w.dtype == np.uint8 else 0
    e, n = w.shape[:2]
    if w_scale is None:
        raise ValueError("w_scale: expected per-group scales [E, N, G] for a weight-only format, "
                         "got None")
    check_float("w_scale", w_scale, ndim=3, shape=(e, n, None))
    g = w_scale.shape[2]
    group_size = wna16_group_size(k, w_scale.shape, block_shape)
    if w_zp is not None:
        check_array("w_zp", w_zp, ndim=3, dtypes=(np.dtype(np.uint8),), shape=(e, n, g))
        if w.dtype == np.int8:
            raise ValueError("w_zp: int8 codes are symmetric (no zero point); store uint8 codes "
                             "to use zero points, got w int8 with a w_zp")
        if num_bits == 4 and w_zp.size and w_zp.max() > 15:
            raise ValueError(f"w_zp: expected int4 zero points in [0, 15], got {int(w_zp.max())}")
    return k, group_size, default_zp


def wna16_group_size(k: int, w_scale_shape, block_shape) -> int:
    """The weight-only group size: block_shape's bk, else Kdim / G for the G = w_scale's last
    dimension groups per row; ValueError unless G groups of it tile Kdim (the launchers of
    cuda_kernels/cupy/quant check their scales the same way)."""
    g = w_scale_shape[-1]
    bs = block_shape_of(block_shape)
    group_size = bs[1] if bs is not None else (k // g if g and k % g == 0 else 0)
    if g < 1 or group_size < 1 or k % group_size or k // group_size != g:
        raise ValueError(f"w_scale: expected Kdim / group_size = {k} / {group_size} groups, got "
                         f"shape {tuple(w_scale_shape)}")
    return group_size


def dequantize_wna16_expert(w_e, scale_e, zp_e, num_bits, group_size, default_zp, dtype=_F32):
    """One expert's weight-only codes -> values [N, Kdim]: (q - zp) * s[n, k // group_size]."""
    q = unpack_int4(w_e) if num_bits == 4 else w_e
    k = q.shape[1]
    cols = np.arange(k) // group_size
    zp = zp_e.astype(dtype)[:, cols] if zp_e is not None else dtype(default_zp)
    return (q.astype(dtype) - zp) * scale_e.astype(dtype)[:, cols]


def _w8a8_scale_kind(w, w_scale, per_channel_quant, block_shape):
    e, n, k = w.shape
    if w_scale is None:
        raise ValueError("w_scale: expected the weight scales of a w8a8 format, got None")
    check_float("w_scale", w_scale)
    bs = block_shape_of(block_shape)
    if bs is not None:
        bn, bk = bs
        want = (e, _cdiv(n, bn), _cdiv(k, bk))
        if bn < 1 or w_scale.shape != want:
            raise ValueError(f"w_scale: expected per-block scales of shape {want} for "
                             f"block_shape {list(bs)}, got {w_scale.shape}")
        return "block"
    if per_channel_quant:
        if w_scale.shape not in ((e, n), (e, n, 1)):
            raise ValueError(f"w_scale: expected per-channel scales ({e}, {n}) with "
                             f"per_channel_quant, got {w_scale.shape}")
        return "channel"
    if w_scale.shape not in ((e,), (e, 1), (e, 1, 1)):
        raise ValueError(f"w_scale: expected one scale per expert ({e},) (per-tensor; pass "
                         f"per_channel_quant=True for [E, N]), got {w_scale.shape}")
    return "tensor"


def dequantize_w8a8_expert(w_e, scale_e, kind, block_shape, dtype=_F32):
    """One expert's fp8 / int8 codes [N, Kdim] -> values: q * s (s per expert, row or block)."""
    qf = w_e.astype(dtype)
    s = np.asarray(scale_e, dtype=dtype)
    if kind == "tensor":
        return qf * s.reshape(())
    if kind == "channel":
        return qf * s.reshape(-1, 1)
    bn, bk = block_shape_of(block_shape)
    n, k = w_e.shape
    return qf * s[np.arange(n) // bn][:, np.arange(k) // bk]


def dequantize_weight(w, w_scale, w_zp=None, *, use_fp8_w8a8=False, use_int8_w8a8=False,
                      use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False,
                      block_shape=None):
    """All experts' weights in fp32 [E, N, Kdim] (for tests and notebooks; the GEMM
    dequantizes one expert at a time)."""
    fmt = quant_format(use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16, use_int4_w4a16)
    if fmt in ("fp8", "int8"):
        _check_w8a8_weight("w", w, fmt)
        kind = _w8a8_scale_kind(w, w_scale, per_channel_quant, block_shape)
        return np.stack([dequantize_w8a8_expert(w[e], w_scale[e], kind, block_shape)
                         for e in range(w.shape[0])]).reshape(w.shape).astype(_F32)
    if fmt is None:
        raise ValueError("use_*: expected one quantized format flag, got none")
    bits = 4 if fmt == "int4" else 8
    k, gs, dzp = _wna16_layout(w, bits, w_scale, w_zp, block_shape)
    out = np.empty((w.shape[0], w.shape[1], k), dtype=_F32)
    for e in range(w.shape[0]):
        out[e] = dequantize_wna16_expert(w[e], w_scale[e], None if w_zp is None else w_zp[e],
                                         bits, gs, dzp)
    return out


# ----------------------------------------------------------------------------- the GEMM
def quant_format(use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16, use_int4_w4a16) -> str | None:
    """"fp8" | "int8" | "w8a16" | "int4" from vLLM's flags, None when none is set (the
    launchers of cuda_kernels/cupy/quant read the flags the same way)."""
    flags = {"fp8": use_fp8_w8a8, "int8": use_int8_w8a8, "w8a16": use_int8_w8a16,
             "int4": use_int4_w4a16}
    on = [k for k, v in flags.items() if v]
    if len(on) > 1:
        raise ValueError(f"use_fp8_w8a8/use_int8_w8a8/use_int8_w8a16/use_int4_w4a16: expected at "
                         f"most one format, got {len(on)} set ({', '.join(on)})")
    return on[0] if on else None


def _check_w8a8_weight(name, w, fmt):
    want = FP8_DTYPE if fmt == "fp8" else np.dtype(np.int8)
    check_array(name, w, ndim=3, dtypes=(want,))


def _a_scale_kind(a, a_scale, per_act_token_quant, block_shape):
    m, k = a.shape
    if a_scale is None:
        raise ValueError("a_scale: expected the activation scales of a w8a8 format, got None")
    check_float("a_scale", np.asarray(a_scale))
    s = np.asarray(a_scale)
    bs = block_shape_of(block_shape)
    if bs is not None:
        if s.shape != (m, _cdiv(k, bs[1])):
            raise ValueError(f"a_scale: expected per-group scales ({m}, {_cdiv(k, bs[1])}) for "
                             f"groups of {bs[1]} columns, got {s.shape}")
        return "group"
    if per_act_token_quant:
        if s.shape not in ((m, 1), (m,)):
            raise ValueError(f"a_scale: expected per-token scales ({m}, 1) with "
                             f"per_act_token_quant, got {s.shape}")
        return "token"
    if s.size != 1:
        raise ValueError(f"a_scale: expected one per-tensor scale (pass per_act_token_quant=True "
                         f"for [M, 1]), got shape {s.shape}")
    return "tensor"


def grouped_gemm_quant(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                       block_size, topk_weights=None, mul_routed_weight=False, bias=None,
                       a_scale=None, w_scale=None, w_zp=None, use_fp8_w8a8=False,
                       use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                       per_act_token_quant=False, per_channel_quant=False, block_shape=None,
                       out_dtype=None):
    """The fused MoE GEMM on quantized operands (vLLM's invoke_fused_moe_kernel).

    For each block b < num_tokens_post_padded / B and each s = sorted_token_ids[p] < P in it
    (P = a.shape[0] * top_k), with e = expert_ids[b]:
        c[s] = (deq(a)[s // top_k] @ deq(w[e]).T + bias[e]) * r[s]
    (r = topk_weights.flat when mul_routed_weight, else 1)
    in fp32, rounded once to out_dtype; c[s] = 0 when e == -1.

    w8a8 (use_fp8_w8a8 / use_int8_w8a8): a [M_a, Kdim] fp8 / int8 with a_scale ([1], [M_a, 1] or
    [M_a, KB]), w [E, N, Kdim] with w_scale ([E], [E, N] or [E, NB, KB]); out_dtype defaults to
    bf16. Weight-only (use_int8_w8a16 / use_int4_w4a16): a [M_a, Kdim] bf16 / fp16 / fp32, w
    codes (int4 packed [E, N, Kdim/2] uint8; int8 [E, N, Kdim] uint8 or int8), w_scale [E, N, G],
    w_zp [E, N, G] uint8 or None; out_dtype defaults to a.dtype. No format flag: grouped_gemm.
    -> c [P, N] out_dtype
    """
    fmt = quant_format(use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16, use_int4_w4a16)
    if fmt is None:
        return grouped_gemm(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                            block_size, topk_weights, mul_routed_weight, bias)
    if fmt in ("fp8", "int8"):
        check_array("a", a, ndim=2, dtypes=(FP8_DTYPE if fmt == "fp8" else np.dtype(np.int8),))
        _check_w8a8_weight("w", w, fmt)
        k = w.shape[2]
        if a.shape[1] != k:
            raise ValueError(f"w: expected shape (E, N, {a.shape[1]}) to match a's columns, "
                             f"got {w.shape}")
        a_kind = _a_scale_kind(a, a_scale, per_act_token_quant, block_shape)
        w_kind = _w8a8_scale_kind(w, w_scale, per_channel_quant, block_shape)
        gs = block_shape_of(block_shape)[1] if a_kind == "group" else None
        a_deq = dequantize_activation(a, np.asarray(a_scale, dtype=_F32), gs)   # [M_a, Kdim]
        w_scale_f = np.asarray(w_scale, dtype=_F32)

        def weight(e):
            return dequantize_w8a8_expert(w[e], w_scale_f[e], w_kind, block_shape)
        out_dtype = np.dtype(ml_dtypes.bfloat16) if out_dtype is None else np.dtype(out_dtype)
        acc_dtype = np.dtype(_F32)
    else:
        check_array("a", a, ndim=2, dtypes=FLOAT_DTYPES)
        bits = 4 if fmt == "int4" else 8
        k, gs, dzp = _wna16_layout(w, bits, w_scale, w_zp, block_shape)
        if a.shape[1] != k:
            raise ValueError(f"w: expected codes for Kdim = {a.shape[1]} (a's columns), got "
                             f"shape {w.shape} (Kdim {k})")
        acc_dtype = compute_dtype(a.dtype)
        a_deq = a.astype(acc_dtype)

        def weight(e):
            return dequantize_wna16_expert(w[e], w_scale[e], None if w_zp is None else w_zp[e],
                                           bits, gs, dzp, dtype=acc_dtype.type)
        out_dtype = a.dtype if out_dtype is None else np.dtype(out_dtype)
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype: expected a float dtype, got {out_dtype}")

    def expert_matmul(e, token_rows):
        return a_deq[token_rows] @ weight(e).T                                  # [rows, N]

    c = walk_expert_blocks(expert_matmul, a_deq.shape[0], w.shape[0], w.shape[1],
                           sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                           block_size, topk_weights, mul_routed_weight, bias, acc_dtype)
    return c.astype(out_dtype)


# ----------------------------------------------------------------------------- the layer
def _logical_k(w, fmt):
    return w.shape[2] * 2 if fmt == "int4" else w.shape[2]


def fused_experts_quant(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                        apply_router_weight_on_input=False, global_num_experts=-1,
                        expert_map=None, w1_bias=None, w2_bias=None, is_act_and_mul=True,
                        block_size=None, use_fp8_w8a8=False, use_int8_w8a8=False,
                        use_int8_w8a16=False, use_int4_w4a16=False, per_act_token_quant=False,
                        per_channel_quant=False, block_shape=None, w1_scale=None, w2_scale=None,
                        w1_zp=None, w2_zp=None, a1_scale=None, a2_scale=None, use_ue8m0=False):
    """The routed experts of one quantized MoE layer (vLLM's fused_experts with quantization).

    hidden_states [T, H] bf16 / fp16 / fp32; w1 [E_local, 2I, H] and w2 [E_local, H, I] codes
    (int4: [E_local, 2I, H/2] and [E_local, H, I/2]); the scales, zero points and flags as in
    grouped_gemm_quant; a1_scale / a2_scale static per-tensor activation scales (or None:
    dynamic). use_ue8m0 rounds the dynamic per-group activation scales up to powers of two.

        a1, s1 = quantize(x)                       (w8a8 only)
        cache1 = GEMM(a1, w1, s1, w1_scale)        [P, 2I]  -> x.dtype
        cache2 = activation(cache1)                [P, I]   -> x.dtype
        a2, s2 = quantize(cache2)                  (w8a8 only)
        cache3 = GEMM(a2, w2, s2, w2_scale) * w    [P, H]   -> x.dtype
        out    = moe_sum(cache3)                   [T, H]

    With no format flag this is the unquantized fused_experts. Returns [T, H] in x.dtype.
    """
    fmt = quant_format(use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16, use_int4_w4a16)
    check_array("hidden_states", hidden_states, ndim=2, dtypes=_ACT_DTYPES)
    num_tokens, hidden = hidden_states.shape
    for name, wt in (("w1", w1), ("w2", w2)):
        if not isinstance(wt, np.ndarray) or wt.ndim != 3:
            raise ValueError(f"{name}: expected a 3-D numpy array [E_local, N, Kdim], got "
                             f"{getattr(wt, 'shape', type(wt).__name__)}")
    num_local = w1.shape[0]
    if fmt is None:
        from .experts import fused_experts
        return fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                             apply_router_weight_on_input, global_num_experts, expert_map,
                             w1_bias, w2_bias, is_act_and_mul, block_size)
    if _logical_k(w1, fmt) != hidden:
        raise ValueError(f"w1: expected Kdim = H = {hidden} (hidden_states' columns), got shape "
                         f"{w1.shape}" + (" (int4: H/2 bytes per row)" if fmt == "int4" else ""))
    if w2.shape[:2] != (num_local, hidden):
        raise ValueError(f"w2: expected shape ({num_local}, {hidden}, ...), got {w2.shape}")
    inter = _logical_k(w2, fmt)
    check_w1_rows(w1, inter, activation, is_act_and_mul)
    check_topk_arrays(topk_weights, topk_ids, num_tokens)
    top_k, num_experts = check_expert_routing(topk_ids, num_local, global_num_experts,
                                              expert_map, apply_router_weight_on_input)
    block_size = check_positive_int("block_size", block_size or DEFAULT_BLOCK_SIZE)
    if fmt in ("w8a16", "int4") and (a1_scale is not None or a2_scale is not None):
        raise ValueError("a1_scale/a2_scale: weight-only formats keep activations unquantized; "
                         "expected None")

    quant_dtype = {"fp8": "fp8", "int8": "int8"}.get(fmt)
    flags = dict(use_fp8_w8a8=use_fp8_w8a8, use_int8_w8a8=use_int8_w8a8,
                 use_int8_w8a16=use_int8_w8a16, use_int4_w4a16=use_int4_w4a16,
                 per_act_token_quant=per_act_token_quant, per_channel_quant=per_channel_quant,
                 block_shape=block_shape, out_dtype=hidden_states.dtype)
    sorted_token_ids, expert_ids, num_tokens_post_padded = moe_align_block_size(
        topk_ids, block_size, num_experts, expert_map=expert_map)

    a1, a1s = moe_kernel_quantize_input(hidden_states, a1_scale, quant_dtype,
                                        per_act_token_quant, block_shape, use_ue8m0)
    cache1 = grouped_gemm_quant(a1, w1, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                top_k, block_size, topk_weights,
                                mul_routed_weight=apply_router_weight_on_input, bias=w1_bias,
                                a_scale=a1s, w_scale=w1_scale, w_zp=w1_zp, **flags)  # [P, 2I]
    cache2 = apply_activation(cache1, activation, is_act_and_mul)                      # [P, I]
    a2, a2s = moe_kernel_quantize_input(cache2, a2_scale, quant_dtype,
                                        per_act_token_quant, block_shape, use_ue8m0)
    cache3 = grouped_gemm_quant(a2, w2, sorted_token_ids, expert_ids, num_tokens_post_padded,
                                1, block_size, topk_weights,
                                mul_routed_weight=not apply_router_weight_on_input, bias=w2_bias,
                                a_scale=a2s, w_scale=w2_scale, w_zp=w2_zp, **flags)   # [P, H]
    live_ids = np.where((topk_ids >= 0) & (topk_ids < num_experts), topk_ids, -1)
    return moe_sum(cache3.reshape(num_tokens, top_k, hidden), live_ids,  # [T, H]
                   expert_map)


# ----------------------------------------------------------------------------- a layer, quantized
SCHEMES = {
    # name           what fused_experts_quant gets
    "fp8_tensor":   "fp8 weights, one scale per expert; activations per-tensor (dynamic, or "
                    "static with a1_scale / a2_scale)",
    "fp8_channel":  "fp8 weights per output channel; activations dynamic per-token",
    "fp8_block":    "DeepSeek-V3: fp8 weights in 128x128 blocks; activations in 1x128 groups",
    "int8_channel": "int8 weights per output channel; activations dynamic per-token (w8a8)",
    "int8_block":   "int8 weights in 128x128 blocks; activations in 1x128 groups (w8a8)",
    "w8a16":        "weight-only uint8 codes, per-group scales (default group 128), zero point "
                    "128 or given; bf16 activations",
    "w4a16":        "weight-only int4 codes packed two per byte, per-group scales, zero point 8 "
                    "or given; bf16 activations",
}


def quantize_moe_layer(w1, w2, scheme, block_shape=DEFAULT_BLOCK_SHAPE, group_size=128,
                       zero_point=False, use_ue8m0=False):
    """Quantize a layer's float experts (e.g. a bf16 checkpoint layer from data/) into `scheme`.

    w1 [E, 2I, H], w2 [E, H, I] float. Returns the keyword arguments of fused_experts_quant
    for the weights: {"w1", "w2", "w1_scale", "w2_scale", "w1_zp", "w2_zp", the use_* flag,
    "per_act_token_quant", "per_channel_quant", "block_shape"} (and "use_ue8m0" for block fp8),
    so that `fused_experts_quant(x, topk_weights=tw, topk_ids=ids, **quantize_moe_layer(...))`
    runs the quantized layer. group_size is clipped to Kdim for the weight-only schemes (a
    layer narrower than the group is per-channel).
    """
    check_choice("scheme", scheme, tuple(SCHEMES))
    check_float("w1", w1, ndim=3)
    check_float("w2", w2, ndim=3)
    out = dict(w1_zp=None, w2_zp=None, per_act_token_quant=False, per_channel_quant=False,
               block_shape=None)
    if scheme.startswith("fp8"):
        gran = scheme.split("_")[1]
        kw = dict(block_shape=block_shape, use_ue8m0=use_ue8m0 and gran == "block")
        (q1, s1), (q2, s2) = (quantize_weight_fp8(w, gran, **kw) for w in (w1, w2))
        out.update(use_fp8_w8a8=True)
    elif scheme.startswith("int8"):
        gran = scheme.split("_")[1]
        (q1, s1), (q2, s2) = (quantize_weight_int8(w, gran, block_shape) for w in (w1, w2))
        out.update(use_int8_w8a8=True)
    else:
        bits = 4 if scheme == "w4a16" else 8
        res = []
        for w in (w1, w2):
            gs = min(group_size, w.shape[2])
            res.append(quantize_weight_wna16(w, bits, gs, zero_point))
        (q1, s1, z1), (q2, s2, z2) = res
        out.update(w1_zp=z1, w2_zp=z2)
        out.update(use_int4_w4a16=True) if bits == 4 else out.update(use_int8_w8a16=True)
        out.update(w1=q1, w2=q2, w1_scale=s1, w2_scale=s2)
        return out
    if gran == "channel":
        out.update(per_act_token_quant=True, per_channel_quant=True)
    if gran == "block":
        out.update(block_shape=list(block_shape_of(block_shape)))
        if use_ue8m0:
            out.update(use_ue8m0=True)
    out.update(w1=q1, w2=q2, w1_scale=s1, w2_scale=s2)
    return out
