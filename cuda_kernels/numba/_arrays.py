"""Host-side plumbing shared by the Numba stage modules: array kinds, outputs, argument checks.

A stage takes NumPy arrays or device arrays and returns the kind it was given:

    kind    what came in                         kernels see               returned
    host    numpy.ndarray                        a device copy (to_device) NumPy (copied back)
    numba   numba DeviceNDArray                  the array itself          numba arrays
    cupy    cupy.ndarray                         a zero-copy view (CAI)    CuPy arrays (pooled)
    torch   torch.Tensor on a CUDA device        a zero-copy view (CAI)    torch tensors
    cai     anything with __cuda_array_interface__ a zero-copy view        numba arrays

bf16 travels as `ml_dtypes.bfloat16` (NumPy, CuPy) or `torch.bfloat16`. Numba cannot type
either (`typeof` rejects the ml_dtypes dtype and torch's interface says `<V2`), so kernels
receive the same bytes viewed as uint16 and convert bits <-> fp32 themselves (`_device.py`).
A numba DeviceNDArray cannot hold bf16 at all: bf16 data given as numba arrays must be uint16
views, and bf16 outputs come back as uint16 (`to_host(x, dtype=ml_dtypes.bfloat16)` views them).

Outputs are allocated in the caller's framework (CuPy's and torch's pooled allocators for
their arrays) and written through a numba view, so a stage costs no extra copies.
`poisoned_outputs()` makes every fresh output start as NaN (floats) or POISON_INT (integers),
so a test sees any element that a kernel forgot to write.

Nothing here imports numba at module import time: `import cuda_kernels.numba` works without
numba and without a GPU, and `availability()` says why the kernels cannot run.
"""
from __future__ import annotations

import contextlib
import functools

import ml_dtypes
import numpy as np

from . import _compat  # noqa: F401  (np.row_stack shim, before numba is imported anywhere)
from .._checks import check_int  # noqa: F401  (the stages call A.check_int)

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)
FLOAT_NAMES = "float32, float16 or bfloat16"
INT_DTYPES = (np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.int16), np.dtype(np.int8),
              np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))
POISON_INT = -0x5A5A5A5B          # int32 0xA5A5A5A5: never a valid id, offset or count
POISON_BF16_BITS = 0x7FC0         # a quiet bf16 NaN


# ----------------------------------------------------------------------------- numba, lazily
def cuda():
    """`numba.cuda`, imported after the compatibility shim."""
    from numba import cuda as _cuda
    return _cuda


def is_simulator() -> bool:
    """True when numba runs kernels in the CUDA simulator (NUMBA_ENABLE_CUDASIM=1 at import)."""
    try:
        cuda()
        from numba.cuda.core import config
    except Exception:
        return False
    return bool(config.ENABLE_CUDASIM)


@functools.lru_cache(maxsize=1)
def _availability() -> tuple[bool, str]:
    try:
        cu = cuda()
    except Exception as e:
        return False, (f"numba.cuda is not importable ({type(e).__name__}: {e}); install "
                       "numba-cuda==0.30.* (the 'gpu' or 'kernels-cpu' extra)")
    if is_simulator():
        return True, ("CUDA simulator (NUMBA_ENABLE_CUDASIM=1): kernels run on the CPU, one "
                      "Python thread per CUDA thread, about 2,000 threads a second")
    try:
        if not cu.is_available():
            return False, ("numba.cuda imports but finds no usable CUDA GPU or driver; set "
                           "NUMBA_ENABLE_CUDASIM=1 before numba is imported to run the kernels "
                           "in the CUDA simulator")
        dev = cu.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        major, minor = dev.compute_capability
        return True, f"{name} (compute capability {major}.{minor}) through numba-cuda"
    except Exception as e:
        return False, f"CUDA device not usable through numba ({type(e).__name__}: {e})"


def availability() -> tuple[bool, str]:
    """(True, what runs the kernels) on a CUDA GPU or in the simulator, else (False, why not)."""
    return _availability()


# ----------------------------------------------------------------------------- poisoning
_POISON = [False]


@contextlib.contextmanager
def _set_inside(box: list, value):
    """box[0] = value inside the block, the old value back after it (the module's settings)."""
    old = box[0]
    box[0] = value
    try:
        yield
    finally:
        box[0] = old


def poisoned_outputs(enabled: bool = True):
    """Within the block, every output a stage allocates starts as NaN / POISON_INT."""
    return _set_inside(_POISON, bool(enabled))


# ----------------------------------------------------------------------------- kinds and dtypes
@functools.lru_cache(maxsize=1)
def _torch_dtypes():
    import torch
    to_np = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
             torch.bfloat16: BF16, torch.float64: np.dtype(np.float64),
             torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
             torch.int16: np.dtype(np.int16), torch.int8: np.dtype(np.int8),
             torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_)}
    for name, np_dt in (("uint16", np.uint16), ("uint32", np.uint32)):
        if hasattr(torch, name):
            to_np[getattr(torch, name)] = np.dtype(np_dt)
    return to_np, {v: k for k, v in to_np.items()}


def kind_of(name: str, x) -> str:
    """'host', 'numba', 'cupy', 'torch' or 'cai' (see the module docstring); TypeError else."""
    if isinstance(x, np.ndarray):
        return "host"
    root = type(x).__module__.split(".")[0]
    if root == "cupy" and hasattr(x, "__cuda_array_interface__"):
        return "cupy"
    if root == "torch" and hasattr(x, "is_cuda"):
        if not x.is_cuda:
            raise TypeError(f"{name}: expected a NumPy array or a CUDA array, got a torch tensor "
                            f"on {x.device} (pass .numpy() or .cuda())")
        return "torch"
    if root == "numba":
        return "numba"
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    raise TypeError(f"{name}: expected a NumPy array or a CUDA array (numba, CuPy, torch), "
                    f"got {type(x).__name__}")


def dtype_of(x) -> np.dtype:
    """The logical NumPy dtype of any supported array (torch.bfloat16 -> ml_dtypes.bfloat16)."""
    dt = x.dtype
    if type(x).__module__.split(".")[0] == "torch":
        return _torch_dtypes()[0][dt]
    return np.dtype(dt)


def shape_of(x) -> tuple:
    return tuple(int(s) for s in x.shape)


def size_of(x) -> int:
    return int(np.prod(shape_of(x), dtype=np.int64))


def _storage(dt: np.dtype) -> np.dtype:
    """What a kernel sees for a logical dtype: bf16 as its uint16 bits, the rest unchanged."""
    return np.dtype(np.uint16) if dt == BF16 else dt


def _poison_value(storage: np.dtype, logical: np.dtype):
    if logical == BF16:
        return POISON_BF16_BITS
    if storage.kind == "f":
        return np.nan
    return POISON_INT if storage.itemsize >= 4 else -1


# ----------------------------------------------------------------------------- a stage call
def _view(x):
    """A numba view of a foreign CUDA array, without numba's host-blocking sync.

    CuPy's interface (v3) names its stream, and numba's default is to synchronize that stream
    on the host before every use: a full stall per argument. Every kernel here runs on the
    legacy default stream, which is ordered with CuPy's and torch's default (blocking)
    streams anyway, or on the caller's own stream (`using_stream`), so the sync is skipped.
    """
    return cuda().as_cuda_array(x, sync=False)


# ----------------------------------------------------------------------------- streams
# The stream every kernel of the package launches on: 0 (the legacy default stream) unless a
# caller sets one with `using_stream` (sandbox.streams does, with torch's current stream, so
# that a torch caller's work and a torch.cuda.graph capture see the kernels).
_STREAM: list = [0]


def using_stream(ptr: int):
    """Launch this package's kernels on the CUDA stream `ptr` (a cudaStream_t as an int)
    inside the block."""
    return _set_inside(_STREAM, int(ptr))


@functools.lru_cache(maxsize=16)
def _numba_stream(ptr: int):
    return cuda().external_stream(ptr)


def launch_stream():
    """What a launch passes as its stream: 0, or numba's handle on the stream set by
    `using_stream` (the simulator has no streams: always 0 there)."""
    ptr = _STREAM[0]
    if ptr == 0 or is_simulator():
        return 0
    return _numba_stream(ptr)


class Call:
    """One stage call: its kind (taken from the main input), device views, fresh outputs.

        call = Call("gating_output", gating_output)
        logits = call.dev("gating_output", gating_output)    # numba view / device copy
        weights = call.empty((T, K), np.float32)              # numba array the kernel writes
        return call.result(weights)                           # the caller's kind
    """

    def __init__(self, name: str, main):
        self.kind = kind_of(name, main)
        self.main = main
        self._public: dict[int, tuple] = {}

    # inputs
    def dev(self, name: str, x):
        """`x` as a numba device array (uint16 bits for bf16); host arrays are copied."""
        cu = cuda()
        kind = kind_of(name, x)
        if kind == "host":
            a = np.ascontiguousarray(x)
            return cu.to_device(a.view(np.uint16) if a.dtype == BF16 else a)
        if kind == "numba":
            return x
        if kind == "torch":
            import torch
            if x.dtype == torch.bfloat16:  # torch's interface says '<V2' for bf16: pass the bits
                x = x.view(torch.uint16)
            x = x.detach()
        elif kind == "cupy" and np.dtype(x.dtype) == BF16:
            x = x.view(np.uint16)
        if size_of(x) == 0:  # an empty array may carry a null pointer; nothing reads it
            return cu.device_array(shape_of(x), dtype=_storage(dtype_of(x)))
        return _view(x)

    # outputs
    def empty(self, shape, dtype):
        """A fresh output of logical `dtype` in the caller's kind; returns its numba view."""
        cu = cuda()
        shape = tuple(int(s) for s in shape)
        logical = np.dtype(dtype)
        storage = _storage(logical)
        poison = _POISON[0]
        public = None
        if self.kind == "cupy":
            import cupy
            arr = cupy.empty(shape, dtype=storage)
            if poison:
                arr.fill(_poison_value(storage, logical))
            public = arr
            if logical == BF16:
                try:
                    public = arr.view(BF16)
                except Exception:  # a CuPy without bf16: the caller gets the uint16 bits
                    public = arr
            dev = _view(arr) if arr.size else cu.device_array(shape, dtype=storage)
        elif self.kind == "torch":
            import torch
            tdt = _torch_dtypes()[1][logical]
            public = torch.empty(shape, dtype=tdt, device=self.main.device)
            if poison:
                public.fill_(float("nan") if logical.kind == "f" or logical == BF16
                             else _poison_value(storage, logical))
            bits = public.view(torch.uint16) if logical == BF16 else public
            dev = _view(bits) if public.numel() else cu.device_array(shape, storage)
        else:
            if poison:
                dev = cu.to_device(np.full(shape, _poison_value(storage, logical), dtype=storage))
            else:
                dev = cu.device_array(shape, dtype=storage)
        self._public[id(dev)] = (dev, public, logical)
        return dev

    def result(self, dev):
        """The output `dev` (from `empty`) as the caller's kind."""
        _, public, logical = self._public[id(dev)]
        if self.kind == "host":
            out = dev.copy_to_host()
            return out.view(BF16) if logical == BF16 else out
        if public is not None:
            return public
        return dev


# ----------------------------------------------------------------------------- public helpers
def to_device(a):
    """A NumPy array copied to the GPU as a numba DeviceNDArray (bf16 becomes its uint16 bits)."""
    a = np.ascontiguousarray(a)
    return cuda().to_device(a.view(np.uint16) if a.dtype == BF16 else a)


def to_host(x, dtype=None):
    """Any supported array as a NumPy array; `dtype=ml_dtypes.bfloat16` views uint16 bits
    as bf16."""
    if isinstance(x, np.ndarray):
        out = x
    else:
        root = type(x).__module__.split(".")[0]
        if root == "cupy":
            out = x.get()
        elif root == "torch":
            import torch
            t = x.detach()
            if t.dtype == torch.bfloat16:
                out = t.view(torch.int16).cpu().numpy().view(BF16)
            else:
                out = t.cpu().numpy()
        elif hasattr(x, "copy_to_host"):
            out = x.copy_to_host()
        else:
            out = _view(x).copy_to_host()
    if dtype is not None and np.dtype(dtype) != out.dtype:
        out = out.view(np.dtype(dtype))
    return out


_DUMMIES: dict = {}


def dummy(dtype, ndim: int = 1):
    """A one-element device array standing in for an absent optional argument (never written)."""
    key = (np.dtype(dtype), ndim, is_simulator())
    if key not in _DUMMIES:
        _DUMMIES[key] = cuda().to_device(np.zeros((1,) * ndim, dtype=np.dtype(dtype)))
    return _DUMMIES[key]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- argument checks
# The reference's checks (reference/_checks.py) for any array kind; messages name the argument,
# what was expected and what came.
def check_array(name, x, ndim=None, dtypes=None, shape=None):
    kind_of(name, x)
    dt = dtype_of(x)
    shp = shape_of(x)
    if ndim is not None and len(shp) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {shp}")
    if dtypes is not None and dt not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({names}), got {dt}")
    if shape is not None:
        if len(shape) != len(shp) or any(s is not None and s != d for s, d in zip(shape, shp)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name}: expected shape {want}, got {shp}")
    return x   # no size limit: numba indexes with int64


def check_float(name, x, ndim=None, shape=None, with_f64=False):
    dts = FLOAT_DTYPES + ((np.dtype(np.float64),) if with_f64 else ())
    if kind_of(name, x) in ("numba", "cai") and dtype_of(x) == np.uint16:
        dts = dts + (np.dtype(np.uint16),)   # a numba array cannot say bf16: its uint16 bits
    return check_array(name, x, ndim=ndim, dtypes=dts, shape=shape)


def check_int_array(name, x, ndim=None, shape=None):
    return check_array(name, x, ndim=ndim, dtypes=INT_DTYPES, shape=shape)


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {sorted(choices)}, got {value!r}")
    return value


def check_ids_in_range(name, ids, upper):
    """Host arrays only (a device array would need a synchronising copy): ids in [0, upper)."""
    if isinstance(ids, np.ndarray) and ids.size and (ids.min() < 0 or ids.max() >= upper):
        bad = ids[(ids < 0) | (ids >= upper)].ravel()[0]
        raise ValueError(f"{name}: expected expert ids in [0, {upper}), got {int(bad)}")
