// wgmma_operands.cuh: the operands of Hopper's wgmma.mma_async and the synchronisation
// around it, written once.
//
// An m64nN wgmma keeps its 64 x N fp32 tile in R = N / 2 registers per thread, and inline PTX
// must name every one of them twice: "%0, ..., %(R-1)" in the instruction text and one "+f"
// operand each. These macros spell both out for R = 32, 64 and 128 (N = 64, 128, 256), so
// that a wrapper states only what is its own: the shape, the types, and the operands after
// the accumulator (numbered from R: the two descriptors %R and %R+1, then the scale-d flag).
// WG_MMA_SS_N64 / _N128 / _N256 write the whole instruction for both operands in shared
// memory; wg_desc_swizzled<SW> is the descriptor of such an operand (K-major, swizzled).
//
// Included (inlined by _compile.source_text) by gemm_wgmma.cuh (gemm_v5_wgmma.cu,
// gemm_v6_tma_ws.cu), quant/w8a8_v4_wgmma.cu and quant/wna16_v6_wgmma.cu.
#pragma once

// "+f" operands d[i] .. d[i + 3], .. d[i + 7], .. d[i + 11], .. d[i + 15], .. d[i + 31],
// .. d[i + 63], and d[0] .. d[127]
#define WG_ACC4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_ACC8(d, i) WG_ACC4(d, i), WG_ACC4(d, i + 4)
#define WG_ACC12(d, i) WG_ACC8(d, i), WG_ACC4(d, i + 8)
#define WG_ACC16(d, i) WG_ACC8(d, i), WG_ACC8(d, i + 8)
#define WG_ACC32(d, i) WG_ACC16(d, i), WG_ACC16(d, i + 16)
#define WG_ACC64(d, i) WG_ACC32(d, i), WG_ACC32(d, i + 32)
#define WG_ACC128(d) WG_ACC64(d, 0), WG_ACC64(d, 64)

// the same registers in the instruction text (4 to 16: the narrow n8 .. n32 tiles of
// quant/wna16_v6_wgmma.cu)
#define WG_REGS4 "%0, %1, %2, %3"
#define WG_REGS8 WG_REGS4 ", %4, %5, %6, %7"
#define WG_REGS12 WG_REGS8 ", %8, %9, %10, %11"
#define WG_REGS16 WG_REGS12 ", %12, %13, %14, %15"
#define WG_REGS32 WG_REGS16 ", %16, %17, %18, %19, %20, %21, %22, %23, " \
                  "%24, %25, %26, %27, %28, %29, %30, %31"
#define WG_REGS64 WG_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_REGS128 WG_REGS64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
                   "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
                   "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
                   "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// One wgmma with A and B read from shared memory through the 64-bit matrix descriptors da and
// db: d = (scale_d ? d : 0) + A * B over this thread's accumulators d. SHAPE_TYPES: the
// instruction's "m64nNkK.f32.<A type>.<B type>"; IMM: the immediates after the scale-d
// predicate (the scales of A and B, 1 or -1; then, for 16-bit types only, the transposes of A
// and B: 0 0 for K-major tiles). The _N forms number the operands after the R accumulators.
#define WG_MMA_SS(SHAPE_TYPES, IMM, REGS, ACC, I_DA, I_DB, I_SCALE_D, da, db, scale_d)       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I_SCALE_D ", 0;\n"                    \
                 "wgmma.mma_async.sync.aligned." SHAPE_TYPES " {" REGS "}, %" #I_DA ", %"     \
                 #I_DB ", p" IMM ";\n}\n"                                                   \
                 : ACC                                                                       \
                 : "l"(da), "l"(db), "r"(scale_d)                                            \
                 : "memory")
#define WG_MMA_SS_N64(SHAPE_TYPES, IMM, d, da, db, scale_d) \
    WG_MMA_SS(SHAPE_TYPES, IMM, WG_REGS32, WG_ACC32(d, 0), 32, 33, 34, da, db, scale_d)
#define WG_MMA_SS_N128(SHAPE_TYPES, IMM, d, da, db, scale_d) \
    WG_MMA_SS(SHAPE_TYPES, IMM, WG_REGS64, WG_ACC64(d, 0), 64, 65, 66, da, db, scale_d)
#define WG_MMA_SS_N256(SHAPE_TYPES, IMM, d, da, db, scale_d) \
    WG_MMA_SS(SHAPE_TYPES, IMM, WG_REGS128, WG_ACC128(d), 128, 129, 130, da, db, scale_d)

// One wgmma with A from registers (a0..a3: the thread's fragment of the 64 x 16 A tile, 16-bit
// elements) and B from shared memory through the descriptor desc: d = (scale_d ? d : 0) + A * B.
// A_REGS names a0..a3 in the text (the four operands after the R accumulators), I_DESC and
// I_SCALE_D the two after them; IMM: the scales of A and B, then the transpose of B.
#define WG_MMA_RS(SHAPE_TYPES, IMM, REGS, A_REGS, ACC, I_DESC, I_SCALE_D, a0, a1, a2, a3, desc, \
                  scale_d)                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I_SCALE_D ", 0;\n"                    \
                 "wgmma.mma_async.sync.aligned." SHAPE_TYPES " {" REGS "}, {" A_REGS "}, %"   \
                 #I_DESC ", p" IMM ";\n}\n"                                                  \
                 : ACC                                                                       \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(scale_d)               \
                 : "memory")

// The matrix descriptor of a K-major operand tile at shared address `addr`, stored in the
// SW-byte swizzle (SW = 128, 64 or 32: one tile row; chunk c of row r at c ^ (r % (SW / 16))
// on absolute address bits, so the tile starts on a 1024-byte boundary): bits 0-13 addr >> 4,
// 16-29 leading byte offset >> 4 (unused by K-major swizzled layouts: 1 by convention), 32-45
// stride byte offset >> 4 (the next 8-row group: 8 SW bytes), 49-51 base offset (0: the atoms
// are 1024-byte aligned), 62-63 layout type (1, 2, 3: the 128-, 64-, 32-byte swizzle).
template <int SW>
__device__ __forceinline__ unsigned long long wg_desc_swizzled(unsigned addr) {
    static_assert(SW == 128 || SW == 64 || SW == 32, "wgmma swizzles rows of 128, 64 or 32 bytes");
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) |
           ((unsigned long long)((8 * SW) >> 4) << 32) |
           ((unsigned long long)(SW == 128 ? 1 : (SW == 64 ? 2 : 3)) << 62);
}

// The pipeline's fences and waits. The CPU emulations of the tests (GG_HOST_EMULATION in
// the emulator, tests/emulator/; QG_EMULATED_PTX in the quantized rungs) bring their own versions.
#if !defined(GG_HOST_EMULATION) && !defined(QG_EMULATED_PTX)
// shared memory written through the generic proxy (cp.async) is read next by wgmma (async proxy)
__device__ __forceinline__ void wg_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// the registers (A fragments, accumulators) are final before the wgmma that reads them
__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// until at most PENDING committed batches of this warpgroup are still running
template <int PENDING>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(PENDING) : "memory");
}
#endif
