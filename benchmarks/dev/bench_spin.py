"""Dev: bench_quant with another spin ahead of each timed call (SPIN_US) and, with ROUTINGS=n in
the environment, n routings per point instead of 4 (ROUTINGS=1: the same routing every
repetition); with ROUTINGS_OF=T0,T1,..,T, the Mixtral routings at T (the last count, one of
--tokens) are those a run of those tokens draws there (bench_quant.routings_of: to time them
without the points before them). It also prints the host time Python takes to enqueue one
call, to tell whether the events measure GPU time or wait on the launchers.
    [ROUTINGS=1] [ROUTINGS_OF=1,16,64] python benchmarks/dev/bench_spin.py SPIN_US [args]"""
import os
import sys
import time

sys.path.insert(0, ".")
from benchmarks import bench_quant as BQ  # noqa: E402


def main():
    BQ.SPIN_US = int(sys.argv[1])
    BQ.ROUTINGS = int(os.environ.get("ROUTINGS", BQ.ROUTINGS))
    BQ._SPIN_STATE.update(cycles=None, kernel=None)
    queue = tokens = None
    if os.environ.get("ROUTINGS_OF"):
        tokens = [int(t) for t in os.environ["ROUTINGS_OF"].split(",")]
        E, K = BQ.MODELS["mixtral"][:2]
        draw, queue = BQ.draw_routing, list(BQ.routings_of(tokens, E, K))
        BQ.draw_routing = lambda rng, T, E, K: (queue.pop(0) if T == tokens[-1] and queue
                                                else draw(rng, T, E, K))
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
    if queue:
        raise SystemExit(f"ROUTINGS_OF: no point at T = {tokens[-1]} (its last token count) "
                         f"took the routings")


if __name__ == "__main__":
    main()
