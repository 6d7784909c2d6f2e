// decode_dot.cuh: the dot products of the decode launch's two rungs (experts_decode.cu,
// experts_decode_ring.cu), one order of sums for both, so that they give the same bits: each
// lane accumulates its 16-byte chunks in fp32 (fma per element), then a warp's butterfly.
// Include it after SCALAR_T is defined (and elementwise.cuh: Pack, to_f32).
#pragma once

// acc + sum_i w[i] * x[i] over the 8 elements of two 16-byte words, in fp32
__device__ __forceinline__ float dot8(float acc, uint4 w, uint4 x) {
    const Pack<SCALAR_T, 8> wv = *reinterpret_cast<const Pack<SCALAR_T, 8>*>(&w);
    const Pack<SCALAR_T, 8> xv = *reinterpret_cast<const Pack<SCALAR_T, 8>*>(&x);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc = fmaf(to_f32(wv.v[i]), to_f32(xv.v[i]), acc);
    return acc;
}

// the sum over a warp's 32 lanes, in every lane (a butterfly: the same order in every lane)
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
}
