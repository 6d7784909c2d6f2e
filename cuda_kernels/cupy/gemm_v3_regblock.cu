// gemm_v3_regblock.cu: rung 3 of the grouped GEMM ladder: register blocking + 16-byte loads.
//
// Math: as every rung (docs/stages.md, grouped_gemm):
//     c[s, n] = (sum_k a[s / top_k, k] * w[e, n, k] + bias[e, n]) * topk_weights.flat[s]
// for each live position p (slot s = sorted_token_ids[p] < P, expert e = expert_ids[p / B]),
// fp32 accumulation (FFMA), rounded once to GG_T; e == -1 writes zeros.
// Shapes: a [M_a, Kdim], w [E_local, N, Kdim], c [P, N], P = M_a * top_k.
// Requirement: Kdim % VEC == 0, VEC = 16 / sizeof(GG_T) (4 for fp32, 8 for fp16/bf16), and
// a, w 16-byte aligned, so that every 16-byte chunk of a row is wholly inside or outside
// Kdim and aligned. The launcher checks this and falls back to v2 otherwise.
//
// Launch geometry (a CTA owns a BLOCK_M x BLOCK_N tile; BLOCK_M divides B):
//     threads = (BLOCK_M / TM) * (BLOCK_N / TN), 1-D; thread (tx, ty) = (tid % (BLOCK_N/TN),
//               tid / (BLOCK_N/TN)) owns the TM x TN micro-tile at rows ty*TM, cols tx*TN
//     grid    = (cdiv(L, BLOCK_M), cdiv(N, BLOCK_N))
//     shared memory (static) = 4 * BLOCK_K * (BLOCK_M + BLOCK_N + 8) + 12 * BLOCK_M bytes
// Why it is faster than v2: a thread keeps TM x TN accumulators in registers and, per k,
// reads TM + TN values from shared memory for TM * TN FMAs (v2: 2 reads per FMA). Tiles are
// stored k-major in shared memory ([k][m], fp32) so a thread's TM (TN) values are one
// 16-byte LDS.128. Global loads are 16 bytes (VEC elements) per thread, and the next tile's
// loads are issued into registers before this tile's FMAs run, so their latency hides.
//
// Versions of the ladder:
//     v1  gemm_v1_naive.cu     one thread per output element
//     v2  gemm_v2_smem.cu      shared-memory tiles of a and w, one output per thread
//     v3  gemm_v3_regblock.cu  register blocking (TM x TN per thread), 16-byte loads  <- this file
//     v4  gemm_v4_mma.cu       tensor cores: mma.sync m16n8k16, ldmatrix, cp.async pipeline
//     v5  gemm_v5_wgmma.cu     (stretch, opt-in) Hopper wgmma from shared-memory descriptors
// Run:  python -m cuda_kernels.cupy.gemm --versions v3
#include "gemm_common.cuh"

// The tile and its tunables, #defined by the launcher from gemm_configs.json.
#if !defined(BLOCK_M) || !defined(BLOCK_N) || !defined(BLOCK_K) || !defined(TM) || !defined(TN)
#error "v3: the launcher #defines the tile (gemm_configs.kernel_defines)"
#endif

#define V3_THREADS ((BLOCK_M / TM) * (BLOCK_N / TN))
#define V3_VEC ((int)(16 / sizeof(GG_T)))                 // elements per 16-byte load
#define V3_PAD 4                                           // keeps rows 16-byte aligned
#define A_VECS (BLOCK_M * BLOCK_K / V3_VEC)
#define W_VECS (BLOCK_N * BLOCK_K / V3_VEC)
#define A_LD ((A_VECS + V3_THREADS - 1) / V3_THREADS)
#define W_LD ((W_VECS + V3_THREADS - 1) / V3_THREADS)

static_assert(BLOCK_M % TM == 0 && BLOCK_N % TN == 0, "v3: the micro-tile must divide the tile");
static_assert(V3_THREADS >= 32 && V3_THREADS <= 1024, "v3: 32 to 1024 threads per CTA");
static_assert(BLOCK_K % V3_VEC == 0, "v3: BLOCK_K must hold whole 16-byte chunks");

// The VEC elements of a 16-byte chunk as fp32.
__device__ __forceinline__ void gg_unpack(const uint4& v, float* f, float*) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
}
__device__ __forceinline__ void gg_unpack(const uint4& v, float* f, __half*) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) { const float2 t = __half22float2(h[j]); f[2*j] = t.x; f[2*j+1] = t.y; }
}
__device__ __forceinline__ void gg_unpack(const uint4& v, float* f, __nv_bfloat16*) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 t = __bfloat1622float2(h[j]); f[2*j] = t.x; f[2*j+1] = t.y;
    }
}

// TM (or TN) consecutive fp32 values of one k-row of a shared tile: LDS.128 when TM % 4 == 0.
template <int CNT>
__device__ __forceinline__ void gg_lds(float* dst, const float* src) {
    if constexpr (CNT % 4 == 0) {
#pragma unroll
        for (int j = 0; j < CNT; j += 4) {
            const float4 t = *reinterpret_cast<const float4*>(src + j);
            dst[j] = t.x; dst[j+1] = t.y; dst[j+2] = t.z; dst[j+3] = t.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < CNT; ++j) dst[j] = src[j];
    }
}

// The 16-byte chunks a thread loaded (chunk idx = tid + i * THREADS of a ROWS x BLOCK_K tile:
// row idx % ROWS, k chunk idx / ROWS) as fp32, transposed into the shared tile dst[k][row].
template <int kLoads, int kChunks, int kRows, int kStride>
__device__ __forceinline__ void gg_store_transposed(const uint4 (&chunks)[kLoads],
                                                    float (*dst)[kStride], int tid) {
    float f[V3_VEC];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
        const int idx = tid + i * V3_THREADS;
        if (idx >= kChunks) break;
        const int r = idx % kRows, kc = (idx / kRows) * V3_VEC;
        gg_unpack(chunks[i], f, (GG_T*)nullptr);
#pragma unroll
        for (int j = 0; j < V3_VEC; ++j) dst[kc + j][r] = f[j];
    }
}

// f(i, j, s, n) for each output of thread (tx, ty)'s TM x TN micro-tile that exists: row i in a
// live slot s, column n = n0 + tx TN + j below N.
template <typename F>
__device__ __forceinline__ void gg_for_outputs(const int* s_slot, int tx, int ty, int n0, int N,
                                               int num_slots, F&& f) {
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int s = s_slot[ty * TM + i];
        if (!gg_live(s, num_slots)) continue;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int n = n0 + tx * TN + j;
            if (n < N) f(i, j, s, n);
        }
    }
}

extern "C" __global__ void __launch_bounds__(V3_THREADS)
grouped_gemm_v3(GG_KERNEL_ARGS) {
    __shared__ __align__(16) float As[BLOCK_K][BLOCK_M + V3_PAD];
    __shared__ __align__(16) float Ws[BLOCK_K][BLOCK_N + V3_PAD];
    __shared__ long long s_arow[BLOCK_M];   // element offset of each tile row's a row, -1 = padding
    __shared__ int s_slot[BLOCK_M];

    const int tid = threadIdx.x;
    const int m0 = blockIdx.x * BLOCK_M;
    const int n0 = blockIdx.y * BLOCK_N;
    if (m0 >= __ldg(num_tokens_post_padded)) return;
    const int e = expert_ids[m0 / block_size];
    gg_load_slots<BLOCK_M, V3_THREADS>(s_slot, sorted_token_ids, m0, num_positions, num_slots, tid);
    __syncthreads();
    for (int r = tid; r < BLOCK_M; r += V3_THREADS) {
        const int s = s_slot[r];
        s_arow[r] = gg_live(s, num_slots) ? (long long)(s / top_k) * Kdim : -1LL;
    }
    __syncthreads();

    const int tx = tid % (BLOCK_N / TN), ty = tid / (BLOCK_N / TN);
    if (e < 0) {                                          // expert not on this rank: zeros
        gg_for_outputs(s_slot, tx, ty, n0, N, num_slots, [&](int, int, int s, int n) {
            c[(long long)s * N + n] = gg_from_f32<GG_T>(0.0f);
        });
        return;
    }

    const GG_T* w_e = w + (long long)e * N * Kdim;
    uint4 ra[A_LD], rw[W_LD];
    // Chunk idx -> (row = idx % ROWS, k-chunk = idx / ROWS): the 32 lanes of a warp take 32
    // consecutive rows of one k-chunk, so their transposed stores As[k][row] hit 32 banks.
    auto load_global = [&](int k0) {
#pragma unroll
        for (int i = 0; i < A_LD; ++i) {
            const int idx = tid + i * V3_THREADS;
            const int r = idx % BLOCK_M, k = k0 + (idx / BLOCK_M) * V3_VEC;
            const long long off = idx < A_VECS ? s_arow[r] : -1LL;
            ra[i] = (off >= 0 && k < Kdim)
                        ? __ldg(reinterpret_cast<const uint4*>(a + off + k)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < W_LD; ++i) {
            const int idx = tid + i * V3_THREADS;
            const int r = idx % BLOCK_N, k = k0 + (idx / BLOCK_N) * V3_VEC;
            const bool ok = idx < W_VECS && n0 + r < N && k < Kdim;
            rw[i] = ok ? __ldg(reinterpret_cast<const uint4*>(w_e + (long long)(n0 + r) * Kdim + k))
                       : make_uint4(0, 0, 0, 0);
        }
    };
    auto store_shared = [&]() {
        gg_store_transposed<A_LD, A_VECS, BLOCK_M>(ra, As, tid);
        gg_store_transposed<W_LD, W_VECS, BLOCK_N>(rw, Ws, tid);
    };

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;

    if (Kdim > 0) load_global(0);
    for (int k0 = 0; k0 < Kdim; k0 += BLOCK_K) {
        store_shared();
        __syncthreads();
        if (k0 + BLOCK_K < Kdim) load_global(k0 + BLOCK_K);   // in flight during the FMAs
#pragma unroll
        for (int kk = 0; kk < BLOCK_K; ++kk) {
            float av[TM], bv[TN];
            gg_lds<TM>(av, &As[kk][ty * TM]);
            gg_lds<TN>(bv, &Ws[kk][tx * TN]);
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();                                  // before the next store overwrites
    }

    gg_for_outputs(s_slot, tx, ty, n0, N, num_slots, [&](int i, int j, int s, int n) {
        const float out = gg_epilogue(acc[i][j], e, n, s, N, bias, bias_kind, topk_weights,
                                      mul_routed_weight);
        c[(long long)s * N + n] = gg_from_f32<GG_T>(out);
    });
}
