"""The host side of the weight-only rung v4 (wna16_v4_packed.cu): int4 weights prepacked once
so that each warp load is the lanes' mma fragments, and the rung's launch plan.

    prepack_int4(w, w_scale, w_zp, order)   the packed arrays (order "mma": v4's and v5's,
                                            "wgmma": v6's); unpack_int4 inverts it
    packed_supports(N, Kdim, group_size, G) whether a shape packs
    packed_plan(P, E, N, Kdim, L, B, cfg)   grid, block, shared memory and the kernel's ints
    live_m_tiles(P, E, mtiles, BM)          the m tiles with a token, as the host expects them

Same math: the packed arrays are a storage format of the same codes, scales and zero points
(quant/wna16.py caches them per weight array: packed_weights).

Shape legend: E experts, N output rows, Kdim reduction width, G = Kdim / group_size groups
per row, P slots, L = len(sorted_token_ids), B block_size, BM = 8 MT positions per CTA.
"""
from __future__ import annotations

import numpy as np

from .. import _compile as C
from .._geometry import cdiv
from . import configs as Q
from . import epilogue as EP

CU = "quant/wna16_v4_packed.cu"
PACK_CHUNK = 64                  # codes per row per lane group and mma chunk (16 per lane)
PACK_ORDERS = ("mma", "wgmma")   # prepack_int4's lane orders: v4's (and v5's), v6's
SMEM_PER_SM = 227 * 1024         # H100 / H200: shared memory an SM can give its CTAs
RED_BYTES = 64 * 1024            # shared memory for the warps' partials (a config's RED
                                 # overrides it)


def kernel_name(cfg: dict, zp: bool, d: int | None = None) -> str:
    """The instantiation of a v4 config, with per-group zero points or not, ring depth d."""
    return (f"wna16_v4_packed<{cfg['MT']}, {cfg['W']}, {cfg['D'] if d is None else d}, "
            f"{int(bool(zp))}, {cfg.get('RT', 1)}, {cfg['MINB']}>")


def packed_supports(N: int, K: int, group_size: int, num_groups: int) -> tuple[bool, str]:
    """(True, "") when prepack_int4 and the rungs on its weights (v4, v5; v6 also needs
    N % 64) take this shape, else (False, why)."""
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


def array_module(x):
    try:
        import cupy
        return cupy.get_array_module(x)
    except ImportError:
        return np


def prepack_int4(w, w_scale, w_zp=None, order="mma"):
    """The int4 weights in wna16_v4_packed's order (order="mma", also v5's) or
    wna16_v6_wgmma's ("wgmma") (NumPy or CuPy in, the same out).

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
    xp = array_module(w)
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
    xp = array_module(wp)
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


def live_m_tiles(P: int, E: int, mtiles: int, bm: int) -> int:
    """The live m tiles (BM positions with a token) to expect, from the host (the alignment
    lives on the device): min(P, E) experts hit, each with about 1.25 P / min(P, E) rows (a
    margin for uneven routing). Over-estimating leaves SMs idle; under-estimating puts a few
    CTAs in a second wave."""
    hit = max(1, min(P, E))
    rows = -(-5 * P // (4 * hit))                  # ceil(1.25 P / hit)
    return max(1, min(mtiles, hit * cdiv(rows, bm)))


def packed_plan(P: int, E: int, N: int, K: int, L: int, block_size: int, cfg: dict,
                num_sms: int = 132, group_size: int = 0, num_groups: int = 1,
                zp: bool = False) -> dict:
    """wna16_v4_packed's launch: grid (cdiv(Lg, BM), cdiv(N/16, TPC)), block 32 W, TPC tiles
    per CTA so that the live CTAs make about WAVES waves (default one; MINB CTAs per SM: a
    later wave's CTAs go to the SMs that finish first, evening out m tiles of unequal live
    token tiles), D the ring depth that divides the chunks per warp CPW (the kernel's rounds),
    the chunk-to-group shift, RG the partials' slots of one group of RT tiles each (the groups
    that meet at one barrier), dynamic shared memory smem."""
    bm = 8 * cfg["MT"]
    if block_size % bm:
        raise ValueError(f"config: tile rows BM = {bm} must divide block_size {block_size}")
    Lg = EP.positions(L, P, block_size)
    nt, nchunks = N // 16, K // PACK_CHUNK
    mtiles = cdiv(Lg, bm)
    live_m = live_m_tiles(P, E, mtiles, bm)
    slots = num_sms * cfg["MINB"] * cfg.get("WAVES", 1)   # CTAs to plan for
    rt = cfg.get("RT", 1)                        # tiles per warp group: TPC a multiple of it
    if nt % rt:
        raise ValueError(f"config: RT = {rt} tiles per group must divide N / 16 = {nt}")
    groups = nt // rt
    # n splits: as many as fit beside the live m tiles in the planned waves (rounding tpc up
    # first could ask for one split too many: 8 live m tiles x 17 = 136 CTAs on 132 slots)
    gy = max(1, min(groups, slots // live_m))
    tpc = cdiv(groups, gy)
    gy = cdiv(groups, tpc)
    tpc *= rt
    cpw = cdiv(nchunks, cfg["W"])
    d = cfg["D"]
    while cpw % d:
        d //= 2
    shift = 30 if num_groups == 1 else (group_size // PACK_CHUNK).bit_length() - 1
    # the warps' partials: slots of one group (RT tiles) each, as many as RED bytes allow (two
    # halves of red_groups slots met at one barrier), no more than the CTA's groups
    gbytes = cfg["W"] * rt * bm * 17 * 4
    room = SMEM_PER_SM // cfg["MINB"] - 1024                # MINB CTAs per SM
    fit = min(cfg.get("RED", RED_BYTES), room) // (2 * gbytes)
    red_groups = max(1, min(tpc // rt, fit))
    smem = 2 * red_groups * gbytes
    if smem > room:
        raise ValueError(f"config: {smem} bytes of the warps' partials per CTA leave no room "
                         f"for MINB = {cfg['MINB']} CTAs per SM")
    return dict(name=kernel_name(cfg, zp, d), cfg=cfg, grid=(mtiles, gy, 1),
                block=(32 * cfg["W"],), smem=smem, TPC=tpc, D=d, shift=shift, Lg=Lg,
                RG=red_groups)


def depths(d: int) -> tuple[int, ...]:
    """The ring depths packed_plan may run a config of depth d with (it halves d until d divides
    the chunks each warp walks)."""
    return tuple(d >> i for i in range(d.bit_length()))


NAMES = tuple(kernel_name(c, z, d) for c in Q.CONFIGS["wna16"].values() if c["rung"] == "v4"
              for d in depths(c["D"]) for z in (False, True))
for _ev in EP.ELEMS.values():
    C.register_compile_case(CU, {"ELEM_BF16": _ev}, NAMES)
