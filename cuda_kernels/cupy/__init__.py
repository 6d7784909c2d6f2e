"""The CuPy backend: CUDA C++ kernels (`*.cu` beside their `.py` launchers) through CuPy RawModules.

Every stage has the name, the arguments and the returns of its NumPy twin in `reference/`
(docs/stages.md); the functions take and return CuPy arrays (bf16 as `ml_dtypes.bfloat16`).

One file per stage (the listing of reference/, numba/ and torch/):
    routing.py      fused_topk, fused_topk_bias, grouped_topk, select_experts   (routing.cu)
    align.py        moe_align_block_size (its output's length: the reference's)  (align.cu)
    permute.py      moe_permute, moe_unpermute                                  (permute.cu)
    gemm.py         grouped_gemm, a ladder of versions v1..v6                   (gemm_v*.cu,
                    gemm_common.cuh, gemm_wgmma.cuh, wgmma_operands.cuh)
    activation.py   apply_activation, silu_and_mul, gelu_and_mul, ...           (activation.cu)
    combine.py      moe_sum                                                     (combine.cu)
    experts.py      fused_experts: align .. combine from a plan cached per shape (the host
                    work of a decode step done once; torch tensors and CUDA graphs welcome)
The ladder's helpers and the other kernels:
    gemm_configs.py the GEMM's tunables: gemm_configs.json, the heuristic, the rung and tiles
                    for a problem, #defines and launch geometry;  tune.py refills the table
    gemm_tensor_map.py  v6's CUtensorMap of the weights (cuTensorMapEncodeTiled)
    grouping.cuh    the stable grouping by expert that align.cu and permute.cu share
    elementwise.cuh fp32 conversions and 16-byte packs of the row-wise kernels
    quant/          the quantized stages: grouped_gemm_quant (quant/gemm.py, two ladders:
                    w8a8 v1-v4, weight-only v1-v6), moe_kernel_quantize_input (quant/act.py)
    ep_layout.py    the expert-parallel dispatch layout                         (ep_layout.cu)
    _compile.py     source text (local includes inlined), CuPy compile + cache, NVRTC compile
                    checks without a GPU, the compile cases CPU CI builds
    _arrays.py      availability, CuPy arrays (bf16, poisoned outputs) and the launchers'
                    argument checks
    _geometry.py    launch geometry: cdiv, block_threads, row_geometry
    _script.py      script_start and rel_err of the modules run as scripts (timing:
                    cuda_kernels/timing.py, the one GPU timer)
    _launch.py      launches with programmatic stream serialization (PDL: cuLaunchKernelEx)
    _stream.py      CuPy's handle on another library's stream (torch's current stream)

Importing this package needs neither a GPU nor CuPy: `availability()` says whether the
kernels can run here, and the stage modules import CuPy only when a stage is called.
Run a stage as a script to validate and time it: `python -m cuda_kernels.cupy.routing`.
"""
from __future__ import annotations

from .. import STAGE_MODULES, lazy_stages
from ._arrays import availability, to_device, to_host

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


__getattr__, __dir__ = lazy_stages(__name__, _STAGES, globals(), __all__)
