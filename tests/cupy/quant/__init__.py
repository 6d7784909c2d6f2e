"""The quantized GEMM ladders (cuda_kernels/cupy/quant/): a file per ladder and rung family."""
