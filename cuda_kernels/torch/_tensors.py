"""What every stage of the torch backend shares: where its tensors live, NumPy <-> torch, the
argument checks.

    availability()             (True, "torch X on DEVICE") when torch imports, else (False, why)
    device()                   the torch.device the stages compute on: CUDA when torch sees a
                               GPU, else the CPU; MOE_SANDBOX_TORCH_DEVICE=cpu (or cuda:1)
                               overrides
    to_device(a), to_host(t)   a NumPy array as a tensor on device(), and back
    numpy_to_torch(a, dev)     NumPy -> torch, zero-copy on the CPU (bf16 through an int16 view)
    torch_to_numpy(t)          torch -> NumPy (bf16 as ml_dtypes.bfloat16, through int16)
    torch_dtype(np_dtype), numpy_dtype(torch_dtype)   the dtype of one library in the other
    as_tensor(x, name)         a stage's argument: a tensor as it is, a NumPy array on device()
    check_float, check_int, positive_int, compute_dtype, index_dtype, cdiv

Nothing here imports torch at module import time (sandbox.arrays uses the converters).
"""
from __future__ import annotations

import functools
import os

import ml_dtypes
import numpy as np

from .._checks import check_int as check_scalar_int

BF16 = np.dtype(ml_dtypes.bfloat16)


# ----------------------------------------------------------------------------- where
@functools.lru_cache(maxsize=1)
def availability() -> tuple[bool, str]:
    """(True, "torch X on DEVICE") when torch imports, else (False, why)."""
    try:
        import torch
    except Exception as e:  # pragma: no cover - torch is in the project venv
        return False, f"torch is not importable ({type(e).__name__}: {e})"
    return True, f"torch {torch.__version__} on {device()}"


@functools.lru_cache(maxsize=1)
def device():
    """The torch device the backend computes on (a `torch.device`)."""
    import torch

    name = os.environ.get("MOE_SANDBOX_TORCH_DEVICE")
    if not name:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        # tensors report "cuda:0", and torch.device("cuda") != torch.device("cuda:0")
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _is_tensor(x) -> bool:
    return (type(x).__module__ or "").startswith("torch")


def to_device(a):
    """A NumPy array as a tensor on the backend's device (zero-copy on the CPU)."""
    if _is_tensor(a):
        return a.to(device())
    return numpy_to_torch(np.asarray(a), device())


def to_host(t):
    """A tensor as a host NumPy array (bf16 as ml_dtypes.bfloat16); NumPy arrays and None
    pass through."""
    if t is None or isinstance(t, np.ndarray):
        return t
    if not _is_tensor(t):
        raise TypeError(f"t: expected a torch.Tensor or numpy.ndarray, got {type(t).__name__}")
    return torch_to_numpy(t)


# ----------------------------------------------------------------------------- NumPy <-> torch
@functools.lru_cache(maxsize=1)
def _dtype_map() -> dict:
    import torch

    return {
        torch.float64: np.dtype(np.float64), torch.float32: np.dtype(np.float32),
        torch.float16: np.dtype(np.float16), torch.bfloat16: BF16,
        torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32),
        torch.int16: np.dtype(np.int16), torch.int8: np.dtype(np.int8),
        torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_),
    }


def numpy_dtype(dtype) -> np.dtype:
    """The NumPy dtype of a torch dtype (torch.bfloat16 -> ml_dtypes.bfloat16)."""
    return _dtype_map()[dtype]


def torch_dtype(dtype):
    """The torch dtype of a NumPy dtype (ml_dtypes.bfloat16 -> torch.bfloat16)."""
    want = np.dtype(dtype)
    for t, n in _dtype_map().items():
        if n == want:
            return t
    raise TypeError(f"dtype: expected one torch can hold, got {want}")


def torch_to_numpy(t) -> np.ndarray:
    """A torch tensor on the host as NumPy; bf16 (which NumPy lacks) through an int16 view."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    import torch

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(BF16)
    return t.numpy()


def numpy_to_torch(a: np.ndarray, device="cpu"):
    """NumPy -> torch on `device`. Zero-copy on the CPU when `a` is contiguous and writeable."""
    import torch

    if not (a.flags.c_contiguous and a.flags.writeable):
        a = np.array(a, order="C", copy=True)   # torch.from_numpy refuses odd strides
    if a.dtype == BF16:
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if str(device) == "cpu" else t.to(device)


# ----------------------------------------------------------------------------- arguments
def as_tensor(x, name="x"):
    """Accept a tensor or a NumPy array (converted to the backend device)."""
    import torch

    if x is None or isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return to_device(x)
    raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def compute_dtype(dtype):
    """fp64 for fp64, else fp32: the precision every stage computes in."""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def check_float(name, x, ndim=None):
    import torch

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating dtype, got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")


def check_int(name, x, ndim=None):
    import torch

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.dtype.is_complex:
        raise TypeError(f"{name}: expected an integer dtype, got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")


def positive_int(name, v, minimum=1):
    """A Python or NumPy int (not a bool) >= minimum: the check every backend shares."""
    return check_scalar_int(name, v, minimum)


def cdiv(a, b):
    return -(-a // b)


def index_dtype(indices_type):
    """The torch dtype of routing ids: int32 by default, or the one asked for (a torch or
    NumPy dtype)."""
    import torch

    if indices_type is None:
        return torch.int32
    if isinstance(indices_type, torch.dtype):
        return indices_type
    return torch_dtype(indices_type)
