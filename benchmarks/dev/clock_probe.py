"""Dev probe: the SM clock and power while the staged int4 GEMMs run back to back (Mixtral, T
tokens), sampled by nvidia-smi every 20 ms, against the clock with the GPU idle. Says whether
the kernels run power-limited (clocks below the boost clock under load).
    python benchmarks/dev/clock_probe.py [--tokens 64] [--config t24] [--seconds 2]"""
import argparse
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, ".")
from benchmarks.bench_wna16 import (E, GROUP, H, I, K, draw_routing, random_bf16,  # noqa: E402
                                    random_bytes)
from cuda_kernels.cupy import _compile as C  # noqa: E402
from cuda_kernels.cupy import quant_gemm_wna16 as W  # noqa: E402


def main():
    import cupy
    from reference import moe_align_block_size
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--config", default="t24")
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()
    w1, w2 = random_bytes((E, 2 * I, H // 2), 1), random_bytes((E, H, I // 2), 2)
    s1 = cupy.random.uniform(1e-3, 2e-3, (E, 2 * I, H // GROUP), dtype=cupy.float32)
    s2 = cupy.random.uniform(1e-3, 2e-3, (E, H, I // GROUP), dtype=cupy.float32)
    ids, tw = draw_routing(np.random.default_rng(0), args.tokens)
    x, act = random_bf16((args.tokens, H), 10), random_bf16((args.tokens * K, I), 20)
    cfg = W.STAGED_CONFIGS[args.config]
    B = -(-32 // (8 * cfg["MT"])) * 8 * cfg["MT"]
    st, ex, ntp = (C.to_device(v) for v in moe_align_block_size(ids, B, E))
    twd = C.to_device(tw)

    def pair():
        W.grouped_gemm_wna16(x, w1, st, ex, ntp, K, B, w_scale=s1, use_int4_w4a16=True,
                             config=cfg)
        W.grouped_gemm_wna16(act, w2, st, ex, ntp, 1, B, twd, True, w_scale=s2,
                             use_int4_w4a16=True, config=cfg)
    pair()
    cupy.cuda.runtime.deviceSynchronize()
    smi = ["nvidia-smi", "--format=csv,noheader,nounits", "-lms", "20",
           "--query-gpu=clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active"]
    idle = subprocess.run(smi[:2] + smi[4:], capture_output=True, text=True).stdout.strip()
    print(f"idle: {idle}", flush=True)
    ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()
    n = 0
    proc = subprocess.Popen(smi, stdout=subprocess.PIPE, text=True)
    t_end = time.time() + args.seconds
    ev0.record()
    while time.time() < t_end:
        for _ in range(50):
            pair()
        n += 50
    ev1.record()
    ev1.synchronize()
    proc.terminate()
    out = proc.communicate()[0].strip().splitlines()
    ms = cupy.cuda.get_elapsed_time(ev0, ev1)
    print(f"{n} GEMM1 + GEMM2 pairs in {ms:.1f} ms: {ms / n * 1e3:.1f} us each (warm L2, "
          f"launches back to back)", flush=True)
    rows = [r.split(", ") for r in out if r.count(",") >= 3]
    sm = np.array([float(r[0]) for r in rows[2:-2]]) if len(rows) > 4 else np.array([])
    pw = np.array([float(r[2]) for r in rows[2:-2]]) if len(rows) > 4 else np.array([])
    if sm.size:
        print(f"under load ({sm.size} samples): SM clock p10/p50/p90 "
              f"{np.percentile(sm, 10):.0f}/{np.median(sm):.0f}/{np.percentile(sm, 90):.0f} MHz, "
              f"power p50 {np.median(pw):.0f} W; throttle reasons seen: "
              f"{sorted(set(r[3] for r in rows))}", flush=True)


if __name__ == "__main__":
    main()
