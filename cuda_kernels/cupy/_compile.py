"""Compile the `.cu` files of this folder: on the GPU through CuPy, on a CPU through NVRTC.
(The arrays the kernels take are _arrays.py's; their launch geometry is _geometry.py's.)

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
    is_sm90(dev)                    whether the device runs the sm_90a kernels (wgmma).

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
    # the oldest architecture the module launches this case on ("sm_90": bulk copies and
    # mbarrier transactions, which sm_80 lacks); None: any
    min_arch: str | None = None


COMPILE_CASES: list[CompileCase] = []


def register_compile_case(cu_name: str, defines: dict | None = None,
                          name_expressions: tuple[str, ...] | None = None,
                          options: tuple[str, ...] = (),
                          min_arch: str | None = None) -> CompileCase:
    """Record one instantiation that a module launches, so CPU CI compiles exactly it (for
    every architecture from `min_arch` on)."""
    case = CompileCase(cu_name, dict(defines) if defines else None,
                       tuple(name_expressions) if name_expressions else None, tuple(options),
                       min_arch)
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
