// common.cuh: what the quantized rungs w8a8 v1-v2 and wna16 v1-v3 share: the element type,
// small conversions, the inline PTX (cp.async, mma.sync, streaming loads) and the epilogue
// (bias, then router weight, in fp32; one rounding to elem_t).
//
// ELEM_BF16 (#define, 1 or 0) picks elem_t = __nv_bfloat16 or __half (the output type; the
// activations' type for the weight-only rungs).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#ifndef ELEM_BF16
#error "ELEM_BF16 (1: bf16, 0: fp16) must be #defined by the launcher"
#endif

#if ELEM_BF16
typedef __nv_bfloat16 elem_t;
#define QG_MMA_16816 "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#else
typedef __half elem_t;
#define QG_MMA_16816 "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#endif

typedef unsigned char u8;
typedef unsigned int u32;

#define QG_FP8 0
#define QG_INT8 1
#define QG_KBLOCK 128          // K width of a quantization block (DeepSeek-V3 128x128)

// ---------------------------------------------------------------------------- small helpers
__device__ __forceinline__ float qg_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float qg_to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ void qg_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void qg_store(__half* p, float v) { *p = __float2half_rn(v); }

// two floats -> one 32-bit register of two 16-bit values, `lo` in the low half (the element
// with the smaller k or n index, as mma fragments and little-endian memory both expect)
__device__ __forceinline__ u32 qg_pack(float lo, float hi) {
#if ELEM_BF16
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
#else
    __half2 v = __floats2half2_rn(lo, hi);
#endif
    return *reinterpret_cast<u32*>(&v);
}

// A slot is live when 0 <= s < P (padding is P; the unsigned compare also drops negatives).
__device__ __forceinline__ bool qg_live(int s, int num_slots) {
    return (unsigned)s < (unsigned)num_slots;
}

__device__ __forceinline__ float qg_fp8_to_f32(u8 b) {
    __nv_fp8_e4m3 v;
    v.__x = b;
    return float(v);
}

// bias then router weight, fp32, in the order of docs/stages.md
__device__ __forceinline__ float qg_epilogue(float acc, int e, int n, int s, int N,
                                             const float* __restrict__ bias,
                                             const float* __restrict__ topk_weights,
                                             int mul_routed_weight) {
    if (bias != nullptr) acc += bias[(long long)e * N + n];
    if (mul_routed_weight) acc *= topk_weights[s];
    return acc;
}

// ---------------------------------------------------------------------------- cp.async, mma
// The only inline PTX of the rungs that include this header. The CPU emulation of the tests
// (tests/emulator) #defines QG_EMULATED_PTX and supplies these helpers (same names
// and semantics), so that everything else executes as written before a GPU sees it.
#ifndef QG_EMULATED_PTX
__device__ __forceinline__ u32 qg_smem(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared; src_bytes = 0 writes zeros and reads nothing (out-of-range tiles)
__device__ __forceinline__ void qg_cp16(void* dst, const void* src, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(qg_smem(dst)), "l"(src), "r"(pred ? 16 : 0) : "memory");
}
__device__ __forceinline__ void qg_cp4(void* dst, const void* src, bool pred) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(qg_smem(dst)), "l"(src), "r"(pred ? 4 : 0) : "memory");
}
__device__ __forceinline__ void qg_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void qg_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// D += A (16x32, row) * B (32x8, col): 8-bit fragments, a[i] / b[i] hold 4 consecutive k bytes.
//   a[0]: row g, k 4t..4t+3     a[1]: row g+8, k 4t..4t+3
//   a[2]: row g, k 16+4t..      a[3]: row g+8, k 16+4t..
//   b[0]: col g, k 4t..4t+3   b[1]: col g, k 16+4t..
//   d[0], d[1]: row g, cols 2t, 2t+1   d[2], d[3]: row g+8        (g = lane / 4, t = lane % 4)
__device__ __forceinline__ void qg_mma_k32(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();   // fp8 tensor cores start at sm_89; the launcher never sends fp8 here below that
#endif
}
__device__ __forceinline__ void qg_mma_k32(int (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// D += A (16x16, row) * B (16x8, col), 16-bit elements, two per register (lower k low):
//   a[0]: row g, k 2t,2t+1      a[1]: row g+8, k 2t,2t+1
//   a[2]: row g, k 2t+8,2t+9    a[3]: row g+8, k 2t+8,2t+9
//   b[0]: col g, k 2t,2t+1   b[1]: col g, k 2t+8, 2t+9
__device__ __forceinline__ void qg_mma_k16(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(QG_MMA_16816
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// 16 bytes global -> 4 registers through the read-only path. _stream: weights, read once,
// kept out of L1 (L1::no_allocate) so that the activations every warp re-reads stay there.
__device__ __forceinline__ void qg_ld16_stream(u32 (&r)[4], const void* p) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
}
__device__ __forceinline__ void qg_ld16(u32 (&r)[4], const void* p) {
    asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
}
// x - y on two 16-bit floats per register (elem_t), round to nearest
__device__ __forceinline__ u32 qg_sub2(u32 x, u32 y) {
#if ELEM_BF16
    __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&x),
                               *reinterpret_cast<__nv_bfloat162*>(&y));
#else
    __half2 r = __hsub2(*reinterpret_cast<__half2*>(&x), *reinterpret_cast<__half2*>(&y));
#endif
    return *reinterpret_cast<u32*>(&r);
}
#endif  // QG_EMULATED_PTX

// ---------------------------------------------------------------------------- shared epilogue
// Write one fragment pair (cols n, n+1 of row slot s) through the epilogue; paired 32-bit
// store when both columns exist and the address is 4-byte aligned.
__device__ __forceinline__ void qg_store_pair(elem_t* __restrict__ c, int s, int n, int N, float v0,
                                              float v1, int e, const float* __restrict__ bias,
                                              const float* __restrict__ topk_weights,
                                              int mul_routed_weight) {
    if (n >= N) return;
    const long long off = (long long)s * N + n;
    v0 = qg_epilogue(v0, e, n, s, N, bias, topk_weights, mul_routed_weight);
    if (n + 1 < N) {
        v1 = qg_epilogue(v1, e, n + 1, s, N, bias, topk_weights, mul_routed_weight);
        if ((off & 1) == 0) {
            *reinterpret_cast<u32*>(c + off) = qg_pack(v0, v1);
            return;
        }
        qg_store(c + off + 1, v1);
    }
    qg_store(c + off, v0);
}
