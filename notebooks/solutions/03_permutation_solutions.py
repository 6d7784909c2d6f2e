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
# # 3. Permutation: solutions
#
# Try the exercises at the end of `03_permutation.ipynb` first.

# %% tags=["parameters"]
import pathlib
import sys

# workshop.py sits one folder up (Jupyter runs this in solutions/; a script knows its file)
HERE = pathlib.Path(__file__).resolve().parent if "__file__" in globals() else pathlib.Path.cwd()
sys.path.insert(0, str(HERE.parent))
import workshop

RUN = workshop.setup("03_permutation_solutions")

# %%
import numpy as np

import reference
from sandbox import FusedMoE


def zipf_routing(T, E, K, s, rng):
    """As in the notebook: K distinct experts per token, popularity ~ 1/rank^s."""
    logp = -s * np.log(np.arange(1, E + 1))[rng.permutation(E)]
    return np.argsort(-(logp + rng.gumbel(size=(T, E))), axis=1)[:, :K].astype(np.int32)


# %% [markdown]
# ## 1. Expert parallelism in the alignment
#
# With `ignore_invalid_experts=False` every expert is aligned, and the blocks of experts
# on rank 0 carry `expert_ids = -1`: the GEMM writes zeros for those rows, so this rank's
# partial output has nothing from them (rank 0 adds their share). With `True` their slots
# are dropped: no blocks, no work, and those rows of the GEMM output are never written.

# %%
T, K, E, B = 6, 2, 4, 4
ids = zipf_routing(T, E, K, 0.0, np.random.default_rng(3))
_, emap = reference.determine_expert_map(2, 1, E)
print("expert_map of rank 1:", emap.tolist())
for ignore in (False, True):
    s, e, n = reference.moe_align_block_size(ids, B, E, expert_map=emap,
                                             ignore_invalid_experts=ignore)
    print(f"ignore_invalid_experts={ignore}: expert_ids {e[:int(n[0]) // B].tolist()}, "
          f"num_tokens_post_padded {int(n[0])}")

# %% [markdown]
# ## 2. The worst buffer
#
# `P = 8 < E = 256`, so the cap `P·B = 512` applies (instead of `P + E(B−1) = 16,136`):
# at most `P` experts can be touched, each padded to `B`. Here all 512 positions are
# "live" — and 504 of them are padding.

# %%
ids = zipf_routing(1, 256, 8, 1.2, np.random.default_rng(0))
s, e, n = reference.moe_align_block_size(ids, 64, 256)
print(f"allocated {s.size} = max_num_tokens_padded {reference.max_num_tokens_padded(8, 64, 256)}, "
      f"live {int(n[0])}, real slots {ids.size}")

# %% [markdown]
# ## 3. Choose B
#
# At `T = 64` (2 slots per expert on average) the smallest block wastes least. At
# `T = 4096` the waste is small for any `B`, and a taller tile reads each weight element
# once per `B` rows instead of once per 16: fewer bytes per FLOP, which is what a
# compute-bound GEMM needs.

# %%
rng = np.random.default_rng(0)
for T_ in (64, 4096):
    ids = zipf_routing(T_, 128, 8, 1.2, rng)
    counts = np.bincount(ids.ravel(), minlength=128)
    padded = {b_: (-(-counts // b_) * b_).sum() for b_ in (16, 32, 64, 128)}
    line = ", ".join(f"B={b_}: {(n_ - ids.size) / n_:.0%}" for b_, n_ in padded.items())
    print(f"T={T_}: share of computed rows that are padding: {line}")

# %% [markdown]
# ## 4. Write the unpermute

# %%
layer = FusedMoE.random(num_experts=8, top_k=2, hidden_size=32, intermediate_size=48, seed=1)
x, logits = layer.random_inputs(10, seed=2)
w, ids, _ = reference.select_experts(x, logits, layer.top_k, False, True)
x_grouped, offsets, inv = reference.moe_permute(x, ids, layer.num_experts)
y = x_grouped * 2.0                                         # any per-row expert output


def unpermute_loop(y_grouped, topk_weights, inv_permuted_idx):
    T_, K_ = topk_weights.shape
    out = np.zeros((T_, y_grouped.shape[1]), np.float32)
    for t in range(T_):
        for k in range(K_):
            out[t] += topk_weights[t, k] * y_grouped[inv_permuted_idx[t * K_ + k]]
    return out


print("loop vs reference.moe_unpermute:",
      f"{workshop.rel_err(unpermute_loop(y, w, inv), reference.moe_unpermute(y, w, inv)):.1e}")
