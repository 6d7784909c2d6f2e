"""The CuPy kernels of the fused all-to-all-v layout (cuda_kernels/cupy/ep_layout.py,
ep_layout.cu) against their NumPy twins (sandbox/ep/layout.py): every instantiation compiles
with NVRTC (CPU, slow), the kernels run on the CPU emulator of tests/emulator (slow) and on a
GPU (`gpu`, outputs poisoned), bit for bit.

    T tokens, K top-k, W ranks, epr experts per rank, S entries per token
"""
import numpy as np
import pytest

from cuda_kernels.cupy import _arrays as A
from cuda_kernels.cupy import _script as S
from sandbox.ep import layout as L
from tests.emulator import build_library, ptr
from tests.oracles import distinct_topk_ids
from tests.support import EP_LAYOUT_SHAPES as SHAPES


def _ids(T, E, K, seed):
    return distinct_topk_ids(np.random.default_rng(seed), T, E, K)


# ----------------------------------------------------------------------------- NVRTC
def _ep_compile_cases():
    import cuda_kernels.cupy.ep_layout  # noqa: F401  (registers its cases at import)
    from cuda_kernels.cupy import _compile as C

    return [c for c in C.COMPILE_CASES if c.cu_name == "ep_layout.cu"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_ep_layout_compiles_with_nvrtc(arch):
    """Every instantiation ep_layout.py launches compiles, each instantiation a case (one per
    float dtype and the counts' kernel)."""
    from cuda_kernels.cupy import _compile as C

    ok, why = C.nvrtc_available()
    if not ok:
        pytest.skip(f"cuda.core/NVRTC unavailable: {why}")
    cases = _ep_compile_cases()
    assert len(cases) == 1 + len(A.float_dtypes())
    for case in cases:
        cubin = C.compile_check(case.cu_name, case.defines, case.name_expressions, arch,
                                case.options)
        assert isinstance(cubin, bytes) and len(cubin) > 0


# ----------------------------------------------------------------------------- GPU
def _cupy_kernels():
    from cuda_kernels.cupy import _compile as C

    ok, why = A.availability()
    if not ok:
        pytest.skip(f"no CUDA GPU: {why}")
    import cuda_kernels.cupy.ep_layout as K

    return K, C


@pytest.mark.gpu
@pytest.mark.usefixtures("cupy_poison")
@pytest.mark.parametrize("T,E,K,W,slot", SHAPES + [(4096, 256, 8, 2, False),
                                                  (4096, 256, 8, 2, True)])
def test_cupy_layout_gather_combine_match_numpy(T, E, K, W, slot):
    import ml_dtypes

    kern, C = _cupy_kernels()
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(T + W)
    ids = _ids(T, E, K, seed=T + 7 * W)
    if T > 2:
        ids[1, 0] = -1
    epr, H = E // W, 136
    x = rng.standard_normal((T, H)).astype(bf16)
    w = rng.random((T, K)).astype(np.float32)
    want = L.ep_layout(ids, epr, W, W - 1, slot, 3)
    d_ids = A.to_device(ids)
    got = kern.ep_layout(d_ids, epr, W, W - 1, slot, 3)
    for g, h in zip(got, want):
        assert np.array_equal(A.to_host(g), h)
    n = int(want[3][0])
    gx, gi, gw = kern.ep_gather(A.to_device(x), d_ids, A.to_device(w), got[1], got[3],
                                epr, slot)
    hx, hi, hw = L.ep_gather(x, ids, w, want[1], want[3], epr, slot)
    assert np.array_equal(A.to_host(gx)[:n].view(np.uint16), hx[:n].view(np.uint16))
    assert np.array_equal(A.to_host(gi)[:n], hi[:n])
    assert np.array_equal(A.to_host(gw)[:n], hw[:n])
    y = rng.standard_normal((n, H)).astype(bf16)
    weights = w if slot else None
    out = A.to_host(kern.ep_combine(A.to_device(y), None if weights is None else
                                    A.to_device(weights), got[1], n, T))
    ref = L.ep_combine(y, weights, want[1], n, T)
    if T > 2:   # a token range into a given output: the rest stays as it was
        d_out = A.to_device(np.zeros((T, H), dtype=bf16))
        kern.ep_combine(A.to_device(y), None if weights is None else A.to_device(weights),
                        got[1], n, T, (1, T - 1), d_out)
        part = A.to_host(d_out)
        assert np.array_equal(part[1:T - 1].view(np.uint16), ref[1:T - 1].view(np.uint16))
        assert not part[[0, T - 1]].view(np.uint16).any()
    assert not np.isnan(out.astype(np.float32)).any()
    assert np.array_equal(out.view(np.uint16), ref.view(np.uint16)) or \
        S.rel_err(out.astype(np.float32), ref.astype(np.float32)) <= 1e-2


@pytest.mark.gpu
def test_cupy_count_experts_is_exact():
    kern, C = _cupy_kernels()
    import cupy

    ids = _ids(4096, 256, 8, seed=2)
    ids[0, 0] = -1
    counts = cupy.zeros(256, dtype=cupy.int64)
    kern.ep_count_experts(A.to_device(ids), counts)
    kern.ep_count_experts(A.to_device(ids), counts)
    assert A.to_host(counts).tolist() == (2 * np.bincount(ids[ids >= 0], minlength=256)).tolist()


# ----------------------------------------------------------------------------- CPU emulation
# ep_layout.cu on the CPU emulator (one std::thread per CUDA thread): the kernels' logic
# against the NumPy twins, without a GPU.
ENTRY = r"""
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
DEFINES = {"SCALAR_T": "float", "LAYOUT_THREADS": 64, "GATHER_THREADS": 32,
           "COMBINE_THREADS": 32, "COUNT_THREADS": 32}


@pytest.fixture(scope="module")
def emulated_ep(tmp_path_factory):
    return build_library(tmp_path_factory.mktemp("ep_layout"), "ep_layout.cu", DEFINES, ENTRY)


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
        lib.layout(ptr(ids), ptr(inv), ptr(src), ptr(counts2), ptr(n_real), T, K, S, W, epr,
                   int(slot), rank, C, nt, smem)
        for g, w in zip((counts2, inv, src, n_real), want):
            np.testing.assert_array_equal(g, w)
    n = int(n_real[0])
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    xs = np.full((T * S, H), np.nan, np.float32)
    meta = (T * S,) if slot else (T * S, K)
    i_s, w_s = np.full(meta, -7, np.int32), np.full(meta, np.nan, np.float32)
    lib.gather(ptr(x), ptr(ids), ptr(w), ptr(inv), ptr(n_real), ptr(xs), ptr(i_s), ptr(w_s), T,
               K, S, epr, int(slot), H)
    hx, hi, hw = L.ep_gather(x, ids, w, inv, n_real, epr, slot)
    np.testing.assert_array_equal(xs[:n], hx[:n])
    np.testing.assert_array_equal(i_s[:n], hi[:n])
    np.testing.assert_array_equal(w_s[:n], hw[:n])
    y = rng.standard_normal((n, H)).astype(np.float32)
    weights = w if slot else None
    for vec in (1, 4):
        out = np.full((T, H), np.nan, np.float32)
        lib.combine(ptr(y), ptr(weights), ptr(inv), ptr(out), 0, T, S, H, n, vec)
        np.testing.assert_array_equal(out, L.ep_combine(y, weights, inv, n, T))
    if T > 2:   # a token range: the other rows stay as they were
        out = np.full((T, H), 5.0, np.float32)
        lib.combine(ptr(y), ptr(weights), ptr(inv), ptr(out), 1, T - 1, S, H, n, 4)
        np.testing.assert_array_equal(out[1:T - 1], L.ep_combine(y, weights, inv, n, T)[1:T - 1])
        assert (out[[0, T - 1]] == 5.0).all()
    counts = np.zeros(E, np.uint64)
    lib.count(ptr(ids), ptr(counts), ids.size, E, 2)
    np.testing.assert_array_equal(counts, np.bincount(ids[ids >= 0], minlength=E))
