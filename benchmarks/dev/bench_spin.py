"""Dev: bench_quant's int4 row with a longer spin ahead of each timed call (SPIN_US), and the
host time Python takes to enqueue one layer (GEMM1 + programmatic GEMM2), to tell whether the
layer's events measure GPU time or wait on the launchers.
    python benchmarks/dev/bench_spin.py SPIN_US [bench_quant arguments]"""
import sys
import time

sys.path.insert(0, ".")
from benchmarks import bench_quant as BQ  # noqa: E402


def main():
    BQ.SPIN_US = int(sys.argv[1])
    BQ._SPIN_STATE.update(cycles=None, kernel=None)
    real = BQ.time_ms

    def timed(fn, setup, warmup, reps, use_spin=True):
        import cupy
        out = real(fn, setup, warmup, reps, use_spin)
        host = []
        for _ in range(5):               # enqueue time alone: the GPU busy behind a spin
            setup()
            BQ.spin()
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
