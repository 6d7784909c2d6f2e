"""CuPy's handle on a stream that another library made (torch's current stream, most often).

    external_stream(ptr, device)    a cupy Stream for the cudaStream_t `ptr`, made once per
                                    (device, ptr): launching on it costs no Python object churn

The kernels of this package launch on CuPy's current stream, or on a stream handed to them;
they never decide which stream that is (sandbox.streams does, for the layer).
"""
from __future__ import annotations

import warnings

_EXTERNAL: dict = {}      # (device, stream pointer) -> CuPy's handle on that stream


def external_stream(ptr: int, device: int):
    """A CuPy stream object for the CUDA stream `ptr` of `device` (cached)."""
    key = (device, ptr)
    hit = _EXTERNAL.get(key)
    if hit is not None:
        return hit
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:                # CuPy >= 14 (ExternalStream is deprecated)
        try:
            hit = from_external(ptr, device_id=device)
        except TypeError:
            hit = None
    if hit is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            hit = cupy.cuda.ExternalStream(ptr, device)
    _EXTERNAL[key] = hit
    return hit
