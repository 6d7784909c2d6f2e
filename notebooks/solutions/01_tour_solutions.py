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
# # 1. A tour of moe-sandbox: solutions
#
# Try the exercises at the end of `01_tour.ipynb` first.

# %% tags=["parameters"]
import pathlib
import sys

# workshop.py sits one folder up (Jupyter runs this in solutions/; a script knows its file)
HERE = pathlib.Path(__file__).resolve().parent if "__file__" in globals() else pathlib.Path.cwd()
sys.path.insert(0, str(HERE.parent))
import workshop

RUN = workshop.setup("01_tour_solutions")
TOKENS = 256 if RUN.gpu else 32
BACKENDS = ["reference", "torch", "numba", "cupy"] if RUN.gpu else ["reference", "torch"]

# %%
import ml_dtypes
import numpy as np

import reference
from sandbox import STAGES, FusedMoE, validate
from sandbox.checkpoint import data_dir, default_trace_path
from sandbox.datagen import load_trace

# %% [markdown]
# ## 1. Another family
#
# DeepSeek-V3's layer routes differently (sigmoid scores, 4 groups of which 2 are kept, a
# correction bias that steers the choice, weights scaled by 2.5) and adds a **shared
# expert** that every token visits with weight 1. `moe_loop` knows neither, so it is far
# off. Routing with `reference.select_experts` and adding the shared expert fixes it:

# %%
ds = FusedMoE.from_safetensors(data_dir() / "deepseek_v3", None)
x, logits = load_trace(default_trace_path("deepseek_v3", "zipf"))
x, logits = x[:TOKENS], logits[:TOKENS]
print(ds)


def silu_mul(h):
    inter = h.shape[-1] // 2
    return h[..., :inter] / (1 + np.exp(-h[..., :inter])) * h[..., inter:]


def moe_loop_v2(layer, x, logits):
    """The tour's loop with the layer's own routing and its shared expert."""
    w, ids, _ = reference.select_experts(
        x, logits, layer.top_k, layer.use_grouped_topk, layer.renormalize,
        topk_group=layer.topk_group, num_expert_group=layer.num_expert_group,
        scoring_func=layer.scoring_func, routed_scaling_factor=layer.routed_scaling_factor,
        e_score_correction_bias=layer.e_score_correction_bias)
    w13, w2 = layer.w13_weight.astype(np.float64), layer.w2_weight.astype(np.float64)
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for k, e in enumerate(ids[t]):
            out[t] += w[t, k] * (w2[e] @ silu_mul(w13[e] @ x[t]))
        if layer.n_shared_experts:
            out[t] += layer.shared_w2.astype(np.float64) @ silu_mul(
                layer.shared_w13.astype(np.float64) @ x[t])
    return out


want = ds.forward(x, logits)
print(f"moe_loop_v2 vs the layer: {workshop.rel_err(moe_loop_v2(ds, x, logits), want):.1e}")

# %% [markdown]
# ## 2. bf16
#
# The tolerance becomes `1e-2`; the errors grow to about `1e-3` per stage (one bf16
# rounding) and a few `1e-3` end to end, where the roundings of the stages add up.

# %%
layer = FusedMoE.from_safetensors(data_dir() / "qwen3_moe", None)
xq, lq = load_trace(default_trace_path("qwen3_moe", "zipf"))
rep = validate(layer, xq[:TOKENS], lq[:TOKENS], backends=BACKENDS, dtype=ml_dtypes.bfloat16)
workshop.show_table(["backend", "stage", "status", "rel. error", "tol"],
                    [(r["backend"], r["stage"], r["status"], r.get("rel_err"), r.get("tol"))
                     for r in rep.rows], floatfmt=".1e")

# %% [markdown]
# ## 3. NaN logits
#
# vLLM's routing kernels turn a score that is not finite into 0. A NaN logit makes the
# whole softmax row NaN, so that token gets experts 0 .. K-1 with weight 0: its output is
# exactly 0, no output is NaN, and every other token is routed as before.

# %%
xn, ln = load_trace(default_trace_path("qwen3_moe", "nan_rows"))
out = layer.forward(xn, ln)
nan_in = np.isnan(ln).any(axis=1)
w_n, ids_n, _ = reference.fused_topk(xn, ln, layer.top_k, layer.renormalize)
print("tokens with a NaN logit:", np.flatnonzero(nan_in).tolist())
print("their ids:", np.unique(ids_n[nan_in], axis=0).tolist(), "weights:",
      np.unique(w_n[nan_in]).tolist())
print("any NaN output:", bool(np.isnan(out).any()),
      "| their outputs all 0:", not np.asarray(out[nan_in], np.float64).any())
clean = ln.copy()
clean[nan_in] = 0.0                                   # the other tokens do not notice
print("other tokens unchanged:",
      np.array_equal(out[~nan_in], layer.forward(xn, clean)[~nan_in]))

# %% [markdown]
# ## 4. Swap one stage at a time
#
# The GEMMs move the output most: they do nearly all the arithmetic, and a different
# summation order (torch's matmul against NumPy's) shows up there first. Routing and
# alignment change nothing: their outputs are exact.

# %%
ref_out = layer.forward(xq[:TOKENS], lq[:TOKENS])
rows = []
for stage in STAGES:
    got = layer.with_backend({stage: "torch"}).forward(xq[:TOKENS], lq[:TOKENS])
    rows.append((stage, f"{workshop.rel_err(got, ref_out):.1e}"))
workshop.show_table(["stage on torch", "end-to-end difference from the reference"], rows)
