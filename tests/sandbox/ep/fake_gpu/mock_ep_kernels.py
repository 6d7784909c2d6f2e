"""Runs the GPU code path of the fused all-to-all-v (the launchers of
cuda_kernels/cupy/ep_layout.py, the chunked combine's streams) on the fake CuPy: each kernel
launch is replaced by its NumPy twin (sandbox/ep/layout.py) applied to the fake arrays'
buffers, so that the launchers' arguments, shapes, checks and the dispatch's GPU branch run on
a CPU. The kernels themselves are checked on a GPU (tests/cupy/test_ep_layout.py, -m gpu).
Imported by name in ranks spawned with this folder on sys.path (tests/sandbox/ep/test_fake_nccl.py).
"""
import numpy as np


def _arr(a):
    """The NumPy array behind a fake device array (None for a null pointer)."""
    return None if isinstance(a, np.integer) else a._a


def _mock_kernel(name, scalar_dtype, calls):
    import ml_dtypes

    from sandbox.ep import layout as L

    def layout(grid, block, args, shared_mem=0):
        ids, inv, src, counts2, n_real = (_arr(a) for a in args[:5])
        T, K, S, W, epr, slot, rank, nc = (int(a) for a in args[5:])
        assert grid == (1,) and block[0] % 32 == 0 and shared_mem <= 48 * 1024
        c2, i, s, n = L.ep_layout(ids, epr, W, rank, bool(slot), nc)
        assert c2.shape == counts2.shape and i.shape == inv.shape and S * T == inv.size
        counts2[...], inv[...], src[...], n_real[...] = c2, i, s, n

    def gather(grid, block, args, shared_mem=0):
        x, ids, w, inv, n_real, x_send, ids_send, w_send = (_arr(a) for a in args[:8])
        T, K, S, epr, slot, row_words = (int(a) for a in args[8:])
        assert grid == (T,) and x.shape[0] == T and x_send.shape[0] == T * S
        xs, i_s, w_s = L.ep_gather(x, ids, w, inv, n_real, epr, bool(slot))
        n = int(n_real[0])
        x_send[:n], ids_send[:n] = xs[:n], i_s[:n]
        if w_send is not None:
            w_send[:n] = w_s[:n]

    def combine(grid, block, args, shared_mem=0):
        y, w, inv, out = (_arr(a) for a in args[:4])
        t0, t1, S, H, n, chunks = (int(a) for a in args[4:])
        assert grid == ((t1 - t0) * chunks,)
        dt = np.dtype(scalar_dtype)
        yv, ov = y.view(dt), out.view(dt)       # bf16 travels as uint16
        T = inv.size // S if S else ov.shape[0]
        L.ep_combine(yv, w, inv, n, T, (t0, t1), ov)

    def count(grid, block, args, shared_mem=0):
        ids, counts = _arr(args[0]), _arr(args[1])
        L.ep_count_experts(ids, counts)

    del ml_dtypes
    fn = {"ep_layout_kernel": layout, "ep_count_experts_kernel": count}.get(name)
    if fn is None:
        fn = gather if name.startswith("ep_gather_kernel") else combine

    def call(grid, block, args, shared_mem=0):
        calls.append(name)
        return fn(tuple(grid), tuple(block), args, shared_mem)
    return call


def install():
    """Route the fused dispatch to cuda_kernels.cupy.ep_layout with mocked launches; returns
    the list of kernel names launched."""
    import cuda_kernels.cupy.ep_layout as K
    from sandbox.ep import layout as L

    calls = []
    K._kernel = lambda name, scalar_dtype=np.float32: _mock_kernel(name, scalar_dtype, calls)
    L._KERNELS[:] = [K]
    return calls


def run_impl_parity_mocked(comm, chunks=3):
    """sandbox.ep.checks.run_impl_parity through the mocked GPU launchers; also records the
    EPLB load through the counting kernel. Returns (results, kernel names launched)."""
    from sandbox.ep import dispatch as D
    from sandbox.ep.checks import run_impl_parity
    from sandbox.ep.eplb_runtime import LoadRecorder

    calls = install()
    res = run_impl_parity(comm, "reference")
    old = D.COMBINE_CHUNKS
    D.COMBINE_CHUNKS = chunks
    try:
        res += run_impl_parity(comm, "reference")
    finally:
        D.COMBINE_CHUNKS = old
    rec = LoadRecorder(16, comm.xp)
    ids = np.arange(24, dtype=np.int32).reshape(6, 4) % 16
    rec.record(comm.xp.asarray(ids))
    load_ok = comm.to_host(rec.counts).tolist() == np.bincount(ids.reshape(-1), minlength=16).tolist()
    return res, sorted(set(calls)), load_ok


def bench_rank_mocked(comm, opts):
    """benchmarks/bench_ep.py's rank function through the mocked GPU launchers."""
    import bench_ep

    install()
    return bench_ep.bench_rank(comm, opts)
