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
# # 3. Permutation: grouping the slots by expert
#
# **What you will learn**
#
# * `moe_align_block_size` step by step: four lines of NumPy (flatten, sort, count,
#   cumulative sum) and a padding rule;
# * what becomes of a slot routed nowhere (id −1) and of another rank's experts: skipped,
#   never computed, left out of the sum;
# * what the padding costs, as a function of the block size and of how skewed the routing
#   is (and why it matters less than it seems at decode);
# * the other layout, contiguous rows (`moe_permute` / `grouped_mm` / `moe_unpermute`),
#   and what each layout moves in memory;
# * how a GPU groups slots without a sort: the CuPy and Numba alignment kernels.
#
# Contract: `docs/stages.md`, section *align*; oracle: `reference/align.py` (and
# `reference/permute.py` for the contiguous layout).

# %% tags=["parameters"]
import workshop

RUN = workshop.setup("03_permutation")
KERNELS = ["numba", "cupy"] if RUN.gpu else ["numba"]    # Numba in the simulator on a CPU
KERNEL_CASES = ([(4096, 256, 8, 64), (1, 256, 8, 16), (64, 8, 2, 16)] if RUN.gpu
                else [(6, 4, 2, 4), (5, 8, 2, 4)])       # (T, E, K, B) checked per kernel
TIMING_TOKENS = [1, 64, 1024, 4096, 16384] if RUN.gpu else []   # GPU only, E=256, K=8, B=64
WASTE_E, WASTE_K = 128, 8            # Qwen3-30B-A3B's router for the padding study

# %%
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

import reference
from sandbox import FusedMoE, get_backend

# %% [markdown]
# ## 1. `moe_align_block_size`, step by step
#
# A *slot* is one (token, choice) pair, `s = t*K + k`, and there are `P = T*K` of them.
# The fused GEMM wants each expert's slots next to each other, in runs whose length is a
# multiple of the GEMM's tile height `B`, so that one tile of `B` rows belongs to one
# expert and loads that expert's weights once. ScatterMoE's recipe is four lines:

# %%
T, K, E, B = 6, 2, 4, 4
rng = np.random.default_rng(3)
topk_ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)   # [T, K]

flat = topk_ids.ravel()                               # [P]   expert of each slot s
order = np.argsort(flat, kind="stable")               # [P]   slots grouped by expert, s increasing
counts = np.bincount(flat, minlength=E)               # [E]   slots per expert
padded = -(-counts // B) * B                          # [E]   each run rounded up to B
starts = np.concatenate([[0], np.cumsum(padded)])     # [E+1] where each expert's run begins

P = flat.size
sorted_by_hand = np.full(starts[-1], P, np.int32)     # padding value: P (an invalid slot)
for e in range(E):
    run = order[flat[order] == e]
    sorted_by_hand[starts[e]:starts[e] + run.size] = run
expert_by_hand = np.repeat(np.arange(E), padded // B)

sorted_ids, expert_ids, ntpp = reference.moe_align_block_size(topk_ids, B, E)
n = int(ntpp[0])
print("topk_ids\n", topk_ids)
print("counts", counts, " padded", padded, " num_tokens_post_padded", n)
print("by hand == reference:", np.array_equal(sorted_by_hand, sorted_ids[:n]),
      np.array_equal(expert_by_hand, expert_ids[:n // B]))
print(f"buffer size: {sorted_ids.size} = max_num_tokens_padded "
      f"(P + E*(B-1) = {P + E * (B - 1)}, capped at P*B = {P * B}: it is sized before the "
      f"counts are known)")

# %%
colors = plt.get_cmap("tab10")


def draw_row(ax, y, values, expert_of, label, width=1.0):
    for i, v in enumerate(values):
        e = expert_of(i, v)
        face = "#eeeeee" if e is None else colors(e)
        ax.add_patch(Rectangle((i * width, y), width * 0.95, 0.8, color=face))
        ax.text(i * width + width * 0.47, y + 0.4, str(v) if e is not None else "P",
                ha="center", va="center", fontsize=8, color="k" if e is None else "w")
    ax.text(-0.5, y + 0.4, label, ha="right", va="center", fontsize=9)


fig, ax = plt.subplots(figsize=(13, 3.6))
draw_row(ax, 3, list(range(P)), lambda i, v: int(flat[v]), "slots s = t*K+k\n(coloured by expert)")
draw_row(ax, 2, order.tolist(), lambda i, v: int(flat[v]), "stable sort by expert")
draw_row(ax, 1, sorted_ids[:n].tolist(), lambda i, v: None if v >= P else int(flat[v]),
         "sorted_token_ids\n(runs padded to B)")
for b in range(n // B):
    ax.add_patch(Rectangle((b * B, 0.05), B * 0.99, 0.7, fill=False, lw=1.5))
    ax.text(b * B + B / 2, 0.4, f"block {b}: expert_ids = {expert_ids[b]}", ha="center",
            va="center", fontsize=8)
ax.set_xlim(-6, max(n, P) + 0.5)
ax.set_ylim(0, 4)
ax.axis("off")
ax.set_title(f"T={T} tokens, K={K}, E={E} experts, B={B}: {P} slots become {n} positions "
             f"in {n // B} blocks")
workshop.show(fig, "align_steps")

# %% [markdown]
# Three outputs, all the GEMM needs: `sorted_token_ids` (which slot each position
# computes; the padding value `P` means "nothing"), `expert_ids` (the expert of each block
# of `B` positions, `-1` past the end) and `num_tokens_post_padded` (where the live blocks
# end: the GEMM reads it *on the device*, so no one waits for the host). An expert with no
# slots gets no block at all.
#
# ### Slots routed nowhere
#
# A slot whose id is −1 (vLLM's mark for a padding token, a masked token, a dropped
# choice; in general any id outside `[0, E)`) is **skipped**: it appears nowhere in
# `sorted_token_ids`, adds no block, and `num_tokens_post_padded` counts only the slots
# that are scheduled. Below, token 1 is padding, and tokens 3 and 4 lost their choice of
# expert 1, which is then left with no slot and no block:

# %%
ids_m = topk_ids.copy()
ids_m[1] = -1                                         # a padding token
ids_m[3, 0] = ids_m[4, 1] = -1                        # two dropped slots (expert 1's)
sorted_m, expert_m, ntpp_m = reference.moe_align_block_size(ids_m, B, E)
n_m = int(ntpp_m[0])
scheduled = np.sort(sorted_m[:n_m][sorted_m[:n_m] < P])
skipped = np.flatnonzero(ids_m.ravel() < 0)
print("topk_ids\n", ids_m)
print("skipped slots", skipped.tolist(), "| scheduled slots", scheduled.tolist())
print(f"num_tokens_post_padded {n} -> {n_m}; expert_ids {expert_m[:n_m // B].tolist()}")
print("no skipped slot is scheduled:", not np.isin(skipped, scheduled).any())

# %% [markdown]
# Downstream, nothing ever computes a skipped slot: the GEMMs write only the rows listed in
# `sorted_token_ids`, so the rows of the skipped slots in the GEMM output hold whatever
# the memory held. The combine therefore takes the ids too (vLLM's pad-aware `moe_sum`)
# and leaves those slots out: the padding token's output is exactly 0, and token 4 gets
# its remaining expert only.

# %%
H_, I_ = 8, 6
xs = rng.standard_normal((T, H_)).astype(np.float32)
w13 = (rng.standard_normal((E, 2 * I_, H_)) / np.sqrt(H_)).astype(np.float32)
w2 = (rng.standard_normal((E, H_, I_)) / np.sqrt(I_)).astype(np.float32)
tw = np.full((T, K), 1.0 / K, np.float32)
out_m = reference.fused_experts(xs, w13, w2, tw, ids_m, block_size=B)           # [T, H]


def one_expert(e, v):   # the expert's MLP on one token, float64
    h = w13[e].astype(np.float64) @ v
    return w2[e].astype(np.float64) @ (h[:I_] / (1 + np.exp(-h[:I_])) * h[I_:])


print("token 1 (padding):", out_m[1])
print("token 4 = its remaining slot only:",
      np.allclose(out_m[4], tw[4, 0] * one_expert(ids_m[4, 0], xs[4].astype(np.float64)),
                  rtol=1e-5, atol=1e-6))

# %% [markdown]
# Expert parallelism uses the same machinery. Each rank holds some experts; an
# `expert_map` (global id → local id, or −1) says which. By default
# (`ignore_invalid_experts=False`, what vLLM's `fused_experts` passes) every expert is
# aligned, and the blocks of other ranks' experts get `expert_ids = −1`: the GEMMs write
# zeros there. With `ignore_invalid_experts=True` those slots are skipped like −1 ids: no
# blocks at all. Rank 0 of 2 (experts 0 and 1), on the routing of section 1:

# %%
_, emap = reference.determine_expert_map(2, 0, E)
rows = []
for ignore in (False, True):
    s_, e_, n_ = reference.moe_align_block_size(topk_ids, B, E, expert_map=emap,
                                                ignore_invalid_experts=ignore)
    rows.append((ignore, int(n_[0]), e_[:int(n_[0]) // B].tolist(),
                 int((s_[:int(n_[0])] < P).sum())))
workshop.show_table(["ignore_invalid_experts", "num_tokens_post_padded",
                     "expert_ids (local, -1 = another rank)", "slots scheduled"], rows)

# %% [markdown]
# ## 2. What the padding costs
#
# Each expert's run is rounded up to a multiple of `B`, so `Σ_e ceil(c_e/B)·B − P`
# positions are computed and thrown away. How many depends on the tokens per expert
# (`T·K/E`), on `B`, and on how skewed the routing is. Below, `T` tokens pick `K = 8` of
# `E = 128` experts from a Zipf popularity with exponent `s` (0 is uniform):

# %%
def zipf_routing(T, E, K, s, rng):
    """[T, K] distinct experts per token, expert e drawn with probability ~ 1/(rank e)^s
    (the Gumbel top-k trick samples K without replacement)."""
    logp = -s * np.log(np.arange(1, E + 1))[rng.permutation(E)]
    g = rng.gumbel(size=(T, E))
    return np.argsort(-(logp + g), axis=1)[:, :K].astype(np.int32)


def waste(topk_ids, E, B):
    counts = np.bincount(topk_ids.ravel(), minlength=E)
    padded = (-(-counts // B) * B).sum()
    return (padded - topk_ids.size) / padded if padded else 0.0


rng = np.random.default_rng(0)
skews = [0.0, 0.8, 1.2, 2.0]
blocks = [16, 32, 64, 128]
tokens = [1, 4, 16, 64, 256, 1024, 4096]
fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 3.6))
for s in skews:
    ids = zipf_routing(256, WASTE_E, WASTE_K, s, rng)
    a0.plot(range(len(blocks)), [100 * waste(ids, WASTE_E, b) for b in blocks], marker="o",
            label=f"s = {s}")
a0.set(xticks=range(len(blocks)), xticklabels=blocks, xlabel="block size B",
       ylabel="% of computed rows that are padding", ylim=(0, 100),
       title=f"T = 256 tokens, top-{WASTE_K} of {WASTE_E}")
a0.legend(title="Zipf exponent", fontsize=8)
for b in (16, 64):
    for s in (0.0, 1.2):
        ys = [100 * np.mean([waste(zipf_routing(T_, WASTE_E, WASTE_K, s, rng), WASTE_E, b)
                             for _ in range(3)]) for T_ in tokens]
        a1.plot(tokens, ys, marker="o", ls="-" if b == 16 else "--", label=f"B = {b}, s = {s}")
a1.set(xscale="log", xlabel="tokens T", ylabel="% padding", ylim=(0, 100),
       title="padding against batch size")
a1.legend(fontsize=8)
workshop.show(fig, "padding_waste")

# %% [markdown]
# Three lessons:
#
# * **Decode is mostly padding.** With one token, 8 experts get one slot each and every
#   one of them is padded to `B` rows: 94 % waste at `B = 16`, 98 % at `B = 64`. That is
#   why the GEMM configs pick a small `BLOCK_M` when there are few tokens per expert
#   (`get_config`).
# * **What counts is tokens per expert, `T·K/E`, against `B`.** The waste falls under
#   ~10 % only once an average expert holds several blocks' worth of slots (`T = 1024`
#   gives 64 slots per expert here). Skew moves the curves surprisingly little: hot experts
#   fill their blocks, but the thin tail of barely used experts pads all the more.
# * **Padding costs FLOPs, not bytes.** A padded row is computed from weights the tile
#   loaded anyway. At decode the grouped GEMM is bound by reading the weights, so the
#   wasted FLOPs are nearly free; at prefill, where FLOPs are the limit, there are many
#   tokens per expert and the waste is a few percent.
#
# ## 3. The contiguous layout
#
# `torch._grouped_mm`-style GEMMs want the rows themselves moved: `x_grouped [P, H]` holds
# the token rows grouped by expert with no padding, `expert_offsets [E+1]` says where each
# expert's rows are, and `inv_permuted_idx [P]` where each slot went, so that the combine
# can find its rows again. The whole MoE in that layout:

# %%
layer = FusedMoE.random(num_experts=8, top_k=2, hidden_size=32, intermediate_size=48, seed=1)
x, logits = layer.random_inputs(10, seed=2)
w, ids, _ = reference.select_experts(x, logits, layer.top_k, False, True)

x_grouped, offsets, inv = reference.moe_permute(x, ids, layer.num_experts)      # [P, H]
h = reference.grouped_mm(x_grouped, layer.w13_weight, offsets)                  # [P, 2I]
a = reference.silu_and_mul(h)                                                   # [P, I]
y = reference.grouped_mm(a, layer.w2_weight, offsets)                           # [P, H]
out_contig = reference.moe_unpermute(y, w, inv)                                 # [T, H]

out_fused = reference.fused_experts(x, layer.w13_weight, layer.w2_weight, w, ids)
print("expert_offsets", offsets.tolist())
print("contiguous vs fused (aligned) layout: rel. error "
      f"{workshop.rel_err(out_contig, out_fused):.1e}")

# %%
fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 2.6))
flat_ids = ids.ravel()
for i in range(x_grouped.shape[0]):
    e = int(flat_ids[np.flatnonzero(inv == i)[0]])
    a0.add_patch(Rectangle((i, 0), 0.95, 1, color=colors(e)))
for e, o in enumerate(offsets[:-1]):
    if offsets[e + 1] > o:
        a0.text((o + offsets[e + 1]) / 2, 1.15, f"e{e}", ha="center", fontsize=8)
a0.set(xlim=(0, x_grouped.shape[0]), ylim=(0, 1.4), title=f"contiguous: {x_grouped.shape[0]} "
       "rows, boundaries at expert_offsets")
a0.axis("off")
Bb = 4
s_ids, e_ids, nt = reference.moe_align_block_size(ids, Bb, layer.num_experts)
for p_, s_ in enumerate(s_ids[:int(nt[0])]):
    live = s_ < ids.size
    a1.add_patch(Rectangle((p_, 0), 0.95, 1, color=colors(int(e_ids[p_ // Bb])) if live
                           else "#eeeeee"))
a1.set(xlim=(0, int(nt[0])), ylim=(0, 1.4),
       title=f"aligned, B={Bb}: {int(nt[0])} positions (grey: padding), rows stay in x")
a1.axis("off")
workshop.show(fig, "layouts")

# %% [markdown]
# | | aligned (`moe_align_block_size` + fused GEMM) | contiguous (`moe_permute` + `grouped_mm`) |
# |---|---|---|
# | extra memory traffic | none: GEMM1 gathers each row of `x` through `sorted_token_ids` as it loads it | a gather copy of `P·H` (permute) and an indexed read back (unpermute) |
# | wasted work | padding rows (section 2) | none |
# | GEMM | a custom kernel that reads `expert_ids` per tile | any grouped GEMM that takes offsets (cuBLAS, CUTLASS, `torch._grouped_mm`) |
# | used by | vLLM's Triton / CUDA fused MoE | MegaBlocks, `torch._grouped_mm`, and our all-to-all EP dispatch |
#
# ## 4. The kernels: grouping without a sort
#
# A GPU does not sort the slots. It **counts** them per expert, **scans** the padded
# counts into run starts, and **scatters** each slot to `start[e] + its rank among the
# slots of e`. The rank is the interesting part. The CuPy kernel keeps the reference's
# order (stable in `s`) with warp intrinsics: the 32 lanes of a warp look at 32
# consecutive slots; `__match_any_sync` tells each lane which other lanes hold the same
# expert, and its rank is the number of those below it:

# %%
workshop.show_source("cuda_kernels/cupy/grouping.cuh", "template <bool PERMUTE, typename Emit>",
                     stop="// In-place exclusive scan", max_lines=34)

# %% [markdown]
# The Numba kernel does the same in two flavours. On a GPU, `cuda.match_any_sync` gives
# the same-expert lanes of a warp as above. The simulator has no warp intrinsics, so there
# each thread of a round of `NT` slots counts the earlier slots of its expert in a shared
# array: `O(NT)` work per slot, but plain loads and barriers, and the same stable order.
# (The contract would allow any order inside an expert's run — atomics give one — and the
# tests compare runs as sets; both kernels here happen to keep the reference's order.)

# %%
workshop.show_source("cuda_kernels/numba/align.py", "def scatter(ids", max_lines=34)

# %% [markdown]
# Both kernels against the reference. `expert_ids` and `num_tokens_post_padded` must match
# exactly; `sorted_token_ids` must hold the same slots in each expert's run.

# %%
def same_runs(got, want, E, B, P):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) agree up to the order of
    slots inside each expert's run."""
    gs, ge, gn = (np.asarray(v) for v in got)
    ws, we, wn = want
    n_ = int(wn[0])
    if int(gn[0]) != n_ or not np.array_equal(ge[:n_ // B], we[:n_ // B]):
        return False
    if np.any(gs[n_:] != P) or np.any(ge[n_ // B:] != -1):
        return False
    for e in range(E):
        mask = np.repeat(we[:n_ // B] == e, B)
        if sorted(gs[:n_][mask].tolist()) != sorted(ws[:n_][mask].tolist()):
            return False
    return True


rows = []
for name in KERNELS:
    bk = get_backend(name)
    if not bk.ok:
        rows.append((name, "-", "-", bk.reason[:80]))
        continue
    fn = bk.stage_fn("align")
    for (T_, E_, K_, B_), masked in ((c, m) for c in KERNEL_CASES for m in (False, True)):
        ids_ = zipf_routing(T_, E_, K_, 1.2, np.random.default_rng(T_ + E_))
        if masked:                                    # every fifth slot routed nowhere
            ids_.reshape(-1)[::5] = -1
        want = reference.moe_align_block_size(ids_, B_, E_)
        got = tuple(bk.get(v) for v in fn(bk.put(ids_), B_, E_))
        stable = np.array_equal(np.asarray(got[0]), want[0])
        rows.append((name, f"T={T_} E={E_} K={K_} B={B_}" + (", -1 slots" if masked else ""),
                     "match" if same_runs(got, want, E_, B_, ids_.size) else "DIFFERENT",
                     "yes" if stable else "no (allowed)"))

workshop.show_table(["kernel", "case", "runs", "same order as the reference"], rows)

# %%
if TIMING_TOKENS:
    times = {name: [] for name in KERNELS}
    for T_ in TIMING_TOKENS:
        ids_ = zipf_routing(T_, 256, 8, 1.2, np.random.default_rng(T_))
        for name in KERNELS:
            bk = get_backend(name)
            dev = bk.put(ids_)
            fn = bk.stage_fn("align")
            times[name].append(workshop.time_gpu_ms(partial(fn, dev, 64, 256)))
    workshop.plot_eager_times(times, TIMING_TOKENS, "moe_align_block_size, top-8 of 256 "
                              "experts, B = 64", "align_times")
else:
    print("CPU mode: no timings here (the simulator's speed says nothing about a GPU's).")

# %% [markdown]
# The committed H200 timings of the stage (L2 flushed, routing re-drawn, device time):

# %%
workshop.plot_stage_times("align", "align_h200", "committed GPU timings of moe_align_block_size")

# %% [markdown]
# ## Exercises
#
# 1. **Expert parallelism in the alignment.** Call `moe_align_block_size` with the
#    `expert_map` of rank 1 of 2 (`reference.determine_expert_map(2, 1, E)`), first with
#    `ignore_invalid_experts=False`, then `True`. What happens to the blocks of experts
#    that live on rank 0 in each case, and what will the GEMM write for them?
# 2. **The worst buffer.** `max_num_tokens_padded` is sized before the counts are known.
#    For `T = 1, K = 8, E = 256, B = 64`, how many positions does it allocate, and how many
#    are live? Which rule caps it?
# 3. **Choose B.** For the Zipf(1.2) routing of section 2 with `T = 64`, find the `B` in
#    {16, 32, 64, 128} that minimises the padded rows, then think about why a GEMM would
#    still prefer a larger `B` at `T = 4096`.
# 4. **Write the unpermute.** Re-implement `moe_unpermute` with a loop over tokens and
#    slots, and check it against the reference on the example of section 3.
#
# Solutions: `solutions/03_permutation_solutions.ipynb`.
