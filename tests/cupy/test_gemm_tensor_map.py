"""v6's TMA tensor map (cuda_kernels/cupy/gemm_tensor_map.py): the fields extra_args encodes
and hands to the driver (CPU, the driver replaced), and the ctypes encoding against
cuda.bindings' (GPU).
"""
from __future__ import annotations

import types

import numpy as np
import pytest

from cuda_kernels.cupy import gemm as gg
from cuda_kernels.cupy import gemm_configs as gcfg
from cuda_kernels.cupy import gemm_tensor_map as gtmap
from tests.cupy.fake_cupy import FakeArray
from tests.oracles import BF16


def test_v6_tensor_map_encoding(monkeypatch):
    """extra_args' CUtensorMap: w [E, N, Kdim] viewed 3-D (Kdim, N, E innermost first), strides
    in bytes, a box of 64 x BLOCK_N x 1, 128-byte swizzle, zero fill; encoded once per (w, shape,
    tile) by the driver's cuTensorMapEncodeTiled (through ctypes), passed as a one-element array
    of its 128 bytes (by value)."""
    import ctypes

    from cuda_kernels.cupy import _launch

    calls = []

    def fake_encode(tmap, dtype, rank, ptr, dims, strides, box, estrides, interleave, swizzle,
                    l2, oob):
        r = rank.value
        calls.append((dtype.value, r, ptr.value, list(dims), list(strides), list(box),
                      list(estrides), interleave.value, swizzle.value, oob.value))
        ctypes.cast(tmap, ctypes.POINTER(ctypes.c_uint64))[0] = 0xABC   # the driver writes it
        return 0

    monkeypatch.setattr(_launch, "_driver",
                        lambda: types.SimpleNamespace(cuTensorMapEncodeTiled=fake_encode))
    monkeypatch.setattr(gtmap, "_TENSOR_MAPS", {})
    w = np.zeros((8, 300, 200), BF16).view(FakeArray)          # [E, N, Kdim]
    cfg = gcfg.fit_config("v6", "bf16", gcfg.heuristic_config("v6", "bf16", 4096), 128)
    (tmap,) = gg.extra_args("v6", cfg, dev=0, w=w)
    assert gtmap.v6_tensor_map(w.ctypes.data, w.shape, "bf16", cfg, 0) is tmap   # cached
    assert len(calls) == 1
    assert isinstance(tmap, np.ndarray) and tmap.size == 1 and tmap.nbytes == 128
    assert tmap.view(np.uint64)[0] == 0xABC                     # the driver's bytes, passed on
    dtype, rank, ptr, dims, strides, box, estrides, interleave, swizzle, oob = calls[0]
    assert dtype == 9 and rank == 3                             # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    assert ptr == w.ctypes.data and dims == [200, 300, 8] and strides == [400, 400 * 300]
    assert box == [64, cfg["BLOCK_N"], 1] and estrides == [1, 1, 1]
    assert (interleave, swizzle, oob) == (0, 3, 0)              # none, 128-byte swizzle, zeros
    gg.extra_args("v6", dict(cfg, BLOCK_N=128), dev=0, w=w)
    assert len(calls) == 2                                      # another tile: another map


@pytest.mark.gpu
def test_v6_tensor_map_is_the_driver_bindings_map():
    """The ctypes encoding gives the same 128 bytes as cuda.bindings' (where it is installed)."""
    cp = pytest.importorskip("cupy")
    driver = pytest.importorskip("cuda.bindings.driver")
    if not gg._compile.is_sm90(0):
        pytest.skip("v6 runs on sm_90 only")
    w = cp.zeros((4, 300, 200), dtype=cp.float16)
    cfg = gcfg.fit_config("v6", "fp16", gcfg.heuristic_config("v6", "fp16", 4096), 128)
    fields = gtmap.v6_tensor_map_fields(w.shape, "fp16", cfg)
    ours = gtmap._encode_tensor_map(fields, w.data.ptr).view(np.uint64)
    err, tmap = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, w.data.ptr,
        [driver.cuuint64_t(x) for x in fields["dims"]],
        [driver.cuuint64_t(x) for x in fields["strides"]],
        [driver.cuuint32_t(x) for x in fields["box"]],
        [driver.cuuint32_t(x) for x in fields["element_strides"]],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    assert err == driver.CUresult.CUDA_SUCCESS
    assert ours.tolist() == [int(x) for x in tmap.opaque]
