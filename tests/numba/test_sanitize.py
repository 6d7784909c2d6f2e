"""compute-sanitizer over one launch of every Numba kernel (cuda_kernels/numba/_sanitize.py):
no invalid access (memcheck), no shared-memory race (racecheck). On a GPU, on request
(MOE_SANDBOX_SANITIZE=1: minutes).
"""
import os

import pytest

from tests.support import gpu_marks

pytestmark = [*gpu_marks("numba"), pytest.mark.usefixtures("numba_poison")]


def _sanitizer():
    import shutil

    path = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    return path if os.path.exists(path) else None


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MOE_SANDBOX_SANITIZE") != "1",
                    reason="minutes under the sanitizer: set MOE_SANDBOX_SANITIZE=1")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_clean(tool):
    """One representative launch of every kernel (cuda_kernels/numba/_sanitize.py) under
    compute-sanitizer: no invalid access (memcheck), no shared-memory race (racecheck), and
    every output still equal to the reference."""
    import subprocess
    import sys

    tool_path = _sanitizer()
    if tool_path is None:
        pytest.skip("compute-sanitizer not found")
    cmd = [tool_path, "--tool", tool, "--error-exitcode", "9",
           sys.executable, "-m", "cuda_kernels.numba._sanitize"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3000, check=False)
    out = r.stdout[-8000:] + r.stderr[-4000:]
    assert r.returncode == 0, f"{' '.join(cmd)} -> {r.returncode}\n{out}"
    assert "ERROR SUMMARY: 0 errors" in out or "RACECHECK SUMMARY: 0 hazards" in out, out
