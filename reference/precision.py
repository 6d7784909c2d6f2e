"""Where the rounding happens.

Every stage computes in fp32 (fp64 when its inputs are fp64) and rounds its floating
output once to the dtype of its main input: this is the *engine-faithful* mode, the
rounding points of vLLM's fused MoE on bf16 / fp16 inputs. The *exact* mode is the same
functions fed float64 inputs (`exact(x)` upcasts), so that a user sees where a kernel's
error comes from: compare a kernel with both and the gap between them is rounding.
"""

from __future__ import annotations

import numpy as np

from ._checks import FLOAT_DTYPES


def compute_dtype(dtype) -> np.dtype:
    """The accumulator for inputs of `dtype`: fp64 for fp64, fp32 for everything else."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def to_compute(x: np.ndarray) -> np.ndarray:
    """`x` in its accumulator dtype (no copy when it already is)."""
    return x.astype(compute_dtype(x.dtype), copy=False)


def exact(x):
    """Upcast a floating array to float64; leave integer arrays, scalars and None alone."""
    if isinstance(x, np.ndarray) and x.dtype in FLOAT_DTYPES:
        return x.astype(np.float64)
    return x
