"""The CuPy backend (cuda_kernels/cupy/): a file per stage, on the GPU and in the CPU emulator."""
