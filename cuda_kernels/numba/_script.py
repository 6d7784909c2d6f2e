"""What the stage modules need when they run as scripts: the script's frame, parity numbers
and CUDA-event timing.

    main(stage, lines)   the script: availability, one line per case, the verdict, exit status
    timed(fn, *host)     ", T us, X GB/s" of fn on device copies of host ('' on the simulator)
    rel_err(a, b)        ||a - b||_F / ||b||_F in float64 (inf if a has a NaN that b lacks)
    time_ms(fn)          median milliseconds of fn() by the one GPU timer (cuda_kernels/timing.py:
                         CuPy's or torch's events on the default stream, which Numba's launches
                         use; GPU only: the simulator's scripts skip timing)
    first_call_s(fn)     wall time of the first call: the JIT compile a notebook user waits for
"""
from __future__ import annotations

import functools
import time

import numpy as np

from .. import timing
from ._arrays import availability, cuda, is_simulator, to_device, to_host


def main(stage: str, lines) -> int:
    """A module run as a script: whether numba can run here, then one printed line per case of
    `lines(rng)` (a generator of (text, ok): the case's parity with the reference, and on a GPU
    its timing), then the verdict. Exit status 1 when a case failed; 0 when nothing could run."""
    ok, why = availability()
    print(f"numba {stage}: {why}")
    if not ok:
        return 0
    failures = 0
    for text, good in lines(np.random.default_rng(0)):
        failures += not good
        print(text, flush=True)
    print("all match" if not failures else f"{failures} mismatches")
    return 1 if failures else 0


def timed(fn, *host, reps: int = 20, nbytes: float = 0, flops: float = 0) -> str:
    """", T us" of fn(*device copies of host) on the GPU (the median of CUDA events), with the
    achieved ", X GB/s" of nbytes moved and ", Y TFLOP/s" of flops when given; "" on the
    simulator, whose timings mean nothing."""
    if is_simulator():
        return ""
    args = [to_device(h) for h in host]
    ms = time_ms(lambda: fn(*args), reps=reps)
    text = f", {ms * 1e3:8.1f} us"
    if nbytes:
        text += f", {nbytes / ms / 1e6:7.1f} GB/s"
    if flops:
        text += f", {flops / ms / 1e9:6.2f} TFLOP/s"
    return text


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
