"""FAKE cupy.cuda: devices, streams and events; all work is synchronous."""
import threading
import time

from . import nccl  # noqa: F401
from . import runtime  # noqa: F401

_tls = threading.local()


def _current_device():
    return getattr(_tls, "device", 0)


def is_available():
    return True


class Device:
    def __init__(self, device=None):
        self.id = _current_device() if device is None else int(device)
        if not 0 <= self.id < runtime.getDeviceCount():
            raise RuntimeError(f"fake cuda: invalid device ordinal {self.id}")

    def use(self):
        _tls.device = self.id

    @property
    def pci_bus_id(self):
        return f"0000:{self.id:02x}:00.0"

    def __enter__(self):
        self._prev = _current_device()
        self.use()
        return self

    def __exit__(self, *exc):
        _tls.device = self._prev


class Stream:
    null = None

    def __init__(self, null=False, non_blocking=False, ptr=None):
        self.ptr = 0 if null else (ptr or id(self))

    def __enter__(self):
        self._prev = get_current_stream()
        _tls.stream = self
        return self

    def __exit__(self, *exc):
        _tls.stream = self._prev

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def use(self):
        _tls.stream = self


Stream.null = Stream(null=True)


def get_current_stream():
    return getattr(_tls, "stream", None) or Stream.null


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    @property
    def done(self):
        return True

    def synchronize(self):
        pass


def get_elapsed_time(start, end):
    return (end.t - start.t) * 1e3
