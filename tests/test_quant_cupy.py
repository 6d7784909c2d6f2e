"""The quantized CuPy kernels (quant_act.cu, quant_gemm.cu) against reference/quant.py.

CPU (always): the launchers import without a GPU and register their compile cases; the
cases compile through NVRTC for sm_90 and sm_80 (marked slow: the tensor-core templates take
a few minutes of CPU).
CPU emulation (`simulator`, slow): the .cu sources built by g++ against a small header that
stands in for CUDA (threads, barriers, warp exchange, cp.async groups, mma.sync fragments
laid out as the PTX ISA says) and run: activation quantization bit-exact, every GEMM rung
and config against the reference.
GPU (`gpu` marker):
- activation quantization is bit-exact (codes and scales) in every mode and input dtype;
  NaN stays confined to its group;
- every GEMM format and version matches grouped_gemm_quant on the same quantized operands
  (outputs poisoned with NaN first; tolerance: bf16 output rounding, 1e-2) and v1 == v2;
- the whole quantized layer built from the GPU stages matches fused_experts_quant within
  vLLM's tolerances (block fp8 0.035, int8 0.065, weight-only 2e-2);
- empty batches, experts on other ranks (e = -1 -> zeros), argument errors.

Shape legend: T tokens, E experts, K top-k, H hidden, I intermediate, B block size, N output
width, Kdim reduction width.
"""
from __future__ import annotations

import contextlib
import math
import zlib

import ml_dtypes
import numpy as np
import pytest

from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy import quant_act as QA
from cuda_kernels.cupy import quant_gemm as QG
from reference import apply_activation, fused_topk, moe_align_block_size, moe_sum
from reference import quant as RQ
from oracles import rel_err

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = RQ.FP8_DTYPE
VLLM_TOL = {"fp8_block": 0.035, "int8": 0.065, "wna16": 2e-2}   # vLLM's own test tolerances
GEMM_TOL = 1e-2   # same quantized operands, other accumulation order: bf16 output rounding


# ----------------------------------------------------------------------------- CPU
def test_launchers_import_and_register_cases():
    files = {c.cu_name for c in C.COMPILE_CASES}
    assert {"quant_act.cu", "quant_gemm.cu"} <= files
    names = {n for c in C.COMPILE_CASES if c.cu_name == "quant_gemm.cu"
             for n in (c.name_expressions or ())}
    assert set(QG.V1_NAMES) | set(QG.W8A8_V2_NAMES) | set(QG.WNA16_V2_NAMES) | \
        set(QG.WNA16_V3_NAMES) <= names


def test_config_tables_choose_by_rows_per_expert():
    assert QG.block_size_for("int4", 0.25) == 16 and QG.block_size_for("int4", 16) == 48
    assert QG.block_size_for("int4", 100) == 48 and QG.block_size_for("int4", 200) == 64
    assert QG.block_size_for("fp8", 2) == 16
    for cfg in QG.WNA16_V3_CONFIGS.values():
        assert QG.v3_smem_bytes(cfg) <= 48 * 1024 and cfg["BM"] % 8 == 0


def test_smem_fits_an_h200_cta():
    for cfg in QG.W8A8_CONFIGS.values():
        assert QG.w8a8_smem_bytes(cfg) <= 227 * 1024
    for cfg in QG.WNA16_CONFIGS.values():
        for bits in (4, 8):
            assert QG.wna16_smem_bytes(cfg, bits) <= 227 * 1024


def test_wna16_group_nesting_rule():
    assert QG.wna16_group_ok(128, 32, 128) and QG.wna16_group_ok(256, 16, 128)
    assert QG.wna16_group_ok(64, 8, 128) and QG.wna16_group_ok(32, 8, 128)
    assert not QG.wna16_group_ok(16, 8, 128)        # 8 groups per tile: v1 only
    assert not QG.wna16_group_ok(96, 4, 128)
    assert QG.wna16_group_ok(320, 1, 128)            # one group per row (per-channel)


# ----------------------------------------------------------------------------- GPU helpers
def up(x):
    """NumPy -> CuPy; fp8 travels as its bytes."""
    if x is None:
        return None
    if isinstance(x, np.ndarray) and x.dtype == FP8:
        return QA.fp8_to_device(x)
    return C.to_device(np.asarray(x))


def host(x, dtype=None):
    h = C.to_host(x)
    if dtype is not None and h.dtype != dtype:
        h = h.view(dtype)          # uint16 bytes of bf16, uint8 bytes of fp8
    return h


def poisoned(shape, dtype):
    out = C.empty(shape, dtype)
    C.raw(out).view(np.uint16 if np.dtype(dtype).itemsize == 2 else np.uint32).fill(
        0x7FC0 if np.dtype(dtype) == BF16 else 0x7E00)   # bf16 / fp16 quiet NaN
    return out


# ----------------------------------------------------------------------------- activation quant
ACT_MODES = [
    # name,            reference call and GPU call get (x, a_scale)
    ("fp8_group",       dict(quant_dtype="fp8", block_shape=[128, 128])),
    ("fp8_group_ue8m0", dict(quant_dtype="fp8", block_shape=[128, 128], use_ue8m0=True)),
    ("fp8_token",       dict(quant_dtype="fp8", per_act_token_quant=True)),
    ("fp8_tensor",      dict(quant_dtype="fp8")),
    ("int8_token",      dict(quant_dtype="int8", per_act_token_quant=True)),
    ("int8_group",      dict(quant_dtype="int8", block_shape=[128, 128])),
    ("int8_tensor",     dict(quant_dtype="int8")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,kw", ACT_MODES, ids=[m[0] for m in ACT_MODES])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16), np.dtype(np.float32)],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 128), (37, 384), (5, 200), (0, 256)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_act_quant_bit_exact(rng, name, kw, dtype, shape):
    M, K = shape
    x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 20, (M, 1))).astype(dtype)
    rq, rs = RQ.moe_kernel_quantize_input(x, None, **kw)
    gq, gs = QA.moe_kernel_quantize_input(up(x), None, **kw)
    gq = host(gq)
    assert gq.shape == rq.shape
    assert np.array_equal(gq.view(np.uint8), rq.view(np.uint8)), "codes differ"
    assert np.array_equal(host(gs).reshape(rs.shape), rs), "scales differ"


@pytest.mark.gpu
@pytest.mark.parametrize("qd", ["fp8", "int8"])
def test_act_quant_static_scale(rng, qd):
    x = rng.standard_normal((9, 256)).astype(BF16)
    s = np.float32([0.013])
    rq, rs = RQ.moe_kernel_quantize_input(x, s, qd)
    for scale in (s, up(s)):                   # host scalar or device array
        gq, gs = QA.moe_kernel_quantize_input(up(x), scale, qd)
        assert np.array_equal(host(gq).view(np.uint8), rq.view(np.uint8))
        assert host(gs).tolist() == rs.tolist()


@pytest.mark.gpu
def test_act_quant_nan_stays_in_its_group(rng):
    x = rng.standard_normal((4, 384)).astype(BF16)
    x[2, 140] = np.nan
    q, s = QA.per_token_group_quant_fp8(up(x), 128)
    deq = RQ.dequantize_activation(host(q, np.uint8).view(FP8), host(s), 128)
    assert np.isnan(deq[2, 128:256]).all()
    mask = np.ones(deq.shape, bool)
    mask[2, 128:256] = False
    assert np.isfinite(deq[mask]).all()


@pytest.mark.gpu
def test_act_quant_errors(rng):
    x = up(rng.standard_normal((4, 256)).astype(BF16))
    with pytest.raises(ValueError, match="group_size"):
        QA.per_token_group_quant_fp8(x, 100)
    with pytest.raises(TypeError, match="x"):
        QA.per_token_group_quant_fp8(host(x), 128)
    with pytest.raises(ValueError, match="quant_dtype"):
        QA.moe_kernel_quantize_input(x, None, "int4")
    with pytest.raises(ValueError, match="a_scale"):
        QA.moe_kernel_quantize_input(x, np.float32([1]), "fp8", block_shape=[128, 128])


# ----------------------------------------------------------------------------- GEMM
FP8_BLOCK = dict(use_fp8_w8a8=True, block_shape=[128, 128])
PER_ROW = dict(per_act_token_quant=True, per_channel_quant=True)
GEMM_FORMATS = [
    # name,          flags,                                            weights,   tolerance key
    ("fp8_block",    FP8_BLOCK,                                        "block",   "fp8_block"),
    ("fp8_tensor",   dict(use_fp8_w8a8=True),                          "tensor",  "fp8_block"),
    ("fp8_channel",  dict(use_fp8_w8a8=True, **PER_ROW),               "channel", "fp8_block"),
    ("int8_channel", dict(use_int8_w8a8=True, **PER_ROW),              "channel", "int8"),
    ("int8_block",   dict(use_int8_w8a8=True, block_shape=[128, 128]), "block",   "int8"),
    # weight-only: the group size (0: one group per row; < 0: signed int8 codes), zp when
    # the name says so
    ("int4_g128",    dict(use_int4_w4a16=True),                        128,       "wna16"),
    ("int4_g32_zp",  dict(use_int4_w4a16=True),                        32,        "wna16"),
    ("int4_channel", dict(use_int4_w4a16=True),                        0,         "wna16"),
    ("int4_g256_zp", dict(use_int4_w4a16=True),                        256,       "wna16"),
    ("uint8_g64_zp", dict(use_int8_w8a16=True),                        64,        "wna16"),
    ("int8_g128",    dict(use_int8_w8a16=True),                        -128,      "wna16"),
]

GEMM_SHAPES = [
    # M_a, E, top_k, N,   Kdim, B   (one row; rows not a multiple of the tile; Kdim / N not
    #                                 multiples of 128 (partial blocks); an expert with no
    #                                 tokens; everything on one expert)
    (1,   4, 2, 64,  256, 16),
    (29,  6, 2, 136, 320, 16),
    (70,  3, 1, 256, 384, 64),
    (40,  1, 1, 72,  128, 32),
]


def quantized_operands(rng, wfmt, flags, M_a, E, N, Kd):
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    w = (rng.standard_normal((E, N, Kd)) * 0.05).astype(BF16)
    if isinstance(wfmt, int):
        bits = 4 if flags.get("use_int4_w4a16") else 8
        gs = Kd if wfmt == 0 else math.gcd(abs(wfmt), Kd)   # a group divides Kdim
        wq, ws, wz = RQ.quantize_weight_wna16(w, bits, gs, zero_point=wfmt > 0 and wfmt != 128)
        if wfmt < 0:                           # signed int8 codes (vLLM's ExpertsInt8 layout)
            wq = (wq.astype(np.int16) - 128).astype(np.int8)
        return a, None, wq, ws, wz
    qd = "fp8" if flags.get("use_fp8_w8a8") else "int8"
    aq, as_ = RQ.moe_kernel_quantize_input(a, None, qd, flags.get("per_act_token_quant", False),
                                           flags.get("block_shape"))
    quant_w = RQ.quantize_weight_fp8 if qd == "fp8" else RQ.quantize_weight_int8
    wq, ws = quant_w(w, wfmt)
    return aq, as_, wq, ws, None


def _v3_runs(flags, wfmt, Kd, B):
    gs = Kd if wfmt == 0 else math.gcd(abs(wfmt), Kd) if isinstance(wfmt, int) else 0
    return bool(flags.get("use_int4_w4a16")) and Kd % 128 == 0 and gs % 128 == 0 and B % 16 == 0


def _skip_fp8_below_sm89(flags, version):
    if flags.get("use_fp8_w8a8") and version in ("v2", None):
        import cupy
        if int(cupy.cuda.Device().compute_capability) < 89:
            pytest.skip("fp8 tensor cores need sm_89+")


@pytest.mark.gpu
@pytest.mark.parametrize("name,flags,wfmt,tol", GEMM_FORMATS, ids=[f[0] for f in GEMM_FORMATS])
@pytest.mark.parametrize("version", ["v1", "v2", "v3", None])
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_matches_reference(rng, name, flags, wfmt, tol, version, shape):
    _skip_fp8_below_sm89(flags, version)
    M_a, E, K, N, Kd, B = shape
    if version == "v3" and not _v3_runs(flags, wfmt, Kd, B):
        pytest.skip("v3 is int4 with Kdim and group_size multiples of 128, block_size % 16 == 0")
    aq, as_, wq, ws, wz = quantized_operands(rng, wfmt, flags, M_a, E, N, Kd)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    if E > 2:
        ids[ids == E - 1] = 0                    # expert E-1 gets no tokens
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    want = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, K, B, tw, True, bias, a_scale=as_,
                                 w_scale=ws, w_zp=wz, **flags)
    out = poisoned((M_a * K, N), BF16)
    got = QG.grouped_gemm_quant(up(aq), up(wq), up(st), up(ex), up(ntp), K, B, up(tw), True,
                                up(bias), a_scale=up(as_), w_scale=up(ws), w_zp=up(wz),
                                version=version, out=out, **flags)
    assert got is out
    err = rel_err(host(got, BF16), want)
    assert err <= GEMM_TOL, f"{name} {version}: rel_err {err:.3e}"
    assert err <= VLLM_TOL[tol]


@pytest.mark.gpu
@pytest.mark.parametrize("name,flags,wfmt,tol", [GEMM_FORMATS[0], GEMM_FORMATS[3],
                                                  GEMM_FORMATS[5]], ids=lambda v: str(v)[:12])
def test_gemm_v1_equals_v2(rng, name, flags, wfmt, tol):
    _skip_fp8_below_sm89(flags, "v2")
    M_a, E, K, N, Kd, B = 48, 5, 2, 192, 512, 64
    aq, as_, wq, ws, wz = quantized_operands(rng, wfmt, flags, M_a, E, N, Kd)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    st, ex, ntp = (up(v) for v in moe_align_block_size(ids, B, E))
    args = (up(aq), up(wq), st, ex, ntp, K, B)
    kw = dict(a_scale=up(as_), w_scale=up(ws), w_zp=up(wz), **flags)
    v1 = host(QG.grouped_gemm_quant(*args, version="v1", **kw), BF16)
    v2 = host(QG.grouped_gemm_quant(*args, version="v2", **kw), BF16)
    assert rel_err(v2, v1) <= GEMM_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_gemm_other_rank_rows_are_zero_and_fp16_output(rng, version):
    flags = dict(use_int8_w8a8=True, per_act_token_quant=True, per_channel_quant=True)
    M_a, E, N, Kd, B = 12, 4, 64, 256, 16
    aq, as_, wq, ws, _ = quantized_operands(rng, "channel", flags, M_a, 2, N, Kd)
    emap = np.array([0, -1, 1, -1], dtype=np.int32)
    ids = rng.integers(0, E, (M_a, 1)).astype(np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E, expert_map=emap)
    want = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, 1, B, a_scale=as_, w_scale=ws,
                                 out_dtype=np.float16, **flags)
    out = poisoned((M_a, N), np.float16)
    got = host(QG.grouped_gemm_quant(up(aq), up(wq), up(st), up(ex), up(ntp), 1, B,
                                     a_scale=up(as_), w_scale=up(ws), out_dtype=np.float16,
                                     version=version, out=out, **flags))
    assert got.dtype == np.float16
    assert (got[np.isin(ids[:, 0], [1, 3])] == 0).all()
    assert rel_err(got, want) <= GEMM_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", sorted(QG.WNA16_V3_CONFIGS))
def test_gemm_v3_fp16_other_rank_and_default_choice(rng, cfg):
    """wna16 v3 with fp16 activations, experts on another rank (zeros), a crowded expert
    (several m blocks), against the reference; and the table picks v3 for a decode batch."""
    M_a, E, K, N, Kd = 21, 4, 2, 48, 512
    B = QG.WNA16_V3_CONFIGS[cfg]["BM"]
    a = rng.standard_normal((M_a, Kd)).astype(np.float16)
    w = (rng.standard_normal((2, N, Kd)) * 0.05).astype(BF16)
    wq, ws, wz = RQ.quantize_weight_wna16(w, 4, 128, zero_point=True)
    emap = np.array([0, -1, 1, -1], dtype=np.int32)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    ids[:, 0] = 0                                      # expert 0 gets more than BM rows
    st, ex, ntp = moe_align_block_size(ids, B, E, expert_map=emap)
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, w_scale=ws, w_zp=wz,
                                 use_int4_w4a16=True)
    out = poisoned((M_a * K, N), np.float16)
    got = host(QG.grouped_gemm_quant(up(a), up(wq), up(st), up(ex), up(ntp), K, B, up(tw), True,
                                     w_scale=up(ws), w_zp=up(wz), use_int4_w4a16=True,
                                     version="v3", config=cfg, out=out))
    assert got.dtype == np.float16
    assert (got.reshape(M_a, K, N)[np.isin(ids, [1, 3])] == 0).all()
    assert rel_err(got, want) <= GEMM_TOL
    assert QG._pick_v3(2.0, 16, None, None, 4, Kd, 128, up(a), up(wq))[0] is not None
    assert QG._pick_v3(100.0, 64, None, None, 4, Kd, 128, up(a), up(wq))[0] is None


@pytest.mark.gpu
def test_gemm_empty_batch():
    rng = np.random.default_rng(0)
    flags = dict(use_fp8_w8a8=True, block_shape=[128, 128])
    aq, as_, wq, ws, _ = quantized_operands(rng, "block", flags, 0, 2, 64, 128)
    st, ex, ntp = moe_align_block_size(np.zeros((0, 2), np.int32), 16, 2)
    got = QG.grouped_gemm_quant(up(aq), up(wq), up(st), up(ex), up(ntp), 2, 16,
                                a_scale=up(as_), w_scale=up(ws), **flags)
    assert got.shape == (0, 64)


@pytest.mark.gpu
def test_gemm_argument_errors(rng):
    flags = dict(use_fp8_w8a8=True, block_shape=[128, 128])
    aq, as_, wq, ws, _ = quantized_operands(rng, "block", flags, 8, 2, 64, 256)
    st, ex, ntp = (up(v) for v in moe_align_block_size(rng.integers(0, 2, (8, 1)).astype(
        np.int32), 16, 2))
    base = dict(a_scale=up(as_), w_scale=up(ws), **flags)
    with pytest.raises(TypeError, match="a:"):
        QG.grouped_gemm_quant(up(aq).view(np.int8), up(wq), st, ex, ntp, 1, 16, **base)
    with pytest.raises(ValueError, match="a_scale"):
        QG.grouped_gemm_quant(up(aq), up(wq), st, ex, ntp, 1, 16,
                              **{**base, "a_scale": up(as_[:, :1].copy())})
    with pytest.raises(ValueError, match="block_shape"):
        QG.grouped_gemm_quant(up(aq), up(wq), st, ex, ntp, 1, 16,
                              **{**base, "block_shape": [64, 64]})
    st8, ex8, ntp8 = (up(v) for v in moe_align_block_size(rng.integers(0, 2, (8, 1)).astype(
        np.int32), 8, 2))
    with pytest.raises(ValueError, match="version"):   # v2 tiles are 16 rows: block_size 8 is v1's
        QG.grouped_gemm_quant(up(aq), up(wq), st8, ex8, ntp8, 1, 8, version="v2", **base)
    with pytest.raises(ValueError, match="use_"):
        QG.grouped_gemm_quant(up(aq), up(wq), st, ex, ntp, 1, 16, a_scale=up(as_),
                              w_scale=up(ws))


# ----------------------------------------------------------------------------- the layer
def gpu_quant_layer(x, w1q, w2q, tw, ids, kw, block_size):
    """fused_experts_quant from the GPU stages of this task: activation quantization and both
    GEMMs on the GPU; alignment, the activation and the combine from the reference (their
    GPU twins are other modules', tested there)."""
    T, K = ids.shape
    H = x.shape[1]
    E = w1q.shape[0]
    flags = {k: kw[k] for k in ("use_fp8_w8a8", "use_int8_w8a8", "use_int8_w8a16",
                                "use_int4_w4a16", "per_act_token_quant", "per_channel_quant",
                                "block_shape") if k in kw}
    qd = "fp8" if kw.get("use_fp8_w8a8") else ("int8" if kw.get("use_int8_w8a8") else None)
    st, ex, ntp = (up(v) for v in moe_align_block_size(ids, block_size, E))
    pat, bs = kw.get("per_act_token_quant", False), kw.get("block_shape")
    a1, s1 = QA.moe_kernel_quantize_input(up(x), None, qd, pat, bs)
    c1 = QG.grouped_gemm_quant(a1, up(w1q), st, ex, ntp, K, block_size, a_scale=s1,
                               w_scale=up(kw["w1_scale"]), w_zp=up(kw.get("w1_zp")), **flags)
    c2 = apply_activation(host(c1, BF16), "silu")
    a2, s2 = QA.moe_kernel_quantize_input(up(c2), None, qd, pat, bs)
    c3 = QG.grouped_gemm_quant(a2, up(w2q), st, ex, ntp, 1, block_size, up(tw), True,
                               a_scale=s2, w_scale=up(kw["w2_scale"]), w_zp=up(kw.get("w2_zp")),
                               **flags)
    return moe_sum(host(c3, BF16).reshape(T, K, H))


LAYER_SCHEMES = [("fp8_block", "fp8_block"), ("int8_channel", "int8"), ("int8_block", "int8"),
                 ("w4a16", "wna16"), ("w8a16", "wna16")]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,tol", LAYER_SCHEMES, ids=[s[0] for s in LAYER_SCHEMES])
@pytest.mark.parametrize("T,B", [(1, 16), (45, 16), (200, 64)])
def test_layer_matches_reference_within_vllm_tolerance(rng, scheme, tol, T, B):
    import cupy

    if scheme.startswith("fp8") and int(cupy.cuda.Device().compute_capability) < 89:
        pytest.skip("fp8 tensor cores need sm_89+")
    E, K, H, I = 8, 2, 384, 256
    x = rng.standard_normal((T, H)).astype(BF16)
    w1 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(BF16)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(BF16)
    tw, ids, _ = fused_topk(x, rng.standard_normal((T, E)).astype(np.float32), K, True)
    kw = RQ.quantize_moe_layer(w1, w2, scheme, zero_point=scheme == "w4a16")
    w1q, w2q = kw.pop("w1"), kw.pop("w2")
    want = RQ.fused_experts_quant(x, w1q, w2q, tw, ids, block_size=B, **kw)
    got = gpu_quant_layer(x, w1q, w2q, tw, ids, kw, B)
    assert rel_err(got, want) <= VLLM_TOL[tol]


# ============================================================================ CPU emulation
# NVRTC proves that the sources compile; this runs them. The .cu text (same source_text the
# GPU compiles, bf16 elements) is built by g++ against QEMU_HEADER, which stands in for the
# CUDA features the kernels use: a std::thread per CUDA thread, block after block; barriers;
# warp shuffles and the mma.sync fragment exchange through a per-warp rendezvous; cp.async
# copies that land only when a wait_group retires their group (a read before the wait sees the
# 0xAB garbage shared memory starts with); griddepcontrol.wait as the contract of a
# programmatic launch (arm_programmatic); fp8 / bf16 conversions by their definitions. The
# only code not run as written is quant_gemm.cu's block of inline-PTX helpers (replaced under
# QG_EMULATED_PTX by the header's versions, whose fragment layouts follow the PTX ISA). It
# cannot see timing, bank conflicts or the hardware's own reading of the PTX: the GPU tests
# stay the judge.
QEMU_HEADER = r"""
// CPU stand-ins for the CUDA features of quant_act.cu / quant_gemm.cu (see the test).
#pragma once
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define QG_EMULATED_PTX 1
using std::min; using std::max;
struct Idx3 { unsigned x = 0, y = 0, z = 0; };
thread_local Idx3 threadIdx, blockIdx;
Idx3 blockDim, gridDim;
alignas(128) static unsigned char g_smem[1 << 20];
inline void __trap() { fprintf(stderr, "__trap\n"); abort(); }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
// ---- 16-bit floats (round to nearest even, NaN kept)
struct __nv_bfloat16 { uint16_t b; };
struct __half { uint16_t b; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
struct __half2 { __half x, y; };
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float((unsigned)h.b << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40)};
    return {(uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline float __half2float(__half h) { _Float16 v; memcpy(&v, &h.b, 2); return (float)v; }
inline __half __float2half_rn(float f) {
    _Float16 v = (_Float16)f; __half h; memcpy(&h.b, &v, 2); return h; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
inline __half2 __floats2half2_rn(float a, float b) {
    return {__float2half_rn(a), __float2half_rn(b)}; }
// ---- fp8 e4m3fn: decode by formula, encode by nearest code (ties to the even code), satfinite
inline float e4m3_value(unsigned c) {
    const unsigned e = (c >> 3) & 15u, m = c & 7u;
    const float v = e ? std::ldexp(1.f + m / 8.f, (int)e - 7) : std::ldexp((float)m, -9);
    if ((c & 0x7fu) == 0x7fu) return NAN;
    return (c & 0x80u) ? -v : v;
}
typedef unsigned char __nv_fp8_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t,
                                                  __nv_fp8_interpretation_t) {
    if (std::isnan(x)) return 0x7f;
    const unsigned char sign = std::signbit(x) ? 0x80 : 0;
    const double a = std::fabs((double)x);
    if (a >= 448.0) return sign | 0x7e;
    unsigned best = 0; double bd = INFINITY;
    for (unsigned c = 0; c <= 0x7e; ++c) {
        const double d = std::fabs((double)e4m3_value(c) - a);
        if (d < bd || (d == bd && (c & 1u) == 0)) { bd = d; best = c; }
    }
    return sign | (unsigned char)best;
}
struct __nv_fp8_e4m3 { __nv_fp8_storage_t __x; operator float() const { return e4m3_value(__x); } };
// ---- warps: a rendezvous where every lane deposits bytes and leaves with all 32 deposits
struct WarpRv { std::mutex m; std::condition_variable cv; int arrived = 0; long gen = 0;
                unsigned char buf[2][32][64]; };
static std::vector<WarpRv>* g_warps = nullptr;
inline void warp_exchange(const void* mine, size_t n, unsigned char (*all)[64]) {
    const int lane = threadIdx.x & 31;
    WarpRv& w = (*g_warps)[threadIdx.x >> 5];
    std::unique_lock<std::mutex> lk(w.m);
    const long g = w.gen;
    memcpy(w.buf[g & 1][lane], mine, n);
    if (++w.arrived == 32) { w.arrived = 0; w.gen++; w.cv.notify_all(); }
    else w.cv.wait(lk, [&] { return w.gen != g; });
    memcpy(all, w.buf[g & 1], sizeof(w.buf[0]));
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int o) {
    unsigned char all[32][64]; warp_exchange(&v, sizeof(T), all);
    T r; memcpy(&r, all[(threadIdx.x & 31) ^ o], sizeof(T)); return r;
}
template <typename T> inline T __shfl_sync(unsigned, T v, int src) {
    unsigned char all[32][64]; warp_exchange(&v, sizeof(T), all);
    T r; memcpy(&r, all[src & 31], sizeof(T)); return r;
}
// ---- blocks
static std::barrier<>* g_bar = nullptr;
inline void __syncthreads() { g_bar->arrive_and_wait(); }
static std::atomic<int> g_or{0};
inline int __syncthreads_or(int p) {
    if (threadIdx.x == 0) g_or = 0;   // every reader of the last call passed its final barrier
    __syncthreads();
    if (p) g_or |= 1;
    __syncthreads();
    const int r = g_or.load();
    __syncthreads();
    return r;
}
static std::mutex g_atomic;
inline unsigned atomicMax(unsigned* p, unsigned v) {
    std::lock_guard<std::mutex> l(g_atomic); unsigned o = *p; if (v > o) *p = v; return o; }
// ---- cp.async: copies are queued per thread and land only when a wait_group retires their
// group (the latest moment the hardware allows): a read before the wait sees garbage
struct Copy { void* dst; const void* src; int n, valid; };
thread_local std::vector<Copy> t_open;
thread_local std::deque<std::vector<Copy>> t_groups;
inline void qg_pdl_read(const void* src, int n);   // (programmatic launches, below)
inline void qg_copy(void* dst, const void* src, int n, bool pred) {
    if (pred) qg_pdl_read(src, n);
    t_open.push_back({dst, src, n, pred ? n : 0}); }
inline void qg_cp16(void* dst, const void* src, bool pred) { qg_copy(dst, src, 16, pred); }
inline void qg_cp4(void* dst, const void* src, bool pred) { qg_copy(dst, src, 4, pred); }
inline void qg_commit() { t_groups.push_back(t_open); t_open.clear(); }
template <int N> inline void qg_wait() {
    while ((int)t_groups.size() > N) {
        for (const Copy& c : t_groups.front()) {
            if (c.valid) memcpy(c.dst, c.src, c.n); else memset(c.dst, 0, c.n);
        }
        t_groups.pop_front();
    }
}
// ---- programmatic dependent launch (griddepcontrol), armed for one launch by qg_pdl_arm: the
// worst case of a grid started while the grid before it still runs. Until every thread of a CTA
// has reached qg_grid_dependency_wait (or exited), the ranges the earlier grid writes (`inputs`)
// hold 0xFF bytes (NaN in every float format; the real bytes come back at the wait) and a
// cp.async from them counts as an early read; the ranges this grid writes (`outputs`) must be
// as the CTA found them when its threads meet there. The emulated wait is a CTA-wide
// rendezvous (the hardware's is per thread): every emulated kernel calls it uniformly, and a
// rendezvous that does not fill within a minute opens anyway and counts as `stuck`.
struct PdlRange { unsigned char* p; size_t n; std::vector<unsigned char> kept; };
struct Pdl {
    bool armed = false, ignore_waits = false;       // ignore_waits: the checks' own test
    std::vector<PdlRange> inputs, outputs;
    std::mutex m; std::condition_variable cv;
    unsigned arrived = 0, exited = 0, block = 0; bool open = true;
    int early_reads = 0, early_writes = 0, stuck = 0;
};
static Pdl g_pdl;
thread_local bool t_dep_waited = false;
inline void qg_pdl_read(const void* src, int n) {
    if (!g_pdl.armed || t_dep_waited) return;
    const unsigned char* s = static_cast<const unsigned char*>(src);
    for (const PdlRange& r : g_pdl.inputs)
        if (s < r.p + r.n && s + n > r.p) {
            std::lock_guard<std::mutex> l(g_pdl.m); ++g_pdl.early_reads; return; }
}
inline void qg_pdl_cta_begin(unsigned block) {      // before the CTA's threads start
    g_pdl.arrived = g_pdl.exited = 0; g_pdl.block = block; g_pdl.open = !g_pdl.armed;
    if (!g_pdl.armed) return;
    for (PdlRange& r : g_pdl.inputs) {
        r.kept.assign(r.p, r.p + r.n); memset(r.p, 0xFF, r.n); }
    for (PdlRange& r : g_pdl.outputs) r.kept.assign(r.p, r.p + r.n);
}
inline void qg_pdl_open() {                         // under g_pdl.m: the earlier grid is done
    for (const PdlRange& r : g_pdl.outputs)
        if (memcmp(r.p, r.kept.data(), r.n) != 0) ++g_pdl.early_writes;
    for (const PdlRange& r : g_pdl.inputs) memcpy(r.p, r.kept.data(), r.n);
    g_pdl.open = true; g_pdl.cv.notify_all();
}
inline void qg_grid_dependency_wait() {
    if (!g_pdl.armed || t_dep_waited || g_pdl.ignore_waits) return;
    std::unique_lock<std::mutex> l(g_pdl.m);
    t_dep_waited = true;
    if (++g_pdl.arrived + g_pdl.exited == g_pdl.block) qg_pdl_open();
    else if (!g_pdl.cv.wait_for(l, std::chrono::seconds(60), [] { return g_pdl.open; })) {
        ++g_pdl.stuck; qg_pdl_open(); }
}
inline void qg_pdl_thread_exit() {                  // a thread leaves the kernel
    if (g_pdl.armed && !t_dep_waited) {
        std::lock_guard<std::mutex> l(g_pdl.m);
        if (++g_pdl.exited + g_pdl.arrived == g_pdl.block && !g_pdl.open) qg_pdl_open();
    }
    t_dep_waited = false;
}
// ---- mma.sync: the fragments of all 32 lanes, multiplied by the PTX ISA's layouts
struct MmaIn { uint32_t a[4], b[2]; };
template <typename Dec, typename Acc>
inline void mma_8bit(Acc (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], Dec dec) {
    MmaIn in; memcpy(in.a, a, 16); memcpy(in.b, b, 8);
    unsigned char all[32][64]; warp_exchange(&in, sizeof(in), all);
    auto A = [&](int row, int col) {   // m16n8k32 A: lane (row % 8) * 4 + (col % 16) / 4
        const int lane = (row & 7) * 4 + ((col & 15) >> 2);
        const int reg = (row >= 8 ? 1 : 0) + (col >= 16 ? 2 : 0);
        MmaIn x; memcpy(&x, all[lane], sizeof(x));
        return dec((x.a[reg] >> (8 * (col & 3))) & 0xffu);
    };
    auto B = [&](int k, int col) {     // B: lane col * 4 + (k % 16) / 4, reg k / 16
        const int lane = col * 4 + ((k & 15) >> 2);
        MmaIn x; memcpy(&x, all[lane], sizeof(x));
        return dec((x.b[k >= 16 ? 1 : 0] >> (8 * (k & 3))) & 0xffu);
    };
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    for (int i = 0; i < 4; ++i) {
        const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        Acc s = 0;
        for (int k = 0; k < 32; ++k) s += (Acc)A(row, k) * (Acc)B(k, col);
        d[i] += s;
    }
}
inline void qg_mma_k32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    mma_8bit(d, a, b, [](unsigned c) { return e4m3_value(c); });
}
inline void qg_mma_k32(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    mma_8bit(d, a, b, [](unsigned c) { return (int)(signed char)c; });
}
#if ELEM_BF16
#define QG_ELEM_H 0      // the build's 16-bit element is bf16
#else
#define QG_ELEM_H 1      // fp16 (also where no ELEM_BF16 is defined: quant_act.cu)
#endif
template <bool H> inline float dec16(unsigned h) {   // H: fp16, else bf16
    if constexpr (H) return __half2float({(uint16_t)h});
    else return __bfloat162float({(uint16_t)h});
}
template <bool H = QG_ELEM_H>
inline void qg_mma_k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    MmaIn in; memcpy(in.a, a, 16); memcpy(in.b, b, 8);
    unsigned char all[32][64]; warp_exchange(&in, sizeof(in), all);
    auto A = [&](int row, int col) {   // m16n8k16 A: lane (row % 8) * 4 + (col % 8) / 2
        const int lane = (row & 7) * 4 + ((col & 7) >> 1);
        const int reg = (row >= 8 ? 1 : 0) + (col >= 8 ? 2 : 0);
        MmaIn x; memcpy(&x, all[lane], sizeof(x));
        return dec16<H>((x.a[reg] >> (16 * (col & 1))) & 0xffffu);
    };
    auto B = [&](int k, int col) {
        const int lane = col * 4 + ((k & 7) >> 1);
        MmaIn x; memcpy(&x, all[lane], sizeof(x));
        return dec16<H>((x.b[k >= 8 ? 1 : 0] >> (16 * (k & 1))) & 0xffffu);
    };
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    for (int i = 0; i < 4; ++i) {
        const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        float s = 0;
        for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
        d[i] += s;
    }
}
// ---- wna16 v3: 16-byte register loads, byte permute, paired 16-bit subtraction
inline void qg_ld16(uint32_t (&r)[4], const void* p) { memcpy(r, p, 16); }
inline void qg_ld16_stream(uint32_t (&r)[4], const void* p) { memcpy(r, p, 16); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned char b[8]; memcpy(b, &x, 4); memcpy(b + 4, &y, 4);
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)b[(s >> (4 * i)) & 7u] << (8 * i);
    return r;
}
inline unsigned enc16(float f) {
#if ELEM_BF16
    return __float2bfloat16_rn(f).b;
#else
    return __float2half_rn(f).b;
#endif
}
inline uint32_t qg_sub2(uint32_t x, uint32_t y) {
    const float lo = dec16<QG_ELEM_H>(x & 0xffffu) - dec16<QG_ELEM_H>(y & 0xffffu);
    const float hi = dec16<QG_ELEM_H>(x >> 16) - dec16<QG_ELEM_H>(y >> 16);
    return enc16(lo) | (enc16(hi) << 16);
}
// ---- a launch: the blocks one after another, a std::thread per CUDA thread
// (in ascending order, or descending after qg_block_order(1): a GPU runs them in any order, and
// kernels whose blocks hand work to each other finish it in whichever block comes last)
static int g_descending = 0;
template <typename F> void launch(unsigned gx, unsigned gy, unsigned block, F body) {
    gridDim.x = gx; gridDim.y = gy; blockDim.x = block;
    for (unsigned i = 0; i < gx * gy; ++i) {
        const unsigned b = g_descending ? gx * gy - 1 - i : i, bx = b % gx, by = b / gx;
        memset(g_smem, 0xAB, sizeof(g_smem));     // garbage, as a fresh CTA's shared memory
        std::vector<WarpRv> warps((block + 31) / 32); g_warps = &warps;
        std::barrier<> bar((std::ptrdiff_t)block); g_bar = &bar;
        qg_pdl_cta_begin(block);
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < block; ++t)
            ts.emplace_back([&, t, bx, by] {
                threadIdx.x = t; blockIdx.x = bx; blockIdx.y = by;
                body();
                for (auto& g : t_groups)           // a copy nobody waited for is a bug
                    if (!g.empty()) { fprintf(stderr, "cp.async never waited\n"); abort(); }
                t_open.clear(); t_groups.clear();
                qg_pdl_thread_exit();
                bar.arrive_and_drop();
            });
        for (auto& t : ts) t.join();
    }
    g_pdl.armed = g_pdl.ignore_waits = false;          // armed for one launch
    g_pdl.inputs.clear(); g_pdl.outputs.clear();
}
extern "C" void qg_block_order(int descending) { g_descending = descending; }
// The C entry points of every emulation: arm the next launch (a list of (pointer, bytes) pairs
// for the inputs, then the outputs), and read what it counted.
extern "C" void qg_pdl_arm(int n_in, void** in, const size_t* in_bytes, int n_out, void** out,
                           const size_t* out_bytes, int ignore_waits) {
    g_pdl.inputs.clear(); g_pdl.outputs.clear();
    for (int i = 0; i < n_in; ++i)
        g_pdl.inputs.push_back({static_cast<unsigned char*>(in[i]), in_bytes[i], {}});
    for (int i = 0; i < n_out; ++i)
        g_pdl.outputs.push_back({static_cast<unsigned char*>(out[i]), out_bytes[i], {}});
    g_pdl.armed = true; g_pdl.ignore_waits = ignore_waits != 0; g_pdl.early_reads = 0;
    g_pdl.early_writes = g_pdl.stuck = 0;
}
extern "C" void qg_pdl_counts(int* counts) {
    counts[0] = g_pdl.early_reads; counts[1] = g_pdl.early_writes; counts[2] = g_pdl.stuck; }
"""


def build_emulation(tmp_path_factory, tag, cu, entry, prelude="", defines=None):
    """`cu` with bf16 elements (or `defines`), built by g++ with the emulation header in a fresh
    folder (the C entry points `entry`, then `prelude` after the header); skips where g++ is
    missing."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine")
    tmp = tmp_path_factory.mktemp(f"{tag}_emulation")
    (tmp / "qemu.h").write_text(QEMU_HEADER)
    return _build_emulated(tmp, cu, defines or {"ELEM_BF16": 1}, entry, tag, prelude=prelude)


def _build_emulated(tmp, cu, defines, entry, name, prelude=""):
    """`cu` with `defines`, the emulation header qemu.h (written into `tmp` by the caller) and
    `prelude` after it, plus the C entry points `entry`, built by g++ and loaded."""
    import re
    import subprocess

    src = C.source_text(cu, defines)
    src = re.sub(r"#include <cuda_(fp16|bf16|fp8)\.h>", "", src)
    src = re.sub(r"extern __shared__ __align__\(\d+\) u8 smem\[\];", "u8* smem = g_smem;", src)
    lines = src.split("\n")   # the header reads the #defines (ELEM_BF16): it goes after them
    first = next(k for k, line in enumerate(lines) if line.startswith("#line"))
    src = "\n".join(lines[:first] + ['#include "qemu.h"', prelude] + lines[first:])
    cpp = tmp / f"{name}.cpp"
    cpp.write_text(src + "\n" + entry + "\n")
    so = tmp / f"{name}.so"
    r = subprocess.run(["g++", "-std=c++20", "-O1", "-w", "-shared", "-fPIC", "-pthread",
                        "-I", str(tmp), str(cpp), "-o", str(so)], capture_output=True, text=True)
    assert r.returncode == 0, f"{cu} does not build for the emulation:\n{r.stderr[:3000]}"
    import ctypes
    return ctypes.CDLL(str(so))


def _gemm_entries():
    """One C entry k<i> per kernel name the launcher can pick (bf16 elements)."""
    names = list(QG.V1_NAMES) + list(QG.W8A8_V2_NAMES) + list(QG.WNA16_V2_NAMES) + \
        list(QG.WNA16_V3_NAMES)
    out = []
    for i, n in enumerate(names):
        if n.startswith("w8a8"):
            call = (f"{n}((const u8*)a, (const u8*)w, (elem_t*)c, (const float*)p3, "
                    f"(const float*)p4, st, ex, ntp, tw, bias, N, K, P, top_k, B, L, mul, i0, i1)")
        else:
            call = (f"{n}((const elem_t*)a, (const u8*)w, (elem_t*)c, (const float*)p3, "
                    f"(const u8*)p4, st, ex, ntp, tw, bias, N, K, P, top_k, B, L, mul, i0, i1, "
                    f"i2, i3)")
        out.append(
            f'extern "C" void k{i}(unsigned gx, unsigned gy, unsigned block, const void* a, '
            f"const void* w, void* c, const void* p3, const void* p4, const int* st, "
            f"const int* ex, const int* ntp, const float* tw, const float* bias, int N, int K, "
            f"int P, int top_k, int B, int L, int mul, int i0, int i1, int i2, int i3) {{\n"
            f"    launch(gx, gy, block, [&] {{ {call}; }});\n}}")
    return names, "\n".join(out)


_ACT_ENTRY = r"""
extern "C" void gq(int qt, unsigned grid, const IN_T* x, unsigned char* q, float* s,
                   const float* st, const float* ta, int M, int K, int gs, int G, float qmax,
                   float eps, float mins, int ue) {
    if (qt == 0) launch(grid, 1, WARPS_PER_BLOCK * 32, [&] {
        group_quant_kernel<0>(x, q, s, st, ta, M, K, gs, G, qmax, eps, mins, ue); });
    else launch(grid, 1, WARPS_PER_BLOCK * 32, [&] {
        group_quant_kernel<1>(x, q, s, st, ta, M, K, gs, G, qmax, eps, mins, ue); });
}
extern "C" void amax(unsigned grid, const IN_T* x, unsigned* bits, long long n) {
    launch(grid, 1, 256, [&] { absmax_kernel(x, bits, n); });
}"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """{"act": quant_act.cu (bf16 input), "gemm": (kernel names, quant_gemm.cu)} built for the
    CPU emulation."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine")
    tmp = tmp_path_factory.mktemp("quant_emulation")
    (tmp / "qemu.h").write_text(QEMU_HEADER)
    names, entries = _gemm_entries()
    return {"act": _build_emulated(tmp, "quant_act.cu", QA._defines(BF16), _ACT_ENTRY, "qa"),
            "gemm": (names, _build_emulated(tmp, "quant_gemm.cu", {"ELEM_BF16": 1}, entries,
                                            "qg"))}


def _ptr(a):
    import ctypes

    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def arm_programmatic(lib, inputs, outputs, ignore_waits=False):
    """Arms the emulation's model of a programmatic launch (QEMU_HEADER, qg_pdl_arm) for the
    next launch of `lib`: `inputs`, the arrays the grid before it writes, read NaN until a CTA's
    wait; `outputs`, the arrays the launch writes, must not change before it. ignore_waits: the
    kernel's waits do nothing (the checks' own test)."""
    import ctypes

    def pairs(arrays):
        ptrs = (ctypes.c_void_p * max(1, len(arrays)))(*[x.ctypes.data for x in arrays])
        sizes = (ctypes.c_size_t * max(1, len(arrays)))(*[x.nbytes for x in arrays])
        return len(arrays), ptrs, sizes

    lib.qg_pdl_arm(*pairs(inputs), *pairs(outputs), int(ignore_waits))


@contextlib.contextmanager
def blocks_descending(lib, descending=True):
    """Launches of `lib` inside run their CTAs last to first (QEMU_HEADER, qg_block_order): a
    GPU runs them in any order, so work that CTAs hand each other must come out the same."""
    lib.qg_block_order(int(descending))
    try:
        yield
    finally:
        lib.qg_block_order(0)


def programmatic_counts(lib) -> dict:
    """What the last armed launch counted: copies issued from its inputs before their CTA's
    wait, outputs found changed at a CTA's wait (one count per array and CTA), and waits that
    not all of a CTA's threads met."""
    import ctypes

    counts = (ctypes.c_int * 3)()
    lib.qg_pdl_counts(counts)
    return dict(early_reads=counts[0], early_writes=counts[1], stuck=counts[2])


def emulated_act_quant(lib, x, qd, group_size, eps, min_scale, ue8m0, static=None,
                       tensor=False):
    """The launch of quant_act.py (geometry, arguments) against the emulated kernels."""
    import ctypes

    M, K = x.shape
    G = -(-K // group_size)
    q = np.full((M, K), 0xEE, np.uint8)                   # poisoned
    s = np.full((1,) if (static is not None or tensor) else (M, G), np.nan, np.float32)
    ta = None
    if tensor:
        bits = np.zeros(1, np.uint32)
        lib.amax(ctypes.c_uint(3), _ptr(x.view(np.uint16)), _ptr(bits), ctypes.c_longlong(x.size))
        ta = bits.view(np.float32)
    st = None if static is None else np.asarray(static, np.float32)
    wpb = QA.CONFIGS["group_quant_kernel"]["WARPS_PER_BLOCK"]
    lib.gq(QA.QT[qd], ctypes.c_uint(-(-(M * G) // wpb)), _ptr(x.view(np.uint16)), _ptr(q),
           _ptr(s), _ptr(st), _ptr(ta), M, K, group_size, G,
           ctypes.c_float(448.0 if qd == "fp8" else 127.0), ctypes.c_float(eps),
           ctypes.c_float(min_scale), int(ue8m0))
    if static is not None:
        s = st
    return q, s


EMU_ACT_MODES = [
    # name, reference kwargs, (quant dtype, group size (None: the row), eps, min scale, ue8m0)
    ("fp8_group", dict(quant_dtype="fp8", block_shape=[128, 128]), ("fp8", 128, 1e-10, 0.0, 0)),
    ("fp8_group_ue8m0", dict(quant_dtype="fp8", block_shape=[128, 128], use_ue8m0=True),
     ("fp8", 128, 1e-10, 0.0, 1)),
    ("fp8_token", dict(quant_dtype="fp8", per_act_token_quant=True),
     ("fp8", None, 0.0, QA.FP8_MIN_SCALE, 0)),
    ("int8_token", dict(quant_dtype="int8", per_act_token_quant=True),
     ("int8", None, 1e-10, 0.0, 0)),
    ("int8_group", dict(quant_dtype="int8", block_shape=[128, 128]), ("int8", 128, 1e-10, 0.0, 0)),
]


@pytest.mark.simulator
@pytest.mark.slow
def test_emulated_act_quant_bit_exact(emulated):
    lib = emulated["act"]
    rng = np.random.default_rng(11)
    for M, K in ((3, 384), (2, 200)):                   # 200: a partial last group
        x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 20, (M, 1))).astype(BF16)
        for name, rkw, (qd, gs, eps, mins, ue) in EMU_ACT_MODES:
            rq, rs = RQ.moe_kernel_quantize_input(x, None, **rkw)
            gq, gs_ = emulated_act_quant(lib, x, qd, gs or K, eps, mins, ue)
            assert np.array_equal(gq, rq.view(np.uint8)), f"{name} {M}x{K}: codes"
            assert np.array_equal(gs_.reshape(rs.shape), rs), f"{name} {M}x{K}: scales"
        rq, rs = RQ.moe_kernel_quantize_input(x, None, "fp8")            # dynamic per-tensor
        gq, gs_ = emulated_act_quant(lib, x, "fp8", K, 0.0, QA.FP8_MIN_SCALE, 0, tensor=True)
        assert np.array_equal(gq, rq.view(np.uint8)) and np.array_equal(gs_, rs)
        rq, rs = RQ.moe_kernel_quantize_input(x, np.float32([0.02]), "int8")   # static
        gq, _ = emulated_act_quant(lib, x, "int8", K, 0.0, 0.0, 0, static=[0.02])
        assert np.array_equal(gq, rq.view(np.uint8))
    x = rng.standard_normal((2, 256)).astype(BF16)
    x[1, 3] = np.nan                                    # NaN: its group's scale and codes
    gq, gs_ = emulated_act_quant(lib, x, "fp8", 128, 1e-10, 0.0, 0)
    deq = RQ.dequantize_activation(gq.view(FP8), gs_, 128)
    assert np.isnan(deq[1, :128]).all() and np.isfinite(deq[0]).all() and \
        np.isfinite(deq[1, 128:]).all()


def emulated_gemm(emu, version, cfg_name, aq, as_, wq, ws, wz, st, ex, ntp, top_k, B, tw,
                  bias, flags):
    """quant_gemm.py's choice of kernel, geometry and arguments, launched on the emulation."""
    import ctypes

    names, lib = emu
    fmt = ("fp8" if flags.get("use_fp8_w8a8") else "int8" if flags.get("use_int8_w8a8")
           else "int4" if flags.get("use_int4_w4a16") else "w8a16")
    M_a, K = aq.shape
    N = wq.shape[1]
    P, L = M_a * top_k, st.size
    Lg = min(L, P * B)                                  # the launcher's grid bound
    c = np.full((P, N), 0x7FC0, np.uint16)             # poisoned: bf16 NaN
    i = [0, 0, 0, 0]
    if fmt in ("fp8", "int8"):
        if flags.get("block_shape"):
            i[:2] = [2, 2]
        else:
            i[:2] = [int(bool(flags.get("per_act_token_quant"))),
                     int(bool(flags.get("per_channel_quant")))]
        p3, p4 = np.ascontiguousarray(as_, np.float32), np.ascontiguousarray(ws, np.float32)
        a_, table = np.ascontiguousarray(aq).view(np.uint8), QG.W8A8_CONFIGS
        name = (f"w8a8_gemm_v1<{QG.QT[fmt]}>" if version == "v1"
                else QG._w8a8_name(fmt, table[cfg_name]))
    else:
        nbits = 4 if fmt == "int4" else 8
        G = ws.shape[2]
        i = [K // G, G, 8 if nbits == 4 else 128, 0x80 if wq.dtype == np.int8 else 0]
        p3, p4 = np.ascontiguousarray(ws, np.float32), wz
        a_, table = np.ascontiguousarray(aq).view(np.uint16), QG.WNA16_CONFIGS
        if version == "v2":
            assert QG.wna16_group_ok(K // G, G, table[cfg_name]["BK"])
        if version == "v3":
            table = QG.WNA16_V3_CONFIGS
            assert nbits == 4 and K % 128 == 0 and (K // G) % 128 == 0
        name = (f"wna16_gemm_v1<{nbits}>" if version == "v1"
                else QG._v3_name(table[cfg_name]) if version == "v3"
                else QG._wna16_name(nbits, table[cfg_name]))
    if version == "v1":
        grid, block = (Lg, -(-N // 128)), 128
    elif version == "v3":
        cfg = table[cfg_name]
        assert B % cfg["BM"] == 0
        grid, block = (-(-Lg // cfg["BM"]), -(-N // 16)), cfg["WARPS"] * 32
    else:
        cfg = table[cfg_name]
        assert B % cfg["BM"] == 0
        grid = (-(-Lg // cfg["BM"]), -(-N // cfg["BN"]))
        block = cfg["WARPS_M"] * cfg["WARPS_N"] * 32
    twf = None if tw is None else np.ascontiguousarray(tw, np.float32).ravel()
    getattr(lib, f"k{names.index(name)}")(
        ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(block), _ptr(a_),
        _ptr(np.ascontiguousarray(wq).view(np.uint8)), _ptr(c), _ptr(p3), _ptr(p4), _ptr(st),
        _ptr(ex), _ptr(ntp),
        _ptr(twf), _ptr(bias), N, K, P, top_k, B, L, int(tw is not None), *i)
    return c.view(BF16)


EMU_GEMM_CASES = [
    # format,        version, config, (M_a, E, top_k, N, Kdim, B)   (partial K blocks, N not a
    #                                                                 multiple of the tile, tiles
    #                                                                 smaller than the block)
    ("fp8_block",    "v1", None,  (5, 4, 2, 72, 320, 16)),
    ("fp8_block",    "v2", "m16", (5, 4, 2, 72, 320, 32)),
    ("fp8_block",    "v2", "m64", (40, 3, 2, 136, 256, 64)),
    ("fp8_tensor",   "v2", "m16", (5, 4, 2, 72, 320, 16)),
    ("int8_channel", "v2", "m16", (5, 4, 2, 72, 320, 16)),
    ("int8_channel", "v1", None,  (5, 4, 2, 72, 320, 16)),
    ("int4_g128",    "v1", None,  (5, 4, 2, 72, 384, 16)),
    ("int4_g128",    "v2", "m16", (5, 4, 2, 72, 384, 32)),
    ("int4_g32_zp",  "v2", "m64", (40, 3, 2, 136, 256, 64)),
    ("uint8_g64_zp", "v2", "m16", (5, 4, 2, 72, 320, 16)),
    ("int8_g128",    "v2", "m64", (40, 3, 2, 136, 256, 64)),   # signed int8 codes
    # v3 (decode): N not a multiple of 16, a K-step count not a multiple of WARPS * U, live
    # tiles next to padding-only ones, zero points, one group per row
    ("int4_g128",    "v3", "gemv16", (3, 4, 2, 40, 384, 16)),
    ("int4_g256_zp", "v3", "gemv32", (14, 3, 2, 24, 1280, 32)),
    ("int4_channel", "v3", "gemv16", (6, 2, 1, 16, 256, 16)),
]


@pytest.mark.simulator
@pytest.mark.slow
@pytest.mark.parametrize("fmt,version,cfg,shape", EMU_GEMM_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in EMU_GEMM_CASES])
def test_emulated_gemm_matches_reference(emulated, fmt, version, cfg, shape):
    entry = next(f for f in GEMM_FORMATS if f[0] == fmt)
    _, flags, wfmt, _ = entry
    rng = np.random.default_rng(zlib.crc32(f"{fmt}{version}{cfg}".encode()))
    M_a, E, K, N, Kd, B = shape
    aq, as_, wq, ws, wz = quantized_operands(rng, wfmt, flags, M_a, E, N, Kd)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    want = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, K, B, tw, True, bias, a_scale=as_,
                                 w_scale=ws, w_zp=wz, **flags)
    got = emulated_gemm(emulated["gemm"], version, cfg, aq, as_, wq, ws, wz, st, ex, ntp, K, B,
                        tw, bias, flags)
    assert rel_err(got, want) <= GEMM_TOL
