// routing.cu: choose each token's top-k experts (softmax, sigmoid or sqrt-softplus scores,
// optional correction bias, optional expert groups), one warp per token row.
//
// Shapes: T tokens, E experts (E <= 32 * VPT <= 1024), K = top-k (K <= 32, K <= E),
//         G = num_groups (groups of E / G consecutive experts), TG = topk_group.
//
// Math (all fp32; docs/stages.md, "route"):
//   scores[t, e] = softmax(gating[t, :])[e]        (scoring == 0: exp(x - max) / sum)
//                | 1 / (1 + exp(-gating[t, e]))     (scoring == 1: sigmoid)
//                | sqrt(softplus(gating[t, e]))     (scoring == 2, mode 0 only: DeepSeek-V4;
//                  softplus(x) = log(1 + exp(x)), or x above 20)
//   the mode's non-finite rule (vLLM's kernels):
//     mode 0 (fused_topk, fused_topk_bias: topk_softmax / topk_sigmoid): a non-finite score is 0
//     mode 1 (grouped_topk): an expert whose scoring input is not finite (the logit for
//       sigmoid, the score for softmax) is invalid: sel -inf, weight 0; a row with no valid
//       expert among its K gets 1/K (renormalize) or 0. Softmax scores are rounded to IN_T
//       (vLLM computes that softmax in the logits' dtype)
//   sel[t, e]    = scores[t, e] + bias[e]           (bias given) | scores[t, e]
//   groups (G > 1): group score = max of the group's scores (no bias; NaN if one is NaN)
//                   | sum of its top-2 sel (bias);
//                   keep the TG best groups, sel = -inf outside them
//   topk_ids[t, :]     = the K largest sel, descending, ties to the lowest id
//   topk_weights[t, :] = scores[t, topk_ids], / their sum if renormalize and the sum > 0,
//                        * routed_scaling_factor
//   token_expert_indices[t, k] = k * T + t            (when the pointer is not null)
// Selection treats NaN as -inf and picks K *distinct* experts even among -inf (lowest ids
// first), so a token always gets K experts in [0, E) and finite weights. expf, not __expf:
// ranks must match the NumPy reference except at true near-ties.
//
// How selection works: every (value, id) pair becomes one 64-bit key, order-preserving float
// bits in the high word and (0xFFFFFFFF - id) in the low word, so "larger value, then lower id"
// is a plain unsigned max. A taken or out-of-range expert has key 0, below every real key
// (-inf's key is 0x007FFFFF << 32). K rounds of a lane-local max plus a 5-step warp max.
//
// Launch geometry (routing.py):
//   block = WARPS_PER_BLOCK * 32 threads, warp w of block b handles row t = b * WARPS_PER_BLOCK + w
//   grid  = cdiv(T, WARPS_PER_BLOCK)
//   dynamic shared memory = G > 1 ? WARPS_PER_BLOCK * (even(E + E / 32 + 1) + 2 G) * 4 bytes : 0
//     (per warp: one padded fp32 row for the group scan, index e + e / 32 keeping the row
//      store and the per-group reads free of bank conflicts, then G 64-bit group keys)
//   lane l holds experts e = i * 32 + l, i < VPT, in registers (coalesced row loads).
//
// Compile-time parameters: IN_T (float, __half, __nv_bfloat16: the gating dtype; fp64 logits
//   are rounded to fp32 by routing.py first),
//   WARPS_PER_BLOCK (tunable, routing.py CONFIGS); template VPT in {1, 2, 4, 8, 16, 32}.
// Versions: v1 (this file): warp per row, register-resident row, 64-bit key selection.
// Run: python -m cuda_kernels.cupy.routing   (validates against reference/, times, GB/s)

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef IN_T
#define IN_T float
#endif
#ifndef WARPS_PER_BLOCK
#define WARPS_PER_BLOCK 4
#endif

#define FULL_MASK 0xffffffffu
#define NEG_INF (__int_as_float(0xff800000))  // NVRTC has no <math.h> INFINITY
#define POS_INF (__int_as_float(0x7f800000))

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// x rounded to the dtype the pointer's elements have (round to nearest even), back to fp32
__device__ __forceinline__ float round_like(const float*, float x) { return x; }
__device__ __forceinline__ float round_like(const __half*, float x) {
    return __half2float(__float2half_rn(x));
}
__device__ __forceinline__ float round_like(const __nv_bfloat16*, float x) {
    return __bfloat162float(__float2bfloat16_rn(x));
}

__device__ __forceinline__ bool finite_f(float v) { return v > NEG_INF && v < POS_INF; }

// A score v (of logit x) under the launch's mode: 0: 0 when not finite; 1: NaN (invalid) when
// the scoring input is not finite (v for softmax, x for sigmoid), else a softmax score
// rounded to IN_T.
__device__ __forceinline__ float score_rule(float v, float x, int scoring, int mode,
                                            const IN_T* row) {
    if (mode == 0) return finite_f(v) ? v : 0.0f;
    if (scoring == 0) return finite_f(v) ? round_like(row, v) : __int_as_float(0x7fc00000);
    return finite_f(x) ? v : __int_as_float(0x7fc00000);
}

// the scores that need no row reduction: sigmoid (scoring 1) or sqrt(softplus) (scoring 2;
// the softplus of vLLM's topk_softplus_sqrt kernel, with logf/expf in place of the fast
// __logf/__expf, like the other scores here)
__device__ __forceinline__ float elementwise_score(float x, int scoring) {
    if (scoring == 1) return 1.0f / (1.0f + expf(-x));
    return sqrtf(x > 20.0f ? x : logf(1.0f + expf(x)));
}

// max that propagates NaN like np.max (fmaxf would drop it)
__device__ __forceinline__ float max_nan(float a, float b) { return (a > b || a != a) ? a : b; }

// float -> unsigned with the same order; NaN counts as -inf and -0 as +0 for selection
__device__ __forceinline__ unsigned int order_bits(float v) {
    if (v != v) v = NEG_INF;
    if (v == 0.0f) v = 0.0f;
    unsigned int u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ unsigned long long make_key(float v, int id) {
    return ((unsigned long long)order_bits(v) << 32) | (unsigned long long)(0xFFFFFFFFu - (unsigned)id);
}

__device__ __forceinline__ int key_id(unsigned long long key) {
    return (int)(0xFFFFFFFFu - (unsigned)(key & 0xFFFFFFFFull));
}

__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long k) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long other = __shfl_xor_sync(FULL_MASK, k, o);
        k = other > k ? other : k;
    }
    return k;
}

__device__ __forceinline__ float warp_max_nan(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// shared memory per warp, in floats: the sel row padded by one float per 32 (rounded up to
// an even count so the group keys that follow are 8-byte aligned), then 2 floats per group key
__host__ __device__ __forceinline__ int padded_row_floats(int E) {
    return ((E + (E >> 5) + 1) + 1) & ~1;
}
__host__ __device__ __forceinline__ int warp_smem_floats(int E, int G) {
    return padded_row_floats(E) + 2 * G;
}

template <int VPT>
__global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
route_topk_kernel(const IN_T* __restrict__ gating,        // [T, E]
                  const float* __restrict__ bias,         // [E] or nullptr
                  float* __restrict__ topk_weights,       // [T, K]
                  int* __restrict__ topk_ids,             // [T, K]
                  int* __restrict__ token_expert_indices, // [T, K] or nullptr
                  int T, int E, int K,
                  int num_groups, int topk_group,
                  int scoring,                            // 0 softmax, 1 sigmoid, 2 sqrt-softplus
                  int renormalize,
                  int mode,                               // 0 topk, 1 grouped (above)
                  float routed_scaling_factor) {
    extern __shared__ float smem[];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * WARPS_PER_BLOCK + warp;
    if (t >= T) return;  // the whole warp leaves together: no block-wide barrier below

    const IN_T* row = gating + (size_t)t * E;

    // ---- scores ----------------------------------------------------------------------------
    float p[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int e = i * 32 + lane;
        p[i] = e < E ? to_f32(row[e]) : NEG_INF;
    }
    float row_max = 0.0f, row_sum = 1.0f;  // softmax only
    if (scoring == 0) {
        float m = NEG_INF;
#pragma unroll
        for (int i = 0; i < VPT; ++i)
            if (i * 32 + lane < E) m = max_nan(m, p[i]);
        m = warp_max_nan(m);
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            // x - max, then exp: the reference's order (inf - inf = NaN stays NaN)
            p[i] = (i * 32 + lane < E) ? expf(p[i] - m) : 0.0f;
            s += p[i];
        }
        s = warp_sum(s);
#pragma unroll
        for (int i = 0; i < VPT; ++i) p[i] = score_rule(p[i] / s, 0.0f, 0, mode, row);
        row_max = m;
        row_sum = s;
    } else {
#pragma unroll
        for (int i = 0; i < VPT; ++i)
            p[i] = score_rule(elementwise_score(p[i], scoring), p[i], scoring, mode, row);
    }

    // ---- selection values: the (biased) scores, -inf for an invalid expert (NaN score);
    //      make_key reads a NaN (a NaN bias) as -inf
    float sel[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int e = i * 32 + lane;
        sel[i] = (bias != nullptr && e < E) ? p[i] + bias[e] : p[i];
        if (p[i] != p[i]) sel[i] = NEG_INF;
    }

    // ---- groups: keep the topk_group best groups ---------------------------------------------
    unsigned int keep = 0xFFFFFFFFu;  // bit i: expert i * 32 + lane is in a kept group
    if (num_groups > 1) {
        // this warp's slice of shared memory: the padded sel row, then one key per group
        float* wrow = smem + (size_t)warp * warp_smem_floats(E, num_groups);
        unsigned long long* gkey =
            reinterpret_cast<unsigned long long*>(wrow + padded_row_floats(E));
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int e = i * 32 + lane;
            if (e < E) wrow[e + (e >> 5)] = sel[i];
        }
        __syncwarp();
        const int gs = E / num_groups;
        for (int g = lane; g < num_groups; g += 32) {  // not unrolled: keeps the code small
            float score;
            if (bias == nullptr) {
                // the group's max, NaN-propagating like np.max (a NaN group then ranks as -inf)
                score = NEG_INF;
                for (int e = g * gs; e < (g + 1) * gs; ++e) score = max_nan(score, wrow[e + (e >> 5)]);
            } else {
                // the sum of the group's two best biased scores, NaN ranked as -inf (only one
                // when gs == 1); a NaN or -inf in the pair makes the group -inf either way
                float top1 = NEG_INF, top2 = NEG_INF;
                for (int e = g * gs; e < (g + 1) * gs; ++e) {
                    float v = wrow[e + (e >> 5)];
                    v = (v != v) ? NEG_INF : v;
                    if (v > top1) { top2 = top1; top1 = v; }
                    else if (v > top2) { top2 = v; }
                }
                score = gs >= 2 ? top1 + top2 : top1;
            }
            gkey[g] = make_key(score, g);
        }
        __syncwarp();
        keep = 0u;
        for (int r = 0; r < topk_group; ++r) {
            unsigned long long best = 0ull;
            for (int g = lane; g < num_groups; g += 32) best = gkey[g] > best ? gkey[g] : best;
            best = warp_max_key(best);
            const int g = key_id(best);
            __syncwarp();                       // every lane has read gkey before it changes
            if ((g & 31) == lane) gkey[g] = 0ull;  // taken
            __syncwarp();
            const int lo = g * gs, hi = lo + gs;
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                const int e = i * 32 + lane;
                if (e >= lo && e < hi) keep |= 1u << i;
            }
        }
    }

    // ---- top-k over the kept selection values ----------------------------------------------
    unsigned long long key[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int e = i * 32 + lane;
        key[i] = e < E ? make_key(((keep >> i) & 1u) ? sel[i] : NEG_INF, e) : 0ull;
    }
    unsigned int taken = 0u;  // bit i: expert i * 32 + lane already chosen
    int my_id = 0;            // lane k keeps the k-th winner
    for (int k = 0; k < K; ++k) {
        unsigned long long best = 0ull;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const unsigned long long c = ((taken >> i) & 1u) ? 0ull : key[i];
            best = c > best ? c : best;
        }
        best = warp_max_key(best);
        const int id = key_id(best);
        if ((id & 31) == lane) taken |= 1u << (id >> 5);
        if (lane == k) my_id = id;
    }

    // ---- weights ------------------------------------------------------------------------------
    // Lane k recomputes the score of its winner from the logit with the same instructions
    // that ranked it (bitwise the same value): cheaper than indexing p[] by a runtime slot,
    // which would push the row into local memory.
    float my_w = 0.0f, valid = 0.0f;
    if (lane < K) {
        const float x = to_f32(row[my_id]);
        const float score = scoring == 0 ? expf(x - row_max) / row_sum
                                         : elementwise_score(x, scoring);
        my_w = score_rule(score, x, scoring, mode, row);
        valid = my_w == my_w ? 1.0f : 0.0f;   // an invalid expert (mode 1) weighs 0
        if (my_w != my_w) my_w = 0.0f;
    }
    const float num_valid = warp_sum(valid);
    if (renormalize) {
        const float s = warp_sum(lane < K ? my_w : 0.0f);
        if (s > 0.0f) my_w = my_w / s;
    }
    my_w = my_w * routed_scaling_factor;
    if (num_valid == 0.0f) my_w = renormalize ? 1.0f / (float)K : 0.0f;   // none valid (mode 1)
    if (lane < K) {
        const size_t o = (size_t)t * K + lane;
        topk_weights[o] = my_w;
        topk_ids[o] = my_id;
        if (token_expert_indices != nullptr) token_expert_indices[o] = lane * T + t;
    }
}
