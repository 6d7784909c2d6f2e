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
# # 6. Precision: where bf16 rounds, and how far kernels drift
#
# **What you will learn**
#
# * what bf16 can represent, and the size of one rounding;
# * the **engine-faithful** mode: every stage accumulates in fp32 and rounds its output once
#   to bf16, as vLLM's kernels do — and how those rounding points add up through the layer,
#   against the **exact** mode (the same stages in float64);
# * why two correct kernels do not agree bit for bit (the order of fp32 additions), and
#   where the backends differ from the reference, by how much;
# * where the tolerances (`1e-2` for bf16, `1e-5` for fp32) come from.
#
# The modes are `reference/precision.py`; the judge is `sandbox/validate.py`.

# %% tags=["parameters"]
import workshop

RUN = workshop.setup("06_precision")
FAMILY = "qwen3_moe"
TRACE = "zipf"
TOKENS = 256 if RUN.gpu else 64
BACKENDS = ["reference", "torch", "numba", "cupy"] if RUN.gpu else ["reference", "torch"]
SIM_TOKENS = 4                     # CPU only: a toy layer through the Numba simulator, in bf16

# %%
import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np

from sandbox import STAGES, FusedMoE, validate
from sandbox.checkpoint import data_dir, default_trace_path
from sandbox.datagen import load_trace
from sandbox.validate import tolerance

BF16 = np.dtype(ml_dtypes.bfloat16)
layer = FusedMoE.from_safetensors(data_dir() / FAMILY, None).to_dtype(BF16)
x, logits = load_trace(default_trace_path(FAMILY, TRACE))
x, logits = x[:TOKENS].astype(BF16), logits[:TOKENS]
print(layer)

# %% [markdown]
# ## 1. One bf16 rounding
#
# bf16 keeps fp32's 8-bit exponent (same range, up to ~3e38) but only 8 bits of
# significand (7 stored). Between 1 and 2 its numbers are 1/128 apart; rounding to the
# nearest one makes a relative error of at most `u = 2^-8 ≈ 0.4 %`, the *unit roundoff*.
# fp16 has 11 bits (`u = 2^-11`) but overflows at 65504 (and its tiny values lose bits:
# the left tail below).

# %%
v = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
fig, ax = plt.subplots(figsize=(8, 3))
for dt, name in ((BF16, "bf16"), (np.float16, "fp16")):
    rel = np.abs(v.astype(dt).astype(np.float64) - v) / np.abs(v)
    ax.hist(np.log10(rel[rel > 0]), bins=80, histtype="step", lw=1.5,
            label=f"{name}: max {rel.max():.1e}, Frobenius {workshop.rel_err(v.astype(dt), v):.1e}")
ax.axvline(np.log10(2.0 ** -8), color="tab:blue", ls=":", lw=1)
ax.axvline(np.log10(2.0 ** -11), color="tab:orange", ls=":", lw=1)
ax.set(xlabel="log10 relative rounding error", ylabel="values",
       title="rounding N(0, 1) fp32 values once (dotted: unit roundoff)")
ax.legend(fontsize=8)
workshop.show(fig, "one_rounding")

# %% [markdown]
# One rounding of many values has a relative Frobenius error of about `1.7e-3` in bf16
# (most values round by less than the worst case). The layer rounds several times; the
# bf16 tolerance of `1e-2` leaves room for a few of them, and for the error the *inputs'*
# rounding causes downstream — but not for a wrong index, a missing scale or a lost row,
# which show up as errors of order one.
#
# ## 2. The rounding points of the engine
#
# `FusedMoE.run_stages` records every stage. In the engine-faithful mode each stage's
# output is bf16; with `exact=True` the same reference stages run on float64 copies of the
# (bf16-valued) weights and inputs, so the only difference between the two is *where the
# engine rounds*. Routing stays in fp32 in both (as vLLM does), so the experts chosen are
# the same.

# %%
out_e, trace_e = layer.run_stages(x, logits)                 # bf16 after every stage
out_x, trace_x = layer.run_stages(x, logits, exact=True)     # float64 throughout
eng = {c.stage: c.outputs for c in trace_e}
ex = {c.stage: c.outputs for c in trace_x}
chain = ["gemm1", "activation", "gemm2", "combine"]
accumulated = [workshop.rel_err(eng[s], ex[s]) for s in chain]
round_once = [workshop.rel_err(np.asarray(ex[s]).astype(BF16), ex[s]) for s in chain]

own = validate(layer, x, logits, backends=["reference"], end_to_end=False)
own_err = [own.row("reference", s)["rel_err"] for s in chain]

fig, ax = plt.subplots(figsize=(8, 3.6))
xs = np.arange(len(chain))
ax.plot(xs, accumulated, marker="o", label="engine chain vs exact chain (errors accumulate)")
ax.plot(xs, own_err, marker="s", label="each stage alone, fed exact inputs (validate's rows)")
ax.plot(xs, round_once, marker="^", ls="--", label="the exact value rounded once to bf16")
ax.axhline(tolerance(BF16), color="k", ls="--", lw=1, label="bf16 tolerance 1e-2")
ax.set(yscale="log", xticks=xs, xticklabels=[f"{s}\n{tuple(np.shape(eng[s]))}" for s in chain],
       ylabel="rel. error vs exact", title=f"{FAMILY} in bf16, {TOKENS} tokens: rounding "
       "through the stages")
ax.legend(fontsize=7, loc="upper left")
workshop.show(fig, "rounding_points")
workshop.show_table(["stage", "accumulated", "stage alone", "rounded once"],
                    [(s, a, o, r) for s, a, o, r in zip(chain, accumulated, own_err, round_once)],
                    floatfmt=".2e")

# %% [markdown]
# Read the three lines:
#
# * **rounded once** is the floor: the exact value, rounded to bf16 one time (`≈ 1.7e-3`).
# * **stage alone** is one stage fed exact inputs: its own fp32 accumulation plus its one
#   rounding; it sits on the floor. A stage that did something wrong would stand out here
#   (this is why `validate` feeds every backend the reference's inputs: no compounding).
# * **accumulated** is what the engine actually delivers: every earlier rounding
#   propagates. GEMM1 inherits nothing, the activation inherits GEMM1's rounding, GEMM2
#   inherits both. The `K`-way combine averages some of it away.
#
# The rounded intermediate values are not a flaw of the sandbox: they are what a bf16
# serving engine computes, and what a kernel must reproduce to be a drop-in replacement.
#
# ### How far, in ulps
#
# An *ulp* (unit in the last place) is the spacing of bf16 numbers at a value. Most
# outputs land within an ulp or two of the exact value. A tail lands many ulps away: the
# outputs close to zero, where the `K` expert rows of a token (and the terms of each dot
# product before them) cancel. Their error is set by the size of the *terms*, their ulp by
# the size of the *result*. This is why parity is judged on the whole tensor (relative
# Frobenius error), never element by element:

# %%
def ulps(a, ref):
    """|a - ref| in bf16 ulps at ref (the spacing 2^(e - 7) of bf16 at |ref| in [2^e, 2^e+1))."""
    ref = np.asarray(ref, np.float64)
    e = np.floor(np.log2(np.maximum(np.abs(ref), 1e-30)))
    return np.abs(np.asarray(a, np.float64) - ref) / 2.0 ** (e - 7)


d = ulps(out_e, out_x).ravel()
mag = np.abs(np.asarray(out_x, np.float64)).ravel()
fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 3.4))
a0.hist(np.minimum(d, 6), bins=np.arange(0, 6.5, 0.25), color="tab:blue")
a0.set(xlabel="|engine − exact| in bf16 ulps (6 = 6 or more)", ylabel="output elements",
       title=f"median {np.median(d):.2f} ulp, 99th percentile {np.percentile(d, 99):.1f} ulp")
a1.scatter(mag, np.maximum(d, 1e-3), s=3, alpha=0.4)
a1.set(xscale="log", yscale="log", xlabel="|exact output|", ylabel="error in ulps",
       title="the large ulp errors are the small outputs")
workshop.show(fig, "ulps")

# %% [markdown]
# ## 3. Why correct kernels disagree: the order of additions
#
# fp32 addition is not associative. A GEMM kernel sums `Kdim` products in some order:
# one long loop (v1), `BLOCK_K`-wide slabs (v2, v3), 16-wide tensor-core steps with their
# own internal order (v4), BLAS's blocking (the reference through NumPy). Each order is
# correct; they differ by a few fp32 ulps, which is invisible — until the result is
# rounded to bf16, where a value close to the midpoint between two bf16 numbers can go
# either way. Here is a GEMM of a real model's inner size, summed three ways:

# %%
KDIM, ROWS, COLS = 2048, 256, 256                                    # Qwen3-30B-A3B's H
rng = np.random.default_rng(1)
a = rng.standard_normal((ROWS, KDIM), dtype=np.float32)                  # [rows, Kdim]
w = (rng.standard_normal((COLS, KDIM)) / np.sqrt(KDIM)).astype(np.float32)  # [cols, Kdim]
loop = np.zeros((ROWS, COLS), np.float32)
for k in range(KDIM):                                                    # v1: k by k
    loop += a[:, k, None] * w[None, :, k]
slabs = np.zeros((ROWS, COLS), np.float32)
for k0 in range(0, KDIM, 16):                                            # 16-wide k steps
    slabs += a[:, k0:k0 + 16] @ w[:, k0:k0 + 16].T
orders = {"one long loop (v1)": loop, "16-wide k steps, summed in turn (like mma)": slabs,
          "BLAS sgemm (NumPy, what the reference calls)": a @ w.T}
exact_dot = a.astype(np.float64) @ w.astype(np.float64).T
rows = []
for name, c in orders.items():
    flips = np.mean(c.astype(BF16) != loop.astype(BF16))
    rows.append((name, f"{workshop.rel_err(c, exact_dot):.1e}",
                 f"{np.max(np.abs(c - loop)) / np.abs(exact_dot).max():.1e}",
                 f"{100 * flips:.2f} %"))
workshop.show_table(["fp32 summation order", "rel. error vs float64",
                     "max difference from the loop", "bf16 results that differ from the loop"],
                    rows)

# %% [markdown]
# So bit-exactness across backends is not a goal in bf16: a fraction of a percent of the
# rounded values flip by one ulp, harmlessly. What must be exact is everything that is
# *not* a rounded float: the routing ids, the alignment, which rows are written.
#
# ## 4. Where the backends differ from the reference
#
# `validate` in bf16, every backend available here. Each stage is fed the reference's
# inputs, and the yardstick is the exact answer, so the reference itself has a row: a
# backend passes if it is as close to the truth as the reference is, give or take.

# %%
report = validate(layer, x, logits, backends=BACKENDS)
rows = [r for r in report.rows if r.get("rel_err") is not None]
if not RUN.gpu:                  # the Numba kernels in the simulator: a toy layer, in bf16
    toy = FusedMoE.random(num_experts=4, top_k=2, hidden_size=16, intermediate_size=16,
                          block_size=4, params_dtype=BF16)
    tx, tl = toy.random_inputs(SIM_TOKENS)
    sim = validate(toy, tx, tl, backends=["numba"])
    rows += [dict(r, backend="numba (sim, toy)") for r in sim.rows if r.get("rel_err") is not None]

names = list(dict.fromkeys(r["backend"] for r in rows))
stages = list(STAGES) + ["end_to_end"]
fig, ax = plt.subplots(figsize=(9, 3.6))
width = 0.8 / len(names)
for i, name in enumerate(names):
    vals = {r["stage"]: r["rel_err"] for r in rows if r["backend"] == name}
    xs = [j + i * width for j, s in enumerate(stages) if s in vals]
    ys = [vals[s] for s in stages if s in vals]
    ax.bar(xs, [max(y, 1e-9) for y in ys], width, label=name)
    for x_, y in zip(xs, ys):
        if y == 0:                              # bit-exact: nothing to draw on a log axis
            ax.text(x_, 2e-9, "0", ha="center", fontsize=8)
ax.axhline(tolerance(BF16), color="k", ls="--", lw=1, label="bf16 tolerance")
ax.set(yscale="log", ylim=(1e-9, 1), ylabel="rel. error vs exact",
       xticks=[j + 0.4 - width / 2 for j in range(len(stages))], xticklabels=stages,
       title="bf16: every backend against the exact answer, stage by stage")
ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
workshop.show(fig, "backends_bf16")
print("verdict:", "OK" if report.ok else "DIVERGENCE", report.first_divergence)

# %% [markdown]
# And directly against the reference: how many of the layer's bf16 outputs does each
# backend produce bit for bit, and how far are the others?

# %%
ref_out = layer.forward(x, logits)
rows = []
for name in BACKENDS[1:]:
    try:
        got = layer.with_backend(name).forward(x, logits)
    except Exception as e:         # a backend that cannot run here: say why, go on
        rows.append((name, "-", "-", "-", f"{type(e).__name__}: {str(e)[:60]}"))
        continue
    u = ulps(got, ref_out)
    rows.append((name, f"{100 * np.mean(u == 0):.1f} %",
                 f"{100 * np.mean((u > 0) & (u <= 1)):.1f} %", f"{u.max():.1f}",
                 f"{workshop.rel_err(got, ref_out):.1e}"))
workshop.show_table(["backend", "identical to the reference", "1 ulp apart", "max ulps",
                     "rel. error vs reference"], rows)

# %% [markdown]
# Two more sources of difference a kernel writer meets:
#
# * **Transcendentals.** `expf` and `__expf`, `erff`, `tanhf` differ in the last bits; the
#   routing kernels use the accurate `expf` because a routing score that differs in the
#   last bit can swap two experts at a near-tie (`validate` counts such swaps separately,
#   as `near_ties`, and leaves those tokens out of the float comparison).
# * **Denormals.** CuPy compiles with `-ftz=true`: values below `1.2e-38` flush to zero.
#   That never matters for bf16 activations, and it can for tiny router probabilities.
#
# ## 5. Quantized experts: what is stored, where it is dequantized, what it costs
#
# The models people download ship their experts quantized: DeepSeek-V3 in fp8 blocks,
# Mixtral and Qwen3 as AWQ / GPTQ int4. A layer built with `quant_config=` (vLLM's
# `FusedMoEQuantConfig`, `sandbox/quant.py`) holds the **codes**, their **scales** and, for
# asymmetric int4, **zero points**, and never the bf16 weights. The committed checkpoints
# in `data/` load straight into it:

# %%
from sandbox import checkpoint
from sandbox import quant as Q
from sandbox.bench import card_limits, expert_bytes, floor_format, quant_expert_bytes

for folder in ("deepseek_v3_fp8", "qwen3_moe_w4a16", "qwen3_moe_gptq", "mixtral_awq"):
    q_layer = FusedMoE.from_safetensors(checkpoint.data_dir() / folder, None)
    print(f"{folder:16s} {q_layer.quant_config.describe()}")

# %% [markdown]
# What each format stores for one layer (E experts, w13 `[E, 2I, H]`, w2 `[E, H, I]`),
# here a small one (H = I = 256, 8 experts) quantized from the same bf16 weights:
#
# * **fp8 block** (DeepSeek-V3): e4m3 codes `[E, N, Kdim]`, one fp32 scale per 128 x 128
#   block `[E, N/128, Kdim/128]` (the checkpoint's `weight_scale_inv`);
# * **int8 channel** (w8a8): int8 codes, one scale per output row `[E, N]`;
# * **int4 groups** (w4a16): two codes a byte `[E, N, Kdim/2]` (low nibble first), one scale
#   per row and group of 128 along Kdim `[E, N, Kdim/128]`, and with zero points
#   (`w4a16_zp`, AWQ / GPTQ) one uint8 code a group beside them.

# %%
SIZES = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=256)
float_layer = FusedMoE.random(seed=0, params_dtype=BF16, **SIZES)
qx, qlogits = float_layer.random_inputs(32)
bf16_out = float_layer(qx, qlogits)
q_layers = {s: FusedMoE(quant_config=s, params_dtype=BF16, **SIZES).quantize_from(float_layer)
            for s in ("fp8_block", "int8_channel", "w4a16", "w4a16_zp")}
rows = []
for s, ql in q_layers.items():
    for name, p in ql.named_parameters():
        if name.startswith("w13"):
            rows.append((s, name, str(p.dtype), str(p.shape)))
workshop.show_table(["scheme", "tensor", "dtype", "shape"], rows)

# %% [markdown]
# **Where the kernel dequantizes.** The w8a8 formats (fp8, int8) quantize the activations
# too (`moe_kernel_quantize_input`: per token, or 1 x 128 groups for fp8 blocks) and
# multiply codes by codes on the tensor cores, accumulating in fp32; the scales are applied
# to the fp32 accumulator, once per K block for block scales (`a_scale[m, kb] *
# w_scale[n/128, kb]`), once at the end for per-channel ones. The weight-only formats keep
# the activations in bf16 and dequantize each weight tile in registers, `(q - zp) * s`,
# right before a bf16 mma: the codes cross HBM, bf16 values never do.
#
# **What it costs in bytes**: the floor of a decode step is the touched experts' bytes over
# the card's bandwidth. fp8 codes are half of bf16's, int4 a quarter, plus the scales (and
# zero points); `moe-sandbox bench --quant` times the layer against exactly these floors.

# %%
rows = []
H_DS, I_DS = 7168, 2048                      # DeepSeek-V3's experts, T = 1: 8 experts read
bw, _ = card_limits("NVIDIA H100 80GB HBM3")
bf16_bytes = expert_bytes(H_DS, I_DS, 2)
rows.append(("bf16", f"{bf16_bytes / 2**20:.1f}", "1.00", f"{8 * bf16_bytes / bw * 1e6:.1f}"))
for s in ("fp8_block", "int8_channel", "w4a16", "w4a16_zp"):
    nbytes = quant_expert_bytes(Q.SCHEMES[s](), H_DS, I_DS)
    rows.append((f"{s} ({floor_format(Q.SCHEMES[s]())} mma)", f"{nbytes / 2**20:.1f}",
                 f"{nbytes / bf16_bytes:.3f}", f"{8 * nbytes / bw * 1e6:.1f}"))
workshop.show_table(["format", "MiB per expert", "of bf16", "T=1 floor on an H100 (us)"],
                    rows)

# %% [markdown]
# **What it costs in error.** The quantized layer against the bf16 layer it was quantized
# from, and against its own experts dequantized (the exact answer of the codes, in float).
# vLLM's tests allow 0.035 relative for fp8, 0.065 for int8 w8a8 and 2e-2 for weight-only
# formats (`sandbox.quant.tolerance`) against a reference that quantizes the activations the
# same way (`validate`'s GEMM rows); against the float experts the w8a8 formats also carry
# their activations' rounding (fp8 blocks: a little over 0.035, inside the 2x the tests and
# `bench` allow). Against bf16 the weight rounding adds its own: int4 groups of 16 levels
# move these random weights' output by about a fifth.

# %%
rows = []
for s, ql in q_layers.items():
    exact, _ = ql.run_stages(qx, qlogits, exact=True)
    out = ql(qx, qlogits)
    rows.append((s, f"{workshop.rel_err(out, exact):.1e}", f"{Q.tolerance(ql.quant_config):g}",
                 f"{workshop.rel_err(out, bf16_out):.1e}"))
workshop.show_table(["scheme", "vs its dequantized experts", "vLLM's tolerance",
                     "vs the bf16 layer"], rows)

# %% [markdown]
# ## Exercises
#
# 1. **fp16.** Re-run section 2 with `FAMILY`'s layer in `float16`. Which mode of error
#    shrinks, by how much, and what would you watch out for with fp16 activations?
# 2. **Round less.** Compute the layer with the reference stages by hand, keeping `cache1`
#    and `cache2` in fp32 and rounding only `cache3` and the output. How much of the
#    end-to-end error was due to the intermediate roundings?
# 3. **A broken kernel.** Simulate a GEMM2 that forgets the router weight on one expert's
#    rows. What relative error does `validate` report for it — and would a tolerance of
#    `1e-1` still catch it?
# 4. **Summation order.** Find a dot product of length 4 in fp32 whose result depends on
#    the order of the additions, and one whose bf16 rounding does too.
# 5. **Zero points.** For the `w4a16` and `w4a16_zp` layers of section 5, compute the
#    relative error of the dequantized `w13` against the bf16 weights. Why do zero points
#    help, and what do they cost in bytes per expert?
#
# Solutions: `solutions/06_precision_solutions.ipynb`.
