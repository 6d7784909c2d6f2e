"""How fast is the NumPy oracle? fused_moe in float32 on the CPU beside a torch per-expert loop.

    python benchmarks/bench_reference_cpu.py [--tokens 1024] [--reps 5]

Shape (issue 2): E=8 experts, top-2, H=1024, I=2816, T=1024 tokens. Both run on the same
inputs in the same process; each is timed `reps` times after one warm-up, median reported.
The flop count is 2 * T * K * (H * 2I + I * H) (two GEMMs per slot), so a reader can see how
close to the CPU's BLAS rate either gets. Writes a JSON record to ./moe-sandbox-results/ (or
--out DIR).
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import reference
from cuda_kernels.timing import time_cpu
from sandbox.bench import add_out_dir, git_commit, torch_per_expert_loop


def time_it(fn, reps):
    """Median seconds of fn() on the host, after one warm-up."""
    return time_cpu(fn, warmup=1, reps=reps).median * 1e-3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-save", action="store_true")
    add_out_dir(parser, "--out")
    args = parser.parse_args()

    num_experts, top_k, hidden, inter, tokens = 8, 2, 1024, 2816, args.tokens
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    w1 = rng.standard_normal((num_experts, 2 * inter, hidden), dtype=np.float32) / hidden**0.5
    w2 = rng.standard_normal((num_experts, hidden, inter), dtype=np.float32) / inter**0.5
    logits = rng.standard_normal((tokens, num_experts), dtype=np.float32)

    ref_s = time_it(lambda: reference.fused_moe(x, w1, w2, logits, top_k, True), args.reps)
    flops = 2 * tokens * top_k * (hidden * 2 * inter + inter * hidden)
    record = {
        "benchmark": "reference fused_moe fp32 on CPU vs torch per-expert loop",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": "python benchmarks/bench_reference_cpu.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "no_save"),
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores",
        "shape": dict(E=num_experts, K=top_k, H=hidden, I=inter, T=tokens),
        "reference_s": ref_s, "reference_gflops": flops / ref_s / 1e9,
    }
    try:
        import torch
    except ImportError:
        print("torch is not installed: timing the reference alone")
    else:
        tw, ti, _ = reference.fused_topk(x, logits, top_k, True)
        args_t = [torch.from_numpy(a) for a in (x, w1, w2, tw, ti.astype(np.int64))]
        with torch.inference_mode():
            torch_s = time_it(lambda: torch_per_expert_loop(*args_t), args.reps)
            got = torch_per_expert_loop(*args_t).numpy()
        ref = reference.fused_experts(x, w1, w2, tw, ti)
        record.update(torch_version=torch.__version__, torch_threads=torch.get_num_threads(),
                      torch_s=torch_s, ratio_reference_over_torch=ref_s / torch_s,
                      rel_err_vs_torch=float(np.linalg.norm(ref - got) / np.linalg.norm(got)))
    for key, value in record.items():
        print(f"{key:28s} {value}")
    if not args.no_save:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"reference_cpu_{datetime.now():%Y%m%d}.json"
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")


if __name__ == "__main__":
    main()
