"""Quantized MoE GEMMs on the GPU beside this project's bf16 grouped GEMM (H200).

    T tokens, E experts, K top-k, H hidden, I intermediate, B block size, P = T*K slots

Two models, each in its quantized format and in bf16, at T in {1, 16, 64, 256, 1024, 4096}:

    deepseek-v3   E=256, K=8, H=7168, I=2048   fp8 block (DeepSeek-V3: 128x128 weight blocks,
                                               1x128 activation groups, fp32 scales)
    mixtral       E=8,   K=2, H=4096, I=14336  weight-only int4, group 128, bf16 activations

Paths (all CuPy kernels of this repository):
    fp8    quant(x) -> GEMM1 fp8 -> quant(act) -> GEMM2 fp8 (* router weight): quant/act.py +
           the w8a8 ladder's route (quant/w8a8.py: v3 weight streaming for decode batches, v4
           wgmma e4m3 above on sm_90, v2 mma.sync e4m3 elsewhere; --fp8-version forces one)
    int4   GEMM1 int4 -> GEMM2 int4 (quant/gemm.py grouped_gemm_quant, the weight-only ladder's
           route, quant/wna16.py: v4 on weights prepacked once per array (the first, untimed
           call packs them) up to 8 rows per expert, v5 staged up to 128, v2 tiles above)
    bf16   GEMM1 -> GEMM2 (cuda_kernels.cupy.gemm, its default version and configs)
The rung and config that ran are recorded as "version" ("v4 q8").
The activation between the GEMMs is not in any path (not a quantization stage): GEMM2 reads a
pre-drawn [P, I] activation. The int4 GEMM2 is launched programmatically (PDL: its CTAs read the
routing and copy their first weights under GEMM1's tail, then wait for GEMM1 to finish before
they read their activations; --no-pdl launches it plainly); the JSON's "programmatic" says
which. Alignment runs on the host (reference) once per routing.

Method: CUDA events (cuda_kernels/timing.py) around each call after warm-up, median over the
repetitions; before each repetition (untimed) the next of 4 pre-drawn routings is selected
and the L2 is flushed, so no repetition reads weights left in the 50 MB L2 by the previous
one. The quantized layer's median per routing is kept too ("by_routing", with the routing's
busiest expert's rows: one past the rung's m tile reads that expert's weights twice).
--flush read (default) evicts by reading a 128 MB buffer (a sum): the L2 is left holding
clean lines. --flush write (the method of the results up to 2026-11-29 22:41) evicts by a
128 MB memset, which leaves up to 50 MB of dirty lines whose write-back can land inside the
timed call: up to 50 MB of extra HBM traffic, noise beside the GBs read at T >= 16 but
comparable to a T=1 layer's 352 MB (fp8). Measured (H200, 2026-11-29 23:15, same commit):
DeepSeek-V3 T=1 fp8 0.116 ms read / 0.125 ms write, bf16 0.194 / 0.202 ms. The "flush" field
of the JSON records the method. Then a one-thread spin kernel (SPIN_US) holds the GPU while
Python enqueues the timed calls, so the events measure GPU time, not the launchers' argument
checks (--no-spin to include them).

Roofline: floor = max(bytes / HBM, flops / peak), HBM the card's datasheet bandwidth (H100
3.35e12, H200 4.8e12 B/s), bytes = the weights (scales included) of the experts the routings
touch, in the path's format, and flops = 2 P (2I H + H I);
peak = 1979e12 FLOP/s for fp8, 989e12 for bf16 and int4 (its mma runs in bf16). frac = floor /
median time (1.0 = at the roofline). Targets (issue 8): frac >= 0.6 at T <= 64; block fp8
faster than bf16 at T >= 1024.

    python benchmarks/bench_quant.py [--models deepseek-v3,mixtral] [--tokens 1,16,64]
                                     [--reps 20] [--no-bf16] [--budget-s 200]
                                     [--fp8-version v1|v2|v3|v4] [--fp8-block-size B] [--no-pdl]

Writes ./moe-sandbox-results/bench_quant_<gpu>_<time>.json, or into --out (GPU, date, commit,
command, points).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cuda_kernels import timing  # noqa: E402
from cuda_kernels.cupy import _arrays as A  # noqa: E402
from cuda_kernels.cupy.quant import act as QA  # noqa: E402
from cuda_kernels.cupy.quant import configs as Q  # noqa: E402
from cuda_kernels.cupy.quant import gemm as QG  # noqa: E402
from cuda_kernels.cupy.quant import w8a8 as W8  # noqa: E402
from cuda_kernels.cupy.quant import wna16 as W16  # noqa: E402
from sandbox.bench import add_out_dir, add_points_options, card_hbm, points_of  # noqa: E402

MODELS = {
    # name: (E, K, H, I, quantized format)
    "deepseek-v3": (256, 8, 7168, 2048, "fp8"),
    "mixtral": (8, 2, 4096, 14336, "int4"),
}
TOKENS = (1, 16, 64, 256, 1024, 4096)
HBM = None   # the card's datasheet HBM bandwidth (bytes/s), set by main (card_hbm)
PEAK = {"fp8": 1979e12, "int4": 989e12, "bf16": 989e12}
GROUP = 128          # int4 group size
ROUTINGS = 4         # routings drawn per point, rotated over the repetitions
FLUSH_BYTES = 128 << 20
SPIN_US = 1000       # longer than Python takes to enqueue one timed call (~0.1-0.4 ms)


def compilers() -> dict:
    """What built the kernels that ran: CuPy's NVRTC (every kernel compiles at run time; the
    sm_90a ones through cuda.core's, the same NVRTC library where both load one)."""
    from cupy.cuda import nvrtc

    return dict(cupy_nvrtc=".".join(map(str, nvrtc.getVersion())))


def git_commit() -> str:
    from sandbox.bench import git_commit as commit   # one source of truth (MOE_SANDBOX_COMMIT on the GPU)
    return commit()


# ----------------------------------------------------------------------------- data on the GPU
_FILL = r"""
extern "C" __global__ void fill_bytes(unsigned char* y, long long n, unsigned long long seed,
                                      int fp8) {
    // splitmix64 of the index: random bytes with no host copy and no temporary
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        unsigned long long z = (unsigned long long)i + seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        // fp8: e4m3 codes 0x08..0x5F (|v| in [2^-6, 15]), random sign: finite, never NaN
        y[i] = fp8 ? (unsigned char)((z % 0x58u) + 0x08u) | (unsigned char)((z >> 63) << 7)
                   : (unsigned char)(z >> 24);
    }
}
"""


def random_bytes(shape, fp8: bool, seed: int):
    import cupy

    out = cupy.empty(shape, dtype=cupy.uint8)
    kern = cupy.RawKernel(_FILL, "fill_bytes")
    kern((2048,), (256,), (out, np.int64(out.size), np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64),
                           np.int32(fp8)))
    return out


def random_bf16(shape, scale, seed):
    """N(0, scale^2) in bf16, made on the GPU (the bf16 GEMM module's helper when present)."""
    import cupy

    try:
        from cuda_kernels.cupy.gemm import random_device
        return random_device(shape, A.bf16_dtype(), scale=scale,
                             rng=cupy.random.default_rng(seed))
    except ImportError:
        x = cupy.random.default_rng(seed).standard_normal(shape, dtype=cupy.float32) * scale
        u = x.view(cupy.uint32)
        b = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(cupy.uint16)
        try:
            return b.view(A.bf16_dtype())
        except Exception:
            return b


def draw_routing(rng, T, E, K):
    """K distinct uniform experts per token and their renormalized weights."""
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
    w = rng.random((T, K)).astype(np.float32) + 0.1
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


# ----------------------------------------------------------------------------- timing
@functools.lru_cache(maxsize=1)
def _api():
    return timing.CudaApi("cupy")


def time_ms(fn, setup, warmup, reps, use_spin=True):
    """(median ms, [ms of each rep]) of fn by the one GPU timer (cuda_kernels/timing.py):
    setup() (the next routing, then this benchmark's own L2 flush: --flush) before every
    call, outside the events; with use_spin a spin kernel of SPIN_US holds the GPU while
    Python enqueues the call (mode "device"), else the call starts from an idle GPU
    ("eager": the launchers' host overhead counts)."""
    times = timing.cuda_samples(fn, warmup, reps, rotate=lambda i: setup(), flush_l2=False,
                                mode="device" if use_spin else "eager", spin_us=SPIN_US,
                                api=_api())
    return float(np.median(times)), times


# ----------------------------------------------------------------------------- one model
def bench_model(name, tokens, reps, with_bf16, deadline, log, use_spin=True, fp8_version=None,
                flush_mode="read", fp8_block=None, programmatic=True):
    import cupy

    from reference import moe_align_block_size

    E, K, H, I, fmt = MODELS[name]
    rng = np.random.default_rng(0)
    t0 = time.time()
    # quantized weights: codes plus fp32 scales (values are random: speed does not depend on them)
    if fmt == "fp8":
        w1 = random_bytes((E, 2 * I, H), True, 1)
        w2 = random_bytes((E, H, I), True, 2)
        s1 = cupy.random.uniform(1e-3, 2e-3, (E, 2 * I // 128, H // 128), dtype=cupy.float32)
        s2 = cupy.random.uniform(1e-3, 2e-3, (E, H // 128, I // 128), dtype=cupy.float32)
        qflags = dict(use_fp8_w8a8=True, block_shape=[128, 128])
    else:
        w1 = random_bytes((E, 2 * I, H // 2), False, 1)
        w2 = random_bytes((E, H, I // 2), False, 2)
        s1 = cupy.random.uniform(1e-3, 2e-3, (E, 2 * I, H // GROUP), dtype=cupy.float32)
        s2 = cupy.random.uniform(1e-3, 2e-3, (E, H, I // GROUP), dtype=cupy.float32)
        qflags = dict(use_int4_w4a16=True)
    gg = None
    if with_bf16:
        try:
            gg = importlib.import_module("cuda_kernels.cupy.gemm")
            gcfg = importlib.import_module("cuda_kernels.cupy.gemm_configs")
            b1 = random_bf16((E, 2 * I, H), 0.02, 3)
            b2 = random_bf16((E, H, I), 0.02, 4)
        except Exception as e:  # noqa: BLE001 - the bf16 path is optional
            log(f"  bf16 path unavailable: {type(e).__name__}: {e}")
            gg = None
    cupy.cuda.Device().synchronize()
    log(f"{name}: weights ready in {time.time() - t0:.1f} s "
        f"({(w1.nbytes + w2.nbytes) / 1e9:.1f} GB {fmt}"
        + (f", {(b1.nbytes + b2.nbytes) / 1e9:.1f} GB bf16)" if gg else ")"))
    qbytes_expert = Q.quant_weight_bytes(fmt, 1, 2 * I, H, GROUP) + \
        Q.quant_weight_bytes(fmt, 1, H, I, GROUP)
    bbytes_expert = 2.0 * (2 * I * H + H * I)
    flush = cupy.empty(FLUSH_BYTES, dtype=cupy.uint8)
    points = []
    for T in tokens:
        if time.time() > deadline:
            log(f"  T={T}: skipped (time budget)")
            continue
        P = T * K
        rows_per_expert = P / E
        Bq = Q.block_size_for(fmt, rows_per_expert)       # the route's block size by M
        if fmt == "fp8" and fp8_block:
            Bq = fp8_block                                # --fp8-block-size
        routings = [draw_routing(rng, T, E, K) for _ in range(ROUTINGS)]
        touched = float(np.mean([len(np.unique(ids)) for ids, _ in routings]))
        flops = 2.0 * P * (2 * I * H + H * I)
        x = random_bf16((T, H), 1.0, 10 + T)
        act = random_bf16((P, I), 1.0, 20 + T)

        def aligned(B):
            out = []
            for ids, tw in routings:
                st, ex, ntp = moe_align_block_size(ids, B, E)
                out.append(tuple(A.to_device(v) for v in (st, ex, ntp)) + (A.to_device(tw),))
            return out
        cur = {"i": 0, "used": []}   # the routing of each setup() (each repetition)

        def setup():
            cur["i"] = (cur["i"] + 1) % ROUTINGS
            cur["used"].append(cur["i"])
            if flush_mode == "write":
                flush.fill(cur["i"])          # evict the L2 (a 128 MB write: dirty lines)
            else:
                flush.sum(dtype=cupy.uint32)  # evict the L2 (a 128 MB read: clean lines)

        # ---- quantized path
        qal = aligned(Bq)

        def q_gemm1():
            st, ex, ntp, tw = qal[cur["i"]]
            if fmt == "fp8":
                a1, as1 = QA.per_token_group_quant_fp8(x, 128)
                return QG.grouped_gemm_quant(a1, w1, st, ex, ntp, K, Bq, a_scale=as1,
                                             w_scale=s1, version=fp8_version, **qflags)
            return QG.grouped_gemm_quant(x, w1, st, ex, ntp, K, Bq, w_scale=s1, **qflags)

        def q_gemm2():
            st, ex, ntp, tw = qal[cur["i"]]
            if fmt == "fp8":
                a2, as2 = QA.per_token_group_quant_fp8(act, 128)
                return QG.grouped_gemm_quant(a2, w2, st, ex, ntp, 1, Bq, tw, True, a_scale=as2,
                                             w_scale=s2, version=fp8_version, **qflags)
            return QG.grouped_gemm_quant(act, w2, st, ex, ntp, 1, Bq, tw, True, w_scale=s2,
                                         programmatic=programmatic, **qflags)

        def q_layer():
            q_gemm1()
            q_gemm2()

        point = dict(model=name, T=T, P=P, touched_experts=touched, flops=flops)
        try:
            c1 = q_gemm1()
            c2 = q_gemm2()
            finite = _all_finite(c1) and _all_finite(c2)   # garbage shows up as inf / NaN
            n_rep = reps if T < 4096 else max(5, reps // 2)
            ms, times = time_ms(q_layer, setup, 3, n_rep, use_spin)
            # the layer's median per routing (the repetitions cycle through them): a routing
            # whose busiest expert overflows one m tile reads that expert's weights twice
            used = cur["used"][-n_rep:]
            by_routing = [dict(ms=float(np.median([t for t, u in zip(times, used) if u == r])),
                               max_rows=int(np.bincount(routings[r][0].ravel(),
                                                        minlength=E).max()))
                          for r in range(ROUTINGS) if r in used]
            ms1, _ = time_ms(q_gemm1, setup, 2, n_rep, use_spin)
            ms2, _ = time_ms(q_gemm2, setup, 2, n_rep, use_spin)
            nbytes = touched * qbytes_expert
            floor = max(nbytes / HBM, flops / PEAK[fmt]) * 1e3
            # fp8: gemm1_ms / gemm2_ms include the activation quantization before each GEMM
            point[fmt] = dict(ms=ms, gemm1_ms=ms1, gemm2_ms=ms2, bytes=nbytes, floor_ms=floor,
                              frac=floor / ms, block_size=Bq, finite=finite,
                              by_routing=by_routing)
            cc = int(cupy.cuda.Device().compute_capability)
            if fmt == "fp8":
                point[fmt]["version"] = fp8_version or W8.default_rung("fp8", rows_per_expert,
                                                                       Bq, H, cc)
            else:
                point[fmt]["version"] = W16.default_rung("int4", rows_per_expert, Bq, 2 * I, H,
                                                         GROUP, cc)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            point[fmt] = dict(error=f"{type(e).__name__}: {e}")

        # ---- bf16 path
        if gg is not None:
            try:
                Bb = int(gcfg.get_config(T, 2 * I, H, E, K, A.bf16_dtype())["BLOCK_M"])
                bal = qal if Bb == Bq else aligned(Bb)

                def b_gemm1():
                    st, ex, ntp, tw = bal[cur["i"]]
                    return gg.grouped_gemm(x, b1, st, ex, ntp, K, Bb)

                def b_gemm2():
                    st, ex, ntp, tw = bal[cur["i"]]
                    return gg.grouped_gemm(act, b2, st, ex, ntp, 1, Bb, tw, True)

                def b_layer():
                    b_gemm1()
                    b_gemm2()
                b_gemm1()                                       # compile outside the timing
                b_gemm2()
                n_rep = reps if T < 4096 else max(5, reps // 2)
                ms, _ = time_ms(b_layer, setup, 3, n_rep, use_spin)
                ms1, _ = time_ms(b_gemm1, setup, 2, n_rep, use_spin)
                ms2, _ = time_ms(b_gemm2, setup, 2, n_rep, use_spin)
                nbytes = touched * bbytes_expert
                floor = max(nbytes / HBM, flops / PEAK["bf16"]) * 1e3
                point["bf16"] = dict(ms=ms, gemm1_ms=ms1, gemm2_ms=ms2, bytes=nbytes,
                                     floor_ms=floor, frac=floor / ms, block_size=Bb)
            except Exception as e:  # noqa: BLE001
                point["bf16"] = dict(error=f"{type(e).__name__}: {e}")
        points.append(point)
        log(_row(point, fmt))
    return points   # the weights go with this frame; main() frees the pool between models


def _all_finite(c):
    import cupy

    # bf16 bits: exponent all ones is inf or NaN
    return bool(((A.raw(c).view(cupy.uint16) & 0x7F80) != 0x7F80).all())


def _row(p, fmt):
    q = p.get(fmt, {})
    b = p.get("bf16", {})
    if "error" in q:
        qtxt = f"{fmt} ERROR {q['error'][:80]}"
    else:
        qtxt = (f"{fmt}{' ' + q['version'] if 'version' in q else ''} {q['ms']:8.3f} ms "
                f"(g1 {q['gemm1_ms']:.3f}, g2 {q['gemm2_ms']:.3f}) "
                f"floor {q['floor_ms']:.3f} frac {q['frac']:5.1%} [by routing " +
                " ".join(f"{r['ms']:.3f}" for r in q.get("by_routing", [])) + "]")
    if not b:
        btxt = ""
    elif "error" in b:
        btxt = f" | bf16 ERROR {b['error'][:60]}"
    else:
        speed = b["ms"] / q["ms"] if "ms" in q else float("nan")
        btxt = f" | bf16 {b['ms']:8.3f} ms frac {b['frac']:5.1%} | {fmt} x{speed:4.2f} vs bf16"
    return f"  {p['model']:12s} T={p['T']:5d}  {qtxt}{btxt}"


def summary(points, log):
    log("targets (issue 8):")
    for p in points:
        fmt = MODELS[p["model"]][4]
        q, b = p.get(fmt, {}), p.get("bf16", {})
        if "ms" not in q:
            continue
        if p["T"] <= 64:
            ok = q["frac"] >= 0.6
            log(f"  {p['model']} T={p['T']}: {fmt} at {q['frac']:.1%} of the roofline "
                f"(target >= 60%): {'met' if ok else 'NOT met'}")
        if p["T"] >= 1024 and fmt == "fp8" and "ms" in b:
            ok = q["ms"] < b["ms"]
            log(f"  {p['model']} T={p['T']}: fp8 {q['ms']:.3f} ms vs bf16 {b['ms']:.3f} ms "
                f"(target: faster): {'met' if ok else 'NOT met'}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_points_options(parser, MODELS, TOKENS)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 path")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="stop starting new points after this many seconds")
    parser.add_argument("--no-spin", action="store_true",
                        help="time the launchers' host overhead too (no spin kernel ahead)")
    parser.add_argument("--no-save", action="store_true")
    add_out_dir(parser, "--out")
    parser.add_argument("--flush", default="read", choices=("read", "write"),
                        help="how the L2 is evicted before each timed call (see the doc)")
    parser.add_argument("--fp8-version", default=None, choices=("v1", "v2", "v3", "v4"),
                        help="force this rung of the w8a8 ladder for fp8 (default: its route)")
    parser.add_argument("--fp8-block-size", type=int, default=None,
                        help="alignment block size of the fp8 path (default: "
                             "quant/configs.py block_size_for)")
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch the int4 GEMM2 plainly (default: programmatic, see the doc)")
    args = parser.parse_args(argv)
    ok, why = A.availability()
    if not ok:
        raise SystemExit(f"needs a GPU: {why}")
    import cupy

    models, tokens = points_of(args, MODELS)
    start = time.time()
    deadline = start + args.budget_s
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    global HBM
    HBM = card_hbm(gpu)
    log(f"GPU {gpu}, commit {git_commit()}")
    points = []
    for m in models:
        points += bench_model(m, tokens, args.reps, not args.no_bf16, deadline, log,
                              use_spin=not args.no_spin, fp8_version=args.fp8_version,
                              flush_mode=args.flush, fp8_block=args.fp8_block_size,
                              programmatic=not args.no_pdl)
        cupy.get_default_memory_pool().free_all_blocks()
    summary(points, log)
    log(f"total {time.time() - start:.0f} s")
    if not args.no_save:
        out_dir = pathlib.Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)
        slug = "".join(ch if ch.isalnum() else "_" for ch in gpu.lower()).strip("_")
        path = out_dir / f"bench_quant_{slug}_{now:%Y%m%d_%H%M%S}.json"
        record = dict(gpu=gpu, date=now.isoformat(timespec="seconds"), commit=git_commit(),
                      command=" ".join([pathlib.Path(sys.argv[0]).name] + sys.argv[1:]),
                      hbm_bytes_per_s=HBM, peak_flops=PEAK, routings_per_point=ROUTINGS,
                      spin_us=0 if args.no_spin else SPIN_US, flush=args.flush,
                      programmatic=not args.no_pdl, compilers=compilers(), points=points)
        path.write_text(json.dumps(record, indent=1) + "\n")
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
