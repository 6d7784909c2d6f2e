"""16-byte loads for the Numba GEMM's v3v rung: what CUDA C writes as `*(uint4*)p` / `float4`.

numba.cuda has no vector types for memory: an element load is one 2-, 4- or 8-byte
instruction. The CuPy v3 kernel reads global memory 16 bytes per thread (LDG.128) and its
shared tiles 16 bytes at a time (LDS.128); these two intrinsics give Numba the same:

    ldg4(x, i)   (x[i], x[i+1], x[i+2], x[i+3]) of a 1-D uint32 array in global memory, one
                 ld.global.nc.v4.u32 (the read-only path, CUDA's __ldg); i a multiple of 4,
                 x's base 16-byte aligned (the caller checks)
    lds4(x, i)   the same 4 elements of a 1-D float32 shared array, one aligned <4 x float>
                 load, which LLVM turns into ld.shared.v4.f32 (the array allocated with
                 alignment=16, i a multiple of 4)

Neither checks bounds (an index is a raw offset, so no sign wrap either); the caller keeps
i + 3 inside the array. In the simulator both are plain Python returning the same tuple.
"""
from __future__ import annotations

from ._arrays import is_simulator

SIMULATOR = is_simulator()


def ldg4(x, i):
    i = int(i)
    return (x[i], x[i + 1], x[i + 2], x[i + 3])


def lds4(x, i):
    i = int(i)
    return (x[i], x[i + 1], x[i + 2], x[i + 3])


if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import types as nbtypes
    from numba.cuda.extending import intrinsic

    def _takes(x, i, dtype):
        """The intrinsics' typing: a 1-D array of `dtype` and an integer index."""
        return (isinstance(x, nbtypes.Array) and x.ndim == 1 and x.dtype == dtype
                and isinstance(i, nbtypes.Integer))

    def _element_pointer(context, builder, sig, args):
        """The address of x[i] (args = (x, i) of signature sig)."""
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        index = context.cast(builder, args[1], sig.args[1], nbtypes.int64)
        return builder.gep(arr.data, [index])

    @intrinsic
    def ldg4(typingctx, x, i):
        """Four uint32 from global memory through the non-coherent (read-only) cache."""
        if not _takes(x, i, nbtypes.uint32):
            return None
        ret = nbtypes.UniTuple(nbtypes.uint32, 4)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig, args)
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [ptr.type])
            # generic -> global address, then one 16-byte read-only load
            asm = ir.InlineAsm(fnty, "{ .reg .u64 g; cvta.to.global.u64 g, $4; "
                               "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [g]; }",
                               "=r,=r,=r,=r,l")
            res = builder.call(asm, [ptr])
            return context.make_tuple(builder, ret, [builder.extract_value(res, j)
                                                     for j in range(4)])

        return ret(x, i), codegen

    @intrinsic
    def lds4(typingctx, x, i):
        """Four float32 from a 16-byte aligned (shared) array: one vector load."""
        if not _takes(x, i, nbtypes.float32):
            return None
        ret = nbtypes.UniTuple(nbtypes.float32, 4)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig, args)
            vty = ir.VectorType(ir.FloatType(), 4)
            v = builder.load(builder.bitcast(ptr, vty.as_pointer()), align=16)
            i32 = ir.IntType(32)
            return context.make_tuple(builder, ret, [builder.extract_element(v, ir.Constant(i32, j))
                                                     for j in range(4)])

        return ret(x, i), codegen
