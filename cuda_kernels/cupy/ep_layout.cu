// ep_layout.cu: the expert-parallel all-to-all-v layout in three launches, no host round trip.
//
// Shapes: T tokens, K top-k, W ranks (W <= 32: a token's destinations fit one 32-bit mask),
//   epr experts per rank (physical id e lives on rank e / epr), S entries per token
//   (token rows: S = min(W, K), one per distinct destination rank; slot rows: S = K, one per
//   slot), NB = W + 1 buckets (bucket W = "nowhere": token rows past a token's last
//   destination, slot rows whose id is outside [0, W epr)), H hidden, n = sum of the counts.
//
// Math (e = t * S + j is an entry; the bucket b(e) is a destination rank or W):
//   token rows: the destinations of t, d_0 < d_1 < ..., are the distinct ranks of its ids;
//               b(t, j) = d_j for j < #destinations, W after
//   slot rows:  b(t, k) = ids[t, k] / epr (W when outside [0, W))
//   counts[p] = #{e : b(e) = p};  the send order groups the entries by bucket, increasing e
//   inside a bucket (stable: the order moe_permute gives); inv[e] = the entry's position,
//   src[pos] = e; the "nowhere" entries sit at positions >= n and are never sent.
//
// Kernels (ep_layout.py launches them):
//   ep_layout_kernel        one block: counts, inv [T S], src [T S], n, and the counts of the
//                           NCCL counts exchange ([2, W, C] int64: [0, p, c] = rows to rank p
//                           from token chunk c; [1, rank] = [0, rank], the rest 0 until the
//                           exchange fills it). C chunks of tokens let the combine overlap
//                           the exchange of chunk c + 1 with the sums of chunk c.
//   ep_gather_kernel<V>     one block per token: its row is read ONCE and written to each of
//                           its positions < n (x_send [T S, H] as V words), with the metadata
//                           (token rows: the K ids and weights; slot rows: the local id
//                           ids % epr and the slot's weight)
//   ep_combine_kernel<VEC>  for t in [t_begin, T):
//                           out[t] = sum_{j: inv[t S + j] < n} w[t, j] y[inv[t S + j]] in fp32,
//                           j in order (the ranks' order for token rows), rounded once
//                           (token rows: w = 1; moe_unpermute's arithmetic otherwise)
//   ep_count_experts_kernel counts[e] += #{(t, k) : ids[t, k] = e} for e in [0, E): per-block
//                           shared-memory histogram, then 64-bit atomics into the device
//                           counts (integers: the result does not depend on the order)
//
// How the layout is stable without a sort: thread i of the block owns tokens
// [i ceil(T / NT), (i + 1) ceil(T / NT)), in order. Pass 0 reads the ids once, coalesced
// (thread i takes tokens i, i + NT, ...), and parks each token's destination mask (slot
// rows: each entry's bucket) in inv, which pass 2 overwrites. Pass 1 counts per (bucket, thread) in
// shared memory; one exclusive block scan per bucket over the threads gives each thread's first
// rank inside each bucket, and a serial scan over the <= 33 bucket totals their starts; pass 2
// walks the same tokens again and hands out positions. Entries of one bucket are thus ordered
// by thread, then by token, then by j: by e.
// Why the gather is per token, not per entry: a token row is read from HBM once and written
// S times (token rows: ~2 writes at W = 2), where the stage path (moe_permute) reads it S times.
//
// Launch geometry (ep_layout.py):
//   ep_layout_kernel:        grid 1, block NT = min(LAYOUT_THREADS, multiple of 32 that fits
//                            (NB NT + 32 + NB + 1 + W C) * 4 B of shared memory in 48 KB)
//   ep_gather_kernel:        grid T, block GATHER_THREADS, each thread every GATHER_THREADS-th
//                            word of the row
//   ep_combine_kernel:       grid (T - t_begin) * cdiv(H, block * VEC), block = min(COMBINE_THREADS,
//                            cdiv(H / VEC, 32) * 32), each thread VEC columns
//   ep_count_experts_kernel: grid min(cdiv(N, COUNT_THREADS * 8), 1024), block COUNT_THREADS,
//                            shared memory E * 4 B
//
// Compile-time parameters: SCALAR_T (the combine's element type), LAYOUT_THREADS,
//   GATHER_THREADS, COMBINE_THREADS, COUNT_THREADS (ep_layout.py CONFIGS); templates V, VEC.
// Versions: v1 (this file). The stage path it replaces (table + counts with CuPy array ops,
//   moe_permute, a metadata gather; sandbox/ep/dispatch.py impl="stages") is kept beside it.
// Run: python -m cuda_kernels.cupy.ep_layout

// to_f32, from_f32, Pack, load, store, add_f32
#include "elementwise.cuh"
// warp_inclusive_scan (and FULL_MASK)
#include "grouping.cuh"

#ifndef SCALAR_T
#define SCALAR_T float
#endif
#ifndef LAYOUT_THREADS
#define LAYOUT_THREADS 1024
#endif
#ifndef GATHER_THREADS
#define GATHER_THREADS 128
#endif
#ifndef COMBINE_THREADS
#define COMBINE_THREADS 128
#endif
#ifndef COUNT_THREADS
#define COUNT_THREADS 256
#endif
#define MAX_S 32

// The ranks token t visits, as a bit mask (ids outside [0, W epr) visit nothing).
__device__ __forceinline__ unsigned token_mask(const int* __restrict__ ids_t, int K, int W, int epr) {
    unsigned m = 0u;
    for (int k = 0; k < K; ++k) {
        const int e = ids_t[k];
        if (e >= 0 && e < W * epr) m |= 1u << (e / epr);
    }
    return m;
}

__device__ __forceinline__ unsigned rank_bit(int e, int W, int epr) {
    return (e >= 0 && e < W * epr) ? 1u << (e / epr) : 0u;
}

__device__ __forceinline__ int slot_bucket(int e, int W, int epr) {
    return (e >= 0 && e < W * epr) ? e / epr : W;
}

// Inclusive scan of one int per thread over the block (blockDim.x a multiple of 32, at most
// 1024); `scratch` holds 32 ints. Ends with a barrier, so scratch can be reused at once.
__device__ int block_inclusive_scan(int v, int* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_inclusive_scan(v, lane);
    if (lane == 31) scratch[warp] = v;
    __syncthreads();
    if (warp == 0)    // inclusive totals of warps 0..lane
        scratch[lane] = warp_inclusive_scan(lane < nwarps ? scratch[lane] : 0, lane);
    __syncthreads();
    if (warp > 0) v += scratch[warp - 1];
    __syncthreads();
    return v;
}

// ============================================================================ layout
extern "C" __global__ void __launch_bounds__(LAYOUT_THREADS)
ep_layout_kernel(const int* __restrict__ ids,      // [T, K] physical expert ids
                 int* __restrict__ inv,            // [T S] entry -> position
                 int* __restrict__ src,            // [T S] position -> entry
                 long long* __restrict__ counts2,  // [2, W, C]: [0] send counts per token
                                                   // chunk, [1, rank] the same, rest 0
                 int* __restrict__ n_real,         // [1]: n = sum of the counts
                 int T, int K, int S, int W, int epr, int slot_rows, int rank, int C) {
    extern __shared__ int smem[];
    const int NT = blockDim.x, tid = threadIdx.x, NB = W + 1;
    int* cnt = smem;                // [NB, NT]: column tid is this thread's, no bank conflicts
    int* scratch = cnt + NB * NT;   // [32]
    int* base = scratch + 32;       // [NB + 1]
    int* ccnt = base + NB + 1;      // [W, C]: entries per (destination, token chunk)
    for (int b = 0; b < NB; ++b) cnt[b * NT + tid] = 0;
    for (int i = tid; i < W * C; i += NT) ccnt[i] = 0;
    // pass 0, coalesced: each id is read once, by consecutive threads (a warp reads 32
    // consecutive tokens), and what the passes below need is parked in inv (which pass 2
    // overwrites, each entry by the thread that reads it): token rows, the destination
    // mask of t in inv[t S]; slot rows, the bucket of e in inv[e]. (Walking the ids in
    // the passes' per-thread token runs instead cost ~40 us at T = 4096, K = 8: each thread
    // issued 2 x 32 dependent, uncoalesced loads.)
    if (slot_rows) {
#pragma unroll 4
        for (int e = tid; e < T * K; e += NT) inv[e] = slot_bucket(ids[e], W, epr);
    } else {
        const bool vec4 = (K & 3) == 0 && (reinterpret_cast<size_t>(ids) & 15) == 0;
#pragma unroll 2
        for (int t = tid; t < T; t += NT) {
            const int* ids_t = ids + (size_t)t * K;
            unsigned m = 0u;
            if (vec4) {
                for (int k = 0; k < K; k += 4) {
                    const uint4 v = *reinterpret_cast<const uint4*>(ids_t + k);  // 16 B
                    m |= rank_bit((int)v.x, W, epr) | rank_bit((int)v.y, W, epr) |
                         rank_bit((int)v.z, W, epr) | rank_bit((int)v.w, W, epr);
                }
            } else {
                m = token_mask(ids_t, K, W, epr);
            }
            inv[(size_t)t * S] = (int)m;
        }
    }
    __syncthreads();   // (also orders the global writes above before the reads below)
    const int per = (T + NT - 1) / NT;
    const int t0 = min(T, tid * per), t1 = min(T, t0 + per);
    // pass 1: counts per (bucket, thread)
    for (int t = t0; t < t1; ++t) {
        if (slot_rows) {
            for (int k = 0; k < K; ++k) cnt[inv[(size_t)t * S + k] * NT + tid] += 1;
        } else {
            unsigned m = (unsigned)inv[(size_t)t * S];
            cnt[W * NT + tid] += S - __popc(m);
            while (m) {
                cnt[(__ffs(m) - 1) * NT + tid] += 1;
                m &= m - 1u;
            }
        }
    }
    __syncthreads();
    // every bucket: exclusive scan over the threads; its total
    for (int b = 0; b < NB; ++b) {
        const int v = cnt[b * NT + tid];
        const int incl = block_inclusive_scan(v, scratch);
        cnt[b * NT + tid] = incl - v;
        if (tid == NT - 1) base[b] = incl;
    }
    __syncthreads();
    if (tid == 0) {
        int run = 0;
        for (int b = 0; b < NB; ++b) {
            const int c = base[b];
            base[b] = run;
            run += c;
        }
        base[NB] = run;
        *n_real = base[W];
    }
    __syncthreads();
    // pass 2: the same walk hands out the positions (and counts per token chunk: token t
    // is in chunk (t C) / T, so chunk c holds tokens [ceil(c T / C), ceil((c + 1) T / C)))
    for (int t = t0; t < t1; ++t) {
        const int chunk = (int)(((long long)t * C) / T);
        if (slot_rows) {
            for (int k = 0; k < K; ++k) {
                const int b = inv[(size_t)t * S + k];   // pass 0's bucket, then overwritten
                const int pos = base[b] + cnt[b * NT + tid]++;
                const int e = t * S + k;
                inv[e] = pos;
                src[pos] = e;
                if (C > 1 && b < W) atomicAdd(&ccnt[b * C + chunk], 1);
            }
        } else {
            unsigned m = (unsigned)inv[(size_t)t * S];  // read before j = 0 overwrites it
            for (int j = 0; j < S; ++j) {
                const int b = m ? __ffs(m) - 1 : W;
                if (m) m &= m - 1u;
                const int pos = base[b] + cnt[b * NT + tid]++;
                const int e = t * S + j;
                inv[e] = pos;
                src[pos] = e;
                if (C > 1 && b < W) atomicAdd(&ccnt[b * C + chunk], 1);
            }
        }
    }
    // one chunk: the counts are the bucket sizes of the scan. (The atomics above all hit W
    // shared words: at T = 4096, K = 8, W = 2 that is 8192 atomics on two addresses, which
    // serialise; they are only needed to split the counts by token chunk.)
    if (C == 1)
        for (int p = tid; p < W; p += NT) ccnt[p] = base[p + 1] - base[p];
    __syncthreads();
    for (int i = tid; i < W * C; i += NT) {
        const int p = i / C;
        counts2[i] = ccnt[i];
        counts2[W * C + i] = p == rank ? ccnt[i] : 0;   // what this rank "receives" from itself
    }
}

// ============================================================================ gather
template <typename V>
__global__ void __launch_bounds__(GATHER_THREADS)
ep_gather_kernel(const V* __restrict__ x,            // [T, row_words]
                 const int* __restrict__ ids,        // [T, K]
                 const float* __restrict__ w,        // [T, K] or null
                 const int* __restrict__ inv,        // [T S]
                 const int* __restrict__ n_real,     // [1]
                 V* __restrict__ x_send,             // [T S, row_words] (rows < n written)
                 int* __restrict__ ids_send,         // token: [T S, K]; slot: [T S]
                 float* __restrict__ w_send,         // token: [T S, K]; slot: [T S]; or null
                 int T, int K, int S, int epr, int slot_rows, int row_words) {
    __shared__ int pos_s[MAX_S];
    const int t = blockIdx.x;
    if (t >= T) return;
    const int n = *n_real;
    if (threadIdx.x < S) pos_s[threadIdx.x] = inv[(size_t)t * S + threadIdx.x];
    __syncthreads();
    const V* row = x + (size_t)t * row_words;
    for (int c = threadIdx.x; c < row_words; c += blockDim.x) {
        const V v = row[c];
        for (int j = 0; j < S; ++j) {
            const int p = pos_s[j];
            if (p < n) x_send[(size_t)p * row_words + c] = v;
        }
    }
    if (slot_rows) {
        const int k = threadIdx.x;
        if (k < S) {
            const int p = pos_s[k];
            if (p < n) {
                ids_send[p] = ids[(size_t)t * K + k] % epr;   // sent only when in range: >= 0
                if (w != nullptr) w_send[p] = w[(size_t)t * K + k];
            }
        }
    } else {
        for (int i = threadIdx.x; i < S * K; i += blockDim.x) {
            const int j = i / K, k = i - j * K;
            const int p = pos_s[j];
            if (p < n) {
                ids_send[(size_t)p * K + k] = ids[(size_t)t * K + k];
                if (w != nullptr) w_send[(size_t)p * K + k] = w[(size_t)t * K + k];
            }
        }
    }
}

// ============================================================================ combine
template <int VEC>
__global__ void __launch_bounds__(COMBINE_THREADS)
ep_combine_kernel(const SCALAR_T* __restrict__ y,      // [n, H] rows in send order
                  const float* __restrict__ w,         // [T, S] or null (weights 1)
                  const int* __restrict__ inv,         // [T S]
                  SCALAR_T* __restrict__ out,          // [T, H] (rows t_begin .. T - 1)
                  int t_begin, int T, int S, int H, int n, int chunks) {
    const int t = t_begin + blockIdx.x / chunks;
    const int col = ((blockIdx.x % chunks) * blockDim.x + threadIdx.x) * VEC;
    if (t >= T || col >= H) return;  // H % VEC == 0 on this path (ep_layout.py)
    float acc[VEC] = {};
    for (int s = 0; s < S; ++s) {
        const int r = inv[(size_t)t * S + s];
        if (r >= n) continue;   // "nowhere": never sent, adds nothing
        const float ws = w != nullptr ? w[(size_t)t * S + s] : 1.0f;
        add_f32(acc, ws, load<VEC>(y + (size_t)r * H + col));
    }
    Pack<SCALAR_T, VEC> o;                          // rounded once
#pragma unroll
    for (int j = 0; j < VEC; ++j) from_f32(acc[j], &o.v[j]);
    store<VEC>(out + (size_t)t * H + col, o);
}

// ============================================================================ EPLB load
extern "C" __global__ void __launch_bounds__(COUNT_THREADS)
ep_count_experts_kernel(const int* __restrict__ ids,          // [N] expert ids
                        unsigned long long* __restrict__ counts,  // [E], accumulated into
                        int N, int E) {
    extern __shared__ unsigned int hist[];   // [E]
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0u;
    __syncthreads();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < N; i += gridDim.x * blockDim.x) {
        const int e = ids[i];
        if (e >= 0 && e < E) atomicAdd(&hist[e], 1u);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        if (hist[e]) atomicAdd(&counts[e], (unsigned long long)hist[e]);
}
