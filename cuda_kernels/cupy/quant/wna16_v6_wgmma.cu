// wna16_v6_wgmma.cu: rung 6 of the weight-only grouped GEMM, int4 on Hopper (sm_90a): wgmma
// with the dequantized weights as its register A operand and the activations as its
// shared-memory B.
//
//   c[s, n] = (sum_k a[s / top_k, k] * w[e, n, k] + bias[e, n]) * r[s],
//   w[e, n, k] = elem_t((q[e, n, k] - zp[e, n, k / gs]) * s[e, n, k / gs])
//
// for every live position p < num_tokens_post_padded (s = sorted_token_ids[p] < P, e =
// expert_ids[p / block_size]; e == -1 writes zeros), r = topk_weights.flat when
// mul_routed_weight. The weights are rounded once to elem_t after the scale (as a bf16
// model's), fp32 accumulation over the whole K, one rounding of the output.
//
// The lesson: wgmma with a register A operand, and the one rule that keeps it asynchronous.
// Not routed (opt-in: version "v6" or config h32): its GEMM1 was the fastest int4 GEMM1 at
// T >= 64, its GEMM2 was not, and routing GEMM1 here would cache a second prepacked copy of
// w13, in this lane order, beside the one the decode batches use.
// Why: wna16_v4_packed issues one mma.sync per 8 tokens; at 2-3 live token tiles (Mixtral
// T=64) its instruction count grows with the tiles. Here one wgmma.m64nNk16 per 16-wide k step
// covers all N = 8 LT live tokens of 64 weight rows.
// ptxas and register A: ptxas keeps wgmma asynchronous only when no operand of a wgmma (A
// fragments, accumulators, descriptors, the scale-d flag) is defined by another instruction
// inside a pipeline stage, i.e. between a wgmma.fence and the wait that retires the batch;
// otherwise it serializes every wgmma of the kernel (warning C7513: a wait after each one).
// The first version of this rung (a second A buffer dequantized while the previous batch ran)
// was serialized that way. So: every operand is computed, then pinned (ww_pin), then the fence
// and one batch of 4 RB wgmma, and the next item's dequantization starts after
// wgmma.wait_group 0; the overlap comes from the other CTAs of the SM.
// Measured (H200, Mixtral int4 g128, GEMM1 / GEMM2 at T = 64): h32 230 / 185 us against the
// packed rung's q32 248 / 125 (GEMM2: 64 row groups per expert made too few CTAs, hence the
// split K below: 235 / 143). Nsight Compute: the rung is issue-bound (126 M warp instructions
// for GEMM1, issue 65% of the active cycles, DRAM 37%): the dequantization is 4 instructions
// per pair of codes, ~128 of the ~255 per warp and item. Measured and taken out (git history
// has them): wgmma on the raw 128 + q with scale and zero point applied per group in fp32 on
// the activations' group sums (fewer instructions per item but 168 registers, 3 CTAs per SM:
// 298 / 213 us); one fma per pair, the bias's rounding error taken off per group in the
// epilogue (25 instructions per item fewer, a costlier epilogue: 296 / 207 against 263 / 164).
//
// Layout:
//   weights  prepack_int4(order="wgmma"): wp [E][N / 16 tiles][Kdim / 64 chunks][32 lanes][4]
//            words; lane (g, t), word v (v & 1: row 16 nt + g + 8 (v & 1)), pair p (bits 4p..
//            and 16+4p..) holds codes 64 c + 16 m + 2 t + 8 (p & 1) + {0, 1} of k16 step
//            m = 2 (v >> 1) + (p >> 1): the pairs p, p + 1 (p = 2 (m & 1)) of rows g and g + 8
//            are the A fragment (a0, a1, a2, a3) of step m, as mma.m16n8k16 lays it out.
//            sp, zp: as wna16_v4_packed (float2 scales / u16 zero points of rows g, g + 8).
//   CTA      one warpgroup: warp w owns the 16-row tile 4 j + w of each 64-row group j of the
//            CTA's range, one m tile of BM = 8 MT positions (one expert), the whole K (or one
//            split of it, below). Its groups come in blocks of RB (the last block's missing
//            groups repeat the last group: computed, never stored).
//   B        one 64-code chunk of the live token rows per stage of a cp.async ring of S stages:
//            [kb = 0..7][nb = 0..MT-1] core matrices of 8 token rows x 16 bytes (K-major, no
//            swizzle); step m reads kb = 2 m, 2 m + 1: descriptor start = stage + 2 m MT 128,
//            leading byte offset (the next 8 codes) MT 128, stride byte offset (the next 8
//            tokens) 128. Rows that hold no live position are zero-filled.
// Pipeline (item = one chunk of one block of RB groups, chunk fastest; one cp.async group per
//   item holds the weights D items ahead and the activations S - 1 ahead, so waiting for an
//   item's activations covers its older weights): wait for the item's copies and for the
//   previous item's wgmma batch; fence.proxy.async and a barrier (everyone's activation copies
//   of the item; every batch that read the stage refilled below is done); dequantize the RB row
//   groups from the warp's shared-memory ring (each lane reads back the 16 bytes it copied; a
//   group's scales and zero points come with its first chunk and stay in registers); one batch
//   of 4 RB wgmma (a block's first chunk with scale-d = 0);
//   refill the weight slot (D items on) and the previous item's stage (S - 1 items on). At a
//   block's end: wait for all, then the epilogue from the accumulators (mma.m16n8's layout per
//   n8 block: warp w, rows 16 w + g (+ 8), tokens 8 nb + 2 t (+ 1)) + bias, times the router
//   weight.
// Split K (gridDim.z = KS > 1; GEMM2's N = H gives too few row groups to fill the GPU): CTA z
//   walks chunks [z cps, (z + 1) cps) (whole groups), stores its fp32 block to the workspace
//   ws [tile][z][RB][BM / 2][128 threads], and the last CTA of the tile to arrive (a per-tile
//   counter, reset by that CTA for the next launch) adds the KS partials in split order
//   (deterministic) and runs the epilogue. Measured (H200, Mixtral int4 g128, h32, GEMM2):
//   185 -> 143 us at T=64 (KS = 3), 92 -> 38 us at T=1 (KS = 9).
// grid (cdiv(Lg, BM), cdiv(N / 64, groups_per_cta), KS), block 128, dynamic shared memory
// S MT 1024 + 4 D RB 32 28 bytes. Needs sm_90a, N % 64 == 0, Kdim % 64 == 0, group_size a
// multiple of 64 with chunks-per-group a power of two (chunk_shift = log2(group_size / 64); one
// group per row: 30), groups_per_cta a multiple of RB, chunks_per_split a multiple of the
// chunks per group when KS > 1, S >= 2, D >= S - 1.
// wna16_v6_wgmma<MT, D, S, MINB, RB>; ELEM_BF16 (#define 1 or 0) picks elem_t.
// Run: python -m cuda_kernels.cupy.quant.wna16 [--quick]
#include "wna16_common.cuh"
#include "../wgmma_operands.cuh"

typedef unsigned long long u64;

#if ELEM_BF16
#define WW_AB "bf16"
#else
#define WW_AB "f16"
#endif

// The PTX of this rung. tests/cupy/quant/test_wna16_wgmma.py builds this file on the CPU
// with QG_EMULATED_PTX and the emulator's versions (tests/emulator/kernels.h: wgmma by its
// definition, through the descriptor).
#ifndef QG_EMULATED_PTX
__device__ __forceinline__ u32 ww_smem(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

#endif  // QG_EMULATED_PTX

// Pin registers in place for ptxas: an empty asm that "rewrites" them. Without it the compiler
// computes the A fragments (and the descriptors) right before each wgmma, inside the pipeline
// stage, and ptxas then serializes every wgmma (its C7513 warning: a wait after each one); with
// it, each value is final before wgmma.fence.
__device__ __forceinline__ void ww_pin1(u32& v) {
#ifndef QG_EMULATED_PTX
    asm volatile("" : "+r"(v)::"memory");
#endif
}
__device__ __forceinline__ void ww_pin1(u64& v) {
#ifndef QG_EMULATED_PTX
    asm volatile("" : "+l"(v)::"memory");
#endif
}
__device__ __forceinline__ void ww_pin1(float& v) {
#ifndef QG_EMULATED_PTX
    asm volatile("" : "+f"(v)::"memory");
#endif
}
template <typename T, int N>
__device__ __forceinline__ void ww_pin(T (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) ww_pin1(r[i]);
}

#ifndef QG_EMULATED_PTX
// d (this thread's NN / 2 accumulators of the 64 x NN tile) = A (the warp's 16 rows of the
// 64 x 16 step: a0..a3) * B (16 x NN through desc) + (acc ? d : 0)
template <int NN> struct WwMma;
// the NN = 8 LT live token rows of the tile: R = NN / 2 accumulators (WG_ACC<R>), then a0..a3,
// desc, acc
#define WW_MMA(NN, REGS, ACC, A_REGS, I_DESC, I_SCALE_D)                                      \
    template <> struct WwMma<NN> {                                                           \
        static __device__ __forceinline__ void run(float (&d)[NN / 2], u32 a0, u32 a1, u32 a2, \
                                                   u32 a3, u64 desc, int acc) {              \
            WG_MMA_RS("m64n" #NN "k16.f32." WW_AB "." WW_AB, ", 1, 1, 0", REGS, A_REGS,       \
                      ACC(d, 0),                                                             \
                      I_DESC, I_SCALE_D, a0, a1, a2, a3, desc, acc);                          \
        }                                                                                    \
    };
WW_MMA(8, WG_REGS4, WG_ACC4, "%4, %5, %6, %7", 8, 9)
WW_MMA(16, WG_REGS8, WG_ACC8, "%8, %9, %10, %11", 12, 13)
WW_MMA(24, WG_REGS12, WG_ACC12, "%12, %13, %14, %15", 16, 17)
WW_MMA(32, WG_REGS16, WG_ACC16, "%16, %17, %18, %19", 20, 21)
#endif  // QG_EMULATED_PTX

// The descriptor of B for k16 step m of the stage at shared address `stage` (MT token tiles):
// bits 0-13 start >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4, 62-63
// layout 0 (no swizzle).
template <int MT>
__device__ __forceinline__ u64 ww_desc_b(u32 stage, int m) {
    const u32 start = stage + 2u * m * MT * 128u;
    return (u64)((start & 0x3FFFFu) >> 4) | ((u64)((MT * 128u) >> 4) << 16) |
           ((u64)(128u >> 4) << 32);
}

template <int MT, int D, int S, int MINB, int RB>
__global__ void __launch_bounds__(128, MINB)
wna16_v6_wgmma(W16_PACKED_ARGS, int groups_per_cta, int chunks_per_split,
               float* __restrict__ ws, int* __restrict__ counters) {
    static_assert(D >= S - 1 && S >= 2, "wna16_v6_wgmma: the weights run at least as far "
                  "ahead as the activations (one cp.async group per item covers both), S >= 2");
    constexpr int BM = 8 * MT;
    constexpr int STAGE = 8 * MT * 128;           // bytes of one activation stage
    __shared__ int sSlot[BM];                     // slot s, or -1 (padding)
    __shared__ int sArow[BM];                     // its row of a, or -1
    __shared__ int sLast;                         // split K: this CTA adds the partials

    const int m0 = blockIdx.x * BM;
    if (!w16::load_m_tile<BM>(m0, sorted_token_ids, num_tokens_post_padded, num_slots, top_k,
                              num_positions, sSlot, sArow))
        return;                                   // padding only
    const int tid = threadIdx.x;
    const int e = expert_ids[m0 / block_size];    // BM divides block_size: one expert
    const int j0 = blockIdx.y * groups_per_cta;
    const int j1 = min(N >> 6, j0 + groups_per_cta);
    if (j0 >= j1) return;
    if (e < 0) {                                  // expert of another rank: zeros
        w16::store_zeros<BM>(c, sSlot, N, j0 * 64, (j1 - j0) * 64, 128);
        return;
    }
    int live_tiles = 0;                           // up to the last tile with a live row
    for (int r = 0; r < BM; ++r)
        if (sArow[r] >= 0) live_tiles = r / 8 + 1;

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int C = Kdim >> 6;                      // 64-code chunks per row
    const int c0 = blockIdx.z * chunks_per_split; // this split's chunks [c0, c1): whole groups
    const int c1 = min(C, c0 + chunks_per_split);
    const int ntiles = N >> 4;
    const uint4* wexp = wp + (size_t)e * ntiles * C * 32 + lane;
    const float2* sexp = sp + (size_t)e * ntiles * num_groups * 8 + g;
    // the aligned word holding rows g & ~1 and g | 1's zero points (cp.async takes 4 bytes)
    const unsigned short* zexp = zp != nullptr ? zp + (size_t)e * ntiles * num_groups * 8 +
                                                 (g & ~1) : nullptr;
    const u32 zdef = qg_magic_pair((u32)default_zp);
    const int cpg_mask = (1 << chunk_shift) - 1;  // chunk & cpg_mask == 0: a group's first
    // dynamic shared memory: S activation stages, then the warps' weight rings:
    // [4 warps][D][RB][32 lanes] uint4 codes, float2 scales, u32 zero-point words
    extern __shared__ __align__(128) u8 smem[];   // 128: see wna16_common.cuh
    constexpr int RING = 4 * D * RB * 32;         // ring entries of each kind
    const u32 ring_b = ww_smem(smem);
    uint4* ring_w = reinterpret_cast<uint4*>(smem + S * STAGE) + warp * D * RB * 32 + lane;
    float2* ring_s = reinterpret_cast<float2*>(smem + S * STAGE + RING * 16) +
                     warp * D * RB * 32 + lane;
    u32* ring_z = reinterpret_cast<u32*>(smem + S * STAGE + RING * 24) + warp * D * RB * 32 +
                  lane;

    w16::with_count<1, MT>(live_tiles, [&](auto live_count) {
        constexpr int LT = decltype(live_count)::value;
        constexpr int NN = 8 * LT;                // wgmma n: the live token rows

        // a chunk's activations are NN x 8 pieces of 16 bytes (row r, kb); thread tid copies
        // pieces tid + 128 q, two consecutive kb per pair of threads (whole 32-byte sectors
        // from global): their source rows and stage offsets, once
        constexpr int NP = (NN * 8 + 127) / 128;
        const elem_t* p_src[NP];
        int p_dst[NP];                            // -1: not this thread's; else the offset,
        bool p_live[NP];                          // and whether the row is live (else zeros)
#pragma unroll
        for (int q = 0; q < NP; ++q) {
            const int i = tid + 128 * q;
            const int kb = 2 * (i / (2 * NN)) + (i & 1), r = (i >> 1) % NN;
            const int ar = i < NN * 8 ? sArow[r] : -1;
            p_src[q] = a + (size_t)(ar >= 0 ? ar : 0) * Kdim + kb * 8;
            p_dst[q] = i < NN * 8 ? (kb * MT + (r >> 3)) * 128 + (r & 7) * 16 : -1;
            p_live[q] = ar >= 0;
        }
        // the CTA's items are (block of RB row groups from jb, chunk cc), chunk fastest; a
        // block's groups past j1 repeat group j1 - 1 (computed, never stored), so that every
        // item has the same wgmma batch. The next item to copy the activations of (S - 1
        // ahead) and the next to load the weights of (D ahead).
        const int items = (j1 - j0 + RB - 1) / RB * (c1 - c0);
        int cp_left = items, cp_cc = c0, cp_stage = 0;
        int ld_left = items, ld_j = j0, ld_cc = c0, ld_slot = 0;
        auto copy_next = [&]() {
            if (cp_left > 0) {
#pragma unroll
                for (int q = 0; q < NP; ++q)
                    if (p_dst[q] >= 0)
                        w16::cp16(smem + cp_stage * STAGE + p_dst[q], p_src[q] + cp_cc * 64,
                                  p_live[q]);
                --cp_left;
                cp_cc = cp_cc + 1 < c1 ? cp_cc + 1 : c0;
                cp_stage = cp_stage + 1 < S ? cp_stage + 1 : 0;
            }
        };
        // the weights' walk, per row group r: the lane's codes of the next chunk to load, and
        // its group's scales / zero points (offset in groups of 8 rows): set when a block
        // starts, stepped by one chunk (one group) otherwise: no index arithmetic per item
        const uint4* ld_w[RB];
        int ld_g[RB];
        auto ld_block = [&]() {
#pragma unroll
            for (int r = 0; r < RB; ++r) {
                const int tile = 4 * min(ld_j + r, j1 - 1) + warp;
                ld_w[r] = wexp + ((size_t)tile * C + c0) * 32;
                ld_g[r] = (tile * num_groups + (c0 >> chunk_shift)) * 8;
            }
        };
        ld_block();
        // the lane's 16 bytes of codes; at a group's first chunk only, its scales and zero
        // points (the item that dequantizes that chunk keeps them in registers for the group)
        auto load_next = [&]() {
            if (ld_left > 0) {
                const bool group_first = (ld_cc & cpg_mask) == 0 || ld_cc == c0;  // or split's
#pragma unroll
                for (int r = 0; r < RB; ++r) {
                    const int at = (ld_slot * RB + r) * 32;
                    w16::cp16(ring_w + at, ld_w[r], true);
                    ld_w[r] += 32;
                    if (group_first) {
                        w16::cp8(ring_s + at, sexp + ld_g[r]);
                        if (zexp != nullptr) w16::cp4(ring_z + at, zexp + ld_g[r], true);
                        ld_g[r] += 8;
                    }
                }
                --ld_left;
                if (++ld_cc == c1) {
                    ld_cc = c0;
                    ld_j += RB;
                    if (ld_left > 0) ld_block();
                }
                ld_slot = ld_slot + 1 < D ? ld_slot + 1 : 0;
            }
        };
        float acc[RB][NN / 2];                    // wgmma's
#pragma unroll
        for (int r = 0; r < RB; ++r)
#pragma unroll
            for (int i = 0; i < NN / 2; ++i) acc[r][i] = 0.f;
        u32 A[RB][4][4];                          // row groups x k16 steps x a0..a3
        const u64 desc0 = ww_desc_b<MT>(ring_b, 0);  // stage s, step m: + (s STAGE + 2 m MT 128) / 16
        int stage = 0, slot = 0;                  // this item's activation stage, weight slot

        // row group r of the item in slot `slot` -> A[r]: 128 + q minus 128 + zp, times s (at
        // a group's first chunk, its scales and zero points: (s, s) and (QG_MAGIC + zp) pairs of
        // rows g and g + 8, kept for the group)
        u32 dq[RB][4];
        auto dequantize = [&](int r, bool first) {
            const int at = (slot * RB + r) * 32;
            const uint4 x = ring_w[at];
            if (first) {
                const float2 s2 = ring_s[at];
                u32 zl = zdef, zh = zdef;
                if (zexp != nullptr) {
                    const u32 z = ring_z[at] >> (16 * (g & 1));
                    zl = qg_magic_pair(z & 0xFFu);
                    zh = qg_magic_pair((z >> 8) & 0xFFu);
                }
                dq[r][0] = w16::pack2(s2.x, s2.x);
                dq[r][1] = w16::pack2(s2.y, s2.y);
                dq[r][2] = zl;
                dq[r][3] = zh;
            }
            const u32 sl = dq[r][0], sh = dq[r][1];
            const u32 zl = dq[r][2], zh = dq[r][3];
#pragma unroll
            for (int m = 0; m < 4; ++m) {         // pairs 2 (m & 1), + 1 of words m >> 1
                const u32 wl = m < 2 ? x.x : x.z, wh = m < 2 ? x.y : x.w;
                const int p = 2 * (m & 1);
                const u32 mk = 0x000F000Fu;
                A[r][m][0] = w16::deq2(w16::and_or(wl >> (4 * p), mk, QG_MAGIC), zl, sl);
                A[r][m][1] = w16::deq2(w16::and_or(wh >> (4 * p), mk, QG_MAGIC), zh, sh);
                A[r][m][2] = w16::deq2(w16::and_or(wl >> (4 * p + 4), mk, QG_MAGIC), zl, sl);
                A[r][m][3] = w16::deq2(w16::and_or(wh >> (4 * p + 4), mk, QG_MAGIC), zh, sh);
            }
        };
        // one item (chunk cc): its copies, the previous item's wgmma batch done (A is free, and
        // the stage it read is refilled below), a barrier, dequantize the RB row groups, one
        // batch of 4 RB wgmma. The batch runs while this item's refills are issued and the next
        // item waits for its copies and meets at its barrier: ptxas keeps wgmma asynchronous
        // only when no wgmma operand is defined while a batch is in flight (else C7513: it
        // waits after every wgmma), so the dequantization cannot overlap the previous batch.
        auto item = [&](int cc) {
            const bool first = (cc & cpg_mask) == 0 || cc == c0;   // a group's (split's) first
            w16::cp_wait<S - 2>();                // the item's copies (its weights are older)
            wg_wait<0>();
            wg_fence_proxy_async();               // everyone's activation copies of the item,
            __syncthreads();                      // visible to wgmma's async proxy
#pragma unroll
            for (int r = 0; r < RB; ++r) {
                dequantize(r, first);
#pragma unroll
                for (int m = 0; m < 4; ++m) ww_pin(A[r][m]);
                ww_pin(acc[r]);
            }
            const u64 desc = desc0 + (u64)((stage * STAGE) >> 4);
            u64 dm[4];                            // every operand final before the fence
            u32 keep[4];
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                dm[m] = desc + (u64)((2 * m * MT * 128) >> 4);
                keep[m] = cc != c0 || m != 0;      // a block's first wgmma: scale-d = 0
            }
            ww_pin(dm);
            ww_pin(keep);
            wg_fence();
#pragma unroll
            for (int r = 0; r < RB; ++r)
#pragma unroll
                for (int m = 0; m < 4; ++m)
                    WwMma<NN>::run(acc[r], A[r][m][0], A[r][m][1], A[r][m][2], A[r][m][3], dm[m],
                                   keep[m]);
            wg_commit();
            stage = stage + 1 < S ? stage + 1 : 0;
            slot = slot + 1 < D ? slot + 1 : 0;
            load_next();                          // into the slot just read (D items on)
            copy_next();                          // into the stage item - 1 read (done)
            w16::cp_commit();
        };

        // the first D items' weights and S - 1 items' activations, one group per item
        for (int k = 0; k < D; ++k) {
            load_next();
            if (k < S - 1) copy_next();
            w16::cp_commit();
        }
        for (int jb = j0; jb < j1; jb += RB) {
            for (int cc = c0; cc < c1; ++cc) item(cc);
            wg_wait<0>();                   // the block's accumulators are final
#pragma unroll
            for (int r = 0; r < RB; ++r) ww_pin(acc[r]);
            // split K: the last CTA of the block's tile adds the partials (the others go on)
            if (gridDim.z > 1 &&
                !w16::split_k_last<RB * NN / 2, 128>(
                    &acc[0][0], ws, counters,
                    ((size_t)blockIdx.x * gridDim.y + blockIdx.y) * (groups_per_cta / RB) +
                        (jb - j0) / RB,
                    RB * (BM / 2) * 128, sLast))
                continue;
#pragma unroll
            for (int r = 0; r < RB; ++r) {
                if (jb + r >= j1) break;          // a repeated group: never stored
                const int n0 = 64 * (jb + r) + 16 * warp + g;
#pragma unroll
                for (int nb = 0; nb < LT; ++nb)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int tok = 8 * nb + 2 * t + (i & 1), n = n0 + 8 * (i >> 1);
                        const int s = sSlot[tok];
                        if (s < 0) continue;
                        float v = acc[r][4 * nb + i];
                        if (bias != nullptr) v += bias[(size_t)e * N + n];
                        if (mul_routed_weight) v *= topk_weights[s];
                        c[(size_t)s * N + n] = w16::from_f32(v);
                    }
            }
        }
        w16::cp_wait<0>();                        // nothing in flight at exit
    });
}
