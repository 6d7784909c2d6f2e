"""The weight-only ladder's router and its first three rungs (cuda_kernels/cupy/quant/wna16.py:
v1 naive, v2 mma.sync on weights dequantized in registers, v3 decode streaming) against
reference/quant.py. The prepacked rungs v4-v6 have their own files
(test_wna16_packed.py, _staged.py, _wgmma.py).

CPU: every rung's file registers its compile cases (tests/cupy/test_nvrtc.py compiles them),
shared memory fits, the group nesting rule of v2, the route picks each rung where its
measurements put it and says why a rung cannot run a problem. CPU emulation (`simulator`,
slow): v1-v3's .cu built by g++ with the emulator of tests/emulator and run
against the reference (int4 and int8 codes, zero points, group sizes 32 / 64 / 128 / 256 /
one per row, partial tiles, padding-only tiles next to live ones).
GPU (`gpu` marker): v3 with fp16 activations, experts on another rank (zeros) and a crowded
expert; the packed-weight cache; an empty batch; argument errors.

Shape legend: M_a activation rows, E experts, K top-k, N output width, Kdim reduction width,
B block size, G groups per row.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from cuda_kernels.cupy import _arrays as A
from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy.quant import configs as Q
from cuda_kernels.cupy.quant import wna16 as W16
from cuda_kernels.cupy.quant import wna16_packed as P4
from cuda_kernels.cupy.quant import wna16_staged as S5
from cuda_kernels.cupy.quant import wna16_wgmma as W6
from tests.oracles import rel_err
from tests.emulator import ptr
from tests.quant_support import (
    BF16, ROUTING_ARGS, ROUTING_PARAMS, SIZE_ARGS, SIZE_PARAMS, host, poisoned, rung_emulations, up,
    wna16_operands)
from reference import moe_align_block_size
from reference import quant as RQ

TOL = 2e-2          # vLLM's weight-only tolerance
GEMM_TOL = 1e-2     # the same quantized operands, another accumulation order


# ----------------------------------------------------------------------------- CPU
def test_every_rung_registers_its_cases():
    files = {**W16.CU, "v4": P4.CU, "v5": S5.CU, "v6": W6.CU}
    names = {**W16.NAMES, "v4": P4.NAMES, "v5": S5.NAMES + S5.WS_NAMES, "v6": W6.NAMES}
    for rung, cu in files.items():
        cases = [c for c in C.COMPILE_CASES if c.cu_name == cu]
        assert {c.defines["ELEM_BF16"] for c in cases} == {0, 1}, rung
        assert {n for c in cases for n in c.name_expressions} == set(names[rung]), rung
    arch = {c.name_expressions: C.required_arch(c.options) for c in C.COMPILE_CASES
            if c.cu_name in (S5.CU, W6.CU)}
    assert arch[S5.WS_NAMES] == arch[W6.NAMES] == "sm_90a" and arch[S5.NAMES] is None
    assert W16.kernel_name("v3", 4, Q.CONFIGS["wna16"]["gemv32"]) == "wna16_v3_gemv<4, 8, 3, 2>"


def test_smem_budgets():
    for cfg in Q.CONFIGS["wna16"].values():
        if cfg["rung"] in ("v2", "v3"):
            for bits in (4, 8):
                smem = W16.smem_bytes(cfg["rung"], cfg, bits)
                assert smem <= (48 if cfg["rung"] == "v3" else 227) * 1024
                assert Q.tile_rows(cfg) % 8 == 0


def test_v2_group_nesting_rule():
    assert W16.group_ok(128, 32, 128) and W16.group_ok(256, 16, 128)
    assert W16.group_ok(64, 8, 128) and W16.group_ok(32, 8, 128)
    assert not W16.group_ok(16, 8, 128)        # 8 groups per tile: v1 only
    assert not W16.group_ok(96, 4, 128)
    assert W16.group_ok(320, 1, 128)            # one group per row (per-channel)


def _pick(rows, B, N=4096, K=4096, gs=128, cc=90, fmt="int4", aligned=True, **kw):
    nbits = 4 if fmt == "int4" else 8
    return Q.route(fmt, rows, K, W16.refuses(nbits, cc, N, K, gs, K // gs, B, aligned),
                   **kw)[0]


def test_route():
    # decode: v4 up to 8 rows per expert; v5 up to 128 (warp-specialized on sm_90, t32 where
    # 24 does not divide the block size); q8 up to 24 rows for other block sizes; v2 above
    assert _pick(0.25, 16) == "q8" and _pick(8, 16) == "q8"
    assert _pick(16, 48) == "t24ws" and _pick(16, 48, cc=89) == "t24"
    assert _pick(100, 32) == "t32" and _pick(100, 64) == "t32"
    assert _pick(20, 16) == "q8" and _pick(30, 16) == "m16"
    assert _pick(200, 64) == "m64" and _pick(200, 16) == "m16"
    # not packable (N % 16, a group size that is not 64 times a power of two): v3 up to 24
    # rows (Kdim and group size multiples of 128), else v2 / v1
    assert _pick(4, 16, N=200) == "gemv16" and _pick(20, 32, N=200) == "gemv32"
    assert _pick(20, 16, N=200) == "gemv16"
    assert _pick(4, 16, gs=384, K=1536) == "gemv16"              # 6 chunks a group
    assert _pick(4, 16, gs=32) == "m16" and _pick(4, 16, gs=16) == "naive"
    assert _pick(4, 16, aligned=False) == "naive"
    # int8 weights: v2 or v1
    assert _pick(1, 16, fmt="w8a16") == "m16" and _pick(500, 64, fmt="w8a16") == "m64"
    # v6 only when asked for, on sm_90 and N % 64 == 0
    assert _pick(16, 32, version="v6") == "h32"
    with pytest.raises(ValueError, match="compute capability 9.0"):
        _pick(16, 32, cc=89, version="v6")
    with pytest.raises(ValueError, match="multiple of 64"):
        _pick(16, 32, N=4112, version="v6")
    with pytest.raises(ValueError, match="int4 codes"):
        _pick(1, 16, fmt="w8a16", version="v3")
    with pytest.raises(ValueError, match="setmaxnreg"):
        _pick(16, 48, cc=89, config="t24ws")
    with pytest.raises(ValueError, match="multiple of 24"):
        _pick(16, 16, config="t24")
    assert _pick(16, 48, config=dict(Q.CONFIGS["wna16"]["t24"], S=4)) == "custom"
    # what the benchmarks record: Mixtral at T = 1 and 64
    assert W16.default_rung("int4", 0.25, 16, 28672, 4096, 128, 90) == "v4 q8"
    assert W16.default_rung("int4", 16, 48, 4096, 14336, 128, 90) == "v5 t24ws"


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [n for n, c in Q.CONFIGS["wna16"].items() if c["rung"] == "v3"])
def test_v3_fp16_other_rank_and_crowded_expert(rng, cfg):
    """v3 with fp16 activations, experts on another rank (zeros), a crowded expert (several m
    blocks), against the reference."""
    M_a, E, K, N, Kd = 21, 4, 2, 48, 512
    B = Q.CONFIGS["wna16"][cfg]["BM"]
    a, wq, ws, wz, flags = wna16_operands(rng, 4, 128, True, M_a, 2, N, Kd,
                                          dtype=np.float16)
    emap = np.array([0, -1, 1, -1], dtype=np.int32)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    ids[:, 0] = 0                                      # expert 0 gets more than BM rows
    st, ex, ntp = moe_align_block_size(ids, B, E, expert_map=emap)
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, w_scale=ws, w_zp=wz,
                                 **flags)
    out = poisoned((M_a * K, N), np.float16)
    got = host(W16.grouped_gemm_wna16(up(a), up(wq), up(st), up(ex), up(ntp), K, B, up(tw),
                                      True, w_scale=up(ws), w_zp=up(wz), config=cfg, out=out))
    assert got.dtype == np.float16
    assert (got.reshape(M_a, K, N)[np.isin(ids, [1, 3])] == 0).all()
    assert rel_err(got, want) <= GEMM_TOL


@pytest.mark.gpu
def test_packed_weight_cache(rng):
    """The second call reuses the packed weights, forget_packed() drops them, another order
    (v5's stage layout) is a set of its own."""
    M_a, E, K, N, Kd = 4, 4, 2, 64, 512
    a, wq, ws, wz, flags = wna16_operands(rng, 4, 128, True, M_a, E, N, Kd)
    st, ex, ntp = moe_align_block_size(rng.integers(0, E, (M_a, K)).astype(np.int32), 48, E)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, 48, w_scale=ws, w_zp=wz, **flags)
    args = (up(a), up(wq), up(st), up(ex), up(ntp), K, 48)
    kw = dict(w_scale=up(ws), w_zp=up(wz))
    W16.forget_packed()
    for config, sets in (("q8", 1), ("q8", 1), ("t24", 2)):
        got = host(W16.grouped_gemm_wna16(*args, **kw, config=config), BF16)
        assert rel_err(got, want) <= TOL and len(W16._PACKED) == sets
    W16.forget_packed()
    assert not W16._PACKED


@pytest.mark.gpu
def test_empty_batch(rng):
    a, wq, ws, _, _ = wna16_operands(rng, 4, 128, False, 0, 2, 64, 256)
    st, ex, ntp = moe_align_block_size(np.zeros((0, 2), np.int32), 16, 2)
    for config in (None, "q8"):
        got = W16.grouped_gemm_wna16(up(a), up(wq), up(st), up(ex), up(ntp), 2, 16,
                                     w_scale=up(ws), config=config)
        assert got.shape == (0, 64)


@pytest.mark.gpu
def test_argument_errors(rng):
    a, wq, ws, wz, _ = wna16_operands(rng, 4, 32, True, 8, 2, 64, 256)
    st, ex, ntp = (up(v) for v in moe_align_block_size(
        rng.integers(0, 2, (8, 1)).astype(np.int32), 16, 2))
    args = (up(a), up(wq), st, ex, ntp, 1, 16)
    with pytest.raises(ValueError, match="fmt"):
        W16.grouped_gemm_wna16(*args, w_scale=up(ws), fmt="fp8")
    with pytest.raises(ValueError, match="w_scale"):
        W16.grouped_gemm_wna16(*args)
    with pytest.raises(ValueError, match="prepacked int4: group_size"):
        W16.grouped_gemm_wna16(*args, w_scale=up(ws), w_zp=up(wz), config="q8")
    with pytest.raises(ValueError, match="multiple of 24"):
        W16.grouped_gemm_wna16(*args, w_scale=up(ws), config="t24")
    with pytest.raises(TypeError, match="out"):
        W16.grouped_gemm_wna16(*args, w_scale=up(ws), out=A.empty((8, 64), np.float16))
    with pytest.raises(ValueError, match="config"):
        W16.grouped_gemm_wna16(*args, w_scale=up(ws), config="nope")
    with pytest.raises(ValueError, match="w_zp"):
        a8, w8, s8, _, _ = wna16_operands(rng, 8, 128, False, 8, 2, 64, 256, signed=True)
        W16.grouped_gemm_wna16(up(a8), up(w8), st, ex, ntp, 1, 16, w_scale=up(s8),
                               w_zp=up(np.zeros((2, 64, 2), np.uint8)), fmt="w8a16")


# ============================================================================ CPU emulation
# v1-v3 take the same arguments
PARAMS = ("const void* a, const void* w, void* c, const void* p3, const void* p4, "
          f"{ROUTING_PARAMS}, {SIZE_PARAMS}, int i0, int i1, int i2, int i3")
ARGS = ("(const elem_t*)a, (const u8*)w, (elem_t*)c, (const float*)p3, (const u8*)p4, "
        f"{ROUTING_ARGS}, {SIZE_ARGS}, i0, i1, i2, i3")


emulation = rung_emulations("wna16", W16.CU, W16.NAMES, PARAMS, ARGS)


EMU_CASES = [
    # bits, group size (0: one per row), zero points, signed, config, (M_a, E, top_k, N, Kdim,
    # B): partial tiles, N not a multiple of the tile, tiles smaller than the block
    (4, 128, False, False, "naive", (5, 4, 2, 72, 384, 16)),
    (8, 64, True, False, "naive", (5, 4, 2, 72, 320, 16)),
    (4, 128, False, False, "m16", (5, 4, 2, 72, 384, 32)),
    (4, 32, True, False, "m64", (40, 3, 2, 136, 256, 64)),
    (8, 64, True, False, "m16", (5, 4, 2, 72, 320, 16)),         # uint8 codes, zero points
    (8, 128, False, True, "m64", (40, 3, 2, 136, 256, 64)),      # signed int8 codes
    # v3 (decode): N not a multiple of 16, a K-step count not a multiple of WARPS * U, live
    # tiles next to padding-only ones, zero points, one group per row
    (4, 128, False, False, "gemv16", (3, 4, 2, 40, 384, 16)),
    (4, 256, True, False, "gemv32", (14, 3, 2, 24, 1280, 32)),
    (4, 0, False, False, "gemv16", (6, 2, 1, 16, 256, 16)),
]


@pytest.mark.simulator
@pytest.mark.slow
@pytest.mark.parametrize("bits,gs,zp,signed,cfg,shape", EMU_CASES,
                         ids=[f"int{c[0]}-g{c[1]}-{c[4]}" for c in EMU_CASES])
def test_emulated_matches_reference(emulation, bits, gs, zp, signed, cfg, shape):
    """grouped_gemm_wna16's launch of the config's kernel (geometry, arguments) on the
    emulation, against the reference (the output poisoned with NaN first)."""
    config = Q.CONFIGS["wna16"][cfg]
    rung = config["rung"]
    rng = np.random.default_rng(zlib.crc32(f"{bits}{gs}{zp}{cfg}{shape}".encode()))
    M_a, E, K, N, Kd, B = shape
    a, wq, ws, wz, flags = wna16_operands(rng, bits, gs, zp, M_a, E, N, Kd, signed=signed)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, bias, w_scale=ws,
                                 w_zp=wz, **flags)
    G = ws.shape[2]
    assert W16.refuses(bits, 90, N, Kd, Kd // G, G, B, True)(config) is None
    P, L = M_a * K, st.size
    Lg = min(L, P * B)                                  # the launcher's grid bound
    if rung == "v1":
        grid, block = (Lg, -(-N // 128)), 128
    elif rung == "v2":
        grid = (-(-Lg // config["BM"]), -(-N // config["BN"]))
        block = config["WARPS_M"] * config["WARPS_N"] * 32
    else:
        grid, block = (-(-Lg // config["BM"]), -(-N // 16)), config["WARPS"] * 32
    c = np.full((P, N), 0x7FC0, np.uint16)             # poisoned: bf16 NaN
    lib = emulation(rung)
    getattr(lib, f"k{W16.NAMES[rung].index(W16.kernel_name(rung, bits, config))}")(
        grid[0], grid[1], 1, block, ptr(np.ascontiguousarray(a).view(np.uint16)),
        ptr(np.ascontiguousarray(wq).view(np.uint8)), ptr(c),
        ptr(np.ascontiguousarray(ws, np.float32)), ptr(wz), ptr(st), ptr(ex), ptr(ntp),
        ptr(tw.ravel()), ptr(bias), N, Kd, P, K, B, L, 1, Kd // G, G, 8 if bits == 4 else 128,
        0x80 if signed else 0)
    assert rel_err(c.view(BF16), want) <= GEMM_TOL
