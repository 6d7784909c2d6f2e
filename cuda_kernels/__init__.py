"""GPU implementations of the MoE stages.

`cuda_kernels.cupy`: CUDA C++ sources (`*.cu`) launched through CuPy RawModules.
`cuda_kernels.numba`: the same stages written in Python with `numba.cuda`.

Each stage has the name and signature of its NumPy twin in `reference/` (docs/stages.md).
The two backends never import each other and know nothing of `sandbox/`.
"""
