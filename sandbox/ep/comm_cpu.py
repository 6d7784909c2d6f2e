"""A CPU communicator: the NCCL semantics over TCP sockets between processes, so that every
line of the expert-parallel logic runs in CPU CI.

    W ranks, a full mesh of W(W-1)/2 TCP connections (loopback in tests)

Set-up: every rank listens on an ephemeral port and publishes `host:port` in the store;
rank r connects to every lower rank (the kernel's listen backlog completes the connection
before the peer accepts, so there is no ordering deadlock) and accepts every higher one.

Transfers: `send(x, p)` / `recv(x, p)` move the raw bytes of a C-contiguous NumPy array.
Inside `group_start()` ... `group_end()` they are queued, then progressed together by one
non-blocking `selectors` loop, so two ranks that send each other megabytes never block
each other (NCCL's grouped p2p has the same contract). Between a pair of ranks, messages
are matched in the order they were posted, as in NCCL.

Each message carries a 16-byte header (an operation tag and the payload size): a receiver
that expects a different size or tag fails at once with CommUsageError naming both sides,
where NCCL would hang or corrupt memory.

Faults: every wait has a deadline (`timeout`); a peer that closes its socket (it raised
and aborted, or died) raises CommPeerError naming it; `abort()` closes every socket so
that the peers see it immediately.
"""
from __future__ import annotations

import selectors
import socket
import struct
import time
from collections import deque

import numpy as np

from .comm import Communicator
from .errors import CommPeerError, CommTimeoutError, CommUsageError

_HDR = struct.Struct("!4sQI")  # tag, payload bytes, sequence number (per pair, per direction)
_HELLO = struct.Struct("!4sI")


def _byte_view(x: np.ndarray, what: str) -> memoryview:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what}: expected a numpy.ndarray, got {type(x).__name__}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: expected a C-contiguous array (a slice of rows is fine), "
                         f"got strides {x.strides} for shape {x.shape}")
    # a uint8 view works for every dtype, bf16 included (memoryview rejects its format)
    return memoryview(x.reshape(-1).view(np.uint8))


class _Pending:
    """One queued send or receive."""
    __slots__ = ("peer", "tag", "data", "header", "stage", "offset")

    def __init__(self, peer, tag, data):
        self.peer, self.tag, self.data = peer, tag, data
        self.header = None
        self.stage = 0  # 0: header, 1: payload, 2: done
        self.offset = 0


class CpuCommunicator(Communicator):
    backend = "cpu"

    def __init__(self, rank, world_size, store, timeout=60.0, namespace="comm0",
                 host="127.0.0.1"):
        super().__init__(rank, world_size, store, timeout, namespace)
        self._socks: dict[int, socket.socket] = {}
        self._queue: list[tuple[str, _Pending]] = []
        self._self_msgs: deque = deque()
        self._send_seq = [0] * world_size
        self._recv_seq = [0] * world_size
        self._tag = b"p2p "
        self._closed = False
        self._connect(host)

    # ---- set-up ------------------------------------------------------------------------
    def _connect(self, host):
        W, r = self.world_size, self.rank
        if W == 1:
            return
        deadline = time.monotonic() + self.timeout
        listener = socket.create_server((host, 0), backlog=max(W, 8))
        port = listener.getsockname()[1]
        self.store.set(f"{self._ns}/cpu/addr/{r}", f"{host}:{port}")
        try:
            for p in range(r):  # connect to every lower rank
                addr = self.store.get(f"{self._ns}/cpu/addr/{p}",
                                      timeout=max(0.1, deadline - time.monotonic())).decode()
                peer_host, peer_port = addr.rsplit(":", 1)
                sock = socket.create_connection((peer_host, int(peer_port)),
                                                timeout=max(0.1, deadline - time.monotonic()))
                sock.sendall(_HELLO.pack(b"mep1", r))
                self._socks[p] = sock
            for _ in range(r + 1, W):  # accept every higher rank
                listener.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    sock, _ = listener.accept()
                except socket.timeout as exc:
                    missing = sorted(set(range(r + 1, W)) - set(self._socks))
                    raise CommTimeoutError(
                        f"rank {r}: ranks {missing} did not connect within {self.timeout:.1f} s"
                        f"{self.describe_peer_failures()}") from exc
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                magic, p = _HELLO.unpack(self._recv_exact_blocking(sock, _HELLO.size))
                if magic != b"mep1" or not r < p < W or p in self._socks:
                    raise CommUsageError(f"rank {r}: bad handshake from a peer ({magic!r}, {p})")
                self._socks[p] = sock
        finally:
            listener.close()
        for sock in self._socks.values():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)

    @staticmethod
    def _recv_exact_blocking(sock, n):
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise CommPeerError("connection closed during the handshake")
            buf += chunk
        return bytes(buf)

    # ---- primitives ----------------------------------------------------------------------
    def group_start(self):
        self._check_group(opening=True)
        self._in_group = True
        self._queue = []

    def group_end(self):
        self._check_group(opening=False)
        self._in_group = False
        queue, self._queue = self._queue, []
        self._progress(queue, self._what or "grouped send/recv")

    def send(self, x, peer):
        self._p2p("send", x, peer)

    def recv(self, x, peer):
        self._p2p("recv", x, peer)

    def _p2p(self, kind, x, peer):
        """A send or recv: queued inside a group, else progressed to completion now."""
        peer = self._check_peer(peer, kind)
        op = _Pending(peer, self._tag, _byte_view(x, "x"))
        if self._in_group:
            self._queue.append((kind, op))
        else:
            self._progress([(kind, op)], self._what or kind)

    def abort(self):
        """Close every connection at once: peers blocked on us fail with CommPeerError."""
        self._closed = True
        for sock in self._socks.values():
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
            except OSError:
                pass
        self._socks = {}

    def destroy(self):
        if self._closed:
            return
        self._closed = True
        for sock in self._socks.values():
            try:
                sock.close()
            except OSError:
                pass
        self._socks = {}

    # ---- the progress engine -------------------------------------------------------------
    def _progress(self, ops, what):
        if self._closed:
            raise CommPeerError(f"rank {self.rank}: {what} on a destroyed or aborted communicator")
        sends: dict[int, deque] = {}
        recvs: dict[int, deque] = {}
        self_recvs = []
        for kind, op in ops:
            if op.peer == self.rank:
                if kind == "send":
                    self._self_msgs.append(bytes(op.data))
                else:
                    self_recvs.append(op)
                continue
            if kind == "send":
                op.header = _HDR.pack(op.tag, op.data.nbytes, self._send_seq[op.peer])
                self._send_seq[op.peer] += 1
                sends.setdefault(op.peer, deque()).append(op)
            else:
                op.header = bytearray(_HDR.size)
                recvs.setdefault(op.peer, deque()).append(op)
        for op in self_recvs:  # a send to oneself is a copy, matched in posting order
            if not self._self_msgs:
                raise CommUsageError(f"rank {self.rank}: recv from itself without a matching send")
            msg = self._self_msgs.popleft()
            if len(msg) != op.data.nbytes:
                raise CommUsageError(f"rank {self.rank}: self send of {len(msg)} bytes matched "
                                     f"a recv of {op.data.nbytes} bytes")
            op.data[:] = msg
        if not sends and not recvs:
            return

        deadline = time.monotonic() + self.timeout
        sel = selectors.DefaultSelector()
        try:
            for peer in set(sends) | set(recvs):
                sock = self._socks[peer]
                events = (selectors.EVENT_WRITE if peer in sends else 0) | \
                         (selectors.EVENT_READ if peer in recvs else 0)
                sel.register(sock, events, peer)
            while sends or recvs:
                if self._closed:  # aborted from another thread (a watchdog)
                    raise CommPeerError(f"rank {self.rank}: {what} interrupted: the "
                                        f"communicator was aborted")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommTimeoutError(
                        f"rank {self.rank}: {what} timed out after {self.timeout:.1f} s, still "
                        f"waiting to receive from ranks {sorted(recvs)} and to send to ranks "
                        f"{sorted(sends)} (a peer is hung, dead, or called a different "
                        f"operation){self.describe_peer_failures()}")
                try:
                    ready = sel.select(timeout=min(remaining, 0.5))
                except (OSError, ValueError):  # a socket closed under us by abort()
                    ready = []
                for key, mask in ready:
                    peer = key.data
                    if mask & selectors.EVENT_READ and peer in recvs:
                        self._pump_recv(peer, recvs, what)
                    if mask & selectors.EVENT_WRITE and peer in sends:
                        self._pump_send(peer, sends, what)
                    events = (selectors.EVENT_WRITE if peer in sends else 0) | \
                             (selectors.EVENT_READ if peer in recvs else 0)
                    if events:
                        sel.modify(key.fileobj, events, peer)
                    else:
                        sel.unregister(key.fileobj)
        finally:
            sel.close()

    def _peer_gone(self, peer, what, exc=None):
        return CommPeerError(
            f"rank {self.rank}: connection to rank {peer} closed during {what} (rank {peer} "
            f"raised, aborted or died){self.describe_peer_failures()}")

    def _pump_send(self, peer, sends, what):
        sock = self._socks[peer]
        queue = sends[peer]
        while queue:
            op = queue[0]
            buf = op.header if op.stage == 0 else op.data
            try:
                n = sock.send(buf[op.offset:]) if len(buf) > op.offset else 0
            except BlockingIOError:
                return
            except OSError as exc:
                raise self._peer_gone(peer, what, exc) from exc
            op.offset += n
            if op.offset < len(buf):
                return
            op.stage += 1
            op.offset = 0
            if op.stage == 2:
                queue.popleft()
        del sends[peer]

    def _pump_recv(self, peer, recvs, what):
        sock = self._socks[peer]
        queue = recvs[peer]
        while queue:
            op = queue[0]
            buf = memoryview(op.header) if op.stage == 0 else op.data
            if len(buf) > op.offset:
                try:
                    n = sock.recv_into(buf[op.offset:])
                except BlockingIOError:
                    return
                except OSError as exc:
                    raise self._peer_gone(peer, what, exc) from exc
                if n == 0:
                    raise self._peer_gone(peer, what)
                op.offset += n
                if op.offset < len(buf):
                    return
            if op.stage == 0:
                tag, nbytes, seq = _HDR.unpack(bytes(op.header))
                if tag != op.tag or nbytes != op.data.nbytes or seq != self._recv_seq[peer]:
                    raise CommUsageError(
                        f"rank {self.rank}: in {what}, rank {peer} sent a message of {nbytes} "
                        f"bytes (tag {tag!r}, #{seq}) where {op.data.nbytes} bytes (tag "
                        f"{op.tag!r}, #{self._recv_seq[peer]}) were expected: the ranks called "
                        f"different operations or passed different shapes")
                self._recv_seq[peer] += 1
            op.stage += 1
            op.offset = 0
            if op.stage == 2:
                queue.popleft()
        del recvs[peer]
