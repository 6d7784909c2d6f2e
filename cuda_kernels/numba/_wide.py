"""16-byte loads and stores for the memory-bound Numba kernels (row copies, activation, combine).

Numba has no 16-byte scalar type, so a kernel that indexes a uint64 array moves 8 bytes per
instruction, where the CuPy kernels move 16 (`uint4` / an aligned `Pack` of 8 bf16). On an
H200 the row copies ran at a third of CuPy's speed partly for that reason: half the bytes in
flight per load. These helpers read or write two consecutive uint64 words as one 16-byte
vector access (`ld.v2.u64` / `st.v2.u64` in the PTX):

    lo, hi = load16(a, i)      (a.flat[i], a.flat[i + 1]) of a C-contiguous uint64 array
    store16(a, i, lo, hi)      a.flat[i], a.flat[i + 1] = lo, hi

`i` is a flat element index (row * row_words + column for a 2-D array) and must be even, with
the array's base 16-byte aligned: `words16()` gives uint64 views only when every row is whole
16-byte chunks and every base is 16-byte aligned (the callers fall back to 8-byte words, or
single elements, otherwise). On the GPU the helpers are inlined LLVM vector accesses; in the
CUDA simulator they are the two plain element accesses below.
"""
from __future__ import annotations

import numpy as np

from ._arrays import is_simulator
from ._device import words

SIMULATOR = is_simulator()


def load16(a, i):
    """(a.flat[i], a.flat[i + 1]) as one 16-byte load; i even, a 16-byte aligned."""
    f = a.reshape(-1)
    return f[i], f[i + 1]


def store16(a, i, lo, hi):
    """a.flat[i], a.flat[i + 1] = lo, hi as one 16-byte store; i even, a 16-byte aligned."""
    f = a.reshape(-1)
    f[i] = lo
    f[i + 1] = hi


if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import types as nbtypes
    from numba.cuda.extending import intrinsic, overload

    _V2 = ir.VectorType(ir.IntType(64), 2)
    _I32 = ir.IntType(32)

    def _is_words(a):
        return (isinstance(a, nbtypes.Array) and a.dtype == nbtypes.uint64
                and a.layout == "C")

    def _vector_pointer(context, builder, aryty, ary, idx):
        """The address of a.flat[idx] as a global-space <2 x i64>* (one 16-byte access)."""
        arr = context.make_array(aryty)(context, builder, ary)
        ptr = builder.gep(arr.data, [idx])
        gptr = builder.addrspacecast(ptr, ir.IntType(64).as_pointer(1))
        return builder.bitcast(gptr, _V2.as_pointer(1))

    @intrinsic
    def _load_v2(typingctx, a, i):
        if not _is_words(a) or not isinstance(i, nbtypes.Integer):
            return None
        sig = nbtypes.UniTuple(nbtypes.uint64, 2)(a, i)

        def codegen(context, builder, signature, args):
            idx = context.cast(builder, args[1], signature.args[1], nbtypes.intp)
            vptr = _vector_pointer(context, builder, signature.args[0], args[0], idx)
            v = builder.load(vptr, align=16)
            lo = builder.extract_element(v, ir.Constant(_I32, 0))
            hi = builder.extract_element(v, ir.Constant(_I32, 1))
            return context.make_tuple(builder, signature.return_type, [lo, hi])

        return sig, codegen

    @intrinsic
    def _store_v2(typingctx, a, i, lo, hi):
        if not _is_words(a) or not isinstance(i, nbtypes.Integer):
            return None
        sig = nbtypes.none(a, i, nbtypes.uint64, nbtypes.uint64)

        def codegen(context, builder, signature, args):
            idx = context.cast(builder, args[1], signature.args[1], nbtypes.intp)
            vptr = _vector_pointer(context, builder, signature.args[0], args[0], idx)
            lo_v = context.cast(builder, args[2], signature.args[2], nbtypes.uint64)
            hi_v = context.cast(builder, args[3], signature.args[3], nbtypes.uint64)
            v = ir.Constant(_V2, ir.Undefined)
            v = builder.insert_element(v, lo_v, ir.Constant(_I32, 0))
            v = builder.insert_element(v, hi_v, ir.Constant(_I32, 1))
            builder.store(v, vptr, align=16)
            return context.get_dummy_value()

        return sig, codegen

    _INLINE = {"forceinline": True}

    @overload(load16, target="cuda", jit_options=_INLINE)
    def _load16_cuda(a, i):
        def impl(a, i):
            return _load_v2(a, i)
        return impl

    @overload(store16, target="cuda", jit_options=_INLINE)
    def _store16_cuda(a, i, lo, hi):
        def impl(a, i, lo, hi):
            _store_v2(a, i, np.uint64(lo), np.uint64(hi))
        return impl


def words16(*arrays):
    """uint64 views of numba arrays whose rows are whole 16-byte chunks (and whose bases are
    16-byte aligned), or None. The views' rows then have an even number of words, so every row
    starts 16-byte aligned too."""
    return words(*arrays, unit=16)


def chunk_grid(C: int, NT: int, rows: int) -> tuple[int, int, int]:
    """(grid, block, blocks per row) of the kernels that take one 16-byte chunk (2 words) of a
    row of C words per thread, CuPy's row geometry: a block of at most NT threads, whole warps,
    no wider than the row (a narrow row leaves no idle warps)."""
    nt = min(NT, -(-(C // 2) // 32) * 32)
    nbx = -(-(C // 2) // nt)
    return rows * nbx, nt, nbx
