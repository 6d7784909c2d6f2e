"""The quantized GEMMs' configs: one table for both ladders, and the routes that pick from it.

    CONFIGS[ladder][name] = dict(rung="vN", tunables...)     ladder "w8a8" or "wna16"
    ROUTES[format] = ((max rows per expert, min Kdim, name), ...)

The table holds what the router picks, plus one config per rung that the router never picks
(wna16 v6's h32, and each ladder's v1 "naive", which has no tunables), so that every rung runs
by name. A route is tried in order: the first entry whose rows per expert (P / E) and Kdim
cover the problem and whose rung takes it (the ladder module's `refuses`) runs; the last
entry of every route is v1, which takes everything. `version=` keeps the entries of one rung
(rows and Kdim then only order them); `config=` names one entry, or gives a dict of tunables
with its "rung".

Tile rows (BM, or 8 MT: MT token tiles of 8) must divide the alignment block_size, since a
tile lies in one expert's block; `block_size_for` gives the block size that lets a route
take its best entry.

Measurements (H200 unless said; GEMM1 / GEMM2 in us; the L2 flushed before each repetition)
say why each entry is what it is; the configs they beat are in git history (issue 37 took
the int4 path from 34 named configs to the 10 below). The napkin math at the end (bytes of the
quantized weights, flops, the H200's peaks) is what the ladders' scripts and the benchmarks
print their floors with.
"""
from __future__ import annotations

INF = float("inf")

CONFIGS = {
    "w8a8": {
        # v1: one thread per output, block 128 (no tunables)
        "naive": dict(rung="v1"),
        # v2: tile rows BM, columns BN, K tile 128 (one scale block), WARPS_M x WARPS_N warps,
        # a cp.async ring of STAGES tiles.
        #   m16: small batches stream the weights: many CTAs (narrow BN) and a deep ring keep
        #        enough bytes in flight with 1-16 rows per expert.
        #   m64: larger batches reuse each weight tile across 64 rows: wider BN, 8 warps.
        "m16": dict(rung="v2", BM=16, BN=64, WARPS_M=1, WARPS_N=4, STAGES=6),
        "m64": dict(rung="v2", BM=64, BN=128, WARPS_M=2, WARPS_N=4, STAGES=4),
        # v3 (fp8 decode): BM = 8 token rows per CTA (tiles of 8), 16 weight rows per CTA, WARPS
        # warps splitting K by 128-wide blocks, U blocks of weight loads in flight per thread,
        # MINB CTAs per SM (caps the registers); PF = 2 adds the L2::256B prefetch hint.
        # Measured (2026-11-30, DeepSeek-V3, block 16; GEMM1 Kdim 7168 / GEMM2 Kdim 2048):
        #   T=1    GEMM1 u3ll 66.1, u3 68.1, u2m6 70.4       GEMM2 u2m6 37.0, u3 40.1
        #   T=16   GEMM1 u3 707, u2m6 768, u3ll 743          GEMM2 u2m6 399, u3 430
        #   T=64   GEMM1 u2m6 1560, u3 1607                  GEMM2 u2m6 861, u3 1000
        # (each timed twice, spread <= 1%). Two register buffers, a persistent grid and 16-row
        # tiles were slower everywhere.
        "gemv8w4u3ll": dict(rung="v3", BM=8, WARPS=4, U=3, MINB=4, PF=2),
        "gemv8w4u3": dict(rung="v3", BM=8, WARPS=4, U=3, MINB=4),
        "gemv8w4u2m6": dict(rung="v3", BM=8, WARPS=4, U=2, MINB=6),
        # v4 (fp8, sm_90a wgmma e4m3): BM token rows (64 per warpgroup), BN weight rows, STAGES
        # 128-wide K blocks in the ring. Measured (DeepSeek-V3): GEMM1 / GEMM2 1.83 / 1.03 ms at
        # T=1024, 3.72 / 2.28 ms at T=4096; BM = 128 (block 128) 3.00 / 1.93 and 4.38 / 2.81.
        "wg64": dict(rung="v4", BM=64, BN=128, STAGES=4),
    },
    "wna16": {
        # v1: one thread per output, block 128 (no tunables)
        "naive": dict(rung="v1"),
        # v2: as w8a8's v2 with a K tile BK; m64: one warp spans all 64 rows (WARPS_M = 1), so
        # each dequantized B fragment feeds 4 mma instead of 2 (the dequantization is the cost).
        "m16": dict(rung="v2", BM=16, BN=64, BK=128, WARPS_M=1, WARPS_N=4, STAGES=8),
        "m64": dict(rung="v2", BM=64, BN=128, BK=64, WARPS_M=1, WARPS_N=4, STAGES=4),
        # v3 (int4 decode): BM = 8 MT activation rows per CTA, 16 weight rows per CTA, WARPS
        # warps splitting K, U 128-K steps of weight loads in flight per thread, MINB CTAs per
        # SM (caps registers at 65536 / (MINB WARPS 32): gemv32 at 128 spills a few words).
        # Mixtral GEMM1 + GEMM2: T=1 155 us, T=16 599, T=64 1156 (v4 / v5 since: 62 / 214 / 262).
        "gemv16": dict(rung="v3", BM=16, WARPS=8, U=4, MINB=2),
        "gemv32": dict(rung="v3", BM=32, WARPS=8, U=3, MINB=2),
        # v4 (int4 prepacked, decode): MT token tiles of 8 (a CTA computes its live ones only),
        # W warps splitting each 16-row tile's K, D 16-byte loads in flight per lane, RT tiles
        # of 16 rows per warp group sharing the activation fragments, MINB CTAs per SM, WAVES
        # waves of CTAs planned (default 1). Mixtral T=1 / 16, GEMM1 + GEMM2: q8 67 / 228 us
        # against MT = 2 71 / 250 and MT = 4 71 / 257; in another run D = 2 73 / 245 against
        # q8's 71 / 232.
        "q8": dict(rung="v4", MT=1, W=8, D=4, RT=2, MINB=2),
        # v5 (int4 prepacked, staged): W warps of TPW 16-row tiles (a row block of W TPW tiles),
        # KC 64-code chunks per stage, S stages, MT token tiles of 8, MINB CTAs per SM; WS: the
        # producers' registers of the warp-specialized CTA (sm_90a's setmaxnreg).
        # Mixtral T = 64: t24 200 / 116, t32 210 / 122 (against v4's best, MT = 3 / 4: 253 / 121
        # and 242 / 122); T = 256: t24 590 / 316, t32 598 / 315. Up to 8 rows v4 stays (T = 1:
        # q8 43 / 25 against v5 at MT = 1 51 / 37). t24 with 3 stages rather than 4: T = 64 layer
        # 0.6-2.8 us faster, T = 256 4-6 us. t24ws (one CTA per SM: 8 consumer warps at 224
        # registers, a producer warpgroup at 56): layer 256.2 / 441.5 / 720.8 us at T = 64 /
        # 128 / 256 against t24's 258.5 / 455.6 / 753.7; the same 8 warps without WS 8-16%
        # slower; other register splits, 3 or 5 stages, 4 consumer warps in 2 CTAs per SM:
        # slower or no faster.
        "t24": dict(rung="v5", MT=3, W=4, TPW=4, KC=2, S=3, MINB=2),
        "t32": dict(rung="v5", MT=4, W=4, TPW=4, KC=2, S=4, MINB=2),
        "t24ws": dict(rung="v5", MT=3, W=8, TPW=4, KC=2, S=4, MINB=1, WS=56),
        # v6 (int4 prepacked in wgmma's lane order, sm_90a): one warpgroup per CTA, RB 64-row
        # groups an item, MT token tiles of 8 (wgmma n = 8 live tiles), D chunks of weights in
        # flight per lane (D >= S - 1), S activation stages, MINB CTAs per SM, WAVES waves
        # planned, KS K splits ("auto": enough for one wave). Mixtral T = 64: 230 / 185 (143
        # with the K split); not routed (see wna16_v6_wgmma.cu).
        "h32": dict(rung="v6", MT=4, D=4, S=4, MINB=4, WAVES=4, RB=2),
    },
}

# The tunables a config dict of each rung must give (the launchers read them).
TUNABLES = {
    ("w8a8", "v1"): (), ("w8a8", "v2"): ("BM", "BN", "WARPS_M", "WARPS_N", "STAGES"),
    ("w8a8", "v3"): ("BM", "WARPS", "U", "MINB"), ("w8a8", "v4"): ("BM", "BN", "STAGES"),
    ("wna16", "v1"): (), ("wna16", "v2"): ("BM", "BN", "BK", "WARPS_M", "WARPS_N", "STAGES"),
    ("wna16", "v3"): ("BM", "WARPS", "U", "MINB"), ("wna16", "v4"): ("MT", "W", "D", "MINB"),
    ("wna16", "v5"): ("MT", "W", "TPW", "KC", "S", "MINB"),
    ("wna16", "v6"): ("MT", "D", "S", "MINB"),
}
LADDER_OF = {"fp8": "w8a8", "int8": "w8a8", "int4": "wna16", "w8a16": "wna16"}
RUNGS = {"w8a8": ("v1", "v2", "v3", "v4"), "wna16": ("v1", "v2", "v3", "v4", "v5", "v6")}

# The tiles of v2: 16 rows up to 16 rows per expert, else 64; 16 where 64 does not divide the
# block size; v1 last (it takes any problem).
_TILES = ((16, 0, "m16"), (INF, 0, "m64"), (INF, 0, "m16"), (INF, 0, "naive"))
ROUTES = {
    # fp8: decode batches (up to 4 rows per expert) stream the weights (v3); above, wgmma
    # (v4, sm_90) or mma.sync tiles (v2) elsewhere. At T=256 (8 rows per expert) v4 with block
    # 64 took GEMM1 1.80 ms / GEMM2 0.97 against v3's best 2.42 / 1.72 (v2: 2.69 / 1.49); at
    # T=64 (2 rows) v3 1.77 / 1.06 ms. The crossover between 2 and 8 rows is not measured: 4
    # splits it.
    "fp8": ((0.25, 4096, "gemv8w4u3ll"), (1, 4096, "gemv8w4u3"), (4, 0, "gemv8w4u2m6"),
            (INF, 0, "wg64")) + _TILES,
    "int8": _TILES,
    # int4: v4 (q8) up to 8 rows per expert, v5 (t24ws on sm_90, else t24; t32 where 24 does
    # not divide the block size) up to 128, q8 up to 24 for other block sizes; problems the
    # prepacked rungs do not take (N % 16, group sizes that are not 64 times a power of two)
    # go to v3 up to 24 rows; v2 above (at 32 / 64 / 128 / 256 rows per expert v4 at MT = 4
    # took 0.82 / 1.48 / 2.74 / 5.71 ms against v2's 1.50 / 2.36 / 3.05 / 5.41, before v5
    # took 9-128).
    "int4": ((8, 0, "q8"), (128, 0, "t24ws"), (128, 0, "t24"), (128, 0, "t32"), (24, 0, "q8"),
             (8, 0, "gemv16"), (24, 0, "gemv32"), (24, 0, "gemv16")) + _TILES,
    "w8a16": _TILES,
}


def block_size_for(fmt: str, rows_per_expert: float) -> int:
    """The alignment block_size that lets the route of `fmt` ("fp8", "int8", "int4", "w8a16")
    take its best entry for `rows_per_expert` = P / E rows."""
    if fmt == "int4":
        # up to 8 rows: 16 (q8's and gemv16's tiles divide it); up to 128: 48, t24's measured
        # block (32 routes to t32, slower: T = 64 t24 188 / 110 against t32 198 / 118); above,
        # the v2 tiles' 64
        return 16 if rows_per_expert <= 8 else 48 if rows_per_expert <= 128 else 64
    if fmt == "fp8":   # v3 takes 8-row tiles, v4 64-row ones above its range
        return 16 if rows_per_expert <= 4 else 64
    return 16 if rows_per_expert <= 16 else 64


def tile_rows(cfg: dict) -> int:
    """The positions a CTA of `cfg` owns (BM, or 8 MT); 1 for v1 (one position per CTA)."""
    if "BM" in cfg:
        return cfg["BM"]
    return 8 * cfg["MT"] if "MT" in cfg else 1


def config_dict(ladder: str, config, version: str | None = None) -> tuple[str, dict]:
    """(name, a copy of the config) for `config`, a name of CONFIGS[ladder] or a dict of
    tunables (with its "rung", or `version`); ValueError naming what is wrong."""
    table = CONFIGS[ladder]
    if isinstance(config, str):
        if config not in table:
            raise ValueError(f"config: expected one of {sorted(table)} ({ladder}), got "
                             f"{config!r}")
        name, cfg = config, dict(table[config])
    elif isinstance(config, dict):
        name, cfg = "custom", dict(config)
        cfg.setdefault("rung", version)
    else:
        raise TypeError(f"config: expected a name or a dict, got {type(config).__name__}")
    rung = cfg.get("rung")
    if rung not in RUNGS[ladder]:
        raise ValueError(f"config: expected a rung of {RUNGS[ladder]} (its 'rung' key or "
                         f"version=), got {rung!r}")
    if version is not None and version != rung:
        raise ValueError(f"config: {name} is a config of {rung}, not of version {version}")
    missing = [k for k in TUNABLES[ladder, rung] if k not in cfg]
    if missing:
        raise ValueError(f"config: expected keys {list(TUNABLES[ladder, rung])} for {ladder} "
                         f"{rung}, missing {missing}")
    return name, cfg


def common_refusal(cfg: dict, block_size: int, aligned: bool) -> str | None:
    """What every rung but v1 needs, in both ladders: a and w on 16-byte boundaries (the loads
    move 16-byte chunks) and tiles that lie in one alignment block; None when cfg has both."""
    rung = cfg["rung"]
    if rung == "v1":
        return None
    if not aligned:
        return f"{rung} loads 16-byte chunks: a and w must be 16-byte aligned"
    bm = tile_rows(cfg)
    if block_size % bm:
        return f"{rung}'s tiles of {bm} rows need block_size a multiple of {bm}, got {block_size}"
    return None


def refusal(block_size: int, aligned: bool, rung_refusal):
    """A ladder's refuses(cfg): common_refusal first (v1 takes every problem), then the
    ladder's own check of its rung, rung_refusal(cfg) -> None or why not."""
    def why(cfg):
        common = common_refusal(cfg, block_size, aligned)
        if common or cfg["rung"] == "v1":
            return common
        return rung_refusal(cfg)
    return why


def route(fmt: str, rows_per_expert: float, Kdim: int, refuses, version: str | None = None,
          config=None) -> tuple[str, dict]:
    """(name, config) of the entry that runs: `config` if given (ValueError when its rung
    refuses the problem), else the first entry of ROUTES[fmt] (of rung `version` only, when
    given) that covers the rows and Kdim and that the rung takes. `refuses(cfg)` is the
    ladder's check: None, or why the rung cannot run this problem with cfg."""
    ladder = LADDER_OF[fmt]
    if version is not None and version not in RUNGS[ladder]:
        raise ValueError(f"version: expected one of {RUNGS[ladder]} ({ladder}), got {version!r}")
    if config is not None:
        name, cfg = config_dict(ladder, config, version)
        why = refuses(cfg)
        if why:
            raise ValueError(f"config: {name} ({ladder} {cfg['rung']}) cannot run this problem: "
                             f"{why}")
        return name, cfg
    table = CONFIGS[ladder]
    entries = [(r, k, n) for r, k, n in ROUTES[fmt]
               if version is None or table[n]["rung"] == version]
    if version is not None:   # a rung asked for: its entries past their rows (widest range
        # first: the nearest to a batch past them all), then its configs off the route
        entries += [(INF, 0, n) for _, _, n in sorted(entries, key=lambda e: -e[0])]
        entries += [(INF, 0, n) for n, c in table.items() if c["rung"] == version]
    reasons = []
    for rows, min_k, name in entries:
        if rows_per_expert > rows or Kdim < min_k:
            continue
        why = refuses(table[name])
        if why is None:
            return name, dict(table[name])
        reasons.append(why)
    if version is None:
        raise AssertionError("every route ends with v1, which takes every problem")
    raise ValueError(f"version: {ladder} {version} cannot run this problem: "
                     f"{reasons[0] if reasons else 'no config of it'}")


# ----------------------------------------------------------------------------- napkin math
HBM_BYTES_PER_S = 4.8e12     # H200 datasheet
PEAK_BF16 = 989e12           # dense bf16 tensor-core FLOP/s (the weight-only mma runs in bf16)
PEAK_FP8 = 1979e12           # dense fp8


def gemm_flops(num_slots: int, N: int, K: int) -> float:
    """2 * P * N * Kdim."""
    return 2.0 * num_slots * N * K


def quant_weight_bytes(fmt: str, touched: int, N: int, K: int, group_size: int = 128,
                       block: int = 128) -> float:
    """Bytes of the touched experts' weights in the quantized format, fp32 scales included."""
    if fmt in ("fp8", "int8"):
        return touched * (N * K + 4 * -(-N // block) * -(-K // block))
    codes = N * K // 2 if fmt == "int4" else N * K
    return touched * (codes + 4 * N * (K // group_size))
