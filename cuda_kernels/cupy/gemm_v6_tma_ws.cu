// gemm_v6_tma_ws.cu: rung 6 of the grouped GEMM ladder: the Hopper GEMM done properly. The
// weights come by the Tensor Memory Accelerator (TMA), the gathered token rows by cp.async, a
// producer warpgroup feeds two consumer warpgroups through an mbarrier ring, and a persistent
// grid walks the tiles in an order that keeps each weight panel in L2.
//
// Math: as every rung (docs/stages.md, grouped_gemm):
//     c[s, n] = (sum_k a[s / top_k, k] * w[e, n, k] + bias[e, n]) * topk_weights.flat[s]
// for each live position p (slot s = sorted_token_ids[p] < P, expert e = expert_ids[p / B]),
// fp16/bf16 products on the tensor cores with fp32 accumulation, epilogue in fp32, rounded
// once to GG_T; e == -1 writes zeros; rows of padding slots are never written.
// Shapes: a [M_a, Kdim], w [E_local, N, Kdim], c [P, N], P = M_a * top_k.
// Requirements: sm_90a (wgmma, setmaxnreg; built with -arch=sm_90a); Kdim % 8 == 0, Kdim > 0,
// a and w 16-byte aligned (TMA: strides multiples of 16 bytes); B % 64 == 0 with BLOCK_M
// (64, 128 or 256) dividing B; BLOCK_N in {64, 128, 256} (at most 128 with BLOCK_M 256);
// BLOCK_K = 64 (one 128-byte swizzled row).
// The last argument is a CUtensorMap of w (gemm.extra_args builds it on the host).
// Chosen per bucket by each card's measured version_by_m in gemm_configs.json and per tuned
// shape by its version_by_shape (on the H100: every bucket but 128 rows per expert, where v5
// measured faster, except DeepSeek-V3's shapes, which take the 256-row tile; at decode too,
// where a 64-row tile wastes tensor-core work that the deep TMA ring of weights hides).
//
// Launch geometry (C = CONSUMERS consumer warpgroups, 1 or 2):
//     threads = 128 (warpgroup 0: the producer) + C x 128 (warpgroups 1..C: the consumers)
//     BLOCK_M = 256: C = 2, consumer c owns the 64-row pieces c and c + 2 (rows 64c.. and
//                    128 + 64c..), all BLOCK_N columns
//     BLOCK_M = 128: C = 2, consumer c owns rows 64c..64c+63, all BLOCK_N columns
//     BLOCK_M = 64:  C = 1 (64 x BLOCK_N) or C = 2 (consumer c owns columns c BLOCK_N/2 ..)
//     grid    = min(#SMs, cdiv(L, BLOCK_M) * cdiv(N, BLOCK_N)), 1-D, persistent: CTA b takes
//               tiles b, b + grid, b + 2 grid, ... of the live ones (see "Persistent")
//     dynamic shared memory = 1024 (alignment) + STAGES * (BLOCK_M + BLOCK_N) * 128
//                             + C * 64 * 72 * 2 (epilogue staging) + 16 * STAGES (mbarriers)
//
// What changes against v5 (each a lesson):
//  - TMA for w. The weight tile (BLOCK_N rows n0.. of w[e], 64 k columns) is one
//    cp.async.bulk.tensor.3d over [E, N, Kdim] (a CUtensorMap built on the host by
//    cuTensorMapEncodeTiled, passed by value as a const __grid_constant__ parameter): one
//    thread issues it, the copy engine writes the tile in wgmma's 128-byte swizzle (the same
//    Swizzle<3,4,3> on address bits that v5's cp.async reproduced by hand), zero-fills rows past
//    N and columns past Kdim (3-D: a ragged N never reads the next expert's rows) and counts
//    its bytes down on the stage's "full" mbarrier (complete_tx; the issuer announced them
//    with mbarrier.arrive.expect_tx).
//  - cp.async for a. TMA cannot gather: a's rows are a[s / top_k] for the tile's slots. The
//    128 producer threads copy them in 16-byte pieces into the same swizzled layout (8 pieces a
//    row, the rows of a thread fixed for the tile), then cp.async.mbarrier.arrive.noinc on the
//    same full barrier: its arrival fires once the thread's copies have landed. So a stage is
//    full after 128 such arrivals, the expect_tx arrival and the TMA's bytes (init count 129).
//  - The ring: STAGES slots, each with a full and an empty mbarrier. The producer waits on
//    empty[slot] (phase parity of its round, the first round passes at once), fills it; each
//    consumer waits on full[slot], issues its wgmma batch, and only once wgmma.wait_group 1
//    says the batch *before* has completed does each consumer warp's lane 0 arrive on that
//    batch's empty barrier (init count 4 C): one batch stays in flight, and a slot is never
//    refilled while the tensor cores may still read it.
//  - Proxies: cp.async writes shared memory through the generic proxy, wgmma reads through the
//    async proxy: each consumer thread executes fence.proxy.async after its full-barrier wait
//    and before the wgmma (TMA writes are async-proxy already).
//  - Warp specialization: setmaxnreg.dec to PRODUCER_REGS in the producer warpgroup,
//    setmaxnreg.inc to CONSUMER_REGS in the consumers (the kernel enters with the cap of
//    __launch_bounds__(threads, 1); the launcher computes the split so the CTA's registers are
//    conserved); the roles are the two branches of one if/else, as setmaxnreg requires.
//  - Persistent: both roles walk the same tile list: t = blockIdx.x + i * gridDim.x over
//    live_m * cdiv(N, BLOCK_N) tiles, live_m = cdiv(num_tokens_post_padded, BLOCK_M) (read on
//    the device: the dead padding tiles are never visited), in groups of GROUP_M m tiles with
//    m fastest: at any time the CTAs work on a few n tiles of one expert's (or two experts')
//    panel, so each w tile is read from HBM once and from L2 by up to GROUP_M CTAs. The ring
//    and its phases run on across tiles: the producer fills the next tile's stages while the
//    consumers run the epilogue of the last one.
//  - The next tile's ids, a tile ahead. A consumer starts a tile by branching on global data
//    (its expert; at BLOCK_M 256, which pieces are live) and by loading its router weights
//    through the slots of its rows, a chain of two loads. Issued as the tile starts, those
//    loads stall the consumer between tiles while the ring, already full of the next tile's
//    stages, waits for it: so the consumer loads them for tile t + grid as tile t begins and
//    computes nothing on them until then (TileIds). Measured through the layer on an H100
//    (CUDA graphs, same call): DeepSeek-V3 T=4096 9.44 -> 9.27 ms, Qwen3-30B-A3B T=1024 and
//    4096 0.5-1% faster; the producer's a-row ids a tile ahead as well gained nothing more
//    (its ring of issued stages already hides them) and cost it registers.
//  - Epilogue: (acc + bias) * weight in fp32, rounded once, staged per consumer warpgroup 64
//    columns at a time in shared memory (its own named barrier), then 16-byte stores to the
//    scattered rows c[s]; e == -1 tiles store zeros and load nothing. Both consumers finish a
//    tile together, so the tensor cores idle through every epilogue: work added here costs
//    its full time. (The layer's activation applied here, gate and up columns loaded into one
//    thread's accumulators, took 0.99-1.16x the layer's time with the activation stage, mean
//    1.08, over 8 prefill points on an H100: an expf, a division and three roundings per
//    output, an estimated 3 us a 128 x 256 tile, against a stage that only streams memory.)
//  - BLOCK_M 256 (two 64-row pieces per consumer, both multiplied by the same w tile): each
//    weight panel is read once per expert of up to 256 rows where two 128-row tiles read it
//    twice, the second time from HBM again once L2 has turned over (DeepSeek-V3 at 128 rows
//    per expert: 1.14x the unique weight bytes). A 256-row block is mostly padding at such
//    counts, and padding costs no tensor-core work: a run's live slots come first, so a
//    piece holds no live row exactly when its first row is padding, and such a piece issues
//    no wgmma and stores nothing. The pieces are interleaved between the consumers (rows
//    0-63 and 128-191 to the first) so that the padding at a run's end takes work from both.
//
// Versions of the ladder:
//     v1  gemm_v1_naive.cu     one thread per output element
//     v2  gemm_v2_smem.cu      shared-memory tiles of a and w, one output per thread
//     v3  gemm_v3_regblock.cu  register blocking (TM x TN per thread), 16-byte loads
//     v4  gemm_v4_mma.cu       tensor cores: mma.sync m16n8k16, ldmatrix, cp.async pipeline
//     v5  gemm_v5_wgmma.cu     Hopper wgmma from shared-memory descriptors
//     v6  gemm_v6_tma_ws.cu    TMA + cp.async gather, mbarrier ring, warp-specialized,
//                              persistent                                            <- this file
// Run:  python -m cuda_kernels.cupy.gemm --versions v4,v5,v6
//       python -m cuda_kernels.cupy.tune --bench --models mixtral,qwen3,deepseek \
//              --tokens 1024,4096,16384 --versions v5,v6          (the models, L2 flushed)
// Check the machine code (HGMMA and UTMALDG must appear, no local memory):
//     nvcc -gencode=arch=compute_90a,code=sm_90a -cubin -Xptxas -v -DGG_T=__nv_bfloat16 \
//          -DGG_AB=bf16 -DBLOCK_M=128 -DBLOCK_N=256 -DBLOCK_K=64 -DSTAGES=4 -DCONSUMERS=2 \
//          -DGROUP_M=8 -DPRODUCER_REGS=56 -DCONSUMER_REGS=224 -I. gemm_v6_tma_ws.cu -o v6.cubin \
//          && cuobjdump -sass v6.cubin | grep -c HGMMA
#include "gemm_common.cuh"
#include "gemm_wgmma.cuh"

// The tile and its tunables, #defined by the launcher from gemm_configs.json.
#if !defined(BLOCK_M) || !defined(BLOCK_N) || !defined(BLOCK_K) || !defined(STAGES) || \
    !defined(CONSUMERS) || !defined(GROUP_M) || !defined(PRODUCER_REGS) || \
    !defined(CONSUMER_REGS)
#error "v6: the launcher #defines the tile (gemm_configs.kernel_defines)"
#endif

#define V6_THREADS ((1 + CONSUMERS) * 128)
#define WG_N (BLOCK_M >= 128 ? BLOCK_N : BLOCK_N / CONSUMERS)   // a consumer's columns
#define PIECES (BLOCK_M == 256 ? 2 : 1)       // a consumer's 64-row pieces of the tile
#define ROW_BYTES 128                         // BLOCK_K bf16 = one 128-byte swizzled row
#define TILE_A_BYTES (BLOCK_M * ROW_BYTES)
#define TILE_B_BYTES (BLOCK_N * ROW_BYTES)
#define STAGE_BYTES (TILE_A_BYTES + TILE_B_BYTES)
#define SMEM_ALIGN 1024                       // the 128-byte swizzle repeats every 1024 bytes
#define EPI_COLS 64                           // the epilogue stages 64 columns at a time
#define EPI_STRIDE (EPI_COLS + 8)             // + 16 bytes: the staging writes spread over banks
#define EPI_BYTES (64 * EPI_STRIDE * 2)
#define EPI_OFFSET (STAGES * STAGE_BYTES)
#define BAR_OFFSET (EPI_OFFSET + CONSUMERS * EPI_BYTES)
#define A_ROWS (BLOCK_M / 16)                 // a rows each producer thread copies per stage
#define FULL_COUNT (128 + 1)                  // 128 cp.async arrivals + the expect_tx arrival
#define EMPTY_COUNT (4 * CONSUMERS)           // lane 0 of each consumer warp

static_assert(sizeof(GG_T) == 2, "v6: wgmma takes __half or __nv_bfloat16");
static_assert(BLOCK_K == 64, "v6: BLOCK_K 64 (a 128-byte swizzled row, the TMA box's width)");
static_assert((BLOCK_M == 256 && CONSUMERS == 2 && BLOCK_N <= 128) ||
              (BLOCK_M == 128 && CONSUMERS == 2) || (BLOCK_M == 64 && (CONSUMERS == 1 ||
              CONSUMERS == 2)), "v6: BLOCK_M 256 (BLOCK_N <= 128: two accumulators a consumer) "
              "or 128 with 2 consumers, or 64 with 1 or 2");
static_assert(WG_N == 64 || WG_N == 128 || WG_N == 256, "v6: wgmma n of 64, 128 or 256");
static_assert(BLOCK_N <= 256, "v6: a TMA box holds at most 256 rows");
static_assert(STAGES >= 2, "v6: a ring of at least 2 stages");
static_assert(BAR_OFFSET % 8 == 0, "v6: mbarriers are 8-byte aligned");
static_assert(PRODUCER_REGS % 8 == 0 && CONSUMER_REGS % 8 == 0 && PRODUCER_REGS >= 24 &&
              CONSUMER_REGS <= 256, "v6: setmaxnreg counts are multiples of 8 in [24, 256]");
static_assert(CONSUMERS == 1 || 128 * PRODUCER_REGS + 128 * CONSUMERS * CONSUMER_REGS <=
              V6_THREADS * (65536 / V6_THREADS / 8 * 8),
              "v6: the register split must not exceed what the CTA entered with");

// The emulator's launcher (tests/emulator/grouped_gemm_main.cpp) passes an emulated tensor map after the common
// arguments when this is defined.
#define GG_KERNEL_TAKES_TMAP 1

// CUtensorMap's 128 opaque bytes (cuda.h is not needed: the kernel only hands its address to
// the TMA instruction). 64-byte aligned, as the driver requires.
struct __align__(64) GgTmap {
    unsigned long long words[16];
};

#ifndef GG_HOST_EMULATION
// gg_mbar_init, gg_fence_mbar_init, gg_mbar_arrive, gg_mbar_arrive_expect_tx, gg_mbar_wait
#include "mbarrier.cuh"
// one arrival on `bar`, made when every cp.async this thread issued before has landed
__device__ __forceinline__ void gg_cp_async_mbar_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void gg_cp_async_wait_all() {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}
// ---------------------------------------------------------------- TMA (sm_90)
// box (c0 = k, c1 = n, c2 = e) of the tensor map into shared memory at dst, bytes counted
// down on bar
__device__ __forceinline__ void gg_tma_load_3d(unsigned dst, const GgTmap* map, int c0, int c1,
                                               int c2, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2),
           "r"(bar)
        : "memory");
}
// ---------------------------------------------------------------- warp specialization (sm_90a)
template <int R>
__device__ __forceinline__ void gg_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(R));
}
template <int R>
__device__ __forceinline__ void gg_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(R));
}
// a barrier of `count` threads (whole warps) under id (1..15; 0 is __syncthreads)
__device__ __forceinline__ void gg_bar_named(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}

#endif  // GG_HOST_EMULATION

// Byte offset of (row r, 16-byte k chunk c) in a 128-byte-swizzled tile that starts on a
// 1024-byte boundary: chunk bits [4, 7) XORed with row bits (address bits [7, 10)), the layout
// the TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and wgmma reads with layout type 1.
__device__ __forceinline__ unsigned gg_swizzle128(int r, int c) {
    return (unsigned)(r * ROW_BYTES + ((c ^ (r & 7)) << 4));
}

// First tile row of consumer cw's piece h (64 rows): BLOCK_M 64 has one piece, the tile (the
// consumers split its columns); 128 gives consumer c rows 64c..; 256 pieces c and c + 2.
__device__ __forceinline__ int v6_piece_row(int cw, int h) {
    return BLOCK_M == 64 ? 0 : 64 * (cw + 2 * h);
}

// A consumer's main loop over one tile: for each k tile, wait for the stage to be full, issue
// the wgmma of its first NP pieces (the live ones; each piece against the same w tile) as one
// batch, and release the stage before it once that batch has completed (one batch stays in
// flight). NP = 0 (every row of this consumer's pieces is padding) still takes part in the
// ring: it waits for each stage and releases it, so that the empty barriers count it.
template <int NP>
__device__ __forceinline__ void v6_consume_tile(float (&acc)[PIECES][WG_N / 2],
                                                unsigned sm_base, int cw, int col0,
                                                int num_k_tiles, unsigned full_bar,
                                                unsigned empty_bar, int lane, int& slot,
                                                unsigned& phase) {
    int prev = 0;
    for (int kt = 0; kt < num_k_tiles; ++kt) {
        gg_mbar_wait(full_bar + 8 * slot, phase);         // a and w of this stage landed
        if (NP > 0) {
            wg_fence_proxy_async();   // cp.async's generic writes -> wgmma's async reads
            const unsigned stage = sm_base + slot * STAGE_BYTES;
            const unsigned b_base = stage + TILE_A_BYTES + col0 * ROW_BYTES;
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BLOCK_K / 16; ++kk)
#pragma unroll
                for (int h = 0; h < NP; ++h)
                    gg_wgmma<WG_N>(acc[h],
                                   wg_desc_swizzled<ROW_BYTES>(
                                       stage + v6_piece_row(cw, h) * ROW_BYTES + kk * 32),
                                   wg_desc_swizzled<ROW_BYTES>(b_base + kk * 32));
            wg_commit();
        }
        wg_wait<1>();                 // the batch before this one has completed ...
        if (kt > 0 && lane == 0) gg_mbar_arrive(empty_bar + 8 * prev);   // ... free it
        prev = slot;
        if (++slot == STAGES) {
            slot = 0;
            phase ^= 1;
        }
    }
    wg_wait<0>();
    if (num_k_tiles > 0 && lane == 0) gg_mbar_arrive(empty_bar + 8 * prev);
}

extern "C" __global__ void __launch_bounds__(V6_THREADS, 1)
grouped_gemm_v6(GG_KERNEL_ARGS, const __grid_constant__ GgTmap w_map) {
    GG_DYNAMIC_SMEM(gg_smem);                 // ring | epilogue staging | mbarriers
    // the ring starts at the first 1024-byte boundary (the launcher adds 1024 bytes for this)
    const unsigned raw_base = gg_smem_addr(gg_smem);
    const unsigned sm_base = (raw_base + (SMEM_ALIGN - 1)) & ~(unsigned)(SMEM_ALIGN - 1);
    unsigned char* smem = gg_smem + (sm_base - raw_base);
    const unsigned full_bar = sm_base + BAR_OFFSET;            // full[s] at + 8 s
    const unsigned empty_bar = full_bar + 8 * STAGES;          // empty[s] at + 8 s
    const int tid = threadIdx.x;

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            gg_mbar_init(full_bar + 8 * s, FULL_COUNT);
            gg_mbar_init(empty_bar + 8 * s, EMPTY_COUNT);
        }
        gg_fence_mbar_init();
    }
    __syncthreads();                          // the last barrier all warpgroups pass together

    // The tile list, the same in both roles: live m tiles only (the alignment pads each
    // expert to a multiple of B, and BLOCK_M divides B: no tile straddles two experts).
    const int ntpp = __ldg(num_tokens_post_padded);
    const int live_m = min((ntpp + BLOCK_M - 1) / BLOCK_M,
                           (num_positions + BLOCK_M - 1) / BLOCK_M);
    const int num_pid_n = (N + BLOCK_N - 1) / BLOCK_N;
    const int num_tiles = max(live_m, 0) * num_pid_n;
    const int num_k_tiles = (Kdim + BLOCK_K - 1) / BLOCK_K;

    if (tid < 128) {
        // ============================================================ producer warpgroup
#if CONSUMERS == 2
        gg_setmaxnreg_dec<PRODUCER_REGS>();
#endif
        // this thread copies 16-byte chunk kc of tile rows r0, r0 + 16, ... (consecutive
        // threads: consecutive chunks of a row, whole 128-byte lines from global)
        const int kc = tid & 7;
        const int r0 = tid >> 3;
        int slot = 0;
        unsigned phase = 0;
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            int pid_m, pid_n;
            gg_tile_of<GROUP_M>(t, live_m, num_pid_n, pid_m, pid_n);
            const int m0 = pid_m * BLOCK_M, n0 = pid_n * BLOCK_N;
            const int e = expert_ids[m0 / block_size];
            if (e < 0) continue;              // the consumers store zeros: nothing to load
            int arow[A_ROWS];                 // the a row of each of this thread's tile rows
#pragma unroll
            for (int i = 0; i < A_ROWS; ++i) {
                const int p = m0 + r0 + 16 * i;
                const int s = p < num_positions ? sorted_token_ids[p] : num_slots;
                arow[i] = gg_live(s, num_slots) ? s / top_k : -1;
            }
            for (int kt = 0; kt < num_k_tiles; ++kt) {
                // the slot is free once every consumer warp released its last round
                gg_mbar_wait(empty_bar + 8 * slot, phase ^ 1);
                const unsigned a_dst = sm_base + slot * STAGE_BYTES;
                const int k = kt * BLOCK_K;
                if (tid == 0) {
                    gg_mbar_arrive_expect_tx(full_bar + 8 * slot, TILE_B_BYTES);
                    gg_tma_load_3d(a_dst + TILE_A_BYTES, &w_map, k, n0, e, full_bar + 8 * slot);
                }
                const bool k_ok = k + kc * 8 < Kdim;      // the Kdim tail: whole chunks out
#pragma unroll
                for (int i = 0; i < A_ROWS; ++i) {
                    const bool ok = arow[i] >= 0 && k_ok;
                    const GG_T* src = ok ? a + (long long)arow[i] * Kdim + k + kc * 8 : a;
                    gg_cp_async16(a_dst + gg_swizzle128(r0 + 16 * i, kc), src, ok ? 16 : 0);
                }
                gg_cp_async_mbar_arrive(full_bar + 8 * slot);
                if (++slot == STAGES) {
                    slot = 0;
                    phase ^= 1;
                }
            }
        }
        gg_cp_async_wait_all();               // no copy outlives its thread
    } else {
        // ============================================================ consumer warpgroups
#if CONSUMERS == 2
        gg_setmaxnreg_inc<CONSUMER_REGS>();
#endif
        const int cw = (tid >> 7) - 1;        // this consumer
        const int ctid = tid & 127;
        const int warp = ctid >> 5, lane = tid & 31;
        const int col0 = BLOCK_M == 64 ? cw * WG_N : 0;       // this consumer's columns
        GG_T* stage_tile = reinterpret_cast<GG_T*>(smem + EPI_OFFSET + cw * EPI_BYTES);
        const bool vec_out = (N % 8) == 0;
        int slot = 0;
        unsigned phase = 0;
        // The ids a tile's start branches on or loads through, loaded a tile ahead: the loads
        // for tile t + grid are issued as tile t begins and nothing computes on them until
        // t + grid does, so they land during t's main loop instead of stalling the consumer
        // between two tiles (while the ring, already full of the next tile's stages, waits).
        struct TileIds {
            int e;
            int head[PIECES];         // the slot of each piece's first row (a live piece?)
            int wrow[PIECES][2];      // the slots of this thread's two accumulator rows
        };
        auto load_ids = [&](int t, TileIds& ids) {
            int pid_m, pid_n;
            gg_tile_of<GROUP_M>(t, live_m, num_pid_n, pid_m, pid_n);
            ids.e = expert_ids[pid_m * BLOCK_M / block_size];
#pragma unroll
            for (int h = 0; h < PIECES; ++h) {
                const int p0 = pid_m * BLOCK_M + v6_piece_row(cw, h);
                ids.head[h] = p0 < num_positions ? sorted_token_ids[p0] : num_slots;
#pragma unroll
                for (int r = 0; r < 2; ++r) {   // accumulator rows 16 warp + lane / 4 (+ 8)
                    const int p = p0 + warp * 16 + (lane >> 2) + 8 * r;
                    ids.wrow[h][r] = p < num_positions ? sorted_token_ids[p] : num_slots;
                }
            }
        };
        float acc[PIECES][WG_N / 2];
        TileIds cur, next;
        if (blockIdx.x < num_tiles) load_ids(blockIdx.x, cur);
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x, cur = next) {
            if (t + gridDim.x < num_tiles) load_ids(t + gridDim.x, next);
            int pid_m, pid_n;
            gg_tile_of<GROUP_M>(t, live_m, num_pid_n, pid_m, pid_n);
            const int m0 = pid_m * BLOCK_M;
            const int n_base = pid_n * BLOCK_N + col0;        // this consumer's first column
            const int e = cur.e;
            // the store phase: thread ctid stores 16-byte chunk (ctid & 7) of rows
            // (ctid >> 3) + 16 i of each of this consumer's pieces, for each 64-column piece
            // (loaded here: nothing waits for them before the epilogue)
            int srow[PIECES][4];
#pragma unroll
            for (int h = 0; h < PIECES; ++h)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int p = m0 + v6_piece_row(cw, h) + (ctid >> 3) + 16 * i;
                    srow[h][i] = p < num_positions ? sorted_token_ids[p] : num_slots;
                }
            // the pieces that hold a live row: the first `live` (BLOCK_M 256 only; a 64- or
            // 128-row tile multiplies its one piece whatever it holds)
            int live = PIECES == 1 ? 1 : 0;
#pragma unroll
            for (int h = 0; h < PIECES; ++h)
                if (PIECES == 2 && gg_live(cur.head[h], num_slots)) live = h + 1;
            if (e < 0) {                      // expert not on this rank: zeros
#pragma unroll
                for (int h = 0; h < PIECES; ++h)
#pragma unroll
                    for (int cc = 0; cc < WG_N / EPI_COLS; ++cc)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int n = n_base + cc * EPI_COLS + (ctid & 7) * 8;
                            if (!gg_live(srow[h][i], num_slots) || n >= N) continue;
                            GG_T* dst = c + (long long)srow[h][i] * N + n;
                            if (vec_out) {
                                *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
                            } else {
                                for (int j = 0; j < 8 && n + j < N; ++j)
                                    dst[j] = gg_from_f32<GG_T>(0.0f);
                            }
                        }
                continue;
            }
            // the router weights of this thread's two accumulator rows of each piece, fetched
            // before the main loop hides their latency
            float scale[PIECES][2];
#pragma unroll
            for (int h = 0; h < PIECES; ++h)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int s = cur.wrow[h][r];
                    scale[h][r] = (mul_routed_weight && gg_live(s, num_slots)) ? topk_weights[s]
                                                                                : 1.0f;
                }
#pragma unroll
            for (int h = 0; h < PIECES; ++h)
#pragma unroll
                for (int j = 0; j < WG_N / 2; ++j) acc[h][j] = 0.0f;

            // one main loop per count of live pieces: no branch between a batch's wgmma
            if (PIECES == 1 || live == PIECES)
                v6_consume_tile<PIECES>(acc, sm_base, cw, col0, num_k_tiles, full_bar,
                                        empty_bar, lane, slot, phase);
            else if (live == 1)
                v6_consume_tile<1>(acc, sm_base, cw, col0, num_k_tiles, full_bar, empty_bar,
                                   lane, slot, phase);
            else
                v6_consume_tile<0>(acc, sm_base, cw, col0, num_k_tiles, full_bar, empty_bar,
                                   lane, slot, phase);

            // Epilogue of each live piece, 64 columns at a time. Warp `warp` holds rows
            // 16 warp + lane / 4 (+ 8) of the piece; for each n8 block j, acc[h][4j..4j+3] =
            // (row, 8j + 2(lane % 4)), (row, +1), (row + 8, ...), (row + 8, +1) (v5's layout).
            const int er = warp * 16 + (lane >> 2);
#pragma unroll
            for (int h = 0; h < PIECES; ++h) {
                if (h >= live) break;         // uniform in the warpgroup: the named barriers
#pragma unroll
                for (int cc = 0; cc < WG_N / EPI_COLS; ++cc) {
                    gg_bar_named(1 + cw, 128);    // the staging tile's last reads are done
#pragma unroll
                    for (int j = 0; j < EPI_COLS / 8; ++j) {
                        const int jj = cc * (EPI_COLS / 8) + j;
                        const int col = j * 8 + (lane & 3) * 2;
                        const int n = n_base + cc * EPI_COLS + col;
                        float b0, b1;
                        gg_bias_pair(bias, bias_kind, e, n, N, b0, b1);
#pragma unroll
                        for (int r = 0; r < 2; ++r)   // (acc + bias) * weight in fp32, rounded once
                            gg_store2(stage_tile + (er + 8 * r) * EPI_STRIDE + col,
                                      (acc[h][4 * jj + 2 * r] + b0) * scale[h][r],
                                      (acc[h][4 * jj + 2 * r + 1] + b1) * scale[h][r]);
                    }
                    gg_bar_named(1 + cw, 128);    // the staging tile is complete
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int r = (ctid >> 3) + 16 * i, ch = (ctid & 7) * 8;
                        const int n = n_base + cc * EPI_COLS + ch;
                        if (!gg_live(srow[h][i], num_slots) || n >= N) continue;
                        GG_T* dst = c + (long long)srow[h][i] * N + n;
                        const GG_T* src = stage_tile + r * EPI_STRIDE + ch;
                        if (vec_out) {
                            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
                        } else {
                            for (int j = 0; j < 8 && n + j < N; ++j) dst[j] = src[j];
                        }
                    }
                }
            }
        }
    }
}
