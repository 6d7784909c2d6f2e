"""How rows travel: between ranks as bytes (bf16 as its uint16 bytes), and between the host
and the communicator's device around a host fallback.

    raw(x)              bf16 -> the same bytes as uint16 (any other dtype: x itself)
    view_as(x, dtype)   the bytes of x as `dtype` (undoes raw)
    to_host(comm, a)    a CuPy array of the communicator as host NumPy (anything else as is)
    to_comm(comm, a)    a host result back as the communicator's array (tuples item by item)

Copies, gathers, sends and the layout kernels only move bytes, so the exchanges ask no bf16
support of the array library (CuPy has no bf16 arithmetic, NCCL's bf16 needs a recent
build): the communicators (comm.py, comm_nccl.py), the dispatch (dispatch.py) and the
layout's host fallback (layout.py) all send bf16 this way. The host fallbacks (the layout
functions and the reference stages run in NumPy for an NCCL run without CuPy kernels) move
their arguments with to_host and their results with to_comm.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["BF16", "raw", "view_as", "to_host", "to_comm"]

BF16 = np.dtype(ml_dtypes.bfloat16)


def raw(x):
    """bf16 as its uint16 bytes (copies, gathers and sends need no bf16 arithmetic)."""
    return x.view(np.uint16) if np.dtype(x.dtype) == BF16 else x


def view_as(x, dtype):
    """The bytes of `x` as `dtype` (undoes `raw`). A CuPy without bf16 keeps uint16."""
    dtype = np.dtype(dtype)
    if np.dtype(x.dtype) == dtype:
        return x
    try:
        return x.view(dtype)
    except Exception:
        return x


def to_host(comm, a):
    """A CuPy array of the communicator as host NumPy; anything else as it is."""
    return comm.to_host(a) if type(a).__module__.startswith("cupy") else a


def to_comm(comm, a):
    """A host result as the communicator's array (bf16 through its bytes: a CuPy without
    bf16 holds them as uint16); tuples item by item, anything else as it is."""
    if isinstance(a, np.ndarray):
        return view_as(comm.xp.asarray(raw(np.ascontiguousarray(a))), a.dtype)
    if isinstance(a, tuple):
        return tuple(to_comm(comm, v) for v in a)
    return a
