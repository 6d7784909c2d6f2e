"""The quantized reference (reference/quant.py) against first principles, on the CPU.

Checks, from the bottom up:
- the casts: round half away from zero, fp8 clamp before the cast, NaN kept, UE8M0 scales;
- the quantizers: scale formulas, the code of the largest element, error bounds, NaN confined
  to its group, int4 nibble order, default zero points;
- grouped_gemm_quant == grouped_gemm on the dequantized operands (the oracle's definition),
  and == an independent block-by-block scaled sum (the kernels' formulation);
- fused_experts_quant against a dumb loop over tokens and slots, against the unquantized
  layer (loose, per-format bounds: that is quantization error, not a bug), empty batches,
  expert parallelism, and argument errors.

Shape legend: T tokens, E experts, K top-k, H hidden, I intermediate, B block size.
"""
from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest

from reference import fused_experts, fused_topk, moe_align_block_size
from reference import quant as Q
from reference.activation import apply_activation
from reference.gemm import grouped_gemm
from tests.oracles import rel_err

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = Q.FP8_DTYPE


# ----------------------------------------------------------------------------- casts
def test_round_half_away_ties_and_near_ties():
    x = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 3.4999998, 0.0],
                 dtype=np.float32)
    assert Q.round_half_away(x).tolist() == [1, 2, 3, -1, -3, 0, 0, 3, 0]


def test_cast_fp8_clamps_before_the_cast_and_keeps_nan():
    y = np.array([1e4, -1e4, 448.0, 460.0, 0.3, np.nan], dtype=np.float32)
    q = Q.cast_fp8(y).astype(np.float32)
    assert q[:5].tolist() == [448.0, -448.0, 448.0, 448.0, float(np.float32(0.3).astype(FP8))]
    assert np.isnan(q[5])


def test_pow2_ceil_is_the_next_power_of_two(rng):
    s = np.exp(rng.uniform(-30, 10, 1000)).astype(np.float32)
    p = Q.pow2_ceil(s)
    assert (p >= s).all() and (p < 2 * s).all()
    m, _ = np.frexp(p)
    assert (m == 0.5).all()                                  # exact powers of two
    exact = np.float32([0.25, 1.0, 2.0 ** -20])
    assert (Q.pow2_ceil(exact) == exact).all()               # powers of two stay
    assert np.isnan(Q.pow2_ceil(np.float32([np.nan]))[0])


# ----------------------------------------------------------------------------- activations
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_per_token_group_quant_fp8(rng, dtype, use_ue8m0):
    M, Kd, gs = 7, 384, 128
    x = (rng.standard_normal((M, Kd)) * rng.uniform(0.01, 10, (M, 1))).astype(dtype)
    q, s = Q.per_token_group_quant_fp8(x, gs, use_ue8m0=use_ue8m0)
    assert q.dtype == FP8 and q.shape == (M, Kd) and s.shape == (M, Kd // gs)
    xf = x.astype(np.float32)
    amax = np.abs(xf.reshape(M, -1, gs)).max(axis=2)
    want = np.maximum(amax, np.float32(1e-10)) / np.float32(448)
    if use_ue8m0:
        assert (s >= want).all() and (np.frexp(s)[0] == 0.5).all()
    else:
        assert np.array_equal(s, want.astype(np.float32))
        # the group's largest element lands on +-448 exactly
        qf = np.abs(q.astype(np.float32)).reshape(M, -1, gs)
        assert (qf.max(axis=2) == 448).all()
    deq = Q.dequantize_activation(q, s, gs)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals, plus the subnormal step
    bound = 2.0 ** -4 * np.abs(xf) + 2.0 ** -10 * np.repeat(s, gs, axis=1)
    assert (np.abs(deq - xf) <= bound * (1 + 1e-6)).all()


def test_group_quant_nan_stays_in_its_group(rng):
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x[1, 130] = np.nan
    q, s = Q.per_token_group_quant_fp8(x, 128)
    deq = Q.dequantize_activation(q, s, 128)
    assert np.isnan(s[1, 1]) and np.isnan(deq[1, 128:]).all()
    finite = np.ones_like(deq, dtype=bool)
    finite[1, 128:] = False
    assert np.isfinite(deq[finite]).all()


def test_scaled_fp8_quant_static_dynamic_per_token(rng):
    x = rng.standard_normal((5, 64)).astype(BF16)
    xf = x.astype(np.float32)
    q, s = Q.scaled_fp8_quant(x, np.float32([0.01]))
    assert s.tolist() == [np.float32(0.01)]
    assert np.array_equal(q.view(np.uint8), Q.cast_fp8(xf / np.float32(0.01)).view(np.uint8))
    q, s = Q.scaled_fp8_quant(x)
    assert s.shape == (1,) and s[0] == np.abs(xf).max() / np.float32(448)
    q, s = Q.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    assert s.shape == (5, 1) and np.array_equal(s[:, 0], np.abs(xf).max(axis=1) / np.float32(448))
    # an all-zero row gets vLLM's floor, not a zero (which would divide 0 by 0)
    z = np.zeros((2, 8), np.float32)
    q, s = Q.scaled_fp8_quant(z, use_per_token_if_dynamic=True)
    assert (s == np.float32(Q.FP8_MIN_SCALE)).all() and (q.astype(np.float32) == 0).all()


def test_int8_rounds_half_away_from_zero():
    # absmax 127 -> scale 1: x / s is the value itself, so the ties are exact
    x = np.array([[127.0, 2.5, -2.5, 0.5, -0.5, 3.5, -126.5]], dtype=np.float32)
    q, s = Q.per_token_quant_int8(x)
    assert s.tolist() == [[1.0]]
    assert q.tolist() == [[127, 3, -3, 1, -1, 4, -127]]


@pytest.mark.parametrize("gs", [32, 64])
def test_int8_group_quant_error_bound(rng, gs):
    x = rng.standard_normal((6, 192)).astype(np.float32)
    q, s = Q.per_token_group_quant_int8(x, gs)
    assert q.dtype == np.int8 and s.shape == (6, 192 // gs)
    deq = Q.dequantize_activation(q, s, gs)
    assert (np.abs(deq - x) <= 0.5 * np.repeat(s, gs, axis=1) * (1 + 1e-4)).all()
    assert (np.abs(q.astype(int)).reshape(6, -1, gs).max(axis=2) == 127).all()


def test_moe_kernel_quantize_input_dispatch(rng):
    x = rng.standard_normal((4, 256)).astype(BF16)
    q, s = Q.moe_kernel_quantize_input(x, None, None)
    assert q is x and s is None
    q, s = Q.moe_kernel_quantize_input(x, None, "fp8", block_shape=[128, 128])
    assert s.shape == (4, 2)
    q, s = Q.moe_kernel_quantize_input(x, None, "int8", per_act_token_quant=True)
    assert q.dtype == np.int8 and s.shape == (4, 1)
    q, s = Q.moe_kernel_quantize_input(x, np.float32([0.02]), "fp8")
    assert s.tolist() == [np.float32(0.02)]
    # Kdim not a multiple of the group: the last group is partial
    q, s = Q.moe_kernel_quantize_input(x[:, :200], None, "fp8", block_shape=[128, 128])
    assert q.shape == (4, 200) and s.shape == (4, 2)
    assert np.array_equal(s[:, 1], np.maximum(np.abs(x[:, 128:200].astype(np.float32)).max(1),
                                              np.float32(1e-10)) / np.float32(448))
    with pytest.raises(ValueError, match="a_scale"):
        Q.moe_kernel_quantize_input(x, np.float32([1.0]), "fp8", block_shape=[128, 128])
    with pytest.raises(ValueError, match="quant_dtype"):
        Q.moe_kernel_quantize_input(x, None, "int4")


# ----------------------------------------------------------------------------- weights
def test_int4_nibble_order():
    q = np.array([[1, 2, 3, 4, 15, 0]], dtype=np.uint8)
    packed = Q.pack_int4(q)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]           # even k in the low nibble
    assert np.array_equal(Q.unpack_int4(packed), q)
    with pytest.raises(ValueError, match="q"):
        Q.pack_int4(np.array([[16, 0]], dtype=np.uint8))


@pytest.mark.parametrize("gran", ["tensor", "channel", "block"])
def test_quantize_weight_fp8_error_bound(rng, gran):
    w = (rng.standard_normal((3, 200, 320)) * 0.02).astype(BF16)   # partial 128-blocks on both axes
    q, s = Q.quantize_weight_fp8(w, gran)
    want_shape = {"tensor": (3,), "channel": (3, 200), "block": (3, 2, 3)}[gran]
    assert q.dtype == FP8 and s.shape == want_shape
    deq = Q.dequantize_weight(q, s, use_fp8_w8a8=True, per_channel_quant=gran == "channel",
                              block_shape=[128, 128] if gran == "block" else None)
    wf = w.astype(np.float32)
    if gran == "block":
        sfull = s[:, np.arange(200) // 128][:, :, np.arange(320) // 128]
    elif gran == "channel":
        sfull = s[:, :, None]
    else:
        sfull = s[:, None, None]
    assert (np.abs(deq - wf) <= (2.0 ** -4 * np.abs(wf) + 2.0 ** -10 * sfull) * (1 + 1e-6)).all()


@pytest.mark.parametrize("gran", ["tensor", "channel", "block"])
def test_quantize_weight_int8_error_bound(rng, gran):
    w = rng.standard_normal((2, 130, 256)).astype(np.float32)
    q, s = Q.quantize_weight_int8(w, gran)
    deq = Q.dequantize_weight(q, s, use_int8_w8a8=True, per_channel_quant=gran == "channel",
                              block_shape=[128, 128] if gran == "block" else None)
    step = {"tensor": lambda: s[:, None, None], "channel": lambda: s[:, :, None],
            "block": lambda: s[:, np.arange(130) // 128][:, :, np.arange(256) // 128]}[gran]()
    # half a step, plus the fp32 rounding of w / s at exact ties
    assert (np.abs(deq - w) <= 0.5 * step * (1 + 1e-4)).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("gs", [32, 128])
def test_quantize_weight_wna16(rng, bits, zero_point, gs):
    E, N, Kd = 2, 24, 256
    w = (rng.standard_normal((E, N, Kd)) * 0.03 + (0.01 if zero_point else 0)).astype(BF16)
    q, s, zp = Q.quantize_weight_wna16(w, bits, gs, zero_point)
    assert q.dtype == np.uint8 and q.shape == (E, N, Kd // 2 if bits == 4 else Kd)
    assert s.shape == (E, N, Kd // gs) and (zp is None) == (not zero_point)
    flag = dict(use_int4_w4a16=True) if bits == 4 else dict(use_int8_w8a16=True)
    deq = Q.dequantize_weight(q, s, zp, block_shape=[0, gs], **flag)
    wf = w.astype(np.float32)
    sfull = np.repeat(s, gs, axis=2)
    # half a step, plus the fp32 rounding of w / s and of the product at exact ties
    assert (np.abs(deq - wf) <= 0.5 * sfull * (1 + 1e-4)).all()
    codes = Q.unpack_int4(q) if bits == 4 else q
    zfull = np.repeat(zp, gs, axis=2).astype(np.float32) if zero_point else \
        (8.0 if bits == 4 else 128.0)
    assert np.array_equal(deq, (codes.astype(np.float32) - zfull) * sfull)


def test_default_zero_points(rng):
    """No w_zp: 8 for int4 codes, 128 for uint8 codes, 0 for int8 codes."""
    E, N, Kd, gs = 1, 8, 64, 32
    s = rng.uniform(0.5, 1, (E, N, Kd // gs)).astype(np.float32)
    codes4 = rng.integers(0, 16, (E, N, Kd), dtype=np.uint8)
    packed = Q.pack_int4(codes4)
    a = Q.dequantize_weight(packed, s, None, use_int4_w4a16=True)
    b = Q.dequantize_weight(packed, s, np.full(s.shape, 8, np.uint8), use_int4_w4a16=True)
    assert np.array_equal(a, b)
    codes8 = rng.integers(0, 256, (E, N, Kd), dtype=np.uint8)
    a = Q.dequantize_weight(codes8, s, None, use_int8_w8a16=True)
    b = Q.dequantize_weight(codes8, s, np.full(s.shape, 128, np.uint8), use_int8_w8a16=True)
    assert np.array_equal(a, b)
    signed = codes8.view(np.int8)
    a = Q.dequantize_weight(signed, s, None, use_int8_w8a16=True)
    assert np.array_equal(a, signed.astype(np.float32) * np.repeat(s, gs, axis=2))


# ----------------------------------------------------------------------------- the GEMM
GEMM_FORMATS = [
    # name,         flags for grouped_gemm_quant,                            activation quant
    ("fp8_block",   dict(use_fp8_w8a8=True, block_shape=[128, 128]),        "group"),
    ("fp8_tensor",  dict(use_fp8_w8a8=True),                                "tensor"),
    ("fp8_channel", dict(use_fp8_w8a8=True, per_act_token_quant=True,
                         per_channel_quant=True),                           "token"),
    ("int8_channel", dict(use_int8_w8a8=True, per_act_token_quant=True,
                          per_channel_quant=True),                          "token"),
    ("int8_block",  dict(use_int8_w8a8=True, block_shape=[128, 128]),       "group"),
    ("w4a16",       dict(use_int4_w4a16=True, block_shape=[0, 64]),         None),
    ("w4a16_zp",    dict(use_int4_w4a16=True, block_shape=[0, 64]),         None),
    ("w8a16",       dict(use_int8_w8a16=True),                              None),
]


def make_gemm_case(rng, name, flags, M_a, N, Kd, E, top_k, B, ids=None):
    """Quantized operands for one grouped GEMM plus their fp32 dequantized twins."""
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    w = (rng.standard_normal((E, N, Kd)) * 0.05).astype(BF16)
    bs = flags.get("block_shape")
    if name.startswith(("fp8", "int8")):
        qd = "fp8" if name.startswith("fp8") else "int8"
        a_q, a_s = Q.moe_kernel_quantize_input(a, None, qd, flags.get("per_act_token_quant", False),
                                               bs)
        gran = "block" if bs else ("channel" if flags.get("per_channel_quant") else "tensor")
        quant_w = Q.quantize_weight_fp8 if qd == "fp8" else Q.quantize_weight_int8
        w_q, w_s = quant_w(w, gran)
        w_zp = None
        a_deq = Q.dequantize_activation(a_q, a_s, bs[1] if bs else None)
    else:
        bits = 4 if name.startswith("w4") else 8
        gs = bs[1] if bs else Kd
        w_q, w_s, w_zp = Q.quantize_weight_wna16(w, bits, gs, zero_point=name.endswith("zp"))
        a_q, a_s, a_deq = a, None, a.astype(np.float32)
    w_deq = Q.dequantize_weight(w_q, w_s, w_zp, **{k: v for k, v in flags.items()
                                                   if k != "per_act_token_quant"})
    if ids is None:
        ids = rng.integers(0, E, (M_a, top_k)).astype(np.int32)
    return dict(a_q=a_q, a_s=a_s, w_q=w_q, w_s=w_s, w_zp=w_zp, a_deq=a_deq, w_deq=w_deq, ids=ids)


@pytest.mark.parametrize("name,flags,_", GEMM_FORMATS, ids=[f[0] for f in GEMM_FORMATS])
@pytest.mark.parametrize("mul_routed_weight", [False, True])
def test_grouped_gemm_quant_is_dequantize_then_matmul(rng, name, flags, _, mul_routed_weight):
    T, E, K, N, Kd, B = 9, 5, 2, 72, 256, 4
    c = make_gemm_case(rng, name, flags, T, N, Kd, E, K, B)
    tw = rng.uniform(0.1, 1, (T, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    st, ex, ntp = moe_align_block_size(c["ids"], B, E)
    got = Q.grouped_gemm_quant(c["a_q"], c["w_q"], st, ex, ntp, K, B, tw, mul_routed_weight, bias,
                               a_scale=c["a_s"], w_scale=c["w_s"], w_zp=c["w_zp"], **flags)
    want = grouped_gemm(c["a_deq"], c["w_deq"], st, ex, ntp, K, B, tw, mul_routed_weight, bias)
    assert got.dtype == BF16 and got.shape == (T * K, N)
    assert np.array_equal(got.view(np.uint16), want.astype(BF16).view(np.uint16))


@pytest.mark.parametrize("name,flags,_", GEMM_FORMATS[:5], ids=[f[0] for f in GEMM_FORMATS[:5]])
def test_grouped_gemm_quant_equals_blockwise_scaled_sum(rng, name, flags, _):
    """The kernels' formulation: integer / fp8 partial sums of each 128-wide K block, scaled by
    a_scale[row, kb] * w_scale[e, nb, kb] (or once at the end for per-tensor / per-channel)."""
    M_a, E, N, Kd = 6, 3, 136, 320                     # partial blocks on N and K
    c = make_gemm_case(rng, name, flags, M_a, N, Kd, E, 1, 1)
    ids = c["ids"]
    st, ex, ntp = moe_align_block_size(ids, 1, E)
    got = Q.grouped_gemm_quant(c["a_q"], c["w_q"], st, ex, ntp, 1, 1, a_scale=c["a_s"],
                               w_scale=c["w_s"], w_zp=None, out_dtype=np.float32, **flags)
    aq = c["a_q"].astype(np.float64)
    wq = c["w_q"].astype(np.float64)
    a_s = np.asarray(c["a_s"], np.float64)
    w_s = np.asarray(c["w_s"], np.float64)
    want = np.zeros((M_a, N))
    for m in range(M_a):                                # the dumbest loop: row, column, K block
        e = ids[m, 0]
        for n in range(N):
            for kb in range(-(-Kd // 128)):
                ks = slice(kb * 128, (kb + 1) * 128)
                part = aq[m, ks] @ wq[e, n, ks]
                if flags.get("block_shape"):
                    part *= a_s[m, kb] * w_s[e, n // 128, kb]
                else:
                    part *= a_s.reshape(-1)[m if a_s.size > 1 else 0] * \
                        (w_s[e, n] if w_s.ndim == 2 else w_s[e])
                want[m, n] += part
    assert rel_err(got, want) < 1e-5                     # fp32 accumulation order only


def test_grouped_gemm_quant_expert_minus_one_and_padding(rng):
    E, N, Kd, B = 4, 16, 128, 4
    c = make_gemm_case(rng, "fp8_block", GEMM_FORMATS[0][1], 6, N, Kd, E, 1, B)
    emap = np.array([0, -1, 1, -1], dtype=np.int32)
    ids = np.array([[0], [1], [2], [3], [1], [0]], dtype=np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E, expert_map=emap)
    w_q, w_s = c["w_q"][:2], c["w_s"][:2]
    got = Q.grouped_gemm_quant(c["a_q"], w_q, st, ex, ntp, 1, B, a_scale=c["a_s"], w_scale=w_s,
                               use_fp8_w8a8=True, block_shape=[128, 128])
    off_rank = np.isin(ids[:, 0], [1, 3])
    assert (got[off_rank].astype(np.float32) == 0).all()
    assert np.isfinite(got.astype(np.float32)).all()


def test_grouped_gemm_quant_argument_errors(rng):
    c = make_gemm_case(rng, "fp8_block", GEMM_FORMATS[0][1], 4, 16, 256, 2, 1, 4)
    st, ex, ntp = moe_align_block_size(c["ids"], 4, 2)
    base = dict(a_scale=c["a_s"], w_scale=c["w_s"], use_fp8_w8a8=True, block_shape=[128, 128])
    with pytest.raises(ValueError, match="use_fp8_w8a8"):
        Q.grouped_gemm_quant(c["a_q"], c["w_q"], st, ex, ntp, 1, 4, **base, use_int8_w8a8=True)
    with pytest.raises(TypeError, match="a:"):
        Q.grouped_gemm_quant(c["a_deq"], c["w_q"], st, ex, ntp, 1, 4, **base)
    with pytest.raises(ValueError, match="a_scale"):
        Q.grouped_gemm_quant(c["a_q"], c["w_q"], st, ex, ntp, 1, 4,
                             **{**base, "a_scale": c["a_s"][:, :1]})
    with pytest.raises(ValueError, match="w_scale"):
        Q.grouped_gemm_quant(c["a_q"], c["w_q"], st, ex, ntp, 1, 4,
                             **{**base, "w_scale": c["w_s"][:, :, :0]})
    with pytest.raises(ValueError, match="w_scale"):
        Q.grouped_gemm_quant(c["a_q"], c["w_q"], st, ex, ntp, 1, 4,
                             **{**base, "block_shape": None, "a_scale": np.float32([1.0])})
    c4 = make_gemm_case(rng, "w4a16", GEMM_FORMATS[5][1], 4, 16, 256, 2, 1, 4)
    with pytest.raises(ValueError, match="w_zp"):
        Q.grouped_gemm_quant(c4["a_q"], c4["w_q"], st, ex, ntp, 1, 4, w_scale=c4["w_s"],
                             w_zp=np.full(c4["w_s"].shape, 16, np.uint8), use_int4_w4a16=True)
    with pytest.raises(ValueError, match="w_scale"):
        Q.grouped_gemm_quant(c4["a_q"], c4["w_q"], st, ex, ntp, 1, 4, w_scale=c4["w_s"],
                             use_int4_w4a16=True, block_shape=[0, 32])


# ----------------------------------------------------------------------------- the layer
def loop_oracle(x, w1q, w2q, tw, ids, kw, activation="silu"):
    """The dumbest obviously-correct quantized layer: quantize each GEMM's input as a whole
    (the activation scales are batch properties), then loop over tokens and slots in float64,
    rounding where the engine rounds (bf16 after each GEMM and after the activation)."""
    deqw = {k: v for k, v in kw.items() if k in ("use_fp8_w8a8", "use_int8_w8a8",
                                                  "use_int8_w8a16", "use_int4_w4a16",
                                                  "per_channel_quant", "block_shape")}
    W1 = Q.dequantize_weight(w1q, kw["w1_scale"], kw.get("w1_zp"), **deqw).astype(np.float64)
    W2 = Q.dequantize_weight(w2q, kw["w2_scale"], kw.get("w2_zp"), **deqw).astype(np.float64)
    qd = "fp8" if kw.get("use_fp8_w8a8") else ("int8" if kw.get("use_int8_w8a8") else None)
    bs = kw.get("block_shape")
    pat = kw.get("per_act_token_quant", False)

    def deq_input(a, static):
        if qd is None:
            return a.astype(np.float64)
        q, s = Q.moe_kernel_quantize_input(a, static, qd, pat, bs)
        return Q.dequantize_activation(q, s, bs[1] if bs else None).astype(np.float64)

    T, K = ids.shape
    xd = deq_input(x, kw.get("a1_scale"))
    cache2 = np.zeros((T * K, W2.shape[2]), dtype=x.dtype)
    for t in range(T):
        for k in range(K):
            h = (W1[ids[t, k]] @ xd[t]).astype(x.dtype)
            cache2[t * K + k] = apply_activation(h[None, :], activation)[0]
    c2d = deq_input(cache2, kw.get("a2_scale"))
    out = np.zeros((T, W2.shape[1]))
    for t in range(T):
        for k in range(K):
            y = (tw[t, k] * (W2[ids[t, k]] @ c2d[t * K + k])).astype(x.dtype)
            out[t] += y.astype(np.float64)
    return out.astype(x.dtype)


SCHEME_BOUNDS = {
    # quantized layer vs the bf16 layer: quantization error, per format (random Gaussian
    # weights; e4m3's 3 mantissa bits on both operands of two GEMMs ~ 6%, int4 symmetric ~ 20%)
    "fp8_tensor": 0.10, "fp8_channel": 0.10, "fp8_block": 0.10, "int8_channel": 0.04,
    "int8_block": 0.04, "w8a16": 0.03, "w4a16": 0.30,
}

LAYER_SHAPES = [
    # T,  E, K,   H,   I, B   (nasty cases: one token, T not a multiple of B, H not a multiple
    #                          of 128 (partial blocks), experts with no tokens)
    (1, 4, 2, 256, 128, 16),
    (11, 6, 2, 320, 64, 4),
    (24, 8, 3, 128, 192, 8),
]


def _bf16_layer(rng, T, E, K, H, I, scaled=True, renormalize=True):  # noqa: E741
    """x [T, H], w1 [E, 2I, H], w2 [E, H, I] in bf16 (divided by the square root of their
    inner size, or not), and x routed: topk_weights, topk_ids [T, K]."""
    x = rng.standard_normal((T, H)).astype(BF16)
    s1, s2 = (np.sqrt(H), np.sqrt(I)) if scaled else (1.0, 1.0)
    w1 = (rng.standard_normal((E, 2 * I, H)) / s1).astype(BF16)
    w2 = (rng.standard_normal((E, H, I)) / s2).astype(BF16)
    tw, ids, _ = fused_topk(x, rng.standard_normal((T, E)).astype(np.float32), K, renormalize)
    return x, w1, w2, tw, ids


@pytest.mark.parametrize("scheme", list(Q.SCHEMES))
@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_experts_quant_against_loop_oracle(rng, scheme, shape):
    T, E, K, H, I, B = shape
    x, w1, w2, tw, ids = _bf16_layer(rng, T, E, K, H, I)
    gs = 64 if scheme.startswith("w") else 128
    kw = Q.quantize_moe_layer(w1, w2, scheme, group_size=gs,
                              zero_point=scheme == "w4a16" and T % 2 == 1)
    w1q, w2q = kw.pop("w1"), kw.pop("w2")
    got = Q.fused_experts_quant(x, w1q, w2q, tw, ids, block_size=B, **kw)
    assert got.dtype == BF16 and got.shape == (T, H)
    want = loop_oracle(x, w1q, w2q, tw, ids, kw)
    # same quantized math, other accumulation order: a bf16 rounding flip of an intermediate
    # may move one activation code, hence the bf16 tolerance rather than exact equality
    assert rel_err(got, want) < 1e-2
    bf16_layer = fused_experts(x, w1, w2, tw, ids, block_size=B)
    assert rel_err(got, bf16_layer) < SCHEME_BOUNDS[scheme]


@pytest.mark.parametrize("scheme", ["fp8_tensor", "int8_channel"])
def test_static_activation_scales(rng, scheme):
    T, E, K, H, I = 8, 4, 2, 128, 64
    x, w1, w2, tw, ids = _bf16_layer(rng, T, E, K, H, I)
    kw = Q.quantize_moe_layer(w1, w2, scheme)
    if scheme == "int8_channel":                        # static per-tensor int8 activations
        kw.update(per_act_token_quant=False)
        qmax = 127.0
    else:
        qmax = 448.0
    kw.update(a1_scale=np.float32([np.abs(x.astype(np.float32)).max() / qmax]),
              a2_scale=np.float32([0.5 / qmax]))
    w1q, w2q = kw.pop("w1"), kw.pop("w2")
    got = Q.fused_experts_quant(x, w1q, w2q, tw, ids, block_size=4, **kw)
    want = loop_oracle(x, w1q, w2q, tw, ids, kw)
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("scheme", ["fp8_block", "w4a16", "fp8_channel"])
def test_empty_batch(scheme):
    rng = np.random.default_rng(1)
    E, H, I = 4, 128, 64
    w1 = rng.standard_normal((E, 2 * I, H)).astype(BF16)
    w2 = rng.standard_normal((E, H, I)).astype(BF16)
    kw = Q.quantize_moe_layer(w1, w2, scheme)
    out = Q.fused_experts_quant(np.zeros((0, H), BF16), topk_weights=np.zeros((0, 2), np.float32),
                                topk_ids=np.zeros((0, 2), np.int32), **kw)
    assert out.shape == (0, H) and out.dtype == BF16


@pytest.mark.parametrize("scheme", ["fp8_block", "int8_channel", "w4a16"])
def test_expert_parallel_ranks_sum_to_the_layer(rng, scheme):
    """Per-token and per-group activation scales depend on the row only, so the ranks'
    partial outputs add up to the whole layer (up to the bf16 rounding of each part)."""
    T, E, K, H, I = 10, 6, 2, 128, 64
    x, w1, w2, tw, ids = _bf16_layer(rng, T, E, K, H, I)
    kw = Q.quantize_moe_layer(w1, w2, scheme, group_size=64)
    whole = Q.fused_experts_quant(x, topk_weights=tw, topk_ids=ids, block_size=4, **kw)
    total = np.zeros((T, H))
    for local in (np.arange(0, 3), np.arange(3, 6)):
        emap = np.full(E, -1, np.int32)
        emap[local] = np.arange(local.size)
        part = {k: (v[local] if isinstance(v, np.ndarray) and k.startswith("w") else v)
                for k, v in kw.items()}
        total += Q.fused_experts_quant(x, topk_weights=tw, topk_ids=ids, block_size=4,
                                       expert_map=emap, global_num_experts=E,
                                       **part).astype(np.float64)
    assert rel_err(total, whole) < 1e-2


def test_apply_router_weight_on_input_top1(rng):
    T, E, H, I = 7, 3, 128, 64
    x, w1, w2, tw, ids = _bf16_layer(rng, T, E, 1, H, I, renormalize=False)
    kw = Q.quantize_moe_layer(w1, w2, "w8a16")
    got = Q.fused_experts_quant(x, topk_weights=tw, topk_ids=ids,
                                apply_router_weight_on_input=True, **kw)
    ref = fused_experts(x, w1, w2, tw, ids, apply_router_weight_on_input=True)
    assert rel_err(got, ref) < SCHEME_BOUNDS["w8a16"]


def test_no_flag_is_the_unquantized_layer(rng):
    T, E, K, H, I = 5, 3, 2, 64, 32
    x, w1, w2, tw, ids = _bf16_layer(rng, T, E, K, H, I, scaled=False)
    got = Q.fused_experts_quant(x, w1, w2, tw, ids)
    assert np.array_equal(got.view(np.uint16), fused_experts(x, w1, w2, tw, ids).view(np.uint16))


def test_fused_experts_quant_argument_errors(rng):
    T, E, K, H, I = 4, 3, 2, 128, 64
    x, w1, w2, tw, ids = _bf16_layer(rng, T, E, K, H, I, scaled=False)
    kw = Q.quantize_moe_layer(w1, w2, "w4a16")
    with pytest.raises(ValueError, match="a1_scale"):
        Q.fused_experts_quant(x, topk_weights=tw, topk_ids=ids, a1_scale=np.float32([1]), **kw)
    with pytest.raises(ValueError, match="w1"):
        Q.fused_experts_quant(x[:, :64], topk_weights=tw, topk_ids=ids, **kw)
    with pytest.raises(TypeError, match="hidden_states"):
        Q.fused_experts_quant(x.astype(np.int32), topk_weights=tw, topk_ids=ids, **kw)
    kw8 = Q.quantize_moe_layer(w1, w2, "fp8_block")
    # an id outside [0, E) is no error since issue 38 (vLLM: routed nowhere): it adds nothing
    out = Q.fused_experts_quant(x, topk_weights=tw, topk_ids=ids + E, **kw8)
    assert not out.astype(np.float32).any()
    masked = ids.copy()
    masked[1] = -1
    out = Q.fused_experts_quant(x, topk_weights=tw, topk_ids=masked, **kw8)
    full = Q.fused_experts_quant(x, topk_weights=tw, topk_ids=ids, **kw8)
    assert not out[1].astype(np.float32).any()
    assert np.array_equal(np.delete(out, 1, 0).view(np.uint16),
                          np.delete(full, 1, 0).view(np.uint16))
    with pytest.raises(ValueError, match="scheme"):
        Q.quantize_moe_layer(w1, w2, "fp4")
