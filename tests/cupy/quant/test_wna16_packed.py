"""The prepacked int4 rung v4 (cuda_kernels/cupy/quant/wna16_packed.py: prepack_int4 and
packed_plan; wna16_v4_packed.cu) against reference/quant.py.

CPU (always): prepack_int4 / unpack_int4 round-trip exactly on NumPy arrays; the packed words
follow the layout the .cu documents (checked code by code with a dumb loop); bad shapes are
refused naming the argument; the launch plan covers every tile once in about one wave, with
a ring depth that divides the chunks per warp and the partials' slots that shared memory
allows. Simulator: the kernel on the CPU emulation (g++, a std::thread per CUDA thread)
against the reference: ring depths 4 / 2 / 1, chunks that do not divide among the warps,
several tile groups a CTA, group sizes 64 / 128 / 256 / one per row, zero points.
GPU (`gpu` marker): the rung's configs on nasty shapes, fp16 activations and experts on
another rank, outputs poisoned first; shapes it cannot take are refused.
Tolerance: vLLM's weight-only 2e-2.

Shape legend: T tokens, E experts, K top-k, N output width, Kdim reduction width, B block
size, G scale groups per row.
"""
from __future__ import annotations

import numpy as np
import pytest

from cuda_kernels.cupy._geometry import cdiv
from cuda_kernels.cupy.quant import configs as Q
from cuda_kernels.cupy.quant import wna16 as W16
from cuda_kernels.cupy.quant import wna16_packed as P4
from tests.oracles import rel_err
from tests.emulator import entries, library_fixture, ptr
from tests.quant_support import (
    BF16, INT4_ARGS, INT4_PARAMS, INT4_SHAPES, ROUTING_ARGS, ROUTING_PARAMS, SIZE_ARGS, SIZE_PARAMS,
    BF16_BUILD, check_matches_reference, check_other_rank, int4_case, up, wna16_operands)
from reference import moe_align_block_size

TOL = 2e-2          # vLLM's weight-only tolerance
CONFIGS = {n: c for n, c in Q.CONFIGS["wna16"].items() if c["rung"] == "v4"}
Q8 = Q.CONFIGS["wna16"]["q8"]


def quantized(rng, E, N, Kd, gs, zp):
    _, wq, ws, wz, _ = wna16_operands(rng, 4, gs, zp, 1, E, N, Kd)
    return wq, ws, wz


# ----------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("E,N,Kd,gs,zp", [(1, 16, 64, 64, False), (3, 48, 256, 128, True),
                                          (2, 32, 384, 384, True), (2, 16, 512, 256, False)])
def test_prepack_round_trip(rng, E, N, Kd, gs, zp):
    wq, ws, wz = quantized(rng, E, N, Kd, gs, zp)
    pk = P4.prepack_int4(wq, ws, wz)
    assert pk["wp"].shape == (E, N // 16, Kd // 64, 32, 4) and pk["wp"].dtype == np.uint32
    w2, s2, z2 = P4.unpack_int4(pk)
    assert np.array_equal(w2, wq) and np.array_equal(s2, ws.astype(np.float32))
    assert (z2 is None) == (wz is None) and (wz is None or np.array_equal(z2, wz))


def test_packed_words_follow_the_documented_layout(rng):
    """Lane (g, t) of tile nt, chunk c: word 0 / 2 = row 16nt+g, codes 64c+16t+0..7 / +8..15,
    word 1 / 3 = row 16nt+g+8; pair p of codes (2p, 2p+1) in bits 4p.. and 16+4p..."""
    E, N, Kd = 2, 32, 128
    wq, ws, _ = quantized(rng, E, N, Kd, 64, False)
    codes = np.stack([wq & 15, wq >> 4], axis=-1).reshape(E, N, Kd)   # k = 2j low nibble
    wp = P4.prepack_int4(wq, ws)["wp"]
    for e in range(E):
        for nt in range(N // 16):
            for c in range(Kd // 64):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for v in range(4):
                        row = 16 * nt + g + 8 * (v & 1)
                        k0 = 64 * c + 16 * t + 8 * (v >> 1)
                        word = int(wp[e, nt, c, lane, v])
                        for p in range(4):
                            assert (word >> (4 * p)) & 15 == codes[e, row, k0 + 2 * p]
                            assert (word >> (16 + 4 * p)) & 15 == codes[e, row, k0 + 2 * p + 1]
    sp = P4.prepack_int4(wq, ws)["sp"]
    assert sp[1, 1, 0, 3, 1] == np.float32(ws[1, 16 + 3 + 8, 0])


def test_prepack_refuses_bad_shapes(rng):
    wq, ws, wz = quantized(rng, 2, 32, 256, 128, True)
    with pytest.raises(TypeError, match="w"):
        P4.prepack_int4(wq.astype(np.int8), ws)
    with pytest.raises(ValueError, match="w_scale"):
        P4.prepack_int4(wq, ws[:, :16])
    with pytest.raises(ValueError, match="multiple of 16"):
        P4.prepack_int4(wq[:, :24], ws[:, :24])
    with pytest.raises(ValueError, match="w_zp"):
        P4.prepack_int4(wq, ws, wz[:, :, :1])
    with pytest.raises(ValueError, match="order"):
        P4.prepack_int4(wq, ws, wz, order="tma")
    wq32, ws32, _ = quantized(rng, 1, 16, 256, 32, False)
    with pytest.raises(ValueError, match="group_size"):
        P4.prepack_int4(wq32, ws32)
    assert not P4.packed_supports(16, 384, 192, 2)[0]          # 3 chunks per group
    assert P4.packed_supports(16, 384, 384, 1)[0]              # one group per row


# q8 and wider or deeper variants of it (the plan is host arithmetic: any config's)
PLAN_CONFIGS = [Q8, dict(Q8, MT=2, D=2), dict(Q8, MT=4, W=4, D=1, MINB=4, WAVES=8),
                dict(Q8, MT=4, W=16, D=1, MINB=1)]


def test_plan_one_wave_and_ring_depth():
    for cfg in PLAN_CONFIGS:
        for P, N, K, L, B in ((2, 28672, 4096, 72, 8), (2, 4096, 14336, 72, 8),
                              (32, 28672, 4096, 88, 8), (128, 4096, 14336, 376, 32),
                              (128, 28672, 4096, 376, 32), (3, 64, 576, 40, 32)):
            if B % (8 * cfg["MT"]):
                continue
            lp = P4.packed_plan(P, 8, N, K, L, B, cfg, 132, 128, K // 128)
            gx, gy, _ = lp["grid"]
            assert gy * lp["TPC"] >= N // 16 > (gy - 1) * lp["TPC"]          # every tile once
            assert lp["TPC"] % cfg["RT"] == 0
            cpw = cdiv(K // 64, cfg["W"])
            assert cpw % lp["D"] == 0 and 1 <= lp["D"] <= cfg["D"]
            assert lp["name"] == P4.kernel_name(cfg, False, lp["D"])
            live = P4.live_m_tiles(P, 8, gx, 8 * cfg["MT"])
            slots = 132 * cfg["MINB"] * cfg.get("WAVES", 1)
            assert live * gy <= slots or lp["TPC"] == cfg["RT"]
    assert P4.live_m_tiles(2, 8, 2, 8) == 2 and P4.live_m_tiles(32, 8, 19, 8) == 8
    assert P4.live_m_tiles(128, 8, 24, 16) == 16 and P4.live_m_tiles(128, 8, 12, 32) == 8
    assert P4.packed_plan(2, 8, 64, 256, 16, 8, Q8, 132, 128, 2)["shift"] == 1
    assert P4.packed_plan(2, 8, 64, 256, 16, 8, Q8, 132, 256, 1)["shift"] == 30
    with pytest.raises(ValueError, match="RT = 2"):
        P4.packed_plan(2, 8, 48, 256, 16, 8, Q8, 132, 128, 2)             # 3 tiles
    # the instantiations the plan can name are the registered ones
    assert {P4.kernel_name(Q8, z, d) for z in (0, 1) for d in (4, 2, 1)} == set(P4.NAMES)


def test_plan_partial_slots():
    """The partials' slots: two halves of as many groups as RED bytes allow (met at one
    barrier), at least one group, never more than the CTA's groups, never past MINB CTAs'
    shared memory."""
    def plan(num_sms=132, **over):
        return P4.packed_plan(2, 8, 28672, 4096, 32, 32, dict(Q8, **over), num_sms, 128, 32)
    wide = dict(MT=2, D=2)                                       # 16 tokens
    group = 8 * 2 * 16 * 17 * 4                                  # W RT BM RS fp32 of it
    assert plan(**wide)["RG"] == P4.RED_BYTES // (2 * group) == 1
    assert plan(**wide)["smem"] == 2 * group
    assert plan(RED=6 * group, **wide)["RG"] == 3                # more room, rarer barriers
    room = P4.SMEM_PER_SM // 2 - 1024                            # 2 CTAs per SM
    assert plan(RED=1 << 20, **wide)["RG"] == room // (2 * group) == 3
    assert plan(RED=1 << 20)["RG"] == room // group == 6 < plan()["TPC"] // 2
    assert plan(MT=4, D=1)["RG"] == 1                            # at least one group, past RED
    assert plan(MT=4, D=1)["smem"] == 4 * group > P4.RED_BYTES
    assert plan(num_sms=1)["TPC"] > 2 * plan(num_sms=1)["RG"]


# ----------------------------------------------------------------------------- emulation
PARAMS = (f"{INT4_PARAMS}, {ROUTING_PARAMS}, {SIZE_PARAMS}, int shift, int G, int dzp, "
          "int tpc, int rg")
ARGS = f"(const elem_t*)a, {INT4_ARGS}, {ROUTING_ARGS}, {SIZE_ARGS}, shift, G, dzp, tpc, rg"


emulated = library_fixture(P4.CU, (BF16_BUILD, entries(P4.NAMES, PARAMS, ARGS)))


@pytest.mark.simulator
@pytest.mark.parametrize("cfg,shape,gs,zp,sms", [
    ("q8", (2, 4, 2, 32, 2048, 8), 128, False, 132),     # D = 4 ring, K split over 8 warps
    ("q8", (2, 3, 2, 64, 2048, 8), 256, True, 1),        # zero points, 2 groups of 2 tiles a CTA
    ("q8", (3, 2, 2, 32, 576, 8), 64, False, 1),         # 9 chunks over 8 warps: dead chunks, D 2
    ("q8", (6, 2, 2, 32, 1024, 16), 1024, True, 132),    # one group per row
    ("q8", (3, 3, 2, 64, 1152, 8), 128, True, 1),        # 18 chunks: D = 1, zero point per pair
    ("q8", (9, 2, 2, 32, 576, 16), 64, False, 132),      # padding tiles in a block of 16
    ("q8", (12, 2, 2, 96, 1024, 16), 128, True, 1),      # 6 tiles, 3 groups a CTA
], ids=lambda v: str(v))
@pytest.mark.slow
def test_emulated_matches_reference(emulated, rng, cfg, shape, gs, zp, sms):
    M_a, E, K, N, Kd, B = shape
    a, wq, ws, wz, st, ex, ntp, tw, bias, want = int4_case(rng, shape, gs, zp)
    pk = P4.prepack_int4(wq, ws, wz)
    P, G = M_a * K, ws.shape[2]
    config = CONFIGS[cfg]
    lp = P4.packed_plan(P, E, N, Kd, st.size, B, config, sms, Kd // G, G, wz is not None)
    c = np.full((P, N), 0x7FC0, np.uint16)                         # poison: bf16 NaN
    gx, gy, _ = lp["grid"]
    getattr(emulated, f"k{P4.NAMES.index(lp['name'])}")(
        gx, gy, 1, lp["block"][0], ptr(np.ascontiguousarray(a).view(np.uint16)), ptr(pk["wp"]),
        ptr(c), ptr(pk["sp"]), ptr(pk["zp"]), ptr(st), ptr(ex), ptr(ntp), ptr(tw), ptr(bias),
        N, Kd, P, K, B, lp["Lg"], 1, lp["shift"], G, 8, lp["TPC"], lp["RG"])
    assert lp["smem"] == 2 * lp["RG"] * config["W"] * config["RT"] * 8 * config["MT"] * 17 * 4
    err = rel_err(c.view(BF16), want)
    assert err <= TOL, f"{cfg} {shape}: rel_err {err:.3e}"


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_matches_reference(rng, shape, cfg):
    if (shape[3] // 16) % CONFIGS[cfg]["RT"]:
        pytest.skip(f"{cfg}: its RT tiles per group do not divide N / 16 = {shape[3] // 16}")
    check_matches_reference(rng, shape, cfg, max(16, 8 * CONFIGS[cfg]["MT"]))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_fp16_and_other_rank(rng, cfg):
    check_other_rank(rng, cfg, max(16, 8 * CONFIGS[cfg]["MT"]), 64)


@pytest.mark.gpu
def test_refuses_what_it_cannot_run(rng):
    a, wq, ws, _, _ = wna16_operands(rng, 4, 128, False, 2, 2, 40, 256)   # N % 16 != 0
    st, ex, ntp = (up(v) for v in moe_align_block_size(
        rng.integers(0, 2, (2, 1)).astype(np.int32), 16, 2))
    with pytest.raises(ValueError, match="prepacked"):
        W16.grouped_gemm_wna16(up(a), up(wq), st, ex, ntp, 1, 16, w_scale=up(ws), config="q8")
