"""The staged rung built by this machine's NVRTC (cuda.core: the prebuilt cubins' compiler)
under other compiler options and configs: a cubin per build for benchmarks/dev/probe_staged.py's
`cubin=PATH` variants (benchmarks/dev/cubins_call.sh times them on the GPU).

    python benchmarks/dev/nvrtc_sweep.py --out DIR [--builds s4,rul0,kc1s8] [--unique]

Each build is a config of quant_gemm_wna16.STAGED_CONFIGS with overrides (the probe's
`t24+S=3` spelling) and a set of cuda.core ProgramOptions (its "arch": sm_90a for the
warp-specialized configs, whose setmaxnreg needs it; sm_90 by default), and optionally one of
the dataflow's roles ("act": GEMM1 with silu_and_mul fused, "awaits": its GEMM2). Writes
DIR/<build>.cubin, beside it .name (the kernel's mangled name), .config (the probe's config
spec) and .kernel (the launcher's name of the kernel), and prints per build its registers,
spill bytes and the md5 of its code section (prebuild.text_md5): two builds of the same md5
run the same instructions, so only one of them needs timing (--unique writes only the first).
"""
from __future__ import annotations

import argparse
import io
import os
import pathlib
import re
import sys

# build name -> (config spec, ProgramOptions fields beside _compile's own, and "defines": the
# .cu's macros)
BUILDS = {
    "plain": ("t24", {}),
    "expensive": ("t24", dict(ptxas_options="--allow-expensive-optimizations=true")),
    **{f"rul{n}": ("t24", dict(ptxas_options=f"--register-usage-level={n}"))
       for n in (0, 2, 4, 6, 8, 10)},
    **{f"maxreg{n}": ("t24", dict(max_register_count=n)) for n in (216, 224, 240, 255)},
    "nomerge": ("t24", dict(ptxas_options="--dont-merge-basicblocks")),
    "noconst": ("t24", dict(ptxas_options="--disable-optimizer-constants")),
    "vector": ("t24", dict(extra_device_vectorization=True)),
    "ptxO2": ("t24", dict(ptxas_options="-O2")),
    "restrict": ("t24", dict(restrict=True)),
    "s4": ("t24+S=4", {}),
    "s3": ("t24+S=3", {}),
    "s2": ("t24+S=2", {}),
    "kc3s3": ("t24+KC=3+S=3", {}),
    "kc3s2": ("t24+KC=3+S=2", {}),
    "kc1s8": ("t24+KC=1+S=8", {}),
    "kc1s6": ("t24+KC=1+S=6", {}),
    "kc4s2": ("t24+KC=4+S=2", {}),
    "kc1s7": ("t24+KC=1+S=7", {}),
    "u24": ("u24", {}),
    # one CTA of 8 warps per SM (the same warps per SM): each activation stage feeds 512 rows
    **{f"w8s{n}": (f"t24+W=8+MINB=1+S={n}", {}) for n in (3, 4, 5)},
    # 3 tiles a warp (fewer accumulators): 8 or 10 warps of one CTA per SM
    "w8tpw3": ("t24+W=8+TPW=3+MINB=1+S=4", {}),
    "w10tpw3": ("t24+W=10+TPW=3+MINB=1+S=4", {}),
    **{f"w8s4_cost{n}": ("t24+W=8+MINB=1+S=4", dict(defines={"STAGED_LT_COST": n}))
       for n in (4, 7)},
    "w8s4_rul6": ("t24+W=8+MINB=1+S=4", dict(ptxas_options="--register-usage-level=6")),
    **{f"{b}_rul{n}": (spec, dict(ptxas_options=f"--register-usage-level={n}"))
       for b, spec in (("s3", "t24+S=3"), ("kc1s8", "t24+KC=1+S=8"), ("kc1s6", "t24+KC=1+S=6"))
       for n in (0, 6)},
    "ptxmaxreg216": ("t24", dict(ptxas_options="--maxrregcount=216")),
    # warp-specialized (WS = the producers' registers): a producer warpgroup for the copies,
    # mbarriers between the roles (setmaxnreg: sm_90a); 4 consumer warps, 2 CTAs per SM, or 8 of
    # one CTA per SM (a stage's activations feed 512 rows)
    **{f"ws_s{n}_p{r}": (f"t24+WS={r}+W=4+MINB=2+S={n}", dict(arch="sm_90a"))
       for n in (3, 4) for r in (24, 32, 40, 56, 72)},
    **{f"ws_w8_s{n}_p{r}": (f"t24+WS={r}+W=8+MINB=1+S={n}", dict(arch="sm_90a"))
       for n in (3, 4, 5) for r in (40, 48, 56, 64, 72, 80)},
    **{f"ws_w8_s4_p56_cost{n}": ("t24+WS=56+W=8+MINB=1+S=4",
                                 dict(arch="sm_90a", defines={"STAGED_LT_COST": n}))
       for n in (3, 4, 6, 7)},
    **{f"ws_w8_s4_p56_seg{n}": ("t24+WS=56+W=8+MINB=1+S=4",
                                dict(arch="sm_90a", defines={"STAGED_SEG_COST": n}))
       for n in (0, 8, 16, 32, 64)},
    # silu_and_mul fused (ACT: the dataflow's GEMM1): the store at one site or two, the silu
    # exact or by __expf / __fdividef
    **{f"act_sites{n}{('', '_fast', '_nomath')[f]}": ("t24+WS=56+W=8+MINB=1+S=4", dict(
        arch="sm_90a", act=True, defines={"STAGED_ACT_SITES": n, "STAGED_ACT_FAST": f}))
       for n in (1, 2) for f in (0, 1, 2)},
    # the dataflow's GEMM2 (awaits) with its runs skewed by CTA order (per mille: the first
    # CTAs', which start earliest, that much longer, the last ones' shorter)
    **{f"flow_skew{n}": ("t24+WS=56+W=8+MINB=1+S=4",
                         dict(arch="sm_90a", awaits=True, defines={"STAGED_FLOW_SKEW": n}))
       for n in (0, 40, 80, 120, 160)},
    # the dataflow's GEMM2 with its last CTA's run shorter by n per mille (it starts last)
    **{f"last_short{n}": ("t24+WS=56+W=8+MINB=1+S=4",
                          dict(arch="sm_90a", awaits=True, defines={"STAGED_LAST_SHORT": n}))
       for n in (0, 20, 40, 80)},
    # the dev macros of the .cu (STAGED_*): here a unit's cost in the runs' split, LT + n
    **{f"cost{n}": ("t24", dict(defines={"STAGED_LT_COST": n})) for n in (3, 4, 6, 7)},
    **{f"s3_cost{n}": ("t24+S=3", dict(defines={"STAGED_LT_COST": n})) for n in (4, 6)},
}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--builds", default=",".join(BUILDS))
    p.add_argument("--unique", action="store_true", help="skip a build whose code repeats one's")
    args = p.parse_args(argv)
    sys.path.insert(0, ".")
    from benchmarks.bench_wna16 import _config_override
    from cuda_kernels.cupy import _compile as C
    from cuda_kernels.cupy import prebuild
    from cuda_kernels.cupy import quant_gemm_wna16 as W

    os.makedirs(args.out, exist_ok=True)
    seen = {}
    for build in args.builds.split(","):
        spec, extra = BUILDS[build]
        extra = dict(extra)
        src = C.source_text(W.CU_STAGED, {"ELEM_BF16": 1, **extra.pop("defines", {})})
        arch = extra.pop("arch", "sm_90")
        role = dict(act=extra.pop("act", False), awaits=extra.pop("awaits", False))
        _, cfg = _config_override(dict(W.STAGED_CONFIGS), spec)
        name = W.staged_kernel_name(cfg, False, **role)
        # the prebuilt cubins' compile (prebuild.build), plus this build's fields and ptxas -v
        ptxas = ["-v"] + ([extra["ptxas_options"]] if "ptxas_options" in extra else [])
        logs = io.StringIO()
        obj = C._nvrtc_compile(src, (name,), arch, C._BASE_OPTIONS, W.CU_STAGED,
                               program_options=dict(extra, ptxas_options=ptxas), logs=logs)
        mangled = obj.symbol_mapping[name]
        mangled = mangled.decode() if isinstance(mangled, bytes) else mangled
        cubin = bytes(obj.code)
        log = logs.getvalue().split(mangled)[-1]     # ptxas -v: the staged kernel's lines
        md5 = prebuild.text_md5(cubin, mangled)
        regs = re.findall(r"Used (\d+) registers", log)
        spill = re.findall(r"(\d+) bytes spill stores", log)
        same = seen.get(md5)
        print(f"{build:10s} {spec:14s} text {md5} regs {regs[0] if regs else '?'} spill "
              f"{spill[0] if spill else '?'}" + (f"  (the code of {same})" if same else ""),
              flush=True)
        if same and args.unique:
            continue
        seen.setdefault(md5, build)
        path = pathlib.Path(args.out) / f"{build}.cubin"
        path.write_bytes(cubin)
        pathlib.Path(f"{path}.name").write_text(mangled + "\n")
        pathlib.Path(f"{path}.config").write_text(spec + "\n")
        pathlib.Path(f"{path}.kernel").write_text(name + "\n")


if __name__ == "__main__":
    main()
