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
# # 7. The Hopper rung: solutions
#
# Try the exercises at the end of `07_hopper_gemm.ipynb` first.

# %% tags=["parameters"]
import pathlib
import sys

# workshop.py sits one folder up (Jupyter runs this in solutions/; a script knows its file)
HERE = pathlib.Path(__file__).resolve().parent if "__file__" in globals() else pathlib.Path.cwd()
sys.path.insert(0, str(HERE.parent))
import workshop

RUN = workshop.setup("07_hopper_gemm_solutions")
CARD = "NVIDIA H100 80GB HBM3"
MODEL = "qwen3"                  # the worked example of the notebook: GEMM1 at NAPKIN_T
NAPKIN_T = 4096
GPU_BUDGET_S = 60                # GPU only (sm_90): exercise 4's timings stop after this

# %%
import io
import itertools
import re
import time

import ml_dtypes
import numpy as np

import reference
from cuda_kernels.cupy import _compile
from cuda_kernels.cupy import gemm as cgg
from cuda_kernels.cupy import gemm_configs as ccfg
from cuda_kernels.cupy import tune

BF16 = np.dtype(ml_dtypes.bfloat16)
NAME, E, K, H, I = tune.MODELS[MODEL]
N, KD = 2 * I, H

# %% [markdown]
# ## 1. Break the ring
#
# **Release before `wait_group`.** The checker reports copies into slots whose wgmma
# batches are still running: the producer sees the slot released and refills it while the
# tensor cores read it. On a GPU nothing would fail loudly: some batches would multiply the
# next stage's data (or half-written data) into the accumulator, and the result would be
# wrong by an amount that depends on timing — different from run to run, and possibly
# right in a small test where the tensor cores happen to win the race. That is why the
# kernel releases the slot of the *previous* batch after `wgmma.wait_group 1`, and why the
# emulator of `tests/cupy/test_gemm_emulated.py` checks the protocol rather than only the output.

# %%
bad = workshop.ring_run(release_early=True)
print(f"release_early: finished {bad['done']}, {len(bad['violations'])} violations, e.g.")
for v in bad["violations"][:3]:
    print("  ", v)

# %% [markdown]
# **The producer's first parity.** With parity `phase ^ 0` the producer waits for phase 0
# of `empty[0]` to complete, which needs the consumers to release slot 0, which needs data
# in it: nobody moves, a deadlock (the GPU kernel would hang; the emulator has a deadlock
# timeout for this). The kernel's `gg_mbar_wait(empty_bar + 8 * slot, phase ^ 1)` makes the
# first round pass: a fresh barrier counts the phase before phase 0 as complete.
#
# **One stage.** A consumer releases a slot only after the *next* batch's
# `wait_group 1`, and the next batch needs the same (only) slot refilled: a deadlock again.
# The kernel refuses it at compile time: `static_assert(STAGES >= 2, ...)`.

# %%
for kw in (dict(producer_parity=0), dict(stages=1)):
    r = workshop.ring_run(**kw, max_steps=200)
    print(f"{kw}: finished {r['done']} after {r['steps']} steps (a deadlock when False), "
          f"violations {r['violations'] or 'none'}")

# %% [markdown]
# ## 2. How deep a ring?
#
# In steady state the tensor cores need one stage every 2 steps (two consumers, 1 step per
# batch). A slot's round trip is about a copy (4 steps), its two batches (2), the release
# one batch later (1–2) and the producer noticing it (1): about 9 steps, so about
# `9 / 2 ≈ 5` slots keep the tensor cores fed; below that the consumers wait on `full`
# (the model: the stalls almost vanish at 5 stages and vanish at 6–7, the two consumers'
# batches queueing make the round trip a little longer). The first 4 steps (the first
# copies) are a wait no ring depth removes. A longer epilogue changes the stalls little:
# the producer fills the next tile's first stages during the epilogue either way. What it
# costs is itself: the total grows by the extra epilogue steps of every tile, time the
# tensor cores idle (the next step, in CUTLASS's "ping-pong" kernels, gives two consumers
# two tiles, one in its epilogue while the other computes).

# %%
rows = []
for epi in (4, 12):
    for stages in range(2, 8):
        r = workshop.ring_run(stages=stages, tiles=3, epilogue_steps=epi)
        fill = 2 * 4                                   # both consumers wait for the first copies
        rows.append((epi, stages, r["steps"], sum(r["stall_steps"]) - fill))
workshop.show_table(["epilogue steps", "stages", "total steps", "consumer stall steps "
                     "after the first fill"], rows)

# %% [markdown]
# The notebook's napkin for the real kernel says a load of 800 ns covers about 1.4 stages
# of the 128×256 tile at the tensor cores' rate; add the one or two slots the consumers
# hold (the batch being read and the one not yet released) and 3–4 stages are needed —
# which is all that fits: a fifth 48 KiB stage exceeds the 227 KiB a CTA may use.

# %%
c = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, warps=12, GROUP_M=8, PRODUCER_REGS=56)
for stages in (3, 4, 5):
    need = ccfg.v6_smem_bytes(dict(c, stages=stages))
    print(f"{stages} stages: {need} B of shared memory "
          f"({'fits' if need <= 227 * 1024 else 'does not fit'} in 227 KiB)")

# %% [markdown]
# ## 3. Registers
#
# Build the 128×256 tile with different splits (the CTA's 384 × 168 registers conserved)
# and read `ptxas`'s spill report (NVRTC's `ptxas` here; another CUDA version may allocate
# a few registers differently). The consumers spill at 168 (no move) and not from 176:
# the move of 8 registers per consumer thread is what the code strictly needs, and the
# launcher's 224 leaves headroom. The producer is fine at 48 and spills at 40 (the
# consumers get more there, so the spills are the producer's).

# %%
def spills(producer_regs, consumer_regs):
    d = dict(GG_T="__nv_bfloat16", GG_AB="bf16", BLOCK_M=128, BLOCK_N=256, BLOCK_K=64,
             STAGES=4, CONSUMERS=2, GROUP_M=8, PRODUCER_REGS=producer_regs,
             CONSUMER_REGS=consumer_regs)
    log = io.StringIO()
    cu = cgg.CU_FILES["v6"]
    _compile._nvrtc_compile(_compile.source_text(cu, d), None, "sm_90a", _compile._BASE_OPTIONS,
                            cu, program_options=dict(ptxas_options=["-v"]), logs=log)
    return int(re.search(r"(\d+) bytes spill stores", log.getvalue()).group(1))


if workshop.nvrtc_ready():
    rows = []
    for p, cons in ((168, 168), (152, 176), (56, 224), (48, 224), (40, 232)):
        assert 128 * p + 256 * cons <= 384 * 168
        rows.append((p, cons, spills(p, cons)))
    workshop.show_table(["PRODUCER_REGS", "CONSUMER_REGS", "spill-store bytes"], rows)

# %% [markdown]
# ## 4. Isolating TMA, warp specialization and persistence
#
# The sweep's v6 candidates (`tune.V6_CANDIDATES`) contain pairs that differ in one
# tunable; each pair isolates that tunable *within v6*:

# %%
keys = tune.CANDIDATE_KEYS["v6"]
cands = [dict(zip(keys, c)) for c in tune.V6_CANDIDATES]
what = {"warps": "one consumer warpgroup (8 warps) against two (12): warp specialization's "
                 "split of the tile, and setmaxnreg (only with two)",
        "GROUP_M": "the walk's grouping: L2 reuse of weight panels and a tiles",
        "stages": "ring depth: bytes in flight against shared memory",
        "BLOCK_N": "tile width (not a Hopper feature)", "BLOCK_M": "tile height"}
rows = []
for a, b in itertools.combinations(cands, 2):
    diff = [k for k in keys if a[k] != b[k]]
    if len(diff) == 1:
        k = diff[0]
        rows.append((f"{a['BLOCK_M']}x{a['BLOCK_N']} w{a['warps']} s{a['stages']} "
                     f"g{a['GROUP_M']}", k, f"{a[k]} vs {b[k]}", what.get(k, k)))
workshop.show_table(["candidate", "differs in", "values", "isolates"], rows)

# %% [markdown]
# Persistence is not a `#define`: the launcher sizes the grid as `min(#SMs, tiles)`. A
# grid of one CTA per tile (what v4 and v5 launch) makes the same kernel non-persistent:
# each CTA then walks one tile (`t = blockIdx.x`, and `t + gridDim.x` is past the end).
# On a GPU that is one line before the call, `cgg._DEVICE_LIMITS[dev] = (10**9, smem)`;
# here, the two geometries:

# %%
cfg = ccfg.fit_config("v6", "bf16", ccfg.get_config(NAPKIN_T, N, KD, E, K, BF16, version="v6",
                                                     device=CARD), 128)
L = reference.max_num_tokens_padded(NAPKIN_T * K, cfg["BLOCK_M"], E)
for label, sms in (("persistent", 132), ("one CTA per tile", 10**9)):
    grid, block, smem = ccfg.launch_geometry("v6", cfg, L, N, num_sms=sms)
    print(f"{label:17s} grid {grid[0]:5d} x {block[0]} threads, {smem} B shared each")

# %% [markdown]
# What each comparison separates, and what stays confounded:
#
# | comparison | isolates | still mixed in |
# |---|---|---|
# | v6 persistent vs one CTA per tile (same config) | persistence: the walk over live tiles, the producer prefetching during the epilogue, barrier setup once | nothing else changes; the non-persistent grid also launches the dead tiles (they exit at once) |
# | `GROUP_M` 4 / 8 / 16 (same tile) | the tile order's L2 reuse | — |
# | `STAGES` 3 / 4 | ring depth | — |
# | 64×256 with 8 warps (one consumer) vs 12 (two) | two consumers sharing the tile and `setmaxnreg` | the number of tensor-core instructions in flight per CTA |
# | v5 64×N vs v6 64×N with one consumer, non-persistent | the producer warpgroup + TMA + the mbarrier ring | those three together: TMA needs an mbarrier, and the ring exists for the producer |
#
# TMA against `cp.async` for the weights needs a code change (the producer copying `w`
# like `a`, arriving with `cp.async.mbarrier.arrive.noinc`); no tunable gives it. The GPU
# commands:
#
# ```bash
# python -m cuda_kernels.cupy.gemm --versions v5,v6 --shapes qwen3,mixtral,deepseek \
#     --tokens 1024,4096,16384 --sweep          # every v6 candidate beside v5, per GEMM
# ```
#
# On an sm_90 GPU this cell times the worked example's GEMM1 with the table's v6 config,
# the same config non-persistent, and the one-tunable variants (inputs stay in L2 here).

# %%
if RUN.gpu and _compile.is_sm90():
    import cupy as cp

    from sandbox import get_backend

    align = get_backend("cupy").stage_fn("align")
    dev = cp.cuda.Device().id
    rng = np.random.default_rng(0)
    a_d = cgg.random_device((NAPKIN_T, KD), BF16)                       # [T, Kdim]
    w_d = cgg.random_device((E, N, KD), BF16, scale=KD ** -0.5)         # [E, N, Kdim]
    ids_d = cp.asarray(np.argsort(rng.random((NAPKIN_T, E)), axis=1)[:, :K].astype(np.int32))
    flops = cgg.gemm_flops(NAPKIN_T * K, N, KD)
    base = ccfg.get_config(NAPKIN_T, N, KD, E, K, BF16, version="v6")
    variants = [("table config", base, False), ("table config, one CTA per tile", base, True)]
    variants += [(f"GROUP_M={g}", dict(base, GROUP_M=g), False) for g in (4, 8, 16)
                 if g != base.get("GROUP_M")]
    variants += [(f"stages={s}", dict(base, stages=s), False) for s in (3, 4)
                 if s != base["stages"]]
    variants += [(f"64x256, {w} warps", dict(base, BLOCK_M=64, BLOCK_N=256, warps=w,
                                             stages=5), False) for w in (8, 12)]
    saved = cgg._device_limits(dev)
    rows, t_start = [], time.time()
    for label, cfg, flat in variants:
        if time.time() - t_start > GPU_BUDGET_S:
            print(f"time budget of {GPU_BUDGET_S} s spent: {label} and the rest skipped")
            break
        cfg = {k: v for k, v in cfg.items() if k != "version"}
        B = cfg["BLOCK_M"]
        try:
            if flat:
                cgg._DEVICE_LIMITS[dev] = (10**9, saved[1])
            al = align(ids_d, B, E)

            def call(al=al, B=B, cfg=cfg):
                return cgg.grouped_gemm(a_d, w_d, *al, K, B, version="v6", config=cfg)
            ms = workshop.time_gpu_ms(call, warmup=2, reps=10)
            rows.append((label, f"{ms * 1e3:.0f}", f"{flops / ms / 1e9:.0f}"))
        except Exception as e:   # a variant this card cannot run: report, go on
            rows.append((label, f"{type(e).__name__}: {str(e)[:60]}", "-"))
        finally:
            cgg._DEVICE_LIMITS[dev] = saved
    workshop.show_table(["v6 variant", "µs", "TFLOP/s"], rows)
else:
    print("the timings of exercise 4 need an sm_90 GPU (H100, H200)")

# %% [markdown]
# ## 5. The tile order's bytes
#
# The notebook's napkin, for DeepSeek-V3's GEMM2 at `T = 16384` (`N = H = 7168`, 28 n
# tiles of 256; `Kdim = I = 2048`; 512 rows per expert, 4 m tiles of 128):

# %%
def tile_of(t, live_m, num_pid_n, group_m):
    per_group = group_m * num_pid_n
    first_m = (t // per_group) * group_m
    rows_ = min(live_m - first_m, group_m)
    return first_m + (t % per_group) % rows_, (t % per_group) // rows_


def distinct_bytes(T, e, k, n, kd, bm, bn, group_m, sms=132, seed=0):
    """Distinct bytes (weight panels + a tiles) each wave of the grouped walk loads, summed."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((T, e)), axis=1)[:, :k].astype(np.int32)       # [T, k]
    _, expert_ids, ntpp = reference.moe_align_block_size(ids, bm, e)
    live_m, num_pid_n = -(-int(np.ravel(ntpp)[0]) // bm), -(-n // bn)
    tiles, total = live_m * num_pid_n, 0
    for w0 in range(0, tiles, sms):
        tl = [tile_of(t, live_m, num_pid_n, group_m) for t in range(w0, min(tiles, w0 + sms))]
        panels = {(int(expert_ids[pm]), pn) for pm, pn in tl}
        total += (len(panels) * bn + len({pm for pm, _ in tl}) * bm) * kd * 2
    return total


mname, e, k, h, i = tune.MODELS["deepseek"]
T = 16384
chosen = ccfg.get_config(T, h, i, e, k, BF16, version="v6", device=CARD)
rows = [(g, f"{distinct_bytes(T, e, k, h, i, 128, 256, g) / 1e9:.2f}",
         "<- the tuner's" if g == chosen.get("GROUP_M") else "")
        for g in (1, 2, 4, 8, 16, 32)]
workshop.show_table(["GROUP_M", "distinct GB over the waves", ""], rows)

# %% [markdown]
# The napkin prefers 16, a few percent below the tuner's choice (marked), and all six values
# lie within 20 % of each other: not a strong signal either way. Why the two may differ: the napkin
# pretends the 132 CTAs march in lock-step waves and that the L2 keeps exactly one wave's
# data (it is 50 MB and keeps more; CTAs drift apart as their tiles take different times);
# it counts `a` tiles per m tile, though the rows of one token are shared by its 8 experts;
# and the tuner's times are medians of 3 runs, where differences of 1–2 % are within noise.
# A napkin says which orders are clearly bad (the notebook's `n fastest` and `m fastest`
# walks of Mixtral's GEMM1); the clock chooses among the reasonable ones.
