// align.cu: moe_align_block_size on the GPU, in one launch, with no host round trip.
//
// Shapes: T tokens, K top-k, P = T * K flat slots (s = t * K + k), E experts, B block size.
//
// Math: count c_e; padded start off_e = sum_{e' < e} ceil(c_e' / B) * B; the slots of expert e
//   sit at off_e .. off_e + c_e - 1 in increasing s (stable: the reference's order), the rest of
//   each expert's run and of the array hold the padding value P; expert_ids[b] = expert_map[e]
//   (or e) for the blocks of e, -1 past the last block. An id outside [0, E), or a non-local
//   expert when ignore_invalid, is dropped.
//
// Kernel (align.py launches it):
//   moe_align_kernel          the whole alignment in one launch: one block up to SMALL_P slots,
//                             above that a cooperative grid (one block per SM at most) with
//                             one grid barrier between the count and the scatter
//
// The grouping is grouping.cuh's (stable without a sort: per-warp chunks in slot order).
// Why a grid for large P: one SM walking P = 32768 slots (and scattering ~one 32-byte sector
// per store) is most of the time; spread over G blocks each walks P / G. The chunks' first
// ranks need every earlier chunk's counts, hence one grid barrier (cooperative launch, so all
// blocks are resident) instead of a second launch.
//
// Launch geometry (align.py):
//   moe_align_kernel: block = W * 32, W = min(32, (SMEM_BUDGET / 4 - 2 E - 33) / E) (at least 1,
//     with an opt-in above 48 KB for E > ~4000); grid G = 1 when P <= SMALL_P (W cut to the
//     32-slot steps), else G = min(SMs, cdiv(P, W WARP_SLOTS), TABLE_LOADS W 32 / E) launched
//     cooperatively; shared memory ((W + 2) E + 33) * 4 B (wc [W, E], off [E + 1], tot [E],
//     scan scratch [32]); global scratch hist [G, E] and the barrier word (G > 1)
//
// Compile-time parameters: PREFETCH (align.py CONFIGS["group"]).
// Versions: alignment v2 (one launch, grid barrier); v1 (a one-block count launch, then a
//   scatter launch over the GPU: 25.4 us at T = 4096, E = 256, K = 8, B = 64 on an H200) is in
//   git history (commit d25bbf6). Run: python -m cuda_kernels.cupy.align

// align_bucket, block_exclusive_scan (and PREFETCH, FULL_MASK)
#include "grouping.cuh"
// grid_barrier (the cooperative grid's one barrier)
#include "grid_barrier.cuh"

// ============================================================================ alignment (v2)
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
