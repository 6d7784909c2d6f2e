// wna16_v4_packed.cu: rung 4 of the weight-only grouped GEMM: decode on int4 weights prepacked
// so that every warp load is the lanes' mma fragments.
//
//   c[s, n] = (sum_k a[s / top_k, k] (q[e, n, k] - zp[e, n, k / gs]) s[e, n, k / gs] + bias[e, n])
//             * r[s]
//   for every live position p < num_tokens_post_padded with s = sorted_token_ids[p] < P and
//   e = expert_ids[p / block_size] (e == -1: c[s] = 0). r = topk_weights.flat when
//   mul_routed_weight, else 1. fp32 accumulation, one rounding to elem_t.
//
// The lesson: rung 3 spends its instructions putting codes where the mma wants them. Reorder
// the weights once, at weight-load time (quant/wna16_packed.py's prepack_int4), and a warp load
// instruction reads 512 contiguous bytes in which each lane's 16 bytes are exactly its mma A
// fragments for one 64-code chunk of 16 weight rows: no shuffle, no permutation of the
// activations, one shift and one lop3 per pair of codes. The router's rung up to 8 rows per
// expert (config q8).
//
//   packed layout  wp [E][N / 16 tiles][Kdim / 64 chunks][32 lanes][4 words]
//                  lane (g, t) of tile nt, chunk c: codes k = 64 c + 16 t + 0..15 of weight
//                  rows n = 16 nt + g (words 0, 2) and 16 nt + g + 8 (words 1, 3); word 0 / 1
//                  hold codes 0..7, words 2 / 3 codes 8..15; in a word, the pair p (p = 0..3)
//                  of codes (2p, 2p + 1) sits in bits 4p..4p+3 and 16+4p..16+4p+3, so that
//                  ((x >> 4p) & 0x000F000F) | QG_MAGIC is the elem2 pair (128 + q_2p,
//                  128 + q_2p+1) in memory order: the activations need no permutation.
//                  sp [E][N / 16][G][8 g] float2 = (s[16 nt + g], s[16 nt + g + 8]) of group G;
//                  zp [E][N / 16][G][8 g] u16 = the same rows' zero points (lo byte, hi byte).
//   mma m (m = 0..3) of a chunk covers codes 16 t + 4 m .. + 3 of the lane: A = pairs
//   (2 (m & 1), 2 (m & 1) + 1) of the row-g / row-g+8 words (m < 2: words 0 / 1, else 2 / 3),
//   B = the same 4 codes of the lane's token (column g of the tile), two pairs of a 16-byte
//   load of a at k = 64 c + 16 t (+ 8): the A and B k slots hold the same codes.
//   Dequantization: one shift and one lop3 per pair give 128 + q, one hsub2 per pair subtracts
//   128 + zp (exact in elem2): 16 hsub2 per chunk. The group scale then multiplies the chunk's
//   fp32 partial (needs group_size % 64 == 0).
//   Why this shape (H200, Mixtral T=1 GEMM1, ncu): the rung is instruction-bound (issue ~60%
//   busy, ALU pipe ~55%, 'wait' stalls first), so the count of instructions per chunk is what
//   the layout and the pointer-walking ring minimise.
//   Measured and taken out (git history has them): the zero point taken off by one more mma per
//   chunk on the activations' chunk sums (a kernel before the GEMM made them) cost more than
//   the 16 hsub2 it saved (q8 68 / 234 / 567 against 75 / 239 / 573 us at T = 1 / 16 / 64); a
//   ring in shared memory filled by cp.async, so that 3-4 live token tiles keep two items in
//   flight without spilling, was faster at one live tile and slower at 2-3.
//
// A CTA owns one m tile (BM = 8 MT positions, one expert) and tiles_per_cta consecutive 16-row
// n tiles; its W warps split each tile's chunks (warp w takes chunks w, w + W, ...: the CTA
// reads 512 W contiguous bytes at a time) and their partials of red_groups groups of RT tiles
// meet in shared memory at one barrier (two halves of red_groups slots: a half is rewritten
// only after the next barrier), added in warp order (deterministic).
// Live token tiles: the CTA computes its first LT token tiles only, LT = 1 + the last tile
// holding a live position (an expert's live rows are a prefix of its block; a padding tile
// before a live one would be computed, never stored), and LT is a compile-time constant of
// the code that runs (w16::with_count: one instantiation per LT <= MT).
// Why: with a run-time test per tile, each tile's mma chain sat in its own branch, the chains
// could not overlap, and a 16-token CTA ran ~60% slower than an 8-token one at the same work
// (H200, Mixtral: MT = 2 against MT = 1 at T=1 and 16).
// Each warp walks its (tile, chunk) items through a register ring of D items in flight per
// lane (16 bytes of codes plus the two rows' scales), across tile boundaries, so a barrier does
// not drain the loads at once.
// Activations are read through L1 (16-byte __ldg, 2 per chunk and live token tile), padding
// columns read a live row (never stored).
//
// wna16_v4_packed<MT, W, D, ZP, RT, MINB>
// Launch: grid (cdiv(Lg, BM), cdiv(N / 16, tiles_per_cta)), block 32 W, static shared memory
// 8 BM bytes, dynamic 2 red_groups W RT BM 17 4 bytes (the warps' partials); Lg = min(L, P *
// block_size): no live position lies past it.
// Needs int4, N % 16 == 0, Kdim % 64 == 0, group_size a multiple of 64 with chunks-per-group a
// power of two (chunk_shift = log2; or one group per row: 30), 16-byte aligned a, BM |
// block_size (the launcher checks).
// ELEM_BF16 (#define 1 or 0) picks elem_t = __nv_bfloat16 or __half.
// Run: python -m cuda_kernels.cupy.quant.wna16 [--quick]
#include "wna16_common.cuh"

template <int MT, int W, int D, int ZP, int RT, int MINB>
__global__ void __launch_bounds__(W * 32, MINB)
wna16_v4_packed(W16_PACKED_ARGS, int tiles_per_cta, int red_groups) {
    constexpr int BM = 8 * MT;
    constexpr int RS = 17;                        // padded row of the partials: fewer conflicts
    __shared__ int sSlot[BM];                     // slot s, or -1 (padding)
    __shared__ int sArow[BM];                     // its row of a, or -1

    const int m0 = blockIdx.x * BM;
    if (!w16::load_m_tile<BM>(m0, sorted_token_ids, num_tokens_post_padded, num_slots, top_k,
                              num_positions, sSlot, sArow))
        return;                                   // padding only
    const int tid = threadIdx.x;
    const int e = expert_ids[m0 / block_size];    // BM divides block_size: one expert
    const int ntiles = N >> 4;
    const int t0 = blockIdx.y * tiles_per_cta;
    const int t1 = min(ntiles, t0 + tiles_per_cta);
    if (t0 >= t1) return;
    if (e < 0) {                                  // expert of another rank: zeros
        w16::store_zeros<BM>(c, sSlot, N, t0 * 16, (t1 - t0) * 16, W * 32);
        return;
    }

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int C = Kdim >> 6;                      // 64-code chunks per row
    // this lane's token rows (column g of each tile of 8), padding -> a live row (its column
    // of the accumulators is never stored); the live tiles: up to the last with a live row
    int first = 0, live_tiles = 0;
    for (int r = BM - 1; r >= 0; --r)
        if (sArow[r] >= 0) {
            first = sArow[r];
            if (!live_tiles) live_tiles = r / 8 + 1;
        }
    const elem_t* arow[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int r = sArow[8 * mt + g] >= 0 ? sArow[8 * mt + g] : first;
        arow[mt] = a + (size_t)r * Kdim + 16 * t;
    }

    const int CPW = (C + W - 1) / W;              // chunks per warp per tile
    // 32-bit offsets inside the expert (the launcher checks N * Kdim / 2 < 2^31)
    const uint4* wexp = wp + (size_t)e * ntiles * C * 32 + lane;
    const float2* sexp = sp + (size_t)e * ntiles * num_groups * 8 + g;
    const unsigned short* zexp = zp + (ZP ? (size_t)e * ntiles * num_groups * 8 + g : 0);
    const u32 zdef = qg_magic_pair((u32)default_zp);

    // dynamic shared memory: the warps' partials [2 halves][red_groups][W][RT][BM][RS] fp32
    extern __shared__ __align__(128) u8 smem[];   // 128: see wna16_common.cuh
    float* sRed = reinterpret_cast<float*>(smem);

    // ---- the ring: D items (16 bytes of codes + the two rows' scales) in flight per lane,
    // walked in rounds of D items (CPW is a multiple of D: a round never crosses a tile).
    // Item u of a round is chunk c0 + u W of the round's tile: its codes lie u W 512 bytes
    // after the round's pointer, its activations u W 64 elements on (immediate offsets, no
    // index arithmetic per item). Each slot is refilled right after its math, from the next
    // round (its registers are free by then: no copies).
    uint4 rw[D][RT];
    float2 rs[D][RT];
    u32 rz[ZP ? D : 1][RT];
    const int RPT = CPW / D;                      // rounds per tile (group of RT tiles)
    const int tstride = C * 32;                   // uint4 from a tile's chunk to the next tile's
    // the next round to load: its tile, first chunk, code pointer, the tile's scale rows
    int n_tile = t0, n_c0 = warp;
    const uint4* n_w = wexp + ((size_t)t0 * C + warp) * 32;
    const float2* n_s = sexp + (size_t)t0 * num_groups * 8;
    const unsigned short* n_z = ZP ? zexp + (size_t)t0 * num_groups * 8 : nullptr;
    auto load = [&](int u) {                      // slot u from the round n_*
        const int chunk = n_c0 + u * W;
        if (n_tile < t1 && chunk < C) {           // past C (C % W != 0): never consumed
            const int grp8 = (chunk >> chunk_shift) * 8;
#pragma unroll
            for (int r = 0; r < RT; ++r) {        // the group's RT tiles: one tile apart
                const uint4* src = n_w + u * W * 32 + r * tstride;
                const float2* ssrc = n_s + r * num_groups * 8 + grp8;
                const unsigned short* zsrc = n_z + r * num_groups * 8 + grp8;
                rw[u][r] = w16::ld_stream(reinterpret_cast<const u8*>(src));
                rs[u][r] = __ldg(ssrc);
                if (ZP) rz[ZP ? u : 0][r] = __ldg(zsrc);
            }
        }
    };
    auto next_round = [&]() {
        n_c0 += D * W;
        n_w += D * W * 32;
        if (n_c0 >= warp + CPW * W) {             // the group's last round was loaded
            n_c0 = warp;
            n_tile += RT;
            n_w += (RT * C - CPW * W) * 32;
            n_s += RT * num_groups * 8;
            if (ZP) n_z += RT * num_groups * 8;
        }
    };
#pragma unroll
    for (int u = 0; u < D; ++u) load(u);
    next_round();

    // the rest runs with LT, the live token tiles, a compile-time constant
    w16::with_count<1, MT>(live_tiles, [&](auto live_count) {
        constexpr int LT = decltype(live_count)::value;
        float acc[RT][LT][4] = {};

        // one item: the math of slot u (chunk c), then the slot's refill from the next round
        auto item = [&](int u, int c, bool check) {
            if (!check || c < C) {                    // uniform over the warp
                // B: the lane's token rows, loaded once for the RT weight tiles of the group
                uint4 b[LT][2];
#pragma unroll
                for (int mt = 0; mt < LT; ++mt) {
                    const uint4* ap = reinterpret_cast<const uint4*>(arow[mt] + c * 64);
                    b[mt][0] = __ldg(ap);
                    b[mt][1] = __ldg(ap + 1);
                }
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    const uint4 x = rw[u][r];
                    const float2 s2 = rs[u][r];
                    u32 zl = zdef, zh = zdef;         // (128 + zp) in both halves, rows g, g + 8
                    if (ZP) {                         // z: row g's zero point in the low byte
                        const u32 z = rz[ZP ? u : 0][r];
                        zl = qg_magic_pair(z & 0xFFu);
                        zh = qg_magic_pair((z >> 8) & 0xFFu);
                    }
                    // A: pairs of row g (words x, z) and row g + 8 (words y, w) as q - zp: one
                    // lop3 (and one shift) per pair give 128 + q, one hsub2 takes 128 + zp off
                    u32 lo[8], hi[8];
                    w16::raw_pairs(x, QG_MAGIC, lo, hi);
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        lo[i] = w16::as_u32(__hsub2(w16::as_e2(lo[i]), w16::as_e2(zl)));
                        hi[i] = w16::as_u32(__hsub2(w16::as_e2(hi[i]), w16::as_e2(zh)));
                    }
#pragma unroll
                    for (int mt = 0; mt < LT; ++mt) {
                        float tmp[4] = {0.f, 0.f, 0.f, 0.f};
                        w16::mma16816(tmp, lo[0], hi[0], lo[1], hi[1], b[mt][0].x, b[mt][0].y);
                        w16::mma16816(tmp, lo[2], hi[2], lo[3], hi[3], b[mt][0].z, b[mt][0].w);
                        w16::mma16816(tmp, lo[4], hi[4], lo[5], hi[5], b[mt][1].x, b[mt][1].y);
                        w16::mma16816(tmp, lo[6], hi[6], lo[7], hi[7], b[mt][1].z, b[mt][1].w);
                        acc[r][mt][0] = fmaf(s2.x, tmp[0], acc[r][mt][0]);
                        acc[r][mt][1] = fmaf(s2.x, tmp[1], acc[r][mt][1]);
                        acc[r][mt][2] = fmaf(s2.y, tmp[2], acc[r][mt][2]);
                        acc[r][mt][3] = fmaf(s2.y, tmp[3], acc[r][mt][3]);
                    }
                }
            }
            load(u);                                  // refill: the slot is free
        };
        constexpr int LM = 8 * LT;                    // the live tiles' rows
        constexpr int GSZ = W * RT * BM * RS;        // floats of one group's partials
        // the outputs of ngroups consecutive groups from their partials at red0 (the first group
        // starts at tile tile0): the W warps' partials added in warp order, then bias and router
        // weight
        auto reduce_store = [&](const float* red0, int ngroups, int tile0) {
            for (int i = tid; i < ngroups * RT * LM * 16; i += W * 32) {
                const int gi = i / (RT * LM * 16), rem = i - gi * (RT * LM * 16);
                const int r = rem / (LM * 16), tok = (rem >> 4) % LM;
                const int n = (tile0 + gi * RT + r) * 16 + (i & 15);
                const int s = sSlot[tok];
                if (s < 0) continue;
                float v = 0.f;
#pragma unroll
                for (int wi = 0; wi < W; ++wi)
                    v += red0[(size_t)gi * GSZ + ((wi * RT + r) * BM + tok) * RS + (i & 15)];
                if (bias != nullptr) v += bias[(size_t)e * N + n];
                if (mul_routed_weight) v *= topk_weights[s];
                c[(size_t)s * N + n] = w16::from_f32(v);
            }
        };
        int grp = 0;                                  // groups of this CTA so far
        // groups of RT tiles (the launcher makes TPC a multiple of RT)
        for (int tile = t0; tile < t1; tile += RT) {
            for (int rd = 0; rd < RPT; ++rd) {
                const int c0 = warp + rd * D * W;
                if (c0 + (D - 1) * W < C) {           // a full round: no per-item check
#pragma unroll
                    for (int u = 0; u < D; ++u) item(u, c0 + u * W, false);
                } else {
#pragma unroll
                    for (int u = 0; u < D; ++u) item(u, c0 + u * W, true);
                }
                next_round();
            }
            // ---- this warp's partials of the group into its slot
            const int slot = grp % red_groups, use = grp / red_groups;
            float* red = sRed + (size_t)((use & 1) * red_groups + slot) * GSZ;
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int mt = 0; mt < LT; ++mt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int row = 8 * mt + 2 * t + (i & 1), col = g + 8 * (i >> 1);
                        red[((warp * RT + r) * BM + row) * RS + col] = acc[r][mt][i];
                        acc[r][mt][i] = 0.f;
                    }
            ++grp;
            if (slot == red_groups - 1 || tile + RT >= t1) {   // uniform over the CTA
                // the partials of this half's slot + 1 groups meet at one barrier
                __syncthreads();
                reduce_store(sRed + (size_t)(use & 1) * red_groups * GSZ, slot + 1,
                             tile - slot * RT);
            }
        }
    });
}
