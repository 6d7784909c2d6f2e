"""Regenerate gemm_configs.json, the grouped GEMM's config table.

    python -m cuda_kernels.cupy.tune --heuristic        # no GPU: the rule of heuristic_config
    python -m cuda_kernels.cupy.tune                    # GPU: time candidates, keep the fastest
    python -m cuda_kernels.cupy.tune --models qwen3 --buckets 1,16,256 --reps 10   # a subset
    python -m cuda_kernels.cupy.tune --versions v6 --models deepseek --buckets 128 --blocks 256
    python -m cuda_kernels.cupy.tune --bench --versions v4,v6 --tokens 1024,4096  # time, no table

The table (see gemm_configs.lookup) holds two kinds of rows, each a config for one
(version, dtype, m bucket) with m = tokens per expert = T * top_k / E:
  - generic rows (no N, K): the heuristic, one per version x dtype x bucket, used for any shape;
  - shape rows (N, K set): written here by timing, for the GEMM1 and GEMM2 shapes of the
    benchmark's models (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3); lookup uses them for
    shapes within a factor of two.

How a shape is tuned on the GPU (--versions v4 by default, or v4,v5,v6 for prefill; bf16, the
fp16 rows copy bf16's: the kernels are the same but for the mma's type): for each bucket m,
T = m * E / top_k tokens are routed uniformly at random; GEMM1 and GEMM2 must share one
alignment block_size B, so for each B in {16, 32, 64, 128} (v5: {64, 128}; v6: {64, 128,
256}; B <= 2m, past that padding only costs), the fastest GEMM1 config with BLOCK_M = B and
the fastest GEMM2 config with BLOCK_M = B are timed, and the B with the smallest sum wins. A
candidate whose output disagrees with v4's default config (relative error > 1e-2) is reported
and dropped.
Timing: the one GPU timer (cuda_kernels/timing.py): CUDA events around one call, the L2
flushed before each (a memset of twice its size, outside the events), 3 warm-ups, median of
--reps.

With two or more --versions (v4,v6 over the decode buckets, v5,v6 over the prefill ones) the
card's section also gets the rungs measured fastest (gemm_configs.default_version):
"version_by_shape", for each tuned model and bucket, the rung whose best GEMM1 + GEMM2 is the
smallest on that model (under its two GEMM shapes); "version_by_m", where two or more models
were tuned, the rung whose sum over them is the smallest, for the shapes never tuned. Each
run is appended to the section's "runs" (date, source, command). --budget-s is checked
before every candidate, so a short budget ends on time (buckets not reached keep the
generic rows: lookup uses a shape row only at its own bucket).
A two-minute run on the buckets of the
compute-bound points (the H200 misses of issue 4):
    python -m cuda_kernels.cupy.tune --versions v4,v5 --budget-s 120
(default models and buckets below: DeepSeek-V3 and Mixtral at m = 128, 256, 512, 64, 32).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import subprocess
import sys
import time

import numpy as np

from .. import timing
from . import _arrays
from . import gemm as gg
from . import gemm_configs as gcfg

# (name, E, top_k, H, I): the benchmark's models; GEMM1 is (N, K) = (2I, H), GEMM2 (H, I)
MODELS = {
    "mixtral": ("Mixtral-8x7B", 8, 2, 4096, 14336),
    "qwen3": ("Qwen3-30B-A3B", 128, 8, 2048, 768),
    "deepseek": ("DeepSeek-V3", 256, 8, 7168, 2048),
}

# v4 candidates: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Short, deep tiles for decode
# (memory-bound: many bytes in flight, many CTAs), big square ones for prefill.
V4_CANDIDATES = [
    (16, 32, 128, 2, 4), (16, 64, 64, 4, 4), (16, 64, 128, 4, 3), (16, 64, 128, 4, 4),
    (16, 64, 256, 4, 3), (16, 128, 64, 4, 4), (16, 128, 128, 4, 3),
    (32, 64, 64, 4, 4), (32, 64, 128, 4, 3), (32, 128, 64, 4, 4),
    (64, 64, 64, 4, 4), (64, 128, 32, 4, 4), (64, 128, 64, 4, 3), (64, 256, 32, 8, 3),
    (128, 64, 64, 4, 4), (128, 128, 32, 4, 4), (128, 128, 64, 4, 3), (128, 128, 32, 8, 4),
    (128, 256, 32, 8, 3),
]
# v5 candidates (wgmma): BLOCK_M 64 (one warpgroup) or 128 (two), warps = BLOCK_M / 16;
# BLOCK_K 32 or 64 (64- or 128-byte swizzle) with rings deep enough that STAGES - 2 tiles of
# copies cover the latency
V5_CANDIDATES = [
    (64, 64, 64, 4, 6), (64, 128, 32, 4, 8), (64, 128, 64, 4, 4), (64, 256, 32, 4, 6),
    (128, 128, 64, 8, 6), (128, 128, 32, 8, 8), (128, 256, 32, 8, 8), (128, 256, 64, 8, 4),
    (128, 256, 32, 8, 6), (128, 128, 64, 8, 4), (64, 256, 64, 4, 4),
]
# v6 candidates (TMA + cp.async, warp-specialized, persistent): (BLOCK_M, BLOCK_N, BLOCK_K,
# warps, stages, GROUP_M, PRODUCER_REGS). warps = 4 (producer) + 4 per consumer: 12 for two
# consumers (128 rows, or 64 rows with BLOCK_N split), 8 for one; the ring fills ~200 KB;
# GROUP_M: m tiles walked before the next n tile (the L2 reuse of a w panel; 1 where an
# expert has one m tile: a wave's CTAs then share its a rows and read its panels in order,
# measured best at DeepSeek-V3 T=4096 and Qwen3-30B-A3B T=1024 on an H100); 56 producer
# registers (40 spills at BLOCK_M 128), the consumers get 224; BLOCK_M 256 (two 64-row pieces
# a consumer, one read of a w panel for up to 256 rows of an expert) needs 80 (its producer
# thread holds 16 a rows), leaving the consumers 208; its ring is full at 4 stages (48 KB a
# stage)
V6_CANDIDATES = [
    (256, 128, 64, 12, 4, 8, 80), (256, 128, 64, 12, 4, 16, 80), (256, 128, 64, 12, 3, 8, 80),
    (256, 128, 64, 12, 4, 1, 80), (256, 128, 64, 12, 4, 4, 80), (256, 128, 64, 12, 4, 32, 80),
    (128, 256, 64, 12, 4, 8, 56), (128, 256, 64, 12, 4, 16, 56), (128, 256, 64, 12, 3, 8, 56),
    (128, 256, 64, 12, 4, 4, 56), (128, 128, 64, 12, 6, 8, 56), (128, 128, 64, 12, 6, 16, 56),
    (128, 128, 64, 12, 4, 8, 56), (64, 256, 64, 12, 5, 8, 56), (64, 256, 64, 8, 5, 8, 56),
    (128, 256, 64, 12, 4, 1, 56), (128, 256, 64, 12, 3, 1, 56), (128, 128, 64, 12, 6, 1, 56),
    (64, 128, 64, 8, 8, 8, 56), (64, 128, 64, 12, 6, 8, 56), (64, 64, 64, 8, 8, 8, 56),
    # decode (a few rows per expert, B = 64): the weights stream through a deep TMA ring on a
    # persistent grid, so the tiles are short in M and the rings 4-8 stages deep
    (64, 256, 64, 8, 4, 8, 56), (64, 256, 64, 12, 4, 1, 56), (64, 128, 64, 8, 6, 1, 56),
    (64, 128, 64, 12, 8, 1, 56), (64, 64, 64, 8, 8, 1, 56),
]
CANDIDATES = {"v4": V4_CANDIDATES, "v5": V5_CANDIDATES, "v6": V6_CANDIDATES}
# the config keys of a candidate tuple, in order
CANDIDATE_KEYS = {"v4": gcfg.CONFIG_KEYS, "v5": gcfg.CONFIG_KEYS,
                  "v6": gcfg.CONFIG_KEYS + gcfg.V6_EXTRA_KEYS}
BLOCK_SIZES = {"v4": (16, 32, 64, 128), "v5": (64, 128), "v6": (64, 128, 256)}
# the buckets and models of issue 4's missed points, the worst first (DeepSeek-V3 m = 128,
# 512, 32 are T = 4096, 16384, 1024; Mixtral m = 256, 64 are T = 1024, 256)
DEFAULT_BUCKETS = (128, 256, 512, 64, 32)
DEFAULT_MODELS = ("deepseek", "mixtral")
BEST_BY_VERSION: dict = {}   # (model, m, version) -> seconds of the best GEMM1 + GEMM2


def heuristic_table() -> dict:
    """The generic rows: heuristic_config for every version, dtype and bucket."""
    rows = []
    for v in gcfg.VERSIONS:
        for dkey in gcfg.DTYPE_KEYS:
            if v in gcfg.TENSOR_CORE_VERSIONS and dkey == "fp32":
                continue
            for b in gcfg.M_BUCKETS:
                cfg = gcfg.heuristic_config(v, dkey, b)
                rows.append({"version": v, "dtype": dkey, "m": b, **cfg})
    return {
        "_doc": "Grouped GEMM configs: see cuda_kernels/cupy/gemm_configs.py (lookup) and "
                "tune.py. m = tokens per expert bucket; rows without N, K apply to any shape; "
                "BLOCK_M is the alignment block_size the caller should use. default_version: "
                "the rung used when none is named; devices[card name]: the rows tuned on that "
                "card, its version_by_shape and version_by_m (the measured fastest rung per "
                "tuned shape, per bucket), read first on that card.",
        "source": "generic rows: the heuristic (gemm_configs.heuristic_config), not timed; "
                  "each card's timed rows and rung per bucket: its section under devices",
        "default_version": dict(gcfg.BUILTIN_DEFAULTS),
        "m_buckets": list(gcfg.M_BUCKETS),
        "configs": rows,
    }


def write_table(table: dict, path: pathlib.Path = gcfg.CONFIG_PATH) -> None:
    """One row per line (the cards' sections too): the table stays readable, diffs small."""
    def rows_block(rows, indent):
        pad = " " * indent
        lines = [f"{pad}{json.dumps(r)}," for r in rows]
        if lines:
            lines[-1] = lines[-1][:-1]
        return lines

    head = {k: v for k, v in table.items() if k not in ("configs", "devices")}
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append('  "configs": [')
    lines += rows_block(table["configs"], 4)
    devices = table.get("devices", {})
    lines.append("  ]," if devices else "  ]")
    if devices:
        lines.append('  "devices": {')
        for i, (name, sec) in enumerate(devices.items()):
            lines.append(f"    {json.dumps(name)}: {{")
            for k, v in sec.items():
                if k != "configs":
                    lines.append(f"      {json.dumps(k)}: {json.dumps(v)},")
            lines.append('      "configs": [')
            lines += rows_block(sec.get("configs", []), 8)
            lines.append("      ]")
            lines.append("    }," if i + 1 < len(devices) else "    }")
        lines.append("  }")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n")
    gcfg.load_table.cache_clear()
    gg._plan.cache_clear()


# ----------------------------------------------------------------------------- GPU timing
def _align_gpu(cp, topk_ids, block_size, num_experts):
    """moe_align_block_size on the GPU with CuPy primitives (the tuner needs only a valid one).

    Slots grouped by expert (stable in s), each expert padded to a multiple of B with P.
    """
    P = topk_ids.size
    flat = topk_ids.ravel().astype(cp.int32)
    counts = cp.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    ends = cp.cumsum(padded)
    starts = ends - padded
    order = cp.argsort(flat.astype(cp.int64) * P + cp.arange(P))   # unique keys: stable in s
    sorted_e = flat[order]
    cstart = cp.cumsum(counts) - counts
    pos = starts[sorted_e] + (cp.arange(P) - cstart[sorted_e])
    max_padded = P + num_experts * (block_size - 1)
    if P < num_experts:
        max_padded = min(max_padded, P * block_size)
    sorted_ids = cp.full(max_padded, P, dtype=cp.int32)
    sorted_ids[pos] = order.astype(cp.int32)
    nblocks = -(-max_padded // block_size)
    block_start = cp.arange(nblocks) * block_size
    expert_ids = cp.searchsorted(ends, block_start, side="right").astype(cp.int32)
    total = ends[-1:].astype(cp.int32)
    expert_ids[block_start >= total[0]] = -1
    return sorted_ids, expert_ids, total


def _rel_err(cp, got, want) -> float:
    g, w_ = gg._as_f32(got), gg._as_f32(want)
    den = float(cp.linalg.norm(w_))
    err = float(cp.linalg.norm(g - w_)) / max(den, 1e-30)
    return err if np.isfinite(err) else float("inf")


def tune(models, buckets, reps, dkey="bf16", budget_s=1800.0, versions=("v4",),
         log=print, blocks=None) -> list[dict]:
    """Shape rows for `versions` (and their fp16 copies) from timing on the current GPU;
    `blocks`: only these alignment blocks B (default: each version's BLOCK_SIZES).

    Every candidate's output is first compared with the default rung's (v4 with its
    heuristic config, which the GPU tests validate against the reference): a candidate that
    disagrees (relative error > 1e-2, or NaN) is logged and never chosen."""
    import cupy as cp

    dt = {"bf16": _arrays.bf16_dtype(), "fp16": np.dtype(np.float16)}[dkey]
    api = timing.CudaApi("cupy")
    rng = cp.random.default_rng(0)
    rows, t_start = [], time.time()
    for key in models:
        name, E, top_k, H, I = MODELS[key]  # noqa: E741
        # one set of weights per model, filled expert by expert (no fp32 copy of all of them)
        w13 = gg.random_device((E, 2 * I, H), dt, 1 / math.sqrt(H), rng)
        w2 = gg.random_device((E, H, I), dt, 1 / math.sqrt(I), rng)
        for version, m in [(v, m) for m in buckets for v in versions]:
            if time.time() - t_start > budget_s:
                log(f"budget of {budget_s:.0f} s spent: stopping before {name} m={m}")
                return rows
            T = max(1, int(round(m * E / top_k)))
            x = gg.random_device((T, H), dt, 1.0, rng)
            act = gg.random_device((T * top_k, I), dt, 1.0, rng)
            ids = cp.argsort(rng.random((T, E)), axis=1)[:, :top_k].astype(cp.int32)
            best = None
            smallest = BLOCK_SIZES[version][0]
            for B in BLOCK_SIZES[version]:
                if B > max(smallest, 2 * m) or (blocks and B not in blocks):
                    continue
                st, ex, nt = _align_gpu(cp, ids, B, E)
                per_gemm = []
                for (a, w, tk, N, K) in ((x, w13, top_k, 2 * I, H), (act, w2, 1, H, I)):
                    timed = []
                    want = gg.grouped_gemm(a, w, st, ex, nt, tk, B, version="v4")
                    for cand in CANDIDATES[version]:
                        if cand[0] != B:
                            continue
                        if time.time() - t_start > budget_s:
                            break
                        cfg = dict(zip(CANDIDATE_KEYS[version], cand))
                        try:
                            gcfg.check_config(version, dkey, cfg)

                            def fn(a=a, w=w, tk=tk, cfg=cfg, st=st, ex=ex, nt=nt, B=B,
                                   v=version):
                                return gg.grouped_gemm(a, w, st, ex, nt, tk, B, version=v,
                                                       config=cfg)
                            err = _rel_err(cp, fn(), want)
                            if err > 1e-2:
                                log(f"  WRONG {version} {cand}: relative error {err:.2e} against "
                                    f"v4's default: not a candidate")
                                continue
                            t = timing.time_cuda(fn, warmup=3, reps=reps, api=api).median
                            timed.append((t * 1e-3, cand))
                        except Exception as e:  # a config that does not fit this GPU
                            log(f"  skip {version} {cand}: {type(e).__name__}: {str(e)[:120]}")
                    if not timed:
                        break
                    per_gemm.append(min(timed))
                if len(per_gemm) != 2:
                    continue
                total = per_gemm[0][0] + per_gemm[1][0]
                log(f"{name:14s} {version} m={m:5d} T={T:6d} B={B:3d} gemm1 "
                    f"{per_gemm[0][0]*1e6:9.1f} us {per_gemm[0][1]}  gemm2 "
                    f"{per_gemm[1][0]*1e6:9.1f} us {per_gemm[1][1]}")
                if best is None or total < best[0]:
                    best = (total, per_gemm)
            if best is None:
                continue
            BEST_BY_VERSION[(key, m, version)] = best[0]
            for (t, cand), (N, K) in zip(best[1], ((2 * I, H), (H, I))):
                for dk in (dkey, "fp16" if dkey == "bf16" else "bf16"):
                    rows.append({"version": version, "dtype": dk, "m": m, "N": N, "K": K,
                                 **dict(zip(CANDIDATE_KEYS[version], cand)),
                                 "us": round(t * 1e6, 1), "model": name})
        del w13, w2
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def version_by_m(best_by_version: dict, dkey: str = "bf16") -> dict:
    """{dtype: {str(m): version}}: for each bucket where two or more rungs were timed on the
    same two or more models, the rung whose GEMM1 + GEMM2 summed over those models is the
    smallest (the rung is chosen by measurement on the card, bucket by bucket). A run of one
    model leaves the buckets alone: their rung speaks for every model (its shapes get theirs
    from `version_by_shape`)."""
    out = {}
    for m in sorted({m for (_, m, _) in best_by_version}):
        versions = sorted({v for (_, mm, v) in best_by_version if mm == m})
        models = [k for k in sorted({k for (k, mm, _) in best_by_version if mm == m})
                  if all((k, m, v) in best_by_version for v in versions)]
        if len(versions) < 2 or len(models) < 2:
            continue
        total = {v: sum(best_by_version[(k, m, v)] for k in models) for v in versions}
        out[str(m)] = min(versions, key=lambda v: total[v])
    return _both_half_types(out, dkey)


def version_by_shape(best_by_version: dict, dkey: str = "bf16") -> dict:
    """{dtype: {'m,N,K': version}}: for each model and bucket where two or more rungs were
    timed, the rung whose GEMM1 + GEMM2 is the smallest on that model, under the shapes of
    both its GEMMs (gemm_configs.shape_key). One rung for both: they share the alignment
    block, whose size GEMM1's config sets."""
    out = {}
    for key, m in sorted({(k, m) for (k, m, _) in best_by_version}):
        times = {v: t for (k, mm, v), t in best_by_version.items() if (k, mm) == (key, m)}
        if len(times) < 2:
            continue
        _, _, _, H, I = MODELS[key]  # noqa: E741
        for N, K in ((2 * I, H), (H, I)):
            out[gcfg.shape_key(m, N, K)] = min(sorted(times), key=lambda v: times[v])
    return _both_half_types(out, dkey)


def _both_half_types(choices: dict, dkey: str) -> dict:
    """The rungs timed on one half type apply to the other (the same kernels, the same
    bytes)."""
    if not choices:
        return {}
    return {dkey: choices, ("fp16" if dkey == "bf16" else "bf16"): dict(choices)}


def merge_device_section(table: dict, device: str, rows: list[dict], by_m: dict,
                         meta: dict, by_shape: dict | None = None) -> dict:
    """Put the rows tuned on `device` into its section of the table: a new row replaces the
    one of the same (version, dtype, m, N, K); the buckets of `by_m` and the shapes of
    `by_shape` replace those of the section's version_by_m and version_by_shape. The
    section's "runs" list records where its numbers came from: `meta` (date, source,
    command) is appended, so that a run that re-tunes a few buckets does not erase the
    provenance of the others."""
    sec = table.setdefault("devices", {}).setdefault(device, {})
    key = (lambda r: (r["version"], r["dtype"], r["m"], r.get("N"), r.get("K")))
    new = {key(r) for r in rows}
    sec["configs"] = [r for r in sec.get("configs", []) if key(r) not in new] + rows
    for name, choices in (("version_by_m", by_m), ("version_by_shape", by_shape or {})):
        merged = sec.get(name, {})
        for dk, picks in choices.items():
            merged.setdefault(dk, {}).update(picks)
        if merged:
            sec[name] = merged
    runs = sec.setdefault("runs", [])
    legacy = {k: sec.pop(k) for k in ("date", "source", "command") if k in sec}
    if legacy:      # a section written before "runs" kept one run's provenance at its top
        runs.insert(0, legacy)
    if meta:
        runs.append(dict(meta))
    return table


# ----------------------------------------------------------------------------- the GEMM bench
# HBM bandwidth of the cards whose datasheets this module knows (the first fragment found in
# the device name wins: the PCIe / NVL parts come first); the decode floor is the touched
# experts' weight bytes over it. Another card gets no floor.
CARD_HBM_BYTES_PER_S = (("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12),
                        ("H200", 4.8e12))


def card_bandwidth(device_name) -> float | None:
    """Datasheet HBM bytes/s of a card by its name, None when unknown."""
    name = device_name.decode() if isinstance(device_name, bytes) else str(device_name or "")
    for fragment, bandwidth in CARD_HBM_BYTES_PER_S:
        if fragment.lower() in name.lower():
            return bandwidth
    return None


# vLLM's Triton fused_moe_kernel, both GEMMs of a layer (ms, bf16, one H100, kernels only,
# measured 2026-12-06 for issue 40): the layer lines of decode_bench give the ratio to it
VLLM_H100_LAYER_MS = {("Mixtral-8x7B", 4096): 5.66, ("Mixtral-8x7B", 16384): 22.2,
                      ("Qwen3-30B-A3B", 1024): 0.46, ("Qwen3-30B-A3B", 4096): 0.77,
                      ("Qwen3-30B-A3B", 16384): 2.56, ("DeepSeek-V3", 16384): 25.9}


def _v6_label(cfg: dict) -> str:
    return (f"v6 {cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['warps']} s{cfg['stages']} "
            f"g{cfg['GROUP_M']} p{cfg['PRODUCER_REGS']}")


def decode_bench(cp, models, tokens, versions=("v4",), reps=20, sweep=False,
                 dkey="bf16", budget_s=480.0, log=print, seed=0) -> list[dict]:
    """Time GEMM1 and GEMM2 of `models` ({key: (name, E, top_k, H, I)}, MODELS) at each T
    of `tokens` for every version (and, with sweep and v6 in `versions`, every
    V6_CANDIDATES config, each aligned to its own BLOCK_M).

    Each rep routes the T tokens anew (uniform: top_k distinct experts per token, drawn on the
    GPU, aligned outside the timing with each version's block size), flushes L2 (twice its size,
    a memset) and times one call with CUDA events; the median is reported. Each version is first
    checked against v4 on the first routing (relative Frobenius error <= 1e-2, else FAIL).
    GB/s counts the touched experts' weights, a and c once; "floor" is the touched weight bytes
    over the card's datasheet bandwidth divided by the time (the fraction of the floor reached);
    TF/s the 2 P N Kdim flops of the live slots over the time. A layer line (GEMM1 + GEMM2)
    gives the ratio to vLLM's time where issue 40 measured it (VLLM_H100_LAYER_MS, an H100)
    and whether it is 10% under it. Returns one dict per (model, T, GEMM or "layer", label)."""
    dt = {"bf16": _arrays.bf16_dtype(), "fp16": np.dtype(np.float16)}[dkey]
    dev = cp.cuda.Device().id
    card = cp.cuda.runtime.getDeviceProperties(dev)["name"]
    card = card.decode() if isinstance(card, bytes) else str(card)
    env = dict(cp=cp, dt=dt, bw=card_bandwidth(card), reps=reps, log=log,
               api=timing.CudaApi("cupy"), deadline=time.time() + budget_s)
    bw = env["bw"]
    rng = cp.random.default_rng(seed)
    log(f"{'model':8s} {'gemm':5s} {'T':>5s} {'version / config':34s} {'us':>9s} {'GB/s':>7s} "
        f"{'floor':>6s} {'TF/s':>6s} {'rel err':>8s}  (card: {card}, floor at "
        f"{'?' if bw is None else f'{bw / 1e12:.2f} TB/s'})")
    results = []
    for key in models:
        name, E, top_k, H, I = models[key]  # noqa: E741
        w13 = gg.random_device((E, 2 * I, H), dt, 1 / math.sqrt(H), rng)     # [E, 2I, H]
        w2 = gg.random_device((E, H, I), dt, 1 / math.sqrt(I), rng)           # [E, H, I]
        for T in tokens:
            pt = _decode_point(cp, rng, dt, name, T, E, top_k, H, I, reps)
            timed = []
            for gemm, a, w, tk, N, K, mul in (("gemm1", pt["x"], w13, top_k, 2 * I, H, False),
                                              ("gemm2", pt["act"], w2, 1, H, I, True)):
                timed += _decode_gemm(env, pt, gemm, a, w, tk, N, K, mul, versions, sweep)
            results += timed
            results += _decode_layer(env, pt, timed, H, I)
        del w13, w2
        cp.get_default_memory_pool().free_all_blocks()
    return results


def _median(xs) -> float:
    return float(np.median(np.asarray(xs, dtype=np.float64)))


def _decode_point(cp, rng, dt, name, T, E, top_k, H, I, reps) -> dict:  # noqa: E741
    """One (model, T): the inputs and `reps` routings (aligned per block size on demand)."""
    P = T * top_k
    routings = [cp.argsort(rng.random((T, E)), axis=1)[:, :top_k].astype(cp.int32)
                for _ in range(reps)]                                      # reps x [T, top_k]
    return dict(name=name, T=T, E=E, top_k=top_k, P=P, routings=routings, aligned={},
                touched=[int(cp.unique(r).size) for r in routings],
                x=gg.random_device((T, H), dt, 1.0, rng),                     # [T, H]
                act=gg.random_device((P, I), dt, 1.0, rng),                   # [P, I]
                tw=rng.random(P, dtype=cp.float32) + cp.float32(0.05))     # [P]


def _decode_gemm(env, pt, gemm, a, w, tk, N, K, mul, versions, sweep) -> list[dict]:
    """decode_bench's lines for one GEMM of one (model, T)."""
    cp, dt, log, bw, reps = env["cp"], env["dt"], env["log"], env["bw"], env["reps"]
    itemsize = dt.itemsize
    wbytes = [n * N * K * itemsize for n in pt["touched"]]
    other = itemsize * (a.shape[0] * K + pt["P"] * N)
    out = _arrays.empty((pt["P"], N), dt)
    head = f"{pt['name'][:8]:8s} {gemm:5s} {pt['T']:5d}"
    flops = gg.gemm_flops(pt["P"], N, K)

    def call(v, cfg, r):
        B = (cfg or gcfg.get_config(pt["T"], N, K, pt["E"], pt["top_k"], dt, v))["BLOCK_M"]
        if B not in pt["aligned"]:
            pt["aligned"][B] = [_align_gpu(cp, ids, B, pt["E"]) for ids in pt["routings"]]
        st, ex, nt = pt["aligned"][B][r]
        return gg.grouped_gemm(a, w, st, ex, nt, tk, B, pt["tw"], mul, version=v, config=cfg,
                            out=out)

    want = call("v4", None, 0).copy()
    results = []

    def timed(label, v, cfg):
        if time.time() > env["deadline"]:
            return None
        try:
            err = _rel_err(cp, call(v, cfg, 0), want)
            warm, r = min(3, reps), [0]

            def rotate(i):     # the warm-ups on the first routings, then rep k on routing k
                r[0] = i if i < warm else i - warm
            times = [ms * 1e-3 for ms in timing.cuda_samples(
                lambda: call(v, cfg, r[0]), warmup=warm, reps=reps, rotate=rotate,
                api=env["api"])]
        except Exception as e:  # a config this card cannot run: reported, skipped
            log(f"{head} {label:34s} skip: {type(e).__name__}: {str(e)[:100]}")
            return None
        t = _median(times)
        gbs = _median([(wb + other) / s / 1e9 for wb, s in zip(wbytes, times)])
        frac = _median([wb / bw / s for wb, s in zip(wbytes, times)]) if bw else None
        ok = err <= 1e-2
        log(f"{head} {label:34s} {t * 1e6:9.1f} {gbs:7.0f} "
            f"{'' if frac is None else f'{frac:6.1%}':>6s} {flops / t / 1e12:6.1f} "
            f"{err:8.1e}{'' if ok else '  FAIL'}")
        res = dict(model=pt["name"], gemm=gemm, T=pt["T"], label=label, version=v, config=cfg,
                   us=t * 1e6, gbs=gbs, floor_fraction=frac, tflops=flops / t / 1e12,
                   rel_err=err, ok=ok, touched=_median(pt["touched"]))
        results.append(res)
        return res

    for v in versions:
        timed(v, v, None)
    if sweep and "v6" in versions:
        best = None
        for cand in V6_CANDIDATES:
            cfg = dict(zip(CANDIDATE_KEYS["v6"], cand))
            res = timed(_v6_label(cfg), "v6", cfg)
            if res is not None and res["ok"] and (best is None or res["us"] < best["us"]):
                best = res
        if best is not None:
            log(f"{head} best v6 candidate: {best['label']} {best['us']:.1f} us "
                f"{best['tflops']:.1f} TFLOP/s")
    return results


def _decode_layer(env, pt, timed, H, I) -> list[dict]:  # noqa: E741
    """GEMM1 + GEMM2 of one (model, T) for every label timed on both."""
    bw, itemsize = env["bw"], env["dt"].itemsize
    floors = [n * (2 * I * H + H * I) * itemsize / bw for n in pt["touched"]] if bw else None
    by_label: dict = {}
    for r in timed:
        by_label.setdefault(r["label"], {})[r["gemm"]] = r["us"]
    out = []
    flops = gg.gemm_flops(pt["P"], 2 * I, H) + gg.gemm_flops(pt["P"], H, I)
    vllm_ms = VLLM_H100_LAYER_MS.get((pt["name"], pt["T"]))
    for label, us in by_label.items():
        if len(us) != 2:
            continue
        t = (us["gemm1"] + us["gemm2"]) * 1e-6
        frac = _median(floors) / t if floors else None
        vs = "" if vllm_ms is None else \
            (f"  {vllm_ms * 1e-3 / t:5.2f}x vLLM's {vllm_ms:.2f} ms (H100), target "
             f"{vllm_ms / 1.1:.2f} ms: {'MET' if t * 1e3 <= vllm_ms / 1.1 else 'missed'}")
        env["log"](f"{pt['name'][:8]:8s} layer {pt['T']:5d} {label:34s} {t * 1e6:9.1f} {'':7s} "
                   f"{'' if frac is None else f'{frac:6.1%}':>6s} {flops / t / 1e12:6.1f}{vs}")
        out.append(dict(model=pt["name"], gemm="layer", T=pt["T"], label=label, us=t * 1e6,
                        floor_fraction=frac, tflops=flops / t / 1e12,
                        vllm_h100_ms=vllm_ms))
    return out


def _blocks_arg(text):
    """--blocks: None (every B) or a set of alignment blocks, each one some rung takes."""
    if not text:
        return None
    takes = {b for bs in BLOCK_SIZES.values() for b in bs}
    blocks = {int(b) for b in text.split(",")}
    if not blocks <= takes:
        raise SystemExit(f"--blocks: expected alignment blocks among {sorted(takes)}, "
                         f"got {text!r}")
    return blocks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heuristic", action="store_true", help="write the untimed table (no GPU)")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--buckets", default=",".join(map(str, DEFAULT_BUCKETS)))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=1800.0)
    p.add_argument("--versions", default="v4", help="rungs to tune: v4, v5 or v4,v5")
    p.add_argument("--blocks", default=None,
                   help="only these alignment blocks B, e.g. 256 (default: every B a rung takes)")
    p.add_argument("--out", default=str(gcfg.CONFIG_PATH))
    p.add_argument("--bench", action="store_true",
                   help="time GEMM1 and GEMM2 of --models at --tokens for --versions (decode_bench)"
                        " instead of tuning; nothing is written but --json")
    p.add_argument("--tokens", default="1,16,64", help="--bench: the T values")
    p.add_argument("--sweep", action="store_true",
                   help="--bench: also v6's candidates (when v6 is in --versions)")
    p.add_argument("--json", default=None, help="--bench: write the results to this file")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = p.parse_args(argv)
    if args.bench:
        return _bench_main(args)
    table = heuristic_table()
    try:   # the generic rows are regenerated; the cards' sections and defaults are kept
        old = json.loads(pathlib.Path(args.out).read_text())
        table["default_version"].update(old.get("default_version", {}))
        if old.get("devices"):
            table["devices"] = old["devices"]
    except (OSError, ValueError):
        pass
    if not args.heuristic:
        ok, why = _arrays.availability()
        if not ok:
            raise SystemExit(f"tuning needs a GPU: {why} (use --heuristic)")
        rows = tune(args.models.split(","), [int(b) for b in args.buckets.split(",")], args.reps,
                    budget_s=args.budget_s, versions=tuple(args.versions.split(",")),
                    blocks=_blocks_arg(args.blocks))
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, cwd=pathlib.Path(__file__).parent).stdout.strip()
        except OSError:
            commit = None
        by_m = version_by_m(BEST_BY_VERSION)
        by_shape = version_by_shape(BEST_BY_VERSION)
        device = gcfg.current_device_name()
        merge_device_section(table, device, rows, by_m, {
            "source": f"timed by tune.py ({args.versions}, commit {commit})",
            "date": datetime.date.today().isoformat(),
            "command": " ".join([sys.executable, "-m", "cuda_kernels.cupy.tune"] +
                                list(argv if argv is not None else sys.argv[1:]))},
            by_shape)
        print(f"{device}: version_by_m {by_m}, version_by_shape {by_shape} (times: "
              f"{ {f'{k} m={m} {v}': round(t * 1e6) for (k, m, v), t in BEST_BY_VERSION.items()} }"
              f" us)")
    write_table(table, pathlib.Path(args.out))
    n_dev = sum(len(sec.get("configs", [])) for sec in table.get("devices", {}).values())
    print(f"wrote {len(table['configs'])} generic rows and {n_dev} card rows to {args.out}")


def _bench_main(args) -> int:  # pragma: no cover - needs a GPU
    import cupy as cp

    ok, why = _arrays.availability()
    if not ok:
        raise SystemExit(f"the bench needs a GPU: {why}")
    models = {k: MODELS[k] for k in args.models.split(",")}
    res = decode_bench(cp, models, [int(x) for x in args.tokens.split(",")],
                       tuple(args.versions.split(",")), args.reps, args.sweep, args.dtype,
                       args.budget_s)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    bad = [r for r in res if r.get("ok") is False]
    print("ok" if not bad else f"{len(bad)} check(s) FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
