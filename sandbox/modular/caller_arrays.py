"""Arrays in the caller's library: the modular kernel allocates its output and workspaces
with hidden_states' library (NumPy, torch or CuPy) and every object writes there in place,
so any prepare/finalize pairs with any experts on one machine.

    in_library_of(host, ref)    a host NumPy array as `ref`'s library holds it (its device)
    empty_in_library_of(like, shape, dtype)   an uninitialised array of `like`'s library
    assign(dst, src)            dst[...] = src in place, whatever the two libraries (zero copy
                                between GPU libraries where the dtype survives)
"""
from __future__ import annotations

import numpy as np

from .. import arrays
from ..registry import get_backend


def in_library_of(host, ref):
    """A host NumPy array in `ref`'s library (and device)."""
    k = arrays.kind(ref)
    if k == "numpy":
        return host
    if k == "torch":
        return arrays.numpy_to_torch(np.ascontiguousarray(host), ref.device)
    return get_backend(k).to_device(np.ascontiguousarray(host))


def assign(dst, src, backend=None):
    """dst[...] = src, in place, whatever the two libraries (`backend`: the one that made
    src, whose `get` knows its conventions; else sandbox.arrays.to_numpy)."""
    k = arrays.kind(dst)

    def host_of(v):
        h = backend.get(v) if backend is not None else arrays.to_numpy(v)
        return np.ascontiguousarray(h).reshape(tuple(dst.shape))

    if k == "torch":
        import torch

        if arrays.kind(src) != "torch":
            t = arrays.zero_copy(src, "torch") if arrays.is_device(src) else None
            src = t if t is not None else arrays.numpy_to_torch(host_of(src))
        with torch.no_grad():
            dst.copy_(src.reshape(dst.shape))
        return dst
    if k == "numpy":
        np.copyto(dst, host_of(src))
        return dst
    if k == "cupy" and arrays.is_device(src):
        y = arrays.zero_copy(src, "cupy")
        if y is not None:
            dst[...] = y.reshape(dst.shape)
            return dst
    host = host_of(src)
    if k == "cupy":
        dst[...] = get_backend("cupy").to_device(host)
    else:                                  # numba device arrays
        dst.copy_to_device(host)
    return dst


def empty_in_library_of(like, shape, dtype=None):
    """An uninitialised array of `like`'s library, device and (by default) dtype."""
    k = arrays.kind(like)
    if k == "torch":
        import torch

        return torch.empty(shape, dtype=like.dtype if dtype is None else dtype,
                           device=like.device)
    if k == "cupy":
        import cupy

        return cupy.empty(shape, dtype=like.dtype if dtype is None else dtype)
    return np.empty(shape, dtype=arrays.dtype_of(like) if dtype is None else dtype)
