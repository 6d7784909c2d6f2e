// gemm_common.cuh: what every rung of the grouped GEMM ladder shares.
//
// Included (inlined by _compile.source_text) by every rung, gemm_v1_naive.cu to
// gemm_v6_tma_ws.cu. It holds:
//   - the element type GG_T (a #define from the launcher: float, __half or __nv_bfloat16) and
//     its conversions to and from fp32;
//   - gg_epilogue(): the one place where bias and router weight are applied, in fp32, in the
//     order of docs/stages.md: c[s] = (acc + bias[e]) * topk_weights.flat[s];
//   - what the tensor-core rungs (v4, v5, v6) share: the grouped tile order gg_tile_of(),
//     gg_store2() (two outputs rounded into one word), gg_bias_pair() (their epilogue's bias)
//     and gg_store_tile() (an output tile staged in shared memory to the rows of c);
//   - the cp.async wrappers of the pipelined rungs (v4, v5, v6);
//   - gg_load_slots() and gg_zero_tile(): a tile's slot ids, and the zeros of a tile whose
//     expert is not on this rank;
//   - the kernel argument list, identical for every version, so that the Python launcher
//     passes the same tuple to whichever rung it picks.
//
// Shape legend: T tokens, E_local experts on this rank, K top-k, N output width, Kdim the
// reduction width (H for GEMM1, I for GEMM2), B = block_size (alignment block), L =
// len(sorted_token_ids), P = a.shape[0] * top_k (the padding value in sorted_token_ids).
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef GG_T
#error "GG_T (the element type: float, __half or __nv_bfloat16) must be #defined by the launcher"
#endif

// Every rung takes the same arguments in the same order: pointers, then sizes, then flags.
//   a                       [M_a, Kdim]           row-major, the activations (a row per token for
//                                                 GEMM1, a row per slot for GEMM2)
//   w                       [E_local, N, Kdim]    row-major ([out, in], Hugging Face layout)
//   c                       [P, N]                row-major, written once per slot s < P
//   sorted_token_ids        [L]    int32          slot of each position, P = padding
//   expert_ids              [L/B]  int32          local expert of each alignment block, -1 = none
//   num_tokens_post_padded  [1]    int32          read on the device: no host round trip
//   topk_weights            [P]    fp32           router weight of each slot (mul_routed_weight)
//   bias                    [E_local, N]          GG_T (bias_kind 1) or fp32 (bias_kind 2)
#define GG_KERNEL_ARGS                                                                        \
    const GG_T* __restrict__ a, const GG_T* __restrict__ w, GG_T* __restrict__ c,             \
    const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,             \
    const int* __restrict__ num_tokens_post_padded, const float* __restrict__ topk_weights,   \
    const void* __restrict__ bias,                                                            \
    int N, int Kdim, int num_slots, int top_k, int block_size, int num_positions,             \
    int mul_routed_weight, int bias_kind

// The dynamic shared-memory buffer of a kernel (a macro so that the CPU emulator of the
// tests can give it a host buffer instead).
#ifndef GG_DYNAMIC_SMEM
#define GG_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

// ---------------------------------------------------------------------------- conversions
__device__ __forceinline__ float gg_to_f32(float x) { return x; }
__device__ __forceinline__ float gg_to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float gg_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T gg_from_f32(float x);
template <> __device__ __forceinline__ float gg_from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half gg_from_f32<__half>(float x) {
    return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 gg_from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// A slot id is live when 0 <= s < P; the unsigned compare folds both tests into one
// (the padding value is P itself, and a stray negative id is skipped too).
__device__ __forceinline__ bool gg_live(int s, int num_slots) {
    return (unsigned)s < (unsigned)num_slots;
}

// The epilogue of docs/stages.md in fp32: (acc + bias[e, n]) * topk_weights.flat[s].
// bias_kind: 0 none, 1 bias has the element type GG_T, 2 bias is fp32.
__device__ __forceinline__ float gg_epilogue(float acc, int e, int n, int s, int N,
                                             const void* __restrict__ bias, int bias_kind,
                                             const float* __restrict__ topk_weights,
                                             int mul_routed_weight) {
    if (bias_kind == 1) {
        acc += gg_to_f32(static_cast<const GG_T*>(bias)[(long long)e * N + n]);
    } else if (bias_kind == 2) {
        acc += static_cast<const float*>(bias)[(long long)e * N + n];
    }
    if (mul_routed_weight) acc *= topk_weights[s];
    return acc;
}

// The tile of an expert that is not on this rank (expert_ids == -1) is zeros: every live row
// of the kRows x kCols tile at column n0, in 16-byte stores of 8 elements when the rows are
// 16-byte aligned (N % 8 == 0; kCols is a multiple of 8), element by element otherwise.
template <int kRows, int kCols, int kThreads>
__device__ __forceinline__ void gg_zero_tile(GG_T* __restrict__ c, const int* s_slot, int n0,
                                             int N, int num_slots, int tid) {
    const bool vec_out = (N % 8) == 0;
    for (int idx = tid; idx < kRows * (kCols / 8); idx += kThreads) {
        const int r = idx / (kCols / 8), n = n0 + (idx % (kCols / 8)) * 8;
        const int s = s_slot[r];
        if (!gg_live(s, num_slots) || n >= N) continue;
        GG_T* dst = c + (long long)s * N + n;
        if (vec_out) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
        } else {
            for (int j = 0; j < 8 && n + j < N; ++j) dst[j] = gg_from_f32<GG_T>(0.0f);
        }
    }
}

// ------------------------------------------------------------- cp.async (v4 and v5)
// (the CPU emulator of tests/emulator defines GG_HOST_EMULATION and its own versions)
#ifndef GG_HOST_EMULATION
__device__ __forceinline__ unsigned gg_smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1 (.cg); src_bytes = 0 writes 16 zero bytes and
// reads nothing (padding rows, ragged N, the Kdim tail).
__device__ __forceinline__ void gg_cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void gg_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int PENDING>
__device__ __forceinline__ void gg_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING) : "memory");
}
#endif  // GG_HOST_EMULATION

// The slot of every row of the tile starting at position m0, into shared memory, once per
// CTA: positions past L (a defensive check: a live tile lies below num_tokens_post_padded,
// which never exceeds L) read as padding.
template <int kRows, int kThreads>
__device__ __forceinline__ void gg_load_slots(int* s_slot, const int* __restrict__ sorted_token_ids,
                                              int m0, int num_positions, int num_slots, int tid) {
    for (int r = tid; r < kRows; r += kThreads) {
        const int p = m0 + r;
        s_slot[r] = p < num_positions ? sorted_token_ids[p] : num_slots;
    }
}

// ---------------------------------------------------------- the tensor-core rungs (v4, v5, v6)
// Tile t of the grouped order: groups of kGroupM m tiles walk all n tiles together, m fastest
// inside a group, so the CTAs that run at the same time share a few w column slabs and a rows
// in L2 (v4, v5: t = blockIdx.x over all m tiles; v6: its persistent walk over the live ones).
template <int kGroupM>
__device__ __forceinline__ void gg_tile_of(int t, int num_pid_m, int num_pid_n, int& pid_m,
                                           int& pid_n) {
    const int per_group = kGroupM * num_pid_n;
    const int first_m = (t / per_group) * kGroupM;
    const int group_rows = min(num_pid_m - first_m, kGroupM);
    pid_m = first_m + (t % per_group) % group_rows;
    pid_n = (t % per_group) / group_rows;
}

// Two adjacent outputs rounded to GG_T and stored as one 4-byte word.
__device__ __forceinline__ void gg_store2(__half* p, float x, float y) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
}
__device__ __forceinline__ void gg_store2(__nv_bfloat16* p, float x, float y) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}

// The bias of columns n and n + 1 of expert e in fp32 (0 past N and without a bias): an
// accumulator fragment holds two adjacent columns, whose bias the epilogue fetches once.
__device__ __forceinline__ void gg_bias_pair(const void* __restrict__ bias, int bias_kind, int e,
                                             int n, int N, float& b0, float& b1) {
    b0 = 0.0f;
    b1 = 0.0f;
    if (bias_kind == 1) {
        const GG_T* be = static_cast<const GG_T*>(bias) + (long long)e * N;
        if (n < N) b0 = gg_to_f32(be[n]);
        if (n + 1 < N) b1 = gg_to_f32(be[n + 1]);
    } else if (bias_kind == 2) {
        const float* be = static_cast<const float*>(bias) + (long long)e * N;
        if (n < N) b0 = be[n];
        if (n + 1 < N) b1 = be[n + 1];
    }
}

// The finished kRows x kCols output tile, staged in shared memory (row stride kStride
// elements), to c: whole 16-byte pieces of each live row (a warp writes 512 contiguous-ish
// bytes per step) when the rows of c are 16-byte aligned (vec_out: N % 8 == 0), element by
// element otherwise; padding rows are never written.
template <int kRows, int kCols, int kStride, int kThreads>
__device__ __forceinline__ void gg_store_tile(GG_T* __restrict__ c, const GG_T* sm,
                                              const int* s_slot, int n0, int N, int num_slots,
                                              bool vec_out, int tid) {
    for (int idx = tid; idx < kRows * (kCols / 8); idx += kThreads) {
        const int r = idx / (kCols / 8), col = (idx % (kCols / 8)) * 8;
        const int s = s_slot[r];
        const int n = n0 + col;
        if (!gg_live(s, num_slots) || n >= N) continue;
        GG_T* dst = c + (long long)s * N + n;
        const GG_T* src = sm + r * kStride + col;
        if (vec_out) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
            for (int j = 0; j < 8 && n + j < N; ++j) dst[j] = src[j];
        }
    }
}
