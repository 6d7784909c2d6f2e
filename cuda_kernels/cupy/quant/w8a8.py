"""The quantized grouped GEMM of the fused MoE layer on the GPU (quant_gemm.cu).

    c[s] = (deq(a)[s // top_k] @ deq(w[e]).T + bias[e]) * r[s]
    (r = topk_weights.flat when mul_routed_weight, else 1)

for every live position of sorted_token_ids, fp32 accumulation, one rounding to bf16 / fp16;
e == -1 writes zeros. Same name, arguments and returns as reference/quant.py's
grouped_gemm_quant (keyword-only extras: version, config, out).

Shape legend: T tokens, E_local experts, K top-k, P = a.shape[0] * top_k slots, N output width
(2I for GEMM1, H for GEMM2), Kdim reduction width (H, I), L = len(sorted_token_ids),
KB = cdiv(Kdim, 128), NB = cdiv(N, 128), G weight-only groups per row.

    format      a [M_a, Kdim]          w                               scales (fp32), zero points
    fp8 w8a8    uint8 (e4m3 bytes)     [E, N, Kdim] uint8 (e4m3 bytes)  a_scale [1] | [M_a, 1] |
    int8 w8a8   int8                   [E, N, Kdim] int8                  [M_a, KB]; w_scale [E] |
                                                                          [E, N] | [E, NB, KB]
    int4 w4a16  bf16 / fp16            [E, N, Kdim/2] uint8 (k=2j low)  w_scale [E, N, G],
    int8 w8a16  bf16 / fp16            [E, N, Kdim] uint8 (or int8)     w_zp [E, N, G] uint8 / None

fp8 codes are uint8 arrays holding the e4m3fn bytes (CuPy has no fp8 dtype; see
quant_act.fp8_to_device). Block quantization on the GPU is DeepSeek-V3's block_shape
[128, 128] (1x128 activation groups, 128x128 weight blocks).

The ladder (`version=`; default: the best that applies):
    v1  CUDA cores, one thread per output (any shape; fp8 needs no tensor cores)
    v2  tensor cores: w8a8 mma.sync m16n8k32 e4m3 (sm_89+) / s8 (sm_80+), per-128-K-block
        scaling of the partial sums in registers; wna16 mma.sync m16n8k16 bf16/f16 with the
        weights dequantized in registers; cp.async rings of STAGES tiles.
    v3  weight-only int4 decode (up to 24 rows per expert): weight streaming, 16 weight rows
        per CTA straight from HBM into registers (the mma's A), K split over 8 warps, an
        ordered reduction; group_size and Kdim multiples of 128.
    v4  fp8 w8a8 decode (up to FP8_V4_MAX_ROWS rows per expert; quant_gemm_fp8_gemv.cu): the
        same weight streaming with mma.sync m16n8k32 e4m3 (sm_89+), 16 weight rows per CTA as
        the mma's A, tiles of 8 tokens as its B (padding-only tiles skipped), K split over the
        warps by 128-wide blocks, block scales folded per block; Kdim % 128 == 0.
    v5  fp8 w8a8 Hopper (sm_90a; quant_gemm_fp8_wgmma.cu): wgmma.m64nBNk32 e4m3 from
        128-byte-swizzled shared tiles (one 128-wide K block = one swizzled row), a cp.async
        ring with gathered A rows, per-block promotion acc += blk * a_scale * w_scale in fp32;
        BM (64 per warpgroup) divides block_size.
Tunables are data: W8A8_CONFIGS / WNA16_CONFIGS / WNA16_V3_CONFIGS / FP8_V4_CONFIGS /
FP8_V5_CONFIGS below, picked by rows per expert P / E (WNA16_BY_ROWS for the weight-only rung; tile rows BM must divide block_size;
block_size_for(fmt, rows) tells callers which block_size lets the table pick its best).

Napkin math at decode (H200, 4.8 TB/s): Mixtral int4 T=1 reads 2 experts' w13 + w2 codes and
scales, 2 * (58.7 + 29.4 + 5.5) MB = 187 MB -> 39 us; v3 spends about 5 instructions per
weight byte (dequantization 2.75, the activation permute and mma the rest), about 60% of the
SM issue slots at that bandwidth.

Run as a script to validate both versions against the reference and time them:
    python -m cuda_kernels.cupy.quant_gemm [--quick]
"""
from __future__ import annotations

import numpy as np

from . import _compile as C

CU = "quant_gemm.cu"
CU_FP8_GEMV = "quant_gemm_fp8_gemv.cu"      # v4
CU_FP8_WGMMA = "quant_gemm_fp8_wgmma.cu"    # v5
V5_OPTIONS = ("-arch=sm_90a",)              # wgmma exists only in sm_90a code
VERSIONS = ("v1", "v2", "v3", "v4", "v5")
KBLOCK = 128                      # the K width of a DeepSeek-V3 quantization block
QT = {"fp8": 0, "int8": 1}
ELEMS = {"bf16": 1, "fp16": 0}    # ELEM_BF16 define

# Tunables: tile rows BM, tile columns BN, K tile BK (w8a8: always 128, one scale block),
# warps as WARPS_M x WARPS_N, and the depth of the cp.async ring.
#   m16: small batches are weight-streaming: many CTAs (narrow BN) and a deep ring keep
#        enough bytes in flight to approach HBM bandwidth with 1-16 rows per expert.
#   m64: larger batches reuse each weight tile across 64 rows: wider BN, 8 warps.
#   wna16 m64: one warp spans all 64 rows (WARPS_M = 1), so each dequantized B fragment
#        feeds 4 mma instead of 2: the dequantization is the compute-bound cost here.
W8A8_CONFIGS = {
    "m16": dict(BM=16, BN=64, WARPS_M=1, WARPS_N=4, STAGES=6),
    "m64": dict(BM=64, BN=128, WARPS_M=2, WARPS_N=4, STAGES=4),
}
WNA16_CONFIGS = {
    "m16": dict(BM=16, BN=64, BK=128, WARPS_M=1, WARPS_N=4, STAGES=8),
    "m64": dict(BM=64, BN=128, BK=64, WARPS_M=1, WARPS_N=4, STAGES=4),
}
# wna16 v3 (decode: weight streaming, int4 only): BM = 8 * MT activation rows per CTA (MT
# tiles of 8 tokens, the mma's n), 16 weight rows per CTA, WARPS warps splitting K, U 128-K
# steps of weight loads in flight per thread, MINB CTAs per SM (caps registers at
# 65536 / (MINB * WARPS * 32): gemv32 at 128 spills a few words of its activation tiles).
WNA16_V3_CONFIGS = {
    "gemv16": dict(BM=16, WARPS=8, U=4, MINB=2),
    "gemv32": dict(BM=32, WARPS=8, U=3, MINB=2),
}
# The weight-only rung by rows per expert (P / E): decode batches stream the weights (v3),
# up to MAX rows; above, tensor-core tiles that reuse each weight tile across rows (v2).
# The first entry whose rows cover the batch and whose BM divides block_size wins.
WNA16_BY_ROWS = ((8, "gemv16"), (24, "gemv32"), (24, "gemv16"))
# fp8 w8a8 v4 (decode: weight streaming, mma.sync e4m3 with the weights as A): BM = 8 * MT
# token rows per CTA (tiles of 8, padding-only tiles skipped), 16 weight rows per CTA, WARPS
# warps splitting K by 128-wide blocks, U blocks of weight loads in flight per thread, MINB
# CTAs per SM (caps the registers).
# PF (default 0) = 1 / 2 adds the L2::128B / L2::256B prefetch hint to the weight loads.
# Measured: FP8_V4_BY_ROWS below.
FP8_V4_CONFIGS = {
    "gemv8w4u2m6": dict(BM=8, WARPS=4, U=2, MINB=6),
    "gemv8w4u3": dict(BM=8, WARPS=4, U=3, MINB=4),
    "gemv8w4u3ll": dict(BM=8, WARPS=4, U=3, MINB=4, PF=2),
    "gemv16": dict(BM=16, WARPS=8, U=2, MINB=2),
}
# v4's config by rows per expert and Kdim: the first entry (max rows per expert, min Kdim,
# name) that covers the batch and whose BM divides block_size wins. Measured (H200, 2026-11-30,
# DeepSeek-V3, block 16, L2 flushed, us; GEMM1 Kdim 7168 / GEMM2 Kdim 2048), slot 2:
#   T=1    GEMM1 u3ll 66.1, u3 68.1, u2 68.8, u2m6 70.4    GEMM2 u2m6 37.0, u2 37.0, u3 40.1
#   T=16   GEMM1 u3 707, u2m6 768, u3ll 743                GEMM2 u2m6 399, u3 430
#   T=64   GEMM1 u2m6 1560, u2 1560, u3 1607               GEMM2 u2m6 861, u2 884, u3 1000
#   T=128  GEMM1 u2 1788, u2m6 1802, u3 1875               GEMM2 u2m6 1021, u3 1167
# (u3 = gemv8w4u3, u3ll = gemv8w4u3ll, u2m6 = gemv8w4u2m6, u2 = U 2 at MINB 4; each timed twice,
# spread <= 1%). The former defaults, in slot 1b: gemv16 70.4 / 46.8 at T=1, gemv8w4 75.2 /
# 40.8 at T=1, 720 / 437 at T=16, 1727 / 1046 at T=64, 2108 / 1254 at T=128. Two register
# buffers (PIPE 2, 2026-11-29) and the persistent form v4p (2026-11-30 slots 1, 1b) were
# slower than these everywhere and were removed.
# gemv16 (two 8-token tiles per CTA) runs when asked for by name.
FP8_V4_BY_ROWS = ((0.25, 4096, "gemv8w4u3ll"), (1, 4096, "gemv8w4u3"), (16, 0, "gemv8w4u2m6"))
# fp8 w8a8 v5 (Hopper wgmma e4m3, per-block promotion): BM token rows (64 per warpgroup), BN
# weight rows, STAGES 128-wide K blocks in the cp.async ring.
# Measured (H200, slot 1, DeepSeek-V3): wg64 (block 64) GEMM1 / GEMM2 1.83 / 1.03 ms at
# T=1024 and 3.72 / 2.28 ms at T=4096; wg128 (block 128) 3.00 / 1.93 and 4.38 / 2.81 ms. The
# default is wg64 (FP8_V5_DEFAULT); wg128 runs only when asked for by name.
FP8_V5_CONFIGS = {
    "wg64": dict(BM=64, BN=128, STAGES=4),
    "wg128": dict(BM=128, BN=128, STAGES=3),
}
FP8_V5_DEFAULT = "wg64"
# The fp8 rung by rows per expert (P / E): decode batches stream the weights (v4) up to this
# many rows per expert; above, the wgmma tiles (v5, sm_90) or mma.sync tiles (v2) elsewhere.
# Measured (H200, slot 3, DeepSeek-V3, read flush): at T=256 (8 rows per expert) v5 wg64 with
# block 64 takes GEMM1 1.80 ms / GEMM2 0.97 ms against v4's best 2.42 / 1.72 (v2: 2.69 /
# 1.49); at T=64 (2 rows) v4 gemv8w4 1.77 / 1.06 ms (the bench's 72.5% of the roofline). The
# crossover between 2 and 8 rows is not measured: 4 splits it.
FP8_V4_MAX_ROWS = 4
V3_KSTEP = 128                    # v3's K step: 32 codes per thread, one scale per step
W8A8_ROW = KBLOCK + 16            # padded shared row, bytes (see quant_gemm.cu)


def w8a8_smem_bytes(cfg: dict) -> int:
    """sA + sW rings, per-stage a-scales, per-stage w-scale (padded to 16 B), slot and row ids."""
    st, bm, bn = cfg["STAGES"], cfg["BM"], cfg["BN"]
    return st * (bm + bn) * W8A8_ROW + st * bm * 4 + 16 * C.cdiv(st * 4, 16) + 2 * bm * 4


def wna16_rows(cfg: dict, nbits: int) -> tuple[int, int]:
    """(A row bytes, W row bytes) of the padded shared tiles."""
    wb = cfg["BK"] * nbits // 8
    return cfg["BK"] * 2 + 16, (48 if wb == 16 else wb + 16)


def wna16_smem_bytes(cfg: dict, nbits: int) -> int:
    arow, wrow = wna16_rows(cfg, nbits)
    return cfg["STAGES"] * (cfg["BM"] * arow + cfg["BN"] * wrow) + 2 * cfg["BM"] * 4


def _w8a8_name(qt: str, cfg: dict) -> str:
    return (f"w8a8_gemm_v2<{QT[qt]}, {cfg['BM']}, {cfg['BN']}, {cfg['WARPS_M']}, "
            f"{cfg['WARPS_N']}, {cfg['STAGES']}>")


def _v3_name(cfg: dict) -> str:
    return f"wna16_gemv_v3<{cfg['BM'] // 8}, {cfg['WARPS']}, {cfg['U']}, {cfg['MINB']}>"


def v3_smem_bytes(cfg: dict) -> int:
    """The warps' partial sums [WARPS][BM][16] fp32, then slot and row ids."""
    return cfg["WARPS"] * cfg["BM"] * 16 * 4 + 2 * cfg["BM"] * 4


def block_size_for(fmt: str, rows_per_expert: float) -> int:
    """The alignment block_size that lets the config tables pick their best rung for a batch
    of `rows_per_expert` = P / E rows ("fp8" / "int8" / "int4" / "w8a16")."""
    if fmt == "int4":
        # up to 8 rows: 16 (gemv16's tiles; the packed q8 route's divide it). Up to 128 rows
        # (the int4 route's range, quant_gemm_wna16.PACKED_BY_ROWS): 48, the staged t24's
        # measured block (its 24-row tiles, and the fallback gemv16's, divide it); 32 routed
        # to t32, slower (H200, Mixtral T = 64, GEMM1 / GEMM2: t24 188 / 110 us against t32
        # 198 / 118). Above: the tile rungs' 64.
        if rows_per_expert <= WNA16_BY_ROWS[0][0]:
            return max(16, WNA16_V3_CONFIGS[WNA16_BY_ROWS[0][1]]["BM"])
        return 48 if rows_per_expert <= 128 else 64
    if fmt == "fp8":   # v4 (decode) takes 8 / 16-row tiles; v5 64-row tiles above its range
        return 16 if rows_per_expert <= FP8_V4_MAX_ROWS else 64
    return 16 if rows_per_expert <= 16 else 64


def _wna16_name(nbits: int, cfg: dict) -> str:
    return (f"wna16_gemm_v2<{nbits}, {cfg['BM']}, {cfg['BN']}, {cfg['BK']}, "
            f"{cfg['WARPS_M']}, {cfg['WARPS_N']}, {cfg['STAGES']}>")


def wna16_group_ok(group_size: int, num_groups: int, bk: int) -> bool:
    """v2 holds 1, 2 or 4 groups per K tile: group_size a multiple of bk (or one group per
    row), or bk / group_size in {2, 4} with group_size a multiple of 16."""
    if num_groups == 1 or group_size % bk == 0:
        return True
    return group_size % 16 == 0 and bk % group_size == 0 and bk // group_size in (2, 4)


def _v4_name(cfg: dict) -> str:
    return (f"fp8_gemv_v4<{cfg['BM'] // 8}, {cfg['WARPS']}, {cfg['U']}, {cfg['MINB']}, "
            f"{cfg.get('PF', 0)}>")


def v4_smem_bytes(cfg: dict) -> int:
    """The warps' partial sums [WARPS][BM][16] fp32, then a rows and slots."""
    return cfg["WARPS"] * cfg["BM"] * 16 * 4 + 2 * cfg["BM"] * 4


def _v5_name(cfg: dict) -> str:
    return f"fp8_gemm_v5<{cfg['BM']}, {cfg['BN']}, {cfg['STAGES']}>"


def v5_smem_bytes(cfg: dict) -> int:
    """1024 (alignment of the swizzled ring) + the ring + per-stage a scales + w scales (16 B
    padded) + a rows and slots."""
    st, bm, bn = cfg["STAGES"], cfg["BM"], cfg["BN"]
    return 1024 + st * ((bm + bn) * 128 + bm * 4) + 16 * C.cdiv(st * 4, 16) + 2 * bm * 4


V1_NAMES = ("w8a8_gemm_v1<0>", "w8a8_gemm_v1<1>", "wna16_gemm_v1<4>", "wna16_gemm_v1<8>")
W8A8_V2_NAMES = tuple(_w8a8_name(q, c) for c in W8A8_CONFIGS.values() for q in QT)
WNA16_V2_NAMES = tuple(_wna16_name(b, c) for c in WNA16_CONFIGS.values() for b in (4, 8))
WNA16_V3_NAMES = tuple(_v3_name(c) for c in WNA16_V3_CONFIGS.values())

# Every instantiation the launcher can pick, for the CPU compile checks (one case per family
# and element type: NVRTC compiles a case's names in one pass). fp8 mma needs sm_89: on sm_80
# those bodies compile to a trap and the launcher never picks them there.
FP8_V4_NAMES = tuple(_v4_name(c) for c in FP8_V4_CONFIGS.values())
FP8_V5_NAMES = tuple(_v5_name(c) for c in FP8_V5_CONFIGS.values())
for _ek, _ev in ELEMS.items():
    for _names in (V1_NAMES, W8A8_V2_NAMES, WNA16_V2_NAMES, WNA16_V3_NAMES):
        C.register_compile_case(CU, {"ELEM_BF16": _ev}, _names)
    C.register_compile_case(CU_FP8_GEMV, {"ELEM_BF16": _ev}, FP8_V4_NAMES)
    C.register_compile_case(CU_FP8_WGMMA, {"ELEM_BF16": _ev}, FP8_V5_NAMES, options=V5_OPTIONS)


# ----------------------------------------------------------------------------- config choice
def _pick(table: dict, rows_per_expert: float, block_size: int, config=None):
    """The config named `config`, or the widest tile that fits the rows per expert; its BM
    must divide block_size (a tile lies in one alignment block). None when none fits."""
    if config is not None:
        if isinstance(config, str):
            if config not in table:
                raise ValueError(f"config: expected one of {sorted(table)}, got {config!r}")
            cfg = table[config]
        elif isinstance(config, dict):
            cfg = config
        else:
            raise TypeError(f"config: expected a name or a dict, got {type(config).__name__}")
        if block_size % cfg["BM"]:
            raise ValueError(f"config: tile rows BM={cfg['BM']} must divide block_size "
                             f"{block_size}")
        return cfg
    fits = [c for c in table.values() if block_size % c["BM"] == 0]
    if not fits:
        return None
    small = [c for c in fits if c["BM"] >= min(rows_per_expert, 64)]
    return min(small, key=lambda c: c["BM"]) if small else max(fits, key=lambda c: c["BM"])


def _named(table: dict, config):
    """The config of `table` that `config` names (a name of it, or a dict with its keys)."""
    if isinstance(config, str):
        return table.get(config)
    if isinstance(config, dict) and set(config) == set(next(iter(table.values()))):
        return config
    return None


def _pick_fp8(version, config, rows_per_expert, block_size, K, cc, a, w):
    """(version, config, None) when the fp8 rung v4 (decode) or v5 (wgmma) should run, else
    (None, None, why not). By default v4 up to FP8_V4_MAX_ROWS rows per expert, v5 above on
    sm_90; `version` / a config name of FP8_V4_CONFIGS or FP8_V5_CONFIGS asks for one."""
    c4, c5 = _named(FP8_V4_CONFIGS, config), _named(FP8_V5_CONFIGS, config)
    if config is not None and c4 is None and c5 is None:
        return None, None, "a config of another rung was asked for"
    if version is None:
        version = "v4" if c4 is not None else "v5" if c5 is not None else None
    if version not in (None, "v4", "v5"):
        return None, None, "another version was asked for"
    if not _aligned(a, w):
        return None, None, "v4 / v5 load 16-byte chunks: a and w must be 16-byte aligned"
    why4 = why5 = None
    if cc < 89:
        why4 = f"fp8 tensor cores need sm_89+, this device is sm_{cc}"
    elif K % 128:
        why4 = f"v4 streams 128-wide K blocks: Kdim must be a multiple of 128, got {K}"
    if cc != 90:
        why5 = f"v5 (wgmma, built for sm_90a) runs on compute capability 9.0 only, got {cc}"
    elif K % 16:
        why5 = f"v5 loads 16-byte chunks: Kdim must be a multiple of 16, got {K}"

    def fit(table, cfg, label):
        if cfg is not None:
            if block_size % cfg["BM"]:
                raise ValueError(f"config: tile rows BM={cfg['BM']} must divide block_size "
                                 f"{block_size}")
            return cfg, None
        fits = [c for c in table.values() if block_size % c["BM"] == 0]
        if not fits:
            return None, f"{label} needs block_size a multiple of its tile rows, got {block_size}"
        small = [c for c in fits if c["BM"] >= min(rows_per_expert, 128)]
        return (min(small, key=lambda c: c["BM"]) if small
                else max(fits, key=lambda c: c["BM"])), None

    if version in (None, "v4") and why4 is None and c5 is None and (
            version == "v4" or c4 is not None or rows_per_expert <= FP8_V4_MAX_ROWS):
        cfg = None
        if c4 is None:
            for rows, min_k, name in FP8_V4_BY_ROWS:
                if rows_per_expert <= rows and K >= min_k and \
                        block_size % FP8_V4_CONFIGS[name]["BM"] == 0:
                    cfg = FP8_V4_CONFIGS[name]
                    break
        if cfg is None:
            cfg, why4 = fit(FP8_V4_CONFIGS, c4, "v4")
        if cfg is not None:
            return "v4", cfg, None
    if version in (None, "v5") and why5 is None and c4 is None:
        cfg, why5 = fit({FP8_V5_DEFAULT: FP8_V5_CONFIGS[FP8_V5_DEFAULT]} if c5 is None
                        else FP8_V5_CONFIGS, c5, "v5")
        if cfg is not None:
            return "v5", cfg, None
    return None, None, why4 if version == "v4" else why5


def fp8_rung(rows_per_expert: float, block_size: int, Kdim: int, cc: int) -> str:
    """The version grouped_gemm_quant runs by default for fp8 w8a8 with 16-byte aligned
    operands ("v4", "v5" or "v2"; "v1" where v2 cannot run), for benchmarks' records."""
    ver = _pick_fp8(None, None, rows_per_expert, block_size, Kdim, cc, None, None)[0]
    if ver is not None:
        return ver
    ok = _pick(W8A8_CONFIGS, rows_per_expert, block_size) is not None and Kdim % 16 == 0
    return "v2" if ok and cc >= 89 else "v1"


def _is_v3_config(config) -> bool:
    return (isinstance(config, str) and config in WNA16_V3_CONFIGS) or \
        (isinstance(config, dict) and "WARPS" in config)


def _pick_v3(rows_per_expert, block_size, config, version, nbits, K, group_size, a, w):
    """(config, None) when wna16 v3 should run, else (None, why not). v3 runs by default when
    the rows per expert are a decode batch (WNA16_BY_ROWS), or when asked by `version` /
    a config name of WNA16_V3_CONFIGS; it needs int4, Kdim and group_size multiples of 128,
    16-byte aligned operands and BM dividing block_size."""
    if version not in (None, "v3") or (config is not None and not _is_v3_config(config)):
        return None, "another version or config was asked for"
    if nbits != 4:
        return None, "v3 streams int4 codes only (int8 weight-only runs v2)"
    if K % V3_KSTEP or group_size % V3_KSTEP:
        return None, (f"v3 needs Kdim and group_size multiples of {V3_KSTEP}, got {K} and "
                      f"{group_size}")
    if not _aligned(a, w):
        return None, "v3 loads 16-byte chunks: a and w must be 16-byte aligned"
    if config is not None:
        cfg = WNA16_V3_CONFIGS[config] if isinstance(config, str) else config
        if block_size % cfg["BM"]:
            raise ValueError(f"config: tile rows BM={cfg['BM']} must divide block_size "
                             f"{block_size}")
        return cfg, None
    for rows, name in WNA16_BY_ROWS:
        cfg = WNA16_V3_CONFIGS[name]
        if (rows_per_expert <= rows or version == "v3") and block_size % cfg["BM"] == 0:
            return cfg, None
    return None, (f"{rows_per_expert:.1f} rows per expert is not a decode batch, or no v3 tile "
                  f"divides block_size {block_size}")


# ----------------------------------------------------------------------------- checks
def _fmt(use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16, use_int4_w4a16):
    flags = {"fp8": use_fp8_w8a8, "int8": use_int8_w8a8, "w8a16": use_int8_w8a16,
             "int4": use_int4_w4a16}
    on = [k for k, v in flags.items() if v]
    if len(on) > 1:
        raise ValueError(f"use_fp8_w8a8/use_int8_w8a8/use_int8_w8a16/use_int4_w4a16: expected at "
                         f"most one format, got {len(on)} set ({', '.join(on)})")
    return on[0] if on else None


def _elem_key(dtype) -> str:
    dt = np.dtype(dtype)
    if dt == C.bf16_dtype() or dt == np.uint16:
        return "bf16"
    if dt == np.float16:
        return "fp16"
    raise TypeError(f"expected bfloat16 or float16, got {dt}")


def _f32(name, x, shape=None):
    """A float CuPy array as contiguous fp32 (bf16 widened exactly), shape-checked."""
    import cupy

    C.check_array(name, x, dtypes=C.float_dtypes(), shape=shape, contiguous=False)
    if np.dtype(x.dtype) == C.bf16_dtype():
        return (C.raw(x).astype(cupy.uint32) << 16).view(cupy.float32).reshape(x.shape)
    return cupy.ascontiguousarray(x.astype(cupy.float32, copy=False))


def epilogue_operands(P, E, N, out_key, mul_routed_weight, topk_weights, bias, out):
    """(topk weights [P] fp32 or None, bias [E, N] fp32 or None, c [P, N]): the checked
    epilogue operands of a quantized grouped GEMM with P slots (shared with
    quant_gemm_wna16). c is `out` (checked: [P, N], a's element type) or a new array."""
    if mul_routed_weight:
        if topk_weights is None:
            raise ValueError("topk_weights: expected an array when mul_routed_weight=True, "
                             "got None")
        tw = _f32("topk_weights", topk_weights).reshape(-1)
        if tw.size != P:
            raise ValueError(f"topk_weights: expected {P} weights (a rows * top_k), got shape "
                             f"{topk_weights.shape}")
    else:
        tw = None
    b32 = _f32("bias", bias, shape=(E, N)) if bias is not None else None
    if out is None:
        c = C.empty((P, N), C.bf16_dtype() if out_key == "bf16" else np.float16)
    else:
        C.check_array("out", out, ndim=2, shape=(P, N))
        if _elem_key(out.dtype) != out_key:
            raise TypeError(f"out: expected dtype {out_key}, got {out.dtype}")
        c = out
    return tw, b32, c


def _block_shape(block_shape):
    if block_shape is None:
        return None
    try:
        bn, bk = (int(v) for v in block_shape)
    except (TypeError, ValueError):
        raise TypeError(f"block_shape: expected two ints [bn, bk], got {block_shape!r}") from None
    return bn, bk


def _check_weights(w, dtypes):
    """w [E, N, Kdim or Kdim/2]: a C-contiguous CuPy array on this device whose *one expert*
    fits 32-bit offsets. The kernels add a 64-bit expert base (e * N * row bytes, once per
    CTA) and index inside the expert in 32 bits, so the whole array may exceed 2^31 bytes
    (DeepSeek-V3's fp8 w13 is 256 * 4096 * 7168 = 7.5e9)."""
    import cupy

    if not isinstance(w, cupy.ndarray):
        C.check_array("w", w)                               # raises the usual TypeError
    if w.ndim != 3:
        raise ValueError(f"w: expected 3 dimensions [E, N, Kdim], got shape {w.shape}")
    C.check_array("w", w[:1], ndim=3, dtypes=dtypes, contiguous=False)   # device, dtype
    if not w.flags.c_contiguous:
        raise ValueError(f"w: expected a C-contiguous array, got strides {w.strides} for shape "
                         f"{w.shape} (call cupy.ascontiguousarray first)")
    C.check_fits_int32("w", w.shape[1] * w.shape[2], "one expert's N * row bytes")


_ALIGN = 16   # cp.async moves 16-byte chunks


def _aligned(*arrays) -> bool:
    return all(x is None or x.data.ptr % _ALIGN == 0 for x in arrays)


# ----------------------------------------------------------------------------- the stage
def grouped_gemm_quant(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                       block_size, topk_weights=None, mul_routed_weight=False, bias=None,
                       a_scale=None, w_scale=None, w_zp=None, use_fp8_w8a8=False,
                       use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                       per_act_token_quant=False, per_channel_quant=False, block_shape=None,
                       out_dtype=None, *, version=None, config=None, out=None,
                       programmatic=False):
    """c [a.shape[0] * top_k, N] on the GPU (see the module doc and reference/quant.py).

    version "v1" | "v2" | None (best that applies: v2 needs block_size % 16 == 0, 16-byte
    aligned rows (Kdim % 16 w8a8, % 32 weight-only), sm_89+ for fp8, group sizes that are a
    multiple of 16 and nest with the K tile). config: a name of W8A8_CONFIGS / WNA16_CONFIGS
    or a dict. out: a [P, N] array to write (tests poison it first); else one is allocated.
    programmatic: int4 on quant_gemm_wna16's staged rung starts under the previous kernel's
    tail (see grouped_gemm_wna16); every other path launches as usual.
    """
    import cupy

    fmt = _fmt(use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16, use_int4_w4a16)
    if fmt is None:
        raise ValueError("use_*: the CuPy quantized GEMM needs one of use_fp8_w8a8, "
                         "use_int8_w8a8, use_int8_w8a16, use_int4_w4a16 (the bf16 GEMM is "
                         "cuda_kernels.cupy.grouped_gemm)")
    # Weight-only formats (int4 / int8 w*a16): the one place to send them to another module's
    # GEMM; everything below is this module's own v1-v3 for them and v1-v5 for w8a8.
    # int4 at decode goes to quant_gemm_wna16's packed rung (weights prepacked once per array,
    # cached), when it takes the shape and no version / config of this module was asked for.
    if fmt == "int4" and version is None and config is None:
        from . import quant_gemm_wna16 as W16

        name = W16.route_int4(a, w, w_scale, w_zp, block_shape, top_k, block_size)
        if name is not None:
            return W16.grouped_gemm_wna16(
                a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_size,
                topk_weights, mul_routed_weight, bias, a_scale, w_scale, w_zp,
                use_int4_w4a16=True, block_shape=block_shape, out_dtype=out_dtype,
                config=name, out=out, programmatic=programmatic)
    if version is not None and version not in VERSIONS:
        raise ValueError(f"version: expected one of {VERSIONS}, got {version!r}")
    top_k = C.check_int("top_k", top_k, 1)
    block_size = C.check_int("block_size", block_size, 1)
    C.check_array("sorted_token_ids", sorted_token_ids, ndim=1, dtypes=(np.int32,))
    C.check_array("expert_ids", expert_ids, ndim=1, dtypes=(np.int32,))
    C.check_array("num_tokens_post_padded", num_tokens_post_padded, dtypes=(np.int32,))
    if num_tokens_post_padded.size < 1:
        raise ValueError("num_tokens_post_padded: expected one int32, got an empty array")
    L = sorted_token_ids.size
    if expert_ids.size < C.cdiv(L, block_size):
        raise ValueError(f"expert_ids: expected at least cdiv({L}, {block_size}) = "
                         f"{C.cdiv(L, block_size)} blocks, got {expert_ids.size}")
    w8a8 = fmt in ("fp8", "int8")

    # ---- operands
    if w8a8:
        code_dt = np.uint8 if fmt == "fp8" else np.int8
        hint = " (fp8 codes travel as their uint8 bytes)" if fmt == "fp8" else ""
        try:
            C.check_array("a", a, ndim=2, dtypes=(code_dt,))
            _check_weights(w, (code_dt,))
        except TypeError as err:
            raise TypeError(f"{err}{hint}") from None
        M_a, K = a.shape
        E, N, Kw = w.shape
        if Kw != K:
            raise ValueError(f"w: expected shape (E, N, {K}) to match a's columns, got {w.shape}")
        out_key = _elem_key(out_dtype if out_dtype is not None else C.bf16_dtype())
        bs = _block_shape(block_shape)
        if bs is not None and bs != (KBLOCK, KBLOCK):
            raise ValueError(f"block_shape: the GPU kernels do DeepSeek-V3's [128, 128] blocks, "
                             f"got {list(bs)}")
        KB, NB = C.cdiv(K, KBLOCK), C.cdiv(N, KBLOCK)
        if a_scale is None or w_scale is None:
            raise ValueError(f"{'a_scale' if a_scale is None else 'w_scale'}: expected the "
                             f"scales of a w8a8 format, got None")
        if bs is not None:
            a_kind, w_kind = 2, 2
            a_s = _f32("a_scale", a_scale, shape=(M_a, KB))
            w_s = _f32("w_scale", w_scale, shape=(E, NB, KB))
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
            a_s = _f32("a_scale", a_scale).reshape(-1)
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
            w_s = _f32("w_scale", w_scale).reshape(-1)
    else:
        # uint16 = bf16 bytes (a CuPy without ml_dtypes' bfloat16), as grouped_gemm accepts
        C.check_array("a", a, ndim=2, dtypes=(C.bf16_dtype(), np.dtype(np.float16),
                                              np.dtype(np.uint16)))
        M_a, K = a.shape
        nbits = 4 if fmt == "int4" else 8
        _check_weights(w, (np.uint8,) if nbits == 4 else (np.uint8, np.int8))
        E, N, Kw = w.shape
        if (Kw * 2 if nbits == 4 else Kw) != K:
            raise ValueError(f"w: expected codes for Kdim = {K} (a's columns), got shape {w.shape}")
        out_key = _elem_key(a.dtype)
        if out_dtype is not None and _elem_key(out_dtype) != out_key:
            raise TypeError(f"out_dtype: weight-only GEMMs return a's dtype ({a.dtype}), got "
                            f"{np.dtype(out_dtype)}")
        if w_scale is None:
            raise ValueError("w_scale: expected per-group scales [E, N, G], got None")
        C.check_array("w_scale", w_scale, ndim=3, contiguous=False)
        G = w_scale.shape[2]
        bs = _block_shape(block_shape)
        group_size = bs[1] if bs is not None else (K // G if G and K % G == 0 else 0)
        if G < 1 or group_size < 1 or K % group_size or K // group_size != G:
            raise ValueError(f"w_scale: expected Kdim / group_size = {K} / {group_size} groups, "
                             f"got shape {w_scale.shape}")
        w_s = _f32("w_scale", w_scale, shape=(E, N, G))
        if w_zp is not None:
            if w.dtype == np.int8:
                raise ValueError("w_zp: int8 codes are symmetric (no zero point); got w int8 "
                                 "with a w_zp")
            C.check_array("w_zp", w_zp, ndim=3, dtypes=(np.uint8,), shape=(E, N, G))
        default_zp = 8 if nbits == 4 else 128
        code_xor = 0x80 if (nbits == 8 and w.dtype == np.int8) else 0   # int8 = uint8 ^ 0x80 - 128
    P = M_a * top_k
    C.check_fits_int32("a", P, "a.shape[0] * top_k")   # slots are int32; offsets are 64-bit

    tw, b32, c = epilogue_operands(P, E, N, out_key, mul_routed_weight, topk_weights, bias, out)
    if P == 0 or N == 0 or L == 0:
        return c

    # ---- version and config
    dev = cupy.cuda.Device()
    cc = int(dev.compute_capability)
    rows_per_expert = P / max(E, 1)
    why = None
    fcfg = None
    if fmt == "fp8":
        fver, fcfg, fwhy = _pick_fp8(version, config, rows_per_expert, block_size, K, cc, a, w)
        if fver is not None:
            version = fver
        elif version in ("v4", "v5"):
            raise ValueError(f"version: {version} cannot run this problem: {fwhy}")
        if _named(FP8_V4_CONFIGS, config) is not None or _named(FP8_V5_CONFIGS, config) is not None:
            config = None                     # a fast-rung config that does not apply here
    elif version in ("v4", "v5"):
        raise ValueError(f"version: {version} is an fp8 w8a8 rung (use_fp8_w8a8), got {fmt}")
    if w8a8:
        cfg = _pick(W8A8_CONFIGS, rows_per_expert, block_size, config)
        if cfg is None:
            why = f"v2 tiles need block_size a multiple of 16, got {block_size}"
        elif K % 16 or not _aligned(a, w):
            why = (f"v2 loads 16-byte chunks: Kdim must be a multiple of 16 (got {K}) and a, w "
                   f"16-byte aligned")
        elif fmt == "fp8" and cc < 89:
            why = f"fp8 tensor cores need sm_89+, this device is sm_{cc}"
    else:
        v3cfg, v3why = _pick_v3(rows_per_expert, block_size, config, version, nbits, K,
                                group_size, a, w)
        if v3cfg is not None and version in (None, "v3"):
            version = "v3"
        elif version == "v3":
            raise ValueError(f"version: v3 cannot run this problem: {v3why}")
        cfg = _pick(WNA16_CONFIGS, rows_per_expert, block_size,
                    None if version == "v3" or _is_v3_config(config) else config)
        if cfg is None:
            why = f"v2 tiles need block_size a multiple of 16, got {block_size}"
        elif K % 32 or not _aligned(a, w):
            why = (f"v2 loads 16-byte chunks: Kdim must be a multiple of 32 (got {K}) and a, w "
                   f"16-byte aligned")
        elif not wna16_group_ok(group_size, G, cfg["BK"]):
            why = (f"v2 holds 1, 2 or 4 groups per K tile of {cfg['BK']}: group_size "
                   f"{group_size} does not nest with it")
    if version == "v3" and w8a8:
        raise ValueError("version: v3 is the weight-only decode rung (use_int4_w4a16); w8a8 "
                         "runs v1 or v2")
    if version is None:
        version = "v1" if why else "v2"
    elif version == "v2" and why:
        raise ValueError(f"version: v2 cannot run this problem: {why}")
    elem = ELEMS[out_key]
    # Positions the grid must cover: num_tokens_post_padded = sum_e ceil(c_e / B) * B <= P * B
    # (each expert with c_e >= 1 slots pads fewer than c_e * (B - 1)), while L is sized for
    # every expert getting a block (P + E (B - 1)). At decode that bound is much smaller:
    # DeepSeek-V3 T=1 has L = 3848 but at most 128 live positions. CTAs past it would only
    # read num_tokens_post_padded and exit, thousands of them per launch.
    Lg = min(L, P * block_size)

    if version == "v4":
        name = _v4_name(fcfg)
        smem = v4_smem_bytes(fcfg)
        kern = _kernel(name, FP8_V4_NAMES if name in FP8_V4_NAMES else (name,), elem, smem,
                       CU_FP8_GEMV)
        grid = (C.cdiv(Lg, fcfg["BM"]), C.cdiv(N, 16))
        block = (fcfg["WARPS"] * 32,)
    elif version == "v5":
        name = _v5_name(fcfg)
        smem = v5_smem_bytes(fcfg)
        kern = _kernel(name, FP8_V5_NAMES if name in FP8_V5_NAMES else (name,), elem, smem,
                       CU_FP8_WGMMA, V5_OPTIONS)
        grid = (C.cdiv(N, fcfg["BN"]), C.cdiv(Lg, fcfg["BM"]))
        block = (fcfg["BM"] // 64 * 128,)
        if grid[1] > 65535:
            raise ValueError(f"sorted_token_ids: {Lg} positions need {grid[1]} row tiles, over "
                             f"the grid's 65535 (use version='v2')")
        grid = (grid[0], grid[1], 1)
    elif version == "v1":
        grid, block, smem = (Lg, C.cdiv(N, 128)), (128,), 0
        if w8a8:
            name = f"w8a8_gemm_v1<{QT[fmt]}>"
        else:
            name = f"wna16_gemm_v1<{nbits}>"
        kern = _kernel(name, V1_NAMES, elem, 0)
    elif version == "v3":
        name = _v3_name(v3cfg)
        smem = v3_smem_bytes(v3cfg)
        kern = _kernel(name, WNA16_V3_NAMES if name in WNA16_V3_NAMES else (name,), elem, smem)
        grid = (C.cdiv(Lg, v3cfg["BM"]), C.cdiv(N, 16))
        block = (v3cfg["WARPS"] * 32,)
    elif w8a8:
        name = _w8a8_name(fmt, cfg)
        smem = w8a8_smem_bytes(cfg)
        kern = _kernel(name, W8A8_V2_NAMES if name in W8A8_V2_NAMES else (name,), elem, smem)
        grid = (C.cdiv(Lg, cfg["BM"]), C.cdiv(N, cfg["BN"]))
        block = (cfg["WARPS_M"] * cfg["WARPS_N"] * 32,)
    else:
        name = _wna16_name(nbits, cfg)
        smem = wna16_smem_bytes(cfg, nbits)
        kern = _kernel(name, WNA16_V2_NAMES if name in WNA16_V2_NAMES else (name,), elem, smem)
        grid = (C.cdiv(Lg, cfg["BM"]), C.cdiv(N, cfg["BN"]))
        block = (cfg["WARPS_M"] * cfg["WARPS_N"] * 32,)
    if version != "v5" and grid[1] > 65535:
        raise ValueError(f"w: N = {N} needs {grid[1]} column tiles, over the grid's 65535")

    null = C.null_ptr()
    common = (sorted_token_ids, expert_ids, num_tokens_post_padded,
              tw if tw is not None else null, b32 if b32 is not None else null,
              np.int32(N), np.int32(K), np.int32(P), np.int32(top_k), np.int32(block_size),
              np.int32(L), np.int32(bool(mul_routed_weight)))
    if w8a8:
        args = (a.view(cupy.uint8), w.view(cupy.uint8), C.raw(c), a_s, w_s) + common + \
            (np.int32(a_kind), np.int32(w_kind))
    else:
        args = (C.raw(a), w.view(cupy.uint8), C.raw(c), w_s,
                w_zp if w_zp is not None else null) + common + \
            (np.int32(group_size), np.int32(G), np.int32(default_zp), np.int32(code_xor))
    kern(grid, block, args, shared_mem=smem)
    return c


_READY: dict = {}


def _kernel(name, names, elem, smem, cu=CU, options=()):
    """The compiled kernel (one NVRTC pass per family and element type), its dynamic
    shared-memory limit raised once when it needs more than the default 48 KB."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (cu, name, elem, dev)
    kern = _READY.get(key)
    if kern is None:
        kern = C.get_kernel(cu, name, {"ELEM_BF16": elem}, names, options=options)
        if smem > 48 * 1024:   # a CTA gets more than 48 KB only after opting in
            kern.max_dynamic_shared_size_bytes = smem
        _READY[key] = kern
    return kern


# ----------------------------------------------------------------------------- napkin math
HBM_BYTES_PER_S = 4.8e12     # H200 datasheet
PEAK_BF16 = 989e12           # dense bf16 tensor-core FLOP/s
PEAK_FP8 = 1979e12           # dense fp8


def gemm_flops(num_slots: int, N: int, K: int) -> float:
    """2 * P * N * Kdim."""
    return 2.0 * num_slots * N * K


def quant_weight_bytes(fmt: str, touched: int, N: int, K: int, group_size: int = 128,
                       block: int = KBLOCK) -> float:
    """Bytes of the touched experts' weights in the quantized format, scales included."""
    if fmt in ("fp8", "int8"):
        return touched * (N * K + 4 * C.cdiv(N, block) * C.cdiv(K, block))
    codes = N * K // 2 if fmt == "int4" else N * K
    return touched * (codes + 4 * N * (K // group_size))


# ----------------------------------------------------------------------------- script
def _main(argv=None):  # pragma: no cover - needs a GPU
    """Validate every version (v1..v5, where it applies) of every format against
    reference.quant.grouped_gemm_quant on small problems (nasty shapes included), then time
    the default rung at DeepSeek-V3 (fp8 block) and Mixtral (int4) GEMM1 shapes. --quick: the
    validation only, small (for compute-sanitizer; it runs fp8 v4 and v5 too)."""
    import argparse
    import math

    import cupy
    import ml_dtypes

    from reference import moe_align_block_size
    from reference import quant as RQ

    from .quant_act import fp8_to_device

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small validation only (sanitizer)")
    args = p.parse_args(argv)
    ok, why = C.availability()
    if not ok:
        raise SystemExit(f"no GPU: {why}")
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16

    def up(x):
        if x is None:
            return None
        if x.dtype == RQ.FP8_DTYPE:
            return fp8_to_device(x)
        return C.to_device(x)

    failures = 0
    formats = [("fp8 block", dict(use_fp8_w8a8=True, block_shape=[128, 128]), "block"),
               ("fp8 tensor", dict(use_fp8_w8a8=True), "tensor"),
               ("fp8 channel", dict(use_fp8_w8a8=True, per_act_token_quant=True,
                                    per_channel_quant=True), "channel"),
               ("int8 channel", dict(use_int8_w8a8=True, per_act_token_quant=True,
                                     per_channel_quant=True), "channel"),
               ("int8 block", dict(use_int8_w8a8=True, block_shape=[128, 128]), "block"),
               ("int4 g128", dict(use_int4_w4a16=True), 128),
               ("int4 g32 zp", dict(use_int4_w4a16=True), 32),
               ("uint8 g64", dict(use_int8_w8a16=True), 64)]
    # the last: a decode batch (block 16, Kdim % 128 == 0), where fp8 picks v4 by default
    shapes = [(5, 4, 2, 136, 320, 16), (33, 6, 3, 256, 256, 32), (70, 3, 1, 200, 384, 64),
              (3, 4, 2, 72, 256, 16)]
    for (M_a, E, K, N, Kd, B) in ([shapes[0], shapes[2], shapes[3]] if args.quick else shapes):
        x = rng.standard_normal((M_a, Kd)).astype(bf16)
        wf = (rng.standard_normal((E, N, Kd)) * 0.05).astype(bf16)
        ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
        ids[:, 0] = 0 if M_a > 30 else ids[:, 0]              # a crowded expert
        st, ex, ntp = moe_align_block_size(ids, B, E)
        tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
        for name, flags, gran in formats:
            if isinstance(gran, int):
                nb = 4 if flags.get("use_int4_w4a16") else 8
                gs = math.gcd(gran, Kd)                          # a group divides Kdim
                wq, ws, wz = RQ.quantize_weight_wna16(wf, nb, gs, zero_point="zp" in name)
                aq, as_ = x, None
            else:
                qd = "fp8" if flags.get("use_fp8_w8a8") else "int8"
                aq, as_ = RQ.moe_kernel_quantize_input(x, None, qd,
                                                       flags.get("per_act_token_quant", False),
                                                       flags.get("block_shape"))
                quant_w = RQ.quantize_weight_fp8 if qd == "fp8" else RQ.quantize_weight_int8
                wq, ws = quant_w(wf, gran)
                wz = None
            want = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, K, B, tw, True, a_scale=as_,
                                         w_scale=ws, w_zp=wz, **flags)
            for ver in VERSIONS:
                outd = C.empty((M_a * K, N), bf16)
                C.raw(outd).fill(0x7FC0)                        # poison: bf16 NaN
                try:
                    got = grouped_gemm_quant(up(aq), up(wq), up(st), up(ex), up(ntp), K, B,
                                             up(tw), True, a_scale=up(as_), w_scale=up(ws),
                                             w_zp=up(wz), version=ver, out=outd, **flags)
                    host = C.to_host(got)
                    host = host.view(bf16) if host.dtype == np.uint16 else host
                    err = C.rel_err(host.astype(np.float32), want.astype(np.float32))
                    status = "ok" if err <= 1e-2 else "FAIL"
                except ValueError as e:
                    err, status = float("nan"), f"skip ({e})"
                failures += status == "FAIL"
                print(f"{name:13s} {ver} M_a={M_a:3d} E={E} K={K} N={N:4d} Kdim={Kd:4d} B={B:3d} "
                      f"rel_err={err:.2e} {status}")
    if args.quick:
        raise SystemExit(1 if failures else 0)

    # timing: GEMM1 of DeepSeek-V3 (fp8 block) and Mixtral (int4), v2
    for label, (E, K, N, Kd), fmt in (("DeepSeek-V3 GEMM1 fp8", (256, 8, 4096, 7168), "fp8"),
                                      ("Mixtral GEMM1 int4", (8, 2, 28672, 4096), "int4")):
        # the codes' values do not change the time (no NaN: 0x38 is fp8 1.0, 0x88 int4 0 / 8)
        if fmt == "fp8":
            w = cupy.full((E, N, Kd), 0x38, dtype=cupy.uint8)
            ws = cupy.random.uniform(1e-3, 2e-3, (E, N // 128, Kd // 128), dtype=cupy.float32)
        else:
            w = cupy.full((E, N, Kd // 2), 0x88, dtype=cupy.uint8)
            ws = cupy.random.uniform(1e-3, 2e-3, (E, N, Kd // 128), dtype=cupy.float32)
        for T in (1, 64, 1024):
            ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
            B = 16 if T * K / E <= 16 else 64
            st, ex, ntp = (C.to_device(v) for v in moe_align_block_size(ids, B, E))
            if fmt == "fp8":
                a = cupy.full((T, Kd), 0x38, dtype=cupy.uint8)
                as_ = cupy.random.uniform(1e-3, 2e-3, (T, Kd // 128), dtype=cupy.float32)
                kw = dict(a_scale=as_, w_scale=ws, use_fp8_w8a8=True, block_shape=[128, 128])
            else:
                a = C.to_device(rng.standard_normal((T, Kd)).astype(bf16))
                kw = dict(w_scale=ws, use_int4_w4a16=True)

            def run():
                grouped_gemm_quant(a, w, st, ex, ntp, K, B, **kw)
            t = C.median(C.cuda_time(run, warmup=3, reps=20)) * 1e-3
            touched = len(np.unique(ids))
            nbytes = quant_weight_bytes(fmt, touched, N, Kd)
            flops = gemm_flops(T * K, N, Kd)
            floor = max(nbytes / HBM_BYTES_PER_S, flops / (PEAK_FP8 if fmt == "fp8" else PEAK_BF16))
            print(f"{label} T={T:5d}: {t * 1e6:9.1f} us  {nbytes / t / 1e12:5.2f} TB/s  "
                  f"{flops / t / 1e12:7.1f} TFLOP/s  roofline {floor / t:5.1%}")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":  # pragma: no cover
    _main()
