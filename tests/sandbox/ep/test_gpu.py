"""Expert parallelism over NCCL (cupy.cuda.nccl) on two GPUs: the collectives, parity of
the layer (CuPy kernels when they are available, else the reference on the host), EPLB,
faults and refusals. Skipped unless CuPy sees two or more GPUs (conftest.py).

The lead runs them on an H200 pair (EP_TEST_WORLD=4 or 8 on bigger machines):
    .venv/bin/python -m pytest -q -m multigpu tests/sandbox/ep/test_gpu.py
    EP_TEST_WORLD=8 .venv/bin/python -m pytest -q -m multigpu tests/sandbox/ep/test_gpu.py
"""
import os
import re

import numpy as np
import pytest

from sandbox.ep import LaunchError, launch
from sandbox.ep.checks import (COLLECTIVE_CHECKS, fault_and_report_pid, parity_cases,
                               run_collectives, run_parity, run_refusals)
from tests.support import once

pytestmark = pytest.mark.multigpu
WORLD = int(os.environ.get("EP_TEST_WORLD", "2"))   # ranks (GPUs) the tests use


def _gpus():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def _compute_backend():
    from sandbox.registry import get_backend

    return "cupy" if get_backend("cupy").ok else "reference"


_CACHE = {}


def _once(key, fn):
    return once(_CACHE, key, fn)


@pytest.mark.parametrize("check", COLLECTIVE_CHECKS)
def test_nccl_collectives(check):
    results = _once("collectives", lambda: launch(run_collectives, WORLD, backend="nccl",
                                                   timeout=60))
    assert all(res[check] for res in results), [res[check] for res in results]


CASES = parity_cases(WORLD)


@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_nccl_ep_matches_single_device(name):
    backend = _compute_backend()
    per_rank = _once("parity", lambda: launch(run_parity, WORLD, backend="nccl",
                                              args=(CASES, backend), timeout=120))
    i = [c["name"] for c in CASES].index(name)
    for res in (r[i] for r in per_rank):
        tol = res["tolerance"] if backend == "reference" else max(res["tolerance"], 2e-5)
        assert not np.isnan(res["error"]) and res["error"] <= tol, res
        if "error_after_rebalance" in res:
            assert res["error_after_rebalance"] <= tol, res


@pytest.mark.parametrize("fault,pattern", [
    ("raise", r"rank 1: RuntimeError: injected failure on rank 1"),
    ("exit", r"rank 1: rank 1 exited with code 7"),
    ("hang", r"rank 0: CommTimeoutError: rank 0: .*(did not complete within|blocked for more "
             r"than) 5.0 s"),
])
def test_nccl_faults_stop_every_rank(fault, pattern, tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(fault_and_report_pid, WORLD, backend="nccl", args=(fault, 1, str(tmp_path)),
               timeout=5.0, grace=8.0)
    message = str(info.value)
    assert re.search(pattern, message), message
    for r in range(WORLD):
        path = tmp_path / f"rank{r}.pid"
        if path.exists():
            pid = int(path.read_text())
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_nccl_refusals():
    for res in launch(run_refusals, WORLD, backend="nccl", timeout=60):
        assert res["indivisible"] and res["mismatch"].startswith("ConfigMismatchError")
        assert res["healthy_after"]


def test_nccl_wrong_device_is_refused():
    if _gpus() < WORLD:
        pytest.skip(f"EP_TEST_WORLD={WORLD} but {_gpus()} GPUs are visible")
    with pytest.raises(LaunchError, match="ranks 0 and 1 were both given device 0"):
        launch(fault_and_report_pid, WORLD, backend="nccl", args=("none",),
               devices=[0, 0] + list(range(2, WORLD)), timeout=30)
    with pytest.raises(LaunchError, match=r"device: expected a GPU index in \[0, "):
        launch(fault_and_report_pid, WORLD, backend="nccl", args=("none",),
               devices=list(range(WORLD - 1)) + [_gpus() + 3], timeout=30)
