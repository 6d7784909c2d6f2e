"""Dev probe of wna16_staged (Mixtral GEMM1 / GEMM2): the same launches with the kernel compiled
under the .cu's dev macros, beside the real one, and a plain read of the same bytes (uint4
loads, grid-stride) as the streaming calibration. Times (CUDA events, median, L2 flushed before
each repetition), and for variants that keep the math (not PROBE) whether their outputs have the
bits of the "base" variant's (the parts of a block add in a fixed order, so they do not depend
on which CTA finishes it), and the layer as bench_quant times it (GEMM1, then GEMM2 launched
programmatically). The macros:
    STAGED_PROBE = 1 no math, 2 no activation copies, 3 no weight copies (garbage results)
    STAGED_TIMES = 1 each CTA's start / end (globaltimer), SM, units, when its first stage
                     landed, the SM cycles it spent ending blocks (of them in whole stores) and
                     its partial blocks, with the parts' fences, counts and adds, and its
                     SM clock (clock64 cycles over globaltimer ns): their spread is printed
    STAGED_LT_COST = c  a unit's cost LT + c in the run split (5 in the kernel)
    MAXREG = n, PTXO = n   compiler options, not macros: --maxrregcount=n, ptxas -On
"base" is the launcher's kernel: for a config with a prebuilt cubin (t24, cuda_kernels/cupy/
prebuilt) that cubin, else the .cu built by CuPy's NVRTC like every macro variant (on the H200
image CUDA 13.0's, whose build of t24 runs 2-3% slower: dev_wna16_20261202b); `cubin=PATH`
loads a cubin built elsewhere (benchmarks/dev/ptxas_cubins.py), its mangled name in PATH.name.
(Runs of dev_wna16_20261130g also used STAGED_BULK and STAGED_LATE, those of dev_wna16_20261201
STAGED_CACHE, STAGED_LATE_START, STAGED_SPLIT and STAGED_DEFER, those of dev_wna16_20261201b
STAGED_EARLY, STAGED_REVERSE, STAGED_AGE / STAGED_SKEW, STAGED_BLOCK_COST, STAGED_PDL_EARLY and
STAGED_HALVES, and of dev_wna16_20261201c STAGED_SUMS, STAGED_L2_AHEAD, STAGED_HALF_SKEW,
STAGED_STORE, STAGED_EARLY_IDS, STAGED_MINE_FIRST and STAGED_ROUTED_SMEM, since taken out or
made the code. Those of dev_wna16_20261201d: config keys TAIL / LTC (6ea9ba9) and RUN_TABLE with
benchmarks/dev/role_skew.py (ccb4bdd), and STAGED_A_SMEM / STAGED_SMEM_BOUNDS (53c21cf), taken
out too. Those of dev_wna16_20261201e: STAGED_TEAMS with config key TEAMS (a5ef20b),
STAGED_FENCE, STAGED_PAD_ZERO and STAGED_BULK_A with config key BULK_A (9bd430f), STAGED_PROBE
= 4 / 5 and STAGED_LEAN_ISSUE (560934b), taken out as well, and those of dev_wna16_20261201f,
STAGED_RP1 / STAGED_RP2 (2c293b0), and of dev_wna16_20261202 STAGED_NO_WAIT (04126d9),
STAGED_SUMS again (8f64e3a), and config key PS with --layer2 and --ps-cached (99c22cc, 35cc965),
and of dev_wna16_20261202b STAGED_PMAX, STAGED_DERIVED and STAGED_RW_PREFETCH (582ad70).)
--compile-only builds the modules into CuPy's cache (run several at once before the timed
call).
A config may name the one variant it runs after "@" (t24+TEAMS=2+MINB=1@TEAMS=2: a launch that
needs its macro); every variant's bits are checked against the first config's base. "A%B" runs
GEMM1 with config A (and the variant) and GEMM2 with the launcher's kernel of config B. A
warp-specialized config (WS, sm_90a) builds its macro variants through cuda.core, without the
TIMES records.
--bench-routing T0,..,T:j times, at T (the last count named, one of --tokens), bench_quant's
routing j of a run of those tokens instead of the probe's own draw (bench_quant.routings_of);
--flush read flushes the L2 as bench_quant does (a 128 MB read; the default is a 128 MB memset:
the same times within 1-2%, dev_wna16_20261201e).
    python benchmarks/dev/probe_staged.py [--configs t24,t24+S=3,base:t24] [--tokens 64]
                                          [--variants base,PROBE=1,TIMES=1+PROBE=3]
                                          [--base-cu quant_gemm_wna16_staged_base.cu]
                                          [--bench-routing 1,16,64:1] [--flush read]"""
import argparse
import json
import sys

import numpy as np

sys.path.insert(0, ".")
from benchmarks.bench_wna16 import (E, H, I, K, Timer, _config_override,  # noqa: E402
                                    draw_routing, mixtral_weights, random_bf16)
from cuda_kernels.cupy import _compile as C  # noqa: E402
from cuda_kernels.cupy import quant_gemm_wna16 as W  # noqa: E402

READ = r"""
extern "C" __global__ void read_all(const uint4* __restrict__ p, size_t n, unsigned* out) {
    unsigned x = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = p[i];
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x12345678u) out[0] = x;
}
"""


# variant keys that are compiler options, not macros: MAXREG=n (--maxrregcount), PTXO=n
# (ptxas -On)
_OPTIONS = {"MAXREG": "--maxrregcount={}", "PTXO": "--ptxas-options=-O{}"}


def _module(cupy, cu, cfg, var):
    """(kernel name, compiled RawModule, macros) of config cfg under variant var ("base", or
    "PROBE=1+TIMES=1": the STAGED_ dev macros, and the compiler options of _OPTIONS)."""
    if var.startswith("cubin="):                # a cubin built elsewhere (another ptxas, say),
        path = var[6:]                          # beside it the kernel's mangled name, PATH.name
        fn = C._function_of_cubin(open(path, "rb").read(), open(path + ".name").read().strip())
        return W.staged_kernel_name(cfg, False), _Loaded(fn), {}
    name = W.staged_kernel_name(cfg, False)
    ws_opts = W.staged_options(cfg)             # (sm_90a for a warp-specialized config)
    if var == "base" and cu == W.CU_STAGED:     # the launcher's kernel: its prebuilt cubin where
        fn = C._prebuilt_kernel(C.source_text(cu, dict(ELEM_BF16=1)), cu, name,
                                C.required_arch(ws_opts), ws_opts)
        if fn is not None:                      # it has one (cuda_kernels/cupy/prebuilt)
            return name, _Loaded(fn), {}
    pairs = [] if var == "base" else [kv.split("=") for kv in var.split("+")]
    defs = {f"STAGED_{k}": int(v) for k, v in pairs if k not in _OPTIONS}
    opts = tuple(_OPTIONS[k].format(int(v)) for k, v in pairs if k in _OPTIONS)
    if ws_opts:                                 # built by cuda.core (no TIMES records: their
        src = C.source_text(cu, dict(ELEM_BF16=1, **defs))     # global needs a RawModule)
        return name, _Loaded(C._load_with_cuda_core(src, cu, name, (name,),
                                                    C.required_arch(ws_opts), ws_opts + opts)), defs
    mod = cupy.RawModule(code=C.source_text(cu, dict(ELEM_BF16=1, **defs)),
                         options=C._BASE_OPTIONS + opts +
                         tuple(f"-I{d}" for d in C.cuda_include_dirs()),
                         name_expressions=(name,))
    mod.get_function(name)                      # compiles (or loads CuPy's cached cubin)
    return name, mod, defs


class _Loaded:
    """A kernel loaded from a cubin, handed out as a module's get_function would."""

    def __init__(self, fn):
        self.fn = fn

    def get_function(self, _name):
        return self.fn


def _own_variants(spec: str, variants: str):
    """("t24+TEAMS=2+MINB=1", ["TEAMS=2"]) from "t24+TEAMS=2+MINB=1@TEAMS=2": a config that
    runs only its own variant (a launch that needs its macro), else --variants."""
    spec, _, own = spec.partition("@")
    return spec, [own] if own else variants.split(",")


def _bench_routing_spec(spec: str):
    """([1, 16, 64], 2) from "1,16,64:2"."""
    tokens, _, j = spec.partition(":")
    try:
        return [int(t) for t in tokens.split(",")], int(j)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected T0,T1,..,T:j, got {spec!r}") from None


def _rel_diff(x16, y16) -> float:
    """||x - y|| / ||y|| of two bf16 arrays given as their uint16 bits (NaN where one is)."""
    f = [(v.astype(np.uint32) << 16).view(np.float32).astype(np.float64) for v in (x16, y16)]
    return float(np.linalg.norm(f[0] - f[1]) / np.linalg.norm(f[1]))


def main():
    import cupy
    from reference import moe_align_block_size
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="t24")
    p.add_argument("--tokens", default="64")
    p.add_argument("--variants", default="base,PROBE=1,PROBE=3")
    p.add_argument("--out", default="/tmp")
    p.add_argument("--bench-routing", type=_bench_routing_spec, default=None,
                   help="T0,T1,..,T:j: at T, bench_quant's routing j of a run of --tokens "
                        "T0,T1,..,T (its draws in order), in place of the probe's own")
    p.add_argument("--flush", choices=("write", "read"), default="write",
                   help="how the L2 is flushed before each repetition: a 128 MB memset (write) "
                        "or bench_quant's 128 MB read")
    p.add_argument("--base-cu", default="quant_gemm_wna16_staged_base.cu",
                   help="the kernel of the base: configs (in cuda_kernels/cupy)")
    p.add_argument("--compile-only", action="store_true",
                   help="only build the modules (CuPy's disk cache): run several in parallel "
                        "before the timed call")
    args = p.parse_args()
    if args.bench_routing and args.bench_routing[0][-1] not in map(int, args.tokens.split(",")):
        raise SystemExit(f"--bench-routing: names the routing at T = {args.bench_routing[0][-1]}"
                         f" (its last token count), not among --tokens {args.tokens}")
    if args.compile_only:
        for spec0 in args.configs.split(","):
            spec, variants = _own_variants(spec0, args.variants)
            base = spec.startswith("base:")
            _, cfg = _config_override(dict(W.STAGED_CONFIGS), spec[5:] if base else spec)
            for var in variants:
                _module(cupy, args.base_cu if base else W.CU_STAGED, cfg, var)
        return
    w1, w2, s1, s2 = mixtral_weights()
    timer, rows = Timer(), []
    if args.flush == "read":         # bench_quant's default: a 128 MB read leaves clean lines
        fl = lambda: timer.flush.sum(dtype=cupy.uint32)  # noqa: E731
    else:                            # a 128 MB memset (this probe's method until 2026-12-01)
        fl = lambda: timer.flush.fill(1)  # noqa: E731
    read = cupy.RawKernel(READ, "read_all")
    sink = cupy.zeros(1, cupy.uint32)
    for w in (w1, w2):
        n = w.nbytes // 16
        for blocks in (132 * 4, 132 * 8, 132 * 16):
            t = timer(lambda: read((blocks,), (512,), (w, np.uint64(n), sink)), fl, 3, 20)
            rows.append(dict(read_bytes=w.nbytes, blocks=blocks, us=t * 1e3,
                             TBps=w.nbytes / t / 1e9))
            print(f"read {w.nbytes / 1e6:.0f} MB, {blocks} x 512: {t * 1e3:7.1f} us, "
                  f"{w.nbytes / t / 1e9:.2f} TB/s", flush=True)
    rng = np.random.default_rng(0)
    dev = cupy.cuda.Device().id
    for T in map(int, args.tokens.split(",")):
        ids, tw = draw_routing(rng, T)
        if args.bench_routing and T == args.bench_routing[0][-1]:
            from benchmarks import bench_quant as BQ
            tokens, j = args.bench_routing
            ids, tw = BQ.routings_of(tokens, E, K)[j]
        x, act = random_bf16((T, H), 10 + T), random_bf16((T * K, I), 20 + T)
        base_bits = None        # the first config's "base" outputs: every other variant's bits
        for spec0 in args.configs.split(","):    # are checked against them
            spec, variants = _own_variants(spec0, args.variants)
            # "base:t24": t24's launch with the kernel of --base-cu (an earlier version of the
            # .cu beside it, same arguments and template), for a same-call baseline
            base = spec.startswith("base:")
            # "A%B": GEMM1 runs config A (and the variant), GEMM2 the launcher's kernel of B
            spec, _, spec2 = spec.partition("%")
            cfg_label = f"{spec}%{spec2}" if spec2 else spec
            cname, cfg = _config_override(dict(W.STAGED_CONFIGS), spec[5:] if base else spec)
            cfg2 = _config_override(dict(W.STAGED_CONFIGS), spec2)[1] if spec2 else cfg
            B = -(-32 // (8 * cfg["MT"])) * 8 * cfg["MT"]
            st, ex, ntp = (C.to_device(v) for v in moe_align_block_size(ids, B, E))
            twd = C.to_device(tw)
            g1 = lambda: W.grouped_gemm_wna16(x, w1, st, ex, ntp, K, B, w_scale=s1,  # noqa: E731
                                              use_int4_w4a16=True, config=cfg)

            def g2(programmatic=False):
                return W.grouped_gemm_wna16(act, w2, st, ex, ntp, 1, B, twd, True, w_scale=s2,
                                            use_int4_w4a16=True, config=cfg2,
                                            programmatic=programmatic)

            def layer():            # GEMM1, then GEMM2 launched programmatically (bench_quant's)
                g1()
                g2(programmatic=True)
            for var in variants:
                W._READY.clear()
                W._SMEM_SET.clear()
                name, mod, defs = _module(cupy, args.base_cu if base else W.CU_STAGED, cfg, var)
                W._READY[(name, 1, dev)] = mod.get_function(name)
                bits = [cupy.asnumpy(g().view(cupy.uint16)) for g in (g1, g2)]
                same = None                       # a variant that keeps the math: same bits?
                if var == "base" and base_bits is None:
                    base_bits = bits
                elif base_bits is not None and not defs.get("STAGED_PROBE"):
                    same = all(np.array_equal(x, y) for x, y in zip(bits, base_bits))
                    # other bits (a variant that splits the work otherwise): how far, by the
                    # relative Frobenius difference of each GEMM's output (bf16 rounding ~1e-3)
                    diff = "" if same else " (relative difference g1 / g2 " + " / ".join(
                        f"{_rel_diff(x, y):.1e}" for x, y in zip(bits, base_bits)) + ")"
                    print(f"T={T} {cfg_label} {var}: {'the same' if same else 'OTHER'} bits as "
                          f"base{diff}", flush=True)
                if defs.get("STAGED_TIMES"):
                    ptr = mod.get_global("g_cta_times")
                    tt = cupy.ndarray((4096, 18), cupy.uint64, memptr=ptr)
                    for label, g in (("g1", g1), ("g2", g2)):
                        tt.fill(0)
                        fl()
                        cupy.cuda.runtime.deviceSynchronize()
                        g()
                        cupy.cuda.runtime.deviceSynchronize()
                        h = cupy.asnumpy(tt)
                        h = h[h[:, 1] > 0].astype(np.float64)
                        t0 = h[:, 0].min()
                        t_s, t_e = (h[:, 0] - t0) / 1e3, (h[:, 1] - t0) / 1e3
                        q = np.percentile(t_e, [0, 10, 50, 90, 100])
                        lt = h[:, 4] / np.maximum(h[:, 3], 1)
                        r = np.corrcoef(lt, t_e - t_s)[0, 1] if lt.std() > 0 else 0.0
                        print(f"  {label}: {len(h)} CTAs, start max {t_s.max():.1f} us, end "
                              f"p0/10/50/90/100 " + " ".join(f"{v:.1f}" for v in q) +
                              f" us; duration p50 {np.median(t_e - t_s):.1f}; units "
                              f"{h[:, 3].min():.0f}-{h[:, 3].max():.0f}, mean LT {lt.min():.2f}-"
                              f"{lt.max():.2f}, corr(LT, duration) {r:.2f}", flush=True)
                        first = (h[:, 5] - t0) / 1e3
                        mhz = (h[:, 17] - h[:, 16]) / np.maximum(h[:, 1] - h[:, 0], 1) * 1e3
                        print(f"      SM clock (cycles / ns of each CTA) p0/50/100 "
                              f"{mhz.min():.0f} {np.median(mhz):.0f} {mhz.max():.0f} MHz",
                              flush=True)
                        ends = h[:, 6] / 1.8e3          # SM cycles at ~1.8 GHz
                        print(f"      first stage landed p0/50/100 {first.min():.1f} "
                              f"{np.median(first):.1f} {first.max():.1f} us; ending blocks "
                              f"p50/100 ~{np.median(ends):.1f} {ends.max():.1f} us; parts "
                              f"{h[:, 7].min():.0f}-{h[:, 7].max():.0f}; of them whole stores "
                              f"p50/100 ~{np.median(h[:, 8]) / 1.8e3:.1f} "
                              f"{h[:, 8].max() / 1.8e3:.1f} us", flush=True)
                        two = h[:, 7] == 2               # a part mid-run, and one at the end
                        every = np.ones(len(h), bool)
                        us = lambda col, m=two: np.median(h[m, col]) / 1.8e3  # noqa: E731
                        print(f"      parts p50 (us): fences {us(9, every):.1f}, count "
                              f"{us(10, every):.1f}, adding {us(11, every):.1f}; of runs with "
                              f"two ({two.sum()}), the first part {us(12):.1f} (fence "
                              f"{us(14):.1f}), the last {us(13):.1f} (fence {us(15):.1f})",
                              flush=True)
                        rows.append(dict(T=T, config=cfg_label, variant=var, gemm=label,
                                         start_us=t_s.round(2).tolist(),
                                         end_us=t_e.round(2).tolist(),
                                         sm=h[:, 2].astype(int).tolist(),
                                         units=h[:, 3].astype(int).tolist(),
                                         lt_units=h[:, 4].astype(int).tolist(),
                                         first_us=first.round(2).tolist(),
                                         end_blocks_cycles=h[:, 6].astype(int).tolist(),
                                         parts=h[:, 7].astype(int).tolist(),
                                         part_cycles=h[:, 9:16].astype(int).tolist(),
                                         sm_mhz=mhz.round(1).tolist()))
                t1, t2 = timer(g1, fl, 3, 20), timer(g2, fl, 3, 20)
                tl = timer(layer, fl, 3, 20)
                rows.append(dict(T=T, config=cfg_label, variant=var, gemm1_us=t1 * 1e3,
                                 gemm2_us=t2 * 1e3, layer_pdl_us=tl * 1e3,
                                 same_bits_as_base=same))
                print(f"T={T} {cfg_label} {var}: g1 {t1 * 1e3:7.1f} us g2 {t2 * 1e3:7.1f} us, "
                      f"layer (GEMM2 programmatic) {tl * 1e3:7.1f} us", flush=True)
    json.dump(rows, open(f"{args.out}/probe_staged.json", "w"), indent=1)


if __name__ == "__main__":
    main()
