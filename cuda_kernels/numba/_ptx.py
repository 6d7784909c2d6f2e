"""Compile every kernel specialisation the stages launch to PTX, without a GPU (CPU CI).

The simulator runs the kernels' Python, not what the GPU runs: warp shuffles, the `overload`s
of _device.py (bf16 bit casts, unsigned indices) and numba's typing of the real target are
only exercised by compiling. `cuda.compile_ptx` needs no GPU, except that numba asks the
current device for its compute capability when it compiles a device function; `assume_device`
answers for it. Run in a process where numba is *not* in simulator mode.

    compile_cases()          [(label, dispatcher, argtypes)]: every kernel x dtype launched
    compile_case(d, types)   the PTX text for one
    check_all(cc=(9, 0), ptxas=None)   {label: None or the error}; with a ptxas, the v3 GEMM
                             kernels must also show no stack frame and no spills
    python -m cuda_kernels.numba._ptx [--ptxas PATH]
"""
from __future__ import annotations

import contextlib
import sys
import time
from types import SimpleNamespace

from . import _arrays as A


@contextlib.contextmanager
def assume_device(cc=(9, 0)):
    """numba's device-function compiles ask the current device for its compute capability:
    answer `cc` without a driver (and restore the real query afterwards)."""
    import numba.cuda.dispatcher as disp

    old = disp.get_current_device
    disp.get_current_device = lambda: SimpleNamespace(compute_capability=tuple(cc))
    try:
        yield
    finally:
        disp.get_current_device = old


def compile_cases():
    """Every (kernel, argument types) the stage modules launch with their GPU configs."""
    if A.is_simulator():
        raise RuntimeError("compile_cases: numba is in simulator mode (NUMBA_ENABLE_CUDASIM=1); "
                           "PTX checks need the real CUDA target")
    import importlib

    cases = []
    for module in ("routing", "align", "permute", "activation", "combine", "gemm"):
        mod = importlib.import_module(f"{__package__}.{module}")
        cases.extend(mod.compile_cases())
    return cases


def compile_case(dispatcher, argtypes, cc=(9, 0)) -> str:
    cu = A.cuda()
    with assume_device(cc):
        ptx, _ = cu.compile_ptx(dispatcher.py_func, tuple(argtypes), cc=tuple(cc))
    return ptx


def ptxas_resources(ptx: str, ptxas: str, arch: str = "sm_90") -> str:
    """ptxas -v's resource line(s) for a PTX text (registers, stack, spills)."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        r = subprocess.run([ptxas, f"-arch={arch}", "-v", f.name, "-o", "/dev/null"],
                           capture_output=True, text=True, check=False)
    if r.returncode:
        raise RuntimeError(f"ptxas failed: {r.stderr[-2000:]}")
    return " | ".join(line.split("info    :")[-1].strip() for line in r.stderr.splitlines()
                      if "registers" in line or "stack frame" in line)


def check_all(cc=(9, 0), verbose=False, ptxas=None, ptxas_filter=" v3 ") -> dict:
    """{label: None, or the error} over compile_cases(); with `ptxas` (a path), the kernels
    whose label contains `ptxas_filter` also go through ptxas, and any stack frame or spill
    counts as an error (their register tiles must stay in registers)."""
    results = {}
    for label, dispatcher, argtypes in compile_cases():
        t0 = time.perf_counter()
        note = ""
        try:
            ptx = compile_case(dispatcher, argtypes, cc)
            results[label] = None
            if ptxas and ptxas_filter in label:
                note = ptxas_resources(ptx, ptxas, f"sm_{cc[0]}{cc[1]}")
                if "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" not in note:
                    results[label] = f"local memory: {note}"
        except Exception as e:   # report every failure, not just the first
            results[label] = f"{type(e).__name__}: {e}"
        if verbose:
            status = "ok" if results[label] is None else "FAIL"
            print(f"{status:4s} {label} ({time.perf_counter() - t0:.1f} s) {note}", flush=True)
    return results


def main(argv=None) -> int:
    import argparse
    import shutil

    ap = argparse.ArgumentParser(description="compile every Numba kernel to PTX, no GPU needed")
    ap.add_argument("--ptxas", default=shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas",
                    help="ptxas for the v3 register check ('' to skip)")
    args = ap.parse_args(argv)
    import os

    ptxas = args.ptxas if args.ptxas and os.path.exists(args.ptxas) else None
    res = check_all(verbose=True, ptxas=ptxas)
    bad = {k: v for k, v in res.items() if v}
    for k, v in bad.items():
        print(f"\n{k}:\n{v}")
    print(f"{len(res) - len(bad)}/{len(res)} kernels compile for sm_90"
          + ("; v3 register tiles checked with ptxas" if ptxas else "; ptxas not found"))
    return 1 if bad or not res else 0


if __name__ == "__main__":
    sys.exit(main())
