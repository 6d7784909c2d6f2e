"""Dev probe: does a fence wait for the thread's cp.async copies still in flight? Each thread of
264 CTAs x 128 keeps 3 stages of 4 16-byte cp.async in flight over a 1 GB buffer (the memory
system loaded as in the staged GEMM), optionally stores 48 floats (st.cg, a part's share), then
times with clock64 (tid 0 of each CTA, at stage 10 of 20): the fence variant, then the
cp.async.wait_all after it. A fence that waits for the copies takes the time the wait would.
    python benchmarks/dev/fence_probe.py [--out DIR]"""
import argparse
import json

import numpy as np

SRC = r"""
extern "C" __global__ void __launch_bounds__(128)
probe(const uint4* __restrict__ src, size_t n16, float* __restrict__ ws, long long* out,
      int variant, int store) {
    __shared__ __align__(16) uint4 ring[4][4][128];
    const int tid = threadIdx.x;
    size_t at = ((size_t)blockIdx.x * 977 * 1024 + tid) % n16;
    long long t_fence = 0, t_wait = 0;
    for (int it = 0; it < 20; ++it) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            unsigned d = (unsigned)__cvta_generic_to_shared(&ring[it & 3][j][tid]);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d),
                         "l"(src + at) : "memory");
            at = (at + 128 * 264) % n16;
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
        if (it == 10) {
            if (store)
                for (int j = 0; j < 48; ++j)
                    __stcg(ws + ((size_t)blockIdx.x * 48 + j) * 128 + tid, (float)j);
            __syncwarp();
            const long long c0 = clock64();
            if (variant == 1) asm volatile("fence.sc.gpu;" ::: "memory");
            if (variant == 2) asm volatile("fence.acq_rel.gpu;" ::: "memory");
            if (variant == 3) __threadfence();
            const long long c1 = clock64();
            asm volatile("cp.async.wait_all;" ::: "memory");
            const long long c2 = clock64();
            t_fence = c1 - c0;
            t_wait = c2 - c1;
        } else {
            asm volatile("cp.async.wait_group 2;" ::: "memory");
        }
        __syncthreads();
    }
    if (tid == 0) {
        out[2 * blockIdx.x] = t_fence;
        out[2 * blockIdx.x + 1] = t_wait;
    }
}
"""


def main():
    import cupy
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp")
    args = p.parse_args()
    k = cupy.RawKernel(SRC, "probe", options=("-arch=sm_90", "-std=c++17"))
    src = cupy.zeros(1 << 30, cupy.uint8)
    ws = cupy.zeros(264 * 48 * 128, cupy.float32)
    out = cupy.zeros(2 * 264, cupy.int64)
    rows = []
    names = {0: "none", 1: "fence.sc.gpu", 2: "fence.acq_rel.gpu", 3: "__threadfence()"}
    for store in (0, 1):
        for variant in (0, 1, 2, 3):
            fs, ws_ = [], []
            for _ in range(5):
                k((264,), (128,), (src, np.uint64(src.nbytes // 16), ws, out, np.int32(variant),
                                   np.int32(store)))
                h = cupy.asnumpy(out).reshape(-1, 2)
                fs.append(np.median(h[:, 0]))
                ws_.append(np.median(h[:, 1]))
            f, w = float(np.median(fs)), float(np.median(ws_))
            rows.append(dict(variant=names[variant], store=store, fence_cycles=f, wait_cycles=w))
            print(f"store {store} {names[variant]:18s}: fence {f:7.0f} cycles, then the "
                  f"cp.async wait {w:7.0f}", flush=True)
    json.dump(rows, open(f"{args.out}/fence_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main()
