"""Alignment in Numba: the (token, slot) pairs grouped by expert in blocks of B.

    T = tokens, K = top-k, P = T*K slots (s = t*K + k), E = experts, B = block size

    moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                         pad_sorted_ids=False, ignore_invalid_experts=False)
        -> sorted_token_ids int32 [max_num_tokens_padded], expert_ids int32 [cdiv(that, B)],
           num_tokens_post_padded int32 [1]

The math (reference/align.py): count the slots of each expert (c_e), pad each count to a
multiple of B, exclusive prefix sum -> off_e (where expert e's run starts), then slot s of
expert e goes to off_e + (its rank among e's slots). Ranks are *stable* (increasing s), so
these kernels return exactly the reference's arrays, not just the same per-block sets.
expert_ids[b] = the expert whose run holds position b*B (binary search in off), -1 past the
end; padding positions hold P. With B = 1 and no padding the same kernels give moe_permute's
expert_offsets and inverse index (permute.py calls _sort_slots).

Kernels (NT = THREADS, CH = SLOTS_PER_BLOCK, nb = cdiv(P, CH); dynamic shared memory in int32
words):

    kernel          grid  block  shared        does
    align_single    1     NT     3E + 1 + 2NT  everything, when P <= SINGLE_BLOCK_MAX_SLOTS
                                   (+ 2 W E)
    align_count     nb    NT     E             per-block histogram -> block_counts [nb, E];
                                               sorted_token_ids filled with P (coalesced)
    align_scan      1     NT     2E + 1 + NT   per-expert block prefix, padded prefix sum,
                                               expert_ids, num_tokens_post_padded
    align_scatter   nb    NT     E + NT        stable rank -> sorted_token_ids / inv index
                                   (+ 2 W E)   (W = NT / 32 warps, "warp" ranks)
    align_grid      G     32 W   W E + 3E + 33 "grid" ranks (GPU default, align_grid.py): the
                                               whole alignment in one launch, align.cu's
                                               moe_align_kernel (one block up to SMALL_P
                                               slots, else G blocks behind a grid barrier)

Every position of sorted_token_ids is first written P by a coalesced fill; the scatter then
overwrites the positions of slots (the first version padded each expert's run in a loop of
up to B - 1 strided stores per thread, a likely part of its 2x gap to CuPy on the H200).
Histograms use shared-memory atomics (with "warp" ranks, one per distinct expert per warp
step, after a match_any); the prefix sum is a per-thread chunk sum plus a Hillis-Steele
scan over NT partial sums; the stable rank processes NT slots per round: a
slot's rank is the number of earlier slots of its expert in the round plus the expert's
running count, which the block's atomics advance after each round. Three ways to count the
earlier slots of the round (config "RANK"):
    "warp"   (GPU) match_any_sync gives the same-expert lanes of the warp (popc of those
             below), plus the counts the earlier warps of the round published in a shared
             [W, E] table (tagged with the round, so it is never cleared); 2 W E more words
    "block"  (simulator, or E too large for the table) an O(NT) scan of the round's experts
             in shared memory: no warp intrinsics
    "grid"   (GPU default) align_grid.py's one launch: contiguous chunks per warp counted
             into per-warp rows, a scan over the warps (and over blocks, after a grid
             barrier), then each warp places its chunk in order (match_any ranks, the group's
             lowest lane advancing the warp's cursor); padding written only where no slot
             goes. It replaced "chunks" (the same grouping in one block, or three launches
             above 2048 slots: over 1.3x CuPy's time at 9 of bench_numba's 18 points on the
             H200, up to 1.94x; the grid kernel: within 1.3x at all 18, slot 1b of 2026-11-30)
With "warp" and "block" ranks, the scan kernel turns block_counts into each block's starting
offset within each expert.

dtypes: topk_ids any integer dtype. Ids outside [0, E) are skipped (no out-of-bounds write:
their slots appear nowhere).

Run as a script to validate against reference/ and time: python -m cuda_kernels.numba.align
"""
from __future__ import annotations

import functools
import sys

import numpy as np
from numba import int32, uint32

from . import _arrays as A
from . import align_grid
from ._device import FULL_MASK, SIMULATOR, cu, device_function, ix, kernel

# Tunables are data. The simulator gets tiny blocks so that tests cover every path cheaply.
CONFIGS = {
    "align": {"THREADS": 256, "SLOTS_PER_BLOCK": 1024, "SINGLE_BLOCK_MAX_SLOTS": 2048,
              "RANK": "grid"},   # grid: align_grid.CONFIGS; the rest: the "warp" / "block" ranks
}
SIM_CONFIGS = {
    "align": {"THREADS": 16, "SLOTS_PER_BLOCK": 32, "SINGLE_BLOCK_MAX_SLOTS": 32,
              "RANK": "block"},
}
SHARED_LIMIT = 48 * 1024


def config(name):
    return (SIM_CONFIGS if SIMULATOR else CONFIGS)[name]


def max_num_tokens_padded(num_slots: int, block_size: int, num_experts: int,
                          pad_sorted_ids: bool = False) -> int:
    """The length of sorted_token_ids: every expert padded in the worst case, never more than
    one block per slot (the reference's formula)."""
    size = num_slots + num_experts * (block_size - 1)
    if pad_sorted_ids:
        size = A.cdiv(size, block_size) * block_size
    if num_slots < num_experts:
        size = min(size, num_slots * block_size)
    return size


# ----------------------------------------------------------------------------- device parts
@functools.lru_cache(maxsize=None)
def _parts(NT):
    """The building blocks shared by the align kernels, for NT threads per block."""

    @device_function
    def expert_of(ids, s, E, emap, use_map, ignore_invalid):
        """The expert of slot s, or -1 when it is out of range or ignored (not on this rank)."""
        e = ids[s]
        if e < 0 or e >= E:
            return -1
        if use_map and ignore_invalid and emap[e] < 0:
            return -1
        return e

    @device_function
    def histogram(ids, lo, hi, E, emap, use_map, ignore_invalid, cnt, tid):
        """cnt[e] += number of slots of expert e in [lo, hi) (cnt zeroed by the caller)."""
        for s in range(lo + tid, hi, NT):
            e = expert_of(ids, s, E, emap, use_map, ignore_invalid)
            if e >= 0:
                cu.atomic.add(cnt, e, 1)

    @device_function
    def histogram_warp(ids, lo, hi, E, emap, use_map, ignore_invalid, cnt, tid):
        """`histogram` with one atomic per distinct expert per warp step (GPU only): the
        lowest lane of each match_any group adds the group's size (few experts, e.g. E = 8,
        would otherwise serialize 32 atomics on one counter)."""
        for s0 in range(lo, hi, NT):   # the same trip count for every lane: full-warp match
            s = s0 + tid
            e = -1
            if s < hi:
                e = expert_of(ids, s, E, emap, use_map, ignore_invalid)
            peers = uint32(cu.match_any_sync(FULL_MASK, e))
            if e >= 0 and (peers & cu.lanemask_lt()) == 0:
                cu.atomic.add(cnt, e, cu.popc(peers))

    @device_function
    def fill(sorted_ids, P, start, capacity, step):
        """sorted_ids[start::step] = P: every position starts as padding (coalesced); the
        scatter then overwrites the positions that hold slots."""
        for p in range(start, capacity, step):
            sorted_ids[ix(p)] = P

    @device_function
    def scan_padded(cnt, off, E, B, red, tid):
        """off[e] = sum_{e' < e} ceil(cnt[e'] / B) * B for e <= E (off[E] = total)."""
        chunk = (E + NT - 1) // NT
        lo = tid * chunk
        hi = min(lo + chunk, E)
        local = 0
        for e in range(lo, hi):
            local += (cnt[e] + B - 1) // B * B
        red[tid] = local
        cu.syncthreads()
        d = 1
        while d < NT:   # Hillis-Steele inclusive scan of the NT chunk sums
            v = red[tid - d] if tid >= d else 0
            cu.syncthreads()
            red[tid] += v
            cu.syncthreads()
            d *= 2
        run = red[tid] - local   # exclusive prefix of this thread's chunk
        for e in range(lo, hi):
            off[e] = run
            run += (cnt[e] + B - 1) // B * B
        if tid == NT - 1:
            off[E] = red[NT - 1]
        cu.syncthreads()

    @device_function
    def write_blocks(off, E, B, emap, use_map, expert_ids, n_blocks, tid):
        """expert_ids of every block: a binary search of its first position in off."""
        total = off[E]
        for b in range(tid, n_blocks, NT):
            pos = b * B
            if pos < total:
                lo = 0
                hi = E   # invariant: off[lo] <= pos < off[hi]; empty experts have no width
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if off[mid] <= pos:
                        lo = mid
                    else:
                        hi = mid
                expert_ids[b] = emap[lo] if use_map else lo
            else:
                expert_ids[b] = -1

    @device_function
    def publish(cnt, off, E, B, red, tid, num_post, offsets, do_align, emap, use_map, expert_ids,
                n_blocks):
        """From the counts: the padded prefix sum off [E + 1], num_post = its total, offsets
        [E + 1] = off, and (do_align) the expert of every block."""
        scan_padded(cnt, off, E, B, red, tid)
        if tid == 0:
            num_post[0] = off[E]
        for e in range(tid, E + 1, NT):
            offsets[e] = off[e]
        if do_align:
            write_blocks(off, E, B, emap, use_map, expert_ids, n_blocks, tid)

    @device_function
    def scatter(ids, lo, hi, E, emap, use_map, ignore_invalid, off, run, rid, sorted_ids,
                inv, write_sorted, write_inv, tid):
        """Stable placement of slots [lo, hi): pos = off[e] + run[e] + rank in the round.

        run[e] starts as this block's offset within expert e and advances by the round's
        count of e after each round; every thread runs the same number of rounds.
        """
        for r0 in range(lo, hi, NT):
            s = r0 + tid
            e = -1
            if s < hi:
                e = expert_of(ids, s, E, emap, use_map, ignore_invalid)
            rid[tid] = e
            cu.syncthreads()
            if e >= 0:
                r = 0
                for j in range(tid):   # earlier slots of the same expert in this round
                    if rid[j] == e:
                        r += 1
                pos = off[e] + run[e] + r
                if write_sorted:
                    sorted_ids[pos] = s
                if write_inv:
                    inv[s] = pos
            cu.syncthreads()           # every rank read run[e] before it moves
            if e >= 0:
                cu.atomic.add(run, e, 1)
            cu.syncthreads()

    @device_function
    def scatter_warp(ids, lo, hi, E, emap, use_map, ignore_invalid, off, run, cntw, tagw,
                     sorted_ids, inv, write_sorted, write_inv, tid):
        """`scatter` with warp-level ranks (GPU only: match_any_sync has no simulator twin).

        A slot's rank in the round = its rank among the same-expert lanes of its warp
        (popc of the match_any peers below it) + the counts of that expert in the earlier
        warps of the round. The lowest lane of each peer group publishes its warp's count in
        cntw[w, e], tagged with the round number in tagw[w, e] (tagw starts at -1), so
        entries left from earlier rounds read as zero without clearing W x E words per round.
        """
        w = tid >> 5                             # this thread's warp
        rnd = 0
        for r0 in range(lo, hi, NT):
            s = r0 + tid
            e = -1
            if s < hi:
                e = expert_of(ids, s, E, emap, use_map, ignore_invalid)
            peers = uint32(cu.match_any_sync(FULL_MASK, e))
            below = peers & cu.lanemask_lt()
            if e >= 0 and below == 0:            # the group's lowest lane speaks for it
                cntw[ix(w * E + e)] = cu.popc(peers)
                tagw[ix(w * E + e)] = rnd
            cu.syncthreads()
            if e >= 0:
                r = cu.popc(below)
                for v in range(w):               # the same expert in earlier warps
                    if tagw[ix(v * E + e)] == rnd:
                        r += cntw[ix(v * E + e)]
                pos = off[ix(e)] + run[ix(e)] + r
                if write_sorted:
                    sorted_ids[ix(pos)] = s
                if write_inv:
                    inv[ix(s)] = pos
            cu.syncthreads()                     # every rank read run[e] before it moves
            if e >= 0 and below == 0:
                cu.atomic.add(run, e, cu.popc(peers))
            cu.syncthreads()
            rnd += 1

    return (expert_of, histogram, histogram_warp, fill, scan_padded, write_blocks, publish,
            scatter, scatter_warp)


# ----------------------------------------------------------------------------- kernels
@functools.lru_cache(maxsize=None)
def align_kernels(NT, rank="block"):
    """(align_single, align_count, align_scan, align_scatter) for NT threads per block.

    rank: "block" ranks a round's slots by an O(NT) scan of shared memory (any target, the
    simulator included); "warp" by match_any_sync within warps (GPU only, about 8x fewer
    shared-memory reads) and needs 2 W E more int32 words of shared memory (W = NT / 32).
    """
    if rank not in ("block", "warp"):
        raise ValueError(f"rank: expected 'block' or 'warp', got {rank!r}")
    if rank == "warp" and (SIMULATOR or NT % 32):
        raise ValueError("rank: 'warp' needs the GPU and whole warps")
    WARP = rank == "warp"
    W = NT // 32
    (_, histogram, histogram_warp, fill, _, _, publish, scatter, scatter_warp) = _parts(NT)

    def align_single(ids, P, E, B, emap, use_map, ignore_invalid, sorted_ids, expert_ids,
                     n_blocks, capacity, num_post, offsets, inv, do_align, write_inv):
        """One block does it all: padding fill, histogram, padded prefix sum, expert_ids,
        stable scatter.
        Shared (int32): cnt [E], off [E+1], run [E], red [NT], rid [NT] (+ cntw, tagw
        [W E] each for warp ranks)."""
        tid = cu.threadIdx.x
        sh = cu.shared.array(0, int32)
        cnt = sh[0:E]
        off = sh[E:2 * E + 1]
        run = sh[2 * E + 1:3 * E + 1]
        red = sh[3 * E + 1:3 * E + 1 + NT]
        rid = sh[3 * E + 1 + NT:3 * E + 1 + 2 * NT]
        for e in range(tid, E, NT):
            cnt[e] = 0
            run[e] = 0
        if WARP:
            base = 3 * E + 1 + 2 * NT
            cntw = sh[base:base + W * E]
            tagw = sh[base + W * E:base + 2 * W * E]
            for i in range(tid, W * E, NT):
                tagw[i] = -1
        if do_align:
            fill(sorted_ids, P, tid, capacity, NT)
        cu.syncthreads()
        if WARP:
            histogram_warp(ids, 0, P, E, emap, use_map, ignore_invalid, cnt, tid)
        else:
            histogram(ids, 0, P, E, emap, use_map, ignore_invalid, cnt, tid)
        cu.syncthreads()
        publish(cnt, off, E, B, red, tid, num_post, offsets, do_align, emap, use_map, expert_ids,
                n_blocks)
        if WARP:
            scatter_warp(ids, 0, P, E, emap, use_map, ignore_invalid, off, run, cntw, tagw,
                         sorted_ids, inv, do_align, write_inv, tid)
        else:
            scatter(ids, 0, P, E, emap, use_map, ignore_invalid, off, run, rid, sorted_ids,
                    inv, do_align, write_inv, tid)

    def align_count(ids, P, E, emap, use_map, ignore_invalid, block_counts, CH, sorted_ids,
                    capacity, do_align):
        """block_counts[b, e] = slots of expert e in block b's chunk [b*CH, (b+1)*CH); the
        blocks also fill sorted_ids with the padding value P (the scatter kernel, launched
        after, overwrites the positions of slots)."""
        tid = cu.threadIdx.x
        b = cu.blockIdx.x
        cnt = cu.shared.array(0, int32)[0:E]
        for e in range(tid, E, NT):
            cnt[e] = 0
        if do_align:
            fill(sorted_ids, P, b * NT + tid, capacity, cu.gridDim.x * NT)
        cu.syncthreads()
        lo = b * CH
        hi = min(P, (b + 1) * CH)
        if WARP:
            histogram_warp(ids, lo, hi, E, emap, use_map, ignore_invalid, cnt, tid)
        else:
            histogram(ids, lo, hi, E, emap, use_map, ignore_invalid, cnt, tid)
        cu.syncthreads()
        for e in range(tid, E, NT):
            block_counts[b, e] = cnt[e]

    def align_scan(block_counts, nb, E, B, P, emap, use_map, sorted_ids, expert_ids, n_blocks,
                   capacity, num_post, offsets, do_align):
        """One block: block_counts -> each block's offset within each expert (in place),
        the padded prefix sum into offsets [E+1], expert_ids, num_post."""
        tid = cu.threadIdx.x
        sh = cu.shared.array(0, int32)
        cnt = sh[0:E]
        off = sh[E:2 * E + 1]
        red = sh[2 * E + 1:2 * E + 1 + NT]
        cb = cu.local.array(8, int32)
        for e in range(tid, E, NT):   # one expert per thread, coalesced across e
            total = 0
            for b0 in range(0, nb, 8):
                # eight loads before any store: a load cannot pass the previous iteration's
                # store to the same array, so one at a time would wait out a round trip each
                for u in range(8):
                    cb[u] = block_counts[ix(b0 + u), ix(e)] if b0 + u < nb else 0
                for u in range(8):
                    if b0 + u < nb:
                        block_counts[ix(b0 + u), ix(e)] = total
                        total += cb[u]
            cnt[e] = total
        cu.syncthreads()
        publish(cnt, off, E, B, red, tid, num_post, offsets, do_align, emap, use_map, expert_ids,
                n_blocks)

    def align_scatter(ids, P, E, emap, use_map, ignore_invalid, block_counts, offsets,
                      sorted_ids, inv, do_align, write_inv, CH):
        """Stable placement of block b's chunk, starting at its offsets within each expert.
        Shared (int32): run [E], rid [NT] (+ cntw, tagw [W E] each for warp ranks)."""
        tid = cu.threadIdx.x
        b = cu.blockIdx.x
        sh = cu.shared.array(0, int32)
        run = sh[0:E]
        rid = sh[E:E + NT]
        for e in range(tid, E, NT):
            run[e] = block_counts[b, e]
        if WARP:
            cntw = sh[E + NT:E + NT + W * E]
            tagw = sh[E + NT + W * E:E + NT + 2 * W * E]
            for i in range(tid, W * E, NT):
                tagw[i] = -1
        cu.syncthreads()
        lo = b * CH
        hi = min(P, (b + 1) * CH)
        if WARP:
            scatter_warp(ids, lo, hi, E, emap, use_map, ignore_invalid, offsets, run, cntw,
                         tagw, sorted_ids, inv, do_align, write_inv, tid)
        else:
            scatter(ids, lo, hi, E, emap, use_map, ignore_invalid, offsets, run, rid,
                    sorted_ids, inv, do_align, write_inv, tid)

    return (kernel(align_single), kernel(align_count), kernel(align_scan),
            kernel(align_scatter))


def _rank_words(rank, NT, E):
    """The extra shared int32 words of the warp ranks (cntw and tagw)."""
    return 2 * (NT // 32) * E if rank == "warp" else 0


# ----------------------------------------------------------------------------- launchers
def _sort_slots(call, topk_ids, E, B, expert_map, ignore_invalid, capacity, do_align,
                write_inv, path=None, rank=None):
    """Run the align kernels. Returns (sorted_ids, expert_ids, num_post, offsets, inv) as
    numba arrays (sorted_ids / expert_ids only when do_align, inv only when write_inv).
    rank ("grid" | "warp" | "block") and, for the warp / block ranks, path ("single" |
    "multi") override the config (tests)."""
    cfg = config("align")
    NT = cfg["THREADS"]
    T, K = A.shape_of(topk_ids)
    P = T * K
    n_blocks = A.cdiv(capacity, B)
    ids = call.dev("topk_ids", topk_ids).reshape(P)                       # [P]
    use_map = expert_map is not None
    emap = call.dev("expert_map", expert_map) if use_map else A.dummy(np.int32)
    sorted_ids = call.empty((capacity,), np.int32) if do_align else A.dummy(np.int32)
    expert_ids = call.empty((n_blocks,), np.int32) if do_align else A.dummy(np.int32)
    num_post = call.empty((1,), np.int32)
    offsets = call.empty((E + 1,), np.int32)
    inv = call.empty((P,), np.int32) if write_inv else A.dummy(np.int32)
    if rank is None:
        rank = cfg["RANK"]
    flags = (1 if use_map else 0, 1 if ignore_invalid else 0)
    if rank == "grid" and not SIMULATOR and align_grid.fits(E):
        align_grid.launch(call, ids, P, E, B, emap, *flags, sorted_ids, expert_ids, n_blocks,
                          capacity, num_post, offsets, inv, int(do_align), int(write_inv))
        return sorted_ids, expert_ids, num_post, offsets, inv
    if rank == "grid":   # the simulator, or E too large for one warp's row of counters
        rank = "block" if SIMULATOR else "warp"
    if rank == "warp" and (3 * E + 1 + 2 * NT + _rank_words(rank, NT, E)) * 4 > SHARED_LIMIT:
        rank = "block"   # very many experts: the warp ranks' tables do not fit
    single, count, scan, scatter = align_kernels(NT, rank)
    extra = _rank_words(rank, NT, E)
    if path is None:
        path = "single" if P <= cfg["SINGLE_BLOCK_MAX_SLOTS"] else "multi"
    if path == "single":
        smem = (3 * E + 1 + 2 * NT + extra) * 4
        single[1, NT, A.launch_stream(), smem](
            ids, P, E, B, emap, *flags, sorted_ids, expert_ids, n_blocks, capacity, num_post,
            offsets, inv, int(do_align), int(write_inv))
    else:
        CH = cfg["SLOTS_PER_BLOCK"]
        nb = A.cdiv(P, CH)
        block_counts = call.empty((nb, E), np.int32)                      # [nb, E] scratch
        stream = A.launch_stream()
        count[nb, NT, stream, E * 4](ids, P, E, emap, *flags, block_counts, CH, sorted_ids,
                                     capacity, int(do_align))
        scan[1, NT, stream, (2 * E + 1 + NT) * 4](block_counts, nb, E, B, P, emap, flags[0],
                                                  sorted_ids, expert_ids, n_blocks, capacity,
                                                  num_post, offsets, int(do_align))
        scatter[nb, NT, stream, (E + NT + extra) * 4](ids, P, E, emap, *flags, block_counts,
                                                      offsets, sorted_ids, inv, int(do_align),
                                                      int(write_inv), CH)
    return sorted_ids, expert_ids, num_post, offsets, inv


def _check_expert_map(expert_map, E):
    if expert_map is None:
        return None
    A.check_int_array("expert_map", expert_map, ndim=1, shape=(E,))
    if isinstance(expert_map, np.ndarray) and expert_map.size and expert_map.min() < -1:
        raise ValueError(f"expert_map: expected local ids >= 0 or -1, got {int(expert_map.min())}")
    return expert_map


def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                         pad_sorted_ids=False, ignore_invalid_experts=False):
    """Sort the P slots by expert and pad each expert's run to a multiple of block_size.

    topk_ids [T, K] -> sorted_token_ids int32 [max_num_tokens_padded] (slots of expert 0,
    then 1, ..., each run padded with P to a multiple of B; stable: increasing s within an
    expert), expert_ids int32 [cdiv(max_num_tokens_padded, B)] (local ids through expert_map,
    -1 past the end or for experts off this rank), num_tokens_post_padded int32 [1].
    A slot whose id is outside [0, E) (vLLM's -1) is skipped: placed and counted nowhere.
    With expert_map and ignore_invalid_experts=True, experts off this rank get no blocks.
    Kernels: align_grid (align_grid.py, one launch) on the GPU; align_single, or align_count +
    align_scan + align_scatter with the simulator's "block" ranks (module docstring).
    """
    A.check_int_array("topk_ids", topk_ids, ndim=2)
    B = A.check_int("block_size", block_size, minimum=1)
    E = A.check_int("num_experts", num_experts, minimum=1)
    _check_expert_map(expert_map, E)
    T, K = A.shape_of(topk_ids)
    capacity = max_num_tokens_padded(T * K, B, E, pad_sorted_ids)
    call = A.Call("topk_ids", topk_ids)
    sorted_ids, expert_ids, num_post, _, _ = _sort_slots(
        call, topk_ids, E, B, expert_map, bool(ignore_invalid_experts and expert_map is not None),
        capacity, True, False)
    return call.result(sorted_ids), call.result(expert_ids), call.result(num_post)


# ----------------------------------------------------------------------------- compile checks
def compile_cases():
    """(label, kernel, argument types) of every launch above, for the PTX checks (_ptx.py)."""
    from numba import types as t

    def arr(dt, nd):
        return t.Array(dt, nd, "C")

    i32, i64 = t.int32, t.int64
    v = arr(i32, 1)
    cases = []
    for rank in ("warp", "block"):
        single, count, scan, scatter = align_kernels(CONFIGS["align"]["THREADS"], rank)
        for ids in (i32, i64):
            a = arr(ids, 1)
            cases += [
                (f"align_single rank={rank} ids={ids}", single,
                 (a, i64, i64, i64, v, i64, i64, v, v, i64, i64, v, v, v, i64, i64)),
                (f"align_scatter rank={rank} ids={ids}", scatter,
                 (a, i64, i64, v, i64, i64, arr(i32, 2), v, v, v, i64, i64, i64)),
            ]
            cases.append((f"align_count rank={rank} ids={ids}", count,
                          (a, i64, i64, v, i64, i64, arr(i32, 2), i64, v, i64, i64)))
        if rank == "warp":
            cases.append(("align_scan", scan,
                          (arr(i32, 2), i64, i64, i64, i64, v, i64, v, v, i64, i64, v, v, i64)))
    grid = align_grid.grid_kernel()
    for ids in (i32, i64):
        cases.append((f"align_grid ids={ids}", grid,
                      (arr(ids, 1), i64, i64, i64, v, i64, i64, v, arr(t.uint32, 1), v, v, i64,
                       i64, v, v, v, i64, i64, i64)))
    return cases


# ----------------------------------------------------------------------------- as a script
def _main():
    import reference

    from . import _script as S

    def lines(rng):
        cases = ([(3, 8, 2, 4), (9, 4, 3, 8)] if SIMULATOR
                 else [(1, 8, 2, 64), (256, 128, 8, 64), (4096, 256, 8, 64), (2256, 257, 16, 128)])
        for T, E, K, B in cases:
            ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)  # [T, K]
            mine = moe_align_block_size(ids, B, E)
            ref = reference.moe_align_block_size(ids, B, E)
            same = all(np.array_equal(a, b) for a, b in zip(mine, ref))
            yield (f"  moe_align_block_size T={T:5d} E={E:4d} K={K:2d} B={B:3d}: "
                   f"{'exact' if same else 'DIFFER'}"
                   + S.timed(lambda d: moe_align_block_size(d, B, E), ids), same)

    return S.main("align", lines)


if __name__ == "__main__":
    sys.exit(_main())
