"""The one GPU timer: every benchmark, the benchmark harness (sandbox.bench), the tuner and
every kernel module run as a script time GPU work here. CUDA events or CUDA graph replays
through torch or CuPy (whichever sees a device; kernels of any library that launch on the
current stream, Numba's on the default stream included, are timed alike), the L2 flushed and
the inputs rotated before every rep, outside the timed region, medians with p20 / p80.

    time_cuda(fn, warmup, reps, rotate=..., flush_l2=True, graph=False, mode="queued")
                                 -> Stats in milliseconds
    cuda_samples(...)            the same loop, the milliseconds of every rep
    cuda_segments(fn, marks, ...)  fn(mark) calls mark() `marks` times: per rep the
                                 milliseconds of the marks + 1 segments, then the total
    time_host(fn)                the host's microseconds per eager call, the GPU idle before it
    time_cpu(fn, warmup, reps, rotate=...)                               the same on the host
    summarize(samples)           median with p20/p80 (and mean, min, max, n)
    cuda_api(prefer)             the CudaApi of torch or CuPy that sees a CUDA device, or None

What a rep's two events bracket depends on `mode` (the benchmarks' JSON names the last two
"device_us" and "eager_us"):
    "queued"   reps follow each other with no wait: the host enqueues the next rep while the
               GPU runs (the L2 flush ahead of each rep gives it the head start), so the events
               bracket GPU work unless the host falls behind
    "device"   each rep starts from an idle GPU, then a spin kernel holds the GPU for
               `spin_us` while the host enqueues fn: the events bracket fn's GPU work alone,
               its kernels back to back
    "eager"    each rep starts from an idle GPU: the events also see the host's launch
               overhead (argument checks, Python), what an eager caller pays

Why flush and rotate: a small problem fits in the 50 MB L2 of an H200, so timing the same
inputs back to back measures L2, not HBM. Writing a buffer of twice the L2 size between reps
evicts everything; re-drawing the routing makes each rep touch a different set of experts.

CUDA graphs (`graph=True`) suit work with static shapes and no host synchronisation; a
capture that records nothing (the work ran on another stream than the capture's) raises
EmptyGraph, never a time.

The CUDA simulator of Numba (CPU CI) has no events: scripts there skip timing, and
`cuda_api()` is None on a machine without a GPU (time_cuda then raises, saying so).
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


# Cycles of the spin kernel per microsecond: at most 2 GHz on the cards we time (H100 and H200
# boost to 1.98 GHz), so a spin of `us` microseconds lasts at least that long at any clock.
SPIN_CYCLES_PER_US = 2000
SPIN_US = 1000.0    # longer than Python takes to enqueue one call of a layer (~0.1-0.4 ms)

_SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    // one thread keeps the GPU busy while the host enqueues the timed call: the events that
    // follow then bracket device work only
    const long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""

MODES = ("queued", "device", "eager")


class CudaApi:
    """CUDA events, synchronisation, L2 size, a spin kernel and graphs through torch or CuPy."""

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
        self._spin_kernel = None

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

    def spin(self, us: float):
        """Keep the GPU busy for at least `us` microseconds (one thread spinning on clock64)."""
        cycles = int(us * SPIN_CYCLES_PER_US)
        if self.name == "torch":
            self.lib.cuda._sleep(cycles)
            return
        if self._spin_kernel is None:
            self._spin_kernel = self.lib.RawKernel(_SPIN_SOURCE, "spin")
        self._spin_kernel((1,), (1,), (np.int64(cycles),))

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


def _timed_reps(fn, warmup, reps, rotate, flush_l2, graph, mode, marks, spin_us, sync, api):
    """The loop behind time_cuda, cuda_samples and cuda_segments: per timed rep, the
    milliseconds between consecutive events (marks + 1 of them), then (with marks) the total
    from the first event to the last."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if graph and marks:
        raise ValueError("marks: a CUDA graph replays as one piece; expected marks=0 with graph")
    api = api or cuda_api()
    if api is None:
        raise RuntimeError("time_cuda: expected a CUDA device visible to torch or CuPy, "
                           "found none")
    wait = sync or api.synchronize
    run = fn
    if graph:
        if rotate:
            rotate(0)
        run = api.capture(fn)
    reps_events = []
    for i in range(warmup + reps):
        if rotate:
            rotate(i)
        if flush_l2:
            api.flush_l2()
        if mode != "queued":
            wait()
        if i < warmup:
            if marks:
                run(lambda: None)
            else:
                run()
            continue
        if mode == "device":
            api.spin(spin_us)
        events = [api.event() for _ in range(marks + 2)]
        events[0].record()
        if marks:
            inner = events[1:-1]

            def mark():
                if not inner:
                    raise ValueError(f"marks: fn called mark() more than {marks} times")
                inner.pop(0).record()
            run(mark)
            if inner:
                raise ValueError(f"marks: fn called mark() {marks - len(inner)} times, "
                                 f"expected {marks}")
        else:
            run()
        events[-1].record()
        reps_events.append(events)
    wait()
    out = []
    for ev in reps_events:
        segs = [api.elapsed_ms(a, b) for a, b in zip(ev, ev[1:])]
        out.append(segs + [api.elapsed_ms(ev[0], ev[-1])] if marks else segs)
    return out


def cuda_samples(fn: Callable[[], Any], warmup: int = 10, reps: int = 50,
                 rotate: Callable[[int], Any] | None = None, flush_l2: bool = True,
                 graph: bool = False, mode: str = "queued", spin_us: float = SPIN_US,
                 sync: Callable[[], Any] | None = None, api: CudaApi | None = None) -> list[float]:
    """The milliseconds of each of `reps` timed runs of `fn()` (time_cuda's loop, unsummarized:
    for statistics per subset of the reps, e.g. per routing)."""
    return [seg[0] for seg in _timed_reps(fn, warmup, reps, rotate, flush_l2, graph, mode, 0,
                                          spin_us, sync, api)]


def cuda_segments(fn: Callable[[Callable[[], None]], Any], marks: int, warmup: int = 10,
                  reps: int = 50, rotate: Callable[[int], Any] | None = None,
                  flush_l2: bool = True, mode: str = "queued", spin_us: float = SPIN_US,
                  sync: Callable[[], Any] | None = None,
                  api: CudaApi | None = None) -> list[tuple[float, ...]]:
    """Per rep, the milliseconds of the `marks + 1` segments of `fn(mark)`, which calls
    `mark()` `marks` times (an event recorded on the current stream at each), then the
    total: [(seg_0, ..., seg_marks, total)]. The rest as time_cuda (no graphs)."""
    if marks < 1:
        raise ValueError(f"marks: expected at least 1 (time_cuda times one piece), got {marks}")
    return [tuple(segs) for segs in _timed_reps(fn, warmup, reps, rotate, flush_l2, False, mode,
                                                marks, spin_us, sync, api)]


def time_cuda(fn: Callable[[], Any], warmup: int = 10, reps: int = 50,
              rotate: Callable[[int], Any] | None = None, flush_l2: bool = True,
              graph: bool = False, api: CudaApi | None = None, mode: str = "queued",
              spin_us: float = SPIN_US, sync: Callable[[], Any] | None = None) -> Stats:
    """Time `fn()` on the GPU: `warmup` untimed runs, then `reps` runs, each between two CUDA
    events on the current stream. Before every run (outside the events): `rotate(i)` when
    given (new routing, next input buffer: it must write into the buffers `fn` reads when
    `graph=True`), then an L2 flush, then what `mode` asks (the module doc: "queued",
    "device" with a spin of `spin_us`, "eager"). `graph=True` captures `fn` once into a CUDA
    graph and times its replays (launch overhead out of the picture). `sync()` replaces the
    device synchronisation where the timer waits (a communicator's, which polls with a
    timeout). Returns Stats in milliseconds."""
    return summarize(cuda_samples(fn, warmup, reps, rotate, flush_l2, graph, mode, spin_us,
                                  sync, api))


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
