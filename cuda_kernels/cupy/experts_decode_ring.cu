// experts_decode_ring.cu: rung 2 of the decode step's one launch (experts_decode.cu is rung
// 1): the same math, the same two phases and grid barrier, the weights brought in by bulk
// copies into a ring of shared memory, and phase 1's work taken from a counter.
//
// Shapes, math and roundings: experts_decode.cu's (c2[s, j] = round(round(act(g)) * u), then
//   c3[s, h] = round((w2[e, h] . c2[s]) * topk_weights[s]), out[t, h] = the K slots in order);
//   the dot products in the same order (each lane's 16-byte chunks lane, lane + 32, ..., then
//   a warp's butterfly), so both rungs give the same bits.
//
// What changes against rung 1 (each a lesson):
//  - Bulk copies. A plain read of the 705 MB that Mixtral-8x7B and DeepSeek-V3 route at T = 1
//    (H100 SXM, one block per SM) took 253-263 us as rung 1's 16-byte loads per lane and
//    230-232 us as cp.async.bulk copies of 8-32 KB into 4 or more shared-memory stages
//    (3.02-3.05 TB/s): one instruction moves kilobytes, tracked by the copy engine instead of
//    the load-store unit's per-request slots. One producer warp (its lane 0) issues the
//    copies; CONSUMER_WARPS warps compute from shared memory. Each stage has a full mbarrier
//    (the producer's expect_tx arrival, then the copy counts its bytes down) and an empty one
//    (one arrival per consumer thread once it has read the stage).
//  - Whole rows, one stream at a time. A stage holds r1 = STAGE_BYTES / (H bytes) rows of one
//    half of w1 (phase 1: a chunk's gate rows, then its up rows: one contiguous stream per
//    block at a time, which read faster than two interleaved), or r2 rows of w2 (phase 2).
//    Row r of a chunk goes to warp (seq r1 + r) % CONSUMER_WARPS, its gate row and its up row
//    alike, so lane 0 of that warp keeps g in shared memory until u comes.
//  - Phase 1 from a counter. With the rows split evenly (rung 1), the blocks of one launch
//    ended phase 1 up to 25 us apart (Mixtral-8x7B, 144-169 us, per-block %globaltimer): SMs
//    do not all read HBM equally fast, and the grid barrier waits for the slowest. Here the
//    producers take chunks of r1 rows (one slot, gate then up) from a launch-wide counter
//    (atomicAdd), so a block that reads faster takes more. The counter is the stream's word
//    next to the grid barrier's: block 0 returns it to 0 once past the barrier, when every
//    producer has taken its last number.
//  - Phase 2 behind the barrier, not after it. Its weights do not depend on phase 1: the
//    producer puts them in the ring as soon as its phase-1 chunks are done, so the consumers
//    find stages full when they come out of the barrier. (Taking phase 2 from the counter
//    too measured slower: small chunks, many stages.)
//  - Descriptors. The consumers learn what a stage holds from a descriptor (Desc) that comes
//    the way the stage's weights come: the producer writes it to its block's slot in global
//    scratch (after c2), then a 32-byte bulk copy puts it next to the stage, counted down on
//    the stage's full mbarrier with the weights. One wait makes both visible, and every
//    shared-memory write of the ring is the copy engine's. (A plain shared store before the
//    arrival is ordered too, by the arrival's release, but compute-sanitizer's racecheck does
//    not see that order; st.async, the store made for this, needs a cluster of 2+ blocks.)
//
// Measured on an H100 SXM (graph replays, L2 flushed, new routing each rep, beside rung 1 in
// one process): Mixtral-8x7B 254 -> 245-246 us, DeepSeek-V3 256-257 -> 244-246 us, and
// Qwen3-30B-A3B 40 -> 43-44 us (75 MB: too little per block for the ring's fixed costs).
// experts_decode.py takes this rung where a block has at least MIN_BLOCK_BYTES of weights.
//
// Launch geometry (experts_decode.py): one block per SM (G = #SMs), 32 (CONSUMER_WARPS + 1)
//   threads, cooperative. Phase 1: chunks of r1 rows j of one slot, taken from the counter
//   (P cdiv(I, r1) of them); phase 2: block b owns rows [b H / G, (b + 1) H / G) of out and
//   puts, for each live slot, r2 = STAGE_BYTES / I rows of w2[e] a stage; the warps take
//   rows in turn; lane 0 of a row's warp writes its c3, the block's c3 [rows, P] is summed
//   after the last stage (the combine, all K slots in order).
//   shared memory (experts_decode.shared_bytes_ring): the ring RING x STAGE_BYTES, c2 [P, I]
//   (staged after the barrier), ids [P], weights [P], c3 [rows, P] and g [RING, r1] in fp32,
//   a descriptor and two mbarriers a stage.
//
// Requirements (experts_decode.py checks them): sm_90 (bulk copies); H % 8 == 0, I % 8 == 0,
//   H and I rows that fit a stage; x, w1, w2, c2 16-byte aligned; __half or __nv_bfloat16; no
//   expert map, no biases. Compile-time parameters: SCALAR_T, CONSUMER_WARPS, RING,
//   STAGE_BYTES; template ACT (0 silu, 1 gelu, 2 gelu_tanh).

// to_f32, from_f32, Pack, act<ACT>, round_to<T>
#include "elementwise.cuh"
// grid_arrive_and_wait
#include "grid_barrier.cuh"
#ifndef GG_HOST_EMULATION   // (tests/emulator/kernels.h has the CPU's versions of these)
// gg_mbar_init, gg_fence_mbar_init, gg_mbar_arrive, gg_mbar_arrive_expect_tx, gg_mbar_wait
#include "mbarrier.cuh"
#endif

#ifndef SCALAR_T
#define SCALAR_T __nv_bfloat16
#endif
#ifndef CONSUMER_WARPS
#define CONSUMER_WARPS 8
#endif
#ifndef RING
#define RING 4
#endif
#ifndef STAGE_BYTES
#define STAGE_BYTES 32768
#endif
#define CONSUMERS (CONSUMER_WARPS * 32)
#define DEC_THREADS (CONSUMERS + 32)                // + the producer warp
#define RING_BYTES (RING * STAGE_BYTES)

// dot8, warp_sum, combine_rows (one order of sums for both rungs)
#include "decode_dot.cuh"

static_assert(STAGE_BYTES % 128 == 0, "decode: stages of whole 128-byte lines");
static_assert(RING >= 2, "decode: a ring of at least 2 stages (one read, one in flight)");

// ---------------------------------------------------------------- the ring (PTX ISA 8.0, sm_90)
#ifndef GG_HOST_EMULATION
// `bytes` (a multiple of 16) from global src to shared dst by the copy engine, counted down
// on bar
__device__ __forceinline__ void dec_bulk_copy(unsigned dst, const void* src, unsigned bytes,
                                              unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// this thread's generic-proxy global writes before, ordered before its async-proxy (bulk copy)
// reads after
__device__ __forceinline__ void dec_fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

// named barrier `id` of `count` threads (whole warps)
__device__ __forceinline__ void dec_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}
#endif  // GG_HOST_EMULATION

// the consumer warps only (named barrier 1): the producer warp never waits with them
__device__ __forceinline__ void consumers_sync() { dec_bar_sync(1, CONSUMERS); }
// the grid barrier among the consumer warps: the producer warp keeps streaming phase-2
// weights into the ring meanwhile
__device__ __forceinline__ void consumers_grid_barrier(unsigned int* bar) {
    consumers_sync();
    if (threadIdx.x == 0) grid_arrive_and_wait(bar);
    consumers_sync();
}

// What a stage holds: written by the producer to global scratch, brought next to the stage by
// a bulk copy counted on the stage's full mbarrier, read by the consumers after their wait.
//   kind 1: `rows` gate rows (up 0) or up rows (up 1) of slot s from row0, phase-1 chunk
//           number `seq` of this block (row r's warp: (seq r1 + r) % CONSUMER_WARPS);
//   kind 2: `rows` rows h of w2[e] from row0 for slot s (row r's warp: (seq + r) % ...);
//   kind 0: no data: the end of phase 1 (then of phase 2).
struct __align__(16) Desc {
    int kind, s, row0, rows, seq, up, pad0, pad1;     // 32 bytes: bulk copies move 16-byte units
};

// A stage's descriptor in every lane of a consumer warp: lane 0 reads it (after its own wait
// on the stage), the others take it from lane 0 (one shared-memory read a warp).
__device__ __forceinline__ Desc read_desc(const Desc* p, int lane) {
    int v[6] = {0, 0, 0, 0, 0, 0};
    if (lane == 0) {
        v[0] = p->kind;
        v[1] = p->s;
        v[2] = p->row0;
        v[3] = p->rows;
        v[4] = p->seq;
        v[5] = p->up;
    }
#pragma unroll
    for (int i = 0; i < 6; ++i) v[i] = __shfl_sync(0xffffffffu, v[i], 0);
    return Desc{v[0], v[1], v[2], v[3], v[4], v[5]};
}

template <int ACT>
__global__ void __launch_bounds__(DEC_THREADS, 1)
moe_decode_ring_kernel(const SCALAR_T* __restrict__ x,   // [T, H]
                  const SCALAR_T* __restrict__ w1,       // [E, 2I, H]
                  const SCALAR_T* __restrict__ w2,       // [E, H, I]
                  const float* __restrict__ topk_weights,  // [T, K]
                  const int* __restrict__ topk_ids,      // [T, K]
                  SCALAR_T* c2,                          // [P, I] scratch (written, then read),
                                                         // then G x RING descriptors
                  SCALAR_T* __restrict__ out,            // [T, H]
                  unsigned int* bar,                     // the grid barrier's word
                  unsigned int* chunks,                  // phase 1's chunk counter (0 at entry)
                  int T, int K, int E, int H, int I) {
    extern __shared__ __align__(128) unsigned char dec_smem[];
    const int P = T * K;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int G = gridDim.x, b = blockIdx.x;
    const int h0 = (int)((long long)H * b / G), h1 = (int)((long long)H * (b + 1) / G);
    const int rows = h1 - h0;
    const int r1 = max(1, STAGE_BYTES / (H * (int)sizeof(SCALAR_T)));   // rows of w1 a stage
    const int r2 = max(1, STAGE_BYTES / (I * (int)sizeof(SCALAR_T)));   // rows of w2 a stage
    // [ring][c2 P x I][ids P][weights P][c3 rows x P][g RING x r1][descs RING][full][empty]
    SCALAR_T* c2_s = reinterpret_cast<SCALAR_T*>(dec_smem + RING_BYTES);
    int* ids_s = reinterpret_cast<int*>(c2_s + (size_t)P * I);
    float* tw_s = reinterpret_cast<float*>(ids_s + P);
    float* c3_s = tw_s + P;
    float* g_s = c3_s + rows * P;             // a chunk's gate dot products, RING chunks kept
    Desc* desc = reinterpret_cast<Desc*>(                // 16-byte aligned (bulk copies)
        (reinterpret_cast<size_t>(g_s + RING * r1) + 15) & ~(size_t)15);
    // this block's descriptor slots in global scratch, from the first 256 bytes after c2
    const size_t c2_bytes = ((size_t)P * I * sizeof(SCALAR_T) + 255) & ~(size_t)255;
    Desc* desc_g = reinterpret_cast<Desc*>(reinterpret_cast<unsigned char*>(c2) + c2_bytes) +
                   (size_t)b * RING;
    const unsigned smem0 = (unsigned)__cvta_generic_to_shared(dec_smem);
    const unsigned full_bar =
        (smem0 + (unsigned)((unsigned char*)(desc + RING) - dec_smem) + 7u) & ~7u;
    const unsigned empty_bar = full_bar + 8 * RING;

    for (int s = tid; s < P; s += DEC_THREADS) {
        ids_s[s] = topk_ids[s];
        tw_s[s] = topk_weights[s];
    }
    for (int q = tid; q < rows * P; q += DEC_THREADS) c3_s[q] = 0.0f;     // dead slots add 0
    if (tid == 0) {
        for (int st = 0; st < RING; ++st) {
            gg_mbar_init(full_bar + 8 * st, 1);                 // the producer's arrival
            gg_mbar_init(empty_bar + 8 * st, CONSUMERS);        // every consumer thread
        }
        gg_fence_mbar_init();
    }
    __syncthreads();                          // the last barrier of all DEC_THREADS threads

    if (warp == CONSUMER_WARPS) {
        // ============================================================ the producer warp
        if (lane != 0) return;
        int stage = 0;
        unsigned parity = 0;
        // the next stage: free once every consumer thread has released its last round
        auto put = [&](const Desc& d, const SCALAR_T* src, unsigned bytes) {
            gg_mbar_wait(empty_bar + 8 * stage, parity ^ 1u);    // the first round passes at once
            // the slot's last copy is done: its consumers waited for it before they released
            desc_g[stage] = d;
            dec_fence_proxy_async_global();   // the generic store, seen by the copy engine
            const unsigned fb = full_bar + 8 * stage;
            gg_mbar_arrive_expect_tx(fb, bytes + (unsigned)sizeof(Desc));
            dec_bulk_copy(smem0 + (unsigned)((unsigned char*)(desc + stage) - dec_smem),
                          desc_g + stage, (unsigned)sizeof(Desc), fb);
            if (bytes) dec_bulk_copy(smem0 + stage * STAGE_BYTES, src, bytes, fb);
            if (++stage == RING) {
                stage = 0;
                parity ^= 1u;
            }
        };
        // phase 1: chunks of r1 rows of one slot taken from the launch's counter, so a block
        // that streams faster takes more of them; a chunk is its gate rows, then its up rows
        const int per_slot = (I + r1 - 1) / r1;
        const unsigned n_chunks = (unsigned)(P * per_slot);
        int seq = 0;
        for (unsigned c = atomicAdd(chunks, 1u); c < n_chunks; c = atomicAdd(chunks, 1u)) {
            const int s = (int)(c / per_slot), j = (int)(c % per_slot) * r1;
            const int e = ids_s[s];
            if (e < 0 || e >= E) continue;                     // a dead slot: nothing to do
            const int n = min(r1, I - j);
            const SCALAR_T* gate = w1 + ((long long)e * 2 * I + j) * H;
            const unsigned bytes = (unsigned)(n * H * sizeof(SCALAR_T));
            put(Desc{1, s, j, n, seq, 0}, gate, bytes);
            put(Desc{1, s, j, n, seq, 1}, gate + (long long)I * H, bytes);
            ++seq;
        }
        put(Desc{0, 0, 0, 0, 0, 0}, nullptr, 0);
        // phase 2 (its weights do not wait for the grid barrier): the block's rows h of w2[e]
        // for each live slot, r2 a stage
        int first = 0;
        for (int s = 0; s < P; ++s) {
            const int e = ids_s[s];
            if (e < 0 || e >= E) continue;
            for (int h = h0; h < h1; h += r2) {
                const int n = min(r2, h1 - h);
                put(Desc{2, s, h, n, first, 0}, w2 + ((long long)e * H + h) * I,
                    (unsigned)(n * I * sizeof(SCALAR_T)));
                first += n;
            }
        }
        put(Desc{0, 0, 0, 0, 0, 0}, nullptr, 0);
        return;
    }

    // ================================================================ the consumer warps
    int stage = 0;
    unsigned parity = 0;
    // this thread is done with the stage. Every reader arrives for itself: a warp's lanes
    // behind __syncwarp and one arrival are ordered as well in the PTX memory model, but
    // racecheck credits an arrival with its own thread's reads only (it reported each lane's
    // reads against the next bulk copy into the stage)
    auto release = [&]() {
        gg_mbar_arrive(empty_bar + 8 * stage);
        if (++stage == RING) {
            stage = 0;
            parity ^= 1u;
        }
    };
    // the next stage's descriptor once the stage has landed; false at a phase's end marker
    // (that stage released)
    auto take = [&](Desc& d) {
        gg_mbar_wait(full_bar + 8 * stage, parity);
        d = read_desc(desc + stage, lane);
        if (d.kind != 0) return true;
        release();
        return false;
    };
    // phase 1: GEMM1 + activation. Lane 0 of a row's warp keeps g in g_s from the chunk's
    // gate stage to its up stage (a chunk's buffer is reused RING chunks later, when every
    // warp has released that chunk's up stage: the ring cannot hold both).
    for (Desc d; take(d);) {
        const uint4* wv = reinterpret_cast<const uint4*>(dec_smem + stage * STAGE_BYTES);
        const uint4* xr = reinterpret_cast<const uint4*>(x + (long long)(d.s / K) * H);
        float* g_chunk = g_s + (d.seq % RING) * r1;
        for (int r = (warp - (d.seq * r1) % CONSUMER_WARPS + CONSUMER_WARPS) % CONSUMER_WARPS;
             r < d.rows; r += CONSUMER_WARPS) {
            float v = 0.0f;
            for (int c = lane; c < H / 8; c += 32)
                v = dot8(v, wv[r * (H / 8) + c], __ldg(xr + c));
            v = warp_sum(v);
            if (lane == 0) {
                if (d.up == 0)
                    g_chunk[r] = v;
                else
                    from_f32(round_to<SCALAR_T>(act<ACT>(round_to<SCALAR_T>(g_chunk[r]))) *
                                 round_to<SCALAR_T>(v),
                             &c2[(long long)d.s * I + d.row0 + r]);
            }
        }
        release();
    }
    consumers_grid_barrier(bar);
    if (b == 0 && tid == 0) *chunks = 0u;     // every block's producer has taken its last chunk

    // phase 2: GEMM2 + router weight + combine. c2 into shared memory first, through L2
    // (.cg: written by other blocks in this launch).
    {
        const uint4* src = reinterpret_cast<const uint4*>(c2);
        uint4* dst = reinterpret_cast<uint4*>(c2_s);
        for (int c = tid; c < P * (I / 8); c += CONSUMERS) dst[c] = __ldcg(src + c);
    }
    consumers_sync();
    for (Desc d; take(d);) {
        const uint4* wv = reinterpret_cast<const uint4*>(dec_smem + stage * STAGE_BYTES);
        const uint4* cv = reinterpret_cast<const uint4*>(c2_s + (long long)d.s * I);
        for (int r = (warp - d.seq % CONSUMER_WARPS + CONSUMER_WARPS) % CONSUMER_WARPS;
             r < d.rows; r += CONSUMER_WARPS) {
            float acc = 0.0f;
            for (int c = lane; c < I / 8; c += 32) acc = dot8(acc, wv[r * (I / 8) + c], cv[c]);
            acc = warp_sum(acc);
            // GEMM2's epilogue: (acc + bias 0) * weight, rounded once
            if (lane == 0)
                c3_s[(d.row0 + r - h0) * P + d.s] =
                    round_to<SCALAR_T>((acc + 0.0f) * tw_s[d.s]);
        }
        release();
    }
    consumers_sync();
    // the combine: each token's K slots in order
    combine_rows(c3_s, out, h0, rows, T, K, H, tid, CONSUMERS);
}
