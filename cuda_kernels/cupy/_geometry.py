"""Launch geometry of the CuPy kernels: how many blocks of how many threads cover the work.

    cdiv(a, b)                  ceil(a / b) for ints
    block_threads(n, max)       a block that covers n work items of a row: whole warps, <= max
    row_geometry(...)           the launch of a row-wise elementwise kernel (elementwise.cuh):
                                VEC columns per thread, block, column chunks, grid
"""
from __future__ import annotations

from typing import NamedTuple

from ._arrays import check_fits_int32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_threads(work_items: int, max_threads: int) -> int:
    """Threads for a block that covers `work_items` per row: all of them, rounded up to a
    whole warp, at most `max_threads` (then several blocks share the row)."""
    return max(32, min(max_threads, cdiv(work_items, 32) * 32))


ROW_VECS = (1, 2, 4, 8)


class RowGeometry(NamedTuple):
    vec: int       # consecutive columns per thread
    threads: int   # block size
    chunks: int    # blocks per row
    grid: int      # rows * chunks


def row_geometry(name: str, rows: int, width: int, max_threads: int, *arrays,
                 rows_symbol: str = "T", vecs: tuple[int, ...] = ROW_VECS) -> RowGeometry:
    """The launch of a row-wise elementwise kernel (elementwise.cuh: activation.cu, combine.cu,
    permute.cu's moe_unpermute_kernel), each thread VEC consecutive columns of one row:

        VEC     the widest of `vecs` with VEC * itemsize <= 16 bytes that divides `width` and
                every base address of `arrays` (so a Pack<T, VEC> load is aligned: one 16-byte
                load per thread when all allow it)
        block   block_threads(cdiv(width, VEC), max_threads)
        grid    rows * chunks, chunks = cdiv(width, block * VEC), flattened (row = blockIdx.x /
                chunks) so that rows is not bound by gridDim.y's 65535

    Raises ValueError naming `name` when the grid overflows int32 (`rows_symbol` names the
    rows in the message: "M * column chunks").
    """
    itemsize = arrays[0].dtype.itemsize
    vec = max(v for v in vecs if v * itemsize <= 16 and width % v == 0
              and all(a.data.ptr % (v * itemsize) == 0 for a in arrays))
    threads = block_threads(cdiv(width, vec), max_threads)
    chunks = cdiv(width, threads * vec)
    check_fits_int32(name, rows * chunks, f"the grid size {rows_symbol} * column chunks")
    return RowGeometry(vec, threads, chunks, rows * chunks)
