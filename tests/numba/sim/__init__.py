"""The Numba kernels in the CUDA simulator (run by tests/numba/test_simulator.py)."""
