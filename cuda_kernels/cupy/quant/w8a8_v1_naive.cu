// w8a8_v1_naive.cu: rung 1 of the w8a8 (fp8 / int8) grouped GEMM: one thread per output.
//
//   c[s] = (deq(a)[s / top_k] @ deq(w[e]).T + bias[e]) * (topk_weights[s] if mul_routed_weight)
//
// for every live position p of sorted_token_ids (slot s = sorted_token_ids[p] < P, e =
// expert_ids[p / block_size], p < num_tokens_post_padded); e == -1 writes zeros. fp32
// accumulation, one rounding to the 16-bit output type (reference/quant.py grouped_gemm_quant).
//
// Shapes: P = slots, N = output width, Kdim = reduction width, E = local experts,
// KB = cdiv(Kdim, 128), NB = cdiv(N, 128).
//   a [M_a, Kdim] fp8 e4m3 bytes / int8    a_scale [1] | [M_a] | [M_a, KB]     fp32, kind 0 / 1 / 2
//   w [E, N, Kdim] fp8 e4m3 bytes / int8   w_scale [E] | [E, N] | [E, NB, KB]  fp32, kind 0 / 1 / 2
//   c [P, N] elem_t, bias [E, N] fp32 or null, topk_weights [P] fp32.
// Block-scaled ("DeepSeek-V3", both kinds 2): each 128-wide K block's partial sum is scaled by
// a_scale[row, kb] * w_scale[e, n / 128, kb] and added to the fp32 accumulator. Per-tensor /
// per-token / per-channel scales multiply once at the end.
//
// The lesson: the math and nothing else. Each thread walks Kdim for one (slot, n): fp8 codes
// are widened to fp32 and multiplied, int8 codes are multiplied exactly in int32 (|sum| of a
// 128-wide block <= 128^3), and the scales are applied per 128-wide K block (block scaling) or
// once at the end. The reference for every faster rung, and the fallback for problems they do
// not take (fp8 below sm_89, Kdim % 16 != 0, unaligned rows, block_size % 16 != 0).
//
// Launch: grid (Lg, cdiv(N, 128)), block 128, no shared memory.
// Lg = min(L, P * block_size) positions (no live position lies past it: num_tokens_post_padded
// <= P * block_size).
// Run: python -m cuda_kernels.cupy.quant.w8a8 [--quick]
#include "common.cuh"

// One thread per output element; codes widened to fp32 (fp8) or multiplied exactly in int32.
// a_scale_kind: 0 per-tensor a_scale[0], 1 per-token a_scale[row], 2 per-group a_scale[row*KB+kb]
// w_scale_kind: 0 per-expert w_scale[e], 1 per-channel w_scale[e*N+n], 2 per-block
// (the two kinds are 2 together: DeepSeek-V3 blocks)
template <int QT>
__global__ void __launch_bounds__(128)
w8a8_v1_naive(QG_W8A8_ARGS) {
    int s, n, e;                      // this thread's slot, column and expert
    if (!qg_naive_element(c, sorted_token_ids, expert_ids, num_tokens_post_padded, N, num_slots,
                          block_size, num_positions, s, n, e))
        return;
    const int row = s / top_k;
    const int KB = (Kdim + QG_KBLOCK - 1) / QG_KBLOCK;
    const int NB = (N + QG_KBLOCK - 1) / QG_KBLOCK;
    const u8* ar = a + (long long)row * Kdim;
    const u8* wr = w + ((long long)e * N + n) * Kdim;
    float acc = 0.f;
    for (int kb = 0; kb < KB; ++kb) {
        const int k1 = min((kb + 1) * QG_KBLOCK, Kdim);
        float part;
        if (QT == QG_FP8) {
            part = 0.f;
            for (int k = kb * QG_KBLOCK; k < k1; ++k)
                part += qg_fp8_to_f32(ar[k]) * qg_fp8_to_f32(wr[k]);
        } else {
            int ip = 0;   // |ip| <= 128 * 128 * 128: exact
            for (int k = kb * QG_KBLOCK; k < k1; ++k)
                ip += (int)(signed char)ar[k] * (int)(signed char)wr[k];
            part = (float)ip;
        }
        if (a_scale_kind == 2)
            part *= a_scale[(long long)row * KB + kb] *
                    w_scale[((long long)e * NB + n / QG_KBLOCK) * KB + kb];
        acc += part;
    }
    if (a_scale_kind != 2) {
        const float sa = a_scale_kind == 0 ? a_scale[0] : a_scale[row];
        const float sw = w_scale_kind == 0 ? w_scale[e] : w_scale[(long long)e * N + n];
        acc *= sa * sw;
    }
    qg_store(c + (long long)s * N + n,
             qg_epilogue(acc, e, n, s, N, bias, topk_weights, mul_routed_weight));
}
