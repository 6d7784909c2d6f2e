"""The Hopper int4 rung v6 (cuda_kernels/cupy/quant/wna16_wgmma.py: wgmma_plan and
wgmma_supports; wna16_v6_wgmma.cu: wgmma with the dequantized weights as the register A
operand; opt-in, never routed) against reference/quant.py.

CPU (always): prepack_int4(order="wgmma") round-trips and follows the documented lane order
(code by code with a dumb loop); wgmma_plan covers every 64-row group once, splits K only into
whole groups; wgmma_supports refuses other GPUs and N % 64 clearly. Simulator: the kernel runs
on the CPU emulator of tests/emulator (g++, a std::thread per CUDA thread) with wgmma
by its definition: each thread's A fragment from the warpgroup's registers, B through the
descriptor (start, leading and stride byte offsets, no swizzle), the accumulator layout of the
PTX ISA. It checks the kernel's own indexing (ring, stages, groups, split K, epilogue), not
the hardware's reading of the descriptor (the GPU tests do).
GPU (`gpu` marker, compute capability 9.0): group sizes 64 / 128 / one per row, zero points,
several 64-row groups per CTA, 1-4 live token tiles, an expert on another rank, bias and
router weights, fp16 activations, K split over the grid, outputs poisoned first. Tolerance:
vLLM's weight-only 2e-2.

Shape legend: T tokens, E experts, K top-k, N output width, Kdim reduction width, B block size.
"""
from __future__ import annotations

import numpy as np
import pytest

from cuda_kernels.cupy import _arrays as A
from cuda_kernels.cupy.quant import configs as Q
from cuda_kernels.cupy.quant import wna16 as W16
from cuda_kernels.cupy.quant import wna16_packed as P4
from cuda_kernels.cupy.quant import wna16_wgmma as W6
from tests.oracles import rel_err
from tests.emulator import blocks_in_order, entries, library_fixture, ptr
from tests.quant_support import (
    BF16, INT4_ARGS, INT4_PARAMS, INT4_SHAPES, ROUTING_ARGS, ROUTING_PARAMS, SIZE_ARGS, SIZE_PARAMS,
    BF16_BUILD, check_matches_reference, check_other_rank, check_repeats, int4_case, up,
    wna16_operands)
from reference import moe_align_block_size

TOL = 2e-2          # vLLM's weight-only tolerance
CONFIGS = {n: c for n, c in Q.CONFIGS["wna16"].items() if c["rung"] == "v6"}
H32 = CONFIGS["h32"]
# h32 and variants of it (the plan is host arithmetic: any config's)
PLAN_CONFIGS = [H32, dict(H32, RB=1, D=8, WAVES=8), dict(H32, MT=3), dict(H32, MINB=3)]


def quantized(rng, E, N, Kd, gs, zp):
    _, wq, ws, wz, _ = wna16_operands(rng, 4, gs, zp, 1, E, N, Kd)
    return wq, ws, wz


# ----------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("E,N,Kd,gs,zp", [(1, 64, 64, 64, False), (2, 128, 384, 128, True)])
def test_wgmma_order_round_trip_and_layout(rng, E, N, Kd, gs, zp):
    """Lane (g, t), word v, pair p: codes 64c + 16m + 2t + 8(p & 1) + {0, 1} of row
    16nt + g + 8(v & 1), m = 2(v >> 1) + (p >> 1)."""
    wq, ws, wz = quantized(rng, E, N, Kd, gs, zp)
    pk = P4.prepack_int4(wq, ws, wz, order="wgmma")
    assert pk["order"] == "wgmma"
    w2, s2, z2 = P4.unpack_int4(pk)
    assert np.array_equal(w2, wq) and np.array_equal(s2, ws.astype(np.float32))
    assert (z2 is None) == (wz is None) and (wz is None or np.array_equal(z2, wz))
    codes = np.stack([wq & 15, wq >> 4], axis=-1).reshape(E, N, Kd)
    wp = pk["wp"]
    for e in range(E):
        for nt in range(N // 16):
            for c in range(Kd // 64):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for v in range(4):
                        row = 16 * nt + g + 8 * (v & 1)
                        word = int(wp[e, nt, c, lane, v])
                        for p in range(4):
                            k = 64 * c + 16 * (2 * (v >> 1) + (p >> 1)) + 2 * t + 8 * (p & 1)
                            assert (word >> (4 * p)) & 15 == codes[e, row, k]
                            assert (word >> (16 + 4 * p)) & 15 == codes[e, row, k + 1]
    with pytest.raises(ValueError, match="order"):
        P4.prepack_int4(wq, ws, wz, order="tma")


def test_wgmma_plan_and_supports():
    for cfg in PLAN_CONFIGS:
        for P, N, K, L, B in ((16, 28672, 4096, 144, 32), (128, 4096, 14336, 376, 32),
                              (128, 28672, 4096, 520, 48), (3, 192, 576, 40, 32)):
            if B % (8 * cfg["MT"]):
                continue
            lp = W6.wgmma_plan(P, 8, N, K, L, B, cfg, 132, 128, K // 128)
            gx, gy, _ = lp["grid"]
            assert gy * lp["GPC"] >= N // 64 > (gy - 1) * lp["GPC"]       # every group once
            assert gx * 8 * cfg["MT"] >= min(L, P * B)
            assert lp["GPC"] % cfg.get("RB", 1) == 0                     # whole items
            assert lp["smem"] == (cfg["S"] * 8 * cfg["MT"] * 128 +
                                  4 * cfg["D"] * cfg.get("RB", 1) * 32 * 28)
            chunks, ks, cps = K // 64, lp["KS"], lp["CPS"]
            assert cps % 2 == 0 and ks * cps >= chunks > (ks - 1) * cps   # whole groups, all K
            assert (lp["WS"] > 0) == (ks > 1) and lp["grid"][2] == ks
    # GEMM2 of Mixtral at T=64 (few row groups) splits K; GEMM1 fills the GPU without
    auto = dict(H32)
    assert W6.wgmma_plan(128, 8, 4096, 14336, 376, 32, auto, 132, 128, 112)["KS"] > 1
    assert W6.wgmma_plan(128, 8, 28672, 4096, 376, 32, auto, 132, 128, 32)["KS"] == 1
    one = W6.wgmma_plan(3, 2, 128, 512, 40, 32, dict(auto, KS=4), 132, 512, 1)
    assert one["KS"] == 1 and one["CPS"] == 8                  # one group per row: no split
    with pytest.raises(ValueError, match="KS"):
        W6.wgmma_plan(2, 8, 64, 256, 16, 32, dict(auto, KS=0))
    assert W6.wgmma_supports(4096, 4096, 128, 32, cc=90) == (True, "")
    assert "9.0" in W6.wgmma_supports(4096, 4096, 128, 32, cc=80)[1]
    assert "64" in W6.wgmma_supports(4112, 4096, 128, 32, cc=90)[1]
    with pytest.raises(ValueError, match="D >= S - 1"):
        W6.wgmma_plan(2, 8, 64, 256, 16, 32, dict(H32, D=2))


# ----------------------------------------------------------------------------- emulation


PARAMS = (f"{INT4_PARAMS}, {ROUTING_PARAMS}, {SIZE_PARAMS}, int shift, int G, int dzp, "
          "int gpc, int cps, float* ws, int* cnt")
ARGS = (f"(const elem_t*)a, {INT4_ARGS}, {ROUTING_ARGS}, {SIZE_ARGS}, shift, G, dzp, gpc, cps, "
        "ws, cnt")


emulated = library_fixture(W6.CU, (BF16_BUILD, entries(W6.NAMES, PARAMS, ARGS)))


@pytest.mark.simulator
@pytest.mark.parametrize("cfg,shape,gs,zp,sms,waves,ks", [
    ("h32", (3, 2, 2, 64, 256, 32), 128, False, 132, 8, None),    # one live tile per expert,
                                                                  # fewer groups than RB
    ("h32", (40, 3, 2, 128, 384, 32), 128, True, 1, 1, None),     # 3-4 live tiles
    ("h32", (50, 3, 2, 64, 640, 32), 64, False, 1, 8, None),      # 1 or 4 live tiles, g64
    ("h32", (40, 3, 2, 64, 512, 64), 128, True, 132, 8, None),    # padding m tiles
    ("h32", (6, 2, 2, 192, 256, 32), 256, True, 1, 1, None),      # one group per row, a
                                                                  # ragged last block
    ("h32", (40, 3, 2, 576, 256, 32), 128, False, 1, 1, None),    # several blocks a CTA
    ("h32", (3, 2, 2, 320, 256, 32), 64, False, 1, 1, None),
    # split K (whole groups a split; the last CTA of a tile adds the partials in split order),
    # several blocks a CTA
    ("h32", (40, 3, 2, 320, 384, 32), 128, True, 1, 1, 3),
    ("h32", (6, 2, 2, 128, 640, 32), 64, False, 132, 8, 3),
    ("h32", (40, 3, 2, 192, 384, 32), 128, True, 1, 1, 2),
])
@pytest.mark.slow
def test_emulated_matches_reference(emulated, rng, cfg, shape, gs, zp, sms, waves, ks):
    p = ptr
    M_a, E, K, N, Kd, B = shape
    a, wq, ws, wz, st, ex, ntp, tw, bias, want = int4_case(rng, shape, gs, zp)
    pk = P4.prepack_int4(wq, ws, wz, order="wgmma")
    P, G = M_a * K, ws.shape[2]
    lp = W6.wgmma_plan(P, E, N, Kd, st.size, B, dict(CONFIGS[cfg], WAVES=waves, KS=ks or 1),
                       sms, Kd // G, G)
    if waves == 1:
        assert lp["GPC"] > 1                                      # several groups a CTA
    a16 = np.ascontiguousarray(a).view(np.uint16)
    gx, gy, gz = lp["grid"]
    assert gz == (ks or 1) == lp["KS"]
    outs = []
    for descending in (False, True) if ks else (False,):    # split K: either split completes
        c = np.full((P, N), 0x7FC0, np.uint16)                     # poison: bf16 NaN
        wsp = np.full(max(lp["WS"], 1), np.nan, np.float32)      # split K's partials
        cnt = np.zeros(max(lp["TILES"], 1), np.int32)
        with blocks_in_order(emulated, "descending" if descending else "ascending"):
            getattr(emulated, f"k{W6.NAMES.index(lp['name'])}")(
                gx, gy, gz, 128, p(a16), p(pk["wp"]), p(c), p(pk["sp"]), p(pk["zp"]), p(st),
                p(ex), p(ntp), p(tw), p(bias), N, Kd, P, K, B, lp["Lg"], 1, lp["shift"], G, 8,
                lp["GPC"], lp["CPS"], p(wsp), p(cnt))
        assert not cnt.any(), "the split-K counters come back to zero"
        outs.append(c)
    if ks:                          # the partials add in split order whichever split is last
        np.testing.assert_array_equal(outs[1], outs[0])
    err = rel_err(outs[0].view(BF16), want)
    assert err <= TOL, f"{cfg} {shape}: rel_err {err:.3e}"


# ----------------------------------------------------------------------------- GPU
def _hopper():
    ok, why = A.availability()
    if not ok:
        pytest.skip(why)
    import cupy
    cc = int(cupy.cuda.Device().compute_capability)
    if cc != 90:
        pytest.skip(f"wgmma needs compute capability 9.0, got {cc}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_matches_reference(rng, shape, cfg):
    _hopper()
    check_matches_reference(rng, shape, cfg, 8 * CONFIGS[cfg]["MT"] * 2)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_fp16_and_other_rank(rng, cfg):
    """fp16 activations, experts on another rank (zeros), no router weights."""
    _hopper()
    check_other_rank(rng, cfg, 8 * CONFIGS[cfg]["MT"], 128)


@pytest.mark.gpu
@pytest.mark.parametrize("ks", [2, 3, 4])
def test_split_k_matches_reference_and_repeats(rng, ks):
    """K split over grid.z: parity with the reference, and the same bits on a second launch
    (the last CTA adds the partials in split order and resets the tile counters)."""
    _hopper()
    check_repeats(rng, dict(H32, KS=ks), (30, 3, 2, 128, 1024, 16 * H32["MT"]), 128)


@pytest.mark.gpu
def test_refuses_what_it_cannot_run(rng):
    _hopper()
    a, wq, ws, _, _ = wna16_operands(rng, 4, 128, False, 2, 2, 48, 256)   # N % 64 != 0
    st, ex, ntp = (up(v) for v in moe_align_block_size(
        rng.integers(0, 2, (2, 1)).astype(np.int32), 32, 2))
    with pytest.raises(ValueError, match="multiple of 64"):
        W16.grouped_gemm_wna16(up(a), up(wq), st, ex, ntp, 1, 32, w_scale=up(ws), config="h32")
