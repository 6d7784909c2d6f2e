// wna16_common.cuh: what the weight-only int4 rungs on prepacked weights share (v4 packed, v5
// staged, v6 wgmma), beyond common.cuh (the element type, the routing arguments): their
// arguments, the magic-number dequantization, the mma.sync and cp.async wrappers, the m tile's
// slots, split K, the compile-time count.
// Inlined by _compile.source_text; QG_EMULATED_PTX (tests) swaps the PTX for its CPU stand-ins.
#pragma once

#include "common.cuh"

#if ELEM_BF16
typedef __nv_bfloat162 elem2_t;
#else
typedef __half2 elem2_t;
#endif

// The arguments of the rungs on prepacked weights (v4, v6; v5 takes the activations as raw
// 16-bit words and its split-K workspace before the sizes): wp, sp, zp as prepack_int4 lays
// them out (the rung's header), then the routing, then the group geometry.
#define W16_PACKED_ARGS                                                                       \
    const elem_t* __restrict__ a, const uint4* __restrict__ wp, elem_t* __restrict__ c,       \
    const float2* __restrict__ sp, const unsigned short* __restrict__ zp, QG_ROUTING_ARGS,     \
    int chunk_shift, int num_groups, int default_zp

namespace w16 {

__device__ __forceinline__ u32 as_u32(elem2_t v) { return *reinterpret_cast<u32*>(&v); }
__device__ __forceinline__ elem2_t as_e2(u32 v) { return *reinterpret_cast<elem2_t*>(&v); }

__device__ __forceinline__ u32 pack2(float lo, float hi) {
#if ELEM_BF16
    return as_u32(__floats2bfloat162_rn(lo, hi));
#else
    return as_u32(__floats2half2_rn(lo, hi));
#endif
}

__device__ __forceinline__ elem_t from_f32(float v) {
#if ELEM_BF16
    return __float2bfloat16_rn(v);
#else
    return __float2half_rn(v);
#endif
}

// v in both halves of a pair, as fp16 (H) or bf16 (for the mma operands of either type).
template <bool H>
__device__ __forceinline__ u32 pair_of(float v) {
    u32 h;
    if constexpr (H)
        h = __half_as_ushort(__float2half_rn(v));
    else
        h = __bfloat16_as_ushort(__float2bfloat16_rn(v));
    return h | h << 16;
}

// (a & b) | c in one instruction (the compiler splits it in two otherwise): the magic-number
// int4 -> 16-bit float conversion of a pair of nibbles.
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
#ifdef QG_EMULATED_PTX
    return (a & b) | c;
#else
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
#endif
}

// The raw 128 + q pairs (1024 + q for fp16: magic = the 16-bit float 128 or 1024 in both
// halves) of a lane's 16 bytes in prepack_int4's "mma" order: lo[p] of row g (words x, z),
// hi[p] of row g + 8 (words y, w); pair p of a word sits in bits 4p.. and 16 + 4p.. One shift
// and one lop3 per pair.
__device__ __forceinline__ void raw_pairs(const uint4& x, u32 magic, u32 (&lo)[8],
                                          u32 (&hi)[8]) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const u32 m = 0x000F000Fu;
        lo[p] = and_or(x.x >> (4 * p), m, magic);
        hi[p] = and_or(x.y >> (4 * p), m, magic);
        lo[4 + p] = and_or(x.z >> (4 * p), m, magic);
        hi[4 + p] = and_or(x.w >> (4 * p), m, magic);
    }
}

// The same pairs as fp16 with two codes per half-word read in place: fp16's 10-bit mantissa
// holds a code at bits 0-3 (under 1024: ulp 1, 1024 + q) and one at bits 4-7 (under 64: ulp
// 1/16, so bit 4 weighs 1: 64 + q). One shift (by 8) per word and one lop3 per pair, against 3
// shifts per word above (bf16's 7-bit mantissa holds one code per half-word). Even pairs p are
// 1024 + q, odd ones 64 + q: the zero point's start must take each offset (wna16_v5_staged).
__device__ __forceinline__ void raw_pairs_f16(const uint4& x, u32 (&lo)[8], u32 (&hi)[8]) {
    constexpr u32 LO = 0x000F000Fu, HI = 0x00F000F0u, M1024 = 0x64006400u, M64 = 0x54005400u;
    const u32 w[4] = {x.x, x.y, x.z, x.w};
    u32 r[4][4];
#pragma unroll
    for (int v = 0; v < 4; ++v) {
        const u32 y = w[v] >> 8;
        r[v][0] = and_or(w[v], LO, M1024);
        r[v][1] = and_or(w[v], HI, M64);
        r[v][2] = and_or(y, LO, M1024);
        r[v][3] = and_or(y, HI, M64);
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        lo[p] = r[0][p];
        hi[p] = r[1][p];
        lo[4 + p] = r[2][p];
        hi[4 + p] = r[3][p];
    }
}

// (x - z) * s on both halves: the subtraction of two small integers is exact, the product
// rounds once.
__device__ __forceinline__ u32 deq2(u32 x, u32 z2, u32 s2) {
    return as_u32(__hmul2(__hsub2(as_e2(x), as_e2(z2)), as_e2(s2)));
}

// mma.sync m16n8k16 with fp32 accumulation; H: the operands are fp16 (1) or bf16 (0); by default
// the build's element type.
#define W16_MMA_F16 "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#define W16_MMA_BF16 "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
template <bool H = !ELEM_BF16>
__device__ __forceinline__ void mma16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
#ifdef QG_EMULATED_PTX   // the CPU emulator of the tests (tests/emulator)
    const uint32_t a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
    qg_mma_k16<H>(*reinterpret_cast<float(*)[4]>(d), a, b);
#else
    if constexpr (H)
        asm volatile(W16_MMA_F16 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile(W16_MMA_BF16 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// 16-byte streaming load: the weights are read once, keep them out of L1.
__device__ __forceinline__ uint4 ld_stream(const u8* p) {
    uint4 v;
#ifdef QG_EMULATED_PTX
    memcpy(&v, p, 16);
#else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#endif
    return v;
}

// cp.async: 16 bytes (.cg: L2 only, the weights are read once) or 4 bytes (.ca), zero-filled
// when pred is false (src-size 0: nothing is read); 8 bytes (.ca), always read.
// The kernels' dynamic shared memory is declared __align__(128): it starts after their static
// __shared__ arrays, and a cp.async whose destination is not aligned like its source's
// 128-byte line costs twice the L2 requests. Measured (H200, wna16_v6_wgmma h32, Mixtral GEMM1 at
// T=64): 4 more bytes of static shared memory put the
// rings 16 bytes off, and L2 read sectors went from 27.2 M to 42.1 M (the weights' 470 MB read
// a second time from L2), 230 -> 250 us; __align__(1024) brought back 27.2 M and 236 us.
__device__ __forceinline__ void cp16(void* dst, const void* src, bool pred) {
#ifdef QG_EMULATED_PTX
    qg_cp16(dst, src, pred);
#else
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(d), "l"(src), "r"(pred ? 16 : 0));
#endif
}
// Programmatic dependent launch (sm_90 and later; no-ops in a plain launch, and compiled out
// below sm_90, where _launch.launch launches plainly): grid_dependency_wait blocks until the
// grid this one was launched after (with programmatic stream serialization) has finished and
// its writes are visible; launch_dependents lets the grid launched after this one start its
// CTAs once every CTA of this grid has issued it or exited. The CPU emulation runs grids one
// after another: its wait checks that nothing before it read the earlier grid's output or wrote
// this grid's (tests/emulator/ptx.h), and launching dependents early has nothing to model.
#if !defined(QG_EMULATED_PTX) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define W16_GRID_DEPENDENCIES 1
#endif
__device__ __forceinline__ void grid_dependency_wait() {
#ifdef QG_EMULATED_PTX
    qg_grid_dependency_wait();
#elif defined(W16_GRID_DEPENDENCIES)
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#ifdef W16_GRID_DEPENDENCIES
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// cp16 issued only when issue is true (a predicated instruction: no branch around it).
__device__ __forceinline__ void cp16_if(bool issue, void* dst, const void* src, bool pred) {
#ifdef QG_EMULATED_PTX
    if (issue) qg_cp16(dst, src, pred);
#else
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n"
                 " @p cp.async.cg.shared.global [%1], [%2], 16, %3;\n}\n"
                 :: "r"((int)issue), "r"(d), "l"(src), "r"(pred ? 16 : 0));
#endif
}
__device__ __forceinline__ void cp4(void* dst, const void* src, bool pred) {
#ifdef QG_EMULATED_PTX
    qg_cp4(dst, src, pred);
#else
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(d), "l"(src), "r"(pred ? 4 : 0));
#endif
}
__device__ __forceinline__ void cp8(void* dst, const void* src) {
#ifdef QG_EMULATED_PTX
    qg_cp8(dst, src);
#else
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" :: "r"(d), "l"(src));
#endif
}
__device__ __forceinline__ void cp_commit() {
#ifdef QG_EMULATED_PTX
    qg_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_wait() {
#ifdef QG_EMULATED_PTX
    qg_wait<N>();
#else
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
#endif
}

// The m tile of BM positions from m0 (one expert: BM divides block_size): sSlot[r] = the slot
// of position m0 + r or -1 (padding, or past the positions), sArow[r] = its row of a (slot /
// top_k) or -1. False, in every thread alike, when no position of the tile is live: the CTA
// has nothing to compute. Every thread of the CTA calls it (it ends in a barrier).
template <int BM>
__device__ __forceinline__ bool load_m_tile(int m0, const int* __restrict__ sorted_token_ids,
                                            const int* __restrict__ num_tokens_post_padded,
                                            int num_slots, int top_k, int num_positions,
                                            int* sSlot, int* sArow) {
    const int tid = threadIdx.x;
    const int s = (tid < BM && m0 + tid < num_positions) ? sorted_token_ids[m0 + tid] : -1;
    if (m0 >= num_positions || m0 >= num_tokens_post_padded[0]) return false;
    int live = 0;
    if (tid < BM) {
        live = s >= 0 && s < num_slots;
        sSlot[tid] = live ? s : -1;
        sArow[tid] = live ? s / top_k : -1;
    }
    return __syncthreads_or(live);
}

// An expert of another rank (expert id -1): zeros in columns n0 .. n0 + cols (those below N) of
// the rows of c that the tile's live positions own, written by the CTA's nthreads threads.
template <int BM>
__device__ __forceinline__ void store_zeros(elem_t* __restrict__ c, const int* sSlot, int N,
                                            int n0, int cols, int nthreads) {
    for (int i = threadIdx.x; i < BM * cols; i += nthreads) {
        const int r = i / cols, n = n0 + i % cols;
        if (sSlot[r] >= 0 && n < N) c[(size_t)sSlot[r] * N + n] = from_f32(0.f);
    }
}
// Split K over grid.z: the N fp32 values v of thread threadIdx.x (of NT) are part blockIdx.z of
// the gridDim.z parts of `tile`; they go to ws [tile][split][per] (v[j] at j NT + thread). The
// last CTA of the tile to arrive (counters[tile], reset by that CTA for the next launch on the
// stream) gets true back, with v = the parts added in split order (deterministic); the others
// get false. Every thread of the CTA calls it (two barriers); s_last is a __shared__ int of the
// caller. (wna16_v5_staged's parts, split where runs end, meet in its own finish_parts.)
template <int N, int NT>
__device__ __forceinline__ bool split_k_last(float* v, float* __restrict__ ws,
                                             int* __restrict__ counters, size_t tile, int per,
                                             int& s_last) {
    const int tid = threadIdx.x, parts = (int)gridDim.z;
    float* mine = ws + (tile * parts + blockIdx.z) * per + tid;
#pragma unroll
    for (int j = 0; j < N; ++j) __stcg(mine + j * NT, v[j]);
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(counters + tile, 1) == parts - 1;
    __syncthreads();
    if (!s_last) return false;
    __threadfence();
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = 0.f;
    for (int z = 0; z < parts; ++z) {
        const float* part = ws + (tile * parts + z) * per + tid;
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] += __ldcg(part + j * NT);
    }
    if (tid == 0) counters[tile] = 0;
    return true;
}

// f(Count<n>{}) for the n in [LO, HI] that equals `n` (n outside: the nearest end), so that
// a loop bound known only at run time (wna16_v4_packed's live token tiles) becomes a constant of
// the code that runs: one instantiation of f per count, branch-free inside.
template <int N> struct Count { static constexpr int value = N; };
template <int LO, int HI, typename F>
__device__ __forceinline__ void with_count(int n, F&& f) {
    if constexpr (LO >= HI) {
        f(Count<LO>{});
    } else {
        if (n <= LO) f(Count<LO>{});
        else with_count<LO + 1, HI>(n, f);
    }
}

}  // namespace w16
