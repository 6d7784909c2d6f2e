"""The w8a8 grouped GEMM of the fused MoE layer (fp8 e4m3 or int8 activations and weights, fp32
scales) as a ladder of kernels, one .cu per rung.

    c[s] = (deq(a)[s // top_k] @ deq(w[e]).T + bias[e]) * r[s]
    (r = topk_weights.flat when mul_routed_weight, else 1)

for every live position of sorted_token_ids, fp32 accumulation, one rounding to bf16 / fp16;
e == -1 writes zeros (reference/quant.py's grouped_gemm_quant; quant/gemm.py, the stage,
sends the w8a8 formats here).

Shape legend: T tokens, E experts, K top-k, P = a.shape[0] * top_k slots, N output width (2I
for GEMM1, H for GEMM2), Kdim reduction width (H, I), L = len(sorted_token_ids),
KB = cdiv(Kdim, 128), NB = cdiv(N, 128).

    format  a [M_a, Kdim]        w [E, N, Kdim]       a_scale (fp32)          w_scale (fp32)
    fp8     uint8 (e4m3 bytes)   uint8 (e4m3 bytes)   [1] | [M_a, 1] |        [E] | [E, N] |
    int8    int8                 int8                 [M_a, KB]               [E, NB, KB]

fp8 codes travel as uint8 arrays of their e4m3fn bytes (CuPy has no fp8 dtype;
quant/act.py's fp8_to_device). Block quantization is DeepSeek-V3's block_shape [128, 128]
(1x128 activation groups, 128x128 weight blocks).

The ladder (version=, config= a name of configs.CONFIGS["w8a8"]; by default the route
configs.ROUTES["fp8" / "int8"] picks by rows per expert):
    v1  w8a8_v1_naive.cu   one thread per output, CUDA cores (any shape; the fallback)
    v2  w8a8_v2_mma.cu     mma.sync m16n8k32 e4m3 (sm_89+) / s8 (sm_80+), per-block scales on
                           the partial sums in registers, a cp.async ring (m16, m64)
    v3  w8a8_v3_gemv.cu    fp8 decode: weight streaming, weights as the mma's A, tokens as its
                           B (sm_89+, Kdim % 128 == 0; up to 4 rows per expert)
    v4  w8a8_v4_wgmma.cu   fp8 on Hopper: wgmma.m64nBNk32 e4m3 from 128-byte-swizzled tiles,
                           per-block promotion in fp32 (sm_90a; above 4 rows per expert)

Napkin math at decode (H200, 4.8 TB/s): DeepSeek-V3 fp8 T=1 reads 8 experts' w13 + w2 codes
and scales, 8 * 44 MB = 352 MB -> 73 us.

Run as a script to validate every rung against the reference and time the default one:
    python -m cuda_kernels.cupy.quant.w8a8 [--quick]
"""
from __future__ import annotations

import numpy as np

from reference.quant import block_shape_of

from .. import _arrays as A
from .._geometry import cdiv
from .._script import rel_err, script_start
from . import configs as Q
from . import epilogue as EP

CU = {"v1": "quant/w8a8_v1_naive.cu", "v2": "quant/w8a8_v2_mma.cu",
      "v3": "quant/w8a8_v3_gemv.cu", "v4": "quant/w8a8_v4_wgmma.cu"}
OPTIONS = {"v4": ("-arch=sm_90a",)}       # wgmma exists only in sm_90a code
QT = {"fp8": 0, "int8": 1}
KBLOCK = 128                              # the K width of a DeepSeek-V3 quantization block
ROW = KBLOCK + 16                         # v2's padded shared row, bytes (see w8a8_v2_mma.cu)


def kernel_name(rung: str, fmt: str, cfg: dict) -> str:
    """The instantiation of `rung` for `fmt` ("fp8" / "int8") with `cfg`'s tunables."""
    if rung == "v1":
        return EP.instantiation("w8a8_v1_naive", QT[fmt])
    if rung == "v2":
        return EP.instantiation("w8a8_v2_mma", QT[fmt], *(cfg[k] for k in (
            "BM", "BN", "WARPS_M", "WARPS_N", "STAGES")))
    if rung == "v3":
        return EP.instantiation("w8a8_v3_gemv", cfg["BM"] // 8, cfg["WARPS"], cfg["U"],
                                cfg["MINB"], cfg.get("PF", 0))
    return EP.instantiation("w8a8_v4_wgmma", cfg["BM"], cfg["BN"], cfg["STAGES"])


def smem_bytes(rung: str, cfg: dict) -> int:
    """Dynamic shared memory of one CTA.
    v2: the sA + sW rings, per-stage a scales, per-stage w scale (padded to 16 B), slots and rows
    v3: the warps' partial sums [WARPS][BM][16] fp32, then rows and slots
    v4: 1024 (alignment of the swizzled ring) + the ring + per-stage a scales + w scales (16 B
        padded) + rows and slots"""
    if rung == "v1":
        return 0
    if rung == "v3":
        return cfg["WARPS"] * cfg["BM"] * 16 * 4 + 2 * cfg["BM"] * 4
    st, bm, bn = cfg["STAGES"], cfg["BM"], cfg["BN"]
    if rung == "v2":
        return st * (bm + bn) * ROW + st * bm * 4 + 16 * cdiv(st * 4, 16) + 2 * bm * 4
    return 1024 + st * ((bm + bn) * 128 + bm * 4) + 16 * cdiv(st * 4, 16) + 2 * bm * 4


def geometry(rung: str, cfg: dict, Lg: int, N: int) -> tuple[tuple, tuple]:
    """(grid, block): v1 one CTA of 128 threads per (position, 128 columns); v2 (m tiles, n
    tiles) of WARPS_M WARPS_N warps; v3 (m tiles, 16-row n tiles) of WARPS warps; v4 (n tiles,
    m tiles) of one warpgroup per 64 rows. m tiles fastest except v4 (see its .cu)."""
    if rung == "v1":
        return (Lg, cdiv(N, 128)), (128,)
    if rung == "v2":
        return ((cdiv(Lg, cfg["BM"]), cdiv(N, cfg["BN"])),
                (cfg["WARPS_M"] * cfg["WARPS_N"] * 32,))
    if rung == "v3":
        return (cdiv(Lg, cfg["BM"]), cdiv(N, 16)), (cfg["WARPS"] * 32,)
    return (cdiv(N, cfg["BN"]), cdiv(Lg, cfg["BM"]), 1), (cfg["BM"] // 64 * 128,)


def _names(rung: str) -> tuple[str, ...]:
    """Every instantiation of `rung` the table holds (one NVRTC pass compiles them)."""
    fmts = ("fp8", "int8") if rung in ("v1", "v2") else ("fp8",)
    return tuple(dict.fromkeys(kernel_name(rung, f, c) for c in Q.CONFIGS["w8a8"].values()
                               if c["rung"] == rung for f in fmts))


NAMES = {rung: _names(rung) for rung in CU}
# Every instantiation the launcher can pick, for the CPU compile checks (one case per file and
# element type). fp8 mma needs sm_89: on sm_80 those bodies compile to a trap, never launched.
EP.register_cases(CU, NAMES, OPTIONS)


# ----------------------------------------------------------------------------- the choice
def refuses(fmt: str, cc: int, K: int, block_size: int, aligned: bool):
    """The route's check for one problem on a device of compute capability `cc`:
    refuses(cfg) -> None when cfg's rung runs it, else why not (`aligned`: a and w start on
    16-byte boundaries). Pure: the CPU tests ask it about any device."""
    def why(cfg):
        rung = cfg["rung"]
        if rung in ("v3", "v4") and fmt != "fp8":
            return f"{rung} is an fp8 rung (int8 runs v1 or v2)"
        if rung in ("v2", "v4") and K % 16:
            return f"{rung} loads 16-byte chunks: Kdim must be a multiple of 16, got {K}"
        if rung in ("v2", "v3") and fmt == "fp8" and cc < 89:
            return f"fp8 tensor cores need sm_89+, this device is sm_{cc}"
        if rung == "v3" and K % KBLOCK:
            return f"v3 streams 128-wide K blocks: Kdim must be a multiple of 128, got {K}"
        if rung == "v4" and cc != 90:
            return f"v4 (wgmma, built for sm_90a) runs on compute capability 9.0 only, got {cc}"
        return None
    return Q.refusal(block_size, aligned, why)


def default_rung(fmt: str, rows_per_expert: float, block_size: int, Kdim: int, cc: int) -> str:
    """The config grouped_gemm_w8a8 runs by default for 16-byte aligned operands, as
    "rung config" (benchmarks record it)."""
    name, cfg = Q.route(fmt, rows_per_expert, Kdim, refuses(fmt, cc, Kdim, block_size, True))
    return f"{cfg['rung']} {name}"


# ----------------------------------------------------------------------------- the launcher
def grouped_gemm_w8a8(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                      block_size, topk_weights=None, mul_routed_weight=False, bias=None,
                      a_scale=None, w_scale=None, fmt="fp8", per_act_token_quant=False,
                      per_channel_quant=False, block_shape=None, out_dtype=None, *,
                      version=None, config=None, out=None):
    """c [a.shape[0] * top_k, N] on the GPU (see the module doc): fmt "fp8" or "int8"; the
    other arguments are quant/gemm.py grouped_gemm_quant's. version: "v1".."v4" or None (the
    route); config: a name of configs.CONFIGS["w8a8"] or a dict of tunables (with its "rung");
    out: a [P, N] array to write (tests poison it first), else one is allocated."""
    import cupy

    if fmt not in QT:
        raise ValueError(f"fmt: expected 'fp8' or 'int8', got {fmt!r}")
    top_k, block_size, L = EP.check_routing(sorted_token_ids, expert_ids,
                                            num_tokens_post_padded, top_k, block_size)
    code_dt = np.uint8 if fmt == "fp8" else np.int8
    hint = " (fp8 codes travel as their uint8 bytes)" if fmt == "fp8" else ""
    try:
        A.check_array("a", a, ndim=2, dtypes=(code_dt,))
        EP.check_weights(w, (code_dt,))
    except TypeError as err:
        raise TypeError(f"{err}{hint}") from None
    M_a, K = a.shape
    E, N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"w: expected shape (E, N, {K}) to match a's columns, got {w.shape}")
    out_key = EP.elem_key(out_dtype if out_dtype is not None else A.bf16_dtype())
    bs = block_shape_of(block_shape)
    if bs is not None and bs != (KBLOCK, KBLOCK):
        raise ValueError(f"block_shape: the GPU kernels do DeepSeek-V3's [128, 128] blocks, "
                         f"got {list(bs)}")
    if a_scale is None or w_scale is None:
        raise ValueError(f"{'a_scale' if a_scale is None else 'w_scale'}: expected the "
                         f"scales of a w8a8 format, got None")
    if bs is not None:                     # DeepSeek-V3 blocks: kinds 2 and 2
        a_kind = w_kind = 2
        a_s = EP.f32("a_scale", a_scale, shape=(M_a, cdiv(K, KBLOCK)))
        w_s = EP.f32("w_scale", w_scale, shape=(E, cdiv(N, KBLOCK), cdiv(K, KBLOCK)))
    else:
        if per_act_token_quant:
            if a_scale.size != M_a or a_scale.ndim not in (1, 2):
                raise ValueError(f"a_scale: expected per-token scales ({M_a}, 1), got "
                                 f"{a_scale.shape}")
            a_kind = 1
        else:
            if a_scale.size != 1:
                raise ValueError(f"a_scale: expected one per-tensor scale (pass "
                                 f"per_act_token_quant=True for [M, 1]), got {a_scale.shape}")
            a_kind = 0
        a_s = EP.f32("a_scale", a_scale).reshape(-1)
        if per_channel_quant:
            if w_scale.shape not in ((E, N), (E, N, 1)):
                raise ValueError(f"w_scale: expected per-channel scales ({E}, {N}), got "
                                 f"{w_scale.shape}")
            w_kind = 1
        else:
            if w_scale.shape not in ((E,), (E, 1), (E, 1, 1)):
                raise ValueError(f"w_scale: expected one scale per expert ({E},), got "
                                 f"{w_scale.shape}")
            w_kind = 0
        w_s = EP.f32("w_scale", w_scale).reshape(-1)
    P = M_a * top_k
    tw, b32, c = EP.epilogue_operands(P, E, N, out_key, mul_routed_weight, topk_weights, bias,
                                      out)
    if P == 0 or N == 0 or L == 0:
        return c

    cc = int(cupy.cuda.Device().compute_capability)
    _, cfg = Q.route(fmt, P / max(E, 1), K, refuses(fmt, cc, K, block_size, EP.aligned(a, w)),
                     version, config)
    rung = cfg["rung"]
    Lg = EP.positions(L, P, block_size)
    grid, block = geometry(rung, cfg, Lg, N)
    if rung == "v4" and grid[1] > 65535:
        raise ValueError(f"sorted_token_ids: {Lg} positions need {grid[1]} row tiles, over the "
                         f"grid's 65535 (use version='v2')")
    if rung != "v4" and grid[1] > 65535:
        raise ValueError(f"w: N = {N} needs {grid[1]} column tiles, over the grid's 65535")
    smem = smem_bytes(rung, cfg)
    kern = EP.kernel(CU[rung], kernel_name(rung, fmt, cfg), NAMES[rung], EP.ELEMS[out_key],
                     smem, OPTIONS.get(rung, ()))
    null = A.null_ptr()
    args = (a.view(cupy.uint8), w.view(cupy.uint8), A.raw(c), a_s, w_s,
            sorted_token_ids, expert_ids, num_tokens_post_padded,
            tw if tw is not None else null, b32 if b32 is not None else null,
            np.int32(N), np.int32(K), np.int32(P), np.int32(top_k), np.int32(block_size),
            np.int32(L), np.int32(bool(mul_routed_weight)), np.int32(a_kind), np.int32(w_kind))
    kern(grid, block, args, shared_mem=smem)
    return c


# ----------------------------------------------------------------------------- script
def _main(argv=None):  # pragma: no cover - needs a GPU
    """Validate every rung (where it applies) of fp8 and int8 with block, per-tensor and
    per-channel scales against reference.quant.grouped_gemm_quant on small problems (nasty
    shapes included), then time the default rung at DeepSeek-V3's GEMM1. --quick: the
    validation only, small (for compute-sanitizer; it runs v3 and v4 too)."""
    import cupy
    import ml_dtypes

    from reference import moe_align_block_size
    from reference import quant as RQ

    from .act import fp8_to_device

    quick, timed = script_start(argv)  # (exits with the reason when no GPU is usable)
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16

    def up(x):
        if x is None:
            return None
        return fp8_to_device(x) if x.dtype == RQ.FP8_DTYPE else A.to_device(x)

    failures = 0
    formats = [("fp8 block", "fp8", dict(block_shape=[128, 128]), "block"),
               ("fp8 tensor", "fp8", {}, "tensor"),
               ("fp8 channel", "fp8", dict(per_act_token_quant=True, per_channel_quant=True),
                "channel"),
               ("int8 channel", "int8", dict(per_act_token_quant=True, per_channel_quant=True),
                "channel"),
               ("int8 block", "int8", dict(block_shape=[128, 128]), "block")]
    # the last: a decode batch (block 16, Kdim % 128 == 0), where fp8 picks v3 by default
    shapes = [(5, 4, 2, 136, 320, 16), (33, 6, 3, 256, 256, 32), (70, 3, 1, 200, 384, 64),
              (3, 4, 2, 72, 256, 16)]
    for (M_a, E, K, N, Kd, B) in ([shapes[0], shapes[2], shapes[3]] if quick else shapes):
        x = rng.standard_normal((M_a, Kd)).astype(bf16)
        wf = (rng.standard_normal((E, N, Kd)) * 0.05).astype(bf16)
        ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
        ids[:, 0] = 0 if M_a > 30 else ids[:, 0]              # a crowded expert
        st, ex, ntp = moe_align_block_size(ids, B, E)
        tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
        for name, fmt, flags, gran in formats:
            aq, as_ = RQ.moe_kernel_quantize_input(x, None, fmt,
                                                   flags.get("per_act_token_quant", False),
                                                   flags.get("block_shape"))
            wq, ws = (RQ.quantize_weight_fp8 if fmt == "fp8" else RQ.quantize_weight_int8)(wf, gran)
            want = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, K, B, tw, True, a_scale=as_,
                                         w_scale=ws, **{f"use_{fmt}_w8a8": True}, **flags)
            for ver in Q.RUNGS["w8a8"]:
                outd = A.empty((M_a * K, N), bf16)
                A.raw(outd).fill(0x7FC0)                        # poison: bf16 NaN
                try:
                    got = grouped_gemm_w8a8(up(aq), up(wq), up(st), up(ex), up(ntp), K, B,
                                            up(tw), True, a_scale=up(as_), w_scale=up(ws),
                                            fmt=fmt, version=ver, out=outd, **flags)
                    host = A.to_host(got)
                    host = host.view(bf16) if host.dtype == np.uint16 else host
                    err = rel_err(host.astype(np.float32), want.astype(np.float32))
                    status = "ok" if err <= 1e-2 else "FAIL"
                except ValueError as e:
                    err, status = float("nan"), f"skip ({e})"
                failures += status == "FAIL"
                print(f"{name:13s} {ver} M_a={M_a:3d} E={E} K={K} N={N:4d} Kdim={Kd:4d} B={B:3d} "
                      f"rel_err={err:.2e} {status}")
    if quick:
        raise SystemExit(1 if failures else 0)

    # timing: DeepSeek-V3's GEMM1, fp8 block, the default rung; the codes' values do not
    # change the time (0x38 is fp8 1.0)
    E, K, N, Kd = 256, 8, 4096, 7168
    cc = int(cupy.cuda.Device().compute_capability)
    w = cupy.full((E, N, Kd), 0x38, dtype=cupy.uint8)
    ws = cupy.random.uniform(1e-3, 2e-3, (E, N // 128, Kd // 128), dtype=cupy.float32)
    for T in (1, 64, 1024):
        ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
        B = Q.block_size_for("fp8", T * K / E)
        st, ex, ntp = (A.to_device(v) for v in moe_align_block_size(ids, B, E))
        a = cupy.full((T, Kd), 0x38, dtype=cupy.uint8)
        as_ = cupy.random.uniform(1e-3, 2e-3, (T, Kd // 128), dtype=cupy.float32)

        def run():
            grouped_gemm_w8a8(a, w, st, ex, ntp, K, B, a_scale=as_, w_scale=ws, fmt="fp8",
                              block_shape=[128, 128])
        t = timed(run).median * 1e-3
        nbytes = Q.quant_weight_bytes("fp8", len(np.unique(ids)), N, Kd)
        flops = Q.gemm_flops(T * K, N, Kd)
        floor = max(nbytes / Q.HBM_BYTES_PER_S, flops / Q.PEAK_FP8)
        print(f"DeepSeek-V3 GEMM1 fp8 {default_rung('fp8', T * K / E, B, Kd, cc)} T={T:5d}: "
              f"{t * 1e6:9.1f} us  {nbytes / t / 1e12:5.2f} TB/s  {flops / t / 1e12:7.1f} "
              f"TFLOP/s  roofline {floor / t:5.1%}")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":  # pragma: no cover
    _main()
