// permute.cu: group the (token, slot) pairs by expert, on the GPU, with no host round trip.
//
// Shapes: T tokens, K top-k, P = T * K flat slots (s = t * K + k), E experts, B block size,
//         H hidden size, NB buckets (E for alignment; E + 1 for permute: bucket E collects ids
//         outside [0, E) so that every row of x_grouped is still written).
//
// Kernels (permute.py launches them):
//   moe_align_kernel       topk_ids [P] -> sorted_token_ids [max_padded], expert_ids
//                          [cdiv(max_padded, B)], num_tokens_post_padded [1]
//       count c_e; padded start off_e = sum_{e' < e} ceil(c_e' / B) * B; the slots of expert e
//       sit at off_e .. off_e + c_e - 1 in increasing s (stable: same order as the reference),
//       the rest of each expert's run and of the array hold the padding value P;
//       expert_ids[b] = expert_map[e] (or e) for the blocks of e, -1 past the last block.
//       An id outside [0, E), or a non-local expert when ignore_invalid, is dropped.
//   moe_permute_index_kernel  the same grouping with B = 1 and no padding:
//       expert_offsets [E + 1] (exclusive cumsum of counts) and inv_permuted_idx [P], the row of
//       x_grouped that slot s goes to.
//   gather_rows_kernel<V>     x_grouped[inv[s]] = hidden_states[s / K], rows copied as V words
//                             (uint4 = 16 bytes when the row size and pointers allow).
//   moe_unpermute_kernel<VEC> out[t] = sum_k w[t, k] * y[inv[t * K + k]], fp32, k in order,
//                             no atomics (deterministic), rounded once to SCALAR_T.
//
// How the grouping is stable without a sort: one block; warp w owns the contiguous chunk of
// slots [w * chunk, (w + 1) * chunk). Pass 1 counts per (warp, bucket) in shared memory;
// a scan over warps turns the counts into each warp's start inside each bucket; a block scan
// over buckets gives the padded bucket starts. Pass 2 walks each chunk again 32 slots at a
// time: __match_any_sync groups the lanes of one bucket, a lane's rank among them is the
// popcount of the lower lanes, and the group's first lane advances the warp's cursor.
//
// Launch geometry:
//   moe_align_kernel, moe_permute_index_kernel: grid = 1, block = W * 32 threads,
//     W = min(32, (SMEM_BUDGET / 4 - NB - 33) / NB) warps (permute.py),
//     dynamic shared memory = (W * NB + NB + 1 + 32) * 4 bytes
//     (per-warp counts, bucket starts, scan scratch). One block is enough up to
//     P ~ 10^5: each warp handles P / W slots twice, and a single launch beats the
//     three launches of a multi-block histogram/scan/scatter at these sizes.
//   gather_rows_kernel: block = ROW_WARPS * 32, one warp per slot row, grid = cdiv(P, ROW_WARPS)
//   moe_unpermute_kernel: block = min(UNPERMUTE_THREADS, cdiv(H / VEC, 32) * 32), each thread
//     VEC columns, grid = T * cdiv(H, block * VEC) (flattened: no 65535 limit on T)
//
// Compile-time parameters: SCALAR_T (float, __half, __nv_bfloat16: y's dtype),
//   ROW_WARPS, UNPERMUTE_THREADS (permute.py CONFIGS); templates V, VEC.
// Versions: v1 (this file). Run: python -m cuda_kernels.cupy.permute

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef SCALAR_T
#define SCALAR_T float
#endif
#ifndef ROW_WARPS
#define ROW_WARPS 4
#endif
#ifndef UNPERMUTE_THREADS
#define UNPERMUTE_THREADS 128
#endif

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_f32(float v, float* out) { *out = v; }
__device__ __forceinline__ void from_f32(float v, __half* out) { *out = __float2half_rn(v); }
__device__ __forceinline__ void from_f32(float v, __nv_bfloat16* out) { *out = __float2bfloat16_rn(v); }

// ============================================================================ grouping
// Shared memory of the one-block grouping kernels (ints):
//   wc[W * NB]   per (warp, bucket) counts, then each warp's start inside the bucket
//   off[NB + 1]  bucket starts (padded for alignment), off[NB] = total
//   scratch[32]  warp totals of the block scan
struct GroupSmem {
    int* wc;
    int* off;
    int* scratch;
};

__device__ __forceinline__ GroupSmem group_smem(int* smem, int W, int NB) {
    GroupSmem g;
    g.wc = smem;
    g.off = smem + W * NB;
    g.scratch = g.off + NB + 1;
    return g;
}

// bucket of an expert id for alignment: -1 drops the slot
__device__ __forceinline__ int align_bucket(int e, int E, const int* expert_map, int ignore_invalid) {
    if (e < 0 || e >= E) return -1;
    if (ignore_invalid && expert_map != nullptr && expert_map[e] < 0) return -1;
    return e;
}

// bucket for permute: ids outside [0, E) go to the trailing bucket E
__device__ __forceinline__ int permute_bucket(int e, int E) { return (e < 0 || e >= E) ? E : e; }

// Pass 1 + scans: after it, g.wc[w * NB + b] is warp w's first rank inside bucket b and
// g.off[b] the start of bucket b, each bucket's size rounded up to a multiple of B.
template <bool PERMUTE>
__device__ void count_and_scan(const int* __restrict__ ids, const int* __restrict__ expert_map,
                               int P, int E, int NB, int B, int ignore_invalid, int chunk,
                               GroupSmem g) {
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const int W = nthreads >> 5, warp = tid >> 5, lane = tid & 31;
    for (int i = tid; i < W * NB; i += nthreads) g.wc[i] = 0;
    __syncthreads();

    const int begin = warp * chunk;
    const int end = min(P, begin + chunk);
    for (int s = begin + lane; s < end; s += 32) {
        const int e = ids[s];
        const int b = PERMUTE ? permute_bucket(e, E) : align_bucket(e, E, expert_map, ignore_invalid);
        if (b >= 0) atomicAdd(&g.wc[warp * NB + b], 1);  // shared-memory atomics, warp-private row
    }
    __syncthreads();

    // scan over warps, per bucket: consecutive threads read consecutive banks
    for (int b = tid; b < NB; b += nthreads) {
        int run = 0;
        for (int w = 0; w < W; ++w) {
            const int c = g.wc[w * NB + b];
            g.wc[w * NB + b] = run;
            run += c;
        }
        g.off[b] = PERMUTE ? run : ((run + B - 1) / B) * B;  // padded size, scanned below
    }
    __syncthreads();

    // exclusive block scan of g.off[0 .. NB): each thread sums a run of ipt buckets,
    // warps scan with shuffles, warp totals are scanned by warp 0
    const int ipt = (NB + nthreads - 1) / nthreads;
    const int lo = min(NB, tid * ipt), hi = min(NB, lo + ipt);
    int local = 0;
    for (int b = lo; b < hi; ++b) local += g.off[b];
    int incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) g.scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int wt = lane < W ? g.scratch[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(FULL_MASK, wt, o);
            if (lane >= o) wt += v;
        }
        if (lane < W) g.scratch[lane] = wt;  // inclusive warp totals
    }
    __syncthreads();
    int run = (warp > 0 ? g.scratch[warp - 1] : 0) + incl - local;  // exclusive start of lo
    for (int b = lo; b < hi; ++b) {
        const int size = g.off[b];
        g.off[b] = run;
        run += size;
    }
    if (tid == nthreads - 1) g.off[NB] = g.scratch[W - 1];
    __syncthreads();
}

// Pass 2: the position of every kept slot, in increasing s inside each bucket.
// Calls emit(s, pos) for each; the warp's cursors in g.wc advance as it goes.
template <bool PERMUTE, typename Emit>
__device__ void stable_positions(const int* __restrict__ ids, const int* __restrict__ expert_map,
                                 int P, int E, int NB, int ignore_invalid, int chunk,
                                 GroupSmem g, Emit emit) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned lower = (1u << lane) - 1u;  // lanes below this one
    const int begin = warp * chunk;
    const int end = min(P, begin + chunk);
    for (int base = begin; base < end; base += 32) {  // warp-uniform trip count
        const int s = base + lane;
        const unsigned active = __ballot_sync(FULL_MASK, s < end);
        if (s < end) {
            const int e = ids[s];
            const int b = PERMUTE ? permute_bucket(e, E) : align_bucket(e, E, expert_map, ignore_invalid);
            const unsigned same = __match_any_sync(active, b);
            int pos = 0;
            if (b >= 0) pos = g.off[b] + g.wc[warp * NB + b] + __popc(same & lower);
            __syncwarp(active);  // every lane read its cursor before the leaders move them
            if (b >= 0 && (same & lower) == 0u) g.wc[warp * NB + b] += __popc(same);
            __syncwarp(active);
            if (b >= 0) emit(s, pos);
        }
    }
}

extern "C" __global__ void __launch_bounds__(1024)
moe_align_kernel(const int* __restrict__ topk_ids,            // [P]
                 const int* __restrict__ expert_map,          // [E] or nullptr
                 int* __restrict__ sorted_token_ids,          // [max_padded]
                 int* __restrict__ expert_ids,                // [num_blocks]
                 int* __restrict__ num_tokens_post_padded,    // [1]
                 int P, int E, int B, int max_padded, int num_blocks,
                 int ignore_invalid, int chunk) {
    extern __shared__ int smem[];
    const int W = blockDim.x >> 5;
    GroupSmem g = group_smem(smem, W, E);
    count_and_scan<false>(topk_ids, expert_map, P, E, E, B, ignore_invalid, chunk, g);

    const int tid = threadIdx.x, nthreads = blockDim.x;
    const int total = g.off[E];
    if (tid == 0) num_tokens_post_padded[0] = total;
    for (int blk = tid; blk < num_blocks; blk += nthreads) {
        const int pos = blk * B;
        int eid = -1;
        if (pos < total) {
            // the expert whose run holds pos: the last e with off[e] <= pos (empty experts
            // share their start with the next one, so take the last)
            int lo = 0, hi = E;  // invariant: off[lo] <= pos < off[hi]
            while (hi - lo > 1) {
                const int mid = (lo + hi) >> 1;
                if (g.off[mid] <= pos) lo = mid; else hi = mid;
            }
            eid = expert_map != nullptr ? expert_map[lo] : lo;
        }
        expert_ids[blk] = eid;
    }
    for (int i = tid; i < max_padded; i += nthreads) sorted_token_ids[i] = P;  // padding
    __syncthreads();  // the padding lands before the slots overwrite it (same block)

    stable_positions<false>(topk_ids, expert_map, P, E, E, ignore_invalid, chunk, g,
                            [&](int s, int pos) { sorted_token_ids[pos] = s; });
}

extern "C" __global__ void __launch_bounds__(1024)
moe_permute_index_kernel(const int* __restrict__ topk_ids,     // [P]
                         int* __restrict__ expert_offsets,     // [E + 1]
                         int* __restrict__ inv_permuted_idx,   // [P]
                         int P, int E, int chunk) {
    extern __shared__ int smem[];
    const int W = blockDim.x >> 5;
    const int NB = E + 1;  // bucket E: ids outside [0, E), placed after every expert
    GroupSmem g = group_smem(smem, W, NB);
    count_and_scan<true>(topk_ids, nullptr, P, E, NB, 1, 0, chunk, g);
    for (int b = threadIdx.x; b <= E; b += blockDim.x) expert_offsets[b] = g.off[b];
    stable_positions<true>(topk_ids, nullptr, P, E, NB, 0, chunk, g,
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

// VEC consecutive elements as one aligned word (16 bytes when VEC * sizeof(T) == 16)
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
    T v[VEC];
};

// out[t, :] = sum_k topk_weights[t, k] * y[inv[t * K + k], :]; explicit _rn ops: no FMA
// contraction, so the fp32 result is the plain "multiply, then add in slot order" one
template <int VEC>
__global__ void __launch_bounds__(UNPERMUTE_THREADS)
moe_unpermute_kernel(const SCALAR_T* __restrict__ y_grouped,    // [P, H]
                     const float* __restrict__ topk_weights,     // [T, K]
                     const int* __restrict__ inv_permuted_idx,   // [P]
                     SCALAR_T* __restrict__ out,                 // [T, H]
                     int T, int K, int H, int chunks) {
    const int t = blockIdx.x / chunks;
    const int col = ((blockIdx.x % chunks) * blockDim.x + threadIdx.x) * VEC;
    if (t >= T || col >= H) return;  // H % VEC == 0 on this path (permute.py)
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
    for (int k = 0; k < K; ++k) {
        const float w = topk_weights[(size_t)t * K + k];
        const int r = inv_permuted_idx[(size_t)t * K + k];
        const Pack<SCALAR_T, VEC> v =
            *reinterpret_cast<const Pack<SCALAR_T, VEC>*>(y_grouped + (size_t)r * H + col);
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, to_f32(v.v[j])));
    }
    Pack<SCALAR_T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) from_f32(acc[j], &o.v[j]);
    *reinterpret_cast<Pack<SCALAR_T, VEC>*>(out + (size_t)t * H + col) = o;
}
