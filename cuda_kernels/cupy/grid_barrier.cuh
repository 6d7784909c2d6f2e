// grid_barrier.cuh: the one grid-wide barrier of a cooperative launch, shared by align.cu
// (between its count and its scatter) and both decode rungs (between GEMM1 and GEMM2).
#pragma once

// Grid-wide barrier of a cooperative launch (every block resident at once). `bar` is one word
// that outlives the launch (align.py's _barrier_word: one per device and stream, zeroed once): block 0
// adds 2^31 - (G - 1) and every other block 1, so the top bit flips exactly when the G-th
// block arrives, and the low 31 bits are back to 0 for the next launch on that stream. The
// scheme of CUDA's own grid sync, written out so that NVRTC needs no cooperative_groups.
// One thread's side of the barrier, for the block whose other threads it stands for (they
// synchronize with it before and after: grid_barrier below, or a subset of the block's warps
// that meet on a named barrier, experts_decode_ring.cu).
__device__ __forceinline__ void grid_arrive_and_wait(unsigned int* bar) {
    const unsigned int inc = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1u) : 1u;
    __threadfence();  // release: this block's global writes, then its arrival
    const unsigned int old = atomicAdd(bar, inc);
    while (((*(volatile unsigned int*)bar ^ old) & 0x80000000u) == 0u) __nanosleep(20);
    __threadfence();  // acquire: every block's writes are visible past this point
}

__device__ __forceinline__ void grid_barrier(unsigned int* bar) {
    __syncthreads();  // the block's writes come before thread 0's fence (a cumulative fence)
    if (threadIdx.x == 0) grid_arrive_and_wait(bar);
    __syncthreads();
}
