"""Expert-parallel dispatch + combine over NCCL, beside a raw NCCL all-to-all of the same
bytes, and the whole EP layer beside the single-GPU layer.

    W GPUs (one process each, NCCL through cupy.cuda.nccl), T tokens per rank,
    DeepSeek-V3's MoE: H = 7168, K = 8 of E = 256 experts, I = 2048, bf16 (b = 2 bytes)

What is timed (CUDA events on each rank after warm-up, every repetition starting from a
barrier, fresh inputs and routing per repetition from a rotating pool, the L2 flushed;
the median per rank, then the slowest rank, which is what a step waits for):

  alltoall   for each row mode (--alltoall-rows; "token": one row per (token, destination
             rank), the layer's default; "slot": one row per (token, slot)):
             dispatch   the send table and counts (device) + counts exchange on a side
                        stream (one host sync) + moe_permute by destination + all_to_all_v
                        of the n rows this rank sends and their metadata
             combine    all_to_all_v of the n result rows back + moe_unpermute
             exchange   the all_to_all_v of the n rows alone (counts known, buffers ready)
             raw        ncclSend/ncclRecv all-to-all with EQUAL splits of the same rows (the
                        busiest rank's n; one group, preallocated buffers: what
                        cupyx.distributed does); and once per T of the P = T*K slot rows
  allgather  dispatch   all_gather of x [T, H] and of the routing [T, 2K] (+ a token-count
                        all_gather, host sync)
             combine    reduce_scatter (bf16 sum) of the [W, T, H] partial outputs
             raw        ncclAllGather + ncclReduceScatter of the same sizes
  layer      EP forward (route, dispatch, the local experts' grouped GEMMs, combine) for
             both schemes, and the single-GPU layer (route + all E experts on one GPU) on
             the same T tokens; rank 0's EP output is compared with the single-GPU output.

Bandwidth is "algorithm bandwidth" per rank: the bytes this rank's send buffer holds
divided by the time (NCCL's algbw; the issue's 416 / 590 GB/s are this number).
    alltoall dispatch / combine / exchange / raw: n * H * b bytes (the self chunk included;
    n = P for slot rows, about T * min(W, K) for token rows)
    allgather dispatch: T * (H*b + 8K) bytes; combine: W * T * H * b bytes
Target (issue 6): the all-to-all-v path (dispatch + combine) at 4096 tokens per rank at
least 80% of the raw all-to-all of the same bytes: ratio = 2 * raw(n rows) / (dispatch +
combine), printed for the first row mode, beside the exchange-only ratio raw / exchange and
the ratio against the raw all-to-all of the P slot rows (what token rows save).

Implementations (--impls, the first is the target's): "fused" (sandbox/ep/layout.py +
cuda_kernels/cupy/ep_layout.cu, the default), "fusedC" (the combine in C token chunks, its
sums overlapping the next chunk's exchange), "fusedslow" ("fused" without its GPU plans: the
generic launchers and communicator calls, to compare), "fusedgf" ("fused" with the gather
launched before the counts exchange), "stages" (moe_permute / moe_unpermute).
--breakdown times each sub-step alone; every row also carries host_ms, the host's median
time inside the timed call (the launches, the counts sync): where GPU time is host-bound.

Run (two GPUs; about two minutes; results in ./moe-sandbox-results/, or --out DIR):
    .venv/bin/python benchmarks/bench_ep.py --gpus 2
    .venv/bin/python benchmarks/bench_ep.py --gpus 8 --tokens 128,4096 --no-layer
    .venv/bin/python benchmarks/bench_ep.py --gpus 2 --no-layer --schemes alltoall \
        --impls fused,fused2,stages --breakdown
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from sandbox.bench import add_out_dir  # noqa: E402
from sandbox.ep import launch  # noqa: E402

DEEPSEEK_V3 = dict(hidden_size=7168, top_k=8, num_experts=256, intermediate_size=2048,
                   dtype="bfloat16")


# ---------------------------------------------------------------------------------------
# helpers that run inside a rank
# ---------------------------------------------------------------------------------------
def _stage_ops(comm, which="cupy"):
    """The CuPy stage functions (through the registry when it reports them usable), or with
    which="reference" the NumPy reference run on the host around each call (slow: only for
    checking the harness, or comm-only numbers where the kernels are broken)."""
    from sandbox.registry import get_backend

    if which == "reference":
        from sandbox.ep.layer import _OnHost

        return _OnHost(get_backend("reference"), comm), "reference on the host"
    b = get_backend("cupy")
    if b.ok:
        return b, "cupy"
    import cuda_kernels.cupy as ops  # the permute kernels may work even if a stage is missing

    return ops, f"cupy module (registry: {b.reason})"


def _rand_bf16(cupy, shape, seed, scale=1.0):
    """Random bf16 on the device without bf16 arithmetic: fp32 normals, top 16 bits."""
    import ml_dtypes

    rs = cupy.random.RandomState(seed)
    f = rs.standard_normal(shape, dtype=cupy.float32) * cupy.float32(scale)
    bits = (f.view(cupy.uint32) >> 16).astype(cupy.uint16)
    try:
        return bits.view(np.dtype(ml_dtypes.bfloat16))
    except Exception:
        return bits


def _random_routing(cupy, T, E, K, seed):
    """K distinct uniform experts per token and renormalised random weights."""
    rs = cupy.random.RandomState(seed)
    ids = cupy.argsort(rs.random_sample((T, E), dtype=cupy.float32), axis=1)[:, :K]
    w = rs.random_sample((T, K), dtype=cupy.float32) + cupy.float32(0.1)
    return (w / w.sum(axis=1, keepdims=True)).astype(cupy.float32), ids.astype(cupy.int32)


class _Timer:
    """Per-repetition CUDA-event timing across ranks: every repetition starts from a barrier
    and ends at the communicator's synchronize (which polls with its timeout: a lost peer
    raises, never hangs). The EP benchmark keeps its own event loops (this and _local_timer):
    cuda_kernels/timing.py waits with a device-wide synchronize, which under the CPU tests'
    fake NCCL drives the other rank's pending collective."""

    def __init__(self, comm, flush_bytes=256 << 20):
        import cupy

        self.comm, self.cupy = comm, cupy
        self.flush = cupy.empty(flush_bytes // 4, dtype=cupy.float32)

    def run(self, fn, reps, warmup):
        cupy, comm = self.cupy, self.comm
        for i in range(warmup):
            fn(i)
        comm.synchronize()
        times, host = [], []
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        for i in range(reps):
            self.flush.fill(i)              # evict the inputs from the 50 MB L2
            comm.barrier()                  # every rank starts together
            start.record()
            t0 = time.perf_counter()
            fn(warmup + i)
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            comm.synchronize()              # polls with the communicator's timeout
            times.append(cupy.cuda.get_elapsed_time(start, end))
        self.last_host_ms = float(np.median(host))   # the host's time inside fn (launches,
        return float(np.median(times)), [float(t) for t in times]   # syncs): the breakdown's


def _raw_alltoall(comm, timer, opts, rows, H):
    """Median ms of a raw ncclSend/ncclRecv all-to-all with EQUAL splits of `rows` rows of
    H bf16 (self chunk through NCCL too; one group, buffers ready: cupyx.distributed's
    all_to_all)."""
    import cupy

    W = comm.world_size
    chunk = -(-rows // W)
    send_buf = cupy.zeros((W * chunk, H), dtype=cupy.uint16)
    recv_buf = cupy.empty_like(send_buf)

    def raw_a2a(i):
        with comm.group():
            for p in range(W):
                comm.send(send_buf[p * chunk:(p + 1) * chunk], p)
                comm.recv(recv_buf[p * chunk:(p + 1) * chunk], p)

    t, _ = timer.run(raw_a2a, opts["reps"], opts["warmup"])
    return t, W * chunk


def _impl_spec(spec):
    """"fused" / "fused4" / "fusedslow" / "stages" -> (impl, combine_chunks or None).
    "fusedslow" is "fused" without the GPU plans (dispatch.GPU_PLANS off while it runs)."""
    if spec.startswith("fused") and spec[5:].isdigit():
        return "fused", int(spec[5:])
    if spec in ("fusedslow", "fusedgf"):
        return "fused", None
    return spec, None


class _Plans:
    """dispatch.GPU_PLANS / COUNTS_FIRST for one implementation's rows ("fusedslow": no
    plans; "fusedgf": the gather launched before the counts exchange), restored after."""

    def __init__(self, spec):
        self.flags = {"GPU_PLANS": spec != "fusedslow", "COUNTS_FIRST": spec != "fusedgf"}

    def __enter__(self):
        from sandbox.ep import dispatch as D

        self.old = {k: getattr(D, k) for k in self.flags}
        for k, v in self.flags.items():
            setattr(D, k, v)

    def __exit__(self, *exc):
        from sandbox.ep import dispatch as D

        for k, v in self.old.items():
            setattr(D, k, v)


def _breakdown(comm, timer, ops, opts, record, mode, spec, T, xs, routes, per_rank):
    """Each sub-step of dispatch / combine timed alone (CUDA events from a barrier, and the
    host time inside the step): where the time of the whole goes. Routing 0, buffers kept."""
    import cupy

    from sandbox.ep import dispatch as D
    from sandbox.ep.layout import layout_ops
    from sandbox.ep.wire import raw, view_as

    W, r = comm.world_size, comm.rank
    x, (w, ids) = xs[0], routes[0]
    H = x.shape[1]
    slot = mode == "slot"
    st = {}
    steps = []
    impl, chunks = _impl_spec(spec)
    if chunks is not None:   # the steps are those of "fused"; only the whole differs
        return
    lay = layout_ops(comm) if impl == "fused" else None
    if impl == "fused" and D.GPU_PLANS and hasattr(lay, "DispatchPlan") and \
            hasattr(comm, "p2p_group"):
        # the GPU plans' steps (what alltoall_dispatch runs on a GPU by default)
        g = D._gpu_fused(comm, lay, x, ids, per_rank, w, mode, 1)

        def layout(i):
            st["inv"] = g.plan.layout(ids)

        def gather(i):
            g.plan.gather(x, ids, w, st["inv"])

        def counts(i):
            g.laid_out.record(g.stream)
            comm.counts_gather_start(g.send_counts_dev, g.gathered, g.pinned_all, g.laid_out,
                                     g.counted, g.pinned_all_ptr)
            comm.wait_done(g.counted, "all_to_all_v (counts)")
            st["c"] = g.pinned_all.tolist()

        steps = [("layout kernel", layout), ("gather kernel", gather),
                 ("counts exchange + host sync", counts)]
    elif impl == "fused":

        def layout(i):
            st["lay"] = lay.ep_layout(ids, per_rank, W, r, slot)

        def gather(i):
            _, inv, _, n_real = st["lay"]
            st["g"] = lay.ep_gather(xs[0], ids, w, inv, n_real, per_rank, slot)

        def counts(i):
            c2 = st["lay"][0]
            st["c"] = comm.counts_phase_async(c2[0], both=c2).wait()

        steps = [("layout kernel", layout), ("gather kernel", gather),
                 ("counts exchange + host sync", counts)]
    else:
        xp = cupy

        def table(i):
            dest = ids // per_rank
            st["t"] = D._token_table(xp, dest, W) if not slot else \
                (dest, D._rank_counts(xp, dest, W))

        def permute(i):
            tab = st["t"][0]
            st["p"] = ops.moe_permute(xs[0], tab, W + 1 if not slot else W)

        def counts(i):
            st["c"] = comm.counts_phase_async(st["t"][1]).wait()

        steps = [("table + counts (array ops)", table), ("moe_permute", permute),
                 ("counts exchange + host sync", counts)]
    for name, fn in steps:
        fn(0)
        t, _ = timer.run(fn, opts["reps"], opts["warmup"])
        record(T, "alltoall", f"  step: {name} ({mode} rows, {impl})", t, 0,
               {"rows": mode, "impl": impl, "host_ms": timer.last_host_ms, "breakdown": True})
    # the whole dispatch / combine with the host time beside the GPU time
    d = D.alltoall_dispatch(comm, ops, x, ids, per_rank, topk_weights=w, rows=mode, impl=impl)
    x_recv, _, _, s_ = d
    sc, rc = s_.send_counts, s_.recv_counts
    n = int(sc.sum())
    back = cupy.empty((n, H), dtype=cupy.uint16)
    yr = raw(x_recv)
    t, _ = timer.run(lambda i: comm.all_to_all_v(yr, rc, recv_counts=sc, outs=back),
                     opts["reps"], opts["warmup"])
    record(T, "alltoall", f"  step: combine exchange ({mode} rows, {impl})", t, n * H * 2,
           {"rows": mode, "impl": impl, "host_ms": timer.last_host_ms, "breakdown": True})
    if impl == "fused" and s_.gpu is not None:    # the plan's combine launch
        cp = lay.CombinePlan(T, s_.width, H, x.dtype)
        wts = w if slot else None
        out = cupy.empty((T, H), dtype=x.dtype)
        fn = lambda i: cp(view_as(back, x.dtype), wts, s_.inv, n, out)  # noqa
        name = "combine kernel"
    elif impl == "fused":
        wts = w if slot else None
        fn = lambda i: lay.ep_combine(view_as(back, x.dtype), wts, s_.inv, n, T)  # noqa
        name = "combine kernel"
    else:
        wts = w if slot else s_.combine_weights
        full = cupy.zeros((T * s_.width, H), dtype=cupy.uint16)
        fn = lambda i: ops.moe_unpermute(view_as(full, x.dtype), wts, s_.inv)  # noqa
        name = "moe_unpermute"
    t, _ = timer.run(fn, opts["reps"], opts["warmup"])
    record(T, "alltoall", f"  step: {name} ({mode} rows, {impl})", t, 0,
           {"rows": mode, "impl": impl, "host_ms": timer.last_host_ms, "breakdown": True})


def _bench_alltoall_rows(comm, timer, ops, opts, record, mode, T, xs, routes, per_rank,
                         raw_slot_t, P, spec="fused"):
    """dispatch / combine / both / exchange only of the all-to-all-v path with `mode` rows
    ("token": one row per (token, destination rank); "slot": one per (token, slot)), beside
    a raw all-to-all of the bytes this path actually moves."""
    import cupy

    from sandbox.ep.dispatch import alltoall_combine, alltoall_dispatch

    pool = len(xs)
    H = xs[0].shape[1]
    row_bytes = H * 2
    state = {}
    impl, chunks = _impl_spec(spec)

    def dispatch(i):
        w, ids = routes[i % pool]
        state["d"] = alltoall_dispatch(comm, ops, xs[i % pool], ids, per_rank,
                                       topk_weights=w, rows=mode, impl=impl,
                                       combine_chunks=chunks)

    def combine(i):
        x_recv, _, _, st = state["d"]     # y has x_recv's shape [R, H] in either mode
        state["out"] = alltoall_combine(comm, ops, x_recv, st, routes[i % pool][0])

    def both(i):
        dispatch(i)
        combine(i)

    disp, _ = timer.run(dispatch, opts["reps"], opts["warmup"])
    disp_host = timer.last_host_ms
    dispatch(0)
    comb, _ = timer.run(lambda i: combine(0), opts["reps"], opts["warmup"])
    comb_host = timer.last_host_ms
    both_t, _ = timer.run(both, opts["reps"], opts["warmup"])

    # the rows exchange alone: the counts of routing 0, buffers ready, no gather
    st = state["d"][3]
    n = int(st.send_counts.sum())
    send_rows = cupy.zeros((n, H), dtype=cupy.uint16)
    recv_rows = cupy.empty((int(st.recv_counts.sum()), H), dtype=cupy.uint16)
    exch, _ = timer.run(lambda i: comm.all_to_all_v(send_rows, st.send_counts,
                                                    recv_counts=st.recv_counts,
                                                    outs=recv_rows),
                        opts["reps"], opts["warmup"])
    # the raw all-to-all of the same bytes: the rows the busiest rank sends (with routing 0)
    n_max = int(max(comm.all_gather_host(np.array([n], dtype=np.int64)).reshape(-1)))
    cache = opts.setdefault("_raw_cache", {})      # one raw run per (T, rows), any impl
    if n_max == P:
        cache[(T, n_max)] = raw_slot_t
    if (T, n_max) not in cache:
        cache[(T, n_max)] = _raw_alltoall(comm, timer, opts, n_max, H)
    raw_t, raw_rows = cache[(T, n_max)]
    nb = n * row_bytes
    impl = spec                      # the name the rows carry: fused, fused2, stages, ...
    tag = f" ({mode} rows, {impl})"
    ex_host = timer.last_host_ms
    raw_row = record(T, "alltoall", "raw NCCL all-to-all (same bytes)" + tag, raw_t,
                     raw_rows * row_bytes, {"rows": mode, "impl": impl,
                                            "rows_per_rank": raw_rows})
    ex = record(T, "alltoall", "exchange only (all_to_all_v)" + tag, exch, nb,
                {"rows": mode, "impl": impl, "host_ms": ex_host})
    d = record(T, "alltoall", "dispatch" + tag, disp, nb,
               {"rows": mode, "impl": impl, "host_ms": disp_host})
    c = record(T, "alltoall", "combine" + tag, comb, nb,
               {"rows": mode, "impl": impl, "host_ms": comb_host})
    b = record(T, "alltoall", "dispatch+combine" + tag, both_t, 2 * nb,
               {"rows": mode, "impl": impl, "rows_sent": n, "slot_rows": P})
    for row in (ex, d, c):
        row["vs_raw"] = raw_row["ms"] / row["ms"]
    # the ratio: dispatch + combine against two raw all-to-alls of the same bytes
    b["vs_raw"] = 2 * raw_row["ms"] / b["ms"]
    b["exchange_vs_raw"] = ex["vs_raw"]
    # against the raw all-to-all of the per-slot bytes (P rows): what token rows save
    b["vs_raw_slot_bytes"] = 2 * raw_slot_t[0] / b["ms"]


def _gather_medians(comm, value):
    """Every rank's median (ms) -> [W] on every rank."""
    return comm.all_gather_host(np.array([value], dtype=np.float64)).reshape(-1).tolist()


def bench_rank(comm, opts):
    """Runs in every rank; rank 0's return value is the report."""
    import cupy

    from sandbox.ep.dispatch import allgather_combine, allgather_dispatch
    from sandbox.ep.wire import raw, view_as

    W, r = comm.world_size, comm.rank
    H, K, E, I = (opts["shape"][k] for k in ("hidden_size", "top_k", "num_experts",
                                             "intermediate_size"))
    per_rank = E // W
    ops, ops_name = _stage_ops(comm, opts.get("stage_ops", "cupy"))
    timer = _Timer(comm, opts.get("flush_mb", 256) << 20)
    rows = []
    pool = opts["pool"]

    def record(T, scheme, phase, med, nbytes, extra=None):
        meds = _gather_medians(comm, med)
        row = {"tokens_per_rank": T, "scheme": scheme, "phase": phase,
               "ms": max(meds), "ms_per_rank": meds, "bytes_per_rank": int(nbytes),
               "GBps_per_rank": (nbytes / (max(meds) * 1e-3) / 1e9) if nbytes else None}
        row.update(extra or {})
        rows.append(row)
        return row

    for T in opts["tokens"]:
        xs = [_rand_bf16(cupy, (T, H), 1000 * r + j) for j in range(pool)]
        routes = [_random_routing(cupy, T, E, K, 7000 * r + j) for j in range(pool)]
        P = T * K
        row_bytes = H * 2

        # ---- all-to-all-v ----------------------------------------------------------------
        if "alltoall" in opts["schemes"]:
            # the raw all-to-all of the per-slot bytes (P rows): the yardstick of slot rows,
            # and the effective comparison for token rows (which move fewer bytes)
            raw_slot_t = _raw_alltoall(comm, timer, opts, P, H)
            record(T, "alltoall", "raw NCCL all-to-all (slot bytes, P rows)", raw_slot_t[0],
                   raw_slot_t[1] * row_bytes, {"rows_per_rank": raw_slot_t[1]})
            for impl in opts.get("impls", ["fused"]):
                for mode in opts.get("alltoall_rows", ["token", "slot"]):
                    with _Plans(impl):
                        _bench_alltoall_rows(comm, timer, ops, opts, record, mode, T, xs,
                                             routes, per_rank, raw_slot_t, P, impl)
                        if opts.get("breakdown"):
                            _breakdown(comm, timer, ops, opts, record, mode, impl, T, xs,
                                       routes, per_rank)

        # ---- all-gather / reduce-scatter ------------------------------------------------
        if "allgather" in opts["schemes"]:
            state = {}

            def ag_dispatch(i):
                w, ids = routes[i % pool]
                state["d"] = allgather_dispatch(comm, xs[i % pool], w, ids)

            def ag_combine(i):
                x_all, _, _, st = state["d"]
                state["out"] = allgather_combine(comm, x_all, st)   # partial = x_all's shape

            def ag_both(i):
                ag_dispatch(i)
                ag_combine(i)

            disp, _ = timer.run(ag_dispatch, opts["reps"], opts["warmup"])
            ag_dispatch(0)
            comb, _ = timer.run(lambda i: ag_combine(0), opts["reps"], opts["warmup"])
            both, _ = timer.run(ag_both, opts["reps"], opts["warmup"])
            x_raw = raw(xs[0])
            rs_in = view_as(cupy.zeros((W, T, H), dtype=cupy.uint16), xs[0].dtype)

            def raw_ag(i):
                comm.all_gather(x_raw)
                comm.reduce_scatter(rs_in)

            raw_t, _ = timer.run(raw_ag, opts["reps"], opts["warmup"])
            nb_d, nb_c = T * (row_bytes + 8 * K), W * T * row_bytes
            raw_row = record(T, "allgather", "raw ncclAllGather + ncclReduceScatter", raw_t,
                             T * row_bytes + nb_c)
            record(T, "allgather", "dispatch", disp, nb_d)
            record(T, "allgather", "combine", comb, nb_c)
            b = record(T, "allgather", "dispatch+combine", both, nb_d + nb_c)
            b["vs_raw"] = raw_row["ms"] / b["ms"]
            del state

    layer_rows, layer_note = [], None
    if opts["layer"]:
        try:
            layer_rows = _bench_layer(comm, opts, timer, ops, ops_name)
        except Exception as exc:  # the dispatch numbers stand on their own
            layer_note = f"layer benchmark failed on rank {r}: {type(exc).__name__}: {exc}"
            notes = comm.all_gather_host(np.frombuffer(
                layer_note.encode()[:400].ljust(400), dtype=np.uint8))
            layer_note = "; ".join(bytes(n).decode(errors="replace").strip() for n in notes)
    comm.barrier()
    if r != 0:
        return None
    props = cupy.cuda.runtime.getDeviceProperties(comm.device)
    return {"gpu": props["name"].decode() if isinstance(props["name"], bytes) else
            str(props["name"]), "world_size": W, "stage_ops": ops_name,
            "nccl_version": _nccl_version(), "impls": list(opts.get("impls", ["fused"])),
            "rows": rows, "layer": layer_rows,
            "layer_note": layer_note}


def _nccl_version():
    try:
        from cupy.cuda import nccl

        return nccl.get_version()
    except Exception:
        return None


def _bench_layer(comm, opts, timer, ops, ops_name):
    """EP forward (both schemes) and the single-GPU layer on the same tokens."""
    import cupy

    from sandbox.ep.layer import EPConfig, EPMoE

    from sandbox.ep.wire import raw, view_as

    W, r = comm.world_size, comm.rank
    shape = opts["shape"]
    H, E, I = shape["hidden_size"], shape["num_experts"], shape["intermediate_size"]
    per_rank = E // W
    # expert e's weights come from seed 10_000 + e, so rank r's slice equals the
    # single-GPU layer's experts [r*E/W, (r+1)*E/W) (linear placement)
    def w13_of(experts):
        out = cupy.empty((len(experts), 2 * I, H), dtype=cupy.uint16)
        for j, e in enumerate(experts):
            out[j] = raw(_rand_bf16(cupy, (2 * I, H), 10_000 + e, scale=H ** -0.5))
        return out

    def w2_of(experts):
        out = cupy.empty((len(experts), H, I), dtype=cupy.uint16)
        for j, e in enumerate(experts):
            out[j] = raw(_rand_bf16(cupy, (H, I), 20_000 + e, scale=I ** -0.5))
        return out

    bf16 = np.dtype(__import__("ml_dtypes").bfloat16)
    mine = list(range(r * per_rank, (r + 1) * per_rank))
    w13 = view_as(w13_of(mine), bf16)
    w2 = view_as(w2_of(mine), bf16)
    rows = []
    base = None
    for T in opts["layer_tokens"]:
        xs = [_rand_bf16(cupy, (T, H), 500 + 31 * r + j) for j in range(opts["pool"])]
        logits = [cupy.random.RandomState(900 + 31 * r + j).standard_normal(
            (T, E), dtype=cupy.float32) for j in range(opts["pool"])]
        outs = {}
        if base is None:  # one layer (its host weight store is big); schemes are twins
            base = EPMoE(comm, EPConfig(**shape, scheme=opts["schemes"][0]),
                         backend="reference" if opts.get("stage_ops") == "reference" else "cupy",
                         host_weights=False)   # random device weights, no 11 GB host copy
            base.set_device_parameters(w13_weight=w13, w2_weight=w2)
        for scheme in opts["schemes"]:
            layer = base.with_scheme(scheme)
            med, _ = timer.run(lambda i: layer.forward(xs[i % len(xs)], logits[i % len(xs)]),
                               opts["layer_reps"], opts["layer_warmup"])
            meds = _gather_medians(comm, med)
            outs[scheme] = layer.forward(xs[0], logits[0])
            rows.append({"tokens_per_rank": T, "what": f"EP layer forward ({scheme})",
                         "ms": max(meds), "ms_per_rank": meds,
                         "tokens_per_s": W * T / (max(meds) * 1e-3)})
        # the single-GPU layer (all E experts on rank 0's GPU), rank 0's tokens
        if r == 0:
            full13 = view_as(cupy.concatenate([raw(w13), w13_of(range(per_rank, E))]), bf16)
            full2 = view_as(cupy.concatenate([raw(w2), w2_of(range(per_rank, E))]), bf16)

            def single(i):
                return _single_gpu_forward(ops, xs[i % len(xs)], logits[i % len(xs)], full13,
                                           full2, shape)

            med, _ = _local_timer(cupy, single, opts["layer_reps"], opts["layer_warmup"])
            ref = single(0)
            errs = {s: _rel_err(cupy, o, ref) for s, o in outs.items()}
            rows.append({"tokens_per_rank": T, "what": "single-GPU layer forward",
                         "ms": med, "tokens_per_s": T / (med * 1e-3),
                         "ep_vs_single_rel_error": errs})
            del full13, full2
        comm.barrier()
    return rows


def _local_timer(cupy, fn, reps, warmup):
    """(median ms, [ms]) of fn(i) on this rank's GPU alone: CUDA events, each rep waited on
    by its own event (not a device-wide synchronize: the other rank meanwhile waits in a
    collective, which a device synchronize would drive under the CPU tests' fake NCCL)."""
    for i in range(warmup):
        fn(i)
    cupy.cuda.get_current_stream().synchronize()
    times = []
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    for i in range(reps):
        start.record()
        fn(warmup + i)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times)), times


def _rel_err(cupy, out, ref):
    from sandbox.ep.wire import raw

    def f32(a):
        return (raw(a).astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)

    a, b = f32(out), f32(ref)
    return float(cupy.linalg.norm(a - b) / cupy.linalg.norm(b))


def _single_gpu_forward(ops, x, logits, w13, w2, shape):
    """The FusedMoE forward on one GPU with the same stages: route, align, GEMM1,
    activation, GEMM2 (* router weight), sum over K."""
    K, E, H = shape["top_k"], shape["num_experts"], shape["hidden_size"]
    w, ids, _ = ops.select_experts(x, logits, K, False, True, global_num_experts=E)
    T = x.shape[0]
    cfg = None
    try:
        cfg = ops.gemm_config(T, w13.shape[1], H, E, K, x.dtype)
    except Exception:
        pass
    B = int(cfg["BLOCK_M"]) if cfg and cfg.get("BLOCK_M") else 64
    sorted_ids, expert_ids, ntpp = ops.moe_align_block_size(ids, B, E)
    c1 = ops.grouped_gemm(x, w13, sorted_ids, expert_ids, ntpp, K, B, w, False, None)
    c2 = ops.apply_activation(c1, "silu", True)
    c3 = ops.grouped_gemm(c2, w2, sorted_ids, expert_ids, ntpp, 1, B, w, True, None)
    return ops.moe_sum(c3.reshape(T, K, H))


# ---------------------------------------------------------------------------------------
# the driver (no CUDA in this process: the ranks are spawned)
# ---------------------------------------------------------------------------------------
def _commit():
    from sandbox.bench import git_commit   # one source of truth (MOE_SANDBOX_COMMIT on the GPU)
    return git_commit() or None


def _target(report, modes):
    """The issue's ratio at the largest token count: dispatch + combine of the all-to-all-v
    path (the first rows mode: the layer's default) against two raw NCCL all-to-alls of the
    same bytes; with the exchange-only ratio and every mode's numbers beside it."""
    both = [row for row in report["rows"] if row["scheme"] == "alltoall"
            and row["phase"].startswith("dispatch+combine")]
    if not both:
        return None
    impls = report.get("impls") or [None]
    impl = impls[0]   # the first implementation (the default, "fused") is the target's
    others = {}
    for row in both:
        if impl is not None and row.get("impl", impl) != impl:
            key = f"{row['rows']} rows, {row['impl']}"
            others.setdefault(key, {})[row["tokens_per_rank"]] = {
                "ms": row["ms"], "ratio": row["vs_raw"]}
    both = [row for row in both if impl is None or row.get("impl", impl) == impl]
    T = max(row["tokens_per_rank"] for row in both)
    by_rows = {row["rows"]: {"ms": row["ms"], "ratio": row["vs_raw"],
                             "exchange_ratio": row["exchange_vs_raw"],
                             "ratio_vs_slot_bytes": row["vs_raw_slot_bytes"],
                             "rows_sent": row["rows_sent"], "slot_rows": row["slot_rows"]}
               for row in both if row["tokens_per_rank"] == T}
    mode = modes[0] if modes[0] in by_rows else next(iter(by_rows))
    main = by_rows[mode]
    return {"tokens_per_rank": T, "rows": mode, "impl": impl, "ratio": main["ratio"],
            "other_impls": others,
            "exchange_ratio": main["exchange_ratio"],
            "ratio_vs_slot_bytes": main["ratio_vs_slot_bytes"], "met": main["ratio"] >= 0.8,
            "definition": "2 x raw NCCL all-to-all (equal splits) of the rows this path sends "
                          "/ (dispatch + combine)", "by_rows": by_rows}


def print_table(report):
    print(f"\n{report['gpu']} x{report['world_size']}  (NCCL {report['nccl_version']}, "
          f"stages: {report['stage_ops']})")
    print(f"{'T/rank':>7} {'scheme':>9} {'phase':<50} {'ms':>9} {'GB/s/rank':>10} {'vs raw':>7}")
    for row in report["rows"]:
        gbps = f"{row['GBps_per_rank']:.1f}" if row.get("GBps_per_rank") else ""
        vs = f"{row['vs_raw']:.2f}" if row.get("vs_raw") is not None else ""
        hostms = f"  host {row['host_ms']:.3f} ms" if row.get("host_ms") is not None else ""
        print(f"{row['tokens_per_rank']:>7} {row['scheme']:>9} {row['phase']:<50} "
              f"{row['ms']:>9.3f} {gbps:>10} {vs:>7}{hostms}")
    for row in report.get("layer", []):
        extra = ""
        if "ep_vs_single_rel_error" in row:
            extra = "  EP vs single rel. err " + ", ".join(
                f"{k} {v:.2e}" for k, v in row["ep_vs_single_rel_error"].items())
        print(f"{row['tokens_per_rank']:>7} {'layer':>9} {row['what']:<50} {row['ms']:>9.3f} "
              f"{row['tokens_per_s'] / 1e3:>9.1f}k tok/s{extra}")
    if report.get("layer_note"):
        print("layer:", report["layer_note"])
    t = report.get("target")
    if t:
        verdict = "met" if t["met"] else "NOT met"
        print(f"\ntarget (issue 6): all-to-all-v ({t['rows']} rows) dispatch+combine at "
              f"{t['tokens_per_rank']} tokens/rank = {t['ratio']:.2f} of two raw NCCL "
              f"all-to-alls of the same bytes (>= 0.80: {verdict}); exchange only "
              f"{t['exchange_ratio']:.2f}; vs the raw all-to-all of the per-slot bytes "
              f"{t['ratio_vs_slot_bytes']:.2f}")
        for mode, o in t.get("by_rows", {}).items():
            print(f"  {mode} rows: dispatch+combine {o['ms']:.3f} ms, {o['ratio']:.2f} of raw "
                  f"same bytes, exchange only {o['exchange_ratio']:.2f}, "
                  f"{o['rows_sent']} rows sent of {o['slot_rows']} slots")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=2, help="world size (one process per GPU)")
    ap.add_argument("--tokens", default="128,4096", help="tokens per rank, comma separated")
    ap.add_argument("--layer-tokens", default="128,4096",
                    help="tokens per rank for the whole-layer comparison")
    ap.add_argument("--schemes", default="alltoall,allgather")
    ap.add_argument("--alltoall-rows", default="token,slot",
                    help="all-to-all-v row modes, the first is the target's: token (one row "
                         "per token and destination rank) and/or slot (one per routed slot)")
    ap.add_argument("--impls", default="fused",
                    help="all-to-all-v implementations (sandbox/ep/dispatch.py), the first is "
                         "the target's: fused, fusedC (the combine in C token chunks, e.g. "
                         "fused2), fusedslow (fused without the GPU plans), fusedgf (gather "
                         "launched first) and/or stages")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time each sub-step of dispatch / combine alone (diagnostic)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--layer-reps", type=int, default=5)
    ap.add_argument("--layer-warmup", type=int, default=2)
    ap.add_argument("--pool", type=int, default=4, help="input/routing sets rotated per rep")
    ap.add_argument("--no-layer", action="store_true", help="skip the whole-layer comparison")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-exchange timeout (s)")
    ap.add_argument("--stage-ops", default="cupy", choices=("cupy", "reference"),
                    help="permute/unpermute/GEMM stages: CuPy kernels, or the NumPy reference "
                         "on the host (slow; harness checks only)")
    add_out_dir(ap, "--out")
    args = ap.parse_args(argv)
    if args.gpus < 1:
        ap.error(f"--gpus: expected a positive number of GPUs, got {args.gpus}")
    schemes = [s for s in args.schemes.split(",") if s]
    for s in schemes:
        if s not in ("alltoall", "allgather"):
            ap.error(f"--schemes: expected alltoall and/or allgather, got {s!r}")
    a2a_rows = [m for m in args.alltoall_rows.split(",") if m]
    for m in a2a_rows:
        if m not in ("token", "slot"):
            ap.error(f"--alltoall-rows: expected token and/or slot, got {m!r}")
    if not a2a_rows:
        ap.error("--alltoall-rows: expected at least one of token, slot")
    impls = [m for m in args.impls.split(",") if m]
    for m in impls:
        if m not in ("stages", "fusedslow", "fusedgf") and not (m.startswith("fused") and
                                                      (m[5:] == "" or m[5:].isdigit())):
            ap.error(f"--impls: expected fused, fusedC (C an int), fusedslow and/or stages, "
                     f"got {m!r}")
    if not impls:
        ap.error("--impls: expected at least one of fused, stages")
    if DEEPSEEK_V3["num_experts"] % args.gpus:
        ap.error(f"--gpus: {args.gpus} does not divide the {DEEPSEEK_V3['num_experts']} experts")
    opts = dict(shape=DEEPSEEK_V3, tokens=[int(t) for t in args.tokens.split(",") if t],
                layer_tokens=[int(t) for t in args.layer_tokens.split(",") if t],
                schemes=schemes, alltoall_rows=a2a_rows, impls=impls,
                breakdown=args.breakdown, reps=args.reps, warmup=args.warmup,
                layer_reps=args.layer_reps, layer_warmup=args.layer_warmup, pool=args.pool,
                layer=not args.no_layer, stage_ops=args.stage_ops)
    from cuda_kernels.cupy import availability

    ok, why = availability()
    if not ok:
        raise SystemExit(f"no GPU here ({why}): nothing to time")
    import cupy

    found = cupy.cuda.runtime.getDeviceCount()
    if found < args.gpus:
        raise SystemExit(f"--gpus: expected at most the {found} GPUs here, got {args.gpus}")
    t0 = time.time()
    results = launch(bench_rank, args.gpus, backend="nccl", args=(opts,), timeout=args.timeout,
                     run_timeout=3600)
    report = results[0]
    report["target"] = _target(report, opts["alltoall_rows"])
    report.update({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(), "command": " ".join([os.path.relpath(sys.argv[0], ROOT)]
                                                  + (argv if argv is not None else sys.argv[1:])),
        "shape": DEEPSEEK_V3, "options": opts, "seconds": round(time.time() - t0, 1),
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_PROTO")},
    })
    print_table(report)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = os.path.join(args.out, f"ep_{args.gpus}gpu_{stamp}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {os.path.relpath(path, ROOT)}")
    return report


if __name__ == "__main__":
    main()
