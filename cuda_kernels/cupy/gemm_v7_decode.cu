// gemm_v7_decode.cu: rung 7 of the grouped GEMM ladder: decode, the weights streamed once at
// HBM speed (fp16 / bf16, mma.sync, any sm_80+ GPU).
//
// Math: as every rung (docs/stages.md, grouped_gemm):
//     c[s, n] = (sum_k a[s / top_k, k] * w[e, n, k] + bias[e, n]) * topk_weights.flat[s]
// for each live position p (slot s = sorted_token_ids[p] < P, expert e = expert_ids[p / B]),
// fp32 accumulation, epilogue in fp32, one rounding to GG_T; e == -1 writes zeros.
// Shapes: a [M_a, Kdim], w [E_local, N, Kdim], c [P, N], P = M_a * top_k.
// Requirements (checked by the launcher): Kdim % 8 == 0, a and w 16-byte aligned (16-byte
// cp.async chunks, as v4). Any block_size B works: the CTA gathers its expert's live slots.
//
// Why a rung of its own: at decode (T <= 64 tokens) an expert block holds 1 to ~16 live rows, so
// the GEMM is a stream of the touched experts' weights and its floor is their bytes / HBM
// bandwidth. v4's tiles spend 16 mma rows per block on a handful of tokens and read the weights
// once per alignment block; here every weight byte crosses HBM once and the tensor cores idle.
//
// Launch geometry:
//     grid  = (cdiv(L, B), cdiv(N, BLOCK_N), S): one CTA per (alignment block, BLOCK_N weight
//             rows, K split); S = gridDim.z splits of SPLIT_STEPS k-tiles of BLOCK_K each
//             (the launcher picks S: grouped_gemm.v7_split_k). Only the first block of each
//             expert's run works ("leader"); the others, and blocks past
//             num_tokens_post_padded, leave after one round trip of loads.
//     block = WARPS_N * WARPS_K warps; warp (wn, wk) owns weight rows wn * BLOCK_N / WARPS_N ..
//             of the tile and the k16 steps wk, wk + WARPS_K, ... of every ring stage
//     dynamic shared memory = max(STAGES * (BLOCK_N + COLS) * (BLOCK_K + 8) * 2,
//                                 WARPS_K * COLS * (BLOCK_N + 4) * 4) bytes
//     static shared memory  = 8 * COLS + 16 bytes (the pass's slots and a rows)
//     registers: __launch_bounds__(threads, MINB), MINB = the CTAs per SM that shared memory
//             allows (1 or 2: grouped_gemm.v7_ctas_per_sm)
//
// What changes against v4:
//  - A and B swapped: the weight rows are the mma's M (16 per m16n8k16, MT per warp), the few
//    tokens its N (8 per mma), so no tensor-core work goes to padding rows: a pass with ncols
//    live tokens runs cdiv(ncols, 8) n8 tiles of COLS / 8 (the others are skipped, uniformly).
//  - One weight tile for all of an expert's rows: the leader CTA walks the expert's run of
//    blocks and gathers its live slots (warp 0: ballot + popc compaction, position order) into
//    up to COLS token columns; a run with more live slots takes several passes (each streams
//    the tile again: right for decode, slow for prefill, where v4 / v5 are the rungs).
//  - The stream: a ring of STAGES stages of BLOCK_N x BLOCK_K weights plus COLS x BLOCK_K
//    activations (gathered rows of a, L2 hits), filled by 16-byte cp.async.cg (coalesced:
//    consecutive threads take consecutive chunks of a row), STAGES - 1 stages in flight:
//    (STAGES - 1) * BLOCK_N * BLOCK_K * 2 bytes of weights per CTA, times the CTAs an SM holds
//    (40-64 KB per SM cover the HBM latency at 3.35 TB/s). Activation rows past the live
//    tokens are zero-filled (no global read) up to the ldmatrix pair, beyond that not copied.
//  - Split K for small grids (few experts x few weight-row tiles): each split stores its fp32
//    partials to ws[z][s][n] (row stride NP = N rounded up to 8); the last CTA of the tile to
//    arrive (an atomicAdd on counters[b][n tile], which that CTA resets to 0 for the next launch
//    or graph replay) adds the S partials in split order (the result does not depend on which
//    CTA is last: bit-for-bit deterministic) and runs the epilogue. No host memset, no host
//    synchronisation: the counters are zeroed once when the launcher makes them.
//
// How a CTA works:
//  1. One round trip of independent loads: num_tokens_post_padded, expert_ids[b], expert_ids[b
//     - 1], and (warp 0) the next 32 blocks' experts and the block's first 32 slots. Past the
//     live blocks, a non-leader: leave. e == -1: split 0 writes the block's zeros, leave.
//  2. Warp 0 finds the run's end (ballot over expert_ids) and compacts the first pass's live
//     slots from the preloaded ids; one barrier publishes them.
//  3. Main loop over this split's k-tiles: v4's ring (wait_group STAGES - 2, barrier, refill,
//     compute); per 16-wide k step a warp loads A (16 weight rows) with ldmatrix.x4 per m tile
//     and B (16 tokens) with ldmatrix.x4 per live token pair, then mma.sync m16n8k16.
//  4. Epilogue: the accumulators (weight row, token) go to an fp32 tile in shared memory (the
//     WARPS_K partial sums meet there, added in wk order), then per live token and 8 weight
//     rows: S == 1: bias, router weight, one rounding, a 16-byte store to c[s, n..n+7];
//     S > 1: 32 bytes of partials to ws, then the counter protocol above.
//
// Versions of the ladder:
//     v1  gemm_v1_naive.cu     one thread per output element
//     v2  gemm_v2_smem.cu      shared-memory tiles of a and w, one output per thread
//     v3  gemm_v3_regblock.cu  register blocking (TM x TN per thread), 16-byte loads
//     v4  gemm_v4_mma.cu       tensor cores: mma.sync m16n8k16, ldmatrix, cp.async pipeline
//     v5  gemm_v5_wgmma.cu     (stretch, opt-in) Hopper wgmma from shared-memory descriptors
//     v7  gemm_v7_decode.cu    decode: weights as the mma's M, expert runs in one CTA, deep
//                              cp.async ring, split K with a self-resetting counter  <- this file
// Run:  python -m cuda_kernels.cupy.grouped_gemm --versions v4,v7 --shapes mixtral,qwen3,deepseek \
//           --tokens 1,16,64 [--sweep]
// Check the machine code (no spills; HMMA, LDSM, LDGSTS must appear):
//     nvcc -arch=sm_90 -cubin -Xptxas -v -DGG_T=__nv_bfloat16 -I. gemm_v7_decode.cu -o v7.cubin
#include "gemm_common.cuh"

#ifndef BLOCK_N
#define BLOCK_N 64          // weight rows per CTA: the mma's M side
#endif
#ifndef BLOCK_K
#define BLOCK_K 128         // reduction elements per ring stage
#endif
#ifndef COLS
#define COLS 16             // token columns per pass: the mma's N side (a multiple of 16)
#endif
#ifndef WARPS_N
#define WARPS_N 4           // warps along the weight rows
#endif
#ifndef WARPS_K
#define WARPS_K 1           // warps along k inside a stage (their sums meet in the epilogue)
#endif
#ifndef STAGES
#define STAGES 5
#endif
#ifndef MINB
#define MINB 2              // CTAs per SM for the register budget (the launcher: 1 or 2)
#endif

#define V7_THREADS (WARPS_N * WARPS_K * 32)
#define V7_WROWS (BLOCK_N / WARPS_N)            // weight rows of a warp
#define V7_MT (V7_WROWS / 16)                   // m16 tiles of a warp
#define V7_NT (COLS / 8)                        // n8 token tiles of a pass
#define V7_SK (BLOCK_K + 8)                     // shared row stride (elements): the 8 row
                                                // addresses of an ldmatrix hit 8 bank groups
#define V7_KC (BLOCK_K / 8)                     // 16-byte chunks per row and stage
#define V7_RPI (V7_THREADS / V7_KC)             // rows copied per round of the CTA's threads
#define V7_W_IT (BLOCK_N / V7_RPI)              // weight chunks per thread and stage
#define V7_A_IT ((COLS + V7_RPI - 1) / V7_RPI)  // activation chunks per thread and stage
#define V7_STAGE_BYTES ((BLOCK_N + COLS) * V7_SK * 2)
#define V7_KSW (BLOCK_K / 16 / WARPS_K)         // k16 steps of a warp per stage
#define V7_RS (BLOCK_N + 4)                     // row stride (floats) of the fp32 output tile:
                                                // fragment stores hit 32 different banks
#define V7_NCH (BLOCK_N / 8)                    // 8-column chunks of a tile row

static_assert(sizeof(GG_T) == 2, "v7: the tensor-core rung takes __half or __nv_bfloat16");
static_assert(V7_WROWS % 16 == 0, "v7: each warp owns whole m16 tiles of weight rows");
static_assert(COLS % 16 == 0 && COLS <= 64, "v7: COLS is 16, 32 or 64 (ldmatrix.x4 pairs)");
static_assert(BLOCK_K % (16 * WARPS_K) == 0, "v7: every warp takes whole k16 steps");
static_assert(V7_THREADS % V7_KC == 0, "v7: each thread copies one fixed k-chunk column");
static_assert(BLOCK_N % V7_RPI == 0, "v7: whole copy rounds of weight rows");
static_assert(STAGES >= 2, "v7: the ring needs at least two stages");

// ---------------------------------------------------------------------------- PTX wrappers
// (as v4's; tests/test_cupy_gemm.py runs this file on the CPU under an emulator that defines
// GG_HOST_EMULATION and supplies these instructions, the cp.async of gemm_common.cuh and the
// warp vote, atomics and fences itself)
#ifndef GG_HOST_EMULATION
// Four 8x8 b16 matrices; lanes 8j..8j+7 give the row addresses of matrix j, and lane t
// receives (row t/4, columns 2(t%4), 2(t%4)+1) of each matrix in r[j].
__device__ __forceinline__ void gg_ldsm_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// d (16x8 fp32) += a (16x16, row-major) * b (16x8, "col": k contiguous per n column).
__device__ __forceinline__ void gg_mma(float* d, const unsigned* a, const unsigned* b, __half*) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void gg_mma(float* d, const unsigned* a, const unsigned* b,
                                       __nv_bfloat16*) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif  // GG_HOST_EMULATION

// Two outputs rounded to GG_T, as the bits of one 4-byte word.
__device__ __forceinline__ unsigned v7_bits2(float x, float y, __half*) {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ unsigned v7_bits2(float x, float y, __nv_bfloat16*) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<unsigned*>(&h);
}

// c[s, n..n+7] (n a multiple of 8; columns past N are not stored) from the fp32 sums v: the
// epilogue of docs/stages.md, one rounding, one 16-byte store when the rows of c are 16-byte
// aligned (N % 8 == 0), element stores otherwise.
__device__ __forceinline__ void v7_store8(GG_T* __restrict__ c, const float* v, int e, int s,
                                          int n, int N, const void* __restrict__ bias,
                                          int bias_kind, const float* __restrict__ topk_weights,
                                          int mul_routed_weight) {
    float x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
        x[j] = n + j < N ? gg_epilogue(v[j], e, n + j, s, N, bias, bias_kind, topk_weights,
                                       mul_routed_weight)
                         : 0.0f;
    GG_T* dst = c + (long long)s * N + n;
    if ((N & 7) == 0) {
        *reinterpret_cast<uint4*>(dst) =
            make_uint4(v7_bits2(x[0], x[1], (GG_T*)nullptr), v7_bits2(x[2], x[3], (GG_T*)nullptr),
                       v7_bits2(x[4], x[5], (GG_T*)nullptr), v7_bits2(x[6], x[7], (GG_T*)nullptr));
    } else {
        for (int j = 0; j < 8 && n + j < N; ++j) dst[j] = gg_from_f32<GG_T>(x[j]);
    }
}

// Warp 0, all lanes: the next live slots of the run [cursor, run_end) (at most COLS, in
// position order) into s_slot / s_arow (their rows of a); returns how many, and in cursor the
// position the next pass starts at (the first live slot not taken, else run_end). When
// have_first, first_s is the slot at position cursor + lane (loaded with the CTA's header).
__device__ __forceinline__ int v7_compact(int* s_slot, int* s_arow,
                                          const int* __restrict__ sorted_token_ids, int& cursor,
                                          int run_end, int first_s, bool have_first,
                                          int num_slots, int top_k, int lane) {
    int n = 0, p = cursor;
    while (n < COLS && p < run_end) {                     // uniform over the warp
        int s = num_slots;
        if (lane < run_end - p) s = have_first ? first_s : sorted_token_ids[p + lane];
        have_first = false;
        const bool live = gg_live(s, num_slots);
        const unsigned m = __ballot_sync(0xffffffffu, live);
        const int rank = __popc(m & ((1u << lane) - 1u));
        const int have = __popc(m);
        const int take = min(have, COLS - n);
        if (live && rank < take) {
            s_slot[n + rank] = s;
            s_arow[n + rank] = s / top_k;
        }
        n += take;
        if (take < have) {                                // full: the next pass starts at the
            unsigned rest = m;                            // first live slot not taken
            for (int i = 0; i < take; ++i) rest &= rest - 1u;
            cursor = p + __ffs(rest) - 1;
            return n;
        }
        p += 32;
    }
    cursor = min(p, run_end);
    return n;
}

// ---------------------------------------------------------------------------- the kernel
// Arguments after the common ones:
//   ws               [S, P, NP] fp32   split-K partials (NP = N rounded up to 8); unused if S == 1
//   counters         [cdiv(L, B) * cdiv(N, BLOCK_N)] int32, zero before the launch and after it
//   steps_per_split  k-tiles (of BLOCK_K) per split: split z takes [z, z + 1) * steps_per_split
// (MINB in the launch bounds: the CTAs per SM that shared memory allows, 1 or 2; without it
// NVRTC 13.5's ptxas aimed at more CTAs than that and spilled: 80 registers and 12 bytes of
// spills for BLOCK_N 128 / BLOCK_K 64 / COLS 16, 152 registers and none with MINB = 2)
extern "C" __global__ void __launch_bounds__(V7_THREADS, MINB)
grouped_gemm_v7(GG_KERNEL_ARGS, float* __restrict__ ws, int* __restrict__ counters,
                int steps_per_split) {
    GG_DYNAMIC_SMEM(gg_smem);                 // the cp.async ring, then the fp32 output tile
    __shared__ int s_slot[COLS];              // slot of each token column of the pass
    __shared__ int s_arow[COLS];              // its row of a
    __shared__ int s_info[4];                 // run end, columns, next cursor, last split
    const unsigned sm_base = gg_smem_addr(gg_smem);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int b = blockIdx.x, n0 = blockIdx.y * BLOCK_N, z = blockIdx.z;
    const int splits = gridDim.z;
    const int p0 = b * block_size;            // < L: the grid has cdiv(L, B) blocks
    const int num_blocks = (num_positions - 1) / block_size + 1;

    // 1. the header: independent loads, one round trip (warp 0 also fetches what steps 2 and
    //    the first compaction need, before the CTA knows whether it will use them)
    const int ntpp = __ldg(num_tokens_post_padded);
    const int e = expert_ids[b];
    const int e_prev = b > 0 ? expert_ids[b - 1] : -1;
    int pre_e = -1, pre_s = num_slots;
    if (warp == 0) {
        if (lane + 1 < num_blocks - b) pre_e = expert_ids[b + 1 + lane];
        if (lane < num_positions - p0) pre_s = sorted_token_ids[p0 + lane];
    }
    if (p0 >= ntpp) return;                   // past the live blocks (the whole CTA leaves)
    if (e < 0) {                              // expert on another rank: zeros, by split 0
        if (z != 0) return;
        const int rows = min(block_size, num_positions - p0);
        for (int idx = tid; idx < rows * V7_NCH; idx += V7_THREADS) {
            const int s = sorted_token_ids[p0 + idx / V7_NCH];
            const int n = n0 + (idx % V7_NCH) * 8;
            if (!gg_live(s, num_slots) || n >= N) continue;
            GG_T* dst = c + (long long)s * N + n;
            if ((N & 7) == 0) {
                *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
            } else {
                for (int j = 0; j < 8 && n + j < N; ++j) dst[j] = gg_from_f32<GG_T>(0.0f);
            }
        }
        return;
    }
    if (b > 0 && e_prev == e) return;         // the run's leader (an earlier block) does it

    // 2. warp 0: the run's end (first block of another expert, or past the live blocks), then
    //    the first pass's columns
    if (warp == 0) {
        const int live_blocks = min(num_blocks, (ntpp - 1) / block_size + 1);
        int first = b + 1, pe = pre_e, end_block;
        for (;;) {                            // uniform over the warp
            const bool same = lane < live_blocks - first && pe == e;
            const unsigned diff = __ballot_sync(0xffffffffu, !same);
            if (diff != 0u) {
                end_block = first + __ffs(diff) - 1;
                break;
            }
            first += 32;
            pe = lane < num_blocks - first ? expert_ids[first + lane] : -1;
        }
        const int run_end = (int)min((long long)num_positions, (long long)end_block * block_size);
        int cursor = p0;
        const int n = v7_compact(s_slot, s_arow, sorted_token_ids, cursor, run_end, pre_s, true,
                                 num_slots, top_k, lane);
        if (lane == 0) {
            s_info[0] = run_end;
            s_info[1] = n;
            s_info[2] = cursor;
        }
    }
    __syncthreads();
    const int run_end = s_info[0];
    int ncols = s_info[1];
    int cursor = s_info[2];

    // this split's k-tiles
    const int ksteps = (Kdim + BLOCK_K - 1) / BLOCK_K;
    const int kt0 = z * steps_per_split;
    const int nk = max(0, min(ksteps, kt0 + steps_per_split) - kt0);

    // Copy assignment: chunk idx = tid + i * THREADS -> (row idx / KC, k-chunk idx % KC); as
    // THREADS % KC == 0 a thread's k-chunk column kc is fixed and its rows are r0 + i * RPI.
    const int kc = tid % V7_KC, r0 = tid / V7_KC;
    const GG_T* w_src = w + (long long)e * N * Kdim + kc * 8;
    bool w_ok[V7_W_IT];
#pragma unroll
    for (int i = 0; i < V7_W_IT; ++i) w_ok[i] = n0 + r0 + i * V7_RPI < N;

    const int wn = warp % WARPS_N, wk = warp / WARPS_N;
    const int g = lane >> 2, q = lane & 3;
    // ldmatrix row addresses of this lane, relative to a ring slot (bytes), as v4's with the
    // roles swapped: A = weight rows (lanes 0-15 rows 0-15 at k 0, 16-31 at k 8), B = token
    // rows (lane l -> token (l/16)*8 + l%8, k ((l/8)%2)*8).
    const unsigned a_lane = ((wn * V7_WROWS + (lane & 15)) * V7_SK + ((lane >> 4) << 3)) * 2;
    const unsigned b_lane = BLOCK_N * V7_SK * 2 +
        ((((lane >> 4) << 3) + (lane & 7)) * V7_SK + (((lane >> 3) & 1) << 3)) * 2;
    float* red = reinterpret_cast<float*>(gg_smem);     // [WARPS_K][COLS][RS], after the ring

    while (ncols > 0) {                       // a pass: up to COLS live slots of the run
        const int nt_live = (ncols + 7) >> 3;              // n8 tiles with a live token
        const int np_live = (ncols + 15) >> 4;             // ldmatrix.x4 token pairs
        const GG_T* a_src[V7_A_IT];
        bool a_ok[V7_A_IT], a_copy[V7_A_IT];
#pragma unroll
        for (int i = 0; i < V7_A_IT; ++i) {
            const int col = r0 + i * V7_RPI;
            a_copy[i] = col < np_live * 16;                // zero-filled up to the pair
            a_ok[i] = col < ncols;
            a_src[i] = a + (a_ok[i] ? (long long)s_arow[col] * Kdim : 0LL) + kc * 8;
        }
        // k-tile t (absolute) into ring slot st: one cp.async per 16-byte chunk, zero-filled
        // (src-size 0, no global read) for rows past N, tokens past ncols, and the Kdim tail
        auto load_tile = [&](int t, int st) {
            const int k = t * BLOCK_K;
            const bool k_ok = k + kc * 8 < Kdim;
            const unsigned sw = sm_base + st * V7_STAGE_BYTES;
            const unsigned sa = sw + BLOCK_N * V7_SK * 2;
#pragma unroll
            for (int i = 0; i < V7_W_IT; ++i) {
                const int r = r0 + i * V7_RPI;
                const bool ok = w_ok[i] && k_ok;
                gg_cp_async16(sw + (r * V7_SK + kc * 8) * 2,
                              ok ? (const void*)(w_src + (long long)(n0 + r) * Kdim + k)
                                 : (const void*)w,
                              ok ? 16 : 0);
            }
#pragma unroll
            for (int i = 0; i < V7_A_IT; ++i) {
                if (!a_copy[i]) continue;
                const int col = r0 + i * V7_RPI;
                const bool ok = a_ok[i] && k_ok;
                gg_cp_async16(sa + (col * V7_SK + kc * 8) * 2,
                              ok ? (const void*)(a_src[i] + k) : (const void*)a, ok ? 16 : 0);
            }
        };

        float acc[V7_MT][V7_NT][4];
#pragma unroll
        for (int mt = 0; mt < V7_MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < V7_NT; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0.0f;

        // 3. the ring: STAGES - 1 tiles in flight; one (possibly empty) group per tile keeps
        //    the group count uniform, so wait_group<STAGES - 2> means "tile t has landed"
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st) {
            if (st < nk) load_tile(kt0 + st, st);
            gg_cp_async_commit();
        }
        int st_read = 0, st_write = STAGES - 1;
        for (int t = 0; t < nk; ++t) {
            gg_cp_async_wait<STAGES - 2>();
            __syncthreads();   // tile t visible to all warps; all warps done with tile t - 1
            if (t + STAGES - 1 < nk) load_tile(kt0 + t + STAGES - 1, st_write);
            gg_cp_async_commit();

            const unsigned sw = sm_base + st_read * V7_STAGE_BYTES;
#pragma unroll
            for (int i = 0; i < V7_KSW; ++i) {
                const int kk = wk + i * WARPS_K;
                unsigned af[V7_MT][4];
#pragma unroll
                for (int mt = 0; mt < V7_MT; ++mt)
                    gg_ldsm_x4(af[mt], sw + a_lane + (mt * 16 * V7_SK + kk * 16) * 2);
#pragma unroll
                for (int np = 0; np < COLS / 16; ++np) {
                    if (np >= np_live) continue;                  // uniform over the CTA
                    unsigned r[4];
                    gg_ldsm_x4(r, sw + b_lane + (np * 16 * V7_SK + kk * 16) * 2);
                    const unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
#pragma unroll
                    for (int mt = 0; mt < V7_MT; ++mt)
                        gg_mma(acc[mt][2 * np], af[mt], b0, (GG_T*)nullptr);
                    if (2 * np + 1 < nt_live) {
#pragma unroll
                        for (int mt = 0; mt < V7_MT; ++mt)
                            gg_mma(acc[mt][2 * np + 1], af[mt], b1, (GG_T*)nullptr);
                    }
                }
            }
            st_read = (st_read + 1 == STAGES) ? 0 : st_read + 1;
            st_write = (st_write + 1 == STAGES) ? 0 : st_write + 1;
        }
        gg_cp_async_wait<0>();
        __syncthreads();       // every warp is done with the ring: it becomes the output tile

        // 4. accumulators -> red[wk][token][weight row]. m16n8 layout: lane holds weight rows
        //    g and g + 8 of the m tile, tokens 2q and 2q + 1 of the n8 tile.
#pragma unroll
        for (int mt = 0; mt < V7_MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < V7_NT; ++nt) {
                if (nt >= nt_live) continue;
                const int row = wn * V7_WROWS + mt * 16 + g, col = nt * 8 + 2 * q;
                float* dst = red + (wk * COLS + col) * V7_RS + row;
                dst[0] = acc[mt][nt][0];
                dst[V7_RS] = acc[mt][nt][1];
                dst[8] = acc[mt][nt][2];
                dst[V7_RS + 8] = acc[mt][nt][3];
            }
        __syncthreads();
        // per live token and 8 weight rows: the WARPS_K partial sums in wk order, then c (one
        // split) or this split's partials in ws
        const int NP = (N + 7) & ~7;
        for (int idx = tid; idx < ncols * V7_NCH; idx += V7_THREADS) {
            const int col = idx / V7_NCH, ch = idx % V7_NCH, n = n0 + ch * 8;
            if (n >= N) continue;
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = 0.0f;
#pragma unroll
            for (int kw = 0; kw < WARPS_K; ++kw) {
                const float4* src =
                    reinterpret_cast<const float4*>(red + (kw * COLS + col) * V7_RS + ch * 8);
                const float4 x = src[0], y = src[1];
                v[0] += x.x; v[1] += x.y; v[2] += x.z; v[3] += x.w;
                v[4] += y.x; v[5] += y.y; v[6] += y.z; v[7] += y.w;
            }
            const int s = s_slot[col];
            if (splits == 1) {
                v7_store8(c, v, e, s, n, N, bias, bias_kind, topk_weights, mul_routed_weight);
            } else {
                float4* dst = reinterpret_cast<float4*>(ws + ((long long)z * num_slots + s) * NP + n);
                __stcg(dst, make_float4(v[0], v[1], v[2], v[3]));
                __stcg(dst + 1, make_float4(v[4], v[5], v[6], v[7]));
            }
        }
        __syncthreads();       // s_slot, s_info and the ring are free for the next pass

        if (cursor >= run_end) break;
        if (warp == 0) {
            int cur = cursor;
            const int n = v7_compact(s_slot, s_arow, sorted_token_ids, cur, run_end, 0, false,
                                     num_slots, top_k, lane);
            if (lane == 0) {
                s_info[1] = n;
                s_info[2] = cur;
            }
        }
        __syncthreads();
        ncols = s_info[1];
        cursor = s_info[2];
    }
    if (splits == 1) return;

    // 5. split K: the last CTA of the tile to arrive adds the partials in split order
    const long long tile = (long long)b * gridDim.y + blockIdx.y;
    __threadfence();           // this thread's partials are visible device-wide ...
    __syncthreads();           // ... for every thread of the CTA, before the count
    if (tid == 0) s_info[3] = atomicAdd(counters + tile, 1) == splits - 1;
    __syncthreads();
    if (!s_info[3]) return;
    __threadfence();           // the other splits' partials, seen through their count
    const int NP = (N + 7) & ~7;
    const int span = run_end - p0;
    for (long long idx = tid; idx < (long long)span * V7_NCH; idx += V7_THREADS) {
        const int p = p0 + (int)(idx / V7_NCH), n = n0 + (int)(idx % V7_NCH) * 8;
        const int s = sorted_token_ids[p];
        if (!gg_live(s, num_slots) || n >= N) continue;
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = 0.0f;
        for (int zz = 0; zz < splits; ++zz) {
            const float4* src =
                reinterpret_cast<const float4*>(ws + ((long long)zz * num_slots + s) * NP + n);
            const float4 x = __ldcg(src), y = __ldcg(src + 1);
            v[0] += x.x; v[1] += x.y; v[2] += x.z; v[3] += x.w;
            v[4] += y.x; v[5] += y.y; v[6] += y.z; v[7] += y.w;
        }
        v7_store8(c, v, e, s, n, N, bias, bias_kind, topk_weights, mul_routed_weight);
    }
    if (tid == 0) counters[tile] = 0;         // ready for the next launch on this stream
}
