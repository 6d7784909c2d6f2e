"""Grouping the (token, slot) pairs by expert on the GPU (permute.cu).

Shapes: T tokens, K top-k, P = T * K slots (s = t * K + k), E experts, B block size, H hidden.

    moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                         pad_sorted_ids=False, ignore_invalid_experts=False)
        -> sorted_token_ids int32 [max_num_tokens_padded], expert_ids int32
           [cdiv(max_num_tokens_padded, B)], num_tokens_post_padded int32 [1]
    moe_permute(hidden_states, topk_ids, num_experts)
        -> x_grouped [P, H], expert_offsets int32 [E + 1], inv_permuted_idx int32 [P]
    moe_unpermute(y_grouped, topk_weights, inv_permuted_idx) -> out [T, H]

The grouping runs on the GPU with no host round trip (counts, scans and a stable scatter:
permute.cu explains it); the order inside an expert is increasing s, the reference's.
Ids outside [0, E) are not checked on the host (that would need a device-to-host copy): the
kernels drop them from the alignment, and moe_permute places their rows after every expert
(expert_offsets[E] < P then says so).

Run as a script to validate against reference/ and time: python -m cuda_kernels.cupy.permute
"""
from __future__ import annotations


import numpy as np

from . import _compile as C

CONFIGS = {
    # the grouping kernels: shared memory budget for the per-(warp, bucket) counters (48 KB
    # needs no opt-in on any GPU; more warps = shorter chunks per warp); PREFETCH 32-slot
    # steps of ids loaded at once per lane.
    "group": {"SMEM_BUDGET": 48 * 1024, "MAX_WARPS": 32, "PREFETCH": 8},
    # alignment, one launch: one block up to SMALL_P slots; above, a cooperative grid of
    # cdiv(P, W * WARP_SLOTS) blocks (at most MAX_BLOCKS, 0 = one per SM), each warp owning
    # WARP_SLOTS slots (two 32-slot steps: its ids stay in registers across the grid barrier);
    # after the barrier each block reads the [G, E] count table, so G is also capped to keep
    # that at TABLE_LOADS loads per thread (matters for large E, where W is small)
    "align": {"SMALL_P": 4096, "WARP_SLOTS": 64, "MAX_BLOCKS": 0, "TABLE_LOADS": 16,
              "EXPERTS_PER_WARP": 8},
    "gather_rows_kernel": {"ROW_WARPS": 4},
    "moe_unpermute_kernel": {"UNPERMUTE_THREADS": 128},
}
MAX_EXPERTS = 4096
_WORDS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short"}
_GATHER_NAMES = tuple(f"gather_rows_kernel<{w}>" for w in _WORDS.values())
_VECS = (1, 2, 4, 8)
_UNPERMUTE_NAMES = tuple(f"moe_unpermute_kernel<{v}>" for v in _VECS)


def _defines(scalar_dtype=np.float32) -> dict:
    return {"SCALAR_T": C.ctype_of(scalar_dtype), "PREFETCH": CONFIGS["group"]["PREFETCH"],
            **CONFIGS["gather_rows_kernel"], **CONFIGS["moe_unpermute_kernel"]}


# The grouping kernels and the gathers do not depend on the dtype: they are compiled with the
# fp32 defines; moe_unpermute once per dtype.
_FIXED_NAMES = ("moe_align_kernel", "moe_permute_index_kernel") + _GATHER_NAMES
C.register_compile_case("permute.cu", _defines(), _FIXED_NAMES)
for _dt in C.float_dtypes():
    C.register_compile_case("permute.cu", _defines(_dt), _UNPERMUTE_NAMES)


# ----------------------------------------------------------------------------- helpers
def _ids_i32(name, ids):
    import cupy

    C.check_array(name, ids, ndim=2)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer dtype (int32 preferred), got {ids.dtype}")
    return ids if ids.dtype == np.int32 else ids.astype(cupy.int32)


def _group_geometry(P: int, NB: int):
    """Warps W of the one-block grouping kernels, their chunk, and the shared memory bytes."""
    cfg = CONFIGS["group"]
    ints = cfg["SMEM_BUDGET"] // 4
    W = min(cfg["MAX_WARPS"], (ints - NB - 33) // NB)
    if W < 1:
        raise ValueError(f"num_experts: {NB} buckets do not fit the grouping kernel's "
                         f"{cfg['SMEM_BUDGET']} bytes of shared memory")
    # no more warps than 32-slot steps: idle warps only cost scan time
    W = max(1, min(W, C.cdiv(max(P, 1), 32)))
    chunk = C.cdiv(C.cdiv(max(P, 1), W), 32) * 32  # whole 32-slot steps per warp
    smem = (W * NB + NB + 1 + 32) * 4
    return W, chunk, smem


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
        W = max(1, min(W, max(C.cdiv(max(P, 1), 32), C.cdiv(E, cfg["EXPERTS_PER_WARP"]))))
    else:
        G = max(1, min(max_blocks, C.cdiv(P, W * cfg["WARP_SLOTS"]),
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


def _barrier_word(stream_ptr: int | None = None):
    """The grid barrier's word for the current device and stream (`stream_ptr`, default
    CuPy's current stream). A launch leaves it ready
    for the next (permute.cu: its low bits return to 0), and launches on one stream never
    overlap; another stream gets its own word.

    The words come from one block per device zeroed when it is made, never by a launch on
    the caller's stream: a stream that is being captured into a CUDA graph runs nothing, so
    a word zeroed there would only be zeroed by the graph's replays, and an eager launch on
    that stream would find garbage in it (a grid barrier that never opens)."""
    import cupy

    if stream_ptr is None:
        stream_ptr = cupy.cuda.get_current_stream().ptr
    dev = cupy.cuda.Device().id
    key = (dev, stream_ptr)
    word = _BARRIER_WORDS.get(key)
    if word is not None:
        return word
    pool = _BARRIER_POOL.get(dev)
    if pool is None or pool[1] == BARRIER_POOL_WORDS:
        if cupy.cuda.runtime.streamIsCapturing(stream_ptr):
            raise RuntimeError("moe_align_block_size: its first call on a device must not be "
                               "inside a CUDA graph capture (a zeroed grid-barrier word is "
                               "made then); run the layer once before capturing")
        words = cupy.zeros((BARRIER_POOL_WORDS,), cupy.uint32)
        cupy.cuda.get_current_stream().synchronize()   # zeroed before any stream uses it
        pool = _BARRIER_POOL[dev] = [words, 0]
    word = _BARRIER_WORDS[key] = pool[0][pool[1]:pool[1] + 1]
    pool[1] += 1
    return word


def max_num_tokens_padded(P: int, num_experts: int, block_size: int,
                          pad_sorted_ids: bool = False) -> int:
    """The length of sorted_token_ids: P + E (B - 1), rounded up to B if pad_sorted_ids,
    and at most P * B when P < E (docs/stages.md)."""
    n = P + num_experts * (block_size - 1)
    if pad_sorted_ids:
        n = C.cdiv(n, block_size) * block_size
    if P < num_experts:
        n = min(n, P * block_size)
    return n


# ----------------------------------------------------------------------------- stages
def moe_align_block_size(topk_ids, block_size, num_experts, expert_map=None,
                         pad_sorted_ids=False, ignore_invalid_experts=False):
    """Group the P slots by expert, each expert's run padded to a multiple of B with P.

    Returns sorted_token_ids int32 [max_num_tokens_padded] (increasing s inside an expert),
    expert_ids int32 [cdiv(max_num_tokens_padded, B)] (local ids under expert_map, -1 past
    the last block or for non-local experts), num_tokens_post_padded int32 [1]
    (= sum_e ceil(c_e / B) * B). One launch: one block up to SMALL_P slots, above that a
    cooperative grid with one grid barrier (permute.cu); nothing is read back to the host.
    """
    ids = _ids_i32("topk_ids", topk_ids)
    B = C.check_int("block_size", block_size, 1)
    E = C.check_int("num_experts", num_experts, 1, MAX_EXPERTS)
    emap = None
    if expert_map is not None:
        C.check_array("expert_map", expert_map, ndim=1, shape=(E,))
        if expert_map.dtype.kind not in "iu":
            raise TypeError(f"expert_map: expected an integer dtype, got {expert_map.dtype}")
        emap = expert_map if expert_map.dtype == np.int32 else expert_map.astype(np.int32)
    P = int(ids.size)
    n = max_num_tokens_padded(P, E, B, pad_sorted_ids)
    C.check_fits_int32("topk_ids", n + B, "max_num_tokens_padded + block_size")
    num_blocks = C.cdiv(n, B)

    sorted_token_ids = C.empty((n,), np.int32)           # [max_num_tokens_padded]
    expert_ids = C.empty((num_blocks,), np.int32)         # [cdiv(max_num_tokens_padded, B)]
    num_tokens_post_padded = C.empty((1,), np.int32)      # [1]
    emap_arg = emap if emap is not None else C.null_ptr()
    ignore = np.int32(1 if ignore_invalid_experts else 0)
    G, W, smem = _align_geometry(P, E, _max_blocks() if P > CONFIGS["align"]["SMALL_P"] else 1)
    kernel = C.get_kernel("permute.cu", "moe_align_kernel", _defines(), _FIXED_NAMES)
    if smem > 48 * 1024:  # a block gets more than 48 KB only after opting in
        kernel.max_dynamic_shared_size_bytes = smem
    hist = C.empty((G * E,), np.int32) if G > 1 else C.null_ptr()  # [G, E] per-block counts
    bar = _barrier_word() if G > 1 else C.null_ptr()
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


def _word_bytes(row_bytes: int, *arrays) -> int:
    """The widest copy word (16, 8, 4, 2 bytes) that divides a row and every base address."""
    for w in (16, 8, 4, 2):
        if row_bytes % w == 0 and all(a.data.ptr % w == 0 for a in arrays):
            return w
    raise ValueError(f"hidden_states: rows of {row_bytes} bytes cannot be copied in 2-byte words")


def moe_permute(hidden_states, topk_ids, num_experts):
    """Rows grouped by expert (increasing id, stable in s): the contiguous layout.

    Returns x_grouped [P, H] (x_grouped[inv_permuted_idx[s]] = hidden_states[s // K]),
    expert_offsets int32 [E + 1] (expert e owns rows expert_offsets[e] .. [e + 1] - 1),
    inv_permuted_idx int32 [P].
    """
    C.check_array("hidden_states", hidden_states, ndim=2, dtypes=C.float_dtypes())
    ids = _ids_i32("topk_ids", topk_ids)
    E = C.check_int("num_experts", num_experts, 1, MAX_EXPERTS)
    T, H = hidden_states.shape
    if ids.shape[0] != T:
        raise ValueError(f"topk_ids: expected {T} rows to match hidden_states {hidden_states.shape}, "
                         f"got shape {ids.shape}")
    K = ids.shape[1]
    P = T * K
    C.check_fits_int32("topk_ids", P, "P = T * K")
    x_grouped = C.empty((P, H), hidden_states.dtype)    # [P, H]
    expert_offsets = C.empty((E + 1,), np.int32)         # [E + 1]
    inv_permuted_idx = C.empty((P,), np.int32)           # [P]

    W, chunk, smem = _group_geometry(P, E + 1)
    kernel = C.get_kernel("permute.cu", "moe_permute_index_kernel", _defines(), _FIXED_NAMES)
    kernel((1,), (W * 32,), (ids, expert_offsets, inv_permuted_idx, np.int32(P), np.int32(E),
                             np.int32(chunk)), shared_mem=smem)
    if P == 0 or H == 0:
        return x_grouped, expert_offsets, inv_permuted_idx

    itemsize = hidden_states.dtype.itemsize
    w = _word_bytes(H * itemsize, hidden_states, x_grouped)
    warps = CONFIGS["gather_rows_kernel"]["ROW_WARPS"]
    gather = C.get_kernel("permute.cu", f"gather_rows_kernel<{_WORDS[w]}>", _defines(),
                          _FIXED_NAMES)
    gather((C.cdiv(P, warps),), (warps * 32,),
           (C.raw(hidden_states), inv_permuted_idx, C.raw(x_grouped), np.int32(P), np.int32(K),
            np.int32(H * itemsize // w)))
    return x_grouped, expert_offsets, inv_permuted_idx


def moe_unpermute(y_grouped, topk_weights, inv_permuted_idx):
    """out[t] = sum_k topk_weights[t, k] * y_grouped[inv_permuted_idx[t * K + k]].

    fp32 accumulation in slot order, rounded once to y_grouped's dtype; one thread per VEC
    output columns, no atomics, so the result is bitwise reproducible.
    """
    import cupy

    C.check_array("y_grouped", y_grouped, ndim=2, dtypes=C.float_dtypes())
    C.check_array("topk_weights", topk_weights, ndim=2, dtypes=C.float_dtypes(with_f64=True))
    T, K = topk_weights.shape
    P, H = y_grouped.shape
    if P != T * K:
        raise ValueError(f"y_grouped: expected T * K = {T} * {K} = {T * K} rows to match "
                         f"topk_weights {topk_weights.shape}, got {P}")
    C.check_array("inv_permuted_idx", inv_permuted_idx, ndim=1, shape=(P,))
    if inv_permuted_idx.dtype.kind not in "iu":
        raise TypeError(f"inv_permuted_idx: expected an integer dtype, got {inv_permuted_idx.dtype}")
    inv = inv_permuted_idx if inv_permuted_idx.dtype == np.int32 else \
        inv_permuted_idx.astype(cupy.int32)
    weights = C.as_f32(topk_weights)
    out = C.empty((T, H), y_grouped.dtype)  # [T, H]
    if T == 0 or H == 0:
        return out
    g = C.row_geometry("topk_weights", T, H, CONFIGS["moe_unpermute_kernel"]["UNPERMUTE_THREADS"],
                       y_grouped, out, vecs=_VECS)
    kernel = C.get_kernel("permute.cu", f"moe_unpermute_kernel<{g.vec}>",
                          _defines(y_grouped.dtype), _UNPERMUTE_NAMES)
    kernel((g.grid,), (g.threads,),
           (C.raw(y_grouped), weights, inv, C.raw(out), np.int32(T), np.int32(K), np.int32(H),
            np.int32(g.chunks)))
    return out


# ----------------------------------------------------------------------------- script
def _main(argv=None):
    quick, timed = C.script_start(argv)  # --quick: small shapes, 3 timed calls (sanitizers)
    import reference

    rng = np.random.default_rng(0)
    bf16 = C.bf16_dtype()
    print(f"{'case':48s} {'check':>10s} {'median us':>10s} {'GB/s':>8s}")
    align_cases = ((16, 8, 2, 16), (4096, 256, 8, 64), (4096, 128, 8, 64), (16384, 256, 8, 128))
    permute_cases = ((1024, 256, 8, 7168), (4096, 128, 8, 2048))
    if quick:
        # one case per alignment path (P <= SMALL_P: one block; above: a grid)
        align_cases = ((16, 8, 2, 16), (300, 256, 8, 64), (600, 64, 8, 32))
        permute_cases = ((33, 16, 4, 136),)
    for T, E, K, B in align_cases:
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)  # [T, K]
        d_ids = C.to_device(ids)
        got = [C.to_host(a) for a in moe_align_block_size(d_ids, B, E)]
        want = reference.moe_align_block_size(ids, B, E)
        same = all((g == w).all() for g, w in zip(got, want))
        ms = C.median(timed(lambda d_ids=d_ids, B=B, E=E: moe_align_block_size(d_ids, B, E)))
        nbytes = (ids.size + want[0].size + want[1].size + 1) * 4  # ids in, three outputs out
        print(f"{f'moe_align_block_size T={T} E={E} K={K} B={B}':48s} "
              f"{'exact' if same else 'MISMATCH':>10s} {ms * 1e3:10.1f} {nbytes / ms / 1e6:8.1f}")
    for T, E, K, H in permute_cases:
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
        x = rng.standard_normal((T, H)).astype(bf16)                              # [T, H]
        d_x, d_ids = C.to_device(x), C.to_device(ids)
        got = moe_permute(d_x, d_ids, E)
        want = reference.moe_permute(x, ids, E)
        same = all((C.to_host(g).view(np.uint8) == w.view(np.uint8)).all()
                   for g, w in zip(got, want))
        ms = C.median(timed(lambda d_x=d_x, d_ids=d_ids, E=E: moe_permute(d_x, d_ids, E)))
        nbytes = (T * H + T * K * H) * 2 + ids.size * 8  # x once, x_grouped, ids + inv
        print(f"{f'moe_permute T={T} E={E} K={K} H={H} bf16':48s} "
              f"{'exact' if same else 'MISMATCH':>10s} {ms * 1e3:10.1f} {nbytes / ms / 1e6:8.1f}")
        y = rng.standard_normal((T * K, H)).astype(bf16)                          # [P, H]
        w8 = rng.random((T, K)).astype(np.float32)
        d_y, d_w, d_inv = C.to_device(y), C.to_device(w8), got[2]
        out = moe_unpermute(d_y, d_w, d_inv)
        err = C.rel_err(C.to_host(out), reference.moe_unpermute(y, w8, want[2]))
        ms = C.median(timed(lambda d_y=d_y, d_w=d_w, d_inv=d_inv: moe_unpermute(d_y, d_w, d_inv)))
        nbytes = (T * K * H + T * H) * 2 + T * K * 8  # y in, out, weights + inv
        print(f"{f'moe_unpermute T={T} K={K} H={H} bf16':48s} {err:10.2e} {ms * 1e3:10.1f} "
              f"{nbytes / ms / 1e6:8.1f}")


if __name__ == "__main__":
    _main()
