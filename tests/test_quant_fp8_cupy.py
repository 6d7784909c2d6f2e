"""The fp8 w8a8 rungs v4 (decode weight streaming, quant_gemm_fp8_gemv.cu) and v5 (Hopper
wgmma, quant_gemm_fp8_wgmma.cu) of quant_gemm.py against reference/quant.py.

CPU: the config tables, the rung choice, the shared-memory budgets, the registered compile
cases (the NVRTC compiles themselves run in tests/test_cupy_nvrtc.py).
GPU (`gpu` marker): every config of each rung against grouped_gemm_quant of the reference on
the same quantized operands (block, per-tensor and per-channel scales; outputs poisoned with
NaN first; tolerance: bf16 output rounding 1e-2, and vLLM's block-fp8 0.035), nasty shapes
(N and Kdim not multiples of the tiles, an expert with no tokens, everything on one expert),
experts on another rank (zeros), fp16 output.

Shape legend: M_a activation rows, E experts, K top-k, N output width, Kdim reduction width,
B block size.
"""
from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy import quant_gemm as QG
from reference import moe_align_block_size
from reference import quant as RQ
from oracles import rel_err
from test_quant_cupy import host, poisoned, up  # the quantized tests' GPU helpers

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = RQ.FP8_DTYPE
GEMM_TOL = 1e-2      # same quantized operands, another accumulation order: bf16 rounding
FP8_BLOCK_TOL = 0.035


# ----------------------------------------------------------------------------- CPU
def test_fp8_rungs_register_their_cases():
    by_file = {}
    for c in C.COMPILE_CASES:
        by_file.setdefault(c.cu_name, set()).update(c.name_expressions or ())
    assert set(QG.FP8_V4_NAMES) <= by_file[QG.CU_FP8_GEMV]
    assert set(QG.FP8_V5_NAMES) <= by_file[QG.CU_FP8_WGMMA]
    assert all(C.required_arch(c.options) == "sm_90a" for c in C.COMPILE_CASES
               if c.cu_name == QG.CU_FP8_WGMMA)


def test_fp8_smem_budgets():
    for cfg in QG.FP8_V4_CONFIGS.values():
        assert QG.v4_smem_bytes(cfg) <= 48 * 1024 and cfg["BM"] % 8 == 0
    for cfg in QG.FP8_V5_CONFIGS.values():
        assert QG.v5_smem_bytes(cfg) <= 227 * 1024 and cfg["BM"] in (64, 128)


class _Arr:
    """Stands in for a device array in the rung choice (only the pointer is read)."""
    class data:
        ptr = 256


def test_fp8_rung_choice():
    x = _Arr()
    # decode on an H200: v4; larger batches: v5 (block_size a multiple of 64)
    assert QG._pick_fp8(None, None, 1.0, 16, 7168, 90, x, x)[0] == "v4"
    assert QG._pick_fp8(None, None, 32.0, 64, 7168, 90, x, x)[0] == "v5"
    # Kdim not a multiple of 128: no v4; block 16: no v5 -> v2
    assert QG._pick_fp8(None, None, 1.0, 16, 320, 90, x, x)[0] is None
    # sm_89: v4 yes, v5 no
    assert QG._pick_fp8(None, None, 1.0, 16, 256, 89, x, x)[0] == "v4"
    assert QG._pick_fp8(None, None, 32.0, 64, 256, 89, x, x)[0] is None
    # v4's table by rows per expert and Kdim (DeepSeek-V3 GEMM1 Kdim 7168, GEMM2 2048)
    by = lambda rows, K: QG._pick_fp8(None, None, rows, 16, K, 90, x, x)[1]
    assert by(8 / 256, 7168) == QG.FP8_V4_CONFIGS["gemv8w4u3ll"]            # T=1
    assert by(128 / 256, 7168) == QG.FP8_V4_CONFIGS["gemv8w4u3"]            # T=16
    assert by(512 / 256, 7168) == QG.FP8_V4_CONFIGS["gemv8w4u2m6"]          # T=64
    assert by(8 / 256, 2048) == QG.FP8_V4_CONFIGS["gemv8w4u2m6"]            # GEMM2
    # asked for by config name
    assert QG._pick_fp8(None, "gemv16", 100.0, 64, 256, 90, x, x)[:2] == \
        ("v4", QG.FP8_V4_CONFIGS["gemv16"])
    assert QG._pick_fp8(None, "wg128", 1.0, 128, 256, 90, x, x)[0] == "v5"
    # a v2 config name leaves the fast rungs alone
    assert QG._pick_fp8(None, "m64", 100.0, 64, 256, 90, x, x)[0] is None
    with pytest.raises(ValueError, match="block_size"):
        QG._pick_fp8(None, "wg128", 1.0, 64, 256, 90, x, x)


# ----------------------------------------------------------------------------- GPU


def _need(version):
    import cupy

    cc = int(cupy.cuda.Device().compute_capability)
    if cc < 89:
        pytest.skip("fp8 tensor cores need sm_89+")
    if version == "v5" and cc != 90:
        pytest.skip("v5 (wgmma, sm_90a) runs on compute capability 9.0 only")


SCALES = [("block", dict(use_fp8_w8a8=True, block_shape=[128, 128])),
          ("tensor", dict(use_fp8_w8a8=True)),
          ("channel", dict(use_fp8_w8a8=True, per_act_token_quant=True, per_channel_quant=True))]
# v4: every config of its table (MT 1 and 2, U 2 and 3, the L2 hint)
V4_TESTED = sorted(QG.FP8_V4_CONFIGS)
CASES = ([("v4", cfg, B) for cfg in V4_TESTED for B in (16, 64)] +
         [("v5", cfg, QG.FP8_V5_CONFIGS[cfg]["BM"]) for cfg in sorted(QG.FP8_V5_CONFIGS)])
SHAPES = [
    # M_a, E, top_k, N,   Kdim   (v4: Kdim % 128 == 0)
    (1,   4, 2, 64,  256),
    (37,  6, 3, 200, 384),       # N not a multiple of 16 / 128; experts with several blocks
    (50,  1, 1, 72,  640),       # everything on one expert
]


@pytest.mark.gpu
@pytest.mark.parametrize("version,cfg,B", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("scale,flags", SCALES, ids=[s[0] for s in SCALES])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_rung_matches_reference(rng, version, cfg, B, scale, flags, shape):
    _need(version)
    M_a, E, K, N, Kd = shape
    if version == "v5" and Kd % 128 == 0 and shape[0] == 50:
        Kd = Kd - 48                                   # v5 takes a partial last K block
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    w = (rng.standard_normal((E, N, Kd)) * 0.05).astype(BF16)
    aq, as_ = RQ.moe_kernel_quantize_input(a, None, "fp8", flags.get("per_act_token_quant",
                                                                      False),
                                           flags.get("block_shape"))
    wq, ws = RQ.quantize_weight_fp8(w, scale)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    if E > 2:
        ids[ids == E - 1] = 0                          # expert E-1 gets no tokens
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    want = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, K, B, tw, True, bias, a_scale=as_,
                                 w_scale=ws, **flags)
    out = poisoned((M_a * K, N), BF16)
    got = QG.grouped_gemm_quant(up(aq), up(wq), up(st), up(ex), up(ntp), K, B, up(tw), True,
                                up(bias), a_scale=up(as_), w_scale=up(ws), version=version,
                                config=cfg, out=out, **flags)
    assert got is out
    err = rel_err(host(got, BF16), want)
    assert err <= GEMM_TOL, f"{version} {cfg} {scale}: rel_err {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["v4", "v5"])
def test_fp8_rung_other_rank_zeros_fp16(rng, version):
    _need(version)
    flags = dict(use_fp8_w8a8=True, block_shape=[128, 128])
    M_a, E, N, Kd = 23, 4, 136, 256
    B = 64 if version == "v5" else 16
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    w = (rng.standard_normal((2, N, Kd)) * 0.05).astype(BF16)
    aq, as_ = RQ.moe_kernel_quantize_input(a, None, "fp8", False, [128, 128])
    wq, ws = RQ.quantize_weight_fp8(w, "block")
    emap = np.array([0, -1, 1, -1], dtype=np.int32)
    ids = rng.integers(0, E, (M_a, 2)).astype(np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E, expert_map=emap)
    want = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, 2, B, a_scale=as_, w_scale=ws,
                                 out_dtype=np.float16, **flags)
    out = poisoned((M_a * 2, N), np.float16)
    got = host(QG.grouped_gemm_quant(up(aq), up(wq), up(st), up(ex), up(ntp), 2, B,
                                     a_scale=up(as_), w_scale=up(ws), out_dtype=np.float16,
                                     version=version, out=out, **flags), np.float16)
    assert (got.reshape(M_a, 2, N)[np.isin(ids, [1, 3])] == 0).all()
    assert rel_err(got, want) <= GEMM_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["v4", "v5"])
def test_fp8_rung_block_error_is_the_formats(rng, version):
    """Against the unquantized product: the rung adds no error beyond the format's own (the
    reference's error on the same codes, about 3.7% for Gaussian data), and matches the
    reference within vLLM's block-fp8 tolerance (0.035)."""
    _need(version)
    M_a, E, K, N, Kd = 33, 4, 2, 256, 512
    B = 64 if version == "v5" else 16
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    w = (rng.standard_normal((E, N, Kd)) / np.sqrt(Kd)).astype(BF16)
    aq, as_ = RQ.moe_kernel_quantize_input(a, None, "fp8", False, [128, 128])
    wq, ws = RQ.quantize_weight_fp8(w, "block")
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    flags = dict(use_fp8_w8a8=True, block_shape=[128, 128])
    got = host(QG.grouped_gemm_quant(up(aq), up(wq), up(st), up(ex), up(ntp), K, B,
                                     a_scale=up(as_), w_scale=up(ws), version=version, **flags),
               BF16)
    ref = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, K, B, a_scale=as_, w_scale=ws, **flags)
    exact = np.einsum("sk,snk->sn", a.astype(np.float64)[np.arange(M_a * K) // K],
                      w.astype(np.float64)[ids.reshape(-1)])
    assert rel_err(got, ref) <= FP8_BLOCK_TOL
    assert rel_err(got, exact) <= 1.05 * rel_err(ref, exact) + 1e-3


# ============================================================================ CPU emulation
# v4 built by g++ against test_quant_cupy.py's emulation header (threads, barriers, the
# mma.sync fragment exchange laid out as the PTX ISA says) and run: its fragment k order,
# tiles, K split and reduction against the reference without a GPU. (v5's wgmma has no
# emulation: the GPU tests judge it.)
def _entries(names):
    """extern "C" k<i>(grid, block, kernel arguments) for each template name: the same
    arguments for v4 and v5 (pointers, sizes, scale kinds)."""
    out = []
    for i, n in enumerate(names):
        call = (f"{n}((const u8*)a, (const u8*)w, (elem_t*)c, (const float*)p3, "
                f"(const float*)p4, st, ex, ntp, tw, bias, N, K, P, top_k, B, L, mul, i0, i1)")
        out.append(
            f'extern "C" void k{i}(unsigned gx, unsigned gy, unsigned block, const void* a, '
            f"const void* w, void* c, const void* p3, const void* p4, const int* st, "
            f"const int* ex, const int* ntp, const float* tw, const float* bias, int N, int K, "
            f"int P, int top_k, int B, int L, int mul, int i0, int i1) {{\n"
            f"    launch(gx, gy, block, [&] {{ {call}; }});\n}}")
    return "\n".join(out)


def _emulation(tmp_path_factory, cu_name, names, tag, extra_header=""):
    """`cu_name` built by g++ with the emulation header (+ `extra_header`), entries k<i>."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine")
    from test_quant_cupy import QEMU_HEADER, _build_emulated
    tmp = tmp_path_factory.mktemp(f"{tag}_emulation")
    (tmp / "qemu.h").write_text(QEMU_HEADER + extra_header)
    return _build_emulated(tmp, cu_name, {"ELEM_BF16": 1}, _entries(names), tag)


@pytest.fixture(scope="module")
def emulated_v4(tmp_path_factory):
    return _emulation(tmp_path_factory, QG.CU_FP8_GEMV, QG.FP8_V4_NAMES, "fp8v4")


EMU_V4_CASES = [
    # scale, config, (M_a, E, top_k, N, Kdim, B): N not a multiple of 16, a block count not a
    # multiple of WARPS * U, padding-only tiles next to live ones, a crowded expert
    ("block", "gemv8w4u2m6", (3, 4, 2, 40, 384, 16)),
    ("block", "gemv16", (9, 2, 2, 24, 1280, 16)),
    ("channel", "gemv8w4u3", (5, 3, 1, 16, 640, 16)),
    ("block", "gemv8w4u3", (6, 4, 2, 40, 2688, 16)),         # 21 blocks: rounds of 3, a tail
    ("tensor", "gemv16", (4, 2, 2, 32, 256, 32)),
    ("channel", "gemv8w4u2m6", (5, 3, 1, 16, 2688, 16)),     # 21 blocks: rounds of 2, a tail
    ("block", "gemv8w4u3ll", (7, 4, 2, 48, 384, 8)),         # block_size 8: no padding tiles
]


def _run_emulated(lib, names, name, grid, block, scale, cfg, shape, crowded=False):
    """One emulated launch of template `name` (index in `names` = entry k<i> of `lib`) on a
    fresh problem of `shape` = (M_a, E, top_k, N, Kdim, B) in `scale` quantization, output
    poisoned with NaN first; returns (out as bf16, the reference). `grid` is a function of
    (Lg, N), the positions the launcher covers."""
    import ctypes

    from test_quant_cupy import _ptr
    flags = dict(SCALES)[scale]
    rng = np.random.default_rng(zlib.crc32(f"{scale}{cfg}".encode()))
    M_a, E, K, N, Kd, B = shape
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    w = (rng.standard_normal((E, N, Kd)) * 0.05).astype(BF16)
    aq, as_ = RQ.moe_kernel_quantize_input(a, None, "fp8", flags.get("per_act_token_quant",
                                                                      False),
                                           flags.get("block_shape"))
    wq, ws = RQ.quantize_weight_fp8(w, scale)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    if crowded:
        ids[: M_a // 2, 0] = 0                              # a crowded expert
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    want = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, K, B, tw, True, bias, a_scale=as_,
                                 w_scale=ws, **flags)
    P, L = M_a * K, st.size
    gx, gy = grid(min(L, P * B), N)
    c = np.full((P, N), 0x7FC0, np.uint16)                 # poisoned: bf16 NaN
    kinds = (2, 2) if scale == "block" else (int(scale == "channel"), int(scale == "channel"))
    getattr(lib, f"k{names.index(name)}")(
        ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(block),
        _ptr(np.ascontiguousarray(aq).view(np.uint8)),
        _ptr(np.ascontiguousarray(wq).view(np.uint8)), _ptr(c),
        _ptr(np.ascontiguousarray(as_, np.float32)), _ptr(np.ascontiguousarray(ws, np.float32)),
        _ptr(st), _ptr(ex), _ptr(ntp), _ptr(tw.ravel()), _ptr(bias), N, Kd, P, K, B, L, 1,
        *kinds)
    return c.view(BF16), want


@pytest.mark.simulator
@pytest.mark.slow
@pytest.mark.parametrize("scale,cfg,shape", EMU_V4_CASES, ids=[f"{c[0]}-{c[1]}" for c in EMU_V4_CASES])
def test_emulated_v4_matches_reference(emulated_v4, scale, cfg, shape):
    v4 = QG.FP8_V4_CONFIGS[cfg]
    got, want = _run_emulated(emulated_v4, QG.FP8_V4_NAMES, QG._v4_name(v4),
                              lambda Lg, N: (-(-Lg // v4["BM"]), -(-N // 16)),
                              v4["WARPS"] * 32, scale, cfg, shape)
    assert rel_err(got, want) <= GEMM_TOL


# v5 on the emulation: cp.async from the shared header; wgmma by its definition, reading each
# operand element through the descriptor (start, stride byte offset, 128-byte swizzle: address
# bits 4-6 XOR bits 7-9) and writing the accumulator fragment layout of the PTX ISA. It checks
# the kernel's own indexing (ring slots, scales, promotion, epilogue), not the hardware's
# reading of the descriptors (the GPU tests do).
WGMMA_EMU = r"""
inline unsigned fw_smem(const void* p) { return (unsigned)((const unsigned char*)p - g_smem); }
inline void fw_cp16(unsigned dst, const void* src, bool pred) { qg_cp16(g_smem + dst, src, pred); }
inline void fw_cp4(unsigned dst, const void* src, bool pred) { qg_cp4(g_smem + dst, src, pred); }
inline void fw_commit() { qg_commit(); }
template <int N> inline void fw_wait() { qg_wait<N>(); }
inline void wg_fence_proxy_async() {}
inline void wg_fence() {}
inline void wg_commit() {}
template <int PENDING> inline void wg_wait() {}
inline float fw_operand(unsigned long long desc, int r, int k) {
    const unsigned start = (unsigned)(desc & 0x3FFFull) << 4;
    const unsigned sbo = (unsigned)((desc >> 32) & 0x3FFFull) << 4;
    if (((desc >> 62) & 3ull) != 1ull) { fprintf(stderr, "not a 128B swizzle\n"); abort(); }
    unsigned addr = start + (r / 8) * sbo + (r % 8) * 128 + k;
    addr ^= ((addr >> 7) & 7u) << 4;
    return e4m3_value(g_smem[addr]);
}
template <int NN>
inline void fw_wgmma_emu(float* d, unsigned long long da, unsigned long long db, int acc) {
    const int wq = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    for (int j = 0; j < NN / 8; ++j)
        for (int i = 0; i < 4; ++i) {
            const int row = 16 * wq + lane / 4 + 8 * (i >> 1), col = 8 * j + 2 * (lane % 4) + (i & 1);
            float s = 0.f;
            for (int k = 0; k < 32; ++k) s += fw_operand(da, row, k) * fw_operand(db, col, k);
            d[4 * j + i] = (acc ? d[4 * j + i] : 0.f) + s;
        }
}
inline void fw_wgmma_n64(float* d, unsigned long long da, unsigned long long db, int acc) {
    fw_wgmma_emu<64>(d, da, db, acc); }
inline void fw_wgmma_n128(float* d, unsigned long long da, unsigned long long db, int acc) {
    fw_wgmma_emu<128>(d, da, db, acc); }
"""


@pytest.fixture(scope="module")
def emulated_v5(tmp_path_factory):
    return _emulation(tmp_path_factory, QG.CU_FP8_WGMMA, QG.FP8_V5_NAMES, "fp8v5", WGMMA_EMU)


EMU_V5_CASES = [
    # scale, config, (M_a, E, top_k, N, Kdim, B): N not a multiple of BN, a partial last K
    # block, more K blocks than stages, an expert with two m tiles, a padding-only tile
    ("block", "wg64", (40, 3, 2, 136, 400, 64)),
    ("channel", "wg64", (9, 2, 1, 64, 256, 64)),
    ("block", "wg128", (20, 2, 2, 128, 512, 128)),
]


@pytest.mark.simulator
@pytest.mark.slow
@pytest.mark.parametrize("scale,cfg,shape", EMU_V5_CASES, ids=[f"{c[0]}-{c[1]}" for c in EMU_V5_CASES])
def test_emulated_v5_matches_reference(emulated_v5, scale, cfg, shape):
    v5 = QG.FP8_V5_CONFIGS[cfg]
    got, want = _run_emulated(emulated_v5, QG.FP8_V5_NAMES, QG._v5_name(v5),
                              lambda Lg, N: (-(-N // v5["BN"]), -(-Lg // v5["BM"])),
                              v5["BM"] // 64 * 128, scale, cfg, shape, crowded=True)
    assert rel_err(got, want) <= GEMM_TOL
