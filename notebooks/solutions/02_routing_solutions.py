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
# # 2. Routing: solutions
#
# Try the exercises at the end of `02_routing.ipynb` first.

# %% tags=["parameters"]
import pathlib
import sys

# workshop.py sits one folder up (Jupyter runs this in solutions/; a script knows its file)
HERE = pathlib.Path(__file__).resolve().parent if "__file__" in globals() else pathlib.Path.cwd()
sys.path.insert(0, str(HERE.parent))
import workshop

RUN = workshop.setup("02_routing_solutions")
KERNEL = "cupy" if RUN.gpu else "numba"      # Numba runs in the simulator on a CPU

# %%
import matplotlib.pyplot as plt
import numpy as np

import reference
from sandbox import FusedMoE, get_backend
from sandbox.checkpoint import data_dir, default_trace_path
from sandbox.datagen import load_trace

# %% [markdown]
# ## 1. Ties
#
# Expert 1 wins; experts 2, 5 and 6 tie for second place, and the lowest id (2) takes
# it. The kernel must agree exactly.

# %%
row = np.array([[0.0, 5.0, 1.0, 0.5, 0.0, 1.0, 1.0, -2.0]], dtype=np.float32)
w, ids, _ = reference.fused_topk(None, row, 2, renormalize=False)
bk = get_backend(KERNEL)
kw, ki, _ = bk.stage_fn("route")(None, bk.put(row), 2, False, False)
print("reference ids", ids[0].tolist(), "| kernel ids", np.asarray(bk.get(ki))[0].tolist())

# %% [markdown]
# ## 2. Balancing the worst case
#
# On `one_expert` every token has the *same* preferences (up to a little noise), so a bias
# step moves all tokens at once: the load jumps from one set of experts to another, the
# controller oscillates, and it stalls well above balance once the noise between tokens
# is used up. Balancing needs tokens that disagree; the bias can only arbitrate between
# experts a token finds nearly equally good.
#
# Whatever the trace, a token that keeps its set of experts keeps its weights: the bias
# never enters them. Not always to the bit, though: the renormalizing sum adds the `K`
# scores in selection order, and that order can change (checked on the zipf trace).

# %%
ds = FusedMoE.from_safetensors(data_dir() / "deepseek_v3", None)
E = ds.num_experts


def route(logits, bias, topk_group=ds.topk_group):
    return reference.grouped_topk(None, logits, ds.top_k, True,
                                  num_expert_group=ds.num_expert_group,
                                  topk_group=topk_group, scoring_func="sigmoid",
                                  routed_scaling_factor=ds.routed_scaling_factor,
                                  e_score_correction_bias=bias)


def controller(logits, steps, gamma=1e-2):
    b = ds.e_score_correction_bias.copy()
    history = []
    for _ in range(steps):
        _, ids_b = route(logits, b)
        load = np.bincount(ids_b.ravel(), minlength=E)
        history.append(load.max() / load.mean())
        b -= np.float32(gamma) * np.sign(load - load.mean()).astype(np.float32)
    return b, history


fig, ax = plt.subplots(figsize=(7, 3))
for trace in ("one_expert", "zipf"):
    _, lt = load_trace(default_trace_path("deepseek_v3", trace))
    b_end, hist = controller(lt, 120)
    ax.plot(hist, label=trace)
ax.set(xlabel="bias update step", ylabel="max / mean load", title="the bias controller")
ax.legend()
workshop.show(fig, "controller")

w0, ids0 = route(lt, ds.e_score_correction_bias)        # lt: the zipf trace
w1, ids1 = route(lt, b_end)
o0, o1 = np.argsort(ids0, axis=1), np.argsort(ids1, axis=1)   # compare as sets of experts
same = (np.take_along_axis(ids0, o0, 1) == np.take_along_axis(ids1, o1, 1)).all(axis=1)
w0s, w1s = np.take_along_axis(w0, o0, 1), np.take_along_axis(w1, o1, 1)
print(f"zipf: {same.sum()} of {same.size} tokens kept their set of experts; weights "
      f"bit-identical for {int((w0s[same] == w1s[same]).all(axis=1).sum())} of them, largest "
      f"relative difference {np.max(np.abs(w0s[same] - w1s[same]) / w0s[same]):.1e} "
      f"(fp32 rounding of the sum)")

# %% [markdown]
# ## 3. Fewer groups
#
# With one group kept, a token's `K` experts all come from one group of `E / G` experts,
# so `K ≤ topk_group · E / G` is needed for the top-k to have enough candidates; the load
# then follows the group scores.

# %%
_, lz = load_trace(default_trace_path("deepseek_v3", "zipf"))
fig, ax = plt.subplots(figsize=(8, 3))
for tg in (2, 1):
    _, ids_g = route(lz, ds.e_score_correction_bias, topk_group=tg)
    load = np.bincount(ids_g.ravel(), minlength=E)
    ax.plot(range(E), load, marker="o",
            label=f"topk_group = {tg}: max/mean {load.max() / load.mean():.2f}")
ax.set(xlabel="expert", ylabel="slots", title="DeepSeek-V3 zipf trace")
ax.legend(fontsize=8)
workshop.show(fig, "topk_group")

# %% [markdown]
# ## 4. The 64-bit key
#
# `order_bits` maps a float to an unsigned integer with the same order (flip all bits of
# negatives, set the sign bit of positives); NaN becomes −inf and −0 becomes +0. The low
# word `0xFFFFFFFF − id` makes the *lower* id the *larger* key among equal values.

# %%
def order_bits(v):
    v = np.where(np.isnan(v), -np.inf, v).astype(np.float32)
    v = np.where(v == 0, np.float32(0), v)              # -0 -> +0
    u = v.view(np.uint32)
    return np.where(u & 0x80000000, ~u, u | 0x80000000).astype(np.uint32)


def make_key(v, ids):
    return (order_bits(v).astype(np.uint64) << np.uint64(32)) | (
        np.uint64(0xFFFFFFFF) - ids.astype(np.uint64))


rows = np.array([[1.0, 3.0, 2.0, 3.0, -0.0, 0.0],
                 [np.nan, 1.0, 1.0, np.nan, -1.0, 0.5],
                 [0.0, -0.0, 0.0, -0.0, 0.0, -0.0]], dtype=np.float32)
K = 3
for r in rows:
    keys = make_key(r, np.arange(r.size))
    ours = np.argsort(keys)[::-1][:K]                  # the K largest keys
    want = reference.topk_indices(r[None], K)[0]
    print(r, "keys ->", ours.tolist(), "| reference", want.tolist(),
          "| same:", np.array_equal(ours, want))
