"""Argument checks shared by the reference stages.

Every message names the argument, what was expected and what came, so that a wrong call
fails at the line that made it rather than deep inside a matmul. The same goes for memory:
check_working_set refuses a batch whose intermediates cannot fit before the first of them
is allocated (available_host_memory says how much there is).
"""

from __future__ import annotations

import os

import numpy as np
import ml_dtypes

# The floating dtypes every stage accepts. bf16 comes from ml_dtypes (NumPy has none).
FLOAT_DTYPES = (
    np.dtype(np.float64),
    np.dtype(np.float32),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
)
INT_DTYPES = (np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.int16), np.dtype(np.int8),
              np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))


def check_array(name, x, ndim=None, dtypes=None, shape=None):
    """Raise TypeError/ValueError unless `x` is an ndarray with the given rank, dtype and shape.

    `shape` may hold None for a free dimension.
    """
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {x.shape}")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({names}), got {x.dtype}")
    if shape is not None:
        if len(shape) != x.ndim or any(s is not None and s != d for s, d in zip(shape, x.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name}: expected shape {want}, got {x.shape}")
    return x


def check_float(name, x, ndim=None, shape=None):
    return check_array(name, x, ndim=ndim, dtypes=FLOAT_DTYPES, shape=shape)


def check_int(name, x, ndim=None, shape=None):
    return check_array(name, x, ndim=ndim, dtypes=INT_DTYPES, shape=shape)


def check_positive_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def check_ids_in_range(name, ids, upper):
    """Every id must lie in [0, upper)."""
    if ids.size and (ids.min() < 0 or ids.max() >= upper):
        bad = ids[(ids < 0) | (ids >= upper)].ravel()[0]
        raise ValueError(f"{name}: expected expert ids in [0, {upper}), got {int(bad)}")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {sorted(choices)}, got {value!r}")
    return value


# ----------------------------------------------------------------------------- memory
# A working set below this is never checked: probing the memory costs a file read, and a
# batch this small cannot be what exhausts a machine.
CHECK_ABOVE_BYTES = 1 << 28


def _meminfo_bytes(*keys):
    """The sum of /proc/meminfo's `keys` in bytes, or None (no /proc, or a key missing)."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: line.split()[1:] for line in f}
        return sum(int(fields[k][0]) * (1024 if fields[k][1:] == ["kB"] else 1) for k in keys)
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _cgroup_room():
    """What the process's cgroup still lets it allocate (limit - usage + inactive page
    cache, which the kernel reclaims first), or None without a limit."""
    for limit_f, usage_f, stat_f, key in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
             "/sys/fs/cgroup/memory.stat", "inactive_file"),                      # v2
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
             "/sys/fs/cgroup/memory/memory.usage_in_bytes",
             "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file")):       # v1
        try:
            with open(limit_f) as f:
                limit = f.read().strip()
            if limit == "max" or int(limit) >= 1 << 60:
                return None
            with open(usage_f) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        cache = 0
        try:
            with open(stat_f) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == key:
                        cache = int(value)
        except (OSError, ValueError):
            pass
        return max(0, int(limit) - usage + cache)
    return None


def available_host_memory():
    """Bytes this process can still allocate in host memory, or None when unknown: RAM the
    kernel reports available plus free swap (/proc/meminfo; psutil or sysconf elsewhere),
    lowered to the cgroup's room when a container limits it. An estimate, read on each call
    (a file read, a few tens of microseconds)."""
    avail = _meminfo_bytes("MemAvailable", "SwapFree")
    if avail is None:
        try:
            import psutil

            avail = int(psutil.virtual_memory().available + psutil.swap_memory().free)
        except Exception:
            try:
                avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (AttributeError, OSError, ValueError):
                avail = None
    room = _cgroup_room()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail


def _human(nbytes):
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def check_working_set(num_tokens, nbytes, what, where="host memory", available=None):
    """MemoryError, before anything is allocated, when `nbytes` (what T = `num_tokens`
    tokens need for `what`) exceed the memory available in `where`. `available`: a
    callable giving the bytes free there (default: available_host_memory); an unknown
    (None) amount passes. Sizes up to CHECK_ABOVE_BYTES pass without a probe."""
    if nbytes <= CHECK_ABOVE_BYTES or num_tokens <= 0:
        return
    free = (available or available_host_memory)()
    if free is None or nbytes <= free:
        return
    fits = int(num_tokens * free // nbytes)
    raise MemoryError(f"hidden_states: expected a batch whose {what} fit in the "
                      f"{_human(free)} of {where} available here, got T={num_tokens} tokens, "
                      f"which need at least {_human(nbytes)} ({nbytes:,} bytes); run it in "
                      f"chunks of fewer than {fits} tokens")
