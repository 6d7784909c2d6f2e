"""The communicator interface every expert-parallel backend implements.

    W = world size (ranks), r = this rank, p = a peer

Primitives (each backend): `send(x, p)` / `recv(x, p)` (recv fills `x` in place; inside
`group_start()` ... `group_end()` they run concurrently, as NCCL's grouped p2p does),
`synchronize()`, `abort()`, `destroy()`.

Collectives (defaults here are built from the primitives; NCCL overrides the first three
with its native kernels):

    all_gather(x [*s])            -> [W, *s]    out[p] = x on rank p
    reduce_scatter(x [W, *s])     -> [*s]       out = sum_p x_p[r]   (fp32 accumulation)
    all_reduce(x [*s])            -> [*s]       out = sum_p x_p       (same on every rank)
    exchange_counts(c [W])        -> [W]        out[p] = c_p[r]       (host int64)
    all_to_all_v(a [N, ...], c)   -> [M, ...]   rows a[off[p]:off[p]+c[p]] go to rank p;
                                                 received rows are grouped by source rank
    barrier()

`all_to_all_v` is the two-phase variable-split exchange: counts first (every rank learns
how many rows each peer sends it, so it can size its receive buffer), then the rows, as one
group of point-to-point sends and receives (NCCL has no variable-split all-to-all).

`agree(name, payload)` compares a JSON payload (a layer config) across ranks through the
rendezvous store, *before* any collective, and raises ConfigMismatchError naming the
fields and ranks that differ: mismatched ranks would otherwise exchange wrong-sized buffers
and hang or corrupt silently.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections import Counter

import numpy as np

from .errors import (CommPeerError, CommTimeoutError, CommUsageError, ConfigMismatchError,
                     StoreTimeoutError)
from .wire import raw, view_as

__all__ = ["Communicator", "split_offsets"]


def split_offsets(counts) -> np.ndarray:
    """[W] counts -> [W + 1] int64 offsets (exclusive prefix sum)."""
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _accumulator(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.kind in "iub":
        return np.dtype(np.int64)
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


class _DeferredCounts:
    """Phase one at wait(). With `both` [2, W, C] (per-chunk counts, the fused layout's),
    one exchange per chunk column; `send_chunks` / `recv_chunks` [W, C] are kept."""

    def __init__(self, comm, counts, both=None):
        self.comm, self.counts, self.both = comm, counts, both

    def wait(self):
        both = self.both
        if both is not None and both.ndim == 3:
            send_chunks = np.asarray(self.comm.to_host(both[0]), dtype=np.int64)   # [W, C]
            recv_chunks = np.stack([self.comm.exchange_counts(send_chunks[:, c])
                                    for c in range(send_chunks.shape[1])], axis=1)
            self.send_chunks, self.recv_chunks = send_chunks, recv_chunks
            return send_chunks.sum(axis=1), recv_chunks.sum(axis=1)
        send, recv = self.comm.counts_phase(self.counts)
        self.send_chunks, self.recv_chunks = send[:, None], recv[:, None]
        return send, recv


class Communicator:
    """Base class: rank bookkeeping, the store, and collectives over send/recv."""

    backend = "abstract"

    def __init__(self, rank: int, world_size: int, store=None, timeout: float = 60.0,
                 namespace: str = "comm0"):
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.store = store
        self.timeout = float(timeout)
        self._ns = namespace
        self._agree_seq: Counter = Counter()
        self._in_group = False
        self._what = None  # the collective in progress, for error messages

    @contextlib.contextmanager
    def _op(self, name):
        outer = self._what
        self._what = name if outer is None else outer
        try:
            yield
        finally:
            self._what = outer

    # ---- the array module of this communicator's buffers (numpy or cupy) -------------
    @property
    def xp(self):
        return np

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x)

    # ---- primitives: a backend implements these --------------------------------------
    def send(self, x, peer: int) -> None:
        raise NotImplementedError

    def recv(self, x, peer: int) -> None:
        raise NotImplementedError

    def group_start(self) -> None:
        raise NotImplementedError

    def group_end(self) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait (with the timeout) until every exchange issued so far has completed."""

    def abort(self) -> None:
        raise NotImplementedError

    def destroy(self) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def group(self):
        self.group_start()
        try:
            yield
        finally:
            self.group_end()

    def _check_group(self, opening: bool):
        """A group opens only outside one and closes only inside one (group_start /
        group_end of every communicator, before they touch their transport)."""
        if opening and self._in_group:
            raise CommUsageError(f"rank {self.rank}: group_start inside a group")
        if not opening and not self._in_group:
            raise CommUsageError(f"rank {self.rank}: group_end without group_start")

    def _check_peer(self, peer: int, what: str) -> int:
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
            raise TypeError(f"peer: expected an int rank for {what}, got {type(peer).__name__}")
        if not 0 <= peer < self.world_size:
            raise ValueError(f"peer: expected a rank in [0, {self.world_size}) for {what}, "
                             f"got {peer}")
        return int(peer)

    # ---- collectives over send/recv ---------------------------------------------------
    def all_gather(self, x):
        """[*s] -> [W, *s]: out[p] is rank p's x (every rank passes the same shape)."""
        xp = self.xp
        xr = xp.ascontiguousarray(raw(x))
        out = xp.empty((self.world_size,) + xr.shape, dtype=xr.dtype)
        out[self.rank] = xr
        with self._op("all_gather"), self.group():
            for p in range(self.world_size):
                if p != self.rank:
                    self.send(xr, p)
                    self.recv(out[p], p)
        return view_as(out, x.dtype)

    def all_gather_host(self, a) -> np.ndarray:
        """A small host array gathered from every rank: [*s] -> host [W, *s]."""
        a = np.ascontiguousarray(a)
        return np.asarray(self.to_host(self.all_gather(self.xp.asarray(a))))

    def reduce_scatter(self, x, dtype=None):
        """[W, *s] -> [*s]: out = sum over ranks p of x_p[r], accumulated in fp32 (fp64 for
        fp64, int64 for ints) in rank order, rounded once to x's dtype. `dtype` names the
        element type when x is a byte view (bf16 as uint16)."""
        xp = self.xp
        x = xp.ascontiguousarray(x if dtype is None else view_as(x, dtype))
        if x.ndim < 1 or x.shape[0] != self.world_size:
            raise ValueError(f"x: expected shape ({self.world_size}, ...) for reduce_scatter, "
                             f"got {x.shape}")
        parts = xp.empty_like(x)
        parts[self.rank] = x[self.rank]
        with self._op("reduce_scatter"), self.group():
            for p in range(self.world_size):
                if p != self.rank:
                    self.send(x[p], p)
                    self.recv(parts[p], p)
        acc_dtype = _accumulator(x.dtype)
        acc = parts[0].astype(acc_dtype)
        for p in range(1, self.world_size):
            acc += parts[p].astype(acc_dtype)
        return acc.astype(x.dtype)

    def all_reduce(self, x, dtype=None):
        """[*s] -> [*s]: the sum over ranks, identical on every rank (rank-order fp32 sum)."""
        x = x if dtype is None else view_as(x, dtype)
        with self._op("all_reduce"):
            gathered = self.all_gather(x)
        acc_dtype = _accumulator(gathered.dtype)
        acc = gathered[0].astype(acc_dtype)
        for p in range(1, self.world_size):
            acc += gathered[p].astype(acc_dtype)
        return acc.astype(gathered.dtype)

    def exchange_counts(self, send_counts) -> np.ndarray:
        """Phase one of all_to_all_v: send_counts[p] rows go to p; returns recv_counts[p],
        the rows p sends here (host int64 [W])."""
        send = np.ascontiguousarray(np.asarray(send_counts, dtype=np.int64).reshape(-1))
        if send.shape != (self.world_size,):
            raise ValueError(f"send_counts: expected {self.world_size} counts, got {send.shape}")
        if np.any(send < 0):
            raise ValueError(f"send_counts: expected non-negative counts, got {send.tolist()}")
        xp = self.xp
        dev_send = xp.asarray(send)
        recv = xp.empty_like(dev_send)
        recv[self.rank] = dev_send[self.rank]
        with self._op("all_to_all_v (counts)"), self.group():
            for p in range(self.world_size):
                if p != self.rank:
                    self.send(dev_send[p:p + 1], p)
                    self.recv(recv[p:p + 1], p)
        return np.asarray(self.to_host(recv)).astype(np.int64)

    def counts_phase_async(self, send_counts, both=None, after=None):
        """Start phase one; `.wait()` returns (send host [W], recv host [W]). The caller can
        enqueue work between the two (NCCL overlaps the exchange with it; the CPU
        communicator exchanges at wait()). `both`: optionally an int64 [2, W] or [2, W, C]
        buffer whose [0] holds the send counts (per chunk of tokens) and [1, rank] = [0, rank]
        (the fused layout kernel writes it so): NCCL then exchanges it in place, with no
        copies first; after wait(), `.send_chunks` / `.recv_chunks` [W, C] hold the
        per-chunk counts (C = 1 without `both`). `after`: an event recorded when the counts
        were ready (NCCL: the exchange waits for it instead of all the work enqueued so
        far)."""
        return _DeferredCounts(self, send_counts, both)

    def counts_phase(self, send_counts):
        """Phase one from counts anywhere (host or device): (send host [W], recv host [W])."""
        send = np.asarray(self.to_host(send_counts), dtype=np.int64).reshape(-1)
        return send, self.exchange_counts(send)

    def all_to_all_v(self, sends, send_counts, recv_counts=None, outs=None):
        """Variable-split all-to-all of one array or a list of arrays sharing the splits.

        sends: [N, ...] (or a list of them, same N), rows grouped by destination rank:
            rows off[p]:off[p]+send_counts[p] go to rank p.
        send_counts: host ints [W]. recv_counts: [W] when already known (skips phase one).
        Returns (recvs, recv_counts): recvs [M, ...] with M = sum(recv_counts), rows from
        rank 0 first, then rank 1, ...; a list when `sends` was a list.
        """
        single = not isinstance(sends, (list, tuple))
        xp = self.xp
        given = [sends] if single else list(sends)
        arrays = [xp.ascontiguousarray(raw(a)) for a in given]
        send_counts = np.asarray(send_counts, dtype=np.int64).reshape(-1)
        if send_counts.shape != (self.world_size,):
            raise ValueError(f"send_counts: expected {self.world_size} counts, "
                             f"got shape {send_counts.shape}")
        total = int(send_counts.sum())
        for i, a in enumerate(arrays):
            if a.ndim < 1 or a.shape[0] != total:
                raise ValueError(f"sends[{i}]: expected {total} rows (sum of send_counts), "
                                 f"got shape {a.shape}")
        if recv_counts is None:
            recv_counts = self.exchange_counts(send_counts)
        recv_counts = np.asarray(recv_counts, dtype=np.int64).reshape(-1)
        so, ro = split_offsets(send_counts), split_offsets(recv_counts)
        if outs is None:
            outs = [xp.empty((int(ro[-1]),) + a.shape[1:], dtype=a.dtype) for a in arrays]
        else:
            outs = [raw(o) for o in ([outs] if single else list(outs))]
            for i, (a, o) in enumerate(zip(arrays, outs)):
                if o.shape != (int(ro[-1]),) + a.shape[1:] or o.dtype != a.dtype:
                    raise ValueError(f"outs[{i}]: expected shape {(int(ro[-1]),) + a.shape[1:]} "
                                     f"dtype {a.dtype}, got {o.shape} {o.dtype}")
        r = self.rank
        if send_counts[r] != recv_counts[r]:
            raise CommUsageError(f"rank {r}: all_to_all_v sends {send_counts[r]} rows to itself "
                                 f"but expects {recv_counts[r]}")
        # the own rows travel inside the group too: NCCL copies them in the same kernel as the
        # peers' rows (concurrently), where a separate copy would run before the transfers
        with self._op("all_to_all_v"), self.group():
            for p in range(self.world_size):
                for a, o in zip(arrays, outs):
                    if send_counts[p]:
                        self.send(a[so[p]:so[p + 1]], p)
                    if recv_counts[p]:
                        self.recv(o[ro[p]:ro[p + 1]], p)
        outs = [view_as(o, g.dtype) for o, g in zip(outs, given)]
        return (outs[0] if single else outs), recv_counts

    def _rows_checked(self, send, send_offsets, send_counts, recv, recv_offsets, recv_counts,
                      prepare=None):
        """exchange_rows' arguments checked: (so, sc, ro, rc, [(send_i, recv_i)]), the offsets
        and counts as lists, the arrays raw (`prepare(a, o, i)` -> (a, o) first: a
        communicator's own checks of a pair) and every rank's rows inside them."""
        so, sc, ro, rc = (np.asarray(a, dtype=np.int64).reshape(-1).tolist()
                          for a in (send_offsets, send_counts, recv_offsets, recv_counts))
        W, r = self.world_size, self.rank
        if not (len(so) == len(sc) == len(ro) == len(rc) == W):
            raise ValueError(f"send_offsets/send_counts/recv_offsets/recv_counts: expected "
                             f"{W} entries each, got {len(so)}, {len(sc)}, {len(ro)}, {len(rc)}")
        if sc[r] != rc[r]:
            raise CommUsageError(f"rank {r}: exchange_rows sends {sc[r]} rows to itself but "
                                 f"expects {rc[r]}")
        sends = list(send) if isinstance(send, (list, tuple)) else [send]
        recvs = list(recv) if isinstance(recv, (list, tuple)) else [recv]
        if len(sends) != len(recvs):
            raise ValueError(f"recv: expected {len(sends)} arrays (one per send), got "
                             f"{len(recvs)}")
        pairs = []
        for i, (a, o) in enumerate(zip(sends, recvs)):
            a, o = raw(a), raw(o)
            if prepare is not None:
                a, o = prepare(a, o, i)
            for p in range(W):
                if so[p] < 0 or sc[p] < 0 or so[p] + sc[p] > a.shape[0] or ro[p] < 0 \
                        or rc[p] < 0 or ro[p] + rc[p] > o.shape[0]:
                    raise ValueError(f"send_offsets/recv_offsets: rank {p}'s rows fall outside "
                                     f"send[{i}] {a.shape} / recv[{i}] {o.shape}")
            pairs.append((a, o))
        return so, sc, ro, rc, pairs

    def exchange_rows(self, send, send_offsets, send_counts, recv, recv_offsets, recv_counts):
        """One group of sends and receives at explicit row offsets (the counts known on both
        sides): rows send[so[p]:so[p]+sc[p]] go to rank p, rows from p land in
        recv[ro[p]:ro[p]+rc[p]]; send and recv are C-contiguous [N, ...] arrays of one row
        shape and dtype, or lists of such pairs sharing the offsets and counts. What a chunked
        all_to_all_v needs (its chunks are not contiguous), and a dispatch that sends from a
        bigger buffer. Returns recv."""
        so, sc, ro, rc, pairs = self._rows_checked(send, send_offsets, send_counts, recv,
                                                   recv_offsets, recv_counts)
        with self._op("exchange_rows"), self.group():
            for p in range(self.world_size):
                for a, o in pairs:
                    if sc[p]:
                        self.send(a[so[p]:so[p] + sc[p]], p)
                    if rc[p]:
                        self.recv(o[ro[p]:ro[p] + rc[p]], p)
        return recv

    def barrier(self) -> None:
        with self._op("barrier"):
            self.all_reduce(self.xp.ones(1, dtype=np.int32))
            self.synchronize()

    # ---- through the store, before any collective -----------------------------------
    def agree(self, name: str, payload: dict) -> str:
        """Check that every rank passes the same JSON-able payload; returns its sha256.

        Goes through the rendezvous store, not a collective, so that ranks with different
        configs never start exchanging buffers of different sizes."""
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        digest = hashlib.sha256(blob).hexdigest()
        if self.store is None or self.world_size == 1:
            return digest
        seq = self._agree_seq[name]
        self._agree_seq[name] += 1
        prefix = f"{self._ns}/agree/{name}/{seq}/"
        self.store.set(prefix + str(self.rank), blob)
        payloads = [json.loads(self._store_wait(prefix + str(p), f"agree({name!r})", p))
                    for p in range(self.world_size)]
        problems = []
        for p in range(1, self.world_size):
            if payloads[p] == payloads[0]:
                continue
            keys = sorted(set(payloads[0]) | set(payloads[p]))
            diff = [f"{k}={payloads[p].get(k)!r} (rank 0: {payloads[0].get(k)!r})"
                    for k in keys if payloads[p].get(k) != payloads[0].get(k)]
            problems.append(f"rank {p} has " + ", ".join(diff))
        if problems:
            raise ConfigMismatchError(
                f"rank {self.rank}: the {name} differs across ranks, refused before any "
                f"collective: " + "; ".join(problems))
        return digest

    def _store_wait(self, key: str, what: str, peer: int) -> bytes:
        """store.get that gives up early when a peer reports a failure, and names the peer
        when the timeout expires."""
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                return self.store.get(key, timeout=max(0.01, min(0.5, remaining)))
            except StoreTimeoutError:
                pass
            notes = self.peer_failures()
            if notes:
                raise CommPeerError(f"rank {self.rank}: {what} abandoned, peers failed"
                                    f"{self.describe_peer_failures()}")
            if time.monotonic() >= deadline:
                raise CommTimeoutError(f"rank {self.rank}: {what} timed out after "
                                       f"{self.timeout:.1f} s waiting for rank {peer}")

    def report_failure(self, message: str) -> None:
        """Leave a note for the peers (their watchdogs and error messages read it)."""
        if self.store is None:
            return
        try:
            self.store.set(f"error/{self.rank}", message[-4000:])
        except Exception:  # the store may be gone already; the note is best-effort
            pass

    def peer_failures(self) -> dict[int, str]:
        """Notes left by failed peers (and by the launcher for ranks that died)."""
        if self.store is None:
            return {}
        try:
            out = {}
            for key in self.store.keys("error/"):
                rank = int(key.split("/")[1])
                if rank != self.rank:
                    out[rank] = self.store.get(key, timeout=1.0).decode(errors="replace")
            return out
        except Exception:
            return {}

    def describe_peer_failures(self) -> str:
        notes = self.peer_failures()
        if not notes:
            return ""
        lines = [f"rank {p}: {msg.strip().splitlines()[-1] if msg.strip() else msg}"
                 for p, msg in sorted(notes.items())]
        return " [peers reported: " + "; ".join(lines) + "]"

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"
