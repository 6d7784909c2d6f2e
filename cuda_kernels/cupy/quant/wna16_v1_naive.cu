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
wna16_v1_naive(const elem_t* __restrict__ a, const u8* __restrict__ w, elem_t* __restrict__ c,
               const float* __restrict__ w_scale, const u8* __restrict__ w_zp,
               const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
               const int* __restrict__ num_tokens_post_padded,
               const float* __restrict__ topk_weights, const float* __restrict__ bias,
               int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,
               int mul_routed_weight, int group_size, int num_groups, int default_zp,
               int code_xor) {
    const int p = blockIdx.x;
    if (p >= num_tokens_post_padded[0] || p >= num_positions) return;
    const int s = sorted_token_ids[p];
    if (!qg_live(s, num_slots)) return;
    const int n = blockIdx.y * 128 + threadIdx.x;
    if (n >= N) return;
    const int e = expert_ids[p / block_size];
    if (e < 0) {
        qg_store(c + (long long)s * N + n, 0.f);
        return;
    }
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
