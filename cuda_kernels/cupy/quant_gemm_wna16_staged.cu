// wna16_staged: the weight-only int4 grouped GEMM for decode batches of 8-32 rows per expert,
// with the CTA's weights AND activations staged together through one shared-memory cp.async
// pipeline, and each CTA's work a contiguous run of (row block, K stage) units.
//
//   c[s, n] = (sum_k a[s / top_k, k] (q[e, n, k] - zp[e, n, k / gs]) s[e, n, k / gs] + bias[e, n])
//             * r[s]      (the same contract as quant_gemm_wna16.cu's rungs; weights prepacked by
//                          quant_gemm_wna16.prepack_int4(order="mma"), wna16_packed's layout)
//
// Why (H200, Mixtral int4 at T = 64, benchmarks/results/dev_wna16_20261130d): wna16_packed reads
// the activations through L1 once per 32 weight rows, so GEMM1 moved 1.56 GB through L2 for
// 0.50 GB of weights, and its warps waited on those loads. Here a CTA owns NB = W TPW 16-row
// tiles (256 rows at W = 4, TPW = 4): each 16-byte activation copied into shared memory feeds
// 16 NB weight rows, and nothing in the main loop waits on global memory but the pipeline.
//
// Layout of the work. Units u = b SPB + s of an m tile: row block b (NB tiles), K stage s (KC
// 64-code chunks; SPB = cdiv(C, KC) stages per block, C = Kdim / 64). The gridDim.y CTAs of an
// m tile take contiguous, near-equal runs [q U / Q, (q + 1) U / Q) of its U = blocks SPB units
// (the stream-K idea: no wave of CTAs is left half full, and a CTA's pipeline runs across
// block boundaries without draining). A CTA that covers a whole block stores it; a block
// shared by several CTAs (runs that start or end inside it) is finished by the last of them to
// arrive, which adds every part in CTA order (deterministic; w16::last_of_parts). Workspace:
// ws [m tiles][Q][2][NT TPW MT 4] fp32 (a CTA hands in at most two parts: its first block and
// its last), counters [m tiles][blocks] (zero, and left zero).
//
// One stage in shared memory (S stages in a ring, one __syncthreads per stage):
//   weights  [NB tiles][KC chunks][32 lanes] uint4   the packed fragments, 512 B per tile-chunk
//   scales   [NB][KC groups][8 g] float2             (s[row g], s[row g + 8]) of each group met
//   zps      [NB][KC][8] u16                         (ZP) the same rows' zero points
//   acts     [BM rows][KC chunks][8 units] uint4     row r's 16-byte unit j at j ^ (r & 1):
//            lane (g, t) reads units 2t, 2t + 1 of its row g: without the swizzle rows g and
//            g + 1 would share banks; with it the 8 lanes of a phase hit 8 distinct 16-byte
//            banks, and each copy stays inside its 128-byte line (see wna16_common.cuh: a
//            destination off its source's line costs twice the L2 requests)
//   sums     [BM][KC] u32                            (RAW) the chunk sums of wna16_chunk_sums
// Only the live token tiles' rows are copied (padding rows inside them copy a live row).
//
// Warp w owns tiles w TPW .. + TPW - 1 of the block and all LT live token tiles: per chunk it
// reads each token's 32 bytes once (2 LDS.128 per token tile) and feeds them to TPW tiles.
// The mma is m16n8k16 with the weights as A (rows g, g + 8), the tokens as B (column g).
// Dequantization (wna16_packed's): one shift and one lop3 per pair give 128 + q; RAW (bf16)
// feeds those raw values to the mma and takes (128 + zp) S off with one more mma per chunk
// and token tile (A = 128 + zp in k slots 0, 1, B = (-hi, -lo) of the chunk sum S); else
// (fp16, or RAW = 0) one hsub2 per pair subtracts 128 + zp. The chunk's fp32 partial is then
// scaled by its group's scale into the accumulators.
//
// grid (m tiles, Q), block 32 W, dynamic shared memory S x stage bytes (staged_stage_bytes in
// the launcher). LT, the live token tiles, is a compile-time constant of the code that runs
// (w16::with_count), as in wna16_packed.
// Needs int4 prepacked (N % 16 == 0, Kdim % 64 == 0, group_size 64 times a power of two or
// one group per row: chunk_shift = log2(chunks per group), 30 for one group).
#include "wna16_common.cuh"

namespace w16 {

// f(i) for the units i = threadIdx.x + j NT < UNITS, all j: the CTA's share of one copy.
template <int UNITS, int NT, typename F>
__device__ __forceinline__ void for_units(F&& f) {
#pragma unroll
    for (int j = 0; j < (UNITS + NT - 1) / NT; ++j) {
        const int i = threadIdx.x + j * NT;
        if (UNITS % NT == 0 || i < UNITS) f(i);
    }
}

}  // namespace w16

// Bytes of one pipeline stage (each part rounded to 128 bytes), as the launcher computes them.
template <int MT, int NB, int KC, int ZP, int RAW>
struct StagedStage {
    static constexpr int BM = 8 * MT;
    __host__ __device__ static constexpr int round(int x) { return (x + 127) / 128 * 128; }
    static constexpr int W_OFF = 0;
    static constexpr int S_OFF = W_OFF + round(NB * KC * 512);
    static constexpr int Z_OFF = S_OFF + round(NB * KC * 64);
    static constexpr int A_OFF = Z_OFF + (ZP ? round(NB * KC * 16) : 0);
    static constexpr int Q_OFF = A_OFF + round(BM * KC * 128);
    static constexpr int BYTES = Q_OFF + (RAW ? round(BM * KC * 4) : 0);
};

template <int MT, int W, int TPW, int KC, int S, int ZP, int RAW, int MINB>
__global__ void __launch_bounds__(W * 32, MINB)
wna16_staged(const elem_t* __restrict__ a, const uint4* __restrict__ wp, elem_t* __restrict__ c,
             const float2* __restrict__ sp, const unsigned short* __restrict__ zp,
             const u32* __restrict__ asum,
             const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
             const int* __restrict__ num_tokens_post_padded,
             const float* __restrict__ topk_weights, const float* __restrict__ bias,
             float* __restrict__ ws, int* __restrict__ counters,
             int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,
             int mul_routed_weight, int chunk_shift, int num_groups, int default_zp) {
    constexpr int BM = 8 * MT, NT = 32 * W, NB = W * TPW;
    constexpr bool USE_RAW = RAW && ELEM_BF16;     // fp16: a chunk's sum may pass 65504
    using St = StagedStage<MT, NB, KC, ZP, USE_RAW>;
    __shared__ int sSlot[BM];                     // slot s, or -1 (padding)
    __shared__ int sArow[BM];                     // its row of a, or -1
    __shared__ int sLast;
    extern __shared__ __align__(128) u8 smem[];   // 128: see wna16_common.cuh

    const int m0 = blockIdx.x * BM;
    if (!w16::load_m_tile<BM>(m0, sorted_token_ids, num_tokens_post_padded, num_slots, top_k,
                              num_positions, sSlot, sArow))
        return;                                   // padding only
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int e = expert_ids[m0 / block_size];    // BM divides block_size: one expert
    const int ntiles = N >> 4, C = Kdim >> 6;
    if (e < 0) {                                  // expert of another rank: zeros, once
        if (blockIdx.y == 0) w16::store_zeros<BM>(c, sSlot, N, 0, N, NT);
        return;
    }
    // this CTA's run of units [u0, u1) of the m tile's U (64-bit products: U Q can pass 2^31)
    const int SPB = (C + KC - 1) / KC, nblocks = (ntiles + NB - 1) / NB;
    const long long U = (long long)nblocks * SPB, Q = gridDim.y;
    const int u0 = (int)(blockIdx.y * U / Q), u1 = (int)((blockIdx.y + 1) * U / Q);
    if (u0 >= u1) return;
    auto owner = [&](long long u) { return (int)(((u + 1) * Q - 1) / U); };   // CTA of unit u

    // the live token tiles (an expert's live rows are a prefix of its block), and the row of a
    // each staged row copies (padding rows inside the live tiles: a live row, never stored)
    int first = -1, live_tiles = 0;
    for (int r = BM - 1; r >= 0; --r)
        if (sArow[r] >= 0) {
            first = sArow[r];
            if (!live_tiles) live_tiles = r / 8 + 1;
        }
    const int live_rows = 8 * live_tiles;

    const uint4* wexp = wp + (size_t)e * ntiles * C * 32;
    const float2* sexp = sp + (size_t)e * ntiles * num_groups * 8;
    const unsigned short* zexp = ZP ? zp + (size_t)e * ntiles * num_groups * 8 : nullptr;

    // ---- stage i of the run (unit u0 + i) into ring slot i % S; one commit group per stage
    // (empty past the run: the wait counts stay right)
    auto issue = [&](int i) {
        const int u = u0 + i;
        if (u < u1) {
            const int b = u / SPB, s = u - b * SPB;
            const int tb = b * NB, c0 = s * KC, kcn = min(KC, C - c0);
            const int g0 = c0 >> chunk_shift, ngr = ((c0 + kcn - 1) >> chunk_shift) - g0 + 1;
            u8* st = smem + (size_t)(i % S) * St::BYTES;
            w16::for_units<NB * KC * 32, NT>([&](int k) {
                const int tile = k / (KC * 32), rem = k % (KC * 32);
                const bool ok = tb + tile < ntiles && rem / 32 < kcn;
                const uint4* src = ok ? wexp + ((size_t)(tb + tile) * C + c0) * 32 + rem : wp;
                w16::cp16(st + St::W_OFF + 16 * k, src, ok);
            });
            w16::for_units<NB * KC * 4, NT>([&](int k) {      // 64 bytes per (tile, group)
                const int tile = k / (KC * 4), gi = (k / 4) % KC;
                const bool ok = tb + tile < ntiles && gi < ngr;
                const float2* src = ok ? sexp + ((size_t)(tb + tile) * num_groups + g0 + gi) * 8 +
                                         (k & 3) * 2 : sp;
                w16::cp16(st + St::S_OFF + 16 * k, src, ok);
            });
            if (ZP)
                w16::for_units<NB * KC, NT>([&](int k) {      // 16 bytes per (tile, group)
                    const int tile = k / KC, gi = k % KC;
                    const bool ok = tb + tile < ntiles && gi < ngr;
                    const unsigned short* src =
                        ok ? zexp + ((size_t)(tb + tile) * num_groups + g0 + gi) * 8 : zp;
                    w16::cp16(st + St::Z_OFF + 16 * k, src, ok);
                });
            w16::for_units<BM * KC * 8, NT>([&](int k) {
                const int r = k / (KC * 8), j = k % (KC * 8);
                if (r < live_rows) {                  // rows past the live tiles: never read
                    const int ar = sArow[r] >= 0 ? sArow[r] : first;
                    const bool ok = j / 8 < kcn;
                    const elem_t* src = ok ? a + (size_t)ar * Kdim + c0 * 64 + j * 8 : a;
                    w16::cp16(st + St::A_OFF + 16 * (r * KC * 8 + (j ^ (r & 1))), src, ok);
                }
            });
            if (USE_RAW)
                w16::for_units<BM * KC, NT>([&](int k) {
                    const int r = k / KC, kc = k % KC;
                    if (r < live_rows) {
                        const int ar = sArow[r] >= 0 ? sArow[r] : first;
                        const bool ok = kc < kcn;
                        w16::cp4(st + St::Q_OFF + 4 * k, ok ? asum + (size_t)ar * C + c0 + kc
                                                            : asum, ok);
                    }
                });
        }
        w16::cp_commit();
    };

#if ELEM_BF16
    constexpr u32 MAGIC = 0x43004300u;
#else
    constexpr u32 MAGIC = 0x64006400u;
#endif
    const u32 zdef = MAGIC | ((u32)default_zp * 0x00010001u);
    const int n_units = u1 - u0;
#pragma unroll
    for (int i = 0; i < S - 1; ++i) issue(i);

    w16::with_count<1, MT>(live_tiles, [&](auto live_count) {
        constexpr int LT = decltype(live_count)::value;
        float acc[TPW][LT][4];
#pragma unroll
        for (int r = 0; r < TPW; ++r)
#pragma unroll
            for (int mt = 0; mt < LT; ++mt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[r][mt][i] = 0.f;

        // the block's outputs: c0 c1 = (row g, tokens 2t, 2t + 1), c2 c3 = (row g + 8, same)
        auto store = [&](int b) {
#pragma unroll
            for (int r = 0; r < TPW; ++r) {
                const int tile = b * NB + warp * TPW + r;
                if (tile >= ntiles) continue;
#pragma unroll
                for (int mt = 0; mt < LT; ++mt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int row = 8 * mt + 2 * t + (i & 1);
                        const int n = tile * 16 + g + 8 * (i >> 1);
                        const int s = sSlot[row];
                        if (s < 0) continue;
                        float v = acc[r][mt][i];
                        if (bias != nullptr) v += bias[(size_t)e * N + n];
                        if (mul_routed_weight) v *= topk_weights[s];
                        c[(size_t)s * N + n] = w16::from_f32(v);
                    }
            }
        };

        for (int i = 0; i < n_units; ++i) {
            w16::cp_wait<S - 2>();                // stage i has landed (this thread's copies)
            __syncthreads();                      // ... and everyone's; slot i - 1 is free
            issue(i + S - 1);
            const int u = u0 + i, b = u / SPB, s = u - b * SPB;
            const int c0 = s * KC, kcn = min(KC, C - c0), g0 = c0 >> chunk_shift;
            const u8* st = smem + (size_t)(i % S) * St::BYTES;
            const uint4* sw = reinterpret_cast<const uint4*>(st + St::W_OFF) +
                              warp * TPW * KC * 32 + lane;
            const float2* ss = reinterpret_cast<const float2*>(st + St::S_OFF) +
                               warp * TPW * KC * 8 + g;
            const unsigned short* sz = reinterpret_cast<const unsigned short*>(st + St::Z_OFF) +
                                       warp * TPW * KC * 8 + g;
            const uint4* sa = reinterpret_cast<const uint4*>(st + St::A_OFF);
            const u32* sq = reinterpret_cast<const u32*>(st + St::Q_OFF);
#pragma unroll
            for (int kc = 0; kc < KC; ++kc) {
                if (kc >= kcn) break;             // uniform: a short last stage
                const int gi = ((c0 + kc) >> chunk_shift) - g0;
                // B: the lane's token (column g of each tile), codes 16 t .. + 15 of the chunk
                uint4 bv[LT][2];
                u32 bsum[USE_RAW ? LT : 1];
#pragma unroll
                for (int mt = 0; mt < LT; ++mt) {
                    const int r = 8 * mt + g;
                    bv[mt][0] = sa[r * KC * 8 + ((kc * 8 + 2 * t) ^ (g & 1))];
                    bv[mt][1] = sa[r * KC * 8 + ((kc * 8 + 2 * t + 1) ^ (g & 1))];
                    if (USE_RAW) bsum[USE_RAW ? mt : 0] = sq[r * KC + kc];
                }
#pragma unroll
                for (int r = 0; r < TPW; ++r) {
                    const uint4 x = sw[(r * KC + kc) * 32];
                    const float2 s2 = ss[(r * KC + gi) * 8];
                    u32 zl = zdef, zh = zdef;     // (128 + zp) in both halves, rows g, g + 8
                    if (ZP) {
                        const u32 z = sz[(r * KC + gi) * 8];
                        zl = MAGIC | ((z & 0xFFu) * 0x00010001u);
                        zh = MAGIC | (((z >> 8) & 0xFFu) * 0x00010001u);
                    }
                    u32 lo[8], hi[8];
#pragma unroll
                    for (int p = 0; p < 4; ++p) {
                        const u32 m = 0x000F000Fu;
                        lo[p] = w16::and_or(x.x >> (4 * p), m, MAGIC);
                        hi[p] = w16::and_or(x.y >> (4 * p), m, MAGIC);
                        lo[4 + p] = w16::and_or(x.z >> (4 * p), m, MAGIC);
                        hi[4 + p] = w16::and_or(x.w >> (4 * p), m, MAGIC);
                        if (!USE_RAW) {
                            lo[p] = w16::as_u32(__hsub2(w16::as_e2(lo[p]), w16::as_e2(zl)));
                            hi[p] = w16::as_u32(__hsub2(w16::as_e2(hi[p]), w16::as_e2(zh)));
                            lo[4 + p] = w16::as_u32(__hsub2(w16::as_e2(lo[4 + p]), w16::as_e2(zl)));
                            hi[4 + p] = w16::as_u32(__hsub2(w16::as_e2(hi[4 + p]), w16::as_e2(zh)));
                        }
                    }
                    const u32 za = t == 0 ? zl : 0u, zb = t == 0 ? zh : 0u;
#pragma unroll
                    for (int mt = 0; mt < LT; ++mt) {
                        float tmp[4] = {0.f, 0.f, 0.f, 0.f};
                        if (USE_RAW)
                            w16::mma16816(tmp, za, zb, 0u, 0u, bsum[USE_RAW ? mt : 0], 0u);
                        w16::mma16816(tmp, lo[0], hi[0], lo[1], hi[1], bv[mt][0].x, bv[mt][0].y);
                        w16::mma16816(tmp, lo[2], hi[2], lo[3], hi[3], bv[mt][0].z, bv[mt][0].w);
                        w16::mma16816(tmp, lo[4], hi[4], lo[5], hi[5], bv[mt][1].x, bv[mt][1].y);
                        w16::mma16816(tmp, lo[6], hi[6], lo[7], hi[7], bv[mt][1].z, bv[mt][1].w);
                        acc[r][mt][0] = fmaf(s2.x, tmp[0], acc[r][mt][0]);
                        acc[r][mt][1] = fmaf(s2.x, tmp[1], acc[r][mt][1]);
                        acc[r][mt][2] = fmaf(s2.y, tmp[2], acc[r][mt][2]);
                        acc[r][mt][3] = fmaf(s2.y, tmp[3], acc[r][mt][3]);
                    }
                }
            }
            // ---- the end of a block (or of the run): store it, or hand in this CTA's part
            if (s == SPB - 1 || i == n_units - 1) {          // uniform over the CTA
                const long long ub = (long long)b * SPB;
                if (u0 <= ub && s == SPB - 1) {
                    store(b);                               // the whole block was this CTA's
                } else {
                    // parts of the block: CTAs q0 .. q1, each at slot 2 q + (b is not q's
                    // first block), per m tile
                    const int q0 = owner(ub), parts = owner(ub + SPB - 1) - q0 + 1;
                    auto slot_of = [&](int z) {
                        const long long q = q0 + z;
                        return (size_t)(blockIdx.x * Q + q) * 2 + (q * U / Q / SPB != b);
                    };
                    if (w16::last_of_parts<TPW * LT * 4, NT>(
                            &acc[0][0][0], ws, counters, (size_t)blockIdx.x * nblocks + b,
                            NT * TPW * MT * 4, sLast, slot_of((int)blockIdx.y - q0), parts,
                            slot_of))
                        store(b);
                }
#pragma unroll
                for (int r = 0; r < TPW; ++r)
#pragma unroll
                    for (int mt = 0; mt < LT; ++mt)
#pragma unroll
                        for (int k = 0; k < 4; ++k) acc[r][mt][k] = 0.f;
            }
        }
    });
    w16::cp_wait<0>();                            // nothing in flight at exit
}
