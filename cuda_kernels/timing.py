"""The GPU timer of the benchmarks: CUDA events or CUDA graphs through torch or CuPy, with
the L2 flushed and the inputs rotated before every rep, outside the timed region.

    time_cuda(fn, warmup, reps, rotate=..., flush_l2=True, graph=False)   CUDA events (torch or
                                 CuPy, whichever is present) or a CUDA graph per rep; the L2 is
                                 flushed and `rotate(i)` (new inputs, new routing) runs before
                                 every rep, outside the timed region. -> Stats in milliseconds
    time_host(fn)                the host's microseconds per eager call, the GPU idle before it
    time_cpu(fn, warmup, reps, rotate=...)                               the same on the host
    summarize(samples)           median with p20/p80 (and mean, min, max, n)
    cuda_api(prefer)             the CudaApi of torch or CuPy that sees a CUDA device, or None

Why flush and rotate: a small problem fits in the 50 MB L2 of an H200, so timing the same
inputs back to back measures L2, not HBM. Writing a buffer of twice the L2 size between reps
evicts everything; re-drawing the routing makes each rep touch a different set of experts.

CUDA graphs (`graph=True`) suit work with static shapes and no host synchronisation; a
capture that records nothing (the work ran on another stream than the capture's) raises
EmptyGraph, never a time.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Stats:
    """Timing summary in milliseconds; p20/p80 bracket the median."""

    median: float
    p20: float
    p80: float
    mean: float
    min: float
    max: float
    n: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def summarize(samples) -> Stats:
    """Median, 20th and 80th percentiles (linear interpolation), mean, min, max of `samples`."""
    a = np.asarray(list(samples), dtype=np.float64)
    if a.size == 0:
        raise ValueError("samples: expected at least one timing, got none")
    p20, med, p80 = np.percentile(a, [20, 50, 80])
    return Stats(float(med), float(p20), float(p80), float(a.mean()), float(a.min()),
                 float(a.max()), int(a.size))


class CudaApi:
    """CUDA events, synchronisation, L2 size and graphs through torch or CuPy."""

    def __init__(self, name: str):
        self.name = name
        if name == "torch":
            import torch
            self.lib = torch
        elif name == "cupy":
            import cupy
            self.lib = cupy
        else:
            raise ValueError(f"api: expected 'torch' or 'cupy', got {name!r}")
        self._flush_buf = None

    def event(self):
        if self.name == "torch":
            return self.lib.cuda.Event(enable_timing=True)
        return self.lib.cuda.Event()

    def synchronize(self):
        if self.name == "torch":
            self.lib.cuda.synchronize()
        else:
            self.lib.cuda.runtime.deviceSynchronize()

    def elapsed_ms(self, start, end) -> float:
        if self.name == "torch":
            return float(start.elapsed_time(end))
        return float(self.lib.cuda.get_elapsed_time(start, end))

    def l2_bytes(self) -> int:
        try:
            if self.name == "torch":
                return int(self.lib.cuda.get_device_properties(
                    self.lib.cuda.current_device()).L2_cache_size)
            dev = self.lib.cuda.runtime.getDevice()
            return int(self.lib.cuda.runtime.getDeviceProperties(dev)["l2CacheSize"])
        except Exception:
            return 64 << 20  # a safe guess above every current card's L2 but the B200's

    def flush_l2(self):
        """Write 2x the L2 size: every line that the previous rep left in L2 is evicted."""
        if self._flush_buf is None:
            n = 2 * self.l2_bytes()
            if self.name == "torch":
                self._flush_buf = self.lib.empty(n, dtype=self.lib.uint8, device="cuda")
            else:
                self._flush_buf = self.lib.empty(n, dtype=self.lib.uint8)
        if self.name == "torch":
            self._flush_buf.zero_()
        else:
            self._flush_buf.fill(0)

    def capture(self, fn: Callable[[], Any]):
        """Capture `fn` into a CUDA graph; returns replay()."""
        if self.name == "torch":
            torch = self.lib
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):   # allocations warm up off the default stream
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.cuda.graph(graph):
                    fn()
            for w in caught:
                if "empty" in str(w.message).lower():
                    # the work ran on another stream than the capture's: a replay does
                    # nothing, and timing it would time nothing
                    raise EmptyGraph("the CUDA graph captured no work (torch: "
                                     f"{str(w.message).strip()[:120]})")
            return graph.replay
        cupy = self.lib
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            fn()
            stream.begin_capture()
            fn()
            graph = stream.end_capture()
        stream.synchronize()

        def replay():
            graph.launch(stream=cupy.cuda.get_current_stream())
        return replay


class EmptyGraph(RuntimeError):
    """A CUDA graph capture that recorded no work (a replay would time nothing)."""


def cuda_api(prefer: str | None = None) -> CudaApi | None:
    """The first of torch / CuPy that sees a CUDA device (or `prefer` when it does)."""
    order = [prefer] if prefer else []
    order += [n for n in ("torch", "cupy") if n not in order]
    for name in order:
        try:
            if name == "torch":
                import torch
                if torch.cuda.is_available():
                    return CudaApi("torch")
            else:
                import cupy
                if cupy.cuda.is_available():
                    return CudaApi("cupy")
        except Exception:
            continue
    return None


def time_cuda(fn: Callable[[], Any], warmup: int = 10, reps: int = 50,
              rotate: Callable[[int], Any] | None = None, flush_l2: bool = True,
              graph: bool = False, api: CudaApi | None = None) -> Stats:
    """Time `fn()` on the GPU: `warmup` untimed runs, then `reps` runs, each between two CUDA
    events on the current stream. Before every run (outside the events): `rotate(i)` when
    given (new routing, next input buffer: it must write into the buffers `fn` reads when
    `graph=True`), then an L2 flush. `graph=True` captures `fn` once into a CUDA graph and
    times its replays (launch overhead out of the picture). Returns Stats in milliseconds."""
    api = api or cuda_api()
    if api is None:
        raise RuntimeError("time_cuda: expected a CUDA device visible to torch or CuPy, "
                           "found none")
    run = fn
    if graph:
        if rotate:
            rotate(0)
        run = api.capture(fn)
    pairs = []
    for i in range(warmup + reps):
        if rotate:
            rotate(i)
        if flush_l2:
            api.flush_l2()
        if i < warmup:
            run()
            continue
        start, end = api.event(), api.event()
        start.record()
        run()
        end.record()
        pairs.append((start, end))
    api.synchronize()
    return summarize(api.elapsed_ms(s, e) for s, e in pairs)


def time_host(fn: Callable[[], Any], reps: int = 20,
              rotate: Callable[[int], Any] | None = None, api: CudaApi | None = None) -> Stats:
    """The host's time per call of an eager `fn` (launch parameters, checks, Python), with the
    GPU idle before each call: synchronize, then `perf_counter` around the call alone (its
    kernels are queued, not waited for). Returns Stats in microseconds."""
    api = api or cuda_api()
    samples = []
    for i in range(reps):
        if rotate:
            rotate(i)
        api.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    api.synchronize()
    return summarize(samples)


def time_cpu(fn: Callable[[], Any], warmup: int = 1, reps: int = 5,
             rotate: Callable[[int], Any] | None = None) -> Stats:
    """Wall-clock `fn()` on the host with `perf_counter`, `rotate(i)` untimed before each run.
    Returns Stats in milliseconds."""
    samples = []
    for i in range(warmup + reps):
        if rotate:
            rotate(i)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            samples.append(dt * 1e3)
    return summarize(samples)
