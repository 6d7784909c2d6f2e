// quant_gemm_fp8_gemv.cu: w8a8 fp8 decode rung (v4 of quant_gemm.py): weight streaming.
//
//   c[s] = (deq(a)[s / top_k] @ deq(w[e]).T + bias[e]) * (topk_weights[s] if mul_routed_weight)
//
// for every live position p of sorted_token_ids (as quant_gemm.cu; e == -1 writes zeros), fp8
// e4m3 codes, fp32 accumulation, one rounding to elem_t.
//   a [M_a, Kdim] e4m3 bytes   a_scale [1] | [M_a] | [M_a, KB]      (kind 0 / 1 / 2)
//   w [E, N, Kdim] e4m3 bytes  w_scale [E] | [E, N] | [E, NB, KB]   (kind 0 / 1 / 2)
// Kind 2 together = DeepSeek-V3 block scaling: each 128-wide K block's partial sum is scaled by
// a_scale[row, kb] * w_scale[e, n / 128, kb]; other kinds multiply once at the end.
//
// Decode (a few rows per expert): the job is to read the touched experts' weights once, at
// HBM bandwidth. Design (the int4 decode rung wna16_gemv_v3 does the same for int4):
//   * Roles swapped: 16 weight rows n0..n0+15 are the mma's A (m16n8k32 e4m3, sm_89+), the
//     block's activation rows its B, in MT tiles of 8 tokens; a tile with no live slot is
//     skipped (uniform), so a padded block of 16 with one token costs one tile of mma.
//   * No shared-memory staging and no barrier in the main loop: each thread loads its weight
//     bytes straight into registers (ld.global.nc, L1::no_allocate: read once), U quantization
//     blocks of loads in flight per thread before the first is used; PIPE = 2 double-buffers
//     them (the next U blocks are issued before this round is consumed: no idle gap).
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
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef ELEM_BF16
#error "ELEM_BF16 (1: bf16, 0: fp16) must be #defined by the launcher"
#endif
#if ELEM_BF16
typedef __nv_bfloat16 elem_t;
#else
typedef __half elem_t;
#endif
typedef unsigned char u8;
typedef unsigned int u32;

__device__ __forceinline__ void fg_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void fg_store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ bool fg_live(int s, int num_slots) {
    return (unsigned)s < (unsigned)num_slots;        // padding is num_slots; negatives dropped
}

// The inline PTX of this file. tests/test_quant_fp8_cupy.py runs this source on the CPU with
// QG_EMULATED_PTX #defined and the helpers of tests/test_quant_cupy.py's emulation header
// (qg_ld16*, qg_mma_k32: same semantics, fragment layouts as the PTX ISA says).
#ifdef QG_EMULATED_PTX
template <int PF>
inline void fg_ld16_stream(u32 (&r)[4], const void* p) { qg_ld16_stream(r, p); }
#define fg_ld16 qg_ld16
inline void fg_mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const u32 a[4] = {a0, a1, a2, a3};
    const u32 b[2] = {b0, b1};
    qg_mma_k32(d, a, b);
}
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
__device__ __forceinline__ void fg_ld16(u32 (&r)[4], const void* p) {
    asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
}
// D += A (16x32) * B (32x8), e4m3 x e4m3 -> f32 (fragment layout in the header comment)
__device__ __forceinline__ void fg_mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                       u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();   // fp8 tensor cores start at sm_89; the launcher never sends fp8 here below that
#endif
}
#endif  // QG_EMULATED_PTX

template <int MT, int WARPS, int U, int MINB, int PIPE, int PF>
__global__ void __launch_bounds__(WARPS * 32, MINB)
fp8_gemv_v4(const u8* __restrict__ a, const u8* __restrict__ w, elem_t* __restrict__ c,
            const float* __restrict__ a_scale, const float* __restrict__ w_scale,
            const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
            const int* __restrict__ num_tokens_post_padded, const float* __restrict__ topk_weights,
            const float* __restrict__ bias,
            int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,
            int mul_routed_weight, int a_scale_kind, int w_scale_kind) {
    constexpr int BM = 8 * MT;
    constexpr int NT = WARPS * 32;
    static_assert(BM <= NT, "v4: one thread per tile row reads the slots");
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
    const int s_first = sorted_token_ids[m0];
    if (m0 >= ntpp) return;
    const bool BLOCKWISE = a_scale_kind == 2;                      // uniform over the grid
    const int warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int KB = Kdim / 128;
    const int NB = (N + 127) / 128;
    // 64-bit expert base once, 32-bit offsets inside it (launcher: N * Kdim < 2^31). Rows past
    // N are clamped to N - 1: read, multiplied, never stored.
    const int ec = max(e, 0);
    const u8* wexp = w + (long long)ec * N * Kdim;
    const u8* w0 = wexp + min(n0 + g, N - 1) * Kdim + 16 * t;
    const u8* w1 = wexp + min(n0 + g + 8, N - 1) * Kdim + 16 * t;
    const float* wsrow = w_scale + ((long long)ec * NB + n0 / 128) * KB;   // kind 2 only

    // U blocks of weight loads per thread, issued back to back before the first is used
    auto issue = [&](u32 (&wq)[U][2][2][4], float (&wsc)[U], int kb0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u * WARPS;
            if (kb < KB) {                                         // uniform over the warp
                fg_ld16_stream<PF>(wq[u][0][0], w0 + 128 * kb);
                fg_ld16_stream<PF>(wq[u][1][0], w1 + 128 * kb);
                fg_ld16_stream<PF>(wq[u][0][1], w0 + 128 * kb + 64);
                fg_ld16_stream<PF>(wq[u][1][1], w1 + 128 * kb + 64);
                wsc[u] = BLOCKWISE ? __ldg(wsrow + kb) : 1.f;
            }
        }
    };
    // PIPE = 2: the first round's loads go out before the tile's rows are resolved (a short
    // CTA would otherwise stream nothing during that setup) when the tile is surely live: its
    // first position holds a slot (alignment puts an expert's slots before its padding; if
    // not, the loads simply go out after the setup as with PIPE = 1)
    u32 wa[U][2][2][4], wb[U][2][2][4];
    float sa[U], sb[U];
    const bool early = PIPE == 2 && e >= 0 && fg_live(s_first, num_slots);
    if (early) issue(wa, sa, warp);

    int live = 0;
    if (tid < BM) {
        sSlot[tid] = s_mine;
        sArow[tid] = fg_live(s_mine, num_slots) ? s_mine / top_k : -1;
        live = fg_live(s_mine, num_slots);
    }
    if (__syncthreads_or(live) == 0) return;                      // padding-only tile
    if (e < 0) {                                                   // expert on another rank
        for (int i = tid; i < BM * 16; i += NT) {
            const int r = i / 16, n = n0 + i % 16;
            if (fg_live(sSlot[r], num_slots) && n < N)
                fg_store(c + (long long)sSlot[r] * N + n, 0.f);
        }
        return;
    }
    int arow[MT];               // this thread's token row (column g of the mma's B), -1 padding
    int srow[MT][2];            // the rows of its accumulator columns 2t, 2t + 1 (a_scale)
    bool tile_live[MT];
#pragma unroll
    for (int j = 0; j < MT; ++j) {
        arow[j] = sArow[8 * j + g];
        srow[j][0] = max(sArow[8 * j + 2 * t], 0);
        srow[j][1] = max(sArow[8 * j + 2 * t + 1], 0);
        int any = 0;
#pragma unroll
        for (int r = 0; r < 8; ++r) any |= sArow[8 * j + r] >= 0;
        tile_live[j] = any;                                        // uniform over the CTA
    }

    float acc[MT][4];
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;

    auto consume = [&](const u32 (&wq)[U][2][2][4], const float (&wsc)[U], int kb0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u * WARPS;
            if (kb >= KB) continue;                                // uniform over the warp
#pragma unroll
            for (int jt = 0; jt < MT; ++jt) {
                if (!tile_live[jt]) continue;
                // the same bytes of this thread's token row (L1 / L2 hits: every CTA of this
                // m block reads them), zeros for padding rows
                u32 x[2][4] = {{0u, 0u, 0u, 0u}, {0u, 0u, 0u, 0u}};
                if (arow[jt] >= 0) {
                    const u8* ap = a + (long long)arow[jt] * Kdim + 128 * kb + 16 * t;
                    fg_ld16(x[0], ap);
                    fg_ld16(x[1], ap + 64);
                }
                float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int q = 0; q < 2; ++q)
                        fg_mma(part, wq[u][0][h][2 * q], wq[u][1][h][2 * q],
                               wq[u][0][h][2 * q + 1], wq[u][1][h][2 * q + 1], x[h][2 * q],
                               x[h][2 * q + 1]);
                float s0 = 1.f, s1 = 1.f;
                if (BLOCKWISE) {
                    s0 = __ldg(a_scale + (long long)srow[jt][0] * KB + kb) * wsc[u];
                    s1 = __ldg(a_scale + (long long)srow[jt][1] * KB + kb) * wsc[u];
                }
                acc[jt][0] += part[0] * s0;
                acc[jt][1] += part[1] * s1;
                acc[jt][2] += part[2] * s0;
                acc[jt][3] += part[3] * s1;
            }
        }
    };
    constexpr int STEP = WARPS * U;            // blocks per round of the CTA
    if (PIPE == 1) {
        // one buffer: the loads of a round go out, then the round is consumed
        for (int kb0 = warp; kb0 < KB; kb0 += STEP) {
            u32 wq[U][2][2][4];                // [block][row g / g+8][half][word]
            float wsc[U];
            issue(wq, wsc, kb0);
            consume(wq, wsc, kb0);
        }
    } else {
        // two buffers: the next round's loads are in flight while this one is consumed, so
        // a warp always has U to 2U blocks of loads outstanding (no gap at each round's end)
        if (!early) issue(wa, sa, warp);
        for (int kb0 = warp; kb0 < KB; kb0 += 2 * STEP) {
            issue(wb, sb, kb0 + STEP);
            consume(wa, sa, kb0);
            issue(wa, sa, kb0 + 2 * STEP);
            consume(wb, sb, kb0 + STEP);
        }
    }

    // ---- the warps' partial sums, added in warp order (deterministic)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = 8 * j + 2 * t + (i & 1), nn = g + 8 * (i >> 1);
            sRed[(warp * BM + r) * 16 + nn] = acc[j][i];
        }
    __syncthreads();
    for (int i = tid; i < BM * 16; i += NT) {
        const int r = i / 16, nn = i % 16, n = n0 + nn;
        const int s = sSlot[r];
        if (!fg_live(s, num_slots) || n >= N) continue;
        float v = 0.f;
        for (int wi = 0; wi < WARPS; ++wi) v += sRed[(wi * BM + r) * 16 + nn];
        if (!BLOCKWISE) {
            const float sa = a_scale_kind == 0 ? a_scale[0] : a_scale[sArow[r]];
            const float sw = w_scale_kind == 0 ? w_scale[e] : w_scale[(long long)e * N + n];
            v *= sa * sw;
        }
        if (bias != nullptr) v += bias[(long long)e * N + n];
        if (mul_routed_weight) v *= topk_weights[s];
        fg_store(c + (long long)s * N + n, v);
    }
}

// ============================================================================ v4 persistent
// fp8_gemv_v4p: the same tile work as fp8_gemv_v4 (PIPE 1 rounds), but a grid of G CTAs (about
// MINB per SM, the launcher's choice) walks the tiles: CTA b takes tiles b, b + G, ... (m tile
// fastest, as v4's grid). What it buys: the next tile's header is loaded while this one
// streams, and its first round of weight loads goes out *before* this tile's reduction and
// stores (when it is surely live: e >= 0 and its first position holds a slot), so a CTA keeps
// weight loads in flight across tile boundaries instead of idling through each tile's setup
// and reduction (at decode a tile is only 32-115 KB of weights: those idle phases were a
// third of a v4 CTA's life).
// grid (G), block WARPS * 32, dynamic smem as v4. Same requirements as v4.
template <int MT, int WARPS, int U, int MINB, int PF>
__global__ void __launch_bounds__(WARPS * 32, MINB)
fp8_gemv_v4p(const u8* __restrict__ a, const u8* __restrict__ w, elem_t* __restrict__ c,
             const float* __restrict__ a_scale, const float* __restrict__ w_scale,
             const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
             const int* __restrict__ num_tokens_post_padded,
             const float* __restrict__ topk_weights, const float* __restrict__ bias,
             int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,
             int mul_routed_weight, int a_scale_kind, int w_scale_kind) {
    constexpr int BM = 8 * MT;
    constexpr int NT = WARPS * 32;
    constexpr int STEP = WARPS * U;
    static_assert(BM <= NT, "v4p: one thread per tile row reads the slots");
    extern __shared__ __align__(16) u8 smem[];
    float* sRed = reinterpret_cast<float*>(smem);                  // [WARPS][BM][16]
    int* sArow = reinterpret_cast<int*>(sRed + WARPS * BM * 16);   // [BM] a row, -1 padding
    int* sSlot = sArow + BM;                                       // [BM] slot s

    // positions past num_slots * block_size hold no slot (num_tokens_post_padded <= P * B)
    const int Lg = (int)min((long long)num_positions, (long long)num_slots * block_size);
    const int m_tiles = (Lg + BM - 1) / BM, n_tiles = (N + 15) / 16;
    const int items = m_tiles * n_tiles;
    int i = blockIdx.x;
    if (i >= items) return;
    const int ntpp = num_tokens_post_padded[0];
    const int tid = threadIdx.x;
    const bool BLOCKWISE = a_scale_kind == 2;
    const int warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int KB = Kdim / 128;
    const int NB = (N + 127) / 128;

    // a tile's header: independent loads, one round trip
    int m0, n0, e, s_mine, s_first;
    auto header = [&](int item, int& m0_, int& n0_, int& e_, int& sm_, int& sf_) {
        m0_ = (item % m_tiles) * BM;
        n0_ = (item / m_tiles) * 16;
        e_ = expert_ids[m0_ / block_size];
        sm_ = (tid < BM && m0_ + tid < num_positions) ? sorted_token_ids[m0_ + tid] : num_slots;
        sf_ = sorted_token_ids[m0_];
    };
    const u8* w0;
    const u8* w1;
    const float* wsrow;
    auto point = [&](int e_, int n0_) {                 // the weight rows of a tile
        const int ec = max(e_, 0);
        const u8* wexp = w + (long long)ec * N * Kdim;
        w0 = wexp + min(n0_ + g, N - 1) * Kdim + 16 * t;
        w1 = wexp + min(n0_ + g + 8, N - 1) * Kdim + 16 * t;
        wsrow = w_scale + ((long long)ec * NB + n0_ / 128) * KB;
    };
    auto streams = [&](int m0_, int e_, int sf_) {      // surely live: prefetch is safe
        return m0_ < ntpp && e_ >= 0 && fg_live(sf_, num_slots);
    };
    u32 wq[U][2][2][4];
    float wsc[U];
    auto issue = [&](int kb0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u * WARPS;
            if (kb < KB) {
                fg_ld16_stream<PF>(wq[u][0][0], w0 + 128 * kb);
                fg_ld16_stream<PF>(wq[u][1][0], w1 + 128 * kb);
                fg_ld16_stream<PF>(wq[u][0][1], w0 + 128 * kb + 64);
                fg_ld16_stream<PF>(wq[u][1][1], w1 + 128 * kb + 64);
                wsc[u] = BLOCKWISE ? __ldg(wsrow + kb) : 1.f;
            }
        }
    };
    int arow[MT], srow[MT][2];
    bool tile_live[MT];
    float acc[MT][4];
    auto consume = [&](int kb0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u * WARPS;
            if (kb >= KB) continue;
#pragma unroll
            for (int jt = 0; jt < MT; ++jt) {
                if (!tile_live[jt]) continue;
                u32 x[2][4] = {{0u, 0u, 0u, 0u}, {0u, 0u, 0u, 0u}};
                if (arow[jt] >= 0) {
                    const u8* ap = a + (long long)arow[jt] * Kdim + 128 * kb + 16 * t;
                    fg_ld16(x[0], ap);
                    fg_ld16(x[1], ap + 64);
                }
                float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int q = 0; q < 2; ++q)
                        fg_mma(part, wq[u][0][h][2 * q], wq[u][1][h][2 * q],
                               wq[u][0][h][2 * q + 1], wq[u][1][h][2 * q + 1], x[h][2 * q],
                               x[h][2 * q + 1]);
                float s0 = 1.f, s1 = 1.f;
                if (BLOCKWISE) {
                    s0 = __ldg(a_scale + (long long)srow[jt][0] * KB + kb) * wsc[u];
                    s1 = __ldg(a_scale + (long long)srow[jt][1] * KB + kb) * wsc[u];
                }
                acc[jt][0] += part[0] * s0;
                acc[jt][1] += part[1] * s1;
                acc[jt][2] += part[2] * s0;
                acc[jt][3] += part[3] * s1;
            }
        }
    };

    header(i, m0, n0, e, s_mine, s_first);
    point(e, n0);
    bool pre = streams(m0, e, s_first);                 // wq holds this tile's first round
    if (pre) issue(warp);
    for (; i < items; i += gridDim.x) {
        // the next tile's header, in flight while this one streams
        const int i2 = i + gridDim.x;
        int m0n = 0, n0n = 0, en = -1, smn = num_slots, sfn = num_slots;
        if (i2 < items) header(i2, m0n, n0n, en, smn, sfn);

        int live = 0;
        if (tid < BM) {
            const int s = m0 < ntpp ? s_mine : num_slots;
            sSlot[tid] = s;
            sArow[tid] = fg_live(s, num_slots) ? s / top_k : -1;
            live = fg_live(s, num_slots);
        }
        const int any = __syncthreads_or(live);
        bool pre_next = false;
        if (any && e < 0) {                                         // expert on another rank
            for (int k = tid; k < BM * 16; k += NT) {
                const int r = k / 16, n = n0 + k % 16;
                if (fg_live(sSlot[r], num_slots) && n < N)
                    fg_store(c + (long long)sSlot[r] * N + n, 0.f);
            }
        } else if (any) {
#pragma unroll
            for (int j = 0; j < MT; ++j) {
                arow[j] = sArow[8 * j + g];
                srow[j][0] = max(sArow[8 * j + 2 * t], 0);
                srow[j][1] = max(sArow[8 * j + 2 * t + 1], 0);
                int anyj = 0;
#pragma unroll
                for (int r = 0; r < 8; ++r) anyj |= sArow[8 * j + r] >= 0;
                tile_live[j] = anyj;
#pragma unroll
                for (int q = 0; q < 4; ++q) acc[j][q] = 0.f;
            }
            for (int kb0 = warp; kb0 < KB; kb0 += STEP) {
                if (!(pre && kb0 == warp)) issue(kb0);
                consume(kb0);
            }
            // the next tile's first round goes out now, before this tile's reduction
            if (i2 < items && streams(m0n, en, sfn)) {
                point(en, n0n);
                issue(warp);
                pre_next = true;
            }
#pragma unroll
            for (int j = 0; j < MT; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int r = 8 * j + 2 * t + (q & 1), nn = g + 8 * (q >> 1);
                    sRed[(warp * BM + r) * 16 + nn] = acc[j][q];
                }
            __syncthreads();
            for (int k = tid; k < BM * 16; k += NT) {
                const int r = k / 16, nn = k % 16, n = n0 + nn;
                const int s = sSlot[r];
                if (!fg_live(s, num_slots) || n >= N) continue;
                float v = 0.f;
                for (int wi = 0; wi < WARPS; ++wi) v += sRed[(wi * BM + r) * 16 + nn];
                if (!BLOCKWISE) {
                    const float sa = a_scale_kind == 0 ? a_scale[0] : a_scale[sArow[r]];
                    const float sw = w_scale_kind == 0 ? w_scale[e] : w_scale[(long long)e * N + n];
                    v *= sa * sw;
                }
                if (bias != nullptr) v += bias[(long long)e * N + n];
                if (mul_routed_weight) v *= topk_weights[s];
                fg_store(c + (long long)s * N + n, v);
            }
        }
        __syncthreads();                    // sSlot / sRed are rewritten by the next tile
        m0 = m0n; n0 = n0n; e = en; s_mine = smn; s_first = sfn;
        if (!pre_next) point(e, n0);
        pre = pre_next;
    }
}
