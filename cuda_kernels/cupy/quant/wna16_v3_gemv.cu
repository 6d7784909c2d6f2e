// wna16_v3_gemv.cu: rung 3 of the weight-only grouped GEMM: decode, the weights streamed
// straight into registers as the mma's A operand (int4).
//
//   c[s, n] = (sum_k a[s / top_k, k] (q[e, n, k] - zp[e, n, k / gs]) s[e, n, k / gs] + bias[e, n])
//             * (topk_weights[s] if mul_routed_weight)      (as wna16_v1_naive.cu)
//
// Shapes: P = slots, N = output width, Kdim = reduction width, E = local experts,
// G = groups per row (group_size = Kdim / G).
//   a [M_a, Kdim] elem_t (bf16 / fp16)   w int4: [E, N, Kdim/2] bytes, k = 2j in the low nibble
//   of byte j; int8: [E, N, Kdim] bytes. w_scale [E, N, G] fp32, w_zp [E, N, G] uint8 or null
//   (then default_zp); code_xor = 0x80 reads int8 (signed) codes as uint8 codes with zero point
//   128. c [P, N] elem_t, bias [E, N] fp32 or null, topk_weights [P] fp32.
//
// The lesson: at a few rows per expert the GEMM is a read of the weights, so swap the roles
// (weights as A, 16 rows; tokens as B, 8 columns), load the weights into registers with no
// shared memory and no barrier, and keep several loads in flight per thread; the details are
// in the comment above the kernel. The router's fallback for decode batches that the prepacked
// rungs v4 / v5 do not take (N % 16 != 0, group sizes that are not 64 times a power of two).
//
// wna16_v3_gemv<MT, WARPS, U, MINB>
// Lg = min(L, P * block_size) positions (no live position lies past it: num_tokens_post_padded
// <= P * block_size).
// Run: python -m cuda_kernels.cupy.quant.wna16 [--quick]
#include "common.cuh"

// GEMV-style weight streaming for small batches (a few rows per expert): the job is to read
// the touched experts' packed int4 weights once, at HBM bandwidth, and nothing else.
//   * Roles swapped: weights are the mma's A operand (16 weight rows n = the M of m16n8k16),
//     the BM = 8 * MT activation rows of the block are its B operand (MT tiles of 8 tokens);
//     a tile with no live slot is skipped (warp-uniform).
//   * No shared-memory staging, no barrier in the main loop: each thread loads its weights
//     straight into registers, 16 bytes (32 int4 codes) per row and step, U steps of loads
//     issued back to back before any is used (U * 2 * 16 bytes in flight per thread).
//   * A CTA owns 16 rows n0..n0+15 of one expert; its WARPS warps split K (warp w takes the
//     128-wide K steps w, w + WARPS, ...) and add their partial sums in a fixed order through
//     shared memory at the end (deterministic).
//   * Dequantization in registers, two codes per instruction: (w >> 4i) & 0x000F000F |
//     0x43004300 is the bf16 pair (128 + q_lo, 128 + q_hi) (fp16: 0x6400, 1024 + q); minus
//     the pair (128 + zp, 128 + zp) gives q - zp exactly. The scale is applied per 128-K step
//     (group_size % 128 == 0) to the fp32 partial sum of that step: acc += part * s[n, g].
//   * The nibbles of one 32-bit word are k = 8j + i (i = 0..7); a pair holds k and k + 4. The
//     mma only needs A and B to agree on which k each of its 16 slots is (the sum runs over
//     all of them), so the activations are permuted to match: __byte_perm makes the pairs
//     (k, k + 4) out of the bf16 pairs (k, k + 1) loaded from memory.
// Thread (g = lane / 4, t = lane % 4) of a warp: in step c it reads bytes 64c + 16t .. +15 of
// weight rows n0 + g and n0 + g + 8 (k = 128c + 32t .. + 31) and the same 32 k of activation
// rows 8j + g of each tile j.
// grid (cdiv(Lg, BM), cdiv(N, 16)), block WARPS * 32, dynamic smem = WARPS * BM * 16 * 4 + BM * 8.
// Needs NBITS = 4, Kdim % 128 == 0, group_size % 128 == 0 (the launcher checks).
template <int MT, int WARPS, int U, int MINB>
__global__ void __launch_bounds__(WARPS * 32, MINB)   // MINB CTAs per SM: caps the registers
wna16_v3_gemv(QG_WNA16_ARGS) {
    constexpr int BM = 8 * MT;
    constexpr int NT = WARPS * 32;
    extern __shared__ __align__(16) u8 smem[];
    float* sRed = reinterpret_cast<float*>(smem);               // [WARPS][BM][16]
    int* sArow = reinterpret_cast<int*>(sRed + WARPS * BM * 16);  // [BM] a row, -1 padding
    int* sSlot = sArow + BM;                                    // [BM] slot s

    const int m0 = blockIdx.x * BM;
    if (m0 >= num_tokens_post_padded[0] || m0 >= num_positions) return;   // past the live blocks
    const int n0 = blockIdx.y * 16;
    const int e = expert_ids[m0 / block_size];                  // BM divides block_size
    const int tid = threadIdx.x;
    if (!qg_stage_m_tile<BM, 16, NT>(c, sSlot, sArow, sorted_token_ids, m0, n0, e, N,
                                     num_slots, top_k, num_positions, tid))
        return;                                   // padding only, or zeros
    const int warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int wrow = Kdim / 2;                                  // bytes of a weight row
    // 64-bit expert base once, 32-bit offsets inside it (launcher: N * wrow < 2^31). Rows past
    // N are clamped to N - 1: read, multiplied, never stored (no predicate in the loop).
    const u8* wexp = w + (long long)e * N * wrow;
    const int r0 = min(n0 + g, N - 1), r1 = min(n0 + g + 8, N - 1);
    const u8* w0 = wexp + r0 * wrow + 16 * t;
    const u8* w1 = wexp + r1 * wrow + 16 * t;
    const long long srow0 = ((long long)e * N + r0) * num_groups;
    const long long srow1 = ((long long)e * N + r1) * num_groups;
    // this thread's activation row in each tile (token column g of the mma's B), -1 = padding
    int arow[MT];
    bool tile_live[MT];
#pragma unroll
    for (int j = 0; j < MT; ++j) {
        arow[j] = sArow[8 * j + g];
        int any = 0;
#pragma unroll
        for (int r = 0; r < 8; ++r) any |= sArow[8 * j + r] >= 0;
        tile_live[j] = any;                                     // uniform over the CTA
    }

    float acc[MT][4] = {};

    const int KS = Kdim / 128;                                  // 128-wide K steps
    for (int c0 = warp; c0 < KS; c0 += WARPS * U) {
        // ---- U steps of weight loads in flight before the first is used
        u32 wq[U][2][4];
        float sc[U][2];
        u32 zo[U][2];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int cs = c0 + u * WARPS;
            if (cs < KS) {                                      // uniform over the warp
                qg_ld16_stream(wq[u][0], w0 + 64 * cs);
                qg_ld16_stream(wq[u][1], w1 + 64 * cs);
                const int gi = (cs * 128) / group_size;
                sc[u][0] = __ldg(w_scale + srow0 + gi);
                sc[u][1] = __ldg(w_scale + srow1 + gi);
                const u32 z0 = w_zp != nullptr ? (u32)__ldg(w_zp + srow0 + gi) : (u32)default_zp;
                const u32 z1 = w_zp != nullptr ? (u32)__ldg(w_zp + srow1 + gi) : (u32)default_zp;
                zo[u][0] = qg_magic_pair(z0);                    // (128 + zp) twice: exact
                zo[u][1] = qg_magic_pair(z1);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int cs = c0 + u * WARPS;
            if (cs < KS) {                                      // uniform over the warp
                float part[MT][4] = {};
                // word j of the 16 bytes: codes k = 128 cs + 32 t + 8 j + (0..7)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    // dequantize: q[h][i] = pair (k = 8j + i, 8j + i + 4) of row h, as q - zp
                    u32 q[2][4];
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int i = 0; i < 4; ++i)
                            q[h][i] = qg_sub2(((wq[u][h][j] >> (4 * i)) & 0x000F000Fu) | QG_MAGIC,
                                              zo[u][h]);
#pragma unroll
                    for (int jt = 0; jt < MT; ++jt) {
                        if (!tile_live[jt]) continue;
                        // the same 8 k of this thread's activation row (L1 / L2 hits: every
                        // CTA of this m block reads them), zeros for padding rows
                        u32 x[4] = {0u, 0u, 0u, 0u};
                        if (arow[jt] >= 0)
                            qg_ld16(x, a + (long long)arow[jt] * Kdim + 128 * cs + 32 * t + 8 * j);
                        // (k0,k1) (k2,k3) (k4,k5) (k6,k7) -> (k0,k4) (k1,k5) (k2,k6) (k3,k7)
                        const u32 b0[2] = {__byte_perm(x[0], x[2], 0x5410),
                                           __byte_perm(x[0], x[2], 0x7632)};
                        const u32 b1[2] = {__byte_perm(x[1], x[3], 0x5410),
                                           __byte_perm(x[1], x[3], 0x7632)};
                        // pairs 0, 1 fill the k slots (2t, 2t + 8) of one mma, pairs 2, 3 the next
                        const u32 a0[4] = {q[0][0], q[1][0], q[0][1], q[1][1]};
                        const u32 a1[4] = {q[0][2], q[1][2], q[0][3], q[1][3]};
                        qg_mma_k16(part[jt], a0, b0);
                        qg_mma_k16(part[jt], a1, b1);
                    }
                }
                // d[0], d[1]: row n0 + g (tokens 2t, 2t + 1); d[2], d[3]: row n0 + g + 8
#pragma unroll
                for (int jt = 0; jt < MT; ++jt) {
                    acc[jt][0] += part[jt][0] * sc[u][0];
                    acc[jt][1] += part[jt][1] * sc[u][0];
                    acc[jt][2] += part[jt][2] * sc[u][1];
                    acc[jt][3] += part[jt][3] * sc[u][1];
                }
            }
        }
    }

    // ---- the warps' partial sums, added in warp order (deterministic), then the epilogue
    qg_sum_warps<MT, WARPS>(acc, sRed, sSlot, n0, N, num_slots, tid,
                            [&](int, int n, int s, float v) {
        qg_store(c + (long long)s * N + n,
                 qg_epilogue(v, e, n, s, N, bias, topk_weights, mul_routed_weight));
    });
}
