// wna16_wgmma.cuh: Hopper's wgmma with the dequantized int4 weights as its register A
// operand, for the int4 rungs that use it (quant_gemm_wna16_wgmma.cu, and
// quant_gemm_wna16_staged.cu's WG configs): the instruction for N = 8 .. 32 token columns,
// the B descriptor of the no-swizzle K-major activation tiles, and the register pins ptxas
// needs to keep wgmma asynchronous. Inlined by _compile.source_text; the tests' CPU emulation
// (QG_EMULATED_PTX) brings its own WwMma, ww_smem and fences (test_quant_wna16_wgmma.WW_EMU).
#pragma once
#include "wgmma_operands.cuh"

typedef unsigned long long u64;

#if ELEM_BF16
#define WW_AB "bf16"
#else
#define WW_AB "f16"
#endif

// The PTX. The tests build the rungs that include this on the CPU with
// QG_EMULATED_PTX and its own versions (wgmma by its definition, through the descriptor).
#ifndef QG_EMULATED_PTX
__device__ __forceinline__ u32 ww_smem(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

#endif  // QG_EMULATED_PTX

// Pin registers in place for ptxas: an empty asm that "rewrites" them. Without it the compiler
// computes the A fragments (and the descriptors) right before each wgmma, inside the pipeline
// stage, and ptxas then serializes every wgmma (its C7513 warning: a wait after each one); with
// it, each value is final before wgmma.fence.
__device__ __forceinline__ void ww_pin1(u32& v) {
#ifndef QG_EMULATED_PTX
    asm volatile("" : "+r"(v)::"memory");
#endif
}
__device__ __forceinline__ void ww_pin1(u64& v) {
#ifndef QG_EMULATED_PTX
    asm volatile("" : "+l"(v)::"memory");
#endif
}
__device__ __forceinline__ void ww_pin1(float& v) {
#ifndef QG_EMULATED_PTX
    asm volatile("" : "+f"(v)::"memory");
#endif
}
template <typename T, int N>
__device__ __forceinline__ void ww_pin(T (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) ww_pin1(r[i]);
}

#ifndef QG_EMULATED_PTX
// d (this thread's NN / 2 accumulators of the 64 x NN tile) = A (the warp's 16 rows of the
// 64 x 16 step: a0..a3) * B (16 x NN through desc) + (acc ? d : 0)
template <int NN> struct WwMma;
template <> struct WwMma<8> {
    static __device__ __forceinline__ void run(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                               u64 desc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n8k16.f32." WW_AB "." WW_AB
                     " {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(acc) : "memory");
    }
};
template <> struct WwMma<16> {
    static __device__ __forceinline__ void run(float (&d)[8], u32 a0, u32 a1, u32 a2, u32 a3,
                                               u64 desc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n16k16.f32." WW_AB "." WW_AB
                     " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                       "+f"(d[6]), "+f"(d[7])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(acc) : "memory");
    }
};
template <> struct WwMma<24> {
    static __device__ __forceinline__ void run(float (&d)[12], u32 a0, u32 a1, u32 a2, u32 a3,
                                               u64 desc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %17, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n24k16.f32." WW_AB "." WW_AB
                     " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15},"
                     " %16, p, 1, 1, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                       "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(acc) : "memory");
    }
};
template <> struct WwMma<32> {
    static __device__ __forceinline__ void run(float (&d)[16], u32 a0, u32 a1, u32 a2, u32 a3,
                                               u64 desc, int acc) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32." WW_AB "." WW_AB
                     " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15},"
                     " {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                       "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                       "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(acc) : "memory");
    }
};
#endif  // QG_EMULATED_PTX

// The descriptor of B for k16 step m of the stage at shared address `stage` (MT token tiles):
// bits 0-13 start >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4, 62-63
// layout 0 (no swizzle).
template <int MT>
__device__ __forceinline__ u64 ww_desc_b(u32 stage, int m) {
    const u32 start = stage + 2u * m * MT * 128u;
    return (u64)((start & 0x3FFFFu) >> 4) | ((u64)((MT * 128u) >> 4) << 16) |
           ((u64)(128u >> 4) << 32);
}
