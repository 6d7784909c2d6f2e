// gemm_v1_naive.cu: rung 1 of the grouped GEMM ladder: one thread per output element.
//
// Math (docs/stages.md, grouped_gemm): for every position p < num_tokens_post_padded with
// slot s = sorted_token_ids[p] < P and expert e = expert_ids[p / B]:
//     c[s, n] = (sum_k a[s / top_k, k] * w[e, n, k] + bias[e, n]) * topk_weights.flat[s]
// in fp32 (bias and the weight optional), rounded once to GG_T; e == -1 gives c[s, :] = 0.
// Shapes: a [M_a, Kdim], w [E_local, N, Kdim], c [P, N], P = M_a * top_k,
//         sorted_token_ids [L], expert_ids [L / B], num_tokens_post_padded [1].
//
// Launch geometry:
//     block = (BLOCK_N, ROWS)          threadIdx.x walks n, threadIdx.y walks positions
//     grid  = (cdiv(L, ROWS), cdiv(N, BLOCK_N))
//     shared memory: none
// The gather is fused (the a row comes straight from sorted_token_ids), but nothing is
// reused: every thread streams its own w row along Kdim, and the 32 threads of a warp read
// 32 different w rows (Kdim apart), so each load instruction touches 32 sectors. It is the
// correctness baseline of the ladder, and slow on purpose.
//
// Versions of the ladder (cuda_kernels/cupy/gemm.py picks one by name):
//     v1  gemm_v1_naive.cu     one thread per output element                    <- this file
//     v2  gemm_v2_smem.cu      shared-memory tiles of a and w, one output per thread
//     v3  gemm_v3_regblock.cu  register blocking (TM x TN per thread), 16-byte loads
//     v4  gemm_v4_mma.cu       tensor cores: mma.sync m16n8k16, ldmatrix, cp.async pipeline
//     v5  gemm_v5_wgmma.cu     (stretch, opt-in) Hopper wgmma from shared-memory descriptors
// Run:  python -m cuda_kernels.cupy.gemm --versions v1   (validates, then times)
#include "gemm_common.cuh"

// The tile and its tunables, #defined by the launcher from gemm_configs.json.
#if !defined(BLOCK_N) || !defined(ROWS)
#error "v1: the launcher #defines the tile (gemm_configs.kernel_defines)"
#endif

extern "C" __global__ void __launch_bounds__(BLOCK_N * ROWS)
grouped_gemm_v1(GG_KERNEL_ARGS) {
    const int p = blockIdx.x * ROWS + threadIdx.y;        // position in sorted_token_ids
    const int n = blockIdx.y * BLOCK_N + threadIdx.x;     // output column
    if (p >= num_positions || n >= N) return;
    if (p >= __ldg(num_tokens_post_padded)) return;       // a block past the live ones
    const int s = sorted_token_ids[p];
    if (!gg_live(s, num_slots)) return;                   // padding
    const int e = expert_ids[p / block_size];
    float out = 0.0f;                                     // e == -1: the row is zero
    if (e >= 0) {
        const GG_T* a_row = a + (long long)(s / top_k) * Kdim;
        const GG_T* w_row = w + ((long long)e * N + n) * Kdim;
        float acc = 0.0f;
        for (int k = 0; k < Kdim; ++k) acc += gg_to_f32(a_row[k]) * gg_to_f32(w_row[k]);
        out = gg_epilogue(acc, e, n, s, N, bias, bias_kind, topk_weights, mul_routed_weight);
    }
    c[(long long)s * N + n] = gg_from_f32<GG_T>(out);
}
