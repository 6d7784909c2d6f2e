"""The weight-only decode GEMM (quant_gemm_wna16.cu) against reference/quant.py.

CPU (always): the launcher imports without a GPU, registers its compile cases (compiled for
sm_90 and sm_80 by tests/test_cupy_nvrtc.py), picks configs and K splits sanely, and refuses
unsupported problems clearly. Simulator: the .cu runs on a CPU emulation.
GPU (`gpu` marker): every config, int4 and int8 (uint8 with zero points, signed int8), group
sizes 32 / 64 / 128 / one group per row, N and Kdim not multiples of the tile, forced K splits,
a crowded expert, experts on another rank (zeros), bias and router weights, fp16 activations,
outputs poisoned with NaN first, against grouped_gemm_quant of the reference (tolerance: the
issue's weight-only 2e-2; bf16 rounding of the dequantized weights is ~1e-3); T = 0.

Shape legend: T tokens, E experts, K top-k, N output width, Kdim reduction width, B block size.
"""
from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest

from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy import quant_gemm_wna16 as W
from reference import moe_align_block_size
from reference import quant as RQ
from oracles import rel_err
from test_quant_cupy import blocks_descending, host, poisoned, up  # the quantized tests' helpers

BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = 2e-2          # issue 8 / vLLM's weight-only tolerance


# ----------------------------------------------------------------------------- CPU
def test_registers_every_config_for_both_element_types():
    cases = [c for c in C.COMPILE_CASES if c.cu_name == W.CU]
    assert {c.defines["ELEM_BF16"] for c in cases} == {0, 1}
    for c in cases:
        assert set(W.NAMES) <= set(c.name_expressions)


def test_config_choice_and_splits():
    for rows in (0.25, 2, 8, 16, 64, 512):
        B = W.block_size_for(rows)
        cfg = W.pick_config(rows, B)
        assert B % (8 * cfg["MT"]) == 0
    # Mixtral T=1 GEMM2 (N=4096, Kdim=14336, 2 live experts) must split K; every split stages
    # at most smem_budget(cfg) bytes of activations, and no split is empty
    for P, N, K in ((2, 4096, 14336), (2, 28672, 4096), (128, 28672, 4096), (8192, 4096, 14336)):
        for cfg in W.CONFIGS.values():
            ks = W.choose_splits(cfg, P, 8, N, K, P * 16, 132)
            steps = C.cdiv(K, W.KSTEP)
            sps = C.cdiv(steps, ks)
            assert 1 <= ks <= steps and (ks - 1) * sps < steps
            assert W.smem_bytes(cfg, sps) <= max(W.smem_budget(cfg), W.smem_bytes(cfg, 1))
            assert W.smem_bytes(cfg, sps, 8) <= W.SMEM_PER_SM
    assert W.choose_splits(W.CONFIGS["m8"], 2, 8, 4096, 14336, 32, 132) > 1
    with pytest.raises(ValueError, match="block_size"):
        W.pick_config(2, 12)
    # int4 on packable weights: the packed rung's 8 token rows up to 8 rows per expert, then
    # the staged rung's 24 or 32 (one pass over each expert's weights per 24 / 32 rows) up to
    # 128, 8 up to 24 for other block sizes; 24 warp-specialized where the GPU runs it (sm_90)
    tiles = 28672 // 16
    assert W.pick_config(4, 16, n_tiles=tiles) == W.PACKED_CONFIGS["q8"]
    assert W.pick_config(16, 48, n_tiles=tiles) == W.STAGED_CONFIGS["t24ws"]
    assert W.pick_config(16, 48, n_tiles=tiles, ws=False) == W.STAGED_CONFIGS["t24"]
    assert W.pick_config(16, 32, n_tiles=tiles) == W.STAGED_CONFIGS["t32"]
    assert W.pick_config(100, 64, n_tiles=tiles) == W.STAGED_CONFIGS["t32"]
    assert W.pick_config(16, 16, n_tiles=tiles) == W.PACKED_CONFIGS["q8"]
    for rows in (16, 100):
        assert W.pick_config(rows, W.block_size_for(rows), n_tiles=tiles)["MT"] == 3
    assert W.pick_config(256, 64, n_tiles=tiles).get("KERNEL") not in ("packed", "staged")
    assert W.pick_config(64, 16, n_tiles=tiles).get("KERNEL") not in ("packed", "staged")


def test_supports_says_why():
    assert W.supports(4096, 128, 32, 16) == (True, "")
    assert "multiple of 32" in W.supports(4100, 4100, 1, 16)[1]
    assert "group_size" in W.supports(256, 16, 16, 16)[1]
    assert W.supports(320, 320, 1, 16)[0]          # one group per row
    assert "block_size" in W.supports(256, 128, 2, 12)[1]


def operands(rng, nbits, gs, zp, signed, M_a, E, N, Kd, dtype=BF16):
    a = rng.standard_normal((M_a, Kd)).astype(dtype)
    w = (rng.standard_normal((E, N, Kd)) * 0.05).astype(BF16)
    wq, ws, wz = RQ.quantize_weight_wna16(w, nbits, gs, zero_point=zp)
    if signed:                                     # signed int8 codes, symmetric
        wq = (wq.astype(np.int16) - 128).astype(np.int8)
    return a, wq, ws, wz


FORMATS = [
    # name,         nbits, group (0: one per row), zero points, signed int8
    ("int4_g128",    4, 128, False, False),
    ("int4_g32_zp",  4, 32,  True,  False),
    ("int4_g64",     4, 64,  False, False),
    ("int4_channel", 4, 0,   True,  False),
    ("uint8_g64_zp", 8, 64,  True,  False),
    ("uint8_g128",   8, 128, False, False),
    ("int8_g32",     8, 32,  False, True),
]
SHAPES = [
    # M_a, E, top_k, N,   Kdim, B   (one token; N and Kdim not multiples of 64 / 128; an
    #                                 expert with no tokens; a crowded expert; long K)
    (1,   4, 2, 64,  256,  16),
    (29,  6, 2, 136, 352,  16),
    (70,  3, 1, 200, 384,  32),
    (40,  1, 1, 72,  2048, 32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=[f[0] for f in FORMATS])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cfg", sorted(W.CONFIGS))
@pytest.mark.parametrize("ks", [None, 3])
def test_matches_reference(rng, fmt, shape, cfg, ks):
    name, nbits, gs, zp, signed = fmt
    M_a, E, K, N, Kd, B = shape
    if B % (8 * W.CONFIGS[cfg]["MT"]):
        pytest.skip(f"{cfg}: BM does not divide block_size {B}")
    g = Kd if gs == 0 else gs
    if Kd % g:
        pytest.skip("group_size must divide Kdim")
    a, wq, ws, wz = operands(rng, nbits, g, zp, signed, M_a, E, N, Kd)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    if E > 2:
        ids[ids == E - 1] = 0                    # expert E-1 gets no tokens
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    flags = dict(use_int4_w4a16=True) if nbits == 4 else dict(use_int8_w8a16=True)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, bias, w_scale=ws,
                                 w_zp=wz, **flags)
    out = poisoned((M_a * K, N), BF16)
    config = dict(W.CONFIGS[cfg], KS=ks) if ks else cfg
    got = W.grouped_gemm_wna16(up(a), up(wq), up(st), up(ex), up(ntp), K, B, up(tw), True,
                               up(bias), w_scale=up(ws), w_zp=up(wz), config=config, out=out,
                               **flags)
    assert got is out
    err = rel_err(host(got, BF16), want)
    assert err <= TOL, f"{name} {cfg} KS={ks}: rel_err {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", sorted(W.CONFIGS))
def test_fp16_other_rank_and_crowded_expert(rng, cfg):
    """fp16 activations, experts on another rank (zeros), an expert with several m tiles,
    default K splits, no router weights."""
    M_a, E, K, N, Kd = 21, 4, 2, 48, 512
    B = max(16, 8 * W.CONFIGS[cfg]["MT"])
    a, wq, ws, wz = operands(rng, 4, 128, True, False, M_a, 2, N, Kd, dtype=np.float16)
    emap = np.array([0, -1, 1, -1], dtype=np.int32)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    ids[:, 0] = 0
    st, ex, ntp = moe_align_block_size(ids, B, E, expert_map=emap)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, w_scale=ws, w_zp=wz,
                                 use_int4_w4a16=True)
    out = poisoned((M_a * K, N), np.float16)
    got = host(W.grouped_gemm_wna16(up(a), up(wq), up(st), up(ex), up(ntp), K, B,
                                    w_scale=up(ws), w_zp=up(wz), use_int4_w4a16=True,
                                    config=cfg, out=out), np.float16)
    assert got.dtype == np.float16
    assert (got.reshape(M_a, K, N)[np.isin(ids, [1, 3])] == 0).all()
    assert rel_err(got, want) <= TOL


@pytest.mark.gpu
def test_repeated_split_launches_reuse_counters(rng):
    """The split-K counters reset themselves: the same launch twice gives the same bits."""
    M_a, E, K, N, Kd, B = 3, 4, 2, 96, 1024, 16
    a, wq, ws, _ = operands(rng, 4, 128, False, False, M_a, E, N, Kd)
    st, ex, ntp = (up(v) for v in moe_align_block_size(
        rng.integers(0, E, (M_a, K)).astype(np.int32), B, E))
    args = (up(a), up(wq), st, ex, ntp, K, B)
    kw = dict(w_scale=up(ws), use_int4_w4a16=True, config=dict(W.CONFIGS["a8"], KS=4))
    first = host(W.grouped_gemm_wna16(*args, **kw), BF16)
    second = host(W.grouped_gemm_wna16(*args, **kw), BF16)
    assert np.array_equal(first.view(np.uint16), second.view(np.uint16))


@pytest.mark.gpu
def test_empty_batch():
    rng = np.random.default_rng(0)
    a, wq, ws, _ = operands(rng, 4, 128, False, False, 0, 2, 64, 256)
    st, ex, ntp = moe_align_block_size(np.zeros((0, 2), np.int32), 16, 2)
    got = W.grouped_gemm_wna16(up(a), up(wq), up(st), up(ex), up(ntp), 2, 16, w_scale=up(ws),
                               use_int4_w4a16=True)
    assert got.shape == (0, 64)


@pytest.mark.gpu
def test_argument_errors(rng):
    a, wq, ws, wz = operands(rng, 4, 32, True, False, 8, 2, 64, 256)
    st, ex, ntp = (up(v) for v in moe_align_block_size(
        rng.integers(0, 2, (8, 1)).astype(np.int32), 16, 2))
    args = (up(a), up(wq), st, ex, ntp, 1, 16)
    with pytest.raises(ValueError, match="use_int4_w4a16/use_int8_w8a16"):
        W.grouped_gemm_wna16(*args, w_scale=up(ws))
    with pytest.raises(ValueError, match="w8a8"):
        W.grouped_gemm_wna16(*args, w_scale=up(ws), use_fp8_w8a8=True)
    with pytest.raises(ValueError, match="w_scale"):
        W.grouped_gemm_wna16(*args, use_int4_w4a16=True)
    with pytest.raises(ValueError, match="block_size"):
        W.grouped_gemm_wna16(up(a), up(wq), st, ex, ntp, 1, 20, w_scale=up(ws),
                             use_int4_w4a16=True)
    a16, wq16, ws16, _ = operands(rng, 4, 16, False, False, 8, 2, 64, 256)
    with pytest.raises(ValueError, match="group_size"):
        W.grouped_gemm_wna16(up(a16), up(wq16), st, ex, ntp, 1, 16, w_scale=up(ws16),
                             use_int4_w4a16=True)
    with pytest.raises(TypeError, match="out"):
        W.grouped_gemm_wna16(*args, w_scale=up(ws), use_int4_w4a16=True,
                             out=C.empty((8, 64), np.float16))
    with pytest.raises(ValueError, match="config"):
        W.grouped_gemm_wna16(*args, w_scale=up(ws), use_int4_w4a16=True, config="nope")


# ============================================================================ CPU emulation
# quant_gemm_wna16.cu built by g++ against tests/test_quant_cupy.py's CUDA stand-in header
# (a std::thread per CUDA thread, mma.sync fragments as the PTX ISA lays them out), plus the
# few features this kernel adds (uint4, 16-bit pair arithmetic rounded once, a 3D grid, the
# split-K atomics): the lane layout, the permuted k order and the split-K reduction run on a
# CPU. Timing, the hardware's reading of the PTX: the GPU tests stay the judge.
W16_PRELUDE = r"""
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float2 { float x, y; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline unsigned short __half_as_ushort(__half h) { return h.b; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.b; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline void __syncwarp(unsigned = 0xffffffffu) {
    int x = 0; unsigned char all[32][64]; warp_exchange(&x, sizeof(x), all); }
#include <unordered_map>
// mbarriers (wna16_staged's WS ring): arrivals counted down to a phase's end; a wait for
// parity p returns once the phase of that parity is over; a thread's cp.async copies land at
// its cp.async.mbarrier.arrive (the latest moment the hardware allows)
struct QgMbar { int expected = 0, pending = 0; long phase = 0; };
static std::mutex g_mbar_m;
static std::condition_variable g_mbar_cv;
static std::unordered_map<const void*, QgMbar> g_mbars;
inline void qg_mbar_init(const void* b, unsigned count) {
    std::lock_guard<std::mutex> l(g_mbar_m); g_mbars[b] = QgMbar{(int)count, (int)count, 0}; }
inline void qg_mbar_arrive(const void* b) {
    std::lock_guard<std::mutex> l(g_mbar_m);
    QgMbar& m = g_mbars.at(b);
    if (--m.pending == 0) { m.pending = m.expected; ++m.phase; g_mbar_cv.notify_all(); }
}
inline void qg_mbar_arrive_on_copies(const void* b) {
    qg_commit();
    qg_wait<0>();
    qg_mbar_arrive(b);
}
inline void qg_mbar_wait(const void* b, unsigned parity) {
    std::unique_lock<std::mutex> l(g_mbar_m);
    g_mbar_cv.wait(l, [&] { return (unsigned)(g_mbars.at(b).phase & 1) != (parity & 1u); });
}
// bar.sync 1, n: the n first threads of the CTA (one barrier per count, reused CTA after CTA)
inline void qg_bar_team(int n) {
    static std::mutex m;
    static std::unordered_map<int, std::barrier<>*> bars;
    std::barrier<>* bar;
    { std::lock_guard<std::mutex> l(m);
      auto& slot = bars[n];
      if (!slot) slot = new std::barrier<>(n);
      bar = slot; }
    bar->arrive_and_wait();
}
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
#define __shared__ static
inline void __threadfence() {}
inline void qg_cp8(void* dst, const void* src) { qg_copy(dst, src, 8, true); }
inline int atomicAdd(int* p, int v) {
    std::lock_guard<std::mutex> l(g_atomic); const int o = *p; *p += v; return o; }
inline void __stcg(float* p, float v) { *p = v; }
inline float __ldcg(const float* p) { return *p; }
inline void __stcg(int* p, int v) { *p = v; }
inline int __ldcg(const int* p) { return *p; }
inline __nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162 b) {
    return {__float2bfloat16_rn(__bfloat162float(a.x) - __bfloat162float(b.x)),
            __float2bfloat16_rn(__bfloat162float(a.y) - __bfloat162float(b.y))}; }
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) {
    return {__float2bfloat16_rn(__bfloat162float(a.x) * __bfloat162float(b.x)),
            __float2bfloat16_rn(__bfloat162float(a.y) * __bfloat162float(b.y))}; }
// (the fp16 build's)
inline __half __ushort_as_half(unsigned short u) { return {u}; }
inline __half2 __hsub2(__half2 a, __half2 b) {
    return {__float2half_rn(__half2float(a.x) - __half2float(b.x)),
            __float2half_rn(__half2float(a.y) - __half2float(b.y))}; }
inline __half2 __hmul2(__half2 a, __half2 b) {
    return {__float2half_rn(__half2float(a.x) * __half2float(b.x)),
            __float2half_rn(__half2float(a.y) * __half2float(b.y))}; }
template <typename F> void launch3(unsigned gx, unsigned gy, unsigned gz, unsigned block, F body) {
    for (unsigned i = 0; i < gz; ++i) {                 // (z descending too: qg_block_order)
        const unsigned bz = g_descending ? gz - 1 - i : i;
        launch(gx, gy, block, [&] { blockIdx.z = bz; body(); });
    }
    gridDim.z = gz;
}
"""


def _w16_entries():
    out = []
    for i, n in enumerate(W.NAMES):
        out.append(
            f'extern "C" void k{i}(unsigned gx, unsigned gy, unsigned gz, unsigned block, '
            f"const void* a, const void* w, void* c, const float* s, const unsigned char* zp, "
            f"const int* st, const int* ex, const int* ntp, const float* tw, const float* bias, "
            f"float* ws, int* cnt, int N, int K, int P, int top_k, int B, int L, int mul, "
            f"int gs, int G, int dzp, int cx, int sps) {{\n"
            f"    gridDim.z = gz;\n"
            f"    launch3(gx, gy, gz, block, [&] {{ gridDim.z = gz; {n}((const elem_t*)a, "
            f"(const u8*)w, (elem_t*)c, s, zp, st, ex, ntp, tw, bias, ws, cnt, N, K, P, top_k, "
            f"B, L, mul, gs, G, dzp, cx, sps); }});\n}}")
    return "\n".join(out)


@pytest.fixture(scope="module")
def emulated_w16(tmp_path_factory):
    from test_quant_cupy import build_emulation

    return build_emulation(tmp_path_factory, "w16", W.CU, _w16_entries(), prelude=W16_PRELUDE)


def _emulated_gemm(lib, a, wq, ws, wz, st, ex, ntp, top_k, B, tw, bias, nbits, config,
                   descending=False):
    """grouped_gemm_wna16's launch (launch_plan, arguments) on the emulation; descending: the
    CTAs run last to first (the first K split then completes each tile)."""
    import ctypes

    def p(x):
        return None if x is None else x.ctypes.data_as(ctypes.c_void_p)

    E, N, Kw = wq.shape
    K = a.shape[1]
    P = a.shape[0] * top_k
    G = ws.shape[2]
    lp = W.launch_plan(nbits, P, E, N, K, st.size, B, config, 132, K // G)
    gx, gy, gz = lp["grid"]
    c = np.full((P, N), 0x7FC0, np.uint16)                        # poison: bf16 NaN
    wsp = np.full(gx * gy * gz * lp["block"][0] * lp["cfg"]["MT"] * 4, np.nan, np.float32)
    cnt = np.zeros(gx * gy, np.int32)
    signed = wq.dtype == np.int8
    dzp = 8 if nbits == 4 else 128
    fn = getattr(lib, f"k{W.NAMES.index(lp['name'])}")
    with blocks_descending(lib, descending):
        fn(gx, gy, gz, lp["block"][0], p(np.ascontiguousarray(a).view(np.uint16)),
           p(wq.view(np.uint8)), p(c), p(ws.astype(np.float32)), p(wz), p(st), p(ex), p(ntp),
           p(tw), p(bias), p(wsp), p(cnt), N, K, P, top_k, B, lp["Lg"], int(tw is not None),
           K // G, G, dzp, 0x80 if signed else 0, lp["SPS"])
    assert not cnt.any(), "the split-K counters come back to zero"
    return c.view(BF16), lp


@pytest.mark.simulator
@pytest.mark.parametrize("cfg,ks,fmt,shape", [
    ("a8", None, FORMATS[0], (1, 4, 2, 64, 256, 16)),
    ("a16", 2, FORMATS[0], (7, 3, 2, 32, 1536, 16)),        # several stages, split K
    ("a8", 2, FORMATS[1], (5, 3, 2, 40, 352, 16)),          # g32 zp, a tail step
    ("a32", None, FORMATS[4], (20, 2, 1, 24, 640, 32)),     # uint8 zp
    ("m8", None, FORMATS[0], (1, 4, 2, 64, 256, 16)),
    ("m8", 2, FORMATS[1], (5, 3, 2, 40, 352, 16)),          # g32 zp, a tail step, N % 16
    ("w8", 3, FORMATS[6], (6, 3, 2, 136, 512, 8)),          # signed int8, 8 warps, B = 8
    ("w16", None, FORMATS[4], (9, 2, 2, 72, 384, 32)),      # uint8 zp, 8 warps
    ("m16", 2, FORMATS[0], (7, 3, 2, 32, 512, 16)),         # int4 post-scaled, split K
    ("m8", None, FORMATS[3], (3, 2, 2, 24, 640, 16)),       # int4 per-channel zp, post-scaled
    ("m8", 3, FORMATS[1], (5, 3, 2, 40, 384, 16)),
    ("m16", 2, FORMATS[4], (9, 3, 2, 24, 256, 16)),
    ("m32", None, FORMATS[6], (20, 2, 1, 16, 128, 32)),
])
@pytest.mark.slow
def test_emulated_matches_reference(emulated_w16, cfg, ks, fmt, shape):
    rng = np.random.default_rng(5)
    name, nbits, gs, zp, signed = fmt
    M_a, E, K, N, Kd, B = shape
    a, wq, ws, wz = operands(rng, nbits, gs or Kd, zp, signed, M_a, E, N, Kd)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    flags = dict(use_int4_w4a16=True) if nbits == 4 else dict(use_int8_w8a16=True)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, bias, w_scale=ws,
                                 w_zp=wz, **flags)
    config = dict(W.CONFIGS[cfg], KS=ks) if ks else cfg
    got, lp = _emulated_gemm(emulated_w16, a, wq, ws, wz, st, ex, ntp, K, B, tw, bias, nbits,
                             config)
    if ks:
        assert lp["KS"] == ks
        # the CTAs last to first: another split completes each tile, adding the partials in
        # split order all the same
        back, _ = _emulated_gemm(emulated_w16, a, wq, ws, wz, st, ex, ntp, K, B, tw, bias,
                                 nbits, config, descending=True)
        np.testing.assert_array_equal(back.view(np.uint16), got.view(np.uint16))
    err = rel_err(got, want)
    assert err <= TOL, f"{name} {cfg} KS={ks}: rel_err {err:.3e}"
