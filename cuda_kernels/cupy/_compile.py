"""Compile the `.cu` files of this folder: on the GPU through CuPy, on a CPU through NVRTC.

One source text feeds both paths, so CPU CI compiles the source the GPU runs (the same bytes
when both use one NVRTC version: CuPy's NVRTC on a GPU machine can be older than the
nvidia-cuda-nvrtc wheel CI compiles with, and its cubin then differs):

    source_text(cu_name, defines)   '#define NAME VALUE' lines, then '#line 1 "<cu_name>"' and
                                    the file, with local `#include "x.cuh"` inlined (CuPy's disk
                                    cache keys on the source text only, so an included header
                                    that changed would otherwise leave a stale kernel).
    get_kernel(...)                 a `cupy.RawKernel` for the current device, cached per
                                    (cu_name, defines, name_expressions, options, device).
    compile_check(...)              a cubin built through `cuda.core` + NVRTC with no GPU (CPU CI).
    COMPILE_CASES                   every instantiation a kernel module launches, registered at
                                    import with `register_compile_case`; tests/cupy/test_nvrtc.py
                                    compiles them all for sm_90 and sm_80.
    availability()                  (True, "") when CuPy imports and a CUDA device is usable.

Local includes resolve against the including file's folder, as a C compiler's do
(`quant/wna16_v5_staged.cu` includes `"wna16_common.cuh"` and `"../wgmma_operands.cuh"`).
Every kernel is compiled at run time, by the NVRTC of the machine that runs it: cubins built
ahead by a newer NVRTC ran the staged int4 rung 2-3% faster, too little to ship binaries.

Architecture: by default a kernel is built for the current device (CuPy picks `sm_XY`). A
kernel that needs an architecture-specific target (`wgmma` needs `sm_90a`) passes it in
`options` as `"-arch=sm_90a"`; `get_kernel` then builds the cubin itself through `cuda.core`
(CuPy would append its own `-arch`) and loads it into CuPy, and `compile_check` uses that
arch instead of its `arch` argument. `required_arch(options)` tells which cases those are
(tests skip them for sm_80).

Precision note: CuPy appends `-ftz=true` to every NVRTC compile (denormals flush to zero);
`compile_check` passes the same flag so both paths agree. It only matters for values below
1.2e-38.

Nothing here imports CuPy or cuda.core at module import time: `import cuda_kernels.cupy`
works on a machine with neither.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import posixpath
import re
import sys
import tempfile
from typing import NamedTuple

from .._checks import check_int  # noqa: F401  (the launchers call C.check_int)

KERNEL_DIR = pathlib.Path(__file__).resolve().parent

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"\s*$')
_BASE_OPTIONS = ("-std=c++17",)


# ----------------------------------------------------------------------------- source text
def _format_define(name: str, value) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z_0-9]*", str(name)):
        raise ValueError(f"defines: expected C identifiers as names, got {name!r}")
    if isinstance(value, bool):  # before int: bool is an int
        value = int(value)
    if value is None:
        return f"#define {name}"
    return f"#define {name} {value}"


def _local_include(cu_name: str, name: str) -> str | None:
    """The file that `#include "name"` in `cu_name` names, relative to KERNEL_DIR (resolved
    against `cu_name`'s folder, as a C compiler does: quant/x.cu's "../y.cuh" is y.cuh), or
    None when no such file is in this folder tree (a system header: left to NVRTC)."""
    inc = posixpath.normpath(posixpath.join(posixpath.dirname(cu_name), name))
    return inc if (KERNEL_DIR / inc).is_file() else None


def _inline(cu_name: str, stack: tuple[str, ...], once: set) -> str:
    """`cu_name`'s text with its local includes inlined once each, `#line` kept right."""
    path = KERNEL_DIR / cu_name
    if not path.is_file():
        raise FileNotFoundError(f"cu_name: no file {cu_name!r} in {KERNEL_DIR}")
    out = [f'#line 1 "{cu_name}"']
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        m = _INCLUDE_RE.match(line)
        inc = _local_include(cu_name, m.group(1)) if m else None
        if inc is not None:
            if inc in stack:
                raise ValueError(f"{cu_name}:{lineno}: recursive #include of {inc!r}")
            if inc not in once:  # every local header is included once (#pragma once semantics)
                once.add(inc)
                out.append(_inline(inc, stack + (inc,), once))
            out.append(f'#line {lineno + 1} "{cu_name}"')
        elif line.strip() == "#pragma once":
            out.append("")  # keeps line numbers; deduplication is done above
        else:
            out.append(line)
    return "\n".join(out)


def source_text(cu_name: str, defines: dict | None = None) -> str:
    """The full text compiled for `cu_name` with `defines` (#define lines first, headers inlined)."""
    head = [_format_define(k, v) for k, v in sorted((defines or {}).items())]
    body = _inline(cu_name, (cu_name,), set())
    return "\n".join(head + [body]) + "\n"


# ----------------------------------------------------------------------------- options
def required_arch(options: tuple[str, ...] = ()) -> str | None:
    """The architecture named in `options` (`-arch=sm_90a`), or None when the device decides."""
    opts = list(options)
    for i, o in enumerate(opts):
        if o in ("-arch", "--gpu-architecture") and i + 1 < len(opts):
            return opts[i + 1]
        for prefix in ("-arch=", "--gpu-architecture="):
            if o.startswith(prefix):
                return o[len(prefix):]
    return None


def _strip_arch(options: tuple[str, ...]) -> tuple[str, ...]:
    out, skip = [], False
    for o in options:
        if skip:
            skip = False
            continue
        if o in ("-arch", "--gpu-architecture"):
            skip = True
            continue
        if o.startswith("-arch=") or o.startswith("--gpu-architecture="):
            continue
        out.append(o)
    return tuple(out)


def _key(defines, name_expressions, options):
    defs = tuple(sorted((str(k), str(v)) for k, v in (defines or {}).items()))
    names = tuple(name_expressions) if name_expressions else None
    return defs, names, tuple(options)


# ----------------------------------------------------------------------------- compile cases
class CompileCase(NamedTuple):
    cu_name: str
    defines: dict | None
    name_expressions: tuple[str, ...] | None
    options: tuple[str, ...]


COMPILE_CASES: list[CompileCase] = []


def register_compile_case(cu_name: str, defines: dict | None = None,
                          name_expressions: tuple[str, ...] | None = None,
                          options: tuple[str, ...] = ()) -> CompileCase:
    """Record one instantiation that a module launches, so CPU CI compiles exactly it."""
    case = CompileCase(cu_name, dict(defines) if defines else None,
                       tuple(name_expressions) if name_expressions else None, tuple(options))
    key = (case.cu_name,) + _key(case.defines, case.name_expressions, case.options)
    if all((c.cu_name,) + _key(c.defines, c.name_expressions, c.options) != key
           for c in COMPILE_CASES):
        COMPILE_CASES.append(case)
    return case


# ----------------------------------------------------------------------------- CPU: NVRTC
class CompileError(RuntimeError):
    """NVRTC rejected a source; the message carries the case and NVRTC's log."""


def cuda_include_dirs() -> list[str]:
    """Folders that hold cuda_fp16.h / cuda_bf16.h: the toolkit, then the NVIDIA wheels."""
    candidates = []
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(pathlib.Path(os.environ[env]) / "include")
    candidates.append(pathlib.Path("/usr/local/cuda/include"))
    for site in sys.path:
        base = pathlib.Path(site) / "nvidia"
        if base.is_dir():
            # CUDA 13 wheels: nvidia/cu13/include; CUDA 12 wheels: nvidia/cuda_runtime/include, ...
            candidates += sorted(base.glob("*/include"))
    found = []
    for c in candidates:
        # cuda_fp16.h for the types; CCCL's <nv/target> may sit in a separate wheel's folder
        if ((c / "cuda_fp16.h").is_file() or (c / "nv" / "target").is_file()) \
                and str(c) not in found:
            found.append(str(c))
    return found


def nvrtc_available() -> tuple[bool, str]:
    """(True, "") when cuda.core + NVRTC can compile here, else (False, why)."""
    try:
        from cuda.core import Program, ProgramOptions  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return False, f"cuda.core is not importable ({type(e).__name__}: {e})"
    try:
        _nvrtc_compile("extern \"C\" __global__ void probe(int* x) { x[0] = 1; }\n",
                       None, "sm_90", (), "probe.cu")
    except Exception as e:
        return False, f"NVRTC does not work here ({type(e).__name__}: {str(e)[:200]})"
    return True, ""


def _nvrtc_compile(src: str, name_expressions, arch: str, options: tuple[str, ...],
                   cu_name: str, *, program_options: dict | None = None, logs=None):
    """A cubin (cuda.core ObjectCode) of `src` by cuda.core's NVRTC, `options` translated to
    ProgramOptions. program_options: more ProgramOptions fields, as they are (the dev sweeps'
    ptxas options); logs: an object with .write for NVRTC's log."""
    from cuda.core import Program, ProgramOptions

    extra = _strip_arch(tuple(options))
    unknown = [o for o in extra if o not in ("-std=c++17", "--std=c++17", "-ftz=true", "-lineinfo",
                                             "--use_fast_math", "-use_fast_math",
                                             "-default-device")]
    kwargs = dict(arch=arch, std="c++17", include_path=cuda_include_dirs() or None, ftz=True,
                  name=cu_name)
    if "-lineinfo" in extra:
        kwargs["lineinfo"] = True
    if "--use_fast_math" in extra or "-use_fast_math" in extra:
        kwargs["use_fast_math"] = True
    if "-default-device" in extra:    # unannotated functions (a kernel's generic lambdas) are
        kwargs["device_as_default_execution_space"] = True    # device code, as CuPy's NVRTC
    for o in unknown:  # -DNAME=VALUE is the only other kind we translate
        if o.startswith("-D"):
            kwargs.setdefault("define_macro", []).append(
                tuple(o[2:].split("=", 1)) if "=" in o else o[2:])
        else:
            raise ValueError(f"options: cannot translate {o!r} for cuda.core's ProgramOptions")
    kwargs.update(program_options or {})
    prog = Program(src, "c++", ProgramOptions(**kwargs))
    return prog.compile("cubin", name_expressions=tuple(name_expressions or ()), logs=logs)


def compile_check(cu_name: str, defines: dict | None = None,
                  name_expressions: tuple[str, ...] | None = None,
                  arch: str = "sm_90", options: tuple[str, ...] = ()) -> bytes:
    """Compile `cu_name` with `defines` to a cubin for `arch` with no GPU; return the cubin.

    An `-arch=...` entry in `options` overrides `arch` (architecture-specific kernels).
    Raises CompileError with NVRTC's log when the source does not compile.
    """
    src = source_text(cu_name, defines)
    arch = required_arch(options) or arch
    try:
        obj = _nvrtc_compile(src, name_expressions, arch, tuple(options), cu_name)
    except ImportError:
        raise
    except Exception as e:
        raise CompileError(
            f"NVRTC failed to compile {cu_name} for {arch} with defines={defines}, "
            f"name_expressions={name_expressions}, options={options}:\n{e}") from e
    return bytes(obj.code)


# ----------------------------------------------------------------------------- GPU: CuPy
def availability() -> tuple[bool, str]:
    """(True, "") when CuPy imports and a CUDA device is usable, else (False, reason)."""
    return _availability()


@functools.lru_cache(maxsize=1)
def _availability() -> tuple[bool, str]:
    try:
        import cupy
    except Exception as e:
        return False, f"cupy is not importable ({type(e).__name__}: {e})"
    try:
        if not cupy.cuda.is_available():
            return False, "cupy imports but no usable CUDA device / driver (cupy.cuda.is_available())"
        cupy.cuda.runtime.getDeviceCount()
        _ = cupy.cuda.Device().compute_capability  # raises when the device is unusable
    except Exception as e:
        return False, f"CUDA device not usable ({type(e).__name__}: {e})"
    return True, ""


_KERNELS: dict = {}


def _device_key():
    import cupy
    dev = cupy.cuda.Device()
    return dev.id, dev.compute_capability


@functools.lru_cache(maxsize=64)
def _sm90_of(dev: int) -> bool:
    import cupy
    return cupy.cuda.Device(dev).compute_capability == "90"


def is_sm90(dev: int | None = None) -> bool:
    """Whether device `dev` (default: the current one) is an sm_90 GPU (H100 / H200), whose
    sm_90a kernels (wgmma, setmaxnreg) it runs; asked once per device."""
    if dev is None:
        import cupy
        dev = cupy.cuda.Device().id
    return _sm90_of(dev)


def _load_with_cuda_core(src, cu_name, kernel_name, name_expressions, arch, options):
    """Build an architecture-specific cubin with cuda.core and load it into CuPy."""
    try:
        obj = _nvrtc_compile(src, name_expressions, arch, options, cu_name)
    except ImportError as e:
        raise RuntimeError(f"options ask for {arch}, which is built through cuda.core; "
                           f"install cuda-core ({e})") from e
    except Exception as e:
        raise CompileError(f"NVRTC failed to compile {cu_name} for {arch}:\n{e}") from e
    mangled = kernel_name
    if name_expressions:
        mangled = obj.symbol_mapping.get(kernel_name, kernel_name)
        if isinstance(mangled, bytes):
            mangled = mangled.decode()
    return _function_of_cubin(bytes(obj.code), mangled)


def _function_of_cubin(cubin: bytes, mangled: str):
    """Kernel `mangled` of a cubin, loaded into CuPy through a file of CuPy's cache folder."""
    import cupy

    cache = pathlib.Path(os.environ.get("CUPY_CACHE_DIR", pathlib.Path.home() / ".cupy"))
    cache = cache / "moe_sandbox_cubins"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / (hashlib.sha256(cubin).hexdigest() + ".cubin")
    if not path.exists():
        # write then rename: another process may load the same cubin at the same time
        with tempfile.NamedTemporaryFile(dir=cache, delete=False) as f:
            f.write(cubin)
        os.replace(f.name, path)
    module = cupy.RawModule(path=str(path))
    return module.get_function(mangled)


def get_kernel(cu_name: str, kernel_name: str, defines: dict | None = None,
               name_expressions: tuple[str, ...] | None = None,
               options: tuple[str, ...] = ()):
    """A compiled kernel of `cu_name` (a `cupy.RawKernel`-like callable) for the current device.

    `kernel_name` is an `extern "C"` name, or one of `name_expressions` for templates.
    Cached in-process per (cu_name, defines, name_expressions, options, device); CuPy also
    caches the cubin on disk keyed by the source text.
    """
    if name_expressions and kernel_name not in name_expressions:
        raise ValueError(f"kernel_name: expected one of name_expressions {name_expressions}, "
                         f"got {kernel_name!r}")
    key = (cu_name, kernel_name) + _key(defines, name_expressions, options) + (_device_key(),)
    kern = _KERNELS.get(key)
    if kern is not None:
        return kern
    import cupy

    src = source_text(cu_name, defines)
    arch = required_arch(options)
    if arch is not None:
        kern = _load_with_cuda_core(src, cu_name, kernel_name, name_expressions, arch,
                                    tuple(options))
    else:
        opts = _BASE_OPTIONS + tuple(options)
        names = tuple(name_expressions) if name_expressions else None
        try:  # RawModule compiles lazily: get_function is where NVRTC runs
            kern = cupy.RawModule(code=src, options=opts,
                                  name_expressions=names).get_function(kernel_name)
        except cupy.cuda.compiler.CompileException as e:
            # a CuPy that finds no cuda_bf16.h of its own: point NVRTC at the toolkit's headers
            dirs = cuda_include_dirs()
            if "cannot open source file" not in str(e) or not dirs:
                raise
            kern = cupy.RawModule(code=src, options=opts + tuple(f"-I{d}" for d in dirs),
                                  name_expressions=names).get_function(kernel_name)
    _KERNELS[key] = kern
    return kern


# ----------------------------------------------------------------------------- arrays
# bf16 travels as ml_dtypes.bfloat16 (CuPy 14 knows it, experimentally). Kernels only need the
# bytes, so launchers hand `raw(x)` (a uint16 view for bf16) to the kernel, which reads it as
# __nv_bfloat16: the public dtype stays ml_dtypes.bfloat16 whatever CuPy supports.
def bf16_dtype():
    import ml_dtypes
    import numpy as np

    return np.dtype(ml_dtypes.bfloat16)


def ctype_of(dtype) -> str:
    """The C type a kernel uses for a floating dtype: double, float, __half or __nv_bfloat16."""
    import numpy as np

    dt = np.dtype(dtype)
    if dt == np.float64:
        return "double"
    if dt == np.float32:
        return "float"
    if dt == np.float16:
        return "__half"
    if dt == bf16_dtype():
        return "__nv_bfloat16"
    raise TypeError(f"expected float64, float32, float16 or bfloat16, got {dt}")


def raw(x):
    """`x` as the kernel receives it: bf16 viewed as uint16 (same bytes), others unchanged."""
    import numpy as np

    if x is None:
        return None
    if np.dtype(x.dtype) == bf16_dtype():
        return x.view("uint16")
    return x


# Tests set POISON (or the environment sets MOE_SANDBOX_POISON=1): every output a launcher
# allocates is then filled with NaN (floats) or POISON_INT (ints) before the kernel runs, so an
# element the kernel forgot to write can never pass for a right answer left in a reused buffer.
POISON = os.environ.get("MOE_SANDBOX_POISON", "") not in ("", "0")
POISON_INT = -123456789


def empty(shape, dtype):
    """An output array of `dtype` (bf16 allowed) on the current device, poisoned if POISON."""
    import cupy
    import numpy as np

    dt = np.dtype(dtype)
    if dt == bf16_dtype():
        try:
            out = cupy.empty(shape, dtype=dt)
        except Exception:  # a CuPy without bf16: keep the bytes, the caller sees uint16
            out = cupy.empty(shape, dtype=np.uint16)
    else:
        out = cupy.empty(shape, dtype=dt)
    if POISON and out.size:
        if dt.kind == "f" or dt == bf16_dtype():
            # 0x7FC0 is a bf16 NaN, 0x7E00 an fp16 NaN: written through an integer view so
            # that the fill needs no bf16 arithmetic in CuPy
            if dt.itemsize == 2:
                raw(out).view(np.uint16).fill(0x7FC0 if dt == bf16_dtype() else 0x7E00)
            else:
                out.fill(np.nan)
        else:
            out.fill(POISON_INT if dt.itemsize >= 4 else -1)
    return out


def as_f32(x):
    """`x` as a float32 CuPy array (no copy when it already is). bf16 widens exactly through
    its bits (bf16 is the top half of an fp32), so no bf16 arithmetic is asked of CuPy."""
    import cupy
    import numpy as np

    if x.dtype == np.float32:
        return x
    if np.dtype(x.dtype) == bf16_dtype():
        return (x.view(np.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    return x.astype(cupy.float32)


def to_device(a):
    """A NumPy array (bf16 as ml_dtypes.bfloat16 included) copied to the current CUDA device."""
    import cupy
    import numpy as np

    a = np.ascontiguousarray(a)
    if a.dtype == bf16_dtype():
        try:
            return cupy.asarray(a)
        except Exception:  # a CuPy without bf16 support: the same bytes as uint16
            return cupy.asarray(a.view(np.uint16))
    return cupy.asarray(a)


def to_host(x):
    """A CuPy array (or anything NumPy can take) as a NumPy array; bf16 stays bfloat16."""
    import numpy as np

    if hasattr(x, "get"):
        return x.get()
    return np.asarray(x)


# ----------------------------------------------------------------------------- argument checks
# Every launcher checks its arguments before the launch: a kernel handed the wrong thing either
# crashes the context or, worse, returns garbage. Messages name the argument, what was expected
# and what came.
INT32_MAX = 2**31 - 1
FLOAT_NAMES = "float32, float16 or bfloat16"


def float_dtypes(with_f64: bool = False):
    import numpy as np

    dts = [np.dtype(np.float32), np.dtype(np.float16), bf16_dtype()]
    return dts + [np.dtype(np.float64)] if with_f64 else dts


def check_array(name, x, ndim=None, dtypes=None, shape=None, contiguous=True):
    """A CuPy array on the current device with the given rank, dtype, shape and C order."""
    import cupy
    import numpy as np

    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name}: expected a cupy.ndarray on the GPU, got {type(x).__name__}"
                        + (" (use cuda_kernels.cupy.to_device)" if isinstance(x, np.ndarray) else ""))
    dev = cupy.cuda.Device().id
    if x.device.id != dev:
        raise ValueError(f"{name}: expected an array on the current device {dev}, "
                         f"got one on device {x.device.id}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {x.shape}")
    if dtypes is not None and np.dtype(x.dtype) not in [np.dtype(d) for d in dtypes]:
        names = ", ".join(str(np.dtype(d)) for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({names}), got {x.dtype}")
    if shape is not None:
        if len(shape) != x.ndim or any(s is not None and s != d for s, d in zip(shape, x.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name}: expected shape {want}, got {x.shape}")
    if contiguous and not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {x.strides} "
                         f"for shape {x.shape} (call cupy.ascontiguousarray first)")
    if x.size > INT32_MAX:
        raise ValueError(f"{name}: expected at most {INT32_MAX} elements (32-bit indexing), "
                         f"got {x.size}")
    return x


def check_fits_int32(name, value, what):
    if value > INT32_MAX:
        raise ValueError(f"{name}: {what} = {value} overflows the kernels' 32-bit indexing "
                         f"(limit {INT32_MAX})")


def null_ptr():
    """A null pointer argument for a RawKernel (8 bytes of zero)."""
    import numpy as np

    return np.uint64(0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_threads(work_items: int, max_threads: int) -> int:
    """Threads for a block that covers `work_items` per row: all of them, rounded up to a
    whole warp, at most `max_threads` (then several blocks share the row)."""
    return max(32, min(max_threads, cdiv(work_items, 32) * 32))


ROW_VECS = (1, 2, 4, 8)


class RowGeometry(NamedTuple):
    vec: int       # consecutive columns per thread
    threads: int   # block size
    chunks: int    # blocks per row
    grid: int      # rows * chunks


def row_geometry(name: str, rows: int, width: int, max_threads: int, *arrays,
                 rows_symbol: str = "T", vecs: tuple[int, ...] = ROW_VECS) -> RowGeometry:
    """The launch of a row-wise elementwise kernel (elementwise.cuh: activation.cu, combine.cu,
    permute.cu's moe_unpermute_kernel), each thread VEC consecutive columns of one row:

        VEC     the widest of `vecs` with VEC * itemsize <= 16 bytes that divides `width` and
                every base address of `arrays` (so a Pack<T, VEC> load is aligned: one 16-byte
                load per thread when all allow it)
        block   block_threads(cdiv(width, VEC), max_threads)
        grid    rows * chunks, chunks = cdiv(width, block * VEC), flattened (row = blockIdx.x /
                chunks) so that rows is not bound by gridDim.y's 65535

    Raises ValueError naming `name` when the grid overflows int32 (`rows_symbol` names the
    rows in the message: "M * column chunks").
    """
    itemsize = arrays[0].dtype.itemsize
    vec = max(v for v in vecs if v * itemsize <= 16 and width % v == 0
              and all(a.data.ptr % (v * itemsize) == 0 for a in arrays))
    threads = block_threads(cdiv(width, vec), max_threads)
    chunks = cdiv(width, threads * vec)
    check_fits_int32(name, rows * chunks, f"the grid size {rows_symbol} * column chunks")
    return RowGeometry(vec, threads, chunks, rows * chunks)


# ----------------------------------------------------------------------------- timing
def script_start(argv=None):
    """The start of a kernel module run as a script: (quick, timed). `--quick` in argv (default
    sys.argv) asks for small shapes and timed(fn) = 1 warm-up and 3 timed calls (a run under
    a sanitizer), else cuda_time's defaults. Exits with the reason when no GPU is usable."""
    quick = "--quick" in (sys.argv[1:] if argv is None else argv)
    ok, why = availability()
    if not ok:
        raise SystemExit(f"needs a CUDA GPU: {why}")
    return quick, ((lambda fn: cuda_time(fn, 1, 3)) if quick else cuda_time)


def cuda_time(fn, warmup: int = 5, reps: int = 50, setup=None) -> list[float]:
    """Milliseconds per call of `fn()`, measured with CUDA events around each call.

    `setup()` (not timed) runs before every call: use it to draw fresh inputs or rotate
    buffers so that repetitions do not just hit the 50 MB L2 of an H200.
    """
    import cupy

    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    times = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(reps):
        if setup is not None:
            setup()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return times


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def rel_err(a, b) -> float:
    """||a - b||_F / ||b||_F in float64 (NaN when either holds a NaN; 0 for two empty arrays)."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"rel_err: shapes differ, {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    if np.isnan(a).any() or np.isnan(b).any():
        return float("nan")
    den = np.linalg.norm(b)
    num = np.linalg.norm(a - b)
    return float(num / den) if den > 0 else float(num)
