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
# # 7. The Hopper rung: wgmma, TMA, the mbarrier ring, warp specialization, persistence
#
# **What you will learn**
#
# * where notebook 4's **v4** (`mma.sync` + `ldmatrix` + a `cp.async` ring, every warp
#   loading and computing) runs out of room on an H100, and what each Hopper feature of the
#   next two rungs adds, one at a time:
#   1. **wgmma** (v5): a warpgroup's matrix instruction that reads both operands from
#      shared memory through descriptors, in a 128-byte swizzled layout, issued
#      asynchronously;
#   2. **TMA** (v6): the weight tile as one bulk tensor copy described by a `CUtensorMap`,
#      and why the gathered token rows still come by `cp.async`;
#   3. **the mbarrier ring**: full and empty barriers per slot, phase parity, who arrives
#      and who waits, the proxy fence;
#   4. **warp specialization**: a producer warpgroup, consumer warpgroups, and `setmaxnreg`
#      moving registers between them;
#   5. **persistence**: one CTA per SM walking the live tiles in an order that keeps a
#      weight panel in L2;
# * the napkin math of each (instructions, registers, shared memory, bytes in flight), the
#   compiled kernels' resources, and the **measured** effect on an H100 — with what the
#   measurements can and cannot separate.
#
# The rungs are `cuda_kernels/cupy/gemm_v4_mma.cu`, `gemm_v5_wgmma.cu` and
# `gemm_v6_tma_ws.cu` (its header explains the design). On a CPU this notebook compiles
# them for `sm_90a` with NVRTC, runs a model of v6's ring in Python, and reads the committed
# H100 results; on an H100 or H200 it also times the three rungs on one shape.

# %% tags=["parameters"]
import workshop

RUN = workshop.setup("07_hopper_gemm")
CARD = "NVIDIA H100 80GB HBM3"        # the card's section of gemm_configs.json (tuned rows)
BENCH = "bench_nvidia-h100-80gb-hbm3_graph"   # the layer, ours and vLLM's, one run, that card
PREFILL_TOKENS = [1024, 4096, 16384]  # the benchmark's T of the measured table
RUNGS = ["v4", "v5", "v6"]
MODEL = "qwen3"                       # the worked example (a tune.MODELS key): its GEMM1 ...
NAPKIN_T = 4096                       # ... at T tokens (m = T * top_k / E = 256 rows per expert)
LOAD_LATENCY_NS = 800                 # napkin only: an assumed latency of a load under traffic
GPU_TOKENS = 4096 if RUN.gpu else None    # GPU only (sm_90): T of the v4 / v5 / v6 timing
GPU_BUDGET_S = 60                     # GPU only: compiles and timing stop after this

# %%
import io
import re
import time

import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np

import reference
from cuda_kernels.cupy import _compile
from cuda_kernels.cupy import gemm as cgg                 # the launcher
from cuda_kernels.cupy import gemm_configs as ccfg        # configs, smem, registers
from cuda_kernels.cupy import gemm_tensor_map as ctmap    # v6's CUtensorMap of the weights
from cuda_kernels.cupy import tune                        # models and candidates
from sandbox import bench
V4, V5, V6 = (f"cuda_kernels/cupy/{cgg.CU_FILES[v]}" for v in RUNGS)
BF16 = np.dtype(ml_dtypes.bfloat16)

NAME, E, K, H, I = tune.MODELS[MODEL]
N, KD = 2 * I, H                      # GEMM1: x [T, H] @ w13[e].T -> [P, 2I]
M_NAPKIN = NAPKIN_T * K // E          # rows per expert at NAPKIN_T


def card_config(v, T=NAPKIN_T, n=N, kd=KD, e=E, k=K):
    """Rung v's config on CARD for a GEMM (N=n, Kdim=kd) of T tokens routed to top-k of e
    experts (the card's tuned row, else the generic one), fitted to its own BLOCK_M (the
    alignment block it asks for)."""
    cfg = ccfg.get_config(T, n, kd, e, k, BF16, version=v, device=CARD)
    return ccfg.fit_config(v, "bf16", cfg, cfg["BLOCK_M"])


CFG = {v: card_config(v) for v in RUNGS}
print(f"{NAME}: E={E}, top_k={K}, H={H}, I={I}. Worked example: GEMM1 (N={N}, Kdim={KD}) "
      f"at T={NAPKIN_T}, m={M_NAPKIN} rows per expert. Configs on {CARD}:")
for v, c in CFG.items():
    print(f"  {v}: {c}")

# %% [markdown]
# ### The measurements this notebook leans on
#
# Two committed files, both from one H100 SXM:
#
# * the **H100 section of `gemm_configs.json`**, written by `cuda_kernels/cupy/tune.py`:
#   for each model shape and bucket `m` of rows per expert, the fastest configuration of
#   each rung and its time `"us"` for GEMM1 and GEMM2, each GEMM timed alone (L2 flushed,
#   uniform routing of `T = m·E/top_k` tokens);
# * **`benchmarks/results/bench_nvidia-h100-80gb-hbm3_graph.json`**: the whole expert
#   computation (align → GEMM1 → activation → GEMM2 → combine) of our layer and of vLLM's
#   Triton `fused_moe` in the same run, at the same `T`, as CUDA graphs, L2 flushed.
#
# The prefill points are `T = 1024, 4096, 16384`: Mixtral's buckets `m = 256, 1024, 4096`,
# Qwen3's `64, 256, 1024`, DeepSeek-V3's `32, 128, 512`.

# %%
section = ccfg.load_table().get("devices", {}).get(CARD, {})
tuned = [r for r in section.get("configs", []) if r.get("dtype") == "bf16" and "us" in r]
print(f"{CARD}: {len(tuned)} tuned bf16 rows from {len(section.get('runs', []))} tuning runs; "
      f"the rung per bucket it names: {section.get('version_by_m', {}).get('bf16', {})}")

runs = workshop.load_results(BENCH)
bench_pts, PEAK_BW, PEAK_FLOPS = {}, 3.35e12, 989e12     # H100 SXM datasheet, as bench uses
if runs:
    bench_path, rec = runs[-1]
    bench_pts = {(p["model"], p["T"], p["candidate"]): p for p in rec.get("points", [])
                 if isinstance(p, dict) and "stats" in p}
    PEAK_BW, PEAK_FLOPS = rec.get("peak_bandwidth", PEAK_BW), rec.get("peak_flops", PEAK_FLOPS)
    print(f"{bench_path.name}: {rec.get('device')}, commit {rec.get('commit')}, "
          f"{len(bench_pts)} points")
else:
    print(f"No {BENCH}*.json in benchmarks/results/: the layer columns stay empty "
          "(`moe-sandbox bench --graph` on an H100 writes it).")


def tuned_us(model, m, v, n, kd):
    """The tuned time of rung v for GEMM (N=n, Kdim=kd) at bucket m on CARD, None if untuned."""
    hit = [r["us"] for r in tuned if r.get("model") == model and r["m"] == m
           and r["version"] == v and r.get("N") == n and r.get("K") == kd]
    return min(hit) if hit else None


def layer_us(model, T, candidate):
    p = bench_pts.get((model.lower(), T, candidate))
    return None if p is None else p["stats"]["median"] * 1e3


points, missing = [], []
for mname, e, k, h, i in tune.MODELS.values():
    for T in PREFILL_TOKENS:
        m = T * k // e
        us = {}
        for v in RUNGS:
            g1, g2 = tuned_us(mname, m, v, 2 * i, h), tuned_us(mname, m, v, h, i)
            us[v] = None if g1 is None or g2 is None else g1 + g2
            if us[v] is None:
                missing.append(f"{mname} m={m} {v}")
        floor = bench_pts.get((mname.lower(), T, "cupy"), {}).get("floor_ms")
        points.append(dict(model=mname, T=T, m=m, flops=bench.moe_flops(T, k, h, i), us=us,
                           ours=layer_us(mname, T, "cupy"),
                           vllm=layer_us(mname, T, "vllm-triton"),
                           floor=None if floor is None else floor * 1e3))
print("every (model, T, rung) is tuned" if not missing else
      f"not tuned on {CARD} (left out below, the rest goes on): {', '.join(missing)}")


def show_speedups(a, b):
    """How much faster rung b ran than rung a (GEMM1 + GEMM2) at every measured point."""
    s = [(f"{p['model'].split('-')[0]} T={p['T']} (m={p['m']})", p["us"][a] / p["us"][b])
         for p in points if p["us"].get(a) and p["us"].get(b)]
    if not s:
        print(f"no point has both {a} and {b} measured on {CARD}")
        return
    print(f"{b} over {a}, GEMM1 + GEMM2 on the H100 (each rung at its tuned config):")
    for label, x in s:
        print(f"  {label:28s} {x:5.2f}x")


# %% [markdown]
# ## 0. Where we start: v4 and why it stops
#
# v4 (notebook 4) is the Ampere recipe: `cp.async` fills a ring of shared tiles, every warp
# copies and computes, and each warp loads its **operand fragments into registers** with
# `ldmatrix` before each `mma.sync.m16n8k16` (2,048 multiply-adds per warp instruction):

# %%
workshop.show_source(V4, "// 4. tensor cores on ring slot", end="gg_mma(acc[mt][nt]",
                     max_lines=20)

# %% [markdown]
# Three limits follow from that loop, and the H100 makes all three bite:
#
# * **instructions**: per 16-wide `k` step a 64×64 warp tile costs `MT + NT/2` `ldmatrix`
#   and `MT·NT` `mma.sync` — 40 warp instructions for 65,536 multiply-adds. Hopper's tensor
#   cores do about twice Ampere's work per clock; the warps must issue twice as fast to keep
#   up, while also issuing the copies and the address math;
# * **registers**: the fragments (`af`, `bf`) live in registers beside the fp32
#   accumulators; a 64×64 warp tile already holds 128 accumulators per thread, and the
#   255-register cap leaves no room for a larger tile (which would cut the shared-memory
#   traffic per multiply-add);
# * **shared-memory bandwidth**: an SM's shared memory delivers 128 bytes per clock; at
#   the datasheet rate (989 TFLOP/s over 132 SMs at about 1.83 GHz) its tensor cores do
#   about 2,048 multiply-adds per clock. That leaves **1/16 byte per multiply-add** for
#   everything read from or written to shared memory.
#
# The napkin below counts those three for the tuned tiles of the worked example (v5 and v6
# use `wgmma.m64nNk16`, section 1).

# %%
SMEM_BYTES_PER_CLK = 128                  # an SM's shared memory: 32 banks x 4 bytes
FMA_PER_CLK = PEAK_FLOPS / 2 / 132 / 1.83e9     # ~2048 on an H100 SXM (dense bf16)
BUDGET = SMEM_BYTES_PER_CLK / FMA_PER_CLK


def rung_napkin(v, cfg):
    """Per 16-wide k step of one warp (v4) or warpgroup (v5, v6): the MMA instruction, its
    multiply-adds, warp instructions per 2^18 multiply-adds, operand and accumulator
    registers per thread, operand bytes read from shared memory per multiply-add."""
    if v == "v4":
        d = ccfg.kernel_defines(v, "bf16", cfg)
        wm, wn = cfg["BLOCK_M"] // d["WARPS_M"], cfg["BLOCK_N"] // d["WARPS_N"]
        mt, nt = wm // 16, wn // 8
        fma = wm * wn * 16
        instr = mt + nt // 2 + mt * nt                  # ldmatrix.x4 (A, B pairs) + mma.sync
        return dict(unit=f"warp {wm}x{wn}", mma=f"{mt * nt} x mma.sync.m16n8k16", fma=fma,
                    instr=instr * 2**18 / fma, operand_regs=mt * 4 + nt * 2,
                    acc_regs=mt * nt * 4, smem=2 * (wm + wn) / (wm * wn))
    wg_n = cfg["BLOCK_N"] if v == "v5" or cfg["BLOCK_M"] >= 128 else \
        cfg["BLOCK_N"] // ccfg.v6_consumers(cfg)
    fma = 64 * wg_n * 16
    return dict(unit=f"warpgroup 64x{wg_n}", mma=f"1 x wgmma.m64n{wg_n}k16", fma=fma,
                instr=4 * 2**18 / fma, operand_regs=0, acc_regs=wg_n // 2,
                smem=2 * (64 + wg_n) / (64 * wg_n))


rows = []
for v in RUNGS:
    c, nap = CFG[v], rung_napkin(v, CFG[v])
    copies = 2 * (c["BLOCK_M"] + c["BLOCK_N"]) / (c["BLOCK_M"] * c["BLOCK_N"])   # ring writes
    rows.append((v, f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}", nap["unit"], nap["mma"],
                 f"{nap['instr']:.0f}", nap["operand_regs"], nap["acc_regs"],
                 f"{nap['smem']:.4f}", f"{(nap['smem'] + copies) / BUDGET:.0%}"))
workshop.show_table(["rung", "CTA tile", "MMA unit", "per k16 step", "warp instr. / 2^18 FMA",
                     "operand regs / thread", "accumulator regs / thread",
                     "smem operand B / FMA", "smem traffic / budget"], rows)
print(f"budget: {SMEM_BYTES_PER_CLK} B/clk / {FMA_PER_CLK:.0f} FMA/clk = {BUDGET:.4f} B per "
      "multiply-add; 'smem traffic' adds the ring's writes, 2(BM+BN)/(BM*BN) B per FMA")

# %% [markdown]
# By this count v4's best tile needs more shared-memory traffic than an SM can serve at the
# tensor cores' rate, and 40 times the instructions of a `wgmma` tile; its measured best on
# the H100 stays near a third of the datasheet peak (section 6). The count assumes every
# operand byte crosses the shared-memory port once per instruction that reads it: a napkin,
# not a model of the hardware's internals.
#
# ## 1. wgmma (v5): the warpgroup reads its operands from shared memory
#
# `wgmma.mma_async.m64nNk16` is issued by a **warpgroup** (4 warps, 128 threads) together:
# one instruction multiplies a 64×16 tile of `a` by a 16×N tile of `w` (N up to 256) into
# a 64×N fp32 accumulator spread over the 128 threads' registers (`N/2` each). Both
# operands come **straight from shared memory** through two 64-bit *matrix descriptors*:
# no `ldmatrix`, no fragments in registers. The inline PTX names the accumulator registers
# (`wgmma_operands.cuh` spells the 128 of them out) and the two descriptors; v5 and v6 take
# their three widths from `gemm_wgmma.cuh`:

# %%
workshop.show_source("cuda_kernels/cupy/wgmma_operands.cuh", "#define WG_MMA_SS(",
                     stop="// One wgmma with A from registers")
workshop.show_source("cuda_kernels/cupy/gemm_wgmma.cuh", "#define GG_WGMMA_K16",
                     stop="// the wgmma of an N-wide accumulator")

# %% [markdown]
# ### The descriptor and the 128-byte swizzle
#
# A descriptor holds the tile's shared address (>> 4), the *stride byte offset* (the
# distance between groups of 8 rows: 8 × 128 = 1024 bytes here) and the layout type. The
# tensor cores read **K-major** tiles (each row of `a` and of `w` holds consecutive `k`)
# in a **swizzled** layout: a row of 64 bf16 is one 128-byte line, and its 16-byte chunk
# `c` is stored at chunk `c XOR (row mod 8)`:

# %%
workshop.show_source("cuda_kernels/cupy/wgmma_operands.cuh",
                     "// The matrix descriptor of a K-major operand tile")
workshop.show_source(V5, "// Byte offset of (row r, 16-byte k chunk c) inside an operand tile")


# %%
def swizzle128(r, c):
    """gg_swizzle_offset for 128-byte rows: the byte offset of (row r, 16-byte chunk c)."""
    o = r * 128 + c * 16
    return o ^ (((o >> 7) & 7) << 4)


def desc128(addr):
    """wg_desc_swizzled<128> (wgmma_operands.cuh: v5's and v6's descriptor of 128-byte rows)
    as a Python int."""
    return ((addr & 0x3FFFF) >> 4) | (1 << 16) | ((1024 >> 4) << 32) | (1 << 62)


for kk in range(4):        # the four k16 steps of a 64-wide BLOCK_K: +32 bytes each
    d = desc128(0x2000 + kk * 32)
    print(f"k step {kk}: start {(d & 0x3FFF) << 4:#06x}  leading {(d >> 16) & 0x3FFF}  "
          f"stride {((d >> 32) & 0x3FFF) << 4} B  layout {d >> 62} (128-byte swizzle)  "
          f"desc {d:#018x}")

# bank groups (4 banks = 16 bytes) hit when 8 rows read the same k chunk (one k slice)
rows8 = np.arange(8)
plain = np.array([[((r * 128 + c * 16) % 128) // 16 for c in range(8)] for r in rows8])
swz = np.array([[(swizzle128(r, c) % 128) // 16 for c in range(8)] for r in rows8])
for label, lay in (("row-major", plain), ("swizzled", swz)):
    worst = max(np.bincount(lay[:, c], minlength=8).max() for c in range(8))
    print(f"{label:9s}: 8 rows reading one k chunk hit at most {worst} times the same bank "
          f"group -> {worst}-way conflict" + (" (none)" if worst == 1 else ""))

fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
for ax, (title, lay) in zip(axes, (("row-major: chunk c at column c", plain),
                                   ("128-byte swizzle: chunk c at column c ^ (row % 8)", swz))):
    where = np.zeros((8, 8), dtype=int)            # which k chunk sits in each 16-byte column
    for r in rows8:
        for c in range(8):
            where[r, lay[r, c]] = c
    ax.imshow(where, cmap="tab10", vmin=0, vmax=9)
    for r in rows8:
        for col in range(8):
            ax.text(col, r, f"k{where[r, col]}", ha="center", va="center", fontsize=8)
    ax.set(title=title, xlabel="16-byte column of the 128-byte line (= bank group)",
           ylabel="tile row", xticks=range(8), yticks=range(8))
    ax.grid(False)
fig.suptitle("One 1024-byte swizzle atom (8 rows x 64 bf16): the tensor cores read a k chunk "
             "of 8 rows at once", y=1.02)
workshop.show(fig, "swizzle")

# %% [markdown]
# Without the swizzle the 8 rows of one `k` chunk sit in the same bank group (the rows are
# exactly 128 bytes apart): an 8-way conflict on every read. With it they spread over all
# 32 banks. v5 copies with `cp.async` and computes the swizzled address itself; the XOR
# uses absolute address bits, so the ring starts on a 1024-byte boundary (the launcher adds
# 1024 bytes of shared memory for that).
#
# ### Asynchronous issue
#
# `wgmma` returns before the multiply is done. A warpgroup issues a *batch* (the four
# k16 steps of a stage), closes it with `wgmma.commit_group`, and `wgmma.wait_group N`
# waits until at most `N` batches are still running. v5 keeps one batch in flight while it
# issues the copies of a later stage; a ring slot is reused only after every warpgroup's
# batch that read it has completed. `fence.proxy.async` orders the `cp.async` writes
# (generic proxy) before the tensor cores' reads (async proxy):

# %%
workshop.show_source(V5, "for (int t = 0; t < num_k_tiles; ++t) {", max_lines=30)
workshop.show_source("cuda_kernels/cupy/gemm_wgmma.cuh", "// One batch of wgmma over a stage")

# %% [markdown]
# What v5 still shares with v4: every warp both copies and computes, the CTA synchronises
# with `__syncthreads()` once per stage, one CTA computes one tile and exits.
#
# **Measured** (v4 → v5 changes the MMA instruction and its operand layout; the tuner also
# found deeper rings for it):

# %%
show_speedups("v4", "v5")

# %% [markdown]
# The gain grows with `m`: at 32 or 64 rows per expert the GEMMs stream weights and
# neither tensor-core instruction is the limit (section 6 shows the roofline).
#
# ## 2. TMA (v6): the weight tile in one instruction
#
# The **Tensor Memory Accelerator** copies a box of a tensor from global to shared memory
# on its own: one thread issues `cp.async.bulk.tensor`, names the box by its coordinates,
# and the copy engine computes the addresses, writes the tile **already in wgmma's
# 128-byte swizzle**, fills with zeros what lies outside the tensor, and counts the bytes
# down on an mbarrier. What it copies is described by a **`CUtensorMap`** (128 opaque
# bytes) that the host encodes once per weight array with the driver's
# `cuTensorMapEncodeTiled` and passes to the kernel by value (`const __grid_constant__`).
# What goes into it:

# %%
workshop.show_source("cuda_kernels/cupy/gemm_tensor_map.py", "def v6_tensor_map_fields")

# %%
rows = []
for gemm, n, kd in (("GEMM1", N, KD), ("GEMM2", H, I)):
    cfg = card_config("v6", n=n, kd=kd)
    f = ctmap.v6_tensor_map_fields((E, n, kd), "bf16", cfg)
    box_bytes = int(np.prod(f["box"])) * f["elem_bytes"]
    rows.append((gemm, f"[{E}, {n}, {kd}]", str(f["dims"]), str(f["strides"]), str(f["box"]),
                 f"{f['swizzle_bytes']} B", box_bytes, -(-n // cfg["BLOCK_N"])))
workshop.show_table(["GEMM", "w [E, N, Kdim]", "dims (innermost first)", "strides (bytes)",
                     "box", "swizzle", "bytes per box (expect_tx)", "n tiles"], rows)

# %% [markdown]
# The map is **3-D** (`Kdim`, `N`, `E`): a box never crosses from one expert into the
# next, so a ragged `N` (not a multiple of `BLOCK_N`) reads zeros, not the next expert's
# rows; the ragged `Kdim` tail likewise. The kernel side is one instruction:

# %%
workshop.show_source(V6, "// box (c0 = k, c1 = n, c2 = e) of the tensor map")

# %% [markdown]
# ### Why the token rows still come by `cp.async`
#
# Hopper's TMA copies boxes of a regular tensor. The `a` tile of a grouped GEMM is not
# one: its rows are `a[s / top_k]` for the tile's slots `s` (`sorted_token_ids`), rows
# scattered over the whole activation tensor (a gather mode, `.tile::gather4`, arrived only
# with Blackwell's TMA). So in v6 the producer warpgroup's 128 threads copy the `a` rows in
# 16-byte pieces into the same swizzled layout, and each thread's
# `cp.async.mbarrier.arrive.noinc` makes one arrival on the stage's barrier once its
# copies have landed. The producer's walk over its tiles, a stage at a time:

# %%
workshop.show_source(V6, "for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {", max_lines=50)

# %% [markdown]
# The napkin of one stage for the tuned tile: who issues what, and how many bytes are in
# flight. The copies must cover the latency of a load under traffic (`LOAD_LATENCY_NS`,
# an assumption: change it) while the tensor cores work on the stages already landed.

# %%
c6 = CFG["v6"]
a_bytes, w_bytes = c6["BLOCK_M"] * 128, c6["BLOCK_N"] * 128        # 64 bf16 = 128 B per row
stage = a_bytes + w_bytes
clk_per_stage = c6["BLOCK_M"] * c6["BLOCK_N"] * c6["BLOCK_K"] / FMA_PER_CLK
latency_clk = LOAD_LATENCY_NS * 1e-9 * 1.83e9
c5 = CFG["v5"]
v5_threads = c5["warps"] * 32
rows = [
    ("w tile", f"{c6['BLOCK_N']} x 64 bf16 = {w_bytes} B",
     "1 cp.async.bulk.tensor by 1 thread",
     f"{c5['BLOCK_N'] * c5['BLOCK_K'] * 2 // 16} cp.async of 16 B "
     f"({c5['BLOCK_N']} x {c5['BLOCK_K']} tile)"),
    ("a tile", f"{c6['BLOCK_M']} x 64 bf16 = {a_bytes} B",
     f"{a_bytes // 16} cp.async of 16 B, {a_bytes // 16 // 128} per producer thread",
     f"{c5['BLOCK_M'] * c5['BLOCK_K'] * 2 // 16} cp.async of 16 B; the {v5_threads} "
     "threads copy a and w, then compute"),
    ("one stage", f"{stage} B = {stage / 1024:.0f} KiB",
     f"tensor cores busy {clk_per_stage:.0f} clk at the datasheet rate", ""),
    ("ring", f"{c6['stages']} stages = {c6['stages'] * stage / 1024:.0f} KiB",
     f"a load of {LOAD_LATENCY_NS} ns = {latency_clk:.0f} clk: "
     f"{latency_clk / clk_per_stage:.1f} stages must be in flight", ""),
]
workshop.show_table(["what", "size", "v6", "v5"], rows)
print(f"shared memory per CTA (launch_geometry): {ccfg.v6_smem_bytes(c6)} B of the 227 KiB an "
      "sm_90 CTA may opt into: the ring, two 64x64 epilogue tiles, 1 KiB of alignment, "
      "the mbarriers")

# %% [markdown]
# ## 3. The mbarrier ring
#
# v5's ring is held together by `__syncthreads()`: every thread of the CTA meets every
# stage. v6 splits the CTA into a producer and consumers that must **not** wait for each
# other more than the data requires, so each ring slot gets two **mbarriers** (8-byte
# objects in shared memory):
#
# * **full[slot]**: "the stage's data has landed". Initialised with a count of 129: 128
#   arrivals of the producer threads' `cp.async.mbarrier.arrive.noinc` (each fires when
#   that thread's copies have landed) and one `mbarrier.arrive.expect_tx` by the TMA
#   issuer, which also announces the TMA's bytes; the copy engine counts them down
#   (`complete_tx`). The phase completes when all 129 arrivals are in and the byte count
#   is back to zero. The consumers wait on it.
# * **empty[slot]**: "every consumer is done reading the slot". Count `4 × CONSUMERS`:
#   lane 0 of each consumer warp arrives, but only once `wgmma.wait_group 1` has said the
#   batch that read the slot is complete. The producer waits on it before refilling.
#
# A barrier's phases alternate, and a wait names the **parity** of the phase it waits for
# (`mbarrier.try_wait.parity`): both sides keep `(slot, phase)` and flip `phase` each time
# `slot` wraps. The producer waits on `empty` with `phase ^ 1`: a fresh barrier counts the
# phase "before" phase 0 as complete, so the first round through the ring passes at once.

# %%
workshop.show_source(V6, "const unsigned full_bar = sm_base + BAR_OFFSET;",
                     end="// the last barrier all warpgroups pass together")
workshop.show_source(V6, "// until the phase of this parity has completed")

# %% [markdown]
# The consumer's side: wait for `full`, make the `cp.async` writes visible to the async
# proxy (`fence.proxy.async`: the TMA's writes already are), issue the batch, and release
# the slot of the **previous** batch once `wgmma.wait_group 1` says it is done:

# %%
workshop.show_source(V6, "int prev = 0;",
                     end="if (num_k_tiles > 0 && lane == 0) gg_mbar_arrive(empty_bar")

# %% [markdown]
# ### The ring, stepped through
#
# `workshop.ring_run` is the same protocol in Python: the kernel's loops and barriers,
# time in abstract steps (a copy lands `copy_steps` after issue, a wgmma batch holds the
# tensor cores for `mma_steps`, a tile ends with an epilogue), and a checker that flags
# any copy into a slot whose wgmma batches have not completed and any batch that reads a
# slot not holding its landed data. Its barrier is a few lines:

# %%
workshop.show_source("notebooks/workshop.py", "class MBarrier:", stop="def ring_run")

# %%
RING = dict(k_tiles=6, tiles=2, stages=4, consumers=2, copy_steps=4, mma_steps=1,
            epilogue_steps=4)
run = workshop.ring_run(**RING)
print(f"finished: {run['done']} in {run['steps']} steps; protocol violations: "
      f"{run['violations'] or 'none'}; steps each consumer waited on a full barrier: "
      f"{run['stall_steps']}")

colors = {"copy": "tab:blue", "mma": "tab:orange", "epilogue": "tab:green",
          "stall": "tab:red"}
fig, ax = plt.subplots(figsize=(11, 3.6))
labels = []
for s in range(RING["stages"]):
    y = len(labels)
    for kind, row, a, b in run["spans"]:
        if kind in ("copy", "mma") and row == s:
            h, off = (0.35, 0.05) if kind == "copy" else (0.35, 0.45)
            ax.broken_barh([(a, b - a)], (y + off, h), facecolors=colors[kind],
                           edgecolors="white")
    labels.append(f"slot {s}")
for c in range(RING["consumers"]):
    y = len(labels)
    for kind, row, a, b in run["spans"]:
        if kind in ("epilogue", "stall") and row == c:
            ax.broken_barh([(a, b - a)], (y + 0.1, 0.8), facecolors=colors[kind],
                           edgecolors="white")
    labels.append(f"consumer {c}")
ax.set(yticks=np.arange(len(labels)) + 0.5, yticklabels=labels, xlabel="step",
       title=f"v6's ring in the model: {RING['stages']} slots, {RING['consumers']} consumers, "
             f"{RING['tiles']} tiles of {RING['k_tiles']} stages")
ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=v) for v in colors.values()],
          labels=["copy in flight (TMA + cp.async)", "wgmma batch on the tensor cores",
                  "epilogue", "waiting on full[slot]"], fontsize=8, ncol=4,
          loc="upper center", bbox_to_anchor=(0.5, -0.22))
ax.invert_yaxis()
workshop.show(fig, "ring")

# %% [markdown]
# Read the picture: the producer fills all four slots at once (the first `empty` waits
# pass); a slot is refilled only after the batch that read it has completed (its consumers
# released it after `wgmma.wait_group 1`), never while the tensor cores read it. The
# consumers wait while the first copies are in flight, and again whenever the ring runs
# dry: a slot's round trip is a copy (4 steps), its two batches, the release one batch
# later, so four slots barely cover the copy latency here (exercise 2 deepens the ring).
# During the epilogue of tile 0 the producer is already filling slots with tile 1:
# persistence (section 5) is what gives it a next tile to fill. Exercise 1 breaks the
# protocol on purpose; `tests/cupy/test_gemm_emulated.py` runs the real kernel source under a CPU
# emulator with a checker of the same rules.
#
# ## 4. Warp specialization and `setmaxnreg`
#
# v6's CTA is 128 producer threads plus `CONSUMERS × 128` consumer threads, one `if` on
# the warpgroup index, and each role gives or takes registers as it enters its branch:

# %%
workshop.show_source(V6, "warp specialization (sm_90a)", end="// a barrier of `count` threads")
workshop.show_source(V6, "if (tid < 128) {", end="#endif")
workshop.show_source(V6, "= consumer warpgroups", end="#endif")

# %% [markdown]
# Why the registers must move: a CTA of 384 threads (one producer, two consumers) that
# wants one CTA per SM enters with at most `65,536 / 384 → 168` registers per thread
# (`__launch_bounds__(384, 1)`, rounded down to 8). A consumer owning 64×256 fp32
# accumulators needs 128 of them for the accumulator alone, plus addresses, descriptors,
# the router weights and the epilogue. The producer needs few: pointers, a slot and a
# phase. `setmaxnreg.dec` releases the producer's surplus to the SM's pool and
# `setmaxnreg.inc` lets the consumers take it; the launcher computes a split that
# conserves the CTA's total:

# %%
workshop.show_source("cuda_kernels/cupy/gemm_configs.py", "def v6_consumer_regs")
c6 = CFG["v6"]
threads = c6["warps"] * 32
entry = 65536 // threads // 8 * 8
cons = ccfg.v6_consumer_regs(c6)
print(f"{threads} threads enter with {entry} registers each ({entry * threads} of 65536); "
      f"producer {c6['PRODUCER_REGS']} x 128 + consumers {cons} x {threads - 128} = "
      f"{c6['PRODUCER_REGS'] * 128 + cons * (threads - 128)}")
print(f"a consumer's accumulator: 64 x {c6['BLOCK_N']} fp32 / 128 threads = "
      f"{64 * c6['BLOCK_N'] // 128} registers per thread")

# %% [markdown]
# ### The compiled kernels
#
# NVRTC runs without a GPU, so the notebook compiles exactly what the H100 runs (`sm_90a`
# for the wgmma rungs) and reads `ptxas`'s report: registers at entry, spills, and the
# shared memory of each CTA. The last row is v6 with **no** register move
# (`PRODUCER_REGS = CONSUMER_REGS = 168`): the consumers must then fit in the entry count.

# %%
def ptxas(v, defines):
    """(registers at entry, spill-store bytes) from ptxas -v of rung v built by NVRTC for
    the architecture it runs on (sm_90a for the wgmma rungs, sm_90 for v4)."""
    cu = cgg.CU_FILES[v]
    arch = _compile.required_arch(cgg.KERNEL_OPTIONS.get(v, ())) or "sm_90"
    log = io.StringIO()
    obj = _compile._nvrtc_compile(_compile.source_text(cu, defines), None, arch,
                                  _compile._BASE_OPTIONS, cu,
                                  program_options=dict(ptxas_options=["-v"]), logs=log)
    res = workshop.cubin_resources(bytes(obj.code)).get(cgg.KERNEL_NAMES[v], {})
    text = log.getvalue()
    spill = re.search(r"(\d+) bytes spill stores", text)
    return res.get("registers"), int(spill.group(1)) if spill else None


if workshop.nvrtc_ready():
    rows = []
    cases = [(v, CFG[v], v) for v in RUNGS] + \
        [("v6", dict(CFG["v6"], PRODUCER_REGS=entry), "v6, no register move")]
    for v, cfg, label in cases:
        defines = ccfg.kernel_defines(v, "bf16", cfg)
        try:
            regs, spill = ptxas(v, defines)
        except Exception as e:     # a rung that does not build here: say so, go on
            rows.append((label, "-", "-", "-", "-", "-", f"{type(e).__name__}: "
                         f"{str(e).splitlines()[0][:60]}"))
            continue
        grid, block, dyn = ccfg.launch_geometry(v, cfg, 4096, N)
        split = (f"{defines['PRODUCER_REGS']} / {defines['CONSUMER_REGS']}"
                 if v == "v6" and defines.get("CONSUMERS") == 2 else "-")
        rows.append((label, f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}, "
                     f"{cfg['stages']} stages", block[0], regs, split, spill, dyn))
    workshop.show_table(["rung", "tile, ring", "threads / CTA", "registers / thread at entry",
                         "setmaxnreg producer / consumer", "spill bytes",
                         "dynamic shared bytes / CTA"], rows)

# %% [markdown]
# v4 spends 240 of its 255 registers on the 128 accumulators of a 64×64 warp tile plus
# its fragments: a larger warp tile does not fit. v5's two warpgroups each hold a 64×256
# accumulator (128 registers per thread) and no operand fragments, in 206 registers. v6
# enters at 168 and runs its consumers at 224; without the move its consumers spill (the
# last row): the register file, not the tensor cores, would bound the tile.
#
# What warp specialization buys beyond registers: the producer never waits for the tensor
# cores and the consumers never wait for address math or copies; nobody meets at a
# `__syncthreads()` per stage. Its cost: 128 threads that do no math, and the whole
# protocol of section 3.
#
# ## 5. Persistence: one CTA per SM, a grouped walk over live tiles
#
# v4 and v5 launch one CTA per tile of the **largest** possible alignment
# (`len(sorted_token_ids)`: every expert padded by `B - 1` rows) and let the CTAs past
# `num_tokens_post_padded` exit at once (the host never waits for the device to know
# it). v6 launches `min(#SMs, tiles)` CTAs; each reads `num_tokens_post_padded` on the
# device, counts the **live** tiles, and walks tiles `blockIdx.x, + gridDim.x, ...`:

# %%
workshop.show_source(V6, "const int ntpp = __ldg(num_tokens_post_padded);",
                     end="const int num_k_tiles")
workshop.show_source("cuda_kernels/cupy/gemm_common.cuh", "// Tile t of the grouped order")

# %% [markdown]
# The order: groups of `GROUP_M` m tiles, **m fastest** inside a group. At any moment the
# 132 CTAs work on a few m tiles (a few experts' rows) and a band of n tiles, so each
# weight panel (`BLOCK_N` rows of one expert, all of `Kdim`) is read from HBM once and
# then from the 50 MB L2 by the other CTAs of the group. The napkin below runs the walk for
# a real routing and counts, wave by wave (132 tiles at a time), the **distinct** bytes the
# wave's CTAs load (their weight panels and `a` tiles): a rough stand-in for what must come
# from HBM if the L2 keeps one wave's data and nothing longer. The first column is what
# the loads add up to without any reuse.

# %%
def tile_of(t, live_m, num_pid_n, group_m):
    """gg_tile_of: tile t of the walk -> (pid_m, pid_n)."""
    per_group = group_m * num_pid_n
    first_m = (t // per_group) * group_m
    rows_ = min(live_m - first_m, group_m)
    return first_m + (t % per_group) % rows_, (t % per_group) // rows_


def walk_bytes(T, e, k, n, kd, bm, bn, order, group_m=8, sms=132, seed=0):
    """(live tiles, launched tiles of v4/v5's grid, loaded bytes, distinct bytes per wave
    summed over the waves) of one GEMM's walk in `order` ("grouped", "n fastest",
    "m fastest"), for a uniform routing of T tokens to top-k of e experts (B = bm)."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((T, e)), axis=1)[:, :k].astype(np.int32)       # [T, k]
    sorted_ids, expert_ids, ntpp = reference.moe_align_block_size(ids, bm, e)
    live_m = -(-int(np.ravel(ntpp)[0]) // bm)
    num_pid_n = -(-n // bn)
    tiles = live_m * num_pid_n
    launched = -(-len(sorted_ids) // bm) * num_pid_n     # v4 / v5: the host's worst case
    distinct = 0
    for w0 in range(0, tiles, sms):
        panels, mtiles = set(), set()
        for t in range(w0, min(tiles, w0 + sms)):
            if order == "grouped":
                pm, pn = tile_of(t, live_m, num_pid_n, group_m)
            elif order == "n fastest":
                pm, pn = t // num_pid_n, t % num_pid_n
            else:
                pm, pn = t % live_m, t // live_m
            panels.add((int(expert_ids[pm]), pn))
            mtiles.add(pm)
        distinct += (len(panels) * bn + len(mtiles) * bm) * kd * 2
    return tiles, launched, tiles * (bm + bn) * kd * 2, distinct


ORDERS = [("grouped", 4), ("grouped", 8), ("grouped", 16), ("n fastest", None),
          ("m fastest", None)]
rows, walk = [], {}
for key, T in (("mixtral", 16384), (MODEL, NAPKIN_T)):
    mname, e, k, h, i = tune.MODELS[key]
    cfg = card_config("v6", T=T, n=2 * i, kd=h, e=e, k=k)
    out = {}
    for order, g in ORDERS:
        tiles, launched, loaded, distinct = walk_bytes(T, e, k, 2 * i, h, cfg["BLOCK_M"],
                                                       cfg["BLOCK_N"], order, g or 8)
        out[(order, g)] = distinct
    walk[f"{mname} T={T}"] = (loaded, out)
    rows.append((f"{mname} GEMM1 T={T}", f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}",
                 f"{tiles} of {launched}", f"{tiles / 132:.1f}", f"{loaded / 1e9:.1f}",
                 *(f"{out[o] / 1e9:.1f}" for o in ORDERS)))
workshop.show_table(["GEMM", "tile", "live tiles of v5's grid", "waves of 132",
                     "GB loaded"] + [f"distinct GB/wave: {o}" + (f" {g}" if g else "")
                                     for o, g in ORDERS], rows)

fig, ax = plt.subplots(figsize=(9, 3.4))
xs = np.arange(len(ORDERS))
for j, (label, (loaded, out)) in enumerate(walk.items()):
    ax.bar(xs + (j - 0.5) * 0.38, [out[o] / loaded for o in ORDERS], 0.38, label=label)
ax.set(xticks=xs, xticklabels=[o + (f"\nGROUP_M={g}" if g else "") for o, g in ORDERS],
       ylabel="distinct bytes per wave / bytes loaded",
       title="The tile order decides how much of what the CTAs load is new to the wave")
ax.legend(fontsize=8)
workshop.show(fig, "tile_order")

# %% [markdown]
# For Mixtral's wide GEMM1 (112 n tiles, 32 m tiles per expert) the order matters a lot:
# walking n fastest gives every CTA of a wave its own weight panel, walking m fastest its
# own `a` tile; the grouped walk reuses both. Qwen3's GEMM1 has only 6 n tiles, so every
# order but m-fastest does about as well. The napkin ignores what the L2 keeps across waves
# and the fact that the `a` rows of one token are shared by its `top_k` experts; the tuner
# picked `GROUP_M` by timing (1, 4, 8 or 16 depending on the shape: the table's rows; 1 where
# an expert has a single m tile, as DeepSeek-V3 at T=4096 and Qwen3-30B-A3B at T=1024: the
# CTAs of a wave then share one expert's `a` rows and read its weight panels in order).
#
# Persistence also means: the barrier setup happens once per CTA, not once per tile; the
# producer fills the next tile's stages while the consumers run the epilogue (the ring
# picture above); and no CTA is launched for the dead tiles past
# `num_tokens_post_padded` (the third column: v5 launches and retires them).
#
# It also lets a tile's bookkeeping move off the critical path. A consumer begins a tile by
# branching on global data (the tile's expert; with 256-row tiles, which pieces hold live
# rows) and by loading its router weights through its rows' slots, two loads in a chain.
# Loaded as the tile begins, they stall the consumer for a few hundred nanoseconds while the
# ring, already full of the tile's first stages, waits for it, once per tile; with short
# tiles (12 k steps for Qwen3-30B-A3B's GEMM2) that is a few percent. The consumer therefore
# loads the next tile's ids as the current one begins (`TileIds`, below) and computes on
# them only when that tile comes. Measured through the layer on an H100 (CUDA graphs, the
# same call): DeepSeek-V3 at T=4096 9.44 -> 9.27 ms, Qwen3-30B-A3B at T=1024 and 4096
# 0.5-1% faster; doing the same for the producer's `a` rows gained nothing more (the stages
# it has already issued hide its loads) and cost it 8-24 registers.

# %%
workshop.show_source(V6, "struct TileIds {", end="load_ids(t + gridDim.x, next)")

# %% [markdown]
# ### Two m tiles of one expert: the 256-row tile
#
# The grouped walk shares a weight panel among the CTAs that work on it at the same time;
# nothing keeps it for a CTA that comes later. At about 128 rows per expert (DeepSeek-V3 at
# T=4096) most experts need two 128-row tiles, the second mostly padding, and each reads the
# expert's whole panel: once the two drift apart by more than the L2 holds, the second read
# comes from HBM again (`ncu` on v5's GEMM1 on an H100: 1.14× the unique weight bytes). v6
# with `BLOCK_M = 256` gives each consumer two 64-row pieces multiplied by the same `w`
# tile, so a panel is read once per expert; and since an expert's slots come before its
# padding, a piece whose first row is padding holds no live row: it issues no `wgmma`, so
# the bigger tile multiplies fewer rows than the two small ones did (whole 64-row pieces,
# not 128-row tiles). The napkin, for a uniform routing (every tile reading its panel from
# HBM, the worst case):

# %%
def tile_napkin(T, e, k, n, kd, bm, seed=0):
    """(m tiles, panel reads / unique panel bytes, rows multiplied / live rows) of one GEMM
    with bm-row tiles (block_size bm); 256-row tiles multiply only their live 64-row pieces."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((T, e)), axis=1)[:, :k]
    counts = np.bincount(ids.ravel(), minlength=e)
    tiles = -(-counts // bm)
    multiplied = (-(-counts // 64) * 64) if bm == 256 else tiles * bm
    panel = n * kd * 2
    return int(tiles.sum()), tiles.sum() * panel / ((counts > 0).sum() * panel), \
        multiplied.sum() / counts.sum()


name, e, k, h, i = tune.MODELS["deepseek"]
rows = []
for bm in (128, 256):
    ntiles, reads, mult = tile_napkin(4096, e, k, 2 * i, h, bm)
    rows.append((f"{name} GEMM1 T=4096", bm, ntiles, f"{reads:.2f}", f"{mult:.2f}"))
workshop.show_table(["GEMM", "BLOCK_M", "m tiles", "panel reads / unique (no L2 reuse)",
                     "rows multiplied / live rows"], rows)
g1 = [tuned_us(name, 128, v, 2 * i, h) for v in ("v5", "v6")]
g2 = [tuned_us(name, 128, v, h, i) for v in ("v5", "v6")]
if all(g1 + g2):
    print(f"{CARD}, tuned at m = 128: GEMM1 v5 (128 rows) {g1[0]:.0f} us, v6 (256 rows) "
          f"{g1[1]:.0f} us; GEMM2 {g2[0]:.0f} and {g2[1]:.0f} us")

# %% [markdown]
# The L2 catches part of the second read (1.14× measured, not the napkin's worst case), so
# the 256-row tile alone gained GEMM1 a few percent, not a third, and only tied v5 on GEMM2,
# whose panels are 3.5× smaller (`Kdim` 2048, not 7168). With the consumers' ids a tile ahead
# (above) and `GROUP_M` 1 (one m tile per expert: a wave reads one expert's panels in order)
# the tuned times printed here are about 10% (GEMM1) and 5% (GEMM2) under v5's (the v5 rows
# were timed in an earlier run). The table (`version_by_shape`) runs both GEMMs of
# DeepSeek-V3 at `m = 128` on the 256-row tile: GEMM1 and GEMM2 must share the alignment
# block, and the pair is the faster sum.
#
# ## 6. Measured: v4 → v5 → v6 beside vLLM's layer and the roofline
#
# Per model and `T`: GEMM1 + GEMM2 of each rung at its tuned configuration (`"us"` of the
# H100 section of `gemm_configs.json`) as TFLOP/s of the layer's FLOPs, beside the whole
# layer of ours and of vLLM's Triton kernel (the benchmark, same run) and the roofline
# floor of the layer (the benchmark's: touched expert bytes / 3.35 TB/s or FLOPs /
# 989 TFLOP/s, whichever is larger).

# %%
def tflops(p, us):
    return None if not us else p["flops"] / us / 1e6


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


rows = []
for p in points:
    us = p["us"]
    r54 = us["v4"] / us["v5"] if us.get("v4") and us.get("v5") else None
    r65 = us["v5"] / us["v6"] if us.get("v5") and us.get("v6") else None
    rows.append((p["model"], p["T"], p["m"], *(fmt(tflops(p, us.get(v)), ".0f") for v in RUNGS),
                 fmt(r54, ".2f"), fmt(r65, ".2f"), fmt(us.get("v6"), ".0f"),
                 fmt(p["ours"], ".0f"), fmt(p["vllm"], ".0f"), fmt(p["floor"], ".0f"),
                 fmt(p["floor"] / us["v6"] if p["floor"] and us.get("v6") else None, ".0%")))
workshop.show_table(["model", "T", "m", "v4 TF/s", "v5 TF/s", "v6 TF/s", "v5/v4", "v6/v5",
                     "v6 GEMMs µs", "our layer µs", "vLLM layer µs", "floor µs",
                     "v6: % of roofline"], rows)


def ratio_range(a, b, lo, hi):
    xs = [p["us"][a] / p["us"][b] for p in points
          if lo <= p["m"] <= hi and p["us"].get(a) and p["us"].get(b)]
    return f"{min(xs):.2f}-{max(xs):.2f}x ({len(xs)} points)" if xs else "no point measured"


for lo, hi, what in ((1, 64, "m <= 64 (the floor: weight bytes)"), (128, 256, "m = 128-256"),
                     (512, 1 << 30, "m >= 512")):
    print(f"{what:34s} v5/v4 {ratio_range('v4', 'v5', lo, hi):24s} "
          f"v6/v5 {ratio_range('v5', 'v6', lo, hi)}")

models = list(dict.fromkeys(p["model"] for p in points))
fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 3.9), squeeze=False)
for ax, model in zip(axes[0], models):
    mine = [p for p in points if p["model"] == model]
    xs = np.arange(len(mine))
    for j, v in enumerate(RUNGS):
        ax.bar(xs + (j - 1.5) * 0.22, [tflops(p, p["us"].get(v)) or 0 for p in mine], 0.22,
               label=f"{v}: GEMM1 + GEMM2 (tuned)")
    for key, marker, label in (("ours", "o", "our layer (bench)"),
                               ("vllm", "s", "vLLM's layer (bench)")):
        ax.plot(xs + 0.36, [tflops(p, p[key]) or np.nan for p in mine], marker, color="k",
                mfc="white" if key == "vllm" else "k", ls="none", label=label)
    roof = [tflops(p, p["floor"]) or np.nan for p in mine]
    ax.hlines(roof, xs - 0.45, xs + 0.45, color="r", lw=2, label="roofline (the layer's floor)")
    ax.set(xticks=xs, xticklabels=[f"T={p['T']}\nm={p['m']}" for p in mine],
           ylabel="TFLOP/s (layer FLOPs / time)", title=model,
           ylim=(0, 1.08 * PEAK_FLOPS / 1e12))
    ax.axhline(PEAK_FLOPS / 1e12, color="k", lw=0.8, ls=":")
handles, labels = axes[0][0].get_legend_handles_labels()
fig.legend(handles, labels, fontsize=8, ncol=6, loc="upper center", bbox_to_anchor=(0.5, 0.0))
fig.suptitle(f"Prefill on one {CARD}: the Hopper rungs, the layers, the roofline "
             f"(dotted: {PEAK_FLOPS / 1e12:.0f} TFLOP/s)", y=1.02)
fig.tight_layout()
workshop.show(fig, "measured")

# %% [markdown]
# **What the data can and cannot separate.**
#
# * **v4 → v5** is one idea (wgmma from swizzled shared memory) plus the deeper rings the
#   tuner found for it: the big step, and it grows with the rows per expert (the ranges
#   printed under the table).
# * **v5 → v6** changes **four things at once** — TMA for the weights, the mbarrier ring,
#   warp specialization with `setmaxnreg`, the persistent grouped walk — and each rung was
#   tuned on its own, so the tiles differ too. The measured rungs are v4, v5 and v6, so the
#   table gives v6's gain over v5 as one number per point (about a tenth where the tensor
#   cores are the limit, in the table committed when this was written; DeepSeek-V3 at
#   `m = 128` is a tie, and the H100's `version_by_m` keeps v5 for that bucket) and says
#   nothing about which of the four features earns it. Isolating them is exercise 4.
# * Where the floor is the weight bytes (Qwen3 and DeepSeek-V3 at `T = 1024`: 64 and 32
#   rows per expert), all three rungs sit close to each other and near the floor: the
#   Hopper features feed the tensor cores, and there the tensor cores wait on HBM.
# * The GEMM columns and the layer columns come from **different runs** (tune.py: each
#   GEMM alone, median of 3; the benchmark: the whole experts computation as a CUDA graph,
#   median of 20). Compare the rungs with each other through the GEMM columns, and ours
#   with vLLM only through the layer columns, which come from one run.

# %% [markdown]
# ## 7. On a GPU: the three rungs on one shape
#
# On an sm_90 GPU (H100, H200) the three rungs run the worked example's GEMM1, each at the
# configuration the table gives this card, each checked against v4 and timed (inputs stay
# in L2 between repetitions here: the committed numbers flush it).

# %%
timed = []
if RUN.gpu:
    import cupy as cp

    from sandbox import get_backend

    align = get_backend("cupy").stage_fn("align")
    if not _compile.is_sm90():
        print("this GPU is not sm_90: v5 and v6 (wgmma, setmaxnreg, TMA) do not run here")
    else:
        t_start = time.time()
        rng = np.random.default_rng(0)
        a_d = cgg.random_device((GPU_TOKENS, KD), BF16)                   # [T, Kdim]
        w_d = cgg.random_device((E, N, KD), BF16, scale=KD ** -0.5)       # [E, N, Kdim]
        ids_d = cp.asarray(np.argsort(rng.random((GPU_TOKENS, E)), axis=1)[:, :K]
                           .astype(np.int32))                             # [T, top_k]
        flops = cgg.gemm_flops(GPU_TOKENS * K, N, KD)
        want = None
        for v in RUNGS:
            if time.time() - t_start > GPU_BUDGET_S:
                print(f"time budget of {GPU_BUDGET_S} s spent: {v} skipped")
                break
            try:
                cfg = ccfg.get_config(GPU_TOKENS, N, KD, E, K, BF16, version=v)
                B = int(cfg["BLOCK_M"])
                aligned = align(ids_d, B, E)      # (sorted_token_ids, expert_ids, ntpp)

                def fn(al=aligned, B=B, v=v):
                    return cgg.grouped_gemm(a_d, w_d, *al, K, B, version=v)
                got = cp.asnumpy(fn().view(cp.uint16)).view(BF16).astype(np.float32)
                want = got if want is None else want
                err = workshop.rel_err(got, want)
                ms = workshop.time_gpu_ms(fn, warmup=2, reps=10)
                timed.append((v, f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}", f"{err:.1e}",
                              f"{ms * 1e3:.0f}", f"{flops / ms / 1e9:.0f}"))
            except Exception as e:   # a rung that cannot run here: report, go on
                print(f"{v}: {type(e).__name__}: {str(e)[:160]}")
        workshop.show_table(["rung", "tile", "rel. err vs v4", "µs", "TFLOP/s"], timed)
else:
    print("CPU mode: section 6 holds the committed H100 measurements.")

# %% [markdown]
# ## 8. The other end: a decode step in one launch
#
# Everything above feeds tensor cores. At `T = 1` there is nothing for them to do: each
# routed expert sees **one** row, so each weight is used once, an fma per element, and the
# step is a read of the routed experts' weights. Napkin math for Qwen3-30B-A3B: 8 experts ×
# 3 matrices × 2048 × 768 × 2 bytes = 75 MB, 22 µs at 3.35 TB/s. The staged path took 58 µs
# on the H100: five launches (alignment, GEMM1, activation, GEMM2, combine), each with its
# launch-to-drain gap, and two GEMM ramps, each leaving SMs idle while its last tiles drain.
# Narrower tiles (more CTAs) and programmatic dependent launches did not move it; removing
# the boundaries did.
#
# `cuda_kernels/cupy/experts_decode.cu` is the whole expert part in one cooperative launch,
# one block per SM:
#
# * **phase 1** — each warp takes a row `j` of a slot's expert, streams the gate row and the
#   up row (16-byte loads that skip L1, 16 in flight per lane), and applies the activation
#   where the two dot products end: no alignment (a slot is its own tile), no `c1`;
# * **one grid barrier** (`grid_barrier.cuh`; the cooperative launch guarantees every block
#   is resident, so nobody waits for a block that never starts);
# * **phase 2** — each block owns whole output rows `h`, computes GEMM2 for all `K` slots,
#   applies the router weight and sums the slots in order: the combine is the epilogue.
#
# GEMM2's weights do not depend on GEMM1, so each block pulls the first 64 KB of its
# phase-2 rows into L2 (`cp.async.bulk.prefetch`) while phase 1 runs.

# %%
workshop.show_source("cuda_kernels/cupy/experts_decode.cu", "phase 1: GEMM1 + activation",
                     "grid_barrier(bar);", max_lines=45)

# %% [markdown]
# The same committed benchmark run as section 6, at `T = 1` (`rungs`: what the plan ran;
# the floor is the routed experts' bytes at the datasheet bandwidth):

# %%
rows = []
for mname, e, k, h, i in tune.MODELS.values():
    ours = bench_pts.get((mname.lower(), 1, "cupy"))
    peer = bench_pts.get((mname.lower(), 1, "vllm-triton"))
    if ours is None or peer is None:
        continue
    ms, peer_ms = ours["stats"]["median"], peer["stats"]["median"]
    rows.append((mname, "/".join(ours.get("rungs", [])) or "-", f"{ours['floor_ms'] * 1e3:.0f}",
                 f"{ms * 1e3:.1f}", f"{peer_ms * 1e3:.1f}", f"{ms / peer_ms:.2f}",
                 f"{ours['floor_ms'] / ms:.0%}"))
if rows:
    workshop.show_table(["model", "rungs", "floor µs", "ours µs", "vLLM µs", "ours / vLLM",
                         "% of floor"], rows)
else:
    print(f"no T = 1 points in {BENCH}*.json")

# %% [markdown]
# **Reading it.** Where the weights are small (Qwen3: 75 MB) the fixed costs were most of
# the step, and one launch removes them. Where they are large (Mixtral and DeepSeek-V3 read
# 704 MB at `T = 1`) both paths already stream at about 2.7 TB/s, close to what this card
# reads (the bench's `card` record measures it), and one launch changes little. From
# `T = 2` on the staged path wins back wherever tokens share experts (one launch reads a
# shared expert's rows once per slot) or the weights are large, which is why
# `experts_decode.CONFIGS["decode"]["MAX_TOKENS"]` is 1. The sums run in another order than
# the tensor cores' (fp32 fma per lane, then a warp's butterfly), so the output matches the
# stages to bf16 rounding, not bit for bit (notebook 06).
#
# **Rung 2: the read itself.** Where a block has megabytes to read, two things kept rung 1
# from the card's limit, each measured on the H100 at `T = 1`:
#
# * *how it reads*: 705 MB took 253-263 µs as 16-byte loads per lane and 230-232 µs as
#   `cp.async.bulk` copies of 8-32 KB into shared-memory stages: one instruction moves
#   kilobytes, tracked by the copy engine instead of the load-store unit's per-request slots;
# * *who waits*: with the rows split evenly, blocks ended phase 1 up to 25 µs apart (SMs do
#   not all read HBM equally fast), and the grid barrier waits for the slowest.
#
# `cuda_kernels/cupy/experts_decode_ring.cu` answers both with the pattern of the Hopper rung
# above, at decode size: one producer warp issues bulk copies into a ring of four 32 KB
# stages (a full and an empty `mbarrier` per stage; the stage's descriptor comes by a
# 32-byte bulk copy beside its weights, so one wait covers both), eight consumer warps
# compute from shared memory, phase 1's chunks come from a launch-wide counter (a block
# that reads faster takes more), and phase 2's weights stream into the ring while the
# barrier waits. Same math, same order of sums: the same bits as rung 1. It is taken where a
# block has at least 2 MB of routed weights (Mixtral-8x7B and DeepSeek-V3, `decode-ring` in
# the table's rungs); below that its fixed costs lose (Qwen3-30B-A3B: 40 → 43 µs).

# %% [markdown]
# ## Exercises
#
# 1. **Break the ring** (CPU). Run `workshop.ring_run(release_early=True)`: each consumer
#    releases its slot right after issuing the batch, before `wgmma.wait_group`. What does
#    the checker report, and what would the GPU compute? Then run it with
#    `producer_parity=0` and with `stages=1`. What happens, and which line of the kernel
#    (or which `static_assert`) prevents it?
# 2. **How deep a ring?** (CPU) In the model, with copies taking 4 steps and a batch 1 step
#    per consumer, how many stages make the consumers stop waiting on `full`? Compare with
#    the napkin of section 2 (stages in flight = latency / time per stage). What changes
#    when the epilogue gets longer?
# 3. **Registers** (CPU, NVRTC). For the worked example's 128×256 v6 tile, find the
#    smallest `CONSUMER_REGS` (set `PRODUCER_REGS` so that the CTA's total is conserved)
#    at which the consumers do not spill. How low can `PRODUCER_REGS` go before the
#    producer spills?
# 4. **Isolate TMA, warp specialization and persistence** (GPU, with a CPU part). The
#    committed data measure v5 → v6 as one step. Plan the runs that separate its parts:
#    one consumer warpgroup against two (v6's `#define CONSUMERS`, tiles 64×256 with 8 or
#    12 warps), `GROUP_M` 4 / 8 / 16, `STAGES` 3 / 4, and a non-persistent v6 (one tile
#    per CTA). Which candidates of `python -m cuda_kernels.cupy.gemm --sweep`
#    differ in exactly one tunable, what does each comparison isolate, and what stays
#    confounded?
# 5. **The tile order's bytes** (CPU). With `walk_bytes`, which `GROUP_M` gives the fewest
#    distinct bytes per wave for DeepSeek-V3's GEMM2 at `T = 16384`? Compare with the
#    `GROUP_M` the tuner chose for that shape, and say why the two may differ.
#
# Solutions: `solutions/07_hopper_gemm_solutions.ipynb`.
