"""The implementations of the MoE stages that the NumPy reference judges.

`cuda_kernels.cupy`: CUDA C++ sources (`*.cu`) launched through CuPy RawModules.
`cuda_kernels.numba`: the same stages written in Python with `numba.cuda`.
`cuda_kernels.torch`: the same stages in plain torch (CPU or CUDA): the outside oracle and
the baseline a torch user would otherwise run.
`cuda_kernels.timing`: the one GPU timer (CUDA events or graph replays through torch or
CuPy) that the kernel scripts, the tuner, the benchmarks and sandbox.bench share.

Each stage has the name and signature of its NumPy twin in `reference/` (docs/stages.md), in
a file of the same name in every backend (routing, align, permute, gemm, activation,
combine; STAGE_MODULES below). The backends never import each other and know nothing of
`sandbox/`; importing a backend package imports no GPU library (its stages load on first use).
"""

# stage name -> the module of a backend package that defines it: cupy/, numba/ and torch/
# share this layout (one module per stage, as reference/); each adds its own stages to it
STAGE_MODULES = {
    "fused_topk": "routing", "fused_topk_bias": "routing", "grouped_topk": "routing",
    "select_experts": "routing",
    "moe_align_block_size": "align", "moe_permute": "permute", "moe_unpermute": "permute",
    "apply_activation": "activation", "silu_and_mul": "activation",
    "gelu_and_mul": "activation", "gelu_tanh_and_mul": "activation",
    "swigluoai_and_mul": "activation",
    "grouped_gemm": "gemm",
    "moe_sum": "combine",
}


def lazy_stages(package: str, stages: dict, namespace: dict, exported: list):
    """A backend package's module `__getattr__` and `__dir__` (PEP 562): stage `name` is
    imported from `package.stages[name]` on first use and then bound in `namespace`, so that
    importing the package imports no GPU library, and a module that fails to import breaks
    only its own stages."""
    def __getattr__(name: str):
        module = stages.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later look-ups skip this function
        return value

    def __dir__():
        return sorted(set(namespace) | set(exported))

    return __getattr__, __dir__
