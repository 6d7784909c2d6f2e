"""Grouped GEMM of the fused MoE layer, as a ladder of CUDA kernels launched through CuPy.

    c[s] = (a[s // top_k] @ w[e].T + bias[e]) * (topk_weights.flat[s] if mul_routed_weight)

for every live position p of `sorted_token_ids` (slot s = sorted_token_ids[p] < P, block
b = p // B below num_tokens_post_padded / B, e = expert_ids[b]); fp32 accumulation, one
rounding to a.dtype; e == -1 writes c[s] = 0 (docs/stages.md, "gemm1 / gemm2").

Shape legend: T tokens, E_local experts on this rank, K top-k, H hidden, I intermediate,
B block_size, N output width (2I for GEMM1, H for GEMM2), Kdim reduction width (H, I),
P = a.shape[0] * top_k slots, L = len(sorted_token_ids).

    a                       [M_a, Kdim]         hidden_states [T, H] (GEMM1) or act [P, I] (GEMM2)
    w                       [E_local, N, Kdim]  w13 [E, 2I, H] or w2 [E, H, I] ([out, in])
    sorted_token_ids        [L]    int32        from moe_align_block_size
    expert_ids              [L/B]  int32
    num_tokens_post_padded  [1]    int32        read on the device, never synchronised
    c (returned)            [P, N]              a.dtype

The ladder (all kept, `version="v1".."v6"`; the default is the table's "default_version":
v4 for fp16/bf16 and v3 for fp32 as shipped, or the rung a card's measured "version_by_m"
names for the bucket, stepping down to the fastest rung that applies):
    v1  gemm_v1_naive.cu     one thread per output element
    v2  gemm_v2_smem.cu      shared-memory tiles, one output per thread
    v3  gemm_v3_regblock.cu  TM x TN register micro-tiles, 16-byte loads, register prefetch
    v4  gemm_v4_mma.cu       mma.sync m16n8k16 (fp16/bf16, fp32 accumulators), ldmatrix,
                             cp.async ring of STAGES tiles; fp32 inputs fall back to v3
    v5  gemm_v5_wgmma.cu     Hopper wgmma.m64nNk16 from shared-memory descriptors, sm_90a
                             only, block_size a multiple of 64; chosen per bucket where a
                             card's "version_by_m" (gemm_configs.json) names it
    v6  gemm_v6_tma_ws.cu    prefill, the Hopper GEMM done properly: w by TMA (a CUtensorMap
                             from extra_args), a gathered by cp.async, an mbarrier ring between
                             a producer warpgroup and two consumer warpgroups (setmaxnreg), a
                             persistent grid of one CTA per SM; sm_90a, block_size % 64 == 0;
                             chosen per bucket where a card's "version_by_m" names it

Tunables are data: gemm_configs.json maps (version, dtype, bucket of m = tokens per expert,
N, Kdim) to BLOCK_M, BLOCK_N, BLOCK_K, warps, stages (v3: TM, TN), injected as #defines.
BLOCK_M is the alignment block_size the caller should use: `get_config(M, N, K, E, top_k,
dtype)` gives it before moe_align_block_size runs. A kernel accepts any block_size that its
BLOCK_M divides (the tile then lies in one alignment block), so GEMM2 reuses GEMM1's
alignment with its own config, shrunk to fit when needed. tune.py regenerates the table.

Run as a script to validate every version against reference.grouped_gemm and time it
(TFLOP/s, GB/s and the fraction of the H200 roofline floor):
    python -m cuda_kernels.cupy.grouped_gemm [--versions v1,v2,v3,v4,v5,v6] [--dtype bf16]
    python -m cuda_kernels.cupy.grouped_gemm --quick      # tiny, for compute-sanitizer
The GEMMs of the benchmark's models at decode and prefill T (a new uniform routing per rep,
L2 flushed, validated against v4; TFLOP/s, GB/s, the fraction of the card's floor) are
tune.py's bench, beside the tuner that fills the table:
    python -m cuda_kernels.cupy.tune --bench --versions v4,v5,v6 --models mixtral,qwen3,deepseek \
        --tokens 1024,4096,16384 [--sweep]

Verification without a GPU: tests/test_cupy_gemm.py compiles every .cu with g++ against a
small emulator of __syncthreads, cp.async, ldmatrix, mma.sync, wgmma (and for v6 the
mbarriers, the tensor-map copy with its swizzle, named barriers, with a checker of the ring's
protocol) and runs them on the CPU against the reference (and the launcher itself with
NumPy-backed arrays).
"""
from __future__ import annotations

import functools
import json
import math
import pathlib

import numpy as np

from . import _compile
from ._compile import bf16_dtype, get_kernel, raw, register_compile_case

VERSIONS = ("v1", "v2", "v3", "v4", "v5", "v6")
CU_FILES = {"v1": "gemm_v1_naive.cu", "v2": "gemm_v2_smem.cu",
            "v3": "gemm_v3_regblock.cu", "v4": "gemm_v4_mma.cu", "v5": "gemm_v5_wgmma.cu",
            "v6": "gemm_v6_tma_ws.cu"}
KERNEL_NAMES = {v: f"grouped_gemm_{v}" for v in VERSIONS}
# wgmma exists only on the architecture-specific target; _compile builds such kernels through
# cuda.core (CuPy would add its own -arch) and CPU CI compiles them for sm_90a only
KERNEL_OPTIONS = {"v5": ("-arch=sm_90a",), "v6": ("-arch=sm_90a",)}
TENSOR_CORE_VERSIONS = ("v4", "v5", "v6")
SM90A_VERSIONS = ("v5", "v6")     # built for sm_90a: they run on compute capability 9.0 only
CONFIG_PATH = pathlib.Path(__file__).resolve().with_name("gemm_configs.json")
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DTYPE_KEYS = ("fp32", "fp16", "bf16")
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "warps", "stages")
GROUP_M = 8                       # v4 launch order: m-tiles per group (L2 reuse of w and a)
INT32_MAX = 2**31 - 1
GRID_Y_MAX = 65535
BLOCK_SIZES = (16, 32, 64, 128)   # the alignment blocks whose kernels CPU CI compiles


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
        if bm not in (64, 128) or bn not in (64, 128, 256) or bk != 64:
            raise ValueError(f"config: v6 needs BLOCK_M in (64, 128), BLOCK_N in (64, 128, "
                             f"256), BLOCK_K 64 (one 128-byte swizzled row), got {cfg}")
        if warps not in (8, 12) or (bm == 128 and warps != 12) or \
                (warps == 12 and bm == 64 and bn < 128):
            raise ValueError(f"config: v6 runs a producer warpgroup and consumers (warps = 4 + "
                             f"4 per consumer): 12 warps for BLOCK_M 128; 8 or 12 for BLOCK_M "
                             f"64 (two consumers split BLOCK_N >= 128), got {cfg}")
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


def default_version_key(dkey: str, m: float | None = None, device: str | None = None) -> str:
    return default_version({"fp32": np.float32, "fp16": np.float16, "bf16": bf16_dtype()}[dkey],
                           m, device)


def default_version(dtype, m: float | None = None, device: str | None = None) -> str:
    """The rung used when none is named: the table's "default_version" for the dtype (v4 on
    fp16/bf16 and v3 on fp32 as shipped), unless the card's section (`device`'s, see
    `lookup`) names one in its "version_by_m" for the bucket of m tokens per expert (written
    by tune.py where the rung measured fastest on that card), stepping down when a problem
    rules it out."""
    dkey = dtype_key(dtype)
    table = load_table()
    v = table.get("default_version", {}).get(dkey, BUILTIN_DEFAULTS[dkey])
    if m is not None:
        by_m = _device_section(table, device).get("version_by_m", {})
        v = by_m.get(dkey, {}).get(str(m_bucket(m)), v)
    if v not in VERSIONS or (v in TENSOR_CORE_VERSIONS and dkey == "fp32"):
        return BUILTIN_DEFAULTS[dkey]
    return v


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
    version = default_version(dtype, m, device) if version is None else version
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
        if bm == 128:
            cfg["warps"] = 12           # two consumers of 64 rows each
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


def compile_cases(table: dict | None = None) -> list[tuple[str, dict, tuple]]:
    """(cu_name, defines, options) of every instantiation the table can launch, for CPU CI.

    Each table row (the cards' sections too, and the heuristic of every bucket) fitted to the
    usual block sizes.
    """
    table = load_table() if table is None else table
    seen, out = set(), []
    every = table.get("configs", []) + [r for sec in table.get("devices", {}).values()
                                        for r in sec.get("configs", [])]
    rows = [(r["version"], r["dtype"], _row_config(r)) for r in every]
    for v in VERSIONS:
        for dkey in DTYPE_KEYS:
            for b in M_BUCKETS:
                rows.append((v, dkey, heuristic_config(v, dkey, b)))
    for version, dkey, cfg in rows:
        if version in TENSOR_CORE_VERSIONS and dkey == "fp32":
            continue
        for bs in BLOCK_SIZES:
            try:
                fitted = fit_config(version, dkey, cfg, bs)
            except ValueError:
                continue
            d = kernel_defines(version, dkey, fitted)
            key = (CU_FILES[version], tuple(sorted(d.items())))
            if key not in seen:
                seen.add(key)
                out.append((CU_FILES[version], d, KERNEL_OPTIONS.get(version, ())))
    return out


def _register_all():
    for cu, d, options in compile_cases():
        register_compile_case(cu, d, options=options)


_register_all()


# ----------------------------------------------------------------------------- checks
def _cupy():
    import cupy

    return cupy


def _check_gpu_array(name, x, cp, device_id, ndim=None, dtypes=None, contiguous=True):
    if not isinstance(x, cp.ndarray):
        raise TypeError(f"{name}: expected a cupy.ndarray on the GPU, got {type(x).__name__}")
    if x.device.id != device_id:
        raise ValueError(f"{name}: expected an array on device {device_id} (a's device), "
                         f"got device {x.device.id}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {x.shape}")
    if dtypes is not None and np.dtype(x.dtype) not in dtypes:
        raise TypeError(f"{name}: expected dtype in ({', '.join(map(str, dtypes))}), "
                        f"got {x.dtype}")
    if contiguous and not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {x.strides} "
                         f"for shape {x.shape} (use cupy.ascontiguousarray)")
    return x


def usable(version: str, dkey: str, K: int, block_size: int, aligned: bool,
           sm90: bool = True) -> str | None:
    """Why `version` cannot run this problem, as "argument: reason" (None when it can)."""
    if version in SM90A_VERSIONS:
        if not sm90:
            return (f"a: {version} (wgmma, built for sm_90a) runs on compute capability 9.0 "
                    f"only")
        if dkey == "fp32":
            return f"a: {version} takes fp16 or bf16 (fp32 uses v3)"
        if block_size % 64:
            return (f"block_size: {version} needs a multiple of 64 (a warpgroup's wgmma covers "
                    f"64 rows), got {block_size}")
    if version == "v6" and K == 0:
        return "a: v6 needs a.shape[1] (Kdim) > 0 (its tensor map of w has no empty dimension)"
    if version == "v4":
        if dkey == "fp32":
            return "a: v4 takes fp16 or bf16 (fp32 uses v3)"
        if block_size % 16:
            return (f"block_size: v4 needs a multiple of 16 (its mma tiles are 16 rows), "
                    f"got {block_size}")
    if version in ("v3", "v4", "v5", "v6"):
        vec = vec_elems(dkey)
        if K % vec:
            return (f"a: {version} loads 16-byte chunks, so a.shape[1] (Kdim) must be a multiple "
                    f"of {vec} for {dkey}, got {K}")
        if not aligned:
            return f"a: {version} loads 16-byte chunks, so a and w must be 16-byte aligned"
    return None


def _is_float(dtype) -> bool:
    return np.dtype(dtype).kind == "f" or np.dtype(dtype) == bf16_dtype()


def _as_f32(x):
    """`x` as a contiguous fp32 CuPy array (bf16 widened exactly: its bits are fp32's top half)."""
    cp = _cupy()
    if x.dtype == np.float32:
        return cp.ascontiguousarray(x)
    if np.dtype(x.dtype) in (bf16_dtype(), np.dtype(np.uint16)):   # uint16: bf16's bytes
        return (raw(x).astype(cp.uint32) << 16).view(cp.float32)
    return x.astype(cp.float32)


_FALLBACK = {"v6": ("v6", "v5", "v4", "v3", "v2"), "v5": ("v5", "v4", "v3", "v2"),
             "v4": ("v4", "v3", "v2"), "v3": ("v3", "v2"), "v2": ("v2",), "v1": ("v1",)}


_DEVICE_SMS: dict = {}


def _sm_count(dev: int) -> int:
    """The multiprocessor count of device `dev` (v6's persistent grid), asked once."""
    n = _DEVICE_SMS.get(dev)
    if n is None:
        n = _DEVICE_SMS[dev] = int(_cupy().cuda.Device(dev).attributes["MultiProcessorCount"])
    return n


# ----------------------------------------------------------------------------- v6: the tensor map
def v6_tensor_map_fields(w_shape, dkey: str, cfg: dict) -> dict:
    """The cuTensorMapEncodeTiled arguments of v6's weight tile, w [E, N, Kdim] viewed 3-D
    (innermost first: Kdim, N, E): a box of BLOCK_K x BLOCK_N x 1 (one expert's BLOCK_N rows,
    BLOCK_K = 64 columns = 128 bytes), 128-byte swizzle (wgmma's layout type 1), zeros outside
    (the ragged N and Kdim tails; 3-D, so a tile never reads the next expert's rows)."""
    E, N, K = (int(x) for x in w_shape)
    item = _ITEMSIZE[dkey]
    return {"dtype": dkey, "rank": 3, "dims": (K, N, E), "strides": (K * item, N * K * item),
            "box": (cfg["BLOCK_K"], cfg["BLOCK_N"], 1), "element_strides": (1, 1, 1),
            "elem_bytes": item, "swizzle_bytes": 128}


# cuda.h's enum values for the map (CUtensorMapDataType, ...Swizzle, ...L2promotion)
_TMAP_DTYPE = {"fp16": 6, "bf16": 9}          # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
_TMAP_SWIZZLE_128B = 3
_TMAP_L2_PROMOTION_256B = 3


def _encode_tensor_map(fields: dict, ptr: int):
    """A CUtensorMap of `fields` at device address `ptr`, as a one-element NumPy array of its
    128 bytes (CuPy passes a size-one NumPy array to a kernel by value). The driver's
    cuTensorMapEncodeTiled, called through ctypes as _launch calls cuLaunchKernelEx: host work
    only, nothing is enqueued, so a capture may follow; interleave none, 128-byte swizzle,
    256-byte L2 promotion, zeros outside the tensor."""
    import ctypes

    from ._launch import _driver

    assert fields["swizzle_bytes"] == 128
    lib = _driver()
    rank = fields["rank"]
    tmap = (ctypes.c_uint64 * 16)()                     # 128 bytes (the driver wants 64-aligned:
    if ctypes.addressof(tmap) % 64:                     # ctypes gives 16; realign in a spare)
        spare = (ctypes.c_uint64 * 24)()
        base = (ctypes.addressof(spare) + 63) // 64 * 64
        tmap = (ctypes.c_uint64 * 16).from_address(base)
        tmap._keep = spare
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    status = lib.cuTensorMapEncodeTiled(
        ctypes.byref(tmap), ctypes.c_int(_TMAP_DTYPE[fields["dtype"]]), u32(rank),
        ctypes.c_void_p(ptr), (u64 * rank)(*fields["dims"]),
        (u64 * (rank - 1))(*fields["strides"]), (u32 * rank)(*fields["box"]),
        (u32 * rank)(*fields["element_strides"]), ctypes.c_int(0),
        ctypes.c_int(_TMAP_SWIZZLE_128B), ctypes.c_int(_TMAP_L2_PROMOTION_256B), ctypes.c_int(0))
    if status != 0:
        raise RuntimeError(f"w: cuTensorMapEncodeTiled failed (CUresult {status}) for {fields} "
                           f"at {ptr:#x}")
    words = np.array(tmap[:], dtype=np.uint64)
    return words.view(np.dtype((np.void, 128)))          # shape (1,): 128 bytes by value


_TENSOR_MAPS: dict = {}


def v6_tensor_map(ptr: int, w_shape, dkey: str, cfg: dict, dev: int):
    """v6's CUtensorMap of the weights [E, N, Kdim] at device address `ptr`, cached per
    (pointer, shape, dtype, BLOCK_N, BLOCK_K, device): the map holds the address, so another
    array at the same address with the same shape reuses it. Host work only (capturable)."""
    key = (int(ptr), tuple(int(x) for x in w_shape), dkey, cfg["BLOCK_N"], cfg["BLOCK_K"], dev)
    tmap = _TENSOR_MAPS.get(key)
    if tmap is None:
        if len(_TENSOR_MAPS) > 256:        # weights come and go: keep the cache bounded
            _TENSOR_MAPS.clear()
        tmap = _TENSOR_MAPS[key] = _encode_tensor_map(
            v6_tensor_map_fields(w_shape, dkey, cfg), int(ptr))
    return tmap


def extra_args(version: str, cfg: dict, *, dev: int, w=None) -> tuple:
    """What `version` takes after the common GG_KERNEL_ARGS (empty for v1-v5): v6 its
    CUtensorMap of the weights `w` (v6_tensor_map, cached)."""
    if version == "v6":
        return (v6_tensor_map(w.data.ptr, w.shape, dtype_key(w.dtype), cfg, dev),)
    return ()


# ----------------------------------------------------------------------------- the stage
def grouped_gemm(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_size,
                 topk_weights=None, mul_routed_weight=False, bias=None, *, version=None,
                 config=None, out=None):
    """c [a.shape[0] * top_k, N] = the grouped GEMM of docs/stages.md on the GPU (see module doc).

    version: "v1".."v6" (None: default_version's rung, v4 for fp16/bf16 and v3 for fp32 unless
    the card's "version_by_m" names another for the bucket, stepping down to v3/v2 when Kdim
    is not a multiple of 16 bytes or block_size not of 16; "v4"/"v5"/"v6" on fp32 run v3;
    "v5" and "v6" need an sm_90 device and block_size % 64 == 0).
    config: a dict as returned by get_config (None: looked up in gemm_configs.json); its
    BLOCK_M is shrunk to divide block_size when needed. out: an optional [P, N] C-contiguous
    array of a.dtype to write into (only the rows of live slots are written; tests poison it).
    num_tokens_post_padded is read on the device: nothing here waits for the GPU.
    """
    cp = _cupy()
    if not isinstance(a, cp.ndarray):
        raise TypeError(f"a: expected a cupy.ndarray on the GPU, got {type(a).__name__}")
    dev = a.device.id
    floats = (np.dtype(np.float32), np.dtype(np.float16), bf16_dtype(), np.dtype(np.uint16))
    _check_gpu_array("a", a, cp, dev, ndim=2, dtypes=floats)
    dkey = dtype_key(a.dtype)
    _check_gpu_array("w", w, cp, dev, ndim=3)
    if np.dtype(w.dtype) != np.dtype(a.dtype):
        raise TypeError(f"w: expected dtype {a.dtype} (a's dtype), got {w.dtype}")
    M_a, K = a.shape
    E_local, N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"w: expected shape [E_local, N, {K}] (last dim = a.shape[1]), "
                         f"got {tuple(w.shape)}")
    top_k = _compile.check_int("top_k", top_k, 1)
    block_size = _compile.check_int("block_size", block_size, 1)
    int32 = (np.dtype(np.int32),)
    _check_gpu_array("sorted_token_ids", sorted_token_ids, cp, dev, ndim=1, dtypes=int32)
    _check_gpu_array("expert_ids", expert_ids, cp, dev, ndim=1, dtypes=int32)
    L = sorted_token_ids.shape[0]
    if expert_ids.shape[0] != -(-L // block_size):
        raise ValueError(f"expert_ids: expected length cdiv(len(sorted_token_ids), block_size) "
                         f"= cdiv({L}, {block_size}) = {-(-L // block_size)}, "
                         f"got {expert_ids.shape[0]}")
    if isinstance(num_tokens_post_padded, (int, np.integer)) and \
            not isinstance(num_tokens_post_padded, bool):
        num_tokens_post_padded = cp.asarray([num_tokens_post_padded], dtype=cp.int32)
    _check_gpu_array("num_tokens_post_padded", num_tokens_post_padded, cp, dev, dtypes=int32)
    if num_tokens_post_padded.size < 1:
        raise ValueError("num_tokens_post_padded: expected shape (1,), got an empty array")
    P = M_a * top_k
    for name, value in (("a.shape[0] * top_k (P)", P), ("len(sorted_token_ids)", L),
                        ("w.shape[1] (N)", N), ("a.shape[1] (Kdim)", K)):
        if value > INT32_MAX:
            raise ValueError(f"{name}: expected at most {INT32_MAX} (kernels index with int32), "
                             f"got {value}")
    mul_routed_weight = bool(mul_routed_weight)
    tw = None
    if mul_routed_weight:
        if topk_weights is None:
            raise ValueError("topk_weights: expected an array [P] when mul_routed_weight=True, "
                             "got None")
        _check_gpu_array("topk_weights", topk_weights, cp, dev)
        if topk_weights.size != P:
            raise ValueError(f"topk_weights: expected {P} elements (a.shape[0] * top_k), "
                             f"got shape {tuple(topk_weights.shape)}")
        if not _is_float(topk_weights.dtype):
            raise TypeError(f"topk_weights: expected a floating dtype, got {topk_weights.dtype}")
        # the router weights are fp32 in vLLM; anything else is converted once ([P], tiny)
        tw = _as_f32(topk_weights)
    bias_kind, bias_arg = 0, None
    if bias is not None:
        _check_gpu_array("bias", bias, cp, dev)
        if tuple(bias.shape) != (E_local, N):
            raise ValueError(f"bias: expected shape ({E_local}, {N}) = [E_local, N], "
                             f"got {tuple(bias.shape)}")
        if np.dtype(bias.dtype) == np.dtype(a.dtype):
            bias_kind, bias_arg = 1, raw(bias)
        elif _is_float(bias.dtype):
            # added in fp32 anyway: an fp32 copy is exact for fp16/bf16 biases
            bias_kind, bias_arg = 2, _as_f32(bias)
        else:
            raise TypeError(f"bias: expected a floating dtype, got {bias.dtype}")

    aligned = a.data.ptr % 16 == 0 and w.data.ptr % 16 == 0
    version, cfg = _plan(version, dkey, m_bucket(max(1.0, P / max(E_local, 1))), N, K,
                         block_size, aligned, _is_sm90(cp, dev),
                         None if config is None else tuple(sorted(config.items())),
                         device_name(dev))

    if out is None:
        c = _compile.empty((P, N), a.dtype)
    else:
        c = _check_gpu_array("out", out, cp, dev)
        if np.dtype(out.dtype) != np.dtype(a.dtype) or tuple(out.shape) != (P, N):
            raise ValueError(f"out: expected shape ({P}, {N}) and dtype {a.dtype}, got "
                             f"{tuple(out.shape)} {out.dtype}")
    if P == 0 or N == 0:
        return c
    if L == 0:  # no positions, no live slot: nothing to write
        return c
    grid, block, smem = launch_geometry(version, cfg, L, N,
                                        _sm_count(dev) if version == "v6" else None)
    if len(grid) >= 2 and grid[1] > GRID_Y_MAX:
        raise ValueError(f"w.shape[1] (N): {version} launches cdiv(N, BLOCK_N) = {grid[1]} CTAs "
                         f"along grid y, more than {GRID_Y_MAX}")
    if math.prod(grid) > INT32_MAX:
        raise ValueError(f"len(sorted_token_ids): the grid of {math.prod(grid)} CTAs overflows "
                         f"int32")
    kernel = _kernel(version, dkey, cfg, dev)
    dummy = _dummy(cp, dev)
    with cp.cuda.Device(dev):
        kernel(grid, block,
               (raw(a), raw(w), raw(c), sorted_token_ids, expert_ids, num_tokens_post_padded,
                tw if tw is not None else dummy, bias_arg if bias_arg is not None else dummy,
                np.int32(N), np.int32(K), np.int32(P), np.int32(top_k), np.int32(block_size),
                np.int32(L), np.int32(mul_routed_weight), np.int32(bias_kind))
               + extra_args(version, cfg, dev=dev, w=w),
               shared_mem=smem)
    return c


def _sm90_of(dev: int) -> bool:
    return _compile.is_sm90(dev)


def _is_sm90(cp, dev) -> bool:
    """Whether device `dev` runs sm_90a code (v5, v6), asked once per device."""
    return _sm90_of(dev)


@functools.lru_cache(maxsize=4096)
def _plan(version, dkey, bucket, N, K, block_size, aligned, sm90, config_items, device=None):
    """(version, fitted config) for a call on card `device`: the rung, the table lookup and
    the fit, cached (a decode step calls the GEMM twice per layer: the host work must stay
    small)."""
    if version in TENSOR_CORE_VERSIONS and dkey == "fp32":
        version = "v3"          # the tensor-core rungs take half types; fp32 uses FFMA
    if version is None:
        chain = _FALLBACK[default_version_key(dkey, bucket, device)]
        version = next(v for v in chain if usable(v, dkey, K, block_size, aligned, sm90) is None)
    elif version not in VERSIONS:
        raise ValueError(f"version: expected one of {VERSIONS} or None, got {version!r}")
    else:
        why = usable(version, dkey, K, block_size, aligned, sm90)
        if why is not None:
            raise ValueError(f"{why} (version={version!r} was asked for; version=None picks "
                             f"a rung that can run this)")
    config = (lookup(version, dkey, bucket, N, K, device=device) if config_items is None
              else dict(config_items))
    return version, fit_config(version, dkey, config, block_size)


_READY: dict = {}


def _kernel(version, dkey, cfg, dev):
    """The compiled kernel, with its dynamic shared-memory limit raised once when needed."""
    defines = kernel_defines(version, dkey, cfg)
    key = (version, tuple(sorted(defines.items())), dev)
    kern = _READY.get(key)
    if kern is None:
        options = KERNEL_OPTIONS.get(version, ())
        if version in SM90A_VERSIONS:
            cc = _cupy().cuda.Device(dev).compute_capability
            if cc != "90":
                raise ValueError(f"version: {version} (wgmma) runs on compute capability 9.0 "
                                 f"only (built for sm_90a), this device is {cc}")
        register_compile_case(CU_FILES[version], defines, options=options)
        kern = get_kernel(CU_FILES[version], KERNEL_NAMES[version], defines, options=options)
        if version in TENSOR_CORE_VERSIONS:
            smem = launch_geometry(version, cfg, 1, 1)[2]
            if smem > 48 * 1024:  # a CTA gets more than 48 KB only after opting in
                kern.max_dynamic_shared_size_bytes = smem
        _READY[key] = kern
    return kern


def prebuild(dtypes=DTYPE_KEYS, versions=VERSIONS, max_workers: int | None = None) -> dict:
    """Compile every instantiation the table can launch for `dtypes` x `versions`, in threads.

    NVRTC runs outside the GIL, so a 16-core host builds the ~50 kernels in the time of a few
    (a test session or a benchmark otherwise compiles them one by one on first use). Returns
    {"built": n, "failed": {case: error}}; failures are left for the first real call to report.
    """
    import concurrent.futures
    import os

    cp = _cupy()
    dev = cp.cuda.Device().id
    cc = cp.cuda.Device(dev).compute_capability
    ctypes_ = {_CTYPES[d] for d in dtypes}
    by_file = {f: v for v, f in CU_FILES.items()}
    todo = [(cu, d, o) for cu, d, o in compile_cases()
            if by_file[cu] in versions and d["GG_T"] in ctypes_
            and not (by_file[cu] in SM90A_VERSIONS and cc != "90")]

    def build(case):
        cu, d, options = case
        with cp.cuda.Device(dev):
            get_kernel(cu, KERNEL_NAMES[by_file[cu]], d, options=options)

    if any(o for _, _, o in todo):
        # import cuda.core (the sm_90a path) once here: threads importing it together find a
        # half-initialised module ("cannot import name 'Program' from 'cuda.core.cu13'")
        try:
            import cuda.core  # noqa: F401
            from cuda.core import Program, ProgramOptions  # noqa: F401
        except ImportError:
            pass
    failed = {}
    workers = max_workers or min(16, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(build, c): c for c in todo}
        for f in concurrent.futures.as_completed(futures):
            if f.exception() is not None:
                cu, d, _ = futures[f]
                failed[f"{cu} {d}"] = f"{type(f.exception()).__name__}: {f.exception()}"[:300]
    return {"built": len(todo) - len(failed), "failed": failed}


_DUMMIES: dict = {}


def _dummy(cp, dev):
    """A one-element fp32 array standing in for an absent pointer (never read)."""
    d = _DUMMIES.get(dev)
    if d is None:
        with cp.cuda.Device(dev):
            d = _DUMMIES[dev] = cp.zeros(1, dtype=cp.float32)
    return d


# ----------------------------------------------------------------------------- test data
def random_device(shape, dtype, scale=1.0, rng=None):
    """Normal(0, scale^2) values of `dtype` made on the GPU, a slab at a time.

    bf16 is rounded from fp32 with integer ops (round to nearest even), so this needs no
    CuPy support for ml_dtypes.bfloat16 beyond a view (uint16 when even that is missing).
    """
    cp = _cupy()
    rng = cp.random.default_rng() if rng is None else rng
    dkey = dtype_key(dtype)
    out = _compile.empty(shape, dtype)
    flat = raw(out).reshape(-1)
    step = 1 << 26  # 64 M elements: a 256 MB fp32 slab at a time
    for i in range(0, flat.size, step):
        n = min(step, flat.size - i)
        x = rng.standard_normal(n, dtype=cp.float32)
        if scale != 1.0:
            x *= cp.float32(scale)
        if dkey == "bf16":
            u = x.view(cp.uint32)
            flat[i:i + n] = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(cp.uint16)
        else:
            flat[i:i + n] = x.astype(flat.dtype)
    return out


# ----------------------------------------------------------------------------- napkin math
def gemm_flops(num_slots: int, N: int, K: int) -> float:
    """2 * P * N * Kdim: one multiply and one add per product, live slots only."""
    return 2.0 * num_slots * N * K


def gemm_bytes(touched_experts: int, M_a: int, num_slots: int, N: int, K: int,
               itemsize: int) -> float:
    """The least traffic: each touched expert's w once, each a row once, each c row once."""
    return float(itemsize) * (touched_experts * N * K + M_a * K + num_slots * N)


HBM_BYTES_PER_S = 4.8e12          # H200 datasheet
PEAK_FLOPS = 989e12               # H200 dense bf16 datasheet


def roofline_floor_s(nbytes: float, flops: float) -> float:
    """max(bytes / 4.8 TB/s, flops / 989 TFLOP/s): no kernel can beat this on an H200."""
    return max(nbytes / HBM_BYTES_PER_S, flops / PEAK_FLOPS)


# ----------------------------------------------------------------------------- script
def _main(argv=None):  # pragma: no cover - needs a GPU
    """Validate every version against reference.grouped_gemm (float64 inputs), then time it.

    --quick: one tiny problem per version and dtype, one timed call (for compute-sanitizer).
    Prints one PASS/FAIL line per (shape, version); exits 1 when any check fails. The GEMMs of
    the benchmark's models at decode and prefill T: `python -m cuda_kernels.cupy.tune --bench`.
    """
    import argparse

    from reference import grouped_gemm as ref_grouped_gemm
    from reference import moe_align_block_size

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--versions", default="v1,v2,v3,v4,v5,v6")
    p.add_argument("--dtype", default="bf16", choices=DTYPE_KEYS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="tiny shapes, one rep (sanitizers)")
    args = p.parse_args(argv)
    ok, why = _compile.availability()
    if not ok:
        raise SystemExit(f"no GPU: {why}")
    cp = _cupy()
    dts = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": bf16_dtype()}
    rng = np.random.default_rng(0)
    # (name, T, E, top_k, N, Kdim, dtype key)
    if args.quick:
        shapes = [("quick N=72 K=136", 7, 4, 2, 72, 136, "bf16"),
                  ("quick N=72 K=136", 7, 4, 2, 72, 136, "fp32")]
        reps = 1
    else:
        d = args.dtype
        shapes = [("qwen3 gemm1 T=1", 1, 128, 8, 1536, 2048, d),
                  ("qwen3 gemm1 T=64", 64, 128, 8, 1536, 2048, d),
                  ("qwen3 gemm1 T=1024", 1024, 128, 8, 1536, 2048, d),
                  ("mixtral gemm2 T=16", 16, 8, 2, 4096, 14336, d),
                  ("mixtral gemm1 T=1024", 1024, 8, 2, 28672, 4096, d)]
        reps = args.reps
    print(f"{'shape':22s} {'dt':4s} {'ver':3s} {'check':5s} {'rel err':>9s} {'us':>9s} "
          f"{'TFLOP/s':>8s} {'GB/s':>7s} {'floor':>6s}")
    failed = 0
    for name, T, E, top_k, N, K, dkey in shapes:
        dt = dts[dkey]
        a_h = rng.standard_normal((T, K), dtype=np.float32).astype(dt)
        w_h = (rng.standard_normal((E, N, K), dtype=np.float32) / math.sqrt(K)).astype(dt)
        tw_h = rng.random((T, top_k), dtype=np.float32) + np.float32(0.05)
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :top_k].astype(np.int32)
        B0 = get_config(T, N, K, E, top_k, dt)["BLOCK_M"]
        st, ex, nt = moe_align_block_size(ids, B0, E)
        # c[s] does not depend on the alignment block: one reference for every version
        ref = ref_grouped_gemm(a_h.astype(np.float64), w_h.astype(np.float64), st, ex, nt,
                               top_k, B0, tw_h.astype(np.float64), True)
        a, w = _compile.to_device(a_h), _compile.to_device(w_h)
        tw_d = cp.asarray(tw_h)
        touched = len(set(int(e) for e in ex[: int(nt[0]) // B0] if e >= 0))
        flops = gemm_flops(T * top_k, N, K)
        nbytes = gemm_bytes(touched, T, T * top_k, N, K, dt.itemsize)
        tol = 1e-5 if dkey == "fp32" else 1e-2
        aligned = {}

        def call(v, out=None):
            # each rung aligns with its own config's BLOCK_M (v5: 64 or 128)
            B = get_config(T, N, K, E, top_k, dt, v)["BLOCK_M"]
            if B not in aligned:
                aligned[B] = tuple(cp.asarray(x) for x in moe_align_block_size(ids, B, E))
            st_d, ex_d, nt_d = aligned[B]
            return grouped_gemm(a, w, st_d, ex_d, nt_d, top_k, B, tw_d, True, version=v, out=out)

        for v in args.versions.split(","):
            out = _compile.empty((T * top_k, N), dt)
            raw(out).view(cp.uint8).fill(255)          # NaN poison: unwritten rows fail
            try:
                call(v, out)
            except ValueError as e:
                print(f"{name:22s} {dkey:4s} {v:3s} skip  {e}")
                continue
            got = _compile.to_host(out)
            if got.dtype == np.uint16:
                got = got.view(bf16_dtype())
            got = got.astype(np.float64)
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) \
                if np.isfinite(got).all() else float("inf")
            verdict = "PASS" if err <= tol else "FAIL"
            failed += verdict == "FAIL"
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            for _ in range(0 if args.quick else 3):
                call(v)
            times = []
            for _ in range(reps):
                start.record()
                call(v)
                stop.record()
                stop.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3)
            t = float(np.median(times))
            print(f"{name:22s} {dkey:4s} {v:3s} {verdict:5s} {err:9.2e} {t * 1e6:9.1f} "
                  f"{flops / t / 1e12:8.2f} {nbytes / t / 1e9:7.0f} "
                  f"{roofline_floor_s(nbytes, flops) / t:6.2f}")
    print("ok" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main())
