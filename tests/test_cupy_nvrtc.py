"""Every CUDA source of the CuPy backend compiles, without a GPU, for sm_90 and sm_80.

The cases are the exact (file, defines, template instantiations, options) tuples that the
kernel modules launch on the GPU (`_compile.COMPILE_CASES`, filled at import), compiled
through cuda.core + NVRTC from the same source text that CuPy compiles on the GPU. A case
built for an architecture-specific target (`-arch=sm_90a` in its options) only runs on that
target and is skipped for sm_80.
"""
from __future__ import annotations

import importlib

import pytest

from cuda_kernels.cupy import _compile as C

# The modules that register compile cases. grouped_gemm is written separately: when it is
# missing or broken the others are still checked (its own test reports the failure).
KERNEL_MODULES = ("routing", "permute", "activation", "combine", "grouped_gemm")
ARCHS = ("sm_90", "sm_80")


def _load_cases():
    problems = {}
    for name in KERNEL_MODULES:
        try:
            importlib.import_module(f"cuda_kernels.cupy.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"cuda_kernels.cupy.{name}":
                problems[name] = "module not written yet"
            else:
                problems[name] = f"import failed: {e!r}"
        except Exception as e:  # noqa: BLE001 - reported as a failing test below
            problems[name] = f"import failed: {e!r}"
    return list(C.COMPILE_CASES), problems


CASES, IMPORT_PROBLEMS = _load_cases()
NVRTC_OK, NVRTC_WHY = C.nvrtc_available()


def _case_id(case) -> str:
    d = ",".join(f"{k}={v}" for k, v in sorted((case.defines or {}).items()))
    n = len(case.name_expressions or ())
    o = ",".join(case.options)
    return f"{case.cu_name}[{d}][{n} names]{'[' + o + ']' if o else ''}"


@pytest.mark.parametrize("name", [m for m in KERNEL_MODULES if m != "grouped_gemm"])
def test_kernel_module_imports_without_gpu(name):
    """The launchers of this task import on a CPU-only machine (CuPy is imported lazily)."""
    assert name not in IMPORT_PROBLEMS, IMPORT_PROBLEMS.get(name)


def test_every_module_registers_cases():
    files = {c.cu_name for c in CASES}
    for cu in ("routing.cu", "permute.cu", "activation.cu", "combine.cu"):
        assert cu in files, f"no compile case registered for {cu}"


@pytest.mark.skipif(not NVRTC_OK, reason=f"cuda.core/NVRTC unavailable: {NVRTC_WHY}")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_compiles(case, arch):
    needed = C.required_arch(case.options)
    if needed is not None and needed != arch and arch == "sm_80":
        pytest.skip(f"{case.cu_name} targets {needed} only")
    cubin = C.compile_check(case.cu_name, case.defines, case.name_expressions, arch,
                            case.options)
    assert isinstance(cubin, bytes) and len(cubin) > 0


@pytest.mark.skipif(not NVRTC_OK, reason=f"cuda.core/NVRTC unavailable: {NVRTC_WHY}")
def test_compile_error_carries_the_log(tmp_path, monkeypatch):
    """A broken source raises CompileError naming the file, with NVRTC's message."""
    monkeypatch.setattr(C, "KERNEL_DIR", tmp_path)
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void k(int* x) {\n  x[0] = ;\n}\n')
    with pytest.raises(C.CompileError, match=r"broken\.cu"):
        C.compile_check("broken.cu")


def test_source_text_defines_and_includes(tmp_path, monkeypatch):
    """#defines first, #line markers, local headers inlined once (CuPy's cache sees them)."""
    monkeypatch.setattr(C, "KERNEL_DIR", tmp_path)
    (tmp_path / "h.cuh").write_text("#pragma once\n#define FROM_HEADER 1\n")
    (tmp_path / "a.cu").write_text('#include "h.cuh"\n#include "h.cuh"\n#include <cuda_fp16.h>\n'
                                   "int x = FROM_HEADER;\n")
    text = C.source_text("a.cu", {"BLOCK": 128, "T": "float"})
    lines = text.splitlines()
    assert lines[0] == "#define BLOCK 128" and lines[1] == "#define T float"
    assert lines[2] == '#line 1 "a.cu"'
    assert text.count("#define FROM_HEADER 1") == 1
    assert "#include <cuda_fp16.h>" in text  # system headers stay includes
    assert '#line 3 "a.cu"' in text  # after the skipped second include
    with pytest.raises(ValueError, match="defines"):
        C.source_text("a.cu", {"not an identifier": 1})
    with pytest.raises(FileNotFoundError, match="cu_name"):
        C.source_text("missing.cu")


def test_required_arch():
    assert C.required_arch(()) is None
    assert C.required_arch(("-arch=sm_90a",)) == "sm_90a"
    assert C.required_arch(("--gpu-architecture", "sm_90a")) == "sm_90a"


def test_package_imports_without_gpu():
    import cuda_kernels.cupy as ck

    ok, why = ck.availability()
    assert isinstance(ok, bool) and isinstance(why, str)
    if not ok:
        assert why
    for name in ("fused_topk", "moe_align_block_size", "moe_permute", "moe_unpermute",
                 "apply_activation", "silu_and_mul", "moe_sum", "select_experts"):
        assert callable(getattr(ck, name))
