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
# # 1. A tour of moe-sandbox
#
# **What you will learn**
#
# * what a Mixture-of-Experts (MoE) layer computes, written as the dumbest loop that is
#   obviously right;
# * how vLLM's fused MoE splits that loop into six stages, and what flows between them;
# * the four backends (the NumPy reference, torch, CuPy, Numba), and how to swap one stage
#   at a time;
# * how to read the parity table, the sandbox's main job.
#
# The series runs on a laptop and on a GPU. The parameters cell below picks the mode:
# on a CPU the NumPy reference, torch and the Numba kernels in the CUDA simulator run; on a
# GPU the real CuPy and Numba kernels do. Set `MOE_SANDBOX_NOTEBOOK_MODE=cpu` or `gpu`
# before starting Jupyter to force one.

# %% tags=["parameters"]
import workshop

RUN = workshop.setup("01_tour")   # mode "cpu" or "gpu", detected (or the env var)
FAMILY = "qwen3_moe"              # a checkpoint in data/: mixtral, qwen3_moe, deepseek_v3, gpt_oss
TRACE = "zipf"                    # a router trace: balanced, zipf, one_expert, nan_rows
TOKENS = 256 if RUN.gpu else 32   # tokens of the trace for the parity table
BACKENDS = ["reference", "torch", "numba", "cupy"] if RUN.gpu else ["reference", "torch"]
SIM_TOKENS = 4                    # CPU only: tokens of the toy layer run in the Numba simulator

# %%
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

import reference
from sandbox import STAGES, FusedMoE, available_backends, get_backend, validate
from sandbox.checkpoint import data_dir, default_trace_path
from sandbox.datagen import load_trace
from sandbox.validate import tolerance

layer = FusedMoE.from_safetensors(data_dir() / FAMILY, None)   # the first MoE layer
x, logits = load_trace(default_trace_path(FAMILY, TRACE))       # [T, H], [T, E]
print(layer)
print(f"trace {TRACE}: hidden_states {x.shape}, router_logits {logits.shape}")

# %% [markdown]
# ## 1. What an MoE layer computes
#
# Shapes: `T` tokens, `E` experts, `K` experts per token (top-k), `H` hidden size,
# `I` intermediate size. A router scores every expert for every token; each token goes
# through its `K` best experts, and their outputs are mixed with the router's weights:
#
# $$\text{out}[t] = \sum_{k<K} w_{t,k}\; W_2^{(e)}\,\big(\text{silu}(g) \odot u\big),
# \qquad [g; u] = W_{13}^{(e)}\, x_t,\qquad e = \text{ids}_{t,k}$$
#
# with `w, ids` the top-`K` of `softmax(logits[t])`, renormalized to sum to one. Every
# expert is a small gated MLP; only `K` of the `E` run per token, which is the point of an
# MoE: the parameters of `E` MLPs at the cost of `K`.
#
# Here it is, one token and one slot at a time (the style of ScatterMoE's test oracle):

# %%
def moe_loop(x, w13, w2, logits, top_k):
    """out[t] = sum_k w[t, k] * w2[e] @ (silu(gate) * up), [gate; up] = w13[e] @ x[t]."""
    inter = w2.shape[2]                                        # I
    out = np.zeros(x.shape, np.float64)                        # [T, H]
    for t in range(x.shape[0]):
        p = np.exp(logits[t] - logits[t].max())
        p /= p.sum()                                           # softmax over E
        ids = np.argsort(-p, kind="stable")[:top_k]            # top-k, ties to the lowest id
        w = p[ids] / p[ids].sum()                              # renormalize
        for k, e in enumerate(ids):
            h = w13[e] @ x[t]                                  # [2I]
            act = h[:inter] / (1 + np.exp(-h[:inter])) * h[inter:]   # silu(gate) * up, [I]
            out[t] += w[k] * (w2[e] @ act)                     # [H]
    return out


x64, w13, w2, g64 = (a.astype(np.float64) for a in (x[:TOKENS], layer.w13_weight,
                                                      layer.w2_weight, logits[:TOKENS]))
loop_out = moe_loop(x64, w13, w2, g64, layer.top_k)
oracle = reference.fused_moe(x64, w13, w2, g64, layer.top_k, renormalize=True, precision="exact")
print(f"loop vs reference.fused_moe (float64): rel. error {workshop.rel_err(loop_out, oracle):.1e}")

# %% [markdown]
# They agree to about 1e-8, not 1e-16, even though both ran in float64: the reference
# routes in fp32 whatever the logits' dtype, as vLLM's routing kernels do, so the router
# weights carry fp32 rounding. Routing is where kernels and references most often part
# ways; notebook 2 is about it.

# %% [markdown]
# The loop is correct and hopeless on a GPU: `T * K` tiny matrix-vector products. The
# fused MoE of inference engines reorganises the same arithmetic so that each expert's
# weights are read once and multiplied by all of its tokens together.
#
# ## 2. The six stages
#
# | stage | function (docs/stages.md) | in → out |
# |---|---|---|
# | route | `select_experts` | logits `[T, E]` → `topk_weights`, `topk_ids` `[T, K]` |
# | align | `moe_align_block_size` | ids → slots grouped by expert, each run padded to the block size `B` |
# | gemm1 | `grouped_gemm` with `w13 [E, 2I, H]` | `x [T, H]` gathered per slot → `[T*K, 2I]` |
# | activation | `apply_activation` | `silu(gate) * up` → `[T*K, I]` |
# | gemm2 | `grouped_gemm` with `w2 [E, H, I]`, × router weight | → `[T*K, H]` |
# | combine | `moe_sum` | sum over the `K` slots → `out [T, H]` |
#
# A *slot* is one (token, choice) pair, `s = t*K + k`; there are `P = T*K` of them.
# `run_stages` runs the layer and records every stage's inputs and outputs, so we can look
# at what flows between them for a few tokens of the trace:

# %%
T_SHOW = 12
# a small alignment block for the picture (the layer's own B is chosen by its GEMM backend)
small_b = FusedMoE.from_safetensors(data_dir() / FAMILY, None, block_size=8)
out_show, trace = small_b.run_stages(x[:T_SHOW], logits[:T_SHOW])
calls = {c.stage: c for c in trace}
topk_weights, topk_ids, _ = calls["route"].outputs
sorted_ids, expert_ids, ntpp = calls["align"].outputs
B = int(calls["align"].args[1])
P = T_SHOW * layer.top_k

routing = np.zeros((T_SHOW, layer.num_experts))                # [T, E]: the chosen weights
np.put_along_axis(routing, topk_ids.astype(np.int64), topk_weights, axis=1)
live = int(ntpp[0])
blocks = sorted_ids[:live].reshape(-1, B)                      # [blocks, B]
block_expert = np.where(blocks < P, expert_ids[:live // B, None], -1).astype(float)
block_expert[block_expert < 0] = np.nan                        # padding: grey

panels = [
    ("route in: logits", logits[:T_SHOW], "[T, E]", "coolwarm"),
    ("route out: weights", routing, "[T, E]", "viridis"),
    ("align: expert of each slot", block_expert, f"[blocks, B={B}]", "tab20"),
    ("gemm1: cache1", calls["gemm1"].outputs, "[P, 2I]", "coolwarm"),
    ("activation: cache2", calls["activation"].outputs, "[P, I]", "coolwarm"),
    ("gemm2: cache3", calls["gemm2"].outputs, "[P, H]", "coolwarm"),
    ("combine: out", out_show, "[T, H]", "coolwarm"),
]
fig, axes = plt.subplots(1, len(panels), figsize=(17, 3.6))
for ax, (title, a, shape, cmap) in zip(axes, panels):
    a = np.asarray(a, dtype=np.float32)
    if cmap == "coolwarm":
        v = float(np.nanmax(np.abs(a))) or 1.0
        ax.imshow(a, aspect="auto", cmap=cmap, vmin=-v, vmax=v, interpolation="nearest")
    else:
        cm = plt.get_cmap(cmap).copy()
        cm.set_bad("#dddddd")                                  # NaN cells: padding
        ax.imshow(a, aspect="auto", cmap=cm, interpolation="nearest")
    ax.set_title(f"{title}\n{shape} = {list(a.shape)}", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
fig.suptitle(f"{T_SHOW} tokens through the {FAMILY} layer (E={layer.num_experts}, "
             f"K={layer.top_k}, H={layer.hidden_size}, I={layer.intermediate_size})", y=1.03)
workshop.show(fig, "data_flow")

# %% [markdown]
# Read it left to right. The router's logits become `K` non-zero weights per token row.
# The alignment lists the `P` slots grouped by expert (one colour per expert); each
# expert's run is padded to a multiple of `B` so a GEMM tile never straddles two experts
# (the grey cells are padding: rows a GEMM tile carries and then throws away). GEMM1 produces `2I` numbers per slot
# (gate and up), the activation halves them, GEMM2 maps back to `H` and scales by the
# router weight, and the combine sums each token's `K` rows. Notebooks 2, 3 and 4 open up
# routing, alignment and the GEMM.
#
# ## 3. The backends
#
# Every stage has one name and one signature in every backend, so a stage can be swapped
# alone. Which ones can run here, and why not:

# %%
avail = available_backends()
workshop.show_table(["backend", "here?", "why / what"],
                    [(name, "yes" if ok else "no", why[:110]) for name, (ok, why) in avail.items()])

grid = np.array([[1.0 if get_backend(b).has_stage(s) else 0.0 for s in STAGES] for b in avail])
fig, ax = plt.subplots(figsize=(7, 2.4))
ax.imshow(grid, cmap=ListedColormap(["#e0e0e0", "#7cc47f"]), vmin=0, vmax=1, aspect="auto")
ax.set_xticks(range(len(STAGES)), STAGES)
ax.set_yticks(range(len(avail)), list(avail))
ax.grid(False)
for i in range(grid.shape[0]):
    for j in range(grid.shape[1]):
        ax.text(j, i, "runs here" if grid[i, j] else "-", ha="center", va="center", fontsize=8)
ax.set_title(f"which backend can run which stage on this machine (mode {RUN.mode})")
workshop.show(fig, "backends")

# %% [markdown]
# Swapping is a dictionary: stages left out stay on the reference. The layer moves arrays
# between backends only where the backend changes.

# %%
mixed = layer.with_backend({"gemm1": "torch", "activation": "torch", "gemm2": "torch"})
ref_out = layer.forward(x[:TOKENS], logits[:TOKENS])
mixed_out = mixed.forward(x[:TOKENS], logits[:TOKENS])
print(f"{mixed.stage_backends}\nrel. error against the reference: "
      f"{workshop.rel_err(mixed_out, ref_out):.1e}")

# %% [markdown]
# ## 4. The parity table
#
# `validate` runs the same inputs through every backend, stage by stage. Two rules make
# its numbers mean something:
#
# * **no compounding**: each backend's stage is fed the *reference's* inputs for that
#   stage, so a row measures that stage's own error;
# * **against the exact answer**: the yardstick is the reference fed float64 copies, so the
#   reference's own rounding shows up as a row too.
#
# Floats pass on the relative Frobenius error `‖got − exact‖ / ‖exact‖` (fp32 ≤ 1e-5,
# bf16/fp16 ≤ 1e-2); routing ids and alignments must match exactly.

# %%
report = validate(layer, x[:TOKENS], logits[:TOKENS], backends=BACKENDS)


def report_rows(rep):
    return [(r["backend"], r["stage"], r["status"], r.get("rel_err"), r.get("tol"),
             r.get("ids") or r.get("detail") or "") for r in rep.rows]


workshop.show_table(["backend", "stage", "status", "rel. error", "tol", "ids / detail"],
                    report_rows(report), floatfmt=".1e")
print("first divergence:", report.first_divergence, "->", "OK" if report.ok else "DIVERGENCE")

# %% [markdown]
# On a CPU the Numba kernels run in the CUDA simulator: one Python thread per CUDA thread,
# about two thousand threads a second. That is slow, but it runs the kernel code itself, with
# shared memory and barriers, on any laptop. A toy layer keeps it to seconds:

# %%
if RUN.gpu:
    sim_report = report                    # the real kernels are in the table above
else:
    toy = FusedMoE.random(num_experts=4, top_k=2, hidden_size=16, intermediate_size=16,
                          block_size=4)
    tx, tl = toy.random_inputs(SIM_TOKENS)
    sim_report = validate(toy, tx, tl, backends=["numba"])
    workshop.show_table(["backend", "stage", "status", "rel. error", "tol", "ids / detail"],
                        report_rows(sim_report), floatfmt=".1e")

# %%
rows = [r for r in report.rows + (sim_report.rows if sim_report is not report else [])
        if r.get("rel_err") is not None]
names = list(dict.fromkeys(r["backend"] for r in rows))
stages = list(STAGES) + ["end_to_end"]
fig, ax = plt.subplots(figsize=(9, 3.4))
width = 0.8 / max(len(names), 1)
for i, name in enumerate(names):
    vals = {r["stage"]: r["rel_err"] for r in rows if r["backend"] == name}
    label = name + (" (simulator, toy layer)" if name == "numba" and not RUN.gpu else "")
    xs = [j + i * width for j, s in enumerate(stages) if s in vals]
    ys = [vals[s] for s in stages if s in vals]
    bars = ax.bar(xs, [max(y, 1e-12) for y in ys], width, label=label)
    for bar, y in zip(bars, ys):
        if y == 0:                                 # bit-exact: no bar to draw on a log axis
            ax.text(bar.get_x() + width / 2, 2e-12, "0", ha="center", fontsize=8)
tol = tolerance(layer.params_dtype)
ax.axhline(tol, color="k", ls="--", lw=1, label=f"tolerance {tol:.0e}")
ax.set_yscale("log")
ax.set_ylim(1e-12, 1e-3)
ax.set_xticks([j + 0.4 - width / 2 for j in range(len(stages))], stages)
ax.set_ylabel("rel. error vs exact")
ax.set_title(f"parity per stage ({layer.params_dtype}, {TOKENS} tokens of '{TRACE}')")
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
workshop.show(fig, "parity")

# %% [markdown]
# Every bar sits orders of magnitude under the dashed tolerance: in fp32 the backends
# differ from the exact answer only by the order in which they add. Routing and alignment
# have no bars: they are compared exactly (the `ids` column). Notebook 6 takes the same
# table to bf16, where the rounding points of the engine become visible.
#
# The same job from a terminal: `moe-sandbox validate` (all backends on the default layer
# and trace, exit code 1 on a divergence).
#
# ## Exercises
#
# 1. **Another family.** Set `FAMILY = "deepseek_v3"` and re-run. Print the layer: what
#    is new (routing, shared expert)? Does `moe_loop` still match? Why not, and what would
#    it need?
# 2. **bf16.** Call `validate(layer, ..., dtype=ml_dtypes.bfloat16)`. Which tolerance
#    applies now, and which stages carry the largest error?
# 3. **NaN logits.** Use `TRACE = "nan_rows"`. What do the tokens whose logits hold a NaN
#    get from the router (docs/stages.md, *route*), and what is their output? Is any output
#    NaN, and do the other tokens notice?
# 4. **Swap one stage at a time.** Make a loop over `STAGES` that swaps only that stage to
#    `"torch"` and prints the end-to-end error against the reference. Which stage changes
#    the output most, and why is that the one?
#
# Solutions: `solutions/01_tour_solutions.ipynb`.
