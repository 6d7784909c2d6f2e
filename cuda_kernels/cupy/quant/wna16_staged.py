"""The host side of the weight-only rung v5 (wna16_v5_staged.cu): prepack_int4's weights laid
out a pipeline stage per contiguous run, and the rung's launch plan (one wave of CTAs, each a
run of equal cost over all m tiles' units).

    stage_blocks(packed, NB, KC)          the "mma" packing, a stage (NB tiles x KC chunks) per run
    staged_plan(P, E, N, Kdim, L, B, cfg) grid, block, shared memory, workspace and counters
    stage_bytes(cfg, zp)                  one pipeline stage's shared memory (the .cu's StagedStage)
    device_runs_ws()                      whether this GPU runs the warp-specialized configs

Shape legend: E experts, N output rows, Kdim reduction width, G groups per row, P slots,
L = len(sorted_token_ids), B block_size, BM = 8 MT positions per CTA, NB = W TPW 16-row
tiles per row block, KC 64-code chunks per K stage, SPB K stages per row block.
"""
from __future__ import annotations

from .. import _compile as C
from .._geometry import cdiv
from . import configs as Q
from . import epilogue as EP
from . import wna16_packed as P4

CU = "quant/wna16_v5_staged.cu"
WS_OPTIONS = ("-arch=sm_90a", "-default-device")   # setmaxnreg: sm_90a only (cuda.core);
# -default-device: the kernel's generic lambdas are device code (NVRTC's JIT mode takes an
# unannotated function for a host one, as nvcc would not)


def device_runs_ws() -> bool:
    """Whether the current GPU runs the warp-specialized configs (sm_90: H100 / H200)."""
    return C.is_sm90()


def stage_blocks(packed, nb: int, kc: int):
    """prepack_int4's "mma" packing laid out for wna16_v5_staged's copies: one pipeline stage
    (row block b of NB tiles, K stage s of KC chunks) is one contiguous run of each array.

        wp [E, blocks, SPB, NB, KC, 32, 4] uint32  (tile b NB + i, chunk s KC + j)
        sp [E, blocks, G, NB, 8, 2] fp32           zp [E, blocks, G, NB, 8] uint16 or None

    blocks = cdiv(N / 16, NB), SPB = cdiv(Kdim / 64, KC); tiles and chunks past the weights
    are zeros (computed, never stored or, for chunks, never multiplied). Same array module."""
    if packed.get("order", "mma") != "mma":
        raise ValueError(f"packed: expected prepack_int4's \"mma\" order, got "
                         f"{packed.get('order')!r}")
    wp = packed["wp"]
    xp = P4.array_module(wp)
    E, N, K = packed["shape"]
    G = packed["G"]
    NT, C = N // 16, K // P4.PACK_CHUNK
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


def options(cfg: dict) -> tuple[str, ...]:
    """The compile options of a v5 config: sm_90a for the warp-specialized (WS) ones."""
    return WS_OPTIONS if cfg.get("WS") else ()


def kernel_name(cfg: dict, zp: bool) -> str:
    """The instantiation of a v5 config, with per-group zero points or not."""
    ws = f", {int(cfg['WS'])}" if cfg.get("WS") else ""
    return (f"wna16_v5_staged<{cfg['MT']}, {cfg['W']}, {cfg['TPW']}, {cfg['KC']}, {cfg['S']}, "
            f"{int(bool(zp))}, {cfg['MINB']}{ws}>")


def stage_bytes(cfg: dict, zp: bool) -> int:
    """One pipeline stage (the .cu's StagedStage): weights NB KC 512, scales NB KC 64, zero
    points NB KC 16 (zp), activations BM KC 128, each rounded up to 128 bytes."""
    nb, kc, bm = cfg["W"] * cfg["TPW"], cfg["KC"], 8 * cfg["MT"]

    def r(x):
        return cdiv(x, 128) * 128
    return r(nb * kc * 512) + r(nb * kc * 64) + (r(nb * kc * 16) if zp else 0) + r(bm * kc * 128)


def staged_plan(P: int, E: int, N: int, K: int, L: int, block_size: int, cfg: dict,
                num_sms: int = 132, group_size: int = 0, num_groups: int = 1,
                zp: bool = False) -> dict:
    """wna16_v5_staged's launch: grid (Q,), block 32 W (+ 128 producers with the config's WS),
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
    Lg = EP.positions(L, P, block_size)
    mtiles = cdiv(Lg, bm)
    nb = cfg["W"] * cfg["TPW"]
    blocks, spb = cdiv(N // 16, nb), cdiv(K // P4.PACK_CHUNK, cfg["KC"])
    units = blocks * spb
    q = max(1, min(num_sms * cfg["MINB"] * cfg.get("WAVES", 1), mtiles * units))
    ws = bool(cfg.get("WS"))
    if ws and cfg["W"] % 4:
        raise ValueError(f"config: WS = 1 takes consumer warpgroups (W a multiple of 4), got "
                         f"W = {cfg['W']}")
    smem = (cfg["S"] * stage_bytes(cfg, zp) + (16 * cfg["S"] if ws else 0) +
            8 * (mtiles + 1) + 4 * spb + 4 * mtiles)
    room = P4.SMEM_PER_SM // cfg["MINB"] - 1024
    if smem > room:
        raise ValueError(f"config: {smem} bytes of pipeline stages and m tile costs per CTA "
                         f"leave no room for MINB = {cfg['MINB']} CTAs per SM ({room} bytes "
                         f"each)")
    shift = 30 if num_groups == 1 else (group_size // P4.PACK_CHUNK).bit_length() - 1
    per = 32 * cfg["W"] * cfg["TPW"] * cfg["MT"] * 4
    slots = 2 * q                              # [Q][2 partial blocks]
    if slots >= 1 << 16 or spb >= 1 << 15:
        raise ValueError(f"config: {slots} part slots or {spb} K stages per block are past the "
                         f"part records' 16-bit fields")
    return dict(name=kernel_name(cfg, zp), cfg=cfg, grid=(q, 1, 1),
                block=(32 * cfg["W"] + (128 if ws else 0),), smem=smem, shift=shift, Lg=Lg,
                Q=q, U=units, SPB=spb, MTILES=mtiles, WS=slots * per, TILES=mtiles * blocks,
                COUNTERS=mtiles * blocks * (1 + spb))


NAMES = tuple(kernel_name(c, z) for c in Q.CONFIGS["wna16"].values()
              if c["rung"] == "v5" and not c.get("WS") for z in (False, True))
WS_NAMES = tuple(kernel_name(c, z) for c in Q.CONFIGS["wna16"].values()
                 if c["rung"] == "v5" and c.get("WS") for z in (False, True))
for _ev in EP.ELEMS.values():
    C.register_compile_case(CU, {"ELEM_BF16": _ev}, NAMES)
    C.register_compile_case(CU, {"ELEM_BF16": _ev}, WS_NAMES, options=WS_OPTIONS)
