// experts_decode.cu: the expert part of a MoE layer for a decode step, in one launch.
//
// Shapes: T tokens (a decode batch: experts_decode.py's MAX_TOKENS), K top-k, P = T * K slots
//   (s = t * K + k), E experts, H hidden, I intermediate; x [T, H], w1 [E, 2I, H] (gate rows,
//   then up rows), w2 [E, H, I], topk_weights / topk_ids [T, K], out [T, H]; scratch c2 [P, I].
//
// Math (the five stages of experts.py, the same roundings; docs/stages.md):
//   phase 1, GEMM1 + activation, for each live slot s (0 <= e = ids[s] < E) and j < I:
//       g = round(w1[e, j] . x[t]),  u = round(w1[e, I + j] . x[t])          (GEMM1's c1)
//       c2[s, j] = round(round(act(g)) * u)                                  (act_and_mul)
//   grid barrier
//   phase 2, GEMM2 + router weight + combine, for each h < H:
//       c3[s, h] = round((w2[e, h] . c2[s]) * topk_weights[s])  (live slots; dead ones add 0)
//       out[t, h] = round(sum_{k in order} c3[t K + k, h])                   (fp32, moe_sum)
//   Dot products in fp32 (fma, each lane's share in k order, then a warp's butterfly sum):
//   not the tensor cores' order, so the output matches the stages to bf16 rounding, not bit
//   for bit.
//
// Why one launch. A decode step reads each routed expert's weights once and does little else
// (T = 1: one row per expert; Qwen3-30B-A3B's 8 experts are 75 MB, 22 us at 3.35 TB/s). Run
// as five kernels, the step also pays five launch-to-drain gaps, the alignment (which only
// groups rows for tiles the decode step does not need) and two GEMM ramps, each with SMs idle
// while the last tiles of a GEMM drain. Here every SM streams weights from the first
// microsecond to the last:
//   - no alignment: with one row per expert, a slot is its own tile;
//   - the activation happens where GEMM1's two dot products end, in registers;
//   - GEMM2's weights do not depend on GEMM1: each block starts pulling the first PREFETCH
//     bytes of its phase-2 rows into L2 (cp.async.bulk.prefetch) at once, so the reads after
//     the barrier start from L2 while HBM streams the rest;
//   - the combine is phase 2's epilogue: a block owns whole output rows h, all K slots.
// The tensor cores have no part: at one row per expert a weight is used once, an fma per
// element (2 per 16-byte load of 8), far below what the SM issues.
//
// Launch geometry (experts_decode.py): one block per SM (G = #SMs), DEC_THREADS threads
//   (W = DEC_THREADS / 32 warps; 1024 as shipped), cooperative (the grid barrier needs every
//   block resident).
//   phase 1: the P * I (slot, j) rows are split in G contiguous ranges; warp w of a block takes
//     rows w, w + W, ...; each lane loads 16 bytes of the gate row and of the up row per
//     step, U1 steps in flight (2 U1 16-byte loads, L1 bypassed: each byte is read once).
//   phase 2: block b owns rows [b H / G, (b + 1) H / G) of out; its (row, slot) pairs are split
//     over the warps, PAIRS pairs per warp at once (short rows, like Qwen3's I = 768, need
//     several rows' loads in flight), U2 steps of 16 bytes per pair.
//   shared memory: c2 [P, I] (staged once after the barrier: every pair of the block reads its
//     slot's row), ids [P], weights [P], the pairs' c3 [rows, P] fp32.
// What the card allows (H100 SXM, one call): a plain read of the 705 MB that Mixtral-8x7B and
//   DeepSeek-V3 route at T = 1, in this load style, took 258-261 us (2.83-2.87 TB/s, 512 or
//   1024 threads, 4 to 16 loads in flight); this kernel's whole layer took 261-268 us.
//   Rung 2 (experts_decode_ring.cu) brings the weights in by bulk copies and balances phase
//   1 across the SMs: faster where a block has megabytes to read, slower where it has less.
//
// Requirements (experts_decode.py checks them): H % 8 == 0 and I % 8 == 0 (16-byte loads), x,
//   w1, w2, c2 16-byte aligned; __half or __nv_bfloat16; no expert map, no biases.
// Compile-time parameters: SCALAR_T, DEC_THREADS, U1, U2, PREFETCH (bytes per block);
//   templates ACT (0 silu, 1 gelu, 2 gelu_tanh), PAIRS.
// Versions: rung 1 (this file); rung 2: experts_decode_ring.cu (experts_decode.py picks one).
// The staged path they replace at decode: experts.py.

// to_f32, from_f32, Pack, act<ACT>, round_to<T>
#include "elementwise.cuh"
// grid_barrier
#include "grid_barrier.cuh"

#ifndef SCALAR_T
#define SCALAR_T __nv_bfloat16
#endif
#ifndef DEC_THREADS
#define DEC_THREADS 1024
#endif
#ifndef U1
#define U1 4
#endif
#ifndef U2
#define U2 4
#endif
#ifndef PREFETCH
#define PREFETCH 65536
#endif
#define DEC_WARPS (DEC_THREADS / 32)

// dot8, warp_sum, combine_rows (one order of sums for both rungs)
#include "decode_dot.cuh"

#ifndef GG_HOST_EMULATION   // (tests/emulator/kernels.h has the CPU's version)
// 16 bytes of weights, read once: no L1 allocation (the L1 keeps x's rows, read by every warp)
__device__ __forceinline__ uint4 ld_weights(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
#endif

// Pull [p, p + bytes) into L2 without waiting (sm_90's bulk prefetch; a hint: none before)
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (bytes >= 16)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                     :: "l"(p), "r"(bytes & ~15u) : "memory");
#endif
}

// The first `bytes` of this block's phase-2 weights of each live slot (rows [h0, h1) of w2[e]
// are contiguous: one prefetch per slot), issued by one thread per slot.
__device__ __forceinline__ void prefetch_phase2(const SCALAR_T* w2, const int* ids_s, int P,
                                                int E, int H, int I, int h0, int h1,
                                                long long bytes) {
    const int s = threadIdx.x;
    if (s >= P || h1 <= h0) return;
    const int e = ids_s[s];
    if (e < 0 || e >= E) return;
    const long long rows_bytes = (long long)(h1 - h0) * I * sizeof(SCALAR_T);
    // whole 16-byte steps (I % 8 == 0: the rows start on 16-byte boundaries)
    bytes = (bytes < rows_bytes ? bytes : rows_bytes) & ~15ll;
    prefetch_l2(w2 + ((long long)e * H + h0) * I, (unsigned)bytes);
}

template <int ACT, int PAIRS>
__global__ void __launch_bounds__(DEC_THREADS, 1)
moe_decode_kernel(const SCALAR_T* __restrict__ x,        // [T, H]
                  const SCALAR_T* __restrict__ w1,       // [E, 2I, H]
                  const SCALAR_T* __restrict__ w2,       // [E, H, I]
                  const float* __restrict__ topk_weights,  // [T, K]
                  const int* __restrict__ topk_ids,      // [T, K]
                  SCALAR_T* c2,                          // [P, I] scratch (written, then read)
                  SCALAR_T* __restrict__ out,            // [T, H]
                  unsigned int* bar,                     // the grid barrier's word
                  unsigned int* chunks,                  // unused: rung 2's chunk counter
                  int T, int K, int E, int H, int I) {
    extern __shared__ __align__(16) unsigned char dec_smem[];
    const int P = T * K;
    SCALAR_T* c2_s = reinterpret_cast<SCALAR_T*>(dec_smem);                      // [P, I]
    int* ids_s = reinterpret_cast<int*>(dec_smem + (size_t)P * I * sizeof(SCALAR_T));  // [P]
    float* tw_s = reinterpret_cast<float*>(ids_s + P);                                 // [P]
    float* c3_s = tw_s + P;                                 // [rows, P], rows <= cdiv(H, G)
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int G = gridDim.x, b = blockIdx.x;

    for (int s = tid; s < P; s += DEC_THREADS) {
        ids_s[s] = topk_ids[s];
        tw_s[s] = topk_weights[s];
    }
    __syncthreads();
    const int h0 = (int)((long long)H * b / G), h1 = (int)((long long)H * (b + 1) / G);
    prefetch_phase2(w2, ids_s, P, E, H, I, h0, h1, PREFETCH / (P > 0 ? P : 1));

    // ------------------------------------------------------------ phase 1: GEMM1 + activation
    const int h_chunks = H / 8, i_chunks = I / 8;
    const long long rows1 = (long long)P * I;
    const long long r_begin = rows1 * b / G, r_end = rows1 * (b + 1) / G;
    for (long long r = r_begin + warp; r < r_end; r += DEC_WARPS) {
        const int s = (int)(r / I), j = (int)(r % I);
        const int e = ids_s[s];
        if (e < 0 || e >= E) continue;                 // a dead slot: phase 2 skips it
        const uint4* gate = reinterpret_cast<const uint4*>(w1 + ((long long)e * 2 * I + j) * H);
        const uint4* up = gate + (long long)I * h_chunks;
        const uint4* xr = reinterpret_cast<const uint4*>(x + (long long)(s / K) * H);
        float g = 0.0f, u = 0.0f;
        for (int c0 = lane; c0 < h_chunks; c0 += 32 * U1) {
            uint4 wg[U1], wu[U1];
#pragma unroll
            for (int i = 0; i < U1; ++i) {             // every load first: 2 U1 in flight
                const int c = c0 + 32 * i;
                if (c < h_chunks) {
                    wg[i] = ld_weights(gate + c);
                    wu[i] = ld_weights(up + c);
                }
            }
#pragma unroll
            for (int i = 0; i < U1; ++i) {
                const int c = c0 + 32 * i;
                if (c < h_chunks) {
                    const uint4 xv = __ldg(xr + c);
                    g = dot8(g, wg[i], xv);
                    u = dot8(u, wu[i], xv);
                }
            }
        }
        g = warp_sum(g);
        u = warp_sum(u);
        if (lane == 0)
            from_f32(round_to<SCALAR_T>(act<ACT>(round_to<SCALAR_T>(g))) *
                         round_to<SCALAR_T>(u),
                     &c2[(long long)s * I + j]);
    }
    grid_barrier(bar);

    // ------------------------------------------------------------ phase 2: GEMM2 + combine
    {   // c2 into shared memory, through L2 (.cg: written by other blocks in this launch)
        const uint4* src = reinterpret_cast<const uint4*>(c2);
        uint4* dst = reinterpret_cast<uint4*>(c2_s);
        for (int c = tid; c < P * i_chunks; c += DEC_THREADS) dst[c] = __ldcg(src + c);
    }
    __syncthreads();
    const int rows = h1 - h0, pairs = rows * P;
    for (int q0 = warp * PAIRS; q0 < pairs; q0 += DEC_WARPS * PAIRS) {
        const uint4* wrow[PAIRS];
        const uint4* crow[PAIRS];
        bool live[PAIRS];
        float acc[PAIRS];
#pragma unroll
        for (int i = 0; i < PAIRS; ++i) {             // pair q: row h0 + q / P, slot q % P
            const int q = q0 + i, s = q % P;
            const int e = q < pairs ? ids_s[s] : -1;
            live[i] = e >= 0 && e < E;
            wrow[i] = reinterpret_cast<const uint4*>(
                w2 + ((long long)(live[i] ? e : 0) * H + h0 + q / P) * I);
            crow[i] = reinterpret_cast<const uint4*>(c2_s + (long long)s * I);
            acc[i] = 0.0f;
        }
        for (int c0 = lane; c0 < i_chunks; c0 += 32 * U2) {
            uint4 wv[PAIRS][U2];
#pragma unroll
            for (int i = 0; i < PAIRS; ++i)
#pragma unroll
                for (int k = 0; k < U2; ++k)
                    if (live[i] && c0 + 32 * k < i_chunks)
                        wv[i][k] = ld_weights(wrow[i] + c0 + 32 * k);
#pragma unroll
            for (int i = 0; i < PAIRS; ++i)
#pragma unroll
                for (int k = 0; k < U2; ++k)
                    if (live[i] && c0 + 32 * k < i_chunks)
                        acc[i] = dot8(acc[i], wv[i][k], crow[i][c0 + 32 * k]);
        }
#pragma unroll
        for (int i = 0; i < PAIRS; ++i) {
            const float v = warp_sum(acc[i]);
            const int q = q0 + i;
            // GEMM2's epilogue: (acc + bias 0) * weight, rounded once
            if (lane == 0 && q < pairs)
                c3_s[q] = live[i] ? round_to<SCALAR_T>((v + 0.0f) * tw_s[q % P]) : 0.0f;
        }
    }
    __syncthreads();
    // the combine: each token's K slots in order
    combine_rows(c3_s, out, h0, rows, T, K, H, tid, DEC_THREADS);
}
