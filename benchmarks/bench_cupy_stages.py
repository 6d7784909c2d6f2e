"""The CuPy kernels around the GEMMs, stage by stage, on real MoE shapes (H200, bf16).

    T tokens, E experts, K top-k, H hidden, I intermediate, B block size, P = T*K slots

Stages (cuda_kernels/cupy), for Mixtral-8x7B (E=8, K=2, H=4096, I=14336), Qwen3-30B-A3B
(E=128, K=8, H=2048, I=768) and DeepSeek-V3 (E=256, K=8, H=7168, I=2048; grouped routing:
8 groups, topk_group 4, sigmoid + correction bias, scaling 2.5) at T in
{1, 16, 64, 256, 1024, 4096, 16384}:

    route       fused_topk (softmax, renormalize) | grouped_topk (DeepSeek-V3)
                bytes = T E 2 (bf16 logits) + T K 8 (weights, ids) [+ E 4 bias]
    align       moe_align_block_size(topk_ids, B, E)
                bytes = 4 (P + max_num_tokens_padded + cdiv(max_num_tokens_padded, B) + 1)
    permute     moe_permute(x [T, H], topk_ids, E)
                bytes = 2 (T H + P H) + 8 P + 4 (E + 1)
    activation  silu_and_mul(x [P, 2I])          bytes = 2 (P 2I + P I)
    unpermute   moe_unpermute(y [P, H], topk_weights, inv_permuted_idx)
                bytes = 2 (P H + T H) + 8 P
    combine     moe_sum(x [T, K, H])             bytes = 2 (T K H + T H)

Method: the one GPU timer (cuda_kernels/timing.py): CUDA events around one call, after
warm-up. Before every repetition (outside the events) the routing is re-drawn (fresh N(0, 1)
logits, routed by this backend's own kernel for the stages that take topk_ids) and the 50 MB
L2 is flushed (a memset of twice its size), so no repetition finds its inputs in cache.
Two figures per point:
    device   a spin kernel keeps the GPU busy while Python enqueues the call, so the events
             bracket only the GPU work of the stage (its kernels, back to back)
    eager    the queue is idle when the call starts: the events also see the Python and
             launch overhead of the call, as an eager caller pays it
median, p20 and p80 of each; GB/s = bytes / device median.

    python benchmarks/bench_cupy_stages.py [--models deepseek-v3] [--tokens 1,4096]
                                           [--stages route,align] [--reps 30] [--block-size 64]

Writes ./moe-sandbox-results/bench_cupy_stages_<gpu>_<time>.json, or into --out-dir (GPU,
date, commit, command, every point), and prints a table, then the issue's target: route and align each under
25 us at T=4096, E=256, top-8.
"""
from __future__ import annotations

import argparse
import datetime
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cuda_kernels import timing
from cuda_kernels.cupy import _arrays as A
from cuda_kernels.cupy._geometry import cdiv
from sandbox import bench

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")
STAGES = ("route", "align", "permute", "activation", "unpermute", "combine")
TARGET_US = 25.0


def _bf16_randn(cp, shape, scale=1.0):
    """N(0, scale^2) in bf16, drawn on the GPU (fp32, rounded to nearest even by bits)."""
    x = cp.random.standard_normal(shape, dtype=cp.float32)
    if scale != 1.0:
        x *= np.float32(scale)
    u = x.view(cp.uint32)
    b = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(cp.uint16)
    return b.view(A.bf16_dtype())


class Point:
    """The inputs of one (model, T) point; `redraw()` re-routes fresh logits."""

    def __init__(self, cp, ck, preset, T, B):
        self.cp, self.ck, self.p, self.T, self.B = cp, ck, preset, T, B
        E, K, H, inter = preset.num_experts, preset.top_k, preset.hidden_size, \
            preset.intermediate_size
        self.bias = (cp.random.standard_normal(E, dtype=cp.float32) * np.float32(0.1))
        self.redraw()
        P = T * K
        self.x = _bf16_randn(cp, (T, H))                                   # [T, H]
        self.gemm1_out = None
        self.y = None
        self.x_sum = None
        self.shapes = {"P": P, "E": E, "K": K, "H": H, "I": inter}

    def route(self):
        return bench.route_preset(self.ck, self.p, self.logits, self.bias)

    def redraw(self):
        self.logits = _bf16_randn(self.cp, (self.T, self.p.num_experts))   # [T, E]
        self.topk_weights, self.topk_ids = self.route()                    # [T, K] x 2
        self.inv = None

    def dense(self, name):
        """The big dense inputs, drawn once per point (the L2 flush keeps them cold)."""
        cp, T, K, H, inter = self.cp, self.T, self.p.top_k, self.p.hidden_size, \
            self.p.intermediate_size
        if name == "activation" and self.gemm1_out is None:
            self.gemm1_out = _bf16_randn(cp, (T * K, 2 * inter))           # [P, 2I]
        if name == "unpermute" and self.y is None:
            self.y = _bf16_randn(cp, (T * K, H))                            # [P, H]
        if name == "combine" and self.x_sum is None:
            self.x_sum = _bf16_randn(cp, (T, K, H))                         # [T, K, H]

    def free(self):
        self.gemm1_out = self.y = self.x_sum = None


def stage_call(pt: Point, stage: str):
    """(fn, bytes) of one stage at this point; fn reads pt's current routing."""
    ck, T, B = pt.ck, pt.T, pt.B
    E, K, H, inter, P = (pt.shapes[k] for k in ("E", "K", "H", "I", "P"))
    if stage == "route":
        nbytes = T * E * 2 + T * K * 8 + (E * 4 if pt.p.name in bench.GROUPED_ROUTING else 0)
        return pt.route, nbytes
    if stage == "align":
        from reference import max_num_tokens_padded

        n = max_num_tokens_padded(P, B, E)
        nbytes = 4 * (P + n + cdiv(n, B) + 1)
        return (lambda: ck.moe_align_block_size(pt.topk_ids, B, E)), nbytes
    if stage == "permute":
        nbytes = 2 * (T * H + P * H) + 8 * P + 4 * (E + 1)
        return (lambda: ck.moe_permute(pt.x, pt.topk_ids, E)), nbytes
    if stage == "activation":
        pt.dense("activation")
        return (lambda: ck.silu_and_mul(pt.gemm1_out)), 2 * (P * 2 * inter + P * inter)
    if stage == "unpermute":
        pt.dense("unpermute")
        # pt.inv: the permutation of the current routing, made by the setup (outside the events)
        return (lambda: ck.moe_unpermute(pt.y, pt.topk_weights, pt.inv)), \
            2 * (P * H + T * H) + 8 * P
    if stage == "combine":
        pt.dense("combine")
        return (lambda: ck.moe_sum(pt.x_sum)), 2 * (T * K * H + T * H)
    raise ValueError(f"stage: expected one of {STAGES}, got {stage!r}")


def time_point(api, pt, stage, reps, warmup):
    fn, nbytes = stage_call(pt, stage)

    def redraw(i):
        pt.redraw()
        if stage == "unpermute":
            pt.inv = pt.ck.moe_permute(pt.x, pt.topk_ids, pt.p.num_experts)[2]

    def us(mode, warm):   # the one GPU timer; the L2 is flushed after every redraw
        return bench.summarize(ms * 1e3 for ms in timing.cuda_samples(
            fn, warm, reps, rotate=redraw, mode=mode, spin_us=SPIN_US, api=api))

    d, e = us("device", warmup), us("eager", 0)
    return {"stage": stage, "bytes": nbytes,
            "device_us": d.as_dict(), "eager_us": e.as_dict(),
            "gbps": nbytes / (d.median * 1e-6) / 1e9 if d.median > 0 else None}


# longer than the host needs to enqueue any one stage call
SPIN_US = 200


def run(models, tokens, stages, reps, warmup, B, budget_s, log=print):
    import cupy as cp

    import cuda_kernels.cupy as ck

    api = timing.CudaApi("cupy")
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    record = {"benchmark": "bench_cupy_stages", "card": {"gpu": gpu},
              "dtype": "bfloat16", "block_size": B, "reps": reps, "warmup": warmup,
              "method": "CUDA events (cuda_kernels/timing.py); routing re-drawn and L2 "
                        "flushed (a memset of twice its size) before every repetition; device "
                        "= spin kernel ahead of the call, eager = idle queue", "points": []}
    t0 = time.time()
    for name in models:
        preset = bench.PRESETS[name]
        for T in tokens:
            if time.time() - t0 > budget_s:
                log(f"budget of {budget_s} s spent: stopping before {name} T={T}")
                record["truncated"] = True
                return record, time.time() - t0
            cp.random.seed(T)
            pt = Point(cp, ck, preset, T, B)
            for stage in stages:
                try:
                    res = time_point(api, pt, stage, reps, warmup)
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    res = {"stage": stage, "error": f"{type(e).__name__}: {e}"[:300]}
                res.update(model=name, T=T, E=preset.num_experts, K=preset.top_k,
                           H=preset.hidden_size, I=preset.intermediate_size)
                record["points"].append(res)
                log(row(res))
            pt.free()
            cp.get_default_memory_pool().free_all_blocks()
    return record, time.time() - t0


def header() -> str:
    return (f"{'model':14s} {'T':>6s} {'stage':10s} {'device us':>10s} {'p20':>8s} {'p80':>8s} "
            f"{'eager us':>9s} {'GB/s':>8s}")


def row(p) -> str:
    if "error" in p:
        return f"{p['model']:14s} {p['T']:6d} {p['stage']:10s} ERROR {p['error']}"
    d, e = p["device_us"], p["eager_us"]
    return (f"{p['model']:14s} {p['T']:6d} {p['stage']:10s} {d['median']:10.1f} {d['p20']:8.1f} "
            f"{d['p80']:8.1f} {e['median']:9.1f} {p['gbps'] or 0:8.1f}")


def target_lines(record) -> list[str]:
    lines = []
    for stage in ("route", "align"):
        hit = [p for p in record["points"] if p["model"] == "deepseek-v3" and p["T"] == 4096
               and p["stage"] == stage and "error" not in p]
        if not hit:
            lines.append(f"target {stage} < {TARGET_US} us at T=4096 E=256 K=8: not measured")
            continue
        d, e = hit[0]["device_us"]["median"], hit[0]["eager_us"]["median"]
        verdict = "met" if d < TARGET_US else f"MISSED by {d - TARGET_US:.1f} us"
        lines.append(f"target {stage} < {TARGET_US} us at T=4096 E=256 K=8: device {d:.1f} us "
                     f"({verdict}), eager {e:.1f} us")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench.add_points_options(p, MODELS, bench.DEFAULT_TOKENS)
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--budget-s", type=float, default=240.0)
    bench.add_out_dir(p)
    args = p.parse_args(argv)
    if bench.no_gpu(A.availability):
        return 0
    models, tokens = bench.points_of(args, MODELS)
    stages = bench.names_arg("--stages", args.stages, STAGES)
    print(header())
    record, elapsed = run(models, tokens, stages, args.reps, args.warmup, args.block_size,
                          args.budget_s)
    record["elapsed_s"] = round(elapsed, 1)
    record["targets"] = target_lines(record)
    command = " ".join([pathlib.Path(sys.executable).name] + sys.argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M%S")
    path = bench.write_results(record, pathlib.Path(args.out_dir), command=command,
                               stem=f"bench_cupy_stages_{bench.slug(record['card']['gpu'])}_{stamp}")
    for line in record["targets"]:
        print(line)
    print(f"\nwrote {path} ({record['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
