// act.cu: quantize activations to fp8 e4m3 or int8 with fp32 scales, one scale per
// 1 x group_size group of columns (DeepSeek-V3's 1x128 groups; group_size = Kdim is per-token),
// or one scale for the whole tensor (static, or dynamic from a device-side absmax).
//
// Math (reference/quant.py, bit for bit):
//   dynamic   s = max(max(absmax(group), eps) / qmax, min_scale)   (NaN-propagating max)
//             s = 2^ceil(log2 s) when use_ue8m0 (bit trick: a non-zero mantissa bumps the exponent)
//   static    s = *static_scale
//   tensor    s = max(max(*tensor_amax, eps) / qmax, min_scale)
//   fp8       q = e4m3_rn(clamp(x / s, -448, 448))     (clamp first: e4m3fn has no inf)
//   int8      q = clamp(roundf(x / s), -128, 127)        (roundf: half away from zero)
// fp8 (group, eps=1e-10, min_scale=0); fp8 per-token / per-tensor (eps=0, min_scale=1/(448*512));
// int8 (eps=1e-10, min_scale=0). NaN: the max keeps it, so a NaN in a group makes its scale NaN
// and the whole group dequantizes to NaN.
//
// Shapes: x [M, Kdim] (IN_T: float, __half or __nv_bfloat16), q [M, Kdim] bytes (e4m3 or int8),
// scales [M, G] fp32 with G = cdiv(Kdim, group_size) (the last group may be partial).
//
// Kernels:
//   group_quant_kernel<QT>   one warp per (row, group): pass 1 absmax (warp shuffle reduction),
//                            pass 2 quantize; QT 0 = fp8 e4m3, 1 = int8.
//                            block = WARPS_PER_BLOCK * 32, grid = cdiv(M * G, WARPS_PER_BLOCK),
//                            no shared memory.
//   absmax_kernel            the whole tensor's absmax into one fp32 (atomicMax on the bits:
//                            non-negative floats order like their bit patterns, NaN above inf).
//                            block = 256, grid = min(cdiv(M * Kdim, 256 * 8), 1024).
//
// Run: python -m cuda_kernels.cupy.quant.act [--quick]
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#ifndef IN_T
#error "IN_T (float, __half or __nv_bfloat16) must be #defined by the launcher"
#endif
#ifndef WARPS_PER_BLOCK
#error "WARPS_PER_BLOCK must be #defined by the launcher"
#endif

#define QA_CACHE 8   // values a lane keeps in registers between the passes (group <= 256)

__device__ __forceinline__ float qa_to_f32(float x) { return x; }
__device__ __forceinline__ float qa_to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float qa_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// max that keeps NaN (fmaxf would return the other operand)
__device__ __forceinline__ float qa_nanmax(float a, float b) {
    return (a != a || a > b) ? a : b;
}

__device__ __forceinline__ float qa_pow2_ceil(float s) {
    const unsigned bits = __float_as_uint(s);
    if (!(s > 0.f) || (bits & 0x7F800000u) == 0x7F800000u) return s;   // NaN, inf, <= 0: unchanged
    if ((bits & 0x007FFFFFu) == 0u) return s;                           // already a power of two
    return __uint_as_float((bits & 0x7F800000u) + 0x00800000u);
}

template <int QT>
__device__ __forceinline__ unsigned char qa_encode(float y) {
    if (QT == 0) {
        // comparisons are false for NaN, so NaN passes through to the cast (-> e4m3 NaN)
        y = y > 448.f ? 448.f : (y < -448.f ? -448.f : y);
        return (unsigned char)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
    } else {
        float r = roundf(y);
        r = r > 127.f ? 127.f : (r < -128.f ? -128.f : r);
        return (unsigned char)(signed char)(int)r;   // NaN -> 0 (cvt.rzi), as the reference
    }
}

// x [M, Kdim] -> q [M, Kdim], scales [M, G] (dynamic group mode only)
//   static_scale != nullptr: s = *static_scale for every group, scales not written
//   tensor_amax  != nullptr: s from the tensor's absmax; thread 0 writes scales[0]
template <int QT>
__global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
group_quant_kernel(const IN_T* __restrict__ x, unsigned char* __restrict__ q,
                   float* __restrict__ scales, const float* __restrict__ static_scale,
                   const float* __restrict__ tensor_amax,
                   int M, int Kdim, int group_size, int num_groups,
                   float qmax, float eps, float min_scale, int use_ue8m0) {
    const int lane = threadIdx.x & 31;
    const long long gid = (long long)blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    if (gid >= (long long)M * num_groups) return;                  // whole warp leaves together
    const int row = (int)(gid / num_groups);
    const int grp = (int)(gid - (long long)row * num_groups);
    const int k0 = grp * group_size;
    const int k1 = min(k0 + group_size, Kdim);
    const IN_T* xr = x + (long long)row * Kdim;

    float cache[QA_CACHE];
    float s;
    if (static_scale != nullptr) {
        s = *static_scale;
    } else if (tensor_amax != nullptr) {
        s = qa_nanmax(qa_nanmax(*tensor_amax, eps) / qmax, min_scale);
        if (gid == 0 && lane == 0) scales[0] = s;
    } else {
        float amax = 0.f;
        int j = 0;
        for (int k = k0 + lane; k < k1; k += 32, ++j) {
            const float v = qa_to_f32(xr[k]);
            if (j < QA_CACHE) cache[j] = v;
            amax = qa_nanmax(amax, fabsf(v));
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
            amax = qa_nanmax(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        s = qa_nanmax(qa_nanmax(amax, eps) / qmax, min_scale);
        if (use_ue8m0) s = qa_pow2_ceil(s);
        if (lane == 0) scales[(long long)row * num_groups + grp] = s;
    }
    const bool cached = static_scale == nullptr && tensor_amax == nullptr;
    unsigned char* qr = q + (long long)row * Kdim;
    int j = 0;
    for (int k = k0 + lane; k < k1; k += 32, ++j) {
        const float v = (cached && j < QA_CACHE) ? cache[j] : qa_to_f32(xr[k]);
        qr[k] = qa_encode<QT>(v / s);   // IEEE division, as the reference's x / s in fp32
    }
}

// amax_bits[0] = bits of max |x| over all n elements (must start at 0)
extern "C" __global__ void __launch_bounds__(256)
absmax_kernel(const IN_T* __restrict__ x, unsigned int* __restrict__ amax_bits, long long n) {
    float m = 0.f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        m = qa_nanmax(m, fabsf(qa_to_f32(x[i])));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        m = qa_nanmax(m, __shfl_xor_sync(0xffffffffu, m, off));
    // fabsf clears the sign, so a NaN here is a positive-signed NaN whose bits exceed inf's
    if ((threadIdx.x & 31) == 0) atomicMax(amax_bits, __float_as_uint(m));
}
