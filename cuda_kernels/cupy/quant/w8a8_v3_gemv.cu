// w8a8_v3_gemv.cu: rung 3 of the w8a8 grouped GEMM (fp8 only): decode, weight streaming.
//
//   c[s] = (deq(a)[s / top_k] @ deq(w[e]).T + bias[e]) * (topk_weights[s] if mul_routed_weight)
//
// for every live position p of sorted_token_ids (as w8a8_v1_naive.cu; e == -1 writes zeros), fp8
// e4m3 codes, fp32 accumulation, one rounding to elem_t.
//   a [M_a, Kdim] e4m3 bytes   a_scale [1] | [M_a] | [M_a, KB]      (kind 0 / 1 / 2)
//   w [E, N, Kdim] e4m3 bytes  w_scale [E] | [E, N] | [E, NB, KB]   (kind 0 / 1 / 2)
// Kind 2 together = DeepSeek-V3 block scaling: each 128-wide K block's partial sum is scaled by
// a_scale[row, kb] * w_scale[e, n / 128, kb]; other kinds multiply once at the end.
//
// Decode (a few rows per expert): the job is to read the touched experts' weights once, at
// HBM bandwidth. Design (the weight-only rung wna16_v3_gemv does the same for int4):
//   * Roles swapped: 16 weight rows n0..n0+15 are the mma's A (m16n8k32 e4m3, sm_89+), the
//     block's activation rows its B, in MT tiles of 8 tokens; a tile with no live slot is
//     skipped (uniform), so a padded block of 16 with one token costs one tile of mma.
//   * No shared-memory staging and no barrier in the main loop: each thread loads its weight
//     bytes straight into registers (ld.global.nc, L1::no_allocate: read once), U quantization
//     blocks of loads in flight per thread before the first is used (a round), then consumed.
//     More bytes in flight come from more CTAs per SM (MINB), not from a second register
//     buffer: double buffering and a persistent grid were measured slower on the H200 and
//     were removed (quant/configs.py has the numbers).
//   * K split over the WARPS warps (warp w takes the 128-wide blocks w, w + WARPS, ...); the
//     partial sums meet in shared memory at the end, added in warp order (deterministic).
//   * Fragment k order: thread (g = lane / 4, t = lane % 4) holds, of block kb and half h,
//     bytes 128 kb + 64 h + 16 t .. +15 of weight rows n0 + g and n0 + g + 8 and of its token
//     row g (4 words each). mma (h, q) takes words 2q, 2q + 1: a = {row g word 2q, row g+8
//     word 2q, row g word 2q+1, row g+8 word 2q+1}, b = {token word 2q, token word 2q+1}. The
//     mma sums over its 32 k slots; A's slot (t, i) and B's slot (t, i) hold the same k of
//     memory, which is all the sum needs.
//   * Accumulator: d[0], d[1] = weight row n0 + g, tokens 2t, 2t + 1 of the tile; d[2], d[3]
//     = row n0 + g + 8. Block scaling folds each block's 4-mma partial into the fp32 sum.
// grid (cdiv(Lg, 8 MT), cdiv(N, 16)), block WARPS * 32,
// dynamic smem = WARPS * 8 MT * 16 * 4 + 8 MT * 8 bytes.
// Needs Kdim % 128 == 0, a and w 16-byte aligned, sm_89+ (the launcher checks).
// ELEM_BF16 (#define 1 / 0): output bf16 / fp16.
// Run: python -m cuda_kernels.cupy.quant.w8a8 [--quick]
#include "common.cuh"

// The inline PTX of this file: the weights' streaming loads (the activations' loads and the
// mma are common.cuh's qg_ld16 and qg_mma_k32). tests/cupy/quant/test_w8a8.py runs this
// source on the CPU with QG_EMULATED_PTX #defined and the emulator's helpers
// (tests/emulator/kernels.h: qg_ld16*, qg_mma_k32, with the same semantics and the fragment
// layouts the PTX ISA gives).
#ifdef QG_EMULATED_PTX
template <int PF>
inline void fg_ld16_stream(u32 (&r)[4], const void* p) { qg_ld16_stream(r, p); }
#else
// 16 bytes global -> 4 registers, read-only path; weights kept out of L1 (read once). PF > 0
// asks L2 to fetch the whole 128-byte (PF 1) / 256-byte (PF 2) span around the address: a
// warp's load covers half of each row's 128-byte block (the other half is its next load) and
// the CTA's other warps read the neighbouring blocks of the same rows.
template <int PF>
__device__ __forceinline__ void fg_ld16_stream(u32 (&r)[4], const void* p) {
    if (PF == 2)
        asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
            : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
    else if (PF == 1)
        asm("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
            : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
    else
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
            : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
}
#endif  // QG_EMULATED_PTX

// ============================================================================ the tile's parts
// One tile = 16 weight rows n0..n0+15 of expert e times BM = 8 MT token rows; w8a8_v3_gemv runs
// one per CTA, in these phases (forceinline: the kernel compiles as if they were written in
// place; its main loop's SASS is the same as when they were).

// Where thread (g, t) reads its weight bytes: rows n0 + g and n0 + g + 8 (clamped to N - 1:
// read, multiplied, never stored), bytes 16 t.. of each 128-wide block; and the block scales
// of the tile's 128-row band (kind 2 only). A 64-bit expert base once, 32-bit offsets inside
// it (the launcher checks N * Kdim < 2^31).
struct FgRows {
    const u8* w0;
    const u8* w1;
    const float* wsrow;
};
__device__ __forceinline__ FgRows fg_rows(const u8* w, const float* w_scale, int e, int n0, int N,
                                          int Kdim, int g, int t) {
    const int ec = max(e, 0);
    const int KB = Kdim / 128, NB = (N + 127) / 128;
    const u8* wexp = w + (long long)ec * N * Kdim;
    return {wexp + min(n0 + g, N - 1) * Kdim + 16 * t, wexp + min(n0 + g + 8, N - 1) * Kdim + 16 * t,
            w_scale + ((long long)ec * NB + n0 / 128) * KB};
}

// A round: U blocks kb0, kb0 + WARPS, ... of weight loads (and their scales), issued back to
// back before the first is used. wq[u][row g / g + 8][half][word].
template <int U, int WARPS, int PF>
__device__ __forceinline__ void fg_issue(u32 (&wq)[U][2][2][4], float (&wsc)[U], const FgRows& r,
                                         int kb0, int KB, bool blockwise) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int kb = kb0 + u * WARPS;
        if (kb < KB) {                                             // uniform over the warp
            fg_ld16_stream<PF>(wq[u][0][0], r.w0 + 128 * kb);
            fg_ld16_stream<PF>(wq[u][1][0], r.w1 + 128 * kb);
            fg_ld16_stream<PF>(wq[u][0][1], r.w0 + 128 * kb + 64);
            fg_ld16_stream<PF>(wq[u][1][1], r.w1 + 128 * kb + 64);
            wsc[u] = blockwise ? __ldg(r.wsrow + kb) : 1.f;
        }
    }
}

// This thread's token rows, from the tile's staged rows sArow [BM] (-1: padding): arow = its
// B column g of each 8-token tile, srow = the rows of its accumulator columns 2t, 2t + 1 (for
// a_scale), live = the 8-token tile holds a slot (uniform over the CTA: skipped otherwise).
template <int MT>
struct FgCols {
    int arow[MT];
    int srow[MT][2];
    bool live[MT];
};
template <int MT>
__device__ __forceinline__ void fg_cols(FgCols<MT>& c, const int* sArow, int g, int t) {
#pragma unroll
    for (int j = 0; j < MT; ++j) {
        c.arow[j] = sArow[8 * j + g];
        c.srow[j][0] = max(sArow[8 * j + 2 * t], 0);
        c.srow[j][1] = max(sArow[8 * j + 2 * t + 1], 0);
        int any = 0;
#pragma unroll
        for (int r = 0; r < 8; ++r) any |= sArow[8 * j + r] >= 0;
        c.live[j] = any;
    }
}

// Consume a round: per block and live 8-token tile, the token bytes (L1 / L2 hits: every CTA
// of the m tile reads them; zeros for padding rows), 4 mma, and (kind 2) the block's partial
// folded into acc with a_scale * w_scale.
template <int MT, int U, int WARPS>
__device__ __forceinline__ void fg_consume(float (&acc)[MT][4], const u32 (&wq)[U][2][2][4],
                                           const float (&wsc)[U], const FgCols<MT>& c,
                                           const u8* a, const float* a_scale, int kb0, int KB,
                                           int Kdim, int t, bool blockwise) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int kb = kb0 + u * WARPS;
        if (kb >= KB) continue;                                    // uniform over the warp
#pragma unroll
        for (int jt = 0; jt < MT; ++jt) {
            if (!c.live[jt]) continue;
            u32 x[2][4] = {{0u, 0u, 0u, 0u}, {0u, 0u, 0u, 0u}};
            if (c.arow[jt] >= 0) {
                const u8* ap = a + (long long)c.arow[jt] * Kdim + 128 * kb + 16 * t;
                qg_ld16(x[0], ap);
                qg_ld16(x[1], ap + 64);
            }
            float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const u32 af[4] = {wq[u][0][h][2 * q], wq[u][1][h][2 * q],
                                       wq[u][0][h][2 * q + 1], wq[u][1][h][2 * q + 1]};
                    const u32 bf[2] = {x[h][2 * q], x[h][2 * q + 1]};
                    qg_mma_k32(part, af, bf);
                }
            float s0 = 1.f, s1 = 1.f;
            if (blockwise) {
                s0 = __ldg(a_scale + (long long)c.srow[jt][0] * KB + kb) * wsc[u];
                s1 = __ldg(a_scale + (long long)c.srow[jt][1] * KB + kb) * wsc[u];
            }
            acc[jt][0] += part[0] * s0;
            acc[jt][1] += part[1] * s1;
            acc[jt][2] += part[2] * s0;
            acc[jt][3] += part[3] * s1;
        }
    }
}

// Stage the tile's slots: thread r < BM holds s_mine = sorted_token_ids[m0 + r] (num_slots
// past the end). Returns whether any row of the tile is live (a barrier: uniform).
template <int BM>
__device__ __forceinline__ int fg_stage(int* sSlot, int* sArow, int s_mine, int num_slots,
                                        int top_k, int tid) {
    int live = 0;
    if (tid < BM) {
        sSlot[tid] = s_mine;
        sArow[tid] = qg_live(s_mine, num_slots) ? s_mine / top_k : -1;
        live = qg_live(s_mine, num_slots);
    }
    return __syncthreads_or(live);
}

// ============================================================================ the kernel
// w8a8_v3_gemv: one CTA per tile, grid (m tiles, n tiles); rounds of U blocks per warp.
template <int MT, int WARPS, int U, int MINB, int PF>
__global__ void __launch_bounds__(WARPS * 32, MINB)
w8a8_v3_gemv(QG_W8A8_ARGS) {
    constexpr int BM = 8 * MT;
    constexpr int NT = WARPS * 32;
    constexpr int STEP = WARPS * U;            // blocks per round of the CTA
    static_assert(BM <= NT, "v3: one thread per tile row reads the slots");
    extern __shared__ __align__(16) u8 smem[];
    float* sRed = reinterpret_cast<float*>(smem);                  // [WARPS][BM][16]
    int* sArow = reinterpret_cast<int*>(sRed + WARPS * BM * 16);   // [BM] a row, -1 padding
    int* sSlot = sArow + BM;                                       // [BM] slot s

    const int m0 = blockIdx.x * BM;
    if (m0 >= num_positions) return;
    const int n0 = blockIdx.y * 16;
    const int tid = threadIdx.x;
    // The tile's header loads are independent (all in bounds: m0 < num_positions, expert_ids
    // has cdiv(num_positions, block_size) entries): issued together, one round trip, so a
    // padding-only CTA leaves fast (at decode half the tiles of a 16-block are padding).
    const int ntpp = num_tokens_post_padded[0];
    const int e = expert_ids[m0 / block_size];                     // BM divides block_size
    const int s_mine = (tid < BM && m0 + tid < num_positions) ? sorted_token_ids[m0 + tid]
                                                               : num_slots;   // BM <= NT
    if (m0 >= ntpp) return;
    const bool BLOCKWISE = a_scale_kind == 2;                      // uniform over the grid
    const int warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int KB = Kdim / 128;
    const FgRows rows = fg_rows(w, w_scale, e, n0, N, Kdim, g, t);

    if (fg_stage<BM>(sSlot, sArow, s_mine, num_slots, top_k, tid) == 0) return;  // padding only
    if (e < 0) {                                                   // expert on another rank
        qg_store_zeros<BM, 16, NT>(c, sSlot, n0, N, num_slots, tid);
        return;
    }
    FgCols<MT> cols;
    fg_cols(cols, sArow, g, t);
    float acc[MT][4];
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;

    u32 wq[U][2][2][4];                        // [block][row g / g + 8][half][word]
    float wsc[U];
    for (int kb0 = warp; kb0 < KB; kb0 += STEP) {
        fg_issue<U, WARPS, PF>(wq, wsc, rows, kb0, KB, BLOCKWISE);
        fg_consume<MT, U, WARPS>(acc, wq, wsc, cols, a, a_scale, kb0, KB, Kdim, t, BLOCKWISE);
    }
    // the warps' partial sums, then the per-tensor / per-channel scales, bias, routed weight
    // (fp32, docs/stages.md's order), one rounding
    qg_sum_warps<MT, WARPS>(acc, sRed, sSlot, n0, N, num_slots, tid,
                            [&](int r, int n, int s, float v) {
        if (a_scale_kind != 2) {
            const float sa = a_scale_kind == 0 ? a_scale[0] : a_scale[sArow[r]];
            const float sw = w_scale_kind == 0 ? w_scale[e] : w_scale[(long long)e * N + n];
            v *= sa * sw;
        }
        if (bias != nullptr) v += bias[(long long)e * N + n];
        if (mul_routed_weight) v *= topk_weights[s];
        qg_store(c + (long long)s * N + n, v);
    });
}
