// permute.cu: group the (token, slot) pairs by expert, on the GPU, with no host round trip.
//
// Shapes: T tokens, K top-k, P = T * K flat slots (s = t * K + k), E experts, B block size,
//         H hidden size, NB buckets (E for alignment; E + 1 for permute: bucket E collects ids
//         outside [0, E) so that every row of x_grouped is still written), NC slot chunks.
//
// Math: count c_e; padded start off_e = sum_{e' < e} ceil(c_e' / B) * B; the slots of expert e
//   sit at off_e .. off_e + c_e - 1 in increasing s (stable: the reference's order), the rest of
//   each expert's run and of the array hold the padding value P; expert_ids[b] = expert_map[e]
//   (or e) for the blocks of e, -1 past the last block. An id outside [0, E), or a non-local
//   expert when ignore_invalid, is dropped.
//
// Kernels (permute.py launches them):
//   moe_align_kernel          one block does everything (P <= SMALL_P: one launch)
//   moe_align_count_kernel    large P, launch 1 of 2: one block counts per (chunk, expert),
//                             scans, writes expert_ids and num_tokens_post_padded, and leaves
//                             hist[c][e] = the rank of chunk c's first slot inside expert e
//   moe_align_scatter_kernel  large P, launch 2 of 2: one warp per chunk places its slots; all
//                             threads write the padding (positions disjoint from the slots')
//   moe_permute_index_kernel  the grouping with B = 1 and no padding: expert_offsets [E + 1]
//                             (exclusive cumsum of counts) and inv_permuted_idx [P], the row
//                             of x_grouped that slot s goes to (one block; its writes are
//                             coalesced, so it needs no second launch)
//   gather_rows_kernel<V>     x_grouped[inv[s]] = hidden_states[s / K], rows copied as V words
//                             (uint4 = 16 bytes when the row size and pointers allow)
//   moe_unpermute_kernel<VEC> out[t] = sum_k w[t, k] * y[inv[t * K + k]], fp32, k in order,
//                             no atomics (deterministic), rounded once to SCALAR_T
//
// How the grouping is stable without a sort: the slots are cut into contiguous chunks, each
// walked by one warp. Pass 1 counts per (chunk, bucket); an exclusive scan over chunks turns
// the counts into each chunk's first rank inside each bucket; a block scan over buckets gives
// the padded bucket starts. Pass 2 walks each chunk again, 32 slots at a time:
// __match_any_sync groups the lanes of one bucket, a lane's rank among them is the popcount
// of the lower lanes, and the group's first lane advances the chunk's cursor. Each lane loads
// the ids of PREFETCH steps at once, so that many loads are in flight.
// Why two launches for large P: the scatter's stores land all over the output, ~one 32-byte
// sector each; from one SM that costs ~32 cycles per warp store (~16 us at P = 32768), spread
// over NC blocks it costs next to nothing.
//
// Launch geometry (permute.py):
//   moe_align_kernel, moe_permute_index_kernel: grid = 1, block = W * 32, warp w owns chunk w,
//     W = min(32, (SMEM_BUDGET / 4 - NB - 33) / NB); shared memory (W NB + NB + 1 + 32) * 4 B
//     (per-warp counters, bucket starts, scan scratch)
//   moe_align_count_kernel: grid = 1, block = W * 32 (same W rule with NB = E), warp w counts
//     chunks w, w + W, ...; shared memory (W E + E + 1 + 32) * 4 B; global scratch
//     hist [NC, E], off [E + 1], counts [E]
//   moe_align_scatter_kernel: grid = cdiv(NC, SCATTER_WARPS), block = SCATTER_WARPS * 32,
//     shared memory (E + 1 + SCATTER_WARPS E) * 4 B
//   gather_rows_kernel: block = ROW_WARPS * 32, one warp per slot row, grid = cdiv(P, ROW_WARPS)
//   moe_unpermute_kernel: block = min(UNPERMUTE_THREADS, cdiv(H / VEC, 32) * 32), each thread
//     VEC columns, grid = T * cdiv(H, block * VEC) (flattened: no 65535 limit on T)
//
// Compile-time parameters: SCALAR_T (float, __half, __nv_bfloat16: y's dtype), PREFETCH,
//   SCATTER_WARPS, ROW_WARPS, UNPERMUTE_THREADS (permute.py CONFIGS); templates V, VEC.
// Versions: v1 (this file). Run: python -m cuda_kernels.cupy.permute

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef SCALAR_T
#define SCALAR_T float
#endif
#ifndef PREFETCH
#define PREFETCH 8
#endif
#ifndef SCATTER_WARPS
#define SCATTER_WARPS 1
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
// bucket of an expert id for alignment: -1 drops the slot
__device__ __forceinline__ int align_bucket(int e, int E, const int* expert_map, int ignore_invalid) {
    if (e < 0 || e >= E) return -1;
    if (ignore_invalid && expert_map != nullptr && expert_map[e] < 0) return -1;
    return e;
}

// bucket for permute: ids outside [0, E) go to the trailing bucket E
__device__ __forceinline__ int permute_bucket(int e, int E) { return (e < 0 || e >= E) ? E : e; }

template <bool PERMUTE>
__device__ __forceinline__ int bucket_of(int e, int E, const int* expert_map, int ignore_invalid) {
    return PERMUTE ? permute_bucket(e, E) : align_bucket(e, E, expert_map, ignore_invalid);
}

// One warp counts the slots [begin, end) into row[bucket] (shared memory, this warp's own row).
template <bool PERMUTE>
__device__ void warp_count(const int* __restrict__ ids, const int* __restrict__ expert_map,
                           int begin, int end, int E, int ignore_invalid, int* row) {
    const int lane = threadIdx.x & 31;
    for (int base = begin; base < end; base += 32 * PREFETCH) {
        int e[PREFETCH];
#pragma unroll
        for (int u = 0; u < PREFETCH; ++u) {  // PREFETCH independent loads in flight
            const int s = base + u * 32 + lane;
            e[u] = s < end ? ids[s] : 0;
        }
#pragma unroll
        for (int u = 0; u < PREFETCH; ++u) {
            if (base + u * 32 + lane < end) {
                const int b = bucket_of<PERMUTE>(e[u], E, expert_map, ignore_invalid);
                if (b >= 0) atomicAdd(&row[b], 1);
            }
        }
    }
}

// One warp places the slots [begin, end), in order: slot s of bucket b goes to
// off[b] + cursor[b] + (its rank among this step's lanes of bucket b); cursor (shared memory,
// this warp's own row) starts at the chunk's first rank in each bucket and advances.
template <bool PERMUTE, typename Emit>
__device__ void warp_place(const int* __restrict__ ids, const int* __restrict__ expert_map,
                           int begin, int end, int E, int ignore_invalid, int* cursor,
                           const int* off, Emit emit) {
    const int lane = threadIdx.x & 31;
    const unsigned lower = (1u << lane) - 1u;  // the lanes below this one
    for (int base = begin; base < end; base += 32 * PREFETCH) {
        int e[PREFETCH];
#pragma unroll
        for (int u = 0; u < PREFETCH; ++u) {
            const int s = base + u * 32 + lane;
            e[u] = s < end ? ids[s] : 0;
        }
#pragma unroll
        for (int u = 0; u < PREFETCH; ++u) {  // the steps in order: this is what keeps s sorted
            const int s = base + u * 32 + lane;
            const unsigned active = __ballot_sync(FULL_MASK, s < end);
            if (s < end) {
                const int b = bucket_of<PERMUTE>(e[u], E, expert_map, ignore_invalid);
                const unsigned same = __match_any_sync(active, b);
                int pos = 0;
                if (b >= 0) pos = off[b] + cursor[b] + __popc(same & lower);
                __syncwarp(active);  // every lane has read its cursor before the leaders move it
                if (b >= 0 && (same & lower) == 0u) cursor[b] += __popc(same);
                __syncwarp(active);
                if (b >= 0) emit(s, pos);
            }
        }
    }
}

// In-place exclusive scan of a[0 .. n) (shared memory) by the whole block; a[n] = the total.
// Each thread sums a run of cdiv(n, threads) entries, warps scan with shuffles, warp 0 scans
// the warp totals (scratch: 32 ints).
__device__ void block_exclusive_scan(int* a, int n, int* scratch) {
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const int W = nthreads >> 5, warp = tid >> 5, lane = tid & 31;
    const int ipt = (n + nthreads - 1) / nthreads;
    const int lo = min(n, tid * ipt), hi = min(n, lo + ipt);
    int local = 0;
    for (int i = lo; i < hi; ++i) local += a[i];
    int incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int wt = lane < W ? scratch[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(FULL_MASK, wt, o);
            if (lane >= o) wt += v;
        }
        if (lane < W) scratch[lane] = wt;  // inclusive warp totals
    }
    __syncthreads();
    int run = (warp > 0 ? scratch[warp - 1] : 0) + incl - local;  // exclusive start of lo
    for (int i = lo; i < hi; ++i) {
        const int v = a[i];
        a[i] = run;
        run += v;
    }
    if (tid == nthreads - 1) a[n] = scratch[W - 1];
    __syncthreads();
}

// expert_ids[blk] for every block and num_tokens_post_padded, from the padded starts off[0..E]
__device__ void write_block_experts(const int* off, int E, int B, const int* __restrict__ expert_map,
                                    int* __restrict__ expert_ids, int num_blocks,
                                    int* __restrict__ num_tokens_post_padded) {
    const int total = off[E];
    if (threadIdx.x == 0) num_tokens_post_padded[0] = total;
    for (int blk = threadIdx.x; blk < num_blocks; blk += blockDim.x) {
        const int pos = blk * B;
        int eid = -1;
        if (pos < total) {
            // the expert whose run holds pos: the last e with off[e] <= pos (an empty expert
            // shares its start with the next one)
            int lo = 0, hi = E;  // invariant: off[lo] <= pos < off[hi]
            while (hi - lo > 1) {
                const int mid = (lo + hi) >> 1;
                if (off[mid] <= pos) lo = mid; else hi = mid;
            }
            eid = expert_map != nullptr ? expert_map[lo] : lo;
        }
        expert_ids[blk] = eid;
    }
}

// The one-block grouping: warp w owns chunk w. Shared memory (ints): wc[W * NB] per-warp
// counters, off[NB + 1] bucket starts, scratch[32]. After it, wc[w * NB + b] is warp w's first
// rank inside bucket b and off[b] the start of bucket b (its size rounded up to B).
template <bool PERMUTE>
__device__ void one_block_count_and_scan(const int* __restrict__ ids,
                                         const int* __restrict__ expert_map, int P, int E, int NB,
                                         int B, int ignore_invalid, int chunk, int* wc, int* off,
                                         int* scratch) {
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const int W = nthreads >> 5, warp = tid >> 5;
    for (int i = tid; i < W * NB; i += nthreads) wc[i] = 0;
    __syncthreads();
    const int begin = warp * chunk;
    warp_count<PERMUTE>(ids, expert_map, begin, min(P, begin + chunk), E, ignore_invalid,
                        wc + warp * NB);
    __syncthreads();
    for (int b = tid; b < NB; b += nthreads) {  // scan over warps: consecutive b, consecutive banks
        int run = 0;
        for (int w = 0; w < W; ++w) {
            const int c = wc[w * NB + b];
            wc[w * NB + b] = run;
            run += c;
        }
        off[b] = ((run + B - 1) / B) * B;  // padded size, scanned next
    }
    __syncthreads();
    block_exclusive_scan(off, NB, scratch);
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
    const int W = blockDim.x >> 5, warp = threadIdx.x >> 5;
    int* wc = smem;
    int* off = wc + W * E;
    int* scratch = off + E + 1;
    one_block_count_and_scan<false>(topk_ids, expert_map, P, E, E, B, ignore_invalid, chunk, wc,
                                    off, scratch);
    write_block_experts(off, E, B, expert_map, expert_ids, num_blocks, num_tokens_post_padded);
    for (int i = threadIdx.x; i < max_padded; i += blockDim.x) sorted_token_ids[i] = P;  // padding
    __syncthreads();  // the padding lands before the slots overwrite it (same block)
    const int begin = warp * chunk;
    warp_place<false>(topk_ids, expert_map, begin, min(P, begin + chunk), E, ignore_invalid,
                      wc + warp * E, off, [&](int s, int pos) { sorted_token_ids[pos] = s; });
}

extern "C" __global__ void __launch_bounds__(1024)
moe_align_count_kernel(const int* __restrict__ topk_ids,          // [P]
                       const int* __restrict__ expert_map,        // [E] or nullptr
                       int* __restrict__ hist,                    // [NC, E] scratch
                       int* __restrict__ off_out,                 // [E + 1] scratch
                       int* __restrict__ counts_out,              // [E] scratch
                       int* __restrict__ expert_ids,              // [num_blocks]
                       int* __restrict__ num_tokens_post_padded,  // [1]
                       int P, int E, int B, int num_blocks, int ignore_invalid, int chunk,
                       int num_chunks) {
    extern __shared__ int smem[];
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const int W = nthreads >> 5, warp = tid >> 5, lane = tid & 31;
    int* row = smem + warp * E;  // this warp's counters
    int* off = smem + W * E;
    int* scratch = off + E + 1;
    for (int c = warp; c < num_chunks; c += W) {
        for (int b = lane; b < E; b += 32) row[b] = 0;
        __syncwarp();
        warp_count<false>(topk_ids, expert_map, c * chunk, min(P, (c + 1) * chunk), E,
                          ignore_invalid, row);
        __syncwarp();
        for (int b = lane; b < E; b += 32) hist[(size_t)c * E + b] = row[b];  // coalesced
        __syncwarp();
    }
    __syncthreads();  // hist written by every warp is visible to the whole block
    for (int e = tid; e < E; e += nthreads) {  // exclusive scan over chunks, 8 loads in flight
        int run = 0;
        for (int c0 = 0; c0 < num_chunks; c0 += 8) {
            int v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) v[u] = c0 + u < num_chunks ? hist[(size_t)(c0 + u) * E + e] : 0;
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                if (c0 + u < num_chunks) {
                    hist[(size_t)(c0 + u) * E + e] = run;
                    run += v[u];
                }
            }
        }
        counts_out[e] = run;
        off[e] = ((run + B - 1) / B) * B;
    }
    __syncthreads();
    block_exclusive_scan(off, E, scratch);
    for (int e = tid; e <= E; e += nthreads) off_out[e] = off[e];
    write_block_experts(off, E, B, expert_map, expert_ids, num_blocks, num_tokens_post_padded);
}

extern "C" __global__ void __launch_bounds__(SCATTER_WARPS * 32)
moe_align_scatter_kernel(const int* __restrict__ topk_ids,     // [P]
                         const int* __restrict__ expert_map,   // [E] or nullptr
                         const int* __restrict__ hist,         // [NC, E] first ranks
                         const int* __restrict__ off_in,       // [E + 1] padded starts
                         const int* __restrict__ counts,       // [E]
                         int* __restrict__ sorted_token_ids,   // [max_padded]
                         int P, int E, int max_padded, int ignore_invalid, int chunk,
                         int num_chunks) {
    extern __shared__ int smem[];
    int* off = smem;                 // [E + 1]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int* cursor = off + E + 1 + warp * E;
    for (int e = threadIdx.x; e <= E; e += blockDim.x) off[e] = off_in[e];
    __syncthreads();
    // the padding, shared by every thread of the grid: the tail of each expert's run and the
    // tail of the array, positions no slot takes (so no ordering against the slots is needed)
    const int gt = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
    for (int e = gt; e < E; e += nt)
        for (int p = off[e] + counts[e]; p < off[e + 1]; ++p) sorted_token_ids[p] = P;
    for (int p = off[E] + gt; p < max_padded; p += nt) sorted_token_ids[p] = P;

    const int c = blockIdx.x * SCATTER_WARPS + warp;
    if (c >= num_chunks) return;  // the whole warp leaves: no block barrier below
    for (int b = lane; b < E; b += 32) cursor[b] = hist[(size_t)c * E + b];
    __syncwarp();
    warp_place<false>(topk_ids, expert_map, c * chunk, min(P, (c + 1) * chunk), E, ignore_invalid,
                      cursor, off, [&](int s, int pos) { sorted_token_ids[pos] = s; });
}

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
