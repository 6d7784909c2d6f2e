"""Dev probe of the int4 layer with silu_and_mul fused into GEMM1 and the dataflow to GEMM2:
bench_quant's Mixtral int4 layer (bench_model, its four routings per T, --fuse-activation)
with kernels taken from cubins built elsewhere (nvrtc_sweep.py's act_*, flow_skew*,
last_short* builds), beside the launcher's own ("base"), the layer without the fusion
("noact": GEMM2 on a pre-drawn activation, as bench_quant's default) and without the
dataflow ("nodataflow": GEMM2 waits for the whole GEMM1), interleaved run after run.
A variant label=CUBIN[%CUBIN...] runs the launcher with each cubin in place of the kernel it
was built as (its .kernel file: nvrtc_sweep.py writes it), e.g. a fused GEMM1 and an
awaiting GEMM2.
    python benchmarks/dev/act_probe.py --variants base,noact,one=/tmp/c/act_sites1.cubin
                                       [--tokens 64,256] [--runs 2] [--out DIR]
"""
import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, ".")
from benchmarks import bench_quant as BQ  # noqa: E402
from cuda_kernels.cupy import _compile as C  # noqa: E402
from cuda_kernels.cupy import quant_gemm_wna16 as W  # noqa: E402


def install(paths: str, dev: int) -> list:
    """Each cubin of `paths` (%-separated) in the launcher's cache under the kernel name it
    was built as (bf16): the launches that pick that name run it. Returns the names."""
    W._READY.clear()
    W._SMEM_SET.clear()
    names = []
    for cubin in filter(None, paths.split("%")):
        name = pathlib.Path(cubin + ".kernel").read_text().strip()
        mangled = pathlib.Path(cubin + ".name").read_text().strip()
        W._READY[(name, 1, dev)] = C._function_of_cubin(pathlib.Path(cubin).read_bytes(),
                                                        mangled)
        names.append(name)
    return names


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="base,noact,nodataflow")
    p.add_argument("--tokens", default="64,256")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    import cupy

    dev = cupy.cuda.Device().id
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for run in range(args.runs):
        for v in args.variants.split(","):
            label, _, paths = v.partition("=")
            installed = install(paths, dev)
            points = BQ.bench_model("mixtral", tokens, 20, False, time.time() + 300,
                                    lambda s: None, fuse_activation=label != "noact",
                                    dataflow=label != "nodataflow")
            for pt in points:
                q = pt["int4"]
                if "error" in q:
                    print(f"{label:12s} T={pt['T']:4d} {q['error']}", flush=True)
                    continue
                by = " ".join(f"{r['ms'] * 1e3:.1f}" for r in q["by_routing"])
                print(f"{label:12s} run {run} T={pt['T']:4d} layer {q['ms'] * 1e3:6.1f} us "
                      f"(g1 {q['gemm1_ms'] * 1e3:.1f}, g2 {q['gemm2_ms'] * 1e3:.1f}) "
                      f"[{by}] {q.get('activation')} dataflow={q.get('dataflow')}", flush=True)
                rows.append(dict(variant=label, run=run, T=pt["T"], cubins=installed, **q))
    W._READY.clear()
    if args.out:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(args.out) / "act_probe.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
