// decode_dot.cuh: the sums of the decode launch's two rungs (experts_decode.cu,
// experts_decode_ring.cu), one order for both, so that they give the same bits: in a dot
// product each lane accumulates its 16-byte chunks in fp32 (fma per element), then a warp's
// butterfly; in the combine each token's K slots are added in order.
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

// The combine of a block's output rows [h0, h0 + rows): out[t, h] = the sum of c3[h - h0, t K + k]
// over k in order (c3 in shared memory, [rows, P] in fp32; a dead slot's 0 leaves the sum as
// skipping it), thread `tid` of `threads` taking elements tid, tid + threads, ...
__device__ __forceinline__ void combine_rows(const float* c3, SCALAR_T* out, int h0, int rows,
                                             int T, int K, int H, int tid, int threads) {
    const int P = T * K;
    for (int idx = tid; idx < rows * T; idx += threads) {
        const int t = idx / rows, hl = idx % rows;
        float sum = 0.0f;
        for (int k = 0; k < K; ++k) sum = __fadd_rn(sum, c3[hl * P + t * K + k]);
        from_f32(sum, &out[(long long)t * H + h0 + hl]);
    }
}
