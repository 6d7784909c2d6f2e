"""Kernel launches through the driver: programmatic dependent launch (PDL), and FastLaunch.

A kernel launched this way may start while the kernel before it on the stream still runs, once
every CTA of that kernel has executed `griddepcontrol.launch_dependents` (or exited). It must
then execute `griddepcontrol.wait` before it reads anything the earlier kernel writes, or
writes anything that kernel reads (wna16_common.cuh: w16::grid_dependency_wait). What it does
before the wait (loads of data final before both kernels, copies of weights) overlaps the
earlier kernel's last CTAs. Without the attribute both instructions are no-ops, so a kernel
written for it also runs in a plain launch.

CuPy launches through cuLaunchKernel, which takes no launch attributes; `launch` calls the
driver's cuLaunchKernelEx through ctypes with a CUlaunchConfig that holds one attribute,
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (the layouts of cuda.h, CUDA 12 and 13).

`FastLaunch` is a launch whose configuration and parameter block are built once and whose
argument values are rewritten in place at each call (the host's share of a decode step:
cuda_kernels/cupy/experts.py).
"""
from __future__ import annotations

import ctypes

import numpy as np

CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, 4 bytes of padding, a 64-byte value union (an int here)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int), ("value_pad", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


# numpy scalar dtypes -> the C type the kernel parameter has
_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
            np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
            np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


def kernel_params(args) -> list:
    """The ctypes value of each kernel argument, as CuPy would pass it: a device array by its
    pointer, a numpy scalar by its dtype's C type (the kernel's parameter types must match, as
    for CuPy), a one-element host numpy array by its bytes (a struct passed by value: v6's
    CUtensorMap). Anything else (a Python int or float, whose C type would be a guess) is
    refused."""
    values = []
    for i, x in enumerate(args):
        data = getattr(x, "data", None)
        if hasattr(data, "ptr"):                       # a cupy.ndarray
            values.append(ctypes.c_void_p(data.ptr))
        elif isinstance(x, np.ndarray) and x.size == 1:
            values.append((ctypes.c_char * x.nbytes).from_buffer_copy(x.tobytes()))
        elif isinstance(x, np.generic) and x.dtype in _SCALARS:
            values.append(_SCALARS[x.dtype](x.item()))
        else:
            raise TypeError(f"args[{i}]: expected a device array or a numpy scalar of "
                            f"{sorted(str(d) for d in _SCALARS)}, got {type(x).__name__}")
    return values


_DRIVER: dict = {}


def _driver():
    if "lib" not in _DRIVER:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorString.restype = ctypes.c_int
        lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
        _DRIVER["lib"] = lib
    return _DRIVER["lib"]


def launch(kernel, grid, block, args, shared_mem: int = 0, programmatic: bool = False):
    """kernel(grid, block, args, shared_mem=...) on the current CuPy stream; with programmatic,
    through cuLaunchKernelEx with programmatic stream serialization (see the module doc: the
    kernel must wait with griddepcontrol.wait before it touches what the kernel before it on
    the stream writes). kernel: a CuPy RawKernel or module Function. Below sm_90, which has no
    programmatic launch (and whose kernels compile the wait out), it launches plainly."""
    import cupy

    if not programmatic or int(cupy.cuda.Device().compute_capability) < 90:
        kernel(grid, block, args, shared_mem=shared_mem)
        return

    fn = getattr(kernel, "kernel", kernel)             # a RawKernel holds its Function
    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = tuple(block) + (1,) * (3 - len(block))
    attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    cfg = LaunchConfig(*grid, *block, int(shared_mem), cupy.cuda.get_current_stream().ptr,
                       ctypes.pointer(attr), 1)
    values = kernel_params(args)
    params = (ctypes.c_void_p * max(1, len(values)))(
        *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    lib = _driver()
    status = lib.cuLaunchKernelEx(ctypes.byref(cfg), fn.ptr, params, None)
    if status != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(status, ctypes.byref(msg))
        raise RuntimeError(f"cuLaunchKernelEx (programmatic launch of {grid} x {block}): "
                           f"{(msg.value or b'?').decode()} ({status})")


# ----------------------------------------------------------------------------- fast launches
class _Bytes128(ctypes.Structure):
    """A 128-byte kernel parameter passed by value (v6's CUtensorMap): `.value = array` copies
    the bytes of a 128-byte host NumPy array into the slot. The array the slot last copied is
    not copied again (`array.ctypes` costs microseconds a call, and a plan passes the same
    tensor map at every call: experts.py builds a new one when the weights move and never
    changes one in place)."""
    _fields_ = [("raw", ctypes.c_char * 128)]
    _source = None

    @property
    def value(self):
        return ctypes.string_at(ctypes.addressof(self), 128)

    @value.setter
    def value(self, array):
        if array is self._source:
            return
        if array.nbytes != 128:
            raise ValueError(f"a 't' argument: expected 128 bytes, got {array.nbytes}")
        ctypes.memmove(ctypes.addressof(self), array.ctypes.data, 128)
        self._source = array


class FastLaunch:
    """One kernel's launch with everything but the argument values fixed: the driver's
    cuLaunchKernelEx called through ctypes with a prebuilt launch configuration (grid, block,
    shared memory, the cooperative attribute) and parameter block, whose slots are rewritten
    in place at each call.

        launch = FastLaunch(kernel, grid, block, shared_mem, "pppiif")   # p pointer, i int32,
        launch(stream_ptr, x_ptr, y_ptr, z_ptr, n, m, 0.5)               # f float32, t 128
                                                                          # bytes (a NumPy array)
        # arguments that never change (sizes, workspace pointers) set once: a call passes
        # the others, in order
        launch = FastLaunch(kernel, grid, block, shared_mem, "pppiif", fixed={3: n, 4: m})
        launch(stream_ptr, x_ptr, y_ptr, z_ptr, 0.5)

    Why: CuPy's launcher converts each argument into a C value at every call, which took
    8-10 us per 16-argument launch on the H100 machine's host (its own measurement); a
    decode step launches five kernels whose GPU work is tens of microseconds. Here a launch is
    the slot stores, the stream stored in the configuration, and one ctypes call of four
    arguments (ctypes converts each argument of a call: cuLaunchKernel's eleven cost more),
    and the slots of `fixed` arguments are stored once.
    The stream is a raw cudaStream_t (torch's or CuPy's), so a CUDA graph capture on that
    stream records the launch like any other."""

    _CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int32, "f": ctypes.c_float, "t": _Bytes128}

    def __init__(self, kernel, grid, block, shared_mem: int, signature: str,
                 cooperative: bool = False, fixed: dict | None = None):
        fn = getattr(kernel, "kernel", kernel)         # a RawKernel holds its Function
        self.fn = ctypes.c_void_p(int(fn.ptr))
        self._keep = fn
        self.grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        self.shared_mem = int(shared_mem)
        self.cooperative = bool(cooperative)
        self.slots = [self._CTYPES[c]() for c in signature]
        self.params = (ctypes.c_void_p * max(1, len(self.slots)))(
            *[ctypes.cast(ctypes.pointer(s), ctypes.c_void_p) for s in self.slots])
        self.signature = signature
        fixed = fixed or {}
        if not all(0 <= i < len(signature) for i in fixed):
            raise ValueError(f"fixed: expected argument indices in [0, {len(signature)}), got "
                             f"{sorted(fixed)}")
        for i, v in fixed.items():
            self.slots[i].value = v
        self._free = [slot for i, slot in enumerate(self.slots) if i not in fixed]
        # cuLaunchCooperativeKernel's grid-wide co-residency, as a launch attribute
        self._attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_COOPERATIVE, value=1)
        self.config = LaunchConfig(*self.grid, *self.block, self.shared_mem, None,
                                   ctypes.pointer(self._attr) if cooperative else None,
                                   1 if cooperative else 0)
        self._config = ctypes.pointer(self.config)
        self._launch = _driver().cuLaunchKernelEx

    def __call__(self, stream_ptr: int, *values):
        """Launch on `stream_ptr` with the arguments that are not fixed, in order."""
        for slot, v in zip(self._free, values):
            slot.value = v
        self.config.hStream = stream_ptr
        status = self._launch(self._config, self.fn, self.params, None)
        if status != 0:
            msg = ctypes.c_char_p()
            _driver().cuGetErrorString(status, ctypes.byref(msg))
            raise RuntimeError(f"cuLaunchKernelEx ({self.grid} x {self.block}, "
                               f"{self.shared_mem} B shared): "
                               f"{(msg.value or b'?').decode()} ({status})")
