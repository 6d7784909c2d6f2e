"""The torch backend's module API (cuda_kernels/torch/_tensors.py): availability, and arrays
to tensors and back in every dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cuda_kernels import torch as tb
from tests.oracles import rng_for

torch = pytest.importorskip("torch")


def test_availability_and_roundtrip():
    ok, reason = tb.availability()
    assert ok and "torch" in reason
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16, np.int32):
        a = (rng_for("rt", str(dt)).standard_normal((3, 5)) * 10).astype(dt)
        t = tb.to_device(a)
        back = tb.to_host(t)
        assert back.dtype == np.dtype(dt) and np.array_equal(back, a)
