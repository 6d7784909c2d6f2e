"""How rows travel between ranks: bf16 as its uint16 bytes.

    raw(x)              bf16 -> the same bytes as uint16 (any other dtype: x itself)
    view_as(x, dtype)   the bytes of x as `dtype` (undoes raw)

Copies, gathers, sends and the layout kernels only move bytes, so the exchanges ask no bf16
support of the array library (CuPy has no bf16 arithmetic, NCCL's bf16 needs a recent
build): the communicators (comm.py, comm_nccl.py), the dispatch (dispatch.py) and the
layout's host fallback (layout.py) all send bf16 this way.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["BF16", "raw", "view_as"]

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
