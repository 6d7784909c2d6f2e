"""The Numba backend: the MoE stages written in Python with `numba.cuda`.

Every stage has the name, the arguments and the returns of its NumPy twin in `reference/`
(docs/stages.md). A stage takes NumPy arrays (copied to the device and back: host in, host
out) or device arrays (numba device arrays, CuPy arrays, torch CUDA tensors, anything with
`__cuda_array_interface__`, used without copies) and returns the kind it was given.

One file per stage (the listing of reference/, cupy/ and torch/):
    routing.py       fused_topk, fused_topk_bias, grouped_topk, select_experts (its
                     kernels, "keys" / "warp" / "block": routing_kernels.py)
    align.py         moe_align_block_size, max_num_tokens_padded (the multi-launch "warp" /
                     "block" ranks; the one-launch "grid" kernel, the GPU default:
                     align_grid.py)
    permute.py       moe_permute, moe_unpermute
    gemm.py          grouped_gemm, a ladder of versions (v1 naive, v2 shared-memory tiles,
                     v3 register blocking, v3v = v3 with 16-byte loads, the default)
    activation.py    apply_activation, silu_and_mul, gelu_and_mul, gelu_tanh_and_mul,
                     swigluoai_and_mul (and the no-mul silu / gelu / gelu_tanh / relu2)
    combine.py       moe_sum
The helpers:
    _arrays.py       array kinds, outputs in the caller's framework, argument checks,
                     availability(), to_device / to_host, poisoned_outputs()
    _device.py       device helpers: bf16 bits <-> fp32, 8-byte word unpacking, fp32 math,
                     unsigned indices, comparisons
    _compat.py       the np.row_stack shim numba-cuda 0.30 needs on NumPy >= 2.5
    _ptx.py          every kernel the stages launch, compiled to PTX for sm_90 with no GPU
                     (CPU CI: python -m cuda_kernels.numba._ptx)
    _sanitize.py     one launch of every kernel, for compute-sanitizer
    _vector.py, _wide.py   4-wide shared / global loads (the GEMM), 16-byte row copies
    _script.py       parity and CUDA-event timing for the modules run as scripts

Kernels launch on the legacy default stream (ordered with CuPy's and torch's default
streams), or on the stream a caller names with `using_stream(ptr)` (sandbox.streams passes
torch's current stream, so that torch streams and CUDA graph captures see the kernels).
bf16 outputs use cvt.rn.bf16.f32 (sm_80+).

The kernels also run in the CUDA simulator (`NUMBA_ENABLE_CUDASIM=1` set before numba is
imported): slowly (about 2,000 threads a second), but on any CPU, which is how CI checks them.
This package never switches the simulator on by itself (the PTX checks need numba's real
CUDA target on a CPU); `sandbox.registry.get_backend("numba")` does, on a machine without a
GPU, as long as numba.cuda is not imported yet.
Importing this package needs neither numba nor a GPU: `availability()` says whether the kernels
can run here and why not. Run a stage as a script to validate and time it:
`python -m cuda_kernels.numba.gemm`.
"""
from __future__ import annotations

# first: the shim must be in place before numba compiles anything. A submodule import runs
# this file before its own body, so the stage modules may import numba at their top.
from . import _compat  # noqa: F401
from .. import STAGE_MODULES, lazy_stages
from ._arrays import availability, poisoned_outputs, to_device, to_host, using_stream

__all__ = [
    "availability", "to_device", "to_host", "poisoned_outputs", "using_stream",
    "fused_topk", "fused_topk_bias", "grouped_topk", "select_experts",
    "moe_align_block_size", "moe_permute", "moe_unpermute",
    "apply_activation", "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul",
    "swigluoai_and_mul", "moe_sum", "grouped_gemm",
]

# stage name -> module that defines it (STAGE_MODULES), imported on first use (PEP 562):
# importing the package never imports numba, and a failing module never breaks the others
__getattr__, __dir__ = lazy_stages(__name__, STAGE_MODULES, globals(), __all__)
