"""Weight-only grouped GEMM for decode (quant_gemm_wna16.cu): int4 / int8 weights streamed at
HBM bandwidth, bf16 / fp16 activations.

    c[s] = (a[s // top_k] @ deq(w[e]).T + bias[e]) * r[s],   deq(w)[n, k] = (q - zp) * s[n, k // gs]
    (r = topk_weights.flat when mul_routed_weight, else 1)

for every live position of sorted_token_ids, fp32 accumulation, one rounding to a's dtype;
e == -1 writes zeros. Same arguments and result as the weight-only branch of
quant_gemm.grouped_gemm_quant (and reference/quant.py's grouped_gemm_quant with
use_int4_w4a16 / use_int8_w8a16); keyword-only extras: config, out.

Shape legend: T tokens, E experts, K top-k, P = a.shape[0] * top_k slots, N output width
(2I for GEMM1, H for GEMM2), Kdim reduction width, G = Kdim / group_size groups per row,
L = len(sorted_token_ids), BM = 8 * MT positions per CTA, KS K splits.

    a        [M_a, Kdim]      bf16 / fp16
    w        [E, N, Kdim / 2] uint8 (int4, k = 2j in the low nibble of byte j)
             [E, N, Kdim]     uint8 (zero point 128) or int8 (symmetric)
    w_scale  [E, N, G]        fp32 (bf16 / fp16 accepted, widened)
    w_zp     [E, N, G]        uint8 or None (8 for int4, 128 for uint8, 0 for int8)
    c        [P, N]           a's dtype

Five rungs (see the .cu headers for the lane layouts), chosen by the config name:
    wna16_staged  (STAGED_CONFIGS: t8 .. t32, u24, t24ws; quant_gemm_wna16_staged.cu) int4 on
                  the packed rung's weights laid out a pipeline stage per contiguous run
                  (stage_blocks): a CTA stages the codes, scales and its tokens' activations
                  of NB = W TPW 16-row tiles x KC 64-code chunks per stage through one
                  cp.async ring, each warp feeds TPW tiles from one read of the activations;
                  raw 128 + q into the mma, the zero point off from the tokens' sums (2
                  more mma per token tile and chunk); one wave of CTAs splits all m tiles'
                  (row block, K stage) units into runs of equal cost (staged_plan), partial
                  blocks added in K-stage order. What grouped_gemm_quant runs for 8-128 rows
                  per expert (route_int4).
                  programmatic=True launches it with PDL (_launch.py): its CTAs read the
                  routing and copy their first weights under the previous kernel's tail
                  (GEMM2 after GEMM1: Mixtral T = 64 layer 0.271 against 0.276 ms, H200).
    wna16_wgmma   (WGMMA_CONFIGS: g32, h32, p32, ...; quant_gemm_wna16_wgmma.cu, sm_90a) int4
                  on weights prepacked in wgmma's register-A order: one warpgroup per CTA, the
                  dequantized weights of RB 64-row groups as wgmma's A, the activations staged
                  as its B; POST: raw codes, scale and zero point per group in fp32 on the
                  activation sums (wna16_group_sums, launched here); K split over grid.z when
                  the row groups alone fill less than a wave (wgmma_plan). Opt-in (see its
                  header).
    wna16_packed  (PACKED_CONFIGS: q8, q24, q32, ...) int4 only, on weights repacked once by
                  prepack_int4 (cached per weight array by packed_weights): each warp load
                  reads 512 contiguous bytes that are the lanes' mma fragments; the CTA's
                  warps split K and meet once per 16-row tile in shared memory; a ring of D
                  chunks per lane (registers, or shared memory with SR); POST: the zero point
                  off by one more mma on the chunk sums (wna16_chunk_sums, launched here);
                  WAVES waves of CTAs (packed_plan). What
                  quant_gemm.grouped_gemm_quant runs for int4 batches of up to 8 rows per
                  expert (route_int4).
    wna16_stream  (CONFIGS: w8, m8, m16, m32) each warp streams 16 weight rows with 16-byte
                  loads straight into registers, U steps of 128 codes in flight per lane;
    wna16_async   (a8, a16, a32) each warp copies its rows through a shared-memory cp.async
                  ring with whole-line requests, then reads them in the mma's layout.
The last two dequantize in registers (magic-number int4 -> bf16; int4 with group_size % 128 == 0
applies the scales after the mma, in fp32) and feed mma.sync m16n8k16 with the weights as A
and up to 8 * MT tokens as B; activations are staged once per CTA in shared memory in the k
order that the dequantization produces. K is split over grid.z (KS) when the batch alone
cannot fill the GPU, reduced by the last CTA of each tile (no extra launch).

Launch: grid (cdiv(Lg, BM), cdiv(N, 16 WN), KS), block 32 WN, dynamic shared memory
smem_bytes(cfg, SPS) (activations, their step sums, async's rings), Lg = min(L, P * block_size),
SPS = cdiv(cdiv(Kdim, 128), KS). block_size_for(P / E) gives the alignment block size that the
table wants (BM: 8 at decode, so that no CTA holds only padding).

Supports: Kdim % 32 == 0, group_size % 32 == 0 (or one group per row), block_size % 8 == 0,
16-byte aligned a and w, a contiguous. `supports(...)` says why not, and the launcher raises
ValueError naming the argument otherwise.

Napkin math (H200, 4.8 TB/s): Mixtral int4 (E=8, top-2, H=4096, I=14336, group 128) at T=1
reads 2 experts' w13 + w2 codes and scales, 187 MB -> 39 us.
wna16_packed, first version (H200, per GEMM, L2 flushed):
T=1 s8 49.7 + 31.2 us = 48% of the roofline (w8 below: 27%), T=16 406 us (37%), T=64 p16
797 us (20%); ncu (T=1 GEMM1): 109 instructions per 512-byte chunk, issue 62% busy, ALU pipe
56%, 'wait' stalls first: instruction-bound, hence the rounds of D items with immediate
offsets and no register copies (53 instructions per chunk in the SASS) that followed.
Then (rounds of D items, two tiles per warp group, one barrier per few tile groups; q8, the
default; whole GEMM1 + GEMM2 through quant_gemm.grouped_gemm_quant, bench_quant.py, L2
flushed by a read): T=1 62 us (62.9% of the roofline), T=16 212 us (73.7%), T=64 551 us
(28.3%: at 16 rows per expert the 8-token tiles read each expert's weights 2-3 times, and the
16 / 32-token configs run far slower per byte so far). bench_wna16 (same machine): 66 / 223 /
519 us against quant_gemm's v3 at 155 / 599 / 1156 us. ncu (T=1 GEMM1): DRAM 68% busy, issue
53%, long-scoreboard stalls first (the weight stream's latency).
The stream rung, before (H200, the m8 / m16 table then; GEMM1 + GEMM2, the activation between
them not timed): T=1 165 us (24% of the roofline; quant_gemm 154 us), T=16 558 us (28%; 595),
T=64 1077 us (14.5%; 1104); T >= 256 quant_gemm is about 2x faster. Its sweep (bench_wna16.py
--sweep) gave the w8 / w16 entries of BY_ROWS: T=1 142 us (27%), T=16 464 us (34%), T=64 879 us
(18%), per-GEMM sums, not yet re-measured as a whole. ncu (T=1 GEMM1): DRAM 29%, issue ~50%,
14 warps per SM: the kernel is latency- and instruction-bound, far from the 60% target.

Run as a script: python -m cuda_kernels.cupy.quant_gemm_wna16 [--quick] (validate every
kernel instantiation against the reference; without --quick also time the Mixtral shape).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np

from . import _compile as C
from ._launch import launch
from .quant_gemm import _elem_key, _f32, epilogue_operands

CU = "quant_gemm_wna16.cu"
KSTEP = 128                     # K codes per warp step (32 per lane)
ELEMS = {"bf16": 1, "fp16": 0}  # the ELEM_BF16 define
CONFIG_FILE = pathlib.Path(__file__).resolve().parent / "quant_gemm_wna16_configs.json"

# Tunables: MT token tiles of 8 per CTA (BM = 8 MT), WN warps of 16 weight rows, U steps of
# weight loads in flight per lane, MINB CTAs per SM for the register cap, KS K splits ("auto":
# enough CTAs to fill the GPU, under a shared-memory budget for the staged activations).
CONFIGS = {
    # wna16_stream (register ring of U steps per lane)
    "w8": dict(MT=1, WN=8, U=4, MINB=2),
    "w16": dict(MT=2, WN=8, U=4, MINB=2),
    "m8": dict(MT=1, WN=4, U=4, MINB=5),
    "m16": dict(MT=2, WN=4, U=4, MINB=4),
    "m32": dict(MT=4, WN=4, U=4, MINB=2),
    # wna16_async (cp.async ring per warp, STAGES stages of 4 steps)
    "a8": dict(KERNEL="async", MT=1, WN=4, STAGES=4, MINB=2),
    "a16": dict(KERNEL="async", MT=2, WN=4, STAGES=4, MINB=2),
    "a32": dict(KERNEL="async", MT=4, WN=4, STAGES=3, MINB=2),
}
# wna16_packed (prepacked int4, see prepack_int4): MT token tiles of 8 (a CTA computes only its
# live ones), W warps splitting each 16-row tile's K, D 16-byte loads in flight per lane, MINB
# CTAs per SM, WAVES waves of CTAs planned (default 1).
# POST = 1 takes the zero point off with one more mma on the chunk sums (see the .cu), 0
# subtracts it per pair; RT tiles of 16 rows per warp group share the activation fragments;
# SR = 1 keeps the ring in shared memory (cp.async) instead of registers. Measured (H200,
# Mixtral T=1 / 16 / 64, GEMM1 + GEMM2 per config, B = BM up to 8 rows per expert, else 32):
#   first: q8 71 / 232 / 530 us, q8d 73 / 245 / 553, p8 73 / 251 / 602.
#   with live token tiles a compile-time count: q8 67 / 228 / 561, q16 71 / 250 / 543, q32
#     71 / 257 / 446; q32 with WAVES = 4: 75 / 257 / 413 (experts of 2 and 3 live tiles
#     evened out), WAVES = 8: 408 at T=64. At 3 or 4 live tiles the ring of D = 2 spills
#     registers (NVRTC sm_90: q32 98 spill loads, MT = 3 14): with D = 1 (T=64 / 256) q32
#     407 / 1195 us (D = 2: 407 / 1449), 24-token tiles (MT = 3, B = 48) 386 / 1089. Four CTAs
#     of 4 warps per SM instead of two of 8 (half the partials each output sums): q32 370 /
#     1042 us at T=64 / 256, 452 at T=96 (W = 8: 507), q24 375 / 1027; q8 stays at 8 warps
#     (T=16: 259 us with 4).
#   T=1 / 16 / 64 / 256: POST's mma costs more than the 16 hsub2 per chunk it saves (q8 vs
#     q8+POST=1 68 / 234 / 567 / 1918 vs 75 / 239 / 573 / 1961; q24 vs q24+POST=1 at T=64 377
#     vs 413). SR lets MT = 3 / 4 keep 2 items in flight without spilling: faster at one live
#     tile (v24 93 / 269 vs q24 100 / 303 at T=1 / 16), slower at 2-3 (392 vs 371 at T=64;
#     D = 4: 473); at MT = 1 slower than the register ring (q8+SR=1 77 / 252 vs 68 / 235).
#   GEMM1 / GEMM2 at T=64: the routed configs stall on long_scoreboard (the next chunk's
#     loads, ~2 cycles per issue); a second chunk in flight at 3 CTAs per SM
#     (q32+D=2+MINB=3 235 / 124, q24+D=2+MINB=3 238 / 128) is within 3-5% of q32 242 / 123 and
#     q24 250 / 120, and no faster at T=256: the table stays.
PACKED_CONFIGS = {
    "q8": dict(KERNEL="packed", MT=1, W=8, D=4, POST=0, RT=2, MINB=2),
    "q8d": dict(KERNEL="packed", MT=1, W=8, D=2, POST=0, RT=2, MINB=2),
    "p8": dict(KERNEL="packed", MT=1, W=8, D=4, POST=0, MINB=2),
    "s8": dict(KERNEL="packed", MT=1, W=8, D=4, POST=1, MINB=2),
    "q16": dict(KERNEL="packed", MT=2, W=8, D=2, POST=0, RT=2, MINB=2),
    "r16": dict(KERNEL="packed", MT=2, W=8, D=2, POST=1, RT=2, MINB=2),
    "q24": dict(KERNEL="packed", MT=3, W=4, D=1, POST=0, RT=2, MINB=4, WAVES=8),
    "q32": dict(KERNEL="packed", MT=4, W=4, D=1, POST=0, RT=2, MINB=4, WAVES=8),
    # SR = 1: the ring in shared memory (cp.async), two items deep at 3-4 live token tiles
    "v24": dict(KERNEL="packed", MT=3, W=4, D=2, POST=0, RT=2, MINB=4, WAVES=8, SR=1),
    "v32": dict(KERNEL="packed", MT=4, W=4, D=2, POST=1, RT=2, MINB=4, WAVES=8, SR=1),
}
# The default choice by rows per expert (P / E): the first entry whose rows cover the batch and
# whose BM divides block_size. Measured (H200, Mixtral int4 g128, bench_wna16.py --sweep): the
# register-ring rung beats the cp.async rung at every T (the async rings cap a CTA at 8 warps
# per SM), 8 warps per CTA beat 4:
#   T=1  (0.25 rows/expert, B=8):  w8  GEMM1 82 us + GEMM2 60 us     (m8 90 + 79, a8 127 + 61)
#   T=16 (4 rows, B=8):            w8  294 + 170 us                   (m8 329 + 248)
#   T=64 (16 rows, B=32):          w16 578 + 301 us                   (m16 696 + 409)
# Past ~16 rows per expert quant_gemm's tile rungs are faster (T=256: 1.79 ms vs 3.07 ms).
# The packed rung (PACKED_CONFIGS, int4) then beat them all up to 128 rows, so its table
# PACKED_BY_ROWS heads this one and is also grouped_gemm_quant's int4 route (route_int4): q8 up
# to 8 rows per expert, then q24 (block_size a multiple of 24) or q32 (of 32) up to 128, q8 up
# to 24 for other block sizes (quant_gemm's block_size_for gives 16 up to 8 rows, 48 up to
# 128, 64 above). Above 128 rows quant_gemm's own tile rungs are faster: measured (H200, Mixtral,
# GEMM1 + GEMM2) q32 (then D = 2, W = 8) 0.82 /
# 1.48 / 2.74 / 5.71 ms vs those rungs 1.50 / 2.36 / 3.05 / 5.41 ms at 32 / 64 / 128 / 256 rows
# per expert (T = 128 / 256 / 512 / 1024). A problem the packed rung cannot take (int8,
# group_size 32, N % 16) names a stream config.
# The staged rung (STAGED_CONFIGS) then took the 8-128 rows from q24 / q32 (H200, Mixtral,
# GEMM1 / GEMM2 us):
# T = 64 t24 200 / 116 and t32 210 / 122 against q24 253 / 121 and q32 242 / 122; T = 256 t24
# 590 / 316 and t32 598 / 315 against q24 702 / 334 and q32 730 / 352. Up to 8 rows q8 stays
# (T = 1: q8 43 / 25 against t8 51 / 37; T = 16: q8 152 / 79 against t16 154 / 92).
# On sm_90 its warp-specialized t24ws (STAGED_CONFIGS) heads t24: Mixtral's T = 64 layer 0.5-3%
# faster on bench_quant's four routings, T = 128 / 256 3% / 4.5%; other
# GPUs take t24 (setmaxnreg is sm_90a's).
PACKED_BY_ROWS = ((8, "q8"), (128, "t24ws"), (128, "t24"), (128, "t32"), (24, "q8"))
# A measured table (CONFIG_FILE) replaces this one when present.
BY_ROWS = PACKED_BY_ROWS + ((4, "w8"), (1 << 30, "w16"), (1 << 30, "w8"))
# block_size measured with each entry (any multiple of its BM works)
MEASURED_BLOCK = {"w8": 8, "w16": 32, "q8": 8, "q24": 48, "q32": 32, "t24": 48, "t24ws": 48,
                  "t32": 32}
SMEM_PER_SM = 227 * 1024        # H100 / H200: shared memory an SM can give its CTAs
TARGET_WARPS_PER_SM = 16        # K splits until this many 16-row streams per SM (the "auto"
                                # of the sweeps; Mixtral T=1 GEMM2 measured 60 us with it (KS=5)
                                # and 45 us with KS=4: a tuning lead, not taken unmeasured)


def _load_table():
    try:
        data = json.loads(CONFIG_FILE.read_text())
        return tuple((float(r), str(n)) for r, n in data["by_rows"]), data.get("configs", {})
    except (OSError, ValueError, KeyError, TypeError):
        return None, {}


_TABLE, _EXTRA = _load_table()
CONFIGS.update({k: dict(v) for k, v in _EXTRA.items()})
if _TABLE:
    BY_ROWS = _TABLE + tuple(r for r in BY_ROWS if r[0] >= 1 << 30)


def kernel_name(nbits: int, cfg: dict, post: bool = False) -> str:
    """post: int4 with one scale group per 128-K step (group_size % 128 == 0), the scales
    applied after the mma (see the .cu). int8 holds twice the weight registers per step: half
    the CTAs per SM (no spills)."""
    minb = cfg["MINB"] if nbits == 4 else max(1, cfg["MINB"] // 2)
    post = int(bool(post) and nbits == 4)
    if cfg.get("KERNEL") == "async":
        return (f"wna16_async<{nbits}, {post}, {cfg['MT']}, {cfg['WN']}, {cfg['STAGES']}, "
                f"{minb}>")
    return f"wna16_stream<{nbits}, {post}, {cfg['MT']}, {cfg['WN']}, {cfg['U']}, {minb}>"


def ring_bytes(cfg: dict, nbits: int) -> int:
    """wna16_async's per-warp rings: STAGES x (16 rows x (4 steps of codes + 16 B pad) + 16 rows
    x 16 scales); 0 for wna16_stream."""
    if cfg.get("KERNEL") != "async":
        return 0
    return cfg["WN"] * cfg["STAGES"] * (16 * (4 * 16 * nbits + 16) + 16 * 16 * 4)


def smem_bytes(cfg: dict, sps: int, nbits: int = 4) -> int:
    """The staged activations [SPS][BM][128] elem and their per-step sums [SPS][BM] fp32
    (rounded up to 16 bytes), then wna16_async's weight rings."""
    return (8 * cfg["MT"] * sps * (256 + 4) + 15) // 16 * 16 + ring_bytes(cfg, nbits)


NAMES = tuple(kernel_name(b, c, p) for c in CONFIGS.values() for b, p in
              ((4, True), (4, False), (8, False)))


def named_config(name: str) -> dict:
    """The config `name` of any rung's table (CONFIGS, PACKED_CONFIGS, STAGED_CONFIGS,
    WGMMA_CONFIGS)."""
    for table in (CONFIGS, PACKED_CONFIGS, STAGED_CONFIGS, WGMMA_CONFIGS):
        if name in table:
            return table[name]
    raise KeyError(name)


def block_size_for(rows_per_expert: float) -> int:
    """The alignment block_size that lets the table pick its best tile for a batch of
    `rows_per_expert` = P / E rows: the tile's BM (8 at decode: with block_size 16, half of
    the CTAs would hold only padding). Any multiple of BM works too."""
    for rows, name in BY_ROWS:
        if rows_per_expert <= rows:
            return MEASURED_BLOCK.get(name, 8 * named_config(name)["MT"])
    return 16


def pick_config(rows_per_expert: float, block_size: int, config=None, n_tiles: int = 0,
                ws: bool = True) -> dict:
    """The config named / given by `config`, or the first BY_ROWS entry that covers the rows
    per expert with BM dividing block_size. Packed entries count only when n_tiles (N / 16 of
    a problem prepack_int4 takes; 0: none) is a multiple of their RT; warp-specialized (WS)
    ones only when ws (the launcher passes device_runs_ws(); the default is the table as
    measured on the H200)."""
    if config is not None:
        if isinstance(config, str):
            tables = (CONFIGS, PACKED_CONFIGS, WGMMA_CONFIGS, STAGED_CONFIGS)
            if not any(config in t for t in tables):
                names = sorted(n for t in tables for n in t)
                raise ValueError(f"config: expected one of {names}, got {config!r}")
            cfg = dict(next(t[config] for t in tables if config in t))
        elif isinstance(config, dict):
            cfg = dict(config)
            kind = cfg.get("KERNEL")
            need = ({"MT", "W", "D", "MINB"} if kind == "packed" else
                    {"MT", "D", "S", "MINB"} if kind == "wgmma" else
                    {"MT", "W", "TPW", "KC", "S", "MINB"} if kind == "staged" else
                    {"MT", "WN", "MINB", "STAGES" if kind == "async" else "U"})
            missing = need - set(cfg)
            if missing:
                raise ValueError(f"config: expected keys {sorted(need)} (KS, KERNEL optional), "
                                 f"missing {sorted(missing)}")
        else:
            raise TypeError(f"config: expected a name or a dict, got {type(config).__name__}")
        if block_size % (8 * cfg["MT"]):
            raise ValueError(f"config: tile rows BM = {8 * cfg['MT']} must divide block_size "
                             f"{block_size}")
        return cfg
    for rows, name in BY_ROWS:
        cfg = named_config(name)
        if cfg.get("KERNEL") in ("packed", "staged") and (n_tiles <= 0 or
                                                          n_tiles % cfg.get("RT", 1)):
            continue
        if cfg.get("WS") and not ws:
            continue
        if rows_per_expert <= rows and block_size % (8 * cfg["MT"]) == 0:
            return dict(cfg)
    raise ValueError(f"block_size: expected a multiple of 8, got {block_size}")


def supports(K: int, group_size: int, num_groups: int, block_size: int) -> tuple[bool, str]:
    """(True, "") when wna16_stream can run this problem, else (False, why)."""
    if K % 32 or K <= 0:
        return False, f"Kdim must be a positive multiple of 32 (16-byte rows of 32 codes), got {K}"
    if num_groups != 1 and group_size % 32:
        return False, (f"group_size must be a multiple of 32 (a lane's 32 codes share one "
                       f"scale), got {group_size}")
    if block_size % 8:
        return False, f"block_size must be a multiple of 8 (the mma's n), got {block_size}"
    return True, ""


def can_run(a, w, w_scale, block_size: int, use_int4_w4a16=False, use_int8_w8a16=False,
            block_shape=None) -> tuple[bool, str]:
    """(True, "") when grouped_gemm_wna16 takes these operands (a router, e.g. the weight-only
    branch of quant_gemm.grouped_gemm_quant, falls back to its own rungs otherwise)."""
    if bool(use_int4_w4a16) == bool(use_int8_w8a16):
        return False, "not a weight-only format"
    try:
        import cupy
    except ImportError:
        return False, "no CuPy"
    if not all(isinstance(x, cupy.ndarray) for x in (a, w, w_scale)):
        return False, "a, w and w_scale must be CuPy arrays"
    if getattr(a, "ndim", 0) != 2 or getattr(w, "ndim", 0) != 3 or \
            getattr(w_scale, "ndim", 0) != 3:
        return False, "a [M, Kdim], w [E, N, codes], w_scale [E, N, G] expected"
    K, G = a.shape[1], w_scale.shape[2]
    gs = int(list(block_shape)[1]) if block_shape is not None else (K // G if G else 0)
    if gs < 1 or K % gs:
        return False, "group_size does not divide Kdim"
    ok, why = supports(K, gs, G, int(block_size))
    if not ok:
        return False, why
    if a.data.ptr % 16 or w.data.ptr % 16 or not a.flags.c_contiguous:
        return False, "a and w must be contiguous and 16-byte aligned"
    return True, ""


# ----------------------------------------------------------------------------- prepacked int4
# wna16_packed: the int4 weights repacked once (at weight-load time, or on first use through
# packed_weights' cache) so that each warp load reads 512 contiguous bytes holding exactly the
# lanes' mma A fragments (layout in the .cu). Same math: the packed arrays are a storage
# format of the same codes, scales and zero points (unpack_int4 inverts prepack_int4).
PACK_CHUNK = 64                  # codes per row per lane group and mma chunk (16 per lane)
PACK_ORDERS = ("mma", "wgmma")   # prepack_int4's lane orders: wna16_packed's, wna16_wgmma's
PACK_CACHE_SIZE = 64             # packed weight sets kept (two per MoE layer)
RED_BYTES = 64 * 1024            # shared memory for the warps' partials (a config's RED
                                # overrides it)


def packed_supports(N: int, K: int, group_size: int, num_groups: int) -> tuple[bool, str]:
    """(True, "") when prepack_int4 / wna16_packed take this shape, else (False, why)."""
    if N % 16:
        return False, f"N must be a multiple of 16 (16-row tiles), got {N}"
    if K % PACK_CHUNK or K <= 0:
        return False, f"Kdim must be a positive multiple of {PACK_CHUNK}, got {K}"
    if num_groups != 1:
        cpg = group_size // PACK_CHUNK
        if group_size % PACK_CHUNK or cpg & (cpg - 1):
            return False, (f"group_size must be {PACK_CHUNK} times a power of two (one scale "
                           f"per chunk), got {group_size}")
    return True, ""


def _xp(x):
    try:
        import cupy
        return cupy.get_array_module(x)
    except ImportError:
        return np


def prepack_int4(w, w_scale, w_zp=None, order="mma"):
    """The int4 weights in wna16_packed's order (order="mma") or wna16_wgmma's ("wgmma")
    (NumPy or CuPy in, the same out).

    w [E, N, Kdim / 2] uint8 (k = 2j in the low nibble of byte j), w_scale [E, N, G] float,
    w_zp [E, N, G] uint8 or None. Returns dict(wp [E, N/16, Kdim/64, 32, 4] uint32,
    sp [E, N/16, G, 8, 2] fp32, zp [E, N/16, G, 8] uint16 or None, shape (E, N, Kdim), G, order).
    Lane (g, t) of tile nt, chunk c holds words v = 0..3 of rows 16nt+g (v even) and +8 (v
    odd); in a word, pair p = codes (2j, 2j+1) of one source byte j sits in bits 4p..4p+3 and
    16+4p..: "mma": j = 32c + 8t + 4(v >> 1) + p (codes 64c+16t+0..7, then +8..15);
    "wgmma": j = 32c + 16(v >> 1) + 4p + t (codes 64c + 16m + 2t + 8(p & 1) of k16 step
    m = 2(v >> 1) + (p >> 1): wgmma's register A fragment order).
    """
    if order not in PACK_ORDERS:
        raise ValueError(f"order: expected one of {PACK_ORDERS}, got {order!r}")
    xp = _xp(w)
    if getattr(w, "ndim", 0) != 3 or np.dtype(w.dtype) != np.uint8:
        raise TypeError(f"w: expected uint8 codes [E, N, Kdim / 2], got "
                        f"{getattr(w, 'dtype', type(w))} {getattr(w, 'shape', '')}")
    E, N, Kh = w.shape
    K = 2 * Kh
    if getattr(w_scale, "ndim", 0) != 3 or w_scale.shape[:2] != (E, N):
        raise ValueError(f"w_scale: expected [E, N, G] = [{E}, {N}, G], got "
                         f"{getattr(w_scale, 'shape', None)}")
    G = w_scale.shape[2]
    if G < 1 or K % G:
        raise ValueError(f"w_scale: G = {G} groups must divide Kdim = {K}")
    ok, why = packed_supports(N, K, K // G, G)
    if not ok:
        raise ValueError(f"w: prepack_int4 cannot pack this shape: {why}")
    NT, C = N // 16, K // PACK_CHUNK
    wp = xp.empty((E, NT, C, 32, 4), dtype=xp.uint32)
    sh = xp.arange(4, dtype=xp.uint32) * 4
    for e in range(E):               # one expert at a time: temporaries of 4x its bytes
        if order == "mma":                                   # the 4 bytes of 8 codes
            b = w[e].reshape(N, K // 8, 4)
        else:                                                # bytes (c, vh, p, t) -> (c, t, vh, p)
            b = w[e].reshape(N, C, 2, 4, 4).transpose(0, 1, 4, 2, 3).reshape(N, K // 8, 4)
        lo = (b & 15).astype(xp.uint32) << sh
        hi = (b >> 4).astype(xp.uint32) << (sh + 16)
        words = (lo.sum(axis=-1, dtype=xp.uint32) | hi.sum(axis=-1, dtype=xp.uint32))
        # rows (nt, h, g), k8 = 8c + 2t + vh -> [nt, c, g, t, vh, h]
        words = words.reshape(NT, 2, 8, C, 4, 2).transpose(0, 3, 2, 4, 5, 1)
        wp[e] = words.reshape(NT, C, 32, 4)
    s32 = w_scale.astype(xp.float32)
    sp = xp.ascontiguousarray(s32.reshape(E, NT, 2, 8, G).transpose(0, 1, 4, 3, 2))
    zp = None
    if w_zp is not None:
        if np.dtype(w_zp.dtype) != np.uint8 or w_zp.shape != (E, N, G):
            raise ValueError(f"w_zp: expected uint8 [{E}, {N}, {G}], got {w_zp.dtype} "
                             f"{w_zp.shape}")
        z = xp.ascontiguousarray(w_zp.reshape(E, NT, 2, 8, G).transpose(0, 1, 4, 3, 2))
        zp = z.view(xp.uint16).reshape(E, NT, G, 8)        # little-endian: row g low byte
    return dict(wp=wp, sp=sp, zp=zp, shape=(E, N, K), G=G, order=order)


def unpack_int4(packed):
    """prepack_int4's inverse: (w [E, N, Kdim / 2] uint8, w_scale [E, N, G] fp32, w_zp or
    None), the same array module."""
    wp = packed["wp"]
    xp = _xp(wp)
    E, N, K = packed["shape"]
    G = packed["G"]
    NT, C = N // 16, K // PACK_CHUNK
    words = wp.reshape(E, NT, C, 8, 4, 2, 2).transpose(0, 1, 6, 3, 2, 4, 5)  # e nt h g c t vh
    words = words.reshape(E, N, K // 8, 1)
    sh = xp.arange(4, dtype=xp.uint32) * 4
    lo = (words >> sh) & 15
    hi = (words >> (sh + 16)) & 15
    w = (lo | (hi << 4)).astype(xp.uint8).reshape(E, N, K // 2)
    if packed.get("order", "mma") == "wgmma":           # bytes (c, t, vh, p) -> (c, vh, p, t)
        w = w.reshape(E, N, C, 4, 2, 4).transpose(0, 1, 2, 4, 5, 3).reshape(E, N, K // 2)
    ws = packed["sp"].transpose(0, 1, 4, 3, 2).reshape(E, N, G)
    zp = None
    if packed["zp"] is not None:
        z = packed["zp"].view(xp.uint8).reshape(E, NT, G, 8, 2)
        zp = z.transpose(0, 1, 4, 3, 2).reshape(E, N, G)
    return xp.ascontiguousarray(w), xp.ascontiguousarray(ws), \
        None if zp is None else xp.ascontiguousarray(zp)


def stage_blocks(packed, nb: int, kc: int):
    """prepack_int4's "mma" packing laid out for wna16_staged's bulk copies: one pipeline stage
    (row block b of NB tiles, K stage s of KC chunks) is one contiguous run of each array.

        wp [E, blocks, SPB, NB, KC, 32, 4] uint32  (tile b NB + i, chunk s KC + j)
        sp [E, blocks, G, NB, 8, 2] fp32           zp [E, blocks, G, NB, 8] uint16 or None

    blocks = cdiv(N / 16, NB), SPB = cdiv(Kdim / 64, KC); tiles and chunks past the weights
    are zeros (computed, never stored or, for chunks, never multiplied). Same array module."""
    if packed.get("order", "mma") != "mma":
        raise ValueError(f"packed: expected prepack_int4's \"mma\" order, got "
                         f"{packed.get('order')!r}")
    wp = packed["wp"]
    xp = _xp(wp)
    E, N, K = packed["shape"]
    G = packed["G"]
    NT, C = N // 16, K // PACK_CHUNK
    blocks, spb = -(-NT // nb), -(-C // kc)

    def pad(x, axis, size):
        if x.shape[axis] == size:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, size - x.shape[axis])
        return xp.pad(x, widths)
    w = pad(pad(wp, 1, blocks * nb), 2, spb * kc).reshape(E, blocks, nb, spb, kc, 32, 4)
    out = dict(packed, order=("staged", nb, kc), blocks=blocks, SPB=spb)
    out["wp"] = xp.ascontiguousarray(w.transpose(0, 1, 3, 2, 4, 5, 6))
    sp = pad(packed["sp"], 1, blocks * nb).reshape(E, blocks, nb, G, 8, 2)
    out["sp"] = xp.ascontiguousarray(sp.transpose(0, 1, 3, 2, 4, 5))
    if packed["zp"] is not None:
        zp = pad(packed["zp"], 1, blocks * nb).reshape(E, blocks, nb, G, 8)
        out["zp"] = xp.ascontiguousarray(zp.transpose(0, 1, 3, 2, 4))
    return out


def packed_kernel_name(cfg: dict, zp: bool, d: int | None = None) -> str:
    return (f"wna16_packed<{cfg['MT']}, {cfg['W']}, {cfg['D'] if d is None else d}, "
            f"{int(bool(zp))}, {int(cfg.get('POST', 0))}, {cfg.get('RT', 1)}, {cfg['MINB']}, "
            f"{cfg.get('SR', 0)}>")


# wna16_wgmma (quant_gemm_wna16_wgmma.cu, sm_90a only; prepack_int4(order="wgmma")): one
# warpgroup per CTA owning 64-row groups (RB of them per item) and the whole K (or one of KS
# splits), MT token tiles of 8 (wgmma n = 8 x the live ones), D chunks of weights in flight
# per lane (a shared-memory ring, D >= S - 1), S activation stages, MINB CTAs per SM, WAVES
# waves of CTAs planned, POST (0 or 1). Measured (H200, Mixtral T = 64):
# h32 runs the fastest GEMM1 of the configs swept (230 us against q32's 248), not the fastest
# GEMM2 (185 against 125; 143 with K split over the grid).
WGMMA_CONFIGS = {
    "g32": dict(KERNEL="wgmma", MT=4, D=8, S=4, MINB=4, WAVES=8),
    "g24": dict(KERNEL="wgmma", MT=3, D=8, S=4, MINB=4, WAVES=8),
    # RB row groups an item (128 rows at RB = 2): each staged activation chunk feeds RB times
    # the weights, each barrier and wgmma wait covers RB times the work
    "h32": dict(KERNEL="wgmma", MT=4, D=4, S=4, MINB=4, WAVES=4, RB=2),
    "h24": dict(KERNEL="wgmma", MT=3, D=4, S=4, MINB=4, WAVES=4, RB=2),
    # POST = 1: wgmma multiplies the raw 128 + q; scale and zero point per group in fp32
    "p32": dict(KERNEL="wgmma", MT=4, D=4, S=4, MINB=3, WAVES=4, RB=2, POST=1),
    "p24": dict(KERNEL="wgmma", MT=3, D=4, S=4, MINB=3, WAVES=4, RB=2, POST=1),
}
CU_WGMMA = "quant_gemm_wna16_wgmma.cu"
# wgmma exists only in sm_90a code (built through cuda.core, whose NVRTC takes the generic
# lambda of w16::with_count for host code unless told otherwise)
WGMMA_OPTIONS = ("-arch=sm_90a", "-default-device")


def wgmma_kernel_name(cfg: dict) -> str:
    return (f"wna16_wgmma<{cfg['MT']}, {cfg['D']}, {cfg['S']}, {cfg['MINB']}, {cfg.get('RB', 1)}, "
            f"{cfg.get('POST', 0)}>")


GROUP_SUMS_KERNEL = "wna16_group_sums"
WGMMA_NAMES = tuple(wgmma_kernel_name(c) for c in WGMMA_CONFIGS.values()) + (GROUP_SUMS_KERNEL,)
SUMS_KERNEL = "wna16_chunk_sums"
PACKED_NAMES = tuple(packed_kernel_name(c, z) for c in PACKED_CONFIGS.values()
                     for z in (False, True)) + (SUMS_KERNEL,)
for _ev in ELEMS.values():     # one NVRTC check per element type: every rung of the file
    C.register_compile_case(CU, {"ELEM_BF16": _ev}, NAMES + PACKED_NAMES)
    C.register_compile_case(CU_WGMMA, {"ELEM_BF16": _ev}, WGMMA_NAMES, options=WGMMA_OPTIONS)


def route_int4(a, w, w_scale, w_zp, block_shape, top_k, block_size):
    """The PACKED_BY_ROWS name (a packed or staged config) that grouped_gemm_quant's int4
    branch should hand this call to (grouped_gemm_wna16 with that config), or None (not CuPy
    arrays, a shape the prepacked rungs do not take, too many rows per expert, BM not dividing
    block_size): then quant_gemm's own rungs run, and check the arguments."""
    try:
        import cupy

        if not all(isinstance(x, cupy.ndarray) for x in (a, w, w_scale)):
            return None
        if w_zp is not None and not isinstance(w_zp, cupy.ndarray):
            return None
        if a.ndim != 2 or w.ndim != 3 or w_scale.ndim != 3 or w.dtype != np.uint8:
            return None
        E, N, Kh = w.shape
        K, G = a.shape[1], w_scale.shape[2]
        if 2 * Kh != K or G < 1 or K % G or w_scale.shape[:2] != (E, N):
            return None
        gs = int(list(block_shape)[1]) if block_shape is not None else K // G
        if gs * G != K or not packed_supports(N, K, gs, G)[0]:
            return None
        if a.data.ptr % 16 or w.data.ptr % 16 or not a.flags.c_contiguous or \
                not w.flags.c_contiguous:
            return None
        rows = a.shape[0] * int(top_k) / max(E, 1)
        for r, name in PACKED_BY_ROWS:
            cfg = named_config(name)
            if cfg.get("WS") and not device_runs_ws():
                continue
            if rows <= r and int(block_size) % (8 * cfg["MT"]) == 0 and \
                    (N // 16) % cfg.get("RT", 1) == 0:
                return name
    except (TypeError, ValueError, AttributeError, IndexError, ImportError):
        return None
    return None


_PACKED: dict = {}


def packed_weights(w, w_scale, w_zp=None, w_scale_f32=None, order="mma"):
    """prepack_int4(w, w_scale, w_zp), cached per weight array: the source arrays are held
    (their memory cannot be reused for other weights while cached), so the cache is right as
    long as they are not written in place after their first use; call forget_packed() after
    writing into them. At most PACK_CACHE_SIZE sets, least recently used dropped first.
    w_scale_f32: w_scale already widened to fp32 (packed instead of w_scale, keyed by it).
    order: prepack_int4's lane order, or ("staged", NB, KC) for stage_blocks' layout (one
    cached set per order)."""
    key = tuple((id(x), x.data.ptr, x.shape, x.strides, str(x.dtype)) if x is not None else None
                for x in (w, w_scale, w_zp)) + (order,)
    hit = _PACKED.pop(key, None)
    if hit is None:
        staged = isinstance(order, tuple)           # ("staged", NB, KC): stage_blocks' layout
        pk = prepack_int4(w, w_scale if w_scale_f32 is None else w_scale_f32, w_zp,
                          "mma" if staged else order)
        hit = ((w, w_scale, w_zp), stage_blocks(pk, order[1], order[2]) if staged else pk)
    _PACKED[key] = hit                  # most recent last
    while len(_PACKED) > PACK_CACHE_SIZE:
        _PACKED.pop(next(iter(_PACKED)))
    return hit[1]


def forget_packed():
    """Drop every cached packed weight set (after writing into weights in place)."""
    _PACKED.clear()


def ring_bytes_packed(cfg: dict, d: int, zp: bool = False) -> int:
    """SR = 1's rings in shared memory: W warps x D slots x RT tiles x 32 lanes x (16 bytes of
    codes + 8 of scales + 4 of zero points with zp); 0 for the register ring."""
    if not cfg.get("SR"):
        return 0
    return cfg["W"] * d * cfg.get("RT", 1) * 32 * (28 if zp else 24)


def chunk_sums(a):
    """What wna16_chunk_sums writes for POST = 1 (NumPy, bf16 a [M, Kdim]): uint32 [M, Kdim /
    64], the bf16 pair (-hi, -lo) (low half -hi) of each 64-element run's fp32 sum S (in k
    order), hi = bf16(S), lo = bf16(S - hi)."""
    M, K = a.shape
    runs = np.asarray(a, dtype=np.float32).reshape(M, K // PACK_CHUNK, PACK_CHUNK)
    s = np.zeros(runs.shape[:2], np.float32)
    for k in range(PACK_CHUNK):                       # fp32, in k order, as the kernel adds
        s = s + runs[:, :, k]
    bf = np.dtype(C.bf16_dtype())
    hi = s.astype(bf)
    lo = (s - hi.astype(np.float32)).astype(bf)
    return (((-lo).view(np.uint16).astype(np.uint32) << 16) |
            (-hi).view(np.uint16).astype(np.uint32))


def live_m_tiles(P: int, E: int, mtiles: int, bm: int) -> int:
    """The live m tiles (BM positions with a token) to expect, from the host (the alignment
    lives on the device): min(P, E) experts hit, each with about 1.25 P / min(P, E) rows (a
    margin for uneven routing). Over-estimating leaves SMs idle; under-estimating puts a few
    CTAs in a second wave."""
    hit = max(1, min(P, E))
    rows = -(-5 * P // (4 * hit))                  # ceil(1.25 P / hit)
    return max(1, min(mtiles, hit * C.cdiv(rows, bm)))


def packed_plan(P: int, E: int, N: int, K: int, L: int, block_size: int, cfg: dict,
                num_sms: int = 132, group_size: int = 0, num_groups: int = 1,
                zp: bool = False) -> dict:
    """wna16_packed's launch: grid (cdiv(Lg, BM), cdiv(N/16, TPC)), block 32 W, TPC tiles
    per CTA so that the live CTAs make about WAVES waves (default one; MINB CTAs per SM: a
    later wave's CTAs go to the SMs that finish first, evening out m tiles of unequal live
    token tiles), D the ring depth that divides the chunks per warp CPW (the kernel's rounds),
    the chunk-to-group shift, RG the partials' slots of one group of RT tiles each (the groups
    that meet at one barrier), dynamic shared memory smem."""
    bm = 8 * cfg["MT"]
    if block_size % bm:
        raise ValueError(f"config: tile rows BM = {bm} must divide block_size {block_size}")
    Lg = min(L, P * block_size)
    nt, nchunks = N // 16, K // PACK_CHUNK
    mtiles = C.cdiv(Lg, bm)
    live_m = live_m_tiles(P, E, mtiles, bm)
    slots = num_sms * cfg["MINB"] * cfg.get("WAVES", 1)   # CTAs to plan for
    rt = cfg.get("RT", 1)                        # tiles per warp group: TPC a multiple of it
    if nt % rt:
        raise ValueError(f"config: RT = {rt} tiles per group must divide N / 16 = {nt}")
    groups = nt // rt
    # n splits: as many as fit beside the live m tiles in the planned waves (rounding tpc up
    # first could ask for one split too many: 8 live m tiles x 17 = 136 CTAs on 132 slots)
    gy = max(1, min(groups, slots // live_m))
    tpc = C.cdiv(groups, gy)
    gy = C.cdiv(groups, tpc)
    tpc *= rt
    cpw = C.cdiv(nchunks, cfg["W"])
    d = cfg["D"]
    while cpw % d:
        d //= 2
    shift = 30 if num_groups == 1 else (group_size // PACK_CHUNK).bit_length() - 1
    # the warps' partials: slots of one group (RT tiles) each, as many as RED bytes allow (two
    # halves of red_groups slots met at one barrier), no more than the CTA's groups
    gbytes = cfg["W"] * rt * bm * 17 * 4
    room = SMEM_PER_SM // cfg["MINB"] - 1024                # MINB CTAs per SM
    while d > 1 and ring_bytes_packed(cfg, d, zp) + 2 * gbytes > room:
        d //= 2                                  # SR: a shallower ring beside one slot pair
    rings = ring_bytes_packed(cfg, d, zp)
    fit = min(cfg.get("RED", RED_BYTES), room - rings) // (2 * gbytes)
    red_groups = max(1, min(tpc // rt, fit))
    smem = rings + 2 * red_groups * gbytes
    if smem > room:
        raise ValueError(f"config: {smem} bytes of shared memory per CTA (the rings and the "
                         f"partials) leave no room for MINB = {cfg['MINB']} CTAs per SM")
    return dict(name=packed_kernel_name(cfg, zp, d), cfg=cfg, grid=(mtiles, gy, 1),
                block=(32 * cfg["W"],), smem=smem, TPC=tpc, D=d, shift=shift, Lg=Lg, KS=1,
                SPS=0, RG=red_groups)


def wgmma_supports(N: int, K: int, group_size: int, num_groups: int,
                   cc: int | None = None) -> tuple[bool, str]:
    """(True, "") when wna16_wgmma takes this shape (on a compute capability `cc` device; None:
    the current one), else (False, why)."""
    if cc is None:
        import cupy
        cc = int(cupy.cuda.Device().compute_capability)
    if cc != 90:
        return False, f"wgmma (built for sm_90a) runs on compute capability 9.0 only, got {cc}"
    if N % 64:
        return False, f"N must be a multiple of 64 (one warpgroup's rows), got {N}"
    return packed_supports(N, K, group_size, num_groups)


def wgmma_plan(P: int, E: int, N: int, K: int, L: int, block_size: int, cfg: dict,
               num_sms: int = 132, group_size: int = 0, num_groups: int = 1) -> dict:
    """wna16_wgmma's launch: grid (cdiv(Lg, BM), cdiv(N / 64, GPC), KS), block 128, GPC 64-row
    groups per CTA (a multiple of RB, the row groups of one item) so that the live CTAs make
    about WAVES waves of MINB CTAs per SM, the chunk-to-group shift, dynamic shared memory:
    S stages of BM x 64 activations, then the 4 warps' rings of D x RB x 32 lanes x (16 bytes
    of codes + 8 of scales + 4 of zero points).
    KS K splits of CPS 64-code chunks (whole groups; cfg "KS", default "auto": when the live
    CTAs fill less than one wave of MINB per SM, enough splits for one wave, e.g. GEMM2, whose
    N = H gives few row groups), reduced by the last CTA of each of the TILES (m tile, row
    block) through a workspace of WS floats."""
    bm = 8 * cfg["MT"]
    rb = cfg.get("RB", 1)
    if block_size % bm:
        raise ValueError(f"config: tile rows BM = {bm} must divide block_size {block_size}")
    if cfg["S"] < 2 or cfg["D"] < cfg["S"] - 1:
        raise ValueError(f"config: expected S >= 2 and D >= S - 1, got D = {cfg['D']}, "
                         f"S = {cfg['S']}")
    if rb < 1:
        raise ValueError(f"config: expected RB >= 1 row groups per item, got {rb}")
    Lg = min(L, P * block_size)
    mtiles = C.cdiv(Lg, bm)
    live_m = live_m_tiles(P, E, mtiles, bm)
    blocks = C.cdiv(N // 64, rb)             # items' row blocks (the last may be ragged)
    slots = num_sms * cfg["MINB"] * cfg.get("WAVES", 1)
    gy = max(1, min(blocks, slots // live_m))
    gpc = C.cdiv(blocks, gy) * rb
    gy = C.cdiv(N // 64, gpc)
    shift = 30 if num_groups == 1 else (group_size // PACK_CHUNK).bit_length() - 1
    chunks = K // PACK_CHUNK
    cpg = chunks if num_groups == 1 else group_size // PACK_CHUNK
    ks = cfg.get("KS", "auto")
    if ks == "auto":
        ks = max(1, C.cdiv(num_sms * cfg["MINB"], live_m * gy))
    if not isinstance(ks, int) or ks < 1:
        raise ValueError(f"config: expected KS a positive int or 'auto', got {ks!r}")
    cps = C.cdiv(C.cdiv(chunks, min(ks, chunks // cpg)), cpg) * cpg
    ks = C.cdiv(chunks, cps)
    tiles = mtiles * gy * (gpc // rb)
    return dict(name=wgmma_kernel_name(cfg), cfg=cfg, grid=(mtiles, gy, ks), block=(128,),
                smem=cfg["S"] * bm * 128 + 4 * cfg["D"] * rb * 32 * 28, GPC=gpc, shift=shift,
                Lg=Lg, KS=ks, CPS=cps, TILES=tiles,
                WS=tiles * ks * rb * (bm // 2) * 128 if ks > 1 else 0)


# wna16_staged (quant_gemm_wna16_staged.cu; prepack_int4's "mma" order, the packed rung's
# weights): the CTA's weights and activations staged together through one shared-memory
# cp.async pipeline of S stages (KC 64-code chunks each), W warps of TPW 16-row tiles (a row
# block of NB = W TPW tiles), MT token tiles of 8, MINB CTAs per SM; the mma multiplies the raw
# 128 + q and the zero point comes off the accumulators' start, -(128 + zp) times the tokens'
# sums (2 more mma per token tile and chunk). One wave of CTAs splits all m tiles' (row block,
# K stage) units into runs of equal cost (staged_plan).
STAGED_CONFIGS = {
    "t8": dict(KERNEL="staged", MT=1, W=4, TPW=4, KC=2, S=4, MINB=2),
    "t16": dict(KERNEL="staged", MT=2, W=4, TPW=4, KC=2, S=4, MINB=2),
    # t24 with 3 stages: its NVRTC 13.5 build (prebuilt/) ran Mixtral's T = 64 layer 0.6-2.8 us
    # faster than with 4, T = 256 4-6 us, the same bits (H200)
    "t24": dict(KERNEL="staged", MT=3, W=4, TPW=4, KC=2, S=3, MINB=2),
    "t32": dict(KERNEL="staged", MT=4, W=4, TPW=4, KC=2, S=4, MINB=2),
    # 8 warps of 2 tiles: twice the warps per SM, each token fetch from shared memory feeds 2
    "u24": dict(KERNEL="staged", MT=3, W=8, TPW=2, KC=2, S=4, MINB=2),
    # WS: warp-specialized, WS the producers' registers. One CTA per SM: 8 consumer warps (a
    # 512-row block: each stage's activations feed 512 rows) at 224 registers, and a producer
    # warpgroup at 56 that issues the copies, the ring's slots handed over by mbarriers.
    # Measured (H200, Mixtral T = 64 / 128 / 256, the same run): layer
    # 256.2 / 441.5 / 720.8 us against t24's 258.5 / 455.6 / 753.7; producers at 40-48 or
    # 64-80 registers (consumers at 232 or 208-216), 3 or 5 stages, and 4 consumer warps in
    # 2 CTAs per SM were slower or no faster.
    "t24ws": dict(KERNEL="staged", MT=3, W=8, TPW=4, KC=2, S=4, MINB=1, WS=56),
}
CU_STAGED = "quant_gemm_wna16_staged.cu"
# setmaxnreg exists only in sm_90a code (built through cuda.core)
STAGED_WS_OPTIONS = ("-arch=sm_90a",)


def staged_options(cfg: dict) -> tuple[str, ...]:
    """The compile options of a staged config: sm_90a for the warp-specialized (WS) ones."""
    return STAGED_WS_OPTIONS if cfg.get("WS") else ()


def device_runs_ws() -> bool:
    """Whether the current GPU runs the warp-specialized staged configs (sm_90: H100 / H200)."""
    return C.is_sm90()


def staged_kernel_name(cfg: dict, zp: bool) -> str:
    """The kernel instantiation of a staged config, with per-group zero points or not."""
    ws = f", {int(cfg['WS'])}" if cfg.get("WS") else ""
    return (f"wna16_staged<{cfg['MT']}, {cfg['W']}, {cfg['TPW']}, {cfg['KC']}, {cfg['S']}, "
            f"{int(bool(zp))}, {cfg['MINB']}{ws}>")


def staged_stage_bytes(cfg: dict, zp: bool) -> int:
    """One pipeline stage (the .cu's StagedStage): weights NB KC 512, scales NB KC 64, zero
    points NB KC 16 (zp), activations BM KC 128, each rounded up to 128 bytes."""
    nb, kc, bm = cfg["W"] * cfg["TPW"], cfg["KC"], 8 * cfg["MT"]

    def r(x):
        return C.cdiv(x, 128) * 128
    return r(nb * kc * 512) + r(nb * kc * 64) + (r(nb * kc * 16) if zp else 0) + r(bm * kc * 128)


def staged_plan(P: int, E: int, N: int, K: int, L: int, block_size: int, cfg: dict,
                num_sms: int = 132, group_size: int = 0, num_groups: int = 1,
                zp: bool = False) -> dict:
    """wna16_staged's launch: grid (Q,), block 32 W (+ 128 producers with the config's WS),
    dynamic shared memory S stages (WS: then 2 S mbarriers), then the m tiles' prefix costs
    (8 (MTILES + 1) bytes), a block's parts by first stage (4 SPB) and the m tiles' experts
    (4 MTILES).
    Every live m tile has U = blocks x SPB units (row blocks of NB tiles x K stages of KC
    chunks), each costing LT + 5 (LT: its live token tiles, found on the device); the Q = MINB
    CTAs per SM (times WAVES) take contiguous runs of equal cost over all m tiles in order.
    The partial blocks meet in a workspace of WS floats ([Q][2 parts][32 W TPW MT 4]) with
    COUNTERS ints ([TILES] units done, [TILES][SPB] parts by their first K stage; TILES = m
    tiles x blocks)."""
    bm = 8 * cfg["MT"]
    if block_size % bm:
        raise ValueError(f"config: tile rows BM = {bm} must divide block_size {block_size}")
    for key in ("W", "TPW", "KC", "S", "MINB"):
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise ValueError(f"config: expected {key} a positive int, got {cfg.get(key)!r}")
    if cfg["S"] < 2:
        raise ValueError(f"config: expected S >= 2 pipeline stages, got {cfg['S']}")
    Lg = min(L, P * block_size)
    mtiles = C.cdiv(Lg, bm)
    nb = cfg["W"] * cfg["TPW"]
    blocks, spb = C.cdiv(N // 16, nb), C.cdiv(K // PACK_CHUNK, cfg["KC"])
    units = blocks * spb
    q = max(1, min(num_sms * cfg["MINB"] * cfg.get("WAVES", 1), mtiles * units))
    ws = bool(cfg.get("WS"))
    if ws and cfg["W"] % 4:
        raise ValueError(f"config: WS = 1 takes consumer warpgroups (W a multiple of 4), got "
                         f"W = {cfg['W']}")
    smem = (cfg["S"] * staged_stage_bytes(cfg, zp) + (16 * cfg["S"] if ws else 0) +
            8 * (mtiles + 1) + 4 * spb + 4 * mtiles)
    room = SMEM_PER_SM // cfg["MINB"] - 1024
    if smem > room:
        raise ValueError(f"config: {smem} bytes of pipeline stages and m tile costs per CTA "
                         f"leave no room for MINB = {cfg['MINB']} CTAs per SM ({room} bytes "
                         f"each)")
    shift = 30 if num_groups == 1 else (group_size // PACK_CHUNK).bit_length() - 1
    per = 32 * cfg["W"] * cfg["TPW"] * cfg["MT"] * 4
    slots = 2 * q                              # [Q][2 partial blocks]
    if slots >= 1 << 16 or spb >= 1 << 15:
        raise ValueError(f"config: {slots} part slots or {spb} K stages per block are past the "
                         f"part records' 16-bit fields")
    return dict(name=staged_kernel_name(cfg, zp), cfg=cfg, grid=(q, 1, 1),
                block=(32 * cfg["W"] + (128 if ws else 0),), smem=smem, shift=shift, Lg=Lg,
                Q=q, U=units, SPB=spb, MTILES=mtiles, WS=slots * per, TILES=mtiles * blocks,
                COUNTERS=mtiles * blocks * (1 + spb))


STAGED_NAMES = tuple(staged_kernel_name(c, z) for c in STAGED_CONFIGS.values() if not c.get("WS")
                     for z in (False, True))
STAGED_WS_NAMES = tuple(staged_kernel_name(c, z) for c in STAGED_CONFIGS.values() if c.get("WS")
                        for z in (False, True))
for _ev in ELEMS.values():
    C.register_compile_case(CU_STAGED, {"ELEM_BF16": _ev}, STAGED_NAMES)
    C.register_compile_case(CU_STAGED, {"ELEM_BF16": _ev}, STAGED_WS_NAMES,
                            options=STAGED_WS_OPTIONS)
# The configs the router takes for 9-128 rows per expert ship compiled by NVRTC 13.5 for the
# H100 / H200 (prebuilt/, python -m cuda_kernels.cupy.prebuild): the same source built by the
# CUDA 13.0 NVRTC of the H200 image ran Mixtral's T = 64 layer 2-3% slower, T = 256 3-4%
# (the module docstring of _compile says how it loads)
PREBUILT_CONFIGS = ("t24", "t24ws")
for _ev in ELEMS.values():
    for _c in PREBUILT_CONFIGS:
        for _z in (False, True):
            C.register_prebuilt(CU_STAGED, {"ELEM_BF16": _ev},
                                staged_kernel_name(STAGED_CONFIGS[_c], _z),
                                options=staged_options(STAGED_CONFIGS[_c]))


# ----------------------------------------------------------------------------- workspace
_WS: dict = {}


def _workspace(floats: int, tiles: int):
    """Split-K partials and per-tile arrival counters, cached per device and grown on demand.
    The counters start at zero and the last CTA of each tile resets its own, so launches on
    one stream reuse them; concurrent launches on two streams must not share a device's."""
    import cupy

    dev = cupy.cuda.Device().id
    ws, cnt = _WS.get(dev, (None, None))
    if ws is None or ws.size < floats:
        ws = cupy.empty(max(floats, 1 << 16), dtype=cupy.float32)
    if cnt is None or cnt.size < tiles:
        cnt = cupy.zeros(max(tiles, 1 << 12), dtype=cupy.int32)
    _WS[dev] = (ws, cnt)
    return ws, cnt


_SMS: dict = {}


def _num_sms() -> int:
    import cupy

    dev = cupy.cuda.Device().id
    if dev not in _SMS:
        _SMS[dev] = cupy.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"]
    return _SMS[dev]


def smem_budget(cfg: dict, nbits: int = 4) -> int:
    """Shared memory per CTA that still lets MINB CTAs share an SM (1 KB each reserved)."""
    minb = cfg["MINB"] if nbits == 4 else max(1, cfg["MINB"] // 2)
    return SMEM_PER_SM // minb - 1024


def choose_splits(cfg: dict, P: int, E: int, N: int, K: int, Lg: int, num_sms: int,
                  nbits: int = 4) -> int:
    """KS: split K until the live CTAs' warps reach TARGET_WARPS_PER_SM per SM, and until one
    split's staged activations fit smem_budget(cfg). Live m tiles are estimated on the host (the
    alignment lives on the device): about min(P, E) experts hit, plus P / BM more tiles."""
    bm = 8 * cfg["MT"]
    ksteps = C.cdiv(K, KSTEP)
    if "KS" in cfg and cfg["KS"] not in (None, "auto"):
        return max(1, min(int(cfg["KS"]), ksteps))
    live_m = max(1, min(C.cdiv(Lg, bm), min(P, E) + P // bm))
    warps = live_m * C.cdiv(N, 16 * cfg["WN"]) * cfg["WN"]
    ks = C.cdiv(TARGET_WARPS_PER_SM * num_sms, warps)
    per_step = smem_bytes(cfg, 1, nbits) - ring_bytes(cfg, nbits)
    room = smem_budget(cfg, nbits) - ring_bytes(cfg, nbits)
    ks = max(ks, C.cdiv(ksteps, max(1, room // per_step)))
    ks = min(ks, ksteps)
    sps = C.cdiv(ksteps, ks)
    return C.cdiv(ksteps, sps)          # no empty split


def launch_plan(nbits: int, P: int, E: int, N: int, K: int, L: int, block_size: int,
                config=None, num_sms: int = 132, group_size: int = 0) -> dict:
    """The kernel name, config, grid, block, dynamic shared memory, KS and SPS (steps per
    split) of one launch; Lg = min(L, P * block_size) positions are covered (no live
    position lies past num_tokens_post_padded <= P * block_size)."""
    cfg = pick_config(P / max(E, 1), block_size, config)
    bm = 8 * cfg["MT"]
    Lg = min(L, P * block_size)
    ks = choose_splits(cfg, P, E, N, K, Lg, num_sms, nbits)
    sps = C.cdiv(C.cdiv(K, KSTEP), ks)
    grid = (C.cdiv(Lg, bm), C.cdiv(N, 16 * cfg["WN"]), ks)
    if grid[1] > 65535 or ks > 65535:
        raise ValueError(f"w: N = {N} needs {grid[1]} column tiles, over the grid's 65535")
    smem = smem_bytes(cfg, sps, nbits)
    if smem > SMEM_PER_SM:
        raise ValueError(f"config: KS = {ks} leaves {smem} bytes of staged activations per CTA")
    post = nbits == 4 and group_size > 0 and group_size % KSTEP == 0
    return dict(name=kernel_name(nbits, cfg, post), cfg=cfg, grid=grid, block=(32 * cfg["WN"],),
                smem=smem, KS=ks, SPS=sps, Lg=Lg)


# ----------------------------------------------------------------------------- the stage
def grouped_gemm_wna16(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                       block_size, topk_weights=None, mul_routed_weight=False, bias=None,
                       a_scale=None, w_scale=None, w_zp=None, use_fp8_w8a8=False,
                       use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                       per_act_token_quant=False, per_channel_quant=False, block_shape=None,
                       out_dtype=None, *, config=None, out=None, programmatic=False):
    """c [a.shape[0] * top_k, N] in a's dtype on the GPU (see the module doc).

    The arguments of quant_gemm.grouped_gemm_quant; exactly one of use_int4_w4a16 /
    use_int8_w8a16 must be set (a_scale, per_act_token_quant, per_channel_quant are unused by
    weight-only formats, as in the reference). config: a name of CONFIGS or a dict with MT,
    WN, U, MINB (and optionally KS). out: a [P, N] array to write (tests poison it first).
    programmatic: the staged rung is launched with programmatic stream serialization
    (_launch.py), so that its CTAs read the routing and copy their first weights while the
    kernel before it on the stream finishes, and wait for it before they read `a` or write
    anything. The caller promises that only `a` comes from that kernel: the routing, weights,
    scales, bias and router weights must be final before it started (in a MoE layer, GEMM2
    after GEMM1 or the activation). Other rungs launch as usual.
    """
    import cupy

    if use_fp8_w8a8 or use_int8_w8a8:
        raise ValueError("use_fp8_w8a8/use_int8_w8a8: grouped_gemm_wna16 is weight-only; "
                         "w8a8 formats run quant_gemm.grouped_gemm_quant")
    if bool(use_int4_w4a16) == bool(use_int8_w8a16):
        raise ValueError(f"use_int4_w4a16/use_int8_w8a16: expected exactly one set, got "
                         f"{bool(use_int4_w4a16)} and {bool(use_int8_w8a16)}")
    nbits = 4 if use_int4_w4a16 else 8
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
    C.check_array("a", a, ndim=2, dtypes=(C.bf16_dtype(), np.dtype(np.float16),
                                          np.dtype(np.uint16)))
    M_a, K = a.shape
    if not isinstance(w, cupy.ndarray):
        C.check_array("w", w)
    if w.ndim != 3:
        raise ValueError(f"w: expected 3 dimensions [E, N, Kdim codes], got shape {w.shape}")
    C.check_array("w", w[:1], ndim=3, dtypes=(np.uint8,) if nbits == 4 else (np.uint8, np.int8),
                  contiguous=False)
    if not w.flags.c_contiguous:
        raise ValueError(f"w: expected a C-contiguous array, got strides {w.strides}")
    E, N, Kw = w.shape
    C.check_fits_int32("w", N * Kw, "one expert's N * row bytes")
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
    if block_shape is not None:
        try:
            group_size = int(list(block_shape)[1])
        except (TypeError, ValueError, IndexError):
            raise TypeError(f"block_shape: expected [bn, group_size], got {block_shape!r}") \
                from None
    else:
        group_size = K // G if G and K % G == 0 else 0
    if G < 1 or group_size < 1 or K % group_size or K // group_size != G:
        raise ValueError(f"w_scale: expected Kdim / group_size = {K} / {group_size} groups, "
                         f"got shape {w_scale.shape}")
    w_s = _f32("w_scale", w_scale, shape=(E, N, G))
    if w_zp is not None:
        if w.dtype == np.int8:
            raise ValueError("w_zp: int8 codes are symmetric (no zero point); got w int8 with a "
                             "w_zp")
        C.check_array("w_zp", w_zp, ndim=3, dtypes=(np.uint8,), shape=(E, N, G))
    default_zp = 8 if nbits == 4 else (0 if w.dtype == np.int8 else 128)
    # int8 codes are read as bytes: (b ^ 0x80) - 128 = the signed value, so zp 128 on b ^ 0x80
    code_xor = 0x80 if (nbits == 8 and w.dtype == np.int8) else 0
    if code_xor:
        default_zp = 128
    ok, why = supports(K, group_size, G, block_size)
    if not ok:
        raise ValueError(f"w: grouped_gemm_wna16 cannot run this problem: {why}")
    if G == 1:
        group_size = K                      # one group per row: any Kdim % 32 == 0
    if a.data.ptr % 16 or w.data.ptr % 16 or not a.flags.c_contiguous:
        raise ValueError("a: expected C-contiguous a and w starting on 16-byte boundaries "
                         "(the kernel loads 16-byte chunks)")
    P = M_a * top_k
    C.check_fits_int32("a", P, "a.shape[0] * top_k")
    tw, b32, c = epilogue_operands(P, E, N, out_key, mul_routed_weight, topk_weights, bias, out)
    if P == 0 or N == 0 or L == 0:
        return c

    packable = nbits == 4 and packed_supports(N, K, group_size, G)[0]
    cfg0 = pick_config(P / max(E, 1), block_size, config, N // 16 if packable else 0,
                       ws=device_runs_ws())
    rung = cfg0.get("KERNEL")
    if rung in ("wgmma", "staged", "packed"):       # the int4 rungs on prepacked weights
        if nbits != 4:
            raise ValueError(f"config: the {rung} rung streams int4 codes (use_int4_w4a16)")
        ok, why = (wgmma_supports if rung == "wgmma" else packed_supports)(N, K, group_size, G)
        if not ok:
            raise ValueError(f"w: the {rung} rung cannot run this problem: {why}")
    if rung == "wgmma":
        pk = packed_weights(w, w_scale, w_zp, w_s, order="wgmma")
        lp = wgmma_plan(P, E, N, K, L, block_size, cfg0, _num_sms(), group_size, G)
        kern = _kernel(lp["name"], ELEMS[out_key], lp["smem"], CU_WGMMA, WGMMA_OPTIONS)
        null = C.null_ptr()
        gsum = null
        if cfg0.get("POST"):                 # POST's activation sums per (row, group)
            C.check_fits_int32("a", M_a * G, "a.shape[0] * the groups per row")
            gsum = cupy.empty((M_a, G), dtype=cupy.float32)
            _kernel(GROUP_SUMS_KERNEL, ELEMS[out_key], 0, CU_WGMMA, WGMMA_OPTIONS)(
                (C.cdiv(M_a * G, 8),), (256,), (C.raw(a), gsum, np.int32(M_a), np.int32(K),
                                                np.int32(G)))
        args = (C.raw(a), pk["wp"], C.raw(c), pk["sp"], pk["zp"] if pk["zp"] is not None else null,
                gsum, sorted_token_ids, expert_ids, num_tokens_post_padded,
                tw if tw is not None else null, b32 if b32 is not None else null,
                np.int32(N), np.int32(K), np.int32(P), np.int32(top_k), np.int32(block_size),
                np.int32(lp["Lg"]), np.int32(bool(mul_routed_weight)), np.int32(lp["shift"]),
                np.int32(G), np.int32(default_zp), np.int32(lp["GPC"]), np.int32(lp["CPS"]))
        args += _workspace(lp["WS"], lp["TILES"]) if lp["KS"] > 1 else (null, null)
        kern(lp["grid"], lp["block"], args, shared_mem=lp["smem"])
        return c
    if rung == "staged":
        if cfg0.get("WS") and not device_runs_ws():
            raise ValueError(f"config: warp-specialized staged configs (WS) need an sm_90 GPU "
                             f"(H100 / H200: setmaxnreg is sm_90a's), this one is sm_"
                             f"{cupy.cuda.Device().compute_capability}")
        pk = packed_weights(w, w_scale, w_zp, w_s,
                            order=("staged", cfg0["W"] * cfg0["TPW"], cfg0["KC"]))
        lp = staged_plan(P, E, N, K, L, block_size, cfg0, _num_sms(), group_size, G,
                         w_zp is not None)
        kern = _kernel(lp["name"], ELEMS[out_key], lp["smem"], CU_STAGED, staged_options(cfg0))
        null = C.null_ptr()
        ws, cnt = _workspace(lp["WS"], lp["COUNTERS"])
        args = (C.raw(a), null, pk["wp"], C.raw(c), pk["sp"],         # (null: `unused`)
                pk["zp"] if pk["zp"] is not None else null,
                sorted_token_ids, expert_ids, num_tokens_post_padded,
                tw if tw is not None else null, b32 if b32 is not None else null, ws, cnt,
                np.int32(N), np.int32(K), np.int32(P), np.int32(top_k), np.int32(block_size),
                np.int32(lp["Lg"]), np.int32(bool(mul_routed_weight)), np.int32(lp["shift"]),
                np.int32(G), np.int32(default_zp))
        launch(kern, lp["grid"], lp["block"], args, shared_mem=lp["smem"],
               programmatic=programmatic)
        return c
    if rung == "packed":
        pk = packed_weights(w, w_scale, w_zp, w_s)
        lp = packed_plan(P, E, N, K, L, block_size, cfg0, _num_sms(), group_size, G,
                         w_zp is not None)
        kern = _kernel(lp["name"], ELEMS[out_key], lp["smem"])
        null = C.null_ptr()
        # POST's chunk sums (fp16 runs POST = 0)
        asum = _device_chunk_sums(a) if cfg0.get("POST") and out_key == "bf16" else null
        args = (C.raw(a), pk["wp"], C.raw(c), pk["sp"], pk["zp"] if pk["zp"] is not None else null,
                asum, sorted_token_ids, expert_ids, num_tokens_post_padded,
                tw if tw is not None else null, b32 if b32 is not None else null,
                np.int32(N), np.int32(K), np.int32(P), np.int32(top_k), np.int32(block_size),
                np.int32(lp["Lg"]), np.int32(bool(mul_routed_weight)), np.int32(lp["shift"]),
                np.int32(G), np.int32(default_zp), np.int32(lp["TPC"]), np.int32(lp["RG"]))
        kern(lp["grid"], lp["block"], args, shared_mem=lp["smem"])
        return c
    lp = launch_plan(nbits, P, E, N, K, L, block_size, cfg0, _num_sms(), group_size)
    grid, block, smem, ks, sps, cfg = (lp[k] for k in ("grid", "block", "smem", "KS", "SPS",
                                                       "cfg"))
    null = C.null_ptr()
    if ks > 1:
        ws, cnt = _workspace(grid[0] * grid[1] * ks * block[0] * cfg["MT"] * 4,
                             grid[0] * grid[1])
    else:
        ws, cnt = null, null
    kern = _kernel(lp["name"], ELEMS[out_key], smem)
    args = (C.raw(a), w.view(cupy.uint8), C.raw(c), w_s, w_zp if w_zp is not None else null,
            sorted_token_ids, expert_ids, num_tokens_post_padded,
            tw if tw is not None else null, b32 if b32 is not None else null, ws, cnt,
            np.int32(N), np.int32(K), np.int32(P), np.int32(top_k), np.int32(block_size),
            np.int32(lp["Lg"]), np.int32(bool(mul_routed_weight)), np.int32(group_size),
            np.int32(G), np.int32(default_zp), np.int32(code_xor), np.int32(sps))
    kern(grid, block, args, shared_mem=smem)
    return c


def _device_chunk_sums(a):
    """wna16_chunk_sums on the GPU: the (-hi, -lo) bf16 pairs of a's 64-element run sums
    (chunk_sums is the NumPy twin), for the packed rung's POST."""
    import cupy

    M_a, K = a.shape
    runs = M_a * (K // PACK_CHUNK)
    C.check_fits_int32("a", runs, "a's 64-element runs (rows * Kdim / 64)")
    asum = cupy.empty(runs, dtype=cupy.uint32)
    _kernel(SUMS_KERNEL, ELEMS["bf16"], 0)((C.cdiv(runs, 256),), (256,),
                                           (C.raw(a), asum, np.int32(runs)))
    return asum


_READY: dict = {}
_SMEM_SET: dict = {}


def _kernel(name, elem, smem, cu=CU, options=()):
    """The compiled kernel (one NVRTC pass per element type for the registered names; a
    config outside the tables compiles on its own), its shared-memory limit raised as needed."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (name, elem, dev)
    kern = _READY.get(key)
    if kern is None:
        # the staged rung compiles one name at a time (~10 s each: a sweep or a test asks for
        # one or two of its configs, not all of them)
        group = next((g for g in (NAMES, PACKED_NAMES, WGMMA_NAMES) if name in g), (name,))
        kern = C.get_kernel(cu, name, {"ELEM_BF16": elem}, group, options=options)
        _READY[key] = kern
    if smem > 0 and _SMEM_SET.get(key, 0) < smem:   # opt in: static + dynamic may pass 48 KB
        kern.max_dynamic_shared_size_bytes = smem
        _SMEM_SET[key] = smem
    return kern


# ----------------------------------------------------------------------------- napkin math
HBM_BYTES_PER_S = 4.8e12     # H200 datasheet
PEAK_BF16 = 989e12           # dense bf16 tensor-core FLOP/s


def weight_bytes(nbits: int, touched: int, N: int, K: int, group_size: int = 128) -> float:
    """Bytes of the touched experts' codes and fp32 scales."""
    return touched * (N * K * nbits // 8 + 4 * N * (K // group_size))


# ----------------------------------------------------------------------------- script
def _main(argv=None):  # pragma: no cover - needs a GPU
    """Validate every config against reference.quant.grouped_gemm_quant (int4 / int8, with
    and without zero points, group sizes 32 / 64 / 128, odd N), then time the Mixtral shape
    (benchmarks/bench_wna16.py is the full comparison). --quick: one case per kernel (for
    compute-sanitizer)."""
    import argparse

    import ml_dtypes

    from reference import moe_align_block_size
    from reference import quant as RQ

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one small case per kernel (sanitizer)")
    args = p.parse_args(argv)
    ok, why = C.availability()
    if not ok:
        raise SystemExit(f"no GPU: {why}")
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    failures = 0
    cases = [  # (M_a, E, top_k, N, Kdim, block_size, nbits, gs, zp, KS)
        (1, 4, 2, 136, 256, 16, 4, 128, False, None),
        (5, 4, 2, 200, 320, 16, 4, 32, True, 2),
        (33, 6, 3, 256, 384, 32, 8, 64, True, None),
        (40, 3, 2, 72, 4096, 32, 8, 128, False, 5),
    ]
    packed_cases = [  # N % 16 == 0, group_size 64 * 2^i: (M_a, E, top_k, N, Kdim, B, gs, zp)
        (1, 4, 2, 64, 256, 16, 128, False),
        (5, 3, 2, 48, 576, 16, 64, True),                  # 9 chunks over the warps
        (30, 2, 2, 32, 2048, 32, 256, False),
    ]
    runs = [(n, c, case) for n, c in CONFIGS.items() for case in
            (cases[:2] if args.quick else cases)]
    # --quick (the sanitizer's run): the route's defaults and one config of each other path
    quick = {"q8", "q24", "q32", "p8", "r16", "v24", "v32"}
    runs += [(n, c, (M_a, E, K, N, Kd, max(B, 8 * c["MT"]), 4, gs, zp, None))
             for n, c in PACKED_CONFIGS.items() if n in quick or not args.quick
             for (M_a, E, K, N, Kd, B, gs, zp) in (packed_cases[:2] if args.quick else
                                                   packed_cases)]
    runs += [(n, c, (M_a, E, K, N, Kd, max(B, 8 * c["MT"]), 4, gs, zp, None))
             for n, c in STAGED_CONFIGS.items()
             if (n in ("t8", "t24", "t24ws") or not args.quick) and
             (not c.get("WS") or device_runs_ws())
             for (M_a, E, K, N, Kd, B, gs, zp) in packed_cases]
    import cupy
    if C.is_sm90():                                               # the wgmma rung: Hopper
        runs += [(n, c, (M_a, E, K, 128, Kd, max(B, 8 * c["MT"]), 4, gs, zp, None))
                 for n, c in WGMMA_CONFIGS.items() if n in ("g32", "h32") or not args.quick
                 for (M_a, E, K, N, Kd, B, gs, zp) in packed_cases]
    for name, cfg, (M_a, E, K, N, Kd, B, nb, gs, zp, ks) in runs:
        if B % (8 * cfg["MT"]) or (N // 16) % cfg.get("RT", 1):
            continue
        x = rng.standard_normal((M_a, Kd)).astype(bf16)
        wf = (rng.standard_normal((E, N, Kd)) * 0.05).astype(bf16)
        ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
        st, ex, ntp = moe_align_block_size(ids, B, E)
        tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
        wq, ws, wz = RQ.quantize_weight_wna16(wf, nb, gs, zero_point=zp)
        flags = dict(use_int4_w4a16=True) if nb == 4 else dict(use_int8_w8a16=True)
        want = RQ.grouped_gemm_quant(x, wq, st, ex, ntp, K, B, tw, True, w_scale=ws,
                                     w_zp=wz, **flags)
        outd = C.empty((M_a * K, N), bf16)
        C.raw(outd).fill(0x7FC0)                                   # poison: bf16 NaN
        c2 = dict(cfg, KS=ks) if ks else cfg
        got = grouped_gemm_wna16(C.to_device(x), C.to_device(wq), C.to_device(st),
                                 C.to_device(ex), C.to_device(ntp), K, B, C.to_device(tw),
                                 True, w_scale=C.to_device(ws),
                                 w_zp=None if wz is None else C.to_device(wz), config=c2,
                                 out=outd, **flags)
        host = C.to_host(got)
        host = host.view(bf16) if host.dtype == np.uint16 else host
        err = C.rel_err(host.astype(np.float32), want.astype(np.float32))
        status = "ok" if err <= 2e-2 else "FAIL"
        failures += status == "FAIL"
        print(f"{name:4s} int{nb} g{gs:3d} zp={int(zp)} KS={ks} M_a={M_a:3d} E={E} K={K} "
              f"N={N:4d} Kdim={Kd:4d} B={B:3d} rel_err={err:.2e} {status}", flush=True)
    if not args.quick:
        for label, (E, K, N, Kd) in (("Mixtral GEMM1", (8, 2, 28672, 4096)),
                                     ("Mixtral GEMM2", (8, 2, 4096, 14336))):
            w = cupy.full((E, N, Kd // 2), 0x88, dtype=cupy.uint8)
            ws = cupy.random.uniform(1e-3, 2e-3, (E, N, Kd // 128), dtype=cupy.float32)
            flush = cupy.empty(128 << 20, dtype=cupy.uint8)
            for T in (1, 16, 64):
                ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
                B = block_size_for(T * K / E)
                st, ex, ntp = (C.to_device(v) for v in moe_align_block_size(ids, B, E))
                a = C.to_device(rng.standard_normal((T, Kd)).astype(bf16))
                t = C.median(C.cuda_time(
                    lambda: grouped_gemm_wna16(a, w, st, ex, ntp, K, B, w_scale=ws,
                                               use_int4_w4a16=True),
                    warmup=3, reps=20, setup=lambda: flush.fill(1))) * 1e-3
                nbytes = weight_bytes(4, len(np.unique(ids)), N, Kd)
                print(f"{label} T={T:3d}: {t * 1e6:8.1f} us  {nbytes / t / 1e12:5.2f} TB/s  "
                      f"roofline {nbytes / HBM_BYTES_PER_S / t:5.1%}", flush=True)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":  # pragma: no cover
    _main()
