"""What the two quantized ladders share: the epilogue's operands, the argument checks, the
compiled-kernel cache and the split-K workspace.

    c[s] = (acc[s] + bias[e]) * (topk_weights.flat[s] if mul_routed_weight)   fp32, then one
                                                                             rounding to c's type

Every rung ends with this epilogue (common.cuh's qg_epilogue, or its copy in each kernel), so
its operands are checked and converted once, here: topk_weights [P] fp32, bias [E, N] fp32,
c [P, N] bf16 / fp16 (`out`, or a new array). quant/w8a8.py and quant/wna16.py import this
module and nothing of each other; quant/gemm.py, the stage, imports both.

Shape legend: P = a.shape[0] * top_k slots, E experts, N output width, L = len(sorted_token_ids).
"""
from __future__ import annotations

import numpy as np

from .. import _arrays as A
from .. import _compile as C
from .._geometry import cdiv

ELEMS = {"bf16": 1, "fp16": 0}    # the ELEM_BF16 define of every quantized .cu
ALIGN = 16                        # cp.async and the streaming loads move 16-byte chunks


def elem_key(dtype) -> str:
    """"bf16" (uint16: bf16's bytes) or "fp16"."""
    dt = np.dtype(dtype)
    if dt == A.bf16_dtype() or dt == np.uint16:
        return "bf16"
    if dt == np.float16:
        return "fp16"
    raise TypeError(f"expected bfloat16 or float16, got {dt}")


def f32(name, x, shape=None):
    """A float CuPy array as contiguous fp32 (bf16 widened exactly), shape-checked."""
    import cupy

    A.check_array(name, x, dtypes=A.float_dtypes(), shape=shape, contiguous=False)
    if np.dtype(x.dtype) == A.bf16_dtype():
        return (A.raw(x).astype(cupy.uint32) << 16).view(cupy.float32).reshape(x.shape)
    return cupy.ascontiguousarray(x.astype(cupy.float32, copy=False))


def aligned(*arrays) -> bool:
    return all(x is None or x.data.ptr % ALIGN == 0 for x in arrays)


def check_routing(sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_size):
    """(top_k, block_size, L) after checking the alignment's arrays (int32 on this device)."""
    top_k = A.check_int("top_k", top_k, 1)
    block_size = A.check_int("block_size", block_size, 1)
    A.check_array("sorted_token_ids", sorted_token_ids, ndim=1, dtypes=(np.int32,))
    A.check_array("expert_ids", expert_ids, ndim=1, dtypes=(np.int32,))
    A.check_array("num_tokens_post_padded", num_tokens_post_padded, dtypes=(np.int32,))
    if num_tokens_post_padded.size < 1:
        raise ValueError("num_tokens_post_padded: expected one int32, got an empty array")
    L = sorted_token_ids.size
    if expert_ids.size < cdiv(L, block_size):
        raise ValueError(f"expert_ids: expected at least cdiv({L}, {block_size}) = "
                         f"{cdiv(L, block_size)} blocks, got {expert_ids.size}")
    return top_k, block_size, L


def check_weights(w, dtypes):
    """w [E, N, Kdim or Kdim/2]: a C-contiguous CuPy array on this device whose *one expert*
    fits 32-bit offsets. The kernels add a 64-bit expert base (e * N * row bytes, once per
    CTA) and index inside the expert in 32 bits, so the whole array may exceed 2^31 bytes
    (DeepSeek-V3's fp8 w13 is 256 * 4096 * 7168 = 7.5e9)."""
    import cupy

    if not isinstance(w, cupy.ndarray):
        A.check_array("w", w)                               # raises the usual TypeError
    if w.ndim != 3:
        raise ValueError(f"w: expected 3 dimensions [E, N, Kdim], got shape {w.shape}")
    A.check_array("w", w[:1], ndim=3, dtypes=dtypes, contiguous=False)   # device, dtype
    if not w.flags.c_contiguous:
        raise ValueError(f"w: expected a C-contiguous array, got strides {w.strides} for shape "
                         f"{w.shape} (call cupy.ascontiguousarray first)")
    A.check_fits_int32("w", w.shape[1] * w.shape[2], "one expert's N * row bytes")


def epilogue_operands(P, E, N, out_key, mul_routed_weight, topk_weights, bias, out):
    """(topk weights [P] fp32 or None, bias [E, N] fp32 or None, c [P, N]): the checked
    epilogue operands of a quantized grouped GEMM with P slots. c is `out` (checked: [P, N],
    the output's element type) or a new array."""
    A.check_fits_int32("a", P, "a.shape[0] * top_k")   # slots are int32; offsets are 64-bit
    if mul_routed_weight:
        if topk_weights is None:
            raise ValueError("topk_weights: expected an array when mul_routed_weight=True, "
                             "got None")
        tw = f32("topk_weights", topk_weights).reshape(-1)
        if tw.size != P:
            raise ValueError(f"topk_weights: expected {P} weights (a rows * top_k), got shape "
                             f"{topk_weights.shape}")
    else:
        tw = None
    b32 = f32("bias", bias, shape=(E, N)) if bias is not None else None
    if out is None:
        c = A.empty((P, N), A.bf16_dtype() if out_key == "bf16" else np.float16)
    else:
        A.check_array("out", out, ndim=2, shape=(P, N))
        if elem_key(out.dtype) != out_key:
            raise TypeError(f"out: expected dtype {out_key}, got {out.dtype}")
        c = out
    return tw, b32, c


def positions(L: int, P: int, block_size: int) -> int:
    """Lg, the positions a grid must cover: num_tokens_post_padded = sum_e ceil(c_e / B) * B
    <= P * B (each expert with c_e >= 1 slots pads fewer than c_e * (B - 1)), while L is sized
    for every expert getting a block (P + E (B - 1)). At decode that bound is much smaller:
    DeepSeek-V3 T=1 has L = 3848 but at most 128 live positions, and CTAs past it would only
    read num_tokens_post_padded and exit, thousands of them per launch."""
    return min(L, P * block_size)


# ----------------------------------------------------------------------------- launching
def instantiation(template: str, *args) -> str:
    """The C++ name of one instantiation of a kernel template: "name<a, b, ...>" (what the
    launchers pass as name_expressions; the cubin's symbols are looked up by it)."""
    return f"{template}<{', '.join(str(a) for a in args)}>"


def register_cases(cu_by_rung: dict, names_by_rung: dict, options_by_rung: dict | None = None):
    """Every instantiation a ladder can launch, for the CPU compile checks: one case per rung's
    file and element type (NVRTC compiles a case's names in one pass)."""
    for ev in ELEMS.values():
        for rung, cu in cu_by_rung.items():
            C.register_compile_case(cu, {"ELEM_BF16": ev}, names_by_rung[rung],
                                    (options_by_rung or {}).get(rung, ()))


_READY: dict = {}
_SMEM_SET: dict = {}


def kernel(cu: str, name: str, group: tuple[str, ...], elem: int, smem: int,
           options: tuple[str, ...] = ()):
    """The compiled kernel `name` of `cu` (one NVRTC pass compiles `group`, the names a module
    launches from that file), its dynamic shared-memory limit raised when it needs more than
    the default 48 KB (a CTA gets more only after opting in)."""
    import cupy

    key = (cu, name, elem, cupy.cuda.Device().id)
    kern = _READY.get(key)
    if kern is None:
        names = group if name in group else (name,)    # a config outside the table: alone
        kern = C.get_kernel(cu, name, {"ELEM_BF16": elem}, names, options=options)
        _READY[key] = kern
    if smem > 48 * 1024 and _SMEM_SET.get(key, 0) < smem:
        kern.max_dynamic_shared_size_bytes = smem
        _SMEM_SET[key] = smem
    return kern


_WS: dict = {}


def workspace(floats: int, counters: int):
    """Split-K partials (fp32) and per-tile arrival counters (int32), cached per device and
    grown on demand. The counters start at zero and the last CTA of each tile resets its own,
    so launches on one stream reuse them; concurrent launches on two streams must not share a
    device's."""
    import cupy

    dev = cupy.cuda.Device().id
    ws, cnt = _WS.get(dev, (None, None))
    if ws is None or ws.size < floats:
        ws = cupy.empty(max(floats, 1 << 16), dtype=cupy.float32)
    if cnt is None or cnt.size < counters:
        cnt = cupy.zeros(max(counters, 1 << 12), dtype=cupy.int32)
    _WS[dev] = (ws, cnt)
    return ws, cnt


_SMS: dict = {}


def num_sms() -> int:
    """The current device's SM count (asked once per device)."""
    import cupy

    dev = cupy.cuda.Device().id
    if dev not in _SMS:
        _SMS[dev] = cupy.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"]
    return _SMS[dev]
