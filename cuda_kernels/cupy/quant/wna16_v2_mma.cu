// quant_gemm.cu: the fused MoE grouped GEMM on quantized operands.
//
//   c[s] = (deq(a)[s / top_k] @ deq(w[e]).T + bias[e]) * (topk_weights[s] if mul_routed_weight)
//
// for every live position p of sorted_token_ids (slot s = sorted_token_ids[p] < P, e =
// expert_ids[p / block_size], p < num_tokens_post_padded); e == -1 writes zeros. fp32
// accumulation, one rounding to the 16-bit output type (reference/quant.py grouped_gemm_quant).
//
// Shapes: P = slots, N = output width, Kdim = reduction width, E = local experts,
// KB = cdiv(Kdim, 128), NB = cdiv(N, 128), G = weight-only groups per row.
//   w8a8   a [M_a, Kdim] fp8 e4m3 bytes / int8     a_scale [1] | [M_a] | [M_a, KB]   fp32
//          w [E, N, Kdim] fp8 e4m3 bytes / int8    w_scale [E] | [E, N] | [E, NB, KB] fp32
//   wna16  a [M_a, Kdim] bf16 / fp16 (elem_t)      w int4: [E, N, Kdim/2] bytes, k = 2j in the
//          low nibble of byte j; int8: [E, N, Kdim] bytes. w_scale [E, N, G] fp32, w_zp [E, N, G]
//          uint8 or null (then default_zp); code_xor = 0x80 reads int8 (signed) codes as
//          uint8 codes with zero point 128.
//   c [P, N] elem_t, bias [E, N] fp32 or null, topk_weights [P] fp32.
//
// Block-scaled w8a8 ("DeepSeek-V3", a_scale [M_a, KB] and w_scale [E, NB, KB]): each 128-wide
// K block's partial sum is scaled by a_scale[row, kb] * w_scale[e, n / 128, kb] and added to
// the fp32 accumulator. Per-tensor / per-token / per-channel scales multiply once at the end.
//
// The ladder (all kept; the launcher picks the best that applies):
//   w8a8_gemm_v1<QT>     CUDA cores, one thread per output, codes converted to fp32 (int8:
//                        exact int32 dot per K block). grid (Lg, cdiv(N, 128)), block 128.
//   w8a8_gemm_v2<QT, BM, BN, WARPS_M, WARPS_N, STAGES>
//                        tensor cores: mma.sync m16n8k32 e4m3 x e4m3 -> f32 (sm_89+) or
//                        s8 x s8 -> s32 (sm_80+), 128-wide K tiles through a cp.async ring of
//                        STAGES buffers, fragments read from padded shared rows (no ldmatrix:
//                        8-bit fragments are 4 consecutive k bytes, one 32-bit load).
//                        grid (cdiv(Lg, BM), cdiv(N, BN)), block WARPS_M * WARPS_N * 32,
//                        dynamic smem = STAGES * ((BM + BN) * 144 + BM * 4)
//                                       + 16 * cdiv(STAGES * 4, 16) + BM * 8.
//   wna16_gemm_v1<NBITS> CUDA cores, one thread per output, codes dequantized to fp32.
//                        grid (Lg, cdiv(N, 128)), block 128.
//   wna16_gemm_v2<NBITS, BM, BN, BK, WARPS_M, WARPS_N, STAGES>
//                        tensor cores: mma.sync m16n8k16 bf16/f16 -> f32; activations and raw
//                        weight bytes through a cp.async ring; each thread dequantizes its own
//                        B fragment in registers, (q - zp) * s in fp32 (q - zp exact via the
//                        2^23 magic number), rounded to elem_t; 1, 2 or 4 groups per K
//                        tile (group_size >= BK / 4).
//                        grid (cdiv(Lg, BM), cdiv(N, BN)), block WARPS_M * WARPS_N * 32,
//                        dynamic smem = STAGES * (BM * (2 BK + 16) + BN * WROW) + BM * 8.
//   wna16_gemv_v3<MT, WARPS, U, MINB>
//                        decode (a few rows per expert, int4): weights are the mma's A operand,
//                        16 rows per CTA streamed straight into registers (16-byte loads, U
//                        K steps in flight per thread), activations (8 * MT rows) its B, K split
//                        over the warps and reduced in order; see its comment below.
//                        grid (cdiv(Lg, 8 MT), cdiv(N, 16)), block WARPS * 32.
// Lg = min(L, P * block_size): no live position lies past it (num_tokens_post_padded <= P * B).
// Grid order: blockIdx.x walks the m tiles (fastest), so the CTAs that run together share an
// n tile of each expert's weights, which are then read from HBM about once.
//
// ELEM_BF16 (#define, 1 or 0) picks elem_t = __nv_bfloat16 or __half.
// Run: python -m cuda_kernels.cupy.quant_gemm [--quick]
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#ifndef ELEM_BF16
#error "ELEM_BF16 (1: bf16, 0: fp16) must be #defined by the launcher"
#endif

#if ELEM_BF16
typedef __nv_bfloat16 elem_t;
#define QG_MMA_16816 "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#else
typedef __half elem_t;
#define QG_MMA_16816 "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#endif

typedef unsigned char u8;
typedef unsigned int u32;

#define QG_FP8 0
#define QG_INT8 1
#define QG_KBLOCK 128          // K width of a quantization block (DeepSeek-V3 128x128)

// ---------------------------------------------------------------------------- small helpers
__device__ __forceinline__ float qg_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float qg_to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ void qg_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void qg_store(__half* p, float v) { *p = __float2half_rn(v); }

// two floats -> one 32-bit register of two 16-bit values, `lo` in the low half (the element
// with the smaller k or n index, as mma fragments and little-endian memory both expect)
__device__ __forceinline__ u32 qg_pack(float lo, float hi) {
#if ELEM_BF16
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
#else
    __half2 v = __floats2half2_rn(lo, hi);
#endif
    return *reinterpret_cast<u32*>(&v);
}

// A slot is live when 0 <= s < P (padding is P; the unsigned compare also drops negatives).
__device__ __forceinline__ bool qg_live(int s, int num_slots) {
    return (unsigned)s < (unsigned)num_slots;
}

__device__ __forceinline__ float qg_fp8_to_f32(u8 b) {
    __nv_fp8_e4m3 v;
    v.__x = b;
    return float(v);
}

// bias then router weight, fp32, in the order of docs/stages.md
__device__ __forceinline__ float qg_epilogue(float acc, int e, int n, int s, int N,
                                             const float* __restrict__ bias,
                                             const float* __restrict__ topk_weights,
                                             int mul_routed_weight) {
    if (bias != nullptr) acc += bias[(long long)e * N + n];
    if (mul_routed_weight) acc *= topk_weights[s];
    return acc;
}

// ---------------------------------------------------------------------------- cp.async, mma
// The only inline PTX of this file. tests/test_quant_cupy.py runs this source on the CPU by
// #defining QG_EMULATED_PTX and supplying these helpers (same names and semantics), so that
// everything else here executes as written before a GPU sees it.
#ifndef QG_EMULATED_PTX
__device__ __forceinline__ u32 qg_smem(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared; src_bytes = 0 writes zeros and reads nothing (out-of-range tiles)
__device__ __forceinline__ void qg_cp16(void* dst, const void* src, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(qg_smem(dst)), "l"(src), "r"(pred ? 16 : 0) : "memory");
}
__device__ __forceinline__ void qg_cp4(void* dst, const void* src, bool pred) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(qg_smem(dst)), "l"(src), "r"(pred ? 4 : 0) : "memory");
}
__device__ __forceinline__ void qg_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void qg_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// D += A (16x32, row) * B (32x8, col): 8-bit fragments, a[i] / b[i] hold 4 consecutive k bytes.
//   a[0]: row g, k 4t..4t+3     a[1]: row g+8, k 4t..4t+3
//   a[2]: row g, k 16+4t..      a[3]: row g+8, k 16+4t..
//   b[0]: col g, k 4t..4t+3   b[1]: col g, k 16+4t..
//   d[0], d[1]: row g, cols 2t, 2t+1   d[2], d[3]: row g+8        (g = lane / 4, t = lane % 4)
__device__ __forceinline__ void qg_mma_k32(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();   // fp8 tensor cores start at sm_89; the launcher never sends fp8 here below that
#endif
}
__device__ __forceinline__ void qg_mma_k32(int (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// D += A (16x16, row) * B (16x8, col), 16-bit elements, two per register (lower k low):
//   a[0]: row g, k 2t,2t+1      a[1]: row g+8, k 2t,2t+1
//   a[2]: row g, k 2t+8,2t+9    a[3]: row g+8, k 2t+8,2t+9
//   b[0]: col g, k 2t,2t+1   b[1]: col g, k 2t+8, 2t+9
__device__ __forceinline__ void qg_mma_k16(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(QG_MMA_16816
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// 16 bytes global -> 4 registers through the read-only path. _stream: weights, read once,
// kept out of L1 (L1::no_allocate) so that the activations every warp re-reads stay there.
__device__ __forceinline__ void qg_ld16_stream(u32 (&r)[4], const void* p) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
}
__device__ __forceinline__ void qg_ld16(u32 (&r)[4], const void* p) {
    asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
}
// x - y on two 16-bit floats per register (elem_t), round to nearest
__device__ __forceinline__ u32 qg_sub2(u32 x, u32 y) {
#if ELEM_BF16
    __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&x),
                               *reinterpret_cast<__nv_bfloat162*>(&y));
#else
    __half2 r = __hsub2(*reinterpret_cast<__half2*>(&x), *reinterpret_cast<__half2*>(&y));
#endif
    return *reinterpret_cast<u32*>(&r);
}
#endif  // QG_EMULATED_PTX

// ---------------------------------------------------------------------------- shared epilogue
// Write one fragment pair (cols n, n+1 of row slot s) through the epilogue; paired 32-bit
// store when both columns exist and the address is 4-byte aligned.
__device__ __forceinline__ void qg_store_pair(elem_t* __restrict__ c, int s, int n, int N, float v0,
                                              float v1, int e, const float* __restrict__ bias,
                                              const float* __restrict__ topk_weights,
                                              int mul_routed_weight) {
    if (n >= N) return;
    const long long off = (long long)s * N + n;
    v0 = qg_epilogue(v0, e, n, s, N, bias, topk_weights, mul_routed_weight);
    if (n + 1 < N) {
        v1 = qg_epilogue(v1, e, n + 1, s, N, bias, topk_weights, mul_routed_weight);
        if ((off & 1) == 0) {
            *reinterpret_cast<u32*>(c + off) = qg_pack(v0, v1);
            return;
        }
        qg_store(c + off + 1, v1);
    }
    qg_store(c + off, v0);
}

// ============================================================================ w8a8 v1
// One thread per output element; codes widened to fp32 (fp8) or multiplied exactly in int32.
// a_scale_kind: 0 per-tensor a_scale[0], 1 per-token a_scale[row], 2 per-group a_scale[row*KB+kb]
// w_scale_kind: 0 per-expert w_scale[e], 1 per-channel w_scale[e*N+n], 2 per-block
// (the two kinds are 2 together: DeepSeek-V3 blocks)
template <int QT>
__global__ void __launch_bounds__(128)
w8a8_gemm_v1(const u8* __restrict__ a, const u8* __restrict__ w, elem_t* __restrict__ c,
             const float* __restrict__ a_scale, const float* __restrict__ w_scale,
             const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
             const int* __restrict__ num_tokens_post_padded, const float* __restrict__ topk_weights,
             const float* __restrict__ bias,
             int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,
             int mul_routed_weight, int a_scale_kind, int w_scale_kind) {
    const int p = blockIdx.x;
    if (p >= num_tokens_post_padded[0] || p >= num_positions) return;
    const int s = sorted_token_ids[p];
    if (!qg_live(s, num_slots)) return;
    const int n = blockIdx.y * 128 + threadIdx.x;
    if (n >= N) return;
    const int e = expert_ids[p / block_size];
    if (e < 0) {
        qg_store(c + (long long)s * N + n, 0.f);
        return;
    }
    const int row = s / top_k;
    const int KB = (Kdim + QG_KBLOCK - 1) / QG_KBLOCK;
    const int NB = (N + QG_KBLOCK - 1) / QG_KBLOCK;
    const u8* ar = a + (long long)row * Kdim;
    const u8* wr = w + ((long long)e * N + n) * Kdim;
    float acc = 0.f;
    for (int kb = 0; kb < KB; ++kb) {
        const int k1 = min((kb + 1) * QG_KBLOCK, Kdim);
        float part;
        if (QT == QG_FP8) {
            part = 0.f;
            for (int k = kb * QG_KBLOCK; k < k1; ++k)
                part += qg_fp8_to_f32(ar[k]) * qg_fp8_to_f32(wr[k]);
        } else {
            int ip = 0;   // |ip| <= 128 * 128 * 128: exact
            for (int k = kb * QG_KBLOCK; k < k1; ++k)
                ip += (int)(signed char)ar[k] * (int)(signed char)wr[k];
            part = (float)ip;
        }
        if (a_scale_kind == 2)
            part *= a_scale[(long long)row * KB + kb] *
                    w_scale[((long long)e * NB + n / QG_KBLOCK) * KB + kb];
        acc += part;
    }
    if (a_scale_kind != 2) {
        const float sa = a_scale_kind == 0 ? a_scale[0] : a_scale[row];
        const float sw = w_scale_kind == 0 ? w_scale[e] : w_scale[(long long)e * N + n];
        acc *= sa * sw;
    }
    qg_store(c + (long long)s * N + n,
             qg_epilogue(acc, e, n, s, N, bias, topk_weights, mul_routed_weight));
}

// ============================================================================ w8a8 v2
template <int QT> struct QgPart { typedef float T; };
template <> struct QgPart<QG_INT8> { typedef int T; };

template <int QT, int BM, int BN, int WARPS_M, int WARPS_N, int STAGES>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * 32)
w8a8_gemm_v2(const u8* __restrict__ a, const u8* __restrict__ w, elem_t* __restrict__ c,
             const float* __restrict__ a_scale, const float* __restrict__ w_scale,
             const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
             const int* __restrict__ num_tokens_post_padded, const float* __restrict__ topk_weights,
             const float* __restrict__ bias,
             int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,
             int mul_routed_weight, int a_scale_kind, int w_scale_kind) {
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
    int live = 0;
    for (int r = tid; r < BM; r += NT) {
        const int p = m0 + r;
        const int s = p < num_positions ? sorted_token_ids[p] : num_slots;
        sSlot[r] = s;
        sArow[r] = qg_live(s, num_slots) ? s / top_k : -1;
        live |= qg_live(s, num_slots);
    }
    // a tile smaller than the alignment block may hold padding only: skip it whole
    if (__syncthreads_or(live) == 0) return;
    if (e < 0) {                                                // expert on another rank
        for (int i = tid; i < BM * BN; i += NT) {
            const int r = i / BN, n = n0 + i % BN;
            if (qg_live(sSlot[r], num_slots) && n < N)
                qg_store(c + (long long)sSlot[r] * N + n, 0.f);
        }
        return;
    }
    const int KB = (Kdim + BK - 1) / BK;
    const int NB = (N + QG_KBLOCK - 1) / QG_KBLOCK;
    // 64-bit expert base once; offsets inside one expert fit 32 bits (the launcher checks
    // N * Kdim < 2^31, the whole w may not: DeepSeek-V3's w13 is 7.5e9 bytes)
    const u8* wexp = w + (long long)e * N * Kdim;

    auto load_stage = [&](int stage, int kb) {
        const int k0 = kb * BK;
        u8* dA = sA + stage * BM * ROW;
        for (int i = tid; i < BM * CH; i += NT) {
            const int r = i / CH, k = k0 + (i % CH) * 16;
            const int arow = sArow[r];
            const bool ok = arow >= 0 && k < Kdim;              // Kdim % 16 == 0: whole chunks
            qg_cp16(dA + r * ROW + (i % CH) * 16, ok ? a + (long long)arow * Kdim + k : a, ok);
        }
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

#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < KB) load_stage(st, st);
        qg_commit();                                 // one group per stage, even when empty
    }

    const int warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[mi][ni][j] = 0.f;

    for (int kt = 0; kt < KB; ++kt) {
        qg_wait<STAGES - 2>();                       // tile kt has landed (for this thread)
        __syncthreads();                             // ... for every thread; stage kt-1 is free
        {
            const int nk = kt + STAGES - 1;
            if (nk < KB) load_stage(nk % STAGES, nk);
            qg_commit();
        }
        const int st = kt % STAGES;
        const u8* tA = sA + st * BM * ROW + (wm * WM) * ROW;
        const u8* tW = sW + st * BN * ROW + (wn * WN) * ROW;
        part_t part[MI][NI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int j = 0; j < 4; ++j) part[mi][ni][j] = 0;
#pragma unroll
        for (int kk = 0; kk < BK / 32; ++kk) {
            u32 af[MI][4], bfr[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                const u8* p = tA + (mi * 16 + g) * ROW + kk * 32 + t * 4;
                af[mi][0] = *reinterpret_cast<const u32*>(p);
                af[mi][1] = *reinterpret_cast<const u32*>(p + 8 * ROW);
                af[mi][2] = *reinterpret_cast<const u32*>(p + 16);
                af[mi][3] = *reinterpret_cast<const u32*>(p + 8 * ROW + 16);
            }
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

#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm * WM + mi * 16 + g + h * 8;
            const int s = sSlot[r];
            if (!qg_live(s, num_slots)) continue;
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
        }
    }
}

// ============================================================================ wna16 v1
template <int NBITS>
__device__ __forceinline__ int qg_code(const u8* __restrict__ wr, int k, int code_xor) {
    if (NBITS == 4) {
        const u8 b = wr[k >> 1];
        return (k & 1) ? (b >> 4) : (b & 0xF);
    }
    return wr[k] ^ code_xor;
}

template <int NBITS>
__global__ void __launch_bounds__(128)
wna16_gemm_v1(const elem_t* __restrict__ a, const u8* __restrict__ w, elem_t* __restrict__ c,
              const float* __restrict__ w_scale, const u8* __restrict__ w_zp,
              const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
              const int* __restrict__ num_tokens_post_padded,
              const float* __restrict__ topk_weights, const float* __restrict__ bias,
              int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,
              int mul_routed_weight, int group_size, int num_groups, int default_zp, int code_xor) {
    const int p = blockIdx.x;
    if (p >= num_tokens_post_padded[0] || p >= num_positions) return;
    const int s = sorted_token_ids[p];
    if (!qg_live(s, num_slots)) return;
    const int n = blockIdx.y * 128 + threadIdx.x;
    if (n >= N) return;
    const int e = expert_ids[p / block_size];
    if (e < 0) {
        qg_store(c + (long long)s * N + n, 0.f);
        return;
    }
    const elem_t* ar = a + (long long)(s / top_k) * Kdim;
    const long long wrow = (long long)e * N + n;
    const u8* wr = w + wrow * (NBITS == 4 ? Kdim / 2 : Kdim);
    const float* sr = w_scale + wrow * num_groups;
    const u8* zr = w_zp != nullptr ? w_zp + wrow * num_groups : nullptr;
    float acc = 0.f;
    for (int k = 0; k < Kdim; ++k) {
        const int gi = k / group_size;
        const int zp = zr != nullptr ? (int)zr[gi] : default_zp;
        const float wv = (float)(qg_code<NBITS>(wr, k, code_xor) - zp) * sr[gi];
        acc += qg_to_f32(ar[k]) * wv;
    }
    qg_store(c + (long long)s * N + n,
             qg_epilogue(acc, e, n, s, N, bias, topk_weights, mul_routed_weight));
}

// ============================================================================ wna16 v2
// (q - zp) exactly, as fp32, without an int -> float conversion: 2^23 + q has q in its
// mantissa, and 2^23 + zp is exact too, so their difference is q - zp with no rounding.
__device__ __forceinline__ float qg_deq(u32 q, float zoff, float sc) {
    return (__uint_as_float(0x4B000000u | q) - zoff) * sc;
}

template <int NBITS, int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES>
__global__ void __launch_bounds__(WARPS_M * WARPS_N * 32)
wna16_gemm_v2(const elem_t* __restrict__ a, const u8* __restrict__ w, elem_t* __restrict__ c,
              const float* __restrict__ w_scale, const u8* __restrict__ w_zp,
              const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
              const int* __restrict__ num_tokens_post_padded,
              const float* __restrict__ topk_weights, const float* __restrict__ bias,
              int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,
              int mul_routed_weight, int group_size, int num_groups, int default_zp, int code_xor) {
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
    if (m0 >= num_tokens_post_padded[0] || m0 >= num_positions) return;
    const int n0 = blockIdx.y * BN;
    const int e = expert_ids[m0 / block_size];
    const int tid = threadIdx.x;
    int live = 0;
    for (int r = tid; r < BM; r += NT) {
        const int p = m0 + r;
        const int s = p < num_positions ? sorted_token_ids[p] : num_slots;
        sSlot[r] = s;
        sArow[r] = qg_live(s, num_slots) ? s / top_k : -1;
        live |= qg_live(s, num_slots);
    }
    if (__syncthreads_or(live) == 0) return;                  // padding-only tile
    if (e < 0) {
        for (int i = tid; i < BM * BN; i += NT) {
            const int r = i / BN, n = n0 + i % BN;
            if (qg_live(sSlot[r], num_slots) && n < N)
                qg_store(c + (long long)sSlot[r] * N + n, 0.f);
        }
        return;
    }
    const int KT = (Kdim + BK - 1) / BK;
    const int wrow_bytes = Kdim * NBITS / 8;
    // 64-bit expert base once, 32-bit offsets inside the expert (launcher: N * row bytes < 2^31)
    const u8* wexp = w + (long long)e * N * wrow_bytes;

    auto load_stage = [&](int stage, int kt) {
        const int k0 = kt * BK;
        u8* dA = sA + stage * BM * AROW;
        for (int i = tid; i < BM * ACH; i += NT) {
            const int r = i / ACH, k = k0 + (i % ACH) * 8;
            const int arow = sArow[r];
            const bool ok = arow >= 0 && k < Kdim;              // Kdim % 32 == 0: whole chunks
            qg_cp16(dA + r * AROW + (i % ACH) * 16, ok ? a + (long long)arow * Kdim + k : a, ok);
        }
        u8* dW = sW + stage * BN * WROW;
        const int kb0 = k0 * NBITS / 8;
        for (int i = tid; i < BN * WCH; i += NT) {
            const int r = i / WCH, n = n0 + r;
            const int kb = kb0 + (i % WCH) * 16;
            const bool ok = n < N && kb < wrow_bytes;
            qg_cp16(dW + r * WROW + (i % WCH) * 16, ok ? wexp + n * wrow_bytes + kb : w, ok);
        }
    };

#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < KT) load_stage(st, st);
        qg_commit();
    }

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
    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[mi][ni][j] = 0.f;

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
        qg_wait<STAGES - 2>();
        __syncthreads();
        {
            const int nk = kt + STAGES - 1;
            if (nk < KT) load_stage(nk % STAGES, nk);
            qg_commit();
        }
        const int st = kt % STAGES;
        const u8* tA = sA + st * BM * AROW + (wm * WM) * AROW;
        const u8* tW = sW + st * BN * WROW + (wn * WN) * WROW;
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            // the group of step kk for ng = 1, 2, 4: three compile-time indices, one select
            const int j1 = 0, j2 = (kk * 2) / KK, j4 = (kk * NGMAX) / KK;
            u32 af[MI][4], bfr[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                const u8* p = tA + (mi * 16 + g) * AROW + (kk * 16 + 2 * t) * 2;
                af[mi][0] = *reinterpret_cast<const u32*>(p);
                af[mi][1] = *reinterpret_cast<const u32*>(p + 8 * AROW);
                af[mi][2] = *reinterpret_cast<const u32*>(p + 16);
                af[mi][3] = *reinterpret_cast<const u32*>(p + 8 * AROW + 16);
            }
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

#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm * WM + mi * 16 + g + h * 8;
            const int s = sSlot[r];
            if (!qg_live(s, num_slots)) continue;
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                const int n = n0 + wn * WN + ni * 8 + 2 * t;
                qg_store_pair(c, s, n, N, acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1], e, bias,
                              topk_weights, mul_routed_weight);
            }
        }
    }
}


// ============================================================================ wna16 v3 (decode)
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
wna16_gemv_v3(const elem_t* __restrict__ a, const u8* __restrict__ w, elem_t* __restrict__ c,
              const float* __restrict__ w_scale, const u8* __restrict__ w_zp,
              const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
              const int* __restrict__ num_tokens_post_padded,
              const float* __restrict__ topk_weights, const float* __restrict__ bias,
              int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,
              int mul_routed_weight, int group_size, int num_groups, int default_zp, int code_xor) {
    constexpr int BM = 8 * MT;
    constexpr int NT = WARPS * 32;
#if ELEM_BF16
    constexpr u32 MAGIC = 0x43004300u;            // bf16 128.0 twice: mantissa ulp 1
#else
    constexpr u32 MAGIC = 0x64006400u;            // fp16 1024.0 twice: mantissa ulp 1
#endif
    extern __shared__ __align__(16) u8 smem[];
    float* sRed = reinterpret_cast<float*>(smem);               // [WARPS][BM][16]
    int* sArow = reinterpret_cast<int*>(sRed + WARPS * BM * 16);  // [BM] a row, -1 padding
    int* sSlot = sArow + BM;                                    // [BM] slot s

    const int m0 = blockIdx.x * BM;
    if (m0 >= num_tokens_post_padded[0] || m0 >= num_positions) return;
    const int n0 = blockIdx.y * 16;
    const int e = expert_ids[m0 / block_size];                  // BM divides block_size
    const int tid = threadIdx.x;
    int live = 0;
    for (int r = tid; r < BM; r += NT) {
        const int p = m0 + r;
        const int s = p < num_positions ? sorted_token_ids[p] : num_slots;
        sSlot[r] = s;
        sArow[r] = qg_live(s, num_slots) ? s / top_k : -1;
        live |= qg_live(s, num_slots);
    }
    if (__syncthreads_or(live) == 0) return;                  // padding-only tile
    if (e < 0) {                                                // expert on another rank
        for (int i = tid; i < BM * 16; i += NT) {
            const int r = i / 16, n = n0 + i % 16;
            if (qg_live(sSlot[r], num_slots) && n < N)
                qg_store(c + (long long)sSlot[r] * N + n, 0.f);
        }
        return;
    }
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

    float acc[MT][4];
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;

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
                zo[u][0] = MAGIC | (z0 * 0x00010001u);          // (128 + zp) twice: exact
                zo[u][1] = MAGIC | (z1 * 0x00010001u);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int cs = c0 + u * WARPS;
            if (cs < KS) {                                      // uniform over the warp
                float part[MT][4];
#pragma unroll
                for (int jt = 0; jt < MT; ++jt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) part[jt][i] = 0.f;
                // word j of the 16 bytes: codes k = 128 cs + 32 t + 8 j + (0..7)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    // dequantize: q[h][i] = pair (k = 8j + i, 8j + i + 4) of row h, as q - zp
                    u32 q[2][4];
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int i = 0; i < 4; ++i)
                            q[h][i] = qg_sub2(((wq[u][h][j] >> (4 * i)) & 0x000F000Fu) | MAGIC,
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
        if (!qg_live(s, num_slots) || n >= N) continue;
        float v = 0.f;
        for (int wi = 0; wi < WARPS; ++wi) v += sRed[(wi * BM + r) * 16 + nn];
        qg_store(c + (long long)s * N + n,
                 qg_epilogue(v, e, n, s, N, bias, topk_weights, mul_routed_weight));
    }
}
