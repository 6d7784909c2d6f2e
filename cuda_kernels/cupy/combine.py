"""The combine: sum each token's K expert outputs (combine.cu).

Shapes: T tokens, K top-k slots, H hidden size.

    moe_sum(x, topk_ids=None, expert_map=None) -> [T, H]
        x [T, K, H]; out[t] = sum_k x[t, k], fp32 in slot order, one rounding; with topk_ids
        (vLLM's pad-aware moe_sum) only the live slots: id >= 0 and, with expert_map, local

Launch: block = min(SUM_THREADS, H / VEC rounded up to a warp), each thread VEC columns (16-byte loads when H and the base
pointers allow), grid = T * cdiv(H, block * VEC). Deterministic: no atomics.

Run as a script to validate against reference/ and time: python -m cuda_kernels.cupy.combine
"""
from __future__ import annotations


import numpy as np

from . import _arrays as A
from . import _compile as C
from ._geometry import row_geometry
from ._script import rel_err, script_start

CONFIGS = {"moe_sum_kernel": {"SUM_THREADS": 128}}
_VECS = (1, 2, 4, 8)
_NAMES = tuple(f"moe_sum_kernel<{v}>" for v in _VECS) + tuple(
    f"moe_sum_live_kernel<{v}>" for v in _VECS)


def _defines(dtype) -> dict:
    return {"SCALAR_T": A.ctype_of(dtype), **CONFIGS["moe_sum_kernel"]}


for _dt in A.float_dtypes():
    C.register_compile_case("combine.cu", _defines(_dt), _NAMES)


def _int32(name, a, ndim, shape=None):
    import cupy

    A.check_array(name, a, ndim=ndim, shape=shape)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer dtype, got {a.dtype}")
    return a if a.dtype == np.int32 else a.astype(cupy.int32)


def moe_sum(x, topk_ids=None, expert_map=None):
    """out[t, h] = sum_k x[t, k, h], fp32 in slot order, rounded once to x.dtype. [T, K, H] -> [T, H]

    With topk_ids [T, K] (vLLM's pad-aware moe_sum) a slot with a negative id, or with
    expert_map a non-local expert, is skipped: its row is never read."""
    A.check_array("x", x, ndim=3, dtypes=A.float_dtypes())
    T, K, H = x.shape
    ids = emap = None
    if topk_ids is not None:
        ids = _int32("topk_ids", topk_ids, 2, (T, K))
        if expert_map is not None:
            emap = _int32("expert_map", expert_map, 1)
    out = A.empty((T, H), x.dtype)  # [T, H]
    if T == 0 or H == 0:
        return out
    if K == 0:
        A.raw(out).fill(0)  # all-zero bits are +0.0 in every float format
        return out
    g = row_geometry("x", T, H, CONFIGS["moe_sum_kernel"]["SUM_THREADS"], x, out, vecs=_VECS)
    if ids is None:
        kernel = C.get_kernel("combine.cu", f"moe_sum_kernel<{g.vec}>", _defines(x.dtype), _NAMES)
        kernel((g.grid,), (g.threads,),
               (A.raw(x), A.raw(out), np.int32(T), np.int32(K), np.int32(H), np.int32(g.chunks)))
        return out
    kernel = C.get_kernel("combine.cu", f"moe_sum_live_kernel<{g.vec}>", _defines(x.dtype),
                          _NAMES)
    kernel((g.grid,), (g.threads,),
           (A.raw(x), ids, emap if emap is not None else A.null_ptr(),
            np.int32(0 if emap is None else emap.shape[0]), A.raw(out), np.int32(T),
            np.int32(K), np.int32(H), np.int32(g.chunks)))
    return out


# ----------------------------------------------------------------------------- script
def _main(argv=None):
    quick, timed = script_start(argv)  # --quick: small shapes, 3 timed calls (sanitizers)
    import reference

    rng = np.random.default_rng(0)
    print(f"{'case':40s} {'rel err':>9s} {'median us':>10s} {'GB/s':>8s}")
    for dtype in A.float_dtypes():
        cases = ((1, 8, 7168), (64, 8, 7168), (4096, 8, 2048), (4096, 2, 4096), (16384, 8, 7168))
        if quick:
            cases = ((1, 8, 72), (9, 3, 130))
        for T, K, H in cases:
            x = rng.standard_normal((T, K, H)).astype(dtype)                    # [T, K, H]
            d_x = A.to_device(x)
            got = moe_sum(d_x)
            err = rel_err(A.to_host(got), reference.moe_sum(x))
            ms = timed(lambda d_x=d_x: moe_sum(d_x)).median
            nbytes = x.nbytes + got.nbytes  # read [T, K, H], write [T, H]
            name = f"moe_sum T={T} K={K} H={H} {np.dtype(dtype).name}"
            print(f"{name:40s} {err:9.2e} {ms * 1e3:10.1f} {nbytes / ms / 1e6:8.1f}")


if __name__ == "__main__":
    _main()
