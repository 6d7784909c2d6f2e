"""NumPy behind CuPy's names, for the host logic of the CuPy launchers on a CPU (put in
sys.modules["cupy"] by monkeypatch):

    FakeArray           a NumPy array answering the few CuPy attributes a launcher reads
                        (device, data.ptr, get)
    launcher_cupy(sms)  a `cupy` with FakeArray allocations (poisoned: NaN floats, 0x5A bytes
                        otherwise) and one compute capability 9.0 device of `sms` SMs: the
                        launcher's checks, configs, geometry and argument tuples run as on a
                        GPU, and the kernel is whatever the test puts in place of get_kernel
    numpy_cupy()        NumPy itself as `cupy`, CUDA events on the host clock, an H100 as the
                        device: what the benchmark helpers (tune.decode_bench) call
"""
from __future__ import annotations

import time
import types

import numpy as np


class FakeArray(np.ndarray):
    """A NumPy array that answers the few CuPy attributes the launcher reads."""

    @property
    def device(self):
        return types.SimpleNamespace(id=0)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def get(self):
        return np.asarray(self)


def _poisoned_empty(shape, dtype=np.float32):
    """np.empty, poisoned: NaN for floats, 0x5A bytes otherwise (nothing may read it unwritten)."""
    out = np.empty(shape, dtype)
    out.view(np.uint8)[...] = 0xFF if np.dtype(dtype).kind == "f" else 0x5A
    return out.view(FakeArray)


def launcher_cupy(sms: int):
    class Device:
        compute_capability = "90"                           # (v5 / v6 check it)

        def __init__(self, dev=0):
            self.id = dev
            self.attributes = {"MultiProcessorCount": sms}  # v6's persistent grid

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake = types.ModuleType("cupy")
    fake.ndarray = FakeArray
    fake.asarray = lambda x, dtype=None: np.array(x, dtype=dtype).view(FakeArray)
    fake.empty = _poisoned_empty
    fake.zeros = lambda shape, dtype=np.float32: np.zeros(shape, dtype).view(FakeArray)
    fake.ascontiguousarray = lambda x: np.ascontiguousarray(x).view(FakeArray)
    for name in ("uint8", "uint16", "uint32", "int32", "float16", "float32"):
        setattr(fake, name, getattr(np, name))
    fake.cuda = types.SimpleNamespace(
        Device=Device,
        runtime=types.SimpleNamespace(getDeviceProperties=lambda dev: {"name": b"CPU emulator"}))
    return fake


def numpy_cupy():
    fake = types.ModuleType("cupy")
    fake.__getattr__ = lambda name: getattr(np, name)
    fake.ndarray = np.ndarray

    class Event:
        t = 0.0

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

    fake.cuda = types.SimpleNamespace(
        Event=Event, get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3 + 1e-3,
        Device=lambda *a: types.SimpleNamespace(id=0),
        runtime=types.SimpleNamespace(getDeviceProperties=lambda d: {
            "name": b"NVIDIA H100 80GB HBM3", "l2CacheSize": 1 << 20},
            getDevice=lambda: 0, deviceSynchronize=lambda: None))
    fake.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    return fake
