"""The staged rung's launcher instantiations built for sm_90 by nvcc (no GPU needed): registers,
spills and an md5 of each cubin, to tell on the CPU whether a change of the .cu changes the code
nvcc builds (a build is deterministic: the same source gives the same bytes, and moving lines
does not change them). The GPU runs another build: t24 from its NVRTC 13.5 prebuilt cubin
(cuda_kernels/cupy/prebuilt; tests/test_prebuilt.py fails when the .cu changed since), the other
configs built by CuPy's NVRTC. nvcc 13.0 schedules the main loops as NVRTC 13.0-13.2 do, not as
NVRTC 13.5 (dev_wna16_20261202b): `python -m cuda_kernels.cupy.prebuild --sass DIR` gives the
SASS the GPU runs.
    python benchmarks/dev/staged_cubins.py [--tree DIR] [--macros STAGED_LT_COST=3,ELEM_BF16=0]
                                           [--configs t24,f24] [--sass DIR]
--tree: another checkout (`git worktree add DIR COMMIT`) whose .cu and package to build.
--sass: also write each cubin's SASS to DIR/<config>.sass (cuobjdump and nvdisasm: on the device
image, or on the CPU from the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels' bin/ on the
PATH); benchmarks/dev/sass_mix.py reads it.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile


def build(C, W, cfg_name: str, defines: dict, tree: str,
          sass: str | None = None) -> tuple[str, str]:
    """(md5 of the cubin, ptxas's register / spill lines) of one config; its SASS to sass."""
    name = W.staged_kernel_name(W.STAGED_CONFIGS[cfg_name], False)
    src = C.source_text(W.CU_STAGED, defines)
    # nvcc builds the kernels a host function refers to (NVRTC takes the names instead)
    src += f"\nvoid* staged_cubins_kernel() {{ return (void*)&{name}; }}\n"
    with tempfile.TemporaryDirectory() as d:
        cu, cubin = os.path.join(d, "k.cu"), os.path.join(d, "k.cubin")
        open(cu, "w").write(src)
        inc = [f"-I{x}" for x in C.cuda_include_dirs()] + [f"-I{tree}/cuda_kernels/cupy"]
        r = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-std=c++17", "-Xptxas", "-v",
                            *inc, cu, "-o", cubin], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{cfg_name}: nvcc failed\n{r.stderr[-3000:]}")
        md5 = hashlib.md5(open(cubin, "rb").read()).hexdigest()[:12]
        if sass:
            with open(sass, "w") as f:
                subprocess.run(["cuobjdump", "-sass", cubin], stdout=f, check=True)
    info, fn = [], ""
    for ln in (r.stdout + r.stderr).splitlines():     # ptxas -v: per entry function
        m = re.search(r"Compiling entry function '([^']+)'", ln)
        if m:
            fn = m.group(1)
        elif "wna16_staged" in fn and re.search(r"Used \d+ registers|spill stores", ln):
            info.append(ln.split("info    :")[-1].strip())
    return md5, "; ".join(info)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tree", default=".")
    p.add_argument("--macros", default="")
    p.add_argument("--configs", default="")
    p.add_argument("--sass", default="")
    args = p.parse_args(argv)
    if shutil.which("nvcc") is None:
        raise SystemExit("needs nvcc on the PATH")
    tree = os.path.abspath(args.tree)
    sys.path.insert(0, tree)
    from cuda_kernels.cupy import _compile as C
    from cuda_kernels.cupy import quant_gemm_wna16 as W

    defines = {"ELEM_BF16": 1}
    for kv in filter(None, args.macros.split(",")):
        k, v = kv.split("=")
        defines[k] = int(v)
    for cfg_name in (args.configs.split(",") if args.configs else sorted(W.STAGED_CONFIGS)):
        sass = os.path.join(args.sass, f"{cfg_name}.sass") if args.sass else None
        md5, info = build(C, W, cfg_name, defines, tree, sass)
        print(f"{cfg_name:4s} {md5}  {info}", flush=True)


if __name__ == "__main__":
    main()
