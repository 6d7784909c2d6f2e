"""Activation quantization on the GPU (cuda_kernels/cupy/quant/act.py, act.cu) against
reference/quant.py: codes and scales bit for bit.

CPU: the launcher registers a compile case per input dtype (tests/cupy/test_nvrtc.py compiles
them). CPU emulation (`simulator`, slow): act.cu built by g++ with the emulator of
tests/emulator, every mode bit-exact, NaN confined to its group.
GPU (`gpu` marker): every mode and input dtype bit-exact (empty inputs too), static scales
from the host or the device, NaN confined to its group, argument errors.

Shape legend: M rows, Kdim columns, G = cdiv(Kdim, group_size) groups per row.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy.quant import act as QA
from tests.emulator import library_fixture, ptr
from tests.quant_support import BF16, FP8, host, up
from reference import quant as RQ


# ----------------------------------------------------------------------------- CPU
def test_registers_a_case_per_input_dtype():
    cases = [c for c in C.COMPILE_CASES if c.cu_name == QA.CU]
    assert {c.defines["IN_T"] for c in cases} == {"float", "__half", "__nv_bfloat16"}
    assert {n for c in cases for n in (c.name_expressions or ())} == set(QA._NAMES)


# ----------------------------------------------------------------------------- GPU
ACT_MODES = [
    # name,            reference call and GPU call get (x, a_scale)
    ("fp8_group",       dict(quant_dtype="fp8", block_shape=[128, 128])),
    ("fp8_group_ue8m0", dict(quant_dtype="fp8", block_shape=[128, 128], use_ue8m0=True)),
    ("fp8_token",       dict(quant_dtype="fp8", per_act_token_quant=True)),
    ("fp8_tensor",      dict(quant_dtype="fp8")),
    ("int8_token",      dict(quant_dtype="int8", per_act_token_quant=True)),
    ("int8_group",      dict(quant_dtype="int8", block_shape=[128, 128])),
    ("int8_tensor",     dict(quant_dtype="int8")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,kw", ACT_MODES, ids=[m[0] for m in ACT_MODES])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16), np.dtype(np.float32)],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 128), (37, 384), (5, 200), (0, 256)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_bit_exact(rng, name, kw, dtype, shape):
    M, K = shape
    x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 20, (M, 1))).astype(dtype)
    rq, rs = RQ.moe_kernel_quantize_input(x, None, **kw)
    gq, gs = QA.moe_kernel_quantize_input(up(x), None, **kw)
    gq = host(gq)
    assert gq.shape == rq.shape
    assert np.array_equal(gq.view(np.uint8), rq.view(np.uint8)), "codes differ"
    assert np.array_equal(host(gs).reshape(rs.shape), rs), "scales differ"


@pytest.mark.gpu
@pytest.mark.parametrize("qd", ["fp8", "int8"])
def test_static_scale(rng, qd):
    x = rng.standard_normal((9, 256)).astype(BF16)
    s = np.float32([0.013])
    rq, rs = RQ.moe_kernel_quantize_input(x, s, qd)
    for scale in (s, up(s)):                   # host scalar or device array
        gq, gs = QA.moe_kernel_quantize_input(up(x), scale, qd)
        assert np.array_equal(host(gq).view(np.uint8), rq.view(np.uint8))
        assert host(gs).tolist() == rs.tolist()


@pytest.mark.gpu
def test_nan_stays_in_its_group(rng):
    x = rng.standard_normal((4, 384)).astype(BF16)
    x[2, 140] = np.nan
    q, s = QA.per_token_group_quant_fp8(up(x), 128)
    deq = RQ.dequantize_activation(host(q, np.uint8).view(FP8), host(s), 128)
    assert np.isnan(deq[2, 128:256]).all()
    mask = np.ones(deq.shape, bool)
    mask[2, 128:256] = False
    assert np.isfinite(deq[mask]).all()


@pytest.mark.gpu
def test_argument_errors(rng):
    x = up(rng.standard_normal((4, 256)).astype(BF16))
    with pytest.raises(ValueError, match="group_size"):
        QA.per_token_group_quant_fp8(x, 100)
    with pytest.raises(TypeError, match="x"):
        QA.per_token_group_quant_fp8(host(x), 128)
    with pytest.raises(ValueError, match="quant_dtype"):
        QA.moe_kernel_quantize_input(x, None, "int4")
    with pytest.raises(ValueError, match="a_scale"):
        QA.moe_kernel_quantize_input(x, np.float32([1]), "fp8", block_shape=[128, 128])


# ----------------------------------------------------------------------------- emulation
_ENTRY = r"""
extern "C" void gq(int qt, unsigned grid, const IN_T* x, unsigned char* q, float* s,
                   const float* st, const float* ta, int M, int K, int gs, int G, float qmax,
                   float eps, float mins, int ue) {
    if (qt == 0) launch(dim3(grid, 1), WARPS_PER_BLOCK * 32, 0, [&] {
        group_quant_kernel<0>(x, q, s, st, ta, M, K, gs, G, qmax, eps, mins, ue); });
    else launch(dim3(grid, 1), WARPS_PER_BLOCK * 32, 0, [&] {
        group_quant_kernel<1>(x, q, s, st, ta, M, K, gs, G, qmax, eps, mins, ue); });
}
extern "C" void amax(unsigned grid, const IN_T* x, unsigned* bits, long long n) {
    launch(dim3(grid, 1), 256, 0, [&] { absmax_kernel(x, bits, n); });
}"""


emulated = library_fixture(QA.CU, (QA._defines(BF16), _ENTRY))   # act.cu with bf16 input


def emulated_act_quant(lib, x, qd, group_size, eps, min_scale, ue8m0, static=None,
                       tensor=False):
    """The launch of act.py (geometry, arguments) against the emulated kernels."""
    M, K = x.shape
    G = -(-K // group_size)
    q = np.full((M, K), 0xEE, np.uint8)                   # poisoned
    s = np.full((1,) if (static is not None or tensor) else (M, G), np.nan, np.float32)
    ta = None
    if tensor:
        bits = np.zeros(1, np.uint32)
        lib.amax(ctypes.c_uint(3), ptr(x.view(np.uint16)), ptr(bits), ctypes.c_longlong(x.size))
        ta = bits.view(np.float32)
    st = None if static is None else np.asarray(static, np.float32)
    wpb = QA.CONFIGS["group_quant_kernel"]["WARPS_PER_BLOCK"]
    lib.gq(QA.QT[qd], ctypes.c_uint(-(-(M * G) // wpb)), ptr(x.view(np.uint16)), ptr(q),
           ptr(s), ptr(st), ptr(ta), M, K, group_size, G,
           ctypes.c_float(448.0 if qd == "fp8" else 127.0), ctypes.c_float(eps),
           ctypes.c_float(min_scale), int(ue8m0))
    if static is not None:
        s = st
    return q, s


EMU_MODES = [
    # name, reference kwargs, (quant dtype, group size (None: the row), eps, min scale, ue8m0)
    ("fp8_group", dict(quant_dtype="fp8", block_shape=[128, 128]), ("fp8", 128, 1e-10, 0.0, 0)),
    ("fp8_group_ue8m0", dict(quant_dtype="fp8", block_shape=[128, 128], use_ue8m0=True),
     ("fp8", 128, 1e-10, 0.0, 1)),
    ("fp8_token", dict(quant_dtype="fp8", per_act_token_quant=True),
     ("fp8", None, 0.0, QA.FP8_MIN_SCALE, 0)),
    ("int8_token", dict(quant_dtype="int8", per_act_token_quant=True),
     ("int8", None, 1e-10, 0.0, 0)),
    ("int8_group", dict(quant_dtype="int8", block_shape=[128, 128]), ("int8", 128, 1e-10, 0.0, 0)),
]


@pytest.mark.simulator
@pytest.mark.slow
def test_emulated_bit_exact(emulated):
    rng = np.random.default_rng(11)
    for M, K in ((3, 384), (2, 200)):                   # 200: a partial last group
        x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 20, (M, 1))).astype(BF16)
        for name, rkw, (qd, gs, eps, mins, ue) in EMU_MODES:
            rq, rs = RQ.moe_kernel_quantize_input(x, None, **rkw)
            gq, gs_ = emulated_act_quant(emulated, x, qd, gs or K, eps, mins, ue)
            assert np.array_equal(gq, rq.view(np.uint8)), f"{name} {M}x{K}: codes"
            assert np.array_equal(gs_.reshape(rs.shape), rs), f"{name} {M}x{K}: scales"
        rq, rs = RQ.moe_kernel_quantize_input(x, None, "fp8")            # dynamic per-tensor
        gq, gs_ = emulated_act_quant(emulated, x, "fp8", K, 0.0, QA.FP8_MIN_SCALE, 0,
                                     tensor=True)
        assert np.array_equal(gq, rq.view(np.uint8)) and np.array_equal(gs_, rs)
        rq, rs = RQ.moe_kernel_quantize_input(x, np.float32([0.02]), "int8")   # static
        gq, _ = emulated_act_quant(emulated, x, "int8", K, 0.0, 0.0, 0, static=[0.02])
        assert np.array_equal(gq, rq.view(np.uint8))
    x = rng.standard_normal((2, 256)).astype(BF16)
    x[1, 3] = np.nan                                    # NaN: its group's scale and codes
    gq, gs_ = emulated_act_quant(emulated, x, "fp8", 128, 1e-10, 0.0, 0)
    deq = RQ.dequantize_activation(gq.view(FP8), gs_, 128)
    assert np.isnan(deq[1, :128]).all() and np.isfinite(deq[0]).all() and \
        np.isfinite(deq[1, 128:]).all()
