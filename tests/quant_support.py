"""What the tests of the quantized kernels (cuda_kernels/cupy/quant/) share, so that the test
modules import this and not each other:

    the CPU emulation   rung_emulations (the fixture of a ladder's rungs on the CPU emulator
                        of tests/emulator, each built on first use), BF16_BUILD, the entry
                        points' shared parameters (ROUTING_*, SIZE_*, INT4_*)
    the GPU helpers     up (NumPy -> CuPy, fp8 as its bytes), host, poisoned (an output filled
                        with NaN first)
    operands            w8a8_operands, wna16_operands, int4_case: random quantized problems
    int4 checks         check_matches_reference, check_other_rank, check_repeats: what the
                        prepacked int4 rungs (v4-v6) each run on a GPU

The emulation: NVRTC proves that the sources compile; this runs them, on the emulator every
CuPy kernel runs on (tests/emulator: a std::thread per CUDA thread, cp.async landing only at
its wait, mma.sync and wgmma by the PTX ISA's layouts, griddepcontrol.wait as the contract of a
programmatic launch). The only code not run as written is each rung's block of inline-PTX
helpers (left out under QG_EMULATED_PTX; tests/emulator/kernels.h has them). It cannot see
timing, bank conflicts or the hardware's own reading of the PTX: the GPU tests stay the judge.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cuda_kernels.cupy import _arrays as A
from tests.emulator import build_library, entries
from tests.oracles import rel_err
from reference import moe_align_block_size
from reference import quant as RQ

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = RQ.FP8_DTYPE


# ----------------------------------------------------------------------------- GPU helpers
def up(x):
    """NumPy -> CuPy; fp8 travels as its bytes."""
    if x is None:
        return None
    if isinstance(x, np.ndarray) and x.dtype == FP8:
        from cuda_kernels.cupy.quant.act import fp8_to_device
        return fp8_to_device(x)
    return A.to_device(np.asarray(x))


def host(x, dtype=None):
    h = A.to_host(x)
    if dtype is not None and h.dtype != dtype:
        h = h.view(dtype)          # uint16 bytes of bf16, uint8 bytes of fp8
    return h


def poisoned(shape, dtype):
    out = A.empty(shape, dtype)
    A.raw(out).view(np.uint16 if np.dtype(dtype).itemsize == 2 else np.uint32).fill(
        0x7FC0 if np.dtype(dtype) == BF16 else 0x7E00)   # bf16 / fp16 quiet NaN
    return out


# ----------------------------------------------------------------------------- emulation
BF16_BUILD = {"ELEM_BF16": 1}     # the 16-bit element of an emulated build: bf16

# The entry-point parameters every quantized GEMM rung takes after its operand pointers: the
# routing arrays and the sizes, as C declarations and as the kernels' arguments.
ROUTING_PARAMS = "const int* st, const int* ex, const int* ntp, const float* tw, const float* bias"
ROUTING_ARGS = "st, ex, ntp, tw, bias"
SIZE_PARAMS = "int N, int K, int P, int top_k, int B, int L, int mul"
SIZE_ARGS = "N, K, P, top_k, B, L, mul"
# ... and the prepacked int4 rungs' (v4-v6) operands and their extra sizes
INT4_PARAMS = "const void* a, const void* wp, void* c, const void* sp, const void* zp"
INT4_ARGS = "(const uint4*)wp, (elem_t*)c, (const float2*)sp, (const unsigned short*)zp"   # after a


def rung_emulations(tag, cu_by_rung, names_by_rung, params, args):
    """A module-scoped fixture giving get(rung): the emulation of that rung's .cu (bf16
    elements; the entry points tests.emulator.entries(names, params, args)), built by
    tests.emulator on first use and kept."""
    @pytest.fixture(scope="module")
    def emulation(tmp_path_factory):
        libs = {}

        def get(rung):
            if rung not in libs:
                libs[rung] = build_library(tmp_path_factory.mktemp(f"{tag}{rung}"),
                                           cu_by_rung[rung], BF16_BUILD,
                                           entries(names_by_rung[rung], params, args))
            return libs[rung]
        return get
    return emulation


# ----------------------------------------------------------------------------- operands
def routed(rng, M_a, E, K, N, B):
    """A random routing of M_a rows to top-K of E experts (expert E - 1 gets none when E > 2),
    its alignment for block size B, router weights and a bias [E, N]:
    (ids, tw, bias, sorted_token_ids, expert_ids, num_tokens_post_padded)."""
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    if E > 2:
        ids[ids == E - 1] = 0                    # expert E-1 gets no tokens
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    return (ids, tw, bias) + tuple(moe_align_block_size(ids, B, E))



W8A8_SCALES = {
    # the w8a8 scale layouts: vLLM's flags, and quantize_weight_fp8 / _int8's granularity
    "block": (dict(block_shape=[128, 128]), "block"),
    "tensor": ({}, "tensor"),
    "channel": (dict(per_act_token_quant=True, per_channel_quant=True), "channel"),
}


def w8a8_operands(rng, fmt, scale, M_a, E, N, Kd, w_scale=0.05):
    """Random a [M_a, Kdim] and w [E, N, Kdim] quantized to `fmt` ("fp8" / "int8") with
    `scale`'s layout: (aq, a_scale, wq, w_scale, the flags of grouped_gemm_quant)."""
    flags, gran = W8A8_SCALES[scale]
    a = rng.standard_normal((M_a, Kd)).astype(BF16)
    w = (rng.standard_normal((E, N, Kd)) * w_scale).astype(BF16)
    aq, as_ = RQ.moe_kernel_quantize_input(a, None, fmt, flags.get("per_act_token_quant", False),
                                           flags.get("block_shape"))
    wq, ws = (RQ.quantize_weight_fp8 if fmt == "fp8" else RQ.quantize_weight_int8)(w, gran)
    return aq, as_, wq, ws, {f"use_{fmt}_w8a8": True, **flags}


def wna16_operands(rng, nbits, group_size, zero_point, M_a, E, N, Kd, signed=False,
                   dtype=BF16):
    """Random activations a [M_a, Kdim] (`dtype`) and weights quantized weight-only: (a, wq,
    w_scale, w_zp or None, the flags of grouped_gemm_quant). group_size 0: one group per row;
    signed: int8 codes (vLLM's ExpertsInt8 layout, no zero points)."""
    import math

    a = rng.standard_normal((M_a, Kd)).astype(dtype)
    w = (rng.standard_normal((E, N, Kd)) * 0.05).astype(BF16)
    gs = math.gcd(group_size, Kd) if group_size else Kd        # a group divides Kdim
    wq, ws, wz = RQ.quantize_weight_wna16(w, nbits, gs, zero_point=zero_point)
    if signed:
        wq = (wq.astype(np.int16) - 128).astype(np.int8)
    flags = dict(use_int4_w4a16=True) if nbits == 4 else dict(use_int8_w8a16=True)
    return a, wq, ws, wz, flags


# ----------------------------------------------------------------------------- int4 checks
# The checks the prepacked int4 rungs (v4 packed, v5 staged, v6 wgmma) run on a GPU, each
# through quant/wna16.py's grouped_gemm_wna16 with a config of the rung.
INT4_SHAPES = [
    # M_a, E, top_k, N,   Kdim, gs,  zp     (one token; 9 chunks over the warps, g64; a group
    #                                         per row; many rows per expert; long K; N % 64 == 0
    #                                         for v6)
    (1,   4, 2, 128, 256,  128,  False),
    (29,  6, 2, 192, 576,  64,   True),
    (70,  3, 1, 64,  384,  384,  True),
    (40,  2, 2, 128, 4096, 128,  False),
]


def int4_case(rng, shape, gs, zp):
    """Fresh inputs of an int4 GEMM (shape = (M_a, E, top_k, N, Kdim, block_size)): a, the
    quantized weights (wq, ws, wz), the alignment (st, ex, ntp), router weights tw, bias, and
    the reference output (router weights and bias applied)."""
    M_a, E, K, N, Kd, B = shape
    a, wq, ws, wz, flags = wna16_operands(rng, 4, gs, zp, M_a, E, N, Kd)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    bias = rng.standard_normal((E, N)).astype(np.float32)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, bias, w_scale=ws, w_zp=wz,
                                 **flags)
    return a, wq, ws, wz, st, ex, ntp, tw, bias, want


def check_matches_reference(rng, shape, config, B, tol=2e-2):
    """grouped_gemm_wna16 with `config` and block size B against the reference on `shape`
    (M_a, E, top_k, N, Kdim, gs, zp): an expert with no tokens, bias and router weights, the
    output poisoned first."""
    from cuda_kernels.cupy.quant.wna16 import grouped_gemm_wna16

    M_a, E, K, N, Kd, gs, zp = shape
    a, wq, ws, wz, flags = wna16_operands(rng, 4, gs, zp, M_a, E, N, Kd)
    ids, tw, bias, st, ex, ntp = routed(rng, M_a, E, K, N, B)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, bias, w_scale=ws,
                                 w_zp=wz, **flags)
    out = poisoned((M_a * K, N), BF16)
    got = grouped_gemm_wna16(up(a), up(wq), up(st), up(ex), up(ntp), K, B, up(tw), True,
                             up(bias), w_scale=up(ws), w_zp=up(wz), config=config, out=out)
    assert got is out
    err = rel_err(host(got, BF16), want)
    assert err <= tol, f"{config}: rel_err {err:.3e}"


def check_other_rank(rng, config, B, N, tol=2e-2):
    """fp16 activations, experts 1 and 3 of 4 on another rank (their rows come back zero),
    every token routed to expert 0 first, no router weights, int4 g128 with zero points:
    grouped_gemm_wna16 with `config` and block size B against the reference, the output
    poisoned first."""
    from cuda_kernels.cupy.quant.wna16 import grouped_gemm_wna16

    M_a, E, K, Kd = 21, 4, 2, 512
    a, wq, ws, wz, flags = wna16_operands(rng, 4, 128, True, M_a, 2, N, Kd, dtype=np.float16)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    ids[:, 0] = 0
    st, ex, ntp = moe_align_block_size(ids, B, E, expert_map=np.array([0, -1, 1, -1], np.int32))
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, w_scale=ws, w_zp=wz, **flags)
    out = poisoned((M_a * K, N), np.float16)
    got = host(grouped_gemm_wna16(up(a), up(wq), up(st), up(ex), up(ntp), K, B,
                                  w_scale=up(ws), w_zp=up(wz), config=config, out=out),
               np.float16)
    assert (got.reshape(M_a, K, N)[np.isin(ids, [1, 3])] == 0).all()
    assert rel_err(got, want) <= tol


def check_repeats(rng, config, shape, gs, tol=2e-2):
    """grouped_gemm_wna16 with `config` on shape (M_a, E, top_k, N, Kdim, B), zero points, bias
    and router weights: parity with the reference, and the same bits on a second launch (a
    rung whose CTAs meet in a workspace adds the parts in a fixed order and resets its
    counters)."""
    from cuda_kernels.cupy.quant.wna16 import grouped_gemm_wna16

    M_a, E, K, N, Kd, B = shape
    a, wq, ws, wz, st, ex, ntp, tw, bias, want = int4_case(rng, shape, gs, True)
    args = (up(a), up(wq), up(st), up(ex), up(ntp), K, B)
    kw = dict(w_scale=up(ws), w_zp=up(wz), config=config, topk_weights=up(tw),
              mul_routed_weight=True, bias=up(bias))
    first = host(grouped_gemm_wna16(*args, **kw, out=poisoned((M_a * K, N), BF16)), BF16)
    second = host(grouped_gemm_wna16(*args, **kw, out=poisoned((M_a * K, N), BF16)), BF16)
    assert rel_err(first, want) <= tol
    assert np.array_equal(first.view(np.uint16), second.view(np.uint16))
