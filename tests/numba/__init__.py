"""The Numba backend (cuda_kernels/numba/): a file per stage on a real GPU, the PTX checks on a
CPU (test_cpu.py, test_gemm.py's v3v), the kernels in the CUDA simulator (sim/, run by
test_simulator.py in a fresh interpreter).

The GPU tests: every one is `gpu` and skips cleanly without a usable device (or under the
simulator, which sim/ covers; tests/support.py's gpu_marks("numba")). Outputs are poisoned
(NaN / POISON_INT) before every launch (the `numba_poison` fixture), so an element a kernel
forgets fails. Inputs are host NumPy arrays (host in, host out: the stage copies) unless a test
is about array kinds. Every kernel and dtype runs by default, on a subset of the shape grids
that fits a GPU session's budget (each new kernel x dtype costs a JIT compile of a few seconds
the first time); MOE_SANDBOX_FULL_GRID=1 runs the CuPy tests' full grids in every dtype
(tests/support.py's full_grid).
"""
