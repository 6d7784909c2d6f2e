"""Which backend runs which stage: the one place that knows every backend.

    STAGES            ("route", "align", "gemm1", "activation", "gemm2", "combine")
    STAGE_FUNCTIONS   stage -> the function name of docs/stages.md it calls
    BACKENDS          ("reference", "torch", "cupy", "numba")

    get_backend(name)            a `Backend` handle (imports the backend lazily)
    available_backends()         {name: (ok, reason)} for every backend, on this machine
    resolve_stage_mapping(spec)  "cupy" or {"route": "numba", "gemm1": "cupy"} -> {stage: name}

Backends and their modules:
    reference   the NumPy oracle, `reference/`                     host
    torch       `cuda_kernels.torch`  (plain torch, CPU or CUDA)   host on the CPU
    cupy        `cuda_kernels.cupy`   (CUDA C++ through CuPy)      GPU
    numba       `cuda_kernels.numba`  (numba.cuda; on a machine without a GPU the CUDA
                                       simulator, switched on by get_backend: see
                                       use_numba_simulator_if_no_gpu)

Each backend module provides the stage functions by their docs/stages.md names plus
`availability() -> (ok, reason)`, `to_device(np_array)` and `to_host(array)`. The GPU
backends are imported on first use and guarded: a backend whose package is missing, fails
to import, or lacks `availability` is reported unavailable with the reason, never raised.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np

from . import arrays

STAGES = ("route", "align", "gemm1", "activation", "gemm2", "combine")

STAGE_FUNCTIONS = {
    "route": "select_experts",
    "align": "moe_align_block_size",
    "gemm1": "grouped_gemm",
    "activation": "apply_activation",
    "gemm2": "grouped_gemm",
    "combine": "moe_sum",
}

BACKENDS = ("reference", "torch", "cupy", "numba")

# a quantized layer (sandbox/quant.py) runs gemm1 / gemm2 as these two steps, each on that
# GEMM's backend: the activations quantized (not for weight-only formats), then the GEMM on
# the codes
QUANT_STAGES = ("quantize1", "gemm1", "quantize2", "gemm2")
QUANT_STAGE_FUNCTIONS = {"quantize1": "moe_kernel_quantize_input", "gemm1": "grouped_gemm_quant",
                         "quantize2": "moe_kernel_quantize_input", "gemm2": "grouped_gemm_quant"}
QUANT_GEMM_STAGE = {"quantize1": "gemm1", "gemm1": "gemm1", "quantize2": "gemm2",
                    "gemm2": "gemm2"}
# why a backend without the quantized stages has none (validate lists it so)
QUANT_NOT_IMPLEMENTED = {
    "numba": "no quantized kernels: the fp8 / int8 / int4 GEMMs and activation quantizers "
             "exist as CUDA C++ (cuda_kernels/cupy/quant/) only; numba.cuda has no fp8 type "
             "and no mma / wgmma intrinsics to build them on",
    "torch": "no quantized stages: plain torch has no grouped GEMM on fp8 / int4 codes "
             "(torch._scaled_grouped_mm is Hopper-only and covers neither int4 nor int8)",
}

# what each backend's stage functions take and return
_ARRAY_KIND = {"reference": "numpy", "torch": "torch", "cupy": "cupy", "numba": "numba"}
_MODULE = {"torch": "cuda_kernels.torch", "cupy": "cuda_kernels.cupy",
           "numba": "cuda_kernels.numba"}

DEFAULT_BLOCK_SIZE = 64
SIMULATOR_BLOCK_SIZE = 4


def _reference_module():
    """The reference package plus the three module functions every backend has."""
    import reference

    ns = SimpleNamespace(**{n: getattr(reference, n) for n in dir(reference)
                            if not n.startswith("__")})
    ns.__name__ = "reference"
    ns.availability = lambda: (True, "NumPy " + np.__version__)
    ns.to_device = lambda a: arrays.to_numpy(a)
    ns.to_host = lambda a: arrays.to_numpy(a)
    return ns


@dataclass
class Backend:
    """A backend: its module (or why there is none) and the stage functions in it.

    Attribute look-ups fall through to the module, so `get_backend("torch").grouped_gemm`
    is `cuda_kernels.torch.grouped_gemm`.
    """

    name: str
    module: Any = None
    ok: bool = False
    reason: str = ""
    array_kind: str = "numpy"
    _configs: dict = field(default_factory=dict, repr=False)

    def __getattr__(self, attr):
        # only called when normal look-up fails: delegate to the backend module
        if attr.startswith("_") or self.__dict__.get("module") is None:
            raise AttributeError(attr)
        return getattr(self.module, attr)

    @property
    def is_host(self) -> bool:
        """True when the backend's arrays live in host memory."""
        if self.name == "reference":
            return True
        if self.name == "torch" and self.ok:
            return self.module.device().type == "cpu"
        if self.name == "numba" and self.ok:
            return _numba_simulator()
        return False

    @property
    def default_block_size(self) -> int:
        """The alignment block when the GEMM offers no config: 64, or 4 for the CUDA
        simulator, where the GEMMs launch over the padded capacity P + E*(B-1) and every
        slot of it costs simulated threads (T=4, E=16: B=4 is 2.4x faster than B=16)."""
        if self.name == "numba" and self.ok and self.is_host:
            return SIMULATOR_BLOCK_SIZE
        return DEFAULT_BLOCK_SIZE

    def accepts(self, x) -> bool:
        """Whether the backend's stages take `x` as it is (no move needed)."""
        k = arrays.kind(x)
        if self.name == "reference":
            return k == "numpy"
        if self.name == "torch":
            if k != "torch":
                return False
            d = self.module.device()
            return x.device.type == d.type and (d.index is None or x.device.index == d.index)
        if self.name == "numba":
            # numba's stages take any CUDA array (numba, CuPy, torch) without copies, and
            # NumPy "host in, host out" (what the simulator runs on)
            if k == "numpy":
                return self.is_host
            return k in ("numba", "cupy") or (k == "torch" and x.device.type == "cuda")
        return k == self.array_kind

    def take(self, x):
        """`x`, whatever backend made it, as this backend's stages read it. The array says
        where it lives (sandbox.arrays.kind), `accepts` whether it may stay there:

          * an array the stages take as it is (same library and device): `x` itself;
          * GPU -> GPU (CuPy, Numba, torch on CUDA): a zero-copy view through DLPack or
            `__cuda_array_interface__` when it keeps the dtype (bf16, which CAI cannot
            describe, takes the host path below);
          * anything else through the host: `put(to_numpy(x))` (a host backend gets the
            host array itself: torch.from_numpy, no copy).

        Tuples and lists move item by item; None, Python scalars, strings and callables pass
        through. The layer calls it for every argument of every stage: a move happens only
        where the backend changes."""
        if isinstance(x, (tuple, list)):
            return type(x)(self.take(v) for v in x)
        if arrays.kind(x) == "none" or isinstance(x, np.generic) or not (
                hasattr(x, "shape") and hasattr(x, "dtype")):
            return x                                   # scalars, strings, callables, None
        if self.accepts(x):
            return x
        if arrays.is_device(x) and not self.is_host:
            y = arrays.zero_copy(x, self.array_kind)
            if y is not None and self.accepts(y):
                return y
        return self.put(arrays.to_numpy(x))

    def put(self, a):
        """A host NumPy array as this backend's stages read it (a device copy on GPU backends).

        Numba's device arrays cannot hold bf16 (its kernels read the uint16 bits), so bf16
        travels to numba stages in a torch CUDA tensor or a CuPy array, which keep the dtype,
        and numba's stages return that same kind."""
        self.require()
        if self.name == "numba":
            if self.is_host:
                return a                                   # the simulator: host in, host out
            if np.dtype(a.dtype) == arrays.BF16:
                carrier = _bf16_carrier(a)
                if carrier is not None:
                    return carrier
                return a                                   # host in, host out: slow, correct
        return self.module.to_device(a)

    def get(self, x):
        """Any array this backend's stages returned, as host NumPy (bf16 as ml_dtypes)."""
        k = arrays.kind(x)
        if k == "numpy":
            return x
        if k in ("torch", "none"):
            return arrays.to_numpy(x)
        self.require()
        return self.module.to_host(x)

    # the module's own movers, for callers that know the backend's conventions
    def to_device(self, a):
        self.require()
        return self.module.to_device(a)

    def to_host(self, x):
        self.require()
        return self.module.to_host(x)

    def require(self):
        if not self.ok:
            raise RuntimeError(f"backend {self.name!r} is not available here: {self.reason}")

    def has_stage(self, stage: str) -> bool:
        return self.ok and _has(self.module, STAGE_FUNCTIONS[_check_stage(stage)])

    def stage_fn(self, stage: str):
        """The function that runs `stage` (e.g. "gemm1" -> grouped_gemm) on this backend."""
        fn_name = STAGE_FUNCTIONS[_check_stage(stage)]
        self.require()
        if not _has(self.module, fn_name):
            raise NotImplementedError(f"backend {self.name!r} has no {fn_name} "
                                      f"(stage {stage!r}) yet")
        return getattr(self.module, fn_name)

    def has_quant_stage(self, stage: str) -> bool:
        return self.ok and _has(self.module, QUANT_STAGE_FUNCTIONS[stage])

    def quant_fn(self, stage: str):
        """The function of a quantized layer's `stage` (QUANT_STAGES) on this backend;
        NotImplementedError with the reason where the backend has none."""
        self.require()
        fn_name = QUANT_STAGE_FUNCTIONS[stage]
        if not _has(self.module, fn_name):
            why = QUANT_NOT_IMPLEMENTED.get(self.name, f"no {fn_name}")
            raise NotImplementedError(f"backend {self.name!r} has no {fn_name} (stage "
                                      f"{stage!r} of a quantized layer): {why}")
        return getattr(self.module, fn_name)

    def free_memory(self):
        """Bytes free where this backend's arrays live, or None when unknown (never raises):
        host memory for a host backend (reference's available_host_memory); for a GPU
        backend the device's free memory plus what its library's pool holds unused (CuPy's
        memory pool, torch's caching allocator; numba: the context's free memory). The
        layer checks its intermediates against it before a forward."""
        if not self.ok:
            return None
        try:
            if self.is_host:
                from reference import _checks

                return _checks.available_host_memory()
            if self.name == "cupy":
                import cupy

                free, _ = cupy.cuda.runtime.memGetInfo()
                return int(free + cupy.get_default_memory_pool().free_bytes())
            if self.name == "torch":
                import torch

                dev = self.module.device()
                free, _ = torch.cuda.mem_get_info(dev)
                return int(free + torch.cuda.memory_reserved(dev)
                           - torch.cuda.memory_allocated(dev))
            if self.name == "numba":
                from numba import cuda

                return int(cuda.current_context().get_memory_info()[0])
        except Exception:
            return None
        return None

    def gemm_config(self, M, N, K, E, top_k, dtype):
        """The GEMM's tuned config for a shape when the backend offers `get_config`
        (e.g. `cuda_kernels.cupy.gemm.get_config`), else None."""
        if not self.ok:
            return None
        key = (M, N, K, E, top_k, np.dtype(dtype).name)
        if key in self._configs:
            return self._configs[key]
        get_config = _find_get_config(self)
        cfg = None
        if get_config is not None:
            kwargs = {}
            try:
                params = inspect.signature(get_config).parameters
                if "version" in params and params["version"].default is inspect.Parameter.empty:
                    kwargs["version"] = None
            except (TypeError, ValueError):
                pass
            cfg = get_config(M, N, K, E, top_k, np.dtype(dtype), **kwargs)
        self._configs[key] = cfg
        return cfg


def _has(module, name) -> bool:
    try:
        getattr(module, name)
        return True
    except Exception:   # lazy module attributes may raise ImportError, not AttributeError
        return False


def _find_get_config(backend: Backend):
    fn = getattr(backend.module, "get_config", None) if not isinstance(
        backend.module, SimpleNamespace) else None
    if callable(fn):
        return fn
    mod_name = _MODULE.get(backend.name)
    if mod_name is None:
        return None
    try:
        sub = importlib.import_module(f"{mod_name}.gemm")
    except Exception:
        return None
    fn = getattr(sub, "get_config", None)
    return fn if callable(fn) else None


def _bf16_carrier(a):
    """A bf16 NumPy array as a CUDA array that keeps its dtype (torch first, then CuPy)."""
    try:
        import torch

        if torch.cuda.is_available():
            return arrays.numpy_to_torch(a, "cuda")
    except Exception:
        pass
    try:
        import cupy

        c = cupy.asarray(a)
        if np.dtype(c.dtype) == arrays.BF16:
            return c
    except Exception:
        pass
    return None


def _numba_simulator() -> bool:
    """Whether numba runs kernels in the CUDA simulator (asked of numba once numba.cuda is
    imported: the environment may say otherwise after the fact)."""
    if "numba.cuda" in sys.modules:
        try:
            return importlib.import_module("cuda_kernels.numba._arrays").is_simulator()
        except Exception:
            pass
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"


# ----------------------------------------------------------------------------- the simulator
def cuda_devices() -> list[str]:
    """Names of the CUDA devices the driver sees, asked through libcuda directly so that no
    GPU library (and above all not Numba) is imported to find out. [] without a driver."""
    for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            cuda = ctypes.CDLL(lib)
            break
        except OSError:
            continue
    else:
        return []
    try:
        if cuda.cuInit(0) != 0:
            return []
        count = ctypes.c_int(0)
        if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return []
        names = []
        for i in range(count.value):
            dev = ctypes.c_int(0)
            buf = ctypes.create_string_buffer(256)
            if cuda.cuDeviceGet(ctypes.byref(dev), i) == 0 and \
                    cuda.cuDeviceGetName(buf, 256, dev) == 0:
                names.append(buf.value.decode(errors="replace"))
            else:
                names.append(f"device {i}")
        return names
    except Exception:
        return []


def use_numba_simulator_if_no_gpu() -> bool:
    """Switch Numba to its CUDA simulator when no GPU is visible, if that can still be done.
    Returns whether the simulator is (or will be) on.

    Numba fixes the mode when `numba.cuda` is first imported (NUMBA_ENABLE_CUDASIM, read
    into numba.core.config). So: a NUMBA_ENABLE_CUDASIM the user set is left alone; with a
    GPU nothing changes; without one the variable is set to 1 (and numba's config reloaded
    if numba, but not numba.cuda, is imported already). Once numba.cuda is imported nothing
    is touched: flipping the variable then would leave numba half in each mode.
    get_backend("numba") calls this before importing the backend, so the numba backend
    runs in the simulator on a machine without a GPU with nothing set by hand."""
    return _choose_numba_mode()[0]


def _choose_numba_mode() -> tuple[bool, str]:
    """(simulator on, why the simulator is not on where it would be wanted, or "")."""
    value = os.environ.get("NUMBA_ENABLE_CUDASIM", "")
    if "numba.cuda" in sys.modules:
        sim = _numba_simulator()
        if sim or cuda_devices():
            return sim, ""
        return False, ("no CUDA GPU here, and numba.cuda was imported before the CUDA "
                       "simulator could be switched on: set NUMBA_ENABLE_CUDASIM=1 in the "
                       "environment before Python starts (e.g. `NUMBA_ENABLE_CUDASIM=1 python "
                       "...`), or use the numba backend before anything imports numba.cuda")
    if value.strip():
        return value.strip() == "1", ("" if value.strip() == "1" else
                                      f"NUMBA_ENABLE_CUDASIM={value} was set by hand")
    if cuda_devices():
        return False, ""
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    config = sys.modules.get("numba.core.config")
    if config is not None:      # numba (not numba.cuda) is imported: it read the old value
        config.reload_config()
    return True, ""


def _check_stage(stage: str) -> str:
    if stage not in STAGE_FUNCTIONS:
        raise ValueError(f"stage: expected one of {list(STAGES)}, got {stage!r}")
    return stage


def _check_backend_name(name) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {name!r}")
    return name


@functools.cache
def get_backend(name: str) -> Backend:
    """The handle of backend `name` (ValueError for an unknown name). An unavailable backend
    still gets a handle: `.ok` is False, `.reason` says why, and calling a stage raises."""
    _check_backend_name(name)
    kind = _ARRAY_KIND[name]
    if name == "reference":
        try:
            return Backend(name, _reference_module(), True, "NumPy " + np.__version__, kind)
        except Exception as e:  # the reference is being written: say so rather than crash
            return Backend(name, None, False, f"reference is not importable "
                                              f"({type(e).__name__}: {e})", kind)
    sim_note = _choose_numba_mode()[1] if name == "numba" else ""
    try:
        module = importlib.import_module(_MODULE[name])
    except Exception as e:
        return Backend(name, None, False,
                       f"{_MODULE[name]} is not importable ({type(e).__name__}: {e})", kind)
    if not isinstance(module, ModuleType) or not callable(getattr(module, "availability", None)):
        return Backend(name, module, False, f"{_MODULE[name]} has no availability() yet", kind)
    try:
        ok, reason = module.availability()
    except Exception as e:
        ok, reason = False, f"{_MODULE[name]}.availability() raised {type(e).__name__}: {e}"
    for fn in ("to_device", "to_host"):
        if ok and not _has(module, fn):
            ok, reason = False, f"{_MODULE[name]} has no {fn}() yet"
    if not ok and sim_note:
        reason = f"{sim_note} ({reason})"
    return Backend(name, module, bool(ok), str(reason or ""), kind)


def available_backends() -> dict[str, tuple[bool, str]]:
    """{backend: (ok, reason)} for every backend in BACKENDS order. For an available backend
    the reason is a short description (e.g. "torch 2.13.0 on cpu")."""
    return {name: (b.ok, b.reason) for name in BACKENDS for b in [get_backend(name)]}


def resolve_stage_mapping(backend=None) -> dict[str, str]:
    """{stage: backend name} for all STAGES (a new dict: the caller's is never kept).

    `backend` is None (all "reference"), a backend name (every stage), or a dict (any
    mapping) naming some stages (the others "reference"). Unknown stage or backend names
    raise ValueError naming the valid ones; any other type raises TypeError. Availability
    is not checked here (the layer checks on forward). `FusedMoE.backend = ...`,
    `FusedMoE(backend=...)` and `FusedMoE.with_backend` all resolve through this.
    """
    if backend is None:
        return {s: "reference" for s in STAGES}
    if isinstance(backend, str):
        _check_backend_name(backend)
        return {s: backend for s in STAGES}
    if isinstance(backend, Mapping):
        mapping = {s: "reference" for s in STAGES}
        for stage, name in backend.items():
            if stage not in STAGES:
                raise ValueError(f"backend: unknown stage {stage!r} in the mapping; expected "
                                 f"stages from {list(STAGES)}")
            if name not in BACKENDS:
                raise ValueError(f"backend: unknown backend {name!r} for stage {stage!r}; "
                                 f"expected one of {list(BACKENDS)}")
            mapping[stage] = name
        return mapping
    raise TypeError(f"backend: expected a backend name, a {{stage: backend}} dict or None, "
                    f"got {type(backend).__name__}")


def clear_cache():
    """Forget the backend handles (for tests that change the environment)."""
    get_backend.cache_clear()
