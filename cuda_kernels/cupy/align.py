"""moe_align_block_size on the GPU (align.cu): the slots grouped by expert in blocks of B.

Shapes: T tokens, K top-k, P = T * K slots (s = t * K + k), E experts, B block size.

    moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                         pad_sorted_ids=False, ignore_invalid_experts=False)
        -> sorted_token_ids int32 [max_num_tokens_padded], expert_ids int32
           [cdiv(max_num_tokens_padded, B)], num_tokens_post_padded int32 [1]

The output's length, max_num_tokens_padded(P, block_size, num_experts, pad_sorted_ids), is the
reference's (reference/align.py): the buffer the contract sizes.

The grouping runs on the GPU with no host round trip (counts, scans and a stable scatter in
one launch: align.cu and grouping.cuh explain it); the order inside an expert is increasing
s, the reference's. Ids outside [0, E) are not checked on the host (that would need a
device-to-host copy): the kernel drops them from the alignment.

Run as a script to validate against reference/ and time: python -m cuda_kernels.cupy.align
"""
from __future__ import annotations

import numpy as np

from reference.align import max_num_tokens_padded

from . import _arrays as A
from . import _compile as C
from ._geometry import cdiv
from ._script import script_start

CONFIGS = {
    # the grouping (grouping.cuh, which permute.cu's index kernel shares): shared memory
    # budget for the per-(warp, bucket) counters (48 KB needs no opt-in on any GPU; more
    # warps = shorter chunks per warp); PREFETCH 32-slot steps of ids loaded at once per lane.
    "group": {"SMEM_BUDGET": 48 * 1024, "MAX_WARPS": 32, "PREFETCH": 8},
    # alignment, one launch: one block up to SMALL_P slots; above, a cooperative grid of
    # cdiv(P, W * WARP_SLOTS) blocks (at most MAX_BLOCKS, 0 = one per SM), each warp owning
    # WARP_SLOTS slots (two 32-slot steps: its ids stay in registers across the grid barrier);
    # after the barrier each block reads the [G, E] count table, so G is also capped to keep
    # that at TABLE_LOADS loads per thread (matters for large E, where W is small)
    "align": {"SMALL_P": 4096, "WARP_SLOTS": 64, "MAX_BLOCKS": 0, "TABLE_LOADS": 16,
              "EXPERTS_PER_WARP": 8},
}
MAX_EXPERTS = 4096
KERNEL_NAMES = ("moe_align_kernel",)


def _defines() -> dict:
    return {"PREFETCH": CONFIGS["group"]["PREFETCH"]}


C.register_compile_case("align.cu", _defines(), KERNEL_NAMES)


# ----------------------------------------------------------------------------- helpers
def _ids_i32(name, ids):
    import cupy

    A.check_array(name, ids, ndim=2)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer dtype (int32 preferred), got {ids.dtype}")
    return ids if ids.dtype == np.int32 else ids.astype(cupy.int32)


SMEM_OPTIN_MAX = 160 * 1024  # the per-block opt-in limit of sm_80 (sm_90: 227 KB)


def _align_geometry(P: int, E: int, max_blocks: int):
    """(G, W, shared memory bytes) of moe_align_kernel: G blocks of W warps.

    W: as many warps (up to MAX_WARPS) as the per-warp counters allow in SMEM_BUDGET, at least
    one (then more than 48 KB if E needs it). G = 1 up to SMALL_P slots, W cut to the 32-slot
    steps (idle warps only cost scan time) but kept at one warp per EXPERTS_PER_WARP experts:
    the per-expert steps (the scans, expert_ids, the padding) run one expert per warp at a
    time, and a lone warp walking E = 256 experts took 20 us of a decode step (H100,
    T = 1). Else G = cdiv(P, W * WARP_SLOTS), at most max_blocks and at most TABLE_LOADS W 32
    / E (the count table read after the grid barrier).
    """
    cfg, group = CONFIGS["align"], CONFIGS["group"]
    fixed = 2 * E + 33  # off [E + 1], tot [E], scan scratch [32]
    W = max(1, min(group["MAX_WARPS"], (group["SMEM_BUDGET"] // 4 - fixed) // E))
    if (W * E + fixed) * 4 > SMEM_OPTIN_MAX:
        raise ValueError(f"num_experts: {E} experts do not fit the alignment kernel's "
                         f"{SMEM_OPTIN_MAX} bytes of shared memory")
    if P <= cfg["SMALL_P"]:
        G = 1
        W = max(1, min(W, max(cdiv(max(P, 1), 32), cdiv(E, cfg["EXPERTS_PER_WARP"]))))
    else:
        G = max(1, min(max_blocks, cdiv(P, W * cfg["WARP_SLOTS"]),
                       cfg["TABLE_LOADS"] * W * 32 // E))
    return G, W, (W * E + fixed) * 4


_SM_COUNT = {}
_BARRIER_WORDS = {}


def _max_blocks() -> int:
    """Blocks of a cooperative alignment grid: MAX_BLOCKS, or one per SM of this device (a
    block of <= 1024 threads and <= 64 registers per thread always fits one per SM)."""
    import cupy

    if CONFIGS["align"]["MAX_BLOCKS"]:
        return CONFIGS["align"]["MAX_BLOCKS"]
    dev = cupy.cuda.Device()
    if dev.id not in _SM_COUNT:
        _SM_COUNT[dev.id] = int(dev.attributes["MultiProcessorCount"])
    return _SM_COUNT[dev.id]


_BARRIER_POOL = {}          # device -> [zeroed words, next free index]
BARRIER_POOL_WORDS = 256


def _barrier_word(stream_ptr: int | None = None, device: int | None = None,
                  name: str = "grid barrier"):
    """The grid barrier's word for `device` (default CuPy's current one) and stream
    (`stream_ptr`, default CuPy's current stream). A launch leaves it ready
    for the next (align.cu: its low bits return to 0), and launches on one stream never
    overlap; another stream gets its own word. `name`: another word of the same kind for
    another use (experts_decode.cu's chunk counter, which each launch leaves at 0 too).

    The words come from one block per device zeroed when it is made, never by a launch on
    the caller's stream: a stream that is being captured into a CUDA graph runs nothing, so
    a word zeroed there would only be zeroed by the graph's replays, and an eager launch on
    that stream would find garbage in it (a grid barrier that never opens)."""
    import cupy

    if stream_ptr is None:
        stream_ptr = cupy.cuda.get_current_stream().ptr
    dev = cupy.cuda.Device().id if device is None else device
    key = (dev, stream_ptr, name)
    word = _BARRIER_WORDS.get(key)
    if word is not None:
        return word
    pool = _BARRIER_POOL.get(dev)
    if pool is None or pool[1] == BARRIER_POOL_WORDS:
        if cupy.cuda.runtime.streamIsCapturing(stream_ptr):
            raise RuntimeError("moe_align_block_size: its first call on a device must not be "
                               "inside a CUDA graph capture (a zeroed grid-barrier word is "
                               "made then); run the layer once before capturing")
        with cupy.cuda.Device(dev):
            words = cupy.zeros((BARRIER_POOL_WORDS,), cupy.uint32)
            cupy.cuda.get_current_stream().synchronize()   # zeroed before any stream uses it
        pool = _BARRIER_POOL[dev] = [words, 0]
    word = _BARRIER_WORDS[key] = pool[0][pool[1]:pool[1] + 1]
    pool[1] += 1
    return word


# ----------------------------------------------------------------------------- stage
def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                         pad_sorted_ids=False, ignore_invalid_experts=False):
    """Group the P slots by expert, each expert's run padded to a multiple of B with P.

    Returns sorted_token_ids int32 [max_num_tokens_padded] (increasing s inside an expert),
    expert_ids int32 [cdiv(max_num_tokens_padded, B)] (local ids under expert_map, -1 past
    the last block or for non-local experts), num_tokens_post_padded int32 [1]
    (= sum_e ceil(c_e / B) * B). One launch: one block up to SMALL_P slots, above that a
    cooperative grid with one grid barrier (align.cu); nothing is read back to the host.
    """
    ids = _ids_i32("topk_ids", topk_ids)
    B = A.check_int("block_size", block_size, 1)
    E = A.check_int("num_experts", num_experts, 1, MAX_EXPERTS)
    emap = None
    if expert_map is not None:
        A.check_array("expert_map", expert_map, ndim=1, shape=(E,))
        if expert_map.dtype.kind not in "iu":
            raise TypeError(f"expert_map: expected an integer dtype, got {expert_map.dtype}")
        emap = expert_map if expert_map.dtype == np.int32 else expert_map.astype(np.int32)
    P = int(ids.size)
    n = max_num_tokens_padded(P, B, E, pad_sorted_ids)
    A.check_fits_int32("topk_ids", n + B, "max_num_tokens_padded + block_size")
    num_blocks = cdiv(n, B)

    sorted_token_ids = A.empty((n,), np.int32)           # [max_num_tokens_padded]
    expert_ids = A.empty((num_blocks,), np.int32)         # [cdiv(max_num_tokens_padded, B)]
    num_tokens_post_padded = A.empty((1,), np.int32)      # [1]
    emap_arg = emap if emap is not None else A.null_ptr()
    ignore = np.int32(1 if ignore_invalid_experts else 0)
    G, W, smem = _align_geometry(P, E, _max_blocks() if P > CONFIGS["align"]["SMALL_P"] else 1)
    kernel = C.get_kernel("align.cu", "moe_align_kernel", _defines(), KERNEL_NAMES)
    if smem > 48 * 1024:  # a block gets more than 48 KB only after opting in
        kernel.max_dynamic_shared_size_bytes = smem
    hist = A.empty((G * E,), np.int32) if G > 1 else A.null_ptr()  # [G, E] per-block counts
    bar = _barrier_word() if G > 1 else A.null_ptr()
    args = (ids, emap_arg, sorted_token_ids, expert_ids, num_tokens_post_padded, hist, bar,
            np.int32(P), np.int32(E), np.int32(B), np.int32(n), np.int32(num_blocks), ignore)
    if G == 1:
        kernel((1,), (W * 32,), args, shared_mem=smem)
    else:
        # cooperative: the driver refuses a grid that cannot be resident all at once, which
        # the grid barrier needs (a plain launch could hang instead). RawKernel takes the flag
        # at construction only; its underlying Function takes it per launch.
        getattr(kernel, "kernel", kernel)((G,), (W * 32,), args, shared_mem=smem,
                                          enable_cooperative_groups=True)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


# ----------------------------------------------------------------------------- script
def _main(argv=None):
    quick, timed = script_start(argv)  # --quick: small shapes, 3 timed calls (sanitizers)
    import reference

    rng = np.random.default_rng(0)
    print(f"{'case':48s} {'check':>10s} {'median us':>10s} {'GB/s':>8s}")
    align_cases = ((16, 8, 2, 16), (4096, 256, 8, 64), (4096, 128, 8, 64), (16384, 256, 8, 128))
    if quick:
        # one case per alignment path (P <= SMALL_P: one block; above: a grid)
        align_cases = ((16, 8, 2, 16), (300, 256, 8, 64), (600, 64, 8, 32))
    for T, E, K, B in align_cases:
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)  # [T, K]
        d_ids = A.to_device(ids)
        got = [A.to_host(a) for a in moe_align_block_size(d_ids, B, E)]
        want = reference.moe_align_block_size(ids, B, E)
        same = all((g == w).all() for g, w in zip(got, want))
        ms = timed(lambda d_ids=d_ids, B=B, E=E: moe_align_block_size(d_ids, B, E)).median
        nbytes = (ids.size + want[0].size + want[1].size + 1) * 4  # ids in, three outputs out
        print(f"{f'moe_align_block_size T={T} E={E} K={K} B={B}':48s} "
              f"{'exact' if same else 'MISMATCH':>10s} {ms * 1e3:10.1f} {nbytes / ms / 1e6:8.1f}")


if __name__ == "__main__":
    _main()
