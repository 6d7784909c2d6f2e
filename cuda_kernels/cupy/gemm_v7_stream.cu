// gemm_v7_stream.cu: rung 7 of the grouped GEMM ladder: decode as weight streaming.
//
// Math (docs/stages.md, grouped_gemm): for every position p < num_tokens_post_padded with
// slot s = sorted_token_ids[p] < P and expert e = expert_ids[p / B]:
//     c[s, n] = (sum_k a[s / top_k, k] * w[e, n, k] + bias[e, n]) * topk_weights.flat[s]
// in fp32, rounded once to GG_T; e == -1 gives c[s, :] = 0.
//
// The lesson: at decode an expert sees a handful of tokens (m = 1-8), so the grouped GEMM is
// a grouped GEMV. Each weight is read once and used m times: 2m flops per 2 bytes, far below
// the ~300 flops per byte where the tensor cores would matter. The time is the touched
// experts' bytes over the HBM bandwidth, and the only question is how many of those bytes are
// in flight on every SM at once. The tiled rungs answer with shared-memory tiles that are
// mostly padding (a 16- or 64-row tile for one live row) and a grid shaped by the tiles; this
// rung drops tiles, shared memory and tensor cores:
//   - a warp owns ROWS consecutive rows of one expert's w (an "item"), its 32 lanes stride
//     Kdim with 16-byte loads, UNROLL of them in flight per row, read with
//     ld.global.nc.L1::no_allocate (w streams past L1; the activations stay there);
//   - the warp computes those rows' dot products with up to TOKENS live tokens of the
//     alignment block at once (an a row is read from L1 by every warp of the SM), keeping
//     ROWS x TOKENS fp32 sums per lane, and adds its lanes up with a shuffle tree;
//   - the warps of a persistent grid (CTAS_PER_SM CTAs on every SM) walk the items of the
//     whole problem, blocks x cdiv(N, ROWS) of them, consecutive warps on consecutive rows of
//     one expert: every SM streams, however few experts are touched.
// The tokens of a block are found with a ballot over its slots and taken TOKENS at a time;
// each pass is compiled for 1, 2, 4, ... TOKENS live tokens (the next power of two up), so a
// block with one token does the work of one.
//
// Launch geometry:
//     block = (WARPS * 32)             one item per warp at a time
//     grid  = (min(cdiv(cdiv(L, BLOCK_M) * cdiv(N, ROWS), WARPS), CTAS_PER_SM * SMs))
//     shared memory: none
//
// Versions of the ladder (cuda_kernels/cupy/gemm.py picks one by name):
//     v1  gemm_v1_naive.cu     one thread per output element
//     v2  gemm_v2_smem.cu      shared-memory tiles of a and w, one output per thread
//     v3  gemm_v3_regblock.cu  register blocking (TM x TN per thread), 16-byte loads
//     v4  gemm_v4_mma.cu       tensor cores: mma.sync m16n8k16, ldmatrix, cp.async pipeline
//     v5  gemm_v5_wgmma.cu     Hopper wgmma from shared-memory descriptors
//     v6  gemm_v6_tma_ws.cu    TMA, an mbarrier ring, warp specialization, a persistent grid
//     v7  gemm_v7_stream.cu    decode: weight streaming, a warp per group of w rows  <- this file
// Run:  python -m cuda_kernels.cupy.gemm --versions v4,v7   (validates, then times)
#include "gemm_common.cuh"

#if !defined(WARPS) || !defined(ROWS) || !defined(TOKENS) || !defined(UNROLL) || \
    !defined(CTAS_PER_SM)
#error "v7: the launcher #defines WARPS, ROWS, TOKENS, UNROLL, CTAS_PER_SM (gemm_configs.kernel_defines)"
#endif

constexpr int kVec = 16 / sizeof(GG_T);     // elements per 16-byte load
constexpr int kLaneStride = 32 * kVec;      // Kdim elements a warp covers with one load a lane
constexpr unsigned kFull = 0xffffffffu;

// 16 bytes of w: read once per call, so kept out of L1 (the a rows live there). .nc: w is
// read-only for the kernel's lifetime.
__device__ __forceinline__ uint4 gg_load_stream(const GG_T* p) {
#ifdef GG_HOST_EMULATION
    return *reinterpret_cast<const uint4*>(p);
#else
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#endif
}

// acc += the dot product of two 16-byte vectors of GG_T, in fp32
__device__ __forceinline__ void gg_dot16(float& acc, const uint4& wv, const uint4& xv) {
    const GG_T* we = reinterpret_cast<const GG_T*>(&wv);
    const GG_T* xe = reinterpret_cast<const GG_T*>(&xv);
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc = fmaf(gg_to_f32(we[i]), gg_to_f32(xe[i]), acc);
}

// One pass of an item: rows n0 .. n0 + ROWS - 1 of expert e against the NT tokens whose
// slots are slot[0 .. live - 1] (live <= NT; the tokens past `live` repeat token 0's row and
// are not stored). Every lane ends with all ROWS x NT sums; lane r * NT + j stores (r, j).
template <int NT>
__device__ __forceinline__ void gg_stream_pass(
        const GG_T* __restrict__ a, const GG_T* __restrict__ w, GG_T* __restrict__ c,
        const int (&slot)[TOKENS], int live, int e, int n0, int N, int Kdim, int top_k,
        const float* __restrict__ topk_weights, const void* __restrict__ bias, int bias_kind,
        int mul_routed_weight, int lane) {
    const GG_T* a_row[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j)
        a_row[j] = a + (long long)((j < live ? slot[j] : slot[0]) / top_k) * Kdim;
    const GG_T* w_row[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)   // rows past N re-read row N - 1 and are not stored
        w_row[r] = w + ((long long)e * N + min(n0 + r, N - 1)) * Kdim;

    float acc[ROWS][NT];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[r][j] = 0.0f;

    for (int k0 = lane * kVec; k0 < Kdim; k0 += UNROLL * kLaneStride) {
        uint4 wv[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {      // every load of the round issued first
            const int k = k0 + u * kLaneStride;
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                wv[u][r] = k < Kdim ? gg_load_stream(w_row[r] + k) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = k0 + u * kLaneStride;
            if (k >= Kdim) break;               // Kdim % kVec == 0: a chunk is all in or out
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const uint4 xv = __ldg(reinterpret_cast<const uint4*>(a_row[j] + k));
#pragma unroll
                for (int r = 0; r < ROWS; ++r) gg_dot16(acc[r][j], wv[u][r], xv);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                acc[r][j] += __shfl_xor_sync(kFull, acc[r][j], off);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int n = n0 + r;
            if (lane == (r * NT + j) % 32 && j < live && n < N) {
                const int s = slot[j];
                const float out = gg_epilogue(acc[r][j], e, n, s, N, bias, bias_kind,
                                              topk_weights, mul_routed_weight);
                c[(long long)s * N + n] = gg_from_f32<GG_T>(out);
            }
        }
    }
}

// The pass compiled for the fewest tokens (a power of two, at most NT) that covers `live`.
template <int NT>
__device__ __forceinline__ void gg_stream_dispatch(
        const GG_T* __restrict__ a, const GG_T* __restrict__ w, GG_T* __restrict__ c,
        const int (&slot)[TOKENS], int live, int e, int n0, int N, int Kdim, int top_k,
        const float* __restrict__ topk_weights, const void* __restrict__ bias, int bias_kind,
        int mul_routed_weight, int lane) {
    if constexpr (NT > 1) {
        if (live <= NT / 2) {
            gg_stream_dispatch<NT / 2>(a, w, c, slot, live, e, n0, N, Kdim, top_k, topk_weights,
                                       bias, bias_kind, mul_routed_weight, lane);
            return;
        }
    }
    gg_stream_pass<NT>(a, w, c, slot, live, e, n0, N, Kdim, top_k, topk_weights, bias,
                       bias_kind, mul_routed_weight, lane);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, CTAS_PER_SM)
grouped_gemm_v7(GG_KERNEL_ARGS) {
    const int lane = threadIdx.x & 31;
    const int warp = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int num_warps = gridDim.x * WARPS;
    // the live blocks (num_tokens_post_padded is a multiple of block_size; never past L)
    const int live_blocks = (min(__ldg(num_tokens_post_padded), num_positions) + block_size - 1)
                            / block_size;
    const int groups = (N + ROWS - 1) / ROWS;
    const long long items = (long long)live_blocks * groups;
    for (long long item = warp; item < items; item += num_warps) {
        const int b = (int)(item / groups);
        const int n0 = (int)(item % groups) * ROWS;
        const int e = expert_ids[b];
        const int p_end = min((b + 1) * block_size, num_positions);
        for (int p32 = b * block_size; p32 < p_end; p32 += 32) {      // 32 positions at a time
            const int my_slot = p32 + lane < p_end ? sorted_token_ids[p32 + lane] : num_slots;
            unsigned todo = __ballot_sync(kFull, gg_live(my_slot, num_slots));
            while (todo) {                       // warp-uniform: TOKENS live tokens a pass
                int slot[TOKENS];
                int live = 0;
#pragma unroll
                for (int j = 0; j < TOKENS; ++j) {
                    slot[j] = num_slots;
                    if (todo) {
                        slot[j] = __shfl_sync(kFull, my_slot, __ffs(todo) - 1);
                        todo &= todo - 1;
                        ++live;
                    }
                }
                if (e < 0) {                     // an expert on another rank: zeros
#pragma unroll
                    for (int j = 0; j < TOKENS; ++j)
                        for (int r = lane; r < ROWS; r += 32)
                            if (j < live && n0 + r < N)
                                c[(long long)slot[j] * N + n0 + r] = gg_from_f32<GG_T>(0.0f);
                    continue;
                }
                gg_stream_dispatch<TOKENS>(a, w, c, slot, live, e, n0, N, Kdim, top_k,
                                           topk_weights, bias, bias_kind, mul_routed_weight, lane);
            }
        }
    }
}
