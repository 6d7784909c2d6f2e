"""Device-side helpers shared by the Numba kernels: dtype conversion, fp32 math, comparisons.

Every kernel loads through `to_f32(x)` and stores through `out[i] = cast_out(out, v)`, so one
kernel body serves fp32, fp16 and bf16 (and fp64 inputs where a stage accepts them):

    storage      to_f32(element)                       cast_out(out, v) (v fp32)
    float32      the value                             v
    float16      cvt.f32.f16                           v (Numba's store rounds: cvt.rn.f16.f32)
    uint16 (bf16 bits)  bits << 16, reinterpreted      round to nearest even: cvt.rn.bf16.f32
                                                       on the GPU (sm_80+, inline PTX), integer
                                                       rounding in the simulator; NaN stays NaN
    float64      cvt.rn.f32.f64                        v

bf16: numba-cuda 0.30 has `numba.cuda.bf16` (a scalar `bfloat16` type and the cuda_bf16.h
intrinsics), but no way to bring a bf16 *array* into a kernel from NumPy, CuPy or torch
(ml_dtypes' dtype is untypeable, torch's interface reports '<V2'), its intrinsics are calls
into a linked C++ shim (local-memory arguments in the PTX), and the simulator has none of it
(`numba.cuda.bf16.bfloat16 is None` there). So bf16 arrays travel as uint16 bits and the
conversion is two integer operations here, identical on the GPU and in the simulator. A
uint16 array is therefore always read as bf16 by these kernels.

On the GPU the helpers are `overload`s resolved at compile time per element type (no runtime
branch); in the simulator they are the plain Python functions below, on NumPy scalars. The
simulator versions compute in np.float32 too (math.exp would return a Python float and raise
OverflowError where expf returns inf).
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np
from numba import float32, int32, uint32, uint64

from ._arrays import cuda, is_simulator

cu = cuda()
SIMULATOR = is_simulator()
FULL_MASK = 0xFFFFFFFF
NEG_INF32 = np.float32(-np.inf)   # globals of NumPy scalar type are fp32 constants in kernels
NAN32 = np.float32(np.nan)


# ----------------------------------------------------------------------------- kernels
def _package_stamp() -> str:
    """A hash of every source file of this package: the freshness stamp of cached kernels."""
    import hashlib
    import pathlib

    h = hashlib.sha256()
    for path in sorted(pathlib.Path(__file__).resolve().parent.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _cache_class():
    """numba-cuda's kernel cache, stamped by the whole package instead of one file.

    numba keys a cached kernel on its own bytecode, closure and source file: a kernel whose
    device helpers (this file) changed would load stale. Stamping every entry with a hash of
    all the package's files makes any edit recompile. Internal numba-cuda 0.30 classes:
    None (no caching, every process compiles) if they moved.
    """
    try:
        from numba.cuda.core import caching
        from numba.cuda.dispatcher import CUDACache, CUDACacheImpl
    except ImportError:
        return None
    stamp = _package_stamp()

    class InTree(caching._InTreeCacheLocator):
        def get_source_stamp(self):
            return stamp

    class UserWide(caching._UserWideCacheLocator):
        def get_source_stamp(self):
            return stamp

    class Impl(CUDACacheImpl):
        _locator_classes = [InTree, UserWide]

    class PackageCache(CUDACache):
        _impl_class = Impl

    return PackageCache


def kernel(fn, launch_bounds=None):
    """`cuda.jit(fn)`, cached on disk across processes (GPU only).

    A kernel compiles the first time it runs with new argument types (seconds each: what a
    notebook user waits for); the cache keeps the result under this package's __pycache__
    (or numba's user cache dir), so the next process loads it instead. Set
    MOE_SANDBOX_NUMBA_CACHE=0 to compile every time.

    launch_bounds=(threads, min_blocks): CUDA C's __launch_bounds__, so ptxas keeps the
    registers under 64K / (threads * min_blocks) and that many blocks fit on an SM (ignored
    by the simulator).
    """
    disp = cu.jit(fn) if SIMULATOR or not launch_bounds else cu.jit(launch_bounds=launch_bounds)(fn)
    if SIMULATOR or os.environ.get("MOE_SANDBOX_NUMBA_CACHE", "1") == "0":
        return disp
    cls = _cache_class()
    if cls is not None:
        try:
            disp._cache = cls(disp.py_func)   # what Dispatcher.enable_caching() does
        except Exception:                      # no writable cache dir: compile as usual
            pass
    return disp


def device_function(fn):
    """A device function, forced inline on the GPU.

    In the simulator a helper that touches no `cuda` API stays a plain Python function: a
    simulated device-function call swaps module globals under a lock on every call, which
    would dominate the inner loops. Helpers that do use `cuda` (syncthreads, shuffles) are
    wrapped, so the simulator can swap in its fake `cuda` module while they run.
    """
    if SIMULATOR:
        g = fn.__globals__
        if any(g.get(n) is cu for n in fn.__code__.co_names):
            return cu.jit(device=True)(fn)
        return fn
    return cu.jit(device=True, forceinline=True)(fn)


# ----------------------------------------------------------------------------- dtype conversion
def to_f32(x):
    """An element of any storage dtype as fp32 (uint16 = bf16 bits)."""
    if isinstance(x, np.uint16):
        return np.uint32(np.uint32(x) << np.uint32(16)).view(np.float32)
    return np.float32(x)


def f32_to_bf16_bits(v):
    """fp32 -> bf16 bits, round to nearest even; NaN -> quiet NaN (what ml_dtypes does)."""
    u = int(np.float32(v).view(np.uint32))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16((u >> 16) | 0x40)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return np.uint16((u >> 16) & 0xFFFF)


def cast_out(out, v):
    """The value to store into `out` for the fp32 value `v` (bf16 bits for uint16 arrays)."""
    if out.dtype == np.uint16:
        return f32_to_bf16_bits(v)
    return v


def exp_f32(x):
    return np.exp(np.float32(x))


def erf_f32(x):
    return np.float32(math.erf(float(x)))


def sqrt_softplus_f32(x):
    """sqrt(softplus(x)) in fp32, softplus(x) = log(1 + exp(x)), or x above 20."""
    x = np.float32(x)
    with np.errstate(over="ignore", invalid="ignore"):
        softplus = x if x > np.float32(20.0) else np.log(np.float32(1.0) + np.exp(x))
        return np.sqrt(np.float32(softplus))


def tanh_f32(x):
    return np.tanh(np.float32(x))


if not SIMULATOR:
    from numba.cuda import libdevice
    from numba.cuda import types as nbtypes
    from numba.cuda.extending import overload

    _INLINE = {"forceinline": True}

    def _is_bf16_bits(ty):
        return isinstance(ty, nbtypes.Integer) and ty.bitwidth == 16 and not ty.signed

    @overload(to_f32, target="cuda", jit_options=_INLINE)
    def _to_f32_cuda(x):
        if _is_bf16_bits(x):
            def impl(x):
                # bf16 is the top half of an fp32: shift the bits up and reinterpret
                return libdevice.int_as_float(int32(x) << int32(16))
            return impl

        def impl(x):
            return float32(x)
        return impl

    from llvmlite import ir as _ir
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _cvt_rn_bf16(typingctx, v):
        """fp32 -> bf16 bits by the hardware's cvt.rn.bf16.f32 (sm_80+): round to nearest
        even, one instruction instead of the integer sequence (NaN becomes 0x7FFF)."""
        if v != nbtypes.float32:
            return None

        def codegen(context, builder, signature, args):
            fnty = _ir.FunctionType(_ir.IntType(16), [_ir.FloatType()])
            asm = _ir.InlineAsm(fnty, "cvt.rn.bf16.f32 $0, $1;", "=h,f")
            return builder.call(asm, [args[0]])

        return nbtypes.uint16(nbtypes.float32), codegen

    @overload(f32_to_bf16_bits, target="cuda", jit_options=_INLINE)
    def _f32_to_bf16_bits_cuda(v):
        def impl(v):
            return _cvt_rn_bf16(float32(v))
        return impl

    @overload(cast_out, target="cuda", jit_options=_INLINE)
    def _cast_out_cuda(out, v):
        if _is_bf16_bits(out.dtype):
            def impl(out, v):
                return f32_to_bf16_bits(v)
            return impl

        def impl(out, v):
            return v
        return impl

    @overload(exp_f32, target="cuda", jit_options=_INLINE)
    def _exp_f32_cuda(x):
        def impl(x):
            return math.exp(float32(x))   # expf (libdevice __nv_expf), not the fast __expf
        return impl

    @overload(erf_f32, target="cuda", jit_options=_INLINE)
    def _erf_f32_cuda(x):
        def impl(x):
            return math.erf(float32(x))
        return impl

    @overload(sqrt_softplus_f32, target="cuda", jit_options=_INLINE)
    def _sqrt_softplus_f32_cuda(x):
        def impl(x):
            x = float32(x)   # logf, expf, sqrtf (libdevice), like routing.cu
            softplus = x if x > float32(20.0) else math.log(float32(1.0) + math.exp(x))
            return math.sqrt(softplus)
        return impl

    @overload(tanh_f32, target="cuda", jit_options=_INLINE)
    def _tanh_f32_cuda(x):
        def impl(x):
            return math.tanh(float32(x))
        return impl


# ----------------------------------------------------------------------------- 8-byte words
# A kernel that reads 8 bytes per load (a uint64 view of an fp32 / fp16 / bf16 array) takes
# element i of a word apart with these: two fp32, or four fp16 / bf16, per word.
def unpack_f32(word, i):
    return np.uint32((int(word) >> (32 * int(i))) & 0xFFFFFFFF).view(np.float32)


def unpack_bf16(word, i):
    return np.uint32(((int(word) >> (16 * int(i))) & 0xFFFF) << 16).view(np.float32)


def unpack_f16(word, i):
    return np.float32(np.uint16((int(word) >> (16 * int(i))) & 0xFFFF).view(np.float16))


if not SIMULATOR:
    @intrinsic
    def _half_bits_to_f32(typingctx, bits):
        """fp16 bits (the low 16 of an integer) -> fp32: a bitcast and one cvt.f32.f16."""
        if not isinstance(bits, nbtypes.Integer):
            return None

        def codegen(context, builder, signature, args):
            v = args[0]
            if bits.bitwidth != 16:
                v = builder.trunc(v, _ir.IntType(16))
            return builder.fpext(builder.bitcast(v, _ir.HalfType()), _ir.FloatType())

        return nbtypes.float32(bits), codegen

    @overload(unpack_f32, target="cuda", jit_options=_INLINE)
    def _unpack_f32_cuda(word, i):
        def impl(word, i):
            return libdevice.int_as_float(int32((word >> uint64(32 * i)) & uint64(0xFFFFFFFF)))
        return impl

    @overload(unpack_bf16, target="cuda", jit_options=_INLINE)
    def _unpack_bf16_cuda(word, i):
        def impl(word, i):
            return libdevice.int_as_float(
                int32(((word >> uint64(16 * i)) & uint64(0xFFFF)) << uint64(16)))
        return impl

    @overload(unpack_f16, target="cuda", jit_options=_INLINE)
    def _unpack_f16_cuda(word, i):
        def impl(word, i):
            return _half_bits_to_f32((word >> uint64(16 * i)) & uint64(0xFFFF))
        return impl


def pack_f32(word, i, x):
    """`word` with element i replaced by fp32 `x` (the slot must be zero: words start at 0)."""
    bits = int(np.float32(x).view(np.uint32))
    return np.uint64(int(word) | (bits << (32 * int(i))))


def pack_bf16(word, i, x):
    return np.uint64(int(word) | (int(f32_to_bf16_bits(x)) << (16 * int(i))))


def pack_f16(word, i, x):
    bits = int(np.float16(np.float32(x)).view(np.uint16))
    return np.uint64(int(word) | (bits << (16 * int(i))))


if not SIMULATOR:
    @intrinsic
    def _f32_to_half_bits(typingctx, v):
        """fp32 -> fp16 bits: cvt.rn.f16.f32 and a bitcast."""
        if v != nbtypes.float32:
            return None

        def codegen(context, builder, signature, args):
            h = builder.fptrunc(args[0], _ir.HalfType())
            return builder.bitcast(h, _ir.IntType(16))

        return nbtypes.uint16(nbtypes.float32), codegen

    @overload(pack_f32, target="cuda", jit_options=_INLINE)
    def _pack_f32_cuda(word, i, x):
        def impl(word, i, x):
            bits = uint64(uint32(libdevice.float_as_int(float32(x))))
            return word | (bits << uint64(32 * i))
        return impl

    @overload(pack_bf16, target="cuda", jit_options=_INLINE)
    def _pack_bf16_cuda(word, i, x):
        def impl(word, i, x):
            return word | (uint64(f32_to_bf16_bits(x)) << uint64(16 * i))
        return impl

    @overload(pack_f16, target="cuda", jit_options=_INLINE)
    def _pack_f16_cuda(word, i, x):
        def impl(word, i, x):
            return word | (uint64(_f32_to_half_bits(float32(x))) << uint64(16 * i))
        return impl


UNPACK = {"f32": unpack_f32, "bf16": unpack_bf16, "f16": unpack_f16}
PACK = {"f32": pack_f32, "bf16": pack_bf16, "f16": pack_f16}
WORD_ELEMENTS = {"f32": 2, "bf16": 4, "f16": 4}
WORD_OF = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
           np.dtype(np.uint16): "bf16"}     # storage dtype -> word kind (uint16 = bf16 bits)


def words(*arrays, unit: int = 8):
    """uint64 views of numba arrays whose rows are whole `unit`-byte pieces, or None.

    Memory-bound kernels load 8 bytes per thread instead of one 2- or 4-byte element: four
    times the bytes in flight for the same number of loads (unit 16: _wide.py's 16-byte chunks,
    two words per access). Needs C-contiguous arrays, a last dimension of whole pieces, and
    unit-byte aligned bases (CuPy / torch / numba allocations are 256-byte aligned; a view into
    the middle of one may not be).
    """
    for x in arrays:
        if (x.ndim == 0 or (x.shape[x.ndim - 1] * x.dtype.itemsize) % unit
                or not x.is_c_contiguous()):
            return None
        if not SIMULATOR and x.size and x.__cuda_array_interface__["data"][0] % unit:
            return None
    return tuple(x.view(np.uint64) for x in arrays)


# ----------------------------------------------------------------------------- indexing
def ix(i):
    """An array index that is never negative, as numba's unsigned type.

    Numba wraps signed indices (`if i < 0: i += n`) on every access, and LLVM rarely proves
    them non-negative (threadIdx arithmetic in int64): in a GEMM's inner loop that is more
    integer work than FMAs. An unsigned index skips the wrap. Only for indices that cannot be
    negative by construction; in the simulator it is the identity.
    """
    return i


if not SIMULATOR:
    @overload(ix, target="cuda", jit_options=_INLINE)
    def _ix_cuda(i):
        def impl(i):
            return uint64(i)
        return impl


# ----------------------------------------------------------------------------- comparisons
@device_function
def max_nan(a, b):
    """max that propagates NaN from either side (NumPy's max): the softmax of a NaN row is NaN."""
    if a != a or a > b:
        return a
    return b


@device_function
def sel_key(x):
    """The selection key of a score: NaN counts as -inf (reference/routing.py)."""
    if x != x:
        return NEG_INF32
    return float32(x)


@device_function
def better(v1, i1, v2, i2):
    """(v1, i1) ranks before (v2, i2): larger value first, ties to the lower index."""
    return v1 > v2 or (v1 == v2 and i1 < i2)


# ----------------------------------------------------------------------------- rounding points
# A stage that rounds an fp32 intermediate to the storage dtype mid-computation (vLLM's gated
# activation rounds act(gate) before the multiply; grouped_topk's softmax runs in the logits'
# dtype) goes through these: the value rounded to fp32 / fp16 / bf16 and back, as fp32.
def round_f32(v):
    return np.float32(v)


def round_bf16(v):
    return to_f32(f32_to_bf16_bits(v))


def round_f16(v):
    return np.float32(np.float16(np.float32(v)))


def round_as(arr, v):
    """fp32 `v` rounded to the storage dtype of `arr`'s elements (uint16 = bf16 bits; fp32
    and fp64 leave it as it is), returned as fp32."""
    if arr.dtype == np.uint16:
        return round_bf16(v)
    if arr.dtype == np.float16:
        return round_f16(v)
    return np.float32(v)


if not SIMULATOR:
    @overload(round_f32, target="cuda", jit_options=_INLINE)
    def _round_f32_cuda(v):
        def impl(v):
            return float32(v)
        return impl

    @overload(round_bf16, target="cuda", jit_options=_INLINE)
    def _round_bf16_cuda(v):
        def impl(v):
            return to_f32(f32_to_bf16_bits(float32(v)))
        return impl

    @overload(round_f16, target="cuda", jit_options=_INLINE)
    def _round_f16_cuda(v):
        def impl(v):
            return _half_bits_to_f32(_f32_to_half_bits(float32(v)))
        return impl

    @overload(round_as, target="cuda", jit_options=_INLINE)
    def _round_as_cuda(arr, v):
        rounding = (round_bf16 if _is_bf16_bits(arr.dtype)
                    else round_f16 if arr.dtype == nbtypes.float16 else round_f32)

        def impl(arr, v):
            return rounding(v)
        return impl


ROUND = {"f32": round_f32, "bf16": round_bf16, "f16": round_f16}   # word kind -> rounding
