// mbarrier.cuh: the shared-memory mbarrier of sm_90 (PTX ISA 7.0+), one function per PTX
// instruction, shared by the Hopper GEMM (gemm_v6_tma_ws.cu, whose gg_ prefix they keep) and
// the decode ring (experts_decode_ring.cu). A barrier is a 64-bit word of shared memory
// named by its shared-window address; a phase completes when its arrivals (init's count) and
// the bytes announced by expect_tx have all come, and a wait on the phase's parity is then
// an acquire of whatever the arrivals released and the copies wrote.
#pragma once

__device__ __forceinline__ void gg_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
// the inits are visible to the other threads (and the copy engine) before any use
__device__ __forceinline__ void gg_fence_mbar_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void gg_mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// one arrival, and `bytes` more to come from the copy engine in this phase
__device__ __forceinline__ void gg_mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(bar), "r"(bytes) : "memory");
}
// until the phase of this parity has completed (acquire: its writes are visible after)
__device__ __forceinline__ void gg_mbar_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n"
                     " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
