// wgmma_operands.cuh: the accumulator operands of Hopper's wgmma.mma_async and the
// synchronisation around it, written once.
//
// An m64nN wgmma keeps its 64 x N fp32 tile in R = N / 2 registers per thread, and inline PTX
// must name every one of them twice: "%0, ..., %(R-1)" in the instruction text and one "+f"
// operand each. These macros spell both out for R = 32, 64 and 128 (N = 64, 128, 256), so
// that a wrapper states only what is its own: the shape, the types, and the operands after
// the accumulator (numbered from R: the two descriptors %R and %R+1, then the scale-d flag).
//
// Included (inlined by _compile.source_text) by gemm_v5_wgmma.cu, quant/w8a8_v4_wgmma.cu and
// quant/wna16_v6_wgmma.cu.
#pragma once

// "+f" operands d[i] .. d[i + 7], .. d[i + 31], .. d[i + 63], and d[0] .. d[127]
#define WG_ACC8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                      "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_ACC32(d, i) WG_ACC8(d, i), WG_ACC8(d, i + 8), WG_ACC8(d, i + 16), WG_ACC8(d, i + 24)
#define WG_ACC64(d, i) WG_ACC32(d, i), WG_ACC32(d, i + 32)
#define WG_ACC128(d) WG_ACC64(d, 0), WG_ACC64(d, 64)

// the same registers in the instruction text
#define WG_REGS32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_REGS64 WG_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_REGS128 WG_REGS64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
                   "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
                   "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
                   "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// The pipeline's fences and waits. The CPU emulator of the tests (tests/emulator: it defines
// GG_HOST_EMULATION and QG_EMULATED_PTX) brings its own versions.
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
