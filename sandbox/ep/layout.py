"""The all-to-all-v layout of the fused dispatch path, in NumPy: the twins of
cuda_kernels/cupy/ep_layout.py (same names, same signatures, same results), and the choice
between them for a communicator.

    T tokens, K top-k, W ranks, epr experts per rank, S entries per token (token rows:
    min(W, K), one per distinct destination rank; slot rows: K), e = t * S + j an entry,
    b(e) its bucket (a destination rank, or W = "nowhere"), n = #{e : b(e) < W}

    ep_layout   counts2 int64 [2, W, C] ([0, p, c] = rows sent to rank p from token chunk c,
                [1, rank] = [0, rank], the rest 0),
                inv int32 [T S] (the entry's position in the send order: grouped by bucket,
                increasing e inside one), src int32 [T S] (position -> entry), n_real
                int32 [1]
    ep_gather   x_send [T S, H] (x_send[inv[e]] = x[e // S] for the sent entries), ids_send
                (token rows: [T S, K] the token's physical ids; slot rows: [T S] the slot's
                local id ids % epr), w_send (same shape, f32) or None
    ep_combine  out[t] = sum_{j : inv[t S + j] < n} weights[t, j] * y[inv[t S + j]] (fp32 in
                j order, rounded once; weights None: 1)
    ep_count_experts  counts[e] += #{ids == e}

`layout_ops(comm)` returns the namespace the dispatch uses: this module for NumPy arrays,
cuda_kernels.cupy.ep_layout on a real GPU, and for device arrays without the kernels (the
fake CuPy of the CPU tests) these NumPy functions run on the host around each call.
"""
from __future__ import annotations

import types

import numpy as np

from .wire import to_comm, to_host

__all__ = ["entries_per_token", "supported", "chunk_bounds", "ep_layout", "ep_gather", "ep_combine",
           "ep_count_experts", "layout_ops"]

MAX_WORLD = 32
MAX_S = 32


def entries_per_token(world_size: int, top_k: int, slot_rows: bool) -> int:
    """S: K for slot rows, min(W, K) for token rows."""
    return int(top_k) if slot_rows else min(int(world_size), int(top_k))


def supported(world_size: int, top_k: int, slot_rows: bool) -> bool:
    """Whether the fused path takes the shape (the GPU kernels' limits, kept here too so that
    the CPU runs the same path as the GPU)."""
    return 1 <= world_size <= MAX_WORLD and 1 <= top_k and \
        entries_per_token(world_size, top_k, slot_rows) <= MAX_S


def _buckets(ids, epr, W, slot_rows):
    """[T, K] physical ids -> [T, S] buckets (destination rank or W)."""
    T, K = ids.shape
    ids = ids.astype(np.int64)
    valid = (ids >= 0) & (ids < W * epr)
    dest = np.where(valid, ids // epr, W)                               # [T, K]
    if slot_rows:
        return dest
    S = entries_per_token(W, K, slot_rows)
    hit = np.zeros((T, W + 1), dtype=bool)                              # [T, W + 1]
    hit[np.arange(T)[:, None], dest] = True
    hit = hit[:, :W]
    # the j-th destination of t = the j-th rank with hit, in increasing order; then W
    order = np.argsort(~hit, axis=1, kind="stable")[:, :S]              # hit ranks first
    ranks_sorted = np.where(np.take_along_axis(hit, order, axis=1), order, W)
    return ranks_sorted


def chunk_bounds(num_tokens: int, chunks: int) -> list[int]:
    """Token chunk c = [bounds[c], bounds[c + 1]), bounds[c] = ceil(c T / C) (token t is in
    chunk floor(t C / T), the layout kernel's rule)."""
    T, C = int(num_tokens), int(chunks)
    return [(c * T + C - 1) // C for c in range(C + 1)]


def ep_layout(topk_ids, experts_per_rank, world_size, rank, slot_rows, chunks=1):
    """See the module docstring. NumPy: a stable sort of the entries by bucket.
    counts2 [2, W, chunks]: per chunk of tokens (chunk_bounds)."""
    ids = np.asarray(topk_ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise TypeError(f"topk_ids: expected an integer [T, K] array, got {ids.dtype} "
                        f"shape {ids.shape}")
    W, epr, r = int(world_size), int(experts_per_rank), int(rank)
    b = _buckets(ids, epr, W, slot_rows).reshape(-1)                   # [T S]
    order = np.argsort(b, kind="stable")                                # position -> entry
    inv = np.empty(b.size, dtype=np.int32)
    inv[order] = np.arange(b.size, dtype=np.int32)
    counts = np.bincount(b, minlength=W + 1)[:W].astype(np.int64)
    C = int(chunks)
    T = ids.shape[0]
    S = b.size // T if T else 1
    tok_chunk = (np.arange(b.size) // S) * C // max(T, 1)               # [T S] chunk of e
    counts2 = np.zeros((2, W, C), dtype=np.int64)
    sent = b < W
    np.add.at(counts2[0], (b[sent], tok_chunk[sent]), 1)
    counts2[1, r] = counts2[0, r]
    return counts2, inv, order.astype(np.int32), np.array([counts.sum()], dtype=np.int32)


def ep_gather(x, topk_ids, topk_weights, inv, n_real, experts_per_rank, slot_rows):
    """x_send [T S, H] and the metadata, rows >= n left as zeros (never sent)."""
    T, H = x.shape
    K = topk_ids.shape[1]
    P = inv.shape[0]
    S = P // T if T else 1
    n = int(np.asarray(n_real).reshape(-1)[0])
    src = np.empty(P, dtype=np.int64)
    src[inv] = np.arange(P)
    src = src[:n]                                                       # [n] sent entries
    x_send = np.zeros((P, H), dtype=x.dtype)
    x_send[:n] = x[src // S] if n else x_send[:0]
    if slot_rows:
        ids_send = np.zeros(P, dtype=np.int32)
        ids_send[:n] = topk_ids.reshape(-1)[src] % experts_per_rank
        w_send = None
        if topk_weights is not None:
            w_send = np.zeros(P, dtype=np.float32)
            w_send[:n] = topk_weights.reshape(-1)[src]
    else:
        ids_send = np.zeros((P, K), dtype=np.int32)
        ids_send[:n] = topk_ids[src // S]
        w_send = None
        if topk_weights is not None:
            w_send = np.zeros((P, K), dtype=np.float32)
            w_send[:n] = topk_weights[src // S]
    return x_send, ids_send, w_send


def ep_combine(y, weights, inv, n, num_tokens, token_range=None, out=None):
    """out [T, H] = sum_j [inv < n] weights * y[inv], fp32 in j order, rounded once; only the
    rows token_range = (t0, t1) when given (into `out` when given)."""
    T = int(num_tokens)
    n = int(n)
    P = inv.shape[0]
    S = P // T if T else 0
    H = y.shape[1]
    t0, t1 = (0, T) if token_range is None else (int(token_range[0]), int(token_range[1]))
    if out is None:
        out = np.zeros((T, H), dtype=y.dtype)
    acc = np.zeros((t1 - t0, H), dtype=np.float32)
    inv2 = np.asarray(inv).reshape(T, S)[t0:t1]
    for j in range(S):
        pos = inv2[:, j]
        sent = pos < n
        rows = np.zeros((t1 - t0, H), dtype=np.float32)
        rows[sent] = y[pos[sent]].astype(np.float32)
        if weights is not None:
            rows *= np.asarray(weights, dtype=np.float32)[t0:t1, j:j + 1]
        acc += rows
    out[t0:t1] = acc.astype(y.dtype)
    return out


def ep_count_experts(topk_ids, counts):
    """counts[e] += #{topk_ids == e}, e in [0, E); in place."""
    E = counts.shape[0]
    ids = np.asarray(topk_ids).reshape(-1).astype(np.int64)
    ids = ids[(ids >= 0) & (ids < E)]
    counts += np.bincount(ids, minlength=E)[:E].astype(counts.dtype)
    return counts


_KERNELS = []


def _gpu_kernels():
    """cuda_kernels.cupy.ep_layout when it can launch here, else None (decided once)."""
    if not _KERNELS:
        _KERNELS.append(_find_gpu_kernels())
    return _KERNELS[0]


def _find_gpu_kernels():
    try:
        from cuda_kernels.cupy import availability

        ok, _ = availability()
        if not ok:
            return None
        import cuda_kernels.cupy.ep_layout as kern

        return kern
    except Exception:
        return None


def _on_host(comm):
    """These NumPy functions for device arrays: to the host and back around each call."""
    def wrap(fn):
        def call(*args, **kwargs):
            if kwargs.get("out") is not None:    # results come back as a new array
                raise ValueError("out: the host fallback returns new arrays, got out=")
            return to_comm(comm, fn(*[to_host(comm, a) for a in args], **kwargs))
        return call

    def count(topk_ids, counts):
        host = ep_count_experts(to_host(comm, topk_ids), to_host(comm, counts).copy())
        counts[...] = comm.xp.asarray(host)
        return counts

    return types.SimpleNamespace(
        name="numpy (host)", entries_per_token=entries_per_token, supported=supported,
        ep_layout=wrap(ep_layout), ep_gather=wrap(ep_gather), ep_combine=wrap(ep_combine),
        ep_count_experts=count)


_NUMPY = types.SimpleNamespace(
    name="numpy", entries_per_token=entries_per_token, supported=supported,
    ep_layout=ep_layout, ep_gather=ep_gather, ep_combine=ep_combine,
    ep_count_experts=ep_count_experts)


def layout_ops(comm_or_xp):
    """The layout functions for a communicator's arrays (or an array module)."""
    xp = getattr(comm_or_xp, "xp", comm_or_xp)
    if xp is np:
        return _NUMPY
    kern = _gpu_kernels()
    if kern is not None:
        return kern
    comm = comm_or_xp if hasattr(comm_or_xp, "to_host") else None
    if comm is None:
        raise TypeError("layout_ops: device arrays without the CUDA kernels need a "
                        "communicator (to_host), got an array module")
    return _on_host(comm)
