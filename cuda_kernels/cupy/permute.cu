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
//   moe_align_kernel          the whole alignment in one launch: one block up to SMALL_P slots,
//                             above that a cooperative grid (one block per SM at most) with
//                             one grid barrier between the count and the scatter
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
// walked by one warp, the warps in slot order. Pass 1 counts per (chunk, bucket); an exclusive
// scan over chunks turns the counts into each chunk's first rank inside each bucket; a block
// scan over buckets gives the padded bucket starts. Pass 2 walks each chunk again, 32 slots at
// a time: __match_any_sync groups the lanes of one bucket, a lane's rank among them is the
// popcount of the lower lanes, and the group's first lane advances the chunk's cursor. Each
// lane loads the ids of PREFETCH steps at once, so that many loads are in flight.
// Why a grid for large P: one SM walking P = 32768 slots (and scattering ~one 32-byte sector
// per store) is most of the time; spread over G blocks each walks P / G. The chunks' first
// ranks need every earlier chunk's counts, hence one grid barrier (cooperative launch, so all
// blocks are resident) instead of a second launch.
//
// Launch geometry (permute.py):
//   moe_align_kernel: block = W * 32, W = min(32, (SMEM_BUDGET / 4 - 2 E - 33) / E) (at least 1,
//     with an opt-in above 48 KB for E > ~4000); grid G = 1 when P <= SMALL_P (W cut to the
//     32-slot steps), else G = min(SMs, cdiv(P, W WARP_SLOTS), TABLE_LOADS W 32 / E) launched
//     cooperatively; shared memory ((W + 2) E + 33) * 4 B (wc [W, E], off [E + 1], tot [E],
//     scan scratch [32]); global scratch hist [G, E] and the barrier word (G > 1)
//   moe_permute_index_kernel: grid = 1, block = W * 32, warp w owns chunk w,
//     W = min(32, (SMEM_BUDGET / 4 - NB - 33) / NB); shared memory (W NB + NB + 1 + 32) * 4 B
//     (per-warp counters, bucket starts, scan scratch)
//   gather_rows_kernel: block = ROW_WARPS * 32, one warp per slot row, grid = cdiv(P, ROW_WARPS)
//   moe_unpermute_kernel: block = min(UNPERMUTE_THREADS, cdiv(H / VEC, 32) * 32), each thread
//     VEC columns, grid = T * cdiv(H, block * VEC) (flattened: no 65535 limit on T)
//
// Compile-time parameters: SCALAR_T (float, __half, __nv_bfloat16: y's dtype), PREFETCH,
//   ROW_WARPS, UNPERMUTE_THREADS (permute.py CONFIGS); templates V, VEC.
// Versions: alignment v2 (one launch, grid barrier); v1 (a one-block count launch, then a
//   scatter launch over the GPU: 25.4 us at T = 4096, E = 256, K = 8, B = 64 on an H200) is in
//   git history (commit d25bbf6). Run: python -m cuda_kernels.cupy.permute

// to_f32, from_f32, Pack, load, store
#include "elementwise.cuh"

#ifndef SCALAR_T
#define SCALAR_T float
#endif
#ifndef PREFETCH
#define PREFETCH 8
#endif
#ifndef ROW_WARPS
#define ROW_WARPS 4
#endif
#ifndef UNPERMUTE_THREADS
#define UNPERMUTE_THREADS 128
#endif

#define FULL_MASK 0xffffffffu

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

// ============================================================================ alignment (v2)
// Grid-wide barrier of a cooperative launch (every block resident at once). `bar` is one word
// that outlives the launch (permute.py keeps one per device and stream, zeroed once): block 0
// adds 2^31 - (G - 1) and every other block 1, so the top bit flips exactly when the G-th
// block arrives, and the low 31 bits are back to 0 for the next launch on that stream. The
// scheme of CUDA's own grid sync, written out so that NVRTC needs no cooperative_groups.
__device__ __forceinline__ void grid_barrier(unsigned int* bar) {
    __syncthreads();  // the block's writes come before thread 0's fence (a cumulative fence)
    if (threadIdx.x == 0) {
        const unsigned int inc = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1u) : 1u;
        __threadfence();  // release: this block's global writes, then its arrival
        const unsigned int old = atomicAdd(bar, inc);
        while (((*(volatile unsigned int*)bar ^ old) & 0x80000000u) == 0u) __nanosleep(20);
        __threadfence();  // acquire: every block's writes are visible past this point
    }
    __syncthreads();
}

// The buckets of one round of a warp's slots: b[u] is the bucket of slot base + 32 u + lane
// (-1: dropped, or past `end`). PREFETCH independent loads in flight per lane.
__device__ __forceinline__ void load_align_buckets(const int* __restrict__ ids,
                                                   const int* __restrict__ expert_map, int base,
                                                   int end, int E, int ignore_invalid,
                                                   int (&b)[PREFETCH]) {
    const int lane = threadIdx.x & 31;
    int e[PREFETCH];
#pragma unroll
    for (int u = 0; u < PREFETCH; ++u) {
        const int s = base + u * 32 + lane;
        e[u] = s < end ? ids[s] : -1;
    }
#pragma unroll
    for (int u = 0; u < PREFETCH; ++u) b[u] = align_bucket(e[u], E, expert_map, ignore_invalid);
}

// One warp places one round in slot order: the lanes of one bucket in a 32-slot step are found
// with __match_any_sync; the group's lowest lane reads and advances the warp's cursor for that
// bucket and hands the old value to the group, each lane adds its rank among the lower lanes.
__device__ __forceinline__ void place_align_buckets(const int (&b)[PREFETCH], int base, int end,
                                                    int* cursor, const int* start,
                                                    int* __restrict__ sorted_token_ids) {
    const int lane = threadIdx.x & 31;
    const unsigned lower = (1u << lane) - 1u;  // the lanes below this one
#pragma unroll
    for (int u = 0; u < PREFETCH; ++u) {
        if (base + u * 32 >= end) break;  // warp-uniform: the rest of the round is past the chunk
        const unsigned same = __match_any_sync(FULL_MASK, b[u]);
        const int leader = __ffs(same) - 1;
        int first = 0;
        if (lane == leader && b[u] >= 0) {
            first = cursor[b[u]];
            cursor[b[u]] = first + __popc(same);
        }
        __syncwarp();  // this step's cursor writes land before the next step's reads
        first = __shfl_sync(FULL_MASK, first, leader);
        if (b[u] >= 0) sorted_token_ids[start[b[u]] + first + __popc(same & lower)] = base + u * 32 + lane;
    }
}

// The whole alignment in one launch. G = gridDim.x blocks of W warps; the P slots are cut into
// G W chunks of `chunk` slots (whole 32-slot steps), warp w of block g owning chunk g W + w, so
// that (block, warp, step, lane) is slot order.
//   1. each warp counts its chunk into its own shared row wc[w][e] (its buckets stay in
//      registers when the chunk is one round: 32 PREFETCH slots);
//   2. a scan over the warps turns wc into each warp's first rank inside the block and gives
//      the block's count per expert, which goes to hist[g][e] (G > 1) or is the total (G = 1);
//   3. G > 1: grid barrier; every block reads hist [G, E]: pre[e] = sum over earlier blocks
//      (added to its warps' ranks) and tot[e] = sum over all blocks;
//   4. padded starts off[e] = exclusive scan of ceil(tot[e] / B) B (every block, redundantly);
//   5. expert_ids, the padding of each run and of the tail, num_tokens_post_padded, spread
//      over every warp of the grid (positions no slot takes: no ordering needed);
//   6. each warp places its slots: sorted_token_ids[off[e] + rank] = s.
// Shared memory (ints): wc [W E], off [E + 1], tot [E], scan scratch [32].
extern "C" __global__ void __launch_bounds__(1024)
moe_align_kernel(const int* __restrict__ topk_ids,          // [P]
                 const int* __restrict__ expert_map,        // [E] or nullptr
                 int* __restrict__ sorted_token_ids,        // [max_padded]
                 int* __restrict__ expert_ids,              // [num_blocks]
                 int* __restrict__ num_tokens_post_padded,  // [1]
                 int* hist,                                 // [G, E] scratch (G > 1): written
                                                            // and read across blocks, so no
                                                            // __restrict__ (no read-only loads)
                 unsigned int* bar,                         // [1] barrier word (G > 1)
                 int P, int E, int B, int max_padded, int num_blocks, int ignore_invalid) {
    extern __shared__ int smem[];
    const int tid = threadIdx.x, nthreads = blockDim.x;
    const int W = nthreads >> 5, warp = tid >> 5, lane = tid & 31;
    const int G = gridDim.x, g = blockIdx.x;
    int* wc = smem;           // [W, E]
    int* off = wc + W * E;    // [E + 1]
    int* tot = off + E + 1;   // [E]
    int* scratch = tot + E;   // [32]

    const int nwarps = G * W;
    const int chunk = (int)((((long long)P + nwarps - 1) / nwarps + 31) / 32 * 32);
    const int begin = (int)min((long long)P, (long long)(g * W + warp) * chunk);
    const int end = min(P, begin + chunk);
    const int step = 32 * PREFETCH;
    const int rounds = (end - begin + step - 1) / step;

    int bk[PREFETCH];
    if (rounds == 1)  // issued before the zeroing below, so its latency overlaps it
        load_align_buckets(topk_ids, expert_map, begin, end, E, ignore_invalid, bk);
    for (int i = tid; i < W * E; i += nthreads) wc[i] = 0;
    for (int e = tid; e < E; e += nthreads) off[e] = tot[e] = 0;  // step 3's accumulators
    __syncthreads();
    for (int r = 0; r < rounds; ++r) {
        if (rounds > 1) load_align_buckets(topk_ids, expert_map, begin + r * step, end, E,
                                           ignore_invalid, bk);
#pragma unroll
        for (int u = 0; u < PREFETCH; ++u)
            if (bk[u] >= 0) atomicAdd(&wc[warp * E + bk[u]], 1);
    }
    __syncthreads();
    for (int e = tid; e < E; e += nthreads) {  // consecutive e: consecutive banks
        int run = 0;
#pragma unroll 8
        for (int w = 0; w < W; ++w) {
            const int c = wc[w * E + e];
            wc[w * E + e] = run;
            run += c;
        }
        if (G > 1) hist[(size_t)g * E + e] = run;
        else tot[e] = run;
    }
    if (G > 1) {
        grid_barrier(bar);
        // `per` threads per expert, each summing every per-th row: few loads per thread, all
        // independent; L2 loads (__ldcg): the rows were written by other SMs during this launch
        const int per = max(1, nthreads / E);
        for (int i = tid; i < per * E; i += nthreads) {
            const int e = i % E, q = i / E;
            int t = 0, p = 0;
#pragma unroll 4
            for (int j = q; j < G; j += per) {
                const int v = __ldcg(hist + (size_t)j * E + e);
                t += v;
                p += j < g ? v : 0;
            }
            atomicAdd(&tot[e], t);
            atomicAdd(&off[e], p);
        }
        __syncthreads();
    }
    for (int e = tid; e < E; e += nthreads) {
        if (G > 1) {
            const int p = off[e];  // slots of e in earlier blocks
            for (int w = 0; w < W; ++w) wc[w * E + e] += p;
        }
        off[e] = (tot[e] + B - 1) / B * B;  // padded size, scanned next
    }
    __syncthreads();
    block_exclusive_scan(off, E, scratch);

    const int gw = g * W + warp;
    for (int e = gw; e < E; e += nwarps) {  // expert e: warp e mod (G W) of the grid
        const int lo = off[e], hi = off[e + 1];
        if (lo == hi) continue;  // no slots, no blocks
        const int eid = expert_map != nullptr ? expert_map[e] : e;
        for (int x = lo / B + lane; x < hi / B; x += 32) expert_ids[x] = eid;
        for (int p = lo + tot[e] + lane; p < hi; p += 32) sorted_token_ids[p] = P;
    }
    const int total = off[E];
    const int gt = g * nthreads + tid, gn = G * nthreads;
    for (int p = total + gt; p < max_padded; p += gn) sorted_token_ids[p] = P;
    for (int x = total / B + gt; x < num_blocks; x += gn) expert_ids[x] = -1;
    if (gt == 0) num_tokens_post_padded[0] = total;

    int* cursor = wc + warp * E;
    for (int r = 0; r < rounds; ++r) {
        if (rounds > 1) load_align_buckets(topk_ids, expert_map, begin + r * step, end, E,
                                           ignore_invalid, bk);
        place_align_buckets(bk, begin + r * step, end, cursor, off, sorted_token_ids);
    }
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
        const Pack<SCALAR_T, VEC> v = load<VEC>(y_grouped + (size_t)r * H + col);
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, to_f32(v.v[j])));
    }
    Pack<SCALAR_T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) from_f32(acc[j], &o.v[j]);
    store<VEC>(out + (size_t)t * H + col, o);
}
