"""The Numba backend on real MoE shapes, stage by stage, beside the CuPy kernel of each stage.

    T tokens, E experts, K top-k, H hidden, I intermediate, B block size, P = T*K slots

For Mixtral-8x7B (E=8, K=2, H=4096, I=14336), Qwen3-30B-A3B (E=128, K=8, H=2048, I=768) and
DeepSeek-V3 (E=256, K=8, H=7168, I=2048; grouped sigmoid routing with a correction bias, 8
groups, topk_group 4, scaling 2.5) at T in {1, 16, 64, 256, 1024, 4096}, bf16:

    route       fused_topk (softmax, renormalize) | grouped_topk (DeepSeek-V3)
                bytes = 2 T E + 8 T K
    align       moe_align_block_size(topk_ids, B, E)
                bytes = 4 (P + max_num_tokens_padded + cdiv(that, B) + 1)
    permute     moe_permute(x [T, H], topk_ids, E)          bytes = 2 (T H + P H) + 8 P
    activation  silu_and_mul(x [P, 2I])                     bytes = 2 (2 P I + P I)
    unpermute   moe_unpermute(y [P, H], topk_weights, inv)  bytes = 2 (P H + T H) + 8 P
    combine     moe_sum(x [T, K, H])                        bytes = 2 (T K H + T H)
    gemm1       grouped_gemm(x [T, H], w13 [E, 2I, H], ...)             flops = 2 P 2I H
    gemm2       grouped_gemm(act [P, I], w2 [E, H, I], ..., top_k=1, * router weight)
                                                                         flops = 2 P H I
                every Numba version (v1 / v2 only where one call is predicted under a second;
                v3v: v3 with 16-byte loads, CuPy v3's layout), CuPy v3 (the issue's yardstick)
                and v4 (tensor cores, for context); --gemm-versions picks a subset

When `cuda_kernels.cupy` is importable and available, its kernel of the same stage runs on the
same inputs in the same run, and the table shows numba / cupy. Targets (issue 5): route,
align, permute and combine each within 1.3x of CuPy; the best Numba GEMM within 1.5x of CuPy
v3 (device medians).

Method: the one GPU timer (cuda_kernels/timing.py): CUDA events (CuPy's, else torch's, on
the default stream that both backends use) around one call, after warm-up. Before every
repetition, outside the events: new router logits, routed by Numba's kernel (the stages after
routing read the new topk_ids), the alignment / inverse index of that routing where a stage
needs one, and an L2 flush (a fill of twice its size). Two figures: device (a spin kernel
occupies the GPU while Python enqueues the call, so the events bracket GPU work only) and
eager (idle queue: the events also see the Python and launch overhead, what a notebook user
pays). The first call of each (stage,
backend) is timed on its own and reported as compile time: numba JIT-compiles a kernel per
argument types when it first runs it, unless an earlier process left it in the package's
disk cache (MOE_SANDBOX_NUMBA_CACHE=0 measures cold compiles); CuPy's kernels come from its
own disk cache after the first run ever.

    python benchmarks/bench_numba.py [--models deepseek-v3] [--tokens 1,4096]
                                     [--stages route,align,gemm1] [--reps 20] [--budget-s 150]
                                     [--gemm-versions numba-v3,numba-v3v,cupy-v3]

No new (model, T) point starts after --budget-s seconds (default 150: the run, JIT compiles
included, ends inside 4 minutes on an H200); the record says when it was cut short.
Writes ./moe-sandbox-results/bench_numba_<gpu>_<time>.json, or into --out-dir (GPU, date,
commit, command, every point, the compile times and the target verdicts) and prints the table. Inputs travel as
CuPy arrays when CuPy is present (bf16 as ml_dtypes.bfloat16), else as numba device arrays
(bf16 as uint16 bits, which the Numba kernels read as bf16).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import os
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cuda_kernels.numba as nb  # noqa: E402  (first: the numpy shim before numba)
from cuda_kernels import timing  # noqa: E402
from cuda_kernels.numba import _arrays as A  # noqa: E402
from sandbox import bench  # noqa: E402

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")
TOKENS = (1, 16, 64, 256, 1024, 4096)
STAGES = ("route", "align", "permute", "activation", "unpermute", "combine", "gemm1", "gemm2")
TARGETS = {"route": 1.3, "align": 1.3, "permute": 1.3, "combine": 1.3}
GEMM_TARGET = 1.5
SPIN_US = 1500             # longer than any one call takes to enqueue
# rough rates for skipping slow rungs (a call predicted over SLOW_LIMIT_S is not timed)
PREDICT_TFLOPS = {"v1": 0.5, "v2": 3.0}
SLOW_LIMIT_S = 1.0
cuda = None   # numba.cuda, bound by _fill_kernel (importing this file needs no numba)


# ----------------------------------------------------------------------------- device helpers
def _fill_kernel():
    """fill_random: the helper kernel of this benchmark, written in Numba."""
    from numba import float32, uint64

    from cuda_kernels.numba._device import cast_out

    global cuda   # a module global, not a closure: the simulator swaps globals named cuda
    cuda = A.cuda()

    @cuda.jit
    def fill_random(out, seed, scale):
        """out.flat[j] = a hash of (j, seed) (splitmix64, unsigned: wrapping is defined) as a
        uniform value in [-scale, scale); arrays of any size (weights reach 7.5e9 elements)."""
        start, stride = cuda.grid(1), cuda.gridsize(1)
        for j in range(start, out.size, stride):
            u = uint64(j) * uint64(0x9E3779B97F4A7C15) + uint64(seed) * uint64(0xBF58476D1CE4E5B9)
            u ^= u >> uint64(31)
            u *= uint64(0x94D049BB133111EB)
            u ^= u >> uint64(29)
            v = float32(u >> uint64(40)) * float32(2.0 / 16777216.0) - float32(1.0)  # 24 bits
            out[j] = cast_out(out, v * scale)

    return fill_random


class Env:
    """Allocation (CuPy arrays when present, else numba), random fills, the GPU timer."""

    def __init__(self, cupy_ok):
        self.cu = A.cuda()
        self.cp = importlib.import_module("cupy") if cupy_ok else None
        self.fill_k = _fill_kernel()
        # CuPy's or torch's events: they time Numba's launches on the same default stream
        self.api = timing.cuda_api("cupy")
        if self.api is None:
            raise SystemExit("timing needs CuPy or torch beside Numba (their CUDA events)")
        self.seed = 1

    def empty(self, shape, dtype):
        dt = np.dtype(dtype)
        if self.cp is not None:
            if dt == A.BF16:
                arr = self.cp.empty(shape, dtype=np.uint16)
                try:
                    return arr.view(A.BF16)
                except Exception:
                    return arr
            return self.cp.empty(shape, dtype=dt)
        return self.cu.device_array(shape, dtype=np.uint16 if dt == A.BF16 else dt)

    def _flat(self, x):
        if self.cp is not None and np.dtype(x.dtype) == A.BF16:
            x = x.view(np.uint16)
        x = self.cu.as_cuda_array(x, sync=False) if self.cp is not None else x
        return x.reshape(x.size)

    def randn(self, shape, dtype, scale=1.0):
        x = self.empty(shape, dtype)
        self.refill(x, scale)
        return x

    def refill(self, x, scale=1.0):
        flat = self._flat(x)
        if flat.size:
            self.seed += 1
            self.fill_k[1024, 256](flat, self.seed, np.float32(scale))

    def free(self):
        if self.cp is not None:
            self.cp.get_default_memory_pool().free_all_blocks()


def time_call(env, fn, setup, reps, eager_reps):
    """{device_us, eager_us} Stats dicts by the one GPU timer: CUDA events around fn(),
    setup() and an L2 flush before every call, outside them; one warm-up (the compiles are
    done by first_call)."""
    def us(mode, warmup, n):
        return bench.summarize(ms * 1e3 for ms in timing.cuda_samples(
            fn, warmup, n, rotate=lambda i: setup(), mode=mode, spin_us=SPIN_US,
            api=env.api)).as_dict()

    return {"device_us": us("device", 1, reps), "eager_us": us("eager", 0, eager_reps)}


def first_call(env, fn, setup):
    """Wall seconds of one synchronised call: the compile, when this is the first."""
    setup()
    env.cu.synchronize()
    t0 = time.perf_counter()
    fn()
    env.cu.synchronize()
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- one (model, T)
class Point:
    """The inputs of one (model, T); `redraw()` routes fresh logits with Numba's kernel.
    Nothing is routed at construction: the route stage's first call must be the first time
    the routing kernel runs, or its JIT compile would hide in a setup."""

    def __init__(self, env, preset, T):
        self.env, self.p, self.T = env, preset, T
        E, K, H, inter = (preset.num_experts, preset.top_k, preset.hidden_size,
                          preset.intermediate_size)
        self.E, self.K, self.H, self.I, self.P = E, K, H, inter, T * K
        self.logits = env.randn((T, E), A.BF16, 2.0)                       # [T, E]
        self.bias = env.randn((E,), np.float32, 0.1)                       # [E]
        self.x = env.randn((T, H), A.BF16)                                 # [T, H]
        self.dense = {}
        self.topk_weights = self.topk_ids = self.inv = None

    def route_with(self, mod):
        return bench.route_preset(mod, self.p, self.logits, self.bias)

    def new_logits(self):
        self.env.refill(self.logits, 2.0)

    def redraw(self):
        self.new_logits()
        self.topk_weights, self.topk_ids = self.route_with(nb)             # [T, K] x 2

    def get(self, name):
        """Dense inputs, drawn once per point (the L2 flush keeps them cold)."""
        if name not in self.dense:
            env, T, K, H, inter, P, E = self.env, self.T, self.K, self.H, self.I, self.P, self.E
            shapes = {"act_in": ((P, 2 * inter), 1.0), "y": ((P, H), 1.0),
                      "x_sum": ((T, K, H), 1.0), "gemm2_a": ((P, inter), 1.0),
                      "w13": ((E, 2 * inter, H), 1.7 / np.sqrt(H)),
                      "w2": ((E, H, inter), 1.7 / np.sqrt(inter))}
            shape, scale = shapes[name]
            self.dense[name] = env.randn(shape, A.BF16, scale)
        return self.dense[name]


def stage_calls(pt, stage, ck, gemm_versions=None):
    """[(backend label, fn, setup, work)] for one stage: work = bytes, or flops for GEMMs."""
    E, K, H, inter, P, T = pt.E, pt.K, pt.H, pt.I, pt.P, pt.T
    backends = [("numba", nb)] + ([("cupy", ck)] if ck is not None else [])
    out = []
    if stage == "route":
        nbytes = 2 * T * E + 8 * T * K
        for label, mod in backends:
            out.append((label, lambda mod=mod: pt.route_with(mod), pt.new_logits, nbytes))
    elif stage == "align":
        from cuda_kernels.numba.align import max_num_tokens_padded

        B = 64
        n = max_num_tokens_padded(P, B, E)
        nbytes = 4 * (P + n + -(-n // B) + 1)
        for label, mod in backends:
            out.append((label, lambda mod=mod: mod.moe_align_block_size(pt.topk_ids, B, E),
                        pt.redraw, nbytes))
    elif stage == "permute":
        nbytes = 2 * (T * H + P * H) + 8 * P
        for label, mod in backends:
            out.append((label, lambda mod=mod: mod.moe_permute(pt.x, pt.topk_ids, E),
                        pt.redraw, nbytes))
    elif stage == "activation":
        a = pt.get("act_in")
        for label, mod in backends:
            out.append((label, lambda mod=mod: mod.silu_and_mul(a), lambda: None,
                        2 * 3 * P * inter))
    elif stage == "unpermute":
        y = pt.get("y")

        def setup():
            pt.redraw()
            pt.inv = nb.moe_permute(pt.x, pt.topk_ids, E)[2]

        for label, mod in backends:
            out.append((label, lambda mod=mod: mod.moe_unpermute(y, pt.topk_weights, pt.inv),
                        setup, 2 * (P * H + T * H) + 8 * P))
    elif stage == "combine":
        xs = pt.get("x_sum")
        for label, mod in backends:
            out.append((label, lambda mod=mod: mod.moe_sum(xs), lambda: None,
                        2 * (T * K * H + T * H)))
    elif stage in ("gemm1", "gemm2"):
        g1 = stage == "gemm1"
        a = pt.x if g1 else pt.get("gemm2_a")
        w = pt.get("w13" if g1 else "w2")
        N, Kd = (2 * inter, H) if g1 else (H, inter)
        top_k = K if g1 else 1
        flops = 2 * P * N * Kd
        gg_nb = importlib.import_module("cuda_kernels.numba.gemm")
        versions = [("numba", v, gg_nb, nb) for v in gg_nb.VERSIONS
                    if gemm_versions is None or f"numba-{v}" in gemm_versions]
        if ck is not None:
            gg_ck = importlib.import_module("cuda_kernels.cupy.gemm")
            versions += [("cupy", v, gg_ck, ck) for v in ("v3", "v4")
                         if gemm_versions is None or f"cupy-{v}" in gemm_versions]
        for label, v, gg, mod in versions:
            if label == "numba" and v in PREDICT_TFLOPS and \
                    flops / (PREDICT_TFLOPS[v] * 1e12) > SLOW_LIMIT_S:
                out.append((f"{label}-{v}", None, None, flops))
                continue
            B = int(gg.get_config(T, N, Kd, E, K, A.BF16, version=v)["BLOCK_M"])
            state = {}

            def setup(mod=mod, B=B, state=state):
                pt.redraw()
                state["align"] = mod.moe_align_block_size(pt.topk_ids, B, E)

            def fn(gg=gg, v=v, B=B, state=state):
                st, ex, nt = state["align"]
                return gg.grouped_gemm(a, w, st, ex, nt, top_k, B, pt.topk_weights, not g1,
                                       version=v)

            out.append((f"{label}-{v}", fn, setup, flops))
    else:
        raise ValueError(f"stage: expected one of {STAGES}, got {stage!r}")
    return out


# ----------------------------------------------------------------------------- the run
def run(models, tokens, stages, reps, budget_s, cupy_ok, log=print, save=None,
        gemm_versions=None):
    """Every (model, T, stage, backend) point; `save(partial result)` after each (model, T),
    so a run killed by an outer timeout still leaves its points on disk."""
    env = Env(cupy_ok)
    ck = importlib.import_module("cuda_kernels.cupy") if cupy_ok else None
    compile_s, points = {}, []
    t0 = time.time()
    truncated = False
    for name in models:
        preset = bench.PRESETS[name]
        for T in tokens:
            if time.time() - t0 > budget_s:
                log(f"budget of {budget_s:.0f} s spent: stopping before {name} T={T}")
                truncated = True
                break
            pt = Point(env, preset, T)
            for stage in stages:
                for label, fn, setup, work in stage_calls(pt, stage, ck, gemm_versions):
                    res = {"model": name, "T": T, "stage": stage, "backend": label,
                           "E": pt.E, "K": pt.K, "H": pt.H, "I": pt.I}
                    if fn is None:
                        res["skipped"] = f"predicted over {SLOW_LIMIT_S} s per call"
                        points.append(res)
                        log(row(res))
                        continue
                    try:
                        first = first_call(env, fn, setup)
                        key = f"{stage}/{label}"
                        if key not in compile_s:
                            compile_s[key] = round(first, 3)
                        res["first_call_s"] = round(first, 4)
                        # fewer reps where one call is long: each point stays ~0.5 s
                        again = first_call(env, fn, setup)
                        n = int(max(3, min(reps, 0.5 / max(again, 1e-4))))
                        res.update(time_call(env, fn, setup, n, max(2, n // 2)))
                        med = res["device_us"]["median"] * 1e-6
                        if stage.startswith("gemm"):
                            res["flops"] = work
                            res["tflops"] = work / med / 1e12 if med > 0 else None
                        else:
                            res["bytes"] = work
                            res["gbps"] = work / med / 1e9 if med > 0 else None
                    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                        res["error"] = f"{type(e).__name__}: {e}"[:300]
                    points.append(res)
                    log(row(res))
            del pt
            env.free()
            if save is not None:
                save({"points": points, "compile_s": compile_s, "truncated": True,
                      "elapsed_s": round(time.time() - t0, 1)})
        if truncated:
            break
    return {"points": points, "compile_s": compile_s, "truncated": truncated,
            "elapsed_s": round(time.time() - t0, 1)}


def header():
    return (f"{'model':14s} {'T':>5s} {'stage':10s} {'backend':10s} {'device us':>11s} "
            f"{'p20':>9s} {'p80':>9s} {'eager us':>10s} {'rate':>14s} {'1st call s':>10s}")


def row(p):
    head = f"{p['model']:14s} {p['T']:5d} {p['stage']:10s} {p['backend']:10s}"
    if "skipped" in p:
        return f"{head} skipped: {p['skipped']}"
    if "error" in p:
        return f"{head} ERROR {p['error']}"
    d, e = p["device_us"], p["eager_us"]
    rate = (f"{p['tflops'] or 0:8.2f} TFLOP/s" if "tflops" in p else f"{p['gbps'] or 0:9.1f} GB/s")
    return (f"{head} {d['median']:11.1f} {d['p20']:9.1f} {d['p80']:9.1f} {e['median']:10.1f} "
            f"{rate:>14s} {p['first_call_s']:10.3f}")


def verdicts(points):
    """Numba / CuPy device-median ratios per stage against the issue's targets."""
    by = {}
    for p in points:
        if "device_us" in p:
            by[(p["model"], p["T"], p["stage"], p["backend"])] = p["device_us"]["median"]
    lines, summary = [], {}

    def verdict(stage, target, what, ratios):   # ratios: [(model, T, numba / cupy)]
        if not ratios:
            return
        worst = max(ratios, key=lambda r: r[2])
        ok = sum(r[2] <= target for r in ratios)
        summary[stage] = {"target": target, "points_met": ok, "points": len(ratios),
                          "worst": {"model": worst[0], "T": worst[1], "ratio": worst[2]}}
        lines.append(f"{stage:10s} {what} <= {target}: {ok}/{len(ratios)} points; worst "
                     f"{worst[2]:.2f}x at {worst[0]} T={worst[1]}")

    for stage, target in TARGETS.items():
        verdict(stage, target, "numba/cupy",
                [(m, T, by[(m, T, s, "numba")] / by[(m, T, s, "cupy")])
                 for (m, T, s, b) in by if s == stage and b == "numba"
                 and (m, T, s, "cupy") in by])
    for stage in ("gemm1", "gemm2"):
        ratios = []
        for (m, T, s, b) in by:
            if s != stage or b != "cupy-v3":
                continue
            mine = [by[k] for k in by if k[:3] == (m, T, s) and k[3].startswith("numba-")]
            if mine:
                ratios.append((m, T, min(mine) / by[(m, T, s, "cupy-v3")]))
        verdict(stage, GEMM_TARGET, "best numba / cupy-v3", ratios)
    return lines, summary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench.add_points_options(p, MODELS, TOKENS)
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=150.0,
                   help="stop starting new (model, T) points after this many seconds")
    p.add_argument("--gemm-versions", default=None,
                   help="GEMM rungs to time, e.g. numba-v3,numba-v3v,cupy-v3 (default: all)")
    p.add_argument("--no-cupy", action="store_true", help="time the Numba kernels only")
    bench.add_out_dir(p)
    args = p.parse_args(argv)
    ok, why = nb.availability()
    if not ok or A.is_simulator():
        print(f"no GPU for numba here ({why}): nothing to time")
        return 0
    models, tokens = bench.points_of(args, MODELS)
    stages = bench.names_arg("--stages", args.stages, STAGES)
    cupy_ok, cupy_why = False, "--no-cupy"
    if not args.no_cupy:
        try:
            from cuda_kernels.cupy import availability as cupy_availability
            cupy_ok, cupy_why = cupy_availability()
        except Exception as e:  # noqa: BLE001
            cupy_ok, cupy_why = False, f"{type(e).__name__}: {e}"
    print(f"numba: {why}\ncupy: {'available' if cupy_ok else cupy_why}\n")
    import numba

    dev = A.cuda().get_current_device()
    gpu = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    command = " ".join([pathlib.Path(sys.executable).name] + sys.argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M%S")
    stem = f"bench_numba_{bench.slug(gpu)}_{stamp}"

    def save(res):
        lines, summary = verdicts(res["points"])
        record = {"benchmark": "bench_numba", "card": {"gpu": gpu}, "dtype": "bfloat16",
                  "numba": numba.__version__,
                  "numba_cuda": importlib.metadata.version("numba-cuda"),
                  "cupy_compared": cupy_ok, "cupy_reason": None if cupy_ok else cupy_why,
                  # first calls are JIT compiles only when no earlier process cached them
                  "numba_disk_cache": os.environ.get("MOE_SANDBOX_NUMBA_CACHE", "1") != "0",
                  "reps": args.reps, "method": "CUDA events on the default stream "
                  "(cuda_kernels/timing.py); new routing + L2 flush (twice its size) before "
                  "every rep; device = spin kernel ahead of the call, eager = idle queue; "
                  "first call timed alone (JIT compile)",
                  "targets": summary, "target_lines": lines, **res}
        return bench.write_results(record, pathlib.Path(args.out_dir), command=command,
                                   stem=stem), lines

    print(header())
    gemm_versions = None if args.gemm_versions is None else set(args.gemm_versions.split(","))
    res = run(models, tokens, stages, args.reps, args.budget_s, cupy_ok, save=save,
              gemm_versions=gemm_versions)
    path, lines = save(res)
    print("\nfirst call (JIT compile + launch), seconds:")
    for k, v in sorted(res["compile_s"].items()):
        print(f"  {k:24s} {v:8.3f}")
    print("\ntargets:")
    for line in lines or ["(no CuPy points to compare with)"]:
        print("  " + line)
    print(f"\nwrote {path} ({res['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
