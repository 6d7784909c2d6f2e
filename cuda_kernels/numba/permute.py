"""The contiguous layout in Numba: rows grouped by expert, and back.

    T = tokens, K = top-k, P = T*K slots (s = t*K + k), E = experts, H = hidden

    moe_permute(hidden_states, topk_ids, num_experts)
        -> x_grouped [P, H], expert_offsets int32 [E+1], inv_permuted_idx int32 [P]
    moe_unpermute(y_grouped, topk_weights, inv_permuted_idx) -> out [T, H]

The math (reference/permute.py): the grouping is align.py's with B = 1 and no padding (its
kernels give expert_offsets = off and inv[s] = the position of slot s, stable in s), then the
rows move: x_grouped[inv[s]] = x[s // K]; out[t] = sum_k w[t, k] * y[inv[t*K + k]].

Kernels (NT = THREADS):

    kernel            grid                          block  does
    gather_rows       cdiv(P, NT/32)                NT     x_grouped[inv[s]] = x[s // K], a
                                                           warp per slot row, 16-byte chunks
                                                           (rows of whole chunks)
    unpermute_rows16  T cdiv(C16, nt)               nt     one 16-byte chunk per thread, its
                                                           K rows summed (nt = min(NT, the
                                                           row's chunks in warps))
    permute_rows      (cdiv(C, 4NT), min(P, 65535)) NT     the same copy, 8-byte words or
    unpermute_rows    (cdiv(C, 4NT), min(T, 65535)) NT     elements, when rows are not whole
                                                           16-byte chunks (or "WIDE" is off)
    (C = the row in 8-byte words, read as uint64 views, when rows are whole words; else in
    elements. permute_rows copies words; unpermute_rows takes VEC elements apart per word.
    Each thread handles 4 columns NT apart per step, their loads issued together.)
The 16-byte kernels (_wide.py: ld/st.global.v2.u64) are CuPy's geometry: the 8-byte words
left deepseek-v3's permute at T = 4096 at 3.3x CuPy's time on the H200 (622 vs 191 us).

dtypes: topk_ids any integer dtype; hidden_states / y_grouped fp32, fp16, bf16 (copied as
uint16 bits by permute; unpermute converts bits <-> fp32 in the kernel) or fp64 (permute only);
topk_weights any float. Ids outside [0, E) raise for host arrays; on device arrays the kernels
skip them (no out-of-bounds write: their slots appear nowhere).

Run as a script to validate against reference/ and time: python -m cuda_kernels.numba.permute
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
from .align import _sort_slots

# Tunables are data. The simulator gets tiny blocks so that tests cover every path cheaply.
CONFIGS = {
    "rows": {"THREADS": 128, "WIDE": True, "ROW_LANES": 32},
}
SIM_CONFIGS = {
    "rows": {"THREADS": 16, "WIDE": True, "ROW_LANES": 8},
}
MAX_GRID_Y = 65535
MAX_UNROLLED_K = 32   # unpermute's K up to this is a compile-time constant (one kernel per K)


def config(name):
    return (SIM_CONFIGS if SIMULATOR else CONFIGS)[name]


# ----------------------------------------------------------------------------- kernels
@functools.lru_cache(maxsize=None)
def row_kernels(NT, KC=0, WORD="", U=4):
    """(permute_rows, unpermute_rows) for NT threads per block. KC > 0 fixes unpermute's K
    at compile time (its K gathers unrolled, in flight together). WORD ("f32" | "f16" |
    "bf16") makes y / out uint64 views read 8 bytes (VEC elements) per load; permute_rows
    copies whatever word size its arrays come in (uint64 views when rows are whole words).
    Each thread handles U columns NT apart per step, loads first: U times the bytes in flight
    (H200: one column per thread left the copy at a third of the bandwidth)."""
    VEC = WORD_ELEMENTS[WORD] if WORD else 1
    if U != 4:
        raise ValueError(f"U: permute_rows unrolls by 4 by hand, got {U}")
    if WORD:
        unpack, pack = UNPACK[WORD], PACK[WORD]

        @device_function
        def add(acc, u, y, r, c, wt):
            wd = y[ix(r), ix(c)]
            for v in range(VEC):
                acc[u, v] += unpack(wd, v) * wt

        @device_function
        def store(out, t, c, acc, u):
            wd = uint64(0)
            for v in range(VEC):
                wd = pack(wd, v, acc[u, v])
            out[ix(t), ix(c)] = wd
    else:
        @device_function
        def add(acc, u, y, r, c, wt):
            acc[u, 0] += to_f32(y[ix(r), ix(c)]) * wt

        @device_function
        def store(out, t, c, acc, u):
            out[ix(t), ix(c)] = cast_out(out, acc[u, 0])

    def permute_rows(x, inv, K, x_grouped, P, C):
        """x_grouped[inv[s], :] = x[s // K, :]: rows strided by blockIdx.y; each thread copies
        four columns NT apart per step, four loads before four stores."""
        for s in range(cu.blockIdx.y, P, cu.gridDim.y):
            dst = inv[ix(s)]
            if dst < 0 or dst >= P:   # a slot the alignment skipped (an id outside [0, E))
                continue
            src = s // K
            for c0 in range(cu.blockIdx.x * NT * 4 + cu.threadIdx.x, C, cu.gridDim.x * NT * 4):
                c1, c2, c3 = c0 + NT, c0 + 2 * NT, c0 + 3 * NT
                if c3 < C:                        # the common case: all four in the row
                    v0 = x[ix(src), ix(c0)]
                    v1 = x[ix(src), ix(c1)]
                    v2 = x[ix(src), ix(c2)]
                    v3 = x[ix(src), ix(c3)]
                    x_grouped[ix(dst), ix(c0)] = v0
                    x_grouped[ix(dst), ix(c1)] = v1
                    x_grouped[ix(dst), ix(c2)] = v2
                    x_grouped[ix(dst), ix(c3)] = v3
                else:
                    for c in range(c0, C, NT):
                        x_grouped[ix(dst), ix(c)] = x[ix(src), ix(c)]

    def unpermute_rows(y, w, inv, out, T, K, C):
        """out[t, c] = sum_k w[t, k] * y[inv[t*K + k], c], fp32, rounded once (c: a column or
        a word of VEC), U columns NT apart per thread and step. An index outside [0, P) (a
        caller's bug; the reference raises) adds nothing."""
        P = y.shape[0]
        acc = cu.local.array((U, VEC), float32)
        for t in range(cu.blockIdx.y, T, cu.gridDim.y):
            for c0 in range(cu.blockIdx.x * NT * U + cu.threadIdx.x, C, cu.gridDim.x * NT * U):
                for u in range(U):
                    for v in range(VEC):
                        acc[u, v] = float32(0.0)
                if KC > 0:
                    for k in range(KC):
                        r = inv[ix(t * KC + k)]
                        if r >= 0 and r < P:
                            wt = to_f32(w[ix(t), k])
                            for u in range(U):
                                if c0 + u * NT < C:
                                    add(acc, u, y, r, c0 + u * NT, wt)
                else:
                    for k in range(K):
                        r = inv[ix(t * K + k)]
                        if r >= 0 and r < P:
                            wt = to_f32(w[ix(t), ix(k)])
                            for u in range(U):
                                if c0 + u * NT < C:
                                    add(acc, u, y, r, c0 + u * NT, wt)
                for u in range(U):
                    if c0 + u * NT < C:
                        store(out, t, c0 + u * NT, acc, u)

    return kernel(permute_rows), kernel(unpermute_rows)


@functools.lru_cache(maxsize=None)
def wide_row_kernels(NT, L=32, KC=0, WORD=""):
    """(gather_rows, unpermute_rows16): the row kernels on 16-byte chunks (_wide.py), the
    CuPy kernels' geometry (permute.cu's gather_rows_kernel and moe_unpermute_kernel).

    gather_rows     block = NT threads = NT / L rows (L = 32: one warp per slot row), grid =
                    cdiv(P, NT / L); lane l copies chunks l, l + L, ... of the row, four
                    16-byte loads in flight before their four stores.
    unpermute_rows16  block = NT threads over a token row's chunks, grid = T * cdiv(C16, NT)
                    (flattened: no 65535 limit on T); a thread owns one 16-byte chunk (VEC16
                    elements) and sums its K rows, the K loads unrolled (KC > 0) so that they
                    are in flight together.
    Arrays are uint64 views (words16) with C words per row, C even; a chunk is 2 words."""
    ROWS = NT // L
    if WORD:
        VEC = WORD_ELEMENTS[WORD]
        VEC16 = 2 * VEC           # elements per 16-byte chunk
        unpack, pack = UNPACK[WORD], PACK[WORD]

        @device_function
        def add16(acc, y, i, wt):
            lo, hi = load16(y, i)
            for v in range(VEC):
                acc[v] += unpack(lo, v) * wt
                acc[VEC + v] += unpack(hi, v) * wt

    def gather_rows(x, inv, K, x_grouped, P, C):
        """x_grouped[inv[s], :] = x[s // K, :], L lanes per slot row, 16-byte chunks."""
        lane = cu.threadIdx.x % L
        s = cu.blockIdx.x * ROWS + cu.threadIdx.x // L
        if s >= P:
            return
        dst = inv[ix(s)]
        if dst < 0 or dst >= P:   # a slot the alignment skipped (an id outside [0, E))
            return
        src0 = (s // K) * C       # flat word index of the source row
        dst0 = dst * C
        for c0 in range(2 * lane, C, 8 * L):      # 4 chunks of 2 words, 2L words apart
            c1, c2, c3 = c0 + 2 * L, c0 + 4 * L, c0 + 6 * L
            if c3 < C:                            # the common case: all four in the row
                a0, b0 = load16(x, src0 + c0)
                a1, b1 = load16(x, src0 + c1)
                a2, b2 = load16(x, src0 + c2)
                a3, b3 = load16(x, src0 + c3)
                store16(x_grouped, dst0 + c0, a0, b0)
                store16(x_grouped, dst0 + c1, a1, b1)
                store16(x_grouped, dst0 + c2, a2, b2)
                store16(x_grouped, dst0 + c3, a3, b3)
            else:
                for c in range(c0, C, 2 * L):
                    a, b = load16(x, src0 + c)
                    store16(x_grouped, dst0 + c, a, b)

    def unpermute_rows16(y, w, inv, out, T, K, C, nbx):
        """out[t, chunk] = sum_k w[t, k] y[inv[t*K + k], chunk] in fp32 (k in order), rounded
        once; nbx = blocks per token row. An index outside [0, P) adds nothing."""
        P = y.shape[0]
        t = cu.blockIdx.x // nbx
        c = ((cu.blockIdx.x % nbx) * NT + cu.threadIdx.x) * 2   # first word of the chunk
        if t >= T or c >= C:
            return
        acc = cu.local.array(VEC16, float32)
        for v in range(VEC16):
            acc[v] = float32(0.0)
        if KC > 0:
            for k in range(KC):
                r = inv[ix(t * KC + k)]
                if r >= 0 and r < P:
                    add16(acc, y, r * C + c, to_f32(w[ix(t), k]))
        else:
            for k in range(K):
                r = inv[ix(t * K + k)]
                if r >= 0 and r < P:
                    add16(acc, y, r * C + c, to_f32(w[ix(t), ix(k)]))
        lo = uint64(0)
        hi = uint64(0)
        for v in range(VEC):
            lo = pack(lo, v, acc[v])
            hi = pack(hi, v, acc[VEC + v])
        store16(out, t * C + c, lo, hi)

    return kernel(gather_rows), (kernel(unpermute_rows16) if WORD else None)


# ----------------------------------------------------------------------------- launchers
def moe_permute(hidden_states, topk_ids, num_experts):
    """Gather token rows into expert-contiguous order (stable in s).

    hidden_states [T, H], topk_ids [T, K] -> x_grouped [P, H] (x_grouped[inv[s]] =
    hidden_states[s // K]), expert_offsets int32 [E+1], inv_permuted_idx int32 [P].
    Kernels: align.py's with B = 1 (offsets and the inverse index), then the row copy.
    """
    A.check_float("hidden_states", hidden_states, ndim=2, with_f64=True)
    A.check_int_array("topk_ids", topk_ids, ndim=2)
    E = A.check_int("num_experts", num_experts, minimum=1)
    T, H = A.shape_of(hidden_states)
    if A.shape_of(topk_ids)[0] != T:
        raise ValueError(f"topk_ids: expected {T} rows to match hidden_states, "
                         f"got shape {A.shape_of(topk_ids)}")
    A.check_ids_in_range("topk_ids", topk_ids, E)
    K = A.shape_of(topk_ids)[1]
    P = T * K
    call = A.Call("hidden_states", hidden_states)
    _, _, _, offsets, inv = _sort_slots(call, topk_ids, E, 1, None, False, P, False, True)
    x_grouped = call.empty((P, H), A.dtype_of(hidden_states))              # [P, H]
    if P and H:
        cfg = config("rows")
        NT = cfg["THREADS"]
        x = call.dev("hidden_states", hidden_states)
        wide = words16(x, x_grouped) if cfg["WIDE"] else None
        if wide is not None:   # 16-byte chunks, one warp per slot row (CuPy's gather)
            L = cfg["ROW_LANES"]
            gather_rows, _ = wide_row_kernels(NT, L)
            xs, xg = wide
            gather_rows[A.cdiv(P, NT // L), NT, A.launch_stream()](xs, inv, K, xg, P, xs.shape[1])
        else:
            permute_rows, _ = row_kernels(NT)
            views = words(x, x_grouped)   # 8-byte words whatever the dtype, when rows allow
            xs, xg = views if views is not None else (x, x_grouped)
            cols = xs.shape[1]
            grid = (A.cdiv(cols, 4 * NT), min(P, MAX_GRID_Y))
            permute_rows[grid, NT, A.launch_stream()](xs, inv, K, xg, P, cols)
    return call.result(x_grouped), call.result(offsets), call.result(inv)


def moe_unpermute(y_grouped, topk_weights, inv_permuted_idx):
    """Weighted combine back into token order.

    out[t] = sum_k topk_weights[t, k] * y_grouped[inv_permuted_idx[t*K + k]], fp32 in slot
    order, rounded once to y_grouped's dtype. y_grouped [P, H], topk_weights [T, K],
    inv_permuted_idx [P] -> out [T, H]. Kernel: unpermute_rows (module docstring).
    """
    A.check_float("y_grouped", y_grouped, ndim=2)
    A.check_float("topk_weights", topk_weights, ndim=2, with_f64=True)
    T, K = A.shape_of(topk_weights)
    A.check_int_array("inv_permuted_idx", inv_permuted_idx, ndim=1, shape=(T * K,))
    P, H = A.shape_of(y_grouped)
    if P != T * K:
        raise ValueError(f"y_grouped: expected {T * K} rows (T*K), got shape {(P, H)}")
    call = A.Call("y_grouped", y_grouped)
    out = call.empty((T, H), A.dtype_of(y_grouped))                         # [T, H]
    if T and H:
        cfg = config("rows")
        NT = cfg["THREADS"]
        y = call.dev("y_grouped", y_grouped)
        w = call.dev("topk_weights", topk_weights)
        inv = call.dev("inv_permuted_idx", inv_permuted_idx)
        wide = words16(y, out) if cfg["WIDE"] and np.dtype(y.dtype) in WORD_OF else None
        if wide is not None:   # 16-byte chunks, one per thread (CuPy's unpermute)
            yw, outw = wide
            C = yw.shape[1]
            grid, nt, nbx = chunk_grid(C, NT, T)
            _, unpermute16 = wide_row_kernels(nt, 32, K if K <= MAX_UNROLLED_K else 0,
                                              WORD_OF[np.dtype(y.dtype)])
            unpermute16[grid, nt, A.launch_stream()](yw, w, inv, outw, T, K, C, nbx)
            return call.result(out)
        word, cols, views = "", H, words(y, out)
        if views is not None:   # 8-byte loads: VEC columns per thread
            word = WORD_OF[np.dtype(y.dtype)]
            y, out_k = views
            cols = H // WORD_ELEMENTS[word]
        else:
            out_k = out
        _, unpermute_rows = row_kernels(NT, K if K <= MAX_UNROLLED_K else 0, word)
        grid = (A.cdiv(cols, 4 * NT), min(T, MAX_GRID_Y))
        unpermute_rows[grid, NT, A.launch_stream()](y, w, inv, out_k, T, K, cols)
    return call.result(out)


# ----------------------------------------------------------------------------- compile checks
def compile_cases():
    """(label, kernel, argument types) of every launch above, for the PTX checks (_ptx.py)."""
    from numba import types as t

    def arr(dt, nd):
        return t.Array(dt, nd, "C")

    i64 = t.int64
    v = arr(t.int32, 1)
    cases = []
    nt = CONFIGS["rows"]["THREADS"]
    permute_rows, _ = row_kernels(nt)
    for dt in (t.float32, t.float16, t.uint16, t.uint64):   # uint64: rows copied as words
        cases.append((f"permute_rows {dt}", permute_rows,
                      (arr(dt, 2), v, i64, arr(dt, 2), i64, i64)))
    gather_rows, _ = wide_row_kernels(nt, CONFIGS["rows"]["ROW_LANES"])
    w64 = arr(t.uint64, 2)
    cases.append(("gather_rows 16-byte chunks", gather_rows, (w64, v, i64, w64, i64, i64)))
    for word in ("f32", "f16", "bf16"):
        for kc in (8, 0):
            _, unpermute16 = wide_row_kernels(nt, 32, kc, word)
            cases.append((f"unpermute_rows16 K={kc or 'runtime'} {word}", unpermute16,
                          (w64, arr(t.float32, 2), v, w64, i64, i64, i64, i64)))
    for dt, word in ((t.float32, "f32"), (t.float16, "f16"), (t.uint16, "bf16")):
        for kc in (8, 0):
            for wk in (word, ""):
                _, unpermute_rows = row_kernels(nt, kc, wk)
                io = t.uint64 if wk else dt
                cases.append((f"unpermute_rows K={kc or 'runtime'} {dt}" + (" words" if wk else ""),
                              unpermute_rows,
                              (arr(io, 2), arr(t.float32, 2), v, arr(io, 2), i64, i64, i64)))
    return cases


# ----------------------------------------------------------------------------- as a script
def _main():
    import reference

    from . import _script as S

    def lines(rng):
        cases = ([(3, 8, 2, 16), (9, 4, 3, 24)] if SIMULATOR
                 else [(1, 8, 2, 4096), (256, 128, 8, 2048), (4096, 256, 8, 7168)])
        for T, E, K, H in cases:
            ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)  # [T, K]
            x = rng.standard_normal((T, H)).astype(np.float32)                    # [T, H]
            mine = moe_permute(x, ids, E)
            ref = reference.moe_permute(x, ids, E)
            same = all(np.array_equal(a, b) for a, b in zip(mine, ref))
            y = rng.standard_normal((T * K, H)).astype(np.float32)                # [P, H]
            w = rng.random((T, K)).astype(np.float32)
            err = S.rel_err(moe_unpermute(y, w, ref[2]), reference.moe_unpermute(y, w, ref[2]))
            yield (f"  moe_permute / moe_unpermute T={T:5d} E={E:4d} K={K:2d} H={H:5d}: "
                   f"{'exact' if same else 'DIFFER'}, rel err {err:.1e}"
                   + S.timed(lambda d_x, d_ids: moe_permute(d_x, d_ids, E), x, ids)
                   + S.timed(moe_unpermute, y, w, ref[2]), same and err <= 1e-6)

    return S.main("permute", lines)


if __name__ == "__main__":
    sys.exit(_main())
