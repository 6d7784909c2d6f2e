"""The combine in Numba: sum each token's K expert outputs.

    T = tokens, K = top-k, H = hidden

    moe_sum(x, topk_ids=None, expert_map=None) -> out [T, H]
        x [T, K, H]; out[t, h] = sum_k x[t, k, h] (with topk_ids: over the live slots only)

fp32 accumulation in slot order k = 0..K-1 (NumPy's order for this reduction, so fp32 inputs
match the reference bit for bit), rounded once to x's dtype (reference/combine.py). The router
weights are already applied by GEMM2 (mul_routed_weight), as in vLLM.

Kernel `moe_sum_kernel`: block = NT threads over columns, grid = (cdiv(C, 4 NT),
min(T, 65535)), rows strided by gridDim.y, no shared memory; each thread takes 4 columns NT
apart per step (their loads in flight together). A column is an 8-byte word of VEC elements (two
fp32 or four fp16 / bf16: the arrays viewed as uint64) when the rows are whole words, else one
element (C = H / VEC or H). Each thread reads K words H apart (every read coalesced across
the warp) and writes one. K <= 32 is compiled in (one kernel per K), so the K loads are
unrolled and in flight together: 32 K bytes per thread.

With topk_ids (vLLM's pad-aware moe_sum) `moe_sum_live_kernel` runs: one thread per output
element, grid = (cdiv(H, NT), min(T, 65535)); slot k of token t is added only when
topk_ids[t, k] >= 0 and, with an expert_map, the expert is local (its row was never written
by the GEMMs otherwise). A token with no live slot sums to 0.

When the rows are whole 16-byte chunks (the MoE shapes), `moe_sum16_kernel` runs instead:
CuPy's geometry (combine.cu), one 16-byte chunk (8 bf16) per thread, grid = T * cdiv(H / 8,
block), loads as ld.global.v2.u64 (_wide.py); config "WIDE" turns it off.

dtypes: fp32, fp16, bf16 (uint16 bits, converted by shifts in the kernel: _device.py).

Run as a script to validate against reference/ and time: python -m cuda_kernels.numba.combine
"""
from __future__ import annotations

import functools
import sys

import numpy as np
from numba import float32, uint64

from . import _arrays as A
from ._device import (PACK, SIMULATOR, UNPACK, WORD_ELEMENTS, WORD_OF, cast_out, cu,
                      device_function, ix, kernel, to_f32, words)
from ._wide import chunk_grid, load16, store16, words16

CONFIGS = {"sum": {"THREADS": 256, "WIDE": True}}
MAX_UNROLLED_K = 32   # K up to this is a compile-time constant (one kernel per K)
SIM_CONFIGS = {"sum": {"THREADS": 16, "WIDE": True}}
MAX_GRID_Y = 65535


def config(name):
    return (SIM_CONFIGS if SIMULATOR else CONFIGS)[name]


@functools.lru_cache(maxsize=None)
def moe_sum_kernel(NT: int, KC: int = 0, WORD: str = "", U: int = 4):
    """The combine kernel. KC > 0 fixes K at compile time, so the K loads of an output are
    unrolled and in flight together (a runtime-K loop waits out each load's latency).
    WORD ("f32" | "f16" | "bf16"): x and out are uint64 views and a thread sums VEC columns
    at once from 8-byte loads; "" reads single elements. Each thread handles U columns NT
    apart per step: U K loads in flight (K = 2 alone left Mixtral at 1.4x CuPy's time)."""
    VEC = WORD_ELEMENTS[WORD] if WORD else 1
    if WORD:
        unpack, pack = UNPACK[WORD], PACK[WORD]

        @device_function
        def add(acc, u, x, t, k, c):
            wd = x[ix(t), ix(k), ix(c)]
            for v in range(VEC):
                acc[u, v] += unpack(wd, v)

        @device_function
        def store(out, t, c, acc, u):
            wd = uint64(0)
            for v in range(VEC):
                wd = pack(wd, v, acc[u, v])
            out[ix(t), ix(c)] = wd
    else:
        @device_function
        def add(acc, u, x, t, k, c):
            acc[u, 0] += to_f32(x[ix(t), ix(k), ix(c)])

        @device_function
        def store(out, t, c, acc, u):
            out[ix(t), ix(c)] = cast_out(out, acc[u, 0])

    def moe_sum_rows(x, out, T, K, C):
        """out[t, c] = sum_k x[t, k, c] in fp32, rounded once (c: a column, or a word of VEC);
        U columns NT apart per thread and step."""
        acc = cu.local.array((U, VEC), float32)
        for t in range(cu.blockIdx.y, T, cu.gridDim.y):
            for c0 in range(cu.blockIdx.x * NT * U + cu.threadIdx.x, C, cu.gridDim.x * NT * U):
                for u in range(U):
                    for v in range(VEC):
                        acc[u, v] = float32(0.0)
                if KC > 0:
                    for k in range(KC):
                        for u in range(U):
                            if c0 + u * NT < C:
                                add(acc, u, x, t, k, c0 + u * NT)
                else:
                    for k in range(K):
                        for u in range(U):
                            if c0 + u * NT < C:
                                add(acc, u, x, t, k, c0 + u * NT)
                for u in range(U):
                    if c0 + u * NT < C:
                        store(out, t, c0 + u * NT, acc, u)

    return kernel(moe_sum_rows)


@functools.lru_cache(maxsize=None)
def moe_sum16_kernel(NT: int, KC: int, WORD: str):
    """The combine on 16-byte chunks (_wide.py), CuPy's geometry (combine.cu): block = NT
    threads over a token row's chunks, grid = T * cdiv(C16, NT) (flattened: no 65535 limit
    on T), one 16-byte chunk (2 VEC elements) per thread, its K loads H apart (coalesced
    across the warp). KC > 0 fixes K at compile time; x and out are uint64 views (words16)
    with C words per output row, C even."""
    VEC = WORD_ELEMENTS[WORD]
    VEC16 = 2 * VEC           # elements per 16-byte chunk
    unpack, pack = UNPACK[WORD], PACK[WORD]

    @device_function
    def add16(acc, x, i):
        lo, hi = load16(x, i)
        for v in range(VEC):
            acc[v] += unpack(lo, v)
            acc[VEC + v] += unpack(hi, v)

    def moe_sum16(x, out, T, K, C, nbx):
        """out[t, chunk] = sum_k x[t, k, chunk] in fp32 (k in order), rounded once;
        nbx = blocks per token row."""
        t = cu.blockIdx.x // nbx
        c = ((cu.blockIdx.x % nbx) * NT + cu.threadIdx.x) * 2   # first word of the chunk
        if t >= T or c >= C:
            return
        acc = cu.local.array(VEC16, float32)
        for v in range(VEC16):
            acc[v] = float32(0.0)
        if KC > 0:
            for k in range(KC):
                add16(acc, x, (t * KC + k) * C + c)
        else:
            for k in range(K):
                add16(acc, x, (t * K + k) * C + c)
        lo = uint64(0)
        hi = uint64(0)
        for v in range(VEC):
            lo = pack(lo, v, acc[v])
            hi = pack(hi, v, acc[VEC + v])
        store16(out, t * C + c, lo, hi)

    return kernel(moe_sum16)


@functools.lru_cache(maxsize=None)
def moe_sum_live_kernel(NT: int):
    """The pad-aware combine: one thread per output element, slots read only when live."""

    def moe_sum_live(x, ids, emap, use_map, out, T, K, H):
        """out[t, h] = sum over live k of x[t, k, h], fp32, rounded once; live: ids[t, k] >= 0
        and (use_map) ids[t, k] < len(emap) and emap[ids[t, k]] >= 0."""
        h = cu.blockIdx.x * NT + cu.threadIdx.x
        if h >= H:
            return
        for t in range(cu.blockIdx.y, T, cu.gridDim.y):
            acc = float32(0.0)
            for k in range(K):
                e = ids[ix(t), ix(k)]
                live = e >= 0
                if live and use_map:
                    live = e < emap.shape[0] and emap[ix(e)] >= 0
                if live:
                    acc += to_f32(x[ix(t), ix(k), ix(h)])
            out[ix(t), ix(h)] = cast_out(out, acc)

    return kernel(moe_sum_live)


def moe_sum(x, topk_ids=None, expert_map=None):
    """The combine: out[t] = sum_k x[t, k] over the K slots, fp32, rounded once.
    [T, K, H] -> [T, H]. With topk_ids [T, K] (vLLM's pad-aware moe_sum) a slot with a
    negative id, or with expert_map a non-local expert, is skipped (never read)."""
    A.check_float("x", x, ndim=3)
    T, K, H = A.shape_of(x)
    call = A.Call("x", x)
    out = call.empty((T, H), A.dtype_of(x))                                # [T, H]
    if topk_ids is not None:
        A.check_int_array("topk_ids", topk_ids, ndim=2)
        if A.shape_of(topk_ids) != (T, K):
            raise ValueError(f"topk_ids: expected shape {(T, K)}, got {A.shape_of(topk_ids)}")
        if expert_map is not None:
            A.check_int_array("expert_map", expert_map, ndim=1)
        if T and H:
            NT = config("sum")["THREADS"]
            ids = call.dev("topk_ids", topk_ids)
            use_map = expert_map is not None
            emap = call.dev("expert_map", expert_map if use_map else np.full(1, -1, np.int32))
            grid = (A.cdiv(H, NT), min(T, MAX_GRID_Y))
            moe_sum_live_kernel(NT)[grid, NT, A.launch_stream()](
                call.dev("x", x), ids, emap, use_map, out, T, K, H)
        return call.result(out)
    if T and H:
        NT = config("sum")["THREADS"]
        xd = call.dev("x", x)
        wide = words16(xd, out) if config("sum")["WIDE"] else None
        if wide is not None:   # 16-byte chunks, one per thread (CuPy's combine)
            xw, outw = wide
            C = outw.shape[1]
            grid, nt, nbx = chunk_grid(C, NT, T)
            kernel16 = moe_sum16_kernel(nt, K if K <= MAX_UNROLLED_K else 0,
                                        WORD_OF[np.dtype(xd.dtype)])
            kernel16[grid, nt, A.launch_stream()](xw, outw, T, K, C, nbx)
            return call.result(out)
        word, cols, views = "", H, words(xd, out)
        if views is not None:   # 8-byte loads: VEC columns per thread
            word = WORD_OF[np.dtype(xd.dtype)]
            xd, out_k = views
            cols = H // WORD_ELEMENTS[word]
        else:
            out_k = out
        kernel = moe_sum_kernel(NT, K if K <= MAX_UNROLLED_K else 0, word)
        grid = (A.cdiv(cols, 4 * NT), min(T, MAX_GRID_Y))
        kernel[grid, NT, A.launch_stream()](xd, out_k, T, K, cols)
    return call.result(out)


def compile_cases():
    """(label, kernel, argument types) of every launch above, for the PTX checks (_ptx.py)."""
    from numba import types as t

    cases = []
    w64 = t.uint64
    for word in ("f32", "f16", "bf16"):
        for kc in (8, 0):
            cases.append((f"moe_sum16 K={kc or 'runtime'} {word}",
                          moe_sum16_kernel(CONFIGS["sum"]["THREADS"], kc, word),
                          (t.Array(w64, 3, "C"), t.Array(w64, 2, "C")) + (t.int64,) * 4))
    for dt in (t.float32, t.float16, t.uint16):
        for idt in (t.int32, t.int64):
            cases.append((f"moe_sum_live {dt} ids {idt}", moe_sum_live_kernel(CONFIGS["sum"]["THREADS"]),
                          (t.Array(dt, 3, "C"), t.Array(idt, 2, "C"), t.Array(t.int32, 1, "C"),
                           t.boolean, t.Array(dt, 2, "C"), t.int64, t.int64, t.int64)))
    for dt, word in ((t.float32, "f32"), (t.float16, "f16"), (t.uint16, "bf16")):
        for kc in (8, 0):
            for wk in (word, ""):
                io = t.uint64 if wk else dt
                cases.append((f"moe_sum K={kc or 'runtime'} {dt}" + (" words" if wk else ""),
                              moe_sum_kernel(CONFIGS["sum"]["THREADS"], kc, wk),
                              (t.Array(io, 3, "C"), t.Array(io, 2, "C"), t.int64, t.int64,
                               t.int64)))
    return cases


def _main():
    import reference

    from . import _script as S

    def lines(rng):
        shapes = [(3, 2, 8)] if SIMULATOR else [(1, 8, 7168), (256, 8, 2048), (4096, 8, 7168)]
        for T, K, H in shapes:
            for dt in (np.float32, np.float16):
                x = rng.standard_normal((T, K, H)).astype(dt)                 # [T, K, H]
                err = S.rel_err(moe_sum(x), reference.moe_sum(x))
                yield (f"  moe_sum [{T}, {K}, {H}] {np.dtype(dt).name}: rel err {err:.1e}"
                       + S.timed(moe_sum, x, nbytes=x.nbytes * (K + 1) / K),  # read x, write out
                       err <= (1e-5 if dt == np.float32 else 1e-2))

    return S.main("combine", lines)


if __name__ == "__main__":
    sys.exit(_main())
