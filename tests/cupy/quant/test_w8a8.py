"""The w8a8 ladder (cuda_kernels/cupy/quant/w8a8.py: v1 naive, v2 mma.sync, v3 fp8 decode
streaming, v4 fp8 wgmma) against reference/quant.py.

CPU: each rung's file registers its compile cases (tests/cupy/test_nvrtc.py compiles them),
shared memory fits, the route picks each rung where its measurements put it and refuses
what a rung cannot run. CPU emulation (`simulator`, slow): every rung's .cu built by g++
with the emulator of tests/emulator (v4's wgmma by its definition, through the
descriptors) and run against the reference: block, per-tensor and per-channel scales, partial
K blocks, N not a multiple of the tile, padding-only tiles, a crowded expert.
GPU (`gpu` marker): every config of v2-v4 against the reference on the same quantized
operands (outputs poisoned with NaN first; tolerance: bf16 output rounding 1e-2, and vLLM's
block-fp8 0.035), nasty shapes (N and Kdim not multiples of the tiles, an expert with no
tokens, everything on one expert), experts on another rank (zeros), fp16 output, and the
block-fp8 error against the unquantized product.

Shape legend: M_a activation rows, E experts, K top-k, N output width, Kdim reduction width,
B block size.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy.quant import configs as Q
from cuda_kernels.cupy.quant import w8a8 as W8
from tests.oracles import rel_err
from tests.emulator import ptr
from tests.quant_support import (
    BF16, ROUTING_ARGS, ROUTING_PARAMS, SIZE_ARGS, SIZE_PARAMS, host, poisoned, routed,
    rung_emulations, up, w8a8_operands)
from reference import moe_align_block_size
from reference import quant as RQ

GEMM_TOL = 1e-2      # same quantized operands, another accumulation order: bf16 rounding
FP8_BLOCK_TOL = 0.035


# ----------------------------------------------------------------------------- CPU
def test_each_rung_registers_its_cases():
    by_file = {}
    for c in C.COMPILE_CASES:
        if c.cu_name in W8.CU.values():
            by_file.setdefault(c.cu_name, []).append(c)
    assert set(by_file) == set(W8.CU.values())
    for rung, cu in W8.CU.items():
        assert {c.defines["ELEM_BF16"] for c in by_file[cu]} == {0, 1}
        assert all(set(c.name_expressions) == set(W8.NAMES[rung]) for c in by_file[cu])
        assert all(C.required_arch(c.options) == ("sm_90a" if rung == "v4" else None)
                   for c in by_file[cu])
    assert W8.kernel_name("v2", "int8", Q.CONFIGS["w8a8"]["m16"]) == \
        "w8a8_v2_mma<1, 16, 64, 1, 4, 6>"


def test_smem_budgets():
    for cfg in Q.CONFIGS["w8a8"].values():
        smem = W8.smem_bytes(cfg["rung"], cfg)
        assert smem <= (48 if cfg["rung"] == "v3" else 227) * 1024


def _pick(fmt, rows, B, K, cc, aligned=True, **kw):
    return Q.route(fmt, rows, K, W8.refuses(fmt, cc, K, B, aligned), **kw)[0]


def test_route():
    # decode on an H200: v3, its config by rows per expert and Kdim (DeepSeek-V3 GEMM1 Kdim
    # 7168, GEMM2 2048); larger batches: v4 (block_size a multiple of 64)
    assert _pick("fp8", 8 / 256, 16, 7168, 90) == "gemv8w4u3ll"                  # T=1
    assert _pick("fp8", 128 / 256, 16, 7168, 90) == "gemv8w4u3"                  # T=16
    assert _pick("fp8", 512 / 256, 16, 7168, 90) == "gemv8w4u2m6"                # T=64
    assert _pick("fp8", 8 / 256, 16, 2048, 90) == "gemv8w4u2m6"                  # GEMM2
    assert _pick("fp8", 32.0, 64, 7168, 90) == "wg64"
    # Kdim not a multiple of 128: no v3; block 16: no v4 -> v2
    assert _pick("fp8", 1.0, 16, 320, 90) == "m16"
    # sm_89: v3 yes, v4 no; sm_80: no fp8 tensor cores
    assert _pick("fp8", 1.0, 16, 256, 89) == "gemv8w4u2m6"
    assert _pick("fp8", 32.0, 64, 256, 89) == "m64"
    assert _pick("fp8", 32.0, 64, 256, 80) == "naive"
    # int8: v2 by rows (16 where 64 does not divide the block size), v1 below tiles
    assert _pick("int8", 2.0, 16, 256, 80) == "m16" and _pick("int8", 32.0, 64, 256, 90) == "m64"
    assert _pick("int8", 32.0, 16, 256, 90) == "m16" and _pick("int8", 32.0, 8, 256, 90) == "naive"
    # unaligned rows, Kdim % 16: v1
    assert _pick("fp8", 1.0, 16, 7168, 90, aligned=False) == "naive"
    assert _pick("int8", 1.0, 16, 200, 90) == "naive"
    # asked for: a rung, a config
    assert _pick("fp8", 100.0, 64, 256, 90, version="v3") == "gemv8w4u2m6"
    assert _pick("fp8", 1.0, 128, 256, 90, config="wg64") == "wg64"
    with pytest.raises(ValueError, match="fp8 rung"):
        _pick("int8", 1.0, 16, 256, 90, version="v3")
    with pytest.raises(ValueError, match="block_size a multiple of 64"):
        _pick("fp8", 1.0, 16, 256, 90, config="wg64")
    with pytest.raises(ValueError, match="compute capability 9.0"):
        _pick("fp8", 1.0, 64, 256, 89, version="v4")
    assert W8.default_rung("fp8", 8 / 256, 16, 7168, 90) == "v3 gemv8w4u3ll"
    assert W8.default_rung("fp8", 32.0, 64, 7168, 90) == "v4 wg64"


# ----------------------------------------------------------------------------- GPU
def _need(fmt, rung):
    import cupy

    cc = int(cupy.cuda.Device().compute_capability)
    if fmt == "fp8" and rung in ("v2", "v3", "v4") and cc < 89:
        pytest.skip("fp8 tensor cores need sm_89+")
    if rung == "v4" and cc != 90:
        pytest.skip("v4 (wgmma, sm_90a) runs on compute capability 9.0 only")


FORMATS = [("fp8", "block"), ("fp8", "tensor"), ("fp8", "channel"), ("int8", "channel"),
           ("int8", "block")]
CASES = ([("m16", 16), ("m64", 64)] +
         [(n, B) for n, c in Q.CONFIGS["w8a8"].items() if c["rung"] == "v3" for B in (16, 64)] +
         [("wg64", 64), ("wg64", 128)])
SHAPES = [
    # M_a, E, top_k, N,   Kdim   (v3: Kdim % 128 == 0; v4 also takes a partial last K block)
    (1,   4, 2, 64,  256),
    (37,  6, 3, 200, 384),       # N not a multiple of 16 / 128; experts with several blocks
    (50,  1, 1, 72,  592),       # everything on one expert; Kdim % 128 != 0 (v3: skipped)
]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg,B", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("fmt,scale", FORMATS, ids=[f"{f}-{s}" for f, s in FORMATS])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_config_matches_reference(rng, cfg, B, fmt, scale, shape):
    rung = Q.CONFIGS["w8a8"][cfg]["rung"]
    if rung in ("v3", "v4") and fmt != "fp8":
        pytest.skip(f"{rung} is an fp8 rung")
    if rung == "v3" and shape[4] % 128:
        pytest.skip("v3 streams 128-wide K blocks")
    _need(fmt, rung)
    M_a, E, K, N, Kd = shape
    aq, as_, wq, ws, flags = w8a8_operands(rng, fmt, scale, M_a, E, N, Kd)
    ids, tw, bias, st, ex, ntp = routed(rng, M_a, E, K, N, B)
    want = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, K, B, tw, True, bias, a_scale=as_,
                                 w_scale=ws, **flags)
    out = poisoned((M_a * K, N), BF16)
    got = W8.grouped_gemm_w8a8(up(aq), up(wq), up(st), up(ex), up(ntp), K, B, up(tw), True,
                               up(bias), up(as_), up(ws), fmt, flags.get("per_act_token_quant",
                                                                         False),
                               flags.get("per_channel_quant", False), flags.get("block_shape"),
                               config=cfg, out=out)
    assert got is out
    err = rel_err(host(got, BF16), want)
    assert err <= GEMM_TOL, f"{cfg} {fmt} {scale}: rel_err {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("rung", ["v3", "v4"])
def test_fast_rungs_other_rank_zeros_fp16(rng, rung):
    _need("fp8", rung)
    M_a, E, N, Kd = 23, 4, 136, 256
    B = 64 if rung == "v4" else 16
    aq, as_, wq, ws, flags = w8a8_operands(rng, "fp8", "block", M_a, 2, N, Kd)
    emap = np.array([0, -1, 1, -1], dtype=np.int32)
    ids = rng.integers(0, E, (M_a, 2)).astype(np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E, expert_map=emap)
    want = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, 2, B, a_scale=as_, w_scale=ws,
                                 out_dtype=np.float16, **flags)
    out = poisoned((M_a * 2, N), np.float16)
    got = host(W8.grouped_gemm_w8a8(up(aq), up(wq), up(st), up(ex), up(ntp), 2, B,
                                    a_scale=up(as_), w_scale=up(ws), fmt="fp8",
                                    block_shape=[128, 128], out_dtype=np.float16,
                                    version=rung, out=out), np.float16)
    assert (got.reshape(M_a, 2, N)[np.isin(ids, [1, 3])] == 0).all()
    assert rel_err(got, want) <= GEMM_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("rung", ["v3", "v4"])
def test_fast_rungs_block_error_is_the_formats(rng, rung):
    """Against the unquantized product: the rung adds no error beyond the format's own (the
    reference's error on the same codes, about 3.7% for Gaussian data), and matches the
    reference within vLLM's block-fp8 tolerance (0.035)."""
    _need("fp8", rung)
    M_a, E, K, N, Kd = 33, 4, 2, 256, 512
    B = 64 if rung == "v4" else 16
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    w = (rng.standard_normal((E, N, Kd)) / np.sqrt(Kd)).astype(BF16)
    aq, as_ = RQ.moe_kernel_quantize_input(a, None, "fp8", False, [128, 128])
    wq, ws = RQ.quantize_weight_fp8(w, "block")
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    flags = dict(use_fp8_w8a8=True, block_shape=[128, 128])
    got = host(W8.grouped_gemm_w8a8(up(aq), up(wq), up(st), up(ex), up(ntp), K, B,
                                    a_scale=up(as_), w_scale=up(ws), fmt="fp8",
                                    block_shape=[128, 128], version=rung), BF16)
    ref = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, K, B, a_scale=as_, w_scale=ws, **flags)
    exact = np.einsum("sk,snk->sn", a.astype(np.float64)[np.arange(M_a * K) // K],
                      w.astype(np.float64)[ids.reshape(-1)])
    assert rel_err(got, ref) <= FP8_BLOCK_TOL
    assert rel_err(got, exact) <= 1.05 * rel_err(ref, exact) + 1e-3


# ============================================================================ CPU emulation
# Every rung's .cu on the CPU emulator of tests/emulator; v4's wgmma by its definition, reading
# each operand element through the descriptor (start, stride byte offset, 128-byte swizzle:
# address bits 4-6 XOR bits 7-9) and writing the accumulator fragment layout of the PTX ISA.
# It checks the kernel's own indexing (ring slots, scales, promotion, epilogue), not the
# hardware's reading of the descriptors (the GPU tests do).


# every rung takes the same arguments (pointers, sizes, scale kinds)
PARAMS = ("const void* a, const void* w, void* c, const void* p3, const void* p4, "
          f"{ROUTING_PARAMS}, {SIZE_PARAMS}, int i0, int i1")
ARGS = ("(const u8*)a, (const u8*)w, (elem_t*)c, (const float*)p3, (const float*)p4, "
        f"{ROUTING_ARGS}, {SIZE_ARGS}, i0, i1")


emulation = rung_emulations("w8a8", W8.CU, W8.NAMES, PARAMS, ARGS)   # (bf16 output)


EMU_CASES = [
    # fmt, scale, config, (M_a, E, top_k, N, Kdim, B): partial K blocks, N not a multiple of
    # the tile, tiles smaller than the block
    ("fp8", "block", "naive", (5, 4, 2, 72, 320, 16)),
    ("int8", "channel", "naive", (5, 4, 2, 72, 320, 16)),
    ("fp8", "block", "m16", (5, 4, 2, 72, 320, 32)),
    ("fp8", "block", "m64", (40, 3, 2, 136, 256, 64)),
    ("fp8", "tensor", "m16", (5, 4, 2, 72, 320, 16)),
    ("int8", "channel", "m16", (5, 4, 2, 72, 320, 16)),
    ("int8", "block", "m64", (40, 3, 2, 136, 256, 64)),
    # v3: N not a multiple of 16, a block count not a multiple of WARPS * U, padding-only
    # tiles next to live ones
    ("fp8", "block", "gemv8w4u2m6", (3, 4, 2, 40, 384, 16)),
    ("fp8", "block", "gemv8w4u3", (9, 2, 2, 24, 1280, 16)),
    ("fp8", "channel", "gemv8w4u3", (5, 3, 1, 16, 640, 16)),
    ("fp8", "block", "gemv8w4u3", (6, 4, 2, 40, 2688, 16)),        # 21 blocks: rounds of 3
    ("fp8", "tensor", "gemv8w4u2m6", (4, 2, 2, 32, 256, 32)),
    ("fp8", "channel", "gemv8w4u2m6", (5, 3, 1, 16, 2688, 16)),    # 21 blocks: rounds of 2
    ("fp8", "block", "gemv8w4u3ll", (7, 4, 2, 48, 384, 8)),        # block 8: no padding tiles
    # v4: N not a multiple of BN, a partial last K block, more K blocks than stages, an
    # expert with two m tiles (crowded), a padding-only tile, two m tiles a block
    ("fp8", "block", "wg64", (40, 3, 2, 136, 400, 64)),
    ("fp8", "channel", "wg64", (9, 2, 1, 64, 256, 64)),
    ("fp8", "block", "wg64", (20, 2, 2, 128, 512, 128)),
]


@pytest.mark.simulator
@pytest.mark.slow
@pytest.mark.parametrize("fmt,scale,cfg,shape", EMU_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3][0]}" for c in EMU_CASES])
def test_emulated_matches_reference(emulation, fmt, scale, cfg, shape):
    """W8.geometry's launch of the config's kernel, on the emulation, against the reference
    (the output poisoned with NaN first)."""
    config = Q.CONFIGS["w8a8"][cfg]
    rung = config["rung"]
    rng = np.random.default_rng(zlib.crc32(f"{fmt}{scale}{cfg}{shape}".encode()))
    M_a, E, K, N, Kd, B = shape
    aq, as_, wq, ws, flags = w8a8_operands(rng, fmt, scale, M_a, E, N, Kd)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    if rung == "v4":
        ids[: M_a // 2, 0] = 0                              # a crowded expert
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    want = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, K, B, tw, True, bias, a_scale=as_,
                                 w_scale=ws, **flags)
    assert W8.refuses(fmt, 90, Kd, B, True)(config) is None
    P, L = M_a * K, st.size
    grid, block = W8.geometry(rung, config, min(L, P * B), N)
    kinds = (2, 2) if scale == "block" else (int(scale == "channel"),) * 2
    c = np.full((P, N), 0x7FC0, np.uint16)                 # poisoned: bf16 NaN
    lib = emulation(rung)
    getattr(lib, f"k{W8.NAMES[rung].index(W8.kernel_name(rung, fmt, config))}")(
        grid[0], grid[1], 1, block[0], ptr(np.ascontiguousarray(aq).view(np.uint8)),
        ptr(np.ascontiguousarray(wq).view(np.uint8)), ptr(c),
        ptr(np.ascontiguousarray(as_, np.float32)), ptr(np.ascontiguousarray(ws, np.float32)),
        ptr(st), ptr(ex), ptr(ntp), ptr(tw.ravel()), ptr(bias), N, Kd, P, K, B, L, 1, *kinds)
    assert rel_err(c.view(BF16), want) <= GEMM_TOL
