"""The one GPU timer's loop (cuda_kernels/timing.py) on the CPU, through a fake CUDA API whose
clock moves only when the timed function (or the spin) says so: what runs before each rep and
in which order, what the events bracket in each mode, and the segments of cuda_segments.
The real events are exercised by the GPU tests of tests/test_bench.py."""
from __future__ import annotations

import pytest

from cuda_kernels import timing


class FakeApi:
    """CudaApi's methods on a host clock (milliseconds) and a log of what the timer asked."""

    name = "fake"

    def __init__(self):
        self.clock, self.log = 0.0, []

    def advance(self, ms):
        self.clock += ms

    def event(self):
        api = self

        class Event:
            t = None

            def record(self):
                self.t = api.clock
                api.log.append("record")
        return Event()

    def synchronize(self):
        self.log.append("sync")

    def elapsed_ms(self, start, end):
        return end.t - start.t

    def flush_l2(self):
        self.log.append("flush")

    def spin(self, us):
        self.log.append(f"spin {us:g}")
        self.advance(us * 1e-3)         # before the start event: never inside a sample


def _run(api, ms=2.0):
    def fn():
        api.log.append("fn")
        api.advance(ms)
    return fn


@pytest.mark.parametrize("mode,before", [("queued", []), ("eager", ["sync"]),
                                         ("device", ["sync", "spin 50"])])
def test_what_runs_before_each_rep(mode, before):
    api = FakeApi()
    seen = []

    def rotate(i):
        seen.append(i)
        api.log.append(f"rotate {i}")
    samples = timing.cuda_samples(_run(api), warmup=2, reps=3, rotate=rotate, mode=mode,
                                  spin_us=50, api=api)
    assert samples == [2.0, 2.0, 2.0] and seen == [0, 1, 2, 3, 4]
    wait = ["sync"] if mode != "queued" else []
    warm = [[f"rotate {i}", "flush"] + wait + ["fn"] for i in (0, 1)]
    timed = [[f"rotate {i}", "flush"] + before + ["record", "fn", "record"] for i in (2, 3, 4)]
    assert api.log == sum(warm + timed, []) + ["sync"]


def test_time_cuda_summarizes_and_sync_replaces_the_device_wait():
    api, waits = FakeApi(), []
    stats = timing.time_cuda(_run(api, 1.5), warmup=0, reps=4, flush_l2=False, mode="eager",
                             sync=lambda: waits.append(1), api=api)
    assert stats.n == 4 and stats.median == 1.5 and stats.min == stats.max == 1.5
    assert len(waits) == 5 and "sync" not in api.log and "flush" not in api.log


def test_segments_and_total():
    api = FakeApi()

    def fn(mark):
        api.advance(1.0)
        mark()
        api.advance(2.0)
        mark()
        api.advance(3.0)
    segs = timing.cuda_segments(fn, 2, warmup=1, reps=2, api=api)
    assert segs == [(1.0, 2.0, 3.0, 6.0)] * 2


@pytest.mark.parametrize("calls", [1, 3])
def test_segments_refuse_a_wrong_number_of_marks(calls):
    api = FakeApi()

    def fn(mark):
        for _ in range(calls):
            mark()
    with pytest.raises(ValueError, match="mark"):
        timing.cuda_segments(fn, 2, warmup=0, reps=1, api=api)


def test_refusals():
    api = FakeApi()
    with pytest.raises(ValueError, match="mode"):
        timing.time_cuda(_run(api), reps=1, mode="lazy", api=api)
    with pytest.raises(ValueError, match="graph"):
        timing._timed_reps(_run(api), 0, 1, None, False, True, "queued", 1, 0.0, None, api)
    with pytest.raises(ValueError, match="marks"):
        timing.cuda_segments(lambda mark: None, 0, reps=1, api=api)
