"""The Numba kernels under the CUDA simulator: collected only when the simulator is on.

The simulator is chosen when numba is first imported (NUMBA_ENABLE_CUDASIM=1), so it cannot
be switched on inside a test process that has already imported numba for the GPU or for
the PTX checks. tests/numba/test_simulator.py therefore runs this folder in a fresh
subprocess with the variable set; a plain `pytest tests/` skips the folder here.

    NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/numba/sim -q     (what the runner does)
"""
import os
import sys

collect_ignore_glob = []
if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    collect_ignore_glob = ["test_*.py"]
elif "numba" in sys.modules:
    from numba.cuda.core import config as _config

    if not _config.ENABLE_CUDASIM:   # numba came up on the GPU target before us
        collect_ignore_glob = ["test_*.py"]

# Every simulated CUDA thread is a Python thread that blocks at each syncthreads; a shorter
# GIL switch interval hands the interpreter over sooner (the suite runs about 2x faster).
sys.setswitchinterval(5e-4)
