"""The fused MoE grouped GEMM in Numba: a ladder of versions, all kept.

    T = tokens, K = top-k (top_k), P = a.shape[0] * top_k slots, E = local experts,
    N = output width (2I for GEMM1, H for GEMM2), Kd = inner size (H for GEMM1, I for GEMM2),
    B = block_size (the alignment block), BM x BN = a thread block's output tile

    grouped_gemm(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_size,
                 topk_weights=None, mul_routed_weight=False, bias=None, *, version=None)
        -> c [P, N] in a.dtype

The math (reference/gemm.py): for every position p < num_tokens_post_padded with
s = sorted_token_ids[p] < P and e = expert_ids[p // B]:
    c[s, :] = (a[s // top_k, :] @ w[e].T + bias[e]) * (topk_weights.flat[s] if mul_routed_weight)
in fp32, rounded once to a.dtype; c[s, :] = 0 when e == -1 (an expert on another rank).
Device inputs are not read back for checks: an expert id >= E also gives zeros and a slot
outside [0, P) is skipped, so a bad alignment never makes the kernel read or write out of
bounds (host inputs are checked and raise, as the reference does).
a [M_a, Kd], w [E, N, Kd] (Hugging Face [out, in]), bias [E, N]. Rows no position names are
left unwritten (the reference leaves them NaN). The gather of a's rows through sorted_token_ids
is fused into the GEMM, as in vLLM: nothing is permuted in memory.

Versions (`version=`; None runs DEFAULT_VERSION, or the next rung down that fits):

    v1  naive: one thread per output element, a dot product of length Kd from global memory.
        block (TX, TY) = (32, 8) over (n, p); grid (cdiv(max_padded, TY), cdiv(N, TX)).
    v2  shared-memory tiles: a BM x BN tile per block, one output per thread; each k-step
        stages a [BM, BK] slice of the gathered a rows and a [BN, BK] slice of w[e] in shared
        memory (w padded to BK + 1 columns: conflict-free column reads).
        block (BN, BM) threads, BN = BK; grid (cdiv(max_padded, BM), cdiv(N, BN));
        shared = (BM + BN) * (BK + 1) * 4 bytes + 2 BM ints.
    v3  register blocking: a BM x BN tile per block of (BN/TN) x (BM/TM) threads, each thread
        a TM x TN micro-tile in registers (cuda.local.array with compile-time sizes, fully
        unrolled so it lives in registers: tests/numba/test_cpu.py checks ptxas reports no
        stack); shared tiles stored k-major (As [BK][BM+1], Ws [BK][BN+1]) so a thread reads
        TM + TN values per k and does TM * TN FMAs; the next k-step's global loads are issued
        into registers before the current step's math (prefetch), so their latency hides
        behind the FMAs. A thread owns rows ty + TY i and columns tx + TX j (strided), which
        makes shared reads conflict-free and stores coalesced. Global loads are 8 bytes
        (two fp32 or four fp16 / bf16: a and w viewed as uint64 words, taken apart when
        staged) when Kd is a multiple of the word and the bases are 8-byte aligned, else one
        element each. Tile table CONFIGS["v3"] keyed by BM (the tallest dividing B): 64 rows
        x 128 columns x 16 deep on 16 x 16 threads; 32 and 16 rows x 64 columns x 32 deep on
        16 x 8 and 16 x 4 threads, for many small blocks and more weight bytes in flight.
        grid (cdiv(max_padded, BM), cdiv(N, BN)); shared = BK * (BM + BN + 2) * 4 bytes + 2 BM ints.
    v3v v3 written as the CuPy rung is (cuda_kernels/cupy/gemm_v3_regblock.cu, line for line):
        16-byte loads everywhere, through two small intrinsics (_vector.py): a and w as flat
        uint32 views read 4 words (8 bf16 / fp16, 4 fp32) per ld.global.nc.v4, and a thread
        owns TM consecutive rows and TN consecutive columns, so its k-row of each shared tile
        is one ld.shared.v4 per 4 values (v3: one 4-byte load each). Tiles padded by 4 floats
        (rows stay 16-byte aligned), launch bounds cap registers (occupancy), a warp whose
        rows are all padding skips the FMAs. Needs Kd a multiple of 16 bytes' elements and
        16-byte aligned a and w, else v3 runs. Tile table CONFIGS["v3v"] keyed by BM as v3;
        a "sparse" tile (TM = 1: one row per thread, so only warps holding live rows compute)
        when the slots per expert fill at most SPARSE_FILL of the tile (decode).
        block (BN/TN) * (BM/TM) threads, 1-D; grid (cdiv(min(max_padded, P * B), BM),
        cdiv(N, BN)): a valid alignment never pads past P * B rows, which at decode is far
        below max_padded = P + E (B - 1), so no blocks launch only to return; a block loops
        over row tiles blockIdx.x + k gridDim.x below num_tokens_post_padded, so any other
        alignment stays correct. shared = BK * (BM + BN + 8) * 4 bytes + 12 BM bytes.

BM divides B (a tile never straddles two experts, so the expert is one load per tile): v2's
tile height is gcd(BM, B); v3 runs when one of its tile heights divides B (B a multiple of
16), else v2 runs. Tiles past num_tokens_post_padded (read on the device: no host sync)
return at once.
Tunables are data: CONFIGS below (SIM_CONFIGS: small tiles for the simulator). No tensor
cores: numba.cuda has no mma/wgmma API (inline PTX through an intrinsic, as _device.py does
for cvt.rn.bf16.f32, could reach mma.sync; not done here); the CuPy backend's v4 is the
tensor-core rung.

dtypes: a and w fp32, fp16 or bf16 (bf16 as uint16 bits, converted by shifts when staged;
rounded by cvt.rn.bf16.f32 on store, sm_80+: _device.py); bias and topk_weights any float;
accumulation fp32.

FLOPs = 2 * (rows computed) * N * Kd; bytes >= w of every used expert + gathered a + c.
Run as a script to validate every version and time it: python -m cuda_kernels.numba.gemm
"""
from __future__ import annotations

import functools
import math
import sys
from typing import NamedTuple

import numpy as np
from numba import float32, int32, int64, uint32, uint64

from . import _arrays as A
from ._device import (SIMULATOR, UNPACK, WORD_ELEMENTS, cast_out, cu, device_function, ix, kernel,
                      to_f32)
from ._vector import ldg4, lds4

VERSIONS = ("v1", "v2", "v3", "v3v")
# what version=None runs (stepping down to what fits). H200, bf16, Mixtral / Qwen3 / DeepSeek-V3
# at T = 1..4096 (benchmarks/bench_numba.py): v3v within
# 1.09x of CuPy v3 at all 36 GEMM points (0.67x to 1.09x; v3: 0.83x to 1.40x)
DEFAULT_VERSION = "v3v"
CONFIGS = {
    "v1": {"TX": 32, "TY": 8},
    "v2": {"BM": 16, "BN": 16, "BK": 16},
    # v3: tile height BM -> the rest; a launch takes the tallest BM that divides block_size.
    # The tall tile: 16 x 16 threads, TM x TN = 4 x 8 (compute-bound prefill). Shorter tiles
    # (few slots per expert: the weight stream is the cost): narrow, deep tiles on 128 and 64
    # threads (TM x TN = 4 x 4), so many small blocks share an SM and keep more weight bytes
    # in flight (H200: 256-thread tiles here ran 1.3-1.9x behind CuPy's v3).
    "v3": {
        64: {"BN": 128, "BK": 16, "TM": 4, "TN": 8},
        32: {"BN": 64, "BK": 32, "TM": 4, "TN": 4},
        16: {"BN": 64, "BK": 32, "TM": 4, "TN": 4},
    },
    # v3v: CuPy v3's tiles (gemm_configs.json, bf16): 64 x 64 x 32 on 256 threads from 64 rows,
    # 32 and 16 rows x 64 x 32 on 128 and 64 threads; TM x TN = 4 x 4 (one LDS.128 each)
    # MB: launch bounds' blocks per SM, so registers stay <= 64K / (threads * MB) (72-85 here;
    # nvcc gives the CuPy kernel 72; without bounds numba's PTX took 93 at 16 rows; 16 rows
    # with 72 spilled once the row-tile loop came in, so 12 blocks: 79, no spills)
    # "sparse": the tile used when a tile is expected to hold few live rows (at most
    # SPARSE_FILL of BM: decode, many experts): one row per thread (TM = 1), so only the warps
    # that hold live rows run FMAs, the rest just load (every warp helps stream w)
    "v3v": {
        64: {"BN": 64, "BK": 32, "TM": 4, "TN": 4, "MB": 3},
        32: {"BN": 64, "BK": 32, "TM": 4, "TN": 4, "MB": 7},
        16: {"BN": 64, "BK": 32, "TM": 4, "TN": 4, "MB": 12,
             "sparse": {"BN": 64, "BK": 32, "TM": 1, "TN": 4, "MB": 6}},
    },
}
SPARSE_FILL = 0.25
BOUND_GRID = True           # v3v: size the grid by P * B rows when below capacity (launch)
SIM_CONFIGS = {
    "v1": {"TX": 4, "TY": 4},
    "v2": {"BM": 4, "BN": 4, "BK": 4},
    "v3": {8: {"BN": 8, "BK": 4, "TM": 2, "TN": 2}, 4: {"BN": 8, "BK": 4, "TM": 1, "TN": 2}},
    "v3v": {8: {"BN": 8, "BK": 8, "TM": 4, "TN": 4, "sparse": {"BN": 8, "BK": 8, "TM": 1, "TN": 4}},
            4: {"BN": 8, "BK": 8, "TM": 4, "TN": 4}},
}


def config(version):
    return (SIM_CONFIGS if SIMULATOR else CONFIGS)[version]


# ----------------------------------------------------------------------------- v1 naive
@functools.lru_cache(maxsize=None)
def gemm_v1(TX: int, TY: int):
    def v1(a, w, sorted_ids, expert_ids, num_post, topk_w, bias, c, P, top_k, N, Kd, B,
           mul_w, has_bias):
        """One thread per (position p, column n): c[s, n] = a[s // top_k] . w[e, n] (+ ...)."""
        p = cu.blockIdx.x * TY + cu.threadIdx.y
        n = cu.blockIdx.y * TX + cu.threadIdx.x
        if p >= num_post[0] or n >= N:
            return
        s = sorted_ids[p]
        if s >= P or s < 0:             # padding
            return
        e = expert_ids[p // B]
        if e < 0 or e >= w.shape[0]:    # expert on another rank: its rows are zeros
            c[s, n] = cast_out(c, float32(0.0))
            return
        row = s // top_k
        acc = float32(0.0)
        for k in range(Kd):
            acc += to_f32(a[ix(row), ix(k)]) * to_f32(w[ix(e), ix(n), ix(k)])
        if has_bias:
            acc += to_f32(bias[ix(e), ix(n)])
        if mul_w:
            acc *= to_f32(topk_w[ix(s)])
        c[ix(s), ix(n)] = cast_out(c, acc)

    return kernel(v1)


# ----------------------------------------------------------------------------- v2 smem tiles
@functools.lru_cache(maxsize=None)
def gemm_v2(BM: int, BN: int, BK: int):
    if BN != BK:
        raise ValueError(f"v2 config: expected BN == BK (a thread loads one column), "
                         f"got {BN}, {BK}")
    BKP = BK + 1   # padded row: thread tx reads Ws[tx][kk] without bank conflicts

    def v2(a, w, sorted_ids, expert_ids, num_post, topk_w, bias, c, P, top_k, N, Kd, B,
           mul_w, has_bias):
        """A BM x BN tile per block, one output per thread, k-slices staged in shared memory."""
        tx = cu.threadIdx.x & 1023          # column in the tile, and the k loaded
        ty = cu.threadIdx.y & 1023          # row in the tile (& 1023: LLVM learns >= 0)
        p0 = cu.blockIdx.x * BM
        n0 = cu.blockIdx.y * BN
        if p0 >= num_post[0]:
            return
        As = cu.shared.array((BM, BKP), float32)
        Ws = cu.shared.array((BN, BKP), float32)
        srow = cu.shared.array(BM, int32)   # a row of each tile row, -1 for padding
        if tx == 0:
            s = sorted_ids[ix(p0 + ty)]
            srow[ty] = s // top_k if s < P and s >= 0 else -1
        e = expert_ids[ix(p0 // B)]         # BM divides B: one expert per tile
        cu.syncthreads()
        s = sorted_ids[ix(p0 + ty)]
        live = s < P and s >= 0
        n = n0 + tx
        if e < 0 or e >= w.shape[0]:        # another rank's expert (>= E: never read w)
            if live and n < N:
                c[ix(s), ix(n)] = cast_out(c, float32(0.0))
            return
        acc = float32(0.0)
        for k0 in range(0, Kd, BK):
            r = srow[ty]
            k = k0 + tx
            As[ty, tx] = to_f32(a[ix(r), ix(k)]) if r >= 0 and k < Kd else float32(0.0)
            for i in range(ty, BN, BM):     # BN rows of w[e] by BM thread rows
                if n0 + i < N and k < Kd:
                    Ws[ix(i), tx] = to_f32(w[ix(e), ix(n0 + i), ix(k)])
                else:
                    Ws[ix(i), tx] = float32(0.0)
            cu.syncthreads()
            for kk in range(BK):
                acc += As[ty, ix(kk)] * Ws[tx, ix(kk)]
            cu.syncthreads()
        if live and n < N:
            if has_bias:
                acc += to_f32(bias[ix(e), ix(n)])
            if mul_w:
                acc *= to_f32(topk_w[ix(s)])
            c[ix(s), ix(n)] = cast_out(c, acc)

    return kernel(v2)


# ----------------------------------------------------------------------------- v3 registers
@functools.lru_cache(maxsize=None)
def gemm_v3(BM: int, BN: int, BK: int, TM: int, TN: int, WORD: str = ""):
    """The v3 kernel for one tile config. WORD ("f32" | "f16" | "bf16") makes a and w uint64
    views (8-byte loads, VEC elements per word, unpacked when staged); "" loads elements."""
    TX, TY = BN // TN, BM // TM
    NT = TX * TY
    VEC = WORD_ELEMENTS[WORD] if WORD else 1
    if BN % TN or BM % TM or BK % VEC:
        raise ValueError(f"v3 config: tiles must split evenly, got BM={BM} BN={BN} BK={BK} "
                         f"TM={TM} TN={TN} VEC={VEC}")
    KW = BK // VEC          # loads per tile row and k-step (words, or elements)
    A_LD = BM * KW          # loads of the a tile per k-step, spread over the NT threads
    W_LD = BN * KW
    LA = -(-A_LD // NT)     # per thread (the last round may leave threads idle)
    LW = -(-W_LD // NT)
    BMP = BM + 1            # padded k-major rows: the transposing stores spread over banks
    BNP = BN + 1
    SA = BK * BMP           # shared words of the a tile, [BK][BMP] flattened
    SW = BK * BNP           # shared words of the w tile, [BK][BNP] flattened
    REG = uint64 if WORD else float32   # what a prefetch register holds
    ZERO = np.uint64(0) if WORD else np.float32(0.0)

    # the three places the two load modes differ, chosen here so the kernel reads the same
    if WORD:
        unpack = UNPACK[WORD]

        @device_function
        def load_a(a, r, kl):
            return a[ix(r), ix(kl)]                  # a word: VEC elements of row r

        @device_function
        def load_w(w, e, n, kl):
            return w[ix(e), ix(n), ix(kl)]

        @device_function
        def stage(S, stride, kv, m, reg):
            for v in range(VEC):                     # unpack into VEC k-rows of the tile
                S[ix((kv + v) * stride + m)] = unpack(reg, v)
    else:
        @device_function
        def load_a(a, r, kl):
            return to_f32(a[ix(r), ix(kl)])

        @device_function
        def load_w(w, e, n, kl):
            return to_f32(w[ix(e), ix(n), ix(kl)])

        @device_function
        def stage(S, stride, kv, m, reg):
            S[ix(kv * stride + m)] = reg

    def v3(a, w, sorted_ids, expert_ids, num_post, topk_w, bias, c, P, top_k, N, Kd, B,
           mul_w, has_bias):
        """A BM x BN tile per block of TX x TY threads, a TM x TN micro-tile per thread.
        With WORD, a [M_a, Kd / VEC] and w [E, N, Kd / VEC] are uint64 views."""
        tid = cu.threadIdx.x & 1023         # & tells LLVM tid >= 0: no sign fix-ups below
        tx = tid % TX
        ty = tid // TX
        p0 = cu.blockIdx.x * BM
        n0 = cu.blockIdx.y * BN
        if p0 >= num_post[0]:
            return
        Kl = Kd // VEC                      # loads along a row of a or w
        As = cu.shared.array(SA, float32)   # a tile, k-major: As[k * BMP + m]
        Ws = cu.shared.array(SW, float32)   # w tile, k-major: Ws[k * BNP + n]
        srow = cu.shared.array(BM, int32)   # a row per tile row, -1 for padding
        sslot = cu.shared.array(BM, int32)  # slot s per tile row, -1 for padding
        for m in range(tid, BM, NT):
            s = sorted_ids[ix(p0 + m)]
            valid = s < P and s >= 0
            srow[m] = s // top_k if valid else -1
            sslot[m] = s if valid else -1
        e = expert_ids[ix(p0 // B)]
        cu.syncthreads()
        if e < 0 or e >= w.shape[0]:        # uniform over the block
            for i in range(TM):
                s = sslot[ix(ty + TY * i)]
                if s >= 0:
                    for j in range(TN):
                        n = n0 + tx + TX * j
                        if n < N:
                            c[ix(s), ix(n)] = cast_out(c, float32(0.0))
            return

        acc = cu.local.array((TM, TN), float32)
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)
        pa = cu.local.array(LA, REG)        # the next k-step's loads, in flight
        pw = cu.local.array(LW, REG)
        am = cu.local.array(TM, float32)
        wn = cu.local.array(TN, float32)

        # load q of this thread: idx = tid + NT q; tile row idx // KW, load idx % KW of it
        for q in range(LA):
            idx = tid + NT * q
            pa[q] = ZERO
            if idx < A_LD:
                r = srow[ix(idx // KW)]
                kl = idx % KW
                if r >= 0 and kl < Kl:
                    pa[q] = load_a(a, r, kl)
        for q in range(LW):
            idx = tid + NT * q
            pw[q] = ZERO
            if idx < W_LD:
                n = n0 + idx // KW
                kl = idx % KW
                if n < N and kl < Kl:
                    pw[q] = load_w(w, e, n, kl)

        for k0 in range(0, Kl, KW):         # k-steps of BK elements (KW loads) each
            for q in range(LA):             # registers -> shared, transposed (and unpacked)
                idx = tid + NT * q
                if idx < A_LD:
                    stage(As, BMP, (idx % KW) * VEC, idx // KW, pa[q])
            for q in range(LW):
                idx = tid + NT * q
                if idx < W_LD:
                    stage(Ws, BNP, (idx % KW) * VEC, idx // KW, pw[q])
            cu.syncthreads()
            k1 = k0 + KW
            if k1 < Kl:                     # issue the next step's loads now
                for q in range(LA):
                    idx = tid + NT * q
                    pa[q] = ZERO
                    if idx < A_LD:
                        r = srow[ix(idx // KW)]
                        kl = k1 + idx % KW
                        if r >= 0 and kl < Kl:
                            pa[q] = load_a(a, r, kl)
                for q in range(LW):
                    idx = tid + NT * q
                    pw[q] = ZERO
                    if idx < W_LD:
                        n = n0 + idx // KW
                        kl = k1 + idx % KW
                        if n < N and kl < Kl:
                            pw[q] = load_w(w, e, n, kl)
            ao = ty                         # As[kk * BMP + ty + TY i]
            wo = tx                         # Ws[kk * BNP + tx + TX j]
            for kk in range(BK):            # TM + TN shared reads, TM * TN FMAs
                for i in range(TM):
                    am[i] = As[ix(ao + TY * i)]
                for j in range(TN):
                    wn[j] = Ws[ix(wo + TX * j)]
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += am[i] * wn[j]
                ao += BMP
                wo += BNP
            cu.syncthreads()

        for i in range(TM):
            s = sslot[ix(ty + TY * i)]
            if s >= 0:
                scale = to_f32(topk_w[ix(s)]) if mul_w else float32(1.0)
                for j in range(TN):
                    n = n0 + tx + TX * j
                    if n < N:
                        v = acc[i, j]
                        if has_bias:
                            v += to_f32(bias[ix(e), ix(n)])
                        if mul_w:
                            v *= scale
                        c[ix(s), ix(n)] = cast_out(c, v)

    return kernel(v3)


# ----------------------------------------------------------------------------- v3v 16-byte
@functools.lru_cache(maxsize=None)
def gemm_v3v(BM: int, BN: int, BK: int, TM: int, TN: int, WORD: str, MIN_BLOCKS: int = 0):
    """v3 as the CuPy rung writes it (gemm_v3_regblock.cu, line for line): 16-byte global loads
    (ldg4: a and w as flat uint32 views, 4 words = VEC elements), 16-byte shared reads (lds4:
    a thread owns TM consecutive rows and TN consecutive columns, so its values of one k-row
    are contiguous), rows padded by 4 floats to keep them 16-byte aligned. WORD: "f32" |
    "f16" | "bf16" (a 4-byte word holds 1 or 2 elements). MIN_BLOCKS > 0: launch bounds
    (NT threads, MIN_BLOCKS blocks per SM), which caps registers at 64K / (NT * MIN_BLOCKS)."""
    TX, TY = BN // TN, BM // TM
    NT = TX * TY
    U = 1 if WORD == "f32" else 2            # elements per 4-byte word
    VEC = 4 * U                              # elements per 16-byte chunk
    if BN % TN or BM % TM or BK % VEC or TN % 4 or NT > 1024 or (NT < 32 and not SIMULATOR):
        raise ValueError(f"v3v config: expected TM | BM, TN | BN (TN a multiple of 4), BK a "
                         f"multiple of {VEC}, 32..1024 threads; got BM={BM} BN={BN} BK={BK} "
                         f"TM={TM} TN={TN}")
    A_VECS = BM * BK // VEC                  # 16-byte chunks of the a tile per k-step
    W_VECS = BN * BK // VEC
    A_LD = -(-A_VECS // NT)                  # per thread
    W_LD = -(-W_VECS // NT)
    BMP = BM + 4                             # + 4: rows stay 16-byte aligned for lds4
    BNP = BN + 4
    SA = BK * BMP                            # shared words of the a tile, [BK][BMP] flattened
    SW = BK * BNP
    ALIGN = None if SIMULATOR else 16        # the simulator takes no alignment (and needs none)
    unpack = UNPACK[WORD]

    @device_function
    def stage(S, stride, kc, r, w0, w1, w2, w3):
        """One 16-byte chunk (4 words, VEC elements of k) into column r of a k-major tile."""
        for v in range(U):
            S[ix((kc + v) * stride + r)] = unpack(uint64(w0), v)
            S[ix((kc + U + v) * stride + r)] = unpack(uint64(w1), v)
            S[ix((kc + 2 * U + v) * stride + r)] = unpack(uint64(w2), v)
            S[ix((kc + 3 * U + v) * stride + r)] = unpack(uint64(w3), v)

    @device_function
    def tile(a, w, sorted_ids, expert_ids, topk_w, bias, c, P, top_k, N, Kd, B, mul_w,
             has_bias, tid, p0, n0, Kw, As, Ws, s_arow, s_slot):
        """The output tile at rows p0..p0+BM, columns n0..n0+BN: v3v's body, per row tile."""
        for r in range(tid, BM, NT):
            s = sorted_ids[ix(p0 + r)]
            valid = s < P and s >= 0
            s_slot[r] = s if valid else -1
            s_arow[r] = int64(s // top_k) * Kw if valid else int64(-1)
        e = expert_ids[ix(p0 // B)]
        cu.syncthreads()
        tx = tid % TX
        ty = tid // TX
        E = w.shape[0] // (N * Kw)          # w is flat: E * N * Kw words (Kd > 0 here)
        if e < 0 or e >= E:                 # another rank's expert (>= E: never read w)
            for i in range(TM):
                s = s_slot[ix(ty * TM + i)]
                if s >= 0:
                    for j in range(TN):
                        n = n0 + tx * TN + j
                        if n < N:
                            c[ix(s), ix(n)] = cast_out(c, float32(0.0))
            return
        # a warp whose TM-row strips are all padding skips the FMAs (it still loads and syncs):
        # decode tiles hold a few live rows, at the top (alignment pads each expert's run)
        busy = False
        for i in range(TM):
            if s_slot[ix(ty * TM + i)] >= 0:
                busy = True
        w_e = int64(e) * N * Kw              # int64: E * N * Kd exceeds 2^31 (DeepSeek-V3)

        acc = cu.local.array((TM, TN), float32)
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)
        ra = cu.local.array((A_LD, 4), uint32)   # the next k-step's chunks, in flight
        rw = cu.local.array((W_LD, 4), uint32)
        am = cu.local.array(TM, float32)
        wn = cu.local.array(TN, float32)

        # chunk idx -> (row idx % ROWS, k-chunk idx // ROWS): a warp's lanes take consecutive
        # rows of one k-chunk, so the transposed stores As[k][row] spread over the banks
        for q in range(A_LD):
            idx = tid + NT * q
            for v in range(4):
                ra[q, v] = uint32(0)
            if idx < A_VECS:
                off = s_arow[ix(idx % BM)]
                kw = (idx // BM) * 4
                if off >= 0 and kw < Kw:
                    ra[q, 0], ra[q, 1], ra[q, 2], ra[q, 3] = ldg4(a, off + kw)
        for q in range(W_LD):
            idx = tid + NT * q
            for v in range(4):
                rw[q, v] = uint32(0)
            if idx < W_VECS:
                n = n0 + idx % BN
                kw = (idx // BN) * 4
                if n < N and kw < Kw:
                    rw[q, 0], rw[q, 1], rw[q, 2], rw[q, 3] = ldg4(w, w_e + int64(n) * Kw + kw)

        for k0 in range(0, Kw, BK // U):     # k-steps of BK elements (BK / U words)
            for q in range(A_LD):            # registers -> shared, transposed and unpacked
                idx = tid + NT * q
                if idx < A_VECS:
                    stage(As, BMP, (idx // BM) * VEC, idx % BM,
                          ra[q, 0], ra[q, 1], ra[q, 2], ra[q, 3])
            for q in range(W_LD):
                idx = tid + NT * q
                if idx < W_VECS:
                    stage(Ws, BNP, (idx // BN) * VEC, idx % BN,
                          rw[q, 0], rw[q, 1], rw[q, 2], rw[q, 3])
            cu.syncthreads()
            k1 = k0 + BK // U
            if k1 < Kw:                      # issue the next step's loads now
                for q in range(A_LD):
                    idx = tid + NT * q
                    for v in range(4):
                        ra[q, v] = uint32(0)
                    if idx < A_VECS:
                        off = s_arow[ix(idx % BM)]
                        kw = k1 + (idx // BM) * 4
                        if off >= 0 and kw < Kw:
                            ra[q, 0], ra[q, 1], ra[q, 2], ra[q, 3] = ldg4(a, off + kw)
                for q in range(W_LD):
                    idx = tid + NT * q
                    for v in range(4):
                        rw[q, v] = uint32(0)
                    if idx < W_VECS:
                        n = n0 + idx % BN
                        kw = k1 + (idx // BN) * 4
                        if n < N and kw < Kw:
                            rw[q, 0], rw[q, 1], rw[q, 2], rw[q, 3] = ldg4(
                                w, w_e + int64(n) * Kw + kw)
            if busy:
                ao = ty * TM                 # As[kk * BMP + ty * TM + i]
                wo = tx * TN                 # Ws[kk * BNP + tx * TN + j]
                for kk in range(BK):         # (TM + TN) / 4 LDS.128, TM * TN FMAs
                    for g in range(TM // 4):
                        am[4 * g], am[4 * g + 1], am[4 * g + 2], am[4 * g + 3] = lds4(
                            As, ao + 4 * g)
                    for i in range(TM - TM % 4, TM):   # TM = 1 or 2: 4-byte loads
                        am[i] = As[ix(ao + i)]
                    for g in range(TN // 4):
                        wn[4 * g], wn[4 * g + 1], wn[4 * g + 2], wn[4 * g + 3] = lds4(
                            Ws, wo + 4 * g)
                    for i in range(TM):
                        for j in range(TN):
                            acc[i, j] += am[i] * wn[j]
                    ao += BMP
                    wo += BNP
            cu.syncthreads()

        for i in range(TM):
            s = s_slot[ix(ty * TM + i)]
            if s >= 0:
                scale = to_f32(topk_w[ix(s)]) if mul_w else float32(1.0)
                for j in range(TN):
                    n = n0 + tx * TN + j
                    if n < N:
                        v = acc[i, j]
                        if has_bias:
                            v += to_f32(bias[ix(e), ix(n)])
                        if mul_w:
                            v *= scale
                        c[ix(s), ix(n)] = cast_out(c, v)

    def v3v(a, w, sorted_ids, expert_ids, num_post, topk_w, bias, c, P, top_k, N, Kd, B,
            mul_w, has_bias):
        """A BM x BN tile per block of NT = TX * TY threads, a TM x TN micro-tile per thread;
        a [M_a * Kd / U] and w [E * N * Kd / U] are flat uint32 views (module docstring)."""
        MIN_BLOCKS  # noqa: B018  (named here so the disk cache's closure key tells bounds apart)
        tid = cu.threadIdx.x & 1023
        n0 = cu.blockIdx.y * BN
        Kw = Kd // U                         # words per row of a or w
        As = cu.shared.array(SA, float32, alignment=ALIGN)   # As[k * BMP + m]
        Ws = cu.shared.array(SW, float32, alignment=ALIGN)   # Ws[k * BNP + n]
        s_arow = cu.shared.array(BM, int64)  # word offset of each tile row's a row, -1: padding
        s_slot = cu.shared.array(BM, int32)  # slot s of each tile row, -1: padding
        # row tiles blockIdx.x, + gridDim.x, ... below num_post: the launch sizes the grid so
        # that a valid alignment needs one tile per block; the loop keeps any other correct
        for p0 in range(cu.blockIdx.x * BM, num_post[0], cu.gridDim.x * BM):
            cu.syncthreads()                 # the previous tile is done with s_slot, s_arow
            tile(a, w, sorted_ids, expert_ids, topk_w, bias, c, P, top_k, N, Kd, B, mul_w,
                 has_bias, tid, p0, n0, Kw, As, Ws, s_arow, s_slot)

    return kernel(v3v, launch_bounds=(NT, MIN_BLOCKS) if MIN_BLOCKS else None)


# ----------------------------------------------------------------------------- launch
class Plan(NamedTuple):
    version: str        # what runs (v3 falls back to v2 for block sizes it cannot tile)
    kernel: object
    block: object       # threads per block (int or (x, y))
    bm: int             # tile rows: grid x = cdiv(max_padded, bm)
    bn: int             # tile columns: grid y = cdiv(N, bn)
    word: str           # v3's 8-byte / v3v's 16-byte load kind ("f32" | "f16" | "bf16"), or ""


def plan(version, block_size, word="", vec="", fill=float("inf")):
    """The kernel and geometry of `version` for block size B (None: DEFAULT_VERSION).

    v3v runs when `vec` names its 16-byte load kind (the caller checked a and w allow it) and
    one of its tile heights divides B, else v3 runs; `fill` (the expected live rows of a tile,
    slots per expert) picks its "sparse" tile when at most SPARSE_FILL of the tile height.
    v3 takes the tallest tile of its table dividing B and runs v2 when none does; v2's tile
    height is gcd(BM, B). `word` asks v3 for 8-byte loads (the caller checked it can)."""
    if version is None:
        version = DEFAULT_VERSION
    A.check_choice("version", version, VERSIONS)
    if version == "v3v":
        table = config("v3v")
        fits = [bm for bm in table if block_size % bm == 0]
        if fits and vec:
            bm = max(fits)
            c = table[bm]
            if fill <= SPARSE_FILL * bm and "sparse" in c:
                c = c["sparse"]
            # fp32: half the depth, the same bytes per k-step (and prefetch registers; 32 deep
            # spilled at 16 rows), as CuPy's table does
            bk = c["BK"] // 2 if vec == "f32" and c["BK"] >= 8 else c["BK"]
            kernel = gemm_v3v(bm, c["BN"], bk, c["TM"], c["TN"], vec, c.get("MB", 0))
            return Plan("v3v", kernel, (c["BN"] // c["TN"]) * (bm // c["TM"]), bm, c["BN"], vec)
        version = "v3"          # no 16-byte loads here (or no tile height fits): v3 runs
    if version == "v3":
        table = config("v3")
        fits = [bm for bm in table if block_size % bm == 0]
        if fits:
            bm = max(fits)
            c = table[bm]
            kernel = gemm_v3(bm, c["BN"], c["BK"], c["TM"], c["TN"], word)
            return Plan("v3", kernel, (c["BN"] // c["TN"]) * (bm // c["TM"]), bm, c["BN"], word)
        version = "v2"
    if version == "v2":
        cfg = config("v2")
        bm = math.gcd(cfg["BM"], block_size)
        return Plan("v2", gemm_v2(bm, cfg["BN"], cfg["BK"]), (cfg["BN"], bm), bm, cfg["BN"], "")
    cfg = config("v1")
    return Plan("v1", gemm_v1(cfg["TX"], cfg["TY"]), (cfg["TX"], cfg["TY"]), cfg["TY"],
                cfg["TX"], "")


_WORD_OF = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
            np.dtype(np.uint16): "bf16"}


def _word_kind(ad, wd, Kd):
    """The 8-byte load kind for a and w (numba views), or "" when they cannot be read in
    words: Kd a multiple of the word's elements, C-contiguous rows, 8-byte aligned bases."""
    kind = _WORD_OF.get(np.dtype(ad.dtype), "")
    if not kind or Kd % WORD_ELEMENTS[kind]:
        return ""
    for x in (ad, wd):
        if not x.is_c_contiguous():
            return ""
        if not SIMULATOR and x.__cuda_array_interface__["data"][0] % 8:
            return ""
    return kind


def _vec_kind(ad, wd, Kd):
    """v3v's load kind for a and w (numba views), or "" when they cannot be read in 16-byte
    chunks: Kd > 0 a multiple of the chunk's elements (4 fp32, 8 fp16 / bf16), C-contiguous,
    16-byte aligned bases (so every chunk of a row is aligned and inside the row)."""
    kind = _WORD_OF.get(np.dtype(ad.dtype), "")
    if not kind or Kd <= 0 or Kd % (16 // np.dtype(ad.dtype).itemsize):
        return ""
    for x in (ad, wd):
        if not x.is_c_contiguous():
            return ""
        if not SIMULATOR and x.__cuda_array_interface__["data"][0] % 16:
            return ""
    return kind


def get_config(M, N, K, E, top_k, dtype, version=None):
    """The alignment block size (BLOCK_M) and version for a GEMM of M tokens, N x K weights,
    E experts, top_k slots per token (the registry asks this to choose the layer's B).

    B is the v3 tile height that wastes the least padding: each expert's run is padded to a
    multiple of B, so with few slots per expert (decode) a small B keeps the padded rows
    (computed, then dropped) few; with many, a tall tile reuses each w element more often.
    """
    slots_per_expert = M * top_k / max(E, 1)
    heights = sorted(config("v3"))                 # the v3 tile heights, e.g. 16, 32, 64
    block = heights[-1]
    for h in heights:
        if slots_per_expert <= 1.5 * h:
            block = h
            break
    return {"BLOCK_M": block, "version": version or DEFAULT_VERSION}


def grouped_gemm(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_size,
                 topk_weights=None, mul_routed_weight=False, bias=None, *, version=None):
    """vLLM's fused MoE GEMM: c[s] = (a[s // top_k] @ w[e].T + bias[e]) * (topk_weights.flat[s]
    if mul_routed_weight), e the expert of s's block, zeros for e == -1 (module docstring).

    a [M_a, Kd], w [E, N, Kd] (same dtype), sorted_token_ids / expert_ids /
    num_tokens_post_padded from moe_align_block_size -> c [M_a * top_k, N] in a.dtype.
    version: "v1" | "v2" | "v3" | "v3v" | None (DEFAULT_VERSION, or the next that fits).
    """
    A.check_float("a", a, ndim=2)
    A.check_float("w", w, ndim=3)
    if A.dtype_of(w) != A.dtype_of(a):
        raise TypeError(f"w: expected the dtype of a ({A.dtype_of(a)}), got {A.dtype_of(w)}")
    if version is not None:
        A.check_choice("version", version, VERSIONS)
    M_a, Kd = A.shape_of(a)
    E, N, Kw = A.shape_of(w)
    if Kw != Kd:
        raise ValueError(f"w: expected shape (E, N, {Kd}) to match a's columns, got {(E, N, Kw)}")
    A.check_int_array("sorted_token_ids", sorted_token_ids, ndim=1)
    A.check_int_array("expert_ids", expert_ids, ndim=1)
    A.check_int_array("num_tokens_post_padded", num_tokens_post_padded, shape=(1,))
    top_k = A.check_int("top_k", top_k, minimum=1)
    B = A.check_int("block_size", block_size, minimum=1)
    capacity = A.size_of(sorted_token_ids)
    n_blocks = A.size_of(expert_ids)
    if isinstance(num_tokens_post_padded, np.ndarray):   # a device value is read on the device
        num_padded = int(num_tokens_post_padded.ravel()[0])
        if num_padded % B or num_padded > capacity or num_padded // B > n_blocks:
            raise ValueError(f"num_tokens_post_padded: expected a multiple of block_size ({B}) "
                             f"within sorted_token_ids ({capacity}) and expert_ids "
                             f"({n_blocks} blocks), got {num_padded}")
        if isinstance(expert_ids, np.ndarray):
            used = expert_ids[:num_padded // B]
            if used.size and (used.min() < -1 or used.max() >= E):
                raise ValueError(f"expert_ids: expected local ids in [-1, {E}), got "
                                 f"{int(used.min())}..{int(used.max())}")
    if capacity > n_blocks * B:
        raise ValueError(f"expert_ids: expected at least cdiv({capacity}, {B}) blocks to cover "
                         f"sorted_token_ids, got {n_blocks}")
    P = M_a * top_k
    if bias is not None:
        A.check_float("bias", bias, ndim=2, shape=(E, N), with_f64=True)
    if mul_routed_weight:
        if topk_weights is None:
            raise ValueError("topk_weights: expected an array when mul_routed_weight=True, "
                             "got None")
        A.check_float("topk_weights", topk_weights, with_f64=True)
        if A.size_of(topk_weights) != P:
            raise ValueError(f"topk_weights: expected {P} weights (a rows * top_k), "
                             f"got shape {A.shape_of(topk_weights)}")
    call = A.Call("a", a)
    c = call.empty((P, N), A.dtype_of(a))                                   # [P, N]
    if P and N and capacity:
        ad = call.dev("a", a)
        wd = call.dev("w", w)
        v = version or DEFAULT_VERSION
        word = _word_kind(ad, wd, Kd) if v in ("v3", "v3v") else ""
        vec = _vec_kind(ad, wd, Kd) if v == "v3v" else ""
        fill = min(P / max(E, 1), B)   # slots per expert: live rows of an expert's tiles
        which, kernel, block, bm, bn, word = plan(version, B, word, vec, fill)
        if which == "v3v":   # 16-byte loads: flat uint32 views of the same bytes
            ad = ad.reshape(ad.size).view(np.uint32)
            wd = wd.reshape(wd.size).view(np.uint32)
        elif word:   # 8-byte loads: the same bytes as uint64 words, VEC elements each
            ad, wd = ad.view(np.uint64), wd.view(np.uint64)
        sd = call.dev("sorted_token_ids", sorted_token_ids)
        ed = call.dev("expert_ids", expert_ids)
        npd = call.dev("num_tokens_post_padded", num_tokens_post_padded)
        tw = (call.dev("topk_weights", topk_weights).reshape(P) if mul_routed_weight
              else A.dummy(np.float32))
        bd = call.dev("bias", bias) if bias is not None else A.dummy(np.float32, 2)
        rows = capacity
        if which == "v3v" and BOUND_GRID:
            # a valid alignment pads each expert that has slots to a multiple of B and gives
            # the others no blocks, so num_tokens_post_padded <= P + P (B - 1) = P B; at decode
            # that is far below capacity = P + E (B - 1): no blocks that would only return
            rows = min(capacity, P * B)
        grid = (A.cdiv(rows, bm), A.cdiv(N, bn))
        kernel[grid, block, A.launch_stream()](ad, wd, sd, ed, npd, tw, bd, c, P, top_k, N, Kd, B,
                            1 if mul_routed_weight else 0, 1 if bias is not None else 0)
    return call.result(c)


# ----------------------------------------------------------------------------- compile checks
def compile_cases():
    """(label, kernel, argument types) of every launch above, for the PTX checks (_ptx.py):
    each version for the tile heights that block sizes 16, 32 and 64 select."""
    from numba import types as t

    def arr(dt, nd):
        return t.Array(dt, nd, "C")

    cases, seen = [], set()
    for dt, word in ((t.float32, "f32"), (t.float16, "f16"), (t.uint16, "bf16")):
        for version in VERSIONS:
            for B in (16, 32, 64):
                for wk, fill in (((word, 1e9), ("", 1e9)) if version == "v3" else
                                 ((word, 1e9), (word, 0)) if version == "v3v" else (("", 1e9),)):
                    pl = plan(version, B, wk, wk if version == "v3v" else "", fill)
                    if (id(pl.kernel), dt) in seen:
                        continue
                    seen.add((id(pl.kernel), dt))
                    if pl.version == "v3v":         # 16-byte loads: flat uint32 views
                        ins = (arr(t.uint32, 1), arr(t.uint32, 1))
                    else:                           # word loads: a and w as uint64 views
                        io = t.uint64 if wk else dt
                        ins = (arr(io, 2), arr(io, 3))
                    sig = (ins + (arr(t.int32, 1), arr(t.int32, 1),
                            arr(t.int32, 1), arr(t.float32, 1), arr(t.float32, 2), arr(dt, 2))
                           + (t.int64,) * 7)
                    label = f"grouped_gemm {pl.version} BM={pl.bm} {dt}" + (
                        f" words={wk}" if wk else "") + (" sparse" if not fill else "")
                    cases.append((label, pl.kernel, sig))
    return cases


# ----------------------------------------------------------------------------- as a script
def _main():
    import reference

    from . import _script as S

    def lines(rng):
        # (T, E, K, N, Kd, B)
        cases = ([(5, 4, 2, 12, 10, 8), (5, 4, 2, 12, 16, 8)] if SIMULATOR
                 else [(1, 8, 2, 28672, 4096, 16), (256, 128, 8, 1536, 2048, 64),
                       (4096, 128, 8, 1536, 2048, 64), (1024, 256, 8, 4096, 7168, 64)])
        for T, E, K, N, Kd, B in cases:
            x = (rng.standard_normal((T, Kd)) * 0.5).astype(np.float16)             # [T, Kd]
            w = (rng.standard_normal((E, N, Kd)) / np.sqrt(Kd)).astype(np.float16)  # [E, N, Kd]
            ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
            align = reference.moe_align_block_size(ids, B, E)
            ref = reference.grouped_gemm(x, w, *align, K, B)
            flops = 2 * int(align[2][0]) * N * Kd
            for version in VERSIONS:
                if not SIMULATOR and version == "v1" and flops > 2e11:
                    continue   # the naive rung would take seconds
                err = S.rel_err(grouped_gemm(x, w, *align, K, B, version=version), ref)
                yield (f"  {version} T={T:5d} E={E:3d} K={K} N={N:5d} Kd={Kd:5d} B={B:3d} fp16: "
                       f"rel err {err:.1e}"
                       + S.timed(lambda *d: grouped_gemm(*d, K, B, version=version), x, w, *align,
                                 reps=5, flops=flops), err <= 1e-2)

    return S.main("grouped_gemm", lines)


if __name__ == "__main__":
    sys.exit(_main())
