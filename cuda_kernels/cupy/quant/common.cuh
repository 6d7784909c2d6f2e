// common.cuh: what the quantized rungs share (every w8a8 and weight-only rung; the prepacked
// int4 rungs v4-v6 through wna16_common.cuh): the element type, the kernel arguments, small
// conversions, the inline PTX of the rungs up to v3 (cp.async, mma.sync, streaming loads), the
// m tile's staging and the epilogue (bias, then router weight, in fp32; one rounding to
// elem_t), and the pieces the tiled rungs repeat: a naive rung's output element, the gathered
// A tile's copy, an A fragment's loads, the warps' partial sums of the decode rungs.
//
// ELEM_BF16 (#define, 1 or 0) picks elem_t = __nv_bfloat16 or __half (the output type; the
// activations' type for the weight-only rungs).
#pragma once
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

// ---------------------------------------------------------------------------- kernel arguments
// Every rung of a ladder takes the same arguments in the same order (the launchers pass one
// tuple): its operands, the routing (QG_ROUTING_ARGS), then its format's sizes.
//   sorted_token_ids [L] int32, slot of each position (P = padding); expert_ids [L / B] int32,
//   local expert of each alignment block (-1: another rank's); num_tokens_post_padded [1]
//   int32 (read on the device); topk_weights [P] fp32; bias [E, N] fp32 or null.
#define QG_ROUTING_ARGS                                                                       \
    const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,             \
    const int* __restrict__ num_tokens_post_padded, const float* __restrict__ topk_weights,   \
    const float* __restrict__ bias, int N, int Kdim, int num_slots, int top_k, int block_size, \
    int num_positions, int mul_routed_weight
// w8a8 (fp8 e4m3 / int8 codes): a [M_a, Kdim], w [E, N, Kdim], scales of kind 0 / 1 / 2
#define QG_W8A8_ARGS                                                                          \
    const u8* __restrict__ a, const u8* __restrict__ w, elem_t* __restrict__ c,               \
    const float* __restrict__ a_scale, const float* __restrict__ w_scale, QG_ROUTING_ARGS,    \
    int a_scale_kind, int w_scale_kind
// weight-only, unpacked codes (v1-v3): a [M_a, Kdim] elem_t, w [E, N, Kdim * NBITS / 8],
// w_scale / w_zp [E, N, G]
#define QG_WNA16_ARGS                                                                         \
    const elem_t* __restrict__ a, const u8* __restrict__ w, elem_t* __restrict__ c,           \
    const float* __restrict__ w_scale, const u8* __restrict__ w_zp, QG_ROUTING_ARGS,          \
    int group_size, int num_groups, int default_zp, int code_xor

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

// The int4 rungs' magic number: the 16-bit float 128 (bf16) or 1024 (fp16) in both halves of
// a word, whose mantissa's ulp is 1. OR-ing a code q (< 16) into a half's low bits makes the
// float 128 + q (1024 + q) exactly: two codes dequantized by one lop3, no int -> float convert.
#if ELEM_BF16
#define QG_MAGIC 0x43004300u
#else
#define QG_MAGIC 0x64006400u
#endif
// the pair (magic + q, magic + q): a zero point q (< 256) in both halves, exact
__device__ __forceinline__ u32 qg_magic_pair(u32 q) { return QG_MAGIC | (q * 0x00010001u); }

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
// The only inline PTX of the rungs that include this header. The CPU emulation of the tests
// (tests/emulator) #defines QG_EMULATED_PTX and supplies these helpers (same names
// and semantics), so that everything else executes as written before a GPU sees it.
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

// ---------------------------------------------------------------------------- the m tile
// The output element of a naive rung's thread (grid (Lg, cdiv(N, 128)), block 128): position
// p = blockIdx.x, column n = 128 blockIdx.y + threadIdx.x, its slot s and expert e. False when
// the thread has nothing to compute: p past the live positions, a padding slot, n past N, or
// an expert of another rank (whose zero it stores first).
__device__ __forceinline__ bool qg_naive_element(elem_t* __restrict__ c,
                                                 const int* __restrict__ sorted_token_ids,
                                                 const int* __restrict__ expert_ids,
                                                 const int* __restrict__ num_tokens_post_padded,
                                                 int N, int num_slots, int block_size,
                                                 int num_positions, int& s, int& n, int& e) {
    const int p = blockIdx.x;
    if (p >= num_tokens_post_padded[0] || p >= num_positions) return false;
    s = sorted_token_ids[p];
    if (!qg_live(s, num_slots)) return false;
    n = blockIdx.y * 128 + threadIdx.x;
    if (n >= N) return false;
    e = expert_ids[p / block_size];
    if (e < 0) {
        qg_store(c + (long long)s * N + n, 0.f);
        return false;
    }
    return true;
}

// An expert of another rank (expert id -1): zeros in columns n0 .. n0 + BN (those below N) of
// the rows of c that the tile's live slots own.
template <int BM, int BN, int NT>
__device__ __forceinline__ void qg_store_zeros(elem_t* c, const int* sSlot, int n0,
                                               int N, int num_slots, int tid) {
    for (int i = tid; i < BM * BN; i += NT) {
        const int r = i / BN, n = n0 + i % BN;
        if (qg_live(sSlot[r], num_slots) && n < N)
            qg_store(c + (long long)sSlot[r] * N + n, 0.f);
    }
}

// The m tile of a tiled rung's CTA (NT threads; every thread calls it: a barrier): BM
// positions from m0 of expert e (one expert: BM divides block_size), staged in sSlot[r] = the
// slot of position m0 + r (num_slots, i.e. padding, past the positions) and sArow[r] = its row
// of a (slot / top_k) or -1. False when the CTA has nothing to compute: the tile holds padding
// only (a tile smaller than the alignment block may), or its expert is another rank's (e < 0:
// the BM x BN tile at n0 then gets its zeros).
template <int BM, int BN, int NT>
__device__ __forceinline__ bool qg_stage_m_tile(elem_t* c, int* sSlot, int* sArow,
                                                const int* sorted_token_ids, int m0, int n0,
                                                int e, int N, int num_slots, int top_k,
                                                int num_positions, int tid) {
    int live = 0;
    for (int r = tid; r < BM; r += NT) {
        const int p = m0 + r;
        const int s = p < num_positions ? sorted_token_ids[p] : num_slots;
        sSlot[r] = s;
        sArow[r] = qg_live(s, num_slots) ? s / top_k : -1;
        live |= qg_live(s, num_slots);
    }
    if (__syncthreads_or(live) == 0) return false;
    if (e < 0) {
        qg_store_zeros<BM, BN, NT>(c, sSlot, n0, N, num_slots, tid);
        return false;
    }
    return true;
}

// ---------------------------------------------------------------------------- tiled rungs (v2)
// The A tile of one K tile: the BM gathered rows sArow (-1: zero-filled) of a [M_a, Kdim]
// from element k0, CH 16-byte chunks each (the Kdim tail: whole chunks in or out), into dst
// with rows of ROW bytes, one cp.async per chunk.
template <int BM, int CH, int ROW, int NT, typename T>
__device__ __forceinline__ void qg_copy_a_tile(u8* dst, const T* a, const int* sArow,
                                               int k0, int Kdim, int tid) {
    constexpr int CE = 16 / sizeof(T);            // elements of a chunk
    for (int i = tid; i < BM * CH; i += NT) {
        const int r = i / CH, k = k0 + (i % CH) * CE;
        const int arow = sArow[r];
        const bool ok = arow >= 0 && k < Kdim;
        qg_cp16(dst + ((i % CH) * 16 + r * ROW), ok ? a + (long long)arow * Kdim + k : a, ok);
    }
}

// The cp.async ring of the tiled rungs, STAGES K tiles deep; load(stage, kt) issues the copies
// of K tile kt into a stage. One commit group per tile, even an empty one, keeps "at most
// STAGES - 2 groups pending" meaning "tile kt has landed". qg_ring_fill: the first STAGES - 1
// tiles; qg_ring_step: wait for tile kt (this thread's copies, then everyone's: a barrier, after
// which the stage of tile kt - 1 is free) and refill that stage with tile kt + STAGES - 1.
// Returns the stage of tile kt.
template <int STAGES, typename Load>
__device__ __forceinline__ void qg_ring_fill(int KT, Load&& load) {
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < KT) load(st, st);
        qg_commit();
    }
}
template <int STAGES, typename Load>
__device__ __forceinline__ int qg_ring_step(int kt, int KT, Load&& load) {
    qg_wait<STAGES - 2>();
    __syncthreads();
    const int nk = kt + STAGES - 1;
    if (nk < KT) load(nk % STAGES, nk);
    qg_commit();
    return kt % STAGES;
}

// The A fragment of one k step of an m16 tile whose row g, k byte 4t is at p (rows of ROW
// bytes): a[0] row g, a[1] row g + 8, a[2] / a[3] the same 16 bytes further. One 32-bit shared
// load each; the same bytes for m16n8k32 (8-bit codes) and m16n8k16 (16-bit elements).
template <int ROW>
__device__ __forceinline__ void qg_load_frag_a(u32 (&af)[4], const u8* p) {
    af[0] = *reinterpret_cast<const u32*>(p);
    af[1] = *reinterpret_cast<const u32*>(p + 8 * ROW);
    af[2] = *reinterpret_cast<const u32*>(p + 16);
    af[3] = *reinterpret_cast<const u32*>(p + 8 * ROW + 16);
}

// The epilogue's rows: f(mi, h, r, s) for each row of this thread's accumulators (rows g and
// g + 8 of each of the MI m16 fragments of the warp tile from tile row row0: the m16n8 layout)
// whose slot s is live; r is its tile row.
template <int MI, typename F>
__device__ __forceinline__ void qg_for_live_rows(const int* sSlot, int row0, int g, int num_slots,
                                                 F&& f) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + mi * 16 + g + h * 8;
            const int s = sSlot[r];
            if (qg_live(s, num_slots)) f(mi, h, r, s);
        }
    }
}

// ---------------------------------------------------------------------------- decode rungs (v3)
// The partial sums of the WARPS warps of a decode CTA (16 weight rows n0.. x BM = 8 MT token
// rows; this thread's acc[j]: d[0], d[1] = weight row n0 + g, tokens 8j + 2t, + 1; d[2], d[3]
// = row n0 + g + 8) meet in sRed [WARPS][BM][16] and are added in warp order (deterministic);
// then out(r, n, s, v) for each live tile row r (slot s) and column n < N with its sum v. A
// barrier between: every thread calls it.
template <int MT, int WARPS, typename Out>
__device__ __forceinline__ void qg_sum_warps(const float (&acc)[MT][4], float* sRed,
                                             const int* sSlot, int n0, int N, int num_slots,
                                             int tid, Out&& out) {
    constexpr int BM = 8 * MT, NT = WARPS * 32;
    const int warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
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
        out(r, n, s, v);
    }
}
