// activation.cu: the MoE activations between GEMM1 and GEMM2, elementwise in fp32.
//
// Shapes: M rows (P = T * K slots in a MoE layer), N = 2 D input columns (GEMM1's 2I),
//         D = N / 2 output columns for the *_and_mul kernels.
//
// Math (docs/stages.md, "activation"; every value computed in fp32, rounded to SCALAR_T where
// vLLM's CUDA kernels round: act(gate) before the multiply, then the product; the others once):
//   act_and_mul_kernel<ACT>  out[m, j] = round(act(x[m, j])) * x[m, D + j]    (gate | up halves)
//       ACT 0 silu(g) = g / (1 + exp(-g))
//       ACT 1 gelu(g) = g / 2 * (1 + erf(g / sqrt 2))                          (exact)
//       ACT 2 gelu_tanh(g) = g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3)))
//   swigluoai_and_mul_kernel  gate = x[m, 2j], up = x[m, 2j + 1]                (interleaved)
//       gate = min(gate, limit), up = clip(up, -limit, limit),
//       out[m, j] = ((up + 1) * gate) / (1 + exp(-alpha gate))  (vLLM's order; gpt-oss: alpha
//       1.702, limit 7)
//   act_kernel<ACT>          out[m, n] = act(x[m, n]), ACT 0 silu, 1 gelu, 2 gelu_tanh,
//                            3 relu2 = max(x, 0)^2
// min / clip / relu keep NaN (like np.minimum / np.clip), unlike fminf.
//
// Launch geometry (activation.py): block = min(ACT_THREADS, cdiv(width / VEC, 32) * 32)
//   (a narrow row, like Qwen3's I = 768, does not leave most of a block idle), each VEC
//   consecutive output columns (VEC * sizeof(SCALAR_T) <= 16 bytes: one 16-byte load per
//   operand when the row width and the pointers allow it, else 8, 4 or 2 bytes, down to 1);
//   grid = M * cdiv(width, block * VEC), flattened (row = block / chunks) so that M is
//   not bound by gridDim.y's 65535. No shared memory.
//
// Compile-time parameters: SCALAR_T (float, __half, __nv_bfloat16), ACT_THREADS (the largest
//   block, tunable); templates ACT, VEC. Versions: v1 (this file). Run: python -m cuda_kernels.cupy.activation

// to_f32, from_f32, Pack, load, store, act<ACT>, round_to<T>
#include "elementwise.cuh"

#ifndef SCALAR_T
#define SCALAR_T float
#endif
#ifndef ACT_THREADS
#define ACT_THREADS 256
#endif

// out[m, j] = round(act(x[m, j])) * x[m, D + j]
template <int ACT, int VEC>
__global__ void __launch_bounds__(ACT_THREADS)
act_and_mul_kernel(const SCALAR_T* __restrict__ x,  // [M, 2D]
                   SCALAR_T* __restrict__ out,      // [M, D]
                   int M, int D, int chunks) {
    const int m = blockIdx.x / chunks;
    const int col = ((blockIdx.x % chunks) * blockDim.x + threadIdx.x) * VEC;
    if (m >= M || col >= D) return;  // D % VEC == 0 (activation.py)
    const SCALAR_T* row = x + (size_t)m * 2 * D;
    const Pack<SCALAR_T, VEC> g = load<VEC>(row + col);
    const Pack<SCALAR_T, VEC> u = load<VEC>(row + D + col);
    Pack<SCALAR_T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
        // act(g) rounded to SCALAR_T first (vLLM's act_and_mul: ACT returns a scalar_t)
        from_f32(round_to<SCALAR_T>(act<ACT>(to_f32(g.v[j]))) * to_f32(u.v[j]), &o.v[j]);
    store<VEC>(out + (size_t)m * D + col, o);
}

// gpt-oss: gate and up interleaved; each thread reads 2 VEC inputs and writes VEC outputs
template <int VEC>
__global__ void __launch_bounds__(ACT_THREADS)
swigluoai_and_mul_kernel(const SCALAR_T* __restrict__ x,  // [M, 2D], (gate, up) pairs
                         SCALAR_T* __restrict__ out,      // [M, D]
                         int M, int D, int chunks, float alpha, float limit) {
    const int m = blockIdx.x / chunks;
    const int col = ((blockIdx.x % chunks) * blockDim.x + threadIdx.x) * VEC;
    if (m >= M || col >= D) return;
    const SCALAR_T* src = x + (size_t)m * 2 * D + 2 * col;
    const Pack<SCALAR_T, VEC> a = load<VEC>(src);        // pairs col .. col + VEC/2 - 1
    const Pack<SCALAR_T, VEC> b = load<VEC>(src + VEC);  // the next VEC/2 pairs (VEC = 1: up)
    float in[2 * VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) { in[j] = to_f32(a.v[j]); in[VEC + j] = to_f32(b.v[j]); }
    Pack<SCALAR_T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        float g = in[2 * j], u = in[2 * j + 1];
        g = g > limit ? limit : g;                            // min(g, limit), NaN kept
        u = u > limit ? limit : (u < -limit ? -limit : u);    // clip(u, -limit, limit), NaN kept
        from_f32(((u + 1.0f) * g) / (1.0f + expf(-alpha * g)), &o.v[j]);   // vLLM's order
    }
    store<VEC>(out + (size_t)m * D + col, o);
}

// out[m, n] = act(x[m, n]) (is_act_and_mul=False)
template <int ACT, int VEC>
__global__ void __launch_bounds__(ACT_THREADS)
act_kernel(const SCALAR_T* __restrict__ x,  // [M, N]
           SCALAR_T* __restrict__ out,      // [M, N]
           int M, int N, int chunks) {
    const int m = blockIdx.x / chunks;
    const int col = ((blockIdx.x % chunks) * blockDim.x + threadIdx.x) * VEC;
    if (m >= M || col >= N) return;
    const Pack<SCALAR_T, VEC> v = load<VEC>(x + (size_t)m * N + col);
    Pack<SCALAR_T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) from_f32(act<ACT>(to_f32(v.v[j])), &o.v[j]);
    store<VEC>(out + (size_t)m * N + col, o);
}
