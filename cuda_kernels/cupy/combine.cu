// combine.cu: the combine of a MoE layer, the sum of each token's K expert outputs.
//
// Shapes: T tokens, K top-k slots, H hidden size.
//
// Math (docs/stages.md, "combine"):
//   moe_sum_kernel<VEC>   out[t, h] = sum_{k = 0 .. K-1} x[t, k, h]
//   fp32 accumulation in slot order k = 0, 1, ... (explicit __fadd_rn: no reassociation, and no
//   atomics), rounded once to SCALAR_T: bitwise reproducible, and bitwise the NumPy
//   reference's x.astype(f32).sum(axis=1) in fp32 (NumPy adds along a non-inner axis in order).
//   (The router weights are applied before this stage: by GEMM2's epilogue, or by
//    moe_unpermute in permute.cu for the contiguous layout.)
//   moe_sum_live_kernel<VEC> (vLLM's pad-aware moe_sum): the same sum over the live slots only,
//   slot k of token t live when ids[t, k] >= 0 and, with an expert map, ids[t, k] < map_len
//   and emap[ids[t, k]] >= 0; a dead slot's row (never written by the GEMMs) is never read,
//   a token with no live slot sums to 0.
//
// Launch geometry (combine.py): block = min(SUM_THREADS, cdiv(H / VEC, 32) * 32) threads, each
//   VEC consecutive columns
//   (VEC * sizeof(SCALAR_T) <= 16 bytes: one 16-byte load per slot when H and the pointers
//   allow it); grid = T * cdiv(H, block * VEC), flattened (t = block / chunks).
//   The K loads of a thread are independent (unrolled by 4) so several are in flight.
//   No shared memory.
//
// Compile-time parameters: SCALAR_T (float, __half, __nv_bfloat16), SUM_THREADS (the largest
//   block, tunable);
//   template VEC in {1, 2, 4, 8}. Versions: v1 (this file). Run: python -m cuda_kernels.cupy.combine

// to_f32, from_f32, Pack, load, store, row_chunk, add_f32
#include "elementwise.cuh"

#ifndef SCALAR_T
#define SCALAR_T float
#endif
#ifndef SUM_THREADS
#define SUM_THREADS 128
#endif

template <int VEC>
__global__ void __launch_bounds__(SUM_THREADS)
moe_sum_kernel(const SCALAR_T* __restrict__ x,  // [T, K, H]
               SCALAR_T* __restrict__ out,      // [T, H]
               int T, int K, int H, int chunks) {
    int t, col;
    row_chunk<VEC>(chunks, t, col);
    if (t >= T || col >= H) return;  // H % VEC == 0 (combine.py)
    const SCALAR_T* src = x + (size_t)t * K * H + col;
    float acc[VEC] = {};
#pragma unroll 4
    for (int k = 0; k < K; ++k) add_f32(acc, load<VEC>(src + (size_t)k * H));
    Pack<SCALAR_T, VEC> o;                      // rounded once
#pragma unroll
    for (int j = 0; j < VEC; ++j) from_f32(acc[j], &o.v[j]);
    store<VEC>(out + (size_t)t * H + col, o);
}

template <int VEC>
__global__ void __launch_bounds__(SUM_THREADS)
moe_sum_live_kernel(const SCALAR_T* __restrict__ x,  // [T, K, H]
                    const int* __restrict__ ids,     // [T, K]
                    const int* __restrict__ emap,    // [map_len] or nullptr
                    int map_len,
                    SCALAR_T* __restrict__ out,      // [T, H]
                    int T, int K, int H, int chunks) {
    int t, col;
    row_chunk<VEC>(chunks, t, col);
    if (t >= T || col >= H) return;
    const SCALAR_T* src = x + (size_t)t * K * H + col;
    float acc[VEC] = {};
    for (int k = 0; k < K; ++k) {
        const int e = ids[(size_t)t * K + k];
        if (e < 0 || (emap != nullptr && (e >= map_len || emap[e] < 0))) continue;
        add_f32(acc, load<VEC>(src + (size_t)k * H));
    }
    Pack<SCALAR_T, VEC> o;                      // rounded once
#pragma unroll
    for (int j = 0; j < VEC; ++j) from_f32(acc[j], &o.v[j]);
    store<VEC>(out + (size_t)t * H + col, o);
}
