"""FAKE cupy.cuda.nccl over sandbox.ep.comm_cpu.CpuCommunicator (sockets between processes).

The unique id carries the address of a store that rank 0's process serves; communicators
in one process share one group state, as NCCL's groups are per thread."""
import ctypes
import struct
import threading

import numpy as _np

available = True
NCCL_INT8, NCCL_CHAR, NCCL_UINT8, NCCL_INT32, NCCL_INT, NCCL_UINT32 = 0, 0, 1, 2, 2, 3
NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16, NCCL_HALF, NCCL_FLOAT32, NCCL_FLOAT = 4, 5, 6, 6, 7, 7
NCCL_FLOAT64, NCCL_DOUBLE, NCCL_BFLOAT16 = 8, 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

_servers = []
_live = []
_lock = threading.Lock()


class NcclError(RuntimeError):
    def __init__(self, status, msg=""):
        self.status = status
        super().__init__(f"NCCL_ERROR ({status}): {msg}")


def _np_dtype(code):
    import ml_dtypes

    return {0: _np.int8, 1: _np.uint8, 2: _np.int32, 3: _np.uint32, 4: _np.int64,
            5: _np.uint64, 6: _np.float16, 7: _np.float32, 8: _np.float64,
            9: ml_dtypes.bfloat16}[code]


def _view(ptr, count, code):
    dt = _np.dtype(_np_dtype(code))
    nbytes = count * dt.itemsize
    if nbytes == 0:
        return _np.empty(0, dtype=dt)
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return _np.frombuffer(buf, dtype=_np.uint8).view(dt)


def get_build_version():
    return 22700


def get_version():
    return 22700


def get_unique_id():
    from sandbox.ep.store import StoreServer

    server = StoreServer("127.0.0.1", 0)
    _servers.append(server)
    return struct.pack("!I", server.port).ljust(128, b"\0")


def groupStart():
    for c in list(_live):
        if c._cpu is not None:
            c._cpu.group_start()


def groupEnd():
    errors = []
    for c in list(_live):
        if c._cpu is not None:
            try:
                c._cpu.group_end()
            except Exception as exc:  # NCCL reports failures as NcclError
                errors.append(exc)
    if errors:
        raise NcclError(3, str(errors[0]))


class NcclCommunicator:
    def __init__(self, ndev, commId, rank, config=None):
        if not isinstance(commId, bytes):
            raise TypeError("fake nccl: commId must be bytes (CuPy 14)")
        from sandbox.ep.comm_cpu import CpuCommunicator
        from sandbox.ep.store import StoreClient

        (port,) = struct.unpack("!I", commId[:4])
        store = StoreClient("127.0.0.1", port, timeout=60)
        self._cpu = CpuCommunicator(rank, ndev, store, timeout=3600, namespace="fake-nccl")
        self._rank, self._size = rank, ndev
        _live.append(self)

    def _check(self):
        if self._cpu is None:
            raise NcclError(4, "invalid communicator (aborted or destroyed)")

    def _run(self, fn):
        self._check()
        try:
            return fn()
        except NcclError:
            raise
        except Exception as exc:
            raise NcclError(3, str(exc)) from exc

    def send(self, sendbuf, count, datatype, peer, stream):
        self._run(lambda: self._cpu.send(_view(sendbuf, count, datatype), peer))

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._run(lambda: self._cpu.recv(_view(recvbuf, count, datatype), peer))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        def go():
            out = self._cpu.all_gather(_view(sendbuf, count, datatype).copy())
            _view(recvbuf, count * self._size, datatype)[:] = out.reshape(-1)
        self._run(go)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        assert op == NCCL_SUM

        def go():
            x = _view(sendbuf, recvcount * self._size, datatype).reshape(self._size, recvcount)
            _view(recvbuf, recvcount, datatype)[:] = self._cpu.reduce_scatter(x.copy())
        self._run(go)

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        assert op == NCCL_SUM

        def go():
            _view(recvbuf, count, datatype)[:] = self._cpu.all_reduce(
                _view(sendbuf, count, datatype).copy())
        self._run(go)

    def check_async_error(self):
        pass

    def abort(self):
        cpu, self._cpu = self._cpu, None
        if cpu is not None:
            cpu.abort()

    def destroy(self):
        cpu, self._cpu = self._cpu, None
        if cpu is not None:
            cpu.destroy()
        if self in _live:
            _live.remove(self)
