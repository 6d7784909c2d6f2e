"""CPU CI for the Numba kernels: the tests/numba/sim suite in the CUDA simulator.

The simulator is picked when numba is first imported (NUMBA_ENABLE_CUDASIM=1), and this
process may already have numba on the real CUDA target (the PTX checks, GPU tests, the
sandbox), so the suite runs in a fresh interpreter with the variable set. Every Numba kernel
runs there against the reference, including the layer through sandbox.validate. About two
minutes on two cores; the simulator runs roughly 2,000 CUDA threads a second.
"""
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.simulator, pytest.mark.slow]
TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_numba_kernels_in_the_cuda_simulator():
    pytest.importorskip("numba")
    pytest.importorskip("numba_cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    # the numba suite, and the modular kernel's pairs with numba experts
    # (tests/sandbox/test_modular.py)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
           str(TESTS / "numba" / "sim"), str(TESTS / "sandbox" / "test_modular.py"),
           "-k", "numba"]
    r = subprocess.run(cmd, cwd=TESTS.parent, env=env, capture_output=True, text=True,
                       timeout=1200)
    tail = (r.stdout[-12000:] + "\n" + r.stderr[-4000:]).strip()
    assert r.returncode == 0, f"the simulator suite failed ({' '.join(cmd)}):\n{tail}"
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], tail
