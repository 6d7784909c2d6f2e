"""The weight-only grouped GEMM of the fused MoE layer (int4 / int8 weights with per-group
scales, bf16 / fp16 activations) as a ladder of kernels, one .cu per rung.

    c[s] = (a[s // top_k] @ deq(w[e]).T + bias[e]) * r[s],  deq(w)[n, k] = (q - zp) * s[n, k // gs]
    (r = topk_weights.flat when mul_routed_weight, else 1)

for every live position of sorted_token_ids, fp32 accumulation, one rounding to a's dtype;
e == -1 writes zeros (reference/quant.py's grouped_gemm_quant with use_int4_w4a16 /
use_int8_w8a16; quant/gemm.py, the stage, sends the weight-only formats here).

Shape legend: T tokens, E experts, K top-k, P = a.shape[0] * top_k slots, N output width (2I
for GEMM1, H for GEMM2), Kdim reduction width, G = Kdim / group_size groups per row,
L = len(sorted_token_ids).

    a        [M_a, Kdim]      bf16 / fp16
    w        [E, N, Kdim / 2] uint8 (int4, k = 2j in the low nibble of byte j)
             [E, N, Kdim]     uint8 (zero point 128) or int8 (symmetric)
    w_scale  [E, N, G]        fp32 (bf16 / fp16 accepted, widened)
    w_zp     [E, N, G]        uint8 or None (8 for int4, 128 for uint8 / int8 codes)
    c        [P, N]           a's dtype

The ladder (version=, config= a name of configs.CONFIGS["wna16"]; by default the route
configs.ROUTES["int4" / "w8a16"] picks by rows per expert); docs/int4_staged.md walks v3-v6
with their measurements:
    v1  wna16_v1_naive.cu   dequantize, then multiply: one thread per output (any shape)
    v2  wna16_v2_mma.cu     tensor cores (mma.sync m16n8k16) on weights dequantized in
                            registers, a cp.async ring (m16, m64: prefill, and int8 weights)
    v3  wna16_v3_gemv.cu    decode: the weights streamed into registers as the mma's A, the
                            tokens as its B (int4, Kdim and group_size multiples of 128)
    v4  wna16_v4_packed.cu  decode on weights prepacked once (wna16_packed.prepack_int4) so
                            that each warp load is the lanes' mma fragments (q8: <= 8 rows)
    v5  wna16_v5_staged.cu  the packed weights and the tokens staged together through one
                            cp.async pipeline, runs of equal cost over one wave of CTAs, a
                            warp-specialized CTA on sm_90 (t24ws, t24, t32: 9-128 rows)
    v6  wna16_v6_wgmma.cu   Hopper wgmma with the dequantized weights as register A (h32;
                            opt-in, never routed)
v4-v6 take int4 with N % 16 == 0 (v6: 64), Kdim % 64 == 0 and group sizes 64 times a power of
two (or one group per row); their packed weights are cached per weight array
(packed_weights: call forget_packed() after writing weights in place).

Napkin math (H200, 4.8 TB/s): Mixtral int4 (E=8, top-2, H=4096, I=14336, group 128) at T=1
reads 2 experts' w13 + w2 codes and scales, 187 MB -> 39 us; the route takes 62 us (v4), at
T = 64 262 us against a 156 us floor (v5; benchmarks/bench_quant.py).

Run as a script to validate every rung and config against the reference and time the route
at Mixtral's shapes:
    python -m cuda_kernels.cupy.quant.wna16 [--quick]
"""
from __future__ import annotations

import numpy as np

from reference.quant import wna16_group_size

from .. import _arrays as A
from .._geometry import cdiv
from .._launch import launch
from .._script import rel_err, script_start
from . import configs as Q
from . import epilogue as EP
from . import wna16_packed as P4
from . import wna16_staged as S5
from . import wna16_wgmma as W6

CU = {"v1": "quant/wna16_v1_naive.cu", "v2": "quant/wna16_v2_mma.cu",
      "v3": "quant/wna16_v3_gemv.cu"}
V3_KSTEP = 128                    # v3's K step: 32 codes per thread, one scale per step
PACK_CACHE_SIZE = 64              # packed weight sets kept (two per MoE layer)


def kernel_name(rung: str, nbits: int, cfg: dict) -> str:
    """The instantiation of rung v1-v3 for nbits-wide codes with `cfg`'s tunables."""
    if rung == "v1":
        return EP.instantiation("wna16_v1_naive", nbits)
    if rung == "v2":
        return EP.instantiation("wna16_v2_mma", nbits, *(cfg[k] for k in (
            "BM", "BN", "BK", "WARPS_M", "WARPS_N", "STAGES")))
    return EP.instantiation("wna16_v3_gemv", cfg["BM"] // 8, cfg["WARPS"], cfg["U"],
                            cfg["MINB"])


def v2_rows(cfg: dict, nbits: int) -> tuple[int, int]:
    """(A row bytes, W row bytes) of v2's padded shared tiles."""
    wb = cfg["BK"] * nbits // 8
    return cfg["BK"] * 2 + 16, (48 if wb == 16 else wb + 16)


def smem_bytes(rung: str, cfg: dict, nbits: int) -> int:
    """Dynamic shared memory of one CTA of v1-v3.
    v2: the A and W rings, then rows and slots; v3: the warps' partial sums [WARPS][BM][16]
    fp32, then rows and slots."""
    if rung == "v1":
        return 0
    if rung == "v3":
        return cfg["WARPS"] * cfg["BM"] * 16 * 4 + 2 * cfg["BM"] * 4
    arow, wrow = v2_rows(cfg, nbits)
    return cfg["STAGES"] * (cfg["BM"] * arow + cfg["BN"] * wrow) + 2 * cfg["BM"] * 4


def group_ok(group_size: int, num_groups: int, bk: int) -> bool:
    """v2 holds 1, 2 or 4 groups per K tile: group_size a multiple of bk (or one group per
    row), or bk / group_size in {2, 4} with group_size a multiple of 16."""
    if num_groups == 1 or group_size % bk == 0:
        return True
    return group_size % 16 == 0 and bk % group_size == 0 and bk // group_size in (2, 4)


def _names(rung: str) -> tuple[str, ...]:
    bits = (4,) if rung == "v3" else (4, 8)
    return tuple(dict.fromkeys(kernel_name(rung, b, c) for c in Q.CONFIGS["wna16"].values()
                               if c["rung"] == rung for b in bits))


NAMES = {rung: _names(rung) for rung in CU}
EP.register_cases(CU, NAMES)      # one NVRTC check per file and element type


# ----------------------------------------------------------------------------- the choice
def refuses(nbits: int, cc: int, N: int, K: int, group_size: int, num_groups: int,
            block_size: int, aligned: bool):
    """The weight-only route's check of one problem with `nbits`-wide codes on a device of
    compute capability `cc` (w8a8.refuses' contract): refuses(cfg) -> None when cfg's rung
    runs it, else why not. Pure: the CPU tests ask it about any device."""
    def why(cfg):
        rung = cfg["rung"]
        if rung == "v2":
            if K % 32:
                return f"v2 loads 16-byte chunks: Kdim must be a multiple of 32, got {K}"
            if not group_ok(group_size, num_groups, cfg["BK"]):
                return (f"v2 holds 1, 2 or 4 groups per K tile of {cfg['BK']}: group_size "
                        f"{group_size} does not nest with it")
            return None
        if nbits != 4:
            return f"{rung} streams int4 codes (int8 weight-only runs v1 or v2)"
        if rung == "v3":
            if K % V3_KSTEP or group_size % V3_KSTEP:
                return (f"v3 needs Kdim and group_size multiples of {V3_KSTEP}, got {K} and "
                        f"{group_size}")
            return None
        ok, reason = (W6.wgmma_supports(N, K, group_size, num_groups, cc) if rung == "v6" else
                      P4.packed_supports(N, K, group_size, num_groups))
        if not ok:
            return f"{rung} runs on prepacked int4: {reason}"
        if (N // 16) % cfg.get("RT", 1):
            return f"{rung}: RT = {cfg['RT']} tiles per group must divide N / 16 = {N // 16}"
        if cfg.get("WS") and cc != 90:               # (S5.device_runs_ws() on this device)
            return (f"the warp-specialized {rung} configs (WS) need an sm_90 GPU (setmaxnreg "
                    f"is sm_90a's), this one is sm_{cc}")
        return None
    return Q.refusal(block_size, aligned, why)


def default_rung(fmt: str, rows_per_expert: float, block_size: int, N: int, Kdim: int,
                 group_size: int, cc: int) -> str:
    """The config grouped_gemm_wna16 runs by default for 16-byte aligned operands, as
    "rung config" (benchmarks record it)."""
    G = Kdim // group_size
    name, cfg = Q.route(fmt, rows_per_expert, Kdim,
                        refuses(4 if fmt == "int4" else 8, cc, N, Kdim, group_size, G,
                                block_size, True))
    return f"{cfg['rung']} {name}"


# ----------------------------------------------------------------------------- packed weights
_PACKED: dict = {}


def packed_weights(w, w_scale, w_zp=None, w_scale_f32=None, order="mma"):
    """prepack_int4(w, w_scale, w_zp, order), cached per weight array: the source arrays are
    held (their memory cannot be reused for other weights while cached), so the cache is right
    as long as they are not written in place after their first use; call forget_packed() after
    writing into them. At most PACK_CACHE_SIZE sets, least recently used dropped first.
    w_scale_f32: w_scale already widened to fp32 (packed instead of w_scale, keyed by it).
    order: prepack_int4's lane order, or ("staged", NB, KC) for stage_blocks' layout (one
    cached set per order)."""
    key = tuple((id(x), x.data.ptr, x.shape, x.strides, str(x.dtype)) if x is not None else None
                for x in (w, w_scale, w_zp)) + (order,)
    hit = _PACKED.pop(key, None)
    if hit is None:
        staged = isinstance(order, tuple)           # ("staged", NB, KC): stage_blocks' layout
        pk = P4.prepack_int4(w, w_scale if w_scale_f32 is None else w_scale_f32, w_zp,
                             "mma" if staged else order)
        hit = ((w, w_scale, w_zp), S5.stage_blocks(pk, order[1], order[2]) if staged else pk)
    _PACKED[key] = hit                  # most recent last
    while len(_PACKED) > PACK_CACHE_SIZE:
        _PACKED.pop(next(iter(_PACKED)))
    return hit[1]


def forget_packed():
    """Drop every cached packed weight set (after writing into weights in place)."""
    _PACKED.clear()


# ----------------------------------------------------------------------------- the launcher
def grouped_gemm_wna16(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                       block_size, topk_weights=None, mul_routed_weight=False, bias=None,
                       w_scale=None, w_zp=None, fmt="int4", block_shape=None, out_dtype=None,
                       *, version=None, config=None, out=None, programmatic=False):
    """c [a.shape[0] * top_k, N] in a's dtype on the GPU (see the module doc): fmt "int4" or
    "w8a16"; the other arguments are quant/gemm.py grouped_gemm_quant's. version: "v1".."v6"
    or None (the route); config: a name of configs.CONFIGS["wna16"] or a dict of tunables
    (with its "rung"); out: a [P, N] array to write (tests poison it first).
    programmatic: v5 is launched with programmatic stream serialization (_launch.py), so that
    its CTAs read the routing and copy their first weights while the kernel before it on the
    stream finishes, and wait for it before they read `a` or write anything. The caller
    promises that only `a` comes from that kernel: the routing, weights, scales, bias and
    router weights must be final before it started (in a MoE layer, GEMM2 after GEMM1 or the
    activation). Other rungs launch as usual."""
    import cupy

    if fmt not in ("int4", "w8a16"):
        raise ValueError(f"fmt: expected 'int4' or 'w8a16', got {fmt!r}")
    top_k, block_size, L = EP.check_routing(sorted_token_ids, expert_ids,
                                            num_tokens_post_padded, top_k, block_size)
    # uint16 = bf16 bytes (a CuPy without ml_dtypes' bfloat16), as grouped_gemm accepts
    A.check_array("a", a, ndim=2, dtypes=(A.bf16_dtype(), np.dtype(np.float16),
                                          np.dtype(np.uint16)))
    M_a, K = a.shape
    nbits = 4 if fmt == "int4" else 8
    EP.check_weights(w, (np.uint8,) if nbits == 4 else (np.uint8, np.int8))
    E, N, Kw = w.shape
    if (Kw * 2 if nbits == 4 else Kw) != K:
        raise ValueError(f"w: expected codes for Kdim = {K} (a's columns), got shape {w.shape}")
    out_key = EP.elem_key(a.dtype)
    if out_dtype is not None and EP.elem_key(out_dtype) != out_key:
        raise TypeError(f"out_dtype: weight-only GEMMs return a's dtype ({a.dtype}), got "
                        f"{np.dtype(out_dtype)}")
    if w_scale is None:
        raise ValueError("w_scale: expected per-group scales [E, N, G], got None")
    A.check_array("w_scale", w_scale, ndim=3, contiguous=False)
    G = w_scale.shape[2]
    group_size = wna16_group_size(K, w_scale.shape, block_shape)
    w_s = EP.f32("w_scale", w_scale, shape=(E, N, G))
    if w_zp is not None:
        if w.dtype == np.int8:
            raise ValueError("w_zp: int8 codes are symmetric (no zero point); got w int8 "
                             "with a w_zp")
        A.check_array("w_zp", w_zp, ndim=3, dtypes=(np.uint8,), shape=(E, N, G))
    default_zp = 8 if nbits == 4 else 128
    code_xor = 0x80 if w.dtype == np.int8 else 0   # int8 = (uint8 byte ^ 0x80) - 128
    P = M_a * top_k
    tw, b32, c = EP.epilogue_operands(P, E, N, out_key, mul_routed_weight, topk_weights, bias,
                                      out)
    if P == 0 or N == 0 or L == 0:
        return c

    cc = int(cupy.cuda.Device().compute_capability)
    _, cfg = Q.route(fmt, P / max(E, 1), K,
                     refuses(nbits, cc, N, K, group_size, G, block_size, EP.aligned(a, w)),
                     version, config)
    rung, elem, null = cfg["rung"], EP.ELEMS[out_key], A.null_ptr()
    Lg = EP.positions(L, P, block_size)
    head = (sorted_token_ids, expert_ids, num_tokens_post_padded,
            tw if tw is not None else null, b32 if b32 is not None else null)
    sizes = (np.int32(N), np.int32(K), np.int32(P), np.int32(top_k), np.int32(block_size))
    mul = np.int32(bool(mul_routed_weight))
    if rung in ("v1", "v2", "v3"):
        if rung == "v1":
            grid, block = (Lg, cdiv(N, 128)), (128,)
        elif rung == "v2":
            grid = (cdiv(Lg, cfg["BM"]), cdiv(N, cfg["BN"]))
            block = (cfg["WARPS_M"] * cfg["WARPS_N"] * 32,)
        else:
            grid, block = (cdiv(Lg, cfg["BM"]), cdiv(N, 16)), (cfg["WARPS"] * 32,)
        if grid[1] > 65535:
            raise ValueError(f"w: N = {N} needs {grid[1]} column tiles, over the grid's 65535")
        smem = smem_bytes(rung, cfg, nbits)
        kern = EP.kernel(CU[rung], kernel_name(rung, nbits, cfg), NAMES[rung], elem, smem)
        args = (A.raw(a), w.view(cupy.uint8), A.raw(c), w_s, w_zp if w_zp is not None else null,
                *head, *sizes, np.int32(L), mul, np.int32(group_size), np.int32(G),
                np.int32(default_zp), np.int32(code_xor))
        kern(grid, block, args, shared_mem=smem)
        return c

    zp = w_zp is not None                 # v4-v6: int4 on prepacked weights
    if rung == "v4":
        pk = packed_weights(w, w_scale, w_zp, w_s)
        lp = P4.packed_plan(P, E, N, K, L, block_size, cfg, EP.num_sms(), group_size, G, zp)
        kern = EP.kernel(P4.CU, lp["name"], P4.NAMES, elem, lp["smem"])
        tail = (np.int32(lp["TPC"]), np.int32(lp["RG"]))
    elif rung == "v5":
        pk = packed_weights(w, w_scale, w_zp, w_s, order=("staged", cfg["W"] * cfg["TPW"],
                                                          cfg["KC"]))
        lp = S5.staged_plan(P, E, N, K, L, block_size, cfg, EP.num_sms(), group_size, G, zp)
        # one name a compile (~10 s each): a run asks for one or two of the configs
        kern = EP.kernel(S5.CU, lp["name"], (), elem, lp["smem"], S5.options(cfg))
        head = head + EP.workspace(lp["WS"], lp["COUNTERS"])
        tail = ()
    else:
        pk = packed_weights(w, w_scale, w_zp, w_s, order="wgmma")
        lp = W6.wgmma_plan(P, E, N, K, L, block_size, cfg, EP.num_sms(), group_size, G)
        kern = EP.kernel(W6.CU, lp["name"], W6.NAMES, elem, lp["smem"], W6.OPTIONS)
        tail = (np.int32(lp["GPC"]), np.int32(lp["CPS"]))
        tail += EP.workspace(lp["WS"], lp["TILES"]) if lp["KS"] > 1 else (null, null)
    args = (A.raw(a), pk["wp"], A.raw(c), pk["sp"], pk["zp"] if zp else null, *head, *sizes,
            np.int32(lp["Lg"]), mul, np.int32(lp["shift"]), np.int32(G), np.int32(default_zp),
            *tail)
    launch(kern, lp["grid"], lp["block"], args, shared_mem=lp["smem"],
           programmatic=programmatic and rung == "v5")
    return c


# ----------------------------------------------------------------------------- script
def _main(argv=None):  # pragma: no cover - needs a GPU
    """Validate every config of every rung (where it applies) against
    reference.quant.grouped_gemm_quant: int4 and int8 weights (uint8 with zero points, signed
    int8), group sizes 32 / 64 / 128 / one per row, N not a multiple of 16, a crowded expert;
    then time the route at Mixtral's GEMM1 and GEMM2 (benchmarks/bench_wna16.py compares the
    rungs). --quick: two small shapes, three formats (for compute-sanitizer)."""
    import math

    import cupy
    import ml_dtypes

    from reference import moe_align_block_size
    from reference import quant as RQ

    quick, timed = script_start(argv)  # (exits with the reason when no GPU is usable)
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    failures = 0
    formats = [  # (label, fmt, group size (0: one per row), zero points, signed int8)
        ("int4 g128", "int4", 128, False, False), ("int4 g64 zp", "int4", 64, True, False),
        ("int4 g32 zp", "int4", 32, True, False), ("int4 row", "int4", 0, False, False),
        ("uint8 g64 zp", "w8a16", 64, True, False), ("int8 g128", "w8a16", 128, False, True)]
    shapes = [(1, 4, 2, 128, 256, 16), (5, 3, 2, 64, 576, 16), (33, 6, 3, 200, 512, 32),
              (40, 3, 2, 128, 4096, 48)]      # (M_a, E, K, N, Kdim, B); N = 200: no packing
    if quick:
        formats, shapes = [formats[0], formats[1], formats[4]], shapes[:2]
    for (M_a, E, K, N, Kd, B) in shapes:
        x = rng.standard_normal((M_a, Kd)).astype(bf16)
        wf = (rng.standard_normal((E, N, Kd)) * 0.05).astype(bf16)
        ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
        ids[:, 0] = 0 if M_a > 30 else ids[:, 0]              # a crowded expert
        tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
        for label, fmt, gs, zp, signed in formats:
            wq, ws, wz = RQ.quantize_weight_wna16(wf, 4 if fmt == "int4" else 8,
                                                  math.gcd(gs, Kd) if gs else Kd, zero_point=zp)
            if signed:                        # int8 codes: the uint8 ones shifted by 128
                wq = (wq.astype(np.int16) - 128).astype(np.int8)
            flags = {"int4": dict(use_int4_w4a16=True), "w8a16": dict(use_int8_w8a16=True)}[fmt]
            for name, cfg in [(None, None)] + list(Q.CONFIGS["wna16"].items()):
                tile = Q.tile_rows(cfg) if cfg else 1
                Bc = B * tile // math.gcd(B, tile)
                st, ex, ntp = moe_align_block_size(ids, Bc, E)
                want = RQ.grouped_gemm_quant(x, wq, st, ex, ntp, K, Bc, tw, True, w_scale=ws,
                                             w_zp=wz, **flags)
                outd = A.empty((M_a * K, N), bf16)
                A.raw(outd).fill(0x7FC0)                        # poison: bf16 NaN
                try:
                    got = grouped_gemm_wna16(
                        A.to_device(x), A.to_device(wq), A.to_device(st), A.to_device(ex),
                        A.to_device(ntp), K, Bc, A.to_device(tw), True, w_scale=A.to_device(ws),
                        w_zp=None if wz is None else A.to_device(wz), fmt=fmt, config=name,
                        out=outd)
                    host = A.to_host(got)
                    host = host.view(bf16) if host.dtype == np.uint16 else host
                    err = rel_err(host.astype(np.float32), want.astype(np.float32))
                    status = "ok" if err <= 2e-2 else "FAIL"
                except ValueError as e:
                    err, status = float("nan"), f"skip ({str(e)[:90]})"
                failures += status == "FAIL"
                rung = cfg["rung"] if cfg else "route"
                print(f"{label:12s} {rung:5s} {name or '-':6s} M_a={M_a:3d} E={E} K={K} N={N:4d} "
                      f"Kdim={Kd:4d} B={Bc:3d} rel_err={err:.2e} {status}", flush=True)
    if quick:
        raise SystemExit(1 if failures else 0)

    # timing: Mixtral's GEMMs, int4 g128, the route (the codes' values do not change the time)
    E, K = 8, 2
    for label, (N, Kd) in (("Mixtral GEMM1", (28672, 4096)), ("Mixtral GEMM2", (4096, 14336))):
        w = cupy.full((E, N, Kd // 2), 0x88, dtype=cupy.uint8)
        ws = cupy.random.uniform(1e-3, 2e-3, (E, N, Kd // 128), dtype=cupy.float32)
        for T in (1, 16, 64):
            ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
            B = Q.block_size_for("int4", T * K / E)
            st, ex, ntp = (A.to_device(v) for v in moe_align_block_size(ids, B, E))
            a = A.to_device(rng.standard_normal((T, Kd)).astype(bf16))
            # (the timer flushes the L2 before every call: the weights come from HBM)
            t = timed(lambda: grouped_gemm_wna16(a, w, st, ex, ntp, K, B, w_scale=ws)).median
            t *= 1e-3
            nbytes = Q.quant_weight_bytes("int4", len(np.unique(ids)), N, Kd)
            print(f"{label} T={T:3d}: {t * 1e6:8.1f} us  {nbytes / t / 1e12:5.2f} TB/s  "
                  f"roofline {nbytes / Q.HBM_BYTES_PER_S / t:5.1%}", flush=True)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":  # pragma: no cover
    _main()
