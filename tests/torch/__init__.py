"""The torch backend (cuda_kernels/torch/) against the NumPy reference, a file per stage; the
stages on CUDA tensors in test_cuda.py (`gpu`).

Fresh random inputs every test; ids and alignment exactly (both backends sort stably, so even
the order of slots within an expert agrees); floats within the dtype's tolerance (oracles.TOL)
against the reference fed the same inputs in float64 (exact mode), NaN only where the
reference has it (oracles.rel_err_where_defined).
"""
