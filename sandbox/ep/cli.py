"""`moe-sandbox ep ...`: expert parallelism from the command line.

    moe-sandbox ep check --gpus 2          collectives + parity of every scheme x placement x
                                           EPLB setting over NCCL (CuPy kernels, or the
                                           reference on the host when they are missing)
    moe-sandbox ep check --cpu 4           the same on 4 CPU processes (sockets)
    moe-sandbox ep bench --gpus 2 [...]    benchmarks/bench_ep.py (extra flags pass through)
    moe-sandbox ep eplb --experts 16 --gpus 4 --redundant 4 [--groups 4 --nodes 2]
                                           the EPLB placement of a skewed (Zipf) load

`sandbox.ep.cli_main(argv)` is the entry point (`sandbox/cli.py` forwards `ep` to it);
`python -m sandbox.ep ...` runs it too. Exit code 0 on success, 1 on a failed check,
2 on bad arguments.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import numpy as np


def _parser():
    ap = argparse.ArgumentParser(prog="moe-sandbox ep",
                                 description="Expert parallelism: checks, benchmark, EPLB.")
    sub = ap.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="parity and collectives on N ranks")
    where = check.add_mutually_exclusive_group(required=True)
    where.add_argument("--gpus", type=int, help="ranks on GPUs (NCCL)")
    where.add_argument("--cpu", type=int, help="ranks as CPU processes (sockets)")
    check.add_argument("--backend", default="auto", choices=("auto", "cupy", "reference"),
                       help="expert compute on GPU ranks (auto: cupy when available)")
    check.add_argument("--quick", action="store_true", help="the fp32 matrix only")
    check.add_argument("--timeout", type=float, default=120.0,
                       help="seconds a rank waits on a peer before failing")

    bench = sub.add_parser("bench", help="benchmarks/bench_ep.py (GPU)")
    bench.add_argument("--gpus", type=int, default=2)
    bench.add_argument("rest", nargs=argparse.REMAINDER,
                       help="more flags for bench_ep.py (--tokens, --no-layer, ...)")

    eplb = sub.add_parser("eplb", help="an EPLB placement for a skewed load (no ranks)")
    eplb.add_argument("--experts", type=int, default=16)
    eplb.add_argument("--gpus", type=int, default=4)
    eplb.add_argument("--redundant", type=int, default=4)
    eplb.add_argument("--groups", type=int, default=1)
    eplb.add_argument("--nodes", type=int, default=1)
    eplb.add_argument("--seed", type=int, default=0)
    return ap


def _check(args) -> int:
    from . import launch
    from .checks import run_collectives, run_parity, parity_cases
    from .errors import LaunchError

    world = args.gpus if args.gpus is not None else args.cpu
    if world < 1:
        print(f"ep check: expected a positive number of ranks, got {world}", file=sys.stderr)
        return 2
    backend = "nccl" if args.gpus is not None else "cpu"
    compute = "reference"
    if backend == "nccl":
        if args.backend == "auto":
            from sandbox.registry import get_backend

            compute = "cupy" if get_backend("cupy").ok else "reference"
        else:
            compute = args.backend
    cases = parity_cases(world, quick=args.quick)
    try:
        coll = launch(run_collectives, world, backend=backend, timeout=args.timeout)
        per_rank = launch(run_parity, world, backend=backend, args=(cases, compute),
                          timeout=args.timeout)
    except LaunchError as exc:
        print(f"ep check failed:\n{exc}", file=sys.stderr)
        return 1
    failed = 0
    print(f"{world} ranks, {backend} communicator, {compute} stages")
    for name in coll[0]:
        ok = all(res[name] for res in coll)
        failed += not ok
        print(f"  collective {name:<30} {'ok' if ok else 'FAILED'}")
    slack = 2.0 if compute == "cupy" else 1.0  # GPU kernels accumulate in another order
    for i, case in enumerate(cases):
        infos = [r[i] for r in per_rank]
        err = max(max(x["error"], x.get("error_after_rebalance", 0.0)) for x in infos)
        tol = max(infos[0]["tolerance"], 1e-5 * slack if compute == "cupy" else 0)
        ok = not np.isnan(err) and err <= tol
        failed += not ok
        moved = " (EPLB moved experts)" if infos[0].get("moved") else ""
        print(f"  {case['name']:<55} rel err {err:.2e} <= {tol:.0e}  "
              f"{'ok' if ok else 'FAILED'}{moved}")
    print("all checks passed" if not failed else f"{failed} checks FAILED")
    return 0 if not failed else 1


def _bench(args) -> int:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "benchmarks", "bench_ep.py")
    if not os.path.exists(path):
        print(f"ep bench: {path} not found (run from a source checkout)", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("bench_ep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rest = [a for a in args.rest if a != "--"]
    module.main(["--gpus", str(args.gpus)] + rest)
    return 0


def _eplb(args) -> int:
    from reference.eplb import gpu_loads, rebalance_experts

    rng = np.random.default_rng(args.seed)
    load = (1000 * rng.zipf(1.5, size=args.experts).clip(max=50)).astype(np.int64)
    try:
        phy2log, _, logcnt = rebalance_experts(load, args.experts + args.redundant,
                                               args.groups, args.nodes, args.gpus)
    except (ValueError, TypeError) as exc:
        print(f"ep eplb: {exc}", file=sys.stderr)
        return 2
    per = phy2log.size // args.gpus
    print(f"load per logical expert: {load.tolist()}")
    print(f"replicas per expert:     {logcnt.tolist()}")
    for g in range(args.gpus):
        print(f"  GPU {g}: experts {phy2log[g * per:(g + 1) * per].tolist()}")
    if args.experts % args.gpus == 0:
        before = gpu_loads(load, np.arange(args.experts), args.gpus)
        print(f"max GPU load, linear without replicas: {before.max():.0f} "
              f"(mean {before.mean():.0f})")
    after = gpu_loads(load, phy2log, args.gpus)
    print(f"max GPU load, EPLB:                    {after.max():.0f} (mean {after.mean():.0f})")
    return 0


def cli_main(argv=None) -> int:
    """Entry point of `moe-sandbox ep ...` (argv without the leading "ep")."""
    args = _parser().parse_args(argv)
    if args.command == "check":
        return _check(args)
    if args.command == "bench":
        return _bench(args)
    return _eplb(args)
