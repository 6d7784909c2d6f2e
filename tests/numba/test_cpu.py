"""The Numba backend on a CPU, outside the simulator: import guards, the numpy 2.5 shim,
argument checks, and every kernel compiled to PTX for sm_90.

The simulator (tests/numba/sim, via test_simulator.py) runs the kernels' Python; it
cannot see what only the GPU target compiles: warp shuffles, the `overload`s of
cuda_kernels/numba/_device.py (bf16 bit casts, unsigned indices), numba's typing for the
device. `cuda.compile_ptx` needs libNVVM but no GPU, so CPU CI compiles every kernel and
dtype the stages launch (cuda_kernels/numba/_ptx.py) in a fresh interpreter with the
simulator off; without NVVM those tests skip with the reason.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_py(code, sim=False, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_import_and_availability_without_numba():
    r = run_py("""
        import sys
        sys.modules["numba"] = None          # as if numba were not installed
        import cuda_kernels.numba as nb
        ok, why = nb.availability()
        assert not ok and "numba" in why, why
        assert "grouped_gemm" in nb.__all__
        print(why)
    """)
    assert r.returncode == 0, r.stdout + r.stderr


def test_availability_says_why():
    pytest.importorskip("numba_cuda")
    r = run_py("""
        import cuda_kernels.numba as nb
        ok, why = nb.availability()
        print(ok, why)
        if ok:
            assert "simulator" not in why
        else:
            assert "NUMBA_ENABLE_CUDASIM" in why
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_py("import cuda_kernels.numba as nb; ok, why = nb.availability(); "
               "assert ok and 'CUDA simulator' in why, why", sim=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _nvvm_or_skip():
    r = run_py("""
        import cuda_kernels.numba
        from numba import cuda, types
        def k(x):
            x[0] = 1
        cuda.compile_ptx(k, (types.float32[:],), cc=(9, 0))
    """)
    if r.returncode != 0:
        pytest.skip(f"numba cannot compile PTX here (no libNVVM?): {r.stderr.strip()[-300:]}")


@pytest.mark.slow
def test_numpy_without_row_stack_is_shimmed():
    """numba-cuda 0.30.4 overloads np.row_stack, which NumPy 2.5 removed (the GPU image has
    2.5.2): without the shim the first compile fails; importing cuda_kernels.numba first fixes
    it."""
    pytest.importorskip("numba_cuda")
    _nvvm_or_skip()
    compile_one = """
        from numba import cuda, types
        def k(x):
            x[0] = 1
        cuda.compile_ptx(k, (types.float32[:],), cc=(9, 0))
    """
    bare = run_py("import numpy as np\ndel np.row_stack\n" + textwrap.dedent(compile_one))
    assert bare.returncode != 0 and "row_stack" in bare.stderr, "numba no longer needs the shim?"
    shimmed = run_py("import numpy as np\ndel np.row_stack\nimport cuda_kernels.numba\n"
                     + textwrap.dedent(compile_one) + "\nassert np.row_stack is np.vstack\n")
    assert shimmed.returncode == 0, shimmed.stderr


def test_compat_shim_leaves_numpy_alone_when_it_has_row_stack():
    from cuda_kernels.numba import _compat

    before = getattr(np, "row_stack", None)
    assert _compat.apply() is (before is None)
    if before is not None:
        assert np.row_stack is before


@pytest.mark.slow
def test_every_kernel_compiles_to_ptx_for_sm90():
    """Every kernel x dtype x flavour the stages launch compiles for sm_90 (cuda_kernels/
    numba/_ptx.py); where ptxas is installed, every v3 GEMM kernel (fp32, fp16, bf16; word
    and element loads) also shows no stack frame and no spills: its TM x TN accumulators
    and prefetch registers stay in registers, not local memory."""
    pytest.importorskip("numba_cuda")
    _nvvm_or_skip()
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    args = ["--ptxas", ptxas if os.path.exists(ptxas) else ""]
    r = run_py(f"import sys, cuda_kernels.numba._ptx as p; sys.exit(p.main({args!r}))",
               timeout=2400)
    assert r.returncode == 0, (r.stdout[-12000:] + r.stderr[-4000:])


def test_bad_arguments_fail_before_any_launch():
    """Checks run on the host before numba touches a device: the same messages as the
    reference on a machine with no GPU and no simulator."""
    pytest.importorskip("numba_cuda")
    r = run_py("""
        import numpy as np, importlib
        R = importlib.import_module("cuda_kernels.numba.routing")
        G = importlib.import_module("cuda_kernels.numba.gemm")
        Al = importlib.import_module("cuda_kernels.numba.align")
        def raises(exc, text, fn, *a, **k):
            try:
                fn(*a, **k)
            except exc as e:
                assert text in str(e), str(e)
            else:
                raise AssertionError(f"no {exc.__name__} for {text}")
        x = np.zeros((2, 8), np.float32)
        raises(ValueError, "topk: expected at most the number of experts (8), got 9",
               R.fused_topk, None, x, 9, True)
        raises(TypeError, "gating_output: expected dtype in", R.fused_topk, None, x.astype(int),
               2, True)
        raises(ValueError, "router_logits: expected 8 columns", R.select_experts, None,
               x[:, :6], 2, False, True, global_num_experts=8)
        raises(ValueError, "block_size: expected an int >= 1, got 0",
               Al.moe_align_block_size, np.zeros((2, 2), np.int32), 0, 4)
        raises(TypeError, "a: expected a NumPy array or a CUDA array", G.grouped_gemm,
               [[1.0]], np.zeros((1, 1, 1), np.float32), np.zeros(1, np.int32),
               np.zeros(1, np.int32), np.zeros(1, np.int32), 1, 1)
    """)
    assert r.returncode == 0, r.stdout + r.stderr


_NO_GPU = """
        from sandbox.cli import cuda_devices    # libcuda asked directly: numba not imported
        if cuda_devices():
            print("HAS_GPU"); raise SystemExit(0)
"""   # indented as the scripts it opens, for run_py's dedent


def test_numba_backend_runs_in_the_simulator_without_being_told():
    """From Python on a machine without a GPU, with NUMBA_ENABLE_CUDASIM unset: the registry
    switches numba to the CUDA simulator before it imports numba.cuda (the layer used to
    refuse the backend until the variable was set by hand)."""
    pytest.importorskip("numba_cuda")
    r = run_py(_NO_GPU + """
        import os, numpy as np
        from sandbox import FusedMoE
        layer = FusedMoE.random(seed=1, num_experts=4, top_k=2, hidden_size=8,
                                intermediate_size=8, block_size=4)
        x, logits = layer.random_inputs(2, seed=2)
        want = layer(x, logits)
        layer.backend = "numba"
        got = layer(x, logits)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (got, want)
        assert os.environ["NUMBA_ENABLE_CUDASIM"] == "1"
        import numba
        assert numba.config.ENABLE_CUDASIM
        print("SIMULATED")
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "HAS_GPU" in r.stdout or "SIMULATED" in r.stdout, r.stdout


def test_numba_imported_first_switches_too_numba_cuda_imported_says_what_to_set():
    """`import numba` before the registry: numba's config is reloaded and the simulator is
    still chosen. `import numba.cuda` before it: the mode is fixed, and the backend is
    unavailable with a reason that says exactly what to set (nothing is flipped behind
    numba's back)."""
    pytest.importorskip("numba_cuda")
    r = run_py(_NO_GPU + """
        import numba
        from sandbox.registry import get_backend
        b = get_backend("numba")
        assert b.ok and "simulator" in b.reason, b.reason
        print("SWITCHED")
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "HAS_GPU" in r.stdout or "SWITCHED" in r.stdout, r.stdout
    r = run_py(_NO_GPU + """
        import os
        import numba.cuda
        from sandbox import FusedMoE
        from sandbox.registry import get_backend
        b = get_backend("numba")
        assert not b.ok and "NUMBA_ENABLE_CUDASIM" not in os.environ
        layer = FusedMoE.random(seed=1, num_experts=4, top_k=2, hidden_size=8,
                                intermediate_size=8, backend="numba")
        try:
            layer(*layer.random_inputs(2))
        except RuntimeError as e:
            print("ERROR", e)
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    if "HAS_GPU" not in r.stdout:
        assert "ERROR backend 'numba' (stage 'route') is not available here" in r.stdout
        assert ("numba.cuda was imported before the CUDA simulator could be switched on: set "
                "NUMBA_ENABLE_CUDASIM=1 in the environment before Python starts") in r.stdout
