// wna16_v1_naive.cu: rung 1 of the weight-only (int4 / int8 weights, bf16 / fp16
// activations) grouped GEMM: dequantize, then multiply, one thread per output.
//
//   c[s, n] = (sum_k a[s / top_k, k] (q[e, n, k] - zp[e, n, k / gs]) s[e, n, k / gs] + bias[e, n])
//             * (topk_weights[s] if mul_routed_weight)
//
// for every live position p of sorted_token_ids (slot s = sorted_token_ids[p] < P, e =
// expert_ids[p / block_size], p < num_tokens_post_padded); e == -1 writes zeros. fp32
// accumulation, one rounding to elem_t (reference/quant.py grouped_gemm_quant).
// Shapes: P = slots, N = output width, Kdim = reduction width, E = local experts,
// G = groups per row (group_size = Kdim / G).
//   a [M_a, Kdim] elem_t (bf16 / fp16)   w int4: [E, N, Kdim/2] bytes, k = 2j in the low nibble
//   of byte j; int8: [E, N, Kdim] bytes. w_scale [E, N, G] fp32, w_zp [E, N, G] uint8 or null
//   (then default_zp); code_xor = 0x80 reads int8 (signed) codes as uint8 codes with zero point
//   128. c [P, N] elem_t, bias [E, N] fp32 or null, topk_weights [P] fp32.
//
// The lesson: the math of the format. Each thread walks Kdim for one (slot, n), unpacks each
// code (the low nibble holds the even k), subtracts its group's zero point and multiplies by
// its scale in fp32, then by the activation. Any group size, any Kdim: the fallback for
// problems no faster rung takes, and the reference the others are checked against.
//
// wna16_v1_naive<NBITS> (4 or 8)
// Launch: grid (Lg, cdiv(N, 128)), block 128, no shared memory.
// Lg = min(L, P * block_size) positions (no live position lies past it: num_tokens_post_padded
// <= P * block_size).
// Run: python -m cuda_kernels.cupy.quant.wna16 [--quick]
#include "common.cuh"

template <int NBITS>
__device__ __forceinline__ int qg_code(const u8* __restrict__ wr, int k, int code_xor) {
    if (NBITS == 4) {
        const u8 b = wr[k >> 1];
        return (k & 1) ? (b >> 4) : (b & 0xF);
    }
    return wr[k] ^ code_xor;
}

template <int NBITS>
__global__ void __launch_bounds__(128)
wna16_v1_naive(QG_WNA16_ARGS) {
    int s, n, e;                      // this thread's slot, column and expert
    if (!qg_naive_element(c, sorted_token_ids, expert_ids, num_tokens_post_padded, N, num_slots,
                          block_size, num_positions, s, n, e))
        return;
    const elem_t* ar = a + (long long)(s / top_k) * Kdim;
    const long long wrow = (long long)e * N + n;
    const u8* wr = w + wrow * (NBITS == 4 ? Kdim / 2 : Kdim);
    const float* sr = w_scale + wrow * num_groups;
    const u8* zr = w_zp != nullptr ? w_zp + wrow * num_groups : nullptr;
    float acc = 0.f;
    for (int k = 0; k < Kdim; ++k) {
        const int gi = k / group_size;
        const int zp = zr != nullptr ? (int)zr[gi] : default_zp;
        const float wv = (float)(qg_code<NBITS>(wr, k, code_xor) - zp) * sr[gi];
        acc += qg_to_f32(ar[k]) * wv;
    }
    qg_store(c + (long long)s * N + n,
             qg_epilogue(acc, e, n, s, N, bias, topk_weights, mul_routed_weight));
}
