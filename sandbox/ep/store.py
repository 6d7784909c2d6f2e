"""A small TCP key-value store for rendezvous: the NCCL unique id, the CPU communicator's
addresses, config hashes, and failure notes all pass through it before (or beside) any
collective.

One server (a thread in `launch()`'s parent, or in rank 0 under torchrun / srun), one
client per rank and thread. Keys are strings, values bytes. `get` blocks until the key
exists or the timeout expires, which is what makes it a rendezvous.

Wire format (big-endian), one request then one reply per round trip:
    request  op u8 | key_len u32 | value_len u64 | timeout_ms u32 | key | value
    reply    status u8 (0 ok, 1 timeout, 2 error) | value_len u64 | value
ops: SET, GET (waits), ADD (value = ASCII int delta; returns the new ASCII int),
     CHECK (returns b"1" or b"0" at once), KEYS (value = prefix; returns keys joined by "\\n").
The protocol never unpickles anything: a store reachable from a network carries only bytes.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

from .errors import StoreTimeoutError

_REQ = struct.Struct("!BIQI")
_REP = struct.Struct("!BQ")
SET, GET, ADD, CHECK, KEYS = range(5)
OK, TIMEOUT, ERROR = range(3)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("store connection closed")
        got += k
    return bytes(buf)


class StoreServer:
    """The server half: a listening socket and one thread per client connection."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._sock = socket.create_server((host, port), backlog=256)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="ep-store", daemon=True)
        self._thread.start()

    # direct access for the process that hosts the server (the launcher writes failure notes)
    def set_local(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get_local(self, key: str):
        with self._cond:
            return self._data.get(key)

    def keys_local(self, prefix: str = "") -> list[str]:
        with self._cond:
            return sorted(k for k in self._data if k.startswith(prefix))

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept_loop(self):
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket):
        with conn:
            while True:
                try:
                    op, key_len, value_len, timeout_ms = _REQ.unpack(_recv_exact(conn, _REQ.size))
                    key = _recv_exact(conn, key_len).decode()
                    value = _recv_exact(conn, value_len) if value_len else b""
                except (ConnectionError, OSError):
                    return
                status, reply = self._handle(op, key, value, timeout_ms / 1000.0)
                try:
                    conn.sendall(_REP.pack(status, len(reply)) + reply)
                except OSError:
                    return

    def _handle(self, op, key, value, timeout):
        with self._cond:
            if op == SET:
                self._data[key] = value
                self._cond.notify_all()
                return OK, b""
            if op == GET:
                ok = self._cond.wait_for(lambda: key in self._data, timeout=timeout)
                return (OK, self._data[key]) if ok else (TIMEOUT, b"")
            if op == ADD:
                new = int(self._data.get(key, b"0")) + int(value)
                self._data[key] = str(new).encode()
                self._cond.notify_all()
                return OK, self._data[key]
            if op == CHECK:
                return OK, b"1" if key in self._data else b"0"
            if op == KEYS:
                prefix = value.decode()
                return OK, "\n".join(sorted(k for k in self._data if k.startswith(prefix))).encode()
        return ERROR, f"unknown op {op}".encode()


class StoreClient:
    """The client half. One per thread (a socket carries one request at a time)."""

    def __init__(self, host: str, port: int, timeout: float = 60.0, connect_timeout=None):
        self.host, self.port, self.timeout = host, int(port), float(timeout)
        deadline = time.monotonic() + (self.timeout if connect_timeout is None else connect_timeout)
        last = None
        while True:  # the server may start a moment after us (rank 0 hosts it under torchrun)
            try:
                self._sock = socket.create_connection((host, self.port), timeout=5.0)
                break
            except OSError as exc:
                last = exc
                if time.monotonic() > deadline:
                    raise StoreTimeoutError(
                        f"could not reach the rendezvous store at {host}:{port} within "
                        f"{self.timeout:.0f} s ({last}); is MASTER_ADDR/MASTER_PORT right and "
                        f"rank 0 running?") from exc
                time.sleep(0.05)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(None)
        self._lock = threading.Lock()

    def _call(self, op, key, value=b"", timeout=None):
        timeout = self.timeout if timeout is None else float(timeout)
        kb = key.encode()
        with self._lock:
            # the socket-level timeout is the store timeout plus slack for the reply itself
            self._sock.settimeout(timeout + 10.0)
            try:
                self._sock.sendall(_REQ.pack(op, len(kb), len(value), int(timeout * 1000))
                                   + kb + value)
                status, n = _REP.unpack(_recv_exact(self._sock, _REP.size))
                reply = _recv_exact(self._sock, n) if n else b""
            except (OSError, ConnectionError) as exc:
                raise StoreTimeoutError(f"rendezvous store at {self.host}:{self.port} "
                                        f"unreachable during {key!r}: {exc}") from exc
        if status == TIMEOUT:
            raise StoreTimeoutError(f"key {key!r} did not appear in the rendezvous store "
                                    f"within {timeout:.1f} s")
        if status != OK:
            raise RuntimeError(f"store error on {key!r}: {reply.decode(errors='replace')}")
        return reply

    def set(self, key: str, value) -> None:
        self._call(SET, key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str, timeout=None) -> bytes:
        return self._call(GET, key, timeout=timeout)

    def add(self, key: str, delta: int = 1) -> int:
        return int(self._call(ADD, key, str(int(delta)).encode()))

    def check(self, key: str) -> bool:
        return self._call(CHECK, key) == b"1"

    def keys(self, prefix: str = "") -> list[str]:
        out = self._call(KEYS, "", prefix.encode()).decode()
        return out.split("\n") if out else []

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
