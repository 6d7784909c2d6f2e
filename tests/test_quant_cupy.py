"""The quantized CuPy kernels (quant_act.cu, quant_gemm.cu) against reference/quant.py.

CPU (always): the launchers import without a GPU and register their compile cases; the
cases compile through NVRTC for sm_90 and sm_80 (marked slow: the tensor-core templates take
about a minute of CPU).
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

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = RQ.FP8_DTYPE
VLLM_TOL = {"fp8_block": 0.035, "int8": 0.065, "wna16": 2e-2}   # vLLM's own test tolerances
GEMM_TOL = 1e-2   # same quantized operands, other accumulation order: bf16 output rounding


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def rel_err(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape
    assert not np.isnan(a).any(), "NaN in the kernel's output (poison left, or a NaN computed)"
    assert not np.isnan(b).any()
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / den) if den else float(np.linalg.norm(a - b))


# ----------------------------------------------------------------------------- CPU
def test_launchers_import_and_register_cases():
    files = {c.cu_name for c in C.COMPILE_CASES}
    assert {"quant_act.cu", "quant_gemm.cu"} <= files
    names = {n for c in C.COMPILE_CASES if c.cu_name == "quant_gemm.cu"
             for n in (c.name_expressions or ())}
    assert set(QG.V1_NAMES) | set(QG.W8A8_V2_NAMES) | set(QG.WNA16_V2_NAMES) <= names


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


NVRTC_OK, NVRTC_WHY = C.nvrtc_available()
MY_CASES = [c for c in C.COMPILE_CASES if c.cu_name in ("quant_act.cu", "quant_gemm.cu")]


@pytest.mark.slow
@pytest.mark.skipif(not NVRTC_OK, reason=f"cuda.core/NVRTC unavailable: {NVRTC_WHY}")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("case", MY_CASES,
                         ids=[f"{c.cu_name}-{c.defines}-{len(c.name_expressions or ())}"
                              for c in MY_CASES])
def test_compiles_without_gpu(case, arch):
    cubin = C.compile_check(case.cu_name, case.defines, case.name_expressions, arch, case.options)
    assert len(cubin) > 0


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
GEMM_FORMATS = [
    # name,          flags,                                                      weights,   tol key
    ("fp8_block",    dict(use_fp8_w8a8=True, block_shape=[128, 128]),            "block",   "fp8_block"),
    ("fp8_tensor",   dict(use_fp8_w8a8=True),                                    "tensor",  "fp8_block"),
    ("fp8_channel",  dict(use_fp8_w8a8=True, per_act_token_quant=True,
                          per_channel_quant=True),                               "channel", "fp8_block"),
    ("int8_channel", dict(use_int8_w8a8=True, per_act_token_quant=True,
                          per_channel_quant=True),                               "channel", "int8"),
    ("int8_block",   dict(use_int8_w8a8=True, block_shape=[128, 128]),           "block",   "int8"),
    ("int4_g128",    dict(use_int4_w4a16=True),                                  128,       "wna16"),
    ("int4_g32_zp",  dict(use_int4_w4a16=True),                                  32,        "wna16"),
    ("int4_channel", dict(use_int4_w4a16=True),                                  0,         "wna16"),
    ("uint8_g64_zp", dict(use_int8_w8a16=True),                                  64,        "wna16"),
    ("int8_g128",    dict(use_int8_w8a16=True),                                  -128,      "wna16"),
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


def _skip_fp8_below_sm89(flags, version):
    if flags.get("use_fp8_w8a8") and version == "v2":
        import cupy
        if int(cupy.cuda.Device().compute_capability) < 89:
            pytest.skip("fp8 tensor cores need sm_89+")


@pytest.mark.gpu
@pytest.mark.parametrize("name,flags,wfmt,tol", GEMM_FORMATS, ids=[f[0] for f in GEMM_FORMATS])
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_matches_reference(rng, name, flags, wfmt, tol, version, shape):
    _skip_fp8_below_sm89(flags, version)
    M_a, E, K, N, Kd, B = shape
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
