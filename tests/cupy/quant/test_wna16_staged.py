"""The staged int4 rung v5 (cuda_kernels/cupy/quant/wna16_staged.py: stage_blocks and
staged_plan; wna16_v5_staged.cu: weights and activations through one shared-memory cp.async
pipeline, each CTA a contiguous run of (row block, K stage) units; t24ws warp-specialized)
against reference/quant.py.

CPU (always): staged_plan's runs cover every unit once, its workspace holds two parts per CTA,
its shared memory matches the kernel's stage layout and fits MINB CTAs per SM, and it refuses
bad configs clearly; stage_blocks' layout. Simulator: the kernel on the CPU emulation of
tests/emulator (g++, a std::thread per CUDA thread, cp.async landing only at its
wait, the mbarriers and named barriers of t24ws): runs that start and end inside row blocks
(blocks finished from 2-3 parts, in K-stage order, by whichever CTA comes last: the CTAs also
run last to first, with the same bits), a ragged last block, a short last K stage, group
sizes 64 / 128 / 256 / one per row, with and without zero points, 1-4 live token tiles, an
expert of another rank, the fp16 build; the part counters come back to zero; and, launched
as a programmatic launch would start it (the activations NaN until a CTA's
griddepcontrol.wait), no activation copy or output write before the wait.
GPU (`gpu` marker): every config on the packed rung's shapes, fp16 and other ranks, long runs,
the same bits on a second launch, and a GEMM1 -> GEMM2 chain whose GEMM2 is launched
programmatically (PDL) and reads GEMM1's output. Tolerance: vLLM's weight-only 2e-2.

Shape legend: T tokens, E experts, K top-k, N output width, Kdim reduction width, B block size.
"""
from __future__ import annotations

import numpy as np
import pytest

from cuda_kernels.cupy import _arrays as A
from cuda_kernels.cupy.quant import configs as Q
from cuda_kernels.cupy.quant import wna16 as W16
from cuda_kernels.cupy.quant import wna16_packed as P4
from cuda_kernels.cupy.quant import wna16_staged as S5
from tests.oracles import rel_err
from tests.emulator import (arm_programmatic, blocks_in_order, entries, library_fixture,
                            programmatic_counts, ptr)
from tests.quant_support import (
    BF16, INT4_ARGS, INT4_PARAMS, INT4_SHAPES, ROUTING_ARGS, ROUTING_PARAMS, SIZE_ARGS, SIZE_PARAMS,
    BF16_BUILD, check_matches_reference, check_other_rank, check_repeats, host, int4_case,
    poisoned, up, wna16_operands)
from reference import moe_align_block_size
from reference import quant as RQ

TOL = 2e-2          # vLLM's weight-only tolerance
CONFIGS = {n: c for n, c in Q.CONFIGS["wna16"].items() if c["rung"] == "v5"}


def quantized(rng, E, N, Kd, gs, zp):
    _, wq, ws, wz, _ = wna16_operands(rng, 4, gs, zp, 1, E, N, Kd)
    return wq, ws, wz


# ----------------------------------------------------------------------------- CPU
def _runs(costs, Q):
    """The kernel's split (wna16_v5_staged): m tile m of cost costs[m] per unit (0: none) and U
    units; CTA q's units of each m tile, as {q: [(m, ua, ub), ...]}."""
    U = costs["U"]
    cum = np.concatenate([[0], np.cumsum([U * w for w in costs["w"]])])
    Wt = int(cum[-1])
    out = {}
    for q in range(Q):
        lo, hi = q * Wt // Q, (q + 1) * Wt // Q
        for m, w in enumerate(costs["w"]):
            if not w or cum[m + 1] <= lo or cum[m] >= hi:
                continue
            ua = max(0, -(-(lo - int(cum[m])) // w))
            ub = min(U, -(-(hi - int(cum[m])) // w))
            if ua < ub:
                out.setdefault(q, []).append((m, ua, ub))
    return out, cum, Wt


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plan_and_runs(name):
    """staged_plan's geometry; the kernel's runs (written out in _runs) cover every unit of every
    live m tile once, in order, each CTA's units of an m tile inside its weighted range, and at
    most two partial blocks per CTA (its workspace slots)."""
    cfg = CONFIGS[name]
    bm, nb = 8 * cfg["MT"], cfg["W"] * cfg["TPW"]
    for P, N, K, L, B, sms in ((2, 28672, 4096, 58, bm, 132), (128, 4096, 14336, 376, 3 * bm, 132),
                               (128, 28672, 4096, 520, 2 * bm, 132), (6, 288, 576, 40, bm, 3)):
        lp = S5.staged_plan(P, 8, N, K, L, B, cfg, sms, 128, K // 128)
        q = lp["grid"][0]
        assert lp["MTILES"] * bm >= min(L, P * B) > (lp["MTILES"] - 1) * bm
        spb = -(-K // 64 // cfg["KC"])
        assert lp["U"] == -(-(N // 16) // nb) * spb and q == min(sms * cfg["MINB"],
                                                                  lp["MTILES"] * lp["U"])
        assert lp["WS"] == q * 2 * 32 * cfg["W"] * cfg["TPW"] * cfg["MT"] * 4
        assert lp["TILES"] == lp["MTILES"] * -(-(N // 16) // nb) and lp["SPB"] == spb
        assert lp["COUNTERS"] == lp["TILES"] * (1 + spb)   # units done, parts by first stage
        assert lp["smem"] == (cfg["S"] * S5.stage_bytes(cfg, False) +
                              (16 * cfg["S"] if cfg.get("WS") else 0) +   # the mbarriers
                              8 * (lp["MTILES"] + 1) + 4 * spb + 4 * lp["MTILES"])
        assert lp["block"] == (32 * cfg["W"] + (128 if cfg.get("WS") else 0),)
        assert lp["smem"] <= P4.SMEM_PER_SM // cfg["MINB"] - 1024
        rng = np.random.default_rng(P)
        costs = dict(U=lp["U"], w=[int(x) for x in rng.choice([0, 6, 7, 8, 9], lp["MTILES"])])
        runs, cum, Wt = _runs(costs, q)
        seen = [(m, u) for r in runs.values() for m, ua, ub in r for u in range(ua, ub)]
        want = [(m, u) for m, w in enumerate(costs["w"]) if w for u in range(lp["U"])]
        assert sorted(seen) == want and len(seen) == len(set(seen))
        for qq, r in runs.items():
            partial = 0
            for m, ua, ub in r:
                w = costs["w"][m]
                for u in (ua, ub - 1):                      # position p in run (p+1)Q-1 // Wt
                    assert ((int(cum[m]) + u * w + 1) * q - 1) // Wt == qq
                partial += (ua % spb != 0) + (ub % spb != 0)
            assert partial <= 2


@pytest.mark.parametrize("E,N,Kd,gs,zp,nb,kc", [(2, 288, 576, 64, True, 16, 2),
                                                (1, 64, 512, 128, False, 8, 4),
                                                (3, 256, 256, 256, True, 16, 2)])
def test_stage_blocks_layout(rng, E, N, Kd, gs, zp, nb, kc):
    """Stage (b, s) of stage_blocks holds tiles b NB .. and chunks s KC .. of the "mma" packing,
    zeros past the weights; the scales and zero points of tile b NB + i at [b, group, i]."""
    wq, ws, wz = quantized(rng, E, N, Kd, gs, zp)
    pk = P4.prepack_int4(wq, ws, wz)
    sb = S5.stage_blocks(pk, nb, kc)
    NT, C, G = N // 16, Kd // 64, Kd // gs
    blocks, spb = -(-NT // nb), -(-C // kc)
    assert sb["order"] == ("staged", nb, kc) and (sb["blocks"], sb["SPB"]) == (blocks, spb)
    assert sb["wp"].shape == (E, blocks, spb, nb, kc, 32, 4)
    for b in range(blocks):
        for i in range(nb):
            tile = b * nb + i
            for st in range(spb):
                for j in range(kc):
                    c = st * kc + j
                    want = pk["wp"][:, tile, c] if tile < NT and c < C else 0
                    assert np.array_equal(sb["wp"][:, b, st, i, j],
                                          np.broadcast_to(want, (E, 32, 4)))
            want_s = pk["sp"][:, tile] if tile < NT else 0
            assert np.array_equal(sb["sp"][:, b, :, i], np.broadcast_to(want_s, (E, G, 8, 2)))
            if zp:
                want_z = pk["zp"][:, tile] if tile < NT else 0
                assert np.array_equal(sb["zp"][:, b, :, i], np.broadcast_to(want_z, (E, G, 8)))
    with pytest.raises(ValueError, match="mma"):
        S5.stage_blocks(P4.prepack_int4(wq, ws, wz, order="wgmma"), nb, kc)


def test_plan_refuses_bad_configs():
    t24 = CONFIGS["t24"]
    with pytest.raises(ValueError, match="BM = 24 must divide block_size 16"):
        S5.staged_plan(4, 8, 256, 256, 40, 16, t24)
    with pytest.raises(ValueError, match="S >= 2"):
        S5.staged_plan(4, 8, 256, 256, 40, 24, dict(t24, S=1))
    with pytest.raises(ValueError, match="TPW a positive int"):
        S5.staged_plan(4, 8, 256, 256, 40, 24, dict(t24, TPW=0))
    with pytest.raises(ValueError, match="no room for MINB = 2"):
        S5.staged_plan(4, 8, 256, 256, 40, 24, dict(t24, S=8, KC=4))
    with pytest.raises(ValueError, match="consumer warpgroups"):
        S5.staged_plan(4, 8, 256, 256, 40, 24, dict(CONFIGS["t24ws"], W=6))


# ----------------------------------------------------------------------------- emulation
EMULATED_NAMES = S5.NAMES + S5.WS_NAMES     # (WS: its mbarriers emulated too)


PARAMS = (f"{INT4_PARAMS}, {ROUTING_PARAMS}, float* ws, int* cnt, {SIZE_PARAMS}, int shift, "
          "int G, int dzp")
ARGS = (f"(const unsigned short*)a, {INT4_ARGS}, {ROUTING_ARGS}, ws, cnt, {SIZE_ARGS}, shift, G, "
        "dzp")


emulated = library_fixture(S5.CU, (BF16_BUILD, entries(EMULATED_NAMES, PARAMS, ARGS)))
# the fp16 build (ELEM_BF16 = 0), whose codes dequantize as fp16 pairs
emulated_fp16 = library_fixture(S5.CU, ({"ELEM_BF16": 0}, entries(EMULATED_NAMES, PARAMS, ARGS)))


def _run_emulated(lib, cfg_name, a, wq, ws, wz, st, ex, ntp, top_k, B, tw, bias, sms,
                  programmatic=None, descending=False, dtype=BF16):
    """The v5 launch (staged_plan, arguments) on the emulation: (c, the plan). programmatic:
    None, a plain launch; "wait" or "ignore_waits", the emulation's model of a programmatic
    launch (tests.emulator.arm_programmatic: the activations are the grid before's output, c and
    the workspace this launch's), whose counts come back as the plan's "programmatic".
    descending: the CTAs run last to first (a block's parts are then completed by the CTA whose
    run ends in it, where in ascending order the CTA whose run starts in it completes it).
    dtype: the build's element type (a goes in as it, c comes back as it)."""
    p = ptr
    cfg = CONFIGS[cfg_name]
    M_a, Kd = a.shape
    E, N = wq.shape[:2]
    P, G = M_a * top_k, ws.shape[2]
    pk = S5.stage_blocks(P4.prepack_int4(wq, ws, wz), cfg["W"] * cfg["TPW"], cfg["KC"])
    lp = S5.staged_plan(P, E, N, Kd, st.size, B, cfg, sms, Kd // G, G, wz is not None)
    a_in = np.ascontiguousarray(a.astype(dtype)).view(np.uint16)
    c = np.full((P, N), 0x7FC0 if dtype == BF16 else 0x7E00, np.uint16)   # poison: NaN
    wsp = np.full(lp["WS"], np.nan, np.float32)                     # the parts' workspace
    cnt = np.zeros(lp["COUNTERS"], np.int32)
    gx, gy, _ = lp["grid"]
    if programmatic is not None:
        arm_programmatic(lib, [a_in], [c, wsp, cnt],
                         ignore_waits=programmatic == "ignore_waits")
    with blocks_in_order(lib, "descending" if descending else "ascending"):
        getattr(lib, f"k{EMULATED_NAMES.index(lp['name'])}")(
            gx, gy, 1, lp["block"][0], p(a_in), p(pk["wp"]), p(c),
            p(pk["sp"]), p(pk["zp"]), p(st), p(ex), p(ntp), p(tw), p(bias), p(wsp), p(cnt),
            N, Kd, P, top_k, B, lp["Lg"], 1, lp["shift"], G, 8)
    assert not cnt.any(), "the part counters come back to zero"
    if programmatic is not None:
        lp["programmatic"] = programmatic_counts(lib)
    return c.view(dtype), lp


# (config, shape, group size, zero points, SMs, the CTAs Q the case was written for)
EMULATION_CASES = [
    # two row blocks (the second of 2 tiles), 9 chunks (a short last stage), g64: runs of 2-3
    # units inside blocks of 5, so blocks are finished from 2-3 parts
    ("t24", (2, 4, 2, 288, 576, 24), 64, False, 8, 16),
    ("t32", (5, 3, 2, 288, 640, 32), 128, True, 8, 16),
    # 1-3 live token tiles per m tile (runs of unequal length: costs LT + 5), zero points
    ("t24", (20, 2, 2, 256, 512, 24), 128, True, 4, 8),
    ("t24", (20, 2, 2, 64, 768, 48), 256, False, 4, 8),        # padding m tiles, g256
    ("t32", (30, 2, 2, 128, 384, 32), 384, True, 1, 2),        # one group per row; runs that
                                                               # cross m tiles
    # warp-specialized (8 consumer warps, a producer warpgroup, mbarriers): two 512-row blocks,
    # runs of 2-3 units (parts); then runs across m tiles that wrap the 4-slot ring, g256
    ("t24ws", (20, 2, 2, 1024, 512, 24), 128, True, 8, 8),
    ("t24ws", (30, 2, 2, 512, 768, 48), 256, False, 2, 2),
]


@pytest.mark.slow
@pytest.mark.simulator
@pytest.mark.parametrize("cfg,shape,gs,zp,sms,q", EMULATION_CASES)
def test_emulated_matches_reference(emulated, rng, cfg, shape, gs, zp, sms, q):
    M_a, E, K, N, Kd, B = shape
    a, wq, ws, wz, st, ex, ntp, tw, bias, want = int4_case(rng, shape, gs, zp)
    got, lp = _run_emulated(emulated, cfg, a, wq, ws, wz, st, ex, ntp, K, B, tw, bias, sms)
    assert lp["Q"] == q, "the case covers the runs it was written for"
    err = rel_err(got, want)
    assert err <= TOL, f"{cfg} {shape}: rel_err {err:.3e} (Q = {lp['Q']}, U = {lp['U']})"


@pytest.mark.slow
@pytest.mark.simulator
@pytest.mark.parametrize("cfg,shape,gs,zp,sms,q", [EMULATION_CASES[i] for i in (1, 3, 5)])
def test_emulated_fp16_build(emulated_fp16, rng, cfg, shape, gs, zp, sms, q):
    """The fp16 build: fp16 activations and output, the codes dequantized as fp16 pairs
    (1024 + q and 64 + q, w16::raw_pairs_f16) and the sums mma's offsets to match."""
    M_a, E, K, N, Kd, B = shape
    a, wq, ws, wz, st, ex, ntp, tw, bias, want = int4_case(rng, shape, gs, zp)
    got, lp = _run_emulated(emulated_fp16, cfg, a, wq, ws, wz, st, ex, ntp, K, B, tw, bias,
                            sms, dtype=np.dtype(np.float16))
    assert lp["Q"] == q
    err = rel_err(got, want)          # a: bf16 values, exact in fp16
    assert err <= TOL, f"{cfg} {shape}: rel_err {err:.3e}"


@pytest.mark.slow
@pytest.mark.simulator
@pytest.mark.parametrize("cfg,shape,gs,zp,sms,q", [c for c in EMULATION_CASES if c[-1] > 2])
def test_emulated_any_block_order_same_bits(emulated, rng, cfg, shape, gs, zp, sms, q):
    """The CTAs run last to first: the blocks split between runs are then completed by the CTA
    whose run ends in them (the other order of the GPU's), with the same bits (the parts add in
    the order of their first K stages) and the counters back at zero."""
    M_a, E, K, N, Kd, B = shape
    a, wq, ws, wz, st, ex, ntp, tw, bias, want = int4_case(rng, shape, gs, zp)
    args = (a, wq, ws, wz, st, ex, ntp, K, B, tw, bias, sms)
    ascending, _ = _run_emulated(emulated, cfg, *args)
    descending, _ = _run_emulated(emulated, cfg, *args, descending=True)
    np.testing.assert_array_equal(descending.view(np.uint16), ascending.view(np.uint16))
    assert rel_err(descending, want) <= TOL


def _other_rank_case(rng, B=24):
    """Experts 1 and 3 of 4 live on another rank (expert id -1), block size B: (ids, the
    launch's arguments after the config name, the reference)."""
    M_a, E, K, N, Kd = 6, 4, 2, 64, 256
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    wq, ws, wz = quantized(rng, 2, N, Kd, 128, True)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    ids[:, 0] = 0
    st, ex, ntp = moe_align_block_size(ids, B, E, expert_map=np.array([0, -1, 1, -1], np.int32))
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((2, N)).astype(np.float32)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, bias, w_scale=ws, w_zp=wz,
                                 use_int4_w4a16=True)
    return ids, (a, wq, ws, wz, st, ex, ntp, K, B, tw, bias, 2), want


@pytest.mark.slow
@pytest.mark.simulator
def test_emulated_other_rank(emulated, rng):
    """Experts 1 and 3 live on another rank (expert id -1): their rows are zeros."""
    ids, args, want = _other_rank_case(rng)
    got, _ = _run_emulated(emulated, "t24", *args)
    assert (got.astype(np.float32).reshape(*ids.shape, -1)[np.isin(ids, [1, 3])] == 0).all()
    assert rel_err(got, want) <= TOL


@pytest.mark.simulator
@pytest.mark.parametrize("cfg,case", [
    ("t24", ((20, 2, 2, 256, 512, 24), 128, True, 4)),   # runs across m tiles, blocks in parts
    ("t32", "other rank"),                               # zeros stored for another rank
    ("t24ws", ((20, 2, 2, 1024, 512, 24), 128, True, 8)),  # producers and consumers both wait
], ids=["t24-parts", "t32-other-rank", "t24ws-roles"])
@pytest.mark.slow
def test_emulated_programmatic_launch(emulated, rng, cfg, case):
    """Launched programmatically (grouped_gemm_wna16(..., programmatic=True)), the kernel may
    start while the grid before it still writes the activations. On the emulation's model of
    that (the activations read NaN until a CTA's wait), no CTA copies an activation or changes
    an output before its wait, and the result is the reference's. With the kernel's waits
    ignored, the same checks count early copies and writes (they can fail)."""
    if case == "other rank":
        _, args, want = _other_rank_case(rng, 8 * CONFIGS[cfg]["MT"])
    else:
        shape, gs, zp, sms = case
        a, wq, ws, wz, st, ex, ntp, tw, bias, want = int4_case(rng, shape, gs, zp)
        args = (a, wq, ws, wz, st, ex, ntp, shape[2], shape[5], tw, bias, sms)
    got, lp = _run_emulated(emulated, cfg, *args, programmatic="wait")
    assert lp["programmatic"] == dict(early_reads=0, early_writes=0, stuck=0)
    assert rel_err(got, want) <= TOL

    _, lp = _run_emulated(emulated, cfg, *args, programmatic="ignore_waits")
    counts = lp["programmatic"]
    assert counts["early_reads"] > 0 and counts["early_writes"] > 0 and counts["stuck"] == 0


# ----------------------------------------------------------------------------- GPU
def _need(cfg):
    ok, why = A.availability()
    if not ok:
        pytest.skip(why)
    if CONFIGS[cfg].get("WS") and not S5.device_runs_ws():
        pytest.skip("the warp-specialized configs run on sm_90 (setmaxnreg is sm_90a's)")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", INT4_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_matches_reference(rng, shape, cfg):
    _need(cfg)
    check_matches_reference(rng, shape, cfg, 16 * CONFIGS[cfg]["MT"])


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_fp16_and_other_rank(rng, cfg):
    """fp16 activations (magic 1024), experts on another rank, no router weights."""
    _need(cfg)
    check_other_rank(rng, cfg, 8 * CONFIGS[cfg]["MT"], 272)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_parts_match_reference_and_repeat(rng, cfg):
    """Many CTAs per m tile (blocks finished from several parts): parity with the reference,
    and the same bits on a second launch (parts added in the order of their K stages, the
    records left at zero)."""
    _need(cfg)
    check_repeats(rng, cfg, (3, 2, 2, 512, 4096, 8 * CONFIGS[cfg]["MT"]), 128)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_long_runs_match_reference(rng, cfg):
    """Runs of ~20 units across m tiles and row blocks (4096 x 8192, 4 experts): parity with
    the reference on a poisoned output, and the same bits on a second launch."""
    _need(cfg)
    check_repeats(rng, cfg, (48, 4, 2, 4096, 8192, 8 * CONFIGS[cfg]["MT"]), 128)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ["t24", "t24ws"])
def test_programmatic_launch_waits_for_its_input(rng, cfg):
    """GEMM2 launched programmatically (PDL) right after GEMM1 reads GEMM1's output as its
    activations: its CTAs start under GEMM1's tail, and must wait before they read it. The
    chain matches the reference chain (GEMM2's input poisoned with NaN before GEMM1 writes it,
    so an early read cannot pass), and the plain launch bit for bit."""
    _need(cfg)
    M_a, E, K, N1, Kd, B = 64, 8, 2, 2048, 4096, 48
    P = M_a * K
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    wq1, ws1, _ = quantized(rng, E, N1, Kd, 128, False)
    wq2, ws2, _ = quantized(rng, E, Kd, N1, 128, False)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(M_a)]).astype(np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    c1 = RQ.grouped_gemm_quant(a, wq1, st, ex, ntp, K, B, w_scale=ws1, use_int4_w4a16=True)
    want = RQ.grouped_gemm_quant(c1.astype(BF16), wq2, st, ex, ntp, 1, B, w_scale=ws2,
                                 use_int4_w4a16=True)
    d = dict(a=up(a), w1=up(wq1), s1=up(ws1), w2=up(wq2), s2=up(ws2), st=up(st), ex=up(ex),
             ntp=up(ntp))

    def chain(programmatic):
        mid = poisoned((P, N1), BF16)
        W16.grouped_gemm_wna16(d["a"], d["w1"], d["st"], d["ex"], d["ntp"], K, B,
                               w_scale=d["s1"], config=cfg, out=mid)
        out = poisoned((P, Kd), BF16)
        return host(W16.grouped_gemm_wna16(mid, d["w2"], d["st"], d["ex"], d["ntp"], 1, B,
                                           w_scale=d["s2"], config=cfg, out=out,
                                           programmatic=programmatic), BF16)

    plain = chain(False)
    for _ in range(3):
        got = chain(True)
        assert np.isfinite(got.astype(np.float32)).all()
        assert rel_err(got, want) <= TOL
        assert np.array_equal(got.view(np.uint16), plain.view(np.uint16))
