"""The host side of the weight-only rung v6 (wna16_v6_wgmma.cu, sm_90a): which shapes it takes
and its launch plan (row groups per CTA for about WAVES waves, K split over grid.z when the
row groups alone fill less than a wave). Its weights are prepack_int4(order="wgmma")'s.

    wgmma_supports(N, Kdim, group_size, G, cc)   (True, "") or (False, why)
    wgmma_plan(P, E, N, Kdim, L, B, cfg)         grid, block, shared memory, GPC, CPS, KS, ...

Shape legend: E experts, N output rows, Kdim reduction width, G groups per row, P slots,
L = len(sorted_token_ids), B block_size, BM = 8 MT positions per CTA.
"""
from __future__ import annotations

from .. import _compile as C
from .._geometry import cdiv
from . import configs as Q
from . import epilogue as EP
from . import wna16_packed as P4

CU = "quant/wna16_v6_wgmma.cu"
# wgmma exists only in sm_90a code (built through cuda.core, whose NVRTC takes the generic
# lambda of w16::with_count for host code unless told otherwise)
OPTIONS = ("-arch=sm_90a", "-default-device")


def kernel_name(cfg: dict) -> str:
    """The instantiation of a v6 config."""
    return f"wna16_v6_wgmma<{cfg['MT']}, {cfg['D']}, {cfg['S']}, {cfg['MINB']}, {cfg.get('RB', 1)}>"


def wgmma_supports(N: int, K: int, group_size: int, num_groups: int,
                   cc: int | None = None) -> tuple[bool, str]:
    """(True, "") when wna16_v6_wgmma takes this shape (on a compute capability `cc` device; None:
    the current one), else (False, why)."""
    if cc is None:
        import cupy
        cc = int(cupy.cuda.Device().compute_capability)
    if cc != 90:
        return False, f"wgmma (built for sm_90a) runs on compute capability 9.0 only, got {cc}"
    if N % 64:
        return False, f"N must be a multiple of 64 (one warpgroup's rows), got {N}"
    return P4.packed_supports(N, K, group_size, num_groups)


def wgmma_plan(P: int, E: int, N: int, K: int, L: int, block_size: int, cfg: dict,
               num_sms: int = 132, group_size: int = 0, num_groups: int = 1) -> dict:
    """wna16_v6_wgmma's launch: grid (cdiv(Lg, BM), cdiv(N / 64, GPC), KS), block 128, GPC 64-row
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
    Lg = EP.positions(L, P, block_size)
    mtiles = cdiv(Lg, bm)
    live_m = P4.live_m_tiles(P, E, mtiles, bm)
    blocks = cdiv(N // 64, rb)             # items' row blocks (the last may be ragged)
    slots = num_sms * cfg["MINB"] * cfg.get("WAVES", 1)
    gy = max(1, min(blocks, slots // live_m))
    gpc = cdiv(blocks, gy) * rb
    gy = cdiv(N // 64, gpc)
    shift = 30 if num_groups == 1 else (group_size // P4.PACK_CHUNK).bit_length() - 1
    chunks = K // P4.PACK_CHUNK
    cpg = chunks if num_groups == 1 else group_size // P4.PACK_CHUNK
    ks = cfg.get("KS", "auto")
    if ks == "auto":
        ks = max(1, cdiv(num_sms * cfg["MINB"], live_m * gy))
    if not isinstance(ks, int) or ks < 1:
        raise ValueError(f"config: expected KS a positive int or 'auto', got {ks!r}")
    cps = cdiv(cdiv(chunks, min(ks, chunks // cpg)), cpg) * cpg
    ks = cdiv(chunks, cps)
    tiles = mtiles * gy * (gpc // rb)
    return dict(name=kernel_name(cfg), cfg=cfg, grid=(mtiles, gy, ks), block=(128,),
                smem=cfg["S"] * bm * 128 + 4 * cfg["D"] * rb * 32 * 28, GPC=gpc, shift=shift,
                Lg=Lg, KS=ks, CPS=cps, TILES=tiles,
                WS=tiles * ks * rb * (bm // 2) * 128 if ks > 1 else 0)


NAMES = tuple(kernel_name(c) for c in Q.CONFIGS["wna16"].values() if c["rung"] == "v6")
for _ev in EP.ELEMS.values():
    C.register_compile_case(CU, {"ELEM_BF16": _ev}, NAMES, options=OPTIONS)
