"""What the tests of the quantized kernels (cuda_kernels/cupy/quant/) share, so that the test
modules import this and not each other:

    the CPU emulation   QEMU_HEADER (the CUDA features the kernels use, stood in for in C++)
                        and W16_PRELUDE (what the weight-only rungs v4-v6 add), built with a
                        .cu by build_emulation; arm_programmatic / programmatic_counts (a
                        programmatic launch's contract), blocks_descending (CTAs last to first),
                        ptr (a NumPy array as a ctypes pointer)
    the GPU helpers     up (NumPy -> CuPy, fp8 as its bytes), host, poisoned (an output filled
                        with NaN first)
    operands            w8a8_operands, wna16_operands, int4_case: random quantized problems
    int4 checks         check_matches_reference, check_other_rank, check_repeats: what the
                        prepacked int4 rungs (v4-v6) each run on a GPU

The emulation: NVRTC proves that the sources compile; this runs them. The .cu text (the same
source_text the GPU compiles) is built by g++ against QEMU_HEADER, which stands in for the
CUDA features the kernels use: a std::thread per CUDA thread, block after block; barriers;
warp shuffles and the mma.sync fragment exchange through a per-warp rendezvous; cp.async
copies that land only when a wait_group retires their group (a read before the wait sees the
0xAB garbage shared memory starts with); griddepcontrol.wait as the contract of a
programmatic launch (arm_programmatic); fp8 / bf16 conversions by their definitions. The only
code not run as written is each rung's block of inline-PTX helpers (replaced under
QG_EMULATED_PTX by the header's versions, whose fragment layouts follow the PTX ISA). It
cannot see timing, bank conflicts or the hardware's own reading of the PTX: the GPU tests
stay the judge.
"""
from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import pytest

from cuda_kernels.cupy import _compile as C
from tests.oracles import rel_err
from reference import moe_align_block_size
from reference import quant as RQ

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = RQ.FP8_DTYPE


# ----------------------------------------------------------------------------- GPU helpers
def up(x):
    """NumPy -> CuPy; fp8 travels as its bytes."""
    if x is None:
        return None
    if isinstance(x, np.ndarray) and x.dtype == FP8:
        from cuda_kernels.cupy.quant.act import fp8_to_device
        return fp8_to_device(x)
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


# ----------------------------------------------------------------------------- emulation
QEMU_HEADER = r"""
// CPU stand-ins for the CUDA features of the quantized kernels (tests/quant_support.py).
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
#define QG_ELEM_H 1      // fp16 (also where no ELEM_BF16 is defined: act.cu)
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
// a 3D grid: the z layers one after another (z descending too: qg_block_order)
template <typename F> void launch3(unsigned gx, unsigned gy, unsigned gz, unsigned block, F body) {
    for (unsigned i = 0; i < gz; ++i) {
        const unsigned bz = g_descending ? gz - 1 - i : i;
        launch(gx, gy, block, [&] { blockIdx.z = bz; body(); });
    }
    gridDim.z = gz;
}
"""


# ----------------------------------------------------------------------------- W16_PRELUDE
# What the weight-only rungs on prepacked weights (wna16_common.cuh: v4-v6) add to the header:
# uint4 / float2, 16-bit pair arithmetic rounded once, __syncwarp, the split-K atomics, and
# wna16_v5_staged's mbarriers and named barriers.
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
// mbarriers (wna16_v5_staged's WS ring): arrivals counted down to a phase's end; a wait for
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
"""


def c_entries(names, params: str, args: str) -> str:
    """The C entry points of an emulation: k<i>(gx, gy, gz, block, <params>) launches
    names[i](<args>) on a grid (gx, gy, gz) of `block` threads (ctypes calls them k0, k1, ...)."""
    return "\n".join(
        f'extern "C" void k{i}(unsigned gx, unsigned gy, unsigned gz, unsigned block, '
        f"{params}) {{\n    launch3(gx, gy, gz, block, [&] {{ gridDim.z = gz; {n}({args}); }});\n}}"
        for i, n in enumerate(names))


def rung_emulations(tmp_path_factory, tag, cu_by_rung, names_by_rung, params, args,
                    prelude_by_rung=None):
    """get(rung): the emulation of that rung's .cu (bf16 elements; entries c_entries(names,
    params, args)), built on first use and kept."""
    libs = {}

    def get(rung):
        if rung not in libs:
            libs[rung] = build_emulation(tmp_path_factory, f"{tag}{rung}", cu_by_rung[rung],
                                         c_entries(names_by_rung[rung], params, args),
                                         prelude=(prelude_by_rung or {}).get(rung, ""))
        return libs[rung]
    return get


def build_emulation(tmp_path_factory, tag, cu, entry, prelude="", defines=None):
    """`cu` with bf16 elements (or `defines`), built by g++ with the emulation header in a fresh
    folder (the C entry points `entry`, then `prelude` after the header); skips where g++ is
    missing."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine")
    tmp = tmp_path_factory.mktemp(f"{tag}_emulation")
    (tmp / "qemu.h").write_text(QEMU_HEADER)
    return build_emulated(tmp, cu, defines or {"ELEM_BF16": 1}, entry, tag, prelude=prelude)


def build_emulated(tmp, cu, defines, entry, name, prelude=""):
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


def ptr(a):
    import ctypes

    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def arm_programmatic(lib, inputs, outputs, ignore_waits=False):
    """Arms the emulation's model of a programmatic launch (QEMU_HEADER's qg_pdl_arm) for the
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
    """Launches of `lib` inside run their CTAs last to first (QEMU_HEADER's qg_block_order): a
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


# ----------------------------------------------------------------------------- operands
def routed(rng, M_a, E, K, N, B):
    """A random routing of M_a rows to top-K of E experts (expert E - 1 gets none when E > 2),
    its alignment for block size B, router weights and a bias [E, N]:
    (ids, tw, bias, sorted_token_ids, expert_ids, num_tokens_post_padded)."""
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    if E > 2:
        ids[ids == E - 1] = 0                    # expert E-1 gets no tokens
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    return (ids, tw, bias) + tuple(moe_align_block_size(ids, B, E))



W8A8_SCALES = {
    # the w8a8 scale layouts: vLLM's flags, and quantize_weight_fp8 / _int8's granularity
    "block": (dict(block_shape=[128, 128]), "block"),
    "tensor": ({}, "tensor"),
    "channel": (dict(per_act_token_quant=True, per_channel_quant=True), "channel"),
}


def w8a8_operands(rng, fmt, scale, M_a, E, N, Kd, w_scale=0.05):
    """Random a [M_a, Kdim] and w [E, N, Kdim] quantized to `fmt` ("fp8" / "int8") with
    `scale`'s layout: (aq, a_scale, wq, w_scale, the flags of grouped_gemm_quant)."""
    flags, gran = W8A8_SCALES[scale]
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    w = (rng.standard_normal((E, N, Kd)) * w_scale).astype(BF16)
    aq, as_ = RQ.moe_kernel_quantize_input(a, None, fmt, flags.get("per_act_token_quant", False),
                                           flags.get("block_shape"))
    wq, ws = (RQ.quantize_weight_fp8 if fmt == "fp8" else RQ.quantize_weight_int8)(w, gran)
    return aq, as_, wq, ws, {f"use_{fmt}_w8a8": True, **flags}


def wna16_operands(rng, nbits, group_size, zero_point, M_a, E, N, Kd, signed=False,
                   dtype=BF16):
    """Random activations a [M_a, Kdim] (`dtype`) and weights quantized weight-only: (a, wq,
    w_scale, w_zp or None, the flags of grouped_gemm_quant). group_size 0: one group per row;
    signed: int8 codes (vLLM's ExpertsInt8 layout, no zero points)."""
    import math

    a = rng.standard_normal((M_a, Kd)).astype(dtype)
    w = (rng.standard_normal((E, N, Kd)) * 0.05).astype(BF16)
    gs = math.gcd(group_size, Kd) if group_size else Kd        # a group divides Kdim
    wq, ws, wz = RQ.quantize_weight_wna16(w, nbits, gs, zero_point=zero_point)
    if signed:
        wq = (wq.astype(np.int16) - 128).astype(np.int8)
    flags = dict(use_int4_w4a16=True) if nbits == 4 else dict(use_int8_w8a16=True)
    return a, wq, ws, wz, flags


# ----------------------------------------------------------------------------- int4 checks
# The checks the prepacked int4 rungs (v4 packed, v5 staged, v6 wgmma) run on a GPU, each
# through quant/wna16.py's grouped_gemm_wna16 with a config of the rung.
INT4_SHAPES = [
    # M_a, E, top_k, N,   Kdim, gs,  zp     (one token; 9 chunks over the warps, g64; a group
    #                                         per row; many rows per expert; long K; N % 64 == 0
    #                                         for v6)
    (1,   4, 2, 128, 256,  128,  False),
    (29,  6, 2, 192, 576,  64,   True),
    (70,  3, 1, 64,  384,  384,  True),
    (40,  2, 2, 128, 4096, 128,  False),
]


def int4_case(rng, shape, gs, zp):
    """Fresh inputs of an int4 GEMM (shape = (M_a, E, top_k, N, Kdim, block_size)): a, the
    quantized weights (wq, ws, wz), the alignment (st, ex, ntp), router weights tw, bias, and
    the reference output (router weights and bias applied)."""
    M_a, E, K, N, Kd, B = shape
    a, wq, ws, wz, flags = wna16_operands(rng, 4, gs, zp, M_a, E, N, Kd)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, bias, w_scale=ws, w_zp=wz,
                                 **flags)
    return a, wq, ws, wz, st, ex, ntp, tw, bias, want


def check_matches_reference(rng, shape, config, B, tol=2e-2):
    """grouped_gemm_wna16 with `config` and block size B against the reference on `shape`
    (M_a, E, top_k, N, Kdim, gs, zp): an expert with no tokens, bias and router weights, the
    output poisoned first."""
    from cuda_kernels.cupy.quant.wna16 import grouped_gemm_wna16

    M_a, E, K, N, Kd, gs, zp = shape
    a, wq, ws, wz, flags = wna16_operands(rng, 4, gs, zp, M_a, E, N, Kd)
    ids, tw, bias, st, ex, ntp = routed(rng, M_a, E, K, N, B)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, bias, w_scale=ws,
                                 w_zp=wz, **flags)
    out = poisoned((M_a * K, N), BF16)
    got = grouped_gemm_wna16(up(a), up(wq), up(st), up(ex), up(ntp), K, B, up(tw), True,
                             up(bias), w_scale=up(ws), w_zp=up(wz), config=config, out=out)
    assert got is out
    err = rel_err(host(got, BF16), want)
    assert err <= tol, f"{config}: rel_err {err:.3e}"


def check_other_rank(rng, config, B, N, tol=2e-2):
    """fp16 activations, experts 1 and 3 of 4 on another rank (their rows come back zero),
    every token routed to expert 0 first, no router weights, int4 g128 with zero points:
    grouped_gemm_wna16 with `config` and block size B against the reference, the output
    poisoned first."""
    from cuda_kernels.cupy.quant.wna16 import grouped_gemm_wna16

    M_a, E, K, Kd = 21, 4, 2, 512
    a, wq, ws, wz, flags = wna16_operands(rng, 4, 128, True, M_a, 2, N, Kd, dtype=np.float16)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    ids[:, 0] = 0
    st, ex, ntp = moe_align_block_size(ids, B, E, expert_map=np.array([0, -1, 1, -1], np.int32))
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, w_scale=ws, w_zp=wz, **flags)
    out = poisoned((M_a * K, N), np.float16)
    got = host(grouped_gemm_wna16(up(a), up(wq), up(st), up(ex), up(ntp), K, B,
                                  w_scale=up(ws), w_zp=up(wz), config=config, out=out),
               np.float16)
    assert (got.reshape(M_a, K, N)[np.isin(ids, [1, 3])] == 0).all()
    assert rel_err(got, want) <= tol


def check_repeats(rng, config, shape, gs, tol=2e-2):
    """grouped_gemm_wna16 with `config` on shape (M_a, E, top_k, N, Kdim, B), zero points, bias
    and router weights: parity with the reference, and the same bits on a second launch (a
    rung whose CTAs meet in a workspace adds the parts in a fixed order and resets its
    counters)."""
    from cuda_kernels.cupy.quant.wna16 import grouped_gemm_wna16

    M_a, E, K, N, Kd, B = shape
    a, wq, ws, wz, st, ex, ntp, tw, bias, want = int4_case(rng, shape, gs, True)
    args = (up(a), up(wq), up(st), up(ex), up(ntp), K, B)
    kw = dict(w_scale=up(ws), w_zp=up(wz), config=config, topk_weights=up(tw),
              mul_routed_weight=True, bias=up(bias))
    first = host(grouped_gemm_wna16(*args, **kw, out=poisoned((M_a * K, N), BF16)), BF16)
    second = host(grouped_gemm_wna16(*args, **kw, out=poisoned((M_a * K, N), BF16)), BF16)
    assert rel_err(first, want) <= tol
    assert np.array_equal(first.view(np.uint16), second.view(np.uint16))
