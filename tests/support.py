"""What the test modules share besides the oracles (tests/oracles.py), the quantized
operands (tests/quant_support.py) and the CPU emulator of CUDA (tests/emulator/):

    DTYPES              "fp32" / "fp16" / "bf16" -> the NumPy dtype: the float dtypes every
                        GPU stage runs in, by the names test ids show
    gpu_marks(backend)  the `gpu` marker plus a skip where `backend` ("cupy" or "numba")
                        cannot run kernels here, with its reason: `pytestmark =
                        gpu_marks("cupy")` in a module whose every test needs the GPU
    on_gpu(backend)     the same marks on one test, in a module that mixes CPU and GPU tests
    runs_kernels(backend)  whether it can (a module imports its kernel modules only then)
    full_grid(default, full)  a GPU test's shape list: the default one that fits a GPU
                        session's budget, or the full grid with MOE_SANDBOX_FULL_GRID=1
    EP_LAYOUT_SHAPES    the cases of the fused all-to-all-v layout, for its NumPy twins
                        (tests/sandbox/ep) and its CuPy kernels (tests/cupy) alike
    once(cache, key, fn)  fn()'s result, computed once per key; its failure raised again to
                        every test that asks (checks that share one launched group of ranks)

The fixtures live in tests/conftest.py (rng, cupy_poison, numba_poison). The conftest's
collection hook already skips `gpu` tests where no CUDA device is visible; the backend's own
availability() adds the cases a device count cannot see (CuPy without NVRTC, Numba in its
simulator, which tests/numba/sim covers instead).
"""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from tests.oracles import BF16

DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": BF16}


@functools.lru_cache(maxsize=None)
def _availability(backend: str) -> tuple[bool, str]:
    if backend == "cupy":
        from cuda_kernels.cupy import availability

        ok, why = availability()
        return ok, f"no usable GPU: {why}"
    if backend == "numba":
        import importlib

        from cuda_kernels import numba as nb

        ok, why = nb.availability()
        if ok and importlib.import_module("cuda_kernels.numba._arrays").is_simulator():
            return False, "numba runs in its CUDA simulator here (tests/numba/sim covers it)"
        return ok, f"needs a CUDA GPU through numba: {why}"
    raise ValueError(f"backend: expected 'cupy' or 'numba', got {backend!r}")


def runs_kernels(backend: str) -> bool:
    """Whether `backend` ("cupy" or "numba") can run kernels on this machine."""
    return _availability(backend)[0]


def gpu_marks(backend: str) -> list:
    """[gpu, skipif(backend cannot run kernels here)]: a module's pytestmark."""
    ok, why = _availability(backend)
    return [pytest.mark.gpu, pytest.mark.skipif(not ok, reason=why)]


def on_gpu(backend: str):
    """A decorator putting gpu_marks(backend) on one test."""
    def mark(test):
        for m in gpu_marks(backend):
            test = m(test)
        return test
    return mark


FULL_GRID = os.environ.get("MOE_SANDBOX_FULL_GRID") == "1"


def full_grid(default, full):
    """`default` (every kernel and dtype, on the shapes that fit a GPU session's budget: each
    new Numba kernel x dtype costs a JIT compile of a few seconds), or `full` with
    MOE_SANDBOX_FULL_GRID=1 (the CuPy tests' grids in every dtype)."""
    return full if FULL_GRID else default


# (T, E, K, W, slot_rows): one token, T not a multiple of anything, W > K, W = 1, empty batch
EP_LAYOUT_SHAPES = [(1, 8, 2, 2, False), (37, 16, 4, 2, False), (37, 16, 4, 4, True),
                    (50, 64, 3, 8, False), (50, 64, 3, 8, True), (20, 8, 4, 1, False),
                    (0, 16, 4, 2, False), (0, 16, 4, 2, True), (129, 32, 8, 4, False)]


def once(cache: dict, key, fn):
    """fn()'s result, computed once per `key` in `cache`; a failure is raised again to every
    test that asks for it."""
    if key not in cache:
        try:
            cache[key] = ("ok", fn())
        except Exception as exc:  # every test that needs it reports the same failure
            cache[key] = ("error", exc)
    kind, value = cache[key]
    if kind == "error":
        raise value
    return value
