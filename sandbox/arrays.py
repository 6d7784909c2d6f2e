"""Array interop: which library an array belongs to, and moving it between libraries.

    kind(x)                  "none", "numpy", "torch", "cupy", "numba" or "other"
    is_device(x)             True for arrays in GPU memory (CuPy, Numba, torch on CUDA)
    dtype_of(x)              the NumPy dtype of any of them (torch.bfloat16 -> ml_dtypes.bfloat16)
    to_numpy(x)              a host NumPy array (bf16 stays ml_dtypes.bfloat16)
    numpy_to_torch(a, dev)   NumPy -> torch, zero-copy on the CPU (bf16 through an int16 view)
    torch_to_numpy(t)        torch -> NumPy (bf16 through an int16 view)
    torch_dtype(np_dtype)    the torch dtype of a NumPy dtype (these three: cuda_kernels.torch's)
    zero_copy(x, kind)       a GPU array viewed by another GPU library, or None

An array carries its own kind: the layer moves a stage's arguments with the registry's
`Backend.take(x)`, which asks `kind(x)` where x lives and the backend whether it `accepts`
x as it is; nothing else needs to remember which backend made an array.

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
