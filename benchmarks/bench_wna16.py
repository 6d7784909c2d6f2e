"""The weight-only int4 ladder (cuda_kernels/cupy/quant/wna16.py) rung by rung, beside its route.

    T tokens, E experts, K top-k, H hidden, I intermediate, B block size, P = T*K slots

Mixtral-8x7B (E=8, top-2, H=4096, I=14336), int4 weights with group 128 and fp32 scales, bf16
activations, at T in {1, 16, 64, 256, 1024, 4096}. The expert path is GEMM1 [P, H] x [2I, H]
then GEMM2 [P, I] x [H, I] (* router weight); the activation between them is not timed
(GEMM2 reads a pre-drawn [P, I] bf16 activation), as in bench_quant.py.

    route   grouped_gemm_wna16 with no version: the route's choice (configs.ROUTES["int4"]) at
            configs.block_size_for's block size
    v2..v6  each rung (--rungs), with the config the route would take for it (its first entry
            that takes the problem; v6 only on sm_90), at a block size its tiles divide: the
            tile rows up to 8 rows per expert, else the first multiple of them from 32

Method: the one GPU timer (cuda_kernels/timing.py, mode "device"): CUDA events around each
call after warm-up, median over the repetitions; before each repetition (untimed) the next of
4 pre-drawn routings is selected and the L2 is flushed (a fill of twice its size); a
one-thread spin kernel then holds the GPU while Python enqueues the timed calls, so the
events measure GPU time.

Roofline: floor = max(bytes / HBM, flops / 989e12 FLOP/s), HBM the card's datasheet
bandwidth (H100 3.35e12, H200 4.8e12 B/s), bytes = the codes and fp32 scales of the experts the
routings touch (GEMM1 and GEMM2), flops = 2 P (2I H + H I).
frac = floor / median time.

    python benchmarks/bench_wna16.py [--tokens 1,16,64] [--reps 20] [--rungs v2,v3,v4,v5,v6]
                                     [--sweep] [--configs t24+S=4,q8] [--budget-s 120] [--zp]
                                     [--out DIR]

--sweep also times every wna16 config of the table (quant/configs.py; --configs: only these,
each with optional integer overrides "name+KEY=VALUE") per GEMM at each T. --zp gives the
weights per-group zero points (uint8 0..15; the command line in the JSON says so). Writes
DIR/bench_wna16_<gpu>_<time>.json (default DIR ./moe-sandbox-results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cuda_kernels import timing  # noqa: E402
from cuda_kernels.cupy import _arrays as A  # noqa: E402
from cuda_kernels.cupy.quant import configs as Q  # noqa: E402
from cuda_kernels.cupy.quant import wna16 as W16  # noqa: E402
from sandbox.bench import add_out_dir, card_hbm  # noqa: E402

E, K, H, I = 8, 2, 4096, 14336
GROUP = 128
TOKENS = (1, 16, 64, 256, 1024, 4096)
HBM = None   # the card's datasheet HBM bandwidth (bytes/s), set by main (card_hbm)
PEAK = 989e12
ROUTINGS = 4
RUNGS = ("v2", "v3", "v4", "v5", "v6")    # v1 (one thread per output) takes seconds at T=4096

_FILL = r"""
extern "C" __global__ void fill_bytes(unsigned char* y, long long n, unsigned long long seed) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        unsigned long long z = (unsigned long long)i + seed;      // splitmix64 of the index
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        y[i] = (unsigned char)((z ^ (z >> 31)) >> 24);
    }
}
"""


def random_bytes(shape, seed):
    import cupy

    out = cupy.empty(shape, dtype=cupy.uint8)
    cupy.RawKernel(_FILL, "fill_bytes")((2048,), (256,), (out, np.int64(out.size),
                                                          np.uint64(seed * 0x9E3779B97F4A7C15
                                                                    % 2**64)))
    return out


def mixtral_weights():
    """Random Mixtral int4 weights on the GPU, (w1, w2, s1, s2): packed codes [E, 2I, H/2] and
    [E, H, I/2] (two codes a byte), fp32 group scales [E, 2I, H/GROUP] and [E, H, I/GROUP]."""
    import cupy

    w1 = random_bytes((E, 2 * I, H // 2), 1)
    w2 = random_bytes((E, H, I // 2), 2)
    s1 = cupy.random.uniform(1e-3, 2e-3, (E, 2 * I, H // GROUP), dtype=cupy.float32)
    s2 = cupy.random.uniform(1e-3, 2e-3, (E, H, I // GROUP), dtype=cupy.float32)
    return w1, w2, s1, s2


def random_bf16(shape, seed):
    import cupy

    x = cupy.random.default_rng(seed).standard_normal(shape, dtype=cupy.float32)
    u = x.view(cupy.uint32)
    b = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(cupy.uint16)   # round to nearest even
    return b.view(A.bf16_dtype())


def _finite(c) -> bool:
    """No bf16 inf / NaN (exponent bits all ones) in c."""
    return not bool(((A.raw(c) >> 7) & 0xFF).max() == 0xFF) if c.size else True


def draw_routing(rng, T):
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
    w = rng.random((T, K)).astype(np.float32) + 0.1
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def make_timer():
    """timer(fn, setup, warmup=3, reps=20) -> median ms of fn by the one GPU timer
    (cuda_kernels/timing.py, CuPy's events): setup() and an L2 flush before every call,
    outside the events, then a spin kernel holds the GPU while Python enqueues the call."""
    api = timing.CudaApi("cupy")

    def timer(fn, setup, warmup=3, reps=20):
        return timing.time_cuda(fn, warmup, reps, rotate=lambda i: setup(), mode="device",
                                api=api).median
    return timer


def _config_override(known: dict, spec: str):
    """("t24+S=4", t24's config with S = 4) from --configs' "name+KEY=VALUE"."""
    name, *overrides = spec.split("+")
    if name not in known:
        raise SystemExit(f"--configs: expected config names of {sorted(known)}, got {name!r}")
    cfg = dict(known[name])
    for o in overrides:
        key, _, value = o.partition("=")
        if not value.lstrip("-").isdigit():
            raise SystemExit(f"--configs: expected KEY=integer after {name!r}, got {o!r}")
        cfg[key] = int(value)
    return spec, cfg


def rung_config(rung: str, rows: float, N: int, Kdim: int, cc: int):
    """(name, config, block size) of `rung` for a batch of `rows` per expert: the route's first
    entry of the rung that takes the problem at a block size its tiles divide (the tile rows up
    to 8 rows per expert, else the first multiple of them from 32), or None."""
    for name, cfg in Q.CONFIGS["wna16"].items():
        if cfg["rung"] != rung:
            continue
        bm = Q.tile_rows(cfg) if rung != "v1" else 16
        B = bm if rows <= 8 else -(-max(32, bm) // bm) * bm
        try:
            got, cfg = Q.route("int4", rows, Kdim, W16.refuses(4, cc, N, Kdim, GROUP,
                                                               Kdim // GROUP, B, True),
                               version=rung)
        except ValueError:
            continue
        return got, cfg, B
    return None


def main(argv=None):
    from reference import moe_align_block_size

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rungs", default=",".join(RUNGS),
                   help="the rungs timed beside the route (comma-separated; '' for none)")
    p.add_argument("--sweep", action="store_true", help="time every config per GEMM")
    p.add_argument("--configs", default="",
                   help="with --sweep: only these configs, comma-separated names, each with "
                        "optional overrides: t24+S=4")
    p.add_argument("--budget-s", type=float, default=1e9)
    p.add_argument("--zp", action="store_true",
                   help="per-group zero points (uint8 0..15), as AWQ-style asymmetric int4")
    add_out_dir(p, "--out")
    args = p.parse_args(argv)
    ok, why = A.availability()
    if not ok:
        raise SystemExit(f"no GPU: {why}")
    import cupy

    deadline = time.time() + args.budget_s
    tokens = [int(t) for t in args.tokens.split(",") if t]
    rungs = [r for r in args.rungs.split(",") if r]
    rng = np.random.default_rng(0)
    w1, w2, s1, s2 = mixtral_weights()
    zp1 = zp2 = None
    if args.zp:
        zp1 = cupy.random.randint(0, 16, (E, 2 * I, H // GROUP), dtype=cupy.int32).astype(cupy.uint8)
        zp2 = cupy.random.randint(0, 16, (E, H, I // GROUP), dtype=cupy.int32).astype(cupy.uint8)
    per_expert = Q.quant_weight_bytes("int4", 1, 2 * I, H, GROUP) + \
        Q.quant_weight_bytes("int4", 1, H, I, GROUP)
    timer = make_timer()
    cc = int(cupy.cuda.Device().compute_capability)
    gpu = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    global HBM
    HBM = card_hbm(gpu)
    points, sweep = [], []
    for T in tokens:
        if time.time() > deadline:
            print(f"T={T}: skipped (time budget)", flush=True)
            continue
        P = T * K
        routings = [draw_routing(rng, T) for _ in range(ROUTINGS)]
        touched = float(np.mean([len(np.unique(ids)) for ids, _ in routings]))
        x = random_bf16((T, H), 10 + T)
        act = random_bf16((P, I), 20 + T)
        nbytes = touched * per_expert
        flops = 2.0 * P * (2 * I * H + H * I)
        floor = max(nbytes / HBM, flops / PEAK) * 1e3
        cur = {"i": 0}

        def setup():
            cur["i"] = (cur["i"] + 1) % ROUTINGS

        def aligned(B):
            return [tuple(A.to_device(v) for v in moe_align_block_size(ids, B, E)) +
                    (A.to_device(tw),) for ids, tw in routings]

        def path(B, **kw):
            al = aligned(B)

            def g1():
                st, ex, ntp, tw = al[cur["i"]]
                return W16.grouped_gemm_wna16(x, w1, st, ex, ntp, K, B, w_scale=s1, w_zp=zp1,
                                              **kw)

            def g2():
                st, ex, ntp, tw = al[cur["i"]]
                return W16.grouped_gemm_wna16(act, w2, st, ex, ntp, 1, B, tw, True, w_scale=s2,
                                              w_zp=zp2, **kw)
            return g1, g2

        point = dict(T=T, P=P, touched_experts=touched, bytes=nbytes, flops=flops,
                     floor_ms=floor)
        impls = [("route", {}, Q.block_size_for("int4", P / E))]
        for rung in rungs:
            picked = rung_config(rung, P / E, 2 * I, H, cc)
            if picked is None:
                point[rung] = dict(error="the rung does not take this problem here")
                continue
            impls.append((rung, dict(config=picked[0]), picked[2]))
        for label, kw, B in impls:
            try:
                g1, g2 = path(B, **kw)
                c1, c2 = g1(), g2()
                finite = _finite(c1) and _finite(c2)       # garbage shows up as inf / NaN
                reps = args.reps if T < 4096 else max(5, args.reps // 2)
                ms1 = timer(g1, setup, reps=reps)
                ms2 = timer(g2, setup, reps=reps)

                def both():
                    g1()
                    g2()
                ms = timer(both, setup, reps=reps)
                point[label] = dict(ms=ms, gemm1_ms=ms1, gemm2_ms=ms2, frac=floor / ms,
                                    block_size=B, finite=finite, **kw)
            except Exception as e:  # noqa: BLE001 - reported, the run goes on
                point[label] = dict(error=f"{type(e).__name__}: {e}")
        row = f"T={T:5d} floor {floor * 1e3:8.1f} us"
        for label in ["route"] + rungs:
            r = point.get(label)
            if r and "ms" in r:
                row += (f" | {label} {r['ms'] * 1e3:8.1f} us (g1 {r['gemm1_ms'] * 1e3:7.1f} "
                        f"g2 {r['gemm2_ms'] * 1e3:7.1f}) frac {r['frac']:5.1%}")
            elif r:
                row += f" | {label} {r['error']}"
        print(row, flush=True)
        points.append(point)

        if args.sweep and time.time() < deadline:
            cands = list(Q.CONFIGS["wna16"].items())
            if args.configs:
                cands = [_config_override(dict(cands), spec) for spec in args.configs.split(",")]
            for cname, cfg in cands:
                if time.time() > deadline:
                    break
                bm = Q.tile_rows(cfg) if cfg["rung"] != "v1" else 16
                B = bm if P / E <= 8 else -(-max(32, bm) // bm) * bm
                try:
                    g1, g2 = path(B, config=dict(cfg))
                    g1()
                    g2()
                    t1 = timer(g1, setup, 2, 10)
                    t2 = timer(g2, setup, 2, 10)
                    sweep.append(dict(T=T, config=cname, B=B, gemm1_ms=t1, gemm2_ms=t2))
                    print(f"  sweep T={T} {cname} B={B}: g1 {t1 * 1e3:7.1f} us "
                          f"g2 {t2 * 1e3:7.1f} us", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  sweep T={T} {cname}: {type(e).__name__}: {e}", flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    try:
        from sandbox.bench import git_commit
        commit = git_commit()
    except Exception:  # noqa: BLE001 - the commit is informative only
        commit = "unknown"
    res = dict(gpu=gpu, date=stamp.isoformat(timespec="seconds"), commit=commit,
               command="bench_wna16.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               hbm_bytes_per_s=HBM, peak_flops=PEAK, routings_per_point=ROUTINGS,
               note="expert path = GEMM1 + GEMM2; the activation between them is not timed",
               points=points, sweep=sweep)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f = out / f"bench_wna16_{gpu.lower().replace(' ', '_')}_{stamp:%Y%m%d_%H%M%S}.json"
    f.write_text(json.dumps(res, indent=1))
    print(f"wrote {f}")


if __name__ == "__main__":
    main()
