// wna16_v5_staged.cu: rung 5 of the weight-only grouped GEMM, int4 at 8-128 rows per expert,
// with the CTA's weights AND activations staged together through one shared-memory cp.async
// pipeline, and each CTA's work a contiguous run of (row block, K stage) units.
//
//   c[s, n] = (sum_k a[s / top_k, k] (q[e, n, k] - zp[e, n, k / gs]) s[e, n, k / gs] + bias[e, n])
//             * r[s]      (the same contract as wna16_v1_naive.cu; weights prepacked by
//                          quant/wna16_packed.py's prepack_int4, then laid out by stage_blocks)
//
// The lesson, in three parts (docs/int4_staged.md walks them with their measurements): stage
// what many weight rows share (the activations) once per CTA in shared memory, beside the
// weights, through one cp.async pipeline; give every CTA of one wave a run of equal cost
// (stream-K); and, on Hopper, split the CTA into producer and consumer warps (WS: mbarriers
// and setmaxnreg). The router's rung for 9-128 rows per expert (configs t24ws on sm_90, t24,
// t32).
//
// Why (H200, Mixtral int4 at T = 64, as every measurement below): wna16_v4_packed reads
// the activations through L1 once per 32 weight rows, so GEMM1 moved 1.56 GB through L2 for
// 0.50 GB of weights, and its warps waited on those loads. Here a CTA owns NB = W TPW 16-row
// tiles (256 rows at W = 4, TPW = 4): each 16-byte activation copied into shared memory feeds
// 16 NB weight rows, and nothing in the main loop waits on global memory but the pipeline.
//
// Layout of the work. Units u = b SPB + s of an m tile: row block b (NB tiles), K stage s (KC
// 64-code chunks; SPB = cdiv(C, KC) stages per block, C = Kdim / 64). Every live m tile has
// U = blocks SPB units, each costing LT + 5 (LT: its live token tiles; a stage's instructions
// grow about so with them). The Q CTAs (one wave: MINB per SM) take contiguous runs of equal
// cost [q Wt / Q, (q + 1) Wt / Q) of all m tiles' units in order (Wt: the total cost), each m
// tile's part of a run a segment of its own (the stream-K idea: no wave is left part full, the
// m tiles of 3 live token tiles do not finish last, and a segment's pipeline runs across block
// boundaries without draining). A CTA that covers a whole block stores it; a block shared by
// several CTAs (runs that start or end inside it) is finished by the CTA whose units complete
// it, which adds every part in the order of their first K stages (deterministic; finish_parts
// below). Workspace: ws [Q][2][NT TPW MT 4] fp32 (a run has at most two partial blocks, its
// first and its last), and the ints units_done [m tiles][blocks] and part_at [m tiles][blocks]
// [SPB] (each part by its first stage; zero, and left zero). Measured (T = 64 GEMM1): with the
// same number of CTAs per m tile the SMs were busy 86% of the kernel, with runs of equal cost
// 94-97%. The part records by first stage replaced a walk over the CTAs that own a block's
// units (same runs: 179 / 99 against 181 / 103 us at T = 64; 219 registers against 235).
//
// One stage in shared memory (S stages in a ring, one __syncthreads per stage):
//   weights  [NB tiles][KC chunks][32 lanes] uint4   the packed fragments, 512 B per tile-chunk
//   scales   [KC groups][NB][8 g] float2             (s[row g], s[row g + 8]) of each group met
//   zps      [KC groups][NB][8] u16                  (ZP) the same rows' zero points
//   acts     [BM rows][KC chunks][8 units] uint4     row r's 16-byte unit j at j ^ (r & 1):
//            lane (g, t) reads units 2t, 2t + 1 of its row g: without the swizzle rows g and
//            g + 1 would share banks; with it the 8 lanes of a phase hit 8 distinct 16-byte
//            banks, and each copy stays inside its 128-byte line (see wna16_common.cuh: a
//            destination off its source's line costs twice the L2 requests)
// The weights come in stage_blocks' layout (quant/wna16_staged.py): a stage's codes (NB KC 512
// bytes), scales and zero points are one contiguous run each, zero-padded past the weights, so
// thread tid copies 16-byte units tid, tid + NT, ... of each run with no bounds to check and
// constant offsets. Only the live token tiles' rows are copied (padding rows inside them copy a
// live row; rows past them are never read). Measured (T = 64, Nsight Compute source counters): 1D
// bulk copies (TMA) with an mbarrier per slot executed as many instructions as cp.async with
// per-thread address arithmetic and ran slower (243 / 135 against 217 / 121 us): one lane per warp
// issuing the row copies serialises them.
//
// Warp w owns tiles w TPW .. + TPW - 1 of the block and all LT live token tiles: per chunk it reads
// each token's 32 bytes once (2 LDS.128 per token tile) and feeds them to TPW tiles. The mma is
// m16n8k16 with the weights as A (rows g, g + 8), the tokens as B (column g). Dequantization: one
// shift and one lop3 per pair give the raw 128 + q (1024 + q in fp16), which the mma multiplies as
// they are; the zero point comes off as a start -(128 + zp) S added to each chain of mma after it
// (not its first C: the chains then wait on nothing but their operands), S = the token's sum over
// the chunks of one scale group met in the stage, computed by the tensor cores too: 2 mma per token
// tile and chunk with the token's 16-byte units as A and B = 1, then two shuffles put each token's
// S where the mma's C holds the token (these mma cost little: with the sums read for free the layer
// at T = 64 took 255 against 258-260 us). Without per-group zero points (ZP = 0) the start is one
// per token tile, shared by the warp's TPW tiles; with them, an fmul per row and token (before: 4
// mma per token tile and chunk with A = -(128 + zp), per tile with zero points; with zero points T
// = 64 went from 248 / 140 to 195 / 115 us). The fp32 partial sum_k (q - zp) a is then scaled by
// the group's scale into the accumulators: once per stage when its KC chunks share a group (g128
// and wider at KC = 2: each mma chain runs over both chunks), else once per chunk. Why: a
// subtraction per pair (16 hsub2 per tile and chunk) cost more than these mma, and a chunk-sum
// kernel before the GEMM cost a launch (as wna16_v4_packed once did; measured slower here, 262 /
// 142 against 247 / 132 us at T = 64); one scaling per stage instead of per chunk took T = 64 from
// 196 / 114 to 188 / 110 us. Exactness: products of 8-bit integers and bf16 are exact in fp32; what
// is left is the fp32 cancellation of sum (128 + q) a against (128 + zp) S (~2^-23 times ~30
// relative).
// Measured and taken out (T = 64 t24, against 197 / 115 us in the same runs): the sums S made
// once per CTA, a stage ahead, instead of by every warp (212 / 122: one stage less in flight);
// the codes prefetched into L2 2 or 4 stages past the ring (207 / 122, 210 / 130); one chunk
// per stage with 9 stages (211 / 121); one CTA of 8 warps x 4 tiles with 5 stages (207 / 122);
// Hopper's wgmma with the staged codes as register A and the tokens as B, a fifth wgmma for S
// (224 / 126: ~12% more instructions, the scaling per chunk no longer folded into the mma's C,
// and the batch waited for per chunk).
//
// Where the time goes (T = 64 GEMM1 t24, builds that leave parts of the work out): 183 us
// whole, 142 without the math (the pipeline streaming alone; a plain read of the same 470 MB
// takes 118), 163 without the weight copies (the math alone: mma.sync at ~36% of the 650
// TFLOP/s it reaches on its own), and the CTAs' equal-cost runs end anywhere from 145 to 180
// us. The kernel runs power-capped (the SM clock read per CTA): the SMs clock at 1675-1730 MHz
// under it against 1980 with the GPU idle, and at 1943-1965 MHz with the math left out, so the
// math's energy, not only its issue slots, sets the pace.
//
// WS > 0, the warp-specialized CTA (config t24ws: W = 8, one CTA per SM): the W consumer warps
// only compute, and a warpgroup of 128 producers, at WS registers each (setmaxnreg; the
// consumers get the rest, 224 at W = 8), issues every copy of the ring as the 128 threads of a
// plain CTA would. Each slot goes round by two mbarriers: full (each producer's copies of the
// slot have landed: cp.async.mbarrier.arrive) and empty (each consumer warp is done reading
// it), so no barrier holds all the CTA's warps at each stage, and the consumers' instruction
// stream holds no copies. Both roles walk the same segments and meet only at load_m_tile and
// at each segment's end, where the ring drains and its barriers start again; the parts' and
// stores' barriers are the consumers' own (named barrier 1). Measured (in one run): T = 64 /
// 256 layer 256 / 721 us against t24's 259 / 754; with 4 consumer warps in 2 CTAs per SM it
// was no faster than t24 (GEMM1 the same, GEMM2 1-4 us slower), and 8 warps of one plain CTA
// 8-16% slower.
//
// grid (Q), block 32 W (+ 128 with WS), dynamic shared memory S x stage bytes
// (staged_stage_bytes in the launcher) + 16 S (WS: the mbarriers) + 8 (m tiles + 1) (the costs'
// prefix sums) + 4 SPB (finish_parts) + 4 m tiles (their experts). LT is a compile-time
// constant of the code that runs (w16::with_count), as in wna16_v4_packed.
// Needs int4 prepacked and staged (N % 16 == 0, Kdim % 64 == 0, group_size 64 times a power of
// two or one group per row: chunk_shift = log2(chunks per group), 30 for one group).
// Run: python -m cuda_kernels.cupy.quant.wna16 [--quick]
#include "wna16_common.cuh"

// Bytes of one pipeline stage (each part rounded to 128 bytes), as the launcher computes them.
template <int MT, int NB, int KC, int ZP>
struct StagedStage {
    __host__ __device__ static constexpr int round(int x) { return (x + 127) / 128 * 128; }
    static constexpr int W_OFF = 0;
    static constexpr int S_OFF = W_OFF + round(NB * KC * 512);
    static constexpr int Z_OFF = S_OFF + round(NB * KC * 64);
    static constexpr int A_OFF = Z_OFF + (ZP ? round(NB * KC * 16) : 0);
    static constexpr int BYTES = A_OFF + round(8 * MT * KC * 128);
};

// The warp-specialized CTA's primitives (WS > 0, see the header): the ring's mbarriers,
// setmaxnreg (PTX ISA 8.0, sm_90a; the pattern of CUTLASS's cp.async warp-specialized
// mainloops). The CPU emulation (QG_EMULATED_PTX, tests/emulator) has stand-ins
// with the same semantics: a slot's copies land at its producer's arrival, the latest moment
// the hardware allows.
namespace staged_ws {
#ifndef QG_EMULATED_PTX
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
#endif
__device__ __forceinline__ void bar_init(unsigned long long* b, unsigned count) {
#ifdef QG_EMULATED_PTX
    qg_mbar_init(b, count);
#else
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_u32(b)), "r"(count)
                 : "memory");
#endif
}
// one of the barrier's arrivals, made when every cp.async this thread issued before has landed
__device__ __forceinline__ void arrive_on_copies(unsigned long long* b) {
#ifdef QG_EMULATED_PTX
    qg_mbar_arrive_on_copies(b);
#else
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(smem_u32(b))
                 : "memory");
#endif
}
__device__ __forceinline__ void arrive(unsigned long long* b) {
#ifdef QG_EMULATED_PTX
    qg_mbar_arrive(b);
#else
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_u32(b)) : "memory");
#endif
}
// until the barrier's phase of this parity has completed
__device__ __forceinline__ void wait(unsigned long long* b, unsigned parity) {
#ifdef QG_EMULATED_PTX
    qg_mbar_wait(b, parity);
#else
    unsigned done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n"
                     " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(smem_u32(b)), "r"(parity) : "memory");
#endif
}
// the warp's registers, down or up to R (every warp of a warpgroup alike)
template <int R>
__device__ __forceinline__ void regs_down() {
#ifndef QG_EMULATED_PTX
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(R));
#endif
}
template <int R>
__device__ __forceinline__ void regs_up() {
#ifndef QG_EMULATED_PTX
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(R));
#endif
}
}  // namespace staged_ws

// A barrier of the TEAM first threads of the CTA (named barrier 1), or of all (TEAM = 0)
template <int TEAM>
__device__ __forceinline__ void team_sync() {
    if constexpr (TEAM == 0) {
        __syncthreads();
    } else {
#ifdef QG_EMULATED_PTX
        qg_bar_team(TEAM);
#else
        asm volatile("bar.sync 1, %0;\n" :: "n"(TEAM) : "memory");
#endif
    }
}

// A block's part: this CTA's walk computed `count` of its SPB K stages from stage `first` (the N
// fp32 values v of each of the NT threads). It goes to workspace slot `slot` (ws [slot][per],
// v[j] at j NT + thread), and part_at[tile][first] = count << 16 | slot + 1 says so; the CTA
// whose units complete the block's SPB (units_done[tile]) gets true back, with v = the parts
// added in the order of their first stages (deterministic for a given split), and leaves both
// at zero; the others get false. Every thread of the team calls it (the CTA's NT first threads,
// which are all of it unless TEAM = NT: WS's consumers); s_last is a __shared__ int.
template <int N, int NT, int TEAM = 0>
__device__ __forceinline__ bool finish_parts(float* v, float* __restrict__ ws,
                                             int* __restrict__ units_done,
                                             int* __restrict__ part_at, int* by_first, int SPB,
                                             size_t tile, int per, int slot, int first,
                                             int count, int& s_last) {
    const int tid = threadIdx.x;
    int* at = part_at + tile * SPB;
#pragma unroll
    for (int j = 0; j < N; ++j) __stcg(ws + (size_t)slot * per + tid + j * NT, v[j]);
    if (tid == 0) __stcg(at + first, count << 16 | (slot + 1));
    __threadfence();
    team_sync<TEAM>();
    if (tid == 0) s_last = atomicAdd(units_done + tile, count) + count == SPB;
    team_sync<TEAM>();
    if (!s_last) return false;
    __threadfence();
    for (int x = tid; x < SPB; x += NT) {              // one load per stage, then shared memory
        by_first[x] = __ldcg(at + x);
        at[x] = 0;
    }
    if (tid == 0) units_done[tile] = 0;
    team_sync<TEAM>();
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = 0.f;
    for (int x = 0; x < SPB;) {                        // the parts tile [0, SPB) in order
        const int p = by_first[x];
        if (p == 0) break;                             // (cannot happen: every unit is done)
        const float* part = ws + (size_t)((p & 0xFFFF) - 1) * per + tid;
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] += __ldcg(part + j * NT);
        x += p >> 16;
    }
    return true;
}

template <int MT, int W, int TPW, int KC, int S, int ZP, int MINB, int WS = 0>
__global__ void __launch_bounds__(W * 32 + (WS ? 128 : 0), MINB)
wna16_v5_staged(const unsigned short* __restrict__ a, const uint4* __restrict__ wp,
                elem_t* __restrict__ c, const float2* __restrict__ sp,
                const unsigned short* __restrict__ zp,
                const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                const int* __restrict__ num_tokens_post_padded,
                const float* __restrict__ topk_weights, const float* __restrict__ bias,
                float* __restrict__ ws, int* __restrict__ counters,
                int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,
                int mul_routed_weight, int chunk_shift, int num_groups, int default_zp) {
    constexpr int BM = 8 * MT, NT = 32 * W, NB = W * TPW;
    // WS: the NT consumer threads (whole warpgroups, for setmaxnreg), then a warpgroup of
    // producers; NC threads copy a stage (thread ctid of NC)
    constexpr int NTT = NT + (WS ? 128 : 0), NC = WS ? 128 : NT;
    static_assert(!WS || W % 4 == 0, "WS: consumer warpgroups of 4 warps");
    // the registers each role keeps of the CTA's NTT x (65536 / MINB / NTT): producers WS,
    // consumers the rest (W = 8, MINB = 1, WS = 56: 224; W = 4, MINB = 2, WS = 40: 216)
    constexpr int WS_CREGS =
        WS ? ((65536 / MINB / NTT / 8 * 8) * NTT - 128 * WS) / NT / 8 * 8 : 0;
    static_assert(!WS || (WS >= 24 && WS % 8 == 0 && WS_CREGS <= 256),
                  "WS: setmaxnreg counts are multiples of 8 in [24, 256]");
    using St = StagedStage<MT, NB, KC, ZP>;
    __shared__ int sSlot[BM];                     // slot s, or -1 (padding)
    __shared__ int sArow[BM];                     // its row of a, or -1
    __shared__ int sLast;
    __shared__ uint2 sSumB[2];                    // the tokens' sums mma: B of even, odd columns
    extern __shared__ __align__(128) u8 smem[];   // 128: see wna16_common.cuh

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int ctid = WS ? tid - NT : tid;            // a copying thread's index (WS: producers)
    const int ntiles = N >> 4, C = Kdim >> 6;
    const int SPB = (C + KC - 1) / KC, nblocks = (ntiles + NB - 1) / NB, U = nblocks * SPB;
    const int mtiles = (num_positions + BM - 1) / BM;
    const int Q = gridDim.x, q = blockIdx.x;
    // The codes the mma reads: bf16 128 + q (one per half-word); fp16 1024 + q for even pairs,
    // 64 + q for odd ones (w16::raw_pairs_f16: a third of the shifts)
    constexpr bool F16 = !ELEM_BF16;
    constexpr float OFF_EVEN = F16 ? 1024.f : 128.f, OFF_ODD = F16 ? 64.f : 128.f;
    // B of the tokens' sums mma: column n of lane g = n, even columns -(OFF_EVEN + zo), odd ones
    // -(OFF_ODD + zo), zo = the default zero point without per-group ones (ZP = 0), else 0
    // (exact in both formats: integers below 2^8 in bf16, 2^11 in fp16). Read back from shared
    // memory per stage: ptxas sees copies of one value as one register and rebuilds an mma's
    // operand registers with moves at each use (16 moves a stage for an A quad held in
    // registers, SASS of cfad067); a load it cannot see through
    if (tid < 2) {                                 // (read after the barriers below)
        const float zo = ZP ? 0.f : (float)default_zp;
        const u32 b = w16::pair_of<F16>(-((tid ? OFF_ODD : OFF_EVEN) + zo));
        sSumB[tid] = make_uint2(b, b);
    }

    // ---- the m tiles' costs: U units each, weighted by LT + 5 (the instructions of a stage
    // grow about so with the live token tiles: ~430, ~500, ~575 SASS instructions per warp at
    // LT = 1, 2, 3, g128, 0e53f21), 0 for an m tile without live rows or of another rank's
    // expert; cum[m] = the weighted position where m tile m starts, cum[mtiles] = the total.
    // Every CTA computes the same (a few hundred loads).
    // (WS: the ring's mbarriers first, full[S] then empty[S])
    u8* const after_ring = smem + (size_t)S * St::BYTES;
    unsigned long long* bar_full = reinterpret_cast<unsigned long long*>(after_ring);
    unsigned long long* bar_empty = bar_full + S;
    long long* cum = reinterpret_cast<long long*>(after_ring + (WS ? 16 * S : 0));
    int* by_first = reinterpret_cast<int*>(cum + mtiles + 1);   // [SPB] (finish_parts)
    int* m_expert = by_first + SPB;                               // [m tiles] their experts
    const int ntp = num_tokens_post_padded[0];
    for (int m = tid; m < mtiles; m += NTT) {
        int lt = 0;                                    // 1 + the last live row's tile
        if (m * BM < ntp) {
#pragma unroll
            for (int r = 0; r < BM; ++r) {             // independent loads, in flight together
                const int p = m * BM + r;
                const int sl = p < num_positions ? sorted_token_ids[p] : -1;
                if (sl >= 0 && sl < num_slots) lt = r / 8 + 1;
            }
        }
        // the m tile's expert, loaded beside its rows (not after them: one round trip less)
        const int ex = m * BM < ntp ? expert_ids[m * BM / block_size] : -1;
        m_expert[m] = ex;
        cum[m + 1] = lt && ex >= 0 ? (long long)U * (lt + 5) : 0;
    }
    __syncthreads();
    if (tid == 0) {
        cum[0] = 0;
        for (int m = 0; m < mtiles; ++m) cum[m + 1] += cum[m];
    }
    auto init_ring_barriers = [&] {                    // (WS) every slot's phases from 0
        if (WS && tid == 0)
            for (int i = 0; i < S; ++i) {
                staged_ws::bar_init(bar_full + i, 128);   // each producer's copies
                staged_ws::bar_init(bar_empty + i, W);    // each consumer warp
            }
    };
    init_ring_barriers();
    __syncthreads();
    const long long Wt = cum[mtiles];
    // CTA q's run: weighted positions [run_start(q), run_start(q + 1)), fixed before the launch.
    // Measured (T = 64 GEMM1, each CTA's end read): the runs end anywhere from 145 to 180 us
    // (the SMs do not stream at one speed, and of an SM's two CTAs the older runs 9-13% faster a
    // unit). Every dynamic balance tried ran slower:
    // tickets from a queue (208 / 137 against 194 / 116 us), runs stolen from their ends by
    // early CTAs (233 / 132 against 197 / 108: a thief starts ~25 us late, each step a loaded
    // round trip), and runs shared from both ends by two CTAs (of one SM or not), even when
    // split in fixed halves with no atomics (193 / 108 against 183 / 103): a run per CTA,
    // walked in one direction, streams faster. Static skews are slower too: the first half's
    // runs 1.5 / 3 / 5% longer took the layer from 262 to 268 / 269-270 / 280-284 us
    // (the halves are not the SMs' first and second CTAs). With the roles
    // read from the GPU, 3% gained ~1% of the layer, and a run's tail left to whichever of two
    // CTAs came first cost ~10 us a CTA in ring restarts: the last CTA
    // is on a slow SM, and the SMs' speeds do not repeat from launch to launch.
    auto run_start = [&](long long qq) { return qq * Wt / Q; };

    // Programmatic dependent launch (grouped_gemm_wna16(..., programmatic=True)): this grid
    // may start while the kernel before it on the stream still runs, and that kernel may only
    // have written a (the activations). So everything up to the run's first weight copies
    // reads only what was final before it (routing, weights), nothing is written to global
    // memory, and the CTA calls wait_for_inputs before its first read of a or write of any
    // output (an other rank's zeros, or its first segment's activation copies); that also lets
    // the next grid launch (its CTAs take the SMs this grid's CTAs leave). In a plain launch
    // both instructions are no-ops. Measured (Mixtral T = 64, GEMM2 so after GEMM1): the layer
    // 0.271 against 0.276 ms.
    bool inputs_ready = false;
    auto wait_for_inputs = [&] {
        if (inputs_ready) return;
        w16::grid_dependency_wait();
        w16::launch_dependents();
        inputs_ready = true;
    };

    // ---- experts of another rank: zeros, m tile m by CTA m % Q
    for (int m = q; m < mtiles; m += Q) {
        if (m * BM >= ntp || m_expert[m] >= 0) continue;
        wait_for_inputs();
        if (w16::load_m_tile<BM>(m * BM, sorted_token_ids, num_tokens_post_padded, num_slots,
                                 top_k, num_positions, sSlot, sArow))
            w16::store_zeros<BM>(c, sSlot, N, 0, N, NTT);
        __syncthreads();                               // sSlot is read before it is reused
    }
    if (Wt == 0 || run_start(q) >= run_start(q + 1)) return;

    // ---- the partial blocks' records (staged_plan's COUNTERS ints, zero between launches) and
    // parts (WS floats: [Q][2 parts][PER], a run has two partial blocks at most)
    constexpr int PER = NT * TPW * MT * 4;
    int* units_done = counters;                            // [m tiles][blocks]
    int* part_at = counters + (size_t)mtiles * nblocks;    // [m tiles][blocks][SPB]
    int parts_used = 0;
    bool first_segment = true;

    // ---- the segments of the run, one m tile each: units [ua, ub) of m tile m. ROLE 0: the
    // plain CTA, every thread copying and computing; WS: 1 the producers, 2 the consumers (each
    // role walks the same segments; both meet at load_m_tile's barrier and at a segment's end).
    // (The lambda's body keeps the loop's indentation, that of the plain CTA before WS.)
    auto segments = [&](auto role) {
    constexpr int ROLE = decltype(role)::value;
    constexpr bool COPIES = ROLE != 2, MATH = ROLE != 1;
    for (int m = 0; m < mtiles; ++m) {
        // (Measured: a fixed cost per segment start, 8-32, was no faster. This form of the split,
        // the same units and bits as the one before it, ptxas schedules otherwise: the T = 64
        // layer ran 2-4 us faster, T = 256 5-6 us, t24's 1-4 us.)
        const long long span = cum[m + 1] - cum[m];
        if (span == 0 || cum[m + 1] <= run_start(q) || cum[m] >= run_start(q + 1)) continue;
        const long long w = span / U;                      // the m tile's cost per unit
        const long long u0 = cum[m];                       // where its first unit starts
        const int ua = (int)max(0LL, (run_start(q) - u0 + w - 1) / w);
        const int ub = (int)min((long long)U, (run_start(q + 1) - u0 + w - 1) / w);
        if (ua >= ub) continue;
        const int n_units = ub - ua;
        const int e = m_expert[m];
        const size_t blk_e = (size_t)e * nblocks;          // this expert's first row block
        // unit u = b SPB + s of the m tile is stage (blk_e + b) SPB + s of stage_blocks'
        // layout: its codes are one contiguous run
        const uint4* w_tile = wp + blk_e * SPB * (NB * KC * 32) + ctid;
        // the expert's scales and zero points: group gr of row block b at (b G + gr) NB 8
        const size_t sz_e = blk_e * num_groups * (NB * 8);
        constexpr int W_PER = NB * KC * 32 / NC;           // NB KC 32 units / NC threads
        static_assert(NB * KC * 32 % NC == 0, "whole weight units per copying thread");
        constexpr int S_PER = (NB * KC * 4 + NC - 1) / NC, Z_PER = (NB * KC + NC - 1) / NC;

        // ---- the weights of segment unit i = (b, s) into ring slot i % S if it is the run's
        // (live): codes, then scales and zero points of the groups met, each a contiguous run
        // of stage_blocks' layout, so thread tid copies 16-byte units tid, tid + NT, ...
        auto issue_weights = [&](int i, int b, int s, bool live) {
            if (!live) return;
            const int c0 = s * KC, kcn = min(KC, C - c0);
            const int g0 = c0 >> chunk_shift, ngr = ((c0 + kcn - 1) >> chunk_shift) - g0 + 1;
            u8* st = smem + (size_t)(i % S) * St::BYTES + 16 * ctid;
            const uint4* wsrc = w_tile + (size_t)(b * SPB + s) * (NB * KC * 32);
#pragma unroll
            for (int j = 0; j < W_PER; ++j)
                w16::cp16(st + St::W_OFF + 16 * j * NC, wsrc + j * NC, true);
            const int sz_off = (b * num_groups + g0) * (NB * 8);   // < 2^31: one expert's
            const float2* ssrc = sp + sz_e + sz_off + 2 * ctid;
#pragma unroll
            for (int j = 0; j < S_PER; ++j)
                if (ctid + j * NC < ngr * NB * 4)
                    w16::cp16(st + St::S_OFF + 16 * j * NC, ssrc + 2 * j * NC, true);
            if (ZP) {
                const unsigned short* zsrc = zp + sz_e + sz_off + 8 * ctid;
#pragma unroll
                for (int j = 0; j < Z_PER; ++j)
                    if (ctid + j * NC < ngr * NB)
                        w16::cp16(st + St::Z_OFF + 16 * j * NC, zsrc + 8 * j * NC, true);
            }
        };
        // the units (b, s) = (row block, K stage) in order, stepped without divisions
        auto step = [&](int& b, int& s) {
            if (++s == SPB) s = 0, ++b;
        };
        int ib = ua / SPB, is = ua - ib * SPB;             // the unit being issued
        const int b_first = ib, s_first = is;
        // The run's first stage: its weights go out before the m tile's rows are read (the
        // rows' round trip and the weights' overlap), its activations after, then the next
        // stages whole. Measured (Mixtral): with all S - 1 first stages'
        // weights early (the first stage's activations queued behind them) T = 256 took 531 /
        // 279 us against 520 / 274; T = 16 and 64 the same either way. (Measured and taken
        // out: the codes' copies with an L2 evict_first policy, createpolicy + cp.async
        // .L2::cache_hint: GEMM2 at T = 64 99.6 against 101.7 us, but with early copies one
        // config failed its GPU test with an illegal instruction.)
        if (COPIES && first_segment) issue_weights(0, ib, is, n_units > 0);
        w16::load_m_tile<BM>(m * BM, sorted_token_ids, num_tokens_post_padded, num_slots, top_k,
                             num_positions, sSlot, sArow);   // live: its cost is not 0

        // the live token tiles (an expert's live rows are a prefix of its block), and the row of a
        // each staged row copies (padding rows inside the live tiles: a live row, never stored)
        int first = -1, live_tiles = 0;
        for (int r = BM - 1; r >= 0; --r)
            if (sArow[r] >= 0) {
                first = sArow[r];
                if (!live_tiles) live_tiles = r / 8 + 1;
            }
        const int live_rows = 8 * live_tiles;

        // ---- this thread's share of the token rows' copies, fixed for the segment: BM rows x
        // KC chunks x 8 16-byte units, unit u of row r at u ^ (r & 1)
        constexpr int A_UNITS = BM * KC * 8, A_PER = (A_UNITS + NC - 1) / NC;
        const unsigned short* a_src[A_PER];                // the unit's source in K stage 0
        bool a_on[A_PER];                                  // copied (rows past the live tiles:
        int a_dst[A_PER];                                  //   never read), to this stage offset
        int a_chunk[A_PER];                                // its chunk in the stage
#pragma unroll
        for (int j = 0; j < A_PER; ++j) {
            if (!COPIES) break;
            const int k = ctid + j * NC, r = k / (KC * 8), u = k % (KC * 8);
            a_on[j] = k < A_UNITS && r < live_rows;
            const int ar = a_on[j] ? (sArow[r] >= 0 ? sArow[r] : first) : 0;
            a_src[j] = a + (size_t)ar * Kdim + u * 8;
            a_dst[j] = St::A_OFF + 16 * (r * KC * 8 + (u ^ (r & 1)));
            a_chunk[j] = u / 8;
        }
        // ---- segment unit i = (b, s): its weights (unless issued early) and the activations
        // of its K stage (a short last stage: zeros), one commit group per call (empty past
        // the run: the wait counts stay right)
        auto issue = [&](int i, int b, int s, bool live, bool with_weights) {
            if (live) {
                if (with_weights) issue_weights(i, b, s, true);
                const int c0 = s * KC, kcn = min(KC, C - c0);
                u8* sa = smem + (size_t)(i % S) * St::BYTES;
#pragma unroll
                for (int j = 0; j < A_PER; ++j) {
                    const bool ok = a_chunk[j] < kcn;
                    w16::cp16_if(a_on[j], sa + a_dst[j], a_src[j] + (ok ? c0 * 64 : 0), ok);
                }
            }
            w16::cp_commit();
        };
        wait_for_inputs();
        const bool early = first_segment;              // stage 0's weights went out above
        first_segment = false;
        if constexpr (ROLE == 0) {
#pragma unroll
            for (int i = 0; i < S - 1; ++i) {
                issue(i, ib, is, i < n_units, !early || i > 0);
                step(ib, is);
            }
        } else if constexpr (ROLE == 1) {
            // slot i % S once the consumers have read its unit i - S, then its copies, whose
            // landing is the slot's full arrival of this thread
            for (int i = 0; i < n_units; ++i) {
                if (i >= S) staged_ws::wait(bar_empty + i % S, (i / S - 1) & 1);
                issue(i, ib, is, true, !early || i > 0);
                staged_ws::arrive_on_copies(bar_full + i % S);
                step(ib, is);
            }
        }

        if constexpr (MATH) w16::with_count<1, MT>(live_tiles, [&](auto live_count) {
            constexpr int LT = decltype(live_count)::value;
            float acc[TPW][LT][4] = {};

            // the block's outputs: c0 c1 = (row g, tokens 2t, 2t + 1), c2 c3 = (row g + 8)
            auto store = [&](int b) {
#pragma unroll
                for (int r = 0; r < TPW; ++r) {
                    const int tile = b * NB + warp * TPW + r;
                    if (tile >= ntiles) continue;
#pragma unroll
                    for (int mt = 0; mt < LT; ++mt)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int row = 8 * mt + 2 * t + (i & 1);
                            const int n = tile * 16 + g + 8 * (i >> 1);
                            const int s = sSlot[row];
                            if (s < 0) continue;
                            float v = acc[r][mt][i];
                            if (bias != nullptr) v += bias[(size_t)e * N + n];
                            if (mul_routed_weight) v *= topk_weights[s];
                            c[(size_t)s * N + n] = w16::from_f32(v);
                        }
                }
            };

            int blk_n = 0;                                 // units of the current block done
            int b = b_first, s = s_first;                  // the unit being computed
            for (int i = 0; i < n_units; ++i) {
                if constexpr (ROLE == 0) {
                    w16::cp_wait<S - 2>();                 // stage i has landed (this thread's)
                    __syncthreads();                       // ... and everyone's; slot i - 1 free
                } else {
                    staged_ws::wait(bar_full + i % S, (i / S) & 1);
                }
                if constexpr (ROLE == 0) {
                    issue(i + S - 1, ib, is, i + S - 1 < n_units, true);
                    step(ib, is);
                }
                const int c0 = s * KC, kcn = min(KC, C - c0), g0 = c0 >> chunk_shift;
                const u8* st = smem + (size_t)(i % S) * St::BYTES;
                const uint4* sw = reinterpret_cast<const uint4*>(st + St::W_OFF) +
                                  warp * TPW * KC * 32 + lane;
                const float2* ss = reinterpret_cast<const float2*>(st + St::S_OFF) +
                                   warp * TPW * 8 + g;
                const unsigned short* sz =
                    reinterpret_cast<const unsigned short*>(st + St::Z_OFF) + warp * TPW * 8 + g;
                const uint4* sa = reinterpret_cast<const uint4*>(st + St::A_OFF);
                // CG chunks from chunk kc0 of the stage, all of one scale group: the mma chain
                // of a (tile, token tile) runs over all of them and is scaled once
                auto chunks = [&](auto cg, int kc0) {
                    constexpr int CG = decltype(cg)::value;
                    const int gi = ((c0 + kc0) >> chunk_shift) - g0;
                    // B: the lane's token (column g of each tile), codes 16 t .. + 15 of a chunk
                    uint4 bv[CG][LT][2];
#pragma unroll
                    for (int j = 0; j < CG; ++j)
#pragma unroll
                        for (int mt = 0; mt < LT; ++mt) {
                            const int r = 8 * mt + g, u = (kc0 + j) * 8 + 2 * t;
                            bv[j][mt][0] = sa[r * KC * 8 + (u ^ (g & 1))];
                            bv[j][mt][1] = sa[r * KC * 8 + ((u + 1) ^ (g & 1))];
                        }
                    // The tokens' sums over the CG chunks, where the main mma's C holds their
                    // tokens (x: token 8 mt + 2 t, y: + 1), by the tensor cores: 2 mma per chunk
                    // with the token's 16-byte units as A (the lane's 4 registers of a unit:
                    // row g gets x, z: elements that meet even code pairs, row g + 8 gets y, w:
                    // odd pairs) and sSumB as B. Of token g (rows g and g + 8 both), with Se, So
                    // its sums over even and odd pairs' elements and OE = OFF_EVEN + zo,
                    // OO = OFF_ODD + zo: c0 = -OE Se, c3 = -OO So, c1 = -OO Se, c2 = -OE So. So
                    // c0 + c3 is the start (ZP = 0) or -T, T = sum offset a (ZP, zo = 0), and
                    // c1 / OO + c2 / OE is -S (ZP: the start of row r is -T - zp_r S). Each lane
                    // then takes its tokens' from lanes 8 t and 8 t + 4 (g = 2 t, 2 t + 1).
                    float2 start2[LT], neg_s2[ZP ? LT : 1];
                    {
                        const uint2 sb = sSumB[g & 1];
#pragma unroll
                        for (int mt = 0; mt < LT; ++mt) {
                            float z[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                            for (int j = 0; j < CG; ++j)
#pragma unroll
                                for (int v = 0; v < 2; ++v) {
                                    const uint4 u = bv[j][mt][v];
                                    w16::mma16816<F16>(z, u.x, u.y, u.z, u.w, sb.x, sb.y);
                                }
                            const float st = z[0] + z[3];
                            start2[mt].x = __shfl_sync(0xFFFFFFFFu, st, 8 * t);
                            start2[mt].y = __shfl_sync(0xFFFFFFFFu, st, 8 * t + 4);
                            if (ZP) {
                                const float ns = fmaf(z[1], 1.f / OFF_ODD, z[2] * (1.f / OFF_EVEN));
                                neg_s2[ZP ? mt : 0].x = __shfl_sync(0xFFFFFFFFu, ns, 8 * t);
                                neg_s2[ZP ? mt : 0].y = __shfl_sync(0xFFFFFFFFu, ns, 8 * t + 4);
                            }
                        }
                    }
                    // Each (tile, token tile) chain of mma starts at 0, and the start (shared by
                    // the TPW tiles without per-group zero points, -T - zp_r S with them) is
                    // added after it: the chains do not wait on the sums' mma and shuffles.
                    // Measured (T = 64): 174.6 / 95.6 against 176.3 /
                    // 97.3 us with the start as the first mma's C; T = 256 525 / 274 against
                    // 535 / 279. Each chain split in two accumulators (8 -> 4 dependent mma)
                    // took 247 registers and ran slower (191 / 106 against 178 / 99 us).
#pragma unroll
                    for (int r = 0; r < TPW; ++r) {
                        const float2 s2 = ss[(gi * NB + r) * 8];
                        float tmp[LT][4] = {};
#pragma unroll
                        for (int j = 0; j < CG; ++j) {
                            const uint4 x = sw[(r * KC + kc0 + j) * 32];
                            u32 lo[8], hi[8];             // A: rows g, g + 8: offset + q
                            if constexpr (F16)
                                w16::raw_pairs_f16(x, lo, hi);
                            else
                                w16::raw_pairs(x, 0x43004300u, lo, hi);   // bf16 128
#pragma unroll
                            for (int mt = 0; mt < LT; ++mt) {
                                const uint4 b0 = bv[j][mt][0], b1 = bv[j][mt][1];
                                w16::mma16816<F16>(tmp[mt], lo[0], hi[0], lo[1], hi[1], b0.x, b0.y);
                                w16::mma16816<F16>(tmp[mt], lo[2], hi[2], lo[3], hi[3], b0.z, b0.w);
                                w16::mma16816<F16>(tmp[mt], lo[4], hi[4], lo[5], hi[5], b1.x, b1.y);
                                w16::mma16816<F16>(tmp[mt], lo[6], hi[6], lo[7], hi[7], b1.z, b1.w);
                            }
                        }
                        if (ZP) {                         // row g's zero point in the low byte
                            const u32 z = sz[(gi * NB + r) * 8];
                            const float zp_g = (float)(z & 0xFFu), zp_g8 = (float)(z >> 8);
#pragma unroll
                            for (int mt = 0; mt < LT; ++mt) {
                                const float2 ns = neg_s2[ZP ? mt : 0];
                                tmp[mt][0] += fmaf(zp_g, ns.x, start2[mt].x);
                                tmp[mt][1] += fmaf(zp_g, ns.y, start2[mt].y);
                                tmp[mt][2] += fmaf(zp_g8, ns.x, start2[mt].x);
                                tmp[mt][3] += fmaf(zp_g8, ns.y, start2[mt].y);
                            }
                        } else {
#pragma unroll
                            for (int mt = 0; mt < LT; ++mt) {
                                tmp[mt][0] += start2[mt].x;
                                tmp[mt][1] += start2[mt].y;
                                tmp[mt][2] += start2[mt].x;
                                tmp[mt][3] += start2[mt].y;
                            }
                        }
#pragma unroll
                        for (int mt = 0; mt < LT; ++mt) {
                            acc[r][mt][0] = fmaf(s2.x, tmp[mt][0], acc[r][mt][0]);
                            acc[r][mt][1] = fmaf(s2.x, tmp[mt][1], acc[r][mt][1]);
                            acc[r][mt][2] = fmaf(s2.y, tmp[mt][2], acc[r][mt][2]);
                            acc[r][mt][3] = fmaf(s2.y, tmp[mt][3], acc[r][mt][3]);
                        }
                    }
                };
                if (kcn == KC && g0 == (c0 + KC - 1) >> chunk_shift) {   // one group
                    chunks(w16::Count<KC>{}, 0);
                } else {
#pragma unroll
                    for (int kc = 0; kc < KC; ++kc) {
                        if (kc >= kcn) break;             // uniform: a short last stage
                        chunks(w16::Count<1>{}, kc);
                    }
                }
                if constexpr (ROLE == 2) {                 // this warp is done with slot i % S
                    __syncwarp();
                    if (lane == 0) staged_ws::arrive(bar_empty + i % S);
                }
                // ---- the end of the run's units of block b: store it whole, or hand in this
                // part (finish_parts: the CTA that completes the block adds the parts)
                ++blk_n;
                if (i + 1 == n_units || s == SPB - 1) {   // uniform over the CTA
                    if (blk_n == SPB) {
                        store(b);
                    } else if (finish_parts<TPW * LT * 4, NT, ROLE == 2 ? NT : 0>(
                                   &acc[0][0][0], ws, units_done, part_at, by_first, SPB,
                                   (size_t)m * nblocks + b, PER, 2 * q + parts_used++,
                                   s - blk_n + 1, blk_n, sLast)) {
                        store(b);
                    }
                    blk_n = 0;
#pragma unroll
                    for (int r = 0; r < TPW; ++r)
#pragma unroll
                        for (int mt = 0; mt < LT; ++mt)
#pragma unroll
                            for (int k = 0; k < 4; ++k) acc[r][mt][k] = 0.f;
                }
                step(b, s);
            }
        });
        if constexpr (ROLE == 0) w16::cp_wait<0>();    // the ring is empty ...
        __syncthreads();                               // ... and read: the next segment refills it
        init_ring_barriers();                          // (WS: before load_m_tile's barrier)
    }
    };
    if constexpr (WS) {
        if (tid >= NT) {
            staged_ws::regs_down<WS>();
            segments(w16::Count<1>{});
        } else {
            staged_ws::regs_up<WS_CREGS>();
            segments(w16::Count<2>{});
        }
    } else {
        segments(w16::Count<0>{});
    }
}
