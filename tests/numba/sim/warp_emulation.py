"""Warp intrinsics for the CUDA simulator, for tests only.

The simulator has no warp-level intrinsics (shfl_*_sync, match_any_sync, ...), so the
kernels' GPU-only paths (routing's "warp" flavour, alignment's "warp" ranks) cannot run there
as shipped. Inside `emulated_warps()` the simulator's fake `cuda` module gains them: each
simulated thread is a Python thread, so the 32 lanes of a warp meet at a barrier, publish
their values and read each other's, which is what the hardware does in one step. That runs
the very code the GPU runs (modulo numba's compilation), at the simulator's speed.

    shfl_xor_sync, shfl_sync, match_any_sync, ballot_sync, lanemask_lt, syncwarp
"""
import contextlib
import threading

import numpy as np
from numba.cuda.simulator import kernelapi

_TIMEOUT_S = 120   # a lane that never arrives (an exception elsewhere) breaks the barrier


class _Warps:
    def __init__(self):
        self.lock = threading.Lock()
        self.state = {}

    def exchange(self, value):
        """Every lane of the caller's warp gives `value`; returns (all 32 values, lane)."""
        t = threading.current_thread()
        bx, by, bz = t._manager._block_dim
        nthreads = bx * by * bz
        warp, lane = divmod(t.thread_id, 32)
        key = (tuple(t.blockIdx), warp)
        with self.lock:
            if key not in self.state:
                parties = min(32, nthreads - warp * 32)
                self.state[key] = (threading.Barrier(parties), [None] * parties)
            barrier, values = self.state[key]
        values[lane] = value
        barrier.wait(_TIMEOUT_S)
        seen = list(values)
        barrier.wait(_TIMEOUT_S)   # nobody overwrites `values` before all have read them
        return seen, lane


@contextlib.contextmanager
def emulated_warps():
    warps = _Warps()

    def shfl_xor_sync(self, mask, value, lane_mask):
        seen, lane = warps.exchange(value)
        return seen[(lane ^ int(lane_mask)) % len(seen)]

    def shfl_sync(self, mask, value, src_lane):
        seen, _ = warps.exchange(value)
        return seen[int(src_lane) % len(seen)]

    def match_any_sync(self, mask, value):
        seen, _ = warps.exchange(value)
        return np.uint32(sum(1 << i for i, v in enumerate(seen) if v == value))

    def ballot_sync(self, mask, predicate):
        seen, _ = warps.exchange(bool(predicate))
        return np.uint32(sum(1 << i for i, v in enumerate(seen) if v))

    def lanemask_lt(self):
        return np.uint32((1 << (threading.current_thread().thread_id % 32)) - 1)

    def syncwarp(self, mask=0xFFFFFFFF):
        warps.exchange(None)

    added = dict(shfl_xor_sync=shfl_xor_sync, shfl_sync=shfl_sync,
                 match_any_sync=match_any_sync, ballot_sync=ballot_sync,
                 lanemask_lt=lanemask_lt, syncwarp=syncwarp)
    cls = kernelapi.FakeCUDAModule
    saved = {k: cls.__dict__[k] for k in added if k in cls.__dict__}
    for k, f in added.items():
        setattr(cls, k, f)
    try:
        yield
    finally:
        for k in added:
            if k in saved:
                setattr(cls, k, saved[k])
            else:
                delattr(cls, k)
