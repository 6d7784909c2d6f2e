# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 4. The grouped GEMM ladder
#
# **What you will learn**
#
# * why the grouped GEMM of an MoE layer is bound by memory at decode and by arithmetic at
#   prefill: the roofline, and where real MoE shapes sit on it;
# * the ladder of kernels, each rung one idea: **v1** one thread per output, **v2**
#   shared-memory tiles, **v3** register blocking, **v4** tensor cores — what changed and
#   why it is faster, with the code;
# * how to read the compiled kernels (registers, shared memory) and the measured results.
#
# The rungs live in `cuda_kernels/cupy/gemm_v*.cu` (CuPy, v1–v4 here; the Hopper rungs v5
# `wgmma` and v6, chosen per card for prefill, are notebook 07's) and
# `cuda_kernels/numba/gemm.py` (Numba, v1–v3: Numba has no tensor core instructions). On a CPU this notebook compiles the CuPy rungs for an H200 with
# NVRTC, runs the Numba rungs in the CUDA simulator at a tiny size, and plots the committed
# H200 results; on a GPU it runs and times every rung.

# %% tags=["parameters"]
import workshop

RUN = workshop.setup("04_gemm_ladder")
CUPY_VERSIONS = ["v1", "v2", "v3", "v4"]      # v5 / v6 (sm_90a): notebook 07
NUMBA_VERSIONS = ["v1", "v2", "v3", "v3v"]   # v3v: v3 with 16-byte loads (GPU; v3 in the simulator)
MODEL = "qwen3-30b-a3b"                       # GEMM1 of this preset: N = 2I, Kdim = H
GPU_TOKENS = [16, 256, 4096] if RUN.gpu else []   # GPU only: tokens timed per rung
GPU_BUDGET_S = 75                             # GPU only: no new T after this (JIT compiles count)
DTYPE = "float16"                             # GPU runs (fp16 and bf16 run at the same speed)
SIM_SHAPE = dict(T=4, E=4, K=2, N=8, Kd=8, B=4)   # CPU: the simulator's tiny GEMM
COMPILE_FOR = "sm_90"                         # CPU: NVRTC target of the compile check

# %%
import importlib
import time
from functools import partial

import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np

import reference
from cuda_kernels.cupy import _compile
from cuda_kernels.cupy import gemm as cgg                 # the CuPy launcher
from cuda_kernels.cupy import gemm_configs as ccfg        # its configs (gemm_configs.json)
from sandbox import bench, get_backend

numba_ok, numba_why = get_backend("numba").ok, get_backend("numba").reason
ngg = importlib.import_module("cuda_kernels.numba.gemm") if numba_ok else None
if not numba_ok:
    print(f"the Numba rungs are skipped here: {numba_why}")

preset = bench.PRESETS[MODEL]
E, K, H, I = preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size
N, KD = 2 * I, H                                  # GEMM1: x [T, H] @ w13[e].T -> [P, 2I]
print(preset)

# %% [markdown]
# ## 1. The roofline
#
# One grouped GEMM computes, for each of the `P = T·K` slots, a row of `a @ w[e].T`:
# `2·P·N·Kd` FLOPs. It must at least read the weights of every expert the batch touches
# (`N·Kd` each), the `a` rows and write `c`. Their ratio, the **arithmetic intensity**
# (FLOP per byte), decides what limits the kernel. An H200 does 989 dense bf16 TFLOP/s
# and moves 4.8 TB/s from HBM: below `989 / 4.8 ≈ 206` FLOP/byte a kernel waits on memory,
# above it on the tensor cores. With `m` tokens per expert, the intensity of bf16 weights
# is about `m` FLOP/byte, so decode (a few tokens per expert) is deep in the memory-bound
# region and only large prefill batches reach the compute roof.

# %%
PEAK_BW, PEAK_FLOPS = bench.PEAK_BANDWIDTH, bench.PEAK_FLOPS


def expected_touched(T, E_, K_):
    """Experts touched by T tokens routed uniformly: E (1 - (1 - K/E)^T)."""
    return E_ * (1 - (1 - K_ / E_) ** T)


def roofline_axes(ax):
    xs = np.logspace(-0.5, 4.5, 200)
    ax.plot(xs, np.minimum(PEAK_FLOPS, PEAK_BW * xs) / 1e12, "k-", lw=1.5,
            label="H200 roofline (datasheet)")
    ax.axvline(PEAK_FLOPS / PEAK_BW, color="k", ls=":", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)",
           ylabel="TFLOP/s")


tokens = list(bench.DEFAULT_TOKENS)
ridge = PEAK_FLOPS / PEAK_BW
fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 3.8))
for name in bench.GPU_PRESETS:
    p = bench.PRESETS[name]
    flops = np.array([bench.moe_flops(T, p.top_k, p.hidden_size, p.intermediate_size)
                      for T in tokens])
    nbytes = np.array([expected_touched(T, p.num_experts, p.top_k) * p.expert_bytes(2)
                       for T in tokens])
    label = f"{name} (E={p.num_experts}, K={p.top_k})"
    a0.plot(tokens, flops / nbytes, marker="o", label=label)
    a1.plot(tokens, np.maximum(nbytes / PEAK_BW, flops / PEAK_FLOPS) * 1e6, marker="o",
            label=label)
a0.axhline(ridge, color="k", ls=":", lw=1)
a0.text(tokens[0], ridge * 1.15, f"ridge: {ridge:.0f} FLOP/byte (compute-bound above)", fontsize=8)
a0.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="FLOP / byte of expert weights",
       title="arithmetic intensity of the routed experts (bf16)")
a1.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="µs",
       title="roofline floor: the fastest any kernel can be on an H200")
a0.legend(fontsize=8)
workshop.show(fig, "roofline_models")

# %% [markdown]
# Mixtral has 8 big experts: few tokens already reuse each expert's weights. DeepSeek-V3
# and Qwen3-30B-A3B have many small experts, so a batch spreads thin over them and stays
# memory-bound up to thousands of tokens. For the kernel writer this says: at decode,
# **stream the weights at full bandwidth** (many CTAs in flight, wide loads, deep
# pipelines); at prefill, **feed the tensor cores**.
#
# ## 2. The ladder
#
# All rungs compute the same thing (`reference.grouped_gemm`): for every live position `p`
# of `sorted_token_ids`, slot `s`, expert `e = expert_ids[p // B]`,
# `c[s] = a[s // top_k] @ w[e].T` (+ bias, × router weight), with the gather of `a`'s rows
# fused into the loads. A CTA's tile never straddles two experts because `BLOCK_M` divides
# the alignment block `B`. What changes from rung to rung is **how often each byte loaded
# from memory is reused**.
#
# ### v1: one thread per output element
# Each thread walks its own row of `w[e]` and its `a` row along `Kdim`. No reuse at all:
# two loads per multiply-add, and the 32 lanes of a warp read 32 different `w` rows.

# %%
workshop.show_source("cuda_kernels/cupy/gemm_v1_naive.cu", 'extern "C" __global__', max_lines=26)

# %% [markdown]
# ### v2: shared-memory tiles
# A CTA computes a `BLOCK_M × BLOCK_N` tile. Per `BLOCK_K` step it stages a slab of the
# gathered `a` rows and of `w[e]` in shared memory (coalesced loads), then every thread
# reads them from there: each element loaded from global memory is used `BLOCK_N` (or
# `BLOCK_M`) times. Still two shared-memory reads per FMA.

# %%
workshop.show_source("cuda_kernels/cupy/gemm_v2_smem.cu",
                     "for (int k0 = 0; k0 < Kdim; k0 += BLOCK_K)", max_lines=20)

# %% [markdown]
# ### v3: register blocking
# Each thread owns a `TM × TN` micro-tile of accumulators in registers. Per `k` it reads
# `TM + TN` values from shared memory (one 16-byte load each, the tiles are stored k-major)
# and does `TM·TN` FMAs; the next slab's global loads are issued before this slab's FMAs,
# so their latency hides behind the arithmetic.

# %%
workshop.show_source("cuda_kernels/cupy/gemm_v3_regblock.cu", "if (Kdim > 0) load_global(0);",
                     end="__syncthreads();                                  // before",
                     max_lines=20)

# %% [markdown]
# The Numba v3 is the same idea in Python; `cuda.local.array` with compile-time sizes,
# fully unrolled by LLVM, lives in registers:

# %%
workshop.show_source("cuda_kernels/numba/gemm.py", "# TM + TN shared reads", max_lines=12)

# %% [markdown]
# ### v4: tensor cores
# `mma.sync.m16n8k16` multiplies a 16×16 by a 16×8 tile in one warp instruction (2,048
# multiply-adds, fp32 accumulators). Fragments come from shared memory with `ldmatrix`,
# and a ring of `STAGES` shared tiles is filled by `cp.async` (global → shared without
# registers), so several slabs are in flight while the tensor cores work.

# %%
workshop.show_source("cuda_kernels/cupy/gemm_v4_mma.cu", "// 4. tensor cores on ring slot",
                     end="gg_mma(acc[mt][nt]", max_lines=20)

# %% [markdown]
# ### The napkin math of each rung
#
# Each rung's configuration is data (`gemm_configs.json`, chosen by `get_config` for the
# shape). From it: how many elements each FMA pulls from global memory and from shared
# memory — the quantities each rung attacks.

# %%
T_NAPKIN = 256
dkey = "bf16"
rows, per_fma = [], {}
for v in CUPY_VERSIONS:
    cfg = ccfg.get_config(T_NAPKIN, N, KD, E, K, ml_dtypes.bfloat16, version=v)
    B_v = cfg["BLOCK_M"] if v != "v1" else 16
    fit = ccfg.fit_config(v, dkey, cfg, B_v)
    bm, bn = fit["BLOCK_M"], fit["BLOCK_N"]
    if v == "v1":
        glob, shared, what = 2.0, 0.0, "none: every thread streams its own row"
    elif v == "v2":
        glob, shared, what = (bm + bn) / (bm * bn), 2.0, f"{bm}x{bn} tile in shared memory"
    elif v == "v3":
        tm, tn = fit["TM"], fit["TN"]
        glob, shared = (bm + bn) / (bm * bn), (tm + tn) / (tm * tn)
        what = f"{bm}x{bn} tile, {tm}x{tn} per thread in registers"
    else:
        wm = bm // fit["WARPS_M"]
        wn = bn // (fit["warps"] // fit["WARPS_M"])
        glob, shared = (bm + bn) / (bm * bn), (wm + wn) / (wm * wn)
        what = f"{bm}x{bn} tile, {wm}x{wn} per warp on tensor cores, {fit['stages']} stages"
    per_fma[v] = (glob, shared)
    rows.append((v, what, f"{glob:.3f}", f"{shared:.3f}" if shared else "-"))
workshop.show_table(["rung", "reuse", "global elements / FMA", "shared elements / FMA"], rows)

fig, ax = plt.subplots(figsize=(7, 3))
xs = np.arange(len(per_fma))
ax.bar(xs - 0.2, [g for g, _ in per_fma.values()], 0.4, label="from global memory")
ax.bar(xs + 0.2, [s if s else np.nan for _, s in per_fma.values()], 0.4,
       label="from shared memory (v1: none used)")
ax.set(yscale="log", xticks=xs, xticklabels=list(per_fma), ylabel="elements loaded per FMA",
       title=f"{MODEL} GEMM1 at T={T_NAPKIN}: what each rung reuses")
ax.legend(fontsize=8)
workshop.show(fig, "napkin_math")

# %% [markdown]
# ## 3. The compiled rungs
#
# The CuPy rungs are CUDA C++ compiled at run time by NVRTC with the config injected as
# `#define`s. NVRTC runs without a GPU, so a laptop can compile exactly what an H200 will
# run and read its resource usage from the cubin: registers per thread (which limit how
# many warps an SM holds) and static shared memory.

# %%
if workshop.nvrtc_ready():
    rows = []
    for v in CUPY_VERSIONS:
        cfg = ccfg.get_config(T_NAPKIN, N, KD, E, K, ml_dtypes.bfloat16, version=v)
        fit = ccfg.fit_config(v, dkey, cfg, cfg["BLOCK_M"] if v != "v1" else 16)
        defines = ccfg.kernel_defines(v, dkey, fit)
        options = cgg.KERNEL_OPTIONS.get(v, ()) if hasattr(cgg, "KERNEL_OPTIONS") else ()
        try:
            cubin = _compile.compile_check(cgg.CU_FILES[v], defines, arch=COMPILE_FOR,
                                           options=options)
        except Exception as e:   # a rung that does not build here: say so, go on
            rows.append((v, "-", "-", "-", f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"))
            continue
        res = workshop.cubin_resources(cubin).get(cgg.KERNEL_NAMES[v], {})
        grid, block, dyn = ccfg.launch_geometry(v, fit, 4096, N)
        rows.append((v, res.get("registers", "?"), res.get("static_shared_bytes", 0) + dyn,
                     int(np.prod(block)), ", ".join(f"{k}={d}" for k, d in defines.items()
                                                    if k != "GG_T")))
    workshop.show_table(["rung", "registers / thread", "shared bytes / CTA", "threads / CTA",
                         "defines"], rows)

# %% [markdown]
# ## 4. Running the rungs
#
# On a CPU, the Numba rungs run in the CUDA simulator — every CUDA thread a Python thread,
# so only a tiny GEMM — and must match the reference. The table also shows how many threads
# each rung launches for it: the naive rung launches one per output, the tiled ones fewer,
# fatter threads.

# %%
rng = np.random.default_rng(0)
rows = []
if not RUN.gpu and ngg is not None:
    s = SIM_SHAPE
    a = rng.standard_normal((s["T"], s["Kd"]), dtype=np.float32)                   # [T, Kd]
    w = rng.standard_normal((s["E"], s["N"], s["Kd"]), dtype=np.float32)           # [E, N, Kd]
    ids = np.stack([rng.permutation(s["E"])[:s["K"]] for _ in range(s["T"])]).astype(np.int32)
    align = reference.moe_align_block_size(ids, s["B"], s["E"])
    want = reference.grouped_gemm(a, w, *align, s["K"], s["B"])
    for v in NUMBA_VERSIONS:
        ran, kernel, block, bm, bn = ngg.plan(v, s["B"])[:5]   # version run, kernel, geometry
        grid = (-(-align[0].size // bm), -(-s["N"] // bn))
        got = ngg.grouped_gemm(a, w, *align, s["K"], s["B"], version=v)
        rows.append((f"numba {ran}", f"{grid} x {block}",
                     int(np.prod(grid) * np.prod(block)), f"{workshop.rel_err(got, want):.1e}"))
    workshop.show_table(["rung", "grid x block", "threads simulated", "rel. error"], rows)
    print(f"GEMM: T={s['T']} tokens, top-{s['K']} of {s['E']} experts, N={s['N']}, "
          f"Kdim={s['Kd']}, B={s['B']}, fp32")

# %% [markdown]
# On a GPU every rung runs at the real size (`MODEL`'s GEMM1, fp16), is checked against
# the reference once, and is timed; each point lands on the roofline.

# %%
measured = []                       # (backend, version, T, ms, flops, bytes)
if RUN.gpu:
    import cupy as cp

    cupy_b, numba_b = get_backend("cupy"), get_backend("numba")
    dt = np.dtype(DTYPE)
    w_d = cgg.random_device((E, N, KD), dt, scale=KD ** -0.5)          # [E, N, Kd] on the GPU
    t_start = time.time()
    for T in GPU_TOKENS:
        if time.time() - t_start > GPU_BUDGET_S:
            print(f"time budget of {GPU_BUDGET_S} s spent (compiles included): T={T} skipped")
            break
        a_d = cgg.random_device((T, KD), dt)                           # [T, Kd]
        ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
        ids_d = cp.asarray(ids)
        touched = len(np.unique(ids))
        flops = cgg.gemm_flops(T * K, N, KD)
        nbytes = cgg.gemm_bytes(touched, T, T * K, N, KD, dt.itemsize)
        want = None
        if T == GPU_TOKENS[0]:         # one check against the reference, on the host
            align_h = reference.moe_align_block_size(ids, 16, E)
            want = reference.grouped_gemm(cp.asnumpy(a_d), cp.asnumpy(w_d), *align_h, K, 16)
        for backend, mod, versions in (("cupy", cgg, CUPY_VERSIONS),
                                       ("numba", ngg, NUMBA_VERSIONS if ngg else [])):
            ops = cupy_b if backend == "cupy" else numba_b
            for v in versions:
                try:
                    B_v = int(mod.get_config(T, N, KD, E, K, dt, version=v)["BLOCK_M"])
                    align = cupy_b.stage_fn("align")(ids_d, B_v, E)
                    fn = partial(mod.grouped_gemm, a_d, w_d, *align, K, B_v, version=v)
                    if want is not None:
                        err = workshop.rel_err(cp.asnumpy(fn()).astype(np.float32), want)
                        assert err < 1e-2, f"{backend} {v}: rel. error {err:.1e}"
                    ms = workshop.time_gpu_ms(fn, warmup=2, reps=10)
                    measured.append((backend, v, T, ms, flops, nbytes))
                except Exception as e:   # a rung that cannot run this shape: report, go on
                    print(f"{backend} {v} T={T}: {type(e).__name__}: {str(e)[:120]}")
    workshop.show_table(["backend", "rung", "T", "ms", "TFLOP/s", "TB/s"],
                        [(b, v, T, f"{ms:.3f}", f"{f / ms / 1e9:.1f}", f"{nb / ms / 1e9:.2f}")
                         for b, v, T, ms, f, nb in measured])

    fig, ax = plt.subplots(figsize=(8, 4.2))
    roofline_axes(ax)
    for (b, v) in dict.fromkeys((m[0], m[1]) for m in measured):
        pts = [(f / nb, f / ms / 1e9) for bb, vv, T, ms, f, nb in measured if (bb, vv) == (b, v)]
        ax.plot(*zip(*pts), marker="o" if b == "cupy" else "s", ls="-" if b == "cupy" else "--",
                label=f"{b} {v}")
    ax.set_title(f"{MODEL} GEMM1 ({DTYPE}), T = {GPU_TOKENS}: measured on this GPU")
    ax.legend(fontsize=8, ncol=2, loc="lower right")
    workshop.show(fig, "roofline_measured")

# %% [markdown]
# ## 5. The committed H200 results
#
# `benchmarks/bench_cupy_gemm.py` times every rung inside the whole expert computation
# (align → GEMM1 → activation → GEMM2 → combine) for three real MoE shapes, beside the
# torch peers, with the L2 flushed and the routing re-drawn before every repetition. Its
# JSON goes to `benchmarks/results/`; here is whatever is committed there.

# %%
def ladder_points():
    """(file, points) of every committed result whose points carry timing statistics."""
    out = []
    for prefix in ("bench_cupy_gemm", "bench_numba", "bench_"):
        for path, rec in workshop.load_results(prefix):
            if any(path == p for p, _ in out):
                continue
            pts = [p for p in rec.get("points", []) if isinstance(p, dict) and "stats" in p
                   and "candidate" in p and "T" in p]
            if pts:
                out.append((path, pts))
    return out


results = ladder_points()
if not results:
    print("No GPU results are committed in benchmarks/results/ yet: run "
          "`python benchmarks/bench_cupy_gemm.py` on a GPU (the lead's H200 session does), "
          "then re-run this cell.")
for path, pts in results:
    models = list(dict.fromkeys(p.get("model", "?") for p in pts))
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        mp = [p for p in pts if p.get("model", "?") == model]
        top, bottom = axes[0][col], axes[1][col]
        for cand in dict.fromkeys(p["candidate"] for p in mp):
            q = sorted((p for p in mp if p["candidate"] == cand), key=lambda p: p["T"])
            top.plot([p["T"] for p in q], [p["stats"]["median"] for p in q], marker="o",
                     label=cand)
            if all("fraction_of_floor" in p for p in q):
                bottom.plot([p["T"] for p in q], [p["fraction_of_floor"] for p in q],
                            marker="o", label=cand)
        floor = sorted({(p["T"], p["floor_ms"]) for p in mp if "floor_ms" in p})
        if floor:
            top.plot(*zip(*floor), "k--", label="roofline floor")
        top.set(xscale="log", yscale="log", title=model, xlabel="tokens T", ylabel="ms (median)")
        bottom.set(xscale="log", ylim=(0, 1.05), xlabel="tokens T",
                   ylabel="fraction of the floor")
        top.legend(fontsize=7)
    fig.suptitle(f"{path.name}", y=1.0)
    fig.tight_layout()
    workshop.show(fig, "results_" + path.stem.replace("-", "_")[:60])

# %% [markdown]
# How to read these plots: the dashed floor is `max(bytes / 4.8 TB/s, FLOPs / 989 TFLOP/s)`
# for the experts each repetition touched; a fraction of 1.0 would be the roofline itself.
# What to look for: how early v1 and v2 fall behind (they are skipped where one call would
# take seconds); whether v3 keeps up at decode, where the weights need only be streamed;
# from which `T` the tensor cores of v4 pull ahead; and where the torch peers stand.

# %% [markdown]
# `benchmarks/bench_numba.py` times each GEMM alone, every Numba rung beside CuPy's v3 and
# v4 on the same inputs and the same routing, as TFLOP/s. (It records the FLOPs but not how
# many experts each repetition's routing touched, so there is no roofline floor here: the
# plots above carry it.)

# %%
gemm_pts = workshop.stage_points(("gemm1", "gemm2"))
gemm_pts = [p for p in gemm_pts if p.get("tflops")]
if not gemm_pts:
    print("No committed bench_numba results with GEMM points yet: run "
          "`python benchmarks/bench_numba.py` on a GPU.")
else:
    models = list(dict.fromkeys(p["model"] for p in gemm_pts))
    fig, axes = plt.subplots(2, len(models), figsize=(4.8 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        for row, stage in enumerate(("gemm1", "gemm2")):
            ax = axes[row][col]
            q = [p for p in gemm_pts if p["model"] == model and p["stage"] == stage]
            for label in dict.fromkeys(p["backend"] for p in q):
                r = sorted((p for p in q if p["backend"] == label), key=lambda p: p["T"])
                ax.plot([p["T"] for p in r], [p["tflops"] for p in r], marker="o",
                        ls="-" if label.startswith("cupy") else "--", label=label)
            ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="TFLOP/s",
                   title=f"{model} {stage}")
            ax.legend(fontsize=6)
    fig.tight_layout()
    workshop.show(fig, "results_numba_gemm")

# %% [markdown]
# ## Exercises
#
# 1. **Napkin math for v1.** For `MODEL`'s GEMM1 at `T = 1` (8 experts touched), how many
#    bytes must any kernel read, and how long does that take at 4.8 TB/s? Compare with the
#    committed v1 time, if there is one, and explain the gap.
# 2. **Tile shapes.** Change `TM, TN` in the v3 row of `get_config`'s result (for example
#    2×2 and 8×8), recompute the shared elements per FMA and the registers of the compiled
#    kernel. What limits how large a micro-tile can grow?
# 3. **The simulator as a debugger.** Break Numba's v2 on purpose (remove the second
#    `cu.syncthreads()` in a copy of the kernel) and run it in the simulator. Does the
#    result change? Why might it on a GPU and not in the simulator?
# 4. **Padding in the ladder.** With the Zipf routing of notebook 3 at `T = 16`, how many
#    of the rows v4 computes are padding for `BLOCK_M = 16` and `BLOCK_M = 64`? Which
#    resource does that padding waste at this size?
#
# Solutions: `solutions/04_gemm_ladder_solutions.ipynb`.
