"""The CuPy backend: CUDA C++ kernels (`*.cu` beside their `.py` launchers) through CuPy RawModules.

Every stage has the name, the arguments and the returns of its NumPy twin in `reference/`
(docs/stages.md); the functions take and return CuPy arrays (bf16 as `ml_dtypes.bfloat16`).

    routing.py      fused_topk, fused_topk_bias, grouped_topk, select_experts   (routing.cu)
    permute.py      moe_align_block_size, moe_permute, moe_unpermute            (permute.cu)
    activation.py   apply_activation, silu_and_mul, gelu_and_mul, ...           (activation.cu)
    combine.py      moe_sum                                                     (combine.cu)
    grouped_gemm.py grouped_gemm, a ladder of versions                          (gemm_v*.cu)
    experts.py      fused_experts: align .. combine from a plan cached per shape (the host
                    work of a decode step done once; torch tensors and CUDA graphs welcome)
    quant/          the quantized stages: grouped_gemm_quant (quant/gemm.py, two ladders:
                    w8a8 v1-v4, weight-only v1-v6), moe_kernel_quantize_input (quant/act.py)
    _compile.py     source text, CuPy compile + cache, NVRTC compile checks without a GPU
    _launch.py      launches with programmatic stream serialization (PDL: cuLaunchKernelEx)
    _stream.py      CuPy's handle on another library's stream (torch's current stream)

Importing this package needs neither a GPU nor CuPy: `availability()` says whether the
kernels can run here, and the stage modules import CuPy only when a stage is called.
Run a stage as a script to validate and time it: `python -m cuda_kernels.cupy.routing`.
"""
from __future__ import annotations

from .. import STAGE_MODULES, lazy_stages
from ._compile import availability, to_device, to_host

__all__ = [
    "availability", "to_device", "to_host",
    "fused_topk", "fused_topk_bias", "grouped_topk", "select_experts",
    "moe_align_block_size", "moe_permute", "moe_unpermute",
    "apply_activation", "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul",
    "swigluoai_and_mul", "moe_sum", "grouped_gemm", "fused_experts",
    "grouped_gemm_quant", "moe_kernel_quantize_input", "per_token_group_quant_fp8",
]

# stage name -> module that defines it; resolved on first use (PEP 562) so that a module
# still being written (or failing to import) never breaks the rest of the package
_STAGES = {
    **STAGE_MODULES,
    "fused_experts": "experts",
    "grouped_gemm_quant": "quant.gemm",
    "moe_kernel_quantize_input": "quant.act", "per_token_group_quant_fp8": "quant.act",
}


# grouped_gemm is both a submodule and the stage function. The first import of the submodule
# sets this package's attribute `grouped_gemm` to the *module*; importing it here, once, and
# binding the function afterwards keeps `cuda_kernels.cupy.grouped_gemm` the function for good
# (`importlib.import_module("cuda_kernels.cupy.grouped_gemm")` still gives the module).
try:
    from .grouped_gemm import grouped_gemm
except Exception as _gemm_error:  # noqa: BLE001 - reported when the stage is called
    _GEMM_IMPORT_ERROR = f"{type(_gemm_error).__name__}: {_gemm_error}"

    def grouped_gemm(*args, **kwargs):
        raise ImportError(f"cuda_kernels.cupy.grouped_gemm failed to import: {_GEMM_IMPORT_ERROR}")


__getattr__, __dir__ = lazy_stages(__name__, _STAGES, globals(), __all__)
