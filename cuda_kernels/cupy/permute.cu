// permute.cu: the contiguous layout (moe_permute / moe_unpermute) on the GPU.
//
// Shapes: T tokens, K top-k, P = T * K flat slots (s = t * K + k), E experts, H hidden size,
//         NB = E + 1 buckets (bucket E collects ids outside [0, E) so that every row of
//         x_grouped is still written).
//
// Math: the grouping of align.cu with B = 1 and no padding: expert_offsets = the exclusive
//   cumsum of the counts, inv_permuted_idx[s] = off_e + (the rank of s among e's slots, in
//   increasing s); x_grouped[inv[s]] = hidden_states[s / K];
//   out[t] = sum_k w[t, k] * y[inv[t * K + k]].
//
// Kernels (permute.py launches them):
//   moe_permute_index_kernel  the grouping with B = 1 and no padding: expert_offsets [E + 1]
//                             (exclusive cumsum of counts) and inv_permuted_idx [P], the row
//                             of x_grouped that slot s goes to (one block; its writes are
//                             coalesced, so it needs no second launch)
//   gather_rows_kernel<V>     x_grouped[inv[s]] = hidden_states[s / K], rows copied as V words
//                             (uint4 = 16 bytes when the row size and pointers allow)
//   moe_unpermute_kernel<VEC> out[t] = sum_k w[t, k] * y[inv[t * K + k]], fp32, k in order,
//                             no atomics (deterministic), rounded once to SCALAR_T
//
// The grouping is grouping.cuh's (stable without a sort: per-warp chunks in slot order).
//
// Launch geometry (permute.py):
//   moe_permute_index_kernel: grid = 1, block = W * 32, warp w owns chunk w,
//     W = min(32, (SMEM_BUDGET / 4 - NB - 33) / NB); shared memory (W NB + NB + 1 + 32) * 4 B
//     (per-warp counters, bucket starts, scan scratch)
//   gather_rows_kernel: block = ROW_WARPS * 32, one warp per slot row, grid = cdiv(P, ROW_WARPS)
//   moe_unpermute_kernel: block = min(UNPERMUTE_THREADS, cdiv(H / VEC, 32) * 32), each thread
//     VEC columns, grid = T * cdiv(H, block * VEC) (flattened: no 65535 limit on T)
//
// Compile-time parameters: SCALAR_T (float, __half, __nv_bfloat16: y's dtype), PREFETCH
//   (align.py CONFIGS["group"]), ROW_WARPS, UNPERMUTE_THREADS (permute.py CONFIGS);
//   templates V, VEC. Run: python -m cuda_kernels.cupy.permute

// to_f32, from_f32, Pack, load, store, row_chunk, add_f32
#include "elementwise.cuh"

#ifndef SCALAR_T
#define SCALAR_T float
#endif
#ifndef ROW_WARPS
#define ROW_WARPS 4
#endif
#ifndef UNPERMUTE_THREADS
#define UNPERMUTE_THREADS 128
#endif

// the bucket rules, warp_count / warp_place, one_block_count_and_scan (and PREFETCH, FULL_MASK)
#include "grouping.cuh"

// ============================================================================ index
extern "C" __global__ void __launch_bounds__(1024)
moe_permute_index_kernel(const int* __restrict__ topk_ids,     // [P]
                         int* __restrict__ expert_offsets,     // [E + 1]
                         int* __restrict__ inv_permuted_idx,   // [P]
                         int P, int E, int chunk) {
    extern __shared__ int smem[];
    const int W = blockDim.x >> 5, warp = threadIdx.x >> 5;
    const int NB = E + 1;  // bucket E: ids outside [0, E), placed after every expert
    int* wc = smem;
    int* off = wc + W * NB;
    int* scratch = off + NB + 1;
    one_block_count_and_scan<true>(topk_ids, nullptr, P, E, NB, 1, 0, chunk, wc, off, scratch);
    for (int b = threadIdx.x; b <= E; b += blockDim.x) expert_offsets[b] = off[b];
    const int begin = warp * chunk;
    warp_place<true>(topk_ids, nullptr, begin, min(P, begin + chunk), E, 0, wc + warp * NB, off,
                     [&](int s, int pos) { inv_permuted_idx[s] = pos; });
}

// ============================================================================ row movement
// x_grouped[inv[s]] = hidden_states[s / K], one warp per slot, V-sized words
template <typename V>
__global__ void __launch_bounds__(ROW_WARPS * 32)
gather_rows_kernel(const V* __restrict__ hidden_states,   // [T, row_words]
                   const int* __restrict__ inv_permuted_idx,  // [P]
                   V* __restrict__ x_grouped,              // [P, row_words]
                   int P, int K, int row_words) {
    const int s = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
    if (s >= P) return;
    const int lane = threadIdx.x & 31;
    const V* src = hidden_states + (size_t)(s / K) * row_words;
    V* dst = x_grouped + (size_t)inv_permuted_idx[s] * row_words;
#pragma unroll 4
    for (int i = lane; i < row_words; i += 32) dst[i] = src[i];
}

// out[t, :] = sum_k topk_weights[t, k] * y[inv[t * K + k], :]; explicit _rn ops: no FMA
// contraction, so the fp32 result is the plain "multiply, then add in slot order" one
template <int VEC>
__global__ void __launch_bounds__(UNPERMUTE_THREADS)
moe_unpermute_kernel(const SCALAR_T* __restrict__ y_grouped,    // [P, H]
                     const float* __restrict__ topk_weights,     // [T, K]
                     const int* __restrict__ inv_permuted_idx,   // [P]
                     SCALAR_T* __restrict__ out,                 // [T, H]
                     int T, int K, int H, int chunks) {
    int t, col;
    row_chunk<VEC>(chunks, t, col);
    if (t >= T || col >= H) return;  // H % VEC == 0 on this path (permute.py)
    float acc[VEC] = {};
    for (int k = 0; k < K; ++k) {
        const float w = topk_weights[(size_t)t * K + k];
        const int r = inv_permuted_idx[(size_t)t * K + k];
        add_f32(acc, w, load<VEC>(y_grouped + (size_t)r * H + col));
    }
    Pack<SCALAR_T, VEC> o;                          // rounded once
#pragma unroll
    for (int j = 0; j < VEC; ++j) from_f32(acc[j], &o.v[j]);
    store<VEC>(out + (size_t)t * H + col, o);
}
