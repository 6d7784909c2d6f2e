// elementwise.cuh: what the row-wise elementwise kernels share (activation.cu, combine.cu,
// permute.cu's moe_unpermute_kernel).
//
// Included (inlined by _compile.source_text) by those files. It holds:
//   - to_f32 / from_f32: every value is read into fp32 and rounded once on the way out
//     (round to nearest even), for float, __half and __nv_bfloat16;
//   - Pack<T, VEC>: VEC consecutive elements as one aligned word, and load<VEC> / store<VEC>
//     through it: VEC * sizeof(T) = 16 bytes gives one 128-bit load or store per thread.
//     The launcher (_compile.row_geometry) picks VEC so that the row width and every base
//     pointer are multiples of VEC * sizeof(T): the reinterpret_cast is then aligned.
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
