"""The CPU emulator of CUDA the tests run the CuPy backend's kernels on, and its loader.

NVRTC proves that the sources compile; this runs them. The .cu text (exactly what the GPU
compiles: _compile.source_text) is built by g++ against the headers of this folder, which
stand in for what the kernels use (cuda.h says how, ptx.h the PTX instructions, kernels.h the
kernels' own helper names), and the results are compared with the reference as on a GPU.

    emulated(cu, defines)       the source text, ready for g++: the CUDA headers dropped, the
                                dynamic shared memory on the emulator's, the emulator included
                                after the #defines
    build_library(tmp, ...)     that text plus C entry points (`launch(...)` calls), as a
                                shared library loaded by ctypes
    build_program(tmp, ...)     that text plus a main(), as an executable (a kernel whose
                                checks end the process, or that may deadlock, runs apart)
    library_fixture(cu, builds) a module-scoped fixture: the library of `cu` built once
    entries(names, ...)         entry points k0, k1, ... launching names[i] on a 3D grid
    ptr(a)                      a NumPy array as a ctypes pointer (None stays None)
    blocks_in_order(lib, order) launches of lib inside run their CTAs in that order
    arm_programmatic / programmatic_counts   the next launch as a programmatic one, and what
                                it counted (ptx.h's griddepcontrol)
    needs_gxx                   the skip marker where there is no g++ (a build skips too where
                                g++ cannot build the headers: gxx_why_not)
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import pathlib
import re
import shutil
import subprocess

import pytest

from cuda_kernels.cupy import _compile as C

HEADERS = pathlib.Path(__file__).resolve().parent
GXX_FLAGS = ["-std=c++20", "-O1", "-w", "-pthread"]


@functools.lru_cache(maxsize=1)
def gxx_why_not() -> str:
    """'' where g++ builds the emulator (C++20: <barrier>), else why not."""
    if shutil.which("g++") is None:
        return "no g++ on this machine"
    r = subprocess.run(["g++", *GXX_FLAGS, "-fsyntax-only", "-x", "c++", "-I", str(HEADERS),
                        "-"], input='#include "cuda.h"\n', capture_output=True, text=True)
    return "" if r.returncode == 0 else f"g++ cannot build the emulator: {r.stderr[:300]}"


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")

_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w ]*?\w)\s+(\w+)\[\];")


def emulated(cu: str, defines: dict | None = None) -> str:
    """The source text of `cu` with `defines` (_compile.source_text), for g++: without the
    CUDA headers (cuda.h has the types), `extern __shared__` buffers at the start of the
    CTA's shared memory, the emulator included after the #defines (it reads GG_T,
    ELEM_BF16)."""
    src = C.source_text(cu, defines)
    src = re.sub(r"#include <cuda_(fp16|bf16|fp8)\.h>", "", src)
    src = _EXTERN_SHARED.sub(r"\1* \2 = (\1*)emu_dynamic_smem();", src)
    src = src.replace('extern "C" __global__', "__global__")
    lines = src.split("\n")
    first = next(k for k, line in enumerate(lines) if line.startswith("#line"))
    return "\n".join(lines[:first] + ['#include "cuda.h"'] + lines[first:])


def _gxx(tmp: pathlib.Path, name: str, text: str, out: pathlib.Path, flags) -> pathlib.Path:
    why = gxx_why_not()
    if why:
        pytest.skip(why)
    cpp = tmp / f"{name}.cpp"
    cpp.write_text(text)
    r = subprocess.run(["g++", *GXX_FLAGS, *flags, "-I", str(HEADERS), str(cpp), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"{name} does not build for the emulation:\n{r.stderr[-3000:]}"
    return out


def build_library(tmp, cu: str, defines: dict | None, entry: str, name: str = "kernels"):
    """`cu` with `defines` and the C entry points `entry`, built by g++ in the folder `tmp`
    and loaded (ctypes.CDLL). Skips where g++ cannot build the emulator."""
    tmp = pathlib.Path(tmp)
    so = _gxx(tmp, name, emulated(cu, defines) + "\n" + entry + "\n", tmp / f"{name}.so",
              ["-shared", "-fPIC"])
    return ctypes.CDLL(str(so))


def library_fixture(cu: str, builds):
    """A module-scoped pytest fixture giving `cu` built for the emulator (build_library) once:
    `builds` is (defines, entry), or a dict name -> (defines, entry), and the fixture then
    gives a dict name -> library."""
    @pytest.fixture(scope="module")
    def emulated(tmp_path_factory):
        def one(tag, defines, entry):
            return build_library(tmp_path_factory.mktemp(tag), cu, defines, entry, tag)
        if isinstance(builds, dict):
            return {name: one(name, *build) for name, build in builds.items()}
        return one(pathlib.PurePath(cu).stem, *builds)
    return emulated


def build_program(tmp, cu: str, defines: dict | None, main: str, name: str = "kernel",
                  flags=()) -> pathlib.Path:
    """`cu` with `defines`, then `main` (the text of a main(); `#include "file"` finds this
    folder), built by g++ in `tmp` as an executable."""
    tmp = pathlib.Path(tmp)
    return _gxx(tmp, name, emulated(cu, defines) + "\n" + main + "\n", tmp / name, list(flags))


def entries(names, params: str, args: str) -> str:
    """C entry points k<i>(gx, gy, gz, block, <params>) launching names[i](<args>) on a grid
    (gx, gy, gz) of `block` threads (ctypes calls them as lib.k0, lib.k1, ...)."""
    return "\n".join(
        f'extern "C" void k{i}(unsigned gx, unsigned gy, unsigned gz, unsigned block, '
        f"{params}) {{\n    launch(dim3(gx, gy, gz), block, 0, [&] {{ {n}({args}); }});\n}}"
        for i, n in enumerate(names))


def ptr(a):
    """A NumPy array as a ctypes pointer for an entry point (None: a null pointer)."""
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


BLOCK_ORDER = {"ascending": 0, "descending": 1}


@contextlib.contextmanager
def blocks_in_order(lib, order="descending"):
    """Launches of `lib` inside run their CTAs in `order` ("ascending", "descending", or an
    int > 1: shuffled with that seed): a GPU runs them in any order, so work that CTAs hand
    each other must come out the same."""
    lib.emu_set_block_order(ctypes.c_uint(BLOCK_ORDER.get(order, order)))
    try:
        yield
    finally:
        lib.emu_set_block_order(ctypes.c_uint(0))


def arm_programmatic(lib, inputs, outputs, ignore_waits=False):
    """The next launch of `lib` as a programmatic one (ptx.h's griddepcontrol): `inputs`, the
    arrays the grid before it writes, read 0xFF until a CTA's wait; `outputs`, the arrays the
    launch writes, must not change before it. ignore_waits: the kernel's waits do nothing (the
    checks' own test)."""
    def pairs(arrays):
        ptrs = (ctypes.c_void_p * max(1, len(arrays)))(*[x.ctypes.data for x in arrays])
        sizes = (ctypes.c_size_t * max(1, len(arrays)))(*[x.nbytes for x in arrays])
        return len(arrays), ptrs, sizes

    lib.emu_pdl_arm(*pairs(inputs), *pairs(outputs), int(ignore_waits))


def programmatic_counts(lib) -> dict:
    """What the last armed launch counted: copies issued from its inputs before their CTA's
    wait, outputs found changed at a CTA's wait (one count per array and CTA), and waits that
    not all of a CTA's threads met."""
    counts = (ctypes.c_int * 3)()
    lib.emu_pdl_counts(counts)
    return dict(early_reads=counts[0], early_writes=counts[1], stuck=counts[2])
