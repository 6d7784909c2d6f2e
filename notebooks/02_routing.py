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
# # 2. Routing
#
# **What you will learn**
#
# * softmax top-k routing (Mixtral, Qwen3-MoE) step by step, with its tie rule, and its
#   sigmoid variant;
# * what vLLM's kernels make of non-finite logits, and of a slot routed nowhere (id −1);
# * what routing does to the load of each expert, on a skewed trace;
# * DeepSeek-V3's grouped top-k: sigmoid scores, expert groups, and the correction bias
#   that steers the choice without touching the weights — and how that bias balances load;
# * how the CuPy and Numba kernels map one token's routing onto the threads of a GPU.
#
# The contract is `docs/stages.md`, section *route*; the oracle is `reference/routing.py`.

# %% tags=["parameters"]
import workshop

RUN = workshop.setup("02_routing")
FAMILY = "qwen3_moe"                 # softmax top-k routing (E=16, K=4)
GROUPED_FAMILY = "deepseek_v3"       # sigmoid grouped top-k + correction bias (E=16, K=4)
KERNELS = ["numba", "cupy"] if RUN.gpu else ["numba"]   # Numba runs in the simulator on a CPU
KERNEL_TOKENS = 256 if RUN.gpu else 8                   # tokens per kernel check
TIMING_TOKENS = [1, 64, 1024, 4096, 16384] if RUN.gpu else []   # GPU only: DeepSeek-V3 sizes
BIAS_STEPS = 80                      # steps of the bias update in section 3

# %%
from functools import partial

import matplotlib.pyplot as plt
import numpy as np

import reference
from sandbox import FusedMoE, get_backend
from sandbox.checkpoint import data_dir, default_trace_path
from sandbox.datagen import load_trace

layer = FusedMoE.from_safetensors(data_dir() / FAMILY, None)
x, logits = load_trace(default_trace_path(FAMILY, "zipf"))
E, K = layer.num_experts, layer.top_k
print(layer)

# %% [markdown]
# ## 1. Softmax top-k, one token
#
# `fused_topk` does four things to a row of logits, all in fp32:
#
# 1. `scores = softmax(logits)`: `exp(x − max) / Σ exp(x − max)`, over all `E` experts
#    (or `sigmoid(logits)` with `scoring_func="sigmoid"`, below);
# 2. `topk_ids` = the `K` largest scores, in descending order, **ties to the lowest id**;
# 3. `topk_weights` = those scores;
# 4. with `renormalize`, divide the `K` weights by their sum (so they sum to one).

# %%
t = 3
scores = reference.softmax(logits[t:t + 1])[0]                     # [E]
w, ids, _ = reference.fused_topk(x[t:t + 1], logits[t:t + 1], K, renormalize=True)

fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 3), gridspec_kw={"width_ratios": [3, 1]})
colors = ["tab:orange" if e in ids[0] else "tab:gray" for e in range(E)]
a0.bar(range(E), scores, color=colors)
for rank, e in enumerate(ids[0]):
    a0.annotate(f"k={rank}", (e, scores[e]), ha="center", va="bottom", fontsize=8)
a0.set(xlabel="expert", ylabel="softmax score", title=f"token {t}: scores, the top-{K} in orange",
       xticks=range(E))
a1.bar([f"e{e}" for e in ids[0]], w[0], color="tab:orange")
a1.set(title="weights after renormalize", ylim=(0, 1))
workshop.show(fig, "one_token")
print("ids", ids[0], "weights", np.round(w[0], 4), "sum", w[0].sum())

# %% [markdown]
# The tie rule matters because every backend must agree *bit for bit* on the ids: a kernel
# that breaks ties differently sends a token to another expert, and its output is then
# simply different.
#
# Non-finite values follow vLLM's routing kernels: **a score that is not finite becomes
# 0**. A NaN (or +inf) logit makes the whole softmax row NaN, and a row of −inf logits
# makes 0/0, so such a row becomes all zeros: the token gets experts `0 … K−1` (the tie
# rule) with weight 0, and its output is 0. No NaN reaches the layer's output.

# %%
toy = np.array([[1.0, 3.0, 2.0, 3.0, 0.5],        # experts 1 and 3 tie at the top
                [0.0, 0.0, 0.0, 0.0, 0.0],        # everything ties
                [1.0, np.nan, 2.0, 0.0, 5.0],     # a NaN logit
                [-np.inf] * 5],                   # nothing finite
               dtype=np.float32)
tw, ti, _ = reference.fused_topk(None, toy, 3, renormalize=True)
sw, si, _ = reference.fused_topk(None, toy, 3, renormalize=False, scoring_func="sigmoid")
workshop.show_table(["logits", "softmax: ids", "weights", "sigmoid: ids", "weights"],
                    [(np.array2string(toy[r]), ti[r].tolist(), np.array2string(tw[r], precision=3),
                      si[r].tolist(), np.array2string(sw[r], precision=3))
                     for r in range(len(toy))])

# %% [markdown]
# ### Sigmoid scoring
#
# With `scoring_func="sigmoid"` (vLLM's `topk_sigmoid` kernel) each expert is scored on its
# own, `sigmoid(logit)`, instead of against the others: the scores no longer sum to one,
# the ranking is the same as the logits' (sigmoid is monotonic), and a NaN logit spoils
# only its own expert (score 0) instead of the whole row. The same token as above:

# %%
sig = reference.sigmoid(logits[t:t + 1])[0]                        # [E]
ws, idss, _ = reference.fused_topk(x[t:t + 1], logits[t:t + 1], K, renormalize=False,
                                   scoring_func="sigmoid")
fig, ax = plt.subplots(figsize=(11, 3))
ax.bar(np.arange(E) - 0.2, scores, 0.4, label="softmax (sums to 1)", color="tab:blue")
ax.bar(np.arange(E) + 0.2, sig, 0.4, label="sigmoid (each on its own)", color="tab:green")
ax.scatter(idss[0], sig[idss[0]] + 0.03, marker="v", color="tab:red", zorder=3,
           label=f"sigmoid top-{K}")
ax.set(xlabel="expert", ylabel="score", xticks=range(E), title=f"token {t}: two scorings")
ax.legend(fontsize=8)
workshop.show(fig, "sigmoid")
print("softmax ids", ids[0], "| sigmoid ids", idss[0], "weights", np.round(ws[0], 3),
      "(not renormalized: sum", round(float(ws[0].sum()), 3), ")")

# %% [markdown]
# ### sqrt-softplus scoring (DeepSeek-V4)
#
# DeepSeek-V4's router scores each expert on its own too, with `sqrt(softplus(logit))`
# (softplus(x) = log(1 + exp(x)), x itself above 20): monotonic like sigmoid, but unbounded
# above and flatter for large logits. vLLM runs it only through `fused_topk_bias`, with the
# model's correction bias steering the choice (`fused_topk` and `grouped_topk` refuse it):

# %%
grid = np.array([[-4.0, -1.0, 0.0, 1.0, 4.0, 25.0]], np.float32)
workshop.show_table(["logit", "softmax", "sigmoid", "sqrt-softplus"],
                    [(float(v), round(float(a), 3), round(float(b), 3), round(float(c), 3))
                     for v, a, b, c in zip(grid[0], reference.softmax(grid)[0],
                                           reference.sigmoid(grid)[0],
                                           reference.routing.sqrt_softplus(grid)[0])])
v4_bias = np.zeros(E, np.float32)
v4_bias[0] = 3.0                                   # pulls expert 0 into the choice
for bias in (np.zeros(E, np.float32), v4_bias):
    wv, idv = reference.fused_topk_bias(x[t:t + 1], logits[t:t + 1], "sqrtsoftplus", bias, K,
                                        True, routed_scaling_factor=1.5)
    print(f"bias[0] = {bias[0]}: ids", idv[0], "weights (unbiased scores, renormalized,"
          " * 1.5)", np.round(wv[0], 3))

# %% [markdown]
# ### Slots routed nowhere: id −1
#
# vLLM marks a slot that must go to no expert with id **−1**: the padding tokens of a batch
# (`VLLM_MOE_SKIP_PADDING`), a masked token, an expert of another rank. Every stage after
# the router treats it as contributing nothing: alignment skips it (notebook 3), the GEMMs
# never write its rows, the combine leaves it out. A custom routing function can return
# such ids; here the last two tokens are padding:

# %%
def padding_router(hidden_states, gating_output, topk, renormalize):
    w_, ids_, _ = reference.fused_topk(hidden_states, gating_output, topk, renormalize)
    ids_ = ids_.copy()
    ids_[-2:] = -1                                   # the padding tokens: routed nowhere
    return w_, ids_


layer.custom_routing_function = padding_router
out_pad = layer(x[:6], logits[:6])                   # [6, H]
layer.custom_routing_function = None
out_all = layer(x[:6], logits[:6])
workshop.show_table(["token", "topk_ids", "|out| (padded tokens)", "|out| (all routed)"],
                    [(i, padding_router(None, logits[:6], K, True)[1][i].tolist(),
                      f"{np.linalg.norm(out_pad[i].astype(np.float64)):.3f}",
                      f"{np.linalg.norm(out_all[i].astype(np.float64)):.3f}") for i in range(6)])

# %% [markdown]
# The routed tokens are untouched (their outputs are the same as without padding), the
# padded ones are exactly 0.

# %% [markdown]
# ## 2. What routing does to the load
#
# The traces in `data/traces/` fix a routing pattern. `balanced` gives every expert the
# same number of slots; `zipf` draws each token's experts from a Zipf(1.2) popularity, so
# a few experts are hot and the tail is thin; `one_expert` sends every token to the same
# `K` experts. Here is the `zipf` trace, token by token (each row has `K` coloured cells):

# %%
w_all, ids_all, _ = reference.fused_topk(x, logits, K, renormalize=True)
dense = np.zeros((x.shape[0], E))                                  # [T, E]
np.put_along_axis(dense, ids_all.astype(np.int64), w_all, axis=1)
fig, ax = plt.subplots(figsize=(10, 3.2))
im = ax.imshow(dense.T, aspect="auto", cmap="magma_r", interpolation="nearest")
ax.set(xlabel="token", ylabel="expert", title=f"{FAMILY}, zipf trace: router weight of each "
       f"(token, expert), {x.shape[0]} tokens, top-{K} of {E}")
ax.grid(False)
fig.colorbar(im, ax=ax, pad=0.01, label="weight")
workshop.show(fig, "routing_heatmap")

# %%
fig, axes = plt.subplots(1, 3, figsize=(13, 3), sharey=False)
for ax, dist in zip(axes, ("balanced", "zipf", "one_expert")):
    xd, ld = load_trace(default_trace_path(FAMILY, dist))
    _, idd, _ = reference.fused_topk(xd, ld, K, renormalize=True)
    load = np.bincount(idd.ravel(), minlength=E)
    ax.bar(range(E), load, color="tab:blue")
    ax.axhline(load.mean(), color="k", ls="--", lw=1)
    ax.set(title=f"{dist}: max/mean = {load.max() / load.mean():.2f}", xlabel="expert",
           ylabel="slots routed", xticks=range(0, E, 2))
fig.suptitle("expert load (dashed: the mean) for three traces", y=1.04)
workshop.show(fig, "load_histograms")

# %% [markdown]
# The load is what the GEMMs see: an expert's weights are read once whatever its token
# count, but a hot expert does more work and, under expert parallelism, makes its GPU the
# straggler (notebook 5). On the `one_expert` trace `E − K` experts get nothing at all,
# which a kernel must handle without launching empty work.
#
# ## 3. Grouped top-k and the correction bias (DeepSeek-V3)
#
# DeepSeek-V3 scores experts with a **sigmoid** (each score independent of the others)
# and limits each token to a few **groups** of consecutive experts, so that in expert
# parallelism a token's experts sit on few nodes:
#
# 1. `scores = sigmoid(logits)`; `choice = scores + bias` (the correction bias);
# 2. group score = the sum of the group's two best `choice` values;
# 3. keep the `topk_group` best groups; experts elsewhere become −inf;
# 4. `topk_ids` = the `K` best `choice` values among the kept experts;
# 5. `topk_weights` = the **unbiased** scores of those experts, renormalized, times
#    `routed_scaling_factor`.
#
# The bias decides *who* is chosen, never *how much* they weigh.

# %%
ds = FusedMoE.from_safetensors(data_dir() / GROUPED_FAMILY, None)
xd, ld = load_trace(default_trace_path(GROUPED_FAMILY, "zipf"))
G, TG, Ed, Kd = ds.num_expert_group, ds.topk_group, ds.num_experts, ds.top_k
bias = ds.e_score_correction_bias
print(ds, f"\ngroups {G} of {Ed // G} experts, keep {TG}; routed_scaling_factor "
      f"{ds.routed_scaling_factor}")


def grouped(logits_, bias_):
    return reference.grouped_topk(None, logits_, Kd, True, num_expert_group=G, topk_group=TG,
                                  scoring_func="sigmoid",
                                  routed_scaling_factor=ds.routed_scaling_factor,
                                  e_score_correction_bias=bias_)


t = 5
sc = reference.sigmoid(ld[t:t + 1])[0]
choice = sc + bias
per = Ed // G
gscore = np.sort(choice.reshape(G, per), axis=1)[:, -2:].sum(axis=1)      # top-2 sum per group
kept = np.argsort(-gscore, kind="stable")[:TG]
gw, gi = grouped(ld[t:t + 1], bias)

fig, ax = plt.subplots(figsize=(11, 3.2))
for g in range(G):
    shade = "#e8f4e8" if g in kept else "#f4f4f4"
    ax.axvspan(g * per - 0.5, (g + 1) * per - 0.5, color=shade, zorder=0)
    label = f"group {g}: {gscore[g]:.2f}" + (" kept" if g in kept else "")
    ax.text((g + 0.5) * per - 0.5, 1.02, label, ha="center", fontsize=8,
            transform=ax.get_xaxis_transform())
ax.bar(np.arange(Ed) - 0.2, sc, 0.4, label="score = sigmoid(logit)", color="tab:blue")
ax.bar(np.arange(Ed) + 0.2, choice, 0.4, label="choice = score + bias", color="tab:cyan")
ax.scatter(gi[0], choice[gi[0]] + 0.05, marker="v", color="tab:red", zorder=3, label="chosen")
ax.set(xlabel="expert", xticks=range(Ed), ylabel="value")
ax.legend(fontsize=8, loc="lower right")
ax.set_title(f"token {t}: group scores (top-2 sum of choice), the {TG} kept groups shaded", pad=18)
workshop.show(fig, "grouped_topk")
print("ids", gi[0], "weights", np.round(gw[0], 3),
      f"(sum = {gw[0].sum():.2f} = routed_scaling_factor)")

# %% [markdown]
# Grouped top-k has its own rule for non-finite inputs (vLLM's fused grouped kernel): an
# expert whose logit (sigmoid) or softmax score is not finite is *invalid*: it ranks below
# every valid one and weighs 0. A token with no valid expert among its `K` gets `1/K` each
# when renormalizing (else 0). One group is the plain top-k with these rules:

# %%
bad = np.array([[-np.inf] * 4, [0.5, np.nan, 2.0, -1.0]], dtype=np.float32)
for scoring in ("softmax", "sigmoid"):
    gw_, gi_ = reference.grouped_topk(None, bad, 2, True, num_expert_group=1, topk_group=1,
                                      scoring_func=scoring)
    print(f"{scoring:8s} ids {gi_.tolist()}  weights {gw_.astype(np.float64).round(3).tolist()}")

# %% [markdown]
# ### The bias balances the load
#
# DeepSeek-V3 trains without an auxiliary balancing loss. Instead, after each step, every
# expert's bias moves a little against its load: `bias[e] -= γ · sign(load[e] − mean)`.
# Overloaded experts become slightly less attractive to the *selection*; the weights the
# chosen experts get are untouched. We can run that controller on the skewed trace:

# %%
gamma = 1e-2
b = bias.copy()
imbalance = []
load0 = None
for step in range(BIAS_STEPS):
    _, ids_b = grouped(ld, b)
    load = np.bincount(ids_b.ravel(), minlength=Ed).astype(np.float64)
    load0 = load if load0 is None else load0
    imbalance.append(load.max() / load.mean())
    b -= np.float32(gamma) * np.sign(load - load.mean()).astype(np.float32)

fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 3.2), gridspec_kw={"width_ratios": [1, 2]})
a0.plot(imbalance, marker=".")
a0.set(xlabel="bias update step", ylabel="max / mean load", title="imbalance")
a1.bar(np.arange(Ed) - 0.2, load0, 0.4, label="bias from the checkpoint")
a1.bar(np.arange(Ed) + 0.2, load, 0.4, label=f"after {BIAS_STEPS} updates")
a1.axhline(load.mean(), color="k", ls="--", lw=1)
a1.set(xlabel="expert", ylabel="slots routed", xticks=range(Ed),
       title=f"{GROUPED_FAMILY} zipf trace: expert load")
a1.legend(fontsize=8)
workshop.show(fig, "bias_balancing")

# %% [markdown]
# ## 4. The kernels
#
# Routing is tiny work per token (`E` exponentials, `K` rounds of an argmax) and a lot of
# tokens, so both kernels give **one token row to a group of threads** and keep the row in
# fast memory:
#
# | | CuPy (`routing.cu`) | Numba (`routing.py`) |
# |---|---|---|
# | threads per row | one warp | one warp (`"warp"`), or a block (`"block"`: the simulator has no shuffles) |
# | the row lives in | registers: lane `l` holds experts `l, l+32, …` | shared memory |
# | argmax | one 64-bit key per (value, id): a plain unsigned max | (value, id) pairs compared with the tie rule |
# | reductions | `__shfl_xor_sync` butterflies | `cuda.shfl_xor_sync`, or a shared-memory tree |
#
# The CuPy kernel's trick: pack the value and the id into one 64-bit integer whose
# unsigned order *is* the selection order (larger value first, then lower id), so a
# 5-step warp max finds the winner and its id at once:

# %%
workshop.show_source("cuda_kernels/cupy/routing.cu", "// float -> unsigned with the same order",
                     stop="warp_max_nan", max_lines=30)

# %% [markdown]
# Numba writes the same selection as `K` rounds of a row-wide argmax; the row-wide part is
# a function chosen when the kernel is built (warp shuffles, or a shared-memory tree), so
# one kernel body serves both flavours:

# %%
workshop.show_source("cuda_kernels/numba/routing_kernels.py", "# 5. top-k: K rounds", end="* scale",
                     max_lines=30)

# %% [markdown]
# Both kernels against the reference, on real traces: ids must match exactly, weights to
# fp32 rounding. On a CPU, Numba runs in the CUDA simulator (one Python thread per CUDA
# thread), so a few tokens only.

# %%
rows = []
for name in KERNELS:
    b_ = get_backend(name)
    if not b_.ok:
        rows.append((name, "-", "-", "-", b_.reason[:80]))
        continue
    for fam, lay, xs, ls in ((FAMILY, layer, x, logits), (GROUPED_FAMILY, ds, xd, ld)):
        xs, ls = xs[:KERNEL_TOKENS], ls[:KERNEL_TOKENS]
        args = (xs, ls, lay.top_k, lay.use_grouped_topk, lay.renormalize)
        kw = dict(topk_group=lay.topk_group, num_expert_group=lay.num_expert_group,
                  scoring_func=lay.scoring_func, routed_scaling_factor=lay.routed_scaling_factor,
                  e_score_correction_bias=lay.e_score_correction_bias)
        want_w, want_i, _ = reference.select_experts(*args, **kw)
        dev = [b_.put(a) if isinstance(a, np.ndarray) else a for a in args]
        kw_dev = {k: (b_.put(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
        got_w, got_i, _ = b_.stage_fn("route")(*dev, **kw_dev)
        got_w, got_i = b_.get(got_w), b_.get(got_i)
        rows.append((name, fam, len(xs), "exact" if np.array_equal(got_i, want_i)
                     else f"{int((got_i != want_i).any(axis=1).sum())} tokens differ",
                     f"{workshop.rel_err(got_w, want_w):.1e}"))
workshop.show_table(["kernel", "routing", "tokens", "ids", "weights rel. error"], rows)

# %% [markdown]
# On a GPU we can also ask what the kernels cost, at DeepSeek-V3's real size (`E = 256`,
# top-8 of 8 groups, keep 4). Routing reads `T·E` logits and writes `T·K` pairs: at
# 4096 tokens that is 2 MB, a microsecond of HBM bandwidth, so what we see is mostly launch
# and Python overhead — which is why serving engines capture decode steps in CUDA graphs.

# %%
if TIMING_TOKENS:
    import cupy

    rng = np.random.default_rng(0)
    bias256 = (0.01 * rng.standard_normal(256)).astype(np.float32)
    times = {name: [] for name in KERNELS}
    for T in TIMING_TOKENS:
        lg = cupy.asarray(rng.standard_normal((T, 256), dtype=np.float32))
        bd = cupy.asarray(bias256)
        for name in KERNELS:
            fn = get_backend(name).stage_fn("route")
            times[name].append(workshop.time_gpu_ms(partial(
                fn, None, lg, 8, True, True, topk_group=4, num_expert_group=8,
                scoring_func="sigmoid", routed_scaling_factor=2.5, e_score_correction_bias=bd)))
    workshop.plot_eager_times(times, TIMING_TOKENS, "grouped top-8 of 256 experts "
                              "(DeepSeek-V3), one call", "kernel_times")
    workshop.show_table(["T"] + KERNELS, [(T, *(f"{times[n][i] * 1e3:.1f} µs" for n in KERNELS))
                                          for i, T in enumerate(TIMING_TOKENS)])
else:
    print("CPU mode: no timings here (the simulator's speed says nothing about a GPU's).")

# %% [markdown]
# The benchmarks measure the same stage more carefully on an H200 (the L2 flushed and the
# routing re-drawn before every repetition; *device* time: the GPU's work only, without the
# Python and launch overhead). Whatever is committed in `benchmarks/results/`:

# %%
workshop.plot_stage_times("route", "route_h200", "committed GPU timings of the route stage")

# %% [markdown]
# ## Exercises
#
# 1. **Ties.** Build a `[1, 8]` row of logits where experts 2, 5 and 6 tie for the last of
#    `K = 2` places, predict `topk_ids`, and check both the reference and the Numba kernel.
# 2. **Balancing the worst case.** Run the bias controller on the `one_expert` trace of
#    DeepSeek-V3 and plot the imbalance over the steps. Does it converge? Explain what you
#    see. Then check, on the zipf trace, that a token whose set of experts did not change
#    kept its router weights. Bit for bit?
# 3. **Fewer groups.** Set `topk_group = 1`: how does the load histogram of the zipf trace
#    change, and why must `K ≤ topk_group · E / num_expert_group`?
# 4. **The 64-bit key.** Write `order_bits` and `make_key` from `routing.cu` in NumPy
#    (`uint32` / `uint64`), and check that the `K` largest keys of a row, decoded, give the
#    reference's `topk_ids` — including rows with ties, `-0.0` and NaN.
#
# Solutions: `solutions/02_routing_solutions.ipynb`.
