"""The staged rung's PTX (nvcc on this machine), assembled by other ptxas versions: a cubin per
ptxas, its registers and md5, for benchmarks/dev/probe_staged.py's `cubin=PATH` variants (ptxas
does the register allocation and the schedule; the newer ones come in the nvidia-cuda-nvcc
wheels: pip download --no-deps nvidia-cuda-nvcc==13.5.37, unzip, nvidia/cu13/bin/ptxas).
    python benchmarks/dev/ptxas_cubins.py --out DIR [--tree DIR] [--configs t24]
                                          /usr/local/bin/ptxas /path/to/13.5/ptxas ...
Writes DIR/<config>_<ptxas version>.cubin and, beside it, .name (the kernel's mangled name).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tree", default=".")
    p.add_argument("--out", required=True)
    p.add_argument("--configs", default="t24")
    p.add_argument("ptxas", nargs="+")
    args = p.parse_args(argv)
    tree = os.path.abspath(args.tree)
    sys.path.insert(0, tree)
    from cuda_kernels.cupy import _compile as C
    from cuda_kernels.cupy import quant_gemm_wna16 as W

    os.makedirs(args.out, exist_ok=True)
    for cfg in args.configs.split(","):
        name = W.staged_kernel_name(W.STAGED_CONFIGS[cfg], False)
        src = C.source_text(W.CU_STAGED, {"ELEM_BF16": 1})
        src += f"\nvoid* ptxas_cubins_kernel() {{ return (void*)&{name}; }}\n"
        cu, ptx = (os.path.join(args.out, f"{cfg}.{x}") for x in ("cu", "ptx"))
        open(cu, "w").write(src)
        inc = [f"-I{x}" for x in C.cuda_include_dirs()] + [f"-I{tree}/cuda_kernels/cupy"]
        subprocess.run(["nvcc", "-arch=sm_90", "-ptx", "-std=c++17", *inc, cu, "-o", ptx],
                       check=True)
        mangled = next(ln.split()[-1].rstrip("(") for ln in open(ptx)
                       if ln.startswith(".visible .entry") and "wna16_staged" in ln)
        for px in args.ptxas:
            ver = subprocess.run([px, "--version"], capture_output=True, text=True).stdout
            tag = re.search(r"release (\d+\.\d+), V([\d.]+)", ver).group(2)
            cubin = os.path.join(args.out, f"{cfg}_{tag}.cubin")
            r = subprocess.run([px, "-arch=sm_90", "-O3", "-v", ptx, "-o", cubin],
                               capture_output=True, text=True, check=True)
            open(cubin + ".name", "w").write(mangled + "\n")
            regs = [ln.split("info    :")[-1].strip() for ln in r.stderr.splitlines()
                    if "registers" in ln][-2:-1]   # the staged kernel's (the other: f16_rows)
            md5 = hashlib.md5(open(cubin, "rb").read()).hexdigest()[:12]
            print(f"{cfg} ptxas {tag}: {cubin} {md5} {'; '.join(regs)}", flush=True)


if __name__ == "__main__":
    main()
