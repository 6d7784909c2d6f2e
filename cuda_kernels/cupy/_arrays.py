"""CuPy arrays on the current device, as the launchers take and make them, and their checks.

    availability()          (True, "") when CuPy imports and a CUDA device is usable
    bf16_dtype, ctype_of, raw       the dtypes: bf16 travels as ml_dtypes.bfloat16, kernels get
                            its bytes (`raw`: a uint16 view) and read __nv_bfloat16
    empty(shape, dtype)     an output array, poisoned (NaN / POISON_INT) when POISON is set
    as_f32, to_device, to_host      conversions (bf16 widened exactly through its bits)
    check_array, check_int, check_fits_int32, float_dtypes, null_ptr
                            what every launcher checks before a launch

Nothing here imports CuPy at module import time: `import cuda_kernels.cupy` works on a
machine without it.
"""
from __future__ import annotations

import functools
import os

from .._checks import check_int  # noqa: F401  (the launchers call A.check_int)


# ----------------------------------------------------------------------------- the device
def availability() -> tuple[bool, str]:
    """(True, "") when CuPy imports and a CUDA device is usable, else (False, reason)."""
    return _availability()


@functools.lru_cache(maxsize=1)
def _availability() -> tuple[bool, str]:
    try:
        import cupy
    except Exception as e:
        return False, f"cupy is not importable ({type(e).__name__}: {e})"
    try:
        if not cupy.cuda.is_available():
            return False, ("cupy imports but no usable CUDA device / driver "
                           "(cupy.cuda.is_available())")
        cupy.cuda.runtime.getDeviceCount()
        _ = cupy.cuda.Device().compute_capability  # raises when the device is unusable
    except Exception as e:
        return False, f"CUDA device not usable ({type(e).__name__}: {e})"
    return True, ""


# ----------------------------------------------------------------------------- arrays
# bf16 travels as ml_dtypes.bfloat16 (CuPy 14 knows it, experimentally). Kernels only need the
# bytes, so launchers hand `raw(x)` (a uint16 view for bf16) to the kernel, which reads it as
# __nv_bfloat16: the public dtype stays ml_dtypes.bfloat16 whatever CuPy supports.
def bf16_dtype():
    import ml_dtypes
    import numpy as np

    return np.dtype(ml_dtypes.bfloat16)


def ctype_of(dtype) -> str:
    """The C type a kernel uses for a floating dtype: double, float, __half or __nv_bfloat16."""
    import numpy as np

    ctypes = {np.dtype(np.float64): "double", np.dtype(np.float32): "float",
              np.dtype(np.float16): "__half", bf16_dtype(): "__nv_bfloat16"}
    dt = np.dtype(dtype)
    if dt not in ctypes:
        raise TypeError(f"expected float64, float32, float16 or bfloat16, got {dt}")
    return ctypes[dt]


def raw(x):
    """`x` as the kernel receives it: bf16 viewed as uint16 (same bytes), others unchanged."""
    import numpy as np

    if x is None:
        return None
    if np.dtype(x.dtype) == bf16_dtype():
        return x.view("uint16")
    return x


# Tests set POISON (or the environment sets MOE_SANDBOX_POISON=1): every output a launcher
# allocates is then filled with NaN (floats) or POISON_INT (ints) before the kernel runs, so an
# element the kernel forgot to write can never pass for a right answer left in a reused buffer.
POISON = os.environ.get("MOE_SANDBOX_POISON", "") not in ("", "0")
POISON_INT = -123456789


def empty(shape, dtype):
    """An output array of `dtype` (bf16 allowed) on the current device, poisoned if POISON."""
    import cupy
    import numpy as np

    dt = np.dtype(dtype)
    if dt == bf16_dtype():
        try:
            out = cupy.empty(shape, dtype=dt)
        except Exception:  # a CuPy without bf16: keep the bytes, the caller sees uint16
            out = cupy.empty(shape, dtype=np.uint16)
    else:
        out = cupy.empty(shape, dtype=dt)
    if POISON and out.size:
        if dt.kind == "f" or dt == bf16_dtype():
            # 0x7FC0 is a bf16 NaN, 0x7E00 an fp16 NaN: written through an integer view so
            # that the fill needs no bf16 arithmetic in CuPy
            if dt.itemsize == 2:
                raw(out).view(np.uint16).fill(0x7FC0 if dt == bf16_dtype() else 0x7E00)
            else:
                out.fill(np.nan)
        else:
            out.fill(POISON_INT if dt.itemsize >= 4 else -1)
    return out


def as_f32(x):
    """`x` as a float32 CuPy array (no copy when it already is). bf16 widens exactly through
    its bits (bf16 is the top half of an fp32), so no bf16 arithmetic is asked of CuPy."""
    import cupy
    import numpy as np

    if x.dtype == np.float32:
        return x
    if np.dtype(x.dtype) == bf16_dtype():
        return (x.view(np.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    return x.astype(cupy.float32)


def to_device(a):
    """A NumPy array (bf16 as ml_dtypes.bfloat16 included) copied to the current CUDA device."""
    import cupy
    import numpy as np

    a = np.ascontiguousarray(a)
    if a.dtype == bf16_dtype():
        try:
            return cupy.asarray(a)
        except Exception:  # a CuPy without bf16 support: the same bytes as uint16
            return cupy.asarray(a.view(np.uint16))
    return cupy.asarray(a)


def to_host(x):
    """A CuPy array (or anything NumPy can take) as a NumPy array; bf16 stays bfloat16."""
    import numpy as np

    if hasattr(x, "get"):
        return x.get()
    return np.asarray(x)


# ----------------------------------------------------------------------------- argument checks
# Every launcher checks its arguments before the launch: a kernel handed the wrong thing either
# crashes the context or, worse, returns garbage. Messages name the argument, what was expected
# and what came.
INT32_MAX = 2**31 - 1
FLOAT_NAMES = "float32, float16 or bfloat16"


def float_dtypes(with_f64: bool = False):
    import numpy as np

    dts = [np.dtype(np.float32), np.dtype(np.float16), bf16_dtype()]
    return dts + [np.dtype(np.float64)] if with_f64 else dts


def check_array(name, x, ndim=None, dtypes=None, shape=None, contiguous=True):
    """A CuPy array on the current device with the given rank, dtype, shape and C order."""
    import cupy
    import numpy as np

    if not isinstance(x, cupy.ndarray):
        hint = " (use cuda_kernels.cupy.to_device)" if isinstance(x, np.ndarray) else ""
        raise TypeError(f"{name}: expected a cupy.ndarray on the GPU, got {type(x).__name__}"
                        + hint)
    dev = cupy.cuda.Device().id
    if x.device.id != dev:
        raise ValueError(f"{name}: expected an array on the current device {dev}, "
                         f"got one on device {x.device.id}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {x.shape}")
    if dtypes is not None and np.dtype(x.dtype) not in [np.dtype(d) for d in dtypes]:
        names = ", ".join(str(np.dtype(d)) for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({names}), got {x.dtype}")
    if shape is not None:
        if len(shape) != x.ndim or any(s is not None and s != d for s, d in zip(shape, x.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name}: expected shape {want}, got {x.shape}")
    if contiguous and not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {x.strides} "
                         f"for shape {x.shape} (call cupy.ascontiguousarray first)")
    if x.size > INT32_MAX:
        raise ValueError(f"{name}: expected at most {INT32_MAX} elements (32-bit indexing), "
                         f"got {x.size}")
    return x


def check_fits_int32(name, value, what):
    if value > INT32_MAX:
        raise ValueError(f"{name}: {what} = {value} overflows the kernels' 32-bit indexing "
                         f"(limit {INT32_MAX})")


def null_ptr():
    """A null pointer argument for a RawKernel (8 bytes of zero)."""
    import numpy as np

    return np.uint64(0)
