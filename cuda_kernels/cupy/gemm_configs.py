"""The grouped GEMM's tunables as data: which rung and which tiles for a problem.

    gemm_configs.json  maps (version, dtype, bucket of m = tokens per expert, N, Kdim) to
                       BLOCK_M, BLOCK_N, BLOCK_K, warps, stages (v3: TM, TN; v6: GROUP_M,
                       PRODUCER_REGS): generic rows, and per card (its name as the driver
                       gives it) the rows, the rung per bucket ("version_by_m") and per
                       tuned shape ("version_by_shape") that tune.py measured fastest on
                       that card
    heuristic_config   the rule behind the untuned rows (decode: short, narrow, deep tiles;
                       prefill: big square ones)
    lookup             the table's row for a problem (the card's shape-specific rows first)
    default_version    the rung used when none is named
    rung_is_tuned      whether that rung was measured on this card (False: the table's
                       default, on a card tune.py never ran on at that bucket)
    get_config         the config for M tokens before alignment runs: its BLOCK_M is the
                       block_size to give moe_align_block_size
    fit_config         a config with BLOCK_M shrunk to divide the alignment block
    check_config       whether a config can launch (threads, shared memory, registers)
    kernel_defines     the #defines that instantiate a rung's .cu with a fitted config
    launch_geometry    (grid, block, dynamic shared bytes) of a fitted config

gemm.py, the launcher, asks these; tune.py regenerates the table. Shape legend as in gemm.py:
m tokens per expert, N output width, K (Kdim) reduction width.
"""
from __future__ import annotations

import functools
import json
import math
import pathlib

import numpy as np

from ._arrays import bf16_dtype

VERSIONS = ("v1", "v2", "v3", "v4", "v5", "v6")
TENSOR_CORE_VERSIONS = ("v4", "v5", "v6")
CONFIG_PATH = pathlib.Path(__file__).resolve().with_name("gemm_configs.json")
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DTYPE_KEYS = ("fp32", "fp16", "bf16")
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "warps", "stages")
GROUP_M = 8                       # v4 launch order: m-tiles per group (L2 reuse of w and a)


# ----------------------------------------------------------------------------- dtypes
def dtype_key(dtype) -> str:
    """'fp32', 'fp16' or 'bf16' for a floating dtype (uint16 is bf16's byte view)."""
    dt = np.dtype(dtype)
    if dt == np.float32:
        return "fp32"
    if dt == np.float16:
        return "fp16"
    if dt == bf16_dtype() or dt == np.uint16:
        return "bf16"
    raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dt}")


_CTYPES = {"fp32": "float", "fp16": "__half", "bf16": "__nv_bfloat16"}
_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}


def vec_elems(dkey: str) -> int:
    """Elements per 16-byte load: Kdim must be a multiple of it for v3 and v4."""
    return 16 // _ITEMSIZE[dkey]


# ----------------------------------------------------------------------------- configs
def _pow2_divisor(n: int) -> int:
    """The largest power of two that divides n (n >= 1)."""
    return n & -n


def _is_pow2(n) -> bool:
    return isinstance(n, int) and n >= 1 and (n & (n - 1)) == 0


def m_bucket(tokens_per_expert: float) -> int:
    """The smallest bucket >= tokens per expert (the last bucket for anything above it)."""
    for b in M_BUCKETS:
        if tokens_per_expert <= b:
            return b
    return M_BUCKETS[-1]


def v4_warp_grid(block_m: int, block_n: int, warps: int) -> tuple[int, int]:
    """(WARPS_M, WARPS_N) for v4: warp tiles multiples of 16 x 16, as square as possible."""
    best = None
    wm = 1
    while wm <= warps:
        wn = warps // wm
        if block_m % wm == 0 and block_n % wn == 0 and (block_m // wm) % 16 == 0 \
                and (block_n // wn) % 16 == 0:
            score = abs(math.log2((block_m // wm) / (block_n // wn)))
            if best is None or score < best[0]:
                best = (score, wm, wn)
        wm *= 2
    if best is None:
        raise ValueError(f"config: no warp grid of {warps} warps gives 16x16-multiple warp tiles "
                         f"for BLOCK_M={block_m}, BLOCK_N={block_n}")
    return best[1], best[2]


def v4_smem_bytes(cfg: dict) -> int:
    """Dynamic shared memory of v4: the cp.async ring, reused for the output tile."""
    ring = cfg["stages"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * (cfg["BLOCK_K"] + 8)
    out = cfg["BLOCK_M"] * (cfg["BLOCK_N"] + 8)
    return 2 * max(ring, out)


V5_SMEM_ALIGN = 1024   # v5's swizzled ring starts on a 1024-byte boundary inside the buffer


def v5_smem_bytes(cfg: dict) -> int:
    """Dynamic shared memory of v5: the swizzled ring (no padding), reused for the output
    tile, plus 1024 bytes to start it on a 1024-byte boundary (static smem comes first)."""
    ring = cfg["stages"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"]
    out = cfg["BLOCK_M"] * (cfg["BLOCK_N"] + 8)
    return 2 * max(ring, out) + V5_SMEM_ALIGN


V6_EPI_BYTES = 64 * (64 + 8) * 2   # a consumer's epilogue staging: 64 rows x 64 columns (+8)
V6_EXTRA_KEYS = ("GROUP_M", "PRODUCER_REGS")   # v6's tunables beside CONFIG_KEYS
V6_DEFAULT_SMS = 132              # H100 / H200 SXM: launch_geometry's grid when none is given


def v6_consumers(cfg: dict) -> int:
    """Consumer warpgroups of a v6 config: warps = 4 (the producer) + 4 per consumer."""
    return cfg["warps"] // 4 - 1


def v6_smem_bytes(cfg: dict) -> int:
    """Dynamic shared memory of v6: 1024 (alignment of the swizzle atoms) + the ring of
    STAGES x (a tile + w tile) + one epilogue staging tile per consumer + 2 mbarriers a stage."""
    ring = cfg["stages"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
    return 1024 + ring + v6_consumers(cfg) * V6_EPI_BYTES + 16 * cfg["stages"]


def v6_consumer_regs(cfg: dict) -> int:
    """setmaxnreg of v6's consumers: what the CTA entered with (the cap of __launch_bounds__
    (threads, 1): 65536 / threads, rounded down to 8) less the producer's share, split among
    the consumers, rounded down to 8, at most 256 (one consumer: no split, 256)."""
    threads = cfg["warps"] * 32
    entry = 65536 // threads // 8 * 8
    cons = v6_consumers(cfg)
    if cons == 1:
        return 256
    return min(256, (entry * threads - 128 * cfg["PRODUCER_REGS"]) // (128 * cons) // 8 * 8)


# per-CTA opt-in limit on sm_90 (227 KB; sm_80: 163 KB), less room for the static slots
V4_SMEM_LIMIT = 227 * 1024 - 1024

def check_config(version: str, dtype, cfg: dict) -> dict:
    """Raise ValueError unless `cfg` is a launchable config of `version`; return it."""
    if version not in VERSIONS:
        raise ValueError(f"version: expected one of {VERSIONS}, got {version!r}")
    dkey = dtype_key(dtype) if not isinstance(dtype, str) else dtype
    if not isinstance(cfg, dict):
        raise TypeError(f"config: expected a dict, got {type(cfg).__name__}")
    for k in CONFIG_KEYS:
        v = cfg.get(k)
        if k == "warps" and version == "v6":   # a producer warpgroup + 1 or 2 consumers: 8, 12
            continue
        if not (_is_pow2(v) or (k == "stages" and isinstance(v, int) and 1 <= v <= 8)):
            raise ValueError(f"config: expected {k} a power of two (stages: 1 to 8), "
                             f"got {v!r} in {cfg}")
    bm, bn, bk, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["warps"]
    if version == "v1":
        if warps * 32 % bn or warps * 32 // bn < 1 or warps * 32 > 1024:
            raise ValueError(f"config: v1 needs BLOCK_N dividing warps*32 <= 1024, got {cfg}")
    elif version == "v2":
        if bm * bn > 1024:
            raise ValueError(f"config: v2 runs BLOCK_M*BLOCK_N threads (<= 1024), got {cfg}")
        if bm * bn != warps * 32 and bm * bn >= 32:
            raise ValueError(f"config: v2 warps must be BLOCK_M*BLOCK_N/32, got {cfg}")
    elif version == "v3":
        tm, tn = cfg.get("TM"), cfg.get("TN")
        if not (_is_pow2(tm) and _is_pow2(tn)) or bm % tm or bn % tn:
            raise ValueError(f"config: v3 needs TM | BLOCK_M, TN | BLOCK_N (powers of two), "
                             f"got {cfg}")
        threads = (bm // tm) * (bn // tn)
        if not 32 <= threads <= 1024 or threads != warps * 32:
            raise ValueError(f"config: v3 runs (BLOCK_M/TM)*(BLOCK_N/TN) = warps*32 threads in "
                             f"[32, 1024], got {threads} for {cfg}")
        if bk % vec_elems(dkey):
            raise ValueError(f"config: v3 BLOCK_K must hold whole 16-byte chunks "
                             f"({vec_elems(dkey)} elements of {dkey}), got {cfg}")
        if 4 * bk * (bm + bn + 8) + 12 * bm > 48 * 1024:
            raise ValueError(f"config: v3 static shared memory over 48 KB for {cfg}")
    elif version == "v5":
        if dkey == "fp32":
            raise ValueError("config: v5 takes fp16 or bf16 (fp32 uses v3)")
        if bm not in (64, 128) or bn not in (64, 128, 256) or bk not in (16, 32, 64):
            raise ValueError(f"config: v5 needs BLOCK_M in (64, 128), BLOCK_N in (64, 128, "
                             f"256), BLOCK_K in (16, 32, 64) (one 32/64/128-byte swizzled "
                             f"row), got {cfg}")
        threads = bm // 64 * 128
        if warps != bm // 16 or cfg["stages"] < 3 or (bn * bk // 8) % threads:
            raise ValueError(f"config: v5 runs BLOCK_M/64 warpgroups (warps = BLOCK_M/16), "
                             f">= 3 stages, whole copy rounds of w, got {cfg}")
        if v5_smem_bytes(cfg) > V4_SMEM_LIMIT:
            raise ValueError(f"config: v5 shared memory {v5_smem_bytes(cfg)} B over "
                             f"{V4_SMEM_LIMIT} B for {cfg}")
    elif version == "v6":
        if dkey == "fp32":
            raise ValueError("config: v6 takes fp16 or bf16 (fp32 uses v3)")
        if bm not in (64, 128, 256) or bn not in (64, 128, 256) or bk != 64 or \
                (bm == 256 and bn == 256):
            raise ValueError(f"config: v6 needs BLOCK_M in (64, 128, 256), BLOCK_N in (64, "
                             f"128, 256) (at most 128 with BLOCK_M 256: two accumulators a "
                             f"consumer), BLOCK_K 64 (one 128-byte swizzled row), got {cfg}")
        if warps not in (8, 12) or (bm >= 128 and warps != 12) or \
                (warps == 12 and bm == 64 and bn < 128):
            raise ValueError(f"config: v6 runs a producer warpgroup and consumers (warps = 4 + "
                             f"4 per consumer): 12 warps for BLOCK_M 128 and 256; 8 or 12 for "
                             f"BLOCK_M 64 (two consumers split BLOCK_N >= 128), got {cfg}")
        group, preg = cfg.get("GROUP_M"), cfg.get("PRODUCER_REGS")
        if not (_is_pow2(group) and group <= 64):
            raise ValueError(f"config: v6 GROUP_M (m tiles per group of the tile order) must "
                             f"be a power of two <= 64, got {cfg}")
        if not (isinstance(preg, int) and 24 <= preg <= 256 and preg % 8 == 0):
            raise ValueError(f"config: v6 PRODUCER_REGS (setmaxnreg) must be a multiple of 8 "
                             f"in [24, 256], got {cfg}")
        if cfg["stages"] < 2 or v6_consumer_regs(cfg) < 128:
            raise ValueError(f"config: v6 needs >= 2 stages and leaves its consumers >= 128 "
                             f"registers, got {cfg}")
        if v6_smem_bytes(cfg) > V4_SMEM_LIMIT:
            raise ValueError(f"config: v6 shared memory {v6_smem_bytes(cfg)} B over "
                             f"{V4_SMEM_LIMIT} B for {cfg}")
    else:
        if dkey == "fp32":
            raise ValueError("config: v4 takes fp16 or bf16 (fp32 uses v3)")
        if bm < 16 or bk < 16 or bn < 16:
            raise ValueError(f"config: v4 needs BLOCK_M, BLOCK_N, BLOCK_K >= 16, got {cfg}")
        wm = cfg.get("WARPS_M")
        if wm is None:
            wm, _ = v4_warp_grid(bm, bn, warps)
        wn = warps // wm if warps % wm == 0 else 0
        if not wn or (bm // wm) % 16 or (bn // wn) % 16 or bm % wm or bn % wn:
            raise ValueError(f"config: v4 warp tiles must be multiples of 16x16, got {cfg}")
        if cfg["stages"] < 2 or warps * 32 > 1024 or (warps * 32) % (bk // 8):
            raise ValueError(f"config: v4 needs stages >= 2, <= 1024 threads, and threads a "
                             f"multiple of BLOCK_K/8, got {cfg}")
        if v4_smem_bytes(cfg) > V4_SMEM_LIMIT:
            raise ValueError(f"config: v4 shared memory {v4_smem_bytes(cfg)} B over "
                             f"{V4_SMEM_LIMIT} B for {cfg}")
    return cfg


def heuristic_config(version: str, dkey: str, m: int, N: int | None = None,
                     K: int | None = None) -> dict:
    """A reasonable config without timing anything: the rule behind the untuned table.

    m is the bucket of tokens per expert. Small m is the decode regime: the GEMM reads the
    touched experts' weights once and is bound by memory bandwidth, so tiles are short in M
    (little padding), narrow in N (many CTAs to keep every SM streaming) and deep in K with
    several stages (many bytes in flight). Large m is compute-bound: big square tiles.
    """
    if version == "v1":
        return {"BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": 64, "BLOCK_K": 1,
                "warps": 8, "stages": 1}
    if version == "v2":
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "warps": 16, "stages": 1}
    if version == "v3":
        bk = 32 if dkey != "fp32" else 16
        if m <= 16:
            return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": bk, "warps": 2, "stages": 1,
                    "TM": 4, "TN": 4}
        if m <= 32:
            return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": bk, "warps": 4, "stages": 1,
                    "TM": 4, "TN": 4}
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": bk, "warps": 8, "stages": 1,
                "TM": 4, "TN": 4}
    if version == "v4":
        if dkey == "fp32":
            return heuristic_config("v3", dkey, m, N, K)
        if m <= 16:
            return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "warps": 4, "stages": 4}
        if m <= 32:
            return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "warps": 4, "stages": 4}
        if m <= 64:
            return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "warps": 4, "stages": 4}
        if m <= 128:
            return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "warps": 4, "stages": 3}
        # from m = 256 (measured, H200: this tile ran at 290-310 TFLOP/s at m >= 1024 where
        # 64 x 128 x 64 gave 170-200 at m = 128-256; the padding of 128-row tiles costs less)
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "warps": 4, "stages": 4}
    if version == "v5":
        if dkey == "fp32":
            return heuristic_config("v3", dkey, m, N, K)
        # cp.async runs STAGES - 2 tiles ahead (one wgmma batch stays in flight): deep rings,
        # 64-128 KB of copies in flight per CTA, cover the L2/HBM latency
        if m <= 32:   # decode: narrow tiles, more CTAs streaming the weights (2 per SM)
            return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "warps": 4, "stages": 6}
        if m <= 128:  # 2 CTAs per SM, 6 x 12 KB in flight each
            return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "warps": 4, "stages": 8}
        if m <= 512:  # 1 CTA per SM, 4 x 32 KB in flight
            return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "warps": 8, "stages": 6}
        # 128 x 256: 85 flops per byte of tile; 6 x 24 KB in flight
        return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "warps": 8, "stages": 8}
    if version == "v6":
        if dkey == "fp32":
            return heuristic_config("v3", dkey, m, N, K)
        # a producer warpgroup (56 registers: no spills at BLOCK_M 128) and 1 or 2 consumer
        # warpgroups; the ring holds 160-200 KB (STAGES - 1 stages of copies in flight)
        if m <= 32:   # decode: one consumer, narrow tiles, a deep ring
            return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "warps": 8, "stages": 8,
                    "GROUP_M": 8, "PRODUCER_REGS": 56}
        if m <= 128:  # short m tiles (little padding), two consumers splitting 256 columns
            return {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "warps": 12, "stages": 5,
                    "GROUP_M": 8, "PRODUCER_REGS": 56}
        if m <= 256:  # 128 x 128 x 64: 64 flops per byte of tile, 6 x 32 KB stages
            return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "warps": 12, "stages": 6,
                    "GROUP_M": 8, "PRODUCER_REGS": 56}
        # 128 x 256 x 64: 85 flops per byte of tile (the L2's bandwidth is the limit), 4 x 48 KB
        return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "warps": 12, "stages": 4,
                "GROUP_M": 8, "PRODUCER_REGS": 56}
    raise ValueError(f"version: expected one of {VERSIONS}, got {version!r}")


@functools.lru_cache(maxsize=1)
def load_table(path: str = str(CONFIG_PATH)) -> dict:
    """The config table (gemm_configs.json); an empty one when the file is missing."""
    p = pathlib.Path(path)
    if not p.is_file():
        return {"configs": []}
    return json.loads(p.read_text())


def _row_config(row: dict) -> dict:
    cfg = {k: row[k] for k in CONFIG_KEYS}
    for k in ("TM", "TN", "WARPS_M") + V6_EXTRA_KEYS:
        if k in row:
            cfg[k] = row[k]
    return cfg


# ----------------------------------------------------------------------------- devices
# A card's tuned rows live in the table's "devices" section under the name the driver gives
# it (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H200"): tune.py writes the section of the card it
# ran on, and a lookup on that card reads it first. Other cards get the generic rows.
@functools.lru_cache(maxsize=16)
def device_name(dev: int) -> str:
    """The CUDA device's name as the driver reports it (the key of its table section)."""
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(dev)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def current_device_name() -> str | None:
    """The current CuPy device's name, or None where there is no GPU (CPU CI)."""
    try:
        import cupy

        return device_name(cupy.cuda.Device().id)
    except Exception:          # no CuPy, no driver, no device: no card-specific rows
        return None


def _device_section(table: dict, device: str | None) -> dict:
    return table.get("devices", {}).get(device or "", {}) if device else {}


def lookup(version: str, dkey: str, m: float, N: int, K: int, table: dict | None = None,
           device: str | None = None) -> dict:
    """The table's config for (version, dtype, bucket of m, N, K); the heuristic when none.

    Rows with N and K are shape-specific (written by the tuner on a card, in the table's
    "devices" section under the card's name); rows without are generic. The nearest
    shape-specific shape of `device`'s section is used when it is within a factor of 2
    overall (|log2 N/N'| + |log2 K/K'| <= 1) and was tuned at this very m bucket (a tuner cut
    short by its budget leaves other buckets to the generic rows, not to a far bucket's
    tiles), else the generic rows; then the nearest m bucket.
    """
    table = load_table() if table is None else table
    bucket = m_bucket(m)
    rows = [r for r in table.get("configs", []) if r["version"] == version and r["dtype"] == dkey]
    tuned = [r for r in _device_section(table, device).get("configs", [])
             if r["version"] == version and r["dtype"] == dkey]
    shaped = [r for r in tuned + rows if r.get("N") and r.get("K") and r["m"] == bucket]

    def shape_dist(r):
        return abs(math.log2(max(N, 1) / r["N"])) + abs(math.log2(max(K, 1) / r["K"]))

    pick = []
    if shaped:
        best = min(shape_dist(r) for r in shaped)
        if best <= 1.0:
            pick = [r for r in shaped if shape_dist(r) == best]
    if not pick:
        pick = [r for r in rows if not (r.get("N") and r.get("K"))]
    if not pick:
        return heuristic_config(version, dkey, bucket, N, K)
    row = min(pick, key=lambda r: (abs(math.log2(bucket / r["m"])), r["m"]))
    return _row_config(row)


BUILTIN_DEFAULTS = {"fp32": "v3", "fp16": "v4", "bf16": "v4"}


def default_version_key(dkey: str, m: float | None = None, device: str | None = None,
                        N: int | None = None, K: int | None = None) -> str:
    return default_version({"fp32": np.float32, "fp16": np.float16, "bf16": bf16_dtype()}[dkey],
                           m, device, N, K)


def shape_key(m: float, N: int, K: int) -> str:
    """The key of a GEMM shape in a card's "version_by_shape": 'bucket,N,K'."""
    return f"{m_bucket(m)},{int(N)},{int(K)}"


def _card_rung(table: dict, dkey: str, m: float | None, device: str | None,
               N: int | None = None, K: int | None = None) -> str | None:
    """The rung `device`'s section names for this GEMM: for its very shape at the bucket of m
    ("version_by_shape", tune.py's fastest for that model), else for the bucket of m
    ("version_by_m", the fastest summed over the tuned models); None where nothing was
    measured on that card."""
    if m is None:
        return None
    sec = _device_section(table, device)
    if N is not None and K is not None:
        v = sec.get("version_by_shape", {}).get(dkey, {}).get(shape_key(m, N, K))
        if v is not None:
            return v
    return sec.get("version_by_m", {}).get(dkey, {}).get(str(m_bucket(m)))


def default_version(dtype, m: float | None = None, device: str | None = None,
                    N: int | None = None, K: int | None = None) -> str:
    """The rung used when none is named: the table's "default_version" for the dtype (v4 on
    fp16/bf16 and v3 on fp32 as shipped), unless the card's section (`device`'s, see
    `lookup`) names one for this GEMM's shape (N output columns, K reduction) at the bucket
    of m tokens per expert, or for the bucket (written by tune.py where the rung measured
    fastest on that card); stepping down when a problem rules it out."""
    dkey = dtype_key(dtype)
    table = load_table()
    v = _card_rung(table, dkey, m, device, N, K) or \
        table.get("default_version", {}).get(dkey, BUILTIN_DEFAULTS[dkey])
    if v not in VERSIONS or (v in TENSOR_CORE_VERSIONS and dkey == "fp32"):
        return BUILTIN_DEFAULTS[dkey]
    return v


def rung_is_tuned(dtype, m: float, device: str | None, N: int | None = None,
                  K: int | None = None) -> bool:
    """Whether `default_version`'s rung for m tokens per expert (and this shape) on card
    `device` was measured there (False: the table's default, e.g. on a card tune.py has not
    run on)."""
    return _card_rung(load_table(), dtype_key(dtype), m, device, N, K) is not None


def get_config(M: int, N: int, K: int, E: int, top_k: int, dtype, version: str | None = None,
               device: str | None = None) -> dict:
    """The kernel config for a GEMM with M tokens, before alignment runs.

    M tokens routed to top_k of E (local) experts gives m = M * top_k / E tokens per expert
    (GEMM2 has M = P slots and top_k = 1: the same m). The returned dict holds "version",
    BLOCK_M (the block_size to give moe_align_block_size), BLOCK_N, BLOCK_K, warps, stages
    (and TM, TN for v3). fp32 with v4 returns v3's config. device: the card whose tuned rows
    apply (None: the current CuPy device's, none without a GPU).
    """
    dkey = dtype_key(dtype)
    m = max(1.0, M * top_k / max(E, 1))
    device = current_device_name() if device is None else device
    version = default_version(dtype, m, device, N, K) if version is None else version
    if version not in VERSIONS:
        raise ValueError(f"version: expected one of {VERSIONS}, got {version!r}")
    if version in TENSOR_CORE_VERSIONS and dkey == "fp32":
        version = "v3"
    cfg = dict(lookup(version, dkey, m, N, K, device=device))
    cfg["version"] = version
    return cfg


def fit_config(version: str, dkey: str, cfg: dict, block_size: int) -> dict:
    """`cfg` with BLOCK_M shrunk to divide block_size (and the warp layout adjusted).

    A CTA tile must lie inside one alignment block (one expert), so BLOCK_M must divide B.
    Raises ValueError when `version` cannot run with this block_size (v4 needs B % 16 == 0).
    """
    cfg = {k: v for k, v in cfg.items() if k != "version"}
    if version == "v1":
        return check_config(version, dkey, cfg)
    bm = min(cfg["BLOCK_M"], _pow2_divisor(block_size))
    cfg["BLOCK_M"] = bm
    if version == "v2":
        cfg["warps"] = max(1, bm * cfg["BLOCK_N"] // 32)
    elif version == "v3":
        tm, tn, bn = min(cfg["TM"], bm), cfg["TN"], cfg["BLOCK_N"]
        while (bm // tm) * (bn // tn) < 32 and tn > 1:
            tn //= 2
        cfg["TM"], cfg["TN"] = tm, tn
        cfg["warps"] = max(1, (bm // tm) * (bn // tn) // 32)
    elif version == "v4":
        if bm < 16:
            raise ValueError(f"block_size: v4 needs a multiple of 16 (mma tiles are 16 rows), "
                             f"got {block_size}")
        warps, bn = cfg["warps"], cfg["BLOCK_N"]
        wm = min(cfg.get("WARPS_M") or v4_warp_grid(cfg["BLOCK_M"], bn, warps)[0], bm // 16)
        wn = max(1, warps // wm)
        while wn > 1 and (bn // wn) % 16:
            wn //= 2
        cfg["WARPS_M"], cfg["warps"] = wm, wm * wn
    elif version == "v5":
        if bm < 64:
            raise ValueError(f"block_size: v5 needs a multiple of 64 (a warpgroup's wgmma "
                             f"covers 64 rows), got {block_size}")
        cfg["warps"] = bm // 16
    elif version == "v6":
        if bm < 64:
            raise ValueError(f"block_size: v6 needs a multiple of 64 (a warpgroup's wgmma "
                             f"covers 64 rows), got {block_size}")
        cfg.setdefault("GROUP_M", 8)             # a config written for v4 / v5 lacks them
        cfg.setdefault("PRODUCER_REGS", 56)
        if bm >= 128:
            cfg["warps"] = 12           # two consumers of 64 rows (128) or two pieces (256)
        elif cfg["warps"] == 12 and cfg["BLOCK_N"] < 128:
            cfg["warps"] = 8            # 64 rows: two consumers would split N below 64
    return check_config(version, dkey, cfg)


def kernel_defines(version: str, dkey: str, cfg: dict) -> dict:
    """The #defines that instantiate `version` for `dkey` with a fitted config."""
    d = {"GG_T": _CTYPES[dkey]}
    if version == "v1":
        d.update(BLOCK_N=cfg["BLOCK_N"], ROWS=cfg["warps"] * 32 // cfg["BLOCK_N"])
    elif version == "v2":
        d.update(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"])
    elif version == "v3":
        d.update(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                 TM=cfg["TM"], TN=cfg["TN"])
    elif version == "v5":
        d.update(GG_AB="bf16" if dkey == "bf16" else "f16", BLOCK_M=cfg["BLOCK_M"],
                 BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], STAGES=cfg["stages"],
                 GROUP_M=GROUP_M)
    elif version == "v6":
        d.update(GG_AB="bf16" if dkey == "bf16" else "f16", BLOCK_M=cfg["BLOCK_M"],
                 BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], STAGES=cfg["stages"],
                 CONSUMERS=v6_consumers(cfg), GROUP_M=cfg["GROUP_M"],
                 PRODUCER_REGS=cfg["PRODUCER_REGS"], CONSUMER_REGS=v6_consumer_regs(cfg))
    else:
        wm = cfg.get("WARPS_M") or v4_warp_grid(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["warps"])[0]
        d.update(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                 WARPS_M=wm, WARPS_N=cfg["warps"] // wm, STAGES=cfg["stages"], GROUP_M=GROUP_M)
    return d


def launch_geometry(version: str, cfg: dict, L: int, N: int, num_sms: int | None = None
                    ) -> tuple[tuple, tuple, int]:
    """(grid, block, dynamic shared bytes) for a fitted config, L positions and N columns.

    num_sms (v6 only, persistent: one CTA per SM, never more CTAs than tiles): the device's
    multiprocessor count (grouped_gemm passes _sm_count(dev); V6_DEFAULT_SMS when None)."""
    cdiv = lambda x, y: -(-x // y)  # noqa: E731
    if version == "v6":
        tiles = cdiv(L, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
        return (max(1, min(num_sms or V6_DEFAULT_SMS, tiles)),), (cfg["warps"] * 32,), \
            v6_smem_bytes(cfg)
    if version == "v1":
        rows = cfg["warps"] * 32 // cfg["BLOCK_N"]
        return (cdiv(L, rows), cdiv(N, cfg["BLOCK_N"])), (cfg["BLOCK_N"], rows), 0
    if version == "v2":
        return (cdiv(L, cfg["BLOCK_M"]), cdiv(N, cfg["BLOCK_N"])), \
            (cfg["BLOCK_N"], cfg["BLOCK_M"]), 0
    if version == "v3":
        threads = (cfg["BLOCK_M"] // cfg["TM"]) * (cfg["BLOCK_N"] // cfg["TN"])
        return (cdiv(L, cfg["BLOCK_M"]), cdiv(N, cfg["BLOCK_N"])), (threads,), 0
    smem = v5_smem_bytes(cfg) if version == "v5" else v4_smem_bytes(cfg)
    return (cdiv(L, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),), (cfg["warps"] * 32,), smem
