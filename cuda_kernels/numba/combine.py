"""The combine in Numba: sum each token's K expert outputs.

    T = tokens, K = top-k, H = hidden

    moe_sum(x) -> out [T, H]      x [T, K, H]; out[t, h] = sum_k x[t, k, h]

fp32 accumulation in slot order k = 0..K-1 (NumPy's order for this reduction, so fp32 inputs
match the reference bit for bit), rounded once to x's dtype (reference/experts.py). The router
weights are already applied by GEMM2 (mul_routed_weight), as in vLLM.

Kernel `moe_sum_kernel`: block = NT threads over h, grid = (cdiv(H, NT), min(T, 65535)), rows
strided by gridDim.y, no shared memory. Each thread reads K elements H apart (every read
coalesced across the warp) and writes one. K <= 32 is compiled in (one kernel per K), so the
K loads are unrolled and in flight together.

dtypes: fp32, fp16, bf16 (uint16 bits, converted by shifts in the kernel: _device.py).

Run as a script to validate against reference/ and time: python -m cuda_kernels.numba.combine
"""
from __future__ import annotations

import functools
import sys

import numpy as np
from numba import float32

from . import _arrays as A
from ._device import SIMULATOR, cast_out, cu, ix, kernel, to_f32

CONFIGS = {"sum": {"THREADS": 256}}
MAX_UNROLLED_K = 32   # K up to this is a compile-time constant (one kernel per K)
SIM_CONFIGS = {"sum": {"THREADS": 16}}
MAX_GRID_Y = 65535


def config(name):
    return (SIM_CONFIGS if SIMULATOR else CONFIGS)[name]


@functools.lru_cache(maxsize=None)
def moe_sum_kernel(NT: int, KC: int = 0):
    """The combine kernel; KC > 0 fixes K at compile time, so the K loads of an output are
    unrolled and in flight together (a runtime-K loop waits out each load's latency)."""

    def moe_sum_rows(x, out, T, K, H):
        """out[t, h] = sum_k x[t, k, h] in fp32, rounded once."""
        for t in range(cu.blockIdx.y, T, cu.gridDim.y):
            for h in range(cu.blockIdx.x * NT + cu.threadIdx.x, H, cu.gridDim.x * NT):
                acc = float32(0.0)
                if KC > 0:
                    for k in range(KC):
                        acc += to_f32(x[ix(t), k, ix(h)])
                else:
                    for k in range(K):
                        acc += to_f32(x[ix(t), ix(k), ix(h)])
                out[ix(t), ix(h)] = cast_out(out, acc)

    return kernel(moe_sum_rows)


def moe_sum(x):
    """The combine: out[t] = sum_k x[t, k] over the K slots, fp32, rounded once.
    [T, K, H] -> [T, H]"""
    A.check_float("x", x, ndim=3)
    T, K, H = A.shape_of(x)
    call = A.Call("x", x)
    out = call.empty((T, H), A.dtype_of(x))                                # [T, H]
    if T and H:
        NT = config("sum")["THREADS"]
        xd = call.dev("x", x)
        kernel = moe_sum_kernel(NT, K if K <= MAX_UNROLLED_K else 0)
        kernel[(A.cdiv(H, NT), min(T, MAX_GRID_Y)), NT](xd, out, T, K, H)
    return call.result(out)


def compile_cases():
    """(label, kernel, argument types) of every launch above, for the PTX checks (_ptx.py)."""
    from numba import types as t

    return [(f"moe_sum K={kc or 'runtime'} {dt}", moe_sum_kernel(CONFIGS["sum"]["THREADS"], kc),
             (t.Array(dt, 3, "C"), t.Array(dt, 2, "C"), t.int64, t.int64, t.int64))
            for dt in (t.float32, t.float16, t.uint16) for kc in (8, 0)]


def _main():
    import reference

    from . import _script as S

    ok, why = A.availability()
    print(f"numba combine: {why}")
    if not ok:
        return 0
    rng = np.random.default_rng(0)
    shapes = [(3, 2, 8)] if SIMULATOR else [(1, 8, 7168), (256, 8, 2048), (4096, 8, 7168)]
    failures = 0
    for T, K, H in shapes:
        for dt in (np.float32, np.float16):
            x = rng.standard_normal((T, K, H)).astype(dt)                     # [T, K, H]
            err = S.rel_err(moe_sum(x), reference.moe_sum(x))
            failures += not err <= (1e-5 if dt == np.float32 else 1e-2)
            line = f"  moe_sum [{T}, {K}, {H}] {np.dtype(dt).name}: rel err {err:.1e}"
            if not SIMULATOR:
                d = A.to_device(x)
                ms = S.time_ms(lambda: moe_sum(d))
                nbytes = x.nbytes * (K + 1) / K   # read x, write out
                line += f", {ms * 1e3:8.1f} us, {nbytes / ms / 1e6:7.1f} GB/s"
            print(line)
    print("all match" if not failures else f"{failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_main())
