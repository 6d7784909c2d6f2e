// wna16_v2_mma.cu: rung 2 of the weight-only grouped GEMM: tensor cores on weights
// dequantized in registers.
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
// The lesson: keep the weights packed in memory and in shared memory, and dequantize each
// thread's own B fragment in registers just before the mma. Activations and raw weight bytes
// come through a cp.async ring of STAGES tiles; mma.sync m16n8k16 bf16 / f16 -> f32; (q - zp) * s
// in fp32 (q - zp exact through the 2^23 magic number), rounded to elem_t; 1, 2 or 4 scale
// groups per K tile (group_size >= BK / 4). The router's rung above 128 rows per expert (a
// prefill batch: each weight tile is reused by 64 rows) and for int8 weights (m16 / m64).
//
// wna16_v2_mma<NBITS, BM, BN, BK, WARPS_M, WARPS_N, STAGES>
// Launch: grid (cdiv(Lg, BM), cdiv(N, BN)), block WARPS_M * WARPS_N * 32, dynamic shared memory
//   STAGES * (BM * (2 BK + 16) + BN * WROW) + BM * 8 bytes (WROW: the padded weight row).
// Lg = min(L, P * block_size) positions (no live position lies past it: num_tokens_post_padded
// <= P * block_size).
// Grid order: blockIdx.x walks the m tiles (fastest), so the CTAs that run together share an
// n tile of each expert's weights, which are then read from HBM about once.
// Run: python -m cuda_kernels.cupy.quant.wna16 [--quick]
#include "common.cuh"

// (q - zp) exactly, as fp32, without an int -> float conversion: 2^23 + q has q in its
// mantissa, and 2^23 + zp is exact too, so their difference is q - zp with no rounding.
__device__ __forceinline__ float qg_deq(u32 q, float zoff, float sc) {
    return (__uint_as_float(0x4B000000u | q) - zoff) * sc;
}

template <int NBITS, int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * 32)
wna16_v2_mma(QG_WNA16_ARGS) {
    constexpr int NT = WARPS_M * WARPS_N * 32;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
    constexpr int MI = WM / 16, NI = WN / 8;
    constexpr int AROW = BK * 2 + 16;             // bytes: 4*odd words, conflict-free fragments
    constexpr int ACH = BK / 8;                   // 16-byte chunks of a row of A (8 elements)
    constexpr int WB = BK * NBITS / 8;            // weight bytes of a row per K tile
    constexpr int WROW = WB == 16 ? 48 : WB + 16; // 4*odd words again (32 would be 2-way)
    constexpr int WCH = WB / 16;
    static_assert(WM % 16 == 0 && WN % 8 == 0, "warp tile must be a multiple of 16 x 8");
    static_assert(WB % 16 == 0, "a K tile of a weight row must be whole 16-byte chunks");
    // ng groups per K tile (runtime, 1, 2 or 4): BK / group_size when a group is narrower
    // than a tile, else 1 (group_size a multiple of BK, or the whole row one group). The
    // scales of a tile live in registers indexed by compile-time constants only (selects,
    // never a dynamically indexed register array, which would go to local memory).
    constexpr int KK = BK / 16;                   // k16 steps per tile
    constexpr int NGMAX = KK < 4 ? KK : 4;
    static_assert(KK % NGMAX == 0, "groups are whole k16 steps of a tile");
    const int ng = BK / group_size > 1 ? BK / group_size : 1;

    extern __shared__ __align__(16) u8 smem[];
    u8* sA = smem;                                              // [STAGES][BM][AROW]
    u8* sW = sA + STAGES * BM * AROW;                           // [STAGES][BN][WROW]
    int* sArow = reinterpret_cast<int*>(sW + STAGES * BN * WROW);   // [BM]
    int* sSlot = sArow + BM;                                    // [BM]

    const int m0 = blockIdx.x * BM;
    if (m0 >= num_tokens_post_padded[0] || m0 >= num_positions) return;   // past the live blocks
    const int n0 = blockIdx.y * BN;
    const int e = expert_ids[m0 / block_size];                  // BM divides block_size
    const int tid = threadIdx.x;
    if (!qg_stage_m_tile<BM, BN, NT>(c, sSlot, sArow, sorted_token_ids, m0, n0, e, N,
                                     num_slots, top_k, num_positions, tid))
        return;                                   // padding only, or zeros
    const int KT = (Kdim + BK - 1) / BK;
    const int wrow_bytes = Kdim * NBITS / 8;
    // 64-bit expert base once, 32-bit offsets inside the expert (launcher: N * row bytes < 2^31)
    const u8* wexp = w + (long long)e * N * wrow_bytes;

    auto load_stage = [&](int stage, int kt) {
        const int k0 = kt * BK;
        qg_copy_a_tile<BM, ACH, AROW, NT>(sA + stage * BM * AROW, a, sArow, k0, Kdim, tid);
        u8* dW = sW + stage * BN * WROW;
        const int kb0 = k0 * NBITS / 8;
        for (int i = tid; i < BN * WCH; i += NT) {
            const int r = i / WCH, n = n0 + r;
            const int kb = kb0 + (i % WCH) * 16;
            const bool ok = n < N && kb < wrow_bytes;
            qg_cp16(dW + r * WROW + (i % WCH) * 16, ok ? wexp + n * wrow_bytes + kb : w, ok);
        }
    };

    qg_ring_fill<STAGES>(KT, load_stage);

    const int warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    // this thread's B columns (one per ni), clamped so that scale loads stay in bounds for
    // the zero-filled rows past N (their products are never stored)
    long long nrow[NI];
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
        const int n = min(n0 + wn * WN + ni * 8 + g, N - 1);
        nrow[ni] = ((long long)e * N + n) * num_groups;
    }
    float acc[MI][NI][4] = {};

    for (int kt = 0; kt < KT; ++kt) {
        // this tile's scales and zero points, issued before the barrier so that their
        // latency overlaps the wait (L1/L2 hits: a row's scales are read by every m tile)
        float sc[NI][NGMAX], zo[NI][NGMAX];
        const int gbase = (kt * BK) / group_size;
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int j = 0; j < NGMAX; ++j) {
                // a partial last tile may name groups past the row: clamp (they multiply
                // zero-filled activations)
                if (j > 0 && j >= ng) {            // not a group of this tile: never selected
                    sc[ni][j] = sc[ni][0];
                    zo[ni][j] = zo[ni][0];
                    continue;
                }
                const int gi = min(gbase + j, num_groups - 1);
                sc[ni][j] = __ldg(w_scale + nrow[ni] + gi);
                zo[ni][j] = 8388608.f + (float)(w_zp != nullptr ? (int)__ldg(w_zp + nrow[ni] + gi)
                                                                : default_zp);
            }
        const int st = qg_ring_step<STAGES>(kt, KT, load_stage);   // tile kt has landed
        const u8* tA = sA + st * BM * AROW + (wm * WM) * AROW;
        const u8* tW = sW + st * BN * WROW + (wn * WN) * WROW;
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            // the group of step kk for ng = 1, 2, 4: three compile-time indices, one select
            const int j1 = 0, j2 = (kk * 2) / KK, j4 = (kk * NGMAX) / KK;
            u32 af[MI][4], bfr[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
                qg_load_frag_a<AROW>(af[mi], tA + (mi * 16 + g) * AROW + (kk * 16 + 2 * t) * 2);
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                const u8* q = tW + (ni * 8 + g) * WROW;
                u32 c0, c1, c2, c3;   // codes of k = 16kk + 2t, +1 and 16kk + 8 + 2t, +1
                if (NBITS == 4) {
                    // byte 8kk + t holds k = 16kk + 2t (low nibble) and 2t+1 (high nibble);
                    // byte 8kk + 4 + t holds k = 16kk + 8 + 2t and + 1
                    const u32 lo = (*reinterpret_cast<const u32*>(q + kk * 8) >> (8 * t)) & 0xFFu;
                    const u32 hi =
                        (*reinterpret_cast<const u32*>(q + kk * 8 + 4) >> (8 * t)) & 0xFFu;
                    c0 = lo & 0xFu; c1 = lo >> 4; c2 = hi & 0xFu; c3 = hi >> 4;
                } else {
                    // bytes 16kk + 2t, +1 and 16kk + 8 + 2t, +1 (two per 16-bit half-word)
                    const u32 wl = *reinterpret_cast<const u32*>(q + kk * 16 + (t >> 1) * 4);
                    const u32 wh = *reinterpret_cast<const u32*>(q + kk * 16 + 8 + (t >> 1) * 4);
                    const u32 x = (u32)code_xor * 0x0101u;
                    const u32 lo = ((wl >> (16 * (t & 1))) & 0xFFFFu) ^ x;
                    const u32 hi = ((wh >> (16 * (t & 1))) & 0xFFFFu) ^ x;
                    c0 = lo & 0xFFu; c1 = lo >> 8; c2 = hi & 0xFFu; c3 = hi >> 8;
                }
                const float s_ = ng == 1 ? sc[ni][j1] : (ng == 2 ? sc[ni][j2] : sc[ni][j4]);
                const float z_ = ng == 1 ? zo[ni][j1] : (ng == 2 ? zo[ni][j2] : zo[ni][j4]);
                bfr[ni][0] = qg_pack(qg_deq(c0, z_, s_), qg_deq(c1, z_, s_));
                bfr[ni][1] = qg_pack(qg_deq(c2, z_, s_), qg_deq(c3, z_, s_));
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) qg_mma_k16(acc[mi][ni], af[mi], bfr[ni]);
        }
    }
    qg_wait<0>();

    qg_for_live_rows<MI>(sSlot, wm * WM, g, num_slots, [&](int mi, int h, int, int s) {
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
            const int n = n0 + wn * WN + ni * 8 + 2 * t;
            qg_store_pair(c, s, n, N, acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1], e, bias,
                          topk_weights, mul_routed_weight);
        }
    });
}
