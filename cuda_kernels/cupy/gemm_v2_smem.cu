// gemm_v2_smem.cu: rung 2 of the grouped GEMM ladder: shared-memory tiles, one output per thread.
//
// Math: as every rung (docs/stages.md, grouped_gemm):
//     c[s, n] = (sum_k a[s / top_k, k] * w[e, n, k] + bias[e, n]) * topk_weights.flat[s]
// for each live position p (slot s = sorted_token_ids[p] < P, expert e = expert_ids[p / B]),
// fp32 accumulation, rounded once to GG_T; e == -1 writes zeros.
// Shapes: a [M_a, Kdim], w [E_local, N, Kdim], c [P, N], P = M_a * top_k.
//
// Launch geometry (a CTA owns a BLOCK_M x BLOCK_N tile of c; BLOCK_M divides B, so the tile
// lies inside one alignment block and has one expert):
//     block = (BLOCK_N, BLOCK_M)       thread (tx, ty) owns c[row ty of the tile, n0 + tx]
//     grid  = (cdiv(L, BLOCK_M), cdiv(N, BLOCK_N))
//     shared memory (static) = 4 * (BLOCK_M * BLOCK_K + BLOCK_N * (BLOCK_K + 1)) + 4 * BLOCK_M
// Each step of BLOCK_K stages the tile's gathered a rows and its w rows in shared memory as
// fp32 (coalesced: consecutive threads read consecutive k), then every thread runs a
// BLOCK_K-long dot product out of shared memory. Every a element is read from global memory
// once per CTA instead of once per output column, every w element once instead of once per row.
//
// Versions of the ladder:
//     v1  gemm_v1_naive.cu     one thread per output element
//     v2  gemm_v2_smem.cu      shared-memory tiles of a and w, one output per thread   <- this file
//     v3  gemm_v3_regblock.cu  register blocking (TM x TN per thread), 16-byte loads
//     v4  gemm_v4_mma.cu       tensor cores: mma.sync m16n8k16, ldmatrix, cp.async pipeline
//     v5  gemm_v5_wgmma.cu     (stretch, opt-in) Hopper wgmma from shared-memory descriptors
// Run:  python -m cuda_kernels.cupy.gemm --versions v2
#include "gemm_common.cuh"

// The tile and its tunables, #defined by the launcher from gemm_configs.json.
#if !defined(BLOCK_M) || !defined(BLOCK_N) || !defined(BLOCK_K)
#error "v2: the launcher #defines the tile (gemm_configs.kernel_defines)"
#endif

#define V2_THREADS (BLOCK_M * BLOCK_N)

static_assert(V2_THREADS <= 1024, "v2: BLOCK_M * BLOCK_N threads must fit in one CTA");

extern "C" __global__ void __launch_bounds__(V2_THREADS)
grouped_gemm_v2(GG_KERNEL_ARGS) {
    __shared__ float As[BLOCK_M][BLOCK_K];      // a row ty is read by all tx: a broadcast
    __shared__ float Ws[BLOCK_N][BLOCK_K + 1];  // +1: lanes tx, tx+1 read words BLOCK_K+1 apart,
                                                // 32 distinct banks
    __shared__ int s_slot[BLOCK_M];

    const int tx = threadIdx.x, ty = threadIdx.y;
    const int tid = ty * BLOCK_N + tx;
    const int m0 = blockIdx.x * BLOCK_M;
    const int n0 = blockIdx.y * BLOCK_N;
    if (m0 >= __ldg(num_tokens_post_padded)) return;      // the whole CTA leaves together
    const int e = expert_ids[m0 / block_size];
    gg_load_slots<BLOCK_M, V2_THREADS>(s_slot, sorted_token_ids, m0, num_positions, num_slots, tid);
    __syncthreads();

    const int s = s_slot[ty];
    const int n = n0 + tx;
    const bool mine = gg_live(s, num_slots) && n < N;
    if (e < 0) {                                          // expert not on this rank: zeros
        if (mine) c[(long long)s * N + n] = gg_from_f32<GG_T>(0.0f);
        return;
    }

    const GG_T* w_e = w + (long long)e * N * Kdim;
    float acc = 0.0f;
    for (int k0 = 0; k0 < Kdim; k0 += BLOCK_K) {
        // consecutive tids read consecutive k of one row: coalesced
        for (int i = tid; i < BLOCK_M * BLOCK_K; i += V2_THREADS) {
            const int r = i / BLOCK_K, kk = i % BLOCK_K, k = k0 + kk;
            const int sr = s_slot[r];
            As[r][kk] = (gg_live(sr, num_slots) && k < Kdim)
                            ? gg_to_f32(a[(long long)(sr / top_k) * Kdim + k]) : 0.0f;
        }
        for (int i = tid; i < BLOCK_N * BLOCK_K; i += V2_THREADS) {
            const int r = i / BLOCK_K, kk = i % BLOCK_K, k = k0 + kk;
            Ws[r][kk] = (n0 + r < N && k < Kdim)
                            ? gg_to_f32(w_e[(long long)(n0 + r) * Kdim + k]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BLOCK_K; ++kk) acc += As[ty][kk] * Ws[tx][kk];
        __syncthreads();                                  // before the next step overwrites
    }
    if (mine) {
        const float out = gg_epilogue(acc, e, n, s, N, bias, bias_kind, topk_weights,
                                      mul_routed_weight);
        c[(long long)s * N + n] = gg_from_f32<GG_T>(out);
    }
}
