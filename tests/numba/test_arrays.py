"""The Numba stages take and return every array kind (cuda_kernels/numba/_arrays.py): numba
device arrays, torch CUDA tensors, CuPy arrays, on a real GPU.

`gpu` tests, outputs poisoned (tests/numba/__init__.py says how).
"""
import importlib

import numpy as np
import pytest

import reference
from cuda_kernels import numba as nb
from tests.oracles import assert_output_close, rng_for, uniform
from tests.support import DTYPES, gpu_marks, runs_kernels

pytestmark = [*gpu_marks("numba"), pytest.mark.usefixtures("numba_poison")]

if runs_kernels("numba"):   # imports numba on its CUDA target: only where it runs
    R = importlib.import_module("cuda_kernels.numba.routing")
    Ac = importlib.import_module("cuda_kernels.numba.activation")
    Cb = importlib.import_module("cuda_kernels.numba.combine")


def draw_logits(T, E, dtype, *params):
    return uniform(rng_for("logits", T, E, str(dtype), *params), (T, E), 2.0).astype(dtype)


def test_numba_device_arrays_in_numba_arrays_out():
    x = draw_logits(10, 16, np.float32)
    w, ids, _ = R.fused_topk(None, nb.to_device(x), 2, True)
    assert type(w).__module__.startswith("numba")
    np.testing.assert_array_equal(nb.to_host(ids), reference.fused_topk(None, x, 2, True)[1])


@pytest.mark.parametrize("dkey", DTYPES)
def test_torch_tensors_in_torch_tensors_out(dkey):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    dt = DTYPES[dkey]
    tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dkey]
    x = uniform(rng_for("torch", dkey), (5, 3, 40), 1.0, dt)
    t = torch.from_numpy(x.astype(np.float32)).to("cuda", tdt)
    out = Cb.moe_sum(t)
    assert isinstance(out, torch.Tensor) and out.dtype == tdt and out.is_cuda
    assert_output_close(nb.to_host(out), reference.moe_sum(x.astype(np.float64)), dt,
                        "torch moe_sum")
    act = Ac.silu_and_mul(t.reshape(15, 40))
    assert isinstance(act, torch.Tensor) and act.dtype == tdt


@pytest.mark.parametrize("dkey", DTYPES)
def test_cupy_arrays_in_cupy_arrays_out(dkey):
    cupy = pytest.importorskip("cupy")
    dt = DTYPES[dkey]
    x = uniform(rng_for("cupy", dkey), (6, 2, 33), 1.0, dt)
    try:
        d = cupy.asarray(x)
    except Exception:
        pytest.skip("this CuPy has no bf16")
    out = Cb.moe_sum(d)
    assert isinstance(out, cupy.ndarray)
    assert_output_close(nb.to_host(out).view(dt) if out.dtype == np.uint16 else nb.to_host(out),
                 reference.moe_sum(x.astype(np.float64)), dt, "cupy moe_sum")
