"""Compatibility shims applied before `numba` / `numba.cuda` is first imported.

numba-cuda 0.30.4 (the last release with the CUDA simulator) and numba 0.6x register an
overload for `np.row_stack` when their NumPy support loads. NumPy 2.5 removed that alias
(deprecated since 2.0), so on such a NumPy `import numba.cuda` fails with
`AttributeError: module 'numpy' has no attribute 'row_stack'`. The GPU image ships NumPy
2.5.2 while the project pins numpy<2.5 (pyproject.toml), so the package applies the shim
itself instead of asking anyone to patch their environment by hand.

`np.row_stack` was always exactly `np.vstack`, so the alias restores the old behaviour; it is
set only when missing and never overrides a NumPy that still has it. Importing this module is
idempotent and has no other effect.
"""
from __future__ import annotations

import numpy as np


def apply() -> bool:
    """Install the shims that the running NumPy needs; True if anything was patched."""
    patched = False
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack  # NumPy >= 2.5: numba-cuda 0.30 still overloads it at import
        patched = True
    return patched


PATCHED = apply()
