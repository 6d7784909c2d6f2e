"""The CuPy grouped GEMM ladder inside the MoE experts, beside the torch peers (H200, bf16).

    T tokens, E experts, K top-k, H hidden, I intermediate, B block size, P = T*K slots

For Mixtral-8x7B (E=8, K=2, H=4096, I=14336), Qwen3-30B-A3B (E=128, K=8, H=2048, I=768) and
DeepSeek-V3 (E=256, K=8, H=7168, I=2048) at T in {1, 16, 64, 256, 1024, 4096, 16384}, each
candidate computes the routed experts from (topk_weights, topk_ids) to out [T, H]:

    cupy-vN        moe_align_block_size -> GEMM1 (vN, gather fused) -> silu_and_mul ->
                   GEMM2 (vN, router weight in the epilogue) -> moe_sum, launched eagerly;
                   timed in three segments: align | GEMM1 + act + GEMM2 ("gemm ms") | combine;
                   block_size = get_config(..., version=vN)["BLOCK_M"] (v5, the opt-in wgmma
                   rung, aligns to 64 or 128)
    cupy-v4-graph  the same as one CUDA graph replay (no Python or launch overhead: what a
                   serving engine does for decode)
    torch-loop     the per-expert loop (sandbox.bench.torch_per_expert_loop)
    torch-grouped_mm  sort + torch._grouped_mm x 2 + scatter-add (sandbox.bench)

Method: CUDA events around each call (cuda_kernels/timing.py), after warm-up; before every
repetition (outside the events) the routing is re-drawn (new topk_ids / topk_weights, written
in place), the hidden states rotate through 2-8 copies (more than 100 MB together where they
are small), and the L2 is flushed (a 2 x L2 = 120 MB memset evicts every input); median
with p20/p80.
Repetitions are budgeted per point so that the whole run ends inside --budget-s (default
180 s, setup included; the GPU session allows 280 s).
v1, v2 (and v3, for the time budget) are skipped where they would take over 2 s per call
(predicted from their time at the previous T, scaled by the flops), and the table says so.
The JSON is rewritten after every point, so a run cut short still leaves its numbers.

Roofline: floor = max(bytes / 4.8 TB/s, flops / 989 TFLOP/s) (H200 datasheet) with bytes =
the weights of the experts this repetition's routing touches (mean over the repetitions)
and flops = 2 P (2I H + H I); "frac" = floor / median (1.0 = at the roofline).

    python benchmarks/bench_cupy_gemm.py [--models qwen3-30b-a3b] [--tokens 1,64]
                                         [--versions v3,v4] [--budget-s 200]

Writes ./moe-sandbox-results/bench_cupy_gemm_<gpu>_<time>.json, or into --out-dir (GPU,
date, commit, command, every point), and prints the table with a summary against the issue's targets.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sandbox import bench  # noqa: E402

from cuda_kernels import timing  # noqa: E402
from cuda_kernels.cupy import _arrays  # noqa: E402
from cuda_kernels.cupy import gemm as gg  # noqa: E402
from cuda_kernels.cupy import gemm_configs as gcfg  # noqa: E402

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")
# skipped where a call would take over SLOW_LIMIT_S (v3 too: the benchmark's budget is 4 min)
SLOW_VERSIONS = ("v1", "v2", "v3")
SLOW_LIMIT_S = 2.0


# ----------------------------------------------------------------------------- CuPy side
def to_cupy(t):
    """A torch CUDA tensor as a CuPy array without a copy (bf16 through a 16-bit view)."""
    import cupy as cp
    import torch

    if t.dtype == torch.bfloat16:
        u = cp.from_dlpack(t.view(torch.int16)).view(cp.uint16)
        try:
            return u.view(_arrays.bf16_dtype())
        except Exception:   # a CuPy without bf16: the GEMM takes uint16 as bf16 bytes
            return u
    return cp.from_dlpack(t)


_SILU_MUL = r"""
#include <cuda_bf16.h>
extern "C" __global__ void silu_mul_bf16(const __nv_bfloat16* x, __nv_bfloat16* y, int I,
                                         long long n) {
    // y[p, i] = silu(x[p, i]) * x[p, I + i], fp32 math, one rounding
    for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < n;
         j += (long long)gridDim.x * blockDim.x) {
        const long long p = j / I, i = j % I;
        const float g = __bfloat162float(x[p * 2 * I + i]);
        const float u = __bfloat162float(x[p * 2 * I + I + i]);
        y[j] = __float2bfloat16_rn(g / (1.0f + __expf(-g)) * u);
    }
}
"""


def _stages():
    """align, act, combine: the CuPy backend's stages when present, else local fallbacks."""
    import cupy as cp

    try:
        from cuda_kernels.cupy import moe_align_block_size as align
    except Exception:
        tune = importlib.import_module("cuda_kernels.cupy.tune")

        def align(ids, B, E):
            return tune._align_gpu(cp, ids, B, E)
    try:
        from cuda_kernels.cupy import apply_activation

        def act(c1):
            return apply_activation(c1, "silu", True)
    except Exception:
        kern = cp.RawKernel(_SILU_MUL, "silu_mul_bf16")

        def act(c1):
            P, N2 = c1.shape
            y = _arrays.empty((P, N2 // 2), c1.dtype)
            n = P * (N2 // 2)
            if n:
                kern((min(65535, -(-n // 256)),), (256,), (_arrays.raw(c1), _arrays.raw(y),
                                                           np.int32(N2 // 2), np.int64(n)))
            return y
    try:
        from cuda_kernels.cupy import moe_sum
    except Exception:
        def moe_sum(x):
            s = gg._as_f32(x).sum(axis=1)
            u = s.view(cp.uint32)
            bf = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(cp.uint16)
            return bf.view(x.dtype) if x.dtype != cp.uint16 else bf
    return align, act, moe_sum


def cupy_pipeline(case, version, stages):
    """fn(mark=None) -> out [T, H] (CuPy); mark() after the alignment and after GEMM2 (the
    timer's events between align | GEMM1 + act + GEMM2 | combine)."""
    align, act, moe_sum = stages
    p = case.preset
    T, E, K, H, I = case.num_tokens, p.num_experts, p.top_k, p.hidden_size, p.intermediate_size  # noqa: E741
    x, w13, w2 = to_cupy(case.x), to_cupy(case.w13), to_cupy(case.w2)
    tw, ids = to_cupy(case.topk_weights), to_cupy(case.topk_ids32)   # rewritten by redraw()
    B = gcfg.get_config(T, 2 * I, H, E, K, _arrays.bf16_dtype(), version)["BLOCK_M"]
    if version == "v4" and B % 16:
        B = 16

    def fn(mark=None):
        st, ex, nt = align(ids, B, E)
        if mark:
            mark()
        c1 = gg.grouped_gemm(x, w13, st, ex, nt, K, B, version=version)             # [P, 2I]
        c2 = act(c1)                                                                 # [P, I]
        c3 = gg.grouped_gemm(c2, w2, st, ex, nt, 1, B, tw, True, version=version)   # [P, H]
        if mark:
            mark()
        return moe_sum(c3.reshape(T, K, H))                                          # [T, H]
    fn.block_size = B
    return fn


# ----------------------------------------------------------------------------- timing
def _next_inputs(case, i):
    """Rep i's inputs: new routing (in place) and the next hidden states of the rotation pool
    (copied into the fixed buffer every candidate reads, CUDA graphs included)."""
    case.redraw(i)
    pool = getattr(case, "x_pool", None)
    if pool:
        case.x.copy_(pool[i % len(pool)])


def time_reps(run, reps, warmup, case, api, marks):
    """[(segment ms, ..., total ms)] of `reps` calls of run (run(mark) with `marks` marks),
    by the one GPU timer; before each (outside the events) the routing is re-drawn, the next
    hidden states are rotated in, and the L2 is flushed."""
    def rotate(i):
        _next_inputs(case, i)
    if marks:
        return timing.cuda_segments(run, marks, warmup, reps, rotate=rotate, api=api)
    return [(t,) for t in timing.cuda_samples(run, warmup, reps, rotate=rotate, api=api)]


def make_weights(preset, seed=0):
    """w13 ~ N(0, 1/H), w2 ~ N(0, 1/I) in bf16, once per model (the largest is 22.5 GB)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    E, H, I = preset.num_experts, preset.hidden_size, preset.intermediate_size  # noqa: E741
    w13 = torch.empty((E, 2 * I, H), dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty((E, H, I), dtype=torch.bfloat16, device="cuda")
    for e in range(E):   # one expert at a time: no fp32 copy of the whole tensor
        w13[e] = torch.randn((2 * I, H), generator=gen, device="cuda") * H ** -0.5
        w2[e] = torch.randn((H, I), generator=gen, device="cuda") * I ** -0.5
    return w13, w2


def make_case(preset, T, w13, w2, seed=0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed + T)
    K, H = preset.top_k, preset.hidden_size
    case = bench.Case(preset, T, "cuda", torch.bfloat16,
                      x=torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16),
                      w13=w13, w2=w2,
                      topk_weights=torch.empty((T, K), dtype=torch.float32, device="cuda"),
                      topk_ids=torch.empty((T, K), dtype=torch.int64, device="cuda"),
                      topk_ids32=torch.empty((T, K), dtype=torch.int32, device="cuda"),
                      _gen=gen)
    # hidden-state copies whose total passes 2 x the 50 MB L2 (at least 2, at most 8)
    nbytes = T * H * 2
    n_rot = int(min(8, max(2, -(-(100 << 20) // max(nbytes, 1)))))
    case.x_pool = [torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
                   for _ in range(n_rot)]
    case.redraw(0)
    case.touched.clear()
    return case


# ----------------------------------------------------------------------------- the run
def run(models, tokens, versions, budget_s, log=print, save=None):
    import cupy as cp
    import torch

    api = bench.cuda_api("torch")
    t_start = time.time()
    stages = _stages()
    record = {"benchmark": "fused MoE experts from routing to output, CuPy grouped GEMM ladder "
                           "vs torch peers", "dtype": "bfloat16", "routing": "uniform (softmax "
                           "of N(0,1) logits, top-k, renormalized), redrawn every rep",
              "flush_l2": True, "peak_bandwidth": bench.PEAK_BANDWIDTH,
              "peak_flops": bench.PEAK_FLOPS, "slow_limit_s": SLOW_LIMIT_S, "points": []}
    try:
        record["card"] = bench.measure_card(api, copy_mib=1024, matmul_n=8192, reps=5)
    except Exception as e:  # noqa: BLE001
        record["card"] = {"gpu": torch.cuda.get_device_name(), "error": str(e)[:200]}
    log(f"card: {record['card']}")
    t0 = time.time()
    built = gg.prebuild(dtypes=("bf16",), versions=tuple(versions))   # parallel NVRTC
    record["prebuild"] = {"seconds": round(time.time() - t0, 1), **built}
    log(f"prebuilt {built['built']} kernels in {record['prebuild']['seconds']} s"
        + (f"; failed: {sorted(built['failed'])}" if built["failed"] else ""))
    plan = [(m, T) for m in models for T in tokens]
    names = ["torch-loop", "torch-grouped_mm"] + [f"cupy-{v}" for v in versions]
    if "v4" in versions:
        names.append("cupy-v4-graph")
    last_slow = {}      # (model, version) -> (flops, seconds) of its last timed point
    for mi, model in enumerate(models):
        preset = bench.PRESETS[model]
        w13, w2 = make_weights(preset)
        for T in tokens:
            left_points = len(plan) - sum(1 for p in record["points"] if p["candidate"] == names[0])
            left_s = budget_s - (time.time() - t_start)
            point_s = max(left_s / max(left_points, 1), 0.0)
            case = make_case(preset, T, w13, w2)
            flops = bench.moe_flops(T, preset.top_k, preset.hidden_size, preset.intermediate_size)
            with torch.inference_mode():
                expected = bench.torch_per_expert_loop(case.x, case.w13, case.w2,
                                                       case.topk_weights, case.topk_ids).float()
            first = (case.topk_weights.clone(), case.topk_ids.clone(), case.x.clone())
            for name in names:
                pt = {"model": model, "E": preset.num_experts, "K": preset.top_k,
                      "H": preset.hidden_size, "I": preset.intermediate_size, "T": T,
                      "candidate": name}
                record["points"].append(pt)
                if point_s <= 0:
                    pt["error"] = "skipped: time budget spent"
                    continue
                case.topk_weights.copy_(first[0])
                case.topk_ids.copy_(first[1])
                case.topk_ids32.copy_(first[1])
                case.x.copy_(first[2])          # the check compares with these inputs
                try:
                    _time_candidate(pt, name, case, expected, api, stages, flops,
                                    point_s / len(names), last_slow)
                except Exception as e:  # noqa: BLE001 - one failing candidate keeps the run
                    pt["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                log(_row(pt))
            if save is not None:
                record["elapsed_s"] = round(time.time() - t_start, 1)
                save(record)
            del case, expected
        del w13, w2
        torch.cuda.empty_cache()
        cp.get_default_memory_pool().free_all_blocks()
    record["elapsed_s"] = round(time.time() - t_start, 1)
    return record


def _time_candidate(pt, name, case, expected, api, stages, flops, cand_s, last_slow):
    import cupy as cp
    import torch

    preset = case.preset
    version = name.split("-")[1] if name.startswith("cupy") else None
    if version in SLOW_VERSIONS and (pt["model"], version) in last_slow:
        f0, s0 = last_slow[(pt["model"], version)]
        predicted = s0 * flops / max(f0, 1.0)
        if predicted > SLOW_LIMIT_S:
            pt["error"] = f"skipped: {version} predicted {predicted:.1f} s per call (> 2 s)"
            return
    marks = 0
    if name == "torch-loop":
        def run():
            return bench.torch_per_expert_loop(case.x, case.w13, case.w2, case.topk_weights,
                                               case.topk_ids)
    elif name == "torch-grouped_mm":
        if not bench.has_grouped_mm():
            pt["error"] = "not available: this torch has no torch._grouped_mm"
            return

        def run():
            return bench.torch_grouped_mm_moe(case.x, case.w13, case.w2, case.topk_weights,
                                              case.topk_ids)
    elif name == "cupy-v4-graph":
        fn = cupy_pipeline(case, "v4", stages)
        pt["block_size"] = fn.block_size
        fn()                                   # compile + warm the pool outside the capture
        replay = bench.cuda_api("cupy").capture(fn)
        # the graph's output buffer: one eager call's result is checked instead (same math)
        out = fn()

        def run():
            replay()
            return out
    else:
        run = cupy_pipeline(case, version, stages)
        pt["block_size"] = run.block_size
        marks = 2                              # align | GEMM1 + act + GEMM2 | combine

    # the check (and the first, untimed call: compiles kernels, sizes the repetitions)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = run()
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    if out is not None:
        got = torch.from_dlpack(gg._as_f32(out)) if not isinstance(out, torch.Tensor) \
            else out.float()
        pt["rel_err"] = float(torch.linalg.vector_norm(got.float() - expected)
                              / torch.linalg.vector_norm(expected).clamp_min(1e-30))
    per_call = first_s
    if first_s < 0.2:   # a second untimed call: the steady time without compilation
        t0 = time.perf_counter()
        with torch.inference_mode():
            run()
            torch.cuda.synchronize()
        per_call = time.perf_counter() - t0
    per_call += 2e-3                                 # + redraw and flush
    reps = int(max(3, min(30, (cand_s - first_s) / per_call)))
    warmup = 1 if per_call > 0.05 else 3
    case.touched.clear()
    with torch.inference_mode():
        segs = time_reps(run, reps, warmup, case, api, marks)
    total = bench.summarize(s[-1] for s in segs)
    pt["stats"] = total.as_dict()
    if marks:
        pt["segments_ms"] = {k: bench.summarize(s[j] for s in segs).as_dict()
                             for j, k in enumerate(("align", "gemm1_act_gemm2", "combine"))}
    touched = float(np.mean(case.touched[-reps:])) if case.touched else float("nan")
    nbytes = touched * preset.expert_bytes(2)
    floor = bench.roofline_floor(nbytes, flops)
    sec = total.median * 1e-3
    pt.update(reps=reps, touched_experts=touched, bytes=nbytes, flops=flops,
              floor_ms=floor * 1e3, fraction_of_floor=floor / sec, TBps=nbytes / sec / 1e12,
              TFLOPs=flops / sec / 1e12)
    if version in SLOW_VERSIONS:
        last_slow[(pt["model"], version)] = (flops, sec)
    del cp


def _row(p):
    head = f"{p['model']:14s} {p['T']:6d} {p['candidate']:17s}"
    if "stats" not in p:
        return f"{head} {p.get('error', '')}"
    s = p["stats"]
    gemm = p.get("segments_ms", {}).get("gemm1_act_gemm2", {}).get("median")
    gemm_s = f"{gemm:9.4f}" if gemm is not None else f"{'':9s}"
    return (f"{head} {s['median']:10.4f} [{s['p20']:9.4f},{s['p80']:9.4f}] {gemm_s} "
            f"{p['floor_ms']:9.4f} {p['fraction_of_floor']:5.2f} "
            f"{p.get('rel_err', float('nan')):8.1e}")


def header():
    return (f"{'model':14s} {'T':>6s} {'candidate':17s} {'median ms':>10s} "
            f"{'[p20, p80] ms':>21s} {'gemm ms':>9s} {'floor ms':>9s} {'frac':>5s} {'rel err':>8s}")


def wide_table(record) -> list[str]:
    """One line per (model, T): every candidate's median ms ('-' skipped, see the JSON)."""
    names = list(dict.fromkeys(p["candidate"] for p in record["points"]))
    short = [n.replace("torch-grouped_mm", "torch-gmm").replace("cupy-", "") for n in names]
    lines = ["median ms per call (routing to output; '-' = skipped or failed: see the log / "
             "JSON), floor ms, best CuPy fraction of the floor",
             f"{'model':14s} {'T':>6s} " + " ".join(f"{s:>10s}" for s in short)
             + f" {'floor':>9s} {'frac':>5s}"]
    pts = record["points"]
    for model, T in dict.fromkeys((p["model"], p["T"]) for p in pts):
        here = {p["candidate"]: p for p in pts if p["model"] == model and p["T"] == T}
        cells = []
        for n in names:
            p = here.get(n)
            cells.append(f"{p['stats']['median']:10.4f}" if p and "stats" in p else f"{'-':>10s}")
        timed = [p for p in here.values() if "stats" in p]
        floor = timed[0]["floor_ms"] if timed else float("nan")
        cupy = [p for p in timed if p["candidate"].startswith("cupy")]
        frac = max((p["fraction_of_floor"] for p in cupy), default=float("nan"))
        lines.append(f"{model:14s} {T:6d} " + " ".join(cells) + f" {floor:9.4f} {frac:5.2f}")
    return lines


def summary(record) -> list[str]:
    """Per point: best CuPy version vs the faster torch peer, and the issue's targets."""
    lines = ["", "targets: best CuPy <= faster torch peer (all Qwen3/DeepSeek points, Mixtral "
             "T<=1024); frac >= 0.60 at T<=64"]
    pts = record["points"]
    for model, T in dict.fromkeys((p["model"], p["T"]) for p in pts):
        here = [p for p in pts if p["model"] == model and p["T"] == T and "stats" in p]
        cupy = [p for p in here if p["candidate"].startswith("cupy")]
        torch_ = [p for p in here if p["candidate"].startswith("torch")]
        if not cupy:
            continue
        best = min(cupy, key=lambda p: p["stats"]["median"])
        line = (f"{model:14s} T={T:<6d} best {best['candidate']:14s} "
                f"{best['stats']['median']:9.4f} ms frac {best['fraction_of_floor']:.2f}")
        if torch_:
            peer = min(torch_, key=lambda p: p["stats"]["median"])
            ratio = peer["stats"]["median"] / best["stats"]["median"]
            wanted = model != "mixtral-8x7b" or T <= 1024
            verdict = ("met" if ratio >= 1 else "MISSED") if wanted else "n/a"
            line += (f" | {peer['candidate']} {peer['stats']['median']:9.4f} ms: "
                     f"x{ratio:.2f} ({verdict})")
        if T <= 64:
            line += f" | frac target {'met' if best['fraction_of_floor'] >= 0.6 else 'MISSED'}"
        lines.append(line)
    return lines


def _compile_gpu_name() -> str:
    import cupy as cp

    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench.add_points_options(p, MODELS, bench.DEFAULT_TOKENS)
    p.add_argument("--versions", default="v1,v2,v3,v4,v5")
    p.add_argument("--budget-s", type=float, default=180.0)
    bench.add_out_dir(p)
    args = p.parse_args(argv)
    if bench.no_gpu(_arrays.availability):
        return 0
    models, tokens = bench.points_of(args, bench.PRESETS)
    versions = args.versions.split(",")
    command = " ".join([pathlib.Path(sys.executable).name] + sys.argv)
    gpu = _compile_gpu_name()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M%S")
    stem = f"bench_cupy_gemm_{bench.slug(gpu)}_{stamp}"

    def save(record):
        record["command"] = command
        return bench.write_results(record, pathlib.Path(args.out_dir), command=command, stem=stem)

    print(header())
    record = run(models, tokens, versions, args.budget_s, save=save)
    path = save(record)
    print()
    for line in wide_table(record):
        print(line)
    for line in summary(record):
        print(line)
    print(f"\nwrote {path} ({record['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
