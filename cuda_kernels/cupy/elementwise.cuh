// elementwise.cuh: what the row-wise elementwise kernels share (activation.cu, combine.cu,
// permute.cu's moe_unpermute_kernel, ep_layout.cu's ep_combine_kernel).
//
// Included (inlined by _compile.source_text) by those files. It holds:
//   - to_f32 / from_f32: every value is read into fp32 and rounded once on the way out
//     (round to nearest even), for float, __half and __nv_bfloat16;
//   - Pack<T, VEC>: VEC consecutive elements as one aligned word, and load<VEC> / store<VEC>
//     through it: VEC * sizeof(T) = 16 bytes gives one 128-bit load or store per thread.
//     The launcher (_compile.row_geometry) picks VEC so that the row width and every base
//     pointer are multiples of VEC * sizeof(T): the reinterpret_cast is then aligned;
//   - act<ACT>: the activations in fp32 (activation.cu's table; experts_decode.cu fuses the
//     gated ones into its GEMM1), and round_to<T>: a value rounded where a stage stores T;
//   - the row sums' pieces (combine, unpermute, the EP combine): row_chunk (a thread's row and
//     first column) and add_f32 (acc += row or w * row in fp32, in order).
// No macros: the element type is a template argument, so a file may use it with its own
// SCALAR_T.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_f32(float v, float* out) { *out = v; }
__device__ __forceinline__ void from_f32(float v, __half* out) { *out = __float2half_rn(v); }
__device__ __forceinline__ void from_f32(float v, __nv_bfloat16* out) { *out = __float2bfloat16_rn(v); }

// VEC consecutive elements as one aligned word (16 bytes when VEC * sizeof(T) == 16)
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
    T v[VEC];
};

template <int VEC, typename T>
__device__ __forceinline__ Pack<T, VEC> load(const T* p) {
    return *reinterpret_cast<const Pack<T, VEC>*>(p);
}
template <int VEC, typename T>
__device__ __forceinline__ void store(T* p, const Pack<T, VEC>& v) {
    *reinterpret_cast<Pack<T, VEC>*>(p) = v;
}

// The row t and first column col of this thread: blocks of `chunks` per row, VEC columns per
// thread (the row-wise launchers' flattened grid, t = block / chunks).
template <int VEC>
__device__ __forceinline__ void row_chunk(int chunks, int& t, int& col) {
    t = blockIdx.x / chunks;
    col = ((blockIdx.x % chunks) * blockDim.x + threadIdx.x) * VEC;
}

// acc[j] += v[j] (or w * v[j]) in fp32, each operation rounded to nearest (__fadd_rn, __fmul_rn:
// no contraction into an fma and no reassociation, so a sum taken in order is bitwise the
// reference's)
template <int VEC, typename T>
__device__ __forceinline__ void add_f32(float (&acc)[VEC], const Pack<T, VEC>& v) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = __fadd_rn(acc[j], to_f32(v.v[j]));
}
template <int VEC, typename T>
__device__ __forceinline__ void add_f32(float (&acc)[VEC], float w, const Pack<T, VEC>& v) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, to_f32(v.v[j])));
}

// v rounded to T and back: what a stage that stores T hands the next one
template <typename T>
__device__ __forceinline__ float round_to(float v) {
    T r;
    from_f32(v, &r);
    return to_f32(r);
}

// act<ACT>(g) in fp32: ACT 0 silu, 1 gelu (exact), 2 gelu_tanh, 3 relu2 (activation.cu's math)
template <int ACT>
__device__ __forceinline__ float act(float g) {
    if (ACT == 0) return g / (1.0f + expf(-g));
    if (ACT == 1) return 0.5f * g * (1.0f + erff(g / 1.41421356237309504880f));
    if (ACT == 2) {
        const float inner = 0.79788456080286535588f * (g + 0.044715f * g * g * g);
        return 0.5f * g * (1.0f + tanhf(inner));
    }
    // ACT == 3: relu squared; a NaN stays NaN (np.maximum propagates it)
    const float r = g > 0.0f ? g : (g != g ? g : 0.0f);
    return r * r;
}
