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
# # 4. The grouped GEMM ladder: solutions
#
# Try the exercises at the end of `04_gemm_ladder.ipynb` first.

# %% tags=["parameters"]
import pathlib
import sys

# workshop.py sits one folder up (Jupyter runs this in solutions/; a script knows its file)
HERE = pathlib.Path(__file__).resolve().parent if "__file__" in globals() else pathlib.Path.cwd()
sys.path.insert(0, str(HERE.parent))
import workshop

RUN = workshop.setup("04_gemm_ladder_solutions")
MODEL = "qwen3-30b-a3b"

# %%
import ml_dtypes
import numpy as np

from cuda_kernels.cupy import _compile
from cuda_kernels.cupy import gemm as cgg
from cuda_kernels.cupy import gemm_configs as ccfg
from sandbox import bench, get_backend

p = bench.PRESETS[MODEL]
N, KD = 2 * p.intermediate_size, p.hidden_size

# %% [markdown]
# ## 1. Napkin math for v1
#
# One token, 8 experts: GEMM1 must read 8 expert slabs of `N × Kd` bf16 weights. Nothing
# can be faster than reading them once at 4.8 TB/s. v1 lands far above that because its
# warps read 32 different weight rows per load (32 sectors per instruction, little of each
# used before eviction) and one thread per output leaves most of the bandwidth idle.

# %%
nbytes = 8 * N * KD * 2 + KD * 2 + 8 * N * 2
print(f"GEMM1 at T=1: {nbytes / 2**20:.1f} MiB -> at least "
      f"{nbytes / bench.PEAK_BANDWIDTH * 1e6:.1f} µs")
for path, rec in workshop.load_results("bench_cupy_gemm"):
    for pt in rec.get("points", []):
        if pt.get("model") == MODEL and pt.get("T") == 1 and "stats" in pt:
            print(f"{path.name}: {pt['candidate']}: {pt['stats']['median'] * 1e3:.1f} µs for the "
                  f"whole experts (GEMM1 + GEMM2 + the small stages)")

# %% [markdown]
# ## 2. Tile shapes
#
# Shared reads per FMA are `(TM + TN) / (TM·TN)`: 1.0 at 2×2, 0.5 at 4×4, 0.25 at 8×8.
# The cost is registers: `TM·TN` accumulators plus `TM + TN` operands per thread. Past
# 255 registers a thread spills to local memory, and well before that fewer warps fit on
# an SM (65,536 registers each) to hide latency.

# %%
cfg = ccfg.fit_config("v3", "bf16", ccfg.get_config(256, N, KD, p.num_experts, p.top_k,
                                                     ml_dtypes.bfloat16, version="v3"), 16)
ok, why = _compile.nvrtc_available()
rows = []
for tm, tn in ((2, 2), (4, 4), (8, 8)):
    c = dict(cfg, BLOCK_M=64, BLOCK_N=64, TM=tm, TN=tn)      # a 64x64 tile for all three
    regs = "-"
    if ok:
        try:
            cubin = _compile.compile_check(cgg.CU_FILES["v3"],
                                           ccfg.kernel_defines("v3", "bf16", c))
            regs = workshop.cubin_resources(cubin)[cgg.KERNEL_NAMES["v3"]]["registers"]
        except Exception as e:    # a shape the kernel's static checks refuse
            regs = f"{type(e).__name__}"
    rows.append((f"{tm}x{tn}", (64 // tm) * (64 // tn), f"{(tm + tn) / (tm * tn):.2f}", regs))
workshop.show_table(["TM x TN", "threads / CTA", "shared reads / FMA", "registers / thread"], rows)

# %% [markdown]
# ## 3. The simulator as a debugger
#
# The race below is the one a missing barrier creates in a tiled kernel: threads read
# shared memory that other threads have not written yet. In the simulator every thread is
# a Python thread and the interleaving varies: the result may be right, wrong, or change
# from run to run. On a GPU the warps of a block run in lock-step groups of 32, so a race
# between lanes of one warp may never show, and one between warps shows only sometimes.
# Neither "it passed" proves the barrier is unneeded; only reasoning (or
# `compute-sanitizer --tool racecheck` on a GPU) does.

# %%
if get_backend("numba").ok:
    from numba import cuda  # after setup(): the simulator is chosen when numba is imported


def make_reverse(with_barrier):

    @cuda.jit
    def reverse(x, y):
        s = cuda.shared.array(64, dtype=np.float32)
        t = cuda.threadIdx.x
        s[t] = x[t]
        if with_barrier:
            cuda.syncthreads()
        y[t] = s[63 - t]          # another thread's element
    return reverse


x = np.arange(64, dtype=np.float32)
for with_barrier in ((True, False) if get_backend("numba").ok else ()):
    y = np.zeros_like(x)
    make_reverse(with_barrier)[1, 64](x, y)
    print(f"barrier={with_barrier}: correct = {np.array_equal(y, x[::-1])}")

# %% [markdown]
# ## 4. Padding in the ladder
#
# At `T = 16` with top-8 of 128 there is about one slot per expert: with `BLOCK_M = 16`
# nearly 9 in 10 of the rows v4 computes are padding, with 64 nearly all. That wastes
# tensor-core FLOPs,
# which at this size are idle anyway: the GEMM waits on the weights. It does not waste
# bandwidth, because a padded row reads no weights of its own.

# %%
rng = np.random.default_rng(0)
logp = -1.2 * np.log(np.arange(1, 129))[rng.permutation(128)]
ids = np.argsort(-(logp + rng.gumbel(size=(16, 128))), axis=1)[:, :8]
counts = np.bincount(ids.ravel(), minlength=128)
for bm in (16, 64):
    padded = (-(-counts // bm) * bm).sum()
    print(f"BLOCK_M={bm}: {padded} rows computed for {ids.size} slots -> "
          f"{(padded - ids.size) / padded:.0%} padding")
