"""The torch backend: every stage of docs/stages.md written in plain torch (CPU and CUDA).

Every stage has the name, the arguments and the returns of its NumPy twin in `reference/`
(docs/stages.md); the stages take torch tensors (NumPy arrays are accepted and moved to
device()) and return tensors.

It plays two parts. It is the *outside oracle*: an independent implementation (torch's
softmax, sort, bincount and matmul, not NumPy's) that the harness compares with the
reference, so that a bug shared by the reference and a kernel written from it still shows
(only what is not math comes from the reference: the dispatch of select_experts, the
capacity of sorted_token_ids, argument checks). And it is the *baseline a user would
otherwise pick*: `fused_experts(..., impl="loop")` is the per-expert Python loop of most MoE
ports, and `impl="grouped_mm"` runs `torch._grouped_mm` on the contiguous layout.

One file per stage (the listing of reference/, cupy/ and numba/):
    routing.py      fused_topk, fused_topk_bias, grouped_topk, select_experts (and
                    zero_experts_compute, the tensor tail of select_experts)
    align.py        moe_align_block_size
    permute.py      moe_permute, moe_unpermute
    gemm.py         grouped_gemm (impl "loop" or "grouped_mm"), grouped_mm
    activation.py   apply_activation, silu_and_mul, gelu_and_mul, gelu_tanh_and_mul,
                    swigluoai_and_mul
    combine.py      moe_sum
    experts.py      fused_experts: the whole computation as a torch user writes it
    _tensors.py     availability(), device(), to_device / to_host, NumPy <-> torch, checks

Precision: like the reference, every stage computes in fp32 (fp64 for fp64 inputs) and
rounds its floating output to the dtype of its main input at the reference's rounding
points. One exception, on purpose: `grouped_gemm(..., impl="grouped_mm")` lets
`torch._grouped_mm` round the product before the bias and the routed weight.
Device: CUDA when torch sees a GPU, else the CPU (`MOE_SANDBOX_TORCH_DEVICE` overrides).

Importing this package imports no GPU library and not torch itself: the stage modules are
imported on first use (PEP 562) and import torch inside their functions. Compare every
stage with the reference: `moe-sandbox validate --backend torch`.
"""
from __future__ import annotations

from .. import STAGE_MODULES, lazy_stages
from ._tensors import (
    availability,
    device,
    numpy_dtype,
    numpy_to_torch,
    to_device,
    to_host,
    torch_dtype,
    torch_to_numpy,
)

__all__ = [
    "availability", "device", "to_device", "to_host",
    "numpy_to_torch", "torch_to_numpy", "torch_dtype", "numpy_dtype",
    "fused_topk", "fused_topk_bias", "grouped_topk", "select_experts", "zero_experts_compute",
    "moe_align_block_size", "moe_permute", "moe_unpermute",
    "grouped_gemm", "grouped_mm", "grouped_mm_supported", "GEMM_IMPLS", "default_gemm_impl",
    "apply_activation", "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul",
    "swigluoai_and_mul", "ACTIVATIONS", "moe_sum", "fused_experts",
]

# stage name -> module that defines it, imported on first use (PEP 562)
_STAGES = {
    **STAGE_MODULES,
    "zero_experts_compute": "routing",
    "grouped_mm": "gemm", "grouped_mm_supported": "gemm", "GEMM_IMPLS": "gemm",
    "default_gemm_impl": "gemm",
    "ACTIVATIONS": "activation",
    "fused_experts": "experts",
}


__getattr__, __dir__ = lazy_stages(__name__, _STAGES, globals(), __all__)
