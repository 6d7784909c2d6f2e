// w8a8_v2_mma.cu: rung 2 of the w8a8 (fp8 / int8) grouped GEMM: tensor cores.
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
// The lesson: 8-bit tensor cores and where the scales go. mma.sync m16n8k32 e4m3 x e4m3 -> f32
// (sm_89+) or s8 x s8 -> s32 (sm_80+) over 128-wide K tiles (one quantization block each), so a
// block scale multiplies each tile's partial sums in registers before they join the fp32
// accumulator. A and W tiles come through a cp.async ring of STAGES buffers; fragments are read
// from padded shared rows (no ldmatrix: an 8-bit fragment is 4 consecutive k bytes, one 32-bit
// load). The router's tiles for int8, and for fp8 off Hopper (configs m16 / m64).
//
// w8a8_v2_mma<QT, BM, BN, WARPS_M, WARPS_N, STAGES> (QT 0 fp8, 1 int8)
// Launch: grid (cdiv(Lg, BM), cdiv(N, BN)), block WARPS_M * WARPS_N * 32, dynamic shared memory
//   STAGES * ((BM + BN) * 144 + BM * 4) + 16 * cdiv(STAGES * 4, 16) + BM * 8 bytes.
// Lg = min(L, P * block_size) positions (no live position lies past it: num_tokens_post_padded
// <= P * block_size).
// Grid order: blockIdx.x walks the m tiles (fastest), so the CTAs that run together share an
// n tile of each expert's weights, which are then read from HBM about once.
// Run: python -m cuda_kernels.cupy.quant.w8a8 [--quick]
#include "common.cuh"

template <int QT> struct QgPart { typedef float T; };
template <> struct QgPart<QG_INT8> { typedef int T; };

template <int QT, int BM, int BN, int WARPS_M, int WARPS_N, int STAGES>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * 32)
w8a8_v2_mma(QG_W8A8_ARGS) {
    constexpr int BK = QG_KBLOCK;                 // one quantization block per K tile
    constexpr int NT = WARPS_M * WARPS_N * 32;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
    constexpr int MI = WM / 16, NI = WN / 8;
    // 144-byte rows = 36 words: the 8 rows x 4 words of a fragment load hit 32 distinct banks
    constexpr int ROW = BK + 16;
    constexpr int CH = BK / 16;                   // 16-byte chunks per row
    static_assert(WM % 16 == 0 && WN % 8 == 0, "warp tile must be a multiple of 16 x 8");
    static_assert(QG_KBLOCK % BN == 0, "a block-scaled n tile lies in one 128-row block");
    typedef typename QgPart<QT>::T part_t;
    // uniform over the grid: the branches on it cost nothing and save an instantiation
    const bool BLOCKWISE = a_scale_kind == 2;

    extern __shared__ __align__(16) u8 smem[];
    u8* sA = smem;                                              // [STAGES][BM][ROW]
    u8* sW = sA + STAGES * BM * ROW;                            // [STAGES][BN][ROW]
    float* sAs = reinterpret_cast<float*>(sW + STAGES * BN * ROW);   // [STAGES][BM]
    float* sWs = sAs + STAGES * BM;                             // [STAGES] (padded to 16 B)
    int* sArow = reinterpret_cast<int*>(sWs + ((STAGES + 3) / 4) * 4);  // [BM] a row, -1 padding
    int* sSlot = sArow + BM;                                    // [BM] slot s

    const int m0 = blockIdx.x * BM;
    if (m0 >= num_tokens_post_padded[0] || m0 >= num_positions) return;   // past the live blocks
    const int n0 = blockIdx.y * BN;
    const int e = expert_ids[m0 / block_size];                  // BM divides block_size
    const int tid = threadIdx.x;
    if (!qg_stage_m_tile<BM, BN, NT>(c, sSlot, sArow, sorted_token_ids, m0, n0, e, N,
                                     num_slots, top_k, num_positions, tid))
        return;                                   // padding only, or zeros
    const int KB = (Kdim + BK - 1) / BK;
    const int NB = (N + QG_KBLOCK - 1) / QG_KBLOCK;
    // 64-bit expert base once; offsets inside one expert fit 32 bits (the launcher checks
    // N * Kdim < 2^31, the whole w may not: DeepSeek-V3's w13 is 7.5e9 bytes)
    const u8* wexp = w + (long long)e * N * Kdim;

    auto load_stage = [&](int stage, int kb) {
        const int k0 = kb * BK;
        qg_copy_a_tile<BM, CH, ROW, NT>(sA + stage * BM * ROW, a, sArow, k0, Kdim, tid);
        u8* dW = sW + stage * BN * ROW;
        for (int i = tid; i < BN * CH; i += NT) {
            const int r = i / CH, k = k0 + (i % CH) * 16, n = n0 + r;
            const bool ok = n < N && k < Kdim;
            qg_cp16(dW + r * ROW + (i % CH) * 16, ok ? wexp + n * Kdim + k : w, ok);
        }
        if (BLOCKWISE) {
            for (int r = tid; r < BM; r += NT) {
                const int arow = sArow[r];
                qg_cp4(sAs + stage * BM + r,
                       arow >= 0 ? a_scale + (long long)arow * KB + kb : a_scale, arow >= 0);
            }
            if (tid == 0)
                qg_cp4(sWs + stage, w_scale + ((long long)e * NB + n0 / QG_KBLOCK) * KB + kb, true);
        }
    };

    qg_ring_fill<STAGES>(KB, load_stage);

    const int warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    float acc[MI][NI][4] = {};

    for (int kt = 0; kt < KB; ++kt) {
        const int st = qg_ring_step<STAGES>(kt, KB, load_stage);   // tile kt has landed
        const u8* tA = sA + st * BM * ROW + (wm * WM) * ROW;
        const u8* tW = sW + st * BN * ROW + (wn * WN) * ROW;
        part_t part[MI][NI][4] = {};
#pragma unroll
        for (int kk = 0; kk < BK / 32; ++kk) {
            u32 af[MI][4], bfr[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
                qg_load_frag_a<ROW>(af[mi], tA + (mi * 16 + g) * ROW + kk * 32 + t * 4);
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                const u8* q = tW + (ni * 8 + g) * ROW + kk * 32 + t * 4;
                bfr[ni][0] = *reinterpret_cast<const u32*>(q);
                bfr[ni][1] = *reinterpret_cast<const u32*>(q + 16);
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) qg_mma_k32(part[mi][ni], af[mi], bfr[ni]);
        }
        // fold this K block into the fp32 accumulator (scaled when block-quantized)
        const float ws = BLOCKWISE ? sWs[st] : 1.f;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
            const int r = wm * WM + mi * 16 + g;
            const float s0 = BLOCKWISE ? sAs[st * BM + r] * ws : 1.f;
            const float s1 = BLOCKWISE ? sAs[st * BM + r + 8] * ws : 1.f;
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                acc[mi][ni][0] += (float)part[mi][ni][0] * s0;
                acc[mi][ni][1] += (float)part[mi][ni][1] * s0;
                acc[mi][ni][2] += (float)part[mi][ni][2] * s1;
                acc[mi][ni][3] += (float)part[mi][ni][3] * s1;
            }
        }
    }
    qg_wait<0>();                                    // no copy outlives the CTA

    qg_for_live_rows<MI>(sSlot, wm * WM, g, num_slots, [&](int mi, int h, int r, int s) {
        float sa = 1.f;
        if (!BLOCKWISE) sa = a_scale_kind == 0 ? a_scale[0] : a_scale[sArow[r]];
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
            const int n = n0 + wn * WN + ni * 8 + 2 * t;
            float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
            if (!BLOCKWISE && n < N) {
                const float* ws_row = w_scale + (long long)e * N;
                v0 *= sa * (w_scale_kind == 0 ? w_scale[e] : ws_row[n]);
                if (n + 1 < N) v1 *= sa * (w_scale_kind == 0 ? w_scale[e] : ws_row[n + 1]);
            }
            qg_store_pair(c, s, n, N, v0, v1, e, bias, topk_weights, mul_routed_weight);
        }
    });
}
