// w8a8_v4_wgmma.cu: rung 4 of the w8a8 grouped GEMM (fp8 only, Hopper): wgmma e4m3 x e4m3.
//
//   c[s] = (deq(a)[s / top_k] @ deq(w[e]).T + bias[e]) * (topk_weights[s] if mul_routed_weight)
//
// for every live position p of sorted_token_ids (as w8a8_v1_naive.cu; e == -1 writes zeros), fp8
// e4m3 codes, fp32 accumulation, one rounding to elem_t.
//   a [M_a, Kdim] e4m3 bytes   a_scale [1] | [M_a] | [M_a, KB]      (kind 0 / 1 / 2)
//   w [E, N, Kdim] e4m3 bytes  w_scale [E] | [E, N] | [E, NB, KB]   (kind 0 / 1 / 2)
// Kind 2 together = DeepSeek-V3 block scaling (128x128 weight blocks, 1x128 activation groups).
//
// Design (large batches: tensor-core bound once each weight tile is reused over 64+ rows):
//   * K tile = one 128-wide quantization block = 128 fp8 bytes per row = exactly one 128-byte
//     swizzled row, the layout wgmma reads at full rate (chunk c of row r at c ^ (r % 8); the
//     XOR uses absolute shared addresses, so tiles start on 1024-byte boundaries). Both
//     operands K-major from shared memory (fp8 wgmma takes no other layout), which is how a
//     [M, K] and w [E, N, K] lie in memory: no transposition anywhere.
//   * Per K block, each warpgroup (64 rows) issues 4 wgmma.m64nBNk32 into a block accumulator
//     (the first with scale-d = 0: no zeroing), waits for them, and promotes:
//         acc[r, n] += blk[r, n] * a_scale[row r, kb] * w_scale[e, n0 / 128, kb]
//     This applies DeepSeek-V3's per-block scales and keeps the long sum in full fp32 (fp8
//     wgmma accumulates with fewer mantissa bits). A BN of 64 or 128 rows aligned to BN lies
//     in one 128-row weight block: one w scale per CTA and block.
//   * cp.async ring of STAGES blocks (A rows gathered through sorted_token_ids as the bf16
//     gemm_v5 does, zero-filled for padding rows and the Kdim tail), STAGES - 1 blocks ahead; the
//     block's scales ride in the same cp.async group. Slot kb - 1 is refilled in iteration kb
//     after the barrier: every warpgroup waited for its wgmma of kb - 1 before reaching it.
//     cp.async writes through the generic proxy, wgmma reads through the async proxy:
//     fence.proxy.async before the barrier orders them.
//   * Grid x = n tiles (fastest), y = m tiles: the CTAs that run together share an m tile (its
//     gathered A rows stay in L2) and an expert's consecutive m tiles are close in time (its
//     weight tiles are read from HBM about once).
// Accumulator layout (per warpgroup, as mma.m16n8 per n8 block): warp wq of the warpgroup
// holds rows 16 wq + lane / 4 (+ 8); for n8 block j, d[4j..4j+3] = (row, 8j + 2 (lane % 4)),
// (row, +1), (row + 8, ...), (row + 8, +1).
// grid (cdiv(N, BN), cdiv(Lg, BM)), block (BM / 64) * 128, dynamic smem = 1024 +
//   STAGES * ((BM + BN) * 128 + BM * 4) + 16 * cdiv(STAGES * 4, 16) + BM * 8.
// Needs sm_90a (built with -arch=sm_90a), Kdim % 16 == 0, a and w 16-byte aligned, BM divides
// block_size (the launcher checks).
// ELEM_BF16 (#define 1 / 0): output bf16 / fp16.
// Run: python -m cuda_kernels.cupy.quant.w8a8 [--quick]
#include "common.cuh"
#include "../wgmma_operands.cuh"

#define FW_ROW 128                 // bytes of a tile row: one K block = the swizzle width

// The inline PTX of this file (to fw_wgmma_n128): cp.async to a shared address (the ring's
// swizzled places are computed as addresses) and the fp8 wgmma. tests/cupy/quant/test_w8a8.py
// runs this source on the CPU with QG_EMULATED_PTX #defined and the emulator's versions of these
// helpers
// (cp.async landing at the wait, wgmma reading the swizzled tiles through the descriptor).
#ifndef QG_EMULATED_PTX
__device__ __forceinline__ u32 fw_smem(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void fw_cp16(u32 dst, const void* src, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(pred ? 16 : 0) : "memory");
}
__device__ __forceinline__ void fw_cp4(u32 dst, const void* src, bool pred) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(dst), "l"(src), "r"(pred ? 4 : 0) : "memory");
}
// d[BN / 2] (64 x BN fp32, this thread's part) = (acc ? d : 0) + A (64 x 32) * B (32 x BN);
// fp8 wgmma reads K-major tiles only: no transpose immediates after the scales of A and B
__device__ __forceinline__ void fw_wgmma_n64(float* d, unsigned long long da,
                                             unsigned long long db, int acc) {
    WG_MMA_SS_N64("m64n64k32.f32.e4m3.e4m3", ", 1, 1", d, da, db, acc);
}
__device__ __forceinline__ void fw_wgmma_n128(float* d, unsigned long long da,
                                              unsigned long long db, int acc) {
    WG_MMA_SS_N128("m64n128k32.f32.e4m3.e4m3", ", 1, 1", d, da, db, acc);
}
#endif  // QG_EMULATED_PTX

template <int BN>
__device__ __forceinline__ void fw_wgmma(float* d, unsigned long long da, unsigned long long db,
                                         int acc) {
    if (BN == 64) fw_wgmma_n64(d, da, db, acc);
    else fw_wgmma_n128(d, da, db, acc);
}

template <int BM, int BN, int STAGES>
__global__ void __launch_bounds__((BM / 64) * 128, 1)
w8a8_v4_wgmma(QG_W8A8_ARGS) {
    constexpr int NT = (BM / 64) * 128;
    constexpr int TILE_A = BM * FW_ROW, TILE_B = BN * FW_ROW;
    constexpr int STAGE = TILE_A + TILE_B;
    constexpr int A_IT = BM * 8 / NT, B_IT = BN * 8 / NT;     // 16-byte chunks per thread
    static_assert(BM == 64 || BM == 128, "v4: one or two warpgroups of 64 rows");
    static_assert(BN == 64 || BN == 128, "v4: BN of 64 or 128 (inside one 128-row block)");
    static_assert(STAGES >= 2, "v4: at least two stages");
    static_assert(A_IT * NT == BM * 8 && B_IT * NT == BN * 8, "v4: whole copy rounds");

    extern __shared__ __align__(16) u8 smem[];
    // the ring starts at the first 1024-byte boundary (the launcher adds 1024 bytes for it)
    const u32 raw_base = fw_smem(smem);
    const u32 base = (raw_base + 1023u) & ~1023u;
    u8* ring = smem + (base - raw_base);
    float* sAs = reinterpret_cast<float*>(ring + STAGES * STAGE);   // [STAGES][BM]
    float* sWs = sAs + STAGES * BM;                                 // [STAGES] (padded to 16 B)
    int* sArow = reinterpret_cast<int*>(sWs + ((STAGES + 3) / 4) * 4);  // [BM] a row, -1 pad
    int* sSlot = sArow + BM;                                        // [BM] slot s

    const int n0 = blockIdx.x * BN;
    const int m0 = blockIdx.y * BM;
    if (m0 >= num_tokens_post_padded[0] || m0 >= num_positions) return;
    const int e = expert_ids[m0 / block_size];                      // BM divides block_size
    const int tid = threadIdx.x;
    if (!qg_stage_m_tile<BM, BN, NT>(c, sSlot, sArow, sorted_token_ids, m0, n0, e, N,
                                     num_slots, top_k, num_positions, tid))
        return;                                   // padding only, or zeros
    const bool BLOCKWISE = a_scale_kind == 2;                       // uniform over the grid
    const int KB = (Kdim + 127) / 128;
    const int NB = (N + 127) / 128;
    // 64-bit expert base once, 32-bit offsets inside it (launcher: N * Kdim < 2^31)
    const u8* wexp = w + (long long)e * N * Kdim;

    // Copy assignment: chunk idx = tid + i * NT -> row idx / 8, k chunk idx % 8 (NT is a
    // multiple of 8: a thread's chunk column is fixed); sources and swizzled places once.
    const int kc = tid % 8;
    const u8* a_src[A_IT];
    bool a_ok[A_IT];
    u32 a_dst[A_IT];
#pragma unroll
    for (int i = 0; i < A_IT; ++i) {
        const int r = (tid + i * NT) / 8;
        const int ar = sArow[r];
        a_ok[i] = ar >= 0;
        a_src[i] = a + (a_ok[i] ? (long long)ar * Kdim : 0LL) + kc * 16;
        a_dst[i] = r * FW_ROW + ((kc ^ (r & 7)) << 4);
    }
    const u8* b_src[B_IT];
    bool b_ok[B_IT];
    u32 b_dst[B_IT];
#pragma unroll
    for (int i = 0; i < B_IT; ++i) {
        const int r = (tid + i * NT) / 8;
        b_ok[i] = n0 + r < N;
        b_src[i] = wexp + (b_ok[i] ? (n0 + r) * Kdim : 0) + kc * 16;
        b_dst[i] = TILE_A + r * FW_ROW + ((kc ^ (r & 7)) << 4);
    }
    const float* ws_blk = w_scale + ((long long)e * NB + n0 / 128) * KB;   // kind 2 only
    const int my_arow = tid < BM ? sArow[tid] : -1;

    auto load_stage = [&](int st, int kb) {
        const int k = kb * 128;
        const bool k_ok = k + kc * 16 < Kdim;             // the Kdim tail: whole chunks
        const u32 sb = base + st * STAGE;
#pragma unroll
        for (int i = 0; i < A_IT; ++i) {
            const bool ok = a_ok[i] && k_ok;
            fw_cp16(sb + a_dst[i], ok ? (const void*)(a_src[i] + k) : (const void*)a, ok);
        }
#pragma unroll
        for (int i = 0; i < B_IT; ++i) {
            const bool ok = b_ok[i] && k_ok;
            fw_cp16(sb + b_dst[i], ok ? (const void*)(b_src[i] + k) : (const void*)w, ok);
        }
        if (BLOCKWISE) {
            if (tid < BM)
                fw_cp4(fw_smem(sAs + st * BM + tid),
                       my_arow >= 0 ? a_scale + (long long)my_arow * KB + kb : a_scale,
                       my_arow >= 0);
            if (tid == BM % NT)        // another warp than the a-scale copies when BM < NT
                fw_cp4(fw_smem(sWs + st), ws_blk + kb, true);
        }
    };

    const int wg = tid >> 7;                  // warpgroup: rows 64 wg .. 64 wg + 63
    const int wq = (tid >> 5) & 3;            // warp inside it: 16 of those rows
    const int lane = tid & 31;
    const int r0 = wg * 64 + wq * 16 + (lane >> 2);    // this thread's rows r0, r0 + 8

    float acc[BN / 2], blk[BN / 2];
#pragma unroll
    for (int j = 0; j < BN / 2; ++j) acc[j] = 0.f;

#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < KB) load_stage(st, st);
        qg_commit();                                   // one group per stage, even when empty
    }
    for (int kb = 0; kb < KB; ++kb) {
        qg_wait<STAGES - 2>();                         // block kb has landed (this thread)
        wg_fence_proxy_async();                        // ... visible to the async proxy
        __syncthreads();                               // everyone's; slot kb - 1 is free
        {
            const int nk = kb + STAGES - 1;
            if (nk < KB) load_stage(nk % STAGES, nk);
            qg_commit();
        }
        const int st = kb % STAGES;
        const u32 a_base = base + st * STAGE + wg * 64 * FW_ROW;
        const u32 b_base = base + st * STAGE + TILE_A;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)      // k32 steps: 32 bytes along the swizzled rows
            fw_wgmma<BN>(blk, wg_desc_swizzled<FW_ROW>(a_base + kk * 32),
                         wg_desc_swizzled<FW_ROW>(b_base + kk * 32), kk > 0);
        wg_commit();
        wg_wait<0>();
        float s0 = 1.f, s1 = 1.f;
        if (BLOCKWISE) {
            const float ws = sWs[st];
            s0 = sAs[st * BM + r0] * ws;
            s1 = sAs[st * BM + r0 + 8] * ws;
        }
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            acc[4 * j + 0] += blk[4 * j + 0] * s0;
            acc[4 * j + 1] += blk[4 * j + 1] * s0;
            acc[4 * j + 2] += blk[4 * j + 2] * s1;
            acc[4 * j + 3] += blk[4 * j + 3] * s1;
        }
    }
    qg_wait<0>();                                      // no copy outlives the CTA

    // Epilogue: per-tensor / per-channel scales, bias, router weight (fp32, docs/stages.md's
    // order), paired 32-bit stores.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = r0 + 8 * h;
        const int s = sSlot[r];
        if (!qg_live(s, num_slots)) continue;
        const float sa = BLOCKWISE ? 1.f : (a_scale_kind == 0 ? a_scale[0] : a_scale[sArow[r]]);
        const float tw = mul_routed_weight ? topk_weights[s] : 1.f;
        elem_t* crow = c + (long long)s * N;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int n = n0 + 8 * j + 2 * (lane & 3);
            if (n >= N) continue;
            float v[2] = {acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]};
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                if (n + q >= N) break;
                if (!BLOCKWISE)
                    v[q] *= sa * (w_scale_kind == 0 ? w_scale[e] : w_scale[(long long)e * N + n + q]);
                if (bias != nullptr) v[q] += bias[(long long)e * N + n + q];
                v[q] *= tw;
            }
            if (n + 1 < N && ((((long long)s * N + n) & 1) == 0)) {
                *reinterpret_cast<u32*>(crow + n) = qg_pack(v[0], v[1]);
            } else {
                qg_store(crow + n, v[0]);
                if (n + 1 < N) qg_store(crow + n + 1, v[1]);
            }
        }
    }
}
