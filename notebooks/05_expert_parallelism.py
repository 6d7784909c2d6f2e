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
# # 5. Expert parallelism
#
# **What you will learn**
#
# * how an MoE layer runs with its experts spread over `W` GPUs: dispatch the tokens to
#   the experts, compute, combine the results back — drawn for a small example;
# * the two dispatch/combine schemes (all-gather + reduce-scatter, and all-to-all-v of the
#   routed rows), and how many bytes each moves;
# * EPLB: replicating and re-placing experts so that a skewed load does not make one GPU
#   the straggler — before and after;
# * how to read the measured NCCL bandwidth.
#
# The story in full is `docs/ep.md`; the code is `sandbox/ep/`. Everything here runs on a
# CPU: `W = 2` processes exchange tokens through sockets with the same code paths that
# exchange them through NCCL on GPUs.

# %% tags=["parameters"]
import workshop

RUN = workshop.setup("05_expert_parallelism")
WORLD = 2                                        # ranks of the live run (CPU processes)
COMM = "cpu"                                     # "nccl" with >= 2 GPUs (then STAGE_BACKEND "cupy")
STAGE_BACKEND = "reference"                      # the experts' stages inside each rank
LAYER = dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=48, dtype="float32",
             alltoall_rows="token")              # or "slot": one row per (token, expert)
TOKENS_PER_RANK = [7, 4]                         # uneven on purpose
EPLB_STUDY = dict(gpus=4, redundant=4)           # the rebalancing study (no processes)
DEEPSEEK = dict(H=7168, K=8, E=256, bytes=2)     # the shape of the bandwidth napkin math

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle
from matplotlib.ticker import NullFormatter

import reference
from reference import eplb
from sandbox.checkpoint import default_trace_path
from sandbox.datagen import load_trace

# %% [markdown]
# ## 1. Dispatch and combine, drawn
#
# With `W` ranks, rank `r` holds experts `[r·E/W, (r+1)·E/W)` (linear placement) and its
# own tokens. After routing, a token's `K` experts may live anywhere, so its hidden state
# must travel to them (**dispatch**) and their outputs must come back and be summed with
# the router weights (**combine**). Two ways to do it:
#
# * **(a) all-gather / reduce-scatter** (vLLM's default): every rank gathers *every*
#   rank's tokens, runs its experts on the rows routed to them (the others contribute
#   zero), and a reduce-scatter sums the partial outputs, each rank keeping its own rows.
# * **(b) all-to-all-v** (MegaBlocks, DeepEP): a token is sent only where its experts
#   are. By default (`alltoall_rows="token"`, DeepEP's layout) it goes **once to each rank**
#   that holds one of its experts; that rank runs its local slots of the token and sends
#   back one weighted partial row, and the source adds the partials. With
#   `alltoall_rows="slot"` (MegaBlocks' layout) each (token, expert) pair travels as its own
#   row and the source does the weighted sum.

# %%
W_, E_, K_, T_ = 2, 4, 2, 3
rng = np.random.default_rng(7)
ids = [reference.fused_topk(None, rng.standard_normal((T_, E_)).astype(np.float32), K_, True)[1]
       for _ in range(W_)]                                   # per rank: [T, K]
per = E_ // W_
colors = plt.get_cmap("tab10")


def draw(ax, scheme):
    ys = {}
    for r in range(W_):                                      # source tokens, left
        for t in range(T_):
            y = (W_ - r) * (T_ + 1.5) - t
            ys[(r, t)] = y
            ax.add_patch(Rectangle((0, y - 0.35), 1.2, 0.7, color=colors(r), alpha=0.35))
            ax.text(0.6, y, f"rank {r} token {t}\nexperts {ids[r][t].tolist()}", ha="center",
                    va="center", fontsize=7)
    ey = {}
    for r in range(W_):                                      # expert ranks, right
        y0 = (W_ - r) * (T_ + 1.5) - T_ + 0.6
        ax.add_patch(Rectangle((4, y0 - 0.5), 1.6, T_ + 0.2, color=colors(r), alpha=0.15))
        ax.text(4.8, y0 + T_ - 0.7, f"rank {r}", ha="center", fontsize=8, weight="bold")
        for j in range(per):
            e = r * per + j
            ey[e] = y0 + (T_ - 1.2) * (j + 0.5) / per
            ax.text(4.8, ey[e], f"expert {e}", ha="center", va="center", fontsize=8)
    n_arrows = 0
    for (r, t), y in ys.items():
        if scheme == "allgather":                            # the whole row to every rank
            for dst in range(W_):
                y_dst = (W_ - dst) * (T_ + 1.5) - T_ + 0.6 + (T_ - 1.2) / 2
                ax.add_patch(FancyArrowPatch((1.2, y), (4, y_dst), arrowstyle="->",
                                             color=colors(r), alpha=0.6, mutation_scale=8))
                n_arrows += 1
        elif scheme == "token":                              # once per destination rank
            for dst in sorted({int(e) // per for e in ids[r][t]}):
                y_dst = (W_ - dst) * (T_ + 1.5) - T_ + 0.6 + (T_ - 1.2) / 2
                ax.add_patch(FancyArrowPatch((1.2, y), (4, y_dst), arrowstyle="->",
                                             color=colors(r), alpha=0.6, mutation_scale=8))
                n_arrows += 1
        else:                                                # one row per routed slot
            for e in ids[r][t]:
                ax.add_patch(FancyArrowPatch((1.2, y), (4, ey[int(e)]), arrowstyle="->",
                                             color=colors(r), alpha=0.6, mutation_scale=8))
                n_arrows += 1
    ax.set(xlim=(-0.2, 6), ylim=(0, W_ * (T_ + 1.5) + 1))
    ax.axis("off")
    return n_arrows


fig, (a0, a1, a2) = plt.subplots(1, 3, figsize=(17, 4.6))
n0 = draw(a0, "allgather")
n1 = draw(a1, "token")
n2 = draw(a2, "slot")
a0.set_title(f"(a) all-gather: every token to every rank\n({n0} row copies)")
a1.set_title(f"(b) all-to-all-v, token rows (default): once to\neach rank holding one of its "
             f"experts ({n1} row copies)")
a2.set_title(f"(b) all-to-all-v, slot rows: one row per\n(token, expert) ({n2} row copies)")
for ax in (a0, a1, a2):
    ax.title.set_fontsize(10)
fig.suptitle(f"dispatch, W={W_} ranks, {T_} tokens each, top-{K_} of {E_} experts "
             "(combine runs the arrows backwards)", y=1.08)
workshop.show(fig, "dispatch")

# %% [markdown]
# ## 2. How many bytes each scheme moves
#
# Per rank, with `T` tokens, hidden size `H`, `b` bytes per element (`docs/ep.md`):
#
# | scheme | dispatch | combine |
# |---|---|---|
# | (a) all-gather / reduce-scatter | `T(H·b + 8K)` (rows + routing) | `W·T·H·b` |
# | (b) all-to-all-v, token rows | `T·R·H·b` | `T·R·H·b` |
# | (b) all-to-all-v, slot rows | `T·K·H·b` | `T·K·H·b` |
#
# with `R ≤ min(W, K)` the number of distinct ranks a token's experts live on (for random
# routing `W(1 − (1 − 1/W)^K)`). Scheme (a) grows with the number of ranks; slot rows grow
# with top-k; token rows with the smaller of the two, which is why they are the default.

# %%
H, K, b = DEEPSEEK["H"], DEEPSEEK["K"], DEEPSEEK["bytes"]
T = 4096
Ws = np.array([2, 4, 8, 16, 32, 64])
allgather = T * (H * b + 8 * K) + Ws * T * H * b
alltoall = 2 * T * K * H * b * np.ones_like(Ws)
dedup = 2 * T * H * b * Ws * (1 - (1 - 1 / Ws) ** K)         # expected distinct ranks per token
fig, ax = plt.subplots(figsize=(7.5, 3.6))
ax.plot(Ws, allgather / 2**20, marker="o", label="(a) all-gather + reduce-scatter")
ax.plot(Ws, dedup / 2**20, marker="o", label="(b) all-to-all-v, token rows (default)")
ax.plot(Ws, alltoall / 2**20, marker="o", ls="--", label="(b) all-to-all-v, slot rows")
ax.set(xscale="log", yscale="log", xticks=Ws, xticklabels=Ws, xlabel="ranks W",
       ylabel="MiB per rank (dispatch + combine)",
       title=f"DeepSeek-V3 shape (H={H}, top-{K}, bf16), T={T} tokens per rank")
ax.xaxis.set_minor_formatter(NullFormatter())      # the log axis: only the W ticks
ax.legend(fontsize=8)
workshop.show(fig, "bytes_per_scheme")

# %% [markdown]
# ## 3. The real thing, on two processes
#
# `sandbox.ep.launch` starts one process per rank (spawned, never forked), serves the
# rendezvous store, and returns each rank's result. Each rank below builds the same random
# single-device layer (same seed), keeps only its experts in an `EPMoE`, runs its own
# tokens through both schemes, and compares with the single-device output for those
# tokens. It then records a skewed load (experts 5 and 6 are hot), rebalances with EPLB
# (2 redundant experts), and checks that moving experts does not change the output.

# %%
parity = dict(config={**LAYER}, tokens_per_rank=TOKENS_PER_RANK, backend=STAGE_BACKEND)
eplb_run = dict(config={**LAYER, "num_redundant_experts": WORLD, "scheme": "alltoall"},
                tokens=48, logits_scale=3.0, hot=[5, 6], backend=STAGE_BACKEND)
results = workshop.launch_ranks(workshop.ep_notebook_rank, WORLD, COMM,
                                args=(parity, eplb_run), timeout=60)

rows = []
for res in results:
    p = res["parity"]
    for scheme in ("allgather", "alltoall"):
        st = p[scheme]["stats"]
        detail = (f"tokens per rank {st.get('tokens_per_rank')}" if scheme == "allgather"
                  else f"rows sent {st.get('rows_sent')}, received {st.get('rows_received')}")
        rows.append((p["rank"], p["local_experts"], scheme, f"{p[scheme]['rel_err']:.1e}", detail))
workshop.show_table(["rank", "experts", "scheme", "rel. error vs single device", "what moved"],
                    rows)

# %% [markdown]
# Both schemes reproduce the single-device layer to fp32 rounding; they only add in a
# different order. Rank 1's experts receive rows from rank 0 and back: that traffic is
# the cost of expert parallelism.
#
# ## 4. EPLB: when one GPU gets the hot experts
#
# Routing is skewed (notebook 2), so with a fixed placement the GPU holding the hot
# experts does most of the work and the others wait for it. DeepSeek's EPLB
# (`reference/eplb.py`) adds `R` redundant physical slots and decides, from the recorded
# load, which experts to replicate and where every replica goes:
#
# 1. pack expert groups onto nodes (one node here),
# 2. give each extra replica to the expert with the highest load *per replica*,
# 3. pack the replicas onto GPUs, balancing the load, `P/W` slots per GPU.
#
# Here it is on the load of DeepSeek-V3's skewed trace (16 experts, 4 GPUs, 4 redundant
# slots):

# %%
xz, lz = load_trace(default_trace_path("deepseek_v3", "zipf"))
_, ids_z, _ = reference.fused_topk(None, lz, 4, True)
load = np.bincount(ids_z.ravel(), minlength=lz.shape[1]).astype(np.float64)     # [E]
E = load.size
G, R = EPLB_STUDY["gpus"], EPLB_STUDY["redundant"]

before = eplb.gpu_loads(load, np.arange(E), G)                       # linear, no replicas
phy2log, log2phy, logcnt = eplb.rebalance_experts(load, E + R, num_groups=1, num_nodes=1,
                                                  num_gpus=G)
after = eplb.gpu_loads(load, phy2log, G)

fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 3.6), gridspec_kw={"width_ratios": [1, 1.4]})
xs = np.arange(G)
a0.bar(xs - 0.2, before, 0.4, label=f"linear placement, {E // G} experts per GPU")
a0.bar(xs + 0.2, after, 0.4, label=f"EPLB, {R} replicas, {(E + R) // G} slots per GPU")
a0.axhline(load.sum() / G, color="k", ls="--", lw=1, label="perfect balance")
a0.set(xticks=xs, xlabel="GPU", ylabel="slots routed to the GPU",
       title=f"max/mean: {before.max() / before.mean():.2f} -> {after.max() / after.mean():.2f}")
a0.legend(fontsize=8)
grid = phy2log.reshape(G, -1)                                   # [GPU, slot] -> logical expert
slot_load = load[grid] / logcnt[grid]                            # each replica takes a share
a1.imshow(slot_load, cmap="OrRd", aspect="auto", vmin=0)
for g in range(G):
    for j in range(grid.shape[1]):
        e = grid[g, j]
        a1.text(j, g, f"e{e}" + (f" (1/{logcnt[e]})" if logcnt[e] > 1 else "")
                + f"\n{slot_load[g, j]:.0f}", ha="center", va="center", fontsize=8,
                color="w" if slot_load[g, j] > 0.6 * slot_load.max() else "k")
a1.set(yticks=range(G), yticklabels=[f"GPU {g}" for g in range(G)], xticks=[],
       title="EPLB placement: the expert in each slot and the load it carries\n"
             "(1/n: one of n replicas, each taking 1/n of the expert's tokens)")
a1.grid(False)
workshop.show(fig, "eplb")

# %% [markdown]
# The runtime does this on the fly (`EPMoE.rebalance()`): all-reduce the recorded load,
# run the same policy on every rank, and move the expert weights with one group of
# point-to-point sends. In the live run of section 3 (8 experts on 2 ranks, 2 redundant
# slots, experts 5 and 6 hot, both on rank 1 at first):

# %%
rows = []
for res in results:
    e = res["eplb"]
    rows.append((e["rank"], e["placement_before"], e["placement_after"],
                 e["rows_computed_before"], e["rows_computed_after"], f"{e['out_change']:.1e}"))
workshop.show_table(["rank", "slots before (logical ids)", "slots after", "rows received before",
                     "after", "output change"], rows)
print("recorded load per logical expert:", [int(v) for v in results[0]["eplb"]["load"]])

# %% [markdown]
# Replicas hold identical weights, so the output does not move (beyond fp32 rounding from
# the new summation order), while the rows each rank receives, and computes, even out.
#
# ## 5. Measured bandwidth
#
# `benchmarks/bench_ep.py --gpus 2` times dispatch and combine for DeepSeek-V3's shape
# over NCCL on H200s (NVLink), beside a raw NCCL all-to-all of the same bytes. Its JSON
# lands in `benchmarks/results/ep_*.json`; here is whatever is committed:

# %%
ep_results = workshop.load_results("ep_")
if not ep_results:
    print("No EP results are committed in benchmarks/results/ yet: run "
          "`python benchmarks/bench_ep.py --gpus 2` on two GPUs. Until then, the expected "
          "times below use the NCCL all-to-all bandwidth we measured between two H200s "
          "(NVLink): 416 GB/s per rank at 32 MiB, 590 GB/s at 512 MiB.")
    Ts = np.array([128, 512, 1024, 4096])
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for gbps, ls in ((416, "-"), (590, "--")):
        for scheme, nbytes in (
                ("all-to-all-v", 2 * Ts * K * H * b),
                ("all-gather + reduce-scatter", Ts * (H * b + 8 * K) + 2 * Ts * H * b)):
            ax.plot(Ts, nbytes / (gbps * 1e9) * 1e6, ls=ls, marker="o",
                    label=f"{scheme} at {gbps} GB/s")
    ax.set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel="µs (dispatch + combine)",
           title="expected exchange time, W = 2, DeepSeek-V3 shape (napkin math)")
    ax.legend(fontsize=7)
    workshop.show(fig, "ep_expected")
for path, rec in ep_results:
    rows_ = [r for r in rec.get("rows", []) if r.get("GBps_per_rank")]
    if not rows_:
        continue
    tokens_ = sorted({r["tokens_per_rank"] for r in rows_})
    fig, axes = plt.subplots(1, len(tokens_), figsize=(6.5 * len(tokens_), 5), squeeze=False)
    for ax, T_r in zip(axes[0], tokens_):
        q = [r for r in rows_ if r["tokens_per_rank"] == T_r]
        ys = np.arange(len(q))[::-1]
        ax.barh(ys, [r["GBps_per_rank"] for r in q],
                color=["tab:blue" if r["scheme"] == "alltoall" else "tab:orange" for r in q])
        ax.set_yticks(ys, [f"{r['scheme']}: {r['phase']}" for r in q], fontsize=7)
        for y, r in zip(ys, q):
            ax.text(r["GBps_per_rank"], y, f" {r['ms']:.3f} ms", va="center", fontsize=7)
        ax.set(xlabel="GB/s per rank (algorithm bandwidth)", title=f"{T_r} tokens per rank")
    fig.suptitle(f"{path.name}: {rec.get('gpu', '')}, W = {rec.get('world_size', '?')}, "
                 "DeepSeek-V3 shape (blue: all-to-all-v, orange: all-gather)")
    fig.tight_layout()
    workshop.show(fig, "ep_" + path.stem.replace("-", "_")[:60])
    layer_rows = rec.get("layer") or []
    if layer_rows:
        workshop.show_table(["tokens per rank", "what", "ms", "tokens/s"],
                            [(r["tokens_per_rank"], r["what"], f"{r['ms']:.3f}",
                              f"{r['tokens_per_s']:.3g}") for r in layer_rows])
    t = rec.get("target")
    if t:
        print(f"{path.name}: all-to-all-v dispatch + combine at {t['tokens_per_rank']} tokens per "
              f"rank = {t['ratio']:.2f} of two raw NCCL all-to-alls of the same rows "
              f"(target >= 0.80: {'met' if t.get('met') else 'not met'})")

# %% [markdown]
# ## Exercises
#
# 1. **Where the crossover is.** From the byte formulas, for which `W` does the all-to-all
#    move fewer bytes than the all-gather at `K = 8`? At `K = 2` (Mixtral)?
# 2. **Round-robin placement, slot rows.** Re-run the live run with
#    `"placement": "round_robin"` in `LAYER`. Which experts does each rank hold now
#    (`reference.determine_expert_map`), and does the output change? Then set
#    `"alltoall_rows": "slot"`: how do the rows sent change?
# 3. **More redundancy.** In section 4, give EPLB 8 redundant slots instead of 4. How close
#    to perfect balance does it get, and which experts get the extra replicas?
# 4. **Hierarchical EPLB.** Call `eplb.rebalance_experts(load, 24, num_groups=4,
#    num_nodes=2, num_gpus=4)`. Check that all replicas of a group's experts stay on the
#    same node (GPUs 0–1 or 2–3). Why does DeepSeek want that?
#
# Solutions: `solutions/05_expert_parallelism_solutions.ipynb`.
