"""Every CUDA source of the CuPy backend compiles, without a GPU, for sm_90 and sm_80.

The cases are the exact (file, defines, template instantiations, options) tuples that the
kernel modules launch on the GPU (`_compile.COMPILE_CASES`, filled at import), compiled
through cuda.core + NVRTC from the same source text that CuPy compiles on the GPU. A case
built for an architecture-specific target (`-arch=sm_90a` in its options) only runs on that
target and is skipped for sm_80, as is a case registered with a newer `min_arch`.
"""
from __future__ import annotations

import importlib

import pytest

from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy import _geometry as G

# The modules that register compile cases. gemm is written separately: when it is
# missing or broken the others are still checked (its own test reports the failure).
KERNEL_MODULES = ("routing", "align", "permute", "activation", "combine", "experts_decode",
                  "gemm", "quant.act", "quant.gemm", "ep_layout")
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


@pytest.mark.parametrize("name", [m for m in KERNEL_MODULES if m != "gemm"])
def test_kernel_module_imports_without_gpu(name):
    """The launchers of this task import on a CPU-only machine (CuPy is imported lazily)."""
    assert name not in IMPORT_PROBLEMS, IMPORT_PROBLEMS.get(name)


def test_every_module_registers_cases():
    files = {c.cu_name for c in CASES}
    for cu in ("routing.cu", "align.cu", "permute.cu", "activation.cu", "combine.cu"):
        assert cu in files, f"no compile case registered for {cu}"


def _arch_number(arch: str) -> int:
    """sm_90a -> 90."""
    return int(arch.removeprefix("sm_").rstrip("a"))


def _compile_params():
    """Every registered case for every arch. The quick run compiles each kernel the layer
    launches for sm_90 (the GPUs this project times on); the quantized ladders' heavy
    instantiations (up to a minute each) and the sm_80 builds run with the slow checks."""
    for case in CASES:
        for arch in ARCHS:
            slow = case.cu_name.startswith("quant/w") or arch != ARCHS[0]
            yield pytest.param(case, arch, id=f"{_case_id(case)}-{arch}",
                               marks=[pytest.mark.slow] if slow else [])


@pytest.mark.skipif(not NVRTC_OK, reason=f"cuda.core/NVRTC unavailable: {NVRTC_WHY}")
@pytest.mark.parametrize("case,arch", list(_compile_params()))
def test_compiles(case, arch):
    needed = C.required_arch(case.options)
    if needed is not None and needed != arch and arch == "sm_80":
        pytest.skip(f"{case.cu_name} targets {needed} only")
    if case.min_arch is not None and _arch_number(arch) < _arch_number(case.min_arch):
        pytest.skip(f"{case.cu_name} is launched from {case.min_arch} on")
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


V6_CASES = [c for c in CASES if c.cu_name == "gemm_v6_tma_ws.cu"]


@pytest.mark.skipif(not NVRTC_OK, reason=f"cuda.core/NVRTC unavailable: {NVRTC_WHY}")
@pytest.mark.parametrize("case", V6_CASES, ids=[_case_id(c) for c in V6_CASES])
def test_v6_resources(case):
    """Every v6 config the table and heuristic can launch, built as the GPU builds it, with
    ptxas's report (-v): no stack frame, no spills (a warp-specialized kernel's registers are
    its budget: the producer's PRODUCER_REGS, the consumers' CONSUMER_REGS), setmaxnreg not
    ignored (warning C7508), and with two consumers the kernel enters with the cap of
    __launch_bounds__(threads, 1) (65536 / threads, to 8): the pool setmaxnreg redistributes."""
    import io
    import re

    src = C.source_text(case.cu_name, case.defines)
    logs = io.StringIO()
    C._nvrtc_compile(src, None, C.required_arch(case.options), C._BASE_OPTIONS, case.cu_name,
                     program_options=dict(ptxas_options=["-v"]), logs=logs)
    log = logs.getvalue()
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in log, log
    assert "C7508" not in log and "setmaxnreg" not in log.lower(), log
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    threads = 128 * (1 + case.defines["CONSUMERS"])
    if case.defines["CONSUMERS"] == 2:
        assert regs == 65536 // threads // 8 * 8, log
        assert 128 * case.defines["PRODUCER_REGS"] + 256 * case.defines["CONSUMER_REGS"] <= \
            regs * threads


def test_required_arch():
    assert C.required_arch(()) is None
    assert C.required_arch(("-arch=sm_90a",)) == "sm_90a"
    assert C.required_arch(("--gpu-architecture", "sm_90a")) == "sm_90a"



def test_row_geometry():
    """The launch of the row-wise elementwise kernels: the widest aligned VEC, a block of whole
    warps covering the row (at most max_threads), a flattened grid rows * chunks."""
    from types import SimpleNamespace as NS

    def arr(itemsize, ptr):  # row_geometry only reads dtype.itemsize and data.ptr
        return NS(dtype=NS(itemsize=itemsize), data=NS(ptr=ptr))

    g = G.row_geometry("x", 33, 7168, 128, arr(2, 4096), arr(2, 8192))
    assert g == (8, 128, 7, 33 * 7)                 # bf16: 8 per 16 bytes, 896 words / 128
    assert G.row_geometry("x", 5, 768, 256, arr(2, 0), arr(2, 0)).threads == 96
    assert G.row_geometry("x", 5, 768, 256, arr(2, 0), arr(2, 6)).vec == 1   # misaligned out
    assert G.row_geometry("x", 5, 6, 256, arr(4, 0), arr(4, 0)).vec == 2    # width 6
    assert G.row_geometry("x", 1, 1, 256, arr(4, 0)).threads == 32          # at least a warp
    assert G.row_geometry("x", 1, 64, 256, arr(4, 0), vecs=(1,)).vec == 1
    with pytest.raises(ValueError, match=r"x: the grid size M \* column chunks"):
        G.row_geometry("x", 2**31, 8, 256, arr(4, 0), rows_symbol="M")


def test_package_imports_without_gpu():
    import cuda_kernels.cupy as ck

    ok, why = ck.availability()
    assert isinstance(ok, bool) and isinstance(why, str)
    if not ok:
        assert why
    for name in ("fused_topk", "moe_align_block_size", "moe_permute", "moe_unpermute",
                 "apply_activation", "silu_and_mul", "moe_sum", "select_experts"):
        assert callable(getattr(ck, name))
