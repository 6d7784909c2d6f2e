"""Dev probe: what the staged rung's FA mode (fp16 activations, codes dequantized as fp16) costs
and saves, split (Mixtral, CUDA events, median of 20, L2 flushed before each repetition).

For each token count, alternating: t24's GEMM1 / GEMM2; f24's as grouped_gemm_wna16 runs them
(wna16_f16_rows converts the bf16 activations first, one launch); f24's GEMM alone (the
conversion's results computed once before, outside the timing); and the conversion alone
(wna16_f16_rows on x [T, H] and on the activation [T K, I]). The GEMM-alone times are what a
layer would pay if the conversion came with the kernel before it (an activation that writes
fp16 rows).
    python benchmarks/dev/fa_split.py [--tokens 64,16] [--rounds 2] [--out DIR]
"""
import argparse
import json
import sys

import numpy as np

sys.path.insert(0, ".")
from benchmarks.bench_wna16 import (E, H, I, K, Timer, draw_routing,  # noqa: E402
                                    mixtral_weights, random_bf16)
from cuda_kernels.cupy import _compile as C  # noqa: E402
from cuda_kernels.cupy import quant_gemm_wna16 as W  # noqa: E402


def main():
    import cupy

    from reference import moe_align_block_size
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="64,16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="/tmp")
    args = p.parse_args()
    w1, w2, s1, s2 = mixtral_weights()
    timer, rows = Timer(), []
    fl = lambda: timer.flush.fill(1)  # noqa: E731
    rng = np.random.default_rng(0)
    convert = W._device_f16_rows
    for T in map(int, args.tokens.split(",")):
        ids, tw = draw_routing(rng, T)
        x, act = random_bf16((T, H), 10 + T), random_bf16((T * K, I), 20 + T)
        B = 48                                       # a multiple of t24's 24 rows, as bench_quant
        st, ex, ntp = (C.to_device(v) for v in moe_align_block_size(ids, B, E))
        twd = C.to_device(tw)
        pre = {id(x): convert(x), id(act): convert(act)}   # the conversions, done once

        def gemms(cfg, cached):
            def with_conversion(fn):
                def run():
                    if cached:
                        W._device_f16_rows = lambda a: pre[id(a)]
                    try:
                        return fn()
                    finally:
                        W._device_f16_rows = convert
                return run
            g1 = with_conversion(lambda: W.grouped_gemm_wna16(
                x, w1, st, ex, ntp, K, B, w_scale=s1, use_int4_w4a16=True, config=cfg))
            g2 = with_conversion(lambda: W.grouped_gemm_wna16(
                act, w2, st, ex, ntp, 1, B, twd, True, w_scale=s2, use_int4_w4a16=True,
                config=cfg))
            return g1, g2
        ref = [cupy.asnumpy(g()) for g in gemms("t24", False)]
        for rnd in range(args.rounds):
            for label, cfg, cached in (("t24", "t24", False), ("f24", "f24", False),
                                       ("f24 GEMM alone", "f24", True)):
                g1, g2 = gemms(cfg, cached)
                outs = [cupy.asnumpy(g()).astype(np.float64) for g in (g1, g2)]
                err = [float(np.linalg.norm(o - r.astype(np.float64)) /
                             np.linalg.norm(r.astype(np.float64))) for o, r in zip(outs, ref)]
                t1, t2 = timer(g1, fl, 3, 20), timer(g2, fl, 3, 20)
                rows.append(dict(T=T, round=rnd, what=label, gemm1_us=t1 * 1e3,
                                 gemm2_us=t2 * 1e3, rel_diff_to_t24=err))
                print(f"T={T} {label:15s} g1 {t1 * 1e3:7.1f} us g2 {t2 * 1e3:7.1f} us "
                      f"(relative difference to t24 {err[0]:.1e} / {err[1]:.1e})", flush=True)
            c1 = timer(lambda: convert(x), fl, 3, 20)
            c2 = timer(lambda: convert(act), fl, 3, 20)
            rows.append(dict(T=T, round=rnd, what="conversion", x_us=c1 * 1e3, act_us=c2 * 1e3))
            print(f"T={T} conversion alone: x {c1 * 1e3:.1f} us, act {c2 * 1e3:.1f} us",
                  flush=True)
    json.dump(rows, open(f"{args.out}/fa_split.json", "w"), indent=1)


if __name__ == "__main__":
    main()
