"""Compile kernels of quant_gemm_wna16's rungs in parallel processes before a device session
times them, so that CuPy's on-disk cache holds them and the timed process only loads them.

    python benchmarks/dev/precompile.py [--elems bf16,fp16] NAME [NAME ...]   (names: "staged"
    for every STAGED_NAMES entry, or kernel names)
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import time


def _one(job):
    name, elem = job
    from cuda_kernels.cupy import quant_gemm_wna16 as W
    t = time.time()
    cu = W.CU_STAGED if name in W.STAGED_NAMES else W.CU
    W._kernel(name, W.ELEMS[elem], 0, cu)
    return f"{name} {elem}: {time.time() - t:.1f} s"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--elems", default="bf16")
    p.add_argument("names", nargs="+")
    args = p.parse_args()
    from cuda_kernels.cupy import quant_gemm_wna16 as W
    names = [n for x in args.names for n in (W.STAGED_NAMES if x == "staged" else (x,))]
    jobs = [(n, e) for n in names for e in args.elems.split(",")]
    with cf.ProcessPoolExecutor(max_workers=min(14, len(jobs))) as ex:
        for line in ex.map(_one, jobs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
