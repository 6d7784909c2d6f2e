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

# The modules that register compile cases. gemm is written separately: when it is
# missing or broken the others are still checked (its own test reports the failure).
KERNEL_MODULES = ("routing", "align", "permute", "activation", "combine", "gemm", "quant.act",
                  "quant.gemm", "ep_layout")
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

    g = C.row_geometry("x", 33, 7168, 128, arr(2, 4096), arr(2, 8192))
    assert g == (8, 128, 7, 33 * 7)                 # bf16: 8 per 16 bytes, 896 words / 128
    assert C.row_geometry("x", 5, 768, 256, arr(2, 0), arr(2, 0)).threads == 96
    assert C.row_geometry("x", 5, 768, 256, arr(2, 0), arr(2, 6)).vec == 1   # misaligned out
    assert C.row_geometry("x", 5, 6, 256, arr(4, 0), arr(4, 0)).vec == 2    # width 6
    assert C.row_geometry("x", 1, 1, 256, arr(4, 0)).threads == 32          # at least a warp
    assert C.row_geometry("x", 1, 64, 256, arr(4, 0), vecs=(1,)).vec == 1
    with pytest.raises(ValueError, match=r"x: the grid size M \* column chunks"):
        C.row_geometry("x", 2**31, 8, 256, arr(4, 0), rows_symbol="M")


def test_package_imports_without_gpu():
    import cuda_kernels.cupy as ck

    ok, why = ck.availability()
    assert isinstance(ok, bool) and isinstance(why, str)
    if not ok:
        assert why
    for name in ("fused_topk", "moe_align_block_size", "moe_permute", "moe_unpermute",
                 "apply_activation", "silu_and_mul", "moe_sum", "select_experts"):
        assert callable(getattr(ck, name))


# ============================================================================ CPU emulation
# NVRTC proves the sources compile; this proves their *logic* on a CPU. A small C++ header
# stands in for the CUDA features the kernels use (one std::thread per CUDA thread, block by
# block; warp shuffles, ballot, match_any and __syncwarp through a per-warp rendezvous;
# __syncthreads a std::barrier; shared memory a per-block buffer filled with garbage), the
# kernel sources are compiled by g++ as they are (same text, tiny tunables), and the results
# are compared with the reference like the GPU tests do. It cannot see timing, memory
# ordering subtleties or the GPU's expf/erff ulps: the GPU tests stay the judge.
EMULATION_HEADER = r"""
#pragma once
#include <atomic>
#include <barrier>
#include <memory>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
struct dim3s { unsigned x = 0, y = 0, z = 0; };
thread_local dim3s threadIdx, blockIdx;
dim3s blockDim, gridDim;
thread_local unsigned char* g_shared = nullptr;  // this thread's block's shared memory
struct __half { uint16_t b; };
struct __nv_bfloat16 { uint16_t b; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
inline float __bfloat162float(__nv_bfloat16 h) { uint32_t u = (uint32_t)h.b << 16; float f; memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)0x7fc0};
    return {(uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline float __half2float(__half h) { _Float16 v; memcpy(&v, &h.b, 2); return (float)v; }
inline __half __float2half_rn(float f) { _Float16 v = (_Float16)f; __half h; memcpy(&h.b, &v, 2); return h; }
inline float __int_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __nanosleep(unsigned) { std::this_thread::yield(); }  // a spinning block yields the CPU
template <typename T> inline T __ldcg(const T* p) { return *(const volatile T*)p; }
using std::min; using std::max;
// A warp's rendezvous, one per lane mask: lanes that skipped a masked collective may already
// wait in the next full-warp one (legal on Volta+: they meet at the same instruction later).
struct Meet { int arrived = 0; long gen = 0; uint64_t vals[32]; uint64_t snap[4][32]; };
struct Warp { std::mutex m; std::condition_variable cv; std::map<unsigned, Meet> meets; };
thread_local std::vector<Warp>* g_warps = nullptr;
// every lane of `mask` deposits a value; all of them leave with the 32 deposits
inline void exchange(unsigned mask, uint64_t v, uint64_t out[32]) {
    const int lane = threadIdx.x & 31;
    if (!((mask >> lane) & 1u)) { fprintf(stderr, "lane %d not in mask %x\n", lane, mask); abort(); }
    Warp& w = (*g_warps)[threadIdx.x >> 5];
    std::unique_lock<std::mutex> lk(w.m);
    Meet& m = w.meets[mask];
    m.vals[lane] = v;
    const long g = m.gen;
    if (++m.arrived == __builtin_popcount(mask)) {
        memcpy(m.snap[g & 3], m.vals, sizeof(m.vals)); m.arrived = 0; m.gen++; w.cv.notify_all();
    } else {
        w.cv.wait(lk, [&] { return m.gen != g; });
    }
    memcpy(out, m.snap[g & 3], sizeof(m.vals));
}
template <typename T> inline uint64_t bits(T v) { uint64_t u = 0; memcpy(&u, &v, sizeof(T)); return u; }
template <typename T> inline T unbits(uint64_t u) { T v; memcpy(&v, &u, sizeof(T)); return v; }
template <typename T> inline T __shfl_xor_sync(unsigned m, T v, int o) {
    uint64_t a[32]; exchange(m, bits(v), a); return unbits<T>(a[(threadIdx.x & 31) ^ o]); }
template <typename T> inline T __shfl_sync(unsigned m, T v, int src) {
    uint64_t a[32]; exchange(m, bits(v), a); return unbits<T>(a[src & 31]); }
template <typename T> inline T __shfl_up_sync(unsigned m, T v, int d) {
    uint64_t a[32]; exchange(m, bits(v), a); int l = threadIdx.x & 31; return l >= d ? unbits<T>(a[l - d]) : v; }
inline unsigned __ballot_sync(unsigned m, int p) {
    uint64_t a[32]; exchange(m, p ? 1 : 0, a); unsigned r = 0;
    for (int i = 0; i < 32; ++i) if (((m >> i) & 1u) && a[i]) r |= 1u << i; return r; }
inline unsigned __match_any_sync(unsigned m, int v) {
    uint64_t a[32]; exchange(m, bits(v), a); unsigned r = 0;
    for (int i = 0; i < 32; ++i) if (((m >> i) & 1u) && unbits<int>(a[i]) == v) r |= 1u << i; return r; }
inline void __syncwarp(unsigned m = 0xffffffffu) { uint64_t a[32]; exchange(m, 0, a); }
thread_local std::barrier<>* g_bar = nullptr;
inline void __syncthreads() { g_bar->arrive_and_wait(); }
static std::mutex g_atomic;
inline int atomicAdd(int* p, int v) { std::lock_guard<std::mutex> l(g_atomic); int o = *p; *p = o + v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    std::lock_guard<std::mutex> l(g_atomic); unsigned o = *(volatile unsigned*)p; *(volatile unsigned*)p = o + v; return o; }
template <typename F> void launch(unsigned grid, unsigned block, size_t smem, F body) {
    gridDim.x = grid; blockDim.x = block;
    std::vector<unsigned char> shared(smem + 16);
    for (unsigned b = 0; b < grid; ++b) {
        memset(shared.data(), 0xAB, shared.size());
        std::vector<Warp> warps((block + 31) / 32);
        std::barrier<> bar((std::ptrdiff_t)block);
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < block; ++t)
            ts.emplace_back([&, t, b] {
                threadIdx.x = t; blockIdx.x = b; g_shared = shared.data(); g_warps = &warps; g_bar = &bar;
                body(); bar.arrive_and_drop(); });
        for (auto& t : ts) t.join();
    }
}
// A cooperative launch: every block runs at once (a grid barrier inside must not deadlock),
// each with its own shared memory, warps and __syncthreads barrier.
template <typename F> void launch_cooperative(unsigned grid, unsigned block, size_t smem, F body) {
    gridDim.x = grid; blockDim.x = block;
    std::vector<std::vector<unsigned char>> shared(grid, std::vector<unsigned char>(smem + 16, 0xAB));
    std::vector<std::vector<Warp>> warps(grid);
    std::vector<std::unique_ptr<std::barrier<>>> bars;
    for (unsigned b = 0; b < grid; ++b) {
        warps[b] = std::vector<Warp>((block + 31) / 32);
        bars.emplace_back(new std::barrier<>((std::ptrdiff_t)block));
    }
    std::vector<std::thread> ts;
    for (unsigned b = 0; b < grid; ++b)
        for (unsigned t = 0; t < block; ++t)
            ts.emplace_back([&, t, b] {
                threadIdx.x = t; blockIdx.x = b;
                g_shared = shared[b].data(); g_warps = &warps[b]; g_bar = bars[b].get();
                body(); g_bar->arrive_and_drop(); });
    for (auto& t : ts) t.join();
}
"""

# C entry points per source, called through ctypes; the launch geometry comes from Python
EMULATION_ENTRY = {
    "routing.cu": ({"IN_T": "float", "WARPS_PER_BLOCK": 4}, r"""
extern "C" void route(const IN_T* g, const float* bias, float* w, int* ids, int* tei, int T,
                      int E, int K, int G, int TG, int scoring, int renorm, int mode,
                      float scale, int vpt, int smem) {
    unsigned grid = (T + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK;
#define R(V) if (vpt == V) launch(grid, WARPS_PER_BLOCK * 32, smem, [&] { \
    route_topk_kernel<V>(g, bias, w, ids, tei, T, E, K, G, TG, scoring, renorm, mode, scale); });
    R(1) R(2) R(4) R(8) R(16) R(32)
}"""),
    "align.cu": ({"PREFETCH": 2}, r"""
extern "C" void align(const int* ids, const int* emap, int* sorted, int* eids, int* npost, int* hist,
                      unsigned* bar, int P, int E, int B, int n, int nb, int ign, int grid,
                      int threads, int smem) {
    auto body = [&] { moe_align_kernel(ids, emap, sorted, eids, npost, hist, bar, P, E, B, n, nb,
                                       ign); };
    if (grid == 1) launch(1, threads, smem, body);
    else launch_cooperative(grid, threads, smem, body);
}"""),
    "permute.cu": ({"SCALAR_T": "float", "ROW_WARPS": 2, "UNPERMUTE_THREADS": 32, "PREFETCH": 2},
                   r"""
extern "C" void permute_index(const int* ids, int* off, int* inv, int P, int E, int chunk,
                              int threads, int smem) {
    launch(1, threads, smem, [&] { moe_permute_index_kernel(ids, off, inv, P, E, chunk); });
}
extern "C" void gather(const unsigned* x, const int* inv, unsigned* xg, int P, int K, int words) {
    launch((P + ROW_WARPS - 1) / ROW_WARPS, ROW_WARPS * 32, 0,
           [&] { gather_rows_kernel<unsigned int>(x, inv, xg, P, K, words); });
}
extern "C" void unpermute(const float* y, const float* w, const int* inv, float* out, int T,
                          int K, int H, int vec) {
    int chunks = (H + UNPERMUTE_THREADS * vec - 1) / (UNPERMUTE_THREADS * vec);
#define U(V) if (vec == V) launch(T * chunks, UNPERMUTE_THREADS, 0, [&] { \
    moe_unpermute_kernel<V>(y, w, inv, out, T, K, H, chunks); });
    U(1) U(4)
}"""),
    "activation.cu": ({"SCALAR_T": "float", "ACT_THREADS": 32}, r"""
extern "C" void act(const float* x, float* out, int M, int N, int which, int vec) {
    // which: 0 silu, 1 gelu, 2 gelu_tanh (and mul), 3 swigluoai, 10 + ACT: no-mul
    int width = which < 10 ? N / 2 : N;
    int chunks = (width + ACT_THREADS * vec - 1) / (ACT_THREADS * vec);
#define AM(A, V) if (which == A && vec == V) launch(M * chunks, ACT_THREADS, 0, [&] { \
    act_and_mul_kernel<A, V>(x, out, M, width, chunks); });
#define SW(V) if (which == 3 && vec == V) launch(M * chunks, ACT_THREADS, 0, [&] { \
    swigluoai_and_mul_kernel<V>(x, out, M, width, chunks, 1.702f, 7.0f); });
#define NM(A, V) if (which == 10 + A && vec == V) launch(M * chunks, ACT_THREADS, 0, [&] { \
    act_kernel<A, V>(x, out, M, width, chunks); });
    AM(0, 1) AM(0, 4) AM(1, 1) AM(1, 4) AM(2, 1) AM(2, 4) SW(1) SW(4)
    NM(0, 1) NM(0, 4) NM(1, 4) NM(2, 4) NM(3, 1) NM(3, 4)
}"""),
    # the same kernels in bf16 (x and out as bf16 bits): vLLM's rounding points
    "activation.cu#bf16": ({"SCALAR_T": "__nv_bfloat16", "ACT_THREADS": 32}, r"""
extern "C" void act(const __nv_bfloat16* x, __nv_bfloat16* out, int M, int N, int which, int vec) {
    int width = N / 2;
    int chunks = (width + ACT_THREADS * vec - 1) / (ACT_THREADS * vec);
#define AM(A, V) if (which == A && vec == V) launch(M * chunks, ACT_THREADS, 0, [&] { \
    act_and_mul_kernel<A, V>(x, out, M, width, chunks); });
#define SW(V) if (which == 3 && vec == V) launch(M * chunks, ACT_THREADS, 0, [&] { \
    swigluoai_and_mul_kernel<V>(x, out, M, width, chunks, 1.702f, 7.0f); });
    AM(0, 1) AM(0, 8) AM(1, 1) AM(1, 8) AM(2, 1) AM(2, 8) SW(1) SW(8)
}"""),
    "routing.cu#bf16": ({"IN_T": "__nv_bfloat16", "WARPS_PER_BLOCK": 4}, r"""
extern "C" void route(const IN_T* g, const float* bias, float* w, int* ids, int* tei, int T,
                      int E, int K, int G, int TG, int scoring, int renorm, int mode,
                      float scale, int vpt, int smem) {
    unsigned grid = (T + WARPS_PER_BLOCK - 1) / WARPS_PER_BLOCK;
#define R(V) if (vpt == V) launch(grid, WARPS_PER_BLOCK * 32, smem, [&] { \
    route_topk_kernel<V>(g, bias, w, ids, tei, T, E, K, G, TG, scoring, renorm, mode, scale); });
    R(1) R(2) R(4) R(8) R(16) R(32)
}"""),
    "combine.cu": ({"SCALAR_T": "float", "SUM_THREADS": 32}, r"""
extern "C" void moe_sum(const float* x, float* out, int T, int K, int H, int vec) {
    int chunks = (H + SUM_THREADS * vec - 1) / (SUM_THREADS * vec);
#define S(V) if (vec == V) launch(T * chunks, SUM_THREADS, 0, [&] { \
    moe_sum_kernel<V>(x, out, T, K, H, chunks); });
    S(1) S(4)
}
extern "C" void moe_sum_live(const float* x, const int* ids, const int* emap, int map_len,
                             float* out, int T, int K, int H, int vec) {
    int chunks = (H + SUM_THREADS * vec - 1) / (SUM_THREADS * vec);
#define SL(V) if (vec == V) launch(T * chunks, SUM_THREADS, 0, [&] { \
    moe_sum_live_kernel<V>(x, ids, emap, map_len, out, T, K, H, chunks); });
    SL(1) SL(4)
}"""),
}


def _gxx_why_not(tmp) -> str:
    import shutil
    import subprocess

    if shutil.which("g++") is None:
        return "no g++ on this machine"
    (tmp / "emu.h").write_text(EMULATION_HEADER)
    (tmp / "probe.cpp").write_text('#include "emu.h"\nint main() { return 0; }\n')
    r = subprocess.run(["g++", "-std=c++20", "-pthread", "-I", str(tmp), str(tmp / "probe.cpp"),
                        "-o", str(tmp / "probe")], capture_output=True, text=True)
    return "" if r.returncode == 0 else f"g++ cannot build the emulation header: {r.stderr[:300]}"


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """cu_name -> ctypes library of that source built for the CPU emulation."""
    import ctypes
    import re
    import subprocess

    tmp = tmp_path_factory.mktemp("cuda_emulation")
    why = _gxx_why_not(tmp)
    if why:
        pytest.skip(why)
    libs = {}

    def get(cu):
        if cu not in libs:
            defines, entry = EMULATION_ENTRY[cu]   # "name.cu#variant": other defines
            src = C.source_text(cu.split("#")[0], defines)
            src = re.sub(r"#include <cuda_(fp16|bf16)\.h>", "", src)
            src = re.sub(r"extern __shared__ (\w+) smem\[\];", r"\1* smem = (\1*)g_shared;", src)
            src = src.replace('extern "C" __global__', "__global__")
            stem = cu.replace("#", "_")
            cpp = tmp / (stem + ".cpp")
            cpp.write_text('#include "emu.h"\n' + src + entry + "\n")
            so = tmp / (stem + ".so")
            r = subprocess.run(["g++", "-std=c++20", "-O1", "-w", "-shared", "-fPIC", "-pthread",
                                "-I", str(tmp), str(cpp), "-o", str(so)],
                               capture_output=True, text=True)
            assert r.returncode == 0, f"{cu} does not build for the emulation:\n{r.stderr[:3000]}"
            libs[cu] = ctypes.CDLL(str(so))
        return libs[cu]
    return get


def _p(a):
    import ctypes

    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.simulator
def test_emulated_align_and_permute(emulated):
    import numpy as np

    import reference
    from cuda_kernels.cupy import align as ck_align
    from cuda_kernels.cupy import permute as ck_perm

    lib_align, lib = emulated("align.cu"), emulated("permute.cu")
    rng = np.random.default_rng(7)

    def ids_of(T, E, K):
        return np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)

    bar = np.zeros(1, np.uint32)  # the grid barrier's word, kept across launches as on the GPU

    def align(ids, B, E, emap=None, pad=False, ign=False, large=False):
        P = ids.size
        n = ck_align.max_num_tokens_padded(P, E, B, pad)
        out = (np.full(n, -7, np.int32), np.full(-(-n // B), -7, np.int32), np.full(1, -7, np.int32))
        G, W, smem = ck_align._align_geometry(P, E, 1)  # one block
        if large:  # a cooperative grid of small blocks: 5 blocks of 2 warps (one round of
            # 32-slot steps per warp), or 3 blocks of 1 warp (several rounds per warp)
            G, W = (5, 2) if large == 1 else (3, 1)
            smem = (W * E + 2 * E + 33) * 4
        hist = np.full(G * E, -7, np.int32)
        lib_align.align(_p(ids), _p(emap), *map(_p, out), _p(hist), _p(bar), P, E, B, n, out[1].size,
                  int(ign), G, W * 32, smem)
        assert bar[0] & 0x7FFFFFFF == 0, "the barrier word's low bits come back to 0"
        return out

    cases = [(1, 8, 2, 4, None, False, False), (3, 32, 2, 32, None, False, False),
             (33, 16, 3, 8, None, True, False), (100, 257, 6, 16, None, False, False),
             (0, 8, 2, 4, None, False, False), (50, 5, 1, 1, None, False, False),
             (40, 1024, 8, 16, None, False, False)]
    for placement in ("linear", "round_robin"):
        emap = reference.determine_expert_map(4, 1, 32, placement)[1].astype(np.int32)
        cases += [(60, 32, 4, 8, emap, False, ign) for ign in (False, True)]
    for T, E, K, B, emap, pad, ign in cases:
        ids = ids_of(T, E, K)
        want = reference.moe_align_block_size(ids, B, E, emap, pad, ign)
        for large in (0, 1, 2):
            got = align(ids, B, E, emap, pad, ign, large)
            for g, w, name in zip(got, want, ("sorted_token_ids", "expert_ids", "num_post")):
                np.testing.assert_array_equal(
                    g, w, err_msg=f"{name} T={T} E={E} K={K} B={B} grid variant {large}")
    # slots routed nowhere (vLLM's -1) and ids past E: skipped, with and without a map
    ids = ids_of(40, 16, 3)
    ids[3], ids[7, 1], ids[9, 0] = -1, -1, 19
    emap = reference.determine_expert_map(2, 1, 16)[1].astype(np.int32)
    for m, ign in ((None, False), (emap, False), (emap, True)):
        want = reference.moe_align_block_size(ids, 4, 16, m, False, ign)
        for large in (0, 1, 2):
            for g, w in zip(align(ids, 4, 16, m, False, ign, large), want):
                np.testing.assert_array_equal(g, w, err_msg=f"-1 ids, map {m is not None}")
    one = np.full((70, 1), 3, np.int32)  # every slot on one expert
    for large in (0, 1, 2):
        for g, w in zip(align(one, 16, 8, large=large), reference.moe_align_block_size(one, 16, 8)):
            np.testing.assert_array_equal(g, w)

    for T, E, K, H in ((1, 8, 2, 4), (37, 16, 3, 9), (130, 64, 4, 12)):
        x = rng.standard_normal((T, H)).astype(np.float32)
        ids = ids_of(T, E, K)
        P = T * K
        W, chunk, smem = ck_perm._group_geometry(P, E + 1)
        off, inv = np.full(E + 1, -7, np.int32), np.full(P, -7, np.int32)
        lib.permute_index(_p(ids), _p(off), _p(inv), P, E, chunk, W * 32, smem)
        xg = np.full((P, H), np.nan, np.float32)
        lib.gather(_p(x), _p(inv), _p(xg), P, K, H)
        want = reference.moe_permute(x, ids, E)
        for g, w in zip((xg, off, inv), want):
            np.testing.assert_array_equal(g, w)
        y = rng.standard_normal((P, H)).astype(np.float32)
        wts = rng.random((T, K)).astype(np.float32)
        for vec in (1, 4) if H % 4 == 0 else (1,):
            out = np.full((T, H), np.nan, np.float32)
            lib.unpermute(_p(y), _p(wts), _p(inv), _p(out), T, K, H, vec)
            np.testing.assert_array_equal(out, reference.moe_unpermute(y, wts, inv))


@pytest.mark.simulator
def test_emulated_routing(emulated):
    import ctypes

    import numpy as np

    import reference
    from cuda_kernels.cupy import routing as ck_route

    lib = emulated("routing.cu")
    lib16 = emulated("routing.cu#bf16")
    rng = np.random.default_rng(8)
    TOPK, GROUPED = ck_route.MODE_TOPK, ck_route.MODE_GROUPED

    def route(x, K, G=1, TG=1, scoring=0, bias=None, renorm=True, scale=1.0, mode=TOPK):
        T, E = x.shape
        w, ids, tei = (np.full((T, K), np.nan, np.float32), np.full((T, K), -7, np.int32),
                       np.full((T, K), -7, np.int32))
        rowf = (E + E // 32 + 2) & ~1
        smem = 4 * (rowf + 2 * G) * 4 if G > 1 else 0
        which = lib16 if x.dtype == reference._checks.FLOAT_DTYPES[3] else lib
        which.route(_p(x), _p(bias), _p(w), _p(ids), _p(tei), T, E, K, G, TG, scoring,
                    int(renorm), mode, ctypes.c_float(scale), ck_route._vpt(E), smem)
        return w, ids, tei

    def same(got, want, what):
        np.testing.assert_array_equal(got[1], want[1], err_msg=what)
        np.testing.assert_array_equal(np.isnan(got[0]), np.isnan(want[0]), err_msg=what)
        ok = ~np.isnan(want[0])
        assert np.abs(got[0][ok] - want[0][ok]).max(initial=0) < 1e-6, what

    for T, E, K in ((1, 8, 2), (9, 60, 4), (5, 257, 9), (3, 1000, 32), (5, 16, 1)):
        x = rng.standard_normal((T, E)).astype(np.float32)
        for renorm in (False, True):
            for scoring, name in ((0, "softmax"), (1, "sigmoid")):
                got = route(x, K, scoring=scoring, renorm=renorm)
                want = reference.fused_topk(None, x, K, renorm, scoring_func=name)
                same(got, want, f"fused_topk {name} T={T} E={E} K={K}")
                np.testing.assert_array_equal(got[2], want[2])
        b = (0.1 * rng.standard_normal(E)).astype(np.float32)
        for scoring, name in ((0, "softmax"), (1, "sigmoid")):
            same(route(x, K, scoring=scoring, bias=b, scale=2.5),
                 reference.fused_topk_bias(None, x, name, b, K, True, routed_scaling_factor=2.5),
                 f"fused_topk_bias {name} E={E}")
    for E, K, G, TG in ((16, 2, 8, 2), (256, 8, 8, 4), (512, 22, 1, 1), (96, 5, 6, 3)):
        for scoring in (0, 1):
            for with_bias in (False, True):
                x = rng.standard_normal((7, E)).astype(np.float32)
                b = (0.1 * rng.standard_normal(E)).astype(np.float32) if with_bias else None
                want = reference.grouped_topk(None, x, K, True, G, TG, ("softmax", "sigmoid")[scoring],
                                              2.5, b)
                same(route(x, K, G, TG, scoring, b, True, 2.5, GROUPED), want,
                     f"grouped_topk E={E} K={K} G={G} TG={TG} scoring={scoring} bias={with_bias}")
    # non-finite logits: fused_topk zeroes non-finite scores (rows of ids 0..K-1, weight 0)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    x[1, 7], x[2, 3], x[3, :], x[4, :], x[5, ::2] = np.nan, np.inf, -np.inf, 0.5, 2.0
    for scoring, name in ((0, "softmax"), (1, "sigmoid")):
        for renorm in (False, True):
            same(route(x, 4, scoring=scoring, renorm=renorm),
                 reference.fused_topk(None, x, 4, renorm, scoring_func=name),
                 f"NaN / inf / ties {name}")
    # grouped_topk: invalid experts ranked last at weight 0, rows with none valid 1/K or 0
    x = rng.standard_normal((6, 64)).astype(np.float32)
    x[0, :8], x[4, 9], x[5, 20:30], x[2] = np.nan, np.nan, np.nan, np.nan
    for b in (None, (0.1 * rng.standard_normal(64)).astype(np.float32)):
        for scoring, name in ((0, "softmax"), (1, "sigmoid")):
            for renorm in (False, True):
                same(route(x, 4, 8, 3, scoring, b, renorm, 1.5, GROUPED),
                     reference.grouped_topk(None, x, 4, renorm, 8, 3, name, 1.5, b),
                     f"{name} with NaN logits, bias {b is not None}")
    # bf16 logits: grouped_topk rounds its softmax scores to bf16 (vLLM's dtype); the
    # single-group non-finite case of vLLM's test
    BF16 = reference._checks.FLOAT_DTYPES[3]
    xb = rng.standard_normal((9, 256)).astype(BF16)
    for scoring, name in ((0, "softmax"), (1, "sigmoid")):
        same(route(xb, 8, 8, 4, scoring, None, True, 2.5, GROUPED),
             reference.grouped_topk(None, xb, 8, True, 8, 4, name, 2.5), f"bf16 grouped {name}")
        same(route(xb, 8, scoring=scoring), reference.fused_topk(None, xb, 8, True,
                                                                scoring_func=name),
             f"bf16 fused_topk {name}")
    for num_finite in (0, 15):
        for renorm in (False, True):
            xn = np.full((1, 512), np.nan, BF16)
            xn[0, :num_finite] = np.arange(num_finite)
            xn[0, num_finite], xn[0, num_finite + 1] = np.inf, -np.inf
            z = np.zeros(512, np.float32)
            same(route(xn, 16, 1, 1, 1, z, renorm, 2.5, GROUPED),
                 reference.grouped_topk(None, xn, 16, renorm, 1, 1, "sigmoid", 2.5, z),
                 f"single group non-finite {num_finite} renorm {renorm}")


@pytest.mark.simulator
def test_emulated_activation_and_combine(emulated):
    import numpy as np

    import reference

    act, comb = emulated("activation.cu"), emulated("combine.cu")
    rng = np.random.default_rng(9)
    names = {0: "silu", 1: "gelu", 2: "gelu_tanh", 3: "swigluoai"}
    for M, N in ((1, 2), (5, 16), (3, 72)):
        x = (4 * rng.standard_normal((M, N))).astype(np.float32)
        x[0, 0] = 9.0  # past swigluoai's limit
        for which, name in names.items():
            for vec in (1, 4):
                if (N // 2) % vec:
                    continue
                out = np.full((M, N // 2), np.nan, np.float32)
                act.act(_p(x), _p(out), M, N, which, vec)
                want = reference.apply_activation(x, name, True)
                assert np.abs(out - want).max() <= 1e-6 * np.abs(want).max(), (name, M, N, vec)
        for a, name in ((0, "silu"), (1, "gelu"), (2, "gelu_tanh"), (3, "relu2")):
            vec = 4 if N % 4 == 0 else 1
            if a in (1, 2) and vec == 1:
                continue  # not instantiated in the entry point
            out = np.full((M, N), np.nan, np.float32)
            act.act(_p(x), _p(out), M, N, 10 + a, vec)
            want = reference.apply_activation(x, name, False)
            assert np.abs(out - want).max() <= 1e-6 * np.abs(want).max(), (name, M, N, vec)
    for T, K, H in ((1, 2, 5), (3, 8, 40), (2, 22, 36)):
        x = rng.standard_normal((T, K, H)).astype(np.float32)
        for vec in (1, 4) if H % 4 == 0 else (1,):
            out = np.full((T, H), np.nan, np.float32)
            comb.moe_sum(_p(x), _p(out), T, K, H, vec)
            np.testing.assert_array_equal(out, reference.moe_sum(x))  # slot order: bitwise
    # pad-aware: slots with id -1 (or a non-local expert) never read (NaN rows here)
    x = rng.standard_normal((5, 3, 40)).astype(np.float32)
    ids = np.array([[0, 1, 2], [-1, 3, 1], [-1, -1, -1], [2, -1, 0], [3, 3, 1]], np.int32)
    for emap in (None, np.array([0, -1, 1, 2], np.int32)):
        live = reference.combine.slot_is_live(ids, emap)
        xp = np.where(live[:, :, None], x, np.nan).astype(np.float32)
        for vec in (1, 4):
            out = np.full((5, 40), np.nan, np.float32)
            comb.moe_sum_live(_p(xp), _p(ids), _p(emap), 0 if emap is None else 4, _p(out),
                              5, 3, 40, vec)
            np.testing.assert_array_equal(out, reference.moe_sum(xp, ids, emap))
    # bf16: vLLM's rounding points (act(gate) rounded before the multiply), bit for bit but
    # for the CPU's expf / erff ulps against NumPy's (a few % for gelu; one rounding of
    # act(gate) * up instead of two differs in ~30% of the elements)
    act16 = emulated("activation.cu#bf16")
    BF16 = reference._checks.FLOAT_DTYPES[3]
    x = (3 * rng.standard_normal((6, 256))).astype(BF16)
    for which, name in names.items():
        for vec in (1, 8):
            out = np.zeros((6, 128), BF16)
            act16.act(_p(x), _p(out), 6, 256, which, vec)
            want = reference.apply_activation(x, name, True)
            assert (out.view(np.uint16) != want.view(np.uint16)).mean() < 0.05, (name, vec)
