"""Argument checks shared by the reference stages.

Every message names the argument, what was expected and what came, so that a wrong call
fails at the line that made it rather than deep inside a matmul.
"""

from __future__ import annotations

import numpy as np
import ml_dtypes

# The floating dtypes every stage accepts. bf16 comes from ml_dtypes (NumPy has none).
FLOAT_DTYPES = (
    np.dtype(np.float64),
    np.dtype(np.float32),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
)
INT_DTYPES = (np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.int16), np.dtype(np.int8),
              np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))


def check_array(name, x, ndim=None, dtypes=None, shape=None):
    """Raise TypeError/ValueError unless `x` is an ndarray with the given rank, dtype and shape.

    `shape` may hold None for a free dimension.
    """
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {x.shape}")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({names}), got {x.dtype}")
    if shape is not None:
        if len(shape) != x.ndim or any(s is not None and s != d for s, d in zip(shape, x.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name}: expected shape {want}, got {x.shape}")
    return x


def check_float(name, x, ndim=None, shape=None):
    return check_array(name, x, ndim=ndim, dtypes=FLOAT_DTYPES, shape=shape)


def check_int(name, x, ndim=None, shape=None):
    return check_array(name, x, ndim=ndim, dtypes=INT_DTYPES, shape=shape)


def check_positive_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def check_ids_in_range(name, ids, upper):
    """Every id must lie in [0, upper)."""
    if ids.size and (ids.min() < 0 or ids.max() >= upper):
        bad = ids[(ids < 0) | (ids >= upper)].ravel()[0]
        raise ValueError(f"{name}: expected expert ids in [0, {upper}), got {int(bad)}")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {sorted(choices)}, got {value!r}")
    return value
