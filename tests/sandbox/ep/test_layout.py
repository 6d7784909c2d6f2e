"""The fused all-to-all-v layout: the NumPy twins (sandbox/ep/layout.py) against a loop, the
fused dispatch/combine against the stage path on the CPU communicator, and (GPU) the CuPy
kernels (cuda_kernels/cupy/ep_layout.py) against the NumPy twins; multigpu: the two
implementations against each other over NCCL.

    T tokens, K top-k, W ranks, epr experts per rank, S entries per token
"""
import numpy as np
import pytest

from sandbox.ep import launch
from sandbox.ep import layout as L
from sandbox.ep.checks import run_impl_parity

# (T, E, K, W, slot_rows): one token, T not a multiple of anything, W > K, W = 1, empty batch
SHAPES = [(1, 8, 2, 2, False), (37, 16, 4, 2, False), (37, 16, 4, 4, True),
          (50, 64, 3, 8, False), (50, 64, 3, 8, True), (20, 8, 4, 1, False),
          (0, 16, 4, 2, False), (0, 16, 4, 2, True), (129, 32, 8, 4, False)]


def _ids(T, E, K, seed):
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)


def _loop_layout(ids, epr, W, slot_rows):
    """The dumbest correct layout: buckets per entry, then positions bucket by bucket."""
    T, K = ids.shape
    S = L.entries_per_token(W, K, slot_rows)
    buckets = []
    for t in range(T):
        if slot_rows:
            buckets += [int(e) // epr if 0 <= e < W * epr else W for e in ids[t]]
        else:
            dests = sorted({int(e) // epr for e in ids[t] if 0 <= e < W * epr})
            buckets += dests + [W] * (S - len(dests))
    inv, pos = [0] * len(buckets), 0
    for b in range(W + 1):
        for e, be in enumerate(buckets):
            if be == b:
                inv[e], pos = pos, pos + 1
    counts = [buckets.count(p) for p in range(W)]
    return np.array(counts), np.array(inv, dtype=np.int64)


@pytest.mark.parametrize("T,E,K,W,slot", SHAPES)
def test_numpy_layout_matches_loop(T, E, K, W, slot):
    ids = _ids(T, E, K, seed=T + 7 * W)
    if T > 2:
        ids[1, 0] = -1            # an id no rank holds: "nowhere"
    epr = E // W
    counts2, inv, src, n_real = L.ep_layout(ids, epr, W, W - 1, slot)
    want_counts, want_inv = _loop_layout(ids, epr, W, slot)
    assert counts2.dtype == np.int64 and inv.dtype == np.int32 and src.dtype == np.int32
    assert counts2.shape == (2, W, 1) and counts2[0, :, 0].tolist() == want_counts.tolist()
    assert counts2[1, W - 1, 0] == counts2[0, W - 1, 0] and counts2[1].sum() == counts2[0, W - 1, 0]
    assert inv.tolist() == want_inv.tolist()
    assert np.array_equal(src[inv], np.arange(inv.size))
    assert int(n_real[0]) == int(want_counts.sum())


@pytest.mark.parametrize("chunks", [2, 5])
def test_numpy_layout_chunk_counts(chunks):
    T, E, K, W = 37, 16, 4, 4
    ids = _ids(T, E, K, seed=9)
    for slot in (False, True):
        counts2, inv, src, n_real = L.ep_layout(ids, E // W, W, 1, slot, chunks)
        bounds = L.chunk_bounds(T, chunks)
        for c in range(chunks):
            part, _ = _loop_layout(ids[bounds[c]:bounds[c + 1]], E // W, W, slot)
            assert counts2[0, :, c].tolist() == part.tolist()
        assert counts2[0].sum() == int(n_real[0])


@pytest.mark.parametrize("slot", [False, True])
def test_numpy_gather_and_combine(slot):
    T, E, K, W, H = 23, 16, 4, 4, 12
    rng = np.random.default_rng(3)
    ids = _ids(T, E, K, seed=5)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    epr = E // W
    counts2, inv, src, n_real = L.ep_layout(ids, epr, W, 0, slot)
    n = int(n_real[0])
    x_send, ids_send, w_send = L.ep_gather(x, ids, w, inv, n_real, epr, slot)
    S = L.entries_per_token(W, K, slot)
    for pos in range(n):
        t, j = divmod(int(src[pos]), S)
        assert np.array_equal(x_send[pos], x[t])
        if slot:
            assert ids_send[pos] == ids[t, j] % epr and w_send[pos] == w[t, j]
        else:
            assert np.array_equal(ids_send[pos], ids[t]) and np.array_equal(w_send[pos], w[t])
    y = x_send[:n] * 3
    weights = w if slot else None
    out = L.ep_combine(y, weights, inv, n, T)
    want = np.zeros((T, H))
    for t in range(T):
        for j in range(S):
            p = inv[t * S + j]
            if p < n:
                want[t] += (w[t, j] if slot else 1.0) * y[p]
    assert np.allclose(out, want, rtol=1e-6, atol=1e-6)


def test_numpy_count_experts():
    ids = _ids(40, 16, 4, seed=1)
    ids[0, 0] = -1
    counts = np.zeros(16, dtype=np.int64)
    L.ep_count_experts(ids, counts)
    L.ep_count_experts(ids, counts)
    want = 2 * np.bincount(ids[ids >= 0].reshape(-1), minlength=16)
    assert counts.tolist() == want.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_matches_stages_on_cpu_communicator(world_size):
    per_rank = launch(run_impl_parity, world_size, timeout=60)
    for res in (d for rank in per_rank for d in rank):
        assert res["impl"] == "fused", res
        assert res["x"] and res["ids"] and res["w"] and res["counts"], res
        assert res["out_vs_stages"] <= 1e-6 and res["chunked_vs_stages"] <= 1e-6, res
        assert res["chunked_x"], res
        assert not np.isnan(res["out_vs_loop"]) and res["out_vs_loop"] <= res["tolerance"], res
        assert res["reuse_vs_fused"] == 0.0 and not res["lean"], res


# ----------------------------------------------------------------------------- NVRTC
def _ep_compile_cases():
    import cuda_kernels.cupy.ep_layout  # noqa: F401  (registers its cases at import)
    from cuda_kernels.cupy import _compile as C

    return [c for c in C.COMPILE_CASES if c.cu_name == "ep_layout.cu"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_ep_layout_compiles_with_nvrtc(arch):
    """Every instantiation ep_layout.py launches compiles (tests/test_cupy_nvrtc.py's list of
    kernel modules is not this task's file, so the check of this module lives here)."""
    from cuda_kernels.cupy import _compile as C

    ok, why = C.nvrtc_available()
    if not ok:
        pytest.skip(f"cuda.core/NVRTC unavailable: {why}")
    cases = _ep_compile_cases()
    assert len(cases) == 1 + len(C.float_dtypes())
    for case in cases:
        cubin = C.compile_check(case.cu_name, case.defines, case.name_expressions, arch,
                                case.options)
        assert isinstance(cubin, bytes) and len(cubin) > 0


# ----------------------------------------------------------------------------- GPU
def _cupy_kernels():
    from cuda_kernels.cupy import _compile as C

    ok, why = C.availability()
    if not ok:
        pytest.skip(f"no CUDA GPU: {why}")
    import cuda_kernels.cupy.ep_layout as K

    return K, C


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,K,W,slot", SHAPES + [(4096, 256, 8, 2, False),
                                                  (4096, 256, 8, 2, True)])
def test_cupy_layout_gather_combine_match_numpy(T, E, K, W, slot):
    import ml_dtypes

    kern, C = _cupy_kernels()
    C.POISON = True
    try:
        bf16 = np.dtype(ml_dtypes.bfloat16)
        rng = np.random.default_rng(T + W)
        ids = _ids(T, E, K, seed=T + 7 * W)
        if T > 2:
            ids[1, 0] = -1
        epr, H = E // W, 136
        x = rng.standard_normal((T, H)).astype(bf16)
        w = rng.random((T, K)).astype(np.float32)
        want = L.ep_layout(ids, epr, W, W - 1, slot, 3)
        d_ids = C.to_device(ids)
        got = kern.ep_layout(d_ids, epr, W, W - 1, slot, 3)
        for g, h in zip(got, want):
            assert np.array_equal(C.to_host(g), h)
        n = int(want[3][0])
        gx, gi, gw = kern.ep_gather(C.to_device(x), d_ids, C.to_device(w), got[1], got[3],
                                    epr, slot)
        hx, hi, hw = L.ep_gather(x, ids, w, want[1], want[3], epr, slot)
        assert np.array_equal(C.to_host(gx)[:n].view(np.uint16), hx[:n].view(np.uint16))
        assert np.array_equal(C.to_host(gi)[:n], hi[:n])
        assert np.array_equal(C.to_host(gw)[:n], hw[:n])
        y = rng.standard_normal((n, H)).astype(bf16)
        weights = w if slot else None
        out = C.to_host(kern.ep_combine(C.to_device(y), None if weights is None else
                                        C.to_device(weights), got[1], n, T))
        ref = L.ep_combine(y, weights, want[1], n, T)
        if T > 2:   # a token range into a given output: the rest stays as it was
            d_out = C.to_device(np.zeros((T, H), dtype=bf16))
            kern.ep_combine(C.to_device(y), None if weights is None else C.to_device(weights),
                            got[1], n, T, (1, T - 1), d_out)
            part = C.to_host(d_out)
            assert np.array_equal(part[1:T - 1].view(np.uint16), ref[1:T - 1].view(np.uint16))
            assert not part[[0, T - 1]].view(np.uint16).any()
        assert not np.isnan(out.astype(np.float32)).any()
        assert np.array_equal(out.view(np.uint16), ref.view(np.uint16)) or \
            C.rel_err(out.astype(np.float32), ref.astype(np.float32)) <= 1e-2
    finally:
        C.POISON = False


@pytest.mark.gpu
def test_cupy_count_experts_is_exact():
    kern, C = _cupy_kernels()
    import cupy

    ids = _ids(4096, 256, 8, seed=2)
    ids[0, 0] = -1
    counts = cupy.zeros(256, dtype=cupy.int64)
    kern.ep_count_experts(C.to_device(ids), counts)
    kern.ep_count_experts(C.to_device(ids), counts)
    assert C.to_host(counts).tolist() == (2 * np.bincount(ids[ids >= 0], minlength=256)).tolist()


@pytest.mark.multigpu
def test_fused_matches_stages_over_nccl():
    try:
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        gpus = 0
    if gpus < 2:
        pytest.skip("needs two GPUs")
    from sandbox.registry import get_backend

    backend = "cupy" if get_backend("cupy").ok else "reference"
    per_rank = launch(run_impl_parity, 2, backend="nccl", args=(backend,), timeout=120)
    for res in (d for rank in per_rank for d in rank):
        assert res["impl"] == "fused", res
        assert res["x"] and res["ids"] and res["w"] and res["counts"], res
        assert res["out_vs_stages"] <= 1e-6 and res["chunked_vs_stages"] <= 1e-6, res
        assert res["chunked_x"], res
        assert not np.isnan(res["out_vs_loop"]) and res["out_vs_loop"] <= res["tolerance"], res
        # the lean GPU path (plans, reused buffers) ran, and a second call of the same shape
        # with the tokens permuted gives each token the same output, bit for bit
        assert res["lean"] and res["reuse_vs_fused"] == 0.0, res


# ----------------------------------------------------------------------------- CPU emulation
# ep_layout.cu compiled for the CPU with the CUDA emulation of tests/test_cupy_nvrtc.py (one
# std::thread per CUDA thread): the kernels' logic against the NumPy twins, without a GPU.
_EMU_ENTRY = r"""
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    std::lock_guard<std::mutex> l(g_atomic); unsigned long long o = *p; *p = o + v; return o; }
"""
_EMU_CALLS = r"""
extern "C" void layout(const int* ids, int* inv, int* src, long long* counts2, int* n_real,
                       int T, int K, int S, int W, int epr, int slot, int rank, int C, int nt,
                       int smem) {
    launch(1, nt, smem, [&] { ep_layout_kernel(ids, inv, src, counts2, n_real, T, K, S, W, epr,
                                               slot, rank, C); });
}
extern "C" void gather(const unsigned* x, const int* ids, const float* w, const int* inv,
                       const int* n_real, unsigned* xs, int* is, float* ws, int T, int K, int S,
                       int epr, int slot, int words) {
    launch(T, GATHER_THREADS, 256, [&] { ep_gather_kernel<unsigned int>(x, ids, w, inv, n_real,
                                         xs, is, ws, T, K, S, epr, slot, words); });
}
extern "C" void combine(const float* y, const float* w, const int* inv, float* out, int t0,
                        int t1, int S, int H, int n, int vec) {
    int chunks = (H + COMBINE_THREADS * vec - 1) / (COMBINE_THREADS * vec);
#define CB(V) if (vec == V) launch((t1 - t0) * chunks, COMBINE_THREADS, 0, [&] { \
    ep_combine_kernel<V>(y, w, inv, out, t0, t1, S, H, n, chunks); });
    CB(1) CB(4)
}
extern "C" void count(const int* ids, unsigned long long* counts, int N, int E, int blocks) {
    launch(blocks, COUNT_THREADS, E * 4, [&] { ep_count_experts_kernel(ids, counts, N, E); });
}
"""


@pytest.fixture(scope="module")
def emulated_ep(tmp_path_factory):
    import ctypes
    import pathlib
    import re
    import subprocess

    src_nvrtc = (pathlib.Path(__file__).parents[2] / "cupy" / "test_nvrtc.py").read_text()
    m = re.search(r'EMULATION_HEADER = r"""(.*?)"""', src_nvrtc, re.S)
    if m is None:
        pytest.skip("no CUDA emulation header in tests/test_cupy_nvrtc.py")
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine")
    from cuda_kernels.cupy import _compile as C

    tmp = tmp_path_factory.mktemp("ep_emulation")
    (tmp / "emu.h").write_text(m.group(1))
    defines = {"SCALAR_T": "float", "LAYOUT_THREADS": 64, "GATHER_THREADS": 32,
               "COMBINE_THREADS": 32, "COUNT_THREADS": 32}
    src = C.source_text("ep_layout.cu", defines)
    src = re.sub(r"#include <cuda_(fp16|bf16)\.h>", "", src)
    src = re.sub(r"extern __shared__ (\w+(?: \w+)?) (\w+)\[\];", r"\1* \2 = (\1*)g_shared;", src)
    src = re.sub(r"__shared__ int pos_s\[MAX_S\];", "int* pos_s = (int*)g_shared;", src)
    src = src.replace('extern "C" __global__', "__global__")
    cpp = tmp / "ep_layout.cpp"
    cpp.write_text('#include "emu.h"\n' + _EMU_ENTRY + src + _EMU_CALLS)
    so = tmp / "ep_layout.so"
    r = subprocess.run(["g++", "-std=c++20", "-O1", "-w", "-shared", "-fPIC", "-pthread", "-I",
                        str(tmp), str(cpp), "-o", str(so)], capture_output=True, text=True)
    if r.returncode and "barrier" in r.stderr and "No such file" in r.stderr:
        pytest.skip("g++ without C++20 <barrier>")
    assert r.returncode == 0, r.stderr[:3000]
    return ctypes.CDLL(str(so))


def _p(a):
    import ctypes

    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.slow
@pytest.mark.simulator
@pytest.mark.parametrize("T,E,K,W,slot", [(1, 8, 2, 2, False), (37, 16, 4, 2, False),
                                          (37, 16, 4, 4, True), (50, 64, 3, 8, False),
                                          (70, 16, 4, 1, True), (0, 16, 4, 2, False)])
def test_emulated_kernels_match_numpy(emulated_ep, T, E, K, W, slot):
    lib = emulated_ep
    rng = np.random.default_rng(T + W)
    ids = _ids(T, E, K, seed=T + 3 * W)
    if T > 2:
        ids[1, 0] = -1
    epr, H, rank = E // W, 8, W - 1
    S = L.entries_per_token(W, K, slot)
    for C in (1, 3):   # one chunk: counts from the scan; more: per-chunk atomics
        want = L.ep_layout(ids, epr, W, rank, slot, C)
        counts2 = np.full((2, W, C), -7, np.int64)
        inv, src = np.full(T * S, -7, np.int32), np.full(T * S, -7, np.int32)
        n_real = np.full(1, -7, np.int32)
        nt = 64
        smem = ((W + 1) * nt + 32 + W + 2 + W * C) * 4
        lib.layout(_p(ids), _p(inv), _p(src), _p(counts2), _p(n_real), T, K, S, W, epr,
                   int(slot), rank, C, nt, smem)
        for g, w in zip((counts2, inv, src, n_real), want):
            np.testing.assert_array_equal(g, w)
    n = int(n_real[0])
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    xs = np.full((T * S, H), np.nan, np.float32)
    meta = (T * S,) if slot else (T * S, K)
    i_s, w_s = np.full(meta, -7, np.int32), np.full(meta, np.nan, np.float32)
    lib.gather(_p(x), _p(ids), _p(w), _p(inv), _p(n_real), _p(xs), _p(i_s), _p(w_s), T, K, S,
               epr, int(slot), H)
    hx, hi, hw = L.ep_gather(x, ids, w, inv, n_real, epr, slot)
    np.testing.assert_array_equal(xs[:n], hx[:n])
    np.testing.assert_array_equal(i_s[:n], hi[:n])
    np.testing.assert_array_equal(w_s[:n], hw[:n])
    y = rng.standard_normal((n, H)).astype(np.float32)
    weights = w if slot else None
    for vec in (1, 4):
        out = np.full((T, H), np.nan, np.float32)
        lib.combine(_p(y), _p(weights), _p(inv), _p(out), 0, T, S, H, n, vec)
        np.testing.assert_array_equal(out, L.ep_combine(y, weights, inv, n, T))
    if T > 2:   # a token range: the other rows stay as they were
        out = np.full((T, H), 5.0, np.float32)
        lib.combine(_p(y), _p(weights), _p(inv), _p(out), 1, T - 1, S, H, n, 4)
        np.testing.assert_array_equal(out[1:T - 1], L.ep_combine(y, weights, inv, n, T)[1:T - 1])
        assert (out[[0, T - 1]] == 5.0).all()
    counts = np.zeros(E, np.uint64)
    lib.count(_p(ids), _p(counts), ids.size, E, 2)
    np.testing.assert_array_equal(counts, np.bincount(ids[ids >= 0], minlength=E))
