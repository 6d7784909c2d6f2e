"""What the kernel modules need when they run as scripts: the start and the parity number.

    quick, timed = script_start(argv)   --quick: small shapes, and timed(fn) = 1 warm-up and
                                        3 timed calls, no L2 flush (a run under a sanitizer);
                                        else the one GPU timer's defaults (cuda_kernels/
                                        timing.py); exits with the reason when no GPU is usable
    rel_err(a, b)                       ||a - b||_F / ||b||_F in float64
"""
from __future__ import annotations

import sys

from .. import timing
from ._arrays import availability


def script_start(argv=None):
    """(quick, timed): `--quick` in argv (default sys.argv) asks for small shapes and few
    calls; timed(fn) returns the Stats (milliseconds) of fn's GPU time, measured by
    timing.time_cuda through CuPy's events (the L2 flushed before every call). Exits with the
    reason when no GPU is usable."""
    quick = "--quick" in (sys.argv[1:] if argv is None else argv)
    ok, why = availability()
    if not ok:
        raise SystemExit(f"needs a CUDA GPU: {why}")
    api = timing.CudaApi("cupy")
    if quick:   # a sanitizer's run: its times mean nothing, so no L2 flush to instrument
        return quick, lambda fn: timing.time_cuda(fn, warmup=1, reps=3, flush_l2=False,
                                                  api=api)
    return quick, lambda fn: timing.time_cuda(fn, api=api)


def rel_err(a, b) -> float:
    """||a - b||_F / ||b||_F in float64 (NaN when either holds a NaN; 0 for two empty arrays)."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"rel_err: shapes differ, {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    if np.isnan(a).any() or np.isnan(b).any():
        return float("nan")
    den = np.linalg.norm(b)
    num = np.linalg.norm(a - b)
    return float(num / den) if den > 0 else float(num)
