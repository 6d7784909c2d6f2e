"""One-launch alignment in Numba: align.cu's moe_align_kernel, written in numba.cuda.

    T = tokens, K = top-k, P = T*K slots (s = t*K + k), E = experts, B = block size,
    W = warps per block, G = blocks, NT = 32 W threads

The math (reference/align.py): c_e = the slots of expert e; off_e = sum_{e' < e}
ceil(c_e' / B) B; slot s of expert e goes to off_e + (its rank among e's slots, increasing s);
every other position of expert e's run and of the array's tail holds P; expert_ids[b] = the
expert (through expert_map) whose run holds position b B, -1 past the last run;
num_tokens_post_padded = off_E. With B = 1 and no padding the same kernel gives moe_permute's
expert_offsets (off, E + 1 entries) and inverse index inv[s] = the position of slot s.

How it is stable without a sort (grouping.cuh): the slots are cut into G W
contiguous chunks of whole 32-slot steps, chunk g W + w owned by warp w of block g, so
(block, warp, step, lane) is slot order.
    1. each warp counts its chunk into its own shared row wc[w, :] (one shared atomic per
       slot); its ids stay in registers when the chunk is one round (PREFETCH steps of 32
       slots, their loads all in flight at once);
    2. a scan over the warps turns wc into each warp's first rank inside the block and gives
       the block's count per expert: the total (G = 1) or hist[g, :] (G > 1);
    3. G > 1: grid barrier; every block reads hist [G, E]: pre[e] = the counts of the
       earlier blocks, tot[e] = the sum over all blocks;
    4. off = the exclusive scan of the padded totals (every block, redundantly: cheaper than a
       second launch), and pre[e] += off[e]: the block's first position in expert e's run;
    5. expert_ids, each run's padding, the tail and num_tokens_post_padded, spread over every
       warp of the grid, a contiguous range of experts per warp (positions no slot takes: no
       ordering needed);
    6. each warp places its chunk again in order: match_any_sync groups the lanes of one
       expert, the group's lowest lane reads and advances the warp's cursor, a lane's rank is
       the popcount of the group's lanes below it.
Numba-specific care (each measured or read off the SASS): the id loads take a clamped index
and no branch (a load under an `if` on the previous id waits for it: one DRAM round trip per
step); strided loops are while loops and divisions 32-bit unsigned (a `range` with a run-time
step divides in 64 bits for its trip count, numba's integer arithmetic is 64-bit, and a 64-bit
division is a ~100-instruction call); the kernel is bounded to 1024 threads (<= 64 registers).

Launch geometry (align_geometry): block NT = 32 W threads, W = min(MAX_WARPS, what the
[W, E] rows leave of SMEM_BUDGET); G = 1 up to SMALL_P slots (then W = the 32-slot steps, at
least min(MIN_WARPS, max(4, cdiv(E, 8))): idle warps cost little in steps 1 and 6, and take
their share of steps 2 and 5), else G = min(SMs, cdiv(P, W WARP_SLOTS), TABLE_LOADS W 32 / E)
blocks, all resident at once (a cooperative launch). Dynamic shared memory (W E + 3 E + 33)
int32: wc [W, E], tot [E], pre [E], off [E + 1], scan scratch [32]. Global scratch (G > 1):
hist [G, E] and the barrier word.

The grid barrier (G > 1) is align.cu's: one uint32 word per device that outlives the launch,
zeroed once; block 0 adds 2^31 - (G - 1), the others 1, so the top bit flips when the G-th
block arrives and the low 31 bits are 0 again for the next launch. numba's own grid sync
(cuda.cg.this_grid().sync()) needs cudadevrt linked at compile time; this needs nothing.

GPU only: match_any_sync and shuffles have no simulator twin, so the simulator runs
align.py's "block" ranks; tests/numba/sim runs this kernel (one block) in emulated warps.
Config "RANK" of align.py picks it ("grid", the GPU default) or the multi-launch "warp" /
"block" ranks. Run: python -m cuda_kernels.numba.align (validates and times).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import int32, uint32

from . import _arrays as A
from ._device import FULL_MASK, SIMULATOR, cu, device_function, ix, kernel

if not SIMULATOR:
    from llvmlite import ir
    from numba.cuda import types as nbtypes
    from numba.cuda.extending import intrinsic, overload

CONFIGS = {
    # shared memory for the per-warp rows [W, E] (48 KB needs no opt-in). One block up to
    # SMALL_P slots: a warp per ONE_SLOTS slots, at least min(MIN_WARPS, E / 8), at most
    # MAX_WARPS. Above, a grid of blocks of GRID_WARPS warps, WARP_SLOTS slots per warp,
    # unless the [G, E] table read after the barrier would take more than TABLE_LOADS loads
    # per thread: then blocks of twice the warps and slots (align_geometry). From the H200
    # sweeps (slots 1b, 2): small blocks won at 2048 slots (deepseek T=256: 8 blocks of 8
    # warps 13.7 us, 2 of 16 16.3), larger ones at 32768 with E = 256 (32 blocks of 16 warps
    # 17.2 us, of 8 warps 19.1). moe_permute (no padding to write) takes at least
    # PERMUTE_MIN_WARPS in one block (slot 3: qwen3 T=64 permute 14.1 -> 12.9 us with 8)
    "grid": {"SMEM_BUDGET": 48 * 1024, "MAX_WARPS": 16, "MIN_WARPS": 16, "ONE_SLOTS": 64,
             "SMALL_P": 512, "GRID_WARPS": 8, "WARP_SLOTS": 32, "TABLE_LOADS": 16,
             "MAX_BLOCKS": 0, "PERMUTE_MIN_WARPS": 8},
}
PREFETCH = 8          # 32-slot steps whose id loads are in flight together
STEP = 32 * PREFETCH  # slots per round of a warp
SCAN_UNROLL = 8       # rows of the per-warp counts a thread loads before storing any
TOP = 0x80000000      # the barrier word's phase bit


# ----------------------------------------------------------------------------- device parts
def udiv32(a, b):
    """a // b for 0 <= a, b < 2^32 as one 32-bit unsigned division: numba widens integer
    arithmetic to 64 bits, and a 64-bit division is a ~100-instruction call on the GPU."""
    return np.uint32(np.uint32(a) // np.uint32(b))


if not SIMULATOR:
    @intrinsic
    def _udiv32(typingctx, a, b):
        if not (isinstance(a, nbtypes.Integer) and isinstance(b, nbtypes.Integer)):
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            x, y = (v if v.type.width == 32 else builder.trunc(v, i32) if v.type.width > 32
                    else builder.zext(v, i32) for v in args)
            return builder.udiv(x, y)

        return nbtypes.uint32(a, b), codegen

    @overload(udiv32, target="cuda", jit_options={"forceinline": True})
    def _udiv32_cuda(a, b):
        def impl(a, b):
            return _udiv32(a, b)
        return impl


@device_function
def load_round(ids, base, end, E, emap, use_map, ignore_invalid, eb, lane):
    """eb[u] = the expert of slot base + 32 u + lane (-1: past end, outside [0, E), or not on
    this rank when ignore_invalid), u < PREFETCH; end > base. The loads take a clamped index
    and no branch, so all PREFETCH are in flight at once (a load under an `if` on the previous
    slot's id waits for it: one DRAM round trip per step)."""
    last = end - 1
    for u in range(PREFETCH):
        s = base + 32 * u + lane
        v = ids[ix(min(s, last))]
        eb[u] = int32(v) if s < end and v >= 0 and v < E else int32(-1)
    if use_map and ignore_invalid:
        for u in range(PREFETCH):
            e = eb[u]
            m = emap[ix(max(e, 0))]      # clamped, unconditional: independent loads again
            if m < 0:
                eb[u] = -1


@device_function
def count_round(eb, wc, row0):
    """wc[row0 + e] += the round's slots of expert e: one shared atomic per lane (align.cu's
    count; lanes of one expert serialize on its counter). One atomic per distinct expert of a
    step, after a match_any_sync, was slower at all 18 bench points on the H200 (slot 1b)."""
    for u in range(PREFETCH):
        e = eb[u]
        if e >= 0:
            cu.atomic.add(wc, ix(row0 + e), 1)


@device_function
def place_round(eb, base, end, wc, row0, off, sorted_ids, inv, write_sorted, write_inv, lane):
    """Place the round's slots in order: the group's lowest lane reads the cursor
    wc[row0 + e] and advances it by the group's size, the others get its value by a shuffle
    and add the group's lanes below them."""
    for u in range(PREFETCH):
        if base + 32 * u < end:          # warp-uniform: steps past the chunk are skipped
            e = eb[u]
            peers = uint32(cu.match_any_sync(FULL_MASK, e))
            below = peers & cu.lanemask_lt()
            first = int32(0)
            if e >= 0 and below == 0:
                first = wc[ix(row0 + e)]
                wc[ix(row0 + e)] = first + int32(cu.popc(peers))
            cu.syncwarp(FULL_MASK)       # this step's cursor writes land before the next reads
            leader = cu.popc((peers & (~peers + uint32(1))) - uint32(1))   # lowest set bit
            first = cu.shfl_sync(FULL_MASK, first, leader)
            if e >= 0:
                pos = off[ix(e)] + first + int32(cu.popc(below))
                s = base + 32 * u + lane
                if write_sorted:
                    sorted_ids[ix(pos)] = s
                if write_inv:
                    inv[ix(s)] = pos


@device_function
def warp_inclusive_scan(v, lane):
    """The inclusive prefix sum of v over the warp's lanes (5 shuffle steps)."""
    d = 1
    while d < 32:
        u = cu.shfl_sync(FULL_MASK, v, max(lane - d, 0))
        if lane >= d:
            v += u
        d *= 2
    return v


@device_function
def scan_padded(tot, off, pre, E, B, red, tid, NT):
    """off[e] = sum_{e' < e} ceil(tot[e'] / B) B for e <= E (off[E] = the total), grouping.cuh's
    block_exclusive_scan: a run of entries per thread, warp scans by shuffles, warp 0 scans
    the warp totals (red[0:W]); pre[e] += off[e] (the block's first position in expert e's
    run). Unsigned 32-bit division (B > 0, counts >= 0): the int64 floor division of Python
    semantics is a long call. Ends with a barrier."""
    lane = tid % 32
    warp = tid // 32
    W = NT // 32
    per = int32(udiv32(E + NT - 1, NT))
    lo = min(E, tid * per)
    hi = min(E, lo + per)
    local = int32(0)
    for e in range(lo, hi):
        local += int32(udiv32(tot[ix(e)] + B - 1, B)) * int32(B)
    incl = warp_inclusive_scan(local, lane)
    if lane == 31:
        red[ix(warp)] = incl
    cu.syncthreads()
    if warp == 0:
        wt = red[ix(lane)] if lane < W else int32(0)
        wt = warp_inclusive_scan(wt, lane)
        if lane < W:
            red[ix(lane)] = wt            # inclusive warp totals
    cu.syncthreads()
    run = incl - local
    if warp > 0:
        run += red[ix(warp - 1)]
    for e in range(lo, hi):
        off[ix(e)] = run
        pre[ix(e)] += run
        run += int32(udiv32(tot[ix(e)] + B - 1, B)) * int32(B)
    if tid == NT - 1:
        off[ix(E)] = red[ix(W - 1)]
    cu.syncthreads()


@device_function
def pad_runs(off, tot, E, B, P, emap, use_map, expert_ids, sorted_ids, gw, nwarps, lane):
    """expert_ids of each expert's blocks and the padding of its run (positions no slot
    takes). Warp gw of the grid takes cdiv(E, nwarps) consecutive experts: its lanes load 32
    experts' bounds at once (independent shared loads, the divisions by B side by side), a
    ballot keeps the non-empty ones, and the warp walks those, each one's bounds broadcast by
    shuffles, its lanes along the run. (An expert per warp iteration, bounds loaded and
    divided one expert at a time, was 1.1x slower at T = 16 and 64 on the H200, slot 2.)"""
    k = int32(udiv32(E + nwarps - 1, nwarps))
    e0 = gw * k
    e1 = min(E, e0 + k)
    while e0 < e1:
        e = e0 + lane
        lo = int32(0)
        hi = int32(0)
        first = int32(0)
        eid = int32(0)
        if e < e1:
            lo = off[ix(e)]
            hi = off[ix(e + 1)]
            first = lo + tot[ix(e)]               # the run's first padding position
            eid = int32(emap[ix(e)]) if use_map else int32(e)
        x_lo = int32(udiv32(lo, B))
        x_hi = int32(udiv32(hi, B))
        todo = uint32(cu.ballot_sync(FULL_MASK, lo < hi))   # the non-empty experts
        while todo != 0:
            j = cu.popc((todo & (~todo + uint32(1))) - uint32(1))   # the lowest one
            todo &= todo - uint32(1)
            j_lo = cu.shfl_sync(FULL_MASK, x_lo, j)
            j_hi = cu.shfl_sync(FULL_MASK, x_hi, j)
            j_first = cu.shfl_sync(FULL_MASK, first, j)
            j_end = cu.shfl_sync(FULL_MASK, hi, j)
            j_eid = cu.shfl_sync(FULL_MASK, eid, j)
            x = j_lo + lane
            while x < j_hi:
                expert_ids[ix(x)] = j_eid
                x += 32
            p = j_first + lane
            while p < j_end:
                sorted_ids[ix(p)] = P
                p += 32
        e0 += 32


@device_function
def grid_barrier(bar, g, G):
    """Every block of the grid arrives before any leaves (module docstring). Thread 0 of
    each block: release fence, one atomic add, spin on the phase bit, acquire fence."""
    cu.syncthreads()                     # the block's writes come before thread 0's fence
    if cu.threadIdx.x == 0:
        inc = uint32(1)
        if g == 0:
            inc = uint32(TOP) - uint32(G - 1)
        cu.threadfence()
        old = cu.atomic.add(bar, 0, inc)
        while ((cu.atomic.or_(bar, 0, uint32(0)) ^ old) & uint32(TOP)) == 0:
            cu.nanosleep(uint32(32))
        cu.threadfence()
    cu.syncthreads()


# ----------------------------------------------------------------------------- the kernel
def align_grid(ids, P, E, B, emap, use_map, ignore_invalid, hist, bar, sorted_ids, expert_ids,
               n_blocks, capacity, num_post, offsets, inv, do_align, write_inv, chunk):
    """The whole alignment in one launch of G blocks of NT threads (module docstring).

    ids [P] any integer; emap [E] (read when use_map); hist [G E] and bar [1] (G > 1);
    sorted_ids [capacity], expert_ids [n_blocks] (when do_align); num_post [1];
    offsets [E + 1] (block 0 writes them: the padded starts); inv [P] (when write_inv);
    chunk = the slots of each warp, cdiv(cdiv(P, G W), 32) 32."""
    tid = cu.threadIdx.x
    NT = cu.blockDim.x
    W = NT // 32
    warp = tid // 32
    lane = tid % 32
    g = cu.blockIdx.x
    G = cu.gridDim.x
    sh = cu.shared.array(0, int32)
    wc = sh[0:W * E]                          # [W, E] counts, then each warp's cursor
    tot = sh[W * E:W * E + E]                 # [E] slots per expert
    pre = sh[W * E + E:W * E + 2 * E]         # [E] slots in earlier blocks, then the
                                              # block's first position in each run
    off = sh[W * E + 2 * E:W * E + 3 * E + 1]  # [E + 1] padded starts
    red = sh[W * E + 3 * E + 1:W * E + 3 * E + 33]   # [32] scan scratch

    # Strided loops are while loops and divisions unsigned 32-bit: a `range` with a run-time
    # step computes its trip count by a signed 64-bit division (a ~100-instruction call)
    nwarps = G * W
    begin = min(P, (g * W + warp) * chunk)   # chunk: whole 32-slot steps per warp (host)
    end = min(P, begin + chunk)
    rounds = (end - begin + STEP - 1) // STEP
    eb = cu.local.array(PREFETCH, int32)
    if rounds == 1:   # issued before the zeroing below, so its latency overlaps it
        load_round(ids, begin, end, E, emap, use_map, ignore_invalid, eb, lane)
    i = tid
    while i < W * E:
        wc[ix(i)] = 0
        i += NT
    e = tid
    while e < E:
        tot[ix(e)] = 0
        pre[ix(e)] = 0
        e += NT
    cu.syncthreads()
    row0 = warp * E
    for r in range(rounds):
        if rounds > 1:
            load_round(ids, begin + r * STEP, end, E, emap, use_map, ignore_invalid, eb, lane)
        count_round(eb, wc, row0)
    cu.syncthreads()
    cv = cu.local.array(SCAN_UNROLL, int32)
    e = tid
    while e < E:                              # consecutive e: consecutive banks
        run = int32(0)
        for w0 in range(0, W, SCAN_UNROLL):   # the loads of a group before its stores
            for u in range(SCAN_UNROLL):      # (a store may alias the next load)
                cv[u] = wc[ix((w0 + u) * E + e)] if w0 + u < W else 0
            for u in range(SCAN_UNROLL):
                if w0 + u < W:
                    wc[ix((w0 + u) * E + e)] = run
                    run += cv[u]
        if G > 1:
            hist[ix(g * E + e)] = run
        else:
            tot[ix(e)] = run
        e += NT
    if G > 1:
        grid_barrier(bar, g, G)
        # `per` threads per expert, each summing every per-th row: few loads per thread, all
        # independent (the rows were written by other SMs in this launch: L2, after the fence)
        per = max(1, int32(udiv32(NT, E)))
        i = tid
        while i < per * E:
            j = int32(udiv32(i, E))
            e = i - j * E
            t_sum = int32(0)
            p_sum = int32(0)
            while j < G:
                v = hist[ix(j * E + e)]
                t_sum += v
                if j < g:
                    p_sum += v
                j += per
            cu.atomic.add(tot, ix(e), t_sum)
            cu.atomic.add(pre, ix(e), p_sum)
            i += NT
    cu.syncthreads()
    scan_padded(tot, off, pre, E, B, red, tid, NT)  # ends with a barrier; pre = starts
    total = off[ix(E)]
    if g == 0:
        if tid == 0:
            num_post[0] = total
        e = tid
        while e <= E:
            offsets[ix(e)] = off[ix(e)]
            e += NT
    if do_align:
        pad_runs(off, tot, E, B, P, emap, use_map, expert_ids, sorted_ids, g * W + warp,
                 nwarps, lane)
        gn = G * NT
        p = total + g * NT + tid
        while p < capacity:                   # the tail: no slot goes there
            sorted_ids[ix(p)] = P
            p += gn
        x = int32(udiv32(total, B)) + g * NT + tid
        while x < n_blocks:
            expert_ids[ix(x)] = -1
            x += gn
    for r in range(rounds):
        if rounds > 1:
            load_round(ids, begin + r * STEP, end, E, emap, use_map, ignore_invalid, eb, lane)
        place_round(eb, begin + r * STEP, end, wc, row0, pre, sorted_ids, inv, do_align,
                    write_inv, lane)


@functools.lru_cache(maxsize=None)
def grid_kernel():
    """The compiled align_grid (one kernel for every geometry: NT and G are read at run
    time, so a notebook waits for one compile). Bounded to 1024 threads: <= 64 registers,
    which it fits without spilling (a round of ids in registers across the barriers)."""
    return kernel(align_grid, launch_bounds=(1024, 1))


# ----------------------------------------------------------------------------- launcher
_SM_COUNT = {}
_BARRIER = {}


def _sm_count() -> int:
    dev = A.cuda().get_current_device()
    if dev.id not in _SM_COUNT:
        _SM_COUNT[dev.id] = int(dev.MULTIPROCESSOR_COUNT)
    return _SM_COUNT[dev.id]


def _barrier_word():
    """The grid barrier's word of the current device and launch stream, zeroed once by a
    synchronous copy (each launch leaves it ready for the next, and launches on one stream
    never overlap; another stream, `A.using_stream`, gets its own word)."""
    cuda = A.cuda()
    key = (cuda.get_current_device().id, A._STREAM[0])
    if key not in _BARRIER:
        _BARRIER[key] = cuda.to_device(np.zeros(1, np.uint32))
    return _BARRIER[key]


def fits(E: int) -> bool:
    """Whether one warp's row of counters (and the rest) fits the shared-memory budget."""
    cfg = CONFIGS["grid"]
    return (E + 3 * E + 33) * 4 <= cfg["SMEM_BUDGET"]


def align_geometry(P: int, E: int, sm_count: int, pad: bool = True):
    """(G, NT, shared memory bytes) of align_grid (module docstring); pad=False (moe_permute:
    no padding, no expert_ids) needs fewer warps for the per-expert work of one block."""
    cfg = CONFIGS["grid"]
    fixed = 3 * E + 33
    fit = max(1, (cfg["SMEM_BUDGET"] // 4 - fixed) // E)   # warps whose [W, E] rows fit
    if P <= cfg["SMALL_P"]:
        G = 1
        # a warp per ONE_SLOTS slots, but at least one per 8 experts (up to MIN_WARPS): the
        # per-expert work (scan, padding, expert_ids) is spread over them
        least = cfg["MIN_WARPS"] if pad else cfg["PERMUTE_MIN_WARPS"]
        W = max(min(least, max(4, A.cdiv(E, 8))), A.cdiv(max(P, 1), cfg["ONE_SLOTS"]))
        W = min(W, cfg["MAX_WARPS"], fit)
    else:
        W, slots = min(cfg["GRID_WARPS"], fit), cfg["WARP_SLOTS"]
        if A.cdiv(P, W * slots) * E > cfg["TABLE_LOADS"] * 32 * W and 2 * W <= fit:
            # the [G, E] table would cost more than TABLE_LOADS loads per thread: blocks of
            # twice the warps, each warp twice the slots (a quarter of the blocks)
            W, slots = 2 * W, 2 * slots
        blocks = cfg["MAX_BLOCKS"] or sm_count
        G = max(1, min(blocks, A.cdiv(P, W * slots), cfg["TABLE_LOADS"] * W * 32 // E))
    return G, 32 * W, (W * E + fixed) * 4


def launch(call, ids, P, E, B, emap, use_map, ignore_invalid, sorted_ids, expert_ids, n_blocks,
           capacity, num_post, offsets, inv, do_align, write_inv):
    """One launch of align_grid over the numba arrays (align._sort_slots makes them)."""
    G, NT, smem = align_geometry(P, E, _sm_count() if P > CONFIGS["grid"]["SMALL_P"] else 1,
                                 bool(do_align))
    if G > 1:
        hist = call.empty((G * E,), np.int32)            # [G, E] per-block counts
        bar = _barrier_word()
    else:
        hist, bar = A.dummy(np.int32), A.dummy(np.uint32)
    k = grid_kernel()
    args = (ids, P, E, B, emap, use_map, ignore_invalid, hist, bar, sorted_ids, expert_ids,
            n_blocks, capacity, num_post, offsets, inv, do_align, write_inv,
            A.cdiv(A.cdiv(P, G * NT // 32), 32) * 32)   # chunk: whole 32-slot steps per warp
    if G > 1 and not SIMULATOR:
        _cooperative(k, args)
    k[G, NT, A.launch_stream(), smem](*args)


_MARKED = set()


def _cooperative(k, args):
    """Mark the kernel `k` compiles for these arguments for a cooperative launch, as
    align.cu's: the driver refuses a grid that cannot be resident all at once (which the
    barrier needs) instead of letting it hang. numba sets the flag only on kernels that call
    cuda.cg (linking cudadevrt for them), so it is set here on the compiled kernel. Only ids
    and expert_map vary in type between calls (the rest are arrays this module makes and
    Python ints), so typing all the arguments (~0.1 ms) happens once per such pair."""
    ids, emap = args[0], args[4]
    key = (id(k), ids.dtype.str, emap.dtype.str, ids.is_c_contiguous())
    if key not in _MARKED:
        k.compile(tuple(k.typeof_pyval(a) for a in args)).cooperative = True
        _MARKED.add(key)
