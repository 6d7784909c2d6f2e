// gemm_v5_wgmma.cu: rung 5 of the grouped GEMM ladder (stretch): Hopper warpgroup MMA (wgmma).
//
// Math: as every rung (docs/stages.md, grouped_gemm):
//     c[s, n] = (sum_k a[s / top_k, k] * w[e, n, k] + bias[e, n]) * topk_weights.flat[s]
// for each live position p (slot s = sorted_token_ids[p] < P, expert e = expert_ids[p / B]),
// fp16/bf16 products on the tensor cores with fp32 accumulation, epilogue in fp32, rounded
// once to GG_T; e == -1 writes zeros.
// Shapes: a [M_a, Kdim], w [E_local, N, Kdim], c [P, N], P = M_a * top_k.
// Requirements: sm_90a (wgmma exists only there: built with -arch=sm_90a); Kdim % 8 == 0 and
// a, w 16-byte aligned (as v4); BLOCK_M in {64, 128} divides B (so B >= 64);
// BLOCK_N in {64, 128, 256}; BLOCK_K in {16, 32, 64} (one swizzled row: 32, 64, 128 bytes).
// Chosen per bucket by each card's measured version_by_m in gemm_configs.json (the H200's
// from 32 rows per expert up; the H100's at 128, v6 elsewhere in prefill).
//
// Launch geometry:
//     threads = (BLOCK_M / 64) warpgroups x 128; warpgroup g owns rows 64g..64g+63 of the tile
//     grid    = cdiv(L, BLOCK_M) * cdiv(N, BLOCK_N), 1-D, grouped by GROUP_M m-tiles (as v4)
//     dynamic shared memory = 1024 + max(STAGES * (BLOCK_M + BLOCK_N) * BLOCK_K * 2,
//                                        BLOCK_M * (BLOCK_N + 8) * 2) bytes (the 1024: the
//                                        ring starts on a 1024-byte boundary, see below);
//     static 4 * BLOCK_M
//
// What changes against v4:
//  - One wgmma.mma_async.m64nNk16 per warpgroup and 16-wide k step reads A (64 x 16) and B
//    (N x 16) straight from shared memory through 64-bit matrix descriptors (no ldmatrix, no
//    register fragments for the operands): the tensor cores run at Hopper's full rate.
//  - Shared tiles use wgmma's K-major *swizzled* layout, the one the tensor cores read at full
//    speed: row r of a tile is SW = BLOCK_K * 2 bytes (32, 64 or 128: the swizzle width) at
//    r * SW, and its 16-byte chunk c sits at chunk c ^ ((offset >> 7) & (SW/16 - 1)), i.e.
//    address bits [4, 4+log2(SW/16)) are XORed with bits [7, ...): Swizzle<3,4,3> for 128 B.
//    The XOR uses absolute shared addresses, so the ring starts on a 1024-byte boundary
//    (every tile and warpgroup slice is a multiple of 1024 bytes). Descriptor: start address,
//    stride byte offset (next 8-row group) = 8 * SW, layout type 1/2/3 (128/64/32 B swizzle);
//    a 16-wide k step advances the start by 32 bytes inside the swizzled row.
//    cp.async: consecutive threads copy consecutive 16-byte chunks of a row (whole 32-byte
//    sectors from global), and the swizzle spreads each 8-thread phase over all 32 banks.
//  - Pipeline: the wgmma of tile t runs while the warps issue the copies of later tiles:
//    each iteration issues its batch, commits it and waits until at most one batch is
//    pending (wgmma.wait_group 1). A ring slot is refilled only after the batch that read it
//    has completed in every warpgroup (the barrier at the top of the next-but-one
//    iteration), so cp.async runs STAGES - 2 tiles ahead: deep rings (6 to 8 stages of
//    BLOCK_K = 32 or 64) keep 100-150 KB in flight per SM, enough to cover L2/HBM latency at
//    the tensor cores' rate. cp.async writes go through the generic proxy and wgmma reads
//    through the async proxy: fence.proxy.async before the barrier orders them.
//  - Epilogue as v4 (the accumulator layout of each warp is that of mma.m16n8 per n8 block).
//
// Versions of the ladder:
//     v1  gemm_v1_naive.cu     one thread per output element
//     v2  gemm_v2_smem.cu      shared-memory tiles of a and w, one output per thread
//     v3  gemm_v3_regblock.cu  register blocking (TM x TN per thread), 16-byte loads
//     v4  gemm_v4_mma.cu       tensor cores: mma.sync m16n8k16, ldmatrix, cp.async pipeline
//     v5  gemm_v5_wgmma.cu     Hopper wgmma from shared-memory descriptors          <- this file
// Run:  python -m cuda_kernels.cupy.gemm --versions v4,v5
// Check the machine code (HGMMA must appear):
//     nvcc -gencode=arch=compute_90a,code=sm_90a -cubin -Xptxas -v -DGG_T=__nv_bfloat16 \
//          -DGG_AB=bf16 -DBLOCK_M=128 -DBLOCK_N=128 -DBLOCK_K=64 -DSTAGES=4 -DGROUP_M=8 -I. \
//          gemm_v5_wgmma.cu -o v5.cubin && cuobjdump -sass v5.cubin | grep -c HGMMA
#include "gemm_common.cuh"
#include "gemm_wgmma.cuh"

// The tile and its tunables, #defined by the launcher from gemm_configs.json.
#if !defined(BLOCK_M) || !defined(BLOCK_N) || !defined(BLOCK_K) || !defined(STAGES) || \
    !defined(GROUP_M)
#error "v5: the launcher #defines the tile (gemm_configs.kernel_defines)"
#endif

#define V5_THREADS ((BLOCK_M / 64) * 128)
#define KC (BLOCK_K / 8)                      // 16-byte chunks per tile row
#define TILE_A_BYTES (BLOCK_M * BLOCK_K * 2)
#define TILE_B_BYTES (BLOCK_N * BLOCK_K * 2)
#define STAGE_BYTES (TILE_A_BYTES + TILE_B_BYTES)
#define SW_BYTES (BLOCK_K * 2)                // one tile row = the swizzle width (32/64/128)
#define SBO_BYTES (8 * SW_BYTES)              // next 8-row group (one swizzle atom)
#define SMEM_ALIGN 1024                       // the swizzle repeats every 1024 bytes
#define SC (BLOCK_N + 8)                      // shared row stride of the output tile
#define A_CHUNKS (BLOCK_M * KC)
#define B_CHUNKS (BLOCK_N * KC)
#define A_IT (A_CHUNKS / V5_THREADS)
#define B_IT (B_CHUNKS / V5_THREADS)

static_assert(sizeof(GG_T) == 2, "v5: wgmma takes __half or __nv_bfloat16");
static_assert(BLOCK_M == 64 || BLOCK_M == 128, "v5: one or two warpgroups of 64 rows");
static_assert(BLOCK_N == 64 || BLOCK_N == 128 || BLOCK_N == 256, "v5: wgmma n of 64, 128, 256");
static_assert((BLOCK_K == 16 || BLOCK_K == 32 || BLOCK_K == 64) && STAGES >= 3,
              "v5: BLOCK_K of 16, 32 or 64 (one 32/64/128-byte swizzled row), >= 3 stages");
static_assert(TILE_A_BYTES % SMEM_ALIGN == 0 && TILE_B_BYTES % SMEM_ALIGN == 0,
              "v5: every tile starts on a 1024-byte boundary (the swizzle uses address bits)");
static_assert(A_CHUNKS % V5_THREADS == 0 && B_CHUNKS % V5_THREADS == 0,
              "v5: whole copy rounds");

// Byte offset of (row r, 16-byte k chunk c) inside an operand tile that starts on a
// 1024-byte boundary: row-major rows of SW_BYTES, chunk bits XORed with address bits 7..9.
__device__ __forceinline__ unsigned gg_swizzle_offset(int r, int c) {
    const unsigned o = (unsigned)(r * SW_BYTES + c * 16);
    return o ^ (((o >> 7) & (SW_BYTES / 16 - 1)) << 4);
}

extern "C" __global__ void __launch_bounds__(V5_THREADS, 1)
grouped_gemm_v5(GG_KERNEL_ARGS) {
    GG_DYNAMIC_SMEM(gg_smem);                 // the cp.async ring, then the output tile
    __shared__ int s_slot[BLOCK_M];
    // the ring starts at the first 1024-byte boundary (static shared memory comes first, so
    // the dynamic buffer is only 16-byte aligned); the launcher adds 1024 bytes for this
    const unsigned raw_base = gg_smem_addr(gg_smem);
    const unsigned sm_base = (raw_base + (SMEM_ALIGN - 1)) & ~(unsigned)(SMEM_ALIGN - 1);
    GG_T* sm = reinterpret_cast<GG_T*>(gg_smem + (sm_base - raw_base));

    // which tile: the grouped order of v4
    int pid_m, pid_n;
    gg_tile_of<GROUP_M>(blockIdx.x, (num_positions + BLOCK_M - 1) / BLOCK_M,
                        (N + BLOCK_N - 1) / BLOCK_N, pid_m, pid_n);
    const int m0 = pid_m * BLOCK_M;
    const int n0 = pid_n * BLOCK_N;
    if (m0 >= __ldg(num_tokens_post_padded)) return;
    const int e = expert_ids[m0 / block_size];

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int wg = tid >> 7;                  // warpgroup: rows 64 wg .. 64 wg + 63
    const int wq = (tid >> 5) & 3;            // warp inside the warpgroup: 16 of those rows

    gg_load_slots<BLOCK_M, V5_THREADS>(s_slot, sorted_token_ids, m0, num_positions, num_slots, tid);
    __syncthreads();

    const bool vec_out = (N % 8) == 0;
    if (e < 0) {                              // expert not on this rank: zeros
        gg_zero_tile<BLOCK_M, BLOCK_N, V5_THREADS>(c, s_slot, n0, N, num_slots, tid);
        return;
    }

    // Copy assignment: chunk idx = tid + i * THREADS -> row idx / KC, k chunk idx % KC (as
    // v4): a row's chunks come from consecutive threads, whole sectors from global. THREADS
    // is a multiple of KC, so a thread's k chunk kc is the same in every round, and its rows
    // are fixed for the whole main loop: resolve their sources and swizzled places once.
    const int kc = tid % KC;
    const GG_T* a_src[A_IT];
    bool a_ok[A_IT];
    unsigned a_dst[A_IT];
#pragma unroll
    for (int i = 0; i < A_IT; ++i) {
        const int r = (tid + i * V5_THREADS) / KC;
        const int s = s_slot[r];
        a_ok[i] = gg_live(s, num_slots);
        a_src[i] = a + (a_ok[i] ? (long long)(s / top_k) * Kdim : 0LL) + kc * 8;
        a_dst[i] = gg_swizzle_offset(r, kc);
    }
    const GG_T* w_e = w + (long long)e * N * Kdim;
    const GG_T* b_src[B_IT];
    bool b_ok[B_IT];
    unsigned b_dst[B_IT];
#pragma unroll
    for (int i = 0; i < B_IT; ++i) {
        const int r = (tid + i * V5_THREADS) / KC;
        b_ok[i] = n0 + r < N;
        b_src[i] = w_e + (b_ok[i] ? (long long)(n0 + r) * Kdim : 0LL) + kc * 8;
        b_dst[i] = TILE_A_BYTES + gg_swizzle_offset(r, kc);
    }

    auto load_tile = [&](int t, int st) {
        const int k = t * BLOCK_K;
        const bool k_ok = k + kc * 8 < Kdim;  // the Kdim tail: whole chunks in or out
        const unsigned base = sm_base + st * STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < A_IT; ++i) {
            const bool ok = a_ok[i] && k_ok;
            gg_cp_async16(base + a_dst[i], ok ? (const void*)(a_src[i] + k) : (const void*)a,
                          ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < B_IT; ++i) {
            const bool ok = b_ok[i] && k_ok;
            gg_cp_async16(base + b_dst[i], ok ? (const void*)(b_src[i] + k) : (const void*)w,
                          ok ? 16 : 0);
        }
    };

    float acc[BLOCK_N / 2];
#pragma unroll
    for (int j = 0; j < BLOCK_N / 2; ++j) acc[j] = 0.0f;

    // Pipeline (see the header): tile t lives in ring slot t % STAGES and is loaded
    // STAGES - 2 iterations ahead; one wgmma batch stays in flight across iterations.
    const int num_k_tiles = (Kdim + BLOCK_K - 1) / BLOCK_K;
#pragma unroll
    for (int st = 0; st < STAGES - 2; ++st) {
        if (st < num_k_tiles) load_tile(st, st);
        gg_cp_async_commit();
    }
    for (int t = 0; t < num_k_tiles; ++t) {
        gg_cp_async_wait<STAGES - 3>();       // this thread's copies of tile t have landed
        wg_fence_proxy_async();               // ... and are visible to the async proxy
        __syncthreads();                      // everyone's copies; batch t - 2 done everywhere
        if (t + STAGES - 2 < num_k_tiles) load_tile(t + STAGES - 2, (t + STAGES - 2) % STAGES);
        gg_cp_async_commit();

        const unsigned slot = sm_base + (t % STAGES) * STAGE_BYTES;
        const unsigned a_base = slot + wg * 8 * SBO_BYTES;       // this warpgroup's 64 rows
        const unsigned b_base = slot + TILE_A_BYTES;
        gg_wgmma_batch<BLOCK_N, SW_BYTES, BLOCK_K / 16>(acc, a_base, b_base);
        wg_wait<1>();                   // batch t - 1 has completed in this warpgroup
    }
    wg_wait<0>();
    gg_cp_async_wait<0>();
    __syncthreads();                          // the ring is free: reuse it for the output tile

    // Epilogue. Warp wq of warpgroup wg holds rows 64 wg + 16 wq + lane/4 (+8); for each n8
    // block j, acc[4j..4j+3] = (row, 8j + 2(lane%4)), (row, +1), (row + 8, ...), (row + 8, +1).
    // The bias is per column, the router weight per row: each fetched once.
    int rows[2];
    float scale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        rows[h] = wg * 64 + wq * 16 + (lane >> 2) + 8 * h;
        const int s = s_slot[rows[h]];
        scale[h] = (mul_routed_weight && gg_live(s, num_slots)) ? topk_weights[s] : 1.0f;
    }
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j) {
        const int col = j * 8 + (lane & 3) * 2;
        const int n = n0 + col;
        float b0, b1;
        gg_bias_pair(bias, bias_kind, e, n, N, b0, b1);
#pragma unroll
        for (int h = 0; h < 2; ++h)     // (acc + bias) * weight in fp32, docs/stages.md's order
            gg_store2(sm + rows[h] * SC + col, (acc[4 * j + 2 * h] + b0) * scale[h],
                      (acc[4 * j + 2 * h + 1] + b1) * scale[h]);
    }
    __syncthreads();
    gg_store_tile<BLOCK_M, BLOCK_N, SC, V5_THREADS>(c, sm, s_slot, n0, N, num_slots, vec_out, tid);
}
