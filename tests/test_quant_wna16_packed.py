"""The prepacked int4 decode rung (quant_gemm_wna16.prepack_int4 + wna16_packed) against
reference/quant.py.

CPU (always): prepack_int4 / unpack_int4 round-trip exactly on NumPy arrays; the packed words
follow the layout the .cu documents (checked code by code with a dumb loop); bad shapes are
refused naming the argument; the launch plan keeps one wave and a ring depth that divides the
chunks per warp. Simulator: the kernel runs on the CPU emulation of
tests/test_quant_wna16_cupy.py (g++, a std::thread per CUDA thread) against the reference.
GPU (`gpu` marker): every packed config, group sizes 64 / 128 / 256 / one per row, zero points,
a Kdim whose chunks do not divide among the warps, several tiles per CTA, an expert on another
rank (zeros), bias and router weights, fp16 activations, outputs poisoned first; the per-array
cache (hit, forget_packed); T = 0. Tolerance: the issue's weight-only 2e-2.

Shape legend: T tokens, E experts, K top-k, N output width, Kdim reduction width, B block size,
G scale groups per row.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy import quant_gemm_wna16 as W
from reference import moe_align_block_size
from reference import quant as RQ
from oracles import rel_err
from test_quant_cupy import host, poisoned, up  # the quantized tests' GPU helpers

BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = 2e-2          # issue 8 / vLLM's weight-only tolerance


def quantized(rng, E, N, Kd, gs, zp):
    w = (rng.standard_normal((E, N, Kd)) * 0.05).astype(BF16)
    return RQ.quantize_weight_wna16(w, 4, gs, zero_point=zp)


# ----------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("E,N,Kd,gs,zp", [(1, 16, 64, 64, False), (3, 48, 256, 128, True),
                                          (2, 32, 384, 384, True), (2, 16, 512, 256, False)])
def test_prepack_round_trip(rng, E, N, Kd, gs, zp):
    wq, ws, wz = quantized(rng, E, N, Kd, gs, zp)
    pk = W.prepack_int4(wq, ws, wz)
    assert pk["wp"].shape == (E, N // 16, Kd // 64, 32, 4) and pk["wp"].dtype == np.uint32
    w2, s2, z2 = W.unpack_int4(pk)
    assert np.array_equal(w2, wq) and np.array_equal(s2, ws.astype(np.float32))
    assert (z2 is None) == (wz is None) and (wz is None or np.array_equal(z2, wz))


def test_packed_words_follow_the_documented_layout(rng):
    """Lane (g, t) of tile nt, chunk c: word 0 / 2 = row 16nt+g, codes 64c+16t+0..7 / +8..15,
    word 1 / 3 = row 16nt+g+8; pair p of codes (2p, 2p+1) in bits 4p.. and 16+4p..."""
    E, N, Kd = 2, 32, 128
    wq, ws, _ = quantized(rng, E, N, Kd, 64, False)
    codes = np.stack([wq & 15, wq >> 4], axis=-1).reshape(E, N, Kd)   # k = 2j low nibble
    wp = W.prepack_int4(wq, ws)["wp"]
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
    sp = W.prepack_int4(wq, ws)["sp"]
    assert sp[1, 1, 0, 3, 1] == np.float32(ws[1, 16 + 3 + 8, 0])


def test_prepack_refuses_bad_shapes(rng):
    wq, ws, wz = quantized(rng, 2, 32, 256, 128, True)
    with pytest.raises(TypeError, match="w"):
        W.prepack_int4(wq.astype(np.int8), ws)
    with pytest.raises(ValueError, match="w_scale"):
        W.prepack_int4(wq, ws[:, :16])
    with pytest.raises(ValueError, match="multiple of 16"):
        W.prepack_int4(wq[:, :24], ws[:, :24])
    with pytest.raises(ValueError, match="w_zp"):
        W.prepack_int4(wq, ws, wz[:, :, :1])
    wq32, ws32, _ = quantized(rng, 1, 16, 256, 32, False)
    with pytest.raises(ValueError, match="group_size"):
        W.prepack_int4(wq32, ws32)
    assert not W.packed_supports(16, 384, 192, 2)[0]          # 3 chunks per group
    assert W.packed_supports(16, 384, 384, 1)[0]              # one group per row


def test_packed_plan_one_wave_and_ring_depth():
    one_per_sm = dict(W.PACKED_CONFIGS["q32"], W=16, MINB=1)      # 8 live m tiles, 132 slots
    for cfg in list(W.PACKED_CONFIGS.values()) + [one_per_sm]:
        for P, N, K, L, B in ((2, 28672, 4096, 72, 8), (2, 4096, 14336, 72, 8),
                              (32, 28672, 4096, 88, 8), (128, 4096, 14336, 376, 32),
                              (128, 28672, 4096, 376, 32), (3, 48, 576, 40, 32)):
            if B % (8 * cfg["MT"]):
                continue
            if (N // 16) % cfg.get("RT", 1):
                continue
            lp = W.packed_plan(P, 8, N, K, L, B, cfg, 132, 128, K // 128)
            gx, gy, _ = lp["grid"]
            assert gy * lp["TPC"] >= N // 16 > (gy - 1) * lp["TPC"]          # every tile once
            assert lp["TPC"] % cfg.get("RT", 1) == 0
            cpw = C.cdiv(K // 64, cfg["W"])
            assert cpw % lp["D"] == 0 and 1 <= lp["D"] <= cfg["D"]
            live = W.live_m_tiles(P, 8, gx, 8 * cfg["MT"])
            slots = 132 * cfg["MINB"] * cfg.get("WAVES", 1)
            assert live * gy <= slots or lp["TPC"] == cfg.get("RT", 1)
    assert W.live_m_tiles(2, 8, 2, 8) == 2 and W.live_m_tiles(32, 8, 19, 8) == 8
    assert W.live_m_tiles(128, 8, 24, 16) == 16 and W.live_m_tiles(128, 8, 12, 32) == 8
    assert W.packed_plan(2, 8, 64, 256, 16, 8, W.PACKED_CONFIGS["p8"], 132, 128, 2)["shift"] == 1
    assert W.packed_plan(2, 8, 64, 256, 16, 8, W.PACKED_CONFIGS["p8"], 132, 256, 1)["shift"] == 30


def test_packed_plan_partial_slots():
    """The partials' slots: two halves of as many groups as RED bytes allow (met at one
    barrier), at least one group, never more than the CTA's groups, never past MINB CTAs'
    shared memory."""
    def plan(name, num_sms=132, **over):
        cfg = dict(W.PACKED_CONFIGS[name], **over)
        return W.packed_plan(2, 8, 28672, 4096, 32, 32, cfg, num_sms, 128, 32)
    group = 8 * 2 * 16 * 17 * 4                                  # W RT BM RS fp32 of q16
    assert plan("q16")["RG"] == W.RED_BYTES // (2 * group) == 1
    assert plan("q16")["smem"] == 2 * group
    assert plan("q16", RED=6 * group)["RG"] == 3                  # more room, rarer barriers
    room = W.SMEM_PER_SM // 2 - 1024                             # 2 CTAs per SM
    assert plan("q16", RED=1 << 20)["RG"] == room // (2 * group) == 3
    assert plan("q8", RED=1 << 20)["RG"] == room // group == 6 < plan("q8")["TPC"] // 2
    assert plan("q32", W=8, MINB=2)["RG"] == 1                   # at least one group, past RED
    assert plan("q32", W=8, MINB=2)["smem"] == 4 * group > W.RED_BYTES
    assert plan("q8", num_sms=1)["TPC"] > 2 * plan("q8", num_sms=1)["RG"]


# ----------------------------------------------------------------------------- emulation
def _emulation_entries(names):
    out = []
    for i, n in enumerate(names):
        out.append(
            f'extern "C" void k{i}(unsigned gx, unsigned gy, unsigned block, const void* a, '
            f"const void* wp, void* c, const void* sp, const void* zp, const unsigned* asum, "
            f"const int* st, "
            f"const int* ex, const int* ntp, const float* tw, const float* bias, int N, int K, "
            f"int P, int top_k, int B, int L, int mul, int shift, int G, int dzp, int tpc, "
            f"int rg) {{\n"
            f"    launch3(gx, gy, 1, block, [&] {{ gridDim.z = 1; {n}((const elem_t*)a, "
            f"(const uint4*)wp, (elem_t*)c, (const float2*)sp, (const unsigned short*)zp, asum, st, "
            f"ex, ntp, tw, bias, N, K, P, top_k, B, L, mul, shift, G, dzp, tpc, rg); }});\n}}")
    out.append(
        'extern "C" void chunk_sums(unsigned grid, const void* a, unsigned* asum, int runs) {\n'
        f"    launch(grid, 1, 256, [&] {{ {W.SUMS_KERNEL}((const elem_t*)a, asum, runs); }});\n}}")
    return "\n".join(out)


EMU_NAMES = sorted({W.packed_kernel_name(c, z, d) for c in W.PACKED_CONFIGS.values()
                    for z in (False, True) for d in (1, 2, 4, 8) if d <= c["D"]})


@pytest.fixture(scope="module")
def emulated_packed(tmp_path_factory):
    from test_quant_cupy import build_emulation
    from test_quant_wna16_cupy import W16_PRELUDE

    return build_emulation(tmp_path_factory, "packed", W.CU, _emulation_entries(EMU_NAMES),
                           prelude=W16_PRELUDE)


def emulation_case(rng, shape, gs, zp):
    """Fresh inputs of an emulated int4 GEMM (shape = (M_a, E, top_k, N, Kdim, block_size)):
    a, the quantized weights (wq, ws, wz), the alignment (st, ex, ntp), router weights tw,
    bias, and the reference output (router weights and bias applied)."""
    M_a, E, K, N, Kd, B = shape
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    wq, ws, wz = quantized(rng, E, N, Kd, gs, zp)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, bias, w_scale=ws, w_zp=wz,
                                 use_int4_w4a16=True)
    return a, wq, ws, wz, st, ex, ntp, tw, bias, want


@pytest.mark.simulator
@pytest.mark.parametrize("cfg,shape,gs,zp,sms", [
    ("p8", (2, 4, 2, 32, 2048, 8), 128, False, 132),     # D = 4 ring, K split over 8 warps
    ("s8", (2, 3, 2, 48, 2048, 8), 256, True, 1),        # POST with zero points, 3 tiles per CTA
    ("p8", (3, 2, 2, 32, 576, 8), 64, False, 1),         # 9 chunks over 8 warps: dead chunks
    ("s8", (6, 2, 2, 16, 1024, 16), 1024, True, 132),    # one group per row
    ("v32", (20, 2, 1, 32, 128, 32), 128, True, 1),      # 4 token tiles, some all padding
    ("v32", (20, 2, 1, 32, 576, 32), 64, False, 1),
    ("q8d", (2, 3, 2, 64, 2048, 8), 128, True, 1),       # RT = 2: two tiles per warp group
    ("r16", (9, 2, 2, 32, 576, 16), 64, False, 132),     # RT = 2 with POST
    ("q8", (3, 3, 2, 64, 1152, 8), 128, True, 1),        # RT = 2, zero point per pair
    ("q16", (12, 2, 2, 64, 1024, 16), 128, True, 1),
    # MT = 4: m tiles of 1 to 4 live token tiles (one code path each), a barrier per group
    ("q32", (40, 3, 2, 64, 1024, 32), 128, True, 1),       # 3 or 4 live tiles
    ("q32", (40, 5, 2, 64, 1024, 32), 128, True, 132),     # 2 or 3
    ("q32", (3, 2, 2, 64, 576, 64), 64, False, 132),       # one live tile, padding m tiles
    ("q32", (50, 3, 2, 32, 640, 32), 128, False, 1),       # 1 or 4
    ("q24", (40, 3, 2, 64, 1024, 48), 128, True, 1),       # MT = 3, a ring of one item
    ("q24", (20, 5, 2, 32, 576, 24), 64, False, 132),
    # SR = 1 (the ring in shared memory, cp.async; v32 with POST = 1, the zero-point mma on the
    # chunk sums): zero points through the ring, dead chunks, 1..4 live tiles, one group per row
    ("v24", (3, 3, 2, 64, 1152, 24), 128, True, 1),
    ("v24", (3, 2, 2, 32, 576, 24), 64, False, 1),
    ("v24", (40, 3, 2, 64, 1024, 48), 128, True, 1),
    ("v32", (40, 3, 2, 64, 1024, 32), 128, True, 1),
    ("v32", (50, 3, 2, 32, 640, 32), 128, False, 132),
    ("v32", (6, 2, 2, 32, 1024, 32), 1024, True, 132),
])
@pytest.mark.slow
def test_emulated_matches_reference(emulated_packed, rng, cfg, shape, gs, zp, sms):
    import ctypes

    def p(x):
        return None if x is None else x.ctypes.data_as(ctypes.c_void_p)

    M_a, E, K, N, Kd, B = shape
    a, wq, ws, wz, st, ex, ntp, tw, bias, want = emulation_case(rng, shape, gs, zp)
    pk = W.prepack_int4(wq, ws, wz)
    asum = W.chunk_sums(a) if W.PACKED_CONFIGS[cfg].get("POST") else None
    P, G = M_a * K, ws.shape[2]
    lp = W.packed_plan(P, E, N, Kd, st.size, B, W.PACKED_CONFIGS[cfg], sms, Kd // G, G,
                       wz is not None)
    c = np.full((P, N), 0x7FC0, np.uint16)                         # poison: bf16 NaN
    gx, gy, _ = lp["grid"]
    getattr(emulated_packed, f"k{EMU_NAMES.index(lp['name'])}")(
        gx, gy, lp["block"][0], p(np.ascontiguousarray(a).view(np.uint16)), p(pk["wp"]), p(c),
        p(pk["sp"]), p(pk["zp"]), p(asum), p(st), p(ex), p(ntp), p(tw), p(bias), N, Kd, P, K, B,
        lp["Lg"], 1, lp["shift"], G, 8, lp["TPC"], lp["RG"])
    c_ = W.PACKED_CONFIGS[cfg]
    rings = c_["W"] * lp["D"] * c_.get("RT", 1) * 32 * (28 if zp else 24) if c_.get("SR") else 0
    assert lp["smem"] == rings + 2 * lp["RG"] * c_["W"] * c_.get("RT", 1) * 8 * c_["MT"] * 17 * 4
    err = rel_err(c.view(BF16), want)
    assert err <= TOL, f"{cfg} {shape}: rel_err {err:.3e}"


@pytest.mark.slow
@pytest.mark.simulator
def test_emulated_chunk_sums(emulated_packed, rng):
    """wna16_chunk_sums writes chunk_sums' words bit for bit, and -(hi + lo) carries each
    64-element sum to ~2^-16 of its size (the two bf16 halves of POST's zero-point mma)."""
    import ctypes

    a = (rng.standard_normal((5, 384)) * np.exp(rng.uniform(-6, 6, (5, 1)))).astype(BF16)
    want = W.chunk_sums(a)
    got = np.full(want.shape, 0xFFFFFFFF, np.uint32)                # poison: NaN pairs
    emulated_packed.chunk_sums(C.cdiv(want.size, 256),
                               np.ascontiguousarray(a).view(np.uint16).ctypes.data_as(
                                   ctypes.c_void_p), got.ctypes.data_as(ctypes.c_void_p),
                               want.size)
    assert np.array_equal(got, want)
    pairs = got.view(np.uint16).reshape(*got.shape, 2).view(BF16).astype(np.float64)
    exact = a.astype(np.float64).reshape(5, 6, 64).sum(axis=-1)
    assert np.all(np.abs(-(pairs[..., 0] + pairs[..., 1]) - exact) <=
                  2.0 ** -15 * np.abs(exact) + 1e-30 + 64 * 2.0 ** -24 * np.abs(a.astype(
                      np.float64)).reshape(5, 6, 64).sum(axis=-1))


# ----------------------------------------------------------------------------- GPU


SHAPES = [
    # M_a, E, top_k, N,   Kdim, gs,   zp     (one token; 9 chunks over the warps; a group per
    #                                          row; many rows per expert; long K)
    (1,   4, 2, 64,  256,  128,  False),
    (29,  6, 2, 144, 576,  64,   True),
    (70,  3, 1, 32,  384,  384,  True),
    (40,  2, 2, 48,  4096, 256,  False),
]


def check_matches_reference(rng, shape, cfg, B):
    """grouped_gemm_wna16 with config `cfg` and block size B against the reference on `shape`
    (M_a, E, top_k, N, Kdim, gs, zp): an expert with no tokens, bias and router weights, the
    output poisoned first (also the wgmma rung's check, tests/test_quant_wna16_wgmma.py)."""
    M_a, E, K, N, Kd, gs, zp = shape
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    wq, ws, wz = quantized(rng, E, N, Kd, gs, zp)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    if E > 2:
        ids[ids == E - 1] = 0                    # expert E-1 gets no tokens
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, bias, w_scale=ws,
                                 w_zp=wz, use_int4_w4a16=True)
    out = poisoned((M_a * K, N), BF16)
    got = W.grouped_gemm_wna16(up(a), up(wq), up(st), up(ex), up(ntp), K, B, up(tw), True,
                               up(bias), w_scale=up(ws), w_zp=up(wz), config=cfg, out=out,
                               use_int4_w4a16=True)
    assert got is out
    err = rel_err(host(got, BF16), want)
    assert err <= TOL, f"{cfg}: rel_err {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("cfg", sorted(W.PACKED_CONFIGS))
def test_matches_reference(rng, shape, cfg):
    M_a, E, K, N, Kd, gs, zp = shape
    if (N // 16) % W.PACKED_CONFIGS[cfg].get("RT", 1):
        pytest.skip(f"{cfg}: its RT tiles per group do not divide N / 16 = {N // 16}")
    check_matches_reference(rng, shape, cfg, max(16, 8 * W.PACKED_CONFIGS[cfg]["MT"]))


def check_other_rank(rng, config, B, N):
    """fp16 activations, experts 1 and 3 of 4 on another rank (their rows come back zero), no
    router weights: grouped_gemm_wna16 with `config` and block size B against the reference,
    the output poisoned first (the wgmma and staged rungs' check)."""
    M_a, E, K, Kd = 21, 4, 2, 512
    a, wq, ws, wz, ids, st, ex, ntp, want = other_rank_case(rng, M_a, E, K, N, Kd, B)
    out = poisoned((M_a * K, N), np.float16)
    got = host(W.grouped_gemm_wna16(up(a), up(wq), up(st), up(ex), up(ntp), K, B,
                                    w_scale=up(ws), w_zp=up(wz), use_int4_w4a16=True,
                                    config=config, out=out), np.float16)
    assert (got.reshape(M_a, K, N)[np.isin(ids, [1, 3])] == 0).all()
    assert rel_err(got, want) <= TOL


def check_repeats(rng, config, shape, gs):
    """grouped_gemm_wna16 with `config` on shape (M_a, E, top_k, N, Kdim, B), zero points, bias
    and router weights: parity with the reference, and the same bits on a second launch (a
    rung whose CTAs meet in a workspace adds the parts in a fixed order and resets its
    counters)."""
    M_a, E, K, N, Kd, B = shape
    a, wq, ws, wz, st, ex, ntp, tw, bias, want = emulation_case(rng, shape, gs, True)
    args = (up(a), up(wq), up(st), up(ex), up(ntp), K, B)
    kw = dict(w_scale=up(ws), w_zp=up(wz), use_int4_w4a16=True, config=config,
              topk_weights=up(tw), mul_routed_weight=True, bias=up(bias))
    first = host(W.grouped_gemm_wna16(*args, **kw, out=poisoned((M_a * K, N), BF16)), BF16)
    second = host(W.grouped_gemm_wna16(*args, **kw, out=poisoned((M_a * K, N), BF16)), BF16)
    assert rel_err(first, want) <= TOL
    assert np.array_equal(first.view(np.uint16), second.view(np.uint16))


def spy_configs(monkeypatch):
    """The configs grouped_gemm_wna16 is called with from now on (a list that fills)."""
    seen = []
    real = W.grouped_gemm_wna16

    def spy(*args, **kw):
        seen.append(kw.get("config"))
        return real(*args, **kw)

    monkeypatch.setattr(W, "grouped_gemm_wna16", spy)
    return seen


def other_rank_case(rng, M_a, E, K, N, Kd, B):
    """fp16 activations over E experts of which 0 and 2 are this rank's (every token routes
    to expert 0 first), int4 g128 weights with zero points, no router weights: (a, wq, ws, wz,
    ids, st, ex, ntp, the reference output)."""
    a = rng.standard_normal((M_a, Kd)).astype(np.float16)
    wq, ws, wz = quantized(rng, 2, N, Kd, 128, True)
    emap = np.array([0, -1, 1, -1], dtype=np.int32)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    ids[:, 0] = 0
    st, ex, ntp = moe_align_block_size(ids, B, E, expert_map=emap)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, w_scale=ws, w_zp=wz,
                                 use_int4_w4a16=True)
    return a, wq, ws, wz, ids, st, ex, ntp, want


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", sorted(W.PACKED_CONFIGS))
def test_fp16_other_rank_and_cache(rng, cfg):
    """fp16 activations, experts on another rank (zeros), no router weights; the second call
    reuses the packed weights, forget_packed() drops them, a new array is packed anew."""
    M_a, E, K, N, Kd = 21, 4, 2, 64, 512
    B = max(16, 8 * W.PACKED_CONFIGS[cfg]["MT"])
    a, wq, ws, wz, ids, st, ex, ntp, want = other_rank_case(rng, M_a, E, K, N, Kd, B)
    dw, ds, dz = up(wq), up(ws), up(wz)
    args = (up(a), dw, up(st), up(ex), up(ntp), K, B)
    W.forget_packed()
    for _ in range(2):
        out = poisoned((M_a * K, N), np.float16)
        got = host(W.grouped_gemm_wna16(*args, w_scale=ds, w_zp=dz, use_int4_w4a16=True,
                                        config=cfg, out=out), np.float16)
        assert (got.reshape(M_a, K, N)[np.isin(ids, [1, 3])] == 0).all()
        assert rel_err(got, want) <= TOL
        assert len(W._PACKED) == 1
    W.forget_packed()
    assert not W._PACKED


@pytest.mark.gpu
def test_empty_batch():
    rng = np.random.default_rng(0)
    wq, ws, _ = quantized(rng, 2, 64, 256, 128, False)
    a = np.zeros((0, 256), BF16)
    st, ex, ntp = moe_align_block_size(np.zeros((0, 2), np.int32), 16, 2)
    got = W.grouped_gemm_wna16(up(a), up(wq), up(st), up(ex), up(ntp), 2, 16, w_scale=up(ws),
                               use_int4_w4a16=True, config="p8")
    assert got.shape == (0, 64)


@pytest.mark.gpu
def test_refuses_what_it_cannot_run(rng):
    wq, ws, _ = quantized(rng, 2, 40, 256, 128, False)             # N % 16 != 0
    a = rng.standard_normal((2, 256)).astype(BF16)
    st, ex, ntp = (up(v) for v in moe_align_block_size(
        rng.integers(0, 2, (2, 1)).astype(np.int32), 16, 2))
    with pytest.raises(ValueError, match="packed"):
        W.grouped_gemm_wna16(up(a), up(wq), st, ex, ntp, 1, 16, w_scale=up(ws),
                             use_int4_w4a16=True, config="p8")


def test_route_int4_needs_cupy_arrays_and_a_packable_shape(rng):
    wq, ws, _ = quantized(rng, 2, 32, 256, 128, False)
    a = rng.standard_normal((2, 256)).astype(BF16)
    assert W.route_int4(a, wq, ws, None, None, 2, 16) is None        # NumPy: not routed


@pytest.mark.gpu
def test_grouped_gemm_quant_routes_decode_int4(rng, monkeypatch):
    """quant_gemm.grouped_gemm_quant sends an int4 decode batch to the packed rung (the
    route's config name reaches grouped_gemm_wna16), matches the reference with a poisoned
    output; version="v3" keeps quant_gemm's own rung."""
    from cuda_kernels.cupy import quant_gemm as QG

    M_a, E, K, N, Kd, B = 3, 4, 2, 64, 512, 16
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    wq, ws, _ = quantized(rng, E, N, Kd, 128, False)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, w_scale=ws,
                                 use_int4_w4a16=True)
    seen = spy_configs(monkeypatch)
    args = (up(a), up(wq), up(st), up(ex), up(ntp), K, B, up(tw), True)
    out = poisoned((M_a * K, N), BF16)
    got = QG.grouped_gemm_quant(*args, w_scale=up(ws), use_int4_w4a16=True, out=out)
    assert got is out and seen and seen[0] in W.PACKED_CONFIGS
    assert rel_err(host(got, BF16), want) <= TOL
    seen.clear()
    got = QG.grouped_gemm_quant(*args, w_scale=up(ws), use_int4_w4a16=True, version="v3")
    assert not seen and rel_err(host(got, BF16), want) <= TOL
