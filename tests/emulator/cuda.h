// CUDA C++ on the CPU: the one emulator the tests run the CuPy backend's kernel sources on
// (the text NVRTC compiles, from _compile.source_text, built by g++: tests/emulator/__init__.py).
//
//   cuda.h     this file: the language, threads, warps, CTAs, launches, atomics, 16-bit and
//              fp8 numbers
//   ptx.h      the PTX instructions the kernels write inline (cp.async, ldmatrix, mma.sync,
//              wgmma, mbarrier, the tensor copy, named barriers, griddepcontrol) and the
//              checker of the cp.async / tensor-copy -> mbarrier -> wgmma ring protocol
//   kernels.h  the kernels' own helper names (gg_*, qg_*, wg_*, ...) on top of ptx.h
//
// The model:
//   threads  one std::thread per CUDA thread; the CTAs of a grid one after another, in the
//            order emu_set_block_order picks (ascending, descending, or shuffled: a GPU runs
//            them in any order), or all at once (launch_cooperative: a grid barrier inside
//            must not deadlock);
//   shared   a fresh buffer per CTA, 1024-byte aligned and filled with 0xAB garbage (what a
//            read before a write sees); static __shared__ arrays are function statics;
//   warps    collectives (shuffles, votes, match, __syncwarp, the mma fragment exchange) meet
//            in a per-warp rendezvous keyed by the lane mask; lanes that skipped a masked
//            collective may already wait in the next one (legal since Volta);
//   CTAs     __syncthreads is a std::barrier; a thread that returns drops out of it;
//   global   atomics under one lock; fences are seq_cst fences; .cg loads and stores are
//            plain memory operations the compiler may not hoist;
//   numbers  fp16 through _Float16, bf16 and fp8 e4m3 by their definitions, rounding to
//            nearest even, NaN kept.
// It cannot see timing, bank conflicts, the GPU's own memory ordering or its expf / erff ulps:
// the GPU tests stay the judge. A broken rule (a lane outside its mask, a copy never waited
// for, a deadlock) prints "EMULATOR: ..." and exits with status 3.
#pragma once
#include <algorithm>
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
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
using std::max;
using std::min;

#ifndef EMU_WAIT_S
#define EMU_WAIT_S 120        // a wait this long is a deadlock
#endif
#ifndef EMU_SMEM_BYTES
#define EMU_SMEM_BYTES (1 << 20)   // a CTA's shared memory (more than any GPU's 227 KiB)
#endif

// ----------------------------------------------------------------------------- threads
struct uint3 { unsigned x = 0, y = 0, z = 0; };
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
thread_local uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
thread_local int emu_tid = -1;                      // the thread's linear index in its CTA

[[noreturn]] inline void emu_fail(const char* what, long long x = 0) {
    std::fprintf(stderr, "EMULATOR: %s (%lld) in CTA (%u, %u, %u) thread %d\n", what, x,
                 blockIdx.x, blockIdx.y, blockIdx.z, emu_tid);
    std::fflush(stderr);
    std::_Exit(3);
}

// ----------------------------------------------------------------------------- numbers
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned char b[8];
    std::memcpy(b, &x, 4);
    std::memcpy(b + 4, &y, 4);
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)b[(s >> (4 * i)) & 7u] << (8 * i);
    return r;
}

struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }

// 16-bit floats: the bits, converted by definition (round to nearest even, NaN kept quiet)
struct __half { uint16_t b; };
struct __nv_bfloat16 { uint16_t b; };
struct __half2 { __half x, y; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __half2float(__half h) { _Float16 v; std::memcpy(&v, &h.b, 2); return (float)v; }
inline __half __float2half_rn(float f) {
    _Float16 v = (_Float16)f;
    __half h;
    std::memcpy(&h.b, &v, 2);
    return h;
}
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float((unsigned)h.b << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40)};
    return {(uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) {
    return {__bfloat162float(h.x), __bfloat162float(h.y)};
}
inline unsigned short __half_as_ushort(__half h) { return h.b; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.b; }
inline __half __ushort_as_half(unsigned short u) { return {u}; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return {u}; }
// paired arithmetic, each half rounded once
template <typename P, typename Op> inline P emu_pair(P a, P b, Op op) {
    if constexpr (std::is_same_v<P, __half2>)
        return {__float2half_rn(op(__half2float(a.x), __half2float(b.x))),
                __float2half_rn(op(__half2float(a.y), __half2float(b.y)))};
    else
        return {__float2bfloat16_rn(op(__bfloat162float(a.x), __bfloat162float(b.x))),
                __float2bfloat16_rn(op(__bfloat162float(a.y), __bfloat162float(b.y)))};
}
inline __half2 __hsub2(__half2 a, __half2 b) { return emu_pair(a, b, std::minus<float>()); }
inline __half2 __hmul2(__half2 a, __half2 b) { return emu_pair(a, b, std::multiplies<float>()); }
inline __nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162 b) {
    return emu_pair(a, b, std::minus<float>());
}
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) {
    return emu_pair(a, b, std::multiplies<float>());
}

// fp8 e4m3fn: decode by formula, encode to the nearest code (ties to the even code), satfinite
inline float emu_e4m3_value(unsigned c) {
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
    unsigned best = 0;
    double bd = INFINITY;
    for (unsigned c = 0; c <= 0x7e; ++c) {
        const double d = std::fabs((double)emu_e4m3_value(c) - a);
        if (d < bd || (d == bd && (c & 1u) == 0)) { bd = d; best = c; }
    }
    return sign | (unsigned char)best;
}
struct __nv_fp8_e4m3 {
    __nv_fp8_storage_t __x;
    operator float() const { return emu_e4m3_value(__x); }
};

// ----------------------------------------------------------------------------- memory
template <typename T> inline T __ldg(const T* p) { return *p; }
// .cg loads and stores (a split-K reduction's partials, a grid barrier's word): plain memory,
// but never hoisted out of a spin loop
template <typename T> inline T __ldcg(const T* p) {
    asm volatile("" ::: "memory");
    T v;
    std::memcpy((void*)&v, (const void*)p, sizeof(T));
    return v;
}
template <typename T> inline void __stcg(T* p, T v) {
    std::memcpy((void*)p, (const void*)&v, sizeof(T));
    asm volatile("" ::: "memory");
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __nanosleep(unsigned) { std::this_thread::yield(); }   // a spinning CTA yields
inline void __trap() { emu_fail("__trap"); }

// global atomics: CTAs meet through them (split-K counters, grid barriers); one lock will do
inline std::mutex& emu_atomic_lock() { static std::mutex m; return m; }
#define EMU_ATOMIC(T, name, update)                                                      \
    inline T name(T* p, T v) {                                                           \
        std::lock_guard<std::mutex> l(emu_atomic_lock());                                 \
        const T o = *(volatile T*)p;                                                      \
        *(volatile T*)p = update;                                                         \
        return o;                                                                         \
    }
EMU_ATOMIC(int, atomicAdd, o + v)
EMU_ATOMIC(unsigned, atomicAdd, o + v)
EMU_ATOMIC(unsigned long long, atomicAdd, o + v)
EMU_ATOMIC(float, atomicAdd, o + v)
EMU_ATOMIC(int, atomicMax, v > o ? v : o)
EMU_ATOMIC(unsigned, atomicMax, v > o ? v : o)
#undef EMU_ATOMIC

// ----------------------------------------------------------------------------- CTAs, warps
// The lanes of a warp meet per lane mask: each deposits up to EMU_LANE_BYTES and leaves with
// every lane's deposit (a generation counter tells one meeting from the next).
#define EMU_LANE_BYTES 64
struct EmuMeet {
    int arrived = 0;
    long gen = 0;
    unsigned char vals[32][EMU_LANE_BYTES];
    unsigned char done[2][32][EMU_LANE_BYTES];
};
struct EmuWarp {
    std::mutex m;
    std::condition_variable cv;
    std::map<unsigned, EmuMeet> meets;
};
struct alignas(1024) EmuSmem { unsigned char bytes[EMU_SMEM_BYTES]; };
struct EmuCta {
    std::unique_ptr<EmuSmem> smem{new EmuSmem};
    std::vector<EmuWarp> warps;
    std::barrier<> bar;
    std::atomic<int> vote{0};
    std::vector<uint32_t> regs;       // a warpgroup's register fragments (ptx.h's wgmma)
    explicit EmuCta(unsigned threads) : warps((threads + 31) / 32), bar((std::ptrdiff_t)threads),
                                        regs(4 * threads) {
        std::memset(smem->bytes, 0xAB, sizeof(smem->bytes));   // garbage, as a fresh CTA finds
    }
};
thread_local EmuCta* emu_cta = nullptr;
thread_local unsigned char* emu_smem = nullptr;      // the CTA's shared memory

// A kernel's dynamic shared memory (`extern __shared__ T smem[]`, rewritten by the loader)
// starts `offset` bytes into the CTA's buffer.
inline unsigned char* emu_dynamic_smem(unsigned offset = 0) { return emu_smem + offset; }
// a shared pointer as the byte offset a 32-bit shared address holds
inline unsigned emu_smem_offset(const void* p) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    if (c < emu_smem || c >= emu_smem + EMU_SMEM_BYTES)
        emu_fail("a shared address outside the CTA's shared memory", (long long)(uintptr_t)c);
    return (unsigned)(c - emu_smem);
}
// a shared pointer's address in the shared window (CUDA's builtin): its byte offset
inline size_t __cvta_generic_to_shared(const void* p) { return emu_smem_offset(p); }

// The part of the CTA's shared memory the PTX instructions may touch (byte offsets): the
// kernel's dynamic buffer where its launcher says so (the GEMM ladder's), else all of it.
unsigned emu_window_lo = 0, emu_window_hi = EMU_SMEM_BYTES;
inline void emu_check_window(unsigned off, unsigned bytes, const char* what) {
    if (off < emu_window_lo || off + bytes > emu_window_hi) {
        std::fprintf(stderr, "EMULATOR: %s: bytes [%u, %u) outside the dynamic shared memory "
                     "[%u, %u)\n", what, off, off + bytes, emu_window_lo, emu_window_hi);
        emu_fail(what, off);
    }
}

inline void emu_warp_exchange(unsigned mask, const void* mine, size_t n,
                              unsigned char (*all)[EMU_LANE_BYTES]) {
    const int lane = emu_tid & 31;
    if (!((mask >> lane) & 1u)) emu_fail("a warp collective from a lane outside its mask", mask);
    EmuWarp& w = emu_cta->warps[emu_tid >> 5];
    std::unique_lock<std::mutex> lk(w.m);
    EmuMeet& m = w.meets[mask];
    std::memcpy(m.vals[lane], mine, n);
    const long g = m.gen;
    if (++m.arrived == __builtin_popcount(mask)) {
        std::memcpy(m.done[g & 1], m.vals, sizeof(m.vals));
        m.arrived = 0;
        ++m.gen;
        w.cv.notify_all();
    } else if (!w.cv.wait_for(lk, std::chrono::seconds(EMU_WAIT_S), [&] { return m.gen != g; })) {
        emu_fail("a warp collective that some lane of its mask never reached", mask);
    }
    std::memcpy(all, m.done[g & 1], sizeof(m.vals));
}
template <typename T> inline T emu_lane_value(unsigned char (*all)[EMU_LANE_BYTES], int lane) {
    T r;
    std::memcpy((void*)&r, all[lane & 31], sizeof(T));
    return r;
}
template <typename T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    unsigned char all[32][EMU_LANE_BYTES];
    emu_warp_exchange(mask, &v, sizeof(T), all);
    const int lane = emu_tid & 31;
    return emu_lane_value<T>(all, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
    unsigned char all[32][EMU_LANE_BYTES];
    emu_warp_exchange(mask, &v, sizeof(T), all);
    const int lane = emu_tid & 31, src = lane ^ m;
    return ((src ^ lane) & ~(width - 1)) ? v : emu_lane_value<T>(all, src);
}
template <typename T> inline T __shfl_up_sync(unsigned mask, T v, int d, int width = 32) {
    unsigned char all[32][EMU_LANE_BYTES];
    emu_warp_exchange(mask, &v, sizeof(T), all);
    const int lane = emu_tid & 31;
    return (lane & (width - 1)) >= d ? emu_lane_value<T>(all, lane - d) : v;
}
inline unsigned __ballot_sync(unsigned mask, int p) {
    unsigned char all[32][EMU_LANE_BYTES];
    const int mine = p ? 1 : 0;
    emu_warp_exchange(mask, &mine, sizeof(mine), all);
    unsigned r = 0;
    for (int i = 0; i < 32; ++i)
        if (((mask >> i) & 1u) && emu_lane_value<int>(all, i)) r |= 1u << i;
    return r;
}
inline unsigned __match_any_sync(unsigned mask, int v) {
    unsigned char all[32][EMU_LANE_BYTES];
    emu_warp_exchange(mask, &v, sizeof(v), all);
    unsigned r = 0;
    for (int i = 0; i < 32; ++i)
        if (((mask >> i) & 1u) && emu_lane_value<int>(all, i) == v) r |= 1u << i;
    return r;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    unsigned char all[32][EMU_LANE_BYTES];
    const int nothing = 0;
    emu_warp_exchange(mask, &nothing, sizeof(nothing), all);
}

inline void __syncthreads() { emu_cta->bar.arrive_and_wait(); }
inline int __syncthreads_or(int p) {
    if (emu_tid == 0) emu_cta->vote = 0;    // every reader of the last vote passed its barrier
    __syncthreads();
    if (p) emu_cta->vote |= 1;
    __syncthreads();
    const int r = emu_cta->vote.load();
    __syncthreads();
    return r;
}

// ----------------------------------------------------------------------------- launches
// ptx.h's bookkeeping around a CTA and a launch (copies never waited for, programmatic launches)
inline void emu_cta_begin(unsigned threads);
inline void emu_thread_end();
inline void emu_launch_end();

// The order of the CTAs: 0 x fastest, then y, then z; 1 the reverse; any other value a
// shuffle seeded by it. Kernels whose CTAs hand work to each other must finish it the same
// way in every order.
unsigned emu_block_order = 0;
extern "C" void emu_set_block_order(unsigned order) { emu_block_order = order; }

inline std::vector<uint3> emu_blocks(dim3 grid) {
    std::vector<uint3> order;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) order.push_back({x, y, z});
    if (emu_block_order == 1) std::reverse(order.begin(), order.end());
    if (emu_block_order > 1) {
        std::mt19937 gen(emu_block_order);
        std::shuffle(order.begin(), order.end(), gen);
    }
    return order;
}

template <typename F> void emu_thread(EmuCta& cta, uint3 block, unsigned t, F& body) {
    emu_tid = (int)t;
    threadIdx = {t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
    blockIdx = block;
    emu_cta = &cta;
    emu_smem = cta.smem->bytes;
    body();
    emu_thread_end();
    cta.bar.arrive_and_drop();
}

// grid x block threads run `body` (a lambda that calls the kernel), CTA after CTA. `smem`, the
// launch's dynamic shared memory as on the GPU, is for the reader: every CTA gets
// EMU_SMEM_BYTES (emu_window_lo / hi bound what the PTX may touch where a launcher knows it).
template <typename F> void launch(dim3 grid, dim3 block, size_t /*smem*/, F body) {
    gridDim = grid;
    blockDim = block;
    const unsigned threads = block.x * block.y * block.z;
    for (const uint3& b : emu_blocks(grid)) {
        EmuCta cta(threads);
        emu_cta_begin(threads);
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < threads; ++t)
            ts.emplace_back([&, t] { emu_thread(cta, b, t, body); });
        for (auto& t : ts) t.join();
    }
    emu_launch_end();
}

// every CTA at once, each with its own shared memory, warps and barrier
template <typename F> void launch_cooperative(dim3 grid, dim3 block, size_t /*smem*/, F body) {
    gridDim = grid;
    blockDim = block;
    const unsigned threads = block.x * block.y * block.z;
    std::vector<std::unique_ptr<EmuCta>> ctas;
    std::vector<std::thread> ts;
    for (const uint3& b : emu_blocks(grid)) {
        ctas.emplace_back(new EmuCta(threads));
        EmuCta* cta = ctas.back().get();
        for (unsigned t = 0; t < threads; ++t)
            ts.emplace_back([&, cta, b, t] { emu_thread(*cta, b, t, body); });
    }
    for (auto& t : ts) t.join();
    emu_launch_end();
}

#include "ptx.h"
#include "kernels.h"
