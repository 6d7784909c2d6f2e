// gemm_wgmma.cuh: what the Hopper rungs of the grouped GEMM ladder (gemm_v5_wgmma.cu,
// gemm_v6_tma_ws.cu) share: the operands' PTX type GG_AB, the wgmma.m64nNk16 with both
// operands in shared memory, for N = 64, 128 and 256 (v5: the CTA's BLOCK_N; v6: a consumer
// warpgroup's columns), and gg_wgmma_batch(): one stage's wgmma, fenced and committed. The
// descriptors come from wgmma_operands.cuh's wg_desc_swizzled.
//
// Included (inlined by _compile.source_text) after gemm_common.cuh.
#pragma once

#include "wgmma_operands.cuh"

#ifndef GG_AB
#define GG_AB bf16                           // the PTX type of the operands: bf16 or f16
#endif
#define GG_STR2(x) #x
#define GG_STR(x) GG_STR2(x)
#define GG_WGMMA_K16(N) "m64n" #N "k16.f32." GG_STR(GG_AB) "." GG_STR(GG_AB)
// the immediates: A and B unscaled (1, 1), neither transposed (0, 0: both tiles are K-major)
#define GG_WGMMA_IMM ", 1, 1, 0, 0"

// (the CPU emulator, tests/emulator/, defines GG_HOST_EMULATION and its own versions)
#ifndef GG_HOST_EMULATION
// d[N / 2] (this thread's part of the 64 x N fp32 accumulator) += A (64 x 16) * B (16 x N)
__device__ __forceinline__ void gg_wgmma_n64(float* d, unsigned long long desc_a,
                                             unsigned long long desc_b) {
    WG_MMA_SS_N64(GG_WGMMA_K16(64), GG_WGMMA_IMM, d, desc_a, desc_b, 1);
}
__device__ __forceinline__ void gg_wgmma_n128(float* d, unsigned long long desc_a,
                                              unsigned long long desc_b) {
    WG_MMA_SS_N128(GG_WGMMA_K16(128), GG_WGMMA_IMM, d, desc_a, desc_b, 1);
}
__device__ __forceinline__ void gg_wgmma_n256(float* d, unsigned long long desc_a,
                                              unsigned long long desc_b) {
    WG_MMA_SS_N256(GG_WGMMA_K16(256), GG_WGMMA_IMM, d, desc_a, desc_b, 1);
}
#endif  // GG_HOST_EMULATION

// the wgmma of an N-wide accumulator (v5: N = BLOCK_N; v6: a consumer's WG_N columns)
template <int N>
__device__ __forceinline__ void gg_wgmma(float* d, unsigned long long desc_a,
                                         unsigned long long desc_b) {
    static_assert(N == 64 || N == 128 || N == 256, "wgmma n of 64, 128 or 256");
    if constexpr (N == 64) gg_wgmma_n64(d, desc_a, desc_b);
    else if constexpr (N == 128) gg_wgmma_n128(d, desc_a, desc_b);
    else gg_wgmma_n256(d, desc_a, desc_b);
}

// One batch of wgmma over a stage: the kSteps k steps of 16 of the A tile at shared address
// a_base and the B tile at b_base (K-major rows of SW bytes, swizzled), between the fence
// (the accumulators are final before the first wgmma reads them) and the commit; the caller
// waits for it (wg_wait). A k step of 16 elements is 32 bytes further along the swizzled rows:
// the hardware applies the XOR to the addresses it computes from the start.
template <int N, int SW, int kSteps>
__device__ __forceinline__ void gg_wgmma_batch(float* acc, unsigned a_base, unsigned b_base) {
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk)
        gg_wgmma<N>(acc, wg_desc_swizzled<SW>(a_base + kk * 32),
                    wg_desc_swizzled<SW>(b_base + kk * 32));
    wg_commit();
}
