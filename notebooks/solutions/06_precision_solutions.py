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
# # 6. Precision: solutions
#
# Try the exercises at the end of `06_precision.ipynb` first.

# %% tags=["parameters"]
import pathlib
import sys

# workshop.py sits one folder up (Jupyter runs this in solutions/; a script knows its file)
HERE = pathlib.Path(__file__).resolve().parent if "__file__" in globals() else pathlib.Path.cwd()
sys.path.insert(0, str(HERE.parent))
import workshop

RUN = workshop.setup("06_precision_solutions")
TOKENS = 64

# %%
import ml_dtypes
import numpy as np

import reference
from sandbox import FusedMoE
from sandbox.checkpoint import data_dir, default_trace_path
from sandbox.datagen import load_trace

BF16 = np.dtype(ml_dtypes.bfloat16)
base = FusedMoE.from_safetensors(data_dir() / "qwen3_moe", None)
x, logits = load_trace(default_trace_path("qwen3_moe", "zipf"))
x, logits = x[:TOKENS], logits[:TOKENS]

# %% [markdown]
# ## 1. fp16
#
# fp16 keeps 3 more significand bits, so every rounding is ~8× smaller. The risk is range:
# activations or GEMM outputs above 65,504 become inf (bf16 goes to ~3e38).

# %%
for dt in (BF16, np.dtype(np.float16)):
    lay = base.to_dtype(dt)
    xe = x.astype(dt)
    out_e, _ = lay.run_stages(xe, logits)
    out_x, _ = lay.run_stages(xe, logits, exact=True)
    print(f"{dt}: end-to-end rel. error vs exact {workshop.rel_err(out_e, out_x):.1e}")

# %% [markdown]
# ## 2. Round less
#
# Keeping `cache1` and `cache2` in fp32 removes two of the four roundings; what is left is
# close to the one-rounding floor.

# %%
lay = base.to_dtype(BF16)
xb = x.astype(BF16)
w, ids, _ = reference.select_experts(xb, logits, lay.top_k, False, True)
B = 16
align = reference.moe_align_block_size(ids, B, lay.num_experts)
w13, w2 = lay.w13_weight.astype(np.float32), lay.w2_weight.astype(np.float32)
c1 = reference.grouped_gemm(xb.astype(np.float32), w13, *align, lay.top_k, B)           # fp32
c2 = reference.silu_and_mul(c1)                                                          # fp32
c3 = reference.grouped_gemm(c2.astype(BF16), lay.w2_weight, *align, 1, B, w, True)       # bf16
out_less = reference.moe_sum(c3.reshape(TOKENS, lay.top_k, -1))                          # bf16
out_e, _ = lay.run_stages(xb, logits)
out_x, _ = lay.run_stages(xb, logits, exact=True)
print(f"engine (4 roundings): {workshop.rel_err(out_e, out_x):.1e}, "
      f"cache1/cache2 in fp32: {workshop.rel_err(out_less, out_x):.1e}, "
      f"exact rounded once: {workshop.rel_err(np.asarray(out_x).astype(BF16), out_x):.1e}")

# %% [markdown]
# ## 3. A broken kernel
#
# Forgetting the router weight on one expert's rows is an error of order one on those
# rows; over the whole output it is still far above `1e-1`: no tolerance in use would let
# it through.

# %%
lay32 = base
w, ids, _ = reference.select_experts(x, logits, lay32.top_k, False, True)
align = reference.moe_align_block_size(ids, B, lay32.num_experts)
c1 = reference.grouped_gemm(x, lay32.w13_weight, *align, lay32.top_k, B)
c2 = reference.silu_and_mul(c1)
good = reference.grouped_gemm(c2, lay32.w2_weight, *align, 1, B, w, True)
unweighted = reference.grouped_gemm(c2, lay32.w2_weight, *align, 1, B)
bad = good.copy()
rows_e0 = (ids.ravel() == 0)                                 # the slots of expert 0
bad[rows_e0] = unweighted[rows_e0]
print(f"GEMM2 missing the weight on expert 0 ({rows_e0.sum()} of {rows_e0.size} rows): "
      f"rel. error {workshop.rel_err(bad, good):.2f} (tolerance 1e-5 in fp32, 1e-2 in bf16)")

# %% [markdown]
# ## 4. Summation order
#
# fp32 drops the `1` added to `1e8` (its spacing there is 8), so the order decides. For
# bf16 we search for four products whose two fp32 sums round to different bf16 numbers.

# %%
v = np.array([1e8, 1.0, -1e8, 1.0], dtype=np.float32)
left = ((v[0] + v[1]) + v[2]) + v[3]
paired = (v[0] + v[2]) + (v[1] + v[3])
print(f"fp32: ((1e8 + 1) - 1e8) + 1 = {left}, (1e8 - 1e8) + (1 + 1) = {paired}")

rng = np.random.default_rng(0)
for trial in range(100_000):
    p4 = rng.standard_normal(4).astype(np.float32)
    s1 = ((p4[0] + p4[1]) + p4[2]) + p4[3]
    s2 = (p4[0] + p4[1]) + (p4[2] + p4[3])
    if np.asarray(s1).astype(BF16) != np.asarray(s2).astype(BF16):
        print(f"after {trial + 1} tries: products {p4.tolist()}: fp32 {s1!r} vs {s2!r} -> bf16 "
              f"{float(np.asarray(s1).astype(BF16))} vs {float(np.asarray(s2).astype(BF16))}")
        break

# %% [markdown]
# ## 5. Zero points
#
# A symmetric int4 group spends its 16 levels on [-absmax, absmax]; a group whose values
# lean to one side wastes part of them. A zero point shifts the levels onto [min, max], so
# the step shrinks from 2 absmax / 15 to (max - min) / 15 (`reference/quant.py`
# quantize_weight_wna16). The cost: one uint8 a group beside each fp32 scale.

# %%
from sandbox import quant as Q
from sandbox.bench import quant_expert_bytes

SIZES = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=256)
float_layer = FusedMoE.random(seed=0, params_dtype=BF16, **SIZES)
w13 = float_layer.w13_weight.astype(np.float32)
for s in ("w4a16", "w4a16_zp"):
    ql = FusedMoE(quant_config=s, params_dtype=BF16, **SIZES).quantize_from(float_layer)
    deq = Q.dequantize_experts(ql.quant_config, ql.w13_weight, ql.w13_weight_scale,
                               ql.w13_weight_zero_point)
    print(f"{s:9s} w13 rel. error {workshop.rel_err(deq, w13):.3f}, "
          f"{quant_expert_bytes(ql.quant_config, 7168, 2048) / 2**20:.2f} MiB per "
          f"DeepSeek-V3-sized expert")
