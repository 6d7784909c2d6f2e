"""The fused all-to-all-v layout: the NumPy twins (sandbox/ep/layout.py) against a loop, the
fused dispatch/combine against the stage path on the CPU communicator; multigpu: the two
implementations against each other over NCCL. The CuPy kernels against these NumPy twins:
tests/cupy/test_ep_layout.py.

    T tokens, K top-k, W ranks, epr experts per rank, S entries per token
"""
import numpy as np
import pytest

from sandbox.ep import launch
from sandbox.ep import layout as L
from sandbox.ep.checks import run_impl_parity
from tests.oracles import distinct_topk_ids
from tests.support import EP_LAYOUT_SHAPES as SHAPES


def _ids(T, E, K, seed):
    return distinct_topk_ids(np.random.default_rng(seed), T, E, K)


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


def _assert_fused_matches_stages(per_rank, lean):
    """run_impl_parity's reports, every rank's: the fused path ran and matched the stages and
    the loop; a second call of the same shape with the tokens permuted gave each token the
    same output, bit for bit; `lean`: the lean GPU path (plans, reused buffers) ran."""
    for res in (d for rank in per_rank for d in rank):
        assert res["impl"] == "fused", res
        assert res["x"] and res["ids"] and res["w"] and res["counts"], res
        assert res["out_vs_stages"] <= 1e-6 and res["chunked_vs_stages"] <= 1e-6, res
        assert res["chunked_x"], res
        assert not np.isnan(res["out_vs_loop"]) and res["out_vs_loop"] <= res["tolerance"], res
        assert res["reuse_vs_fused"] == 0.0 and res["lean"] == lean, res


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_matches_stages_on_cpu_communicator(world_size):
    _assert_fused_matches_stages(launch(run_impl_parity, world_size, timeout=60), lean=False)


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
    # the lean GPU path (plans, reused buffers) runs there
    _assert_fused_matches_stages(launch(run_impl_parity, 2, backend="nccl", args=(backend,),
                                        timeout=120), lean=True)
