"""cuda_kernels/cupy/_launch.py, the programmatic (PDL) launch through cuLaunchKernelEx.

CPU (always): the ctypes structures have cuda.h's layout (CUlaunchAttribute 72 bytes, its value
at 8; CUlaunchConfig 56 bytes, hStream at 32, attrs at 40, numAttrs at 48), and kernel
arguments turn into the C types CuPy would pass, or a clear error; FastLaunch writes its fixed
arguments once. GPU: the chained launch is tested on the kernel that uses it
(tests/cupy/quant/test_wna16_staged.py).
"""
from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

from cuda_kernels.cupy import _launch as L


def test_structures_have_the_driver_layout():
    assert ctypes.sizeof(L.LaunchAttribute) == 72 and L.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(L.LaunchConfig) == 56
    assert (L.LaunchConfig.sharedMemBytes.offset, L.LaunchConfig.hStream.offset,
            L.LaunchConfig.attrs.offset, L.LaunchConfig.numAttrs.offset) == (24, 32, 40, 48)


class _DeviceArray:                       # what the marshalling reads of a cupy.ndarray
    class data:
        ptr = 0x7F0012345600


def test_kernel_params_follow_the_argument_types():
    vals = L.kernel_params((_DeviceArray(), np.int32(-3), np.uint64(0), np.float32(1.5),
                            np.int64(1 << 40)))
    assert [type(v) for v in vals] == [ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64,
                                       ctypes.c_float, ctypes.c_int64]
    assert vals[0].value == 0x7F0012345600 and vals[1].value == -3 and vals[3].value == 1.5
    assert vals[4].value == 1 << 40


def test_kernel_params_pass_a_one_element_host_array_by_value():
    """v6's CUtensorMap: 128 bytes by value, as CuPy passes a size-one NumPy array."""
    tmap = np.arange(16, dtype=np.uint64).view(np.dtype((np.void, 128)))
    vals = L.kernel_params((np.int32(1), tmap))
    assert ctypes.sizeof(vals[1]) == 128 and bytes(vals[1]) == tmap.tobytes()


def test_fast_launch_slot_of_128_bytes():
    """FastLaunch's 't' slot (v6's CUtensorMap): the array's 128 bytes, copied in place."""
    slot = L.FastLaunch._CTYPES["t"]()
    tmap = np.arange(16, dtype=np.uint64).view(np.dtype((np.void, 128)))
    slot.value = tmap
    assert ctypes.sizeof(slot) == 128 and slot.value == tmap.tobytes()
    # a new map (the weights moved) is copied; the same map object again is not (a plan
    # never changes a tensor map in place: that copy is the host time of a decode call)
    moved = np.arange(16, 32, dtype=np.uint64).view(np.dtype((np.void, 128)))
    slot.value = moved
    assert slot.value == moved.tobytes()
    moved.view(np.uint64)[:] = 0
    slot.value = moved
    assert slot.value == np.arange(16, 32, dtype=np.uint64).tobytes()
    slot.value = tmap
    assert slot.value == tmap.tobytes()
    with pytest.raises(ValueError, match="128 bytes"):
        slot.value = np.zeros(4, np.uint64)


@pytest.mark.parametrize("bad", [3, 1.5, None, np.int8(1), np.zeros(2, np.float32)])
def test_kernel_params_refuse_what_has_no_fixed_c_type(bad):
    with pytest.raises(TypeError, match=r"args\[1\]: expected a device array or a numpy scalar"):
        L.kernel_params((np.int32(1), bad))


def test_fast_launch_sets_fixed_arguments_once(monkeypatch):
    """FastLaunch: the fixed arguments' slots are written at construction, a call writes the
    others in order and the stream into the launch configuration, and the driver's
    cuLaunchKernelEx gets every slot of the parameter block; a fixed index
    outside the signature is refused by name before the driver is touched."""
    seen = []

    def fake_launch(config, fn, params, extra):
        cfg = config.contents
        assert (cfg.gridDimX, cfg.blockDimX, cfg.numAttrs) == (2, 32, 0)
        slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        p = [slots[i] for i in range(4)]
        seen.append((cfg.hStream, ctypes.c_void_p.from_address(p[0]).value,
                     ctypes.c_int32.from_address(p[1]).value,
                     ctypes.c_int32.from_address(p[2]).value,
                     ctypes.c_float.from_address(p[3]).value))
        return 0

    monkeypatch.setattr(L, "_driver",
                        lambda: types.SimpleNamespace(cuLaunchKernelEx=fake_launch))
    kernel = types.SimpleNamespace(ptr=1234)
    launch = L.FastLaunch(kernel, (2,), (32,), 0, "piif", fixed={1: 7, 2: -3})
    launch(99, 0xBEEF, 0.5)
    launch(98, 0xCAFE, 1.5)
    assert seen == [(99, 0xBEEF, 7, -3, 0.5), (98, 0xCAFE, 7, -3, 1.5)]
    with pytest.raises(ValueError, match="fixed: expected argument indices in \\[0, 4\\)"):
        L.FastLaunch(kernel, (2,), (32,), 0, "piif", fixed={4: 1})
