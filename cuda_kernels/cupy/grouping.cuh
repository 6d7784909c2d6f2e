// grouping.cuh: group the (token, slot) pairs by expert, stably, without a sort. What the
// alignment (align.cu) and the contiguous layout's index (permute.cu) share.
//
// Shapes: P = T * K flat slots (s = t * K + k), E experts, B block size, NB buckets (E for
//         alignment; E + 1 for permute: bucket E collects ids outside [0, E) so that every
//         row of x_grouped is still written).
//
// How the grouping is stable without a sort: the slots are cut into contiguous chunks, each
// walked by one warp, the warps in slot order. Pass 1 counts per (chunk, bucket); an exclusive
// scan over chunks turns the counts into each chunk's first rank inside each bucket; a block
// scan over buckets gives the padded bucket starts. Pass 2 walks each chunk again, 32 slots at
// a time: __match_any_sync groups the lanes of one bucket, a lane's rank among them is the
// popcount of the lower lanes, and the group's first lane advances the chunk's cursor. Each
// lane loads the ids of PREFETCH steps at once, so that many loads are in flight.
//
// It holds the bucket rules (align_bucket, permute_bucket), one warp's count and placement of
// its chunk (warp_count, warp_place), the warp's and the block's scans (warp_inclusive_scan,
// block_exclusive_scan) and the one-block grouping built from them (one_block_count_and_scan).
// ep_layout.cu's grouping by destination rank uses its warp scan.
// Compile-time parameter: PREFETCH (align.py CONFIGS["group"]).
#pragma once

#ifndef PREFETCH
#define PREFETCH 8
#endif

#define FULL_MASK 0xffffffffu

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

// The sum of v over lanes 0 .. lane of the warp (shuffles up by 1, 2, 4, 8, 16).
__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += u;
    }
    return v;
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
    const int incl = warp_inclusive_scan(local, lane);
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int wt = warp_inclusive_scan(lane < W ? scratch[lane] : 0, lane);
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
