// Weight-only grouped GEMM of the fused MoE layer (int4 / int8 weights, bf16 / fp16
// activations), built for decode: stream the packed weights at HBM bandwidth.
//
//   c[s, n] = (sum_k a[s / top_k, k] * (q[e, n, k] - zp[e, n, k / gs]) * s[e, n, k / gs]
//              + bias[e, n]) * r[s]
//   for every live position p < num_tokens_post_padded with s = sorted_token_ids[p] < P and
//   e = expert_ids[p / block_size] (e == -1: c[s] = 0). r = topk_weights.flat when
//   mul_routed_weight, else 1. fp32 accumulation, one rounding to elem_t.
//
// Shapes: a [M_a, K] elem_t; w [E, N, K / 2] uint8 (int4, k = 2j in the low nibble of byte j)
// or [E, N, K] uint8 (int8; int8 codes travel as their bytes with code_xor = 0x80);
// w_scale [E, N, G] fp32; w_zp [E, N, G] uint8 or null (default_zp then); c [P, N].
//
// Three rungs (the older tile rungs live in quant_gemm.cu):
//   wna16_stream<NBITS, POST, MT, WN, U, MINB>   weights straight from HBM into registers
//   wna16_async<NBITS, POST, MT, WN, STAGES, MINB> weights through a per-warp cp.async ring
//   wna16_packed<MT, W, D, ZP, POST, RT, MINB, SR> int4 prepacked at weight-load time (its own
//                                                header below): 512-byte warp loads that are
//                                                the mma fragments, K split over the warps
// The first two share the lane layout, the activation staging, step_math and the epilogue:
//
//     Weights are the mma's A operand (m16 = 16 weight rows), activations its B (n8 = 8
//     tokens, MT tiles of them: BM = 8 MT positions of sorted_token_ids per CTA).
//     A CTA owns BM positions (one expert: BM divides block_size), 16 WN weight rows (one
//     warp per 16 rows) and one K split of SPS steps of 128 (grid.z = KS splits).
//     Lane (g = lane / 4, t = lane % 4) of a warp works, per 128-K step, on the 32 codes
//     k0 + 32 t .. + 31 of rows g and g + 8 (int4: 16 bytes per row; int8: 32).
//       stream: the lane loads them itself (16-byte loads, U steps in flight in registers).
//         Measured (slot 1): ~1.3 TB/s at most: each warp load touches 8 rows x 64 B.
//       async: the warp copies STAGES stages of 4 steps into its own shared ring with
//         whole-line requests (16 lanes read 256 contiguous bytes of one row), with the
//         scales of every (step, t) alongside (4-byte copies); __syncwarp only, no CTA
//         barrier in the main loop; each lane then reads its 16 bytes per row from shared
//         memory (rows padded by 16 bytes: conflict-free).
//     The order of k inside the mma is free (a dot product), so the mma's logical k is a
//     permutation of the real one: for every 8 codes the magic-number int4 -> bf16 trick
//     yields the pairs (k0, k4), (k1, k5), (k2, k6), (k3, k7) (one shift and one lop3 each),
//     and the activations are staged once per CTA in shared memory in that same order
//     [a0 a4 a1 a5 a2 a6 a3 a7] (16 bytes per lane per 8 codes, conflict-free layout).
//     Dequantization (POST = 0): (128 + q) - (128 + zp) is exact in bf16 (1024 in fp16),
//     then one multiply by the group scale rounded to elem_t (weights rounded once, as a bf16
//     model's). int8 goes through fp32 (2^23 + q), since bf16 has only 8 significant bits.
//     POST = 1 (int4, group_size % 128 == 0: one group per step): the mma multiplies the raw
//     magic values 128 + q, and per step s * (acc_step - (128 + zp) * sum_k a) is added in
//     fp32, with sum_k a per (step, token) staged beside the activations.
//     Split K (KS > 1): each CTA stores its fp32 partials to a workspace, the last CTA of a
//     tile to arrive (a per-tile counter, reset by that CTA for the next launch) adds the KS
//     partials in split order (deterministic) and runs the epilogue.
//     grid (cdiv(Lg, BM), cdiv(N, 16 WN), KS), block 32 WN, dynamic shared memory
//     round16(BM * SPS * 260) (activations and their step sums) + async's rings
//     WN * STAGES * (16 * (4 * 16 * NBITS + 16) + 1024).
//     Lg = min(L, P * block_size): no live position lies past it.
//
// Needs K % 32 == 0, group_size % 32 == 0 (a lane's 32 codes lie in one group), a and w
// 16-byte aligned, BM | block_size (the launcher checks and refuses the rest clearly).
// ELEM_BF16 (#define 1 or 0) picks elem_t = __nv_bfloat16 or __half.
// Run: python -m cuda_kernels.cupy.quant_gemm_wna16 [--quick]
#include "wna16_common.cuh"

// One 128-K step of one warp: the lane's 32 codes of rows g and g + 8 (cw), their scales and
// zero points, the staged activations of the step (a_st, and their sums sum_st for POST),
// accumulated into acc (the m16n8 C fragments of the MT token tiles).
template <int NBITS, int POST, int MT>
__device__ __forceinline__ void step_math(const uint4 (&cw)[2][NBITS / 4], float s_lo,
                                          float s_hi, int z_lo, int z_hi, const uint4* a_st,
                                          const float* sum_st, float (&acc)[MT][4], int g, int t,
                                          int code_xor) {
    constexpr int BM = 8 * MT;
    constexpr int CH = NBITS / 4;
    if (POST) {
        // int4 with one group per step: the mma sees the raw magic values
        // 128 + q (exact, 1024 + q for fp16), per step in fresh accumulators; then
        // sum_k (q - zp) a s = s (sum_k (128 + q) a - (128 + zp) sum_k a), with
        // sum_k a of the step staged beside the activations. One lop3 (and one
        // shift) per pair, nothing else: the dequantization is off the hot path.
        float tmp[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < 4; ++i) tmp[mt][i] = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 wl = j == 0 ? cw[0][0].x : j == 1 ? cw[0][0].y
                         : j == 2 ? cw[0][0].z : cw[0][0].w;
            const u32 wh = j == 0 ? cw[1][0].x : j == 1 ? cw[1][0].y
                         : j == 2 ? cw[1][0].z : cw[1][0].w;
            const u32 l0 = (wl & 0x000F000Fu) | W16_MAGIC;
            const u32 l1 = ((wl >> 4) & 0x000F000Fu) | W16_MAGIC;
            const u32 l2 = ((wl >> 8) & 0x000F000Fu) | W16_MAGIC;
            const u32 l3 = ((wl >> 12) & 0x000F000Fu) | W16_MAGIC;
            const u32 h0 = (wh & 0x000F000Fu) | W16_MAGIC;
            const u32 h1 = ((wh >> 4) & 0x000F000Fu) | W16_MAGIC;
            const u32 h2 = ((wh >> 8) & 0x000F000Fu) | W16_MAGIC;
            const u32 h3 = ((wh >> 12) & 0x000F000Fu) | W16_MAGIC;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const uint4 b = a_st[(j * BM + mt * 8 + g) * 4 + t];
                w16::mma16816(tmp[mt], l0, h0, l1, h1, b.x, b.y);
                w16::mma16816(tmp[mt], l2, h2, l3, h3, b.z, b.w);
            }
        }
            const float zl = W16_MAGIC_F + z_lo, zh = W16_MAGIC_F + z_hi;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const float2 as = *reinterpret_cast<const float2*>(sum_st + mt * 8 +
                                                                 2 * t);
            acc[mt][0] += s_lo * (tmp[mt][0] - zl * as.x);
            acc[mt][1] += s_lo * (tmp[mt][1] - zl * as.y);
            acc[mt][2] += s_hi * (tmp[mt][2] - zh * as.x);
            acc[mt][3] += s_hi * (tmp[mt][3] - zh * as.y);
        }
        return;
    }
    u32 zl2, zh2, sl2, sh2;
    float zfl = 0.f, zfh = 0.f;
    if (NBITS == 4) {
        zl2 = w16::pack2(W16_MAGIC_F + z_lo, W16_MAGIC_F + z_lo);
        zh2 = w16::pack2(W16_MAGIC_F + z_hi, W16_MAGIC_F + z_hi);
        sl2 = w16::pack2(s_lo, s_lo);
        sh2 = w16::pack2(s_hi, s_hi);
    } else {
        zfl = 8388608.f + z_lo;
        zfh = 8388608.f + z_hi;
        zl2 = zh2 = sl2 = sh2 = 0;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 l0, l1, l2, l3, h0, h1, h2, h3;
        if (NBITS == 4) {
            const u32 wl = j == 0 ? cw[0][0].x : j == 1 ? cw[0][0].y
                         : j == 2 ? cw[0][0].z : cw[0][0].w;
            const u32 wh = j == 0 ? cw[1][0].x : j == 1 ? cw[1][0].y
                         : j == 2 ? cw[1][0].z : cw[1][0].w;
            w16::deq_int4(wl, zl2, sl2, l0, l1, l2, l3);
            w16::deq_int4(wh, zh2, sh2, h0, h1, h2, h3);
        } else {
            // 8 codes = words 2j, 2j+1 of the lane's 32 bytes
            const uint4 ql = cw[0][CH - 1 >= 1 ? (j >> 1) : 0];
            const uint4 qh = cw[1][CH - 1 >= 1 ? (j >> 1) : 0];
            u32 a0 = (j & 1) ? ql.z : ql.x, a1 = (j & 1) ? ql.w : ql.y;
            u32 b0 = (j & 1) ? qh.z : qh.x, b1 = (j & 1) ? qh.w : qh.y;
            const u32 xm = code_xor * 0x01010101u;
            w16::deq_int8(a0 ^ xm, a1 ^ xm, zfl, s_lo, l0, l1, l2, l3);
            w16::deq_int8(b0 ^ xm, b1 ^ xm, zfh, s_hi, h0, h1, h2, h3);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const uint4 b = a_st[(j * BM + mt * 8 + g) * 4 + t];
            w16::mma16816(acc[mt], l0, h0, l1, h1, b.x, b.y);
            w16::mma16816(acc[mt], l2, h2, l3, h3, b.z, b.w);
        }
    }
}

template <int NBITS, int POST, int MT, int WN, int U, int MINB>
__global__ void __launch_bounds__(WN * 32, MINB)
wna16_stream(const elem_t* __restrict__ a, const u8* __restrict__ w, elem_t* __restrict__ c,
             const float* __restrict__ w_scale, const u8* __restrict__ w_zp,
             const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
             const int* __restrict__ num_tokens_post_padded,
             const float* __restrict__ topk_weights, const float* __restrict__ bias,
             float* __restrict__ ws, int* __restrict__ counters,
             int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,
             int mul_routed_weight, int group_size, int num_groups, int default_zp,
             int code_xor, int steps_per_split) {
    // the group of a code: a shift for power-of-two group sizes (an integer division is
    // ~20 instructions, per step and lane)
    const int gs_shift = (group_size & (group_size - 1)) == 0 ? __ffs(group_size) - 1 : -1;
    constexpr int BM = 8 * MT;
    constexpr int NT = WN * 32;
    constexpr int CH = NBITS / 4;                 // 16-byte chunks per row per lane per step
    extern __shared__ __align__(128) u8 smem[];   // 128: see wna16_common.cuh
    uint4* sA = reinterpret_cast<uint4*>(smem);   // [SPS][4 j][BM][4 t] 16-byte units
    __shared__ int sSlot[BM];                     // slot s, or -1 (padding)
    __shared__ int sArow[BM];                     // its row of a: s / top_k
    __shared__ int sLast;

    const int m0 = blockIdx.x * BM;
    if (m0 >= num_positions) return;
    const int tid = threadIdx.x;
    // three independent loads in flight together: a padding CTA pays one round trip
    const int ntp = num_tokens_post_padded[0];
    const int e = expert_ids[m0 / block_size];    // BM divides block_size: one expert
    const int s_mine = (tid < BM && m0 + tid < num_positions) ? sorted_token_ids[m0 + tid] : -1;
    if (m0 >= ntp) return;
    int live = 0;
    if (tid < BM) {
        live = s_mine >= 0 && s_mine < num_slots;
        sSlot[tid] = live ? s_mine : -1;
        sArow[tid] = live ? s_mine / top_k : 0;   // once per row, not per staged unit
    }
    if (!__syncthreads_or(live)) return;          // all padding (every split agrees)
    const int n_cta = blockIdx.y * (16 * WN);
    if (e < 0) {                                  // expert of another rank: zeros, once
        if (blockIdx.z == 0) w16::store_zeros<BM>(c, sSlot, N, n_cta, 16 * WN, NT);
        return;
    }

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int ksteps = (Kdim + 127) >> 7;
    const int s_begin = blockIdx.z * steps_per_split;
    const int s_end = min(ksteps, s_begin + steps_per_split);
    const int row_bytes = Kdim * NBITS / 8;
    const int n_lo = n_cta + warp * 16 + g, n_hi = n_lo + 8;
    const bool ok_lo = n_lo < N, ok_hi = n_hi < N;
    const u8* w_e = w + (size_t)e * N * row_bytes;     // 64-bit expert base, 32-bit inside
    const u8* w_lo = w_e + (size_t)(ok_lo ? n_lo : 0) * row_bytes + t * 16 * CH;
    const u8* w_hi = w_e + (size_t)(ok_hi ? n_hi : 0) * row_bytes + t * 16 * CH;
    const size_t sc_e = (size_t)e * N * num_groups;
    const int sc_lo = (ok_lo ? n_lo : 0) * num_groups, sc_hi = (ok_hi ? n_hi : 0) * num_groups;

    // ---- the register ring: U steps of weights (and their scales) in flight per lane
    uint4 wr[U][2][CH];
    float sr[U][2];
    int zr[U][2];
    auto load_step = [&](int st, int u) {
        // No predicates, no branches: the address is clamped inside the split and the row
        // (rows past N were clamped to row 0 above). What a clamped load brings is never
        // stored: a slot past s_end is never consumed, rows past N only reach C rows the
        // epilogue skips, and codes past Kdim (a tail step) meet staged zero activations.
        const int stc = max(0, min(st, s_end - 1));
        const int kc = min(stc * 128 + t * 32, Kdim - 32);   // this lane's first code
        const int off = kc * CH / 2;                          // its byte offset in the row
#pragma unroll
        for (int ch = 0; ch < CH; ++ch) {
            wr[u][0][ch] = w16::ld_stream(w_lo - t * 16 * CH + off + 16 * ch);
            wr[u][1][ch] = w16::ld_stream(w_hi - t * 16 * CH + off + 16 * ch);
        }
        // POST folds the scale after the mma, which sums the step's 4 lanes: every lane takes
        // the scale of the step's group (one per step)
        const int kq = POST ? stc * 128 : kc;
        const int grp = w16::group_of(kq, group_size, gs_shift, num_groups);
        sr[u][0] = __ldg(w_scale + sc_e + sc_lo + grp);
        sr[u][1] = __ldg(w_scale + sc_e + sc_hi + grp);
        if (w_zp != nullptr) {
            zr[u][0] = __ldg(w_zp + sc_e + sc_lo + grp);
            zr[u][1] = __ldg(w_zp + sc_e + sc_hi + grp);
        } else {
            zr[u][0] = default_zp;
            zr[u][1] = default_zp;
        }
    };
#pragma unroll
    for (int u = 0; u < U; ++u) load_step(s_begin + u, u);

    // ---- stage this split's activations, permuted [a0 a4 a1 a5 a2 a6 a3 a7] per 8 codes.
    // Only live tokens: a padding column of B only reaches the same column of the
    // accumulators, which the epilogue never stores, so its shared memory stays unwritten.
    __shared__ int sLive[BM];
    __shared__ int sNumLive;
    if (tid == 0) {
        int nl = 0;
        for (int r = 0; r < BM; ++r)
            if (sSlot[r] >= 0) sLive[nl++] = r;
        sNumLive = nl;
    }
    __syncthreads();
    const int num_live = sNumLive;
    const int nsteps = max(0, s_end - s_begin);
    float* sSum = reinterpret_cast<float*>(sA + (size_t)nsteps * 16 * BM);   // [SPS][BM]
    // A half warp stages one (step, live token) pair per pass: its 16 lanes take the 4 j x 4 t
    // units of 8 codes. Both half warps of a warp run the same passes (POST's shuffle sums
    // stay inside a half warp), and the pair index advances without a division.
    const int npairs = nsteps * num_live;
    const int half = (tid >> 4) & 1, j = (tid >> 2) & 3, tt = tid & 3;
    int ri = (tid >> 5) * 2 + half, sl = 0;
    while (ri >= num_live) { ri -= num_live; ++sl; }
    for (int base = (tid >> 5) * 2; base < npairs; base += NT / 16) {
        const bool ok = base + half < npairs;
        const int k = (s_begin + sl) * 128 + tt * 32 + j * 8;
        float part = 0.f;
        const int r = ok ? sLive[ri] : 0;
        if (ok) {
            uint4 v = make_uint4(0, 0, 0, 0);   // past Kdim: zeros (0 * garbage could be NaN)
            if (k < Kdim) {
                const uint4 x = __ldg(reinterpret_cast<const uint4*>(
                    a + (size_t)sArow[r] * Kdim + k));
                v.x = __byte_perm(x.x, x.z, 0x5410);   // (a0, a4)
                v.y = __byte_perm(x.x, x.z, 0x7632);   // (a1, a5)
                v.z = __byte_perm(x.y, x.w, 0x5410);   // (a2, a6)
                v.w = __byte_perm(x.y, x.w, 0x7632);   // (a3, a7)
                if (POST)
                    part = (w16::lo_f32(x.x) + w16::hi_f32(x.x)) + (w16::lo_f32(x.y) +
                           w16::hi_f32(x.y)) + ((w16::lo_f32(x.z) + w16::hi_f32(x.z)) +
                           (w16::lo_f32(x.w) + w16::hi_f32(x.w)));
            }
            sA[((sl * 4 + j) * BM + r) * 4 + tt] = v;
        }
        if (POST) {                             // the token's sum over the step's 128 codes
#pragma unroll
            for (int o = 1; o < 16; o <<= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            if (ok && (tid & 15) == 0) sSum[sl * BM + r] = part;
        }
        ri += NT / 16;
        while (ri >= num_live) { ri -= num_live; ++sl; }
    }
    __syncthreads();

    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;

    for (int base = s_begin; base < s_end; base += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int st = base + u;
            if (st < s_end) {                     // uniform over the CTA
                uint4 cw[2][CH];
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int ch = 0; ch < CH; ++ch) cw[h][ch] = wr[u][h][ch];
                const float s_lo = sr[u][0], s_hi = sr[u][1];
                const int z_lo = zr[u][0], z_hi = zr[u][1];
                load_step(st + U, u);             // refill the slot before the math
                const uint4* a_st = sA + (size_t)(st - s_begin) * 16 * BM;
                const float* sum_st = sSum + (size_t)(st - s_begin) * BM;
                step_math<NBITS, POST, MT>(cw, s_lo, s_hi, z_lo, z_hi, a_st, sum_st, acc, g, t,
                                           code_xor);
            }
        }
    }

    // ---- split K: the last CTA of the tile to arrive adds the partials in split order
    if (gridDim.z > 1 &&
        !w16::split_k_last<MT * 4, NT>(&acc[0][0], ws, counters,
                                       (size_t)blockIdx.y * gridDim.x + blockIdx.x, NT * MT * 4,
                                       sLast))
        return;

    // ---- epilogue: c0 c1 = (row g, tokens 2t, 2t+1), c2 c3 = (row g + 8, same tokens)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = mt * 8 + 2 * t + (i & 1);
            const int n = (i >> 1) ? n_hi : n_lo;
            const int s = sSlot[r];
            if (s < 0 || n >= N) continue;
            float v = acc[mt][i];
            if (bias != nullptr) v += bias[(size_t)e * N + n];
            if (mul_routed_weight) v *= topk_weights[s];
            c[(size_t)s * N + n] = w16::from_f32(v);
        }
    }
}

template <int NBITS, int POST, int MT, int WN, int STAGES, int MINB>
__global__ void __launch_bounds__(WN * 32, MINB)
wna16_async(const elem_t* __restrict__ a, const u8* __restrict__ w, elem_t* __restrict__ c,
             const float* __restrict__ w_scale, const u8* __restrict__ w_zp,
             const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
             const int* __restrict__ num_tokens_post_padded,
             const float* __restrict__ topk_weights, const float* __restrict__ bias,
             float* __restrict__ ws, int* __restrict__ counters,
             int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,
             int mul_routed_weight, int group_size, int num_groups, int default_zp,
             int code_xor, int steps_per_split) {
    // the group of a code: a shift for power-of-two group sizes (an integer division is
    // ~20 instructions, per step and lane)
    const int gs_shift = (group_size & (group_size - 1)) == 0 ? __ffs(group_size) - 1 : -1;
    constexpr int BM = 8 * MT;
    constexpr int NT = WN * 32;
    constexpr int CH = NBITS / 4;                 // 16-byte chunks per row per lane per step
    extern __shared__ __align__(128) u8 smem[];   // 128: see wna16_common.cuh
    uint4* sA = reinterpret_cast<uint4*>(smem);   // [SPS][4 j][BM][4 t] 16-byte units
    __shared__ int sSlot[BM];                     // slot s, or -1 (padding)
    __shared__ int sArow[BM];                     // its row of a: s / top_k
    __shared__ int sLast;

    const int m0 = blockIdx.x * BM;
    if (m0 >= num_positions) return;
    const int tid = threadIdx.x;
    // three independent loads in flight together: a padding CTA pays one round trip
    const int ntp = num_tokens_post_padded[0];
    const int e = expert_ids[m0 / block_size];    // BM divides block_size: one expert
    const int s_mine = (tid < BM && m0 + tid < num_positions) ? sorted_token_ids[m0 + tid] : -1;
    if (m0 >= ntp) return;
    int live = 0;
    if (tid < BM) {
        live = s_mine >= 0 && s_mine < num_slots;
        sSlot[tid] = live ? s_mine : -1;
        sArow[tid] = live ? s_mine / top_k : 0;   // once per row, not per staged unit
    }
    if (!__syncthreads_or(live)) return;          // all padding (every split agrees)
    const int n_cta = blockIdx.y * (16 * WN);
    if (e < 0) {                                  // expert of another rank: zeros, once
        if (blockIdx.z == 0) w16::store_zeros<BM>(c, sSlot, N, n_cta, 16 * WN, NT);
        return;
    }

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int ksteps = (Kdim + 127) >> 7;
    const int s_begin = blockIdx.z * steps_per_split;
    const int s_end = min(ksteps, s_begin + steps_per_split);
    const int row_bytes = Kdim * NBITS / 8;
    const int n_lo = n_cta + warp * 16 + g, n_hi = n_lo + 8;
    const bool ok_lo = n_lo < N, ok_hi = n_hi < N;
    const u8* w_e = w + (size_t)e * N * row_bytes;     // 64-bit expert base, 32-bit inside
    const u8* w_lo = w_e + (size_t)(ok_lo ? n_lo : 0) * row_bytes + t * 16 * CH;
    const u8* w_hi = w_e + (size_t)(ok_hi ? n_hi : 0) * row_bytes + t * 16 * CH;
    const size_t sc_e = (size_t)e * N * num_groups;
    const int sc_lo = (ok_lo ? n_lo : 0) * num_groups, sc_hi = (ok_hi ? n_hi : 0) * num_groups;

    // ---- per-warp cp.async ring: STAGES stages of SB steps, 16 rows x RB bytes each, copied
    // with whole-line requests (16 lanes read 256 contiguous bytes of one row), read back
    // by each lane in the mma's layout; the scales of each (step, lane t) ride along (4 bytes).
    constexpr int SB = 4;                        // 128-K steps per stage
    constexpr int RB = SB * 64 * CH;             // bytes of one row per stage
    constexpr int RP = RB + 16;                  // padded shared row: conflict-free 16-byte reads
    constexpr int CPR = RB / 16;                 // 16-byte chunks per row per stage
    constexpr int CPS = 4 * CH;                  // chunks per row per step
    constexpr int WT = 16 * RP + 16 * SB * 4 * 4;   // one warp stage: weights, then scales
    const int nsteps_all = max(0, s_end - s_begin);
    const size_t act_bytes = ((size_t)BM * steps_per_split * 260 + 15) & ~(size_t)15;
    u8* wbase = smem + act_bytes + (size_t)warp * STAGES * WT;
    const int n_w = n_cta + warp * 16;
    auto issue = [&](int stg) {                  // stage stg of this split into its ring slot
        const int st0 = s_begin + stg * SB;
        if (stg * SB < nsteps_all) {
            u8* dst = wbase + (stg % STAGES) * WT;
#pragma unroll
            for (int i = 0; i < 16 * CPR / 32; ++i) {
                const int cidx = i * 32 + lane;
                const int row = cidx / CPR, col = cidx % CPR;
                const int st = st0 + col / CPS;
                const int kc = st * 128 + (col % CPS) * (128 / CPS);
                const bool ok = st < s_end && kc < Kdim && n_w + row < N;
                const u8* src = ok ? w_e + (size_t)(n_w + row) * row_bytes + kc * NBITS / 8 : w;
                w16::cp16(dst + row * RP + col * 16, src, ok);
            }
            float* ssc = reinterpret_cast<float*>(dst + 16 * RP);   // [16 rows][SB steps][4 t]
#pragma unroll
            for (int i = 0; i < 16 * SB * 4 / 32; ++i) {
                const int q = i * 32 + lane;
                const int row = q / (SB * 4), st = st0 + (q / 4) % SB, tt = q % 4;
                const int kq = POST ? st * 128 : st * 128 + tt * 32;
                const bool ok = st < s_end && kq < Kdim && n_w + row < N;
                const float* src = ok ? w_scale + sc_e + (size_t)(n_w + row) * num_groups +
                                        w16::group_of(kq, group_size, gs_shift, num_groups)
                                      : w_scale;
                w16::cp4(ssc + q, src, ok);
            }
        }
        w16::cp_commit();                        // an empty group past the end keeps the count
    };
#pragma unroll
    for (int s0 = 0; s0 < STAGES - 1; ++s0) issue(s0);

    // ---- stage this split's activations, permuted [a0 a4 a1 a5 a2 a6 a3 a7] per 8 codes.
    // Only live tokens: a padding column of B only reaches the same column of the
    // accumulators, which the epilogue never stores, so its shared memory stays unwritten.
    __shared__ int sLive[BM];
    __shared__ int sNumLive;
    if (tid == 0) {
        int nl = 0;
        for (int r = 0; r < BM; ++r)
            if (sSlot[r] >= 0) sLive[nl++] = r;
        sNumLive = nl;
    }
    __syncthreads();
    const int num_live = sNumLive;
    const int nsteps = max(0, s_end - s_begin);
    float* sSum = reinterpret_cast<float*>(sA + (size_t)nsteps * 16 * BM);   // [SPS][BM]
    // A half warp stages one (step, live token) pair per pass: its 16 lanes take the 4 j x 4 t
    // units of 8 codes. Both half warps of a warp run the same passes (POST's shuffle sums
    // stay inside a half warp), and the pair index advances without a division.
    const int npairs = nsteps * num_live;
    const int half = (tid >> 4) & 1, j = (tid >> 2) & 3, tt = tid & 3;
    int ri = (tid >> 5) * 2 + half, sl = 0;
    while (ri >= num_live) { ri -= num_live; ++sl; }
    for (int base = (tid >> 5) * 2; base < npairs; base += NT / 16) {
        const bool ok = base + half < npairs;
        const int k = (s_begin + sl) * 128 + tt * 32 + j * 8;
        float part = 0.f;
        const int r = ok ? sLive[ri] : 0;
        if (ok) {
            uint4 v = make_uint4(0, 0, 0, 0);   // past Kdim: zeros (0 * garbage could be NaN)
            if (k < Kdim) {
                const uint4 x = __ldg(reinterpret_cast<const uint4*>(
                    a + (size_t)sArow[r] * Kdim + k));
                v.x = __byte_perm(x.x, x.z, 0x5410);   // (a0, a4)
                v.y = __byte_perm(x.x, x.z, 0x7632);   // (a1, a5)
                v.z = __byte_perm(x.y, x.w, 0x5410);   // (a2, a6)
                v.w = __byte_perm(x.y, x.w, 0x7632);   // (a3, a7)
                if (POST)
                    part = (w16::lo_f32(x.x) + w16::hi_f32(x.x)) + (w16::lo_f32(x.y) +
                           w16::hi_f32(x.y)) + ((w16::lo_f32(x.z) + w16::hi_f32(x.z)) +
                           (w16::lo_f32(x.w) + w16::hi_f32(x.w)));
            }
            sA[((sl * 4 + j) * BM + r) * 4 + tt] = v;
        }
        if (POST) {                             // the token's sum over the step's 128 codes
#pragma unroll
            for (int o = 1; o < 16; o <<= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            if (ok && (tid & 15) == 0) sSum[sl * BM + r] = part;
        }
        ri += NT / 16;
        while (ri >= num_live) { ri -= num_live; ++sl; }
    }
    __syncthreads();

    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;

    const int nstages = (nsteps_all + SB - 1) / SB;
    for (int stg = 0; stg < nstages; ++stg) {
        w16::cp_wait<STAGES - 2>();              // stage stg has landed (this lane's copies)
        __syncwarp();                            // ... and every lane's; slot stg-1 is free
        issue(stg + STAGES - 1);
        const u8* tile = wbase + (stg % STAGES) * WT;
        const float* ssc = reinterpret_cast<const float*>(tile + 16 * RP);
#pragma unroll
        for (int sb = 0; sb < SB; ++sb) {
            const int st = s_begin + stg * SB + sb;
            if (st >= s_end) break;
            uint4 cw[2][CH];
#pragma unroll
            for (int ch = 0; ch < CH; ++ch) {
                cw[0][ch] = *reinterpret_cast<const uint4*>(tile + g * RP + sb * 64 * CH +
                                                            t * 16 * CH + ch * 16);
                cw[1][ch] = *reinterpret_cast<const uint4*>(tile + (g + 8) * RP + sb * 64 * CH +
                                                            t * 16 * CH + ch * 16);
            }
            const float s_lo = ssc[(g * SB + sb) * 4 + t];
            const float s_hi = ssc[((g + 8) * SB + sb) * 4 + t];
            int z_lo = default_zp, z_hi = default_zp;
            if (w_zp != nullptr) {                // zero points: a plain load (rarer format)
                const int kq = POST ? st * 128 : st * 128 + t * 32;
                const int grp = kq < Kdim ? w16::group_of(kq, group_size, gs_shift, num_groups) : 0;
                if (ok_lo) z_lo = __ldg(w_zp + sc_e + sc_lo + grp);
                if (ok_hi) z_hi = __ldg(w_zp + sc_e + sc_hi + grp);
            }
            const uint4* a_st = sA + (size_t)(st - s_begin) * 16 * BM;
            const float* sum_st = sSum + (size_t)(st - s_begin) * BM;
            step_math<NBITS, POST, MT>(cw, s_lo, s_hi, z_lo, z_hi, a_st, sum_st, acc, g, t,
                                       code_xor);
        }
    }
    w16::cp_wait<0>();                           // nothing in flight at exit

    // ---- split K: the last CTA of the tile to arrive adds the partials in split order
    if (gridDim.z > 1 &&
        !w16::split_k_last<MT * 4, NT>(&acc[0][0], ws, counters,
                                       (size_t)blockIdx.y * gridDim.x + blockIdx.x, NT * MT * 4,
                                       sLast))
        return;

    // ---- epilogue: c0 c1 = (row g, tokens 2t, 2t+1), c2 c3 = (row g + 8, same tokens)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = mt * 8 + 2 * t + (i & 1);
            const int n = (i >> 1) ? n_hi : n_lo;
            const int s = sSlot[r];
            if (s < 0 || n >= N) continue;
            float v = acc[mt][i];
            if (bias != nullptr) v += bias[(size_t)e * N + n];
            if (mul_routed_weight) v *= topk_weights[s];
            c[(size_t)s * N + n] = w16::from_f32(v);
        }
    }
}

// ============================================================================ wna16_packed
// The decode rung on prepacked int4 weights (quant_gemm_wna16.prepack_int4 writes them once,
// at weight-load time): every warp load instruction reads 512 contiguous bytes, and each
// lane's 16 bytes are exactly its mma A fragments for one 64-code chunk of 16 weight rows.
//
//   packed layout  wp [E][N / 16 tiles][Kdim / 64 chunks][32 lanes][4 words]
//                  lane (g, t) of tile nt, chunk c: codes k = 64 c + 16 t + 0..15 of weight
//                  rows n = 16 nt + g (words 0, 2) and 16 nt + g + 8 (words 1, 3); word 0 / 1
//                  hold codes 0..7, words 2 / 3 codes 8..15; in a word, the pair p (p = 0..3)
//                  of codes (2p, 2p + 1) sits in bits 4p..4p+3 and 16+4p..16+4p+3, so that
//                  ((x >> 4p) & 0x000F000F) | MAGIC is the elem2 pair (128 + q_2p, 128 + q_2p+1)
//                  in memory order: the activations need no permutation.
//                  sp [E][N / 16][G][8 g] float2 = (s[16 nt + g], s[16 nt + g + 8]) of group G;
//                  zp [E][N / 16][G][8 g] u16 = the same rows' zero points (lo byte, hi byte).
//   mma m (m = 0..3) of a chunk covers codes 16 t + 4 m .. + 3 of the lane: A = pairs
//   (2 (m & 1), 2 (m & 1) + 1) of the row-g / row-g+8 words (m < 2: words 0 / 1, else 2 / 3),
//   B = the same 4 codes of the lane's token (column g of the tile), two pairs of a 16-byte
//   load of a at k = 64 c + 16 t (+ 8): the A and B k slots hold the same codes.
//   Dequantization: one shift and one lop3 per pair give 128 + q.
//     POST = 0 subtracts 128 + zp per pair (exact in elem2): 16 hsub2 per chunk.
//     POST = 1 (bf16 only) feeds 128 + q to the mma and takes the zero point off with one more
//       mma per chunk and token tile: A = 128 + zp at k slots 0, 1 (lanes t = 0; zeros
//       elsewhere), B = (-hi, -lo) of the token's chunk sum S = sum_k a (asum, written by
//       wna16_chunk_sums below: hi = bf16(S), lo = bf16(S - hi)), so the partial gains
//       -(128 + zp) (hi + lo) = -(128 + zp) S to ~2^-17 relative. Products of 8-bit numbers
//       are exact in fp32; what is left is the fp32 cancellation of sum (128 + q) a against
//       (128 + zp) S (~2^-23 times ~30). fp16 (a chunk's sum may pass 65504) runs POST = 0.
//   The group scale then multiplies the chunk's fp32 partial (needs group_size % 64 == 0).
//   Why this shape (H200, Mixtral T=1 GEMM1, ncu of slot 1): the rung is instruction-bound
//   (issue ~60% busy, ALU pipe ~55%, 'wait' stalls first), so the count of instructions per
//   chunk is what the layout, the pointer-walking ring and POST minimise.
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
// (H200, Mixtral: q16 vs q8 at T=1 and 16). So one config
// of MT = 4 reads each expert's weights once for up to 32 rows and pays per live tile only.
// Each warp walks its (tile, chunk) items through a ring of D items in flight per lane (16
// bytes of codes plus the two rows' scales), across tile boundaries, so a barrier does not
// drain the loads at once. SR = 0: the ring is registers (16-byte loads); SR = 1: it is the
// warp's own slice of shared memory, filled by cp.async (each lane reads back only the bytes
// it copied: cp.async.wait_group, no barrier), so that D > 1 fits at 3-4 live token tiles,
// where a register ring deeper than one item spills (q24 / q32 run with D = 1). Measured:
// faster at one live tile, slower at 2-3 and with D = 4 (the ring's
// shared memory comes out of L1, which the activations are read through).
// Activations are read through L1 (16-byte __ldg, 2 per chunk and live token tile), padding
// columns read a live row (never stored).
// grid (cdiv(Lg, BM), cdiv(N / 16, tiles_per_cta)), block 32 W, static shared memory
// 8 BM bytes, dynamic SR W D RT 768 (the rings) + 2 red_groups W RT BM 17 4 bytes (the
// warps' partials).
// Needs int4, N % 16 == 0, Kdim % 64 == 0, group_size a multiple of 64 with
// chunks-per-group a power of two (chunk_shift = log2; or one group per row: 30).
template <int MT, int W, int D, int ZP, int POST, int RT, int MINB, int SR>
__global__ void __launch_bounds__(W * 32, MINB)
wna16_packed(const elem_t* __restrict__ a, const uint4* __restrict__ wp, elem_t* __restrict__ c,
             const float2* __restrict__ sp, const unsigned short* __restrict__ zp,
             const u32* __restrict__ asum,
             const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
             const int* __restrict__ num_tokens_post_padded,
             const float* __restrict__ topk_weights, const float* __restrict__ bias,
             int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,
             int mul_routed_weight, int chunk_shift, int num_groups, int default_zp,
             int tiles_per_cta, int red_groups) {
    constexpr int BM = 8 * MT;
    constexpr int RS = 17;                        // padded row of the partials: fewer conflicts
    constexpr bool RAW = POST && ELEM_BF16;       // the mma sees 128 + q (see above)
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
    int srow[RAW ? MT : 1];                       // the rows' first chunk sums in asum
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int r = sArow[8 * mt + g] >= 0 ? sArow[8 * mt + g] : first;
        arow[mt] = a + (size_t)r * Kdim + 16 * t;
        if (RAW) srow[RAW ? mt : 0] = r * C;
    }

    const int CPW = (C + W - 1) / W;              // chunks per warp per tile
    // 32-bit offsets inside the expert (the launcher checks N * Kdim / 2 < 2^31)
    const uint4* wexp = wp + (size_t)e * ntiles * C * 32 + lane;
    const float2* sexp = sp + (size_t)e * ntiles * num_groups * 8 + g;
    const unsigned short* zexp = zp + (ZP ? (size_t)e * ntiles * num_groups * 8 + g : 0);
#if ELEM_BF16
    constexpr u32 MAGIC = 0x43004300u;
#else
    constexpr u32 MAGIC = 0x64006400u;
#endif
    const u32 zdef = MAGIC | ((u32)default_zp * 0x00010001u);

    // dynamic shared memory: SR's rings [W][D][RT][32] of uint4 codes, float2 scales and (ZP)
    // the 4-byte word holding the rows' zero points, then the warps' partials
    // [2 halves][red_groups][W][RT][BM][RS] fp32
    extern __shared__ __align__(128) u8 smem[];   // 128: see wna16_common.cuh
    constexpr int SLOTS = SR ? W * D * RT * 32 : 0;          // ring entries of each kind
    uint4* ring_w = reinterpret_cast<uint4*>(smem) + warp * D * RT * 32 + lane;
    float2* ring_s = reinterpret_cast<float2*>(smem + SLOTS * 16) + warp * D * RT * 32 + lane;
    u32* ring_z = reinterpret_cast<u32*>(smem + SLOTS * 24) + warp * D * RT * 32 + lane;
    float* sRed = reinterpret_cast<float*>(smem + SLOTS * (ZP ? 28 : 24));

    // ---- the ring: D items (16 bytes of codes + the two rows' scales) in flight per lane,
    // walked in rounds of D items (CPW is a multiple of D: a round never crosses a tile).
    // Item u of a round is chunk c0 + u W of the round's tile: its codes lie u W 512 bytes
    // after the round's pointer, its activations u W 64 elements on (immediate offsets, no
    // index arithmetic per item). Each slot is refilled right after its math, from the next
    // round (the registers / the lane's shared bytes are free by then: no copies).
    uint4 rw[SR ? 1 : D][RT];
    float2 rs[SR ? 1 : D][RT];
    u32 rz[ZP && !SR ? D : 1][RT];
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
                if constexpr (SR) {
                    w16::cp16(ring_w + (u * RT + r) * 32, src, true);
                    w16::cp8(ring_s + (u * RT + r) * 32, ssrc);
                    if (ZP)                       // the aligned word: rows g & ~1 and g | 1
                        w16::cp4(ring_z + (u * RT + r) * 32, zsrc - (g & 1), true);
                } else {
                    rw[SR ? 0 : u][r] = w16::ld_stream(reinterpret_cast<const u8*>(src));
                    rs[SR ? 0 : u][r] = __ldg(ssrc);
                    if (ZP) rz[ZP ? u : 0][r] = __ldg(zsrc);
                }
            }
        }
        if constexpr (SR) w16::cp_commit();       // one group per slot, empty past the end
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
        float acc[RT][LT][4];
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int mt = 0; mt < LT; ++mt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[r][mt][i] = 0.f;

        // one item: the math of slot u (chunk c), then the slot's refill from the next round
        auto item = [&](int u, int c, bool check) {
            if (!check || c < C) {                    // uniform over the warp
                // SR: the slot's copies are the oldest of the D groups in flight
                if constexpr (SR) w16::cp_wait<D - 1>();
                // B: the lane's token rows, loaded once for the RT weight tiles of the group
                uint4 b[LT][2];
                u32 bsum[RAW ? LT : 1];
#pragma unroll
                for (int mt = 0; mt < LT; ++mt) {
                    const uint4* ap = reinterpret_cast<const uint4*>(arow[mt] + c * 64);
                    b[mt][0] = __ldg(ap);
                    b[mt][1] = __ldg(ap + 1);
                    if (RAW) bsum[RAW ? mt : 0] = __ldg(asum + srow[RAW ? mt : 0] + c);
                }
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    const uint4 x = SR ? ring_w[(u * RT + r) * 32] : rw[SR ? 0 : u][r];
                    const float2 s2 = SR ? ring_s[(u * RT + r) * 32] : rs[SR ? 0 : u][r];
                    u32 zl = zdef, zh = zdef;         // (128 + zp) in both halves, rows g, g + 8
                    if (ZP) {                         // z: row g's zero point in the low byte
                        const u32 z = SR ? ring_z[(u * RT + r) * 32] >> (16 * (g & 1))
                                         : rz[ZP && !SR ? u : 0][r];
                        zl = MAGIC | ((z & 0xFFu) * 0x00010001u);
                        zh = MAGIC | (((z >> 8) & 0xFFu) * 0x00010001u);
                    }
                    // A: pairs of row g (words x, z) and row g + 8 (words y, w): 128 + q (RAW)
                    // or q - zp, one lop3 (and one shift) per pair
                    u32 lo[8], hi[8];
                    w16::raw_pairs(x, MAGIC, lo, hi);
                    if (!RAW) {
#pragma unroll
                        for (int i = 0; i < 8; ++i) {
                            lo[i] = w16::as_u32(__hsub2(w16::as_e2(lo[i]), w16::as_e2(zl)));
                            hi[i] = w16::as_u32(__hsub2(w16::as_e2(hi[i]), w16::as_e2(zh)));
                        }
                    }
                    // RAW's zero-point mma: A = 128 + zp at k slots 0, 1 (lanes t = 0 hold them)
                    const u32 za = t == 0 ? zl : 0u, zb = t == 0 ? zh : 0u;
#pragma unroll
                    for (int mt = 0; mt < LT; ++mt) {
                        float tmp[4] = {0.f, 0.f, 0.f, 0.f};
                        if (RAW)
                            w16::mma16816(tmp, za, zb, 0u, 0u, bsum[RAW ? mt : 0], 0u);
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

// The chunk sums of wna16_packed's POST = 1: asum[row][c] = the elem2 pair (-hi, -lo) with
// S = sum_{k < 64} a[row][64 c + k] in fp32 (in k order), hi = bf16(S), lo = bf16(S - hi)
// (S - hi is exact in fp32). Rows are contiguous, so (row, c) is the 64-element run i.
// grid cdiv(rows Kdim / 64, 256), block 256: one thread per run, eight 16-byte loads.
__global__ void __launch_bounds__(256)
wna16_chunk_sums(const elem_t* __restrict__ a, u32* __restrict__ asum, int runs) {
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= runs) return;
    const uint4* src = reinterpret_cast<const uint4*>(a) + (size_t)i * 8;
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const uint4 v = __ldg(src + j);
        const u32 w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {             // one add at a time: k order, as chunk_sums
            s += w16::lo_f32(w4[q]);
            s += w16::hi_f32(w4[q]);
        }
    }
    const float hi = w16::to_f32(w16::from_f32(s));
    asum[i] = w16::pack2(-hi, -(s - hi));
}
