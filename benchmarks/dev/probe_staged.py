"""Dev probe of wna16_staged (T = 64 Mixtral, GEMM1 / GEMM2): the same launches with the kernel
compiled under STAGED_PROBE = 1 (no math), 2 (no activation copies), 3 (no weight copies),
beside the real one (0), each with STAGED_BULK = 0 / 1 (the weights by cp.async / one bulk
copy per stage). Times only; the probes' outputs are garbage.
    python benchmarks/dev/probe_staged.py [--configs t24,f24] [--tokens 64] [--variants 0:0,1:0]"""
import argparse
import json
import sys

import numpy as np

sys.path.insert(0, ".")
from benchmarks.bench_wna16 import E, GROUP, H, I, K, Timer, draw_routing, random_bf16, random_bytes  # noqa
from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy import quant_gemm_wna16 as W


def main():
    import cupy
    from reference import moe_align_block_size
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="t24")
    p.add_argument("--tokens", default="64")
    p.add_argument("--out", default="/tmp")
    p.add_argument("--variants", default="0:0,0:1,0:2,0:3", help="BULK:PROBE pairs")
    args = p.parse_args()
    w1 = random_bytes((E, 2 * I, H // 2), 1)
    w2 = random_bytes((E, H, I // 2), 2)
    s1 = cupy.random.uniform(1e-3, 2e-3, (E, 2 * I, H // GROUP), dtype=cupy.float32)
    s2 = cupy.random.uniform(1e-3, 2e-3, (E, H, I // GROUP), dtype=cupy.float32)
    timer, rows = Timer(), []
    rng = np.random.default_rng(0)
    for T in map(int, args.tokens.split(",")):
        ids, tw = draw_routing(rng, T)
        x, act = random_bf16((T, H), 10 + T), random_bf16((T * K, I), 20 + T)
        for cname in args.configs.split(","):
            cfg = W.STAGED_CONFIGS[cname]
            B = -(-32 // (8 * cfg["MT"])) * 8 * cfg["MT"]
            st, ex, ntp = (C.to_device(v) for v in moe_align_block_size(ids, B, E))
            twd = C.to_device(tw)
            g1 = lambda: W.grouped_gemm_wna16(x, w1, st, ex, ntp, K, B, w_scale=s1, use_int4_w4a16=True, config=cname)  # noqa
            g2 = lambda: W.grouped_gemm_wna16(act, w2, st, ex, ntp, 1, B, twd, True, w_scale=s2, use_int4_w4a16=True, config=cname)  # noqa
            for var in args.variants.split(","):
                bulk, probe = map(int, var.split(":"))
                W._READY.clear()
                if probe or bulk:
                    for zp in (False,):
                        name = W.staged_kernel_name(cfg, zp)
                        kern = C.get_kernel(W.CU_STAGED, name, {"ELEM_BF16": 1, "STAGED_PROBE": probe,
                                                                   "STAGED_BULK": bulk},
                                            (name,))
                        W._READY[(name, 1, cupy.cuda.Device().id)] = kern
                        W._SMEM_SET.pop((name, 1, cupy.cuda.Device().id), None)
                g1(), g2()
                fl = lambda: timer.flush.fill(1)
                t1, t2 = timer(g1, fl, 3, 20), timer(g2, fl, 3, 20)
                rows.append(dict(T=T, config=cname, bulk=bulk, probe=probe, gemm1_us=t1 * 1e3, gemm2_us=t2 * 1e3))
                print(f"T={T} {cname} bulk {bulk} probe {probe}: g1 {t1 * 1e3:7.1f} us g2 {t2 * 1e3:7.1f} us", flush=True)
    json.dump(rows, open(f"{args.out}/probe_staged.json", "w"), indent=1)


if __name__ == "__main__":
    main()
