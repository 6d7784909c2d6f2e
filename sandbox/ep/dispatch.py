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

(b) "alltoall" (MegaBlocks / DeepEP's shape): only the routed (token, slot) rows move.
        dispatch   dest[t, k] = phys_id // P_l; phase 1 exchanges the W counts (a
                   histogram of dest), overlapped with moe_permute by dest, which groups
                   the P slot rows by destination rank (x_sorted [P, H], inv [P]); phase 2
                   moves the rows and their local expert ids (all_to_all_v)
                   -> x_recv [R, H], local ids [R]
        experts    the owner runs each received row through its one expert, unweighted
                   (top-1 with weight 1) -> y_recv [R, H]
        combine    all_to_all_v back (the counts are known: the reverse of phase 1), then
                   the weighted sum at the source: moe_unpermute(y, topk_weights, inv),
                   out[t] = sum_k w[t, k] * y[inv[t*K + k]] (fp32, rounded once)
    bytes per rank: about P * H*b * (W-1)/W each way (uniform routing).

Both run on NumPy (CPU communicator, reference stages) or CuPy (NCCL, cuda_kernels.cupy
stages): `comm.xp` and the stage backend `ops` decide. bf16 rows move as their uint16
bytes, so no bf16 arithmetic is ever asked of the array library.
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

__all__ = ["SCHEMES", "AllGatherState", "AllToAllState", "allgather_dispatch",
           "allgather_combine", "alltoall_dispatch", "alltoall_combine", "raw", "view_as"]

SCHEMES = ("allgather", "alltoall")
BF16 = np.dtype(ml_dtypes.bfloat16)


def raw(x):
    """bf16 as its uint16 bytes (copies, gathers and sends need no bf16 arithmetic)."""
    return x.view(np.uint16) if np.dtype(x.dtype) == BF16 else x


def view_as(x, dtype):
    """The bytes of `x` as `dtype` (undoes `raw`). A CuPy without bf16 keeps uint16."""
    dtype = np.dtype(dtype)
    if np.dtype(x.dtype) == dtype:
        return x
    try:
        return x.view(dtype)
    except Exception:
        return x


def _f32_bits(xp, w):
    """fp32 weights [T, K] as int32 bits (so ids and weights travel in one int32 buffer)."""
    return xp.ascontiguousarray(w.astype(xp.float32)).view(xp.int32)


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
@dataclasses.dataclass
class AllToAllState:
    send_counts: np.ndarray   # host int64 [W]: slot rows this rank sent to each rank
    recv_counts: np.ndarray   # host int64 [W]: rows received from each rank
    inv: object               # xp int32 [P]: where slot s sits in the sorted send order
    num_tokens: int
    dtype: np.dtype


def alltoall_dispatch(comm, ops, x, topk_ids, experts_per_rank: int, topk_weights=None):
    """x [T, H], topk_ids [T, K] int32 physical ids ->
    (x_recv [R, H], local_ids_recv [R] int32, weights_recv [R] f32 or None, state).

    `ops` is the stage backend (moe_permute). `topk_weights` travel only when given (the
    apply_router_weight_on_input case: the owner applies them inside GEMM1)."""
    xp = comm.xp
    T, H = x.shape
    W = comm.world_size
    ids = topk_ids.astype(xp.int32)
    dest = ids // experts_per_rank                                   # [T, K] owning rank
    # phase one starts first, from a histogram of the destinations, so that the exchange of
    # the counts (and its host sync) overlaps the row gather below
    counts = xp.bincount(dest.reshape(-1), minlength=W)[:W] if T else xp.zeros(W, xp.int64)
    pending = comm.counts_phase_async(counts)
    if T == 0:  # nothing to send, but the exchange still runs (peers may send to us)
        x_sorted = view_as(xp.zeros((0, H), dtype=raw(x).dtype), x.dtype)
        inv = xp.zeros(0, dtype=xp.int32)
    else:
        x_sorted, _, inv = ops.moe_permute(x, dest, W)               # [P, H], [W+1], [P]
    inv = inv.astype(xp.int64)
    local = (ids % experts_per_rank).reshape(-1)                     # [P]
    meta_cols = [local]
    if topk_weights is not None:
        meta_cols.append(_f32_bits(xp, topk_weights).reshape(-1))
    meta = xp.empty((local.size, len(meta_cols)), dtype=xp.int32)   # [P, 1 or 2]
    for c, col in enumerate(meta_cols):
        meta[inv, c] = col                                           # same order as x_sorted
    send_counts, recv_counts = pending.wait()
    (x_recv, meta_recv), _ = comm.all_to_all_v([raw(x_sorted), meta], send_counts,
                                               recv_counts=recv_counts)
    weights_recv = None
    if topk_weights is not None:
        weights_recv = xp.ascontiguousarray(meta_recv[:, 1]).view(xp.float32)
    state = AllToAllState(send_counts, recv_counts, inv.astype(xp.int32), T, np.dtype(x.dtype))
    return view_as(x_recv, x.dtype), xp.ascontiguousarray(meta_recv[:, 0]), weights_recv, state


def alltoall_combine(comm, ops, y_recv, state: AllToAllState, topk_weights):
    """y_recv [R, H] (expert outputs in received order) -> out [T, H] =
    sum_k topk_weights[t, k] * y[slot t*K+k] at the source (moe_unpermute)."""
    y_back, _ = comm.all_to_all_v(raw(y_recv), state.recv_counts,
                                  recv_counts=state.send_counts)     # [P, H] sorted order
    y_back = view_as(y_back, state.dtype)
    if state.num_tokens == 0:  # no tokens here: nothing to combine (and no empty launches)
        return view_as(comm.xp.zeros((0, y_recv.shape[1]), dtype=raw(y_back).dtype),
                       state.dtype)
    return ops.moe_unpermute(y_back, topk_weights, state.inv)
