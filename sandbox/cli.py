"""`moe-sandbox`: the command line.

    moe-sandbox validate [--checkpoint PATH] [--layer N] [--trace NAME|PATH] [--tokens N]
                         [--backend NAME ...] [--dtype float32|bfloat16|float16]
                         [--sim-tokens N] [--json OUT] [--quiet]
        The main job: the default layer of data/ (or --checkpoint) and a router trace go
        through every backend available here, stage by stage, against the reference; prints
        the parity table (a backend running longer than a few seconds prints a line per
        stage on stderr, unless --quiet). A backend that cannot run is listed as skipped
        with the reason; a job in which no backend but the reference ran FAILS. On a machine
        without a GPU the Numba kernels run under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1
        is set before Numba is imported: sandbox.registry's use_numba_simulator_if_no_gpu)
        in a second, small run: the first --sim-tokens tokens, alignment block --sim-block,
        stage rows only (the simulator runs one Python thread per CUDA thread).
    moe-sandbox bench [--model NAME ...] [--tokens 1,16,...] [--candidates ...] [--graph]
                      [--quant SCHEME[,SCHEME]] [--peers DIR] [--out DIR] [--cpu] ...
        Our fused experts against vLLM's Triton kernel and torch._grouped_mm (CUDA events or
        graph replays, L2 flushed, new routing each rep): medians, ratios to the peers, the
        roofline floor of the card (known cards only), host microseconds per eager call; JSON
        + plot in ./moe-sandbox-results (--out benchmarks/results updates the committed ones).
        --quant fp8_block,w4a16 adds the quantized layer in those schemes (cupy-fp8_block,
        cupy-w4a16; reference-<scheme> with --cpu) beside the other candidates, on the same
        routings, each with its format's floor and its ratio to our bf16 layer (vs_cupy).
    moe-sandbox info       which backends and devices are available here, and why not
    moe-sandbox data make [--out DIR] [--seed 0]     the small files of data/ (--out data
                                                     in the checkout replaces them)
        (written into a temporary folder and moved into place at the end: a failure leaves
        the folder as it was)

Exit codes: 0 success; 1 a divergence (validate) or failed points (bench --strict);
2 a usage error, a bad checkpoint or trace, or no GPU for `bench`. Errors are one sentence
on stderr, never a traceback (`MOE_SANDBOX_DEBUG=1` re-raises them).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys

# cuda_devices() asks libcuda directly (no GPU library imported); use_numba_simulator_if_no_gpu()
# sets NUMBA_ENABLE_CUDASIM=1 on a machine without a GPU while numba.cuda is not imported yet.
# Both live in the registry, which calls the latter itself before it imports the numba backend.
from sandbox.registry import cuda_devices, use_numba_simulator_if_no_gpu

EXIT_OK, EXIT_DIVERGENCE, EXIT_ERROR = 0, 1, 2
DTYPES = ("float32", "bfloat16", "float16")
# The CUDA simulator runs one Python thread per CUDA thread and every array access in Python
# (~1e4 simulated multiply-adds a second): the Numba run gets a few tokens and a small
# alignment block (little padding to compute), and no end-to-end rerun. ~30 s on a laptop.
SIM_TOKENS = 2
SIM_BLOCK_SIZE = 4


class CliError(Exception):
    """A one-sentence error for the user (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, not the usage block plus a line."""

    def error(self, message):
        raise CliError(f"{self.prog}: {message} (see {self.prog} --help)")


# ----------------------------------------------------------------------------- validate

def _np_dtype(name: str):
    import ml_dtypes
    import numpy as np

    return {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
            "bfloat16": np.dtype(ml_dtypes.bfloat16)}[name]


def _load_trace(arg: str | None, layer, family: str | None):
    """(hidden_states [T, H] f32, router_logits [T, E] f32, label) from a distribution name
    (data/traces/<family>_<name>.npz when there is one, else drawn now) or a .npz path."""
    from sandbox import checkpoint, datagen

    H, E, K = layer_sizes(layer)
    name = arg or checkpoint.DEFAULT_TRACE
    if name in datagen.DISTRIBUTIONS:
        path = checkpoint.default_trace_path(family or "", name) if family else None
        x = None
        if path is not None and path.exists():
            x, logits = datagen.load_trace(path)
            label = f"{name} ({_rel(path)})"
            if x.shape[1] != H or logits.shape[1] != E:
                x = None      # a quantized variant of the family with its own sizes
        if x is None:
            t = datagen.make_trace(name, datagen.TRACE_TOKENS[name], H, E, K, seed=0,
                                   family=family if family in datagen.FAMILIES else "mixtral")
            x, logits = t["hidden_states"], t["router_logits"]
            label = f"{name} (drawn now, seed 0)"
    else:
        path = pathlib.Path(name)
        if not path.exists():
            raise CliError(f"--trace: expected one of {', '.join(datagen.DISTRIBUTIONS)} or a "
                           f".npz file, got {name!r}, which is neither")
        try:
            x, logits = datagen.load_trace(path)
        except (ValueError, OSError) as exc:
            raise CliError(f"--trace {name}: {exc}") from None
        label = _rel(path)
    if x.ndim != 2 or x.shape[1] != H or logits.shape != (x.shape[0], E):
        raise CliError(f"--trace {name}: expected hidden_states [T, {H}] and router_logits "
                       f"[T, {E}] for this layer, got {list(x.shape)} and {list(logits.shape)}")
    return x, logits, label


def layer_sizes(layer) -> tuple[int, int, int]:
    """(H, E, K) of a layer."""
    H = int(layer.hidden_size)         # not w13's last dim: int4 codes pack two a byte
    E = int(getattr(layer, "global_num_experts", None) or layer.num_experts)
    K = int(layer.top_k)
    return H, E, K


def _rel(path: pathlib.Path) -> str:
    try:
        return str(pathlib.Path(path).resolve().relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)


def cmd_validate(args) -> int:
    # arguments first: a usage error must not wait for (or depend on) any GPU library
    from sandbox import checkpoint
    from sandbox.registry import BACKENDS

    wanted = args.backend
    for b in wanted or []:
        if b not in BACKENDS:
            raise CliError(f"--backend: expected names from {', '.join(BACKENDS)}, got {b!r}")
    if args.tokens is not None and args.tokens < 0:
        raise CliError(f"--tokens: expected a count >= 0, got {args.tokens}")
    if args.sim_tokens < 1:
        raise CliError(f"--sim-tokens: expected a count >= 1, got {args.sim_tokens}")
    if args.sim_block < 1:
        raise CliError(f"--sim-block: expected a block size >= 1, got {args.sim_block}")
    ckpt = pathlib.Path(args.checkpoint) if args.checkpoint else \
        checkpoint.default_checkpoint_path()
    if not ckpt.exists():
        hint = "" if args.checkpoint else (" (run `moe-sandbox data make --out data` in the "
                                           "checkout to write data/)")
        raise CliError(f"--checkpoint: expected a checkpoint file or folder, got "
                       f"{str(ckpt)!r}, which does not exist{hint}")

    # the simulator must be chosen before anything imports Numba
    if wanted is None or "numba" in wanted:
        sim = use_numba_simulator_if_no_gpu()
    else:
        sim = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    from sandbox.layer import FusedMoE
    from sandbox.registry import available_backends
    from sandbox.validate import validate

    try:
        layer = FusedMoE.from_safetensors(ckpt, args.layer, params_dtype=_np_dtype(args.dtype))
    except checkpoint.CheckpointError as exc:
        raise CliError(f"--checkpoint {ckpt}: {exc}") from None
    info = getattr(layer, "checkpoint_info", {})
    family = info.get("family")
    x, logits, trace_label = _load_trace(args.trace, layer, family)
    if args.tokens is not None:
        x, logits = x[:args.tokens], logits[:args.tokens]
    x = x.astype(_np_dtype(args.dtype))

    avail = available_backends()
    if wanted:
        missing = [n for n in wanted if not avail[n][0]]
        if missing:
            raise CliError(f"--backend {missing[0]}: not available here "
                           f"({avail[missing[0]][1]}); `moe-sandbox info` lists what is")
        names = list(dict.fromkeys(["reference", *wanted]))
    else:
        names = list(BACKENDS)   # the unavailable ones show as skipped, with the reason
    # the simulator runs one Python thread per CUDA thread: give it a few tokens only
    slow = ["numba"] if (sim and "numba" in names and avail["numba"][0]) else []
    fast = [n for n in names if n not in slow]

    H, E, K = layer_sizes(layer)
    print(f"layer   {_rel(ckpt)} layer {info.get('layer_idx')} ({family}: E={E} K={K} H={H} "
          f"I={layer.intermediate_size}, {args.dtype})")
    print(f"trace   {trace_label}: T={x.shape[0]}", flush=True)
    runs = [("", fast, layer, x, logits, True)]
    if slow:
        n = min(args.sim_tokens, x.shape[0])
        sim_layer = layer.with_backend("reference")     # a shallow copy: same parameters
        sim_layer.block_size = args.sim_block
        title = (f" (Numba under the CUDA simulator: first {n} tokens, block size "
                 f"{args.sim_block}, stages only)")
        runs.append((title, ["reference"] + slow, sim_layer, x[:n], logits[:n], False))
    diverged, compared, reports = False, names == ["reference"], []
    for title, backends, lyr, xs, ls, e2e in runs:
        print(f"\n== {', '.join(backends)}{title}, T={xs.shape[0]}", flush=True)
        report = validate(lyr, xs, ls, backends=backends, end_to_end=e2e, quiet=args.quiet)
        print(report.table(), flush=True)
        diverged = diverged or report.diverged
        compared = compared or bool(report.compared)
        reports.append({"backends": backends, "tokens": int(xs.shape[0]),
                        "report": report.to_json()})
    # a divergence anywhere fails; so does a job in which no backend but the reference ran
    ok = compared and not diverged
    if diverged:
        print("\nFAIL: a backend diverged (see 'first divergence' above)")
    elif not compared:
        print("\nFAIL: no backend but the reference ran here, so nothing was compared (see "
              "the 'skipped' lines above; `moe-sandbox info` says why)")
    else:
        print("\nPASS: every backend that ran is within tolerance at every stage")
    if args.json:
        out = {"checkpoint": str(ckpt), "layer": info.get("layer_idx"), "family": family,
               "dtype": args.dtype, "trace": trace_label, "ok": ok, "runs": reports}
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1, default=_jsonable) + "\n")
    return EXIT_OK if ok else EXIT_DIVERGENCE


def _jsonable(o):
    try:
        import numpy as np
        if isinstance(o, (np.floating, np.integer, np.bool_)):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    return str(o)


# ----------------------------------------------------------------------------- bench

def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected token counts >= 1, got {text!r}")
    return values


def _scheme_list(text: str) -> tuple[str, ...]:
    from sandbox.quant import SCHEMES

    values = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in values if v not in SCHEMES]
    if not values or bad:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated schemes from {', '.join(SCHEMES)}, got {text!r}")
    return values


def cmd_bench(args) -> int:
    from sandbox import bench

    if args.cpu:
        device = "cpu"
    else:
        if not cuda_devices() and bench.cuda_api() is None:
            print("moe-sandbox bench: no CUDA GPU is visible here, so there is nothing to time; "
                  "run it on a GPU machine, or pass --cpu to time the NumPy reference and the "
                  "torch peers on this CPU.", file=sys.stderr)
            return EXIT_ERROR
        device = "cuda"
    try:
        import torch
    except ImportError:
        raise CliError("bench: expected torch (the inputs and the peers are torch tensors), "
                       "found it not installed: pip install 'moe-sandbox[torch]'") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise CliError("bench: expected torch to see the CUDA GPU, but torch.cuda.is_available()"
                       " is False (a CPU-only torch build?)")

    models = args.model or (["tiny"] if device == "cpu" else list(bench.GPU_PRESETS))
    if models == ["all"]:
        models = list(bench.GPU_PRESETS)
    for m in models:
        if m not in bench.PRESETS:
            raise CliError(f"--model: expected names from {', '.join(bench.PRESETS)} or all, "
                           f"got {m!r}")
    tokens = args.tokens or bench.default_tokens(device)
    candidates = args.candidates or (["reference", "torch-loop", "torch-grouped_mm"]
                                     if device == "cpu" else list(bench.GPU_CANDIDATES))
    if args.peers is not None:
        if not (pathlib.Path(args.peers) / "vllm_triton" / "peer.py").is_file():
            raise CliError(f"--peers: expected a folder holding vllm_triton/peer.py, got "
                           f"{args.peers!r}")
        bench.PEERS_DIR[0] = pathlib.Path(args.peers)
    if args.quant:
        candidates = list(dict.fromkeys(list(candidates) + bench.quant_candidate_names(
            args.quant, device)))
    for c in candidates:
        if c not in bench.CANDIDATES:
            raise CliError(f"--candidates: expected names from {', '.join(bench.CANDIDATES)}, "
                           f"got {c!r}")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32}[args.dtype or ("float32" if device == "cpu"
                                                      else "bfloat16")]
    card = None
    if device == "cuda" and not args.no_card:
        print("measuring the card (copy bandwidth, bf16 matmul)...", flush=True)
        card = bench.measure_card()
        print(f"  {card['gpu']}: copy {card['copy_TBps']:.2f} TB/s, matmul "
              f"{card['matmul_TFLOPs']:.0f} TFLOP/s ({card['matmul_dtype']})")
    elif device == "cpu":
        card = {"gpu": "cpu", "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    bar = bench.tqdm_or_none() if not args.no_progress else None
    record = bench.run_bench(models, tokens, candidates, device=device, dtype=dtype,
                             warmup=args.warmup, reps=args.reps, graph=args.graph,
                             flush_l2=not args.no_flush, routing=args.routing, seed=args.seed,
                             progress=bar, card=card)
    record["torch_version"] = torch.__version__
    print(bench.format_table(record))
    note = bench.untuned_note(record)
    if note:
        print(note)
    command = "moe-sandbox " + " ".join(args.argv)
    if not args.no_save:
        path = bench.write_results(record, pathlib.Path(args.out), command=command)
        print(f"wrote {_rel(path)}")
        if not args.no_plot:
            png = bench.plot_results(record, path.with_suffix(".png"))
            if png:
                print(f"wrote {_rel(png)}")
    failed = [p for p in record["points"] if "stats" not in p
              and not p.get("error", "").startswith(bench.UNAVAILABLE)]
    return EXIT_DIVERGENCE if (args.strict and failed) else EXIT_OK


# ----------------------------------------------------------------------------- info, data

def cmd_info(args) -> int:
    devices = cuda_devices()
    sim = use_numba_simulator_if_no_gpu()
    import numpy as np

    print(f"python   {platform.python_version()} ({platform.machine()}), numpy {np.__version__}")
    if devices:
        for i, name in enumerate(devices):
            print(f"gpu {i}    {name}")
    else:
        print("gpu      none visible (no CUDA driver or no device)")
    print(f"numba    CUDA simulator {'on' if sim else 'off'} "
          f"(NUMBA_ENABLE_CUDASIM={os.environ.get('NUMBA_ENABLE_CUDASIM', '')!s})")
    from sandbox.registry import available_backends

    print("\nbackend    available  why")
    for name, (ok, reason) in available_backends().items():
        print(f"{name:10s} {'yes' if ok else 'no':9s}  {reason}")
    from sandbox import checkpoint

    ckpt = checkpoint.default_checkpoint_path()
    print(f"\ndata     {_rel(ckpt)} {'present' if ckpt.exists() else 'missing'}")
    return EXIT_OK


def cmd_data_make(args) -> int:
    from sandbox import datagen

    # arguments first, by their names: nothing is written for a bad one
    if args.seed < 0:
        raise CliError(f"--seed: expected an int >= 0, got {args.seed}")
    if args.seed >= datagen.SEED_LIMIT:
        raise CliError(f"--seed: expected an int < 2**63 (the traces store it as int64), "
                       f"got {args.seed}")
    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out: expected a folder (existing or to create), got {args.out!r}, "
                       f"which is a file")
    written = datagen.make_all(out, args.seed, progress=lambda m: print(f"  {m}", flush=True))
    total = sum(p.stat().st_size for p in written)
    print(f"wrote {len(written)} files under {_rel(out)} ({total / 1e6:.2f} MB, seed "
          f"{args.seed})")
    return EXIT_OK


# ----------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moe-sandbox", description="The MoE kernel sandbox: parity, benchmarks, "
                                                "data.")
    sub = p.add_subparsers(dest="command", metavar="{validate,bench,info,data,ep}",
                           parser_class=_Parser)

    v = sub.add_parser("validate", help="the main job: the parity table of every backend here")
    v.add_argument("--checkpoint", help="a .safetensors file, index .json or folder "
                                        "(default: data/qwen3_moe)")
    v.add_argument("--layer", type=int, default=None, help="MoE layer index (default: the "
                                                           "first MoE layer)")
    v.add_argument("--trace", help="balanced, zipf, one_expert, nan_rows, or a .npz path "
                                   "(default: zipf)")
    v.add_argument("--tokens", type=int, default=None, help="use only the first N tokens")
    v.add_argument("--backend", nargs="+", metavar="NAME",
                   help="backends to compare (default: every one available here)")
    v.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights and activations dtype (default float32)")
    v.add_argument("--sim-tokens", type=int, default=SIM_TOKENS,
                   help=f"tokens for Numba under the CUDA simulator (default {SIM_TOKENS})")
    v.add_argument("--sim-block", type=int, default=SIM_BLOCK_SIZE,
                   help=f"alignment block size of the simulator run (default {SIM_BLOCK_SIZE})")
    v.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")
    v.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr (otherwise printed for a backend that "
                        "runs longer than a few seconds, e.g. Numba in the CUDA simulator)")
    v.set_defaults(func=cmd_validate)

    b = sub.add_parser("bench", help="time candidates against vLLM's kernel, torch and the "
                                     "roofline")
    b.add_argument("--model", nargs="+", metavar="NAME",
                   help="presets: mixtral-8x7b qwen3-30b-a3b deepseek-v3 tiny, or all "
                        "(default: the three models; tiny with --cpu)")
    b.add_argument("--tokens", type=_int_list, help="comma-separated T values (default "
                                                    "1,16,64,256,1024,4096,16384; "
                                                    "1,16,64,256 with --cpu)")
    b.add_argument("--candidates", nargs="+", metavar="NAME",
                   help="what to time (default: cupy vllm-triton torch-grouped_mm; "
                        "reference torch-loop torch-grouped_mm with --cpu)")
    b.add_argument("--quant", type=_scheme_list, metavar="SCHEME[,SCHEME]",
                   help="also time the quantized layer in these schemes (fp8_tensor "
                        "fp8_static fp8_token fp8_block int8_channel w4a16 w4a16_zp w8a16): "
                        "candidates cupy-<scheme> (reference-<scheme> with --cpu), the "
                        "weights quantized once per model, untimed")
    b.add_argument("--dtype", choices=DTYPES, help="default bfloat16 (float32 with --cpu)")
    b.add_argument("--reps", type=int, default=50)
    b.add_argument("--warmup", type=int, default=10)
    b.add_argument("--graph", action="store_true", help="time CUDA-graph replays")
    b.add_argument("--no-flush", action="store_true", help="do not flush L2 between reps")
    b.add_argument("--routing", choices=("uniform", "zipf"), default="uniform")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default=str(bench_out_default()),
                   help="results folder (default ./moe-sandbox-results; pass "
                        "benchmarks/results to update the committed files)")
    b.add_argument("--peers", metavar="DIR", default=None,
                   help="the measuring instruments (vllm_triton/peer.py); default .peers/ "
                        "in the checkout, else ../shared/peers beside it")
    b.add_argument("--no-save", action="store_true", help="print only")
    b.add_argument("--no-plot", action="store_true")
    b.add_argument("--no-card", action="store_true", help="skip measuring the card")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--strict", action="store_true", help="exit 1 when a point failed")
    b.add_argument("--cpu", action="store_true", help="time on this CPU (no GPU needed)")
    b.set_defaults(func=cmd_bench)

    i = sub.add_parser("info", help="backends and devices here, and why not")
    i.set_defaults(func=cmd_info)

    e = sub.add_parser("ep", help="expert parallelism: one process per GPU (or CPU rank); "
                                  "moe-sandbox ep --help", add_help=False)
    e.add_argument("ep_args", nargs=argparse.REMAINDER)
    e.set_defaults(func=_run_ep)

    d = sub.add_parser("data", help="the small files of data/")
    dsub = d.add_subparsers(dest="data_command", metavar="{make}", parser_class=_Parser)
    m = dsub.add_parser("make", help="write the checkpoints and traces from a seed")
    m.add_argument("--out", default="moe-sandbox-results/data",
                   help="the folder to write (default ./moe-sandbox-results/data; pass "
                        "--out data in the checkout to regenerate the committed files)")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_data_make)
    return p


def bench_out_default() -> pathlib.Path:
    """Where `bench` writes unless told: a folder of the current directory, never the
    package's own tree (only an explicit --out benchmarks/results updates those files)."""
    return pathlib.Path("moe-sandbox-results")


def _run_ep(args) -> int:
    # the expert-parallel runtime has its own parser (moe-sandbox ep --help)
    from sandbox.ep import cli_main
    try:
        return cli_main(args.ep_args)
    except SystemExit as exc:          # its argparse exits on --help and on bad arguments
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ep"]:          # everything after "ep" belongs to the EP runtime's parser
        return int(_run_ep(argparse.Namespace(ep_args=argv[1:])))
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.argv = argv
        if not getattr(args, "func", None):
            if args.command == "data":
                raise CliError("moe-sandbox data: expected a subcommand: make "
                               "(see moe-sandbox data --help)")
            parser.print_help()
            return EXIT_ERROR
        code = int(args.func(args))
        sys.stdout.flush()   # a closed pipe shows here, inside the handlers below
        return code
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader left (`moe-sandbox info | head -1`): not an error of ours. Point stdout
        # at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # anything else: one sentence, the traceback on request
        if os.environ.get("MOE_SANDBOX_DEBUG") == "1":
            raise
        text = str(exc).strip().splitlines()
        print(f"error: {type(exc).__name__}: {text[0] if text else ''} "
              f"(MOE_SANDBOX_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
