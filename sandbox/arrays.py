"""Array interop: move a stage's arrays from the backend that made them to the one that reads them.

    kind(x)                  "none", "numpy", "torch", "cupy", "numba" or "other"
    is_device(x)             True for arrays in GPU memory (CuPy, Numba, torch on CUDA)
    dtype_of(x)              the NumPy dtype of any of them (torch.bfloat16 -> ml_dtypes.bfloat16)
    to_numpy(x)              a host NumPy array (bf16 stays ml_dtypes.bfloat16)
    numpy_to_torch(a, dev)   NumPy -> torch, zero-copy on the CPU (bf16 through an int16 view)
    torch_to_numpy(t)        torch -> NumPy (bf16 through an int16 view)
    torch_dtype(np_dtype)    the torch dtype of a NumPy dtype (these three: cuda_kernels.torch's)
    transfer(x, src, dst)    the layer's mover: x, made by backend `src`, as backend `dst` reads it

Rules of `transfer` (the layer calls it between every two stages and only when the backend
changes):
  * an array the destination's stages already take (same library and device): nothing
    happens;
  * GPU -> GPU (CuPy, Numba, torch on CUDA): zero-copy through DLPack or
    `__cuda_array_interface__`; the result must keep the dtype, otherwise (bf16, which CAI
    cannot describe) the array takes the host path below;
  * anything else goes through the host: `src.get(x)` then `dst.put(x)` (the registry's
    Backend methods, which respect each backend's convention for bf16). A host backend (the
    NumPy reference, torch on the CPU) gets the host array itself (torch.from_numpy: no copy).

Nothing here imports torch, CuPy or Numba at module import time.
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

# the torch converters live with the torch backend (cuda_kernels/torch/_tensors.py);
# numpy_to_torch and torch_dtype are part of this module's API (above)
from cuda_kernels.torch import numpy_dtype, numpy_to_torch, torch_dtype, torch_to_numpy  # noqa: F401

BF16 = np.dtype(ml_dtypes.bfloat16)


def kind(x) -> str:
    """Which library an array belongs to, without importing any library."""
    if x is None:
        return "none"
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    if mod.startswith("numba"):
        return "numba"
    return "other"


def is_device(x) -> bool:
    """True when `x` lives in GPU memory (a CUDA simulator array counts as host)."""
    k = kind(x)
    if k == "torch":
        return x.device.type == "cuda"
    if k == "cupy":
        return True
    if k == "numba":
        # numba's simulator arrays (FakeCUDAArray) live on the host
        return "simulator" not in type(x).__module__
    return False


def dtype_of(x) -> np.dtype:
    """The NumPy dtype of an array of any kind."""
    if kind(x) == "torch":
        return numpy_dtype(x.dtype)
    return np.dtype(x.dtype)


def to_numpy(x):
    """Any array (NumPy, torch, CuPy, Numba device or simulator array) as a host NumPy array."""
    k = kind(x)
    if k == "none":
        return None
    if k == "numpy":
        return x
    if k == "torch":
        return torch_to_numpy(x)
    if k == "cupy":
        return x.get()
    if hasattr(x, "copy_to_host"):                 # numba device arrays, simulator included
        return x.copy_to_host()
    return np.asarray(x)


# ---------------------------------------------------------------------------- GPU zero-copy
def _gpu_to_torch(x):
    import torch

    if kind(x) == "cupy" or hasattr(x, "__dlpack__"):
        try:
            return torch.from_dlpack(x)
        except Exception:
            pass
    return torch.as_tensor(x, device="cuda")       # __cuda_array_interface__, no copy


def _gpu_to_cupy(x):
    import cupy

    if hasattr(x, "__dlpack__"):
        try:
            return cupy.from_dlpack(x)
        except Exception:
            pass
    return cupy.asarray(x)                           # __cuda_array_interface__, no copy


def _gpu_to_numba(x):
    from numba import cuda

    return cuda.as_cuda_array(x)                     # __cuda_array_interface__, no copy


_ZERO_COPY = {"torch": _gpu_to_torch, "cupy": _gpu_to_cupy, "numba": _gpu_to_numba}


def zero_copy(x, dst_kind: str):
    """`x` (in GPU memory) viewed as a `dst_kind` array without a copy, or None when the
    libraries cannot agree on it (bf16 has no `__cuda_array_interface__` type string)."""
    if kind(x) == dst_kind:
        return x
    convert = _ZERO_COPY.get(dst_kind)
    if convert is None:
        return None
    try:
        y = convert(x)
    except Exception:
        return None
    try:
        same = dtype_of(y) == dtype_of(x) and tuple(y.shape) == tuple(x.shape)
    except Exception:
        same = False
    return y if same else None


def transfer(x, src, dst):
    """`x`, produced by backend `src`, as backend `dst` reads it (see the module docstring).

    `src` and `dst` are `sandbox.registry.Backend` handles (they provide `name`,
    `array_kind`, `is_host`, `accepts`, `get` and `put`). Tuples and lists are moved item by
    item; None, Python scalars, strings and callables pass through.
    """
    if isinstance(x, (tuple, list)):
        return type(x)(transfer(v, src, dst) for v in x)
    k = kind(x)
    if k == "none" or isinstance(x, np.generic) or not (hasattr(x, "shape")
                                                         and hasattr(x, "dtype")):
        return x                                 # scalars, strings, callables, None
    if dst.accepts(x):
        return x
    if is_device(x) and not dst.is_host:
        y = zero_copy(x, dst.array_kind)
        if y is not None and dst.accepts(y):
            return y
    host = x if k == "numpy" else (src.get(x) if src is not None else to_numpy(x))
    return dst.put(host)


def describe(x) -> str:
    """`numpy float32 (3, 4)`: for error messages."""
    if x is None:
        return "None"
    try:
        return f"{kind(x)} {dtype_of(x)} {tuple(x.shape)}"
    except Exception:
        return type(x).__name__


def torch_loaded() -> bool:
    return "torch" in sys.modules
