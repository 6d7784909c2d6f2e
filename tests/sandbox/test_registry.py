"""The stage/backend registry and the array movers between backends."""

from __future__ import annotations

import sys
import types

import ml_dtypes
import numpy as np
import pytest

from sandbox import arrays, registry
from sandbox.registry import (
    BACKENDS,
    STAGE_FUNCTIONS,
    STAGES,
    available_backends,
    get_backend,
    resolve_stage_mapping,
)


@pytest.fixture
def fresh_registry():
    registry.clear_cache()
    yield
    registry.clear_cache()


def test_stage_table():
    assert STAGES == ("route", "align", "gemm1", "activation", "gemm2", "combine")
    assert STAGE_FUNCTIONS == {"route": "select_experts", "align": "moe_align_block_size",
                               "gemm1": "grouped_gemm", "activation": "apply_activation",
                               "gemm2": "grouped_gemm", "combine": "moe_sum"}
    assert BACKENDS == ("reference", "torch", "cupy", "numba")


def test_resolve_stage_mapping():
    assert resolve_stage_mapping(None) == {s: "reference" for s in STAGES}
    assert resolve_stage_mapping("torch") == {s: "torch" for s in STAGES}
    m = resolve_stage_mapping({"route": "numba", "gemm1": "cupy"})
    assert m == {"route": "numba", "align": "reference", "gemm1": "cupy",
                 "activation": "reference", "gemm2": "reference", "combine": "reference"}
    assert list(m) == list(STAGES)


@pytest.mark.parametrize("spec,match", [
    ("triton", r"backend.*reference.*torch.*cupy.*numba.*'triton'"),
    ({"gemm3": "torch"}, r"unknown stage 'gemm3'.*route.*combine"),
    ({"gemm1": "cutlass"}, r"unknown backend 'cutlass'.*reference.*numba"),
])
def test_resolve_stage_mapping_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        resolve_stage_mapping(spec)
    with pytest.raises(TypeError, match="backend"):
        resolve_stage_mapping(3)


def test_available_backends_here():
    avail = available_backends()
    assert tuple(avail) == BACKENDS
    for name, (ok, reason) in avail.items():
        assert isinstance(ok, bool) and isinstance(reason, str)
        if not ok:
            assert reason, f"{name} is unavailable without saying why"
    assert avail["reference"][0] and avail["torch"][0]


def test_get_backend():
    with pytest.raises(ValueError, match=r"expected one of \['reference', 'torch'"):
        get_backend("jax")
    tb = get_backend("torch")
    from cuda_kernels import torch as torch_backend

    assert tb.module is torch_backend
    assert tb.grouped_gemm is torch_backend.grouped_gemm        # falls through to the module
    assert tb.stage_fn("gemm2") is torch_backend.grouped_gemm
    assert tb.stage_fn("combine") is torch_backend.moe_sum
    ref = get_backend("reference")
    import reference

    assert ref.stage_fn("align") is reference.moe_align_block_size
    assert ref.is_host and ref.array_kind == "numpy"
    with pytest.raises(ValueError, match="stage"):
        ref.stage_fn("permute")


def test_missing_gpu_package_is_reported_not_raised(fresh_registry, monkeypatch):
    monkeypatch.setitem(registry._MODULE, "cupy", "cuda_kernels.no_such_backend")
    ok, reason = available_backends()["cupy"]
    assert not ok and "not importable" in reason and "no_such_backend" in reason
    b = get_backend("cupy")
    with pytest.raises(RuntimeError, match="not available"):
        b.stage_fn("route")


def test_backend_without_availability_or_stage(fresh_registry, monkeypatch):
    fake = types.ModuleType("fake_numba_backend")
    monkeypatch.setitem(sys.modules, "fake_numba_backend", fake)
    monkeypatch.setitem(registry._MODULE, "numba", "fake_numba_backend")
    ok, reason = available_backends()["numba"]
    assert not ok and "availability" in reason
    registry.clear_cache()
    fake.availability = lambda: (True, "")
    fake.to_device = fake.to_host = lambda a: a
    fake.moe_sum = lambda x: x.sum(1)
    b = get_backend("numba")
    assert b.ok and b.has_stage("combine") and not b.has_stage("route")
    with pytest.raises(NotImplementedError, match="select_experts"):
        b.stage_fn("route")


def test_availability_that_raises_is_a_reason(fresh_registry, monkeypatch):
    fake = types.ModuleType("fake_cupy_backend")

    def boom():
        raise OSError("driver exploded")

    fake.availability = boom
    monkeypatch.setitem(sys.modules, "fake_cupy_backend", fake)
    monkeypatch.setitem(registry._MODULE, "cupy", "fake_cupy_backend")
    ok, reason = available_backends()["cupy"]
    assert not ok and "driver exploded" in reason


def test_gemm_config_from_backend(fresh_registry, monkeypatch):
    fake = types.ModuleType("fake_cupy_cfg")
    fake.availability = lambda: (True, "")
    fake.to_device = fake.to_host = lambda a: a
    seen = {}

    def get_config(M, N, K, E, top_k, dtype, version):
        seen.update(M=M, N=N, K=K, E=E, top_k=top_k, dtype=dtype, version=version)
        return {"BLOCK_M": 16, "BLOCK_N": 64}

    fake.get_config = get_config
    monkeypatch.setitem(sys.modules, "fake_cupy_cfg", fake)
    monkeypatch.setitem(registry._MODULE, "cupy", "fake_cupy_cfg")
    cfg = get_backend("cupy").gemm_config(33, 128, 64, 8, 2, np.float32)
    assert cfg["BLOCK_M"] == 16 and seen["M"] == 33 and seen["version"] is None


# ----------------------------------------------------------------------------- arrays
def test_torch_numpy_bf16_roundtrip():
    torch = pytest.importorskip("torch")
    a = np.random.default_rng(3).standard_normal((4, 6)).astype(ml_dtypes.bfloat16)
    t = arrays.numpy_to_torch(a)
    assert t.dtype == torch.bfloat16 and arrays.dtype_of(t) == a.dtype
    assert np.array_equal(arrays.torch_to_numpy(t), a)
    assert np.array_equal(arrays.to_numpy(t), a)
    ro = a.copy()
    ro.flags.writeable = False                             # safetensors hands out read-only
    assert np.array_equal(arrays.torch_to_numpy(arrays.numpy_to_torch(ro)), a)


def test_take_between_host_backends():
    """Backend.take moves an array by its own kind: no record of who made it is needed."""
    torch = pytest.importorskip("torch")
    ref, tb = get_backend("reference"), get_backend("torch")
    a = np.random.default_rng(4).standard_normal((3, 5)).astype(np.float32)
    t = tb.take(a)
    assert isinstance(t, torch.Tensor) and np.array_equal(t.numpy(), a)
    back = ref.take(t)
    assert isinstance(back, np.ndarray) and np.array_equal(back, a)
    assert ref.take(a) is a                                 # accepted as it is: untouched
    assert tb.take(t) is t
    for v in (None, 3, "silu", True, len):
        assert tb.take(v) is v                              # non-arrays pass through
    pair = tb.take((a, None))
    assert isinstance(pair, tuple) and pair[1] is None and isinstance(pair[0], torch.Tensor)


def test_kind_and_is_device():
    assert arrays.kind(None) == "none"
    assert arrays.kind(np.zeros(2)) == "numpy" and not arrays.is_device(np.zeros(2))
    torch = pytest.importorskip("torch")
    assert arrays.kind(torch.zeros(2)) == "torch" and not arrays.is_device(torch.zeros(2))


@pytest.mark.gpu
def test_gpu_zero_copy_between_libraries():
    """On the GPU: torch <-> CuPy <-> Numba views share memory (no copies)."""
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    for dst in ("cupy", "numba"):
        try:
            v = arrays.zero_copy(t, dst)
        except ImportError:
            continue
        if v is None:
            continue
        back = arrays.zero_copy(v, "torch")
        assert back is not None and back.data_ptr() == t.data_ptr()
