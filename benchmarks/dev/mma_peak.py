"""Dev calibration: mma.sync m16n8k16 (bf16 and fp16, fp32 accumulators) throughput on this GPU.
Each warp runs CH independent accumulator chains for ITER rounds; blocks of WARPS warps, grid
SMS x BLOCKS. Prints TFLOP/s and HMMA per SM-cycle (the clock from cudaDevAttrClockRate).
    python benchmarks/dev/mma_peak.py"""
import sys

import numpy as np

SRC = r"""
template <int H, int CH>
__global__ void mma_loop(float* out, int iters, unsigned seed) {
    unsigned a0 = seed ^ threadIdx.x, a1 = a0 * 3u, a2 = a0 * 5u, a3 = a0 * 7u, b0 = a0 * 11u,
             b1 = a0 * 13u;
    float d[CH][4] = {};
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int c = 0; c < CH; ++c) {
            if (H)
                asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                             "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                             : "+f"(d[c][0]), "+f"(d[c][1]), "+f"(d[c][2]), "+f"(d[c][3])
                             : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
            else
                asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                             "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                             : "+f"(d[c][0]), "+f"(d[c][1]), "+f"(d[c][2]), "+f"(d[c][3])
                             : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        }
    }
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c) s += d[c][0] + d[c][1] + d[c][2] + d[c][3];
    if (s == 1.2345f) out[0] = s;
}
"""


def main():
    import cupy
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    sms, khz = props["multiProcessorCount"], props["clockRate"]
    names = [f"mma_loop<{h}, {c}>" for h in (0, 1) for c in (1, 2, 4, 8)]
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",), name_expressions=names)
    out = cupy.zeros(1, cupy.float32)
    iters = 4096
    for name in names:
        k = mod.get_function(name)
        ch = int(name.split(",")[1].strip(" >"))
        for warps, blocks in ((4, 1), (4, 2), (8, 2), (16, 1), (8, 4)):
            grid = sms * blocks
            k((grid,), (32 * warps,), (out, np.int32(iters), np.uint32(7)))
            s, e = cupy.cuda.Event(), cupy.cuda.Event()
            s.record()
            k((grid,), (32 * warps,), (out, np.int32(iters), np.uint32(7)))
            e.record()
            e.synchronize()
            ms = cupy.cuda.get_elapsed_time(s, e)
            n = grid * warps * iters * ch
            tf = n * 4096 / (ms * 1e-3) / 1e12
            per_cyc = n / sms / (ms * 1e-3 * khz * 1e3)
            print(f"{name:18s} warps/SM {warps * blocks:3d}: {tf:6.1f} TFLOP/s, "
                  f"{per_cyc:.3f} HMMA per SM-cycle at {khz / 1e3:.0f} MHz", flush=True)


if __name__ == "__main__":
    sys.exit(main())
