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
# # 5. Expert parallelism: solutions
#
# Try the exercises at the end of `05_expert_parallelism.ipynb` first.

# %% tags=["parameters"]
import pathlib
import sys

# workshop.py sits one folder up (Jupyter runs this in solutions/; a script knows its file)
HERE = pathlib.Path(__file__).resolve().parent if "__file__" in globals() else pathlib.Path.cwd()
sys.path.insert(0, str(HERE.parent))
import workshop

RUN = workshop.setup("05_expert_parallelism_solutions")
LAYER = dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=48, dtype="float32")

# %%
import numpy as np

import reference
from reference import eplb
from sandbox.checkpoint import default_trace_path
from sandbox.datagen import load_trace

# %% [markdown]
# ## 1. Where the crossover is
#
# Per rank: all-gather moves `T(Hb + 8K) + W·T·H·b`, all-to-all `2·T·K·H·b`. Ignoring the
# small routing term, the all-to-all wins once `W + 1 > 2K`: from `W = 16` at `K = 8`,
# already at `W = 4` for Mixtral's `K = 2`.

# %%
H, b, T = 7168, 2, 4096
for K in (8, 2):
    for W in (2, 4, 8, 16, 32):
        ag = T * (H * b + 8 * K) + W * T * H * b
        a2a = 2 * T * K * H * b
        if a2a < ag:
            print(f"K={K}: all-to-all moves fewer bytes from W = {W}")
            break

# %% [markdown]
# ## 2. Round-robin placement, slot rows
#
# Rank `r` holds experts `r, r + W, …`; the outputs still match the single-device layer.
# With slot rows a token whose two experts sit on one rank is sent there twice, so more
# rows travel than with token rows (one per token and destination rank).

# %%
for r in range(2):
    _, emap = reference.determine_expert_map(2, r, 8, "round_robin")
    print(f"rank {r}:", np.flatnonzero(emap >= 0).tolist())
for rows_mode in ("token", "slot"):
    config = {**LAYER, "placement": "round_robin", "alltoall_rows": rows_mode}
    results = workshop.launch_ranks(workshop.ep_parity_rank, 2, "cpu", args=(config, [5, 3]),
                                    timeout=60)
    for res in results:
        print(f"{rows_mode} rows, rank {res['rank']}, experts {res['local_experts']}:",
              {s: f"{res[s]['rel_err']:.1e}" for s in ("allgather", "alltoall")},
              "rows sent", res["alltoall"]["stats"].get("rows_sent"))

# %% [markdown]
# ## 3. More redundancy
#
# Eight replicas go to the heaviest experts (by load per replica); the balance improves,
# with diminishing returns once every GPU is near the mean.

# %%
_, lz = load_trace(default_trace_path("deepseek_v3", "zipf"))
_, ids, _ = reference.fused_topk(None, lz, 4, True)
load = np.bincount(ids.ravel(), minlength=16).astype(float)
for R in (4, 8):
    phy2log, _, logcnt = eplb.rebalance_experts(load, 16 + R, 1, 1, 4)
    g = eplb.gpu_loads(load, phy2log, 4)
    print(f"R={R}: max/mean {g.max() / g.mean():.3f}, replicated experts "
          f"{[(int(e), int(c)) for e, c in enumerate(logcnt) if c > 1]}")

# %% [markdown]
# ## 4. Hierarchical EPLB
#
# With 4 groups on 2 nodes, each node gets 2 whole groups and all their replicas: a
# token's experts, limited to few groups by grouped top-k, then sit on few nodes, so the
# slow inter-node links carry fewer copies of it.

# %%
phy2log, _, _ = eplb.rebalance_experts(load, 24, num_groups=4, num_nodes=2, num_gpus=4)
per_node = phy2log.reshape(2, -1)                   # node n: GPUs 2n, 2n+1
for n, slots in enumerate(per_node):
    print(f"node {n}: experts {sorted(set(slots.tolist()))}, groups "
          f"{sorted(set((slots // 4).tolist()))}")
groups_on_both = set((per_node[0] // 4).tolist()) & set((per_node[1] // 4).tolist())
print("a group on both nodes:", sorted(groups_on_both) or "none")
