// gemm_v4_mma.cu: rung 4 of the grouped GEMM ladder: tensor cores (mma.sync), fp16 / bf16.
//
// Math: as every rung (docs/stages.md, grouped_gemm):
//     c[s, n] = (sum_k a[s / top_k, k] * w[e, n, k] + bias[e, n]) * topk_weights.flat[s]
// for each live position p (slot s = sorted_token_ids[p] < P, expert e = expert_ids[p / B]),
// products on the tensor cores with fp32 accumulation, epilogue in fp32, rounded once to
// GG_T (__half or __nv_bfloat16; fp32 inputs use v3). e == -1 writes zeros.
// Shapes: a [M_a, Kdim], w [E_local, N, Kdim], c [P, N], P = M_a * top_k.
// Requirements (checked by the launcher, which falls back to v3/v2 otherwise): Kdim % 8 == 0
// and a, w 16-byte aligned (every 16-byte cp.async chunk of a row is aligned and wholly in
// or out of Kdim); BLOCK_M divides B and WM = BLOCK_M / WARPS_M, WN = BLOCK_N / WARPS_N are
// multiples of 16. N is free (ragged tiles are zero-filled, stores are guarded).
//
// Launch geometry:
//     threads = WARPS_M * WARPS_N * 32; warp (wm, wn) owns a WM x WN piece of the CTA tile
//     grid    = cdiv(L, BLOCK_M) * cdiv(N, BLOCK_N), 1-D; CTA pid -> (pid_m, pid_n) in groups of
//               GROUP_M m-tiles (pid_m fastest inside a group), so the CTAs that run together
//               share the same few w column slabs and a rows in L2.
//     dynamic shared memory = 2 * max(STAGES * (BLOCK_M + BLOCK_N) * (BLOCK_K + 8),
//                                     BLOCK_M * (BLOCK_N + 8)) bytes
//     static shared memory  = 4 * BLOCK_M bytes (the slot of every tile row)
//
// How a CTA works:
//  1. It reads num_tokens_post_padded on the device and leaves if its tile is past it: the
//     host launches the largest grid (L = len(sorted_token_ids)) and never synchronises.
//  2. Its rows' slots go to shared memory; each thread turns the rows it copies into a
//     pointers once (a row = s / top_k: the gather of GEMM1 is fused into the loads).
//  3. Main loop over Kdim in steps of BLOCK_K: a STAGES-deep ring of shared tiles, filled by
//     cp.async (16 bytes per thread per copy, zero-filled for padding rows, ragged N and
//     the Kdim tail), so STAGES - 1 tiles are in flight while the tensor cores work on one.
//     Each shared row is BLOCK_K + 8 elements: the 8 row addresses of an ldmatrix are then
//     16 bytes apart modulo 128, so they hit 8 different bank groups (no conflicts).
//  4. Per 16-wide k step a warp loads its fragments with ldmatrix.x4 (A: 16x16, B: two 8-wide
//     n tiles) and issues MT x NT mma.sync.m16n8k16 (fp32 accumulators in registers).
//  5. Epilogue: bias and router weight in fp32, round to GG_T into shared memory, then
//     16-byte coalesced stores of whole rows to c[s, n0:n0+BLOCK_N].
//
// Versions of the ladder:
//     v1  gemm_v1_naive.cu     one thread per output element
//     v2  gemm_v2_smem.cu      shared-memory tiles of a and w, one output per thread
//     v3  gemm_v3_regblock.cu  register blocking (TM x TN per thread), 16-byte loads
//     v4  gemm_v4_mma.cu       tensor cores: mma.sync m16n8k16, ldmatrix, cp.async   <- this file
//     v5  gemm_v5_wgmma.cu     (stretch, opt-in) Hopper wgmma from shared-memory descriptors
// Run:  python -m cuda_kernels.cupy.gemm --versions v4
// Check the machine code (a config of gemm_configs.json as -D flags):
//     nvcc -arch=sm_90 -cubin -Xptxas -v -DGG_T=__nv_bfloat16 -DBLOCK_M=64 -DBLOCK_N=64 \
//          -DBLOCK_K=64 -DWARPS_M=2 -DWARPS_N=2 -DSTAGES=3 -DGROUP_M=8 -I. gemm_v4_mma.cu \
//          -o v4.cubin && cuobjdump -sass v4.cubin | grep -cE 'HMMA|LDSM|LDGSTS'
#include "gemm_common.cuh"

// The tile and its tunables, #defined by the launcher from gemm_configs.json.
#if !defined(BLOCK_M) || !defined(BLOCK_N) || !defined(BLOCK_K) || !defined(WARPS_M) || \
    !defined(WARPS_N) || !defined(STAGES) || !defined(GROUP_M)
#error "v4: the launcher #defines the tile (gemm_configs.kernel_defines)"
#endif

#define V4_THREADS (WARPS_M * WARPS_N * 32)
#define WM (BLOCK_M / WARPS_M)              // warp tile rows
#define WN (BLOCK_N / WARPS_N)              // warp tile columns
#define MT (WM / 16)                        // m16 fragments per warp
#define NT (WN / 8)                         // n8 fragments per warp
#define SK (BLOCK_K + 8)                    // shared row stride of the a / w tiles (elements)
#define KC (BLOCK_K / 8)                    // 16-byte chunks per tile row
#define SC (BLOCK_N + 8)                    // shared row stride of the output tile (elements)
#define STAGE_BYTES ((BLOCK_M + BLOCK_N) * SK * 2)
#define A_CHUNKS (BLOCK_M * KC)
#define B_CHUNKS (BLOCK_N * KC)
#define A_IT ((A_CHUNKS + V4_THREADS - 1) / V4_THREADS)
#define B_IT ((B_CHUNKS + V4_THREADS - 1) / V4_THREADS)

static_assert(sizeof(GG_T) == 2, "v4: the tensor-core rung takes __half or __nv_bfloat16");
static_assert(WM % 16 == 0 && WN % 16 == 0, "v4: warp tiles must be multiples of 16 x 16");
static_assert(BLOCK_K % 16 == 0, "v4: BLOCK_K must be a multiple of the mma k (16)");
static_assert(V4_THREADS % KC == 0, "v4: each thread copies one fixed k-chunk column");
static_assert(STAGES >= 2, "v4: the pipeline needs at least two stages");

// ---------------------------------------------------------------------------- PTX wrappers
// (tests/cupy/test_gemm_emulated.py runs this file on the CPU under the emulator of
// tests/emulator, which defines GG_HOST_EMULATION and supplies these instructions itself, and
// gemm_common.cuh's cp.async ones; the GPU never sees it.)
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

// ---------------------------------------------------------------------------- the kernel
extern "C" __global__ void __launch_bounds__(V4_THREADS)
grouped_gemm_v4(GG_KERNEL_ARGS) {
    GG_DYNAMIC_SMEM(gg_smem);                 // the cp.async ring, then the output tile
    __shared__ int s_slot[BLOCK_M];
    GG_T* sm = reinterpret_cast<GG_T*>(gg_smem);
    const unsigned sm_base = gg_smem_addr(gg_smem);

    // 1. which tile: grouped order, GROUP_M m-tiles walk all n-tiles together
    int pid_m, pid_n;
    gg_tile_of<GROUP_M>(blockIdx.x, (num_positions + BLOCK_M - 1) / BLOCK_M,
                        (N + BLOCK_N - 1) / BLOCK_N, pid_m, pid_n);
    const int m0 = pid_m * BLOCK_M;
    const int n0 = pid_n * BLOCK_N;
    if (m0 >= __ldg(num_tokens_post_padded)) return;      // the whole CTA leaves together
    const int e = expert_ids[m0 / block_size];

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;

    // 2. slots of the tile rows
    gg_load_slots<BLOCK_M, V4_THREADS>(s_slot, sorted_token_ids, m0, num_positions, num_slots, tid);
    __syncthreads();

    const bool vec_out = (N % 8) == 0;                    // c rows are 16-byte aligned
    if (e < 0) {                                          // expert not on this rank: zeros
        gg_zero_tile<BLOCK_M, BLOCK_N, V4_THREADS>(c, s_slot, n0, N, num_slots, tid);
        return;
    }

    // Copy assignment: chunk idx = tid + i * THREADS -> (row idx / KC, k-chunk idx % KC). As
    // THREADS % KC == 0 the k-chunk column kc is the same for all of a thread's chunks, and
    // its rows are fixed for the whole main loop: resolve their source rows once.
    const int kc = tid % KC;
    const GG_T* a_src[A_IT];
    bool a_ok[A_IT];
#pragma unroll
    for (int i = 0; i < A_IT; ++i) {
        const int r = (tid + i * V4_THREADS) / KC;
        const int s = r < BLOCK_M ? s_slot[r] : num_slots;
        a_ok[i] = gg_live(s, num_slots);
        a_src[i] = a + (a_ok[i] ? (long long)(s / top_k) * Kdim : 0LL) + kc * 8;
    }
    const GG_T* w_e = w + (long long)e * N * Kdim;
    const GG_T* b_src[B_IT];
    bool b_ok[B_IT];
#pragma unroll
    for (int i = 0; i < B_IT; ++i) {
        const int r = (tid + i * V4_THREADS) / KC;
        b_ok[i] = r < BLOCK_N && n0 + r < N;
        b_src[i] = w_e + (b_ok[i] ? (long long)(n0 + r) * Kdim : 0LL) + kc * 8;
    }

    // one k-tile (tile index t) into ring slot st: one cp.async per chunk
    auto load_tile = [&](int t, int st) {
        const int k = t * BLOCK_K;
        const bool k_ok = k + kc * 8 < Kdim;
        const unsigned sa = sm_base + st * STAGE_BYTES;
        const unsigned sb = sa + BLOCK_M * SK * 2;
#pragma unroll
        for (int i = 0; i < A_IT; ++i) {
            const int r = (tid + i * V4_THREADS) / KC;
            if (A_CHUNKS % V4_THREADS != 0 && r >= BLOCK_M) break;
            const bool ok = a_ok[i] && k_ok;
            gg_cp_async16(sa + (r * SK + kc * 8) * 2, ok ? (const void*)(a_src[i] + k) : (const void*)a,
                          ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < B_IT; ++i) {
            const int r = (tid + i * V4_THREADS) / KC;
            if (B_CHUNKS % V4_THREADS != 0 && r >= BLOCK_N) break;
            const bool ok = b_ok[i] && k_ok;
            gg_cp_async16(sb + (r * SK + kc * 8) * 2, ok ? (const void*)(b_src[i] + k) : (const void*)w,
                          ok ? 16 : 0);
        }
    };

    float acc[MT][NT][4] = {};

    // ldmatrix row addresses of this lane, relative to a ring slot (bytes):
    //   A: lanes 0-15 rows 0-15 at k 0, lanes 16-31 rows 0-15 at k 8   -> a0..a3 of m16n8k16
    //   B: lane l -> n row (l/16)*8 + l%8, k ((l/8)%2)*8               -> b0,b1 of two n8 tiles
    const unsigned a_lane = ((wm * WM + (lane & 15)) * SK + ((lane >> 4) << 3)) * 2;
    const unsigned b_lane = BLOCK_M * SK * 2 +
        ((wn * WN + ((lane >> 4) << 3) + (lane & 7)) * SK + (((lane >> 3) & 1) << 3)) * 2;

    // 3. the pipeline: STAGES - 1 tiles in flight; one (possibly empty) group per tile keeps
    //    the group count uniform, so wait_group<STAGES - 2> always means "tile t has landed"
    const int num_k_tiles = (Kdim + BLOCK_K - 1) / BLOCK_K;
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < num_k_tiles) load_tile(st, st);
        gg_cp_async_commit();
    }
    int st_read = 0, st_write = STAGES - 1;
    for (int t = 0; t < num_k_tiles; ++t) {
        gg_cp_async_wait<STAGES - 2>();
        __syncthreads();   // tile t visible to all warps; all warps done with tile t - 1's slot
        if (t + STAGES - 1 < num_k_tiles) load_tile(t + STAGES - 1, st_write);
        gg_cp_async_commit();

        // 4. tensor cores on ring slot st_read
        const unsigned sa = sm_base + st_read * STAGE_BYTES + a_lane;
        const unsigned sb = sm_base + st_read * STAGE_BYTES + b_lane;
#pragma unroll
        for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
            unsigned af[MT][4], bf[NT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) gg_ldsm_x4(af[mt], sa + (mt * 16 * SK + kk * 16) * 2);
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned r[4];
                gg_ldsm_x4(r, sb + (np * 16 * SK + kk * 16) * 2);
                bf[2 * np][0] = r[0]; bf[2 * np][1] = r[1];
                bf[2 * np + 1][0] = r[2]; bf[2 * np + 1][1] = r[3];
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) gg_mma(acc[mt][nt], af[mt], bf[nt], (GG_T*)nullptr);
        }
        st_read = (st_read + 1 == STAGES) ? 0 : st_read + 1;
        st_write = (st_write + 1 == STAGES) ? 0 : st_write + 1;
    }
    gg_cp_async_wait<0>();
    __syncthreads();       // every warp is done reading the ring: reuse it for the output tile

    // 5. epilogue. Accumulator layout of m16n8: lane holds rows lane/4 and lane/4 + 8,
    //    columns 2(lane%4) and 2(lane%4)+1. The bias depends on the column only and the
    //    router weight on the row only: fetch each once, so the unrolled body is plain FMAs.
    float bias_v[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int n = n0 + wn * WN + nt * 8 + (lane & 3) * 2;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float b = 0.0f;
            if (bias_kind == 1 && n + j < N) {
                b = gg_to_f32(static_cast<const GG_T*>(bias)[(long long)e * N + n + j]);
            } else if (bias_kind == 2 && n + j < N) {
                b = static_cast<const float*>(bias)[(long long)e * N + n + j];
            }
            bias_v[nt][j] = b;
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm * WM + mt * 16 + (lane >> 2) + 8 * h;
            const int s = s_slot[r];
            // padding rows are computed (as zeros) and staged but never stored
            const float scale = (mul_routed_weight && gg_live(s, num_slots)) ? topk_weights[s] : 1.0f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int col = wn * WN + nt * 8 + (lane & 3) * 2;
                // (acc + bias) * weight in fp32, the order of docs/stages.md
                gg_store2(sm + r * SC + col, (acc[mt][nt][2 * h] + bias_v[nt][0]) * scale,
                          (acc[mt][nt][2 * h + 1] + bias_v[nt][1]) * scale);
            }
        }
    }
    __syncthreads();
    gg_store_tile<BLOCK_M, BLOCK_N, SC, V4_THREADS>(c, sm, s_slot, n0, N, num_slots, vec_out, tid);
}
