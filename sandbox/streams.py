"""Run the GPU backends on the caller's stream, so that torch streams and CUDA graphs see them.

CuPy launches on CuPy's current stream and allocates from CuPy's pool; torch launches on
torch's current stream and allocates from torch's caching allocator. A layer called from
torch code (torch tensors in, or a `torch.cuda.graph` capture under way) must do its work on
torch's stream: otherwise the kernels race with the caller's own work, and a capture records
nothing ("The CUDA Graph is empty": a replay then does no work at all). So every GPU stage
call of the layer and of the benchmark runs inside

    with caller_stream(*inputs):
        ...

which, when torch is the caller, makes torch's current stream CuPy's current stream
(`cupy.cuda.Stream.from_external`) and CuPy's allocations come from torch's allocator (under a
capture, from the graph's private pool, which is what makes a replay's buffers stay valid),
and sets the same stream for the Numba kernels (`cuda_kernels.numba.using_stream`). Without
torch in play it changes nothing: CuPy's current stream and pool stay in charge.

Nothing in `cuda_kernels/` knows about torch: the kernels take CuPy's current stream, and
this module decides what that stream is.
"""
from __future__ import annotations

import contextlib
import sys

from . import arrays


def torch_is_caller(*inputs) -> bool:
    """True when torch drives the call: a CUDA torch tensor among `inputs`, or a torch CUDA
    graph capture under way on this thread. Never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    for x in inputs:
        if arrays.kind(x) == "torch" and x.device.type == "cuda":
            return True
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def _torch_malloc(nbytes: int):
    """A CuPy MemoryPointer to `nbytes` from torch's caching allocator (the tensor that owns
    the bytes lives as long as the CuPy array: UnownedMemory keeps a reference to it)."""
    import cupy
    import torch

    dev = cupy.cuda.Device().id
    t = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=f"cuda:{dev}")
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), int(nbytes), t, dev)
    return cupy.cuda.MemoryPointer(mem, 0)


@contextlib.contextmanager
def torch_stream_for_cupy():
    """CuPy launches on torch's current stream and allocates through torch (see the module
    docstring); the Numba kernels launch on that stream too."""
    import torch

    stream = torch.cuda.current_stream()
    with contextlib.ExitStack() as stack:
        if "cupy" in sys.modules or _cupy_importable():
            import cupy

            stack.enter_context(cupy.cuda.Device(stream.device.index))
            stack.enter_context(_external_stream(stream.cuda_stream, stream.device.index))
            stack.enter_context(cupy.cuda.using_allocator(_torch_malloc))
        numba_pkg = sys.modules.get("cuda_kernels.numba")
        if numba_pkg is not None and hasattr(numba_pkg, "using_stream"):
            stack.enter_context(numba_pkg.using_stream(stream.cuda_stream))
        yield stream


def _external_stream(ptr: int, device: int):
    from cuda_kernels.cupy._stream import external_stream

    return external_stream(ptr, device)


def _cupy_importable() -> bool:
    try:
        import cupy  # noqa: F401
        return True
    except Exception:
        return False


def caller_stream(*inputs):
    """The context every GPU stage call runs in: torch's stream and allocator when torch is
    the caller (`torch_is_caller(*inputs)`), else nothing changes."""
    if torch_is_caller(*inputs):
        return torch_stream_for_cupy()
    return contextlib.nullcontext()
