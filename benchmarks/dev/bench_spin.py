"""Dev: bench_quant with another spin ahead of each timed call (SPIN_US) and, with ROUTINGS=n in
the environment, n routings per point instead of 4 (ROUTINGS=1: the same routing every
repetition); it also prints the host time Python takes to enqueue one call, to tell whether
the events measure GPU time or wait on the launchers.
    [ROUTINGS=1] python benchmarks/dev/bench_spin.py SPIN_US [bench_quant arguments]"""
import os
import sys
import time

sys.path.insert(0, ".")
from benchmarks import bench_quant as BQ  # noqa: E402


def main():
    BQ.SPIN_US = int(sys.argv[1])
    BQ.ROUTINGS = int(os.environ.get("ROUTINGS", BQ.ROUTINGS))
    BQ._SPIN_STATE.update(cycles=None, kernel=None)
    real = BQ.time_ms

    def timed(fn, setup, warmup, reps, use_spin=True):
        import cupy
        out = real(fn, setup, warmup, reps, use_spin)
        host = []
        for _ in range(5):               # enqueue time alone: the GPU busy behind a spin (no
            BQ.spin()                    # setup(): it would shift bench_quant's by_routing)
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            cupy.cuda.Device().synchronize()
        print(f"  host enqueue of one call: {sorted(host)[2]:.3f} ms (median of 5); spin "
              f"{BQ.SPIN_US} us", flush=True)
        return out
    BQ.time_ms = timed
    BQ.main(sys.argv[2:])


if __name__ == "__main__":
    main()
