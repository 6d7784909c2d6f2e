"""Dispatch and combine: how tokens reach the ranks that hold their experts, and come back.

    W ranks, r this rank, T tokens here, T_p tokens on rank p, K top-k, H hidden,
    P = T*K slots (s = t*K + k), P_l physical experts per rank, R rows received

Two schemes, both exact (they change where the work happens, never the math):

(a) "allgather" (vLLM's default naive EP): every rank sees every token.
        dispatch   all_gather x [T, H] and the routing [T, K] (ids + weights, one int32
                   buffer [T, 2K]); ranks with fewer tokens pad to T_max = max_p T_p
                   -> x_all [sum_p T_p, H], ids_all, weights_all
        experts    each rank runs its P_l experts on all tokens (expert_map: other ranks'
                   experts add 0) -> partial [sum_p T_p, H]
        combine    reduce_scatter (sum over ranks) of the partials, each rank keeping its
                   own T rows
    bytes per rank: (W-1) * T * (H*b + 8K) in, (W-1) * T * H*b out (b = dtype bytes).

(b) "alltoall" (MegaBlocks / DeepEP's shape): only the routed rows move, two row modes.
    "token" rows (default; DeepEP's): token t goes ONCE to each rank holding one of its
        experts, with its K physical ids and weights (int32 meta [T, 2K]).
        dispatch   table[t, j] = the j-th distinct destination of t, or W ("nowhere"),
                   S = min(W, K) columns; counts[p] = #tokens visiting p (a device
                   reduction: no host sync); phase 1 exchanges the counts on a side stream
                   while moe_permute over the W + 1 buckets groups the rows by destination
                   (x_sorted [T*S, H], inv [T*S]; the "nowhere" rows park at the end and
                   are never sent); one host sync for the counts; phase 2 moves the first
                   n = sum(counts) rows and their meta (all_to_all_v) -> x_recv [R, H],
                   ids [R, K], weights [R, K]
        experts    the owner runs its local slots of each row (expert_map drops the others,
                   as in (a)) and sums them weighted: one partial row per received token
        combine    all_to_all_v back into [T*S, H] (the "nowhere" rows zeroed), then
                   out[t] = sum_j [table[t, j] < W] * partial[inv[t*S + j]] (moe_unpermute,
                   fp32 in rank order, rounded once)
        bytes per rank: T * E[#ranks a token visits] * H*b each way, <= T * min(W, K) * H*b:
        K / W times fewer than slot rows when every token visits every rank (W <= K).
    "slot" rows: one row per (token, slot), with its local expert id.
        dispatch   dest[t, k] = phys_id // P_l; the same two phases with moe_permute by dest
                   -> x_recv [R, H], local ids [R]
        experts    the owner runs each received row through its one expert, unweighted
                   (top-1 with weight 1) -> y_recv [R, H]
        combine    all_to_all_v back, then the weighted sum at the source:
                   out[t] = sum_k w[t, k] * y[inv[t*K + k]] (moe_unpermute, fp32, rounded once)
        bytes per rank: P * H*b each way (the self share included).
    Rounding: slot rows round once (like the single device); token rows round each rank's
    partial to the dtype before the final sum, exactly as (a) does.

    Two implementations of (b), same results (impl=):
    "fused" (default; sandbox/ep/layout.py, cuda_kernels/cupy/ep_layout.cu): one kernel
        computes the counts, every entry's send position (stable, grouped by destination)
        and the counts vector of phase one; one kernel gathers each token row once into the
        send buffer with its metadata; one kernel combines (out[t] = sum of its sent entries,
        weighted, fp32, rounded once). Per dispatch: 2 launches, the counts exchange on a
        side stream, one host sync, the rows exchange; per combine: the exchange, 1 launch.
        On the GPU it runs through per-shape plans (_GpuFused below; GPU_PLANS).
    "stages": the table and counts as CuPy array ops, moe_permute / moe_unpermute of the
        stage backend (the first version; kept beside it, and the fallback past W = 32).

Both run on NumPy (CPU communicator, reference stages) or CuPy (NCCL, cuda_kernels.cupy
stages): `comm.xp` and the stage backend `ops` decide. bf16 rows move as their uint16
bytes, so no bf16 arithmetic is ever asked of the array library.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .wire import raw, view_as

__all__ = ["SCHEMES", "ALLTOALL_ROWS", "ALLTOALL_IMPLS", "AllGatherState", "AllToAllState",
           "allgather_dispatch", "allgather_combine", "alltoall_dispatch", "alltoall_combine"]

SCHEMES = ("allgather", "alltoall")


def _f32_bits(xp, w):
    """fp32 weights [T, K] as int32 bits (so ids and weights travel in one int32 buffer)."""
    return xp.ascontiguousarray(w.astype(xp.float32, copy=False)).view(xp.int32)


# --------------------------------------------------------------------------------------
# (a) all-gather of tokens, reduce-scatter of outputs
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class AllGatherState:
    counts: np.ndarray        # host int64 [W]: tokens on each rank
    t_max: int                # padded rows per rank in the gathered buffers
    rows: object              # xp int64 [sum T_p] rows of the padded [W*T_max] that are real
                              # (None when every rank has T_max tokens: nothing to compact)
    num_tokens: int           # T on this rank
    dtype: np.dtype


def allgather_dispatch(comm, x, topk_weights, topk_ids):
    """x [T, H], topk_weights [T, K] f32, topk_ids [T, K] int32 (physical ids) ->
    (x_all [sum T_p, H], weights_all [sum T_p, K] f32, ids_all [sum T_p, K] int32, state)."""
    xp = comm.xp
    T, H = x.shape
    K = topk_ids.shape[1]
    counts = comm.all_gather_host(np.array([T], dtype=np.int64)).reshape(-1)     # [W]
    t_max = int(counts.max())
    W = comm.world_size
    xr = raw(x)
    meta = xp.concatenate([topk_ids.astype(xp.int32), _f32_bits(xp, topk_weights)], axis=1)
    if T < t_max:  # pad to the common shape that all_gather needs
        pad_x = xp.zeros((t_max, H), dtype=xr.dtype)
        pad_x[:T] = xr
        pad_m = xp.zeros((t_max, 2 * K), dtype=xp.int32)
        pad_m[:T] = meta
        xr, meta = pad_x, pad_m
    xg = comm.all_gather(xr).reshape(W * t_max, H)                # [W*T_max, H]
    mg = comm.all_gather(meta).reshape(W * t_max, 2 * K)          # [W*T_max, 2K]
    rows = None
    if np.any(counts != t_max):
        host_rows = np.concatenate([p * t_max + np.arange(counts[p]) for p in range(W)])
        rows = xp.asarray(host_rows.astype(np.int64))
        xg, mg = xg[rows], mg[rows]
    ids_all = xp.ascontiguousarray(mg[:, :K])
    weights_all = xp.ascontiguousarray(mg[:, K:]).view(xp.float32)
    state = AllGatherState(counts, t_max, rows, T, np.dtype(x.dtype))
    return view_as(xg, x.dtype), weights_all, ids_all, state


def allgather_combine(comm, partial, state: AllGatherState):
    """partial [sum T_p, H] (this rank's experts' share of every token) -> out [T, H]:
    the sum over ranks of the partials of this rank's tokens (reduce_scatter)."""
    xp = comm.xp
    W, H = comm.world_size, partial.shape[1]
    pr = raw(partial)
    if state.rows is None:
        padded = pr.reshape(W, state.t_max, H)
    else:
        padded = xp.zeros((W * state.t_max, H), dtype=pr.dtype)   # padding rows add 0
        padded[state.rows] = pr
        padded = padded.reshape(W, state.t_max, H)
    out = comm.reduce_scatter(view_as(padded, state.dtype), dtype=state.dtype)  # [T_max, H]
    return out[:state.num_tokens]


# --------------------------------------------------------------------------------------
# (b) all-to-all-v of the routed rows
# --------------------------------------------------------------------------------------
ALLTOALL_ROWS = ("token", "slot")
ALLTOALL_IMPLS = ("fused", "stages")
# "fused": 3 launches and no array-op chain (see the module docstring); measured against
# "stages" by benchmarks/bench_ep.py (--impls fused,stages)
DEFAULT_IMPL = "fused"
# the fused combine in C chunks of tokens: the exchange of chunk c + 1 overlaps the sums of
# chunk c (a side stream on the GPU); 1 = one exchange then one combine kernel
COMBINE_CHUNKS = 1
# the fused path on the GPU through per-shape plans (_GpuFused: checks, kernels, send buffers
# made once, NCCL groups from raw pointers); False = the generic path's launchers and
# communicator calls (kept to compare: benchmarks/bench_ep.py --impls fused,fusedslow)
GPU_PLANS = True
# with GPU_PLANS: the counts exchange is enqueued before the gather's launch (True) or after
# it (False); either way it runs on the side stream beside the gather. First, the GPU gets
# the counts sooner and the host's work after the sync overlaps the gather.
COUNTS_FIRST = True


@dataclasses.dataclass
class AllToAllState:
    rows: str                 # "token" (one row per (token, destination rank)) | "slot"
    send_counts: np.ndarray   # host int64 [W]: rows this rank sent to each rank
    recv_counts: np.ndarray   # host int64 [W]: rows received from each rank
    inv: object               # xp int32 [T*S]: where entry (t, j) sits in the send order
    num_tokens: int
    dtype: np.dtype
    width: int = 0            # S: K (slot rows) or min(W, K) (token rows)
    combine_weights: object = None   # token rows, stages: xp f32 [T, S], 1 where sent
    impl: str = "stages"      # which implementation made it (the combine follows it)
    send_chunks: np.ndarray = None   # fused: host int64 [W, C] rows sent per token chunk
    recv_chunks: np.ndarray = None   # fused: host int64 [W, C] rows received per chunk
    gpu: object = None        # fused on the GPU: the _GpuFused that made it (the combine's
                              # plan), and (so, ro, counts): the send / receive offsets as
                              # Python lists [W + 1] and the per-chunk counts [2][W C]
    offsets: tuple = None


def _rank_counts(xp, dest, W):
    """[T, K] destination ranks -> xp int64 [W] histogram, on the device with no host sync
    (cupy.bincount reads max(x) and any(x < 0) back to the host: two syncs)."""
    ranks = xp.arange(W, dtype=xp.int32)
    return (dest.reshape(-1, 1) == ranks.reshape(1, W)).sum(axis=0).astype(xp.int64)


def _token_table(xp, dest, W):
    """Which ranks each token visits, once each.

    dest [T, K] -> (table int32 [T, S], counts int64 [W]), S = min(W, K): table[t, j] is a
    destination rank of token t, or W ("nowhere": a bucket after every rank, so that
    moe_permute over W + 1 buckets groups the rows by rank and parks the rest at the end);
    the real entries of a row are distinct and in increasing rank order.
    """
    T, K = dest.shape
    ranks = xp.arange(W, dtype=xp.int32)
    # few array ops: each costs ~10 us of launch overhead on the host, before the one sync
    hit = (dest.reshape(T, K, 1) == ranks.reshape(1, 1, W)).any(axis=1)          # [T, W]
    counts = hit.sum(axis=0, dtype=xp.int64)                                     # [W]
    if W <= K:   # column p is rank p or nowhere
        table = xp.where(hit, ranks.reshape(1, W), xp.int32(W))
    else:        # sorted destinations, repeats turned into nowhere
        d = xp.sort(dest, axis=1)
        repeat = xp.concatenate([xp.zeros((T, 1), dtype=bool), d[:, 1:] == d[:, :-1]], axis=1)
        table = xp.where(repeat, xp.int32(W), d)
    return table.astype(xp.int32, copy=False), counts


def alltoall_dispatch(comm, ops, x, topk_ids, experts_per_rank: int, topk_weights=None,
                      rows: str = "token", impl: str | None = None,
                      combine_chunks: int | None = None):
    """Send each rank the rows its experts need.

    x [T, H], topk_ids [T, K] int32 physical ids, topk_weights [T, K] f32.

    rows="token" (default): token t goes once to each rank that holds one of its experts,
        with its K ids and weights (the owner runs its local slots and sums them, weighted,
        as the all-gather scheme does; the combine adds one partial per rank). Rows per rank
        sent: T * E[#distinct ranks of a token] <= T * min(W, K); bytes cut by up to K / W.
        Returns (x_recv [R, H], ids_recv [R, K] int32 physical, weights_recv [R, K] f32,
        state); topk_weights is required.
    rows="slot": one row per (token, slot), with its local expert id (the owner runs it
        unweighted, top-1; the weighted sum happens at the source). Returns (x_recv [R, H],
        local_ids_recv [R] int32, weights_recv [R] f32 or None, state); the weights travel
        only when given (the apply_router_weight_on_input case: the owner applies them).

    Host syncs: exactly one, for the counts (phase one runs on a side stream while the rows
    are gathered). `ops` is the stage backend (moe_permute; impl="stages" only). impl:
    "fused" (default) or "stages" (see the module docstring); the state remembers it.
    combine_chunks (fused only; default COMBINE_CHUNKS): the combine's token chunks.
    """
    if rows not in ALLTOALL_ROWS:
        raise ValueError(f"rows: expected one of {list(ALLTOALL_ROWS)}, got {rows!r}")
    impl = DEFAULT_IMPL if impl is None else impl
    if impl not in ALLTOALL_IMPLS:
        raise ValueError(f"impl: expected one of {list(ALLTOALL_IMPLS)}, got {impl!r}")
    xp = comm.xp
    T, H = x.shape
    W = comm.world_size
    ids = topk_ids if topk_ids.dtype == np.int32 else topk_ids.astype(xp.int32)
    K = ids.shape[1]
    if rows == "token" and topk_weights is None:
        raise ValueError("topk_weights: expected [T, K] weights for rows='token' (the "
                         "owner applies them), got None")
    if impl == "fused":
        from .layout import layout_ops

        lay = layout_ops(comm)
        if lay.supported(W, K, rows == "slot"):
            chunks = COMBINE_CHUNKS if combine_chunks is None else int(combine_chunks)
            if chunks < 1:
                raise ValueError(f"combine_chunks: expected an int >= 1, got {combine_chunks}")
            if not _chunkable(comm, lay):
                chunks = 1
            if GPU_PLANS and xp is not np and hasattr(lay, "DispatchPlan") and \
                    hasattr(comm, "p2p_group"):
                return _gpu_fused(comm, lay, x, ids, experts_per_rank, topk_weights, rows,
                                  chunks).dispatch(x, ids, topk_weights)
            return _alltoall_dispatch_fused(comm, lay, x, ids, experts_per_rank,
                                            topk_weights, rows, chunks)   # same C on every rank
    dest = ids // experts_per_rank                                   # [T, K] owning rank
    if rows == "token":
        if topk_weights is None:
            raise ValueError("topk_weights: expected [T, K] weights for rows='token' (the "
                             "owner applies them), got None")
        table, counts = _token_table(xp, dest, W)                    # [T, S], [W]
        S, buckets = table.shape[1], W + 1
        meta_cols = [ids, _f32_bits(xp, topk_weights)]               # [T, K] each
    else:
        table, counts, S, buckets = dest, _rank_counts(xp, dest, W), K, W
        meta_cols = [(ids % experts_per_rank).reshape(T, K, 1)]
        if topk_weights is not None:
            meta_cols.append(_f32_bits(xp, topk_weights).reshape(T, K, 1))
    # phase one starts first, so that the exchange of the counts (and its host sync)
    # overlaps the row gather below
    pending = comm.counts_phase_async(counts)
    if T == 0:  # nothing to send, but the exchange still runs (peers may send to us)
        x_sorted = view_as(xp.zeros((0, H), dtype=raw(x).dtype), x.dtype)
        inv = xp.zeros(0, dtype=xp.int32)
        meta_sorted = xp.zeros((0, K * len(meta_cols) if rows == "token" else len(meta_cols)),
                               dtype=xp.int32)
    else:
        x_sorted, _, inv = ops.moe_permute(x, table, buckets)        # [T*S, H], _, [T*S]
        # the metadata rows follow the same permutation: entry s = t*S + j belongs to t
        # (token rows: [ids | weight bits] of t; slot rows: slot s's own columns)
        if rows == "token":
            meta = xp.concatenate(meta_cols, axis=1)                 # [T, 2K]
            src = meta[xp.arange(T * S, dtype=xp.int32) // S]        # [T*S, 2K]
        else:
            src = xp.concatenate(meta_cols, axis=2).reshape(T * K, len(meta_cols))
        meta_sorted = xp.empty(src.shape, dtype=xp.int32)
        meta_sorted[inv] = src
    send_counts, recv_counts = pending.wait()
    n = int(send_counts.sum())                # rows past n (token rows: "nowhere") stay
    (x_recv, meta_recv), _ = comm.all_to_all_v([raw(x_sorted)[:n], meta_sorted[:n]],
                                               send_counts, recv_counts=recv_counts)
    combine_w = None
    if rows == "token":
        combine_w = (table < W).astype(xp.float32)                   # [T, S]
        ids_recv = xp.ascontiguousarray(meta_recv[:, :K])
        w_recv = xp.ascontiguousarray(meta_recv[:, K:]).view(xp.float32)
    else:
        ids_recv = xp.ascontiguousarray(meta_recv[:, 0])
        w_recv = None
        if topk_weights is not None:
            w_recv = xp.ascontiguousarray(meta_recv[:, 1]).view(xp.float32)
    state = AllToAllState(rows, send_counts, recv_counts, inv, T, np.dtype(x.dtype), S,
                          combine_w)
    return view_as(x_recv, x.dtype), ids_recv, w_recv, state


def _chunkable(comm, lay):
    """A chunked combine needs NumPy (sequential) or the GPU kernels (a side stream); the
    host fallback of device arrays (the fake CuPy of the CPU tests) combines in one go."""
    return comm.xp is np or getattr(lay, "__name__", "").endswith("ep_layout")


def _alltoall_dispatch_fused(comm, lay, x, ids, experts_per_rank, topk_weights, rows,
                             chunks=1):
    """impl="fused": layout kernel -> counts exchange (side stream) while the gather kernel
    runs -> one host sync -> the rows exchange."""
    xp = comm.xp
    T, H = x.shape
    W, K = comm.world_size, ids.shape[1]
    slot = rows == "slot"
    ids = xp.ascontiguousarray(ids)
    if not x.flags.c_contiguous:   # (bf16 copies go through the uint16 bytes)
        x = view_as(xp.ascontiguousarray(raw(x)), x.dtype)
    counts2, inv, _, n_real = lay.ep_layout(ids, experts_per_rank, W, comm.rank, slot,
                                            chunks)                 # [2, W, C], [T S], .., [1]
    laid_out = None
    if xp is not np:   # the counts are ready here: the exchange need not wait for the gather
        laid_out = xp.cuda.Event(disable_timing=True)
        laid_out.record()
    w32 = None
    if topk_weights is not None:
        w32 = xp.ascontiguousarray(topk_weights.astype(xp.float32, copy=False))   # [T, K]
    # the gather goes first on the GPU (the host's launch work is shorter than the counts
    # exchange's); phase one then runs on a side stream after the layout kernel only, so
    # that the exchange of the counts and its host sync overlap the gather
    x_send, ids_send, w_send = lay.ep_gather(x, ids, w32, inv, n_real, experts_per_rank, slot)
    pending = comm.counts_phase_async(counts2[0], both=counts2, after=laid_out)
    send_counts, recv_counts = pending.wait()
    # rows past n = sum(send_counts) ("nowhere") are never sent; the rows exchange goes
    # straight from the [T S, ...] send buffers at the destinations' offsets
    so = np.concatenate([[0], np.cumsum(send_counts)[:-1]])
    ro = np.concatenate([[0], np.cumsum(recv_counts)[:-1]])
    R = int(recv_counts.sum())
    sends = [raw(x_send), ids_send] + ([w_send] if w_send is not None else [])
    recvs = [xp.empty((R,) + a.shape[1:], dtype=a.dtype) for a in sends]
    comm.exchange_rows(sends, so, send_counts, recvs, ro, recv_counts)
    x_recv, ids_recv = recvs[0], recvs[1]
    w_recv = recvs[2] if w_send is not None else None
    state = AllToAllState(rows, send_counts, recv_counts, inv, T, np.dtype(x.dtype),
                          lay.entries_per_token(W, K, slot), None, "fused",
                          pending.send_chunks, pending.recv_chunks)
    return view_as(x_recv, x.dtype), ids_recv, w_recv, state


# --------------------------------------------------------------------------------------
# the fused path on the GPU, with the host out of the way
# --------------------------------------------------------------------------------------
# Plans kept per communicator (least recently used dropped first): each holds the send
# buffers of its shape (T S rows of H), so a caller with ever-changing T keeps only a few.
MAX_GPU_PLANS = 4


def _gpu_fused(comm, lay, x, ids, epr, w, rows, chunks):
    """The _GpuFused of this call's shape on the current stream (made on first use)."""
    stream = comm.xp.cuda.get_current_stream()
    key = (x.shape, x.dtype, ids.shape, None if w is None else w.shape, epr, rows, chunks,
           stream.ptr)
    plans = comm.__dict__.setdefault("_ep_gpu_plans", {})
    g = plans.pop(key, None)
    if g is None:
        g = _GpuFused(comm, lay, x, ids, epr, w, rows, chunks, stream)
        while len(plans) >= MAX_GPU_PLANS:
            plans.pop(next(iter(plans)))
    plans[key] = g          # re-inserted: the dict's order is the recency order
    return g


def _device_of(a):
    """The device of a CuPy array: its memory pointer's id (ndarray.device builds a Device
    object per call: microseconds on the hot path); the CPU tests' fake has only .device."""
    try:
        return a.data.device_id
    except AttributeError:
        return a.device.id


class _GpuFused:
    """impl="fused" on the GPU for one shape and stream: the same steps as
    _alltoall_dispatch_fused / _alltoall_combine_fused, with every per-shape decision made
    once (argument checks, kernels, launch geometry, send buffers, events, the page-locked
    counts buffer) and the NCCL groups issued from raw pointers (comm.p2p_group).

    Why: after the counts sync the GPU idles until the host has enqueued the rows exchange,
    and at the start of a dispatch until the first launches are in; the measured host time
    of the old path (0.64 ms per dispatch at 4096 tokens, DeepSeek-V3 shape, two H200s) was
    twice its GPU work. Per dispatch now: 2 launches, 1 event, one ncclAllGather of the send
    counts on the side stream and an async copy, one poll, 3 allocations (the results), one
    NCCL group of the rows; per combine: 2 allocations, one NCCL group, 1 launch. Measured
    (two H200s, 4096 tokens, token rows): dispatch + combine 0.869 ms without the plans
    (GPU_PLANS off), 0.686 ms with them, 0.625-0.688 ms with the layout kernel's coalesced
    reads and the counts by all-gather: 0.85-0.88 of two raw all-to-alls of the same bytes.
    """

    def __init__(self, comm, lay, x, ids, epr, w, rows, chunks, stream):
        xp = comm.xp
        T, H = x.shape
        K = ids.shape[1]
        if ids.shape != (T, K):
            raise ValueError(f"topk_ids: expected {T} rows to match x {x.shape}, got {ids.shape}")
        if w is not None and w.shape != (T, K):
            raise ValueError(f"topk_weights: expected shape {(T, K)}, got {w.shape}")
        for name, a in (("x", x), ("topk_ids", ids), ("topk_weights", w)):
            if a is not None:
                comm._contig(a, name)
        self.comm, self.xp, self.stream = comm, xp, stream
        self.rows, self.slot = rows, rows == "slot"
        self.W, self.rank, self.T, self.H, self.K = comm.world_size, comm.rank, T, H, K
        self.dtype = np.dtype(x.dtype)
        self.plan = lay.DispatchPlan(T, H, K, x.dtype, w is not None, epr, self.W, self.rank,
                                     self.slot, chunks)
        self.S, self.C = self.plan.S, chunks
        self.lay = lay
        self.combine_plan = None
        self.laid_out = xp.cuda.Event(disable_timing=True)
        self.counted = xp.cuda.Event(disable_timing=True)
        comm.side_stream()
        from .comm_nccl import cupyx_empty_pinned

        # the counts exchange: every rank's send counts [W, W C] (device and page-locked)
        self.gathered = xp.empty((self.W, self.W * chunks), dtype=xp.int64)
        self.pinned_all = cupyx_empty_pinned((self.W, self.W * chunks), np.int64)
        self.pinned_all_ptr = self.pinned_all.ctypes.data
        self.send_counts_dev = self.plan.counts2[0].reshape(self.W * chunks)   # a view, once
        p = self.plan
        # (send buffer, row bytes, the received array's row shape and dtype)
        meta = p.ids_send.shape[1:]                      # () slot rows, (K,) token rows
        meta_bytes = 4 * int(np.prod(meta, dtype=np.int64))
        self.bufs = [(p.x_send, p.row_bytes, (H,), x.dtype),
                     (p.ids_send, meta_bytes, meta, np.int32)]
        if p.w_send is not None:
            self.bufs.append((p.w_send, meta_bytes, meta, np.float32))
        self.send_ptrs = [(b.data.ptr, rb) for b, rb, _, _ in self.bufs]

    def dispatch(self, x, ids, w):
        comm, xp, W = self.comm, self.xp, self.W
        dev = comm.device
        if _device_of(x) != dev or _device_of(ids) != dev or \
                (w is not None and _device_of(w) != dev):
            for name, a in (("x", x), ("topk_ids", ids), ("topk_weights", w)):
                if a is not None:
                    comm._contig(a, name)            # raises, naming the array
        if not (x.flags.c_contiguous and ids.flags.c_contiguous):
            x = view_as(xp.ascontiguousarray(raw(x)), x.dtype)
            ids = xp.ascontiguousarray(ids)
        if w is not None and (w.dtype != np.float32 or not w.flags.c_contiguous):
            w = xp.ascontiguousarray(w.astype(xp.float32, copy=False))
        plan, stream = self.plan, self.stream
        inv = plan.layout(ids)                                          # [T S]
        # the counts are ready here: their exchange waits for the layout only, and runs on
        # the high-priority side stream beside the gather
        self.laid_out.record(stream)
        if not COUNTS_FIRST:
            plan.gather(x, ids, w, inv)
        comm.counts_gather_start(self.send_counts_dev, self.gathered, self.pinned_all,
                                 self.laid_out, self.counted, self.pinned_all_ptr)
        if COUNTS_FIRST:   # the gather's launch then overlaps the exchange of the counts
            plan.gather(x, ids, w, inv)
        comm.wait_done(self.counted, "all_to_all_v (counts)")
        # the one host sync: seen complete, the counts exchange is ordered before anything
        # enqueued from here on (the rows exchange below, the next call's layout)
        C, r = self.C, self.rank
        # row p = what rank p sends: I send row r and receive column block r
        g = self.pinned_all.tolist()                                    # [W][W C]
        c = [g[r], [v for p in range(W) for v in g[p][r * C:(r + 1) * C]]]   # [2][W C]
        if C == 1:
            sc, rc = c[0], c[1]
        else:
            sc = [sum(c[0][p * C:(p + 1) * C]) for p in range(W)]
            rc = [sum(c[1][p * C:(p + 1) * C]) for p in range(W)]
        so, ro = [0] * (W + 1), [0] * (W + 1)
        for p in range(W):
            so[p + 1], ro[p + 1] = so[p] + sc[p], ro[p] + rc[p]
        R = ro[W]
        recvs = [xp.empty((R,) + shape, dtype=dt) for _, _, shape, dt in self.bufs]
        # my own rows travel inside the group too: NCCL copies them concurrently with the
        # peers' (measured: the exchange with them 236 us, without 232 us, at 4096 tokens)
        bufs = [(sptr, o.data.ptr, rb) for (sptr, rb), o in zip(self.send_ptrs, recvs)]
        transfers = []
        for p in range(W):
            s, n_s, o, n_r = so[p], sc[p], ro[p], rc[p]
            for sptr, rptr, rb in bufs:
                if n_s:
                    transfers.append((True, sptr + s * rb, n_s * rb, p))
                if n_r:
                    transfers.append((False, rptr + o * rb, n_r * rb, p))
        comm.p2p_group("all_to_all_v", transfers, stream.ptr)
        send_chunks = recv_chunks = None
        if C > 1:
            send_chunks = np.array(c[0], dtype=np.int64).reshape(W, C)
            recv_chunks = np.array(c[1], dtype=np.int64).reshape(W, C)
        state = AllToAllState(self.rows, np.array(sc, dtype=np.int64),
                              np.array(rc, dtype=np.int64), inv, self.T, self.dtype, self.S,
                              None, "fused", send_chunks, recv_chunks, self, (so, ro, c))
        w_recv = recvs[2] if len(recvs) > 2 else None
        return recvs[0], recvs[1], w_recv, state

    def combine(self, y, state, weights):
        """y [R, H] (rows as received) -> out [T, H]; weights f32 [T, K] for slot rows."""
        comm, xp, W = self.comm, self.xp, self.W
        so, ro, counts = state.offsets
        R, n, H, T = ro[W], so[W], self.H, self.T
        if y.shape != (R, H):
            raise ValueError(f"y_recv: expected shape {(R, H)} (the rows received), got "
                             f"{y.shape}")
        if _device_of(y) != comm.device:
            comm._contig(y, "y_recv")
        if not y.flags.c_contiguous:
            y = view_as(xp.ascontiguousarray(raw(y)), y.dtype)
        if self.slot:
            if weights is None:
                raise ValueError("topk_weights: expected [T, K] weights to combine slot rows, "
                                 "got None")
            if weights.shape != (T, self.K):
                raise ValueError(f"topk_weights: expected shape {(T, self.K)}, got "
                                 f"{weights.shape}")
            if weights.dtype != np.float32 or not weights.flags.c_contiguous:
                weights = xp.ascontiguousarray(weights.astype(xp.float32, copy=False))
        else:
            weights = None
        back = xp.empty((n, H), dtype=y.dtype)                         # [n, H] send order
        rb = H * np.dtype(y.dtype).itemsize
        yp, bp = y.data.ptr, back.data.ptr
        if self.combine_plan is None:
            self.combine_plan = self.lay.CombinePlan(T, self.S, H, y.dtype)
            self.landed = [xp.cuda.Event(disable_timing=True) for _ in range(self.C)]
            self.summed = xp.cuda.Event(disable_timing=True)
        out = xp.empty((T, H), dtype=y.dtype)                          # [T, H]
        C, main = self.C, self.stream
        if C == 1:
            transfers = []
            for p in range(W):
                rc, sc = ro[p + 1] - ro[p], so[p + 1] - so[p]
                if rc:
                    transfers.append((True, yp + ro[p] * rb, rc * rb, p))
                if sc:
                    transfers.append((False, bp + so[p] * rb, sc * rb, p))
            comm.p2p_group("all_to_all_v", transfers, main.ptr)
            return self.combine_plan(back, weights, state.inv, n, out)
        # C token chunks: the exchanges back to back on the stream, the sums of chunk c on
        # the side stream once chunk c has landed (overlapping the exchange of chunk c + 1).
        # Chunk c of my tokens comes back from rank p at my send positions: inside p's block
        # the rows are in token order, so chunk c is the run after the earlier chunks'; I
        # return each peer's chunk c out of the rows it sent me, likewise.
        from .layout import chunk_bounds

        side = comm.side_stream()
        bounds = chunk_bounds(T, C)
        s_at, r_at = list(so[:W]), list(ro[:W])                        # running offsets
        for ch in range(C):
            transfers = []
            for p in range(W):
                rc, sc = counts[1][p * C + ch], counts[0][p * C + ch]
                if rc:
                    transfers.append((True, yp + r_at[p] * rb, rc * rb, p))
                if sc:
                    transfers.append((False, bp + s_at[p] * rb, sc * rb, p))
                s_at[p] += sc
                r_at[p] += rc
            comm.p2p_group("all_to_all_v", transfers, main.ptr)
            self.landed[ch].record(main)
            side.wait_event(self.landed[ch])
            with side:
                self.combine_plan(back, weights, state.inv, n, out, bounds[ch], bounds[ch + 1])
        self.summed.record(side)
        # back, out and weights belong to the main stream: once it waits for the side
        # stream, any reuse of their memory (after they are freed) is ordered after the sums
        main.wait_event(self.summed)
        return out


def _alltoall_combine_fused(comm, y_recv, state: AllToAllState, topk_weights):
    from .layout import layout_ops

    from .layout import chunk_bounds

    xp = comm.xp
    g = state.gpu
    if g is not None and xp.cuda.get_current_stream().ptr == g.stream.ptr \
            and np.dtype(y_recv.dtype) == state.dtype:
        return g.combine(y_recv, state, topk_weights)
    H = y_recv.shape[1]
    yr = raw(y_recv)
    T = state.num_tokens
    n = int(state.send_counts.sum())
    weights = None
    if state.rows == "slot":
        if topk_weights is None:
            raise ValueError("topk_weights: expected [T, K] weights to combine slot rows, "
                             "got None")
        weights = xp.ascontiguousarray(topk_weights.astype(xp.float32, copy=False))
    lay = layout_ops(comm)
    back = xp.empty((n, H), dtype=yr.dtype)                          # [n, H] send order
    sc = state.send_chunks
    C = 1 if sc is None else sc.shape[1]
    if C == 1:
        comm.all_to_all_v(yr, state.recv_counts, recv_counts=state.send_counts, outs=back)
        return lay.ep_combine(view_as(back, state.dtype), weights, state.inv, n, T)
    # chunk c: every rank returns the rows of my tokens [b_c, b_c+1) (at my send positions:
    # inside the block of destination p they come in token order, so chunk c is the run
    # after the earlier chunks'), and I return each peer's chunk c out of the rows it sent
    rc = state.recv_chunks
    W = comm.world_size
    so = np.concatenate([[0], np.cumsum(state.send_counts)])[:W]           # my blocks
    ro = np.concatenate([[0], np.cumsum(state.recv_counts)])[:W]           # peers' blocks
    so_c = so[:, None] + np.cumsum(sc, axis=1) - sc                         # [W, C]
    ro_c = ro[:, None] + np.cumsum(rc, axis=1) - rc                         # [W, C]
    bounds = chunk_bounds(T, C)
    out = view_as(xp.empty((T, H), dtype=yr.dtype), state.dtype)           # [T, H]
    y_back = view_as(back, state.dtype)
    if xp is np:    # the CPU: one chunk after the other
        for c in range(C):
            comm.exchange_rows(yr, ro_c[:, c], rc[:, c], back, so_c[:, c], sc[:, c])
            lay.ep_combine(y_back, weights, state.inv, n, T, (bounds[c], bounds[c + 1]), out)
        return out
    # the GPU: exchanges on the current stream, back to back; the sums of chunk c on a side
    # stream once chunk c has landed, overlapping the exchange of chunk c + 1
    main = xp.cuda.get_current_stream()
    side = _side_stream(comm)
    for c in range(C):
        comm.exchange_rows(yr, ro_c[:, c], rc[:, c], back, so_c[:, c], sc[:, c])
        landed = xp.cuda.Event(disable_timing=True)
        landed.record(main)
        side.wait_event(landed)
        with side:
            lay.ep_combine(y_back, weights, state.inv, n, T, (bounds[c], bounds[c + 1]), out)
    summed = xp.cuda.Event(disable_timing=True)
    summed.record(side)
    # back, out and weights were allocated on the main stream: once it waits for the side
    # stream, any reuse of their memory (after they are freed) is ordered after the sums
    main.wait_event(summed)
    return out


def _side_stream(comm):
    side = getattr(comm, "_ep_combine_stream", None)
    if side is None:
        side = comm._ep_combine_stream = comm.xp.cuda.Stream(non_blocking=True)
    return side


def alltoall_combine(comm, ops, y_recv, state: AllToAllState, topk_weights=None):
    """y_recv [R, H] (rows in received order) -> out [T, H] on the source rank.

    token rows: y_recv holds each received token's weighted partial sum over the owner's
        slots; out[t] = sum over the ranks t visited of their partials (fp32, rank order,
        rounded once; moe_unpermute with weights 1 and 0 for "nowhere").
    slot rows: y_recv holds unweighted expert rows; out[t] = sum_k topk_weights[t, k] *
        y[slot t*K+k] (fp32, rounded once; moe_unpermute)."""
    if state.impl == "fused":
        return _alltoall_combine_fused(comm, y_recv, state, topk_weights)
    xp = comm.xp
    H = y_recv.shape[1]
    yr = raw(y_recv)
    n = int(state.send_counts.sum())
    rows_total = state.num_tokens * state.width
    back = xp.empty((rows_total, H), dtype=yr.dtype)                 # [T*S, H] send order
    if n < rows_total:  # the "nowhere" rows: weight 0, and 0 * garbage could be NaN
        back[n:] = 0
    comm.all_to_all_v(yr, state.recv_counts, recv_counts=state.send_counts, outs=back[:n])
    if state.num_tokens == 0:  # no tokens here: nothing to combine (and no empty launches)
        return view_as(xp.zeros((0, H), dtype=yr.dtype), state.dtype)
    weights = state.combine_weights if state.rows == "token" else topk_weights
    if weights is None:
        raise ValueError("topk_weights: expected [T, K] weights to combine slot rows, got None")
    return ops.moe_unpermute(view_as(back, state.dtype), weights, state.inv)
