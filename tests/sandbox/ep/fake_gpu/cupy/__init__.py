"""FAKE cupy for CPU tests (see tests/sandbox/ep/fake_gpu/README.md). Arrays wrap NumPy arrays."""
import numpy as _np

from . import cuda  # noqa: F401
from . import random  # noqa: F401
from . import linalg  # noqa: F401

__version__ = "0.0-fake"
int8, uint8, int16, uint16, int32, uint32, int64, uint64 = (
    _np.int8, _np.uint8, _np.int16, _np.uint16, _np.int32, _np.uint32, _np.int64, _np.uint64)
float16, float32, float64, bool_ = _np.float16, _np.float32, _np.float64, _np.bool_
dtype = _np.dtype


def _u(x):
    """Unwrap fake arrays (also inside index tuples)."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, tuple):
        return tuple(_u(v) for v in x)
    return x


def _w(x):
    if isinstance(x, _np.ndarray):
        return ndarray(x)
    if isinstance(x, _np.generic):
        return ndarray(_np.asarray(x))
    return x


class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


class _Flags:
    def __init__(self, a):
        self.c_contiguous = a.flags.c_contiguous
        self.f_contiguous = a.flags.f_contiguous


class ndarray:
    """A device array: a NumPy array behind a wall (no implicit conversion)."""

    __array_ufunc__ = None  # numpy ufuncs refuse us, as they refuse real CuPy arrays

    def __init__(self, a):
        assert isinstance(a, _np.ndarray)
        self._a = a
        self._device = cuda._current_device()

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    # metadata
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    data = property(lambda self: _Ptr(self._a.ctypes.data))
    device = property(lambda self: cuda.Device(self._device))
    T = property(lambda self: ndarray(self._a.T))

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"fakecupy.{self._a!r}"

    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is not None:
            out[...] = self._a
            return out
        return _np.array(self._a, copy=True)

    def tolist(self):
        return self._a.tolist()

    def __getitem__(self, key):
        return _w(self._a[_u(key)])

    def __setitem__(self, key, value):
        if isinstance(value, _np.ndarray) and value.ndim > 0:
            raise TypeError("fake cupy: assigning a numpy.ndarray into a device array")
        self._a[_u(key)] = _u(value)

    def view(self, dtype):
        return ndarray(self._a.view(dtype))

    def astype(self, dtype, copy=True):
        return ndarray(self._a.astype(dtype, copy=copy))

    def reshape(self, *shape):
        return ndarray(self._a.reshape(*shape))

    def ravel(self):
        return ndarray(self._a.ravel())

    def copy(self):
        return ndarray(self._a.copy())

    def fill(self, v):
        self._a.fill(v)

    def sum(self, axis=None, keepdims=False, dtype=None):
        return _w(self._a.sum(axis=axis, keepdims=keepdims, dtype=dtype))

    def any(self, axis=None):
        return _w(self._a.any(axis=axis))

    def max(self, axis=None):
        return _w(self._a.max(axis=axis))

    def min(self, axis=None):
        return _w(self._a.min(axis=axis))

    def __int__(self):
        return int(self._a)

    def __float__(self):
        return float(self._a)

    def __index__(self):
        return int(self._a)

    def __bool__(self):
        return bool(self._a)


def _binop(name):
    def op(self, other):
        return _w(getattr(self._a, name)(_u(other)))
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
              "__rmod__", "__lshift__", "__rshift__", "__and__", "__or__", "__eq__", "__ne__",
              "__lt__", "__le__", "__gt__", "__ge__", "__neg__", "__iadd__", "__isub__",
              "__imul__", "__pow__"):
    if _name == "__neg__":
        setattr(ndarray, _name, lambda self: ndarray(-self._a))
    elif _name.startswith("__i"):
        def _inplace(self, other, _n=_name):
            getattr(self._a, _n)(_u(other))
            return self
        setattr(ndarray, _name, _inplace)
    else:
        setattr(ndarray, _name, _binop(_name))


def _host(a):
    if isinstance(a, ndarray):
        return a._a
    if isinstance(a, (list, tuple)):
        return _np.asarray([_host(v) for v in a]) if any(isinstance(v, ndarray) for v in a) \
            else _np.asarray(a)
    return a


def asarray(a, dtype=None):
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    return ndarray(_np.array(a, dtype=dtype, copy=True))  # a host-to-device copy


array = asarray


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError("fake cupy: ascontiguousarray of a host array")
    if a._a.flags.c_contiguous and (dtype is None or a.dtype == dtype):
        return a
    return ndarray(_np.ascontiguousarray(a._a, dtype=dtype))


def empty(shape, dtype=_np.float64):
    out = _np.empty(shape, dtype=dtype)
    out.view(_np.uint8).reshape(-1)[:] = 0xFF  # garbage, like fresh device memory (NaN floats)
    return ndarray(out)


def zeros(shape, dtype=_np.float64):
    return ndarray(_np.zeros(shape, dtype=dtype))


def ones(shape, dtype=_np.float64):
    return ndarray(_np.ones(shape, dtype=dtype))


def full(shape, value, dtype=None):
    return ndarray(_np.full(shape, value, dtype=dtype))


def empty_like(a, dtype=None):
    return ndarray(_np.empty_like(_u(a), dtype=dtype))


def zeros_like(a, dtype=None):
    return ndarray(_np.zeros_like(_u(a), dtype=dtype))


def arange(*args, dtype=None):
    return ndarray(_np.arange(*args, dtype=dtype))


def concatenate(arrays, axis=0):
    for a in arrays:
        if not isinstance(a, ndarray):
            raise TypeError("fake cupy: concatenate of a host array")
    return ndarray(_np.concatenate([a._a for a in arrays], axis=axis))


def bincount(x, minlength=0):
    if not isinstance(x, ndarray):
        raise TypeError("fake cupy: bincount of a host array")
    return ndarray(_np.bincount(x._a, minlength=minlength))


def argsort(a, axis=-1):
    return ndarray(_np.argsort(_u(a), axis=axis, kind="stable"))


def get_array_module(*args):
    import sys

    return sys.modules[__name__]


def where(condition, x, y):
    return ndarray(_np.asarray(_np.where(_u(condition), _u(x), _u(y))))


def sort(a, axis=-1):
    if not isinstance(a, ndarray):
        raise TypeError("fake cupy: sort of a host array")
    return ndarray(_np.sort(a._a, axis=axis, kind="stable"))
