"""The Numba backend (cuda_kernels/numba/): a file per stage on the GPU, the PTX checks on a CPU."""
