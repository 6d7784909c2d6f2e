"""What the stage modules need when they run as scripts: parity numbers and CUDA-event timing.

    rel_err(a, b)     ||a - b||_F / ||b||_F in float64 (inf if a has a NaN that b lacks)
    time_ms(fn)       median milliseconds of fn() by the one GPU timer (cuda_kernels/timing.py:
                      CuPy's or torch's events on the default stream, which Numba's launches
                      use; GPU only: the simulator's scripts skip timing)
    first_call_s(fn)  wall time of the first call: the JIT compile a notebook user waits for
"""
from __future__ import annotations

import functools
import time

import numpy as np

from .. import timing
from ._arrays import cuda, to_host


def rel_err(a, b) -> float:
    a = np.asarray(to_host(a)).astype(np.float64)
    b = np.asarray(to_host(b)).astype(np.float64)
    if a.shape != b.shape:
        return float("inf")
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        return float("inf")
    a, b = np.where(nan_a, 0, a), np.where(nan_b, 0, b)
    denom = np.linalg.norm(b)
    num = np.linalg.norm(a - b)
    if denom == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / denom)


@functools.lru_cache(maxsize=1)
def _api():
    return timing.cuda_api("cupy")     # CuPy's events first; one flush buffer per process


def time_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median milliseconds of fn() (the L2 flushed before every call)."""
    return timing.time_cuda(fn, warmup, reps, api=_api()).median


def first_call_s(fn) -> float:
    """Seconds of the first fn() (compile + launch), synchronised."""
    cu = cuda()
    cu.synchronize()
    t0 = time.perf_counter()
    fn()
    cu.synchronize()
    return time.perf_counter() - t0
