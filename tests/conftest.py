"""Shared test configuration: hardware markers skip cleanly when the hardware is absent.

`gpu` tests need a CUDA device visible to CuPy (or Numba); `multigpu` tests need two.
The markers, not `if`s inside tests, decide what runs where (pyproject declares them
with --strict-markers). The `rng` fixture gives every test its own reproducible generator;
`cupy_poison` and `numba_poison` make every output a stage allocates start as NaN (ints as a
poison value), so an element a kernel forgets to write fails the comparison. The helpers that
are not fixtures (dtype table, GPU marks per backend) are in tests/support.py.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A generator seeded by the test's id (parameters included): stable across runs, so a
    failure reproduces, and different for every parametrization."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def cupy_poison(monkeypatch):
    """CuPy outputs poisoned before every launch (`_arrays.POISON`)."""
    from cuda_kernels.cupy import _arrays

    monkeypatch.setattr(_arrays, "POISON", True)


@pytest.fixture
def numba_poison():
    """Numba outputs poisoned before every launch (`poisoned_outputs()`)."""
    from cuda_kernels import numba as nb

    with nb.poisoned_outputs():
        yield


@functools.lru_cache(maxsize=None)
def cuda_device_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        pass
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    count = cuda_device_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible here)")
    skip_multi = pytest.mark.skip(reason=f"needs two or more CUDA GPUs ({count} visible here)")
    for item in items:
        if "multigpu" in item.keywords and count < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and count < 1:
            item.add_marker(skip_gpu)
