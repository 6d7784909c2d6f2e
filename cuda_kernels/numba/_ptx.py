"""Compile every kernel specialisation the stages launch to PTX, without a GPU (CPU CI).

The simulator runs the kernels' Python, not what the GPU runs: warp shuffles, the `overload`s
of _device.py (bf16 bit casts, unsigned indices) and numba's typing of the real target are
only exercised by compiling. `cuda.compile_ptx` needs no GPU, except that numba asks the
current device for its compute capability when it compiles a device function; `assume_device`
answers for it. Run in a process where numba is *not* in simulator mode.

    compile_cases()          [(label, dispatcher, argtypes)]: every kernel x dtype launched
    compile_case(d, types)   the PTX text for one
    check_all(cc=(9, 0))     {label: None or the error}; `python -m cuda_kernels.numba._ptx`
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
    for module in ("routing", "permute", "activation", "combine", "grouped_gemm"):
        mod = importlib.import_module(f"{__package__}.{module}")
        cases.extend(mod.compile_cases())
    return cases


def compile_case(dispatcher, argtypes, cc=(9, 0)) -> str:
    cu = A.cuda()
    with assume_device(cc):
        ptx, _ = cu.compile_ptx(dispatcher.py_func, tuple(argtypes), cc=tuple(cc))
    return ptx


def check_all(cc=(9, 0), verbose=False) -> dict:
    results = {}
    for label, dispatcher, argtypes in compile_cases():
        t0 = time.perf_counter()
        try:
            compile_case(dispatcher, argtypes, cc)
            results[label] = None
        except Exception as e:   # report every failure, not just the first
            results[label] = f"{type(e).__name__}: {e}"
        if verbose:
            status = "ok" if results[label] is None else "FAIL"
            print(f"{status:4s} {label} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return results


if __name__ == "__main__":
    res = check_all(verbose=True)
    bad = {k: v for k, v in res.items() if v}
    for k, v in bad.items():
        print(f"\n{k}:\n{v}")
    print(f"{len(res) - len(bad)}/{len(res)} kernels compile for sm_90")
    sys.exit(1 if bad else 0)
